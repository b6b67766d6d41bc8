//! Export: a canopy-ir [`Graph`] (or one entry point of a [`Model`], with
//! its parameters) as an ONNX [`ModelProto`], default domain, opset
//! [`EXPORT_OPSET`], IR version [`EXPORT_IR_VERSION`].
//!
//! The mapping, which callers rely on:
//! - every graph input stays an ONNX graph input of the same name, except
//!   that [`export_model`] binds each `params/NAME` input to the model's
//!   current value of parameter `NAME`, written as an initializer named
//!   `NAME`;
//! - the batch dimension ([`Dim::Batch`]) is the symbolic dimension
//!   [`BATCH_DIM_PARAM`] (`N`) wherever it appears;
//! - constants become initializers;
//! - every graph output keeps its name (an ONNX `Identity` names an output
//!   that is an input, a constant or another output's value).
//!
//! Each IR op is lowered to ONNX ops with the op's IR semantics
//! ([`canopy_ir::Op`]'s doc comments), composed where ONNX opset 17 has no
//! single op for it (`rsqrt`, `square`, both GELUs, `log1p`, `one_hot`,
//! `ne`). Custom gradients are inlined (their forward graph is what they
//! compute). Control flow is ONNX's own, bodies as subgraphs
//! (`export/control.rs`): `scan` → `Scan`, `cond` → `If`, `while_loop` →
//! `Loop`. Ops with no exact ONNX form (`random_uniform`: ONNX's
//! generator is not canopy's; the training-only adjoints `scatter_add`,
//! `conv2d_backward_*`, `max_pool2d_select`/`_backward`,
//! `avg_pool2d_backward`) are refused with an
//! [`OnnxError::ExportUnsupported`] naming the node and op.
//!
//! Known differences from the IR, all outside valid inputs: ONNX `Gather`
//! wraps a negative index where the IR reports an error, and ONNX leaves
//! NaN handling of `ArgMax`, `ReduceMax`, `Max` and `Min` to the runtime.

mod control;
mod lower;

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet};

use canopy_ir::model::PARAM_PREFIX;
use canopy_ir::{Buffer, DType, Dim, Graph, Model, Op, TensorData, TensorType, ValueId};
use prost::Message;

use crate::error::OnnxError;
use crate::proto::tensor_shape_proto::{Dimension, dimension};
use crate::proto::{
    AttributeProto, GraphProto, ModelProto, NodeProto, OperatorSetIdProto, TensorProto,
    TensorShapeProto, TypeProto, ValueInfoProto, attribute_type, data_type, type_proto,
};

/// The default-domain opset every export declares: 14 is the first with
/// `Reshape`'s `allowzero`, and 17 (the last with `ReduceMean`'s and
/// `ReduceMax`'s axes as attributes) is what the ONNX Runtime releases of
/// the last years all run.
pub const EXPORT_OPSET: i64 = 17;
/// ONNX IR version 8 (onnx 1.10+) goes with opset 17.
pub const EXPORT_IR_VERSION: i64 = 8;
/// The `dim_param` the batch dimension becomes.
pub const BATCH_DIM_PARAM: &str = "N";
/// The IR ops export refuses (by [`canopy_ir::Op::name`]): `random_uniform`,
/// whose values ONNX's generator would not reproduce, and the adjoints
/// only training graphs hold. Every other op has a lowering; the tests of
/// this crate and of the ONNX Runtime backend read this list, and
/// `tests/export.rs` checks it both ways: each op listed is refused, each
/// other op exports.
pub const NOT_EXPORTED_OPS: [&str; 7] = [
    "random_uniform",
    "scatter_add",
    "conv2d_backward_input",
    "conv2d_backward_filter",
    "max_pool2d_select",
    "max_pool2d_backward",
    "avg_pool2d_backward",
];

/// What an export writes besides the graph.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportOptions {
    /// `GraphProto.name`.
    pub graph_name: String,
    /// `ModelProto.producer_name` and `producer_version`.
    pub producer_name: String,
    pub producer_version: String,
    /// `ModelProto.doc_string`.
    pub doc_string: String,
}

impl Default for ExportOptions {
    fn default() -> Self {
        ExportOptions {
            graph_name: "canopy".to_string(),
            producer_name: "canopy".to_string(),
            producer_version: env!("CARGO_PKG_VERSION").to_string(),
            doc_string: String::new(),
        }
    }
}

