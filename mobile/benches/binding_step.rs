//! The cost of the binding: training called from Python through UniFFI
//! against the same training called in Rust, measured in the same run,
//! alternating, the median of each taken.
//! - per step: `LocalTrainer.step_bytes` (the batch handed over on every
//!   call, borrowed as bytes) against `Trainer::step`;
//! - `fit`: `LocalTrainer.fit` over `.npy` files (the data crosses once,
//!   a Python progress listener at the default pace) against the engine's
//!   `fit` over the same files.
//!
//! `cargo bench -p canopy-mobile --bench binding_step` measures the
//! library the tests build (the release profile). To measure the library
//! as it ships, point `CANOPY_BINDING_LIBRARY` at the mobile profile's
//! (`cargo build --profile mobile -p canopy-mobile`, then
//! `target/mobile/libcanopy_mobile.so`).

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, ensure};
use std::ops::ControlFlow;

use canopy_engine::train::{FitConfig, Trainer, fit};
use canopy_engine::zoo::{Architecture, ModelConfig, build_model};
use canopy_engine::{CpuBackend, Value};

const LEARNING_RATE: f32 = 0.01;
/// Runs of each measurement, alternating; the median is reported.
const REPEATS: usize = 7;
/// Batches in one epoch of the `fit` measurement.
const FIT_BATCHES: usize = 40;

struct Workload {
    name: &'static str,
    architecture: Architecture,
    sample: Vec<usize>,
    batch: usize,
    /// Steps of the per-step measurement.
    steps: usize,
    /// Epochs of the `fit` measurement: about a second of training, so
    /// that loading the files and the scheduler's noise are a small part.
    fit_epochs: usize,
}

fn workloads() -> Vec<Workload> {
    vec![
        Workload {
            name: "MLP 784-128-10, batch 64",
            architecture: Architecture::Mlp {
                inputs: 784,
                hidden: 128,
                classes: 10,
            },
            sample: vec![784],
            batch: 64,
            steps: 1000,
            fit_epochs: 50,
        },
        Workload {
            name: "LeNet-5 28x28, batch 32",
            architecture: Architecture::LeNet5 { classes: 10 },
            sample: vec![1, 28, 28],
            batch: 32,
            steps: 200,
            fit_epochs: 6,
        },
    ]
}

/// `samples` samples of the workload's shape, deterministic.
fn samples(workload: &Workload, samples: usize) -> (Vec<f32>, Vec<i64>) {
    let per: usize = workload.sample.iter().product();
    let features = (0..samples * per)
        .map(|i| ((i * 31) % 97) as f32 / 97.0)
        .collect();
    let labels = (0..samples).map(|i| (i % 10) as i64).collect();
    (features, labels)
}

fn direct(
    model: &canopy_ir::Model,
    workload: &Workload,
    features: &[f32],
    labels: &[i64],
) -> Result<f64> {
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

/// The same steps through the binding's Rust side (`LocalTrainer`, the
/// bytes decoded on every call), without Python.
fn through_local_trainer(
    model: &[u8],
    workload: &Workload,
    features: &[f32],
    labels: &[i64],
) -> Result<f64> {
    let trainer = canopy_mobile::LocalTrainer::new(
        model.to_vec(),
        LEARNING_RATE,
        canopy_mobile::BackendPreference::Cpu,
        1,
    )?;
    let bytes: Vec<u8> = features.iter().flat_map(|v| v.to_le_bytes()).collect();
    let label_bytes: Vec<u8> = labels.iter().flat_map(|v| v.to_le_bytes()).collect();
    for _ in 0..workload.steps / 10 {
        trainer.step_bytes(&bytes, &label_bytes)?;
    }
    let start = Instant::now();
    for _ in 0..workload.steps {
        trainer.step_bytes(&bytes, &label_bytes)?;
    }
    Ok(start.elapsed().as_secs_f64() / workload.steps as f64)
}

fn through_python(
    mode: &str,
    site: &Path,
    files: &Path,
    workload: &Workload,
    steps: usize,
) -> Result<f64> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/binding_step.py");
    let output = Command::new("python3")
        .arg(&script)
        .arg(mode)
        .arg(files.join("model.canopy"))
        .arg(files.join("images.npy"))
        .arg(files.join("labels.npy"))
        .arg(LEARNING_RATE.to_string())
        .arg(workload.batch.to_string())
        .arg((steps / 10).to_string())
        .arg(steps.to_string())
        .env("PYTHONPATH", site)
        .env("GLIBC_TUNABLES", MALLOC_TUNABLES)
        .output()
        .context("cannot run python3")?;
    seconds_printed(output, "Python")
}

