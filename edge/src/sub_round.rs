//! A cloud task becomes a sub-round: the cloud's version, verified and
//! kept once by digest with the cloud's signature, and a local job of one
//! round on it, opened with its uplink row in one transaction
//! ([`uplinks::begin`]).

use bytes::Bytes;
use canopy_protocol::messages::{SubRound, Task, TaskKind};
use canopy_sdk::{DeviceClient, SdkError};
use canopy_server::blobs::BlobError;
use canopy_server::db::{SqlError, now_ms};
use canopy_server::signing::ModelSignature;
use canopy_server::state::AppState;
use canopy_server::store::jobs::{Asynchronous, JobSpec};
use canopy_server::store::uplinks::{self, NewSubRound, UplinkKind};
use canopy_server::store::{models, relayed_signatures};

/// Why the edge declines a cloud task; the cloud records it as the
/// aggregator's reason.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    #[error("this aggregator runs only sub-rounds of tiered jobs; the task has no `sub_round`")]
    NotTiered,
    #[error("the task is outside the shared bounds")]
    Bounds(#[from] canopy_protocol::bounds::BoundsError),
    #[error("the sub-round's deadline has passed, or leaves under a second")]
    TooLate,
    #[error("the sub-round's settings make no valid local job: {0}")]
    LocalJob(String),
    #[error("the sub-round makes versions of its own, and {0}")]
    Delegation(String),
    #[error("cannot fetch the cloud's model")]
    Download(#[source] SdkError),
    #[error("the edge's blob store failed")]
    Blob(#[from] BlobError),
    #[error("the edge's database failed")]
    Database(#[from] SqlError),
}

/// Opens the sub-round of a cloud task; returns its local job's id.
pub async fn open(cloud: &DeviceClient, state: &AppState, task: &Task) -> Result<i64, Refusal> {
    task.validate()?;
    let Some(sub_round) = &task.sub_round else {
        return Err(Refusal::NotTiered);
    };
    let spec = local_job_spec(task, sub_round, now_ms())?;
    // `Task::validate` let only a training sub-round make versions.
    if sub_round.makes_versions() {
        check_delegation(cloud, sub_round)?;
    }
    let signature = cached_signature(state, task).await?;
    let signature = match signature {
        Some(signature) => signature,
        None => fetch(cloud, state, task).await?,
    };
    let cloud_task_json = serde_json::to_string(task).unwrap_or_default();
    let model_name = format!("cloud-job-{}", task.job_id);
    let uplink = uplinks::begin(
        &state.db,
        NewSubRound {
            cloud_round_id: task.round_id,
            kind: UplinkKind::of(task.kind),
            cloud_task_json: &cloud_task_json,
            model_name: &model_name,
            digest: &task.model_digest,
            size_bytes: task.model_size_bytes,
            layout: &task.layout,
            signature: &signature,
            spec,
        },
    )
    .await?;
    state.orchestrator_wake.notify_one();
    Ok(uplink.job_id)
}

/// That the cloud lets this aggregator's key sign the versions its
/// sub-round makes, by a key the aggregator trusts as the cloud's, for
/// long enough: its devices would refuse them otherwise.
fn check_delegation(cloud: &DeviceClient, sub_round: &SubRound) -> Result<(), Refusal> {
    let refuse = |reason: String| Refusal::Delegation(reason);
    let delegation = sub_round
        .delegation
        .as_ref()
        .ok_or_else(|| refuse("the task carries no delegation to sign them".to_string()))?;
    let (delegator, delegate) = delegation
        .verify()
        .map_err(|error| refuse(canopy_term::error_chain(&error)))?;
    let now = u64::try_from(now_ms()).unwrap_or(0);
    cloud
        .trusted_keys()
        .accepts(&delegator, now)
        .map_err(|error| refuse(format!("its delegation is not the cloud's: {error}")))?;
    if delegate != cloud.key().public_key() {
        return Err(refuse(format!(
            "its delegation is for key {}, not this aggregator's {}",
            delegation.delegate_key,
            cloud.key().public_key_hex()
        )));
    }
    if delegation.valid_until_ms < sub_round.deadline_unix_ms {
        return Err(refuse(format!(
            "its delegation ends at {} ms, before the sub-round's deadline at {} ms",
            delegation.valid_until_ms, sub_round.deadline_unix_ms
        )));
    }
    Ok(())
}

/// The local job that runs a sub-round: one round on the cloud's version
/// (or for training, `sub_round.rounds` of them, buffered when the
/// sub-round says so) with the sub-round's counts and deadline, the
/// cloud's training settings,
/// device policy and secure aggregation, no retries (the cloud round will
/// not wait for one), no server optimizer (the cloud's), and no evaluation
/// of its own; for an evaluation task, only the evaluation of the cloud's
/// version by every eligible device, up to the sub-round's target (the
/// orchestrator trains nothing in such a job). The task has passed
/// [`Task::validate`].
pub fn local_job_spec(task: &Task, sub_round: &SubRound, now_ms: i64) -> Result<JobSpec, Refusal> {
    let remaining_ms = u64::try_from(now_ms)
        .ok()
        .and_then(|now| sub_round.deadline_unix_ms.checked_sub(now))
        .filter(|&ms| ms >= 1_000)
        .ok_or(Refusal::TooLate)?;
    let mut spec = serde_json::json!({
        "name": format!("sub-round of cloud round {}", task.round_id),
        "model_version_id": 0,
        "min_devices": sub_round.min_devices,
        "target_devices": sub_round.target_devices,
        "over_selection": sub_round.over_selection,
        "round_deadline_ms": remaining_ms,
        "max_wait_for_devices_ms": remaining_ms,
        "local_epochs": task.training.epochs,
        "batch_size": task.training.batch_size,
        "learning_rate": task.training.learning_rate,
        "device_policy": task.policy,
        "dataset": task.dataset,
        "max_round_retries": 0,
        "evaluation": match task.kind {
            TaskKind::Evaluate => serde_json::json!({
                "fraction": 1.0,
                "max_devices": sub_round.target_devices,
            }),
            TaskKind::Train | TaskKind::Statistics => serde_json::json!({ "fraction": 0.0 }),
        },
        "max_samples_per_device": sub_round.max_samples_per_device,
    });
    // A training sub-round may make versions of its own first
    // (`edges.rounds`), and may buffer for its devices (FedBuff); the
    // task's validation refused both in any other.
    spec["rounds"] = serde_json::json!(sub_round.rounds);
    if let Some(buffers) = &sub_round.asynchronous {
        spec["asynchronous"] = serde_json::to_value(Asynchronous::from(buffers))
            .map_err(|error| Refusal::LocalJob(error.to_string()))?;
    }
    // Secure among the edge's devices when the cloud's job is: the edge
    // learns only their sum.
    if let Some(secure) = &sub_round.secure_aggregation {
        spec["secure_aggregation"] =
            serde_json::to_value(secure).map_err(|error| Refusal::LocalJob(error.to_string()))?;
    }
    let spec: JobSpec =
        serde_json::from_value(spec).map_err(|error| Refusal::LocalJob(error.to_string()))?;
    spec.validate().map_err(Refusal::LocalJob)?;
    Ok(spec)
}

/// The cloud's signature of the task's version when the edge already
/// holds the version with bytes that still match its digest; a blob that
/// fails its digest is fetched again.
async fn cached_signature(
    state: &AppState,
    task: &Task,
) -> Result<Option<ModelSignature>, Refusal> {
    let Some(signature) = relayed_signatures::get(&state.db, &task.model_digest).await? else {
        return Ok(None);
    };
    if models::find_by_digest(&state.db, &task.model_digest)
        .await?
        .is_none()
    {
        return Ok(None);
    }
    let limit = state.settings.limits.max_model_bytes;
    let bytes = match state.blobs.get(&task.model_digest, limit).await {
        Ok(bytes) => bytes,
        Err(error) => {
            tracing::warn!(digest = %task.model_digest, error = %canopy_term::error_chain(&error), "the cached model cannot be read; fetching it again");
            return Ok(None);
        }
    };
    if !digest_matches(&bytes, &task.model_digest) {
        tracing::warn!(digest = %task.model_digest, "the cached model fails its digest; fetching it again");
        return Ok(None);
    }
    Ok(Some(signature))
}

/// Downloads the task's version from the cloud (the SDK verifies the
/// cloud's signature and the digest) and keeps it by digest.
async fn fetch(
    cloud: &DeviceClient,
    state: &AppState,
    task: &Task,
) -> Result<ModelSignature, Refusal> {
    let model = cloud
        .download_model(task)
        .await
        .map_err(Refusal::Download)?;
    state
        .blobs
        .put(&model.digest, Bytes::clone(&model.bytes))
        .await?;
    tracing::info!(digest = %model.digest, bytes = model.bytes.len(), "kept the cloud's model");
    Ok(ModelSignature {
        key_hex: model.signer_key_hex,
        signature_hex: model.signature_hex,
        delegation: None,
    })
}

fn digest_matches(bytes: &[u8], digest_hex: &str) -> bool {
    canopy_ir::format::digest(bytes).is_ok_and(|digest| {
        canopy_ir::format::digest_hex(&digest) == digest_hex.to_ascii_lowercase()
    })
}
