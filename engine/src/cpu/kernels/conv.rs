//! 2-D convolution (NCHW input, OIHW filter) and its two gradients, by
//! im2col + gemm: each image's receptive fields are unrolled into a
//! [C·KH·KW, OH·OW] patch matrix, so the convolution is one matmul with the
//! [O, C·KH·KW] filter matrix. Images are independent, so batches are split
//! across rayon's threads when the work is large enough to pay for it.

use std::ops::Range;

use canopy_ir::Conv2dAttrs;
use canopy_ir::op::window_output_size;
use ndarray::linalg::general_mat_mul;
use ndarray::{Array2, ArrayView2, ArrayViewMut2, IxDyn};
use rayon::prelude::*;

use super::Arg;
use super::tensor::{Tensor, as_slice, checked_len, from_vec, standard, tensor};
use crate::error::KernelError;
use crate::value::Value;

/// Multiply-adds from which a convolution is split across threads.
const PAR_WORK: usize = 1 << 20;

/// The geometry of one convolution.
#[derive(Clone, Copy, Debug)]
struct Geometry {
    attrs: Conv2dAttrs,
    channels: usize,
    in_hw: [usize; 2],
    filters: usize,
    kernel: [usize; 2],
    out_hw: [usize; 2],
}

impl Geometry {
    fn new(
        attrs: &Conv2dAttrs,
        [channels, filters]: [usize; 2],
        in_hw: [usize; 2],
        kernel: [usize; 2],
    ) -> Result<Geometry, KernelError> {
        let mut out_hw = [0; 2];
        for i in 0..2 {
            out_hw[i] = window_output_size(
                in_hw[i],
                kernel[i],
                attrs.stride[i],
                attrs.padding[i],
                attrs.dilation[i],
            )
            .filter(|&o| o > 0 && attrs.dilation[i] > 0)
            .ok_or_else(|| {
                KernelError::Attribute(format!(
                    "kernel {kernel:?} with {attrs:?} does not fit input {in_hw:?}"
                ))
            })?;
        }
        let g = Geometry {
            attrs: *attrs,
            channels,
            in_hw,
            filters,
            kernel,
            out_hw,
        };
        checked_len(&[g.patch(), g.out_plane()])?;
        Ok(g)
    }

    /// Rows of the patch matrix: C·KH·KW.
    fn patch(&self) -> usize {
        self.channels * self.kernel[0] * self.kernel[1]
    }

    fn out_plane(&self) -> usize {
        self.out_hw[0] * self.out_hw[1]
    }

    fn in_plane(&self) -> usize {
        self.in_hw[0] * self.in_hw[1]
    }

    fn in_image(&self) -> usize {
        self.channels * self.in_plane()
    }

    fn out_image(&self) -> usize {
        self.filters * self.out_plane()
    }

    /// Multiply-adds per image, to decide whether to parallelise.
    fn work(&self, images: usize) -> usize {
        images
            .saturating_mul(self.out_image())
            .saturating_mul(self.patch())
    }

    /// A 1×1 kernel with unit stride and no padding reads each image as its
    /// own patch matrix, so im2col can be skipped.
    fn is_pointwise(&self) -> bool {
        self.kernel == [1, 1] && self.attrs.stride == [1, 1] && self.attrs.padding == [0, 0]
    }

    /// The outputs along axis `i` whose input, at kernel tap `k`, lies
    /// inside the image; and the input offset of output 0 at that tap.
    fn valid_outputs(&self, i: usize, k: usize) -> (Range<usize>, isize) {
        let stride = self.attrs.stride[i] as isize;
        let offset = (k * self.attrs.dilation[i]) as isize - self.attrs.padding[i] as isize;
        let (len, out) = (self.in_hw[i] as isize, self.out_hw[i] as isize);
        let ceil_div = |a: isize| (a + stride - 1).div_euclid(stride);
        let lo = ceil_div(-offset).clamp(0, out);
        let hi = ceil_div(len - offset).clamp(lo, out);
        (lo as usize..hi as usize, offset)
    }

