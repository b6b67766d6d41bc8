//! A job's server-optimizer state, one row per job, replaced inside the
//! transaction that writes the round's version (see `crate::strategy`).

use super::rounds::Tx;
use crate::db::now_ms;

/// The stored state and the number of rounds it has folded in, or `None`
/// before the job's first successful round.
pub async fn get(tx: &mut Tx<'_>, job_id: i64) -> Result<Option<(i64, Vec<u8>)>, sqlx::Error> {
    sqlx::query_as("SELECT rounds, state FROM strategy_states WHERE job_id = $1")
        .bind(job_id)
        .fetch_optional(&mut **tx)
        .await
}

pub async fn put(
    tx: &mut Tx<'_>,
    job_id: i64,
    rounds: i64,
    state: &[u8],
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO strategy_states (job_id, rounds, state, updated_ms) VALUES ($1, $2, $3, $4) \
         ON CONFLICT (job_id) DO UPDATE SET rounds = excluded.rounds, state = excluded.state, \
         updated_ms = excluded.updated_ms",
    )
    .bind(job_id)
    .bind(rounds)
    .bind(state)
    .bind(now_ms())
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Drops a finished job's state: no round will read it again, and it is
/// one or two model-sized vectors.
pub async fn delete(tx: &mut Tx<'_>, job_id: i64) -> Result<(), sqlx::Error> {
    sqlx::query("DELETE FROM strategy_states WHERE job_id = $1")
        .bind(job_id)
        .execute(&mut **tx)
        .await?;
    Ok(())
}
