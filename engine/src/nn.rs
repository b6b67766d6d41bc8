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

/// What follows a layer, as [`Initializer::for_layer`] reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Follows {
    /// A ReLU.
    ReLU,
    /// A ReLU, then a max pool (a convolution of LeNet-5).
    ReLUAndMaxPool,
    /// No activation: the logits.
    Nothing,
}

/// How a model's weights are drawn (`canopy model new --init`). Every
/// variant draws from the model's one seeded RNG, so a seed fixes the model.
///
/// On a model ([`crate::zoo::build_model_with_init`]) a variant names a
/// scheme, which [`Initializer::for_layer`] turns into each layer's own
/// choice; on a layer ([`Linear::init`], [`Conv2d::init`]) it is that
/// layer's distribution.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Initializer {
    /// He et al. 2015, normal variant (as in the paper): weights from
    /// N(0, 2/fan_in), biases zero. It keeps the activations' variance
    /// through ReLU layers. As a model scheme: He for the layers a ReLU
    /// follows, LeCun for those whose ReLU is max-pooled, Xavier for the
    /// others (the output layer); see [`Initializer::for_layer`].
    #[default]
    He,
    /// Glorot & Bengio 2010, uniform variant (as in the paper): weights
    /// from U(±√(6/(fan_in+fan_out))), so std √(2/(fan_in+fan_out));
    /// biases zero. For linear, tanh and sigmoid layers.
    Xavier,
    /// Weights and biases from U(±1/√fan_in): PyTorch's default for linear
    /// and conv layers, and Canopy's before He.
    Uniform,
    /// LeCun et al. 1998, normal variant: weights from N(0, 1/fan_in),
    /// biases zero; JAX/Flax's default for `Dense` and `Conv` (Flax draws
    /// from a truncated normal of the same variance).
    LeCun,
}

impl Initializer {
    /// Every initialiser, for parsers and help texts.
    pub const ALL: [Initializer; 4] = [
        Initializer::He,
        Initializer::Xavier,
        Initializer::Uniform,
        Initializer::LeCun,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Initializer::He => "he",
            Initializer::Xavier => "xavier",
            Initializer::Uniform => "uniform",
            Initializer::LeCun => "lecun",
        }
    }

    /// Parses an initialiser's [`Initializer::name`].
    pub fn parse(text: &str) -> EngineResult<Initializer> {
        Initializer::ALL
            .into_iter()
            .find(|init| init.name() == text)
            .ok_or_else(|| {
                let known = Initializer::ALL.map(Initializer::name).join(", ");
                EngineError::Setting(format!("unknown initialiser `{text}` (known: {known})"))
            })
    }

    /// A layer's own initialiser under this model scheme, by what
    /// follows the layer. He's gain of 2 makes up for a ReLU halving the
    /// second moment of what the next layer reads; where a max pool
    /// follows the ReLU it raises that moment again (by about 2.4 on
    /// LeNet-5's 2×2 pools), so the gain would compound: LeNet-5 started
    /// with logits of second moment 11 and a first loss of 4.5 (ln 10 is
    /// 2.3), its second SGD step at lr 0.1 overshot to a loss of 16, and
    /// with the convolutions frozen every ReLU died. Those layers get
    /// LeCun's gain of 1 (JAX's default for `Conv`), and the logits,
    /// which no ReLU follows, Xavier.
    pub fn for_layer(self, next: Follows) -> Initializer {
        match (self, next) {
            (Initializer::He, Follows::ReLU) => Initializer::He,
            (Initializer::He, Follows::ReLUAndMaxPool) => Initializer::LeCun,
            (Initializer::He, Follows::Nothing) => Initializer::Xavier,
            (other, _) => other,
        }
    }

    /// The distribution of a layer's weights. For a conv layer the fans
    /// count the kernel window: fan_in = in_channels·kh·kw.
    pub fn weight(self, fan_in: usize, fan_out: usize) -> Init {
        let (fan_in, fan_out) = (fan_in.max(1) as f32, fan_out.max(1) as f32);
        match self {
            Initializer::He => Init::Normal {
                std: (2.0 / fan_in).sqrt(),
            },
            Initializer::Xavier => Init::Uniform {
                bound: (6.0 / (fan_in + fan_out)).sqrt(),
            },
            Initializer::Uniform => Init::Uniform {
                bound: 1.0 / fan_in.sqrt(),
            },
            Initializer::LeCun => Init::Normal {
                std: (1.0 / fan_in).sqrt(),
            },
        }
    }

    /// The distribution of a layer's bias.
    pub fn bias(self, fan_in: usize) -> Init {
        match self {
            Initializer::He | Initializer::Xavier | Initializer::LeCun => Init::Zeros,
            Initializer::Uniform => Initializer::Uniform.weight(fan_in, 0),
        }
    }
}

