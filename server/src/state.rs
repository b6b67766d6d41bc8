//! What every handler shares.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use canopy_protocol::update::UpdateLayout;
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use tokio::sync::{Notify, Semaphore};

use crate::inflight::InFlight;
use crate::slots::UploadSlots;

use crate::blobs::BlobStore;
use crate::config::Settings;
use crate::db::Db;
use crate::metrics::Metrics;
use crate::signing::SigningRing;

#[derive(Clone)]
pub struct AppState(pub Arc<Inner>);

pub struct Inner {
    pub db: Db,
    pub blobs: BlobStore,
    /// The model-signing keys, reloaded from the database periodically.
    pub signing: SigningRing,
    pub settings: Settings,
    pub metrics: Arc<Metrics>,
    /// Woken when rounds select devices, so long polls answer at once
    /// (through [`AppState::announcing`], which also refreshes the board).
    pub tasks_ready: Notify,
    /// Woken when an update lands, so the orchestrator can close a full round.
    pub orchestrator_wake: Notify,
    /// Woken when a secure round changes stage, so devices' long polls
    /// answer at once.
    pub secagg_progress: Notify,
    /// Device uploads: updates and masked inputs (see `slots.rs`).
    pub upload_slots: UploadSlots,
    /// Operators' model and dataset uploads.
    pub model_upload_slots: UploadSlots,
    /// Model files verified, and datasets parsed, at once: one, since each
    /// holds the file and what it parses to in memory.
    pub model_verification: Semaphore,
    /// The last readiness ping (when, and whether the database answered),
    /// shared by `/readyz` probes.
    pub readiness: tokio::sync::Mutex<Option<(std::time::Instant, bool)>>,
    /// Which devices have a task waiting, shared by the waiting task polls.
    pub task_board: crate::api::device::TaskBoard,
    /// The request pools, drawn on by kind (see `request_slots.rs`).
    pub request_slots: Arc<crate::request_slots::RequestSlots>,
    /// Requests and task polls each device has in flight.
    pub device_requests: Arc<InFlight<i64>>,
    pub device_polls: Arc<InFlight<i64>>,
    pub device_keys: crate::device_keys::DeviceKeys,
    /// Signed requests' nonces, written in batches, with each device's
    /// seen-time.
    pub nonces: crate::store::devices::NonceBook,
    /// Devices refused at their rate or in-flight cap, until their
    /// `Retry-After` has passed.
    pub throttled_devices: crate::inflight::Throttle<i64>,
    /// Uploads waiting to be folded, batched per round.
    pub folds: crate::api::device::folds::FoldQueue<crate::store::rounds::AcceptedUpdate>,
    /// The graphs and survivor sets of secure rounds in progress.
    pub secure_graphs: crate::secure::RoundCache<canopy_protocol::secagg::graph::Graph>,
    pub secure_survivors: crate::secure::RoundCache<Vec<u64>>,
    /// Secure rounds' participant rows once ShareKeys, and once
    /// Unmasking, has opened.
    pub secure_key_rows: crate::secure::RoundCache<Vec<crate::store::secagg::SecureParticipant>>,
    pub secure_unmask_rows: crate::secure::RoundCache<Vec<crate::store::secagg::SecureParticipant>>,
    /// Each secure round's devices excluded at ShareCheck, once it closed.
    pub secure_exclusions: crate::secure::RoundCache<std::collections::BTreeSet<u64>>,
    /// Secure rounds' stages, as long polls re-check them.
    pub secure_progress: crate::secure::ProgressSnapshots,
    /// Secure rounds' masked inputs waiting to be folded, batched per round.
    pub masked_folds: crate::api::device::folds::FoldQueue<crate::store::secagg::MaskedUpload>,
    /// Secure rounds' key-stage, ConsistencyCheck and Unmasking messages.
    pub stage_writes: crate::api::device::folds::FoldQueue<crate::store::secagg::QueuedWrite>,
    /// `sensitive_requests_per_minute`, per credential route and client.
    pub sensitive_limiter: DefaultKeyedRateLimiter<(
        crate::request_slots::CredentialRoute,
        crate::conn::ClientAddress,
    )>,
    /// `device_requests_per_second`, per device.
    pub device_limiter: DefaultKeyedRateLimiter<i64>,
    pub shutting_down: AtomicBool,
    layouts: std::sync::Mutex<HashMap<i64, Arc<UpdateLayout>>>,
    /// Sample shapes of model versions, for selecting devices by dataset.
    input_shapes: std::sync::Mutex<HashMap<i64, Vec<u64>>>,
}

