-- The running FedAvg sum (8 bytes per parameter) is read and rewritten by
-- every accepted update while the upload holds the round's row lock. With
-- the default storage, PostgreSQL ran pglz over the whole value on each
-- rewrite, which was the largest single cost of a fold; out of line and
-- uncompressed, a fold no longer pays for it.
ALTER TABLE rounds ALTER COLUMN update_sum SET STORAGE EXTERNAL;
