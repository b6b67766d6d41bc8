//! Neural-network layers, written once against [`Tensor`] so they run
//! eagerly or trace into IR.
//!
//! A layer owns no tensors: it declares [`ParamSpec`]s and reads their
//! values from a [`Params`] map at forward time. The same layer object thus
//! builds the graph a model file ships (parameters become `params/NAME`
//! inputs) and runs eagerly on concrete weights.

use std::cell::Cell;
use std::collections::BTreeMap;

use canopy_ir::{Conv2dAttrs, DType, Dim, Pool2dAttrs, TensorData};
use rand::{Rng, SeedableRng, rngs::StdRng};
use rand_distr::{Distribution, Normal};

use crate::error::{EngineError, EngineResult, Part};
use crate::tensor::Tensor;

/// How a parameter is initialised.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// U(-bound, bound); with bound = 1/√fan_in this is PyTorch's default
    /// for linear and conv layers.
    Uniform {
        bound: f32,
    },
    Normal {
        std: f32,
    },
    Zeros,
    Ones,
}

impl Init {
    pub fn fill(self, len: usize, rng: &mut StdRng) -> Vec<f32> {
        match self {
            Init::Uniform { bound } => (0..len).map(|_| rng.random_range(-bound..bound)).collect(),
            Init::Normal { std } => {
                let normal = Normal::new(0.0f32, std).expect("std is finite and positive");
                (0..len).map(|_| normal.sample(rng)).collect()
            }
            Init::Zeros => vec![0.0; len],
            Init::Ones => vec![1.0; len],
        }
    }
}

/// A parameter a layer needs.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub init: Init,
    /// False for statistics fitted from data rather than learned.
    pub trainable: bool,
}

/// Initialises every spec from one seeded RNG, in order, so a seed fixes
/// the whole model.
pub fn init_params(specs: &[ParamSpec], seed: u64) -> Vec<(String, TensorData)> {
    // Zeros and Ones draw nothing from the RNG, so adding a `Standardize`
    // layer does not change the initial weights of the layers after it.
    let mut rng = StdRng::seed_from_u64(seed);
    specs
        .iter()
        .map(|spec| {
            let len = spec.shape.iter().product();
            let values = spec.init.fill(len, &mut rng);
            let data = TensorData::f32(spec.shape.clone(), values)
                .expect("fill produces shape-product elements");
            (spec.name.clone(), data)
        })
        .collect()
}

/// Parameter values by name.
#[derive(Clone, Debug, Default)]
pub struct Params(pub BTreeMap<String, Tensor>);

impl Params {
    pub fn get(&self, name: &str) -> EngineResult<&Tensor> {
        self.0.get(name).ok_or_else(|| EngineError::Missing {
            owner: "the model".to_string(),
            part: Part::Parameter,
            name: name.to_string(),
        })
    }
}

/// Per-call state: training or inference, and the dropout seed.
pub struct ForwardCtx {
    pub training: bool,
    /// i64 scalar seed for dropout masks; required when training with dropout.
    pub seed: Option<Tensor>,
    dropout_calls: Cell<i64>,
}

impl ForwardCtx {
    pub fn inference() -> ForwardCtx {
        ForwardCtx {
            training: false,
            seed: None,
            dropout_calls: Cell::new(0),
        }
    }

    pub fn training(seed: Option<Tensor>) -> ForwardCtx {
        ForwardCtx {
            training: true,
            seed,
            dropout_calls: Cell::new(0),
        }
    }

    /// A seed distinct for each dropout layer of one forward pass.
    fn next_dropout_seed(&self) -> EngineResult<Tensor> {
        let seed = self.seed.as_ref().ok_or_else(|| EngineError::Missing {
            owner: "a training pass with dropout".to_string(),
            part: Part::Input,
            name: "seed".to_string(),
        })?;
        let call = self.dropout_calls.get();
        self.dropout_calls.set(call + 1);
        // A large odd stride keeps the per-layer streams apart.
        let offset = Tensor::from_value(crate::Value::scalar_i64((call + 1) * 0x2545_F491));
        seed.add(&offset)
    }
}