/// `per_second` sustained, bursts of twice that.
fn device_quota(per_second: u32) -> Quota {
    let rate = NonZeroU32::new(per_second).unwrap_or(NonZeroU32::MIN);
    let burst = NonZeroU32::new(per_second.saturating_mul(2)).unwrap_or(rate);
    Quota::per_second(rate).allow_burst(burst)
}

impl std::ops::Deref for AppState {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.0
    }
}

impl AppState {
    pub fn new(db: Db, blobs: BlobStore, signing: SigningRing, settings: Settings) -> AppState {
        let per_minute = NonZeroU32::new(settings.limits.sensitive_requests_per_minute.max(1))
            .unwrap_or(NonZeroU32::MIN);
        let limits = &settings.limits;
        AppState(Arc::new(Inner {
            upload_slots: UploadSlots::new(
                "max_concurrent_uploads",
                limits.max_concurrent_uploads,
                limits.upload_slot_wait_ms,
            ),
            model_upload_slots: UploadSlots::new(
                "max_concurrent_model_uploads",
                limits.max_concurrent_model_uploads,
                limits.upload_slot_wait_ms,
            ),
            model_verification: Semaphore::new(1),
            readiness: Default::default(),
            task_board: Default::default(),
            request_slots: Arc::new(crate::request_slots::RequestSlots::new(limits)),
            device_requests: InFlight::new(limits.max_requests_per_device),
            device_polls: InFlight::new(limits.max_polls_per_device),
            device_keys: Default::default(),
            nonces: Default::default(),
            throttled_devices: Default::default(),
            folds: Default::default(),
            masked_folds: Default::default(),
            stage_writes: Default::default(),
            secure_graphs: Default::default(),
            secure_key_rows: crate::secure::RoundCache::with_capacity(
                crate::secure::MAX_CACHED_ROW_ROUNDS,
            ),
            secure_unmask_rows: crate::secure::RoundCache::with_capacity(
                crate::secure::MAX_CACHED_ROW_ROUNDS,
            ),
            secure_survivors: Default::default(),
            secure_exclusions: Default::default(),
            secure_progress: Default::default(),
            sensitive_limiter: RateLimiter::keyed(Quota::per_minute(per_minute)),
            device_limiter: RateLimiter::keyed(device_quota(limits.device_requests_per_second)),
            db,
            blobs,
            signing,
            settings,
            metrics: Arc::new(Metrics::new()),
            tasks_ready: Notify::new(),
            orchestrator_wake: Notify::new(),
            secagg_progress: Notify::new(),
            shutting_down: AtomicBool::new(false),
            layouts: std::sync::Mutex::new(HashMap::new()),
            input_shapes: std::sync::Mutex::new(HashMap::new()),
        }))
    }

    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::Relaxed)
    }

    /// Held across the commit of a transaction that gives devices tasks.
    /// While it is held no poll trusts the task board; when it drops,
    /// waiting polls look again and the board is read anew.
    pub fn announcing(&self) -> Announcing<'_> {
        self.task_board.selection_begins();
        Announcing { state: self }
    }

    pub fn cached_layout(&self, version_id: i64) -> Option<Arc<UpdateLayout>> {
        self.layouts.lock().ok()?.get(&version_id).cloned()
    }

    pub fn cached_input_shape(&self, version_id: i64) -> Option<Vec<u64>> {
        self.input_shapes.lock().ok()?.get(&version_id).cloned()
    }

    /// Bounded like the layout cache: cleared whole when full.
    pub fn cache_input_shape(&self, version_id: i64, shape: Vec<u64>) {
        if let Ok(mut shapes) = self.input_shapes.lock() {
            if shapes.len() >= self.settings.limits.max_cached_layouts {
                shapes.clear();
            }
            shapes.insert(version_id, shape);
        }
    }

    pub fn cache_layout(&self, version_id: i64, layout: Arc<UpdateLayout>) {
        if let Ok(mut layouts) = self.layouts.lock() {
            if layouts.len() >= self.settings.limits.max_cached_layouts {
                layouts.clear();
            }
            layouts.insert(version_id, layout);
        }
    }
}

/// A selection being committed; see [`AppState::announcing`].
#[must_use = "the announcement is made when this drops, after the commit"]
pub struct Announcing<'a> {
    state: &'a AppState,
}

impl Drop for Announcing<'_> {
    fn drop(&mut self) {
        self.state.task_board.selection_ends();
        self.state.tasks_ready.notify_waiters();
    }
}
