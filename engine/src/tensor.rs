//! The user-facing `Tensor`: eager by default, traced into IR in graph mode.
//!
//! Model code is written once against `Tensor`. In eager mode each op runs
//! at once on the CPU kernels. Inside a trace (graph mode, or an explicit
//! [`trace`]) the same calls append nodes to a graph instead; eager tensors
//! met during a trace are captured as constants. The switch is one line:
//! `canopy_engine::set_mode(Mode::Graph)`, as with MindSpore's
//! `set_context(mode=…)`.

use std::cell::{Cell, RefCell};
use std::sync::Arc;

use canopy_ir::{
    BinaryOp, Conv2dAttrs, DType, Dim, Graph, Op, Pool2dAttrs, ReduceKind, TensorType, UnaryOp,
    ValueId,
};

use crate::cpu::kernels::{self, Arg};
use crate::error::{EngineError, EngineResult, TraceError};
use crate::value::Value;

/// How [`crate::Function`]s run: op by op, or traced and compiled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Eager,
    Graph,
}

thread_local! {
    static MODE: Cell<Mode> = const { Cell::new(Mode::Eager) };
    static TRACE: RefCell<Option<TraceState>> = const { RefCell::new(None) };
    static NEXT_TRACE_ID: Cell<u64> = const { Cell::new(1) };
}

/// Selects eager or graph mode for this thread.
pub fn set_mode(mode: Mode) {
    MODE.with(|m| m.set(mode));
}

pub fn mode() -> Mode {
    MODE.with(|m| m.get())
}

struct TraceState {
    id: u64,
    graph: Graph,
}

#[derive(Clone, Debug)]
enum Repr {
    Eager(Arc<Value>),
    Traced {
        id: ValueId,
        trace: u64,
        ty: TensorType,
    },
}

/// A tensor: concrete data (eager) or a value of the graph being traced.
#[derive(Clone, Debug)]
pub struct Tensor {
    repr: Repr,
}

impl From<Value> for Tensor {
    fn from(value: Value) -> Tensor {
        Tensor::from_value(value)
    }
}

impl Tensor {
    pub fn from_value(value: Value) -> Tensor {
        Tensor {
            repr: Repr::Eager(Arc::new(value)),
        }
    }

    pub fn from_f32(shape: &[usize], data: Vec<f32>) -> EngineResult<Tensor> {
        Value::f32(shape, data).map(Tensor::from_value)
    }

    pub fn scalar(x: f32) -> Tensor {
        Tensor::from_value(Value::scalar_f32(x))
    }

    /// The tensor's static type (for eager tensors, their concrete shape).
    pub fn ty(&self) -> TensorType {
        match &self.repr {
            Repr::Eager(v) => TensorType::new(v.dtype(), canopy_ir::Shape::fixed(v.shape())),
            Repr::Traced { ty, .. } => ty.clone(),
        }
    }

    pub fn dims(&self) -> Vec<Dim> {
        self.ty().shape.0
    }

    pub fn rank(&self) -> usize {
        self.ty().rank()
    }

    pub fn is_traced(&self) -> bool {
        matches!(self.repr, Repr::Traced { .. })
    }

    /// The concrete value; an error for a traced tensor.
    pub fn value(&self) -> EngineResult<&Value> {
        match &self.repr {
            Repr::Eager(v) => Ok(v),
            Repr::Traced { .. } => Err(EngineError::Trace(TraceError::NoValue)),
        }
    }

    pub fn to_vec_f32(&self) -> EngineResult<Vec<f32>> {
        self.value()?.to_f32_vec()
    }

    /// The graph value of a traced tensor.
    pub fn traced_id(&self) -> Option<ValueId> {
        match self.repr {
            Repr::Traced { id, .. } => Some(id),
            Repr::Eager(_) => None,
        }
    }
}

/// Traces `f` into a graph whose inputs are `inputs` (name, type) and whose
/// outputs are the named tensors `f` returns.
pub fn trace<F>(inputs: &[(&str, TensorType)], f: F) -> EngineResult<Graph>
where
    F: FnOnce(&[Tensor]) -> EngineResult<Vec<(String, Tensor)>>,
{
    let id = NEXT_TRACE_ID.with(|n| {
        let id = n.get();
        n.set(id + 1);
        id
    });
    let previous = TRACE.with(|t| {
        t.borrow_mut().replace(TraceState {
            id,
            graph: Graph::new(),
        })
    });
    let result = trace_body(id, inputs, f);
    let state = TRACE.with(|t| std::mem::replace(&mut *t.borrow_mut(), previous));
    let outputs = result?;
    let mut graph = state.expect("trace state is restored only here").graph;
    graph.set_outputs(outputs)?;
    Ok(graph)
}

