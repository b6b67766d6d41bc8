//! Forward mode: the tangent sweep and every JVP rule, in one `match`.

use std::collections::HashMap;

use crate::autodiff::util::{
    broadcast_to, check_type, keep_dims_shape, mask, or_zeros, reshape_to,
    scale_by_unary_derivative,
};
use crate::autodiff::{activity, control};
use crate::error::{IrError, IrResult};
use crate::graph::{Graph, ValueId};
use crate::op::{BinaryOp, Op, ReduceKind};

/// Appends the tangent computation of the first `n` (primal) nodes of `g`.
///
/// `tangents` pairs `wrt` inputs with their tangent inputs. Returns one
/// tangent per `target`, zeros where no `wrt` input reaches it.
pub fn propagate(
    g: &mut Graph,
    n: usize,
    tangents: &[(ValueId, ValueId)],
    targets: &[ValueId],
) -> IrResult<Vec<ValueId>> {
    let sources: Vec<ValueId> = tangents.iter().map(|t| t.0).collect();
    let active = activity::active(g, n, &sources, targets.iter().copied());
    let mut tan: Vec<Option<ValueId>> = vec![None; n];
    for &(input, tangent) in tangents {
        tan[input.index()] = Some(tangent);
    }
    // Each control-flow node's tangent node, and where among its results
    // the tangent of each primal result is.
    let mut tuple_tan: HashMap<usize, (ValueId, Vec<Option<usize>>)> = HashMap::new();
    for i in 0..n {
        let id = ValueId(i as u32);
        let node = g.node(id).clone();
        if !active[i] || node.inputs.is_empty() {
            continue;
        }
        if let Op::Output { index } = node.op {
            let tangent = match tuple_tan.get(&node.inputs[0].index()) {
                Some(&(tuple, ref map)) => match map[index] {
                    Some(r) => Some(g.push(Op::Output { index: r }, &[tuple])?),
                    None => None,
                },
                None => None,
            };
            tan[i] = Some(or_zeros(g, tangent, id)?);
            continue;
        }
        let t_in: Vec<Option<ValueId>> = (0..node.inputs.len())
            .map(|k| {
                let x = node.inputs[k];
                let flows = activity::differentiable_edge(g, id, k);
                if flows { tan[x.index()] } else { None }
            })
            .collect();
        if node.op.is_tuple() {
            let tangent = control::tuple_jvp(g, &node.op, &node.inputs, &t_in)?;
            tuple_tan.insert(i, tangent);
            continue;
        }
        let t = jvp_rule(g, &node.op, &node.inputs, id, &t_in)?;
        check_type(g, t, id, node.op.name())?;
        tan[i] = Some(t);
    }
    targets
        .iter()
        .map(|&v| or_zeros(g, tan[v.index()], v))
        .collect()
}

