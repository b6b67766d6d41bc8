//! `run`: the daemon. It heartbeats at the server's interval, long-polls
//! for tasks, and for each task downloads the model (verified), evaluates
//! it on the held-out 10% of the local dataset, trains on the rest,
//! uploads the update and reports the metrics, recording every step in
//! `status.json`.
//!
//! Network errors are retried with the SDK's backoff and jitter (a task's
//! requests under [`task::TASK_RETRY`], failed polls by the poll loop under
//! [`POLL_BACKOFF`]); nothing the server or the network does ends the
//! daemon. SIGTERM or SIGINT lets a running task finish within
//! [`SHUTDOWN_GRACE`] (a second signal ends it at once, and stops its
//! training), then the daemon exits 0.

mod data;
mod task;

pub(crate) use task::TASK_RETRY;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use canopy_protocol::messages::{DeviceRole, Heartbeat, TaskKind};
use canopy_sdk::{CancelToken, DeviceClient, RetryPolicy, SdkError};
use clap::Args;
use tokio::sync::{Notify, watch};

use crate::backend::{AgentBackend, OrtArgs};
use crate::config::{AgentConfig, FileConfig, load_key};
use crate::files::{DataDir, now_ms};
use crate::status::{AgentState, AgentStatus, TaskRecord, TaskResult};
use data::LocalDatasets;

/// How long a running task may take to finish after SIGTERM or SIGINT.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(20);
/// `--only-when-idle` defers polling while the 1-minute load average per
/// core is above this.
pub const IDLE_LOAD_PER_CORE: f64 = 0.5;
/// How often a deferred daemon looks at the load again.
const IDLE_RECHECK: Duration = Duration::from_secs(30);
pub const DEFAULT_POLL_WAIT_MS: u64 = 25_000;
/// The SDK's request timeout is 120 s; a poll must end well before it.
const MAX_POLL_WAIT_MS: u64 = 110_000;
const MIN_POLL_WAIT_MS: u64 = 100;
const MAX_THREADS: usize = 1024;
/// Bounds on the heartbeat interval the server may ask for.
const MIN_HEARTBEAT: Duration = Duration::from_secs(1);
const MAX_HEARTBEAT: Duration = Duration::from_secs(3600);
/// Polls and heartbeats: one attempt each, since their loops are the
/// retry (a poll retried inside the client would hide a server that is
/// down from the log and the status for minutes); the poll loop waits the
/// SDK's backoff of this policy between failed polls, from 1 s doubling up
/// to 60 s, with full jitter.
const POLL_BACKOFF: RetryPolicy = RetryPolicy {
    max_attempts: 1,
    initial_backoff_ms: 1_000,
    max_backoff_ms: 60_000,
    multiplier: 2.0,
};
/// Rounds remembered as not to be worked on again (declined, or a secure
/// round finished) at most.
const MAX_DECLINED_ROUNDS: usize = 1024;

#[derive(Args, Default)]
pub struct RunArgs {
    /// Registered dataset to train on; default: `run.dataset` in
    /// config.toml, else the default dataset.
    #[arg(long)]
    dataset: Option<String>,
    /// Threads for training (rayon's global pool); default: one per core.
    #[arg(long)]
    max_threads: Option<usize>,
    /// Refuse tasks whose model file size x 8 exceeds this many MiB; the
    /// refusal is logged and recorded in status.json.
    #[arg(long)]
    max_memory_mb: Option<u64>,
    /// Defer polling while /proc/loadavg's 1-minute load per core is above
    /// 0.5 (checked every 30 s).
    #[arg(long)]
    only_when_idle: bool,
    /// How long one task poll waits at the server, in milliseconds
    /// (100..=110000; the server caps it at its own maximum).
    #[arg(long)]
    poll_wait_ms: Option<u64>,
    /// The engine backend to train and evaluate on: cpu, gpu (any Vulkan,
    /// Metal or DX12 adapter), auto (a hardware GPU when there is one,
    /// else the CPU) or npu (a model's frozen backbone in ONNX Runtime,
    /// the rest on the CPU; an error when ONNX Runtime does not open);
    /// default: `run.backend` in config.toml, else auto.
    #[arg(long)]
    backend: Option<AgentBackend>,
    #[command(flatten)]
    ort: OrtArgs,
}

/// `run`'s settings after merging flags over config.toml.
#[derive(Clone, Debug)]
struct Settings {
    dataset: Option<String>,
    max_threads: Option<usize>,
    max_memory_mb: Option<u64>,
    only_when_idle: bool,
    poll_wait_ms: u64,
    backend: AgentBackend,
    ort: OrtArgs,
}

