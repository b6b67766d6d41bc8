//! The model-signing key ring (`model_signing_keys`): the key the server
//! signs with now (highest `seq`), the keys it replaced, and each
//! replacement's endorsement by the key it replaced.

use crate::store::row::any_row;
use std::time::Duration;

use canopy_protocol::model_sig::{
    KeyEndorsement, MAX_KEY_CHAIN_LEN, ServerKey, SigningKeys, endorsement_message,
};

use super::settings;
use crate::db::{Db, is_unique_violation, now_ms};

/// The longest a replaced key's signatures stay acceptable. Past a few
/// weeks the window no longer covers a slow rollout but a leaked key.
pub const MAX_OVERLAP: Duration = Duration::from_secs(90 * 24 * 3600);
pub const DEFAULT_OVERLAP: Duration = Duration::from_secs(7 * 24 * 3600);

#[derive(Debug, thiserror::Error)]
pub enum SigningKeyError {
    #[error(transparent)]
    Sql(#[from] sqlx::Error),
    #[error("model-signing key {seq} in the database is corrupt: {reason}")]
    Corrupt { seq: i64, reason: String },
    #[error(
        "the overlap of {overlap_ms} ms is over the limit of {max_ms} ms ({} days)",
        .max_ms / 86_400_000
    )]
    OverlapTooLong { overlap_ms: u64, max_ms: u64 },
    #[error(
        "another rotation of the model-signing key committed at the same time; list the keys and rotate again if needed"
    )]
    ConcurrentRotation,
    #[error(
        "the database holds no model-signing key yet; the first start of `canopy-server serve` \
         on a new database creates it"
    )]
    NoKeys,
}

/// One key of the ring, without its secret.
#[derive(Clone, Debug)]
pub struct SigningKeyInfo {
    pub seq: i64,
    pub public_key_hex: String,
    pub created_ms: i64,
    /// Set once the key was replaced: its signatures are accepted until then.
    pub valid_until_ms: Option<i64>,
    /// Whether the database still holds its secret.
    pub has_secret: bool,
}

/// What the server signs with, and the chain devices follow to it.
#[derive(Clone, Debug)]
pub struct Ring {
    pub seq: i64,
    pub current: ServerKey,
    /// The most recent [`MAX_KEY_CHAIN_LEN`] endorsements, oldest first.
    pub chain: SigningKeys,
}

/// A rotation's outcome.
#[derive(Clone, Debug)]
pub struct Rotation {
    pub seq: i64,
    pub public_key_hex: String,
    pub previous_public_key_hex: String,
    pub previous_valid_until_ms: i64,
}

any_row! {
    struct KeyRow {
        seq: i64,
        public_key: Vec<u8>,
        created_ms: i64,
        valid_until_ms: Option<i64>,
        endorsement: Option<Vec<u8>>,
        has_secret: i64,
    }
}

const KEY_COLUMNS: &str = "seq, public_key, created_ms, valid_until_ms, endorsement, \
     CAST(CASE WHEN secret_key IS NULL THEN 0 ELSE 1 END AS BIGINT) AS has_secret";

fn corrupt(seq: i64, reason: impl Into<String>) -> SigningKeyError {
    SigningKeyError::Corrupt {
        seq,
        reason: reason.into(),
    }
}

fn key_bytes<const N: usize>(
    seq: i64,
    what: &str,
    value: &[u8],
) -> Result<[u8; N], SigningKeyError> {
    value.try_into().map_err(|_| {
        corrupt(
            seq,
            format!("its {what} is {} bytes, expected {N}", value.len()),
        )
    })
}

/// Moves the pre-ring setting's key into the ring, so that devices
/// enrolled before the ring existed keep verifying; creates no key. Each
/// step is one statement, safe when several processes start at once: the
/// row with `seq` 1 is inserted once, and the setting is deleted only after.
async fn adopt_pre_ring_key(db: &Db) -> Result<(), SigningKeyError> {
    if ring_size(db).await? > 0 {
        return Ok(());
    }
    let Some(first) = settings::pre_ring_signing_key(db).await? else {
        return Ok(());
    };
    insert_first_key(db, &first).await?;
    settings::delete_model_signing_key(db).await?;
    Ok(())
}

