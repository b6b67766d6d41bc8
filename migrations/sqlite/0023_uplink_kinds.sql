-- An edge owes the cloud, for one cloud round, a training result and,
-- once the round's version exists, its devices' evaluation of it: one
-- uplink of each kind (`result`: a training or statistics sub-round's
-- weighted mean; `evaluation`: the sample-weighted mean of its devices'
-- evaluation reports). SQLite cannot drop a column's UNIQUE, so the table
-- is rebuilt with the pair as its key.
CREATE TABLE uplinks_by_kind (
    job_id INTEGER PRIMARY KEY REFERENCES jobs (id),
    cloud_round_id INTEGER NOT NULL,
    task_kind TEXT NOT NULL DEFAULT 'result',
    cloud_task TEXT NOT NULL,
    state TEXT NOT NULL DEFAULT 'collecting',
    partial BLOB,
    num_samples INTEGER,
    reason TEXT NOT NULL DEFAULT '',
    created_ms INTEGER NOT NULL,
    updated_ms INTEGER NOT NULL,
    UNIQUE (cloud_round_id, task_kind)
);
INSERT INTO uplinks_by_kind (job_id, cloud_round_id, cloud_task, state, partial, num_samples,
    reason, created_ms, updated_ms)
SELECT job_id, cloud_round_id, cloud_task, state, partial, num_samples, reason, created_ms,
    updated_ms FROM uplinks;
DROP TABLE uplinks;
ALTER TABLE uplinks_by_kind RENAME TO uplinks;
CREATE INDEX uplinks_by_state ON uplinks (state);