fn trace_body<F>(
    trace: u64,
    inputs: &[(&str, TensorType)],
    f: F,
) -> EngineResult<Vec<(String, canopy_ir::ValueId)>>
where
    F: FnOnce(&[Tensor]) -> EngineResult<Vec<(String, Tensor)>>,
{
    let mut args = Vec::with_capacity(inputs.len());
    for (name, ty) in inputs {
        let id = with_graph(|g| Ok(g.input(*name, ty.clone())?))?;
        args.push(Tensor {
            repr: Repr::Traced {
                id,
                trace,
                ty: ty.clone(),
            },
        });
    }
    let outputs = f(&args)?;
    outputs
        .into_iter()
        .map(|(name, t)| Ok((name, graph_value(&t)?)))
        .collect()
}

fn with_graph<T>(f: impl FnOnce(&mut Graph) -> EngineResult<T>) -> EngineResult<T> {
    TRACE.with(|t| match t.borrow_mut().as_mut() {
        Some(state) => f(&mut state.graph),
        None => Err(EngineError::Trace(TraceError::NotTracing)),
    })
}

fn tracing() -> Option<u64> {
    TRACE.with(|t| t.borrow().as_ref().map(|s| s.id))
}

/// The graph value for `t` in the active trace; eager tensors become
/// constants (captured, as in graph mode closures).
fn graph_value(t: &Tensor) -> EngineResult<ValueId> {
    let active = tracing().ok_or(EngineError::Trace(TraceError::NotTracing))?;
    match &t.repr {
        Repr::Traced { id, trace, .. } if *trace == active => Ok(*id),
        Repr::Traced { .. } => Err(EngineError::Trace(TraceError::ForeignTensor)),
        Repr::Eager(v) => with_graph(|g| Ok(g.constant(v.to_data())?)),
    }
}

/// Applies `op` to `inputs`: appends a node while tracing, runs the kernel
/// otherwise. The single dispatch point of every tensor op.
pub fn apply(op: Op, inputs: &[&Tensor]) -> EngineResult<Tensor> {
    if let Some(trace) = tracing() {
        let ids = inputs
            .iter()
            .map(|t| graph_value(t))
            .collect::<EngineResult<Vec<_>>>()?;
        let (id, ty) = with_graph(|g| {
            let id = g.push(op, &ids)?;
            Ok((id, g.ty(id).clone()))
        })?;
        return Ok(Tensor {
            repr: Repr::Traced { id, trace, ty },
        });
    }
    run_eager(op, inputs)
}

/// Applies every node of `graph` to `args` (bound to its inputs in order)
/// and returns its outputs in order: inlined into the active trace, or run
/// op by op when eager. This is how a graph that came from elsewhere (an
/// imported ONNX model) becomes part of a traced model, like a layer.
pub fn call(graph: &Graph, args: &[&Tensor]) -> EngineResult<Vec<Tensor>> {
    if args.len() != graph.inputs().len() {
        return Err(EngineError::Shape(format!(
            "the called graph takes {} inputs ({}), got {}",
            graph.inputs().len(),
            graph.input_names().join(", "),
            args.len()
        )));
    }
    /// Runs the control-flow `node` of `graph` on eager `inputs` on the CPU
    /// backend, its operands typed as `graph` declares them: a loop over
    /// the batch dimension, or a body typed with it, needs the symbolic batch
    /// that eager values (all fixed sizes) no longer show; the executable
    /// binds it from the values.
    fn run_tuple(
        graph: &Graph,
        node: &canopy_ir::Node,
        inputs: &[&Tensor],
    ) -> EngineResult<Vec<Tensor>> {
        let mut one = Graph::new();
        let mut ids = Vec::with_capacity(inputs.len());
        for (k, &operand) in node.inputs.iter().enumerate() {
            ids.push(one.input(format!("operand/{k}"), graph.ty(operand).clone())?);
        }
        let outs = one.push_tuple(node.op.clone(), &ids)?;
        let named = outs
            .iter()
            .enumerate()
            .map(|(k, &v)| (format!("result/{k}"), v));
        one.set_outputs(named.collect())?;
        let values = inputs
            .iter()
            .map(|t| t.value().cloned())
            .collect::<EngineResult<Vec<_>>>()?;
        let mut exe = crate::cpu::CpuExecutable::new(&one)?;
        let results = crate::backend::Executable::run(&mut exe, values)?;
        Ok(results.into_iter().map(Tensor::from_value).collect())
    }

    let mut values: Vec<Tensor> = Vec::with_capacity(graph.len());
    // A control-flow node's results, by node index, for its `output`s.
    let mut tuples: std::collections::HashMap<usize, Vec<Tensor>> =
        std::collections::HashMap::new();
    let mut next_arg = args.iter();
    for (index, node) in graph.nodes().iter().enumerate() {
        let inputs: Vec<&Tensor> = node.inputs.iter().map(|i| &values[i.index()]).collect();
        let value = match &node.op {
            Op::Input { .. } => (*next_arg.next().expect("arity checked above")).clone(),
            Op::Constant(data) if tracing().is_none() => Tensor::from_value(Value::from_data(data)),
            op if op.is_tuple() => {
                // `apply` makes one value per node, which a loop or branch
                // does not have: it is traced (`apply_tuple`) or run as a
                // one-node graph, and its `output`s pick the results. The
                // tuple's own slot holds its first result, which only its
                // `output`s could read.
                let results = match tracing() {
                    Some(_) => apply_tuple(op.clone(), &inputs)?,
                    None => run_tuple(graph, node, &inputs)?,
                };
                let first = results.first().cloned().ok_or_else(|| {
                    EngineError::Internal(format!("control-flow node %{index} has no results"))
                })?;
                tuples.insert(index, results);
                first
            }
            Op::Output { index: result } => {
                let tuple = node.inputs.first().map_or(usize::MAX, |t| t.index());
                tuples
                    .get(&tuple)
                    .and_then(|results| results.get(*result))
                    .cloned()
                    .ok_or_else(|| {
                        EngineError::Internal(format!(
                            "node %{index} reads result {result} of %{tuple}, which is not a control-flow node with that result"
                        ))
                    })?
            }
            op => apply(op.clone(), &inputs)?,
        };
        values.push(value);
    }
    Ok(graph
        .outputs()
        .iter()
        .map(|(_, v)| values[v.index()].clone())
        .collect())
}

