//! Reverse mode: the backward sweep and every VJP rule, in one `match`.

use std::collections::HashMap;
use std::collections::hash_map::Entry;

use crate::autodiff::util::{
    accumulate, broadcast_to, check_type, keep_dims_shape, mask, or_zeros, reduce_count,
    reshape_to, scale_by_unary_derivative, unbroadcast,
};
use crate::autodiff::{activity, control};
use crate::error::{IrError, IrResult};
use crate::graph::{Graph, ValueId};
use crate::op::{BinaryOp, Op, ReduceKind};
use crate::types::{Dim, Shape};

/// Appends the backward pass of the first `n` (primal) nodes of `g`.
///
/// `seeds` pairs primal values with their incoming cotangents. Returns one
/// gradient per `wrt` input, zeros where no path leads to a seeded output.
pub fn backpropagate(
    g: &mut Graph,
    n: usize,
    seeds: &[(ValueId, ValueId)],
    wrt: &[ValueId],
) -> IrResult<Vec<ValueId>> {
    let active = activity::active(g, n, wrt, seeds.iter().map(|s| s.0));
    let mut ct: Vec<Option<ValueId>> = vec![None; n];
    for &(value, seed) in seeds {
        if active[value.index()] {
            accumulate(g, &mut ct[value.index()], seed)?;
        }
    }
    // The cotangents of each control-flow node's results, gathered from
    // the `output` nodes that read them (which come after it).
    let mut tuple_ct: HashMap<usize, Vec<Option<ValueId>>> = HashMap::new();
    for i in (0..n).rev() {
        let id = ValueId(i as u32);
        let node = g.node(id).clone();
        let contributions = match &node.op {
            // ⟨ct, output_r(t)⟩: the cotangent of result r of the tuple.
            Op::Output { index } => {
                let Some(cotangent) = ct[i] else { continue };
                let tuple = node.inputs[0];
                if !active[tuple.index()] {
                    continue;
                }
                let slots = match tuple_ct.entry(tuple.index()) {
                    Entry::Occupied(e) => e.into_mut(),
                    Entry::Vacant(e) => {
                        let count = g.results(tuple).map_err(IrError::Invalid)?.len();
                        e.insert(vec![None; count])
                    }
                };
                accumulate(g, &mut slots[*index], cotangent)?;
                continue;
            }
            op if op.is_tuple() => {
                let Some(cts) = tuple_ct.remove(&i) else {
                    continue;
                };
                let wanted: Vec<bool> = (0..node.inputs.len())
                    .map(|k| {
                        active[node.inputs[k].index()] && activity::differentiable_edge(g, id, k)
                    })
                    .collect();
                tuple_vjp(g, op, &node.inputs, id, &cts, &wanted)?
            }
            op => {
                let Some(cotangent) = ct[i] else { continue };
                if node.inputs.is_empty() {
                    continue;
                }
                vjp_rule(g, op, &node.inputs, id, cotangent)?
            }
        };
        for (k, (&x, c)) in node.inputs.iter().zip(contributions).enumerate() {
            let wanted = active[x.index()] && activity::differentiable_edge(g, id, k);
            if let (true, Some(c)) = (wanted, c) {
                check_type(g, c, x, node.op.name())?;
                accumulate(g, &mut ct[x.index()], c)?;
            }
        }
    }
    wrt.iter().map(|&w| or_zeros(g, ct[w.index()], w)).collect()
}

/// The VJP of a control-flow node, given its results' cotangents (`None`
/// where none reached one): the contributions of its operands, for those
/// `wanted`. See `control.rs`.
fn tuple_vjp(
    g: &mut Graph,
    op: &Op,
    x: &[ValueId],
    tuple: ValueId,
    cts: &[Option<ValueId>],
    wanted: &[bool],
) -> IrResult<Vec<Option<ValueId>>> {
    match op {
        Op::Scan(scan) => control::scan_vjp(g, scan, x, tuple, cts, wanted),
        Op::Cond(cond) => control::cond_vjp(g, cond, x, cts, wanted),
        // Reverse mode sees no `while_loop`: `lower_for_reverse` makes each
        // a scan of `max_trips` guarded steps first.
        Op::WhileLoop(_) => Err(IrError::Invalid(
            "a `while_loop` reached the reverse sweep unlowered".into(),
        )),
        _ => Err(IrError::Invalid(format!(
            "`{}` is not a control-flow op",
            op.name()
        ))),
    }
}