impl Settings {
    fn merge(args: RunArgs, file: FileConfig) -> Result<Settings> {
        let run = file.run;
        let settings = Settings {
            dataset: args.dataset.or(run.dataset),
            max_threads: args.max_threads.or(run.max_threads),
            max_memory_mb: args.max_memory_mb.or(run.max_memory_mb),
            only_when_idle: args.only_when_idle || run.only_when_idle.unwrap_or(false),
            poll_wait_ms: args
                .poll_wait_ms
                .or(run.poll_wait_ms)
                .unwrap_or(DEFAULT_POLL_WAIT_MS),
            backend: args.backend.or(run.backend).unwrap_or_default(),
            ort: args.ort.or(run.ort_library, run.ort_providers),
        };
        if let Some(threads) = settings.max_threads {
            if threads == 0 || threads > MAX_THREADS {
                bail!("max-threads {threads} is out of range (1..={MAX_THREADS})");
            }
        }
        if let Some(mb) = settings.max_memory_mb {
            if mb == 0 || mb > canopy_protocol::messages::MAX_MEMORY_MB {
                bail!(
                    "max-memory-mb {mb} is out of range (1..={})",
                    canopy_protocol::messages::MAX_MEMORY_MB
                );
            }
        }
        if !(MIN_POLL_WAIT_MS..=MAX_POLL_WAIT_MS).contains(&settings.poll_wait_ms) {
            bail!(
                "poll-wait-ms {} is out of range ({MIN_POLL_WAIT_MS}..={MAX_POLL_WAIT_MS})",
                settings.poll_wait_ms
            );
        }
        Ok(settings)
    }
}

pub fn run(dir: &DataDir, args: RunArgs) -> Result<()> {
    let settings = Settings::merge(args, FileConfig::load(dir)?)?;
    if settings.backend == AgentBackend::Npu {
        settings
            .ort
            .open()
            .context("cannot train on the NPU backend (--backend npu)")?;
    }
    let agent = AgentConfig::require(dir)?;
    if agent.role == DeviceRole::Aggregator {
        return Err(crate::files::hinted(
            format!(
                "`{}` is enrolled as an aggregator, which trains on no data of its own",
                dir.root.display()
            ),
            "run it with `canopy-agent aggregate`, which serves its end devices",
        ));
    }
    let key = load_key(&dir.key())?;
    let datasets = Arc::new(LocalDatasets::open(dir, settings.dataset.as_deref())?);
    settings.backend.settle();
    if let Some(threads) = settings.max_threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("canopy-train-{i}"))
            .build_global()
            .context("cannot size the training thread pool")?;
    }
    let client = agent
        .device_client(key)?
        .with_retry_policy(task::TASK_RETRY);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(4)
        .thread_name("canopy-agent-io")
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let daemon = Arc::new(Daemon {
        dir: dir.clone(),
        poller: client.clone().with_retry_policy(POLL_BACKOFF),
        client,
        datasets,
        settings,
        heartbeat_ms: agent.heartbeat_interval_ms,
        agent: Mutex::new(agent),
        status: Mutex::new(AgentStatus::default()),
        reconnected: Notify::new(),
    });
    let result = runtime.block_on(daemon.main());
    // A task abandoned after the grace period may still be in a training
    // step on a blocking thread (it stops at the next batch): do not wait
    // for it.
    runtime.shutdown_timeout(Duration::from_millis(500));
    result
}

struct Daemon {
    dir: DataDir,
    /// A task's requests: retried under [`task::TASK_RETRY`].
    client: DeviceClient,
    /// Polls and heartbeats: one attempt each (see [`POLL_BACKOFF`]).
    /// Shares the connection pool and the trusted keys with `client`.
    poller: DeviceClient,
    datasets: Arc<LocalDatasets>,
    settings: Settings,
    heartbeat_ms: u64,
    /// The enrollment as last written, rewritten when the trusted
    /// model-signing keys move.
    agent: Mutex<AgentConfig>,
    status: Mutex<AgentStatus>,
    /// Signalled when a heartbeat gets through after failures, so a poll
    /// loop backing off tries again at once.
    reconnected: Notify,
}

/// What the daemon remembers about a round it will not work on again.
struct Declined {
    deadline_unix_ms: u64,
}

