//! The CPU backend: an executor over `ndarray` kernels.
//!
//! Graph mode reuses buffers: the executor computes each value's last use
//! at compile time and hands a value to its last consumer by ownership, so
//! elementwise kernels and in-graph optimizer updates write in place.

mod control;
pub mod kernels;

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use canopy_ir::{Dim, Graph, Op, TensorType, ValueId};

use crate::backend::{Backend, Executable, HostResidency};
use crate::error::{EngineError, EngineResult};
use crate::fuse::{Fusion, Group, MAX_INPUTS, Rule};
use crate::value::Value;
pub use kernels::Arg;
use kernels::fused::{FusedKernel, Member, Source};

/// The CPU backend. Everything runs on rayon's pool: a large matmul is
/// split in halves under `rayon::join`, each a single-threaded
/// `matrixmultiply` call, and large elementwise and reduction kernels fork
/// there too. Chains of elementwise nodes, and a matmul with the
/// elementwise nodes that follow it (bias, activation), run as one fused
/// kernel (`crate::fuse`, `kernels/fused.rs`); `CANOPY_FUSION=off` turns
/// that off, to compare.
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

/// The CPU backend with fusion on or off whatever `CANOPY_FUSION` says:
/// what benches and tests compare against each other.
#[derive(Clone, Copy, Debug)]
pub struct CpuBackendWithFusion {
    pub fuse: bool,
}

impl Backend for CpuBackendWithFusion {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn compile(&self, graph: &Graph) -> EngineResult<Box<dyn Executable>> {
        Ok(Box::new(CpuExecutable::compile(graph, self.fuse)?))
    }
}

