//! The device client: enrollment, the client's settings (retry policy,
//! cancel token, trusted model-signing keys), polls, heartbeats, uploads,
//! metrics, declines and withdrawals. Request signing is in `signing`,
//! model downloads and their verification in `download`; the connection
//! is [`crate::transport`].

mod download;
mod signing;

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use canopy_protocol::auth::{self, DeviceKey};
use canopy_protocol::device_cert::{self, Certificate, KeyTrust};
use canopy_protocol::messages::{
    CERTIFICATE_PATH, Capabilities, DatasetInfo, DeviceCertificate, DeviceConditions, DeviceRole,
    ERROR_ALREADY_WITHDRAWN, EnrollRequest, EnrollResponse, Heartbeat, HeartbeatResponse,
    MAX_DECLINE_REASON_CHARS, RoundMetrics, SubRoundReport, Task, UploadReceipt, WithdrawTask,
    check_dataset_name,
};
use canopy_protocol::model_sig::TrustedKeys;
use reqwest::{Method, StatusCode};

pub use download::{DownloadedModel, MAX_MODEL_BYTES, MAX_SIGNING_KEYS_BYTES};

use crate::cancel::CancelToken;
use crate::error::SdkError;
use crate::retry::{self, RetryObserver, RetryPolicy};
use crate::transport::{Transport, check, json};

/// Enrolls a device key with an enrollment token.
pub async fn enroll(
    transport: &Transport,
    enrollment_token: &str,
    key: &DeviceKey,
    capabilities: Capabilities,
) -> Result<EnrollResponse, SdkError> {
    enroll_as(
        transport,
        enrollment_token,
        key,
        capabilities,
        DeviceRole::Device,
    )
    .await
}

/// [`enroll`] in a role: an edge aggregator enrolls as
/// [`DeviceRole::Aggregator`], with a token made for that role.
pub async fn enroll_as(
    transport: &Transport,
    enrollment_token: &str,
    key: &DeviceKey,
    capabilities: Capabilities,
    role: DeviceRole,
) -> Result<EnrollResponse, SdkError> {
    let url = transport.url("/device/v1/enroll");
    let request = EnrollRequest {
        enrollment_token: enrollment_token.to_string(),
        public_key: key.public_key_hex(),
        capabilities,
        role,
    };
    let response = transport
        .http()
        .post(&url)
        .json(&request)
        .send()
        .await
        .map_err(|source| SdkError::Transport { url, source })?;
    json(check(response).await?, "enrollment answer").await
}

/// [`enroll`] that retries under `policy`, but only failures that show the
/// server did not act on the request: the connection could not be opened,
/// or the server answered 429 or 503 before doing anything. Enrollment is
/// not idempotent (a second try with the same key answers 409 and its
/// device id is lost), so a request that may have been carried out is
/// never repeated. Every attempt and wait races `cancel`.
pub async fn enroll_with(
    transport: &Transport,
    enrollment_token: &str,
    key: &DeviceKey,
    capabilities: Capabilities,
    policy: &RetryPolicy,
    cancel: &CancelToken,
) -> Result<EnrollResponse, SdkError> {
    let policy = policy.normalized();
    let mut failures = 0;
    loop {
        let attempt = enroll(transport, enrollment_token, key, capabilities.clone());
        let error = match cancel.run(attempt).await {
            None => return Err(SdkError::Cancelled),
            Some(Ok(enrolled)) => return Ok(enrolled),
            Some(Err(error)) => error,
        };
        failures += 1;
        if !error.is_retryable()
            || error.may_have_been_processed()
            || failures >= policy.max_attempts
        {
            return Err(error);
        }
        retry::sleep(cancel, policy.wait_after(failures - 1, &error)).await?;
    }
}

