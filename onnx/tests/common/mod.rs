//! Builders for ONNX models made from the crate's own proto structs, and a
//! runner for imported graphs on the CPU backend.

#![allow(dead_code)] // each test binary uses a different subset

use anyhow::{Context, Result, bail, ensure};
use canopy_engine::{Backend, CpuBackend, Value};
use canopy_ir::{Buffer, Graph};
use canopy_onnx::proto::tensor_shape_proto::{Dimension, dimension};
use canopy_onnx::proto::{
    AttributeProto, GraphProto, ModelProto, NodeProto, OperatorSetIdProto, TensorProto,
    TensorShapeProto, TypeProto, ValueInfoProto, attribute_type, data_type, type_proto,
};
use canopy_onnx::{Limits, OnnxError, decode_model};
use prost::Message;

pub const OPSET: i64 = 17;

/// An f32 tensor with its elements in `raw_data`, as exporters write them.
pub fn f32_tensor(name: &str, dims: &[i64], data: &[f32]) -> TensorProto {
    let raw: Vec<u8> = data.iter().flat_map(|x| x.to_le_bytes()).collect();
    TensorProto {
        name: name.to_string(),
        dims: dims.to_vec(),
        data_type: data_type::FLOAT,
        raw_data: raw.into(),
        ..Default::default()
    }
}

/// An int64 tensor with its elements in the typed `int64_data` field.
pub fn i64_tensor(name: &str, dims: &[i64], data: &[i64]) -> TensorProto {
    TensorProto {
        name: name.to_string(),
        dims: dims.to_vec(),
        data_type: data_type::INT64,
        int64_data: data.to_vec(),
        ..Default::default()
    }
}

pub fn node(
    op_type: &str,
    inputs: &[&str],
    outputs: &[&str],
    attribute: Vec<AttributeProto>,
) -> NodeProto {
    NodeProto {
        name: format!("{op_type}_{}", outputs.first().copied().unwrap_or("none")),
        op_type: op_type.to_string(),
        input: inputs.iter().map(|s| s.to_string()).collect(),
        output: outputs.iter().map(|s| s.to_string()).collect(),
        attribute,
        ..Default::default()
    }
}

pub fn attr_int(name: &str, i: i64) -> AttributeProto {
    AttributeProto {
        name: name.to_string(),
        r#type: attribute_type::INT,
        i,
        ..Default::default()
    }
}

pub fn attr_float(name: &str, f: f32) -> AttributeProto {
    AttributeProto {
        name: name.to_string(),
        r#type: attribute_type::FLOAT,
        f,
        ..Default::default()
    }
}

pub fn attr_ints(name: &str, ints: &[i64]) -> AttributeProto {
    AttributeProto {
        name: name.to_string(),
        r#type: attribute_type::INTS,
        ints: ints.to_vec(),
        ..Default::default()
    }
}

pub fn attr_floats(name: &str, floats: &[f32]) -> AttributeProto {
    AttributeProto {
        name: name.to_string(),
        r#type: attribute_type::FLOATS,
        floats: floats.to_vec(),
        ..Default::default()
    }
}

pub fn attr_string(name: &str, value: &str) -> AttributeProto {
    AttributeProto {
        name: name.to_string(),
        r#type: attribute_type::STRING,
        s: value.as_bytes().to_vec(),
        ..Default::default()
    }
}

pub fn attr_strings(name: &str, values: &[&str]) -> AttributeProto {
    AttributeProto {
        name: name.to_string(),
        r#type: attribute_type::STRINGS,
        strings: values.iter().map(|v| v.as_bytes().to_vec()).collect(),
        ..Default::default()
    }
}

pub fn attr_graph(name: &str, g: GraphProto) -> AttributeProto {
    AttributeProto {
        name: name.to_string(),
        r#type: attribute_type::GRAPH,
        g: Some(g),
        ..Default::default()
    }
}

/// A subgraph (a Loop or Scan body, an If branch).
pub fn subgraph(
    name: &str,
    nodes: Vec<NodeProto>,
    inputs: Vec<ValueInfoProto>,
    outputs: Vec<ValueInfoProto>,
    initializers: Vec<TensorProto>,
) -> GraphProto {
    GraphProto {
        name: name.to_string(),
        node: nodes,
        input: inputs,
        output: outputs,
        initializer: initializers,
        ..Default::default()
    }
}

pub fn attr_tensor(name: &str, t: TensorProto) -> AttributeProto {
    AttributeProto {
        name: name.to_string(),
        r#type: attribute_type::TENSOR,
        t: Some(t),
        ..Default::default()
    }
}

/// A tensor value info; `None` dims are the symbolic batch `N`.
pub fn value_info(name: &str, elem_type: i32, dims: &[Option<i64>]) -> ValueInfoProto {
    let dim = dims
        .iter()
        .map(|d| Dimension {
            value: Some(match d {
                Some(size) => dimension::Value::DimValue(*size),
                None => dimension::Value::DimParam("N".to_string()),
            }),
            ..Default::default()
        })
        .collect();
    ValueInfoProto {
        name: name.to_string(),
        r#type: Some(TypeProto {
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type,
                shape: Some(TensorShapeProto { dim }),
            })),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A value info for an output, whose type import does not read.
pub fn output(name: &str) -> ValueInfoProto {
    ValueInfoProto {
        name: name.to_string(),
        ..Default::default()
    }
}

pub fn model(
    nodes: Vec<NodeProto>,
    inputs: Vec<ValueInfoProto>,
    outputs: Vec<ValueInfoProto>,
    initializers: Vec<TensorProto>,
) -> ModelProto {
    ModelProto {
        ir_version: 10,
        producer_name: "canopy-onnx tests".to_string(),
        graph: Some(GraphProto {
            name: "test".to_string(),
            node: nodes,
            input: inputs,
            output: outputs,
            initializer: initializers,
            ..Default::default()
        }),
        opset_import: vec![OperatorSetIdProto {
            domain: String::new(),
            version: OPSET,
        }],
        ..Default::default()
    }
}

