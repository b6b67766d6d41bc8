//! The forward check the engine's suites call, under
//! `cfg(canopy_forward_backend)` (npu/build.rs), for each case in place of
//! their derivative checks (engine/tests/common/mod.rs): the case's graph
//! run in ONNX Runtime (CPU execution provider) through the NPU backend,
//! compared with the CPU backend's outputs (`|ort − cpu| ≤ 1e-4·|cpu| +
//! 1e-5·max(1, max|cpu|)`). Shared by every suite this crate includes.
//!
//! Export refuses a few ops by design (ONNX has no form for them:
//! canopy's random generator and training-only adjoints); a case built on
//! one of those must be refused with that op named, and any other refusal
//! fails.

use std::sync::OnceLock;

use canopy_engine::{Backend, CpuBackend, EngineError, Value};
use canopy_ir::Graph;
use canopy_npu::OrtBackend;
use canopy_onnx::export::NOT_EXPORTED_OPS as NOT_EXPORTED;

use crate::engine_common::assert_close_across_backends;

fn ort() -> &'static OrtBackend {
    static ORT: OnceLock<OrtBackend> = OnceLock::new();
    ORT.get_or_init(crate::common::cpu_backend)
}

/// Called by the suites' `check_vjp_jvp_with` for each case.
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
