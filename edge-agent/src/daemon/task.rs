//! One task: limits, verified download, held-out evaluation of the global
//! model, local training, upload and metrics.
//!
//! Every request of a task goes through the SDK's retry policy
//! ([`TASK_RETRY`], set on the daemon's client; `canopy_sdk::retry` says
//! what is retried), under a cancel token that fires once the round's
//! deadline has passed, so no retry or wait outlives the round; each
//! retry is logged. Training
//! observes the token the daemon cancels when it abandons the task.
//!
//! A secure task (`secure_aggregation` set) uploads nothing: the agent
//! exchanges round keys before it downloads and trains, since the key
//! stages are short and wait for every device, then finishes the secure
//! round with the trained update (see `canopy_sdk::secure`).

use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use bytes::Bytes;
use canopy_protocol::messages::{Task, TaskKind};
use canopy_sdk::local::{evaluate_held_out, round_metrics, train_and_evaluate, training_seed};
use canopy_sdk::train::{EvalOptions, LocalUpdate, TrainOptions, statistics_update};
use canopy_sdk::{
    CancelToken, DeviceClient, DownloadedModel, RetryNotice, RetryObserver, RetryPolicy, SdkError,
    SecureRound, StageObserver, StageProgress,
};

use super::{Daemon, new_record, record_outcome};
use crate::files::now_ms;
use crate::status::{AgentState, TaskResult};

/// Device and server clocks differ; a deadline is treated as passed only
/// this long after it, by the device's clock.
const CLOCK_SKEW_MS: u64 = 60_000;
/// How patiently each request of a task (download, upload, metrics,
/// decline, each message of a secure round) is repeated: 8 attempts,
/// waits from 1 s doubling up to 30 s, with full jitter. A secure round's
/// stage cannot be run again from the agent's side (the round's keys live
/// in one `SecureRound`), so the SDK retries each request itself.
pub(crate) const TASK_RETRY: RetryPolicy = RetryPolicy {
    max_attempts: 8,
    initial_backoff_ms: 1_000,
    max_backoff_ms: 30_000,
    multiplier: 2.0,
};

/// Why a task did not end in an accepted upload.
struct Stop {
    result: TaskResult,
    detail: String,
}

impl Stop {
    fn new(result: TaskResult, detail: impl Into<String>) -> Stop {
        Stop {
            result,
            detail: detail.into(),
        }
    }
}

fn past_deadline(task: &Task) -> bool {
    now_ms() > task.deadline_unix_ms.saturating_add(CLOCK_SKEW_MS)
}

/// A token that fires once `task`'s deadline has passed, by the device's
/// clock, and the timer that fires it; dropping the guard stops the timer.
fn deadline_token(task: &Task) -> (CancelToken, DeadlineTimer) {
    let token = CancelToken::new();
    let fire = token.clone();
    let wait_ms = task
        .deadline_unix_ms
        .saturating_add(CLOCK_SKEW_MS)
        .saturating_sub(now_ms());
    let timer = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(wait_ms)).await;
        fire.cancel();
    });
    (token, DeadlineTimer(timer))
}

struct DeadlineTimer(tokio::task::JoinHandle<()>);

impl Drop for DeadlineTimer {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Why this device will not start `task`, if it will not: a task outside
/// the bounds every device checks, or one over `--max-memory-mb`.
fn refusal(task: &Task, max_memory_mb: Option<u64>) -> Option<String> {
    if let Err(bounds) = task.validate() {
        return Some(format!(
            "the task is outside the bounds devices accept: {bounds}"
        ));
    }
    let limits = canopy_sdk::DeviceLimits {
        max_memory_mb,
        ..canopy_sdk::DeviceLimits::default()
    };
    // The data's size is not known before the task's dataset is opened;
    // the model's share of the estimate is what --max-memory-mb bounds.
    limits
        .refusal(task, 0)
        .map(|refusal| format!("{refusal} (--max-memory-mb {})", max_memory_mb.unwrap_or(0)))
}

/// How a failed request of a task ends it: a cancellation here is the
/// round's deadline passing.
fn request_failure(error: &SdkError) -> TaskResult {
    match error {
        SdkError::Cancelled => TaskResult::Expired,
        _ => TaskResult::Failed,
    }
}

/// How a secure round that stopped with `error` ends: 410 means the server
/// has already written this device off (dropped, or the round failed), so
/// declining would tell it nothing; anything else is declined unless the
/// round is over anyway.
fn secure_failure(error: &SdkError, past_deadline: bool) -> TaskResult {
    match error {
        SdkError::SecureRoundGone { .. } => TaskResult::Rejected,
        _ if past_deadline => TaskResult::Expired,
        _ => TaskResult::Failed,
    }
}

/// The stage a secure-round error names, for the logs.
fn failed_stage(error: &SdkError) -> &'static str {
    match error {
        SdkError::SecureAggregation { stage, .. }
        | SdkError::SecureRoundGone { stage, .. }
        | SdkError::SecureMessageRefused { stage, .. }
        | SdkError::StageTimeout { stage, .. } => stage.name(),
        _ => "",
    }
}

