//! The virtual devices: enrollment, check-ins, and each task's work.
//!
//! Every device enrolls with its own Ed25519 key, derived from the
//! simulation's seed and the device's index, so that an idle device keeps
//! no key: it is a [`Slot`] (its id and key index) and a busy flag. After
//! enrollment, slot k holds shard k, slots ordered by device id: the k-th
//! device the server enrolled trains on shard k whatever order concurrent
//! enrollments finished in, as the k-th agent enrolled one after another
//! would (`tests/simulate.rs` relies on this).
//!
//! Devices check in (a task poll that does not wait) once per
//! `check_in_ms`, spread over lanes so that the fleet's polls are paced
//! evenly; a poll that finds a task materialises the device (key, client,
//! its data split) for that task only. Training runs off the async
//! runtime, at most `train_concurrency` at once, through the same
//! `canopy_sdk::local` functions the edge agent calls.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use canopy_engine::data::Dataset;
use canopy_protocol::auth::DeviceKey;
use canopy_protocol::messages::{Capabilities, Heartbeat, Task, TaskKind, Tier};
use canopy_sdk::local::{
    LocalData, evaluate_held_out, round_metrics, train_and_evaluate, training_seed,
};
use canopy_sdk::train::{EvalOptions, TrainOptions, statistics_update};
use canopy_sdk::{CancelToken, DeviceClient, RetryPolicy, SdkError, Transport};
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand_distr::{Distribution, StandardNormal};
use sha2::{Digest, Sha256};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::{MAX_DEVICES, SimError};

/// Most enrollments (and first heartbeats) in flight at once.
pub const MAX_ENROLL_CONCURRENCY: usize = 256;
/// Most check-in lanes: polls in flight at once.
pub const MAX_LANES: usize = 64;
/// Most devices working on a task at once (holding a model and a data
/// split); a lane that finds a task waits for a place.
pub const MAX_ACTIVE_DEVICES: usize = 4_096;
/// How patiently each request of a task is repeated: a simulation shares
/// one server among many devices, so 429 and 503 are expected at peaks.
const TASK_RETRY: RetryPolicy = RetryPolicy {
    max_attempts: 6,
    initial_backoff_ms: 200,
    max_backoff_ms: 5_000,
    multiplier: 2.0,
};
/// The longest default check-in period: half the server's default
/// online window (`online_window_ms`, 60 s), so that idle devices stay
/// online and selectable.
pub const MAX_CHECK_IN_MS: u64 = 30_000;
/// The shortest default check-in period, for small fleets: a selected
/// device finds its task within a twentieth of a second, as an agent's
/// long poll would (a fleet of 50 or fewer polls at most 1,000 times a
/// second).
pub const MIN_CHECK_IN_MS: u64 = 50;
const DOMAIN: &[u8] = b"canopy-sim-device-key-v1";

/// How the fleet behaves; [`FleetSettings::new`] gives what a simulation
/// of `devices` devices wants.
#[derive(Clone, Debug)]
pub struct FleetSettings {
    /// Seeds the devices' keys (and nothing the server computes).
    pub seed: u64,
    /// The name each device reports its shard under.
    pub dataset: String,
    /// How often an idle device checks in for a task.
    pub check_in_ms: u64,
    pub enroll_concurrency: usize,
    /// Tasks computed at once (training, evaluation, statistics).
    pub train_concurrency: usize,
    /// Devices working on a task at once.
    pub max_active: usize,
    /// How long each device takes per training step, beyond the host's
    /// own compute; `None`: as fast as the host computes.
    pub step_time: Option<StepTime>,
    /// Which of the simulation's devices this fleet hosts, when several
    /// processes share them: its first shard is device `first_device` of
    /// `all_devices`, which seeds that device's key and draws its speed.
    /// One process hosts them all by default.
    pub part: Option<FleetPart>,
    /// Devices that poison their training updates, to try a job's robust
    /// aggregation; all honest when `None`.
    pub attack: Option<Attack>,
}

/// The simulation's first `devices` devices (by index over every part)
/// send poisoned updates: they train honestly, then change the update
/// they send as `kind` says. Their sample counts stay honest.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Attack {
    pub devices: usize,
    pub kind: AttackKind,
}

