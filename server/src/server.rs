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

pub async fn serve(settings: Settings) -> Result<(), ServeError> {
    tls::install_crypto_provider();
    let db = open_database(&settings).await?;
    let blobs = BlobStore::open(&settings.blob_store)?;
    let server_key = settings::model_signing_key(&db)
        .await
        .map_err(ServeError::Keys)?;
    if let Some(secret) = settings::bootstrap_admin_token(&db)
        .await
        .map_err(ServeError::Keys)?
    {
        announce(&format!("admin token: {secret}"));
        tracing::warn!(
            "issued the first admin token; it was printed once and only its hash is kept"
        );
    }
    let listen = settings.listen;
    let tls_setting = settings.tls.clone();
    let data_dir = settings.data_dir.clone();
    let grace = Duration::from_millis(settings.limits.shutdown_grace_ms);
    let state = AppState::new(db, blobs, server_key, settings);
    let app = api::app(state.clone()).into_make_service_with_connect_info::<SocketAddr>();

    let (stop_tx, stop_rx) = watch::channel(false);
    let orchestrator = tokio::spawn(orchestrator::run(state.clone(), stop_rx));
    let handle = axum_server::Handle::new();
    tokio::spawn(shutdown_on_signal(
        handle.clone(),
        state.clone(),
        stop_tx,
        grace,
    ));
    let announce_handle = handle.clone();
    let scheme = if matches!(tls_setting, TlsSetting::None { .. }) {
        "http"
    } else {
        "https"
    };
    tokio::spawn(async move {
        if let Some(addr) = announce_handle.listening().await {
            announce(&format!("listening on {scheme}://{addr}"));
            tracing::info!(%addr, "serving");
        }
    });

    let served = match tls_setting {
        TlsSetting::None { insecure } => {
            if insecure {
                tracing::warn!(%listen, "serving plain HTTP on a non-loopback address (--insecure-http); tokens and updates cross the network unencrypted");
            }
            axum_server::bind(listen).handle(handle).serve(app).await
        }
        tls_setting => {
            let (cert, key) = match tls_setting {
                TlsSetting::Files { cert, key } => (cert, key),
                _ => {
                    let extra = (!listen.ip().is_unspecified()).then(|| listen.ip().to_string());
                    let (cert, key) = tls::self_signed(&data_dir, extra)?;
                    announce(&format!("tls fingerprint: {}", tls::fingerprint(&cert)?));
                    (cert, key)
                }
            };
            let config = axum_server::tls_rustls::RustlsConfig::from_pem_file(&cert, &key)
                .await
                .map_err(|source| TlsError::Load {
                    cert: cert.clone(),
                    key: key.clone(),
                    source,
                })?;
            axum_server::bind_rustls(listen, config)
                .handle(handle)
                .serve(app)
                .await
        }
    };
    served.map_err(|source| ServeError::Bind { listen, source })?;
    let _ = orchestrator.await;
    tracing::info!("server stopped");
    Ok(())
}

/// SIGTERM or Ctrl-C: report not-ready, stop the orchestrator, stop
/// accepting connections, and give in-flight requests (uploads included)
/// the grace period to finish.
async fn shutdown_on_signal(
    handle: axum_server::Handle<SocketAddr>,
    state: AppState,
    stop: watch::Sender<bool>,
    grace: Duration,
) {
    wait_for_signal().await;
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
