//! Recurrent layers and the `charlm` architecture: each cell against its
//! equations computed by hand in f64, derivatives against finite
//! differences, a graph whose size does not grow with the sequence, and a
//! model that learns to predict Shakespeare's next character.

mod common;

use std::ops::ControlFlow;

use canopy_engine::data::{Part, load_shakespeare, most_frequent_character_baseline};
use canopy_engine::nn::{ForwardCtx, Layer, Params};
use canopy_engine::optim::Optimizer;
use canopy_engine::recurrent::{Cell, Recurrent};
use canopy_engine::train::{FitConfig, Trainer, evaluate, fit};
use canopy_engine::zoo::{Architecture, ModelConfig, build_model};
use canopy_engine::{CpuBackend, Value, trace};
use canopy_ir::model::ENTRY_TRAIN_STEP;
use canopy_ir::{DType, Dim, Shape, TensorType};
use common::{Rng, check_vjp_jvp, run, to_f64};

/// The layer traced on its own: inputs x [N, T, F] and its four weights.
fn layer_graph(layer: &Recurrent, steps: usize) -> canopy_ir::Graph {
    let specs = layer.params();
    let mut inputs: Vec<(String, TensorType)> = specs
        .iter()
        .map(|s| (s.name.clone(), TensorType::f32(&s.shape)))
        .collect();
    let x_ty = TensorType::new(
        DType::F32,
        Shape(vec![
            Dim::Batch,
            Dim::Fixed(steps),
            Dim::Fixed(layer.inputs),
        ]),
    );
    inputs.push(("x".into(), x_ty));
    let refs: Vec<(&str, TensorType)> = inputs
        .iter()
        .map(|(n, t)| (n.as_str(), t.clone()))
        .collect();
    trace(&refs, |args| {
        let params = Params(
            specs
                .iter()
                .zip(args)
                .map(|(s, t)| (s.name.clone(), t.clone()))
                .collect(),
        );
        let y = layer.forward(&params, &args[specs.len()], &ForwardCtx::inference())?;
        Ok(vec![("y".into(), y)])
    })
    .expect("trace")
}

fn random(shape: &[usize], rng: &mut Rng) -> Value {
    let n = shape.iter().product();
    Value::f32(shape, (0..n).map(|_| rng.uniform()).collect()).expect("shape")
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// The cell's equations in f64, step by step: [N, T, H].
fn reference(
    cell: Cell,
    w: &[Vec<f64>],
    x: &[f64],
    n: usize,
    t: usize,
    f: usize,
    h: usize,
) -> Vec<f64> {
    let (w_ih, w_hh, b_ih, b_hh) = (&w[0], &w[1], &w[2], &w[3]);
    let gates = w_hh.len() / (h * h);
    let mut out = vec![0.0; n * t * h];
    for b in 0..n {
        let (mut state, mut memory) = (vec![0.0; h], vec![0.0; h]);
        for s in 0..t {
            let pre = |from_x: bool, g: usize, j: usize| -> f64 {
                if from_x {
                    let mut acc = b_ih[g * h + j];
                    for k in 0..f {
                        acc += x[(b * t + s) * f + k] * w_ih[k * gates * h + g * h + j];
                    }
                    acc
                } else {
                    let mut acc = b_hh[g * h + j];
                    for k in 0..h {
                        acc += state[k] * w_hh[k * gates * h + g * h + j];
                    }
                    acc
                }
            };
            let mut next = vec![0.0; h];
            let mut next_memory = vec![0.0; h];
            for j in 0..h {
                match cell {
                    Cell::Gru => {
                        let r = sigmoid(pre(true, 0, j) + pre(false, 0, j));
                        let z = sigmoid(pre(true, 1, j) + pre(false, 1, j));
                        let c = (pre(true, 2, j) + r * pre(false, 2, j)).tanh();
                        next[j] = (1.0 - z) * c + z * state[j];
                    }
                    Cell::Lstm => {
                        let gate = |g| pre(true, g, j) + pre(false, g, j);
                        let (i, fg, g, o) = (
                            sigmoid(gate(0)),
                            sigmoid(gate(1)),
                            gate(2).tanh(),
                            sigmoid(gate(3)),
                        );
                        next_memory[j] = fg * memory[j] + i * g;
                        next[j] = o * next_memory[j].tanh();
                    }
                }
            }
            state = next;
            memory = next_memory;
            out[(b * t + s) * h..(b * t + s + 1) * h].copy_from_slice(&state);
        }
    }
    out
}

#[test]
fn each_cell_computes_its_equations() {
    let (n, t, f, h) = (2, 5, 3, 4);
    for cell in [Cell::Gru, Cell::Lstm] {
        let layer = Recurrent::new("rnn", cell, f, h);
        let graph = layer_graph(&layer, t);
        let mut rng = Rng(21);
        let mut inputs: Vec<Value> = layer
            .params()
            .iter()
            .map(|s| random(&s.shape, &mut rng))
            .collect();
        inputs.push(random(&[n, t, f], &mut rng));
        let got = to_f64(&run(&graph, inputs.clone())[0]);
        let w: Vec<Vec<f64>> = inputs[..4].iter().map(to_f64).collect();
        let want = reference(cell, &w, &to_f64(&inputs[4]), n, t, f, h);
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!(
                (a - b).abs() < 1e-5,
                "{} element {i}: {a} vs {b}",
                cell.name()
            );
        }
    }
}

