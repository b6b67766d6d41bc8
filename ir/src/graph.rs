//! The graph: SSA values, nodes in topological order, named inputs and
//! outputs, and a builder that infers each new node's type as it is added.

use std::collections::BTreeMap;

use crate::data::TensorData;
use crate::error::{IrError, IrResult, node_error};
use crate::infer::infer_type;
use crate::op::{BinaryOp, Conv2dAttrs, Op, Pool2dAttrs, ReduceKind, UnaryOp};
use crate::types::{DType, Dim, TensorType};

/// Upper bound on nodes in one graph. Graph size is attacker-controlled when
/// a graph arrives in a file, so every walk over it is bounded by this.
pub const MAX_NODES: usize = 1 << 20;
/// Upper bound on a tensor's rank.
pub const MAX_RANK: usize = 8;

/// An SSA value: the output of the node with the same index.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ValueId(pub u32);

impl ValueId {
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl std::fmt::Display for ValueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "%{}", self.0)
    }
}

/// One operation applied to earlier values.
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    pub op: Op,
    pub inputs: Vec<ValueId>,
    /// The type of the node's single output.
    pub ty: TensorType,
}

/// A functional graph.
///
/// Architecture invariant: node `i` only reads values `< i`, so the node
/// list is a topological order and every pass is a single forward sweep.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Graph {
    nodes: Vec<Node>,
    inputs: Vec<ValueId>,
    outputs: Vec<(String, ValueId)>,
}

impl Graph {
    pub fn new() -> Graph {
        Graph::default()
    }

    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    pub fn node(&self, id: ValueId) -> &Node {
        &self.nodes[id.index()]
    }

    pub fn ty(&self, id: ValueId) -> &TensorType {
        &self.nodes[id.index()].ty
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Graph inputs in declaration order; each is an `Op::Input` node.
    pub fn inputs(&self) -> &[ValueId] {
        &self.inputs
    }

    pub fn input_name(&self, id: ValueId) -> &str {
        match &self.node(id).op {
            Op::Input { name } => name,
            _ => unreachable!("graph inputs are input nodes"),
        }
    }

    pub fn input_names(&self) -> Vec<&str> {
        self.inputs.iter().map(|&i| self.input_name(i)).collect()
    }

    pub fn find_input(&self, name: &str) -> Option<ValueId> {
        self.inputs
            .iter()
            .copied()
            .find(|&i| self.input_name(i) == name)
    }

    pub fn outputs(&self) -> &[(String, ValueId)] {
        &self.outputs
    }

    pub fn find_output(&self, name: &str) -> Option<ValueId> {
        self.outputs
            .iter()
            .find(|(n, _)| n == name)
            .map(|&(_, v)| v)
    }

    /// Count of nodes per op name, for reports.
    pub fn op_counts(&self) -> BTreeMap<&'static str, usize> {
        let mut counts = BTreeMap::new();
        for node in &self.nodes {
            *counts.entry(node.op.name()).or_default() += 1;
        }
        counts
    }

    /// Declares a named graph input.
    pub fn input(&mut self, name: impl Into<String>, ty: TensorType) -> IrResult<ValueId> {
        let name = name.into();
        if self.find_input(&name).is_some() {
            return Err(IrError::DuplicateInput(name));
        }
        let id = self.push_node(Node {
            op: Op::Input { name },
            inputs: Vec::new(),
            ty,
        })?;
        self.inputs.push(id);
        Ok(id)
    }

    /// Declares (or replaces) a named graph output.
    pub fn set_output(&mut self, name: impl Into<String>, value: ValueId) -> IrResult<()> {
        let name = name.into();
        if value.index() >= self.nodes.len() {
            return Err(IrError::DanglingOutput {
                name,
                value: value.index(),
            });
        }
        match self.outputs.iter_mut().find(|(n, _)| *n == name) {
            Some(slot) => slot.1 = value,
            None => self.outputs.push((name, value)),
        }
        Ok(())
    }

