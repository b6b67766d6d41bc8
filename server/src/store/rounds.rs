//! Rounds and their participants: the durable state machine that the
//! orchestrator drives and device uploads feed.
//!
//! Round states: `selecting` → `training` → `aggregating` → `succeeded` or
//! `failed`. Participant states: `selected` → `delivered` (task fetched) →
//! `uploaded`, or `dropped` when the round closes without their update, or
//! `ineligible` when the device withdrew because it no longer met the
//! job's device policy (not a dropout).
//! Every transition is a conditional UPDATE on the current state, inside a
//! transaction that holds the round's row lock on PostgreSQL, so two server
//! processes can never both act on one round. A participant's task state
//! machine is the one evaluators share (`task_state`).

use crate::store::row::any_row;
use std::collections::HashSet;

use super::task_state::{self, Admission, States, TaskState, Value};
use super::{Page, parse_state, text_enum};
use crate::db::{Db, now_ms};
use crate::fedavg;
use crate::round_failure::RoundFailure;
use canopy_protocol::update;

pub use super::task_state::ParticipantState;

text_enum! {
    /// A round's state: `selecting` → `training` → `aggregating` →
    /// `succeeded` or `failed`.
    pub enum RoundState {
        Selecting = "selecting",
        Training = "training",
        Aggregating = "aggregating",
        Succeeded = "succeeded",
        Failed = "failed",
    }
}

text_enum! {
    /// What a round does: trains the model, or (`statistics`, number 0,
    /// before a job trains a model whose input statistics are unfitted)
    /// adds up the devices' input moments into a fitted version.
    pub enum RoundKind {
        Train = "train",
        Statistics = "statistics",
    }
}

impl RoundState {
    /// Selecting, training or aggregating: not yet succeeded or failed.
    pub fn is_open(self) -> bool {
        matches!(
            self,
            RoundState::Selecting | RoundState::Training | RoundState::Aggregating
        )
    }

    /// Whether a round in this state hands out its participants' tasks and
    /// takes their updates (an upload also checks the deadline): while it
    /// trains, and a buffer of an asynchronous job also once it has closed,
    /// since its devices train on past the close, until their deadline.
    /// Architecture invariant: only such a buffer keeps pending
    /// participants after its close; every other close drops them.
    pub fn takes_updates(self, buffered: bool) -> bool {
        match self {
            RoundState::Training => true,
            RoundState::Aggregating | RoundState::Succeeded => buffered,
            RoundState::Selecting | RoundState::Failed => false,
        }
    }
}

/// The round states for which `keep` holds, as an SQL list.
fn states_sql(keep: impl Fn(RoundState) -> bool) -> String {
    let names: Vec<String> = RoundState::ALL
        .iter()
        .filter(|&&state| keep(state))
        .map(|state| format!("'{}'", state.as_str()))
        .collect();
    format!("({})", names.join(", "))
}

/// [`RoundState::takes_updates`] of round `r`, as SQL.
pub fn takes_updates_sql() -> String {
    format!(
        "(r.state IN {} OR (r.max_staleness IS NOT NULL AND r.state IN {}))",
        states_sql(|state| state.takes_updates(false)),
        states_sql(|state| state.takes_updates(true))
    )
}

/// The open round states, as SQL; the text of [`RoundState`]'s open variants.
pub const OPEN_STATES: &str = "('selecting', 'training', 'aggregating')";
/// The pending participant states ([`ParticipantState::is_pending`]), as SQL.
pub const PENDING_STATES: States<ParticipantState> = States::PENDING;
/// The states of participants that have left ([`ParticipantState::has_left`]), as SQL.
pub const LEFT_STATES: States<ParticipantState> = States::LEFT;

any_row! {
    #[derive(Clone, Debug)]
    pub struct RoundRow {
        pub id: i64,
        pub job_id: i64,
        pub number: i64,
        pub attempt: i64,
        pub state: RoundState as String,
        pub base_version_id: i64,
        pub result_version_id: Option<i64>,
        pub target_devices: i64,
        pub min_devices: i64,
        pub selected_count: i64,
        pub updates_accepted: i64,
        pub weight_total: i64,
        pub bytes_in: i64,
        pub bytes_out: i64,
        pub dropouts: i64,
        /// Participants that withdrew because they no longer met the job's
        /// device policy; not dropouts.
        pub ineligible: i64,
        pub status_message: String,
        pub kind: RoundKind as String,
        pub created_ms: i64,
        pub training_started_ms: Option<i64>,
        pub deadline_ms: Option<i64>,
        pub closed_ms: Option<i64>,
        pub finished_ms: Option<i64>,
        /// A secure round's SecAgg+ stage; `None` for plain rounds.
        pub secagg_stage: Option<String>,
        /// The federated evaluation of the round's version, if it has one;
        /// read it through [`RoundRow::evaluation_state`].
        eval_state: Option<String>,
        pub central_eval_loss: Option<f64>,
        pub central_eval_accuracy: Option<f64>,
        pub central_eval_samples: Option<i64>,
        /// The central evaluation of the round's version, if its job has one;
        /// read it through [`RoundRow::central_state`].
        central_eval_state: Option<String>,
        /// Why the central evaluation failed.
        pub central_eval_error: Option<String>,
        /// A failed round's [`crate::round_failure::FailureKind`], by name.
        pub failure_kind: Option<String>,
        /// A buffer of an asynchronous job: the oldest update it takes, in
        /// versions; `None` in a synchronous round.
        pub max_staleness: Option<i64>,
        /// A round of a differentially private job: the L2 norm each
        /// update is clipped to as it folds, every update weighing the
        /// same; `None` in any other round.
        pub clip_norm: Option<f64>,
        /// A private round's sampling rate: devices selected over those it
        /// could have selected.
        pub dp_sampling_rate: Option<f64>,
        /// The job's ε after a private round succeeded.
        pub dp_epsilon: Option<f64>,
        /// A private round's updates whose norm was within its clip, as
        /// folded: what adaptive clipping moves the next round's clip by.
        pub dp_unclipped: i64,
        /// A robust round's rule: it stores each update in the blob store
        /// instead of folding it into a sum (`crate::robust`); read it
        /// through [`RoundRow::robust_rule`].
        robust_rule: Option<String>,
        /// When a robust round's stored updates were deleted, after it
        /// closed.
        pub updates_deleted_ms: Option<i64>,
    }
}

pub const ROUND_COLUMNS: &str = "id, job_id, number, attempt, state, base_version_id, \
     result_version_id, target_devices, min_devices, selected_count, updates_accepted, \
     weight_total, bytes_in, bytes_out, dropouts, ineligible, status_message, kind, created_ms, \
     training_started_ms, deadline_ms, closed_ms, finished_ms, secagg_stage, eval_state, \
     central_eval_loss, central_eval_accuracy, central_eval_samples, central_eval_state, \
     central_eval_error, failure_kind, max_staleness, clip_norm, dp_sampling_rate, dp_epsilon, \
     dp_unclipped, robust_rule, updates_deleted_ms";

impl RoundRow {
    /// Whether the round is a buffer of an asynchronous job.
    pub fn is_buffer(&self) -> bool {
        self.max_staleness.is_some()
    }

    /// The state of the federated evaluation of the round's version.
    pub fn evaluation_state(
        &self,
    ) -> Result<Option<super::evaluations::EvaluationState>, sqlx::Error> {
        self.eval_state
            .clone()
            .map(|text| parse_state("rounds.eval_state", text))
            .transpose()
    }

    /// A robust round's rule; `None` in a round that folds a sum.
    pub fn robust_rule(&self) -> Result<Option<crate::robust::RobustRule>, sqlx::Error> {
        self.robust_rule
            .clone()
            .map(|text| parse_state("rounds.robust_rule", text))
            .transpose()
    }

    /// The state of the central evaluation of the round's version.
    pub fn central_state(&self) -> Result<Option<super::evaluations::CentralState>, sqlx::Error> {
        self.central_eval_state
            .clone()
            .map(|text| parse_state("rounds.central_eval_state", text))
            .transpose()
    }
}

pub type Tx<'a> = sqlx::Transaction<'a, sqlx::Any>;

/// A round to open: its job, kind, number and attempt, the version it
/// starts from and how many devices it wants.
pub struct NewRound {
    pub kind: RoundKind,
    pub job_id: i64,
    pub number: i64,
    pub attempt: i64,
    pub base_version_id: i64,
    pub target_devices: i64,
    pub min_devices: i64,
    /// A buffer of an asynchronous job: its maximum staleness.
    pub max_staleness: Option<i64>,
    /// A training round of a differentially private job: its clip norm.
    pub clip_norm: Option<f64>,
    /// A training round of a robust job: its rule.
    pub robust_rule: Option<crate::robust::RobustRule>,
}

