//! Jobs and their rounds.

use axum::extract::State;
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::api::ErrorResponse;
use crate::api::admin::models::ModelVersionView;
use crate::api::error::{ApiError, ApiResult, Json, Path, Query};
use crate::api::pagination::{PageQuery, finish};
use crate::config::api_bounds::{DETAIL_PARTICIPANTS, MAX_ROUNDS_PAGE};
use crate::orchestrator;
use crate::round_failure::FailureView;
use crate::state::AppState;
use crate::store::evaluations::{self, CentralState, EvaluationState};
use crate::store::jobs::{self, ActionError, JobAction, JobRow, JobSpec, JobState};
use crate::store::rounds::{
    self, ParticipantRow, ParticipantState, RoundKind, RoundRow, RoundState,
};
use crate::store::{datasets, models};

#[derive(Debug, Serialize, ToSchema)]
pub struct JobView {
    pub id: i64,
    pub name: String,
    pub state: JobState,
    pub spec: JobSpec,
    /// The version the job started from.
    pub model_version_id: i64,
    /// The latest version the job produced (the start version before any round).
    pub current_version_id: i64,
    pub rounds_completed: i64,
    /// Failed attempts of the current round.
    pub round_failures: i64,
    /// Why the job is waiting, paused or failed.
    pub status_message: String,
    pub created_ms: i64,
    pub updated_ms: i64,
    pub started_ms: Option<i64>,
    pub finished_ms: Option<i64>,
    /// A differentially private job's spending: the ε of its (ε, δ)
    /// guarantee so far, by the tight conversion; absent for other jobs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub privacy: Option<PrivacySpent>,
}

/// What a differentially private job has spent.
#[derive(Debug, Serialize, ToSchema)]
pub struct PrivacySpent {
    /// ε after the rounds that have succeeded; 0 before the first.
    pub epsilon: f64,
    pub delta: f64,
    /// Who adds the noise: the server (central DP) or the devices, before
    /// masking (distributed DP, with secure aggregation).
    pub noise_added_by: crate::privacy::NoiseSource,
    /// The clip the job's next round takes: `clip_norm`, or with adaptive
    /// clipping where the rounds so far have moved it.
    pub clip_norm: f64,
    /// The job's `budget_epsilon`, if it has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub budget_epsilon: Option<f64>,
}

impl JobView {
    fn from_row(row: JobRow) -> ApiResult<JobView> {
        let spec = row.spec()?;
        let privacy = spec
            .differential_privacy
            .as_ref()
            .zip(spec.noise_source())
            .map(|(privacy, noise_added_by)| PrivacySpent {
                epsilon: row.dp_epsilon.unwrap_or(0.0),
                delta: privacy.delta,
                noise_added_by,
                clip_norm: row.dp_clip_norm.unwrap_or(privacy.clip_norm),
                budget_epsilon: privacy.budget_epsilon,
            });
        Ok(JobView {
            privacy,
            spec,
            state: row.state,
            id: row.id,
            name: row.name,
            model_version_id: row.model_version_id,
            current_version_id: row.current_version_id,
            rounds_completed: row.rounds_completed,
            round_failures: row.round_failures,
            status_message: row.status_message,
            created_ms: row.created_ms,
            updated_ms: row.updated_ms,
            started_ms: row.started_ms,
            finished_ms: row.finished_ms,
        })
    }
}

/// A job as its creation answers it: the job, the version it starts
/// from, and what may keep it from ever running.
#[derive(Debug, Serialize, ToSchema)]
pub struct CreatedJob {
    #[serde(flatten)]
    pub job: JobView,
    /// The version the job starts from (`model_version_id`): its model,
    /// number and provenance.
    pub start_version: ModelVersionView,
    /// Why no round could start with the devices enrolled now, if so. The
    /// job is created anyway: devices may enroll, or register data, later.
    pub warnings: Vec<JobWarning>,
}

