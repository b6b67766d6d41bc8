//! A graph laid out for one batch size: elementwise nodes fused (see
//! `fuse.rs`), buffers assigned by liveness, pipelines and bind groups
//! made once, dispatches in order, and each control-flow node's bodies
//! laid out as plans of their own (`control.rs`).

use std::collections::BTreeMap;
use std::sync::Arc;

use canopy_ir::{DType, Graph, Op, ValueId};

use super::context::GpuContext;
use super::control::{At, ControlPlan};
use super::fuse::{Fusion, Group};
use super::kernels::{self, Bind, Family, FusedMember, FusedOperand, FusedSite, Kernel, Site};
use super::program::Program;
use super::wgsl::element_bytes;
use crate::backend::TransferCounters;
use crate::error::{EngineError, EngineResult};

/// Where a value lives during a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Storage {
    /// The buffer of graph input `k` (fed, or resident).
    Input(usize),
    /// A constant's buffer, uploaded once at compile time.
    Constant(usize),
    /// Buffer `k` of the plan's pool.
    Pooled(usize),
}

pub struct Dispatch {
    pub pipeline: Arc<wgpu::ComputePipeline>,
    pub bind_group: wgpu::BindGroup,
    pub workgroups: [u32; 3],
}

/// What a plan records, in order.
pub enum Step {
    /// Kernels dispatched in one compute pass.
    Kernels(Vec<Dispatch>),
    /// A control-flow node, run from the host over its bodies' plans.
    Control(Box<ControlPlan>),
}

/// The buffers a plan binds that it does not own.
pub struct Bound<'a> {
    pub inputs: &'a [wgpu::Buffer],
    pub constants: &'a BTreeMap<usize, wgpu::Buffer>,
    pub flags: &'a wgpu::Buffer,
}

pub struct Plan {
    /// Per node: resolved shape.
    pub shapes: Vec<Vec<usize>>,
    /// Per node: where its value lives (None for nodes never computed, and
    /// for control-flow nodes, whose results live in their `output`s').
    pub storage: Vec<Option<Storage>>,
    pub pool: Vec<wgpu::Buffer>,
    pub steps: Vec<Step>,
    /// Which nodes are computed inside another node's kernel.
    pub fusion: Fusion,
}

/// What a dispatch reads and writes: node ids, operands in binding order.
struct Endpoints<'a> {
    operands: &'a [usize],
    output: usize,
}

