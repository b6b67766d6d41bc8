//! Held-out loss and accuracy of a model on local data, on the backend a
//! device trains on.

use canopy_engine::data::Dataset;
use canopy_ir::Model;

use super::TrainError;
use crate::backend::BackendChoice;

/// Samples per forward pass when evaluating.
pub use canopy_engine::train::EVAL_BATCH;

/// Held-out loss and accuracy of a model on local data.
#[derive(Clone, Copy, Debug)]
pub struct Evaluation {
    pub loss: f64,
    pub accuracy: f64,
    pub samples: u64,
}

/// How [`evaluate`] runs. The default is what a device reports: the CPU,
/// in batches of [`EVAL_BATCH`].
#[derive(Clone, Debug)]
pub struct EvalOptions {
    /// The backend the device trains on; for an NPU choice, its head
    /// backend (the CPU or GPU) evaluates.
    pub backend: BackendChoice,
    /// Samples per forward pass.
    pub batch: usize,
}

impl Default for EvalOptions {
    fn default() -> EvalOptions {
        EvalOptions {
            backend: BackendChoice::default(),
            batch: EVAL_BATCH,
        }
    }
}

/// The engine's evaluation ([`canopy_engine::train::evaluate`]) of `model`
/// on `data`, as a device reports it (an evaluation task's work, or the
/// global model's held-out metrics before training). A model file loads
/// with [`super::read_model`].
pub fn evaluate(
    model: &Model,
    data: &Dataset,
    options: &EvalOptions,
) -> Result<Evaluation, TrainError> {
    if data.is_empty() {
        return Err(TrainError::NoData);
    }
    // Not the NPU: the `eval` graph would go to ONNX Runtime whole, loss
    // and accuracy included, with no split to keep the ops export cannot
    // take on the CPU, so an exported-op gap would fail the evaluation
    // outright; and a device evaluates a few batches per round, where a
    // session's export and creation would cost about what it saves.
    let backend = options.backend.engine_backend();
    let stats = super::placement::or_on_cpu(backend.as_ref(), "evaluation", |b| {
        canopy_engine::train::evaluate(model, data, options.batch, b)
    })?;
    Ok(Evaluation {
        loss: stats.loss,
        accuracy: stats.accuracy,
        samples: stats.samples as u64,
    })
}
