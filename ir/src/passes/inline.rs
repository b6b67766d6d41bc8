//! Inlining of custom-gradient calls: once a graph has been differentiated
//! the custom rules have done their job, and backends only see plain ops.

use crate::error::IrResult;
use crate::graph::{Graph, ValueId};
use crate::op::Op;

/// Replaces every `CustomGrad` node by its forward graph, recursively and
/// in loop bodies and branches too.
pub fn inline_custom_grads(graph: &Graph) -> IrResult<Graph> {
    if !has_custom_grad(graph) {
        return Ok(graph.clone());
    }
    let mut out = Graph::new();
    let mut map: Vec<ValueId> = Vec::with_capacity(graph.len());
    for node in graph.nodes() {
        let inputs: Vec<ValueId> = node.inputs.iter().map(|i| map[i.index()]).collect();
        let id = match &node.op {
            Op::Input { name } => out.input(name.clone(), node.ty.clone())?,
            Op::CustomGrad(custom) => {
                let forward = inline_custom_grads(&custom.forward)?;
                out.inline(&forward, &inputs)?[0]
            }
            op => out.push(op.map_control_bodies(inline_custom_grads)?, &inputs)?,
        };
        map.push(id);
    }
    let outputs = graph
        .outputs()
        .iter()
        .map(|(name, v)| (name.clone(), map[v.index()]))
        .collect();
    out.set_outputs(outputs)?;
    Ok(out)
}

/// Whether `graph`, its loop bodies or its branches hold a custom gradient.
pub fn has_custom_grad(graph: &Graph) -> bool {
    graph.nodes().iter().any(|node| match &node.op {
        Op::CustomGrad(_) => true,
        op => op.subgraphs().into_iter().any(has_custom_grad),
    })
}