/// How an attacker changes its update Δ.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum AttackKind {
    /// Sends `factor`·Δ (model replacement's boost).
    Scale { factor: f32 },
    /// Sends −`factor`·Δ: the update pushed back up the loss.
    SignFlip { factor: f32 },
}

impl AttackKind {
    /// The most an attack may scale an update by.
    pub const MAX_FACTOR: f32 = 1e6;

    /// `scale:F` or `sign-flip[:F]` (F 1 when left out).
    pub fn parse(text: &str) -> Result<AttackKind, String> {
        let (name, factor) = match text.split_once(':') {
            Some((name, factor)) => {
                let factor: f32 = factor
                    .parse()
                    .map_err(|_| format!("`{factor}` is not a number"))?;
                (name, Some(factor))
            }
            None => (text, None),
        };
        if let Some(factor) = factor.filter(|f| !(f.is_finite() && f.abs() <= Self::MAX_FACTOR)) {
            return Err(format!(
                "the factor must be finite and at most {} in size, got {factor}",
                Self::MAX_FACTOR
            ));
        }
        match (name, factor) {
            ("scale", Some(factor)) => Ok(AttackKind::Scale { factor }),
            ("scale", None) => Err("`scale` needs its factor: `scale:10`".into()),
            ("sign-flip", factor) => Ok(AttackKind::SignFlip {
                factor: factor.unwrap_or(1.0),
            }),
            _ => Err(format!(
                "unknown attack `{name}`: `scale:F` or `sign-flip[:F]`"
            )),
        }
    }

    /// The multiplier of Δ the attack sends.
    fn multiplier(self) -> f32 {
        match self {
            AttackKind::Scale { factor } => factor,
            AttackKind::SignFlip { factor } => -factor,
        }
    }
}

/// The devices one of several processes hosts: its shards are devices
/// `first_device..first_device + shards` of `all_devices`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FleetPart {
    pub first_device: usize,
    pub all_devices: usize,
}

/// Simulated device speeds: each device's time per training step, drawn
/// log-normal and rescaled so that the slowest device takes exactly
/// `spread` times as long as the fastest, with `median_ms` their geometric
/// middle. A device waits that long per step after computing its update
/// (the host computes every device at its own speed), so a synchronous
/// round waits for its slowest device as a real one does.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepTime {
    pub median_ms: f64,
    pub spread: f64,
}

/// Most milliseconds a simulated step may take.
pub const MAX_STEP_MS: f64 = 60_000.0;
/// Largest ratio between the slowest and the fastest device.
pub const MAX_SPREAD: f64 = 1_000.0;

impl StepTime {
    /// `devices` step times in milliseconds, reproducibly from `seed`.
    pub fn per_device(self, devices: usize, seed: u64) -> Vec<f32> {
        let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed_57e9);
        let z: Vec<f64> = (0..devices)
            .map(|_| StandardNormal.sample(&mut rng))
            .collect();
        let low = z.iter().copied().fold(f64::INFINITY, f64::min);
        let high = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let width = high - low;
        z.iter()
            .map(|&z| {
                let position = if width > 0.0 {
                    (z - low) / width - 0.5
                } else {
                    0.0
                };
                (self.median_ms * self.spread.powf(position)) as f32
            })
            .collect()
    }
}

impl FleetSettings {
    /// Check-ins paced at about 1,000 polls a second over the fleet, each
    /// device's between [`MIN_CHECK_IN_MS`] and [`MAX_CHECK_IN_MS`] apart; as many trainings
    /// at once as the machine has cores.
    pub fn new(devices: usize, seed: u64, dataset: &str) -> FleetSettings {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        FleetSettings {
            seed,
            dataset: dataset.to_string(),
            check_in_ms: (devices as u64).clamp(MIN_CHECK_IN_MS, MAX_CHECK_IN_MS),
            enroll_concurrency: devices.clamp(1, 32),
            train_concurrency: cores,
            max_active: devices.clamp(1, MAX_ACTIVE_DEVICES),
            step_time: None,
            part: None,
            attack: None,
        }
    }
}

