//! The device side of the Canopy protocol: enrollment, signed requests,
//! task polling, verified and resumable model download and update upload,
//! over HTTPS with a pinned, CA-verified or publicly rooted server
//! certificate.
//!
//! - [`DeviceClient`] is async (tokio); [`blocking::DeviceClient`] is the
//!   same client for callers without a runtime.
//! - [`retry`]: retries with capped exponential backoff and full jitter;
//!   what is retried, and why uploads are safe to repeat.
//! - [`CancelToken`]: cancels a poll, a download, an upload, the waits
//!   between retries and local training.
//! - [`keystore`]: the device key in a file with mode 0600.
//! - [`files`]: atomic file writes (a crash leaves the old file or the new
//!   one), for the key store, checkpoints and the apps, agents and CLI on
//!   top.
//! - [`backend`]: which engine backend trains, chosen from the device's
//!   reported capabilities: the CPU, the GPU, or the NPU (ONNX Runtime,
//!   configured with [`configure_npu`]) for a frozen backbone.
//! - [`limits`]: what a device allows one task (memory, download size,
//!   threads, time), and the one rule that refuses a task over them.
//! - [`secure`]: the device's side of a secure-aggregation round, which
//!   replaces the upload when a task asks for it.
//!
//! [`train`] runs a task's shipped `train_step` in `canopy-engine` on local
//! data and produces the update ([`train::train_task`] under
//! [`train::TrainOptions`]; [`train::evaluate`] under
//! [`train::EvalOptions`]); the edge agent and mobile apps build on
//! both. [`checkpoint`] keeps a task's training progress in a file, so
//! training killed at any step resumes where it stopped.

pub mod backend;
pub mod blocking;
mod cancel;
pub mod checkpoint;
mod client;
mod error;
pub mod files;
pub mod keystore;
pub mod limits;
pub mod local;
pub mod retry;
pub mod secure;
#[cfg(any(test, feature = "testing"))]
#[doc(hidden)]
pub mod testing;
pub mod train;
mod transport;
mod trust;

pub use backend::{
    BackendChoice, BackendKind, NpuSetupError, available_backends, choose_backend, configure_npu,
    gpu_adapter, shared_npu,
};
pub use cancel::CancelToken;
/// The NPU backend's configuration, for [`configure_npu`].
pub use canopy_npu::{OrtConfig, Provider};
/// What a device says of a dataset it holds (see [`describe_dataset`]),
/// in [`Heartbeat::datasets`](canopy_protocol::messages::Heartbeat), and
/// the protocol's limits on them.
pub use canopy_protocol::messages::{DatasetInfo, MAX_DATASET_NAME_CHARS, MAX_DATASETS};
/// A job's device policy (shipped in every task), the state a device
/// reports, and why a device may not train now; see
/// [`DeviceClient::withdraw_task`].
pub use canopy_protocol::messages::{DeviceConditions, DevicePolicy, Ineligible, Unmet};
/// What a device trusts to sign models, and the server's answer it
/// advances along; see [`DeviceClient::trusted_keys`].
pub use canopy_protocol::model_sig::{KeyEndorsement, SigningKeys, TrustedKeys};
pub use checkpoint::{CheckpointInfo, CheckpointSettings};
pub use client::{
    DeviceClient, DownloadedModel, MAX_MODEL_BYTES, MAX_SIGNING_KEYS_BYTES, UnofferableDataset,
    describe_dataset, enroll, enroll_as, enroll_with,
};
pub use error::{SdkError, error_chain};
pub use keystore::{KeyStoreError, load_device_key, save_device_key};
pub use limits::{DeviceLimits, LimitRefusal};
pub use retry::{RetryNotice, RetryObserver, RetryPolicy};
pub use secure::{SecureReceipt, SecureRound, StageObserver, StageProgress};
pub use transport::{CONNECT_TIMEOUT_MS, ConnectProblem, REQUEST_TIMEOUT_MS, Transport};
pub use trust::{PinMismatch, Trust, TrustError};
