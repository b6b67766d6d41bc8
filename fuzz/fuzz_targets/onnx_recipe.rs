//! Fuzz input read as a recipe for a small ONNX model, so that most inputs
//! decode and reach the lowering of each op with odd shapes, types and
//! attribute values. Sizes are small by construction (ranks up to 4, dims
//! up to 5, a dozen nodes): the raw-bytes path covers hostile sizes.

use canopy_onnx::proto::tensor_shape_proto::{Dimension, dimension};
use canopy_onnx::proto::{
    AttributeProto, GraphProto, ModelProto, NodeProto, OperatorSetIdProto, TensorProto,
    TensorShapeProto, TypeProto, ValueInfoProto, attribute_type, data_type, type_proto,
};
use canopy_onnx::{MAX_OPSET, MIN_OPSET, ML_DOMAIN, ML_MAX_OPSET, SUPPORTED_ML_OPS, SUPPORTED_OPS};
use libfuzzer_sys::arbitrary::{Result, Unstructured};

/// Ops no importer lowers, so refusals are exercised too.
const OTHER_OPS: &[&str] = &["Hardmax", "If", "Loop"];

/// Element types: the four import supports, and two it refuses.
const DATA_TYPES: &[i32] = &[
    data_type::FLOAT,
    data_type::FLOAT,
    data_type::INT64,
    data_type::INT32,
    data_type::BOOL,
    data_type::DOUBLE,
    data_type::UNDEFINED,
];

/// Attribute names the lowerings read, each with the kind ONNX gives it.
const ATTRIBUTES: &[(&str, Kind)] = &[
    ("axis", Kind::Int),
    ("axes", Kind::Ints),
    ("perm", Kind::Ints),
    ("transA", Kind::Int),
    ("transB", Kind::Int),
    ("alpha", Kind::Float),
    ("beta", Kind::Float),
    ("allowzero", Kind::Int),
    ("to", Kind::Int),
    ("value", Kind::Tensor),
    ("value_float", Kind::Float),
    ("value_floats", Kind::Floats),
    ("value_int", Kind::Int),
    ("value_ints", Kind::Ints),
    ("group", Kind::Int),
    ("kernel_shape", Kind::Ints),
    ("ceil_mode", Kind::Int),
    ("count_include_pad", Kind::Int),
    (
        "auto_pad",
        Kind::String(&["NOTSET", "VALID", "SAME_UPPER", "SAME_LOWER"]),
    ),
    ("pads", Kind::Ints),
    ("strides", Kind::Ints),
    ("dilations", Kind::Ints),
    ("keepdims", Kind::Int),
    ("noop_with_empty_axes", Kind::Int),
    ("select_last_index", Kind::Int),
    ("mode", Kind::String(&["constant", "reflect", "edge"])),
    ("coefficients", Kind::Floats),
    ("intercepts", Kind::Floats),
    ("classlabels_ints", Kind::Ints),
    ("classlabels_strings", Kind::String(&["a", "b"])),
    ("multi_class", Kind::Int),
    (
        "post_transform",
        Kind::String(&["NONE", "LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO", "PROBIT"]),
    ),
    ("norm", Kind::String(&["MAX", "L1", "L2"])),
    ("offset", Kind::Floats),
    ("scale", Kind::Floats),
];

#[derive(Clone, Copy)]
enum Kind {
    Int,
    Ints,
    Float,
    Floats,
    String(&'static [&'static str]),
    Tensor,
}

const KINDS: &[Kind] = &[
    Kind::Int,
    Kind::Ints,
    Kind::Float,
    Kind::Floats,
    Kind::String(&["?"]),
    Kind::Tensor,
];

/// Builds one model from `u`: graph inputs, initializers, nodes whose
/// inputs are earlier values, and outputs among those values.
pub fn model(u: &mut Unstructured) -> Result<ModelProto> {
    let mut values: Vec<String> = Vec::new();
    let mut graph = GraphProto {
        name: "recipe".to_string(),
        ..GraphProto::default()
    };
    for index in 0..u.int_in_range(1..=3)? {
        let name = format!("x{index}");
        graph.input.push(input(u, &name)?);
        values.push(name);
    }
    for index in 0..u.int_in_range(0..=4)? {
        let name = format!("w{index}");
        graph.initializer.push(tensor(u, &name)?);
        values.push(name);
    }
    for index in 0..u.int_in_range(1..=12)? {
        let output = format!("v{index}");
        graph.node.push(node(u, &values, &output)?);
        values.push(output);
    }
    let last = values.last().cloned().unwrap_or_default();
    graph.output.push(output(&last));
    for _ in 0..u.int_in_range(0..=2)? {
        graph.output.push(output(u.choose(&values)?));
    }
    Ok(ModelProto {
        ir_version: 8,
        graph: Some(graph),
        opset_import: vec![
            OperatorSetIdProto {
                domain: String::new(),
                version: u.int_in_range(MIN_OPSET - 1..=MAX_OPSET + 1)?,
            },
            OperatorSetIdProto {
                domain: ML_DOMAIN.to_string(),
                version: u.int_in_range(0..=ML_MAX_OPSET + 1)?,
            },
        ],
        ..ModelProto::default()
    })
}

