//! `canopy-engine`: the runtime half of Canopy's engine.
//!
//! Runtime values ([`Value`]), the [`Backend`] seam and the CPU backend
//! ([`cpu`]), eager tensors and graph-mode tracing, layers, losses,
//! optimizers expressed in IR, and data loading.
//!
//! Architecture invariant: the engine executes graphs but never invents
//! their meaning; op semantics are defined once in `canopy-ir` and every
//! backend conforms to the same suite.

pub mod backend;
pub mod cpu;
pub mod data;
pub mod error;
pub mod fold;
pub mod function;
pub mod fuse;
#[cfg(feature = "gpu")]
pub mod gpu;
#[cfg(not(feature = "gpu"))]
#[path = "gpu_absent.rs"]
pub mod gpu;
pub mod nn;
pub mod optim;
pub mod proximal;
pub mod recurrent;
pub mod select;
pub mod split;
pub mod stats;
pub mod tensor;
pub mod train;
pub mod value;
pub mod zoo;

pub use backend::{Backend, Executable};
pub use cpu::CpuBackend;
pub use error::{EngineError, EngineResult};
pub use function::Function;
pub use gpu::GpuBackend;
pub use tensor::{Mode, Tensor, mode, set_mode, trace};
pub use value::Value;

/// The standard optimisation pipeline, with constant folding on the CPU
/// kernels.
pub fn optimize_graph(graph: &canopy_ir::Graph) -> EngineResult<canopy_ir::Graph> {
    Ok(canopy_ir::passes::optimize(
        graph,
        Some(&fold::CpuConstEvaluator),
    )?)
}
