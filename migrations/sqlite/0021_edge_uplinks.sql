-- An edge aggregator's side of the edge tier (ARCHITECTURE.md, "The edge
-- tier"). A sub-round the cloud assigns is a local job of one round on the
-- cloud's version; its uplink row is what the edge owes the cloud for it:
-- collecting (the local round runs), ready (its weighted mean is kept in
-- `partial`, not yet accepted by the cloud), sent, or failed (`reason`).
CREATE TABLE uplinks (
    job_id INTEGER PRIMARY KEY REFERENCES jobs (id),
    cloud_round_id INTEGER NOT NULL UNIQUE,
    cloud_task TEXT NOT NULL,
    state TEXT NOT NULL DEFAULT 'collecting',
    partial BLOB,
    num_samples INTEGER,
    reason TEXT NOT NULL DEFAULT '',
    created_ms INTEGER NOT NULL,
    updated_ms INTEGER NOT NULL
);
CREATE INDEX uplinks_by_state ON uplinks (state);

-- The cloud's signatures over the versions an edge relays: the edge signs
-- no model, it hands its devices the cloud's signature.
CREATE TABLE relayed_signatures (
    digest TEXT PRIMARY KEY,
    key_hex TEXT NOT NULL,
    signature_hex TEXT NOT NULL,
    created_ms INTEGER NOT NULL
);
