//! The GPU backend against the CPU on whole training runs: LeNet-5 steps
//! agree, an MLP trained on the GPU learns as on the CPU, parameters stay
//! on the device (host↔device traffic per step is the batch and the
//! outputs), and unsupported or oversized work is refused by name.

mod common;

use anyhow::Result;
use canopy_engine::data::{Dataset, load_dir};
use canopy_engine::optim::Optimizer;
use canopy_engine::train::{Trainer, evaluate};
use canopy_engine::zoo::{Architecture, ModelConfig, build_model};
use canopy_engine::{Backend, CpuBackend, EngineError, Value};
use canopy_ir::{DType, Model, Shape, TensorType};

fn mnist() -> Result<(Dataset, Dataset)> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../datasets/mnist-10k");
    Ok(load_dir(dir)?)
}

fn model(architecture: Architecture, optimizer: Optimizer) -> Result<Model> {
    Ok(build_model(&ModelConfig {
        architecture,
        seed: 5,
        optimizer,
        frozen_prefixes: vec![],
        producer: "test".into(),
    })?)
}

fn trainable(model: &Model) -> Vec<(String, Vec<f32>)> {
    model
        .parameters
        .iter()
        .filter(|p| p.trainable)
        .map(|p| (p.name.clone(), p.data.as_f32().unwrap().to_vec()))
        .collect()
}

/// Runs `steps` training steps of `model` on `backend` over the first
/// batches of `data` at learning rate `lr`; returns the trained model.
fn train_steps(
    model: &Model,
    backend: &dyn Backend,
    data: &Dataset,
    (batch, steps, lr): (usize, usize, f32),
) -> Result<Model> {
    let mut trainer = Trainer::new(model, backend, 11)?;
    let mut done = 0;
    'epochs: loop {
        for batch in data.batches(batch, Some(3), true)? {
            trainer.step(batch.x, batch.y, lr)?;
            done += 1;
            if done == steps {
                break 'epochs;
            }
        }
    }
    let mut trained = model.clone();
    trainer.write_back(&mut trained)?;
    Ok(trained)
}

#[test]
fn fifty_lenet_steps_agree_on_the_gpu_and_the_cpu() -> Result<()> {
    let Some(gpu) = common::gpu_under_test() else {
        return Ok(());
    };
    let (train, _) = mnist()?;
    let train = train.with_feature_shape(&[1, 28, 28])?;
    let start = model(Architecture::LeNet5 { classes: 10 }, Optimizer::sgd())?;
    let on_cpu = train_steps(&start, &CpuBackend, &train, (32, 50, 0.01))?;
    let on_gpu = train_steps(&start, &gpu, &train, (32, 50, 0.01))?;
    // Relative in the L2 norm, per tensor: floats summed in another order
    // may break a near-tie of a max-pool window the other way, which
    // moves a few weights of one filter by a step's worth; the norm
    // bounds that, while an error in any kernel would exceed it.
    for ((name, cpu), (_, gpu)) in trainable(&on_cpu).iter().zip(trainable(&on_gpu)) {
        let norm =
            |v: &mut dyn Iterator<Item = f32>| v.map(|x| f64::from(x).powi(2)).sum::<f64>().sqrt();
        let difference = norm(&mut cpu.iter().zip(&gpu).map(|(c, g)| c - g));
        let size = norm(&mut cpu.iter().copied());
        assert!(
            difference <= 1e-4 * size,
            "`{name}` after 50 SGD steps: CPU and GPU differ by {difference} in L2 (norm {size})"
        );
    }
    // And training moved them: a check that cannot pass by standing still.
    assert_ne!(trainable(&start), trainable(&on_gpu));
    Ok(())
}

#[test]
fn an_mlp_trained_on_the_gpu_learns_as_on_the_cpu() -> Result<()> {
    let Some(gpu) = common::gpu_under_test() else {
        return Ok(());
    };
    let (train, test) = mnist()?;
    let (train, test) = (
        train.with_feature_shape(&[784])?,
        test.with_feature_shape(&[784])?,
    );
    let mut start = model(
        Architecture::Mlp {
            inputs: 784,
            hidden: 128,
            classes: 10,
        },
        Optimizer::sgd(),
    )?;
    canopy_engine::stats::fit_model(&mut start, &canopy_engine::stats::InputMoments::of(&train))?;
    let steps = train.len() / 32;
    let on_cpu = train_steps(&start, &CpuBackend, &train, (32, steps, 0.1))?;
    let on_gpu = train_steps(&start, &gpu, &train, (32, steps, 0.1))?;
    let cpu = evaluate(&on_cpu, &test, 256, &CpuBackend)?;
    let gpu_eval = evaluate(&on_gpu, &test, 256, &gpu)?;
    assert!(
        gpu_eval.accuracy >= 0.9,
        "one epoch on the GPU: {gpu_eval:?}"
    );
    assert!(
        (gpu_eval.accuracy - cpu.accuracy).abs() <= 0.005,
        "GPU {gpu_eval:?} vs CPU {cpu:?}"
    );
    Ok(())
}