/// Opens the next round of a job unless one is open; the partial unique
/// index settles races between processes.
pub async fn open_round(tx: &mut Tx<'_>, new: &NewRound) -> Result<Option<i64>, sqlx::Error> {
    let row: Option<(i64,)> = sqlx::query_as(
        "INSERT INTO rounds (job_id, number, attempt, state, base_version_id, target_devices, \
         min_devices, created_ms, kind, max_staleness, clip_norm, robust_rule) \
         VALUES ($1, $2, $3, 'selecting', $4, $5, $6, $7, $8, $9, $10, $11) \
         ON CONFLICT DO NOTHING RETURNING id",
    )
    .bind(new.job_id)
    .bind(new.number)
    .bind(new.attempt)
    .bind(new.base_version_id)
    .bind(new.target_devices)
    .bind(new.min_devices)
    .bind(now_ms())
    .bind(new.kind.as_str())
    .bind(new.max_staleness)
    .bind(new.clip_norm)
    .bind(new.robust_rule.map(|rule| rule.as_str()))
    .fetch_optional(&mut **tx)
    .await?;
    Ok(row.map(|(id,)| id))
}

/// Records the sampling rate a private round's selection had.
pub async fn set_sampling_rate(tx: &mut Tx<'_>, id: i64, rate: f64) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE rounds SET dp_sampling_rate = $1 WHERE id = $2")
        .bind(rate)
        .bind(id)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Records the job's ε after a private round, in the transaction that
/// records its version.
pub async fn set_epsilon(tx: &mut Tx<'_>, id: i64, epsilon: f64) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE rounds SET dp_epsilon = $1 WHERE id = $2")
        .bind(epsilon)
        .bind(id)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Ends a job that has spent what it may: its round, not yet begun (no
/// device was selected), fails with `failure`, and the job completes with
/// the reason as its status.
pub async fn stop_job(
    tx: &mut Tx<'_>,
    round: &RoundRow,
    failure: &RoundFailure,
) -> Result<(), sqlx::Error> {
    mark_failed(tx, round.id, failure, now_ms()).await?;
    let message = format!("stopped before round {}: {failure}", round.number);
    super::jobs::complete(tx, round.job_id, &message).await
}

/// Opens an asynchronous job's next buffer straight into `training`, in
/// the transaction that finishes the one before it, so that updates
/// arriving meanwhile have a buffer to fold into; the orchestrator tops
/// it up with devices on its next tick. `None` when a round is open.
pub async fn open_buffer(
    tx: &mut Tx<'_>,
    new: &NewRound,
    deadline_ms: i64,
) -> Result<Option<i64>, sqlx::Error> {
    debug_assert!(new.max_staleness.is_some() && new.kind == RoundKind::Train);
    let Some(id) = open_round(tx, new).await? else {
        return Ok(None);
    };
    // Training with no devices yet: the orchestrator's top-up selects them.
    task_state::open::<ParticipantState>(tx, id, &[], deadline_ms).await?;
    Ok(Some(id))
}

/// Adds devices to a buffer that is training: an asynchronous job keeps
/// its `concurrency` devices busy as others finish.
pub async fn top_up(tx: &mut Tx<'_>, round_id: i64, device_ids: &[i64]) -> Result<(), sqlx::Error> {
    task_state::select::<ParticipantState>(tx, round_id, device_ids).await?;
    sqlx::query(
        "UPDATE rounds SET selected_count = selected_count + $1 WHERE id = $2 AND state = 'training'",
    )
    .bind(device_ids.len() as i64)
    .bind(round_id)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// The condition that participant `p` of round `r` holds its device busy
/// (`$1` binds now): pending in an open round, or in a closed buffer of a
/// job still under way, until the round's deadline. Selection skips busy
/// devices, and an asynchronous job counts its busy devices against its
/// concurrency.
fn busy_sql() -> String {
    format!(
        "p.state IN {PENDING_STATES} AND (r.state IN {OPEN_STATES} OR ({} AND r.deadline_ms > $1 \
         AND EXISTS (SELECT 1 FROM jobs j WHERE j.id = r.job_id \
         AND j.state IN ('created', 'running', 'paused'))))",
        takes_updates_sql()
    )
}

/// Devices an asynchronous job holds busy now, over all its buffers.
pub async fn busy_in_job(tx: &mut Tx<'_>, job_id: i64) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT COUNT(*) FROM participants p JOIN rounds r ON r.id = p.round_id \
         WHERE r.job_id = $2 AND {}",
        busy_sql()
    )))
    .bind(now_ms())
    .bind(job_id)
    .fetch_one(&mut **tx)
    .await
}

/// The states of a closed buffer that still takes updates
/// ([`RoundState::takes_updates`] of a buffer but not of a round), as SQL.
fn closed_buffer_states_sql() -> String {
    states_sql(|state| state.takes_updates(true) && !state.takes_updates(false))
}

/// Drops the pending participants of `rounds` with `reason`, counting
/// them as each round's dropouts; how many.
async fn drop_pending_in(
    tx: &mut Tx<'_>,
    rounds: &[i64],
    reason: &str,
) -> Result<u64, sqlx::Error> {
    let mut total = 0;
    for &round_id in rounds {
        let dropped = task_state::drop_pending::<ParticipantState>(tx, round_id, reason).await?;
        if dropped > 0 {
            sqlx::query("UPDATE rounds SET dropouts = dropouts + $1 WHERE id = $2")
                .bind(dropped as i64)
                .bind(round_id)
                .execute(&mut **tx)
                .await?;
        }
        total += dropped;
    }
    Ok(total)
}

/// Drops the participants of an asynchronous job's closed buffers whose
/// deadline has passed, counting them as their rounds' dropouts, and
/// returns how many. Its own transaction takes the rounds' row locks in
/// id order, as every fold does (the participant's round, then the open
/// buffer), so the two never wait on each other.
pub async fn expire_buffered(db: &Db, job_id: i64) -> Result<u64, sqlx::Error> {
    let now = now_ms();
    let _writer = db.write_lock().await;
    let mut tx = db.pool.begin().await?;
    let expired: Vec<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT r.id FROM rounds r WHERE r.job_id = $1 AND r.max_staleness IS NOT NULL \
         AND r.state IN {} AND r.deadline_ms <= $2 AND EXISTS ( \
         SELECT 1 FROM participants p WHERE p.round_id = r.id AND p.state IN {PENDING_STATES}) \
         ORDER BY r.id{}",
        closed_buffer_states_sql(),
        db.for_update()
    )))
    .bind(job_id)
    .bind(now)
    .fetch_all(&mut *tx)
    .await?;
    let reason = "timeout: no update before the deadline of the buffer that selected it";
    let total = drop_pending_in(&mut tx, &expired, reason).await?;
    tx.commit().await?;
    Ok(total)
}

/// Drops every pending participant of a job's closed buffers, when its
/// last version is made: nothing will take their updates.
pub async fn drop_buffered(tx: &mut Tx<'_>, job_id: i64, reason: &str) -> Result<(), sqlx::Error> {
    let rounds: Vec<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT id FROM rounds WHERE job_id = $1 AND max_staleness IS NOT NULL \
         AND state IN {} ORDER BY id",
        closed_buffer_states_sql()
    )))
    .bind(job_id)
    .fetch_all(&mut **tx)
    .await?;
    drop_pending_in(tx, &rounds, reason).await?;
    Ok(())
}

pub async fn get(db: &Db, id: i64) -> Result<Option<RoundRow>, sqlx::Error> {
    get_with(&db.pool, id).await
}

/// [`get`] on any executor, e.g. inside a transaction.
pub async fn get_with<'e, E>(executor: E, id: i64) -> Result<Option<RoundRow>, sqlx::Error>
where
    E: sqlx::Executor<'e, Database = sqlx::Any>,
{
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {ROUND_COLUMNS} FROM rounds WHERE id = $1"
    )))
    .bind(id)
    .fetch_optional(executor)
    .await
}

pub async fn list_for_job(db: &Db, job_id: i64, page: Page) -> Result<Vec<RoundRow>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {ROUND_COLUMNS} FROM rounds WHERE job_id = $1 AND id > $2 ORDER BY id LIMIT $3"
    )))
    .bind(job_id)
    .bind(page.after)
    .bind(page.limit)
    .fetch_all(&db.pool)
    .await
}

