//! Control flow on the GPU: `scan`, `cond` and `while_loop` run from the
//! host over their bodies' plans, with every tensor kept on the device.
//!
//! - Each body or branch is compiled once with its node (`Program`) and
//!   laid out as a [`Plan`] of its own when the enclosing plan is, so once
//!   per batch size, bound to the enclosing plan's buffers.
//! - The values a body reads from the enclosing graph (a loop's
//!   constants, such as a recurrent layer's weights, and all of a
//!   branch's operands) are bound where they live, never copied.
//! - A loop's carries live in buffers of the body's own, which it reads;
//!   after each step the body's new carries are copied over them on the
//!   device. A scan's step of each scanned input is copied from its offset
//!   into the body's input buffer, and each per-step output is copied into
//!   its offset of the stacked result.
//! - A `scan` therefore records all its steps into the run's command
//!   buffers with no host round trip: its trip count is known.
//! - `cond` and `while_loop` decide on the host. Each reads one 32-bit word
//!   back per decision (the predicate, or the condition before every
//!   trip), and each read is a submission and a wait for the device to
//!   finish everything before it; a while loop of n trips costs n + 1 of
//!   them. The trip count is written to its result from the host.

use canopy_ir::Op;

use super::context::GpuContext;
use super::plan::{Bound, Plan, Recorder};
use super::program::{Program, roles, within};
use crate::error::{EngineError, EngineResult};

/// A control-flow node in the enclosing plan.
pub struct At<'a> {
    pub node: usize,
    pub op: &'a Op,
    /// Per operand: its buffer in the enclosing plan.
    pub operands: Vec<wgpu::Buffer>,
    /// Per result: the buffer in the enclosing plan that holds it (none
    /// when no `output` reads it), and its bytes.
    pub results: Vec<(Option<wgpu::Buffer>, u64)>,
}

/// A control-flow node laid out for one batch size.
pub struct ControlPlan {
    node: usize,
    op: &'static str,
    results: Vec<(Option<wgpu::Buffer>, u64)>,
    kind: Kind,
}

enum Kind {
    Scan {
        body: Body,
        /// Per carry: its initial value's buffer and its bytes.
        initial: Vec<(wgpu::Buffer, u64)>,
        feeds: Vec<Feed>,
        /// Per scanned input: its buffer and the bytes of one step.
        xs: Vec<(wgpu::Buffer, u64)>,
        length: usize,
        reverse: bool,
    },
    Cond {
        predicate: wgpu::Buffer,
        /// Then, else.
        branches: [Body; 2],
        staging: wgpu::Buffer,
    },
    While {
        cond: Body,
        body: Body,
        /// Per carry: its initial value's buffer and its bytes.
        initial: Vec<(wgpu::Buffer, u64)>,
        /// Per carry: the buffer the condition and the body read it from.
        state: Vec<wgpu::Buffer>,
        feeds: Vec<Feed>,
        max_trips: usize,
        staging: wgpu::Buffer,
    },
}

/// A body or branch laid out: its plan, and its inputs' and outputs'
/// buffers.
struct Body {
    plan: Plan,
    inputs: Vec<wgpu::Buffer>,
    /// Per output: its buffer and its bytes.
    outputs: Vec<(wgpu::Buffer, u64)>,
}

/// How a loop body's new carry reaches the buffer the next step reads.
struct Feed {
    from: wgpu::Buffer,
    to: wgpu::Buffer,
    /// Where it waits while the carries are overwritten, when it is
    /// itself another carry's buffer (a body that swaps two carries, or
    /// passes one on as another): copied straight, it could be
    /// overwritten before it is read.
    via: Option<wgpu::Buffer>,
    bytes: u64,
}

impl Body {
    fn new(
        context: &GpuContext,
        program: &Program,
        batch: usize,
        fuse: bool,
        inputs: Vec<wgpu::Buffer>,
        flags: &wgpu::Buffer,
    ) -> EngineResult<Body> {
        let bound = Bound {
            inputs: &inputs,
            constants: &program.constants,
            flags,
        };
        let plan = Plan::new(context, program, batch, fuse, &bound)?;
        let graph = &program.graph;
        let outputs = graph
            .outputs()
            .iter()
            .map(|(_, id)| {
                let bytes = super::plan::value_bytes(graph.ty(*id).dtype, &plan.shapes[id.index()]);
                Ok((plan.buffer(&bound, id.index())?.clone(), bytes))
            })
            .collect::<EngineResult<Vec<_>>>()?;
        Ok(Body {
            plan,
            inputs,
            outputs,
        })
    }

