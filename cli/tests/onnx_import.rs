//! `canopy model import` and `canopy model run` against ONNX Runtime: a
//! small CNN written with `onnx.helper` (Conv, Relu, MaxPool,
//! GlobalAveragePool, Flatten, Gemm, Softmax) is generated and run by ONNX
//! Runtime in Python (`tests/reference/onnx_cnn.py`,
//! `requirements-dev.txt`); `canopy model run` of the imported file gives
//! the same probabilities on 100 inputs (to 1e-4) and the same labels, on
//! the CPU and on the GPU backend. An input of the wrong dtype gets an
//! error that names it; broken ONNX files are in `onnx_errors.rs`.

mod common;

use std::path::Path;

use anyhow::Result;
use common::{canopy, reference_script};
use ndarray::ArrayD;
use ndarray_npy::NpzReader;

/// Runs the reference script into `dir`: `cnn.onnx` and `cnn.json`.
fn generate(dir: &Path) -> Result<serde_json::Value> {
    reference_script("onnx_cnn.py", dir)?;
    Ok(serde_json::from_slice(&std::fs::read(
        dir.join("cnn.json"),
    )?)?)
}

fn floats(json: &serde_json::Value, key: &str) -> Vec<f32> {
    json[key]
        .as_array()
        .unwrap_or_else(|| panic!("`{key}` in the reference"))
        .iter()
        .map(|v| v.as_f64().unwrap() as f32)
        .collect()
}

fn argmax_rows(probabilities: &[f32], classes: usize) -> Vec<usize> {
    probabilities
        .chunks(classes)
        .map(|row| (0..classes).fold(0, |b, j| if row[j] > row[b] { j } else { b }))
        .collect()
}

#[test]
fn an_imported_cnn_matches_onnx_runtime_on_every_backend() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let reference = generate(dir.path())?;
    let model = dir.path().join("cnn.canopy");
    let onnx = dir.path().join("cnn.onnx");
    let out = canopy(&[
        "model",
        "import",
        onnx.to_str().unwrap(),
        "-o",
        model.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("6 parameters (297 elements)"), "{stdout}");

    let want = floats(&reference, "probabilities");
    let want_labels: Vec<usize> = reference["labels"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as usize)
        .collect();
    let input = format!("x={}", dir.path().join("inputs.npy").display());
    for backend in ["cpu", "gpu"] {
        let npz = dir.path().join(format!("out-{backend}.npz"));
        let out = canopy(&[
            "model",
            "run",
            model.to_str().unwrap(),
            "--input",
            &input,
            "-o",
            npz.to_str().unwrap(),
            "--backend",
            backend,
        ]);
        assert!(
            out.status.success(),
            "{backend}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let mut reader = NpzReader::new(std::fs::File::open(&npz)?)?;
        let probabilities: ArrayD<f32> = reader.by_name("probabilities")?;
        assert_eq!(probabilities.shape(), &[100, 5], "{backend}");
        let got: Vec<f32> = probabilities.iter().copied().collect();
        let worst = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(
            worst <= 1e-4,
            "{backend}: probabilities differ from ONNX Runtime by {worst}"
        );
        assert_eq!(argmax_rows(&got, 5), want_labels, "{backend}: labels");
    }

    // An input of another dtype is refused by name, with the fix.
    let wrong = format!("x={}", dir.path().join("inputs_f64.npy").display());
    let npz = dir.path().join("wrong.npz");
    let out = canopy(&[
        "model",
        "run",
        model.to_str().unwrap(),
        "--input",
        &wrong,
        "-o",
        npz.to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && !npz.exists(), "{stderr}");
    assert!(
        stderr.contains("input `x`") && stderr.contains("`<f8`") && stderr.contains("astype"),
        "{stderr}"
    );
    Ok(())
}
