//! Common-subexpression elimination by hash-consing in one forward sweep.

use std::collections::HashMap;
use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};

use crate::data::{Buffer, TensorData};
use crate::error::IrResult;
use crate::graph::{Graph, ValueId};
use crate::op::Op;

use super::rebuild::{Rebuild, ids};

/// Merges nodes with the same op, attributes and (already merged) operands.
/// Constants compare bitwise, so identical NaN constants merge but NaNs
/// with different payloads do not. Graph inputs never merge.
pub fn eliminate_common_subexpressions(g: &Graph) -> IrResult<Graph> {
    Ok(eliminate_common_subexpressions_counted(g)?.0)
}

/// As [`eliminate_common_subexpressions`], also returning how many nodes
/// were merged into an earlier equal one.
pub(crate) fn eliminate_common_subexpressions_counted(g: &Graph) -> IrResult<(Graph, usize)> {
    let mut rb = Rebuild::new(g, "cse");
    // Hash → new values with that hash; collisions are resolved by a full
    // comparison, so a bucket is almost always a single value.
    let mut seen: HashMap<u64, Vec<ValueId>> = HashMap::new();
    let mut merged = 0;
    for id in ids(g) {
        let node = g.node(id);
        if !node.op.is_pure() {
            rb.copy_input(id)?;
            continue;
        }
        let inputs = rb.operands(id)?;
        let key = node_hash(&node.op, &inputs);
        let bucket = seen.entry(key).or_default();
        let twin = bucket.iter().copied().find(|&c| {
            let cand = rb.out.node(c);
            cand.inputs == inputs && ops_equal(&cand.op, &node.op)
        });
        match twin {
            Some(existing) => {
                rb.bind(id, existing)?;
                merged += 1;
            }
            None => bucket.push(rb.emit(id, node.op.clone(), &inputs)?),
        }
    }
    Ok((rb.finish()?, merged))
}

/// Op equality for merging: bitwise for constants, never for inputs.
fn ops_equal(a: &Op, b: &Op) -> bool {
    match (a, b) {
        (Op::Constant(x), Op::Constant(y)) => x.bit_eq(y),
        (Op::Input { .. }, _) | (_, Op::Input { .. }) => false,
        _ => a == b,
    }
}

fn node_hash(op: &Op, inputs: &[ValueId]) -> u64 {
    let mut h = DefaultHasher::new();
    std::mem::discriminant(op).hash(&mut h);
    match op {
        Op::Constant(data) => hash_data(data, &mut h),
        // Hashing whole subgraphs is wasteful; equality settles collisions.
        Op::CustomGrad(custom) => custom.name.hash(&mut h),
        Op::Scan(scan) => (scan.carries, scan.scanned, scan.body.len()).hash(&mut h),
        Op::Cond(cond) => (cond.then_branch.len(), cond.else_branch.len()).hash(&mut h),
        Op::WhileLoop(w) => (w.carries, w.max_trips, w.body.len()).hash(&mut h),
        // Every other op's attributes are small integers, flags and dims,
        // all rendered faithfully by Debug, so new ops need no new code here.
        other => format!("{other:?}").hash(&mut h),
    }
    inputs.hash(&mut h);
    h.finish()
}

/// Hashes a constant by its bits, consistently with `TensorData::bit_eq`.
fn hash_data(data: &TensorData, h: &mut DefaultHasher) {
    data.shape.hash(h);
    data.dtype().hash(h);
    match &data.buffer {
        Buffer::F32(v) => v.iter().for_each(|x| x.to_bits().hash(h)),
        Buffer::I64(v) => v.hash(h),
        Buffer::I32(v) => v.hash(h),
        Buffer::Bool(v) => v.hash(h),
    }
}