impl std::fmt::Display for Initializer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// y = x·W + b, with W stored [in, out] so the forward needs no transpose.
pub struct Linear {
    pub name: String,
    pub inputs: usize,
    pub outputs: usize,
    pub bias: bool,
    /// This layer's own initialiser; [`Initializer::Uniform`] unless set.
    pub init: Initializer,
}

impl Linear {
    pub fn new(name: &str, inputs: usize, outputs: usize) -> Linear {
        Linear {
            name: name.into(),
            inputs,
            outputs,
            bias: true,
            init: Initializer::Uniform,
        }
    }

    pub fn init(mut self, init: Initializer) -> Linear {
        self.init = init;
        self
    }
}

impl Layer for Linear {
    fn params(&self) -> Vec<ParamSpec> {
        let mut specs = vec![ParamSpec {
            name: format!("{}.weight", self.name),
            shape: vec![self.inputs, self.outputs],
            init: self.init.weight(self.inputs, self.outputs),
            trainable: true,
        }];
        if self.bias {
            specs.push(ParamSpec {
                name: format!("{}.bias", self.name),
                shape: vec![self.outputs],
                init: self.init.bias(self.inputs),
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
    /// This layer's own initialiser; [`Initializer::Uniform`] unless set.
    pub init: Initializer,
}

impl Conv2d {
    pub fn new(name: &str, in_channels: usize, out_channels: usize, kernel: usize) -> Conv2d {
        Conv2d {
            name: name.into(),
            in_channels,
            out_channels,
            kernel,
            attrs: Conv2dAttrs::default(),
            init: Initializer::Uniform,
        }
    }

    pub fn init(mut self, init: Initializer) -> Conv2d {
        self.init = init;
        self
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
        let window = self.kernel * self.kernel;
        let fan_in = self.in_channels * window;
        vec![
            ParamSpec {
                name: format!("{}.weight", self.name),
                shape: vec![
                    self.out_channels,
                    self.in_channels,
                    self.kernel,
                    self.kernel,
                ],
                init: self.init.weight(fan_in, self.out_channels * window),
                trainable: true,
            },
            ParamSpec {
                name: format!("{}.bias", self.name),
                shape: vec![self.out_channels],
                init: self.init.bias(fan_in),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The sample standard deviation of a parameter's values.
    fn std_of(values: &[f32]) -> f64 {
        let n = values.len() as f64;
        let mean = values.iter().map(|&v| v as f64).sum::<f64>() / n;
        let var = values
            .iter()
            .map(|&v| (v as f64 - mean).powi(2))
            .sum::<f64>()
            / n;
        var.sqrt()
    }

    fn weights_of(layer: &dyn Layer, seed: u64) -> Vec<Vec<f32>> {
        init_params(&layer.params(), seed)
            .into_iter()
            .map(|(_, data)| data.as_f32().expect("f32 parameter").to_vec())
            .collect()
    }

    fn assert_within_5_percent(actual: f64, expected: f64, what: &str) {
        let error = (actual / expected - 1.0).abs();
        assert!(
            error < 0.05,
            "{what}: std {actual} is {:.1}% off {expected}",
            error * 100.0
        );
    }

    #[test]
    fn he_linear_weights_have_std_sqrt_2_over_fan_in_and_zero_bias() {
        let layer = Linear::new("fc", 1024, 1024).init(Initializer::He);
        let params = weights_of(&layer, 7);
        assert_within_5_percent(std_of(&params[0]), (2.0f64 / 1024.0).sqrt(), "He weight");
        assert!(params[1].iter().all(|&b| b == 0.0), "He bias is zero");
    }

    #[test]
    fn xavier_linear_weights_have_std_sqrt_2_over_fan_sum() {
        let layer = Linear::new("fc", 1024, 512).init(Initializer::Xavier);
        let params = weights_of(&layer, 7);
        let expected = (2.0f64 / (1024.0 + 512.0)).sqrt();
        assert_within_5_percent(std_of(&params[0]), expected, "Xavier weight");
        // He's std for the same fan_in is 41% larger: the check tells them apart.
        assert!((std_of(&params[0]) / (2.0f64 / 1024.0).sqrt() - 1.0).abs() > 0.05);
        assert!(params[1].iter().all(|&b| b == 0.0), "Xavier bias is zero");
    }

    #[test]
    fn conv_fans_count_the_kernel_window() {
        let he = Conv2d::new("c", 64, 64, 3).init(Initializer::He);
        let std = std_of(&weights_of(&he, 3)[0]);
        assert_within_5_percent(std, (2.0f64 / (64.0 * 9.0)).sqrt(), "He conv weight");
        let xavier = Conv2d::new("c", 64, 32, 3).init(Initializer::Xavier);
        let std = std_of(&weights_of(&xavier, 3)[0]);
        let expected = (2.0f64 / ((64.0 + 32.0) * 9.0)).sqrt();
        assert_within_5_percent(std, expected, "Xavier conv weight");
    }

    #[test]
    fn uniform_keeps_the_fan_in_bound_on_weights_and_bias() {
        let layer = Linear::new("fc", 400, 300).init(Initializer::Uniform);
        let params = weights_of(&layer, 1);
        let bound = 1.0 / 20.0;
        for values in &params {
            assert!(values.iter().all(|v| v.abs() <= bound));
        }
        // U(±b) has std b/√3.
        assert_within_5_percent(std_of(&params[0]), bound as f64 / 3f64.sqrt(), "uniform");
        assert!(params[1].iter().any(|&b| b != 0.0), "uniform draws biases");
    }

    #[test]
    fn initialisation_is_deterministic_by_seed() {
        for init in Initializer::ALL {
            let layer = Linear::new("fc", 64, 32).init(init);
            assert_eq!(weights_of(&layer, 42), weights_of(&layer, 42), "{init}");
            assert_ne!(weights_of(&layer, 42), weights_of(&layer, 43), "{init}");
        }
    }

    #[test]
    fn the_he_scheme_gives_xavier_to_layers_no_relu_follows() {
        assert_eq!(Initializer::He.for_layer(Follows::ReLU), Initializer::He);
        assert_eq!(
            Initializer::He.for_layer(Follows::ReLUAndMaxPool),
            Initializer::LeCun
        );
        assert_eq!(
            Initializer::He.for_layer(Follows::Nothing),
            Initializer::Xavier
        );
        for next in [Follows::ReLU, Follows::ReLUAndMaxPool, Follows::Nothing] {
            for init in [
                Initializer::Xavier,
                Initializer::Uniform,
                Initializer::LeCun,
            ] {
                assert_eq!(
                    init.for_layer(next),
                    init,
                    "{init} is one distribution everywhere"
                );
            }
        }
    }

    #[test]
    fn initialisers_parse_their_names_and_refuse_others() {
        for init in Initializer::ALL {
            assert_eq!(Initializer::parse(init.name()).unwrap(), init);
        }
        let error = Initializer::parse("kaiming").unwrap_err().to_string();
        assert!(error.contains("`kaiming`") && error.contains("he, xavier, uniform"));
    }
}