/// Exports `graph`: its inputs stay ONNX inputs, its constants become
/// initializers, its outputs keep their names.
pub fn export_graph(graph: &Graph, options: &ExportOptions) -> Result<ModelProto, OnnxError> {
    export_bound(graph, &BTreeMap::new(), options)
}

/// Exports entry point `entry` of `model` with every `params/NAME` input
/// bound to parameter `NAME`'s current value, an initializer named `NAME`;
/// the other inputs stay ONNX inputs.
pub fn export_model(
    model: &Model,
    entry: &str,
    options: &ExportOptions,
) -> Result<ModelProto, OnnxError> {
    let graph = model.entry(entry).map_err(|source| OnnxError::Export {
        what: format!("entry point `{entry}`"),
        cause: source.to_string(),
        hint: format!(
            "the model has entry points {:?}",
            model.entry_points.keys().collect::<Vec<_>>()
        ),
    })?;
    let mut bound = BTreeMap::new();
    for name in graph.input_names() {
        let Some(parameter_name) = name.strip_prefix(PARAM_PREFIX) else {
            continue;
        };
        let parameter = model
            .parameter(parameter_name)
            .ok_or_else(|| OnnxError::Export {
                what: format!("entry point `{entry}`"),
                cause: format!(
                    "it reads `{name}`, but the model has no parameter `{parameter_name}`"
                ),
                hint: "the model file is inconsistent; `canopy model inspect` lists its parameters"
                    .to_string(),
            })?;
        bound.insert(
            name.to_string(),
            (parameter_name.to_string(), &parameter.data),
        );
    }
    export_bound(graph, &bound, options)
}

/// The bytes of an ONNX file.
pub fn encode(model: &ModelProto) -> Vec<u8> {
    model.encode_to_vec()
}

/// The ONNX element type of `dtype`.
pub fn onnx_data_type(dtype: DType) -> i32 {
    match dtype {
        DType::F32 => data_type::FLOAT,
        DType::I64 => data_type::INT64,
        DType::I32 => data_type::INT32,
        DType::Bool => data_type::BOOL,
    }
}

/// A tensor proto holding `data`, elements in `raw_data` (little-endian,
/// one byte per bool, as ONNX lays them out).
pub fn tensor_proto(name: &str, data: &TensorData) -> TensorProto {
    TensorProto {
        name: name.to_string(),
        dims: data.shape.iter().map(|&d| d as i64).collect(),
        data_type: onnx_data_type(data.dtype()),
        raw_data: data.buffer.to_le_bytes().into(),
        ..Default::default()
    }
}

/// Graph inputs bound to initializers: IR input name → (initializer name,
/// value).
type Bindings<'m> = BTreeMap<String, (String, &'m TensorData)>;

fn export_bound(
    graph: &Graph,
    bound: &Bindings<'_>,
    options: &ExportOptions,
) -> Result<ModelProto, OnnxError> {
    let graph = inline_custom_grads(graph).map_err(|source| OnnxError::Export {
        what: "the graph".to_string(),
        cause: format!("its custom gradients do not inline: {source}"),
        hint: "verify the graph (`canopy model inspect`)".to_string(),
    })?;
    let mut exporter = Exporter::new(&graph, bound)?;
    for (index, node) in graph.nodes().iter().enumerate() {
        let id = ValueId(index as u32);
        match &node.op {
            Op::Input { name } => exporter.bind_input(id, name),
            Op::Constant(data) => exporter.add_initializer(id, data),
            _ => lower::lower(&mut exporter, id)?,
        }
    }
    exporter.name_outputs();
    Ok(exporter.finish(options))
}

/// `graph` with every custom gradient replaced by its forward graph, in
/// loop bodies and branches too; borrowed when there is none.
fn inline_custom_grads(graph: &Graph) -> canopy_ir::IrResult<Cow<'_, Graph>> {
    if canopy_ir::passes::has_custom_grad(graph) {
        canopy_ir::passes::inline_custom_grads(graph).map(Cow::Owned)
    } else {
        Ok(Cow::Borrowed(graph))
    }
}

