//! An edge aggregator's sub-rounds and what it owes the cloud for each
//! (ARCHITECTURE.md, "The edge tier"). A sub-round is a local job on the
//! cloud's version, of one round or of `edges.rounds` (buffered or not),
//! run by the same orchestrator as every job; its uplink row records the
//! cloud's task, and, once the last round has closed, the result its
//! devices' updates make, until the cloud has it.

use canopy_protocol::messages::TaskKind;
use canopy_protocol::update::UpdateLayout;

use super::jobs::{JOB_COLUMNS, JobRow, JobSpec, JobState};
use super::models::{self, NewVersion};
use super::relayed_signatures;
use super::row::any_row;
use super::text_enum;
use crate::db::{Db, now_ms};
use crate::signing::ModelSignature;
use crate::store::rounds::{ROUND_COLUMNS, RoundRow, Tx};

text_enum! {
    /// Where an edge's result for one cloud round stands.
    pub enum UplinkState {
        /// The local rounds run.
        Collecting = "collecting",
        /// The last local round closed; `partial` waits to reach the cloud.
        Ready = "ready",
        /// The cloud accepted it.
        Sent = "sent",
        /// The sub-round or its upload failed (`reason`); the cloud was
        /// told, or its round is over.
        Failed = "failed",
    }
}

text_enum! {
    /// What an edge owes the cloud for a cloud round: one of each.
    pub enum UplinkKind {
        /// A training (or statistics) sub-round's weighted mean.
        Result = "result",
        /// Its devices' evaluation of the round's version: the
        /// sample-weighted mean of their reports.
        Evaluation = "evaluation",
    }
}

impl UplinkKind {
    /// The uplink a cloud task makes.
    pub fn of(task: TaskKind) -> UplinkKind {
        match task {
            TaskKind::Evaluate => UplinkKind::Evaluation,
            TaskKind::Train | TaskKind::Statistics => UplinkKind::Result,
        }
    }
}

any_row! {
    #[derive(Clone, Debug)]
    pub struct UplinkRow {
        pub job_id: i64,
        pub cloud_round_id: i64,
        pub kind: UplinkKind as String,
        /// The cloud's task, as JSON.
        pub cloud_task: String,
        pub state: UplinkState as String,
        /// The encoded update for the cloud, once `ready`.
        pub partial: Option<Vec<u8>>,
        pub num_samples: Option<i64>,
        pub reason: String,
        pub job_state: JobState as String,
        pub job_status: String,
    }
}

const UPLINK_COLUMNS: &str = "u.job_id, u.cloud_round_id, u.task_kind AS kind, u.cloud_task, \
     u.state, u.partial, u.num_samples, u.reason, j.state AS job_state, \
     j.status_message AS job_status";

/// A sub-round to open: the cloud's task, the version it trains, and the
/// local job that runs it.
pub struct NewSubRound<'a> {
    pub cloud_round_id: i64,
    pub kind: UplinkKind,
    pub cloud_task_json: &'a str,
    /// The name the cloud's model goes by on the edge.
    pub model_name: &'a str,
    pub digest: &'a str,
    pub size_bytes: u64,
    pub layout: &'a UpdateLayout,
    pub signature: &'a ModelSignature,
    /// The local job; its `model_version_id` is filled in here.
    pub spec: JobSpec,
}

/// Opens a sub-round in one transaction: the cloud's version (once per
/// digest) with its signature, a running local job on it, and its uplink
/// row. The same cloud round again (a restarted edge polled it twice)
/// answers the uplink it already has.
pub async fn begin(db: &Db, new: NewSubRound<'_>) -> Result<UplinkRow, sqlx::Error> {
    {
        let _writer = db.write_lock().await;
        let mut tx = db.pool.begin().await?;
        if by_cloud_round(&mut tx, new.cloud_round_id, new.kind)
            .await?
            .is_none()
        {
            let version_id = version_for(&mut tx, &new).await?;
            relayed_signatures::put(&mut tx, new.digest, new.signature).await?;
            let mut spec = new.spec;
            spec.model_version_id = version_id;
            let job = insert_running_job(&mut tx, &spec).await?;
            sqlx::query(
                "INSERT INTO uplinks (job_id, cloud_round_id, task_kind, cloud_task, state, \
                 created_ms, updated_ms) VALUES ($1, $2, $3, $4, 'collecting', $5, $5)",
            )
            .bind(job.id)
            .bind(new.cloud_round_id)
            .bind(new.kind.as_str())
            .bind(new.cloud_task_json)
            .bind(now_ms())
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
    }
    let mut tx = db.pool.begin().await?;
    let row = by_cloud_round(&mut tx, new.cloud_round_id, new.kind).await?;
    tx.rollback().await?;
    row.ok_or(sqlx::Error::RowNotFound)
}

/// The edge's version of the cloud's model file: the one with its digest,
/// or a new version of `model_name`.
async fn version_for(tx: &mut Tx<'_>, new: &NewSubRound<'_>) -> Result<i64, sqlx::Error> {
    if let Some(existing) = models::find_by_digest_with(&mut **tx, new.digest).await? {
        return Ok(existing.id);
    }
    let version = models::insert_version(
        tx,
        &NewVersion {
            model_name: new.model_name,
            digest: new.digest,
            size_bytes: new.size_bytes,
            layout: new.layout,
            untrainable_reason: None,
            parent_version_id: None,
            job_id: None,
            round_id: None,
        },
    )
    .await?;
    Ok(version.id)
}

async fn insert_running_job(tx: &mut Tx<'_>, spec: &JobSpec) -> Result<JobRow, sqlx::Error> {
    let now = now_ms();
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "INSERT INTO jobs (name, model_version_id, current_version_id, config, state, \
         created_ms, updated_ms, started_ms) VALUES ($1, $2, $2, $3, 'running', $4, $4, $4) \
         RETURNING {JOB_COLUMNS}"
    )))
    .bind(spec.name.clone())
    .bind(spec.model_version_id)
    .bind(serde_json::to_string(spec).unwrap_or_default())
    .bind(now)
    .fetch_one(&mut **tx)
    .await
}

