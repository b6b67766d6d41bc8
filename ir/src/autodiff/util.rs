//! Builder helpers shared by the VJP and JVP rules. Everything here emits
//! ordinary IR ops, so derivative graphs stay differentiable.

use crate::error::{IrError, IrResult};
use crate::graph::{Graph, ValueId};
use crate::op::{BinaryOp, UnaryOp};
use crate::types::{DType, Dim, Shape, TensorType};

/// A tensor of `ty` filled with `value`. The scalar is broadcast (not a
/// literal of the full shape) so shapes with the batch dimension work.
pub fn filled(g: &mut Graph, ty: &TensorType, value: f32) -> IrResult<ValueId> {
    let scalar = g.scalar(value)?;
    broadcast_to(g, scalar, &ty.shape)
}

pub fn zeros(g: &mut Graph, ty: &TensorType) -> IrResult<ValueId> {
    filled(g, ty, 0.0)
}

/// `derivative`, or zeros typed like `value` when nothing reached it.
pub fn or_zeros(g: &mut Graph, derivative: Option<ValueId>, value: ValueId) -> IrResult<ValueId> {
    match derivative {
        Some(d) => Ok(d),
        None => {
            let ty = g.ty(value).clone();
            zeros(g, &ty)
        }
    }
}

/// `v` broadcast to `shape`; no node when it already has that shape.
pub fn broadcast_to(g: &mut Graph, v: ValueId, shape: &Shape) -> IrResult<ValueId> {
    if g.ty(v).shape == *shape {
        return Ok(v);
    }
    g.broadcast(v, shape.0.clone())
}

/// `v` reshaped to `shape`; no node when it already has that shape.
pub fn reshape_to(g: &mut Graph, v: ValueId, shape: &Shape) -> IrResult<ValueId> {
    if g.ty(v).shape == *shape {
        return Ok(v);
    }
    g.reshape(v, shape.0.clone())
}

/// The adjoint of broadcasting: sums `ct` over the axes that broadcasting
/// added or stretched, so it gets the shape `target`.
pub fn unbroadcast(g: &mut Graph, ct: ValueId, target: &Shape) -> IrResult<ValueId> {
    let from = g.ty(ct).shape.clone();
    if from == *target {
        return Ok(ct);
    }
    let lead = from.rank() - target.rank();
    let axes: Vec<usize> = (0..from.rank())
        .filter(|&i| {
            i < lead || (target.0[i - lead] == Dim::Fixed(1) && from.0[i] != Dim::Fixed(1))
        })
        .collect();
    let summed = if axes.is_empty() {
        ct
    } else {
        g.sum(ct, &axes, true)?
    };
    reshape_to(g, summed, target)
}

/// `shape` with each of `axes` set to 1: a reduction's keep-dims shape.
pub fn keep_dims_shape(shape: &Shape, axes: &[usize]) -> Shape {
    let dims = shape
        .0
        .iter()
        .enumerate()
        .map(|(i, &d)| if axes.contains(&i) { Dim::Fixed(1) } else { d })
        .collect();
    Shape(dims)
}

/// How many elements a reduction over `axes` of `x` combines, as a value:
/// a literal when static, else counted at run time (the batch dimension).
pub fn reduce_count(g: &mut Graph, x: ValueId, axes: &[usize]) -> IrResult<ValueId> {
    let shape = g.ty(x).shape.clone();
    let fixed: Option<usize> = axes.iter().map(|&a| shape.0[a].fixed()).product();
    match fixed {
        Some(n) => g.scalar(n as f32),
        None => {
            let ones = filled(g, &TensorType::new(DType::F32, shape), 1.0)?;
            g.sum(ones, axes, true)
        }
    }
}

/// A 0/1 f32 mask of a comparison; the cast from bool cuts the derivative,
/// which is right for masks (they are piecewise constant).
pub fn mask(g: &mut Graph, op: BinaryOp, a: ValueId, b: ValueId) -> IrResult<ValueId> {
    let cond = g.binary(op, a, b)?;
    g.cast(cond, DType::F32)
}

