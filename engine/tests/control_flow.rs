//! Control flow (`scan`, `cond`, `while_loop`): forward results, and
//! derivatives in both modes against finite differences, against each
//! other, against the same model unrolled by hand, and differentiated
//! again (the VJP graph's own VJP), with nesting both ways.

mod common;

use canopy_engine::{Backend, CpuBackend, Value};
use canopy_ir::autodiff::vjp;
use canopy_ir::{
    BinaryOp, Cond, DType, Dim, Graph, Op, Scan, Shape, TensorType, UnaryOp, ValueId, WhileLoop,
};
use common::{Rng, check_vjp_jvp, run, to_f64};

fn f32_ty(shape: &[usize]) -> TensorType {
    TensorType::f32(shape)
}

fn random(shape: &[usize], rng: &mut Rng) -> Value {
    let n = shape.iter().product();
    Value::f32(shape, (0..n).map(|_| rng.uniform()).collect()).expect("shape")
}

/// One recurrent step: h' = tanh(h·W + x_t), y_t = h'·h' (elementwise).
fn rnn_step(g: &mut Graph, h: ValueId, x: ValueId, w: ValueId) -> (ValueId, ValueId) {
    let hw = g.matmul(h, w).expect("h·W");
    let pre = g.add(hw, x).expect("+ x");
    let next = g.unary(UnaryOp::Tanh, pre).expect("tanh");
    let y = g.mul(next, next).expect("y");
    (next, y)
}

fn rnn_body(batch: usize, width: usize) -> Graph {
    let mut body = Graph::new();
    let h = body.input("h", f32_ty(&[batch, width])).expect("h");
    let x = body.input("x", f32_ty(&[batch, width])).expect("x");
    let w = body.input("w", f32_ty(&[width, width])).expect("w");
    let (next, y) = rnn_step(&mut body, h, x, w);
    body.set_output("h", next).expect("out");
    body.set_output("y", y).expect("out");
    body
}

/// A recurrent network over `steps` steps as one scan: outputs the final
/// state and the stacked per-step outputs.
fn rnn_scan(steps: usize, batch: usize, width: usize, reverse: bool) -> Graph {
    rnn_scan_checkpointed(steps, batch, width, reverse, 0)
}

fn rnn_scan_checkpointed(
    steps: usize,
    batch: usize,
    width: usize,
    reverse: bool,
    checkpoint: usize,
) -> Graph {
    let mut g = Graph::new();
    let h0 = g.input("h0", f32_ty(&[batch, width])).expect("h0");
    let xs = g.input("xs", f32_ty(&[steps, batch, width])).expect("xs");
    let w = g.input("w", f32_ty(&[width, width])).expect("w");
    let scan = Scan {
        body: rnn_body(batch, width),
        carries: 1,
        scanned: 1,
        length: Dim::Fixed(steps),
        reverse,
        checkpoint,
    };
    let results = g
        .push_tuple(Op::Scan(Box::new(scan)), &[h0, xs, w])
        .expect("scan");
    g.set_output("h", results[0]).expect("out");
    g.set_output("ys", results[1]).expect("out");
    g
}

/// The same network unrolled by hand.
fn rnn_unrolled(steps: usize, batch: usize, width: usize) -> Graph {
    let mut g = Graph::new();
    let mut h = g.input("h0", f32_ty(&[batch, width])).expect("h0");
    let xs = g.input("xs", f32_ty(&[steps, batch, width])).expect("xs");
    let w = g.input("w", f32_ty(&[width, width])).expect("w");
    let mut ys = Vec::new();
    for t in 0..steps {
        let slice = g
            .push(
                Op::Slice {
                    axis: 0,
                    start: t,
                    end: t + 1,
                },
                &[xs],
            )
            .expect("slice");
        let x = g
            .reshape(slice, Shape::fixed(&[batch, width]).0)
            .expect("x_t");
        let (next, y) = rnn_step(&mut g, h, x, w);
        h = next;
        ys.push(
            g.reshape(y, Shape::fixed(&[1, batch, width]).0)
                .expect("y_t"),
        );
    }
    let stacked = g.push(Op::Concat { axis: 0 }, &ys).expect("stack");
    g.set_output("h", h).expect("out");
    g.set_output("ys", stacked).expect("out");
    g
}

fn rnn_inputs(steps: usize, batch: usize, width: usize, seed: u64) -> Vec<Value> {
    let mut rng = Rng(seed);
    vec![
        random(&[batch, width], &mut rng),
        random(&[steps, batch, width], &mut rng),
        random(&[width, width], &mut rng),
    ]
}

#[test]
fn a_scan_computes_what_the_unrolled_graph_computes() {
    let inputs = rnn_inputs(5, 2, 3, 1);
    let scanned = run(&rnn_scan(5, 2, 3, false), inputs.clone());
    let unrolled = run(&rnn_unrolled(5, 2, 3), inputs);
    assert_eq!(scanned, unrolled);
}

#[test]
fn a_scan_differentiates_in_both_modes_and_twice() {
    check_vjp_jvp(&rnn_scan(4, 2, 3, false), &rnn_inputs(4, 2, 3, 2));
}

#[test]
fn a_reverse_scan_differentiates_in_both_modes_and_twice() {
    check_vjp_jvp(&rnn_scan(4, 2, 3, true), &rnn_inputs(4, 2, 3, 3));
}

