//! Split execution for transfer learning: LeNet-5 with its convolutional
//! backbone and first dense layer frozen trains its head for 20 SGD steps
//! on MNIST with the backbone's forward pass in ONNX Runtime (CPU
//! execution provider) and the head, its gradient and the update on the
//! CPU backend. The parameters must match an all-CPU run's, and the
//! backbone must really have run in ONNX Runtime.

mod common;

use std::path::Path;

use anyhow::{Result, ensure};
use canopy_engine::data::{Dataset, load_dir};
use canopy_engine::optim::Optimizer;
use canopy_engine::split::{CUT_PREFIX, split_train_step};
use canopy_engine::train::Trainer;
use canopy_engine::zoo::{Architecture, ModelConfig, build_model, rebuild_train_step};
use canopy_engine::{Backend, CpuBackend};
use canopy_ir::Model;
use canopy_ir::model::{ENTRY_TRAIN_STEP, PARAM_PREFIX};

const STEPS: usize = 20;
const BATCH: usize = 32;
const LEARNING_RATE: f32 = 0.05;

fn mnist() -> Result<Dataset> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../datasets/mnist-10k");
    Ok(load_dir(dir)?.0)
}

/// Runs `STEPS` steps over the same batches and returns the trained model.
fn train(mut trainer: Trainer, mut model: Model, data: &Dataset) -> Result<Model> {
    for batch in data.batches(BATCH, Some(7), true)?.take(STEPS) {
        trainer.step(batch.x, batch.y, LEARNING_RATE)?;
    }
    ensure!(
        trainer.steps() == STEPS as u64,
        "ran {} steps",
        trainer.steps()
    );
    trainer.write_back(&mut model)?;
    Ok(model)
}

#[test]
fn the_backbone_runs_in_onnx_runtime_and_the_head_trains_as_on_the_cpu() -> Result<()> {
    backbone_in_ort_matches_all_cpu(&CpuBackend)
}

/// The head on the GPU backend (lavapipe in CI), as a device with a GPU
/// and an NPU would split it; `CANOPY_TEST_BACKENDS=cpu` leaves it out,
/// as it does every GPU suite.
#[test]
fn the_head_trains_on_the_gpu_as_on_the_cpu() -> Result<()> {
    if std::env::var("CANOPY_TEST_BACKENDS").as_deref() == Ok("cpu") {
        return Ok(());
    }
    let gpu = canopy_engine::select::shared_gpu().map_err(|e| {
        anyhow::anyhow!(
            "{e}\nhint: install a Vulkan driver (.ci/run installs mesa-vulkan-drivers), or set \
             CANOPY_TEST_BACKENDS=cpu to test the CPU backend alone"
        )
    })?;
    backbone_in_ort_matches_all_cpu(&gpu)
}

/// Trains the head on `head` with the backbone in ONNX Runtime, and the
/// whole step on the CPU, and compares the parameters.
fn backbone_in_ort_matches_all_cpu(head: &dyn Backend) -> Result<()> {
    let data = mnist()?;
    let model = common::frozen_lenet(&data)?;
    let ort = common::cpu_backend();

    let all_cpu = train(Trainer::new(&model, &CpuBackend, 3)?, model.clone(), &data)?;
    let split = train(Trainer::split(&model, &ort, head, 3)?, model.clone(), &data)?;

    // One session, one run per step: the backbone ran in ONNX Runtime.
    assert_eq!(ort.sessions_created(), 1, "sessions created");
    assert_eq!(ort.runs(), STEPS as u64, "session runs");

    let mut compared = 0;
    for (before, (cpu, split)) in model
        .parameters
        .iter()
        .zip(all_cpu.parameters.iter().zip(&split.parameters))
    {
        let f32s = |p: &canopy_ir::Parameter| p.data.as_f32().map(<[f32]>::to_vec);
        let (Some(b), Some(c), Some(s)) = (f32s(before), f32s(cpu), f32s(split)) else {
            anyhow::bail!("parameter `{}` is not f32", cpu.name);
        };
        for (i, (x, y)) in c.iter().zip(&s).enumerate() {
            assert!(
                (x - y).abs() <= 1e-4,
                "parameter `{}` element {i}: all-CPU {x}, split {y}",
                cpu.name
            );
        }
        if before.trainable {
            ensure!(b != c, "trainable `{}` did not change", cpu.name);
            compared += 1;
        } else {
            ensure!(b == s, "frozen `{}` changed", cpu.name);
        }
    }
    assert_eq!(compared, 4, "fc2 and fc3 weights and biases");
    Ok(())
}

/// The backbone reads only `x` (the frozen parameters are its constants),
/// the head reads no frozen parameter and nothing from the backbone but
/// the cut, and no gradient reaches the backbone.
#[test]
fn the_cut_leaves_the_frozen_forward_part_to_the_backbone() -> Result<()> {
    let model = common::frozen_lenet(&mnist()?)?;
    let step = model.entry(ENTRY_TRAIN_STEP)?;
    let split = split_train_step(&model)?.expect("a frozen backbone");
    assert_eq!(split.backbone.input_names(), ["x"]);
    let cut: Vec<String> = split
        .backbone
        .outputs()
        .iter()
        .map(|(n, _)| n.clone())
        .collect();
    assert!(!cut.is_empty() && cut.iter().all(|n| n.starts_with(CUT_PREFIX)));
    for name in split.head.input_names() {
        if let Some(param) = name.strip_prefix(PARAM_PREFIX) {
            assert!(
                model.parameter(param).unwrap().trainable,
                "the head reads frozen `{param}`"
            );
        }
        assert!(
            name != "x",
            "the head reads `x`: it should only see the cut"
        );
    }
    let head_ops = split.head.op_counts();
    for op in ["conv2d", "max_pool2d", "conv2d_backward_filter"] {
        assert!(
            !head_ops.contains_key(op),
            "the head has {op}: {head_ops:?}"
        );
    }
    // Nothing computed twice: the two parts hold no more compute nodes
    // than the step.
    let compute = |g: &canopy_ir::Graph| {
        g.nodes()
            .iter()
            .filter(|n| {
                !matches!(
                    n.op,
                    canopy_ir::Op::Input { .. } | canopy_ir::Op::Constant(_)
                )
            })
            .count()
    };
    assert!(compute(&split.backbone) + compute(&split.head) <= compute(step));
    Ok(())
}

/// A step with every parameter trainable (the input statistics too) has
/// no backbone to split off: `Trainer::split` says so and how to fix it.
#[test]
fn a_step_with_nothing_frozen_is_refused_with_a_hint() -> Result<()> {
    let mut model = build_model(&ModelConfig {
        architecture: Architecture::LeNet5 { classes: 10 },
        seed: 5,
        optimizer: Optimizer::parse("sgd")?,
        frozen_prefixes: Vec::new(),
        producer: "split test".to_string(),
    })?;
    for parameter in &mut model.parameters {
        parameter.trainable = true;
    }
    rebuild_train_step(&mut model, &Optimizer::parse("sgd")?)?;
    let ort = common::cpu_backend();
    let error = Trainer::split(&model, &ort, &CpuBackend, 1)
        .err()
        .expect("nothing to split");
    let message = error.to_string();
    assert!(message.contains("no frozen forward part"), "{message}");
    assert!(message.contains("hint:"), "{message}");
    assert_eq!(ort.sessions_created(), 0);
    Ok(())
}
