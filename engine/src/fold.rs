//! The engine's side of constant folding: `canopy-ir` decides what to fold
//! but does no arithmetic itself, so the CPU backend supplies it.

use canopy_ir::passes::ConstEvaluator;
use canopy_ir::{Graph, Op, TensorData, TensorType};

use crate::backend::Executable;
use crate::cpu::CpuExecutable;
use crate::value::Value;

/// Evaluates one op on constant operands with the CPU kernels, so folded
/// values are bit-for-bit what the CPU backend would compute at run time.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuConstEvaluator;

impl ConstEvaluator for CpuConstEvaluator {
    fn eval(&self, op: &Op, inputs: &[&TensorData], out_ty: &TensorType) -> Option<TensorData> {
        let graph = one_node_graph(op, inputs)?;
        if graph.ty(graph.outputs()[0].1) != out_ty {
            return None;
        }
        let mut exe = CpuExecutable::new(&graph).ok()?;
        let args = inputs.iter().map(|d| Value::from_data(d)).collect();
        let outputs = exe.run(args).ok()?;
        let data = outputs.into_iter().next()?.to_data();
        (data.tensor_type() == *out_ty).then_some(data)
    }
}

/// `op` applied to one graph input per operand. Operands are inputs, not
/// constants, so their data is copied once (into a `Value`), not twice.
fn one_node_graph(op: &Op, inputs: &[&TensorData]) -> Option<Graph> {
    let mut g = Graph::new();
    let args = inputs
        .iter()
        .enumerate()
        .map(|(i, d)| g.input(format!("in{i}"), d.tensor_type()))
        .collect::<Result<Vec<_>, _>>()
        .ok()?;
    let y = g.push(op.clone(), &args).ok()?;
    g.set_output("y", y).ok()?;
    Some(g)
}
