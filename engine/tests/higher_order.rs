//! Higher-order derivatives: derivative graphs are ordinary graphs, so
//! they can be differentiated again; and custom gradient rules replace the
//! derived ones.

mod common;

use canopy_engine::Value;
use canopy_ir::autodiff::{call_custom, grad, jvp, vjp};
use canopy_ir::{Dim, Graph, Op, Shape, TensorType, UnaryOp};
use common::{Tolerance, assert_close, run, to_f64};
use proptest::prelude::*;

fn cube() -> Graph {
    let mut g = Graph::new();
    let x = g.input("x", TensorType::f32(&[])).unwrap();
    let x2 = g.mul(x, x).unwrap();
    let x3 = g.mul(x2, x).unwrap();
    g.set_output("y", x3).unwrap();
    g
}

proptest! {
    #![proptest_config(proptest::test_runner::Config { cases: common::proptest_cases(), failure_persistence: None, ..Default::default() })]

    #[test]
    fn second_derivative_of_cube_is_6x(x in -3.0f32..3.0) {
        let d1 = grad(&cube(), "y", &["x"]).unwrap();
        let d2 = grad(&d1, "grad/x", &["x"]).unwrap();
        let out = run(&d2, vec![Value::scalar_f32(x)]);
        let got = out[0].to_scalar_f32().unwrap();
        prop_assert!((got - 6.0 * x).abs() <= 1e-4 * (1.0 + x.abs()), "{got} vs {}", 6.0 * x);

        let d3 = grad(&d2, "grad/x", &["x"]).unwrap();
        let third = run(&d3, vec![Value::scalar_f32(x)])[0].to_scalar_f32().unwrap();
        prop_assert!((third - 6.0).abs() <= 1e-4, "third derivative {third}");
    }
}

/// Softmax cross-entropy of a two-layer MLP with a tanh hidden layer (so
/// the loss has curvature everywhere): loss(w1, w2; x, labels).
fn mlp_loss(batch: usize, d_in: usize, hidden: usize, classes: usize) -> Graph {
    let mut g = Graph::new();
    let x = g.input("x", TensorType::f32(&[batch, d_in])).unwrap();
    let labels_ty = TensorType::new(canopy_ir::DType::I64, Shape(vec![Dim::Fixed(batch)]));
    let labels = g.input("labels", labels_ty).unwrap();
    let w1 = g.input("w1", TensorType::f32(&[d_in, hidden])).unwrap();
    let w2 = g.input("w2", TensorType::f32(&[hidden, classes])).unwrap();
    let h = g.matmul(x, w1).unwrap();
    let h = g.unary(UnaryOp::Tanh, h).unwrap();
    let h = g.unary(UnaryOp::Gelu, h).unwrap();
    let logits = g.matmul(h, w2).unwrap();
    let logp = g.log_softmax(logits, 1).unwrap();
    let onehot = g.push(Op::OneHot { depth: classes }, &[labels]).unwrap();
    let picked = g.mul(logp, onehot).unwrap();
    let total = g.sum_all(picked).unwrap();
    let n = g.scalar(batch as f32).unwrap();
    let mean = g.div(total, n).unwrap();
    let loss = g.neg(mean).unwrap();
    g.set_output("loss", loss).unwrap();
    g
}

fn random(rng: &mut common::Rng, shape: &[usize], scale: f32) -> Value {
    let n = shape.iter().product();
    Value::f32(shape, (0..n).map(|_| scale * rng.uniform()).collect()).unwrap()
}

/// H·v by forward-over-reverse: the JVP of the gradient graph.
#[test]
fn hessian_vector_product_matches_finite_differences_of_the_gradient() {
    let (b, d, h, c) = (4, 3, 5, 3);
    let loss = mlp_loss(b, d, h, c);
    let gradient = grad(&loss, "loss", &["w1", "w2"]).unwrap();
    let hvp = jvp(&gradient, &["w1", "w2"]).unwrap();

    let mut rng = common::Rng(42);
    let x = random(&mut rng, &[b, d], 1.5);
    let labels = Value::i64(&[b], vec![0, 2, 1, 2]).unwrap();
    let w1 = random(&mut rng, &[d, h], 1.0);
    let w2 = random(&mut rng, &[h, c], 1.0);
    let v1 = random(&mut rng, &[d, h], 1.0);
    let v2 = random(&mut rng, &[h, c], 1.0);

    let inputs = |w1: &Value, w2: &Value| vec![x.clone(), labels.clone(), w1.clone(), w2.clone()];
    let out = run(
        &hvp,
        [inputs(&w1, &w2), vec![v1.clone(), v2.clone()]].concat(),
    );
    let (hv1, hv2) = (to_f64(&out[2]), to_f64(&out[3]));

    // (∇L(w + εv) − ∇L(w − εv)) / 2ε
    let eps = 1e-2f32;
    let shift = |w: &Value, v: &Value, s: f32| {
        let (w, v) = (w.as_f32().unwrap(), v.as_f32().unwrap());
        Value::F32(w + &(v * s))
    };
    let plus = run(
        &gradient,
        inputs(&shift(&w1, &v1, eps), &shift(&w2, &v2, eps)),
    );
    let minus = run(
        &gradient,
        inputs(&shift(&w1, &v1, -eps), &shift(&w2, &v2, -eps)),
    );
    let fd = |k: usize| -> Vec<f64> {
        to_f64(&plus[k])
            .iter()
            .zip(to_f64(&minus[k]))
            .map(|(p, m)| (p - m) / (2.0 * f64::from(eps)))
            .collect()
    };
    let tol = Tolerance::default();
    assert_close("H·v for w1", &hv1, &fd(0), tol);
    assert_close("H·v for w2", &hv2, &fd(1), tol);

    // Reverse-over-reverse gives the same product: ∇(⟨∇L, v⟩).
    let rr = grad_of_directional_gradient(&gradient);
    let out = run(&rr, [inputs(&w1, &w2), vec![v1, v2]].concat());
    assert_close("reverse-over-reverse w1", &to_f64(&out[0]), &hv1, tol);
    assert_close("reverse-over-reverse w2", &to_f64(&out[1]), &hv2, tol);
}

