//! Import of ONNX control flow (If, Loop, Scan) as other producers write
//! it: bodies that read outer values by name (initializers, graph inputs,
//! values of an enclosing body), PyTorch's `for` loop (a constant `M`, a
//! constant true condition the body passes on) and a loop its condition
//! ends. Each model is checked by `onnx.checker` and run by ONNX Runtime
//! (`tests/reference/export_ops.py`) on the inputs canopy's import ran on,
//! with the same outputs. The forms canopy cannot type are refused naming
//! the node, the cause and a hint, and the limits bound nesting and trips.

mod common;

use anyhow::{Result, bail, ensure};
use canopy_engine::Value;
use canopy_ir::Graph;
use canopy_onnx::proto::{ModelProto, NodeProto, TensorProto, data_type};
use canopy_onnx::{ImportOptions, Limits, OnnxError, decode_model, import_model_with};
use common::*;

/// The reference script reads IR version 8, opset 17 models (what export
/// writes); every model here is one.
fn model_v8(
    nodes: Vec<NodeProto>,
    inputs: Vec<canopy_onnx::proto::ValueInfoProto>,
    outputs: Vec<canopy_onnx::proto::ValueInfoProto>,
    initializers: Vec<TensorProto>,
) -> ModelProto {
    ModelProto {
        ir_version: 8,
        ..model(nodes, inputs, outputs, initializers)
    }
}

fn bool_tensor(name: &str, dims: &[i64], data: &[bool]) -> TensorProto {
    TensorProto {
        name: name.to_string(),
        dims: dims.to_vec(),
        data_type: data_type::BOOL,
        int32_data: data.iter().map(|&b| i32::from(b)).collect(),
        ..Default::default()
    }
}

fn f32_value(shape: &[usize], data: Vec<f32>) -> Value {
    Value::f32(shape, data).expect("shape matches")
}

fn scalar_info(name: &str, elem_type: i32) -> canopy_onnx::proto::ValueInfoProto {
    value_info(name, elem_type, &[])
}

/// Imports `model` (through the wire format), runs it on the CPU backend
/// and returns a reference case with canopy's outputs.
fn imported_case(
    name: &str,
    model: &ModelProto,
    inputs: &[(&str, Value)],
) -> Result<(Graph, ReferenceCase)> {
    let graph = import_bytes(model)?;
    let values: Vec<Value> = inputs.iter().map(|(_, v)| v.clone()).collect();
    let outputs = run(&graph, values)?;
    let names = graph.outputs().iter().map(|(n, _)| n.clone());
    let case = ReferenceCase {
        name: name.to_string(),
        model: model.clone(),
        inputs: inputs
            .iter()
            .map(|(n, v)| (n.to_string(), v.clone()))
            .collect(),
        outputs: names.zip(outputs).collect(),
    };
    Ok((graph, case))
}

fn count(graph: &Graph, op: &str) -> usize {
    graph.op_counts().get(op).copied().unwrap_or(0)
}

/// PyTorch's `for i in range(4)`: `M` a constant, the condition a constant
/// true the body passes on (`Identity(cond_in)`). The body reads an
/// initializer (`w`) and a graph input (`b`) from the outer scope, uses
/// the iteration number, and stacks a scan output.
fn for_loop() -> ModelProto {
    let body = subgraph(
        "body",
        vec![
            node("Cast", &["i"], &["i_f"], vec![attr_int("to", 1)]),
            node("Mul", &["x_in", "w"], &["xw"], vec![]),
            node("Add", &["xw", "b"], &["xb"], vec![]),
            node("Add", &["xb", "i_f"], &["x_out"], vec![]),
            node("Identity", &["cond_in"], &["cond_out"], vec![]),
            node("Tanh", &["x_out"], &["y"], vec![]),
        ],
        vec![
            scalar_info("i", data_type::INT64),
            scalar_info("cond_in", data_type::BOOL),
            value_info("x_in", data_type::FLOAT, &[None, Some(3)]),
        ],
        vec![
            scalar_info("cond_out", data_type::BOOL),
            value_info("x_out", data_type::FLOAT, &[None, Some(3)]),
            value_info("y", data_type::FLOAT, &[None, Some(3)]),
        ],
        vec![],
    );
    model_v8(
        vec![node(
            "Loop",
            &["M", "cond", "x"],
            &["x_final", "ys"],
            vec![attr_graph("body", body)],
        )],
        vec![
            value_info("x", data_type::FLOAT, &[None, Some(3)]),
            value_info("b", data_type::FLOAT, &[Some(3)]),
        ],
        vec![
            value_info("x_final", data_type::FLOAT, &[None, Some(3)]),
            value_info("ys", data_type::FLOAT, &[Some(4), None, Some(3)]),
        ],
        vec![
            i64_tensor("M", &[], &[4]),
            bool_tensor("cond", &[], &[true]),
            f32_tensor("w", &[3], &[0.5, -1.0, 0.25]),
        ],
    )
}