fn run_eager(op: Op, inputs: &[&Tensor]) -> EngineResult<Tensor> {
    let values = inputs
        .iter()
        .map(|t| t.value())
        .collect::<EngineResult<Vec<_>>>()?;
    let types: Vec<TensorType> = inputs.iter().map(|t| t.ty()).collect();
    let type_refs: Vec<&TensorType> = types.iter().collect();
    let out_ty = canopy_ir::infer::infer_type(&op, &type_refs)
        .map_err(|cause| EngineError::Shape(format!("eager {}: {cause}", op.name())))?;
    let args = values.into_iter().map(Arg::Shared).collect();
    let value = kernels::eval(&op, args, &out_ty, 1).map_err(|source| EngineError::Kernel {
        node: None,
        op: op.name(),
        operands: types.iter().map(|t| t.shape.resolve(1)).collect(),
        source,
    })?;
    Ok(Tensor::from_value(value))
}

macro_rules! unary_methods {
    ($($name:ident => $op:ident),* $(,)?) => {
        $(pub fn $name(&self) -> EngineResult<Tensor> {
            apply(Op::Unary(UnaryOp::$op), &[self])
        })*
    };
}

macro_rules! binary_methods {
    ($($name:ident => $op:ident),* $(,)?) => {
        $(pub fn $name(&self, other: &Tensor) -> EngineResult<Tensor> {
            apply(Op::Binary(BinaryOp::$op), &[self, other])
        })*
    };
}

impl Tensor {
    unary_methods!(
        neg => Neg, abs => Abs, exp => Exp, log => Log, sqrt => Sqrt, rsqrt => Rsqrt,
        square => Square, relu => Relu, gelu => Gelu, sigmoid => Sigmoid, tanh => Tanh,
        erf => Erf, gelu_erf => GeluErf, softplus => Softplus, log1p => Log1p,
    );

    binary_methods!(
        add => Add, sub => Sub, mul => Mul, div => Div, pow => Pow,
        maximum => Maximum, minimum => Minimum, eq => Eq, lt => Lt, gt => Gt, ge => Ge,
    );

    /// Multiplies by a scalar constant.
    pub fn scale(&self, factor: f32) -> EngineResult<Tensor> {
        self.mul(&Tensor::scalar(factor))
    }

    pub fn matmul(&self, other: &Tensor) -> EngineResult<Tensor> {
        self.matmul_t(other, false, false)
    }

    pub fn matmul_t(&self, other: &Tensor, ta: bool, tb: bool) -> EngineResult<Tensor> {
        apply(
            Op::MatMul {
                transpose_a: ta,
                transpose_b: tb,
            },
            &[self, other],
        )
    }

