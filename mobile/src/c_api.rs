//! The C ABI, for everything UniFFI does not reach. `canopy.h` is
//! generated from this file by cbindgen (`canopy-bindgen c`).
//!
//! Conventions, the same for every function:
//! - A call returns `CANOPY_OK` (0) or a `CanopyStatus` naming the
//!   [`CanopyError`] variant. Its message, with causes and hint, is then
//!   `canopy_last_error_message()`, valid on the calling thread until its
//!   next failing call; `canopy_last_error_name()` is the variant's name.
//! - Objects are opaque pointers made by `*_new` and released by
//!   `*_free`, which take NULL. Strings in are NUL-terminated UTF-8;
//!   strings out are freed with `canopy_string_free`.
//! - A NULL where a value is needed is an error, never a crash; a panic
//!   in the core is `CANOPY_INTERNAL`, never an unwind into C.
#![allow(unsafe_code)]

use std::cell::RefCell;
use std::ffi::{CStr, CString, c_char, c_void};
use std::sync::Arc;

use crate::client::{CancelToken, CanopyClient};
use crate::error::{CanopyError, guard};
use crate::types::{
    BackendPreference, ClientConfig, DeviceConditions, DeviceInfo, Limits, ProgressListener,
    TaskKind, TrainingData, TrainingProgress, TrustSetting,
};

/// What a call returned.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CanopyStatus {
    CanopyOk = 0,
    CanopyInvalidConfig,
    CanopyInvalidData,
    CanopyStorage,
    CanopyNotEnrolled,
    CanopyAlreadyEnrolled,
    CanopyNoTask,
    CanopyIneligible,
    CanopyOverLimit,
    CanopyTaskExpired,
    CanopyTimeLimit,
    CanopyCancelled,
    CanopyTraining,
    CanopyNetwork,
    CanopyServer,
    CanopyVerification,
    CanopySecureAggregation,
    /// Any other error; the name says which.
    CanopyOther,
    CanopyInternal,
}

fn status_of(error: &CanopyError) -> CanopyStatus {
    use CanopyError as E;
    match error {
        E::InvalidConfig { .. } | E::Trust { .. } | E::BadUrl { .. } => {
            CanopyStatus::CanopyInvalidConfig
        }
        E::InvalidData { .. } => CanopyStatus::CanopyInvalidData,
        E::Storage { .. } | E::LocalFile { .. } => CanopyStatus::CanopyStorage,
        E::NotEnrolled { .. } => CanopyStatus::CanopyNotEnrolled,
        E::AlreadyEnrolled { .. } => CanopyStatus::CanopyAlreadyEnrolled,
        E::NoTask { .. } => CanopyStatus::CanopyNoTask,
        E::Ineligible { .. } => CanopyStatus::CanopyIneligible,
        E::OverLimit { .. } => CanopyStatus::CanopyOverLimit,
        E::TaskExpired { .. } => CanopyStatus::CanopyTaskExpired,
        E::TimeLimit { .. } => CanopyStatus::CanopyTimeLimit,
        E::Cancelled { .. } => CanopyStatus::CanopyCancelled,
        E::Training { .. } | E::InvalidTask { .. } => CanopyStatus::CanopyTraining,
        E::Transport { .. } | E::Incomplete { .. } => CanopyStatus::CanopyNetwork,
        E::Server { .. } | E::BadResponse { .. } => CanopyStatus::CanopyServer,
        E::ModelVerification { .. } | E::Certificate { .. } => CanopyStatus::CanopyVerification,
        E::SecureAggregation { .. }
        | E::SecureRoundGone { .. }
        | E::SecureMessageRefused { .. }
        | E::StageTimeout { .. }
        | E::NotSecure { .. } => CanopyStatus::CanopySecureAggregation,
        E::Internal { .. } => CanopyStatus::CanopyInternal,
        _ => CanopyStatus::CanopyOther,
    }
}

thread_local! {
    static LAST_ERROR: RefCell<(CString, CString)> = RefCell::new((CString::default(), CString::default()));
}

