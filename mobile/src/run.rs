//! One run of an accepted task: limits, the backend, a thread pool of the
//! allowed size, a stop signal for the app's cancel, the time limit and
//! the round's deadline, checkpointed training, and what to keep or
//! forget when it ends.

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use canopy_protocol::messages::{self, ERROR_NO_OPEN_TASK, Task};
use canopy_sdk::blocking::{RunTaskError, RunTaskOutcome};
use canopy_sdk::checkpoint::CheckpointSettings;
use canopy_sdk::train::{TrainOptions, TrainProgress};
use canopy_sdk::{CancelToken, SdkError};

use crate::client::CanopyClient;
use crate::error::CanopyError;
use crate::progress::Pace;
use crate::storage::Storage;
use crate::types::{
    ProgressListener, TaskInfo, TaskKind, TaskOutcome, TaskPolicy, TrainingData, TrainingProgress,
};

/// Steps between checkpoints when the config says 0.
pub const DEFAULT_CHECKPOINT_EVERY_STEPS: u32 = 20;
/// A device clock may be this far off the server's.
const CLOCK_SKEW_MS: u64 = 5_000;
/// How often the stop watcher looks at the clocks.
const WATCH_INTERVAL: Duration = Duration::from_millis(20);

pub(crate) struct RunContext<'a> {
    pub client: &'a CanopyClient,
    pub task: &'a Task,
    pub listener: Option<Arc<dyn ProgressListener>>,
    pub cancel: Option<CancelToken>,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

pub(crate) fn past_deadline(task: &Task) -> bool {
    now_ms() > task.deadline_unix_ms.saturating_add(CLOCK_SKEW_MS)
}

/// Why the run's stop signal fired.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum StopCause {
    None = 0,
    App = 1,
    TimeLimit = 2,
    Deadline = 3,
}

