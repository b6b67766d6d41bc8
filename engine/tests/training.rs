//! Training graphs on real data: gradients of the shipped model against
//! finite differences, eager against graph mode, frozen backbones.

use anyhow::Result;
use canopy_engine::data::load_dir;
use canopy_engine::nn::Initializer;
use canopy_engine::optim::Optimizer;
use canopy_engine::train::Trainer;
use canopy_engine::zoo::{
    Architecture, ENTRY_TRAIN_LOSS, ModelConfig, PROP_INIT, build_model, build_model_with_init,
};
use canopy_engine::{Backend, CpuBackend, EngineError, Value};
use canopy_ir::{Model, autodiff};

fn datasets() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../datasets")
}

fn mlp_config() -> ModelConfig {
    ModelConfig {
        architecture: Architecture::Mlp {
            inputs: 784,
            hidden: 32,
            classes: 10,
        },
        seed: 3,
        optimizer: Optimizer::sgd(),
        frozen_prefixes: vec![],
        producer: "test".into(),
    }
}

fn mlp() -> Result<Model> {
    Ok(build_model(&mlp_config())?)
}

fn inputs_for(model: &Model, graph: &canopy_ir::Graph, x: &Value, y: &Value) -> Vec<Value> {
    graph
        .inputs()
        .iter()
        .map(|&i| match graph.input_name(i) {
            "x" => x.clone(),
            "y" => y.clone(),
            "seed" => Value::scalar_i64(7),
            name => Value::from_data(
                &model
                    .parameter(name.strip_prefix("params/").unwrap())
                    .unwrap()
                    .data,
            ),
        })
        .collect()
}

#[test]
fn mlp_gradient_on_real_batch_matches_finite_differences() -> Result<()> {
    for batch_size in [64, 4, 5, 1] {
        check_gradient(batch_size)?;
    }
    Ok(())
}

fn check_gradient(batch_size: usize) -> Result<()> {
    let model = mlp()?;
    let (train, _) = load_dir(datasets().join("mnist-10k"))?;
    let train = train.with_feature_shape(&[784])?;
    let batch = train.batches(batch_size, None, true)?.next().unwrap();
    let loss_graph = model.entry(ENTRY_TRAIN_LOSS)?.clone();
    let wrt = ["params/fc1.weight", "params/fc2.bias"];
    let vg = autodiff::value_and_grad(&loss_graph, "loss", &wrt)?;
    let mut exec = CpuBackend.compile(&vg)?;
    let out = exec.run(inputs_for(&model, &vg, &batch.x, &batch.y))?;
    let mut loss_exec = CpuBackend.compile(&loss_graph)?;
    let names: Vec<String> = vg.outputs().iter().map(|(n, _)| n.clone()).collect();
    for (k, param) in ["fc1.weight", "fc2.bias"].iter().enumerate() {
        let grad = out[names
            .iter()
            .position(|n| *n == format!("grad/{}", wrt[k]))
            .unwrap()]
        .to_f32_vec()?;
        let base = model.parameter(param).unwrap().data.clone();
        // Probe the largest-gradient coordinates, where f32 differences are meaningful.
        let mut order: Vec<usize> = (0..grad.len()).collect();
        order.sort_by(|&a, &b| grad[b].abs().total_cmp(&grad[a].abs()));
        for &i in order.iter().take(5) {
            let eps = 1e-3f32;
            let mut eval = |delta: f32| -> Result<f64> {
                let mut m = model.clone();
                let p = m.parameter_mut(param).unwrap();
                if let canopy_ir::Buffer::F32(v) = &mut p.data.buffer {
                    v[i] = base.as_f32().unwrap()[i] + delta;
                }
                let o = loss_exec.run(inputs_for(&m, &loss_graph, &batch.x, &batch.y))?;
                Ok(o[0].to_scalar_f32()? as f64)
            };
            let numeric = (eval(eps)? - eval(-eps)?) / (2.0 * eps as f64);
            let analytic = grad[i] as f64;
            assert!(
                (numeric - analytic).abs() <= 2e-2 * analytic.abs().max(1e-3),
                "batch {batch_size}, {param}[{i}]: analytic {analytic} vs numeric {numeric}"
            );
        }
    }
    Ok(())
}

