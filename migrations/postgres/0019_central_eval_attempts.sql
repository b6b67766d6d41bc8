-- Central evaluation runs in a worker process (`server/src/central.rs`).
-- Each attempt is counted, and committed, before its worker starts, so a
-- version that takes its server down with it cannot be tried forever:
-- past `limits.central_eval_attempts` the round's evaluation is `failed`.
-- `central_eval_started_ms` is when the last attempt began: the queue
-- takes the job evaluated least recently first, and skips an attempt
-- younger than the timeout (another process is running it).
ALTER TABLE rounds ADD COLUMN central_eval_attempts BIGINT NOT NULL DEFAULT 0;
ALTER TABLE rounds ADD COLUMN central_eval_started_ms BIGINT;