/// The run's stop signal: `token` is a child of the app's token, so the
/// app's cancel reaches training before its next step (a watcher that
/// looked at the app's token every few milliseconds let a short training
/// run to its end first, and the cancel then landed in the upload, with no
/// progress left to keep). A thread fires `token` when the time limit or
/// the round's deadline passes, remembering which; it stops watching when
/// dropped.
struct StopWatcher {
    token: CancelToken,
    app: Option<CancelToken>,
    cause: Arc<AtomicU8>,
    done: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl StopWatcher {
    fn start(
        app: Option<CancelToken>,
        time_limit_ms: Option<u64>,
        deadline_unix_ms: u64,
    ) -> StopWatcher {
        let token = app
            .as_ref()
            .map_or_else(CancelToken::new, CancelToken::child);
        let cause = Arc::new(AtomicU8::new(StopCause::None as u8));
        let done = Arc::new(AtomicBool::new(false));
        let limit = time_limit_ms.map(|ms| Instant::now() + Duration::from_millis(ms));
        let deadline = deadline_unix_ms.saturating_add(CLOCK_SKEW_MS);
        let (fire, why, finished) = (token.clone(), cause.clone(), done.clone());
        let thread = std::thread::spawn(move || {
            while !finished.load(Ordering::Acquire) && !fire.is_cancelled() {
                let stop = if limit.is_some_and(|at| Instant::now() >= at) {
                    StopCause::TimeLimit
                } else if now_ms() > deadline {
                    StopCause::Deadline
                } else {
                    StopCause::None
                };
                if stop != StopCause::None {
                    why.store(stop as u8, Ordering::Release);
                    fire.cancel();
                    return;
                }
                std::thread::sleep(WATCH_INTERVAL);
            }
        });
        StopWatcher {
            token,
            app,
            cause,
            done,
            thread: Some(thread),
        }
    }

    /// The first of the clocks to fire, else the app when its token did.
    fn cause(&self) -> StopCause {
        match self.cause.load(Ordering::Acquire) {
            2 => StopCause::TimeLimit,
            3 => StopCause::Deadline,
            _ if self.app.as_ref().is_some_and(CancelToken::is_cancelled) => StopCause::App,
            _ => StopCause::None,
        }
    }
}

impl Drop for StopWatcher {
    fn drop(&mut self) {
        self.done.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

pub(crate) fn run(context: RunContext<'_>, data: TrainingData) -> Result<TaskOutcome, CanopyError> {
    let RunContext {
        client,
        task,
        listener,
        cancel,
    } = context;
    let storage = client.storage();
    if past_deadline(task) {
        storage.clear_task()?;
        storage.save_outcome(&format!(
            "round {}: its deadline passed before it ran",
            task.round_id
        ))?;
        return Err(CanopyError::TaskExpired {
            message: format!(
                "round {}'s deadline passed; the task was given up",
                task.round_id
            ),
        });
    }
    let data = crate::data::load(data)?;
    let limits = client.config().limits;
    let data_bytes = (data.features().len() * 4 + data.labels().len() * 8) as u64;
    let watcher = StopWatcher::start(cancel, limits.time_limit_ms, task.deadline_unix_ms);
    let (device, enrollment) = client.device(watcher.token.clone())?;
    if let Some(refusal) = limits.to_sdk().refusal(task, data_bytes) {
        device.decline_task(task, &refusal.to_string())?;
        storage.clear_task()?;
        storage.save_outcome(&format!("round {}: declined: {refusal}", task.round_id))?;
        return Err(CanopyError::OverLimit {
            message: format!("{refusal}\nhint: raise the client's limits, or train on less data"),
        });
    }
    let backend = client.training_backend();
    let resumed = Arc::new(Mutex::new(0u64));
    let options = TrainOptions {
        backend: backend.clone(),
        cancel: watcher.token.clone(),
        checkpoint: Some(CheckpointSettings {
            path: storage.checkpoint_path(),
            every_steps: match client.config().checkpoint_every_steps {
                0 => DEFAULT_CHECKPOINT_EVERY_STEPS,
                n => n,
            },
        }),
        progress: Some(progress_callback(
            task.round_id,
            listener,
            client.config().progress_interval_ms,
            resumed.clone(),
        )),
    };
    let seed = canopy_sdk::local::training_seed(enrollment.device_id, task.round_id);
    let model_path = storage.model_path();
    let result = in_pool(limits.max_threads, || {
        device.run_task_with(task, &data, seed, &options, Some(&model_path))
    })?;
    client.persist_trust(&enrollment, device.trusted_keys())?;
    let cause = watcher.cause();
    drop(watcher);
    match result {
        Ok(outcome) => {
            storage.clear_task()?;
            let resumed_from_step = *resumed.lock().unwrap_or_else(|p| p.into_inner());
            let outcome = task_outcome(task, outcome, resumed_from_step, backend.kind().as_str());
            storage.save_outcome(&describe(&outcome))?;
            Ok(outcome)
        }
        Err(error) => Err(ended(client, &device, task, error, cause)?),
    }
}

/// What a failed run keeps or gives up, and the error the app sees.
fn ended(
    client: &CanopyClient,
    device: &canopy_sdk::blocking::DeviceClient,
    task: &Task,
    error: RunTaskError,
    cause: StopCause,
) -> Result<CanopyError, CanopyError> {
    let storage = client.storage();
    let cancelled = matches!(
        error,
        RunTaskError::Sdk(SdkError::Cancelled)
            | RunTaskError::Train(canopy_sdk::train::TrainError::Cancelled)
    );
    let round = task.round_id;
    if cancelled {
        // Read only where the error names it: a given-up task's checkpoint
        // is not worth reading (a few times the model's size).
        let kept = || kept_progress(checkpointed_step(storage, task));
        return Ok(match cause {
            StopCause::TimeLimit => CanopyError::TimeLimit {
                message: format!(
                    "round {round}'s run reached the client's time limit; {}",
                    kept()
                ),
            },
            StopCause::Deadline => {
                storage.clear_task()?;
                storage.save_outcome(&format!(
                    "round {round}: its deadline passed during the run"
                ))?;
                CanopyError::TaskExpired {
                    message: format!(
                        "round {round}'s deadline passed during the run; the task was given up"
                    ),
                }
            }
            _ => CanopyError::Cancelled {
                message: format!("round {round}'s run was cancelled; {}", kept()),
            },
        });
    }
    match what_to_keep(&error) {
        Keep::Task => {}
        Keep::Nothing => storage.clear_task()?,
        Keep::NothingDecline => {
            let reason = crate::error::chain(&error, None).replace(char::is_control, " ");
            if let Err(decline) = device.decline_task(task, &reason) {
                tracing::warn!(round_id = round, error = %decline, "cannot decline the task");
            }
            storage.clear_task()?;
        }
    }
    if let Some(closed) = round_closed(round, &error) {
        storage.save_outcome(&format!("round {round}: not taken: {}", closed.message()))?;
        return Ok(closed);
    }
    let converted: CanopyError = error.into();
    storage.save_outcome(&format!("round {round}: failed: {}", converted.message()))?;
    Ok(converted)
}

/// The server's 410 to an upload or a report, or its 404 `no_open_task`
/// to the model's download (the round closed between the task and the
/// download): the round no longer takes this device's work, which is how
/// over-selection ends for the slowest devices, not a failure of the
/// device.
fn round_closed(round: i64, error: &RunTaskError) -> Option<CanopyError> {
    let RunTaskError::Sdk(SdkError::Server {
        status,
        code,
        message,
        ..
    }) = error
    else {
        return None;
    };
    if !(*status == 410 || (*status == 404 && code == ERROR_NO_OPEN_TASK)) {
        return None;
    }
    Some(CanopyError::RoundClosed {
        message: format!(
            "round {round} went on without this device: {message}\nhint: nothing is wrong \
             with the device (a round selects more devices than it needs, and closes at its \
             target); call check_for_task for the next task"
        ),
    })
}

/// The step of `task`'s checkpoint in `storage`, if one of this round's
/// training reads back.
pub(crate) fn checkpointed_step(storage: &Storage, task: &Task) -> Option<u64> {
    canopy_sdk::checkpoint::peek(&storage.checkpoint_path())
        .filter(|info| info.round_id == task.round_id)
        .map(|info| info.steps_done)
}

/// What a stopped run kept, as the error says it: what is on disk, not
/// what was meant to be (a stop before training began, or after it ended,
/// keeps no checkpoint).
fn kept_progress(checkpointed_step: Option<u64>) -> String {
    match checkpointed_step {
        Some(step) => format!(
            "its progress is checkpointed at step {step}\nhint: call run_task again to resume \
             from it"
        ),
        None => "no training progress was checkpointed (it stopped before the first checkpoint \
                 or after training ended)\nhint: call run_task again; it trains from the first \
                 step"
            .to_string(),
    }
}

/// What a run that failed leaves for the next one.
enum Keep {
    /// A failure worth another try (the network, a busy server, the
    /// storage): the task and its checkpoint stay.
    Task,
    /// The round went on without this device (it was dropped, the round
    /// closed, the device's update already counted).
    Nothing,
    /// This device cannot do the task (a model that fails verification
    /// or does not train): give it back now rather than at the deadline.
    NothingDecline,
}

fn what_to_keep(error: &RunTaskError) -> Keep {
    match error {
        RunTaskError::Sdk(sdk) if sdk.is_retryable() => Keep::Task,
        RunTaskError::Sdk(SdkError::LocalFile { .. } | SdkError::Runtime(_)) => Keep::Task,
        RunTaskError::Sdk(SdkError::SecureRoundGone { .. } | SdkError::Server { .. }) => {
            Keep::Nothing
        }
        RunTaskError::Sdk(_) | RunTaskError::Train(_) => Keep::NothingDecline,
    }
}

fn progress_callback(
    round_id: i64,
    listener: Option<Arc<dyn ProgressListener>>,
    interval_ms: u64,
    resumed: Arc<Mutex<u64>>,
) -> Arc<dyn Fn(TrainProgress) + Send + Sync> {
    let pace = Mutex::new(Pace::new(interval_ms));
    Arc::new(move |progress: TrainProgress| {
        *resumed.lock().unwrap_or_else(|p| p.into_inner()) = progress.resumed_from_step;
        let due = || {
            pace.lock()
                .unwrap_or_else(|p| p.into_inner())
                .due(progress.steps_done, progress.total_steps)
        };
        if let Some(listener) = listener.as_ref().filter(|_| due()) {
            listener.on_progress(TrainingProgress {
                round_id,
                epoch: progress.epoch,
                epochs: progress.epochs,
                steps_done: progress.steps_done,
                total_steps: progress.total_steps,
                mean_loss: progress.mean_loss,
                resumed_from_step: progress.resumed_from_step,
            });
        }
    })
}

/// Runs `work` on a thread pool of `threads` (the CPU backend's kernels
/// run on the pool they are called from), or on the global pool.
fn in_pool<T: Send>(
    threads: Option<u32>,
    work: impl FnOnce() -> T + Send,
) -> Result<T, CanopyError> {
    let Some(threads) = threads else {
        return Ok(work());
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads as usize)
        .thread_name(|i| format!("canopy-train-{i}"))
        .build()
        .map_err(|error| CanopyError::Runtime {
            message: format!("cannot start {threads} training threads: {error}"),
        })?;
    Ok(pool.install(work))
}

fn kind(task: &Task) -> TaskKind {
    match task.kind {
        messages::TaskKind::Train => TaskKind::Train,
        messages::TaskKind::Evaluate => TaskKind::Evaluate,
        messages::TaskKind::Statistics => TaskKind::Statistics,
    }
}

pub(crate) fn task_info(task: &Task, checkpointed_step: Option<u64>) -> TaskInfo {
    TaskInfo {
        kind: kind(task),
        job_id: task.job_id,
        round_id: task.round_id,
        round_number: task.round_number,
        model_size_bytes: task.model_size_bytes,
        deadline_unix_ms: task.deadline_unix_ms,
        epochs: task.training.epochs,
        batch_size: task.training.batch_size,
        learning_rate: task.training.learning_rate,
        secure: task.secure_aggregation.is_some(),
        policy: TaskPolicy {
            requires_charging: task.policy.requires_charging,
            requires_unmetered_network: task.policy.requires_unmetered_network,
            requires_idle: task.policy.requires_idle,
            min_battery_percent: task.policy.min_battery_percent,
        },
        dataset: task.dataset.clone(),
        checkpointed_step,
    }
}

fn task_outcome(
    task: &Task,
    outcome: RunTaskOutcome,
    resumed_from_step: u64,
    backend: &str,
) -> TaskOutcome {
    TaskOutcome {
        round_id: task.round_id,
        kind: kind(task),
        num_samples: outcome.receipt.num_samples,
        train_loss: outcome.train_loss,
        eval_loss: outcome.evaluation.map(|e| e.loss),
        eval_accuracy: outcome.evaluation.map(|e| e.accuracy),
        train_duration_ms: outcome.train_duration_ms,
        uploaded_bytes: outcome.receipt.bytes,
        secure: outcome.secure.is_some(),
        resumed_from_step,
        delta: outcome.delta,
        backend: backend.to_string(),
    }
}

fn describe(outcome: &TaskOutcome) -> String {
    match outcome.kind {
        TaskKind::Evaluate => format!(
            "round {}: evaluated on {} samples (accuracy {:.4})",
            outcome.round_id,
            outcome.num_samples,
            outcome.eval_accuracy.unwrap_or(0.0)
        ),
        _ => format!(
            "round {}: {} from {} samples ({} bytes)",
            outcome.round_id,
            if outcome.secure {
                "masked update sent"
            } else {
                "update uploaded"
            },
            outcome.num_samples,
            outcome.uploaded_bytes
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server(status: u16, code: &str) -> RunTaskError {
        RunTaskError::Sdk(SdkError::Server {
            status,
            code: code.into(),
            message: "m".into(),
            retry_after_ms: None,
        })
    }

    /// A round that closed before the upload (410) or before the download
    /// (404 `no_open_task`, the race a device that polled late meets) went
    /// on without the device; any other 404 is a failure.
    #[test]
    fn a_round_gone_before_the_download_or_the_upload_is_round_closed() {
        for error in [server(410, "gone"), server(404, ERROR_NO_OPEN_TASK)] {
            assert!(matches!(
                round_closed(3, &error),
                Some(CanopyError::RoundClosed { .. })
            ));
        }
        assert!(round_closed(3, &server(404, "not_found")).is_none());
        assert!(round_closed(3, &server(500, ERROR_NO_OPEN_TASK)).is_none());
    }

    /// A deadline an hour away: only the app or the time limit stops.
    fn later_ms() -> u64 {
        now_ms() + 3_600_000
    }

    #[test]
    fn the_apps_cancel_reaches_the_run_before_cancel_returns() {
        let app = CancelToken::new();
        let watcher = StopWatcher::start(Some(app.clone()), None, later_ms());
        assert!(!watcher.token.is_cancelled());
        app.cancel();
        // No wait: training checks the token before its next step, and a
        // cancel seen later lets a short training finish first (the
        // resume test's flake).
        assert!(watcher.token.is_cancelled());
        assert_eq!(watcher.cause(), StopCause::App);
    }

    #[test]
    fn the_run_stopping_leaves_the_apps_token_alone() {
        let app = CancelToken::new();
        let watcher = StopWatcher::start(Some(app.clone()), Some(0), later_ms());
        let until = Instant::now() + Duration::from_secs(10);
        while !watcher.token.is_cancelled() && Instant::now() < until {
            std::thread::sleep(WATCH_INTERVAL);
        }
        assert!(
            watcher.token.is_cancelled(),
            "the time limit fires the run's token"
        );
        assert_eq!(watcher.cause(), StopCause::TimeLimit);
        assert!(!app.is_cancelled(), "the app may use its token again");
    }

    #[test]
    fn the_error_says_what_is_on_disk() {
        assert!(kept_progress(Some(12)).starts_with("its progress is checkpointed at step 12\n"));
        assert!(kept_progress(None).starts_with("no training progress was checkpointed"));
    }
}
