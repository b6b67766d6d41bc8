//! `canopy model import` and `canopy model run` against ONNX Runtime on
//! scikit-learn models: a LogisticRegression (with and without a
//! StandardScaler) and an MLPClassifier trained on the bundled digits and
//! exported by skl2onnx, with and without ZipMap
//! (`tests/reference/sklearn_models.py`, `requirements-dev.txt`). On 100
//! held-out digits, `canopy model run` of each imported file gives ONNX
//! Runtime's probabilities (to 1e-4) and exactly its labels, on the CPU
//! and on the GPU backend; the classifier weights import as parameters.

mod common;

use std::path::Path;

use anyhow::{Context, Result, ensure};
use common::{canopy, reference_script};
use ndarray::ArrayD;
use ndarray_npy::NpzReader;
use serde_json::Value as Json;

const CLASSES: usize = 10;
const HELD_OUT: usize = 100;

/// One exported model and ONNX Runtime's outputs for the held-out digits.
struct Reference {
    name: String,
    label_output: String,
    probability_output: String,
    labels: Vec<i64>,
    probabilities: Vec<f32>,
}

fn text(model: &Json, key: &str) -> Result<String> {
    model[key]
        .as_str()
        .map(str::to_string)
        .with_context(|| format!("`{key}` in the reference"))
}

fn references(dir: &Path) -> Result<(Vec<Reference>, Vec<String>)> {
    reference_script("sklearn_models.py", dir)?;
    let json: Json = serde_json::from_slice(&std::fs::read(dir.join("sklearn.json"))?)?;
    let models = json["models"].as_array().context("`models`")?;
    let mut ops = Vec::new();
    let mut references = Vec::with_capacity(models.len());
    for model in models {
        let numbers = |key: &str| -> Result<Vec<f64>> {
            model[key]
                .as_array()
                .with_context(|| format!("`{key}` in the reference"))?
                .iter()
                .map(|v| v.as_f64().context("a number"))
                .collect()
        };
        ops.extend(
            model["ops"]
                .as_array()
                .context("`ops`")?
                .iter()
                .filter_map(|op| op.as_str().map(str::to_string)),
        );
        references.push(Reference {
            name: text(model, "name")?,
            label_output: text(model, "label_output")?,
            probability_output: text(model, "probability_output")?,
            labels: numbers("labels")?.iter().map(|&v| v as i64).collect(),
            probabilities: numbers("probabilities")?
                .iter()
                .map(|&v| v as f32)
                .collect(),
        });
    }
    Ok((references, ops))
}

/// `canopy model import`s `NAME.onnx` and returns its summary line.
fn import(dir: &Path, name: &str) -> Result<String> {
    let onnx = dir.join(format!("{name}.onnx"));
    let model = dir.join(format!("{name}.canopy"));
    let out = canopy(&[
        "model",
        "import",
        onnx.to_str().context("path")?,
        "-o",
        model.to_str().context("path")?,
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    ensure!(
        out.status.success(),
        "{name}: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(stdout)
}

/// `canopy model run` on the held-out digits: the labels and probabilities.
fn run(dir: &Path, reference: &Reference, backend: &str) -> Result<(Vec<i64>, Vec<f32>)> {
    let model = dir.join(format!("{}.canopy", reference.name));
    let npz = dir.join(format!("{}-{backend}.npz", reference.name));
    let input = format!("X={}", dir.join("inputs.npy").display());
    let out = canopy(&[
        "model",
        "run",
        model.to_str().context("path")?,
        "--input",
        &input,
        "-o",
        npz.to_str().context("path")?,
        "--backend",
        backend,
    ]);
    ensure!(
        out.status.success(),
        "{} on {backend}: {}",
        reference.name,
        String::from_utf8_lossy(&out.stderr)
    );
    let mut reader = NpzReader::new(std::fs::File::open(&npz)?)?;
    let labels: ArrayD<i64> = reader.by_name(&reference.label_output)?;
    let probabilities: ArrayD<f32> = reader.by_name(&reference.probability_output)?;
    ensure!(labels.shape() == [HELD_OUT], "labels {:?}", labels.shape());
    ensure!(
        probabilities.shape() == [HELD_OUT, CLASSES],
        "probabilities {:?}",
        probabilities.shape()
    );
    Ok((
        labels.iter().copied().collect(),
        probabilities.iter().copied().collect(),
    ))
}

#[test]
fn imported_sklearn_models_match_onnx_runtime_on_every_backend() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (references, ops) = references(dir.path())?;
    // The exporter still writes the ops this test is about.
    for op in [
        "LinearClassifier",
        "Normalizer",
        "Scaler",
        "ZipMap",
        "ArrayFeatureExtractor",
        "ArgMax",
    ] {
        ensure!(ops.iter().any(|o| o == op), "no {op} in {ops:?}");
    }
    // LinearClassifier's 10 × 64 coefficients and 10 intercepts; the MLP's
    // two layers (64 × 32 + 32, 32 × 10 + 10).
    let parameters = [
        ("logreg", "2 parameters (650 elements)"),
        ("logreg_scaled", "2 parameters (650 elements)"),
        ("mlp", "4 parameters (2410 elements)"),
        ("mlp_zipmap", "4 parameters (2410 elements)"),
    ];
    ensure!(references.len() == parameters.len());
    for (reference, (name, summary)) in references.iter().zip(parameters) {
        ensure!(reference.name == name, "{} is not {name}", reference.name);
        let stdout = import(dir.path(), name)?;
        ensure!(stdout.contains(summary), "{name}: {stdout}");
        for backend in ["cpu", "gpu"] {
            let (labels, probabilities) = run(dir.path(), reference, backend)?;
            let worst = probabilities
                .iter()
                .zip(&reference.probabilities)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            eprintln!("{name} on {backend}: probabilities within {worst:e} of ONNX Runtime");
            ensure!(
                worst <= 1e-4,
                "{name} on {backend}: probabilities differ from ONNX Runtime by {worst}"
            );
            ensure!(labels == reference.labels, "{name} on {backend}: labels");
        }
    }
    Ok(())
}