/// What a device is between tasks: the server's id for it and the index
/// its key derives from. 12 bytes (16 with padding) per idle device.
#[derive(Clone, Copy, Debug)]
struct Slot {
    device_id: i64,
    key_index: u32,
}

/// What the fleet did, counted as it ran.
#[derive(Debug, Default)]
struct Counters {
    polls: AtomicU64,
    poll_errors: AtomicU64,
    trained: AtomicU64,
    evaluated: AtomicU64,
    statistics: AtomicU64,
    failed: AtomicU64,
    /// The first failed task's reason, for the report.
    first_failure: std::sync::Mutex<Option<String>>,
}

/// [`Counters`] read once.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct FleetReport {
    pub devices: usize,
    pub polls: u64,
    pub poll_errors: u64,
    /// Training tasks whose update the server accepted.
    pub trained: u64,
    pub evaluated: u64,
    pub statistics: u64,
    /// Tasks that ended in an error (each declined, where it could be).
    pub failed: u64,
    /// Why the first of them failed.
    pub first_failure: Option<String>,
}

/// An enrolled fleet of virtual devices.
pub struct Fleet {
    shared: Arc<Shared>,
}

struct Shared {
    transport: Transport,
    server_key: String,
    settings: FleetSettings,
    shards: Vec<Dataset>,
    slots: Vec<Slot>,
    busy: Vec<AtomicBool>,
    counters: Counters,
    compute: Semaphore,
    active: Arc<Semaphore>,
    /// Each slot's simulated time per training step, in milliseconds;
    /// empty when devices run at the host's speed. 4 bytes a device.
    step_ms: Vec<f32>,
    /// The index over every part of this fleet's first device.
    first_device: usize,
}

/// Device `index`'s key: SHA-256 over the domain, the seed and the index.
fn device_key(seed: u64, index: u32) -> DeviceKey {
    let mut hash = Sha256::new();
    hash.update(DOMAIN);
    hash.update(seed.to_le_bytes());
    hash.update(index.to_le_bytes());
    DeviceKey::from_bytes(&hash.finalize().into())
}

fn capabilities() -> Capabilities {
    Capabilities {
        tier: Tier::End,
        backends: vec!["cpu".into()],
        memory_mb: 1_024,
        os: "canopy-sim".into(),
        tags: [("simulated".to_string(), "true".to_string())].into(),
        gpu: None,
    }
}

impl Fleet {
    /// Enrolls one device per shard with `enrollment_token` (at most
    /// `settings.enroll_concurrency` at once), pairs slot k with shard k
    /// in order of device id, and has each device report its shard.
    /// `progress` hears the devices enrolled so far.
    pub async fn enroll(
        transport: Transport,
        enrollment_token: &str,
        shards: Vec<Dataset>,
        settings: FleetSettings,
        progress: impl Fn(usize),
    ) -> Result<Fleet, SimError> {
        let devices = shards.len();
        if devices == 0 {
            return Err(SimError::NoDevices);
        }
        if devices > MAX_DEVICES {
            return Err(SimError::TooManyDevices { devices });
        }
        let part = settings.part.unwrap_or(FleetPart {
            first_device: 0,
            all_devices: devices,
        });
        let hosted = part.first_device..part.first_device.saturating_add(devices);
        if hosted.end > part.all_devices || part.all_devices > MAX_DEVICES {
            return Err(SimError::BadPart {
                first: hosted.start,
                end: hosted.end,
                all: part.all_devices,
            });
        }
        let mut enrolled: Vec<(i64, u32)> = Vec::with_capacity(devices);
        let mut server_key = String::new();
        let (token, seed) = (enrollment_token.to_string(), settings.seed);
        let enroll_one = |index: usize| {
            let (transport, token) = (transport.clone(), token.clone());
            async move {
                // Below MAX_DEVICES, checked above: a u32.
                let key_index = (part.first_device + index) as u32;
                let key = device_key(seed, key_index);
                canopy_sdk::enroll_with(
                    &transport,
                    &token,
                    &key,
                    capabilities(),
                    &TASK_RETRY,
                    &CancelToken::new(),
                )
                .await
                .map(|answer| (answer, key_index))
                .map_err(|source| SimError::Enroll { index, source })
            }
        };
        bounded(
            devices,
            settings.enroll_concurrency,
            enroll_one,
            |(answer, key_index)| {
                server_key = answer.server_public_key;
                enrolled.push((answer.device_id, key_index));
                progress(enrolled.len());
            },
        )
        .await?;
        enrolled.sort_unstable();
        let slots: Vec<Slot> = enrolled
            .into_iter()
            .map(|(device_id, key_index)| Slot {
                device_id,
                key_index,
            })
            .collect();
        let shared = Arc::new(Shared {
            transport,
            server_key,
            busy: (0..devices).map(|_| AtomicBool::new(false)).collect(),
            counters: Counters::default(),
            compute: Semaphore::new(settings.train_concurrency.max(1)),
            active: Arc::new(Semaphore::new(
                settings.max_active.clamp(1, MAX_ACTIVE_DEVICES),
            )),
            step_ms: settings
                .step_time
                .map(|time| time.per_device(part.all_devices, settings.seed)[hosted].to_vec())
                .unwrap_or_default(),
            first_device: part.first_device,
            settings,
            shards,
            slots,
        });
        report_datasets(&shared).await?;
        Ok(Fleet { shared })
    }