/// One graph being lowered: the main graph, a body or branch (an ONNX
/// subgraph), or a graph inlined into its enclosing one (a `while_loop`'s
/// condition).
struct Scope<'g> {
    graph: &'g Graph,
    /// The ONNX name of each of its values.
    names: Vec<String>,
    nodes: Vec<NodeProto>,
    /// (control-flow node, result index) → the first `output` node reading
    /// it, whose name the ONNX node's output takes.
    readers: HashMap<(ValueId, usize), ValueId>,
}

impl<'g> Scope<'g> {
    fn new(graph: &'g Graph, names: Vec<String>) -> Self {
        let mut readers = HashMap::new();
        for (index, node) in graph.nodes().iter().enumerate() {
            if let (Op::Output { index: result }, [tuple]) = (&node.op, node.inputs.as_slice()) {
                readers
                    .entry((*tuple, *result))
                    .or_insert(ValueId(index as u32));
            }
        }
        Scope {
            graph,
            names,
            nodes: Vec::new(),
            readers,
        }
    }
}

/// The export of one graph under way. Lowering works on the innermost
/// scope (the graph whose nodes are being lowered); names are unique
/// across all scopes, and every initializer (a body's constants too) is
/// the main graph's, which subgraphs read by name from the outer scope.
pub(crate) struct Exporter<'g> {
    bound: &'g Bindings<'g>,
    used: HashSet<String>,
    initializers: Vec<TensorProto>,
    inputs: Vec<ValueInfoProto>,
    /// See [`Exporter::batch_mask`].
    batch_mask: Option<String>,
    /// The main graph first, then each body or branch being lowered inside
    /// the one before.
    scopes: Vec<Scope<'g>>,
}

impl<'g> Exporter<'g> {
    /// Names every value up front: graph inputs and initializers keep
    /// their names, a node's value takes the name of the first output it
    /// is, and the rest get fresh names. ONNX names are single-assignment,
    /// so an output named like an input or a bound parameter is refused.
    fn new(graph: &'g Graph, bound: &'g Bindings<'g>) -> Result<Self, OnnxError> {
        let mut used = HashSet::new();
        let claim = |name: &str, by: String, used: &mut HashSet<String>| {
            if used.insert(name.to_string()) {
                Ok(())
            } else {
                Err(OnnxError::Export {
                    what: by,
                    cause: format!("the ONNX name `{name}` is already taken"),
                    hint: "ONNX names each value once; rename the graph output (an output may not share a name with an input or a parameter)".to_string(),
                })
            }
        };
        let mut names = vec![String::new(); graph.len()];
        for &input in graph.inputs() {
            let name = graph.input_name(input);
            let onnx_name = match bound.get(name) {
                Some((initializer, _)) => initializer.clone(),
                None => name.to_string(),
            };
            claim(&onnx_name, format!("graph input `{name}`"), &mut used)?;
            names[input.index()] = onnx_name;
        }
        for (output, _) in graph.outputs() {
            claim(output, format!("graph output `{output}`"), &mut used)?;
        }
        let outputs: Vec<(String, ValueId)> = graph.outputs().to_vec();
        name_by_outputs(graph, &mut names, &outputs);
        let mut exporter = Exporter {
            bound,
            used,
            initializers: Vec::new(),
            inputs: Vec::new(),
            batch_mask: None,
            scopes: Vec::new(),
        };
        exporter.name_the_rest(graph, &mut names, "");
        exporter.scopes.push(Scope::new(graph, names));
        Ok(exporter)
    }

    /// Fresh names for the values `names` leaves unnamed, after their op
    /// and index, under `prefix`.
    fn name_the_rest(&mut self, graph: &Graph, names: &mut [String], prefix: &str) {
        for (index, node) in graph.nodes().iter().enumerate() {
            if names[index].is_empty() {
                names[index] = self.fresh(&format!("{prefix}{}_{index}", node.op.name()));
            }
        }
    }

