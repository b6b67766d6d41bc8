//! Held-out datasets kept on the server, for central evaluation. A
//! dataset's bytes are one blob (the data file, then the labels file for
//! IDX and NPY, from byte `data_bytes` on); the row holds what the API and
//! the job checks need without reading it.

use crate::store::row::any_row;

use super::{from_json, text_enum};
use crate::db::{Db, is_unique_violation, now_ms};

text_enum! {
    /// The file format a dataset was uploaded in, detected from its bytes.
    pub enum DatasetKind {
        Csv = "csv",
        Idx = "idx",
        Npy = "npy",
    }
}

any_row! {
    #[derive(Clone, Debug)]
    pub struct DatasetRow {
        pub id: i64,
        pub name: String,
        pub kind: DatasetKind as String,
        pub samples: i64,
        sample_shape: String,
        pub classes: i64,
        pub size_bytes: i64,
        /// Where the labels file starts in the blob (its end for CSV).
        pub data_bytes: i64,
        pub digest: String,
        pub blob_key: String,
        pub created_unix_ms: i64,
    }
}

const DATASET_COLUMNS: &str = "id, name, kind, samples, sample_shape, classes, size_bytes, \
     data_bytes, digest, blob_key, created_unix_ms";

impl DatasetRow {
    /// The shape of one sample, as the loader produced it.
    pub fn sample_shape(&self) -> Result<Vec<u64>, sqlx::Error> {
        from_json("datasets.sample_shape", &self.sample_shape)
    }
}

/// A parsed, stored upload, before it has an id.
pub struct NewDataset<'a> {
    pub name: &'a str,
    pub kind: DatasetKind,
    pub samples: u64,
    pub sample_shape: &'a [u64],
    pub classes: u64,
    pub size_bytes: u64,
    pub data_bytes: u64,
    pub digest: &'a str,
}

/// What became of an insert.
#[derive(Debug)]
pub enum Inserted {
    Stored(Box<DatasetRow>),
    /// A dataset of that name exists.
    Exists,
    /// The server holds `max` datasets already.
    Full {
        max: usize,
    },
}

/// Adds a dataset unless the name is taken or the server holds `max`
/// already; the count and the insert share one transaction.
pub async fn insert(db: &Db, new: &NewDataset<'_>, max: usize) -> Result<Inserted, sqlx::Error> {
    let _writer = db.write_lock().await;
    let mut tx = db.pool.begin().await?;
    let count: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM datasets")
        .fetch_one(&mut *tx)
        .await?;
    if usize::try_from(count).unwrap_or(usize::MAX) >= max {
        return Ok(Inserted::Full { max });
    }
    let shape = serde_json::to_string(new.sample_shape).unwrap_or_else(|_| "[]".to_string());
    let as_i64 = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
    let inserted = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "INSERT INTO datasets (name, kind, samples, sample_shape, classes, size_bytes, \
         data_bytes, digest, blob_key, created_unix_ms) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $8, $9) RETURNING {DATASET_COLUMNS}"
    )))
    .bind(new.name)
    .bind(new.kind.as_str())
    .bind(as_i64(new.samples))
    .bind(shape)
    .bind(as_i64(new.classes))
    .bind(as_i64(new.size_bytes))
    .bind(as_i64(new.data_bytes))
    .bind(new.digest)
    .bind(now_ms())
    .fetch_one(&mut *tx)
    .await;
    match inserted {
        Ok(row) => {
            tx.commit().await?;
            Ok(Inserted::Stored(Box::new(row)))
        }
        Err(error) if is_unique_violation(&error) => Ok(Inserted::Exists),
        Err(error) => Err(error),
    }
}

pub async fn get(db: &Db, name: &str) -> Result<Option<DatasetRow>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {DATASET_COLUMNS} FROM datasets WHERE name = $1"
    )))
    .bind(name)
    .fetch_optional(&db.pool)
    .await
}

/// Every dataset, by name; there are at most `limits.max_datasets`.
pub async fn list(db: &Db) -> Result<Vec<DatasetRow>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {DATASET_COLUMNS} FROM datasets ORDER BY name"
    )))
    .fetch_all(&db.pool)
    .await
}

/// Removes the row. The blob stays: blobs are content-addressed, and
/// another dataset may hold the same bytes.
pub async fn delete(db: &Db, name: &str) -> Result<bool, sqlx::Error> {
    let _writer = db.write_lock().await;
    let deleted = sqlx::query("DELETE FROM datasets WHERE name = $1")
        .bind(name)
        .execute(&db.pool)
        .await?;
    Ok(deleted.rows_affected() > 0)
}

/// The jobs not yet finished whose central evaluation uses dataset `name`.
pub async fn unfinished_jobs_using(db: &Db, name: &str) -> Result<Vec<i64>, sqlx::Error> {
    let rows: Vec<(i64, String)> = sqlx::query_as(
        "SELECT id, config FROM jobs WHERE state IN ('created', 'running', 'paused') ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await?;
    let mut using = Vec::new();
    for (id, config) in rows {
        let spec: super::jobs::JobSpec = from_json("jobs.config", &config)?;
        if spec.evaluation.central_dataset.as_deref() == Some(name) {
            using.push(id);
        }
    }
    Ok(using)
}
