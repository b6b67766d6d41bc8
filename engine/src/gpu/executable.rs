//! A compiled graph on the GPU: constants uploaded once, a plan per batch
//! size, resident inputs in buffers of their own, and one submission per
//! run (more where control flow decides on the host, see `control.rs`).

use std::collections::BTreeMap;
use std::sync::Arc;

use canopy_ir::{DType, Graph, ValueId};
use ndarray::{ArrayD, IxDyn};

use super::context::GpuContext;
use super::kernels::{FLAG_DIVISION_BY_ZERO, FLAG_INDEX_OUT_OF_RANGE, FLAG_OUTPUTS};
use super::plan::{Bound, Dispatch, Plan, Recorder, value_bytes};
use super::program::Program;
use super::wgsl::{self, HELPERS, flat_entry, grid};
use crate::backend::{Executable, ResidentRun, TransferCounters};
use crate::cpu::bind_batch;
use crate::error::{EngineError, EngineResult};
use crate::value::Value;

/// Plans kept per executable (one per batch size and mode); past it they
/// are all dropped and rebuilt on demand, which bounds memory when a
/// caller feeds many batch sizes.
pub const MAX_PLANS: usize = 8;

/// A resident input: its buffer, and the copy taken by a snapshot.
struct Resident {
    buffer: wgpu::Buffer,
    dtype: DType,
    shape: Vec<usize>,
    snapshot: Option<wgpu::Buffer>,
}

/// A plan with the buffers one run at its batch size needs.
struct Prepared {
    plan: Plan,
    /// Per graph input: the buffer a run reads it from.
    input_buffers: Vec<wgpu::Buffer>,
    /// Per graph output: the resident input it replaces, if any.
    targets: Vec<Option<usize>>,
    /// Checks that flag a non-finite element in each replacing f32 output.
    finite_checks: Vec<Dispatch>,
    staging: wgpu::Buffer,
}

pub struct GpuExecutable {
    context: Arc<GpuContext>,
    /// The graph, its constants and its bodies, compiled.
    program: Program,
    input_names: Vec<String>,
    output_names: Vec<String>,
    /// The run's flag words (`kernels::FLAG_*`).
    flags: wgpu::Buffer,
    resident: Vec<Option<Resident>>,
    prepared: BTreeMap<(usize, bool), Prepared>,
    counters: TransferCounters,
    /// Whether plans fuse elementwise chains (`fuse.rs`); off only to
    /// compare against.
    fuse: bool,
}

impl GpuExecutable {
    /// Compiles `graph`; `fuse` says whether plans fuse elementwise chains.
    pub fn new(context: Arc<GpuContext>, graph: &Graph, fuse: bool) -> EngineResult<GpuExecutable> {
        let mut counters = TransferCounters::default();
        let program = Program::new(&context, graph, &mut counters.host_to_device_bytes)?;
        let graph = &program.graph;
        let flags_bytes = 4 * (u64::from(FLAG_OUTPUTS) + graph.outputs().len() as u64);
        let flags = context.storage_buffer("flags", flags_bytes)?;
        Ok(GpuExecutable {
            input_names: graph.input_names().iter().map(|s| s.to_string()).collect(),
            output_names: graph.outputs().iter().map(|(n, _)| n.clone()).collect(),
            resident: (0..graph.inputs().len()).map(|_| None).collect(),
            context,
            program,
            flags,
            prepared: BTreeMap::new(),
            counters,
            fuse,
        })
    }

    fn is_resident(&self, position: usize) -> bool {
        self.resident.get(position).is_some_and(Option::is_some)
    }

    /// Runs with `fed` (position, value) pairs; in resident mode the other
    /// inputs are the resident ones and replacing outputs are kept.
    fn execute(
        &mut self,
        fed: Vec<(usize, Value)>,
        resident_mode: bool,
    ) -> EngineResult<ResidentRun> {
        let pairs: Vec<(ValueId, &Value)> = fed
            .iter()
            .map(|(position, value)| (self.program.graph.inputs()[*position], value))
            .collect();
        let batch = bind_batch(&self.program.graph, &pairs)?;
        let key = (batch, resident_mode);
        if !self.prepared.contains_key(&key) {
            if self.prepared.len() >= MAX_PLANS {
                self.prepared.clear();
            }
            let prepared = self.prepare(batch, resident_mode)?;
            self.prepared.insert(key, prepared);
        }
        let prepared = &self.prepared[&key];
        let queue = self.context.queue();
        for (position, value) in &fed {
            let bytes = to_bytes(value);
            if !bytes.is_empty() {
                queue.write_buffer(&prepared.input_buffers[*position], 0, &bytes);
            }
            self.counters.host_to_device_bytes += bytes.len() as u64;
        }
        let (returned, counters, submitted) = self.record_and_submit(prepared, resident_mode)?;
        self.counters.submissions += counters.submissions;
        self.counters.dispatches += counters.dispatches;
        self.counters.host_to_device_bytes += counters.host_to_device_bytes;
        self.counters.device_to_host_bytes += counters.device_to_host_bytes;
        let bytes =
            self.context
                .read(&prepared.staging, submitted, "the outputs' staging buffer")?;
        self.counters.device_to_host_bytes += bytes.len() as u64;
        self.unpack(&bytes, &returned, prepared)
    }

