//! The one state machine of a device's task in a round, for both kinds
//! of task: a participant's (it trains; rows of `participants`) and an
//! evaluator's (it evaluates the version the round produced; rows of
//! `evaluators`).
//!
//! Both kinds have the same states but the one they answer with:
//! `selected` → `delivered` (task fetched) → answered (`uploaded`, or
//! `reported`), or `dropped` (declined, or still pending when the task
//! closed), or `ineligible` (withdrew because it no longer met the job's
//! device policy; not a dropout). `task_state!` declares both enums from
//! one list, so their pending states cannot drift apart; [`States`] writes
//! their SQL lists from the enums; [`admit`] is the one decision on an
//! answer; [`answer`] is the one transition a report, a decline or a
//! withdrawal makes.
//!
//! Every answer takes the round's row lock first (as the upload fold
//! does, and as every close of a task does: a round's close, fail or
//! evaluation close updates the round's row), then moves the task with a
//! conditional UPDATE from a pending state. So an answer and a close never
//! both act on one task, on PostgreSQL across server processes too: the
//! second to take the lock sees what the first committed
//! (`server/tests/evaluator_race.rs`).

use crate::store::row::any_row;
use std::fmt;
use std::marker::PhantomData;

use sqlx::FromRow;
use sqlx::any::AnyRow;

use super::evaluations::EvaluationState;
use super::rounds::{RoundState, Tx};
use super::{UnknownState, parse_state};
use crate::db::{Db, now_ms};

/// Where a device stands in its task, whatever the kind: every decision
/// on a task reads this, never a state's text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Selected, or its task delivered: still expected to answer.
    Pending,
    /// Answered: its update uploaded, or its evaluation reported.
    Answered,
    /// Out without an answer: it declined, or the task closed without one.
    Dropped,
    /// Withdrew because it no longer met the job's device policy.
    Withdrawn,
}

/// The two kinds of task a device holds in a round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TaskKind {
    /// It trains on the round's base version (`participants`).
    Training,
    /// It evaluates the version the round produced (`evaluators`).
    Evaluation,
}

impl TaskKind {
    /// The table that holds this kind's tasks, one row per round and device.
    pub fn table(self) -> &'static str {
        match self {
            TaskKind::Training => "participants",
            TaskKind::Evaluation => "evaluators",
        }
    }

    /// Whether the round takes answers to this kind of task: a round while
    /// it trains (an upload also checks the deadline, see
    /// `rounds::admit`), an evaluation while it is open and before its
    /// deadline.
    fn is_open(self, round: &LockedRound, now_ms: i64) -> Result<bool, sqlx::Error> {
        Ok(match self {
            TaskKind::Training => round.state.takes_updates(round.max_staleness.is_some()),
            TaskKind::Evaluation => {
                let evaluation = round
                    .eval_state
                    .clone()
                    .map(|text| parse_state("rounds.eval_state", text))
                    .transpose()?;
                evaluation == Some(EvaluationState::Open)
                    && round
                        .eval_deadline_ms
                        .is_some_and(|deadline| now_ms < deadline)
            }
        })
    }

    /// The condition under which round `r` hands out this kind of task:
    /// while it takes updates ([`RoundState::takes_updates`]), or while its
    /// evaluation is open, until the deadline (`$1`, now).
    fn open_sql(self) -> String {
        match self {
            TaskKind::Training => format!(
                "{} AND r.deadline_ms > $1",
                super::rounds::takes_updates_sql()
            ),
            TaskKind::Evaluation => "r.eval_state = 'open' AND r.eval_deadline_ms > $1".to_string(),
        }
    }

    /// What opening this kind of task records in round `$4`'s row: how
    /// many devices (`$1`), when (`$2`), until when (`$3`). A round moves
    /// from `selecting` to `training`; an evaluation opens, or with no
    /// evaluators closes at once.
    fn open_round_sql(self) -> &'static str {
        match self {
            TaskKind::Training => {
                "UPDATE rounds SET state = 'training', selected_count = $1, \
                 training_started_ms = $2, deadline_ms = $3, status_message = '' \
                 WHERE id = $4 AND state = 'selecting'"
            }
            TaskKind::Evaluation => {
                "UPDATE rounds SET eval_state = CASE WHEN $1 = 0 THEN 'closed' ELSE 'open' END, \
                 eval_selected = $1, eval_closed_ms = CASE WHEN $1 = 0 THEN $2 ELSE NULL END, \
                 eval_deadline_ms = $3 WHERE id = $4"
            }
        }
    }

    /// The model version a task of this kind works on, of round `r`: the
    /// round's base, or the version it produced.
    fn version_sql(self) -> &'static str {
        match self {
            TaskKind::Training => "r.base_version_id",
            TaskKind::Evaluation => "r.result_version_id",
        }
    }

    /// The round's count that a task leaving for `phase` adds one to: a
    /// training round counts its dropouts and withdrawals in its row; an
    /// evaluation counts its evaluators' rows when it is read.
    fn counter(self, phase: Phase) -> Option<&'static str> {
        match (self, phase) {
            (TaskKind::Training, Phase::Dropped) => Some("dropouts"),
            (TaskKind::Training, Phase::Withdrawn) => Some("ineligible"),
            _ => None,
        }
    }
}

