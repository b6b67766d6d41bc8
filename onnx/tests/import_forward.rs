//! Imported models run on the CPU backend and give hand-computed values.

mod common;

use anyhow::{Result, ensure};
use canopy_engine::Value;
use canopy_ir::{DType, Dim, Shape, TensorType};
use canopy_onnx::proto::data_type;
use common::*;

#[test]
fn gemm_relu_softmax_matches_hand_computed_values() -> Result<()> {
    // Y = softmax(relu(2·x·Wᵀ + 0.5·b)).
    let m = model(
        vec![
            node(
                "Gemm",
                &["x", "W", "b"],
                &["h"],
                vec![
                    attr_int("transB", 1),
                    attr_float("alpha", 2.0),
                    attr_float("beta", 0.5),
                ],
            ),
            node("Relu", &["h"], &["r"], vec![]),
            node("Softmax", &["r"], &["y"], vec![]),
        ],
        vec![value_info("x", data_type::FLOAT, &[None, Some(3)])],
        vec![output("y")],
        vec![
            f32_tensor("W", &[2, 3], &[1.0, 1.0, 0.0, 0.0, 1.0, 1.0]),
            f32_tensor("b", &[2], &[1.0, -2.0]),
        ],
    );
    let decoded = round_trip(&m)?;
    let imported = canopy_onnx::import_model(&decoded, &canopy_onnx::Limits::default())?;
    let graph = &imported.graph;
    let x_type = graph.ty(graph.inputs()[0]);
    ensure!(
        *x_type == TensorType::new(DType::F32, Shape(vec![Dim::Batch, Dim::Fixed(3)])),
        "x imported as {x_type}"
    );
    let names: Vec<&str> = imported
        .initializers
        .iter()
        .map(|(n, _)| n.as_str())
        .collect();
    ensure!(names == ["W", "b"], "initializers {names:?}");

    let x = Value::f32(&[2, 3], vec![1.0, 0.0, 2.0, 0.0, 1.0, -1.0])?;
    let outputs = run(graph, vec![x])?;
    // x·Wᵀ = [[1, 2], [1, 0]]; ·2 + [0.5, -1] = [[2.5, 3], [2.5, -1]];
    // relu → [[2.5, 3], [2.5, 0]]; softmax per row.
    let row0 = [
        1.0 / (1.0 + 0.5f32.exp()),
        0.5f32.exp() / (1.0 + 0.5f32.exp()),
    ];
    let row1 = [
        2.5f32.exp() / (2.5f32.exp() + 1.0),
        1.0 / (2.5f32.exp() + 1.0),
    ];
    assert_close(
        "y",
        &outputs[0],
        &[2, 2],
        &[row0[0], row0[1], row1[0], row1[1]],
    )
}

#[test]
fn conv_maxpool_global_average_pool_matches_hand_computed_values() -> Result<()> {
    // Channel 0: 3×3 box sum + 10; channel 1: the identity kernel.
    let mut weights = vec![1.0; 9];
    weights.extend([0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]);
    let m = model(
        vec![
            node(
                "Conv",
                &["x", "W", "B"],
                &["c"],
                vec![
                    attr_ints("pads", &[1, 1, 1, 1]),
                    attr_ints("kernel_shape", &[3, 3]),
                    attr_ints("strides", &[1, 1]),
                ],
            ),
            node(
                "MaxPool",
                &["c"],
                &["p"],
                vec![
                    attr_ints("kernel_shape", &[2, 2]),
                    attr_ints("strides", &[2, 2]),
                ],
            ),
            node("GlobalAveragePool", &["p"], &["g"], vec![]),
        ],
        vec![value_info(
            "x",
            data_type::FLOAT,
            &[None, Some(1), Some(4), Some(4)],
        )],
        vec![output("p"), output("g")],
        vec![
            f32_tensor("W", &[2, 1, 3, 3], &weights),
            f32_tensor("B", &[2], &[10.0, 0.0]),
        ],
    );
    let graph = import_bytes(&m)?;
    let x = Value::f32(&[1, 1, 4, 4], (0..16).map(|i| i as f32).collect())?;
    let outputs = run(&graph, vec![x])?;
    // Box sums of the 0..15 grid, max over each 2×2 block: 45, 54, 81, 90.
    assert_close(
        "p",
        &outputs[0],
        &[1, 2, 2, 2],
        &[55.0, 64.0, 91.0, 100.0, 5.0, 7.0, 13.0, 15.0],
    )?;
    assert_close("g", &outputs[1], &[1, 2, 1, 1], &[77.5, 10.0])
}

