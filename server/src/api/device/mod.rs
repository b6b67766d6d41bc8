//! The device API, under `/device/v1`.

pub mod auth;
pub mod folds;
mod secagg;
mod tasks;
mod unenroll;
mod upload;

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, post, put};
use canopy_protocol::device_cert;
use canopy_protocol::messages::DeviceCertificate;
use canopy_protocol::messages::{
    DeclineTask, ERROR_ALREADY_WITHDRAWN, EnrollRequest, EnrollResponse, EvaluationReport,
    Heartbeat, HeartbeatResponse, Ineligible, RoundMetrics, WithdrawTask,
};
use canopy_protocol::model_sig::SigningKeys;
use serde::de::DeserializeOwned;

use crate::api::error::{ApiError, ApiResult, Json, Path};
use crate::db::now_ms;
use crate::device_keys::DeviceKey;
use crate::request_slots::PollSlot;
use crate::state::AppState;
use crate::store::devices::{self, EnrollError};
use crate::store::tokens::EnrollmentTokenError;
use crate::store::{evaluations, rounds};
use auth::DeviceAuth;
pub use tasks::TaskBoard;

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/device/v1/enroll", post(enroll))
        .route("/device/v1/server-key", get(server_key))
        .route("/device/v1/signing-keys", get(signing_keys))
        .route("/device/v1/heartbeat", post(heartbeat))
        .route(
            canopy_protocol::messages::CERTIFICATE_PATH,
            post(install_certificate),
        )
        .route(
            canopy_protocol::messages::UNENROLL_PATH,
            post(unenroll::unenroll),
        )
        .route("/device/v1/tasks/next", get(tasks::next_task))
        .route("/device/v1/models/{version_id}", get(tasks::download_model))
        .route(
            "/device/v1/rounds/{round_id}/update",
            put(upload::upload_update),
        )
        .route("/device/v1/rounds/{round_id}/metrics", post(report_metrics))
        .route("/device/v1/rounds/{round_id}/decline", post(decline_task))
        .route("/device/v1/rounds/{round_id}/withdraw", post(withdraw_task))
        .route(
            "/device/v1/rounds/{round_id}/evaluation",
            post(report_evaluation),
        )
        .route(
            "/device/v1/rounds/{round_id}/evaluation/decline",
            post(decline_evaluation),
        )
        .route(
            "/device/v1/rounds/{round_id}/evaluation/withdraw",
            post(withdraw_evaluation),
        )
        .route(
            "/device/v1/rounds/{round_id}/secagg/{endpoint}",
            post(secagg::post_message).get(secagg::get_message),
        )
}

/// Reads a small JSON body, checks it against the signed digest, parses it.
async fn signed_json<T: DeserializeOwned>(
    state: &AppState,
    device: &DeviceAuth,
    headers: &HeaderMap,
    body: Body,
) -> ApiResult<T> {
    let limit = state.settings.limits.max_json_bytes as u64;
    let bytes = device
        .read_message(headers, body, limit, "request body")
        .await?;
    serde_json::from_slice(&bytes)
        .map_err(|error| ApiError::unprocessable(format!("the JSON body is invalid: {error}")))
}

async fn enroll(
    State(state): State<AppState>,
    Json(request): Json<EnrollRequest>,
) -> ApiResult<(StatusCode, Json<EnrollResponse>)> {
    request
        .capabilities
        .validate()
        .map_err(ApiError::unprocessable)?;
    let public_key = canopy_protocol::auth::parse_public_key_hex(&request.public_key)
        .map_err(|error| ApiError::unprocessable(error.to_string()))?;
    let device_id = devices::enroll(
        &state.db,
        &request.enrollment_token,
        &public_key,
        &request.capabilities,
    )
    .await
    .map_err(|error| match error {
        EnrollError::Token(EnrollmentTokenError::Sql(error)) | EnrollError::Sql(error) => {
            error.into()
        }
        EnrollError::Token(token) => ApiError::unauthorized(format!("cannot enroll: {token}")),
        EnrollError::KeyInUse { .. } => ApiError::conflict(format!("cannot enroll: {error}")),
    })?;
    tracing::info!(device = device_id, tier = %request.capabilities.tier, "enrolled device");
    Ok((
        StatusCode::CREATED,
        Json(EnrollResponse {
            device_id,
            server_public_key: state.signing.current_public_key_hex(),
            heartbeat_interval_ms: state.settings.limits.heartbeat_interval_ms,
        }),
    ))
}

