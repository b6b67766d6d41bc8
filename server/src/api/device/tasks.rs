//! Task polling and model download.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::store::rounds::RoundKind;
use axum::Extension;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use canopy_protocol::messages::{
    ERROR_NO_OPEN_TASK, SecureTask, Task, TaskKind, TrainingConfig, task_paths,
};
use canopy_protocol::model_sig::{
    HEADER_MODEL_DELEGATION, HEADER_MODEL_DIGEST, HEADER_MODEL_KEY, HEADER_MODEL_SIGNATURE,
};
use canopy_protocol::update::UpdateLayout;
use serde::Deserialize;

use super::auth::DeviceAuth;
use super::{POLL_RECHECK_MS, poll_wait, waiting};
use crate::api::error::{ApiError, ApiResult, Path, Query};
use crate::request_slots::PollSlot;
use crate::state::AppState;
use crate::store::evaluations::{self, EvaluatorState};
use crate::store::jobs::JobSpec;
use crate::store::rounds::ParticipantState;
use crate::store::task_state::has_task_on_version;
use crate::store::{models, rounds};

#[derive(Debug, Deserialize)]
pub struct PollQuery {
    pub wait_ms: Option<u64>,
}

/// Answers a task when there is one, else waits for one up to `wait_ms`.
/// While it waits the poll holds only its place among the waiting polls
/// (`max_waiting_polls`), not a general one: it gives that back around the
/// wait ([`PollSlot::while_waiting`]) and takes it again to look.
pub async fn next_task(
    State(state): State<AppState>,
    device: DeviceAuth,
    slot: Option<Extension<PollSlot>>,
    Query(query): Query<PollQuery>,
) -> ApiResult<Response> {
    let Some(Extension(slot)) = slot else {
        return Err(ApiError::internal(
            "the task poll ran without its request slot (api::take_request_slots); this is a bug",
        ));
    };
    let _poll = state
        .device_polls
        .try_enter(device.device_id)
        .ok_or_else(|| {
            state.metrics.refused("max_polls_per_device");
            ApiError::too_many(
                format!(
                    "device {} already has {} task polls waiting, its limit; \
                     poll again when one is answered",
                    device.device_id,
                    state.device_polls.limit()
                ),
                1,
            )
        })?;
    let wait = poll_wait(query.wait_ms, state.settings.limits.long_poll_max_ms);
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        // Register interest before looking, so a wake-up between the look
        // and the wait is not lost.
        let woken = state.tasks_ready.notified();
        // Most polls of a large fleet come from devices with nothing to do:
        // the board answers those without a task query of their own.
        if state
            .task_board
            .may_have_task(&state, device.device_id)
            .await?
        {
            // Evaluating a finished round's version is quick and costs no
            // training, so it goes before the next round's training.
            if let Some(task) = evaluations::take(&state.db, device.device_id).await? {
                return Ok(axum::Json(build_evaluation_task(&state, task).await?).into_response());
            }
            if let Some(task) = rounds::take_task(&state.db, device.device_id).await? {
                let task = build_task(&state, task, &device.public_key).await?;
                return Ok(axum::Json(task).into_response());
            }
        }
        if tokio::time::Instant::now() >= deadline || state.is_shutting_down() {
            return Ok(StatusCode::NO_CONTENT.into_response());
        }
        let board = wait_for_board(&state, device.device_id, woken, deadline);
        // False only at the deadline or on shutdown.
        if !waiting(&state, Some(&slot), board).await?? {
            return Ok(StatusCode::NO_CONTENT.into_response());
        }
    }
}

