//! Server settings, from flags, `CANOPY_*` environment variables and a TOML
//! file, in that order of precedence; then built-in defaults.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use canopy_protocol::bounds::MAX_MODEL_BYTES;
use clap::{Args, ValueEnum};
use serde::Deserialize;

pub mod api_bounds;

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
    /// Directory for the SQLite database, blobs and the development certificate.
    #[arg(long, env = "CANOPY_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    #[arg(long, env = "CANOPY_LOG_FORMAT", value_enum)]
    pub log_format: Option<LogFormat>,
    #[command(flatten)]
    pub server: ServerArgs,
}

/// Every flag of `serve` but the data directory and the log format, which
/// a program that embeds the server names its own way (`canopy-agent
/// aggregate` keeps the edge's data inside the agent's directory, whose
/// `--data-dir` is the agent's own, and logs as the agent does).
#[derive(Args, Clone, Debug, Default)]
pub struct ServerArgs {
    /// TOML file with any of the settings below (snake_case keys).
    #[arg(long, env = "CANOPY_CONFIG")]
    pub config: Option<PathBuf>,
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
    /// Hex Ed25519 public key of the device authority that certifies
    /// devices' keys for secure rounds (see docs/secure-aggregation.md).
    #[arg(long, env = "CANOPY_DEVICE_AUTHORITY")]
    pub device_authority: Option<String>,
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
    pub device_authority: Option<String>,
    #[serde(default)]
    pub limits: Limits,
}