/// Reverse mode through the scan and through the unrolled graph, with the
/// same cotangents, agree to 1e-5 relative.
#[test]
fn the_scan_gradient_is_the_unrolled_gradient() {
    let (steps, batch, width) = (6, 2, 3);
    let wrt = ["h0", "xs", "w"];
    let mut inputs = rnn_inputs(steps, batch, width, 4);
    let mut rng = Rng(5);
    inputs.push(random(&[batch, width], &mut rng));
    inputs.push(random(&[steps, batch, width], &mut rng));
    let scanned = run(
        &vjp(&rnn_scan(steps, batch, width, false), &wrt).expect("vjp"),
        inputs.clone(),
    );
    let unrolled = run(
        &vjp(&rnn_unrolled(steps, batch, width), &wrt).expect("vjp"),
        inputs,
    );
    for (k, (a, b)) in scanned.iter().zip(&unrolled).enumerate() {
        let (a, b) = (to_f64(a), to_f64(b));
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert!(
                (x - y).abs() <= 1e-5 * x.abs().max(y.abs()) + 1e-7,
                "output {k} element {i}: scan {x}, unrolled {y}"
            );
        }
    }
}

/// Differentiating a loop adds a fixed number of nodes: a scan of 1,000
/// steps and one of 10 have graphs, and gradient graphs, of one size.
#[test]
fn node_counts_do_not_grow_with_the_trip_count() {
    let wrt = ["h0", "xs", "w"];
    let short = rnn_scan(10, 2, 3, false);
    let long = rnn_scan(1000, 2, 3, false);
    assert_eq!(short.len(), long.len());
    let (short_vjp, long_vjp) = (
        vjp(&short, &wrt).expect("vjp"),
        vjp(&long, &wrt).expect("vjp"),
    );
    assert_eq!(short_vjp.len(), long_vjp.len());
    let nested = |g: &Graph| -> usize {
        g.nodes()
            .iter()
            .flat_map(|n| n.op.subgraphs())
            .map(Graph::len)
            .sum()
    };
    assert_eq!(nested(&short_vjp), nested(&long_vjp));
    assert!(long_vjp.len() < 40, "{} nodes", long_vjp.len());
    let unrolled = vjp(&rnn_unrolled(10, 2, 3), &wrt).expect("vjp");
    assert!(
        long_vjp.len() < unrolled.len() / 4,
        "{} vs {}",
        long_vjp.len(),
        unrolled.len()
    );
}

/// A scan whose trip count is the symbolic batch: a running sum over the
/// rows of an [N, 3] input.
#[test]
fn a_scan_over_the_batch_dimension() {
    let mut body = Graph::new();
    let total = body.input("total", f32_ty(&[3])).expect("total");
    let row = body.input("row", f32_ty(&[3])).expect("row");
    let next = body.add(total, row).expect("add");
    let scaled = body.mul(next, row).expect("mul");
    body.set_output("total", next).expect("out");
    body.set_output("scaled", scaled).expect("out");
    let mut g = Graph::new();
    let zero = g.input("start", f32_ty(&[3])).expect("start");
    let rows = g
        .input(
            "rows",
            TensorType::new(DType::F32, Shape(vec![Dim::Batch, Dim::Fixed(3)])),
        )
        .expect("rows");
    let scan = Scan {
        body,
        carries: 1,
        scanned: 1,
        length: Dim::Batch,
        reverse: false,
        checkpoint: 0,
    };
    let results = g
        .push_tuple(Op::Scan(Box::new(scan)), &[zero, rows])
        .expect("scan");
    g.set_output("total", results[0]).expect("out");
    g.set_output("scaled", results[1]).expect("out");
    let rows = Value::f32(&[4, 3], (0..12).map(|i| i as f32 * 0.1).collect()).expect("rows");
    let start = Value::f32(&[3], vec![1.0, 0.0, -1.0]).expect("start");
    let out = run(&g, vec![start.clone(), rows.clone()]);
    assert_eq!(
        to_f64(&out[0])
            .iter()
            .map(|x| (x * 1e4).round() / 1e4)
            .collect::<Vec<_>>(),
        vec![2.8, 2.2, 1.6]
    );
    assert_eq!(out[1].shape(), &[4, 3]);
    check_vjp_jvp(&g, &[start, rows]);
}

/// then: x·x·w; else: exp(x) + w.
fn two_branches(shape: &[usize]) -> Cond {
    let mut then_branch = Graph::new();
    let x = then_branch.input("x", f32_ty(shape)).expect("x");
    let w = then_branch.input("w", f32_ty(shape)).expect("w");
    let xx = then_branch.mul(x, x).expect("xx");
    let y = then_branch.mul(xx, w).expect("y");
    then_branch.set_output("y", y).expect("out");
    let mut else_branch = Graph::new();
    let x = else_branch.input("x", f32_ty(shape)).expect("x");
    let w = else_branch.input("w", f32_ty(shape)).expect("w");
    let e = else_branch.exp(x).expect("exp");
    let y = else_branch.add(e, w).expect("y");
    else_branch.set_output("y", y).expect("out");
    Cond {
        then_branch,
        else_branch,
    }
}

fn cond_graph(shape: &[usize]) -> Graph {
    let mut g = Graph::new();
    let pred = g
        .input("pred", TensorType::new(DType::Bool, Shape(vec![])))
        .expect("pred");
    let x = g.input("x", f32_ty(shape)).expect("x");
    let w = g.input("w", f32_ty(shape)).expect("w");
    let y = g
        .push_tuple(Op::Cond(Box::new(two_branches(shape))), &[pred, x, w])
        .expect("cond");
    g.set_output("y", y[0]).expect("out");
    g
}

fn bool_scalar(b: bool) -> Value {
    Value::Bool(ndarray::ArrayD::from_elem(ndarray::IxDyn(&[]), b))
}

