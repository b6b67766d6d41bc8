//! The values that cross the boundary: settings in, reports out. Plain
//! records and enums, so every binding gets them as native data classes.

use std::path::PathBuf;

use canopy_sdk::{DeviceLimits, Trust};

use crate::error::CanopyError;

/// How the client trusts the server's TLS certificate.
#[derive(Clone, Debug, PartialEq, Eq, uniffi::Enum)]
pub enum TrustSetting {
    /// The SHA-256 of the server's certificate, as `canopy-server serve
    /// --tls self-signed` prints it (`sha256:HEX` or `HEX`).
    PinnedSha256 { fingerprint: String },
    /// A PEM file of the CA certificates that signed the server's.
    CaFile { path: String },
    /// Mozilla's root program, compiled into the library, for a server
    /// whose certificate comes from a public CA.
    PublicRoots,
}

impl TrustSetting {
    pub(crate) fn to_sdk(&self) -> Trust {
        match self {
            TrustSetting::PinnedSha256 { fingerprint } => Trust::PinnedSha256(fingerprint.clone()),
            TrustSetting::CaFile { path } => Trust::CaFile(PathBuf::from(path)),
            TrustSetting::PublicRoots => Trust::SystemRoots,
        }
    }
}

/// Which engine backend trains.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, uniffi::Enum)]
pub enum BackendPreference {
    /// The best the device has: an NPU through ONNX Runtime for a frozen
    /// backbone, else a hardware GPU, else the CPU.
    #[default]
    Auto,
    Cpu,
    /// The GPU through wgpu (Vulkan on Android, Metal on iOS).
    Gpu,
    /// ONNX Runtime's execution providers (NNAPI, Core ML, QNN) for the
    /// frozen backbone, the head on the CPU or GPU.
    Npu,
}

/// What the app allows one task; `None` is no limit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, uniffi::Record)]
pub struct Limits {
    /// Memory training may take, in MiB (model and data, estimated before
    /// the task starts).
    #[uniffi(default = None)]
    pub max_memory_mb: Option<u64>,
    /// Threads training runs on.
    #[uniffi(default = None)]
    pub max_threads: Option<u32>,
    /// The largest model the device downloads, in bytes.
    #[uniffi(default = None)]
    pub max_download_bytes: Option<u64>,
    /// How long one `run_task` call may run, in milliseconds; then it
    /// stops with `TimeLimit`, checkpointed, to resume later (the OS gives
    /// background work a budget).
    #[uniffi(default = None)]
    pub time_limit_ms: Option<u64>,
}

impl Limits {
    pub(crate) fn to_sdk(self) -> DeviceLimits {
        DeviceLimits {
            max_memory_mb: self.max_memory_mb,
            max_download_bytes: self.max_download_bytes,
            max_threads: self.max_threads,
            time_limit_ms: self.time_limit_ms,
        }
    }
}

/// Everything the client needs to start; see [`crate::CanopyClient::new`].
#[derive(Clone, Debug, PartialEq, Eq, uniffi::Record)]
pub struct ClientConfig {
    /// `https://host:port` of the Canopy server.
    pub server_url: String,
    pub trust: TrustSetting,
    /// A directory private to the app (its files dir on Android, its
    /// Application Support dir on iOS), where the client keeps the
    /// device key, its enrollment, the accepted task, the cached model and
    /// training checkpoints. Created if missing.
    pub storage_dir: String,
    pub limits: Limits,
    pub backend: BackendPreference,
    /// Steps between training checkpoints; 0 takes the default.
    #[uniffi(default = 0)]
    pub checkpoint_every_steps: u32,
    /// The least time between two progress reports to the listener, in
    /// milliseconds (the first and the last step are always reported); 0
    /// reports every step.
    #[uniffi(default = 100)]
    pub progress_interval_ms: u64,
    /// The device authority's Ed25519 public key, 64 hex digits, when the
    /// app's backend certifies its devices (`canopy authority`): in secure
    /// rounds the client then takes a neighbour's key only with the
    /// authority's certificate, so that the server cannot put a key of its
    /// own in an honest neighbour's place. Install this device's own
    /// certificate with `install_certificate` after `enroll`.
    #[uniffi(default = None)]
    pub device_authority: Option<String>,
}

/// The device's state, as the app reads it from the OS.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, uniffi::Record)]
pub struct DeviceConditions {
    pub charging: bool,
    pub unmetered_network: bool,
    pub idle: bool,
    /// 0 to 100.
    pub battery_percent: u8,
}

impl DeviceConditions {
    pub(crate) fn to_protocol(self) -> canopy_protocol::messages::DeviceConditions {
        canopy_protocol::messages::DeviceConditions {
            charging: self.charging,
            unmetered_network: self.unmetered_network,
            idle: self.idle,
            battery_percent: self.battery_percent,
        }
    }
}

/// What the device reports about itself when it enrolls.
#[derive(Clone, Debug, Default, PartialEq, Eq, uniffi::Record)]
pub struct DeviceInfo {
    /// e.g. `android 15` or `ios 18.2`.
    pub os: String,
    pub memory_mb: u64,
    /// Free-form labels a job can select on (e.g. `app_version`).
    #[uniffi(default)]
    pub tags: std::collections::HashMap<String, String>,
}

/// A dataset the device offers to the server, as `register_dataset`
/// read it: what the server selects devices by (a job created with
/// `--dataset NAME` asks for devices that offer `NAME` with samples its
/// model takes). The samples never leave the device.
#[derive(Clone, Debug, PartialEq, Eq, uniffi::Record)]
pub struct DatasetSummary {
    /// 1 to 64 characters of `[A-Za-z0-9_.-]`.
    pub name: String,
    pub samples: u64,
    /// The shape of one sample, e.g. `[64]` or `[1, 28, 28]`.
    pub sample_shape: Vec<u64>,
    pub classes: u64,
}

