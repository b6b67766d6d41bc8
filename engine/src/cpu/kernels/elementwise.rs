//! Elementwise kernels: unary and binary ops, `Where` and `Cast`.
//!
//! Results are written into an owned operand whose shape is the output
//! shape whenever there is one (graph-mode buffer reuse); otherwise the
//! output starts as a copy of the larger operand and is updated in place,
//! so every case runs through the same fast paths.

use canopy_ir::{BinaryOp, DType, UnaryOp};
use ndarray::{ArrayD, ArrayViewD, Zip};
use rayon::prelude::*;

use super::Arg;
use super::tensor::{
    Element, Number, PAR_THRESHOLD, Tensor, broadcast_shapes, broadcast_to, tensor, to_standard,
};
use crate::error::KernelError;
use crate::value::Value;

/// √(2/π), the constant of the tanh approximation of GELU.
const SQRT_2_OVER_PI: f32 = 0.797_884_6;

pub fn unary(op: UnaryOp, arg: Arg<'_>) -> Result<Value, KernelError> {
    if op == UnaryOp::Not {
        let x = tensor::<bool>(arg, "operand")?;
        return Ok(Value::Bool(map(x, |v| !v)));
    }
    let x = tensor::<f32>(arg, "operand")?;
    let out = match op {
        UnaryOp::Neg => map(x, |v| -v),
        UnaryOp::Abs => map(x, f32::abs),
        UnaryOp::Sign => map(x, sign),
        UnaryOp::Exp => map(x, f32::exp),
        UnaryOp::Log => map(x, f32::ln),
        UnaryOp::Sqrt => map(x, f32::sqrt),
        UnaryOp::Rsqrt => map(x, |v| 1.0 / v.sqrt()),
        UnaryOp::Reciprocal => map(x, |v| 1.0 / v),
        UnaryOp::Square => map(x, |v| v * v),
        // Written as a comparison so that NaN passes through.
        UnaryOp::Relu => map(x, |v| if v < 0.0 { 0.0 } else { v }),
        UnaryOp::Gelu => map(x, gelu),
        UnaryOp::Sigmoid => map(x, |v| 1.0 / (1.0 + (-v).exp())),
        UnaryOp::Tanh => map(x, f32::tanh),
        UnaryOp::Erf => map(x, |v| libm::erf(f64::from(v)) as f32),
        UnaryOp::GeluErf => map(x, gelu_erf),
        UnaryOp::Softplus => map(x, softplus),
        UnaryOp::Log1p => map(x, f32::ln_1p),
        UnaryOp::Not => {
            return Err(KernelError::Internal(
                "`not` reached the f32 kernels".to_string(),
            ));
        }
    };
    Ok(Value::F32(out))
}

/// -1, 0 or 1 (NaN stays NaN, unlike `f32::signum`, which maps 0 to 1).
fn sign(v: f32) -> f32 {
    if v > 0.0 {
        1.0
    } else if v < 0.0 {
        -1.0
    } else {
        v * 0.0
    }
}

fn gelu(v: f32) -> f32 {
    0.5 * v * (1.0 + (SQRT_2_OVER_PI * (v + 0.044_715 * v * v * v)).tanh())
}

/// x·Φ(x), in f64 so the f32 result is correctly rounded but for ties.
fn gelu_erf(v: f32) -> f32 {
    let x = f64::from(v);
    (0.5 * x * (1.0 + libm::erf(x * std::f64::consts::FRAC_1_SQRT_2))) as f32
}

/// max(x, 0) + log1p(e^(−|x|)): no overflow for large x, and full
/// precision for very negative x, where log(1 + eˣ) would round to 0.
fn softplus(v: f32) -> f32 {
    if v.is_nan() {
        return v;
    }
    v.max(0.0) + (-v.abs()).exp().ln_1p()
}

/// Applies `f` to every element, in place when the operand is owned.
fn map<T: Element>(x: Tensor<'_, T>, f: impl Fn(T) -> T + Sync + Send) -> ArrayD<T> {
    match x {
        Tensor::Owned(mut a) => {
            if a.len() >= PAR_THRESHOLD {
                a.par_mapv_inplace(f);
            } else {
                a.mapv_inplace(f);
            }
            a
        }
        Tensor::Shared(a) if a.len() >= PAR_THRESHOLD => Zip::from(a).par_map_collect(|&v| f(v)),
        Tensor::Shared(a) => a.mapv(f),
    }
}