#[test]
fn a_cond_runs_the_chosen_branch_and_differentiates_through_it() {
    let mut rng = Rng(6);
    let (x, w) = (random(&[2, 3], &mut rng), random(&[2, 3], &mut rng));
    for pred in [true, false] {
        let inputs = vec![bool_scalar(pred), x.clone(), w.clone()];
        let y = to_f64(&run(&cond_graph(&[2, 3]), inputs.clone())[0]);
        let (xs, ws) = (to_f64(&x), to_f64(&w));
        for i in 0..6 {
            let want = if pred {
                xs[i] * xs[i] * ws[i]
            } else {
                xs[i].exp() + ws[i]
            };
            assert!(
                (y[i] - want).abs() < 1e-5,
                "pred {pred}: {} vs {want}",
                y[i]
            );
        }
        check_vjp_jvp(&cond_graph(&[2, 3]), &inputs);
    }
}

/// A scan whose body branches on a per-step flag: cond inside scan.
#[test]
fn a_cond_inside_a_scan_differentiates() {
    let mut body = Graph::new();
    let h = body.input("h", f32_ty(&[3])).expect("h");
    let flag = body
        .input("flag", TensorType::new(DType::Bool, Shape(vec![])))
        .expect("flag");
    let w = body.input("w", f32_ty(&[3])).expect("w");
    let next = body
        .push_tuple(Op::Cond(Box::new(two_branches(&[3]))), &[flag, h, w])
        .expect("cond")[0];
    let tanh = body.unary(UnaryOp::Tanh, next).expect("tanh");
    body.set_output("h", tanh).expect("out");
    let mut g = Graph::new();
    let h0 = g.input("h0", f32_ty(&[3])).expect("h0");
    let flags = g
        .input("flags", TensorType::new(DType::Bool, Shape::fixed(&[5])))
        .expect("flags");
    let w = g.input("w", f32_ty(&[3])).expect("w");
    let scan = Scan {
        body,
        carries: 1,
        scanned: 1,
        length: Dim::Fixed(5),
        reverse: false,
        checkpoint: 0,
    };
    let h = g
        .push_tuple(Op::Scan(Box::new(scan)), &[h0, flags, w])
        .expect("scan")[0];
    g.set_output("h", h).expect("out");
    let mut rng = Rng(7);
    let flags = Value::Bool(
        ndarray::ArrayD::from_shape_vec(
            ndarray::IxDyn(&[5]),
            vec![true, false, false, true, false],
        )
        .expect("flags"),
    );
    check_vjp_jvp(&g, &[random(&[3], &mut rng), flags, random(&[3], &mut rng)]);
}

/// A branch that runs a whole recurrent scan: scan inside cond.
#[test]
fn a_scan_inside_a_cond_differentiates() {
    let (steps, batch, width) = (3, 2, 2);
    let inner = rnn_scan(steps, batch, width, false);
    let mut then_branch = Graph::new();
    let h0 = then_branch
        .input("h0", f32_ty(&[batch, width]))
        .expect("h0");
    let xs = then_branch
        .input("xs", f32_ty(&[steps, batch, width]))
        .expect("xs");
    let w = then_branch.input("w", f32_ty(&[width, width])).expect("w");
    let outs = then_branch.inline(&inner, &[h0, xs, w]).expect("inline");
    then_branch.set_output("h", outs[0]).expect("out");
    let mut else_branch = Graph::new();
    let h0 = else_branch
        .input("h0", f32_ty(&[batch, width]))
        .expect("h0");
    let _xs = else_branch
        .input("xs", f32_ty(&[steps, batch, width]))
        .expect("xs");
    let w = else_branch.input("w", f32_ty(&[width, width])).expect("w");
    let hw = else_branch.matmul(h0, w).expect("h·w");
    else_branch.set_output("h", hw).expect("out");
    let mut g = Graph::new();
    let pred = g
        .input("pred", TensorType::new(DType::Bool, Shape(vec![])))
        .expect("pred");
    let h0 = g.input("h0", f32_ty(&[batch, width])).expect("h0");
    let xs = g.input("xs", f32_ty(&[steps, batch, width])).expect("xs");
    let w = g.input("w", f32_ty(&[width, width])).expect("w");
    let cond = Cond {
        then_branch,
        else_branch,
    };
    let h = g
        .push_tuple(Op::Cond(Box::new(cond)), &[pred, h0, xs, w])
        .expect("cond")[0];
    g.set_output("h", h).expect("out");
    for pred in [true, false] {
        let mut inputs = vec![bool_scalar(pred)];
        inputs.extend(rnn_inputs(steps, batch, width, 8));
        check_vjp_jvp(&g, &inputs);
    }
}

/// Doubling until the value reaches a bound: the loop stops on its
/// condition, or at `max_trips`, and counts its trips either way.
#[test]
fn a_while_loop_stops_on_its_condition_or_its_bound() {
    let mut cond = Graph::new();
    let x = cond.input("x", f32_ty(&[])).expect("x");
    let bound = cond.input("bound", f32_ty(&[])).expect("bound");
    let go = cond.binary(BinaryOp::Lt, x, bound).expect("lt");
    cond.set_output("go", go).expect("out");
    let mut body = Graph::new();
    let x = body.input("x", f32_ty(&[])).expect("x");
    let _bound = body.input("bound", f32_ty(&[])).expect("bound");
    let two = body.scalar(2.0).expect("2");
    let doubled = body.mul(x, two).expect("mul");
    body.set_output("x", doubled).expect("out");
    let graph = |max_trips: usize| {
        let mut g = Graph::new();
        let x = g.input("x", f32_ty(&[])).expect("x");
        let bound = g.input("bound", f32_ty(&[])).expect("bound");
        let w = WhileLoop {
            cond: cond.clone(),
            body: body.clone(),
            carries: 1,
            max_trips,
        };
        let results = g
            .push_tuple(Op::WhileLoop(Box::new(w)), &[x, bound])
            .expect("while");
        g.set_output("x", results[0]).expect("out");
        g.set_output("trips", results[1]).expect("out");
        g
    };
    let inputs = vec![Value::scalar_f32(1.5), Value::scalar_f32(100.0)];
    let out = run(&graph(50), inputs.clone());
    assert_eq!(out, vec![Value::scalar_f32(192.0), Value::scalar_i64(7)]);
    let out = run(&graph(3), inputs);
    assert_eq!(out, vec![Value::scalar_f32(12.0), Value::scalar_i64(3)]);
}