/// The seconds per step a measuring process printed, or its error.
fn seconds_printed(output: std::process::Output, side: &str) -> Result<f64> {
    ensure!(
        output.status.success(),
        "the {side} side failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(String::from_utf8(output.stdout)?.trim().parse()?)
}

/// One epoch of the engine's `fit` over the files, as `LocalTrainer.fit`
/// runs it, loading included.
fn direct_fit(model: &canopy_ir::Model, files: &Path, workload: &Workload) -> Result<f64> {
    let mut trainer = Trainer::new(model, &CpuBackend, 1)?;
    let load = || {
        canopy_engine::data::load_npy_dataset(files.join("images.npy"), files.join("labels.npy"))
    };
    let config = |epochs, seed| FitConfig::new(epochs, workload.batch, LEARNING_RATE, seed);
    fit(&mut trainer, &load()?, &config(1, 1), &mut |_| {
        ControlFlow::Continue(())
    })?;
    let start = Instant::now();
    let data = load()?;
    fit(
        &mut trainer,
        &data,
        &config(workload.fit_epochs as u32, 2),
        &mut |_| ControlFlow::Continue(()),
    )?;
    Ok(start.elapsed().as_secs_f64() / (FIT_BATCHES * workload.fit_epochs) as f64)
}

/// An `.npy` file (format 1.0) of `shape` and `descr`, little-endian.
fn write_npy(path: &Path, descr: &str, shape: &[usize], payload: &[u8]) -> Result<()> {
    let dims: Vec<String> = shape.iter().map(usize::to_string).collect();
    let mut header = format!(
        "{{'descr': '{descr}', 'fortran_order': False, 'shape': ({},), }}",
        dims.join(", ")
    );
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
    bytes.extend((header.len() as u16).to_le_bytes());
    bytes.extend(header.as_bytes());
    bytes.extend(payload);
    Ok(std::fs::write(path, bytes)?)
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

#[path = "../tests/common/mod.rs"]
#[allow(unused_imports)]
mod common;

/// glibc's malloc with fixed thresholds on both sides. By default it
/// adapts them to what the process has freed so far, so a fresh process
/// and a Python interpreter (whose heap its own objects have grown)
/// serve a step's large buffers differently, mapped anew or reused, by
/// up to 15 % of a LeNet-5 step: a difference of allocator state, not of
/// the binding.
const MALLOC_TUNABLES: &str =
    "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=134217728";

/// Set in a child process of this bench: which Rust measurement to run.
const CHILD: &str = "CANOPY_BENCH_CHILD";

/// Runs the Rust measurement `measure` of workload `index` in a fresh
/// process, as the Python side runs in one, so that both start from the
/// same process state (with [`MALLOC_TUNABLES`], the same allocator
/// state): only the binding differs.
fn in_child(measure: &str, index: usize, files: &Path) -> Result<f64> {
    let output = Command::new(std::env::current_exe()?)
        .env(CHILD, format!("{measure}:{index}:{}", files.display()))
        .env("GLIBC_TUNABLES", MALLOC_TUNABLES)
        .output()
        .context("cannot run the bench's child process")?;
    seconds_printed(output, "Rust")
}

/// The child's side of [`in_child`]: prints seconds per step.
fn child(spec: &str) -> Result<()> {
    let mut parts = spec.splitn(3, ':');
    let (Some(measure), Some(index), Some(files)) = (parts.next(), parts.next(), parts.next())
    else {
        anyhow::bail!("{CHILD} is `measure:index:files`, not `{spec}`");
    };
    let workload = workloads()
        .into_iter()
        .nth(index.parse()?)
        .context("no such workload")?;
    let files = Path::new(files);
    let model_bytes = std::fs::read(files.join("model.canopy"))?;
    let model = canopy_ir::format::read_model(&model_bytes)?;
    let (features, labels) = samples(&workload, workload.batch);
    let seconds = match measure {
        "step" => direct(&model, &workload, &features, &labels)?,
        "local" => through_local_trainer(&model_bytes, &workload, &features, &labels)?,
        "fit" => direct_fit(&model, files, &workload)?,
        other => anyhow::bail!("unknown measurement `{other}`"),
    };
    println!("{seconds}");
    Ok(())
}

fn main() -> Result<()> {
    if let Ok(spec) = std::env::var(CHILD) {
        return child(&spec);
    }
    let site = tempfile::tempdir()?;
    let package = site.path().join("canopy");
    // The bindings come from the library the tests built: a stripped
    // library (the mobile profile's) has no UniFFI metadata left to read.
    let built = common::cdylib()?;
    canopy_bindgen::generate(canopy_bindgen::Language::Python, &built, &package)?;
    let library = match std::env::var_os("CANOPY_BINDING_LIBRARY") {
        Some(path) => std::path::PathBuf::from(path),
        None => built.clone(),
    };
    // Under the name the bindings load.
    std::fs::copy(&library, package.join(built.file_name().context("name")?))?;
    std::fs::write(package.join("__init__.py"), "from .canopy import *\n")?;
    println!(
        "training through the Python binding vs direct Rust, CPU backend, each run in a fresh \
         process, alternating, median of {REPEATS} (ms per step); library: {}",
        library.display()
    );
    println!(
        "{:<26} {:>8} {:>12} {:>10} {:>8} | {:>9} {:>10} {:>8}",
        "workload", "Rust", "LocalTrainer", "Py step", "ratio", "Rust fit", "Py fit", "ratio"
    );
    for (index, workload) in workloads().into_iter().enumerate() {
        let model = build_model(&ModelConfig {
            architecture: workload.architecture.clone(),
            seed: 1,
            optimizer: canopy_engine::optim::Optimizer::parse("sgd")?,
            frozen_prefixes: Vec::new(),
            producer: "binding_step bench".to_string(),
        })?;
        let count = workload.batch * FIT_BATCHES;
        let (features, labels) = samples(&workload, count);
        let files = tempfile::tempdir()?;
        let model_bytes = canopy_ir::format::write_model(&model)?;
        std::fs::write(files.path().join("model.canopy"), &model_bytes)?;
        let mut shape = vec![count];
        shape.extend(&workload.sample);
        let feature_bytes: Vec<u8> = features.iter().flat_map(|v| v.to_le_bytes()).collect();
        write_npy(
            &files.path().join("images.npy"),
            "<f4",
            &shape,
            &feature_bytes,
        )?;
        let label_bytes: Vec<u8> = labels.iter().flat_map(|v| v.to_le_bytes()).collect();
        write_npy(
            &files.path().join("labels.npy"),
            "<i8",
            &[count],
            &label_bytes,
        )?;
        let files = files.path();
        let mut runs: [Vec<f64>; 5] = Default::default();
        for _ in 0..REPEATS {
            runs[0].push(in_child("step", index, files)?);
            runs[1].push(in_child("local", index, files)?);
            runs[2].push(through_python(
                "step",
                site.path(),
                files,
                &workload,
                workload.steps,
            )?);
            runs[3].push(in_child("fit", index, files)?);
            let fit_steps = FIT_BATCHES * workload.fit_epochs;
            runs[4].push(through_python(
                "fit",
                site.path(),
                files,
                &workload,
                fit_steps,
            )?);
        }
        let [rust, local, python, rust_fit, python_fit] = runs.map(median);
        println!(
            "{:<26} {:>8.3} {:>12.3} {:>10.3} {:>7.3}x | {:>9.3} {:>10.3} {:>7.3}x",
            workload.name,
            rust * 1e3,
            local * 1e3,
            python * 1e3,
            python / rust,
            rust_fit * 1e3,
            python_fit * 1e3,
            python_fit / rust_fit
        );
    }
    Ok(())
}
