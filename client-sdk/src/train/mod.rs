//! Running a task's training on local data: the shipped `train_step` graph
//! runs in the engine, and what leaves the device is the change of the
//! trainable parameters only, in the binary update format.
//!
//! One entry point a kind of task, each with one options struct whose
//! `Default` is what a device wants (the CPU, no cancel, no checkpoint):
//! [`train_task`] under [`TrainOptions`], [`evaluate`] under
//! [`EvalOptions`], and [`statistics_update`] for a statistics task. The
//! checkpointed run's lifecycle (resume, progress, periodic saves) lives
//! in `run`, and where a step's graphs run (one backend, or a frozen
//! backbone on the NPU) in `placement`.

mod evaluate;
mod placement;
mod run;
#[cfg(test)]
mod tests;

use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use canopy_engine::data::Dataset;
use canopy_ir::Model;
use canopy_protocol::bounds::BoundsError;
use canopy_protocol::messages::Task;
use canopy_protocol::update::{
    TensorSpec, UpdateLayout, clip_to_norm, encode_update, encode_update_int8,
};

pub use evaluate::{EVAL_BATCH, EvalOptions, Evaluation, evaluate};
use placement::Placement;
use run::{Resume, Run};

use crate::backend::BackendChoice;
use crate::cancel::CancelToken;
use crate::checkpoint::CheckpointSettings;

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The task asks for more than the shared bounds allow
    /// ([`canopy_protocol::bounds`]); nothing was trained.
    #[error(
        "the task's `{}` is outside the bounds devices accept; the job's settings must be fixed \
         on the server",
        .0.field()
    )]
    InvalidTask(#[source] BoundsError),
    #[error("the model file does not load")]
    Model(#[source] canopy_ir::format::FormatError),
    #[error("the model's trainable parameters do not match the task's layout: {0}")]
    Layout(String),
    #[error("the local dataset is empty, so there is nothing to train on")]
    NoData,
    #[error("training failed")]
    Engine(#[from] canopy_engine::EngineError),
    #[error("the update cannot be encoded")]
    Encode(#[from] canopy_protocol::update::UpdateError),
    #[error("training was cancelled")]
    Cancelled,
}

/// How [`train_task`] runs: where and how the update is computed, never
/// what it is (the backend changes it by float rounding at most, the rest
/// not at all). The default trains on the CPU, uncancellable, from the
/// first step, in silence.
#[derive(Clone, Default)]
pub struct TrainOptions {
    /// The backend to compile `train_step` with; the CPU by default. Pick it
    /// with [`crate::backend::choose_backend`] from the device's
    /// capabilities. An NPU choice trains split: the step's frozen
    /// backbone in ONNX Runtime, the rest on the choice's head backend.
    pub backend: BackendChoice,
    /// Checked before every batch; a cancelled token stops training with
    /// [`TrainError::Cancelled`] (nothing is encoded or uploaded), after
    /// writing a checkpoint when there is one. A batch in progress
    /// finishes first, so the delay is at most one training step.
    pub cancel: CancelToken,
    /// Where to keep this task's progress, so that training killed at any
    /// step resumes there in a later call (see [`crate::checkpoint`]).
    /// `None`: no checkpoint, every call starts from the first step.
    pub checkpoint: Option<CheckpointSettings>,
    /// Called before every step and once when training finishes, on the
    /// training thread: keep it short (update a counter, post to a UI).
    pub progress: Option<ProgressCallback>,
}

/// What [`TrainOptions::progress`] is called with.
pub type ProgressCallback = Arc<dyn Fn(TrainProgress) + Send + Sync>;

impl fmt::Debug for TrainOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TrainOptions")
            .field("backend", &self.backend)
            .field("cancel", &self.cancel)
            .field("checkpoint", &self.checkpoint)
            .field("progress", &self.progress.as_ref().map(|_| "callback"))
            .finish()
    }
}

/// Where a task's training stands, as [`TrainOptions::progress`] hears it:
/// before each step, and once at the end (`steps_done == total_steps`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TrainProgress {
    /// The epoch running, from 1.
    pub epoch: u32,
    pub epochs: u32,
    /// Batches done in this epoch.
    pub batch: u64,
    pub batches_per_epoch: u64,
    /// Steps done in all, those before a resume included.
    pub steps_done: u64,
    pub total_steps: u64,
    /// Sample-weighted mean loss of this epoch so far (0 at its start);
    /// at the end, the last epoch's.
    pub mean_loss: f64,
    /// The step the checkpoint this run resumed from holds; 0 when it
    /// started from the first.
    pub resumed_from_step: u64,
}

