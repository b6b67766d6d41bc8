//! Dead-code elimination: drops every node no output depends on.

use crate::error::IrResult;
use crate::graph::Graph;
use crate::op::Op;

use super::rebuild::{Rebuild, ids};

/// Removes nodes not reachable from the outputs. Graph inputs are always
/// kept, used or not, because they are the graph's calling convention.
pub fn eliminate_dead_code(g: &Graph) -> IrResult<Graph> {
    Ok(eliminate_dead_code_counted(g)?.0)
}

/// As [`eliminate_dead_code`], also returning how many nodes were removed.
pub(crate) fn eliminate_dead_code_counted(g: &Graph) -> IrResult<(Graph, usize)> {
    let live = live_nodes(g);
    if live.iter().all(|&l| l) {
        return Ok((g.clone(), 0));
    }
    let mut rb = Rebuild::new(g, "dce");
    for id in ids(g).filter(|id| live[id.index()]) {
        rb.copy(id)?;
    }
    let out = rb.finish()?;
    let removed = g.len() - out.len();
    Ok((out, removed))
}

/// Liveness in one reverse sweep: the node order is topological, so every
/// reader of a node comes after it and is decided before it.
fn live_nodes(g: &Graph) -> Vec<bool> {
    let mut live = vec![false; g.len()];
    for &(_, v) in g.outputs() {
        live[v.index()] = true;
    }
    for (index, node) in g.nodes().iter().enumerate().rev() {
        if matches!(node.op, Op::Input { .. }) {
            live[index] = true;
        }
        if live[index] {
            for input in &node.inputs {
                live[input.index()] = true;
            }
        }
    }
    live
}
