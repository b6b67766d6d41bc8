//! The blocking API: the same client, for callers without an async
//! runtime (an Android or iOS app calling through FFI, a plain thread).
//!
//! [`DeviceClient`] wraps the async [`crate::DeviceClient`] with a tokio
//! current-thread runtime of its own, so the caller needs none; its
//! methods take the same arguments and return the same values and errors.
//! Retries and cancellation work as in the async client: cancel from any
//! thread with a clone of the client's [`CancelToken`].
//!
//! # Inside a tokio runtime
//!
//! A blocking call on a thread that runs a tokio runtime would stall that
//! runtime (and tokio panics when a runtime is started from inside
//! another). Every call here checks first and returns
//! [`SdkError::InsideRuntime`] instead; use the async client there. This
//! includes threads of `tokio::task::spawn_blocking`, which tokio does not
//! tell apart from its worker threads. Dropping a blocking client inside a
//! runtime is allowed: its runtime is then shut down in the background.

use std::future::Future;
use std::path::Path;

use bytes::Bytes;
use canopy_protocol::auth::DeviceKey;
use canopy_protocol::messages::{
    Capabilities, EnrollResponse, Heartbeat, HeartbeatResponse, RoundMetrics, Task, TaskKind,
    UploadReceipt,
};
use canopy_protocol::model_sig::{SigningKeys, TrustedKeys};
use canopy_protocol::secagg::wire::Stage;
use tokio::runtime::Runtime;

use crate::cancel::CancelToken;
use crate::client::DownloadedModel;
use crate::error::SdkError;
use crate::retry::{RetryObserver, RetryPolicy};
use crate::secure::{SecureReceipt, SecureRound, StageObserver};
use crate::train::LocalUpdate;
use crate::transport::Transport;

fn outside_runtime() -> Result<(), SdkError> {
    if tokio::runtime::Handle::try_current().is_ok() {
        return Err(SdkError::InsideRuntime);
    }
    Ok(())
}

fn new_runtime() -> Result<Runtime, SdkError> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(SdkError::Runtime)
}

/// Enrolls a device key with an enrollment token; see [`crate::enroll`].
/// Uses a fresh connection for the call.
pub fn enroll(
    transport: &Transport,
    enrollment_token: &str,
    key: &DeviceKey,
    capabilities: Capabilities,
) -> Result<EnrollResponse, SdkError> {
    outside_runtime()?;
    let runtime = new_runtime()?;
    let transport = transport.reconnect()?;
    runtime.block_on(crate::enroll(
        &transport,
        enrollment_token,
        key,
        capabilities,
    ))
}

/// [`enroll`] with the retries and cancellation of [`crate::enroll_with`].
pub fn enroll_with(
    transport: &Transport,
    enrollment_token: &str,
    key: &DeviceKey,
    capabilities: Capabilities,
    policy: &RetryPolicy,
    cancel: &CancelToken,
) -> Result<EnrollResponse, SdkError> {
    outside_runtime()?;
    let runtime = new_runtime()?;
    let transport = transport.reconnect()?;
    runtime.block_on(crate::enroll_with(
        &transport,
        enrollment_token,
        key,
        capabilities,
        policy,
        cancel,
    ))
}

/// An enrolled device, blocking. Not `Clone` (it owns its runtime); share
/// it behind an `Arc`, calls from several threads take turns.
#[derive(Debug)]
pub struct DeviceClient {
    inner: crate::DeviceClient,
    /// `None` only while dropping.
    runtime: Option<Runtime>,
}

impl DeviceClient {
    pub fn new(
        transport: Transport,
        device_id: i64,
        key: DeviceKey,
        server_public_key_hex: &str,
    ) -> Result<DeviceClient, SdkError> {
        let inner = crate::DeviceClient::new(transport, device_id, key, server_public_key_hex)?;
        DeviceClient::from_async(inner)
    }

    /// A client that trusts `trusted` for model signatures, e.g. as
    /// persisted from [`DeviceClient::trusted_keys`].
    pub fn with_trusted_keys(
        transport: Transport,
        device_id: i64,
        key: DeviceKey,
        trusted: TrustedKeys,
    ) -> Result<DeviceClient, SdkError> {
        DeviceClient::from_async(crate::DeviceClient::with_trusted_keys(
            transport, device_id, key, trusted,
        ))
    }

