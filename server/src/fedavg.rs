//! Federated averaging, as a running sum.
//!
//! The round keeps `Σ nᵢ·Δᵢ` (f64) and `Σ nᵢ`, where `Δᵢ` is device i's
//! change to the trainable parameters and `nᵢ` its sample count. Each
//! update is folded in as it arrives, so memory is one model-sized vector
//! whatever the number of devices; the new model is
//! `θ + Σ nᵢ·Δᵢ / Σ nᵢ`. The sum is f64 so that thousands of f32 updates
//! add up without the rounding drift of an f32 accumulator.

use canopy_ir::data::{Buffer, TensorData};
use canopy_ir::model::Model;
use canopy_protocol::update::{TensorSpec, UpdateLayout};

#[derive(Debug, thiserror::Error)]
pub enum FedAvgError {
    #[error("trainable parameter `{name}` is {dtype:?}; federated training needs f32 parameters")]
    NotF32 {
        name: String,
        dtype: canopy_ir::types::DType,
    },
    #[error("model has no trainable parameters, so devices would have nothing to send")]
    NothingTrainable,
    #[error("model has no `train_step` entry point, so devices cannot train it")]
    NoTrainStep,
    #[error("the model's trainable layout does not match the round's: {reason}")]
    LayoutMismatch { reason: String },
    #[error("no update was accepted, so there is nothing to average")]
    NoWeight,
    #[error("the averaged value of `{name}` at {index} is not finite")]
    NonFinite { name: String, index: usize },
    #[error(transparent)]
    Layout(#[from] canopy_protocol::update::UpdateError),
}

/// The trainable parameters, in the order devices send them.
pub fn layout_of(model: &Model) -> Result<UpdateLayout, FedAvgError> {
    let mut tensors = Vec::new();
    for parameter in model.parameters.iter().filter(|p| p.trainable) {
        if !matches!(parameter.data.buffer, Buffer::F32(_)) {
            return Err(FedAvgError::NotF32 {
                name: parameter.name.clone(),
                dtype: parameter.data.buffer.dtype(),
            });
        }
        tensors.push(TensorSpec {
            name: parameter.name.clone(),
            shape: parameter.data.shape.clone(),
        });
    }
    Ok(UpdateLayout::new(tensors)?)
}

/// Checks that devices can train the model: a `train_step`, at least one
/// trainable parameter, all f32.
pub fn check_trainable(model: &Model) -> Result<UpdateLayout, FedAvgError> {
    if !model
        .entry_points
        .contains_key(canopy_ir::model::ENTRY_TRAIN_STEP)
    {
        return Err(FedAvgError::NoTrainStep);
    }
    let layout = layout_of(model)?;
    if layout.tensors.is_empty() {
        return Err(FedAvgError::NothingTrainable);
    }
    Ok(layout)
}

/// Adds `weight · update` to the sum: an update weighs its samples (in an
/// asynchronous job, times its staleness weight).
pub fn fold_weighted(sum: &mut [f64], weight: f64, update: &[f32]) {
    debug_assert_eq!(sum.len(), update.len());
    for (total, value) in sum.iter_mut().zip(update) {
        *total += weight * f64::from(*value);
    }
}

pub fn encode_sum(sum: &[f64]) -> Vec<u8> {
    sum.iter().flat_map(|v| v.to_le_bytes()).collect()
}

pub fn decode_sum(bytes: &[u8]) -> Vec<f64> {
    bytes
        .chunks_exact(8)
        .map(|chunk| {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            f64::from_le_bytes(word)
        })
        .collect()
}

/// The weighted mean update `Σ nᵢΔᵢ / Σ nᵢ`, checked against the model's
/// layout: what a strategy steps on.
pub fn mean_update(
    layout: &UpdateLayout,
    sum: &[f64],
    weight_total: u64,
) -> Result<Vec<f64>, FedAvgError> {
    if weight_total == 0 {
        return Err(FedAvgError::NoWeight);
    }
    if sum.len() != layout.num_elements() {
        return Err(FedAvgError::LayoutMismatch {
            reason: format!(
                "the sum has {} values, the layout {}",
                sum.len(),
                layout.num_elements()
            ),
        });
    }
    let weight_total = weight_total as f64;
    Ok(sum.iter().map(|s| s / weight_total).collect())
}

/// An edge's sub-round result for the cloud, as an ordinary encoded
/// update whose `num_samples` is `weight`, so that the cloud's fold
/// multiplies it back: for one round, the mean update `Σ nᵢΔᵢ / Σ nᵢ`
/// with `weight = Σ nᵢ`, and the cloud's sum is the sum over every end
/// device (ARCHITECTURE.md, "The edge tier").
pub fn encode_result(
    layout: &UpdateLayout,
    values: &[f64],
    weight: u64,
) -> Result<Vec<u8>, FedAvgError> {
    let mut narrowed = Vec::with_capacity(values.len());
    for (index, value) in values.iter().enumerate() {
        let value = *value as f32;
        if !value.is_finite() {
            let (name, index) = locate(layout, index);
            return Err(FedAvgError::NonFinite { name, index });
        }
        narrowed.push(value);
    }
    Ok(canopy_protocol::update::encode_update(
        layout, weight, &narrowed,
    )?)
}

/// The tensor holding the `index`th value of the layout, and the value's
/// index within it.
fn locate(layout: &UpdateLayout, mut index: usize) -> (String, usize) {
    for tensor in &layout.tensors {
        let len = tensor.num_elements();
        if index < len {
            return (tensor.name.clone(), index);
        }
        index -= len;
    }
    (String::new(), index)
}

/// `last − first` over the trainable parameters, in layout order: the
/// step an edge's own versions took from the cloud's.
pub fn difference(
    first: &Model,
    last: &Model,
    layout: &UpdateLayout,
) -> Result<Vec<f64>, FedAvgError> {
    for model in [first, last] {
        if &layout_of(model)? != layout {
            return Err(FedAvgError::LayoutMismatch {
                reason: "an edge's version does not have the cloud's layout".to_string(),
            });
        }
    }
    let values = |model: &Model| {
        model
            .trainable_values()
            .map_err(|error| FedAvgError::LayoutMismatch {
                reason: error.to_string(),
            })
    };
    let (from, to) = (values(first)?, values(last)?);
    Ok(from
        .iter()
        .zip(&to)
        .map(|(a, b)| f64::from(*b) - f64::from(*a))
        .collect())
}

/// Adds `step` to the model's trainable parameters, in layout order.
pub fn apply_step(
    model: &mut Model,
    layout: &UpdateLayout,
    step: &[f64],
) -> Result<(), FedAvgError> {
    let actual = layout_of(model)?;
    if &actual != layout {
        return Err(FedAvgError::LayoutMismatch {
            reason: "the base model changed since the round began".to_string(),
        });
    }
    if step.len() != layout.num_elements() {
        return Err(FedAvgError::LayoutMismatch {
            reason: format!(
                "the step has {} values, the layout {}",
                step.len(),
                layout.num_elements()
            ),
        });
    }
    let mut offset = 0;
    for parameter in model.parameters.iter_mut().filter(|p| p.trainable) {
        let TensorData {
            buffer: Buffer::F32(values),
            ..
        } = &mut parameter.data
        else {
            unreachable!("layout_of accepted only f32 parameters");
        };
        let deltas = &step[offset..offset + values.len()];
        for (index, (value, delta)) in values.iter_mut().zip(deltas).enumerate() {
            let updated = (f64::from(*value) + delta) as f32;
            if !updated.is_finite() {
                return Err(FedAvgError::NonFinite {
                    name: parameter.name.clone(),
                    index,
                });
            }
            *value = updated;
        }
        offset += values.len();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sum_round_trips_bit_exact() {
        let sum = vec![1.5, -0.0, f64::MIN_POSITIVE, 1e300];
        let decoded = decode_sum(&encode_sum(&sum));
        assert_eq!(
            decoded.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            sum.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
    }

    #[test]
    fn fold_weights_by_samples() {
        let mut sum = vec![0.0; 2];
        fold_weighted(&mut sum, 3.0, &[1.0, 2.0]);
        fold_weighted(&mut sum, 1.0, &[-1.0, 0.5]);
        assert_eq!(sum, vec![2.0, 6.5]);
    }
}