/// A job's rounds newest first, those with ids below `before` (all when
/// `None`): the page a dashboard polls for a long job's latest rounds.
pub async fn list_for_job_newest(
    db: &Db,
    job_id: i64,
    before: Option<i64>,
    limit: i64,
) -> Result<Vec<RoundRow>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {ROUND_COLUMNS} FROM rounds WHERE job_id = $1 AND id < $2 ORDER BY id DESC LIMIT $3"
    )))
    .bind(job_id)
    .bind(before.unwrap_or(i64::MAX))
    .bind(limit)
    .fetch_all(&db.pool)
    .await
}

/// Ids of open rounds, oldest first.
pub async fn open_round_ids(db: &Db, limit: i64) -> Result<Vec<i64>, sqlx::Error> {
    let rows: Vec<(i64,)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT id FROM rounds WHERE state IN {OPEN_STATES} ORDER BY id LIMIT $1"
    )))
    .bind(limit)
    .fetch_all(&db.pool)
    .await?;
    Ok(rows.into_iter().map(|(id,)| id).collect())
}

/// Locks an open round for this transaction, or returns `None` when it is
/// closed or another process holds it.
pub async fn claim(db: &Db, tx: &mut Tx<'_>, id: i64) -> Result<Option<RoundRow>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {ROUND_COLUMNS} FROM rounds WHERE id = $1 AND state IN {OPEN_STATES}{}",
        db.skip_locked()
    )))
    .bind(id)
    .fetch_optional(&mut **tx)
    .await
}

/// Says why a round is waiting, on the round and on its job, where an
/// operator looks first.
pub async fn set_status(tx: &mut Tx<'_>, id: i64, message: &str) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE rounds SET status_message = $1 WHERE id = $2")
        .bind(message)
        .bind(id)
        .execute(&mut **tx)
        .await?;
    sqlx::query(
        "UPDATE jobs SET status_message = $1 WHERE id = (SELECT job_id FROM rounds WHERE id = $2)",
    )
    .bind(message)
    .bind(id)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

any_row! {
    /// A device that may be selected, with what the filters look at.
    #[derive(Clone, Debug)]
    pub struct CandidateRow {
        pub id: i64,
        pub tier: String,
        pub backends: String,
        pub tags: String,
        pub datasets: Option<String>,
        /// JSON GPU adapter reported at enrollment.
        pub gpu: Option<String>,
        /// JSON device conditions from the latest heartbeat that had them.
        pub conditions: Option<String>,
        /// 1 when it installed a device authority's certificate, else 0 (an
        /// integer: SQLite has no boolean to decode).
        pub certified: i64,
        /// Its role (`DeviceRole`'s name).
        pub role: String,
    }
}

/// The columns of a [`CandidateRow`], from `devices d`.
const CANDIDATE_COLUMNS: &str = "d.id, d.tier, d.backends, d.tags, d.datasets, d.gpu, \
     d.conditions, CAST(CASE WHEN d.certificate IS NULL THEN 0 ELSE 1 END AS BIGINT) AS certified, \
     d.role";

/// Every unrevoked device, online or not, busy or not: those that could
/// ever be selected (a job's creation checks them). Streamed.
pub fn enrolled_candidates(
    db: &Db,
) -> futures_util::stream::BoxStream<'_, Result<CandidateRow, sqlx::Error>> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {CANDIDATE_COLUMNS} FROM devices d WHERE d.revoked_ms IS NULL ORDER BY d.id"
    )))
    .fetch(&db.pool)
}

/// Online, unrevoked devices that are not busy in another round and, for
/// selection into `training_round`, not yet in it (a device takes part in a round once: an
/// asynchronous job's device that finished in the open buffer waits for
/// the next). Streamed, so selection memory is bounded by the sample it
/// keeps.
pub fn candidates<'a>(
    tx: &'a mut Tx<'_>,
    online_since_ms: i64,
    training_round: Option<i64>,
) -> futures_util::stream::BoxStream<'a, Result<CandidateRow, sqlx::Error>> {
    let not_in_round = match training_round {
        Some(_) => {
            " AND NOT EXISTS (SELECT 1 FROM participants q WHERE q.round_id = $3 \
             AND q.device_id = d.id)"
        }
        None => "",
    };
    let query = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {CANDIDATE_COLUMNS} FROM devices d \
         WHERE d.revoked_ms IS NULL AND d.last_seen_ms >= $2 AND NOT EXISTS ( \
           SELECT 1 FROM participants p JOIN rounds r ON r.id = p.round_id \
           WHERE p.device_id = d.id AND {}){not_in_round} \
         ORDER BY d.id",
        busy_sql()
    )))
    .bind(now_ms())
    .bind(online_since_ms);
    match training_round {
        Some(round_id) => query.bind(round_id).fetch(&mut **tx),
        None => query.fetch(&mut **tx),
    }
}

