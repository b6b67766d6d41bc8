//! A graph laid out for one batch size: buffers assigned by liveness,
//! pipelines and bind groups made once, dispatches in order.

use std::collections::BTreeMap;
use std::sync::Arc;

use canopy_ir::{DType, Graph, Op};

use super::context::GpuContext;
use super::kernels::{self, Bind, Kernel, Site};
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
}

impl Plan {
    pub fn new(
        context: &GpuContext,
        graph: &Graph,
        batch: usize,
        input_buffers: &[wgpu::Buffer],
        constants: &BTreeMap<usize, wgpu::Buffer>,
        flags: &wgpu::Buffer,
    ) -> EngineResult<Plan> {
        let shapes: Vec<Vec<usize>> = graph
            .nodes()
            .iter()
            .map(|node| node.ty.shape.resolve(batch))
            .collect();
        let (storage, pool_sizes) = assign_storage(graph, &shapes);
        let mut pool = Vec::with_capacity(pool_sizes.len());
        for (k, bytes) in pool_sizes.iter().enumerate() {
            pool.push(context.storage_buffer(&format!("pooled buffer {k}"), *bytes)?);
        }
        let bound = Bound {
            inputs: input_buffers,
            constants,
            flags,
        };
        let mut plan = Plan {
            shapes,
            storage,
            pool,
            dispatches: Vec::new(),
        };
        for (index, node) in graph.nodes().iter().enumerate() {
            if matches!(
                node.op,
                Op::Input { .. } | Op::Constant(_) | Op::Reshape { .. }
            ) {
                continue;
            }
            let site = Site {
                op: &node.op,
                operands: node
                    .inputs
                    .iter()
                    .map(|id| (graph.ty(*id).dtype, plan.shapes[id.index()].clone()))
                    .collect(),
                out: (node.ty.dtype, plan.shapes[index].clone()),
                max_workgroups: context.max_workgroups(),
            };
            if plan.shapes[index].iter().product::<usize>() == 0 {
                continue;
            }
            let generated = kernels::generate(&site).map_err(|what| {
                EngineError::Internal(format!("node %{index} ({}): {what}", node.op.name()))
            })?;
            for kernel in generated {
                let dispatch = plan.dispatch(context, &bound, graph, index, &kernel)?;
                plan.dispatches.push(dispatch);
            }
        }
        Ok(plan)
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
        graph: &Graph,
        index: usize,
        kernel: &Kernel,
    ) -> EngineResult<Dispatch> {
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
        let node = &graph.nodes()[index];
        let mut buffers = Vec::with_capacity(kernel.bindings.len());
        for bind in &kernel.bindings {
            buffers.push(match bind {
                Bind::Operand(k) => self.buffer(bound, node.inputs[*k].index())?,
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
/// its operand's, every other node a pooled buffer. A pooled buffer is
/// free again after the last reader of every value stored in it; the
/// smallest free buffer that fits is reused, else a new one is made.
/// Returns the storages and the pool's buffer sizes.
fn assign_storage(graph: &Graph, shapes: &[Vec<usize>]) -> (Vec<Option<Storage>>, Vec<u64>) {
    let nodes = graph.nodes();
    let input_position: BTreeMap<usize, usize> = graph
        .inputs()
        .iter()
        .enumerate()
        .map(|(k, id)| (id.index(), k))
        .collect();
    // The last node reading each node's value; graph outputs live to the end.
    let mut last_use: Vec<usize> = (0..nodes.len()).collect();
    for (index, node) in nodes.iter().enumerate() {
        for input in &node.inputs {
            last_use[input.index()] = index;
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
        storage[index] = Some(match &node.op {
            Op::Input { .. } => Storage::Input(input_position[&index]),
            Op::Constant(_) => Storage::Constant(index),
            Op::Reshape { .. } => {
                let from = node.inputs[0].index();
                let shared = storage[from].expect("operands precede their readers");
                if let Storage::Pooled(k) = shared {
                    busy_until[k] = busy_until[k].max(last_use[index]);
                }
                shared
            }
            _ => {
                let bytes = value_bytes(node.ty.dtype, &shapes[index]).max(4);
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
                Storage::Pooled(k)
            }
        });
        // Buffers whose every value has been read by now are free.
        for (k, until) in busy_until.iter().enumerate() {
            if *until == index && !free.contains(&k) && *until != usize::MAX {
                free.push(k);
            }
        }
    }
    (storage, sizes)
}
