//! The database checks the real binary makes before it works on a
//! database: `token` and `migrate` never create one by mistake, a file
//! that is not a database fails at once, a damaged database fails its
//! integrity check, and a damaged write-ahead log that would silently drop
//! committed transactions is refused.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::str::FromStr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use sqlx::ConnectOptions;
use sqlx::sqlite::{SqliteConnectOptions, SqliteConnection};

fn server_bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_canopy-server"))
}

/// Gives an existing data directory and its database files the modes the
/// server requires (0700 and 0600), as an operator's would have: these
/// tests are about the files' contents, not their modes.
fn make_private(data_dir: &Path) -> Result<()> {
    #[cfg(unix)]
    if data_dir.is_dir() {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(data_dir, std::fs::Permissions::from_mode(0o700))?;
        for name in ["canopy.db", "canopy.db-wal", "canopy.db-shm"] {
            let file = data_dir.join(name);
            if file.exists() {
                std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600))?;
            }
        }
    }
    Ok(())
}

fn run(args: &[&str], data_dir: &Path) -> Result<Output> {
    make_private(data_dir)?;
    Ok(server_bin()
        .args(args)
        .arg("--data-dir")
        .arg(data_dir)
        .env_remove("CANOPY_DATABASE_URL")
        .env_remove("CANOPY_DATA_DIR")
        .output()?)
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

fn expect_failure(output: &Output, needles: &[&str]) -> Result<()> {
    let text = stderr(output);
    ensure!(!output.status.success(), "succeeded: {text}");
    for needle in needles {
        ensure!(text.contains(needle), "stderr lacks `{needle}`:\n{text}");
    }
    Ok(())
}

fn expect_success(output: &Output) -> Result<()> {
    ensure!(output.status.success(), "failed: {}", stderr(output));
    Ok(())
}

#[test]
fn token_and_migrate_refuse_a_missing_data_directory() -> Result<()> {
    let root = tempfile::tempdir()?;
    let typo = root.path().join("typo");
    let typo_text = typo.display().to_string();
    for args in [
        &["token", "list"][..],
        &["token", "create", "--role", "admin"],
        &["token", "revoke", "1"],
        &["migrate"],
    ] {
        let output = run(args, &typo)?;
        expect_failure(
            &output,
            &[
                &format!("the data directory {typo_text} does not exist"),
                "hint:",
                "--create",
                "canopy-server serve",
            ],
        )
        .with_context(|| format!("{args:?}"))?;
        ensure!(!typo.exists(), "{args:?} created {typo_text}");
    }

    // A data directory without the database: the file is named.
    let empty = root.path().join("empty");
    std::fs::create_dir(&empty)?;
    let output = run(&["token", "list"], &empty)?;
    let database = empty.join("canopy.db");
    expect_failure(
        &output,
        &[
            &format!("the SQLite database {} does not exist", database.display()),
            "--create",
        ],
    )?;
    ensure!(
        !database.exists(),
        "token list created {}",
        database.display()
    );

    // Asked for, both create it; then the plain commands work on it.
    expect_success(&run(&["migrate", "--create"], &typo)?)?;
    ensure!(typo.join("canopy.db").is_file());
    let fresh = root.path().join("fresh");
    let created = run(&["token", "create", "--role", "admin", "--create"], &fresh)?;
    expect_success(&created)?;
    ensure!(String::from_utf8_lossy(&created.stdout).contains("admin token: "));
    let listed = run(&["token", "list"], &fresh)?;
    expect_success(&listed)?;
    ensure!(String::from_utf8_lossy(&listed.stdout).contains("admin"));
    expect_success(&run(&["migrate"], &fresh)?)?;
    Ok(())
}

/// 1 KB of pseudo-random bytes as canopy.db: `migrate` and `serve` fail
/// at once naming the file, instead of retrying until a pool timeout.
#[test]
fn a_file_that_is_not_a_database_fails_at_once() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let database = dir.path().join("canopy.db");
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let garbage: Vec<u8> = (0..1024)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect();
    std::fs::write(&database, garbage)?;
    let expected = format!("{} is not a SQLite database", database.display());
    for args in [
        &["migrate"][..],
        &["token", "list"],
        &["serve", "--listen", "127.0.0.1:0"],
    ] {
        let started = Instant::now();
        let output = run(args, dir.path())?;
        let took = started.elapsed();
        expect_failure(&output, &[&expected, "hint:"]).with_context(|| format!("{args:?}"))?;
        ensure!(
            took < Duration::from_secs(3),
            "{args:?} took {took:?} to fail"
        );
    }
    Ok(())
}

fn page_size(database: &Path) -> Result<usize> {
    let header = std::fs::read(database)?;
    let size = u16::from_be_bytes([header[16], header[17]]);
    Ok(if size == 1 { 65_536 } else { size as usize })
}

