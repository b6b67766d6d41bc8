//! The backend seam: a backend compiles a verified graph into an
//! executable. The IR never changes for a backend; a GPU (wgpu) or an
//! NPU-delegate backend implements these two traits and rejects ops it
//! does not support from `compile` with `EngineError::Unsupported`, so the
//! caller can fall back to the CPU, which runs every op.

use canopy_ir::Graph;

use crate::error::EngineResult;
use crate::value::Value;

pub trait Backend: Send + Sync {
    /// Short name, e.g. `cpu`.
    fn name(&self) -> &'static str;

    /// Compiles `graph` (already verified) into something that runs it.
    fn compile(&self, graph: &Graph) -> EngineResult<Box<dyn Executable>>;
}

/// A compiled graph. `run` takes the inputs in the graph's input order, by
/// value, so a backend may reuse their buffers (a training step updates
/// parameters in place this way), and returns the outputs in order.
pub trait Executable: Send {
    fn run(&mut self, inputs: Vec<Value>) -> EngineResult<Vec<Value>>;

    /// Names of the graph's inputs, in order.
    fn input_names(&self) -> &[String];

    /// Names of the graph's outputs, in order.
    fn output_names(&self) -> &[String];
}