    /// Replaces all outputs at once; names must be distinct.
    /// Linear in the outputs: a file may declare very many.
    pub fn set_outputs(&mut self, outputs: Vec<(String, ValueId)>) -> IrResult<()> {
        let mut names = std::collections::HashSet::with_capacity(outputs.len());
        for (name, value) in &outputs {
            if !names.insert(name.as_str()) {
                return Err(IrError::DuplicateOutput(name.clone()));
            }
            if value.index() >= self.nodes.len() {
                return Err(IrError::DanglingOutput {
                    name: name.clone(),
                    value: value.index(),
                });
            }
        }
        self.outputs = outputs;
        Ok(())
    }

    /// Appends a node after inferring its type; the type check is the
    /// verifier's, so an ill-typed node never enters the graph.
    pub fn push(&mut self, op: Op, inputs: &[ValueId]) -> IrResult<ValueId> {
        let next = ValueId(self.nodes.len() as u32);
        for &input in inputs {
            if input.index() >= self.nodes.len() {
                return Err(node_error(
                    next,
                    op.name(),
                    format!("reads {input}, which is not defined before it"),
                ));
            }
        }
        let ty = self
            .infer(&op, inputs)
            .map_err(|cause| node_error(next, op.name(), cause))?;
        self.push_node(Node {
            op,
            inputs: inputs.to_vec(),
            ty,
        })
    }

    /// The type of `op` applied to `inputs`, which exist; an `output` reads
    /// its type from the control-flow node it projects.
    pub(crate) fn infer(&self, op: &Op, inputs: &[ValueId]) -> Result<TensorType, String> {
        let Op::Output { index } = op else {
            let types: Vec<&TensorType> = inputs.iter().map(|&i| self.ty(i)).collect();
            return infer_type(op, &types);
        };
        let &[tuple] = inputs else {
            return Err(format!("expects 1 input, got {}", inputs.len()));
        };
        let mut results = self.results(tuple)?;
        if *index >= results.len() {
            return Err(format!(
                "reads result {index} of {tuple}, which has {}",
                results.len()
            ));
        }
        Ok(results.swap_remove(*index))
    }

    /// The results' types of the control-flow node `tuple`.
    pub fn results(&self, tuple: ValueId) -> Result<Vec<TensorType>, String> {
        let node = self.node(tuple);
        let types: Vec<&TensorType> = node.inputs.iter().map(|&i| self.ty(i)).collect();
        node.op.results(&types).unwrap_or_else(|| {
            Err(format!(
                "{tuple} ({}) has one result; only a control-flow node is read by `output`",
                node.op.name()
            ))
        })
    }

    /// Appends a control-flow node and one `output` node per result;
    /// returns the outputs.
    pub fn push_tuple(&mut self, op: Op, inputs: &[ValueId]) -> IrResult<Vec<ValueId>> {
        let tuple = self.push(op, inputs)?;
        let results = self.results(tuple).map_err(IrError::Invalid)?;
        results
            .into_iter()
            .enumerate()
            .map(|(index, ty)| {
                self.push_node(Node {
                    op: Op::Output { index },
                    inputs: vec![tuple],
                    ty,
                })
            })
            .collect()
    }

    /// Gives the control-flow node `tuple` a new op that keeps its operands
    /// and its results, adding results after them. Reverse mode uses it to
    /// make a loop save what its backward pass reads: the `output` nodes
    /// already reading it keep their meaning.
    pub(crate) fn extend_tuple(&mut self, tuple: ValueId, op: Op) -> IrResult<()> {
        let old = self.results(tuple).map_err(IrError::Invalid)?;
        let node = self.node(tuple);
        let types: Vec<&TensorType> = node.inputs.iter().map(|&i| self.ty(i)).collect();
        let new = op
            .results(&types)
            .unwrap_or_else(|| Err("is not a control-flow op".into()))
            .map_err(|cause| node_error(tuple, op.name(), cause))?;
        if new.len() < old.len() || new[..old.len()] != old[..] {
            return Err(node_error(
                tuple,
                op.name(),
                "a replacement must keep the node's results, adding only after them",
            ));
        }
        self.nodes[tuple.index()].op = op;
        Ok(())
    }

