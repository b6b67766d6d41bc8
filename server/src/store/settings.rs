//! Server-wide values kept in the database, so that every server process
//! on one database shares them: the fact that the first admin token was
//! issued, and the model-signing key of servers from before the key ring
//! (`signing_keys`), which moves it into the ring on the first start.

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

/// A setting's value, if it is set.
async fn get(db: &Db, name: &str) -> Result<Option<Vec<u8>>, sqlx::Error> {
    let value: Option<(Vec<u8>,)> = sqlx::query_as("SELECT value FROM settings WHERE name = $1")
        .bind(name)
        .fetch_optional(&db.pool)
        .await?;
    Ok(value.map(|(value,)| value))
}

/// The pre-ring model-signing key, if the database has one, so that the
/// ring's first key is the one devices enrolled under.
pub async fn pre_ring_signing_key(db: &Db) -> Result<Option<ServerKey>, sqlx::Error> {
    let Some(value) = get(db, MODEL_SIGNING_KEY).await? else {
        return Ok(None);
    };
    let secret: [u8; 32] = value.as_slice().try_into().map_err(|_| {
        sqlx::Error::Protocol(format!(
            "setting `{MODEL_SIGNING_KEY}` holds {} bytes, expected 32",
            value.len()
        ))
    })?;
    Ok(Some(ServerKey::from_bytes(&secret)))
}

/// Deletes the pre-ring key once the ring holds it, so that its secret is
/// kept in one place only (where the ring erases it when it retires).
pub async fn delete_model_signing_key(db: &Db) -> Result<(), sqlx::Error> {
    sqlx::query("DELETE FROM settings WHERE name = $1")
        .bind(MODEL_SIGNING_KEY)
        .execute(&db.pool)
        .await
        .map(|_| ())
}

/// The bootstrap setting's values: the token exists, or it was also printed.
const ISSUED: &[u8] = b"issued";
const SHOWN: &[u8] = b"shown";

/// Records that the first admin token reached the operator.
pub async fn mark_admin_token_shown(db: &Db) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE settings SET value = $1 WHERE name = $2")
        .bind(SHOWN.to_vec())
        .bind(BOOTSTRAP_ADMIN_TOKEN)
        .execute(&db.pool)
        .await
        .map(|_| ())
}

/// True when the first admin token was issued (shown or not): the
/// database has been started before.
pub async fn admin_token_issued(db: &Db) -> Result<bool, sqlx::Error> {
    Ok(get(db, BOOTSTRAP_ADMIN_TOKEN).await?.is_some())
}

/// True when the first admin token was issued and never shown, so nobody
/// holds its secret.
pub async fn admin_token_unshown(db: &Db) -> Result<bool, sqlx::Error> {
    Ok(get(db, BOOTSTRAP_ADMIN_TOKEN)
        .await?
        .is_some_and(|value| value == ISSUED))
}

/// On the very first start, issues an admin token and returns its secret
/// (to print once). Later starts, and racing processes, get `None`.
pub async fn bootstrap_admin_token(db: &Db) -> Result<Option<String>, sqlx::Error> {
    if !insert_once(db, BOOTSTRAP_ADMIN_TOKEN, ISSUED).await? {
        return Ok(None);
    }
    let (_, secret) = tokens::create_api_token(db, Role::Admin, "first admin", None).await?;
    Ok(Some(secret))
}