/// Something that keeps a job from running, found at its creation.
#[derive(Debug, Serialize, ToSchema)]
pub struct JobWarning {
    /// The cause: how many enrolled devices could take part, and why the
    /// others cannot (the reasons a waiting round's status gives).
    pub message: String,
    /// What would make enough devices eligible.
    pub hint: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct JobList {
    pub items: Vec<JobView>,
    pub next_cursor: Option<String>,
}

/// Create a job (in state `created`; start it with `/start`).
#[utoipa::path(
    post, path = "/api/v1/jobs", tag = "jobs",
    request_body(content = JobSpec, example = json!({
        "name": "mnist-fedavg", "model_version_id": 1, "rounds": 10, "min_devices": 1,
        "target_devices": 2, "round_deadline_ms": 60_000, "local_epochs": 1, "batch_size": 32,
        "learning_rate": 0.05, "filters": {"tier": "edge"},
        "strategy": {"name": "fedavgm", "momentum": 0.9},
    })),
    responses(
        (status = 201, description = "Created, with `warnings` when no round could start with the devices enrolled now", body = CreatedJob),
        (status = 400, body = ErrorResponse), (status = 401, body = ErrorResponse), (status = 403, body = ErrorResponse),
        (status = 404, description = "No such model version", body = ErrorResponse),
        (status = 415, body = ErrorResponse),
        (status = 422, description = "Invalid settings or an untrainable model", body = ErrorResponse),
    ),
    security(("bearer" = []))
)]
pub async fn create(
    State(state): State<AppState>,
    Json(mut spec): Json<JobSpec>,
) -> ApiResult<(StatusCode, Json<CreatedJob>)> {
    spec.validate().map_err(ApiError::unprocessable)?;
    spec.fill_defaults();
    let version = models::get_version(&state.db, spec.model_version_id)
        .await?
        .ok_or_else(|| {
            ApiError::not_found(format!(
                "model version {} does not exist",
                spec.model_version_id
            ))
        })?;
    if version.has_train_step == 0 {
        let reason = version
            .untrainable_reason
            .as_deref()
            .unwrap_or("it needs a `train_step` entry point and f32 trainable parameters");
        return Err(ApiError::unprocessable(format!(
            "model `{}` version {} cannot be trained on devices: {reason}",
            version.model_name, version.version
        )));
    }
    check_model_for_job(&state, &spec, &version).await?;
    if let Some(privacy) = &spec.differential_privacy {
        let update_len = usize::try_from(version.trainable_elements).unwrap_or(usize::MAX);
        spec.check_private_rounds(update_len)
            .map_err(ApiError::unprocessable)?;
        // A secure job's first round, as its plan will be.
        let plan = match spec.noise_target() {
            Some(_) => Some(
                spec.round_plan(spec.selection_size() as usize, update_len)
                    .map_err(|error| ApiError::unprocessable(error.to_string()))?,
            ),
            None => None,
        };
        let enrolled = crate::store::devices::count_enrolled(&state.db).await?;
        let enrolled = u64::try_from(enrolled).unwrap_or(0);
        crate::privacy::budget_below_one_round(
            privacy,
            spec.selection_size(),
            enrolled,
            plan.as_ref(),
        )
        .map_err(ApiError::internal)?
        .map_or(Ok(()), |refusal| Err(ApiError::unprocessable(refusal)))?;
    }
    if let Some(name) = &spec.evaluation.central_dataset {
        check_central_dataset(&state, name, &version).await?;
    }
    let warnings = device_warnings(&state, &spec, &version).await?;
    let row = jobs::insert(&state.db, &spec).await?;
    tracing::info!(job = row.id, name = %row.name, warnings = warnings.len(), "created job");
    Ok((
        StatusCode::CREATED,
        Json(CreatedJob {
            job: JobView::from_row(row)?,
            start_version: version.into(),
            warnings,
        }),
    ))
}

