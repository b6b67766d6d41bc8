//! Structural tests of the autodiff transforms: names and types of inputs
//! and outputs, activity analysis, dead-code freedom and errors. Numerical
//! correctness lives in canopy-engine's conformance suite.

use canopy_ir::autodiff::{call_custom, custom_grad, grad, jvp, value_and_grad, vjp};
use canopy_ir::{
    BinaryOp, Conv2dAttrs, DType, Dim, Graph, IrError, Op, Shape, TensorType, UnaryOp, ValueId,
};

fn f32_ty(dims: &[usize]) -> TensorType {
    TensorType::f32(dims)
}

/// A small classifier: logits = x·w + b, loss = mean(-log_softmax picked by
/// one-hot labels), correct = count of labels equal to the argmax proxy.
fn classifier() -> Graph {
    let mut g = Graph::new();
    let x = g
        .input(
            "x",
            TensorType::new(DType::F32, Shape(vec![Dim::Batch, Dim::Fixed(3)])),
        )
        .unwrap();
    let w = g.input("w", f32_ty(&[3, 4])).unwrap();
    let b = g.input("b", f32_ty(&[4])).unwrap();
    let labels = g
        .input(
            "labels",
            TensorType::new(DType::I64, Shape(vec![Dim::Batch])),
        )
        .unwrap();
    let xw = g.matmul(x, w).unwrap();
    let logits = g.add(xw, b).unwrap();
    let logp = g.log_softmax(logits, 1).unwrap();
    let onehot = g.push(Op::OneHot { depth: 4 }, &[labels]).unwrap();
    let picked = g.mul(logp, onehot).unwrap();
    let per_row = g.sum(picked, &[1], false).unwrap();
    let mean = g.mean(per_row, &[0], false).unwrap();
    let loss = g.neg(mean).unwrap();
    let top = g
        .reduce(canopy_ir::ReduceKind::Max, logits, &[1], true)
        .unwrap();
    let hit = g.binary(BinaryOp::Eq, logits, top).unwrap();
    let hit = g.cast(hit, DType::F32).unwrap();
    let hit = g.mul(hit, onehot).unwrap();
    let hit = g.cast(hit, DType::I64).unwrap();
    let correct = g.sum_all(hit).unwrap();
    g.set_output("loss", loss).unwrap();
    g.set_output("correct", correct).unwrap();
    g.set_output("logits", logits).unwrap();
    g
}

fn names_and_types(
    g: &Graph,
    ids: impl Iterator<Item = (String, ValueId)>,
) -> Vec<(String, TensorType)> {
    ids.map(|(n, v)| (n, g.ty(v).clone())).collect()
}

fn inputs_of(g: &Graph) -> Vec<(String, TensorType)> {
    let ids = g.inputs().iter().map(|&i| (g.input_name(i).to_string(), i));
    names_and_types(g, ids)
}

fn outputs_of(g: &Graph) -> Vec<(String, TensorType)> {
    names_and_types(g, g.outputs().iter().cloned())
}

fn batch_ty(dtype: DType, dims: &[Dim]) -> TensorType {
    TensorType::new(dtype, Shape(dims.to_vec()))
}

/// Every non-input node must be read by some node or output.
fn assert_no_dead_nodes(g: &Graph) {
    let mut used = vec![false; g.len()];
    for (_, v) in g.outputs() {
        used[v.index()] = true;
    }
    for node in g.nodes() {
        for x in &node.inputs {
            used[x.index()] = true;
        }
    }
    for (i, node) in g.nodes().iter().enumerate() {
        let is_input = matches!(node.op, Op::Input { .. });
        assert!(used[i] || is_input, "dead node %{i} ({})", node.op.name());
    }
}

#[test]
fn vjp_inputs_and_outputs() {
    let f = classifier();
    let d = vjp(&f, &["w", "b"]).unwrap();
    let mut want_inputs = inputs_of(&f);
    want_inputs.push(("cotangent/loss".into(), f32_ty(&[])));
    want_inputs.push((
        "cotangent/logits".into(),
        batch_ty(DType::F32, &[Dim::Batch, Dim::Fixed(4)]),
    ));
    assert_eq!(inputs_of(&d), want_inputs);
    let mut want_outputs = outputs_of(&f);
    want_outputs.push(("grad/w".into(), f32_ty(&[3, 4])));
    want_outputs.push(("grad/b".into(), f32_ty(&[4])));
    assert_eq!(outputs_of(&d), want_outputs);
    canopy_ir::verify::verify(&d).unwrap();
    assert_no_dead_nodes(&d);
}

#[test]
fn grad_has_only_gradient_outputs_and_the_original_inputs() {
    let f = classifier();
    let d = grad(&f, "loss", &["x", "w"]).unwrap();
    assert_eq!(inputs_of(&d), inputs_of(&f));
    let want = vec![
        (
            "grad/x".to_string(),
            batch_ty(DType::F32, &[Dim::Batch, Dim::Fixed(3)]),
        ),
        ("grad/w".to_string(), f32_ty(&[3, 4])),
    ];
    assert_eq!(outputs_of(&d), want);
    assert_no_dead_nodes(&d);
    // `correct` is not an output, so nothing of its computation survives.
    assert!(!d.op_counts().contains_key("max"), "{:?}", d.op_counts());
}

