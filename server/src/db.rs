//! The database handle: one pool over SQLite or PostgreSQL, chosen by URL.
//!
//! Every query is written once, in the SQL both databases accept (`$N`
//! placeholders, `RETURNING`, partial indexes), and runs through sqlx's
//! `Any` driver. The two differences that matter are isolated here:
//! migrations (one set per database) and row locking (`FOR UPDATE SKIP
//! LOCKED` on PostgreSQL; on SQLite, which has one writer, a process-wide
//! writer lock).

/// The database's error, for crates that call the store without linking
/// sqlx themselves (the edge).
pub type SqlError = sqlx::Error;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use sqlx::any::{AnyConnectOptions, AnyPoolOptions};
use sqlx::{AnyPool, ConnectOptions, Connection, Executor};
use tokio::sync::{Mutex, MutexGuard, Semaphore, SemaphorePermit, oneshot};

use crate::config::{Limits, Settings};
use crate::server::{ServeError, open_database};
use crate::sqlite_files::{self, SqliteFileError};

/// Problems `PRAGMA quick_check` lists before it stops.
const INTEGRITY_PROBLEMS_SHOWN: u32 = 10;
/// Pages the log may hold before a commit checkpoints it itself
/// (`wal_autocheckpoint`) while the background checkpointer runs: only
/// when it has fallen far behind, so that the log stays bounded (40 MB of
/// 4 KB pages) even then. Without it, SQLite's default of 1,000.
pub const WAL_BACKSTOP_PAGES: u32 = 10_000;
/// SQLite's own `wal_autocheckpoint`.
const SQLITE_DEFAULT_AUTOCHECKPOINT_PAGES: u32 = 1_000;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("database URL `{url}` is not supported; use sqlite://PATH or postgres://…")]
    UnsupportedUrl { url: String },
    #[error("cannot connect to the database at {url}")]
    Connect {
        url: String,
        #[source]
        source: sqlx::Error,
    },
    #[error("cannot apply the database migrations")]
    Migrate(#[source] sqlx::migrate::MigrateError),
    #[error(transparent)]
    Files(#[from] SqliteFileError),
    #[error("the SQLite database {path} fails its integrity check: {}", problems.join("; "))]
    Integrity {
        path: PathBuf,
        problems: Vec<String>,
    },
    #[error("the data directory {path} does not exist")]
    MissingDirectory { path: PathBuf },
    #[error("the SQLite database {path} does not exist")]
    MissingDatabase { path: PathBuf },
    #[error(transparent)]
    Sql(#[from] sqlx::Error),
}

impl DbError {
    /// What the operator can do about it.
    pub fn hint(&self) -> Option<String> {
        match self {
            DbError::Files(error) => error.hint(),
            DbError::Integrity { path, .. } => Some(format!(
                "stop the server and restore {0} from a backup, or salvage what is readable with \
                 `sqlite3 {0} .recover | sqlite3 recovered.db` and point --database-url at the result",
                path.display()
            )),
            DbError::MissingDirectory { .. } | DbError::MissingDatabase { .. } => Some(
                "check --data-dir / --database-url; to start a new database there, run \
                 `canopy-server serve` once, or pass --create"
                    .to_string(),
            ),
            DbError::Connect { .. } => Some(
                "check --database-url (or CANOPY_DATABASE_URL) and that the database is running"
                    .to_string(),
            ),
            _ => None,
        }
    }
}

/// The file a `sqlite:` URL names; `None` for other databases and for
/// in-memory SQLite.
pub fn sqlite_path(url: &str) -> Option<PathBuf> {
    let rest = url
        .strip_prefix("sqlite://")
        .or_else(|| url.strip_prefix("sqlite:"))?;
    let path = rest.split_once('?').map_or(rest, |(path, _)| path);
    if path.is_empty() || path == ":memory:" {
        return None;
    }
    Some(PathBuf::from(path))
}

/// The settings for opening only a database that already exists: its
/// directory and (SQLite) file must be there, and SQLite is opened
/// `mode=rw` so that nothing can create it. PostgreSQL databases are not
/// created by the server anyway, and its data directory plays no part in
/// `token` and `migrate`.
pub fn existing_only(settings: &Settings) -> Result<Settings, DbError> {
    let Some(path) = sqlite_path(&settings.database_url) else {
        return Ok(settings.clone());
    };
    let directory = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    if !directory.is_dir() {
        return Err(DbError::MissingDirectory {
            path: directory.to_path_buf(),
        });
    }
    if !path.is_file() {
        return Err(DbError::MissingDatabase { path });
    }
    let mut settings = settings.clone();
    if let Some((base, query)) = settings.database_url.split_once('?') {
        let query = query.replace("mode=rwc", "mode=rw");
        settings.database_url = format!("{base}?{query}");
    }
    Ok(settings)
}

/// [`open_database`] for commands that manage an existing server's
/// database (`token`, `migrate`): a mistyped `--data-dir` is an error
/// naming the path, not a new empty database there.
pub async fn open_existing_database(settings: &Settings) -> Result<Db, ServeError> {
    open_database(&existing_only(settings)?).await
}

/// The pool plus what differs between the two databases.
#[derive(Clone)]
pub struct Db {
    pub pool: AnyPool,
    pub backend: Backend,
    writer: Arc<Mutex<()>>,
    round_writes: Arc<Semaphore>,
    /// A SQLite file's background checkpointer, which stops when the last
    /// handle is dropped.
    checkpointer: Option<Arc<Checkpointer>>,
}

/// Held for the length of a write transaction on SQLite; empty on PostgreSQL.
pub struct WriteGuard<'a>(#[allow(dead_code)] Option<MutexGuard<'a, ()>>);

impl Db {
    /// Opens the pool, sized and timed by `limits` (`database_*`,
    /// `round_write_connections`, `sqlite_busy_timeout_ms`), with a SQLite
    /// file's log checkpointed every `sqlite_checkpoint_interval_ms` (0:
    /// by the commits that fill it, SQLite's default).
    pub async fn connect(url: &str, limits: &Limits) -> Result<Db, DbError> {
        let interval = Duration::from_millis(limits.sqlite_checkpoint_interval_ms);
        Db::connect_checkpointing(url, limits, (!interval.is_zero()).then_some(interval)).await
    }

    /// [`Db::connect`], with a SQLite file's log checkpointed every
    /// `checkpoint_interval` in the background, or by commits when `None`.
    async fn connect_checkpointing(
        url: &str,
        limits: &Limits,
        checkpoint_interval: Option<Duration>,
    ) -> Result<Db, DbError> {
        sqlx::any::install_default_drivers();
        let backend = if url.starts_with("sqlite:") {
            Backend::Sqlite
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Backend::Postgres
        } else {
            return Err(DbError::UnsupportedUrl { url: redact(url) });
        };
        if let Some(path) = sqlite_path(url) {
            // Before SQLite touches the files: it would reject a non-database
            // only query by query, and replay a damaged log without a word.
            let checked = path.clone();
            tokio::task::spawn_blocking(move || sqlite_files::check_files(&checked))
                .await
                .map_err(|error| {
                    DbError::Files(SqliteFileError::Read {
                        path: path.clone(),
                        source: std::io::Error::other(error),
                    })
                })??;
        }
        let options: AnyConnectOptions = url.parse().map_err(|source| DbError::Connect {
            url: redact(url),
            source,
        })?;
        // ARCHITECTURE.md, "What a commit survives": in WAL mode,
        // `synchronous = NORMAL` fsyncs only when the log is checkpointed, and
        // a commit outlives a crash or a kill of the process; checkpoints
        // run in the background, so no request waits for the disk.
        let autocheckpoint_pages = match checkpoint_interval {
            Some(_) => WAL_BACKSTOP_PAGES,
            None => SQLITE_DEFAULT_AUTOCHECKPOINT_PAGES,
        };
        let pragmas = format!(
            "PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL; \
             PRAGMA wal_autocheckpoint = {autocheckpoint_pages}; \
             PRAGMA foreign_keys = ON; PRAGMA busy_timeout = {};",
            limits.sqlite_busy_timeout_ms
        );
        if let Some(path) = sqlite_path(url) {
            probe_sqlite(&options, &pragmas)
                .await
                .map_err(|source| match source {
                    sqlx::Error::Database(error)
                        if is_sqlite_corruption(error.code().as_deref()) =>
                    {
                        DbError::Integrity {
                            path,
                            problems: vec![error.message().to_string()],
                        }
                    }
                    source => DbError::Connect {
                        url: redact(url),
                        source,
                    },
                })?;
        }
        let pool_pragmas = pragmas.clone();
        let pool = AnyPoolOptions::new()
            .max_connections(limits.database_connections)
            .acquire_timeout(Duration::from_millis(limits.database_acquire_timeout_ms))
            .after_connect(move |conn, _meta| {
                let pragmas = pool_pragmas.clone();
                Box::pin(async move {
                    if backend == Backend::Sqlite {
                        conn.execute(sqlx::AssertSqlSafe(pragmas)).await?;
                    }
                    Ok(())
                })
            })
            .connect_with(options.clone())
            .await
            .map_err(|source| DbError::Connect {
                url: redact(url),
                source,
            })?;
        let mut db = Db {
            pool,
            backend,
            writer: Arc::new(Mutex::new(())),
            round_writes: Arc::new(Semaphore::new(limits.round_write_connections)),
            checkpointer: None,
        };
        if let Some(path) = sqlite_path(url) {
            db.check_integrity(&path).await?;
            if let Some(interval) = checkpoint_interval {
                let checkpointer = Checkpointer::start(&options, pragmas, interval)
                    .await
                    .map_err(|source| DbError::Connect {
                        url: redact(url),
                        source,
                    })?;
                db.checkpointer = Some(Arc::new(checkpointer));
            }
        }
        Ok(db)
    }

    /// Checkpoints of a SQLite file's log the background checkpointer has
    /// completed; 0 on PostgreSQL.
    pub fn checkpoints(&self) -> u64 {
        self.checkpointer.as_ref().map_or(0, |checkpointer| {
            checkpointer.completed.load(Ordering::Relaxed)
        })
    }

    /// `PRAGMA quick_check`: every page and index entry is well formed
    /// (it skips the index-to-table cross-check of `integrity_check`, so it
    /// runs in about one read of the file).
    async fn check_integrity(&self, path: &Path) -> Result<(), DbError> {
        let query = format!("PRAGMA quick_check({INTEGRITY_PROBLEMS_SHOWN})");
        let problems: Vec<String> =
            match sqlx::query_scalar::<_, String>(sqlx::AssertSqlSafe(query))
                .fetch_all(&self.pool)
                .await
            {
                Ok(rows) => rows,
                // A page too damaged to walk fails the pragma itself.
                Err(sqlx::Error::Database(error))
                    if is_sqlite_corruption(error.code().as_deref()) =>
                {
                    vec![error.message().to_string()]
                }
                Err(error) => return Err(error.into()),
            };
        if problems.len() == 1 && problems[0] == "ok" {
            return Ok(());
        }
        Err(DbError::Integrity {
            path: path.to_path_buf(),
            problems,
        })
    }

    pub async fn migrate(&self) -> Result<(), DbError> {
        let migrator = match self.backend {
            Backend::Sqlite => &*crate::migrations::SQLITE,
            Backend::Postgres => &*crate::migrations::POSTGRES,
        };
        migrator.run(&self.pool).await.map_err(DbError::Migrate)
    }

    /// Serialises this process's writers on SQLite, so that a transaction
    /// that reads before it writes never meets SQLITE_BUSY on upgrade.
    pub async fn write_lock(&self) -> WriteGuard<'_> {
        match self.backend {
            Backend::Sqlite => WriteGuard(Some(self.writer.lock().await)),
            Backend::Postgres => WriteGuard(None),
        }
    }

    /// Taken before a write to a round's row, so that writers queueing for
    /// the row lock wait here, holding no pooled connection (see
    /// `limits.round_write_connections`).
    pub async fn round_write_slot(&self) -> Option<SemaphorePermit<'_>> {
        self.round_writes.acquire().await.ok()
    }

    /// One round trip, for readiness checks.
    pub async fn ping(&self) -> Result<(), sqlx::Error> {
        sqlx::query("SELECT 1")
            .execute(&self.pool)
            .await
            .map(|_| ())
    }

    /// `FOR UPDATE SKIP LOCKED` where the database has row locks.
    pub fn skip_locked(&self) -> &'static str {
        match self.backend {
            Backend::Sqlite => "",
            Backend::Postgres => " FOR UPDATE SKIP LOCKED",
        }
    }

    /// `FOR UPDATE` where the database has row locks.
    pub fn for_update(&self) -> &'static str {
        match self.backend {
            Backend::Sqlite => "",
            Backend::Postgres => " FOR UPDATE",
        }
    }
}