/// Logs every stage message of a secure round as it goes out or comes in.
fn stage_logger() -> StageObserver {
    Arc::new(|progress: &StageProgress| {
        if progress.sent() {
            tracing::info!(
                round_id = progress.round_id,
                stage = progress.stage.name(),
                bytes = progress.bytes,
                elapsed_ms = progress.elapsed_ms,
                "secure round: message sent"
            );
        } else {
            tracing::info!(
                round_id = progress.round_id,
                stage = progress.stage.name(),
                bytes = progress.bytes,
                waited_ms = progress.elapsed_ms,
                "secure round: message received"
            );
        }
    })
}

/// Logs every retry of a task's requests before its wait.
fn retry_logger(round_id: i64) -> RetryObserver {
    Arc::new(move |notice: &RetryNotice<'_>| {
        tracing::warn!(
            round_id,
            attempt = notice.failures,
            retry_in_ms = notice.wait.as_millis() as u64,
            error = %canopy_term::error_chain(notice.error),
            "request failed; retrying"
        );
    })
}

/// One task's run: the task, the client its requests go through (its
/// token fires at the round's deadline), and the token that stops its
/// training when the daemon abandons it.
struct Run<'a> {
    task: &'a Task,
    client: DeviceClient,
    training: &'a CancelToken,
}

impl Daemon {
    /// Works on one task and records how it ended. `training` is cancelled
    /// by the caller when it abandons the task, which stops training
    /// between batches.
    pub(super) async fn run_task(&self, task: &Task, training: &CancelToken) -> TaskResult {
        tracing::info!(
            job_id = task.job_id,
            round_id = task.round_id,
            round = task.round_number,
            model_version_id = task.model_version_id,
            model_bytes = task.model_size_bytes,
            epochs = task.training.epochs,
            batch = task.training.batch_size,
            lr = task.training.learning_rate,
            "task received"
        );
        self.update_status(|s| {
            s.last_task = Some(new_record(task));
            s.state = AgentState::Downloading;
        });
        let (deadline, _timer) = deadline_token(task);
        let run = Run {
            task,
            client: self
                .client
                .clone()
                .with_cancel_token(deadline)
                .with_retry_observer(retry_logger(task.round_id)),
            training,
        };
        let (result, detail) = match self.work(&run).await {
            Ok(()) => (TaskResult::Uploaded, None),
            Err(stop) => (stop.result, Some(stop.detail)),
        };
        match (&result, &detail) {
            (TaskResult::Uploaded, _) if task.secure_aggregation.is_some() => {
                tracing::info!(
                    round_id = task.round_id,
                    "task done: masked update sent and unmasking answered"
                );
            }
            (TaskResult::Uploaded, _) if task.kind == TaskKind::Evaluate => {
                tracing::info!(round_id = task.round_id, "task done: evaluation reported");
            }
            (TaskResult::Uploaded, _) => {
                tracing::info!(round_id = task.round_id, "task done: update uploaded");
            }
            (_, detail) => tracing::warn!(
                round_id = task.round_id,
                result = result.as_str(),
                detail = detail.as_deref().unwrap_or(""),
                "task not uploaded"
            ),
        }
        if matches!(result, TaskResult::Refused | TaskResult::Failed) && !past_deadline(task) {
            // Best effort: without it the server would keep handing out
            // this task until the deadline.
            let reason = detail
                .as_deref()
                .unwrap_or("the agent could not do this task");
            if let Err(error) = run.client.decline_task(task, reason).await {
                tracing::warn!(round_id = task.round_id, error = %canopy_term::error_chain(&error), "cannot decline the task");
            }
        }
        self.update_status(|s| record_outcome(s, result, detail));
        result
    }

