//! A graph compiled for the device once: verified, custom gradients
//! inlined, every node checked against the kernels, constants uploaded,
//! and the bodies of its control-flow nodes compiled the same way. Plans
//! (one per batch size) are laid out from it.

use std::collections::BTreeMap;

use canopy_ir::{DType, Graph, Op};

use super::context::GpuContext;
use super::executable::to_bytes;
use super::kernels;
use crate::error::{EngineError, EngineResult};
use crate::value::Value;

pub struct Program {
    pub graph: Graph,
    /// Per constant node: its buffer.
    pub constants: BTreeMap<usize, wgpu::Buffer>,
    /// Per node: the graphs nested in it (`Op::subgraphs` order), compiled;
    /// empty for a node without any.
    pub bodies: Vec<Vec<Program>>,
}

impl Program {
    /// Compiles `graph` and the graphs nested in it. An op without a
    /// kernel, at any depth, refuses the whole graph with
    /// `EngineError::Unsupported` before anything reaches the device, so
    /// the caller can use the CPU. Adds the bytes uploaded to `uploaded`.
    pub fn new(context: &GpuContext, graph: &Graph, uploaded: &mut u64) -> EngineResult<Program> {
        let mut program = Program::checked(graph)?;
        program.upload(context, uploaded)?;
        Ok(program)
    }

    fn checked(graph: &Graph) -> EngineResult<Program> {
        canopy_ir::verify::verify(graph)?;
        // Each body is inlined on its own: the pass does not descend into
        // bodies.
        let graph = canopy_ir::passes::inline_custom_grads(graph)?;
        let mut bodies = Vec::with_capacity(graph.len());
        for (index, node) in graph.nodes().iter().enumerate() {
            let operands: Vec<DType> = node.inputs.iter().map(|id| graph.ty(*id).dtype).collect();
            kernels::check(&node.op, &operands, node.ty.dtype).map_err(|detail| {
                super::unsupported(format!("op `{}` (node %{index}): {detail}", node.op.name()))
            })?;
            let nested = node
                .op
                .subgraphs()
                .into_iter()
                .zip(roles(&node.op))
                .map(|(body, role)| {
                    Program::checked(body).map_err(|e| within(e, index, &node.op, role))
                })
                .collect::<EngineResult<Vec<_>>>()?;
            bodies.push(nested);
        }
        Ok(Program {
            graph,
            constants: BTreeMap::new(),
            bodies,
        })
    }

    fn upload(&mut self, context: &GpuContext, uploaded: &mut u64) -> EngineResult<()> {
        for (index, node) in self.graph.nodes().iter().enumerate() {
            if let Op::Constant(data) = &node.op {
                let bytes = to_bytes(&Value::from_data(data));
                let buffer =
                    context.storage_buffer(&format!("constant %{index}"), bytes.len() as u64)?;
                context.queue().write_buffer(&buffer, 0, &bytes);
                *uploaded += bytes.len() as u64;
                self.constants.insert(index, buffer);
            }
        }
        for body in self.bodies.iter_mut().flatten() {
            body.upload(context, uploaded)?;
        }
        Ok(())
    }
}

/// What each graph nested in a control-flow op is, in `Op::subgraphs`
/// order, for error messages.
pub fn roles(op: &Op) -> &'static [&'static str] {
    match op {
        Op::Scan(_) => &["body"],
        Op::Cond(_) => &["then branch", "else branch"],
        Op::WhileLoop(_) => &["condition", "body"],
        _ => &[],
    }
}

/// `error`, raised by the graph `role` of node `node`, said to come from
/// there; errors that name no place of their own pass unchanged.
pub fn within(error: EngineError, node: usize, op: &Op, role: &str) -> EngineError {
    let place = format!("in the {role} of node %{node} ({})", op.name());
    match error {
        EngineError::Unsupported { backend, what } => EngineError::Unsupported {
            backend,
            what: format!("{what}, {place}"),
        },
        EngineError::Gpu { what, cause } => EngineError::Gpu {
            what: format!("{what}, {place}"),
            cause,
        },
        EngineError::Internal(what) => EngineError::Internal(format!("{what}, {place}")),
        other => other,
    }
}
