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
use canopy_protocol::messages::{Capabilities, DeviceCertificate, Heartbeat, Task, Tier};
use canopy_protocol::model_sig::TrustedKeys;
use canopy_sdk::{BackendChoice, RetryPolicy, Transport, blocking};

use crate::error::{CanopyError, guard};
use crate::run::{self, RunContext};
use crate::storage::{Enrollment, Storage};
use crate::types::{
    BackendPreference, ClientConfig, ClientStatus, DeviceConditions, DeviceInfo, ProgressListener,
    TaskInfo, TaskOutcome, TrainingData, check_limits,
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

    /// Waits up to `wait_ms` (at most a minute) for a task. A task whose
    /// policy the device's state does not meet is given back to the
    /// server as ineligible (not a dropout) and `None` is returned; one
    /// over the device's download limit is declined with
    /// `OverLimit`. An accepted task is kept in storage until `run_task`
    /// finishes it, so it is returned again after a restart.
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
        Ok(CanopyClient {
            config,
            storage,
            transport,
            authority,
            conditions: Mutex::new(None),
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
        let beat = Heartbeat {
            state: Some("idle".to_string()),
            conditions: Some(reported),
            ..Heartbeat::default()
        };
        device.heartbeat(&beat)?;
        Ok(())
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
        let Some(task) = device.next_task(wait_ms)? else {
            return Ok(None);
        };
        let conditions = self.conditions().unwrap_or_default().to_protocol();
        if let Err(ineligible) = task.policy.check(&conditions) {
            device.withdraw_task(&task, &conditions)?;
            self.storage.save_outcome(&format!(
                "round {}: withdrew, not eligible: {ineligible}",
                task.round_id
            ))?;
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
/// the reason, where it does not open), or the best the device has.
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
