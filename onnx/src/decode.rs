//! Bytes to a validated [`ModelProto`], and ONNX tensors to canopy-ir
//! tensors.
//!
//! prost checks every length prefix against the remaining buffer before it
//! allocates, so a field that claims more bytes than the file has fails
//! without allocating. What prost does not bound (how many nodes, how many
//! elements a tensor's dims declare, how long names are) is checked here,
//! before import walks or converts anything.

use canopy_ir::{Buffer, DType, TensorData};
use prost::Message;

use crate::error::OnnxError;
use crate::limits::Limits;
use crate::proto::{
    AttributeProto, DATA_LOCATION_EXTERNAL, GraphProto, ModelProto, NodeProto, TensorProto,
    ValueInfoProto, data_type,
};

/// Decodes and validates a serialized ONNX model: its size, every count and
/// name against `limits`, and every tensor (initializers and tensor-valued
/// attributes) for a supported data type, no external data, and a payload
/// that matches its dims exactly; subgraphs (If branches, Loop and Scan
/// bodies) like the main graph, nested at most `limits.max_graph_depth`
/// deep.
pub fn decode_model(bytes: &[u8], limits: &Limits) -> Result<ModelProto, OnnxError> {
    if bytes.len() > limits.max_model_bytes {
        return Err(OnnxError::limit(
            "model size in bytes",
            bytes.len(),
            limits.max_model_bytes,
        ));
    }
    let model = ModelProto::decode(bytes).map_err(|source| OnnxError::Decode { source })?;
    validate_model(&model, limits)?;
    Ok(model)
}

/// The checks [`decode_model`] runs after decoding; import runs them too, so
/// a `ModelProto` built in memory gets the same guarantees.
pub fn validate_model(model: &ModelProto, limits: &Limits) -> Result<(), OnnxError> {
    check_count(
        "opset_import entries",
        model.opset_import.len(),
        limits.max_opset_imports,
    )?;
    for opset in &model.opset_import {
        check_name("an opset_import domain", &opset.domain, limits)?;
    }
    let graph = model.graph.as_ref().ok_or(OnnxError::MissingGraph)?;
    validate_graph(graph, limits, 0, &mut 0)
}

/// Validates `graph`, nested `depth` levels in the main graph; `nodes`
/// counts the nodes of every graph validated so far.
fn validate_graph(
    graph: &GraphProto,
    limits: &Limits,
    depth: usize,
    nodes: &mut usize,
) -> Result<(), OnnxError> {
    check_count("nodes in the graph", graph.node.len(), limits.max_nodes)?;
    *nodes = nodes.saturating_add(graph.node.len());
    check_count(
        "nodes in the main graph and its subgraphs",
        *nodes,
        limits.max_nodes,
    )?;
    check_count(
        "initializers in the graph",
        graph.initializer.len(),
        limits.max_initializers,
    )?;
    let value_infos = graph
        .input
        .len()
        .saturating_add(graph.output.len())
        .saturating_add(graph.value_info.len());
    check_count(
        "graph inputs, outputs and value_info entries",
        value_infos,
        limits.max_value_infos,
    )?;
    for info in graph
        .input
        .iter()
        .chain(&graph.output)
        .chain(&graph.value_info)
    {
        validate_value_info(info, limits)?;
    }
    for tensor in &graph.initializer {
        validate_tensor(tensor, &tensor.name, limits)?;
    }
    for node in &graph.node {
        validate_node(node, limits, depth, nodes)?;
    }
    Ok(())
}

fn validate_value_info(info: &ValueInfoProto, limits: &Limits) -> Result<(), OnnxError> {
    check_name("a graph value", &info.name, limits)?;
    let rank = info
        .r#type
        .as_ref()
        .and_then(|t| t.value.as_ref())
        .and_then(|crate::proto::type_proto::Value::TensorType(t)| t.shape.as_ref())
        .map_or(0, |shape| shape.dim.len());
    check_count(&format!("rank of `{}`", info.name), rank, limits.max_rank)?;
    Ok(())
}

fn validate_node(
    node: &NodeProto,
    limits: &Limits,
    depth: usize,
    nodes: &mut usize,
) -> Result<(), OnnxError> {
    check_name("a node", &node.name, limits)?;
    check_name("an op type", &node.op_type, limits)?;
    check_name("a domain", &node.domain, limits)?;
    let what = |part: &str| format!("{part} of node `{}` ({})", node.name, node.op_type);
    check_count(&what("inputs"), node.input.len(), limits.max_node_arity)?;
    check_count(&what("outputs"), node.output.len(), limits.max_node_arity)?;
    check_count(
        &what("attributes"),
        node.attribute.len(),
        limits.max_attributes,
    )?;
    for name in node.input.iter().chain(&node.output) {
        check_name("a node input or output", name, limits)?;
    }
    for attribute in &node.attribute {
        validate_attribute(node, attribute, limits, depth, nodes)?;
    }
    Ok(())
}