fn c_string(text: &str) -> CString {
    CString::new(text.replace('\0', " ")).unwrap_or_default()
}

/// Runs `call` under the panic guard and records a failure for
/// `canopy_last_error_*`.
fn status(call: impl FnOnce() -> Result<(), CanopyError>) -> CanopyStatus {
    match guard(call) {
        Ok(()) => CanopyStatus::CanopyOk,
        Err(error) => {
            let code = status_of(&error);
            LAST_ERROR.with(|last| {
                *last.borrow_mut() = (c_string(error.name()), c_string(&error.message()));
            });
            code
        }
    }
}

fn null(argument: &str) -> CanopyError {
    CanopyError::config(format!(
        "argument `{argument}` is NULL\nhint: pass a valid pointer; only the arguments the \
         header marks as optional may be NULL"
    ))
}

/// # Safety
/// `text` is NULL or a NUL-terminated string.
unsafe fn text(text: *const c_char, argument: &str) -> Result<String, CanopyError> {
    if text.is_null() {
        return Err(null(argument));
    }
    // SAFETY: non-null, and the caller promises a NUL-terminated string.
    let text = unsafe { CStr::from_ptr(text) };
    text.to_str()
        .map(str::to_string)
        .map_err(|_| CanopyError::config(format!("argument `{argument}` is not UTF-8")))
}

/// # Safety
/// `text` is NULL or a NUL-terminated string.
unsafe fn optional_text(
    text: *const c_char,
    argument: &str,
) -> Result<Option<String>, CanopyError> {
    if text.is_null() {
        return Ok(None);
    }
    // SAFETY: forwarded from the caller.
    unsafe { self::text(text, argument) }.map(Some)
}

/// # Safety
/// `client` is NULL or from `canopy_client_new`, not yet freed.
unsafe fn client<'a>(client: *const CanopyClient) -> Result<&'a CanopyClient, CanopyError> {
    // SAFETY: the caller promises a live pointer from `Arc::into_raw`.
    unsafe { client.as_ref() }.ok_or_else(|| null("client"))
}

/// # Safety
/// `slice` is NULL with `len` 0, or points to `len` readable values.
unsafe fn slice<'a, T>(
    slice: *const T,
    len: usize,
    argument: &str,
) -> Result<&'a [T], CanopyError> {
    if len == 0 {
        return Ok(&[]);
    }
    if slice.is_null() {
        return Err(null(argument));
    }
    // SAFETY: non-null, and the caller promises `len` readable values.
    Ok(unsafe { std::slice::from_raw_parts(slice, len) })
}

/// The labelled arrays `canopy_client_register_dataset` and
/// `canopy_client_run_task` take, copied into the core's form.
///
/// # Safety
/// Each array is NULL with length 0, or holds the values its length says.
unsafe fn arrays(
    features: (*const f32, usize),
    sample_shape: (*const u32, usize),
    labels: (*const i64, usize),
    classes: u32,
) -> Result<TrainingData, CanopyError> {
    // SAFETY: the caller's promises on every pointer, forwarded.
    let (features, shape, labels) = unsafe {
        (
            slice(features.0, features.1, "features")?,
            slice(sample_shape.0, sample_shape.1, "sample_shape")?,
            slice(labels.0, labels.1, "labels")?,
        )
    };
    Ok(TrainingData::Arrays {
        features: features.to_vec(),
        sample_shape: shape.to_vec(),
        labels: labels.to_vec(),
        classes,
    })
}

/// Writes `value` to `out`.
///
/// # Safety
/// `out` is NULL or writable.
unsafe fn put<T>(out: *mut T, value: T, argument: &str) -> Result<(), CanopyError> {
    if out.is_null() {
        return Err(null(argument));
    }
    // SAFETY: non-null, and the caller promises it is writable.
    unsafe { out.write(value) };
    Ok(())
}

