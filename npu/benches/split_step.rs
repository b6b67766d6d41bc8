//! What split execution costs or saves on a transfer-learning step,
//! measured in one run: LeNet-5 with its convolutional backbone and fc1
//! frozen, one SGD step of the head on MNIST batches, with the backbone's
//! forward pass in ONNX Runtime (CPU execution provider) and the rest on
//! the CPU backend, against the whole step on the CPU backend. Also the
//! backbone's forward pass alone on each.
//!
//! `cargo bench -p canopy-npu --bench split_step [-- --quick] [--batch N]`
//!
//! Start-up (library load, export, session creation, compilation) is left
//! out. Each configuration runs in alternating blocks, so drift of the
//! machine's load hits both; the figures are medians of per-step times.

#[path = "../tests/common/mod.rs"]
mod common;

use std::path::Path;
use std::time::Instant;

use anyhow::{Result, bail};
use canopy_engine::data::{Batch, load_dir};
use canopy_engine::split::split_train_step;
use canopy_engine::train::Trainer;
use canopy_engine::{Backend, CpuBackend, Executable};

const LEARNING_RATE: f32 = 0.01;

struct Args {
    batch: usize,
    /// Alternating blocks per configuration, and steps per block.
    blocks: usize,
    steps: usize,
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        batch: 64,
        blocks: 5,
        steps: 20,
    };
    let mut raw = std::env::args().skip(1);
    while let Some(arg) = raw.next() {
        match arg.as_str() {
            "--quick" => (args.blocks, args.steps) = (2, 5),
            "--batch" => {
                args.batch = raw.next().unwrap_or_default().parse()?;
                if args.batch == 0 {
                    bail!("--batch must be at least 1");
                }
            }
            // `cargo bench` passes `--bench`.
            "--bench" => {}
            other => bail!("unknown argument `{other}` (expected --quick or --batch N)"),
        }
    }
    Ok(args)
}

/// Seconds per call of `run` over `steps` calls, one entry per call.
fn time_block(steps: usize, mut run: impl FnMut(usize) -> Result<()>) -> Result<Vec<f64>> {
    let mut times = Vec::with_capacity(steps);
    for step in 0..steps {
        let start = Instant::now();
        run(step)?;
        times.push(start.elapsed().as_secs_f64());
    }
    Ok(times)
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn main() -> Result<()> {
    let args = parse_args()?;
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../datasets/mnist-10k");
    let data = load_dir(&dir)?.0;
    let batches: Vec<Batch> = data.batches(args.batch, Some(1), true)?.collect();
    let model = common::frozen_lenet(&data)?;
    let ort = common::cpu_backend();

    let mut split = Trainer::split(&model, &ort, &CpuBackend, 1)?;
    let mut all_cpu = Trainer::new(&model, &CpuBackend, 1)?;
    let backbone = split_train_step(&model)?
        .expect("LeNet-5 with conv and fc1 frozen has a backbone")
        .backbone;
    let mut backbone_ort = ort.compile(&backbone)?;
    let mut backbone_cpu = CpuBackend.compile(&backbone)?;

    let batch = |i: usize| &batches[i % batches.len()];
    let train = |trainer: &mut Trainer, i: usize| -> Result<()> {
        let b = batch(i);
        trainer.step(b.x.clone(), b.y.clone(), LEARNING_RATE)?;
        Ok(())
    };
    let forward = |exe: &mut Box<dyn Executable>, i: usize| -> Result<()> {
        exe.run(vec![batch(i).x.clone()])?;
        Ok(())
    };
    // Warm-up: the first runs allocate.
    for i in 0..3 {
        train(&mut split, i)?;
        train(&mut all_cpu, i)?;
        forward(&mut backbone_ort, i)?;
        forward(&mut backbone_cpu, i)?;
    }
    let (mut split_t, mut cpu_t, mut ort_f, mut cpu_f) = (vec![], vec![], vec![], vec![]);
    for _ in 0..args.blocks {
        split_t.extend(time_block(args.steps, |i| train(&mut split, i))?);
        cpu_t.extend(time_block(args.steps, |i| train(&mut all_cpu, i))?);
        ort_f.extend(time_block(args.steps, |i| forward(&mut backbone_ort, i))?);
        cpu_f.extend(time_block(args.steps, |i| forward(&mut backbone_cpu, i))?);
    }
    let ms = |v: Vec<f64>| 1e3 * median(v);
    let (split_ms, cpu_ms) = (ms(split_t), ms(cpu_t));
    let (ort_ms, cpu_forward_ms) = (ms(ort_f), ms(cpu_f));
    println!(
        "LeNet-5 transfer step (conv*, fc1 frozen), batch {}, ONNX Runtime {} CPU EP, {} steps each",
        args.batch,
        ort.runtime_version(),
        args.blocks * args.steps
    );
    println!("  step, backbone in ORT + head on CPU: {split_ms:8.3} ms");
    println!("  step, all on the CPU backend:        {cpu_ms:8.3} ms");
    println!(
        "  split / all-CPU:                     {:8.3}",
        split_ms / cpu_ms
    );
    println!("  backbone forward alone, ORT:         {ort_ms:8.3} ms");
    println!("  backbone forward alone, CPU backend: {cpu_forward_ms:8.3} ms");
    println!(
        "  ORT / CPU backend (forward):         {:8.3}",
        ort_ms / cpu_forward_ms
    );
    println!(
        "  sessions created: {}, session runs: {}",
        ort.sessions_created(),
        ort.runs()
    );
    Ok(())
}
