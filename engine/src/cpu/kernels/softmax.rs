//! Softmax and log-softmax along one axis, numerically stable: each lane is
//! shifted by its maximum before exponentiating, so no exp overflows.

use ndarray::{ArrayView1, Axis, Zip};
use rayon::prelude::*;

use super::Arg;
use super::tensor::{PAR_THRESHOLD, check_axis, tensor};
use crate::error::KernelError;
use crate::value::Value;

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Output {
    Probabilities,
    LogProbabilities,
}

pub fn softmax(arg: Arg<'_>, axis: usize, output: Output) -> Result<Value, KernelError> {
    let x = tensor::<f32>(arg, "input")?;
    let rank = x.shape().len();
    check_axis(axis, rank)?;
    let mut out = x.into_standard();
    let lane = out.shape()[axis];
    if lane == 0 || out.is_empty() {
        return Ok(Value::F32(out));
    }
    let parallel = out.len() >= PAR_THRESHOLD;
    if axis + 1 == rank {
        // The lanes are contiguous rows of the row-major buffer.
        let data = out
            .as_slice_mut()
            .ok_or_else(|| KernelError::Internal("expected a contiguous array".to_string()))?;
        if parallel {
            super::hot::keep_hot();
            data.par_chunks_exact_mut(lane)
                .for_each(|row| normalise(row, output));
        } else {
            data.chunks_exact_mut(lane)
                .for_each(|row| normalise(row, output));
        }
    } else {
        // Strided lanes: normalise a contiguous copy and write it back.
        let normalise_lane = |mut lane: ndarray::ArrayViewMut1<'_, f32>| {
            let mut row = lane.to_vec();
            normalise(&mut row, output);
            lane.assign(&ArrayView1::from(&row));
        };
        let zip = Zip::from(out.lanes_mut(Axis(axis)));
        if parallel {
            zip.par_for_each(normalise_lane);
        } else {
            zip.for_each(normalise_lane);
        }
    }
    Ok(Value::F32(out))
}

/// Softmax (or log-softmax) of one lane, in place.
fn normalise(row: &mut [f32], output: Output) {
    // f32::max skips NaN; a NaN in the lane still poisons the sum below.
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    match output {
        Output::Probabilities => {
            let mut sum = 0.0;
            for v in row.iter_mut() {
                *v = (*v - max).exp();
                sum += *v;
            }
            let scale = 1.0 / sum;
            row.iter_mut().for_each(|v| *v *= scale);
        }
        Output::LogProbabilities => {
            let sum: f32 = row.iter().map(|&v| (v - max).exp()).sum();
            let log_sum = sum.ln();
            row.iter_mut().for_each(|v| *v = (*v - max) - log_sum);
        }
    }
}