/// Encodes `model` to bytes and decodes it back with the default limits,
/// so every test goes through the wire format.
pub fn round_trip(model: &ModelProto) -> Result<ModelProto> {
    let bytes = model.encode_to_vec();
    Ok(decode_model(&bytes, &Limits::default())?)
}

/// Encodes, decodes and imports `model`.
pub fn import_bytes(model: &ModelProto) -> Result<Graph> {
    let decoded = round_trip(model)?;
    Ok(canopy_onnx::import(&decoded)?)
}

pub fn run(graph: &Graph, inputs: Vec<Value>) -> Result<Vec<Value>> {
    let mut executable = CpuBackend.compile(graph)?;
    Ok(executable.run(inputs)?)
}

/// Decodes and imports the encoded model, expecting an error.
pub fn refusal(model: &ModelProto) -> Result<OnnxError> {
    refusal_with(model, &Limits::default())
}

pub fn refusal_with(model: &ModelProto, limits: &Limits) -> Result<OnnxError> {
    let bytes = model.encode_to_vec();
    match decode_model(&bytes, limits).and_then(|m| canopy_onnx::import_model(&m, limits)) {
        Ok(_) => bail!("the model was accepted"),
        Err(error) => Ok(error),
    }
}

pub fn expect_message(error: &OnnxError, parts: &[&str]) -> Result<()> {
    let message = error.to_string();
    for part in parts {
        ensure!(
            message.contains(part),
            "message {message:?} does not mention {part:?}"
        );
    }
    Ok(())
}

pub fn assert_close(what: &str, actual: &Value, shape: &[usize], expected: &[f32]) -> Result<()> {
    let array = actual
        .as_f32()
        .with_context(|| format!("{what} is not f32"))?;
    ensure!(
        array.shape() == shape,
        "{what}: shape {:?}, expected {shape:?}",
        array.shape()
    );
    let values: Vec<f32> = array.iter().copied().collect();
    ensure!(
        values.len() == expected.len(),
        "{what}: {} values, expected {}",
        values.len(),
        expected.len()
    );
    for (index, (got, want)) in values.iter().zip(expected).enumerate() {
        ensure!(
            (got - want).abs() <= 1e-5 * want.abs().max(1.0),
            "{what}[{index}]: got {got}, expected {want} (all: {values:?})"
        );
    }
    Ok(())
}

pub fn python() -> String {
    std::env::var("CANOPY_PYTHON").unwrap_or_else(|_| "python3".to_string())
}

/// JSON for an f32 (NaN and infinities as Python's json reads them).
fn json_number(value: f64) -> String {
    if value.is_nan() {
        "NaN".to_string()
    } else if value.is_infinite() {
        if value > 0.0 { "Infinity" } else { "-Infinity" }.to_string()
    } else {
        format!("{value:?}")
    }
}

/// A tensor as `tests/reference/export_ops.py` reads it.
pub fn json_tensor(name: &str, value: &Value) -> String {
    let data = value.to_data();
    let elements: Vec<String> = match &data.buffer {
        Buffer::F32(v) => v.iter().map(|&x| json_number(f64::from(x))).collect(),
        Buffer::I64(v) => v.iter().map(i64::to_string).collect(),
        Buffer::I32(v) => v.iter().map(i32::to_string).collect(),
        Buffer::Bool(v) => v.iter().map(bool::to_string).collect(),
    };
    format!(
        r#"{{"name": "{name}", "dtype": "{}", "shape": {:?}, "data": [{}]}}"#,
        data.dtype(),
        data.shape,
        elements.join(", ")
    )
}

/// One model for ONNX Runtime, its inputs and the outputs canopy
/// computed for them.
pub struct ReferenceCase {
    pub name: String,
    pub model: ModelProto,
    pub inputs: Vec<(String, Value)>,
    pub outputs: Vec<(String, Value)>,
}

/// Runs `tests/reference/export_ops.py` on `cases`: each model must pass
/// `onnx.checker` with full shape inference and ONNX Runtime must compute
/// the outputs canopy computed (floats to 1e-5).
pub fn onnx_runtime_agrees(cases: &[ReferenceCase]) -> Result<()> {
    let dir = tempfile::tempdir()?;
    let mut manifest = Vec::with_capacity(cases.len());
    for case in cases {
        let file = format!("{}.onnx", case.name);
        std::fs::write(dir.path().join(&file), case.model.encode_to_vec())?;
        let tensors = |values: &[(String, Value)]| {
            values
                .iter()
                .map(|(name, value)| json_tensor(name, value))
                .collect::<Vec<_>>()
                .join(", ")
        };
        manifest.push(format!(
            r#"{{"name": "{}", "file": "{file}", "inputs": [{}], "outputs": [{}]}}"#,
            case.name,
            tensors(&case.inputs),
            tensors(&case.outputs)
        ));
    }
    std::fs::write(
        dir.path().join("cases.json"),
        format!("[\n{}\n]", manifest.join(",\n")),
    )?;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/reference/export_ops.py");
    let output = std::process::Command::new(python())
        .arg(script)
        .arg(dir.path())
        .output()
        .with_context(|| {
            format!(
                "cannot run `{}`; hint: pip install -r requirements-dev.txt",
                python()
            )
        })?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        bail!(
            "ONNX Runtime disagrees with canopy:\n{stdout}{}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    ensure!(
        stdout.contains(&format!("{} cases match", cases.len())),
        "{stdout}"
    );
    Ok(())
}
