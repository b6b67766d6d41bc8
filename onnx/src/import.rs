//! Lowering a validated [`ModelProto`]'s main graph to a canopy-ir [`Graph`].
//!
//! Values are looked up by their ONNX names. Initializers and Constant
//! outputs stay known constants until a node reads them as a graph value,
//! so a Reshape's target shape or a Squeeze's axes are read at import time
//! and never become nodes.

use std::collections::{HashMap, HashSet};

use canopy_ir::model::PARAM_PREFIX;
use canopy_ir::{DType, Dim, Graph, IrError, Shape, TensorData, TensorType, ValueId};

use crate::decode::{dtype_of, tensor_data, unsupported_data_type, validate_model};
use crate::error::OnnxError;
use crate::limits::Limits;
use crate::ops::ml::{ML_DOMAIN, ML_MAX_OPSET, ML_MIN_OPSET};
use crate::proto::tensor_shape_proto::dimension;
use crate::proto::{GraphProto, ModelProto, NodeProto, ValueInfoProto, data_type, type_proto};

/// The default-domain opsets import supports: 13 is the first with
/// Squeeze/Unsqueeze axes as inputs and the single-axis Softmax; 21 is what
/// current exporters (skl2onnx 1.20, torch.onnx) write.
pub const MIN_OPSET: i64 = 13;
pub const MAX_OPSET: i64 = 21;

/// An imported model: the graph, plus every initializer by name.
#[derive(Clone, Debug, PartialEq)]
pub struct ImportedModel {
    pub graph: Graph,
    /// Every initializer of the main graph by name (a subgraph's own are
    /// constants of its body), then the float tensors import made from
    /// node attributes (an `ai.onnx.ml` LinearClassifier's coefficients
    /// and intercepts, as `NODE.coefficients` and `NODE.intercepts`).
    pub initializers: Vec<(String, TensorData)>,
    /// With [`ImportOptions::parameters`], the float initializers and
    /// attribute tensors the graph reads as `params/NAME` inputs, in the
    /// order they were made.
    pub parameters: Vec<String>,
}

/// How import treats initializers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ImportOptions {
    /// Float initializers the graph reads as values become `params/NAME`
    /// inputs (a Canopy model's parameters), so the model can be trained;
    /// otherwise every initializer is a constant. Initializers read only
    /// for their contents (a Reshape's shape) stay constants either way.
    pub parameters: bool,
}

/// Imports the main graph with the default [`Limits`].
pub fn import(model: &ModelProto) -> Result<Graph, OnnxError> {
    import_model(model, &Limits::default()).map(|imported| imported.graph)
}

/// Validates `model` against `limits` (as [`decode_model`](crate::decode_model)
/// does) and lowers its main graph.
pub fn import_model(model: &ModelProto, limits: &Limits) -> Result<ImportedModel, OnnxError> {
    import_model_with(model, limits, ImportOptions::default())
}

/// [`import_model`] with [`ImportOptions`].
pub fn import_model_with(
    model: &ModelProto,
    limits: &Limits,
    options: ImportOptions,
) -> Result<ImportedModel, OnnxError> {
    validate_model(model, limits)?;
    let graph = model.graph.as_ref().ok_or(OnnxError::MissingGraph)?;
    let mut importer = Importer::new(model, limits, options)?;
    let mut initializers = importer.define_initializers(graph)?;
    importer.define_inputs(graph)?;
    for (index, node) in graph.node.iter().enumerate() {
        importer.lower_node(index, node)?;
    }
    importer.set_outputs(graph)?;
    initializers.append(&mut importer.attribute_tensors);
    Ok(ImportedModel {
        graph: importer.graph,
        initializers,
        parameters: importer.parameters,
    })
}

fn is_default_domain(domain: &str) -> bool {
    domain.is_empty() || domain == "ai.onnx"
}

/// The one version the model imports a domain at (`None` when it does not
/// import it), or the first two versions when it imports two. Duplicate
/// entries at the same version are tolerated (skl2onnx writes them).
fn opset_version(
    model: &ModelProto,
    in_domain: impl Fn(&str) -> bool,
) -> Result<Option<i64>, [i64; 2]> {
    let mut found: Option<i64> = None;
    for entry in model.opset_import.iter().filter(|e| in_domain(&e.domain)) {
        match found {
            Some(first) if first != entry.version => return Err([first, entry.version]),
            _ => found = Some(entry.version),
        }
    }
    Ok(found)
}