impl Daemon {
    /// Changes the status under its lock and writes it; a write failure is
    /// logged, never fatal.
    fn update_status(&self, change: impl FnOnce(&mut AgentStatus)) {
        let mut status = self.status.lock().unwrap_or_else(|p| p.into_inner());
        change(&mut status);
        if let Err(error) = status.save(&self.dir) {
            tracing::warn!(error = %canopy_term::error_chain(error.as_ref()), "cannot record the status");
        }
    }

    /// Writes `agent.toml` (atomically) when the client followed a
    /// rotation of the server's model-signing key, so that a restart keeps
    /// trusting the new key. A write failure is logged: the daemon goes on
    /// with the trust it holds, and a restart can still follow the chain
    /// from the old key while the server keeps it.
    fn persist_trusted_keys(&self) {
        let trusted = self.client.trusted_keys();
        let mut agent = self.agent.lock().unwrap_or_else(|p| p.into_inner());
        if agent.trusted_keys().ok() == Some(trusted) {
            return;
        }
        let mut updated = agent.clone();
        updated.set_trusted_keys(trusted);
        match updated.save(&self.dir) {
            Ok(()) => {
                tracing::info!(key = %trusted.current_hex(), "now trusting the server's rotated model-signing key");
                *agent = updated;
            }
            Err(error) => {
                tracing::warn!(error = %canopy_term::error_chain(error.as_ref()), "cannot record the server's rotated model-signing key");
            }
        }
    }

    fn set_state(&self, state: AgentState) {
        self.update_status(|s| s.state = state);
    }

    fn heartbeat(&self) -> Heartbeat {
        let status = self.status.lock().unwrap_or_else(|p| p.into_inner());
        let round_id = status
            .last_task
            .as_ref()
            .filter(|t| t.result == TaskResult::InProgress)
            .map(|t| t.round_id);
        Heartbeat {
            state: Some(status.state.as_str().to_string()),
            round_id,
            datasets: Some(self.datasets.offered()),
            last_error: Some(heartbeat_error(&status)),
            // An edge machine has no charger or battery to report; jobs'
            // device policies leave devices that report nothing selectable.
            conditions: None,
        }
    }

    async fn main(self: Arc<Self>) -> Result<()> {
        let previous = AgentStatus::load(&self.dir).unwrap_or_else(|error| {
            tracing::warn!(error = %canopy_term::error_chain(error.as_ref()), "ignoring an unreadable status file");
            None
        });
        self.update_status(|status| {
            if let Some(previous) = previous {
                status.tasks_uploaded = previous.tasks_uploaded;
                status.tasks_not_uploaded = previous.tasks_not_uploaded;
                status.last_task = previous.last_task;
                if let Some(task) = status.last_task.as_mut() {
                    if task.result == TaskResult::InProgress {
                        task.finish(
                            TaskResult::Abandoned,
                            Some("the agent stopped while the task ran".into()),
                        );
                    }
                }
            }
            status.pid = Some(std::process::id());
            status.state = AgentState::Idle;
            status.started_unix_ms = Some(now_ms());
            status.device_id = Some(self.client.device_id);
            status.dataset = Some(self.datasets.default_name().to_string());
        });
        tracing::info!(
            device_id = self.client.device_id,
            server = %self.client.transport.url(""),
            dataset = %self.datasets.default_name(),
            max_threads = rayon::current_num_threads(),
            max_memory_mb = self.settings.max_memory_mb,
            only_when_idle = self.settings.only_when_idle,
            poll_wait_ms = self.settings.poll_wait_ms,
            "canopy-agent running"
        );
        let stop = spawn_signal_listener();
        let heartbeats = tokio::spawn(self.clone().heartbeats(stop.clone()));
        self.poll_loop(stop).await;
        heartbeats.abort();
        self.set_state(AgentState::Stopped);
        tracing::info!("canopy-agent stopped");
        Ok(())
    }

    /// Sends heartbeats until the first stop signal, at the interval the
    /// server's last answer asked for.
    async fn heartbeats(self: Arc<Self>, mut stop: watch::Receiver<u32>) {
        let mut interval = clamp_heartbeat(self.heartbeat_ms);
        let mut failing = false;
        loop {
            match self.poller.heartbeat(&self.heartbeat()).await {
                Ok(answer) => {
                    interval = clamp_heartbeat(answer.heartbeat_interval_ms);
                    if failing {
                        tracing::info!("heartbeats reach the server again");
                        failing = false;
                        self.reconnected.notify_one();
                    }
                }
                Err(error) => {
                    failing = true;
                    tracing::warn!(
                        error = %canopy_term::error_chain(&error),
                        retry_in_ms = interval.as_millis() as u64,
                        "heartbeat failed"
                    );
                }
            }
            if sleep_or_stop(interval, &mut stop).await {
                return;
            }
        }
    }