    fn reduce(&self, kind: ReduceKind, axes: &[usize], keep_dims: bool) -> EngineResult<Tensor> {
        apply(
            Op::Reduce {
                kind,
                axes: axes.to_vec(),
                keep_dims,
            },
            &[self],
        )
    }

    pub fn sum(&self, axes: &[usize], keep_dims: bool) -> EngineResult<Tensor> {
        self.reduce(ReduceKind::Sum, axes, keep_dims)
    }

    pub fn mean(&self, axes: &[usize], keep_dims: bool) -> EngineResult<Tensor> {
        self.reduce(ReduceKind::Mean, axes, keep_dims)
    }

    pub fn max(&self, axes: &[usize], keep_dims: bool) -> EngineResult<Tensor> {
        self.reduce(ReduceKind::Max, axes, keep_dims)
    }

    pub fn sum_all(&self) -> EngineResult<Tensor> {
        let axes: Vec<usize> = (0..self.rank()).collect();
        self.sum(&axes, false)
    }

    pub fn mean_all(&self) -> EngineResult<Tensor> {
        let axes: Vec<usize> = (0..self.rank()).collect();
        self.mean(&axes, false)
    }

    pub fn reshape(&self, shape: Vec<Dim>) -> EngineResult<Tensor> {
        apply(Op::Reshape { shape }, &[self])
    }

    /// Keeps the leading dimension and flattens the rest.
    pub fn flatten(&self) -> EngineResult<Tensor> {
        let dims = self.dims();
        let Some((&lead, rest)) = dims.split_first() else {
            return Err(EngineError::Shape("cannot flatten a scalar".into()));
        };
        let mut count = 1usize;
        for d in rest {
            count *= d.fixed().ok_or_else(|| {
                EngineError::Shape("only the leading dimension may be the batch".into())
            })?;
        }
        self.reshape(vec![lead, Dim::Fixed(count)])
    }

    pub fn transpose(&self, perm: Vec<usize>) -> EngineResult<Tensor> {
        apply(Op::Transpose { perm }, &[self])
    }

    pub fn broadcast_to(&self, shape: Vec<Dim>) -> EngineResult<Tensor> {
        apply(Op::Broadcast { shape }, &[self])
    }

    pub fn cast(&self, to: DType) -> EngineResult<Tensor> {
        apply(Op::Cast { to }, &[self])
    }

    pub fn select(cond: &Tensor, a: &Tensor, b: &Tensor) -> EngineResult<Tensor> {
        apply(Op::Where, &[cond, a, b])
    }

    pub fn conv2d(&self, w: &Tensor, attrs: Conv2dAttrs) -> EngineResult<Tensor> {
        apply(Op::Conv2d(attrs), &[self, w])
    }

    pub fn max_pool2d(&self, attrs: Pool2dAttrs) -> EngineResult<Tensor> {
        apply(Op::MaxPool2d(attrs), &[self])
    }

    pub fn avg_pool2d(&self, attrs: Pool2dAttrs) -> EngineResult<Tensor> {
        apply(Op::AvgPool2d(attrs), &[self])
    }

    pub fn softmax(&self, axis: usize) -> EngineResult<Tensor> {
        apply(Op::Softmax { axis }, &[self])
    }

    pub fn log_softmax(&self, axis: usize) -> EngineResult<Tensor> {
        apply(Op::LogSoftmax { axis }, &[self])
    }

    pub fn gather(&self, indices: &Tensor, axis: usize) -> EngineResult<Tensor> {
        apply(Op::Gather { axis }, &[self, indices])
    }

    pub fn one_hot(&self, depth: usize) -> EngineResult<Tensor> {
        apply(Op::OneHot { depth }, &[self])
    }

    /// The i64 index of the largest element along `axis` ([`Op::ArgMax`]).
    pub fn argmax(&self, axis: usize, keep_dims: bool) -> EngineResult<Tensor> {
        apply(Op::ArgMax { axis, keep_dims }, &[self])
    }

    /// Uniform [0, 1) noise of `shape` from an i64 scalar seed tensor.
    pub fn random_uniform(seed: &Tensor, shape: Vec<Dim>) -> EngineResult<Tensor> {
        apply(Op::RandomUniform { shape }, &[seed])
    }
}

/// How [`scan`] runs its loop: backwards when `reverse`, and what reverse
/// mode saves (see [`canopy_ir::Scan`]'s `checkpoint`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ScanOptions {
    pub reverse: bool,
    pub checkpoint: usize,
}