/// The result of one task's local training.
#[derive(Clone, Debug)]
pub struct LocalUpdate {
    /// The encoded update, ready to upload.
    pub encoded: Vec<u8>,
    /// The values `encoded` holds, in the task's layout order: for a
    /// training task the change of each trainable parameter, for a
    /// statistics task the moments. `encoded` is what a plain upload
    /// sends; a secure round masks these values (they are the same
    /// numbers: the encoding is f32). A compressed job's `encoded` holds
    /// them rounded to int8 (`Task::compression`, never in a secure round).
    pub delta: Vec<f32>,
    pub num_samples: u64,
    /// Sample-weighted mean loss over the last epoch.
    pub train_loss: f64,
    pub train_duration_ms: u64,
}

/// A model file, loaded for [`evaluate`] (training and statistics take
/// the file's bytes and load it themselves).
pub fn read_model(model_bytes: &[u8]) -> Result<Model, TrainError> {
    canopy_ir::format::read_model(model_bytes).map_err(TrainError::Model)
}

/// A statistics task ([`canopy_protocol::messages::TaskKind::Statistics`]):
/// the moments of `data`'s inputs, shaped for the model, as an update in
/// the task's layout (per feature, the mean and the mean of squares; the
/// sample count as the weight). Nothing is trained; the samples never
/// leave the device, only these sums.
pub fn statistics_update(
    model_bytes: &[u8],
    task: &Task,
    data: &Dataset,
) -> Result<LocalUpdate, TrainError> {
    let started = Instant::now();
    if data.is_empty() {
        return Err(TrainError::NoData);
    }
    let model = read_model(model_bytes)?;
    let shape = canopy_engine::zoo::sample_shape(&model)?;
    let shaped = data.clone().with_feature_shape(&shape)?;
    let moments = canopy_engine::stats::InputMoments::of(&shaped);
    let expected = canopy_protocol::update::statistics_layout(moments.features())?;
    if expected != task.layout {
        return Err(TrainError::Layout(format!(
            "a statistics task for samples of {} features has layout {:?}, the task {:?}",
            moments.features(),
            expected.tensors,
            task.layout.tensors
        )));
    }
    let count = moments.count as f64;
    let values: Vec<f32> = moments
        .sum
        .iter()
        .chain(&moments.sum_sq)
        .map(|total| (total / count) as f32)
        .collect();
    let encoded = encode_update(&task.layout, moments.count, &values)?;
    Ok(LocalUpdate {
        encoded,
        delta: values,
        num_samples: moments.count,
        train_loss: 0.0,
        train_duration_ms: started.elapsed().as_millis() as u64,
    })
}

/// The layout of `model`'s trainable parameters, in the order an update
/// holds them.
pub(crate) fn trainable_layout(model: &Model) -> Result<UpdateLayout, TrainError> {
    let tensors = model
        .parameters
        .iter()
        .filter(|p| p.trainable)
        .map(|p| TensorSpec {
            name: p.name.clone(),
            shape: p.data.shape.clone(),
        })
        .collect();
    UpdateLayout::new(tensors).map_err(|error| TrainError::Layout(error.to_string()))
}

fn trainable_values(model: &Model) -> Result<Vec<f32>, TrainError> {
    model
        .trainable_values()
        .map_err(|error| TrainError::Layout(error.to_string()))
}

