//! Export: every exportable IR op, in small graphs, (1) imports back to a
//! graph that computes the same outputs on the CPU backend, and (2) runs in
//! ONNX Runtime with the same outputs as canopy (`tests/reference/
//! export_ops.py`, after `onnx.checker` with full shape inference).
//! Refusals name the node and op.

mod common;

use std::collections::BTreeSet;

use anyhow::{Context, Result, bail, ensure};
use canopy_engine::Value;
use canopy_ir::model::PARAM_PREFIX;
use canopy_ir::{
    BinaryOp, Buffer, Cond, Conv2dAttrs, CustomGrad, DType, Dim, Graph, Metadata, Model, Op,
    Parameter, Pool2dAttrs, ReduceKind, Scan, Shape, TensorData, TensorType, UnaryOp, ValueId,
    WhileLoop,
};
use canopy_onnx::{
    BATCH_DIM_PARAM, EXPORT_OPSET, ExportOptions, Limits, OnnxError, decode_model, encode,
    export_graph, export_model, import_model,
};
use common::{ReferenceCase, onnx_runtime_agrees, run};

/// One graph and the inputs it runs on.
struct Case {
    name: String,
    graph: Graph,
    inputs: Vec<Value>,
}

/// Deterministic values in [-2, 2); a longer tensor also holds 0, ±1e-7
/// (log1p's and softplus's precision) and ±30 (their overflow).
fn values(count: usize, seed: u64) -> Vec<f32> {
    const SPECIAL: [f32; 5] = [0.0, 1e-7, -1e-7, 30.0, -30.0];
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..count)
        .map(|i| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let random = (state >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0;
            match i.checked_sub(3) {
                Some(k) if count > 12 && k < SPECIAL.len() => SPECIAL[k],
                _ => random,
            }
        })
        .collect()
}

fn f32_value(shape: &[usize], seed: u64) -> Value {
    let count = shape.iter().product();
    Value::f32(shape, values(count, seed)).expect("shape matches")
}

fn batch(dims: &[usize]) -> Shape {
    let mut shape = vec![Dim::Batch];
    shape.extend(dims.iter().map(|&d| Dim::Fixed(d)));
    Shape(shape)
}

fn f32_type(shape: Shape) -> TensorType {
    TensorType::new(DType::F32, shape)
}

/// A graph of `inputs` with output `y` made by `build`.
fn case(
    name: impl Into<String>,
    inputs: &[(&str, TensorType, Value)],
    build: impl FnOnce(&mut Graph, &[ValueId]) -> canopy_ir::IrResult<ValueId>,
) -> Case {
    let mut graph = Graph::new();
    let ids: Vec<ValueId> = inputs
        .iter()
        .map(|(name, ty, _)| graph.input(*name, ty.clone()).expect("input"))
        .collect();
    let name = name.into();
    let y = build(&mut graph, &ids).unwrap_or_else(|e| panic!("case {name}: {e}"));
    graph.set_output("y", y).expect("output");
    Case {
        name,
        graph,
        inputs: inputs.iter().map(|(_, _, v)| v.clone()).collect(),
    }
}

fn x_input(dims: &[usize], seed: u64) -> (&'static str, TensorType, Value) {
    let mut shape = vec![3];
    shape.extend_from_slice(dims);
    ("x", f32_type(batch(dims)), f32_value(&shape, seed))
}

fn positive(value: Value) -> Value {
    match value {
        Value::F32(a) => Value::F32(a.mapv(|v| v.abs() + 0.05)),
        other => other,
    }
}

fn unary_cases() -> Vec<Case> {
    UnaryOp::ALL
        .into_iter()
        .map(|op| {
            let (_, ty, value) = x_input(&[16], op.position() as u64 + 1);
            let value = match op {
                UnaryOp::Log | UnaryOp::Sqrt | UnaryOp::Rsqrt | UnaryOp::Reciprocal => {
                    positive(value)
                }
                _ => value,
            };
            case(format!("unary_{op:?}"), &[("x", ty, value)], |g, i| {
                if op == UnaryOp::Not {
                    let zero = g.scalar(0.0)?;
                    let positive = g.binary(BinaryOp::Gt, i[0], zero)?;
                    g.unary(op, positive)
                } else {
                    g.unary(op, i[0])
                }
            })
        })
        .collect()
}

fn binary_cases() -> Vec<Case> {
    BinaryOp::ALL
        .into_iter()
        .map(|op| {
            let seed = 100 + op.position() as u64;
            let a = x_input(&[4], seed);
            let a = if op == BinaryOp::Pow {
                ("x", a.1, positive(a.2))
            } else {
                a
            };
            // Every other element of b equals a's, so comparisons see ties.
            let b = ("b", f32_type(Shape::fixed(&[4])), f32_value(&[4], seed + 7));
            case(format!("binary_{op:?}"), &[a, b], |g, i| {
                if op.is_logical() {
                    let zero = g.scalar(0.0)?;
                    let left = g.binary(BinaryOp::Gt, i[0], zero)?;
                    let right = g.binary(BinaryOp::Lt, i[1], zero)?;
                    g.binary(op, left, right)
                } else if op.is_comparison() {
                    let rounded_a = g.push(Op::Cast { to: DType::I64 }, &[i[0]])?;
                    let rounded_b = g.push(Op::Cast { to: DType::I64 }, &[i[1]])?;
                    let a = g.cast(rounded_a, DType::F32)?;
                    let b = g.cast(rounded_b, DType::F32)?;
                    g.binary(op, a, b)
                } else {
                    g.binary(op, i[0], i[1])
                }
            })
        })
        .collect()
}

fn reduce_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for kind in ReduceKind::ALL {
        for (axes, keep) in [(vec![1], false), (vec![0, 2], true), (vec![], false)] {
            let x = x_input(&[4, 5], 200 + kind.position() as u64);
            let name = format!("reduce_{kind:?}_{axes:?}_{keep}");
            cases.push(case(name, &[x], |g, i| g.reduce(kind, i[0], &axes, keep)));
        }
    }
    cases
}