/// A scan that sums `table[index]` over three indices, the last out of
/// range.
fn scan_with_a_bad_index() -> (Graph, Vec<Value>) {
    let mut body = Graph::new();
    let total = body.input("total", f32_ty(&[])).expect("total");
    let index = body
        .input("index", TensorType::new(DType::I64, Shape::fixed(&[1])))
        .expect("index");
    let table = body.input("table", f32_ty(&[2])).expect("table");
    let picked = body
        .push(Op::Gather { axis: 0 }, &[table, index])
        .expect("gather");
    let sum = body.sum(picked, &[0], false).expect("sum");
    let next = body.add(total, sum).expect("add");
    body.set_output("total", next).expect("out");
    let mut g = Graph::new();
    let start = g.input("start", f32_ty(&[])).expect("start");
    let indices = g
        .input(
            "indices",
            TensorType::new(DType::I64, Shape::fixed(&[3, 1])),
        )
        .expect("i");
    let table = g.input("table", f32_ty(&[2])).expect("table");
    let scan = Scan {
        body,
        carries: 1,
        scanned: 1,
        length: Dim::Fixed(3),
        reverse: false,
        checkpoint: 0,
    };
    let total = g
        .push_tuple(Op::Scan(Box::new(scan)), &[start, indices, table])
        .expect("scan")[0];
    g.set_output("total", total).expect("out");
    let inputs = vec![
        Value::scalar_f32(0.0),
        Value::i64(&[3, 1], vec![0, 1, 7]).expect("indices"),
        Value::f32(&[2], vec![1.0, 2.0]).expect("table"),
    ];
    (g, inputs)
}

/// A failure inside a body names the loop's node and the step.
#[test]
fn an_error_inside_a_body_names_the_node_and_the_step() {
    let (g, inputs) = scan_with_a_bad_index();
    let error = CpuBackend
        .compile(&g)
        .expect("compile")
        .run(inputs)
        .expect_err("index 7 of 2");
    let mut report = error.to_string();
    let mut source = std::error::Error::source(&error);
    while let Some(cause) = source {
        report += &format!(": {cause}");
        source = cause.source();
    }
    assert!(
        report.contains("scan") && report.contains("step 2"),
        "{report}"
    );
}

/// A recurrent update run while a counter is below a bound given as an
/// input: x ← tanh(x·w + b) for `bound` trips, at most `max_trips`.
fn counted_loop(max_trips: usize) -> Graph {
    let carry_types = [f32_ty(&[2, 3]), f32_ty(&[])];
    let const_types = [f32_ty(&[3, 3]), f32_ty(&[3]), f32_ty(&[])];
    let names = ["x", "i", "w", "b", "bound"];
    let declare = |g: &mut Graph| -> Vec<ValueId> {
        carry_types
            .iter()
            .chain(&const_types)
            .zip(names)
            .map(|(ty, name)| g.input(name, ty.clone()).expect("input"))
            .collect()
    };
    let mut cond = Graph::new();
    let v = declare(&mut cond);
    let go = cond.binary(BinaryOp::Lt, v[1], v[4]).expect("lt");
    cond.set_output("go", go).expect("out");
    let mut body = Graph::new();
    let v = declare(&mut body);
    let xw = body.matmul(v[0], v[2]).expect("x·w");
    let pre = body.add(xw, v[3]).expect("+ b");
    let x = body.unary(UnaryOp::Tanh, pre).expect("tanh");
    let one = body.scalar(1.0).expect("1");
    let i = body.add(v[1], one).expect("i + 1");
    body.set_output("x", x).expect("out");
    body.set_output("i", i).expect("out");
    let mut g = Graph::new();
    let v = declare(&mut g);
    let w = WhileLoop {
        cond,
        body,
        carries: 2,
        max_trips,
    };
    let results = g.push_tuple(Op::WhileLoop(Box::new(w)), &v).expect("while");
    let scaled = g.mul(results[0], results[0]).expect("x²");
    g.set_output("x", scaled).expect("out");
    g.set_output("trips", results[2]).expect("out");
    g
}

fn counted_inputs(bound: f32) -> Vec<Value> {
    let mut rng = Rng(9);
    vec![
        random(&[2, 3], &mut rng),
        Value::scalar_f32(0.0),
        random(&[3, 3], &mut rng),
        random(&[3], &mut rng),
        Value::scalar_f32(bound),
    ]
}

/// Reverse mode through a bounded `while_loop` (which JAX's is not), and
/// forward mode, against finite differences, each other, and twice: when
/// the condition ends the loop, and when its bound does.
#[test]
fn a_while_loop_differentiates_in_both_modes_and_twice() {
    for (max_trips, bound, trips) in [(8, 4.5, 5), (3, 4.5, 3)] {
        let g = counted_loop(max_trips);
        let inputs = counted_inputs(bound);
        let out = run(&g, inputs.clone());
        assert_eq!(out[1], Value::scalar_i64(trips));
        check_vjp_jvp(&g, &inputs);
    }
}