    /// Calls `f(row, oh, input_row_start, output_cols, first_input_col)` for
    /// every (channel, tap, output row `oh`) whose input row lies in the
    /// image: `row` is the patch-matrix row, and output columns
    /// `output_cols` read input columns first_input_col, +stride, ... of the
    /// input row starting at flat index `input_row_start`.
    fn for_each_segment(&self, mut f: impl FnMut(usize, usize, usize, Range<usize>, usize)) {
        let [kh, kw] = self.kernel;
        let (width, stride_w) = (self.in_hw[1], self.attrs.stride[1]);
        for c in 0..self.channels {
            for ki in 0..kh {
                let (rows, row_offset) = self.valid_outputs(0, ki);
                for kj in 0..kw {
                    let row = (c * kh + ki) * kw + kj;
                    let (cols, col_offset) = self.valid_outputs(1, kj);
                    if cols.is_empty() {
                        continue;
                    }
                    let first_col = (cols.start * stride_w) as isize + col_offset;
                    for oh in rows.clone() {
                        let ih = (oh * self.attrs.stride[0]) as isize + row_offset;
                        let start = c * self.in_plane() + ih as usize * width;
                        f(row, oh, start, cols.clone(), first_col as usize);
                    }
                }
            }
        }
    }

    /// Unrolls one image into the [patch, out_plane] matrix `cols`.
    fn im2col(&self, image: &[f32], cols: &mut [f32]) {
        cols.fill(0.0);
        let (out_w, plane, stride) = (self.out_hw[1], self.out_plane(), self.attrs.stride[1]);
        self.for_each_segment(|row, oh, start, range, first| {
            let dst = &mut cols[row * plane + oh * out_w..][range];
            if stride == 1 {
                dst.copy_from_slice(&image[start + first..][..dst.len()]);
            } else {
                let src = image[start + first..].iter().step_by(stride);
                dst.iter_mut().zip(src).for_each(|(d, &s)| *d = s);
            }
        });
    }

    /// The adjoint of `im2col`: adds each patch-matrix entry back onto the
    /// input element it was read from.
    fn col2im(&self, cols: &[f32], image: &mut [f32]) {
        let (out_w, plane, stride) = (self.out_hw[1], self.out_plane(), self.attrs.stride[1]);
        self.for_each_segment(|row, oh, start, range, first| {
            let src = &cols[row * plane + oh * out_w..][range];
            if stride == 1 {
                let dst = &mut image[start + first..][..src.len()];
                dst.iter_mut().zip(src).for_each(|(d, &s)| *d += s);
            } else {
                let dst = image[start + first..].iter_mut().step_by(stride);
                dst.zip(src).for_each(|(d, &s)| *d += s);
            }
        });
    }

    /// The patch matrix of `image`, unrolled into `scratch` unless the
    /// kernel is pointwise.
    fn patches<'a>(
        &self,
        image: &'a [f32],
        scratch: &'a mut Vec<f32>,
    ) -> Result<ArrayView2<'a, f32>, KernelError> {
        let shape = (self.patch(), self.out_plane());
        if self.is_pointwise() {
            return matrix(shape, image);
        }
        scratch.resize(shape.0 * shape.1, 0.0);
        self.im2col(image, scratch);
        matrix(shape, scratch)
    }
}

fn matrix(shape: (usize, usize), data: &[f32]) -> Result<ArrayView2<'_, f32>, KernelError> {
    ArrayView2::from_shape(shape, data).map_err(|e| KernelError::Internal(e.to_string()))
}

fn matrix_mut(
    shape: (usize, usize),
    data: &mut [f32],
) -> Result<ArrayViewMut2<'_, f32>, KernelError> {
    ArrayViewMut2::from_shape(shape, data).map_err(|e| KernelError::Internal(e.to_string()))
}

/// An NCHW (or OIHW) f32 operand and its four dimensions.
fn rank4<'a>(arg: Arg<'a>, role: &str) -> Result<(Tensor<'a, f32>, [usize; 4]), KernelError> {
    let x = tensor::<f32>(arg, role)?;
    match *x.shape() {
        [a, b, c, d] => Ok((x, [a, b, c, d])),
        ref other => Err(KernelError::Rank {
            role: role.to_string(),
            expected: "4",
            got: other.to_vec(),
        }),
    }
}