/// Copies a SQLite file's write-ahead log into the database in the
/// background, on its own connection, every
/// `limits.sqlite_checkpoint_interval_ms`.
///
/// *Why:* with SQLite's default, the commit that takes the log past 1,000
/// pages runs the checkpoint itself: it writes the pages back and fsyncs
/// the log and the database, two flushes that take seconds on a busy
/// disk, while that request (an upload's fold, a round's new version)
/// holds the process's writer lock and every other writer waits. Here a
/// checkpoint is `PASSIVE`: it waits for no reader or writer and blocks
/// none, and copies only what every reader is done with. A commit still
/// checkpoints itself past [`WAL_BACKSTOP_PAGES`], should this fall far
/// behind.
struct Checkpointer {
    completed: Arc<AtomicU64>,
    /// Dropped with the last [`Db`] handle, which ends the task.
    _stop: oneshot::Sender<()>,
}

impl Checkpointer {
    async fn start(
        options: &AnyConnectOptions,
        pragmas: String,
        interval: Duration,
    ) -> Result<Checkpointer, sqlx::Error> {
        let mut conn = options.connect().await?;
        conn.execute(sqlx::AssertSqlSafe(pragmas)).await?;
        let completed = Arc::new(AtomicU64::new(0));
        let (stop, mut stopped) = oneshot::channel::<()>();
        let counter = completed.clone();
        tokio::spawn(async move {
            let mut ticks = tokio::time::interval(interval);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut failing = false;
            loop {
                tokio::select! {
                    _ = ticks.tick() => {}
                    _ = &mut stopped => break,
                }
                let started = std::time::Instant::now();
                match sqlx::query_as::<_, (i64, i64, i64)>("PRAGMA wal_checkpoint(PASSIVE)")
                    .fetch_one(&mut conn)
                    .await
                {
                    Ok((_busy, log_pages, copied_pages)) => {
                        failing = false;
                        counter.fetch_add(1, Ordering::Relaxed);
                        tracing::trace!(
                            log_pages,
                            copied_pages,
                            elapsed_ms = started.elapsed().as_millis() as u64,
                            "checkpointed the SQLite log"
                        );
                    }
                    // Once per spell of failures, not every second.
                    Err(error) if !failing => {
                        failing = true;
                        tracing::warn!(
                            error = %canopy_term::error_chain(&error),
                            "cannot checkpoint the SQLite log; commits checkpoint it themselves past {WAL_BACKSTOP_PAGES} pages"
                        );
                    }
                    Err(_) => {}
                }
            }
            let _ = conn.close().await;
        });
        Ok(Checkpointer {
            completed,
            _stop: stop,
        })
    }
}