/// The JVP of one node: the tangent of its output `y` from the tangents
/// `t[k]` of its inputs `x[k]` (`None`: zero). At least one is `Some`.
fn jvp_rule(
    g: &mut Graph,
    op: &Op,
    x: &[ValueId],
    y: ValueId,
    t: &[Option<ValueId>],
) -> IrResult<ValueId> {
    let out_shape = g.ty(y).shape.clone();
    match op {
        Op::Input { .. } | Op::Constant(_) => Err(internal(op)),
        Op::Unary(u) => scale_by_unary_derivative(g, *u, x[0], y, tangent(t, 0, op)?),
        Op::Binary(b) => {
            let dy = binary_jvp(g, *b, x[0], x[1], y, t[0], t[1])?;
            broadcast_to(g, dy, &out_shape)
        }
        Op::Where => {
            let zero = g.scalar(0.0)?;
            let ta = t[1].unwrap_or(zero);
            let tb = t[2].unwrap_or(zero);
            let dy = g.select(x[0], ta, tb)?;
            broadcast_to(g, dy, &out_shape)
        }
        Op::Cast { .. } => Ok(tangent(t, 0, op)?),
        // Bilinear: d(a·b) = da·b + a·db, with the same flags.
        Op::MatMul { .. }
        | Op::Conv2d(_)
        | Op::Conv2dBackwardInput { .. }
        | Op::Conv2dBackwardFilter { .. } => bilinear(g, op, x, t),
        Op::Reduce {
            kind,
            axes,
            keep_dims,
        } => reduce_jvp(g, *kind, axes, *keep_dims, x[0], y, tangent(t, 0, op)?),
        // Linear in their one operand: the same op on the tangent.
        Op::Reshape { .. }
        | Op::Transpose { .. }
        | Op::Broadcast { .. }
        | Op::Slice { .. }
        | Op::Pad { .. }
        | Op::AvgPool2d(_)
        | Op::AvgPool2dBackward { .. } => g.push(op.clone(), &[tangent(t, 0, op)?]),
        Op::Concat { .. } => {
            let mut parts = Vec::with_capacity(x.len());
            for (k, &xk) in x.iter().enumerate() {
                parts.push(or_zeros(g, t[k], xk)?);
            }
            g.push(op.clone(), &parts)
        }
        // Pooling selections: positions come from x, values from the tangent.
        Op::MaxPool2d(attrs) => {
            let tx = tangent(t, 0, op)?;
            g.push(Op::MaxPool2dSelect(*attrs), &[x[0], tx])
        }
        Op::MaxPool2dSelect(_) | Op::MaxPool2dBackward(_) => {
            g.push(op.clone(), &[x[0], tangent(t, 1, op)?])
        }
        // The softmax Jacobian is symmetric: y·(t − Σ t·y).
        Op::Softmax { axis } => {
            let tx = tangent(t, 0, op)?;
            let ty = g.mul(tx, y)?;
            let s = g.sum(ty, &[*axis], true)?;
            let centered = g.sub(tx, s)?;
            g.mul(y, centered)
        }
        // t − Σ exp(y)·t
        Op::LogSoftmax { axis } => {
            let tx = tangent(t, 0, op)?;
            let p = g.exp(y)?;
            let pt = g.mul(p, tx)?;
            let s = g.sum(pt, &[*axis], true)?;
            g.sub(tx, s)
        }
        Op::Gather { .. } => g.push(op.clone(), &[tangent(t, 0, op)?, x[1]]),
        Op::ScatterAdd { .. } => g.push(op.clone(), &[x[0], tangent(t, 1, op)?]),
        Op::OneHot { .. } | Op::RandomUniform { .. } | Op::ArgMax { .. } => Err(internal(op)),
        // The sweep pairs each with a node of its kind (`control.rs`).
        Op::Output { .. } | Op::Scan(_) | Op::Cond(_) | Op::WhileLoop(_) => {
            Err(IrError::Invalid(format!(
                "`{}` is differentiated by the sweep, not by a single-result rule",
                op.name()
            )))
        }
        // Differentiate the forward graph itself: custom rules are for
        // reverse mode only.
        Op::CustomGrad(custom) => {
            let fwd = &custom.forward;
            let mut wrt = Vec::new();
            let mut args = x.to_vec();
            for (k, tk) in t.iter().enumerate() {
                if let Some(tk) = tk {
                    wrt.push(fwd.input_name(fwd.inputs()[k]).to_string());
                    args.push(*tk);
                }
            }
            let names: Vec<&str> = wrt.iter().map(String::as_str).collect();
            let differentiated = crate::autodiff::jvp(fwd, &names)?;
            let outs = g.inline(&differentiated, &args)?;
            Ok(outs[1])
        }
    }
}

/// The tangent of input `k`, which the rule requires to be non-zero.
fn tangent(t: &[Option<ValueId>], k: usize, op: &Op) -> IrResult<ValueId> {
    t[k].ok_or_else(|| internal(op))
}

fn internal(op: &Op) -> IrError {
    IrError::Invalid(format!(
        "jvp reached `{}` without a tangent to propagate",
        op.name()
    ))
}

/// For an op bilinear in its two operands: op(da, b) + op(a, db).
fn bilinear(g: &mut Graph, op: &Op, x: &[ValueId], t: &[Option<ValueId>]) -> IrResult<ValueId> {
    let left = t[0].map(|ta| g.push(op.clone(), &[ta, x[1]])).transpose()?;
    let right = t[1].map(|tb| g.push(op.clone(), &[x[0], tb])).transpose()?;
    match (left, right) {
        (Some(l), Some(r)) => g.add(l, r),
        (Some(d), None) | (None, Some(d)) => Ok(d),
        (None, None) => Err(internal(op)),
    }
}