    async fn poll_loop(&self, mut stop: watch::Receiver<u32>) {
        let mut failures = 0u32;
        // Keyed by kind too: a device that declined to train in a round
        // may still evaluate the version that round produced.
        let mut declined: HashMap<(TaskKind, i64), Declined> = HashMap::new();
        let mut deferred = false;
        let mut warned_no_load = false;
        loop {
            if *stop.borrow() > 0 {
                return;
            }
            if self.settings.only_when_idle {
                match load_per_core() {
                    Some(load) if load > IDLE_LOAD_PER_CORE => {
                        if !deferred {
                            tracing::info!(
                                load_per_core = load,
                                threshold = IDLE_LOAD_PER_CORE,
                                "machine busy: deferring task polls"
                            );
                            self.set_state(AgentState::Deferred);
                            deferred = true;
                        } else {
                            tracing::debug!(load_per_core = load, "still busy");
                        }
                        if sleep_or_stop(IDLE_RECHECK, &mut stop).await {
                            return;
                        }
                        continue;
                    }
                    Some(load) if deferred => {
                        tracing::info!(load_per_core = load, "machine idle: polling again");
                        self.set_state(AgentState::Idle);
                        deferred = false;
                    }
                    Some(_) => {}
                    None if !warned_no_load => {
                        tracing::warn!(
                            "--only-when-idle: /proc/loadavg is unreadable here, so polling is never deferred"
                        );
                        warned_no_load = true;
                    }
                    None => {}
                }
            }
            let polled = tokio::select! {
                polled = self.poller.next_task(self.settings.poll_wait_ms) => polled,
                () = stopped(&mut stop, 1) => return,
            };
            let task = match polled {
                Ok(None) => {
                    failures = 0;
                    continue;
                }
                Ok(Some(task)) => {
                    failures = 0;
                    task
                }
                Err(error) => {
                    let delay = POLL_BACKOFF.wait_after(failures, &error);
                    failures = failures.saturating_add(1);
                    self.log_poll_error(&error, delay, failures);
                    tokio::select! {
                        () = tokio::time::sleep(delay) => {}
                        () = self.reconnected.notified() => {
                            tracing::info!("the server answers again: polling now");
                        }
                        () = stopped(&mut stop, 1) => return,
                    }
                    continue;
                }
            };
            let now = now_ms();
            declined.retain(|_, d| d.deadline_unix_ms > now);
            if declined.contains_key(&(task.kind, task.round_id)) {
                // The server may hand a task out again until its deadline
                // (one whose decline did not get through, or a finished
                // secure round's), so wait instead of spinning.
                let wait = task
                    .deadline_unix_ms
                    .saturating_sub(now)
                    .clamp(1_000, self.settings.poll_wait_ms.max(1_000));
                tracing::debug!(
                    round_id = task.round_id,
                    wait_ms = wait,
                    "skipping a declined round"
                );
                if sleep_or_stop(Duration::from_millis(wait), &mut stop).await {
                    return;
                }
                continue;
            }
            let result = self.run_task_until_stopped(&task, &mut stop).await;
            match result {
                None => return,
                // A plain upload ends the task at the server; a secure
                // round's task may still be handed out while the round
                // finishes, and its keys are gone, so it is skipped too.
                Some(TaskResult::Uploaded) if task.secure_aggregation.is_none() => {}
                Some(_) => {
                    if declined.len() >= MAX_DECLINED_ROUNDS {
                        declined.clear();
                    }
                    declined.insert(
                        (task.kind, task.round_id),
                        Declined {
                            deadline_unix_ms: task.deadline_unix_ms,
                        },
                    );
                }
            }
            if *stop.borrow() > 0 {
                return;
            }
            self.set_state(if deferred {
                AgentState::Deferred
            } else {
                AgentState::Idle
            });
        }
    }

    fn log_poll_error(&self, error: &SdkError, delay: Duration, failures: u32) {
        let chain = canopy_term::error_chain(error);
        let retry_in_ms = delay.as_millis() as u64;
        match error.status() {
            Some(401 | 403) => tracing::error!(
                error = %chain,
                retry_in_ms,
                hint = "the device may have been revoked; enroll again with `canopy-agent enroll --force`",
                "the server refused this device"
            ),
            _ => tracing::warn!(error = %chain, retry_in_ms, failures, "task poll failed"),
        }
        self.update_status(|s| s.set_error(&format!("task poll failed: {chain}")));
    }

