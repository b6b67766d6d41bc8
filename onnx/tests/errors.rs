//! Every refusal names the object and the cause, and no input panics.

mod common;

use anyhow::{Result, bail, ensure};
use canopy_onnx::proto::{
    AttributeProto, DATA_LOCATION_EXTERNAL, ModelProto, OperatorSetIdProto, StringStringEntryProto,
    TensorProto, data_type,
};
use canopy_onnx::{Limits, OnnxError, decode_model, import};
use common::*;
use prost::Message;

/// x[N, 3] → Relu → y, with one initializer.
fn small_model() -> ModelProto {
    model(
        vec![node("Relu", &["x"], &["y"], vec![])],
        vec![value_info("x", data_type::FLOAT, &[None, Some(3)])],
        vec![output("y")],
        vec![f32_tensor("W", &[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0])],
    )
}

#[test]
fn the_small_model_is_accepted() -> Result<()> {
    // The baseline every refusal below is a variation of.
    let graph = import_bytes(&small_model())?;
    ensure!(graph.outputs().len() == 1, "outputs {:?}", graph.outputs());
    Ok(())
}

#[test]
fn an_unsupported_op_is_refused_naming_node_op_domain_and_opset() -> Result<()> {
    let mut m = small_model();
    let graph = m
        .graph
        .as_mut()
        .ok_or_else(|| anyhow::anyhow!("no graph"))?;
    graph.node[0].op_type = "Celu".to_string();
    graph.node[0].name = "mystery".to_string();
    let error = refusal(&m)?;
    ensure!(
        matches!(&error, OnnxError::UnsupportedOp { op_type, opset: 17, .. } if op_type == "Celu"),
        "{error:?}"
    );
    expect_message(&error, &["`mystery`", "Celu", "ai.onnx", "opset 17"])
}

#[test]
fn another_domain_is_refused_naming_domain_and_its_opset() -> Result<()> {
    let mut m = small_model();
    m.opset_import.push(OperatorSetIdProto {
        domain: "com.microsoft".to_string(),
        version: 1,
    });
    let graph = m
        .graph
        .as_mut()
        .ok_or_else(|| anyhow::anyhow!("no graph"))?;
    graph.node[0].op_type = "FusedMatMul".to_string();
    graph.node[0].domain = "com.microsoft".to_string();
    let error = refusal(&m)?;
    ensure!(
        matches!(error, OnnxError::UnsupportedDomain { .. }),
        "{error:?}"
    );
    expect_message(
        &error,
        &["FusedMatMul", "`com.microsoft`", "opset 1", "`ai.onnx.ml`"],
    )
}

#[test]
fn opsets_outside_13_to_21_and_conflicting_opsets_are_refused() -> Result<()> {
    for version in [12, 22] {
        let mut m = small_model();
        m.opset_import[0].version = version;
        let error = refusal(&m)?;
        ensure!(
            matches!(error, OnnxError::UnsupportedOpset { version: v, .. } if v == version),
            "{error:?}"
        );
    }
    let mut m = small_model();
    m.opset_import.push(OperatorSetIdProto {
        domain: "ai.onnx".to_string(),
        version: 18,
    });
    let error = refusal(&m)?;
    ensure!(
        matches!(
            error,
            OnnxError::ConflictingOpset {
                first: 17,
                second: 18
            }
        ),
        "{error:?}"
    );
    // The same version twice (skl2onnx writes that) is fine.
    let mut m = small_model();
    m.opset_import.push(OperatorSetIdProto {
        domain: String::new(),
        version: OPSET,
    });
    import_bytes(&m)?;
    let mut m = small_model();
    m.opset_import.clear();
    ensure!(
        matches!(refusal(&m)?, OnnxError::MissingDefaultOpset),
        "no opset accepted"
    );
    Ok(())
}