/// Tangent of an elementwise binary op, at the broadcast of the operand
/// shapes (the caller broadcasts it to the output shape).
fn binary_jvp(
    g: &mut Graph,
    op: BinaryOp,
    a: ValueId,
    b: ValueId,
    y: ValueId,
    ta: Option<ValueId>,
    tb: Option<ValueId>,
) -> IrResult<ValueId> {
    let zero_or = |g: &mut Graph, t: Option<ValueId>| match t {
        Some(t) => Ok(t),
        None => g.scalar(0.0),
    };
    match op {
        BinaryOp::Add => combine(g, ta, tb, false),
        BinaryOp::Sub => combine(g, ta, tb, true),
        BinaryOp::Mul => {
            let l = ta.map(|ta| g.mul(ta, b)).transpose()?;
            let r = tb.map(|tb| g.mul(a, tb)).transpose()?;
            combine(g, l, r, false)
        }
        // (ta − y·tb) / b
        BinaryOp::Div => {
            let r = tb.map(|tb| g.mul(y, tb)).transpose()?;
            let num = combine(g, ta, r, true)?;
            g.div(num, b)
        }
        // b·a^(b−1)·ta + y·ln(a)·tb
        BinaryOp::Pow => {
            let l = match ta {
                Some(ta) => {
                    let one = g.scalar(1.0)?;
                    let b1 = g.sub(b, one)?;
                    let p = g.binary(BinaryOp::Pow, a, b1)?;
                    let bp = g.mul(b, p)?;
                    Some(g.mul(ta, bp)?)
                }
                None => None,
            };
            let r = match tb {
                Some(tb) => {
                    let ln_a = g.log(a)?;
                    let y_ln_a = g.mul(y, ln_a)?;
                    Some(g.mul(tb, y_ln_a)?)
                }
                None => None,
            };
            combine(g, l, r, false)
        }
        // The same tie rule as the VJP: `a` wins ties.
        BinaryOp::Maximum | BinaryOp::Minimum => {
            let cmp = if op == BinaryOp::Maximum {
                BinaryOp::Ge
            } else {
                BinaryOp::Le
            };
            let a_wins = g.binary(cmp, a, b)?;
            let ta = zero_or(g, ta)?;
            let tb = zero_or(g, tb)?;
            g.select(a_wins, ta, tb)
        }
        _ => Err(IrError::Invalid(format!(
            "jvp of non-differentiable {op:?}"
        ))),
    }
}

/// l + r (or l − r), where a missing term is zero.
fn combine(
    g: &mut Graph,
    l: Option<ValueId>,
    r: Option<ValueId>,
    subtract: bool,
) -> IrResult<ValueId> {
    match (l, r) {
        (Some(l), Some(r)) if subtract => g.sub(l, r),
        (Some(l), Some(r)) => g.add(l, r),
        (Some(l), None) => Ok(l),
        (None, Some(r)) if subtract => g.neg(r),
        (None, Some(r)) => Ok(r),
        (None, None) => Err(IrError::Invalid(
            "jvp of a binary op without tangents".into(),
        )),
    }
}

/// Sum and Mean are linear; Max passes the tangents of the maximal
/// positions, averaged over ties (matching the VJP).
fn reduce_jvp(
    g: &mut Graph,
    kind: ReduceKind,
    axes: &[usize],
    keep_dims: bool,
    x: ValueId,
    y: ValueId,
    t: ValueId,
) -> IrResult<ValueId> {
    match kind {
        ReduceKind::Sum | ReduceKind::Mean => g.reduce(kind, t, axes, keep_dims),
        ReduceKind::Max => {
            let kept = keep_dims_shape(&g.ty(x).shape.clone(), axes);
            let y_kept = reshape_to(g, y, &kept)?;
            let is_max = mask(g, BinaryOp::Eq, x, y_kept)?;
            let picked = g.mul(is_max, t)?;
            let total = g.sum(picked, axes, keep_dims)?;
            let ties = g.sum(is_max, axes, keep_dims)?;
            g.div(total, ties)
        }
    }
}
