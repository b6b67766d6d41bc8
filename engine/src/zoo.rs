//! The model zoo and the builder of model files.
//!
//! A model file carries four graphs traced from one network:
//! - `infer(params, x) → logits`;
//! - `eval(params, x, y) → (loss, correct)`;
//! - `train_loss(params, x, y, seed) → (loss, correct)`, the training-mode
//!   forward (dropout active), kept so any tier can derive a new training
//!   step (another optimizer, another frozen set) with no model code;
//! - `train_step`, built from `train_loss` by [`crate::optim`].

use std::collections::BTreeMap;

use canopy_ir::model::{ENTRY_EVAL, ENTRY_INFER, ENTRY_TRAIN_STEP, PARAM_PREFIX};
use canopy_ir::{DType, Dim, Graph, Metadata, Model, Op, Parameter, Shape, TensorType, ValueId};

use crate::data::Dataset;
use crate::error::{EngineError, EngineResult, Part};
use crate::nn::{
    Conv2d, Embedding, Flatten, Follows, ForwardCtx, INPUT_STATS_PREFIX, Initializer, Layer,
    Linear, MaxPool2d, Params, ReLU, Sequential, Standardize, correct_count, init_params,
    softmax_cross_entropy,
};
use crate::optim::{INPUT_SEED, Optimizer, build_train_step};
use crate::recurrent::{Cell, Indices, LastStep, Recurrent};
use crate::stats::{InputMoments, InputStatsState, fit_model};
use crate::tensor::{Tensor, trace};

pub const ENTRY_TRAIN_LOSS: &str = "train_loss";

/// Metadata property keys.
pub const PROP_ARCH: &str = "architecture";
pub const PROP_INPUT_SHAPE: &str = "input_shape";
pub const PROP_CLASSES: &str = "classes";
pub const PROP_OPTIMIZER: &str = "optimizer";
/// The initialiser scheme the weights were drawn with (`he`, `xavier`, `uniform`).
pub const PROP_INIT: &str = "initializer";
/// `unfitted` until `input.mean` / `input.std` are fitted, then `fitted`
/// (see [`InputStatsState`]).
pub const PROP_INPUT_STATS: &str = "input_stats";

/// The architectures `canopy model new` knows.
#[derive(Clone, Debug, PartialEq)]
pub enum Architecture {
    Mlp {
        inputs: usize,
        hidden: usize,
        classes: usize,
    },
    LeNet5 {
        classes: usize,
    },
    LogReg {
        inputs: usize,
        classes: usize,
    },
    /// Next-character prediction: `sequence` character indices (as f32
    /// features) → an embedding → `layers` recurrent layers → a linear map
    /// of the last step's state over the `vocabulary`.
    CharLm {
        vocabulary: usize,
        sequence: usize,
        embedding: usize,
        hidden: usize,
        layers: usize,
        cell: Cell,
        /// Each recurrent layer traced step by step instead of as one loop:
        /// the same function, for comparing graph sizes (it grows with the
        /// sequence).
        unrolled: bool,
    },
}

impl Architecture {
    /// `canopy model new charlm`'s default: one GRU layer of 128 over 80
    /// characters with an 8-wide embedding, small enough to train on a
    /// phone's CPU in a federated round.
    pub fn charlm(vocabulary: usize) -> Architecture {
        Architecture::CharLm {
            vocabulary,
            sequence: 80,
            embedding: 8,
            hidden: 128,
            layers: 1,
            cell: Cell::Gru,
            unrolled: false,
        }
    }

    /// The same architecture with its recurrent layers traced step by
    /// step (only `CharLm` has any).
    pub fn unrolled(mut self) -> Architecture {
        if let Architecture::CharLm { unrolled, .. } = &mut self {
            *unrolled = true;
        }
        self
    }

    /// The FedAvg paper's Shakespeare model (McMahan et al. 2017): an
    /// 8-wide embedding, two LSTM layers of 256 and a softmax over the
    /// vocabulary, unrolled over 80 characters (here: a loop of 80 steps).
    pub fn charlm_fedavg(vocabulary: usize) -> Architecture {
        Architecture::CharLm {
            vocabulary,
            sequence: 80,
            embedding: 8,
            hidden: 256,
            layers: 2,
            cell: Cell::Lstm,
            unrolled: false,
        }
    }
}