async fn ring_size(db: &Db) -> Result<i64, SigningKeyError> {
    let (count,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM model_signing_keys")
        .fetch_one(&db.pool)
        .await?;
    Ok(count)
}

async fn insert_first_key(db: &Db, first: &ServerKey) -> Result<(), SigningKeyError> {
    sqlx::query(
        "INSERT INTO model_signing_keys (seq, public_key, secret_key, created_ms) \
         VALUES (1, $1, $2, $3) ON CONFLICT (seq) DO NOTHING",
    )
    .bind(first.public_key().to_vec())
    .bind(first.to_bytes().to_vec())
    .bind(now_ms())
    .execute(&db.pool)
    .await?;
    Ok(())
}

/// Whether the database holds a model-signing key (a pre-ring one is
/// moved into the ring first).
pub async fn has_keys(db: &Db) -> Result<bool, SigningKeyError> {
    adopt_pre_ring_key(db).await?;
    Ok(ring_size(db).await? > 0)
}

/// The ring's first key, on a new database only: `bootstrap` decides that
/// it is one. Racing first starts insert one key between them.
pub async fn create_first_key(db: &Db) -> Result<(), SigningKeyError> {
    insert_first_key(db, &ServerKey::generate()).await
}

/// The ring as it is now. Erases the secrets of replaced keys whose window
/// has ended first, so that every process that loads the ring enforces it.
pub async fn load_ring(db: &Db) -> Result<Ring, SigningKeyError> {
    adopt_pre_ring_key(db).await?;
    let mut rows: Vec<KeyRow> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {KEY_COLUMNS} FROM model_signing_keys ORDER BY seq DESC LIMIT $1"
    )))
    .bind(MAX_KEY_CHAIN_LEN as i64 + 1)
    .fetch_all(&db.pool)
    .await?;
    rows.reverse();
    let now = now_ms();
    if rows
        .iter()
        .any(|row| row.has_secret == 1 && row.valid_until_ms.is_some_and(|until| until < now))
    {
        erase_expired_secrets(db, now).await?;
    }
    let current_row = rows.last().ok_or(SigningKeyError::NoKeys)?;
    let (secret,): (Option<Vec<u8>>,) =
        sqlx::query_as("SELECT secret_key FROM model_signing_keys WHERE seq = $1")
            .bind(current_row.seq)
            .fetch_one(&db.pool)
            .await?;
    let secret = secret.ok_or_else(|| corrupt(current_row.seq, "the key in use has no secret"))?;
    let current = ServerKey::from_bytes(&key_bytes(current_row.seq, "secret key", &secret)?);
    if current.public_key().as_slice() != current_row.public_key.as_slice() {
        return Err(corrupt(
            current_row.seq,
            "its secret does not belong to its public key",
        ));
    }
    let endorsements = rows
        .windows(2)
        .map(|pair| endorsement(&pair[0], &pair[1]))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Ring {
        seq: current_row.seq,
        chain: SigningKeys {
            current_key: current.public_key_hex(),
            endorsements,
        },
        current,
    })
}

/// `next`'s endorsement by `previous`, checked as a device would check it,
/// so that a damaged row is reported here rather than refused by devices.
fn endorsement(previous: &KeyRow, next: &KeyRow) -> Result<KeyEndorsement, SigningKeyError> {
    if next.seq != previous.seq + 1 {
        return Err(corrupt(
            next.seq,
            format!("it follows key {} in the ring", previous.seq),
        ));
    }
    let valid_until_ms = previous
        .valid_until_ms
        .and_then(|until| u64::try_from(until).ok())
        .ok_or_else(|| corrupt(previous.seq, "it was replaced but has no valid window"))?;
    let signature = next
        .endorsement
        .as_deref()
        .ok_or_else(|| corrupt(next.seq, "it has no endorsement"))?;
    let signature: [u8; 64] = key_bytes(next.seq, "endorsement", signature)?;
    let link = KeyEndorsement {
        previous_key: hex::encode(&previous.public_key),
        next_key: hex::encode(&next.public_key),
        previous_valid_until_ms: valid_until_ms,
        signature: hex::encode(signature),
    };
    link.verify()
        .map_err(|error| corrupt(next.seq, error.to_string()))?;
    Ok(link)
}

