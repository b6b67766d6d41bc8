//! A graph laid out for one batch size: elementwise nodes fused (see
//! `fuse.rs`), buffers assigned by liveness, pipelines and bind groups
//! made once, dispatches in order.

use std::collections::BTreeMap;
use std::sync::Arc;

use canopy_ir::{DType, Graph, Op};

use super::context::GpuContext;
use super::fuse::{Fusion, Group};
use super::kernels::{self, Bind, FusedMember, FusedOperand, FusedSite, Kernel, Site};
use super::wgsl::element_bytes;
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

/// The buffers a plan binds that it does not own.
pub struct Bound<'a> {
    pub inputs: &'a [wgpu::Buffer],
    pub constants: &'a BTreeMap<usize, wgpu::Buffer>,
    pub flags: &'a wgpu::Buffer,
}

pub struct Plan {
    /// Per node: resolved shape.
    pub shapes: Vec<Vec<usize>>,
    /// Per node: where its value lives (None for nodes never computed).
    pub storage: Vec<Option<Storage>>,
    pub pool: Vec<wgpu::Buffer>,
    pub dispatches: Vec<Dispatch>,
    /// Which nodes are computed inside another node's kernel.
    pub fusion: Fusion,
}

/// What a dispatch reads and writes: node ids, operands in binding order.
struct Endpoints<'a> {
    operands: &'a [usize],
    output: usize,
}

impl Plan {
    pub fn new(
        context: &GpuContext,
        graph: &Graph,
        batch: usize,
        fuse: bool,
        bound: &Bound<'_>,
    ) -> EngineResult<Plan> {
        let shapes: Vec<Vec<usize>> = graph
            .nodes()
            .iter()
            .map(|node| node.ty.shape.resolve(batch))
            .collect();
        let fusion = if fuse {
            Fusion::plan(graph, &shapes, context.max_fused_inputs())
        } else {
            Fusion::none(graph)
        };
        let (storage, pool_sizes) = assign_storage(graph, &shapes, &fusion);
        let mut pool = Vec::with_capacity(pool_sizes.len());
        for (k, bytes) in pool_sizes.iter().enumerate() {
            pool.push(context.storage_buffer(&format!("pooled buffer {k}"), *bytes)?);
        }
        let mut plan = Plan {
            shapes,
            storage,
            pool,
            dispatches: Vec::new(),
            fusion,
        };
        // A node without a kernel (`Family::NoKernel`) generates none.
        for index in 0..graph.nodes().len() {
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
            self.dispatches.push(dispatch);
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
        self.dispatches.push(dispatch);
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

/// Gives each node a storage: inputs and constants their own, a reshape
/// its operand's, a node fused into another's kernel none, every other
/// node a pooled buffer. A value is read where its readers are computed
/// (a fused member's reads happen in its group's root), and a pooled
/// buffer is free again after the last reader of every value stored in
/// it; the smallest free buffer that fits is reused, else a new one is
/// made. Returns the storages and the pool's buffer sizes.
fn assign_storage(
    graph: &Graph,
    shapes: &[Vec<usize>],
    fusion: &Fusion,
) -> (Vec<Option<Storage>>, Vec<u64>) {
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
    let mut storage: Vec<Option<Storage>> = vec![None; nodes.len()];
    let mut sizes: Vec<u64> = Vec::new();
    let mut free: Vec<usize> = Vec::new();
    // Per pooled buffer: the last use of any value stored in it.
    let mut busy_until: Vec<usize> = Vec::new();
    for (index, node) in nodes.iter().enumerate() {
        storage[index] = match &node.op {
            _ if fusion.is_fused_away(index) => None,
            Op::Input { .. } => Some(Storage::Input(input_position[&index])),
            Op::Constant(_) => Some(Storage::Constant(index)),
            Op::Reshape { .. } => {
                let from = node.inputs[0].index();
                let shared = storage[from].expect("operands precede their readers");
                if let Storage::Pooled(k) = shared {
                    busy_until[k] = busy_until[k].max(last_use[index]);
                }
                Some(shared)
            }
            _ => {
                // Whole vec4s, so a kernel may bind any pooled buffer as
                // `array<vec4<f32>>` (gemm.rs).
                let bytes = value_bytes(node.ty.dtype, &shapes[index])
                    .next_multiple_of(16)
                    .max(16);
                let best = free
                    .iter()
                    .enumerate()
                    .filter(|(_, k)| sizes[**k] >= bytes)
                    .min_by_key(|(_, k)| sizes[**k])
                    .map(|(slot, _)| slot);
                let k = match best {
                    Some(slot) => free.swap_remove(slot),
                    None => {
                        sizes.push(bytes);
                        busy_until.push(0);
                        sizes.len() - 1
                    }
                };
                busy_until[k] = last_use[index];
                Some(Storage::Pooled(k))
            }
        };
        // Buffers whose every value has been read by now are free.
        for (k, until) in busy_until.iter().enumerate() {
            if *until == index && !free.contains(&k) && *until != usize::MAX {
                free.push(k);
            }
        }
    }
    (storage, sizes)
}
