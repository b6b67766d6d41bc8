//! The cost of the binding: one training step called from Python through
//! UniFFI (`LocalTrainer.step_bytes`, the batch copied across on every
//! call) against the same step called in Rust (`Trainer::step`), measured
//! in the same run, alternating, the median of each taken.
//!
//! `cargo bench -p canopy-mobile --bench binding_step`

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, ensure};
use canopy_engine::train::Trainer;
use canopy_engine::zoo::{Architecture, ModelConfig, build_model};
use canopy_engine::{CpuBackend, Value};

const LEARNING_RATE: f32 = 0.01;
const REPEATS: usize = 3;

struct Workload {
    name: &'static str,
    architecture: Architecture,
    sample: Vec<usize>,
    batch: usize,
    steps: usize,
}

fn workloads() -> Vec<Workload> {
    vec![
        Workload {
            name: "MLP 784-128-10, batch 64",
            architecture: Architecture::Mlp { inputs: 784, hidden: 128, classes: 10 },
            sample: vec![784],
            batch: 64,
            steps: 400,
        },
        Workload {
            name: "LeNet-5 28x28, batch 32",
            architecture: Architecture::LeNet5 { classes: 10 },
            sample: vec![1, 28, 28],
            batch: 32,
            steps: 40,
        },
    ]
}

fn batch(workload: &Workload) -> (Vec<f32>, Vec<i64>) {
    let per: usize = workload.sample.iter().product();
    let features = (0..workload.batch * per).map(|i| ((i * 31) % 97) as f32 / 97.0).collect();
    let labels = (0..workload.batch).map(|i| (i % 10) as i64).collect();
    (features, labels)
}

fn direct(model: &canopy_ir::Model, workload: &Workload, features: &[f32], labels: &[i64]) -> Result<f64> {
    let mut trainer = Trainer::new(model, &CpuBackend, 1)?;
    let mut shape = vec![workload.batch];
    shape.extend(&workload.sample);
    let mut step = || -> Result<()> {
        let x = Value::f32(&shape, features.to_vec())?;
        let y = Value::i64(&[workload.batch], labels.to_vec())?;
        trainer.step(x, y, LEARNING_RATE)?;
        Ok(())
    };
    for _ in 0..workload.steps / 10 {
        step()?;
    }
    let start = Instant::now();
    for _ in 0..workload.steps {
        step()?;
    }
    Ok(start.elapsed().as_secs_f64() / workload.steps as f64)
}

fn through_python(site: &Path, files: &Path, workload: &Workload) -> Result<f64> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/binding_step.py");
    let output = Command::new("python3")
        .arg(&script)
        .arg(files.join("model.canopy"))
        .arg(files.join("features.bin"))
        .arg(files.join("labels.bin"))
        .arg(LEARNING_RATE.to_string())
        .arg((workload.steps / 10).to_string())
        .arg(workload.steps.to_string())
        .env("PYTHONPATH", site)
        .output()
        .context("cannot run python3")?;
    ensure!(
        output.status.success(),
        "the Python side failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(String::from_utf8(output.stdout)?.trim().parse()?)
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

#[path = "../tests/common/mod.rs"]
#[allow(dead_code, unused_imports)]
mod common;

fn main() -> Result<()> {
    let site = tempfile::tempdir()?;
    let package = site.path().join("canopy");
    common::bindings(canopy_bindgen::Language::Python, &package)?;
    let library = common::cdylib()?;
    std::fs::copy(&library, package.join(library.file_name().context("name")?))?;
    std::fs::write(package.join("__init__.py"), "from .canopy import *\n")?;
    println!("one training step: through the Python binding vs direct Rust, CPU backend, same run");
    println!("{:<28} {:>12} {:>12} {:>8}", "workload", "Rust ms", "Python ms", "ratio");
    for workload in workloads() {
        let model = build_model(&ModelConfig {
            architecture: workload.architecture.clone(),
            seed: 1,
            optimizer: canopy_engine::optim::Optimizer::parse("sgd")?,
            frozen_prefixes: Vec::new(),
            producer: "binding_step bench".to_string(),
        })?;
        let (features, labels) = batch(&workload);
        let files = tempfile::tempdir()?;
        std::fs::write(files.path().join("model.canopy"), canopy_ir::format::write_model(&model)?)?;
        let feature_bytes: Vec<u8> = features.iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(files.path().join("features.bin"), feature_bytes)?;
        let label_bytes: Vec<u8> = labels.iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(files.path().join("labels.bin"), label_bytes)?;
        let (mut rust, mut python) = (Vec::new(), Vec::new());
        for _ in 0..REPEATS {
            rust.push(direct(&model, &workload, &features, &labels)?);
            python.push(through_python(site.path(), files.path(), &workload)?);
        }
        let (rust, python) = (median(rust), median(python));
        println!(
            "{:<28} {:>12.3} {:>12.3} {:>7.3}x",
            workload.name,
            rust * 1e3,
            python * 1e3,
            python / rust
        );
    }
    Ok(())
}