/// An enrolled device: signs every request with its key.
///
/// The client holds a [`RetryPolicy`] (none by default: one attempt) and a
/// [`CancelToken`] (never cancelled by default) that `next_task`,
/// `download_model`, `download_model_to`, `upload_update`, `heartbeat`,
/// `report_metrics` and the secure-aggregation calls ([`crate::secure`])
/// observe; see [`crate::retry`] for what is retried.
/// `signed` and `send_signed` are single raw requests and observe neither.
/// Clones share the connection pool, the policy is copied, and the token
/// is shared (cancelling it cancels every clone's work).
///
/// Models are verified under the client's [`TrustedKeys`]. A download
/// signed by a key the device does not trust yet makes the client fetch
/// the server's endorsement chain and follow it (see
/// [`TrustedKeys::advance`]); the trust moves only along a valid chain from
/// the key it held. Clones share the trust. Persist
/// [`DeviceClient::trusted_keys`] after a task and construct with
/// [`DeviceClient::with_trusted_keys`], or a restarted device falls back to
/// its enrollment key.
#[derive(Clone, Debug)]
pub struct DeviceClient {
    pub transport: Transport,
    pub device_id: i64,
    key: DeviceKey,
    trust: Arc<Mutex<TrustedKeys>>,
    /// Whose word secure rounds take on neighbours' enrolled keys.
    key_trust: KeyTrust,
    retry: RetryPolicy,
    cancel: CancelToken,
    observer: Observer,
}

/// The client's [`RetryObserver`], if any; printed as whether there is one.
#[derive(Clone, Default)]
struct Observer(Option<RetryObserver>);

impl std::fmt::Debug for Observer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Observer({})",
            if self.0.is_some() { "set" } else { "none" }
        )
    }
}

impl DeviceClient {
    pub fn new(
        transport: Transport,
        device_id: i64,
        key: DeviceKey,
        server_public_key_hex: &str,
    ) -> Result<DeviceClient, SdkError> {
        let server_public_key =
            auth::parse_public_key_hex(server_public_key_hex).map_err(|error| {
                SdkError::BadResponse {
                    what: "server public key",
                    reason: error.to_string(),
                }
            })?;
        Ok(DeviceClient::with_trusted_keys(
            transport,
            device_id,
            key,
            TrustedKeys::new(server_public_key),
        ))
    }

    /// A client that trusts `trusted` for model signatures, e.g. as
    /// persisted from [`DeviceClient::trusted_keys`].
    pub fn with_trusted_keys(
        transport: Transport,
        device_id: i64,
        key: DeviceKey,
        trusted: TrustedKeys,
    ) -> DeviceClient {
        DeviceClient {
            transport,
            device_id,
            key,
            trust: Arc::new(Mutex::new(trusted)),
            key_trust: KeyTrust::Server,
            retry: RetryPolicy::none(),
            cancel: CancelToken::new(),
            observer: Observer::default(),
        }
    }

    /// The client pinning a device authority (its Ed25519 public key): in
    /// secure rounds it takes a neighbour's enrolled key only with the
    /// authority's certificate, so that a server cannot substitute keys
    /// (see [`canopy_protocol::device_cert`]). Install this device's own
    /// certificate with [`DeviceClient::install_certificate`].
    pub fn with_device_authority(mut self, authority: [u8; 32]) -> DeviceClient {
        self.key_trust = KeyTrust::Authority(authority);
        self
    }

    pub fn key_trust(&self) -> KeyTrust {
        self.key_trust
    }

    /// Hands the server the device authority's certificate of this
    /// device's id and key, to relay to its neighbours in secure rounds.
    /// Checked first against the pinned authority, if there is one.
    pub async fn install_certificate(&self, certificate: &Certificate) -> Result<(), SdkError> {
        if let KeyTrust::Authority(authority) = self.key_trust {
            let device_id = self.device_id;
            let id = u64::try_from(device_id).unwrap_or(u64::MAX);
            device_cert::verify(&authority, id, &self.key.public_key(), certificate)
                .map_err(|source| SdkError::Certificate { device_id, source })?;
        }
        let body = DeviceCertificate::new(certificate);
        self.retrying(|| async {
            self.signed_json(CERTIFICATE_PATH, "certificate", &body)
                .await?;
            Ok(())
        })
        .await
    }

    /// The client with this retry policy; e.g. `RetryPolicy::default()`.
    pub fn with_retry_policy(mut self, policy: RetryPolicy) -> DeviceClient {
        self.retry = policy;
        self
    }

    pub fn set_retry_policy(&mut self, policy: RetryPolicy) {
        self.retry = policy;
    }

    pub fn retry_policy(&self) -> &RetryPolicy {
        &self.retry
    }

    /// The client telling `observer` of every retry of its calls, before
    /// the wait (e.g. to log it). Clones share it.
    pub fn with_retry_observer(mut self, observer: RetryObserver) -> DeviceClient {
        self.observer = Observer(Some(observer));
        self
    }

