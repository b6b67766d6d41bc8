//! Evaluation of the version each round produced: on devices (federated
//! evaluation, its own small state machine per device) and on the server
//! (central evaluation, one result per round).
//!
//! A round that succeeds may open its evaluation: it selects evaluators
//! (`evaluators` rows) and sets `rounds.eval_state` to `open` with a
//! deadline. Evaluator states: `selected` → `delivered` (task fetched) →
//! `reported`, or `dropped` (declined, or still pending when the
//! evaluation closes), or `ineligible` (withdrew: it no longer meets the
//! job's device policy; not a dropout). The evaluation closes when no evaluator is pending
//! or at its deadline; a job whose last round has an open evaluation is
//! not complete until it closes, so a completed job's numbers are final.

use sqlx::FromRow;

use super::jobs::JobState;
use super::rounds::Tx;
use super::text_enum;
use crate::db::{Db, now_ms};

text_enum! {
    /// An evaluator's state: `selected` → `delivered` → `reported`, or
    /// `dropped`, or `ineligible` (withdrawn under the job's device policy).
    pub enum EvaluatorState {
        Selected = "selected",
        Delivered = "delivered",
        Reported = "reported",
        Dropped = "dropped",
        Ineligible = "ineligible",
    }
}

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

/// The pending evaluator states, as SQL.
pub const PENDING_EVALUATOR_STATES: &str = "('selected', 'delivered')";

/// Opens a round's federated evaluation with these evaluators; with none,
/// it is closed at once.
pub async fn open(
    tx: &mut Tx<'_>,
    round_id: i64,
    device_ids: &[i64],
    deadline_ms: i64,
) -> Result<(), sqlx::Error> {
    let now = now_ms();
    for device_id in device_ids {
        sqlx::query(
            "INSERT INTO evaluators (round_id, device_id, state, selected_ms) \
             VALUES ($1, $2, 'selected', $3)",
        )
        .bind(round_id)
        .bind(device_id)
        .bind(now)
        .execute(&mut **tx)
        .await?;
    }
    let state = if device_ids.is_empty() {
        "closed"
    } else {
        "open"
    };
    sqlx::query(
        "UPDATE rounds SET eval_state = $1, eval_deadline_ms = $2, eval_selected = $3, \
         eval_closed_ms = CASE WHEN $1 = 'closed' THEN $4 ELSE NULL END WHERE id = $5",
    )
    .bind(state)
    .bind(deadline_ms)
    .bind(device_ids.len() as i64)
    .bind(now)
    .bind(round_id)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// An evaluation task: evaluate the version round `round_id` produced.
#[derive(Clone, Debug, FromRow)]
pub struct EvaluationTaskRow {
    pub round_id: i64,
    pub job_id: i64,
    pub number: i64,
    pub version_id: i64,
    pub deadline_ms: i64,
    pub config: String,
}

/// The device's open evaluation task, marked delivered (and handed out
/// again until it reports, as training tasks are).
pub async fn take(db: &Db, device_id: i64) -> Result<Option<EvaluationTaskRow>, sqlx::Error> {
    let now = now_ms();
    let task: Option<EvaluationTaskRow> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT r.id AS round_id, r.job_id, r.number, r.result_version_id AS version_id, \
         r.eval_deadline_ms AS deadline_ms, j.config \
         FROM evaluators e JOIN rounds r ON r.id = e.round_id JOIN jobs j ON j.id = r.job_id \
         WHERE e.device_id = $1 AND e.state IN {PENDING_EVALUATOR_STATES} \
         AND r.eval_state = 'open' AND r.eval_deadline_ms > $2 AND j.state = 'running' \
         ORDER BY r.id LIMIT 1"
    )))
    .bind(device_id)
    .bind(now)
    .fetch_optional(&db.pool)
    .await?;
    if let Some(task) = &task {
        let _writer = db.write_lock().await;
        sqlx::query(
            "UPDATE evaluators SET state = 'delivered', delivered_ms = $1 \
             WHERE round_id = $2 AND device_id = $3 AND state = 'selected'",
        )
        .bind(now)
        .bind(task.round_id)
        .bind(device_id)
        .execute(&db.pool)
        .await?;
    }
    Ok(task)
}