fn matmul_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
        let a_dims = if ta { [3, 2] } else { [2, 3] };
        let b_dims = if tb { [4, 3] } else { [3, 4] };
        let a = (
            "a",
            f32_type(Shape::fixed(&a_dims)),
            f32_value(&a_dims, 300),
        );
        let b = (
            "b",
            f32_type(Shape::fixed(&b_dims)),
            f32_value(&b_dims, 301),
        );
        cases.push(case(format!("matmul_2d_{ta}_{tb}"), &[a, b], |g, i| {
            g.matmul_t(i[0], i[1], ta, tb)
        }));
        let a_dims = if ta { [3, 2] } else { [2, 3] };
        let x = x_input(&a_dims, 302);
        let w = (
            "w",
            f32_type(Shape::fixed(&b_dims)),
            f32_value(&b_dims, 303),
        );
        cases.push(case(
            format!("matmul_batched_{ta}_{tb}"),
            &[x, w],
            |g, i| g.matmul_t(i[0], i[1], ta, tb),
        ));
    }
    cases
}

fn shape_cases() -> Vec<Case> {
    let fixed = |dims: &[usize], seed| {
        let name = if seed % 2 == 0 { "a" } else { "b" };
        (name, f32_type(Shape::fixed(dims)), f32_value(dims, seed))
    };
    vec![
        case("reshape_batch", &[x_input(&[2, 3], 400)], |g, i| {
            g.reshape(i[0], vec![Dim::Batch, Dim::Fixed(6)])
        }),
        case("reshape_fixed", &[fixed(&[2, 3], 402)], |g, i| {
            g.reshape(i[0], vec![Dim::Fixed(3), Dim::Fixed(1), Dim::Fixed(2)])
        }),
        case("transpose", &[x_input(&[2, 3], 404)], |g, i| {
            g.transpose(i[0], vec![2, 0, 1])
        }),
        case("broadcast_keeps_batch", &[x_input(&[1], 406)], |g, i| {
            g.broadcast(i[0], vec![Dim::Fixed(2), Dim::Batch, Dim::Fixed(3)])
        }),
        case(
            "broadcast_adds_batch",
            &[x_input(&[3], 408), fixed(&[3], 410)],
            |g, i| {
                let b = g.broadcast(i[1], vec![Dim::Batch, Dim::Fixed(3)])?;
                g.add(i[0], b)
            },
        ),
        case("broadcast_fixed", &[fixed(&[1, 3], 412)], |g, i| {
            g.broadcast(i[0], vec![Dim::Fixed(4), Dim::Fixed(3)])
        }),
        case("slice", &[x_input(&[5, 2], 414)], |g, i| {
            g.push(
                Op::Slice {
                    axis: 1,
                    start: 1,
                    end: 4,
                },
                &[i[0]],
            )
        }),
        case("pad", &[x_input(&[2, 3], 416)], |g, i| {
            g.push(
                Op::Pad {
                    axis: 2,
                    before: 1,
                    after: 2,
                },
                &[i[0]],
            )
        }),
        case(
            "concat",
            &[
                x_input(&[2], 418),
                ("z", f32_type(batch(&[3])), f32_value(&[3, 3], 419)),
            ],
            |g, i| g.push(Op::Concat { axis: 1 }, &[i[0], i[1], i[0]]),
        ),
        case("where", &[x_input(&[4], 420), fixed(&[4], 421)], |g, i| {
            let cond = g.binary(BinaryOp::Gt, i[0], i[1])?;
            g.select(cond, i[0], i[1])
        }),
    ]
}

fn cast_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for to in [DType::I64, DType::I32, DType::Bool] {
        let x = x_input(&[6], 500);
        cases.push(case(format!("cast_f32_{to}"), &[x], |g, i| {
            let scaled = g.scalar(3.0)?;
            let scaled = g.mul(i[0], scaled)?;
            g.cast(scaled, to)
        }));
        let x = x_input(&[6], 501);
        cases.push(case(format!("cast_{to}_f32"), &[x], |g, i| {
            let scaled = g.scalar(3.0)?;
            let scaled = g.mul(i[0], scaled)?;
            let other = g.cast(scaled, to)?;
            g.cast(other, DType::F32)
        }));
    }
    cases
}

fn image(channels: usize, side: usize, seed: u64) -> (&'static str, TensorType, Value) {
    x_input(&[channels, side, side], seed)
}

fn window_cases() -> Vec<Case> {
    let filter = |dims: &[usize]| ("w", f32_type(Shape::fixed(dims)), f32_value(dims, 601));
    let mut cases = Vec::new();
    for (stride, padding, dilation) in [(1, 0, 1), (2, 1, 1), (1, 2, 2)] {
        let attrs = Conv2dAttrs {
            stride: [stride, stride],
            padding: [padding, padding],
            dilation: [dilation, 1],
        };
        let name = format!("conv2d_s{stride}_p{padding}_d{dilation}");
        cases.push(case(
            name,
            &[image(2, 7, 600), filter(&[3, 2, 3, 2])],
            |g, i| g.conv2d(i[0], i[1], attrs),
        ));
    }
    for (kernel, stride, padding) in [(2, 2, 0), (3, 1, 1), (3, 2, 1)] {
        let attrs = Pool2dAttrs {
            kernel: [kernel, kernel],
            stride: [stride, stride],
            padding: [padding, padding],
        };
        let name = format!("max_pool2d_k{kernel}_s{stride}_p{padding}");
        cases.push(case(name, &[image(2, 6, 602)], |g, i| {
            g.max_pool2d(i[0], attrs)
        }));
        let name = format!("avg_pool2d_k{kernel}_s{stride}_p{padding}");
        cases.push(case(name, &[image(2, 6, 603)], |g, i| {
            g.avg_pool2d(i[0], attrs)
        }));
    }
    cases
}