/// Trains a task's model on `data` for the task's epochs, shuffled by
/// `seed`, and returns the encoded change of its trainable parameters.
/// `options` say where and how it runs ([`TrainOptions::default`]: on the
/// CPU, uncancellable, without a checkpoint); they never change the
/// update.
///
/// With [`TrainOptions::checkpoint`], it resumes from the checkpoint there
/// when it belongs to this training (the same task, model, seed, data and
/// settings; another is ignored and overwritten, a damaged one ignored
/// with a warning), writes one every `every_steps` steps and when
/// cancelled, and deletes it on success; the update is the one an
/// uninterrupted run gives (bit for bit on the CPU). A checkpoint that
/// cannot be written costs only the progress it would have kept: training
/// goes on, with a warning.
pub fn train_task(
    model_bytes: &[u8],
    task: &Task,
    data: &Dataset,
    seed: u64,
    options: &TrainOptions,
) -> Result<LocalUpdate, TrainError> {
    let head = options.backend.engine_backend();
    let npu = options.backend.npu_backend();
    let backbone = npu.as_deref().map(|npu| npu as &dyn canopy_engine::Backend);
    let placement = Placement::new(head.as_ref(), backbone);
    train_on(model_bytes, task, data, seed, placement, options)
}

/// The training loop on `placement`, which compiles and runs `train_step`
/// (`options.backend` is not read). The task is checked against the
/// shared bounds first, so that its epochs and batch size bound the loop.
fn train_on(
    model_bytes: &[u8],
    task: &Task,
    data: &Dataset,
    seed: u64,
    placement: Placement<'_>,
    options: &TrainOptions,
) -> Result<LocalUpdate, TrainError> {
    check_cancelled(&options.cancel)?;
    task.validate().map_err(TrainError::InvalidTask)?;
    if data.is_empty() {
        return Err(TrainError::NoData);
    }
    let started = Instant::now();
    let mut model = read_model(model_bytes)?;
    let layout = trainable_layout(&model)?;
    if layout != task.layout {
        return Err(TrainError::Layout(format!(
            "the model has {} trainable tensors ({} values), the task {} ({} values)",
            layout.tensors.len(),
            layout.num_elements(),
            task.layout.tensors.len(),
            task.layout.num_elements()
        )));
    }
    let before = trainable_values(&model)?;
    let mut trainer = placement.trainer(&model, seed)?;
    let mut run = Run::new(task, model_bytes, data, seed, options);
    if run.resume(&mut trainer) == Resume::Failed {
        // The restore may have replaced part of the trainer's values.
        trainer = placement.trainer(&model, seed)?;
    }
    let train_loss = run.epochs(&mut trainer, data)?;
    trainer.write_back(&mut model)?;
    run.finish();
    let mut delta: Vec<f32> = trainable_values(&model)?
        .iter()
        .zip(&before)
        .map(|(after, before)| after - before)
        .collect();
    if let Some(privacy) = &task.privacy {
        // A differentially private job bounds what one device can move
        // the sum by; the server clips again what it folds.
        clip_to_norm(&mut delta, privacy.clip_norm);
    }
    let num_samples = data.len() as u64;
    let encoded = encode_delta(task, num_samples, &delta, seed)?;
    Ok(LocalUpdate {
        encoded,
        delta,
        num_samples,
        train_loss,
        train_duration_ms: started.elapsed().as_millis() as u64,
    })
}

/// The update as the task asks for it: f32, or with a compressed job's
/// larger tensors as int8, rounded from a stream seeded by the training
/// seed (so a device's update is reproducible).
fn encode_delta(
    task: &Task,
    num_samples: u64,
    delta: &[f32],
    seed: u64,
) -> Result<Vec<u8>, canopy_protocol::update::UpdateError> {
    let Some(compression) = &task.compression else {
        return encode_update(&task.layout, num_samples, delta);
    };
    use rand::SeedableRng;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x1A78_5EED_0F1A_7800);
    let min_elements = compression.int8_min_elements;
    encode_update_int8(&task.layout, num_samples, delta, min_elements, &mut rng)
}

fn check_cancelled(cancel: &CancelToken) -> Result<(), TrainError> {
    if cancel.is_cancelled() {
        return Err(TrainError::Cancelled);
    }
    Ok(())
}
