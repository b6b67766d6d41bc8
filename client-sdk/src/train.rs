//! Running a task's training on local data: the shipped `train_step` graph
//! runs in the engine, and what leaves the device is the change of the
//! trainable parameters only, in the binary update format.

use std::time::Instant;

use canopy_engine::CpuBackend;
use canopy_engine::data::Dataset;
use canopy_engine::train::{Evaluator, Trainer};
use canopy_ir::{Buffer, Model};
use canopy_protocol::messages::Task;
use canopy_protocol::update::{TensorSpec, UpdateLayout, encode_update};

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
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
}

/// The result of one task's local training.
#[derive(Clone, Debug)]
pub struct LocalUpdate {
    /// The encoded update, ready to upload.
    pub encoded: Vec<u8>,
    pub num_samples: u64,
    /// Sample-weighted mean loss over the last epoch.
    pub train_loss: f64,
    pub train_duration_ms: u64,
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
/// encoded change of its trainable parameters.
pub fn train_task(
    model_bytes: &[u8],
    task: &Task,
    data: &Dataset,
    seed: u64,
) -> Result<LocalUpdate, TrainError> {
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
    let batch = (task.training.batch_size as usize).max(1);
    let lr = task.training.learning_rate as f32;
    let mut trainer = Trainer::new(&model, &CpuBackend, seed)?;
    // As in `canopy model train`: a short final batch is one noisy step, so
    // it is dropped unless it is all the data there is.
    let drop_last = data.len() >= batch;
    let mut train_loss = 0.0;
    for epoch in 0..task.training.epochs.max(1) {
        let shuffle = seed
            .wrapping_mul(0x9E37_79B9)
            .wrapping_add(u64::from(epoch));
        let (mut loss_sum, mut seen) = (0.0f64, 0usize);
        for batch in data.batches(batch, Some(shuffle), drop_last)? {
            let size = batch.len();
            let stats = trainer.step(batch.x, batch.y, lr)?;
            loss_sum += f64::from(stats.loss) * size as f64;
            seen += size;
        }
        train_loss = loss_sum / seen.max(1) as f64;
    }
    trainer.write_back(&mut model)?;
    let delta: Vec<f32> = trainable_values(&model)
        .iter()
        .zip(&before)
        .map(|(after, before)| after - before)
        .collect();
    let num_samples = data.len() as u64;
    let encoded = encode_update(&task.layout, num_samples, &delta)?;
    Ok(LocalUpdate {
        encoded,
        num_samples,
        train_loss,
        train_duration_ms: started.elapsed().as_millis() as u64,
    })
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

pub fn evaluate_model(
    model: &Model,
    data: &Dataset,
    batch: usize,
) -> Result<Evaluation, TrainError> {
    if data.is_empty() {
        return Err(TrainError::NoData);
    }
    let mut evaluator = Evaluator::new(model, &CpuBackend)?;
    let (mut loss, mut correct) = (0.0f64, 0i64);
    for batch in data.batches(batch.max(1), None, false)? {
        let (batch_loss, batch_correct) = evaluator.batch(batch.x, batch.y)?;
        loss += batch_loss;
        correct += batch_correct;
    }
    let samples = data.len() as f64;
    Ok(Evaluation {
        loss: loss / samples,
        accuracy: correct as f64 / samples,
        samples: data.len() as u64,
    })
}
