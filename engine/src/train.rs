//! Runners for a model file's `train_step` and `eval` graphs.
//!
//! The trainer keeps parameters and optimizer state as runtime values
//! between steps and hands them to the compiled step by ownership, so the
//! update is written into the same buffers step after step.

use std::collections::HashMap;
use std::ops::ControlFlow;

use canopy_ir::Model;
use canopy_ir::model::{ENTRY_EVAL, ENTRY_TRAIN_STEP, PARAM_PREFIX, STATE_PREFIX};

use crate::backend::{Backend, Executable};
use crate::data::Dataset;
use crate::error::{EngineError, EngineResult, NonFinite, Part};
use crate::optim::{INPUT_LR, INPUT_SEED, INPUT_STEP};
use crate::proximal::ANCHOR_PREFIX;
use crate::split::{SplitExecutable, split_train_step};
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
    /// A parameter's value when training began (`anchor/NAME`, FedProx):
    /// fed unchanged to every step.
    Anchor,
}

pub struct Trainer {
    executable: Box<dyn Executable>,
    /// By input position.
    slots: Vec<Slot>,
    /// The slots the caller feeds each step (the rest are resident), in
    /// input order.
    fed: Vec<Slot>,
    /// Positions, among the outputs a resident run returns, of the loss
    /// and the correct count.
    loss_output: usize,
    correct_output: usize,
    steps: u64,
    seed: i64,
    /// The step of the last snapshot of the resident values, to roll back
    /// to when a step fails or diverges.
    checkpoint_step: Option<u64>,
}

/// How often the trainer checkpoints for rollback, in steps.
pub const CHECKPOINT_EVERY_STEPS: u64 = 64;

/// A trainer's state between steps ([`Trainer::export_state`]): what a
/// run killed mid-training saves to resume from.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainerState {
    /// The trainer's seed: with the step number, the seed of each step's
    /// dropout masks.
    pub seed: u64,
    /// Steps run; the next step is numbered `steps + 1` (its seed, and the
    /// step Adam's bias correction reads).
    pub steps: u64,
    /// Every value the trainer keeps between steps, by its `train_step`
    /// input name (`params/NAME`, `state/NAME/SLOT`, `anchor/NAME`), in
    /// input order.
    pub values: Vec<(String, Value)>,
}

/// A trainer state's value that does not fit the trainer; the hint is the
/// same for every cause.
fn state_error(name: &str, cause: String) -> EngineError {
    EngineError::Input {
        name: name.to_string(),
        cause: format!(
            "{cause}; hint: restore only a state exported by a trainer of the same model, \
             optimizer and frozen set"
        ),
    }
}

impl Trainer {
    /// Compiles the model's `train_step` and makes its parameters, anchors
    /// and optimizer state (from zeros) resident in the executable, so
    /// they stay where the backend computes (on the GPU, in its memory).
    pub fn new(model: &Model, backend: &dyn Backend, seed: u64) -> EngineResult<Trainer> {
        let graph = model.entry(ENTRY_TRAIN_STEP)?;
        Trainer::with_executable(model, backend.compile(graph)?, seed)
    }

    /// Like [`Trainer::new`], with the step's frozen forward part (the
    /// backbone, see [`crate::split`]) on `backbone` and the rest (the
    /// trainable head, its gradient and the optimizer) on `head`. An error
    /// when the step has no frozen forward part: freeze a backbone first
    /// (`zoo::set_frozen`, `zoo::rebuild_train_step`).
    pub fn split(
        model: &Model,
        backbone: &dyn Backend,
        head: &dyn Backend,
        seed: u64,
    ) -> EngineResult<Trainer> {
        let graph = model.entry(ENTRY_TRAIN_STEP)?;
        let split = split_train_step(model)?.ok_or_else(|| {
            EngineError::Setting(format!(
                "{ENTRY_TRAIN_STEP} has no frozen forward part to run on the `{}` backend: \
                 every computation depends on a trainable parameter, `y` or the seed; hint: \
                 freeze a backbone (`canopy model train --freeze PREFIX`, or `zoo::set_frozen` \
                 and `zoo::rebuild_train_step`)",
                backbone.name()
            ))
        })?;
        let executable = SplitExecutable::new(graph, &split, backbone, head)?;
        Trainer::with_executable(model, Box::new(executable), seed)
    }

