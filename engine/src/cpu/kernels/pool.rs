//! 2-D pooling over NCHW images and the adjoints used by autodiff.
//!
//! Each (n, c) plane is independent, so kernels work plane by plane (in
//! parallel when large). Padding never wins a max and counts as zero in an
//! average, whose divisor is always the full kernel area.

use std::ops::Range;

use canopy_ir::Pool2dAttrs;
use canopy_ir::op::window_output_size;
use rayon::prelude::*;

use super::Arg;
use super::tensor::{PAR_THRESHOLD, Tensor, as_slice, from_vec, standard, tensor};
use crate::error::KernelError;
use crate::value::Value;

/// Pooling geometry for one input size, with each output row's and
/// column's window clipped to the image once, up front.
struct Geometry {
    in_hw: [usize; 2],
    out_hw: [usize; 2],
    kernel_area: f32,
    /// Input rows of each output row's window (padding excluded).
    row_windows: Vec<Range<usize>>,
    /// Input columns of each output column's window (padding excluded).
    col_windows: Vec<Range<usize>>,
    /// 2×2 windows at stride 2 without padding (LeNet's, and most CNNs'
    /// pooling): the max, its gradient and the argmax read two rows at a
    /// time instead of window by window.
    two_by_two: bool,
}

impl Geometry {
    fn new(attrs: &Pool2dAttrs, in_hw: [usize; 2]) -> Result<Geometry, KernelError> {
        let mut out_hw = [0; 2];
        for i in 0..2 {
            out_hw[i] = window_output_size(
                in_hw[i],
                attrs.kernel[i],
                attrs.stride[i],
                attrs.padding[i],
                1,
            )
            .filter(|&o| o > 0 && attrs.kernel[i] > 0)
            .ok_or_else(|| {
                KernelError::Attribute(format!("window {attrs:?} does not fit input {in_hw:?}"))
            })?;
        }
        let windows = |i: usize| -> Vec<Range<usize>> {
            (0..out_hw[i])
                .map(|o| {
                    let start = (o * attrs.stride[i]) as isize - attrs.padding[i] as isize;
                    let end = start + attrs.kernel[i] as isize;
                    let limit = in_hw[i] as isize;
                    (start.clamp(0, limit) as usize)..(end.clamp(0, limit) as usize)
                })
                .collect()
        };
        Ok(Geometry {
            in_hw,
            out_hw,
            kernel_area: (attrs.kernel[0] * attrs.kernel[1]) as f32,
            row_windows: windows(0),
            col_windows: windows(1),
            two_by_two: attrs.kernel == [2, 2] && attrs.stride == [2, 2] && attrs.padding == [0, 0],
        })
    }

    fn in_plane(&self) -> usize {
        self.in_hw[0] * self.in_hw[1]
    }

    fn out_plane(&self) -> usize {
        self.out_hw[0] * self.out_hw[1]
    }

    /// Calls `f(output_index, rows, cols)` for every output of a plane.
    fn for_each_window(&self, mut f: impl FnMut(usize, &Range<usize>, &Range<usize>)) {
        let width = self.out_hw[1];
        for (oh, rows) in self.row_windows.iter().enumerate() {
            for (ow, cols) in self.col_windows.iter().enumerate() {
                f(oh * width + ow, rows, cols);
            }
        }
    }

    /// The flat position of the first maximum of `plane` in the window, in
    /// row-major window order (NaN counts as the maximum); `None` for a
    /// window of padding only, which happens only for an empty input.
    fn argmax(&self, plane: &[f32], rows: &Range<usize>, cols: &Range<usize>) -> Option<usize> {
        if rows.is_empty() || cols.is_empty() {
            return None;
        }
        let width = self.in_hw[1];
        let mut best_at = rows.start * width + cols.start;
        let mut best = plane[best_at];
        for r in rows.clone() {
            let line = &plane[r * width..(r + 1) * width];
            for c in cols.clone() {
                let v = line[c];
                if wins(v, best) {
                    best = v;
                    best_at = r * width + c;
                }
            }
        }
        Some(best_at)
    }

