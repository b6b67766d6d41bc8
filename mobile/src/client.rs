//! `CanopyClient`: the one object an app holds.
//!
//! Every method is blocking (call it from a background thread, a
//! WorkManager worker, a `BGProcessingTask`), runs under
//! [`crate::error::guard`] so a panic comes back as an error, and keeps
//! what must outlive the process in the storage directory
//! ([`crate::storage`]). The network, signing, verification and training
//! are `canopy-sdk`'s; this layer adds what an app needs on top: the
//! device's state against the job's policy, limits, a storage directory,
//! and a task that survives the process.

use std::sync::{Arc, Mutex};

use canopy_protocol::auth::{self, DeviceKey};
use canopy_protocol::messages::{
    Capabilities, DatasetInfo, DeviceCertificate, Heartbeat, MAX_DATASETS, Task, Tier,
    check_dataset_name,
};
use canopy_protocol::model_sig::TrustedKeys;
use canopy_sdk::{BackendChoice, RetryPolicy, Transport, blocking};

use crate::error::{CanopyError, guard};
use crate::run::{self, RunContext};
use crate::storage::{Enrollment, Storage};
use crate::types::{
    BackendPreference, ClientConfig, ClientStatus, DatasetSummary, DeviceConditions, DeviceInfo,
    ProgressListener, TaskInfo, TaskOutcome, TrainingData, check_limits,
};

/// The longest `check_for_task` waits for the server, in milliseconds.
pub const MAX_TASK_WAIT_MS: u64 = 60_000;

/// A cancel signal for `run_task`: cancel it from any thread; the run
/// stops before its next step, keeping its progress.
#[derive(Debug, Default, uniffi::Object)]
pub struct CancelToken {
    pub(crate) inner: canopy_sdk::CancelToken,
}

#[uniffi::export]
impl CancelToken {
    #[uniffi::constructor]
    pub fn new() -> Arc<CancelToken> {
        Arc::new(CancelToken::default())
    }

    pub fn cancel(&self) {
        self.inner.cancel();
    }

    pub fn is_cancelled(&self) -> bool {
        self.inner.is_cancelled()
    }
}

/// What `enroll` registered.
#[derive(Clone, Debug, PartialEq, Eq, uniffi::Record)]
pub struct EnrollmentInfo {
    pub device_id: i64,
    /// The device's enrolled Ed25519 public key, 64 hex digits: with the
    /// id, what a device authority certifies.
    pub device_key: String,
    /// The backends reported to the server (`cpu`, `gpu`, `npu`).
    pub backends: Vec<String>,
}

/// The device's side of federated learning, for an app.
#[derive(Debug, uniffi::Object)]
pub struct CanopyClient {
    config: ClientConfig,
    storage: Storage,
    transport: Transport,
    /// `config.device_authority`, parsed once.
    authority: Option<[u8; 32]>,
    conditions: Mutex<Option<DeviceConditions>>,
    datasets: Mutex<DatasetOffer>,
    /// Why the last `check_for_task` found no task, for `status`.
    last_check: Mutex<Option<String>>,
}

/// The datasets this process offers the server, and whether the server
/// has heard of the latest list.
#[derive(Debug, Default)]
struct DatasetOffer {
    /// `None` until the app registers one: heartbeats then leave what the
    /// server knows alone (an earlier process's offer stands).
    offered: Option<Vec<DatasetInfo>>,
    sent: bool,
}

#[uniffi::export]
impl CanopyClient {
    /// Checks the settings and opens the storage directory; nothing is
    /// sent. An enrollment kept there is picked up.
    #[uniffi::constructor]
    pub fn new(config: ClientConfig) -> Result<Arc<CanopyClient>, CanopyError> {
        guard(|| CanopyClient::open(config).map(Arc::new))
    }

    /// Registers this device with an enrollment token from the server's
    /// operator, reporting `info` and the backends it can train on.
    pub fn enroll(&self, token: String, info: DeviceInfo) -> Result<EnrollmentInfo, CanopyError> {
        guard(|| self.enroll_inner(&token, info))
    }

    /// Tells the client (and, when enrolled, the server, in a heartbeat)
    /// the device's state; tasks are accepted only when it meets the
    /// job's policy. Until the app reports, the device counts as not
    /// charging, on a metered network, busy, at 0 %.
    pub fn report_conditions(&self, conditions: DeviceConditions) -> Result<(), CanopyError> {
        guard(|| self.report_conditions_inner(conditions))
    }