/// The backend a client trains on.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub enum CanopyBackend {
    CanopyBackendAuto = 0,
    CanopyBackendCpu,
    CanopyBackendGpu,
    CanopyBackendNpu,
}

/// A client's limits; 0 in a field is no limit.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CanopyLimits {
    pub max_memory_mb: u64,
    pub max_threads: u32,
    pub max_download_bytes: u64,
    pub time_limit_ms: u64,
}

/// The device's state, as the OS reports it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CanopyConditions {
    pub charging: bool,
    pub unmetered_network: bool,
    pub idle: bool,
    pub battery_percent: u8,
}

/// A task the device accepted.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CanopyTaskInfo {
    pub job_id: i64,
    pub round_id: i64,
    pub round_number: u32,
    /// 0 train, 1 evaluate, 2 statistics.
    pub kind: u32,
    pub epochs: u32,
    pub batch_size: u32,
    pub learning_rate: f64,
    pub model_size_bytes: u64,
    pub deadline_unix_ms: u64,
    pub secure: bool,
}

/// What a finished run did.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CanopyTaskOutcome {
    pub round_id: i64,
    pub num_samples: u64,
    /// NaN when the task trained nothing.
    pub train_loss: f64,
    pub uploaded_bytes: u64,
    pub train_duration_ms: u64,
    pub resumed_from_step: u64,
    pub secure: bool,
}

/// Called before each training step: steps done, steps in all, the
/// epoch's mean loss so far, and the caller's `user_data`.
pub type CanopyProgressFn = Option<
    extern "C" fn(steps_done: u64, total_steps: u64, mean_loss: f64, user_data: *mut c_void),
>;

/// The library's version, a static string (do not free).
#[unsafe(no_mangle)]
pub extern "C" fn canopy_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// The message of this thread's last failed call (causes and hint
/// included), or "" if none failed; valid until the thread's next failing
/// call. Do not free.
#[unsafe(no_mangle)]
pub extern "C" fn canopy_last_error_message() -> *const c_char {
    LAST_ERROR.with(|last| last.borrow().1.as_ptr())
}

/// The error name (`Cancelled`, `Server`, ...) of this thread's last
/// failed call, as every binding spells it; valid like the message.
#[unsafe(no_mangle)]
pub extern "C" fn canopy_last_error_name() -> *const c_char {
    LAST_ERROR.with(|last| last.borrow().0.as_ptr())
}

/// Frees a string the library returned as `char *`.
///
/// # Safety
/// `text` is NULL or a string from this library, freed once.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn canopy_string_free(text: *mut c_char) {
    if !text.is_null() {
        // SAFETY: the caller passes a string from `CString::into_raw`, once.
        drop(unsafe { CString::from_raw(text) });
    }
}

