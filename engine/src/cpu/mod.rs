//! The CPU backend: an executor over `ndarray` kernels.
//!
//! Graph mode reuses buffers: the executor computes each value's last use
//! at compile time and hands a value to its last consumer by ownership, so
//! elementwise kernels and in-graph optimizer updates write in place.

mod control;
pub mod kernels;

use canopy_ir::{Dim, Graph, Op, TensorType, ValueId};

use crate::backend::{Backend, Executable, HostResidency};
use crate::error::{EngineError, EngineResult};
use crate::value::Value;
pub use kernels::Arg;

/// The CPU backend. Everything runs on rayon's pool: a large matmul is
/// split in halves under `rayon::join`, each a single-threaded
/// `matrixmultiply` call, and large elementwise and reduction kernels fork
/// there too.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuBackend;

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn compile(&self, graph: &Graph) -> EngineResult<Box<dyn Executable>> {
        Ok(Box::new(CpuExecutable::new(graph)?))
    }
}

/// A graph prepared for repeated execution on the CPU.
pub struct CpuExecutable {
    graph: Graph,
    /// For each node, the index of the last node that reads it, or
    /// `usize::MAX` when it is a graph output.
    last_use: Vec<usize>,
    /// Constants decoded once, at compile time.
    constants: Vec<Option<Value>>,
    input_names: Vec<String>,
    output_names: Vec<String>,
    /// Per-node (total time, runs) when `CANOPY_PROFILE=1`; printed to
    /// stderr by op name when the executable is dropped.
    profile: Option<Vec<(std::time::Duration, u64)>>,
    /// Inputs kept between runs (`Executable::make_resident`).
    residency: HostResidency,
    /// Each control-flow node's graphs, compiled (`Op::subgraphs` order).
    bodies: Vec<Vec<CpuExecutable>>,
    /// Each control-flow node's result types.
    result_types: Vec<Vec<TensorType>>,
    /// For each `output` node: whether it is the last to read its result,
    /// so it may take the value instead of copying it.
    takes_result: Vec<bool>,
}

impl Drop for CpuExecutable {
    fn drop(&mut self) {
        let Some(profile) = &self.profile else {
            return;
        };
        let mut by_op: std::collections::BTreeMap<&str, (std::time::Duration, u64)> =
            Default::default();
        for (node, (time, runs)) in self.graph.nodes().iter().zip(profile) {
            let entry = by_op.entry(node.op.name()).or_default();
            entry.0 += *time;
            entry.1 += runs;
        }
        let total: f64 = by_op.values().map(|(t, _)| t.as_secs_f64()).sum();
        let mut rows: Vec<_> = by_op.into_iter().collect();
        rows.sort_by_key(|row| std::cmp::Reverse(row.1.0));
        eprintln!(
            "canopy profile ({} nodes, {:.3} s in kernels):",
            self.graph.len(),
            total
        );
        for (op, (time, runs)) in rows {
            let secs = time.as_secs_f64();
            eprintln!(
                "  {op:<24} {:>6.1}%  {:>10.1} µs/run-of-node  {runs} runs",
                100.0 * secs / total.max(1e-12),
                1e6 * secs / runs.max(1) as f64
            );
        }
    }
}

impl CpuExecutable {
    pub fn new(graph: &Graph) -> EngineResult<CpuExecutable> {
        canopy_ir::verify::verify(graph)?;
        let graph = canopy_ir::passes::inline_custom_grads(graph)?;
        let mut last_use = vec![0usize; graph.len()];
        for (index, node) in graph.nodes().iter().enumerate() {
            for input in &node.inputs {
                last_use[input.index()] = index;
            }
        }
        for (_, out) in graph.outputs() {
            last_use[out.index()] = usize::MAX;
        }
        let constants = graph
            .nodes()
            .iter()
            .map(|n| match &n.op {
                Op::Constant(data) => Some(Value::from_data(data)),
                _ => None,
            })
            .collect();
        let mut bodies = Vec::with_capacity(graph.len());
        let mut result_types = Vec::with_capacity(graph.len());
        for (index, node) in graph.nodes().iter().enumerate() {
            if !node.op.is_tuple() {
                bodies.push(Vec::new());
                result_types.push(Vec::new());
                continue;
            }
            let compiled = node
                .op
                .subgraphs()
                .into_iter()
                .map(CpuExecutable::new)
                .collect::<EngineResult<Vec<_>>>()?;
            bodies.push(compiled);
            let results = graph
                .results(ValueId(index as u32))
                .map_err(|cause| EngineError::Internal(format!("node %{index}: {cause}")))?;
            result_types.push(results);
        }
        let mut takes_result = vec![false; graph.len()];
        let mut seen = std::collections::HashSet::new();
        for (index, node) in graph.nodes().iter().enumerate().rev() {
            if let Op::Output { index: result } = node.op {
                takes_result[index] = seen.insert((node.inputs[0], result));
            }
        }
        let input_names = graph.input_names().iter().map(|s| s.to_string()).collect();
        let output_names = graph.outputs().iter().map(|(n, _)| n.clone()).collect();
        let profile = (std::env::var("CANOPY_PROFILE").as_deref() == Ok("1"))
            .then(|| vec![Default::default(); graph.len()]);
        Ok(CpuExecutable {
            graph,
            last_use,
            constants,
            input_names,
            output_names,
            profile,
            residency: HostResidency::default(),
            bodies,
            result_types,
            takes_result,
        })
    }

    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    /// Binds the symbolic batch dimension from the inputs and checks every
    /// input against its declared type.
    fn bind_batch(&self, inputs: &[Value]) -> EngineResult<usize> {
        let pairs: Vec<(ValueId, &Value)> =
            self.graph.inputs().iter().copied().zip(inputs).collect();
        bind_batch(&self.graph, &pairs)
    }
}