#[test]
fn average_pool_counts_padding_when_asked_to() -> Result<()> {
    let m = model(
        vec![
            node(
                "AveragePool",
                &["x"],
                &["plain"],
                vec![
                    attr_ints("kernel_shape", &[2, 2]),
                    attr_ints("strides", &[2, 2]),
                ],
            ),
            node(
                "AveragePool",
                &["x"],
                &["padded"],
                vec![
                    attr_ints("kernel_shape", &[3, 3]),
                    attr_ints("strides", &[3, 3]),
                    attr_ints("pads", &[1, 1, 1, 1]),
                    attr_int("count_include_pad", 1),
                ],
            ),
        ],
        vec![value_info(
            "x",
            data_type::FLOAT,
            &[None, Some(1), Some(4), Some(4)],
        )],
        vec![output("plain"), output("padded")],
        vec![],
    );
    let graph = import_bytes(&m)?;
    let x = Value::f32(&[1, 1, 4, 4], (0..16).map(|i| i as f32).collect())?;
    let outputs = run(&graph, vec![x])?;
    assert_close("plain", &outputs[0], &[1, 1, 2, 2], &[2.5, 4.5, 10.5, 12.5])?;
    // Each 3×3 window covers a 2×2 block of x and five padding zeros.
    assert_close(
        "padded",
        &outputs[1],
        &[1, 1, 2, 2],
        &[10.0 / 9.0, 2.0, 42.0 / 9.0, 50.0 / 9.0],
    )
}

#[test]
fn reshape_flatten_transpose_and_friends_move_elements_as_onnx_does() -> Result<()> {
    let m = model(
        vec![
            node(
                "Transpose",
                &["x"],
                &["t"],
                vec![attr_ints("perm", &[0, 2, 1])],
            ),
            node("Reshape", &["t", "shape"], &["r"], vec![]),
            node("Identity", &["r"], &["i"], vec![]),
            node("Dropout", &["i"], &["d"], vec![]),
            node(
                "Constant",
                &[],
                &["axes"],
                vec![attr_tensor("value", i64_tensor("", &[1], &[1]))],
            ),
            node("Unsqueeze", &["d", "axes"], &["u"], vec![]),
            node("Flatten", &["u"], &["f"], vec![attr_int("axis", 1)]),
            node("Squeeze", &["u", "axes"], &["s"], vec![]),
            node("Concat", &["f", "s"], &["c"], vec![attr_int("axis", -1)]),
            node(
                "Cast",
                &["x"],
                &["n"],
                vec![attr_int("to", i64::from(data_type::INT64))],
            ),
        ],
        vec![value_info("x", data_type::FLOAT, &[None, Some(2), Some(3)])],
        vec![output("u"), output("c"), output("n")],
        vec![i64_tensor("shape", &[2], &[0, -1])],
    );
    let graph = import_bytes(&m)?;
    let u_type = graph.ty(graph
        .find_output("u")
        .ok_or_else(|| anyhow::anyhow!("no output u"))?);
    ensure!(
        u_type.shape == Shape(vec![Dim::Batch, Dim::Fixed(1), Dim::Fixed(6)]),
        "u is {u_type}"
    );

    let x = Value::f32(
        &[2, 2, 3],
        vec![
            1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 10.5, 20.0, 30.0, 40.0, 50.0, -60.5,
        ],
    )?;
    let outputs = run(&graph, vec![x])?;
    let transposed = [
        1.0, 4.0, 2.0, 5.0, 3.0, 6.0, 10.5, 40.0, 20.0, 50.0, 30.0, -60.5,
    ];
    assert_close("u", &outputs[0], &[2, 1, 6], &transposed)?;
    let mut concatenated = Vec::new();
    for row in transposed.chunks(6) {
        concatenated.extend_from_slice(row);
        concatenated.extend_from_slice(row);
    }
    assert_close("c", &outputs[1], &[2, 12], &concatenated)?;
    // float → int64 truncates toward zero.
    let Value::I64(cast) = &outputs[2] else {
        anyhow::bail!("n is {:?}, expected i64", outputs[2].dtype());
    };
    let cast: Vec<i64> = cast.iter().copied().collect();
    ensure!(
        cast == [1, 2, 3, 4, 5, 6, 10, 20, 30, 40, 50, -60],
        "cast gave {cast:?}"
    );
    Ok(())
}

