//! Central evaluation: the server evaluates each version a job produces
//! on the held-out dataset the job names (`evaluation.central_dataset`),
//! with the engine's evaluation (`canopy_engine::train::evaluate`, the
//! one devices report with), and stores the result on the round.
//!
//! A round that succeeds is marked `pending` in the transaction that
//! records its success, and its job does not complete while one of its
//! rounds is pending. This task evaluates pending rounds one at a time,
//! jobs taking turns (the oldest pending round of the job evaluated least
//! recently), so one job's many or slow evaluations delay another's by at
//! most one.
//!
//! Each evaluation is bounded three ways. Before it runs, the `eval`
//! graph's peak memory and operations are computed from its shapes
//! (`bounds.rs`) and refused over `limits.central_eval_memory_bytes` /
//! `limits.central_eval_flops`, the batch halved where that fits. It runs
//! in a worker process of its own (`worker.rs`, started by `sandbox.rs`)
//! under an address-space and a CPU limit and a wall-clock timeout, so an
//! abort, an allocation failure or an endless graph ends the worker, not
//! the server. And each attempt is counted in the database before its
//! worker starts, so a version that took its server down is not tried
//! more than `limits.central_eval_attempts` times.
//!
//! An evaluation that cannot be done (the dataset was deleted, its
//! samples do not fit, a bound, the worker's end) is recorded as `failed`
//! with its reason; it does not fail the job. A cancelled job's pending
//! evaluations are recorded as failed without running.

pub mod bounds;
mod sandbox;
pub mod worker;

use std::path::{Path, PathBuf};
use std::time::Duration;

use futures_util::StreamExt;
use tokio::io::AsyncWriteExt;
use tokio::sync::watch;

use crate::datasets::{DATA_PART, LABELS_PART};
use crate::db::now_ms;
use crate::orchestrator;
use crate::state::AppState;
use crate::store::datasets::{self as dataset_store, DatasetRow};
use crate::store::evaluations::{self, CentralResult, CentralTask};
use crate::store::jobs::{JobSpec, JobState};
use crate::store::{from_json, models};
use canopy_term::error_chain as chain;
use sandbox::{WorkerBounds, WorkerJob};
use worker::WorkerReport;

/// An attempt younger than the timeout plus this belongs to a process
/// still running it (staging and the static check come before the
/// worker's clock starts), so another process leaves it alone.
const LEASE_MARGIN_MS: u64 = 30_000;
/// The staged model's file name.
const MODEL_FILE: &str = "model";

/// Evaluates pending rounds until shutdown, looking for new ones every
/// orchestrator tick.
pub async fn run(state: AppState, mut shutdown: watch::Receiver<bool>) {
    let tick = Duration::from_millis(state.settings.limits.orchestrator_tick_ms.max(10));
    loop {
        if let Err(error) = evaluate_pending(&state, &mut shutdown).await {
            tracing::warn!(error = %chain(&error), "central evaluation failed; retrying");
        }
        tokio::select! {
            _ = tokio::time::sleep(tick) => {}
            _ = shutdown.changed() => {}
        }
        if *shutdown.borrow() {
            return;
        }
    }
}

/// Evaluates pending rounds, jobs in turn, until none is left. A database
/// error stops the pass (the round stays pending and is tried again next
/// tick).
async fn evaluate_pending(
    state: &AppState,
    shutdown: &mut watch::Receiver<bool>,
) -> Result<(), sqlx::Error> {
    let limits = &state.settings.limits;
    let lease_ms = limits
        .central_eval_timeout_ms
        .saturating_add(LEASE_MARGIN_MS);
    while !*shutdown.borrow() {
        let started_before = now_ms().saturating_sub(i64::try_from(lease_ms).unwrap_or(i64::MAX));
        let Some(task) = evaluations::next_central(&state.db, started_before).await? else {
            return Ok(());
        };
        if let Some(reason) = not_to_run(&task, limits.central_eval_attempts) {
            record(state, &task, Err(reason)).await?;
            continue;
        }
        if !claim(state, &task).await? {
            continue;
        }
        let outcome = tokio::select! {
            outcome = evaluate(state, &task) => outcome?,
            // Dropping the evaluation kills its worker; a shutdown is no
            // crash, so the attempt is given back and the next start
            // evaluates the round.
            _ = shutdown.changed() => {
                let _writer = state.db.write_lock().await;
                let _ = evaluations::release_central(&state.db, task.round_id).await;
                return Ok(());
            }
        };
        record(state, &task, outcome).await?;
    }
    Ok(())
}