    /// Records the plan, the finiteness checks, the resident updates and
    /// the copies of the returned outputs and flags into the staging
    /// buffer, and submits: once, unless control flow submits on the way.
    /// Returns the returned outputs' positions, what the recording did and
    /// the last submission.
    fn record_and_submit(
        &self,
        prepared: &Prepared,
        resident_mode: bool,
    ) -> EngineResult<(Vec<usize>, TransferCounters, Option<wgpu::SubmissionIndex>)> {
        let mut recorder = Recorder::new(&self.context);
        recorder.encoder().clear_buffer(&self.flags, 0, None);
        prepared.plan.record(&mut recorder)?;
        recorder.kernels(&prepared.finite_checks);
        let bound = self.bound(prepared);
        let mut returned = Vec::new();
        let mut offset = 0u64;
        for (j, (_, id)) in self.program.graph.outputs().iter().enumerate() {
            let source = prepared.plan.buffer(&bound, id.index())?;
            let bytes = value_bytes(
                self.program.graph.ty(*id).dtype,
                &prepared.plan.shapes[id.index()],
            );
            match prepared.targets[j].filter(|_| resident_mode) {
                Some(position) => {
                    let target = &self.resident[position]
                        .as_ref()
                        .expect("target is resident")
                        .buffer;
                    recorder.copy(source, 0, target, 0, bytes);
                }
                None => {
                    recorder.copy(source, 0, &prepared.staging, offset, bytes);
                    offset += bytes;
                    returned.push(j);
                }
            }
        }
        let flags_bytes = self.flags.size();
        recorder.copy(&self.flags, 0, &prepared.staging, offset, flags_bytes);
        recorder.submit();
        Ok((returned, recorder.counters, recorder.submitted))
    }

    fn bound<'a>(&'a self, prepared: &'a Prepared) -> Bound<'a> {
        Bound {
            inputs: &prepared.input_buffers,
            constants: &self.program.constants,
            flags: &self.flags,
        }
    }

    fn unpack(
        &self,
        bytes: &[u8],
        returned: &[usize],
        prepared: &Prepared,
    ) -> EngineResult<ResidentRun> {
        let mut outputs = Vec::with_capacity(returned.len());
        let mut offset = 0usize;
        for &j in returned {
            let id = self.program.graph.outputs()[j].1;
            let dtype = self.program.graph.ty(id).dtype;
            let shape = &prepared.plan.shapes[id.index()];
            let len = value_bytes(dtype, shape) as usize;
            outputs.push(from_bytes(dtype, shape, &bytes[offset..offset + len])?);
            offset += len;
        }
        let flags: Vec<u32> = bytes[offset..]
            .chunks_exact(4)
            .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
            .collect();
        let flag = |word: u32| flags.get(word as usize).copied().unwrap_or(0) != 0;
        if flag(FLAG_INDEX_OUT_OF_RANGE) {
            return Err(EngineError::Gpu {
                what: "a gather or scatter_add".to_string(),
                cause: "an index was out of range (or beyond 32 bits)".to_string(),
            });
        }
        if flag(FLAG_DIVISION_BY_ZERO) {
            return Err(EngineError::Gpu {
                what: "an integer div".to_string(),
                cause: "division by zero".to_string(),
            });
        }
        let non_finite = (0..self.output_names.len())
            .find(|&j| flag(FLAG_OUTPUTS + j as u32))
            .map(|j| self.output_names[j].clone());
        Ok(ResidentRun {
            outputs,
            non_finite,
        })
    }