/// A layer: declares its parameters and maps an input to an output.
pub trait Layer {
    fn params(&self) -> Vec<ParamSpec> {
        Vec::new()
    }
    fn forward(&self, params: &Params, x: &Tensor, ctx: &ForwardCtx) -> EngineResult<Tensor>;
}

/// Layers applied in order.
#[derive(Default)]
pub struct Sequential {
    pub layers: Vec<Box<dyn Layer>>,
}

impl Sequential {
    pub fn new() -> Sequential {
        Sequential::default()
    }

    pub fn push(mut self, layer: impl Layer + 'static) -> Sequential {
        self.layers.push(Box::new(layer));
        self
    }
}

impl Layer for Sequential {
    fn params(&self) -> Vec<ParamSpec> {
        self.layers.iter().flat_map(|l| l.params()).collect()
    }

    fn forward(&self, params: &Params, x: &Tensor, ctx: &ForwardCtx) -> EngineResult<Tensor> {
        let mut h = x.clone();
        for layer in &self.layers {
            h = layer.forward(params, &h, ctx)?;
        }
        Ok(h)
    }
}

fn fan_in_uniform(fan_in: usize) -> Init {
    Init::Uniform {
        bound: 1.0 / (fan_in.max(1) as f32).sqrt(),
    }
}

/// y = x·W + b, with W stored [in, out] so the forward needs no transpose.
pub struct Linear {
    pub name: String,
    pub inputs: usize,
    pub outputs: usize,
    pub bias: bool,
}

impl Linear {
    pub fn new(name: &str, inputs: usize, outputs: usize) -> Linear {
        Linear {
            name: name.into(),
            inputs,
            outputs,
            bias: true,
        }
    }
}

impl Layer for Linear {
    fn params(&self) -> Vec<ParamSpec> {
        let init = fan_in_uniform(self.inputs);
        let mut specs = vec![ParamSpec {
            name: format!("{}.weight", self.name),
            shape: vec![self.inputs, self.outputs],
            init,
            trainable: true,
        }];
        if self.bias {
            specs.push(ParamSpec {
                name: format!("{}.bias", self.name),
                shape: vec![self.outputs],
                init,
                trainable: true,
            });
        }
        specs
    }

    fn forward(&self, params: &Params, x: &Tensor, _: &ForwardCtx) -> EngineResult<Tensor> {
        let y = x.matmul(params.get(&format!("{}.weight", self.name))?)?;
        if !self.bias {
            return Ok(y);
        }
        y.add(params.get(&format!("{}.bias", self.name))?)
    }
}

/// 2-D convolution over NCHW input with an OIHW filter and a bias.
pub struct Conv2d {
    pub name: String,
    pub in_channels: usize,
    pub out_channels: usize,
    pub kernel: usize,
    pub attrs: Conv2dAttrs,
}

impl Conv2d {
    pub fn new(name: &str, in_channels: usize, out_channels: usize, kernel: usize) -> Conv2d {
        Conv2d {
            name: name.into(),
            in_channels,
            out_channels,
            kernel,
            attrs: Conv2dAttrs::default(),
        }
    }

    pub fn padding(mut self, padding: usize) -> Conv2d {
        self.attrs.padding = [padding, padding];
        self
    }

    pub fn stride(mut self, stride: usize) -> Conv2d {
        self.attrs.stride = [stride, stride];
        self
    }
}

impl Layer for Conv2d {
    fn params(&self) -> Vec<ParamSpec> {
        let init = fan_in_uniform(self.in_channels * self.kernel * self.kernel);
        vec![
            ParamSpec {
                name: format!("{}.weight", self.name),
                shape: vec![
                    self.out_channels,
                    self.in_channels,
                    self.kernel,
                    self.kernel,
                ],
                init,
                trainable: true,
            },
            ParamSpec {
                name: format!("{}.bias", self.name),
                shape: vec![self.out_channels],
                init,
                trainable: true,
            },
        ]
    }

