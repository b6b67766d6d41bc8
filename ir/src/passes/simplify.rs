//! Algebraic simplification: local rewrites that are exact in IEEE
//! arithmetic and never change a value's type.
//!
//! Deliberately absent: `x * 0 → 0` (wrong for NaN and ±inf) and
//! `exp(log(x)) → x` (wrong for x ≤ 0). Rewrites may leave nodes unused;
//! dead-code elimination removes them.

use crate::error::IrResult;
use crate::graph::{Graph, ValueId};
use crate::op::{BinaryOp, Op, ReduceKind, UnaryOp};
use crate::types::{Dim, TensorType};

use super::rebuild::{Rebuild, ids};

/// Sweeps until no rule fires; each sweep nearly always reaches the
/// fixpoint already, since operands are simplified before their readers.
const MAX_SWEEPS: usize = 8;
/// Rules applied to one node in a row (e.g. a reshape chain collapsing and
/// then turning out to be the identity).
const MAX_REWRITES_PER_NODE: usize = 8;

/// What a rule turns a node into.
enum Rewrite {
    /// The node's value is this existing (new-graph) value.
    Forward(ValueId),
    /// The node becomes another op over new-graph values.
    Replace(Op, Vec<ValueId>),
}

/// Applies the simplification rules until none fires (bounded).
pub fn simplify(g: &Graph) -> IrResult<Graph> {
    Ok(simplify_counted(g)?.0)
}

/// As [`simplify`], also returning how many rewrites were applied.
pub(crate) fn simplify_counted(g: &Graph) -> IrResult<(Graph, usize)> {
    let mut current = g.clone();
    let mut total = 0;
    for _ in 0..MAX_SWEEPS {
        let (next, fired) = sweep(&current)?;
        if fired == 0 {
            break;
        }
        current = next;
        total += fired;
    }
    Ok((current, total))
}

fn sweep(g: &Graph) -> IrResult<(Graph, usize)> {
    let mut rb = Rebuild::new(g, "simplify");
    let mut fired = 0;
    for id in ids(g) {
        let node = g.node(id);
        if matches!(node.op, Op::Input { .. }) {
            rb.copy_input(id)?;
            continue;
        }
        let mut op = node.op.clone();
        let mut inputs = rb.operands(id)?;
        let mut forwarded = None;
        for _ in 0..MAX_REWRITES_PER_NODE {
            match rewrite(&rb.out, &op, &inputs, &node.ty) {
                None => break,
                Some(Rewrite::Forward(x)) => {
                    forwarded = Some(x);
                    fired += 1;
                    break;
                }
                Some(Rewrite::Replace(new_op, new_inputs)) => {
                    (op, inputs) = (new_op, new_inputs);
                    fired += 1;
                }
            }
        }
        match forwarded {
            Some(x) => rb.bind(id, x)?,
            None => {
                rb.emit(id, op, &inputs)?;
            }
        }
    }
    Ok((rb.finish()?, fired))
}

/// The first rule that applies to `op(inputs)` of type `ty`, if any.
fn rewrite(g: &Graph, op: &Op, inputs: &[ValueId], ty: &TensorType) -> Option<Rewrite> {
    let x = *inputs.first()?;
    let same_type = |v: ValueId| (g.ty(v) == ty).then_some(Rewrite::Forward(v));
    match op {
        Op::Binary(b) => binary_identity(g, *b, inputs[0], inputs[1], ty).map(Rewrite::Forward),
        Op::Unary(UnaryOp::Neg) => match g.node(x).op {
            Op::Unary(UnaryOp::Neg) => same_type(g.node(x).inputs[0]),
            _ => None,
        },
        Op::Transpose { perm } => transpose(g, x, perm, ty),
        Op::Reshape { shape } if g.ty(x).shape.0 == *shape => same_type(x),
        Op::Reshape { shape } => match g.node(x).op {
            Op::Reshape { .. } => Some(Rewrite::Replace(
                Op::Reshape {
                    shape: shape.clone(),
                },
                vec![g.node(x).inputs[0]],
            )),
            _ => None,
        },
        Op::Broadcast { shape } if g.ty(x).shape.0 == *shape => same_type(x),
        Op::Cast { to } if g.ty(x).dtype == *to => same_type(x),
        Op::Reduce { kind, axes, .. } if axes.is_empty() && is_plain_reduce(*kind) => same_type(x),
        Op::MatMul {
            transpose_a,
            transpose_b,
        } => absorb_transpose(g, inputs, [*transpose_a, *transpose_b]),
        Op::Slice { axis, start, end } => {
            let full = *start == 0 && g.ty(x).shape.0.get(*axis) == Some(&Dim::Fixed(*end));
            full.then(|| same_type(x)).flatten()
        }
        Op::Pad { before, after, .. } if *before == 0 && *after == 0 => same_type(x),
        Op::Concat { .. } if inputs.len() == 1 => same_type(x),
        _ => None,
    }
}

