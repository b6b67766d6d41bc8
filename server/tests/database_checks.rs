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

use crate::support;

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

/// [`run`], killing a command still running after `limit` (a `serve`
/// that started instead of refusing) and failing with its output.
fn run_within(args: &[&str], data_dir: &Path, limit: Duration) -> Result<Output> {
    make_private(data_dir)?;
    let mut child = server_bin()
        .args(args)
        .arg("--data-dir")
        .arg(data_dir)
        .env_remove("CANOPY_DATABASE_URL")
        .env_remove("CANOPY_DATA_DIR")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    let started = Instant::now();
    while child.try_wait()?.is_none() {
        if started.elapsed() > limit {
            let _ = child.kill();
            let output = child.wait_with_output()?;
            anyhow::bail!(
                "{args:?} still running after {limit:?}:\n{}{}",
                String::from_utf8_lossy(&output.stdout),
                stderr(&output)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(child.wait_with_output()?)
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

/// Issue 36: a real server writes, is killed (so its log holds every
/// transaction since the last checkpoint), and one byte of the log's
/// header is flipped. SQLite alone ignores such a log whole and opens the
/// database empty, on which `serve` would start afresh (a new admin token,
/// a new model-signing key); the server refuses it like a damaged frame,
/// with the same hint, and the intact log still starts it as it was.
#[tokio::test]
async fn a_damaged_log_header_is_refused_not_started_afresh() -> Result<()> {
    // Checkpoints left to the commits that fill the log (1,000 pages, far
    // more than this test writes): a log the background checkpointer had
    // copied into the database could be lost whole without harm.
    let dir = support::private_tempdir()?;
    let config = support::limits_file(dir.path(), "sqlite_checkpoint_interval_ms = 0")?;
    let mut server =
        support::TestServer::start_with(support::Database::Sqlite, &["--config", &config])?;
    let admin = server.admin();
    admin
        .upload_model("kept", support::logreg_model_bytes(1))
        .await?;
    admin.enrollment_token(2).await?;
    let key = admin.ok("/device/v1/server-key").await?["server_public_key"].clone();
    server.kill9();
    let live = server.data_dir.path();
    let wal = std::fs::read(live.join("canopy.db-wal"))?;
    let page = page_size(&live.join("canopy.db"))?;
    ensure!(
        wal.len() >= 32 + 2 * (24 + page),
        "the log holds no frames ({} bytes): the test proves nothing",
        wal.len()
    );

    let root = tempfile::tempdir()?;
    for (at, fault) in [
        (1, "magic number"),
        (6, "format version"),
        (20, "checksum"),
        (29, "checksum"),
    ] {
        let dir = root.path().join(format!("byte-{at}"));
        std::fs::create_dir(&dir)?;
        for name in ["canopy.db", "canopy.db-shm"] {
            std::fs::copy(live.join(name), dir.join(name))?;
        }
        let mut damaged = wal.clone();
        damaged[at] ^= 0x04;
        let log = dir.join("canopy.db-wal");
        std::fs::write(&log, &damaged)?;
        if at == 20 {
            // On a spare copy, SQLite alone opens an empty database.
            let spare = root.path().join("spare");
            std::fs::create_dir(&spare)?;
            for name in ["canopy.db", "canopy.db-wal"] {
                std::fs::copy(dir.join(name), spare.join(name))?;
            }
            let mut connection = open(&spare.join("canopy.db")).await?;
            let tables: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM sqlite_master")
                .fetch_one(&mut connection)
                .await?;
            ensure!(
                tables == 0,
                "SQLite read {tables} tables past the damaged header: the test proves nothing"
            );
        }
        let started = Instant::now();
        let output = run_within(
            &["serve", "--listen", "127.0.0.1:0"],
            &dir,
            Duration::from_secs(20),
        )?;
        expect_failure(
            &output,
            &[
                &format!("the write-ahead log {} has a damaged header", log.display()),
                fault,
                "committed transactions",
                "hint:",
                &format!("keep a copy of {}", log.display()),
                &format!("move {} aside", log.display()),
            ],
        )
        .with_context(|| format!("byte {at}"))?;
        ensure!(
            !String::from_utf8_lossy(&output.stdout).contains("admin token"),
            "byte {at}: a first admin token was issued"
        );
        ensure!(
            std::fs::read(&log)? == damaged,
            "byte {at}: the refusal changed the log"
        );
        println!(
            "figures: header byte {at} refused in {:?}",
            started.elapsed()
        );
    }

    // The intact files start the same database: the same key, no new token.
    server.restart()?;
    let again = server.admin().ok("/device/v1/server-key").await?["server_public_key"].clone();
    ensure!(again == key, "the key changed from {key} to {again}");
    server.admin().ok("/api/v1/models/kept/versions").await?;
    Ok(())
}

/// Issue 36: a file with SQLite's header and garbage after it fails at
/// once, named as a damaged database with the restore hint (it used to
/// retry until the pool's 10 s acquire timeout and then suggest checking
/// that the database is running). Both a damaged header and a good header
/// followed by a damaged first page.
#[test]
fn a_good_header_before_garbage_fails_at_once() -> Result<()> {
    let root = tempfile::tempdir()?;
    let made = root.path().join("made");
    expect_success(&run(&["migrate", "--create"], &made)?)?;
    let header: Vec<u8> = std::fs::read(made.join("canopy.db"))?[..100].to_vec();
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let garbage: Vec<u8> = (0..16 * 4096)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect();
    for (name, prefix) in [("magic-only", &header[..16]), ("whole-header", &header[..])] {
        let dir = root.path().join(name);
        std::fs::create_dir(&dir)?;
        let database = dir.join("canopy.db");
        let mut bytes = prefix.to_vec();
        bytes.extend_from_slice(&garbage[prefix.len()..]);
        if name == "whole-header" {
            // Page 1's b-tree header says "table leaf", as a real one does.
            bytes[100] = 0x0d;
        }
        std::fs::write(&database, bytes)?;
        for args in [&["migrate"][..], &["serve", "--listen", "127.0.0.1:0"]] {
            let started = Instant::now();
            let output = run_within(args, &dir, Duration::from_secs(30))?;
            let took = started.elapsed();
            expect_failure(
                &output,
                &[&database.display().to_string(), "hint:", "restore"],
            )
            .with_context(|| format!("{name} {args:?}"))?;
            let text = stderr(&output);
            ensure!(
                !text.contains("that the database is running"),
                "{name} {args:?}: a misleading hint:\n{text}"
            );
            println!("figures: {name} {args:?} failed in {took:?}");
            ensure!(
                took < Duration::from_secs(3),
                "{name} {args:?} took {took:?} to fail"
            );
        }
    }
    Ok(())
}
