//! Forward references for the ops defined by composition (layer and batch
//! normalisation, global average pooling), computed by hand, on every
//! backend; their derivatives are in the conformance suite.

mod common;

use canopy_engine::Value;
use canopy_ir::{Graph, TensorType, ValueId};

fn input(
    g: &mut Graph,
    inputs: &mut Vec<Value>,
    name: &str,
    shape: &[usize],
    data: &[f32],
) -> ValueId {
    inputs.push(Value::f32(shape, data.to_vec()).unwrap());
    g.input(name, TensorType::f32(shape)).unwrap()
}

fn assert_values(got: &Value, want: &[f32]) {
    let got: Vec<f32> = got.as_f32().unwrap().iter().copied().collect();
    assert_eq!(got.len(), want.len(), "{got:?} vs {want:?}");
    for (g, w) in got.iter().zip(want) {
        assert!(
            (g - w).abs() <= 1e-5 * w.abs().max(1.0),
            "got {got:?}, want {want:?}"
        );
    }
}

#[test]
fn layer_norm_standardises_each_row() {
    let (mut g, mut inputs) = (Graph::new(), Vec::new());
    let x = input(
        &mut g,
        &mut inputs,
        "x",
        &[2, 4],
        &[1.0, 2.0, 3.0, 4.0, 2.0, 2.0, 2.0, 6.0],
    );
    let scale = input(&mut g, &mut inputs, "scale", &[4], &[1.0, 1.0, 2.0, 1.0]);
    let bias = input(&mut g, &mut inputs, "bias", &[4], &[0.0, 0.0, 0.0, 10.0]);
    let y = g.layer_norm(x, [scale, bias], 1, 0.0).unwrap();
    g.set_output("y", y).unwrap();
    let out = common::run(&g, inputs);
    // Row 1: mean 2.5, variance 1.25; row 2: mean 3, variance 3.
    let (a, b) = (1.0 / 1.25f32.sqrt(), 1.0 / 3.0f32.sqrt());
    assert_values(
        &out[0],
        &[
            -1.5 * a,
            -0.5 * a,
            2.0 * 0.5 * a,
            10.0 + 1.5 * a,
            -b,
            -b,
            2.0 * -b,
            10.0 + 3.0 * b,
        ],
    );
}

#[test]
fn batch_norm_uses_running_statistics_for_inference_and_the_batch_for_training() {
    let (mut g, mut inputs) = (Graph::new(), Vec::new());
    // [N=2, C=2, 1, 2]: channel 0 holds 1, 3, 5, 7; channel 1 holds 2, 2, 4, 4.
    let x = input(
        &mut g,
        &mut inputs,
        "x",
        &[2, 2, 1, 2],
        &[1.0, 3.0, 2.0, 2.0, 5.0, 7.0, 4.0, 4.0],
    );
    let scale = input(&mut g, &mut inputs, "scale", &[2], &[2.0, 1.0]);
    let bias = input(&mut g, &mut inputs, "bias", &[2], &[0.0, 1.0]);
    let mean = input(&mut g, &mut inputs, "mean", &[2], &[1.0, 0.0]);
    let var = input(&mut g, &mut inputs, "var", &[2], &[4.0, 1.0]);
    let inference = g
        .batch_norm_inference(x, [scale, bias, mean, var], 0.0)
        .unwrap();
    let (training, batch_mean, batch_var) = g.batch_norm_training(x, [scale, bias], 0.0).unwrap();
    g.set_outputs(vec![
        ("inference".into(), inference),
        ("training".into(), training),
        ("mean".into(), batch_mean),
        ("var".into(), batch_var),
    ])
    .unwrap();
    let out = common::run(&g, inputs);
    // Inference: channel 0 is (x − 1) / 2 · 2, channel 1 is x + 1.
    assert_values(&out[0], &[0.0, 2.0, 3.0, 3.0, 4.0, 6.0, 5.0, 5.0]);
    // Training: channel 0 has mean 4, variance 5; channel 1 mean 3, variance 1.
    let s = 2.0 / 5.0f32.sqrt();
    assert_values(&out[1], &[-3.0 * s, -s, 0.0, 0.0, s, 3.0 * s, 2.0, 2.0]);
    assert_values(&out[2], &[4.0, 3.0]);
    assert_values(&out[3], &[5.0, 1.0]);
}

#[test]
fn global_average_pooling_means_each_plane() {
    let (mut g, mut inputs) = (Graph::new(), Vec::new());
    let data: Vec<f32> = (0..12).map(|i| i as f32).collect();
    let x = input(&mut g, &mut inputs, "x", &[1, 2, 2, 3], &data);
    let y = g.global_avg_pool(x).unwrap();
    g.set_output("y", y).unwrap();
    let out = common::run(&g, inputs);
    assert_eq!(out[0].shape(), &[1, 2, 1, 1]);
    assert_values(&out[0], &[2.5, 8.5]);
}

#[test]
fn malformed_composites_are_refused_by_shape() {
    let (mut g, mut inputs) = (Graph::new(), Vec::new());
    let x = input(&mut g, &mut inputs, "x", &[2, 3], &[0.0; 6]);
    let wrong = input(&mut g, &mut inputs, "wrong", &[2], &[0.0; 2]);
    let err = g
        .batch_norm_inference(x, [wrong; 4], 1e-5)
        .unwrap_err()
        .to_string();
    assert!(err.contains("shape [3]"), "{err}");
    let err = g.global_avg_pool(x).unwrap_err().to_string();
    assert!(err.contains("[N, C, H, W]"), "{err}");
    let err = g
        .layer_norm(x, [wrong, wrong], 2, 1e-5)
        .unwrap_err()
        .to_string();
    assert!(err.contains("from axis 2"), "{err}");
    let err = g
        .layer_norm(x, [wrong, wrong], 1, f32::NAN)
        .unwrap_err()
        .to_string();
    assert!(err.contains("epsilon"), "{err}");
}