pub fn binary(op: BinaryOp, a: Arg<'_>, b: Arg<'_>) -> Result<Value, KernelError> {
    let dtype = a.value().dtype();
    if op.is_comparison() {
        return for_each_dtype!(dtype, T => compare::<T>(op, a, b));
    }
    if op.is_logical() {
        let (x, y) = (
            tensor::<bool>(a, "left operand")?,
            tensor::<bool>(b, "right operand")?,
        );
        let out = match op {
            BinaryOp::And => combine(x, y, |p, q| p && q)?,
            _ => combine(x, y, |p, q| p || q)?,
        };
        return Ok(Value::Bool(out));
    }
    match dtype {
        DType::F32 => arithmetic::<f32>(op, a, b).map(Value::F32),
        DType::I64 => arithmetic::<i64>(op, a, b).map(Value::I64),
        DType::I32 => arithmetic::<i32>(op, a, b).map(Value::I32),
        DType::Bool => Err(KernelError::DType {
            role: "left operand".to_string(),
            expected: "numeric",
            got: DType::Bool,
        }),
    }
}

fn arithmetic<T: Number>(op: BinaryOp, a: Arg<'_>, b: Arg<'_>) -> Result<ArrayD<T>, KernelError> {
    if op == BinaryOp::Pow {
        let (x, y) = (tensor::<f32>(a, "base")?, tensor::<f32>(b, "exponent")?);
        let out = combine(x, y, f32::powf)?;
        return T::from_value(Value::F32(out))
            .ok_or_else(|| KernelError::Internal("pow reached a non-f32 kernel".to_string()));
    }
    let (x, y) = (
        tensor::<T>(a, "left operand")?,
        tensor::<T>(b, "right operand")?,
    );
    match op {
        BinaryOp::Add => combine(x, y, T::plus),
        BinaryOp::Sub => combine(x, y, T::minus),
        BinaryOp::Mul => combine(x, y, T::times),
        BinaryOp::Div => {
            if T::DIVISION_BY_ZERO_IS_ERROR && y.view().iter().any(|&d| d == T::ZERO) {
                return Err(KernelError::DivisionByZero);
            }
            combine(x, y, T::divide)
        }
        BinaryOp::Maximum => combine(x, y, T::maximum),
        BinaryOp::Minimum => combine(x, y, T::minimum),
        other => Err(KernelError::Internal(format!(
            "`{other:?}` is not an arithmetic op"
        ))),
    }
}

/// `f(a, b)` elementwise with NumPy broadcasting, into an owned operand of
/// the output shape when there is one.
fn combine<T, F>(a: Tensor<'_, T>, b: Tensor<'_, T>, f: F) -> Result<ArrayD<T>, KernelError>
where
    T: Element,
    F: Fn(T, T) -> T + Sync + Send,
{
    let shape = broadcast_shapes(a.shape(), b.shape())?;
    let (mut acc, other, swapped) = match (a, b) {
        (Tensor::Owned(x), y) if x.shape() == shape.as_slice() => (x, y, false),
        (x, Tensor::Owned(y)) if y.shape() == shape.as_slice() => (y, x, true),
        (x, y) if x.shape() == shape.as_slice() => (to_standard(x.view()), y, false),
        (x, y) if y.shape() == shape.as_slice() => (to_standard(y.view()), x, true),
        (x, y) => (to_standard(broadcast_to(&x.view(), &shape)?), y, false),
    };
    let other = other.view();
    if swapped {
        update(&mut acc, &other, |y, x| f(x, y))?;
    } else {
        update(&mut acc, &other, f)?;
    }
    Ok(acc)
}

