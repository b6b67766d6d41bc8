//! Bytes → model, for untrusted bytes. Order of checks: preamble and
//! lengths, digest, padding, JSON nesting, JSON parse, decoding (limits,
//! names, data ranges, graphs through the verifier), canonical form, and
//! finally `Model::validate`.

use std::collections::HashSet;

use crate::data::{Buffer, TensorData};
use crate::graph::{Graph, Node, ValueId};
use crate::model::{Metadata, Model, Parameter};
use crate::op::Op;
use crate::types::{DType, Dim, Shape, TensorType};

use super::error::FormatError;
use super::limits::ReadLimits;
use super::preamble::{self, PREAMBLE_LEN, Preamble, align};
use super::schema::{DataRef, DimRec, GraphRec, HeaderRec, MetadataRec, ParamRec, TypeRec};
use super::{ALIGN, hex, ops, write};

pub(crate) fn read_model(bytes: &[u8], limits: &ReadLimits) -> Result<Model, FormatError> {
    let pre = preamble::parse(bytes, limits)?;
    check_digest(bytes, &pre)?;
    let header = &bytes[PREAMBLE_LEN..PREAMBLE_LEN + pre.header_len];
    check_zero(
        &bytes[PREAMBLE_LEN + pre.header_len..pre.data_start()],
        "header padding",
    )?;
    // One level more than `max_nesting` may parse, so that a graph nested
    // one level too deep reaches the decoder, whose error names the node
    // and the depth; deeper JSON is refused here, before serde recurses.
    check_json_depth(header, 7 + 3 * (limits.max_nesting + 1))?;
    let rec: HeaderRec = serde_json::from_slice(header).map_err(header_error)?;
    let mut dec = Decoder {
        limits,
        data: &bytes[pre.data_start()..pre.data_start() + pre.data_len],
        end: 0,
        graphs: 0,
    };
    let model = dec.model(&rec)?;
    dec.finish()?;
    check_opset(&model, pre.opset)?;
    check_canonical(&rec, header)?;
    model.validate().map_err(FormatError::Model)?;
    Ok(model)
}

/// Every op must exist in the op set the file declares: a file that says
/// opset 1 but holds an opset-2 op was not written by a conforming writer.
/// Nor was one declaring a newer opset than its ops need (the writer
/// declares exactly that), which would give one model two encodings.
fn check_opset(model: &Model, declared: u16) -> Result<(), FormatError> {
    for (name, graph) in &model.entry_points {
        if let Some(node) = graph.nodes().iter().find(|n| n.op.opset() > declared) {
            return Err(FormatError::invalid(
                "preamble",
                format!(
                    "entry point `{name}` uses `{}`, an opset-{} op, but the file declares opset {declared}",
                    node.op.name(),
                    node.op.opset()
                ),
            ));
        }
    }
    let needed = write::model_opset(model);
    if declared > needed {
        return Err(FormatError::NonCanonical(format!(
            "the file declares opset {declared}, but its ops need only opset {needed}"
        )));
    }
    Ok(())
}

/// serde's messages can quote a whole offending string; keep them short.
fn header_error(e: serde_json::Error) -> FormatError {
    let msg = e.to_string();
    match msg.char_indices().nth(300) {
        Some((at, _)) => FormatError::Header(format!("{}… ({})", &msg[..at], position(&e))),
        None => FormatError::Header(msg),
    }
}

fn position(e: &serde_json::Error) -> String {
    format!("line {} column {}", e.line(), e.column())
}

fn check_digest(bytes: &[u8], pre: &Preamble) -> Result<(), FormatError> {
    let computed = preamble::content_digest(bytes);
    if computed != pre.digest {
        return Err(FormatError::DigestMismatch {
            stored: hex::encode(&pre.digest),
            computed: hex::encode(&computed),
        });
    }
    Ok(())
}

fn check_zero(bytes: &[u8], what: &str) -> Result<(), FormatError> {
    match bytes.iter().position(|&b| b != 0) {
        Some(at) => Err(FormatError::invalid(
            what,
            format!("byte {at} of the padding is not zero"),
        )),
        None => Ok(()),
    }
}

