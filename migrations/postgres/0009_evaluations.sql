-- Evaluation of the version each round produced: on devices (federated:
-- `evaluators`, one row per device asked) and on the server (central: the
-- round's `central_eval_*`). See `server/src/store/evaluations.rs`.
ALTER TABLE rounds ADD COLUMN eval_state TEXT;
ALTER TABLE rounds ADD COLUMN eval_deadline_ms BIGINT;
ALTER TABLE rounds ADD COLUMN eval_closed_ms BIGINT;
ALTER TABLE rounds ADD COLUMN eval_selected BIGINT NOT NULL DEFAULT 0;
ALTER TABLE rounds ADD COLUMN central_eval_loss DOUBLE PRECISION;
ALTER TABLE rounds ADD COLUMN central_eval_accuracy DOUBLE PRECISION;
ALTER TABLE rounds ADD COLUMN central_eval_samples BIGINT;
CREATE INDEX rounds_eval_open ON rounds (eval_state) WHERE eval_state = 'open';

CREATE TABLE evaluators (
    round_id BIGINT NOT NULL REFERENCES rounds (id),
    device_id BIGINT NOT NULL REFERENCES devices (id),
    state TEXT NOT NULL,
    selected_ms BIGINT NOT NULL,
    delivered_ms BIGINT,
    reported_ms BIGINT,
    loss DOUBLE PRECISION,
    accuracy DOUBLE PRECISION,
    samples BIGINT,
    drop_reason TEXT,
    PRIMARY KEY (round_id, device_id)
);
CREATE INDEX evaluators_device_state ON evaluators (device_id, state);
