//! What a device does with its own data for a task: the held-out split it
//! never trains on, the dataset shaped for the task's model, the training
//! seed, and a training task's evaluate-then-train. The edge agent and
//! `canopy simulate` (crate `canopy-sim`) both run these, so a simulated
//! device computes the update an agent would, bit for bit on the CPU.

use std::borrow::Cow;

use canopy_engine::data::Dataset;
use canopy_ir::Model;
use canopy_protocol::messages::{RoundMetrics, Task};

use crate::train::{EvalOptions, Evaluation, LocalUpdate, TrainError, TrainOptions};

/// Share of every dataset held out for evaluation, never trained on.
pub const HOLDOUT_FRACTION: f64 = 0.1;
/// Seed of that stratified split, fixed so the held-out samples are the
/// same in every run, task and command.
pub const HOLDOUT_SEED: u64 = 0x00ca_9097_a9e7;

/// Why a device cannot use its data for a task.
#[derive(Debug, thiserror::Error)]
pub enum LocalDataError {
    #[error("cannot split off the held-out evaluation set")]
    Split(#[source] Box<canopy_engine::EngineError>),
    #[error("cannot read the model's input shape or classes")]
    ModelShape(#[source] Box<canopy_engine::EngineError>),
    #[error("the dataset has label {label}, but model `{model}` has {classes} classes")]
    Label {
        label: i64,
        model: String,
        classes: usize,
    },
    #[error("the dataset's samples have shape {from:?}, but model `{model}` expects {to:?}")]
    Shape {
        from: Vec<usize>,
        to: Vec<usize>,
        model: String,
        #[source]
        source: Box<canopy_engine::EngineError>,
    },
    #[error("local dataset `{name}` does not fit the task's model")]
    DoesNotFit {
        name: String,
        #[source]
        source: Box<LocalDataError>,
    },
    #[error("local dataset `{name}` has no held-out samples to evaluate on")]
    NoHeldOut { name: String },
    #[error("cannot make next-character samples of the text")]
    Text(#[source] Box<canopy_engine::EngineError>),
    #[error("the downloaded model does not load")]
    Model(#[source] Box<TrainError>),
    #[error("evaluating the round's model on the held-out data failed")]
    Evaluate(#[source] Box<TrainError>),
    #[error("local training failed")]
    Train(#[source] Box<TrainError>),
}

/// Splits off the held-out evaluation set: `(train, holdout)`, stratified
/// by class, the same every time for the same data.
pub fn holdout(data: &Dataset) -> Result<(Dataset, Dataset), LocalDataError> {
    data.split(HOLDOUT_FRACTION, HOLDOUT_SEED)
        .map_err(|e| LocalDataError::Split(Box::new(e)))
}

/// The seed of a task's shuffles: deterministic per device and round,
/// different across both, so a resumed run continues the same shuffles.
pub fn training_seed(device_id: i64, round_id: i64) -> u64 {
    (device_id as u64)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .rotate_left(17)
        ^ (round_id as u64)
}

/// `data` shaped for `model`'s input (e.g. IDX `[1, 28, 28]` images as
/// the MLP's `[784]`), after checking every label is one of the model's
/// classes. Borrows when the shape already fits.
pub fn fit_to_model<'a>(
    data: &'a Dataset,
    model: &Model,
) -> Result<Cow<'a, Dataset>, LocalDataError> {
    let shape = canopy_engine::zoo::sample_shape(model)
        .map_err(|e| LocalDataError::ModelShape(Box::new(e)))?;
    let classes = canopy_engine::zoo::class_count(model)
        .map_err(|e| LocalDataError::ModelShape(Box::new(e)))?;
    if let Some(&label) = data
        .labels()
        .iter()
        .find(|&&l| l < 0 || l as u64 >= classes as u64)
    {
        return Err(LocalDataError::Label {
            label,
            model: model.metadata.model_name.clone(),
            classes,
        });
    }
    if data.feature_shape() == shape.as_slice() {
        return Ok(Cow::Borrowed(data));
    }
    let from = data.feature_shape().to_vec();
    let shaped =
        data.clone()
            .with_feature_shape(&shape)
            .map_err(|source| LocalDataError::Shape {
                from,
                to: shape.clone(),
                model: model.metadata.model_name.clone(),
                source: Box::new(source),
            })?;
    Ok(Cow::Owned(shaped))
}

/// One dataset of a device, split once: trained on, and held out.
#[derive(Clone, Debug)]
pub struct LocalData {
    pub name: String,
    pub train: Dataset,
    pub holdout: Dataset,
}

impl LocalData {
    /// `data` under `name`, with its held-out share split off by [`holdout`].
    pub fn split(name: &str, data: &Dataset) -> Result<LocalData, LocalDataError> {
        let (train, holdout) = holdout(data)?;
        Ok(LocalData {
            name: name.to_string(),
            train,
            holdout,
        })
    }

    /// A device's own text as next-character samples of `sequence_len`
    /// characters, under `name`: trained on all but the last fifth of its
    /// lines and held out on the rest, in order (the Shakespeare task's
    /// split, [`canopy_engine::data::train_lines`]). A random split of
    /// overlapping windows would test on characters trained on.
    pub fn text(
        name: &str,
        lines: &[String],
        sequence_len: usize,
    ) -> Result<LocalData, LocalDataError> {
        use canopy_engine::data::{Part, next_character_samples, part_text};
        let samples = |part| {
            next_character_samples(
                std::path::Path::new(name),
                &part_text(lines, part),
                sequence_len,
            )
            .map_err(|e| LocalDataError::Text(Box::new(e)))
        };
        Ok(LocalData {
            name: name.to_string(),
            train: samples(Part::Train)?,
            holdout: samples(Part::Test)?,
        })
    }

    fn fitted<'a>(
        &self,
        data: &'a Dataset,
        model: &Model,
    ) -> Result<Cow<'a, Dataset>, LocalDataError> {
        fit_to_model(data, model).map_err(|source| LocalDataError::DoesNotFit {
            name: self.name.clone(),
            source: Box::new(source),
        })
    }
}

/// An evaluation task's work: the model evaluated on the held-out split,
/// the samples the training tasks' metrics use; an error when there are
/// none or they do not fit the model.
pub fn evaluate_held_out(
    model_bytes: &[u8],
    data: &LocalData,
    options: &EvalOptions,
) -> Result<Evaluation, LocalDataError> {
    let model =
        crate::train::read_model(model_bytes).map_err(|e| LocalDataError::Model(Box::new(e)))?;
    held_out_evaluation(&model, data, options)?.ok_or_else(|| LocalDataError::NoHeldOut {
        name: data.name.clone(),
    })
}

/// A training task's work: the downloaded global model evaluated on the
/// held-out split (none when the split is empty), then trained on the
/// training split, both on `options.backend` and shaped for the model.
pub fn train_and_evaluate(
    model_bytes: &[u8],
    task: &Task,
    data: &LocalData,
    seed: u64,
    options: &TrainOptions,
) -> Result<(Option<Evaluation>, LocalUpdate), LocalDataError> {
    let model =
        crate::train::read_model(model_bytes).map_err(|e| LocalDataError::Model(Box::new(e)))?;
    let train = data.fitted(&data.train, &model)?;
    let on_training_backend = EvalOptions {
        backend: options.backend.clone(),
        ..EvalOptions::default()
    };
    let evaluation = held_out_evaluation(&model, data, &on_training_backend)?;
    drop(model);
    let update = crate::train::train_task(model_bytes, task, &train, seed, options)
        .map_err(|e| LocalDataError::Train(Box::new(e)))?;
    Ok((evaluation, update))
}

/// `model` on `data`'s held-out split, shaped for it; `None` when the split
/// is empty.
fn held_out_evaluation(
    model: &Model,
    data: &LocalData,
    options: &EvalOptions,
) -> Result<Option<Evaluation>, LocalDataError> {
    let held_out = data.fitted(&data.holdout, model)?;
    if held_out.is_empty() {
        return Ok(None);
    }
    crate::train::evaluate(model, &held_out, options)
        .map(Some)
        .map_err(|e| LocalDataError::Evaluate(Box::new(e)))
}

/// The metrics a device reports after a training task: the loss and
/// evaluation where they are numbers a server accepts.
pub fn round_metrics(
    task: &Task,
    evaluation: Option<Evaluation>,
    update: &LocalUpdate,
) -> RoundMetrics {
    RoundMetrics {
        round_id: task.round_id,
        train_loss: Some(update.train_loss).filter(|l| l.is_finite() && *l >= 0.0),
        eval_loss: evaluation
            .map(|e| e.loss)
            .filter(|l| l.is_finite() && *l >= 0.0),
        eval_accuracy: evaluation.map(|e| e.accuracy),
        eval_samples: evaluation.map(|e| e.samples),
        train_duration_ms: Some(update.train_duration_ms),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeds_differ_by_device_and_round() {
        assert_ne!(training_seed(1, 1), training_seed(2, 1));
        assert_ne!(training_seed(1, 1), training_seed(1, 2));
        assert_eq!(training_seed(3, 4), training_seed(3, 4));
    }

    /// A text's held-out samples are windows of its last lines only.
    #[test]
    fn a_text_holds_out_its_last_fifth_in_order() {
        let lines: Vec<String> = (0..10).map(|i| format!("line {i} of ten")).collect();
        let local = LocalData::text("role", &lines, 4).unwrap();
        let decode = |data: &Dataset, i: usize| -> String {
            let (features, label) = data.sample(i).unwrap();
            let chars: Vec<char> = canopy_engine::data::CHARACTERS.chars().collect();
            let mut text: String = features.iter().map(|&f| chars[f as usize - 1]).collect();
            text.push(chars[label as usize - 1]);
            text
        };
        assert_eq!(decode(&local.holdout, 0), "line ");
        assert!((0..local.holdout.len()).all(|i| !decode(&local.holdout, i).contains("7")));
        assert_eq!(
            local.holdout.len(),
            "line 8 of ten\nline 9 of ten\n".len() - 4
        );
        let last_train = decode(&local.train, local.train.len() - 1);
        assert_eq!(last_train, " ten\n");
    }

    #[test]
    fn the_holdout_is_deterministic_and_a_tenth() {
        let n = 200;
        let features: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let labels: Vec<i64> = (0..n).map(|i| (i % 4) as i64).collect();
        let data = Dataset::new(features, vec![1], labels, 4).unwrap();
        let (train, test) = holdout(&data).unwrap();
        assert_eq!(test.len(), 20);
        assert_eq!(train.len(), 180);
        let (_, again) = holdout(&data).unwrap();
        assert_eq!(test, again);
    }
}
