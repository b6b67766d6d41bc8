//! What the CPU's fusion buys: the training step time of the zoo's MLP
//! (784-128-10, batch 64), LeNet-5 (batch 64) and a GRU charlm (hidden
//! 256, sequence 80, batch 32), fused against unfused, in one process,
//! interleaved round by round (each round in a new order), with medians
//! compared. Also prints each step's node count before and after fusion.
//!
//! `cargo bench -p canopy-engine --bench fusion [-- --rounds 5]`

use std::time::Instant;

use anyhow::{Context, Result};
use canopy_engine::Value;
use canopy_engine::cpu::{CpuBackendWithFusion, fusion_report};
use canopy_engine::optim::Optimizer;
use canopy_engine::recurrent::Cell;
use canopy_engine::train::Trainer;
use canopy_engine::zoo::{Architecture, ModelConfig, build_model};
use canopy_ir::Model;

struct Workload {
    name: &'static str,
    model: Model,
    x: Value,
    y: Value,
    steps: usize,
}

fn model(architecture: Architecture) -> Result<Model> {
    Ok(build_model(&ModelConfig {
        architecture,
        seed: 0,
        optimizer: Optimizer::sgd(),
        frozen_prefixes: Vec::new(),
        producer: "fusion bench".into(),
    })?)
}

/// Deterministic values in -1..1.
fn pattern(len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| (i * 37 % 101) as f32 / 50.0 - 1.0)
        .collect()
}

fn workloads() -> Result<Vec<Workload>> {
    let labels = |n: usize, classes: usize| -> Result<Value> {
        Ok(Value::i64(
            &[n],
            (0..n).map(|i| (i * 7 % classes) as i64).collect(),
        )?)
    };
    let characters: Vec<f32> = (0..32 * 80).map(|i| (i * 31 % 77) as f32).collect();
    Ok(vec![
        Workload {
            name: "mlp 784-128-10, batch 64",
            model: model(Architecture::Mlp {
                inputs: 784,
                hidden: 128,
                classes: 10,
            })?,
            x: Value::f32(&[64, 784], pattern(64 * 784))?,
            y: labels(64, 10)?,
            steps: 400,
        },
        Workload {
            name: "lenet5, batch 64",
            model: model(Architecture::LeNet5 { classes: 10 })?,
            x: Value::f32(&[64, 1, 28, 28], pattern(64 * 784))?,
            y: labels(64, 10)?,
            steps: 30,
        },
        Workload {
            name: "charlm gru256, sequence 80, batch 32",
            model: model(Architecture::CharLm {
                vocabulary: 77,
                sequence: 80,
                embedding: 8,
                hidden: 256,
                layers: 1,
                cell: Cell::Gru,
                unrolled: false,
            })?,
            x: Value::f32(&[32, 80], characters)?,
            y: labels(32, 77)?,
            steps: 8,
        },
    ])
}

/// Seconds per training step over `w.steps` steps, after 2 warm-up steps.
fn step_seconds(w: &Workload, fuse: bool) -> Result<f64> {
    let mut trainer = Trainer::new(&w.model, &CpuBackendWithFusion { fuse }, 0)?;
    for _ in 0..2 {
        trainer.step(w.x.clone(), w.y.clone(), 0.01)?;
    }
    let started = Instant::now();
    for _ in 0..w.steps {
        trainer.step(w.x.clone(), w.y.clone(), 0.01)?;
    }
    Ok(started.elapsed().as_secs_f64() / w.steps as f64)
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let rounds: usize = match args.iter().position(|a| a == "--rounds") {
        Some(at) => args.get(at + 1).context("--rounds N")?.parse()?,
        None => 5,
    };
    println!("CPU training steps, fused vs unfused, median of {rounds} interleaved rounds");
    for w in workloads()? {
        let report = fusion_report(w.model.entry("train_step")?)?;
        let (mut fused, mut plain) = (Vec::new(), Vec::new());
        for round in 0..rounds {
            for fuse in [round % 2 == 0, round % 2 == 1] {
                let seconds = step_seconds(&w, fuse)?;
                if fuse { &mut fused } else { &mut plain }.push(seconds);
            }
        }
        let (fused, plain) = (median(fused), median(plain));
        println!(
            "{:<40} unfused {:>9.1} µs  fused {:>9.1} µs  {:.2}x  ({} nodes, {} after fusion)",
            w.name,
            1e6 * plain,
            1e6 * fused,
            plain / fused,
            report.nodes,
            report.after_fusion
        );
    }
    Ok(())
}
