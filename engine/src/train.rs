//! Runners for a model file's `train_step` and `eval` graphs.
//!
//! The trainer keeps parameters and optimizer state as runtime values
//! between steps and hands them to the compiled step by ownership, so the
//! update is written into the same buffers step after step.

use std::collections::HashMap;

use canopy_ir::Model;
use canopy_ir::model::{ENTRY_EVAL, ENTRY_TRAIN_STEP, PARAM_PREFIX, STATE_PREFIX};

use crate::backend::{Backend, Executable};
use crate::error::{EngineError, EngineResult, NonFinite, Part};
use crate::optim::{INPUT_LR, INPUT_SEED, INPUT_STEP};
use crate::value::Value;

/// What one training step reports.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepStats {
    pub loss: f32,
    pub correct: i64,
}

/// What an evaluation pass reports.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EvalStats {
    pub loss: f64,
    pub accuracy: f64,
    pub samples: usize,
}

/// What feeds one input of an entry point.
#[derive(Clone, Debug, PartialEq)]
enum Slot {
    /// A model parameter, carried between steps; `trainable` as the model
    /// file marks it. Only trainable parameters are written back.
    Param {
        trainable: bool,
    },
    /// Optimizer state (`state/NAME/SLOT`), carried between steps from
    /// zeros; it is the trainer's, never written to the model.
    State,
    X,
    Y,
    Seed,
    Lr,
    Step,
}

pub struct Trainer {
    executable: Box<dyn Executable>,
    slots: Vec<Slot>,
    /// Carried values, by input position.
    carried: Vec<Option<Value>>,
    /// For each output, the input position it replaces (or None for
    /// `loss` / `correct`).
    output_targets: Vec<Option<usize>>,
    /// By input position: whether the step outputs the input's next value.
    /// Such a value is handed to the step by ownership (so the update runs
    /// in place) and checkpointed for rollback; the rest are cloned.
    replaced: Vec<bool>,
    loss_output: usize,
    correct_output: usize,
    steps: u64,
    seed: i64,
    /// (step, the values the step replaces) to roll back to when a step
    /// fails or diverges.
    checkpoint: Option<(u64, Vec<(usize, Value)>)>,
}

/// How often the trainer checkpoints for rollback, in steps.
pub const CHECKPOINT_EVERY_STEPS: u64 = 64;

impl Trainer {
    /// Compiles the model's `train_step`; optimizer state starts at zero.
    pub fn new(model: &Model, backend: &dyn Backend, seed: u64) -> EngineResult<Trainer> {
        let graph = model.entry(ENTRY_TRAIN_STEP)?;
        let executable = backend.compile(graph)?;
        let mut slots = Vec::new();
        let mut carried = Vec::new();
        for &input in graph.inputs() {
            let name = graph.input_name(input);
            let (slot, value) = classify_input(model, ENTRY_TRAIN_STEP, name, graph.ty(input))?;
            slots.push(slot);
            carried.push(value);
        }
        let position: HashMap<&str, usize> = graph
            .inputs()
            .iter()
            .enumerate()
            .map(|(i, &id)| (graph.input_name(id), i))
            .collect();
        let output_targets: Vec<Option<usize>> = graph
            .outputs()
            .iter()
            .map(|(name, _)| position.get(name.as_str()).copied())
            .collect();
        let mut replaced = vec![false; slots.len()];
        for &target in output_targets.iter().flatten() {
            replaced[target] = matches!(slots[target], Slot::Param { .. } | Slot::State);
        }
        let find = |name: &str| output_position(graph, ENTRY_TRAIN_STEP, name);
        Ok(Trainer {
            executable,
            slots,
            carried,
            output_targets,
            replaced,
            loss_output: find("loss")?,
            correct_output: find("correct")?,
            steps: 0,
            seed: seed as i64,
            checkpoint: None,
        })
    }

    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Runs one step on a batch. A step that yields a non-finite loss or
    /// parameter is an error, and the trainer rolls back to its last
    /// checkpoint, so a diverging run never leaves NaN weights behind.
    pub fn step(&mut self, x: Value, y: Value, lr: f32) -> EngineResult<StepStats> {
        if !(lr.is_finite() && lr > 0.0) {
            return Err(EngineError::LearningRate(lr));
        }
        if self.checkpoint.is_none() || self.steps.is_multiple_of(CHECKPOINT_EVERY_STEPS) {
            self.take_checkpoint();
        }
        let step_number = self.steps + 1;
        let inputs = self.step_inputs(x, y, lr, step_number)?;
        let outputs = match self.executable.run(inputs) {
            Ok(outputs) => outputs,
            Err(source) => {
                return Err(EngineError::Step {
                    step: step_number,
                    rolled_back_to: self.roll_back(),
                    source: Box::new(source),
                });
            }
        };
        let loss = outputs[self.loss_output].to_scalar_f32()?;
        let correct = count_of(&outputs[self.correct_output])?;
        if let Some(problem) = self.non_finite(loss, &outputs) {
            return Err(EngineError::Diverged {
                step: step_number,
                problem,
                rolled_back_to: self.roll_back(),
            });
        }
        for (value, target) in outputs.into_iter().zip(&self.output_targets) {
            if let Some(position) = target {
                self.carried[*position] = Some(value);
            }
        }
        self.steps = step_number;
        Ok(StepStats { loss, correct })
    }