impl Architecture {
    pub fn name(&self) -> &'static str {
        match self {
            Architecture::Mlp { .. } => "mlp",
            Architecture::LeNet5 { .. } => "lenet5",
            Architecture::LogReg { .. } => "logreg",
            Architecture::CharLm { .. } => "charlm",
        }
    }

    pub fn classes(&self) -> usize {
        match *self {
            Architecture::Mlp { classes, .. }
            | Architecture::LeNet5 { classes }
            | Architecture::LogReg { classes, .. } => classes,
            Architecture::CharLm { vocabulary, .. } => vocabulary,
        }
    }

    /// The shape of one sample.
    pub fn input_shape(&self) -> Vec<usize> {
        match *self {
            Architecture::Mlp { inputs, .. } | Architecture::LogReg { inputs, .. } => vec![inputs],
            Architecture::LeNet5 { .. } => vec![1, 28, 28],
            Architecture::CharLm { sequence, .. } => vec![sequence],
        }
    }

    /// The network, its weights drawn by `init` (a model scheme: see
    /// [`Initializer::for_layer`]).
    pub fn network(&self, init: Initializer) -> Sequential {
        let hidden = init.for_layer(Follows::ReLU);
        let pooled = init.for_layer(Follows::ReLUAndMaxPool);
        let output = init.for_layer(Follows::Nothing);
        match *self {
            Architecture::Mlp {
                inputs,
                hidden: hidden_units,
                classes,
            } => Sequential::new()
                .push(Standardize)
                .push(Linear::new("fc1", inputs, hidden_units).init(hidden))
                .push(ReLU)
                .push(Linear::new("fc2", hidden_units, classes).init(output)),
            Architecture::LogReg { inputs, classes } => Sequential::new()
                .push(Standardize)
                .push(Linear::new("linear", inputs, classes).init(output)),
            // LeCun et al. 1998 with ReLU and max pooling, as in most modern
            // reproductions; padding 2 keeps 28×28 MNIST at the original 32×32 geometry.
            Architecture::LeNet5 { classes } => Sequential::new()
                .push(Standardize)
                .push(Conv2d::new("conv1", 1, 6, 5).padding(2).init(pooled))
                .push(ReLU)
                .push(MaxPool2d::new(2, 2))
                .push(Conv2d::new("conv2", 6, 16, 5).init(pooled))
                .push(ReLU)
                .push(MaxPool2d::new(2, 2))
                .push(Flatten)
                .push(Linear::new("fc1", 16 * 5 * 5, 120).init(hidden))
                .push(ReLU)
                .push(Linear::new("fc2", 120, 84).init(hidden))
                .push(ReLU)
                .push(Linear::new("fc3", 84, classes).init(output)),
            Architecture::CharLm {
                vocabulary,
                embedding,
                hidden: width,
                layers,
                cell,
                unrolled,
                ..
            } => {
                let mut net = Sequential::new().push(Indices).push(Embedding {
                    name: "embed".into(),
                    count: vocabulary,
                    dim: embedding,
                });
                for layer in 0..layers {
                    let inputs = if layer == 0 { embedding } else { width };
                    let name = format!("{}{}", cell.name(), layer + 1);
                    let layer = Recurrent::new(&name, cell, inputs, width);
                    net = net.push(if unrolled { layer.unrolled() } else { layer });
                }
                net.push(LastStep)
                    .push(Linear::new("out", width, vocabulary).init(output))
            }
        }
    }

    fn describe(&self) -> String {
        match *self {
            Architecture::Mlp {
                inputs,
                hidden,
                classes,
            } => format!("mlp:{inputs},{hidden},{classes}"),
            Architecture::LeNet5 { classes } => format!("lenet5:{classes}"),
            Architecture::LogReg { inputs, classes } => format!("logreg:{inputs},{classes}"),
            Architecture::CharLm {
                vocabulary,
                sequence,
                embedding,
                hidden,
                layers,
                cell,
                unrolled,
            } => format!(
                "charlm:{},{vocabulary},{sequence},{embedding},{hidden},{layers}{}",
                cell.name(),
                if unrolled { ",unrolled" } else { "" }
            ),
        }
    }
}