    /// Input `k`'s bytes at `batch`.
    fn input_bytes(program: &Program, k: usize, batch: usize) -> u64 {
        let ty = program.graph.ty(program.graph.inputs()[k]);
        super::plan::value_bytes(ty.dtype, &ty.shape.resolve(batch))
    }
}

/// Per carry, how the body's new value reaches `state`, the buffers the
/// body reads the carries from.
fn feeds(
    context: &GpuContext,
    body: &Body,
    state: &[wgpu::Buffer],
    bytes: &[u64],
) -> EngineResult<Vec<Feed>> {
    (0..state.len())
        .map(|j| {
            let from = body.outputs[j].0.clone();
            let via = if from != state[j] && state.contains(&from) {
                Some(context.storage_buffer("a carry in passing", bytes[j])?)
            } else {
                None
            };
            Ok(Feed {
                from,
                to: state[j].clone(),
                via,
                bytes: bytes[j],
            })
        })
        .collect()
}

/// Carries `feeds` forward: first every carry that is another's buffer
/// aside, then each into place.
fn feed(recorder: &mut Recorder<'_>, feeds: &[Feed]) {
    for f in feeds {
        if let Some(via) = &f.via {
            recorder.copy(&f.from, 0, via, 0, f.bytes);
        }
    }
    for f in feeds {
        recorder.copy(f.via.as_ref().unwrap_or(&f.from), 0, &f.to, 0, f.bytes);
    }
}

impl ControlPlan {
    /// Lays out the node `at` with its compiled `bodies` at `batch`;
    /// `flags` are the run's flag words, which the bodies' kernels set too.
    pub fn new(
        context: &GpuContext,
        at: At<'_>,
        bodies: &[Program],
        batch: usize,
        fuse: bool,
        flags: &wgpu::Buffer,
    ) -> EngineResult<ControlPlan> {
        let (node, op) = (at.node, at.op);
        let named = |k: usize| move |e: EngineError| within(e, node, op, roles(op)[k]);
        let program = |k: usize| {
            bodies.get(k).ok_or_else(|| {
                EngineError::Internal(format!("node %{node} ({}) lacks graph {k}", op.name()))
            })
        };
        let body = |k: usize, inputs: Vec<wgpu::Buffer>| {
            Body::new(context, program(k)?, batch, fuse, inputs, flags).map_err(named(k))
        };
        // Buffers of the body's own for inputs `range`, which it reads
        // while the loop writes them.
        let own = |k: usize, range: std::ops::Range<usize>| {
            let program = program(k)?;
            range
                .map(|j| {
                    let bytes = Body::input_bytes(program, j, batch);
                    // Whole vec4s, as a pooled buffer: a kernel may bind
                    // it as `array<vec4<f32>>` (gemm.rs).
                    let size = bytes.next_multiple_of(16).max(16);
                    let buffer = context.storage_buffer(&format!("input {j}"), size);
                    Ok((buffer.map_err(named(k))?, bytes))
                })
                .collect::<EngineResult<Vec<_>>>()
        };
        let operands = at.operands;
        let kind = match op {
            Op::Scan(scan) => {
                let (c, s) = (scan.carries, scan.scanned);
                let owned = own(0, 0..c + s)?;
                let bytes: Vec<u64> = owned.iter().map(|(_, b)| *b).collect();
                let mut inputs: Vec<wgpu::Buffer> = owned.into_iter().map(|(b, _)| b).collect();
                inputs.extend(operands[c + s..].iter().cloned());
                let body = body(0, inputs)?;
                let feeds = feeds(context, &body, &body.inputs[..c], &bytes[..c])?;
                Kind::Scan {
                    initial: operands[..c]
                        .iter()
                        .cloned()
                        .zip(bytes[..c].to_vec())
                        .collect(),
                    xs: operands[c..c + s]
                        .iter()
                        .cloned()
                        .zip(bytes[c..].to_vec())
                        .collect(),
                    feeds,
                    body,
                    length: scan.length.resolve(batch),
                    reverse: scan.reverse,
                }
            }
            Op::Cond(_) => {
                let (predicate, operands) = operands.split_first().ok_or_else(|| {
                    EngineError::Internal(format!("cond node %{node} has no predicate"))
                })?;
                Kind::Cond {
                    predicate: predicate.clone(),
                    branches: [body(0, operands.to_vec())?, body(1, operands.to_vec())?],
                    staging: context.staging_buffer(4)?,
                }
            }
            Op::WhileLoop(w) => {
                let c = w.carries;
                let owned = own(1, 0..c)?;
                let bytes: Vec<u64> = owned.iter().map(|(_, b)| *b).collect();
                let state: Vec<wgpu::Buffer> = owned.into_iter().map(|(b, _)| b).collect();
                let mut inputs = state.clone();
                inputs.extend(operands[c..].iter().cloned());
                let cond = body(0, inputs.clone())?;
                let body = body(1, inputs)?;
                let feeds = feeds(context, &body, &state, &bytes)?;
                Kind::While {
                    cond,
                    body,
                    initial: operands[..c].iter().cloned().zip(bytes).collect(),
                    state,
                    feeds,
                    max_trips: w.max_trips,
                    staging: context.staging_buffer(4)?,
                }
            }
            other => {
                return Err(EngineError::Internal(format!(
                    "`{}` (node %{node}) is not a control-flow op",
                    other.name()
                )));
            }
        };
        Ok(ControlPlan {
            node,
            op: op.name(),
            results: at.results,
            kind,
        })
    }