/// The loop's reverse mode agrees with the loop unrolled by hand.
#[test]
fn the_while_loop_gradient_is_the_unrolled_gradient() {
    let g = counted_loop(8);
    let inputs = counted_inputs(4.5);
    let mut unrolled = Graph::new();
    let x0 = unrolled.input("x", f32_ty(&[2, 3])).expect("x");
    let _i = unrolled.input("i", f32_ty(&[])).expect("i");
    let w = unrolled.input("w", f32_ty(&[3, 3])).expect("w");
    let b = unrolled.input("b", f32_ty(&[3])).expect("b");
    let _bound = unrolled.input("bound", f32_ty(&[])).expect("bound");
    let mut x = x0;
    for _ in 0..5 {
        let xw = unrolled.matmul(x, w).expect("x·w");
        let pre = unrolled.add(xw, b).expect("+ b");
        x = unrolled.unary(UnaryOp::Tanh, pre).expect("tanh");
    }
    let scaled = unrolled.mul(x, x).expect("x²");
    unrolled.set_output("x", scaled).expect("out");
    let wrt = ["x", "w", "b"];
    let mut with_ct = inputs.clone();
    with_ct.push(random(&[2, 3], &mut Rng(10)));
    let looped = run(&vjp(&g, &wrt).expect("vjp"), with_ct.clone());
    let reference = run(&vjp(&unrolled, &wrt).expect("vjp"), with_ct);
    // Outputs: x, trips, then the three gradients; the reference has no trips.
    for (k, (a, b)) in looped[2..].iter().zip(&reference[1..]).enumerate() {
        for (i, (x, y)) in to_f64(a).iter().zip(to_f64(b)).enumerate() {
            assert!(
                (x - y).abs() <= 1e-5 * x.abs().max(y.abs()) + 1e-7,
                "gradient {k} element {i}: loop {x}, unrolled {y}"
            );
        }
    }
}

/// A Hessian-vector product through a scan: forward mode over the
/// reverse-mode gradient (whose backward pass is itself a scan), against
/// central differences of the gradient along the same direction.
#[test]
fn a_hessian_vector_product_through_a_scan() {
    use canopy_ir::autodiff::{grad, jvp};
    let mut g = rnn_scan(4, 2, 3, false);
    let ys = g.find_output("ys").expect("ys");
    let loss = g.sum_all(ys).expect("loss");
    g.set_outputs(vec![("loss".into(), loss)]).expect("out");
    let gradient = grad(&g, "loss", &["w"]).expect("grad");
    let hvp = jvp(&gradient, &["w"]).expect("jvp of grad");
    let inputs = rnn_inputs(4, 2, 3, 11);
    let direction = random(&[3, 3], &mut Rng(12));
    let mut with_direction = inputs.clone();
    with_direction.push(direction.clone());
    let analytic = to_f64(&run(&hvp, with_direction)[1]);
    let eps = 1e-2f32;
    let shifted = |sign: f32| {
        let mut moved = inputs.clone();
        let Value::F32(w) = &mut moved[2] else {
            unreachable!("w is f32")
        };
        w.zip_mut_with(direction.as_f32().expect("f32"), |x, &d| {
            *x += sign * eps * d
        });
        to_f64(&run(&gradient, moved)[0])
    };
    let (plus, minus) = (shifted(1.0), shifted(-1.0));
    for (i, a) in analytic.iter().enumerate() {
        let numeric = (plus[i] - minus[i]) / (2.0 * f64::from(eps));
        assert!(
            (a - numeric).abs() <= 1e-2 * a.abs().max(numeric.abs()) + 2e-3,
            "element {i}: {a} vs {numeric}"
        );
    }
}

/// Checkpointing changes what the backward pass saves, never what it
/// computes: every interval gives the gradients of saving everything, in
/// both directions, differentiated twice; and the statically costed peak
/// of the gradient graph falls as the interval nears √T.
#[test]
fn checkpointed_scans_give_the_same_gradients_from_less_memory() {
    let (steps, batch, width) = (12, 2, 3);
    let wrt = ["h0", "xs", "w"];
    let mut inputs = rnn_inputs(steps, batch, width, 13);
    let mut rng = Rng(14);
    inputs.push(random(&[batch, width], &mut rng));
    inputs.push(random(&[steps, batch, width], &mut rng));
    for reverse in [false, true] {
        let plain = vjp(&rnn_scan(steps, batch, width, reverse), &wrt).expect("vjp");
        let want = run(&plain, inputs.clone());
        for k in [1, 3, 4, 12] {
            let g = rnn_scan_checkpointed(steps, batch, width, reverse, k);
            let got = run(&vjp(&g, &wrt).expect("vjp"), inputs.clone());
            for (o, (a, b)) in got.iter().zip(&want).enumerate() {
                for (i, (x, y)) in to_f64(a).iter().zip(to_f64(b)).enumerate() {
                    assert!(
                        (x - y).abs() <= 1e-6 * x.abs().max(y.abs()) + 1e-7,
                        "k {k} reverse {reverse} output {o} element {i}: {x} vs {y}"
                    );
                }
            }
        }
        // Few steps: finite differences through many tanh steps drift.
        check_vjp_jvp(
            &rnn_scan_checkpointed(4, batch, width, reverse, 2),
            &rnn_inputs(4, batch, width, 15),
        );
    }
    let peak = |k: usize| {
        let g = gated_scan(1000, k);
        let g = vjp(&g, &["h0", "w", "u"]).expect("vjp");
        canopy_ir::graph_cost(&g, 1).peak_bytes
    };
    let (all, root) = (peak(0), peak(Scan::sqrt_checkpoint(1000)));
    assert_eq!(Scan::sqrt_checkpoint(1000), 25);
    assert!(
        root * 5 < all,
        "peak with checkpoints every 25 steps {root} B, without {all} B"
    );
}

