//! A device's answer to its evaluation task racing the evaluation's close,
//! on PostgreSQL, through the store's own functions.
//!
//! The close (`evaluations::close`, as the orchestrator runs it) moves the
//! round's evaluation to `closed` and drops every evaluator still pending,
//! in one transaction. A report, decline or withdrawal that reads the
//! evaluator as pending while that transaction is under way must not
//! overwrite the drop once it commits: whichever commits second must see
//! the first. Each case here holds the close's transaction open (its row
//! locks are the only ones it takes), starts the answer, waits until the
//! answer waits on a lock, then commits the close: the answer must then
//! hear that the evaluation closed, and the evaluator must stay dropped
//! by the close. (With no state condition and no round lock, the answer
//! read the evaluator as pending before the close committed and wrote
//! over the drop after, counted in a closed evaluation: each case here
//! failed so, answered `Taken`.)
//!
//! A participant's decline and withdrawal, which go through the same
//! state machine (`store::task_state`), race a training round's close
//! (`rounds::close`) the same way.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use canopy_server::config::Limits;
use canopy_server::db::{Db, now_ms};
use canopy_server::store::evaluations::{self, EvaluatorState, Report};
use canopy_server::store::rounds::{self, ParticipantState, RoundKind};
use canopy_server::store::task_state::{self, Admission};
use sqlx::AnyPool;
use sqlx::any::AnyPoolOptions;

use crate::support;

const DEVICE_ID: i64 = 1;
const TIMEOUT: Duration = Duration::from_secs(30);

/// One fresh PostgreSQL database with the server's schema: the store's
/// `Db`, and a one-connection pool whose session checks no foreign keys,
/// to set up rounds without the models, jobs and devices they point at.
struct Database {
    db: Db,
    setup: AnyPool,
    name: String,
}

impl Database {
    async fn create() -> Result<Database> {
        let (url, name) = support::create_postgres_database()?;
        let db = Db::connect(&url, &Limits::default()).await?;
        db.migrate().await?;
        let setup = AnyPoolOptions::new()
            .max_connections(1)
            .connect(&url)
            .await?;
        sqlx::query("SET session_replication_role = replica")
            .execute(&setup)
            .await?;
        Ok(Database { db, setup, name })
    }

    /// A round of a running job with one task of the kind `closing`
    /// closes, which its device has taken: a succeeded round whose
    /// evaluation is open, or a round that trains. Its id.
    async fn task_taken(&self, closing: Close) -> Result<i64> {
        sqlx::query(
            "INSERT INTO jobs (id, name, model_version_id, current_version_id, config, state, \
             created_ms, updated_ms) VALUES (1, 'race', 1, 1, '{}', 'running', 0, 0)",
        )
        .execute(&self.setup)
        .await?;
        let mut tx = self.setup.begin().await?;
        let new = rounds::NewRound {
            kind: RoundKind::Train,
            job_id: 1,
            number: 1,
            attempt: 1,
            base_version_id: 1,
            target_devices: 1,
            min_devices: 1,
            max_staleness: None,
            clip_norm: None,
            robust_rule: None,
        };
        let round_id = rounds::open_round(&mut tx, &new)
            .await?
            .context("no round opened")?;
        let (devices, deadline_ms) = (&[DEVICE_ID], now_ms() + 3_600_000);
        match closing {
            Close::Evaluation => {
                sqlx::query(
                    "UPDATE rounds SET state = 'succeeded', result_version_id = 2 WHERE id = $1",
                )
                .bind(round_id)
                .execute(&mut *tx)
                .await?;
                task_state::open::<EvaluatorState>(&mut tx, round_id, devices, deadline_ms).await?
            }
            Close::Training => {
                task_state::open::<ParticipantState>(&mut tx, round_id, devices, deadline_ms)
                    .await?
            }
        }
        tx.commit().await?;
        let taken = match closing {
            Close::Evaluation => evaluations::take(&self.db, DEVICE_ID)
                .await?
                .map(|t| t.round_id),
            Close::Training => rounds::take_task(&self.db, DEVICE_ID)
                .await?
                .map(|t| t.round_id),
        };
        ensure!(
            taken == Some(round_id),
            "the device took {taken:?}, not its task in round {round_id}"
        );
        Ok(round_id)
    }

    /// Sessions of this database waiting for a lock.
    async fn lock_waits(&self) -> Result<i64> {
        Ok(sqlx::query_scalar(
            "SELECT COUNT(*) FROM pg_stat_activity \
             WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .fetch_one(&self.setup)
        .await?)
    }

    /// The device's state and drop reason in `table`.
    async fn task(&self, table: &str, round_id: i64) -> Result<(String, Option<String>)> {
        Ok(sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT state, drop_reason FROM {table} WHERE round_id = $1 AND device_id = $2"
        )))
        .bind(round_id)
        .bind(DEVICE_ID)
        .fetch_one(&self.setup)
        .await?)
    }

    async fn remove(self) -> Result<()> {
        self.db.pool.close().await;
        self.setup.close().await;
        support::drop_postgres_database(&self.name)
    }
}

#[derive(Clone, Copy, Debug)]
enum Answer {
    Report,
    Decline,
    Withdraw,
}

async fn answer(db: Db, round_id: i64, answer: Answer) -> Result<Admission, sqlx::Error> {
    type Evaluator = EvaluatorState;
    match answer {
        Answer::Report => {
            let report = Report {
                loss: 0.5,
                accuracy: 0.75,
                samples: 40,
            };
            evaluations::report(&db, round_id, DEVICE_ID, report).await
        }
        Answer::Decline => {
            task_state::decline::<Evaluator>(&db, round_id, DEVICE_ID, "low battery").await
        }
        Answer::Withdraw => {
            task_state::withdraw::<Evaluator>(&db, round_id, DEVICE_ID, "ineligible: battery").await
        }
    }
}