    /// Runs `attempt` under the client's policy, token and observer.
    pub(crate) async fn retrying<T, F, Fut>(&self, attempt: F) -> Result<T, SdkError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, SdkError>>,
    {
        retry::retrying_observed(&self.retry, &self.cancel, self.observer.0.as_ref(), attempt).await
    }

    /// Waits before the retry that follows `failures` failed attempts of a
    /// call of this client's own loop, telling the observer first.
    pub(crate) async fn wait_to_retry(
        &self,
        policy: &RetryPolicy,
        failures: u32,
        error: &SdkError,
    ) -> Result<(), SdkError> {
        retry::wait_to_retry(
            policy,
            &self.cancel,
            self.observer.0.as_ref(),
            failures,
            error,
        )
        .await
    }

    /// The client observing `token`: cancelling it (or any clone of it)
    /// makes the operation in progress, and every later one, return
    /// [`SdkError::Cancelled`].
    pub fn with_cancel_token(mut self, token: CancelToken) -> DeviceClient {
        self.cancel = token;
        self
    }

    /// Replaces the token, e.g. with a fresh one after a cancellation.
    pub fn set_cancel_token(&mut self, token: CancelToken) {
        self.cancel = token;
    }

    pub fn cancel_token(&self) -> &CancelToken {
        &self.cancel
    }

    /// The model-signing key the device trusts now: the one given at
    /// construction until a rotation was followed.
    pub fn server_public_key(&self) -> [u8; 32] {
        self.trusted_keys().current()
    }

