//! Running a task's training on local data: the shipped `train_step` graph
//! runs in the engine, and what leaves the device is the change of the
//! trainable parameters only, in the binary update format.

use std::fmt;
use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::Instant;

use canopy_engine::Backend;
use canopy_engine::EngineError;
use canopy_engine::data::Dataset;
use canopy_engine::train::{FitConfig, FitProgress, Trainer, fit_with_trainer};
use canopy_ir::{Buffer, Model};
use canopy_protocol::bounds::BoundsError;
use canopy_protocol::messages::Task;
use canopy_protocol::update::{TensorSpec, UpdateLayout, encode_update};

use crate::backend::BackendChoice;
use crate::cancel::CancelToken;
use crate::checkpoint::{self, Checkpoint, CheckpointSettings, Position, TaskIdentity};

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

/// How [`train_task_with`] runs.
#[derive(Clone, Default)]
pub struct TrainOptions {
    /// The backend to compile `train_step` with; the CPU by default. Pick it
    /// with [`crate::backend::choose_backend`] from the device's
    /// capabilities.
    pub backend: BackendChoice,
    /// Checked before every batch; a cancelled token stops training with
    /// [`TrainError::Cancelled`] (nothing is encoded or uploaded), after
    /// writing a checkpoint when there is one.
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
    /// numbers: the encoding is f32).
    pub delta: Vec<f32>,
    pub num_samples: u64,
    /// Sample-weighted mean loss over the last epoch.
    pub train_loss: f64,
    pub train_duration_ms: u64,
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
    let model = canopy_ir::format::read_model(model_bytes).map_err(TrainError::Model)?;
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

/// Held-out loss and accuracy of a model on local data.
#[derive(Clone, Copy, Debug)]
pub struct Evaluation {
    pub loss: f64,
    pub accuracy: f64,
    pub samples: u64,
}

fn trainable_layout(model: &Model) -> Result<UpdateLayout, TrainError> {
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

fn trainable_values(model: &Model) -> Vec<f32> {
    let mut values = Vec::with_capacity(model.trainable_elements());
    for parameter in model.parameters.iter().filter(|p| p.trainable) {
        if let Buffer::F32(data) = &parameter.data.buffer {
            values.extend_from_slice(data);
        }
    }
    values
}

/// Trains a task's model on `data` for the task's epochs and returns the
/// encoded change of its trainable parameters. Runs on the CPU and cannot
/// be cancelled; see [`train_task_cancellable`] and [`train_task_with`].
pub fn train_task(
    model_bytes: &[u8],
    task: &Task,
    data: &Dataset,
    seed: u64,
) -> Result<LocalUpdate, TrainError> {
    train_task_with(model_bytes, task, data, seed, &TrainOptions::default())
}

/// [`train_task`] that checks `cancel` between batches and returns
/// [`TrainError::Cancelled`] once it fires. A batch in progress finishes
/// first, so the delay is at most one training step.
pub fn train_task_cancellable(
    model_bytes: &[u8],
    task: &Task,
    data: &Dataset,
    seed: u64,
    cancel: &CancelToken,
) -> Result<LocalUpdate, TrainError> {
    let options = TrainOptions {
        cancel: cancel.clone(),
        ..TrainOptions::default()
    };
    train_task_with(model_bytes, task, data, seed, &options)
}

/// [`train_task`] on a chosen backend, cancellable between batches. An NPU
/// choice trains split: the step's frozen backbone in ONNX Runtime, the
/// rest on the choice's head backend ([`Placement::Split`]).
///
/// With [`TrainOptions::checkpoint`], it resumes from the checkpoint there
/// when it belongs to this training (the same task, model, seed, data and
/// settings; another is ignored and overwritten, a damaged one ignored
/// with a warning), writes one every `every_steps` steps and when
/// cancelled, and deletes it on success; the update is the one an
/// uninterrupted run gives (bit for bit on the CPU). A checkpoint that
/// cannot be written costs only the progress it would have kept: training
/// goes on, with a warning.
pub fn train_task_with(
    model_bytes: &[u8],
    task: &Task,
    data: &Dataset,
    seed: u64,
    options: &TrainOptions,
) -> Result<LocalUpdate, TrainError> {
    let head = options.backend.engine_backend();
    let npu = options.backend.npu_backend();
    let placement = match &npu {
        Some(npu) => Placement::Split {
            backbone: npu.as_ref(),
            head: head.as_ref(),
        },
        None => Placement::One(head.as_ref()),
    };
    train_on(model_bytes, task, data, seed, placement, options)
}

/// Where a training step runs.
#[derive(Clone, Copy)]
enum Placement<'a> {
    /// The whole step on one backend.
    One(&'a dyn Backend),
    /// The frozen forward part (the backbone) on `backbone`, the trainable
    /// head, its gradient and the optimizer on `head`; the whole step on
    /// `head` when the model has no frozen backbone or `backbone` cannot
    /// run it. Either way the update has the same layout and values (the
    /// split computes the same step).
    Split {
        backbone: &'a dyn Backend,
        head: &'a dyn Backend,
    },
}

impl Placement<'_> {
    /// The trainer for `model`'s `train_step` placed here.
    fn trainer(self, model: &Model, seed: u64) -> Result<Trainer, TrainError> {
        let (backbone, head) = match self {
            Placement::One(backend) => return Ok(Trainer::new(model, backend, seed)?),
            Placement::Split { backbone, head } => (backbone, head),
        };
        if !has_frozen_backbone(model) {
            tracing::info!(
                "the whole training step runs on the {} backend: the model freezes no layer \
                 (at most its input statistics), so there is no backbone for the {}",
                head.name(),
                backbone.name()
            );
            return Ok(Trainer::new(model, head, seed)?);
        }
        match Trainer::split(model, backbone, head, seed) {
            Ok(trainer) => {
                tracing::info!(
                    backbone = backbone.name(),
                    head = head.name(),
                    "training with the frozen backbone on the {} backend and the head on the {}",
                    backbone.name(),
                    head.name()
                );
                Ok(trainer)
            }
            // No frozen part to split off, or an op the backbone's
            // backend cannot take: the whole step on the head instead.
            Err(why @ (EngineError::Setting(_) | EngineError::Unsupported { .. })) => {
                tracing::info!(
                    reason = %crate::error::error_chain(&why),
                    "the whole training step runs on the {} backend, none of it on the {}",
                    head.name(),
                    backbone.name()
                );
                Ok(Trainer::new(model, head, seed)?)
            }
            Err(other) => Err(other.into()),
        }
    }
}

/// Whether `model` freezes a layer's parameters. The input statistics are
/// always frozen, but a session of their normalization alone costs a step
/// more than it saves, so they make no backbone.
fn has_frozen_backbone(model: &Model) -> bool {
    model
        .parameters
        .iter()
        .any(|p| !p.trainable && !p.name.starts_with(canopy_engine::nn::INPUT_STATS_PREFIX))
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
    let mut model = canopy_ir::format::read_model(model_bytes).map_err(TrainError::Model)?;
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
    let before = trainable_values(&model);
    let mut trainer = placement.trainer(&model, seed)?;
    let mut run = Run::new(task, model_bytes, data, seed, options);
    if run.resume(&mut trainer) == Resume::Failed {
        // The restore may have replaced part of the trainer's values.
        trainer = placement.trainer(&model, seed)?;
    }
    let train_loss = run.epochs(&mut trainer, data)?;
    trainer.write_back(&mut model)?;
    run.finish();
    let delta: Vec<f32> = trainable_values(&model)
        .iter()
        .zip(&before)
        .map(|(after, before)| after - before)
        .collect();
    let num_samples = data.len() as u64;
    let encoded = encode_update(&task.layout, num_samples, &delta)?;
    Ok(LocalUpdate {
        encoded,
        delta,
        num_samples,
        train_loss,
        train_duration_ms: started.elapsed().as_millis() as u64,
    })
}

fn check_cancelled(cancel: &CancelToken) -> Result<(), TrainError> {
    if cancel.is_cancelled() {
        return Err(TrainError::Cancelled);
    }
    Ok(())
}

/// How a checkpoint found at the start went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Resume {
    /// None found, or none usable: training starts from the first step.
    Fresh,
    Resumed,
    /// Restoring the trainer failed part way: the caller makes a new one.
    Failed,
}

