-- Evaluation of the version each round produced: on devices (federated:
-- `evaluators`, one row per device asked) and on the server (central: the
-- round's `central_eval_*`). See `server/src/store/evaluations.rs`.
ALTER TABLE rounds ADD COLUMN eval_state TEXT;
ALTER TABLE rounds ADD COLUMN eval_deadline_ms INTEGER;
ALTER TABLE rounds ADD COLUMN eval_closed_ms INTEGER;
ALTER TABLE rounds ADD COLUMN eval_selected INTEGER NOT NULL DEFAULT 0;
ALTER TABLE rounds ADD COLUMN central_eval_loss REAL;
ALTER TABLE rounds ADD COLUMN central_eval_accuracy REAL;
ALTER TABLE rounds ADD COLUMN central_eval_samples INTEGER;
CREATE INDEX rounds_eval_open ON rounds (eval_state) WHERE eval_state = 'open';

CREATE TABLE evaluators (
    round_id INTEGER NOT NULL REFERENCES rounds (id),
    device_id INTEGER NOT NULL REFERENCES devices (id),
    state TEXT NOT NULL,
    selected_ms INTEGER NOT NULL,
    delivered_ms INTEGER,
    reported_ms INTEGER,
    loss REAL,
    accuracy REAL,
    samples INTEGER,
    drop_reason TEXT,
    PRIMARY KEY (round_id, device_id)
);
CREATE INDEX evaluators_device_state ON evaluators (device_id, state);
