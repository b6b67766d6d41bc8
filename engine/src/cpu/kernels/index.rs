//! Index ops: gather, its adjoint scatter_add, and one_hot.
//!
//! Gather and scatter view data as [outer, axis, inner] row-major blocks, so
//! each index moves one contiguous run of `inner` elements.

use ndarray::ArrayD;

use super::Arg;
use super::tensor::{Element, as_slice, check_axis, checked_len, from_vec, standard, tensor};
use crate::error::KernelError;
use crate::value::Value;

/// Index tensor contents in row-major order, widened to i64, with its shape.
fn index_values(arg: &Arg<'_>) -> Result<(Vec<i64>, Vec<usize>), KernelError> {
    match arg.value() {
        Value::I64(a) => Ok((a.iter().copied().collect(), a.shape().to_vec())),
        Value::I32(a) => Ok((
            a.iter().map(|&i| i64::from(i)).collect(),
            a.shape().to_vec(),
        )),
        other => Err(KernelError::DType {
            role: "indices".to_string(),
            expected: "i64 or i32",
            got: other.dtype(),
        }),
    }
}

/// The indices as positions along an axis of `len`; any outside `0..len`
/// is an error.
fn positions(indices: &[i64], axis: usize, len: usize) -> Result<Vec<usize>, KernelError> {
    indices
        .iter()
        .map(|&i| {
            usize::try_from(i)
                .ok()
                .filter(|&p| p < len)
                .ok_or(KernelError::IndexOutOfRange {
                    index: i,
                    axis,
                    len,
                })
        })
        .collect()
}

/// out.shape = data.shape[..axis] ++ indices.shape ++ data.shape[axis+1..].
pub fn gather(data: Arg<'_>, indices: Arg<'_>, axis: usize) -> Result<Value, KernelError> {
    let (indices, index_shape) = index_values(&indices)?;
    let shape = data.value().shape().to_vec();
    check_axis(axis, shape.len())?;
    let positions = positions(&indices, axis, shape[axis])?;
    let out_shape = [&shape[..axis], &index_shape, &shape[axis + 1..]].concat();
    checked_len(&out_shape)?;
    for_each_dtype!(data.value().dtype(), T => {
        let x = tensor::<T>(data, "data")?;
        let view = x.view();
        let contiguous = standard(&view);
        let out = gather_rows(as_slice(&contiguous)?, &shape, axis, &positions);
        from_vec(&out_shape, out).map(T::into_value)
    })
}

fn gather_rows<T: Element>(
    data: &[T],
    shape: &[usize],
    axis: usize,
    positions: &[usize],
) -> Vec<T> {
    let len = shape[axis];
    let inner: usize = shape[axis + 1..].iter().product();
    let outer: usize = shape[..axis].iter().product();
    let mut out = Vec::with_capacity(outer * positions.len() * inner);
    for o in 0..outer {
        for &p in positions {
            let start = (o * len + p) * inner;
            out.extend_from_slice(&data[start..start + inner]);
        }
    }
    out
}

/// Zeros of shape updates.shape[..axis] ++ [dim_size] ++
/// updates.shape[axis + indices.rank..], with each update added at its index.
pub fn scatter_add(
    indices: Arg<'_>,
    updates: Arg<'_>,
    axis: usize,
    dim_size: usize,
) -> Result<Value, KernelError> {
    let (indices, index_shape) = index_values(&indices)?;
    let positions = positions(&indices, axis, dim_size)?;
    let updates = tensor::<f32>(updates, "updates")?;
    let shape = updates.shape().to_vec();
    let index_end = axis + index_shape.len();
    if shape.len() < index_end || shape[axis..index_end] != index_shape[..] {
        return Err(KernelError::Shape(format!(
            "updates {shape:?} do not fit indices {index_shape:?} at axis {axis}"
        )));
    }
    let out_shape = [&shape[..axis], &[dim_size], &shape[index_end..]].concat();
    let blocks = Blocks {
        outer: shape[..axis].iter().product(),
        inner: shape[index_end..].iter().product(),
        dim_size,
    };
    let mut out = vec![0.0f32; checked_len(&out_shape)?];
    let view = updates.view();
    let contiguous = standard(&view);
    scatter_rows(as_slice(&contiguous)?, &positions, blocks, &mut out);
    from_vec(&out_shape, out).map(Value::F32)
}

/// The [outer, dim_size, inner] geometry of a scatter output.
#[derive(Clone, Copy)]
struct Blocks {
    outer: usize,
    inner: usize,
    dim_size: usize,
}

fn scatter_rows(updates: &[f32], positions: &[usize], blocks: Blocks, out: &mut [f32]) {
    let Blocks {
        outer,
        inner,
        dim_size,
    } = blocks;
    let count = positions.len();
    for o in 0..outer {
        for (j, &p) in positions.iter().enumerate() {
            let src = &updates[(o * count + j) * inner..][..inner];
            let dst = &mut out[(o * dim_size + p) * inner..][..inner];
            dst.iter_mut().zip(src).for_each(|(d, &s)| *d += s);
        }
    }
}

/// f32 [..., depth] with a 1 at each index; out-of-range rows stay zero.
pub fn one_hot(indices: Arg<'_>, depth: usize) -> Result<Value, KernelError> {
    let (indices, index_shape) = index_values(&indices)?;
    let out_shape = [&index_shape[..], &[depth]].concat();
    let mut out = vec![0.0f32; checked_len(&out_shape)?];
    for (row, &i) in indices.iter().enumerate() {
        if let Some(p) = usize::try_from(i).ok().filter(|&p| p < depth) {
            out[row * depth + p] = 1.0;
        }
    }
    let array: ArrayD<f32> = from_vec(&out_shape, out)?;
    Ok(Value::F32(array))
}
