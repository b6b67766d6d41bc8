//! Elementwise kernels: unary and binary ops, `Where` and `Cast`.
//!
//! Results are written into an owned operand whose shape is the output
//! shape whenever there is one (graph-mode buffer reuse); otherwise the
//! output starts as a copy of the larger operand and is updated in place,
//! so every case runs through the same fast paths.

use canopy_ir::{BinaryOp, DType, UnaryOp};
use ndarray::{ArrayD, ArrayViewD, CowArray, IxDyn, Zip};
use rayon::prelude::*;

use super::Arg;
use super::tensor::{
    Element, Number, PAR_THRESHOLD, Tensor, broadcast_shapes, broadcast_to, tensor, to_standard,
};
use crate::error::KernelError;
use crate::value::Value;

/// √(2/π), the constant of the tanh approximation of GELU.
const SQRT_2_OVER_PI: f32 = 0.797_884_6;

/// The one table of f32 unary functions: evaluates `$body` with `$f`
/// bound to `op`'s function (each use compiles its own loop, which the
/// compiler vectorises), or `$not` for `not`, the one bool op. The op
/// kernel and the fused kernel both read it.
macro_rules! with_unary_f32 {
    ($op:expr, $f:ident => $body:expr, not => $not:expr) => {
        match $op {
            UnaryOp::Neg => with_unary_f32!(@ $f = |v: f32| -v; $body),
            UnaryOp::Abs => with_unary_f32!(@ $f = f32::abs; $body),
            UnaryOp::Sign => with_unary_f32!(@ $f = $crate::cpu::kernels::elementwise::sign; $body),
            UnaryOp::Exp => with_unary_f32!(@ $f = f32::exp; $body),
            UnaryOp::Log => with_unary_f32!(@ $f = f32::ln; $body),
            UnaryOp::Sqrt => with_unary_f32!(@ $f = f32::sqrt; $body),
            UnaryOp::Rsqrt => with_unary_f32!(@ $f = |v: f32| 1.0 / v.sqrt(); $body),
            UnaryOp::Reciprocal => with_unary_f32!(@ $f = |v: f32| 1.0 / v; $body),
            UnaryOp::Square => with_unary_f32!(@ $f = |v: f32| v * v; $body),
            // Written as a comparison so that NaN passes through.
            UnaryOp::Relu => {
                with_unary_f32!(@ $f = |v: f32| if v < 0.0 { 0.0 } else { v }; $body)
            }
            UnaryOp::Gelu => with_unary_f32!(@ $f = $crate::cpu::kernels::elementwise::gelu; $body),
            UnaryOp::Sigmoid => {
                with_unary_f32!(@ $f = $crate::cpu::kernels::elementwise::sigmoid; $body)
            }
            UnaryOp::Tanh => with_unary_f32!(@ $f = $crate::cpu::kernels::elementwise::tanh; $body),
            UnaryOp::Erf => {
                with_unary_f32!(@ $f = |v: f32| libm::erf(f64::from(v)) as f32; $body)
            }
            UnaryOp::GeluErf => with_unary_f32!(@ $f = $crate::cpu::kernels::elementwise::gelu_erf; $body),
            UnaryOp::Softplus => with_unary_f32!(@ $f = $crate::cpu::kernels::elementwise::softplus; $body),
            UnaryOp::Log1p => with_unary_f32!(@ $f = f32::ln_1p; $body),
            UnaryOp::Not => $not,
        }
    };
    (@ $f:ident = $func:expr; $body:expr) => {{
        let $f = $func;
        $body
    }};
}
pub(super) use with_unary_f32;