    /// A trainer over `executable`, compiled from the model's `train_step`
    /// (its inputs and outputs by name).
    fn with_executable(
        model: &Model,
        mut executable: Box<dyn Executable>,
        seed: u64,
    ) -> EngineResult<Trainer> {
        let graph = model.entry(ENTRY_TRAIN_STEP)?;
        let mut slots = Vec::new();
        let mut resident = Vec::new();
        for (position, &input) in graph.inputs().iter().enumerate() {
            let name = graph.input_name(input);
            let (slot, value) = classify_input(model, ENTRY_TRAIN_STEP, name, graph.ty(input))?;
            if let Some(value) = value {
                resident.push((position, value));
            }
            slots.push(slot);
        }
        let resident_names: Vec<&str> = resident
            .iter()
            .map(|(p, _)| graph.input_name(graph.inputs()[*p]))
            .collect();
        executable.make_resident(resident)?;
        let fed = slots
            .iter()
            .filter(|slot| !slot.is_carried())
            .cloned()
            .collect();
        let returned: Vec<&str> = graph
            .outputs()
            .iter()
            .map(|(name, _)| name.as_str())
            .filter(|name| !resident_names.contains(name))
            .collect();
        let find = |name: &str| {
            returned
                .iter()
                .position(|n| *n == name)
                .ok_or_else(|| EngineError::Missing {
                    owner: ENTRY_TRAIN_STEP.to_string(),
                    part: Part::Output,
                    name: name.to_string(),
                })
        };
        Ok(Trainer {
            loss_output: find("loss")?,
            correct_output: find("correct")?,
            executable,
            slots,
            fed,
            steps: 0,
            seed: seed as i64,
            checkpoint_step: None,
        })
    }

    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// The seed the trainer was made with (with the step number, it seeds
    /// each step's dropout masks).
    pub fn seed(&self) -> u64 {
        self.seed as u64
    }

    /// Everything that decides the trainer's later steps: the values it
    /// keeps in its executable (parameters as they are now, optimizer
    /// state, anchors) and its step count. A trainer of the same model and
    /// seed given it by [`Trainer::restore_state`] runs the same steps
    /// from there, bit for bit on the CPU. Copies the values to the host.
    pub fn export_state(&mut self) -> EngineResult<TrainerState> {
        let resident = self.executable.read_resident()?;
        let names = self.executable.input_names();
        let values = resident
            .into_iter()
            .map(|(position, value)| (names[position].clone(), value))
            .collect();
        Ok(TrainerState {
            seed: self.seed(),
            steps: self.steps,
            values,
        })
    }

    /// Makes this trainer the one `state` was exported from. The state
    /// must hold exactly this trainer's resident values, by name, each of
    /// the same dtype and shape; values no step writes (frozen parameters,
    /// anchors) must also be equal, since a split step holds those as
    /// constants of its backbone and would silently keep its own. Nothing
    /// changes when a check fails. The rollback snapshot is taken afresh
    /// before the next step: a restored trainer rolls back at most to the
    /// restored step.
    pub fn restore_state(&mut self, state: &TrainerState) -> EngineResult<()> {
        if state.seed != self.seed() {
            return Err(EngineError::Setting(format!(
                "the trainer state was exported by a trainer seeded {}, this trainer is seeded \
                 {}: its dropout masks would differ\nhint: make the trainer with the state's seed",
                state.seed,
                self.seed()
            )));
        }
        let current = self.executable.read_resident()?;
        let resident = self.match_state(state, current)?;
        self.executable.make_resident(resident)?;
        self.steps = state.steps;
        self.checkpoint_step = None;
        Ok(())
    }

    /// `state`'s values at the positions of this trainer's resident values
    /// (`current`), checked against them (see [`Trainer::restore_state`]).
    fn match_state(
        &self,
        state: &TrainerState,
        current: Vec<(usize, Value)>,
    ) -> EngineResult<Vec<(usize, Value)>> {
        let names = self.executable.input_names();
        let mut given: HashMap<&str, &Value> = HashMap::with_capacity(state.values.len());
        for (name, value) in &state.values {
            if given.insert(name.as_str(), value).is_some() {
                return Err(state_error(name, "the trainer state holds it twice".into()));
            }
        }
        let mut resident = Vec::with_capacity(current.len());
        for (position, own) in current {
            let name = names[position].as_str();
            let value = given.remove(name).ok_or_else(|| EngineError::Missing {
                owner: "the trainer state".to_string(),
                part: Part::Input,
                name: name.to_string(),
            })?;
            self.check_state_value(name, value, &own)?;
            resident.push((position, value.clone()));
        }
        if let Some(extra) = given.keys().min() {
            return Err(state_error(
                extra,
                format!(
                    "the trainer state holds it, but this trainer's `{ENTRY_TRAIN_STEP}` keeps no such value"
                ),
            ));
        }
        Ok(resident)
    }

