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
pub mod error;
pub mod value;

pub use backend::{Backend, Executable};
pub use cpu::CpuBackend;
pub use error::{EngineError, EngineResult};
pub use value::Value;