/// A gated recurrence whose saved values outweigh its inputs and outputs,
/// as in a recurrent layer: h' = z·h + (1 − z)·tanh(a), z = σ(a),
/// a = h·W + x·U, with h [8, 64] and x [8, 4]; only the final h is a result.
fn gated_scan(steps: usize, checkpoint: usize) -> Graph {
    let (batch, width, features) = (8, 64, 4);
    let mut body = Graph::new();
    let h = body.input("h", f32_ty(&[batch, width])).expect("h");
    let x = body.input("x", f32_ty(&[batch, features])).expect("x");
    let w = body.input("w", f32_ty(&[width, width])).expect("w");
    let u = body.input("u", f32_ty(&[features, width])).expect("u");
    let hw = body.matmul(h, w).expect("h·W");
    let xu = body.matmul(x, u).expect("x·U");
    let a = body.add(hw, xu).expect("a");
    let z = body.unary(UnaryOp::Sigmoid, a).expect("z");
    let candidate = body.unary(UnaryOp::Tanh, a).expect("tanh");
    let one = body.scalar(1.0).expect("1");
    let keep = body.sub(one, z).expect("1 − z");
    let old = body.mul(z, h).expect("z·h");
    let new = body.mul(keep, candidate).expect("(1 − z)·c");
    let next = body.add(old, new).expect("h'");
    body.set_output("h", next).expect("out");
    let mut g = Graph::new();
    let h0 = g.input("h0", f32_ty(&[batch, width])).expect("h0");
    let xs = g
        .input("xs", f32_ty(&[steps, batch, features]))
        .expect("xs");
    let w = g.input("w", f32_ty(&[width, width])).expect("w");
    let u = g.input("u", f32_ty(&[features, width])).expect("u");
    let scan = Scan {
        body,
        carries: 1,
        scanned: 1,
        length: Dim::Fixed(steps),
        reverse: false,
        checkpoint,
    };
    let h = g
        .push_tuple(Op::Scan(Box::new(scan)), &[h0, xs, w, u])
        .expect("scan")[0];
    g.set_output("h", h).expect("out");
    g
}

#[test]
fn a_checkpoint_that_does_not_divide_the_length_is_refused() {
    let mut g = Graph::new();
    let h0 = g.input("h0", f32_ty(&[1, 2])).expect("h0");
    let xs = g.input("xs", f32_ty(&[10, 1, 2])).expect("xs");
    let w = g.input("w", f32_ty(&[2, 2])).expect("w");
    let scan = Scan {
        body: rnn_body(1, 2),
        carries: 1,
        scanned: 1,
        length: Dim::Fixed(10),
        reverse: false,
        checkpoint: 3,
    };
    let error = g
        .push_tuple(Op::Scan(Box::new(scan)), &[h0, xs, w])
        .expect_err("3 ∤ 10");
    let message = error.to_string();
    assert!(
        message.contains("checkpoint 3 does not divide the length 10") && message.contains("= 2"),
        "{message}"
    );
}

// ---- on the GPU ----------------------------------------------------------
//
// Every graph above also runs on the GPU and is checked against the CPU
// (`common::compile`). These check what that cross-check cannot see: what
// crosses between host and device, the carries a body moves between one
// another, trip counts written from the host, and refusals and errors.

/// Bytes a value takes on the device (bool as u32, i64 as two words).
fn device_bytes(values: &[Value]) -> u64 {
    values
        .iter()
        .map(|v| {
            let element = if v.dtype() == DType::I64 { 8 } else { 4 };
            element * v.len() as u64
        })
        .sum()
}

/// Runs `graph` on the GPU and on the CPU, checks that they agree, and
/// returns the GPU's transfers for the one run.
fn gpu_transfers(
    gpu: &canopy_engine::GpuBackend,
    graph: &Graph,
    inputs: &[Value],
) -> canopy_engine::backend::TransferCounters {
    let want = CpuBackend
        .compile(graph)
        .and_then(|mut exe| exe.run(inputs.to_vec()))
        .expect("CPU run");
    let mut exe = gpu.compile(graph).expect("the GPU compiles control flow");
    let before = exe.transfers();
    let got = exe.run(inputs.to_vec()).expect("GPU run");
    let after = exe.transfers();
    assert_eq!(want.len(), got.len());
    for ((w, g), name) in want.iter().zip(&got).zip(exe.output_names()) {
        common::assert_close_across_backends(name, w, g);
    }
    let down = after.device_to_host_bytes - before.device_to_host_bytes;
    let flags = 4 * (2 + want.len() as u64);
    assert!(down >= device_bytes(&want) + flags, "{down} bytes down");
    canopy_engine::backend::TransferCounters {
        host_to_device_bytes: after.host_to_device_bytes - before.host_to_device_bytes,
        device_to_host_bytes: down - device_bytes(&want) - flags,
        submissions: after.submissions - before.submissions,
        dispatches: after.dispatches - before.dispatches,
    }
}

/// A scan's steps stay on the device: a run moves the inputs up and the
/// outputs (and the run's flag words) down and nothing per step, in one
/// submission for a short scan and a few for a long one, whose steps are
/// recorded in batches.
#[test]
fn a_scan_on_the_gpu_reads_nothing_back_between_steps() {
    let Some(gpu) = common::gpu_under_test() else {
        return;
    };
    for steps in [5, 600] {
        let inputs = rnn_inputs(steps, 2, 3, 16);
        let moved = gpu_transfers(&gpu, &rnn_scan(steps, 2, 3, steps == 5), &inputs);
        assert_eq!(moved.host_to_device_bytes, device_bytes(&inputs), "{steps}");
        assert_eq!(moved.device_to_host_bytes, 0, "{steps} steps: read back");
        let most = if steps == 5 { 1 } else { 4 };
        assert!(
            (1..=most).contains(&moved.submissions),
            "{steps} steps: {} submissions",
            moved.submissions
        );
        assert!(moved.dispatches >= steps as u64, "{moved:?}");
    }
}