/// The VJP of one node: given the cotangent `ct` of its output `y`, the
/// cotangent contribution for each input `x[k]` (`None`: no derivative).
///
/// Rules return a contribution for every differentiable operand; the caller
/// keeps only active ones and the dead-code sweep drops the rest.
fn vjp_rule(
    g: &mut Graph,
    op: &Op,
    x: &[ValueId],
    y: ValueId,
    ct: ValueId,
) -> IrResult<Vec<Option<ValueId>>> {
    let shapes: Vec<Shape> = x.iter().map(|&v| g.ty(v).shape.clone()).collect();
    Ok(match op {
        Op::Input { .. } | Op::Constant(_) => vec![],
        Op::Unary(u) => vec![Some(scale_by_unary_derivative(g, *u, x[0], y, ct)?)],
        Op::Binary(b) => {
            let (da, db) = binary_vjp(g, *b, x[0], x[1], y, ct)?;
            let da = da.map(|d| unbroadcast(g, d, &shapes[0])).transpose()?;
            let db = db.map(|d| unbroadcast(g, d, &shapes[1])).transpose()?;
            vec![da, db]
        }
        // where(c, a, b): each branch gets the cotangent where it was chosen.
        Op::Where => {
            let zero = g.scalar(0.0)?;
            let da = g.select(x[0], ct, zero)?;
            let db = g.select(x[0], zero, ct)?;
            let da = unbroadcast(g, da, &shapes[1])?;
            let db = unbroadcast(g, db, &shapes[2])?;
            vec![None, Some(da), Some(db)]
        }
        // Only f32 → f32 casts are differentiable edges: the identity.
        Op::Cast { .. } => vec![Some(ct)],
        Op::MatMul {
            transpose_a,
            transpose_b,
        } => {
            let (da, db) = matmul_vjp(g, x[0], x[1], *transpose_a, *transpose_b, ct)?;
            let da = unbroadcast(g, da, &shapes[0])?;
            let db = unbroadcast(g, db, &shapes[1])?;
            vec![Some(da), Some(db)]
        }
        // keep_dims needs no case: the rule reshapes the cotangent to the
        // keep-dims shape either way.
        Op::Reduce { kind, axes, .. } => vec![Some(reduce_vjp(g, *kind, axes, x[0], y, ct)?)],
        Op::Reshape { .. } => vec![Some(reshape_to(g, ct, &shapes[0])?)],
        Op::Transpose { perm } => {
            let mut inverse = vec![0; perm.len()];
            for (i, &p) in perm.iter().enumerate() {
                inverse[p] = i;
            }
            vec![Some(g.transpose(ct, inverse)?)]
        }
        Op::Broadcast { .. } => vec![Some(unbroadcast(g, ct, &shapes[0])?)],
        // Slice and Pad are adjoint.
        Op::Slice { axis, start, end } => {
            let len = fixed_dim(&shapes[0].0, *axis, "slice")?;
            let pad = Op::Pad {
                axis: *axis,
                before: *start,
                after: len - end,
            };
            vec![Some(g.push(pad, &[ct])?)]
        }
        Op::Pad { axis, before, .. } => {
            let len = fixed_dim(&shapes[0].0, *axis, "pad")?;
            let slice = Op::Slice {
                axis: *axis,
                start: *before,
                end: before + len,
            };
            vec![Some(g.push(slice, &[ct])?)]
        }
        Op::Concat { axis } => {
            let mut start = 0;
            let mut parts = Vec::with_capacity(x.len());
            for input_shape in &shapes {
                let len = fixed_dim(&input_shape.0, *axis, "concat")?;
                let slice = Op::Slice {
                    axis: *axis,
                    start,
                    end: start + len,
                };
                parts.push(Some(g.push(slice, &[ct])?));
                start += len;
            }
            parts
        }
        // conv2d is bilinear; its two partial adjoints are ops of their own.
        Op::Conv2d(attrs) => {
            let input_hw = spatial(&shapes[0].0, "conv2d input")?;
            let kernel_hw = spatial(&shapes[1].0, "conv2d filter")?;
            let dx = g.push(
                Op::Conv2dBackwardInput {
                    attrs: *attrs,
                    input_hw,
                },
                &[ct, x[1]],
            )?;
            let dw = g.push(
                Op::Conv2dBackwardFilter {
                    attrs: *attrs,
                    kernel_hw,
                },
                &[x[0], ct],
            )?;
            vec![Some(dx), Some(dw)]
        }
        // convBI(dy, w): ⟨g, convBI(dy, w)⟩ = ⟨conv(g, w), dy⟩ = ⟨w, convBF(g, dy)⟩.
        Op::Conv2dBackwardInput { attrs, .. } => {
            let kernel_hw = spatial(&shapes[1].0, "conv2d filter")?;
            let d_dy = g.conv2d(ct, x[1], *attrs)?;
            let dw = g.push(
                Op::Conv2dBackwardFilter {
                    attrs: *attrs,
                    kernel_hw,
                },
                &[ct, x[0]],
            )?;
            vec![Some(d_dy), Some(dw)]
        }
        // convBF(x, dy): ⟨g, convBF(x, dy)⟩ = ⟨conv(x, g), dy⟩ = ⟨x, convBI(dy, g)⟩.
        Op::Conv2dBackwardFilter { attrs, .. } => {
            let input_hw = spatial(&shapes[0].0, "conv2d input")?;
            let dx = g.push(
                Op::Conv2dBackwardInput {
                    attrs: *attrs,
                    input_hw,
                },
                &[x[1], ct],
            )?;
            let d_dy = g.conv2d(x[0], ct, *attrs)?;
            vec![Some(dx), Some(d_dy)]
        }
        // Pooling selections are piecewise constant in x: x gets nothing.
        Op::MaxPool2d(attrs) => vec![Some(g.push(Op::MaxPool2dBackward(*attrs), &[x[0], ct])?)],
        Op::MaxPool2dSelect(attrs) => {
            vec![
                None,
                Some(g.push(Op::MaxPool2dBackward(*attrs), &[x[0], ct])?),
            ]
        }
        Op::MaxPool2dBackward(attrs) => {
            vec![
                None,
                Some(g.push(Op::MaxPool2dSelect(*attrs), &[x[0], ct])?),
            ]
        }
        Op::AvgPool2d(attrs) => {
            let input_hw = spatial(&shapes[0].0, "avg_pool2d input")?;
            let adjoint = Op::AvgPool2dBackward {
                attrs: *attrs,
                input_hw,
            };
            vec![Some(g.push(adjoint, &[ct])?)]
        }
        Op::AvgPool2dBackward { attrs, .. } => vec![Some(g.avg_pool2d(ct, *attrs)?)],
        // y·(g − Σ g·y)
        Op::Softmax { axis } => {
            let gy = g.mul(ct, y)?;
            let s = g.sum(gy, &[*axis], true)?;
            let centered = g.sub(ct, s)?;
            vec![Some(g.mul(y, centered)?)]
        }
        // g − exp(y)·Σ g
        Op::LogSoftmax { axis } => {
            let s = g.sum(ct, &[*axis], true)?;
            let p = g.exp(y)?;
            let ps = g.mul(p, s)?;
            vec![Some(g.sub(ct, ps)?)]
        }
        // Gather and ScatterAdd are adjoint in the data/updates operand.
        Op::Gather { axis } => {
            let dim_size = fixed_dim(&shapes[0].0, *axis, "gather")?;
            let scatter = Op::ScatterAdd {
                axis: *axis,
                dim_size,
            };
            vec![Some(g.push(scatter, &[x[1], ct])?), None]
        }
        Op::ScatterAdd { axis, .. } => {
            vec![None, Some(g.push(Op::Gather { axis: *axis }, &[ct, x[0]])?)]
        }
        Op::OneHot { .. } | Op::RandomUniform { .. } | Op::ArgMax { .. } => vec![None],
        // Control flow has several results: the sweep gathers their
        // cotangents and calls `tuple_vjp`.
        Op::Output { .. } | Op::Scan(_) | Op::Cond(_) | Op::WhileLoop(_) => {
            return Err(IrError::Invalid(format!(
                "`{}` is differentiated by the sweep, not by a single-result rule",
                op.name()
            )));
        }
        // The user's rule, inlined with (inputs…, y, dy).
        Op::CustomGrad(custom) => {
            let mut args = x.to_vec();
            args.extend([y, ct]);
            let grads = g.inline(&custom.backward, &args)?;
            grads.into_iter().map(Some).collect()
        }
    })
}