#[test]
fn value_and_grad_keeps_every_output() {
    let f = classifier();
    let d = value_and_grad(&f, "loss", &["b"]).unwrap();
    assert_eq!(inputs_of(&d), inputs_of(&f));
    let mut want = outputs_of(&f);
    want.push(("grad/b".into(), f32_ty(&[4])));
    assert_eq!(outputs_of(&d), want);
    assert_eq!(d.ty(d.find_output("correct").unwrap()).dtype, DType::I64);
    assert_no_dead_nodes(&d);
}

#[test]
fn jvp_inputs_and_outputs() {
    let f = classifier();
    let d = jvp(&f, &["w"]).unwrap();
    let mut want_inputs = inputs_of(&f);
    want_inputs.push(("tangent/w".into(), f32_ty(&[3, 4])));
    assert_eq!(inputs_of(&d), want_inputs);
    let mut want_outputs = outputs_of(&f);
    want_outputs.push(("tangent/loss".into(), f32_ty(&[])));
    want_outputs.push((
        "tangent/logits".into(),
        batch_ty(DType::F32, &[Dim::Batch, Dim::Fixed(4)]),
    ));
    assert_eq!(outputs_of(&d), want_outputs);
    assert_no_dead_nodes(&d);
}

/// A conv backbone whose parameters are frozen (not in `wrt`) followed by a
/// trainable linear head.
fn transfer_model() -> Graph {
    let mut g = Graph::new();
    let x = g.input("x", f32_ty(&[2, 1, 6, 6])).unwrap();
    let k1 = g
        .input("params/backbone/k1", f32_ty(&[4, 1, 3, 3]))
        .unwrap();
    let k2 = g
        .input("params/backbone/k2", f32_ty(&[4, 4, 3, 3]))
        .unwrap();
    let w = g.input("params/head/w", f32_ty(&[4, 3])).unwrap();
    let y = g.input("y", f32_ty(&[2, 3])).unwrap();
    let h = g.conv2d(x, k1, Conv2dAttrs::default()).unwrap();
    let h = g.relu(h).unwrap();
    let h = g.conv2d(h, k2, Conv2dAttrs::default()).unwrap();
    let h = g.unary(UnaryOp::Tanh, h).unwrap();
    let feats = g.mean(h, &[2, 3], false).unwrap();
    let logits = g.matmul(feats, w).unwrap();
    let diff = g.sub(logits, y).unwrap();
    let sq = g.unary(UnaryOp::Square, diff).unwrap();
    let loss = g.mean(sq, &[0, 1], false).unwrap();
    g.set_output("loss", loss).unwrap();
    g
}

#[test]
fn frozen_backbone_gets_no_backward_ops() {
    let f = transfer_model();
    let d = grad(&f, "loss", &["params/head/w"]).unwrap();
    let counts = d.op_counts();
    for op in [
        "conv2d_backward_input",
        "conv2d_backward_filter",
        "where",
        "gt",
    ] {
        assert!(!counts.contains_key(op), "found {op} in {counts:?}");
    }
    // Forward: conv, relu, conv, tanh; backward adds nothing before the head.
    assert_eq!(counts["conv2d"], 2);
    assert_eq!(counts["tanh"], 1);
    assert_eq!(counts["matmul"], 2, "the head's forward and its dW only");
    assert_no_dead_nodes(&d);

    let full = grad(&f, "loss", &["params/backbone/k1", "params/head/w"]).unwrap();
    let counts = full.op_counts();
    assert_eq!(counts["conv2d_backward_filter"], 1, "k2 is frozen");
    assert_eq!(
        counts["conv2d_backward_input"], 1,
        "dx of the first conv is not needed"
    );
}

#[test]
fn unreachable_gradient_is_zeros() {
    let mut g = Graph::new();
    let x = g.input("x", f32_ty(&[3])).unwrap();
    let unused = g.input("unused", f32_ty(&[2, 2])).unwrap();
    let _ = unused;
    let s = g.sum_all(x).unwrap();
    g.set_output("s", s).unwrap();
    let d = grad(&g, "s", &["unused", "x"]).unwrap();
    assert_eq!(
        outputs_of(&d)[0],
        ("grad/unused".to_string(), f32_ty(&[2, 2]))
    );
    assert!(
        !d.op_counts().contains_key("sum"),
        "the forward sum is dead: {:?}",
        d.op_counts()
    );
}

#[test]
fn multiple_uses_accumulate_with_add() {
    let mut g = Graph::new();
    let x = g.input("x", f32_ty(&[])).unwrap();
    let a = g.exp(x).unwrap();
    let b = g.unary(UnaryOp::Tanh, x).unwrap();
    let y = g.add(a, b).unwrap();
    g.set_output("y", y).unwrap();
    let d = grad(&g, "y", &["x"]).unwrap();
    let out = d.find_output("grad/x").unwrap();
    assert_eq!(d.node(out).op, Op::Binary(BinaryOp::Add));
}