/// The warning for a job that no round could start with the devices
/// enrolled now (the orchestrator's eligibility rule, applied to every
/// enrolled device); none when enough could qualify.
async fn device_warnings(
    state: &AppState,
    spec: &JobSpec,
    version: &models::VersionRow,
) -> ApiResult<Vec<JobWarning>> {
    let shortfall = orchestrator::shortfall_at_creation(state, spec, version.id)
        .await
        .map_err(|error| match error {
            // Selection needs the input shape to match the job's dataset.
            orchestrator::OrchestratorError::InputShape { reason, .. } => {
                ApiError::unprocessable(format!(
                    "model `{}` version {} has no input shape to match dataset `{}` against: \
                     {reason}",
                    version.model_name,
                    version.version,
                    spec.dataset.as_deref().unwrap_or_default(),
                ))
            }
            orchestrator::OrchestratorError::Database(error) => error.into(),
            orchestrator::OrchestratorError::Blob(error) => error.into(),
            other => ApiError::internal(canopy_term::error_chain(&other)),
        })?;
    Ok(shortfall
        .map(|shortfall| JobWarning {
            message: shortfall.message,
            hint: shortfall.hint,
        })
        .into_iter()
        .collect())
}

/// What a job asks of its model beyond training, checked at creation so
/// the job does not fail at start: FedProx derives its step from
/// `train_loss`, and a secure job cannot fit unfitted input statistics
/// (see `docs/strategies.md`).
async fn check_model_for_job(
    state: &AppState,
    spec: &JobSpec,
    version: &models::VersionRow,
) -> ApiResult<()> {
    let proximal = spec.strategy.proximal_mu().ok().flatten().is_some();
    let private = spec.differential_privacy.is_some();
    if !proximal && !spec.secure_aggregation.enabled && !private {
        return Ok(());
    }
    let limit = state.settings.limits.max_model_bytes;
    let bytes = state.blobs.get(&version.digest, limit).await?;
    let model = tokio::task::spawn_blocking(move || canopy_ir::format::read_model(&bytes))
        .await
        .map_err(|error| ApiError::internal(format!("model check task failed: {error}")))?
        .map_err(|error| ApiError::internal(canopy_term::error_chain(&error)))?;
    let name = format!("model `{}` version {}", version.model_name, version.version);
    if proximal && model.entry(canopy_engine::zoo::ENTRY_TRAIN_LOSS).is_err() {
        return Err(ApiError::unprocessable(format!(
            "{name} has no `train_loss` entry point, from which FedProx derives its step; \
             hint: leave out `strategy.proximal_mu`, or push a model built by `canopy model new`"
        )));
    }
    let unfitted = canopy_engine::stats::InputStatsState::of(&model)
        == canopy_engine::stats::InputStatsState::Unfitted;
    if spec.secure_aggregation.enabled && unfitted {
        return Err(ApiError::unprocessable(format!(
            "{name} has unfitted input statistics, and a secure job cannot fit them federatedly \
             (secure aggregation clips what devices send); hint: fit them with \
             `canopy model stats FILE --data DIR -o FITTED` and push that, or run the job \
             without secure aggregation, which fits them in a statistics round"
        )));
    }
    if private && unfitted {
        return Err(ApiError::unprocessable(format!(
            "{name} has unfitted input statistics, and a differentially private job cannot fit \
             them federatedly (a statistics round would reveal the devices' data moments \
             without noise); hint: fit them with `canopy model stats FILE --data DIR -o FITTED` \
             on data you may use, and push that"
        )));
    }
    Ok(())
}

/// The job's central dataset exists and its samples fit the model's input
/// (the orchestrator's rule for devices' datasets).
async fn check_central_dataset(
    state: &AppState,
    name: &str,
    version: &models::VersionRow,
) -> ApiResult<()> {
    let dataset = datasets::get(&state.db, name).await?.ok_or_else(|| {
        ApiError::unprocessable(format!(
            "`evaluation.central_dataset` names dataset `{name}`, which does not exist; \
             hint: upload it first (PUT /api/v1/datasets/{name})"
        ))
    })?;
    let input = orchestrator::model_input_shape(state, version.id)
        .await
        .map_err(|error| {
            ApiError::unprocessable(format!(
                "model `{}` version {} has no input shape to check dataset `{name}` against: {}",
                version.model_name,
                version.version,
                canopy_term::error_chain(&error)
            ))
        })?;
    let samples = dataset.sample_shape()?;
    if !orchestrator::sample_fits(&samples, &input) {
        return Err(ApiError::unprocessable(format!(
            "dataset `{name}` has samples of shape {samples:?}, but model `{}` version {} takes \
             {input:?}; hint: upload a dataset whose samples have as many values as the model's input",
            version.model_name, version.version
        )));
    }
    check_central_bounds(state, &dataset, version).await
}