/// Which devices have a task waiting, read for all of a process's task
/// polls at once: again after this process's orchestrator selects devices
/// ([`AppState::announcing`]), and at least every `POLL_RECHECK_MS` for
/// rounds opened by another server process. A waiting poll looks at its
/// own rows only once its device is on the board, so 10,000 idle
/// devices, polling or waiting, cost the database one read per interval
/// instead of two each per look.
///
/// Architecture invariant: a transaction that selects devices commits
/// while it holds [`AppState::announcing`], so a poll that begins after
/// the commit sees its tasks; another process's selection is seen within
/// `POLL_RECHECK_MS`.
#[derive(Default)]
pub struct TaskBoard {
    snapshot: tokio::sync::Mutex<Option<BoardSnapshot>>,
    /// Selections of this process now committing.
    selecting: AtomicU64,
    /// Selections of this process done; a snapshot read before the latest
    /// is stale whatever its age.
    selections: AtomicU64,
}

struct BoardSnapshot {
    /// When the read began: it saw every commit before then.
    read_started: tokio::time::Instant,
    /// `selections` when the read began, or `None` when a selection was
    /// committing then, which the read may or may not have seen.
    selections: Option<u64>,
    devices: Arc<HashSet<i64>>,
}

impl TaskBoard {
    pub(crate) fn selection_begins(&self) {
        self.selecting.fetch_add(1, Ordering::SeqCst);
    }

    pub(crate) fn selection_ends(&self) {
        self.selections.fetch_add(1, Ordering::SeqCst);
        self.selecting.fetch_sub(1, Ordering::SeqCst);
    }

    /// False when the board, at most `POLL_RECHECK_MS` old and read after
    /// this process's last selection, has no task for `device_id`.
    pub(crate) async fn may_have_task(&self, state: &AppState, device_id: i64) -> ApiResult<bool> {
        let interval = std::time::Duration::from_millis(POLL_RECHECK_MS);
        let now = tokio::time::Instant::now();
        let fresh_since = now.checked_sub(interval).unwrap_or(now);
        Ok(self.devices(state, fresh_since).await?.contains(&device_id))
    }

    /// The board as read since `fresh_since` and after the last selection,
    /// read again when older; one read at a time, which the polls waiting
    /// for it then share.
    async fn devices(
        &self,
        state: &AppState,
        fresh_since: tokio::time::Instant,
    ) -> ApiResult<Arc<HashSet<i64>>> {
        let mut snapshot = self.snapshot.lock().await;
        // Both read before the board is, so a selection that commits
        // during the read leaves the snapshot stale.
        let committing = self.selecting.load(Ordering::SeqCst) > 0;
        let selections = (!committing).then(|| self.selections.load(Ordering::SeqCst));
        if let Some(current) = snapshot.as_ref()
            && current.read_started >= fresh_since
            && current.selections.is_some()
            && current.selections == selections
        {
            return Ok(current.devices.clone());
        }
        let read_started = tokio::time::Instant::now();
        let devices = Arc::new(rounds::devices_with_tasks(&state.db).await?);
        *snapshot = Some(BoardSnapshot {
            read_started,
            selections,
            devices: devices.clone(),
        });
        Ok(devices)
    }
}

/// Waits until the board has a task for `device_id` (true), or until
/// `deadline` or shutdown (false).
async fn wait_for_board(
    state: &AppState,
    device_id: i64,
    woken: tokio::sync::futures::Notified<'_>,
    deadline: tokio::time::Instant,
) -> ApiResult<bool> {
    let interval = std::time::Duration::from_millis(POLL_RECHECK_MS);
    tokio::pin!(woken);
    loop {
        let now = tokio::time::Instant::now();
        if now >= deadline || state.is_shutting_down() {
            return Ok(false);
        }
        let fresh_since = tokio::select! {
            _ = &mut woken => {
                // Selected just now: only a read begun after the wake-up
                // has seen it. Listen again before reading.
                woken.set(state.tasks_ready.notified());
                tokio::time::Instant::now()
            }
            _ = tokio::time::sleep_until((now + interval).min(deadline)) => {
                let now = tokio::time::Instant::now();
                now.checked_sub(interval).unwrap_or(now)
            }
        };
        if state.is_shutting_down() {
            return Ok(false);
        }
        if state
            .task_board
            .devices(state, fresh_since)
            .await?
            .contains(&device_id)
        {
            return Ok(true);
        }
    }
}

