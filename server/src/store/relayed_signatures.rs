//! The cloud's signatures over the model versions an edge aggregator
//! relays (ARCHITECTURE.md, "The edge tier").

use crate::db::{Db, now_ms};
use crate::signing::ModelSignature;
use crate::store::rounds::Tx;

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