    /// Offers `data` to the server as the dataset `name` (1 to 64
    /// characters of `[A-Za-z0-9_.-]`): jobs that train on a named dataset
    /// (`canopy job create --dataset NAME`) select only devices that offer
    /// it. The data is read once, for its size, sample shape and classes
    /// (what the server is told; the samples stay on the device); the
    /// server hears now when the device is enrolled, else right after
    /// `enroll`. Registering a name again replaces it; at most 32.
    /// Registrations last as long as the client: register at every start.
    pub fn register_dataset(
        &self,
        name: String,
        data: TrainingData,
    ) -> Result<DatasetSummary, CanopyError> {
        guard(|| self.register_dataset_inner(&name, data))
    }

    /// Stops offering the dataset `name`, telling the server when
    /// enrolled; returns whether it was offered.
    pub fn forget_dataset(&self, name: String) -> Result<bool, CanopyError> {
        guard(|| self.forget_dataset_inner(&name))
    }

    /// Waits up to `wait_ms` (at most a minute) for a task. A task whose
    /// policy the device's state does not meet is given back to the
    /// server as ineligible (not a dropout) and `None` is returned; one
    /// over the device's download limit is declined with
    /// `OverLimit`. An accepted task is kept in storage until `run_task`
    /// finishes it, so it is returned again after a restart. When no task
    /// comes, `status().last_check` says why that may be (no dataset a job
    /// names, no reported conditions).
    pub fn check_for_task(&self, wait_ms: u64) -> Result<Option<TaskInfo>, CanopyError> {
        guard(|| self.check_for_task_inner(wait_ms))
    }

    /// Runs the accepted task on `data`: downloads and verifies the
    /// model, trains (resuming from a checkpoint of an interrupted run),
    /// and uploads the update, or evaluates and reports. Stops with
    /// `Cancelled` or `TimeLimit`, progress kept, or with `Ineligible`
    /// when the device's state no longer meets the policy; a later call
    /// resumes.
    pub fn run_task(
        &self,
        data: TrainingData,
        listener: Option<Arc<dyn ProgressListener>>,
        cancel: Option<Arc<CancelToken>>,
    ) -> Result<TaskOutcome, CanopyError> {
        guard(|| self.run_task_inner(data, listener, cancel))
    }

    /// What the client knows of itself, from storage; no network call.
    pub fn status(&self) -> Result<ClientStatus, CanopyError> {
        guard(|| self.status_inner())
    }

    /// Forgets the enrollment: tells the server to revoke the device's
    /// key, then deletes the key, the task and every file the client
    /// kept. The storage is wiped even when the server cannot be reached
    /// (the error is returned after).
    pub fn unenroll(&self) -> Result<(), CanopyError> {
        guard(|| self.unenroll_inner())
    }

    /// Hands the server the device authority's certificate of this
    /// device's id and enrolled key (128 hex digits), for it to relay to
    /// the device's neighbours in secure rounds. With `device_authority`
    /// set, the certificate is checked against it first. Call it once
    /// after `enroll`, with what the app's backend made of
    /// `EnrollmentInfo`'s `device_id` and `device_key`.
    pub fn install_certificate(&self, certificate: String) -> Result<(), CanopyError> {
        guard(|| self.install_certificate_inner(&certificate))
    }
}

impl CanopyClient {
    pub fn open(config: ClientConfig) -> Result<CanopyClient, CanopyError> {
        check_limits(&config.limits)?;
        let transport = Transport::new(&config.server_url, &config.trust.to_sdk())?;
        let authority = parse_authority(config.device_authority.as_deref())?;
        let storage = Storage::open(&config.storage_dir)?;
        if let Some(enrolled) = storage.enrollment()?
            && enrolled.server_url != config.server_url
        {
            return Err(CanopyError::config(format!(
                "the storage directory holds an enrollment with {}, not {}\nhint: use another \
                 storage directory per server, or unenroll first",
                enrolled.server_url, config.server_url
            )));
        }
        if config.backend == BackendPreference::Auto {
            // Decided (and logged) once, here, not at the first task.
            canopy_engine::select::auto_decision();
        }
        Ok(CanopyClient {
            config,
            storage,
            transport,
            authority,
            conditions: Mutex::new(None),
            datasets: Mutex::new(DatasetOffer::default()),
            last_check: Mutex::new(None),
        })
    }

    pub(crate) fn storage(&self) -> &Storage {
        &self.storage
    }

    pub(crate) fn config(&self) -> &ClientConfig {
        &self.config
    }