    /// Calls `f(output_index, argmax)` for every output of a plane, with
    /// [`Geometry::argmax`]'s answer.
    fn for_each_argmax(&self, plane: &[f32], mut f: impl FnMut(usize, Option<usize>)) {
        if !self.two_by_two {
            self.for_each_window(|o, rows, cols| f(o, self.argmax(plane, rows, cols)));
            return;
        }
        let (width, [out_h, out_w]) = (self.in_hw[1], self.out_hw);
        for r in 0..out_h {
            let top_start = 2 * r * width;
            let top = &plane[top_start..][..2 * out_w];
            let bottom = &plane[top_start + width..][..2 * out_w];
            let pairs = top.chunks_exact(2).zip(bottom.chunks_exact(2));
            for (c, (upper, lower)) in pairs.enumerate() {
                let best_at = first_max_of_four([upper[0], upper[1], lower[0], lower[1]]);
                let at = top_start + 2 * c + (best_at & 1) + (best_at >> 1) * width;
                f(r * out_w + c, Some(at));
            }
        }
    }

    /// The maxima of a plane's 2×2 windows, without their positions: which
    /// of equal maxima comes first does not change the value, so this is
    /// a select per pair of elements that the compiler vectorises.
    fn max_two_by_two(&self, plane: &[f32], out: &mut [f32]) {
        let (width, out_w) = (self.in_hw[1], self.out_hw[1]);
        for (r, out_row) in out.chunks_exact_mut(out_w).enumerate() {
            let top = &plane[2 * r * width..][..2 * out_w];
            let bottom = &plane[(2 * r + 1) * width..][..2 * out_w];
            for ((o, upper), lower) in out_row
                .iter_mut()
                .zip(top.chunks_exact(2))
                .zip(bottom.chunks_exact(2))
            {
                *o = max_or_nan(
                    max_or_nan(upper[0], upper[1]),
                    max_or_nan(lower[0], lower[1]),
                );
            }
        }
    }

    /// Each of a plane's 2×2 windows' gradient `dy` written at its first
    /// maximum in `dx`, zeros at the other three: the windows do not
    /// overlap, so every element of `dx` is written once (an odd last row
    /// or column keeps its zeros), without a branch.
    fn route_two_by_two(&self, plane: &[f32], dy: &[f32], dx: &mut [f32]) {
        let (width, out_w) = (self.in_hw[1], self.out_hw[1]);
        for (r, dy_row) in dy.chunks_exact(out_w).enumerate() {
            let start = 2 * r * width;
            let top = &plane[start..][..2 * out_w];
            let bottom = &plane[start + width..][..2 * out_w];
            let (dx_top, dx_rest) = dx[start..].split_at_mut(width);
            let dx_bottom = &mut dx_rest[..2 * out_w];
            let windows = top.chunks_exact(2).zip(bottom.chunks_exact(2)).zip(dy_row);
            let targets = dx_top[..2 * out_w]
                .chunks_exact_mut(2)
                .zip(dx_bottom.chunks_exact_mut(2));
            for (((upper, lower), &g), (dx_upper, dx_lower)) in windows.zip(targets) {
                let at = first_max_of_four([upper[0], upper[1], lower[0], lower[1]]);
                dx_upper[0] = if at == 0 { g } else { 0.0 };
                dx_upper[1] = if at == 1 { g } else { 0.0 };
                dx_lower[0] = if at == 2 { g } else { 0.0 };
                dx_lower[1] = if at == 3 { g } else { 0.0 };
            }
        }
    }

    /// Sum of `plane` over the window.
    fn window_sum(&self, plane: &[f32], rows: &Range<usize>, cols: &Range<usize>) -> f32 {
        let width = self.in_hw[1];
        rows.clone()
            .map(|r| {
                plane[r * width..(r + 1) * width][cols.clone()]
                    .iter()
                    .sum::<f32>()
            })
            .sum()
    }

    /// Adds `value` to every element of `plane` in the window.
    fn window_add(&self, plane: &mut [f32], rows: &Range<usize>, cols: &Range<usize>, value: f32) {
        let width = self.in_hw[1];
        for r in rows.clone() {
            plane[r * width..(r + 1) * width][cols.clone()]
                .iter_mut()
                .for_each(|v| *v += value);
        }
    }
}