/// Opens one connection and sets the pragmas every pooled connection
/// sets, before the pool exists: the pool retries a connection whose setup
/// fails until its acquire timeout (10 s by default) and then reports a
/// timeout, whereas a damaged file fails the same way every time and is
/// named here at once.
async fn probe_sqlite(options: &AnyConnectOptions, pragmas: &str) -> Result<(), sqlx::Error> {
    let mut conn = options.connect().await?;
    let set = conn.execute(sqlx::AssertSqlSafe(pragmas.to_string())).await;
    let _ = conn.close().await;
    set.map(|_| ())
}

/// SQLITE_CORRUPT (11) or SQLITE_NOTADB (26), in any extended form (the
/// low byte is the primary code); "database is locked" and the like are
/// not the file's fault.
fn is_sqlite_corruption(code: Option<&str>) -> bool {
    code.and_then(|code| code.parse::<u32>().ok())
        .is_some_and(|code| matches!(code & 0xff, 11 | 26))
}

/// The URL with any password replaced, for messages and logs.
pub fn redact(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut parsed) if parsed.password().is_some() => {
            let _ = parsed.set_password(Some("***"));
            parsed.to_string()
        }
        _ => url.to_string(),
    }
}

/// True when the error is a unique-constraint violation (a duplicate).
pub fn is_unique_violation(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Database(db) => db.is_unique_violation(),
        _ => false,
    }
}

