//! Split execution for transfer learning: a training step whose backbone
//! is frozen runs that backbone's forward pass on one backend (an NPU
//! through ONNX Runtime) and the rest, the trainable head with its
//! gradient and optimizer update, on another (the CPU or the GPU).
//!
//! [`split_frozen_forward`] finds the **frozen forward part** of a
//! `train_step`: every node computed from `x`, frozen parameters and
//! constants alone. Nothing there depends on a trainable parameter, `y`,
//! the seed or optimizer state, so no gradient flows into it and its
//! values are the same whichever backend computes them. What of it does
//! not depend on `x` (a constant, a frozen bias reshaped) is the same
//! every step: the head computes what it reads of that itself. The values of that part
//! that the rest reads are the **cut**: the backbone graph computes them
//! from `x`, the head graph takes them as inputs.
//!
//! The frozen parameters become constants of the backbone graph: they
//! never change while it runs, and a backend that compiles ahead of time
//! (an ONNX Runtime session, an NPU delegate) can then fold them, pre-pack
//! them and place them on the device once, where an input would be copied
//! in every run.
//!
//! [`SplitExecutable`] runs the two as one [`Executable`] with the original
//! step's inputs and outputs, so [`crate::train::Trainer`] drives it like
//! any other (see `Trainer::split`).

use std::collections::HashMap;

use canopy_ir::model::{ENTRY_TRAIN_STEP, PARAM_PREFIX};
use canopy_ir::{Graph, Model, Op, TensorData, ValueId};

use crate::backend::{Backend, Executable, ResidentRun, TransferCounters};
use crate::error::{EngineError, EngineResult};
use crate::value::Value;

/// The prefix of the head's inputs that carry the cut values.
pub const CUT_PREFIX: &str = "cut/";

/// A training step cut in two.
#[derive(Clone, Debug)]
pub struct SplitStep {
    /// Inputs: the step's data input(s) (`x`); outputs: the cut values,
    /// named `cut/0`, `cut/1`, … The frozen parameters are constants.
    pub backbone: Graph,
    /// Every other node of the step; inputs: the step's inputs that the
    /// head reads, in the step's order, then the cut values (by the same
    /// names as the backbone's outputs); outputs: the step's outputs.
    pub head: Graph,
}

/// Cuts `step` at its frozen forward part. `frozen` gives the value of
/// each frozen parameter (by parameter name, without `params/`); a
/// `params/NAME` input not in it is trainable. `data_inputs` are the
/// inputs the backbone may read (`x`). Returns `None` when that part
/// computes nothing the rest needs (nothing frozen, or only parameters
/// the head reads directly).
pub fn split_frozen_forward(
    step: &Graph,
    frozen: &HashMap<String, TensorData>,
    data_inputs: &[&str],
) -> EngineResult<Option<SplitStep>> {
    let partition = Partition::of(step, frozen, data_inputs);
    if partition.cut.is_empty() {
        return Ok(None);
    }
    let backbone = backbone_graph(step, frozen, &partition)?;
    let head = head_graph(step, &partition)?;
    Ok(Some(SplitStep { backbone, head }))
}

/// [`split_frozen_forward`] of `model`'s `train_step`, with the model's
/// frozen parameters and `x` as the data input: the one place a model's
/// step is cut, for [`crate::train::Trainer::split`] and whoever inspects
/// or times the cut.
pub fn split_train_step(model: &Model) -> EngineResult<Option<SplitStep>> {
    let step = model.entry(ENTRY_TRAIN_STEP)?;
    let frozen: HashMap<String, TensorData> = model
        .parameters
        .iter()
        .filter(|p| !p.trainable)
        .map(|p| (p.name.clone(), p.data.clone()))
        .collect();
    split_frozen_forward(step, &frozen, &["x"])
}