    /// What the device trusts to sign models; it moves when a download is
    /// signed by a key the server endorsed. Persist it when it changes.
    pub fn trusted_keys(&self) -> TrustedKeys {
        self.inner.trusted_keys()
    }

    /// The server's current model-signing key and its endorsement chain.
    pub fn signing_keys(&self) -> Result<SigningKeys, SdkError> {
        self.block_on(self.inner.signing_keys())?
    }

    /// Wraps an async client, keeping its retry policy and cancel token.
    /// Its transport is replaced by one with a fresh connection pool, since
    /// connections belong to the runtime that opened them.
    pub fn from_async(mut inner: crate::DeviceClient) -> Result<DeviceClient, SdkError> {
        outside_runtime()?;
        let runtime = new_runtime()?;
        inner.transport = inner.transport.reconnect()?;
        Ok(DeviceClient {
            inner,
            runtime: Some(runtime),
        })
    }

    fn block_on<F: Future>(&self, future: F) -> Result<F::Output, SdkError> {
        outside_runtime()?;
        let runtime = self
            .runtime
            .as_ref()
            .ok_or_else(|| SdkError::Runtime(std::io::Error::other("the runtime was shut down")))?;
        Ok(runtime.block_on(future))
    }

    /// The wrapped async client (its methods must not be awaited on another
    /// runtime while this one holds its connections; see [`Transport`]).
    pub fn as_async(&self) -> &crate::DeviceClient {
        &self.inner
    }

    pub fn device_id(&self) -> i64 {
        self.inner.device_id
    }

    pub fn key(&self) -> &DeviceKey {
        self.inner.key()
    }

    pub fn transport(&self) -> &Transport {
        &self.inner.transport
    }

    /// Swaps the connection (given a fresh pool, as in [`Self::from_async`]).
    pub fn set_transport(&mut self, transport: Transport) -> Result<(), SdkError> {
        self.inner.set_transport(transport.reconnect()?);
        Ok(())
    }

    pub fn with_retry_policy(mut self, policy: RetryPolicy) -> DeviceClient {
        self.inner.set_retry_policy(policy);
        self
    }

    pub fn set_retry_policy(&mut self, policy: RetryPolicy) {
        self.inner.set_retry_policy(policy);
    }

    pub fn retry_policy(&self) -> &RetryPolicy {
        self.inner.retry_policy()
    }

    /// See [`crate::DeviceClient::with_retry_observer`].
    pub fn with_retry_observer(mut self, observer: RetryObserver) -> DeviceClient {
        self.inner = self.inner.clone().with_retry_observer(observer);
        self
    }

    pub fn with_cancel_token(mut self, token: CancelToken) -> DeviceClient {
        self.inner.set_cancel_token(token);
        self
    }

    pub fn set_cancel_token(&mut self, token: CancelToken) {
        self.inner.set_cancel_token(token);
    }

    /// Clone it and call `cancel()` from another thread to stop the call in
    /// progress.
    pub fn cancel_token(&self) -> &CancelToken {
        self.inner.cancel_token()
    }

    pub fn heartbeat(&self, beat: &Heartbeat) -> Result<HeartbeatResponse, SdkError> {
        self.block_on(self.inner.heartbeat(beat))?
    }

    /// Waits up to `wait_ms` for a task; `None` when there is none.
    pub fn next_task(&self, wait_ms: u64) -> Result<Option<Task>, SdkError> {
        self.block_on(self.inner.next_task(wait_ms))?
    }

    /// See [`crate::DeviceClient::download_model`].
    pub fn download_model(&self, task: &Task) -> Result<DownloadedModel, SdkError> {
        self.block_on(self.inner.download_model(task))?
    }

    /// See [`crate::DeviceClient::download_model_to`].
    pub fn download_model_to(&self, task: &Task, path: &Path) -> Result<DownloadedModel, SdkError> {
        self.block_on(self.inner.download_model_to(task, path))?
    }

    /// See [`crate::DeviceClient::upload_update`].
    pub fn upload_update(&self, task: &Task, encoded: Bytes) -> Result<UploadReceipt, SdkError> {
        self.block_on(self.inner.upload_update(task, encoded))?
    }