#[test]
fn external_data_is_refused_naming_the_tensor() -> Result<()> {
    let mut m = small_model();
    let graph = m
        .graph
        .as_mut()
        .ok_or_else(|| anyhow::anyhow!("no graph"))?;
    let tensor = &mut graph.initializer[0];
    tensor.raw_data = Default::default();
    tensor.data_location = DATA_LOCATION_EXTERNAL;
    tensor.external_data = vec![StringStringEntryProto {
        key: "location".to_string(),
        value: "weights.bin".to_string(),
    }];
    let error = refusal(&m)?;
    ensure!(
        matches!(&error, OnnxError::ExternalData { tensor, .. } if tensor == "W"),
        "{error:?}"
    );
    expect_message(&error, &["`W`", "weights.bin"])?;
    // external_data entries alone are enough to refuse.
    let graph = m
        .graph
        .as_mut()
        .ok_or_else(|| anyhow::anyhow!("no graph"))?;
    graph.initializer[0].data_location = 0;
    let error = refusal(&m)?;
    ensure!(matches!(error, OnnxError::ExternalData { .. }), "{error:?}");
    Ok(())
}

#[test]
fn truncated_and_garbage_buffers_are_decode_errors() -> Result<()> {
    let bytes = small_model().encode_to_vec();
    // Both cuts fall inside a length-delimited field (the graph, then the
    // final opset_import), so the field claims more bytes than remain.
    for cut in [bytes.len() / 2, bytes.len() - 1] {
        let error = match decode_model(&bytes[..cut], &Limits::default()) {
            Ok(_) => bail!("a model cut to {cut} of {} bytes decoded", bytes.len()),
            Err(error) => error,
        };
        ensure!(
            matches!(error, OnnxError::Decode { .. }),
            "cut {cut}: {error:?}"
        );
        expect_message(&error, &["truncated"])?;
    }
    let error = match decode_model(&[0xff; 64], &Limits::default()) {
        Ok(_) => bail!("garbage decoded"),
        Err(error) => error,
    };
    ensure!(matches!(error, OnnxError::Decode { .. }), "{error:?}");
    Ok(())
}

#[test]
fn a_tensor_declaring_2_pow_31_elements_with_a_small_payload_is_refused_by_name() -> Result<()> {
    let mut m = small_model();
    let graph = m
        .graph
        .as_mut()
        .ok_or_else(|| anyhow::anyhow!("no graph"))?;
    graph.initializer[0] = f32_tensor("huge", &[1 << 16, 1 << 15], &[1.0]);
    let error = refusal(&m)?;
    ensure!(
        matches!(&error, OnnxError::TensorTooLarge { tensor, .. } if tensor == "huge"),
        "{error:?}"
    );
    expect_message(&error, &["`huge`", "2147483648"])?;
    // Dims whose product overflows u64 are refused the same way.
    let graph = m
        .graph
        .as_mut()
        .ok_or_else(|| anyhow::anyhow!("no graph"))?;
    graph.initializer[0] = f32_tensor("overflow", &[1 << 40, 1 << 40], &[1.0]);
    let error = refusal(&m)?;
    expect_message(&error, &["`overflow`", "more than 2^64"])
}

#[test]
fn the_element_limit_is_configurable_and_exact() -> Result<()> {
    let limits = Limits {
        max_tensor_elements: 6,
        ..Limits::default()
    };
    // W has exactly 6 elements: accepted at the limit.
    let bytes = small_model().encode_to_vec();
    decode_model(&bytes, &limits)?;
    let tight = Limits {
        max_tensor_elements: 5,
        ..Limits::default()
    };
    let error = refusal_with(&small_model(), &tight)?;
    ensure!(
        matches!(error, OnnxError::TensorTooLarge { limit: 5, .. }),
        "{error:?}"
    );
    Ok(())
}