/// A task's state enum, as `task_state!` declares it.
pub trait TaskState:
    Copy + Eq + fmt::Debug + Send + Sync + TryFrom<String, Error = UnknownState> + 'static
{
    /// The kind of task whose states these are.
    const KIND: TaskKind;
    /// Every state, in declaration order.
    const STATES: &'static [Self];
    /// The state of an answered task (uploaded, or reported).
    const ANSWERED: Self;
    /// The state of a task dropped without an answer.
    const DROPPED: Self;
    /// The state of a task withdrawn under the job's device policy.
    const WITHDRAWN: Self;

    /// The state as stored.
    fn text(self) -> &'static str;

    fn phase(self) -> Phase;
}

/// Declares a task's state enum: the states every task has, and the one
/// its kind answers with. One declaration for both kinds, so that their
/// pending states, and what each state means, are written once.
macro_rules! task_state {
    (
        $(#[$meta:meta])*
        pub enum $name:ident ($kind:ident) { $answered:ident = $text:literal }
    ) => {
        $crate::store::text_enum! {
            $(#[$meta])*
            pub enum $name {
                Selected = "selected",
                Delivered = "delivered",
                $answered = $text,
                Dropped = "dropped",
                Ineligible = "ineligible",
            }
        }

        impl $crate::store::task_state::TaskState for $name {
            const KIND: $crate::store::task_state::TaskKind =
                $crate::store::task_state::TaskKind::$kind;
            const STATES: &'static [$name] = $name::ALL;
            const ANSWERED: $name = $name::$answered;
            const DROPPED: $name = $name::Dropped;
            const WITHDRAWN: $name = $name::Ineligible;

            fn text(self) -> &'static str {
                self.as_str()
            }

            fn phase(self) -> $crate::store::task_state::Phase {
                use $crate::store::task_state::Phase;
                match self {
                    $name::Selected | $name::Delivered => Phase::Pending,
                    $name::$answered => Phase::Answered,
                    $name::Dropped => Phase::Dropped,
                    $name::Ineligible => Phase::Withdrawn,
                }
            }
        }

        impl $name {
            /// Still expected to answer: selected, or its task delivered.
            pub fn is_pending(self) -> bool {
                use $crate::store::task_state::{Phase, TaskState};
                self.phase() == Phase::Pending
            }

            /// Out of its task without an answer: dropped, or withdrawn as
            /// ineligible. A secure round treats both alike (their masks
            /// must be removed); only dropouts count as dropouts.
            pub fn has_left(self) -> bool {
                use $crate::store::task_state::{Phase, TaskState};
                matches!(self.phase(), Phase::Dropped | Phase::Withdrawn)
            }
        }
    };
}

task_state! {
    /// A participant's state: `selected` → `delivered` (task fetched) →
    /// `uploaded`, or `dropped` when the round closes without its update or
    /// it declines, or `ineligible` when it withdrew because it no longer
    /// meets the job's device policy (counted apart from dropouts).
    pub enum ParticipantState(Training) { Uploaded = "uploaded" }
}

task_state! {
    /// An evaluator's state: `selected` → `delivered` → `reported`, or
    /// `dropped`, or `ineligible` (withdrawn under the job's device policy).
    pub enum EvaluatorState(Evaluation) { Reported = "reported" }
}

/// Some of a task's states as an SQL list, e.g. `('selected',
/// 'delivered')`, written from the enum where a query is formatted, so
/// that no list is kept beside it.
pub struct States<S> {
    phases: &'static [Phase],
    of: PhantomData<S>,
}

impl<S> States<S> {
    /// The pending states: selected, or delivered.
    pub const PENDING: States<S> = States {
        phases: &[Phase::Pending],
        of: PhantomData,
    };
    /// The states of tasks left without an answer: dropped, or ineligible.
    pub const LEFT: States<S> = States {
        phases: &[Phase::Dropped, Phase::Withdrawn],
        of: PhantomData,
    };
}

impl<S: TaskState> fmt::Display for States<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let listed = S::STATES
            .iter()
            .filter(|state| self.phases.contains(&state.phase()));
        let quoted: Vec<String> = listed.map(|state| format!("'{}'", state.text())).collect();
        write!(f, "({})", quoted.join(", "))
    }
}

