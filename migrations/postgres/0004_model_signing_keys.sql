-- The model-signing key ring. The key the server signs with is the row
-- with the highest `seq`. Each later row carries its predecessor's
-- endorsement: the predecessor's Ed25519 signature over
-- (canopy-model-key-rotation-v1, its public key, this public key, its
-- valid_until_ms). `valid_until_ms` is set when a key is replaced; once it
-- has passed, the key's secret is erased (set to NULL), while its public
-- key and endorsement stay so that devices can still follow the chain.
-- The old `model_signing_key` setting becomes row 1 on the first start
-- (in Rust: the public key has to be derived from the secret).
CREATE TABLE model_signing_keys (
    seq BIGINT PRIMARY KEY,
    public_key BYTEA NOT NULL UNIQUE,
    secret_key BYTEA,
    created_ms BIGINT NOT NULL,
    valid_until_ms BIGINT,
    endorsement BYTEA,
    CHECK (seq >= 1),
    CHECK ((seq = 1) = (endorsement IS NULL))
);