#[test]
fn each_cell_differentiates_in_both_modes_and_twice() {
    for cell in [Cell::Gru, Cell::Lstm] {
        let layer = Recurrent::new("rnn", cell, 2, 3);
        let graph = layer_graph(&layer, 3);
        let mut rng = Rng(22);
        let mut inputs: Vec<Value> = layer
            .params()
            .iter()
            .map(|s| random(&s.shape, &mut rng))
            .collect();
        inputs.push(random(&[2, 3, 2], &mut rng));
        check_vjp_jvp(&graph, &inputs);
    }
}

/// Samples of one role's part, every window of `sequence` characters.
fn role_samples(
    play: &str,
    speaker: &str,
    part: Part,
    sequence: usize,
) -> canopy_engine::data::Dataset {
    let roles = load_shakespeare("../datasets/shakespeare").expect("the plays load");
    let role = roles
        .iter()
        .find(|r| r.play == play && r.speaker == speaker)
        .expect("the role");
    role.next_character_samples(part, sequence)
        .expect("samples")
}

/// A GRU `charlm` trained centrally on Hamlet's lines beats the
/// most-frequent-character baseline on the lines it was not trained on.
#[test]
fn a_charlm_learns_hamlets_next_character() {
    let sequence = 20;
    let architecture = Architecture::CharLm {
        vocabulary: canopy_engine::data::VOCABULARY_SIZE,
        sequence,
        embedding: 8,
        hidden: 64,
        layers: 1,
        cell: Cell::Gru,
        unrolled: false,
    };
    let config = ModelConfig {
        architecture,
        seed: 1,
        optimizer: Optimizer::parse("adam").expect("adam"),
        frozen_prefixes: vec![],
        producer: "test".into(),
    };
    let mut model = build_model(&config).expect("model");
    let all = role_samples("hamlet", "HAM", Part::Train, sequence);
    let train = all.subset(&(0..20_000).collect::<Vec<_>>());
    let test = role_samples("hamlet", "HAM", Part::Test, sequence);
    let started = std::time::Instant::now();
    let mut trainer = Trainer::new(&model, &CpuBackend, 1).expect("trainer");
    let epochs = fit(
        &mut trainer,
        &train,
        &FitConfig::new(1, 32, 0.01, 1),
        &mut |_| ControlFlow::Continue(()),
    )
    .expect("fit");
    trainer.write_back(&mut model).expect("write back");
    let stats = evaluate(&model, &test, 256, &CpuBackend).expect("evaluate");
    let roles = load_shakespeare("../datasets/shakespeare").expect("plays");
    let hamlet: Vec<_> = roles
        .into_iter()
        .filter(|r| r.play == "hamlet" && r.speaker == "HAM")
        .collect();
    let (_, baseline) = most_frequent_character_baseline(&hamlet, sequence);
    eprintln!(
        "{} training samples, {:?}: train {:?}, test accuracy {:.3} (baseline {baseline:.3}), {:.1} s",
        train.len(),
        model.entry(ENTRY_TRAIN_STEP).map(|g| g.len()),
        epochs.last(),
        stats.accuracy,
        started.elapsed().as_secs_f64()
    );
    assert!(
        stats.accuracy > baseline + 0.1,
        "{} vs baseline {baseline}",
        stats.accuracy
    );
}

