//! One call's training as a run: the task's epochs in the engine's loop,
//! resumed from this training's checkpoint when there is one, reporting
//! progress and keeping the checkpoint as it goes, and discarding it once
//! training succeeds.

use std::ops::ControlFlow;

use canopy_engine::EngineError;
use canopy_engine::data::Dataset;
use canopy_engine::train::{FitConfig, FitProgress, Trainer, fit_with_trainer};
use canopy_protocol::messages::Task;

use super::{TrainError, TrainOptions, TrainProgress};
use crate::checkpoint::{self, Checkpoint, Position, TaskIdentity};

/// How a checkpoint found at the start went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Resume {
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
pub(super) struct Run<'a> {
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
    pub(super) fn new(
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
    pub(super) fn resume(&mut self, trainer: &mut Trainer) -> Resume {
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
    pub(super) fn epochs(
        &mut self,
        trainer: &mut Trainer,
        data: &Dataset,
    ) -> Result<f64, TrainError> {
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
    pub(super) fn finish(&self) {
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