#[test]
fn sgd_train_step_equals_parameter_minus_lr_times_gradient() -> Result<()> {
    let mut model = mlp()?;
    let (train, _) = load_dir(datasets().join("mnist-10k"))?;
    let train = train.with_feature_shape(&[784])?;
    let batch = train.batches(64, Some(1), true)?.next().unwrap();
    let loss_graph = model.entry(ENTRY_TRAIN_LOSS)?.clone();
    let names: Vec<String> = model
        .parameters
        .iter()
        .filter(|p| p.trainable)
        .map(|p| format!("params/{}", p.name))
        .collect();
    let wrt: Vec<&str> = names.iter().map(String::as_str).collect();
    let vg = autodiff::value_and_grad(&loss_graph, "loss", &wrt)?;
    let out = CpuBackend
        .compile(&vg)?
        .run(inputs_for(&model, &vg, &batch.x, &batch.y))?;
    let before = model.clone();
    let mut trainer = Trainer::new(&model, &CpuBackend, 0)?;
    let lr = 0.1f32;
    let stats = trainer.step(batch.x.clone(), batch.y.clone(), lr)?;
    assert!(
        (stats.loss - out[0].to_scalar_f32()?).abs() < 1e-5,
        "loss differs"
    );
    trainer.write_back(&mut model)?;
    for (k, name) in names.iter().enumerate() {
        let param = name.strip_prefix("params/").unwrap();
        let grad = out[2 + k].to_f32_vec()?;
        let values = |m: &Model| m.parameter(param).unwrap().data.as_f32().unwrap().to_vec();
        let (old, new) = (values(&before), values(&model));
        for i in 0..old.len() {
            let expected = old[i] - lr * grad[i];
            assert!(
                (new[i] - expected).abs() <= 1e-6 + 1e-5 * expected.abs(),
                "{param}[{i}]: {} vs {expected}",
                new[i]
            );
        }
    }
    Ok(())
}

fn lenet(frozen: &[&str], optimizer: Optimizer) -> Result<Model> {
    Ok(build_model(&ModelConfig {
        architecture: Architecture::LeNet5 { classes: 10 },
        seed: 1,
        optimizer,
        frozen_prefixes: frozen.iter().map(|s| s.to_string()).collect(),
        producer: "test".into(),
    })?)
}

#[test]
fn frozen_backbone_has_a_smaller_training_graph_without_backbone_backward() -> Result<()> {
    let full = lenet(&[], Optimizer::adam())?;
    let head = lenet(&["conv", "fc1"], Optimizer::adam())?;
    let full_step = full.entry("train_step")?;
    let head_step = head.entry("train_step")?;
    assert!(
        head_step.len() < full_step.len(),
        "frozen: {} nodes, full: {} nodes",
        head_step.len(),
        full_step.len()
    );
    let count = |g: &canopy_ir::Graph, op: &str| g.op_counts().get(op).copied().unwrap_or(0);
    assert!(count(full_step, "conv2d_backward_filter") == 2);
    for op in [
        "conv2d_backward_filter",
        "conv2d_backward_input",
        "max_pool2d_backward",
    ] {
        assert_eq!(
            count(head_step, op),
            0,
            "frozen backbone graph has a `{op}` node"
        );
    }
    // Optimizer state exists only for the trainable head: two Adam slots per parameter.
    let state_inputs = head_step
        .input_names()
        .iter()
        .filter(|n| n.starts_with("state/"))
        .count();
    let trainable = head.parameters.iter().filter(|p| p.trainable).count();
    assert_eq!(trainable, 4, "fc2 and fc3 weights and biases");
    assert_eq!(state_inputs, 2 * trainable);
    Ok(())
}

#[test]
fn training_a_head_leaves_the_frozen_backbone_untouched() -> Result<()> {
    let mut model = lenet(&["conv", "fc1"], Optimizer::sgd())?;
    let before = model.clone();
    let (train, _) = load_dir(datasets().join("mnist-10k"))?;
    let mut trainer = Trainer::new(&model, &CpuBackend, 0)?;
    for batch in train.batches(32, Some(3), true)?.take(5) {
        trainer.step(batch.x, batch.y, 0.05)?;
    }
    trainer.write_back(&mut model)?;
    for (old, new) in before.parameters.iter().zip(&model.parameters) {
        if old.trainable {
            assert_ne!(old.data, new.data, "{} should have changed", old.name);
        } else {
            assert_eq!(old.data, new.data, "{} is frozen", old.name);
        }
    }
    Ok(())
}

