//! The backend seam: a backend compiles a verified graph into an
//! executable. The IR never changes for a backend; the GPU backend
//! (`gpu`) and an NPU-delegate backend implement these two traits and
//! reject ops they do not support from `compile` with
//! `EngineError::Unsupported`, so the caller can fall back to the CPU,
//! which runs every op.
//!
//! **Residency.** A training loop feeds the same parameters and optimizer
//! state to every step and gets their next values back. An executable can
//! keep such inputs *resident* (on the device, for a GPU): after
//! [`Executable::make_resident`], [`Executable::run_resident`] takes only
//! the other inputs (the batch, the learning rate), writes each output
//! named like a resident input over that input where it lives, and returns
//! only the remaining outputs (loss, metrics). The model crosses the
//! host–device boundary twice per training run, not twice per step. The
//! CPU backend implements the same API with [`HostResidency`], so the
//! trainer has one code path.

use canopy_ir::Graph;

use crate::error::{EngineError, EngineResult};
use crate::value::Value;

pub trait Backend: Send + Sync {
    /// Short name, e.g. `cpu`.
    fn name(&self) -> &'static str;

    /// Compiles `graph` (already verified) into something that runs it.
    fn compile(&self, graph: &Graph) -> EngineResult<Box<dyn Executable>>;

    /// What this backend runs on, for reports (`model bench`, enrolment).
    fn describe(&self) -> BackendInfo {
        BackendInfo {
            backend: self.name().to_string(),
            adapter: None,
        }
    }
}

/// A backend and, for a GPU, the adapter it drives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackendInfo {
    pub backend: String,
    pub adapter: Option<AdapterInfo>,
}

/// A GPU adapter as the driver names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdapterInfo {
    pub name: String,
    /// `vulkan`, `metal`, `dx12` or `gl`.
    pub api: String,
    /// `discrete`, `integrated`, `virtual`, `cpu` or `other`.
    pub device_type: String,
    pub driver: String,
    /// The largest storage buffer one kernel may bind, in bytes.
    pub max_buffer_bytes: u64,
    /// The largest workgroup count per dispatch dimension.
    pub max_workgroups_per_dimension: u32,
}

/// Bytes that crossed between host and device, counted by the backend
/// since the executable was compiled. Zero on the CPU, whose values never
/// leave the host.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TransferCounters {
    pub host_to_device_bytes: u64,
    pub device_to_host_bytes: u64,
    /// Command-buffer submissions.
    pub submissions: u64,
    /// Compute dispatches (kernels run) over all submissions, finiteness
    /// checks included.
    pub dispatches: u64,
}

/// What [`Executable::run_resident`] returns.
#[derive(Debug)]
pub struct ResidentRun {
    /// The outputs that replace no resident input, in graph order.
    pub outputs: Vec<Value>,
    /// The name of the first output that replaced a resident f32 input with
    /// a non-finite element, if any (checked where the values live).
    pub non_finite: Option<String>,
}

/// A compiled graph. `run` takes the inputs in the graph's input order, by
/// value, so a backend may reuse their buffers (a training step updates
/// parameters in place this way), and returns the outputs in order.
pub trait Executable: Send {
    fn run(&mut self, inputs: Vec<Value>) -> EngineResult<Vec<Value>>;

    /// Names of the graph's inputs, in order.
    fn input_names(&self) -> &[String];

    /// Names of the graph's outputs, in order.
    fn output_names(&self) -> &[String];

    /// Keeps the inputs at the given positions between runs, starting from
    /// these values (see the module doc). Replaces any earlier resident set.
    fn make_resident(&mut self, values: Vec<(usize, Value)>) -> EngineResult<()>;

    /// Runs with the resident inputs where they live; `inputs` are the
    /// others, in graph order.
    fn run_resident(&mut self, inputs: Vec<Value>) -> EngineResult<ResidentRun>;

    /// The resident values, copied to the host, by input position.
    fn read_resident(&mut self) -> EngineResult<Vec<(usize, Value)>>;

    /// Copies the resident values aside where they live (for a rollback),
    /// replacing the previous snapshot.
    fn snapshot_resident(&mut self) -> EngineResult<()>;

