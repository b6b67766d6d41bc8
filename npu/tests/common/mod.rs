//! The ONNX Runtime library the tests load: `ORT_DYLIB_PATH`, else the one
//! in the `onnxruntime` wheel (requirements-dev.txt), found by asking
//! python3. Not finding one fails the test: the NPU backend is tested for
//! real or the run is red.

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;

use canopy_npu::{OrtBackend, OrtConfig, Provider};

const INSTALL_HINT: &str = "hint: pip install -r requirements-dev.txt (it installs onnxruntime), \
     or set ORT_DYLIB_PATH to an ONNX Runtime shared library";

/// The library under test.
pub fn ort_library() -> PathBuf {
    if let Some(path) = std::env::var_os("ORT_DYLIB_PATH").filter(|p| !p.is_empty()) {
        return PathBuf::from(path);
    }
    let script = "import onnxruntime, pathlib; \
                  capi = pathlib.Path(onnxruntime.__file__).parent / 'capi'; \
                  print(next(p for p in capi.iterdir() \
                             if p.name.startswith('libonnxruntime.') or p.name == 'onnxruntime.dll'))";
    let output = Command::new("python3")
        .args(["-c", script])
        .output()
        .unwrap_or_else(|e| panic!("cannot run python3 to find ONNX Runtime: {e}\n{INSTALL_HINT}"));
    assert!(
        output.status.success(),
        "python3 found no ONNX Runtime library: {}\n{INSTALL_HINT}",
        String::from_utf8_lossy(&output.stderr).trim()
    );
    PathBuf::from(String::from_utf8_lossy(&output.stdout).trim())
}

/// A configuration for the library under test on these providers.
pub fn config(providers: &[Provider]) -> OrtConfig {
    OrtConfig {
        library: Some(ort_library()),
        providers: providers.to_vec(),
    }
}

/// The backend on ONNX Runtime's CPU execution provider, as CI runs it.
pub fn cpu_backend() -> OrtBackend {
    OrtBackend::open(&config(&[Provider::Cpu]))
        .unwrap_or_else(|e| panic!("cannot open the NPU backend: {e}\n{INSTALL_HINT}"))
}

/// LeNet-5 with `conv*` and `fc1` frozen (the head is fc2 and fc3), its
/// input statistics fitted on `train`: the transfer-learning model of the
/// split tests and the split bench.
pub fn frozen_lenet(train: &canopy_engine::data::Dataset) -> anyhow::Result<canopy_ir::Model> {
    use canopy_engine::optim::Optimizer;
    use canopy_engine::zoo::{
        Architecture, ModelConfig, build_model, fit_input_stats, rebuild_train_step, set_frozen,
    };
    let mut model = build_model(&ModelConfig {
        architecture: Architecture::LeNet5 { classes: 10 },
        seed: 5,
        optimizer: Optimizer::parse("sgd")?,
        frozen_prefixes: Vec::new(),
        producer: "canopy-npu tests".to_string(),
    })?;
    fit_input_stats(&mut model, train)?;
    set_frozen(&mut model, &["conv".to_string(), "fc1".to_string()])?;
    rebuild_train_step(&mut model, &Optimizer::parse("sgd")?)?;
    Ok(model)
}
