//! The op set: v1, and the ops opset 2 added (each says so; a file
//! declares the newest opset its ops need, see [`Op::opset`]).
//!
//! Every op produces exactly one value. Layouts are NCHW for images and
//! OIHW for convolution filters. Semantics, one line each, are the contract
//! that every backend and every autodiff rule follows.

use crate::control::{Cond, Scan, WhileLoop};
use crate::data::TensorData;
use crate::graph::Graph;
use crate::types::{DType, Dim, TensorType};

/// Elementwise unary ops. All take and return f32 except `Not` (bool).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnaryOp {
    Neg,
    Abs,
    /// -1, 0 or 1.
    Sign,
    Exp,
    Log,
    Sqrt,
    /// 1 / sqrt(x).
    Rsqrt,
    /// 1 / x.
    Reciprocal,
    Square,
    Relu,
    /// tanh approximation: 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))).
    Gelu,
    Sigmoid,
    Tanh,
    /// Logical not, bool → bool.
    Not,
    /// Opset 2. The error function, 2/√π·∫₀ˣ e^(−t²) dt.
    Erf,
    /// Opset 2. Exact GELU: x·Φ(x) = ½·x·(1 + erf(x/√2)), the form
    /// PyTorch, JAX (`approximate=False`) and ONNX use by default; `gelu`
    /// is the tanh approximation, up to 5e-4 away in value.
    GeluErf,
    /// Opset 2. log(1 + eˣ), computed as max(x, 0) + log1p(e^(−|x|)), so it
    /// neither overflows for large x nor loses precision for very negative x.
    Softplus,
    /// Opset 2. log(1 + x), accurate for x near 0.
    Log1p,
}

/// Which GELU: the exact (erf) form or the tanh approximation. The
/// attribute of [`Graph::gelu`](crate::Graph) and of the GELU layer;
/// imported models default to exact, as ONNX does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum GeluApproximation {
    #[default]
    None,
    Tanh,
}

impl GeluApproximation {
    /// The unary op computing this form.
    pub fn op(self) -> UnaryOp {
        match self {
            GeluApproximation::None => UnaryOp::GeluErf,
            GeluApproximation::Tanh => UnaryOp::Gelu,
        }
    }
}

/// Elementwise binary ops with NumPy broadcasting.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
    /// x^y for f32.
    Pow,
    Maximum,
    Minimum,
    /// Comparisons take two tensors of one dtype and return bool.
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    /// Logical ops take and return bool.
    And,
    Or,
}