fn index_cases() -> Vec<Case> {
    let indices = |dtype: DType, values: Vec<i64>| -> (&'static str, TensorType, Value) {
        let shape = [values.len()];
        let value = match dtype {
            DType::I32 => Value::from_data(
                &TensorData::new(
                    shape.to_vec(),
                    Buffer::I32(values.iter().map(|&v| v as i32).collect()),
                )
                .expect("vector"),
            ),
            _ => Value::i64(&shape, values).expect("vector"),
        };
        ("i", TensorType::new(dtype, batch(&[])), value)
    };
    let table = (
        "t",
        f32_type(Shape::fixed(&[5, 3])),
        f32_value(&[5, 3], 700),
    );
    let mut cases = Vec::new();
    for dtype in [DType::I64, DType::I32] {
        cases.push(case(
            format!("gather_axis0_{dtype}"),
            &[table.clone(), indices(dtype, vec![4, 0, 2, 2])],
            |g, i| g.push(Op::Gather { axis: 0 }, &[i[0], i[1]]),
        ));
        cases.push(case(
            format!("gather_axis1_{dtype}"),
            &[table.clone(), indices(dtype, vec![2, 1, 0])],
            |g, i| g.push(Op::Gather { axis: 1 }, &[i[0], i[1]]),
        ));
        // -1 and 4 are outside [0, 4): their rows are zeros.
        cases.push(case(
            format!("one_hot_{dtype}"),
            &[indices(dtype, vec![0, 3, -1, 4, 2])],
            |g, i| g.push(Op::OneHot { depth: 4 }, &[i[0]]),
        ));
    }
    for (axis, keep_dims) in [(1, false), (0, true), (2, false)] {
        cases.push(case(
            format!("argmax_{axis}_{keep_dims}"),
            &[x_input(&[4, 3], 701)],
            |g, i| g.argmax(i[0], axis, keep_dims),
        ));
    }
    for axis in [0, 1] {
        cases.push(case(
            format!("softmax_{axis}"),
            &[x_input(&[6], 702)],
            |g, i| g.softmax(i[0], axis),
        ));
        cases.push(case(
            format!("log_softmax_{axis}"),
            &[x_input(&[6], 703)],
            |g, i| g.log_softmax(i[0], axis),
        ));
    }
    cases
}

/// A custom gradient whose forward graph is x·x + x, on `shape`.
fn square_plus(shape: Shape) -> Op {
    let mut forward = Graph::new();
    let x = forward.input("x", f32_type(shape.clone())).unwrap();
    let square = forward.mul(x, x).unwrap();
    let y = forward.add(square, x).unwrap();
    forward.set_output("y", y).unwrap();
    let mut backward = Graph::new();
    let bx = backward.input("x", f32_type(shape.clone())).unwrap();
    backward.input("y", f32_type(shape.clone())).unwrap();
    let dy = backward.input("dy", f32_type(shape)).unwrap();
    let dx = backward.mul(bx, dy).unwrap();
    backward.set_output("dx", dx).unwrap();
    Op::CustomGrad(Box::new(CustomGrad {
        name: "square_plus".to_string(),
        forward,
        backward,
    }))
}

/// A custom gradient exports as its forward graph: x·x + x.
fn custom_grad_case() -> Case {
    case("custom_grad", &[x_input(&[4], 800)], |g, i| {
        g.push(square_plus(batch(&[4])), &[i[0]])
    })
}

/// Outputs that are an input, a constant, and one value twice: each needs
/// an Identity to carry its name.
fn naming_case() -> Case {
    let mut graph = Graph::new();
    let x = graph.input("x", f32_type(batch(&[3]))).unwrap();
    let c = graph
        .constant(TensorData::f32(vec![2], vec![1.5, -2.0]).unwrap())
        .unwrap();
    let r = graph.relu(x).unwrap();
    graph.set_output("same_as_x", x).unwrap();
    graph.set_output("constant", c).unwrap();
    graph.set_output("relu", r).unwrap();
    graph.set_output("relu_again", r).unwrap();
    Case {
        name: "output_naming".to_string(),
        graph,
        inputs: vec![f32_value(&[2, 3], 900)],
    }
}

/// Values in [-1, 1], for loops: a long run of steps through `exp` or a
/// product stays finite.
fn small_value(shape: &[usize], seed: u64) -> Value {
    match f32_value(shape, seed) {
        Value::F32(a) => Value::F32(a.mapv(|v| v.clamp(-2.0, 2.0) * 0.5)),
        other => other,
    }
}

fn bool_value(shape: &[usize], values: Vec<bool>) -> Value {
    let data = TensorData::new(shape.to_vec(), Buffer::Bool(values)).expect("shape matches");
    Value::from_data(&data)
}