#[test]
fn count_and_size_limits_are_enforced() -> Result<()> {
    let m = small_model();
    let bytes = m.encode_to_vec();
    let limits = Limits {
        max_model_bytes: bytes.len() - 1,
        ..Limits::default()
    };
    let error = match decode_model(&bytes, &limits) {
        Ok(_) => bail!("an oversized model decoded"),
        Err(error) => error,
    };
    expect_message(&error, &["model size in bytes", &bytes.len().to_string()])?;

    let cases: [(Limits, &str); 5] = [
        (
            Limits {
                max_nodes: 0,
                ..Limits::default()
            },
            "nodes",
        ),
        (
            Limits {
                max_initializers: 0,
                ..Limits::default()
            },
            "initializers",
        ),
        (
            Limits {
                max_value_infos: 1,
                ..Limits::default()
            },
            "value_info",
        ),
        (
            Limits {
                max_name_bytes: 1,
                ..Limits::default()
            },
            "name",
        ),
        (
            Limits {
                max_rank: 1,
                ..Limits::default()
            },
            "rank",
        ),
    ];
    for (limits, what) in cases {
        let error = refusal_with(&m, &limits)?;
        ensure!(
            matches!(error, OnnxError::LimitExceeded { .. }),
            "{what}: {error:?}"
        );
        expect_message(&error, &[what])?;
    }
    let mut with_attributes = small_model();
    let graph = with_attributes
        .graph
        .as_mut()
        .ok_or_else(|| anyhow::anyhow!("no graph"))?;
    graph.node[0].attribute = vec![attr_ints("big", &[1; 5])];
    let error = refusal_with(
        &with_attributes,
        &Limits {
            max_attribute_elements: 4,
            ..Limits::default()
        },
    )?;
    expect_message(&error, &["attribute `big`", "5", "limit of 4"])?;
    let error = refusal_with(
        &with_attributes,
        &Limits {
            max_attributes: 0,
            ..Limits::default()
        },
    )?;
    expect_message(&error, &["attributes of node", "limit of 0"])
}

#[test]
fn payload_mismatches_and_unsupported_types_are_refused_by_tensor_name() -> Result<()> {
    let cases: Vec<(TensorProto, &[&str])> = vec![
        (
            f32_tensor("short", &[2, 3], &[1.0; 5]),
            &["`short`", "raw_data bytes should hold 24, but it holds 20"],
        ),
        (
            TensorProto {
                float_data: vec![1.0],
                ..f32_tensor("both", &[1], &[1.0])
            },
            &["`both`", "float_data is set alongside"],
        ),
        (
            TensorProto {
                name: "typed".into(),
                dims: vec![3],
                data_type: data_type::INT64,
                int64_data: vec![1, 2],
                ..Default::default()
            },
            &["`typed`", "int64_data should hold 3, but it holds 2"],
        ),
        (
            TensorProto {
                name: "wide".into(),
                dims: vec![1],
                data_type: data_type::DOUBLE,
                double_data: vec![1.0],
                ..Default::default()
            },
            &["`wide`", "DOUBLE", "float32"],
        ),
        (
            TensorProto {
                name: "flag".into(),
                dims: vec![1],
                data_type: data_type::BOOL,
                int32_data: vec![2],
                ..Default::default()
            },
            &["`flag`", "only 0 and 1"],
        ),
        (
            TensorProto {
                name: "negative".into(),
                dims: vec![-1],
                data_type: data_type::FLOAT,
                ..Default::default()
            },
            &["`negative`", "negative"],
        ),
    ];
    for (tensor, parts) in cases {
        let mut m = small_model();
        let graph = m
            .graph
            .as_mut()
            .ok_or_else(|| anyhow::anyhow!("no graph"))?;
        graph.initializer[0] = tensor;
        let error = refusal(&m)?;
        expect_message(&error, parts)?;
    }
    Ok(())
}

#[test]
fn duplicate_and_missing_names_are_refused() -> Result<()> {
    let mut m = small_model();
    let graph = m
        .graph
        .as_mut()
        .ok_or_else(|| anyhow::anyhow!("no graph"))?;
    graph.initializer.push(f32_tensor("W", &[1], &[0.0]));
    let error = refusal(&m)?;
    ensure!(
        matches!(&error, OnnxError::DuplicateName { name, .. } if name == "W"),
        "{error:?}"
    );

    let mut m = small_model();
    let graph = m
        .graph
        .as_mut()
        .ok_or_else(|| anyhow::anyhow!("no graph"))?;
    graph.node[0].output[0] = "x".to_string();
    graph.output[0].name = "x".to_string();
    let error = refusal(&m)?;
    expect_message(&error, &["`x`", "graph input `x`", "Relu"])?;

    let mut m = small_model();
    let graph = m
        .graph
        .as_mut()
        .ok_or_else(|| anyhow::anyhow!("no graph"))?;
    graph.input[0].name = String::new();
    ensure!(
        matches!(refusal(&m)?, OnnxError::EmptyName { .. }),
        "an unnamed input was accepted"
    );

    let mut m = small_model();
    let graph = m
        .graph
        .as_mut()
        .ok_or_else(|| anyhow::anyhow!("no graph"))?;
    graph.output[0].name = "nowhere".to_string();
    let error = refusal(&m)?;
    ensure!(
        matches!(&error, OnnxError::UndefinedOutput { output } if output == "nowhere"),
        "{error:?}"
    );
    Ok(())
}

