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
use axum::extract::{FromRequest, FromRequestParts, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, post, put};
use canopy_protocol::device_cert;
use canopy_protocol::messages::DeviceCertificate;
use canopy_protocol::messages::{
    DeclineTask, ERROR_ALREADY_WITHDRAWN, EnrollRequest, EnrollResponse, EvaluationReport,
    Heartbeat, HeartbeatResponse, Ineligible, RoundMetrics, SubRoundReport, WithdrawTask,
};
use canopy_protocol::model_sig::SigningKeys;
use serde::de::DeserializeOwned;

use crate::api::error::{ApiError, ApiResult, Json, Path};
use crate::db::now_ms;
use crate::device_keys::DeviceKey;
use crate::request_slots::PollSlot;
use crate::state::AppState;
use crate::store::devices::{self, EnrollError};
use crate::store::evaluations::{self, EvaluatorState};
use crate::store::rounds::{self, ParticipantState};
use crate::store::task_state::{self, Admission, TaskKind, TaskState};
use crate::store::tokens::EnrollmentTokenError;
use auth::DeviceAuth;
pub use tasks::TaskBoard;

pub fn router() -> Router<AppState> {
    let training = "/device/v1/rounds/{round_id}";
    let evaluation = "/device/v1/rounds/{round_id}/evaluation";
    let router = answer_routes::<ParticipantState>(Router::new(), training);
    answer_routes::<EvaluatorState>(router, evaluation)
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
        .route(
            "/device/v1/rounds/{round_id}/sub-round",
            post(report_sub_round),
        )
        .route(
            "/device/v1/rounds/{round_id}/evaluation",
            post(report_evaluation),
        )
        .route(
            "/device/v1/rounds/{round_id}/secagg/{endpoint}",
            post(secagg::post_message).get(secagg::get_message),
        )
}

/// A task's decline and withdrawal, under the task's path: the same two
/// handlers for either kind.
fn answer_routes<S: TaskState>(router: Router<AppState>, task: &str) -> Router<AppState> {
    router
        .route(&format!("{task}/decline"), post(decline_task::<S>))
        .route(&format!("{task}/withdraw"), post(withdraw_task::<S>))
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

/// A signed request about one round, as [`RoundMessage`] reads it.
trait RoundRequest: DeserializeOwned + Send {
    fn round_id(&self) -> i64;
    fn validate(&self) -> Result<(), String>;
}

macro_rules! round_requests {
    ($($message:ty),+) => {$(
        impl RoundRequest for $message {
            fn round_id(&self) -> i64 {
                self.round_id
            }

            fn validate(&self) -> Result<(), String> {
                <$message>::validate(self)
            }
        }
    )+};
}
round_requests!(
    DeclineTask,
    EvaluationReport,
    RoundMetrics,
    SubRoundReport,
    WithdrawTask
);

/// A device's signed request about the round in its path, checked in
/// the one place every such request is: the device's signature, the body
/// read against it, its fields valid, and about the round in the path (a
/// body about one round posted to another round's path is refused); 422
/// otherwise.
struct RoundMessage<T> {
    device: DeviceAuth,
    round_id: i64,
    message: T,
}

impl<T: RoundRequest> FromRequest<AppState> for RoundMessage<T> {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &AppState) -> Result<Self, ApiError> {
        let (mut parts, body) = request.into_parts();
        let device = DeviceAuth::from_request_parts(&mut parts, state).await?;
        let Path(round_id) = Path::<i64>::from_request_parts(&mut parts, state).await?;
        let message: T = signed_json(state, &device, &parts.headers, body).await?;
        message.validate().map_err(ApiError::unprocessable)?;
        if message.round_id() != round_id {
            return Err(ApiError::unprocessable(format!(
                "the body is about round {}, the path about round {round_id}",
                message.round_id()
            )));
        }
        Ok(RoundMessage {
            device,
            round_id,
            message,
        })
    }
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
        request.role,
    )
    .await
    .map_err(|error| match error {
        EnrollError::Token(EnrollmentTokenError::Sql(error)) | EnrollError::Sql(error) => {
            error.into()
        }
        EnrollError::Token(wrong @ EnrollmentTokenError::WrongRole { .. }) => {
            ApiError::forbidden(format!("cannot enroll: {wrong}"))
        }
        EnrollError::Token(token) => ApiError::unauthorized(format!("cannot enroll: {token}")),
        EnrollError::KeyInUse { .. } => ApiError::conflict(format!("cannot enroll: {error}")),
    })?;
    tracing::info!(
        device = device_id, tier = %request.capabilities.tier, role = %request.role,
        "enrolled device"
    );
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
    metrics: RoundMessage<RoundMetrics>,
) -> ApiResult<StatusCode> {
    let RoundMessage {
        device,
        round_id,
        message: metrics,
    } = metrics;
    let device_id = device.device_id;
    if !rounds::record_metrics(&state.db, round_id, device_id, &metrics).await? {
        return Err(ApiError::not_found(format!(
            "device {device_id} is not a participant of round {round_id}"
        )));
    }
    Ok(StatusCode::NO_CONTENT)
}