/// Makes a client. `pinned_sha256` (the fingerprint `canopy-server serve`
/// prints) or else `ca_file` (a PEM path) says how the server's
/// certificate is trusted; both NULL trusts public roots. `limits` may be
/// NULL. `device_authority` (64 hex digits) pins the device authority
/// whose certificates neighbours' keys must carry in secure rounds; NULL
/// takes them on the server's word. On success `*out` is the client, to
/// free with `canopy_client_free`.
///
/// # Safety
/// Strings are NULL or NUL-terminated; `limits` is NULL or readable;
/// `out` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn canopy_client_new(
    server_url: *const c_char,
    pinned_sha256: *const c_char,
    ca_file: *const c_char,
    storage_dir: *const c_char,
    limits: *const CanopyLimits,
    backend: CanopyBackend,
    device_authority: *const c_char,
    out: *mut *mut CanopyClient,
) -> CanopyStatus {
    status(|| {
        // SAFETY: the caller's promises on each pointer, forwarded.
        let (url, pin, ca, dir, authority) = unsafe {
            (
                text(server_url, "server_url")?,
                optional_text(pinned_sha256, "pinned_sha256")?,
                optional_text(ca_file, "ca_file")?,
                text(storage_dir, "storage_dir")?,
                optional_text(device_authority, "device_authority")?,
            )
        };
        let trust = match (pin, ca) {
            (Some(fingerprint), _) => TrustSetting::PinnedSha256 { fingerprint },
            (None, Some(path)) => TrustSetting::CaFile { path },
            (None, None) => TrustSetting::PublicRoots,
        };
        // SAFETY: NULL or readable, as the caller promises.
        let limits = unsafe { limits.as_ref() }.copied().unwrap_or_default();
        let nonzero = |v: u64| (v > 0).then_some(v);
        let config = ClientConfig {
            server_url: url,
            trust,
            storage_dir: dir,
            limits: Limits {
                max_memory_mb: nonzero(limits.max_memory_mb),
                max_threads: (limits.max_threads > 0).then_some(limits.max_threads),
                max_download_bytes: nonzero(limits.max_download_bytes),
                time_limit_ms: nonzero(limits.time_limit_ms),
            },
            backend: match backend {
                CanopyBackend::CanopyBackendAuto => BackendPreference::Auto,
                CanopyBackend::CanopyBackendCpu => BackendPreference::Cpu,
                CanopyBackend::CanopyBackendGpu => BackendPreference::Gpu,
                CanopyBackend::CanopyBackendNpu => BackendPreference::Npu,
            },
            checkpoint_every_steps: 0,
            progress_interval_ms: crate::DEFAULT_PROGRESS_INTERVAL_MS,
            device_authority: authority,
        };
        let client = CanopyClient::new(config)?;
        // SAFETY: `out` is writable, as the caller promises.
        unsafe { put(out, Arc::into_raw(client).cast_mut(), "out") }
    })
}

/// Frees a client; NULL is ignored.
///
/// # Safety
/// `client` is NULL or from `canopy_client_new`, freed once, with no call
/// on it in progress.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn canopy_client_free(client: *mut CanopyClient) {
    if !client.is_null() {
        // SAFETY: from `Arc::into_raw` in `canopy_client_new`, freed once.
        drop(unsafe { Arc::from_raw(client.cast_const()) });
    }
}

/// Enrolls the device with an enrollment token; `*device_id` is its id.
///
/// # Safety
/// `client` is live; strings are NUL-terminated; `device_id` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn canopy_client_enroll(
    client: *const CanopyClient,
    token: *const c_char,
    os: *const c_char,
    memory_mb: u64,
    device_id: *mut i64,
) -> CanopyStatus {
    status(|| {
        // SAFETY: the caller's promises, forwarded.
        let (client, token, os) = unsafe {
            (
                self::client(client)?,
                text(token, "token")?,
                text(os, "os")?,
            )
        };
        let info = DeviceInfo {
            os,
            memory_mb,
            tags: Default::default(),
        };
        let enrolled = client.enroll(token, info)?;
        // SAFETY: writable, as the caller promises.
        unsafe { put(device_id, enrolled.device_id, "device_id") }
    })
}

/// Reports the device's state (and sends it in a heartbeat when enrolled).
///
/// # Safety
/// `client` is live; `conditions` is readable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn canopy_client_report_conditions(
    client: *const CanopyClient,
    conditions: *const CanopyConditions,
) -> CanopyStatus {
    status(|| {
        // SAFETY: the caller's promises, forwarded.
        let (client, conditions) = unsafe { (self::client(client)?, conditions.as_ref()) };
        let c = conditions.ok_or_else(|| null("conditions"))?;
        client.report_conditions(DeviceConditions {
            charging: c.charging,
            unmetered_network: c.unmetered_network,
            idle: c.idle,
            battery_percent: c.battery_percent,
        })
    })
}