#[test]
fn a_declared_output_type_must_be_the_imported_one() -> Result<()> {
    let with_output_type = |elem_type: i32| -> Result<ModelProto> {
        let mut m = small_model();
        let graph = m
            .graph
            .as_mut()
            .ok_or_else(|| anyhow::anyhow!("no graph"))?;
        graph.output[0] = value_info("y", elem_type, &[None, Some(3)]);
        Ok(m)
    };
    import_bytes(&with_output_type(data_type::FLOAT)?)?;
    let error = refusal(&with_output_type(data_type::INT64)?)?;
    ensure!(matches!(error, OnnxError::OutputType { .. }), "{error:?}");
    expect_message(&error, &["`y`", "INT64", "f32"])
}

#[test]
fn a_node_reading_an_undefined_value_is_refused_naming_both() -> Result<()> {
    let mut m = small_model();
    let graph = m
        .graph
        .as_mut()
        .ok_or_else(|| anyhow::anyhow!("no graph"))?;
    graph.node[0].input[0] = "ghost".to_string();
    let error = refusal(&m)?;
    ensure!(
        matches!(&error, OnnxError::UndefinedValue { value, .. } if value == "ghost"),
        "{error:?}"
    );
    expect_message(&error, &["`Relu_y`", "Relu", "`ghost`", "topological"])
}

/// A one-node model over an NCHW input, for attribute refusals.
fn image_model(
    op_type: &str,
    inputs: &[&str],
    attributes: Vec<AttributeProto>,
    initializers: Vec<TensorProto>,
) -> ModelProto {
    model(
        vec![node(op_type, inputs, &["y"], attributes)],
        vec![value_info(
            "x",
            data_type::FLOAT,
            &[None, Some(1), Some(4), Some(4)],
        )],
        vec![output("y")],
        initializers,
    )
}

#[test]
fn attribute_values_canopy_cannot_honour_are_refused_by_name() -> Result<()> {
    let w = || vec![f32_tensor("W", &[1, 1, 3, 3], &[1.0; 9])];
    let pool = |extra: Vec<AttributeProto>| {
        let mut attributes = vec![attr_ints("kernel_shape", &[3, 3])];
        attributes.extend(extra);
        attributes
    };
    let cases: Vec<(ModelProto, &str, &str)> = vec![
        (
            image_model(
                "Conv",
                &["x", "W"],
                vec![attr_ints("pads", &[1, 1, 0, 0])],
                w(),
            ),
            "pads",
            "asymmetric",
        ),
        (
            image_model("Conv", &["x", "W"], vec![attr_int("group", 2)], w()),
            "group",
            "grouped",
        ),
        (
            image_model(
                "Conv",
                &["x", "W"],
                vec![attr_string("auto_pad", "SAME_UPPER")],
                w(),
            ),
            "auto_pad",
            "NOTSET and VALID",
        ),
        (
            image_model(
                "AveragePool",
                &["x"],
                pool(vec![attr_ints("pads", &[1, 1, 1, 1])]),
                vec![],
            ),
            "count_include_pad",
            "hint",
        ),
        (
            image_model(
                "MaxPool",
                &["x"],
                pool(vec![attr_int("ceil_mode", 1)]),
                vec![],
            ),
            "ceil_mode",
            "rounds",
        ),
        (
            image_model(
                "MaxPool",
                &["x"],
                pool(vec![attr_ints("dilations", &[2, 2])]),
                vec![],
            ),
            "dilations",
            "dilated",
        ),
        (
            image_model("Relu", &["x"], vec![attr_int("mystery", 1)], vec![]),
            "mystery",
            "does not know",
        ),
        (
            image_model(
                "Cast",
                &["x"],
                vec![attr_int("to", i64::from(data_type::DOUBLE))],
                vec![],
            ),
            "to",
            "DOUBLE",
        ),
    ];
    for (m, attribute, cause) in cases {
        let error = refusal(&m)?;
        ensure!(
            matches!(&error, OnnxError::UnsupportedAttribute { attribute: a, .. } if a == attribute),
            "{attribute}: {error:?}"
        );
        expect_message(&error, &[attribute, cause, "node `"])?;
    }
    Ok(())
}