fn validate_attribute(
    node: &NodeProto,
    attribute: &AttributeProto,
    limits: &Limits,
    depth: usize,
    nodes: &mut usize,
) -> Result<(), OnnxError> {
    check_name("an attribute", &attribute.name, limits)?;
    let what = format!(
        "elements of attribute `{}` of node `{}` ({})",
        attribute.name, node.name, node.op_type
    );
    let longest = [
        attribute.floats.len(),
        attribute.ints.len(),
        attribute.strings.len(),
        attribute.tensors.len(),
        attribute.graphs.len(),
        attribute.s.len(),
    ]
    .into_iter()
    .max()
    .unwrap_or(0);
    check_count(&what, longest, limits.max_attribute_elements)?;
    // A tensor in an attribute (a Constant's value) is as untrusted as an
    // initializer; an unnamed one is named after its node and attribute.
    let fallback = format!("{}.{}", node.name, attribute.name);
    for tensor in attribute.t.iter().chain(&attribute.tensors) {
        let name = if tensor.name.is_empty() {
            &fallback
        } else {
            &tensor.name
        };
        validate_tensor(tensor, name, limits)?;
    }
    // A subgraph (an If branch, a Loop or Scan body) is as untrusted as the
    // main graph, one level deeper: the depth bound keeps this recursion
    // (and import's) short.
    for graph in attribute.g.iter().chain(&attribute.graphs) {
        check_count(
            &format!(
                "levels of nested graphs (at attribute `{}` of node `{}` ({}))",
                attribute.name, node.name, node.op_type
            ),
            depth + 1,
            limits.graph_depth(),
        )?;
        validate_graph(graph, limits, depth + 1, nodes)?;
    }
    Ok(())
}

fn check_count(what: &str, actual: usize, limit: usize) -> Result<(), OnnxError> {
    if actual > limit {
        return Err(OnnxError::limit(what, actual, limit));
    }
    Ok(())
}

fn check_name(what: &str, name: &str, limits: &Limits) -> Result<(), OnnxError> {
    if name.len() > limits.max_name_bytes {
        let start: String = name.chars().take(40).collect();
        return Err(OnnxError::limit(
            format!("the length in bytes of {what} name starting `{start}`"),
            name.len(),
            limits.max_name_bytes,
        ));
    }
    Ok(())
}

/// The canopy-ir dtype of a supported ONNX data type.
pub fn dtype_of(data_type: i32) -> Option<DType> {
    match data_type {
        data_type::FLOAT => Some(DType::F32),
        data_type::INT64 => Some(DType::I64),
        data_type::INT32 => Some(DType::I32),
        data_type::BOOL => Some(DType::Bool),
        _ => None,
    }
}

/// The error for a data type canopy-ir has no dtype for. DOUBLE is refused,
/// not narrowed: the ops reading it are typed double too, and narrowing
/// silently would change what the model computes.
pub(crate) fn unsupported_data_type(tensor: &str, code: i32) -> OnnxError {
    OnnxError::UnsupportedDataType {
        tensor: tensor.to_string(),
        data_type: code,
        type_name: data_type::name(code),
        hint: match code {
            data_type::DOUBLE => "; hint: export the model in float32",
            data_type::FLOAT16 | data_type::BFLOAT16 => {
                "; hint: convert the model to float32 before import"
            }
            _ => "",
        },
    }
}

/// Checks one tensor without converting it: no external data, a supported
/// type, dims within the rank and element limits, and exactly as many
/// elements in its payload as its dims declare.
pub fn validate_tensor(tensor: &TensorProto, name: &str, limits: &Limits) -> Result<(), OnnxError> {
    check_name("a tensor", name, limits)?;
    if tensor.data_location == DATA_LOCATION_EXTERNAL || !tensor.external_data.is_empty() {
        let location = tensor
            .external_data
            .iter()
            .find(|entry| entry.key == "location")
            .map_or_else(
                || "no location given".to_string(),
                |e| format!("`{}`", e.value),
            );
        return Err(OnnxError::ExternalData {
            tensor: name.to_string(),
            location,
        });
    }
    let dtype =
        dtype_of(tensor.data_type).ok_or_else(|| unsupported_data_type(name, tensor.data_type))?;
    let elements = element_count(tensor, name, limits)?;
    check_payload(tensor, name, dtype, elements)
}