/// Why a pending round is recorded as failed without running: its job
/// was cancelled, or its attempts are spent.
fn not_to_run(task: &CentralTask, attempts_limit: u32) -> Option<String> {
    if task.job_state == JobState::Cancelled {
        return Some(format!(
            "not evaluated: job {} was cancelled before this round's evaluation ran",
            task.job_id
        ));
    }
    (task.attempts >= i64::from(attempts_limit)).then(|| {
        format!(
            "not evaluated: its worker was started {} times (limits.central_eval_attempts = \
             {attempts_limit}) and the server stopped during each attempt; hint: look in the \
             server's log for what ended it (memory, a kill)",
            task.attempts
        )
    })
}

/// Counts the attempt, committed before anything runs; false when another
/// process took the round first.
async fn claim(state: &AppState, task: &CentralTask) -> Result<bool, sqlx::Error> {
    let _writer = state.db.write_lock().await;
    let mut tx = state.db.pool.begin().await?;
    let claimed = evaluations::claim_central(&mut tx, task.round_id, task.attempts).await?;
    tx.commit().await?;
    Ok(claimed)
}

async fn record(
    state: &AppState,
    task: &CentralTask,
    outcome: Result<CentralResult, String>,
) -> Result<(), sqlx::Error> {
    let _writer = state.db.write_lock().await;
    let mut tx = state.db.pool.begin().await?;
    match outcome {
        Ok(result) => {
            if evaluations::set_central(&mut tx, task.round_id, result).await? {
                tracing::info!(
                    job = task.job_id,
                    round = task.round_id,
                    version = task.version_id,
                    accuracy = result.accuracy,
                    loss = result.loss,
                    samples = result.samples,
                    "central evaluation stored"
                );
            }
        }
        Err(reason) => {
            if evaluations::fail_central(&mut tx, task.round_id, &reason).await? {
                tracing::warn!(
                    job = task.job_id, round = task.round_id, version = task.version_id, %reason,
                    "central evaluation failed"
                );
            }
        }
    }
    tx.commit().await
}

/// The evaluation of the task's version; `Err` is a reason to record.
async fn evaluate(
    state: &AppState,
    task: &CentralTask,
) -> Result<Result<CentralResult, String>, sqlx::Error> {
    let spec: JobSpec = from_json("jobs.config", &task.config)?;
    let Some(name) = spec.evaluation.central_dataset else {
        return Ok(Err("the job names no central dataset".to_string()));
    };
    let Some(row) = dataset_store::get(&state.db, &name).await? else {
        return Ok(Err(format!(
            "dataset `{name}` no longer exists (it was deleted after the job finished)"
        )));
    };
    let Some(version) = models::get_version(&state.db, task.version_id).await? else {
        return Ok(Err(format!("model version {} is missing", task.version_id)));
    };
    let input_shape = match orchestrator::model_input_shape(state, task.version_id).await {
        Ok(shape) => shape,
        Err(error) => return Ok(Err(chain(&error))),
    };
    let input_shape: Vec<usize> = input_shape.iter().map(|&d| d as usize).collect();
    let staged = match stage(state, &version.digest, &row).await {
        Ok(staged) => staged,
        Err(reason) => return Ok(Err(reason)),
    };
    let plan = match plan(state, &staged.model, &row).await {
        Ok(plan) => plan,
        Err(reason) => {
            return Ok(Err(format!(
                "model version {} was not evaluated on dataset `{name}`: {reason}",
                task.version_id
            )));
        }
    };
    tracing::info!(
        job = task.job_id,
        round = task.round_id,
        version = task.version_id,
        attempt = task.attempts + 1,
        batch = plan.batch,
        peak_bytes = plan.peak_bytes,
        flops = plan.flops,
        "central evaluation started"
    );
    let job = WorkerJob {
        model: &staged.model,
        data: &staged.data,
        labels: staged.labels.as_deref(),
        kind: row.kind.as_str(),
        input_shape: &input_shape,
        batch: plan.batch,
    };
    let limits = &state.settings.limits;
    let bounds = WorkerBounds {
        memory_bytes: limits.central_eval_worker_memory_bytes,
        timeout_ms: limits.central_eval_timeout_ms,
        dataset: crate::datasets::bounds(limits),
    };
    Ok(match sandbox::run(&job, bounds).await {
        Ok(WorkerReport::Done {
            loss,
            accuracy,
            samples,
        }) => Ok(CentralResult {
            loss,
            accuracy,
            samples,
        }),
        Ok(WorkerReport::Refused { reason }) => Err(format!("on dataset `{name}`: {reason}")),
        Err(failure) => Err(format!("on dataset `{name}`: {failure}")),
    })
}

