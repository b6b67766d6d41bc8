//! A local dead-code sweep, so transforms hand back graphs without the
//! derivative nodes that turned out unneeded (rules compute a contribution
//! for every operand; only active ones are used).

use crate::error::IrResult;
use crate::graph::{Graph, Node, ValueId};
use crate::op::Op;

/// Drops every node that no output reads; graph inputs are always kept,
/// since they are the graph's calling convention.
pub fn sweep(graph: &Graph) -> IrResult<Graph> {
    let mut live = vec![false; graph.len()];
    for (_, v) in graph.outputs() {
        live[v.index()] = true;
    }
    for &input in graph.inputs() {
        live[input.index()] = true;
    }
    for i in (0..graph.len()).rev() {
        if live[i] {
            for x in &graph.nodes()[i].inputs {
                live[x.index()] = true;
            }
        }
    }
    let mut map = vec![ValueId(u32::MAX); graph.len()];
    let mut nodes = Vec::new();
    let mut inputs = Vec::new();
    for (i, node) in graph.nodes().iter().enumerate() {
        if !live[i] {
            continue;
        }
        let id = ValueId(nodes.len() as u32);
        map[i] = id;
        if let Op::Input { .. } = node.op {
            inputs.push(id);
        }
        nodes.push(Node {
            op: node.op.clone(),
            inputs: node.inputs.iter().map(|x| map[x.index()]).collect(),
            ty: node.ty.clone(),
        });
    }
    let outputs = graph
        .outputs()
        .iter()
        .map(|(name, v)| (name.clone(), map[v.index()]))
        .collect();
    Graph::from_parts(nodes, inputs, outputs)
}