/// The one table of f32 arithmetic (and `pow`): `$body` with `$f` bound to
/// `op`'s function, or `$other` for the ops that are not arithmetic.
macro_rules! with_arithmetic_f32 {
    ($op:expr, $f:ident => $body:expr, other => $other:expr) => {
        match $op {
            BinaryOp::Add => with_unary_f32!(@ $f = <f32 as Number>::plus; $body),
            BinaryOp::Sub => with_unary_f32!(@ $f = <f32 as Number>::minus; $body),
            BinaryOp::Mul => with_unary_f32!(@ $f = <f32 as Number>::times; $body),
            BinaryOp::Div => with_unary_f32!(@ $f = <f32 as Number>::divide; $body),
            BinaryOp::Maximum => with_unary_f32!(@ $f = <f32 as Number>::maximum; $body),
            BinaryOp::Minimum => with_unary_f32!(@ $f = <f32 as Number>::minimum; $body),
            BinaryOp::Pow => with_unary_f32!(@ $f = f32::powf; $body),
            _ => $other,
        }
    };
}
pub(super) use with_arithmetic_f32;

/// The one table of comparisons, for any element type.
macro_rules! with_comparison {
    ($op:expr, $f:ident => $body:expr, other => $other:expr) => {
        match $op {
            BinaryOp::Eq => with_unary_f32!(@ $f = |p, q| p == q; $body),
            BinaryOp::Ne => with_unary_f32!(@ $f = |p, q| p != q; $body),
            BinaryOp::Lt => with_unary_f32!(@ $f = |p, q| p < q; $body),
            BinaryOp::Le => with_unary_f32!(@ $f = |p, q| p <= q; $body),
            BinaryOp::Gt => with_unary_f32!(@ $f = |p, q| p > q; $body),
            BinaryOp::Ge => with_unary_f32!(@ $f = |p, q| p >= q; $body),
            _ => $other,
        }
    };
}
pub(super) use with_comparison;

pub fn unary(op: UnaryOp, arg: Arg<'_>) -> Result<Value, KernelError> {
    if op == UnaryOp::Not {
        let x = tensor::<bool>(arg, "operand")?;
        return Ok(Value::Bool(map(x, |v| !v)));
    }
    let x = tensor::<f32>(arg, "operand")?;
    let out = with_unary_f32!(op, f => map(x, f), not => {
        return Err(KernelError::Internal(
            "`not` reached the f32 kernels".to_string(),
        ));
    });
    Ok(Value::F32(out))
}

/// eˣ without a branch or a call, so that a loop over it vectorises:
/// x = n·ln 2 + r with |r| ≤ ln 2 / 2, eʳ by a degree-7 polynomial
/// (Cephes' expf coefficients), 2ⁿ by building the float's exponent.
/// Within 2 ulp of the correctly rounded result over the normal range;
/// results below the smallest normal float flush to 0, above `f32::MAX`
/// are +inf, and NaN stays NaN. Recurrent cells spend most of their
/// elementwise time here: `f32::exp` is a call per element.
pub(super) fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding and subtracting 1.5·2²³ rounds to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    const HIGHEST: f32 = 88.722_83;
    const LOWEST: f32 = -87.336_55;
    let clamped = x.clamp(LOWEST, HIGHEST);
    let n = (clamped * LOG2E + ROUND) - ROUND;
    let r = clamped - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 0.166_666_65;
    p = p * r + 0.5;
    let er = p * r * r + r + 1.0;
    // 2ⁿ in two factors, each a normal float for every n in −126..=128
    // (2ⁿ itself is not at either end).
    let half = (n as i32) >> 1;
    let power = |k: i32| f32::from_bits(((k + 127) as u32) << 23);
    let y = er * power(half) * power(n as i32 - half);
    if x > HIGHEST {
        f32::INFINITY
    } else if x < LOWEST {
        0.0
    } else {
        y
    }
}

/// 1 / (1 + e⁻ˣ), on the vectorised [`exp`].
pub(super) fn sigmoid(v: f32) -> f32 {
    1.0 / (1.0 + exp(-v))
}