/// Stops accepting updates: `training` → `aggregating`; devices that did
/// not upload become dropouts, with `drop_reason` saying why. A buffer
/// closed by its size passes `None`: its devices train on, and a later
/// buffer takes their updates.
pub async fn close(
    tx: &mut Tx<'_>,
    round_id: i64,
    drop_reason: Option<&str>,
) -> Result<(), sqlx::Error> {
    let dropped = match drop_reason {
        Some(reason) => task_state::drop_pending::<ParticipantState>(tx, round_id, reason).await?,
        None => 0,
    };
    sqlx::query(
        "UPDATE rounds SET state = 'aggregating', closed_ms = $1, dropouts = dropouts + $2 \
         WHERE id = $3 AND state = 'training'",
    )
    .bind(now_ms())
    .bind(dropped as i64)
    .bind(round_id)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// The weighted sum of the round's accepted updates, `None` before any.
/// It lives in `round_sums`, apart from the round's row, so that reading or
/// updating the row never touches a model-sized value (see the migration
/// `0017_round_sums.sql`).
pub async fn update_sum(tx: &mut Tx<'_>, round_id: i64) -> Result<Option<Vec<u8>>, sqlx::Error> {
    let sum: Option<(Vec<u8>,)> =
        sqlx::query_as("SELECT update_sum FROM round_sums WHERE round_id = $1")
            .bind(round_id)
            .fetch_optional(&mut **tx)
            .await?;
    Ok(sum.map(|(sum,)| sum))
}

/// Replaces the round's running sum.
pub async fn store_sum(tx: &mut Tx<'_>, round_id: i64, sum: Vec<u8>) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO round_sums (round_id, update_sum) VALUES ($1, $2) \
         ON CONFLICT (round_id) DO UPDATE SET update_sum = excluded.update_sum",
    )
    .bind(round_id)
    .bind(sum)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Deletes the round's running sum once the round has ended.
pub async fn clear_sum(tx: &mut Tx<'_>, round_id: i64) -> Result<(), sqlx::Error> {
    sqlx::query("DELETE FROM round_sums WHERE round_id = $1")
        .bind(round_id)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// `aggregating` → `succeeded`, and the job moves on to the new version.
/// The job completes with its last round, unless that round's version is
/// still being evaluated (the orchestrator completes it once that closes).
pub async fn succeed(
    tx: &mut Tx<'_>,
    round: &RoundRow,
    new_version_id: i64,
    total_rounds: i64,
    evaluation_open: bool,
) -> Result<(), sqlx::Error> {
    let completes_after = if evaluation_open {
        i64::MAX
    } else {
        total_rounds
    };
    let now = now_ms();
    super::secagg::purge(tx, round.id).await?;
    clear_sum(tx, round.id).await?;
    sqlx::query(
        "UPDATE rounds SET state = 'succeeded', result_version_id = $1, finished_ms = $2, \
         status_message = '' WHERE id = $3",
    )
    .bind(new_version_id)
    .bind(now)
    .bind(round.id)
    .execute(&mut **tx)
    .await?;
    sqlx::query(
        "UPDATE jobs SET current_version_id = $1, rounds_completed = rounds_completed + 1, \
         round_failures = 0, updated_ms = $2, status_message = '', \
         state = CASE WHEN rounds_completed + 1 >= $3 THEN 'completed' ELSE state END, \
         finished_ms = CASE WHEN rounds_completed + 1 >= $3 THEN $2 ELSE finished_ms END \
         WHERE id = $4",
    )
    .bind(new_version_id)
    .bind(now)
    .bind(completes_after)
    .bind(round.job_id)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// A statistics round's `aggregating` → `succeeded`: the fitted version
/// becomes the one the job's first training round starts from; no round
/// of the job's count is used up.
pub async fn succeed_statistics(
    tx: &mut Tx<'_>,
    round: &RoundRow,
    fitted_version_id: i64,
) -> Result<(), sqlx::Error> {
    let now = now_ms();
    clear_sum(tx, round.id).await?;
    sqlx::query(
        "UPDATE rounds SET state = 'succeeded', result_version_id = $1, finished_ms = $2, \
         status_message = '' WHERE id = $3 AND state = 'aggregating'",
    )
    .bind(fitted_version_id)
    .bind(now)
    .bind(round.id)
    .execute(&mut **tx)
    .await?;
    sqlx::query(
        "UPDATE jobs SET round_failures = 0, status_message = '', updated_ms = $1 WHERE id = $2",
    )
    .bind(now)
    .bind(round.job_id)
    .execute(&mut **tx)
    .await?;
    super::jobs::set_start_version(tx, round.job_id, fitted_version_id).await
}

/// An edge's sub-round: `aggregating` → `succeeded` with no version of
/// its own (its result went to its uplink row, in this transaction), and
/// its one-round job completed.
/// The samples behind the job's rounds that succeeded before `round_id`:
/// an edge's earlier versions, whose weight its one result carries too.
pub async fn earlier_samples(
    tx: &mut Tx<'_>,
    job_id: i64,
    round_id: i64,
) -> Result<u64, sqlx::Error> {
    // Summed here: PostgreSQL's SUM of a BIGINT is a NUMERIC.
    let weights: Vec<i64> = sqlx::query_scalar(
        "SELECT weight_total FROM rounds WHERE job_id = $1 AND id <> $2 AND state = 'succeeded'",
    )
    .bind(job_id)
    .bind(round_id)
    .fetch_all(&mut **tx)
    .await?;
    Ok(weights
        .into_iter()
        .map(|weight| u64::try_from(weight).unwrap_or(0))
        .fold(0, u64::saturating_add))
}

pub async fn succeed_partial(tx: &mut Tx<'_>, round: &RoundRow) -> Result<(), sqlx::Error> {
    let now = now_ms();
    clear_sum(tx, round.id).await?;
    sqlx::query(
        "UPDATE rounds SET state = 'succeeded', finished_ms = $1, status_message = '' \
         WHERE id = $2 AND state = 'aggregating'",
    )
    .bind(now)
    .bind(round.id)
    .execute(&mut **tx)
    .await?;
    sqlx::query(
        "UPDATE jobs SET rounds_completed = rounds_completed + 1, round_failures = 0, \
         status_message = '', state = 'completed', updated_ms = $1, finished_ms = $1 \
         WHERE id = $2",
    )
    .bind(now)
    .bind(round.job_id)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// `aggregating` → `failed` with a reason; no model version is written.
/// The job fails once the round has failed more than `max_retries` times.
pub async fn fail(
    tx: &mut Tx<'_>,
    round: &RoundRow,
    failure: &RoundFailure,
    max_retries: i64,
) -> Result<(), sqlx::Error> {
    let reason = failure.to_string();
    let now = now_ms();
    super::secagg::purge(tx, round.id).await?;
    clear_sum(tx, round.id).await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE participants SET state = 'dropped', drop_reason = $2 WHERE round_id = $1 \
         AND state IN {PENDING_STATES}"
    )))
    .bind(round.id)
    .bind(format!("the round failed: {reason}"))
    .execute(&mut **tx)
    .await?;
    mark_failed(tx, round.id, failure, now).await?;
    let job_message = format!(
        "round {} attempt {} failed: {reason}",
        round.number, round.attempt
    );
    sqlx::query(
        "UPDATE jobs SET round_failures = round_failures + 1, updated_ms = $1, status_message = $2, \
         state = CASE WHEN round_failures + 1 > $3 THEN 'failed' ELSE state END, \
         finished_ms = CASE WHEN round_failures + 1 > $3 THEN $1 ELSE finished_ms END \
         WHERE id = $4",
    )
    .bind(now)
    .bind(job_message)
    .bind(max_retries)
    .bind(round.job_id)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// The round's row: `failed` at `now`, with the failure's text and kind.
async fn mark_failed(
    tx: &mut Tx<'_>,
    round_id: i64,
    failure: &RoundFailure,
    now: i64,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE rounds SET state = 'failed', finished_ms = $1, closed_ms = COALESCE(closed_ms, $1), \
         status_message = $2, failure_kind = $3 WHERE id = $4",
    )
    .bind(now)
    .bind(failure.to_string())
    .bind(failure.kind().as_str())
    .bind(round_id)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Fails a job's open round, if any (cancellation). The rounds' rows are
/// locked first, as every device answer locks them
/// ([`super::task_state::answer`]) before its task's row: one order, so a
/// cancel and an answer never deadlock on PostgreSQL.
pub async fn fail_open_round(
    db: &Db,
    tx: &mut Tx<'_>,
    job_id: i64,
    failure: &RoundFailure,
    now: i64,
) -> Result<(), sqlx::Error> {
    let reason = failure.to_string();
    let open: Vec<(i64,)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT id FROM rounds WHERE job_id = $1 AND state IN {OPEN_STATES} ORDER BY id{}",
        db.for_update()
    )))
    .bind(job_id)
    .fetch_all(&mut **tx)
    .await?;
    for &(round_id,) in &open {
        super::secagg::purge(tx, round_id).await?;
    }
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE participants SET state = 'dropped', drop_reason = $2 WHERE state IN {PENDING_STATES} \
         AND round_id IN (SELECT id FROM rounds WHERE job_id = $1 AND state IN {OPEN_STATES})"
    )))
    .bind(job_id)
    .bind(&reason)
    .execute(&mut **tx)
    .await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE rounds SET state = 'failed', finished_ms = $1, closed_ms = COALESCE(closed_ms, $1), \
         status_message = $2, failure_kind = $3 WHERE job_id = $4 AND state IN {OPEN_STATES}"
    )))
    .bind(now)
    .bind(&reason)
    .bind(failure.kind().as_str())
    .bind(job_id)
    .execute(&mut **tx)
    .await?;
    // After the rounds' rows, which a fold locks before the sum: the same
    // order, so the two never wait on each other.
    for (round_id,) in open {
        clear_sum(tx, round_id).await?;
    }
    Ok(())
}

any_row! {
    #[derive(Clone, Debug)]
    pub struct ParticipantRow {
        pub round_id: i64,
        pub device_id: i64,
        pub state: ParticipantState as String,
        pub selected_ms: i64,
        pub delivered_ms: Option<i64>,
        pub uploaded_ms: Option<i64>,
        pub num_samples: Option<i64>,
        pub update_bytes: Option<i64>,
        pub train_loss: Option<f64>,
        pub eval_loss: Option<f64>,
        pub eval_accuracy: Option<f64>,
        pub eval_samples: Option<i64>,
        pub train_duration_ms: Option<i64>,
        pub drop_reason: Option<String>,
        /// An aggregator's account of its sub-round, as JSON.
        pub sub_round: Option<String>,
        /// In an asynchronous job: the buffer that took the update, and
        /// its staleness in versions.
        pub folded_round_id: Option<i64>,
        pub staleness: Option<i64>,
    }
}

const PARTICIPANT_COLUMNS: &str = "round_id, device_id, state, selected_ms, delivered_ms, \
     uploaded_ms, num_samples, update_bytes, train_loss, eval_loss, eval_accuracy, eval_samples, \
     train_duration_ms, drop_reason, sub_round, folded_round_id, staleness";

pub async fn participants(
    db: &Db,
    round_id: i64,
    page: Page,
) -> Result<Vec<ParticipantRow>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {PARTICIPANT_COLUMNS} FROM participants WHERE round_id = $1 AND device_id > $2 \
         ORDER BY device_id LIMIT $3"
    )))
    .bind(round_id)
    .bind(page.after)
    .bind(page.limit)
    .fetch_all(&db.pool)
    .await
}

any_row! {
    /// Sample-weighted means of what the participants reported. A secure
    /// round never learns a participant's sample count (it travels inside
    /// the masked sum), so its training loss weights each device equally.
    #[derive(Clone, Debug, Default)]
    pub struct RoundMetricsRow {
        pub train_loss: Option<f64>,
        pub eval_accuracy: Option<f64>,
        pub eval_loss: Option<f64>,
        pub mean_train_duration_ms: Option<f64>,
    }
}