/// A graph with `inputs` whose outputs `build` names.
fn multi_case(
    name: &str,
    inputs: &[(&str, TensorType, Value)],
    build: impl FnOnce(&mut Graph, &[ValueId]) -> canopy_ir::IrResult<Vec<(&'static str, ValueId)>>,
) -> Case {
    let mut graph = Graph::new();
    let ids: Vec<ValueId> = inputs
        .iter()
        .map(|(name, ty, _)| graph.input(*name, ty.clone()).expect("input"))
        .collect();
    let outputs = build(&mut graph, &ids).unwrap_or_else(|e| panic!("case {name}: {e}"));
    let outputs = outputs
        .into_iter()
        .map(|(name, v)| (name.to_string(), v))
        .collect();
    graph.set_outputs(outputs).expect("outputs");
    Case {
        name: name.to_string(),
        graph,
        inputs: inputs.iter().map(|(_, _, v)| v.clone()).collect(),
    }
}

/// A body graph of `inputs`; `build` returns its outputs.
fn body(
    inputs: &[(&str, TensorType)],
    build: impl FnOnce(&mut Graph, &[ValueId]) -> canopy_ir::IrResult<Vec<(&'static str, ValueId)>>,
) -> Graph {
    let mut graph = Graph::new();
    let ids: Vec<ValueId> = inputs
        .iter()
        .map(|(name, ty)| graph.input(*name, ty.clone()).expect("input"))
        .collect();
    let outputs = build(&mut graph, &ids).expect("body");
    let outputs = outputs
        .into_iter()
        .map(|(name, v)| (name.to_string(), v))
        .collect();
    graph.set_outputs(outputs).expect("outputs");
    graph
}

/// One recurrent step on the batch: h' = tanh(h·W + x), and y = f(h'·h'
/// plus ½ broadcast to [N, 3]) for f(v) = v·v + v a custom gradient. The
/// broadcast inside the body needs the main graph's batch dimension, and
/// the custom gradient must be inlined in the body.
fn rnn_body() -> Graph {
    let state = f32_type(batch(&[3]));
    body(
        &[
            ("h", state.clone()),
            ("x", state.clone()),
            ("w", f32_type(Shape::fixed(&[3, 3]))),
        ],
        |g, i| {
            let hw = g.matmul(i[0], i[2])?;
            let pre = g.add(hw, i[1])?;
            let next = g.unary(UnaryOp::Tanh, pre)?;
            let square = g.mul(next, next)?;
            let half = g.scalar(0.5)?;
            let half = g.broadcast(half, vec![Dim::Batch, Dim::Fixed(3)])?;
            let y = g.add(square, half)?;
            let y = g.push(square_plus(batch(&[3])), &[y])?;
            Ok(vec![("h", next), ("y", y)])
        },
    )
}

/// `then`: x·x·w; `else`: exp(x) + w.
fn branches(shape: Shape) -> Cond {
    let ty = f32_type(shape);
    let inputs = [("x", ty.clone()), ("w", ty)];
    Cond {
        then_branch: body(&inputs, |g, i| {
            let xx = g.mul(i[0], i[0])?;
            Ok(vec![("y", g.mul(xx, i[1])?)])
        }),
        else_branch: body(&inputs, |g, i| {
            let e = g.exp(i[0])?;
            Ok(vec![("y", g.add(e, i[1])?)])
        }),
    }
}

/// x ← tanh(x·w + b) and i ← i + 1 while i < bound, at most `max_trips`.
fn counted_loop(max_trips: usize) -> WhileLoop {
    let types = [
        ("x", f32_type(batch(&[3]))),
        ("i", f32_type(Shape::scalar())),
        ("w", f32_type(Shape::fixed(&[3, 3]))),
        ("b", f32_type(Shape::fixed(&[3]))),
        ("bound", f32_type(Shape::scalar())),
    ];
    WhileLoop {
        cond: body(&types, |g, v| {
            Ok(vec![("go", g.binary(BinaryOp::Lt, v[1], v[4])?)])
        }),
        body: body(&types, |g, v| {
            let xw = g.matmul(v[0], v[2])?;
            let pre = g.add(xw, v[3])?;
            let x = g.unary(UnaryOp::Tanh, pre)?;
            let one = g.scalar(1.0)?;
            Ok(vec![("x", x), ("i", g.add(v[1], one)?)])
        }),
        carries: 2,
        max_trips,
    }
}

fn scan_op(body: Graph, carries: usize, scanned: usize, length: Dim, reverse: bool) -> Op {
    Op::Scan(Box::new(Scan {
        body,
        carries,
        scanned,
        length,
        reverse,
        checkpoint: 0,
    }))
}

/// Each control-flow op, both directions of a scan, a scan over the batch
/// and one with no scanned input, both branches of a cond, a loop ended
/// by its condition and one by its bound, nesting both ways, and results
/// read twice or not at all.
fn control_flow_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for reverse in [false, true] {
        let inputs = [
            ("h0", f32_type(batch(&[3])), small_value(&[3, 3], 1000)),
            (
                "xs",
                f32_type(batch(&[4, 3])),
                small_value(&[3, 4, 3], 1001),
            ),
            (
                "w",
                f32_type(Shape::fixed(&[3, 3])),
                small_value(&[3, 3], 1002),
            ),
        ];
        let name = format!("scan_rnn_reverse_{reverse}");
        cases.push(multi_case(&name, &inputs, |g, i| {
            let steps = g.transpose(i[1], vec![1, 0, 2])?;
            let op = scan_op(rnn_body(), 1, 1, Dim::Fixed(4), reverse);
            let r = g.push_tuple(op, &[i[0], steps, i[2]])?;
            Ok(vec![("h", r[0]), ("ys", r[1])])
        }));
    }
    let rows = ("rows", f32_type(batch(&[3])), small_value(&[3, 3], 1003));
    let start = (
        "start",
        f32_type(Shape::fixed(&[3])),
        small_value(&[3], 1004),
    );
    cases.push(multi_case("scan_over_the_batch", &[start, rows], |g, i| {
        let row = f32_type(Shape::fixed(&[3]));
        let step = body(&[("total", row.clone()), ("row", row)], |b, v| {
            let next = b.add(v[0], v[1])?;
            Ok(vec![("total", next), ("scaled", b.mul(next, v[1])?)])
        });
        let r = g.push_tuple(scan_op(step, 1, 1, Dim::Batch, true), &[i[0], i[1]])?;
        Ok(vec![("total", r[0]), ("scaled", r[1])])
    }));
    for (length, name) in [
        (Dim::Fixed(5), "scan_without_xs"),
        (Dim::Batch, "scan_without_xs_over_the_batch"),
    ] {
        let x = ("x", f32_type(batch(&[2])), small_value(&[3, 2], 1005));
        let c = ("c", f32_type(Shape::fixed(&[2])), small_value(&[2], 1006));
        cases.push(multi_case(name, &[x, c], |g, i| {
            let carry = f32_type(Shape::fixed(&[2]));
            let step = body(&[("s", carry.clone()), ("c", carry)], |b, v| {
                let half = b.scalar(0.5)?;
                let scaled = b.mul(v[0], half)?;
                let next = b.add(scaled, v[1])?;
                Ok(vec![("s", next), ("seen", v[0])])
            });
            let s0 = g.sum(i[0], &[0], false)?;
            let r = g.push_tuple(scan_op(step, 1, 0, length, true), &[s0, i[1]])?;
            Ok(vec![("s", r[0]), ("seen", r[1])])
        }));
    }
    for pred in [true, false] {
        let inputs = [
            (
                "pred",
                TensorType::scalar(DType::Bool),
                bool_value(&[], vec![pred]),
            ),
            ("x", f32_type(batch(&[3])), small_value(&[3, 3], 1007)),
            ("w", f32_type(batch(&[3])), small_value(&[3, 3], 1008)),
        ];
        cases.push(multi_case(&format!("cond_{pred}"), &inputs, |g, i| {
            let op = Op::Cond(Box::new(branches(batch(&[3]))));
            let r = g.push_tuple(op, &[i[0], i[1], i[2]])?;
            Ok(vec![("y", r[0])])
        }));
    }
    for (max_trips, bound) in [(8, 4.5), (3, 4.5)] {
        let inputs = [
            ("x", f32_type(batch(&[3])), small_value(&[3, 3], 1009)),
            ("i", f32_type(Shape::scalar()), Value::scalar_f32(0.0)),
            (
                "w",
                f32_type(Shape::fixed(&[3, 3])),
                small_value(&[3, 3], 1010),
            ),
            ("b", f32_type(Shape::fixed(&[3])), small_value(&[3], 1011)),
            ("bound", f32_type(Shape::scalar()), Value::scalar_f32(bound)),
        ];
        let name = format!("while_loop_max_{max_trips}");
        cases.push(multi_case(&name, &inputs, |g, i| {
            let op = Op::WhileLoop(Box::new(counted_loop(max_trips)));
            let r = g.push_tuple(op, i)?;
            let squared = g.mul(r[0], r[0])?;
            Ok(vec![
                ("x_squared", squared),
                ("count", r[1]),
                ("trips", r[2]),
            ])
        }));
    }
    // A cond inside a scan: each step branches on its flag.
    let inputs = [
        ("h0", f32_type(Shape::fixed(&[3])), small_value(&[3], 1012)),
        (
            "flags",
            TensorType::new(DType::Bool, Shape::fixed(&[5])),
            bool_value(&[5], vec![true, false, false, true, false]),
        ),
        ("w", f32_type(Shape::fixed(&[3])), small_value(&[3], 1013)),
    ];
    cases.push(multi_case("cond_inside_scan", &inputs, |g, i| {
        let row = f32_type(Shape::fixed(&[3]));
        let step = body(
            &[
                ("h", row.clone()),
                ("flag", TensorType::scalar(DType::Bool)),
                ("w", row),
            ],
            |b, v| {
                let op = Op::Cond(Box::new(branches(Shape::fixed(&[3]))));
                let next = b.push_tuple(op, &[v[1], v[0], v[2]])?[0];
                Ok(vec![("h", b.unary(UnaryOp::Tanh, next)?)])
            },
        );
        let h = g.push_tuple(
            scan_op(step, 1, 1, Dim::Fixed(5), false),
            &[i[0], i[1], i[2]],
        )?[0];
        Ok(vec![("h", h)])
    }));
    // A scan inside a cond's branch, a loop inside the other.
    for pred in [true, false] {
        let inputs = [
            (
                "pred",
                TensorType::scalar(DType::Bool),
                bool_value(&[], vec![pred]),
            ),
            ("h0", f32_type(batch(&[3])), small_value(&[3, 3], 1014)),
            (
                "xs",
                f32_type(Shape::fixed(&[4, 3])),
                small_value(&[4, 3], 1015),
            ),
            (
                "w",
                f32_type(Shape::fixed(&[3, 3])),
                small_value(&[3, 3], 1016),
            ),
        ];
        let name = format!("scan_and_loop_inside_cond_{pred}");
        cases.push(multi_case(&name, &inputs, |g, i| {
            let types = [
                ("h0", f32_type(batch(&[3]))),
                ("xs", f32_type(Shape::fixed(&[4, 3]))),
                ("w", f32_type(Shape::fixed(&[3, 3]))),
            ];
            let then_branch = body(&types, |b, v| {
                let row = f32_type(Shape::fixed(&[3]));
                let step = body(
                    &[
                        ("h", f32_type(batch(&[3]))),
                        ("x", row),
                        ("w", f32_type(Shape::fixed(&[3, 3]))),
                    ],
                    |s, u| {
                        let hw = s.matmul(u[0], u[2])?;
                        let pre = s.add(hw, u[1])?;
                        Ok(vec![("h", s.unary(UnaryOp::Tanh, pre)?)])
                    },
                );
                let h = b.push_tuple(
                    scan_op(step, 1, 1, Dim::Fixed(4), false),
                    &[v[0], v[1], v[2]],
                )?[0];
                Ok(vec![("h", h)])
            });
            let else_branch = body(&types, |b, v| {
                let zero = b.scalar(0.0)?;
                let bound = b.scalar(2.5)?;
                // The loop's b is a zero vector made in the branch.
                let zeros = b.broadcast(zero, vec![Dim::Fixed(3)])?;
                let op = Op::WhileLoop(Box::new(counted_loop(6)));
                let r = b.push_tuple(op, &[v[0], zero, v[2], zeros, bound])?;
                Ok(vec![("h", r[0])])
            });
            let op = Op::Cond(Box::new(Cond {
                then_branch,
                else_branch,
            }));
            let h = g.push_tuple(op, &[i[0], i[1], i[2], i[3]])?[0];
            Ok(vec![("h", h)])
        }));
    }
    // A result read by two `output` nodes, and results no node reads.
    let inputs = [
        ("h0", f32_type(batch(&[3])), small_value(&[3, 3], 1017)),
        (
            "xs",
            f32_type(batch(&[4, 3])),
            small_value(&[3, 4, 3], 1018),
        ),
        (
            "w",
            f32_type(Shape::fixed(&[3, 3])),
            small_value(&[3, 3], 1019),
        ),
    ];
    cases.push(multi_case(
        "scan_results_read_twice_or_never",
        &inputs,
        |g, i| {
            let steps = g.transpose(i[1], vec![1, 0, 2])?;
            let tuple = g.push(
                scan_op(rnn_body(), 1, 1, Dim::Fixed(4), false),
                &[i[0], steps, i[2]],
            )?;
            let first = g.push(Op::Output { index: 0 }, &[tuple])?;
            let again = g.push(Op::Output { index: 0 }, &[tuple])?;
            let sum = g.add(first, again)?;
            Ok(vec![("h", first), ("sum", sum)])
        },
    ));
    cases
}

fn all_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    cases.extend(unary_cases());
    cases.extend(binary_cases());
    cases.extend(reduce_cases());
    cases.extend(matmul_cases());
    cases.extend(shape_cases());
    cases.extend(cast_cases());
    cases.extend(window_cases());
    cases.extend(index_cases());
    cases.push(custom_grad_case());
    cases.push(naming_case());
    cases.extend(control_flow_cases());
    cases
}