/// Rejects JSON nested deeper than `max` before serde recurses into it, so
/// hostile nesting cannot exhaust the stack. The schema needs 7 levels for
/// an entry point (header, `entry_points`, graph, `nodes`, node, `type`,
/// `shape`) and 3 more per nested graph: every op that nests one (custom
/// gradients, loops, branches) holds it as a node attribute, which adds
/// the graph, its `nodes` and a node.
fn check_json_depth(json: &[u8], max: usize) -> Result<(), FormatError> {
    let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
    for &b in json {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => depth += 1,
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
        if depth > max {
            return Err(FormatError::limit(
                "header JSON nesting depth",
                depth as u64,
                max as u64,
            ));
        }
    }
    Ok(())
}

/// The header must be byte-for-byte what the writer would emit, so that one
/// model has one encoding and hence one digest.
fn check_canonical(rec: &HeaderRec, header: &[u8]) -> Result<(), FormatError> {
    let canonical = serde_json::to_vec(rec).map_err(|e| FormatError::Header(e.to_string()))?;
    if canonical == header {
        return Ok(());
    }
    let at = canonical
        .iter()
        .zip(header)
        .position(|(a, b)| a != b)
        .unwrap_or(canonical.len().min(header.len()));
    Err(FormatError::NonCanonical(format!(
        "header byte {at} differs from the canonical compact JSON"
    )))
}

/// Decoding state: the limits, the data section and how far into it the
/// tensors read so far reach (tensors must be packed in reading order).
pub(crate) struct Decoder<'b> {
    pub limits: &'b ReadLimits,
    data: &'b [u8],
    end: usize,
    graphs: usize,
}

impl<'b> Decoder<'b> {
    fn model(&mut self, rec: &HeaderRec) -> Result<Model, FormatError> {
        let metadata = self.metadata(&rec.model)?;
        let parameters = self.parameters(&rec.parameters)?;
        let pairs = &rec.entry_points.0;
        check_sorted(
            pairs.iter().map(|(k, _)| k.as_str()),
            "entry point",
            "header",
        )?;
        let mut entry_points = std::collections::BTreeMap::new();
        for (name, graph) in pairs {
            self.check_string(name, "header: entry point name")?;
            let graph = self.graph(graph, &format!("entry point `{name}`"), 0)?;
            entry_points.insert(name.clone(), graph);
        }
        Ok(Model {
            metadata,
            parameters,
            entry_points,
        })
    }

    fn metadata(&self, m: &MetadataRec) -> Result<Metadata, FormatError> {
        let loc = "model metadata";
        self.check_string(&m.name, loc)?;
        self.check_string(&m.producer, loc)?;
        let parent_digest = match &m.parent_digest {
            None => None,
            Some(h) => Some(parse_digest(h).ok_or_else(|| {
                FormatError::invalid(loc, "parent digest is not 64 lowercase hex digits")
            })?),
        };
        let props = &m.properties.0;
        if props.len() > self.limits.max_properties {
            let (n, max) = (props.len() as u64, self.limits.max_properties as u64);
            return Err(FormatError::limit("number of properties", n, max));
        }
        check_sorted(props.iter().map(|(k, _)| k.as_str()), "property", loc)?;
        for (k, v) in props {
            self.check_string(k, loc)?;
            self.check_string(v, loc)?;
        }
        Ok(Metadata {
            model_name: m.name.clone(),
            parent_digest,
            producer: m.producer.clone(),
            properties: props.iter().cloned().collect(),
        })
    }

    fn parameters(&mut self, recs: &[ParamRec]) -> Result<Vec<Parameter>, FormatError> {
        if recs.len() > self.limits.max_parameters {
            let (n, max) = (recs.len() as u64, self.limits.max_parameters as u64);
            return Err(FormatError::limit("number of parameters", n, max));
        }
        let mut seen = HashSet::new();
        let mut out = Vec::with_capacity(recs.len());
        for (i, p) in recs.iter().enumerate() {
            self.check_string(&p.name, &format!("parameter {i}"))?;
            let loc = format!("parameter `{}`", p.name);
            if !seen.insert(p.name.as_str()) {
                return Err(FormatError::invalid(loc, "is declared twice"));
            }
            out.push(self.parameter(p, &loc)?);
        }
        Ok(out)
    }