    /// One value of a state against the trainer's own value of that name.
    fn check_state_value(&self, name: &str, value: &Value, own: &Value) -> EngineResult<()> {
        if value.dtype() != own.dtype() || value.shape() != own.shape() {
            return Err(state_error(
                name,
                format!(
                    "the trainer state holds {} {:?}, this trainer's `{ENTRY_TRAIN_STEP}` reads {} {:?}",
                    value.dtype(),
                    value.shape(),
                    own.dtype(),
                    own.shape()
                ),
            ));
        }
        let written = self.executable.output_names().iter().any(|n| n == name);
        if !written && value != own {
            return Err(state_error(
                name,
                "no step changes it, yet the trainer state's value differs from this trainer's"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Host↔device traffic of this trainer's step so far.
    pub fn transfers(&self) -> crate::backend::TransferCounters {
        self.executable.transfers()
    }

    /// Runs one step on a batch. A step that yields a non-finite loss or
    /// parameter is an error, and the trainer rolls back to its last
    /// checkpoint, so a diverging run never leaves NaN weights behind.
    pub fn step(&mut self, x: Value, y: Value, lr: f32) -> EngineResult<StepStats> {
        if !(lr.is_finite() && lr > 0.0) {
            return Err(EngineError::LearningRate(lr));
        }
        if self.checkpoint_step.is_none() || self.steps.is_multiple_of(CHECKPOINT_EVERY_STEPS) {
            self.executable.snapshot_resident()?;
            self.checkpoint_step = Some(self.steps);
        }
        let step_number = self.steps + 1;
        let inputs = self.step_inputs(x, y, lr, step_number)?;
        let run = match self.executable.run_resident(inputs) {
            Ok(run) => run,
            Err(source) => {
                return Err(EngineError::Step {
                    step: step_number,
                    rolled_back_to: self.roll_back()?,
                    source: Box::new(source),
                });
            }
        };
        let loss = run.outputs[self.loss_output].to_scalar_f32()?;
        let correct = count_of(&run.outputs[self.correct_output])?;
        let problem = if !loss.is_finite() {
            Some(NonFinite::Loss(loss))
        } else {
            run.non_finite.map(NonFinite::Output)
        };
        if let Some(problem) = problem {
            return Err(EngineError::Diverged {
                step: step_number,
                problem,
                rolled_back_to: self.roll_back()?,
            });
        }
        self.steps = step_number;
        Ok(StepStats { loss, correct })
    }

    fn step_inputs(&mut self, x: Value, y: Value, lr: f32, step: u64) -> EngineResult<Vec<Value>> {
        let mut x = Some(x);
        let mut y = Some(y);
        let mut inputs = Vec::with_capacity(self.fed.len());
        for slot in &self.fed {
            let value = match slot {
                Slot::X => x.take(),
                Slot::Y => y.take(),
                Slot::Seed => Some(Value::scalar_i64(
                    self.seed.wrapping_mul(1_000_003).wrapping_add(step as i64),
                )),
                Slot::Lr => Some(Value::scalar_f32(lr)),
                Slot::Step => Some(Value::scalar_f32(step as f32)),
                Slot::Param { .. } | Slot::State | Slot::Anchor => None,
            };
            inputs.push(value.ok_or_else(|| {
                EngineError::Internal(format!("the trainer cannot feed {slot:?} per step"))
            })?);
        }
        Ok(inputs)
    }

    /// Restores the last snapshot; returns the step it was taken at.
    fn roll_back(&mut self) -> EngineResult<u64> {
        let Some(step) = self.checkpoint_step else {
            return Ok(self.steps);
        };
        self.executable.restore_resident()?;
        self.steps = step;
        Ok(step)
    }

    /// Writes the current values of the trainable parameters back into
    /// `model`; frozen parameters and optimizer state stay as they are.
    /// Copies the resident values to the host (one model's worth).
    pub fn write_back(&mut self, model: &mut Model) -> EngineResult<()> {
        for (i, value) in self.executable.read_resident()? {
            if self.slots[i] != (Slot::Param { trainable: true }) {
                continue;
            }
            let name = self.executable.input_names()[i].as_str();
            let param = name.strip_prefix(PARAM_PREFIX).unwrap_or(name);
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

impl Slot {
    /// Whether the value is the model's or the trainer's, carried between
    /// steps (and so resident), rather than fed per batch.
    fn is_carried(&self) -> bool {
        matches!(self, Slot::Param { .. } | Slot::State | Slot::Anchor)
    }
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
    if let Some(param) = name.strip_prefix(ANCHOR_PREFIX) {
        let p = model.parameter(param).ok_or_else(|| EngineError::Missing {
            owner: format!("the model read by `{entry}`"),
            part: Part::Parameter,
            name: param.to_string(),
        })?;
        return Ok((Slot::Anchor, Some(Value::from_data(&p.data))));
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

/// Runs a model's `eval` graph over batches, its parameters resident.
pub struct Evaluator {
    executable: Box<dyn Executable>,
    /// The inputs fed per batch (`X` and `Y`), in input order.
    fed: Vec<Slot>,
    loss_output: usize,
    correct_output: usize,
}

impl Evaluator {
    pub fn new(model: &Model, backend: &dyn Backend) -> EngineResult<Evaluator> {
        let graph = model.entry(ENTRY_EVAL)?;
        let mut executable = backend.compile(graph)?;
        let mut fed = Vec::new();
        let mut resident = Vec::new();
        for (position, &input) in graph.inputs().iter().enumerate() {
            let name = graph.input_name(input);
            let (slot, value) = classify_input(model, ENTRY_EVAL, name, graph.ty(input))?;
            match (slot, value) {
                (Slot::Param { .. }, Some(value)) => resident.push((position, value)),
                (slot @ (Slot::X | Slot::Y), _) => fed.push(slot),
                _ => {
                    return Err(EngineError::Unfeedable {
                        entry: ENTRY_EVAL.to_string(),
                        name: name.to_string(),
                    });
                }
            }
        }
        executable.make_resident(resident)?;
        let position = |name: &str| output_position(graph, ENTRY_EVAL, name);
        Ok(Evaluator {
            loss_output: position("loss")?,
            correct_output: position("correct")?,
            executable,
            fed,
        })
    }

    /// Loss (summed over samples) and correct count of one batch.
    pub fn batch(&mut self, x: Value, y: Value) -> EngineResult<(f64, i64)> {
        let batch = x.shape().first().copied().unwrap_or(0);
        let mut x = Some(x);
        let mut y = Some(y);
        let inputs = self
            .fed
            .iter()
            .map(|slot| match slot {
                Slot::X => x.take(),
                _ => y.take(),
            })
            .collect::<Option<Vec<Value>>>()
            .ok_or_else(|| EngineError::Internal("eval reads `x` or `y` twice".into()))?;
        let out = self.executable.run_resident(inputs)?.outputs;
        let loss = out[self.loss_output].to_scalar_f32()? as f64 * batch as f64;
        Ok((loss, count_of(&out[self.correct_output])?))
    }
}

/// Samples per forward pass when evaluating: devices and the server use
/// the same, so their numbers for one model and dataset agree exactly.
pub const EVAL_BATCH: usize = 256;

/// Runs the model's `eval` entry point over `data` in order (no
/// shuffling), `batch` samples at a time: the mean loss per sample and the
/// fraction predicted correctly. The one evaluation behind devices' reports
/// and the server's central evaluation.
pub fn evaluate(
    model: &Model,
    data: &Dataset,
    batch: usize,
    backend: &dyn Backend,
) -> EngineResult<EvalStats> {
    if data.is_empty() {
        return Err(EngineError::Setting(
            "cannot evaluate on an empty dataset".to_string(),
        ));
    }
    let mut evaluator = Evaluator::new(model, backend)?;
    let (mut loss, mut correct) = (0.0f64, 0i64);
    for batch in data.batches(batch.max(1), None, false)? {
        let (batch_loss, batch_correct) = evaluator.batch(batch.x, batch.y)?;
        loss += batch_loss;
        correct += batch_correct;
    }
    let samples = data.len() as f64;
    Ok(EvalStats {
        loss: loss / samples,
        accuracy: correct as f64 / samples,
        samples: data.len(),
    })
}

/// What [`fit`] runs: epochs of shuffled batches at one learning rate,
/// from the start of a run or from where an interrupted one stopped.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FitConfig {
    /// Epochs already run (0 for a fresh run): a caller that runs one
    /// epoch at a time, to evaluate between them, gets the same shuffles
    /// as one run of all its epochs.
    pub start_epoch: u32,
    /// Batches of epoch `start_epoch` already run (0 from an epoch's
    /// start). Each epoch's shuffle is a function of the seed and the
    /// epoch alone, so skipping these batches of it resumes a run killed
    /// mid-epoch exactly where it stopped.
    pub start_batch: usize,
    /// The sums over those `start_batch` batches, so that the resumed
    /// epoch's mean loss and accuracy are the uninterrupted run's.
    pub start_sums: EpochSums,
    /// Epochs to run, counting the one resumed mid-epoch.
    pub epochs: u32,
    pub batch: usize,
    pub learning_rate: f32,
    /// Seeds each epoch's shuffle (and, through the trainer, dropout).
    pub seed: u64,
}

impl FitConfig {
    /// A run of `epochs` from the start.
    pub fn new(epochs: u32, batch: usize, learning_rate: f32, seed: u64) -> FitConfig {
        FitConfig {
            start_epoch: 0,
            start_batch: 0,
            start_sums: EpochSums::default(),
            epochs,
            batch,
            learning_rate,
            seed,
        }
    }

    /// Steps per epoch over `samples` samples: a short final batch is
    /// dropped unless it is all the data.
    pub fn batches_per_epoch(&self, samples: usize) -> usize {
        match self.batch {
            0 => 0,
            batch if samples >= batch => samples / batch,
            _ => 1,
        }
    }
}

/// Running sums over the batches of one epoch so far, behind its mean loss
/// and accuracy; what a checkpoint saves mid-epoch.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EpochSums {
    /// Each batch's mean loss times its size, summed.
    pub loss_sum: f64,
    pub correct: i64,
    pub seen: usize,
}

impl EpochSums {
    /// The sample-weighted mean loss so far (0 before any batch).
    pub fn mean_loss(&self) -> f64 {
        self.loss_sum / self.seen.max(1) as f64
    }

    fn add(&mut self, stats: StepStats, size: usize) {
        self.loss_sum += f64::from(stats.loss) * size as f64;
        self.correct += stats.correct;
        self.seen += size;
    }

    /// The finished epoch `epoch` (from 1).
    fn finish(self, epoch: u32) -> EpochStats {
        let seen = self.seen.max(1);
        EpochStats {
            epoch,
            loss: self.loss_sum / seen as f64,
            accuracy: self.correct as f64 / seen as f64,
            samples: seen,
        }
    }
}

/// One finished epoch: sample-weighted mean loss and training accuracy.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EpochStats {
    /// From 1.
    pub epoch: u32,
    pub loss: f64,
    pub accuracy: f64,
    pub samples: usize,
}

/// What [`fit`] reports as it goes; the observer's answer can stop it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum FitProgress {
    /// Checked before each batch: `done` of `batches` in epoch `epoch`
    /// (from 1) have run, `steps` steps in all (the trainer's count).
    /// Resuming with `start_epoch: epoch - 1`, `start_batch: done` and
    /// `start_sums: sums` continues from exactly here.
    Batch {
        epoch: u32,
        done: usize,
        batches: usize,
        /// `sums.mean_loss()`.
        mean_loss: f64,
        sums: EpochSums,
        steps: u64,
    },
    Epoch(EpochStats),
}

/// How far a finished epoch's mean training loss may end above the run's
/// first loss before the run counts as diverging: this fraction of the
/// first loss, and at least [`DIVERGENCE_MIN_RISE`]. A run that learns
/// ends well below where it started, so any clear rise means the
/// learning rate is too large for the optimizer (SGD's 0.1 with Adam, or
/// a fine-tune's rate on an already trained model).
pub const DIVERGENCE_RISE_FRACTION: f64 = 0.25;
/// The smallest rise, in nats, that counts: a fine-tune that starts near
/// zero loss wobbles by more than a quarter of it without diverging.
pub const DIVERGENCE_MIN_RISE: f64 = 0.1;

/// Whether a loss of `now` after one started at `first` is divergence:
/// non-finite, or above `first` by the margin of
/// [`DIVERGENCE_RISE_FRACTION`] and [`DIVERGENCE_MIN_RISE`].
pub fn loss_diverged(first: f64, now: f64) -> bool {
    if !now.is_finite() {
        return true;
    }
    now > first + (DIVERGENCE_RISE_FRACTION * first.abs()).max(DIVERGENCE_MIN_RISE)
}

/// How a run diverged.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Divergence {
    /// A finished epoch's mean loss ended past the first step's
    /// ([`loss_diverged`]).
    LossRose {
        /// From 1.
        epoch: u32,
        first_loss: f64,
        epoch_loss: f64,
    },
    /// The loss shot past its start within an epoch (its running mean did,
    /// by [`loss_diverged`]'s margin), and the epoch ended with the model
    /// at chance: the update threw it where every ReLU is dead, and its
    /// loss settles at about ln(classes), often below the first step's.
    Collapsed {
        /// From 1.
        epoch: u32,
        first_loss: f64,
        /// The highest running mean of the run's losses.
        peak_loss: f64,
        epoch_loss: f64,
        accuracy: f64,
    },
}

impl std::fmt::Display for Divergence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Divergence::LossRose {
                epoch,
                first_loss,
                epoch_loss,
            } => write!(
                f,
                "training diverged: epoch {epoch}'s mean training loss {epoch_loss:.4} rose past \
                 the first step's {first_loss:.4}"
            ),
            Divergence::Collapsed {
                epoch,
                first_loss,
                peak_loss,
                epoch_loss,
                accuracy,
            } => write!(
                f,
                "training diverged: the mean training loss rose from the first step's \
                 {first_loss:.4} to {peak_loss:.4}, and epoch {epoch} ended at chance \
                 (training accuracy {accuracy:.4}, loss {epoch_loss:.4})"
            ),
        }
    }
}

/// Watches [`fit`]'s progress for divergence ([`Divergence`]): the first
/// step's loss is the start; the running mean of each epoch's losses is
/// followed batch by batch, and each finished epoch is judged. A
/// non-finite step is the trainer's own error ([`EngineError::Diverged`]),
/// so it never reaches the watch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DivergenceWatch {
    /// Training accuracy at or below this is chance: 1.5/classes.
    chance_accuracy: f64,
    first_loss: Option<f64>,
    /// The highest running mean seen, once it rose past the start.
    peak_loss: Option<f64>,
}

