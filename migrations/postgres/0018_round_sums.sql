-- A round's running sum moves out of `rounds` into a table of its own, as on
-- SQLite (see migrations/sqlite/0017_round_sums.sql), so that both keep the
-- same schema: updating a round's counters or stage no longer writes a
-- new version of a row that carries the sum. Stored out of line and
-- uncompressed, as 0002 chose for the column it replaces.
CREATE TABLE round_sums (
    round_id BIGINT PRIMARY KEY REFERENCES rounds (id),
    update_sum BYTEA NOT NULL
);
ALTER TABLE round_sums ALTER COLUMN update_sum SET STORAGE EXTERNAL;
INSERT INTO round_sums (round_id, update_sum)
    SELECT id, update_sum FROM rounds WHERE update_sum IS NOT NULL;
ALTER TABLE rounds DROP COLUMN update_sum;