    /// Restores the resident values from the last snapshot.
    fn restore_resident(&mut self) -> EngineResult<()>;

    /// Host↔device traffic so far.
    fn transfers(&self) -> TransferCounters {
        TransferCounters::default()
    }
}

/// The [`Executable`] methods every backend whose values live on the host
/// shares (names, and residency through [`HostResidency`]), so the CPU and
/// ONNX Runtime backends keep one definition. Expects the fields
/// `input_names`, `output_names` and `residency`; `run` stays the
/// backend's own.
#[macro_export]
macro_rules! host_resident_methods {
    () => {
        fn input_names(&self) -> &[String] {
            &self.input_names
        }

        fn output_names(&self) -> &[String] {
            &self.output_names
        }

        fn make_resident(
            &mut self,
            values: Vec<(usize, $crate::Value)>,
        ) -> $crate::EngineResult<()> {
            self.residency =
                $crate::backend::HostResidency::new(&self.input_names, &self.output_names, values)?;
            Ok(())
        }

        fn run_resident(
            &mut self,
            inputs: Vec<$crate::Value>,
        ) -> $crate::EngineResult<$crate::backend::ResidentRun> {
            let all = self.residency.splice(inputs)?;
            let outputs = self.run(all)?;
            Ok(self.residency.absorb(outputs, &self.output_names))
        }

        fn read_resident(&mut self) -> $crate::EngineResult<Vec<(usize, $crate::Value)>> {
            Ok(self.residency.read())
        }

        fn snapshot_resident(&mut self) -> $crate::EngineResult<()> {
            self.residency.snapshot();
            Ok(())
        }

        fn restore_resident(&mut self) -> $crate::EngineResult<()> {
            self.residency.restore();
            Ok(())
        }
    };
}

/// Residency for a backend whose values live on the host: resident values
/// are kept as `Value`s and spliced into each run's inputs, by ownership,
/// so in-place updates still happen.
#[derive(Debug, Default)]
pub struct HostResidency {
    /// By input position.
    values: Vec<Option<Value>>,
    /// For each output, the input position it replaces when resident.
    output_targets: Vec<Option<usize>>,
    snapshot: Vec<(usize, Value)>,
}

impl HostResidency {
    /// Makes `values` resident for a graph with these input and output
    /// names; an output replaces the resident input of the same name.
    pub fn new(
        input_names: &[String],
        output_names: &[String],
        values: Vec<(usize, Value)>,
    ) -> EngineResult<HostResidency> {
        let mut slots: Vec<Option<Value>> = vec![None; input_names.len()];
        for (position, value) in values {
            let slot = slots.get_mut(position).ok_or_else(|| {
                EngineError::Internal(format!(
                    "resident input {position} is out of range ({} inputs)",
                    input_names.len()
                ))
            })?;
            *slot = Some(value);
        }
        let output_targets = output_names
            .iter()
            .map(|name| {
                input_names
                    .iter()
                    .position(|input| input == name)
                    .filter(|&p| slots[p].is_some())
            })
            .collect();
        Ok(HostResidency {
            values: slots,
            output_targets,
            snapshot: Vec::new(),
        })
    }

    /// Whether input `position` is resident.
    pub fn is_resident(&self, position: usize) -> bool {
        self.values.get(position).is_some_and(Option::is_some)
    }

    /// How many inputs a resident run takes from the caller.
    pub fn fed_count(&self) -> usize {
        self.values.iter().filter(|v| v.is_none()).count()
    }

    /// All inputs in graph order: the resident ones taken out (they come
    /// back through [`HostResidency::absorb`]) and `fed` in the gaps.
    pub fn splice(&mut self, fed: Vec<Value>) -> EngineResult<Vec<Value>> {
        if fed.len() != self.fed_count() {
            return Err(EngineError::Internal(format!(
                "a resident run takes {} inputs, got {}",
                self.fed_count(),
                fed.len()
            )));
        }
        let replaced: Vec<bool> = (0..self.values.len())
            .map(|p| self.output_targets.contains(&Some(p)))
            .collect();
        let mut fed = fed.into_iter();
        let mut all = Vec::with_capacity(self.values.len());
        for (position, slot) in self.values.iter_mut().enumerate() {
            let value = match slot {
                Some(_) if replaced[position] => slot.take(),
                Some(value) => Some(value.clone()),
                None => fed.next(),
            };
            all.push(value.ok_or_else(|| {
                EngineError::Internal(format!("resident input {position} is missing"))
            })?);
        }
        Ok(all)
    }