/// A database that opens but whose pages are damaged fails `PRAGMA
/// quick_check`: the file and the first problems are named.
#[tokio::test]
async fn a_damaged_database_fails_its_integrity_check() -> Result<()> {
    let dir = tempfile::tempdir()?;
    expect_success(&run(&["migrate", "--create"], dir.path())?)?;
    let database = dir.path().join("canopy.db");
    checkpoint(&database).await?;
    let mut bytes = std::fs::read(&database)?;
    let page = page_size(&database)?;
    ensure!(bytes.len() >= 4 * page, "only {} bytes", bytes.len());
    // Page 3 onwards hold tables and indexes: scribble over one.
    for byte in &mut bytes[2 * page..3 * page] {
        *byte = 0xa5;
    }
    std::fs::write(&database, bytes)?;
    let started = Instant::now();
    let output = run(&["migrate"], dir.path())?;
    expect_failure(
        &output,
        &[
            &format!(
                "the SQLite database {} fails its integrity check",
                database.display()
            ),
            "hint:",
            ".recover",
        ],
    )?;
    ensure!(started.elapsed() < Duration::from_secs(5));
    Ok(())
}

const TRANSACTIONS: i64 = 5;

async fn open(database: &Path) -> Result<SqliteConnection> {
    let url = format!("sqlite://{}", database.display());
    Ok(SqliteConnectOptions::from_str(&url)?.connect().await?)
}

async fn rows(database: &Path) -> Result<i64> {
    let mut connection = open(database).await?;
    Ok(sqlx::query_scalar("SELECT COUNT(*) FROM wal_probe")
        .fetch_one(&mut connection)
        .await?)
}

/// Moves everything in the log into the database file, so that the test
/// damages the tables themselves.
async fn checkpoint(database: &Path) -> Result<()> {
    let mut connection = open(database).await?;
    sqlx::query("PRAGMA wal_checkpoint(TRUNCATE)")
        .execute(&mut connection)
        .await?;
    Ok(())
}

/// A database made by the server, then five transactions that stay in
/// the log (no checkpoint); the files are copied while the connection is
/// open, as a crash would leave them.
async fn database_with_a_live_log(root: &Path) -> Result<(PathBuf, Vec<u8>, Vec<u8>)> {
    let dir = root.join("live");
    expect_success(&run(&["migrate", "--create"], &dir)?)?;
    let database = dir.join("canopy.db");
    checkpoint(&database).await?;
    let mut connection = open(&database).await?;
    for statement in [
        "PRAGMA journal_mode = WAL",
        "PRAGMA wal_autocheckpoint = 0",
        "CREATE TABLE wal_probe (id INTEGER PRIMARY KEY, payload BLOB)",
    ] {
        sqlx::query(statement).execute(&mut connection).await?;
    }
    for id in 0..TRANSACTIONS {
        sqlx::query("INSERT INTO wal_probe (id, payload) VALUES ($1, zeroblob(6000))")
            .bind(id)
            .execute(&mut connection)
            .await?;
    }
    let db = std::fs::read(&database)?;
    let wal = std::fs::read(dir.join("canopy.db-wal"))?;
    drop(connection);
    Ok((database, db, wal))
}

fn place(root: &Path, name: &str, db: &[u8], wal: &[u8]) -> Result<PathBuf> {
    let dir = root.join(name);
    std::fs::create_dir(&dir)?;
    std::fs::write(dir.join("canopy.db"), db)?;
    std::fs::write(dir.join("canopy.db-wal"), wal)?;
    Ok(dir)
}

#[tokio::test]
async fn a_damaged_log_is_refused_and_a_torn_last_frame_is_not() -> Result<()> {
    let root = tempfile::tempdir()?;
    let (database, db, wal) = database_with_a_live_log(root.path()).await?;
    let page = page_size(&database)?;
    let frame = 24 + page;
    let frames = (wal.len() - 32) / frame;
    ensure!(frames >= 6, "only {frames} frames in the log");

    // Intact: every transaction is replayed.
    let intact = place(root.path(), "intact", &db, &wal)?;
    expect_success(&run(&["migrate"], &intact)?)?;
    ensure!(rows(&intact.join("canopy.db")).await? == TRANSACTIONS);

    // One bit flipped in frame 2's page: SQLite alone would open it on an
    // earlier state without a word, as shown on a spare copy ...
    let mut damaged_wal = wal.clone();
    damaged_wal[32 + frame + 24 + page / 2] ^= 0x01;
    let silent = place(root.path(), "silent", &db, &damaged_wal)?;
    let replayed = rows(&silent.join("canopy.db")).await.unwrap_or(0);
    ensure!(
        replayed < TRANSACTIONS,
        "SQLite replayed past the damage ({replayed} rows): the test proves nothing"
    );
    // ... and the server refuses it, naming the log and the frame.
    let damaged = place(root.path(), "damaged", &db, &damaged_wal)?;
    let log = damaged.join("canopy.db-wal");
    for args in [&["migrate"][..], &["serve", "--listen", "127.0.0.1:0"]] {
        let output = run(args, &damaged)?;
        expect_failure(
            &output,
            &[
                &format!(
                    "the write-ahead log {} is damaged at frame 2",
                    log.display()
                ),
                "committed transactions",
                "hint:",
                "keep a copy",
                "move",
            ],
        )
        .with_context(|| format!("{args:?}"))?;
    }
    ensure!(
        std::fs::read(&log)? == damaged_wal,
        "the refusal changed the log"
    );

    // A last frame cut short mid-write, as in a crash: a normal start on
    // every transaction but the torn one.
    let torn = place(root.path(), "torn", &db, &wal[..wal.len() - page / 2])?;
    expect_success(&run(&["migrate"], &torn)?)?;
    ensure!(rows(&torn.join("canopy.db")).await? == TRANSACTIONS - 1);
    Ok(())
}
