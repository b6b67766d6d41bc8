//! Inlining of custom-gradient calls: once a graph has been differentiated
//! the custom rules have done their job, and backends only see plain ops.

use crate::error::IrResult;
use crate::graph::{Graph, ValueId};
use crate::op::Op;

/// Replaces every `CustomGrad` node by its forward graph (recursively).
pub fn inline_custom_grads(graph: &Graph) -> IrResult<Graph> {
    if !graph
        .nodes()
        .iter()
        .any(|n| matches!(n.op, Op::CustomGrad(_)))
    {
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
            op => out.push(op.clone(), &inputs)?,
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
