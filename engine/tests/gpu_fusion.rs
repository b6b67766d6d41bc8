//! Fusion of elementwise chains on the GPU: a fused chain is one dispatch
//! and computes what the CPU does; values read outside a chain, returned
//! values and broadcast operands keep their meaning; groups past the size
//! limits are split; a training step needs fewer dispatches with fusion
//! than without and lands on the same parameters.

mod common;

use anyhow::Result;
use canopy_engine::data::{Dataset, load_dir};
use canopy_engine::optim::Optimizer;
use canopy_engine::train::Trainer;
use canopy_engine::zoo::{Architecture, ModelConfig, build_model};
use canopy_engine::{Backend, CpuBackend, GpuBackend, Value};
use canopy_ir::{BinaryOp, DType, Dim, Graph, Model, Op, Shape, TensorType, UnaryOp};

/// Deterministic inputs in [-1, 1).
fn ramp(shape: &[usize], salt: usize) -> Value {
    let n: usize = shape.iter().product();
    let data = (0..n)
        .map(|k| (((k * 7 + salt * 13) % 23) as f32 / 11.5) - 1.0)
        .collect();
    Value::f32(shape, data).expect("data fits shape")
}

/// Runs `graph` on the CPU and on the GPU with fusion, checks that every
/// output agrees, and returns the GPU's dispatches for the one run.
fn dispatches_agreeing_with_cpu(gpu: &GpuBackend, graph: &Graph, inputs: &[Value]) -> u64 {
    let cpu = CpuBackend
        .compile(graph)
        .and_then(|mut exe| exe.run(inputs.to_vec()))
        .expect("CPU runs");
    let mut exe = gpu.compile(graph).expect("GPU compiles");
    let on_gpu = exe.run(inputs.to_vec()).expect("GPU runs");
    assert_eq!(cpu.len(), on_gpu.len());
    for ((c, g), name) in cpu.iter().zip(&on_gpu).zip(exe.output_names()) {
        common::assert_close_across_backends(name, c, g);
    }
    exe.transfers().dispatches
}

/// The dispatches of one run of `graph` with fusion off.
fn unfused_dispatches(gpu: &GpuBackend, graph: &Graph, inputs: &[Value]) -> u64 {
    let mut exe = gpu.with_fusion(false).compile(graph).expect("compiles");
    exe.run(inputs.to_vec()).expect("runs");
    exe.transfers().dispatches
}

#[test]
fn a_chain_is_one_dispatch_and_agrees_with_the_cpu() -> Result<()> {
    let Some(gpu) = common::gpu_under_test() else {
        return Ok(());
    };
    // exp(x * 2 + 1) - y
    let mut g = Graph::new();
    let x = g.input("x", TensorType::f32(&[3, 50]))?;
    let y = g.input("y", TensorType::f32(&[3, 50]))?;
    let two = g.scalar(2.0)?;
    let one = g.scalar(1.0)?;
    let doubled = g.mul(x, two)?;
    let shifted = g.add(doubled, one)?;
    let raised = g.exp(shifted)?;
    let out = g.sub(raised, y)?;
    g.set_output("out", out)?;
    let inputs = [ramp(&[3, 50], 1), ramp(&[3, 50], 2)];
    assert_eq!(dispatches_agreeing_with_cpu(&gpu, &g, &inputs), 1);
    assert_eq!(unfused_dispatches(&gpu, &g, &inputs), 4);
    Ok(())
}

#[test]
fn values_read_outside_a_chain_or_returned_stay_materialised() -> Result<()> {
    let Some(gpu) = common::gpu_under_test() else {
        return Ok(());
    };
    let mut g = Graph::new();
    let x = g.input("x", TensorType::f32(&[4, 6]))?;
    let two = g.scalar(2.0)?;
    let one = g.scalar(1.0)?;
    // `raised` is read by a reduction, and `tripled` is returned: both
    // must be written although elementwise nodes read them too.
    let doubled = g.mul(x, two)?;
    let raised = g.exp(doubled)?;
    let total = g.sum(raised, &[1], true)?;
    let lowered = g.sub(raised, one)?;
    let out = g.div(lowered, total)?;
    let tripled = g.add(x, doubled)?;
    let shifted = g.add(tripled, one)?;
    g.set_outputs(vec![
        ("out".into(), out),
        ("tripled".into(), tripled),
        ("shifted".into(), shifted),
    ])?;
    let inputs = [ramp(&[4, 6], 3)];
    // doubled (read by `raised` and `tripled`), raised, sum,
    // {lowered, out}, tripled, shifted.
    let fused = dispatches_agreeing_with_cpu(&gpu, &g, &inputs);
    assert_eq!(fused, 6);
    assert_eq!(unfused_dispatches(&gpu, &g, &inputs), 7);
    Ok(())
}