    fn step_inputs(&mut self, x: Value, y: Value, lr: f32, step: u64) -> EngineResult<Vec<Value>> {
        let mut x = Some(x);
        let mut y = Some(y);
        let mut inputs = Vec::with_capacity(self.slots.len());
        let feeds = self.slots.iter().zip(&self.replaced).zip(&mut self.carried);
        for ((slot, &replaced), carried) in feeds {
            let value = match slot {
                Slot::Param { .. } | Slot::State if replaced => carried.take(),
                Slot::Param { .. } | Slot::State => carried.clone(),
                Slot::X => x.take(),
                Slot::Y => y.take(),
                Slot::Seed => Some(Value::scalar_i64(
                    self.seed.wrapping_mul(1_000_003).wrapping_add(step as i64),
                )),
                Slot::Lr => Some(Value::scalar_f32(lr)),
                Slot::Step => Some(Value::scalar_f32(step as f32)),
            };
            inputs.push(value.ok_or_else(|| {
                EngineError::Internal("trainer state is missing a carried value".into())
            })?);
        }
        Ok(inputs)
    }

    /// The first non-finite loss or carried output, if any.
    fn non_finite(&self, loss: f32, outputs: &[Value]) -> Option<NonFinite> {
        if !loss.is_finite() {
            return Some(NonFinite::Loss(loss));
        }
        let names = self.executable.output_names();
        outputs
            .iter()
            .zip(&self.output_targets)
            .zip(names)
            .filter(|((_, target), _)| target.is_some())
            .find(|((value, _), _)| match value {
                Value::F32(a) => match a.as_slice_memory_order() {
                    Some(slice) => !all_finite(slice),
                    None => !a.iter().all(|v| v.is_finite()),
                },
                _ => false,
            })
            .map(|(_, name)| NonFinite::Output(name.clone()))
    }

    /// Copies every value the step replaces (parameters and optimizer
    /// state). Costs one model (plus optimizer state) of memory traffic,
    /// hence only every `CHECKPOINT_EVERY_STEPS`.
    fn take_checkpoint(&mut self) {
        let values = self
            .replaced
            .iter()
            .zip(&self.carried)
            .enumerate()
            .filter(|(_, (replaced, _))| **replaced)
            .filter_map(|(i, (_, value))| value.clone().map(|v| (i, v)))
            .collect();
        self.checkpoint = Some((self.steps, values));
    }

    /// Restores the last checkpoint; returns the step it was taken at.
    fn roll_back(&mut self) -> u64 {
        let Some((step, values)) = &self.checkpoint else {
            return self.steps;
        };
        for (i, value) in values {
            self.carried[*i] = Some(value.clone());
        }
        self.steps = *step;
        *step
    }

    /// Writes the current values of the trainable parameters back into
    /// `model`; frozen parameters and optimizer state stay as they are.
    pub fn write_back(&self, model: &mut Model) -> EngineResult<()> {
        for (i, slot) in self.slots.iter().enumerate() {
            if *slot != (Slot::Param { trainable: true }) {
                continue;
            }
            let name = self.executable.input_names()[i].as_str();
            let param = name.strip_prefix(PARAM_PREFIX).unwrap_or(name);
            let value = self.carried[i].as_ref().ok_or_else(|| {
                EngineError::Internal(format!("trainer holds no value for parameter `{param}`"))
            })?;
            let target = model
                .parameter_mut(param)
                .ok_or_else(|| EngineError::Missing {
                    owner: "the model".to_string(),
                    part: Part::Parameter,
                    name: param.to_string(),
                })?;
            target.data = value.to_data();
        }
        Ok(())
    }
}

/// Whether every element is finite, without a branch per element: `v·0`
/// is 0 for finite `v` and NaN otherwise, and 16 lanes vectorise.
fn all_finite(values: &[f32]) -> bool {
    let mut lanes = [0.0f32; 16];
    let chunks = values.chunks_exact(16);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (lane, &v) in lanes.iter_mut().zip(chunk) {
            *lane += v * 0.0;
        }
    }
    lanes.iter().all(|l| *l == 0.0) && rest.iter().all(|v| v.is_finite())
}

fn classify_input(
    model: &Model,
    entry: &str,
    name: &str,
    ty: &canopy_ir::TensorType,
) -> EngineResult<(Slot, Option<Value>)> {
    if let Some(param) = name.strip_prefix(PARAM_PREFIX) {
        let p = model.parameter(param).ok_or_else(|| EngineError::Missing {
            owner: format!("the model read by `{entry}`"),
            part: Part::Parameter,
            name: param.to_string(),
        })?;
        let slot = Slot::Param {
            trainable: p.trainable,
        };
        return Ok((slot, Some(Value::from_data(&p.data))));
    }
    if name.starts_with(STATE_PREFIX) {
        let dims = ty.shape.as_fixed().ok_or_else(|| {
            EngineError::Shape(format!("state `{name}` must have a static shape"))
        })?;
        let zeros = Value::zeros(ty.dtype, &dims);
        return Ok((Slot::State, Some(zeros)));
    }
    let slot = match name {
        "x" => Slot::X,
        "y" => Slot::Y,
        INPUT_SEED => Slot::Seed,
        INPUT_LR => Slot::Lr,
        INPUT_STEP => Slot::Step,
        other => {
            return Err(EngineError::Unfeedable {
                entry: entry.to_string(),
                name: other.to_string(),
            });
        }
    };
    Ok((slot, None))
}