    fn conditions(&self) -> Option<DeviceConditions> {
        *self
            .conditions
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn offer(&self) -> std::sync::MutexGuard<'_, DatasetOffer> {
        self.datasets
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn set_last_check(&self, why: Option<String>) {
        *self
            .last_check
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = why;
    }

    /// Tells the server the device's state and the datasets it offers,
    /// as far as the app reported them.
    fn send_heartbeat(&self, device: &blocking::DeviceClient) -> Result<(), CanopyError> {
        let offered = self.offer().offered.clone();
        let beat = Heartbeat {
            state: Some("idle".to_string()),
            conditions: self.conditions().map(DeviceConditions::to_protocol),
            datasets: offered.clone(),
            ..Heartbeat::default()
        };
        device.heartbeat(&beat)?;
        let mut offer = self.offer();
        // Another thread may have changed the list meanwhile: only the
        // list sent counts as sent.
        if offer.offered == offered {
            offer.sent = true;
        }
        Ok(())
    }

    fn enrollment(&self) -> Result<Enrollment, CanopyError> {
        self.storage
            .enrollment()?
            .ok_or_else(|| CanopyError::NotEnrolled {
                message: "this device is not enrolled\nhint: call enroll with a token from the \
                      server's operator first"
                    .to_string(),
            })
    }

    /// A blocking device client for one call, observing `cancel`.
    pub(crate) fn device(
        &self,
        cancel: canopy_sdk::CancelToken,
    ) -> Result<(blocking::DeviceClient, Enrollment), CanopyError> {
        let enrollment = self.enrollment()?;
        let key = self.device_key()?;
        let mut client = canopy_sdk::DeviceClient::with_trusted_keys(
            self.transport.clone(),
            enrollment.device_id,
            key,
            enrollment.trusted_keys,
        )
        .with_retry_policy(RetryPolicy::default())
        .with_cancel_token(cancel);
        if let Some(authority) = self.authority {
            client = client.with_device_authority(authority);
        }
        Ok((blocking::DeviceClient::from_async(client)?, enrollment))
    }

    /// The key the device enrolled with, from the storage directory.
    fn device_key(&self) -> Result<DeviceKey, CanopyError> {
        canopy_sdk::load_device_key(&self.storage.key_path()).map_err(|error| {
            CanopyError::storage(crate::error::chain(
                &error,
                Some("the device key is gone or damaged; unenroll and enroll again"),
            ))
        })
    }

    /// Keeps a model-signing key the server rotated to.
    pub(crate) fn persist_trust(
        &self,
        enrollment: &Enrollment,
        trusted: TrustedKeys,
    ) -> Result<(), CanopyError> {
        if trusted == enrollment.trusted_keys {
            return Ok(());
        }
        let mut updated = enrollment.clone();
        updated.trusted_keys = trusted;
        self.storage.save_enrollment(&updated)
    }

    fn enroll_inner(&self, token: &str, info: DeviceInfo) -> Result<EnrollmentInfo, CanopyError> {
        if let Some(enrolled) = self.storage.enrollment()? {
            return Err(CanopyError::AlreadyEnrolled {
                message: format!(
                    "this device is already enrolled as device {} with {}\nhint: unenroll first \
                     to enroll again",
                    enrolled.device_id, enrolled.server_url
                ),
            });
        }
        let backends = reported_backends(self.config.backend)?;
        let capabilities = Capabilities {
            tier: Tier::End,
            gpu: backends
                .iter()
                .any(|b| b == "gpu")
                .then(canopy_sdk::gpu_adapter)
                .flatten(),
            backends: backends.clone(),
            memory_mb: info.memory_mb,
            os: info.os,
            tags: info.tags.into_iter().collect(),
        };
        let key = DeviceKey::generate();
        let policy = RetryPolicy::default();
        let cancel = canopy_sdk::CancelToken::new();
        let enrolled =
            blocking::enroll_with(&self.transport, token, &key, capabilities, &policy, &cancel)?;
        let server_key =
            auth::parse_public_key_hex(&enrolled.server_public_key).map_err(|error| {
                CanopyError::BadResponse {
                    message: format!("the server's model-signing key is unreadable: {error}"),
                }
            })?;
        canopy_sdk::save_device_key(&self.storage.key_path(), &key)
            .map_err(|error| CanopyError::storage(crate::error::chain(&error, None)))?;
        let enrollment = Enrollment::new(
            &self.config.server_url,
            enrolled.device_id,
            TrustedKeys::new(server_key),
            backends.clone(),
        );
        self.storage.save_enrollment(&enrollment)?;
        if self.offer().offered.is_some() {
            // The enrollment stands either way; `check_for_task` offers
            // the datasets again if this does not get through.
            let (device, _) = self.device(canopy_sdk::CancelToken::new())?;
            if let Err(error) = self.send_heartbeat(&device) {
                tracing::warn!(error = %error, "cannot offer the datasets after enrolling");
            }
        }
        Ok(EnrollmentInfo {
            device_id: enrolled.device_id,
            device_key: hex::encode(key.public_key()),
            backends,
        })
    }

    fn report_conditions_inner(&self, conditions: DeviceConditions) -> Result<(), CanopyError> {
        let reported = conditions.to_protocol();
        reported.validate().map_err(|reason| {
            CanopyError::config(format!("the device conditions are invalid: {reason}"))
        })?;
        *self
            .conditions
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(conditions);
        if self.storage.enrollment()?.is_none() {
            return Ok(());
        }
        let (device, _) = self.device(canopy_sdk::CancelToken::new())?;
        self.send_heartbeat(&device)
    }

    fn register_dataset_inner(
        &self,
        name: &str,
        data: TrainingData,
    ) -> Result<DatasetSummary, CanopyError> {
        let refused = |reason: String| {
            CanopyError::data(format!(
                "{reason}\nhint: name it as the job does (`canopy job create --dataset NAME`)"
            ))
        };
        // Before reading what may be a large file.
        check_dataset_name("the dataset name", name).map_err(refused)?;
        let dataset = crate::data::load(data)?;
        let info = canopy_sdk::describe_dataset(name, &dataset)
            .map_err(|error| refused(crate::error::chain(&error, None)))?;
        {
            let mut offer = self.offer();
            let offered = offer.offered.get_or_insert_with(Vec::new);
            if let Some(known) = offered.iter_mut().find(|known| known.name == name) {
                *known = info.clone();
            } else if offered.len() >= MAX_DATASETS {
                return Err(CanopyError::config(format!(
                    "the client offers {MAX_DATASETS} datasets already, the protocol's limit, \
                     so it cannot offer `{name}`\nhint: forget_dataset one first"
                )));
            } else {
                offered.push(info.clone());
            }
            offer.sent = false;
        }
        self.tell_server()?;
        Ok(DatasetSummary::from_protocol(info))
    }

    fn forget_dataset_inner(&self, name: &str) -> Result<bool, CanopyError> {
        let removed = {
            let mut offer = self.offer();
            let offered = offer.offered.get_or_insert_with(Vec::new);
            let before = offered.len();
            offered.retain(|known| known.name != name);
            let removed = offered.len() != before;
            offer.sent &= !removed;
            removed
        };
        if removed {
            self.tell_server()?;
        }
        Ok(removed)
    }

    /// A heartbeat now when enrolled; otherwise `enroll` sends it.
    fn tell_server(&self) -> Result<(), CanopyError> {
        if self.storage.enrollment()?.is_none() {
            return Ok(());
        }
        let (device, _) = self.device(canopy_sdk::CancelToken::new())?;
        self.send_heartbeat(&device)
    }

    fn check_for_task_inner(&self, wait_ms: u64) -> Result<Option<TaskInfo>, CanopyError> {
        if wait_ms > MAX_TASK_WAIT_MS {
            return Err(CanopyError::config(format!(
                "wait_ms is {wait_ms}, over the limit of {MAX_TASK_WAIT_MS}\nhint: call \
                 check_for_task again to wait longer"
            )));
        }
        let (device, _) = self.device(canopy_sdk::CancelToken::new())?;
        if let Some(task) = self.storage.task()? {
            if !run::past_deadline(&task) {
                return Ok(Some(self.task_info(&task)));
            }
            self.storage.clear_task()?;
            self.storage.save_outcome(&format!(
                "round {}: its deadline passed before it ran",
                task.round_id
            ))?;
        }
        let unsent = {
            let offer = self.offer();
            !offer.sent && offer.offered.is_some()
        };
        if unsent {
            self.send_heartbeat(&device)?;
        }
        let Some(task) = poll_until(&device, wait_ms)? else {
            let why = self.why_no_task(wait_ms);
            tracing::info!(wait_ms, "no task: {why}");
            self.set_last_check(Some(why));
            return Ok(None);
        };
        self.set_last_check(None);
        let conditions = self.conditions().unwrap_or_default().to_protocol();
        if let Err(ineligible) = task.policy.check(&conditions) {
            device.withdraw_task(&task, &conditions)?;
            let why = format!(
                "round {}: withdrew, not eligible: {ineligible}",
                task.round_id
            );
            self.storage.save_outcome(&why)?;
            self.set_last_check(Some(format!(
                "{why}\nhint: report_conditions when the device's state meets the job's policy"
            )));
            return Ok(None);
        }
        if let Some(refusal) = self.config.limits.to_sdk().refusal(&task, 0) {
            device.decline_task(&task, &refusal.to_string())?;
            self.storage
                .save_outcome(&format!("round {}: declined: {refusal}", task.round_id))?;
            return Err(CanopyError::OverLimit {
                message: format!("{refusal}\nhint: raise the client's limits to take such tasks"),
            });
        }
        self.storage.save_task(&task)?;
        Ok(Some(self.task_info(&task)))
    }

    /// What a poll that brought no task may mean, from what this client
    /// told the server: the server does not say why it selects a device
    /// or not (`canopy job show` does, to the job's owner).
    fn why_no_task(&self, wait_ms: u64) -> String {
        let mut why = format!(
            "no task came within {wait_ms} ms: no running job's round selected this device"
        );
        let offered = self.offer().offered.clone().unwrap_or_default();
        if offered.is_empty() {
            why.push_str(
                ". It offers no dataset, so jobs that train on a named one (`canopy job create \
                 --dataset NAME`) never select it",
            );
        } else {
            let names: Vec<String> = offered.iter().map(describe_offer).collect();
            why.push_str(&format!(
                ". It offers {}; jobs that name another dataset, or whose model takes other \
                 samples, do not select it",
                names.join(", ")
            ));
        }
        if self.conditions().is_none() {
            why.push_str(
                ". It has not reported its state (report_conditions), so it counts as not \
                 charging, on a metered network, busy, at 0 %, which a job's device policy may \
                 exclude",
            );
        }
        why.push_str(if offered.is_empty() {
            "\nhint: register_dataset(NAME, data) with the dataset the job names"
        } else {
            "\nhint: `canopy job ls` lists the running jobs, and `canopy job show ID` why a \
             round waits for devices"
        });
        why
    }

    fn task_info(&self, task: &Task) -> TaskInfo {
        run::task_info(task, run::checkpointed_step(&self.storage, task))
    }

    fn run_task_inner(
        &self,
        data: TrainingData,
        listener: Option<Arc<dyn ProgressListener>>,
        cancel: Option<Arc<CancelToken>>,
    ) -> Result<TaskOutcome, CanopyError> {
        let task = self.storage.task()?.ok_or_else(|| CanopyError::NoTask {
            message: "there is no accepted task to run\nhint: call check_for_task first; it \
                      returns the task to run"
                .to_string(),
        })?;
        let conditions = self.conditions().unwrap_or_default().to_protocol();
        if let Err(ineligible) = task.policy.check(&conditions) {
            return Err(CanopyError::Ineligible {
                message: format!(
                    "round {}'s task waits: {ineligible}\nhint: run it when the device's state \
                     meets the job's policy again (the task is kept until its deadline)",
                    task.round_id
                ),
            });
        }
        let context = RunContext {
            client: self,
            task: &task,
            listener,
            cancel: cancel.map(|token| token.inner.clone()),
        };
        run::run(context, data)
    }

    fn status_inner(&self) -> Result<ClientStatus, CanopyError> {
        let enrollment = self.storage.enrollment()?;
        let pending_task = self.storage.task()?.map(|task| self.task_info(&task));
        let device_key = match enrollment {
            Some(_) => Some(hex::encode(self.device_key()?.public_key())),
            None => None,
        };
        Ok(ClientStatus {
            enrolled: enrollment.is_some(),
            device_id: enrollment.as_ref().map(|e| e.device_id),
            device_key,
            server_url: self.config.server_url.clone(),
            backends: enrollment.map(|e| e.backends).unwrap_or_default(),
            training_backend: self.training_backend().kind().to_string(),
            pending_task,
            conditions: self.conditions(),
            last_outcome: self.storage.last_outcome()?,
            datasets: self
                .offer()
                .offered
                .iter()
                .flatten()
                .cloned()
                .map(DatasetSummary::from_protocol)
                .collect(),
            last_check: self
                .last_check
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .clone(),
        })
    }

    fn unenroll_inner(&self) -> Result<(), CanopyError> {
        let told = match self.device(canopy_sdk::CancelToken::new()) {
            Ok((device, _)) => device.unenroll().map_err(CanopyError::from),
            Err(error @ CanopyError::NotEnrolled { .. }) => Err(error),
            Err(other) => Err(other),
        };
        self.storage.wipe()?;
        match told {
            Err(CanopyError::NotEnrolled { .. }) => Ok(()),
            other => other,
        }
    }

    fn install_certificate_inner(&self, certificate: &str) -> Result<(), CanopyError> {
        let body = DeviceCertificate {
            certificate: certificate.trim().to_string(),
        };
        let certificate = body.bytes().map_err(|cause| {
            CanopyError::config(format!(
                "the certificate is not a device certificate: {cause}\nhint: pass the 128 hex \
                 digits the device authority made (`canopy authority certify` prints them)"
            ))
        })?;
        let (device, _) = self.device(canopy_sdk::CancelToken::new())?;
        device.install_certificate(&certificate)?;
        Ok(())
    }

    /// The backend tasks train on: the pinned one, or the best the device
    /// has.
    pub(crate) fn training_backend(&self) -> BackendChoice {
        backend_choice(self.config.backend)
    }
}

/// A pause between polls that the server answered before `wait_ms`
/// was up, so a server that answers at once (shutting down) is not
/// polled in a loop.
const REPOLL_PAUSE: std::time::Duration = std::time::Duration::from_millis(500);

/// Polls until a task comes or `wait_ms` is up: the server answers a
/// poll with nothing after its own `long_poll_max_ms` (30 s by default),
/// which may be shorter.
fn poll_until(device: &blocking::DeviceClient, wait_ms: u64) -> Result<Option<Task>, CanopyError> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_millis(wait_ms);
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if let Some(task) = device.next_task(left.as_millis() as u64)? {
            return Ok(Some(task));
        }
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Ok(None);
        }
        std::thread::sleep(left.min(REPOLL_PAUSE));
    }
}