/// `product(dims)` with checked arithmetic, within `max_tensor_elements`.
fn element_count(tensor: &TensorProto, name: &str, limits: &Limits) -> Result<usize, OnnxError> {
    if tensor.dims.len() > limits.max_rank {
        return Err(OnnxError::limit(
            format!("the rank of tensor `{name}`"),
            tensor.dims.len(),
            limits.max_rank,
        ));
    }
    let too_large = |elements: String| OnnxError::TensorTooLarge {
        tensor: name.to_string(),
        dims: tensor.dims.clone(),
        elements,
        limit: limits.max_tensor_elements,
    };
    let mut elements: u64 = 1;
    for &dim in &tensor.dims {
        let dim = u64::try_from(dim).map_err(|_| {
            OnnxError::invalid_tensor(
                name,
                format!("dims {:?} contain a negative size", tensor.dims),
            )
        })?;
        elements = elements
            .checked_mul(dim)
            .ok_or_else(|| too_large("more than 2^64".to_string()))?;
    }
    match usize::try_from(elements) {
        Ok(count) if count <= limits.max_tensor_elements => Ok(count),
        _ => Err(too_large(elements.to_string())),
    }
}

/// The payload is either `raw_data` or the one typed field for the dtype,
/// never both, and holds exactly `elements` elements.
fn check_payload(
    tensor: &TensorProto,
    name: &str,
    dtype: DType,
    elements: usize,
) -> Result<(), OnnxError> {
    let typed_lengths = [
        ("float_data", tensor.float_data.len()),
        ("int32_data", tensor.int32_data.len()),
        ("int64_data", tensor.int64_data.len()),
        ("double_data", tensor.double_data.len()),
        ("uint64_data", tensor.uint64_data.len()),
    ];
    let own_field = typed_field_name(dtype);
    let stray = typed_lengths
        .iter()
        .find(|(field, len)| *len > 0 && (*field != own_field || !tensor.raw_data.is_empty()));
    if let Some((field, _)) = stray {
        return Err(OnnxError::invalid_tensor(
            name,
            format!(
                "{field} is set alongside its {} payload",
                payload_field(tensor, own_field)
            ),
        ));
    }
    let (field, actual, expected) = if tensor.raw_data.is_empty() {
        let actual = typed_lengths
            .iter()
            .find(|(field, _)| *field == own_field)
            .map_or(0, |(_, len)| *len);
        (own_field, actual, elements)
    } else {
        let expected = elements
            .checked_mul(dtype.size_bytes())
            .ok_or_else(|| OnnxError::invalid_tensor(name, "its size in bytes overflows"))?;
        ("raw_data bytes", tensor.raw_data.len(), expected)
    };
    if actual != expected {
        return Err(OnnxError::invalid_tensor(
            name,
            format!(
                "dims {:?} declare {elements} elements, so {field} should hold {expected}, but it holds {actual}",
                tensor.dims
            ),
        ));
    }
    Ok(())
}

fn payload_field(tensor: &TensorProto, own_field: &'static str) -> &'static str {
    if tensor.raw_data.is_empty() {
        own_field
    } else {
        "raw_data"
    }
}

/// Where ONNX keeps elements of `dtype` when not in `raw_data` (BOOL shares
/// `int32_data`).
fn typed_field_name(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "float_data",
        DType::I64 => "int64_data",
        DType::I32 | DType::Bool => "int32_data",
    }
}

/// Converts a tensor, after [`validate_tensor`], into canopy-ir's form.
pub fn tensor_data(
    tensor: &TensorProto,
    name: &str,
    limits: &Limits,
) -> Result<TensorData, OnnxError> {
    validate_tensor(tensor, name, limits)?;
    let dtype =
        dtype_of(tensor.data_type).ok_or_else(|| unsupported_data_type(name, tensor.data_type))?;
    let shape = tensor
        .dims
        .iter()
        .map(|&d| usize::try_from(d))
        .collect::<Result<Vec<usize>, _>>()
        .map_err(|_| OnnxError::invalid_tensor(name, "a dim does not fit in usize"))?;
    let buffer = if tensor.raw_data.is_empty() {
        typed_buffer(tensor, name, dtype)?
    } else {
        Buffer::from_le_bytes(dtype, &tensor.raw_data).ok_or_else(|| {
            OnnxError::invalid_tensor(name, "raw_data holds a BOOL byte that is neither 0 nor 1")
        })?
    };
    TensorData::new(shape, buffer)
        .ok_or_else(|| OnnxError::invalid_tensor(name, "its element count does not match its dims"))
}

fn typed_buffer(tensor: &TensorProto, name: &str, dtype: DType) -> Result<Buffer, OnnxError> {
    Ok(match dtype {
        DType::F32 => Buffer::F32(tensor.float_data.clone()),
        DType::I64 => Buffer::I64(tensor.int64_data.clone()),
        DType::I32 => Buffer::I32(tensor.int32_data.clone()),
        DType::Bool => Buffer::Bool(
            tensor
                .int32_data
                .iter()
                .map(|&v| match v {
                    0 => Ok(false),
                    1 => Ok(true),
                    other => Err(OnnxError::invalid_tensor(
                        name,
                        format!(
                            "int32_data holds {other} for a BOOL element; only 0 and 1 are booleans"
                        ),
                    )),
                })
                .collect::<Result<Vec<bool>, _>>()?,
        ),
    })
}