/// The one default-domain opset version the model imports.
fn default_opset(model: &ModelProto) -> Result<i64, OnnxError> {
    let found = opset_version(model, is_default_domain)
        .map_err(|[first, second]| OnnxError::ConflictingOpset { first, second })?;
    let version = found.ok_or(OnnxError::MissingDefaultOpset)?;
    if !(MIN_OPSET..=MAX_OPSET).contains(&version) {
        return Err(OnnxError::UnsupportedOpset {
            version,
            min: MIN_OPSET,
            max: MAX_OPSET,
        });
    }
    Ok(version)
}

/// What an ONNX name is bound to.
#[derive(Clone, Debug)]
pub(crate) struct Binding {
    /// Who defined it, for duplicate-name errors.
    origin: String,
    /// The graph value, once one exists (in the graph of the scope that
    /// holds the binding).
    value: Option<ValueId>,
    /// Where the contents are when the value is a known constant: the
    /// level of the scope that holds them (0 is the main graph) and their
    /// index in its constants.
    constant: Option<(usize, usize)>,
}

/// A graph being lowered: the main graph, or a body or branch (an ONNX
/// subgraph) one level down from the scope around it.
#[derive(Default)]
pub(crate) struct Scope {
    graph: Graph,
    values: HashMap<String, Binding>,
    constants: Vec<TensorData>,
    /// The enclosing scope's values this one reads, which become its last
    /// inputs (a body's constants, a branch's operands): the ONNX name and
    /// the value in the enclosing scope, in the order first read.
    captures: Vec<(String, ValueId)>,
    /// Where the scope is, for error messages: "" for the main graph, " in
    /// the body of node …" for a subgraph.
    within: String,
}

/// A body or branch lowered by [`Importer::lower_body`].
pub(crate) struct Body<T> {
    pub(crate) graph: Graph,
    /// The enclosing scope's values it reads, after its declared inputs:
    /// (ONNX name, value in the enclosing scope).
    pub(crate) captures: Vec<(String, ValueId)>,
    /// What the caller's `finish` returned.
    pub(crate) result: T,
}

/// How a body or branch starts.
pub(crate) struct BodySpec<'g> {
    pub(crate) graph: &'g GraphProto,
    /// "the body of node …", for its nodes' error messages.
    pub(crate) role: String,
    /// Inputs it declares, in order: the ONNX name and the type.
    pub(crate) inputs: Vec<(String, TensorType)>,
    /// Names bound to a known constant rather than an input (a Loop
    /// body's condition, true whenever the body runs).
    pub(crate) constants: Vec<(String, TensorData)>,
    /// Values of the enclosing scope it reads before any other, as its
    /// first inputs after the declared ones (an If's else branch reads
    /// what its then branch read, so both take the same operands).
    pub(crate) captured: Vec<(String, ValueId)>,
}

pub(crate) struct Importer<'a> {
    /// The graph of the scope being lowered.
    pub(crate) graph: Graph,
    pub(crate) opset: i64,
    model: &'a ModelProto,
    pub(crate) limits: &'a Limits,
    values: HashMap<String, Binding>,
    constants: Vec<TensorData>,
    /// The scope being lowered reads these from the one around it.
    captures: Vec<(String, ValueId)>,
    within: String,
    /// The scopes around the one being lowered, the main graph first.
    outer: Vec<Scope>,
    options: ImportOptions,
    initializer_names: HashSet<String>,
    parameters: Vec<String>,
    /// Float tensors made from node attributes, by their given names.
    attribute_tensors: Vec<(String, TensorData)>,
}

impl<'a> Importer<'a> {
    fn new(
        model: &'a ModelProto,
        limits: &'a Limits,
        options: ImportOptions,
    ) -> Result<Self, OnnxError> {
        Ok(Importer {
            graph: Graph::new(),
            opset: default_opset(model)?,
            model,
            limits,
            values: HashMap::new(),
            constants: Vec::new(),
            captures: Vec::new(),
            within: String::new(),
            outer: Vec::new(),
            options,
            initializer_names: HashSet::new(),
            parameters: Vec::new(),
            attribute_tensors: Vec::new(),
        })
    }
}

