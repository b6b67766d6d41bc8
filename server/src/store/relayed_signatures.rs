//! The cloud's signatures over the model versions an edge aggregator
//! relays, and the cloud's key chain (ARCHITECTURE.md, "The edge tier").

use canopy_protocol::model_sig::SigningKeys;

use crate::db::{Db, now_ms};
use crate::signing::ModelSignature;
use crate::store::rounds::Tx;

/// The `settings` row that holds the cloud's key chain, as last fetched.
const CHAIN_SETTING: &str = "relayed_signing_keys";

pub async fn get(db: &Db, digest_hex: &str) -> Result<Option<ModelSignature>, sqlx::Error> {
    let row: Option<(String, String)> =
        sqlx::query_as("SELECT key_hex, signature_hex FROM relayed_signatures WHERE digest = $1")
            .bind(digest_hex.to_ascii_lowercase())
            .fetch_optional(&db.pool)
            .await?;
    Ok(row.map(|(key_hex, signature_hex)| ModelSignature {
        key_hex,
        signature_hex,
    }))
}

/// Keeps the cloud's signature of a digest; a digest keeps the first one
/// recorded (a version's bytes, and so its digest, never change).
pub async fn put(
    tx: &mut Tx<'_>,
    digest_hex: &str,
    signature: &ModelSignature,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO relayed_signatures (digest, key_hex, signature_hex, created_ms) \
         VALUES ($1, $2, $3, $4) ON CONFLICT (digest) DO NOTHING",
    )
    .bind(digest_hex.to_ascii_lowercase())
    .bind(&signature.key_hex)
    .bind(&signature.signature_hex)
    .bind(now_ms())
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// The cloud's key chain as the edge last stored it.
pub async fn chain(db: &Db) -> Result<Option<SigningKeys>, sqlx::Error> {
    let row: Option<(Vec<u8>,)> = sqlx::query_as("SELECT value FROM settings WHERE name = $1")
        .bind(CHAIN_SETTING)
        .fetch_optional(&db.pool)
        .await?;
    row.map(|(value,)| {
        serde_json::from_slice(&value).map_err(|error| sqlx::Error::ColumnDecode {
            index: format!("settings.{CHAIN_SETTING}"),
            source: Box::new(error),
        })
    })
    .transpose()
}

pub async fn set_chain(db: &Db, chain: &SigningKeys) -> Result<(), sqlx::Error> {
    let value = serde_json::to_vec(chain).unwrap_or_default();
    let _writer = db.write_lock().await;
    sqlx::query(
        "INSERT INTO settings (name, value, created_ms) VALUES ($1, $2, $3) \
         ON CONFLICT (name) DO UPDATE SET value = excluded.value",
    )
    .bind(CHAIN_SETTING)
    .bind(value)
    .bind(now_ms())
    .execute(&db.pool)
    .await?;
    Ok(())
}