    pub fn len(&self) -> usize {
        self.shared.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.shared.slots.is_empty()
    }

    /// What the fleet keeps for a device that has no task: its slot and its
    /// busy flag (its shard is the simulation's data, not the device's
    /// state).
    pub const fn idle_bytes_per_device() -> usize {
        std::mem::size_of::<Slot>() + std::mem::size_of::<AtomicBool>()
    }

    /// Checks the devices in until `stop` fires, then waits for the tasks
    /// under way to end (their requests observe `stop` too).
    pub async fn run(&self, stop: CancelToken) -> FleetReport {
        let lanes = self.len().clamp(1, MAX_LANES);
        let mut running = JoinSet::new();
        for lane in 0..lanes {
            let shared = self.shared.clone();
            let stop = stop.clone();
            running.spawn(async move { check_in_lane(shared, lane, lanes, stop).await });
        }
        while running.join_next().await.is_some() {}
        self.report()
    }

    pub fn report(&self) -> FleetReport {
        let c = &self.shared.counters;
        FleetReport {
            devices: self.len(),
            polls: c.polls.load(Ordering::Relaxed),
            poll_errors: c.poll_errors.load(Ordering::Relaxed),
            trained: c.trained.load(Ordering::Relaxed),
            evaluated: c.evaluated.load(Ordering::Relaxed),
            statistics: c.statistics.load(Ordering::Relaxed),
            failed: c.failed.load(Ordering::Relaxed),
            first_failure: c
                .first_failure
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
        }
    }
}

impl Shared {
    /// Slot `slot`'s device, materialised: its key and a client.
    fn client(&self, slot: usize, cancel: CancelToken) -> Result<DeviceClient, SdkError> {
        let Slot {
            device_id,
            key_index,
        } = self.slots[slot];
        let key = device_key(self.settings.seed, key_index);
        Ok(
            DeviceClient::new(self.transport.clone(), device_id, key, &self.server_key)?
                .with_retry_policy(TASK_RETRY)
                .with_cancel_token(cancel),
        )
    }
}

/// Runs `work(i)` for every `i` in `0..count`, at most `concurrency`
/// (up to [`MAX_ENROLL_CONCURRENCY`]) at once on the runtime's threads,
/// handing each result to `done` as it finishes; the first error stops it.
async fn bounded<T, Fut>(
    count: usize,
    concurrency: usize,
    work: impl Fn(usize) -> Fut,
    mut done: impl FnMut(T),
) -> Result<(), SimError>
where
    T: Send + 'static,
    Fut: std::future::Future<Output = Result<T, SimError>> + Send + 'static,
{
    let concurrency = concurrency.clamp(1, MAX_ENROLL_CONCURRENCY);
    let mut running = JoinSet::new();
    let mut next = 0;
    while next < count || !running.is_empty() {
        while running.len() < concurrency && next < count {
            running.spawn(work(next));
            next += 1;
        }
        if let Some(joined) = running.join_next().await {
            done(joined.expect("enrollment and heartbeats do not panic")?);
        }
    }
    Ok(())
}