/// One call's training: the task's epochs over the data (validated, so
/// bounded) in the engine's one loop ([`canopy_engine::train::fit`]),
/// checking the cancel token before every batch, reporting progress and
/// keeping the checkpoint.
struct Run<'a> {
    options: &'a TrainOptions,
    /// Only when checkpointing: hashing the data costs.
    identity: Option<TaskIdentity>,
    config: FitConfig,
    /// Epochs of the whole training (`config.epochs` counts from a resume).
    epochs: u32,
    batches_per_epoch: u64,
    resumed_from: u64,
    /// The step of the last checkpoint written or resumed from.
    saved_at: Option<u64>,
}

impl<'a> Run<'a> {
    fn new(
        task: &Task,
        model_bytes: &[u8],
        data: &Dataset,
        seed: u64,
        options: &'a TrainOptions,
    ) -> Run<'a> {
        let config = FitConfig::new(
            task.training.epochs,
            task.training.batch_size as usize,
            task.training.learning_rate as f32,
            seed,
        );
        let identity = options
            .checkpoint
            .as_ref()
            .map(|_| TaskIdentity::of(task, model_bytes, data, seed));
        Run {
            options,
            identity,
            epochs: config.epochs,
            batches_per_epoch: config.batches_per_epoch(data.len()) as u64,
            config,
            resumed_from: 0,
            saved_at: None,
        }
    }

    /// Restores `trainer` from this training's checkpoint, if there is a
    /// usable one, and starts the loop where it stands.
    fn resume(&mut self, trainer: &mut Trainer) -> Resume {
        let (Some(settings), Some(identity)) = (&self.options.checkpoint, &self.identity) else {
            return Resume::Fresh;
        };
        let path = settings.path.display();
        let found = match checkpoint::load(&settings.path) {
            Ok(Some(found)) => found,
            Ok(None) => return Resume::Fresh,
            Err(error) => {
                tracing::warn!(
                    %path,
                    reason = %crate::error::error_chain(&error),
                    "ignoring the training checkpoint; training starts from the first step"
                );
                return Resume::Fresh;
            }
        };
        if found.identity != *identity {
            tracing::info!(
                %path,
                round_id = found.identity.round_id,
                "the training checkpoint belongs to other training (another task, model, seed, \
                 data or settings); it is ignored and will be overwritten"
            );
            return Resume::Fresh;
        }
        if !found.is_consistent() {
            tracing::warn!(
                %path,
                steps = found.state.steps,
                "ignoring the training checkpoint: its position is not one this training passes \
                 through; training starts from the first step"
            );
            return Resume::Fresh;
        }
        self.restore(trainer, found)
    }

    fn restore(&mut self, trainer: &mut Trainer, found: Checkpoint) -> Resume {
        if let Err(error) = trainer.restore_state(&found.state) {
            tracing::warn!(
                reason = %crate::error::error_chain(&error),
                "ignoring the training checkpoint: the trainer does not take its state; training \
                 starts from the first step"
            );
            return Resume::Failed;
        }
        let at = found.position;
        self.config.start_epoch = at.epoch;
        self.config.start_batch = at.batch;
        self.config.start_sums = at.sums;
        self.config.epochs = self.epochs - at.epoch;
        self.resumed_from = found.state.steps;
        self.saved_at = Some(found.state.steps);
        tracing::info!(
            step = found.state.steps,
            epoch = at.epoch + 1,
            batch = at.batch,
            "resuming training from its checkpoint"
        );
        Resume::Resumed
    }

    /// Runs the loop; returns the last epoch's sample-weighted mean loss.
    fn epochs(&mut self, trainer: &mut Trainer, data: &Dataset) -> Result<f64, TrainError> {
        let config = self.config;
        let mut observe = |trainer: &mut Trainer, progress| self.observe(trainer, progress);
        let loss = match fit_with_trainer(trainer, data, &config, &mut observe) {
            Ok(epochs) => epochs.last().map_or(0.0, |e| e.loss),
            Err(EngineError::Cancelled { .. }) => return Err(TrainError::Cancelled),
            Err(other) => return Err(other.into()),
        };
        self.report(TrainProgress {
            epoch: self.epochs,
            batch: self.batches_per_epoch,
            steps_done: trainer.steps(),
            mean_loss: loss,
            ..self.progress_base()
        });
        Ok(loss)
    }

    /// Before each batch: progress, then the cancel token (writing a
    /// checkpoint before stopping), then the periodic checkpoint.
    fn observe(&mut self, trainer: &mut Trainer, progress: FitProgress) -> ControlFlow<()> {
        let FitProgress::Batch {
            epoch,
            done,
            sums,
            steps,
            ..
        } = progress
        else {
            return ControlFlow::Continue(());
        };
        self.report(TrainProgress {
            epoch,
            batch: done as u64,
            steps_done: steps,
            mean_loss: sums.mean_loss(),
            ..self.progress_base()
        });
        let position = Position {
            epoch: epoch.saturating_sub(1),
            batch: done,
            sums,
        };
        if self.options.cancel.is_cancelled() {
            self.save(trainer, position);
            return ControlFlow::Break(());
        }
        let every = self
            .options
            .checkpoint
            .as_ref()
            .map_or(0, |c| u64::from(c.every_steps));
        if every > 0 && steps > 0 && steps.is_multiple_of(every) {
            self.save(trainer, position);
        }
        ControlFlow::Continue(())
    }

    /// The fields of a progress report that do not change as it runs.
    fn progress_base(&self) -> TrainProgress {
        TrainProgress {
            epoch: 0,
            epochs: self.epochs,
            batch: 0,
            batches_per_epoch: self.batches_per_epoch,
            steps_done: 0,
            total_steps: u64::from(self.epochs).saturating_mul(self.batches_per_epoch),
            mean_loss: 0.0,
            resumed_from_step: self.resumed_from,
        }
    }

    fn report(&self, progress: TrainProgress) {
        if let Some(callback) = &self.options.progress {
            callback(progress);
        }
    }

    /// Writes the checkpoint for `position`, unless there is none to keep
    /// or it holds this step already. A failure is a warning: training
    /// goes on, only the progress since the last checkpoint is at risk.
    fn save(&mut self, trainer: &mut Trainer, position: Position) {
        let (Some(settings), Some(identity)) = (&self.options.checkpoint, &self.identity) else {
            return;
        };
        let steps = trainer.steps();
        if steps == 0 || self.saved_at == Some(steps) {
            return;
        }
        let written = trainer
            .export_state()
            .map_err(|error| crate::error::error_chain(&error))
            .and_then(|state| {
                let checkpoint = Checkpoint {
                    identity: identity.clone(),
                    position,
                    state,
                };
                checkpoint::save(&settings.path, &checkpoint)
                    .map_err(|error| crate::error::error_chain(&error))
            });
        match written {
            Ok(()) => {
                self.saved_at = Some(steps);
                tracing::debug!(path = %settings.path.display(), step = steps, "training checkpoint written");
            }
            Err(reason) => tracing::warn!(
                path = %settings.path.display(),
                step = steps,
                %reason,
                "cannot write the training checkpoint; training goes on without it"
            ),
        }
    }

    /// Training succeeded: its checkpoint has served.
    fn finish(&self) {
        let Some(settings) = &self.options.checkpoint else {
            return;
        };
        if let Err(error) = checkpoint::discard(&settings.path) {
            tracing::warn!(
                reason = %crate::error::error_chain(&error),
                "cannot delete the finished training's checkpoint"
            );
        }
    }
}