/// A graph prepared for repeated execution on the CPU.
pub struct CpuExecutable {
    graph: Graph,
    /// For each node, the index of the last node that reads it (a fused
    /// group reads at its root), or `usize::MAX` when it is a graph output.
    last_use: Vec<usize>,
    /// For each node that runs, the values it reads: a fused group's root
    /// reads every value its group reads from outside; a fused-away
    /// member reads nothing.
    reads: Vec<Vec<usize>>,
    /// Which nodes run fused, and with which.
    fusion: Fusion,
    /// Per fused group's root: its kernel.
    groups: Vec<Option<FusedGroup>>,
    /// Constants decoded once, at compile time.
    constants: Vec<Option<Value>>,
    input_names: Vec<String>,
    output_names: Vec<String>,
    /// Per-node (total time, runs) when `CANOPY_PROFILE=1`; printed to
    /// stderr by kernel name when the executable is dropped. Behind a lock
    /// because a loop body runs through `&self`.
    profile: Option<Mutex<Vec<(Duration, u64)>>>,
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
        let Some(profile) = self.profile.take() else {
            return;
        };
        let profile = profile.into_inner().unwrap_or_else(PoisonError::into_inner);
        let mut by_op: std::collections::BTreeMap<&str, (Duration, u64)> = Default::default();
        for (index, (time, runs)) in profile.into_iter().enumerate() {
            let entry = by_op
                .entry(kernel_name(&self.graph, &self.groups, index))
                .or_default();
            entry.0 += time;
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
    /// Compiles `graph`, fused unless `CANOPY_FUSION=off`.
    pub fn new(graph: &Graph) -> EngineResult<CpuExecutable> {
        let fuse = std::env::var("CANOPY_FUSION").as_deref() != Ok("off");
        CpuExecutable::compile(graph, fuse)
    }

    /// Compiles `graph`, fusing its nodes (and its bodies') when `fuse`.
    pub fn compile(graph: &Graph, fuse: bool) -> EngineResult<CpuExecutable> {
        canopy_ir::verify::verify(graph)?;
        let graph = canopy_ir::passes::inline_custom_grads(graph)?;
        let fusion = if fuse {
            plan_fusion(&graph)
        } else {
            Fusion::none(&graph)
        };
        let groups: Vec<Option<FusedGroup>> = (0..graph.len())
            .map(|index| {
                (fusion.is_fused(index))
                    .then(|| FusedGroup::new(&graph, fusion.group(&graph, index)))
            })
            .collect();
        let reads: Vec<Vec<usize>> = graph
            .nodes()
            .iter()
            .enumerate()
            .map(
                |(index, node)| match (&groups[index], fusion.is_fused_away(index)) {
                    (_, true) => Vec::new(),
                    (Some(group), _) => group.reads.clone(),
                    (None, _) => node.inputs.iter().map(|id| id.index()).collect(),
                },
            )
            .collect();
        let mut last_use = vec![0usize; graph.len()];
        for (index, read) in reads.iter().enumerate() {
            for &input in read {
                last_use[input] = last_use[input].max(index);
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
                .map(|body| CpuExecutable::compile(body, fuse))
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
            .then(|| Mutex::new(vec![Default::default(); graph.len()]));
        Ok(CpuExecutable {
            graph,
            last_use,
            reads,
            fusion,
            groups,
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

/// A fused group, compiled.
struct FusedGroup {
    kernel: FusedKernel,
    /// The kernel's inputs: the head's value first when there is a head,
    /// then the values the members read from outside the group.
    inputs: Vec<usize>,
    head: Option<usize>,
    /// Every value the group reads from outside (the head's operands
    /// included): what the executor keeps alive for it.
    reads: Vec<usize>,
}

impl FusedGroup {
    fn new(graph: &Graph, group: Group) -> FusedGroup {
        let nodes = graph.nodes();
        let head = group.head;
        let steps: Vec<usize> = group
            .members
            .iter()
            .copied()
            .filter(|&m| Some(m) != head)
            .collect();
        let mut inputs: Vec<usize> = head.into_iter().collect();
        let members = steps
            .iter()
            .map(|&m| Member {
                op: nodes[m].op.clone(),
                operands: nodes[m]
                    .inputs
                    .iter()
                    .map(|id| {
                        let v = id.index();
                        if let Some(j) = steps.iter().position(|&s| s == v) {
                            return Source::Member(j);
                        }
                        let k = inputs.iter().position(|&i| i == v).unwrap_or_else(|| {
                            inputs.push(v);
                            inputs.len() - 1
                        });
                        Source::Input(k)
                    })
                    .collect(),
            })
            .collect();
        FusedGroup {
            kernel: FusedKernel {
                inputs: inputs.len(),
                members,
                output: nodes[group.root()].ty.dtype,
            },
            inputs,
            head,
            reads: group.inputs,
        }
    }
}

/// How the CPU backend groups `graph`'s nodes: elementwise ops over f32
/// and bool (`kernels::fused::fusible`), headed by a matmul when one
/// feeds the chain, on symbolic shapes (one plan serves every batch).
fn plan_fusion(graph: &Graph) -> Fusion {
    let nodes = graph.nodes();
    let elementwise = |i: usize| {
        let node = &nodes[i];
        let operands: Vec<_> = node.inputs.iter().map(|&id| graph.ty(id).dtype).collect();
        kernels::fused::fusible(&node.op, &operands, node.ty.dtype)
    };
    let head = |i: usize| {
        matches!(nodes[i].op, Op::MatMul { .. }) && nodes[i].ty.dtype == canopy_ir::DType::F32
    };
    let same_shape = |a: usize, b: usize| nodes[a].ty.shape == nodes[b].ty.shape;
    Fusion::plan(
        graph,
        &Rule {
            elementwise: &elementwise,
            head: &head,
            same_shape: &same_shape,
            max_inputs: MAX_INPUTS,
        },
    )
}

/// The name node `index` runs under, in profiles and errors: its op's, or
/// the fused kernel's when it is the root of a fused group.
fn kernel_name(graph: &Graph, groups: &[Option<FusedGroup>], index: usize) -> &'static str {
    match &groups[index] {
        Some(FusedGroup { head: Some(_), .. }) => "fused epilogue of a matmul",
        Some(_) => "fused elementwise",
        None => graph.nodes()[index].op.name(),
    }
}

/// How the CPU backend fuses a graph, for `canopy model inspect` and the
/// benchmarks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FusionReport {
    /// Nodes in the graph and in its loop bodies and branches.
    pub nodes: usize,
    /// What runs once fused: nodes that are not computed inside another
    /// node's kernel (inputs and constants included, as in `nodes`).
    pub after_fusion: usize,
    /// The top-level graph's fused groups.
    pub groups: Vec<Group>,
}

/// The fusion the CPU backend plans for `graph` (after inlining custom
/// gradients, as it compiles it).
pub fn fusion_report(graph: &Graph) -> EngineResult<FusionReport> {
    let graph = canopy_ir::passes::inline_custom_grads(graph)?;
    let fusion = plan_fusion(&graph);
    let mut report = FusionReport {
        nodes: graph.len(),
        after_fusion: fusion.group_count(0..graph.len()),
        groups: (0..graph.len())
            .filter(|&i| fusion.is_fused(i))
            .map(|i| fusion.group(&graph, i))
            .collect(),
    };
    for node in graph.nodes() {
        for body in node.op.subgraphs() {
            let inner = fusion_report(body)?;
            report.nodes += inner.nodes;
            report.after_fusion += inner.after_fusion;
        }
    }
    Ok(report)
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
        let inputs = inputs.into_iter().map(Arg::Owned).collect();
        self.execute(inputs, batch)
    }

    /// Runs the graph on `inputs`, owned or borrowed: a loop body borrows
    /// its constants (weights) from the enclosing graph at every step.
    pub(crate) fn execute<'a>(
        &'a self,
        inputs: Vec<Arg<'a>>,
        batch: usize,
    ) -> EngineResult<Vec<Value>> {
        let mut guard = self
            .profile
            .as_ref()
            .map(|p| p.lock().unwrap_or_else(PoisonError::into_inner));
        let mut profile = guard.as_deref_mut();
        let mut values: Vec<Option<Arg<'a>>> = Vec::new();
        values.resize_with(self.graph.len(), || None);
        let mut tuples: Vec<Option<Vec<Option<Value>>>> = vec![None; self.graph.len()];
        for (&id, value) in self.graph.inputs().iter().zip(inputs) {
            values[id.index()] = Some(value);
        }
        for (index, node) in self.graph.nodes().iter().enumerate() {
            if matches!(node.op, Op::Input { .. } | Op::Constant(_))
                || self.fusion.is_fused_away(index)
            {
                continue;
            }
            let started = profile.is_some().then(Instant::now);
            let mut in_head = Duration::ZERO;
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
            } else if let Some(group) = &self.groups[index] {
                let (result, head_time) = self.eval_group(index, group, &mut values, batch)?;
                values[index] = Some(Arg::Owned(result));
                // The head is its own line of the profile; the root's is the
                // epilogue.
                if let (Some(profile), Some(head)) = (profile.as_deref_mut(), group.head) {
                    profile[head].0 += head_time;
                    profile[head].1 += 1;
                    in_head = head_time;
                }
            } else {
                let result = self.eval_node(index, &mut values, batch)?;
                values[index] = Some(Arg::Owned(result));
            }
            if let (Some(profile), Some(started)) = (profile.as_deref_mut(), started) {
                profile[index].0 += started.elapsed().saturating_sub(in_head);
                profile[index].1 += 1;
            }
            for &input in &self.reads[index] {
                if self.last_use[input] == index {
                    values[input] = None;
                    tuples[input] = None;
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
        kernels::eval(&node.op, args, &node.ty, batch)
            .map_err(|source| self.kernel_error(index, &node.inputs, batch, source))
    }

    fn kernel_error(
        &self,
        index: usize,
        operands: &[ValueId],
        batch: usize,
        source: crate::error::KernelError,
    ) -> EngineError {
        EngineError::Kernel {
            node: Some(index),
            op: kernel_name(&self.graph, &self.groups, index),
            operands: operands
                .iter()
                .map(|&id| self.graph.ty(id).shape.resolve(batch))
                .collect(),
            source,
        }
    }

    /// Runs the fused group whose root is `index`: its head first (a
    /// matmul, into the buffer the members then run over), then the
    /// members, block by block. An operand read for the last time is
    /// handed over, so the group may write into it.
    fn eval_group(
        &self,
        index: usize,
        group: &FusedGroup,
        values: &mut [Option<Arg<'_>>],
        batch: usize,
    ) -> EngineResult<(Value, Duration)> {
        let nodes = self.graph.nodes();
        let mut args: Vec<Arg<'_>> = Vec::with_capacity(group.kernel.inputs);
        let mut head_time = Duration::ZERO;
        if let Some(head) = group.head {
            let started = Instant::now();
            let node = &nodes[head];
            let operands = node
                .inputs
                .iter()
                .map(|&id| Arg::Shared(self.lookup(values, id)))
                .collect();
            let product = kernels::eval(&node.op, operands, &node.ty, batch)
                .map_err(|source| self.kernel_error(head, &node.inputs, batch, source))?;
            args.push(Arg::Owned(product));
            head_time = started.elapsed();
        }
        let outside = &group.inputs[usize::from(group.head.is_some())..];
        let mut owned: Vec<Option<Arg<'_>>> = outside
            .iter()
            .map(|&v| {
                if self.last_use[v] == index {
                    values[v].take()
                } else {
                    None
                }
            })
            .collect();
        let values: &[Option<Arg<'_>>] = values;
        for (&v, slot) in outside.iter().zip(owned.iter_mut()) {
            args.push(match slot.take() {
                Some(arg) => arg,
                None => Arg::Shared(self.lookup(values, ValueId(v as u32))),
            });
        }
        let shape = nodes[index].ty.shape.resolve(batch);
        let value = group.kernel.run(args, &shape).map_err(|source| {
            let operands: Vec<ValueId> = group.reads.iter().map(|&v| ValueId(v as u32)).collect();
            self.kernel_error(index, &operands, batch, source)
        })?;
        Ok((value, head_time))
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

#[cfg(test)]
mod fusion_tests;