    /// Takes a run's outputs: those that replace resident inputs go back
    /// in; the rest are returned, with the first non-finite replacement.
    pub fn absorb(&mut self, outputs: Vec<Value>, output_names: &[String]) -> ResidentRun {
        let mut returned = Vec::new();
        let mut non_finite = None;
        for ((value, target), name) in outputs
            .into_iter()
            .zip(&self.output_targets)
            .zip(output_names)
        {
            match target {
                Some(position) => {
                    if non_finite.is_none() && !is_finite(&value) {
                        non_finite = Some(name.clone());
                    }
                    self.values[*position] = Some(value);
                }
                None => returned.push(value),
            }
        }
        ResidentRun {
            outputs: returned,
            non_finite,
        }
    }

    pub fn read(&self) -> Vec<(usize, Value)> {
        self.values
            .iter()
            .enumerate()
            .filter_map(|(p, v)| v.clone().map(|v| (p, v)))
            .collect()
    }

    pub fn snapshot(&mut self) {
        self.snapshot = self.read();
    }

    pub fn restore(&mut self) {
        for (position, value) in &self.snapshot {
            self.values[*position] = Some(value.clone());
        }
    }
}

/// Whether every element of an f32 value is finite (other dtypes always
/// are); see [`first_non_finite`].
pub fn is_finite(value: &Value) -> bool {
    let Value::F32(array) = value else {
        return true;
    };
    match array.as_slice_memory_order() {
        Some(values) => first_non_finite(values).is_none(),
        None => array.iter().all(|v| v.is_finite()),
    }
}

/// The index of the first NaN or infinite value. Blocks are checked
/// without a branch per element (`v·0` is 0 for finite `v` and NaN
/// otherwise, summed in 16 lanes that vectorise), and only a block that
/// fails is searched: the scan runs on every step's parameters and every
/// batch an app hands over, so it must cost next to nothing.
pub fn first_non_finite(values: &[f32]) -> Option<usize> {
    const BLOCK: usize = 256;
    let finite = |block: &[f32]| {
        let mut lanes = [0.0f32; 16];
        let chunks = block.chunks_exact(16);
        let rest = chunks.remainder();
        for chunk in chunks {
            for (lane, &v) in lanes.iter_mut().zip(chunk) {
                *lane += v * 0.0;
            }
        }
        lanes.iter().all(|l| *l == 0.0) && rest.iter().all(|v| v.is_finite())
    };
    let block = values.chunks(BLOCK).position(|block| !finite(block))?;
    let start = block * BLOCK;
    values[start..]
        .iter()
        .position(|v| !v.is_finite())
        .map(|i| start + i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_non_finite_value_is_found_in_any_block() {
        let mut values = vec![f32::MAX; 1000];
        assert_eq!(first_non_finite(&values), None);
        for (index, bad) in [
            (0, f32::NAN),
            (255, f32::INFINITY),
            (256, f32::NEG_INFINITY),
            (999, f32::NAN),
        ] {
            values[index] = bad;
            assert_eq!(first_non_finite(&values), Some(index));
            values[index] = f32::MIN;
        }
        values[700] = f32::NAN;
        values[300] = f32::NAN;
        assert_eq!(first_non_finite(&values), Some(300));
        assert_eq!(first_non_finite(&[]), None);
    }

    #[test]
    fn a_value_is_finite_whatever_its_layout() {
        let mut array = ndarray::ArrayD::from_elem(ndarray::IxDyn(&[40, 30]), 1.0f32);
        assert!(is_finite(&Value::F32(array.clone())));
        array[[39, 0]] = f32::NAN;
        assert!(!is_finite(&Value::F32(array.clone())));
        let transposed = array.t().to_owned();
        assert!(!is_finite(&Value::F32(transposed)));
    }
}