async fn erase_expired_secrets(db: &Db, now: i64) -> Result<(), SigningKeyError> {
    let _writer = db.write_lock().await;
    let erased = sqlx::query(
        "UPDATE model_signing_keys SET secret_key = NULL \
         WHERE secret_key IS NOT NULL AND valid_until_ms IS NOT NULL AND valid_until_ms < $1",
    )
    .bind(now)
    .execute(&db.pool)
    .await?
    .rows_affected();
    if erased > 0 {
        tracing::info!(
            erased,
            "erased the secrets of replaced model-signing keys whose window ended"
        );
    }
    Ok(())
}

/// Replaces the key in use with a fresh one, endorsed by it; the replaced
/// key's signatures stay acceptable for `overlap`.
pub async fn rotate(db: &Db, overlap: Duration) -> Result<Rotation, SigningKeyError> {
    let overlap_ms = u64::try_from(overlap.as_millis()).unwrap_or(u64::MAX);
    if overlap > MAX_OVERLAP {
        return Err(SigningKeyError::OverlapTooLong {
            overlap_ms,
            max_ms: MAX_OVERLAP.as_millis() as u64,
        });
    }
    let ring = load_ring(db).await?;
    let _writer = db.write_lock().await;
    let mut tx = db.pool.begin().await?;
    // Locks the key in use on PostgreSQL; a rotation racing this one then
    // waits, and its insert of the same `seq` fails below.
    let (seq,): (i64,) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT seq FROM model_signing_keys WHERE seq = $1{}",
        db.for_update()
    )))
    .bind(ring.seq)
    .fetch_one(&mut *tx)
    .await?;
    let now = now_ms();
    let valid_until_ms = now.saturating_add(overlap_ms as i64);
    let next = ServerKey::generate();
    let message = endorsement_message(
        &ring.current.public_key(),
        &next.public_key(),
        valid_until_ms as u64,
    );
    let signature = ring.current.sign_message(&message);
    sqlx::query("UPDATE model_signing_keys SET valid_until_ms = $1 WHERE seq = $2")
        .bind(valid_until_ms)
        .bind(seq)
        .execute(&mut *tx)
        .await?;
    let inserted = sqlx::query(
        "INSERT INTO model_signing_keys (seq, public_key, secret_key, created_ms, endorsement) \
         VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(seq + 1)
    .bind(next.public_key().to_vec())
    .bind(next.to_bytes().to_vec())
    .bind(now)
    .bind(signature.to_vec())
    .execute(&mut *tx)
    .await;
    match inserted {
        Err(error) if is_unique_violation(&error) => {
            return Err(SigningKeyError::ConcurrentRotation);
        }
        other => other?,
    };
    tx.commit().await?;
    Ok(Rotation {
        seq: seq + 1,
        public_key_hex: next.public_key_hex(),
        previous_public_key_hex: ring.current.public_key_hex(),
        previous_valid_until_ms: valid_until_ms,
    })
}

/// Every key of the ring, oldest first, without secrets.
pub async fn list(db: &Db) -> Result<Vec<SigningKeyInfo>, SigningKeyError> {
    adopt_pre_ring_key(db).await?;
    let rows: Vec<KeyRow> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {KEY_COLUMNS} FROM model_signing_keys ORDER BY seq"
    )))
    .fetch_all(&db.pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(|row| SigningKeyInfo {
            seq: row.seq,
            public_key_hex: hex::encode(&row.public_key),
            created_ms: row.created_ms,
            valid_until_ms: row.valid_until_ms,
            has_secret: row.has_secret == 1,
        })
        .collect())
}