/// An aggregator's account of its sub-round, kept on its participant row
/// for the round's tree.
async fn report_sub_round(
    State(state): State<AppState>,
    report: RoundMessage<SubRoundReport>,
) -> ApiResult<StatusCode> {
    let RoundMessage {
        device,
        round_id,
        message: report,
    } = report;
    let device_id = device.device_id;
    if !rounds::record_sub_round(&state.db, round_id, device_id, &report).await? {
        return Err(ApiError::not_found(format!(
            "device {device_id} is not a participant of round {round_id}"
        )));
    }
    Ok(StatusCode::NO_CONTENT)
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

/// A device gives up its task (training, or evaluation), saying why: it
/// becomes a dropout at once instead of at the close.
async fn decline_task<S: TaskState>(
    State(state): State<AppState>,
    decline: RoundMessage<DeclineTask>,
) -> ApiResult<StatusCode> {
    let (device_id, round_id) = (decline.device.device_id, decline.round_id);
    let reason = &decline.message.reason;
    let admission = task_state::decline::<S>(&state.db, round_id, device_id, reason).await?;
    if admission == Admission::Taken {
        tracing::warn!(round = round_id, device = device_id, task = task_noun(S::KIND), %reason, "device declined its task");
    }
    task_answer::<S>(&state, admission, round_id, device_id)
}

/// Checks a withdrawal's conditions against the device policy of the
/// round's job, which are then the device's latest (as a heartbeat's).
/// The answer is the unmet requirements (what the task's record says); 404
/// when there is no such round, 422 when the conditions meet the policy,
/// since such a device is eligible and must do its task or decline it.
async fn checked_withdrawal(
    state: &AppState,
    withdrawal: &RoundMessage<WithdrawTask>,
) -> ApiResult<Ineligible> {
    let RoundMessage {
        device,
        round_id,
        message: withdrawal,
    } = withdrawal;
    let config = rounds::job_config(&state.db, *round_id)
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
            Ok(ineligible)
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

/// A device that no longer meets the job's device policy gives up its task
/// (training, or evaluation): it becomes `ineligible`, which is not a
/// dropout, and the round stops waiting for it.
async fn withdraw_task<S: TaskState>(
    State(state): State<AppState>,
    withdrawal: RoundMessage<WithdrawTask>,
) -> ApiResult<StatusCode> {
    let ineligible = checked_withdrawal(&state, &withdrawal).await?;
    let reason = withdrawal_reason(&withdrawal.message, &ineligible);
    let (device_id, round_id) = (withdrawal.device.device_id, withdrawal.round_id);
    let admission = task_state::withdraw::<S>(&state.db, round_id, device_id, &reason).await?;
    if admission == Admission::Taken {
        tracing::info!(round = round_id, device = device_id, task = task_noun(S::KIND), %reason, "device withdrew as ineligible");
    }
    task_answer::<S>(&state, admission, round_id, device_id)
}

/// A device's evaluation of the version a round produced (an evaluation
/// task's answer).
async fn report_evaluation(
    State(state): State<AppState>,
    report: RoundMessage<EvaluationReport>,
) -> ApiResult<StatusCode> {
    let (device_id, round_id) = (report.device.device_id, report.round_id);
    let evaluation = evaluations::Report {
        loss: report.message.loss,
        accuracy: report.message.accuracy,
        samples: report.message.samples,
    };
    let admission = evaluations::report(&state.db, round_id, device_id, evaluation).await?;
    task_answer::<EvaluatorState>(&state, admission, round_id, device_id)
}

fn task_noun(kind: TaskKind) -> &'static str {
    match kind {
        TaskKind::Training => "training",
        TaskKind::Evaluation => "evaluation",
    }
}

/// The status of a device's answer to its task ([`task_state::admit`]'s
/// decision): 204 when taken, 404 to a device with no such task, 409 to
/// one that already answered or withdrew, 410 once the task is over for
/// it.
fn task_answer<S: TaskState>(
    state: &AppState,
    admission: Admission,
    round_id: i64,
    device_id: i64,
) -> ApiResult<StatusCode> {
    let task = task_noun(S::KIND);
    match admission {
        Admission::Taken => {
            state.orchestrator_wake.notify_one();
            Ok(StatusCode::NO_CONTENT)
        }
        Admission::NotMember => Err(ApiError::not_found(format!(
            "device {device_id} has no {task} task in round {round_id}"
        ))),
        Admission::Answered => {
            let answered = match S::KIND {
                TaskKind::Training => "uploaded its update",
                TaskKind::Evaluation => "reported its evaluation",
            };
            Err(ApiError::conflict(format!(
                "device {device_id} already {answered} for round {round_id}"
            )))
        }
        Admission::Withdrawn => Err(already_withdrawn(device_id, round_id, task)),
        Admission::Closed => Err(ApiError::gone(format!(
            "round {round_id}'s {task} is over for device {device_id}: it closed, or its \
             deadline passed"
        ))),
        Admission::Dropped => Err(ApiError::gone(format!(
            "device {device_id} was dropped from round {round_id}'s {task}: it declined"
        ))),
    }
}
