//! CPU kernels, one per op. `eval` is the single dispatch point; the kernels
//! live in modules by op family and share the typed operand helpers of
//! `tensor`.

use canopy_ir::{Op, TensorType};

use crate::error::KernelError;
use crate::value::Value;

/// Expands `$body` once per dtype with `$T` bound to that dtype's element
/// type, so one generic kernel serves every dtype of a `Value`.
macro_rules! for_each_dtype {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            canopy_ir::DType::F32 => {
                type $T = f32;
                $body
            }
            canopy_ir::DType::I64 => {
                type $T = i64;
                $body
            }
            canopy_ir::DType::I32 => {
                type $T = i32;
                $body
            }
            canopy_ir::DType::Bool => {
                type $T = bool;
                $body
            }
        }
    };
}

mod conv;
mod elementwise;
pub(crate) mod fused;
pub(crate) mod hot;
mod index;
mod matmul;
mod pool;
mod random;
mod reduce;
mod shape;
mod softmax;
mod tensor;

/// A kernel argument: owned when this is the value's last use (so the
/// kernel may write into it), shared otherwise.
pub enum Arg<'a> {
    Owned(Value),
    Shared(&'a Value),
}

impl Arg<'_> {
    pub fn value(&self) -> &Value {
        match self {
            Arg::Owned(v) => v,
            Arg::Shared(v) => v,
        }
    }

    /// The value itself, copying only when it is shared.
    pub fn into_value(self) -> Value {
        match self {
            Arg::Owned(v) => v,
            Arg::Shared(v) => v.clone(),
        }
    }
}

/// Evaluates `op` on `args`. `out_ty` is the node's declared type and
/// `batch` the bound batch size. Errors say what is wrong with the
/// operands; the caller adds the node, the op and the operand shapes.
pub fn eval(
    op: &Op,
    args: Vec<Arg<'_>>,
    out_ty: &TensorType,
    batch: usize,
) -> Result<Value, KernelError> {
    let out_shape = out_ty.shape.resolve(batch);
    match op {
        Op::Input { .. }
        | Op::Constant(_)
        | Op::CustomGrad(_)
        | Op::Scan(_)
        | Op::Cond(_)
        | Op::WhileLoop(_)
        | Op::Output { .. } => Err(KernelError::Internal(format!(
            "op `{}` is handled by the executor, not by a kernel",
            op.name()
        ))),
        Op::Unary(u) => {
            let [x] = operands(args)?;
            elementwise::unary(*u, x)
        }
        Op::Binary(b) => {
            let [x, y] = operands(args)?;
            elementwise::binary(*b, x, y)
        }
        Op::Where => {
            let [cond, x, y] = operands(args)?;
            elementwise::select(cond, x, y)
        }
        Op::Cast { to } => {
            let [x] = operands(args)?;
            Ok(elementwise::cast(x, *to))
        }
        Op::MatMul {
            transpose_a,
            transpose_b,
        } => {
            let [a, b] = operands(args)?;
            matmul::matmul(a, b, [*transpose_a, *transpose_b])
        }
        Op::Reduce {
            kind,
            axes,
            keep_dims: _,
        } => {
            let [x] = operands(args)?;
            reduce::reduce(*kind, axes, x, &out_shape)
        }
        Op::Reshape { .. } => {
            let [x] = operands(args)?;
            shape::reshape(x, &out_shape)
        }
        Op::Transpose { perm } => {
            let [x] = operands(args)?;
            shape::transpose(x, perm)
        }
        Op::Broadcast { .. } => {
            let [x] = operands(args)?;
            shape::broadcast(x, &out_shape)
        }
        Op::Slice { axis, start, end } => {
            let [x] = operands(args)?;
            shape::slice(x, *axis, *start..*end)
        }
        Op::Pad {
            axis,
            before,
            after,
        } => {
            let [x] = operands(args)?;
            shape::pad(x, *axis, [*before, *after])
        }
        Op::Concat { axis } => shape::concat(args, *axis),
        Op::Conv2d(attrs) => {
            let [x, w] = operands(args)?;
            conv::conv2d(x, w, attrs)
        }
        Op::Conv2dBackwardInput { attrs, input_hw } => {
            let [dy, w] = operands(args)?;
            conv::conv2d_backward_input(dy, w, attrs, *input_hw)
        }
        Op::Conv2dBackwardFilter { attrs, kernel_hw } => {
            let [x, dy] = operands(args)?;
            conv::conv2d_backward_filter(x, dy, attrs, *kernel_hw)
        }
        Op::MaxPool2d(attrs) => {
            let [x] = operands(args)?;
            pool::max_pool2d(x, attrs)
        }
        Op::MaxPool2dSelect(attrs) => {
            let [x, v] = operands(args)?;
            pool::max_pool2d_select(x, v, attrs)
        }
        Op::MaxPool2dBackward(attrs) => {
            let [x, dy] = operands(args)?;
            pool::max_pool2d_backward(x, dy, attrs)
        }
        Op::AvgPool2d(attrs) => {
            let [x] = operands(args)?;
            pool::avg_pool2d(x, attrs)
        }
        Op::AvgPool2dBackward { attrs, input_hw } => {
            let [dy] = operands(args)?;
            pool::avg_pool2d_backward(dy, attrs, *input_hw)
        }
        Op::Softmax { axis } => {
            let [x] = operands(args)?;
            softmax::softmax(x, *axis, softmax::Output::Probabilities)
        }
        Op::LogSoftmax { axis } => {
            let [x] = operands(args)?;
            softmax::softmax(x, *axis, softmax::Output::LogProbabilities)
        }
        Op::Gather { axis } => {
            let [data, indices] = operands(args)?;
            index::gather(data, indices, *axis)
        }
        Op::ScatterAdd { axis, dim_size } => {
            let [indices, updates] = operands(args)?;
            index::scatter_add(indices, updates, *axis, *dim_size)
        }
        Op::ArgMax { axis, .. } => {
            let [x] = operands(args)?;
            reduce::argmax(x, *axis, &out_shape)
        }
        Op::OneHot { depth } => {
            let [indices] = operands(args)?;
            index::one_hot(indices, *depth)
        }
        Op::RandomUniform { .. } => {
            let [seed] = operands(args)?;
            random::random_uniform(seed, &out_shape)
        }
    }
}

/// The arguments as a fixed-size array, or an error naming the mismatch.
fn operands<const N: usize>(args: Vec<Arg<'_>>) -> Result<[Arg<'_>; N], KernelError> {
    let count = args.len();
    args.try_into().map_err(|_| KernelError::Operands {
        expected: N,
        got: count,
    })
}