/// The means over the updates a round took: its own participants' in a
/// synchronous round, in a buffer those of the updates folded into it,
/// whichever buffer selected their devices.
pub async fn metrics(db: &Db, round: &RoundRow) -> Result<RoundMetricsRow, sqlx::Error> {
    let took = match round.is_buffer() {
        true => "folded_round_id",
        false => "round_id",
    };
    // Casts make both databases return a float (PostgreSQL's SUM of a
    // BIGINT is NUMERIC, which the `Any` driver cannot decode).
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT \
           SUM(train_loss * COALESCE(num_samples, 1)) / NULLIF(CAST(SUM(CASE WHEN train_loss IS NULL THEN 0 ELSE COALESCE(num_samples, 1) END) AS DOUBLE PRECISION), 0) AS train_loss, \
           SUM(eval_accuracy * eval_samples) / NULLIF(CAST(SUM(CASE WHEN eval_accuracy IS NULL THEN 0 ELSE eval_samples END) AS DOUBLE PRECISION), 0) AS eval_accuracy, \
           SUM(eval_loss * eval_samples) / NULLIF(CAST(SUM(CASE WHEN eval_loss IS NULL THEN 0 ELSE eval_samples END) AS DOUBLE PRECISION), 0) AS eval_loss, \
           AVG(CAST(train_duration_ms AS DOUBLE PRECISION)) AS mean_train_duration_ms \
         FROM participants WHERE {took} = $1"
    )))
    .bind(round.id)
    .fetch_one(&db.pool)
    .await
}

any_row! {
    /// A task the device should work on: its participation in a training round.
    #[derive(Clone, Debug)]
    pub struct TaskRow {
        pub round_id: i64,
        pub job_id: i64,
        pub number: i64,
        pub base_version_id: i64,
        pub deadline_ms: i64,
        pub config: String,
        /// The round's secure-aggregation plan (JSON), for secure jobs.
        pub secagg_plan: Option<String>,
        pub kind: RoundKind as String,
    }
}

/// The devices with a task waiting for them now: a pending training task
/// ([`take_task`]'s) or a pending evaluation (`evaluations::take`'s). One
/// read serves every task poll of a process (`api::device::tasks`'s
/// board), so that waiting polls cost the database nothing each.
pub async fn devices_with_tasks(db: &Db) -> Result<HashSet<i64>, sqlx::Error> {
    let training = task_state::open_tasks::<ParticipantState>();
    let evaluation = task_state::open_tasks::<super::evaluations::EvaluatorState>();
    let devices: Vec<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT t.device_id FROM {training} AND j.state = 'running' \
         UNION SELECT t.device_id FROM {evaluation} AND j.state = 'running'"
    )))
    .bind(now_ms())
    .fetch_all(&db.pool)
    .await?;
    Ok(devices.into_iter().collect())
}

impl task_state::HandedTask for TaskRow {
    fn round_id(&self) -> i64 {
        self.round_id
    }
}

/// The device's open training task, marked delivered. Updates already
/// under way in a paused job are still accepted until the deadline.
pub async fn take_task(db: &Db, device_id: i64) -> Result<Option<TaskRow>, sqlx::Error> {
    let columns = "r.id AS round_id, r.job_id, r.number, r.base_version_id, r.deadline_ms, \
         j.config, r.secagg_plan, r.kind";
    task_state::take::<ParticipantState, _>(db, device_id, columns).await
}

/// Why an upload was not folded in.
#[derive(Debug, thiserror::Error)]
pub enum UploadRejection {
    #[error("device {device_id} was not selected for round {round_id}")]
    NotParticipant { round_id: i64, device_id: i64 },
    #[error("device {device_id} already uploaded its update for round {round_id}")]
    Duplicate { round_id: i64, device_id: i64 },
    #[error("round {round_id} is closed ({reason}); the update arrived too late")]
    Closed {
        round_id: i64,
        /// The round's state, or `deadline passed` while it still trains.
        reason: &'static str,
    },
    #[error("device {device_id} was dropped from round {round_id} before its update arrived")]
    Dropped { round_id: i64, device_id: i64 },
    #[error(
        "device {device_id} withdrew from round {round_id} as ineligible (the job's device \
         policy); its update is not taken"
    )]
    Withdrawn { round_id: i64, device_id: i64 },
    #[error(
        "round {round_id} runs secure aggregation, so it takes no plain update: an update \
         goes masked through the round's SecAgg+ stages (the task's `secure_aggregation.path`), \
         and a plain one would show this device's update to the server"
    )]
    Secure { round_id: i64 },
    #[error(
        "device {device_id}'s update was trained on the version of buffer {round_id}, \
         {staleness} versions behind the newest, and the job takes updates at most \
         {max_staleness} behind (`asynchronous.max_staleness`)"
    )]
    Stale {
        round_id: i64,
        device_id: i64,
        staleness: i64,
        max_staleness: i64,
    },
    #[error(
        "round {round_id}'s job has no buffer open to take the update: the last one is still \
         being made into a version"
    )]
    NoOpenBuffer { round_id: i64 },
    #[error("round {round_id}'s stored sum has {stored} values, the update {got}")]
    SumLength {
        round_id: i64,
        stored: usize,
        got: usize,
    },
}

/// What decides whether a round takes an update: its state and deadline,
/// and whether it is a buffer of an asynchronous job.
#[derive(Clone, Copy, Debug)]
pub struct RoundGate {
    pub round_id: i64,
    pub state: RoundState,
    pub deadline_ms: Option<i64>,
    pub buffered: bool,
}

/// The decision on an upload, for the check before its body is read and
/// for the fold under the round's lock: [`task_state::admit`], with the
/// round open while it trains and before its deadline. A duplicate comes
/// before closed so that a device whose update was counted hears so (409)
/// even after the round closed.
pub fn admit(
    round: RoundGate,
    device_id: i64,
    participant: Option<ParticipantState>,
    now_ms: i64,
) -> Result<(), UploadRejection> {
    let round_id = round.round_id;
    let late = round.deadline_ms.is_some_and(|deadline| now_ms > deadline);
    let training = round.state.takes_updates(round.buffered);
    match task_state::admit(participant.map(TaskState::phase), training && !late) {
        Admission::Taken => Ok(()),
        Admission::NotMember => Err(UploadRejection::NotParticipant {
            round_id,
            device_id,
        }),
        Admission::Answered => Err(UploadRejection::Duplicate {
            round_id,
            device_id,
        }),
        Admission::Withdrawn => Err(UploadRejection::Withdrawn {
            round_id,
            device_id,
        }),
        Admission::Closed => Err(UploadRejection::Closed {
            round_id,
            reason: if training {
                "deadline passed"
            } else {
                round.state.as_str()
            },
        }),
        Admission::Dropped => Err(UploadRejection::Dropped {
            round_id,
            device_id,
        }),
    }
}

any_row! {
    /// A participant's standing in its round, as the upload handler reads it
    /// before the body.
    #[derive(Clone, Debug)]
    pub struct Standing {
        pub participant: ParticipantState as String,
        pub round: RoundState as String,
        pub deadline_ms: Option<i64>,
        pub base_version_id: i64,
        pub kind: RoundKind as String,
        pub job_id: i64,
        /// A secure round's stage; `None` for a plain round, which alone
        /// takes plain updates.
        pub secagg_stage: Option<String>,
        pub max_staleness: Option<i64>,
        /// A robust round's rule: its updates are stored before they fold.
        pub robust_rule: Option<String>,
    }
}

impl Standing {
    pub fn gate(&self, round_id: i64) -> RoundGate {
        RoundGate {
            round_id,
            state: self.round,
            deadline_ms: self.deadline_ms,
            buffered: self.max_staleness.is_some(),
        }
    }
}

/// What the upload handler knows about the round before reading the body.
pub async fn standing(
    db: &Db,
    round_id: i64,
    device_id: i64,
) -> Result<Option<Standing>, sqlx::Error> {
    sqlx::query_as(
        "SELECT p.state AS participant, r.state AS round, r.deadline_ms, r.base_version_id, r.kind, \
         r.job_id, r.secagg_stage, r.max_staleness, r.robust_rule FROM participants p \
         JOIN rounds r ON r.id = p.round_id \
         WHERE p.round_id = $1 AND p.device_id = $2",
    )
    .bind(round_id)
    .bind(device_id)
    .fetch_optional(&db.pool)
    .await
}

any_row! {
    /// A round under its lock: what [`admit`] needs, and the running sum.
    struct LockedRound {
        state: RoundState as String,
        deadline_ms: Option<i64>,
        weight_total: i64,
        job_id: i64,
        number: i64,
        max_staleness: Option<i64>,
        clip_norm: Option<f64>,
        robust_rule: Option<String>,
    }
}

any_row! {
    /// An asynchronous job's open buffer, under its lock.
    struct LockedBuffer {
        id: i64,
        number: i64,
        weight_total: i64,
        updates_accepted: i64,
        target_devices: i64,
    }
}