/// Each device's first heartbeat, which offers its shard.
async fn report_datasets(shared: &Arc<Shared>) -> Result<(), SimError> {
    let beat = |slot: usize| {
        let shared = shared.clone();
        async move { heartbeat(&shared, slot).await }
    };
    bounded(
        shared.slots.len(),
        shared.settings.enroll_concurrency,
        beat,
        |()| {},
    )
    .await
}

async fn heartbeat(shared: &Shared, slot: usize) -> Result<(), SimError> {
    let info = canopy_sdk::describe_dataset(&shared.settings.dataset, &shared.shards[slot])
        .map_err(|source| SimError::Dataset {
            index: slot,
            source,
        })?;
    let device_id = shared.slots[slot].device_id;
    let failed = |source| SimError::Heartbeat {
        index: slot,
        device_id,
        source,
    };
    let client = shared.client(slot, CancelToken::new()).map_err(failed)?;
    let beat = Heartbeat {
        state: Some("idle".into()),
        round_id: None,
        datasets: Some(vec![info]),
        last_error: None,
        conditions: None,
    };
    client.heartbeat(&beat).await.map_err(failed)?;
    Ok(())
}

/// Lane `lane` of `lanes`: checks in its slots (`lane`, `lane + lanes`,
/// ...) in turn, one poll at a time, so that each comes round once per
/// `check_in_ms`.
async fn check_in_lane(shared: Arc<Shared>, lane: usize, lanes: usize, stop: CancelToken) {
    let slots: Vec<usize> = (lane..shared.slots.len()).step_by(lanes).collect();
    let gap = Duration::from_millis(shared.settings.check_in_ms) / slots.len().max(1) as u32;
    let mut ticks = tokio::time::interval(gap);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut tasks = JoinSet::new();
    'sweeps: loop {
        for &slot in &slots {
            if stop.run(ticks.tick()).await.is_none() {
                break 'sweeps;
            }
            while tasks.try_join_next().is_some() {}
            if shared.busy[slot].load(Ordering::Acquire) {
                continue;
            }
            let Some((client, task)) = check_in(&shared, slot, &stop).await else {
                continue;
            };
            let Some(Ok(place)) = stop.run(shared.active.clone().acquire_owned()).await else {
                break 'sweeps;
            };
            shared.busy[slot].store(true, Ordering::Release);
            let (shared, stop) = (shared.clone(), stop.clone());
            tasks.spawn(async move {
                let _place = place;
                let (mut client, mut task) = (client, task);
                // As an agent does, a device asks for its next task as soon
                // as it finishes one, not at its next paced check-in.
                loop {
                    work(&shared, slot, &client, task, stop.clone()).await;
                    match check_in(&shared, slot, &stop).await {
                        Some((next_client, next_task)) => (client, task) = (next_client, next_task),
                        None => break,
                    }
                }
                shared.busy[slot].store(false, Ordering::Release);
            });
        }
    }
    while tasks.join_next().await.is_some() {}
}

/// One check-in: the device's task, if it has one, and the device's
/// client, which then works on it.
async fn check_in(
    shared: &Shared,
    slot: usize,
    stop: &CancelToken,
) -> Option<(DeviceClient, Task)> {
    shared.counters.polls.fetch_add(1, Ordering::Relaxed);
    let polled = match shared.client(slot, stop.clone()) {
        Ok(client) => client
            .next_task(0)
            .await
            .map(|task| task.map(|task| (client, task))),
        Err(error) => Err(error),
    };
    match polled {
        Ok(found) => found,
        Err(SdkError::Cancelled) => None,
        Err(error) => {
            shared.counters.poll_errors.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(slot, error = %canopy_term::error_chain(&error), "check-in failed");
            None
        }
    }
}