/// A participant's answer: the same decline and withdrawal.
async fn participant_answer(
    db: Db,
    round_id: i64,
    answer: Answer,
) -> Result<Admission, sqlx::Error> {
    type Participant = ParticipantState;
    match answer {
        Answer::Report => unreachable!("a participant uploads; it does not report"),
        Answer::Decline => {
            task_state::decline::<Participant>(&db, round_id, DEVICE_ID, "low battery").await
        }
        Answer::Withdraw => {
            task_state::withdraw::<Participant>(&db, round_id, DEVICE_ID, "ineligible: battery")
                .await
        }
    }
}

/// What closes a task: an evaluation's close, or a training round's.
#[derive(Clone, Copy, Debug)]
enum Close {
    Evaluation,
    Training,
}

const TRAINING_CLOSE_REASON: &str = "timeout: no update before the deadline";

/// The close's transaction, open, and `what` started against it: returns
/// once `what` waits on a lock the close holds, or has finished without
/// waiting.
async fn race_close(
    database: &Database,
    round_id: i64,
    closing: Close,
    what: Answer,
) -> Result<Admission> {
    let mut close = database.db.pool.begin().await?;
    let db = database.db.clone();
    let racing = match closing {
        Close::Evaluation => {
            ensure!(
                evaluations::close(&mut close, round_id).await?,
                "round {round_id}'s evaluation was not open"
            );
            tokio::spawn(answer(db, round_id, what))
        }
        Close::Training => {
            rounds::close(&mut close, round_id, Some(TRAINING_CLOSE_REASON)).await?;
            tokio::spawn(participant_answer(db, round_id, what))
        }
    };
    let started = Instant::now();
    while database.lock_waits().await? == 0 && !racing.is_finished() {
        if started.elapsed() > TIMEOUT {
            bail!("the {what:?} neither waited on the close's locks nor finished");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    close.commit().await?;
    let outcome = tokio::time::timeout(TIMEOUT, racing)
        .await
        .context("the answer did not finish once the close committed")???;
    Ok(outcome)
}

/// An answer that races the close either commits first (and the close
/// then finds the evaluator answered) or hears that the evaluation is
/// closed; it never overwrites the close's drop.
async fn an_answer_racing_the_close_does_not_overwrite_it(what: Answer) -> Result<()> {
    let database = Database::create().await?;
    let round_id = database.task_taken(Close::Evaluation).await?;
    let outcome = race_close(&database, round_id, Close::Evaluation, what).await;
    let evaluator = database.task("evaluators", round_id).await;
    let counted = evaluations::federated(&database.db, round_id).await;
    database.remove().await?;
    let (outcome, (state, reason), counted) = (outcome?, evaluator?, counted?);
    ensure!(
        outcome == Admission::Closed,
        "the {what:?} that raced the close was answered {outcome:?}, not Closed; the evaluator \
         is now `{state}` ({reason:?}) in a closed evaluation"
    );
    ensure!(
        state == "dropped" && reason.as_deref().is_some_and(|r| r.starts_with("timeout")),
        "the close dropped the evaluator, but the {what:?} left it `{state}` ({reason:?})"
    );
    ensure!(
        counted.devices == 0 && counted.dropped == 1 && counted.ineligible == 0,
        "the closed evaluation counts {} reports, {} dropped and {} ineligible after the {what:?}",
        counted.devices,
        counted.dropped,
        counted.ineligible
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_racing_the_close_is_refused() -> Result<()> {
    an_answer_racing_the_close_does_not_overwrite_it(Answer::Report).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decline_racing_the_close_is_refused() -> Result<()> {
    an_answer_racing_the_close_does_not_overwrite_it(Answer::Decline).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_withdrawal_racing_the_close_is_refused() -> Result<()> {
    an_answer_racing_the_close_does_not_overwrite_it(Answer::Withdraw).await
}

/// The participant's side of the same machine: a decline or withdrawal
/// racing the round's close hears that the round closed, the participant
/// stays dropped by the close, and the round counts one dropout, not two.
async fn a_participant_racing_the_close_does_not_overwrite_it(what: Answer) -> Result<()> {
    let database = Database::create().await?;
    let round_id = database.task_taken(Close::Training).await?;
    let outcome = race_close(&database, round_id, Close::Training, what).await;
    let participant = database.task("participants", round_id).await;
    let round = rounds::get(&database.db, round_id).await;
    database.remove().await?;
    let (outcome, (state, reason)) = (outcome?, participant?);
    let round = round?.context("the round is gone")?;
    ensure!(
        outcome == Admission::Closed,
        "the participant's {what:?} that raced the close was answered {outcome:?}, not Closed; \
         it is now `{state}` ({reason:?})"
    );
    ensure!(
        state == "dropped" && reason.as_deref() == Some(TRAINING_CLOSE_REASON),
        "the close dropped the participant, but the {what:?} left it `{state}` ({reason:?})"
    );
    ensure!(
        round.dropouts == 1 && round.ineligible == 0,
        "the closed round counts {} dropouts and {} ineligible after the {what:?}",
        round.dropouts,
        round.ineligible
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_participant_decline_racing_the_close_is_refused() -> Result<()> {
    a_participant_racing_the_close_does_not_overwrite_it(Answer::Decline).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_participant_withdrawal_racing_the_close_is_refused() -> Result<()> {
    a_participant_racing_the_close_does_not_overwrite_it(Answer::Withdraw).await
}
