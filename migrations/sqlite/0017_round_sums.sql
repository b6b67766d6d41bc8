-- A round's running sum (8 bytes a parameter in plain rounds, 4 in secure
-- ones) moves out of `rounds` into a table of its own. SQLite keeps a row's
-- columns in order and a model-sized value in a chain of overflow pages, so
-- with the sum inside `rounds` every read of a later column (the secure
-- stage, the deadlines) walked about a thousand pages per million
-- parameters, and every update of a round's counters or stage rewrote the
-- whole sum. Only folding and aggregation touch it now.
CREATE TABLE round_sums (
    round_id INTEGER PRIMARY KEY REFERENCES rounds (id),
    update_sum BLOB NOT NULL
);
INSERT INTO round_sums (round_id, update_sum)
    SELECT id, update_sum FROM rounds WHERE update_sum IS NOT NULL;
ALTER TABLE rounds DROP COLUMN update_sum;