/// Offers the server `samples` samples of `sample_shape` (`rank`
/// dimensions) as the dataset `name`, for jobs that name it
/// (`canopy job create --dataset NAME`); the same arrays as
/// `canopy_client_run_task`. Only their size, shape and classes are sent.
///
/// # Safety
/// `client` is live; `name` is NUL-terminated; each array holds the
/// values its length says.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn canopy_client_register_dataset(
    client: *const CanopyClient,
    name: *const c_char,
    features: *const f32,
    features_len: usize,
    sample_shape: *const u32,
    rank: usize,
    labels: *const i64,
    samples: usize,
    classes: u32,
) -> CanopyStatus {
    status(|| {
        // SAFETY: the caller's promises on every pointer, forwarded.
        let (client, name, data) = unsafe {
            (
                self::client(client)?,
                text(name, "name")?,
                arrays(
                    (features, features_len),
                    (sample_shape, rank),
                    (labels, samples),
                    classes,
                )?,
            )
        };
        client.register_dataset(name, data).map(drop)
    })
}

/// Waits up to `wait_ms` for a task; `*has_task` says whether `*task` was
/// filled.
///
/// # Safety
/// `client` is live; `task` and `has_task` are writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn canopy_client_check_for_task(
    client: *const CanopyClient,
    wait_ms: u64,
    task: *mut CanopyTaskInfo,
    has_task: *mut bool,
) -> CanopyStatus {
    status(|| {
        // SAFETY: the caller's promise, forwarded.
        let client = unsafe { self::client(client)? };
        let found = client.check_for_task(wait_ms)?;
        let info = found.as_ref().map(|t| CanopyTaskInfo {
            job_id: t.job_id,
            round_id: t.round_id,
            round_number: t.round_number,
            kind: match t.kind {
                TaskKind::Train => 0,
                TaskKind::Evaluate => 1,
                TaskKind::Statistics => 2,
            },
            epochs: t.epochs,
            batch_size: t.batch_size,
            learning_rate: t.learning_rate,
            model_size_bytes: t.model_size_bytes,
            deadline_unix_ms: t.deadline_unix_ms,
            secure: t.secure,
        });
        // SAFETY: writable, as the caller promises.
        unsafe {
            put(has_task, info.is_some(), "has_task")?;
            put(task, info.unwrap_or_default(), "task")
        }
    })
}

/// A C callback as a progress listener.
struct CProgress {
    callback: extern "C" fn(u64, u64, f64, *mut c_void),
    user_data: usize,
}

impl ProgressListener for CProgress {
    fn on_progress(&self, progress: TrainingProgress) {
        (self.callback)(
            progress.steps_done,
            progress.total_steps,
            progress.mean_loss,
            self.user_data as *mut c_void,
        );
    }
}

/// Runs the accepted task on `samples` samples: `features` holds
/// `samples` × the product of `sample_shape` (of `rank` dimensions)
/// floats, `labels` `samples` class indices below `classes`. `progress`
/// (optional) is called before each step, from the thread that trains, with
/// `user_data`; `cancel` (optional) stops the run, keeping its progress.
///
/// # Safety
/// `client` is live; each array holds the values its length says;
/// `cancel` is NULL or live; `outcome` is writable. `user_data` is only
/// passed back.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn canopy_client_run_task(
    client: *const CanopyClient,
    features: *const f32,
    features_len: usize,
    sample_shape: *const u32,
    rank: usize,
    labels: *const i64,
    samples: usize,
    classes: u32,
    progress: CanopyProgressFn,
    user_data: *mut c_void,
    cancel: *const CancelToken,
    outcome: *mut CanopyTaskOutcome,
) -> CanopyStatus {
    status(|| {
        // SAFETY: the caller's promises on every pointer, forwarded.
        let (client, data) = unsafe {
            (
                self::client(client)?,
                arrays(
                    (features, features_len),
                    (sample_shape, rank),
                    (labels, samples),
                    classes,
                )?,
            )
        };
        let listener = progress.map(|callback| -> Arc<dyn ProgressListener> {
            Arc::new(CProgress {
                callback,
                user_data: user_data as usize,
            })
        });
        let cancel = if cancel.is_null() {
            None
        } else {
            // SAFETY: a live token from `canopy_cancel_token_new`; the
            // count is raised so the caller keeps its own reference.
            unsafe {
                Arc::increment_strong_count(cancel);
                Some(Arc::from_raw(cancel))
            }
        };
        let done = client.run_task(data, listener, cancel)?;
        let summary = CanopyTaskOutcome {
            round_id: done.round_id,
            num_samples: done.num_samples,
            train_loss: done.train_loss.unwrap_or(f64::NAN),
            uploaded_bytes: done.uploaded_bytes,
            train_duration_ms: done.train_duration_ms,
            resumed_from_step: done.resumed_from_step,
            secure: done.secure,
        };
        // SAFETY: writable, as the caller promises.
        unsafe { put(outcome, summary, "outcome") }
    })
}