/// Runs `f(image, out_chunk, scratch)` for each of `images` equal chunks of
/// `out`, in parallel when `work` is large; each thread owns a scratch
/// buffer for its patch matrices.
fn per_image<F>(out: &mut [f32], images: usize, work: usize, f: F) -> Result<(), KernelError>
where
    F: Fn(usize, &mut [f32], &mut Vec<f32>) -> Result<(), KernelError> + Sync + Send,
{
    if out.is_empty() || images == 0 {
        return Ok(());
    }
    let size = out.len() / images;
    if work >= PAR_WORK && images > 1 {
        super::hot::keep_hot();
        out.par_chunks_mut(size)
            .enumerate()
            .try_for_each_init(Vec::new, |scratch, (n, chunk)| f(n, chunk, scratch))
    } else {
        let mut scratch = Vec::new();
        out.chunks_mut(size)
            .enumerate()
            .try_for_each(|(n, chunk)| f(n, chunk, &mut scratch))
    }
}

/// conv2d(x: [N, C, H, W], w: [O, C, KH, KW]) → [N, O, OH, OW].
pub fn conv2d(x: Arg<'_>, w: Arg<'_>, attrs: &Conv2dAttrs) -> Result<Value, KernelError> {
    let (x, [n, c, h, width]) = rank4(x, "input")?;
    let (w, [o, wc, kh, kw]) = rank4(w, "filter")?;
    if wc != c {
        return Err(KernelError::Shape(format!(
            "input has {c} channels but the filter expects {wc}"
        )));
    }
    let g = Geometry::new(attrs, [c, o], [h, width], [kh, kw])?;
    let (xv, wv) = (x.view(), w.view());
    let (xd, wd) = (standard(&xv), standard(&wv));
    let (xs, filter) = (as_slice(&xd)?, matrix((o, g.patch()), as_slice(&wd)?)?);
    let shape = [n, o, g.out_hw[0], g.out_hw[1]];
    let mut out = vec![0.0f32; checked_len(&shape)?];
    per_image(&mut out, n, g.work(n), |i, y, scratch| {
        let cols = g.patches(&xs[i * g.in_image()..][..g.in_image()], scratch)?;
        let mut y = matrix_mut((o, g.out_plane()), y)?;
        general_mat_mul(1.0, &filter, &cols, 0.0, &mut y);
        Ok(())
    })?;
    from_vec(&shape, out).map(Value::F32)
}

/// (dy: [N, O, OH, OW], w: [O, C, KH, KW]) → dx: [N, C, H, W], with
/// (H, W) = `input_hw`: col2im(wᵀ · dy) per image.
pub fn conv2d_backward_input(
    dy: Arg<'_>,
    w: Arg<'_>,
    attrs: &Conv2dAttrs,
    input_hw: [usize; 2],
) -> Result<Value, KernelError> {
    let (dy, [n, o, oh, ow]) = rank4(dy, "gradient")?;
    let (w, [wo, c, kh, kw]) = rank4(w, "filter")?;
    let g = Geometry::new(attrs, [c, wo], input_hw, [kh, kw])?;
    if o != wo || [oh, ow] != g.out_hw {
        return Err(KernelError::Shape(format!(
            "gradient {:?} does not match the output of filter {:?} on input {input_hw:?}",
            dy.shape(),
            w.shape()
        )));
    }
    let (dv, wv) = (dy.view(), w.view());
    let (dd, wd) = (standard(&dv), standard(&wv));
    let (ds, filter) = (as_slice(&dd)?, matrix((o, g.patch()), as_slice(&wd)?)?);
    let shape = [n, c, input_hw[0], input_hw[1]];
    let mut out = vec![0.0f32; checked_len(&shape)?];
    per_image(&mut out, n, g.work(n), |i, dx, scratch| {
        let dy_i = matrix(
            (o, g.out_plane()),
            &ds[i * g.out_image()..][..g.out_image()],
        )?;
        if g.is_pointwise() {
            let mut dx = matrix_mut((g.patch(), g.out_plane()), dx)?;
            general_mat_mul(1.0, &filter.t(), &dy_i, 0.0, &mut dx);
            return Ok(());
        }
        scratch.resize(g.patch() * g.out_plane(), 0.0);
        let mut cols = matrix_mut((g.patch(), g.out_plane()), scratch)?;
        general_mat_mul(1.0, &filter.t(), &dy_i, 0.0, &mut cols);
        g.col2im(scratch, dx);
        Ok(())
    })?;
    from_vec(&shape, out).map(Value::F32)
}

