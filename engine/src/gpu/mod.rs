//! The GPU backend: graphs compiled to WGSL compute pipelines on wgpu
//! (Vulkan, Metal, DX12).
//!
//! How a graph runs (see ARCHITECTURE.md, "The GPU backend"):
//! - `compile` checks every node against what the kernels support and
//!   refuses the graph with `EngineError::Unsupported`, naming the op,
//!   before anything reaches the device; the caller then uses the CPU.
//! - The first run at a batch size builds a [`plan::Plan`]: each node's
//!   shapes are resolved, its WGSL is generated with the shapes baked in
//!   as constants, and the pipeline comes from the context's cache, keyed
//!   by that source (so by op and shape). Values get buffers from a pool
//!   assigned by liveness; bind groups are made once per plan.
//! - Fusion ([`fuse`]): the plan groups the nodes of the elementwise
//!   kernel family (`kernels::Family`) into one kernel per group. A node
//!   joins its consumer's group when it is elementwise, has the group's
//!   output shape, is not a graph output and every consumer of it is in
//!   the group; broadcast operands are the group's inputs. At most 32
//!   nodes and 8 inputs (within the adapter's storage-buffer bindings) per
//!   group. Only the group's root is written; the others get no buffer.
//!   Why: a dispatch inside one submission costs 2–5 µs on an H100, and
//!   every materialised intermediate costs a write and a read of memory.
//! - A run is one command-buffer submission: the fed inputs are written,
//!   every kernel is dispatched in one compute pass, the returned outputs
//!   are copied to one staging buffer, which is mapped once.
//! - Control flow ([`control`]) runs from the host over its bodies' plans,
//!   with every tensor on the device: a `scan` records its steps into the
//!   same submission (a long one into a few), while `cond` and
//!   `while_loop` submit and read back one word per decision.
//! - Resident inputs (parameters, optimizer state) live in their own
//!   buffers; an output that replaces one is copied over it on the device
//!   at the end of the submission.
//!
//! Element types on the device: f32 as `f32`, i32 as `i32`, bool as `u32`
//! (0 or 1), i64 as two `u32` words (low, high), so seeds and counts keep
//! all 64 bits.

mod context;
mod control;
mod executable;
mod fuse;
mod kernels;
mod loader_env;
mod plan;
mod program;
mod wgsl;

use std::sync::Arc;

use canopy_ir::Graph;

pub use context::GpuContext;
pub use executable::GpuExecutable;
pub use loader_env::quiet_device_select_layer;

use crate::backend::{AdapterInfo, Backend, BackendInfo, Executable};
use crate::error::{EngineError, EngineResult};

/// Which adapter to use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AdapterPreference {
    /// A discrete GPU, else an integrated one, else any other adapter
    /// (virtual, or a CPU implementation such as lavapipe).
    Best,
    /// Only a real GPU (discrete or integrated).
    HardwareOnly,
}

/// The wgpu backend. Cheap to clone: clones share one device, its
/// pipeline cache and its counters.
#[derive(Clone)]
pub struct GpuBackend {
    context: Arc<GpuContext>,
    /// Whether executables fuse elementwise chains (on unless
    /// [`GpuBackend::with_fusion`] turns it off).
    fuse: bool,
}

impl std::fmt::Debug for GpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuBackend")
            .field("adapter", &self.context.adapter().name)
            .field("fuse", &self.fuse)
            .finish()
    }
}

impl GpuBackend {
    /// Opens the best adapter by `preference`, or says why there is none.
    pub fn new(preference: AdapterPreference) -> EngineResult<GpuBackend> {
        Ok(GpuBackend {
            context: Arc::new(GpuContext::open(preference)?),
            fuse: true,
        })
    }

    /// This backend on the same device, with fusion of elementwise chains
    /// on or off; off exists to measure and check fusion against.
    pub fn with_fusion(&self, fuse: bool) -> GpuBackend {
        GpuBackend {
            context: self.context.clone(),
            fuse,
        }
    }

    /// The adapter this backend drives.
    pub fn adapter(&self) -> &AdapterInfo {
        self.context.adapter()
    }

    pub fn context(&self) -> &Arc<GpuContext> {
        &self.context
    }
}

impl Backend for GpuBackend {
    fn name(&self) -> &'static str {
        "gpu"
    }

    fn compile(&self, graph: &Graph) -> EngineResult<Box<dyn Executable>> {
        Ok(Box::new(GpuExecutable::new(
            self.context.clone(),
            graph,
            self.fuse,
        )?))
    }

    fn describe(&self) -> BackendInfo {
        BackendInfo {
            backend: "gpu".to_string(),
            adapter: Some(self.context.adapter().clone()),
        }
    }
}

/// Every adapter wgpu finds, best first, for reports (`canopy model bench`
/// and device enrolment).
pub fn list_adapters() -> Vec<AdapterInfo> {
    context::ranked_adapters()
        .iter()
        .map(context::describe_adapter)
        .collect()
}

pub(crate) fn unsupported(what: impl Into<String>) -> EngineError {
    EngineError::Unsupported {
        backend: "gpu".to_string(),
        what: what.into(),
    }
}
