//! An edge aggregator (ARCHITECTURE.md, "The edge tier"): a device to the
//! cloud and a server to its own end devices.
//!
//! To its devices the edge is a Canopy server: `canopy-server`'s own
//! device API, admin API, orchestrator and stores, on the edge's database,
//! started by [`canopy_server::server::start_relay`] so that it hands its
//! devices the cloud's model signatures instead of signing any itself.
//! To the cloud it is a device enrolled as an `aggregator`, through the
//! SDK's [`DeviceClient`]. Between the two:
//!
//! - [`sub_round`]: a task from the cloud becomes a sub-round, a local job
//!   of one round on the cloud's version (downloaded and verified once,
//!   kept by digest), opened in one transaction with its uplink row;
//! - the server's orchestrator runs that round like any other, and where a
//!   cloud round would write a version it keeps the devices' weighted mean
//!   in the uplink row;
//! - [`uplink`]: sends each kept result to the cloud, or tells the cloud
//!   why a sub-round failed;
//! - [`secure`]: in a secure cloud round, the edge is a SecAgg+
//!   participant among the aggregators: it exchanges keys while its
//!   sub-round (secure among its own devices) runs, then masks the result.
//!
//! *Architecture invariant:* nothing here aggregates, selects or admits:
//! that is the server's code, run on the edge's database. This crate only
//! moves tasks down and results up.

mod cloud;
mod secure;
mod sub_round;
mod uplink;

use std::time::Duration;

use canopy_sdk::{DeviceClient, SigningKeys};
use canopy_server::config::Settings;
use canopy_server::server::{self, ServeError};
use canopy_server::state::AppState;

pub use sub_round::local_job_spec;

/// Why the edge stopped.
#[derive(Debug, thiserror::Error)]
pub enum EdgeError {
    #[error("the edge's server failed")]
    Serve(#[from] ServeError),
}

impl EdgeError {
    pub fn hint(&self) -> Option<String> {
        match self {
            EdgeError::Serve(error) => error.hint(),
        }
    }
}

/// How the edge talks to the cloud.
#[derive(Clone, Debug)]
pub struct EdgeSettings {
    /// How long one task poll to the cloud waits.
    pub poll_wait_ms: u64,
    /// How often the edge tells the cloud it is online.
    pub heartbeat_interval_ms: u64,
    /// How long the edge waits after a failed call to the cloud.
    pub retry_after_ms: u64,
    /// How often the edge looks for results to send up.
    pub uplink_interval_ms: u64,
}

impl Default for EdgeSettings {
    fn default() -> Self {
        EdgeSettings {
            poll_wait_ms: 25_000,
            heartbeat_interval_ms: 10_000,
            retry_after_ms: 2_000,
            uplink_interval_ms: 250,
        }
    }
}

/// Serves the edge's devices and works for the cloud until SIGTERM or
/// Ctrl-C: starts the edge's server (printing its fingerprint, address and
/// first admin token as `canopy-server serve` does), then polls the cloud
/// for tasks and sends results up while it serves.
pub async fn run(
    cloud: DeviceClient,
    settings: Settings,
    edge: EdgeSettings,
) -> Result<(), EdgeError> {
    let data_dir = settings.data_dir.clone();
    let chain = SigningKeys {
        current_key: cloud.trusted_keys().current_hex(),
        endorsements: Vec::new(),
    };
    // The aggregator's enrolled key signs the versions its sub-rounds
    // make, under the cloud's delegation: the devices' trust stays rooted
    // in the cloud's key.
    let own_key = canopy_protocol::model_sig::ServerKey::from_bytes(&cloud.key().to_bytes());
    let running = server::start_relay(settings, chain, own_key).await?;
    let state = running.state().clone();
    tracing::info!(
        cloud = %cloud.transport.url(""),
        aggregator = cloud.device_id,
        "edge aggregator started"
    );
    let sessions = secure::Sessions::default();
    let tasks = tokio::spawn(cloud::run(
        cloud.clone(),
        state.clone(),
        edge.clone(),
        sessions.clone(),
    ));
    let uplinks = tokio::spawn(uplink::run(cloud, state.clone(), edge, sessions));
    let served = server::serve_started(running, &data_dir).await;
    tasks.abort();
    uplinks.abort();
    Ok(served?)
}

/// Sleeps `ms`, or less if the server begins to shut down; false then.
async fn pause(state: &AppState, ms: u64) -> bool {
    let step = Duration::from_millis(ms.min(200));
    let until = tokio::time::Instant::now() + Duration::from_millis(ms);
    while tokio::time::Instant::now() < until {
        if state.is_shutting_down() {
            return false;
        }
        tokio::time::sleep(step).await;
    }
    !state.is_shutting_down()
}