#[test]
fn passes_shrink_the_mlp_training_graph() -> Result<()> {
    let model = mlp()?;
    let loss = model.entry(ENTRY_TRAIN_LOSS)?;
    let trainable: Vec<String> = model.trainable_names();
    let wrt: Vec<String> = trainable.iter().map(|p| format!("params/{p}")).collect();
    let wrt: Vec<&str> = wrt.iter().map(String::as_str).collect();
    let raw = autodiff::value_and_grad(loss, "loss", &wrt)?;
    let (optimized, report) = canopy_ir::passes::optimize_with_report(
        &raw,
        Some(&canopy_engine::fold::CpuConstEvaluator),
    )?;
    println!(
        "mlp value_and_grad: {} nodes before passes, {} after ({:?})",
        report.before, report.after, report.per_pass
    );
    assert!(report.after < report.before);
    assert_eq!(optimized.len(), report.after);
    Ok(())
}

#[test]
fn divergence_is_an_error_that_keeps_the_parameters() -> Result<()> {
    let mut model = mlp()?;
    let before = model.clone();
    let (train, _) = load_dir(datasets().join("mnist-10k"))?;
    let train = train.with_feature_shape(&[784])?;
    let mut trainer = Trainer::new(&model, &CpuBackend, 0)?;
    let batch = train.batches(64, None, true)?.next().unwrap();
    let err = trainer
        .step(batch.x.clone(), batch.y.clone(), f32::NAN)
        .unwrap_err();
    assert!(
        matches!(err, EngineError::LearningRate(lr) if lr.is_nan()),
        "{err:?}"
    );
    // An absurd learning rate overflows the weights within a few steps.
    let mut failure = None;
    for _ in 0..20 {
        if let Err(e) = trainer.step(batch.x.clone(), batch.y.clone(), 1e30) {
            failure = Some(e);
            break;
        }
    }
    let failure = failure.expect("a learning rate of 1e30 diverges");
    let EngineError::Diverged {
        step,
        rolled_back_to: 0,
        ..
    } = failure
    else {
        panic!("expected a divergence rolled back to step 0, got {failure:?}");
    };
    assert!((1..=20).contains(&step), "diverged at step {step}");
    let message = failure.to_string();
    assert!(
        message.contains(&format!("diverged at step {step}"))
            && message.contains("rolled back to the parameters of step 0"),
        "{message}"
    );
    trainer.write_back(&mut model)?;
    assert_eq!(
        model.parameters, before.parameters,
        "rolled back to the start"
    );
    // The trainer is still usable after the rollback.
    assert!(trainer.step(batch.x, batch.y, 0.1)?.loss.is_finite());
    Ok(())
}

/// A step whose graph fails to run says which step, where it rolled back
/// to and why (as its source), and restores both the parameters and the
/// optimizer state it had handed to the step.
#[test]
fn a_failed_step_keeps_its_cause_and_rolls_back_parameters_and_state() -> Result<()> {
    let model = build_model(&ModelConfig {
        optimizer: Optimizer::adam(),
        ..mlp_config()
    })?;
    let (train, _) = load_dir(datasets().join("mnist-10k"))?;
    let train = train.with_feature_shape(&[784])?;
    let batch = train.batches(16, None, true)?.next().unwrap();
    let mut trainer = Trainer::new(&model, &CpuBackend, 0)?;
    trainer.step(batch.x.clone(), batch.y.clone(), 0.01)?;

    let wrong_x = Value::f32(&[16, 783], vec![0.0; 16 * 783])?;
    let err = trainer.step(wrong_x, batch.y.clone(), 0.01).unwrap_err();
    let EngineError::Step {
        step: 2,
        rolled_back_to: 0,
        source,
    } = &err
    else {
        panic!("expected step 2 to fail and roll back to 0, got {err:?}");
    };
    assert!(
        matches!(&**source, EngineError::Input { name, .. } if name == "x"),
        "{source:?}"
    );
    let cause = std::error::Error::source(&err).map(ToString::to_string);
    assert_eq!(cause, Some(source.to_string()), "the cause is the source");
    assert_eq!(trainer.steps(), 0);

    // Back at step 0, Adam's state included: the next step is a fresh
    // trainer's first step, bit for bit.
    let mut fresh = Trainer::new(&model, &CpuBackend, 0)?;
    let again = trainer.step(batch.x.clone(), batch.y.clone(), 0.01)?;
    let first = fresh.step(batch.x, batch.y, 0.01)?;
    assert_eq!(again, first);
    let (mut a, mut b) = (model.clone(), model.clone());
    trainer.write_back(&mut a)?;
    fresh.write_back(&mut b)?;
    assert_eq!(a.parameters, b.parameters);
    Ok(())
}

/// Reference update rules, written out plainly, for one parameter tensor.
struct Reference {
    optimizer: Optimizer,
    slots: [Vec<f32>; 2],
}