    fn forward(&self, params: &Params, x: &Tensor, _: &ForwardCtx) -> EngineResult<Tensor> {
        let y = x.conv2d(params.get(&format!("{}.weight", self.name))?, self.attrs)?;
        let bias = params.get(&format!("{}.bias", self.name))?.reshape(vec![
            Dim::Fixed(1),
            Dim::Fixed(self.out_channels),
            Dim::Fixed(1),
            Dim::Fixed(1),
        ])?;
        y.add(&bias)
    }
}

fn pool_attrs(kernel: usize, stride: usize) -> Pool2dAttrs {
    Pool2dAttrs {
        kernel: [kernel, kernel],
        stride: [stride, stride],
        padding: [0, 0],
    }
}

pub struct MaxPool2d(pub Pool2dAttrs);

impl MaxPool2d {
    pub fn new(kernel: usize, stride: usize) -> MaxPool2d {
        MaxPool2d(pool_attrs(kernel, stride))
    }
}

impl Layer for MaxPool2d {
    fn forward(&self, _: &Params, x: &Tensor, _: &ForwardCtx) -> EngineResult<Tensor> {
        x.max_pool2d(self.0)
    }
}

pub struct AvgPool2d(pub Pool2dAttrs);

impl AvgPool2d {
    pub fn new(kernel: usize, stride: usize) -> AvgPool2d {
        AvgPool2d(pool_attrs(kernel, stride))
    }
}

impl Layer for AvgPool2d {
    fn forward(&self, _: &Params, x: &Tensor, _: &ForwardCtx) -> EngineResult<Tensor> {
        x.avg_pool2d(self.0)
    }
}

/// Prefix of the statistics [`Standardize`] reads.
pub const INPUT_STATS_PREFIX: &str = "input.";
pub const INPUT_MEAN: &str = "input.mean";
pub const INPUT_STD: &str = "input.std";

/// (x − mean) / std with scalar statistics stored as frozen parameters
/// (`input.mean`, `input.std`). They start as the identity and are fitted
/// from training data once, so the graph, not device code, owns the
/// preprocessing.
pub struct Standardize;

impl Layer for Standardize {
    fn params(&self) -> Vec<ParamSpec> {
        let stat = |name: &str, init| ParamSpec {
            name: name.into(),
            shape: vec![],
            init,
            trainable: false,
        };
        vec![stat(INPUT_MEAN, Init::Zeros), stat(INPUT_STD, Init::Ones)]
    }

    fn forward(&self, params: &Params, x: &Tensor, _: &ForwardCtx) -> EngineResult<Tensor> {
        x.sub(params.get(INPUT_MEAN)?)?.div(params.get(INPUT_STD)?)
    }
}

/// Keeps the batch dimension and flattens the rest.
pub struct Flatten;

impl Layer for Flatten {
    fn forward(&self, _: &Params, x: &Tensor, _: &ForwardCtx) -> EngineResult<Tensor> {
        x.flatten()
    }
}

macro_rules! activation {
    ($($name:ident => $method:ident),*) => {
        $(
            pub struct $name;
            impl Layer for $name {
                fn forward(&self, _: &Params, x: &Tensor, _: &ForwardCtx) -> EngineResult<Tensor> {
                    x.$method()
                }
            }
        )*
    };
}

activation!(ReLU => relu, GELU => gelu, Sigmoid => sigmoid, Tanh => tanh);

/// Inverted dropout: zeroes each element with probability `p` while
/// training and rescales the rest by 1/(1-p); identity at inference.
pub struct Dropout {
    pub p: f32,
}

impl Layer for Dropout {
    fn forward(&self, _: &Params, x: &Tensor, ctx: &ForwardCtx) -> EngineResult<Tensor> {
        if !ctx.training || self.p == 0.0 {
            return Ok(x.clone());
        }
        if !(0.0..1.0).contains(&self.p) {
            return Err(EngineError::Setting(format!(
                "dropout probability {} is outside [0, 1)",
                self.p
            )));
        }
        let noise = Tensor::random_uniform(&ctx.next_dropout_seed()?, x.dims())?;
        let keep = noise.ge(&Tensor::scalar(self.p))?;
        let scaled = x.scale(1.0 / (1.0 - self.p))?;
        let zeros = Tensor::scalar(0.0).broadcast_to(x.dims())?;
        Tensor::select(&keep, &scaled, &zeros)
    }
}