    pub fn report_metrics(&self, metrics: &RoundMetrics) -> Result<(), SdkError> {
        self.block_on(self.inner.report_metrics(metrics))?
    }

    /// See [`crate::DeviceClient::report_evaluation`].
    pub fn report_evaluation(
        &self,
        task: &Task,
        evaluation: &crate::train::Evaluation,
    ) -> Result<(), SdkError> {
        self.block_on(self.inner.report_evaluation(task, evaluation))?
    }

    /// See [`crate::DeviceClient::unenroll`].
    pub fn unenroll(&self) -> Result<(), SdkError> {
        self.block_on(self.inner.unenroll())?
    }

    /// See [`crate::DeviceClient::install_certificate`].
    pub fn install_certificate(
        &self,
        certificate: &canopy_protocol::device_cert::Certificate,
    ) -> Result<(), SdkError> {
        self.block_on(self.inner.install_certificate(certificate))?
    }

    /// See [`crate::DeviceClient::decline_task`].
    pub fn decline_task(&self, task: &Task, reason: &str) -> Result<(), SdkError> {
        self.block_on(self.inner.decline_task(task, reason))?
    }

    /// See [`crate::DeviceClient::withdraw_task`].
    pub fn withdraw_task(
        &self,
        task: &Task,
        conditions: &canopy_protocol::messages::DeviceConditions,
    ) -> Result<(), SdkError> {
        self.block_on(self.inner.withdraw_task(task, conditions))?
    }

    /// See [`crate::DeviceClient::post_secure_message`].
    pub fn post_secure_message(
        &self,
        task: &Task,
        stage: Stage,
        message: Bytes,
    ) -> Result<(), SdkError> {
        self.block_on(self.inner.post_secure_message(task, stage, message))?
    }

    /// See [`crate::DeviceClient::poll_secure_message`].
    pub fn poll_secure_message(
        &self,
        task: &Task,
        stage: Stage,
        wait_ms: u64,
    ) -> Result<Option<Bytes>, SdkError> {
        self.block_on(self.inner.poll_secure_message(task, stage, wait_ms))?
    }

    /// See [`crate::DeviceClient::wait_secure_message`].
    pub fn wait_secure_message(
        &self,
        task: &Task,
        stage: Stage,
        wait_limit_ms: u64,
    ) -> Result<Bytes, SdkError> {
        self.block_on(self.inner.wait_secure_message(task, stage, wait_limit_ms))?
    }

    /// See [`crate::DeviceClient::begin_secure_round`]. Finish the round
    /// with [`Self::finish_secure_round`] on this client: the round uses
    /// this client's connections, which belong to its runtime.
    pub fn begin_secure_round(&self, task: &Task) -> Result<SecureRound, SdkError> {
        self.block_on(self.inner.begin_secure_round(task))?
    }

    /// See [`crate::DeviceClient::begin_secure_round_observed`].
    pub fn begin_secure_round_observed(
        &self,
        task: &Task,
        observer: StageObserver,
    ) -> Result<SecureRound, SdkError> {
        self.block_on(self.inner.begin_secure_round_observed(task, observer))?
    }

    /// See [`SecureRound::finish`].
    pub fn finish_secure_round(
        &self,
        round: SecureRound,
        delta: &[f32],
        num_samples: u64,
    ) -> Result<SecureReceipt, SdkError> {
        self.block_on(round.finish(delta, num_samples))?
    }

    /// See [`SecureRound::finish_update`].
    pub fn finish_secure_round_update(
        &self,
        round: SecureRound,
        update: &LocalUpdate,
    ) -> Result<SecureReceipt, SdkError> {
        self.block_on(round.finish_update(update))?
    }

    /// See [`crate::DeviceClient::run_secure_round`].
    pub fn run_secure_round(
        &self,
        task: &Task,
        delta: &[f32],
        num_samples: u64,
    ) -> Result<SecureReceipt, SdkError> {
        self.block_on(self.inner.run_secure_round(task, delta, num_samples))?
    }

