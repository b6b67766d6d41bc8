//! The CPU's fused kernels compute bit for bit what the unfused graph
//! does: each member runs its op's own scalar function. Checked on whole
//! training steps of the zoo's models (a matmul heading its bias and
//! activation, optimizer updates, loop bodies) and on graphs built to
//! reach every broadcast, bool and in-place path.

use canopy_ir::{BinaryOp, DType, Graph, Model, TensorType, UnaryOp};

use super::{CpuBackendWithFusion, CpuExecutable, fusion_report};
use crate::backend::Executable;
use crate::optim::Optimizer;
use crate::recurrent::Cell;
use crate::train::Trainer;
use crate::value::Value;
use crate::zoo::{Architecture, ModelConfig, build_model};

fn model(architecture: Architecture) -> Model {
    build_model(&ModelConfig {
        architecture,
        seed: 3,
        optimizer: Optimizer::adam(),
        frozen_prefixes: Vec::new(),
        producer: "fusion test".into(),
    })
    .unwrap()
}

/// Losses of `steps` training steps and the weights after them.
fn train(model: &Model, fuse: bool, x: &Value, y: &Value, steps: usize) -> (Vec<u32>, Model) {
    let mut trainer = Trainer::new(model, &CpuBackendWithFusion { fuse }, 0).unwrap();
    let losses = (0..steps)
        .map(|_| {
            trainer
                .step(x.clone(), y.clone(), 0.05)
                .unwrap()
                .loss
                .to_bits()
        })
        .collect();
    let mut trained = model.clone();
    trainer.write_back(&mut trained).unwrap();
    (losses, trained)
}

fn assert_same_training(architecture: Architecture, x: Value, y: Value) {
    let model = model(architecture);
    let step = model.entry("train_step").unwrap();
    let report = fusion_report(step).unwrap();
    assert!(
        report.after_fusion < report.nodes && !report.groups.is_empty(),
        "nothing fused in {}: {report:?}",
        model.metadata.model_name
    );
    let (fused_losses, fused) = train(&model, true, &x, &y, 3);
    let (plain_losses, plain) = train(&model, false, &x, &y, 3);
    assert_eq!(fused_losses, plain_losses);
    for (a, b) in fused.parameters.iter().zip(&plain.parameters) {
        assert_eq!(a.data, b.data, "parameter {} differs", a.name);
    }
}

fn pattern(len: usize, scale: f32) -> Vec<f32> {
    (0..len)
        .map(|i| ((i * 37 % 101) as f32 / 50.0 - 1.0) * scale)
        .collect()
}

#[test]
fn an_mlp_and_lenet_train_bit_for_bit_fused_and_unfused() {
    let mlp = Architecture::Mlp {
        inputs: 12,
        hidden: 8,
        classes: 3,
    };
    let x = Value::f32(&[5, 12], pattern(60, 2.0)).unwrap();
    let y = Value::i64(&[5], vec![0, 1, 2, 1, 0]).unwrap();
    assert_same_training(mlp, x, y);
    let x = Value::f32(&[2, 1, 28, 28], pattern(2 * 784, 1.0)).unwrap();
    let y = Value::i64(&[2], vec![3, 7]).unwrap();
    assert_same_training(Architecture::LeNet5 { classes: 10 }, x, y);
}

#[test]
fn recurrent_models_train_bit_for_bit_fused_and_unfused() {
    for cell in [Cell::Gru, Cell::Lstm] {
        let charlm = Architecture::CharLm {
            vocabulary: 11,
            sequence: 6,
            embedding: 4,
            hidden: 8,
            layers: 2,
            cell,
            unrolled: false,
        };
        let x: Vec<f32> = (0..18).map(|i| (i * 7 % 11) as f32).collect();
        let x = Value::f32(&[3, 6], x).unwrap();
        let y = Value::i64(&[3], vec![1, 10, 4]).unwrap();
        assert_same_training(charlm, x, y);
    }
}

/// Runs `graph` fused and unfused and compares every output bit for bit
/// (NaN included).
fn assert_same_outputs(graph: &Graph, inputs: Vec<Value>) -> Vec<Value> {
    let mut fused = CpuExecutable::compile(graph, true).unwrap();
    let mut plain = CpuExecutable::compile(graph, false).unwrap();
    let got = fused.run(inputs.clone()).unwrap();
    let want = plain.run(inputs).unwrap();
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(&want) {
        assert_eq!((g.dtype(), g.shape()), (w.dtype(), w.shape()));
        assert_eq!(bits(g), bits(w));
    }
    got
}