/// The update layout of a model version, cached.
pub async fn layout(state: &AppState, version_id: i64) -> ApiResult<Arc<UpdateLayout>> {
    if let Some(layout) = state.cached_layout(version_id) {
        return Ok(layout);
    }
    let row = models::get_version(&state.db, version_id)
        .await?
        .ok_or_else(|| ApiError::not_found(format!("model version {version_id} does not exist")))?;
    layout_of_row(state, &row)
}

/// The layout of the updates a round takes: the model's trainable
/// parameters, or a statistics round's moments of its input.
pub async fn round_layout(
    state: &AppState,
    kind: RoundKind,
    base_version_id: i64,
) -> ApiResult<Arc<UpdateLayout>> {
    match kind {
        RoundKind::Train => layout(state, base_version_id).await,
        RoundKind::Statistics => statistics_layout(state, base_version_id).await,
    }
}

/// A statistics round's layout for a version: per input feature, the mean
/// and the mean of squares.
async fn statistics_layout(state: &AppState, version_id: i64) -> ApiResult<Arc<UpdateLayout>> {
    let shape = crate::orchestrator::model_input_shape(state, version_id)
        .await
        .map_err(|error| ApiError::internal(canopy_term::error_chain(&error)))?;
    let features = shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(usize::try_from(d).ok()?));
    let layout = features
        .ok_or_else(|| "the input is too large".to_string())
        .and_then(|f| canopy_protocol::update::statistics_layout(f).map_err(|e| e.to_string()))
        .map_err(|reason| {
            ApiError::internal(format!(
                "no statistics layout for model version {version_id}: {reason}"
            ))
        })?;
    Ok(Arc::new(layout))
}

/// The layout of a version row already in hand, cached.
fn layout_of_row(state: &AppState, row: &models::VersionRow) -> ApiResult<Arc<UpdateLayout>> {
    if let Some(layout) = state.cached_layout(row.id) {
        return Ok(layout);
    }
    let layout = Arc::new(row.layout()?);
    state.cache_layout(row.id, layout.clone());
    Ok(layout)
}

fn job_spec(job_id: i64, config: &str) -> ApiResult<JobSpec> {
    serde_json::from_str(config).map_err(|error| {
        ApiError::internal(format!("job {job_id} has an unreadable config: {error}"))
    })
}

/// An evaluation task: the version the round produced, evaluated on the
/// device's held-out data and reported to the evaluation path.
async fn build_evaluation_task(
    state: &AppState,
    task: evaluations::EvaluationTaskRow,
) -> ApiResult<Task> {
    let spec = job_spec(task.job_id, &task.config)?;
    let version = models::get_version(&state.db, task.version_id)
        .await?
        .ok_or_else(|| ApiError::internal(format!("model version {} vanished", task.version_id)))?;
    let layout = layout_of_row(state, &version)?;
    Ok(Task {
        kind: TaskKind::Evaluate,
        job_id: task.job_id,
        round_id: task.round_id,
        round_number: u32::try_from(task.number).unwrap_or(u32::MAX),
        model_version_id: version.id,
        model_digest: version.digest.clone(),
        model_size_bytes: u64::try_from(version.size_bytes).unwrap_or(0),
        model_path: format!("/device/v1/models/{}", version.id),
        upload_path: task_paths::upload(TaskKind::Evaluate, task.round_id),
        upload_size_bytes: 0,
        deadline_unix_ms: u64::try_from(task.deadline_ms).unwrap_or(0),
        training: training_config(&spec, task.number),
        dataset: spec.dataset.clone(),
        layout: (*layout).clone(),
        secure_aggregation: None,
        sub_round: spec.evaluation_sub_round(u64::try_from(task.deadline_ms).unwrap_or(0)),
        policy: spec.device_policy,
        privacy: None,
        compression: None,
    })
}