    /// What the device trusts to sign models; persist it when it changes.
    pub fn trusted_keys(&self) -> TrustedKeys {
        // The lock only guards a `Copy` value, so a poisoned one is whole.
        *self
            .trust
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Moves the trust from `from` to `to`, unless another call moved it
    /// meanwhile (that call followed a valid chain too).
    fn advance_trust(&self, from: TrustedKeys, to: TrustedKeys) {
        let mut trust = self
            .trust
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if *trust == from {
            *trust = to;
        }
    }

    /// Swaps the connection, e.g. after the server restarted.
    pub fn set_transport(&mut self, transport: Transport) {
        self.transport = transport;
    }

    pub fn key(&self) -> &DeviceKey {
        &self.key
    }

    pub async fn heartbeat(&self, beat: &Heartbeat) -> Result<HeartbeatResponse, SdkError> {
        self.retrying(|| async {
            json(
                self.signed_json("/device/v1/heartbeat", "heartbeat", beat)
                    .await?,
                "heartbeat answer",
            )
            .await
        })
        .await
    }

    /// Waits up to `wait_ms` for a task; `None` when there is none.
    /// Repeating a poll is safe: the server hands a device its task again
    /// until the device uploads.
    pub async fn next_task(&self, wait_ms: u64) -> Result<Option<Task>, SdkError> {
        let path = format!("/device/v1/tasks/next?wait_ms={wait_ms}");
        self.retrying(|| async {
            let response = check(self.signed(Method::GET, &path, Bytes::new()).await?).await?;
            if response.status() == StatusCode::NO_CONTENT {
                return Ok(None);
            }
            json(response, "task").await.map(Some)
        })
        .await
    }

    /// Uploads an update, retrying under the client's policy.
    ///
    /// When a retry is answered 409 and an earlier attempt of this call may
    /// have reached the server (see [`crate::retry`]), the earlier attempt
    /// was folded in, and this returns a receipt built locally:
    /// `accepted: true`, the task's round, `num_samples` from the update's
    /// header and `bytes` its length. A 409 on the first attempt is an
    /// error: the device had uploaded before this call. After
    /// [`SdkError::Cancelled`] or another error the update may or may not
    /// have been accepted; a later upload answering 409 says it was.
    pub async fn upload_update(
        &self,
        task: &Task,
        encoded: Bytes,
    ) -> Result<UploadReceipt, SdkError> {
        let policy = self.retry.normalized();
        let mut failures = 0u32;
        let mut maybe_delivered = false;
        loop {
            let attempt = async {
                let response = check(
                    self.signed(Method::PUT, &task.upload_path, encoded.clone())
                        .await?,
                )
                .await?;
                json::<UploadReceipt>(response, "upload receipt").await
            };
            let error = match self.cancel.run(attempt).await {
                None => return Err(SdkError::Cancelled),
                Some(Ok(receipt)) => return Ok(receipt),
                Some(Err(error)) => error,
            };
            if maybe_delivered && error.status() == Some(409) {
                return Ok(UploadReceipt {
                    round_id: task.round_id,
                    accepted: true,
                    num_samples: encoded_samples(&encoded),
                    bytes: encoded.len() as u64,
                });
            }
            failures += 1;
            maybe_delivered |= error.may_have_been_processed();
            if !error.is_retryable() || failures >= policy.max_attempts {
                return Err(error);
            }
            self.wait_to_retry(&policy, failures, &error).await?;
        }
    }

    pub async fn report_metrics(&self, metrics: &RoundMetrics) -> Result<(), SdkError> {
        let path = format!("/device/v1/rounds/{}/metrics", metrics.round_id);
        self.retrying(|| async {
            self.signed_json(&path, "round metrics", metrics).await?;
            Ok(())
        })
        .await
    }

    /// An aggregator's account of its sub-round, for the cloud's round tree.
    pub async fn report_sub_round(&self, report: &SubRoundReport) -> Result<(), SdkError> {
        let path = format!("/device/v1/rounds/{}/sub-round", report.round_id);
        self.retrying(|| async {
            self.signed_json(&path, "sub-round report", report).await?;
            Ok(())
        })
        .await
    }

    /// Gives up a task this device cannot do, with a reason the server
    /// logs; the server stops handing it out and counts a dropout at once.
    pub async fn decline_task(&self, task: &Task, reason: &str) -> Result<(), SdkError> {
        let decline = canopy_protocol::messages::DeclineTask {
            round_id: task.round_id,
            reason: reason
                .chars()
                .take(canopy_protocol::messages::MAX_DECLINE_REASON_CHARS)
                .collect(),
        };
        // Training and evaluation tasks are declined at their own paths.
        let path = canopy_protocol::messages::task_paths::decline(task);
        self.retrying(|| async {
            self.signed_json(&path, "decline", &decline).await?;
            Ok(())
        })
        .await
    }

    /// Ends this device's enrollment: the server revokes its key, so no
    /// request signed with it is accepted again and it is never selected.
    /// One attempt, no retry: a repeat after a lost answer would be
    /// refused with the key already revoked.
    pub async fn unenroll(&self) -> Result<(), SdkError> {
        let attempt = async {
            self.signed_json(
                canopy_protocol::messages::UNENROLL_PATH,
                "unenroll",
                &serde_json::json!({}),
            )
            .await?;
            Ok(())
        };
        self.cancel
            .run(attempt)
            .await
            .unwrap_or(Err(SdkError::Cancelled))
    }

    /// Gives up a task because this device no longer meets the job's
    /// device policy ([`Task::policy`]; check it with
    /// [`DevicePolicy::check`]): the server records the device as
    /// `ineligible`, which is not a dropout, once it has checked that
    /// `conditions` violate the policy. A device whose conditions meet the
    /// policy is refused (422): it must do the task, or decline it.
    /// Retried under the client's policy; a 409 `already_withdrawn` (an
    /// earlier attempt got through before its answer was lost, or the
    /// device withdrew before) counts as done. Any other 409 (the device
    /// already uploaded) or a 410 (its task is over) is an error.
    ///
    /// [`DevicePolicy::check`]: canopy_protocol::messages::DevicePolicy::check
    pub async fn withdraw_task(
        &self,
        task: &Task,
        conditions: &DeviceConditions,
    ) -> Result<(), SdkError> {
        let reason = match task.policy.check(conditions) {
            Err(ineligible) => ineligible.to_string(),
            Ok(()) => String::new(),
        };
        let withdrawal = WithdrawTask {
            round_id: task.round_id,
            conditions: *conditions,
            reason: reason.chars().take(MAX_DECLINE_REASON_CHARS).collect(),
        };
        // Training and evaluation tasks are withdrawn at their own paths.
        let path = canopy_protocol::messages::task_paths::withdraw(task);
        let sent = self
            .retrying(|| async {
                self.signed_json(&path, "withdrawal", &withdrawal).await?;
                Ok(())
            })
            .await;
        match sent {
            Err(SdkError::Server {
                status: 409, code, ..
            }) if code == ERROR_ALREADY_WITHDRAWN => Ok(()),
            other => other,
        }
    }

    /// Sends the answer to an evaluation task ([`TaskKind::Evaluate`]):
    /// the task's model evaluated on this device's held-out data. A 409
    /// means the server already holds this device's report (an earlier
    /// attempt got through before its answer was lost), so it counts as
    /// sent.
    ///
    /// [`TaskKind::Evaluate`]: canopy_protocol::messages::TaskKind::Evaluate
    pub async fn report_evaluation(
        &self,
        task: &Task,
        evaluation: &crate::train::Evaluation,
    ) -> Result<(), SdkError> {
        let report = canopy_protocol::messages::EvaluationReport {
            round_id: task.round_id,
            loss: evaluation.loss,
            accuracy: evaluation.accuracy,
            samples: evaluation.samples,
        };
        report
            .validate()
            .map_err(|reason| SdkError::InvalidEvaluation {
                round_id: task.round_id,
                reason,
            })?;
        let path = canopy_protocol::messages::task_paths::upload(task.kind, task.round_id);
        let sent = self
            .retrying(|| async {
                self.signed_json(&path, "evaluation", &report).await?;
                Ok(())
            })
            .await;
        match sent {
            Err(error) if error.status() == Some(409) => Ok(()),
            other => other,
        }
    }
}

/// Refuses a task outside the bounds every device checks, before anything
/// is downloaded, exchanged or trained (see [`SdkError::InvalidTask`]).
pub(crate) fn validate_task(task: &Task) -> Result<(), SdkError> {
    task.validate().map_err(|source| SdkError::InvalidTask {
        round_id: task.round_id,
        source,
    })
}

/// A dataset a device holds could not be offered to the server.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot offer the dataset to the server: {reason}")]
pub struct UnofferableDataset {
    /// The protocol's rule it breaks, with the limit.
    pub reason: String,
}

/// What a heartbeat says of a dataset the device holds (its name, size,
/// sample shape and classes; never a sample), for
/// [`Heartbeat::datasets`]: jobs that name a dataset
/// (`canopy job create --dataset NAME`) select only devices that offer
/// it with samples the model takes. The name and the sizes are checked
/// against the protocol's limits here, so the server does not refuse the
/// heartbeat for them.
pub fn describe_dataset(
    name: &str,
    data: &canopy_engine::data::Dataset,
) -> Result<DatasetInfo, UnofferableDataset> {
    let refused = |reason| UnofferableDataset { reason };
    check_dataset_name("the dataset name", name).map_err(refused)?;
    let info = DatasetInfo {
        name: name.to_string(),
        samples: data.len() as u64,
        sample_shape: data.feature_shape().iter().map(|&d| d as u64).collect(),
        classes: data.num_classes() as u64,
    };
    info.validate(0).map_err(refused)?;
    Ok(info)
}

/// `num_samples` from an encoded update's header (bytes 12..20, little
/// endian; see `canopy_protocol::update`); 0 if it is too short.
fn encoded_samples(encoded: &[u8]) -> u64 {
    encoded
        .get(12..20)
        .and_then(|bytes| bytes.try_into().ok())
        .map(u64::from_le_bytes)
        .unwrap_or(0)
}

#[cfg(test)]
mod describe_dataset_tests {
    use super::*;
    use canopy_engine::data::Dataset;

    fn digits_like(samples: usize) -> Dataset {
        let labels = (0..samples).map(|i| (i % 10) as i64).collect();
        Dataset::new(vec![0.5; samples * 64], vec![64], labels, 10).expect("a dataset")
    }

    #[test]
    fn a_dataset_is_described_by_its_size_shape_and_classes() {
        let info = describe_dataset("digits", &digits_like(30)).expect("describable");
        assert_eq!(
            info,
            DatasetInfo {
                name: "digits".into(),
                samples: 30,
                sample_shape: vec![64],
                classes: 10,
            }
        );
    }

    #[test]
    fn names_outside_the_protocols_rule_are_refused_by_it() {
        for bad in ["", "two words", "ünïcode", &"x".repeat(65)] {
            let error = describe_dataset(bad, &digits_like(3)).unwrap_err();
            assert!(
                error
                    .to_string()
                    .contains("must be 1 to 64 characters of [A-Za-z0-9_.-]"),
                "{bad:?}: {error}"
            );
        }
        assert!(describe_dataset(&"x".repeat(64), &digits_like(3)).is_ok());
    }
}

#[cfg(test)]
#[path = "client_tests.rs"]
pub(crate) mod tests;