#[test]
fn a_for_loop_imports_as_a_scan_of_its_trip_count() -> Result<()> {
    let x = f32_value(&[2, 3], vec![0.1, -0.2, 0.3, 0.4, 0.5, -0.6]);
    let b = f32_value(&[3], vec![0.01, 0.02, -0.03]);
    let (graph, case) = imported_case("for_loop", &for_loop(), &[("x", x), ("b", b)])?;
    ensure!(
        count(&graph, "scan") == 1 && count(&graph, "while_loop") == 0,
        "{:?}",
        graph.op_counts()
    );
    ensure!(case.outputs[1].1.shape() == [4, 2, 3], "stacked ys");
    onnx_runtime_agrees(&[case])
}

/// x doubles while the sum of |x| stays below `bound`, at most 10 trips.
/// The body has a Constant node and an initializer of its own and reads
/// the graph input `bound`.
fn while_loop() -> ModelProto {
    let body = subgraph(
        "body",
        vec![
            NodeProto {
                name: "two".to_string(),
                ..node(
                    "Constant",
                    &[],
                    &["two"],
                    vec![attr_tensor("value", f32_tensor("", &[], &[2.0]))],
                )
            },
            node("Mul", &["x_in", "two"], &["x_out"], vec![]),
            node(
                "ReduceSum",
                &["x_out", "all"],
                &["s"],
                vec![attr_int("keepdims", 0)],
            ),
            node("Less", &["s", "bound"], &["cond_out"], vec![]),
        ],
        vec![
            scalar_info("i", data_type::INT64),
            scalar_info("cond_in", data_type::BOOL),
            value_info("x_in", data_type::FLOAT, &[None, Some(3)]),
        ],
        vec![
            scalar_info("cond_out", data_type::BOOL),
            value_info("x_out", data_type::FLOAT, &[None, Some(3)]),
        ],
        vec![i64_tensor("all", &[2], &[0, 1])],
    );
    model_v8(
        vec![
            node("Abs", &["x"], &["ax"], vec![]),
            node(
                "ReduceSum",
                &["ax", "axes"],
                &["s0"],
                vec![attr_int("keepdims", 0)],
            ),
            node("Less", &["s0", "bound"], &["cond"], vec![]),
            node(
                "Loop",
                &["M", "cond", "ax"],
                &["x_final"],
                vec![attr_graph("body", body)],
            ),
        ],
        vec![
            value_info("x", data_type::FLOAT, &[None, Some(3)]),
            scalar_info("bound", data_type::FLOAT),
        ],
        vec![value_info("x_final", data_type::FLOAT, &[None, Some(3)])],
        vec![
            i64_tensor("M", &[], &[10]),
            i64_tensor("axes", &[2], &[0, 1]),
        ],
    )
}