/// What `build_model` needs besides the architecture.
#[derive(Clone, Debug)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub seed: u64,
    pub optimizer: Optimizer,
    /// Parameters whose name starts with any of these are frozen.
    pub frozen_prefixes: Vec<String>,
    pub producer: String,
}

/// Builds a complete model: initialised parameters and all entry points,
/// with the default initialiser ([`Initializer::He`]).
pub fn build_model(config: &ModelConfig) -> EngineResult<Model> {
    build_model_with_init(config, Initializer::default())
}

/// [`build_model`] with weights drawn by `init`. The initialiser is an
/// argument rather than a [`ModelConfig`] field so the callers that build
/// configs literally keep compiling; it is recorded in the metadata.
pub fn build_model_with_init(config: &ModelConfig, init: Initializer) -> EngineResult<Model> {
    let arch = &config.architecture;
    let net = arch.network(init);
    let parameters = initial_parameters(&net, config);
    let x = batch_input(&arch.input_shape());
    let entries = trace_entry_points(&net, &parameters, &x, arch.classes())?
        .into_iter()
        .map(|(name, graph)| Ok((name, crate::optimize_graph(&graph)?)))
        .collect::<EngineResult<BTreeMap<_, _>>>()?;
    let mut properties = BTreeMap::new();
    properties.insert(PROP_ARCH.into(), arch.describe());
    properties.insert(PROP_INPUT_SHAPE.into(), join(&arch.input_shape()));
    properties.insert(PROP_CLASSES.into(), arch.classes().to_string());
    properties.insert(PROP_INIT.into(), init.to_string());
    // Only a network that standardises its input has statistics to fit.
    let standardizes = parameters.iter().any(|p| p.name == crate::nn::INPUT_MEAN);
    let stats = if standardizes {
        InputStatsState::Unfitted
    } else {
        InputStatsState::Absent
    };
    properties.insert(PROP_INPUT_STATS.into(), stats.marker().into());
    let mut model = Model {
        metadata: Metadata {
            model_name: arch.name().into(),
            parent_digest: None,
            producer: config.producer.clone(),
            properties,
        },
        parameters,
        entry_points: entries,
    };
    rebuild_train_step(&mut model, &config.optimizer)?;
    model.validate()?;
    Ok(model)
}

pub fn is_frozen(name: &str, prefixes: &[String]) -> bool {
    prefixes.iter().any(|p| name.starts_with(p.as_str()))
}