/// Cotangents of both operands of an elementwise binary op, at the output
/// shape (the caller unbroadcasts them).
fn binary_vjp(
    g: &mut Graph,
    op: BinaryOp,
    a: ValueId,
    b: ValueId,
    y: ValueId,
    ct: ValueId,
) -> IrResult<(Option<ValueId>, Option<ValueId>)> {
    Ok(match op {
        BinaryOp::Add => (Some(ct), Some(ct)),
        BinaryOp::Sub => (Some(ct), Some(g.neg(ct)?)),
        BinaryOp::Mul => (Some(g.mul(ct, b)?), Some(g.mul(ct, a)?)),
        // d(a/b) = da/b − db·y/b
        BinaryOp::Div => {
            let da = g.div(ct, b)?;
            let dy = g.mul(da, y)?;
            (Some(da), Some(g.neg(dy)?))
        }
        // d(a^b) = b·a^(b−1)·da + y·ln(a)·db
        BinaryOp::Pow => {
            let one = g.scalar(1.0)?;
            let b1 = g.sub(b, one)?;
            let p = g.binary(BinaryOp::Pow, a, b1)?;
            let bp = g.mul(b, p)?;
            let da = g.mul(ct, bp)?;
            let ln_a = g.log(a)?;
            let y_ln_a = g.mul(y, ln_a)?;
            (Some(da), Some(g.mul(ct, y_ln_a)?))
        }
        // The winning operand gets the cotangent; ties go to `a`, so the two
        // parts always sum to `ct`.
        BinaryOp::Maximum | BinaryOp::Minimum => {
            let cmp = if op == BinaryOp::Maximum {
                BinaryOp::Ge
            } else {
                BinaryOp::Le
            };
            let a_wins = g.binary(cmp, a, b)?;
            let zero = g.scalar(0.0)?;
            let da = g.select(a_wins, ct, zero)?;
            let db = g.select(a_wins, zero, ct)?;
            (Some(da), Some(db))
        }
        // Comparisons and logic return bool: no derivative.
        _ => (None, None),
    })
}