fn training_config(spec: &JobSpec, round_number: i64) -> TrainingConfig {
    TrainingConfig {
        epochs: spec.local_epochs,
        batch_size: spec.batch_size,
        learning_rate: spec.learning_rate_at(u32::try_from(round_number).unwrap_or(u32::MAX)),
    }
}

/// The task of a training or statistics round for the device whose key
/// is `device_key`.
async fn build_task(
    state: &AppState,
    task: rounds::TaskRow,
    device_key: &[u8; 32],
) -> ApiResult<Task> {
    let spec = job_spec(task.job_id, &task.config)?;
    let version = models::get_version(&state.db, task.base_version_id)
        .await?
        .ok_or_else(|| {
            ApiError::internal(format!("model version {} vanished", task.base_version_id))
        })?;
    let (kind, layout) = match task.kind {
        RoundKind::Train => (TaskKind::Train, layout_of_row(state, &version)?),
        RoundKind::Statistics => (
            TaskKind::Statistics,
            statistics_layout(state, version.id).await?,
        ),
    };
    Ok(Task {
        kind,
        job_id: task.job_id,
        round_id: task.round_id,
        round_number: u32::try_from(task.number).unwrap_or(u32::MAX),
        model_version_id: version.id,
        model_digest: version.digest.clone(),
        model_size_bytes: u64::try_from(version.size_bytes).unwrap_or(0),
        model_path: format!("/device/v1/models/{}", version.id),
        upload_path: task_paths::upload(kind, task.round_id),
        upload_size_bytes: layout.encoded_len(),
        deadline_unix_ms: u64::try_from(task.deadline_ms).unwrap_or(0),
        training: training_config(&spec, task.number),
        dataset: spec.dataset.clone(),
        layout: (*layout).clone(),
        secure_aggregation: secure_task(state, &task)?,
        sub_round: sub_round(state, &spec, kind, &task, device_key)?,
        policy: spec.device_policy,
        privacy: match kind {
            TaskKind::Train => spec.differential_privacy.as_ref().and_then(|dp| dp.task()),
            TaskKind::Evaluate | TaskKind::Statistics => None,
        },
        // A statistics round's moments stay f32: they are few, and fitted
        // exactly.
        compression: match kind {
            TaskKind::Train => spec.update_compression.as_ref().map(|c| c.task()),
            TaskKind::Evaluate | TaskKind::Statistics => None,
        },
    })
}

/// A tiered job's sub-round for the aggregator whose key is `device_key`.
/// A training sub-round that makes versions of its own carries this
/// server's leave for that key to sign them, until the sub-round's
/// deadline: the aggregator's devices trust only this server's key.
fn sub_round(
    state: &AppState,
    spec: &JobSpec,
    kind: TaskKind,
    task: &rounds::TaskRow,
    device_key: &[u8; 32],
) -> ApiResult<Option<canopy_protocol::messages::SubRound>> {
    let Some(mut sub_round) = spec.sub_round(u64::try_from(task.deadline_ms).unwrap_or(0)) else {
        return Ok(None);
    };
    // Versions of the aggregator's own are a training sub-round's: the
    // job's edge settings for them leave any other task (devices refuse
    // them there, `Task::validate`).
    if kind != TaskKind::Train {
        sub_round.rounds = 1;
        sub_round.asynchronous = None;
    }
    if sub_round.makes_versions() {
        let delegation = state
            .signing
            .delegate(device_key, sub_round.deadline_unix_ms)
            .ok_or_else(|| {
                ApiError::internal(
                    "a server that relays another's signatures cannot let an aggregator sign",
                )
            })?;
        sub_round.delegation = Some(delegation);
    }
    Ok(Some(sub_round))
}

fn secure_task(state: &AppState, task: &rounds::TaskRow) -> ApiResult<Option<SecureTask>> {
    let Some(plan) = &task.secagg_plan else {
        return Ok(None);
    };
    let plan = crate::store::from_json("rounds.secagg_plan", plan)?;
    Ok(Some(SecureTask {
        plan,
        path: format!("/device/v1/rounds/{}/secagg", task.round_id),
        stage_timeout_ms: state.settings.limits.secagg_stage_timeout_ms,
    }))
}