#[test]
fn a_loop_its_condition_ends_imports_as_a_while_loop() -> Result<()> {
    let x = f32_value(&[2, 3], vec![0.1, -0.2, 0.3, 0.4, 0.5, -0.6]);
    let mut cases = Vec::new();
    // Ended by the condition (after 5 trips), by M, and before a trip.
    for (name, bound, doublings) in [
        ("loop_ended_by_its_condition", 40.0, 5),
        ("loop_ended_by_m", 1e9, 10),
        ("loop_that_never_runs", 1.0, 0),
    ] {
        let inputs = [("x", x.clone()), ("bound", Value::scalar_f32(bound))];
        let (graph, case) = imported_case(name, &while_loop(), &inputs)?;
        ensure!(count(&graph, "while_loop") == 1, "{:?}", graph.op_counts());
        let got = case.outputs[0]
            .1
            .as_f32()?
            .iter()
            .copied()
            .collect::<Vec<_>>();
        let scale = (1u32 << doublings) as f32;
        let want: Vec<f32> = [0.1f32, 0.2, 0.3, 0.4, 0.5, 0.6]
            .iter()
            .map(|v| v * scale)
            .collect();
        ensure!(
            got.iter()
                .zip(&want)
                .all(|(a, b)| (a - b).abs() <= 1e-5 * b),
            "{name}: {got:?}, want {want:?}"
        );
        cases.push(case);
    }
    onnx_runtime_agrees(&cases)
}

/// `If` on a `[1, 1]` condition (a keepdims reduction): the then branch
/// reads `x` and `a`, the else branch `b` and `x`, each from the outer
/// scope; the then branch makes a constant of its own.
fn branching() -> ModelProto {
    let then_branch = subgraph(
        "then",
        vec![
            node(
                "Constant",
                &[],
                &["three"],
                vec![attr_tensor("value", f32_tensor("", &[], &[3.0]))],
            ),
            node("Mul", &["x", "a"], &["xa"], vec![]),
            node("Add", &["xa", "three"], &["then_y"], vec![]),
        ],
        vec![],
        vec![value_info("then_y", data_type::FLOAT, &[None, Some(3)])],
        vec![],
    );
    let else_branch = subgraph(
        "else",
        vec![node("Sub", &["b", "x"], &["else_y"], vec![])],
        vec![],
        vec![value_info("else_y", data_type::FLOAT, &[None, Some(3)])],
        vec![],
    );
    model_v8(
        vec![
            node(
                "ReduceSum",
                &["x", "axes"],
                &["s"],
                vec![attr_int("keepdims", 1)],
            ),
            node("Greater", &["s", "zero"], &["positive"], vec![]),
            node(
                "If",
                &["positive"],
                &["y"],
                vec![
                    attr_graph("then_branch", then_branch),
                    attr_graph("else_branch", else_branch),
                ],
            ),
        ],
        vec![
            value_info("x", data_type::FLOAT, &[None, Some(3)]),
            value_info("a", data_type::FLOAT, &[Some(3)]),
        ],
        vec![value_info("y", data_type::FLOAT, &[None, Some(3)])],
        vec![
            i64_tensor("axes", &[2], &[0, 1]),
            f32_tensor("zero", &[], &[0.0]),
            f32_tensor("b", &[3], &[1.0, 2.0, 3.0]),
        ],
    )
}

#[test]
fn an_if_whose_branches_read_different_outer_values() -> Result<()> {
    let a = f32_value(&[3], vec![2.0, -1.0, 0.5]);
    let mut cases = Vec::new();
    for (name, sign) in [("if_then", 1.0f32), ("if_else", -1.0)] {
        let x = f32_value(&[2, 3], vec![sign, 0.5, 0.25, 0.125, 1.0, 2.0]);
        let inputs = [("x", x), ("a", a.clone())];
        let (graph, case) = imported_case(name, &branching(), &inputs)?;
        ensure!(count(&graph, "cond") == 1, "{:?}", graph.op_counts());
        cases.push(case);
    }
    onnx_runtime_agrees(&cases)
}