/// The central evaluation's static bounds (`central::bounds`, the rule
/// each evaluation applies again), so the operator hears at once.
async fn check_central_bounds(
    state: &AppState,
    dataset: &datasets::DatasetRow,
    version: &models::VersionRow,
) -> ApiResult<()> {
    let bytes = state
        .blobs
        .get(&version.digest, state.settings.limits.max_model_bytes)
        .await?;
    let (limits, samples) = (
        state.settings.limits.clone(),
        u64::try_from(dataset.samples).unwrap_or(0),
    );
    let _permit = state
        .model_verification
        .acquire()
        .await
        .map_err(|error| ApiError::internal(error.to_string()))?;
    let planned = tokio::task::spawn_blocking(move || {
        let model = canopy_ir::format::read_model(&bytes)
            .map_err(|error| canopy_term::error_chain(&error))?;
        crate::central::bounds::plan(&model, samples, &limits).map_err(|error| error.to_string())
    })
    .await
    .map_err(|error| ApiError::internal(format!("model check task failed: {error}")))?;
    planned.map(drop).map_err(|reason| {
        ApiError::unprocessable(format!(
            "model `{}` version {} cannot be evaluated centrally on dataset `{}`: {reason}",
            version.model_name, version.version, dataset.name
        ))
    })
}

/// List jobs.
#[utoipa::path(
    get, path = "/api/v1/jobs", tag = "jobs", params(PageQuery),
    responses((status = 200, body = JobList), (status = 400, body = ErrorResponse), (status = 401, body = ErrorResponse)),
    security(("bearer" = []))
)]
pub async fn list(
    State(state): State<AppState>,
    Query(query): Query<PageQuery>,
) -> ApiResult<Json<JobList>> {
    let page = query.page(state.settings.limits.max_page_size)?;
    let rows = jobs::list(&state.db, page).await?;
    let (rows, next_cursor) = finish(rows, page, |row| row.id.to_string());
    Ok(Json(JobList {
        items: rows
            .into_iter()
            .map(JobView::from_row)
            .collect::<ApiResult<_>>()?,
        next_cursor,
    }))
}

async fn find(state: &AppState, id: i64) -> ApiResult<JobRow> {
    jobs::get(&state.db, id)
        .await?
        .ok_or_else(|| ApiError::not_found(format!("job {id} does not exist")))
}

/// Get a job's settings and status.
#[utoipa::path(
    get, path = "/api/v1/jobs/{id}", tag = "jobs", params(("id" = i64, Path)),
    responses((status = 200, body = JobView), (status = 400, body = ErrorResponse), (status = 401, body = ErrorResponse), (status = 404, body = ErrorResponse)),
    security(("bearer" = []))
)]
pub async fn get(State(state): State<AppState>, Path(id): Path<i64>) -> ApiResult<Json<JobView>> {
    Ok(Json(JobView::from_row(find(&state, id).await?)?))
}

async fn act(state: &AppState, id: i64, action: JobAction) -> ApiResult<Json<JobView>> {
    let row = jobs::apply_action(&state.db, id, action)
        .await
        .map_err(|error| match error {
            ActionError::NotFound { .. } => ApiError::not_found(error.to_string()),
            ActionError::WrongState { .. } => ApiError::conflict(error.to_string()),
            ActionError::Sql(error) => error.into(),
        })?;
    tracing::info!(job = id, action = action.verb(), "job action");
    state.orchestrator_wake.notify_one();
    Ok(Json(JobView::from_row(row)?))
}