/// Every bound the server enforces that an operator sizes to the machine,
/// in one place. `docs/limits.md` says what each protects against and how
/// to size it. Bounds the OpenAPI document states are [`api_bounds`];
/// bounds devices check too are `canopy_protocol::bounds`.
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Largest model file accepted by `POST /api/v1/models/{name}/versions`;
    /// at most `canopy_protocol::bounds::MAX_MODEL_BYTES`, which devices
    /// refuse to download past.
    pub max_model_bytes: u64,
    /// Largest dataset upload (`PUT /api/v1/datasets/{name}`): the data
    /// and labels parts together, counted as they arrive and again as
    /// they decompress, so a gzipped part stops at this many bytes.
    pub max_dataset_bytes: u64,
    /// Most values (samples × values per sample) one dataset's features
    /// may hold, checked against an IDX or NPY header before anything is
    /// allocated; parsing holds 4 bytes per value and 8 per sample, one
    /// upload at a time. At most `canopy_engine::data::limits::MAX_ELEMENTS`.
    pub max_dataset_values: usize,
    /// Datasets the server keeps; past it an upload is refused until one is
    /// deleted.
    pub max_datasets: usize,
    /// Most bytes the values of a model's `eval` graph may hold at once
    /// in central evaluation, computed from its shapes before anything
    /// runs (`canopy_ir::cost`). Over it at the evaluation batch (256) the
    /// batch is halved until it fits; over it at batch 1 the evaluation
    /// is refused, at job creation and before each evaluation.
    pub central_eval_memory_bytes: u64,
    /// Most floating-point operations one central evaluation (every
    /// batch of the dataset) may take, from the same static count.
    pub central_eval_flops: u64,
    /// The address space of a central evaluation's worker process: the
    /// graph's values, the parsed dataset, the model and the process
    /// itself. An evaluation past it ends its worker, never the server.
    pub central_eval_worker_memory_bytes: u64,
    /// Wall-clock time one central evaluation's worker may run; it is
    /// killed past it. Also each job's longest wait behind another job.
    pub central_eval_timeout_ms: u64,
    /// Workers started for one round's central evaluation before it is
    /// recorded as failed (each start is counted before the worker runs,
    /// so a server killed by every attempt cannot retry forever).
    pub central_eval_attempts: u32,
    /// Removed: parsed datasets are no longer cached (central evaluation
    /// parses its dataset in its worker). Kept only to refuse it by name.
    #[doc(hidden)]
    #[serde(rename = "max_cached_datasets")]
    pub removed_max_cached_datasets: Option<serde::de::IgnoredAny>,
    /// Largest JSON request body.
    pub max_json_bytes: usize,
    /// Device uploads (updates, masked inputs) read at once; each holds one
    /// update-sized buffer.
    pub max_concurrent_uploads: usize,
    /// How long an upload waits for one of those slots before it is
    /// answered 503 with `Retry-After`.
    pub upload_slot_wait_ms: u64,
    /// How long an upload may hold its slot while its body arrives; past it
    /// the upload is answered 408 and the slot goes to the next device.
    pub upload_timeout_ms: u64,
    /// Model uploads (admin API) received at once. Each streams to a
    /// staging file; they are verified one at a time, so a model upload
    /// needs about twice the model's size in memory, once.
    pub max_concurrent_model_uploads: usize,
    /// Requests served at once from the general pool (every route but
    /// probes, enrollments and waiting task polls; see
    /// `request_slots.rs`); more wait up to `request_queue_timeout_ms`,
    /// then get 503.
    pub max_concurrent_requests: usize,
    pub request_queue_timeout_ms: u64,
    /// Places only the admin API takes (it takes general ones past them),
    /// so that device traffic filling the general pool never locks
    /// operators out.
    pub reserved_admin_requests: usize,
    /// Places only device uploads take (then general ones); at least
    /// `max_concurrent_uploads`, so every upload slot can be filled.
    pub reserved_upload_requests: usize,
    /// Task polls waiting at once, in their own pool: a waiting poll holds
    /// no general place. At least `max_connections`, since every device
    /// holds a connection with a poll waiting (the default leaves room for
    /// two, `max_polls_per_device`); 503 past it.
    pub max_waiting_polls: usize,
    /// Enrollments (the one body from clients with no credentials) served
    /// at once, in their own pool; more wait up to
    /// `request_queue_timeout_ms`, then get 503.
    pub max_concurrent_enrollments: usize,
    /// Enrollments in progress from one client address (an IPv6 client by
    /// its /64); 429 past it.
    pub max_enrollments_per_address: usize,
    /// An enrollment's body must arrive within this, before its handler
    /// runs; 408 past it.
    pub enrollment_body_timeout_ms: u64,
    /// And at this rate at least, after its first second; 408 below it.
    pub min_enrollment_body_bytes_per_second: u64,
    /// Requests one device may have in flight at once (429 past it).
    pub max_requests_per_device: usize,
    /// Task polls one device may have waiting at once (429 past it).
    pub max_polls_per_device: usize,
    /// Signed requests per second one device may make, with bursts of
    /// twice this; past it 429. Checked before the replay nonce is stored,
    /// so a flood from one device costs the database nothing.
    pub device_requests_per_second: u32,
    pub request_timeout_ms: u64,
    /// Open connections, all clients together; past it new connections are
    /// closed at once.
    pub max_connections: usize,
    /// Open connections from one client address (for IPv6, one /64).
    pub max_connections_per_address: usize,
    /// A TLS handshake must finish within this.
    pub tls_handshake_timeout_ms: u64,
    /// A connection's first byte, and each HTTP/1 request head (request
    /// line and headers), must arrive within this; an idle HTTP/1
    /// keep-alive connection is closed after it.
    pub header_read_timeout_ms: u64,
    /// A connection on which no byte moves either way for this long is
    /// closed (HTTP/2 too). Must exceed `long_poll_max_ms`.
    pub idle_timeout_ms: u64,
    /// Largest request head (request line and headers) answered normally;
    /// up to twice this gets a JSON 431, past that the connection's parser
    /// refuses it with a bare 431.
    pub max_header_bytes: usize,
    /// Largest request URI (path and query); longer gets a JSON 414.
    pub max_uri_bytes: usize,
    /// Most header fields in one request; more gets a JSON 431.
    pub max_header_count: usize,
    /// Concurrent streams on one HTTP/2 connection.
    pub http2_max_concurrent_streams: u32,
    /// Longest a device's task poll may wait.
    pub long_poll_max_ms: u64,
    /// A device is online if it was seen this recently.
    pub online_window_ms: u64,
    pub heartbeat_interval_ms: u64,
    /// Enrollments, and token creations, per minute from one client
    /// address (an IPv6 client by its /64); each has its own bucket.
    pub sensitive_requests_per_minute: u32,
    pub orchestrator_tick_ms: u64,
    /// Open rounds the orchestrator advances per tick; the rest wait for
    /// the next tick.
    pub max_rounds_per_tick: u32,
    /// How often expired replay nonces are deleted and idle rate-limiter
    /// entries forgotten.
    pub nonce_prune_interval_ms: u64,
    /// Updates to one round folded in one transaction. The upload slots
    /// bound the queue anyway; this bounds one transaction, which rewrites
    /// the model-sized sum once however many it folds.
    pub max_fold_batch: usize,
    /// Model versions whose update layout is kept in memory; past this many
    /// the cache is cleared, which only costs a re-read.
    pub max_cached_layouts: usize,
    /// Pooled database connections; SQLite readers share the one file.
    pub database_connections: u32,
    /// How long a request waits for a pooled connection before a 503.
    pub database_acquire_timeout_ms: u64,
    /// Pooled connections that writes to one round's row (folding updates,
    /// counting download bytes) may hold at once; below
    /// `database_connections`. On PostgreSQL such a write waits for the
    /// round's row lock, and without this bound a burst for one round parks
    /// every pooled connection on that lock and starves all other requests.
    pub round_write_connections: usize,
    /// How long SQLite waits for another process's write lock (the `token`
    /// subcommand while `serve` runs) before it reports "database is locked".
    pub sqlite_busy_timeout_ms: u64,
    /// How often a background connection copies SQLite's write-ahead log
    /// into the database (a `PASSIVE` checkpoint, which blocks no reader
    /// or writer), so that no request's commit runs a checkpoint and its
    /// fsyncs. 0: the commit that takes the log past 1,000 pages runs it,
    /// SQLite's default.
    pub sqlite_checkpoint_interval_ms: u64,
    /// How long shutdown waits for in-flight requests.
    pub shutdown_grace_ms: u64,
    /// Largest page of a list.
    pub max_page_size: u32,
    /// How long each key stage of a secure round (AdvertiseKeys, ShareKeys,
    /// Unmasking) waits for devices before it closes without them.
    pub secagg_stage_timeout_ms: u64,
    /// How often each process rereads the model-signing keys, so that a
    /// rotation reaches every process sharing the database.
    pub signing_key_reload_ms: u64,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_model_bytes: 512 << 20,
            max_dataset_bytes: 256 << 20,
            max_dataset_values: 64 << 20,
            max_datasets: 64,
            central_eval_memory_bytes: 2 << 30,
            central_eval_flops: 2_000_000_000_000,
            central_eval_worker_memory_bytes: 6 << 30,
            central_eval_timeout_ms: 300_000,
            central_eval_attempts: 3,
            removed_max_cached_datasets: None,
            max_json_bytes: 64 << 10,
            max_concurrent_uploads: 32,
            upload_slot_wait_ms: 10_000,
            upload_timeout_ms: 60_000,
            max_concurrent_model_uploads: 2,
            max_concurrent_requests: 4096,
            request_queue_timeout_ms: 2_000,
            reserved_admin_requests: 64,
            reserved_upload_requests: 64,
            max_waiting_polls: 20_000,
            max_concurrent_enrollments: 64,
            max_enrollments_per_address: 8,
            enrollment_body_timeout_ms: 5_000,
            min_enrollment_body_bytes_per_second: 1_024,
            max_requests_per_device: 8,
            max_polls_per_device: 2,
            device_requests_per_second: 20,
            request_timeout_ms: 120_000,
            max_connections: 10_000,
            max_connections_per_address: 256,
            tls_handshake_timeout_ms: 10_000,
            header_read_timeout_ms: 10_000,
            idle_timeout_ms: 60_000,
            max_header_bytes: 16 << 10,
            max_uri_bytes: 8 << 10,
            max_header_count: 100,
            http2_max_concurrent_streams: 32,
            long_poll_max_ms: 30_000,
            online_window_ms: 60_000,
            heartbeat_interval_ms: 15_000,
            sensitive_requests_per_minute: 120,
            orchestrator_tick_ms: 200,
            max_rounds_per_tick: 256,
            nonce_prune_interval_ms: 60_000,
            max_fold_batch: 64,
            max_cached_layouts: 256,
            database_connections: 16,
            database_acquire_timeout_ms: 10_000,
            round_write_connections: 4,
            sqlite_busy_timeout_ms: 10_000,
            sqlite_checkpoint_interval_ms: 1_000,
            shutdown_grace_ms: 30_000,
            max_page_size: 500,
            secagg_stage_timeout_ms: 60_000,
            signing_key_reload_ms: 5_000,
        }
    }
}

