//! The cloud's signatures over the model versions an edge aggregator
//! relays, and the edge's own over the versions its sub-rounds make, each
//! with the cloud's delegation (ARCHITECTURE.md, "The edge tier").

use crate::db::{Db, now_ms};
use crate::signing::ModelSignature;
use crate::store::rounds::Tx;

pub async fn get(db: &Db, digest_hex: &str) -> Result<Option<ModelSignature>, sqlx::Error> {
    let row: Option<(String, String, Option<String>)> = sqlx::query_as(
        "SELECT key_hex, signature_hex, delegation FROM relayed_signatures WHERE digest = $1",
    )
    .bind(digest_hex.to_ascii_lowercase())
    .fetch_optional(&db.pool)
    .await?;
    Ok(
        row.map(|(key_hex, signature_hex, delegation)| ModelSignature {
            key_hex,
            signature_hex,
            delegation,
        }),
    )
}

/// Keeps the signature of a digest; a digest keeps the first one recorded
/// (a version's bytes, and so its digest, never change).
pub async fn put(
    tx: &mut Tx<'_>,
    digest_hex: &str,
    signature: &ModelSignature,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO relayed_signatures (digest, key_hex, signature_hex, delegation, \
         created_ms) VALUES ($1, $2, $3, $4, $5) ON CONFLICT (digest) DO NOTHING",
    )
    .bind(digest_hex.to_ascii_lowercase())
    .bind(&signature.key_hex)
    .bind(&signature.signature_hex)
    .bind(signature.delegation.as_deref())
    .bind(now_ms())
    .execute(&mut **tx)
    .await?;
    Ok(())
}