/// Binds the symbolic batch dimension from `inputs` (graph inputs and
/// their values) and checks each against its declared type. Every backend
/// uses this one check, so an input is refused with the same message
/// everywhere.
pub fn bind_batch(graph: &Graph, inputs: &[(ValueId, &Value)]) -> EngineResult<usize> {
    let mut batch: Option<usize> = None;
    for &(id, value) in inputs {
        let ty = graph.ty(id);
        let name = graph.input_name(id);
        check_rank_and_dtype(name, ty, value)?;
        for (axis, dim) in ty.shape.dims().iter().enumerate() {
            if *dim != Dim::Batch {
                continue;
            }
            let got = value.shape()[axis];
            match batch {
                None => batch = Some(got),
                Some(b) if b != got => {
                    return Err(EngineError::Input {
                        name: name.to_string(),
                        cause: format!(
                            "batch dimension (axis {axis}) is {got}, but other inputs bind it to {b}"
                        ),
                    });
                }
                Some(_) => {}
            }
        }
    }
    let batch = batch.unwrap_or(1);
    for &(id, value) in inputs {
        let ty = graph.ty(id);
        if !value.fits(ty, batch) {
            return Err(EngineError::Input {
                name: graph.input_name(id).to_string(),
                cause: format!("expected {ty} (N = {batch}), got shape {:?}", value.shape()),
            });
        }
    }
    Ok(batch)
}

fn check_rank_and_dtype(name: &str, ty: &TensorType, value: &Value) -> EngineResult<()> {
    if value.dtype() != ty.dtype || value.shape().len() != ty.rank() {
        return Err(EngineError::Input {
            name: name.to_string(),
            cause: format!("expected {ty}, got {}{:?}", value.dtype(), value.shape()),
        });
    }
    Ok(())
}

impl Executable for CpuExecutable {
    /// Runs the whole graph on a rayon worker: kernels that fork (matmul
    /// halves, large elementwise ops) then join from inside the pool, one
    /// half inline, instead of parking the caller's thread at every fork.
    fn run(&mut self, inputs: Vec<Value>) -> EngineResult<Vec<Value>> {
        if rayon::current_thread_index().is_some() {
            return self.run_here(inputs);
        }
        rayon::scope(|_| self.run_here(inputs))
    }

    crate::host_resident_methods!();
}

impl CpuExecutable {
    fn run_here(&mut self, inputs: Vec<Value>) -> EngineResult<Vec<Value>> {
        let expected = self.graph.inputs().len();
        if inputs.len() != expected {
            return Err(EngineError::InputCount {
                expected: self.input_names.clone(),
                got: inputs.len(),
            });
        }
        let batch = self.bind_batch(&inputs)?;
        let mut profile = self.profile.take();
        let inputs = inputs.into_iter().map(Arg::Owned).collect();
        let result = self.execute(inputs, batch, profile.as_mut());
        self.profile = profile;
        result
    }