/// Where a batch of updates folds: the round itself, or for a buffer of
/// an asynchronous job the buffer open now, with each update weighted by
/// its staleness.
struct FoldTarget {
    round_id: i64,
    weight_total: i64,
    /// How many versions behind the target the updates were trained, and
    /// the weight that gives them per sample; `None` in a synchronous round.
    staleness: Option<(i64, f64)>,
    /// A buffer takes exactly its size: the updates it still has room for
    /// (at least one); `None` in a synchronous round.
    room: Option<i64>,
}

/// A decoded, checked update, ready to fold.
pub struct AcceptedUpdate {
    pub device_id: i64,
    pub num_samples: u64,
    /// The values, to fold into the round's sum; empty when `stored`.
    pub values: Vec<f32>,
    pub bytes: u64,
    /// In a robust round: the digest of the update the blob store holds
    /// for it (`BlobStore::put_update`), which the participant's row names
    /// instead of the update folding.
    pub stored: Option<String>,
}

/// Folds a batch of updates to one round into its running weighted sum and
/// records each accepted device as uploaded, in one transaction: after a
/// crash, an update is either fully counted or not at all, and never twice.
/// One transaction per batch, not per update, because each fold rewrites
/// the whole model-sized sum. Returns, per update in order, the number of
/// updates accepted so far or why it was refused.
pub async fn accept_updates(
    db: &Db,
    round_id: i64,
    updates: &[AcceptedUpdate],
) -> Result<Vec<Result<u64, UploadRejection>>, sqlx::Error> {
    let _slot = db.round_write_slot().await;
    let now = now_ms();
    let _writer = db.write_lock().await;
    let mut tx = db.pool.begin().await?;
    let round: Option<LockedRound> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT state, deadline_ms, weight_total, job_id, number, max_staleness, clip_norm, \
         robust_rule \
         FROM rounds WHERE id = $1{}",
        db.for_update()
    )))
    .bind(round_id)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(round) = round else {
        let why = |device_id| UploadRejection::NotParticipant {
            round_id,
            device_id,
        };
        return Ok(refuse_all(updates, why));
    };
    let gate = RoundGate {
        round_id,
        state: round.state,
        deadline_ms: round.deadline_ms,
        buffered: round.max_staleness.is_some(),
    };
    let target = match fold_target(db, &mut tx, round_id, &round).await? {
        Target::Fold(target) => target,
        Target::Wait => {
            let why = |_| UploadRejection::NoOpenBuffer { round_id };
            return Ok(refuse_all(updates, why));
        }
        Target::Over => {
            let reason = "the job made its last version";
            let why = |_| UploadRejection::Closed { round_id, reason };
            return Ok(refuse_all(updates, why));
        }
    };
    let mut weight_total = target.weight_total;
    let stored = update_sum(&mut tx, target.round_id).await?;
    let mut sum = stored.map(|bytes| fedavg::decode_sum(&bytes));
    let mut outcomes = Vec::with_capacity(updates.len());
    let (mut accepted, mut bytes_in, mut unclipped) = (0i64, 0i64, 0i64);
    for update in updates {
        if target.room.is_some_and(|room| accepted >= room) {
            // Full: the update waits for the next buffer.
            outcomes.push(Err(UploadRejection::NoOpenBuffer { round_id }));
            continue;
        }
        let fold = Fold {
            gate,
            target: &target,
            max_staleness: round.max_staleness,
            clip_norm: round.clip_norm,
            robust: round.robust_rule.is_some(),
            now,
        };
        let outcome = fold_one(&mut tx, &fold, update, &mut sum).await?;
        if let Ok(folded) = &outcome {
            accepted += 1;
            unclipped += i64::from(folded.within_clip);
            bytes_in = bytes_in.saturating_add(i64::try_from(update.bytes).unwrap_or(i64::MAX));
            // A private round's updates weigh one each.
            let weight = match round.clip_norm {
                Some(_) => 1,
                None => i64::try_from(update.num_samples).unwrap_or(i64::MAX),
            };
            weight_total = weight_total.saturating_add(weight);
        }
        outcomes.push(outcome.map(|_| ()));
    }
    if accepted == 0 {
        // Only refusals; a stale one dropped its participant, which stands.
        tx.commit().await?;
        let refusals = outcomes.into_iter().map(|outcome| outcome.map(|()| 0));
        return Ok(refusals.collect());
    }
    if let Some(sum) = &sum {
        store_sum(&mut tx, target.round_id, fedavg::encode_sum(sum)).await?;
    }
    let batch = BatchCount {
        accepted,
        bytes_in,
        weight_total: Some(weight_total),
        unclipped,
    };
    let counted = count_batch(&mut tx, target.round_id, batch).await?;
    tx.commit().await?;
    Ok(numbered(outcomes, counted))
}

/// A robust round's accepted updates, as their participants' rows name
/// them, by device.
pub async fn stored_updates(
    tx: &mut Tx<'_>,
    round_id: i64,
) -> Result<Vec<crate::robust::StoredUpdate>, sqlx::Error> {
    let rows: Vec<(i64, String)> = sqlx::query_as(
        "SELECT device_id, update_digest FROM participants \
         WHERE round_id = $1 AND state = $2 AND update_digest IS NOT NULL \
         ORDER BY device_id",
    )
    .bind(round_id)
    .bind(ParticipantState::Uploaded.as_str())
    .fetch_all(&mut **tx)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(device_id, digest)| crate::robust::StoredUpdate { device_id, digest })
        .collect())
}

/// Robust rounds that are over but still keep their stored updates, at
/// most `limit`, oldest first.
pub async fn keeping_updates(db: &Db, limit: i64) -> Result<Vec<i64>, sqlx::Error> {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT id FROM rounds WHERE robust_rule IS NOT NULL AND updates_deleted_ms IS NULL \
         AND state NOT IN {OPEN_STATES} ORDER BY id LIMIT $1"
    )))
    .bind(limit)
    .fetch_all(&db.pool)
    .await
}

/// Records that a closed robust round's stored updates are deleted.
pub async fn updates_deleted(db: &Db, round_id: i64) -> Result<(), sqlx::Error> {
    let _writer = db.write_lock().await;
    sqlx::query("UPDATE rounds SET updates_deleted_ms = $1 WHERE id = $2")
        .bind(now_ms())
        .bind(round_id)
        .execute(&db.pool)
        .await?;
    Ok(())
}

/// The same refusal for every update of a batch.
fn refuse_all(
    updates: &[AcceptedUpdate],
    why: impl Fn(i64) -> UploadRejection,
) -> Vec<Result<u64, UploadRejection>> {
    updates
        .iter()
        .map(|update| Err(why(update.device_id)))
        .collect()
}

/// Where updates to `round` fold, under the target's row lock: the round
/// itself, or for a buffer of an asynchronous job the job's buffer that
/// trains now (locked after the round, as ids ascend: the same order as
/// every other fold and as [`expire_buffered`]); `None` while the job's
/// last buffer is full or being made into a version and the next is not
/// open yet ([`Target::Wait`]), or for good ([`Target::Over`]).
async fn fold_target(
    db: &Db,
    tx: &mut Tx<'_>,
    round_id: i64,
    round: &LockedRound,
) -> Result<Target, sqlx::Error> {
    if round.max_staleness.is_none() {
        return Ok(Target::Fold(FoldTarget {
            round_id,
            weight_total: round.weight_total,
            staleness: None,
            room: None,
        }));
    }
    let buffer: Option<LockedBuffer> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT id, number, weight_total, updates_accepted, target_devices FROM rounds \
         WHERE job_id = $1 AND state = 'training' AND max_staleness IS NOT NULL \
         ORDER BY id DESC LIMIT 1{}",
        db.for_update()
    )))
    .bind(round.job_id)
    .fetch_optional(&mut **tx)
    .await?;
    let job: JobNow =
        sqlx::query_as("SELECT config, state, rounds_completed FROM jobs WHERE id = $1")
            .bind(round.job_id)
            .fetch_one(&mut **tx)
            .await?;
    let spec: super::jobs::JobSpec = super::from_json("jobs.config", &job.config)?;
    // A full buffer is about to close: no buffer has room.
    let Some(buffer) = buffer.filter(|buffer| buffer.updates_accepted < buffer.target_devices)
    else {
        return next_buffer_coming(tx, round.job_id, &job, &spec).await;
    };
    let staleness = (buffer.number - round.number).max(0);
    let weight = spec.asynchronous.map_or(1.0, |asynchronous| {
        asynchronous.staleness_weight(u64::try_from(staleness).unwrap_or(0))
    });
    Ok(Target::Fold(FoldTarget {
        round_id: buffer.id,
        weight_total: buffer.weight_total,
        staleness: Some((staleness, weight)),
        room: Some(buffer.target_devices - buffer.updates_accepted),
    }))
}