#[test]
fn semantics_import_does_not_reproduce_are_refused() -> Result<()> {
    let cases: Vec<(ModelProto, &str)> = vec![
        (
            image_model("Dropout", &["x"], vec![], vec![]),
            "the baseline",
        ),
        (
            model(
                vec![node("Dropout", &["x"], &["y", "mask"], vec![])],
                vec![value_info("x", data_type::FLOAT, &[None, Some(3)])],
                vec![output("y")],
                vec![],
            ),
            "output 1 (`mask`)",
        ),
        (
            model(
                vec![
                    node("Shape", &["x"], &["s"], vec![]),
                    node("Reshape", &["x", "s"], &["y"], vec![]),
                ],
                vec![value_info("x", data_type::FLOAT, &[None, Some(3)])],
                vec![output("y")],
                vec![],
            ),
            "Shape",
        ),
        (
            model(
                vec![node("Reshape", &["x", "x"], &["y"], vec![])],
                vec![value_info("x", data_type::INT64, &[Some(2)])],
                vec![output("y")],
                vec![],
            ),
            "must be a constant",
        ),
        (
            model(
                vec![node("Flatten", &["x"], &["y"], vec![attr_int("axis", 2)])],
                vec![value_info("x", data_type::FLOAT, &[None, Some(3), Some(2)])],
                vec![output("y")],
                vec![],
            ),
            "batch dimension would merge",
        ),
        (
            model(
                vec![node("Relu", &["x"], &["y"], vec![])],
                vec![value_info("x", data_type::FLOAT, &[Some(2), None])],
                vec![output("y")],
                vec![],
            ),
            "only the first dimension may be",
        ),
    ];
    for (index, (m, expected)) in cases.into_iter().enumerate() {
        if index == 0 {
            import_bytes(&m)?;
            continue;
        }
        let error = refusal(&m)?;
        expect_message(&error, &[expected])?;
    }
    Ok(())
}

#[test]
fn import_validates_models_built_in_memory_too() -> Result<()> {
    let mut m = small_model();
    let graph = m
        .graph
        .as_mut()
        .ok_or_else(|| anyhow::anyhow!("no graph"))?;
    graph.initializer[0] = f32_tensor("huge", &[1 << 31], &[1.0]);
    match import(&m) {
        Ok(_) => bail!("import accepted a tensor decode_model would refuse"),
        Err(error) => expect_message(&error, &["`huge`"]),
    }
}

#[test]
fn no_single_byte_corruption_makes_decode_or_import_panic() -> Result<()> {
    let m = model(
        vec![
            node(
                "Conv",
                &["x", "W"],
                &["c"],
                vec![attr_ints("pads", &[1, 1, 1, 1])],
            ),
            node("Reshape", &["c", "shape"], &["r"], vec![]),
            node("Gemm", &["r", "G"], &["y"], vec![attr_int("transB", 1)]),
        ],
        vec![value_info(
            "x",
            data_type::FLOAT,
            &[None, Some(1), Some(2), Some(2)],
        )],
        vec![output("y")],
        vec![
            f32_tensor("W", &[1, 1, 3, 3], &[1.0; 9]),
            i64_tensor("shape", &[2], &[0, -1]),
            f32_tensor("G", &[2, 4], &[0.5; 8]),
        ],
    );
    let bytes = m.encode_to_vec();
    import_bytes(&m)?;
    let (mut accepted, mut refused) = (0usize, 0usize);
    for position in 0..bytes.len() {
        for replacement in [0x00, 0x01, 0x7f, 0x80, 0xff] {
            let mut corrupted = bytes.clone();
            if let Some(byte) = corrupted.get_mut(position) {
                *byte = replacement;
            }
            // Both outcomes are fine; a panic fails the test.
            match decode_model(&corrupted, &Limits::default()).and_then(|model| import(&model)) {
                Ok(_) => accepted += 1,
                Err(_) => refused += 1,
            }
        }
    }
    ensure!(
        refused > 0 && accepted > 0,
        "accepted {accepted}, refused {refused}"
    );
    Ok(())
}