#[test]
fn elementwise_ops_and_batched_matmul_follow_onnx_semantics() -> Result<()> {
    let m = model(
        vec![
            node("MatMul", &["a", "b"], &["mm"], vec![]),
            node("Sub", &["mm", "one"], &["s"], vec![]),
            node("Mul", &["s", "half"], &["m"], vec![]),
            node("Div", &["m", "two"], &["q"], vec![]),
            node("Sigmoid", &["q"], &["sig"], vec![]),
            node("Tanh", &["q"], &["tanh"], vec![]),
            node("Erf", &["q"], &["erf"], vec![]),
            node("Add", &["sig", "tanh"], &["st"], vec![]),
            node("Add", &["st", "erf"], &["sum"], vec![]),
            node("LogSoftmax", &["sum"], &["y"], vec![]),
        ],
        vec![
            value_info("a", data_type::FLOAT, &[None, Some(1), Some(2)]),
            value_info("b", data_type::FLOAT, &[Some(2), Some(2)]),
        ],
        vec![output("q"), output("sum"), output("y")],
        vec![
            f32_tensor("one", &[], &[1.0]),
            f32_tensor("half", &[2], &[0.5, 2.0]),
            f32_tensor("two", &[1, 1], &[2.0]),
        ],
    );
    let graph = import_bytes(&m)?;
    let a = Value::f32(&[2, 1, 2], vec![1.0, 2.0, 3.0, 4.0])?;
    let b = Value::f32(&[2, 2], vec![1.0, 0.0, 1.0, 1.0])?;
    let outputs = run(&graph, vec![a, b])?;
    // a·b = [[3, 2]], [[7, 4]]; −1 → [2, 1], [6, 3]; ·[0.5, 2] → [1, 2], [3, 6]; ÷2.
    let q = [0.5f32, 1.0, 1.5, 3.0];
    assert_close("q", &outputs[0], &[2, 1, 2], &q)?;
    // erf at 0.5, 1, 1.5 and 3, from a table.
    let erf = [0.520_499_9f32, 0.842_700_8, 0.966_105_1, 0.999_977_9];
    let sum: Vec<f32> = q
        .iter()
        .zip(erf)
        .map(|(&v, erf)| 1.0 / (1.0 + (-v).exp()) + v.tanh() + erf)
        .collect();
    assert_close("sum", &outputs[1], &[2, 1, 2], &sum)?;
    // LogSoftmax over the last axis (default -1): v − log(Σ eᵛ) per pair.
    let log_softmax: Vec<f32> = sum
        .chunks(2)
        .flat_map(|pair| {
            let log_total = pair.iter().map(|v| v.exp()).sum::<f32>().ln();
            pair.iter()
                .map(move |v| v - log_total)
                .collect::<Vec<f32>>()
        })
        .collect();
    assert_close("y", &outputs[2], &[2, 1, 2], &log_softmax)
}

#[test]
fn gemm_transposes_a_without_bias_and_constants_come_from_every_value_attribute() -> Result<()> {
    let m = model(
        vec![
            // a is [K=2, M=3], so transA gives aᵀ·B: [3, 1].
            node("Gemm", &["a", "B"], &["g"], vec![attr_int("transA", 1)]),
            node(
                "Constant",
                &[],
                &["three"],
                vec![attr_float("value_float", 3.0)],
            ),
            node("Mul", &["g", "three"], &["scaled"], vec![]),
            node(
                "Constant",
                &[],
                &["target"],
                vec![attr_ints("value_ints", &[1, 3, 1])],
            ),
            node("Reshape", &["scaled", "target"], &["r"], vec![]),
            node("Squeeze", &["r"], &["y"], vec![]),
        ],
        // `B` is also listed as an input: ONNX's overridable default; it
        // stays a constant.
        vec![
            value_info("a", data_type::FLOAT, &[Some(2), Some(3)]),
            value_info("B", data_type::FLOAT, &[Some(2), Some(1)]),
        ],
        vec![output("y")],
        vec![f32_tensor("B", &[2, 1], &[1.0, -1.0])],
    );
    let graph = import_bytes(&m)?;
    ensure!(
        graph.input_names() == ["a"],
        "inputs {:?}",
        graph.input_names()
    );
    let a = Value::f32(&[2, 3], vec![1.0, 2.0, 3.0, 10.0, 20.0, 30.0])?;
    let outputs = run(&graph, vec![a])?;
    // aᵀ·B = [1 − 10, 2 − 20, 3 − 30] = [−9, −18, −27]; ·3; squeezed to [3].
    assert_close("y", &outputs[0], &[3], &[-27.0, -54.0, -81.0])
}