/// Whether the device has an open evaluation of this version, which lets it
/// download the version.
pub async fn has_evaluation_of_version(
    db: &Db,
    device_id: i64,
    version_id: i64,
) -> Result<bool, sqlx::Error> {
    let found: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT r.id FROM evaluators e JOIN rounds r ON r.id = e.round_id \
         WHERE e.device_id = $1 AND e.state IN {PENDING_EVALUATOR_STATES} \
         AND r.result_version_id = $2 AND r.eval_state = 'open' AND r.eval_deadline_ms > $3 \
         LIMIT 1"
    )))
    .bind(device_id)
    .bind(version_id)
    .bind(now_ms())
    .fetch_optional(&db.pool)
    .await?;
    Ok(found.is_some())
}

/// What a device reports about the version it evaluated.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Report {
    pub loss: f64,
    pub accuracy: f64,
    pub samples: u64,
}

/// What became of a report or a decline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Taken,
    /// The device was not asked to evaluate this round's version.
    NotEvaluator,
    /// It already reported or declined.
    AlreadyAnswered,
    /// It withdrew as ineligible; a second withdrawal finds it standing.
    AlreadyWithdrawn,
    /// The evaluation closed (deadline), or the device was dropped from it.
    Closed,
}

/// The one decision on a report, a decline or a withdrawal, from the
/// evaluator's state and the evaluation's: not an evaluator, already
/// answered (or withdrawn), closed, or taken, in that order (so a device whose report counted hears so even
/// after the close).
pub fn admit(
    evaluator: Option<EvaluatorState>,
    evaluation: Option<EvaluationState>,
    deadline_ms: Option<i64>,
    now: i64,
) -> Outcome {
    match evaluator {
        None => Outcome::NotEvaluator,
        Some(EvaluatorState::Reported) => Outcome::AlreadyAnswered,
        Some(EvaluatorState::Ineligible) => Outcome::AlreadyWithdrawn,
        Some(EvaluatorState::Dropped) => Outcome::Closed,
        Some(EvaluatorState::Selected | EvaluatorState::Delivered) => {
            let open = evaluation == Some(EvaluationState::Open)
                && deadline_ms.is_some_and(|deadline| now < deadline);
            if open {
                Outcome::Taken
            } else {
                Outcome::Closed
            }
        }
    }
}

async fn standing(
    tx: &mut Tx<'_>,
    round_id: i64,
    device_id: i64,
) -> Result<(Option<EvaluatorState>, Option<EvaluationState>, Option<i64>), sqlx::Error> {
    let evaluator: Option<(String,)> =
        sqlx::query_as("SELECT state FROM evaluators WHERE round_id = $1 AND device_id = $2")
            .bind(round_id)
            .bind(device_id)
            .fetch_optional(&mut **tx)
            .await?;
    let round: Option<(Option<String>, Option<i64>)> =
        sqlx::query_as("SELECT eval_state, eval_deadline_ms FROM rounds WHERE id = $1")
            .bind(round_id)
            .fetch_optional(&mut **tx)
            .await?;
    let evaluator = evaluator
        .map(|(text,)| super::parse_state::<EvaluatorState>("evaluators.state", text))
        .transpose()?;
    let (evaluation, deadline_ms) = round.unwrap_or((None, None));
    let evaluation = evaluation
        .map(|text| super::parse_state::<EvaluationState>("rounds.eval_state", text))
        .transpose()?;
    Ok((evaluator, evaluation, deadline_ms))
}

/// Records a device's evaluation of the round's version.
pub async fn report(
    db: &Db,
    round_id: i64,
    device_id: i64,
    report: Report,
) -> Result<Outcome, sqlx::Error> {
    let _writer = db.write_lock().await;
    let mut tx = db.pool.begin().await?;
    let (evaluator, evaluation, deadline) = standing(&mut tx, round_id, device_id).await?;
    let outcome = admit(evaluator, evaluation, deadline, now_ms());
    if outcome == Outcome::Taken {
        sqlx::query(
            "UPDATE evaluators SET state = 'reported', reported_ms = $1, loss = $2, \
             accuracy = $3, samples = $4 WHERE round_id = $5 AND device_id = $6",
        )
        .bind(now_ms())
        .bind(report.loss)
        .bind(report.accuracy)
        .bind(i64::try_from(report.samples).unwrap_or(i64::MAX))
        .bind(round_id)
        .bind(device_id)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
    }
    Ok(outcome)
}

/// A device gives up its evaluation task, saying why.
pub async fn decline(
    db: &Db,
    round_id: i64,
    device_id: i64,
    reason: &str,
) -> Result<Outcome, sqlx::Error> {
    let reason = format!("declined: {reason}");
    give_up(db, round_id, device_id, EvaluatorState::Dropped, &reason).await
}