/// A while loop reads one word back per decision, the condition before
/// each trip (n + 1 of them for n trips the condition ends, n for a loop
/// its bound ends), and writes only its trip count from the host.
#[test]
fn a_while_loop_on_the_gpu_reads_back_one_word_per_decision() {
    let Some(gpu) = common::gpu_under_test() else {
        return;
    };
    for (max_trips, decisions) in [(8, 6), (3, 3)] {
        let inputs = counted_inputs(4.5);
        let moved = gpu_transfers(&gpu, &counted_loop(max_trips), &inputs);
        assert_eq!(
            moved.device_to_host_bytes,
            4 * decisions,
            "bound {max_trips}"
        );
        assert_eq!(
            moved.host_to_device_bytes,
            device_bytes(&inputs) + 8,
            "the inputs and the trip count"
        );
    }
}

/// A cond reads its predicate back, one word, and runs only its branch.
#[test]
fn a_cond_on_the_gpu_reads_back_its_predicate_alone() {
    let Some(gpu) = common::gpu_under_test() else {
        return;
    };
    let mut rng = Rng(17);
    let (x, w) = (random(&[2, 3], &mut rng), random(&[2, 3], &mut rng));
    for pred in [true, false] {
        let inputs = vec![bool_scalar(pred), x.clone(), w.clone()];
        let moved = gpu_transfers(&gpu, &cond_graph(&[2, 3]), &inputs);
        assert_eq!(moved.device_to_host_bytes, 4, "pred {pred}");
        // then: two muls (fused into one kernel), else: exp and add (one).
        assert_eq!(moved.dispatches, 1, "pred {pred}: only the branch runs");
    }
}

/// Bodies that hand carries to one another: a step of Fibonacci swaps
/// its two carries, (a, b) → (b, a + b), so each new carry is read from
/// the other's buffer; in a scan (with `a` stacked) and a while loop.
#[test]
fn carries_that_swap_move_as_on_the_cpu() {
    let scalar = || f32_ty(&[]);
    let step = |g: &mut Graph, extra: &[TensorType]| {
        let a = g.input("a", scalar()).expect("a");
        let b = g.input("b", scalar()).expect("b");
        let rest: Vec<ValueId> = extra
            .iter()
            .enumerate()
            .map(|(k, ty)| g.input(format!("c{k}"), ty.clone()).expect("input"))
            .collect();
        let sum = g.add(a, b).expect("a + b");
        (a, b, sum, rest)
    };
    let mut body = Graph::new();
    let (a, b, sum, _) = step(&mut body, &[]);
    body.set_output("a", b).expect("out");
    body.set_output("b", sum).expect("out");
    body.set_output("y", a).expect("out");
    let mut g = Graph::new();
    let a0 = g.input("a0", scalar()).expect("a0");
    let b0 = g.input("b0", scalar()).expect("b0");
    let scan = Scan {
        body,
        carries: 2,
        scanned: 0,
        length: Dim::Fixed(10),
        reverse: false,
        checkpoint: 0,
    };
    let results = g
        .push_tuple(Op::Scan(Box::new(scan)), &[a0, b0])
        .expect("scan");
    g.set_output("a", results[0]).expect("out");
    g.set_output("b", results[1]).expect("out");
    g.set_output("ys", results[2]).expect("out");
    let out = run(&g, vec![Value::scalar_f32(0.0), Value::scalar_f32(1.0)]);
    assert_eq!(out[0], Value::scalar_f32(55.0));
    assert_eq!(out[1], Value::scalar_f32(89.0));
    let fibonacci = [0.0, 1.0, 1.0, 2.0, 3.0, 5.0, 8.0, 13.0, 21.0, 34.0];
    assert_eq!(out[2], Value::f32(&[10], fibonacci.to_vec()).expect("ys"));

    let mut cond = Graph::new();
    let (_, b, _, rest) = step(&mut cond, &[scalar()]);
    let go = cond.binary(BinaryOp::Lt, b, rest[0]).expect("b < bound");
    cond.set_output("go", go).expect("out");
    let mut body = Graph::new();
    let (_, b, sum, _) = step(&mut body, &[scalar()]);
    body.set_output("a", b).expect("out");
    body.set_output("b", sum).expect("out");
    let mut g = Graph::new();
    let a0 = g.input("a0", scalar()).expect("a0");
    let b0 = g.input("b0", scalar()).expect("b0");
    let bound = g.input("bound", scalar()).expect("bound");
    let w = WhileLoop {
        cond,
        body,
        carries: 2,
        max_trips: 100,
    };
    let results = g
        .push_tuple(Op::WhileLoop(Box::new(w)), &[a0, b0, bound])
        .expect("while");
    g.set_output("a", results[0]).expect("out");
    g.set_output("b", results[1]).expect("out");
    g.set_output("trips", results[2]).expect("out");
    let out = run(
        &g,
        vec![
            Value::scalar_f32(0.0),
            Value::scalar_f32(1.0),
            Value::scalar_f32(50.0),
        ],
    );
    assert_eq!(
        out,
        vec![
            Value::scalar_f32(34.0),
            Value::scalar_f32(55.0),
            Value::scalar_i64(9),
        ]
    );
}