/// `digits (1455 samples of [64], 10 classes)`.
fn describe_offer(info: &DatasetInfo) -> String {
    format!(
        "`{}` ({} samples of {:?}, {} classes)",
        info.name, info.samples, info.sample_shape, info.classes
    )
}

/// The device authority's public key from its 64 hex digits.
fn parse_authority(hex: Option<&str>) -> Result<Option<[u8; 32]>, CanopyError> {
    hex.map(|hex| {
        auth::parse_public_key_hex(hex.trim()).map_err(|cause| {
            CanopyError::config(format!(
                "device_authority is not an Ed25519 public key: {cause}\nhint: give the 64 hex \
                 digits `canopy authority new` printed, or leave it unset to take neighbours' \
                 keys on the server's word"
            ))
        })
    })
    .transpose()
}

/// The engine backend for a preference: the pinned one (the CPU, with
/// the reason, where it does not open), or the best the device has: an
/// NPU where ONNX Runtime opens, else the engine's `auto` (a hardware GPU,
/// never a software one, else the CPU), as `available_backends` offers.
pub(crate) fn backend_choice(preference: BackendPreference) -> BackendChoice {
    match preference {
        BackendPreference::Cpu => BackendChoice::cpu(),
        BackendPreference::Gpu => BackendChoice::gpu(),
        BackendPreference::Npu => BackendChoice::npu(),
        BackendPreference::Auto => canopy_sdk::choose_backend(&Capabilities {
            tier: Tier::End,
            backends: canopy_sdk::available_backends(),
            memory_mb: 0,
            os: String::new(),
            tags: Default::default(),
            gpu: None,
        }),
    }
}

/// The backends to report at enrollment: what the device has, or the
/// pinned one, which must be there.
fn reported_backends(preference: BackendPreference) -> Result<Vec<String>, CanopyError> {
    use canopy_sdk::BackendKind;
    let pinned = match preference {
        BackendPreference::Auto => return Ok(canopy_sdk::available_backends()),
        BackendPreference::Cpu => BackendKind::Cpu,
        BackendPreference::Gpu => BackendKind::Gpu,
        BackendPreference::Npu => BackendKind::Npu,
    };
    if !pinned.is_available() {
        return Err(CanopyError::config(format!(
            "the client is pinned to the {pinned} backend, which does not open on this device\n\
             hint: use BackendPreference.Auto to train on the best backend the device has"
        )));
    }
    Ok(vec![pinned.as_str().to_string()])
}
