//! The `ai.onnx.ml` ops scikit-learn's exporter writes: imported models run
//! on the CPU backend and give hand-computed values (ONNX Runtime's kernel
//! semantics), the classifier's weights become trainable parameters with
//! gradients, and everything import does not reproduce is refused by name.

mod common;

use anyhow::{Context, Result, bail, ensure};
use canopy_engine::Value;
use canopy_ir::{Op, autodiff};
use canopy_onnx::proto::{AttributeProto, ModelProto, NodeProto, OperatorSetIdProto, data_type};
use canopy_onnx::{ImportOptions, Limits, ML_DOMAIN, OnnxError, import_model_with};
use common::*;

fn ml_node(
    op_type: &str,
    inputs: &[&str],
    outputs: &[&str],
    attribute: Vec<AttributeProto>,
) -> NodeProto {
    NodeProto {
        domain: ML_DOMAIN.to_string(),
        ..node(op_type, inputs, outputs, attribute)
    }
}

/// A model importing the default domain and `ai.onnx.ml` opset 1, as
/// skl2onnx writes them.
fn ml_model(
    nodes: Vec<NodeProto>,
    x_type: i32,
    x_features: i64,
    outputs: &[&str],
    initializers: Vec<canopy_onnx::proto::TensorProto>,
) -> ModelProto {
    let mut m = model(
        nodes,
        vec![value_info("x", x_type, &[None, Some(x_features)])],
        outputs.iter().map(|name| output(name)).collect(),
        initializers,
    );
    m.opset_import.push(OperatorSetIdProto {
        domain: ML_DOMAIN.to_string(),
        version: 1,
    });
    m
}

fn import_ml(m: &ModelProto, parameters: bool) -> Result<canopy_onnx::ImportedModel> {
    let decoded = round_trip(m)?;
    let options = ImportOptions { parameters };
    Ok(import_model_with(&decoded, &Limits::default(), options)?)
}

fn i64_values(value: &Value, shape: &[usize]) -> Result<Vec<i64>> {
    let Value::I64(array) = value else {
        bail!("expected int64, got {:?}", value.dtype());
    };
    ensure!(array.shape() == shape, "shape {:?}", array.shape());
    Ok(array.iter().copied().collect())
}

fn softmax(row: &[f32]) -> Vec<f32> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = row.iter().map(|s| (s - max).exp()).collect();
    let total: f32 = exps.iter().sum();
    exps.iter().map(|e| e / total).collect()
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// W = [[1, 0], [0, 1], [1, 1]], b = [0, 0.5, -1]: scores x·Wᵀ + b.
fn three_class_attributes(post_transform: &str, labels: &[i64]) -> Vec<AttributeProto> {
    vec![
        attr_ints("classlabels_ints", labels),
        attr_floats("coefficients", &[1.0, 0.0, 0.0, 1.0, 1.0, 1.0]),
        attr_floats("intercepts", &[0.0, 0.5, -1.0]),
        attr_int("multi_class", 1),
        attr_string("post_transform", post_transform),
    ]
}

/// LinearClassifier → Normalizer (L1) → ZipMap, as skl2onnx writes a
/// multinomial LogisticRegression.
fn logistic_regression(attributes: Vec<AttributeProto>) -> ModelProto {
    let mut classifier = ml_node("LinearClassifier", &["x"], &["label", "scores"], attributes);
    classifier.name = "lc".to_string();
    ml_model(
        vec![
            classifier,
            ml_node(
                "Normalizer",
                &["scores"],
                &["probabilities"],
                vec![attr_string("norm", "L1")],
            ),
            ml_node(
                "ZipMap",
                &["probabilities"],
                &["output_probability"],
                vec![attr_ints("classlabels_int64s", &[10, 20, 30])],
            ),
        ],
        data_type::FLOAT,
        2,
        &["label", "output_probability"],
        vec![],
    )
}