/// A loop over the leading axis of `xs`, as one `scan` node: `step` maps
/// (carries, one step of each of `xs`, `consts`) to (new carries, per-step
/// outputs). Returns the final carries and the per-step outputs stacked.
///
/// `step` is traced once, into the loop's body, whatever the number of
/// steps; it reads only its arguments (a tensor of the enclosing trace is
/// refused), so weights it uses are passed as `consts`. In eager mode the
/// body runs on the CPU backend.
pub fn scan<F>(
    init: &[Tensor],
    xs: &[Tensor],
    consts: &[Tensor],
    options: ScanOptions,
    step: F,
) -> EngineResult<(Vec<Tensor>, Vec<Tensor>)>
where
    F: FnOnce(&[Tensor], &[Tensor], &[Tensor]) -> EngineResult<(Vec<Tensor>, Vec<Tensor>)>,
{
    let length = match xs.first().map(Tensor::dims) {
        Some(dims) if !dims.is_empty() => dims[0],
        _ => {
            return Err(EngineError::Shape(
                "scan needs at least one scanned input with a leading axis".into(),
            ));
        }
    };
    let mut names = Vec::new();
    let mut types = Vec::new();
    for (k, t) in init.iter().enumerate() {
        names.push(format!("carry/{k}"));
        types.push(t.ty());
    }
    for (k, t) in xs.iter().enumerate() {
        let mut ty = t.ty();
        if ty.shape.0.is_empty() {
            return Err(EngineError::Shape(format!("scanned input {k} is a scalar")));
        }
        ty.shape.0.remove(0);
        names.push(format!("x/{k}"));
        types.push(ty);
    }
    for (k, t) in consts.iter().enumerate() {
        names.push(format!("const/{k}"));
        types.push(t.ty());
    }
    let inputs: Vec<(&str, TensorType)> = names.iter().map(String::as_str).zip(types).collect();
    let carries = init.len();
    let scanned = xs.len();
    let body = trace(&inputs, |args| {
        let (c, rest) = args.split_at(carries);
        let (x, k) = rest.split_at(scanned);
        let (next, ys) = step(c, x, k)?;
        if next.len() != carries {
            return Err(EngineError::Shape(format!(
                "a scan step must return {carries} carries, returned {}",
                next.len()
            )));
        }
        let named_carries = next
            .into_iter()
            .enumerate()
            .map(|(k, t)| (format!("carry/{k}"), t));
        let named_ys = ys
            .into_iter()
            .enumerate()
            .map(|(k, t)| (format!("y/{k}"), t));
        Ok(named_carries.chain(named_ys).collect())
    })?;
    let op = Op::Scan(Box::new(canopy_ir::Scan {
        body,
        carries,
        scanned,
        length,
        reverse: options.reverse,
        checkpoint: options.checkpoint,
    }));
    let operands: Vec<&Tensor> = init.iter().chain(xs).chain(consts).collect();
    let mut results = apply_tuple(op, &operands)?;
    let ys = results.split_off(carries);
    Ok((results, ys))
}

/// Applies a control-flow `op` to `inputs` and returns its results: the
/// node and its `output`s while tracing, a one-node graph run on the CPU
/// backend otherwise.
pub fn apply_tuple(op: Op, inputs: &[&Tensor]) -> EngineResult<Vec<Tensor>> {
    if let Some(trace) = tracing() {
        let ids = inputs
            .iter()
            .map(|t| graph_value(t))
            .collect::<EngineResult<Vec<_>>>()?;
        let outs = with_graph(|g| {
            let outs = g.push_tuple(op, &ids)?;
            Ok(outs
                .into_iter()
                .map(|id| (id, g.ty(id).clone()))
                .collect::<Vec<_>>())
        })?;
        return Ok(outs
            .into_iter()
            .map(|(id, ty)| Tensor {
                repr: Repr::Traced { id, trace, ty },
            })
            .collect());
    }
    let mut graph = Graph::new();
    let mut ids = Vec::with_capacity(inputs.len());
    for (k, t) in inputs.iter().enumerate() {
        ids.push(graph.input(format!("operand/{k}"), t.ty())?);
    }
    let outs = graph.push_tuple(op, &ids)?;
    let named = outs
        .iter()
        .enumerate()
        .map(|(k, &v)| (format!("result/{k}"), v));
    graph.set_outputs(named.collect())?;
    let values = inputs
        .iter()
        .map(|t| t.value().cloned())
        .collect::<EngineResult<Vec<_>>>()?;
    let mut exe = crate::cpu::CpuExecutable::new(&graph)?;
    let results = crate::backend::Executable::run(&mut exe, values)?;
    Ok(results.into_iter().map(Tensor::from_value).collect())
}