/// Which node goes where, by node index.
struct Partition {
    /// Computable from data inputs, frozen parameters and constants alone.
    available: Vec<bool>,
    /// The cut: available nodes that depend on a data input and that a
    /// head node or a step output reads, in node order.
    cut: Vec<ValueId>,
    /// The nodes the head holds: every node that is not available, and
    /// the available ones it reads that do not depend on a data input
    /// (constants, frozen parameters and what is computed from them alone,
    /// the same every step), which it computes itself.
    in_head: Vec<bool>,
}

impl Partition {
    fn of(step: &Graph, frozen: &HashMap<String, TensorData>, data_inputs: &[&str]) -> Partition {
        let mut available = Vec::with_capacity(step.len());
        let mut reads_data = Vec::with_capacity(step.len());
        for node in step.nodes() {
            let (member, data) = match &node.op {
                Op::Input { name } => {
                    let data = data_inputs.contains(&name.as_str());
                    let frozen_param = name
                        .strip_prefix(PARAM_PREFIX)
                        .is_some_and(|param| frozen.contains_key(param));
                    (data || frozen_param, data)
                }
                Op::Constant(_) => (true, false),
                _ => (
                    node.inputs.iter().all(|input| available[input.index()]),
                    node.inputs.iter().any(|input| reads_data[input.index()]),
                ),
            };
            available.push(member);
            reads_data.push(data);
        }
        let mut needed = vec![false; step.len()];
        for (_, output) in step.outputs() {
            needed[output.index()] = true;
        }
        let mut in_head = vec![false; step.len()];
        let mut cut = Vec::new();
        for (index, node) in step.nodes().iter().enumerate().rev() {
            let held = !available[index] || (needed[index] && !reads_data[index]);
            if held {
                in_head[index] = true;
                for input in &node.inputs {
                    needed[input.index()] = true;
                }
            } else if needed[index] && !matches!(node.op, Op::Input { .. }) {
                cut.push(ValueId(index as u32));
            }
        }
        cut.reverse();
        Partition {
            available,
            cut,
            in_head,
        }
    }
}

fn cut_name(position: usize) -> String {
    format!("{CUT_PREFIX}{position}")
}

/// The backbone: its data inputs, the frozen parameters as constants, and
/// the available nodes the cut needs.
fn backbone_graph(
    step: &Graph,
    frozen: &HashMap<String, TensorData>,
    partition: &Partition,
) -> EngineResult<Graph> {
    let mut graph = Graph::new();
    let mut map: Vec<Option<ValueId>> = vec![None; step.len()];
    for (index, node) in step.nodes().iter().enumerate() {
        if !partition.available[index] {
            continue;
        }
        map[index] = Some(match &node.op {
            Op::Input { name } => match name.strip_prefix(PARAM_PREFIX) {
                Some(param) => {
                    let data = frozen.get(param).ok_or_else(|| {
                        EngineError::Internal(format!("frozen parameter `{param}` has no value"))
                    })?;
                    graph.constant(data.clone())?
                }
                None => graph.input(name.clone(), node.ty.clone())?,
            },
            op => graph.push(op.clone(), &mapped(&map, &node.inputs)?)?,
        });
    }
    let outputs = partition
        .cut
        .iter()
        .enumerate()
        .map(|(position, id)| Ok((cut_name(position), mapped(&map, &[*id])?[0])))
        .collect::<EngineResult<Vec<_>>>()?;
    graph.set_outputs(outputs)?;
    Ok(canopy_ir::passes::eliminate_dead_code(&graph)?)
}

/// The head: the step's inputs it reads (in step order), then the cut
/// values as inputs, then its nodes.
fn head_graph(step: &Graph, partition: &Partition) -> EngineResult<Graph> {
    let mut graph = Graph::new();
    let mut map: Vec<Option<ValueId>> = vec![None; step.len()];
    for &input in step.inputs() {
        if partition.in_head[input.index()] {
            let name = step.input_name(input);
            map[input.index()] = Some(graph.input(name, step.ty(input).clone())?);
        }
    }
    for (position, id) in partition.cut.iter().enumerate() {
        map[id.index()] = Some(graph.input(cut_name(position), step.ty(*id).clone())?);
    }
    for (index, node) in step.nodes().iter().enumerate() {
        if partition.in_head[index] && map[index].is_none() {
            map[index] = Some(graph.push(node.op.clone(), &mapped(&map, &node.inputs)?)?);
        }
    }
    let outputs = step
        .outputs()
        .iter()
        .map(|(name, id)| Ok((name.clone(), mapped(&map, &[*id])?[0])))
        .collect::<EngineResult<Vec<_>>>()?;
    graph.set_outputs(outputs)?;
    Ok(graph)
}

