//! Evaluation of the version each round produced: on devices (federated
//! evaluation, its own small state machine per device) and on the server
//! (central evaluation, one result per round).
//!
//! A round that succeeds may open its evaluation: it selects evaluators
//! (`evaluators` rows) and sets `rounds.eval_state` to `open` with a
//! deadline. Evaluator states: `selected` → `delivered` (task fetched) →
//! `reported`, or `dropped` (declined, or still pending when the
//! evaluation closes), or `ineligible` (withdrew: it no longer meets the
//! job's device policy; not a dropout): the task state machine both kinds
//! of task share (`task_state`). The evaluation closes when no evaluator
//! is pending or at its deadline; a job whose last round has an open evaluation is
//! not complete until it closes, so a completed job's numbers are final.

use crate::store::row::any_row;

use super::jobs::JobState;
use super::rounds::Tx;
use super::task_state::{self, Admission, States, Value};
use super::text_enum;
use crate::db::{Db, now_ms};

pub use super::task_state::EvaluatorState;

text_enum! {
    /// A round's federated evaluation: `open` while devices evaluate, then
    /// `closed`. Rounds without one have none (NULL).
    pub enum EvaluationState {
        Open = "open",
        Closed = "closed",
    }
}

text_enum! {
    /// A round's central evaluation: `pending` from the round's success
    /// (committed with it, so a restart picks it up) until the server has
    /// evaluated the version, then `done`, or `failed` with the reason.
    /// Rounds of jobs without a central dataset have none (NULL).
    pub enum CentralState {
        Pending = "pending",
        Done = "done",
        Failed = "failed",
    }
}

/// The device's open evaluation task, marked delivered (and handed out
/// again until it reports, as training tasks are).
pub async fn take(db: &Db, device_id: i64) -> Result<Option<EvaluationTaskRow>, sqlx::Error> {
    let columns = "r.id AS round_id, r.job_id, r.number, r.result_version_id AS version_id, \
         r.eval_deadline_ms AS deadline_ms, j.config";
    task_state::take::<EvaluatorState, _>(db, device_id, columns).await
}

any_row! {
    /// An evaluation task: evaluate the version round `round_id` produced.
    #[derive(Clone, Debug)]
    pub struct EvaluationTaskRow {
        pub round_id: i64,
        pub job_id: i64,
        pub number: i64,
        pub version_id: i64,
        pub deadline_ms: i64,
        pub config: String,
    }
}

impl task_state::HandedTask for EvaluationTaskRow {
    fn round_id(&self) -> i64 {
        self.round_id
    }
}

/// What a device reports about the version it evaluated.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Report {
    pub loss: f64,
    pub accuracy: f64,
    pub samples: u64,
}

/// Records a device's evaluation of the round's version, if
/// [`task_state::admit`] takes it.
pub async fn report(
    db: &Db,
    round_id: i64,
    device_id: i64,
    report: Report,
) -> Result<Admission, sqlx::Error> {
    let samples = i64::try_from(report.samples).unwrap_or(i64::MAX);
    let columns = [
        ("reported_ms", Value::Int(now_ms())),
        ("loss", Value::Float(report.loss)),
        ("accuracy", Value::Float(report.accuracy)),
        ("samples", Value::Int(samples)),
    ];
    let reported = EvaluatorState::Reported;
    task_state::answer(db, round_id, device_id, reported, &columns).await
}

/// Open evaluations that can close now: past their deadline, or with no
/// evaluator left pending.
pub async fn due(db: &Db, limit: i64) -> Result<Vec<i64>, sqlx::Error> {
    let pending = States::<EvaluatorState>::PENDING;
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT r.id FROM rounds r WHERE r.eval_state = 'open' AND (r.eval_deadline_ms <= $1 \
         OR NOT EXISTS (SELECT 1 FROM evaluators e WHERE e.round_id = r.id \
         AND e.state IN {pending})) ORDER BY r.id LIMIT $2"
    )))
    .bind(now_ms())
    .bind(limit)
    .fetch_all(&db.pool)
    .await
}

/// Closes an open evaluation; evaluators still pending are dropped with a
/// timeout. False when it was not open (another process closed it).
pub async fn close(tx: &mut Tx<'_>, round_id: i64) -> Result<bool, sqlx::Error> {
    let closed = sqlx::query(
        "UPDATE rounds SET eval_state = 'closed', eval_closed_ms = $1 \
         WHERE id = $2 AND eval_state = 'open'",
    )
    .bind(now_ms())
    .bind(round_id)
    .execute(&mut **tx)
    .await?;
    if closed.rows_affected() == 0 {
        return Ok(false);
    }
    let reason = "timeout: no evaluation before the deadline";
    task_state::drop_pending::<EvaluatorState>(tx, round_id, reason).await?;
    Ok(true)
}

/// Whether the job has an evaluation still open: a federated one, or a
/// central one not yet stored.
pub async fn job_has_open(tx: &mut Tx<'_>, job_id: i64) -> Result<bool, sqlx::Error> {
    let found: Option<i64> = sqlx::query_scalar(
        "SELECT id FROM rounds WHERE job_id = $1 \
         AND (eval_state = 'open' OR central_eval_state = 'pending') LIMIT 1",
    )
    .bind(job_id)
    .fetch_optional(&mut **tx)
    .await?;
    Ok(found.is_some())
}

any_row! {
    /// The sample-weighted means of what the evaluators reported.
    #[derive(Clone, Debug, Default)]
    pub struct FederatedEvaluation {
        pub accuracy: Option<f64>,
        pub loss: Option<f64>,
        pub samples: Option<i64>,
        pub devices: i64,
        pub dropped: i64,
        /// Evaluators that withdrew under the job's device policy.
        pub ineligible: i64,
    }
}