/// A device that no longer meets the job's device policy withdraws from
/// its evaluation task: it becomes `ineligible`, not a dropout. The caller
/// has checked its conditions against the policy.
pub async fn withdraw(
    db: &Db,
    round_id: i64,
    device_id: i64,
    reason: &str,
) -> Result<Outcome, sqlx::Error> {
    give_up(db, round_id, device_id, EvaluatorState::Ineligible, reason).await
}

/// An evaluator leaves its task for `state`, with `reason`, if [`admit`]
/// takes it.
async fn give_up(
    db: &Db,
    round_id: i64,
    device_id: i64,
    state: EvaluatorState,
    reason: &str,
) -> Result<Outcome, sqlx::Error> {
    let _writer = db.write_lock().await;
    let mut tx = db.pool.begin().await?;
    let (evaluator, evaluation, deadline) = standing(&mut tx, round_id, device_id).await?;
    let outcome = admit(evaluator, evaluation, deadline, now_ms());
    if outcome == Outcome::Taken {
        sqlx::query(
            "UPDATE evaluators SET state = $1, drop_reason = $2 \
             WHERE round_id = $3 AND device_id = $4",
        )
        .bind(state.as_str())
        .bind(reason)
        .bind(round_id)
        .bind(device_id)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
    }
    Ok(outcome)
}

/// Open evaluations that can close now: past their deadline, or with no
/// evaluator left pending.
pub async fn due(db: &Db, limit: i64) -> Result<Vec<i64>, sqlx::Error> {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT r.id FROM rounds r WHERE r.eval_state = 'open' AND (r.eval_deadline_ms <= $1 \
         OR NOT EXISTS (SELECT 1 FROM evaluators e WHERE e.round_id = r.id \
         AND e.state IN {PENDING_EVALUATOR_STATES})) ORDER BY r.id LIMIT $2"
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
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE evaluators SET state = 'dropped', \
         drop_reason = 'timeout: no evaluation before the deadline' \
         WHERE round_id = $1 AND state IN {PENDING_EVALUATOR_STATES}"
    )))
    .bind(round_id)
    .execute(&mut **tx)
    .await?;
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

/// The sample-weighted means of what the evaluators reported.
#[derive(Clone, Debug, Default, FromRow)]
pub struct FederatedEvaluation {
    pub accuracy: Option<f64>,
    pub loss: Option<f64>,
    pub samples: Option<i64>,
    pub devices: i64,
    pub dropped: i64,
    /// Evaluators that withdrew under the job's device policy.
    pub ineligible: i64,
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

/// A version waiting for its central evaluation.
#[derive(Clone, Debug, FromRow)]
pub struct CentralTask {
    pub round_id: i64,
    pub job_id: i64,
    pub version_id: i64,
    /// The job's spec, which names the dataset.
    pub config: String,
    #[sqlx(try_from = "String")]
    pub job_state: JobState,
    /// Attempts already started (each committed before its worker ran).
    pub attempts: i64,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pending_list_is_the_enum() {
        let pending: Vec<String> = EvaluatorState::ALL
            .iter()
            .filter(|s| matches!(s, EvaluatorState::Selected | EvaluatorState::Delivered))
            .map(|s| format!("'{s}'"))
            .collect();
        assert_eq!(
            PENDING_EVALUATOR_STATES,
            format!("({})", pending.join(", "))
        );
    }

    #[test]
    fn admit_decides_in_one_order() {
        use EvaluationState::*;
        use EvaluatorState::*;
        let open = (Some(Open), Some(100));
        assert_eq!(admit(None, open.0, open.1, 50), Outcome::NotEvaluator);
        assert_eq!(
            admit(Some(Reported), Some(Closed), open.1, 500),
            Outcome::AlreadyAnswered
        );
        assert_eq!(admit(Some(Dropped), open.0, open.1, 50), Outcome::Closed);
        assert_eq!(
            admit(Some(Ineligible), Some(Closed), open.1, 500),
            Outcome::AlreadyWithdrawn
        );
        assert_eq!(admit(Some(Delivered), open.0, open.1, 50), Outcome::Taken);
        assert_eq!(
            admit(Some(Selected), open.0, open.1, 100),
            Outcome::Closed,
            "at the deadline"
        );
        assert_eq!(
            admit(Some(Delivered), Some(Closed), open.1, 50),
            Outcome::Closed
        );
    }
}