fn mapped(map: &[Option<ValueId>], ids: &[ValueId]) -> EngineResult<Vec<ValueId>> {
    ids.iter()
        .map(|id| {
            map[id.index()].ok_or_else(|| {
                EngineError::Internal(format!("split: {id} is read before it is defined"))
            })
        })
        .collect()
}

/// Where one input of the original step goes.
#[derive(Clone, Copy, Debug, Default)]
struct Route {
    backbone: Option<usize>,
    head: Option<usize>,
}

/// A [`SplitStep`] compiled on two backends, run as one executable with
/// the original step's inputs and outputs. Each run feeds the backbone,
/// then the head with the cut values; resident values (the trainable
/// parameters, optimizer state) live in the head's executable.
pub struct SplitExecutable {
    backbone: Box<dyn Executable>,
    head: Box<dyn Executable>,
    input_names: Vec<String>,
    output_names: Vec<String>,
    /// By the step's input position.
    routes: Vec<Route>,
    /// Head input position of each cut value, by backbone output position.
    cut_to_head: Vec<usize>,
    /// Step inputs at these positions are resident.
    resident: Vec<bool>,
    /// Resident values no head input takes (frozen parameters the backbone
    /// holds as constants), kept for `read_resident`.
    held: Vec<(usize, Value)>,
}

impl SplitExecutable {
    /// Compiles `split` of a step with these input names: the backbone on
    /// `backbone`, the head on `head`.
    pub fn new(
        step: &Graph,
        split: &SplitStep,
        backbone: &dyn Backend,
        head: &dyn Backend,
    ) -> EngineResult<SplitExecutable> {
        let backbone_exe = backbone.compile(&split.backbone)?;
        let head_exe = head.compile(&split.head)?;
        let position_in = |names: &[String], name: &str| names.iter().position(|n| n == name);
        let routes = step
            .input_names()
            .iter()
            .map(|name| Route {
                backbone: position_in(backbone_exe.input_names(), name),
                head: position_in(head_exe.input_names(), name),
            })
            .collect();
        let cut_to_head = backbone_exe
            .output_names()
            .iter()
            .map(|name| {
                position_in(head_exe.input_names(), name).ok_or_else(|| {
                    EngineError::Internal(format!("split: the head does not read `{name}`"))
                })
            })
            .collect::<EngineResult<Vec<_>>>()?;
        let input_names: Vec<String> = step.input_names().iter().map(|s| s.to_string()).collect();
        Ok(SplitExecutable {
            resident: vec![false; input_names.len()],
            input_names,
            output_names: step.outputs().iter().map(|(n, _)| n.clone()).collect(),
            routes,
            cut_to_head,
            backbone: backbone_exe,
            head: head_exe,
            held: Vec::new(),
        })
    }