    fn scope(&self) -> &Scope<'g> {
        self.scopes
            .last()
            .expect("the main graph's scope is never left")
    }

    fn scope_mut(&mut self) -> &mut Scope<'g> {
        self.scopes
            .last_mut()
            .expect("the main graph's scope is never left")
    }

    /// A name no other value has, `base` when it is free.
    pub(crate) fn fresh(&mut self, base: &str) -> String {
        let mut name = base.to_string();
        while !self.used.insert(name.clone()) {
            name.push('_');
        }
        name
    }

    /// The graph whose nodes are being lowered.
    pub(crate) fn graph(&self) -> &'g Graph {
        self.scope().graph
    }

    pub(crate) fn name(&self, id: ValueId) -> String {
        self.scope().names[id.index()].clone()
    }

    pub(crate) fn ty(&self, id: ValueId) -> &'g TensorType {
        self.graph().ty(id)
    }

    /// The ONNX name of result `index` of the control-flow node `tuple`:
    /// the name of the first `output` node reading it, or a fresh one
    /// when none does (ONNX still needs a name for it).
    pub(crate) fn result_name(&mut self, tuple: ValueId, index: usize) -> String {
        match self.scope().readers.get(&(tuple, index)) {
            Some(&reader) => self.name(reader),
            None => {
                let base = format!("{}/result{index}", self.name(tuple));
                self.fresh(&base)
            }
        }
    }

    /// Starts lowering `graph` one scope down, its values named under
    /// `base`: `inputs` names its inputs
    /// in order (a subgraph's declared inputs, or values of the enclosing
    /// scope it reads by name), `outputs` its outputs (fresh names the
    /// caller claimed), which the values computed for them take.
    pub(crate) fn enter(
        &mut self,
        graph: &'g Graph,
        base: &str,
        inputs: Vec<String>,
        outputs: &[String],
    ) {
        let mut names = vec![String::new(); graph.len()];
        for (&input, name) in graph.inputs().iter().zip(inputs) {
            names[input.index()] = name;
        }
        let named: Vec<(String, ValueId)> = outputs
            .iter()
            .cloned()
            .zip(graph.outputs().iter().map(|(_, v)| *v))
            .collect();
        name_by_outputs(graph, &mut names, &named);
        self.name_the_rest(graph, &mut names, &format!("{base}/"));
        self.scopes.push(Scope::new(graph, names));
    }

    /// Lowers every node of the innermost scope's graph.
    pub(crate) fn lower_scope(&mut self) -> Result<(), OnnxError> {
        let graph = self.graph();
        for (index, node) in graph.nodes().iter().enumerate() {
            let id = ValueId(index as u32);
            match &node.op {
                Op::Input { .. } => {}
                Op::Constant(data) => self.add_initializer(id, data),
                _ => lower::lower(self, id)?,
            }
        }
        Ok(())
    }

    /// Ends the innermost scope, whose outputs are named `outputs` (an
    /// `Identity` names one whose value is named otherwise); returns its
    /// nodes.
    pub(crate) fn leave(&mut self, outputs: &[String]) -> Vec<NodeProto> {
        let values: Vec<ValueId> = self.graph().outputs().iter().map(|(_, v)| *v).collect();
        for (output, value) in outputs.iter().zip(values) {
            let source = self.name(value);
            if source != *output {
                self.emit("Identity", vec![source], output, Vec::new());
            }
        }
        self.scopes
            .pop()
            .expect("leave follows enter, one level down")
            .nodes
    }

    /// Appends `nodes` (an inlined graph's) to the innermost scope.
    pub(crate) fn extend(&mut self, nodes: Vec<NodeProto>) {
        self.scope_mut().nodes.extend(nodes);
    }

    /// `graph` as an ONNX subgraph named `base` whose inputs are
    /// `declared` and whose values named `inputs` are read as the
    /// graph's inputs, in order (declared ones, and values of the
    /// enclosing scope read by name).
    pub(crate) fn subgraph(
        &mut self,
        graph: &'g Graph,
        base: &str,
        inputs: Vec<String>,
        declared: Vec<ValueInfoProto>,
    ) -> Result<GraphProto, OnnxError> {
        let outputs: Vec<String> = graph
            .outputs()
            .iter()
            .map(|(name, _)| self.fresh(&format!("{base}/{name}")))
            .collect();
        self.enter(graph, base, inputs, &outputs);
        self.lower_scope()?;
        let node = self.leave(&outputs);
        let output = outputs
            .iter()
            .zip(graph.outputs())
            .map(|(name, (_, value))| value_info(name, graph.ty(*value)))
            .collect();
        Ok(GraphProto {
            node,
            name: base.to_string(),
            input: declared,
            output,
            ..Default::default()
        })
    }

    fn bind_input(&mut self, id: ValueId, name: &str) {
        match self.bound.get(name) {
            Some((initializer, data)) => {
                self.initializers.push(tensor_proto(initializer, data));
            }
            None => {
                let info = value_info(&self.name(id), self.graph().ty(id));
                self.inputs.push(info);
            }
        }
    }

    fn add_initializer(&mut self, id: ValueId, data: &TensorData) {
        let tensor = tensor_proto(&self.name(id), data);
        self.initializers.push(tensor);
    }

    /// Adds a node computing `output` from `inputs`.
    pub(crate) fn emit(
        &mut self,
        op_type: &str,
        inputs: Vec<String>,
        output: &str,
        attribute: Vec<AttributeProto>,
    ) {
        self.emit_outputs(op_type, inputs, vec![output.to_string()], attribute);
    }

    /// Adds a node with several outputs, named after its first.
    pub(crate) fn emit_outputs(
        &mut self,
        op_type: &str,
        inputs: Vec<String>,
        outputs: Vec<String>,
        attribute: Vec<AttributeProto>,
    ) {
        let node = node_proto(op_type, inputs, outputs, attribute);
        self.scope_mut().nodes.push(node);
    }

    /// Adds a node with a fresh output named after `base`; returns it.
    pub(crate) fn emit_temp(
        &mut self,
        base: &str,
        op_type: &str,
        inputs: Vec<String>,
        attribute: Vec<AttributeProto>,
    ) -> String {
        let output = self.fresh(&format!("{base}/{op_type}"));
        self.emit(op_type, inputs, &output, attribute);
        output
    }

    /// A fresh initializer holding `data`; returns its name.
    pub(crate) fn constant(&mut self, base: &str, role: &str, data: &TensorData) -> String {
        let name = self.fresh(&format!("{base}/{role}"));
        self.initializers.push(tensor_proto(&name, data));
        name
    }

    pub(crate) fn constant_i64(&mut self, base: &str, role: &str, values: &[i64]) -> String {
        let data = TensorData::new(vec![values.len()], Buffer::I64(values.to_vec()))
            .expect("a vector's shape matches its length");
        self.constant(base, role, &data)
    }

    /// A fresh i64 scalar initializer.
    pub(crate) fn constant_scalar_i64(&mut self, base: &str, role: &str, value: i64) -> String {
        let data = TensorData::new(Vec::new(), Buffer::I64(vec![value]))
            .expect("a scalar holds one element");
        self.constant(base, role, &data)
    }

    pub(crate) fn constant_f32(&mut self, base: &str, role: &str, value: f32) -> String {
        self.constant(base, role, &TensorData::scalar_f32(value))
    }

    /// A `[N]` bool tensor (its values do not matter, only its shape):
    /// `Where(mask, v, v)` gives `v` a batch dimension with ops import
    /// reads back, where `Shape` would need run-time shape arithmetic.
    /// Made once, in the main graph (a body reads it from the outer
    /// scope), from the first main-graph input with the batch dimension
    /// and no empty one: its first element along every other axis.
    pub(crate) fn batch_mask(&mut self, node: ValueId) -> Result<String, OnnxError> {
        if let Some(name) = &self.batch_mask {
            return Ok(name.clone());
        }
        let main = self.scopes[0].graph;
        let carrier = main.inputs().iter().find_map(|&input| {
            let dims = &main.ty(input).shape.0;
            let axis = dims.iter().position(|&d| d == Dim::Batch)?;
            let batches = dims.iter().filter(|&&d| d == Dim::Batch).count();
            (batches == 1 && !dims.contains(&Dim::Fixed(0))).then_some((input, axis, dims.len()))
        });
        let Some((input, batch_axis, rank)) = carrier else {
            return Err(OnnxError::ExportUnsupported {
                node: node.to_string(),
                op: self.graph().node(node).op.name(),
                cause: "it adds the batch dimension, but no graph input has it (once, and no empty dimension)"
                    .to_string(),
                hint: "give the graph an input with the batch dimension".to_string(),
            });
        };
        // Built as a scope of its own, then moved to the main graph's
        // nodes: every scope inside it can read the mask.
        let base = self.fresh("batch_mask");
        self.scopes.push(Scope::new(main, Vec::new()));
        let mut column = self.scopes[0].names[input.index()].clone();
        let others: Vec<i64> = (0..rank as i64)
            .filter(|&a| a != batch_axis as i64)
            .collect();
        if !others.is_empty() {
            let starts = self.constant_i64(&base, "starts", &vec![0; others.len()]);
            let ends = self.constant_i64(&base, "ends", &vec![1; others.len()]);
            let axes = self.constant_i64(&base, "axes", &others);
            column = self.emit_temp(&base, "Slice", vec![column, starts, ends, axes], Vec::new());
        }
        let flat = self.constant_i64(&base, "shape", &[-1]);
        let flat = self.emit_temp(&base, "Reshape", vec![column, flat], Vec::new());
        let to = attr_int("to", i64::from(data_type::BOOL));
        self.emit("Cast", vec![flat], &base, vec![to]);
        let nodes = self.scopes.pop().expect("pushed above").nodes;
        self.scopes[0].nodes.extend(nodes);
        self.batch_mask = Some(base.clone());
        Ok(base)
    }

    /// Outputs whose value is named otherwise (an input, a constant,
    /// another output's value) get an `Identity`.
    fn name_outputs(&mut self) {
        let graph = self.graph();
        for (output, value) in graph.outputs() {
            let source = self.name(*value);
            if source != *output {
                self.emit("Identity", vec![source], output, Vec::new());
            }
        }
    }

    fn finish(mut self, options: &ExportOptions) -> ModelProto {
        let main = self.scopes.pop().expect("the main graph's scope");
        let outputs = main
            .graph
            .outputs()
            .iter()
            .map(|(name, value)| value_info(name, main.graph.ty(*value)))
            .collect();
        let graph = GraphProto {
            node: main.nodes,
            name: options.graph_name.clone(),
            initializer: self.initializers,
            input: self.inputs,
            output: outputs,
            ..Default::default()
        };
        ModelProto {
            ir_version: EXPORT_IR_VERSION,
            producer_name: options.producer_name.clone(),
            producer_version: options.producer_version.clone(),
            doc_string: options.doc_string.clone(),
            graph: Some(graph),
            opset_import: vec![OperatorSetIdProto {
                domain: String::new(),
                version: EXPORT_OPSET,
            }],
            ..Default::default()
        }
    }
}