/// A task's work, to its end; a failure is counted, logged and declined.
async fn work(
    shared: &Arc<Shared>,
    slot: usize,
    client: &DeviceClient,
    task: Task,
    stop: CancelToken,
) {
    let kind = task.kind;
    match run_task(shared, slot, client, &task, &stop).await {
        Ok(()) => {
            let counter = match kind {
                TaskKind::Train => &shared.counters.trained,
                TaskKind::Evaluate => &shared.counters.evaluated,
                TaskKind::Statistics => &shared.counters.statistics,
            };
            counter.fetch_add(1, Ordering::Relaxed);
        }
        Err(TaskError::Stopped) => {}
        Err(TaskError::Failed(reason)) => {
            shared.counters.failed.fetch_add(1, Ordering::Relaxed);
            shared
                .counters
                .first_failure
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get_or_insert_with(|| format!("round {}: {reason}", task.round_id));
            // Counted and reported at the end: a fleet's failures would
            // bury the round table.
            tracing::debug!(
                device_id = client.device_id,
                round_id = task.round_id,
                %reason,
                "simulated task failed"
            );
            // Best effort, as an agent does: without it the server would
            // keep handing out this task until its deadline.
            let _ = client.decline_task(&task, &reason).await;
        }
    }
}

enum TaskError {
    /// The simulation is stopping.
    Stopped,
    Failed(String),
}

impl From<SdkError> for TaskError {
    fn from(error: SdkError) -> TaskError {
        match error {
            SdkError::Cancelled => TaskError::Stopped,
            error => TaskError::Failed(canopy_term::error_chain(&error)),
        }
    }
}

async fn run_task(
    shared: &Arc<Shared>,
    slot: usize,
    client: &DeviceClient,
    task: &Task,
    stop: &CancelToken,
) -> Result<(), TaskError> {
    if let Err(bounds) = task.validate() {
        return Err(TaskError::Failed(format!(
            "the task is outside the bounds devices accept: {bounds}"
        )));
    }
    if task.secure_aggregation.is_some() {
        return Err(TaskError::Failed(
            "simulated devices do not take part in secure rounds yet".into(),
        ));
    }
    let model = client.download_model(task).await?;
    let Some(Ok(compute_place)) = stop.run(shared.compute.acquire()).await else {
        return Err(TaskError::Stopped);
    };
    let owned = (shared.clone(), task.clone(), stop.clone());
    let device_id = client.device_id;
    let computed = tokio::task::spawn_blocking(move || {
        let (shared, task, stop) = owned;
        compute(&shared, slot, device_id, &task, &model.bytes, stop)
    })
    .await
    .map_err(|join| TaskError::Failed(format!("the device's computation stopped: {join}")))?;
    // The host's compute is free again: the device's own time, the upload
    // and the metrics wait without it.
    drop(compute_place);
    match computed? {
        Computed::Update { update, metrics } => {
            device_time(shared, slot, task, update.num_samples, stop).await?;
            client
                .upload_update(task, Bytes::from(update.encoded))
                .await?;
            if let Some(metrics) = metrics.filter(|m| m.validate().is_ok()) {
                // The update counts; the metrics are informational.
                let _ = client.report_metrics(&metrics).await;
            }
        }
        Computed::Evaluation(evaluation) => client.report_evaluation(task, &evaluation).await?,
    }
    Ok(())
}

/// Waits out the simulated device's own time for a training task's steps
/// (none for statistics, which train nothing).
async fn device_time(
    shared: &Shared,
    slot: usize,
    task: &Task,
    samples: u64,
    stop: &CancelToken,
) -> Result<(), TaskError> {
    let Some(&step_ms) = shared.step_ms.get(slot) else {
        return Ok(());
    };
    if task.kind != TaskKind::Train {
        return Ok(());
    }
    let batch = u64::from(task.training.batch_size.max(1));
    let steps = u64::from(task.training.epochs) * samples.div_ceil(batch);
    let wait = Duration::from_secs_f64(f64::from(step_ms) * steps as f64 / 1_000.0);
    match stop.run(tokio::time::sleep(wait)).await {
        Some(()) => Ok(()),
        None => Err(TaskError::Stopped),
    }
}

