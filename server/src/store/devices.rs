//! Enrolled devices, their keys and the nonces they have used.

use crate::store::row::any_row;
use std::collections::BTreeMap;
use std::sync::Arc;

use crate::group_commit::GroupCommit;

use canopy_protocol::messages::{
    Capabilities, DatasetInfo, DeviceConditions, DeviceRole, GpuAdapter,
};

use super::tokens::{EnrollmentTokenError, spend_enrollment_token};
use super::{Page, from_json};
use crate::db::{Db, is_unique_violation, now_ms};

any_row! {
    #[derive(Clone, Debug)]
    pub struct DeviceRow {
        pub id: i64,
        pub public_key: Vec<u8>,
        pub tier: String,
        pub backends: String,
        pub memory_mb: i64,
        pub os: String,
        pub tags: String,
        pub enrollment_token_id: i64,
        pub enrolled_ms: i64,
        pub last_seen_ms: i64,
        pub revoked_ms: Option<i64>,
        /// JSON list of [`DatasetInfo`], from the device's heartbeats.
        pub datasets: Option<String>,
        pub last_error: Option<String>,
        /// JSON [`GpuAdapter`] the device reported at enrollment.
        pub gpu: Option<String>,
        /// JSON [`DeviceConditions`] from the device's latest heartbeat that
        /// had them.
        pub conditions: Option<String>,
        /// Its enrollment token's role (`DeviceRole`'s name).
        pub role: String,
    }
}

const DEVICE_COLUMNS: &str = "id, public_key, tier, backends, memory_mb, os, tags, \
     enrollment_token_id, enrolled_ms, last_seen_ms, revoked_ms, datasets, last_error, gpu, \
     conditions, role";

impl DeviceRow {
    pub fn backends(&self) -> Result<Vec<String>, sqlx::Error> {
        from_json("devices.backends", &self.backends)
    }

    pub fn tags(&self) -> Result<BTreeMap<String, String>, sqlx::Error> {
        from_json("devices.tags", &self.tags)
    }

    pub fn datasets(&self) -> Result<Vec<DatasetInfo>, sqlx::Error> {
        parse_datasets(self.datasets.as_deref())
    }

    pub fn gpu(&self) -> Result<Option<GpuAdapter>, sqlx::Error> {
        self.gpu
            .as_deref()
            .map(|text| from_json("devices.gpu", text))
            .transpose()
    }

    pub fn conditions(&self) -> Result<Option<DeviceConditions>, sqlx::Error> {
        parse_conditions(self.conditions.as_deref())
    }

    pub fn role(&self) -> Result<DeviceRole, sqlx::Error> {
        self.role
            .parse()
            .map_err(|error: String| sqlx::Error::Decode(error.into()))
    }
}

/// A device's latest reported conditions; none before its first report.
pub fn parse_conditions(json: Option<&str>) -> Result<Option<DeviceConditions>, sqlx::Error> {
    json.map(|text| from_json("devices.conditions", text))
        .transpose()
}

/// A device's reported datasets; none before its first report.
pub fn parse_datasets(json: Option<&str>) -> Result<Vec<DatasetInfo>, sqlx::Error> {
    json.map(|text| from_json("devices.datasets", text))
        .transpose()
        .map(Option::unwrap_or_default)
}

/// What a heartbeat says about the device that the server keeps; `None`
/// leaves each unchanged.
#[derive(Clone, Copy, Debug, Default)]
pub struct HeartbeatReport<'a> {
    /// The datasets it offers, replaced when given.
    pub datasets: Option<&'a [DatasetInfo]>,
    /// Its last error, replaced when given, cleared by an empty one.
    pub last_error: Option<&'a str>,
    /// Its state now (charging, network, idle, battery), replaced when
    /// given: selection checks jobs' device policies against it.
    pub conditions: Option<&'a DeviceConditions>,
}