/// A node, named after its first output.
pub(crate) fn node_proto(
    op_type: &str,
    inputs: Vec<String>,
    outputs: Vec<String>,
    attribute: Vec<AttributeProto>,
) -> NodeProto {
    NodeProto {
        name: outputs.first().cloned().unwrap_or_default(),
        op_type: op_type.to_string(),
        input: inputs,
        output: outputs,
        attribute,
        ..Default::default()
    }
}

/// Names each computed value (not an input or a constant, which are named
/// otherwise) after the first of `outputs` that it is, where `names`
/// leaves it unnamed.
fn name_by_outputs(graph: &Graph, names: &mut [String], outputs: &[(String, ValueId)]) {
    for (output, value) in outputs {
        let computed = !matches!(graph.node(*value).op, Op::Input { .. } | Op::Constant(_));
        if computed && names[value.index()].is_empty() {
            names[value.index()] = output.clone();
        }
    }
}

/// A tensor value info: element type and shape, the batch dimension as
/// [`BATCH_DIM_PARAM`].
pub(crate) fn value_info(name: &str, ty: &TensorType) -> ValueInfoProto {
    let dim = ty
        .shape
        .0
        .iter()
        .map(|d| Dimension {
            value: Some(match d {
                Dim::Fixed(n) => dimension::Value::DimValue(*n as i64),
                Dim::Batch => dimension::Value::DimParam(BATCH_DIM_PARAM.to_string()),
            }),
            denotation: String::new(),
        })
        .collect();
    ValueInfoProto {
        name: name.to_string(),
        r#type: Some(TypeProto {
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type: onnx_data_type(ty.dtype),
                shape: Some(TensorShapeProto { dim }),
            })),
            denotation: String::new(),
        }),
        doc_string: String::new(),
    }
}

pub(crate) fn attr_int(name: &str, i: i64) -> AttributeProto {
    AttributeProto {
        name: name.to_string(),
        r#type: attribute_type::INT,
        i,
        ..Default::default()
    }
}

pub(crate) fn attr_ints(name: &str, ints: &[i64]) -> AttributeProto {
    AttributeProto {
        name: name.to_string(),
        r#type: attribute_type::INTS,
        ints: ints.to_vec(),
        ..Default::default()
    }
}