/// Whether `v`, met after `best` in a window, becomes its maximum: when
/// larger, or NaN where `best` is not (NaN counts as the maximum).
fn wins(v: f32, best: f32) -> bool {
    (v > best) | (v.is_nan() & !best.is_nan())
}

/// Which of a 2×2 window's values, in row-major order, is its first
/// maximum (as [`Geometry::argmax`] decides), chosen with masks: a branch
/// per comparison mispredicts on real activations about every other window.
fn first_max_of_four(window: [f32; 4]) -> usize {
    let (mut best, mut best_at) = (window[0], 0u32);
    for (k, &v) in (1u32..).zip(&window[1..]) {
        let mask = 0u32.wrapping_sub(u32::from(wins(v, best)));
        best = f32::from_bits((v.to_bits() & mask) | (best.to_bits() & !mask));
        best_at = (k & mask) | (best_at & !mask);
    }
    best_at as usize
}

/// The larger of two values, or NaN when either is (the value `wins`
/// picks, whatever the order).
fn max_or_nan(a: f32, b: f32) -> f32 {
    if wins(b, a) { b } else { a }
}

/// An NCHW f32 operand with its (N·C) plane count and (H, W).
fn image<'a>(
    arg: Arg<'a>,
    role: &str,
) -> Result<(Tensor<'a, f32>, usize, [usize; 2]), KernelError> {
    let x = tensor::<f32>(arg, role)?;
    match *x.shape() {
        [n, c, h, w] => Ok((x, n * c, [h, w])),
        ref other => Err(KernelError::Rank {
            role: format!("{role} (NCHW)"),
            expected: "4",
            got: other.to_vec(),
        }),
    }
}

/// Checks that `arg`'s shape is `expected`.
fn expect_shape(x: &Tensor<'_, f32>, expected: &[usize], role: &str) -> Result<(), KernelError> {
    if x.shape() != expected {
        return Err(KernelError::Shape(format!(
            "{role} has shape {:?}, expected {expected:?}",
            x.shape()
        )));
    }
    Ok(())
}

/// Calls `f(plane, out_plane)` for each of `planes` equal parts of `out`,
/// in parallel when `work` (elements touched) is large.
fn per_plane(
    out: &mut [f32],
    planes: usize,
    work: usize,
    f: impl Fn(usize, &mut [f32]) + Sync + Send,
) {
    if out.is_empty() || planes == 0 {
        return;
    }
    let size = out.len() / planes;
    if work >= PAR_THRESHOLD {
        super::hot::keep_hot();
        out.par_chunks_mut(size)
            .enumerate()
            .for_each(|(p, o)| f(p, o));
    } else {
        out.chunks_mut(size).enumerate().for_each(|(p, o)| f(p, o));
    }
}

fn pooled_shape(x: &Tensor<'_, f32>, g: &Geometry) -> Vec<usize> {
    let s = x.shape();
    vec![s[0], s[1], g.out_hw[0], g.out_hw[1]]
}

pub fn max_pool2d(x: Arg<'_>, attrs: &Pool2dAttrs) -> Result<Value, KernelError> {
    let (x, planes, in_hw) = image(x, "input")?;
    let g = Geometry::new(attrs, in_hw)?;
    let view = x.view();
    let data = standard(&view);
    let xs = as_slice(&data)?;
    if !g.two_by_two {
        return select_into(xs, xs, planes, &g, pooled_shape(&x, &g));
    }
    let mut out = vec![0.0f32; planes * g.out_plane()];
    per_plane(&mut out, planes, xs.len(), |p, out| {
        g.max_two_by_two(&xs[p * g.in_plane()..][..g.in_plane()], out);
    });
    from_vec(&pooled_shape(&x, &g), out).map(Value::F32)
}

/// (x, v) → pooled: v at the first maximum of x in each window.
pub fn max_pool2d_select(
    x: Arg<'_>,
    v: Arg<'_>,
    attrs: &Pool2dAttrs,
) -> Result<Value, KernelError> {
    let (x, planes, in_hw) = image(x, "input")?;
    let v = tensor::<f32>(v, "values")?;
    expect_shape(&v, x.shape(), "values")?;
    let g = Geometry::new(attrs, in_hw)?;
    let (xv, vv) = (x.view(), v.view());
    let (xd, vd) = (standard(&xv), standard(&vv));
    select_into(
        as_slice(&xd)?,
        as_slice(&vd)?,
        planes,
        &g,
        pooled_shape(&x, &g),
    )
}