/// Declares `$enum::ALL`, every variant in the order listed, and
/// `$enum::position`, a `match` over the same list with no wildcard. A
/// variant left out of the list makes that match non-exhaustive, a compile
/// error; one listed twice is an unreachable pattern (denied by clippy's
/// `-D warnings`). So `ALL`, which the file reader and its tests use,
/// cannot fall behind the enum. Exported for other crates' enums (the GPU
/// backend's kernel families); not part of the IR's API.
#[doc(hidden)]
#[macro_export]
macro_rules! all_variants {
    ($(#[$doc:meta])* $enum:ident [$($variant:ident),+ $(,)?]) => {
        impl $enum {
            $(#[$doc])*
            pub const ALL: [$enum; [$(stringify!($variant)),+].len()] = [$($enum::$variant),+];

            /// This variant's index in `ALL`.
            pub const fn position(self) -> usize {
                match self {
                    $($enum::$variant => {
                        // Found while compiling, once per variant.
                        const POSITION: usize = {
                            let mut i = 0;
                            while $enum::ALL[i] as u8 != $enum::$variant as u8 {
                                i += 1;
                            }
                            i
                        };
                        POSITION
                    })+
                }
            }
        }
    };
}

all_variants! {
    /// Every unary op.
    UnaryOp [
        Neg, Abs, Sign, Exp, Log, Sqrt, Rsqrt, Reciprocal, Square, Relu, Gelu, Sigmoid, Tanh, Not,
        Erf, GeluErf, Softplus, Log1p,
    ]
}

all_variants! {
    /// Every binary op.
    BinaryOp [Add, Sub, Mul, Div, Pow, Maximum, Minimum, Eq, Ne, Lt, Le, Gt, Ge, And, Or]
}

impl BinaryOp {
    pub fn is_comparison(self) -> bool {
        matches!(
            self,
            BinaryOp::Eq | BinaryOp::Ne | BinaryOp::Lt | BinaryOp::Le | BinaryOp::Gt | BinaryOp::Ge
        )
    }

    pub fn is_logical(self) -> bool {
        matches!(self, BinaryOp::And | BinaryOp::Or)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceKind {
    Sum,
    Mean,
    Max,
}

all_variants! {
    /// Every reduction.
    ReduceKind [Sum, Mean, Max]
}

/// Convolution geometry; each pair is (height, width).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Conv2dAttrs {
    pub stride: [usize; 2],
    /// Zero padding added on both sides.
    pub padding: [usize; 2],
    pub dilation: [usize; 2],
}

impl Default for Conv2dAttrs {
    fn default() -> Self {
        Conv2dAttrs {
            stride: [1, 1],
            padding: [0, 0],
            dilation: [1, 1],
        }
    }
}

/// Pooling geometry; each pair is (height, width). Padding never wins a max
/// and counts as zero in an average (count_include_pad).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Pool2dAttrs {
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub padding: [usize; 2],
}

/// A function with a user-written backward rule that replaces the derived
/// one.
///
/// `forward` maps the node's inputs (in order) to one output. `backward`
/// takes the same inputs, then the forward output `y`, then the cotangent
/// `dy`, and returns one gradient per forward input, in order. Because `y`
/// is an input of the backward graph, a rule can reuse the forward result.
#[derive(Clone, Debug, PartialEq)]
pub struct CustomGrad {
    pub name: String,
    pub forward: Graph,
    pub backward: Graph,
}

/// An operation, with its attributes.
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// A named graph input.
    Input {
        name: String,
    },
    /// A literal tensor.
    Constant(Box<TensorData>),
    Unary(UnaryOp),
    Binary(BinaryOp),
    /// where(cond: bool, a, b): a where cond, else b, with broadcasting.
    Where,
    /// Converts the element type (float → int truncates toward zero).
    Cast {
        to: DType,
    },
    /// Batched matmul: [..., m, k] × [..., k, n] → [..., m, n]; batch
    /// dimensions broadcast. The transpose flags swap the last two axes of
    /// an operand first, so autodiff needs no materialised transpose.
    MatMul {
        transpose_a: bool,
        transpose_b: bool,
    },
    /// Reduction over sorted, distinct `axes`.
    Reduce {
        kind: ReduceKind,
        axes: Vec<usize>,
        keep_dims: bool,
    },
    /// Same elements, new shape (row-major order is kept).
    Reshape {
        shape: Vec<Dim>,
    },
    /// `out.shape[i] = in.shape[perm[i]]`.
    Transpose {
        perm: Vec<usize>,
    },
    /// NumPy broadcast_to.
    Broadcast {
        shape: Vec<Dim>,
    },
    /// Elements [start, end) along one axis.
    Slice {
        axis: usize,
        start: usize,
        end: usize,
    },
    /// Zero padding along one axis (the adjoint of `Slice`).
    Pad {
        axis: usize,
        before: usize,
        after: usize,
    },
    /// Joins its inputs (at least one) along `axis`.
    Concat {
        axis: usize,
    },
    /// conv2d(x: [N, C, H, W], w: [O, C, KH, KW]) → [N, O, OH, OW], no bias.
    Conv2d(Conv2dAttrs),
    /// The gradient of conv2d with respect to x: (dy, w) → x-shaped, for an
    /// input of spatial size `input_hw`.
    Conv2dBackwardInput {
        attrs: Conv2dAttrs,
        input_hw: [usize; 2],
    },
    /// The gradient of conv2d with respect to w: (x, dy) → w-shaped, for a
    /// filter of spatial size `kernel_hw`.
    Conv2dBackwardFilter {
        attrs: Conv2dAttrs,
        kernel_hw: [usize; 2],
    },
    /// Max over each window of x: [N, C, H, W] → [N, C, OH, OW].
    MaxPool2d(Pool2dAttrs),
    /// (x, v) → pooled-shaped: v at the position where x has its window
    /// maximum (the first one on ties). `MaxPool2d(x) = Select(x, x)`.
    MaxPool2dSelect(Pool2dAttrs),
    /// (x, dy) → x-shaped: each dy routed to its window's argmax in x
    /// (the adjoint of `MaxPool2dSelect` in its second operand).
    MaxPool2dBackward(Pool2dAttrs),
    /// Mean over each window (padding counts as zero).
    AvgPool2d(Pool2dAttrs),
    /// dy → x-shaped, the adjoint of `AvgPool2d`, for input size `input_hw`.
    AvgPool2dBackward {
        attrs: Pool2dAttrs,
        input_hw: [usize; 2],
    },
    /// Opset 2. f32 → i64: the index of the largest element along `axis`,
    /// the first one on ties; a NaN counts as larger than any number (the
    /// first NaN wins), as in NumPy. `keep_dims` keeps `axis` with size 1.
    /// An empty axis is an error.
    ArgMax {
        axis: usize,
        keep_dims: bool,
    },
    Softmax {
        axis: usize,
    },
    LogSoftmax {
        axis: usize,
    },
    /// gather(data, indices: i64|i32) along `axis`: out.shape =
    /// data.shape[..axis] ++ indices.shape ++ data.shape[axis+1..].
    /// Out-of-range indices are a runtime error.
    Gather {
        axis: usize,
    },
    /// scatter_add(indices, updates): the adjoint of `Gather`; returns zeros
    /// of data shape (axis length `dim_size`) with updates summed in.
    ScatterAdd {
        axis: usize,
        dim_size: usize,
    },
    /// one_hot(indices: i64|i32) → f32 [..., depth]; out-of-range rows are 0.
    OneHot {
        depth: usize,
    },
    /// uniform(seed: i64 scalar) → f32 in [0, 1) of `shape`; the same seed
    /// gives the same values on every backend: element `i` (row-major) is
    /// `(splitmix64(seed as u64 + (i as u64 + 1) * 0x9E3779B97F4A7C15) >> 40) as f32 / 2^24`
    /// with wrapping arithmetic, where splitmix64 is the finaliser
    /// `z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27; z *= 0x94D049BB133111EB; z ^= z >> 31`.
    RandomUniform {
        shape: Vec<Dim>,
    },
    /// A call with a user-written backward rule.
    CustomGrad(Box<CustomGrad>),
    /// Opset 3. A loop over a leading axis with a carry (see [`Scan`]).
    Scan(Box<Scan>),
    /// Opset 3. One of two graphs, chosen by a bool scalar (see [`Cond`]).
    Cond(Box<Cond>),
    /// Opset 3. A loop with a condition and a bound on its trips (see
    /// [`WhileLoop`]).
    WhileLoop(Box<WhileLoop>),
    /// Opset 3. Result `index` of the control-flow node it reads, the only
    /// op that reads one (see `control.rs`).
    Output {
        index: usize,
    },
}

impl Op {
    /// The first op-set version with this op (and these semantics). A file
    /// declares the newest its ops need, so a model using only v1 ops is
    /// still readable by a v1 reader.
    pub fn opset(&self) -> u16 {
        match self {
            Op::Unary(UnaryOp::Erf | UnaryOp::GeluErf | UnaryOp::Softplus | UnaryOp::Log1p)
            | Op::ArgMax { .. } => 2,
            Op::CustomGrad(custom) => custom.forward.opset().max(custom.backward.opset()),
            Op::Scan(_) | Op::Cond(_) | Op::WhileLoop(_) => {
                self.subgraphs().iter().map(|g| g.opset()).fold(3, u16::max)
            }
            Op::Output { .. } => 3,
            _ => 1,
        }
    }

    /// Stable op name, used in error messages, op counts and the file format.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Input { .. } => "input",
            Op::Constant(_) => "constant",
            Op::Unary(u) => match u {
                UnaryOp::Neg => "neg",
                UnaryOp::Abs => "abs",
                UnaryOp::Sign => "sign",
                UnaryOp::Exp => "exp",
                UnaryOp::Log => "log",
                UnaryOp::Sqrt => "sqrt",
                UnaryOp::Rsqrt => "rsqrt",
                UnaryOp::Reciprocal => "reciprocal",
                UnaryOp::Square => "square",
                UnaryOp::Relu => "relu",
                UnaryOp::Gelu => "gelu",
                UnaryOp::Sigmoid => "sigmoid",
                UnaryOp::Tanh => "tanh",
                UnaryOp::Not => "not",
                UnaryOp::Erf => "erf",
                UnaryOp::GeluErf => "gelu_erf",
                UnaryOp::Softplus => "softplus",
                UnaryOp::Log1p => "log1p",
            },
            Op::Binary(b) => match b {
                BinaryOp::Add => "add",
                BinaryOp::Sub => "sub",
                BinaryOp::Mul => "mul",
                BinaryOp::Div => "div",
                BinaryOp::Pow => "pow",
                BinaryOp::Maximum => "maximum",
                BinaryOp::Minimum => "minimum",
                BinaryOp::Eq => "eq",
                BinaryOp::Ne => "ne",
                BinaryOp::Lt => "lt",
                BinaryOp::Le => "le",
                BinaryOp::Gt => "gt",
                BinaryOp::Ge => "ge",
                BinaryOp::And => "and",
                BinaryOp::Or => "or",
            },
            Op::Where => "where",
            Op::Cast { .. } => "cast",
            Op::MatMul { .. } => "matmul",
            Op::Reduce { kind, .. } => match kind {
                ReduceKind::Sum => "sum",
                ReduceKind::Mean => "mean",
                ReduceKind::Max => "max",
            },
            Op::Reshape { .. } => "reshape",
            Op::Transpose { .. } => "transpose",
            Op::Broadcast { .. } => "broadcast",
            Op::Slice { .. } => "slice",
            Op::Pad { .. } => "pad",
            Op::Concat { .. } => "concat",
            Op::Conv2d(_) => "conv2d",
            Op::Conv2dBackwardInput { .. } => "conv2d_backward_input",
            Op::Conv2dBackwardFilter { .. } => "conv2d_backward_filter",
            Op::MaxPool2d(_) => "max_pool2d",
            Op::MaxPool2dSelect(_) => "max_pool2d_select",
            Op::MaxPool2dBackward(_) => "max_pool2d_backward",
            Op::AvgPool2d(_) => "avg_pool2d",
            Op::AvgPool2dBackward { .. } => "avg_pool2d_backward",
            Op::ArgMax { .. } => "argmax",
            Op::Softmax { .. } => "softmax",
            Op::LogSoftmax { .. } => "log_softmax",
            Op::Gather { .. } => "gather",
            Op::ScatterAdd { .. } => "scatter_add",
            Op::OneHot { .. } => "one_hot",
            Op::RandomUniform { .. } => "random_uniform",
            Op::CustomGrad(_) => "custom_grad",
            Op::Scan(_) => "scan",
            Op::Cond(_) => "cond",
            Op::WhileLoop(_) => "while_loop",
            Op::Output { .. } => "output",
        }
    }

    /// How many inputs the op takes; `None` for variadic ops.
    pub fn arity(&self) -> Option<usize> {
        Some(match self {
            Op::Input { .. } | Op::Constant(_) => 0,
            Op::Unary(_)
            | Op::Cast { .. }
            | Op::Reduce { .. }
            | Op::Reshape { .. }
            | Op::Transpose { .. }
            | Op::Broadcast { .. }
            | Op::Slice { .. }
            | Op::Pad { .. }
            | Op::MaxPool2d(_)
            | Op::AvgPool2d(_)
            | Op::AvgPool2dBackward { .. }
            | Op::ArgMax { .. }
            | Op::Softmax { .. }
            | Op::LogSoftmax { .. }
            | Op::OneHot { .. }
            | Op::RandomUniform { .. }
            | Op::Output { .. } => 1,
            Op::Binary(_)
            | Op::MatMul { .. }
            | Op::Conv2d(_)
            | Op::Conv2dBackwardInput { .. }
            | Op::Conv2dBackwardFilter { .. }
            | Op::MaxPool2dSelect(_)
            | Op::MaxPool2dBackward(_)
            | Op::Gather { .. }
            | Op::ScatterAdd { .. } => 2,
            Op::Where => 3,
            Op::Concat { .. } => return None,
            Op::CustomGrad(c) => c.forward.inputs().len(),
            Op::Scan(scan) => scan.body.inputs().len(),
            Op::Cond(cond) => cond.then_branch.inputs().len() + 1,
            Op::WhileLoop(w) => w.body.inputs().len(),
        })
    }

    /// This op with each loop body and branch replaced by `f` of it (in
    /// [`Op::subgraphs`] order); any other op, a custom gradient included,
    /// as it is. The one place a pass that rewrites graphs walks into
    /// control flow.
    pub fn map_control_bodies(
        &self,
        mut f: impl FnMut(&Graph) -> crate::error::IrResult<Graph>,
    ) -> crate::error::IrResult<Op> {
        Ok(match self {
            Op::Scan(scan) => {
                let mut mapped = (**scan).clone();
                mapped.body = f(&scan.body)?;
                Op::Scan(Box::new(mapped))
            }
            Op::Cond(cond) => Op::Cond(Box::new(Cond {
                then_branch: f(&cond.then_branch)?,
                else_branch: f(&cond.else_branch)?,
            })),
            Op::WhileLoop(w) => Op::WhileLoop(Box::new(WhileLoop {
                cond: f(&w.cond)?,
                body: f(&w.body)?,
                carries: w.carries,
                max_trips: w.max_trips,
            })),
            op => op.clone(),
        })
    }

    /// The graphs nested in this op (bodies, branches, custom rules).
    pub fn subgraphs(&self) -> Vec<&Graph> {
        match self {
            Op::CustomGrad(c) => vec![&c.forward, &c.backward],
            Op::Scan(scan) => vec![&scan.body],
            Op::Cond(cond) => vec![&cond.then_branch, &cond.else_branch],
            Op::WhileLoop(w) => vec![&w.cond, &w.body],
            _ => Vec::new(),
        }
    }

    /// For a control-flow op, its results' types given operands of types
    /// `t` (`None` for every other op: those have one result).
    pub fn results(&self, t: &[&TensorType]) -> Option<Result<Vec<TensorType>, String>> {
        Some(match self {
            Op::Scan(scan) => scan.results(t),
            Op::Cond(cond) => cond.results(t),
            Op::WhileLoop(w) => w.results(t),
            _ => return None,
        })
    }

    /// True for a control-flow op: its value is a tuple that only
    /// [`Op::Output`] nodes read.
    pub fn is_tuple(&self) -> bool {
        matches!(self, Op::Scan(_) | Op::Cond(_) | Op::WhileLoop(_))
    }

    /// True for ops whose result depends only on their inputs and attributes
    /// (every op but graph inputs), so equal nodes may be merged.
    pub fn is_pure(&self) -> bool {
        !matches!(self, Op::Input { .. })
    }
}

/// The output size of a strided window over `input` (conv and pooling).
pub fn window_output_size(
    input: usize,
    kernel: usize,
    stride: usize,
    padding: usize,
    dilation: usize,
) -> Option<usize> {
    let effective_kernel = dilation
        .checked_mul(kernel.checked_sub(1)?)?
        .checked_add(1)?;
    let padded = input.checked_add(padding.checked_mul(2)?)?;
    if stride == 0 || padded < effective_kernel {
        return None;
    }
    Some((padded - effective_kernel) / stride + 1)
}