impl DatasetSummary {
    pub(crate) fn from_protocol(info: canopy_protocol::messages::DatasetInfo) -> DatasetSummary {
        DatasetSummary {
            name: info.name,
            samples: info.samples,
            sample_shape: info.sample_shape,
            classes: info.classes,
        }
    }
}

/// The job's requirements on the device's state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, uniffi::Record)]
pub struct TaskPolicy {
    pub requires_charging: bool,
    pub requires_unmetered_network: bool,
    pub requires_idle: bool,
    pub min_battery_percent: u8,
}

/// The kind of work a task asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, uniffi::Enum)]
pub enum TaskKind {
    Train,
    Evaluate,
    Statistics,
}

/// A task the device accepted, waiting for `run_task`.
#[derive(Clone, Debug, PartialEq, uniffi::Record)]
pub struct TaskInfo {
    pub kind: TaskKind,
    pub job_id: i64,
    pub round_id: i64,
    pub round_number: u32,
    pub model_size_bytes: u64,
    pub deadline_unix_ms: u64,
    pub epochs: u32,
    pub batch_size: u32,
    pub learning_rate: f64,
    /// The round runs secure aggregation: the server learns only the sum.
    pub secure: bool,
    pub policy: TaskPolicy,
    /// The dataset the job trains on (`canopy job create --dataset NAME`),
    /// one this device registered with `register_dataset`; `None` when the
    /// job names none and the app's data is the device's default.
    pub dataset: Option<String>,
    /// Steps already done and checkpointed by an earlier, interrupted run.
    pub checkpointed_step: Option<u64>,
}

/// Where training is, reported before each step.
#[derive(Clone, Copy, Debug, PartialEq, uniffi::Record)]
pub struct TrainingProgress {
    pub round_id: i64,
    /// From 1.
    pub epoch: u32,
    pub epochs: u32,
    pub steps_done: u64,
    pub total_steps: u64,
    /// The epoch's mean loss so far (0 before its first step).
    pub mean_loss: f64,
    /// The step this run resumed from, 0 for a fresh start.
    pub resumed_from_step: u64,
}

/// What a finished `run_task` did.
#[derive(Clone, Debug, PartialEq, uniffi::Record)]
pub struct TaskOutcome {
    pub round_id: i64,
    pub kind: TaskKind,
    pub num_samples: u64,
    /// The last epoch's mean training loss (training tasks).
    pub train_loss: Option<f64>,
    /// Evaluation tasks: the model's loss and accuracy on the data.
    pub eval_loss: Option<f64>,
    pub eval_accuracy: Option<f64>,
    pub train_duration_ms: u64,
    /// Bytes sent: the update, or the masked input of a secure round.
    pub uploaded_bytes: u64,
    pub secure: bool,
    /// The step training resumed from (0: it ran from the start).
    pub resumed_from_step: u64,
    /// The change of the trainable parameters that was sent (before
    /// masking, in a secure round), in the task's layout; empty for
    /// evaluation tasks.
    pub delta: Vec<f32>,
    /// The backend that trained (`cpu`, `gpu`, `npu`).
    pub backend: String,
}

/// What the client knows of itself; no network call.
#[derive(Clone, Debug, PartialEq, uniffi::Record)]
pub struct ClientStatus {
    pub enrolled: bool,
    pub device_id: Option<i64>,
    /// The device's enrolled Ed25519 public key, 64 hex digits: what the
    /// device authority certifies, with the id.
    pub device_key: Option<String>,
    pub server_url: String,
    /// The backends reported at enrollment.
    pub backends: Vec<String>,
    /// The backend tasks train on, as chosen now.
    pub training_backend: String,
    pub pending_task: Option<TaskInfo>,
    pub conditions: Option<DeviceConditions>,
    /// How the last task ended, in words.
    pub last_outcome: Option<String>,
    /// The datasets this client offers the server (`register_dataset`
    /// in this process).
    pub datasets: Vec<DatasetSummary>,
    /// Why the last `check_for_task` of this process came back with no
    /// task, in words, with a hint (e.g. that the device offers no dataset
    /// the jobs ask for); `None` once a task came.
    pub last_check: Option<String>,
}

/// The app's training data.
#[derive(Clone, Debug, PartialEq, uniffi::Enum)]
pub enum TrainingData {
    /// `features` holds `labels.len()` samples of `sample_shape`, row
    /// major; labels are class indices below `classes`.
    Arrays {
        features: Vec<f32>,
        sample_shape: Vec<u32>,
        labels: Vec<i64>,
        classes: u32,
    },
    /// [`TrainingData::Arrays`] with the features as little-endian f32
    /// bytes (numpy's `astype('<f4').tobytes()`, a `ByteBuffer` on the
    /// JVM, `Data` in Swift): one copy across the boundary rather than a
    /// conversion per value, for large arrays.
    Bytes {
        features_f32le: Vec<u8>,
        sample_shape: Vec<u32>,
        labels: Vec<i64>,
        classes: u32,
    },
    /// A CSV file (label in the last column, an optional header), a
    /// directory the engine reads (IDX or CSV files, its train split), or
    /// `.npy` images beside `labels_path`.
    File {
        path: String,
        #[uniffi(default = None)]
        labels_path: Option<String>,
    },
}

/// Takes progress reports; implemented by the app.
#[uniffi::export(with_foreign)]
pub trait ProgressListener: Send + Sync {
    fn on_progress(&self, progress: TrainingProgress);
}

pub(crate) fn check_limits(limits: &Limits) -> Result<(), CanopyError> {
    limits
        .to_sdk()
        .validate()
        .map_err(|error| CanopyError::config(format!("{error}")))
}