/// A Scan over the rows of `xs` (the batch) whose body branches on each
/// row: the If's then branch reads `k`, an initializer two scopes out,
/// and the scan's own state and row; the else branch runs a `for` loop
/// of 3 trips reading the row.
fn nested() -> ModelProto {
    let inner_loop = subgraph(
        "inner_loop",
        vec![
            node("Identity", &["c_in"], &["c_out"], vec![]),
            node("Sub", &["v_in", "x_t"], &["v_out"], vec![]),
        ],
        vec![
            scalar_info("j", data_type::INT64),
            scalar_info("c_in", data_type::BOOL),
            value_info("v_in", data_type::FLOAT, &[Some(3)]),
        ],
        vec![
            scalar_info("c_out", data_type::BOOL),
            value_info("v_out", data_type::FLOAT, &[Some(3)]),
        ],
        vec![],
    );
    let then_branch = subgraph(
        "then",
        vec![
            node("Mul", &["x_t", "k"], &["xk"], vec![]),
            node("Add", &["h_in", "xk"], &["then_h"], vec![]),
        ],
        vec![],
        vec![value_info("then_h", data_type::FLOAT, &[Some(3)])],
        vec![],
    );
    let else_branch = subgraph(
        "else",
        vec![node(
            "Loop",
            &["three", "", "h_in"],
            &["else_h"],
            vec![attr_graph("body", inner_loop)],
        )],
        vec![],
        vec![value_info("else_h", data_type::FLOAT, &[Some(3)])],
        vec![i64_tensor("three", &[], &[3])],
    );
    let body = subgraph(
        "scan_body",
        vec![
            node(
                "ReduceSum",
                &["x_t", "axis0"],
                &["row_sum"],
                vec![attr_int("keepdims", 0)],
            ),
            node("Greater", &["row_sum", "zero"], &["flag"], vec![]),
            node(
                "If",
                &["flag"],
                &["branched"],
                vec![
                    attr_graph("then_branch", then_branch),
                    attr_graph("else_branch", else_branch),
                ],
            ),
            node("Tanh", &["branched"], &["h_out"], vec![]),
            node("Identity", &["h_out"], &["y_t"], vec![]),
        ],
        vec![
            value_info("h_in", data_type::FLOAT, &[Some(3)]),
            value_info("x_t", data_type::FLOAT, &[Some(3)]),
        ],
        vec![
            value_info("h_out", data_type::FLOAT, &[Some(3)]),
            value_info("y_t", data_type::FLOAT, &[Some(3)]),
        ],
        vec![],
    );
    model_v8(
        vec![node(
            "Scan",
            &["h0", "xs"],
            &["h", "ys"],
            vec![
                attr_graph("body", body),
                attr_int("num_scan_inputs", 1),
                attr_ints("scan_input_directions", &[1]),
                attr_ints("scan_output_directions", &[1]),
            ],
        )],
        vec![
            value_info("h0", data_type::FLOAT, &[Some(3)]),
            value_info("xs", data_type::FLOAT, &[None, Some(3)]),
        ],
        vec![
            value_info("h", data_type::FLOAT, &[Some(3)]),
            value_info("ys", data_type::FLOAT, &[None, Some(3)]),
        ],
        vec![
            f32_tensor("k", &[3], &[0.5, 2.0, -1.0]),
            f32_tensor("zero", &[], &[0.0]),
            i64_tensor("axis0", &[1], &[0]),
        ],
    )
}

#[test]
fn nested_bodies_read_values_from_every_enclosing_scope() -> Result<()> {
    let h0 = f32_value(&[3], vec![0.1, 0.2, 0.3]);
    let xs = f32_value(
        &[4, 3],
        vec![
            0.5, 0.1, 0.2, -0.5, -0.1, 0.2, 0.3, 0.3, 0.3, -0.9, 0.4, 0.1,
        ],
    );
    let (graph, case) = imported_case("nested", &nested(), &[("h0", h0), ("xs", xs)])?;
    // The scan's body holds the cond, whose else branch holds the loop.
    let scan = graph
        .nodes()
        .iter()
        .find(|n| n.op.name() == "scan")
        .expect("a scan");
    let body = scan.op.subgraphs()[0];
    ensure!(count(body, "cond") == 1, "{:?}", body.op_counts());
    onnx_runtime_agrees(&[case])
}

/// A Loop in a model that imports initializers as parameters reads them
/// as the parameters, passed into the loop: they stay trainable.
#[test]
fn a_body_reads_parameters_as_parameters() -> Result<()> {
    let imported = import_model_with(
        &round_trip(&for_loop())?,
        &Limits::default(),
        ImportOptions { parameters: true },
    )?;
    ensure!(imported.parameters == ["w"], "{:?}", imported.parameters);
    let graph = &imported.graph;
    let w = graph.find_input("params/w").expect("params/w");
    let scan = graph
        .nodes()
        .iter()
        .find(|n| n.op.name() == "scan")
        .expect("a scan");
    ensure!(scan.inputs.contains(&w), "the scan does not read params/w");
    Ok(())
}