/// y = A·B with A = aᵀ if `ta`, B = bᵀ if `tb`. Then dA = g·Bᵀ and
/// dB = Aᵀ·g, and da is dA (or dAᵀ when `ta`), db likewise; each case is one
/// matmul with flags, never a materialised transpose.
fn matmul_vjp(
    g: &mut Graph,
    a: ValueId,
    b: ValueId,
    ta: bool,
    tb: bool,
    ct: ValueId,
) -> IrResult<(ValueId, ValueId)> {
    let da = match (ta, tb) {
        (false, false) => g.matmul_t(ct, b, false, true)?, // g·bᵀ
        (false, true) => g.matmul_t(ct, b, false, false)?, // g·b
        (true, false) => g.matmul_t(b, ct, false, true)?,  // (g·bᵀ)ᵀ = b·gᵀ
        (true, true) => g.matmul_t(b, ct, true, true)?,    // (g·b)ᵀ = bᵀ·gᵀ
    };
    let db = match (ta, tb) {
        (false, false) => g.matmul_t(a, ct, true, false)?, // aᵀ·g
        (true, false) => g.matmul_t(a, ct, false, false)?, // a·g
        (false, true) => g.matmul_t(ct, a, true, false)?,  // (aᵀ·g)ᵀ = gᵀ·a
        (true, true) => g.matmul_t(ct, a, true, true)?,    // (a·g)ᵀ = gᵀ·aᵀ
    };
    Ok((da, db))
}

/// Reductions: Sum spreads the cotangent, Mean also divides by the count,
/// Max routes it to the maximal positions, split evenly between ties.
fn reduce_vjp(
    g: &mut Graph,
    kind: ReduceKind,
    axes: &[usize],
    x: ValueId,
    y: ValueId,
    ct: ValueId,
) -> IrResult<ValueId> {
    let x_shape = g.ty(x).shape.clone();
    let kept = keep_dims_shape(&x_shape, axes);
    let ct_kept = reshape_to(g, ct, &kept)?;
    match kind {
        ReduceKind::Sum => broadcast_to(g, ct_kept, &x_shape),
        ReduceKind::Mean => {
            let count = reduce_count(g, x, axes)?;
            let scaled = g.div(ct_kept, count)?;
            broadcast_to(g, scaled, &x_shape)
        }
        ReduceKind::Max => {
            let y_kept = reshape_to(g, y, &kept)?;
            let is_max = mask(g, BinaryOp::Eq, x, y_kept)?;
            let ties = g.sum(is_max, axes, true)?;
            let share = g.div(ct_kept, ties)?;
            g.mul(is_max, share)
        }
    }
}

fn fixed_dim(dims: &[Dim], axis: usize, what: &str) -> IrResult<usize> {
    dims[axis].fixed().ok_or_else(|| {
        IrError::Invalid(format!(
            "cannot differentiate {what} along axis {axis}: it is the batch dimension"
        ))
    })
}

/// The static (H, W) of an NCHW shape.
fn spatial(dims: &[Dim], what: &str) -> IrResult<[usize; 2]> {
    Ok([fixed_dim(dims, 2, what)?, fixed_dim(dims, 3, what)?])
}