fn select_into(
    x: &[f32],
    v: &[f32],
    planes: usize,
    g: &Geometry,
    shape: Vec<usize>,
) -> Result<Value, KernelError> {
    let mut out = vec![0.0f32; planes * g.out_plane()];
    per_plane(&mut out, planes, x.len(), |p, out| {
        let xp = &x[p * g.in_plane()..][..g.in_plane()];
        let vp = &v[p * g.in_plane()..][..g.in_plane()];
        g.for_each_argmax(xp, |o, at| out[o] = at.map_or(0.0, |i| vp[i]));
    });
    from_vec(&shape, out).map(Value::F32)
}

/// (x, dy) → x-shaped: each dy added at its window's first maximum of x.
pub fn max_pool2d_backward(
    x: Arg<'_>,
    dy: Arg<'_>,
    attrs: &Pool2dAttrs,
) -> Result<Value, KernelError> {
    let (x, planes, in_hw) = image(x, "input")?;
    let g = Geometry::new(attrs, in_hw)?;
    let dy = tensor::<f32>(dy, "gradient")?;
    expect_shape(&dy, &pooled_shape(&x, &g), "gradient")?;
    let (xv, dv) = (x.view(), dy.view());
    let (xd, dd) = (standard(&xv), standard(&dv));
    let (xs, ds) = (as_slice(&xd)?, as_slice(&dd)?);
    let mut out = vec![0.0f32; xs.len()];
    per_plane(&mut out, planes, xs.len(), |p, dx| {
        let xp = &xs[p * g.in_plane()..][..g.in_plane()];
        let dyp = &ds[p * g.out_plane()..][..g.out_plane()];
        if g.two_by_two {
            g.route_two_by_two(xp, dyp, dx);
            return;
        }
        g.for_each_argmax(xp, |o, at| {
            if let Some(i) = at {
                dx[i] += dyp[o];
            }
        });
    });
    from_vec(x.shape(), out).map(Value::F32)
}

pub fn avg_pool2d(x: Arg<'_>, attrs: &Pool2dAttrs) -> Result<Value, KernelError> {
    let (x, planes, in_hw) = image(x, "input")?;
    let g = Geometry::new(attrs, in_hw)?;
    let view = x.view();
    let data = standard(&view);
    let xs = as_slice(&data)?;
    let mut out = vec![0.0f32; planes * g.out_plane()];
    let scale = 1.0 / g.kernel_area;
    per_plane(&mut out, planes, xs.len(), |p, out| {
        let xp = &xs[p * g.in_plane()..][..g.in_plane()];
        g.for_each_window(|o, rows, cols| out[o] = g.window_sum(xp, rows, cols) * scale);
    });
    from_vec(&pooled_shape(&x, &g), out).map(Value::F32)
}

/// dy → x-shaped: each dy spread evenly (over the full kernel area) onto
/// the input elements of its window.
pub fn avg_pool2d_backward(
    dy: Arg<'_>,
    attrs: &Pool2dAttrs,
    input_hw: [usize; 2],
) -> Result<Value, KernelError> {
    let (dy, planes, _) = image(dy, "gradient")?;
    let g = Geometry::new(attrs, input_hw)?;
    let shape = dy.shape();
    let (x_shape, expected) = (
        vec![shape[0], shape[1], input_hw[0], input_hw[1]],
        vec![shape[0], shape[1], g.out_hw[0], g.out_hw[1]],
    );
    expect_shape(&dy, &expected, "gradient")?;
    let view = dy.view();
    let data = standard(&view);
    let ds = as_slice(&data)?;
    let mut out = vec![0.0f32; planes * g.in_plane()];
    let scale = 1.0 / g.kernel_area;
    per_plane(&mut out, planes, planes * g.in_plane(), |p, dx| {
        let dyp = &ds[p * g.out_plane()..][..g.out_plane()];
        g.for_each_window(|o, rows, cols| g.window_add(dx, rows, cols, dyp[o] * scale));
    });
    from_vec(&x_shape, out).map(Value::F32)
}