/// A while loop inside a scan's body: each step doubles 1 until it
/// reaches that step's bound and stacks the trips it took, so each
/// step's trip count, written from the host, must land in its own row.
#[test]
fn a_while_loop_inside_a_scan_counts_each_steps_trips() {
    let scalar = || f32_ty(&[]);
    let mut cond = Graph::new();
    let v = cond.input("v", scalar()).expect("v");
    let bound = cond.input("bound", scalar()).expect("bound");
    let go = cond.binary(BinaryOp::Lt, v, bound).expect("v < bound");
    cond.set_output("go", go).expect("out");
    let mut doubling = Graph::new();
    let v = doubling.input("v", scalar()).expect("v");
    let _bound = doubling.input("bound", scalar()).expect("bound");
    let twice = doubling.add(v, v).expect("2v");
    doubling.set_output("v", twice).expect("out");
    let mut body = Graph::new();
    let total = body.input("total", scalar()).expect("total");
    let bound = body.input("bound", scalar()).expect("bound");
    let one = body.scalar(1.0).expect("1");
    let w = WhileLoop {
        cond,
        body: doubling,
        carries: 1,
        max_trips: 6,
    };
    let inner = body
        .push_tuple(Op::WhileLoop(Box::new(w)), &[one, bound])
        .expect("while");
    let next = body.add(total, inner[0]).expect("total + v");
    body.set_output("total", next).expect("out");
    body.set_output("trips", inner[1]).expect("out");
    let mut g = Graph::new();
    let start = g.input("start", scalar()).expect("start");
    let bounds = g.input("bounds", f32_ty(&[5])).expect("bounds");
    let scan = Scan {
        body,
        carries: 1,
        scanned: 1,
        length: Dim::Fixed(5),
        reverse: true,
        checkpoint: 0,
    };
    let results = g
        .push_tuple(Op::Scan(Box::new(scan)), &[start, bounds])
        .expect("scan");
    g.set_output("total", results[0]).expect("out");
    g.set_output("trips", results[1]).expect("out");
    let bounds = Value::f32(&[5], vec![1.0, 3.0, 100.0, 8.0, 0.5]).expect("bounds");
    let out = run(&g, vec![Value::scalar_f32(0.0), bounds]);
    // 1, 4, 64 (the bound of 6 trips ends it), 8, 1.
    assert_eq!(out[0], Value::scalar_f32(78.0));
    assert_eq!(
        out[1],
        Value::i64(&[5], vec![0, 2, 6, 3, 0]).expect("trips")
    );
}

/// A scan of no steps returns its initial carries and empty stacks.
#[test]
fn a_scan_of_no_steps_returns_its_initial_carries() {
    let mut g = Graph::new();
    let h0 = g.input("h0", f32_ty(&[2, 3])).expect("h0");
    let xs = g.input("xs", f32_ty(&[0, 2, 3])).expect("xs");
    let w = g.input("w", f32_ty(&[3, 3])).expect("w");
    let scan = Scan {
        body: rnn_body(2, 3),
        carries: 1,
        scanned: 1,
        length: Dim::Fixed(0),
        reverse: false,
        checkpoint: 0,
    };
    let results = g
        .push_tuple(Op::Scan(Box::new(scan)), &[h0, xs, w])
        .expect("scan");
    g.set_output("h", results[0]).expect("out");
    g.set_output("ys", results[1]).expect("out");
    let mut inputs = rnn_inputs(1, 2, 3, 18);
    inputs[1] = Value::f32(&[0, 2, 3], vec![]).expect("no steps");
    let out = run(&g, inputs.clone());
    assert_eq!(out[0], inputs[0]);
    assert_eq!(out[1].shape(), &[0, 2, 3]);
}

/// A body the adapter cannot hold (a value of 64 GiB inside it) is
/// refused when the plan is laid out, naming the loop it sits in.
#[test]
fn a_body_past_the_adapters_limits_is_refused_naming_its_loop() {
    let Some(gpu) = common::gpu_under_test() else {
        return;
    };
    let huge = 1usize << 34;
    let mut body = Graph::new();
    let c = body.input("c", f32_ty(&[1])).expect("c");
    let spread = body
        .push(
            Op::Broadcast {
                shape: vec![Dim::Fixed(huge)],
            },
            &[c],
        )
        .expect("broadcast");
    let total = body.sum(spread, &[0], true).expect("sum");
    body.set_output("c", total).expect("out");
    let mut g = Graph::new();
    let c0 = g.input("c0", f32_ty(&[1])).expect("c0");
    let scan = Scan {
        body,
        carries: 1,
        scanned: 0,
        length: Dim::Fixed(2),
        reverse: false,
        checkpoint: 0,
    };
    let c = g.push_tuple(Op::Scan(Box::new(scan)), &[c0]).expect("scan")[0];
    g.set_output("c", c).expect("out");
    let error = gpu
        .compile(&g)
        .expect("compiles: the plan is laid out at the first run")
        .run(vec![Value::f32(&[1], vec![1.0]).expect("c0")])
        .expect_err("64 GiB in the body");
    let message = error.to_string();
    assert!(
        matches!(error, canopy_engine::EngineError::Gpu { .. })
            && message.contains("in the body of node %1 (scan)")
            && message.contains("bytes"),
        "{message}"
    );
}

/// An index out of range inside a body fails the run on the GPU too.
#[test]
fn an_index_out_of_range_inside_a_body_fails_on_the_gpu() {
    let Some(gpu) = common::gpu_under_test() else {
        return;
    };
    let (g, inputs) = scan_with_a_bad_index();
    let error = gpu
        .compile(&g)
        .expect("compile")
        .run(inputs)
        .expect_err("index 7 of 2");
    assert!(
        error.to_string().contains("index was out of range"),
        "{error}"
    );
}