#[test]
fn a_training_step_moves_the_batch_and_the_outputs_not_the_model() -> Result<()> {
    let Some(gpu) = common::gpu_under_test() else {
        return Ok(());
    };
    let (train, _) = mnist()?;
    let train = train.with_feature_shape(&[784])?;
    let mlp = model(
        Architecture::Mlp {
            inputs: 784,
            hidden: 128,
            classes: 10,
        },
        Optimizer::adam(),
    )?;
    let model_bytes: u64 = mlp
        .parameters
        .iter()
        .map(|p| 4 * p.data.num_elements() as u64)
        .sum();
    let mut trainer = Trainer::new(&mlp, &gpu, 1)?;
    let mut batches = train.batches(64, Some(1), true)?;
    let first = batches.next().unwrap();
    trainer.step(first.x, first.y, 0.01)?;
    let before = trainer.transfers();
    let steps = 10u64;
    let mut batch_bytes = 0u64;
    for batch in batches.take(steps as usize) {
        // x (f32) and y (i64) go up, and the three scalars (seed i64, lr
        // and step f32).
        batch_bytes += 4 * batch.x.len() as u64 + 8 * batch.y.len() as u64 + 8 + 4 + 4;
        trainer.step(batch.x, batch.y, 0.01)?;
    }
    let after = trainer.transfers();
    let up = after.host_to_device_bytes - before.host_to_device_bytes;
    let down = after.device_to_host_bytes - before.device_to_host_bytes;
    assert_eq!(up, batch_bytes, "host→device over {steps} steps");
    // Down: the loss (f32), the correct count (i64) and the run's flag
    // words (2 + one per output: a NaN check on each parameter).
    let outputs = trainer_outputs(&mlp)?;
    assert_eq!(
        down,
        steps * (4 + 8 + 4 * (2 + outputs)),
        "device→host over {steps} steps"
    );
    assert!(
        down * 100 < model_bytes,
        "{down} bytes down vs a {model_bytes}-byte model"
    );
    assert_eq!(
        after.submissions - before.submissions,
        steps,
        "one submission per step"
    );
    Ok(())
}

fn trainer_outputs(model: &Model) -> Result<u64> {
    Ok(model.entry("train_step")?.outputs().len() as u64)
}

#[test]
fn a_diverging_step_on_the_gpu_rolls_back_on_the_device() -> Result<()> {
    let Some(gpu) = common::gpu_under_test() else {
        return Ok(());
    };
    let (train, _) = mnist()?;
    let train = train.with_feature_shape(&[784])?;
    let mlp = model(
        Architecture::Mlp {
            inputs: 784,
            hidden: 16,
            classes: 10,
        },
        Optimizer::sgd(),
    )?;
    let mut trainer = Trainer::new(&mlp, &gpu, 1)?;
    let mut batches = train.batches(32, Some(1), true)?;
    let batch = batches.next().unwrap();
    trainer.step(batch.x.clone(), batch.y.clone(), 0.01)?;
    let mut good = mlp.clone();
    trainer.write_back(&mut good)?;
    let Value::F32(mut poisoned) = batch.x.clone() else {
        unreachable!()
    };
    poisoned[[0, 0]] = f32::NAN;
    let error = trainer
        .step(Value::F32(poisoned), batch.y.clone(), 0.01)
        .expect_err("a NaN input diverges");
    assert!(
        matches!(
            error,
            EngineError::Diverged {
                rolled_back_to: 0,
                ..
            }
        ),
        "{error}"
    );
    let mut after = mlp.clone();
    trainer.write_back(&mut after)?;
    // Rolled back to the snapshot taken before step 1, on the device.
    assert_eq!(trainable(&after), trainable(&mlp));
    assert_ne!(trainable(&good), trainable(&mlp));
    Ok(())
}

