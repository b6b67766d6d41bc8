//! Upgrading a database keeps what it holds. A round that is open when
//! the server is upgraded keeps its running sum: before migration
//! `round_sums` (SQLite 0017, PostgreSQL 0018) the sum was the column
//! `rounds.update_sum`; after it, the same bytes are in `round_sums`, and
//! `rounds` no longer has the column. A round that failed before causes
//! were recorded (`failure_kind`, SQLite 0019, PostgreSQL 0020) reads as
//! `unrecorded`; other rounds have no kind.

use anyhow::{Context, Result, ensure};
use canopy_server::migrations::{POSTGRES, SQLITE};
use sqlx::any::AnyPoolOptions;
use sqlx::migrate::Migrator;

use crate::support;

/// A sum as a round of a few parameters would hold it, and large enough
/// to span SQLite overflow pages.
fn sum_bytes() -> Vec<u8> {
    (0..20_000u32)
        .flat_map(|i| i.wrapping_mul(2_654_435_761).to_le_bytes())
        .collect()
}

async fn an_upgrade_keeps_a_running_sum(
    url: &str,
    migrator: &Migrator,
    last_before: i64,
) -> Result<()> {
    sqlx::any::install_default_drivers();
    // One connection, so that the session setting below holds for every
    // statement.
    let pool = AnyPoolOptions::new()
        .max_connections(1)
        .connect(url)
        .await?;
    migrator
        .run_to(last_before, &pool)
        .await
        .context("migrating to the old schema")?;
    // The rounds' jobs and versions are beside the point: this session
    // checks no foreign keys. (Each round has a job of its own, since a job
    // has at most one open round.)
    let no_foreign_keys = if url.starts_with("postgres") {
        "SET session_replication_role = replica"
    } else {
        "PRAGMA foreign_keys = OFF"
    };
    sqlx::query(no_foreign_keys).execute(&pool).await?;
    let sum = sum_bytes();
    let rounds = [
        (1i64, "training", Some(sum.clone())),
        (2, "training", None),
        (3, "failed", None),
        (4, "succeeded", None),
    ];
    for (id, state, stored) in rounds {
        sqlx::query(
            "INSERT INTO rounds (id, job_id, number, attempt, state, base_version_id, \
             target_devices, min_devices, created_ms, update_sum) \
             VALUES ($1, $1, 1, 1, $2, 1, 10, 2, 0, $3)",
        )
        .bind(id)
        .bind(state)
        .bind(stored)
        .execute(&pool)
        .await?;
    }
    migrator.run(&pool).await.context("upgrading")?;
    let rows: Vec<(i64, Vec<u8>)> =
        sqlx::query_as("SELECT round_id, update_sum FROM round_sums ORDER BY round_id")
            .fetch_all(&pool)
            .await?;
    ensure!(
        rows.len() == 1,
        "round_sums has {} rows, expected 1",
        rows.len()
    );
    ensure!(rows[0].0 == 1, "the sum moved to round {}", rows[0].0);
    ensure!(rows[0].1 == sum, "the sum changed on the way");
    let old_column = sqlx::query("SELECT update_sum FROM rounds")
        .fetch_all(&pool)
        .await;
    ensure!(old_column.is_err(), "rounds still has update_sum");
    let kinds: Vec<(i64, Option<String>)> =
        sqlx::query_as("SELECT id, failure_kind FROM rounds ORDER BY id")
            .fetch_all(&pool)
            .await?;
    let unrecorded = Some("unrecorded".to_string());
    ensure!(
        kinds == [(1, None), (2, None), (3, unrecorded), (4, None)],
        "failure kinds after the upgrade: {kinds:?}"
    );
    pool.close().await;
    Ok(())
}

#[tokio::test]
async fn an_sqlite_upgrade_keeps_a_running_sum() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let url = format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("canopy.db").display()
    );
    an_upgrade_keeps_a_running_sum(&url, &SQLITE, 16).await
}

#[tokio::test]
async fn a_postgres_upgrade_keeps_a_running_sum() -> Result<()> {
    let (url, name) = support::create_postgres_database()?;
    let outcome = an_upgrade_keeps_a_running_sum(&url, &POSTGRES, 17).await;
    support::drop_postgres_database(&name)?;
    outcome
}
