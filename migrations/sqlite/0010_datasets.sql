-- Held-out datasets kept on the server for central evaluation. The bytes
-- are one blob in the blob store (`blob_key`, its SHA-256 `digest`): the
-- data file, then, for IDX and NPY, the labels file from byte `data_bytes`
-- on. See `server/src/store/datasets.rs`.
CREATE TABLE datasets (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    kind TEXT NOT NULL,
    samples INTEGER NOT NULL,
    sample_shape TEXT NOT NULL,
    classes INTEGER NOT NULL,
    size_bytes INTEGER NOT NULL,
    data_bytes INTEGER NOT NULL,
    digest TEXT NOT NULL,
    blob_key TEXT NOT NULL,
    created_unix_ms INTEGER NOT NULL
);

-- A round's central evaluation: `pending` from the round's success until
-- the server has evaluated its version, then `done` or `failed` (with the
-- reason). Rounds of jobs without a central dataset have none (NULL).
ALTER TABLE rounds ADD COLUMN central_eval_state TEXT;
ALTER TABLE rounds ADD COLUMN central_eval_error TEXT;
CREATE INDEX rounds_central_eval_pending ON rounds (central_eval_state)
    WHERE central_eval_state = 'pending';
