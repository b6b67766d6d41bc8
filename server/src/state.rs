//! What every handler shares.

use std::collections::HashMap;
use std::net::IpAddr;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use canopy_protocol::model_sig::ServerKey;
use canopy_protocol::update::UpdateLayout;
use governor::{DefaultKeyedRateLimiter, Quota, RateLimiter};
use tokio::sync::{Notify, Semaphore};

use crate::blobs::BlobStore;
use crate::config::Settings;
use crate::db::Db;
use crate::metrics::Metrics;

/// Layouts are cached per model version; past this many the cache is
/// cleared, which only costs a re-read.
const MAX_CACHED_LAYOUTS: usize = 256;

#[derive(Clone)]
pub struct AppState(pub Arc<Inner>);

pub struct Inner {
    pub db: Db,
    pub blobs: BlobStore,
    pub server_key: ServerKey,
    pub settings: Settings,
    pub metrics: Metrics,
    /// Woken when rounds select devices, so long polls answer at once.
    pub tasks_ready: Notify,
    /// Woken when an update lands, so the orchestrator can close a full round.
    pub orchestrator_wake: Notify,
    /// Woken when a secure round changes stage, so devices' long polls
    /// answer at once.
    pub secagg_progress: Notify,
    pub upload_slots: Semaphore,
    /// Uploads waiting to be folded, batched per round.
    pub folds: crate::api::device::folds::FoldQueue,
    pub sensitive_limiter: DefaultKeyedRateLimiter<IpAddr>,
    pub shutting_down: AtomicBool,
    layouts: std::sync::Mutex<HashMap<i64, Arc<UpdateLayout>>>,
}

impl std::ops::Deref for AppState {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.0
    }
}

impl AppState {
    pub fn new(db: Db, blobs: BlobStore, server_key: ServerKey, settings: Settings) -> AppState {
        let per_minute = NonZeroU32::new(settings.limits.sensitive_requests_per_minute.max(1))
            .unwrap_or(NonZeroU32::MIN);
        AppState(Arc::new(Inner {
            upload_slots: Semaphore::new(settings.limits.max_concurrent_uploads),
            folds: Default::default(),
            sensitive_limiter: RateLimiter::keyed(Quota::per_minute(per_minute)),
            db,
            blobs,
            server_key,
            settings,
            metrics: Metrics::new(),
            tasks_ready: Notify::new(),
            orchestrator_wake: Notify::new(),
            secagg_progress: Notify::new(),
            shutting_down: AtomicBool::new(false),
            layouts: std::sync::Mutex::new(HashMap::new()),
        }))
    }

    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::Relaxed)
    }

    pub fn cached_layout(&self, version_id: i64) -> Option<Arc<UpdateLayout>> {
        self.layouts.lock().ok()?.get(&version_id).cloned()
    }

    pub fn cache_layout(&self, version_id: i64, layout: Arc<UpdateLayout>) {
        if let Ok(mut layouts) = self.layouts.lock() {
            if layouts.len() >= MAX_CACHED_LAYOUTS {
                layouts.clear();
            }
            layouts.insert(version_id, layout);
        }
    }
}
