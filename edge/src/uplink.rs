//! Sends each closed sub-round's result to the cloud, or tells the cloud
//! why the sub-round failed. The result stays in the edge's uplink row
//! until the cloud has answered, so a killed edge sends it after its
//! restart; the cloud refuses a second upload for the same round (409),
//! which for a result sent before a crash means it was accepted.

use bytes::Bytes;
use canopy_protocol::messages::Task;
use canopy_protocol::update::decode_update;
use canopy_sdk::train::Evaluation;
use canopy_sdk::{DeviceClient, SdkError};
use canopy_server::state::AppState;
use canopy_server::store::evaluations;
use canopy_server::store::jobs::JobState;
use canopy_server::store::rounds;
use canopy_server::store::uplinks::{self, UplinkKind, UplinkRow, UplinkState};
use canopy_term::error_chain as chain;

use crate::secure::Sessions;
use crate::{EdgeSettings, pause};

/// Uplinks handled per pass.
const UPLINKS_PER_PASS: i64 = 16;

pub async fn run(cloud: DeviceClient, state: AppState, edge: EdgeSettings, sessions: Sessions) {
    loop {
        let pending = match uplinks::pending(&state.db, UPLINKS_PER_PASS).await {
            Ok(pending) => pending,
            Err(error) => {
                tracing::warn!(error = %chain(&error), "cannot read the uplinks; retrying");
                Vec::new()
            }
        };
        for uplink in pending {
            if let Err(error) = send(&cloud, &state, &uplink, &sessions).await {
                tracing::warn!(
                    round = uplink.cloud_round_id, error = %chain(&error),
                    "cannot reach the cloud with a sub-round's outcome; retrying"
                );
            }
        }
        if !pause(&state, edge.uplink_interval_ms).await {
            return;
        }
    }
}

/// What the cloud's answer means for an uplink.
enum Answer {
    /// It has the result (or the decline): done.
    Taken,
    /// It refuses for good (the round is over, or the result is not one
    /// it takes): done, with the reason.
    Refused(String),
}

async fn send(
    cloud: &DeviceClient,
    state: &AppState,
    uplink: &UplinkRow,
    sessions: &Sessions,
) -> Result<(), EdgeUplinkError> {
    let task: Task = serde_json::from_str(&uplink.cloud_task)
        .map_err(|error| EdgeUplinkError::Task(error.to_string()))?;
    if uplink.kind == UplinkKind::Evaluation {
        return send_evaluation(cloud, state, uplink, &task).await;
    }
    let Some(partial) = uplink
        .partial
        .as_deref()
        .filter(|_| uplink.state == UplinkState::Ready)
    else {
        // In a secure round its keys go unused: to the cloud, a dropout,
        // told at once.
        sessions.end(uplink.cloud_round_id);
        report(cloud, state, uplink).await;
        let reason = format!("the aggregator's sub-round failed: {}", uplink.job_status);
        let answer = decline(cloud, &task, &reason).await?;
        return settle(state, uplink, answer, Some(&uplink.job_status)).await;
    };
    if task.secure_aggregation.is_some() {
        return send_secure(cloud, state, uplink, &task, partial, sessions).await;
    }
    report(cloud, state, uplink).await;
    let answer = upload(cloud, &task, partial).await?;
    settle(state, uplink, answer, None).await
}

/// Declines the cloud's task for `reason`, and records the uplink as
/// failed for it (or for the cloud's refusal).
async fn give_up(
    cloud: &DeviceClient,
    state: &AppState,
    uplink: &UplinkRow,
    task: &Task,
    reason: &str,
) -> Result<(), EdgeUplinkError> {
    let answer = decline(cloud, task, reason).await?;
    settle(state, uplink, answer, Some(reason)).await
}

/// Records what the cloud made of an uplink: the result it took (no
/// `declined` reason), a decline it took (failed, for that reason), or its
/// refusal (failed, for the cloud's reason).
async fn settle(
    state: &AppState,
    uplink: &UplinkRow,
    answer: Answer,
    declined: Option<&str>,
) -> Result<(), EdgeUplinkError> {
    match (answer, declined) {
        (Answer::Taken, None) => {
            tracing::info!(
                round = uplink.cloud_round_id,
                samples = uplink.num_samples,
                "the cloud accepted the sub-round's result"
            );
            uplinks::mark_sent(&state.db, uplink.job_id).await?;
        }
        (Answer::Taken, Some(reason)) => {
            uplinks::mark_failed(&state.db, uplink.job_id, reason).await?;
        }
        (Answer::Refused(reason), _) => {
            tracing::warn!(round = uplink.cloud_round_id, %reason, "the cloud refused the sub-round's outcome");
            uplinks::mark_failed(&state.db, uplink.job_id, &reason).await?;
        }
    }
    Ok(())
}