    /// One task, whole: downloads the model (verified), trains it on
    /// `data` with the client's cancel token, uploads the update and
    /// reports the training loss. What an app calls when `next_task` hands
    /// it work.
    ///
    /// An evaluation task (`kind` is [`TaskKind::Evaluate`]) evaluates the
    /// model on `data` instead, which should then be the device's held-out
    /// data, and reports the result; nothing is trained or uploaded. A
    /// statistics task ([`TaskKind::Statistics`]) uploads the moments of
    /// `data`'s inputs, which should then be the training data.
    ///
    /// A secure task (`secure_aggregation` set) uploads nothing: the device
    /// exchanges keys first (the key stages are short and wait for every
    /// device, so they do not wait for this one's download and training),
    /// then downloads and trains, then finishes the secure round with the
    /// update; see [`crate::secure`].
    pub fn run_task(
        &self,
        task: &Task,
        data: &canopy_engine::data::Dataset,
        seed: u64,
    ) -> Result<RunTaskOutcome, RunTaskError> {
        let options = crate::train::TrainOptions {
            cancel: self.cancel_token().clone(),
            ..crate::train::TrainOptions::default()
        };
        self.run_task_with(task, data, seed, &options, None)
    }

    /// [`Self::run_task`] training under `options` (the backend, the
    /// cancel token training observes, checkpoints and progress), and,
    /// with `model_path`, downloading the model to that file, so that an
    /// interrupted download resumes there (see
    /// [`crate::DeviceClient::download_model_to`]).
    pub fn run_task_with(
        &self,
        task: &Task,
        data: &canopy_engine::data::Dataset,
        seed: u64,
        options: &crate::train::TrainOptions,
        model_path: Option<&Path>,
    ) -> Result<RunTaskOutcome, RunTaskError> {
        match task.kind {
            TaskKind::Evaluate => return self.run_evaluation(task, data, model_path),
            TaskKind::Statistics => return self.run_statistics(task, data, model_path),
            TaskKind::Train => {}
        }
        let secure_round = match task.secure_aggregation {
            Some(_) => Some(self.begin_secure_round(task)?),
            None => None,
        };
        let model = self.fetch_model(task, model_path)?;
        let update = crate::train::train_task(&model.bytes, task, data, seed, options)?;
        let (receipt, secure) = match secure_round {
            Some(round) => {
                let secure = self.finish_secure_round_update(round, &update)?;
                let receipt = UploadReceipt {
                    round_id: task.round_id,
                    accepted: true,
                    num_samples: update.num_samples,
                    bytes: secure.masked_input_bytes,
                };
                (receipt, Some(secure))
            }
            None => (
                self.upload_update(task, Bytes::from(update.encoded.clone()))?,
                None,
            ),
        };
        self.report_metrics(&RoundMetrics {
            round_id: task.round_id,
            train_loss: Some(update.train_loss),
            eval_loss: None,
            eval_accuracy: None,
            eval_samples: None,
            train_duration_ms: Some(update.train_duration_ms),
        })?;
        Ok(RunTaskOutcome {
            receipt,
            secure,
            train_loss: Some(update.train_loss),
            train_duration_ms: update.train_duration_ms,
            evaluation: None,
            delta: update.delta,
        })
    }

    /// The task's model, downloaded to `path` (resumably) or into memory.
    fn fetch_model(&self, task: &Task, path: Option<&Path>) -> Result<DownloadedModel, SdkError> {
        match path {
            Some(path) => self.download_model_to(task, path),
            None => self.download_model(task),
        }
    }

    /// A statistics task: downloads the model (verified) for its input
    /// shape and uploads the moments of `data`'s inputs; nothing is
    /// trained.
    fn run_statistics(
        &self,
        task: &Task,
        data: &canopy_engine::data::Dataset,
        model_path: Option<&Path>,
    ) -> Result<RunTaskOutcome, RunTaskError> {
        let model = self.fetch_model(task, model_path)?;
        let update = crate::train::statistics_update(&model.bytes, task, data)?;
        let receipt = self.upload_update(task, Bytes::from(update.encoded))?;
        Ok(RunTaskOutcome {
            receipt,
            secure: None,
            train_loss: None,
            train_duration_ms: update.train_duration_ms,
            evaluation: None,
            delta: Vec::new(),
        })
    }