/// The ops export refuses; every other op has a case.
const REFUSED: &[&str] = &canopy_onnx::export::NOT_EXPORTED_OPS;

/// Every op name of the IR, from a match with no wildcard: a new op is a
/// compile error here until it is exported or refused.
fn every_op_name() -> BTreeSet<&'static str> {
    let attrs = Pool2dAttrs {
        kernel: [1, 1],
        stride: [1, 1],
        padding: [0, 0],
    };
    let ops = [
        Op::Input {
            name: String::new(),
        },
        Op::Constant(Box::new(TensorData::scalar_f32(0.0))),
        Op::Where,
        Op::Cast { to: DType::F32 },
        Op::MatMul {
            transpose_a: false,
            transpose_b: false,
        },
        Op::Reshape { shape: vec![] },
        Op::Transpose { perm: vec![] },
        Op::Broadcast { shape: vec![] },
        Op::Slice {
            axis: 0,
            start: 0,
            end: 0,
        },
        Op::Pad {
            axis: 0,
            before: 0,
            after: 0,
        },
        Op::Concat { axis: 0 },
        Op::Conv2d(Conv2dAttrs::default()),
        Op::Conv2dBackwardInput {
            attrs: Conv2dAttrs::default(),
            input_hw: [1, 1],
        },
        Op::Conv2dBackwardFilter {
            attrs: Conv2dAttrs::default(),
            kernel_hw: [1, 1],
        },
        Op::MaxPool2d(attrs),
        Op::MaxPool2dSelect(attrs),
        Op::MaxPool2dBackward(attrs),
        Op::AvgPool2d(attrs),
        Op::AvgPool2dBackward {
            attrs,
            input_hw: [1, 1],
        },
        Op::ArgMax {
            axis: 0,
            keep_dims: false,
        },
        Op::Softmax { axis: 0 },
        Op::LogSoftmax { axis: 0 },
        Op::Gather { axis: 0 },
        Op::ScatterAdd {
            axis: 0,
            dim_size: 1,
        },
        Op::OneHot { depth: 1 },
        Op::RandomUniform { shape: vec![] },
        Op::CustomGrad(Box::new(CustomGrad {
            name: String::new(),
            forward: Graph::new(),
            backward: Graph::new(),
        })),
        Op::Scan(Box::new(Scan {
            body: Graph::new(),
            carries: 0,
            scanned: 0,
            length: Dim::Fixed(1),
            reverse: false,
            checkpoint: 0,
        })),
        Op::Cond(Box::new(Cond {
            then_branch: Graph::new(),
            else_branch: Graph::new(),
        })),
        Op::WhileLoop(Box::new(WhileLoop {
            cond: Graph::new(),
            body: Graph::new(),
            carries: 0,
            max_trips: 1,
        })),
        Op::Output { index: 0 },
    ];
    // The compiler checks this match covers every variant.
    let check = |op: &Op| match op {
        Op::Input { .. }
        | Op::Constant(_)
        | Op::Unary(_)
        | Op::Binary(_)
        | Op::Where
        | Op::Cast { .. }
        | Op::MatMul { .. }
        | Op::Reduce { .. }
        | Op::Reshape { .. }
        | Op::Transpose { .. }
        | Op::Broadcast { .. }
        | Op::Slice { .. }
        | Op::Pad { .. }
        | Op::Concat { .. }
        | Op::Conv2d(_)
        | Op::Conv2dBackwardInput { .. }
        | Op::Conv2dBackwardFilter { .. }
        | Op::MaxPool2d(_)
        | Op::MaxPool2dSelect(_)
        | Op::MaxPool2dBackward(_)
        | Op::AvgPool2d(_)
        | Op::AvgPool2dBackward { .. }
        | Op::ArgMax { .. }
        | Op::Softmax { .. }
        | Op::LogSoftmax { .. }
        | Op::Gather { .. }
        | Op::ScatterAdd { .. }
        | Op::OneHot { .. }
        | Op::RandomUniform { .. }
        | Op::CustomGrad(_)
        | Op::Scan(_)
        | Op::Cond(_)
        | Op::WhileLoop(_)
        | Op::Output { .. } => op.name(),
    };
    let mut names: BTreeSet<&'static str> = ops.iter().map(check).collect();
    names.extend(UnaryOp::ALL.map(|op| Op::Unary(op).name()));
    names.extend(BinaryOp::ALL.map(|op| Op::Binary(op).name()));
    names.extend(ReduceKind::ALL.map(|kind| {
        Op::Reduce {
            kind,
            axes: vec![],
            keep_dims: false,
        }
        .name()
    }));
    names
}

