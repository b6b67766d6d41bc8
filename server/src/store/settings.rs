//! Server-wide values kept in the database, so that every server process
//! on one database shares them: the model-signing key and the fact that
//! the first admin token was issued.

use canopy_protocol::model_sig::ServerKey;

use super::tokens::{self, Role};
use crate::db::{Db, now_ms};

const MODEL_SIGNING_KEY: &str = "model_signing_key";
const BOOTSTRAP_ADMIN_TOKEN: &str = "bootstrap_admin_token";

/// Inserts a setting unless one exists; true when this call inserted it.
async fn insert_once(db: &Db, name: &str, value: &[u8]) -> Result<bool, sqlx::Error> {
    let result = sqlx::query(
        "INSERT INTO settings (name, value, created_ms) VALUES ($1, $2, $3) \
         ON CONFLICT (name) DO NOTHING",
    )
    .bind(name)
    .bind(value.to_vec())
    .bind(now_ms())
    .execute(&db.pool)
    .await?;
    Ok(result.rows_affected() == 1)
}

/// The server's Ed25519 model-signing key, created on first use. Whichever
/// process inserts first wins; the others read its key.
pub async fn model_signing_key(db: &Db) -> Result<ServerKey, sqlx::Error> {
    insert_once(db, MODEL_SIGNING_KEY, &ServerKey::generate().to_bytes()).await?;
    let (value,): (Vec<u8>,) = sqlx::query_as("SELECT value FROM settings WHERE name = $1")
        .bind(MODEL_SIGNING_KEY)
        .fetch_one(&db.pool)
        .await?;
    let secret: [u8; 32] = value.as_slice().try_into().map_err(|_| {
        sqlx::Error::Protocol(format!(
            "setting `{MODEL_SIGNING_KEY}` holds {} bytes, expected 32",
            value.len()
        ))
    })?;
    Ok(ServerKey::from_bytes(&secret))
}

/// On the very first start, issues an admin token and returns its secret
/// (to print once). Later starts, and racing processes, get `None`.
pub async fn bootstrap_admin_token(db: &Db) -> Result<Option<String>, sqlx::Error> {
    if !insert_once(db, BOOTSTRAP_ADMIN_TOKEN, b"issued").await? {
        return Ok(None);
    }
    let (_, secret) = tokens::create_api_token(db, Role::Admin, "first admin", None).await?;
    Ok(Some(secret))
}
