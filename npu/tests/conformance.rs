//! The engine's conformance suite (engine/tests/conformance.rs), included
//! as it is, with every case's forward graph run in ONNX Runtime through
//! the NPU backend and compared with the CPU backend's outputs
//! (`forward::check_forward`). The cases are the suite's own, so an op it
//! gains is checked here too.

mod common;

#[path = "../../engine/tests/conformance.rs"]
mod conformance;
/// The suite's helpers again, for the comparison every backend's check
/// uses: the suite declares its copy private.
#[allow(clippy::duplicate_mod)]
#[path = "../../engine/tests/common/mod.rs"]
mod engine_common;
mod forward;

pub use forward::check_forward;