#[test]
fn the_cases_cover_every_op_export_does_not_refuse() {
    let covered: BTreeSet<&str> = all_cases()
        .iter()
        .flat_map(|case| case.graph.nodes().iter().map(|n| n.op.name()))
        .collect();
    let want: BTreeSet<&str> = every_op_name()
        .into_iter()
        .filter(|name| !REFUSED.contains(name))
        .collect();
    let missing: Vec<_> = want.difference(&covered).collect();
    assert!(
        missing.is_empty(),
        "ops without an export case: {missing:?}"
    );
}

/// A graph whose one op, `op`, reads inputs of `input_types`.
fn one_op_graph(op: Op, input_types: &[TensorType]) -> Result<Graph> {
    let mut graph = Graph::new();
    let mut inputs = Vec::with_capacity(input_types.len());
    for (index, ty) in input_types.iter().enumerate() {
        inputs.push(graph.input(format!("in{index}"), ty.clone())?);
    }
    let result = graph.push(op, &inputs)?;
    graph.set_output("out", result)?;
    Ok(graph)
}

/// One graph per op export refuses: with the coverage test above (every
/// other op exports), the list agrees with the exporter both ways.
#[test]
fn export_refuses_exactly_the_listed_ops() -> Result<()> {
    let image = f32_type(Shape::fixed(&[1, 1, 2, 2]));
    let unit_pool = Pool2dAttrs {
        kernel: [1, 1],
        stride: [1, 1],
        padding: [0, 0],
    };
    let graphs = [
        one_op_graph(
            Op::RandomUniform {
                shape: vec![Dim::Fixed(3)],
            },
            &[TensorType::scalar(DType::I64)],
        )?,
        one_op_graph(
            Op::ScatterAdd {
                axis: 0,
                dim_size: 4,
            },
            &[
                TensorType::new(DType::I64, Shape::fixed(&[2])),
                f32_type(Shape::fixed(&[2, 3])),
            ],
        )?,
        one_op_graph(
            Op::Conv2dBackwardInput {
                attrs: Conv2dAttrs::default(),
                input_hw: [2, 2],
            },
            &[image.clone(), f32_type(Shape::fixed(&[1, 1, 1, 1]))],
        )?,
        one_op_graph(
            Op::Conv2dBackwardFilter {
                attrs: Conv2dAttrs::default(),
                kernel_hw: [1, 1],
            },
            &[image.clone(), image.clone()],
        )?,
        one_op_graph(
            Op::MaxPool2dSelect(unit_pool),
            &[image.clone(), image.clone()],
        )?,
        one_op_graph(
            Op::MaxPool2dBackward(unit_pool),
            &[image.clone(), image.clone()],
        )?,
        one_op_graph(
            Op::AvgPool2dBackward {
                attrs: unit_pool,
                input_hw: [2, 2],
            },
            std::slice::from_ref(&image),
        )?,
    ];
    let mut refused = BTreeSet::new();
    for graph in &graphs {
        match export_graph(graph, &ExportOptions::default()) {
            Err(OnnxError::ExportUnsupported { op, .. }) => {
                ensure!(
                    REFUSED.contains(&op),
                    "export refuses {op}, which NOT_EXPORTED_OPS does not list"
                );
                refused.insert(op);
            }
            other => bail!("a graph of {:?} exported: {other:?}", graph.op_counts()),
        }
    }
    let listed: BTreeSet<&str> = REFUSED.iter().copied().collect();
    ensure!(
        refused == listed,
        "NOT_EXPORTED_OPS lists {listed:?}, export refused {refused:?}"
    );
    Ok(())
}