    /// Runs the graph on `inputs`, owned or borrowed: a loop body borrows
    /// its constants (weights) from the enclosing graph at every step.
    pub(crate) fn execute<'a>(
        &'a self,
        inputs: Vec<Arg<'a>>,
        batch: usize,
        mut profile: Option<&mut Vec<(std::time::Duration, u64)>>,
    ) -> EngineResult<Vec<Value>> {
        let mut values: Vec<Option<Arg<'a>>> = Vec::new();
        values.resize_with(self.graph.len(), || None);
        let mut tuples: Vec<Option<Vec<Option<Value>>>> = vec![None; self.graph.len()];
        for (&id, value) in self.graph.inputs().iter().zip(inputs) {
            values[id.index()] = Some(value);
        }
        for (index, node) in self.graph.nodes().iter().enumerate() {
            if matches!(node.op, Op::Input { .. } | Op::Constant(_)) {
                continue;
            }
            let started = profile.is_some().then(std::time::Instant::now);
            if node.op.is_tuple() {
                let results = self.eval_tuple(index, &mut values, batch)?;
                tuples[index] = Some(results.into_iter().map(Some).collect());
            } else if let Op::Output { index: result } = node.op {
                let tuple = node.inputs[0].index();
                let slots = tuples[tuple]
                    .as_mut()
                    .expect("executor invariant: a tuple lives until its last output");
                let value = if self.takes_result[index] {
                    slots[result].take()
                } else {
                    slots[result].clone()
                };
                let value = value.expect("executor invariant: a result is taken once, last");
                values[index] = Some(Arg::Owned(value));
            } else {
                let result = self.eval_node(index, &mut values, batch)?;
                values[index] = Some(Arg::Owned(result));
            }
            if let (Some(profile), Some(started)) = (profile.as_deref_mut(), started) {
                profile[index].0 += started.elapsed();
                profile[index].1 += 1;
            }
            for input in &node.inputs {
                if self.last_use[input.index()] == index {
                    values[input.index()] = None;
                    tuples[input.index()] = None;
                }
            }
        }
        let outputs = self.graph.outputs();
        let mut result = Vec::with_capacity(outputs.len());
        for (position, (_, id)) in outputs.iter().enumerate() {
            let reused_later = outputs[position + 1..].iter().any(|(_, o)| o == id);
            let value = if reused_later {
                self.lookup(&values, *id).clone()
            } else {
                match values[id.index()].take() {
                    Some(v) => v.into_value(),
                    None => self.lookup(&values, *id).clone(),
                }
            };
            result.push(value);
        }
        Ok(result)
    }

    fn lookup<'v>(&'v self, values: &'v [Option<Arg<'_>>], id: ValueId) -> &'v Value {
        values[id.index()]
            .as_ref()
            .map(Arg::value)
            .or(self.constants[id.index()].as_ref())
            .expect("executor invariant: a value is live until its last use")
    }

    /// The operands of node `index`: each handed over by ownership at its
    /// last use when this node reads it once, else borrowed.
    fn operands<'v>(&'v self, index: usize, values: &'v mut [Option<Arg<'_>>]) -> Vec<Arg<'v>> {
        let node = &self.graph.nodes()[index];
        let mut owned: Vec<Option<Arg<'_>>> = node
            .inputs
            .iter()
            .map(|id| {
                let once = node.inputs.iter().filter(|&x| x == id).count() == 1;
                if once && self.last_use[id.index()] == index {
                    values[id.index()].take()
                } else {
                    None
                }
            })
            .collect();
        let values: &'v [Option<Arg<'_>>] = values;
        node.inputs
            .iter()
            .zip(owned.iter_mut())
            .map(|(&id, slot)| match slot.take() {
                Some(arg) => arg,
                None => Arg::Shared(self.lookup(values, id)),
            })
            .collect()
    }

    fn eval_node(
        &self,
        index: usize,
        values: &mut [Option<Arg<'_>>],
        batch: usize,
    ) -> EngineResult<Value> {
        let node = &self.graph.nodes()[index];
        let args = self.operands(index, values);
        kernels::eval(&node.op, args, &node.ty, batch).map_err(|source| EngineError::Kernel {
            node: Some(index),
            op: node.op.name(),
            operands: node
                .inputs
                .iter()
                .map(|&id| self.graph.ty(id).shape.resolve(batch))
                .collect(),
            source,
        })
    }

    fn eval_tuple(
        &self,
        index: usize,
        values: &mut [Option<Arg<'_>>],
        batch: usize,
    ) -> EngineResult<Vec<Value>> {
        let node = &self.graph.nodes()[index];
        let args = self.operands(index, values);
        let run = control::Run {
            node: index,
            op: &node.op,
            bodies: &self.bodies[index],
            results: &self.result_types[index],
            batch,
        };
        run.eval(args)
    }
}