#[test]
fn linear_classifier_normalizer_and_zipmap_match_hand_computed_values() -> Result<()> {
    let m = logistic_regression(three_class_attributes("SOFTMAX", &[10, 20, 30]));
    let imported = import_ml(&m, false)?;
    ensure!(imported.graph.input_names() == ["x"]);
    // L1 of a softmax is the identity: the probabilities are the softmax.
    let (_, probabilities) = imported.graph.outputs()[1];
    ensure!(
        matches!(
            imported.graph.node(probabilities).op,
            Op::Softmax { axis: 1 }
        ),
        "{:?}",
        imported.graph.op_counts()
    );
    let rows = [[1.0f32, 2.0], [3.0, -1.0], [0.5, 0.0]];
    let x = Value::f32(&[3, 2], rows.concat())?;
    let out = run(&imported.graph, vec![x])?;
    // Scores [1, 2.5, 2], [3, -0.5, 1] and [0.5, 0.5, -0.5]: the last row
    // ties, and the first maximum wins.
    ensure!(i64_values(&out[0], &[3])? == [20, 10, 10]);
    let scores = [[1.0, 2.5, 2.0], [3.0, -0.5, 1.0], [0.5, 0.5, -0.5]];
    let expected: Vec<f32> = scores.iter().flat_map(|row| softmax(row)).collect();
    assert_close("output_probability", &out[1], &[3, 3], &expected)
}

#[test]
fn post_transforms_follow_onnx_runtime() -> Result<()> {
    // W = [[1, 0], [0, 1], [0.5, 0.5]], b = 0: scores [2, 0, 1], [-1, 3, 1].
    let rows = [[2.0f32, 0.0], [-1.0, 3.0]];
    let scores = [[2.0f32, 0.0, 1.0], [-1.0, 3.0, 1.0]];
    let softmax_zero_first = {
        // 0 is left out of the sum and stays 0.
        let total = 1.0 + (-1.0f32).exp();
        [1.0 / total, 0.0, (-1.0f32).exp() / total]
    };
    let cases: [(&str, Vec<f32>); 3] = [
        ("NONE", scores.concat()),
        (
            "LOGISTIC",
            scores.iter().flatten().map(|&s| sigmoid(s)).collect(),
        ),
        (
            "SOFTMAX_ZERO",
            [softmax_zero_first.to_vec(), softmax(&scores[1])].concat(),
        ),
    ];
    for (transform, expected) in cases {
        let classifier = ml_node(
            "LinearClassifier",
            &["x"],
            &["label", "scores"],
            vec![
                attr_ints("classlabels_ints", &[0, 1, 2]),
                attr_floats("coefficients", &[1.0, 0.0, 0.0, 1.0, 0.5, 0.5]),
                attr_floats("intercepts", &[0.0, 0.0, 0.0]),
                attr_string("post_transform", transform),
            ],
        );
        let m = ml_model(
            vec![classifier],
            data_type::FLOAT,
            2,
            &["label", "scores"],
            vec![],
        );
        let graph = import_ml(&m, false)?.graph;
        let out = run(&graph, vec![Value::f32(&[2, 2], rows.concat())?])?;
        ensure!(i64_values(&out[0], &[2])? == [0, 1], "{transform} labels");
        assert_close(transform, &out[1], &[2, 3], &expected)?;
    }
    Ok(())
}

#[test]
fn normalizer_divides_by_max_l1_or_l2_and_leaves_zero_rows() -> Result<()> {
    // int64 input, converted to float as ONNX Runtime does.
    let rows: [[i64; 2]; 3] = [[3, -4], [0, 0], [-2, -1]];
    let root5 = 5.0f32.sqrt();
    let cases: [(&str, [f32; 6]); 3] = [
        // The row max, not the largest magnitude: -1 flips row 3's signs.
        ("MAX", [1.0, -4.0 / 3.0, 0.0, 0.0, 2.0, 1.0]),
        (
            "L1",
            [3.0 / 7.0, -4.0 / 7.0, 0.0, 0.0, -2.0 / 3.0, -1.0 / 3.0],
        ),
        ("L2", [0.6, -0.8, 0.0, 0.0, -2.0 / root5, -1.0 / root5]),
    ];
    for (norm, expected) in cases {
        let m = ml_model(
            vec![ml_node(
                "Normalizer",
                &["x"],
                &["y"],
                vec![attr_string("norm", norm)],
            )],
            data_type::INT64,
            2,
            &["y"],
            vec![],
        );
        let graph = import_ml(&m, false)?.graph;
        let out = run(&graph, vec![Value::i64(&[3, 2], rows.concat())?])?;
        assert_close(norm, &out[0], &[3, 2], &expected)?;
    }
    Ok(())
}

