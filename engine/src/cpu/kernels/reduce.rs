//! Sum, Mean and Max over a set of axes.
//!
//! The input is viewed as [outer, reduced, inner] in row-major order, which
//! is free when the reduced axes are one contiguous run (leading, trailing
//! or middle axes of a contiguous array, e.g. a bias gradient summed over
//! the batch). Axes in several runs are reduced run by run, the last first
//! (`reduce_in_stages`), never by a transposing copy of the operand.

use canopy_ir::{DType, ReduceKind};
use ndarray::{ArrayD, IxDyn};
use rayon::prelude::*;

use super::Arg;
use super::tensor::{Number, PAR_THRESHOLD, as_slice, check_axis, from_vec, tensor};
use crate::error::KernelError;
use crate::value::Value;

/// Columns handled by one parallel task when a single row of output is
/// reduced over many rows.
const COLUMN_BLOCK: usize = 1024;

pub fn reduce(
    kind: ReduceKind,
    axes: &[usize],
    arg: Arg<'_>,
    out_shape: &[usize],
) -> Result<Value, KernelError> {
    match (arg.value().dtype(), kind) {
        (DType::F32, ReduceKind::Mean) => {
            let x = tensor::<f32>(arg, "operand")?;
            let (sum, count) = reduce_typed(ReduceKind::Sum, axes, &x.view(), out_shape)?;
            // An empty reduction divides 0 by 0: NaN, as in NumPy.
            let scale = 1.0 / count as f32;
            Ok(Value::F32(sum.mapv_into(|v| v * scale)))
        }
        (DType::F32, _) => reduce_value::<f32>(kind, axes, arg, out_shape),
        (DType::I64, ReduceKind::Sum | ReduceKind::Max) => {
            reduce_value::<i64>(kind, axes, arg, out_shape)
        }
        (DType::I32, ReduceKind::Sum | ReduceKind::Max) => {
            reduce_value::<i32>(kind, axes, arg, out_shape)
        }
        (dtype, kind) => Err(KernelError::DType {
            role: format!("operand of {kind:?}"),
            expected: if kind == ReduceKind::Mean {
                "f32"
            } else {
                "numeric"
            },
            got: dtype,
        }),
    }
}

fn reduce_value<T: Number>(
    kind: ReduceKind,
    axes: &[usize],
    arg: Arg<'_>,
    out_shape: &[usize],
) -> Result<Value, KernelError> {
    let x = tensor::<T>(arg, "operand")?;
    let (out, _) = reduce_typed(kind, axes, &x.view(), out_shape)?;
    Ok(T::into_value(out))
}

/// The reduction and the number of elements folded into each output.
fn reduce_typed<T: Number>(
    kind: ReduceKind,
    axes: &[usize],
    x: &ndarray::ArrayViewD<'_, T>,
    out_shape: &[usize],
) -> Result<(ArrayD<T>, usize), KernelError> {
    for &axis in axes {
        check_axis(axis, x.ndim())?;
    }
    if axes.windows(2).any(|w| w[0] >= w[1]) {
        return Err(KernelError::Attribute(format!(
            "axes {axes:?} must be sorted and distinct"
        )));
    }
    if let Some(split) = last_run_start(axes) {
        return reduce_in_stages(kind, axes, split, x, out_shape);
    }
    let (data, [outer, reduced, inner]) = arrange(x, axes);
    let data = as_slice(&data)?;
    let out = match kind {
        ReduceKind::Max if reduced == 0 && outer * inner > 0 => {
            return Err(KernelError::Shape(
                "cannot take the max over an empty axis".to_string(),
            ));
        }
        ReduceKind::Max => fold(data, [outer, reduced, inner], max_slice::<T>, T::maximum),
        ReduceKind::Sum | ReduceKind::Mean => {
            fold(data, [outer, reduced, inner], sum_slice::<T>, T::plus)
        }
    };
    Ok((from_vec(out_shape, out)?, reduced))
}

/// Where the last run of consecutive axes starts in `axes`, when there is
/// more than one run (a conv bias gradient sums [N, C, H, W] over N, H and
/// W: two runs).
fn last_run_start(axes: &[usize]) -> Option<usize> {
    (1..axes.len()).rev().find(|&i| axes[i] != axes[i - 1] + 1)
}

/// Reduces the last run of `axes` (a free [outer, reduced, inner] view),
/// then the rest of them in the result, instead of moving every reduced
/// axis to the end with a transposing copy of the whole operand: for the
/// conv bias gradient that copy was four fifths of the reduction.
fn reduce_in_stages<T: Number>(
    kind: ReduceKind,
    axes: &[usize],
    split: usize,
    x: &ndarray::ArrayViewD<'_, T>,
    out_shape: &[usize],
) -> Result<(ArrayD<T>, usize), KernelError> {
    let (earlier, last) = axes.split_at(split);
    let partial_shape: Vec<usize> = (0..x.ndim())
        .filter(|a| !last.contains(a))
        .map(|a| x.shape()[a])
        .collect();
    let (partial, last_count) = reduce_typed(kind, last, x, &partial_shape)?;
    // Axes before the last run keep their positions in the partial result.
    let (out, earlier_count) = reduce_typed(kind, earlier, &partial.view(), out_shape)?;
    Ok((out, last_count * earlier_count))
}

