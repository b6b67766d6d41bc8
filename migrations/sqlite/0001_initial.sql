-- Canopy server schema, SQLite flavour. Keep it in step with
-- ../postgres/0001_initial.sql: the two differ only in column types.
-- Times are Unix milliseconds; ids are 64-bit integers.

CREATE TABLE settings (
    name TEXT PRIMARY KEY,
    value BLOB NOT NULL,
    created_ms INTEGER NOT NULL
);

CREATE TABLE api_tokens (
    id INTEGER PRIMARY KEY,
    role TEXT NOT NULL CHECK (role IN ('admin', 'operator', 'viewer')),
    label TEXT NOT NULL DEFAULT '',
    token_hash BLOB NOT NULL UNIQUE,
    created_ms INTEGER NOT NULL,
    expires_ms INTEGER,
    revoked_ms INTEGER
);

CREATE TABLE enrollment_tokens (
    id INTEGER PRIMARY KEY,
    label TEXT NOT NULL DEFAULT '',
    token_hash BLOB NOT NULL UNIQUE,
    created_ms INTEGER NOT NULL,
    expires_ms INTEGER NOT NULL,
    max_uses INTEGER NOT NULL,
    uses INTEGER NOT NULL DEFAULT 0,
    revoked_ms INTEGER
);

CREATE TABLE devices (
    id INTEGER PRIMARY KEY,
    public_key BLOB NOT NULL UNIQUE,
    tier TEXT NOT NULL,
    backends TEXT NOT NULL,
    memory_mb INTEGER NOT NULL,
    os TEXT NOT NULL,
    tags TEXT NOT NULL,
    enrollment_token_id INTEGER NOT NULL REFERENCES enrollment_tokens (id),
    enrolled_ms INTEGER NOT NULL,
    last_seen_ms INTEGER NOT NULL,
    revoked_ms INTEGER
);
CREATE INDEX devices_last_seen ON devices (last_seen_ms);

CREATE TABLE device_nonces (
    device_id INTEGER NOT NULL,
    nonce TEXT NOT NULL,
    expires_ms INTEGER NOT NULL,
    PRIMARY KEY (device_id, nonce)
);
CREATE INDEX device_nonces_expiry ON device_nonces (expires_ms);

CREATE TABLE models (
    name TEXT PRIMARY KEY,
    created_ms INTEGER NOT NULL
);

CREATE TABLE model_versions (
    id INTEGER PRIMARY KEY,
    model_name TEXT NOT NULL REFERENCES models (name),
    version INTEGER NOT NULL,
    digest TEXT NOT NULL,
    size_bytes INTEGER NOT NULL,
    trainable_elements INTEGER NOT NULL,
    has_train_step INTEGER NOT NULL,
    layout TEXT NOT NULL,
    parent_version_id INTEGER REFERENCES model_versions (id),
    job_id INTEGER,
    round_id INTEGER,
    created_ms INTEGER NOT NULL,
    UNIQUE (model_name, version)
);

CREATE TABLE jobs (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL,
    model_version_id INTEGER NOT NULL REFERENCES model_versions (id),
    current_version_id INTEGER NOT NULL REFERENCES model_versions (id),
    config TEXT NOT NULL,
    state TEXT NOT NULL,
    rounds_completed INTEGER NOT NULL DEFAULT 0,
    round_failures INTEGER NOT NULL DEFAULT 0,
    status_message TEXT NOT NULL DEFAULT '',
    created_ms INTEGER NOT NULL,
    updated_ms INTEGER NOT NULL,
    started_ms INTEGER,
    finished_ms INTEGER
);
CREATE INDEX jobs_state ON jobs (state);

CREATE TABLE rounds (
    id INTEGER PRIMARY KEY,
    job_id INTEGER NOT NULL REFERENCES jobs (id),
    number INTEGER NOT NULL,
    attempt INTEGER NOT NULL,
    state TEXT NOT NULL,
    base_version_id INTEGER NOT NULL REFERENCES model_versions (id),
    result_version_id INTEGER REFERENCES model_versions (id),
    target_devices INTEGER NOT NULL,
    min_devices INTEGER NOT NULL,
    selected_count INTEGER NOT NULL DEFAULT 0,
    updates_accepted INTEGER NOT NULL DEFAULT 0,
    weight_total INTEGER NOT NULL DEFAULT 0,
    update_sum BLOB,
    bytes_in INTEGER NOT NULL DEFAULT 0,
    bytes_out INTEGER NOT NULL DEFAULT 0,
    dropouts INTEGER NOT NULL DEFAULT 0,
    status_message TEXT NOT NULL DEFAULT '',
    created_ms INTEGER NOT NULL,
    training_started_ms INTEGER,
    deadline_ms INTEGER,
    closed_ms INTEGER,
    finished_ms INTEGER,
    UNIQUE (job_id, number, attempt)
);
-- At most one open round per job, whatever number of server processes race.
CREATE UNIQUE INDEX rounds_one_open_per_job ON rounds (job_id)
    WHERE state IN ('selecting', 'training', 'aggregating');
CREATE INDEX rounds_state ON rounds (state);

CREATE TABLE participants (
    round_id INTEGER NOT NULL REFERENCES rounds (id),
    device_id INTEGER NOT NULL REFERENCES devices (id),
    state TEXT NOT NULL,
    selected_ms INTEGER NOT NULL,
    delivered_ms INTEGER,
    uploaded_ms INTEGER,
    num_samples INTEGER,
    update_bytes INTEGER,
    train_loss DOUBLE,
    eval_loss DOUBLE,
    eval_accuracy DOUBLE,
    eval_samples INTEGER,
    train_duration_ms INTEGER,
    PRIMARY KEY (round_id, device_id)
);
CREATE INDEX participants_device ON participants (device_id, state);