/// Values equal, NaN equal to NaN, within `tolerance` (absolute plus
/// relative) for f32.
fn compare(what: &str, got: &Value, want: &Value, tolerance: f32) -> Result<f32> {
    ensure!(
        got.dtype() == want.dtype() && got.shape() == want.shape(),
        "{what}: got {} {:?}, want {} {:?}",
        got.dtype(),
        got.shape(),
        want.dtype(),
        want.shape()
    );
    let (got, want) = (got.to_data(), want.to_data());
    match (&got.buffer, &want.buffer) {
        (Buffer::F32(g), Buffer::F32(w)) => {
            let mut worst = 0.0f32;
            for (index, (a, b)) in g.iter().zip(w).enumerate() {
                if a.is_nan() && b.is_nan() || a == b {
                    continue;
                }
                let diff = (a - b).abs();
                ensure!(
                    diff <= tolerance * (1.0 + b.abs()),
                    "{what}[{index}]: got {a}, want {b}"
                );
                worst = worst.max(diff);
            }
            Ok(worst)
        }
        _ => {
            ensure!(
                got.buffer == want.buffer,
                "{what}: got {got:?}, want {want:?}"
            );
            Ok(0.0)
        }
    }
}

fn export_and_import(graph: &Graph) -> Result<Graph> {
    let proto = export_graph(graph, &ExportOptions::default())?;
    let decoded = decode_model(&encode(&proto), &Limits::default())?;
    Ok(import_model(&decoded, &Limits::default())?.graph)
}

#[test]
fn every_exportable_op_imports_back_with_the_same_outputs() -> Result<()> {
    let mut bit_identical = 0;
    let cases = all_cases();
    for case in &cases {
        let imported = export_and_import(&case.graph).with_context(|| case.name.clone())?;
        let want = run(&case.graph, case.inputs.clone()).with_context(|| case.name.clone())?;
        let got = run(&imported, case.inputs.clone())
            .with_context(|| format!("{}: the imported graph", case.name))?;
        let names: Vec<&str> = imported.outputs().iter().map(|(n, _)| n.as_str()).collect();
        let want_names: Vec<&str> = case
            .graph
            .outputs()
            .iter()
            .map(|(n, _)| n.as_str())
            .collect();
        ensure!(names == want_names, "{}: outputs {names:?}", case.name);
        for (input, &id) in case.graph.inputs().iter().zip(imported.inputs()) {
            ensure!(
                case.graph.ty(*input) == imported.ty(id),
                "{}: input type changed",
                case.name
            );
        }
        let mut identical = true;
        for ((name, _), (g, w)) in case.graph.outputs().iter().zip(got.iter().zip(&want)) {
            let worst = compare(&format!("{} {name}", case.name), g, w, 2e-6)?;
            identical &= worst == 0.0;
        }
        bit_identical += usize::from(identical);
    }
    // The composed lowerings (GELU, softplus, log1p, rsqrt) round within
    // an ulp or two; everything else is the same IR op again.
    ensure!(
        bit_identical + 8 >= cases.len(),
        "only {bit_identical} of {} cases are bit-identical",
        cases.len()
    );
    Ok(())
}

/// Each case exported, with the outputs canopy computes for its inputs.
fn reference_cases(cases: &[Case]) -> Result<Vec<ReferenceCase>> {
    cases
        .iter()
        .map(|case| {
            let model = export_graph(&case.graph, &ExportOptions::default())
                .with_context(|| case.name.clone())?;
            let outputs = run(&case.graph, case.inputs.clone())?;
            let named =
                |names: Vec<String>, values: Vec<Value>| names.into_iter().zip(values).collect();
            Ok(ReferenceCase {
                name: case.name.clone(),
                model,
                inputs: named(
                    case.graph
                        .input_names()
                        .iter()
                        .map(|n| n.to_string())
                        .collect(),
                    case.inputs.clone(),
                ),
                outputs: named(
                    case.graph
                        .outputs()
                        .iter()
                        .map(|(n, _)| n.clone())
                        .collect(),
                    outputs,
                ),
            })
        })
        .collect()
}

#[test]
fn every_exportable_op_matches_onnx_runtime() -> Result<()> {
    onnx_runtime_agrees(&reference_cases(&all_cases())?)
}