impl Limits {
    /// The relations between limits that the server relies on; a file that
    /// breaks one is refused at start, naming the setting.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.check_counts()?;
        self.check_durations()?;
        self.check_request_heads()?;
        self.check_connections()?;
        self.check_request_pools()?;
        self.check_database()?;
        self.check_central_evaluation()?;
        self.check_upload_sizes()
    }

    /// The worker needs room for itself; a removed setting is named.
    fn check_central_evaluation(&self) -> Result<(), ConfigError> {
        if self.removed_max_cached_datasets.is_some() {
            return Err(invalid(
                "limits.max_cached_datasets was removed: central evaluation parses its dataset \
                 in a worker process and keeps none in memory; delete the setting"
                    .to_string(),
            ));
        }
        if self.central_eval_worker_memory_bytes < MIN_WORKER_MEMORY_BYTES {
            return Err(invalid(format!(
                "limits.central_eval_worker_memory_bytes is {}; use at least \
                 {MIN_WORKER_MEMORY_BYTES} (128 MiB), which the worker process needs for itself",
                self.central_eval_worker_memory_bytes
            )));
        }
        Ok(())
    }

    /// Counts and sizes of zero would refuse everything.
    fn check_counts(&self) -> Result<(), ConfigError> {
        let counts = [
            ("max_concurrent_uploads", self.max_concurrent_uploads),
            (
                "max_concurrent_model_uploads",
                self.max_concurrent_model_uploads,
            ),
            ("max_concurrent_requests", self.max_concurrent_requests),
            ("reserved_admin_requests", self.reserved_admin_requests),
            ("reserved_upload_requests", self.reserved_upload_requests),
            ("max_waiting_polls", self.max_waiting_polls),
            (
                "max_concurrent_enrollments",
                self.max_concurrent_enrollments,
            ),
            (
                "max_enrollments_per_address",
                self.max_enrollments_per_address,
            ),
            (
                "min_enrollment_body_bytes_per_second",
                usize::try_from(self.min_enrollment_body_bytes_per_second).unwrap_or(usize::MAX),
            ),
            ("max_requests_per_device", self.max_requests_per_device),
            ("max_polls_per_device", self.max_polls_per_device),
            (
                "device_requests_per_second",
                self.device_requests_per_second as usize,
            ),
            ("max_connections", self.max_connections),
            (
                "max_connections_per_address",
                self.max_connections_per_address,
            ),
            ("max_header_count", self.max_header_count),
            ("max_page_size", self.max_page_size as usize),
            ("max_rounds_per_tick", self.max_rounds_per_tick as usize),
            ("max_fold_batch", self.max_fold_batch),
            ("max_cached_layouts", self.max_cached_layouts),
            ("max_datasets", self.max_datasets),
            ("max_dataset_values", self.max_dataset_values),
            (
                "central_eval_memory_bytes",
                usize::try_from(self.central_eval_memory_bytes).unwrap_or(usize::MAX),
            ),
            (
                "central_eval_flops",
                usize::try_from(self.central_eval_flops).unwrap_or(usize::MAX),
            ),
            ("central_eval_attempts", self.central_eval_attempts as usize),
            (
                "max_dataset_bytes",
                usize::try_from(self.max_dataset_bytes).unwrap_or(usize::MAX),
            ),
            ("database_connections", self.database_connections as usize),
            ("round_write_connections", self.round_write_connections),
            (
                "http2_max_concurrent_streams",
                self.http2_max_concurrent_streams as usize,
            ),
        ];
        for (name, value) in counts {
            if value == 0 {
                return Err(invalid(format!("limits.{name} must be at least 1")));
            }
        }
        Ok(())
    }

    fn check_durations(&self) -> Result<(), ConfigError> {
        let durations = [
            ("upload_slot_wait_ms", self.upload_slot_wait_ms),
            ("upload_timeout_ms", self.upload_timeout_ms),
            ("request_queue_timeout_ms", self.request_queue_timeout_ms),
            ("request_timeout_ms", self.request_timeout_ms),
            (
                "enrollment_body_timeout_ms",
                self.enrollment_body_timeout_ms,
            ),
            ("tls_handshake_timeout_ms", self.tls_handshake_timeout_ms),
            ("header_read_timeout_ms", self.header_read_timeout_ms),
            ("idle_timeout_ms", self.idle_timeout_ms),
            ("nonce_prune_interval_ms", self.nonce_prune_interval_ms),
            (
                "database_acquire_timeout_ms",
                self.database_acquire_timeout_ms,
            ),
            ("sqlite_busy_timeout_ms", self.sqlite_busy_timeout_ms),
            ("central_eval_timeout_ms", self.central_eval_timeout_ms),
        ];
        for (name, value) in durations {
            if value == 0 || value > MAX_TIMEOUT_MS {
                return Err(invalid(format!(
                    "limits.{name} is {value}; use 1 to {MAX_TIMEOUT_MS} ms"
                )));
            }
        }
        if self.sqlite_checkpoint_interval_ms > MAX_TIMEOUT_MS {
            return Err(invalid(format!(
                "limits.sqlite_checkpoint_interval_ms is {}; use 1 to {MAX_TIMEOUT_MS} ms, or 0 \
                 to leave checkpoints to the commits that fill the log",
                self.sqlite_checkpoint_interval_ms
            )));
        }
        Ok(())
    }

    fn check_request_heads(&self) -> Result<(), ConfigError> {
        if !(MIN_HEADER_BYTES..=MAX_HEADER_BYTES).contains(&self.max_header_bytes) {
            return Err(invalid(format!(
                "limits.max_header_bytes is {}; use {MIN_HEADER_BYTES} to {MAX_HEADER_BYTES}",
                self.max_header_bytes
            )));
        }
        if self.max_uri_bytes == 0 || self.max_uri_bytes > self.max_header_bytes {
            return Err(invalid(format!(
                "limits.max_uri_bytes is {}; use 1 to max_header_bytes ({})",
                self.max_uri_bytes, self.max_header_bytes
            )));
        }
        Ok(())
    }

    fn check_connections(&self) -> Result<(), ConfigError> {
        if self.idle_timeout_ms <= self.long_poll_max_ms {
            return Err(invalid(format!(
                "limits.idle_timeout_ms ({}) must exceed limits.long_poll_max_ms ({}), \
                 or idle connections would be cut in the middle of a task poll",
                self.idle_timeout_ms, self.long_poll_max_ms
            )));
        }
        if self.max_connections_per_address > self.max_connections {
            return Err(invalid(format!(
                "limits.max_connections_per_address ({}) is over limits.max_connections ({})",
                self.max_connections_per_address, self.max_connections
            )));
        }
        Ok(())
    }

    /// The pools of `request_slots.rs` against what they serve.
    fn check_request_pools(&self) -> Result<(), ConfigError> {
        if self.max_waiting_polls < self.max_connections {
            return Err(invalid(format!(
                "limits.max_waiting_polls ({}) is below limits.max_connections ({}); every \
                 device holds a connection with a task poll waiting, so polls past it would be \
                 refused; raise it",
                self.max_waiting_polls, self.max_connections
            )));
        }
        if self.reserved_upload_requests < self.max_concurrent_uploads {
            return Err(invalid(format!(
                "limits.reserved_upload_requests ({}) is below limits.max_concurrent_uploads \
                 ({}), so device traffic could keep upload slots empty; raise it",
                self.reserved_upload_requests, self.max_concurrent_uploads
            )));
        }
        if self.max_enrollments_per_address > self.max_concurrent_enrollments {
            return Err(invalid(format!(
                "limits.max_enrollments_per_address ({}) is over limits.max_concurrent_enrollments \
                 ({}), so one address could take every enrollment place",
                self.max_enrollments_per_address, self.max_concurrent_enrollments
            )));
        }
        if self.enrollment_body_timeout_ms > self.request_timeout_ms {
            return Err(invalid(format!(
                "limits.enrollment_body_timeout_ms ({}) is over limits.request_timeout_ms ({})",
                self.enrollment_body_timeout_ms, self.request_timeout_ms
            )));
        }
        Ok(())
    }

    fn check_database(&self) -> Result<(), ConfigError> {
        if self.round_write_connections >= self.database_connections as usize {
            return Err(invalid(format!(
                "limits.round_write_connections ({}) must be below limits.database_connections \
                 ({}), or writes to one round could hold every pooled connection",
                self.round_write_connections, self.database_connections
            )));
        }
        Ok(())
    }

    /// A model devices would refuse to download must not be accepted, nor
    /// a dataset bound the engine cannot load to.
    fn check_upload_sizes(&self) -> Result<(), ConfigError> {
        use canopy_engine::data::limits::MAX_ELEMENTS;
        if self.max_dataset_values > MAX_ELEMENTS {
            return Err(invalid(format!(
                "limits.max_dataset_values is {}; use 1 to {MAX_ELEMENTS}, the most values the \
                 engine loads into one dataset",
                self.max_dataset_values
            )));
        }
        if self.max_model_bytes == 0 || self.max_model_bytes > MAX_MODEL_BYTES {
            return Err(invalid(format!(
                "limits.max_model_bytes is {}; use 1 to {MAX_MODEL_BYTES}, the largest model \
                 devices download (canopy_protocol::bounds::MAX_MODEL_BYTES)",
                self.max_model_bytes
            )));
        }
        Ok(())
    }
}