    /// Appends a node whose type the caller vouches for; used by readers and
    /// transforms that re-verify afterwards.
    pub(crate) fn push_node(&mut self, node: Node) -> IrResult<ValueId> {
        if self.nodes.len() >= MAX_NODES {
            return Err(IrError::LimitExceeded {
                what: "nodes",
                limit: MAX_NODES,
            });
        }
        self.nodes.push(node);
        Ok(ValueId(self.nodes.len() as u32 - 1))
    }

    /// Rebuilds a graph from raw parts and verifies it. This is how readers
    /// and passes construct graphs they did not build node by node.
    pub fn from_parts(
        nodes: Vec<Node>,
        inputs: Vec<ValueId>,
        outputs: Vec<(String, ValueId)>,
    ) -> IrResult<Graph> {
        let graph = Graph {
            nodes,
            inputs,
            outputs,
        };
        crate::verify::verify(&graph)?;
        Ok(graph)
    }

    // ---- builder shorthands -------------------------------------------

    pub fn constant(&mut self, data: TensorData) -> IrResult<ValueId> {
        self.push(Op::Constant(Box::new(data)), &[])
    }

    pub fn scalar(&mut self, value: f32) -> IrResult<ValueId> {
        self.constant(TensorData::scalar_f32(value))
    }

    pub fn unary(&mut self, op: UnaryOp, x: ValueId) -> IrResult<ValueId> {
        self.push(Op::Unary(op), &[x])
    }

    pub fn binary(&mut self, op: BinaryOp, a: ValueId, b: ValueId) -> IrResult<ValueId> {
        self.push(Op::Binary(op), &[a, b])
    }

    pub fn add(&mut self, a: ValueId, b: ValueId) -> IrResult<ValueId> {
        self.binary(BinaryOp::Add, a, b)
    }

    pub fn sub(&mut self, a: ValueId, b: ValueId) -> IrResult<ValueId> {
        self.binary(BinaryOp::Sub, a, b)
    }

    pub fn mul(&mut self, a: ValueId, b: ValueId) -> IrResult<ValueId> {
        self.binary(BinaryOp::Mul, a, b)
    }

    pub fn div(&mut self, a: ValueId, b: ValueId) -> IrResult<ValueId> {
        self.binary(BinaryOp::Div, a, b)
    }

    pub fn neg(&mut self, x: ValueId) -> IrResult<ValueId> {
        self.unary(UnaryOp::Neg, x)
    }

    pub fn exp(&mut self, x: ValueId) -> IrResult<ValueId> {
        self.unary(UnaryOp::Exp, x)
    }

    pub fn log(&mut self, x: ValueId) -> IrResult<ValueId> {
        self.unary(UnaryOp::Log, x)
    }

    pub fn relu(&mut self, x: ValueId) -> IrResult<ValueId> {
        self.unary(UnaryOp::Relu, x)
    }

    /// GELU in the chosen form (see [`GeluApproximation`]).
    pub fn gelu(
        &mut self,
        x: ValueId,
        approximate: crate::op::GeluApproximation,
    ) -> IrResult<ValueId> {
        self.unary(approximate.op(), x)
    }

    /// The newest op-set version any of this graph's ops needs.
    pub fn opset(&self) -> u16 {
        self.nodes().iter().map(|n| n.op.opset()).max().unwrap_or(1)
    }

    pub fn matmul(&mut self, a: ValueId, b: ValueId) -> IrResult<ValueId> {
        self.push(
            Op::MatMul {
                transpose_a: false,
                transpose_b: false,
            },
            &[a, b],
        )
    }

    pub fn matmul_t(
        &mut self,
        a: ValueId,
        b: ValueId,
        transpose_a: bool,
        transpose_b: bool,
    ) -> IrResult<ValueId> {
        self.push(
            Op::MatMul {
                transpose_a,
                transpose_b,
            },
            &[a, b],
        )
    }