    /// Copies `from` into result `r`'s buffer, when an `output` reads it.
    fn to_result(&self, recorder: &mut Recorder<'_>, r: usize, from: &wgpu::Buffer, bytes: u64) {
        if let Some((Some(result), _)) = self.results.get(r) {
            recorder.copy(from, 0, result, 0, bytes);
        }
    }

    /// Records the node's work; a `cond` or `while_loop` submits and waits
    /// for each decision.
    pub fn record(&self, recorder: &mut Recorder<'_>) -> EngineResult<()> {
        match &self.kind {
            Kind::Scan {
                body,
                initial,
                feeds,
                xs,
                length,
                reverse,
            } => {
                let c = initial.len();
                if *length == 0 {
                    for (j, (from, bytes)) in initial.iter().enumerate() {
                        self.to_result(recorder, j, from, *bytes);
                    }
                    return Ok(());
                }
                for (j, (from, bytes)) in initial.iter().enumerate() {
                    recorder.copy(from, 0, &body.inputs[j], 0, *bytes);
                }
                for k in 0..*length {
                    let t = if *reverse { length - 1 - k } else { k };
                    for (j, (x, bytes)) in xs.iter().enumerate() {
                        recorder.copy(x, t as u64 * bytes, &body.inputs[c + j], 0, *bytes);
                    }
                    body.plan.record(recorder)?;
                    for (i, (y, bytes)) in body.outputs[c..].iter().enumerate() {
                        if let Some((Some(stacked), _)) = self.results.get(c + i) {
                            recorder.copy(y, 0, stacked, t as u64 * bytes, *bytes);
                        }
                    }
                    if k + 1 < *length {
                        feed(recorder, feeds);
                    }
                    recorder.step_done();
                }
                for (j, (from, bytes)) in body.outputs[..c].iter().enumerate() {
                    self.to_result(recorder, j, from, *bytes);
                }
            }
            Kind::Cond {
                predicate,
                branches,
                staging,
            } => {
                let what = format!("the predicate of node %{} ({})", self.node, self.op);
                let taken = recorder.read_word(predicate, staging, &what)? != 0;
                let branch = &branches[if taken { 0 } else { 1 }];
                branch.plan.record(recorder)?;
                for (r, (from, bytes)) in branch.outputs.iter().enumerate() {
                    self.to_result(recorder, r, from, *bytes);
                }
            }
            Kind::While {
                cond,
                body,
                initial,
                state,
                feeds,
                max_trips,
                staging,
            } => {
                for ((from, bytes), to) in initial.iter().zip(state) {
                    recorder.copy(from, 0, to, 0, *bytes);
                }
                let what = format!("the condition of node %{} ({})", self.node, self.op);
                let mut trips = 0usize;
                while trips < *max_trips {
                    cond.plan.record(recorder)?;
                    let go = &cond.outputs[0].0;
                    if recorder.read_word(go, staging, &what)? == 0 {
                        break;
                    }
                    body.plan.record(recorder)?;
                    feed(recorder, feeds);
                    trips += 1;
                }
                for (j, (to, (_, bytes))) in state.iter().zip(initial).enumerate() {
                    self.to_result(recorder, j, to, *bytes);
                }
                if let Some((Some(count), _)) = self.results.get(state.len()) {
                    recorder.write(count, &(trips as i64).to_le_bytes());
                }
            }
        }
        Ok(())
    }
}
