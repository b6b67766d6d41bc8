//! The edge's side of the cloud's device API: it says it is online, polls
//! for tasks, and opens a sub-round for each, keeping the cloud's key
//! chain current for its devices.

use std::time::{Duration, Instant};

use canopy_protocol::messages::{Heartbeat, Task};
use canopy_sdk::{DeviceClient, SdkError};
use canopy_server::state::AppState;
use canopy_server::store::uplinks::{self, UplinkKind, UplinkState};
use canopy_term::error_chain as chain;

use crate::secure::Sessions;
use crate::{EdgeSettings, pause, sub_round};

pub async fn run(cloud: DeviceClient, state: AppState, edge: EdgeSettings, sessions: Sessions) {
    let heartbeat_every = Duration::from_millis(edge.heartbeat_interval_ms);
    let mut last_heartbeat: Option<Instant> = None;
    loop {
        if last_heartbeat.is_none_or(|at| at.elapsed() >= heartbeat_every) {
            match heartbeat(&cloud, &state).await {
                Ok(()) => last_heartbeat = Some(Instant::now()),
                Err(error) => {
                    tracing::warn!(error = %chain(&error), "cannot reach the cloud; retrying");
                    if !pause(&state, edge.retry_after_ms).await {
                        return;
                    }
                    continue;
                }
            }
        }
        let wait_ms = edge.poll_wait_ms.min(edge.heartbeat_interval_ms);
        match cloud.next_task(wait_ms).await {
            Ok(Some(task)) => take(&cloud, &state, task, &edge, &sessions).await,
            Ok(None) => {}
            Err(error) => {
                tracing::warn!(error = %chain(&error), "cannot poll the cloud for tasks; retrying");
                if !pause(&state, edge.retry_after_ms).await {
                    return;
                }
            }
        }
        if state.is_shutting_down() {
            return;
        }
    }
}

/// Tells the cloud the edge is online, and brings the cloud's key chain
/// to the edge's devices.
async fn heartbeat(cloud: &DeviceClient, state: &AppState) -> Result<(), SdkError> {
    let beat = Heartbeat {
        state: Some("aggregating".to_string()),
        round_id: None,
        datasets: None,
        last_error: None,
        conditions: None,
    };
    cloud.heartbeat(&beat).await?;
    let keys = cloud.signing_keys().await?;
    state.signing.set_relayed_chain(keys);
    Ok(())
}

/// Opens a sub-round for a task (and, for a secure cloud round, starts
/// exchanging keys with the other aggregators), or declines the task with
/// the reason. The cloud hands a device its oldest open task again until
/// it answers, so a task whose sub-round the edge already runs means: wait
/// for it.
async fn take(
    cloud: &DeviceClient,
    state: &AppState,
    task: Task,
    edge: &EdgeSettings,
    sessions: &Sessions,
) {
    let (round_id, kind) = (task.round_id, UplinkKind::of(task.kind));
    match uplinks::for_cloud_round(&state.db, round_id, kind).await {
        Ok(Some(_)) => {
            wait_for_uplink(state, round_id, kind, edge).await;
            return;
        }
        Ok(None) => {}
        Err(error) => {
            tracing::warn!(round = round_id, error = %chain(&error), "cannot read the uplinks");
            pause(state, edge.retry_after_ms).await;
            return;
        }
    }
    match sub_round::open(cloud, state, &task).await {
        Ok(job_id) => {
            tracing::info!(round = round_id, local_job = job_id, "opened a sub-round");
            if task.secure_aggregation.is_some() {
                sessions.begin(cloud, &task);
            }
        }
        Err(refusal) => {
            let reason = chain(&refusal);
            tracing::warn!(round = round_id, %reason, "declining the cloud's task");
            if let Err(error) = cloud.decline_task(&task, &reason).await {
                tracing::warn!(round = round_id, error = %chain(&error), "cannot decline the task");
            }
        }
    }
}

/// Waits, up to a heartbeat interval, until the cloud round's sub-round
/// of `kind` has been answered (its outcome sent, or its failure told).
async fn wait_for_uplink(state: &AppState, round_id: i64, kind: UplinkKind, edge: &EdgeSettings) {
    let until = Instant::now() + Duration::from_millis(edge.heartbeat_interval_ms);
    while Instant::now() < until {
        let open = uplinks::for_cloud_round(&state.db, round_id, kind)
            .await
            .ok()
            .flatten()
            .is_some_and(|uplink| {
                matches!(uplink.state, UplinkState::Collecting | UplinkState::Ready)
            });
        if !open || !pause(state, edge.uplink_interval_ms).await {
            return;
        }
    }
}