pub async fn federated(db: &Db, round_id: i64) -> Result<FederatedEvaluation, sqlx::Error> {
    // Casts make both databases return the same types (see rounds::metrics).
    sqlx::query_as(
        "SELECT \
           SUM(accuracy * samples) / NULLIF(CAST(SUM(samples) AS DOUBLE PRECISION), 0) AS accuracy, \
           SUM(loss * samples) / NULLIF(CAST(SUM(samples) AS DOUBLE PRECISION), 0) AS loss, \
           CAST(SUM(samples) AS BIGINT) AS samples, \
           CAST(COUNT(*) FILTER (WHERE state = 'reported') AS BIGINT) AS devices, \
           CAST(COUNT(*) FILTER (WHERE state = 'dropped') AS BIGINT) AS dropped, \
           CAST(COUNT(*) FILTER (WHERE state = 'ineligible') AS BIGINT) AS ineligible \
         FROM evaluators WHERE round_id = $1",
    )
    .bind(round_id)
    .fetch_one(&db.pool)
    .await
}

/// The server's evaluation of the round's version on the job's held-out
/// dataset.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CentralResult {
    pub loss: f64,
    pub accuracy: f64,
    pub samples: u64,
}

/// Marks the round's version for central evaluation, in the transaction
/// that records the round's success.
pub async fn await_central(tx: &mut Tx<'_>, round_id: i64) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE rounds SET central_eval_state = 'pending', central_eval_error = NULL WHERE id = $1",
    )
    .bind(round_id)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

any_row! {
    /// A version waiting for its central evaluation.
    #[derive(Clone, Debug)]
    pub struct CentralTask {
        pub round_id: i64,
        pub job_id: i64,
        pub version_id: i64,
        /// The job's spec, which names the dataset.
        pub config: String,
        pub job_state: JobState as String,
        /// Attempts already started (each committed before its worker ran).
        pub attempts: i64,
    }
}

/// The next round to evaluate centrally: the oldest pending round of the
/// job evaluated least recently (jobs take turns, so one job's many or
/// slow evaluations hold another's back by at most one), skipping rounds
/// whose last attempt began after `started_before_ms` (another process
/// is still within its timeout on them).
pub async fn next_central(
    db: &Db,
    started_before_ms: i64,
) -> Result<Option<CentralTask>, sqlx::Error> {
    sqlx::query_as(
        "SELECT r.id AS round_id, r.job_id, r.result_version_id AS version_id, j.config, \
           j.state AS job_state, r.central_eval_attempts AS attempts \
         FROM rounds r JOIN jobs j ON j.id = r.job_id \
         WHERE r.central_eval_state = 'pending' AND r.result_version_id IS NOT NULL \
           AND (r.central_eval_started_ms IS NULL OR r.central_eval_started_ms < $1) \
         ORDER BY (SELECT COALESCE(MAX(o.central_eval_started_ms), 0) FROM rounds o \
                   WHERE o.job_id = r.job_id), r.id \
         LIMIT 1",
    )
    .bind(started_before_ms)
    .fetch_optional(&db.pool)
    .await
}

/// Counts an attempt at the round's evaluation, starting now; false when
/// the round is no longer pending or another process counted this
/// attempt first. Committed before the worker starts, so a crash that
/// takes the server down still counts.
pub async fn claim_central(
    tx: &mut Tx<'_>,
    round_id: i64,
    attempts_seen: i64,
) -> Result<bool, sqlx::Error> {
    let claimed = sqlx::query(
        "UPDATE rounds SET central_eval_attempts = central_eval_attempts + 1, \
         central_eval_started_ms = $1 \
         WHERE id = $2 AND central_eval_state = 'pending' AND central_eval_attempts = $3",
    )
    .bind(now_ms())
    .bind(round_id)
    .bind(attempts_seen)
    .execute(&mut **tx)
    .await?;
    Ok(claimed.rows_affected() > 0)
}

/// Gives back an attempt that a shutdown interrupted (no crash, so it
/// does not count), leaving the round for the next start.
pub async fn release_central(db: &Db, round_id: i64) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE rounds SET central_eval_attempts = central_eval_attempts - 1, \
         central_eval_started_ms = NULL \
         WHERE id = $1 AND central_eval_state = 'pending' AND central_eval_attempts > 0",
    )
    .bind(round_id)
    .execute(&db.pool)
    .await?;
    Ok(())
}

/// Stores the central evaluation of a pending round; false when it was not
/// pending (another process stored it first).
pub async fn set_central(
    tx: &mut Tx<'_>,
    round_id: i64,
    result: CentralResult,
) -> Result<bool, sqlx::Error> {
    let stored = sqlx::query(
        "UPDATE rounds SET central_eval_loss = $1, central_eval_accuracy = $2, \
         central_eval_samples = $3, central_eval_state = 'done', central_eval_error = NULL \
         WHERE id = $4 AND central_eval_state = 'pending'",
    )
    .bind(result.loss)
    .bind(result.accuracy)
    .bind(i64::try_from(result.samples).unwrap_or(i64::MAX))
    .bind(round_id)
    .execute(&mut **tx)
    .await?;
    Ok(stored.rows_affected() > 0)
}

/// Records why a pending round's central evaluation failed; false when it
/// was not pending.
pub async fn fail_central(
    tx: &mut Tx<'_>,
    round_id: i64,
    reason: &str,
) -> Result<bool, sqlx::Error> {
    let stored = sqlx::query(
        "UPDATE rounds SET central_eval_state = 'failed', central_eval_error = $1 \
         WHERE id = $2 AND central_eval_state = 'pending'",
    )
    .bind(reason)
    .bind(round_id)
    .execute(&mut **tx)
    .await?;
    Ok(stored.rows_affected() > 0)
}
