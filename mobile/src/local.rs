//! `LocalTrainer`: a model trained step by step on the device, with no
//! server: personalisation on the user's own data, or a check that a
//! model trains before it is shipped. Each `step` is one run of the
//! model's own `train_step` in the engine's `Trainer`, parameters and
//! optimizer state kept resident between steps, as in a federated task.

use std::sync::{Arc, Mutex};

use std::ops::ControlFlow;

use canopy_engine::train::{FitConfig, FitProgress, Trainer, fit};
use canopy_engine::{Backend, Value};
use canopy_ir::Model;

use crate::client::CancelToken;
use crate::error::{CanopyError, chain, guard};
use crate::progress::Pace;
use crate::types::{BackendPreference, ProgressListener, TrainingProgress};

/// The most samples one `step` takes.
pub const MAX_STEP_SAMPLES: u32 = 65_536;

/// One finished epoch of [`LocalTrainer::fit`].
#[derive(Clone, Copy, Debug, PartialEq, uniffi::Record)]
pub struct EpochResult {
    /// From 1.
    pub epoch: u32,
    /// Sample-weighted mean training loss.
    pub loss: f64,
    pub accuracy: f64,
    pub samples: u64,
}

/// What one step reported.
#[derive(Clone, Copy, Debug, PartialEq, uniffi::Record)]
pub struct StepResult {
    /// The batch's mean loss before the update.
    pub loss: f32,
    /// Samples the model classified right, before the update.
    pub correct: i64,
}

struct State {
    model: Model,
    trainer: Trainer,
}

/// A model file under training on this device.
#[derive(uniffi::Object)]
pub struct LocalTrainer {
    state: Mutex<State>,
    sample_shape: Vec<usize>,
    learning_rate: f32,
}

impl std::fmt::Debug for LocalTrainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalTrainer")
            .field("sample_shape", &self.sample_shape)
            .field("learning_rate", &self.learning_rate)
            .finish_non_exhaustive()
    }
}

fn training(error: impl std::error::Error) -> CanopyError {
    CanopyError::Training {
        message: chain(&error, None),
    }
}

#[uniffi::export]
impl LocalTrainer {
    /// Loads `model` (a `.canopy` file's bytes) and compiles its
    /// `train_step` on `backend` (`Auto` takes the best the device has).
    #[uniffi::constructor]
    pub fn new(
        model: Vec<u8>,
        learning_rate: f32,
        backend: BackendPreference,
        seed: u64,
    ) -> Result<Arc<LocalTrainer>, CanopyError> {
        guard(|| {
            canopy_protocol::bounds::check_learning_rate("learning_rate", f64::from(learning_rate))
                .map_err(|error| CanopyError::config(error.to_string()))?;
            let model = canopy_ir::format::read_model(&model).map_err(|error| {
                CanopyError::data(chain(
                    &error,
                    Some("pass the bytes of a `.canopy` model file"),
                ))
            })?;
            let sample_shape = canopy_engine::zoo::sample_shape(&model).map_err(training)?;
            let backend = crate::client::backend_choice(backend).engine_backend();
            let trainer =
                Trainer::new(&model, backend.as_ref() as &dyn Backend, seed).map_err(training)?;
            Ok(Arc::new(LocalTrainer {
                state: Mutex::new(State { model, trainer }),
                sample_shape,
                learning_rate,
            }))
        })
    }

    /// One training step on a batch: `features` holds `labels.len()`
    /// samples of the model's input shape, row major.
    pub fn step(&self, features: Vec<f32>, labels: Vec<i64>) -> Result<StepResult, CanopyError> {
        guard(|| {
            let (x, y) = self.batch(features, labels)?;
            let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
            let stats = state
                .trainer
                .step(x, y, self.learning_rate)
                .map_err(training)?;
            Ok(StepResult {
                loss: stats.loss,
                correct: stats.correct,
            })
        })
    }

    /// [`Self::step`] with the batch as little-endian bytes: the features
    /// as f32 (numpy's `astype('<f4').tobytes()`), the labels as i64
    /// (`astype('<i8').tobytes()`); a `ByteArray` each on the JVM. Both
    /// are borrowed from the caller for the call (UniFFI's zero-copy
    /// `&[u8]` arguments) and decoded once, so a batch costs one pass over
    /// its bytes instead of a conversion per value on each side.
    pub fn step_bytes(
        &self,
        features_f32le: &[u8],
        labels_i64le: &[u8],
    ) -> Result<StepResult, CanopyError> {
        guard(|| {
            self.step(
                crate::data::f32_from_le_bytes(features_f32le)?,
                crate::data::i64_from_le_bytes(labels_i64le)?,
            )
        })
    }