/// Stores what a heartbeat says about the device.
pub async fn record_heartbeat(
    db: &Db,
    device_id: i64,
    report: HeartbeatReport<'_>,
) -> Result<(), sqlx::Error> {
    if report.datasets.is_none() && report.last_error.is_none() && report.conditions.is_none() {
        return Ok(());
    }
    let encode = |error: serde_json::Error| sqlx::Error::Encode(Box::new(error));
    let datasets = report
        .datasets
        .map(serde_json::to_string)
        .transpose()
        .map_err(encode)?;
    let conditions = report
        .conditions
        .map(serde_json::to_string)
        .transpose()
        .map_err(encode)?;
    let last_error = report
        .last_error
        .map(|e| if e.is_empty() { None } else { Some(e) });
    let _writer = db.write_lock().await;
    sqlx::query(
        "UPDATE devices SET datasets = COALESCE($1, datasets), \
         last_error = CASE WHEN $2 = 1 THEN $3 ELSE last_error END, \
         conditions = COALESCE($4, conditions) WHERE id = $5",
    )
    .bind(datasets)
    .bind(i64::from(last_error.is_some()))
    .bind(last_error.flatten())
    .bind(conditions)
    .bind(device_id)
    .execute(&db.pool)
    .await?;
    Ok(())
}

#[derive(Debug, thiserror::Error)]
pub enum EnrollError {
    #[error(transparent)]
    Token(#[from] EnrollmentTokenError),
    #[error("this public key is already enrolled as device {device_id}")]
    KeyInUse { device_id: i64 },
    #[error(transparent)]
    Sql(#[from] sqlx::Error),
}

/// Spends one use of the enrollment token and records the device in the
/// token's role, which must be the `role` asked for, in one transaction:
/// a failed enrollment spends nothing.
pub async fn enroll(
    db: &Db,
    enrollment_secret: &str,
    public_key: &[u8; 32],
    capabilities: &Capabilities,
    role: DeviceRole,
) -> Result<i64, EnrollError> {
    let _writer = db.write_lock().await;
    let mut tx = db.pool.begin().await?;
    let token_id = spend_enrollment_token(&mut tx, enrollment_secret, role).await?;
    let existing: Option<(i64,)> = sqlx::query_as("SELECT id FROM devices WHERE public_key = $1")
        .bind(public_key.to_vec())
        .fetch_optional(&mut *tx)
        .await?;
    if let Some((device_id,)) = existing {
        return Err(EnrollError::KeyInUse { device_id });
    }
    let now = now_ms();
    let inserted: Result<(i64,), sqlx::Error> = sqlx::query_as(
        "INSERT INTO devices (public_key, tier, backends, memory_mb, os, tags, \
         enrollment_token_id, enrolled_ms, last_seen_ms, gpu, role) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $8, $9, $10) RETURNING id",
    )
    .bind(public_key.to_vec())
    .bind(capabilities.tier.to_string())
    .bind(serde_json::to_string(&capabilities.backends).unwrap_or_default())
    .bind(i64::try_from(capabilities.memory_mb).unwrap_or(i64::MAX))
    .bind(capabilities.os.clone())
    .bind(serde_json::to_string(&capabilities.tags).unwrap_or_default())
    .bind(token_id)
    .bind(now)
    .bind(
        capabilities
            .gpu
            .as_ref()
            .map(|gpu| serde_json::to_string(gpu).unwrap_or_default()),
    )
    .bind(role.as_str())
    .fetch_one(&mut *tx)
    .await;
    let (device_id,) = match inserted {
        Err(error) if is_unique_violation(&error) => {
            return Err(EnrollError::KeyInUse { device_id: 0 });
        }
        other => other?,
    };
    tx.commit().await?;
    Ok(device_id)
}

pub async fn get(db: &Db, id: i64) -> Result<Option<DeviceRow>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {DEVICE_COLUMNS} FROM devices WHERE id = $1"
    )))
    .bind(id)
    .fetch_optional(&db.pool)
    .await
}

pub async fn list(db: &Db, page: Page) -> Result<Vec<DeviceRow>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {DEVICE_COLUMNS} FROM devices WHERE id > $1 ORDER BY id LIMIT $2"
    )))
    .bind(page.after)
    .bind(page.limit)
    .fetch_all(&db.pool)
    .await
}

/// How closely `last_seen_ms` follows a device's requests. Seen-times
/// need no millisecond precision, and skipping most writes keeps a busy
/// device from rewriting its row on every request.
pub const SEEN_PRECISION_MS: i64 = 1_000;

/// Devices whose last seen-write this process remembers at most; past it
/// the map starts over (a write each).
const MAX_SEEN_MARKS: usize = 65_536;

