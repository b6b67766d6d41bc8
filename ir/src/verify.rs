//! The verifier: checks every structural invariant of a graph built from
//! raw parts (a file, a pass), naming the node, its op and the cause.

use std::collections::{HashMap, HashSet};

use crate::error::{IrError, IrResult, node_error};
use crate::graph::{Graph, MAX_NODES, Node, ValueId};
use crate::op::{CustomGrad, Op};
use crate::types::TensorType;

/// How deeply graphs may nest (custom gradients, loop bodies, branches);
/// bounds recursion on untrusted input.
pub const MAX_NESTING: usize = 8;

pub fn verify(graph: &Graph) -> IrResult<()> {
    verify_at_depth(graph, 0)
}

fn verify_at_depth(graph: &Graph, depth: usize) -> IrResult<()> {
    if depth > MAX_NESTING {
        return Err(IrError::LimitExceeded {
            what: "levels of nested graphs",
            limit: MAX_NESTING,
        });
    }
    if graph.len() > MAX_NODES {
        return Err(IrError::LimitExceeded {
            what: "nodes",
            limit: MAX_NODES,
        });
    }
    let mut input_nodes = Vec::new();
    // Each control-flow node's result types, derived once: re-deriving
    // them for every `output` would make a file of k results cost k².
    let mut results: HashMap<ValueId, Vec<TensorType>> = HashMap::new();
    for (index, node) in graph.nodes().iter().enumerate() {
        let id = ValueId(index as u32);
        let name = node.op.name();
        if let Some(&bad) = node.inputs.iter().find(|i| i.index() >= index) {
            return Err(node_error(
                id,
                name,
                format!("reads {bad}, which is not defined before it"),
            ));
        }
        if let Op::Input { .. } = node.op {
            if !node.inputs.is_empty() {
                return Err(node_error(id, name, "an input node cannot read values"));
            }
            input_nodes.push(id);
            continue;
        }
        verify_subgraphs(&node.op, depth).map_err(|e| node_error(id, name, e.to_string()))?;
        verify_tuple_reads(graph, node).map_err(|cause| node_error(id, name, cause))?;
        let inferred = infer_with(graph, id, node, &mut results)
            .map_err(|cause| node_error(id, name, cause))?;
        if inferred != node.ty {
            return Err(node_error(
                id,
                name,
                format!(
                    "declared type {} differs from inferred type {inferred}",
                    node.ty
                ),
            ));
        }
    }
    if input_nodes != graph.inputs() {
        return Err(IrError::Invalid(
            "graph inputs must list every input node once, in node order".into(),
        ));
    }
    let mut names = HashSet::new();
    for &input in graph.inputs() {
        let name = graph.input_name(input);
        if !names.insert(name) {
            return Err(IrError::DuplicateInput(name.to_string()));
        }
    }
    let mut names = HashSet::new();
    for (name, value) in graph.outputs() {
        if value.index() >= graph.len() {
            return Err(IrError::DanglingOutput {
                name: name.clone(),
                value: value.index(),
            });
        }
        if !names.insert(name.as_str()) {
            return Err(IrError::DuplicateOutput(name.clone()));
        }
        if graph.node(*value).op.is_tuple() {
            return Err(IrError::Invalid(format!(
                "graph output `{name}` is the tuple {value}; it must be one of its `output` nodes"
            )));
        }
    }
    Ok(())
}

/// The type of `node`, reading an `output`'s from `results` and recording
/// a control-flow node's there.
fn infer_with(
    graph: &Graph,
    id: ValueId,
    node: &Node,
    results: &mut HashMap<ValueId, Vec<TensorType>>,
) -> Result<TensorType, String> {
    if let Op::Output { index } = node.op {
        let tuple = node.inputs[0];
        let types = results
            .get(&tuple)
            .ok_or_else(|| format!("reads {tuple}, which is not a control-flow node"))?;
        return types
            .get(index)
            .cloned()
            .ok_or_else(|| format!("reads result {index} of {tuple}, which has {}", types.len()));
    }
    if node.op.is_tuple() {
        let types: Vec<&TensorType> = node.inputs.iter().map(|&i| graph.ty(i)).collect();
        let arity = node
            .op
            .arity()
            .expect("control-flow ops have a fixed arity");
        if types.len() != arity {
            return Err(format!("expects {arity} inputs, got {}", types.len()));
        }
        let found = node
            .op
            .results(&types)
            .expect("a control-flow op has results")?;
        let first = found[0].clone();
        results.insert(id, found);
        return Ok(first);
    }
    graph.infer(&node.op, &node.inputs)
}

/// Verifies the graphs nested in `op` one level deeper.
fn verify_subgraphs(op: &Op, depth: usize) -> IrResult<()> {
    if let Op::CustomGrad(custom) = op {
        return verify_custom(custom, depth);
    }
    for graph in op.subgraphs() {
        verify_at_depth(graph, depth + 1)?;
    }
    Ok(())
}

/// A control-flow node's value is a tuple: `output` nodes, and only they,
/// read it.
fn verify_tuple_reads(graph: &Graph, node: &Node) -> Result<(), String> {
    let is_output = matches!(node.op, Op::Output { .. });
    for &input in &node.inputs {
        let tuple = graph.node(input).op.is_tuple();
        if tuple && !is_output {
            return Err(format!(
                "reads the tuple {input}; only an `output` node may read a control-flow node"
            ));
        }
        if is_output && !tuple {
            return Err(format!("reads {input}, which is not a control-flow node"));
        }
    }
    Ok(())
}

/// A custom rule's backward graph takes (inputs…, y, dy) and returns one
/// gradient per input, each of that input's type.
fn verify_custom(custom: &CustomGrad, depth: usize) -> IrResult<()> {
    verify_at_depth(&custom.forward, depth + 1)?;
    verify_at_depth(&custom.backward, depth + 1)?;
    let fwd = &custom.forward;
    let bwd = &custom.backward;
    let [(_, out)] = fwd.outputs() else {
        return Err(IrError::Invalid(format!(
            "custom gradient `{}`: forward must have one output",
            custom.name
        )));
    };
    let n = fwd.inputs().len();
    let mut expected: Vec<_> = fwd.inputs().iter().map(|&i| fwd.ty(i).clone()).collect();
    expected.push(fwd.ty(*out).clone());
    expected.push(fwd.ty(*out).clone());
    let got: Vec<_> = bwd.inputs().iter().map(|&i| bwd.ty(i).clone()).collect();
    if got != expected {
        return Err(IrError::Invalid(format!(
            "custom gradient `{}`: backward must take (inputs…, y, dy) typed {expected:?}, takes {got:?}",
            custom.name
        )));
    }
    let grads: Vec<_> = bwd
        .outputs()
        .iter()
        .map(|(_, v)| bwd.ty(*v).clone())
        .collect();
    if grads.len() != n || grads.iter().zip(&expected).any(|(g, e)| g != e) {
        return Err(IrError::Invalid(format!(
            "custom gradient `{}`: backward must return one gradient per input, typed like it",
            custom.name
        )));
    }
    Ok(())
}