/// `x` as [outer, reduced, inner] around `axes`, one run of consecutive
/// axes or none ([`reduce_in_stages`] splits the others), with those three
/// sizes.
fn arrange<'b, T: Number>(
    x: &'b ndarray::ArrayViewD<'_, T>,
    axes: &[usize],
) -> (ndarray::CowArray<'b, T, IxDyn>, [usize; 3]) {
    debug_assert!(
        last_run_start(axes).is_none(),
        "axes {axes:?} are not one run"
    );
    let shape = x.shape();
    let product = |dims: &[usize]| dims.iter().product::<usize>();
    let sizes = match (axes.first(), axes.last()) {
        (Some(&first), Some(&last)) => [
            product(&shape[..first]),
            product(&shape[first..=last]),
            product(&shape[last + 1..]),
        ],
        _ => [x.len(), 1, 1],
    };
    (x.as_standard_layout(), sizes)
}

/// Folds the `reduced` axis of `data` viewed as [outer, reduced, inner]:
/// `whole` reduces one contiguous run, `combine` merges two partials.
fn fold<T: Number>(
    data: &[T],
    [outer, reduced, inner]: [usize; 3],
    whole: impl Fn(&[T]) -> T + Copy + Sync + Send,
    combine: impl Fn(T, T) -> T + Copy + Sync + Send,
) -> Vec<T> {
    let parallel = data.len() >= PAR_THRESHOLD;
    if parallel {
        super::hot::keep_hot();
    }
    if reduced == 0 {
        return vec![T::ZERO; outer * inner];
    }
    if inner == 1 {
        return fold_rows(data, reduced, parallel, whole, combine);
    }
    let mut out = vec![T::ZERO; outer * inner];
    if parallel && outer > 1 {
        out.par_chunks_mut(inner)
            .zip(data.par_chunks(reduced * inner))
            .for_each(|(row, block)| fold_columns(block, inner, 0, row, combine));
    } else if parallel {
        out.par_chunks_mut(COLUMN_BLOCK)
            .enumerate()
            .for_each(|(i, cols)| fold_columns(data, inner, i * COLUMN_BLOCK, cols, combine));
    } else {
        for (row, block) in out.chunks_mut(inner).zip(data.chunks(reduced * inner)) {
            fold_columns(block, inner, 0, row, combine);
        }
    }
    out
}

/// Each output is the reduction of one contiguous row of `reduced` elements.
fn fold_rows<T: Number>(
    data: &[T],
    reduced: usize,
    parallel: bool,
    whole: impl Fn(&[T]) -> T + Copy + Sync + Send,
    combine: impl Fn(T, T) -> T + Copy + Sync + Send,
) -> Vec<T> {
    let rows = data.len() / reduced;
    if parallel && rows == 1 {
        // One long row: reduce chunks in parallel, then the partials.
        let partials: Vec<T> = data.par_chunks(PAR_THRESHOLD / 4).map(whole).collect();
        return vec![partials.into_iter().reduce(combine).unwrap_or(T::ZERO)];
    }
    if parallel {
        return data.par_chunks_exact(reduced).map(whole).collect();
    }
    data.chunks_exact(reduced).map(whole).collect()
}

/// Folds rows of `block` (each `inner` long) into `out`, which holds the
/// columns starting at `first`. The first row seeds the result so that Max
/// needs no identity.
fn fold_columns<T: Number>(
    block: &[T],
    inner: usize,
    first: usize,
    out: &mut [T],
    combine: impl Fn(T, T) -> T,
) {
    let width = out.len();
    let mut rows = block
        .chunks_exact(inner)
        .map(|row| &row[first..first + width]);
    if let Some(seed) = rows.next() {
        out.copy_from_slice(seed);
    }
    for row in rows {
        out.iter_mut()
            .zip(row)
            .for_each(|(acc, &v)| *acc = combine(*acc, v));
    }
}

/// Sum with eight independent accumulators: vectorisable, and more
/// accurate than one running sum.
fn sum_slice<T: Number>(xs: &[T]) -> T {
    lanes_fold(xs, T::ZERO, T::plus)
}

fn max_slice<T: Number>(xs: &[T]) -> T {
    lanes_fold(xs, xs.first().copied().unwrap_or(T::ZERO), T::maximum)
}

fn lanes_fold<T: Number>(xs: &[T], seed: T, combine: impl Fn(T, T) -> T + Copy) -> T {
    let mut lanes = [seed; 8];
    let chunks = xs.chunks_exact(8);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (lane, &v) in lanes.iter_mut().zip(chunk) {
            *lane = combine(*lane, v);
        }
    }
    let tail = rest.iter().fold(seed, |acc, &v| combine(acc, v));
    lanes.into_iter().fold(tail, combine)
}

/// The index of the largest element along `axis`, the first on ties, a
/// NaN winning over any number (NumPy's rule); `out_shape` may keep the
/// axis with size 1, the element order is the same.
pub fn argmax(arg: Arg<'_>, axis: usize, out_shape: &[usize]) -> Result<Value, KernelError> {
    let x = tensor::<f32>(arg, "operand")?;
    let view = x.view();
    check_axis(axis, view.ndim())?;
    let lanes = view.lanes(ndarray::Axis(axis));
    let indices: Vec<i64> = lanes
        .into_iter()
        .map(|lane| {
            let mut best = 0usize;
            for (i, &v) in lane.iter().enumerate().skip(1) {
                let current = lane[best];
                if !current.is_nan() && (v.is_nan() || v > current) {
                    best = i;
                }
            }
            best as i64
        })
        .collect();
    Ok(Value::I64(
        ArrayD::from_shape_vec(IxDyn(out_shape), indices)
            .map_err(|e| KernelError::Internal(format!("argmax output {out_shape:?}: {e}")))?,
    ))
}