    /// Runs the backbone on the step inputs it reads (in step order, with
    /// `None` for resident ones) and returns the head's inputs with the
    /// cut values filled in, in head order, leaving out resident ones.
    fn feed_head(&mut self, step_inputs: Vec<Option<Value>>) -> EngineResult<Vec<Value>> {
        let mut backbone_inputs: Vec<Option<Value>> = vec![None; self.backbone.input_names().len()];
        let mut head_inputs: Vec<Option<Value>> = vec![None; self.head.input_names().len()];
        for (route, value) in self.routes.iter().zip(step_inputs) {
            let Some(value) = value else { continue };
            match (route.backbone, route.head) {
                (Some(b), Some(h)) => {
                    backbone_inputs[b] = Some(value.clone());
                    head_inputs[h] = Some(value);
                }
                (Some(b), None) => backbone_inputs[b] = Some(value),
                (None, Some(h)) => head_inputs[h] = Some(value),
                (None, None) => {}
            }
        }
        let backbone_inputs = backbone_inputs
            .into_iter()
            .zip(self.backbone.input_names())
            .map(|(value, name)| {
                value.ok_or_else(|| {
                    EngineError::Internal(format!("split: backbone input `{name}` is not fed"))
                })
            })
            .collect::<EngineResult<Vec<_>>>()?;
        let cut = self.backbone.run(backbone_inputs)?;
        for (value, &position) in cut.into_iter().zip(&self.cut_to_head) {
            head_inputs[position] = Some(value);
        }
        Ok(head_inputs.into_iter().flatten().collect())
    }

    /// The step inputs in step order, `None` at resident positions.
    fn spread(&self, fed: Vec<Value>) -> EngineResult<Vec<Option<Value>>> {
        let expected = self.resident.iter().filter(|r| !**r).count();
        if fed.len() != expected {
            return Err(EngineError::Internal(format!(
                "a resident run takes {expected} inputs, got {}",
                fed.len()
            )));
        }
        let mut fed = fed.into_iter();
        Ok(self
            .resident
            .iter()
            .map(|&resident| if resident { None } else { fed.next() })
            .collect())
    }

    fn head_to_step_position(&self, head_position: usize) -> Option<usize> {
        self.routes
            .iter()
            .position(|route| route.head == Some(head_position))
    }
}

impl Executable for SplitExecutable {
    fn run(&mut self, inputs: Vec<Value>) -> EngineResult<Vec<Value>> {
        if inputs.len() != self.input_names.len() {
            return Err(EngineError::InputCount {
                expected: self.input_names.clone(),
                got: inputs.len(),
            });
        }
        let head_inputs = self.feed_head(inputs.into_iter().map(Some).collect())?;
        self.head.run(head_inputs)
    }

    fn input_names(&self) -> &[String] {
        &self.input_names
    }

    fn output_names(&self) -> &[String] {
        &self.output_names
    }

    /// Values for head inputs become resident in the head; values only the
    /// backbone would read (frozen parameters, which it holds as
    /// constants) are kept aside for `read_resident`.
    fn make_resident(&mut self, values: Vec<(usize, Value)>) -> EngineResult<()> {
        let mut head_values = Vec::new();
        self.held.clear();
        self.resident = vec![false; self.input_names.len()];
        for (position, value) in values {
            let route = self.routes.get(position).copied().ok_or_else(|| {
                EngineError::Internal(format!("resident input {position} is out of range"))
            })?;
            self.resident[position] = true;
            match route.head {
                Some(h) => head_values.push((h, value)),
                None => self.held.push((position, value)),
            }
        }
        self.head.make_resident(head_values)
    }

    fn run_resident(&mut self, inputs: Vec<Value>) -> EngineResult<ResidentRun> {
        let spread = self.spread(inputs)?;
        let head_inputs = self.feed_head(spread)?;
        self.head.run_resident(head_inputs)
    }

    fn read_resident(&mut self) -> EngineResult<Vec<(usize, Value)>> {
        let mut values = self.held.clone();
        for (head_position, value) in self.head.read_resident()? {
            let position = self.head_to_step_position(head_position).ok_or_else(|| {
                EngineError::Internal(format!(
                    "split: head input {head_position} has no step input"
                ))
            })?;
            values.push((position, value));
        }
        values.sort_by_key(|(position, _)| *position);
        Ok(values)
    }

    fn snapshot_resident(&mut self) -> EngineResult<()> {
        self.head.snapshot_resident()
    }

    fn restore_resident(&mut self) -> EngineResult<()> {
        self.head.restore_resident()
    }