    async fn work(&self, run: &Run<'_>) -> Result<(), Stop> {
        let task = run.task;
        if let Some(reason) = refusal(task, self.settings.max_memory_mb) {
            return Err(Stop::new(TaskResult::Refused, reason));
        }
        if past_deadline(task) {
            return Err(Stop::new(
                TaskResult::Expired,
                "the round's deadline passed before work began",
            ));
        }
        self.datasets
            .check(task.dataset.as_deref())
            .map_err(|reason| Stop::new(TaskResult::Refused, reason))?;
        match task.kind {
            TaskKind::Evaluate => return self.evaluate(run).await,
            TaskKind::Statistics => return self.statistics(run).await,
            TaskKind::Train => {}
        }
        let secure_round = match task.secure_aggregation {
            Some(_) => Some(self.exchange_keys(run).await?),
            None => None,
        };
        let model = self.download(run).await?;
        tracing::info!(round_id = task.round_id, digest = %model.digest, "model downloaded and verified");
        self.set_state(AgentState::Training);
        let datasets = self.datasets.clone();
        let owned_task = task.clone();
        let seed = training_seed(self.client.device_id, task.round_id);
        let options = TrainOptions {
            backend: self.settings.backend.sdk_choice(),
            cancel: run.training.clone(),
            ..TrainOptions::default()
        };
        tracing::info!(round_id = task.round_id, backend = %options.backend, "training");
        let (evaluation, update) = off_thread("training", move || {
            let data = datasets.get(owned_task.dataset.as_deref())?;
            Ok(train_and_evaluate(
                &model.bytes,
                &owned_task,
                &data,
                seed,
                &options,
            )?)
        })
        .await?;
        let metrics = round_metrics(task, evaluation, &update);
        tracing::info!(
            round_id = task.round_id,
            samples = update.num_samples,
            train_loss = update.train_loss,
            train_ms = update.train_duration_ms,
            eval_accuracy = metrics.eval_accuracy,
            eval_loss = metrics.eval_loss,
            "trained"
        );
        self.update_status(|s| {
            s.state = if secure_round.is_some() {
                AgentState::SecureAggregation
            } else {
                AgentState::Uploading
            };
            if let Some(record) = s.last_task.as_mut() {
                record.num_samples = Some(update.num_samples);
                record.train_loss = metrics.train_loss;
                record.train_duration_ms = metrics.train_duration_ms;
                record.eval_accuracy = metrics.eval_accuracy;
                record.eval_loss = metrics.eval_loss;
                record.eval_samples = metrics.eval_samples;
            }
        });
        match secure_round {
            Some(round) => self.finish_secure_round(task, round, &update).await?,
            None => self.upload(run, update).await?,
        }
        match metrics.validate() {
            Err(reason) => tracing::warn!(%reason, "not reporting invalid metrics"),
            Ok(()) => {
                if let Err(error) = run.client.report_metrics(&metrics).await {
                    // The update counts; the metrics are informational.
                    tracing::warn!(error = %canopy_term::error_chain(&error), "metrics were not reported");
                }
            }
        }
        Ok(())
    }

    /// A statistics task: the moments of the training split's inputs,
    /// uploaded as the round's update; nothing is trained.
    async fn statistics(&self, run: &Run<'_>) -> Result<(), Stop> {
        let task = run.task;
        let model = self.download(run).await?;
        let datasets = self.datasets.clone();
        let owned_task = task.clone();
        let update = off_thread("computing input statistics", move || {
            let data = datasets.get(owned_task.dataset.as_deref())?;
            Ok(statistics_update(&model.bytes, &owned_task, &data.train)?)
        })
        .await?;
        tracing::info!(
            round_id = task.round_id,
            samples = update.num_samples,
            "input moments computed"
        );
        self.set_state(AgentState::Uploading);
        self.upload(run, update).await
    }

    /// The task's model, downloaded and verified; the keys it was checked
    /// against are kept for the next restart.
    async fn download(&self, run: &Run<'_>) -> Result<DownloadedModel, Stop> {
        self.set_state(AgentState::Downloading);
        let model = run.client.download_model(run.task).await.map_err(|error| {
            Stop::new(
                request_failure(&error),
                format!(
                    "model download failed: {}",
                    canopy_term::error_chain(&error)
                ),
            )
        })?;
        self.persist_trusted_keys();
        Ok(model)
    }