pub fn now_ms() -> i64 {
    let since_epoch = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    i64::try_from(since_epoch.as_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlite_paths_come_from_the_url() {
        assert_eq!(
            sqlite_path("sqlite:///srv/canopy/canopy.db?mode=rwc"),
            Some(PathBuf::from("/srv/canopy/canopy.db"))
        );
        assert_eq!(
            sqlite_path("sqlite:data/canopy.db"),
            Some(PathBuf::from("data/canopy.db"))
        );
        assert_eq!(sqlite_path("sqlite::memory:"), None);
        assert_eq!(sqlite_path("postgres://u@h/db"), None);
    }

    /// Writes `count` transactions of 100 pages each into a scratch table.
    async fn write_pages(db: &Db, count: usize) {
        sqlx::query("CREATE TABLE IF NOT EXISTS scratch (body BLOB NOT NULL)")
            .execute(&db.pool)
            .await
            .expect("create");
        for _ in 0..count {
            sqlx::query("INSERT INTO scratch (body) VALUES ($1)")
                .bind(vec![7u8; 100 * 4096])
                .execute(&db.pool)
                .await
                .expect("insert");
        }
    }

    fn file_len(path: &Path) -> u64 {
        std::fs::metadata(path).map_or(0, |meta| meta.len())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn commits_leave_the_log_to_the_background_checkpointer() {
        let dir = tempfile::tempdir().expect("tempdir");
        let limits = Limits::default();
        // A checkpointer that does not come round again: no commit copies
        // the log back, so it grows past SQLite's own 1,000 pages.
        let path = dir.path().join("quiet.db");
        let url = crate::config::sqlite_url(&path);
        let db = Db::connect_checkpointing(&url, &limits, Some(Duration::from_secs(3600)))
            .await
            .expect("open");
        write_pages(&db, 30).await;
        let log = file_len(&dir.path().join("quiet.db-wal"));
        assert!(log > 2_000 * 4096, "the log holds {log} bytes");
        assert!(file_len(&path) < 1_000 * 4096, "{}", file_len(&path));
        // One that comes round every 20 ms copies it back by itself.
        let path = dir.path().join("busy.db");
        let url = crate::config::sqlite_url(&path);
        let db = Db::connect_checkpointing(&url, &limits, Some(Duration::from_millis(20)))
            .await
            .expect("open");
        write_pages(&db, 30).await;
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while file_len(&path) < 3_000 * 4096 {
            assert!(
                std::time::Instant::now() < deadline,
                "the database holds {} bytes after {} checkpoints",
                file_len(&path),
                db.checkpoints()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(db.checkpoints() > 0);
        // None (`sqlite_checkpoint_interval_ms = 0`): the commit that takes
        // the log past SQLite's 1,000 pages copies it back itself.
        let path = dir.path().join("plain.db");
        let url = crate::config::sqlite_url(&path);
        let db = Db::connect_checkpointing(&url, &limits, None)
            .await
            .expect("open");
        write_pages(&db, 30).await;
        let log = file_len(&dir.path().join("plain.db-wal"));
        assert!(log < 1_200 * 4096, "the log holds {log} bytes");
        assert!(file_len(&path) > 2_000 * 4096, "{}", file_len(&path));
        assert_eq!(db.checkpoints(), 0);
    }

    #[test]
    fn only_corruption_codes_count_as_a_damaged_file() {
        assert!(is_sqlite_corruption(Some("11")));
        assert!(is_sqlite_corruption(Some("779"))); // SQLITE_CORRUPT_INDEX
        assert!(is_sqlite_corruption(Some("26")));
        assert!(!is_sqlite_corruption(Some("5"))); // SQLITE_BUSY
        assert!(!is_sqlite_corruption(Some("517"))); // SQLITE_BUSY_SNAPSHOT
        assert!(!is_sqlite_corruption(None));
    }

    #[test]
    fn existing_only_opens_sqlite_without_create() {
        let dir = tempfile::tempdir().expect("tempdir");
        let database = dir.path().join("canopy.db");
        let mut settings = Settings::resolve(&crate::config::ServeArgs {
            data_dir: Some(dir.path().to_path_buf()),
            ..Default::default()
        })
        .expect("settings");
        assert!(matches!(
            existing_only(&settings),
            Err(DbError::MissingDatabase { path }) if path == database
        ));
        std::fs::write(&database, b"").expect("touch");
        let opened = existing_only(&settings).expect("exists");
        assert!(
            opened.database_url.ends_with("?mode=rw"),
            "{}",
            opened.database_url
        );
        settings.data_dir = dir.path().join("typo");
        settings.database_url = crate::config::sqlite_url(&settings.data_dir.join("canopy.db"));
        assert!(matches!(
            existing_only(&settings),
            Err(DbError::MissingDirectory { .. })
        ));
    }
}