/// Bounds on the limits themselves.
const MAX_TIMEOUT_MS: u64 = 24 * 3600 * 1000;
/// hyper's HTTP/1 read buffer, twice `max_header_bytes`, must be at least 8 KiB.
const MIN_HEADER_BYTES: usize = 4 << 10;
const MAX_HEADER_BYTES: usize = 1 << 20;
/// The central evaluation worker's own code, threads and allocator.
const MIN_WORKER_MEMORY_BYTES: u64 = 128 << 20;

fn invalid(message: String) -> ConfigError {
    ConfigError::Invalid(message)
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
    /// With one, the server takes only certificates this authority made,
    /// and selects only certified devices for secure rounds.
    pub device_authority: Option<[u8; 32]>,
    pub limits: Limits,
}

impl Settings {
    /// A server of one's own for a run on this machine (the demo's, a
    /// simulation's): a free loopback port, HTTPS with a development
    /// certificate, SQLite and blobs under `dir/server`, no device
    /// authority, and `limits`.
    pub fn local(dir: &Path, limits: Limits) -> Settings {
        let server = dir.join("server");
        Settings {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            database_url: sqlite_url(&server.join("canopy.db")),
            blob_store: server.join("blobs").display().to_string(),
            data_dir: server,
            tls: TlsSetting::SelfSigned,
            log_format: LogFormat::Pretty,
            device_authority: None,
            limits,
        }
    }
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
    pub fn resolve(serve: &ServeArgs) -> Result<Settings, ConfigError> {
        let args = &serve.server;
        let file = match &args.config {
            Some(path) => read_file(path)?,
            None => FileConfig::default(),
        };
        let data_dir = serve
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
        let device_authority = match args.device_authority.clone().or(file.device_authority) {
            Some(hex) => Some(canopy_protocol::auth::parse_public_key_hex(&hex).map_err(
                |cause| {
                    ConfigError::Invalid(format!(
                        "device_authority is not an Ed25519 public key: {cause}; hint: give the \
                         64 hex digits of the authority's public key"
                    ))
                },
            )?),
            None => None,
        };
        let limits = file.limits;
        limits.validate()?;
        Ok(Settings {
            data_dir,
            listen,
            database_url,
            blob_store,
            tls,
            log_format: serve
                .log_format
                .or(file.log_format)
                .unwrap_or(LogFormat::Pretty),
            device_authority,
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
            data_dir: None,
            log_format: None,
            server: ServerArgs {
                config: Some(path.clone()),
                listen: Some("127.0.0.1:9100".parse().unwrap()),
                ..ServerArgs::default()
            },
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
    fn limits_refuse_what_devices_or_the_pool_cannot_honour() {
        Limits::default()
            .validate()
            .expect("the defaults are valid");
        let over = Limits {
            max_model_bytes: MAX_MODEL_BYTES + 1,
            ..Limits::default()
        };
        let error = over.validate().unwrap_err().to_string();
        assert!(error.contains("limits.max_model_bytes"), "{error}");
        let at = Limits {
            max_model_bytes: MAX_MODEL_BYTES,
            ..Limits::default()
        };
        at.validate()
            .expect("the protocol's bound itself is allowed");
        for values in [0, canopy_engine::data::limits::MAX_ELEMENTS + 1] {
            let error = Limits {
                max_dataset_values: values,
                ..Limits::default()
            }
            .validate()
            .unwrap_err()
            .to_string();
            assert!(error.contains("limits.max_dataset_values"), "{error}");
        }
        let starved = Limits {
            database_connections: 4,
            round_write_connections: 4,
            ..Limits::default()
        };
        let error = starved.validate().unwrap_err().to_string();
        assert!(error.contains("limits.round_write_connections"), "{error}");
        for (pools, setting) in [
            (
                Limits {
                    max_waiting_polls: 9_999,
                    ..Limits::default()
                },
                "limits.max_waiting_polls",
            ),
            (
                Limits {
                    reserved_upload_requests: 31,
                    ..Limits::default()
                },
                "limits.reserved_upload_requests",
            ),
            (
                Limits {
                    max_enrollments_per_address: 65,
                    ..Limits::default()
                },
                "limits.max_enrollments_per_address",
            ),
            (
                Limits {
                    enrollment_body_timeout_ms: 120_001,
                    ..Limits::default()
                },
                "limits.enrollment_body_timeout_ms",
            ),
        ] {
            let error = pools.validate().unwrap_err().to_string();
            assert!(error.contains(setting), "{error}");
        }
    }

    #[test]
    fn central_evaluation_limits_are_checked_and_the_removed_cache_is_named() {
        let old: FileConfig = toml::from_str("[limits]\nmax_cached_datasets = 2\n")
            .expect("the old key still parses");
        let error = old.limits.validate().unwrap_err().to_string();
        assert!(
            error.contains("limits.max_cached_datasets was removed"),
            "{error}"
        );
        let cramped = Limits {
            central_eval_worker_memory_bytes: 1 << 20,
            ..Limits::default()
        };
        let error = cramped.validate().unwrap_err().to_string();
        assert!(
            error.contains("limits.central_eval_worker_memory_bytes"),
            "{error}"
        );
        let never = Limits {
            central_eval_attempts: 0,
            ..Limits::default()
        };
        let error = never.validate().unwrap_err().to_string();
        assert!(error.contains("limits.central_eval_attempts"), "{error}");
    }

    #[test]
    fn plain_http_needs_loopback_or_explicit_consent() {
        let mut args = ServeArgs {
            data_dir: None,
            log_format: None,
            server: ServerArgs {
                listen: Some("0.0.0.0:8080".parse().unwrap()),
                ..ServerArgs::default()
            },
        };
        let error = Settings::resolve(&args).unwrap_err();
        assert!(error.to_string().contains("--insecure-http"), "{error}");
        args.server.insecure_http = true;
        let settings = Settings::resolve(&args).unwrap();
        assert_eq!(settings.tls, TlsSetting::None { insecure: true });
    }
}
