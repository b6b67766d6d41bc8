//! Batched matmul on `matrixmultiply` (through `general_mat_mul`), which
//! takes arbitrary strides: transposes are strided views, never copies.

use ndarray::linalg::general_mat_mul;
use ndarray::{Array2, ArrayD, ArrayView2, ArrayViewD, ArrayViewMut2, Axis, Ix2, IxDyn};

use super::Arg;
use super::tensor::{broadcast_shapes, broadcast_to, checked_len, filled, tensor};
use crate::error::KernelError;
use crate::value::Value;

/// [..., m, k] × [..., k, n] → [..., m, n]; `transpose` swaps the last two
/// axes of the left and right operand first.
pub fn matmul(a: Arg<'_>, b: Arg<'_>, transpose: [bool; 2]) -> Result<Value, KernelError> {
    let (a, b) = (
        tensor::<f32>(a, "left operand")?,
        tensor::<f32>(b, "right operand")?,
    );
    let a = matrix_view(a.view(), transpose[0], "left")?;
    let b = matrix_view(b.view(), transpose[1], "right")?;
    let (ra, rb) = (a.ndim(), b.ndim());
    let (m, k, k2, n) = (
        a.shape()[ra - 2],
        a.shape()[ra - 1],
        b.shape()[rb - 2],
        b.shape()[rb - 1],
    );
    if k != k2 {
        return Err(KernelError::Shape(format!(
            "inner dimensions differ: {:?} × {:?} (after transposes)",
            a.shape(),
            b.shape()
        )));
    }
    if ra == 2 && rb == 2 {
        return Ok(Value::F32(matmul_2d(&as_2d(a)?, &as_2d(b)?)?.into_dyn()));
    }
    if rb == 2 && a.is_standard_layout() {
        return Ok(Value::F32(matmul_folded(&a, &as_2d(b)?)?));
    }
    let batch = broadcast_shapes(&a.shape()[..ra - 2], &b.shape()[..rb - 2])?;
    matmul_batched(&a, &b, &batch, [m, k, n]).map(Value::F32)
}

/// `view` with its last two axes swapped when `transpose` is set.
fn matrix_view<'a>(
    mut view: ArrayViewD<'a, f32>,
    transpose: bool,
    side: &str,
) -> Result<ArrayViewD<'a, f32>, KernelError> {
    let rank = view.ndim();
    if rank < 2 {
        return Err(KernelError::Rank {
            role: format!("{side} operand"),
            expected: ">= 2",
            got: view.shape().to_vec(),
        });
    }
    if transpose {
        view.swap_axes(rank - 2, rank - 1);
    }
    Ok(view)
}

