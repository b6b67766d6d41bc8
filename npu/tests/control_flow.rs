//! The engine's control-flow suite (engine/tests/control_flow.rs), included
//! as it is: each case its derivative checks cover (scans both ways and
//! over the batch, conds on either branch, a while loop its condition or
//! its bound ends, nesting both ways, checkpointed scans) has its forward
//! graph run in ONNX Runtime through the NPU backend, exported as ONNX's
//! Scan, If and Loop, and compared with the CPU backend's outputs
//! (`forward::check_forward`). Its other tests (unrolled equivalence,
//! node counts, errors, refusals) run as the engine's run does, on the CPU.

mod common;

#[path = "../../engine/tests/control_flow.rs"]
mod control_flow;
/// The suite's helpers again, for the comparison every backend's check
/// uses: the suite declares its copy private.
#[allow(clippy::duplicate_mod)]
#[path = "../../engine/tests/common/mod.rs"]
mod engine_common;
mod forward;

pub use forward::check_forward;