    fn prepare(&self, batch: usize, resident_mode: bool) -> EngineResult<Prepared> {
        let mut input_buffers = Vec::with_capacity(self.program.graph.inputs().len());
        for (position, &id) in self.program.graph.inputs().iter().enumerate() {
            match &self.resident[position] {
                Some(resident) if resident_mode => input_buffers.push(resident.buffer.clone()),
                _ => {
                    let ty = self.program.graph.ty(id);
                    let bytes = value_bytes(ty.dtype, &ty.shape.resolve(batch));
                    let what = format!("input `{}`", self.input_names[position]);
                    input_buffers.push(self.context.storage_buffer(&what, bytes)?);
                }
            }
        }
        let bound = Bound {
            inputs: &input_buffers,
            constants: &self.program.constants,
            flags: &self.flags,
        };
        let plan = Plan::new(&self.context, &self.program, batch, self.fuse, &bound)?;
        let targets: Vec<Option<usize>> = self
            .output_names
            .iter()
            .map(|name| {
                self.input_names
                    .iter()
                    .position(|input| input == name)
                    .filter(|&p| resident_mode && self.is_resident(p))
            })
            .collect();
        let mut staging_bytes = self.flags.size();
        let mut finite_checks = Vec::new();
        for (j, (_, id)) in self.program.graph.outputs().iter().enumerate() {
            let dtype = self.program.graph.ty(*id).dtype;
            let shape = &plan.shapes[id.index()];
            if targets[j].is_none() {
                staging_bytes += value_bytes(dtype, shape);
            } else if dtype == DType::F32 && value_bytes(dtype, shape) > 0 {
                let bound = Bound {
                    inputs: &input_buffers,
                    constants: &self.program.constants,
                    flags: &self.flags,
                };
                let buffer = plan.buffer(&bound, id.index())?;
                finite_checks.push(self.finite_check(buffer, shape, j)?);
            }
        }
        let staging = self.context.staging_buffer(staging_bytes)?;
        Ok(Prepared {
            plan,
            input_buffers,
            targets,
            finite_checks,
            staging,
        })
    }

    /// A dispatch that sets flag word `FLAG_OUTPUTS + output` if `buffer` (f32 of
    /// `shape`) holds a NaN or an infinity; it tests the exponent bits,
    /// since WGSL may assume floats are finite.
    fn finite_check(
        &self,
        buffer: &wgpu::Buffer,
        shape: &[usize],
        output: usize,
    ) -> EngineResult<Dispatch> {
        let n = shape.iter().product::<usize>() as u64;
        let groups = grid(n, self.context.max_workgroups());
        let mut source = String::from(HELPERS);
        wgsl::declare(&mut source, 0, "a0", DType::F32, false);
        source.push_str("@group(0) @binding(1) var<storage, read_write> flags: array<u32>;\n");
        flat_entry(
            &mut source,
            n,
            groups,
            &format!(
                "  if (!is_finite_bits(a0[i])) {{ flags[{}u] = 1u; }}",
                FLAG_OUTPUTS as usize + output
            ),
        );
        let pipeline = self.context.pipeline("finite_check", &source)?;
        let bind_group = self
            .context
            .device()
            .create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some("finite_check"),
                layout: &pipeline.get_bind_group_layout(0),
                entries: &[
                    wgpu::BindGroupEntry {
                        binding: 0,
                        resource: buffer.as_entire_binding(),
                    },
                    wgpu::BindGroupEntry {
                        binding: 1,
                        resource: self.flags.as_entire_binding(),
                    },
                ],
            });
        Ok(Dispatch {
            pipeline,
            bind_group,
            workgroups: groups,
        })
    }

    /// Copies between each resident buffer and its snapshot, on the device.
    fn copy_snapshots(&mut self, to_snapshot: bool) -> EngineResult<()> {
        let device = self.context.device().clone();
        let mut encoder = device.create_command_encoder(&wgpu::CommandEncoderDescriptor {
            label: Some("canopy snapshot"),
        });
        for resident in self.resident.iter_mut().flatten() {
            let size = resident.buffer.size();
            if to_snapshot && resident.snapshot.is_none() {
                resident.snapshot = Some(self.context.storage_buffer("snapshot", size)?);
            }
            let Some(snapshot) = &resident.snapshot else {
                continue;
            };
            if to_snapshot {
                encoder.copy_buffer_to_buffer(&resident.buffer, 0, snapshot, 0, size);
            } else {
                encoder.copy_buffer_to_buffer(snapshot, 0, &resident.buffer, 0, size);
            }
        }
        self.context.queue().submit([encoder.finish()]);
        self.counters.submissions += 1;
        Ok(())
    }
}

impl Executable for GpuExecutable {
    fn run(&mut self, inputs: Vec<Value>) -> EngineResult<Vec<Value>> {
        if inputs.len() != self.input_names.len() {
            return Err(EngineError::InputCount {
                expected: self.input_names.clone(),
                got: inputs.len(),
            });
        }
        Ok(self
            .execute(inputs.into_iter().enumerate().collect(), false)?
            .outputs)
    }

    fn input_names(&self) -> &[String] {
        &self.input_names
    }

    fn output_names(&self) -> &[String] {
        &self.output_names
    }