/// tanh, branch-free so that it vectorises: an odd polynomial below
/// |x| = 0.625 (Cephes' tanhf coefficients; 1 − 2/(e²ˣ + 1) would cancel
/// there), else 1 − 2/(e^2|x| + 1) with the sign restored.
pub(super) fn tanh(v: f32) -> f32 {
    let z = v * v;
    let mut p = -5.704_988_7e-3_f32;
    p = p * z + 2.063_909e-2;
    p = p * z - 5.373_971_6e-2;
    p = p * z + 0.133_314_42;
    p = p * z - 0.333_332_8;
    let small = p * z * v + v;
    let large = 1.0 - 2.0 / (exp(2.0 * v.abs()) + 1.0);
    // tanh is odd: the sign is v's (−0 included).
    (if v.abs() < 0.625 { small } else { large }).copysign(v)
}

/// -1, 0 or 1 (NaN stays NaN, unlike `f32::signum`, which maps 0 to 1).
pub(super) fn sign(v: f32) -> f32 {
    if v > 0.0 {
        1.0
    } else if v < 0.0 {
        -1.0
    } else {
        v * 0.0
    }
}

pub(super) fn gelu(v: f32) -> f32 {
    0.5 * v * (1.0 + (SQRT_2_OVER_PI * (v + 0.044_715 * v * v * v)).tanh())
}

/// x·Φ(x), in f64 so the f32 result is correctly rounded but for ties.
pub(super) fn gelu_erf(v: f32) -> f32 {
    let x = f64::from(v);
    (0.5 * x * (1.0 + libm::erf(x * std::f64::consts::FRAC_1_SQRT_2))) as f32
}

/// max(x, 0) + log1p(e^(−|x|)): no overflow for large x, and full
/// precision for very negative x, where log(1 + eˣ) would round to 0.
pub(super) fn softplus(v: f32) -> f32 {
    if v.is_nan() {
        return v;
    }
    v.max(0.0) + (-v.abs()).exp().ln_1p()
}

/// Applies `f` to every element, in place when the operand is owned.
fn map<T: Element>(x: Tensor<'_, T>, f: impl Fn(T) -> T + Sync + Send) -> ArrayD<T> {
    match x {
        owned @ Tensor::Owned(_) => {
            let mut a = owned.into_standard();
            let dst = a.as_slice_mut().expect("standard layout");
            run(dst, &|_, out: &mut [T]| {
                out.iter_mut().for_each(|v| *v = f(*v))
            });
            a
        }
        Tensor::Shared(a) => {
            let source = a.as_standard_layout();
            let src = source.as_slice().expect("standard layout");
            let mut out = ArrayD::<T>::default(a.raw_dim());
            let dst = out.as_slice_mut().expect("standard layout");
            run(dst, &|offset, out: &mut [T]| {
                let src = &src[offset..offset + out.len()];
                out.iter_mut().zip(src).for_each(|(v, &s)| *v = f(s));
            });
            out
        }
    }
}

/// Elements one parallel task takes when an op is split across the pool.
const BLOCK: usize = 32 * 1024;

/// One op's loop over a contiguous run of its output, told where the run
/// starts in the whole output. Each op has its own small loop, which the
/// compiler vectorises; [`run`] takes it as `&dyn`, so what splits the
/// output across threads is compiled once per element type rather than
/// once per op and layout (half the app library's size was such copies:
/// docs/mobile.md).
type Body<'a, T> = dyn Fn(usize, &mut [T]) + Sync + 'a;