#[test]
fn scaler_subtracts_the_offset_then_multiplies_per_feature_or_by_one_value() -> Result<()> {
    let cases: [(&[f32], &[f32], [f32; 6]); 2] = [
        (
            &[1.0, 2.0, 3.0],
            &[2.0, 0.5, -1.0],
            [4.0, 1.0, -2.0, -2.0, -0.5, 1.0],
        ),
        (&[1.0], &[10.0], [20.0, 30.0, 40.0, -10.0, 0.0, 10.0]),
    ];
    for (offset, scale, expected) in cases {
        let m = ml_model(
            vec![ml_node(
                "Scaler",
                &["x"],
                &["y"],
                vec![attr_floats("offset", offset), attr_floats("scale", scale)],
            )],
            data_type::FLOAT,
            3,
            &["y"],
            vec![],
        );
        let graph = import_ml(&m, false)?.graph;
        let x = Value::f32(&[2, 3], vec![3.0, 4.0, 5.0, 0.0, 1.0, 2.0])?;
        let out = run(&graph, vec![x])?;
        assert_close(&format!("scale {scale:?}"), &out[0], &[2, 3], &expected)?;
    }
    Ok(())
}

/// skl2onnx's MLP label: the class at each row's argmax index, picked from
/// a 1-D class list ([1, N], ONNX Runtime's shape) and reshaped to [N].
#[test]
fn array_feature_extractor_picks_classes_and_columns() -> Result<()> {
    let m = model(
        vec![
            ml_node(
                "ArrayFeatureExtractor",
                &["classes", "index"],
                &["picked"],
                vec![],
            ),
            node("Reshape", &["picked", "flat"], &["label"], vec![]),
            ml_node(
                "ArrayFeatureExtractor",
                &["x", "columns"],
                &["selected"],
                vec![],
            ),
        ],
        vec![
            value_info("index", data_type::INT64, &[None, Some(1)]),
            value_info("x", data_type::FLOAT, &[None, Some(3)]),
        ],
        vec![output("picked"), output("label"), output("selected")],
        vec![
            i64_tensor("classes", &[3], &[5, 6, 7]),
            i64_tensor("flat", &[1], &[-1]),
            i64_tensor("columns", &[2], &[2, 0]),
        ],
    );
    let mut m = m;
    m.opset_import.push(OperatorSetIdProto {
        domain: ML_DOMAIN.to_string(),
        version: 3,
    });
    let graph = import_ml(&m, false)?.graph;
    let index = Value::i64(&[4, 1], vec![2, 0, 1, 2])?;
    let x = Value::f32(&[4, 3], (0..12).map(|i| i as f32).collect())?;
    let out = run(&graph, vec![index, x])?;
    ensure!(i64_values(&out[0], &[1, 4])? == [7, 5, 6, 7]);
    ensure!(i64_values(&out[1], &[4])? == [7, 5, 6, 7]);
    assert_close(
        "selected",
        &out[2],
        &[4, 2],
        &[2.0, 0.0, 5.0, 3.0, 8.0, 6.0, 11.0, 9.0],
    )
}