impl Plan {
    /// Lays `program` out at `batch`; `bound` holds its inputs' buffers
    /// and its constants'.
    pub fn new(
        context: &GpuContext,
        program: &Program,
        batch: usize,
        fuse: bool,
        bound: &Bound<'_>,
    ) -> EngineResult<Plan> {
        let graph = &program.graph;
        let shapes: Vec<Vec<usize>> = graph
            .nodes()
            .iter()
            .map(|node| node.ty.shape.resolve(batch))
            .collect();
        let fusion = if fuse {
            super::fuse::plan(graph, &shapes, context.max_fused_inputs())
        } else {
            Fusion::none(graph)
        };
        let mut result_bytes: Vec<Vec<u64>> = vec![Vec::new(); graph.len()];
        for (index, node) in graph.nodes().iter().enumerate() {
            if node.op.is_tuple() {
                let results = graph.results(ValueId(index as u32)).map_err(|cause| {
                    EngineError::Internal(format!("node %{index} ({}): {cause}", node.op.name()))
                })?;
                result_bytes[index] = results
                    .iter()
                    .map(|ty| value_bytes(ty.dtype, &ty.shape.resolve(batch)))
                    .collect();
            }
        }
        let layout = assign_storage(graph, &shapes, &fusion, &result_bytes);
        let mut pool = Vec::with_capacity(layout.sizes.len());
        for (k, bytes) in layout.sizes.iter().enumerate() {
            pool.push(context.storage_buffer(&format!("pooled buffer {k}"), *bytes)?);
        }
        let mut plan = Plan {
            shapes,
            storage: layout.storage,
            pool,
            steps: Vec::new(),
            fusion,
        };
        // A node without a kernel (`Family::NoKernel`) generates none.
        for (index, node) in graph.nodes().iter().enumerate() {
            if Family::of(&node.op) == Family::ControlFlow {
                // An `output` is its result's buffer, which the control-flow
                // node writes; that node runs even when its result 0 is
                // empty.
                if node.op.is_tuple() {
                    let operands = node
                        .inputs
                        .iter()
                        .map(|id| plan.buffer(bound, id.index()).cloned())
                        .collect::<EngineResult<Vec<_>>>()?;
                    let results = layout.results[index]
                        .iter()
                        .zip(&result_bytes[index])
                        .map(|(k, bytes)| (k.map(|k| plan.pool[k].clone()), *bytes))
                        .collect();
                    let at = At {
                        node: index,
                        op: &node.op,
                        operands,
                        results,
                    };
                    let bodies = &program.bodies[index];
                    let control = ControlPlan::new(context, at, bodies, batch, fuse, bound.flags)?;
                    plan.steps.push(Step::Control(Box::new(control)));
                }
                continue;
            }
            let computed_here = !plan.fusion.is_fused_away(index);
            if !computed_here || plan.shapes[index].iter().product::<usize>() == 0 {
                continue;
            }
            let group = plan.fusion.group(graph, index);
            if group.members.len() > 1 {
                plan.push_fused(context, bound, graph, &group)?;
            } else {
                plan.push_node(context, bound, graph, index)?;
            }
        }
        Ok(plan)
    }

    /// Records the plan's work: kernels, and control flow run from the
    /// host (which may submit and wait, see `control.rs`).
    pub fn record(&self, recorder: &mut Recorder<'_>) -> EngineResult<()> {
        for step in &self.steps {
            match step {
                Step::Kernels(dispatches) => recorder.kernels(dispatches),
                Step::Control(control) => control.record(recorder)?,
            }
        }
        Ok(())
    }

    fn push_dispatch(&mut self, dispatch: Dispatch) {
        match self.steps.last_mut() {
            Some(Step::Kernels(dispatches)) => dispatches.push(dispatch),
            _ => self.steps.push(Step::Kernels(vec![dispatch])),
        }
    }

