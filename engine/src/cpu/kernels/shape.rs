//! Layout ops: reshape, transpose, broadcast, slice, pad and concat. Every
//! result is materialised in standard (row-major) layout so that later
//! kernels hit their contiguous fast paths.

use std::ops::Range;

use ndarray::{ArrayD, ArrayViewD, Axis, IxDyn, Slice};

use super::Arg;
use super::tensor::{
    Element, Tensor, broadcast_to, check_axis, checked_len, filled, from_vec, tensor, to_standard,
};
use crate::error::KernelError;
use crate::value::Value;

/// Same elements in row-major order, new shape (from the node's type).
pub fn reshape(arg: Arg<'_>, shape: &[usize]) -> Result<Value, KernelError> {
    for_each_dtype!(arg.value().dtype(), T => {
        let x = tensor::<T>(arg, "operand")?;
        reshape_typed(x, shape).map(T::into_value)
    })
}

fn reshape_typed<T: Element>(x: Tensor<'_, T>, shape: &[usize]) -> Result<ArrayD<T>, KernelError> {
    if checked_len(shape)? != x.len() {
        return Err(KernelError::Shape(format!(
            "cannot reshape {:?} to {shape:?} (element counts differ)",
            x.shape()
        )));
    }
    x.into_standard()
        .into_shape_with_order(IxDyn(shape))
        .map_err(|e| KernelError::Internal(e.to_string()))
}

/// out.shape[i] = in.shape[perm[i]], materialised row-major.
pub fn transpose(arg: Arg<'_>, perm: &[usize]) -> Result<Value, KernelError> {
    let rank = arg.value().shape().len();
    let mut seen = vec![false; rank];
    let valid = perm.len() == rank
        && perm
            .iter()
            .all(|&p| p < rank && !std::mem::replace(&mut seen[p], true));
    if !valid {
        return Err(KernelError::Attribute(format!(
            "{perm:?} is not a permutation of 0..{rank}"
        )));
    }
    for_each_dtype!(arg.value().dtype(), T => {
        let x = tensor::<T>(arg, "operand")?;
        let view = x.view();
        let out = match swapped_matrices(&view, perm) {
            Some(out) => out?,
            None => to_standard(view.permuted_axes(IxDyn(perm))),
        };
        Ok(T::into_value(out))
    })
}

/// Side of the square tiles a matrix transpose copies at a time, so that
/// both the reads and the writes of a tile stay in cache.
const TILE: usize = 32;

/// Transposes a standard-layout `x` whose permutation only swaps the last
/// two axes (a matrix transpose, or a batch of them) tile by tile; `None`
/// for any other permutation or layout. Element-by-element strided copying
/// touches a new cache line per element there.
fn swapped_matrices<T: Element>(
    x: &ArrayViewD<'_, T>,
    perm: &[usize],
) -> Option<Result<ArrayD<T>, KernelError>> {
    let rank = perm.len();
    let swaps_last_two = rank >= 2
        && perm[..rank - 2].iter().enumerate().all(|(i, &p)| i == p)
        && perm[rank - 2..] == [rank - 1, rank - 2];
    let data = x.as_slice().filter(|_| swaps_last_two)?;
    let (rows, cols) = (x.shape()[rank - 2], x.shape()[rank - 1]);
    let mut out = vec![T::default(); data.len()];
    if rows * cols > 0 {
        for (src, dst) in data
            .chunks_exact(rows * cols)
            .zip(out.chunks_exact_mut(rows * cols))
        {
            transpose_tiled(src, dst, rows, cols);
        }
    }
    let shape: Vec<usize> = perm.iter().map(|&p| x.shape()[p]).collect();
    Some(from_vec(&shape, out))
}

/// dst[c][r] = src[r][c] for a row-major [rows, cols] `src`.
fn transpose_tiled<T: Copy>(src: &[T], dst: &mut [T], rows: usize, cols: usize) {
    for r0 in (0..rows).step_by(TILE) {
        for c0 in (0..cols).step_by(TILE) {
            for r in r0..(r0 + TILE).min(rows) {
                for c in c0..(c0 + TILE).min(cols) {
                    dst[c * rows + r] = src[r * cols + c];
                }
            }
        }
    }
}

/// NumPy broadcast_to, materialised.
pub fn broadcast(arg: Arg<'_>, shape: &[usize]) -> Result<Value, KernelError> {
    checked_len(shape)?;
    for_each_dtype!(arg.value().dtype(), T => {
        let x = tensor::<T>(arg, "operand")?;
        let view = x.view();
        Ok(T::into_value(to_standard(broadcast_to(&view, shape)?)))
    })
}

/// Elements `range` along `axis`.
pub fn slice(arg: Arg<'_>, axis: usize, range: Range<usize>) -> Result<Value, KernelError> {
    let shape = arg.value().shape();
    check_axis(axis, shape.len())?;
    let len = shape[axis];
    if range.start > range.end || range.end > len {
        return Err(KernelError::Attribute(format!(
            "range {}..{} is out of bounds for axis {axis} of length {len}",
            range.start, range.end
        )));
    }
    for_each_dtype!(arg.value().dtype(), T => {
        let x = tensor::<T>(arg, "operand")?;
        let part = x.view().slice_axis_move(Axis(axis), Slice::from(range));
        Ok(T::into_value(to_standard(part)))
    })
}

/// Zero padding (false for bool) of `before` and `after` along `axis`.
pub fn pad(arg: Arg<'_>, axis: usize, [before, after]: [usize; 2]) -> Result<Value, KernelError> {
    let mut shape = arg.value().shape().to_vec();
    check_axis(axis, shape.len())?;
    let len = shape[axis];
    shape[axis] = len
        .checked_add(before)
        .and_then(|n| n.checked_add(after))
        .ok_or_else(|| {
            KernelError::Attribute(format!("padding {before} + {after} overflows axis {axis}"))
        })?;
    for_each_dtype!(arg.value().dtype(), T => {
        let x = tensor::<T>(arg, "operand")?;
        let mut out = filled(&shape, T::default())?;
        out.slice_axis_mut(Axis(axis), Slice::from(before..before + len)).assign(&x.view());
        Ok(T::into_value(out))
    })
}

/// Joins the operands (at least one, all of one dtype) along `axis`.
pub fn concat(args: Vec<Arg<'_>>, axis: usize) -> Result<Value, KernelError> {
    let Some(first) = args.first() else {
        return Err(KernelError::Operands {
            expected: 1,
            got: 0,
        });
    };
    check_axis(axis, first.value().shape().len())?;
    for_each_dtype!(first.value().dtype(), T => {
        let parts = args
            .into_iter()
            .enumerate()
            .map(|(i, arg)| tensor::<T>(arg, &format!("operand {i}")))
            .collect::<Result<Vec<_>, _>>()?;
        concat_typed(&parts, axis).map(T::into_value)
    })
}

fn concat_typed<T: Element>(
    parts: &[Tensor<'_, T>],
    axis: usize,
) -> Result<ArrayD<T>, KernelError> {
    let views: Vec<ArrayViewD<'_, T>> = parts.iter().map(Tensor::view).collect();
    let joined = ndarray::concatenate(Axis(axis), &views)
        .map_err(|e| KernelError::Shape(format!("cannot concatenate: {e}")))?;
    Ok(if joined.is_standard_layout() {
        joined
    } else {
        to_standard(joined.view())
    })
}