/// (x: [N, C, H, W], dy: [N, O, OH, OW]) → dw: [O, C, KH, KW], with
/// (KH, KW) = `kernel_hw`: the sum over images of dy · patchesᵀ.
pub fn conv2d_backward_filter(
    x: Arg<'_>,
    dy: Arg<'_>,
    attrs: &Conv2dAttrs,
    kernel_hw: [usize; 2],
) -> Result<Value, KernelError> {
    let (x, [n, c, h, w]) = rank4(x, "input")?;
    let (dy, [dn, o, oh, ow]) = rank4(dy, "gradient")?;
    let g = Geometry::new(attrs, [c, o], [h, w], kernel_hw)?;
    if dn != n || [oh, ow] != g.out_hw {
        return Err(KernelError::Shape(format!(
            "gradient {:?} does not match the output of a {kernel_hw:?} filter on input {:?}",
            dy.shape(),
            x.shape()
        )));
    }
    let (xv, dv) = (x.view(), dy.view());
    let (xd, dd) = (standard(&xv), standard(&dv));
    let (xs, ds) = (as_slice(&xd)?, as_slice(&dd)?);
    let shape = [o, c, kernel_hw[0], kernel_hw[1]];
    checked_len(&shape)?;
    let grad = filter_gradient(&g, n, xs, ds)?;
    let grad = grad
        .into_shape_with_order(IxDyn(&shape))
        .map_err(|e| KernelError::Internal(e.to_string()))?;
    Ok(Value::F32(grad))
}