impl Reference {
    fn new(optimizer: Optimizer, len: usize) -> Reference {
        Reference {
            optimizer,
            slots: [vec![0.0; len], vec![0.0; len]],
        }
    }

    fn update(&mut self, p: &mut [f32], g: &[f32], lr: f32, step: i32) {
        match self.optimizer {
            Optimizer::Sgd {
                momentum,
                nesterov,
                weight_decay,
            } => {
                for i in 0..p.len() {
                    let grad = g[i] + weight_decay * p[i];
                    let v = momentum * self.slots[0][i] + grad;
                    self.slots[0][i] = v;
                    let dir = if momentum == 0.0 {
                        grad
                    } else if nesterov {
                        grad + momentum * v
                    } else {
                        v
                    };
                    p[i] -= lr * dir;
                }
            }
            Optimizer::Adam {
                beta1,
                beta2,
                eps,
                weight_decay,
                decoupled,
            } => {
                for i in 0..p.len() {
                    let grad = if decoupled {
                        g[i]
                    } else {
                        g[i] + weight_decay * p[i]
                    };
                    let m = beta1 * self.slots[0][i] + (1.0 - beta1) * grad;
                    let v = beta2 * self.slots[1][i] + (1.0 - beta2) * grad * grad;
                    self.slots[0][i] = m;
                    self.slots[1][i] = v;
                    let m_hat = m / (1.0 - beta1.powi(step));
                    let v_hat = v / (1.0 - beta2.powi(step));
                    let mut dir = m_hat / (v_hat.sqrt() + eps);
                    if decoupled {
                        dir += weight_decay * p[i];
                    }
                    p[i] -= lr * dir;
                }
            }
        }
    }
}

#[test]
fn every_optimizer_matches_its_reference_update_over_three_steps() -> Result<()> {
    let (train, _) = load_dir(datasets().join("mnist-10k"))?;
    let train = train.with_feature_shape(&[784])?;
    let batches: Vec<_> = train.batches(16, Some(5), true)?.take(3).collect();
    let optimizers = [
        Optimizer::parse("sgd:momentum=0.9")?,
        Optimizer::parse("sgd:momentum=0.9,nesterov=true,weight_decay=0.01")?,
        Optimizer::parse("sgd:weight_decay=0.1")?,
        Optimizer::adam(),
        Optimizer::parse("adam:weight_decay=0.05")?,
        Optimizer::adamw(0.1),
    ];
    for optimizer in optimizers {
        let mut model = build_model(&ModelConfig {
            architecture: Architecture::LogReg {
                inputs: 784,
                classes: 10,
            },
            seed: 11,
            optimizer,
            frozen_prefixes: vec![],
            producer: "test".into(),
        })?;
        let loss_graph = model.entry(ENTRY_TRAIN_LOSS)?.clone();
        let grads = autodiff::grad(
            &loss_graph,
            "loss",
            &["params/linear.weight", "params/linear.bias"],
        )?;
        let mut grad_exec = CpuBackend.compile(&grads)?;
        let mut trainer = Trainer::new(&model, &CpuBackend, 0)?;
        let names = ["linear.weight", "linear.bias"];
        let mut reference: Vec<Reference> = names
            .iter()
            .map(|n| Reference::new(optimizer, model.parameter(n).unwrap().data.num_elements()))
            .collect();
        let mut expected: Vec<Vec<f32>> = names
            .iter()
            .map(|n| model.parameter(n).unwrap().data.as_f32().unwrap().to_vec())
            .collect();
        let lr = 0.05;
        for (step, batch) in batches.iter().enumerate() {
            // Gradients at the reference parameters, which equal the trainer's so far.
            let mut at = model.clone();
            for (n, values) in names.iter().zip(&expected) {
                at.parameter_mut(n).unwrap().data = canopy_ir::TensorData::f32(
                    at.parameter(n).unwrap().data.shape.clone(),
                    values.clone(),
                )
                .unwrap();
            }
            let g = grad_exec.run(inputs_for(&at, &grads, &batch.x, &batch.y))?;
            for k in 0..2 {
                reference[k].update(&mut expected[k], &g[k].to_f32_vec()?, lr, step as i32 + 1);
            }
            trainer.step(batch.x.clone(), batch.y.clone(), lr)?;
        }
        trainer.write_back(&mut model)?;
        for (n, want) in names.iter().zip(&expected) {
            let got = model.parameter(n).unwrap().data.as_f32().unwrap();
            for (i, (a, b)) in got.iter().zip(want).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-5 + 1e-4 * b.abs(),
                    "{optimizer}: {n}[{i}] {a} vs reference {b}"
                );
            }
        }
    }
    Ok(())
}

