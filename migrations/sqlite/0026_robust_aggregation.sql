-- Robust aggregation. A robust round names its rule (NULL: the round
-- folds a running sum) and, once it is over and the updates it stored
-- in the blob store are deleted, when that was. A participant of a robust
-- round names the digest of the update it stored.
ALTER TABLE rounds ADD COLUMN robust_rule TEXT;
ALTER TABLE rounds ADD COLUMN updates_deleted_ms BIGINT;
ALTER TABLE participants ADD COLUMN update_digest TEXT;
