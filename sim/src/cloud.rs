//! The server a simulation runs against when it names none: the real
//! `canopy-server`, started in this process on a loopback port, SQLite in
//! the simulation's directory, HTTPS with a development certificate, and
//! the limits that one address hosting a whole fleet needs.

use std::path::Path;

/// The central evaluation worker: the in-process server evaluates each
/// version in a child of the running executable (never in its own
/// process), so a binary that hosts a simulation's server must answer this
/// hidden subcommand as `canopy-server` does.
pub use canopy_server::central::worker::{
    SUBCOMMAND as CENTRAL_WORKER, WorkerArgs as CentralWorkerArgs, run as central_worker,
};
use canopy_server::config::{Limits, Settings};
pub use canopy_server::server::Running;

use crate::SimError;
use crate::fleet::{FleetSettings, MAX_ENROLL_CONCURRENCY, MAX_LANES};

/// Settings for an in-process server in `dir` that hosts `fleet`.
///
/// The defaults are sized for devices each on its own address; here every
/// device shares 127.0.0.1, so the per-address bounds (enrollments,
/// credential requests, connections) are raised to the fleet's, and the
/// online window covers two check-in periods, so an idle device stays
/// selectable between its check-ins. Every other bound is the default.
pub fn settings(dir: &Path, devices: usize, fleet: &FleetSettings) -> Settings {
    let defaults = Limits::default();
    let per_address = MAX_ENROLL_CONCURRENCY + MAX_LANES + fleet.max_active;
    let limits = Limits {
        sensitive_requests_per_minute: u32::try_from(devices.saturating_mul(4))
            .unwrap_or(u32::MAX)
            .max(defaults.sensitive_requests_per_minute),
        max_enrollments_per_address: MAX_ENROLL_CONCURRENCY
            .max(defaults.max_enrollments_per_address),
        max_concurrent_enrollments: MAX_ENROLL_CONCURRENCY.max(defaults.max_concurrent_enrollments),
        max_connections_per_address: per_address.max(defaults.max_connections_per_address),
        max_connections: (per_address + 64).max(defaults.max_connections),
        online_window_ms: fleet
            .check_in_ms
            .saturating_mul(2)
            .max(defaults.online_window_ms),
        orchestrator_tick_ms: 50,
        ..defaults
    };
    Settings::local(dir, limits)
}

/// Starts the server [`settings`] describe; its first admin token and its
/// certificate's fingerprint are in the answer.
pub async fn start(dir: &Path, devices: usize, fleet: &FleetSettings) -> Result<Running, SimError> {
    canopy_server::server::start(settings(dir, devices, fleet))
        .await
        .map_err(SimError::Server)
}