impl DivergenceWatch {
    /// A watch for a classifier of `classes` classes.
    pub fn new(classes: usize) -> DivergenceWatch {
        DivergenceWatch {
            chance_accuracy: 1.5 / classes.max(1) as f64,
            first_loss: None,
            peak_loss: None,
        }
    }

    /// The run's first step's loss, once it ran.
    pub fn first_loss(&self) -> Option<f64> {
        self.first_loss
    }

    /// Takes one report of [`fit`]'s; returns the divergence when it is a
    /// finished epoch that diverged. The start is the loss after the first
    /// batch (a run that resumes mid-epoch, or whose epochs are one batch,
    /// takes its first epoch's mean instead).
    pub fn observe(&mut self, progress: &FitProgress) -> Option<Divergence> {
        match *progress {
            FitProgress::Batch {
                done, mean_loss, ..
            } if done > 0 => {
                self.follow(mean_loss);
                None
            }
            FitProgress::Batch { .. } => None,
            FitProgress::Epoch(stats) => self.judge(stats),
        }
    }

    fn follow(&mut self, mean_loss: f64) {
        let Some(first) = self.first_loss else {
            self.first_loss = Some(mean_loss);
            return;
        };
        if loss_diverged(first, mean_loss) {
            self.peak_loss = Some(self.peak_loss.map_or(mean_loss, |peak| peak.max(mean_loss)));
        }
    }

