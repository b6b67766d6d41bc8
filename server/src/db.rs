//! The database handle: one pool over SQLite or PostgreSQL, chosen by URL.
//!
//! Every query is written once, in the SQL both databases accept (`$N`
//! placeholders, `RETURNING`, partial indexes), and runs through sqlx's
//! `Any` driver. The two differences that matter are isolated here:
//! migrations (one set per database) and row locking (`FOR UPDATE SKIP
//! LOCKED` on PostgreSQL; on SQLite, which has one writer, a process-wide
//! writer lock).

use std::sync::Arc;
use std::time::Duration;

use sqlx::any::{AnyConnectOptions, AnyPoolOptions};
use sqlx::{AnyPool, Executor};
use tokio::sync::{Mutex, MutexGuard, Semaphore, SemaphorePermit};

/// Connections in the pool; SQLite readers share the one file.
const MAX_CONNECTIONS: u32 = 16;
const ACQUIRE_TIMEOUT_MS: u64 = 10_000;
/// Pooled connections that writes to a round's row (folding an update,
/// counting download bytes) may hold at once. On PostgreSQL such a write
/// waits for the round's row lock, which every upload to that round holds
/// while it folds; without this bound, a burst of uploads and downloads for
/// one round parks every pooled connection on that lock and starves all
/// other requests (polls, signature nonces) towards the acquire timeout.
const ROUND_WRITE_CONNECTIONS: usize = 4;
/// How long SQLite waits for another process's write lock (the `token`
/// subcommand while `serve` runs) before it reports "database is locked".
const SQLITE_BUSY_TIMEOUT_MS: u64 = 10_000;

static SQLITE_MIGRATIONS: sqlx::migrate::Migrator = sqlx::migrate!("../migrations/sqlite");
static POSTGRES_MIGRATIONS: sqlx::migrate::Migrator = sqlx::migrate!("../migrations/postgres");

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
    Sql(#[from] sqlx::Error),
}

/// The pool plus what differs between the two databases.
#[derive(Clone)]
pub struct Db {
    pub pool: AnyPool,
    pub backend: Backend,
    writer: Arc<Mutex<()>>,
    round_writes: Arc<Semaphore>,
}

/// Held for the length of a write transaction on SQLite; empty on PostgreSQL.
pub struct WriteGuard<'a>(#[allow(dead_code)] Option<MutexGuard<'a, ()>>);

impl Db {
    pub async fn connect(url: &str) -> Result<Db, DbError> {
        sqlx::any::install_default_drivers();
        let backend = if url.starts_with("sqlite:") {
            Backend::Sqlite
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Backend::Postgres
        } else {
            return Err(DbError::UnsupportedUrl { url: redact(url) });
        };
        let options: AnyConnectOptions = url.parse().map_err(|source| DbError::Connect {
            url: redact(url),
            source,
        })?;
        let pool = AnyPoolOptions::new()
            .max_connections(MAX_CONNECTIONS)
            .acquire_timeout(Duration::from_millis(ACQUIRE_TIMEOUT_MS))
            .after_connect(move |conn, _meta| {
                Box::pin(async move {
                    if backend == Backend::Sqlite {
                        let pragmas = format!(
                            "PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL; \
                             PRAGMA foreign_keys = ON; PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS};"
                        );
                        conn.execute(sqlx::AssertSqlSafe(pragmas)).await?;
                    }
                    Ok(())
                })
            })
            .connect_with(options)
            .await
            .map_err(|source| DbError::Connect {
                url: redact(url),
                source,
            })?;
        Ok(Db {
            pool,
            backend,
            writer: Arc::new(Mutex::new(())),
            round_writes: Arc::new(Semaphore::new(ROUND_WRITE_CONNECTIONS)),
        })
    }

    pub async fn migrate(&self) -> Result<(), DbError> {
        let migrator = match self.backend {
            Backend::Sqlite => &SQLITE_MIGRATIONS,
            Backend::Postgres => &POSTGRES_MIGRATIONS,
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
    /// [`ROUND_WRITE_CONNECTIONS`]).
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