enum Computed {
    Update {
        update: canopy_sdk::train::LocalUpdate,
        metrics: Option<canopy_protocol::messages::RoundMetrics>,
    },
    Evaluation(canopy_sdk::train::Evaluation),
}

/// The update slot `slot` sends: its own, or, for an attacker, the
/// attack's change of it.
fn poisoned(
    shared: &Shared,
    slot: usize,
    task: &Task,
    mut update: canopy_sdk::train::LocalUpdate,
) -> Result<canopy_sdk::train::LocalUpdate, canopy_protocol::update::UpdateError> {
    let Some(attack) = shared.settings.attack else {
        return Ok(update);
    };
    if shared.first_device + slot >= attack.devices {
        return Ok(update);
    }
    let multiplier = attack.kind.multiplier();
    update
        .delta
        .iter_mut()
        .for_each(|value| *value *= multiplier);
    update.encoded =
        canopy_protocol::update::encode_update(&task.layout, update.num_samples, &update.delta)?;
    Ok(update)
}

/// A task's computation on slot `slot`'s shard, as an agent's would be.
fn compute(
    shared: &Shared,
    slot: usize,
    device_id: i64,
    task: &Task,
    model: &[u8],
    stop: CancelToken,
) -> Result<Computed, TaskError> {
    let failed = |error: &dyn std::error::Error| TaskError::Failed(canopy_term::error_chain(error));
    let data =
        LocalData::split(&shared.settings.dataset, &shared.shards[slot]).map_err(|e| failed(&e))?;
    match task.kind {
        TaskKind::Train => {
            let options = TrainOptions {
                cancel: stop,
                ..TrainOptions::default()
            };
            let seed = training_seed(device_id, task.round_id);
            let (evaluation, update) =
                train_and_evaluate(model, task, &data, seed, &options).map_err(|e| failed(&e))?;
            let metrics = round_metrics(task, evaluation, &update);
            let update = poisoned(shared, slot, task, update).map_err(|e| failed(&e))?;
            Ok(Computed::Update {
                update,
                metrics: Some(metrics),
            })
        }
        TaskKind::Statistics => {
            let update = statistics_update(model, task, &data.train).map_err(|e| failed(&e))?;
            Ok(Computed::Update {
                update,
                metrics: None,
            })
        }
        TaskKind::Evaluate => {
            let evaluation =
                evaluate_held_out(model, &data, &EvalOptions::default()).map_err(|e| failed(&e))?;
            Ok(Computed::Evaluation(evaluation))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_differ_by_index_and_seed_and_are_reproducible() {
        let public = |seed, index| device_key(seed, index).public_key_hex();
        assert_eq!(public(1, 2), public(1, 2));
        assert_ne!(public(1, 2), public(1, 3));
        assert_ne!(public(1, 2), public(2, 2));
    }

    #[test]
    fn an_idle_device_costs_a_few_bytes() {
        assert!(Fleet::idle_bytes_per_device() <= 24);
    }

    #[test]
    fn step_times_span_the_spread_around_the_median() {
        let time = StepTime {
            median_ms: 100.0,
            spread: 10.0,
        };
        let times = time.per_device(20, 3);
        let fastest = times.iter().copied().fold(f32::INFINITY, f32::min);
        let slowest = times.iter().copied().fold(0.0, f32::max);
        assert!(
            (slowest / fastest - 10.0).abs() < 1e-3,
            "{fastest} to {slowest}"
        );
        assert!((f64::from(fastest * slowest).sqrt() - 100.0).abs() < 1e-2);
        assert_eq!(times, time.per_device(20, 3), "reproducible");
        assert_ne!(times, time.per_device(20, 4));
        assert_eq!(time.per_device(1, 3), vec![100.0]);
    }

    #[test]
    fn check_ins_are_paced_for_the_fleet() {
        assert_eq!(FleetSettings::new(10, 1, "d").check_in_ms, MIN_CHECK_IN_MS);
        assert_eq!(FleetSettings::new(20_000, 1, "d").check_in_ms, 20_000);
        assert_eq!(
            FleetSettings::new(100_000, 1, "d").check_in_ms,
            MAX_CHECK_IN_MS
        );
    }
}