fn as_2d(view: ArrayViewD<'_, f32>) -> Result<ArrayView2<'_, f32>, KernelError> {
    view.into_dimensionality::<Ix2>()
        .map_err(|e| KernelError::Internal(e.to_string()))
}

fn matmul_2d(a: &ArrayView2<'_, f32>, b: &ArrayView2<'_, f32>) -> Result<Array2<f32>, KernelError> {
    let shape = [a.nrows(), b.ncols()];
    checked_len(&shape)?;
    let mut out = Array2::zeros(shape);
    if a.ncols() > 0 {
        gemm(a, b, &mut out.view_mut());
    }
    Ok(out)
}

/// Products below this many multiply-adds run on the calling thread: for
/// them, handing half to another core costs more than it saves even with
/// that core's worker kept awake ([`super::hot`]).
const PARALLEL_MACS: usize = 1 << 20;

/// The fewest multiply-adds per element of the operand that both halves of
/// a split product pack (the right one when the rows are split, the left
/// one when the columns are). That ratio is the larger output dimension.
/// Packing costs about as much as the arithmetic in products this size
/// (perf on the MLP: 16 % of samples in `pack`, 22 % in the kernel), so a
/// split that packs much twice loses: the MLP's 64×784 · 784×128 layer
/// (ratio 128) split by columns made training 0.85× as fast, while a GRU
/// 256's 32×256 · 256×768 step (ratio 768) gains 1.26× from its split, and
/// 1024³ (ratio 1024) 1.7×.
const MIN_MACS_PER_TWICE_PACKED: usize = 256;

/// Whether an [m, k] · [k, n] product is split between two cores.
fn splits([m, k, n]: [usize; 3]) -> bool {
    let macs = m.saturating_mul(k).saturating_mul(n);
    let twice_packed = k.saturating_mul(m.min(n));
    macs >= PARALLEL_MACS
        && macs >= twice_packed.saturating_mul(MIN_MACS_PER_TWICE_PACKED)
        && m.max(n) >= 2
}

/// c = a·b. Products of at least `PARALLEL_MACS` are split once, in two,
/// along the larger output dimension (splitting further repacks the
/// operands per piece), unless that packs too much twice
/// (`MIN_MACS_PER_TWICE_PACKED`). The halves run under `rayon::join`, with
/// a worker kept awake to take the second half ([`super::hot`]); each half
/// is a single-threaded `matrixmultiply` call. One thread pool (rayon's) thus
/// serves matmul and every other kernel, instead of two pools competing for
/// the cores.
fn gemm(a: &ArrayView2<'_, f32>, b: &ArrayView2<'_, f32>, c: &mut ArrayViewMut2<'_, f32>) {
    let (m, k, n) = (a.nrows(), a.ncols(), b.ncols());
    if !splits([m, k, n]) || rayon::current_num_threads() < 2 {
        general_mat_mul(1.0, a, b, 0.0, c);
        return;
    }
    super::hot::keep_hot();
    if m >= n {
        let (a_top, a_bottom) = a.view().split_at(Axis(0), m / 2);
        let (mut c_top, mut c_bottom) = c.view_mut().split_at(Axis(0), m / 2);
        rayon::join(
            || general_mat_mul(1.0, &a_top, b, 0.0, &mut c_top),
            || general_mat_mul(1.0, &a_bottom, b, 0.0, &mut c_bottom),
        );
    } else {
        let (b_left, b_right) = b.view().split_at(Axis(1), n / 2);
        let (mut c_left, mut c_right) = c.view_mut().split_at(Axis(1), n / 2);
        rayon::join(
            || general_mat_mul(1.0, a, &b_left, 0.0, &mut c_left),
            || general_mat_mul(1.0, a, &b_right, 0.0, &mut c_right),
        );
    }
}

/// A contiguous [..., m, k] left operand times a plain matrix is one
/// [(... m), k] × [k, n] product: one large gemm instead of many small ones.
fn matmul_folded(
    a: &ArrayViewD<'_, f32>,
    b: &ArrayView2<'_, f32>,
) -> Result<ArrayD<f32>, KernelError> {
    let k = a.shape()[a.ndim() - 1];
    let mut out_shape = a.shape().to_vec();
    let last = out_shape.len() - 1;
    out_shape[last] = b.ncols();
    if k == 0 {
        // An empty inner dimension makes every output element an empty sum.
        return filled(&out_shape, 0.0);
    }
    let a2 = a
        .view()
        .into_shape_with_order((a.len() / k, k))
        .map_err(|e| KernelError::Internal(e.to_string()))?;
    let out = matmul_2d(&a2, b)?;
    out.into_shape_with_order(IxDyn(&out_shape))
        .map_err(|e| KernelError::Internal(e.to_string()))
}

/// One gemm per element of the broadcast batch dimensions.
fn matmul_batched(
    a: &ArrayViewD<'_, f32>,
    b: &ArrayViewD<'_, f32>,
    batch: &[usize],
    [m, k, n]: [usize; 3],
) -> Result<ArrayD<f32>, KernelError> {
    let a = broadcast_to(a, &[batch, &[m, k]].concat())?;
    let b = broadcast_to(b, &[batch, &[k, n]].concat())?;
    let out_shape = [batch, &[m, n]].concat();
    let mut out = filled(&out_shape, 0.0f32)?;
    let count: usize = batch.iter().product();
    if k == 0 || out.is_empty() {
        return Ok(out);
    }
    let mut out3 = out
        .view_mut()
        .into_shape_with_order((count, m, n))
        .map_err(|e| KernelError::Internal(e.to_string()))?;
    for (flat, mut c) in out3.outer_iter_mut().enumerate() {
        let index = unravel(flat, batch);
        let (a2, b2) = (as_2d(select(&a, &index))?, as_2d(select(&b, &index))?);
        gemm(&a2, &b2, &mut c);
    }
    Ok(out)
}

/// The row-major multi-index of `flat` in `shape`.
fn unravel(mut flat: usize, shape: &[usize]) -> Vec<usize> {
    let mut index = vec![0; shape.len()];
    for (slot, &dim) in index.iter_mut().zip(shape).rev() {
        *slot = flat % dim;
        flat /= dim;
    }
    index
}

/// The trailing sub-array of `view` at the leading `index`.
fn select<'a>(view: &ArrayViewD<'a, f32>, index: &[usize]) -> ArrayViewD<'a, f32> {
    let mut sub = view.clone();
    for &i in index {
        sub = sub.index_axis_move(Axis(0), i);
    }
    sub
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn products_split_only_where_the_halves_pack_little_twice() {
        assert!(splits([32, 256, 768]), "a GRU 256 step");
        assert!(splits([784, 64, 128]), "the MLP's first weight gradient");
        assert!(splits([1024, 1024, 1024]));
        assert!(
            !splits([64, 784, 128]),
            "the MLP's first layer packs its input twice"
        );
        assert!(!splits([64, 128, 10]), "below PARALLEL_MACS");
        assert!(
            !splits([1, 1 << 22, 1]),
            "one output element cannot be split"
        );
    }

    /// Both directions of the split against one single-threaded call.
    #[test]
    fn a_split_product_equals_the_whole_one() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        for [m, k, n] in [[32, 256, 768], [784, 64, 128], [257, 64, 255]] {
            let a = Array2::from_shape_fn((m, k), |(i, j)| ((i * 31 + j * 17) % 23) as f32 - 11.0);
            let b = Array2::from_shape_fn((k, n), |(i, j)| ((i * 7 + j * 13) % 19) as f32 / 9.0);
            assert!(splits([m, k, n]), "{m}x{k}x{n} must take the split path");
            let mut whole = Array2::zeros((m, n));
            general_mat_mul(1.0, &a.view(), &b.view(), 0.0, &mut whole);
            let mut split = Array2::zeros((m, n));
            pool.install(|| gemm(&a.view(), &b.view(), &mut split.view_mut()));
            let scale = whole.iter().fold(1.0f32, |s, v| s.max(v.abs()));
            let worst = (&whole - &split).iter().fold(0.0f32, |s, v| s.max(v.abs()));
            assert!(
                worst <= 1e-6 * scale,
                "{m}x{k}x{n}: off by {worst} of {scale}"
            );
        }
    }
}
