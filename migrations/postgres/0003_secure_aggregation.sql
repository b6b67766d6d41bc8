-- Secure aggregation (SecAgg+). A round of a secure job walks its
-- `secagg_stage` through advertise → share → collect → unmask while it is
-- `training`; plain rounds leave the secagg columns NULL.
-- Nothing here is an individual plaintext update: advertised public keys,
-- share ciphertexts sealed to other devices, shares revealed in Unmasking,
-- and (in rounds.update_sum) the masked running sum. All of it is deleted
-- when the round ends.
ALTER TABLE rounds ADD COLUMN secagg_stage TEXT;
ALTER TABLE rounds ADD COLUMN secagg_plan TEXT;
ALTER TABLE rounds ADD COLUMN secagg_seed BYTEA;
ALTER TABLE rounds ADD COLUMN stage_deadline_ms BIGINT;

ALTER TABLE participants ADD COLUMN secagg_keys BYTEA;
ALTER TABLE participants ADD COLUMN secagg_commitment BYTEA;
ALTER TABLE participants ADD COLUMN secagg_reveal BYTEA;

CREATE TABLE secagg_shares (
    round_id BIGINT NOT NULL REFERENCES rounds (id),
    to_device BIGINT NOT NULL,
    from_device BIGINT NOT NULL,
    ciphertext BYTEA NOT NULL,
    PRIMARY KEY (round_id, to_device, from_device)
);