fn input(u: &mut Unstructured, name: &str) -> Result<ValueInfoProto> {
    let rank = u.int_in_range(0..=4)?;
    let dim = (0..rank)
        .map(|axis| {
            let value = if axis == 0 && u.ratio(1, 2)? {
                dimension::Value::DimParam("N".to_string())
            } else {
                dimension::Value::DimValue(u.int_in_range(0..=5)?)
            };
            Ok(Dimension {
                value: Some(value),
                ..Dimension::default()
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(ValueInfoProto {
        name: name.to_string(),
        r#type: Some(TypeProto {
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type: *u.choose(DATA_TYPES)?,
                shape: Some(TensorShapeProto { dim }),
            })),
            ..TypeProto::default()
        }),
        ..ValueInfoProto::default()
    })
}

/// A tensor of small dims whose elements are small integers, so they make
/// sense as shapes, axes and perms as well as weights.
fn tensor(u: &mut Unstructured, name: &str) -> Result<TensorProto> {
    let dims: Vec<i64> = (0..u.int_in_range(0..=3)?)
        .map(|_| u.int_in_range(0..=4))
        .collect::<Result<_>>()?;
    let count = dims.iter().product::<i64>() as usize;
    let elements: Vec<i8> = (0..count)
        .map(|_| u.int_in_range(-4..=4))
        .collect::<Result<_>>()?;
    let data_type = *u.choose(&DATA_TYPES[..5])?;
    let mut tensor = TensorProto {
        name: name.to_string(),
        dims,
        data_type,
        ..TensorProto::default()
    };
    let raw = u.arbitrary::<bool>()?;
    let wide = |e: &i8| i64::from(*e);
    match data_type {
        data_type::FLOAT if raw => {
            tensor.raw_data = elements
                .iter()
                .flat_map(|&e| (f32::from(e) / 2.0).to_le_bytes())
                .collect::<Vec<u8>>()
                .into();
        }
        data_type::FLOAT => {
            tensor.float_data = elements.iter().map(|&e| f32::from(e) / 2.0).collect()
        }
        data_type::INT64 => tensor.int64_data = elements.iter().map(wide).collect(),
        data_type::BOOL => tensor.int32_data = elements.iter().map(|&e| i32::from(e & 1)).collect(),
        _ => tensor.int32_data = elements.iter().map(|&e| i32::from(e)).collect(),
    }
    Ok(tensor)
}

fn node(u: &mut Unstructured, values: &[String], output: &str) -> Result<NodeProto> {
    let pick =
        u.int_in_range(0..=SUPPORTED_OPS.len() + SUPPORTED_ML_OPS.len() + OTHER_OPS.len() - 1)?;
    let (op_type, domain) = if let Some(op) = SUPPORTED_OPS.get(pick) {
        (*op, "")
    } else if let Some(op) = SUPPORTED_ML_OPS.get(pick - SUPPORTED_OPS.len()) {
        (*op, ML_DOMAIN)
    } else {
        (
            OTHER_OPS[pick - SUPPORTED_OPS.len() - SUPPORTED_ML_OPS.len()],
            "",
        )
    };
    let input = (0..u.int_in_range(0..=3)?)
        .map(|_| {
            Ok(if u.ratio(1, 16)? {
                String::new()
            } else {
                u.choose(values)?.clone()
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let attribute = (0..u.int_in_range(0..=3)?)
        .map(|_| attribute(u))
        .collect::<Result<Vec<_>>>()?;
    Ok(NodeProto {
        name: format!("n_{output}"),
        op_type: op_type.to_string(),
        domain: domain.to_string(),
        input,
        output: vec![output.to_string()],
        attribute,
        ..NodeProto::default()
    })
}

/// An attribute the lowerings read, usually of its ONNX kind, sometimes of
/// another (an exporter bug import must refuse, not misread).
fn attribute(u: &mut Unstructured) -> Result<AttributeProto> {
    let (name, mut kind) = *u.choose(ATTRIBUTES)?;
    if u.ratio(1, 16)? {
        kind = *u.choose(KINDS)?;
    }
    let small = |u: &mut Unstructured| u.int_in_range(-3..=6);
    let list = |u: &mut Unstructured| -> Result<Vec<i64>> {
        (0..u.int_in_range(0..=5)?).map(|_| small(u)).collect()
    };
    let mut attribute = AttributeProto {
        name: name.to_string(),
        ..AttributeProto::default()
    };
    match kind {
        Kind::Int => {
            attribute.r#type = attribute_type::INT;
            attribute.i = small(u)?;
        }
        Kind::Ints => {
            attribute.r#type = attribute_type::INTS;
            attribute.ints = list(u)?;
        }
        Kind::Float => {
            attribute.r#type = attribute_type::FLOAT;
            attribute.f = u.arbitrary()?;
        }
        Kind::Floats => {
            attribute.r#type = attribute_type::FLOATS;
            attribute.floats = list(u)?.into_iter().map(|v| v as f32 / 2.0).collect();
        }
        Kind::String(choices) => {
            attribute.r#type = attribute_type::STRING;
            attribute.s = u.choose(choices)?.as_bytes().to_vec();
        }
        Kind::Tensor => {
            attribute.r#type = attribute_type::TENSOR;
            attribute.t = Some(tensor(u, "")?);
        }
    }
    Ok(attribute)
}

fn output(name: &str) -> ValueInfoProto {
    ValueInfoProto {
        name: name.to_string(),
        ..ValueInfoProto::default()
    }
}