/// From the gradient graph, builds ∇_w ⟨∇L(w), v⟩ with v as extra inputs.
fn grad_of_directional_gradient(gradient: &Graph) -> Graph {
    let mut g = gradient.clone();
    let g1 = g.find_output("grad/w1").unwrap();
    let g2 = g.find_output("grad/w2").unwrap();
    let v1 = g.input("v1", g.ty(g1).clone()).unwrap();
    let v2 = g.input("v2", g.ty(g2).clone()).unwrap();
    let p1 = g.mul(g1, v1).unwrap();
    let p2 = g.mul(g2, v2).unwrap();
    let s1 = g.sum_all(p1).unwrap();
    let s2 = g.sum_all(p2).unwrap();
    let s = g.add(s1, s2).unwrap();
    g.set_outputs(vec![("s".into(), s)]).unwrap();
    grad(&g, "s", &["w1", "w2"]).unwrap()
}

fn sigmoid_forward(ty: &TensorType) -> Graph {
    let mut g = Graph::new();
    let x = g.input("x", ty.clone()).unwrap();
    let y = g.unary(UnaryOp::Sigmoid, x).unwrap();
    g.set_output("y", y).unwrap();
    g
}

/// The textbook rule dy·y·(1 − y), which reuses the forward output.
fn sigmoid_backward(ty: &TensorType) -> Graph {
    let mut g = Graph::new();
    let _x = g.input("x", ty.clone()).unwrap();
    let y = g.input("y", ty.clone()).unwrap();
    let dy = g.input("dy", ty.clone()).unwrap();
    let one = g.scalar(1.0).unwrap();
    let one_minus = g.sub(one, y).unwrap();
    let d = g.mul(y, one_minus).unwrap();
    let dx = g.mul(dy, d).unwrap();
    g.set_output("dx", dx).unwrap();
    g
}

/// loss = Σ w · σ(x), with σ either custom or written as 1 / (1 + exp(−x)).
fn sigmoid_model(custom: bool) -> Graph {
    let ty = TensorType::f32(&[2, 3]);
    let mut g = Graph::new();
    let x = g.input("x", ty.clone()).unwrap();
    let w = g.input("w", ty.clone()).unwrap();
    let s = if custom {
        call_custom(
            &mut g,
            "sigmoid",
            sigmoid_forward(&ty),
            sigmoid_backward(&ty),
            &[x],
        )
        .unwrap()
    } else {
        let nx = g.neg(x).unwrap();
        let e = g.exp(nx).unwrap();
        let one = g.scalar(1.0).unwrap();
        let d = g.add(one, e).unwrap();
        g.unary(UnaryOp::Reciprocal, d).unwrap()
    };
    let ws = g.mul(w, s).unwrap();
    let loss = g.sum_all(ws).unwrap();
    g.set_output("loss", loss).unwrap();
    g
}

#[test]
fn custom_sigmoid_matches_the_derived_gradient_without_exp() {
    let mut rng = common::Rng(7);
    let inputs = vec![
        random(&mut rng, &[2, 3], 3.0),
        random(&mut rng, &[2, 3], 1.0),
    ];
    let derived = run(
        &grad(&sigmoid_model(false), "loss", &["x"]).unwrap(),
        inputs.clone(),
    );
    let custom_graph = grad(&sigmoid_model(true), "loss", &["x"]).unwrap();
    let custom = run(&custom_graph, inputs);
    assert_close(
        "custom vs derived",
        &to_f64(&custom[0]),
        &to_f64(&derived[0]),
        Tolerance {
            eps: 0.0,
            rtol: 1e-5,
            atol: 1e-6,
        },
    );

    // The backward part (everything but the forward custom call) has no exp:
    // the rule reused y instead of re-deriving the sigmoid.
    let full = vjp(&sigmoid_model(true), &["x"]).unwrap();
    let backward_ops: Vec<&str> = full
        .nodes()
        .iter()
        .filter(|n| !matches!(n.op, Op::CustomGrad(_) | Op::Input { .. }))
        .map(|n| n.op.name())
        .collect();
    assert!(!backward_ops.contains(&"exp"), "{backward_ops:?}");
    assert!(!backward_ops.contains(&"sigmoid"), "{backward_ops:?}");
    assert_eq!(full.op_counts()["custom_grad"], 1);
    assert!(!custom_graph.op_counts().contains_key("exp"));

    // And the custom rule is itself differentiable: second order matches.
    let check = |custom: bool| {
        let g1 = grad(&sigmoid_model(custom), "loss", &["x"]).unwrap();
        let mut g = g1.clone();
        let gx = g.find_output("grad/x").unwrap();
        let s = g.sum_all(gx).unwrap();
        g.set_outputs(vec![("s".into(), s)]).unwrap();
        let g2 = grad(&g, "s", &["x"]).unwrap();
        let mut rng = common::Rng(9);
        let inputs = vec![
            random(&mut rng, &[2, 3], 3.0),
            random(&mut rng, &[2, 3], 1.0),
        ];
        to_f64(&run(&g2, inputs)[0])
    };
    let tol = Tolerance {
        eps: 0.0,
        rtol: 1e-4,
        atol: 1e-5,
    };
    assert_close(
        "second order custom vs derived",
        &check(true),
        &check(false),
        tol,
    );
}