/// Every element's bits, so that NaN equals NaN and -0 differs from 0.
fn bits(value: &Value) -> Vec<u32> {
    match value {
        Value::F32(a) => a.iter().map(|v| v.to_bits()).collect(),
        Value::Bool(a) => a.iter().map(|&v| u32::from(v)).collect(),
        other => panic!("unexpected dtype {}", other.dtype()),
    }
}

#[test]
fn broadcasts_bools_nan_and_large_tensors_match_the_unfused_kernels() {
    for (batch, spatial) in [(2usize, 3usize), (4, 160), (0, 3)] {
        let mut g = Graph::new();
        let x = g
            .input("x", TensorType::f32(&[batch, 5, spatial, spatial]))
            .unwrap();
        let channel = g.input("channel", TensorType::f32(&[5, 1, 1])).unwrap();
        let row = g.input("row", TensorType::f32(&[spatial])).unwrap();
        // Varies along axes 0 and 3, not adjacent: spelled out once.
        let corner = g
            .input("corner", TensorType::f32(&[batch, 1, 1, spatial]))
            .unwrap();
        let half = g.scalar(0.5).unwrap();
        let zero = g.scalar(0.0).unwrap();
        let a = g.binary(BinaryOp::Mul, x, channel).unwrap();
        let b = g.binary(BinaryOp::Add, a, row).unwrap();
        let c = g.binary(BinaryOp::Sub, b, corner).unwrap();
        let positive = g.binary(BinaryOp::Gt, c, zero).unwrap();
        let small = g.binary(BinaryOp::Lt, c, half).unwrap();
        let both = g.binary(BinaryOp::And, positive, small).unwrap();
        let neither = g.unary(UnaryOp::Not, both).unwrap();
        let picked = g.select(neither, c, half).unwrap();
        let mask = g.cast(both, DType::F32).unwrap();
        let soft = g.unary(UnaryOp::Softplus, picked).unwrap();
        let out = g.binary(BinaryOp::Add, soft, mask).unwrap();
        let flag = g.cast(out, DType::Bool).unwrap();
        g.set_outputs(vec![("out".into(), out), ("flag".into(), flag)])
            .unwrap();
        let report = fusion_report(&g).unwrap();
        assert!(report.groups.iter().any(|group| group.members.len() >= 10));
        let n = batch * 5 * spatial * spatial;
        let mut xs = pattern(n, 3.0);
        if n > 0 {
            xs[n / 2] = f32::NAN;
        }
        let inputs = vec![
            Value::f32(&[batch, 5, spatial, spatial], xs).unwrap(),
            Value::f32(&[5, 1, 1], pattern(5, 1.5)).unwrap(),
            Value::f32(&[spatial], pattern(spatial, 0.7)).unwrap(),
            Value::f32(&[batch, 1, 1, spatial], pattern(batch * spatial, 0.3)).unwrap(),
        ];
        let outputs = assert_same_outputs(&g, inputs);
        assert_eq!(outputs[0].shape(), [batch, 5, spatial, spatial]);
    }
}

#[test]
fn a_matmul_heads_its_bias_and_activation_and_a_graph_output_stays_its_own() {
    let mut g = Graph::new();
    let x = g.input("x", TensorType::f32(&[7, 6])).unwrap();
    let w = g.input("w", TensorType::f32(&[6, 4])).unwrap();
    let bias = g.input("bias", TensorType::f32(&[4])).unwrap();
    let product = g.matmul(x, w).unwrap();
    let biased = g.binary(BinaryOp::Add, product, bias).unwrap();
    let hidden = g.unary(UnaryOp::Relu, biased).unwrap();
    let doubled = g.binary(BinaryOp::Add, hidden, hidden).unwrap();
    g.set_outputs(vec![("hidden".into(), hidden), ("doubled".into(), doubled)])
        .unwrap();
    let report = fusion_report(&g).unwrap();
    let group = report
        .groups
        .iter()
        .find(|group| group.head == Some(product.index()))
        .expect("the matmul heads a group");
    assert_eq!(
        group.members,
        [product.index(), biased.index(), hidden.index()]
    );
    assert_eq!(report.after_fusion, g.len() - 2);
    let inputs = vec![
        Value::f32(&[7, 6], pattern(42, 1.0)).unwrap(),
        Value::f32(&[6, 4], pattern(24, 0.5)).unwrap(),
        Value::f32(&[4], pattern(4, 0.2)).unwrap(),
    ];
    assert_same_outputs(&g, inputs);
}