    fn site<'g>(
        &self,
        context: &GpuContext,
        graph: &'g Graph,
        op: &'g Op,
        operands: &[usize],
        output: usize,
    ) -> Site<'g> {
        Site {
            op,
            operands: operands
                .iter()
                .map(|&v| (graph.nodes()[v].ty.dtype, self.shapes[v].clone()))
                .collect(),
            out: (graph.nodes()[output].ty.dtype, self.shapes[output].clone()),
            max_workgroups: context.max_workgroups(),
        }
    }

    /// The kernels of one node on its own.
    fn push_node(
        &mut self,
        context: &GpuContext,
        bound: &Bound<'_>,
        graph: &Graph,
        index: usize,
    ) -> EngineResult<()> {
        let node = &graph.nodes()[index];
        let operands: Vec<usize> = node.inputs.iter().map(|id| id.index()).collect();
        let site = self.site(context, graph, &node.op, &operands, index);
        let generated = kernels::generate(&site).map_err(|what| {
            EngineError::Internal(format!("node %{index} ({}): {what}", node.op.name()))
        })?;
        let endpoints = Endpoints {
            operands: &operands,
            output: index,
        };
        for kernel in generated {
            let dispatch = self.dispatch(context, bound, &endpoints, &kernel)?;
            self.push_dispatch(dispatch);
        }
        Ok(())
    }

    /// One kernel for a fused group, writing only its root.
    fn push_fused(
        &mut self,
        context: &GpuContext,
        bound: &Bound<'_>,
        graph: &Graph,
        group: &Group,
    ) -> EngineResult<()> {
        let nodes = graph.nodes();
        let root = group.root();
        let operand_of = |value: usize| match group.members.iter().position(|&m| m == value) {
            Some(position) => Ok(FusedOperand::Member(position)),
            None => group
                .inputs
                .iter()
                .position(|&v| v == value)
                .map(FusedOperand::Input)
                .ok_or_else(|| {
                    EngineError::Internal(format!("fused group of %{root} misses %{value}"))
                }),
        };
        let mut members = Vec::with_capacity(group.members.len());
        for &m in &group.members {
            members.push(FusedMember {
                op: &nodes[m].op,
                operands: nodes[m]
                    .inputs
                    .iter()
                    .map(|id| operand_of(id.index()))
                    .collect::<EngineResult<_>>()?,
                out: nodes[m].ty.dtype,
            });
        }
        let fused = FusedSite {
            site: self.site(context, graph, &nodes[root].op, &group.inputs, root),
            members,
        };
        let kernel = kernels::fused_elementwise(&fused).map_err(|what| {
            EngineError::Internal(format!(
                "fused group of %{root} ({:?}): {what}",
                group.members
            ))
        })?;
        let endpoints = Endpoints {
            operands: &group.inputs,
            output: root,
        };
        let dispatch = self.dispatch(context, bound, &endpoints, &kernel)?;
        self.push_dispatch(dispatch);
        Ok(())
    }

    /// The buffer holding node `index`'s value.
    pub fn buffer<'a>(&'a self, bound: &Bound<'a>, index: usize) -> EngineResult<&'a wgpu::Buffer> {
        match self.storage[index] {
            Some(Storage::Input(k)) => bound.inputs.get(k),
            Some(Storage::Constant(k)) => bound.constants.get(&k),
            Some(Storage::Pooled(k)) => self.pool.get(k),
            None => None,
        }
        .ok_or_else(|| EngineError::Internal(format!("node %{index} has no GPU buffer")))
    }

    fn dispatch(
        &self,
        context: &GpuContext,
        bound: &Bound<'_>,
        endpoints: &Endpoints<'_>,
        kernel: &Kernel,
    ) -> EngineResult<Dispatch> {
        let index = endpoints.output;
        let max = context.max_workgroups();
        if kernel.workgroups.iter().any(|&g| g > max) {
            return Err(EngineError::Gpu {
                what: format!("node %{index} ({})", kernel.label),
                cause: format!(
                    "needs {:?} workgroups, more than the adapter's {max} per dimension; use a smaller batch",
                    kernel.workgroups
                ),
            });
        }
        let pipeline = context.pipeline(kernel.label, &kernel.source)?;
        let mut buffers = Vec::with_capacity(kernel.bindings.len());
        for bind in &kernel.bindings {
            buffers.push(match bind {
                Bind::Operand(k) => {
                    let value = endpoints.operands.get(*k).ok_or_else(|| {
                        EngineError::Internal(format!("{} binds operand {k}", kernel.label))
                    })?;
                    self.buffer(bound, *value)?
                }
                Bind::Output => self.buffer(bound, index)?,
                Bind::Flags => bound.flags,
            });
        }
        let entries: Vec<wgpu::BindGroupEntry<'_>> = buffers
            .iter()
            .enumerate()
            .map(|(binding, buffer)| wgpu::BindGroupEntry {
                binding: binding as u32,
                resource: buffer.as_entire_binding(),
            })
            .collect();
        let bind_group = context
            .device()
            .create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some(kernel.label),
                layout: &pipeline.get_bind_group_layout(0),
                entries: &entries,
            });
        Ok(Dispatch {
            pipeline,
            bind_group,
            workgroups: kernel.workgroups,
        })
    }
}

/// Bytes of a value of `dtype` and `shape` on the device.
pub fn value_bytes(dtype: DType, shape: &[usize]) -> u64 {
    shape.iter().product::<usize>() as u64 * element_bytes(dtype)
}