/// With `ImportOptions::parameters`, LinearClassifier's coefficients and
/// intercepts are `params/lc.coefficients` and `params/lc.intercepts`, and
/// the probabilities' gradient reaches them: for two classes under
/// SOFTMAX, d p0 / d s0 = p0·p1 = -d p0 / d s1.
#[test]
fn classifier_weights_are_trainable_parameters_with_gradients() -> Result<()> {
    let coefficients = [0.5f32, -1.0, 1.0, 2.0];
    let intercepts = [0.25f32, -0.25];
    let mut classifier = ml_node(
        "LinearClassifier",
        &["x"],
        &["label", "scores"],
        vec![
            attr_ints("classlabels_ints", &[0, 1]),
            attr_floats("coefficients", &coefficients),
            attr_floats("intercepts", &intercepts),
            attr_string("post_transform", "SOFTMAX"),
        ],
    );
    classifier.name = "lc".to_string();
    let normalizer = ml_node(
        "Normalizer",
        &["scores"],
        &["probabilities"],
        vec![attr_string("norm", "L1")],
    );
    let m = ml_model(
        vec![classifier, normalizer],
        data_type::FLOAT,
        2,
        &["label", "probabilities"],
        vec![],
    );
    let imported = import_ml(&m, true)?;
    ensure!(imported.parameters == ["lc.coefficients", "lc.intercepts"]);
    let names = imported.graph.input_names();
    ensure!(
        names == ["x", "params/lc.coefficients", "params/lc.intercepts"],
        "{names:?}"
    );
    let listed: Vec<(&str, Option<&[f32]>)> = imported
        .initializers
        .iter()
        .map(|(name, data)| (name.as_str(), data.as_f32()))
        .collect();
    ensure!(
        listed
            == [
                ("lc.coefficients", Some(&coefficients[..])),
                ("lc.intercepts", Some(&intercepts[..]))
            ],
        "{listed:?}"
    );

    // loss = Σ_rows p0.
    let mut graph = imported.graph.clone();
    let probabilities = graph
        .find_output("probabilities")
        .context("no probabilities output")?;
    let first = graph.push(
        Op::Slice {
            axis: 1,
            start: 0,
            end: 1,
        },
        &[probabilities],
    )?;
    let loss = graph.sum_all(first)?;
    graph.set_output("loss", loss)?;
    let gradients = autodiff::grad(
        &graph,
        "loss",
        &["params/lc.coefficients", "params/lc.intercepts"],
    )?;
    let rows = [[1.0f32, 2.0], [-1.0, 0.5]];
    let inputs = vec![
        Value::f32(&[2, 2], rows.concat())?,
        Value::f32(&[2, 2], coefficients.to_vec())?,
        Value::f32(&[2], intercepts.to_vec())?,
    ];
    let out = run(&gradients, inputs)?;
    let (mut d_w0, mut d_b0) = ([0.0f32; 2], 0.0f32);
    for row in rows {
        let s0 = coefficients[0] * row[0] + coefficients[1] * row[1] + intercepts[0];
        let s1 = coefficients[2] * row[0] + coefficients[3] * row[1] + intercepts[1];
        let p0 = sigmoid(s0 - s1);
        let slope = p0 * (1.0 - p0);
        d_w0[0] += slope * row[0];
        d_w0[1] += slope * row[1];
        d_b0 += slope;
    }
    assert_close(
        "d loss / d coefficients",
        &out[0],
        &[2, 2],
        &[d_w0[0], d_w0[1], -d_w0[0], -d_w0[1]],
    )?;
    assert_close("d loss / d intercepts", &out[1], &[2], &[d_b0, -d_b0])
}

fn expect_refusal(m: &ModelProto, parts: &[&str]) -> Result<OnnxError> {
    let error = refusal(m)?;
    expect_message(&error, parts)?;
    Ok(error)
}

#[test]
fn the_ml_opset_must_be_imported_once_and_in_range() -> Result<()> {
    let mut m = logistic_regression(three_class_attributes("SOFTMAX", &[0, 1, 2]));
    m.opset_import[1].version = 5;
    import_ml(&m, false)?;
    for (versions, found) in [
        (vec![6], "opset 6"),
        (vec![0], "opset 0"),
        (vec![], "no opset for it"),
        (vec![1, 2], "two opsets, 1 and 2"),
    ] {
        m.opset_import.truncate(1);
        for version in versions {
            m.opset_import.push(OperatorSetIdProto {
                domain: ML_DOMAIN.to_string(),
                version,
            });
        }
        let error = expect_refusal(
            &m,
            &[
                "node `lc` (LinearClassifier, #0)",
                "`ai.onnx.ml`",
                "1 to 5",
                found,
            ],
        )?;
        ensure!(
            matches!(error, OnnxError::UnsupportedDomainOpset { .. }),
            "{error:?}"
        );
    }
    Ok(())
}

#[test]
fn an_unsupported_ml_op_is_refused_naming_domain_and_opset() -> Result<()> {
    let m = ml_model(
        vec![ml_node("LinearRegressor", &["x"], &["y"], vec![])],
        data_type::FLOAT,
        2,
        &["y"],
        vec![],
    );
    let error = expect_refusal(&m, &["LinearRegressor", "`ai.onnx.ml`", "(opset 1)"])?;
    ensure!(
        matches!(&error, OnnxError::UnsupportedOp { opset: 1, domain, .. } if domain == ML_DOMAIN),
        "{error:?}"
    );
    Ok(())
}