impl Importer<'_> {
    /// The level of the scope being lowered (0: the main graph).
    fn level(&self) -> usize {
        self.outer.len()
    }

    fn define(&mut self, name: &str, origin: String, binding: Binding) -> Result<(), OnnxError> {
        if name.is_empty() {
            return Err(OnnxError::EmptyName { what: origin });
        }
        if let Some(existing) = self.values.get(name) {
            return Err(OnnxError::DuplicateName {
                name: name.to_string(),
                first: existing.origin.clone(),
                second: origin,
            });
        }
        self.values.insert(name.to_string(), binding);
        Ok(())
    }

    pub(crate) fn define_value(
        &mut self,
        name: &str,
        origin: String,
        value: ValueId,
    ) -> Result<(), OnnxError> {
        let binding = Binding {
            origin: origin.clone(),
            value: Some(value),
            constant: None,
        };
        self.define(name, origin, binding)
    }

    pub(crate) fn define_constant(
        &mut self,
        name: &str,
        origin: String,
        data: TensorData,
    ) -> Result<(), OnnxError> {
        let binding = Binding {
            origin: origin.clone(),
            value: None,
            constant: Some((self.level(), self.constants.len())),
        };
        self.define(name, origin, binding)?;
        self.constants.push(data);
        Ok(())
    }

    /// Binds `name` to whatever `source` is bound to (Identity, Dropout),
    /// keeping a known constant known. A source of an enclosing scope that
    /// is not a plain constant (a computed value, a parameter) is read
    /// into this scope first.
    pub(crate) fn define_alias(
        &mut self,
        name: &str,
        origin: String,
        source: &str,
        node: &str,
    ) -> Result<(), OnnxError> {
        let (level, found) = self.lookup(source, node)?;
        let mut binding = found.clone();
        if level != self.level()
            && (binding.constant.is_none() || self.is_parameter(source, &binding))
        {
            let value = self.value(source, node)?;
            binding.value = Some(value);
        } else if level != self.level() {
            // A plain constant: this scope makes its own constant node if
            // it reads it as a value.
            binding.value = None;
        }
        binding.origin = origin.clone();
        self.define(name, origin, binding)
    }

    /// The binding of `name` in the innermost scope that has one, with
    /// that scope's level.
    fn lookup(&self, name: &str, node: &str) -> Result<(usize, &Binding), OnnxError> {
        if let Some(binding) = self.values.get(name) {
            return Ok((self.level(), binding));
        }
        self.outer
            .iter()
            .enumerate()
            .rev()
            .find_map(|(level, scope)| scope.values.get(name).map(|b| (level, b)))
            .ok_or_else(|| OnnxError::UndefinedValue {
                node: node.to_string(),
                value: name.to_string(),
            })
    }

    fn constant_at(&self, (level, index): (usize, usize)) -> Option<&TensorData> {
        if level == self.level() {
            self.constants.get(index)
        } else {
            self.outer.get(level)?.constants.get(index)
        }
    }

    /// Whether reading `name`, bound to the known constant `binding`, as a
    /// value makes it a parameter: a float initializer of the main graph,
    /// with [`ImportOptions::parameters`].
    fn is_parameter(&self, name: &str, binding: &Binding) -> bool {
        let Some(at) = binding.constant else {
            return false;
        };
        at.0 == 0
            && self.options.parameters
            && self.initializer_names.contains(name)
            && self
                .constant_at(at)
                .is_some_and(|d| d.dtype() == DType::F32)
    }

    /// The graph value of `name`, adding a constant node the first time a
    /// known constant is read as a value. A name of an enclosing scope is
    /// captured: each scope between it and this one reads it as an input.
    pub(crate) fn value(&mut self, name: &str, node: &str) -> Result<ValueId, OnnxError> {
        let here = self.level();
        let (level, binding) = self.lookup(name, node)?;
        if level < here {
            return self.capture(name, level, node);
        }
        if let Some(value) = binding.value {
            return Ok(value);
        }
        let binding = binding.clone();
        let value = self.materialize(name, &binding, node)?;
        if let Some(binding) = self.values.get_mut(name) {
            binding.value = Some(value);
        }
        Ok(value)
    }

    /// A value in this scope's graph for the known constant `binding`: a
    /// parameter input (see [`Importer::is_parameter`]) or a constant node.
    fn materialize(
        &mut self,
        name: &str,
        binding: &Binding,
        node: &str,
    ) -> Result<ValueId, OnnxError> {
        let data = binding
            .constant
            .and_then(|at| self.constant_at(at))
            .cloned()
            .ok_or_else(|| OnnxError::UndefinedValue {
                node: node.to_string(),
                value: name.to_string(),
            })?;
        if self.is_parameter(name, binding) {
            let ty = TensorType::new(data.dtype(), Shape::fixed(&data.shape));
            self.parameters.push(name.to_string());
            self.graph
                .input(format!("{PARAM_PREFIX}{name}"), ty)
                .map_err(|source| OnnxError::Lowering {
                    node: format!("{node} (parameter `{name}`)"),
                    source,
                })
        } else {
            self.graph
                .constant(data)
                .map_err(|source| OnnxError::Lowering {
                    node: format!("{node} (constant `{name}`)"),
                    source,
                })
        }
    }

    /// Reads `name`, bound at the enclosing scope `level`, into this scope:
    /// its value there, then an input of each scope from there to here.
    fn capture(&mut self, name: &str, level: usize, node: &str) -> Result<ValueId, OnnxError> {
        // Lower the scopes down to `level` one by one, so that the value
        // is made in its own scope's graph by the same code as here.
        let mut lowered = Vec::with_capacity(self.level() - level);
        while self.level() > level {
            lowered.push(self.leave_scope());
        }
        let mut value = self.value(name, node);
        // Every scope is resumed, error or not: the caller leaves them in
        // order.
        while let Some(scope) = lowered.pop() {
            self.enter_scope(scope);
            value = value.and_then(|outer| self.read_outer(name, outer, node));
        }
        value
    }

    /// Makes `outer`, the enclosing scope's value of `name`, an input of
    /// this scope, bound to `name`; returns the input.
    fn read_outer(&mut self, name: &str, outer: ValueId, node: &str) -> Result<ValueId, OnnxError> {
        let enclosing = self.outer.last().expect("a body has an enclosing scope");
        let ty = enclosing.graph.ty(outer).clone();
        // A known constant stays known (a Reshape's shape read in a body).
        let constant = enclosing.values.get(name).and_then(|b| b.constant);
        let input =
            self.graph
                .input(name.to_string(), ty)
                .map_err(|source| OnnxError::Lowering {
                    node: format!("{node} (reading `{name}` from the enclosing graph)"),
                    source,
                })?;
        self.captures.push((name.to_string(), outer));
        let binding = Binding {
            origin: format!("the enclosing graph's `{name}`"),
            value: Some(input),
            constant,
        };
        self.values.insert(name.to_string(), binding);
        Ok(input)
    }

    /// Saves the scope being lowered and starts a new, empty one inside it.
    fn push_scope(&mut self, within: String) {
        let scope = Scope {
            graph: std::mem::take(&mut self.graph),
            values: std::mem::take(&mut self.values),
            constants: std::mem::take(&mut self.constants),
            captures: std::mem::take(&mut self.captures),
            within: std::mem::replace(&mut self.within, within),
        };
        self.outer.push(scope);
    }

    /// Ends the scope being lowered, resuming the one around it; returns
    /// the ended one.
    fn leave_scope(&mut self) -> Scope {
        let enclosing = self.outer.pop().expect("leave_scope follows push_scope");
        self.swap_scope(enclosing)
    }

    /// Resumes `scope`, one level inside the scope being lowered.
    fn enter_scope(&mut self, scope: Scope) {
        self.push_scope(String::new());
        let placeholder = self.swap_scope(scope);
        debug_assert!(placeholder.graph.is_empty());
    }

    /// Makes `scope` the one being lowered; returns the one that was.
    fn swap_scope(&mut self, mut scope: Scope) -> Scope {
        std::mem::swap(&mut self.graph, &mut scope.graph);
        std::mem::swap(&mut self.values, &mut scope.values);
        std::mem::swap(&mut self.constants, &mut scope.constants);
        std::mem::swap(&mut self.captures, &mut scope.captures);
        std::mem::swap(&mut self.within, &mut scope.within);
        scope
    }

    /// Lowers the subgraph `spec.graph` one scope down: its declared
    /// inputs, its initializers (constants of its own) and its nodes. A
    /// name it reads but does not define is read from the enclosing scopes
    /// ([`Importer::value`]). Then `finish` runs inside it and sets its
    /// outputs, so it can shape them (a Loop adds its trip counter).
    pub(crate) fn lower_body<T>(
        &mut self,
        spec: BodySpec<'_>,
        node: &str,
        finish: impl FnOnce(&mut Self) -> Result<T, OnnxError>,
    ) -> Result<Body<T>, OnnxError> {
        if self.level() + 1 > self.limits.graph_depth() {
            return Err(OnnxError::limit(
                format!("levels of nested graphs at {node}"),
                self.level() + 1,
                self.limits.graph_depth(),
            ));
        }
        self.push_scope(format!(" in {}", spec.role));
        let result = self.lower_body_inside(&spec, finish);
        let body = self.leave_scope();
        Ok(Body {
            graph: body.graph,
            captures: body.captures,
            result: result?,
        })
    }

    fn lower_body_inside<T>(
        &mut self,
        spec: &BodySpec<'_>,
        finish: impl FnOnce(&mut Self) -> Result<T, OnnxError>,
    ) -> Result<T, OnnxError> {
        let role = &spec.role;
        for (name, outer) in &spec.captured {
            self.read_outer(name, *outer, role)?;
        }
        for (name, ty) in &spec.inputs {
            let origin = format!("input `{name}` of {role}");
            let value = self
                .graph
                .input(name.clone(), ty.clone())
                .map_err(|source| OnnxError::Lowering {
                    node: origin.clone(),
                    source,
                })?;
            self.define_value(name, origin, value)?;
        }
        for (name, data) in &spec.constants {
            self.define_constant(name, format!("input `{name}` of {role}"), data.clone())?;
        }
        for tensor in &spec.graph.initializer {
            if tensor.name.is_empty() {
                return Err(OnnxError::EmptyName {
                    what: format!("an initializer of {role}"),
                });
            }
            let data = tensor_data(tensor, &tensor.name, self.limits)?;
            let origin = format!("initializer `{}` of {role}", tensor.name);
            self.define_constant(&tensor.name, origin, data)?;
        }
        for (index, node) in spec.graph.node.iter().enumerate() {
            self.lower_node(index, node)?;
        }
        finish(self)
    }

    /// The values of a subgraph's outputs `outputs` (its outputs from
    /// position `first` on), as the scope being lowered computes them.
    pub(crate) fn body_outputs(
        &mut self,
        outputs: &[ValueInfoProto],
        first: usize,
        role: &str,
    ) -> Result<Vec<(String, ValueId)>, OnnxError> {
        outputs
            .iter()
            .enumerate()
            .map(|(position, info)| {
                let what = format!("output {} of {role}", first + position);
                if info.name.is_empty() {
                    return Err(OnnxError::EmptyName { what });
                }
                let value = self.value(&info.name, &what)?;
                check_declared_dtype(info, self.graph.ty(value).dtype)?;
                Ok((info.name.clone(), value))
            })
            .collect()
    }

    /// The contents of `name` when it is a known constant.
    pub(crate) fn constant(
        &self,
        name: &str,
        node: &str,
    ) -> Result<Option<&TensorData>, OnnxError> {
        let (_, binding) = self.lookup(name, node)?;
        Ok(binding.constant.and_then(|at| self.constant_at(at)))
    }

    /// The graph value of a float tensor a node holds as an attribute (an
    /// `ai.onnx.ml` LinearClassifier's coefficients), named `name`: it is
    /// bound and read like an initializer, so with
    /// [`ImportOptions::parameters`] it is the trainable `params/NAME` and
    /// the model can be fine-tuned, and it is listed with the initializers.
    pub(crate) fn attribute_tensor(
        &mut self,
        name: &str,
        data: TensorData,
        node: &str,
    ) -> Result<ValueId, OnnxError> {
        let origin = format!("an attribute of {node}");
        self.define_constant(name, origin, data.clone())?;
        if self.level() == 0 {
            self.initializer_names.insert(name.to_string());
        }
        self.attribute_tensors.push((name.to_string(), data));
        self.value(name, node)
    }

    pub(crate) fn ty(&self, value: ValueId) -> &TensorType {
        self.graph.ty(value)
    }

    fn define_initializers(
        &mut self,
        graph: &GraphProto,
    ) -> Result<Vec<(String, TensorData)>, OnnxError> {
        let mut initializers = Vec::with_capacity(graph.initializer.len());
        for tensor in &graph.initializer {
            if tensor.name.is_empty() {
                return Err(OnnxError::EmptyName {
                    what: "an initializer".to_string(),
                });
            }
            let data = tensor_data(tensor, &tensor.name, self.limits)?;
            let origin = format!("initializer `{}`", tensor.name);
            self.define_constant(&tensor.name, origin, data.clone())?;
            self.initializer_names.insert(tensor.name.clone());
            initializers.push((tensor.name.clone(), data));
        }
        Ok(initializers)
    }

    /// Graph inputs that are not initializers become `Graph::input`s. An
    /// input that shares an initializer's name only gives the initializer
    /// an overridable default in ONNX; import keeps it a constant.
    fn define_inputs(&mut self, graph: &GraphProto) -> Result<(), OnnxError> {
        let initializer_names: HashSet<&str> =
            graph.initializer.iter().map(|t| t.name.as_str()).collect();
        for info in &graph.input {
            if info.name.is_empty() {
                return Err(OnnxError::EmptyName {
                    what: "a graph input".to_string(),
                });
            }
            if initializer_names.contains(info.name.as_str()) {
                continue;
            }
            let ty = input_type(info)?;
            let value = self.graph.input(info.name.clone(), ty).map_err(|source| {
                OnnxError::InvalidGraphInput {
                    input: info.name.clone(),
                    cause: source.to_string(),
                }
            })?;
            self.define_value(&info.name, format!("graph input `{}`", info.name), value)?;
        }
        Ok(())
    }

    fn set_outputs(&mut self, graph: &GraphProto) -> Result<(), OnnxError> {
        for info in &graph.output {
            if info.name.is_empty() {
                return Err(OnnxError::EmptyName {
                    what: "a graph output".to_string(),
                });
            }
            if !self.values.contains_key(&info.name) {
                return Err(OnnxError::UndefinedOutput {
                    output: info.name.clone(),
                });
            }
            let value = self.value(&info.name, &format!("graph output `{}`", info.name))?;
            check_declared_dtype(info, self.graph.ty(value).dtype)?;
            self.graph
                .set_output(info.name.clone(), value)
                .map_err(|source: IrError| OnnxError::Output {
                    output: info.name.clone(),
                    source,
                })?;
        }
        Ok(())
    }

    /// The opset a node of `domain` is read under, for error messages.
    pub(crate) fn opset_of(&self, domain: &str) -> String {
        self.model
            .opset_import
            .iter()
            .find(|entry| entry.domain == domain)
            .map_or_else(
                || "not imported".to_string(),
                |entry| entry.version.to_string(),
            )
    }

    pub(crate) fn lower_node(&mut self, index: usize, node: &NodeProto) -> Result<(), OnnxError> {
        let describe = format!("{}{}", describe_node(index, node), self.within);
        if is_default_domain(&node.domain) {
            return crate::ops::lower(self, node, &describe);
        }
        if node.domain == ML_DOMAIN {
            let opset = self.ml_opset(node, &describe)?;
            return crate::ops::ml::lower(self, node, &describe, opset);
        }
        Err(OnnxError::UnsupportedDomain {
            node: describe,
            op_type: node.op_type.clone(),
            domain: node.domain.clone(),
            opset: self.opset_of(&node.domain),
        })
    }

    /// The `ai.onnx.ml` opset an ml node is read under: the model must
    /// import that domain at one version in the supported range. Checked
    /// at the first ml node, so a model that only declares the domain
    /// imports whatever version it names.
    fn ml_opset(&self, node: &NodeProto, describe: &str) -> Result<i64, OnnxError> {
        let refuse = |found: String| OnnxError::UnsupportedDomainOpset {
            node: describe.to_string(),
            op_type: node.op_type.clone(),
            domain: ML_DOMAIN.to_string(),
            found,
            min: ML_MIN_OPSET,
            max: ML_MAX_OPSET,
        };
        match opset_version(self.model, |domain| domain == ML_DOMAIN) {
            Ok(Some(version)) if (ML_MIN_OPSET..=ML_MAX_OPSET).contains(&version) => Ok(version),
            Ok(Some(version)) => Err(refuse(format!("opset {version}"))),
            Ok(None) => Err(refuse("no opset for it".to_string())),
            Err([first, second]) => Err(refuse(format!("two opsets, {first} and {second}"))),
        }
    }
}