/// When this process last wrote each device's `last_seen_ms`: a request
/// within [`SEEN_PRECISION_MS`] of that write costs no statement, where a
/// conditional UPDATE that changes nothing still costs a hand-off to
/// SQLite's worker thread (a secure round makes nine signed requests a
/// device). Another process's writes are still seen by the UPDATE's own
/// condition, so the column lags a device's last request by less than
/// [`SEEN_PRECISION_MS`] whichever process took it.
#[derive(Default)]
pub struct SeenMarks {
    written_ms: std::sync::Mutex<std::collections::HashMap<i64, i64>>,
}

impl SeenMarks {
    fn due(&self, device_id: i64, now_ms: i64) -> bool {
        let written = self.lock();
        written
            .get(&device_id)
            .is_none_or(|&at| now_ms - at >= SEEN_PRECISION_MS)
    }

    fn record(&self, device_id: i64, now_ms: i64) {
        let mut written = self.lock();
        if written.len() >= MAX_SEEN_MARKS {
            written.clear();
        }
        written.insert(device_id, now_ms);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<i64, i64>> {
        self.written_ms
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Most nonces written in one transaction.
pub const MAX_NONCE_BATCH: usize = 512;

/// The nonces of signed device requests, written with group commit
/// ([`crate::group_commit`]): one worker writes every nonce queued by its
/// turn (at most [`MAX_NONCE_BATCH`]) in one transaction, so a fleet's
/// polls cost the database one commit per batch instead of one each, and
/// a request behind ten thousand polls waits for a few batches, not for
/// ten thousand commits. A fresh nonce also marks its device as seen,
/// when [`SeenMarks`] says its row is due.
///
/// Architecture invariant: a nonce is answered fresh only after the
/// transaction that recorded it committed; the worker is its own task, so
/// a request dropped mid-write cannot leave a committed nonce unanswered
/// or an answered one uncommitted.
#[derive(Default)]
pub struct NonceBook {
    queue: GroupCommit<(), PendingNonce, Result<bool, sqlx::Error>>,
    seen: Arc<SeenMarks>,
}

struct PendingNonce {
    device_id: i64,
    nonce: String,
    expires_ms: i64,
}

impl NonceBook {
    /// Records a nonce; false when the device already used it (a replay).
    pub async fn record(
        &self,
        db: &Db,
        device_id: i64,
        nonce: &str,
        expires_ms: i64,
    ) -> Result<bool, sqlx::Error> {
        let pending = PendingNonce {
            device_id,
            nonce: nonce.to_string(),
            expires_ms,
        };
        let (db, seen) = (db.clone(), self.seen.clone());
        let write = move |(), batch| {
            let (db, seen) = (db.clone(), seen.clone());
            async move { write_nonces(&db, &seen, batch).await }
        };
        self.queue
            .submit((), pending, MAX_NONCE_BATCH, write)
            .await
            .unwrap_or_else(|| {
                Err(sqlx::Error::Protocol(
                    "the nonce writer stopped before answering".into(),
                ))
            })
    }
}

/// Writes a batch: for each nonce in order, whether it was fresh. When the
/// database refuses the batch's transaction, each nonce is written on its
/// own, so that one bad row fails only its own request.
async fn write_nonces(
    db: &Db,
    seen: &SeenMarks,
    batch: Vec<PendingNonce>,
) -> Vec<Result<bool, sqlx::Error>> {
    let rows: Vec<(i64, &str, i64)> = batch
        .iter()
        .map(|p| (p.device_id, p.nonce.as_str(), p.expires_ms))
        .collect();
    match insert_nonces(db, seen, &rows).await {
        Ok(fresh) => fresh.into_iter().map(Ok).collect(),
        Err(error) if rows.len() == 1 => vec![Err(error)],
        // A statement the database refused: one row's fault, maybe.
        Err(sqlx::Error::Database(_)) => {
            let mut answers = Vec::with_capacity(rows.len());
            for row in &rows {
                let one = insert_nonces(db, seen, std::slice::from_ref(row)).await;
                answers.push(one.map(|fresh| fresh.first().copied().unwrap_or(false)));
            }
            answers
        }
        // The database itself (unreachable, its pool exhausted): every
        // request gets the error at once, not one timeout each in turn.
        Err(error) => rows.iter().map(|_| Err(same_error(&error))).collect(),
    }
}

/// `error` again, for another request: sqlx errors are not `Clone`. The
/// kinds answered differently (a busy pool is 503) stay what they were.
fn same_error(error: &sqlx::Error) -> sqlx::Error {
    match error {
        sqlx::Error::PoolTimedOut => sqlx::Error::PoolTimedOut,
        sqlx::Error::PoolClosed => sqlx::Error::PoolClosed,
        other => sqlx::Error::Protocol(other.to_string()),
    }
}

/// Inserts `(device, nonce, expiry)` rows in one transaction; for each,
/// whether it was fresh. A device's seen-time is written with its fresh
/// nonce when due.
async fn insert_nonces(
    db: &Db,
    seen: &SeenMarks,
    rows: &[(i64, &str, i64)],
) -> Result<Vec<bool>, sqlx::Error> {
    let now = now_ms();
    let _writer = db.write_lock().await;
    let mut tx = db.pool.begin().await?;
    let mut fresh = Vec::with_capacity(rows.len());
    let mut marked = Vec::new();
    for &(device_id, nonce, expires_ms) in rows {
        let inserted = sqlx::query(
            "INSERT INTO device_nonces (device_id, nonce, expires_ms) VALUES ($1, $2, $3) \
             ON CONFLICT (device_id, nonce) DO NOTHING",
        )
        .bind(device_id)
        .bind(nonce)
        .bind(expires_ms)
        .execute(&mut *tx)
        .await?;
        let is_fresh = inserted.rows_affected() == 1;
        if is_fresh && seen.due(device_id, now) && !marked.contains(&device_id) {
            sqlx::query("UPDATE devices SET last_seen_ms = $1 WHERE id = $2 AND last_seen_ms < $3")
                .bind(now)
                .bind(device_id)
                .bind(now - SEEN_PRECISION_MS)
                .execute(&mut *tx)
                .await?;
            marked.push(device_id);
        }
        fresh.push(is_fresh);
    }
    tx.commit().await?;
    for device_id in marked {
        seen.record(device_id, now);
    }
    Ok(fresh)
}

/// Forgets nonces whose timestamps can no longer pass the clock check.
pub async fn prune_nonces(db: &Db) -> Result<u64, sqlx::Error> {
    let _writer = db.write_lock().await;
    let result = sqlx::query("DELETE FROM device_nonces WHERE expires_ms < $1")
        .bind(now_ms())
        .execute(&db.pool)
        .await?;
    Ok(result.rows_affected())
}

pub async fn set_tags(
    db: &Db,
    id: i64,
    tags: &BTreeMap<String, String>,
) -> Result<bool, sqlx::Error> {
    let _writer = db.write_lock().await;
    let result = sqlx::query("UPDATE devices SET tags = $1 WHERE id = $2")
        .bind(serde_json::to_string(tags).unwrap_or_default())
        .bind(id)
        .execute(&db.pool)
        .await?;
    Ok(result.rows_affected() == 1)
}

pub async fn revoke(db: &Db, id: i64) -> Result<bool, sqlx::Error> {
    let _writer = db.write_lock().await;
    let result =
        sqlx::query("UPDATE devices SET revoked_ms = COALESCE(revoked_ms, $1) WHERE id = $2")
            .bind(now_ms())
            .bind(id)
            .execute(&db.pool)
            .await?;
    Ok(result.rows_affected() == 1)
}

/// Stores the device authority's certificate of a device's key, replacing
/// any earlier one. False when no such unrevoked device exists.
pub async fn set_certificate(db: &Db, id: i64, certificate: &[u8]) -> Result<bool, sqlx::Error> {
    let _writer = db.write_lock().await;
    let result =
        sqlx::query("UPDATE devices SET certificate = $1 WHERE id = $2 AND revoked_ms IS NULL")
            .bind(certificate)
            .bind(id)
            .execute(&db.pool)
            .await?;
    Ok(result.rows_affected() == 1)
}

/// Devices enrolled and not revoked: the population a job's rounds sample.
pub async fn count_enrolled(db: &Db) -> Result<i64, sqlx::Error> {
    let (count,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM devices WHERE revoked_ms IS NULL")
        .fetch_one(&db.pool)
        .await?;
    Ok(count)
}

pub async fn count_online(db: &Db, online_since_ms: i64) -> Result<i64, sqlx::Error> {
    let (count,): (i64,) = sqlx::query_as(
        "SELECT COUNT(*) FROM devices WHERE revoked_ms IS NULL AND last_seen_ms >= $1",
    )
    .bind(online_since_ms)
    .fetch_one(&db.pool)
    .await?;
    Ok(count)
}