    fn judge(&mut self, stats: EpochStats) -> Option<Divergence> {
        let Some(first_loss) = self.first_loss else {
            self.first_loss = Some(stats.loss);
            return None;
        };
        if loss_diverged(first_loss, stats.loss) {
            return Some(Divergence::LossRose {
                epoch: stats.epoch,
                first_loss,
                epoch_loss: stats.loss,
            });
        }
        let peak_loss = self.peak_loss?;
        (stats.accuracy <= self.chance_accuracy).then_some(Divergence::Collapsed {
            epoch: stats.epoch,
            first_loss,
            peak_loss,
            epoch_loss: stats.loss,
            accuracy: stats.accuracy,
        })
    }
}

/// What [`fit_with_trainer`]'s observer is: it sees the trainer too.
pub type TrainerObserver<'a> = dyn FnMut(&mut Trainer, FitProgress) -> ControlFlow<()> + Send + 'a;

/// The one training loop every caller (the CLI, the agent, the SDK) runs:
/// `config.epochs` passes over `data`, reshuffled per epoch from the seed,
/// a short final batch dropped unless it is all the data (one noisy step
/// at SGD learning rates can undo much of an epoch). The observer sees
/// every batch before it runs and every finished epoch; returning
/// `ControlFlow::Break` stops with [`EngineError::Cancelled`], so a batch
/// in progress finishes first. A diverging step is the trainer's error,
/// with its rollback. On the CPU the loop runs on a rayon worker, so each
/// step's kernels fork and join inside the pool.
pub fn fit(
    trainer: &mut Trainer,
    data: &Dataset,
    config: &FitConfig,
    observer: &mut (dyn FnMut(FitProgress) -> ControlFlow<()> + Send),
) -> EngineResult<Vec<EpochStats>> {
    fit_with_trainer(trainer, data, config, &mut |_, progress| observer(progress))
}