fn loop_model(m: &[&str], cond: &str, body_outputs: usize) -> ModelProto {
    let mut nodes = vec![node("Identity", &["cond_in"], &["cond_out"], vec![])];
    let mut outputs = vec![
        scalar_info("cond_out", data_type::BOOL),
        value_info("x_out", data_type::FLOAT, &[None, Some(3)]),
    ];
    nodes.push(node("Neg", &["x_in"], &["x_out"], vec![]));
    if body_outputs > 2 {
        nodes.push(node("Abs", &["x_out"], &["y"], vec![]));
        outputs.push(value_info("y", data_type::FLOAT, &[None, Some(3)]));
    }
    let body = subgraph(
        "body",
        nodes,
        vec![
            scalar_info("i", data_type::INT64),
            scalar_info("cond_in", data_type::BOOL),
            value_info("x_in", data_type::FLOAT, &[None, Some(3)]),
        ],
        outputs,
        vec![],
    );
    let mut graph_nodes = vec![node(
        "ReduceSum",
        &["x", "axes"],
        &["s"],
        vec![attr_int("keepdims", 0)],
    )];
    graph_nodes.push(node(
        "Cast",
        &["s"],
        &["computed_m"],
        vec![attr_int("to", 7)],
    ));
    graph_nodes.push(node("Greater", &["s", "zero"], &["computed_cond"], vec![]));
    let mut inputs: Vec<&str> = m.to_vec();
    inputs.extend([cond, "x"]);
    let loop_outputs: &[&str] = if body_outputs > 2 {
        &["x_final", "xs"]
    } else {
        &["x_final"]
    };
    graph_nodes.push(NodeProto {
        name: "the_loop".to_string(),
        ..node(
            "Loop",
            &inputs,
            loop_outputs,
            vec![attr_graph("body", body)],
        )
    });
    model_v8(
        graph_nodes,
        vec![value_info("x", data_type::FLOAT, &[None, Some(3)])],
        loop_outputs.iter().map(|o| output(o)).collect(),
        vec![
            i64_tensor("M", &[], &[4]),
            i64_tensor("zero_trips", &[], &[0]),
            i64_tensor("axes", &[2], &[0, 1]),
            f32_tensor("zero", &[], &[0.0]),
            bool_tensor("yes", &[], &[true]),
        ],
    )
}

#[test]
fn loops_canopy_cannot_type_are_refused_with_the_cause_and_a_hint() -> Result<()> {
    let limits = Limits::default();
    let cases: [(ModelProto, &[&str]); 5] = [
        (
            loop_model(&[""], "yes", 2),
            &["`the_loop`", "no maximum trip count M", "hint:"],
        ),
        (
            loop_model(&["computed_m"], "yes", 2),
            &[
                "`the_loop`",
                "M (`computed_m`) is computed at run time",
                "hint: export the model with static shapes",
            ],
        ),
        (
            loop_model(&["zero_trips"], "yes", 2),
            &[
                "`the_loop`",
                "is 0, so it never runs",
                "hint: remove the loop",
            ],
        ),
        (
            loop_model(&["M"], "computed_cond", 3),
            &[
                "`the_loop`",
                "scan output `y`",
                "its condition decides the trips at run time",
                "hint: make the condition constant true",
            ],
        ),
        (
            loop_model(&["M"], "", 3),
            // The same loop with no condition is a for loop: accepted.
            &[],
        ),
    ];
    for (model, parts) in cases {
        if parts.is_empty() {
            let graph = import_bytes(&model)?;
            ensure!(count(&graph, "scan") == 1, "{:?}", graph.op_counts());
            continue;
        }
        let error = refusal_with(&model, &limits)?;
        expect_message(&error, parts)?;
    }
    Ok(())
}