macro_rules! job_action {
    ($name:ident, $action:expr, $path:literal, $summary:literal) => {
        #[doc = $summary]
        #[utoipa::path(
            post, path = $path, tag = "jobs", params(("id" = i64, Path)),
            responses(
                (status = 200, body = JobView),
                (status = 400, body = ErrorResponse), (status = 401, body = ErrorResponse), (status = 403, body = ErrorResponse),
                (status = 404, body = ErrorResponse),
                (status = 409, description = "The job is not in a state the action applies to", body = ErrorResponse),
            ),
            security(("bearer" = []))
        )]
        pub async fn $name(State(state): State<AppState>, Path(id): Path<i64>) -> ApiResult<Json<JobView>> {
            act(&state, id, $action).await
        }
    };
}

job_action!(
    start,
    JobAction::Start,
    "/api/v1/jobs/{id}/start",
    "Start a created job."
);
job_action!(
    pause,
    JobAction::Pause,
    "/api/v1/jobs/{id}/pause",
    "Pause a running job; its open round waits."
);
job_action!(
    resume,
    JobAction::Resume,
    "/api/v1/jobs/{id}/resume",
    "Resume a paused job."
);
job_action!(
    cancel,
    JobAction::Cancel,
    "/api/v1/jobs/{id}/cancel",
    "Cancel a job; its open round fails."
);