/// Σ over images of dy_i · patches_iᵀ, accumulated per thread over a
/// contiguous range of images, then summed.
fn filter_gradient(
    g: &Geometry,
    images: usize,
    xs: &[f32],
    ds: &[f32],
) -> Result<Array2<f32>, KernelError> {
    let accumulate = |range: Range<usize>| -> Result<Array2<f32>, KernelError> {
        let mut grad = Array2::<f32>::zeros((g.filters, g.patch()));
        let mut scratch = Vec::new();
        for i in range {
            let cols = g.patches(&xs[i * g.in_image()..][..g.in_image()], &mut scratch)?;
            let dy_i = matrix(
                (g.filters, g.out_plane()),
                &ds[i * g.out_image()..][..g.out_image()],
            )?;
            general_mat_mul(1.0, &dy_i, &cols.t(), 1.0, &mut grad);
        }
        Ok(grad)
    };
    let threads = rayon::current_num_threads().max(1);
    if g.work(images) < PAR_WORK || images < 2 || threads < 2 {
        return accumulate(0..images);
    }
    let per_task = images.div_ceil(threads);
    super::hot::keep_hot();
    let partials = (0..images)
        .step_by(per_task)
        .collect::<Vec<_>>()
        .into_par_iter()
        .map(|start| accumulate(start..(start + per_task).min(images)))
        .collect::<Result<Vec<_>, KernelError>>()?;
    let mut parts = partials.into_iter();
    let mut total = parts
        .next()
        .unwrap_or_else(|| Array2::zeros((g.filters, g.patch())));
    parts.for_each(|part| total += &part);
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::ArrayD;

    fn pattern(len: usize, seed: usize) -> Vec<f32> {
        (0..len)
            .map(|i| ((i * 7919 + seed * 104_729) % 997) as f32 / 498.5 - 1.0)
            .collect()
    }

    fn value(shape: &[usize], seed: usize) -> Value {
        let len = shape.iter().product();
        Value::F32(ArrayD::from_shape_vec(IxDyn(shape), pattern(len, seed)).unwrap())
    }

    fn dot(a: &Value, b: &Value) -> f64 {
        let (Value::F32(a), Value::F32(b)) = (a, b) else {
            unreachable!()
        };
        a.iter()
            .zip(b)
            .map(|(&p, &q)| f64::from(p) * f64::from(q))
            .sum()
    }

    /// conv2d at one output, straight from the definition, in f64.
    fn direct(x: &ArrayD<f32>, w: &ArrayD<f32>, attrs: &Conv2dAttrs, at: [usize; 4]) -> f64 {
        let [n, f, oh, ow] = at;
        let (c, kh, kw) = (w.shape()[1], w.shape()[2], w.shape()[3]);
        let mut sum = 0.0;
        for ch in 0..c {
            for i in 0..kh {
                for j in 0..kw {
                    let ih = (oh * attrs.stride[0] + i * attrs.dilation[0]) as isize
                        - attrs.padding[0] as isize;
                    let iw = (ow * attrs.stride[1] + j * attrs.dilation[1]) as isize
                        - attrs.padding[1] as isize;
                    let inside = (0..x.shape()[2] as isize).contains(&ih)
                        && (0..x.shape()[3] as isize).contains(&iw);
                    if inside {
                        sum += f64::from(x[[n, ch, ih as usize, iw as usize]])
                            * f64::from(w[[f, ch, i, j]]);
                    }
                }
            }
        }
        sum
    }

    /// Images split across two threads (the work is above `PAR_WORK`, and
    /// 37 images split unevenly): the forward pass against the definition,
    /// and both gradients through the adjoint identity
    /// ⟨conv(x, w), dy⟩ = ⟨x, dx⟩ = ⟨w, dw⟩.
    #[test]
    fn parallel_convolutions_match_the_definition_and_their_adjoints() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let cases = [
            ([37, 6, 14, 14], [16, 6, 5, 5], [1, 1], [0, 0]),
            ([37, 3, 40, 40], [8, 3, 3, 3], [2, 2], [1, 1]),
            ([37, 16, 32, 32], [12, 16, 1, 1], [1, 1], [0, 0]),
        ];
        for (x_shape, w_shape, stride, padding) in cases {
            let attrs = Conv2dAttrs {
                stride,
                padding,
                dilation: [1, 1],
            };
            let (x, w) = (value(&x_shape, 1), value(&w_shape, 2));
            let g = Geometry::new(
                &attrs,
                [x_shape[1], w_shape[0]],
                [x_shape[2], x_shape[3]],
                [w_shape[2], w_shape[3]],
            )
            .unwrap();
            assert!(g.work(x_shape[0]) >= PAR_WORK);
            let y = pool
                .install(|| conv2d(Arg::Shared(&x), Arg::Shared(&w), &attrs))
                .unwrap();
            let (Value::F32(xa), Value::F32(wa), Value::F32(ya)) = (&x, &w, &y) else {
                unreachable!()
            };
            for (at, &got) in ya.indexed_iter() {
                let want = direct(xa, wa, &attrs, [at[0], at[1], at[2], at[3]]);
                assert!(
                    (f64::from(got) - want).abs() <= 1e-4 * want.abs().max(1.0),
                    "{x_shape:?} at {at:?}: {got} vs {want}"
                );
            }
            let dy = value(ya.shape(), 3);
            let hw = [x_shape[2], x_shape[3]];
            let dx = pool
                .install(|| conv2d_backward_input(Arg::Shared(&dy), Arg::Shared(&w), &attrs, hw))
                .unwrap();
            let kernel = [w_shape[2], w_shape[3]];
            let dw = pool
                .install(|| {
                    conv2d_backward_filter(Arg::Shared(&x), Arg::Shared(&dy), &attrs, kernel)
                })
                .unwrap();
            let forward = dot(&y, &dy);
            for (name, pair) in [("dx", dot(&x, &dx)), ("dw", dot(&w, &dw))] {
                assert!(
                    (pair - forward).abs() <= 1e-4 * forward.abs().max(1.0),
                    "{x_shape:?} {name}: {pair} vs {forward}"
                );
            }
        }
    }
}
