//! Models and their versions. A version's bytes live in the blob store
//! under its digest; the row holds what the server needs without reading
//! the blob: size, trainable layout and lineage.

use crate::store::row::any_row;
use canopy_protocol::update::UpdateLayout;

use super::{Page, from_json};
use crate::db::{Db, now_ms};

any_row! {
    #[derive(Clone, Debug)]
    pub struct VersionRow {
        pub id: i64,
        pub model_name: String,
        pub version: i64,
        pub digest: String,
        pub size_bytes: i64,
        pub trainable_elements: i64,
        pub has_train_step: i64,
        /// Why devices cannot train it, when they cannot (and it was kept).
        pub untrainable_reason: Option<String>,
        pub layout: String,
        pub parent_version_id: Option<i64>,
        pub job_id: Option<i64>,
        pub round_id: Option<i64>,
        pub created_ms: i64,
        /// The parent's number among the model's versions (ids are
        /// server-wide; people count versions per model).
        pub parent_version: Option<i64>,
        /// The number of the round that produced it within its job (0 for a
        /// statistics round), as `round_id` is the round's server-wide id.
        pub round_number: Option<i64>,
    }
}

/// The columns of a [`VersionRow`], from `model_versions v`.
const VERSION_COLUMNS: &str = "v.id, v.model_name, v.version, v.digest, v.size_bytes, \
     v.trainable_elements, v.has_train_step, v.untrainable_reason, v.layout, v.parent_version_id, \
     v.job_id, v.round_id, v.created_ms, \
     (SELECT p.version FROM model_versions p WHERE p.id = v.parent_version_id) AS parent_version, \
     (SELECT r.number FROM rounds r WHERE r.id = v.round_id) AS round_number";

impl VersionRow {
    pub fn layout(&self) -> Result<UpdateLayout, sqlx::Error> {
        from_json("model_versions.layout", &self.layout)
    }
}

/// What a new version is, before it has an id.
pub struct NewVersion<'a> {
    pub model_name: &'a str,
    pub digest: &'a str,
    pub size_bytes: u64,
    pub layout: &'a UpdateLayout,
    /// `None` when devices can train it.
    pub untrainable_reason: Option<&'a str>,
    pub parent_version_id: Option<i64>,
    pub job_id: Option<i64>,
    pub round_id: Option<i64>,
}

/// Adds a version numbered one past the model's latest, creating the
/// model on its first version. Runs inside the caller's transaction.
pub async fn insert_version(
    tx: &mut sqlx::Transaction<'_, sqlx::Any>,
    new: &NewVersion<'_>,
) -> Result<VersionRow, sqlx::Error> {
    let now = now_ms();
    sqlx::query(
        "INSERT INTO models (name, created_ms) VALUES ($1, $2) ON CONFLICT (name) DO NOTHING",
    )
    .bind(new.model_name)
    .bind(now)
    .execute(&mut **tx)
    .await?;
    // Lock the model row so that concurrent uploads number versions apart.
    sqlx::query("UPDATE models SET created_ms = created_ms WHERE name = $1")
        .bind(new.model_name)
        .execute(&mut **tx)
        .await?;
    let (latest,): (i64,) = sqlx::query_as(
        "SELECT COALESCE(MAX(version), 0) FROM model_versions WHERE model_name = $1",
    )
    .bind(new.model_name)
    .fetch_one(&mut **tx)
    .await?;
    let (id,): (i64,) = sqlx::query_as(
        "INSERT INTO model_versions (model_name, version, digest, size_bytes, trainable_elements, \
         has_train_step, untrainable_reason, layout, parent_version_id, job_id, round_id, \
         created_ms) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12) RETURNING id",
    )
    .bind(new.model_name)
    .bind(latest + 1)
    .bind(new.digest)
    .bind(i64::try_from(new.size_bytes).unwrap_or(i64::MAX))
    .bind(i64::try_from(new.layout.num_elements()).unwrap_or(i64::MAX))
    .bind(i64::from(new.untrainable_reason.is_none()))
    .bind(new.untrainable_reason)
    .bind(serde_json::to_string(new.layout).unwrap_or_default())
    .bind(new.parent_version_id)
    .bind(new.job_id)
    .bind(new.round_id)
    .bind(now)
    .fetch_one(&mut **tx)
    .await?;
    // Read back with the numbers of its parent and round, which RETURNING
    // cannot join.
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {VERSION_COLUMNS} FROM model_versions v WHERE v.id = $1"
    )))
    .bind(id)
    .fetch_one(&mut **tx)
    .await
}

