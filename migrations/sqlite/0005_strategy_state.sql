-- A job's server-optimizer state (FedAvgM's momentum, the adaptive
-- strategies' first and second moments), replaced in the transaction that
-- writes each round's version, so that the model and the state it was
-- stepped with never disagree after a crash.
CREATE TABLE strategy_states (
    job_id INTEGER PRIMARY KEY REFERENCES jobs (id),
    rounds INTEGER NOT NULL,
    state BLOB NOT NULL,
    updated_ms INTEGER NOT NULL
);

-- `strategy` became an object (`{"name": "fedadam", ...}`); jobs stored
-- with the bare name keep it as that object's name.
UPDATE jobs
SET config = json_set(config, '$.strategy', json_object('name', json_extract(config, '$.strategy')))
WHERE json_type(config, '$.strategy') = 'text';