#[derive(serde::Serialize)]
struct ServerKeyView {
    server_public_key: String,
}

/// The model-signing public key. Devices should take it from enrollment,
/// over the pinned TLS channel; this route is for tooling.
async fn server_key(State(state): State<AppState>) -> Json<ServerKeyView> {
    Json(ServerKeyView {
        server_public_key: state.signing.current_public_key_hex(),
    })
}

/// The key models are signed with now and the endorsements that lead to
/// it, for a device whose trusted key was replaced (see
/// `canopy_protocol::model_sig::TrustedKeys::advance`). Signed, like every
/// call an enrolled device makes.
async fn signing_keys(State(state): State<AppState>, _device: DeviceAuth) -> Json<SigningKeys> {
    Json(state.signing.chain())
}

async fn heartbeat(
    State(state): State<AppState>,
    device: DeviceAuth,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Json<HeartbeatResponse>> {
    let beat: Heartbeat = signed_json(&state, &device, &headers, body).await?;
    beat.validate().map_err(ApiError::unprocessable)?;
    let report = devices::HeartbeatReport {
        datasets: beat.datasets.as_deref(),
        last_error: beat.last_error.as_deref(),
        conditions: beat.conditions.as_ref(),
    };
    devices::record_heartbeat(&state.db, device.device_id, report).await?;
    Ok(Json(HeartbeatResponse {
        server_time_ms: u64::try_from(now_ms()).unwrap_or(0),
        heartbeat_interval_ms: state.settings.limits.heartbeat_interval_ms,
    }))
}

/// Stores the device authority's certificate of the calling device's id and
/// key, checked against the authority the server is configured with: a
/// certificate that would make the device's neighbours refuse it is
/// refused here, by name, instead.
async fn install_certificate(
    State(state): State<AppState>,
    device: DeviceAuth,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<StatusCode> {
    let request: DeviceCertificate = signed_json(&state, &device, &headers, body).await?;
    let certificate = request.bytes().map_err(ApiError::unprocessable)?;
    let Some(authority) = state.settings.device_authority else {
        return Err(ApiError::conflict(
            "this server has no device authority, so it cannot check or relay certificates; \
             hint: start it with --device-authority and the authority's public key",
        ));
    };
    let gone = || ApiError::gone(format!("device {} is no longer enrolled", device.device_id));
    let Some(DeviceKey::Active(key)) = state
        .device_keys
        .lookup(&state.db, device.device_id)
        .await?
    else {
        return Err(gone());
    };
    let id = u64::try_from(device.device_id).unwrap_or(u64::MAX);
    device_cert::verify(&authority, id, &key, &certificate).map_err(|cause| {
        ApiError::unprocessable(format!(
            "{cause}; hint: ask the device authority for a certificate of device {id}'s enrolled key"
        ))
    })?;
    if !devices::set_certificate(&state.db, device.device_id, &certificate).await? {
        return Err(gone());
    }
    tracing::info!(device = device.device_id, "stored device certificate");
    Ok(StatusCode::NO_CONTENT)
}

async fn report_metrics(
    State(state): State<AppState>,
    device: DeviceAuth,
    Path(round_id): Path<i64>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<StatusCode> {
    let metrics: RoundMetrics = signed_json(&state, &device, &headers, body).await?;
    metrics.validate().map_err(ApiError::unprocessable)?;
    same_round(metrics.round_id, round_id)?;
    if !rounds::record_metrics(&state.db, round_id, device.device_id, &metrics).await? {
        return Err(ApiError::not_found(format!(
            "device {} is not a participant of round {round_id}",
            device.device_id
        )));
    }
    Ok(StatusCode::NO_CONTENT)
}

/// A body about one round posted to another round's path is refused.
fn same_round(body_round_id: i64, path_round_id: i64) -> ApiResult<()> {
    if body_round_id != path_round_id {
        return Err(ApiError::unprocessable(format!(
            "the body is about round {body_round_id}, the path about round {path_round_id}"
        )));
    }
    Ok(())
}

/// Between wake-ups, a long poll (for a task or a secure-round message)
/// re-reads the database this often, so that it also sees rounds opened and
/// stages closed by another server process.
const POLL_RECHECK_MS: u64 = 500;

/// How long a task poll waits, clamped to the server's limit.
fn poll_wait(requested_ms: Option<u64>, max_ms: u64) -> Duration {
    Duration::from_millis(requested_ms.unwrap_or(max_ms).min(max_ms))
}

/// Runs a wait without the request's working place where it has one
/// (`PollSlot::while_waiting`), so that a device waiting for a task or
/// for a secure stage to close does not hold the places other requests
/// are served in. `Err` when no place was free again for the work after.
async fn waiting<T>(
    state: &AppState,
    slot: Option<&PollSlot>,
    wait: impl std::future::Future<Output = ApiResult<T>>,
) -> ApiResult<ApiResult<T>> {
    let Some(slot) = slot else {
        return Ok(wait.await);
    };
    slot.while_waiting(wait)
        .await
        .map_err(|refusal| crate::api::slot_refused(state, refusal))
}

async fn decline_task(
    State(state): State<AppState>,
    device: DeviceAuth,
    Path(round_id): Path<i64>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<StatusCode> {
    let decline: DeclineTask = signed_json(&state, &device, &headers, body).await?;
    decline.validate().map_err(ApiError::unprocessable)?;
    same_round(decline.round_id, round_id)?;
    if !rounds::decline(&state.db, round_id, device.device_id, &decline.reason).await? {
        return Err(ApiError::not_found(format!(
            "device {} has no pending task in round {round_id}",
            device.device_id
        )));
    }
    tracing::warn!(round = round_id, device = device.device_id, reason = %decline.reason, "device declined its task");
    state.orchestrator_wake.notify_one();
    Ok(StatusCode::NO_CONTENT)
}

/// Reads and checks a withdrawal: its body, and its conditions against the
/// device policy of the round's job, which are then the device's latest
/// (as a heartbeat's). The answer is the unmet requirements (what the
/// participant's record says); 404 when there is no such round, 422 when
/// the conditions meet the policy, since such a device is eligible and
/// must do its task or decline it.
async fn checked_withdrawal(
    state: &AppState,
    device: &DeviceAuth,
    round_id: i64,
    headers: &HeaderMap,
    body: Body,
) -> ApiResult<(WithdrawTask, Ineligible)> {
    let withdrawal: WithdrawTask = signed_json(state, device, headers, body).await?;
    withdrawal.validate().map_err(ApiError::unprocessable)?;
    same_round(withdrawal.round_id, round_id)?;
    let config = rounds::job_config(&state.db, round_id)
        .await?
        .ok_or_else(|| ApiError::not_found(format!("round {round_id} does not exist")))?;
    let spec: crate::store::jobs::JobSpec = crate::store::from_json("jobs.config", &config)?;
    match spec.device_policy.check(&withdrawal.conditions) {
        Err(ineligible) => {
            // The device's latest state, as a heartbeat's would be, so that
            // the next selection passes it over too.
            let report = devices::HeartbeatReport {
                conditions: Some(&withdrawal.conditions),
                ..devices::HeartbeatReport::default()
            };
            devices::record_heartbeat(&state.db, device.device_id, report).await?;
            Ok((withdrawal, ineligible))
        }
        Ok(()) => Err(ApiError::unprocessable(format!(
            "device {} cannot withdraw from round {round_id}: the conditions it reports \
             meet the job's device policy, so it is eligible; hint: do the task, or decline \
             it (a dropout) if it cannot for another reason",
            device.device_id
        ))),
    }
}

/// What a withdrawn participant's record says: the unmet requirements,
/// and the device's own words when they add anything.
fn withdrawal_reason(withdrawal: &WithdrawTask, ineligible: &Ineligible) -> String {
    let unmet = ineligible.to_string();
    let said = withdrawal.reason.trim();
    if said.is_empty() || said == unmet {
        format!("ineligible: {unmet}")
    } else {
        format!("ineligible: {unmet} (the device says: {said})")
    }
}

/// 409 with [`ERROR_ALREADY_WITHDRAWN`]: the device's earlier withdrawal
/// stands, which a retried withdrawal counts as done.
fn already_withdrawn(device_id: i64, round_id: i64, what: &str) -> ApiError {
    ApiError::new(
        StatusCode::CONFLICT,
        ERROR_ALREADY_WITHDRAWN,
        format!("device {device_id} already withdrew from round {round_id}'s {what}"),
    )
}

/// A participant that no longer meets the job's device policy gives up
/// its training task: it becomes `ineligible`, which is not a dropout, and
/// the round stops waiting for it.
async fn withdraw_task(
    State(state): State<AppState>,
    device: DeviceAuth,
    Path(round_id): Path<i64>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<StatusCode> {
    let (withdrawal, ineligible) =
        checked_withdrawal(&state, &device, round_id, &headers, body).await?;
    let reason = withdrawal_reason(&withdrawal, &ineligible);
    let device_id = device.device_id;
    match rounds::withdraw(&state.db, round_id, device_id, &reason).await? {
        rounds::Withdrawal::Taken => {
            tracing::info!(round = round_id, device = device_id, %reason, "device withdrew as ineligible");
            state.orchestrator_wake.notify_one();
            Ok(StatusCode::NO_CONTENT)
        }
        rounds::Withdrawal::NotParticipant => Err(ApiError::not_found(format!(
            "device {device_id} has no task in round {round_id}"
        ))),
        rounds::Withdrawal::AlreadyWithdrawn => {
            Err(already_withdrawn(device_id, round_id, "training"))
        }
        rounds::Withdrawal::Over(rounds::ParticipantState::Uploaded) => {
            Err(ApiError::conflict(format!(
                "device {device_id} already uploaded its update for round {round_id}; \
                 there is nothing to withdraw"
            )))
        }
        rounds::Withdrawal::Over(participant) => Err(ApiError::gone(format!(
            "device {device_id} is {participant} in round {round_id}: its task is over \
             (the round closed, or the device declined)"
        ))),
    }
}

/// An evaluator that no longer meets the job's device policy gives up its
/// evaluation task: `ineligible`, not a dropout.
async fn withdraw_evaluation(
    State(state): State<AppState>,
    device: DeviceAuth,
    Path(round_id): Path<i64>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<StatusCode> {
    let (withdrawal, ineligible) =
        checked_withdrawal(&state, &device, round_id, &headers, body).await?;
    let reason = withdrawal_reason(&withdrawal, &ineligible);
    let outcome = evaluations::withdraw(&state.db, round_id, device.device_id, &reason).await?;
    if outcome == evaluations::Outcome::Taken {
        tracing::info!(round = round_id, device = device.device_id, %reason, "device withdrew from its evaluation as ineligible");
    }
    evaluation_answer(outcome, round_id, device.device_id, &state)
}

/// A device's evaluation of the version a round produced (an evaluation
/// task's answer).
async fn report_evaluation(
    State(state): State<AppState>,
    device: DeviceAuth,
    Path(round_id): Path<i64>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<StatusCode> {
    let report: EvaluationReport = signed_json(&state, &device, &headers, body).await?;
    report.validate().map_err(ApiError::unprocessable)?;
    same_round(report.round_id, round_id)?;
    let outcome = evaluations::report(
        &state.db,
        round_id,
        device.device_id,
        evaluations::Report {
            loss: report.loss,
            accuracy: report.accuracy,
            samples: report.samples,
        },
    )
    .await?;
    evaluation_answer(outcome, round_id, device.device_id, &state)
}

async fn decline_evaluation(
    State(state): State<AppState>,
    device: DeviceAuth,
    Path(round_id): Path<i64>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<StatusCode> {
    let decline: DeclineTask = signed_json(&state, &device, &headers, body).await?;
    decline.validate().map_err(ApiError::unprocessable)?;
    same_round(decline.round_id, round_id)?;
    let outcome =
        evaluations::decline(&state.db, round_id, device.device_id, &decline.reason).await?;
    if outcome == evaluations::Outcome::Taken {
        tracing::warn!(round = round_id, device = device.device_id, reason = %decline.reason, "device declined its evaluation");
    }
    evaluation_answer(outcome, round_id, device.device_id, &state)
}

/// 204 when taken; 404 to a device that was not asked, 409 to one that
/// already answered or withdrew, 410 once the evaluation is over for it.
fn evaluation_answer(
    outcome: evaluations::Outcome,
    round_id: i64,
    device_id: i64,
    state: &AppState,
) -> ApiResult<StatusCode> {
    use evaluations::Outcome;
    match outcome {
        Outcome::Taken => {
            state.orchestrator_wake.notify_one();
            Ok(StatusCode::NO_CONTENT)
        }
        Outcome::NotEvaluator => Err(ApiError::not_found(format!(
            "device {device_id} was not asked to evaluate round {round_id}'s version"
        ))),
        Outcome::AlreadyAnswered => Err(ApiError::conflict(format!(
            "device {device_id} already answered round {round_id}'s evaluation"
        ))),
        Outcome::AlreadyWithdrawn => Err(already_withdrawn(device_id, round_id, "evaluation")),
        Outcome::Closed => Err(ApiError::gone(format!(
            "round {round_id}'s evaluation is closed for device {device_id} (its deadline passed)"
        ))),
    }
}
