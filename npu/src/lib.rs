//! `canopy-npu`: the NPU backend. A graph (a whole entry point, or the
//! frozen backbone of a training step, see `canopy_engine::split`) is
//! exported to ONNX in memory with `canopy_onnx::export_graph` and run as
//! one ONNX Runtime session on the execution providers a configuration
//! lists in order of preference ([`Provider`]: NNAPI, Core ML, QNN, CANN,
//! TensorRT, CUDA, CPU).
//!
//! ONNX Runtime is loaded at run time from a shared library
//! ([`OrtConfig::library`], else `ORT_DYLIB_PATH`), once per process; a
//! missing or unloadable library is an [`NpuError`], never a panic.
//! Providers the loaded build lacks, or cannot start, are logged and
//! listed by [`OrtBackend::missing_providers`], and skipped.
//!
//! Architecture invariant: this crate adds no op semantics. Export lowers
//! each IR op by its definition in `canopy-ir`, ONNX Runtime computes it,
//! and the engine's conformance suites check the forward results against
//! the CPU backend (`tests/conformance.rs`).

pub mod backend;
pub mod config;
pub mod error;
pub mod runtime;

pub use backend::{BACKEND_NAME, MissingProvider, OrtBackend, OrtExecutable};
pub use config::{OrtConfig, Provider};
pub use error::NpuError;
