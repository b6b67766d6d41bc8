-- A job's server-optimizer state (FedAvgM's momentum, the adaptive
-- strategies' first and second moments), replaced in the transaction that
-- writes each round's version, so that the model and the state it was
-- stepped with never disagree after a crash.
CREATE TABLE strategy_states (
    job_id BIGINT PRIMARY KEY REFERENCES jobs (id),
    rounds BIGINT NOT NULL,
    state BYTEA NOT NULL,
    updated_ms BIGINT NOT NULL
);
-- Rewritten whole once per round; compressing it would cost more than it saves.
ALTER TABLE strategy_states ALTER COLUMN state SET STORAGE EXTERNAL;

-- `strategy` became an object (`{"name": "fedadam", ...}`); jobs stored
-- with the bare name keep it as that object's name.
UPDATE jobs
SET config = jsonb_set(config::jsonb, '{strategy}', jsonb_build_object('name', config::jsonb -> 'strategy'))::text
WHERE jsonb_typeof(config::jsonb -> 'strategy') = 'string';