#[test]
fn scans_canopy_cannot_express_are_refused_naming_the_attribute() -> Result<()> {
    let body = || {
        subgraph(
            "body",
            vec![
                node("Add", &["s_in", "x_t"], &["s_out"], vec![]),
                node("Identity", &["s_out"], &["y_t"], vec![]),
            ],
            vec![
                value_info("s_in", data_type::FLOAT, &[Some(3)]),
                value_info("x_t", data_type::FLOAT, &[Some(3)]),
            ],
            vec![
                value_info("s_out", data_type::FLOAT, &[Some(3)]),
                value_info("y_t", data_type::FLOAT, &[Some(3)]),
            ],
            vec![],
        )
    };
    let scan = |attrs: Vec<canopy_onnx::proto::AttributeProto>| {
        let mut attribute = vec![attr_graph("body", body()), attr_int("num_scan_inputs", 1)];
        attribute.extend(attrs);
        model_v8(
            vec![NodeProto {
                name: "the_scan".to_string(),
                ..node("Scan", &["s0", "xs"], &["s", "ys"], attribute)
            }],
            vec![
                value_info("s0", data_type::FLOAT, &[Some(3)]),
                value_info("xs", data_type::FLOAT, &[Some(5), Some(3)]),
            ],
            vec![output("s"), output("ys")],
            vec![],
        )
    };
    let cases: [(Vec<canopy_onnx::proto::AttributeProto>, &[&str]); 3] = [
        (
            vec![attr_ints("scan_input_axes", &[1])],
            &["`the_scan`", "scan_input_axes", "axis 1", "hint: transpose"],
        ),
        (
            vec![
                attr_ints("scan_input_directions", &[1]),
                attr_ints("scan_output_directions", &[0]),
            ],
            &["`the_scan`", "mixes directions", "hint:"],
        ),
        (
            vec![attr_ints("scan_output_axes", &[2])],
            &["`the_scan`", "scan_output_axes", "axis 2"],
        ),
    ];
    for (attrs, parts) in cases {
        expect_message(&refusal_with(&scan(attrs), &Limits::default())?, parts)?;
    }
    // The leading axis, written from the end, and both directions reversed
    // import; the trip limit bounds the scan's steps.
    let reversed = scan(vec![
        attr_ints("scan_input_axes", &[-2]),
        attr_ints("scan_input_directions", &[1]),
        attr_ints("scan_output_directions", &[1]),
    ]);
    let graph = import_bytes(&reversed)?;
    let s0 = f32_value(&[3], vec![0.0; 3]);
    let xs = f32_value(&[5, 3], (0..15).map(|v| v as f32).collect());
    let out = run(&graph, vec![s0, xs])?;
    // Reversed, step t still writes row t: the running sum from the end.
    assert_close(
        "ys",
        &out[1],
        &[5, 3],
        &[
            30.0, 35.0, 40.0, 30.0, 34.0, 38.0, 27.0, 30.0, 33.0, 21.0, 23.0, 25.0, 12.0, 13.0,
            14.0,
        ],
    )?;
    let tight = Limits {
        max_trips: 4,
        ..Limits::default()
    };
    let error = refusal_with(&reversed, &tight)?;
    ensure!(
        matches!(error, OnnxError::LimitExceeded { limit: 4, .. }),
        "{error:?}"
    );
    expect_message(&error, &["the steps of node `the_scan`"])?;
    Ok(())
}

#[test]
fn the_limits_bound_trip_counts_and_nesting() -> Result<()> {
    let tight = Limits {
        max_trips: 3,
        ..Limits::default()
    };
    let error = refusal_with(&loop_model(&["M"], "", 2), &tight)?;
    ensure!(
        matches!(
            error,
            OnnxError::LimitExceeded {
                actual: 4,
                limit: 3,
                ..
            }
        ),
        "{error:?}"
    );
    expect_message(&error, &["maximum trip count M", "`the_loop`"])?;

    // `nested` holds three levels (scan body, If branch, loop body).
    let bytes = {
        use prost::Message;
        nested().encode_to_vec()
    };
    decode_model(&bytes, &Limits::default())?;
    let shallow = Limits {
        max_graph_depth: 2,
        ..Limits::default()
    };
    let error = match decode_model(&bytes, &shallow) {
        Ok(_) => bail!("a model nested 3 levels decoded under a limit of 2"),
        Err(error) => error,
    };
    ensure!(
        matches!(
            error,
            OnnxError::LimitExceeded {
                actual: 3,
                limit: 2,
                ..
            }
        ),
        "{error:?}"
    );
    expect_message(&error, &["levels of nested graphs", "Loop"])?;
    // A limit above canopy-ir's own is clamped to it.
    let deep = Limits {
        max_graph_depth: 1000,
        ..Limits::default()
    };
    ensure!(deep.graph_depth() == canopy_ir::verify::MAX_NESTING);
    Ok(())
}

