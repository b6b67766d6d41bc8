//! Queries, grouped by what they are about. Each function is one
//! statement or one transaction; callers never see SQL.

pub mod devices;
pub mod jobs;
pub mod models;
pub mod rounds;
pub mod secagg;
pub mod settings;
pub mod signing_keys;
pub mod tokens;

use rand::RngCore;
use sha2::{Digest, Sha256};

/// A fresh secret: `prefix` plus 32 random bytes in hex. The prefix tells a
/// leaked secret's kind at a glance (and to secret scanners).
pub fn new_secret(prefix: &str) -> String {
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    format!("{prefix}{}", hex::encode(bytes))
}

/// Secrets are 256-bit random, so a plain SHA-256 is enough to store them:
/// there is no dictionary to slow down, unlike with passwords.
pub fn secret_hash(secret: &str) -> Vec<u8> {
    Sha256::digest(secret.as_bytes()).to_vec()
}

/// Cursor pagination: ids strictly after `after`, at most `limit`.
#[derive(Clone, Copy, Debug)]
pub struct Page {
    pub after: i64,
    pub limit: i64,
}

/// Unwraps a JSON column written by this server.
pub(crate) fn from_json<T: serde::de::DeserializeOwned>(
    column: &str,
    text: &str,
) -> Result<T, sqlx::Error> {
    serde_json::from_str(text).map_err(|error| sqlx::Error::ColumnDecode {
        index: column.to_string(),
        source: Box::new(error),
    })
}
