//! Central evaluation: the server evaluates each version a job produces
//! on the held-out dataset the job names (`evaluation.central_dataset`),
//! with the engine's evaluation (`canopy_engine::train::evaluate`, the
//! one devices report with), and stores the result on the round.
//!
//! A round that succeeds is marked `pending` in the transaction that
//! records its success, and its job does not complete while one of its
//! rounds is pending. This task evaluates pending rounds one at a time,
//! oldest first, on a blocking thread; a process killed mid-evaluation
//! leaves the round pending, and the next process to run this task
//! evaluates it again. An evaluation that cannot be done (the dataset was
//! deleted, its samples do not fit, the engine refuses the model) is
//! recorded as `failed` with its reason; it does not fail the job.

use std::sync::Arc;
use std::time::Duration;

use canopy_engine::CpuBackend;
use canopy_engine::data::Dataset;
use canopy_engine::train::{EVAL_BATCH, EvalStats};
use tokio::sync::watch;

use crate::datasets::{self, Staged};
use crate::orchestrator;
use crate::state::AppState;
use crate::store::datasets::{self as dataset_store, DatasetRow};
use crate::store::evaluations::{self, CentralResult, CentralTask};
use crate::store::jobs::JobSpec;
use crate::store::{from_json, models};
use canopy_term::error_chain as chain;

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

/// Evaluates every pending round, oldest first. A database error stops
/// the pass (the round stays pending and is tried again next tick).
async fn evaluate_pending(
    state: &AppState,
    shutdown: &mut watch::Receiver<bool>,
) -> Result<(), sqlx::Error> {
    while let Some(task) = evaluations::next_central(&state.db).await? {
        let outcome = tokio::select! {
            outcome = evaluate(state, &task) => outcome?,
            // The round stays pending; the next start evaluates it.
            _ = shutdown.changed() => return Ok(()),
        };
        record(state, &task, outcome).await?;
    }
    Ok(())
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
    let dataset = match dataset_for(state, &row, &input_shape).await {
        Ok(dataset) => dataset,
        Err(reason) => return Ok(Err(format!("dataset `{name}`: {reason}"))),
    };
    let limit = state.settings.limits.max_model_bytes;
    let bytes = match state.blobs.get(&version.digest, limit).await {
        Ok(bytes) => bytes,
        Err(error) => return Ok(Err(chain(&error))),
    };
    let evaluated = tokio::task::spawn_blocking(move || evaluate_model(&bytes, &dataset)).await;
    Ok(match evaluated {
        Ok(Ok(stats)) => Ok(CentralResult {
            loss: stats.loss,
            accuracy: stats.accuracy,
            samples: stats.samples as u64,
        }),
        Ok(Err(reason)) => Err(format!("on dataset `{name}`: {reason}")),
        Err(error) => Err(format!("the evaluation task stopped: {error}")),
    })
}

/// The engine's evaluation of a model file on a dataset. Blocking.
fn evaluate_model(model_bytes: &[u8], dataset: &Dataset) -> Result<EvalStats, String> {
    let model = canopy_ir::format::read_model(model_bytes)
        .map_err(|error| format!("the model does not load: {}", chain(&error)))?;
    // The engine scores a label past the model's classes as a wrong
    // prediction, which would report a number that means nothing.
    let classes = canopy_engine::zoo::class_count(&model)
        .map_err(|error| format!("the model's classes are unknown: {}", chain(&error)))?;
    if let Some(&label) = dataset
        .labels()
        .iter()
        .find(|&&l| l as u64 >= classes as u64)
    {
        return Err(format!(
            "the dataset has label {label}, but the model predicts {classes} classes (0 to {})",
            classes.saturating_sub(1)
        ));
    }
    canopy_engine::train::evaluate(&model, dataset, EVAL_BATCH, &CpuBackend)
        .map_err(|error| format!("the engine cannot evaluate the model: {}", chain(&error)))
}

/// The dataset with samples shaped for the model: from the cache, or
/// parsed again from its blob and cached.
async fn dataset_for(
    state: &AppState,
    row: &DatasetRow,
    input_shape: &[usize],
) -> Result<Arc<Dataset>, String> {
    if let Some(dataset) = state.datasets.get(&row.digest, input_shape) {
        return Ok(dataset);
    }
    let size = u64::try_from(row.size_bytes).unwrap_or(0);
    let bytes = state
        .blobs
        .get(&row.blob_key, size)
        .await
        .map_err(|error| chain(&error))?;
    let staging = crate::api::admin::models::staging_dir(state);
    let data_bytes = usize::try_from(row.data_bytes).unwrap_or(usize::MAX);
    let (kind, shape) = (row.kind, input_shape.to_vec());
    let parsed = tokio::task::spawn_blocking(move || -> Result<Dataset, String> {
        let mut staged = Staged::new_in(&staging).map_err(|error| error.to_string())?;
        let (data, labels) = bytes.split_at(data_bytes.min(bytes.len()));
        std::fs::write(staged.data(), data).map_err(|error| error.to_string())?;
        if !labels.is_empty() {
            std::fs::write(staged.labels(), labels).map_err(|error| error.to_string())?;
            staged.has_labels = true;
        }
        let labels = staged.has_labels.then(|| staged.labels());
        let dataset = datasets::parse(kind, &staged.data(), labels.as_deref())
            .map_err(|error| error.to_string())?;
        if dataset.feature_shape() == shape.as_slice() {
            return Ok(dataset);
        }
        let from = dataset.feature_shape().to_vec();
        dataset
            .with_feature_shape(&shape)
            .map_err(|_| format!("its samples have shape {from:?}, but the model takes {shape:?}"))
    })
    .await
    .map_err(|error| format!("the parse task stopped: {error}"))??;
    let parsed = Arc::new(parsed);
    state.datasets.insert(&row.digest, parsed.clone());
    Ok(parsed)
}