fn join(dims: &[usize]) -> String {
    dims.iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

fn param_inputs(parameters: &[Parameter]) -> Vec<(String, TensorType)> {
    parameters
        .iter()
        .map(|p| (format!("{PARAM_PREFIX}{}", p.name), p.data.tensor_type()))
        .collect()
}

fn batch_input(sample_shape: &[usize]) -> TensorType {
    let mut dims = vec![Dim::Batch];
    dims.extend(sample_shape.iter().map(|&d| Dim::Fixed(d)));
    TensorType::new(DType::F32, Shape(dims))
}

fn labels_input() -> TensorType {
    TensorType::new(DType::I64, Shape(vec![Dim::Batch]))
}

/// Seeded initial values of `net`'s parameters, with the config's frozen set.
fn initial_parameters(net: &dyn Layer, config: &ModelConfig) -> Vec<Parameter> {
    let specs = net.params();
    init_params(&specs, config.seed)
        .into_iter()
        .zip(&specs)
        .map(|((name, data), spec)| Parameter {
            trainable: spec.trainable && !is_frozen(&name, &config.frozen_prefixes),
            name,
            data,
        })
        .collect()
}

/// The `train_loss` graph exactly as traced, before any pass, and the
/// trainable parameter names (for reports on the passes).
pub fn traced_train_loss(config: &ModelConfig) -> EngineResult<(Graph, Vec<String>)> {
    let arch = &config.architecture;
    let net = arch.network(Initializer::default());
    let parameters = initial_parameters(&net, config);
    let x = batch_input(&arch.input_shape());
    let mut entries = trace_entry_points(&net, &parameters, &x, arch.classes())?;
    let graph = entries
        .remove(ENTRY_TRAIN_LOSS)
        .ok_or_else(|| EngineError::Internal("no train_loss traced".into()))?;
    let trainable = parameters
        .into_iter()
        .filter(|p| p.trainable)
        .map(|p| p.name)
        .collect();
    Ok((graph, trainable))
}

/// Traces `infer`, `eval` and `train_loss` from `net`, whose data input
/// `x` has type `x` (batch first).
fn trace_entry_points(
    net: &dyn Layer,
    parameters: &[Parameter],
    x: &TensorType,
    classes: usize,
) -> EngineResult<BTreeMap<String, Graph>> {
    let params = param_inputs(parameters);
    let n = params.len();
    let mut with_x: Vec<(&str, TensorType)> = params
        .iter()
        .map(|(n, t)| (n.as_str(), t.clone()))
        .collect();
    with_x.push(("x", x.clone()));
    let mut with_xy = with_x.clone();
    with_xy.push(("y", labels_input()));
    let mut with_seed = with_xy.clone();
    with_seed.push((INPUT_SEED, TensorType::scalar(DType::I64)));

    let bind = |args: &[Tensor]| -> Params {
        Params(
            parameters
                .iter()
                .zip(args)
                .map(|(p, t)| (p.name.clone(), t.clone()))
                .collect(),
        )
    };
    let infer = trace(&with_x, |args| {
        let logits = net.forward(&bind(args), &args[n], &ForwardCtx::inference())?;
        check_logits(&logits, classes)?;
        Ok(vec![("logits".into(), logits)])
    })?;
    let loss_and_correct = |args: &[Tensor], ctx: ForwardCtx| {
        let logits = net.forward(&bind(args), &args[n], &ctx)?;
        check_logits(&logits, classes)?;
        let loss = softmax_cross_entropy(&logits, &args[n + 1])?;
        let correct = correct_count(&logits, &args[n + 1])?;
        Ok(vec![("loss".into(), loss), ("correct".into(), correct)])
    };
    let eval = trace(&with_xy, |args| {
        loss_and_correct(args, ForwardCtx::inference())
    })?;
    let train_loss = trace(&with_seed, |args| {
        loss_and_correct(args, ForwardCtx::training(Some(args[n + 2].clone())))
    })?;
    let mut entries = BTreeMap::new();
    entries.insert(ENTRY_INFER.to_string(), crate::optimize_graph(&infer)?);
    entries.insert(ENTRY_EVAL.to_string(), crate::optimize_graph(&eval)?);
    entries.insert(
        ENTRY_TRAIN_LOSS.to_string(),
        crate::optimize_graph(&train_loss)?,
    );
    Ok(entries)
}

fn check_logits(logits: &Tensor, classes: usize) -> EngineResult<()> {
    match logits.dims().as_slice() {
        [Dim::Batch, Dim::Fixed(c)] if *c == classes => Ok(()),
        dims => Err(EngineError::Shape(format!(
            "network output must be [N, {classes}], got {dims:?}"
        ))),
    }
}

/// The optimizer a model's `train_step` was built with (SGD when the file
/// does not say).
pub fn model_optimizer(model: &Model) -> EngineResult<Optimizer> {
    match model.metadata.properties.get(PROP_OPTIMIZER) {
        Some(text) => Optimizer::parse(text),
        None => Ok(Optimizer::sgd()),
    }
}

/// (Re)derives `train_step` from the model's `train_loss` graph for the
/// current trainable set and `optimizer`, with the FedProx term when the
/// model has one (see [`crate::proximal`]). Works on any model file, so a
/// device or the CLI can change the optimizer or freeze a backbone.
pub fn rebuild_train_step(model: &mut Model, optimizer: &Optimizer) -> EngineResult<()> {
    let train_loss = model.entry(ENTRY_TRAIN_LOSS)?.clone();
    let trainable: Vec<String> = model.trainable_names();
    if trainable.is_empty() {
        return Err(EngineError::NothingToTrain);
    }
    let step = match crate::proximal::proximal_mu(model)? {
        Some(mu) => {
            let loss = crate::proximal::proximal_train_loss(&train_loss, &trainable, mu)?;
            build_train_step(&loss, &trainable, optimizer)?
        }
        None => build_train_step(&train_loss, &trainable, optimizer)?,
    };
    model.entry_points.insert(ENTRY_TRAIN_STEP.into(), step);
    model
        .metadata
        .properties
        .insert(PROP_OPTIMIZER.into(), optimizer.to_string());
    Ok(())
}

/// A network given as a graph (an imported model's `infer`, cut at its
/// logits): its inputs are parameters (`params/NAME`) and one data input.
struct GraphNetwork {
    graph: Graph,
    data_input: ValueId,
}

impl Layer for GraphNetwork {
    fn forward(&self, params: &Params, x: &Tensor, _: &ForwardCtx) -> EngineResult<Tensor> {
        let args = self
            .graph
            .inputs()
            .iter()
            .map(|&id| match id == self.data_input {
                true => Ok(x),
                false => {
                    let name = self.graph.input_name(id);
                    params.get(name.strip_prefix(PARAM_PREFIX).unwrap_or(name))
                }
            })
            .collect::<EngineResult<Vec<_>>>()?;
        let mut outputs = crate::tensor::call(&self.graph, &args)?;
        Ok(outputs.remove(0))
    }
}

/// Writes `eval`, `train_loss` and `train_step` for a classifier whose
/// `infer` entry point came from elsewhere (an ONNX import), so it trains
/// and is fine-tuned federatedly like a zoo model. The loss is the softmax
/// cross-entropy on its logits: the input of the softmax that produces its
/// class scores ([`class_scores`]), or the scores themselves when no
/// softmax does. `infer` is kept exactly as it is.
pub fn add_classifier_training(model: &mut Model, optimizer: &Optimizer) -> EngineResult<()> {
    let infer = model.entry(ENTRY_INFER)?;
    let (_, scores) = class_scores(infer)?;
    let classes = batch_rows(infer.ty(scores)).expect("class_scores checked the shape");
    let node = infer.node(scores);
    let logits = match node.op {
        Op::Softmax { axis: 1 } | Op::LogSoftmax { axis: 1 } => node.inputs[0],
        _ => scores,
    };
    let mut cut = infer.clone();
    cut.set_outputs(vec![("logits".to_string(), logits)])?;
    let graph = canopy_ir::passes::eliminate_dead_code(&cut)?;
    let data_input = data_input(&graph)?;
    let x = graph.ty(data_input).clone();
    if x.shape.0.first() != Some(&Dim::Batch) {
        return Err(EngineError::Shape(format!(
            "input `{}` is {x}, with a fixed first dimension: training feeds batches of any \
             size, so the first dimension must be symbolic (the batch)",
            graph.input_name(data_input)
        )));
    }
    let net = GraphNetwork { graph, data_input };
    let mut entries = trace_entry_points(&net, &model.parameters, &x, classes)?;
    for entry in [ENTRY_EVAL, ENTRY_TRAIN_LOSS] {
        let graph = entries
            .remove(entry)
            .ok_or_else(|| EngineError::Internal(format!("no {entry} traced")))?;
        model.entry_points.insert(entry.to_string(), graph);
    }
    rebuild_train_step(model, optimizer)?;
    model.validate()?;
    Ok(())
}

/// Sets `trainable` from freeze prefixes; errors when a prefix matches
/// nothing, since a typo would silently train everything.
pub fn set_frozen(model: &mut Model, prefixes: &[String]) -> EngineResult<()> {
    for prefix in prefixes {
        if !model
            .parameters
            .iter()
            .any(|p| p.name.starts_with(prefix.as_str()))
        {
            let names: Vec<&str> = model.parameters.iter().map(|p| p.name.as_str()).collect();
            return Err(EngineError::Setting(format!(
                "freeze prefix `{prefix}` matches no parameter (parameters: {})",
                names.join(", ")
            )));
        }
    }
    for p in &mut model.parameters {
        p.trainable = !is_frozen(&p.name, prefixes) && !p.name.starts_with(INPUT_STATS_PREFIX);
    }
    Ok(())
}

/// Whether the model's input statistics still await fitting (see
/// [`InputStatsState::of`]).
pub fn needs_input_stats(model: &Model) -> bool {
    InputStatsState::of(model) == InputStatsState::Unfitted
}

/// Sets `input.mean` / `input.std` from `train`'s features (global
/// statistics, so constant pixels cannot cause a division by zero), by the
/// same moments a federated fit merges ([`crate::stats`]).
pub fn fit_input_stats(model: &mut Model, train: &Dataset) -> EngineResult<()> {
    fit_model(model, &InputMoments::of(train)).map(drop)
}

/// The classes a model predicts: the last dimension of the class scores
/// of its `infer` entry point ([`class_scores`]).
pub fn class_count(model: &Model) -> EngineResult<usize> {
    let infer = model.entry(ENTRY_INFER)?;
    let (_, scores) = class_scores(infer)?;
    Ok(batch_rows(infer.ty(scores)).expect("class_scores checked the shape"))
}

/// `[batch, classes]` f32 with at least two classes: the class count.
/// The batch may be fixed (an export traced with one sample); training
/// refuses that later, with the reason.
fn batch_rows(ty: &TensorType) -> Option<usize> {
    match ty.shape.0.as_slice() {
        [_, Dim::Fixed(classes)] if ty.dtype == DType::F32 && *classes >= 2 => Some(*classes),
        _ => None,
    }
}

/// The first output of `infer` shaped `[batch, classes]` in f32, with its
/// name: a zoo model's logits, an imported model's probabilities (its
/// other outputs, such as integer labels, are skipped).
pub fn class_scores(infer: &Graph) -> EngineResult<(&str, ValueId)> {
    infer
        .outputs()
        .iter()
        .find(|(_, value)| batch_rows(infer.ty(*value)).is_some())
        .map(|(name, value)| (name.as_str(), *value))
        .ok_or_else(|| {
            let outputs: Vec<String> = infer
                .outputs()
                .iter()
                .map(|(name, value)| format!("{name}: {}", infer.ty(*value)))
                .collect();
            EngineError::Shape(format!(
                "entry point `{ENTRY_INFER}` has no f32 output shaped [batch, classes] (outputs: {})",
                outputs.join(", ")
            ))
        })
}

/// The data input of an entry point: `x`, or else its one input that is
/// not a parameter (an imported model keeps its ONNX input's name).
pub fn data_input(graph: &Graph) -> EngineResult<ValueId> {
    if let Some(x) = graph.find_input("x") {
        return Ok(x);
    }
    let mut data = graph
        .inputs()
        .iter()
        .filter(|&&id| !graph.input_name(id).starts_with(PARAM_PREFIX));
    match (data.next(), data.next()) {
        (Some(&only), None) => Ok(only),
        _ => Err(EngineError::Missing {
            owner: "the model's entry point".to_string(),
            part: Part::Input,
            name: "x (or a single input that is not a parameter)".to_string(),
        }),
    }
}

/// The sample shape a model's data input expects.
pub fn sample_shape(model: &Model) -> EngineResult<Vec<usize>> {
    let infer = model.entry(ENTRY_INFER)?;
    let x = data_input(infer)?;
    let name = infer.input_name(x);
    let dims = &infer.ty(x).shape.0;
    dims.iter()
        .skip(1)
        .map(|d| {
            d.fixed().ok_or_else(|| {
                EngineError::Shape(format!(
                    "only the leading dimension of `{name}` may be the batch"
                ))
            })
        })
        .collect()
}