/// Subgraphs are as untrusted as the main graph: their nodes count
/// against the node limit and their tensors are validated.
#[test]
fn subgraphs_are_validated_like_the_main_graph() -> Result<()> {
    let model = for_loop();
    let total_nodes = 1 + 6;
    let bytes = {
        use prost::Message;
        model.encode_to_vec()
    };
    let limits = Limits {
        max_nodes: total_nodes - 1,
        ..Limits::default()
    };
    let error = match decode_model(&bytes, &limits) {
        Ok(_) => bail!("the node limit ignored the body's nodes"),
        Err(error) => error,
    };
    expect_message(&error, &["nodes in the main graph and its subgraphs"])?;

    let mut model = branching();
    let graph = model.graph.as_mut().expect("graph");
    let then_branch = graph.node[2].attribute[0].g.as_mut().expect("then");
    then_branch.initializer.push(TensorProto {
        data_type: data_type::DOUBLE,
        ..f32_tensor("wide", &[1], &[1.0])
    });
    let error = refusal(&model)?;
    expect_message(&error, &["`wide`", "DOUBLE"])?;
    Ok(())
}

#[test]
fn an_if_branch_with_inputs_is_refused() -> Result<()> {
    let mut model = branching();
    let graph = model.graph.as_mut().expect("graph");
    let then_branch = graph.node[2].attribute[0].g.as_mut().expect("then");
    then_branch
        .input
        .push(value_info("extra", data_type::FLOAT, &[Some(3)]));
    let error = refusal(&model)?;
    expect_message(
        &error,
        &["then_branch declares inputs", "outer values by name"],
    )
}

/// An imported graph with loops and branches is called like a layer
/// (`canopy_engine::tensor::call`, how an imported classifier becomes
/// trainable): run op by op when eager, inlined into a trace otherwise,
/// with the outputs the CPU backend computes for the graph itself.
#[test]
fn imported_control_flow_is_called_eagerly_and_traced() -> Result<()> {
    use canopy_engine::tensor::{Tensor, call, trace};
    let graph = import_bytes(&nested())?;
    let h0 = f32_value(&[3], vec![0.1, 0.2, 0.3]);
    let xs = f32_value(
        &[4, 3],
        vec![
            0.5, 0.1, 0.2, -0.5, -0.1, 0.2, 0.3, 0.3, 0.3, -0.9, 0.4, 0.1,
        ],
    );
    let want = run(&graph, vec![h0.clone(), xs.clone()])?;

    let args = [
        Tensor::from_value(h0.clone()),
        Tensor::from_value(xs.clone()),
    ];
    let eager = call(&graph, &[&args[0], &args[1]])?;
    for (got, want) in eager.iter().zip(&want) {
        ensure!(
            got.value()? == want,
            "eager: {:?} vs {want:?}",
            got.value()?
        );
    }

    let types: Vec<(&str, canopy_ir::TensorType)> = graph
        .inputs()
        .iter()
        .map(|&i| (graph.input_name(i), graph.ty(i).clone()))
        .collect();
    let traced = trace(&types, |inputs| {
        let outputs = call(&graph, &[&inputs[0], &inputs[1]])?;
        Ok(vec![
            ("h".to_string(), outputs[0].clone()),
            ("ys".to_string(), outputs[1].clone()),
        ])
    })?;
    ensure!(count(&traced, "scan") == 1, "{:?}", traced.op_counts());
    ensure!(run(&traced, vec![h0, xs])? == want, "traced outputs differ");
    Ok(())
}
