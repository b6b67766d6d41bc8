//! Server settings, from flags, `CANOPY_*` environment variables and a TOML
//! file, in that order of precedence; then built-in defaults.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use clap::{Args, ValueEnum};
use serde::Deserialize;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LogFormat {
    Pretty,
    Json,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TlsMode {
    /// A development certificate, created once in the data directory.
    SelfSigned,
}

/// Flags of `serve` (and, for the database, of `migrate` and `token`).
#[derive(Args, Clone, Debug, Default)]
pub struct ServeArgs {
    /// TOML file with any of the settings below (snake_case keys).
    #[arg(long, env = "CANOPY_CONFIG")]
    pub config: Option<PathBuf>,
    /// Directory for the SQLite database, blobs and the development certificate.
    #[arg(long, env = "CANOPY_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// Address to listen on [default: 127.0.0.1:8443].
    #[arg(long, env = "CANOPY_LISTEN")]
    pub listen: Option<SocketAddr>,
    /// sqlite://PATH or postgres://… [default: sqlite in the data directory].
    #[arg(long, env = "CANOPY_DATABASE_URL")]
    pub database_url: Option<String>,
    /// Blob store: a directory, or s3:// gs:// az:// with the cloud-blobs feature.
    #[arg(long, env = "CANOPY_BLOB_STORE")]
    pub blob_store: Option<String>,
    /// PEM certificate chain for HTTPS.
    #[arg(
        long,
        env = "CANOPY_TLS_CERT",
        requires = "tls_key",
        conflicts_with = "tls"
    )]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key for HTTPS.
    #[arg(long, env = "CANOPY_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// `self-signed`: create a development certificate and print its fingerprint.
    #[arg(long, env = "CANOPY_TLS", value_enum)]
    pub tls: Option<TlsMode>,
    /// Serve plain HTTP on a non-loopback address (logs a warning).
    #[arg(long, env = "CANOPY_INSECURE_HTTP")]
    pub insecure_http: bool,
    #[arg(long, env = "CANOPY_LOG_FORMAT", value_enum)]
    pub log_format: Option<LogFormat>,
}

/// The TOML file: the same settings plus the limits.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub data_dir: Option<PathBuf>,
    pub listen: Option<SocketAddr>,
    pub database_url: Option<String>,
    pub blob_store: Option<String>,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    pub tls: Option<TlsMode>,
    pub insecure_http: Option<bool>,
    pub log_format: Option<LogFormat>,
    #[serde(default)]
    pub limits: Limits,
}

/// Every bound the server enforces, in one place.
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Largest model file accepted by `POST /api/v1/models/{name}/versions`.
    pub max_model_bytes: u64,
    /// Largest JSON request body.
    pub max_json_bytes: usize,
    /// Uploads read at once; each holds one model-sized buffer.
    pub max_concurrent_uploads: usize,
    /// Requests served at once; more wait.
    pub max_concurrent_requests: usize,
    pub request_timeout_ms: u64,
    /// Longest a device's task poll may wait.
    pub long_poll_max_ms: u64,
    /// A device is online if it was seen this recently.
    pub online_window_ms: u64,
    pub heartbeat_interval_ms: u64,
    /// Enrollment and token-creation requests per minute, per client address.
    pub sensitive_requests_per_minute: u32,
    pub orchestrator_tick_ms: u64,
    /// How long shutdown waits for in-flight requests.
    pub shutdown_grace_ms: u64,
    /// Largest page of a list.
    pub max_page_size: u32,
    /// How long each key stage of a secure round (AdvertiseKeys, ShareKeys,
    /// Unmasking) waits for devices before it closes without them.
    pub secagg_stage_timeout_ms: u64,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_model_bytes: 512 << 20,
            max_json_bytes: 64 << 10,
            max_concurrent_uploads: 32,
            max_concurrent_requests: 4096,
            request_timeout_ms: 120_000,
            long_poll_max_ms: 30_000,
            online_window_ms: 60_000,
            heartbeat_interval_ms: 15_000,
            sensitive_requests_per_minute: 120,
            orchestrator_tick_ms: 200,
            shutdown_grace_ms: 30_000,
            max_page_size: 500,
            secagg_stage_timeout_ms: 60_000,
        }
    }
}

/// Settings after merging flags, environment, file and defaults.
#[derive(Clone, Debug)]
pub struct Settings {
    pub data_dir: PathBuf,
    pub listen: SocketAddr,
    pub database_url: String,
    pub blob_store: String,
    pub tls: TlsSetting,
    pub log_format: LogFormat,
    pub limits: Limits,
}