#[test]
fn linear_classifier_attributes_import_cannot_honour_are_refused() -> Result<()> {
    let with = |name: &str, replacement: Option<AttributeProto>| {
        let mut attributes = three_class_attributes("SOFTMAX", &[0, 1, 2]);
        attributes.retain(|a| a.name != name);
        attributes.extend(replacement);
        logistic_regression(attributes)
    };
    let cases: Vec<(ModelProto, &[&str])> = vec![
        (
            with(
                "classlabels_ints",
                Some(attr_strings("classlabels_strings", &["a", "b", "c"])),
            ),
            &["classlabels_strings", "LabelEncoder"],
        ),
        (
            with(
                "post_transform",
                Some(attr_string("post_transform", "PROBIT")),
            ),
            &["post_transform", "PROBIT", "not supported"],
        ),
        (
            with(
                "post_transform",
                Some(attr_string("post_transform", "SQUASH")),
            ),
            &["post_transform `SQUASH`"],
        ),
        (
            with("multi_class", Some(attr_int("multi_class", 2))),
            &["multi_class 2"],
        ),
        (
            with("coefficients", Some(attr_floats("coefficients", &[1.0; 5]))),
            &["coefficients has 5 values", "3 classes × 2 features need 6"],
        ),
        (
            with(
                "classlabels_ints",
                Some(attr_ints("classlabels_ints", &[0, 1])),
            ),
            &["classlabels_ints has 2 labels but intercepts 3 classes"],
        ),
        (
            with("intercepts", None),
            &["required attribute `intercepts` is missing"],
        ),
        (
            with("kernel", Some(attr_string("kernel", "RBF"))),
            &["attribute `kernel`", "does not know"],
        ),
    ];
    for (m, parts) in cases {
        let mut all = vec!["node `lc` (LinearClassifier, #0)"];
        all.extend_from_slice(parts);
        expect_refusal(&m, &all)?;
    }

    // One score column: ONNX Runtime derives the second class itself.
    let binary = logistic_regression(vec![
        attr_ints("classlabels_ints", &[0, 1]),
        attr_floats("coefficients", &[1.0, 1.0]),
        attr_floats("intercepts", &[0.0]),
    ]);
    expect_refusal(&binary, &["`intercepts`", "one score column"])?;

    // A third output.
    let mut m = logistic_regression(three_class_attributes("SOFTMAX", &[0, 1, 2]));
    if let Some(graph) = m.graph.as_mut() {
        graph.node[0].output.push("extra".to_string());
    }
    expect_refusal(&m, &["output 2 (`extra`)"])?;
    Ok(())
}

#[test]
fn other_ml_attribute_values_import_cannot_honour_are_refused() -> Result<()> {
    let single = |op: &str, x_type: i32, attributes: Vec<AttributeProto>| {
        ml_model(
            vec![ml_node(op, &["x"], &["y"], attributes)],
            x_type,
            3,
            &["y"],
            vec![],
        )
    };
    let cases: Vec<(ModelProto, &[&str])> = vec![
        (
            single(
                "Normalizer",
                data_type::FLOAT,
                vec![attr_string("norm", "L3")],
            ),
            &["Normalizer", "norm `L3`"],
        ),
        (
            single("Normalizer", data_type::BOOL, vec![]),
            &["Normalizer", "input 0 is bool"],
        ),
        (
            single(
                "Scaler",
                data_type::FLOAT,
                vec![
                    attr_floats("offset", &[1.0, 2.0]),
                    attr_floats("scale", &[1.0, 2.0]),
                ],
            ),
            &["Scaler", "one value per feature (3)"],
        ),
        (
            single(
                "Scaler",
                data_type::FLOAT,
                vec![attr_floats("offset", &[1.0])],
            ),
            &["Scaler", "required attribute `scale`"],
        ),
        (
            single(
                "ZipMap",
                data_type::FLOAT,
                vec![attr_strings("classlabels_strings", &["a", "b", "c"])],
            ),
            &["ZipMap", "classlabels_strings", "LabelEncoder"],
        ),
        (
            single(
                "ZipMap",
                data_type::FLOAT,
                vec![attr_ints("classlabels_int64s", &[0, 1])],
            ),
            &["ZipMap", "2 keys for 3 columns"],
        ),
        (
            single(
                "ZipMap",
                data_type::INT64,
                vec![attr_ints("classlabels_int64s", &[0, 1, 2])],
            ),
            &["ZipMap", "2-D float tensor"],
        ),
    ];
    for (m, parts) in cases {
        expect_refusal(&m, parts)?;
    }

    // Constant indices are checked against X's last axis at import.
    for (indices, cause) in [(3, "index 3"), (-1, "index -1")] {
        let m = ml_model(
            vec![ml_node(
                "ArrayFeatureExtractor",
                &["x", "i"],
                &["y"],
                vec![],
            )],
            data_type::FLOAT,
            3,
            &["y"],
            vec![i64_tensor("i", &[2], &[0, indices])],
        );
        expect_refusal(&m, &["ArrayFeatureExtractor", cause])?;
    }
    Ok(())
}