/// What becomes of a device's answer to its task: an update, a report, a
/// decline or a withdrawal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Taken: the task moved on.
    Taken,
    /// The device has no task of this kind in the round.
    NotMember,
    /// It answered before (uploaded its update, or reported).
    Answered,
    /// It withdrew before: the withdrawal stands.
    Withdrawn,
    /// The round no longer takes answers to the task: it closed, or its
    /// deadline passed.
    Closed,
    /// It was dropped (it declined) while the task was still open.
    Dropped,
}

/// The one decision on an answer to a task, from the device's phase in it
/// and whether the round takes answers: not a member, answered, withdrawn,
/// closed, dropped, or taken, in that order. The device's own earlier
/// answer or withdrawal comes first, so that it hears that its answer
/// counted (or that its withdrawal stands) even after the close; closed
/// comes before dropped, since closing is what drops a silent device.
pub fn admit(member: Option<Phase>, open: bool) -> Admission {
    match member {
        None => Admission::NotMember,
        Some(Phase::Answered) => Admission::Answered,
        Some(Phase::Withdrawn) => Admission::Withdrawn,
        Some(_) if !open => Admission::Closed,
        Some(Phase::Dropped) => Admission::Dropped,
        Some(Phase::Pending) => Admission::Taken,
    }
}

/// A value an answer stores beside the task's new state.
#[derive(Clone, Copy, Debug)]
pub enum Value<'a> {
    Int(i64),
    Float(f64),
    Text(&'a str),
}

any_row! {
    /// What [`answer`] reads of the round under its lock.
    struct LockedRound {
        state: RoundState as String,
        eval_state: Option<String>,
        eval_deadline_ms: Option<i64>,
        max_staleness: Option<i64>,
    }
}

/// The one transition of an answer to a task: under the round's row lock,
/// [`admit`] decides from the task's state, and a taken answer moves the
/// task from a pending state to `to`, storing `columns` with it (and
/// counting it in the round's row where the kind keeps a count).
pub async fn answer<S: TaskState>(
    db: &Db,
    round_id: i64,
    device_id: i64,
    to: S,
    columns: &[(&'static str, Value<'_>)],
) -> Result<Admission, sqlx::Error> {
    let _slot = db.round_write_slot().await;
    let _writer = db.write_lock().await;
    let mut tx = db.pool.begin().await?;
    let round: Option<LockedRound> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT state, eval_state, eval_deadline_ms, max_staleness FROM rounds WHERE id = $1{}",
        db.for_update()
    )))
    .bind(round_id)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(round) = round else {
        return Ok(Admission::NotMember);
    };
    let member = member_state::<S>(&mut tx, round_id, device_id).await?;
    let admission = admit(member.map(S::phase), S::KIND.is_open(&round, now_ms())?);
    if admission != Admission::Taken {
        return Ok(admission);
    }
    if !leave(&mut tx, round_id, device_id, to, columns).await? {
        // Under the round's lock only a writer that skips it (none should)
        // can have moved the task since the read: nothing was written.
        return Ok(Admission::Closed);
    }
    tx.commit().await?;
    Ok(Admission::Taken)
}

/// The device's state in its task of this kind in the round, if it has one.
pub async fn member_state<S: TaskState>(
    tx: &mut Tx<'_>,
    round_id: i64,
    device_id: i64,
) -> Result<Option<S>, sqlx::Error> {
    let table = S::KIND.table();
    let text: Option<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT state FROM {table} WHERE round_id = $1 AND device_id = $2"
    )))
    .bind(round_id)
    .bind(device_id)
    .fetch_optional(&mut **tx)
    .await?;
    text.map(|text| parse_state(&format!("{table}.state"), text))
        .transpose()
}

/// Moves a pending task to `to` with `columns`, counting it in the
/// round's row where the kind keeps a count of that phase (dropouts,
/// withdrawals); false when it was not pending. The caller holds the
/// round's row lock.
pub async fn leave<S: TaskState>(
    tx: &mut Tx<'_>,
    round_id: i64,
    device_id: i64,
    to: S,
    columns: &[(&'static str, Value<'_>)],
) -> Result<bool, sqlx::Error> {
    if !move_pending(tx, round_id, device_id, to, columns).await? {
        return Ok(false);
    }
    if let Some(counter) = S::KIND.counter(to.phase()) {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE rounds SET {counter} = {counter} + 1 WHERE id = $1"
        )))
        .bind(round_id)
        .execute(&mut **tx)
        .await?;
    }
    Ok(true)
}