/// Evaluates a model file on local data.
pub fn evaluate(
    model_bytes: &[u8],
    data: &Dataset,
    batch: usize,
) -> Result<Evaluation, TrainError> {
    let model = canopy_ir::format::read_model(model_bytes).map_err(TrainError::Model)?;
    evaluate_model(&model, data, batch)
}

/// Evaluates a downloaded model file on `data` (an evaluation task's work).
pub fn evaluate_file(model_bytes: &[u8], data: &Dataset) -> Result<Evaluation, TrainError> {
    let model = canopy_ir::format::read_model(model_bytes).map_err(TrainError::Model)?;
    evaluate_model(&model, data, EVAL_BATCH)
}

/// Samples per forward pass when evaluating.
pub use canopy_engine::train::EVAL_BATCH;

/// The engine's evaluation ([`canopy_engine::train::evaluate`]) on the
/// backend [`BackendChoice::default`] picks, as a device reports it.
pub fn evaluate_model(
    model: &Model,
    data: &Dataset,
    batch: usize,
) -> Result<Evaluation, TrainError> {
    evaluate_model_on(model, data, batch, &BackendChoice::default())
}

/// [`evaluate_model`] on a chosen backend, the one a device trains on; for
/// an NPU choice, its head backend (the CPU or GPU).
pub fn evaluate_model_on(
    model: &Model,
    data: &Dataset,
    batch: usize,
    backend: &BackendChoice,
) -> Result<Evaluation, TrainError> {
    if data.is_empty() {
        return Err(TrainError::NoData);
    }
    // Not the NPU: the `eval` graph would go to ONNX Runtime whole, loss
    // and accuracy included, with no split to keep the ops export cannot
    // take on the CPU, so an exported-op gap would fail the evaluation
    // outright; and a device evaluates a few batches per round, where a
    // session's export and creation would cost about what it saves.
    let backend = backend.engine_backend();
    let stats = canopy_engine::train::evaluate(model, data, batch, backend.as_ref())?;
    Ok(Evaluation {
        loss: stats.loss,
        accuracy: stats.accuracy,
        samples: stats.samples as u64,
    })
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::{Duration, Instant};

    use canopy_engine::backend::ResidentRun;
    use canopy_engine::{CpuBackend, EngineError, EngineResult, Executable, Value};
    use canopy_ir::Graph;
    use canopy_protocol::bounds::MAX_EPOCHS;
    use canopy_protocol::messages::TrainingConfig;

    use super::*;

    fn setup(epochs: u32) -> (Vec<u8>, Task, Dataset) {
        setup_with(epochs, 64)
    }

    fn setup_with(epochs: u32, samples: usize) -> (Vec<u8>, Task, Dataset) {
        let logreg = canopy_engine::zoo::Architecture::LogReg {
            inputs: 8,
            classes: 3,
        };
        setup_model(logreg, &[], epochs, samples)
    }

    /// `architecture` on 8 features and 3 classes, `frozen` frozen.
    fn setup_model(
        architecture: canopy_engine::zoo::Architecture,
        frozen: &[&str],
        epochs: u32,
        samples: usize,
    ) -> (Vec<u8>, Task, Dataset) {
        setup_optimized(architecture, frozen, "sgd", epochs, samples)
    }

    /// [`setup_model`] with `optimizer` (as `Optimizer::parse` reads it).
    fn setup_optimized(
        architecture: canopy_engine::zoo::Architecture,
        frozen: &[&str],
        optimizer: &str,
        epochs: u32,
        samples: usize,
    ) -> (Vec<u8>, Task, Dataset) {
        let config = canopy_engine::zoo::ModelConfig {
            architecture,
            seed: 1,
            optimizer: canopy_engine::optim::Optimizer::parse(optimizer).expect("optimizer"),
            frozen_prefixes: frozen.iter().map(|p| p.to_string()).collect(),
            producer: "sdk train tests".to_string(),
        };
        let model = canopy_engine::zoo::build_model(&config).expect("model");
        let layout = trainable_layout(&model).expect("layout");
        let bytes = canopy_ir::format::write_model(&model).expect("bytes");
        let features = (0..samples * 8).map(|i| (i % 7) as f32 / 7.0).collect();
        let labels = (0..samples).map(|i| (i % 3) as i64).collect();
        let data = Dataset::new(features, vec![8], labels, 3).expect("dataset");
        let task = Task {
            kind: canopy_protocol::messages::TaskKind::Train,
            dataset: None,
            job_id: 1,
            round_id: 1,
            round_number: 1,
            model_version_id: 1,
            model_digest: String::new(),
            model_size_bytes: bytes.len() as u64,
            model_path: String::new(),
            upload_path: String::new(),
            upload_size_bytes: layout.encoded_len(),
            deadline_unix_ms: 0,
            training: TrainingConfig {
                epochs,
                batch_size: 1,
                learning_rate: 0.05,
            },
            layout,
            secure_aggregation: None,
            policy: Default::default(),
        };
        (bytes, task, data)
    }

    #[test]
    fn a_cancelled_token_stops_training_before_the_first_batch() {
        let (bytes, task, data) = setup(1);
        let token = CancelToken::new();
        token.cancel();
        assert!(matches!(
            train_task_cancellable(&bytes, &task, &data, 1, &token),
            Err(TrainError::Cancelled)
        ));
    }

    #[test]
    fn cancelling_from_another_thread_stops_training_between_batches() {
        // 4,096 samples, batch 1, the most epochs a task may ask for:
        // minutes of work uncancelled.
        let (bytes, task, data) = setup_with(MAX_EPOCHS, 4_096);
        let token = CancelToken::new();
        let canceller = token.clone();
        let thread = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            canceller.cancel();
        });
        let started = Instant::now();
        let outcome = train_task_cancellable(&bytes, &task, &data, 1, &token);
        assert!(matches!(outcome, Err(TrainError::Cancelled)), "{outcome:?}");
        assert!(started.elapsed() < Duration::from_secs(10));
        thread.join().expect("canceller");
    }

    #[test]
    fn a_task_outside_the_shared_bounds_is_refused_before_training() {
        let (bytes, mut task, data) = setup(MAX_EPOCHS + 1);
        let backend = Recording::default();
        let outcome = train_on(
            &bytes,
            &task,
            &data,
            1,
            Placement::One(&backend),
            &TrainOptions::default(),
        );
        let Err(TrainError::InvalidTask(bounds)) = &outcome else {
            panic!("an out-of-bounds task trained: {outcome:?}");
        };
        assert_eq!(bounds.field(), "training.epochs");
        let error = outcome.unwrap_err();
        assert!(error.to_string().contains("training.epochs"), "{error}");
        assert_eq!(
            backend.compiled.load(Ordering::SeqCst),
            0,
            "nothing compiled"
        );
        task.training = TrainingConfig {
            epochs: 1,
            batch_size: 0,
            ..task.training
        };
        let outcome = train_task(&bytes, &task, &data, 1);
        assert!(
            matches!(&outcome, Err(TrainError::InvalidTask(b)) if b.field() == "training.batch_size"),
            "{outcome:?}"
        );
    }

    /// The CPU backend, counting what it compiles and runs.
    #[derive(Default)]
    struct Recording {
        compiled: AtomicUsize,
        runs: Arc<AtomicUsize>,
    }

    struct RecordingExecutable {
        inner: Box<dyn Executable>,
        runs: Arc<AtomicUsize>,
    }

    impl Backend for Recording {
        fn name(&self) -> &'static str {
            "recording"
        }

        fn compile(&self, graph: &Graph) -> EngineResult<Box<dyn Executable>> {
            self.compiled.fetch_add(1, Ordering::SeqCst);
            Ok(Box::new(RecordingExecutable {
                inner: CpuBackend.compile(graph)?,
                runs: self.runs.clone(),
            }))
        }
    }

    impl Executable for RecordingExecutable {
        fn run(&mut self, inputs: Vec<Value>) -> EngineResult<Vec<Value>> {
            self.runs.fetch_add(1, Ordering::SeqCst);
            self.inner.run(inputs)
        }

        fn input_names(&self) -> &[String] {
            self.inner.input_names()
        }

        fn output_names(&self) -> &[String] {
            self.inner.output_names()
        }

        fn make_resident(&mut self, values: Vec<(usize, Value)>) -> EngineResult<()> {
            self.inner.make_resident(values)
        }

        fn run_resident(&mut self, inputs: Vec<Value>) -> EngineResult<ResidentRun> {
            self.runs.fetch_add(1, Ordering::SeqCst);
            self.inner.run_resident(inputs)
        }

        fn read_resident(&mut self) -> EngineResult<Vec<(usize, Value)>> {
            self.inner.read_resident()
        }

        fn snapshot_resident(&mut self) -> EngineResult<()> {
            self.inner.snapshot_resident()
        }

        fn restore_resident(&mut self) -> EngineResult<()> {
            self.inner.restore_resident()
        }
    }

    /// A backend that can run nothing, as a GPU backend refuses an op.
    struct Refusing;

    impl Backend for Refusing {
        fn name(&self) -> &'static str {
            "refusing"
        }

        fn compile(&self, _graph: &Graph) -> EngineResult<Box<dyn Executable>> {
            Err(EngineError::Unsupported {
                backend: "refusing".into(),
                what: "anything".into(),
            })
        }
    }

    /// Evaluation on the GPU gives the CPU's loss and accuracy.
    #[test]
    fn an_evaluation_on_the_gpu_equals_the_cpus() {
        if std::env::var("CANOPY_TEST_BACKENDS").as_deref() == Ok("cpu") {
            return;
        }
        let (bytes, _, data) = setup(1);
        let model = canopy_ir::format::read_model(&bytes).expect("model");
        let on_gpu = evaluate_model_on(&model, &data, 16, &BackendChoice::gpu()).expect("GPU");
        let on_cpu = evaluate_model_on(&model, &data, 16, &BackendChoice::cpu()).expect("CPU");
        assert_eq!(on_gpu.samples, on_cpu.samples);
        assert_eq!(on_gpu.accuracy, on_cpu.accuracy);
        assert!((on_gpu.loss - on_cpu.loss).abs() <= 1e-5 * on_cpu.loss.abs().max(1.0));
    }

    /// A task trained on the GPU gives the CPU's update, to 1e-4 of its
    /// largest value: the same data, seed and loop, another backend.
    #[test]
    fn an_update_trained_on_the_gpu_equals_the_cpus() {
        if std::env::var("CANOPY_TEST_BACKENDS").as_deref() == Ok("cpu") {
            return;
        }
        let (bytes, task, data) = setup(3);
        let options = TrainOptions::default();
        let gpu = BackendChoice::gpu();
        assert_eq!(gpu.kind(), crate::BackendKind::Gpu, "{gpu}");
        let on_gpu = train_on(
            &bytes,
            &task,
            &data,
            5,
            Placement::One(gpu.engine_backend().as_ref()),
            &options,
        )
        .expect("GPU training");
        let on_cpu = train_on(
            &bytes,
            &task,
            &data,
            5,
            Placement::One(&CpuBackend),
            &options,
        )
        .expect("CPU training");
        let decode = |u: &LocalUpdate| {
            canopy_protocol::update::decode_update(&u.encoded, &task.layout)
                .expect("decodes")
                .values
        };
        let (g, c) = (decode(&on_gpu), decode(&on_cpu));
        let scale = c.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        assert!(scale > 0.0, "training moved the parameters");
        for (i, (a, b)) in g.iter().zip(&c).enumerate() {
            assert!((a - b).abs() <= 1e-4 * scale, "value {i}: GPU {a}, CPU {b}");
        }
        assert!((on_gpu.train_loss - on_cpu.train_loss).abs() <= 1e-4 * on_cpu.train_loss);
    }

    /// A split placement for a model that freezes nothing but its input
    /// statistics trains the whole step on the head (the backbone backend,
    /// which refuses everything, is never asked): the update is the
    /// one-backend update, bit for bit.
    #[test]
    fn a_split_that_cannot_happen_trains_the_whole_step_on_the_head() {
        let (bytes, task, data) = setup(1);
        let options = TrainOptions::default();
        let head = Recording::default();
        let placement = Placement::Split {
            backbone: &Refusing,
            head: &head,
        };
        let split = train_on(&bytes, &task, &data, 9, placement, &options).expect("train");
        assert_eq!(head.compiled.load(Ordering::SeqCst), 1, "the whole step");
        assert_eq!(head.runs.load(Ordering::SeqCst), 64);
        let plain = train_task(&bytes, &task, &data, 9).expect("train");
        assert_eq!(split.encoded, plain.encoded);
    }

    /// A frozen backbone the backbone's backend cannot take (it refuses
    /// every graph, as ONNX Runtime an op export lacks) trains the whole
    /// step on the head, with the one-backend update.
    #[test]
    fn a_backbone_the_backend_refuses_trains_on_the_head() {
        let mlp = canopy_engine::zoo::Architecture::Mlp {
            inputs: 8,
            hidden: 6,
            classes: 3,
        };
        let (bytes, task, data) = setup_model(mlp, &["fc1"], 1, 64);
        let head = Recording::default();
        let placement = Placement::Split {
            backbone: &Refusing,
            head: &head,
        };
        let options = TrainOptions::default();
        let split = train_on(&bytes, &task, &data, 3, placement, &options).expect("train");
        assert_eq!(
            head.runs.load(Ordering::SeqCst),
            64,
            "every step on the head"
        );
        let plain = train_on(
            &bytes,
            &task,
            &data,
            3,
            Placement::One(&CpuBackend),
            &options,
        )
        .expect("train");
        assert_eq!(split.encoded, plain.encoded);
    }

    #[test]
    fn training_runs_on_the_backend_it_is_given() {
        let (bytes, task, data) = setup(2);
        let recording = Recording::default();
        let options = TrainOptions::default();
        let recorded = train_on(
            &bytes,
            &task,
            &data,
            9,
            Placement::One(&recording),
            &options,
        )
        .expect("train");
        assert_eq!(
            recording.compiled.load(Ordering::SeqCst),
            1,
            "one train_step"
        );
        // Batch 1: one step per sample and epoch, each a run of this backend.
        assert_eq!(recording.runs.load(Ordering::SeqCst), 2 * 64);
        // It wraps the CPU, so the update is the default path's, bit for bit.
        let plain = train_task(&bytes, &task, &data, 9).expect("train");
        assert_eq!(recorded.encoded, plain.encoded);
        let refused = train_on(&bytes, &task, &data, 9, Placement::One(&Refusing), &options);
        assert!(
            matches!(
                &refused,
                Err(TrainError::Engine(EngineError::Unsupported { backend, .. })) if backend == "refusing"
            ),
            "{refused:?}"
        );
    }

    /// An MLP trained with Adam in batches of 4 (16 steps an epoch), and
    /// the logistic regression with SGD in batches of 1 (64 an epoch).
    fn resumable_setups() -> Vec<(&'static str, Vec<u8>, Task, Dataset)> {
        let mlp = canopy_engine::zoo::Architecture::Mlp {
            inputs: 8,
            hidden: 6,
            classes: 3,
        };
        let (bytes, mut task, data) = setup_optimized(mlp, &[], "adam", 3, 64);
        task.training.batch_size = 4;
        let (logreg_bytes, logreg_task, logreg_data) = setup(2);
        vec![
            ("mlp, adam", bytes, task, data),
            ("logreg, sgd", logreg_bytes, logreg_task, logreg_data),
        ]
    }

    /// Options that checkpoint at `path` every `every` steps, and record
    /// every progress report; `stop_at` cancels `cancel` from the progress
    /// callback once that many steps are done.
    fn checkpointing(
        path: &std::path::Path,
        every: u32,
        stop_at: Option<u64>,
    ) -> (TrainOptions, Arc<std::sync::Mutex<Vec<TrainProgress>>>) {
        let heard = Arc::new(std::sync::Mutex::new(Vec::new()));
        let cancel = CancelToken::new();
        let (log, canceller) = (heard.clone(), cancel.clone());
        let progress: ProgressCallback = Arc::new(move |progress: TrainProgress| {
            log.lock().expect("progress log").push(progress);
            if stop_at.is_some_and(|stop| progress.steps_done >= stop) {
                canceller.cancel();
            }
        });
        let options = TrainOptions {
            cancel,
            checkpoint: Some(CheckpointSettings {
                path: path.to_path_buf(),
                every_steps: every,
            }),
            progress: Some(progress),
            ..TrainOptions::default()
        };
        (options, heard)
    }

    /// Trains with a checkpoint at `path` until `stop_at` steps are done
    /// and checks that the run was cancelled there, leaving a checkpoint.
    fn stop_at(bytes: &[u8], task: &Task, data: &Dataset, seed: u64, path: &Path, stop_at: u64) {
        let (options, _) = checkpointing(path, 10, Some(stop_at));
        let outcome = train_task_with(bytes, task, data, seed, &options);
        assert!(matches!(outcome, Err(TrainError::Cancelled)), "{outcome:?}");
        let info = checkpoint::peek(path).expect("a checkpoint after the cancel");
        assert_eq!(info.steps_done, stop_at);
        assert_eq!(info.round_id, task.round_id);
    }

    /// Trains with a checkpoint at `path` to the end; returns the update and
    /// the step the run resumed from.
    fn finish(
        bytes: &[u8],
        task: &Task,
        data: &Dataset,
        seed: u64,
        path: &Path,
    ) -> (LocalUpdate, u64) {
        let (options, heard) = checkpointing(path, 10, None);
        let update = train_task_with(bytes, task, data, seed, &options).expect("training");
        let heard = heard.lock().expect("progress log");
        let first = heard.first().expect("progress reported");
        let last = heard.last().expect("progress reported");
        assert_eq!(first.steps_done, first.resumed_from_step);
        assert_eq!(last.steps_done, last.total_steps, "{last:?}");
        assert!(!path.exists(), "the checkpoint is deleted on success");
        (update, first.resumed_from_step)
    }

    fn assert_same_update(resumed: &LocalUpdate, whole: &LocalUpdate, what: &str) {
        assert!(
            resumed.encoded == whole.encoded,
            "{what}: the encoded update differs"
        );
        let bits = |u: &LocalUpdate| u.delta.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(resumed), bits(whole), "{what}: delta");
        assert_eq!(
            resumed.train_loss.to_bits(),
            whole.train_loss.to_bits(),
            "{what}: loss"
        );
    }

    /// Cancelled from its progress callback, a run leaves a checkpoint; the
    /// next call (new options, as a new process would make) resumes from it
    /// and ends with the uninterrupted run's update, bit for bit.
    #[test]
    fn a_cancelled_run_resumes_from_its_checkpoint_to_the_uninterrupted_update() {
        let dir = tempfile::tempdir().expect("temporary directory");
        for (what, bytes, task, data) in resumable_setups() {
            let whole = train_task(&bytes, &task, &data, 5).expect("uninterrupted");
            let path = dir.path().join(format!("{what}.ckpt"));
            stop_at(&bytes, &task, &data, 5, &path, 37);
            let (resumed, from) = finish(&bytes, &task, &data, 5, &path);
            assert_eq!(from, 37, "{what}");
            assert_same_update(&resumed, &whole, what);
        }
    }

    /// A run killed without warning resumes from its last periodic
    /// checkpoint: copied aside after step 30's, put back after the run.
    #[test]
    fn a_killed_run_resumes_from_its_last_periodic_checkpoint() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let (bytes, task, data) = setup(2);
        let whole = train_task(&bytes, &task, &data, 5).expect("uninterrupted");
        let path = dir.path().join("task.ckpt");
        let aside = dir.path().join("aside.ckpt");
        let (mut options, _) = checkpointing(&path, 10, None);
        let (from, to) = (path.clone(), aside.clone());
        options.progress = Some(Arc::new(move |progress: TrainProgress| {
            if progress.steps_done == 31 {
                std::fs::copy(&from, &to).expect("copy the checkpoint");
            }
        }));
        train_task_with(&bytes, &task, &data, 5, &options).expect("training");
        assert_eq!(checkpoint::peek(&aside).map(|i| i.steps_done), Some(30));
        std::fs::rename(&aside, &path).expect("put back");
        let (resumed, from) = finish(&bytes, &task, &data, 5, &path);
        assert_eq!(from, 30);
        assert_same_update(&resumed, &whole, "killed after step 30");
    }

    /// Spoils a checkpoint file's bytes.
    type Damage = fn(&mut Vec<u8>);

    /// A checkpoint with a flipped byte or cut short is ignored: training
    /// starts from the first step and gives the right update.
    #[test]
    fn a_damaged_checkpoint_is_ignored() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let (bytes, task, data) = setup(2);
        let whole = train_task(&bytes, &task, &data, 5).expect("uninterrupted");
        let path = dir.path().join("task.ckpt");
        let damages: [(&str, Damage); 4] = [
            ("a flipped byte", |b| {
                let middle = b.len() / 2;
                b[middle] ^= 0x01;
            }),
            ("a flipped magic", |b| b[3] ^= 0x20),
            ("cut short", |b| b.truncate(b.len() - 100)),
            ("emptied", |b| b.clear()),
        ];
        for (what, damage) in damages {
            stop_at(&bytes, &task, &data, 5, &path, 21);
            let mut file = std::fs::read(&path).expect("checkpoint");
            damage(&mut file);
            std::fs::write(&path, &file).expect("damage");
            assert!(checkpoint::peek(&path).is_none(), "{what}");
            let (update, from) = finish(&bytes, &task, &data, 5, &path);
            assert_eq!(from, 0, "{what}: training starts over");
            assert_same_update(&update, &whole, what);
        }
    }

    /// A checkpoint of another seed, round or learning rate is not this
    /// training's: ignored (and overwritten).
    #[test]
    fn a_checkpoint_of_other_training_is_ignored() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let (bytes, task, data) = setup(2);
        let path = dir.path().join("task.ckpt");
        stop_at(&bytes, &task, &data, 5, &path, 21);
        let (update, from) = finish(&bytes, &task, &data, 6, &path);
        assert_eq!(from, 0, "another seed");
        let whole = train_task(&bytes, &task, &data, 6).expect("uninterrupted");
        assert_same_update(&update, &whole, "another seed");

        for change in [(|t: &mut Task| t.round_id += 1) as fn(&mut Task), |t| {
            t.training.learning_rate = 0.04
        }] {
            stop_at(&bytes, &task, &data, 5, &path, 21);
            let mut other = task.clone();
            change(&mut other);
            let (_, from) = finish(&bytes, &other, &data, 5, &path);
            assert_eq!(from, 0);
        }
        stop_at(&bytes, &task, &data, 5, &path, 21);
        let other_data = Dataset::new(
            data.features().iter().map(|v| v + 1.0).collect(),
            vec![8],
            data.labels().to_vec(),
            3,
        )
        .expect("dataset");
        let (_, from) = finish(&bytes, &task, &other_data, 5, &path);
        assert_eq!(from, 0, "other data");
    }

    /// Progress counts every step once, in order, with the totals.
    #[test]
    fn progress_is_reported_before_every_step_and_at_the_end() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let (bytes, task, data) = setup(2);
        let (options, heard) = checkpointing(&dir.path().join("task.ckpt"), 0, None);
        train_task_with(&bytes, &task, &data, 5, &options).expect("training");
        let heard = heard.lock().expect("progress log");
        let steps: Vec<u64> = heard.iter().map(|p| p.steps_done).collect();
        assert_eq!(steps, (0..=128).collect::<Vec<_>>());
        let last = heard.last().expect("the end");
        assert_eq!((last.epoch, last.epochs, last.batch), (2, 2, 64));
        assert_eq!((last.batches_per_epoch, last.total_steps), (64, 128));
        assert!(last.mean_loss > 0.0);
        assert!(format!("{options:?}").contains("checkpoint"));
    }
}