/// An evaluation sub-round's outcome, once its local job has completed
/// (its evaluation closed): the sample-weighted mean of the devices'
/// reports, as this aggregator's own report, so the cloud's mean over its
/// aggregators is the mean over every end device that reported; or, when
/// none did, a decline saying so.
async fn send_evaluation(
    cloud: &DeviceClient,
    state: &AppState,
    uplink: &UplinkRow,
    task: &Task,
) -> Result<(), EdgeUplinkError> {
    let summary = match uplinks::local_round(&state.db, uplink.job_id).await? {
        Some(round) => Some(evaluations::federated(&state.db, round.id).await?),
        None => None,
    };
    let evaluation = summary.as_ref().and_then(|summary| {
        Some(Evaluation {
            loss: summary.loss?,
            accuracy: summary.accuracy?,
            samples: u64::try_from(summary.samples?).ok().filter(|&n| n > 0)?,
        })
    });
    let Some(evaluation) = evaluation.filter(|_| uplink.job_state == JobState::Completed) else {
        let asked = summary.map_or(0, |s| s.devices + s.dropped + s.ineligible);
        let reason = format!(
            "none of the aggregator's devices evaluated the version ({asked} asked): {}",
            uplink.job_status
        );
        return give_up(cloud, state, uplink, task, &reason).await;
    };
    let answer = match cloud.report_evaluation(task, &evaluation).await {
        Ok(()) => Answer::Taken,
        // Reported before a crash.
        Err(error) if error.status() == Some(409) => Answer::Taken,
        Err(error) if refused_for_good(&error) => Answer::Refused(chain(&error)),
        Err(error) => return Err(error.into()),
    };
    settle(state, uplink, answer, None).await
}

/// A secure cloud round's result: the sub-round's `partial` masked with
/// the round's keys, in a task of its own (its stages run until the
/// cloud's round ends, and other uplinks must not wait), or a decline when
/// the edge is out of the round.
async fn send_secure(
    cloud: &DeviceClient,
    state: &AppState,
    uplink: &UplinkRow,
    task: &Task,
    partial: &[u8],
    sessions: &Sessions,
) -> Result<(), EdgeUplinkError> {
    let round_id = uplink.cloud_round_id;
    let turn = match decode_update(partial, &task.layout) {
        Ok(result) => sessions
            .turn(round_id)
            .map(|round| round.map(|round| (round, result))),
        Err(error) => Err(format!(
            "the aggregator's kept result is unreadable: {error}"
        )),
    };
    let (round, result) = match turn {
        Ok(None) => return Ok(()),
        Ok(Some(keyed)) => keyed,
        Err(reason) => {
            report(cloud, state, uplink).await;
            give_up(cloud, state, uplink, task, &reason).await?;
            sessions.end(round_id);
            return Ok(());
        }
    };
    report(cloud, state, uplink).await;
    let (state, uplink, sessions) = (state.clone(), uplink.clone(), sessions.clone());
    tokio::spawn(async move {
        let answer = match round.finish(&result.values, result.num_samples).await {
            Ok(receipt) => {
                tracing::info!(
                    round = round_id,
                    weight = receipt.weight,
                    bytes = receipt.masked_input_bytes,
                    "masked the sub-round's result for the cloud"
                );
                Answer::Taken
            }
            Err(error) => Answer::Refused(chain(&error)),
        };
        if let Err(error) = settle(&state, &uplink, answer, None).await {
            tracing::warn!(round = round_id, error = %chain(&error), "cannot record the secure round's outcome");
        }
        sessions.end(round_id);
    });
    Ok(())
}

/// Tells the cloud what the sub-round did, for its round tree. The
/// result goes up whether or not the report does: the tree is for people,
/// the result for the model.
async fn report(cloud: &DeviceClient, state: &AppState, uplink: &UplinkRow) {
    let report = match rounds::sub_round_report(&state.db, uplink.job_id, uplink.cloud_round_id)
        .await
    {
        Ok(report) => report,
        Err(error) => {
            tracing::warn!(error = %chain(&error), "cannot sum up the sub-round for its report");
            return;
        }
    };
    if let Err(error) = cloud.report_sub_round(&report).await {
        tracing::warn!(
            round = uplink.cloud_round_id, error = %chain(&error),
            "the cloud did not take the sub-round's report"
        );
    }
}

async fn upload(cloud: &DeviceClient, task: &Task, partial: &[u8]) -> Result<Answer, SdkError> {
    match cloud
        .upload_update(task, Bytes::copy_from_slice(partial))
        .await
    {
        Ok(_) => Ok(Answer::Taken),
        // Sent before a crash, and folded then.
        Err(error) if error.status() == Some(409) => Ok(Answer::Taken),
        Err(error) if refused_for_good(&error) => Ok(Answer::Refused(chain(&error))),
        Err(error) => Err(error),
    }
}

async fn decline(cloud: &DeviceClient, task: &Task, reason: &str) -> Result<Answer, SdkError> {
    match cloud.decline_task(task, reason).await {
        Ok(()) => Ok(Answer::Taken),
        Err(error)
            if error
                .status()
                .is_some_and(|status| status < 500 && status != 429) =>
        {
            Ok(Answer::Refused(chain(&error)))
        }
        Err(error) => Err(error),
    }
}

/// Answers that sending again would not change: the round closed or the
/// aggregator was dropped (410), it is not the aggregator's round (403),
/// or the result is refused (422).
fn refused_for_good(error: &SdkError) -> bool {
    matches!(error.status(), Some(403 | 404 | 410 | 413 | 422))
}

#[derive(Debug, thiserror::Error)]
enum EdgeUplinkError {
    #[error("the uplink's stored cloud task is unreadable: {0}")]
    Task(String),
    #[error(transparent)]
    Cloud(#[from] SdkError),
    #[error("the edge's database failed")]
    Database(#[from] canopy_server::db::SqlError),
}