    /// An evaluation task: the version a round produced, evaluated on the
    /// held-out split (the same samples the training tasks' metrics use)
    /// and reported; nothing is trained or uploaded.
    async fn evaluate(&self, run: &Run<'_>) -> Result<(), Stop> {
        let task = run.task;
        let model = self.download(run).await?;
        self.set_state(AgentState::Evaluating);
        let datasets = self.datasets.clone();
        let name = task.dataset.clone();
        let options = EvalOptions {
            backend: self.settings.backend.sdk_choice(),
            ..EvalOptions::default()
        };
        let evaluation = off_thread("evaluation", move || {
            let data = datasets.get(name.as_deref())?;
            Ok(rayon::scope(|_| {
                evaluate_held_out(&model.bytes, &data, &options)
            })?)
        })
        .await?;
        tracing::info!(
            round_id = task.round_id,
            accuracy = evaluation.accuracy,
            loss = evaluation.loss,
            samples = evaluation.samples,
            "evaluated the round's version"
        );
        self.update_status(|s| {
            if let Some(record) = s.last_task.as_mut() {
                record.eval_accuracy = Some(evaluation.accuracy);
                record.eval_loss = Some(evaluation.loss);
                record.eval_samples = Some(evaluation.samples);
            }
        });
        run.client
            .report_evaluation(task, &evaluation)
            .await
            .map_err(|error| {
                Stop::new(
                    request_failure(&error),
                    format!(
                        "the evaluation was not reported: {}",
                        canopy_term::error_chain(&error)
                    ),
                )
            })
    }

    /// AdvertiseKeys and ShareKeys of a secure task, before training.
    async fn exchange_keys(&self, run: &Run<'_>) -> Result<SecureRound, Stop> {
        let task = run.task;
        self.set_state(AgentState::ExchangingKeys);
        if let Some(secure) = &task.secure_aggregation {
            tracing::info!(
                round_id = task.round_id,
                stage = "AdvertiseKeys",
                participants = secure.plan.participants,
                degree = secure.plan.degree,
                threshold = secure.plan.threshold,
                bits = secure.plan.bits,
                stage_timeout_ms = secure.stage_timeout_ms,
                "secure round: exchanging keys"
            );
        }
        let round = run
            .client
            .begin_secure_round_observed(task, stage_logger())
            .await
            .map_err(|error| self.secure_stop(task, "key exchange", &error))?;
        tracing::info!(
            round_id = task.round_id,
            stage = "ShareKeys",
            "secure round: keys exchanged; training while the other devices share theirs"
        );
        Ok(round)
    }

    /// The rest of a secure round, with the trained update: masked input,
    /// then the answer to the unmask request.
    async fn finish_secure_round(
        &self,
        task: &Task,
        round: SecureRound,
        update: &LocalUpdate,
    ) -> Result<(), Stop> {
        tracing::info!(
            round_id = task.round_id,
            stage = "MaskedInput",
            "secure round: sending the masked update"
        );
        let receipt = round
            .finish_update(update)
            .await
            .map_err(|error| self.secure_stop(task, "secure aggregation", &error))?;
        tracing::info!(
            round_id = receipt.round_id,
            stage = "UnmaskResponse",
            weight = receipt.weight,
            masked_input_bytes = receipt.masked_input_bytes,
            "secure round: done; the server can unmask the sum"
        );
        Ok(())
    }

    fn secure_stop(&self, task: &Task, what: &str, error: &SdkError) -> Stop {
        let detail = format!("{what} failed: {}", canopy_term::error_chain(error));
        tracing::warn!(
            round_id = task.round_id,
            stage = failed_stage(error),
            error = %canopy_term::error_chain(error),
            "secure round stopped"
        );
        Stop::new(secure_failure(error, past_deadline(task)), detail)
    }

    async fn upload(&self, run: &Run<'_>, update: LocalUpdate) -> Result<(), Stop> {
        let task = run.task;
        let uploaded = run
            .client
            .upload_update(task, Bytes::from(update.encoded))
            .await;
        match uploaded {
            Ok(receipt) => tracing::info!(
                round_id = receipt.round_id,
                bytes = receipt.bytes,
                "update accepted"
            ),
            // The device had uploaded before this call (an earlier run).
            Err(error) if error.status() == Some(409) => tracing::info!(
                round_id = task.round_id,
                "the server already holds this device's update"
            ),
            Err(error) => {
                let result = match error.status() {
                    Some(403 | 404 | 410) => TaskResult::Rejected,
                    _ if past_deadline(task) => TaskResult::Expired,
                    _ => TaskResult::Failed,
                };
                return Err(Stop::new(
                    result,
                    format!("upload failed: {}", canopy_term::error_chain(&error)),
                ));
            }
        }
        Ok(())
    }
}