/// The files a worker reads, in a staging directory removed on drop.
struct Staged {
    _dir: tempfile::TempDir,
    model: PathBuf,
    data: PathBuf,
    labels: Option<PathBuf>,
}

/// Streams the model and the dataset from the blob store to files, so the
/// server never holds either whole.
async fn stage(state: &AppState, model_digest: &str, row: &DatasetRow) -> Result<Staged, String> {
    let staging = crate::api::admin::models::staging_dir(state);
    let dir = tokio::task::spawn_blocking(move || {
        std::fs::create_dir_all(&staging)?;
        tempfile::Builder::new()
            .prefix("central-")
            .tempdir_in(&staging)
    })
    .await
    .map_err(|error| format!("the staging task stopped: {error}"))?
    .map_err(|error| format!("cannot create a staging directory: {error}"))?;
    let model = dir.path().join(MODEL_FILE);
    let data = dir.path().join(DATA_PART);
    let labels = dir.path().join(LABELS_PART);
    let model_limit = state.settings.limits.max_model_bytes;
    copy_blob(
        state,
        model_digest,
        model_limit,
        &[(model.as_path(), model_limit)],
    )
    .await?;
    let size = u64::try_from(row.size_bytes).unwrap_or(0);
    let data_bytes = u64::try_from(row.data_bytes).unwrap_or(0).min(size);
    let parts = [
        (data.as_path(), data_bytes),
        (labels.as_path(), size - data_bytes),
    ];
    copy_blob(state, &row.blob_key, size, &parts)
        .await
        .map_err(|reason| format!("dataset `{}`: {reason}", row.name))?;
    Ok(Staged {
        _dir: dir,
        model,
        data,
        labels: (size > data_bytes).then_some(labels),
    })
}

/// Writes a blob of at most `limit` bytes into files, each taking the
/// number of bytes beside it in turn (the last takes what remains).
async fn copy_blob(
    state: &AppState,
    key: &str,
    limit: u64,
    parts: &[(&Path, u64)],
) -> Result<(), String> {
    let blob = state.blobs.stream(key, 0).await.map_err(|e| chain(&e))?;
    if blob.size > limit {
        return Err(format!("its blob holds {} bytes, over {limit}", blob.size));
    }
    let mut stream = blob.stream;
    let write_error = |error: std::io::Error| format!("cannot stage it: {error}");
    let mut index = 0;
    let mut file = tokio::fs::File::create(parts[0].0)
        .await
        .map_err(write_error)?;
    let mut room = parts[0].1;
    while let Some(chunk) = stream.next().await {
        let bytes = chunk.map_err(|error| format!("cannot read its blob: {error}"))?;
        let mut chunk: &[u8] = &bytes;
        while !chunk.is_empty() {
            if room == 0 && index + 1 < parts.len() {
                file.flush().await.map_err(write_error)?;
                index += 1;
                file = tokio::fs::File::create(parts[index].0)
                    .await
                    .map_err(write_error)?;
                room = parts[index].1;
            }
            let last = index + 1 == parts.len();
            let take = if last {
                chunk.len()
            } else {
                chunk.len().min(usize::try_from(room).unwrap_or(usize::MAX))
            };
            file.write_all(&chunk[..take]).await.map_err(write_error)?;
            room = room.saturating_sub(take as u64);
            chunk = &chunk[take..];
        }
    }
    file.flush().await.map_err(write_error)
}

/// The static bounds, checked on the staged model (one model parsed at a
/// time, as uploads are verified).
async fn plan(
    state: &AppState,
    model: &Path,
    row: &DatasetRow,
) -> Result<bounds::EvalPlan, String> {
    let _permit = state
        .model_verification
        .acquire()
        .await
        .map_err(|error| error.to_string())?;
    let (path, limits) = (model.to_path_buf(), state.settings.limits.clone());
    let samples = u64::try_from(row.samples).unwrap_or(0);
    tokio::task::spawn_blocking(move || {
        let bytes = std::fs::read(&path).map_err(|error| error.to_string())?;
        let model = canopy_ir::format::read_model(&bytes)
            .map_err(|error| format!("the model does not load: {}", chain(&error)))?;
        bounds::plan(&model, samples, &limits).map_err(|error| error.to_string())
    })
    .await
    .map_err(|error| format!("the check task stopped: {error}"))?
}