/// The position of output `name` of entry point `entry`.
fn output_position(graph: &canopy_ir::Graph, entry: &str, name: &str) -> EngineResult<usize> {
    graph
        .outputs()
        .iter()
        .position(|(n, _)| n == name)
        .ok_or_else(|| EngineError::Missing {
            owner: entry.to_string(),
            part: Part::Output,
            name: name.to_string(),
        })
}

/// The single value of a `correct` output (i64, or f32 from older graphs).
fn count_of(value: &Value) -> EngineResult<i64> {
    match value {
        Value::I64(a) => Ok(a.iter().copied().next().unwrap_or(0)),
        other => Ok(other.to_scalar_f32()? as i64),
    }
}

/// Runs a model's `eval` graph over batches.
pub struct Evaluator {
    executable: Box<dyn Executable>,
    /// Per input: parameters (`Carried`, with their value), `X` or `Y`.
    slots: Vec<(Slot, Option<Value>)>,
    loss_output: usize,
    correct_output: usize,
}

impl Evaluator {
    pub fn new(model: &Model, backend: &dyn Backend) -> EngineResult<Evaluator> {
        let graph = model.entry(ENTRY_EVAL)?;
        let executable = backend.compile(graph)?;
        let mut slots = Vec::new();
        for &input in graph.inputs() {
            let name = graph.input_name(input);
            let slot = classify_input(model, ENTRY_EVAL, name, graph.ty(input))?;
            let feedable = match slot.0 {
                Slot::Param { .. } | Slot::X | Slot::Y => true,
                Slot::State | Slot::Seed | Slot::Lr | Slot::Step => false,
            };
            if !feedable {
                return Err(EngineError::Unfeedable {
                    entry: ENTRY_EVAL.to_string(),
                    name: name.to_string(),
                });
            }
            slots.push(slot);
        }
        let position = |name: &str| output_position(graph, ENTRY_EVAL, name);
        Ok(Evaluator {
            loss_output: position("loss")?,
            correct_output: position("correct")?,
            executable,
            slots,
        })
    }

    /// Loss (summed over samples) and correct count of one batch.
    pub fn batch(&mut self, x: Value, y: Value) -> EngineResult<(f64, i64)> {
        let batch = x.shape().first().copied().unwrap_or(0);
        let mut x = Some(x);
        let mut y = Some(y);
        let inputs = self
            .slots
            .iter()
            .map(|(slot, value)| match slot {
                Slot::X => x.take(),
                Slot::Y => y.take(),
                _ => value.clone(),
            })
            .collect::<Option<Vec<Value>>>()
            .ok_or_else(|| EngineError::Internal("eval reads `x` or `y` twice".into()))?;
        let out = self.executable.run(inputs)?;
        let loss = out[self.loss_output].to_scalar_f32()? as f64 * batch as f64;
        Ok((loss, count_of(&out[self.correct_output])?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CpuBackend;
    use crate::optim::Optimizer;
    use crate::zoo::{Architecture, ModelConfig, build_model};

    /// Parameters keep the model's `trainable` flag; optimizer state is
    /// the trainer's own slot kind, never a trainable parameter.
    #[test]
    fn only_parameters_are_trainable() {
        let model = build_model(&ModelConfig {
            architecture: Architecture::Mlp {
                inputs: 4,
                hidden: 3,
                classes: 2,
            },
            seed: 1,
            optimizer: Optimizer::adam(),
            frozen_prefixes: vec!["fc1".into()],
            producer: "test".into(),
        })
        .unwrap();
        let trainer = Trainer::new(&model, &CpuBackend, 0).unwrap();
        let names = trainer.executable.input_names();
        let mut seen = [0usize; 3];
        for (slot, name) in trainer.slots.iter().zip(names) {
            if let Some(param) = name.strip_prefix(PARAM_PREFIX) {
                let trainable = model.parameter(param).unwrap().trainable;
                assert_eq!(*slot, Slot::Param { trainable }, "{name}");
                seen[usize::from(trainable)] += 1;
            } else if name.starts_with(STATE_PREFIX) {
                assert_eq!(*slot, Slot::State, "{name}");
                seen[2] += 1;
            } else {
                assert!(!matches!(slot, Slot::Param { .. } | Slot::State), "{name}");
            }
        }
        // Frozen: fc1 and the input statistics; trainable: fc2; two Adam
        // slots per trainable parameter.
        assert_eq!(seen, [4, 2, 4], "[frozen, trainable, state]");
    }
}