    /// Runs one task; after a stop signal, gives it [`SHUTDOWN_GRACE`] to
    /// finish. `None` means the daemon must exit now.
    async fn run_task_until_stopped(
        &self,
        task: &canopy_protocol::messages::Task,
        stop: &mut watch::Receiver<u32>,
    ) -> Option<TaskResult> {
        let training = CancelToken::new();
        let work = self.run_task(task, &training);
        tokio::pin!(work);
        tokio::select! {
            result = &mut work => return Some(result),
            () = stopped(stop, 1) => {}
        }
        tracing::info!(
            round_id = task.round_id,
            grace_s = SHUTDOWN_GRACE.as_secs(),
            "stop requested: letting the current task finish"
        );
        let finished = tokio::select! {
            result = tokio::time::timeout(SHUTDOWN_GRACE, &mut work) => result.ok(),
            () = stopped(stop, 2) => None,
        };
        if finished.is_none() {
            // Training runs on a blocking thread the runtime does not wait
            // for; this stops it at its next batch.
            training.cancel();
            tracing::warn!(round_id = task.round_id, "abandoning the current task");
            self.update_status(|s| {
                if let Some(record) = s.last_task.as_mut() {
                    record.finish(
                        TaskResult::Abandoned,
                        Some("the agent was stopped before the task finished".into()),
                    );
                }
                s.tasks_not_uploaded += 1;
            });
        }
        None
    }
}

fn clamp_heartbeat(ms: u64) -> Duration {
    Duration::from_millis(ms).clamp(MIN_HEARTBEAT, MAX_HEARTBEAT)
}

/// The 1-minute load average per core, from `/proc/loadavg`.
fn load_per_core() -> Option<f64> {
    let text = crate::files::read_text(std::path::Path::new("/proc/loadavg"), 4096).ok()??;
    let load: f64 = text.split_whitespace().next()?.parse().ok()?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    Some(load / cores as f64)
}

/// Counts SIGTERM and SIGINT.
fn spawn_signal_listener() -> watch::Receiver<u32> {
    let (sender, receiver) = watch::channel(0u32);
    // Registered here, not in the task, so SIGTERM is caught from the
    // moment this returns.
    #[cfg(unix)]
    let mut terminate =
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(signal) => Some(signal),
            Err(error) => {
                tracing::warn!(%error, "cannot listen for SIGTERM");
                None
            }
        };
    tokio::spawn(async move {
        loop {
            #[cfg(unix)]
            let name = {
                let term = async {
                    match terminate.as_mut() {
                        Some(signal) => signal.recv().await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    _ = term => "SIGTERM",
                    _ = tokio::signal::ctrl_c() => "SIGINT",
                }
            };
            #[cfg(not(unix))]
            let name = {
                let _ = tokio::signal::ctrl_c().await;
                "SIGINT"
            };
            sender.send_modify(|count| *count += 1);
            let count = *sender.borrow();
            if count == 1 {
                tracing::info!(signal = name, "stopping");
            } else {
                tracing::warn!(signal = name, "stopping now");
            }
        }
    });
    receiver
}