#[test]
fn an_input_too_large_for_the_adapter_is_refused_by_name() -> Result<()> {
    let Some(gpu) = common::gpu_under_test() else {
        return Ok(());
    };
    let limit = gpu.adapter().max_buffer_bytes;
    let mut g = canopy_ir::Graph::new();
    let elements = (limit / 4 + 1) as usize;
    let x = g.input(
        "huge",
        TensorType::new(DType::F32, Shape::fixed(&[elements])),
    )?;
    let y = g.push(canopy_ir::Op::Unary(canopy_ir::UnaryOp::Neg), &[x])?;
    g.set_output("y", y)?;
    let mut exe = gpu.compile(&g)?;
    let error = exe
        .run(vec![Value::zeros(DType::F32, &[elements])])
        .expect_err("larger than a buffer may be");
    let text = error.to_string();
    assert!(
        text.contains("input `huge`") && text.contains("bytes"),
        "{text}"
    );
    Ok(())
}

#[test]
fn the_adapter_is_reported() {
    let Some(gpu) = common::gpu_under_test() else {
        return;
    };
    let info = gpu.adapter();
    assert!(!info.name.is_empty());
    assert!(
        ["vulkan", "metal", "dx12", "gl"].contains(&info.api.as_str()),
        "{info:?}"
    );
    assert!(info.max_buffer_bytes >= 1 << 20, "{info:?}");
    let described = gpu.describe();
    assert_eq!(described.backend, "gpu");
    assert_eq!(described.adapter.as_ref(), Some(info));
}

/// From the same parameters, one step on each backend lands within float
/// rounding (1e-6 of the largest weight) for every batch: the 50-step
/// test above allows for a near-tie flipping, this one does not.
#[test]
fn each_lenet_step_from_the_same_parameters_agrees_closely() -> Result<()> {
    let Some(gpu) = common::gpu_under_test() else {
        return Ok(());
    };
    let (train, _) = mnist()?;
    let train = train.with_feature_shape(&[1, 28, 28])?;
    let start = model(Architecture::LeNet5 { classes: 10 }, Optimizer::sgd())?;
    let mut reference = Trainer::new(&start, &CpuBackend, 11)?;
    for (k, batch) in train.batches(32, Some(3), true)?.take(12).enumerate() {
        let mut here = start.clone();
        reference.write_back(&mut here)?;
        let mut results = Vec::new();
        for backend in [&CpuBackend as &dyn Backend, &gpu] {
            let mut trainer = Trainer::new(&here, backend, 11)?;
            let stats = trainer.step(batch.x.clone(), batch.y.clone(), 0.05)?;
            let mut after = here.clone();
            trainer.write_back(&mut after)?;
            results.push((stats.loss, trainable(&after)));
        }
        let (cpu, gpu) = (&results[0], &results[1]);
        assert!(
            (cpu.0 - gpu.0).abs() <= 1e-5 * cpu.0.abs(),
            "step {k}: loss {} vs {}",
            cpu.0,
            gpu.0
        );
        for ((name, c), (_, g)) in cpu.1.iter().zip(&gpu.1) {
            let scale = c.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let worst = c
                .iter()
                .zip(g)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0f32, f32::max);
            assert!(
                worst <= 1e-6 * scale.max(1.0),
                "step {k}, `{name}`: {worst}"
            );
        }
        reference.step(batch.x, batch.y, 0.05)?;
    }
    Ok(())
}

/// Deterministic values in [-1, 1) without a random-number crate.
fn ramp(len: usize, seed: u32) -> Vec<f32> {
    (0..len as u32)
        .map(|i| {
            let h = i
                .wrapping_mul(2_654_435_761)
                .wrapping_add(seed.wrapping_mul(40_503));
            (h >> 8) as f32 / (1u32 << 23) as f32 - 1.0
        })
        .collect()
}

/// Runs `y` of `case` on both backends; [`common::compile`] asserts they
/// agree.
fn cross_check(mut case: common::Case, y: canopy_ir::ValueId) -> Result<()> {
    case.g.set_output("y", y)?;
    let mut executable = common::compile(&case.g);
    executable.run(case.inputs)?;
    Ok(())
}