    /// `epochs` passes over `data` in batches of `batch_size`, reshuffled
    /// each epoch from `seed`, in the engine's one training loop (the
    /// same as a federated task's): the data crosses the boundary once.
    /// `listener` hears of the first and the last step and of steps at
    /// least `progress_interval_ms` apart (0: every step). `cancel` stops
    /// it between steps with `Cancelled`; the steps done so far are kept.
    #[uniffi::method(default(progress_interval_ms = 100))]
    #[allow(clippy::too_many_arguments)]
    pub fn fit(
        &self,
        data: crate::types::TrainingData,
        epochs: u32,
        batch_size: u32,
        seed: u64,
        listener: Option<Arc<dyn ProgressListener>>,
        cancel: Option<Arc<CancelToken>>,
        progress_interval_ms: u64,
    ) -> Result<Vec<EpochResult>, CanopyError> {
        guard(|| {
            let bounds = |error: canopy_protocol::bounds::BoundsError| {
                CanopyError::config(error.to_string())
            };
            canopy_protocol::bounds::check_epochs("epochs", u64::from(epochs)).map_err(bounds)?;
            canopy_protocol::bounds::check_batch_size("batch_size", u64::from(batch_size))
                .map_err(bounds)?;
            let data = crate::data::load(data)?;
            let config = FitConfig::new(epochs, batch_size as usize, self.learning_rate, seed);
            let total = u64::from(epochs) * config.batches_per_epoch(data.len()) as u64;
            let mut pace = Pace::new(progress_interval_ms);
            let mut observe = |progress: FitProgress| {
                if let (
                    Some(listener),
                    FitProgress::Batch {
                        epoch,
                        mean_loss,
                        steps,
                        ..
                    },
                ) = (&listener, progress)
                {
                    if pace.due(steps, total) {
                        listener.on_progress(TrainingProgress {
                            round_id: 0,
                            epoch,
                            epochs,
                            steps_done: steps,
                            total_steps: total,
                            mean_loss,
                            resumed_from_step: 0,
                        });
                    }
                }
                match &cancel {
                    Some(token) if token.is_cancelled() => ControlFlow::Break(()),
                    _ => ControlFlow::Continue(()),
                }
            };
            let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
            let epochs = match fit(&mut state.trainer, &data, &config, &mut observe) {
                Ok(epochs) => epochs,
                Err(canopy_engine::EngineError::Cancelled { epoch, step }) => {
                    return Err(CanopyError::Cancelled {
                        message: format!(
                            "local training was cancelled in epoch {epoch}, after step {step}; \
                             the steps done are kept"
                        ),
                    });
                }
                Err(other) => return Err(training(other)),
            };
            Ok(epochs
                .iter()
                .map(|e| EpochResult {
                    epoch: e.epoch,
                    loss: e.loss,
                    accuracy: e.accuracy,
                    samples: e.samples as u64,
                })
                .collect())
        })
    }

    /// The model as trained so far, as `.canopy` file bytes.
    pub fn model(&self) -> Result<Vec<u8>, CanopyError> {
        guard(|| {
            let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
            let State { model, trainer } = &mut *state;
            trainer.write_back(model).map_err(training)?;
            canopy_ir::format::write_model(model).map_err(training)
        })
    }
}

impl LocalTrainer {
    fn batch(&self, features: Vec<f32>, labels: Vec<i64>) -> Result<(Value, Value), CanopyError> {
        let samples = labels.len();
        if samples == 0 || samples > MAX_STEP_SAMPLES as usize {
            return Err(CanopyError::data(format!(
                "a step takes 1 to {MAX_STEP_SAMPLES} samples, got {samples}"
            )));
        }
        let per_sample: usize = self.sample_shape.iter().product();
        if features.len() != samples * per_sample {
            return Err(CanopyError::data(format!(
                "{samples} samples of shape {:?} need {} feature values, got {}",
                self.sample_shape,
                samples * per_sample,
                features.len()
            )));
        }
        if let Some(index) = canopy_engine::backend::first_non_finite(&features) {
            return Err(CanopyError::data(format!(
                "feature value {index} is {}; training needs finite numbers",
                features[index]
            )));
        }
        let mut shape = vec![samples];
        shape.extend(&self.sample_shape);
        let x = Value::f32(&shape, features).map_err(training)?;
        let y = Value::i64(&[samples], labels).map_err(training)?;
        Ok((x, y))
    }
}
