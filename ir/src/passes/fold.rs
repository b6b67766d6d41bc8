//! Constant folding. This crate does no execution (architecture
//! invariant), so the arithmetic is delegated to a [`ConstEvaluator`] that
//! the engine supplies.

use crate::data::TensorData;
use crate::error::IrResult;
use crate::graph::{Graph, ValueId};
use crate::op::Op;
use crate::types::TensorType;

use super::rebuild::{Rebuild, ids};

/// Computes one op on concrete operands.
pub trait ConstEvaluator {
    /// `op` applied to `inputs`, whose result must have type `out_ty`;
    /// `None` when the evaluator cannot (or would rather not) compute it.
    fn eval(&self, op: &Op, inputs: &[&TensorData], out_ty: &TensorType) -> Option<TensorData>;
}

/// Replaces every node whose operands are all constants by a constant.
///
/// A node is folded only when its type has no batch dimension (its size is
/// unknown until run time) and has at most `max_elements` elements, so that
/// folding a broadcast or a one-hot never bloats the model. Folding runs in
/// one forward sweep, so whole constant chains fold at once; the operands
/// left unused are removed by dead-code elimination.
pub fn fold_constants(
    g: &Graph,
    evaluator: &dyn ConstEvaluator,
    max_elements: usize,
) -> IrResult<Graph> {
    Ok(fold_constants_counted(g, evaluator, max_elements)?.0)
}

/// As [`fold_constants`], also returning how many nodes were folded.
pub(crate) fn fold_constants_counted(
    g: &Graph,
    evaluator: &dyn ConstEvaluator,
    max_elements: usize,
) -> IrResult<(Graph, usize)> {
    let mut rb = Rebuild::new(g, "fold");
    let mut folded = 0;
    for id in ids(g) {
        match try_fold(&rb, id, evaluator, max_elements)? {
            Some(data) => {
                rb.emit(id, Op::Constant(Box::new(data)), &[])?;
                folded += 1;
            }
            None => {
                rb.copy(id)?;
            }
        }
    }
    Ok((rb.finish()?, folded))
}

/// The folded value of old node `id`, when it can and may be folded.
fn try_fold(
    rb: &Rebuild<'_>,
    id: ValueId,
    evaluator: &dyn ConstEvaluator,
    max_elements: usize,
) -> IrResult<Option<TensorData>> {
    let node = rb.src.node(id);
    // A control-flow node is a tuple: it is never one constant (a loop
    // over constants stays a loop; its results are not folded either).
    let tuple = node.op.is_tuple() || matches!(node.op, Op::Output { .. });
    if tuple || matches!(node.op, Op::Input { .. } | Op::Constant(_)) || node.inputs.is_empty() {
        return Ok(None);
    }
    match node.ty.shape.num_elements() {
        Some(n) if n <= max_elements => {}
        _ => return Ok(None),
    }
    let operands = rb.operands(id)?;
    let Some(datas) = constant_operands(&rb.out, &operands) else {
        return Ok(None);
    };
    Ok(evaluator
        .eval(&node.op, &datas, &node.ty)
        .filter(|data| fits(data, &node.ty)))
}

/// The operands' contents when every operand is a constant node.
fn constant_operands<'g>(g: &'g Graph, operands: &[ValueId]) -> Option<Vec<&'g TensorData>> {
    operands
        .iter()
        .map(|&v| match &g.node(v).op {
            Op::Constant(data) => Some(data.as_ref()),
            _ => None,
        })
        .collect()
}

/// Guards against a faulty evaluator: a folded constant must have exactly
/// the node's type, or the rewritten graph would not verify.
fn fits(data: &TensorData, ty: &TensorType) -> bool {
    data.tensor_type() == *ty && ty.shape.num_elements() == Some(data.num_elements())
}