async fn by_cloud_round(
    tx: &mut Tx<'_>,
    cloud_round_id: i64,
    kind: UplinkKind,
) -> Result<Option<UplinkRow>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {UPLINK_COLUMNS} FROM uplinks u JOIN jobs j ON j.id = u.job_id \
         WHERE u.cloud_round_id = $1 AND u.task_kind = $2"
    )))
    .bind(cloud_round_id)
    .bind(kind.as_str())
    .fetch_optional(&mut **tx)
    .await
}

/// The uplink of a cloud round's task of `kind`, if the edge opened a
/// sub-round for it.
pub async fn for_cloud_round(
    db: &Db,
    cloud_round_id: i64,
    kind: UplinkKind,
) -> Result<Option<UplinkRow>, sqlx::Error> {
    let mut tx = db.pool.begin().await?;
    let row = by_cloud_round(&mut tx, cloud_round_id, kind).await?;
    tx.rollback().await?;
    Ok(row)
}

/// The uplink of a local job, if it runs a sub-round.
pub async fn for_job<'e, E>(executor: E, job_id: i64) -> Result<Option<UplinkRow>, sqlx::Error>
where
    E: sqlx::Executor<'e, Database = sqlx::Any>,
{
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {UPLINK_COLUMNS} FROM uplinks u JOIN jobs j ON j.id = u.job_id \
         WHERE u.job_id = $1"
    )))
    .bind(job_id)
    .fetch_optional(executor)
    .await
}

/// The latest local round of an uplink's job, if opened: an evaluation
/// sub-round's one round.
pub async fn local_round(db: &Db, job_id: i64) -> Result<Option<RoundRow>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {ROUND_COLUMNS} FROM rounds WHERE job_id = $1 ORDER BY id DESC LIMIT 1"
    )))
    .bind(job_id)
    .fetch_optional(&db.pool)
    .await
}

/// Uplinks the edge has work for: results to send, evaluations whose
/// local job completed (it completes once its evaluation has closed), and
/// sub-rounds whose local job stopped without a result (the cloud is told
/// why). A training sub-round's uplink is ready before its job completes.
pub async fn pending(db: &Db, limit: i64) -> Result<Vec<UplinkRow>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {UPLINK_COLUMNS} FROM uplinks u JOIN jobs j ON j.id = u.job_id \
         WHERE u.state = 'ready' OR (u.state = 'collecting' AND j.state IN \
         ('completed', 'failed', 'cancelled')) ORDER BY u.job_id LIMIT $1"
    )))
    .bind(limit)
    .fetch_all(&db.pool)
    .await
}

/// Keeps a closed sub-round's result for the cloud, inside the
/// transaction that closes its round.
pub async fn keep_partial(
    tx: &mut Tx<'_>,
    job_id: i64,
    partial: &[u8],
    num_samples: u64,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE uplinks SET state = 'ready', partial = $1, num_samples = $2, updated_ms = $3 \
         WHERE job_id = $4 AND state = 'collecting'",
    )
    .bind(partial)
    .bind(i64::try_from(num_samples).unwrap_or(i64::MAX))
    .bind(now_ms())
    .bind(job_id)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// The cloud has the result: the edge forgets the sum (it keeps no
/// aggregate longer than it must).
pub async fn mark_sent(db: &Db, job_id: i64) -> Result<(), sqlx::Error> {
    finish(db, job_id, UplinkState::Sent, "").await
}

pub async fn mark_failed(db: &Db, job_id: i64, reason: &str) -> Result<(), sqlx::Error> {
    finish(db, job_id, UplinkState::Failed, reason).await
}

async fn finish(db: &Db, job_id: i64, state: UplinkState, reason: &str) -> Result<(), sqlx::Error> {
    let _writer = db.write_lock().await;
    sqlx::query(
        "UPDATE uplinks SET state = $1, partial = NULL, reason = $2, updated_ms = $3 \
         WHERE job_id = $4",
    )
    .bind(state.as_str())
    .bind(reason)
    .bind(now_ms())
    .bind(job_id)
    .execute(&db.pool)
    .await?;
    Ok(())
}
