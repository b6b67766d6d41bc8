//! Model → bytes. Deterministic: parameters in declaration order, entry
//! points by name, nodes in order, and tensors placed in the data section in
//! exactly that traversal order.

use crate::data::TensorData;
use crate::error::{IrError, IrResult, node_error};
use crate::graph::{Graph, MAX_RANK, Node, ValueId};
use crate::model::{Metadata, Model, Parameter};
use crate::types::{Dim, TensorType};

use super::limits::HARD_MAX_DIM;
use super::schema::{DataRef, DimRec, GraphRec, HeaderRec, MetadataRec, OrderedMap, OutputRec};
use super::schema::{NodeRec, ParamRec, TypeRec};
use super::{ALIGN, hex, ops, preamble};

pub(crate) fn write_model(model: &Model) -> IrResult<Vec<u8>> {
    model.validate()?;
    let mut data = DataWriter::default();
    let parameters = model
        .parameters
        .iter()
        .map(|p| encode_param(p, &mut data))
        .collect::<IrResult<Vec<_>>>()?;
    let mut entry_points = Vec::with_capacity(model.entry_points.len());
    for (name, graph) in &model.entry_points {
        let rec = encode_graph(graph, &mut data)
            .map_err(|e| IrError::Invalid(format!("entry point `{name}`: {e}")))?;
        entry_points.push((name.clone(), rec));
    }
    let header = HeaderRec {
        model: encode_metadata(&model.metadata),
        parameters,
        entry_points: OrderedMap(entry_points),
    };
    let json = serde_json::to_vec(&header)
        .map_err(|e| IrError::Invalid(format!("cannot encode the header: {e}")))?;
    Ok(preamble::assemble(&json, &data.bytes, model_opset(model)))
}

/// The opset a file of `model` declares: the newest its ops need, so a
/// model of older ops stays readable by older readers.
pub(crate) fn model_opset(model: &Model) -> u16 {
    model
        .entry_points
        .values()
        .map(Graph::opset)
        .max()
        .unwrap_or(1)
}

/// The data section under construction; every tensor starts 64-aligned and
/// the section ends on a 64-byte boundary.
#[derive(Default)]
pub(crate) struct DataWriter {
    bytes: Vec<u8>,
}

impl DataWriter {
    pub fn push(&mut self, tensor: &[u8]) -> DataRef {
        let offset = self.bytes.len() as u64;
        self.bytes.extend_from_slice(tensor);
        self.bytes
            .resize(self.bytes.len().div_ceil(ALIGN) * ALIGN, 0);
        DataRef {
            offset,
            bytes: tensor.len() as u64,
        }
    }
}

fn encode_metadata(m: &Metadata) -> MetadataRec {
    MetadataRec {
        name: m.model_name.clone(),
        parent_digest: m.parent_digest.as_ref().map(|d| hex::encode(d)),
        producer: m.producer.clone(),
        properties: OrderedMap(
            m.properties
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        ),
    }
}

fn encode_param(p: &Parameter, data: &mut DataWriter) -> IrResult<ParamRec> {
    let context = |e: IrError| IrError::Invalid(format!("parameter `{}`: {e}", p.name));
    check_tensor(&p.data).map_err(context)?;
    let shape = p
        .data
        .shape
        .iter()
        .map(|&d| dim_value(d))
        .collect::<IrResult<Vec<_>>>()
        .map_err(context)?;
    Ok(ParamRec {
        name: p.name.clone(),
        dtype: p.data.dtype().name().to_string(),
        shape,
        trainable: p.trainable,
        data: data.push(&p.data.buffer.to_le_bytes()),
    })
}

/// `TensorData`'s fields are public, so its shape and buffer can disagree;
/// such a tensor has no faithful encoding.
pub(crate) fn check_tensor(t: &TensorData) -> IrResult<()> {
    if t.shape.len() > MAX_RANK {
        return Err(IrError::Invalid(format!(
            "rank {} exceeds the limit of {MAX_RANK}",
            t.shape.len()
        )));
    }
    let count = t
        .shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d));
    if count != Some(t.buffer.len()) {
        return Err(IrError::Invalid(format!(
            "shape {:?} does not match the {} elements of its buffer",
            t.shape,
            t.buffer.len()
        )));
    }
    Ok(())
}

pub(crate) fn encode_graph(graph: &Graph, data: &mut DataWriter) -> IrResult<GraphRec> {
    let mut nodes = Vec::with_capacity(graph.len());
    for (i, node) in graph.nodes().iter().enumerate() {
        let rec = encode_node(node, data)
            .map_err(|e| node_error(ValueId(i as u32), node.op.name(), e.to_string()))?;
        nodes.push(rec);
    }
    let outputs = graph
        .outputs()
        .iter()
        .map(|(name, value)| OutputRec {
            name: name.clone(),
            value: value.0,
        })
        .collect();
    Ok(GraphRec { nodes, outputs })
}

fn encode_node(node: &Node, data: &mut DataWriter) -> IrResult<NodeRec> {
    let mut rec = ops::encode_op(&node.op, data)?;
    rec.inputs = node.inputs.iter().map(|v| v.0).collect();
    rec.ty = encode_type(&node.ty)?;
    Ok(rec)
}

fn encode_type(ty: &TensorType) -> IrResult<TypeRec> {
    if ty.rank() > MAX_RANK {
        return Err(IrError::Invalid(format!(
            "type {ty} exceeds the rank limit of {MAX_RANK}"
        )));
    }
    let shape = ty
        .shape
        .dims()
        .iter()
        .map(|d| match d {
            Dim::Fixed(n) => dim_value(*n).map(DimRec::Fixed),
            Dim::Batch => Ok(DimRec::Batch),
        })
        .collect::<IrResult<Vec<_>>>()?;
    Ok(TypeRec {
        dtype: ty.dtype.name().to_string(),
        shape,
    })
}

/// A dimension or integer attribute, within the format's hard ceiling.
pub(crate) fn dim_value(n: usize) -> IrResult<u64> {
    let v = n as u64;
    if v > HARD_MAX_DIM {
        return Err(IrError::Invalid(format!(
            "value {n} exceeds the file format's limit of {HARD_MAX_DIM}"
        )));
    }
    Ok(v)
}