    fn parameter(&mut self, p: &ParamRec, loc: &str) -> Result<Parameter, FormatError> {
        let dtype = self.dtype(&p.dtype, loc)?;
        let dims: Vec<DimRec> = p.shape.iter().map(|&d| DimRec::Fixed(d)).collect();
        let shape = Shape(self.dims(&dims, loc)?);
        let elements = self.elements(&shape, loc)?;
        let bytes = self.take_data(p.data, elements * dtype.size_bytes() as u64, loc)?;
        let buffer = Buffer::from_le_bytes(dtype, bytes)
            .ok_or_else(|| FormatError::invalid(loc, "bool data holds a byte other than 0 or 1"))?;
        let shape = shape
            .as_fixed()
            .expect("parameter shapes have no batch dimension");
        let data = TensorData::new(shape, buffer)
            .ok_or_else(|| FormatError::invalid(loc, "element count does not match the shape"))?;
        Ok(Parameter {
            name: p.name.clone(),
            data,
            trainable: p.trainable,
        })
    }

    /// Decodes and verifies one graph (an entry point, or a graph nested
    /// in a node, such as a loop body, at `depth` > 0).
    pub(crate) fn graph(
        &mut self,
        rec: &GraphRec,
        loc: &str,
        depth: usize,
    ) -> Result<Graph, FormatError> {
        self.graphs += 1;
        if self.graphs > self.limits.max_graphs {
            let (n, max) = (self.graphs as u64, self.limits.max_graphs as u64);
            return Err(FormatError::limit("number of graphs", n, max));
        }
        if rec.nodes.len() > self.limits.max_nodes_per_graph {
            let (n, max) = (
                rec.nodes.len() as u64,
                self.limits.max_nodes_per_graph as u64,
            );
            return Err(FormatError::limit(
                format!("{loc}: number of nodes"),
                n,
                max,
            ));
        }
        let mut nodes = Vec::with_capacity(rec.nodes.len());
        for (i, n) in rec.nodes.iter().enumerate() {
            let node_loc = format!("{loc}, node {i}");
            let op = ops::decode_op(n, self, &node_loc, depth)?;
            let ty = self.tensor_type(&n.ty, &node_loc)?;
            let inputs = n.inputs.iter().map(|&v| ValueId(v)).collect();
            nodes.push(Node { op, inputs, ty });
        }
        // Graph inputs are not stored: they are the input nodes, in order.
        let inputs = nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| matches!(n.op, Op::Input { .. }))
            .map(|(i, _)| ValueId(i as u32))
            .collect();
        let mut outputs = Vec::with_capacity(rec.outputs.len());
        for out in &rec.outputs {
            self.check_string(&out.name, &format!("{loc}: output name"))?;
            outputs.push((out.name.clone(), ValueId(out.value)));
        }
        Graph::from_parts(nodes, inputs, outputs).map_err(|source| FormatError::Graph {
            location: loc.to_string(),
            source,
        })
    }

    pub(crate) fn check_string(&self, s: &str, loc: &str) -> Result<(), FormatError> {
        let max = self.limits.max_string_bytes;
        if s.len() > max {
            return Err(FormatError::limit(
                format!("{loc}: string length in bytes"),
                s.len() as u64,
                max as u64,
            ));
        }
        Ok(())
    }

    pub(crate) fn dtype(&self, name: &str, loc: &str) -> Result<DType, FormatError> {
        DType::from_name(name).ok_or_else(|| {
            let shown: String = name.chars().take(32).collect();
            FormatError::invalid(
                loc,
                format!("invalid dtype `{shown}` (expected f32, i64, i32 or bool)"),
            )
        })
    }

    pub(crate) fn dims(&self, shape: &[DimRec], loc: &str) -> Result<Vec<Dim>, FormatError> {
        let max_rank = self.limits.max_rank;
        if shape.len() > max_rank {
            return Err(FormatError::limit(
                format!("{loc}: rank"),
                shape.len() as u64,
                max_rank as u64,
            ));
        }
        let max = self.limits.max_dim;
        shape
            .iter()
            .map(|d| match *d {
                DimRec::Fixed(n) if n > max => Err(FormatError::invalid(
                    loc,
                    format!("dimension {n} exceeds the limit of {max}"),
                )),
                DimRec::Fixed(n) => Ok(Dim::Fixed(n as usize)),
                DimRec::Batch => Ok(Dim::Batch),
            })
            .collect()
    }

    /// A value's type, with its static element count capped so that no
    /// later product over its shape can overflow.
    pub(crate) fn tensor_type(&self, t: &TypeRec, loc: &str) -> Result<TensorType, FormatError> {
        let dtype = self.dtype(&t.dtype, loc)?;
        let shape = Shape(self.dims(&t.shape, loc)?);
        self.elements(&shape, loc)?;
        Ok(TensorType::new(dtype, shape))
    }

    /// Elements of the fixed dimensions of `shape`, within the limit.
    fn elements(&self, shape: &Shape, loc: &str) -> Result<u64, FormatError> {
        // Saturating: an overflowing product exceeds any limit, yet a zero
        // dimension still makes the count zero.
        let count = shape
            .dims()
            .iter()
            .filter_map(|d| d.fixed())
            .fold(1u64, |acc, d| acc.saturating_mul(d as u64));
        let max = self.limits.max_tensor_elements;
        if count > max {
            return Err(FormatError::limit(
                format!("{loc}: element count of {shape}"),
                count,
                max,
            ));
        }
        Ok(count)
    }

    /// The bytes of the next tensor. Tensors are packed in reading order,
    /// each at the first 64-aligned offset after the previous one, so a
    /// range is checked against exactly one legal position.
    pub(crate) fn take_data(
        &mut self,
        r: DataRef,
        want: u64,
        loc: &str,
    ) -> Result<&'b [u8], FormatError> {
        let err = |cause: String| FormatError::invalid(loc, cause);
        if r.bytes != want {
            return Err(err(format!(
                "data holds {} bytes, but its dtype and shape need {want}",
                r.bytes
            )));
        }
        if !r.offset.is_multiple_of(ALIGN as u64) {
            return Err(err(format!(
                "data offset {} is not aligned to {ALIGN} bytes",
                r.offset
            )));
        }
        let len = self.data.len();
        let end = r.offset.checked_add(r.bytes).filter(|&e| e <= len as u64);
        let Some(end) = end else {
            let shown = r.offset.saturating_add(r.bytes);
            return Err(err(format!(
                "data range {}..{shown} exceeds the data section of {len} bytes",
                r.offset
            )));
        };
        let (start, end) = (r.offset as usize, end as usize);
        let expected = align(self.end);
        if start < expected {
            return Err(err(format!(
                "data range {start}..{end} overlaps the previous tensor, which ends at {}",
                self.end
            )));
        }
        if start > expected {
            return Err(err(format!(
                "data range {start}..{end} leaves a gap: tensors are packed in order and this one must start at {expected}"
            )));
        }
        check_zero(&self.data[self.end..start], "data section")?;
        self.end = end;
        Ok(&self.data[start..end])
    }

    /// Every byte of the data section must belong to a tensor or to the
    /// zero padding after one.
    fn finish(&self) -> Result<(), FormatError> {
        let (len, expected) = (self.data.len(), align(self.end));
        if len != expected {
            return Err(FormatError::invalid(
                "data section",
                format!(
                    "is {len} bytes, but its tensors end at {} ({expected} with padding)",
                    self.end
                ),
            ));
        }
        check_zero(&self.data[self.end..], "data section")
    }
}

/// Names must be strictly increasing: the writer emits maps sorted, and a
/// repeated name is ambiguous.
fn check_sorted<'a>(
    mut names: impl Iterator<Item = &'a str>,
    what: &str,
    loc: &str,
) -> Result<(), FormatError> {
    let Some(mut prev) = names.next() else {
        return Ok(());
    };
    for name in names {
        if name == prev {
            let shown: String = name.chars().take(64).collect();
            return Err(FormatError::invalid(
                loc,
                format!("{what} `{shown}` is declared twice"),
            ));
        }
        if name < prev {
            return Err(FormatError::NonCanonical(format!(
                "{what}s must be sorted by name"
            )));
        }
        prev = name;
    }
    Ok(())
}

fn parse_digest(h: &str) -> Option<[u8; 32]> {
    hex::decode(h)?.try_into().ok()
}