#[derive(Clone, Debug, PartialEq)]
pub enum TlsSetting {
    Files {
        cert: PathBuf,
        key: PathBuf,
    },
    SelfSigned,
    /// Plain HTTP; `insecure` when on a non-loopback address.
    None {
        insecure: bool,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read the config file {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("config file {path} is not valid")]
    Parse {
        path: PathBuf,
        #[source]
        source: Box<toml::de::Error>,
    },
    #[error(
        "refusing plain HTTP on {listen}, which is not a loopback address; \
         pass --tls self-signed, --tls-cert/--tls-key, or --insecure-http"
    )]
    PlainHttpNotLoopback { listen: SocketAddr },
    #[error("config: {0}")]
    Invalid(String),
}

pub const DEFAULT_LISTEN: &str = "127.0.0.1:8443";

impl Settings {
    pub fn resolve(args: &ServeArgs) -> Result<Settings, ConfigError> {
        let file = match &args.config {
            Some(path) => read_file(path)?,
            None => FileConfig::default(),
        };
        let data_dir = args
            .data_dir
            .clone()
            .or(file.data_dir)
            .unwrap_or_else(|| PathBuf::from("canopy-data"));
        let listen = args
            .listen
            .or(file.listen)
            .unwrap_or_else(|| DEFAULT_LISTEN.parse().expect("valid default address"));
        let database_url = args
            .database_url
            .clone()
            .or(file.database_url)
            .unwrap_or_else(|| sqlite_url(&data_dir.join("canopy.db")));
        let blob_store = args
            .blob_store
            .clone()
            .or(file.blob_store)
            .unwrap_or_else(|| data_dir.join("blobs").display().to_string());
        let cert = args.tls_cert.clone().or(file.tls_cert);
        let key = args.tls_key.clone().or(file.tls_key);
        let insecure_http = args.insecure_http || file.insecure_http.unwrap_or(false);
        let tls = match (cert, key, args.tls.or(file.tls)) {
            (Some(cert), Some(key), None) => TlsSetting::Files { cert, key },
            (None, None, Some(TlsMode::SelfSigned)) => TlsSetting::SelfSigned,
            (None, None, None) => {
                if !listen.ip().is_loopback() && !insecure_http {
                    return Err(ConfigError::PlainHttpNotLoopback { listen });
                }
                TlsSetting::None {
                    insecure: !listen.ip().is_loopback(),
                }
            }
            _ => {
                return Err(ConfigError::Invalid(
                    "give either both tls_cert and tls_key, or tls = \"self-signed\", not a mix"
                        .to_string(),
                ));
            }
        };
        let limits = file.limits;
        if limits.max_concurrent_uploads == 0 || limits.max_page_size == 0 {
            return Err(ConfigError::Invalid(
                "limits.max_concurrent_uploads and limits.max_page_size must be at least 1"
                    .to_string(),
            ));
        }
        Ok(Settings {
            data_dir,
            listen,
            database_url,
            blob_store,
            tls,
            log_format: args
                .log_format
                .or(file.log_format)
                .unwrap_or(LogFormat::Pretty),
            limits,
        })
    }
}

pub fn sqlite_url(path: &Path) -> String {
    format!("sqlite://{}?mode=rwc", path.display())
}

fn read_file(path: &Path) -> Result<FileConfig, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    toml::from_str(&text).map_err(|source| ConfigError::Parse {
        path: path.to_path_buf(),
        source: Box::new(source),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_override_file_and_file_overrides_defaults() {
        let dir = std::env::temp_dir().join(format!("canopy-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("server.toml");
        std::fs::write(
            &path,
            "listen = \"127.0.0.1:9000\"\ndata_dir = \"/srv/canopy\"\n[limits]\nmax_page_size = 7\n",
        )
        .unwrap();
        let args = ServeArgs {
            config: Some(path.clone()),
            listen: Some("127.0.0.1:9100".parse().unwrap()),
            ..ServeArgs::default()
        };
        let settings = Settings::resolve(&args).unwrap();
        assert_eq!(settings.listen.port(), 9100);
        assert_eq!(settings.data_dir, PathBuf::from("/srv/canopy"));
        assert_eq!(settings.limits.max_page_size, 7);
        assert_eq!(
            settings.database_url,
            "sqlite:///srv/canopy/canopy.db?mode=rwc"
        );
        std::fs::write(&path, "no_such_setting = 1\n").unwrap();
        let error = Settings::resolve(&args).unwrap_err();
        assert!(matches!(error, ConfigError::Parse { .. }), "{error}");
    }

    #[test]
    fn plain_http_needs_loopback_or_explicit_consent() {
        let mut args = ServeArgs {
            listen: Some("0.0.0.0:8080".parse().unwrap()),
            ..ServeArgs::default()
        };
        let error = Settings::resolve(&args).unwrap_err();
        assert!(error.to_string().contains("--insecure-http"), "{error}");
        args.insecure_http = true;
        let settings = Settings::resolve(&args).unwrap();
        assert_eq!(settings.tls, TlsSetting::None { insecure: true });
    }
}