/// Resolves once `level` stop signals have arrived.
async fn stopped(stop: &mut watch::Receiver<u32>, level: u32) {
    if stop.wait_for(|count| *count >= level).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// Sleeps; `true` when a stop signal cut the sleep short.
async fn sleep_or_stop(duration: Duration, stop: &mut watch::Receiver<u32>) -> bool {
    tokio::select! {
        () = tokio::time::sleep(duration) => false,
        () = stopped(stop, 1) => true,
    }
}

/// Records a finished or failed task.
/// The error the heartbeat reports: the last task's, while it is the last
/// thing that happened; empty (clearing the server's copy) once a task
/// succeeds after it.
fn heartbeat_error(status: &AgentStatus) -> String {
    let failed_last = status
        .last_task
        .as_ref()
        .is_some_and(|t| !matches!(t.result, TaskResult::Uploaded | TaskResult::InProgress));
    match (&status.last_error, failed_last) {
        (Some(error), true) => error
            .chars()
            .take(canopy_protocol::messages::MAX_LAST_ERROR_CHARS)
            .filter(|c| !c.is_control())
            .collect(),
        _ => String::new(),
    }
}

fn record_outcome(status: &mut AgentStatus, result: TaskResult, detail: Option<String>) {
    if let Some(record) = status.last_task.as_mut() {
        record.finish(result, detail.clone());
    }
    if result == TaskResult::Uploaded {
        status.tasks_uploaded += 1;
    } else {
        status.tasks_not_uploaded += 1;
        if let Some(detail) = detail {
            status.set_error(&format!("task {}: {detail}", result.as_str()));
        }
    }
}

fn new_record(task: &canopy_protocol::messages::Task) -> TaskRecord {
    TaskRecord {
        job_id: task.job_id,
        round_id: task.round_id,
        round_number: task.round_number,
        model_version_id: task.model_version_id,
        model_size_bytes: task.model_size_bytes,
        received_unix_ms: now_ms(),
        finished_unix_ms: None,
        result: TaskResult::InProgress,
        detail: None,
        num_samples: None,
        train_loss: None,
        train_duration_ms: None,
        eval_accuracy: None,
        eval_loss: None,
        eval_samples: None,
    }
}

#[cfg(test)]
mod tests {
    use canopy_engine::select::BackendChoice;

    use super::*;
    use crate::backend::AgentBackend::Engine;
    use crate::config::RunSettings;

    #[test]
    fn flags_override_the_settings_file() {
        let file = FileConfig {
            run: RunSettings {
                dataset: Some("a".into()),
                max_threads: Some(2),
                max_memory_mb: Some(100),
                only_when_idle: Some(true),
                poll_wait_ms: Some(5_000),
                backend: Some(Engine(BackendChoice::Cpu)),
                ..RunSettings::default()
            },
        };
        let args = RunArgs {
            dataset: Some("b".into()),
            max_threads: None,
            max_memory_mb: Some(50),
            only_when_idle: false,
            poll_wait_ms: None,
            backend: Some(Engine(BackendChoice::Gpu)),
            ..RunArgs::default()
        };
        let settings = Settings::merge(args, file).unwrap();
        assert_eq!(settings.dataset.as_deref(), Some("b"));
        assert_eq!(settings.max_threads, Some(2));
        assert_eq!(settings.max_memory_mb, Some(50));
        assert!(settings.only_when_idle);
        assert_eq!(settings.poll_wait_ms, 5_000);
        assert_eq!(settings.backend, Engine(BackendChoice::Gpu));
        let defaults = Settings::merge(RunArgs::default(), FileConfig::default()).unwrap();
        assert_eq!(defaults.poll_wait_ms, DEFAULT_POLL_WAIT_MS);
        assert_eq!(defaults.backend, Engine(BackendChoice::Auto));
        let file: FileConfig = toml::from_str("[run]\nbackend = \"gpu\"\n").unwrap();
        assert_eq!(file.run.backend, Some(Engine(BackendChoice::Gpu)));
        let file: FileConfig = toml::from_str(
            "[run]\nbackend = \"npu\"\nort_library = \"/opt/ort.so\"\nort_providers = \"qnn,cpu\"\n",
        )
        .unwrap();
        assert_eq!(file.run.backend, Some(AgentBackend::Npu));
        assert_eq!(
            file.run.ort_library.as_deref(),
            Some(std::path::Path::new("/opt/ort.so"))
        );
        assert_eq!(file.run.ort_providers.as_deref(), Some("qnn,cpu"));
        let wrong = toml::from_str::<FileConfig>("[run]\nbackend = \"tpu\"\n").unwrap_err();
        assert!(
            wrong.to_string().contains("unknown backend `tpu`"),
            "{wrong}"
        );
        let bad = RunArgs {
            max_threads: Some(0),
            ..RunArgs::default()
        };
        assert!(Settings::merge(bad, FileConfig::default()).is_err());
        let bad = RunArgs {
            poll_wait_ms: Some(200_000),
            ..RunArgs::default()
        };
        assert!(Settings::merge(bad, FileConfig::default()).is_err());
    }

    #[test]
    fn heartbeat_intervals_are_clamped() {
        assert_eq!(clamp_heartbeat(0), MIN_HEARTBEAT);
        assert_eq!(clamp_heartbeat(15_000), Duration::from_secs(15));
        assert_eq!(clamp_heartbeat(u64::MAX), MAX_HEARTBEAT);
    }

    #[test]
    fn load_average_is_read_where_there_is_one() {
        if std::path::Path::new("/proc/loadavg").exists() {
            let load = load_per_core().expect("parsed");
            assert!(load >= 0.0);
        }
    }
}