/// Where a batch of updates goes.
enum Target {
    Fold(FoldTarget),
    /// The job's buffer is full or becoming a version, and another will
    /// open: the updates wait for it.
    Wait,
    /// No buffer will open again: the job made (or is making) its last
    /// version, or it has stopped.
    Over,
}

any_row! {
    /// What decides whether an asynchronous job will open another buffer.
    struct JobNow {
        config: String,
        state: super::jobs::JobState as String,
        rounds_completed: i64,
    }
}

/// With no buffer that has room: whether another will open, that is the
/// job is under way and its newest buffer (or, with none open, its last
/// version) is not its last.
async fn next_buffer_coming(
    tx: &mut Tx<'_>,
    job_id: i64,
    job: &JobNow,
    spec: &super::jobs::JobSpec,
) -> Result<Target, sqlx::Error> {
    use super::jobs::JobState;
    let newest: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT MAX(number) FROM rounds WHERE job_id = $1 AND state IN {OPEN_STATES}"
    )))
    .bind(job_id)
    .fetch_one(&mut **tx)
    .await?;
    let under_way = matches!(
        job.state,
        JobState::Created | JobState::Running | JobState::Paused
    );
    let last = newest.unwrap_or(job.rounds_completed) >= i64::from(spec.rounds);
    Ok(if under_way && !last {
        Target::Wait
    } else {
        Target::Over
    })
}

/// What [`fold_one`] checks an update against, and where it folds.
struct Fold<'a> {
    gate: RoundGate,
    target: &'a FoldTarget,
    max_staleness: Option<i64>,
    /// A private round's clip norm: each update is clipped to it and
    /// weighs one, whatever its sample count.
    clip_norm: Option<f64>,
    /// A robust round: each update is stored, and only named here.
    robust: bool,
    now: i64,
}

/// What a folded batch adds to its round's row.
#[derive(Clone, Copy, Debug, Default)]
pub struct BatchCount {
    pub accepted: i64,
    pub bytes_in: i64,
    /// The new weight total where the fold keeps one (a secure round
    /// learns its weights only when it unmasks).
    pub weight_total: Option<i64>,
    /// A private round's updates that were within its clip.
    pub unclipped: i64,
}

/// Counts a folded batch in the round's row, in one write. How many
/// updates the round had accepted before the batch.
pub async fn count_batch(
    tx: &mut Tx<'_>,
    round_id: i64,
    batch: BatchCount,
) -> Result<u64, sqlx::Error> {
    let (before,): (i64,) = sqlx::query_as(
        "UPDATE rounds SET weight_total = COALESCE($1, weight_total), \
         updates_accepted = updates_accepted + $2, bytes_in = bytes_in + $3, \
         dp_unclipped = dp_unclipped + $4 \
         WHERE id = $5 RETURNING updates_accepted - $2",
    )
    .bind(batch.weight_total)
    .bind(batch.accepted)
    .bind(batch.bytes_in)
    .bind(batch.unclipped)
    .bind(round_id)
    .fetch_one(&mut **tx)
    .await?;
    Ok(before as u64)
}

/// A batch's outcomes in order, each accepted one numbered by how many the
/// round had accepted with it (counting on from `before`).
pub fn numbered<E>(outcomes: Vec<Result<(), E>>, before: u64) -> Vec<Result<u64, E>> {
    let mut count = before;
    outcomes
        .into_iter()
        .map(|outcome| {
            outcome.map(|()| {
                count += 1;
                count
            })
        })
        .collect()
}

/// Checks one participant and folds its update into `sum`; an error in
/// the outer result aborts the whole batch, one in the inner refuses only
/// this update.
async fn fold_one(
    tx: &mut Tx<'_>,
    fold: &Fold<'_>,
    update: &AcceptedUpdate,
    sum: &mut Option<Vec<f64>>,
) -> Result<Result<Folded, UploadRejection>, sqlx::Error> {
    let (round_id, device_id, now) = (fold.gate.round_id, update.device_id, fold.now);
    let participant = task_state::member_state(tx, round_id, device_id).await?;
    if let Err(rejection) = admit(fold.gate, device_id, participant, now) {
        return Ok(Err(rejection));
    }
    let (staleness, weight) = fold.target.staleness.unwrap_or((0, 1.0));
    if let Some(max_staleness) = fold.max_staleness.filter(|&limit| staleness > limit) {
        let rejection = UploadRejection::Stale {
            round_id,
            device_id,
            staleness,
            max_staleness,
        };
        drop_stale(tx, round_id, device_id, &rejection.to_string()).await?;
        return Ok(Err(rejection));
    }
    let stored = match (fold.robust, &update.stored) {
        (true, Some(digest)) => Some(digest.as_str()),
        (false, None) => None,
        // Read from the round before the body, and a round's rule never
        // changes, so these do not happen.
        (true, None) | (false, Some(_)) => {
            let reason = "the round's aggregation is not the one the upload was prepared for";
            return Ok(Err(UploadRejection::Closed { round_id, reason }));
        }
    };
    if stored.is_none() {
        let sum = sum.get_or_insert_with(|| vec![0.0; update.values.len()]);
        if sum.len() != update.values.len() {
            return Ok(Err(UploadRejection::SumLength {
                round_id,
                stored: sum.len(),
                got: update.values.len(),
            }));
        }
    }
    let columns = [
        ("uploaded_ms", Value::Int(now)),
        (
            "num_samples",
            Value::Int(i64::try_from(update.num_samples).unwrap_or(i64::MAX)),
        ),
        (
            "update_bytes",
            Value::Int(i64::try_from(update.bytes).unwrap_or(i64::MAX)),
        ),
    ];
    let buffered = fold.target.staleness.map(|(staleness, _)| {
        [
            ("folded_round_id", Value::Int(fold.target.round_id)),
            ("staleness", Value::Int(staleness)),
        ]
    });
    let digest = stored.map(|digest| [("update_digest", Value::Text(digest))]);
    let columns: Vec<_> = columns
        .into_iter()
        .chain(buffered.into_iter().flatten())
        .chain(digest.into_iter().flatten())
        .collect();
    let uploaded = ParticipantState::Uploaded;
    if !task_state::move_pending(tx, round_id, device_id, uploaded, &columns).await? {
        // Under the round's lock only a writer that skips it (none should)
        // can have moved the participant since the read.
        let reason = "the participant left meanwhile";
        return Ok(Err(UploadRejection::Closed { round_id, reason }));
    }
    let Some(sum) = sum.as_mut().filter(|_| stored.is_none()) else {
        // Stored: the round aggregates it when it closes.
        return Ok(Ok(Folded { within_clip: false }));
    };
    let (weight, within_clip) = match fold.clip_norm {
        // The device clipped it already, unless it is old, lies, or was
        // asked not to (adaptive clipping): clipped here, one device moves
        // the sum by at most the clip norm.
        Some(clip_norm) => {
            let norm = update::l2_norm(&update.values);
            (update::clip_scale(norm, clip_norm), norm <= clip_norm)
        }
        None => (update.num_samples as f64 * weight, false),
    };
    fedavg::fold_weighted(sum, weight, &update.values);
    Ok(Ok(Folded { within_clip }))
}

/// What folding an accepted update saw.
struct Folded {
    /// A private round's update whose norm was within the round's clip.
    within_clip: bool,
}

/// Drops a participant whose update is too stale to take, so that its
/// device is free for a task on a newer version.
async fn drop_stale(
    tx: &mut Tx<'_>,
    round_id: i64,
    device_id: i64,
    reason: &str,
) -> Result<(), sqlx::Error> {
    let columns = [("drop_reason", Value::Text(reason))];
    task_state::leave(tx, round_id, device_id, ParticipantState::Dropped, &columns).await?;
    Ok(())
}

/// The config of the job a round belongs to, `None` when there is no such
/// round: what a withdrawal is checked against.
pub async fn job_config(db: &Db, round_id: i64) -> Result<Option<String>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT j.config FROM rounds r JOIN jobs j ON j.id = r.job_id WHERE r.id = $1",
    )
    .bind(round_id)
    .fetch_optional(&db.pool)
    .await
}

/// Stores what a participant reports about its training and evaluation.
/// Keeps an aggregator's account of its sub-round on its participant row;
/// false when the device is not a participant of the round.
pub async fn record_sub_round(
    db: &Db,
    round_id: i64,
    device_id: i64,
    report: &canopy_protocol::messages::SubRoundReport,
) -> Result<bool, sqlx::Error> {
    let _writer = db.write_lock().await;
    let result = sqlx::query(
        "UPDATE participants SET sub_round = $1 WHERE round_id = $2 AND device_id = $3",
    )
    .bind(serde_json::to_string(report).unwrap_or_default())
    .bind(round_id)
    .bind(device_id)
    .execute(&db.pool)
    .await?;
    Ok(result.rows_affected() > 0)
}