    /// An evaluation task: downloads the model (verified), evaluates it on
    /// `data` and reports the result; nothing is trained or uploaded.
    fn run_evaluation(
        &self,
        task: &Task,
        data: &canopy_engine::data::Dataset,
        model_path: Option<&Path>,
    ) -> Result<RunTaskOutcome, RunTaskError> {
        let model = self.fetch_model(task, model_path)?;
        let model = crate::train::read_model(&model.bytes)?;
        let evaluation = crate::train::evaluate(&model, data, &Default::default())?;
        self.report_evaluation(task, &evaluation)?;
        Ok(RunTaskOutcome {
            receipt: UploadReceipt {
                round_id: task.round_id,
                accepted: true,
                num_samples: evaluation.samples,
                bytes: 0,
            },
            secure: None,
            train_loss: None,
            train_duration_ms: 0,
            evaluation: Some(evaluation),
            delta: Vec::new(),
        })
    }
}

/// What [`DeviceClient::run_task`] did.
#[derive(Clone, Debug)]
pub struct RunTaskOutcome {
    /// The server's receipt of the upload. For a secure task, which
    /// uploads nothing, one built locally once the device's part of the
    /// round is done: `accepted`, the update's sample count, and the size
    /// of the masked input as `bytes`.
    pub receipt: UploadReceipt,
    /// For a secure task, what its round amounted to.
    pub secure: Option<SecureReceipt>,
    /// A training task's mean training loss; `None` for an evaluation task.
    pub train_loss: Option<f64>,
    pub train_duration_ms: u64,
    /// An evaluation task's result, as reported to the server.
    pub evaluation: Option<crate::train::Evaluation>,
    /// A training task's change of the trainable parameters, in the
    /// task's layout, as uploaded (before masking, in a secure round);
    /// empty for other tasks.
    pub delta: Vec<f32>,
}

/// Why [`DeviceClient::run_task`] stopped.
#[derive(Debug, thiserror::Error)]
pub enum RunTaskError {
    #[error(transparent)]
    Sdk(#[from] SdkError),
    #[error("local training failed")]
    Train(#[from] crate::train::TrainError),
}

impl Drop for DeviceClient {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            // Dropping a runtime blocks, which tokio forbids inside another.
            if tokio::runtime::Handle::try_current().is_ok() {
                runtime.shutdown_background();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Trust;

    fn client() -> DeviceClient {
        let transport =
            Transport::new("https://127.0.0.1:9", &Trust::PinnedSha256("ab".repeat(32)))
                .expect("transport");
        let server_key = DeviceKey::generate().public_key_hex();
        DeviceClient::new(transport, 1, DeviceKey::generate(), &server_key).expect("client")
    }

    #[test]
    fn calls_inside_a_runtime_return_an_error_instead_of_panicking() {
        let blocking = client();
        let runtime = new_runtime().expect("runtime");
        runtime.block_on(async {
            assert!(matches!(
                blocking.next_task(0),
                Err(SdkError::InsideRuntime)
            ));
            assert!(matches!(
                blocking.heartbeat(&Heartbeat::default()),
                Err(SdkError::InsideRuntime)
            ));
            let transport = blocking.transport().clone();
            let key = DeviceKey::generate();
            let capabilities = Capabilities {
                tier: canopy_protocol::messages::Tier::End,
                backends: vec!["cpu".into()],
                memory_mb: 1,
                os: "test".into(),
                tags: Default::default(),
                gpu: None,
            };
            assert!(matches!(
                enroll(&transport, "token", &key, capabilities),
                Err(SdkError::InsideRuntime)
            ));
            let inner = blocking.as_async().clone();
            assert!(matches!(
                DeviceClient::from_async(inner),
                Err(SdkError::InsideRuntime)
            ));
            let message = SdkError::InsideRuntime.to_string();
            assert!(message.contains("async"), "{message}");
            // Dropping one inside a runtime does not panic either.
            drop(blocking);
        });
    }

    #[test]
    fn a_cancelled_client_returns_cancelled_without_a_request() {
        let token = CancelToken::new();
        token.cancel();
        let blocking = client()
            .with_retry_policy(RetryPolicy::default())
            .with_cancel_token(token);
        assert!(matches!(blocking.next_task(0), Err(SdkError::Cancelled)));
        assert!(blocking.cancel_token().is_cancelled());
    }
}
