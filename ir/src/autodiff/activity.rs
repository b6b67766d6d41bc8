//! Activity analysis: which primal nodes carry derivatives.
//!
//! A node is *varying* when it depends on a `wrt` input through
//! differentiable edges, and *useful* when it leads to a differentiated
//! output through them. Only nodes that are both get derivative nodes, so a
//! frozen backbone (not in `wrt`) costs nothing in the backward pass.

use crate::graph::{Graph, ValueId};
use crate::op::{Op, UnaryOp};
use crate::types::DType;

/// Whether a derivative flows from input `k` of node `id` to its output.
///
/// Only f32 values carry derivatives. Beyond that, an edge is cut where the
/// op is piecewise constant in that operand: `Sign`, and the pooling
/// selections in their first operand (`x` only picks positions).
pub fn differentiable_edge(graph: &Graph, id: ValueId, k: usize) -> bool {
    let node = graph.node(id);
    let input = node.inputs[k];
    // A tuple's `ty` is only its result 0: an f32 operand of a control-flow
    // node may reach any f32 result, and an `output` carries what it reads.
    if node.op.is_tuple() {
        return graph.ty(input).dtype == DType::F32;
    }
    if let Op::Output { .. } = node.op {
        return node.ty.dtype == DType::F32;
    }
    if node.ty.dtype != DType::F32 || graph.ty(input).dtype != DType::F32 {
        return false;
    }
    match &node.op {
        Op::Unary(UnaryOp::Sign) => false,
        Op::MaxPool2dSelect(_) | Op::MaxPool2dBackward(_) => k == 1,
        Op::OneHot { .. } | Op::RandomUniform { .. } | Op::ArgMax { .. } => false,
        _ => true,
    }
}

/// Nodes among the first `n` that depend on `sources`.
pub fn varying(graph: &Graph, n: usize, sources: &[ValueId]) -> Vec<bool> {
    let mut varies = vec![false; n];
    for &s in sources {
        varies[s.index()] = true;
    }
    for (i, node) in graph.nodes()[..n].iter().enumerate() {
        let id = ValueId(i as u32);
        let from_input = node
            .inputs
            .iter()
            .enumerate()
            .any(|(k, x)| varies[x.index()] && differentiable_edge(graph, id, k));
        varies[i] |= from_input;
    }
    varies
}

/// Nodes among the first `n` that lead to `targets`.
pub fn useful(graph: &Graph, n: usize, targets: impl IntoIterator<Item = ValueId>) -> Vec<bool> {
    let mut useful = vec![false; n];
    for t in targets {
        useful[t.index()] = true;
    }
    for i in (0..n).rev() {
        if !useful[i] {
            continue;
        }
        let id = ValueId(i as u32);
        for (k, x) in graph.node(id).inputs.iter().enumerate() {
            if differentiable_edge(graph, id, k) {
                useful[x.index()] = true;
            }
        }
    }
    useful
}

/// Varying and useful: the nodes that get derivative nodes.
pub fn active(
    graph: &Graph,
    n: usize,
    sources: &[ValueId],
    targets: impl IntoIterator<Item = ValueId>,
) -> Vec<bool> {
    let varies = varying(graph, n, sources);
    let useful = useful(graph, n, targets);
    varies.iter().zip(&useful).map(|(&v, &u)| v && u).collect()
}
