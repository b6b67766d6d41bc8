//! The engine's conformance suite (engine/tests/conformance.rs), included
//! as it is, with every case's forward graph run in ONNX Runtime (CPU
//! execution provider) through the NPU backend and compared with the CPU
//! backend's outputs (`|ort − cpu| ≤ 1e-4·|cpu| + 1e-5·max(1, max|cpu|)`).
//! The cases are the suite's own, so an op it gains is checked here too.
//!
//! Export refuses a few ops by design (ONNX has no form for them:
//! canopy's random generator and training-only adjoints); a case built on
//! one of those must be refused with that op named, and any other refusal
//! fails.

mod common;

#[path = "../../engine/tests/conformance.rs"]
mod conformance;
/// The suite's helpers again, for the comparison every backend's check
/// uses: the suite declares its copy private.
#[allow(clippy::duplicate_mod)]
#[path = "../../engine/tests/common/mod.rs"]
mod engine_common;

use std::sync::OnceLock;

use canopy_engine::{Backend, CpuBackend, EngineError, Value};
use canopy_ir::Graph;
use canopy_npu::OrtBackend;
use engine_common::assert_close_across_backends;

use canopy_onnx::export::NOT_EXPORTED_OPS as NOT_EXPORTED;

fn ort() -> &'static OrtBackend {
    static ORT: OnceLock<OrtBackend> = OnceLock::new();
    ORT.get_or_init(common::cpu_backend)
}

/// Called by the suite's `check_vjp_jvp_with` for each case.
pub fn check_forward(graph: &Graph, inputs: &[Value]) {
    let want = CpuBackend
        .compile(graph)
        .and_then(|mut cpu| cpu.run(inputs.to_vec()))
        .unwrap_or_else(|e| panic!("the CPU backend failed: {e}\n{graph:#?}"));
    let mut executable = match ort().compile(graph) {
        Ok(executable) => executable,
        Err(EngineError::Unsupported { what, .. }) => {
            let ops = graph.op_counts();
            assert!(
                NOT_EXPORTED
                    .iter()
                    .any(|op| ops.contains_key(op) && what.contains(op)),
                "export refused a graph of {ops:?}: {what}"
            );
            return;
        }
        Err(e) => panic!("ONNX Runtime refused the graph: {e:?}\n{graph:#?}"),
    };
    let got = executable
        .run(inputs.to_vec())
        .unwrap_or_else(|e| panic!("ONNX Runtime failed: {e:?}\n{graph:#?}"));
    assert_eq!(got.len(), want.len(), "output count");
    for ((name, _), (want, got)) in graph.outputs().iter().zip(want.iter().zip(&got)) {
        assert_close_across_backends(name, want, got);
    }
}