#[test]
fn one_imported_graph_serves_every_batch_size() -> Result<()> {
    let m = model(
        vec![
            node("Flatten", &["x"], &["f"], vec![]),
            node("Gemm", &["f", "W"], &["y"], vec![attr_int("transB", 1)]),
        ],
        vec![value_info("x", data_type::FLOAT, &[None, Some(2), Some(2)])],
        vec![output("y")],
        vec![f32_tensor("W", &[1, 4], &[1.0, 2.0, 3.0, 4.0])],
    );
    let graph = import_bytes(&m)?;
    for batch in [1usize, 3] {
        let x = Value::f32(&[batch, 2, 2], (0..batch * 4).map(|i| i as f32).collect())?;
        let outputs = run(&graph, vec![x])?;
        // Row i holds 4i .. 4i+3: Σ (k+1)(4i+k) = 40i + 20.
        let expected: Vec<f32> = (0..batch).map(|i| 40.0 * i as f32 + 20.0).collect();
        assert_close(
            &format!("batch {batch}"),
            &outputs[0],
            &[batch, 1],
            &expected,
        )?;
    }
    Ok(())
}

#[test]
fn conv_pads_strides_and_dilations_map_to_the_right_axes() -> Result<()> {
    let m = model(
        vec![
            // pads [h_begin, w_begin, h_end, w_end]: rows padded, columns not.
            node(
                "Conv",
                &["x", "one"],
                &["rows"],
                vec![
                    attr_ints("pads", &[1, 0, 1, 0]),
                    attr_ints("strides", &[2, 1]),
                ],
            ),
            node(
                "Conv",
                &["x", "corners"],
                &["dilated"],
                vec![attr_ints("dilations", &[2, 2])],
            ),
        ],
        vec![value_info(
            "x",
            data_type::FLOAT,
            &[None, Some(1), Some(3), Some(3)],
        )],
        vec![output("rows"), output("dilated")],
        vec![
            f32_tensor("one", &[1, 1, 1, 1], &[1.0]),
            f32_tensor("corners", &[1, 1, 2, 2], &[1.0, 1.0, 1.0, 1.0]),
        ],
    );
    let graph = import_bytes(&m)?;
    let x = Value::f32(&[1, 1, 3, 3], (0..9).map(|i| i as f32).collect())?;
    let outputs = run(&graph, vec![x])?;
    // Padded rows are [0], x0, x1, x2, [0]; stride 2 keeps rows 0, 2 and 4.
    assert_close(
        "rows",
        &outputs[0],
        &[1, 1, 3, 3],
        &[0.0, 0.0, 0.0, 3.0, 4.0, 5.0, 0.0, 0.0, 0.0],
    )?;
    // A 2×2 kernel dilated by 2 touches the four corners: 0 + 2 + 6 + 8.
    assert_close("dilated", &outputs[1], &[1, 1, 1, 1], &[16.0])
}

/// With `ImportOptions::parameters`, the float weights a node reads become
/// `params/NAME` inputs, in first-use order, while an int64 initializer read
/// only for its contents (a Reshape's shape) stays a constant; without it,
/// every initializer is a constant and the graph has only its data inputs.
#[test]
fn float_initializers_become_parameters_when_asked() -> Result<()> {
    let m = model(
        vec![
            node("MatMul", &["x", "w"], &["y"], vec![]),
            node("Add", &["y", "b"], &["z"], vec![]),
            node("Reshape", &["z", "shape"], &["r"], vec![]),
        ],
        vec![value_info("x", data_type::FLOAT, &[None, Some(2)])],
        vec![output("r")],
        vec![
            f32_tensor("w", &[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]),
            f32_tensor("b", &[3], &[0.5, 0.5, 0.5]),
            i64_tensor("shape", &[2], &[-1, 3]),
        ],
    );
    let decoded = round_trip(&m)?;
    let limits = canopy_onnx::Limits::default();
    let options = canopy_onnx::ImportOptions { parameters: true };
    let imported = canopy_onnx::import_model_with(&decoded, &limits, options)?;
    ensure!(
        imported.parameters == ["w", "b"],
        "{:?}",
        imported.parameters
    );
    let names = imported.graph.input_names();
    ensure!(names == ["x", "params/w", "params/b"], "{names:?}");
    let x = Value::f32(&[1, 2], vec![1.0, -1.0])?;
    let w = Value::f32(&[2, 3], vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0])?;
    let b = Value::f32(&[3], vec![0.5, 0.5, 0.5])?;
    let out = run(&imported.graph, vec![x, w, b])?;
    assert_close("r", &out[0], &[1, 3], &[-2.5, -2.5, -2.5])?;

    let constants_only = canopy_onnx::import_model(&decoded, &limits)?;
    ensure!(constants_only.parameters.is_empty());
    ensure!(constants_only.graph.input_names() == ["x"]);
    Ok(())
}