/// Where each node's value lives, and the pool's buffer sizes.
struct Layout {
    storage: Vec<Option<Storage>>,
    /// Per control-flow node: per result, the pooled buffer holding it
    /// (none where no `output` reads it); empty for other nodes.
    results: Vec<Vec<Option<usize>>>,
    sizes: Vec<u64>,
}

/// Gives each node a storage: inputs and constants their own, a reshape
/// its operand's, a node fused into another's kernel none, every other
/// node a pooled buffer. A control-flow node has none itself: each of its
/// results that an `output` reads gets a pooled buffer when the node
/// runs, busy until the last reader of any of those `output`s, and the
/// `output`s share it. A value is read where its readers are computed (a
/// fused member's reads happen in its group's root), and a pooled buffer
/// is free again after the last reader of every value stored in it; the
/// smallest free buffer that fits is reused, else a new one is made.
/// `result_bytes` gives each control-flow node's results' sizes.
fn assign_storage(
    graph: &Graph,
    shapes: &[Vec<usize>],
    fusion: &Fusion,
    result_bytes: &[Vec<u64>],
) -> Layout {
    let nodes = graph.nodes();
    let input_position: BTreeMap<usize, usize> = graph
        .inputs()
        .iter()
        .enumerate()
        .map(|(k, id)| (id.index(), k))
        .collect();
    // Where each node's value is last read; graph outputs live to the end.
    let mut last_use: Vec<usize> = (0..nodes.len()).collect();
    for (index, node) in nodes.iter().enumerate() {
        let read_at = fusion.root_of(index);
        for input in &node.inputs {
            last_use[input.index()] = last_use[input.index()].max(read_at);
        }
    }
    for (_, out) in graph.outputs() {
        last_use[out.index()] = usize::MAX;
    }
    // Per (control-flow node, result): the last use of any `output` of it.
    let mut result_last_use: BTreeMap<(usize, usize), usize> = BTreeMap::new();
    for (index, node) in nodes.iter().enumerate() {
        if let Op::Output { index: result } = node.op {
            let until = result_last_use
                .entry((node.inputs[0].index(), result))
                .or_insert(0);
            *until = (*until).max(last_use[index]);
        }
    }
    let mut storage: Vec<Option<Storage>> = vec![None; nodes.len()];
    let mut results: Vec<Vec<Option<usize>>> = vec![Vec::new(); nodes.len()];
    let mut pool = Pool::default();
    for (index, node) in nodes.iter().enumerate() {
        storage[index] = match &node.op {
            _ if fusion.is_fused_away(index) => None,
            Op::Input { .. } => Some(Storage::Input(input_position[&index])),
            Op::Constant(_) => Some(Storage::Constant(index)),
            Op::Reshape { .. } => {
                let from = node.inputs[0].index();
                let shared = storage[from].expect("operands precede their readers");
                if let Storage::Pooled(k) = shared {
                    pool.busy_until[k] = pool.busy_until[k].max(last_use[index]);
                }
                Some(shared)
            }
            op if op.is_tuple() => {
                results[index] = result_bytes[index]
                    .iter()
                    .enumerate()
                    .map(|(r, bytes)| {
                        let until = result_last_use.get(&(index, r))?;
                        Some(pool.allocate(*bytes, *until))
                    })
                    .collect();
                None
            }
            Op::Output { index: result } => {
                let tuple = node.inputs[0].index();
                results[tuple][*result].map(Storage::Pooled)
            }
            _ => {
                let bytes = value_bytes(node.ty.dtype, &shapes[index]);
                Some(Storage::Pooled(pool.allocate(bytes, last_use[index])))
            }
        };
        pool.release(index);
    }
    Layout {
        storage,
        results,
        sizes: pool.sizes,
    }
}

/// The pooled buffers being assigned: their sizes, which are free, and
/// until when each is busy.
#[derive(Default)]
struct Pool {
    sizes: Vec<u64>,
    free: Vec<usize>,
    /// Per buffer: the last use of any value stored in it.
    busy_until: Vec<usize>,
}

