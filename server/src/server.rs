//! `canopy-server serve`: wires the pieces together and runs until SIGTERM.

use std::io::Write;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::sync::watch;

use crate::api;
use crate::blobs::{BlobError, BlobStore};
use crate::config::{Settings, TlsSetting};
use crate::db::{Db, DbError};
use crate::orchestrator;
use crate::state::AppState;
use crate::store::settings;
use crate::tls::{self, TlsError};

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot create the data directory {path}")]
    DataDir {
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
    #[error("cannot serve on {listen}")]
    Bind {
        listen: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// Opens the database named by the settings and applies migrations.
pub async fn open_database(settings: &Settings) -> Result<Db, ServeError> {
    if settings.database_url.starts_with("sqlite:") {
        std::fs::create_dir_all(&settings.data_dir).map_err(|source| ServeError::DataDir {
            path: settings.data_dir.clone(),
            source,
        })?;
    }
    let db = Db::connect(&settings.database_url).await?;
    db.migrate().await?;
    Ok(db)
}

/// Lines other programs read from stdout (tests, the demo, operators'
/// scripts); logs go to stderr.
fn announce(line: &str) {
    let mut stdout = std::io::stdout().lock();
    let _ = writeln!(stdout, "{line}");
    let _ = stdout.flush();
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
}

impl Running {
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
        tracing::info!("server stopped");
        served
    }
}

/// Opens everything, binds, and starts serving and orchestrating in the
/// background; returns once the listener is bound.
pub async fn start(settings: Settings) -> Result<Running, ServeError> {
    tls::install_crypto_provider();
    let db = open_database(&settings).await?;
    let blobs = BlobStore::open(&settings.blob_store)?;
    let server_key = settings::model_signing_key(&db)
        .await
        .map_err(ServeError::Keys)?;
    let admin_token = settings::bootstrap_admin_token(&db)
        .await
        .map_err(ServeError::Keys)?;
    let listen = settings.listen;
    let tls_setting = settings.tls.clone();
    let data_dir = settings.data_dir.clone();
    let grace = Duration::from_millis(settings.limits.shutdown_grace_ms);
    let state = AppState::new(db, blobs, server_key, settings);
    let app = api::app(state.clone()).into_make_service_with_connect_info::<SocketAddr>();
    let (stop, stop_rx) = watch::channel(false);
    let orchestrator = tokio::spawn(orchestrator::run(state.clone(), stop_rx));
    let handle = axum_server::Handle::new();
    let (scheme, fingerprint, served) = match tls_setting {
        TlsSetting::None { insecure } => {
            if insecure {
                tracing::warn!(%listen, "serving plain HTTP on a non-loopback address (--insecure-http); tokens and updates cross the network unencrypted");
            }
            let server = axum_server::bind(listen).handle(handle.clone());
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
            let server = axum_server::bind_rustls(listen, config).handle(handle.clone());
            let served = tokio::spawn(async move {
                server
                    .serve(app)
                    .await
                    .map_err(|source| ServeError::Bind { listen, source })
            });
            ("https", fingerprint, served)
        }
    };
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
    })
}

/// `canopy-server serve`: starts, prints the lines tools read, and runs
/// until SIGTERM or Ctrl-C.
pub async fn serve(settings: Settings) -> Result<(), ServeError> {
    let running = start(settings).await?;
    if let Some(secret) = &running.admin_token {
        announce(&format!("admin token: {secret}"));
        tracing::warn!(
            "issued the first admin token; it was printed once and only its hash is kept"
        );
    }
    if let Some(fingerprint) = &running.fingerprint {
        announce(&format!("tls fingerprint: {fingerprint}"));
    }
    announce(&format!("listening on {}", running.base_url()));
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