/// A lookup table: i64 indices [...] → [..., dim].
pub struct Embedding {
    pub name: String,
    pub count: usize,
    pub dim: usize,
}

impl Layer for Embedding {
    fn params(&self) -> Vec<ParamSpec> {
        vec![ParamSpec {
            name: format!("{}.weight", self.name),
            shape: vec![self.count, self.dim],
            init: Init::Normal { std: 1.0 },
            trainable: true,
        }]
    }

    fn forward(&self, params: &Params, x: &Tensor, _: &ForwardCtx) -> EngineResult<Tensor> {
        if !matches!(x.ty().dtype, DType::I64 | DType::I32) {
            return Err(EngineError::DType(format!(
                "embedding `{}` needs integer indices, got {}",
                self.name,
                x.ty()
            )));
        }
        params.get(&format!("{}.weight", self.name))?.gather(x, 0)
    }
}

/// Normalises over the last axis, then scales and shifts.
pub struct LayerNorm {
    pub name: String,
    pub dim: usize,
    pub eps: f32,
}

impl LayerNorm {
    pub fn new(name: &str, dim: usize) -> LayerNorm {
        LayerNorm {
            name: name.into(),
            dim,
            eps: 1e-5,
        }
    }
}

impl Layer for LayerNorm {
    fn params(&self) -> Vec<ParamSpec> {
        vec![
            ParamSpec {
                name: format!("{}.weight", self.name),
                shape: vec![self.dim],
                init: Init::Ones,
                trainable: true,
            },
            ParamSpec {
                name: format!("{}.bias", self.name),
                shape: vec![self.dim],
                init: Init::Zeros,
                trainable: true,
            },
        ]
    }

    fn forward(&self, params: &Params, x: &Tensor, _: &ForwardCtx) -> EngineResult<Tensor> {
        let last = x.rank().checked_sub(1).ok_or_else(|| {
            EngineError::Shape(format!("layer norm `{}` needs rank >= 1", self.name))
        })?;
        let mean = x.mean(&[last], true)?;
        let centered = x.sub(&mean)?;
        let variance = centered.square()?.mean(&[last], true)?;
        let inv_std = variance.add(&Tensor::scalar(self.eps))?.rsqrt()?;
        let normalized = centered.mul(&inv_std)?;
        normalized
            .mul(params.get(&format!("{}.weight", self.name))?)?
            .add(params.get(&format!("{}.bias", self.name))?)
    }
}

/// Mean softmax cross-entropy of `logits` `[B, C]` against i64 labels `[B]`.
pub fn softmax_cross_entropy(logits: &Tensor, labels: &Tensor) -> EngineResult<Tensor> {
    let classes = class_count(logits)?;
    let log_probs = logits.log_softmax(1)?;
    let picked = log_probs.mul(&labels.one_hot(classes)?)?.sum(&[1], false)?;
    picked.mean(&[0], false)?.neg()
}

/// Mean squared error.
pub fn mse(prediction: &Tensor, target: &Tensor) -> EngineResult<Tensor> {
    prediction.sub(target)?.square()?.mean_all()
}

/// How many rows of `logits` score their label highest (i64 scalar).
pub fn correct_count(logits: &Tensor, labels: &Tensor) -> EngineResult<Tensor> {
    let classes = class_count(logits)?;
    let label_logit = logits.mul(&labels.one_hot(classes)?)?.sum(&[1], false)?;
    let best = logits.max(&[1], false)?;
    label_logit.ge(&best)?.cast(DType::I64)?.sum(&[0], false)
}

fn class_count(logits: &Tensor) -> EngineResult<usize> {
    match logits.dims().as_slice() {
        [_, Dim::Fixed(c)] => Ok(*c),
        dims => Err(EngineError::Shape(format!(
            "logits must be [batch, classes], got {dims:?}"
        ))),
    }
}