#[test]
fn broadcast_operands_are_read_inside_a_chain() -> Result<()> {
    let Some(gpu) = common::gpu_under_test() else {
        return Ok(());
    };
    // relu(x + b) * broadcast(s) - 0.5 with b over the rows and s over
    // the columns, one implicitly and one by an explicit broadcast node.
    let mut g = Graph::new();
    let x = g.input("x", TensorType::f32(&[4, 5]))?;
    let b = g.input("b", TensorType::f32(&[5]))?;
    let s = g.input("s", TensorType::f32(&[4, 1]))?;
    let half = g.scalar(0.5)?;
    let biased = g.add(x, b)?;
    let active = g.relu(biased)?;
    let spread = g.broadcast(s, vec![Dim::Fixed(4), Dim::Fixed(5)])?;
    let scaled = g.mul(active, spread)?;
    let out = g.sub(scaled, half)?;
    g.set_output("out", out)?;
    let inputs = [ramp(&[4, 5], 4), ramp(&[5], 5), ramp(&[4, 1], 6)];
    assert_eq!(dispatches_agreeing_with_cpu(&gpu, &g, &inputs), 1);
    Ok(())
}

#[test]
fn casts_selects_and_comparisons_fuse_with_their_types() -> Result<()> {
    let Some(gpu) = common::gpu_under_test() else {
        return Ok(());
    };
    // where(x > 0, f32(i64(x * 3) * k), -x): bool, i64 and f32 members.
    let mut g = Graph::new();
    let x = g.input("x", TensorType::f32(&[2, 9]))?;
    let k = g.input("k", TensorType::new(DType::I64, Shape::fixed(&[9])))?;
    let zero = g.scalar(0.0)?;
    let three = g.scalar(3.0)?;
    let positive = g.binary(BinaryOp::Gt, x, zero)?;
    let tripled = g.mul(x, three)?;
    let whole = g.push(Op::Cast { to: DType::I64 }, &[tripled])?;
    let product = g.binary(BinaryOp::Mul, whole, k)?;
    let back = g.push(Op::Cast { to: DType::F32 }, &[product])?;
    let negated = g.neg(x)?;
    let out = g.push(Op::Where, &[positive, back, negated])?;
    g.set_output("out", out)?;
    let k_values = Value::i64(&[9], (0..9).map(|v| v - 4).collect())?;
    let inputs = [ramp(&[2, 9], 7), k_values];
    assert_eq!(dispatches_agreeing_with_cpu(&gpu, &g, &inputs), 1);
    Ok(())
}

#[test]
fn an_integer_division_by_zero_inside_a_chain_is_still_flagged() -> Result<()> {
    let Some(gpu) = common::gpu_under_test() else {
        return Ok(());
    };
    let mut g = Graph::new();
    let a = g.input("a", TensorType::new(DType::I64, Shape::fixed(&[4])))?;
    let b = g.input("b", TensorType::new(DType::I64, Shape::fixed(&[4])))?;
    let quotient = g.div(a, b)?;
    let out = g.add(quotient, a)?;
    g.set_output("out", out)?;
    let a_values = Value::i64(&[4], vec![7, -9, 1 << 40, 5])?;
    let good = [a_values.clone(), Value::i64(&[4], vec![2, 4, -3, 1])?];
    assert_eq!(dispatches_agreeing_with_cpu(&gpu, &g, &good), 1);
    let zero = vec![a_values, Value::i64(&[4], vec![2, 0, -3, 1])?];
    for backend in [gpu.clone(), gpu.with_fusion(false)] {
        let error = backend
            .compile(&g)?
            .run(zero.clone())
            .expect_err("a zero divisor is an error");
        assert!(error.to_string().contains("division by zero"), "{error}");
    }
    Ok(())
}