    fn make_resident(&mut self, values: Vec<(usize, Value)>) -> EngineResult<()> {
        self.prepared.clear();
        self.resident = (0..self.input_names.len()).map(|_| None).collect();
        for (position, value) in values {
            let &id = self.program.graph.inputs().get(position).ok_or_else(|| {
                EngineError::Internal(format!("resident input {position} is out of range"))
            })?;
            let ty = self.program.graph.ty(id);
            let name = &self.input_names[position];
            if ty.shape.as_fixed().is_none() {
                return Err(EngineError::Input {
                    name: name.clone(),
                    cause: "only an input of static shape can stay on the device".to_string(),
                });
            }
            bind_batch(&self.program.graph, &[(id, &value)])?;
            let bytes = to_bytes(&value);
            let buffer = self
                .context
                .storage_buffer(&format!("resident `{name}`"), bytes.len() as u64)?;
            self.context.queue().write_buffer(&buffer, 0, &bytes);
            self.counters.host_to_device_bytes += bytes.len() as u64;
            self.resident[position] = Some(Resident {
                buffer,
                dtype: value.dtype(),
                shape: value.shape().to_vec(),
                snapshot: None,
            });
        }
        Ok(())
    }

    fn run_resident(&mut self, inputs: Vec<Value>) -> EngineResult<ResidentRun> {
        let fed: Vec<usize> = (0..self.input_names.len())
            .filter(|&p| !self.is_resident(p))
            .collect();
        if inputs.len() != fed.len() {
            return Err(EngineError::InputCount {
                expected: fed.iter().map(|&p| self.input_names[p].clone()).collect(),
                got: inputs.len(),
            });
        }
        self.execute(fed.into_iter().zip(inputs).collect(), true)
    }

    fn read_resident(&mut self) -> EngineResult<Vec<(usize, Value)>> {
        let total: u64 = self
            .resident
            .iter()
            .flatten()
            .map(|r| r.buffer.size())
            .sum();
        let staging = self.context.staging_buffer(total)?;
        let mut encoder =
            self.context
                .device()
                .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                    label: Some("canopy read"),
                });
        let mut offset = 0u64;
        for resident in self.resident.iter().flatten() {
            encoder.copy_buffer_to_buffer(
                &resident.buffer,
                0,
                &staging,
                offset,
                resident.buffer.size(),
            );
            offset += resident.buffer.size();
        }
        let submitted = self.context.queue().submit([encoder.finish()]);
        self.counters.submissions += 1;
        let bytes = self.context.read(
            &staging,
            Some(submitted),
            "the resident values' staging buffer",
        )?;
        self.counters.device_to_host_bytes += bytes.len() as u64;
        let mut values = Vec::new();
        let mut offset = 0usize;
        for (position, resident) in self.resident.iter().enumerate() {
            let Some(resident) = resident else { continue };
            let len = value_bytes(resident.dtype, &resident.shape) as usize;
            values.push((
                position,
                from_bytes(
                    resident.dtype,
                    &resident.shape,
                    &bytes[offset..offset + len],
                )?,
            ));
            offset += resident.buffer.size() as usize;
        }
        Ok(values)
    }

    fn snapshot_resident(&mut self) -> EngineResult<()> {
        self.copy_snapshots(true)
    }

    fn restore_resident(&mut self) -> EngineResult<()> {
        self.copy_snapshots(false)
    }

    fn transfers(&self) -> TransferCounters {
        self.counters
    }
}

/// A value's elements as the device stores them (little-endian; bool as
/// u32; i64 as its two 32-bit halves, low first, which is its own
/// little-endian layout).
pub(super) fn to_bytes(value: &Value) -> Vec<u8> {
    match value {
        Value::F32(a) => a.iter().flat_map(|v| v.to_le_bytes()).collect(),
        Value::I32(a) => a.iter().flat_map(|v| v.to_le_bytes()).collect(),
        Value::I64(a) => a.iter().flat_map(|v| v.to_le_bytes()).collect(),
        Value::Bool(a) => a.iter().flat_map(|v| u32::from(*v).to_le_bytes()).collect(),
    }
}

fn from_bytes(dtype: DType, shape: &[usize], bytes: &[u8]) -> EngineResult<Value> {
    let words = |n: usize| bytes.chunks_exact(n);
    let shape = IxDyn(shape);
    let built = match dtype {
        DType::F32 => ArrayD::from_shape_vec(
            shape,
            words(4)
                .map(|w| f32::from_le_bytes([w[0], w[1], w[2], w[3]]))
                .collect(),
        )
        .map(Value::F32),
        DType::I32 => ArrayD::from_shape_vec(
            shape,
            words(4)
                .map(|w| i32::from_le_bytes([w[0], w[1], w[2], w[3]]))
                .collect(),
        )
        .map(Value::I32),
        DType::I64 => ArrayD::from_shape_vec(
            shape,
            words(8)
                .map(|w| i64::from_le_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]))
                .collect(),
        )
        .map(Value::I64),
        DType::Bool => ArrayD::from_shape_vec(shape, words(4).map(|w| w != [0, 0, 0, 0]).collect())
            .map(Value::Bool),
    };
    built.map_err(|e| EngineError::Internal(format!("GPU output of the wrong size: {e}")))
}