/// `acc[i] = f(acc[i], other[i])`, with `other` broadcast to `acc`'s shape.
fn update<T, F>(acc: &mut ArrayD<T>, other: &ArrayViewD<'_, T>, f: F) -> Result<(), KernelError>
where
    T: Element,
    F: Fn(T, T) -> T + Sync + Send,
{
    let parallel = acc.len() >= PAR_THRESHOLD;
    if other.len() == 1 {
        let scalar = other.iter().copied().next().unwrap_or_default();
        if parallel {
            acc.par_mapv_inplace(|x| f(x, scalar));
        } else {
            acc.mapv_inplace(|x| f(x, scalar));
        }
        return Ok(());
    }
    if update_same_layout(acc, other, &f, parallel)
        || update_trailing_block(acc, other, &f, parallel)
        || update_leading_block(acc, other, &f, parallel)
    {
        return Ok(());
    }
    let other = broadcast_to(other, acc.shape())?;
    let zip = Zip::from(acc.view_mut()).and(&other);
    if parallel {
        zip.par_for_each(|x, &y| *x = f(*x, y));
    } else {
        zip.for_each(|x, &y| *x = f(*x, y));
    }
    Ok(())
}

/// Fast path: both operands contiguous with identical layouts, so the
/// update is a zip of two slices the compiler vectorises.
fn update_same_layout<T, F>(
    acc: &mut ArrayD<T>,
    other: &ArrayViewD<'_, T>,
    f: &F,
    parallel: bool,
) -> bool
where
    T: Element,
    F: Fn(T, T) -> T + Sync + Send,
{
    if acc.shape() != other.shape() || acc.strides() != other.strides() {
        return false;
    }
    let (Some(dst), Some(src)) = (
        acc.as_slice_memory_order_mut(),
        other.as_slice_memory_order(),
    ) else {
        return false;
    };
    if parallel {
        dst.par_iter_mut()
            .zip(src.par_iter())
            .for_each(|(x, &y)| *x = f(*x, y));
    } else {
        dst.iter_mut().zip(src).for_each(|(x, &y)| *x = f(*x, y));
    }
    true
}

/// Fast path: `other` fills the trailing axes of `acc` (a bias row added to
/// a batch), so each row-major block of `acc` zips with all of `other`.
fn update_trailing_block<T, F>(
    acc: &mut ArrayD<T>,
    other: &ArrayViewD<'_, T>,
    f: &F,
    parallel: bool,
) -> bool
where
    T: Element,
    F: Fn(T, T) -> T + Sync + Send,
{
    let trimmed = trim_leading_ones(other.shape());
    if trimmed.len() > acc.ndim() || !acc.shape().ends_with(trimmed) || other.is_empty() {
        return false;
    }
    let block = other.len();
    let (Some(dst), Some(src)) = (acc.as_slice_mut(), other.as_slice()) else {
        return false;
    };
    let apply = |row: &mut [T]| row.iter_mut().zip(src).for_each(|(x, &y)| *x = f(*x, y));
    if parallel {
        dst.par_chunks_exact_mut(block).for_each(apply);
    } else {
        dst.chunks_exact_mut(block).for_each(apply);
    }
    true
}

/// Fast path: `other` spans the leading axes of `acc` with ones after them
/// (a per-row statistic kept with `keep_dims`), so each element of `other`
/// applies to one contiguous block of `acc`.
fn update_leading_block<T, F>(
    acc: &mut ArrayD<T>,
    other: &ArrayViewD<'_, T>,
    f: &F,
    parallel: bool,
) -> bool
where
    T: Element,
    F: Fn(T, T) -> T + Sync + Send,
{
    let kept = other.ndim() - other.shape().iter().rev().take_while(|&&d| d == 1).count();
    if other.ndim() != acc.ndim()
        || other.shape()[..kept] != acc.shape()[..kept]
        || other.is_empty()
    {
        return false;
    }
    let block = acc.len() / other.len();
    let (Some(dst), Some(src)) = (acc.as_slice_mut(), other.as_slice()) else {
        return false;
    };
    if block == 0 {
        return true;
    }
    let apply = |(row, &y): (&mut [T], &T)| row.iter_mut().for_each(|x| *x = f(*x, y));
    if parallel {
        dst.par_chunks_exact_mut(block)
            .zip(src.par_iter())
            .for_each(apply);
    } else {
        dst.chunks_exact_mut(block).zip(src).for_each(apply);
    }
    true
}

fn trim_leading_ones(shape: &[usize]) -> &[usize] {
    let ones = shape.iter().take_while(|&&d| d == 1).count();
    &shape[ones..]
}

fn compare<T: Element>(op: BinaryOp, a: Arg<'_>, b: Arg<'_>) -> Result<Value, KernelError> {
    let (x, y) = (
        tensor::<T>(a, "left operand")?,
        tensor::<T>(b, "right operand")?,
    );
    let (x, y) = (x.view(), y.view());
    let out = match op {
        BinaryOp::Eq => compare_with(&x, &y, |p, q| p == q),
        BinaryOp::Ne => compare_with(&x, &y, |p, q| p != q),
        BinaryOp::Lt => compare_with(&x, &y, |p, q| p < q),
        BinaryOp::Le => compare_with(&x, &y, |p, q| p <= q),
        BinaryOp::Gt => compare_with(&x, &y, |p, q| p > q),
        BinaryOp::Ge => compare_with(&x, &y, |p, q| p >= q),
        other => Err(KernelError::Internal(format!(
            "`{other:?}` is not a comparison"
        ))),
    }?;
    Ok(Value::Bool(out))
}

fn compare_with<T, F>(
    a: &ArrayViewD<'_, T>,
    b: &ArrayViewD<'_, T>,
    f: F,
) -> Result<ArrayD<bool>, KernelError>
where
    T: Element,
    F: Fn(T, T) -> bool + Sync + Send,
{
    let shape = broadcast_shapes(a.shape(), b.shape())?;
    let (a, b) = (broadcast_to(a, &shape)?, broadcast_to(b, &shape)?);
    let zip = Zip::from(&a).and(&b);
    Ok(if a.len() >= PAR_THRESHOLD {
        zip.par_map_collect(|&p, &q| f(p, q))
    } else {
        zip.map_collect(|&p, &q| f(p, q))
    })
}

/// where(cond, a, b) with broadcasting, into an owned branch of the output
/// shape when there is one.
pub fn select(cond: Arg<'_>, a: Arg<'_>, b: Arg<'_>) -> Result<Value, KernelError> {
    let cond = tensor::<bool>(cond, "condition")?;
    let dtype = a.value().dtype();
    for_each_dtype!(dtype, T => {
        let (x, y) = (tensor::<T>(a, "first branch")?, tensor::<T>(b, "second branch")?);
        select_typed(&cond.view(), x, y).map(T::into_value)
    })
}

fn select_typed<T: Element>(
    cond: &ArrayViewD<'_, bool>,
    a: Tensor<'_, T>,
    b: Tensor<'_, T>,
) -> Result<ArrayD<T>, KernelError> {
    let shape = broadcast_shapes(&broadcast_shapes(cond.shape(), a.shape())?, b.shape())?;
    let cond = broadcast_to(cond, &shape)?;
    let (mut acc, other, keep_when) = match (a, b) {
        (Tensor::Owned(x), y) if x.shape() == shape.as_slice() => (x, y, true),
        (x, Tensor::Owned(y)) if y.shape() == shape.as_slice() => (y, x, false),
        (x, y) => (to_standard(broadcast_to(&x.view(), &shape)?), y, true),
    };
    let other = other.view();
    if select_contiguous(&mut acc, &cond, &other, keep_when) {
        return Ok(acc);
    }
    let other = broadcast_to(&other, &shape)?;
    // `acc` holds one branch; elements where the condition picks the other
    // branch are overwritten.
    let parallel = acc.len() >= PAR_THRESHOLD;
    let zip = Zip::from(acc.view_mut()).and(&cond).and(&other);
    let pick = |x: &mut T, &c: &bool, &y: &T| {
        if c != keep_when {
            *x = y;
        }
    };
    if parallel {
        zip.par_for_each(pick);
    } else {
        zip.for_each(pick);
    }
    Ok(acc)
}

/// Fast path for contiguous operands, with the other branch either of the
/// same layout or a single value (ReLU's gradient is `where(x > 0, g, 0)`).
/// Branch-free so the loop vectorises.
fn select_contiguous<T: Element>(
    acc: &mut ArrayD<T>,
    cond: &ArrayViewD<'_, bool>,
    other: &ArrayViewD<'_, T>,
    keep_when: bool,
) -> bool {
    let (Some(flags), Some(dst)) = (cond.as_slice(), acc.as_slice_mut()) else {
        return false;
    };
    if other.len() == 1 {
        let y = other.iter().copied().next().unwrap_or_default();
        for (x, &c) in dst.iter_mut().zip(flags) {
            *x = if c == keep_when { *x } else { y };
        }
        return true;
    }
    match other.as_slice() {
        Some(src) if src.len() == dst.len() && other.shape() == cond.shape() => {
            for ((x, &c), &y) in dst.iter_mut().zip(flags).zip(src) {
                *x = if c == keep_when { *x } else { y };
            }
            true
        }
        _ => false,
    }
}

/// Converts the element type; a cast to the same dtype returns the operand.
pub fn cast(arg: Arg<'_>, to: DType) -> Value {
    if arg.value().dtype() == to {
        return arg.into_value();
    }
    match arg.value() {
        Value::F32(a) => convert(a, to),
        Value::I64(a) => convert(a, to),
        Value::I32(a) => convert(a, to),
        Value::Bool(a) => convert(a, to),
    }
}

fn convert<T: Element>(a: &ArrayD<T>, to: DType) -> Value {
    match to {
        DType::F32 => Value::F32(a.mapv(T::to_f32)),
        DType::I64 => Value::I64(a.mapv(T::to_i64)),
        DType::I32 => Value::I32(a.mapv(T::to_i32)),
        DType::Bool => Value::Bool(a.mapv(T::to_bool)),
    }
}