/// Moves a pending task to `to` with `columns`; false when it was not
/// pending.
pub async fn move_pending<S: TaskState>(
    tx: &mut Tx<'_>,
    round_id: i64,
    device_id: i64,
    to: S,
    columns: &[(&'static str, Value<'_>)],
) -> Result<bool, sqlx::Error> {
    let table = S::KIND.table();
    let pending = States::<S>::PENDING;
    let assignments: String = columns
        .iter()
        .enumerate()
        .map(|(i, (column, _))| format!(", {column} = ${}", i + 4))
        .collect();
    let sql = format!(
        "UPDATE {table} SET state = $3{assignments} \
         WHERE round_id = $1 AND device_id = $2 AND state IN {pending}"
    );
    let mut query = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(round_id)
        .bind(device_id)
        .bind(to.text());
    for (_, value) in columns {
        query = match *value {
            Value::Int(value) => query.bind(value),
            Value::Float(value) => query.bind(value),
            Value::Text(value) => query.bind(value.to_string()),
        };
    }
    Ok(query.execute(&mut **tx).await?.rows_affected() == 1)
}

/// A device gives up its task, saying why: it becomes a dropout at once
/// instead of at the close.
pub async fn decline<S: TaskState>(
    db: &Db,
    round_id: i64,
    device_id: i64,
    reason: &str,
) -> Result<Admission, sqlx::Error> {
    let reason = format!("declined: {reason}");
    let columns = [("drop_reason", Value::Text(&reason))];
    answer(db, round_id, device_id, S::DROPPED, &columns).await
}

/// A device that no longer meets the job's device policy withdraws from
/// its task: it becomes `ineligible` with `reason`, not a dropout, and
/// the round stops waiting for it. The caller has checked its conditions
/// against the policy.
pub async fn withdraw<S: TaskState>(
    db: &Db,
    round_id: i64,
    device_id: i64,
    reason: &str,
) -> Result<Admission, sqlx::Error> {
    let columns = [("drop_reason", Value::Text(reason))];
    answer(db, round_id, device_id, S::WITHDRAWN, &columns).await
}

/// The tasks of this kind to do now, as SQL to select from: `t` a pending
/// task, in round `r` of job `j`, which hands it out (`$1` binds now). The
/// one condition a task is handed out, waited for, or its version
/// downloaded under.
pub fn open_tasks<S: TaskState>() -> String {
    let (table, pending) = (S::KIND.table(), States::<S>::PENDING);
    format!(
        "{table} t JOIN rounds r ON r.id = t.round_id JOIN jobs j ON j.id = r.job_id \
         WHERE t.state IN {pending} AND {}",
        S::KIND.open_sql()
    )
}

/// A task as a device is handed it, read by [`take`].
pub trait HandedTask: for<'r> FromRow<'r, AnyRow> + Send + Unpin {
    fn round_id(&self) -> i64;
}

/// The device's oldest task of this kind to do now, read as `T` from
/// `columns` (of round `r` and job `j`), marked delivered. One delivered
/// already is handed out again, so a device that restarts picks its work
/// back up; a paused job hands out nothing.
pub async fn take<S: TaskState, T: HandedTask>(
    db: &Db,
    device_id: i64,
    columns: &str,
) -> Result<Option<T>, sqlx::Error> {
    let now = now_ms();
    let task: Option<T> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {columns} FROM {} AND t.device_id = $2 AND j.state = 'running' \
         ORDER BY r.id LIMIT 1",
        open_tasks::<S>()
    )))
    .bind(now)
    .bind(device_id)
    .fetch_optional(&db.pool)
    .await?;
    if let Some(task) = &task {
        deliver::<S>(db, task.round_id(), device_id, now).await?;
    }
    Ok(task)
}

/// Whether the device has a task of this kind to do on the version: only
/// then may it download it.
pub async fn has_task_on_version<S: TaskState>(
    db: &Db,
    device_id: i64,
    version_id: i64,
) -> Result<bool, sqlx::Error> {
    let found: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT r.id FROM {} AND t.device_id = $2 AND {} = $3 LIMIT 1",
        open_tasks::<S>(),
        S::KIND.version_sql()
    )))
    .bind(now_ms())
    .bind(device_id)
    .bind(version_id)
    .fetch_optional(&db.pool)
    .await?;
    Ok(found.is_some())
}