#[derive(Debug, Serialize, ToSchema)]
pub struct RoundMetricsView {
    /// Sample-weighted mean of the participants' training losses.
    pub train_loss: Option<f64>,
    /// Sample-weighted mean of the participants' held-out accuracy of the
    /// round's BASE version, measured before they trained (so it lags a
    /// round); `federated_eval_accuracy` is the version this round produced.
    pub eval_accuracy: Option<f64>,
    pub eval_loss: Option<f64>,
    pub bytes_in: i64,
    pub bytes_out: i64,
    /// Selected devices that declined or timed out, or were dropped when
    /// the round closed or failed.
    pub dropouts: i64,
    /// Selected devices that withdrew because they no longer met the job's
    /// `device_policy` (participant state `ineligible`); not dropouts.
    pub ineligible: i64,
    pub updates_accepted: i64,
    /// Samples behind the accepted updates (the FedAvg weight).
    pub samples: i64,
    /// Federated evaluation of the version this round produced:
    /// sample-weighted mean accuracy of the evaluators' held-out data.
    pub federated_eval_accuracy: Option<f64>,
    pub federated_eval_loss: Option<f64>,
    /// Held-out samples behind the federated evaluation.
    pub federated_eval_samples: Option<i64>,
    /// Devices that reported their evaluation.
    pub federated_eval_devices: i64,
    /// Devices asked to evaluate that declined or timed out.
    pub federated_eval_dropouts: i64,
    /// Devices asked to evaluate that withdrew because they no longer met
    /// the job's `device_policy`; not dropouts.
    pub federated_eval_ineligible: i64,
    /// `open` while devices evaluate, `closed` after; absent when the
    /// version was not evaluated on devices.
    pub federated_eval_state: Option<EvaluationState>,
    /// Central evaluation of the version this round produced, on the
    /// job's held-out dataset on the server.
    pub central_eval_accuracy: Option<f64>,
    pub central_eval_loss: Option<f64>,
    pub central_eval_samples: Option<i64>,
    /// `pending` until the server has evaluated the version, then `done`,
    /// or `failed` with `central_eval_error`; absent when the job has no
    /// `evaluation.central_dataset`.
    pub central_eval_state: Option<CentralState>,
    /// Why the central evaluation failed.
    pub central_eval_error: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct RoundDurations {
    /// Waiting for enough eligible devices.
    pub selecting_ms: Option<i64>,
    /// From selection to closing.
    pub training_ms: Option<i64>,
    /// From closing to the new version.
    pub aggregating_ms: Option<i64>,
    pub total_ms: Option<i64>,
    pub mean_device_training_ms: Option<f64>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct RoundView {
    pub id: i64,
    pub job_id: i64,
    pub number: i64,
    pub attempt: i64,
    pub state: RoundState,
    /// `train`, or `statistics`: round 0, run before the first training
    /// round of a model with unfitted input statistics, whose result is
    /// the model with them fitted from every device's data.
    pub kind: RoundKind,
    pub base_version_id: i64,
    pub result_version_id: Option<i64>,
    pub target_devices: i64,
    pub min_devices: i64,
    pub selected: i64,
    pub status_message: String,
    /// Why the round failed, for a `failed` round: a stable `kind` to
    /// branch on and the `message` (its `status_message`).
    pub failure: Option<FailureView>,
    pub created_ms: i64,
    pub deadline_ms: Option<i64>,
    pub finished_ms: Option<i64>,
    /// For secure rounds, the SecAgg+ stage reached: advertise, share,
    /// check, collect, consistency or unmask.
    pub secure_stage: Option<String>,
    /// For a buffer of an asynchronous job, the oldest update it takes, in
    /// versions; absent for a synchronous round. A buffer's `selected`
    /// counts the devices it selected, its `updates_accepted` the updates
    /// it took, from devices selected in it or in earlier buffers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_staleness: Option<i64>,
    /// For a round of a differentially private job: its sampling rate
    /// (devices selected over those it could have selected) and, once it
    /// succeeded, the job's ε after it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub privacy: Option<RoundPrivacy>,
}

/// A private round's part of its job's spending.
#[derive(Debug, Serialize, ToSchema)]
pub struct RoundPrivacy {
    pub sampling_rate: Option<f64>,
    pub epsilon: Option<f64>,
    /// The L2 norm the round clipped each update to (with adaptive
    /// clipping, the clip the rounds before it adapted).
    pub clip_norm: f64,
}

impl From<&RoundRow> for RoundView {
    fn from(row: &RoundRow) -> RoundView {
        RoundView {
            id: row.id,
            job_id: row.job_id,
            number: row.number,
            attempt: row.attempt,
            state: row.state,
            kind: row.kind,
            base_version_id: row.base_version_id,
            result_version_id: row.result_version_id,
            target_devices: row.target_devices,
            min_devices: row.min_devices,
            selected: row.selected_count,
            status_message: row.status_message.clone(),
            failure: FailureView::of(row),
            created_ms: row.created_ms,
            deadline_ms: row.deadline_ms,
            finished_ms: row.finished_ms,
            secure_stage: row.secagg_stage.clone(),
            max_staleness: row.max_staleness,
            privacy: row.clip_norm.map(|clip_norm| RoundPrivacy {
                sampling_rate: row.dp_sampling_rate,
                epsilon: row.dp_epsilon,
                clip_norm,
            }),
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ParticipantView {
    pub device_id: i64,
    pub state: ParticipantState,
    pub num_samples: Option<i64>,
    pub update_bytes: Option<i64>,
    pub train_loss: Option<f64>,
    pub eval_loss: Option<f64>,
    pub eval_accuracy: Option<f64>,
    pub train_duration_ms: Option<i64>,
    pub selected_ms: i64,
    pub delivered_ms: Option<i64>,
    pub uploaded_ms: Option<i64>,
    /// Why a dropped device dropped out: the reason it gave when it
    /// declined (a model it refused, data that does not fit, ...), a
    /// timeout, its exclusion from a secure round (neighbours could not
    /// open its shares), or the round's failure. For an `ineligible` one, the
    /// requirements of the job's `device_policy` it no longer met.
    pub drop_reason: Option<String>,
    /// For an aggregator in a tiered job: its account of the sub-round
    /// below it (the tree's next tier): `selected`, `updates`, `dropouts`,
    /// `ineligible`, `dropout_reasons` (`reason`, `devices`), `samples`,
    /// `bytes_in`, `bytes_out` and `duration_ms`. It names no end device.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub sub_round: Option<serde_json::Value>,
    /// In an asynchronous job, the buffer (round id) that took the
    /// device's update, and how many versions behind it the update was
    /// trained.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub folded_round_id: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub staleness: Option<i64>,
}

impl From<ParticipantRow> for ParticipantView {
    fn from(row: ParticipantRow) -> ParticipantView {
        ParticipantView {
            device_id: row.device_id,
            state: row.state,
            num_samples: row.num_samples,
            update_bytes: row.update_bytes,
            train_loss: row.train_loss,
            eval_loss: row.eval_loss,
            eval_accuracy: row.eval_accuracy,
            train_duration_ms: row.train_duration_ms,
            selected_ms: row.selected_ms,
            delivered_ms: row.delivered_ms,
            uploaded_ms: row.uploaded_ms,
            drop_reason: row.drop_reason,
            sub_round: row
                .sub_round
                .and_then(|text| serde_json::from_str(&text).ok()),
            folded_round_id: row.folded_round_id,
            staleness: row.staleness,
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct RoundDetail {
    #[serde(flatten)]
    pub round: RoundView,
    pub metrics: RoundMetricsView,
    pub durations: RoundDurations,
    /// The first participants by device id; page through
    /// `/api/v1/rounds/{id}/participants` for all.
    pub participants: Vec<ParticipantView>,
    pub participants_next_cursor: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct RoundDetailList {
    pub items: Vec<RoundDetail>,
    pub next_cursor: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ParticipantList {
    pub items: Vec<ParticipantView>,
    pub next_cursor: Option<String>,
}

fn span(from: Option<i64>, to: Option<i64>) -> Option<i64> {
    Some(to? - from?)
}

async fn detail(
    state: &AppState,
    row: &RoundRow,
    with_participants: bool,
) -> ApiResult<RoundDetail> {
    let metrics = rounds::metrics(&state.db, row).await?;
    let federated = evaluations::federated(&state.db, row.id).await?;
    let (participants, participants_next_cursor) = if with_participants {
        let page = crate::store::Page {
            after: 0,
            limit: DETAIL_PARTICIPANTS + 1,
        };
        let rows = rounds::participants(&state.db, row.id, page).await?;
        let (rows, next) = finish(rows, page, |p| p.device_id.to_string());
        (rows.into_iter().map(Into::into).collect(), next)
    } else {
        (Vec::new(), None)
    };
    let end = row.finished_ms;
    Ok(RoundDetail {
        round: row.into(),
        metrics: RoundMetricsView {
            train_loss: metrics.train_loss,
            eval_accuracy: metrics.eval_accuracy,
            eval_loss: metrics.eval_loss,
            bytes_in: row.bytes_in,
            bytes_out: row.bytes_out,
            dropouts: row.dropouts,
            ineligible: row.ineligible,
            updates_accepted: row.updates_accepted,
            samples: row.weight_total,
            federated_eval_accuracy: federated.accuracy,
            federated_eval_loss: federated.loss,
            federated_eval_samples: federated.samples,
            federated_eval_devices: federated.devices,
            federated_eval_dropouts: federated.dropped,
            federated_eval_ineligible: federated.ineligible,
            federated_eval_state: row.evaluation_state()?,
            central_eval_accuracy: row.central_eval_accuracy,
            central_eval_loss: row.central_eval_loss,
            central_eval_samples: row.central_eval_samples,
            central_eval_state: row.central_state()?,
            central_eval_error: row.central_eval_error.clone(),
        },
        durations: RoundDurations {
            selecting_ms: span(Some(row.created_ms), row.training_started_ms),
            training_ms: span(row.training_started_ms, row.closed_ms),
            aggregating_ms: span(row.closed_ms, end),
            total_ms: span(Some(row.created_ms), end),
            mean_device_training_ms: metrics.mean_train_duration_ms,
        },
        participants,
        participants_next_cursor,
    })
}

/// Which end of a job's rounds a page starts from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum RoundOrder {
    /// Oldest first; `next_cursor` leads to later rounds.
    #[default]
    Oldest,
    /// Newest first; `next_cursor` leads to earlier rounds. A dashboard
    /// polls the first page of this order for a long job's latest rounds.
    Newest,
}

/// The rounds list's query: a page (as [`PageQuery`]) and its order. Not
/// a flattened `PageQuery`: serde's flatten reads query values as strings
/// only, so `limit` would no longer parse as a number.
#[derive(Debug, Deserialize)]
pub struct RoundsQuery {
    pub limit: Option<u32>,
    pub cursor: Option<String>,
    #[serde(default)]
    pub order: RoundOrder,
}

/// List a job's rounds with their metrics, oldest first (or newest first
/// with `order=newest`).
#[utoipa::path(
    get, path = "/api/v1/jobs/{id}/rounds", tag = "jobs",
    params(
        ("id" = i64, Path),
        ("limit" = Option<u32>, Query, minimum = 1, maximum = 100, description = "Rounds per page, 1 to 100 (each carries its metrics)"),
        ("cursor" = Option<String>, Query, pattern = "^[0-9]{1,18}$", description = "`next_cursor` of the previous page (of the same order)"),
        ("order" = Option<RoundOrder>, Query, description = "`oldest` (the default) or `newest` first"),
    ),
    responses((status = 200, body = RoundDetailList), (status = 400, body = ErrorResponse), (status = 401, body = ErrorResponse), (status = 404, body = ErrorResponse)),
    security(("bearer" = []))
)]
pub async fn list_rounds(
    State(state): State<AppState>,
    Path(id): Path<i64>,
    Query(query): Query<RoundsQuery>,
) -> ApiResult<Json<RoundDetailList>> {
    find(&state, id).await?;
    let has_cursor = query.cursor.is_some();
    let page_query = PageQuery {
        limit: query.limit,
        cursor: query.cursor,
    };
    let page = page_query.page(state.settings.limits.max_page_size.min(MAX_ROUNDS_PAGE))?;
    let rows = match query.order {
        RoundOrder::Oldest => rounds::list_for_job(&state.db, id, page).await?,
        RoundOrder::Newest => {
            let before = has_cursor.then_some(page.after);
            rounds::list_for_job_newest(&state.db, id, before, page.limit).await?
        }
    };
    let (rows, next_cursor) = finish(rows, page, |row| row.id.to_string());
    let mut items = Vec::with_capacity(rows.len());
    for row in &rows {
        items.push(detail(&state, row, false).await?);
    }
    Ok(Json(RoundDetailList { items, next_cursor }))
}

/// A round's detail: participants, metrics and durations.
#[utoipa::path(
    get, path = "/api/v1/rounds/{id}", tag = "jobs", params(("id" = i64, Path)),
    responses((status = 200, body = RoundDetail), (status = 400, body = ErrorResponse), (status = 401, body = ErrorResponse), (status = 404, body = ErrorResponse)),
    security(("bearer" = []))
)]
pub async fn get_round(
    State(state): State<AppState>,
    Path(id): Path<i64>,
) -> ApiResult<Json<RoundDetail>> {
    let row = rounds::get(&state.db, id)
        .await?
        .ok_or_else(|| ApiError::not_found(format!("round {id} does not exist")))?;
    Ok(Json(detail(&state, &row, true).await?))
}

/// Page through a round's participants.
#[utoipa::path(
    get, path = "/api/v1/rounds/{id}/participants", tag = "jobs", params(("id" = i64, Path), PageQuery),
    responses((status = 200, body = ParticipantList), (status = 400, body = ErrorResponse), (status = 401, body = ErrorResponse), (status = 404, body = ErrorResponse)),
    security(("bearer" = []))
)]
pub async fn list_participants(
    State(state): State<AppState>,
    Path(id): Path<i64>,
    Query(query): Query<PageQuery>,
) -> ApiResult<Json<ParticipantList>> {
    rounds::get(&state.db, id)
        .await?
        .ok_or_else(|| ApiError::not_found(format!("round {id} does not exist")))?;
    let page = query.page(state.settings.limits.max_page_size)?;
    let rows = rounds::participants(&state.db, id, page).await?;
    let (rows, next_cursor) = finish(rows, page, |p| p.device_id.to_string());
    Ok(Json(ParticipantList {
        items: rows.into_iter().map(Into::into).collect(),
        next_cursor,
    }))
}