/// Reductions over no axes are the identity.
fn is_plain_reduce(kind: ReduceKind) -> bool {
    matches!(kind, ReduceKind::Sum | ReduceKind::Mean | ReduceKind::Max)
}

/// x+0, 0+x, x-0, x*1, 1*x, x/1 → x, provided the constant does not
/// broadcast x to a different type.
fn binary_identity(
    g: &Graph,
    op: BinaryOp,
    a: ValueId,
    b: ValueId,
    ty: &TensorType,
) -> Option<ValueId> {
    let keep = |v: ValueId, cond: bool| (cond && g.ty(v) == ty).then_some(v);
    match op {
        BinaryOp::Add => keep(a, is_all(g, b, 0.0)).or_else(|| keep(b, is_all(g, a, 0.0))),
        BinaryOp::Sub => keep(a, is_all(g, b, 0.0)),
        BinaryOp::Mul => keep(a, is_all(g, b, 1.0)).or_else(|| keep(b, is_all(g, a, 1.0))),
        BinaryOp::Div => keep(a, is_all(g, b, 1.0)),
        _ => None,
    }
}

/// Whether `v` is a constant whose every element equals `want` exactly.
/// For zero this accepts -0.0 too: x + (±0) is x for every x but -0.0,
/// which differs from the result only in the sign of zero.
fn is_all(g: &Graph, v: ValueId, want: f64) -> bool {
    use crate::data::Buffer;
    let Op::Constant(data) = &g.node(v).op else {
        return false;
    };
    match &data.buffer {
        Buffer::F32(xs) => xs.iter().all(|&x| f64::from(x) == want),
        Buffer::I64(xs) => xs.iter().all(|&x| x as f64 == want),
        Buffer::I32(xs) => xs.iter().all(|&x| f64::from(x) == want),
        Buffer::Bool(_) => false,
    }
}

/// transpose(x, identity) → x; transpose(transpose(y, p), q) → one
/// transpose of y with perm p∘q (or y itself when that is the identity).
fn transpose(g: &Graph, x: ValueId, perm: &[usize], ty: &TensorType) -> Option<Rewrite> {
    if is_identity(perm) {
        return (g.ty(x) == ty).then_some(Rewrite::Forward(x));
    }
    let Op::Transpose { perm: inner } = &g.node(x).op else {
        return None;
    };
    // out[i] = x[perm[i]] = y[inner[perm[i]]].
    let composed: Vec<usize> = perm.iter().map(|&p| inner[p]).collect();
    Some(Rewrite::Replace(
        Op::Transpose { perm: composed },
        vec![g.node(x).inputs[0]],
    ))
}

fn is_identity(perm: &[usize]) -> bool {
    perm.iter().enumerate().all(|(i, &p)| i == p)
}

/// Whether `perm` swaps the last two axes and keeps the others.
fn swaps_last_two(perm: &[usize]) -> bool {
    let r = perm.len();
    r >= 2 && perm[r - 2] == r - 1 && perm[r - 1] == r - 2 && is_identity(&perm[..r - 2])
}

/// matmul(transpose(a), b) → matmul with transpose_a toggled, and likewise
/// for b: the flag does the same swap without materialising it.
fn absorb_transpose(g: &Graph, inputs: &[ValueId], flags: [bool; 2]) -> Option<Rewrite> {
    for side in 0..2 {
        let node = g.node(inputs[side]);
        let Op::Transpose { perm } = &node.op else {
            continue;
        };
        if !swaps_last_two(perm) {
            continue;
        }
        let mut new_inputs = inputs.to_vec();
        new_inputs[side] = node.inputs[0];
        let mut new_flags = flags;
        new_flags[side] = !new_flags[side];
        let op = Op::MatMul {
            transpose_a: new_flags[0],
            transpose_b: new_flags[1],
        };
        return Some(Rewrite::Replace(op, new_inputs));
    }
    None
}