/// Gives these devices a task of this kind in the round, `selected` now;
/// when, for the round's row.
pub async fn select<S: TaskState>(
    tx: &mut Tx<'_>,
    round_id: i64,
    device_ids: &[i64],
) -> Result<i64, sqlx::Error> {
    let now = now_ms();
    let insert = format!(
        "INSERT INTO {} (round_id, device_id, state, selected_ms) VALUES ($1, $2, 'selected', $3)",
        S::KIND.table()
    );
    for device_id in device_ids {
        sqlx::query(sqlx::AssertSqlSafe(insert.clone()))
            .bind(round_id)
            .bind(device_id)
            .bind(now)
            .execute(&mut **tx)
            .await?;
    }
    Ok(now)
}

/// Opens the round's tasks of this kind for these devices, `selected`,
/// until `deadline_ms`: the round starts training, or the evaluation of
/// its version opens (and, with no evaluators, closes at once).
pub async fn open<S: TaskState>(
    tx: &mut Tx<'_>,
    round_id: i64,
    device_ids: &[i64],
    deadline_ms: i64,
) -> Result<(), sqlx::Error> {
    let now = select::<S>(tx, round_id, device_ids).await?;
    sqlx::query(S::KIND.open_round_sql())
        .bind(device_ids.len() as i64)
        .bind(now)
        .bind(deadline_ms)
        .bind(round_id)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Marks a task delivered when its device fetches it; one delivered
/// already stays so.
async fn deliver<S: TaskState>(
    db: &Db,
    round_id: i64,
    device_id: i64,
    now_ms: i64,
) -> Result<(), sqlx::Error> {
    let _writer = db.write_lock().await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE {} SET state = 'delivered', delivered_ms = $1 \
         WHERE round_id = $2 AND device_id = $3 AND state = 'selected'",
        S::KIND.table()
    )))
    .bind(now_ms)
    .bind(round_id)
    .bind(device_id)
    .execute(&db.pool)
    .await?;
    Ok(())
}

/// Drops every task of the round still pending, with `reason`, as its
/// close does; how many it dropped.
pub async fn drop_pending<S: TaskState>(
    tx: &mut Tx<'_>,
    round_id: i64,
    reason: &str,
) -> Result<u64, sqlx::Error> {
    let pending = States::<S>::PENDING;
    let dropped = sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE {} SET state = 'dropped', drop_reason = $2 \
         WHERE round_id = $1 AND state IN {pending}",
        S::KIND.table()
    )))
    .bind(round_id)
    .bind(reason)
    .execute(&mut **tx)
    .await?;
    Ok(dropped.rows_affected())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::evaluations::EvaluatorState;
    use crate::store::rounds::ParticipantState;

    #[test]
    fn the_sql_lists_are_written_from_the_enums() {
        let pending = "('selected', 'delivered')";
        assert_eq!(States::<ParticipantState>::PENDING.to_string(), pending);
        assert_eq!(States::<EvaluatorState>::PENDING.to_string(), pending);
        let left = "('dropped', 'ineligible')";
        assert_eq!(States::<ParticipantState>::LEFT.to_string(), left);
        assert_eq!(States::<EvaluatorState>::LEFT.to_string(), left);
    }

    #[test]
    fn each_kind_answers_with_its_own_state() {
        use ParticipantState as P;
        assert_eq!(P::ANSWERED.phase(), Phase::Answered);
        assert_eq!(EvaluatorState::ANSWERED, EvaluatorState::Reported);
        assert_eq!(P::WITHDRAWN.phase(), Phase::Withdrawn);
        assert!(P::Delivered.is_pending() && !P::Uploaded.is_pending());
        assert!(P::Ineligible.has_left() && !P::Ineligible.is_pending());
    }

    #[test]
    fn admit_decides_in_one_order() {
        use Phase::*;
        assert_eq!(admit(None, true), Admission::NotMember);
        // A counted answer, or a withdrawal, stands even after the close.
        assert_eq!(admit(Some(Answered), false), Admission::Answered);
        assert_eq!(admit(Some(Withdrawn), false), Admission::Withdrawn);
        // Closed comes before dropped: closing is what dropped the device.
        assert_eq!(admit(Some(Dropped), false), Admission::Closed);
        assert_eq!(admit(Some(Dropped), true), Admission::Dropped);
        assert_eq!(admit(Some(Pending), false), Admission::Closed);
        assert_eq!(admit(Some(Pending), true), Admission::Taken);
    }
}
