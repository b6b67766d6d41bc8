//! Update upload: a binary stream, bounded by the model's own size.
//!
//! Order matters. The signature is checked from headers alone; the round
//! and participant are checked before the body is touched; the declared
//! length is checked against the exact encoded size of the model's
//! trainable parameters; only then is a slot taken (one per device and
//! round, see `slots.rs`) and the body read, chunk by chunk, stopping at the
//! limit and at the upload timeout. Upload slots bound how many bodies are
//! in memory at once.

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use canopy_protocol::messages::UploadReceipt;
use canopy_protocol::update::decode_update;

use super::auth::DeviceAuth;
use super::folds::{self, FoldError};
use super::tasks::round_layout;
use crate::api::admin::models::content_length;
use crate::api::error::{ApiError, ApiResult, Json, Path};
use crate::api::{upload_slot, within_upload_timeout};
use crate::db::now_ms;
use crate::state::AppState;
use crate::store::jobs;
use crate::store::rounds::{self, AcceptedUpdate, RoundKind, UploadRejection};
use canopy_term::error_chain as chain;

pub async fn upload_update(
    State(state): State<AppState>,
    device: DeviceAuth,
    Path(round_id): Path<i64>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<(StatusCode, Json<UploadReceipt>)> {
    let (kind, base_version_id, job_id, robust) =
        check_participant(&state, round_id, device.device_id).await?;
    let layout = round_layout(&state, kind, base_version_id).await?;
    let limit = layout.encoded_len();
    if let Some(length) = content_length(&headers)
        && length > limit
    {
        return Err(ApiError::too_large(format!(
            "the update is {length} bytes, but an update of this model is at most {limit} bytes \
             (all f32)"
        )));
    }
    let _slot = upload_slot(
        &state,
        &state.upload_slots,
        Some((device.device_id, round_id)),
    )
    .await?;
    let over_limit = || {
        ApiError::too_large(format!(
            "the update is over {limit} bytes, the size of an update of this model in f32"
        ))
    };
    let bytes = within_upload_timeout(
        &state,
        "update",
        device.read_body(body, limit, "upload", over_limit),
    )
    .await?;
    let decoded = {
        let layout = layout.clone();
        let bytes = bytes.clone();
        tokio::task::spawn_blocking(move || decode_update(&bytes, &layout))
            .await
            .map_err(|error| ApiError::internal(format!("update decoding task failed: {error}")))?
    }
    .map_err(|error| {
        ApiError::unprocessable(format!("update for round {round_id} rejected: {error}"))
    })?;
    let num_samples = decoded.num_samples;
    check_sample_bound(&state, job_id, round_id, num_samples).await?;
    if kind == RoundKind::Statistics {
        check_moments(num_samples, &decoded.values).map_err(|reason| {
            ApiError::unprocessable(format!(
                "statistics for round {round_id} rejected: {reason}"
            ))
        })?;
    }
    let (values, stored) = match robust {
        true => {
            let values = decoded.values;
            let digest = store_update(&state, round_id, device.device_id, values).await?;
            (Vec::new(), Some(digest))
        }
        false => (decoded.values, None),
    };
    let update = AcceptedUpdate {
        device_id: device.device_id,
        num_samples,
        values,
        bytes: bytes.len() as u64,
        stored,
    };
    folds::submit(&state, round_id, update)
        .await
        .map_err(|error| match error {
            FoldError::Refused(rejection_reason) => rejection(rejection_reason),
            FoldError::Failed(error) => error,
        })?;
    state.metrics.updates_accepted.inc();
    state.metrics.bytes_received.inc_by(bytes.len() as u64);
    tracing::debug!(
        round = round_id,
        device = device.device_id,
        samples = num_samples,
        "accepted update"
    );
    Ok((
        StatusCode::CREATED,
        Json(UploadReceipt {
            round_id,
            accepted: true,
            num_samples,
            bytes: bytes.len() as u64,
        }),
    ))
}

fn rejection(error: UploadRejection) -> ApiError {
    match error {
        UploadRejection::NotParticipant { .. } => ApiError::forbidden(error.to_string()),
        UploadRejection::Duplicate { .. } => ApiError::conflict(error.to_string()),
        UploadRejection::Closed { .. }
        | UploadRejection::Dropped { .. }
        | UploadRejection::Withdrawn { .. }
        | UploadRejection::Stale { .. } => ApiError::gone(error.to_string()),
        // The wait in `folds` has already passed: the version is late.
        UploadRejection::NoOpenBuffer { .. } => ApiError::busy(error.to_string(), 1),
        UploadRejection::Secure { .. } => ApiError::unprocessable(error.to_string()),
        UploadRejection::SumLength { .. } => ApiError::internal(error.to_string()),
    }
}

/// Fails fast, before reading the body, on uploads that cannot be accepted,
/// with the same decision the fold makes under the round's lock.
async fn check_participant(
    state: &AppState,
    round_id: i64,
    device_id: i64,
) -> ApiResult<(RoundKind, i64, i64, bool)> {
    let standing = rounds::standing(&state.db, round_id, device_id).await?;
    let Some(standing) = standing else {
        return Err(rejection(UploadRejection::NotParticipant {
            round_id,
            device_id,
        }));
    };
    let participant = Some(standing.participant);
    rounds::admit(standing.gate(round_id), device_id, participant, now_ms()).map_err(rejection)?;
    // A secure round's stage is set with its participants and never
    // cleared while it takes input, so the check before the body decides.
    if standing.secagg_stage.is_some() {
        return Err(rejection(UploadRejection::Secure { round_id }));
    }
    let robust = standing.robust_rule.is_some();
    Ok((
        standing.kind,
        standing.base_version_id,
        standing.job_id,
        robust,
    ))
}

/// Writes a robust round's update to the blob store, synced, before the
/// fold names it: its values as little-endian f32, so that the round can
/// read any block of coordinates. Its digest.
async fn store_update(
    state: &AppState,
    round_id: i64,
    device_id: i64,
    values: Vec<f32>,
) -> ApiResult<String> {
    use sha2::{Digest, Sha256};
    let (raw, digest) = tokio::task::spawn_blocking(move || {
        let raw: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let digest = hex::encode(Sha256::digest(&raw));
        (raw, digest)
    })
    .await
    .map_err(|error| ApiError::internal(format!("update hashing task failed: {error}")))?;
    state
        .blobs
        .put_update(round_id, device_id, &digest, bytes::Bytes::from(raw))
        .await
        .map_err(|error| {
            ApiError::internal(format!(
                "round {round_id}'s update from device {device_id} could not be stored: {}",
                chain(&error)
            ))
        })?;
    Ok(digest)
}

/// Refuses an update that claims more samples than its job allows one
/// device (`max_samples_per_device`), or, in a tiered job, than the
/// aggregator's sub-round could have gathered: every device it may select,
/// each at that bound. A weight is what FedAvg trusts, so a sender that
/// overstates it would outweigh everyone else.
async fn check_sample_bound(
    state: &AppState,
    job_id: i64,
    round_id: i64,
    num_samples: u64,
) -> ApiResult<()> {
    let job = jobs::get(&state.db, job_id)
        .await?
        .ok_or_else(|| ApiError::gone(format!("round {round_id}'s job {job_id} is gone")))?;
    let spec = job.spec()?;
    let (bound, what) = match spec.sub_round(0) {
        Some(sub_round) => (
            sub_round.max_samples(),
            format!(
                "an aggregator's result in round {round_id} may claim at most {} samples \
                 (each of its sub-round's {} rounds takes updates from at most {} devices, each \
                 at most the job's `max_samples_per_device` of {})",
                sub_round.max_samples(),
                sub_round.rounds,
                sub_round.max_devices(),
                sub_round.max_samples_per_device
            ),
        ),
        None => match spec.max_samples_per_device {
            Some(bound) => (
                bound,
                format!(
                    "an update in round {round_id} may claim at most the job's \
                     `max_samples_per_device` of {bound} samples"
                ),
            ),
            None => return Ok(()),
        },
    };
    if num_samples > bound {
        return Err(ApiError::unprocessable(format!(
            "the update claims {num_samples} samples, but {what}"
        )));
    }
    Ok(())
}

/// One device's input moments (per feature, the mean then the mean of
/// squares, over `count` samples) must be moments of real numbers, so a
/// bad report is refused alone instead of failing the round's fit.
fn check_moments(count: u64, values: &[f32]) -> Result<(), String> {
    let features = values.len() / 2;
    let scale = count as f64;
    let moments = canopy_engine::stats::InputMoments {
        count,
        sum: values[..features]
            .iter()
            .map(|&m| f64::from(m) * scale)
            .collect(),
        sum_sq: values[features..]
            .iter()
            .map(|&m| f64::from(m) * scale)
            .collect(),
    };
    moments
        .validate()
        .map_err(|error| canopy_term::error_chain(&error))
}
