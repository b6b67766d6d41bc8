//! `canopy-server serve`: wires the pieces together and runs until SIGTERM.

use std::io::Write;
use std::net::SocketAddr;
use std::time::Duration;

use canopy_protocol::model_sig::SigningKeys;
use tokio::sync::watch;

use crate::api;
use crate::blobs::{BlobError, BlobStore};
use crate::bootstrap;
use crate::config::{Settings, TlsSetting};
use crate::conn;
use crate::db::{Db, DbError};
use crate::orchestrator;
use crate::signing::{self, SigningRing};
use crate::state::AppState;
use crate::store::{settings, signing_keys};
use crate::tls::{self, TlsError};

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot create the data directory {path}")]
    DataDir {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{what} {path} can be read by other users (mode {mode:04o}); it holds the database \
         with the model-signing key"
    )]
    OpenToOthers {
        what: &'static str,
        path: std::path::PathBuf,
        mode: u32,
    },
    #[error("cannot set up {path}")]
    File {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Db(#[from] DbError),
    #[error(transparent)]
    Blob(#[from] BlobError),
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error("cannot read the server's keys from the database")]
    Keys(#[source] sqlx::Error),
    #[error("cannot load the model-signing keys from the database")]
    SigningKeys(#[source] signing_keys::SigningKeyError),
    #[error(transparent)]
    Bootstrap(#[from] bootstrap::BootstrapError),
    #[error("cannot serve on {listen}")]
    Bind {
        listen: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

impl ServeError {
    /// What the operator can do about it, for the `hint:` line.
    pub fn hint(&self) -> Option<String> {
        match self {
            ServeError::OpenToOthers { what, path, .. } => Some(format!(
                "run `chmod {} {}` (and check who else could have read it)",
                if *what == "data directory" {
                    "700"
                } else {
                    "600"
                },
                path.display()
            )),
            ServeError::Bind { .. } => Some(
                "another process is listening there; stop it or pick another --listen address"
                    .to_string(),
            ),
            ServeError::Bootstrap(error) => error.hint(),
            ServeError::Tls(error) => error.hint(),
            _ => None,
        }
    }
}

/// Opens the database named by the settings and applies migrations. A
/// SQLite file is created 0600 in a data directory created 0700; an
/// existing one open to other users is refused.
pub async fn open_database(settings: &Settings) -> Result<Db, ServeError> {
    if let Some(path) = private_files::sqlite_path(&settings.database_url) {
        if path.parent() == Some(settings.data_dir.as_path()) {
            private_files::prepare_dir(&settings.data_dir)?;
        }
        private_files::prepare_file(&path)?;
    }
    let db = Db::connect(&settings.database_url, &settings.limits).await?;
    db.migrate().await?;
    Ok(db)
}

/// Modes of the files that hold secrets: the data directory 0700, the
/// SQLite database 0600 (SQLite gives its `-wal` and `-shm` files the
/// database's mode). *Why refuse rather than fix:* a directory that was
/// readable may already have been read; the operator should know.
mod private_files {
    use std::path::{Path, PathBuf};
    use std::str::FromStr;

    use super::ServeError;

    pub fn sqlite_path(database_url: &str) -> Option<PathBuf> {
        if !database_url.starts_with("sqlite:") {
            return None;
        }
        let options = sqlx::sqlite::SqliteConnectOptions::from_str(database_url).ok()?;
        let path = options.get_filename();
        (!path.as_os_str().is_empty() && path != Path::new(":memory:")).then(|| path.to_path_buf())
    }

    pub fn prepare_dir(dir: &Path) -> Result<(), ServeError> {
        match std::fs::metadata(dir) {
            Ok(meta) => check_private(dir, &meta, "data directory"),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => create_dir(dir),
            Err(source) => Err(ServeError::DataDir {
                path: dir.to_path_buf(),
                source,
            }),
        }
    }

    pub fn prepare_file(path: &Path) -> Result<(), ServeError> {
        match std::fs::metadata(path) {
            Ok(meta) => check_private(path, &meta, "database file"),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => create_file(path),
            Err(source) => Err(ServeError::File {
                path: path.to_path_buf(),
                source,
            }),
        }
    }

    fn check_private(
        path: &Path,
        meta: &std::fs::Metadata,
        what: &'static str,
    ) -> Result<(), ServeError> {
        match crate::file_modes::open_to_others(meta) {
            Some(mode) => Err(ServeError::OpenToOthers {
                what,
                path: path.to_path_buf(),
                mode,
            }),
            None => Ok(()),
        }
    }

    fn create_dir(dir: &Path) -> Result<(), ServeError> {
        crate::file_modes::create_private_dir_all(dir).map_err(|source| ServeError::DataDir {
            path: dir.to_path_buf(),
            source,
        })
    }

    /// An empty file is a valid new SQLite database; creating it here is
    /// what lets us choose its mode.
    fn create_file(path: &Path) -> Result<(), ServeError> {
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            options.mode(crate::file_modes::PRIVATE_FILE_MODE);
        }
        match options.open(path) {
            Ok(_) => Ok(()),
            // Another process created it first: fine, check it instead.
            Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => prepare_file(path),
            Err(source) => Err(ServeError::File {
                path: path.to_path_buf(),
                source,
            }),
        }
    }
}

/// Lines other programs read from stdout (tests, the demo, operators'
/// scripts); logs go to stderr. A closed stdout is reported, not a panic.
fn announce(line: &str) -> std::io::Result<()> {
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{line}")?;
    stdout.flush()
}

/// A server started in this process.
pub struct Running {
    pub addr: SocketAddr,
    /// `https` or `http`.
    pub scheme: &'static str,
    /// The first admin token, on the very first start only.
    pub admin_token: Option<String>,
    /// `sha256:HEX` of the development certificate, with `--tls self-signed`.
    pub fingerprint: Option<String>,
    handle: axum_server::Handle<SocketAddr>,
    state: AppState,
    stop: watch::Sender<bool>,
    grace: Duration,
    served: tokio::task::JoinHandle<Result<(), ServeError>>,
    orchestrator: tokio::task::JoinHandle<()>,
    central_evaluation: tokio::task::JoinHandle<()>,
}

impl Running {
    /// The server's state: its database, blob store and signing ring, for
    /// a program that embeds the server (an edge aggregator).
    pub fn state(&self) -> &AppState {
        &self.state
    }

    pub fn base_url(&self) -> String {
        format!("{}://{}", self.scheme, self.addr)
    }

    /// Stops as on SIGTERM: not ready, no new work, in-flight requests get
    /// the grace period; returns when everything has stopped.
    pub async fn shutdown(self) -> Result<(), ServeError> {
        begin_shutdown(&self.handle, &self.state, &self.stop, self.grace);
        self.wait().await
    }

    /// Waits until the server stops (after a signal or a failure).
    pub async fn wait(self) -> Result<(), ServeError> {
        let served = self.served.await.unwrap_or(Ok(()));
        let _ = self.stop.send(true);
        let _ = self.orchestrator.await;
        let _ = self.central_evaluation.await;
        tracing::info!("server stopped");
        served
    }
}

/// Binds, opens everything, and starts serving and orchestrating in the
/// background; returns once the listener is bound.
///
/// The order is the contract: the port is bound before anything else, so a
/// busy port fails in milliseconds and before the database is touched (a
/// second server on the same SQLite file used to wait on its lock instead);
/// the first admin token is created last, when nothing can fail between its
/// creation and [`serve`] printing it.
pub async fn start(settings: Settings) -> Result<Running, ServeError> {
    start_signing(settings, None).await
}

/// [`start`] for an edge aggregator: the server hands its devices the
/// cloud's model signatures and key chain (`chain`, kept current by the
/// edge with [`SigningRing::set_relayed_chain`]), and signs only versions
/// of its own, with `own_key` as the cloud's delegation lets it.
pub async fn start_relay(
    settings: Settings,
    chain: SigningKeys,
    own_key: canopy_protocol::model_sig::ServerKey,
) -> Result<Running, ServeError> {
    start_signing(settings, Some((chain, own_key))).await
}

async fn start_signing(
    settings: Settings,
    relayed_chain: Option<(SigningKeys, canopy_protocol::model_sig::ServerKey)>,
) -> Result<Running, ServeError> {
    tls::install_crypto_provider();
    let listen = settings.listen;
    let listener = bind(listen)?;
    if let TlsSetting::Files { key, .. } = &settings.tls {
        tls::check_key_private(key)?;
    }
    private_files::prepare_dir(&settings.data_dir)?;
    remove_stale_staging(&settings.data_dir.join("staging"));
    raise_file_limit(&settings.limits);
    let db = open_database(&settings).await?;
    let blobs = BlobStore::open(&settings.blob_store)?;
    bootstrap::prepare(&db, &settings.data_dir, &settings.database_url).await?;
    let ring = signing_keys::load_ring(&db)
        .await
        .map_err(ServeError::SigningKeys)?;
    let tls_setting = settings.tls.clone();
    let data_dir = settings.data_dir.clone();
    let grace = Duration::from_millis(settings.limits.shutdown_grace_ms);
    let signing = match relayed_chain {
        Some((chain, own_key)) => SigningRing::relaying(ring, chain, own_key),
        None => SigningRing::new(ring),
    };
    let state = AppState::new(db, blobs, signing, settings);
    let limits = state.settings.limits.clone();
    let app = api::app(state.clone()).into_make_service_with_connect_info::<SocketAddr>();
    let gate = conn::ConnectionGate::new(&limits, state.metrics.clone());
    let first_byte = Duration::from_millis(limits.header_read_timeout_ms);
    let handle = axum_server::Handle::new();
    let (scheme, fingerprint, served) = match tls_setting {
        TlsSetting::None { insecure } => {
            if insecure {
                tracing::warn!(%listen, "serving plain HTTP on a non-loopback address (--insecure-http); tokens and updates cross the network unencrypted");
            }
            let mut server = axum_server::from_tcp(listener)
                .map_err(|source| ServeError::Bind { listen, source })?
                .acceptor(conn::FirstByteDeadline::new(gate, first_byte))
                .handle(handle.clone());
            conn::configure_http(server.http_builder(), &limits);
            let served = tokio::spawn(async move {
                server
                    .serve(app)
                    .await
                    .map_err(|source| ServeError::Bind { listen, source })
            });
            ("http", None, served)
        }
        tls_setting => {
            let (cert, key, fingerprint) = match tls_setting {
                TlsSetting::Files { cert, key } => (cert, key, None),
                _ => {
                    let extra = (!listen.ip().is_unspecified()).then(|| listen.ip().to_string());
                    let (cert, key) = tls::self_signed(&data_dir, extra)?;
                    let fingerprint = tls::fingerprint(&cert)?;
                    (cert, key, Some(fingerprint))
                }
            };
            let config = axum_server::tls_rustls::RustlsConfig::from_pem_file(&cert, &key)
                .await
                .map_err(|source| TlsError::Load {
                    cert: cert.clone(),
                    key: key.clone(),
                    source,
                })?;
            let tls = axum_server::tls_rustls::RustlsAcceptor::new(config)
                .handshake_timeout(Duration::from_millis(limits.tls_handshake_timeout_ms))
                .acceptor(gate);
            let mut server = axum_server::from_tcp(listener)
                .map_err(|source| ServeError::Bind { listen, source })?
                .acceptor(conn::FirstByteDeadline::new(tls, first_byte))
                .handle(handle.clone());
            conn::configure_http(server.http_builder(), &limits);
            let served = tokio::spawn(async move {
                server
                    .serve(app)
                    .await
                    .map_err(|source| ServeError::Bind { listen, source })
            });
            ("https", fingerprint, served)
        }
    };
    let (stop, stop_rx) = watch::channel(false);
    let Some(addr) = handle.listening().await else {
        let _ = stop.send(true);
        return Err(served
            .await
            .unwrap_or(Ok(()))
            .err()
            .unwrap_or(ServeError::Bind {
                listen,
                source: std::io::Error::other("the listener stopped before it was bound"),
            }));
    };
    tokio::spawn(signing::reload_periodically(state.clone(), stop_rx.clone()));
    let central_evaluation = tokio::spawn(crate::central::run(state.clone(), stop_rx.clone()));
    let orchestrator = tokio::spawn(orchestrator::run(state.clone(), stop_rx));
    let admin_token = settings::bootstrap_admin_token(&state.db)
        .await
        .map_err(ServeError::Keys)?;
    bootstrap::record(&state.settings.data_dir, &state.settings.database_url)?;
    tracing::info!(%addr, "serving");
    Ok(Running {
        addr,
        scheme,
        admin_token,
        fingerprint,
        handle,
        state,
        stop,
        grace,
        served,
        orchestrator,
        central_evaluation,
    })
}

/// Binds the listening socket; a busy or forbidden address fails here, at
/// once, with the operating system's reason.
fn bind(listen: SocketAddr) -> Result<std::net::TcpListener, ServeError> {
    let listener = std::net::TcpListener::bind(listen)
        .map_err(|source| ServeError::Bind { listen, source })?;
    listener
        .set_nonblocking(true)
        .map_err(|source| ServeError::Bind { listen, source })?;
    Ok(listener)
}

/// Staged model uploads are removed when their request ends; a crash leaves
/// them behind. Files a day old belong to no upload still running.
fn remove_stale_staging(dir: &std::path::Path) {
    const STALE: Duration = Duration::from_secs(24 * 3600);
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let stale = entry
            .metadata()
            .and_then(|meta| meta.modified())
            .is_ok_and(|modified| modified.elapsed().unwrap_or_default() > STALE);
        if stale && std::fs::remove_file(entry.path()).is_ok() {
            tracing::info!(path = %entry.path().display(), "removed a stale staged model upload");
        }
    }
}

/// File descriptors the server needs besides client connections: the
/// database pool, blob files, the listener, logs.
const RESERVED_FILES: u64 = 256;

/// Raises the soft limit on open files to the hard limit, as a server that
/// holds one descriptor per connection must, and says so when the hard
/// limit is still below `max_connections`.
fn raise_file_limit(limits: &crate::config::Limits) {
    #[cfg(unix)]
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(files) if files < limits.max_connections as u64 + RESERVED_FILES => {
            tracing::warn!(
                open_files = files,
                max_connections = limits.max_connections,
                "the process may open fewer files than limits.max_connections needs; \
                 connections past about {} will fail to be accepted (raise LimitNOFILE or ulimit -n)",
                files.saturating_sub(RESERVED_FILES)
            );
        }
        Ok(_) => {}
        Err(error) => tracing::warn!(%error, "cannot raise the open-file limit"),
    }
}

/// `canopy-server serve`: starts, prints the lines tools read, and runs
/// until SIGTERM or Ctrl-C.
pub async fn serve(settings: Settings) -> Result<(), ServeError> {
    let data_dir = settings.data_dir.clone();
    let running = start(settings).await?;
    serve_started(running, &data_dir).await
}

/// [`serve`] for a server already started ([`start`], [`start_relay`]):
/// prints the lines tools read and runs until SIGTERM or Ctrl-C.
pub async fn serve_started(running: Running, data_dir: &std::path::Path) -> Result<(), ServeError> {
    announce_admin_token(&running, data_dir).await;
    for line in running
        .fingerprint
        .iter()
        .map(|fingerprint| format!("tls fingerprint: {fingerprint}"))
        .chain([format!("listening on {}", running.base_url())])
    {
        if let Err(error) = announce(&line) {
            tracing::warn!(%error, line = %line, "cannot print to stdout");
        }
    }
    let (handle, state, stop, grace) = (
        running.handle.clone(),
        running.state.clone(),
        running.stop.clone(),
        running.grace,
    );
    tokio::spawn(async move {
        wait_for_signal().await;
        begin_shutdown(&handle, &state, &stop, grace);
    });
    running.wait().await
}

/// Prints the first admin token, and records that it was shown only once
/// the line is out. A token that could not be shown (stdout closed, or a
/// crash between creating and printing it on an earlier start) can never be
/// used, since only its hash is kept: the operator is told how to make one.
async fn announce_admin_token(running: &Running, data_dir: &std::path::Path) {
    let how = format!(
        "create one with `canopy-server token create --role admin --data-dir {}` \
         (with the same --database-url, if you use one)",
        data_dir.display()
    );
    let db = &running.state.db;
    match &running.admin_token {
        Some(secret) => match announce(&format!("admin token: {secret}")) {
            Ok(()) => {
                tracing::warn!(
                    "issued the first admin token; it was printed once and only its hash is kept"
                );
                if let Err(error) = settings::mark_admin_token_shown(db).await {
                    tracing::warn!(%error, "cannot record that the first admin token was shown");
                }
            }
            Err(error) => {
                tracing::error!(%error, "the first admin token could not be printed; {how}");
            }
        },
        None => match settings::admin_token_unshown(db).await {
            Ok(true) => tracing::warn!(
                "the first admin token was issued by an earlier start but never shown; {how}"
            ),
            Ok(false) => {}
            Err(error) => tracing::warn!(%error, "cannot read the admin token's bootstrap state"),
        },
    }
}

/// Reports not-ready, stops the orchestrator and the long polls, stops
/// accepting connections, and gives in-flight requests (uploads included)
/// the grace period to finish.
fn begin_shutdown(
    handle: &axum_server::Handle<SocketAddr>,
    state: &AppState,
    stop: &watch::Sender<bool>,
    grace: Duration,
) {
    tracing::info!(
        grace_ms = grace.as_millis() as u64,
        "shutting down: finishing in-flight requests"
    );
    state
        .shutting_down
        .store(true, std::sync::atomic::Ordering::Relaxed);
    state.tasks_ready.notify_waiters();
    let _ = stop.send(true);
    handle.graceful_shutdown(Some(grace));
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut terminate) => {
                tokio::select! {
                    _ = terminate.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