pub async fn get_version(db: &Db, id: i64) -> Result<Option<VersionRow>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {VERSION_COLUMNS} FROM model_versions v WHERE v.id = $1"
    )))
    .bind(id)
    .fetch_optional(&db.pool)
    .await
}

/// The first version with this content digest.
pub async fn find_by_digest(db: &Db, digest: &str) -> Result<Option<VersionRow>, sqlx::Error> {
    find_by_digest_with(&db.pool, digest).await
}

/// [`find_by_digest`] on any executor, e.g. inside a transaction.
pub async fn find_by_digest_with<'e, E>(
    executor: E,
    digest: &str,
) -> Result<Option<VersionRow>, sqlx::Error>
where
    E: sqlx::Executor<'e, Database = sqlx::Any>,
{
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {VERSION_COLUMNS} FROM model_versions v WHERE v.digest = $1 ORDER BY v.id LIMIT 1"
    )))
    .bind(digest)
    .fetch_optional(executor)
    .await
}

pub async fn find_version(
    db: &Db,
    model_name: &str,
    version: i64,
) -> Result<Option<VersionRow>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {VERSION_COLUMNS} FROM model_versions v WHERE v.model_name = $1 AND v.version = $2"
    )))
    .bind(model_name)
    .bind(version)
    .fetch_optional(&db.pool)
    .await
}

pub async fn list_versions(
    db: &Db,
    model_name: &str,
    page: Page,
) -> Result<Vec<VersionRow>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {VERSION_COLUMNS} FROM model_versions v WHERE v.model_name = $1 \
         AND v.version > $2 ORDER BY v.version LIMIT $3"
    )))
    .bind(model_name)
    .bind(page.after)
    .bind(page.limit)
    .fetch_all(&db.pool)
    .await
}

/// Whether a model of this name exists (it does from its first version).
pub async fn exists(db: &Db, name: &str) -> Result<bool, sqlx::Error> {
    let found: Option<(String,)> = sqlx::query_as("SELECT name FROM models WHERE name = $1")
        .bind(name)
        .fetch_optional(&db.pool)
        .await?;
    Ok(found.is_some())
}

any_row! {
    #[derive(Clone, Debug)]
    pub struct ModelRow {
        pub name: String,
        pub created_ms: i64,
        pub versions: i64,
    }
}

/// Models by name; the cursor is the last name seen.
pub async fn list_models(
    db: &Db,
    after_name: &str,
    limit: i64,
) -> Result<Vec<ModelRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT m.name, m.created_ms, \
         (SELECT COUNT(*) FROM model_versions v WHERE v.model_name = m.name) AS versions \
         FROM models m WHERE m.name > $1 ORDER BY m.name LIMIT $2",
    )
    .bind(after_name)
    .bind(limit)
    .fetch_all(&db.pool)
    .await
}

/// The chain of parents of a version, newest first, at most `limit` long.
pub async fn lineage(db: &Db, id: i64, limit: usize) -> Result<Vec<VersionRow>, sqlx::Error> {
    let mut chain = Vec::new();
    let mut next = Some(id);
    while let Some(id) = next {
        if chain.len() >= limit {
            break;
        }
        let Some(row) = get_version(db, id).await? else {
            break;
        };
        next = row.parent_version_id;
        chain.push(row);
    }
    Ok(chain)
}