/// Runs `body` over all of `dst`: in blocks on the pool from
/// [`PAR_THRESHOLD`] elements, else at once on this thread.
fn run<T: Send>(dst: &mut [T], body: &Body<'_, T>) {
    if dst.len() >= PAR_THRESHOLD {
        super::hot::keep_hot();
        dst.par_chunks_mut(BLOCK)
            .enumerate()
            .for_each(|(i, out)| body(i * BLOCK, out));
    } else {
        body(0, dst);
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
    let (acc, other, swapped) = match (a, b) {
        (x, y) if matches!(x, Tensor::Owned(_)) && x.shape() == shape.as_slice() => (x, y, false),
        (x, y) if matches!(y, Tensor::Owned(_)) && y.shape() == shape.as_slice() => (y, x, true),
        (x, y) if x.shape() == shape.as_slice() => (x, y, false),
        (x, y) if y.shape() == shape.as_slice() => (y, x, true),
        (x, y) => (
            Tensor::Owned(to_standard(broadcast_to(&x.view(), &shape)?)),
            y,
            false,
        ),
    };
    let mut acc = acc.into_standard();
    let other = other.view();
    if swapped {
        update(&mut acc, &other, |y, x| f(x, y))?;
    } else {
        update(&mut acc, &other, f)?;
    }
    Ok(acc)
}

/// `acc[i] = f(acc[i], other[i])`, with `other` broadcast to `acc`'s shape
/// (row major).
fn update<T, F>(acc: &mut ArrayD<T>, other: &ArrayViewD<'_, T>, f: F) -> Result<(), KernelError>
where
    T: Element,
    F: Fn(T, T) -> T + Sync + Send,
{
    let shape = acc.shape().to_vec();
    let (source, repeat) = lined_up(other, &shape)?;
    let src = source.as_slice().expect("standard layout");
    let dst = acc.as_slice_mut().expect("standard layout");
    run(dst, &|offset, out: &mut [T]| {
        repeat.for_runs(offset, out, src, &mut |out, run| match run {
            Run::Zip(src) => out.iter_mut().zip(src).for_each(|(x, &y)| *x = f(*x, y)),
            Run::Splat(y) => out.iter_mut().for_each(|x| *x = f(*x, y)),
        });
    });
    Ok(())
}

/// How a broadcast operand lines up with a row-major output: output
/// element `i` pairs with operand element `(i / inner) % period`. Every
/// broadcast whose operand varies along one run of adjacent output axes
/// has this form: the same shape (`inner` 1, `period` the length), a bias
/// row over a batch (`inner` 1), a statistic per row kept with
/// `keep_dims`, a per-channel bias over NCHW (`inner` H·W, `period` C), a
/// scalar (`period` 1, `inner` the length).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Repeat {
    inner: usize,
    period: usize,
}

/// `operand`'s elements in row-major order and how they pair with an
/// output of `shape`. A broadcast over axes that are not adjacent is
/// spelled out once and then pairs element for element.
pub(super) fn lined_up<'b, T: Clone>(
    operand: &'b ArrayViewD<'_, T>,
    shape: &[usize],
) -> Result<(CowArray<'b, T, IxDyn>, Repeat), KernelError> {
    Ok(match Repeat::of(shape, operand.shape()) {
        Some(repeat) => (operand.as_standard_layout(), repeat),
        None => (
            to_standard(broadcast_to(operand, shape)?).into(),
            Repeat::elementwise(shape.iter().product()),
        ),
    })
}

/// A stretch of output whose operand elements are a slice of the operand
/// or one element repeated.
pub(super) enum Run<'s, T> {
    Zip(&'s [T]),
    Splat(T),
}

impl Repeat {
    /// Where output elements `offset..offset + len` find their operand
    /// elements as one contiguous slice, if they do: from there on.
    pub(super) fn contiguous(&self, offset: usize, len: usize) -> Option<usize> {
        let start = offset % self.period;
        (self.inner == 1 && start + len <= self.period).then_some(start)
    }

    fn elementwise(len: usize) -> Repeat {
        Repeat {
            inner: 1,
            period: len.max(1),
        }
    }

    /// `None` when the operand varies along axes that are not adjacent.
    fn of(out: &[usize], operand: &[usize]) -> Option<Repeat> {
        let pad = out.len().checked_sub(operand.len())?;
        let dim = |axis: usize| if axis < pad { 1 } else { operand[axis - pad] };
        let varying: Vec<usize> = (0..out.len()).filter(|&a| dim(a) != 1).collect();
        let len: usize = out.iter().product();
        let (Some(&first), Some(&last)) = (varying.first(), varying.last()) else {
            return Some(Repeat {
                inner: len.max(1),
                period: 1,
            });
        };
        if (first..=last).any(|a| dim(a) != out[a]) {
            return None;
        }
        Some(Repeat {
            inner: out[last + 1..].iter().product(),
            period: out[first..=last].iter().product(),
        })
    }