/// An edge's account of its sub-round for the cloud's round tree, over
/// every round of the sub-round's local job (one, or `edges.rounds`).
pub async fn sub_round_report(
    db: &Db,
    job_id: i64,
    cloud_round_id: i64,
) -> Result<canopy_protocol::messages::SubRoundReport, sqlx::Error> {
    use canopy_protocol::messages::{DropoutCount, MAX_SUB_ROUND_REASONS};
    let reasons: Vec<(Option<String>, i64)> = sqlx::query_as(
        "SELECT p.drop_reason, COUNT(*) FROM participants p JOIN rounds r ON r.id = p.round_id \
         WHERE r.job_id = $1 AND p.state = 'dropped' GROUP BY p.drop_reason \
         ORDER BY COUNT(*) DESC",
    )
    .bind(job_id)
    .fetch_all(&db.pool)
    .await?;
    let rounds: Vec<RoundRow> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {ROUND_COLUMNS} FROM rounds WHERE job_id = $1 ORDER BY id"
    )))
    .bind(job_id)
    .fetch_all(&db.pool)
    .await?;
    let count = |n: i64| u32::try_from(n).unwrap_or(u32::MAX);
    let total = |field: fn(&RoundRow) -> i64| {
        rounds
            .iter()
            .map(|round| u64::try_from(field(round)).unwrap_or(0))
            .fold(0u64, u64::saturating_add)
    };
    let dropout_reasons = reasons
        .into_iter()
        .take(MAX_SUB_ROUND_REASONS)
        .map(|(reason, devices)| DropoutCount {
            reason: reason
                .unwrap_or_default()
                .chars()
                .filter(|c| !c.is_control())
                .take(canopy_protocol::messages::MAX_SUB_ROUND_REASON_CHARS)
                .collect(),
            devices: count(devices),
        })
        .collect();
    let opened_ms = rounds.first().map_or(0, |round| round.created_ms);
    let closed_ms = rounds.last().map_or(opened_ms, |round| {
        round
            .closed_ms
            .or(round.finished_ms)
            .unwrap_or(round.created_ms)
    });
    let narrow = |n: u64| u32::try_from(n).unwrap_or(u32::MAX);
    Ok(canopy_protocol::messages::SubRoundReport {
        round_id: cloud_round_id,
        selected: narrow(total(|r| r.selected_count)),
        updates: narrow(total(|r| r.updates_accepted)),
        dropouts: narrow(total(|r| r.dropouts)),
        ineligible: narrow(total(|r| r.ineligible)),
        dropout_reasons,
        // A secure round's weight is one of the secrets its sum hides.
        samples: rounds
            .iter()
            .all(|round| round.secagg_stage.is_none())
            .then(|| total(|r| r.weight_total)),
        bytes_in: total(|r| r.bytes_in),
        bytes_out: total(|r| r.bytes_out),
        duration_ms: u64::try_from(closed_ms - opened_ms).unwrap_or(0),
    })
}

pub async fn record_metrics(
    db: &Db,
    round_id: i64,
    device_id: i64,
    metrics: &canopy_protocol::messages::RoundMetrics,
) -> Result<bool, sqlx::Error> {
    let _writer = db.write_lock().await;
    let result = sqlx::query(
        "UPDATE participants SET train_loss = COALESCE($1, train_loss), \
         eval_loss = COALESCE($2, eval_loss), eval_accuracy = COALESCE($3, eval_accuracy), \
         eval_samples = COALESCE($4, eval_samples), \
         train_duration_ms = COALESCE($5, train_duration_ms) \
         WHERE round_id = $6 AND device_id = $7",
    )
    .bind(metrics.train_loss)
    .bind(metrics.eval_loss)
    .bind(metrics.eval_accuracy)
    .bind(
        metrics
            .eval_samples
            .map(|n| i64::try_from(n).unwrap_or(i64::MAX)),
    )
    .bind(
        metrics
            .train_duration_ms
            .map(|n| i64::try_from(n).unwrap_or(i64::MAX)),
    )
    .bind(round_id)
    .bind(device_id)
    .execute(&db.pool)
    .await?;
    Ok(result.rows_affected() == 1)
}

/// Counts bytes sent to a device against its open round on this version.
pub async fn add_bytes_out(
    db: &Db,
    device_id: i64,
    version_id: i64,
    bytes: u64,
) -> Result<(), sqlx::Error> {
    let _round_write = db.round_write_slot().await;
    let _writer = db.write_lock().await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE rounds SET bytes_out = bytes_out + $1 WHERE base_version_id = $2 \
         AND (state IN {OPEN_STATES} OR max_staleness IS NOT NULL) \
         AND id IN (SELECT round_id FROM participants WHERE device_id = $3)"
    )))
    .bind(i64::try_from(bytes).unwrap_or(i64::MAX))
    .bind(version_id)
    .bind(device_id)
    .execute(&db.pool)
    .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sql_list(states: impl Iterator<Item = &'static str>) -> String {
        let quoted: Vec<String> = states.map(|state| format!("'{state}'")).collect();
        format!("({})", quoted.join(", "))
    }

    #[test]
    fn a_closed_buffer_still_takes_its_devices_updates() {
        use ParticipantState::Delivered;
        use RoundState::*;
        let gate = |state, buffered| RoundGate {
            round_id: 7,
            state,
            deadline_ms: Some(1_000),
            buffered,
        };
        assert!(admit(gate(Succeeded, true), 3, Some(Delivered), 500).is_ok());
        assert!(admit(gate(Aggregating, true), 3, Some(Delivered), 500).is_ok());
        let closed = |result| matches!(result, Err(UploadRejection::Closed { .. }));
        assert!(closed(admit(
            gate(Succeeded, false),
            3,
            Some(Delivered),
            500
        )));
        assert!(closed(admit(gate(Failed, true), 3, Some(Delivered), 500)));
        assert!(closed(admit(
            gate(Succeeded, true),
            3,
            Some(Delivered),
            2_000
        )));
        assert_eq!(closed_buffer_states_sql(), "('aggregating', 'succeeded')");
        let fedbuff = super::super::jobs::Asynchronous {
            concurrency: 4,
            max_staleness: 20,
            staleness_exponent: 0.5,
        };
        assert_eq!(fedbuff.staleness_weight(0), 1.0);
        assert_eq!(fedbuff.staleness_weight(3), 0.5);
    }

    #[test]
    fn the_open_states_are_the_enum() {
        let open = RoundState::ALL.iter().filter(|s| s.is_open());
        assert_eq!(OPEN_STATES, sql_list(open.map(|s| s.as_str())));
    }

    fn decide(
        participant: Option<ParticipantState>,
        round: RoundState,
        late: bool,
    ) -> Result<(), UploadRejection> {
        let gate = RoundGate {
            round_id: 7,
            state: round,
            deadline_ms: Some(1_000),
            buffered: false,
        };
        admit(gate, 3, participant, if late { 2_000 } else { 500 })
    }

    #[test]
    fn admit_decides_in_one_order() {
        use ParticipantState::*;
        use RoundState::*;
        assert!(decide(Some(Selected), Training, false).is_ok());
        assert!(decide(Some(Delivered), Training, false).is_ok());
        let refused = |p, r, late| decide(p, r, late).unwrap_err();
        assert!(matches!(
            refused(None, Aggregating, true),
            UploadRejection::NotParticipant { .. }
        ));
        // A counted update is reported as such even once the round closed.
        assert!(matches!(
            refused(Some(Uploaded), Succeeded, true),
            UploadRejection::Duplicate { .. }
        ));
        // Closed comes before dropped: closing is what dropped the device.
        let closed = refused(Some(Dropped), Aggregating, false);
        assert!(matches!(
            closed,
            UploadRejection::Closed {
                reason: "aggregating",
                ..
            }
        ));
        let late = refused(Some(Delivered), Training, true);
        assert!(matches!(
            late,
            UploadRejection::Closed {
                reason: "deadline passed",
                ..
            }
        ));
        assert!(matches!(
            refused(Some(Dropped), Training, false),
            UploadRejection::Dropped { .. }
        ));
        assert!(matches!(
            refused(Some(Ineligible), Training, false),
            UploadRejection::Withdrawn { .. }
        ));
        // An ineligible participant is out of the round, not pending.
        assert!(!Ineligible.is_pending() && Ineligible.has_left());
    }
}