/// [`fit`] whose observer is also handed the trainer between batches, so
/// that it can save [`Trainer::export_state`] with the position the
/// progress gives (a checkpoint to resume from).
pub fn fit_with_trainer(
    trainer: &mut Trainer,
    data: &Dataset,
    config: &FitConfig,
    observer: &mut TrainerObserver<'_>,
) -> EngineResult<Vec<EpochStats>> {
    check_fit(data, config)?;
    if rayon::current_thread_index().is_some() {
        return fit_here(trainer, data, config, observer);
    }
    rayon::scope(|_| fit_here(trainer, data, config, observer))
}

fn check_fit(data: &Dataset, config: &FitConfig) -> EngineResult<()> {
    if data.is_empty() {
        return Err(EngineError::Setting(
            "cannot train on an empty dataset".into(),
        ));
    }
    if config.batch == 0 {
        return Err(EngineError::Setting(
            "the batch size must be at least 1".into(),
        ));
    }
    let batches = config.batches_per_epoch(data.len());
    if config.epochs > 0 && config.start_batch >= batches {
        return Err(EngineError::Setting(format!(
            "the run resumes after batch {} of epoch {}, but an epoch of {} samples has {batches} \
             batches of {}; hint: resume only from a position saved for the same data and batch \
             size",
            config.start_batch,
            config.start_epoch + 1,
            data.len(),
            config.batch
        )));
    }
    Ok(())
}