    fn transfers(&self) -> TransferCounters {
        let (b, h) = (self.backbone.transfers(), self.head.transfers());
        TransferCounters {
            host_to_device_bytes: b.host_to_device_bytes + h.host_to_device_bytes,
            device_to_host_bytes: b.device_to_host_bytes + h.device_to_host_bytes,
            submissions: b.submissions + h.submissions,
            dispatches: b.dispatches + h.dispatches,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CpuBackend;
    use crate::optim::Optimizer;
    use crate::train::Trainer;
    use crate::zoo::{Architecture, ModelConfig, build_model, rebuild_train_step, set_frozen};
    use canopy_ir::Model;

    fn frozen_lenet() -> Model {
        let mut model = build_model(&ModelConfig {
            architecture: Architecture::LeNet5 { classes: 10 },
            seed: 2,
            optimizer: Optimizer::adam(),
            frozen_prefixes: Vec::new(),
            producer: "split test".into(),
        })
        .unwrap();
        set_frozen(&mut model, &["conv".into(), "fc1".into()]).unwrap();
        rebuild_train_step(&mut model, &Optimizer::adam()).unwrap();
        model
    }

    fn batch(seed: usize) -> (Value, Value) {
        let pixels = (0..4 * 28 * 28)
            .map(|i| ((i * 7919 + seed * 104_729) % 255) as f32 / 255.0)
            .collect();
        let x = Value::f32(&[4, 1, 28, 28], pixels).unwrap();
        let y = Value::i64(&[4], (0..4).map(|i| ((i + seed) % 10) as i64).collect()).unwrap();
        (x, y)
    }

    /// With both parts on the CPU the arithmetic is the same, so a split
    /// trainer must match the unsplit one bit for bit, Adam state and
    /// rollback included.
    #[test]
    fn a_split_step_on_one_backend_equals_the_whole_step() {
        let model = frozen_lenet();
        let mut whole = Trainer::new(&model, &CpuBackend, 9).unwrap();
        let mut split = Trainer::split(&model, &CpuBackend, &CpuBackend, 9).unwrap();
        for step in 0..3 {
            let (x, y) = batch(step);
            let a = whole.step(x.clone(), y.clone(), 0.01).unwrap();
            let b = split.step(x, y, 0.01).unwrap();
            assert_eq!(a, b, "step {step}");
        }
        let written = |trainer: &mut Trainer| {
            let mut trained = model.clone();
            trainer.write_back(&mut trained).unwrap();
            trained
        };
        let trained = written(&mut whole);
        assert!(written(&mut split) == trained, "parameters after 3 steps");
        assert!(trained != model, "the head trained");
        // A NaN pixel makes the loss non-finite: both roll back to their
        // checkpoint, the first step's.
        let (mut x, y) = batch(3);
        if let Value::F32(pixels) = &mut x {
            pixels[[0, 0, 14, 14]] = f32::NAN;
        }
        assert!(whole.step(x.clone(), y.clone(), 0.01).is_err());
        assert!(split.step(x, y, 0.01).is_err());
        assert_eq!((whole.steps(), split.steps()), (0, 0));
        assert!(written(&mut whole) == model && written(&mut split) == model);
    }

    #[test]
    fn the_frozen_parameters_are_backbone_constants() {
        let model = frozen_lenet();
        let step = model.entry(ENTRY_TRAIN_STEP).unwrap();
        let frozen: HashMap<String, TensorData> = model
            .parameters
            .iter()
            .filter(|p| !p.trainable)
            .map(|p| (p.name.clone(), p.data.clone()))
            .collect();
        let split = split_frozen_forward(step, &frozen, &["x"])
            .unwrap()
            .unwrap();
        assert_eq!(split.backbone.input_names(), ["x"]);
        let constants = split
            .backbone
            .nodes()
            .iter()
            .filter(|n| matches!(n.op, Op::Constant(_)))
            .count();
        assert!(
            constants >= frozen.len() - 2,
            "conv1, conv2, fc1 weights and biases"
        );
        // Nothing frozen: no split.
        assert!(
            split_frozen_forward(step, &HashMap::new(), &["x"])
                .unwrap()
                .is_none()
        );
    }
}