#[test]
fn second_order_graph_builds() {
    let mut g = Graph::new();
    let x = g.input("x", f32_ty(&[])).unwrap();
    let x2 = g.unary(UnaryOp::Square, x).unwrap();
    let x3 = g.mul(x2, x).unwrap();
    g.set_output("y", x3).unwrap();
    let d1 = grad(&g, "y", &["x"]).unwrap();
    let d2 = grad(&d1, "grad/x", &["x"]).unwrap();
    let d3 = grad(&d2, "grad/x", &["x"]).unwrap();
    assert_eq!(outputs_of(&d3), vec![("grad/x".to_string(), f32_ty(&[]))]);
}

#[test]
fn errors_name_the_input_or_output_and_the_cause() {
    let f = classifier();
    assert_eq!(
        vjp(&f, &["nope"]),
        Err(IrError::UnknownInput("nope".into()))
    );
    assert_eq!(
        jvp(&f, &["nope"]),
        Err(IrError::UnknownInput("nope".into()))
    );
    let err = grad(&f, "loss", &["labels"]).unwrap_err().to_string();
    assert!(err.contains("`labels`") && err.contains("f32"), "{err}");
    assert_eq!(
        grad(&f, "nope", &["w"]),
        Err(IrError::UnknownOutput("nope".into()))
    );
    let err = grad(&f, "logits", &["w"]).unwrap_err().to_string();
    assert!(err.contains("`logits`") && err.contains("scalar"), "{err}");
    let err = grad(&f, "correct", &["w"]).unwrap_err().to_string();
    assert!(err.contains("`correct`"), "{err}");
    let err = value_and_grad(&f, "loss", &["w", "w"])
        .unwrap_err()
        .to_string();
    assert!(err.contains("`w`"), "{err}");
}

fn sigmoid_forward() -> Graph {
    let mut g = Graph::new();
    let x = g.input("x", f32_ty(&[3])).unwrap();
    let y = g.unary(UnaryOp::Sigmoid, x).unwrap();
    g.set_output("y", y).unwrap();
    g
}

/// backward(x, y, dy) = dy·y·(1 − y)
fn sigmoid_backward() -> Graph {
    let mut g = Graph::new();
    let _x = g.input("x", f32_ty(&[3])).unwrap();
    let y = g.input("y", f32_ty(&[3])).unwrap();
    let dy = g.input("dy", f32_ty(&[3])).unwrap();
    let one = g.scalar(1.0).unwrap();
    let one_minus = g.sub(one, y).unwrap();
    let d = g.mul(y, one_minus).unwrap();
    let dx = g.mul(dy, d).unwrap();
    g.set_output("dx", dx).unwrap();
    g
}

#[test]
fn custom_grad_uses_the_user_rule_in_reverse_and_the_forward_in_jvp() {
    let mut g = Graph::new();
    let x = g.input("x", f32_ty(&[3])).unwrap();
    let y = call_custom(
        &mut g,
        "sigmoid",
        sigmoid_forward(),
        sigmoid_backward(),
        &[x],
    )
    .unwrap();
    let s = g.sum_all(y).unwrap();
    g.set_output("s", s).unwrap();

    let d = vjp(&g, &["x"]).unwrap();
    let counts = d.op_counts();
    assert_eq!(counts["custom_grad"], 1, "the forward stays a custom call");
    assert!(!counts.contains_key("sigmoid"), "{counts:?}");

    let t = jvp(&g, &["x"]).unwrap();
    assert!(
        t.op_counts().contains_key("sigmoid"),
        "jvp differentiates the forward graph"
    );
}

#[test]
fn custom_grad_rejects_a_mismatched_rule() {
    let mut bad = Graph::new();
    let x = bad.input("x", f32_ty(&[3])).unwrap();
    let _y = bad.input("y", f32_ty(&[3])).unwrap();
    bad.set_output("dx", x).unwrap(); // no dy input
    let err = custom_grad("sigmoid", sigmoid_forward(), bad)
        .unwrap_err()
        .to_string();
    assert!(err.contains("sigmoid"), "{err}");
    assert!(custom_grad("sigmoid", sigmoid_forward(), sigmoid_backward()).is_ok());
}

#[test]
fn matmul_gradients_use_flags_not_transposes() {
    for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
        let mut g = Graph::new();
        let a_dims = if ta { [5, 4, 2] } else { [5, 2, 4] };
        let b_dims = if tb { [3, 4] } else { [4, 3] };
        let a = g.input("a", f32_ty(&a_dims)).unwrap();
        let b = g.input("b", f32_ty(&b_dims)).unwrap();
        let y = g.matmul_t(a, b, ta, tb).unwrap();
        g.set_output("y", y).unwrap();
        let d = vjp(&g, &["a", "b"]).unwrap();
        assert!(
            !d.op_counts().contains_key("transpose"),
            "{:?}",
            d.op_counts()
        );
        assert_eq!(d.ty(d.find_output("grad/b").unwrap()), &f32_ty(&b_dims));
    }
}