impl Pool {
    /// The smallest free buffer of at least `bytes`, else a new one; busy
    /// until node `until`.
    fn allocate(&mut self, bytes: u64, until: usize) -> usize {
        // Whole vec4s, so a kernel may bind any pooled buffer as
        // `array<vec4<f32>>` (gemm.rs).
        let bytes = bytes.next_multiple_of(16).max(16);
        let best = self
            .free
            .iter()
            .enumerate()
            .filter(|(_, k)| self.sizes[**k] >= bytes)
            .min_by_key(|(_, k)| self.sizes[**k])
            .map(|(slot, _)| slot);
        let k = match best {
            Some(slot) => self.free.swap_remove(slot),
            None => {
                self.sizes.push(bytes);
                self.busy_until.push(0);
                self.sizes.len() - 1
            }
        };
        self.busy_until[k] = until;
        k
    }

    /// Frees the buffers whose every value has been read by node `index`.
    fn release(&mut self, index: usize) {
        for (k, until) in self.busy_until.iter().enumerate() {
            if *until == index && !self.free.contains(&k) && *until != usize::MAX {
                self.free.push(k);
            }
        }
    }
}

/// Loop steps recorded into one command buffer at most before it is
/// submitted: a step records its body's dispatches and copies, so a long
/// loop in one buffer would hold them all at once. Submitting does not
/// wait, so the device keeps working while the host records on.
pub const MAX_STEPS_PER_SUBMISSION: usize = 256;

/// Records a run's commands, submitting when control flow needs a value
/// from the device (or a write from the host) and at the end, and counts
/// what it did.
pub struct Recorder<'a> {
    context: &'a GpuContext,
    encoder: Option<wgpu::CommandEncoder>,
    /// Loop steps recorded since the last submission.
    steps: usize,
    /// The last submission made, which a read waits for.
    pub submitted: Option<wgpu::SubmissionIndex>,
    pub counters: TransferCounters,
}

impl<'a> Recorder<'a> {
    pub fn new(context: &'a GpuContext) -> Recorder<'a> {
        Recorder {
            context,
            encoder: None,
            steps: 0,
            submitted: None,
            counters: TransferCounters::default(),
        }
    }

    /// The command buffer being recorded.
    pub fn encoder(&mut self) -> &mut wgpu::CommandEncoder {
        let device = self.context.device();
        self.encoder.get_or_insert_with(|| {
            device.create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("canopy run"),
            })
        })
    }

    /// `dispatches` in one compute pass.
    pub fn kernels(&mut self, dispatches: &[Dispatch]) {
        if dispatches.is_empty() {
            return;
        }
        let mut pass = self
            .encoder()
            .begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("canopy graph"),
                timestamp_writes: None,
            });
        for dispatch in dispatches {
            pass.set_pipeline(&dispatch.pipeline);
            pass.set_bind_group(0, &dispatch.bind_group, &[]);
            let [x, y, z] = dispatch.workgroups;
            pass.dispatch_workgroups(x, y, z);
        }
        drop(pass);
        self.counters.dispatches += dispatches.len() as u64;
    }

    /// Copies `bytes` on the device; nothing when there are none, or when
    /// the source is the destination (a value already where it goes).
    pub fn copy(
        &mut self,
        from: &wgpu::Buffer,
        from_offset: u64,
        to: &wgpu::Buffer,
        to_offset: u64,
        bytes: u64,
    ) {
        if bytes == 0 || (from == to && from_offset == to_offset) {
            return;
        }
        self.encoder()
            .copy_buffer_to_buffer(from, from_offset, to, to_offset, bytes);
    }

    /// Submits what has been recorded, without waiting for it.
    pub fn submit(&mut self) {
        if let Some(encoder) = self.encoder.take() {
            self.submitted = Some(self.context.queue().submit([encoder.finish()]));
            self.counters.submissions += 1;
        }
        self.steps = 0;
    }

    /// Marks the end of a loop step, submitting past
    /// [`MAX_STEPS_PER_SUBMISSION`].
    pub fn step_done(&mut self) {
        self.steps += 1;
        if self.steps >= MAX_STEPS_PER_SUBMISSION {
            self.submit();
        }
    }

    /// The 32-bit word at the start of `from`, once everything recorded
    /// so far has run: one submission and a wait, through `staging` (a
    /// mappable buffer of at least 4 bytes). `what` names the value in
    /// errors.
    pub fn read_word(
        &mut self,
        from: &wgpu::Buffer,
        staging: &wgpu::Buffer,
        what: &str,
    ) -> EngineResult<u32> {
        self.copy(from, 0, staging, 0, 4);
        self.submit();
        let bytes = self.context.read(staging, self.submitted.clone(), what)?;
        self.counters.device_to_host_bytes += 4;
        let word = bytes
            .get(..4)
            .ok_or_else(|| EngineError::Internal(format!("{what}: a short read")))?;
        Ok(u32::from_le_bytes([word[0], word[1], word[2], word[3]]))
    }

    /// Writes `bytes` at the start of `to` from the host, after everything
    /// recorded so far and before anything recorded next: the queue
    /// applies a write at its next submission, ahead of that submission's
    /// commands, so what is recorded is submitted first.
    pub fn write(&mut self, to: &wgpu::Buffer, bytes: &[u8]) {
        self.submit();
        self.context.queue().write_buffer(to, 0, bytes);
        self.counters.host_to_device_bytes += bytes.len() as u64;
    }
}