/// The client's status as a JSON object (`enrolled`, `device_id`,
/// `pending_task`, `last_outcome`, `datasets`, `last_check`, ...); free `*json` with
/// `canopy_string_free`.
///
/// # Safety
/// `client` is live; `json` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn canopy_client_status_json(
    client: *const CanopyClient,
    json: *mut *mut c_char,
) -> CanopyStatus {
    status(|| {
        // SAFETY: the caller's promise, forwarded.
        let client = unsafe { self::client(client)? };
        let status = client.status()?;
        let value = serde_json::json!({
            "enrolled": status.enrolled,
            "device_id": status.device_id,
            "device_key": status.device_key,
            "server_url": status.server_url,
            "backends": status.backends,
            "training_backend": status.training_backend,
            "pending_round_id": status.pending_task.as_ref().map(|t| t.round_id),
            "checkpointed_step": status.pending_task.and_then(|t| t.checkpointed_step),
            "last_outcome": status.last_outcome,
            "datasets": status.datasets.iter().map(|d| serde_json::json!({
                "name": d.name, "samples": d.samples,
                "sample_shape": d.sample_shape, "classes": d.classes,
            })).collect::<Vec<_>>(),
            "last_check": status.last_check,
        });
        // SAFETY: writable, as the caller promises.
        unsafe { put(json, c_string(&value.to_string()).into_raw(), "json") }
    })
}

/// Installs the device authority's certificate of this device (128 hex
/// digits), checked first against the pinned authority, if any.
///
/// # Safety
/// `client` is live; `certificate` is NUL-terminated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn canopy_client_install_certificate(
    client: *const CanopyClient,
    certificate: *const c_char,
) -> CanopyStatus {
    status(|| {
        // SAFETY: the caller's promises, forwarded.
        let (client, certificate) =
            unsafe { (self::client(client)?, text(certificate, "certificate")?) };
        client.install_certificate(certificate)
    })
}

/// Unenrolls: revokes the device's key on the server and wipes storage.
///
/// # Safety
/// `client` is live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn canopy_client_unenroll(client: *const CanopyClient) -> CanopyStatus {
    // SAFETY: the caller's promise, forwarded.
    status(|| unsafe { self::client(client)? }.unenroll())
}

/// A new cancel token, to pass to `canopy_client_run_task` and cancel
/// from any thread; free with `canopy_cancel_token_free`.
#[unsafe(no_mangle)]
pub extern "C" fn canopy_cancel_token_new() -> *mut CancelToken {
    Arc::into_raw(CancelToken::new()).cast_mut()
}

/// Cancels the runs observing `token`.
///
/// # Safety
/// `token` is NULL or live.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn canopy_cancel_token_cancel(token: *const CancelToken) {
    // SAFETY: NULL or a live token, as the caller promises.
    if let Some(token) = unsafe { token.as_ref() } {
        token.cancel();
    }
}

/// Frees a cancel token; NULL is ignored.
///
/// # Safety
/// `token` is NULL or from `canopy_cancel_token_new`, freed once.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn canopy_cancel_token_free(token: *mut CancelToken) {
    if !token.is_null() {
        // SAFETY: from `Arc::into_raw`, freed once.
        drop(unsafe { Arc::from_raw(token.cast_const()) });
    }
}