/// `v · f'(x)` for an elementwise unary `f` with output `y`. The Jacobian
/// is diagonal, so this one formula is both the VJP (v = cotangent) and the
/// JVP (v = tangent).
pub fn scale_by_unary_derivative(
    g: &mut Graph,
    op: UnaryOp,
    x: ValueId,
    y: ValueId,
    v: ValueId,
) -> IrResult<ValueId> {
    match op {
        UnaryOp::Neg => g.neg(v),
        UnaryOp::Abs => {
            let sign = g.unary(UnaryOp::Sign, x)?;
            g.mul(v, sign)
        }
        // Piecewise constant: the derivative is zero (the edge is cut in
        // activity analysis, so this arm is only reached defensively).
        UnaryOp::Sign | UnaryOp::Not => {
            let ty = g.ty(x).clone();
            zeros(g, &ty)
        }
        UnaryOp::Exp => g.mul(v, y),
        UnaryOp::Log => g.div(v, x),
        UnaryOp::Sqrt => {
            let half = g.scalar(0.5)?;
            let half_v = g.mul(v, half)?;
            g.div(half_v, y)
        }
        // d x^(-1/2) = -1/2 · x^(-1/2) / x
        UnaryOp::Rsqrt => {
            let minus_half = g.scalar(-0.5)?;
            let scaled = g.mul(v, minus_half)?;
            let y_over_x = g.div(y, x)?;
            g.mul(scaled, y_over_x)
        }
        // d (1/x) = -y²
        UnaryOp::Reciprocal => {
            let y2 = g.unary(UnaryOp::Square, y)?;
            let vy2 = g.mul(v, y2)?;
            g.neg(vy2)
        }
        UnaryOp::Square => {
            let two = g.scalar(2.0)?;
            let two_x = g.mul(x, two)?;
            g.mul(v, two_x)
        }
        UnaryOp::Relu => {
            let zero = g.scalar(0.0)?;
            let positive = g.binary(BinaryOp::Gt, x, zero)?;
            g.select(positive, v, zero)
        }
        UnaryOp::Gelu => {
            let d = gelu_derivative(g, x)?;
            g.mul(v, d)
        }
        UnaryOp::Sigmoid => {
            let one = g.scalar(1.0)?;
            let one_minus_y = g.sub(one, y)?;
            let dy = g.mul(y, one_minus_y)?;
            g.mul(v, dy)
        }
        UnaryOp::Tanh => {
            let one = g.scalar(1.0)?;
            let y2 = g.unary(UnaryOp::Square, y)?;
            let sech2 = g.sub(one, y2)?;
            g.mul(v, sech2)
        }
        // erf'(x) = 2/√π · e^(−x²)
        UnaryOp::Erf => {
            let gauss = scaled_gaussian(g, x, 1.0, std::f32::consts::FRAC_2_SQRT_PI)?;
            g.mul(v, gauss)
        }
        // (x·Φ(x))' = Φ(x) + x·φ(x), with Φ(x) = ½(1 + erf(x/√2)) and
        // φ(x) = e^(−x²/2)/√(2π).
        UnaryOp::GeluErf => {
            let d = gelu_erf_derivative(g, x)?;
            g.mul(v, d)
        }
        // softplus' = sigmoid
        UnaryOp::Softplus => {
            let s = g.unary(UnaryOp::Sigmoid, x)?;
            g.mul(v, s)
        }
        // log1p'(x) = 1 / (1 + x)
        UnaryOp::Log1p => {
            let one = g.scalar(1.0)?;
            let one_x = g.add(one, x)?;
            g.div(v, one_x)
        }
    }
}

/// `scale · e^(−width·x²)`.
fn scaled_gaussian(g: &mut Graph, x: ValueId, width: f32, scale: f32) -> IrResult<ValueId> {
    let x2 = g.unary(UnaryOp::Square, x)?;
    let minus_width = g.scalar(-width)?;
    let exponent = g.mul(x2, minus_width)?;
    let e = g.unary(UnaryOp::Exp, exponent)?;
    let scale = g.scalar(scale)?;
    g.mul(e, scale)
}

fn gelu_erf_derivative(g: &mut Graph, x: ValueId) -> IrResult<ValueId> {
    let one = g.scalar(1.0)?;
    let half = g.scalar(0.5)?;
    let inv_sqrt2 = g.scalar(std::f32::consts::FRAC_1_SQRT_2)?;
    let scaled = g.mul(x, inv_sqrt2)?;
    let erf = g.unary(UnaryOp::Erf, scaled)?;
    let one_erf = g.add(one, erf)?;
    let cdf = g.mul(half, one_erf)?;
    // 1/√(2π)
    let pdf = scaled_gaussian(g, x, 0.5, 0.398_942_3)?;
    let x_pdf = g.mul(x, pdf)?;
    g.add(cdf, x_pdf)
}

/// The derivative of the tanh-approximated GELU, from primitives:
/// with u = c·(x + k·x³) and t = tanh(u),
/// gelu'(x) = ½(1 + t) + ½·x·(1 − t²)·c·(1 + 3k·x²).
fn gelu_derivative(g: &mut Graph, x: ValueId) -> IrResult<ValueId> {
    const C: f32 = 0.797_884_6; // √(2/π)
    const K: f32 = 0.044_715;
    let one = g.scalar(1.0)?;
    let half = g.scalar(0.5)?;
    let x2 = g.unary(UnaryOp::Square, x)?;
    let k = g.scalar(K)?;
    let kx2 = g.mul(x2, k)?;
    let one_kx2 = g.add(one, kx2)?;
    let inner = g.mul(x, one_kx2)?;
    let c = g.scalar(C)?;
    let u = g.mul(inner, c)?;
    let t = g.unary(UnaryOp::Tanh, u)?;
    let one_t = g.add(one, t)?;
    let left = g.mul(half, one_t)?;
    let t2 = g.unary(UnaryOp::Square, t)?;
    let sech2 = g.sub(one, t2)?;
    let k3 = g.scalar(3.0 * K)?;
    let k3x2 = g.mul(x2, k3)?;
    let du = g.add(one, k3x2)?;
    let c_half = g.scalar(0.5 * C)?;
    let a = g.mul(x, c_half)?;
    let b = g.mul(a, sech2)?;
    let right = g.mul(b, du)?;
    g.add(left, right)
}

/// Adds `contribution` to an accumulated derivative.
pub fn accumulate(
    g: &mut Graph,
    slot: &mut Option<ValueId>,
    contribution: ValueId,
) -> IrResult<()> {
    *slot = Some(match *slot {
        None => contribution,
        Some(acc) => g.add(acc, contribution)?,
    });
    Ok(())
}

/// Rules must return derivatives typed exactly like the primal value; a
/// mismatch is a bug in a rule, reported rather than silently broadcast.
pub fn check_type(g: &Graph, derivative: ValueId, primal: ValueId, op: &str) -> IrResult<()> {
    let (got, want) = (g.ty(derivative), g.ty(primal));
    if got != want {
        return Err(IrError::Invalid(format!(
            "autodiff rule for `{op}` produced {got} for a value of type {want}"
        )));
    }
    Ok(())
}