/// Parses `Range: bytes=N-`, the one form resumable downloads need.
fn range_start(headers: &HeaderMap, size: u64) -> ApiResult<Option<u64>> {
    let Some(value) = headers.get(header::RANGE) else {
        return Ok(None);
    };
    let text = value.to_str().unwrap_or_default();
    let start = text
        .strip_prefix("bytes=")
        .and_then(|rest| rest.strip_suffix('-'))
        .and_then(|start| start.parse::<u64>().ok())
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::RANGE_NOT_SATISFIABLE,
                "range_not_satisfiable",
                format!(
                    "only `Range: bytes=N-` is supported, got `{}`",
                    text.chars().take(64).collect::<String>()
                ),
            )
        })?;
    if start >= size {
        return Err(ApiError::new(
            StatusCode::RANGE_NOT_SATISFIABLE,
            "range_not_satisfiable",
            format!("range starts at byte {start}, but the model is {size} bytes"),
        ));
    }
    Ok(Some(start))
}

pub async fn download_model(
    State(state): State<AppState>,
    device: DeviceAuth,
    Path(version_id): Path<i64>,
    headers: HeaderMap,
) -> ApiResult<Response> {
    // 404 whether the version is missing or only not this device's task:
    // a device learns nothing about versions it was not sent.
    let (db, device_id) = (&state.db, device.device_id);
    let trains_on = has_task_on_version::<ParticipantState>(db, device_id, version_id).await?;
    if !trains_on && !has_task_on_version::<EvaluatorState>(db, device_id, version_id).await? {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            ERROR_NO_OPEN_TASK,
            format!(
                "device {} has no open task on model version {version_id}; a device downloads \
                 only the version of a round it was selected for, until the round closes",
                device.device_id
            ),
        ));
    }
    let version = models::get_version(&state.db, version_id)
        .await?
        .ok_or_else(|| ApiError::not_found(format!("model version {version_id} does not exist")))?;
    let size = u64::try_from(version.size_bytes).unwrap_or(0);
    let start = range_start(&headers, size)?;
    let blob = state
        .blobs
        .stream(&version.digest, start.unwrap_or(0))
        .await?;
    let sent = blob.range.end - blob.range.start;
    state.metrics.bytes_sent.inc_by(sent);
    rounds::add_bytes_out(&state.db, device.device_id, version_id, sent).await?;
    let signed = state
        .signing
        .model_signature(&state.db, &version.digest)
        .await
        .map_err(|error| ApiError::internal(canopy_term::error_chain(&error)))?;
    let status = if start.is_some() {
        StatusCode::PARTIAL_CONTENT
    } else {
        StatusCode::OK
    };
    let mut response = (
        status,
        [
            (header::CONTENT_TYPE, "application/octet-stream".to_string()),
            (header::CONTENT_LENGTH, sent.to_string()),
            (header::ACCEPT_RANGES, "bytes".to_string()),
        ],
        [
            (HEADER_MODEL_DIGEST, version.digest.clone()),
            (HEADER_MODEL_SIGNATURE, signed.signature_hex),
            (HEADER_MODEL_KEY, signed.key_hex),
        ],
        Body::from_stream(blob.stream),
    )
        .into_response();
    if let Some(delegation) = signed.delegation.and_then(|json| json.parse().ok()) {
        response
            .headers_mut()
            .insert(HEADER_MODEL_DELEGATION, delegation);
    }
    if start.is_some() {
        let value = format!(
            "bytes {}-{}/{}",
            blob.range.start,
            blob.range.end.saturating_sub(1),
            blob.size
        );
        if let Ok(value) = value.parse() {
            response.headers_mut().insert(header::CONTENT_RANGE, value);
        }
    }
    Ok(response)
}