#[cfg(test)]
mod tests {
    use canopy_ir::{Dim, Scan, TensorType, UnaryOp};

    use super::*;

    /// x → a = exp(x) → scan(carry a, xs) whose result 0 only is read →
    /// e = neg(x) → out = result 0 + e.
    #[test]
    fn a_control_flow_nodes_results_live_in_their_outputs_buffers() {
        let mut body = Graph::new();
        let h = body.input("h", TensorType::f32(&[4])).expect("h");
        let x = body.input("x", TensorType::f32(&[4])).expect("x");
        let next = body.add(h, x).expect("h + x");
        body.set_output("h", next).expect("out");
        body.set_output("y", next).expect("out");
        let mut g = Graph::new();
        let x = g.input("x", TensorType::f32(&[4])).expect("x");
        let xs = g.input("xs", TensorType::f32(&[3, 4])).expect("xs");
        let a = g.unary(UnaryOp::Exp, x).expect("a");
        let scan = Scan {
            body,
            carries: 1,
            scanned: 1,
            length: Dim::Fixed(3),
            reverse: false,
            checkpoint: 0,
        };
        let tuple = g.push(Op::Scan(Box::new(scan)), &[a, xs]).expect("scan");
        let result = g.push(Op::Output { index: 0 }, &[tuple]).expect("output");
        let e = g.unary(UnaryOp::Neg, x).expect("e");
        let out = g.add(result, e).expect("out");
        g.set_output("out", out).expect("out");
        let shapes: Vec<Vec<usize>> = g.nodes().iter().map(|n| n.ty.shape.resolve(1)).collect();
        let result_bytes: Vec<Vec<u64>> = (0..g.len())
            .map(|i| {
                if i == tuple.index() {
                    vec![16, 48]
                } else {
                    Vec::new()
                }
            })
            .collect();
        let layout = assign_storage(&g, &shapes, &Fusion::none(&g), &result_bytes);
        let at = |id: ValueId| layout.storage[id.index()];
        assert_eq!(at(tuple), None, "the tuple itself has no buffer");
        let k = layout.results[tuple.index()][0].expect("result 0 is read");
        assert_eq!(
            at(result),
            Some(Storage::Pooled(k)),
            "the output is its result"
        );
        assert_eq!(
            layout.results[tuple.index()][1],
            None,
            "no output reads the ys"
        );
        assert_ne!(
            at(a),
            at(result),
            "a result never shares its operand's buffer"
        );
        assert_ne!(at(e), at(result), "nor a value made while it is read");
        assert_eq!(layout.sizes[k], 16);
    }
}