/// Multiply-adds of a graph's matmuls and convolutions at batch `n`, from
/// static shapes: a deterministic measure of a step's work, where a timed
/// assertion would be flaky.
fn multiply_adds(graph: &canopy_ir::Graph, n: usize) -> usize {
    use canopy_ir::Op;
    let dims = |id: canopy_ir::ValueId| graph.ty(id).shape.resolve(n);
    graph
        .nodes()
        .iter()
        .map(|node| match &node.op {
            Op::MatMul { transpose_a, .. } => {
                let a = dims(node.inputs[0]);
                let k = if *transpose_a {
                    a[a.len() - 2]
                } else {
                    a[a.len() - 1]
                };
                node.ty.shape.resolve(n).iter().product::<usize>() * k
            }
            // Each conv-family op costs output elements × the reduction length.
            Op::Conv2d(_) => {
                let w = dims(node.inputs[1]);
                node.ty.shape.resolve(n).iter().product::<usize>() * w[1] * w[2] * w[3]
            }
            Op::Conv2dBackwardInput { .. } => {
                let w = dims(node.inputs[1]);
                dims(node.inputs[0]).iter().product::<usize>() * w[1] * w[2] * w[3]
            }
            Op::Conv2dBackwardFilter { .. } => {
                let dy = dims(node.inputs[1]);
                node.ty.shape.resolve(n).iter().product::<usize>() * dy[0] * dy[2] * dy[3]
            }
            _ => 0,
        })
        .sum()
}

#[test]
fn frozen_backbone_step_does_far_less_work_than_full_fine_tuning() -> Result<()> {
    let full = lenet(&[], Optimizer::sgd())?;
    let head = lenet(&["conv", "fc1"], Optimizer::sgd())?;
    let full_work = multiply_adds(full.entry("train_step")?, 64);
    let head_work = multiply_adds(head.entry("train_step")?, 64);
    let forward_work = multiply_adds(full.entry("eval")?, 64);
    println!(
        "multiply-adds per step at N=64: full {full_work}, frozen {head_work}, forward {forward_work}"
    );
    // The frozen step is the forward pass plus a small head backward.
    assert!(
        head_work < full_work / 2,
        "frozen {head_work} vs full {full_work}"
    );
    assert!(
        head_work < forward_work * 11 / 10,
        "frozen {head_work} vs forward {forward_work}"
    );
    Ok(())
}

/// The standard deviation of a model parameter's values.
fn parameter_std(model: &Model, name: &str) -> f64 {
    let values = model.parameter(name).unwrap().data.as_f32().unwrap();
    let n = values.len() as f64;
    let mean = values.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
    (values
        .iter()
        .map(|&v| (f64::from(v) - mean).powi(2))
        .sum::<f64>()
        / n)
        .sqrt()
}

#[test]
fn the_default_scheme_draws_he_before_relu_and_xavier_for_the_logits() -> Result<()> {
    let mut config = mlp_config();
    config.architecture = Architecture::Mlp {
        inputs: 784,
        hidden: 512,
        classes: 10,
    };
    let model = build_model(&config)?;
    assert_eq!(model.metadata.properties[PROP_INIT], "he");
    let within = |actual: f64, expected: f64| (actual / expected - 1.0).abs() < 0.05;
    let fc1 = parameter_std(&model, "fc1.weight");
    assert!(within(fc1, (2.0 / 784.0f64).sqrt()), "fc1 std {fc1}");
    let fc2 = parameter_std(&model, "fc2.weight");
    assert!(within(fc2, (2.0 / 522.0f64).sqrt()), "fc2 std {fc2}");
    for bias in ["fc1.bias", "fc2.bias"] {
        let values = model.parameter(bias).unwrap().data.as_f32().unwrap();
        assert!(values.iter().all(|&b| b == 0.0), "{bias} starts at zero");
    }
    assert_eq!(build_model(&config)?, model, "a seed fixes the model");

    let uniform = build_model_with_init(&config, Initializer::Uniform)?;
    assert_eq!(uniform.metadata.properties[PROP_INIT], "uniform");
    let bound = 1.0 / 784.0f32.sqrt();
    let fc1 = uniform
        .parameter("fc1.weight")
        .unwrap()
        .data
        .as_f32()
        .unwrap();
    assert!(fc1.iter().all(|v| v.abs() <= bound));
    let fc1 = parameter_std(&uniform, "fc1.weight");
    assert!(
        within(fc1, f64::from(bound) / 3f64.sqrt()),
        "uniform fc1 std {fc1}"
    );
    Ok(())
}