/// The tiled GEMM at shapes the conformance suite's small cases do not
/// reach: several tiles per side, partial tiles, a depth that is not a
/// multiple of the stage, the vectorised and the scalar load paths, both
/// transposes and a broadcast batch.
#[test]
fn matmuls_of_every_layout_agree_on_the_gpu_and_the_cpu() -> Result<()> {
    // (batch of a, batch of b, m, k, n): k and m multiples of 4 take the
    // vec4 loads, the others the scalar ones.
    type Shapes = (&'static [usize], &'static [usize], usize, usize, usize);
    let shapes: [Shapes; 5] = [
        (&[], &[], 64, 784, 128),
        (&[], &[], 130, 33, 70),
        (&[], &[], 7, 16, 300),
        (&[3], &[3], 68, 20, 12),
        (&[2, 3], &[3], 36, 9, 40),
    ];
    for (a_batch, b_batch, m, k, n) in shapes {
        for (transpose_a, transpose_b) in
            [(false, false), (true, false), (false, true), (true, true)]
        {
            let mut case = common::Case::new();
            let a_matrix = if transpose_a { [k, m] } else { [m, k] };
            let b_matrix = if transpose_b { [n, k] } else { [k, n] };
            let a_shape = [a_batch, &a_matrix[..]].concat();
            let b_shape = [b_batch, &b_matrix[..]].concat();
            let a = case.f32("a", &a_shape, ramp(a_shape.iter().product(), 1));
            let b = case.f32("b", &b_shape, ramp(b_shape.iter().product(), 2));
            let y = case.g.matmul_t(a, b, transpose_a, transpose_b)?;
            cross_check(case, y)?;
        }
    }
    Ok(())
}

/// Convolution forward and both backward ops at LeNet-5's shapes (the
/// direct kernels) and, with enough channels and depth, the implicit GEMM,
/// at geometries with stride, padding and dilation.
#[test]
fn convolutions_at_model_sizes_agree_on_the_gpu_and_the_cpu() -> Result<()> {
    use canopy_ir::Conv2dAttrs;
    use canopy_ir::op::window_output_size;
    // (N, C, O, H, W, KH, KW, stride, padding, dilation)
    let cases = [
        (32, 1, 6, 28, 28, 5, 5, [1, 1], [0, 0], [1, 1]),
        (32, 6, 16, 12, 12, 5, 5, [1, 1], [0, 0], [1, 1]),
        (3, 5, 70, 11, 9, 3, 3, [2, 1], [1, 2], [1, 2]),
        (2, 33, 9, 8, 8, 1, 1, [1, 1], [0, 0], [1, 1]),
        // Enough channels and depth for the implicit GEMM both ways.
        (4, 40, 48, 10, 10, 3, 3, [1, 1], [1, 1], [1, 1]),
        (2, 36, 64, 9, 11, 3, 3, [2, 2], [1, 0], [1, 2]),
    ];
    for (n, c, o, h, w, kh, kw, stride, padding, dilation) in cases {
        let attrs = Conv2dAttrs {
            stride,
            padding,
            dilation,
        };
        let out_h = window_output_size(h, kh, stride[0], padding[0], dilation[0]).unwrap();
        let out_w = window_output_size(w, kw, stride[1], padding[1], dilation[1]).unwrap();
        let (xs, ws, dys) = ([n, c, h, w], [o, c, kh, kw], [n, o, out_h, out_w]);
        let mut case = common::Case::new();
        let x = case.f32("x", &xs, ramp(xs.iter().product(), 3));
        let wt = case.f32("w", &ws, ramp(ws.iter().product(), 4));
        let y = case.g.conv2d(x, wt, attrs)?;
        cross_check(case, y)?;

        let mut case = common::Case::new();
        let dy = case.f32("dy", &dys, ramp(dys.iter().product(), 5));
        let wt = case.f32("w", &ws, ramp(ws.iter().product(), 4));
        let op = canopy_ir::Op::Conv2dBackwardInput {
            attrs,
            input_hw: [h, w],
        };
        let y = case.g.push(op, &[dy, wt])?;
        cross_check(case, y)?;

        let mut case = common::Case::new();
        let x = case.f32("x", &xs, ramp(xs.iter().product(), 3));
        let dy = case.f32("dy", &dys, ramp(dys.iter().product(), 5));
        let op = canopy_ir::Op::Conv2dBackwardFilter {
            attrs,
            kernel_hw: [kh, kw],
        };
        let y = case.g.push(op, &[x, dy])?;
        cross_check(case, y)?;
    }
    Ok(())
}