    pub fn reduce(
        &mut self,
        kind: ReduceKind,
        x: ValueId,
        axes: &[usize],
        keep_dims: bool,
    ) -> IrResult<ValueId> {
        self.push(
            Op::Reduce {
                kind,
                axes: axes.to_vec(),
                keep_dims,
            },
            &[x],
        )
    }

    pub fn sum(&mut self, x: ValueId, axes: &[usize], keep_dims: bool) -> IrResult<ValueId> {
        self.reduce(ReduceKind::Sum, x, axes, keep_dims)
    }

    pub fn mean(&mut self, x: ValueId, axes: &[usize], keep_dims: bool) -> IrResult<ValueId> {
        self.reduce(ReduceKind::Mean, x, axes, keep_dims)
    }

    /// Sum over every axis to a scalar.
    pub fn sum_all(&mut self, x: ValueId) -> IrResult<ValueId> {
        let axes: Vec<usize> = (0..self.ty(x).rank()).collect();
        self.sum(x, &axes, false)
    }

    pub fn reshape(&mut self, x: ValueId, shape: Vec<Dim>) -> IrResult<ValueId> {
        self.push(Op::Reshape { shape }, &[x])
    }

    pub fn transpose(&mut self, x: ValueId, perm: Vec<usize>) -> IrResult<ValueId> {
        self.push(Op::Transpose { perm }, &[x])
    }

    pub fn broadcast(&mut self, x: ValueId, shape: Vec<Dim>) -> IrResult<ValueId> {
        self.push(Op::Broadcast { shape }, &[x])
    }

    pub fn cast(&mut self, x: ValueId, to: DType) -> IrResult<ValueId> {
        self.push(Op::Cast { to }, &[x])
    }

    pub fn select(&mut self, cond: ValueId, a: ValueId, b: ValueId) -> IrResult<ValueId> {
        self.push(Op::Where, &[cond, a, b])
    }

    pub fn conv2d(&mut self, x: ValueId, w: ValueId, attrs: Conv2dAttrs) -> IrResult<ValueId> {
        self.push(Op::Conv2d(attrs), &[x, w])
    }

    pub fn max_pool2d(&mut self, x: ValueId, attrs: Pool2dAttrs) -> IrResult<ValueId> {
        self.push(Op::MaxPool2d(attrs), &[x])
    }

    pub fn avg_pool2d(&mut self, x: ValueId, attrs: Pool2dAttrs) -> IrResult<ValueId> {
        self.push(Op::AvgPool2d(attrs), &[x])
    }

    pub fn log_softmax(&mut self, x: ValueId, axis: usize) -> IrResult<ValueId> {
        self.push(Op::LogSoftmax { axis }, &[x])
    }

    pub fn softmax(&mut self, x: ValueId, axis: usize) -> IrResult<ValueId> {
        self.push(Op::Softmax { axis }, &[x])
    }

    /// Adds every node of `callee` to this graph, binding its inputs to
    /// `args` in order; returns the values of its outputs in order.
    pub fn inline(&mut self, callee: &Graph, args: &[ValueId]) -> IrResult<Vec<ValueId>> {
        if args.len() != callee.inputs.len() {
            return Err(IrError::Invalid(format!(
                "inlined graph takes {} inputs, got {}",
                callee.inputs.len(),
                args.len()
            )));
        }
        let mut map: Vec<ValueId> = Vec::with_capacity(callee.len());
        let mut next_arg = args.iter();
        for node in &callee.nodes {
            let id = match &node.op {
                Op::Input { .. } => *next_arg.next().expect("arity checked above"),
                op => {
                    let inputs: Vec<ValueId> = node.inputs.iter().map(|i| map[i.index()]).collect();
                    self.push(op.clone(), &inputs)?
                }
            };
            map.push(id);
        }
        Ok(callee.outputs.iter().map(|(_, v)| map[v.index()]).collect())
    }
}