    /// Calls `each` on consecutive stretches of `out`, which starts at
    /// output element `offset`, with the operand elements that pair with
    /// them.
    pub(super) fn for_runs<'s, O, T: Copy>(
        self,
        offset: usize,
        out: &mut [O],
        src: &'s [T],
        each: &mut dyn FnMut(&mut [O], Run<'s, T>),
    ) {
        let mut done = 0;
        while done < out.len() {
            let at = offset + done;
            let left = out.len() - done;
            let (len, run) = if self.inner == 1 {
                let start = at % self.period;
                let len = (self.period - start).min(left);
                (len, Run::Zip(&src[start..start + len]))
            } else {
                let len = (self.inner - at % self.inner).min(left);
                (len, Run::Splat(src[(at / self.inner) % self.period]))
            };
            each(&mut out[done..done + len], run);
            done += len;
        }
    }
}

fn compare<T: Element>(op: BinaryOp, a: Arg<'_>, b: Arg<'_>) -> Result<Value, KernelError> {
    let (x, y) = (
        tensor::<T>(a, "left operand")?,
        tensor::<T>(b, "right operand")?,
    );
    let (x, y) = (x.view(), y.view());
    let out = with_comparison!(op, f => compare_with(&x, &y, f), other => {
        Err(KernelError::Internal(format!("`{op:?}` is not a comparison")))
    })?;
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
    let left = broadcast_to(a, &shape)?;
    let left = left.as_standard_layout();
    let (source, repeat) = lined_up(b, &shape)?;
    let (lhs, rhs) = (
        left.as_slice().expect("standard layout"),
        source.as_slice().expect("standard layout"),
    );
    let mut out = ArrayD::<bool>::default(IxDyn(&shape));
    let dst = out.as_slice_mut().expect("standard layout");
    run(dst, &|offset, out: &mut [bool]| {
        let mut done = 0;
        let lhs = &lhs[offset..offset + out.len()];
        repeat.for_runs(offset, out, rhs, &mut |out, run| {
            let lhs = &lhs[done..done + out.len()];
            done += out.len();
            match run {
                Run::Zip(rhs) => {
                    for ((o, &p), &q) in out.iter_mut().zip(lhs).zip(rhs) {
                        *o = f(p, q);
                    }
                }
                Run::Splat(q) => {
                    for (o, &p) in out.iter_mut().zip(lhs) {
                        *o = f(p, q);
                    }
                }
            }
        });
    });
    Ok(out)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The largest relative error of `f` against `reference` (in f64) over
    /// `count` points spread over `low..high`.
    fn worst(f: fn(f32) -> f32, reference: fn(f64) -> f64, low: f32, high: f32) -> f64 {
        let count = 200_000;
        (0..=count)
            .map(|i| low + (high - low) * i as f32 / count as f32)
            .map(|x| {
                let want = reference(f64::from(x));
                (f64::from(f(x)) - want).abs() / want.abs().max(f64::from(f32::MIN_POSITIVE))
            })
            .fold(0.0, f64::max)
    }

    #[test]
    fn the_vectorised_exp_sigmoid_and_tanh_are_within_a_few_ulp() {
        // One f32 ulp is 2^-23 ≈ 1.19e-7 relative at most.
        assert!(worst(exp, f64::exp, -87.0, 88.7) < 3.0e-7);
        assert!(worst(sigmoid, |x| 1.0 / (1.0 + (-x).exp()), -80.0, 80.0) < 4.0e-7);
        assert!(worst(tanh, f64::tanh, -12.0, 12.0) < 3.0e-7);
        assert!(worst(tanh, f64::tanh, -1e-3, 1e-3) < 2.0e-7);
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(100.0), f32::INFINITY);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert!(exp(88.72).is_finite());
        assert_eq!((tanh(f32::INFINITY), tanh(f32::NEG_INFINITY)), (1.0, -1.0));
        assert_eq!(tanh(1e-30), 1e-30);
        assert!(tanh(-0.0).is_sign_negative());
        assert_eq!(
            (sigmoid(f32::INFINITY), sigmoid(f32::NEG_INFINITY)),
            (1.0, 0.0)
        );
        for f in [exp, sigmoid, tanh] {
            assert!(f(f32::NAN).is_nan());
        }
    }

    /// The operand index each output element pairs with, by the rule.
    fn pairs(out: &[usize], operand: &[usize]) -> Option<Vec<usize>> {
        let repeat = Repeat::of(out, operand)?;
        let len = out.iter().product();
        Some(
            (0..len)
                .map(|i| (i / repeat.inner) % repeat.period)
                .collect(),
        )
    }

    /// The same pairing through ndarray's broadcasting of the indices.
    fn broadcast_pairs(out: &[usize], operand: &[usize]) -> Vec<usize> {
        let len = operand.iter().product();
        let indices = ArrayD::from_shape_vec(IxDyn(operand), (0..len).collect()).expect("shape");
        let view = indices.view();
        broadcast_to(&view, out)
            .expect("broadcasts")
            .iter()
            .copied()
            .collect()
    }

    #[test]
    fn the_repeat_rule_pairs_elements_as_broadcasting_does() {
        let cases: [(&[usize], &[usize]); 9] = [
            (&[4, 3], &[4, 3]),
            (&[4, 3], &[3]),
            (&[4, 3], &[4, 1]),
            (&[2, 3, 4, 5], &[1, 3, 1, 1]),
            (&[2, 3, 4, 5], &[3, 1, 1]),
            (&[2, 3, 4, 5], &[3, 4, 1]),
            (&[2, 3], &[]),
            (&[2, 3], &[1, 1]),
            (&[5], &[1]),
        ];
        for (out, operand) in cases {
            assert_eq!(
                pairs(out, operand),
                Some(broadcast_pairs(out, operand)),
                "{out:?} with {operand:?}"
            );
        }
        // Varying along axes 0 and 2, not adjacent: no single repeat.
        assert_eq!(Repeat::of(&[2, 3, 4], &[2, 1, 4]), None);
    }

    #[test]
    fn runs_split_at_any_offset_cover_the_output_in_order() {
        let repeat = Repeat::of(&[3, 4, 5], &[4, 1]).expect("adjacent");
        let src: Vec<i64> = (0..4).collect();
        let expected = broadcast_pairs(&[3, 4, 5], &[4, 1]);
        for split in [1, 7, 20, 59] {
            let mut out = vec![-1i64; 60];
            let (head, tail) = out.split_at_mut(split);
            for (offset, part) in [(0, head), (split, tail)] {
                repeat.for_runs(offset, part, &src, &mut |out, run| match run {
                    Run::Zip(src) => out.copy_from_slice(src),
                    Run::Splat(y) => out.fill(y),
                });
            }
            let got: Vec<usize> = out.iter().map(|&v| v as usize).collect();
            assert_eq!(got, expected, "split at {split}");
        }
    }

    #[test]
    fn a_large_update_split_across_the_pool_equals_the_sequential_one() {
        let rows = PAR_THRESHOLD / 64 + 3;
        let acc: Vec<f32> = (0..rows * 64).map(|i| (i % 97) as f32).collect();
        let bias: Vec<f32> = (0..64).map(|i| i as f32 * 0.5).collect();
        let mut big = ArrayD::from_shape_vec(IxDyn(&[rows, 64]), acc.clone()).expect("shape");
        let bias = ArrayD::from_shape_vec(IxDyn(&[64]), bias).expect("shape");
        update(&mut big, &bias.view(), |x, y| x * 2.0 + y).expect("updates");
        for (i, (&got, &x)) in big.iter().zip(&acc).enumerate() {
            assert_eq!(got, x * 2.0 + (i % 64) as f32 * 0.5, "element {i}");
        }
    }
}