/// A `charlm` trains on the GPU as on the CPU: its loops run there, with
/// the parameters and the optimizer state resident on the device, over
/// the same batches; after a few Adam steps its parameters are the CPU's,
/// and its evaluation on the GPU gives the CPU's loss.
#[test]
fn a_charlm_trains_and_evaluates_on_the_gpu_as_on_the_cpu() {
    let Some(gpu) = common::gpu_under_test() else {
        return;
    };
    let sequence = 8;
    let train = role_samples("hamlet", "HAM", Part::Train, sequence);
    let train = train.subset(&(0..128).collect::<Vec<_>>());
    let test = role_samples("hamlet", "HAM", Part::Test, sequence);
    let test = test.subset(&(0..100).collect::<Vec<_>>());
    for (cell, layers) in [(Cell::Gru, 1), (Cell::Lstm, 2)] {
        let config = ModelConfig {
            architecture: Architecture::CharLm {
                vocabulary: canopy_engine::data::VOCABULARY_SIZE,
                sequence,
                embedding: 4,
                hidden: 8,
                layers,
                cell,
                unrolled: false,
            },
            seed: 3,
            optimizer: Optimizer::parse("adam").expect("adam"),
            frozen_prefixes: vec![],
            producer: "test".into(),
        };
        let start = build_model(&config).expect("model");
        let trained = |backend: &dyn canopy_engine::Backend| {
            let mut trainer = Trainer::new(&start, backend, 1).expect("trainer");
            fit(
                &mut trainer,
                &train,
                &FitConfig::new(1, 32, 0.01, 1),
                &mut |_| ControlFlow::Continue(()),
            )
            .expect("fit");
            let mut model = start.clone();
            trainer.write_back(&mut model).expect("write back");
            model
        };
        let (on_cpu, on_gpu) = (trained(&CpuBackend), trained(&gpu));
        let what = cell.name();
        let mut moved = false;
        for (c, g) in on_cpu.parameters.iter().zip(&on_gpu.parameters) {
            let (c, g) = (c.data.as_f32().expect("f32"), g.data.as_f32().expect("f32"));
            let norm = |v: &mut dyn Iterator<Item = f32>| {
                v.map(|x| f64::from(x).powi(2)).sum::<f64>().sqrt()
            };
            let difference = norm(&mut c.iter().zip(g).map(|(a, b)| a - b));
            assert!(
                difference <= 1e-4 * norm(&mut c.iter().copied()),
                "{what}: CPU and GPU differ by {difference} in L2"
            );
        }
        for (p, s) in on_gpu.parameters.iter().zip(&start.parameters) {
            moved |= p.trainable && p.data != s.data;
        }
        assert!(moved, "{what}: training moved the parameters");
        let cpu = evaluate(&on_gpu, &test, 64, &CpuBackend).expect("CPU evaluation");
        let on_device = evaluate(&on_gpu, &test, 64, &gpu).expect("GPU evaluation");
        assert_eq!(cpu.samples, on_device.samples);
        assert!(
            (cpu.loss - on_device.loss).abs() <= 1e-5 * cpu.loss.abs().max(1.0),
            "{what}: CPU {cpu:?}, GPU {on_device:?}"
        );
    }
}

/// Nodes of a graph and of every graph nested in it.
fn all_nodes(graph: &canopy_ir::Graph) -> usize {
    graph.len()
        + graph
            .nodes()
            .iter()
            .flat_map(|n| n.op.subgraphs())
            .map(all_nodes)
            .sum::<usize>()
}

/// No unrolling: the shipped `train_step` of a `charlm` reading 80
/// characters (the loop's bodies counted) is smaller than the same model
/// reading 8, unrolled.
#[test]
fn a_charlm_of_80_steps_is_smaller_than_8_steps_unrolled() {
    let train_step = |architecture: Architecture| {
        let config = ModelConfig {
            architecture,
            seed: 1,
            optimizer: Optimizer::sgd(),
            frozen_prefixes: vec![],
            producer: "test".into(),
        };
        let model = build_model(&config).expect("model");
        all_nodes(model.entry(ENTRY_TRAIN_STEP).expect("train_step"))
    };
    let vocabulary = canopy_engine::data::VOCABULARY_SIZE;
    for base in [
        Architecture::charlm(vocabulary),
        Architecture::charlm_fedavg(vocabulary),
    ] {
        let Architecture::CharLm {
            vocabulary,
            embedding,
            hidden,
            layers,
            cell,
            ..
        } = base.clone()
        else {
            unreachable!("a charlm")
        };
        let looped = train_step(base);
        let short = Architecture::CharLm {
            vocabulary,
            sequence: 8,
            embedding,
            hidden,
            layers,
            cell,
            unrolled: false,
        };
        let unrolled = train_step(short.unrolled());
        eprintln!(
            "{} × {layers}: 80 steps as a loop {looped} nodes, 8 steps unrolled {unrolled}",
            cell.name()
        );
        assert!(looped < unrolled, "{looped} vs {unrolled}");
    }
}