fn tiny_model() -> Model {
    let mut graph = Graph::new();
    let w = graph
        .input(format!("{PARAM_PREFIX}w"), f32_type(Shape::fixed(&[3, 2])))
        .unwrap();
    let x = graph.input("x", f32_type(batch(&[3]))).unwrap();
    let y = graph.matmul(x, w).unwrap();
    graph.set_output("logits", y).unwrap();
    Model {
        metadata: Metadata::default(),
        parameters: vec![Parameter {
            name: "w".to_string(),
            data: TensorData::f32(vec![3, 2], vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap(),
            trainable: true,
        }],
        entry_points: [("infer".to_string(), graph)].into(),
    }
}

#[test]
fn a_model_exports_its_parameters_as_initializers() -> Result<()> {
    let model = tiny_model();
    let proto = export_model(&model, "infer", &ExportOptions::default())?;
    assert_eq!(proto.ir_version, 8);
    assert_eq!(proto.opset_import[0].version, EXPORT_OPSET);
    let graph = proto.graph.as_ref().unwrap();
    let inputs: Vec<&str> = graph.input.iter().map(|i| i.name.as_str()).collect();
    assert_eq!(inputs, ["x"]);
    let initializers: Vec<&str> = graph.initializer.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(initializers, ["w"]);
    let dims = format!("{:?}", graph.input[0].r#type);
    assert!(
        dims.contains(&format!("DimParam(\"{BATCH_DIM_PARAM}\")")),
        "{dims}"
    );

    let imported = import_model(&proto, &Limits::default())?;
    let x = Value::f32(&[2, 3], vec![1.0, 0.0, -1.0, 0.5, 0.5, 0.5])?;
    let got = run(&imported.graph, vec![x])?;
    common::assert_close("logits", &got[0], &[2, 2], &[-4.0, -4.0, 4.5, 6.0])?;

    let err = export_model(&model, "eval", &ExportOptions::default()).unwrap_err();
    assert!(err.to_string().contains("entry point `eval`"), "{err}");
    assert!(
        err.to_string()
            .contains("hint: the model has entry points [\"infer\"]"),
        "{err}"
    );
    Ok(())
}

#[test]
fn ops_without_an_onnx_form_are_refused_by_node_and_op() {
    let mut graph = Graph::new();
    let seed = graph.input("seed", TensorType::scalar(DType::I64)).unwrap();
    let noise = graph
        .push(
            Op::RandomUniform {
                shape: vec![Dim::Fixed(3)],
            },
            &[seed],
        )
        .unwrap();
    graph.set_output("noise", noise).unwrap();
    let err = export_graph(&graph, &ExportOptions::default()).unwrap_err();
    assert!(
        matches!(&err, OnnxError::ExportUnsupported { node, op: "random_uniform", .. } if node == "%1"),
        "{err:?}"
    );
    assert!(err.to_string().contains("another generator"), "{err}");
    assert!(
        err.to_string().contains("hint: export an inference graph"),
        "{err}"
    );

    let mut graph = Graph::new();
    let indices = graph
        .input("i", TensorType::new(DType::I64, Shape::fixed(&[2])))
        .unwrap();
    let updates = graph.input("u", f32_type(Shape::fixed(&[2, 3]))).unwrap();
    let scattered = graph
        .push(
            Op::ScatterAdd {
                axis: 0,
                dim_size: 4,
            },
            &[indices, updates],
        )
        .unwrap();
    graph.set_output("s", scattered).unwrap();
    let err = export_graph(&graph, &ExportOptions::default()).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("cannot export node %2 (scatter_add): it is a training-graph adjoint"),
        "{err}"
    );
}

#[test]
fn an_output_named_like_an_input_is_refused() {
    // train_step's `params/w` in and out: ONNX names each value once.
    let mut graph = Graph::new();
    let w = graph
        .input("params/w", f32_type(Shape::fixed(&[2])))
        .unwrap();
    let twice = graph.add(w, w).unwrap();
    graph.set_output("params/w", twice).unwrap();
    let err = export_graph(&graph, &ExportOptions::default()).unwrap_err();
    let message = err.to_string();
    assert!(
        message.contains("graph output `params/w`")
            && message.contains("`params/w` is already taken")
            && message.contains("hint: "),
        "{message}"
    );
}

/// The ops import gained for export's sake refuse what canopy-ir cannot
/// compute exactly, by node and attribute.
#[test]
fn import_refuses_what_the_new_ops_cannot_reproduce() -> Result<()> {
    use canopy_onnx::proto::data_type;
    use common::{attr_int, i64_tensor, model, node, output, value_info};
    let x = || value_info("x", data_type::FLOAT, &[None, Some(4), Some(4)]);
    let cases = [
        (
            node("Slice", &["x", "s", "e", "a", "st"], &["y"], vec![]),
            vec![
                i64_tensor("s", &[1], &[0]),
                i64_tensor("e", &[1], &[4]),
                i64_tensor("a", &[1], &[1]),
                i64_tensor("st", &[1], &[2]),
            ],
            "steps [2] are not supported",
        ),
        (
            node("Slice", &["x", "s", "e"], &["y"], vec![]),
            vec![i64_tensor("s", &[1], &[1]), i64_tensor("e", &[1], &[2])],
            "slicing the batch dimension (axis 0) is not supported",
        ),
        (
            node(
                "Pad",
                &["x", "p"],
                &["y"],
                vec![canopy_onnx::proto::AttributeProto {
                    name: "mode".to_string(),
                    r#type: canopy_onnx::proto::attribute_type::STRING,
                    s: b"reflect".to_vec(),
                    ..Default::default()
                }],
            ),
            vec![i64_tensor("p", &[6], &[0, 1, 0, 0, 1, 0])],
            "only constant padding is supported",
        ),
        (
            node("Pad", &["x", "p"], &["y"], vec![]),
            vec![i64_tensor("p", &[6], &[0, -1, 0, 0, 0, 0])],
            "non-negative sizes",
        ),
        (
            node(
                "ArgMax",
                &["x"],
                &["y"],
                vec![attr_int("select_last_index", 1)],
            ),
            vec![],
            "picks the first maximum",
        ),
        (
            node("Expand", &["x", "shape"], &["y"], vec![]),
            vec![i64_tensor("shape", &[3], &[1, 3, 4])],
            "cannot broadcast [N, 4, 4] to shape [1, 3, 4]",
        ),
        (
            node("ReduceSum", &["x", "axes"], &["y"], vec![]),
            vec![i64_tensor("axes", &[2], &[1, -2])],
            "name an axis twice",
        ),
    ];
    for (onnx_node, initializers, cause) in cases {
        let op = onnx_node.op_type.clone();
        let proto = model(vec![onnx_node], vec![x()], vec![output("y")], initializers);
        let err = import_model(&proto, &Limits::default()).unwrap_err();
        ensure!(
            err.to_string().contains(cause) && err.to_string().contains(&format!("({op}, #0)")),
            "{op}: {err}"
        );
    }
    Ok(())
}