#[test]
fn groups_past_the_size_limits_are_split_and_agree() -> Result<()> {
    let Some(gpu) = common::gpu_under_test() else {
        return Ok(());
    };
    // 40 unary nodes in a row: 32 in one kernel, the other 8 in another.
    let mut g = Graph::new();
    let x = g.input("x", TensorType::f32(&[3, 7]))?;
    let mut value = x;
    for k in 0..40 {
        let op = [UnaryOp::Tanh, UnaryOp::Neg, UnaryOp::Sigmoid, UnaryOp::Abs][k % 4];
        value = g.unary(op, value)?;
    }
    g.set_output("out", value)?;
    let inputs = [ramp(&[3, 7], 8)];
    assert_eq!(dispatches_agreeing_with_cpu(&gpu, &g, &inputs), 2);

    // A sum of 12 distinct inputs reads more values than one kernel may
    // bind: more than one kernel, fewer than one per add.
    let mut g = Graph::new();
    let mut inputs = Vec::new();
    let mut total = None;
    for k in 0..12 {
        let input = g.input(format!("x{k}"), TensorType::f32(&[5]))?;
        inputs.push(ramp(&[5], k));
        total = Some(match total {
            None => input,
            Some(sum) => g.add(sum, input)?,
        });
    }
    g.set_output("total", total.expect("twelve inputs"))?;
    let dispatches = dispatches_agreeing_with_cpu(&gpu, &g, &inputs);
    assert!((2..11).contains(&dispatches), "{dispatches} dispatches");
    Ok(())
}

fn mnist() -> Result<Dataset> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../datasets/mnist-10k");
    Ok(load_dir(dir)?.0)
}

fn trainable(model: &Model) -> Vec<(String, Vec<f32>)> {
    model
        .parameters
        .iter()
        .filter(|p| p.trainable)
        .map(|p| (p.name.clone(), p.data.as_f32().expect("f32").to_vec()))
        .collect()
}

/// What `steps` training steps did.
struct Trained {
    dispatches_per_step: u64,
    losses: Vec<f32>,
    parameters: Vec<(String, Vec<f32>)>,
}

/// `steps` training steps on `backend`.
fn train(model: &Model, backend: &dyn Backend, data: &Dataset, steps: usize) -> Result<Trained> {
    let mut trainer = Trainer::new(model, backend, 11)?;
    let mut losses = Vec::new();
    for batch in data.batches(32, Some(3), true)?.take(steps) {
        losses.push(trainer.step(batch.x, batch.y, 0.05)?.loss);
    }
    let dispatches_per_step = trainer.transfers().dispatches / steps as u64;
    let mut trained = model.clone();
    trainer.write_back(&mut trained)?;
    Ok(Trained {
        dispatches_per_step,
        losses,
        parameters: trainable(&trained),
    })
}

/// Fused and unfused steps of `architecture` land on the same parameters
/// (within float rounding: a fused kernel may contract a multiply and an
/// add), and fusion saves dispatches.
fn fusion_saves_dispatches(architecture: Architecture, feature_shape: &[usize]) -> Result<()> {
    let Some(gpu) = common::gpu_under_test() else {
        return Ok(());
    };
    let data = mnist()?.with_feature_shape(feature_shape)?;
    let model = build_model(&ModelConfig {
        architecture: architecture.clone(),
        seed: 5,
        optimizer: Optimizer::adam(),
        frozen_prefixes: vec![],
        producer: "test".into(),
    })?;
    let steps = 3;
    let fused = train(&model, &gpu, &data, steps)?;
    let unfused = train(&model, &gpu.with_fusion(false), &data, steps)?;
    let (before, after) = (unfused.dispatches_per_step, fused.dispatches_per_step);
    eprintln!("{architecture:?} train_step dispatches: {before} unfused, {after} fused");
    assert!(after < before, "{after} fused vs {before} unfused");
    for (f, u) in fused.losses.iter().zip(&unfused.losses) {
        assert!((f - u).abs() <= 1e-5 * u.abs().max(1.0), "loss {f} vs {u}");
    }
    for ((name, f), (_, u)) in fused.parameters.iter().zip(&unfused.parameters) {
        let scale = u.iter().fold(1.0f32, |m, v| m.max(v.abs()));
        let worst = f
            .iter()
            .zip(u)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(
            worst <= 1e-5 * scale,
            "`{name}`: fused and unfused differ by {worst}"
        );
    }
    Ok(())
}

#[test]
fn an_mlp_step_needs_fewer_dispatches_fused_and_computes_the_same() -> Result<()> {
    fusion_saves_dispatches(
        Architecture::Mlp {
            inputs: 784,
            hidden: 128,
            classes: 10,
        },
        &[784],
    )
}

#[test]
fn a_lenet_step_needs_fewer_dispatches_fused_and_computes_the_same() -> Result<()> {
    fusion_saves_dispatches(Architecture::LeNet5 { classes: 10 }, &[1, 28, 28])
}