fn fit_here(
    trainer: &mut Trainer,
    data: &Dataset,
    config: &FitConfig,
    observer: &mut TrainerObserver<'_>,
) -> EngineResult<Vec<EpochStats>> {
    let end = config.start_epoch.saturating_add(config.epochs);
    let mut epochs = Vec::with_capacity(config.epochs as usize);
    for epoch in config.start_epoch..end {
        let stats = fit_epoch(trainer, data, config, epoch, observer)?;
        epochs.push(stats);
        let last = epoch + 1 == end;
        if observer(trainer, FitProgress::Epoch(stats)).is_break() && !last {
            return Err(EngineError::Cancelled {
                epoch: epoch + 1,
                step: trainer.steps(),
            });
        }
    }
    Ok(epochs)
}

/// One epoch (`epoch` from 0), from `config.start_batch` when it is the
/// epoch the run resumes in.
fn fit_epoch(
    trainer: &mut Trainer,
    data: &Dataset,
    config: &FitConfig,
    epoch: u32,
    observer: &mut TrainerObserver<'_>,
) -> EngineResult<EpochStats> {
    let batches = config.batches_per_epoch(data.len());
    let drop_last = data.len() >= config.batch;
    let (skip, mut sums) = if epoch == config.start_epoch {
        (config.start_batch, config.start_sums)
    } else {
        (0, EpochSums::default())
    };
    let shuffle = config
        .seed
        .wrapping_mul(0x9E37_79B9)
        .wrapping_add(u64::from(epoch));
    for (done, batch) in data
        .batches(config.batch, Some(shuffle), drop_last)?
        .enumerate()
        .skip(skip)
    {
        let progress = FitProgress::Batch {
            epoch: epoch + 1,
            done,
            batches,
            mean_loss: sums.mean_loss(),
            sums,
            steps: trainer.steps(),
        };
        if observer(trainer, progress).is_break() {
            return Err(EngineError::Cancelled {
                epoch: epoch + 1,
                step: trainer.steps(),
            });
        }
        let size = batch.len();
        let stats = trainer.step(batch.x, batch.y, config.learning_rate)?;
        sums.add(stats, size);
    }
    Ok(sums.finish(epoch + 1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CpuBackend;
    use crate::optim::Optimizer;
    use crate::zoo::{Architecture, ModelConfig, build_model};

    fn batch(epoch: u32, done: usize, mean_loss: f64) -> FitProgress {
        FitProgress::Batch {
            epoch,
            done,
            batches: 100,
            mean_loss,
            sums: EpochSums::default(),
            steps: done as u64,
        }
    }

    fn epoch(epoch: u32, loss: f64, accuracy: f64) -> FitProgress {
        FitProgress::Epoch(EpochStats {
            epoch,
            loss,
            accuracy,
            samples: 6400,
        })
    }

    #[test]
    fn a_loss_that_rises_clearly_past_its_start_is_divergence() {
        // From scratch: 2.30 at the start; 14.3 (Adam at SGD's rate) is
        // divergence, 2.5 is not yet (within a quarter), 3.0 is.
        assert!(loss_diverged(2.30, 14.3));
        assert!(!loss_diverged(2.30, 2.5));
        assert!(loss_diverged(2.30, 3.0));
        assert!(!loss_diverged(2.30, 0.3));
        // A fine-tune from a trained model starts near zero: a wobble of
        // less than 0.1 nats is not divergence, a rise to 0.5 is.
        assert!(!loss_diverged(0.02, 0.08));
        assert!(loss_diverged(0.02, 0.5));
        assert!(loss_diverged(0.02, f64::NAN));
        assert!(loss_diverged(0.02, f64::INFINITY));
    }

    #[test]
    fn the_watch_judges_each_epoch_against_the_first_steps_loss() {
        let mut watch = DivergenceWatch::new(10);
        assert_eq!(watch.observe(&batch(1, 0, 0.0)), None);
        assert_eq!(watch.first_loss(), None, "no step ran yet");
        assert_eq!(watch.observe(&batch(1, 1, 0.05)), None);
        assert_eq!(watch.observe(&batch(1, 2, 0.06)), None);
        assert_eq!(watch.first_loss(), Some(0.05));
        let diverged = watch.observe(&epoch(1, 14.3, 0.5)).expect("diverged");
        assert_eq!(
            diverged,
            Divergence::LossRose {
                epoch: 1,
                first_loss: 0.05,
                epoch_loss: 14.3
            }
        );
        assert!(diverged.to_string().contains("14.3000"), "{diverged}");
        assert_eq!(
            watch.observe(&epoch(2, 0.04, 0.99)),
            None,
            "a recovered epoch"
        );
    }

    /// LeNet-5 with He's gain on its pooled convolutions, frozen, at lr
    /// 0.1: 4.48 at the first step, a running mean of 43.95 four steps
    /// later, then every ReLU dead and the loss at ln 10.
    #[test]
    fn a_spike_that_ends_at_chance_is_divergence_and_one_that_learns_is_not() {
        let mut watch = DivergenceWatch::new(10);
        for (done, mean) in [(1, 4.48), (2, 15.24), (3, 26.84), (4, 43.95), (5, 37.27)] {
            assert_eq!(watch.observe(&batch(1, done, mean)), None);
        }
        let collapsed = watch.observe(&epoch(1, 3.91, 0.11)).expect("collapsed");
        assert_eq!(
            collapsed,
            Divergence::Collapsed {
                epoch: 1,
                first_loss: 4.48,
                peak_loss: 43.95,
                epoch_loss: 3.91,
                accuracy: 0.11
            }
        );
        assert!(
            collapsed.to_string().contains("ended at chance"),
            "{collapsed}"
        );

        // The same spike in a run that goes on to learn is let be.
        let mut watch = DivergenceWatch::new(10);
        for (done, mean) in [(1, 4.48), (2, 10.30), (3, 7.72)] {
            watch.observe(&batch(1, done, mean));
        }
        assert_eq!(watch.observe(&epoch(1, 1.12, 0.67)), None);
    }

    #[test]
    fn the_watch_starts_from_the_first_epoch_when_no_step_was_reported() {
        let mut watch = DivergenceWatch::new(10);
        assert_eq!(watch.observe(&epoch(1, 2.0, 0.5)), None);
        assert_eq!(watch.first_loss(), Some(2.0));
        assert!(watch.observe(&epoch(2, 3.0, 0.5)).is_some());
    }

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