/// A graph output's declared element type, when it has one, must be the
/// type import computed: a mismatch means a lowering disagrees with the
/// exporter.
fn check_declared_dtype(info: &ValueInfoProto, imported: DType) -> Result<(), OnnxError> {
    let Some(type_proto::Value::TensorType(tensor)) =
        info.r#type.as_ref().and_then(|t| t.value.as_ref())
    else {
        return Ok(());
    };
    if tensor.elem_type == data_type::UNDEFINED || dtype_of(tensor.elem_type) == Some(imported) {
        return Ok(());
    }
    Err(OnnxError::OutputType {
        output: info.name.clone(),
        declared: data_type::name(tensor.elem_type),
        imported,
    })
}

/// "node `name` (OpType, #index)", or without the name when it is empty.
fn describe_node(index: usize, node: &NodeProto) -> String {
    if node.name.is_empty() {
        format!("node #{index} ({})", node.op_type)
    } else {
        format!("node `{}` ({}, #{index})", node.name, node.op_type)
    }
}

/// A graph input's type. The first dimension may be symbolic (a
/// `dim_param`, unknown, or 0): it becomes canopy's batch dimension. Every
/// other dimension must be a positive size.
fn input_type(info: &ValueInfoProto) -> Result<TensorType, OnnxError> {
    let invalid = |cause: String| OnnxError::InvalidGraphInput {
        input: info.name.clone(),
        cause,
    };
    let Some(type_proto::Value::TensorType(tensor)) =
        info.r#type.as_ref().and_then(|t| t.value.as_ref())
    else {
        return Err(invalid("it is not a tensor (or has no type)".to_string()));
    };
    let dtype: DType = dtype_of(tensor.elem_type).ok_or_else(|| {
        let refusal = unsupported_data_type(&info.name, tensor.elem_type);
        invalid(refusal.to_string())
    })?;
    let shape = tensor.shape.as_ref().ok_or_else(|| {
        invalid("it has no shape; import needs the rank and every non-batch size".to_string())
    })?;
    let mut dims = Vec::with_capacity(shape.dim.len());
    for (axis, dim) in shape.dim.iter().enumerate() {
        dims.push(input_dim(axis, dim.value.as_ref()).map_err(invalid)?);
    }
    Ok(TensorType::new(dtype, Shape(dims)))
}

fn input_dim(axis: usize, dim: Option<&dimension::Value>) -> Result<Dim, String> {
    match (axis, dim) {
        (0, None | Some(dimension::Value::DimParam(_)) | Some(dimension::Value::DimValue(0))) => {
            Ok(Dim::Batch)
        }
        (_, Some(dimension::Value::DimValue(size))) if *size > 0 => usize::try_from(*size)
            .map(Dim::Fixed)
            .map_err(|_| format!("dimension {axis} ({size}) does not fit in usize")),
        (_, Some(dimension::Value::DimValue(size))) => Err(format!(
            "dimension {axis} has size {size}; sizes must be positive"
        )),
        (_, Some(dimension::Value::DimParam(param))) => Err(format!(
            "dimension {axis} is symbolic (`{param}`); only the first dimension may be, and it becomes the batch dimension"
        )),
        (_, None) => Err(format!(
            "dimension {axis} is unknown; only the first dimension may be, and it becomes the batch dimension"
        )),
    }
}