/// Runs engine work (training, statistics, evaluation) off the async
/// runtime; its error, or its panic, fails the task with the cause.
async fn off_thread<T: Send + 'static>(
    what: &'static str,
    work: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T, Stop> {
    match tokio::task::spawn_blocking(work).await {
        Ok(Ok(done)) => Ok(done),
        Ok(Err(error)) => Err(Stop::new(
            TaskResult::Failed,
            canopy_term::error_chain(error.as_ref()),
        )),
        Err(join) => Err(Stop::new(
            TaskResult::Failed,
            format!("{what} stopped unexpectedly: {join}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secure_failures_are_declined_unless_the_server_ended_the_round() {
        use canopy_protocol::secagg::wire::Stage;
        let gone = SdkError::SecureRoundGone {
            round_id: 7,
            stage: Stage::IncomingShares,
            code: "dropped".into(),
            reason: "device 5 missed ShareKeys".into(),
        };
        assert_eq!(secure_failure(&gone, false), TaskResult::Rejected);
        assert_eq!(failed_stage(&gone), "IncomingShares");
        let timeout = SdkError::StageTimeout {
            round_id: 7,
            stage: Stage::UnmaskRequest,
            waited_ms: 1,
        };
        assert_eq!(secure_failure(&timeout, false), TaskResult::Failed);
        assert_eq!(secure_failure(&timeout, true), TaskResult::Expired);
        let refused = SdkError::SecureMessageRefused {
            round_id: 7,
            stage: Stage::ShareKeys,
            code: "secagg_rejected".into(),
            reason: "bad".into(),
        };
        assert_eq!(secure_failure(&refused, false), TaskResult::Failed);
        assert_eq!(failed_stage(&refused), "ShareKeys");
        assert_eq!(failed_stage(&SdkError::Cancelled), "");
        assert!(!gone.is_retryable() && !timeout.is_retryable() && !refused.is_retryable());
    }

    #[test]
    fn the_task_retry_policy_is_within_the_sdk_caps() {
        assert_eq!(TASK_RETRY, TASK_RETRY.normalized());
        const { assert!(TASK_RETRY.max_attempts > 1) };
    }

    fn task(epochs: u32, model_size_bytes: u64, deadline_unix_ms: u64) -> Task {
        Task {
            kind: canopy_protocol::messages::TaskKind::Train,
            dataset: None,
            job_id: 1,
            round_id: 2,
            round_number: 1,
            model_version_id: 3,
            model_digest: String::new(),
            model_size_bytes,
            model_path: "/device/v1/models/3".into(),
            upload_path: "/device/v1/rounds/2/update".into(),
            upload_size_bytes: 0,
            deadline_unix_ms,
            training: canopy_protocol::messages::TrainingConfig {
                epochs,
                batch_size: 8,
                learning_rate: 0.1,
            },
            layout: canopy_protocol::update::UpdateLayout::new(vec![
                canopy_protocol::update::TensorSpec {
                    name: "w".into(),
                    shape: vec![2],
                },
            ])
            .expect("layout"),
            secure_aggregation: None,
            sub_round: None,
            privacy: None,
            compression: None,
            policy: Default::default(),
        }
    }

    #[test]
    fn tasks_outside_the_bounds_or_the_memory_cap_are_refused() {
        assert_eq!(refusal(&task(5, 1 << 20, 0), Some(100)), None);
        let epochs = refusal(&task(5_000, 1 << 20, 0), None).expect("refused");
        assert!(epochs.contains("training.epochs"), "{epochs}");
        let size = refusal(&task(5, 2 << 30, 0), None).expect("refused");
        assert!(size.contains("model_size_bytes"), "{size}");
        let memory = refusal(&task(5, 100 << 20, 0), Some(100)).expect("refused");
        assert!(memory.contains("--max-memory-mb 100"), "{memory}");
    }

    #[test]
    fn the_deadline_token_fires_only_once_the_deadline_has_passed() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async {
            let passed = task(1, 1, now_ms().saturating_sub(CLOCK_SKEW_MS + 1));
            let (token, _timer) = deadline_token(&passed);
            tokio::time::timeout(Duration::from_secs(5), token.cancelled())
                .await
                .expect("fired at once");
            let open = task(1, 1, now_ms() + 3_600_000);
            let (token, timer) = deadline_token(&open);
            tokio::time::sleep(Duration::from_millis(50)).await;
            assert!(!token.is_cancelled());
            drop(timer);
            assert!(!token.is_cancelled(), "a stopped timer never fires");
        });
        assert_eq!(request_failure(&SdkError::Cancelled), TaskResult::Expired);
        let server = SdkError::Server {
            status: 503,
            code: "x".into(),
            message: "y".into(),
            retry_after_ms: None,
        };
        assert_eq!(request_failure(&server), TaskResult::Failed);
    }
}
