//! Elementwise kernels: one invocation per output element, each operand
//! read at the element's (broadcast) position. The per-node kernels and
//! the fused ones (`fuse.rs`) build each op's value with the same
//! expressions, so NaN, i64 and integer-division semantics are shared.

use std::fmt::Write;

use canopy_ir::{BinaryOp, DType, Op, UnaryOp};

use super::{FLAG_DIVISION_BY_ZERO, Family, Kernel, Site, foreign, per_output};
use crate::gpu::wgsl::{broadcast_index, load};

/// Whether an op of this family, on a first operand of `first`, has a
/// kernel producing `out`.
pub fn check(op: &Op, first: DType, out: DType) -> Result<(), String> {
    match op {
        Op::Unary(UnaryOp::Not) | Op::Broadcast { .. } => Ok(()),
        Op::Unary(u) if first == DType::F32 => unary_expr(*u, "x").map(|_| ()),
        Op::Unary(_) => Err(format!("{} on {first}", op.name())),
        Op::Binary(b) => binary_expr(*b, first, "x", "y").map(|_| ()),
        Op::Where | Op::Cast { .. } => cast_expr(first, out, "x").map(|_| ()),
        other => Err(foreign(other, Family::Elementwise)),
    }
}

pub fn generate(site: &Site<'_>) -> Result<Vec<Kernel>, String> {
    Ok(vec![elementwise(site)?])
}

fn unary_expr(op: UnaryOp, x: &str) -> Result<String, String> {
    Ok(match op {
        UnaryOp::Neg => format!("-{x}"),
        UnaryOp::Abs => format!("abs({x})"),
        UnaryOp::Sign => format!("select(sign({x}), {x}, is_nan_bits({x}))"),
        UnaryOp::Exp => format!("exp({x})"),
        UnaryOp::Log => format!("log({x})"),
        UnaryOp::Sqrt => format!("sqrt({x})"),
        UnaryOp::Rsqrt => format!("inverseSqrt({x})"),
        UnaryOp::Reciprocal => format!("(1.0 / {x})"),
        UnaryOp::Square => format!("({x} * {x})"),
        UnaryOp::Relu => format!("select(max({x}, 0.0), {x}, is_nan_bits({x}))"),
        UnaryOp::Gelu => format!("gelu_tanh({x})"),
        UnaryOp::Sigmoid => format!("stable_sigmoid({x})"),
        UnaryOp::Tanh => format!("stable_tanh({x})"),
        UnaryOp::Not => format!("!{x}"),
        UnaryOp::Erf => format!("erf_f32({x})"),
        UnaryOp::GeluErf => format!("gelu_erf({x})"),
        UnaryOp::Softplus => format!("softplus({x})"),
        UnaryOp::Log1p => format!("log1p_f32({x})"),
    })
}

fn binary_expr(op: BinaryOp, dtype: DType, x: &str, y: &str) -> Result<String, String> {
    use BinaryOp::*;
    let infix = |symbol: &str| format!("({x} {symbol} {y})");
    Ok(match (dtype, op) {
        (DType::F32 | DType::I32, Add) => infix("+"),
        (DType::F32 | DType::I32, Sub) => infix("-"),
        (DType::F32 | DType::I32, Mul) => infix("*"),
        (DType::F32, Div) => infix("/"),
        (DType::I32, Div) => format!("select({x} / {y}, 0i, {y} == 0i)"),
        (DType::I64, Div) => format!("i64_div({x}, {y})"),
        (DType::I64, Mul) => format!("i64_mul({x}, {y})"),
        (DType::F32, Pow) => format!("pow_real({x}, {y})"),
        (DType::F32, Maximum) => format!("nan_max({x}, {y})"),
        (DType::F32, Minimum) => format!("nan_min({x}, {y})"),
        (DType::I32, Maximum) => format!("max({x}, {y})"),
        (DType::I32, Minimum) => format!("min({x}, {y})"),
        (DType::F32 | DType::I32 | DType::Bool, Eq) => infix("=="),
        (DType::F32 | DType::I32 | DType::Bool, Ne) => infix("!="),
        (DType::F32 | DType::I32, Lt) => infix("<"),
        (DType::F32 | DType::I32, Le) => infix("<="),
        (DType::F32 | DType::I32, Gt) => infix(">"),
        (DType::F32 | DType::I32, Ge) => infix(">="),
        (DType::Bool, Lt | Le | Gt | Ge) => {
            let (x, y) = (
                format!("select(0u, 1u, {x})"),
                format!("select(0u, 1u, {y})"),
            );
            return binary_expr(op, DType::I32, &x, &y);
        }
        (DType::Bool, And) => infix("&&"),
        (DType::Bool, Or) => infix("||"),
        (DType::I64, Add) => format!("i64_add({x}, {y})"),
        (DType::I64, Sub) => format!("i64_sub({x}, {y})"),
        (DType::I64, Maximum) => format!("select({x}, {y}, i64_lt({x}, {y}))"),
        (DType::I64, Minimum) => format!("select({x}, {y}, i64_lt({y}, {x}))"),
        (DType::I64, Eq) => format!("i64_eq({x}, {y})"),
        (DType::I64, Ne) => format!("!i64_eq({x}, {y})"),
        (DType::I64, Lt) => format!("i64_lt({x}, {y})"),
        (DType::I64, Le) => format!("!i64_lt({y}, {x})"),
        (DType::I64, Gt) => format!("i64_lt({y}, {x})"),
        (DType::I64, Ge) => format!("!i64_lt({x}, {y})"),
        _ => return Err(format!("{} on {dtype}", Op::Binary(op).name())),
    })
}

/// Converts `x` of `from` to `to`; also the identity used by `where`.
fn cast_expr(from: DType, to: DType, x: &str) -> Result<String, String> {
    use DType::*;
    Ok(match (from, to) {
        (a, b) if a == b => x.to_string(),
        (F32, I32) => format!("i32({x})"),
        (F32, I64) => format!("i64_from_i32(i32({x}))"),
        (F32, Bool) => format!("({x} != 0.0)"),
        (I32, F32) => format!("f32({x})"),
        (I32, I64) => format!("i64_from_i32({x})"),
        (I32, Bool) => format!("({x} != 0i)"),
        (I64, F32) => format!("i64_to_f32({x})"),
        (I64, I32) => format!("bitcast<i32>({x}.x)"),
        (I64, Bool) => format!("({x}.x != 0u || {x}.y != 0u)"),
        (Bool, F32) => format!("select(0.0, 1.0, {x})"),
        (Bool, I32) => format!("select(0i, 1i, {x})"),
        (Bool, I64) => format!("vec2<u32>(select(0u, 1u, {x}), 0u)"),
        (a, b) => return Err(format!("cast from {a} to {b}")),
    })
}

/// One elementwise op applied to operand expressions `operands` (of
/// `operand_types`), as a value of `out`'s type; the shared core of the
/// per-node and the fused kernels.
struct ElementValue {
    value: String,
    /// For an integer division: a condition that flags a zero divisor
    /// ([`FLAG_DIVISION_BY_ZERO`]).
    zero_divisor: Option<String>,
}

fn element_value(
    op: &Op,
    operand_types: &[DType],
    out: DType,
    operands: &[String],
) -> Result<ElementValue, String> {
    let operand = |k: usize| {
        operands
            .get(k)
            .ok_or_else(|| format!("{} lacks operand {k}", op.name()))
    };
    let first = operand_types.first().copied().unwrap_or(out);
    let zero_divisor = match (op, first) {
        (Op::Binary(BinaryOp::Div), DType::I64) => {
            Some(format!("i64_eq({}, vec2<u32>(0u, 0u))", operand(1)?))
        }
        (Op::Binary(BinaryOp::Div), DType::I32) => Some(format!("{} == 0i", operand(1)?)),
        _ => None,
    };
    let value = match op {
        Op::Unary(u) => unary_expr(*u, operand(0)?)?,
        Op::Binary(b) => binary_expr(*b, first, operand(0)?, operand(1)?)?,
        Op::Where => format!("select({}, {}, {})", operand(2)?, operand(1)?, operand(0)?),
        Op::Cast { to } => cast_expr(first, *to, operand(0)?)?,
        // Its operand is already read with broadcast indexing (an external
        // input) or has the output's shape (a fused member).
        Op::Broadcast { .. } => operand(0)?.clone(),
        other => return Err(foreign(other, Family::Elementwise)),
    };
    Ok(ElementValue {
        value,
        zero_divisor,
    })
}

/// The statement that flags a zero divisor, if the op divides integers.
fn zero_divisor_check(value: &ElementValue) -> String {
    value
        .zero_divisor
        .as_ref()
        .map(|zero| format!("  if ({zero}) {{ flags[{FLAG_DIVISION_BY_ZERO}u] = 1u; }}\n"))
        .unwrap_or_default()
}

fn elementwise(site: &Site<'_>) -> Result<Kernel, String> {
    let out_shape = &site.out.1;
    let operands: Vec<String> = site
        .operands
        .iter()
        .enumerate()
        .map(|(k, (dtype, shape))| {
            load(&format!("a{k}"), *dtype, &broadcast_index(shape, out_shape))
        })
        .collect();
    let types: Vec<DType> = site.operands.iter().map(|(dtype, _)| *dtype).collect();
    let element = element_value(site.op, &types, site.out.0, &operands)?;
    let with_flags = element.zero_divisor.is_some();
    let body = format!(
        "{}  let value = {};",
        zero_divisor_check(&element),
        element.value
    );
    Ok(per_output(site, &body, with_flags))
}

/// Where a fused member's operand comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FusedOperand {
    /// The group's external input `k` (binding `k`).
    Input(usize),
    /// The value of an earlier member, by its position in the group.
    Member(usize),
}

/// One node of a fused group.
pub struct FusedMember<'a> {
    pub op: &'a Op,
    pub operands: Vec<FusedOperand>,
    pub out: DType,
}

/// A group of elementwise nodes of one output shape, computed by one
/// kernel: `site.operands` are the group's external inputs, `site.out`
/// is the last member's value (the only one written).
pub struct FusedSite<'a> {
    pub site: Site<'a>,
    pub members: Vec<FusedMember<'a>>,
}

/// One kernel for a fused group: one invocation per output element, each
/// external input loaded once (with its own broadcast indexing), each
/// member a `let` in topological order, the last member stored.
pub fn fused_elementwise(fused: &FusedSite<'_>) -> Result<Kernel, String> {
    let site = &fused.site;
    let out_shape = &site.out.1;
    let mut body = String::new();
    for (k, (dtype, shape)) in site.operands.iter().enumerate() {
        let loaded = load(&format!("a{k}"), *dtype, &broadcast_index(shape, out_shape));
        let _ = writeln!(body, "  let x{k} = {loaded};");
    }
    let mut with_flags = false;
    for (m, member) in fused.members.iter().enumerate() {
        let mut names = Vec::with_capacity(member.operands.len());
        let mut types = Vec::with_capacity(member.operands.len());
        for operand in &member.operands {
            let (name, dtype) = match *operand {
                FusedOperand::Input(k) => (format!("x{k}"), site.operands.get(k).map(|o| o.0)),
                FusedOperand::Member(j) if j < m => {
                    (format!("v{j}"), fused.members.get(j).map(|p| p.out))
                }
                FusedOperand::Member(j) => {
                    return Err(format!("member {m} reads later member {j}"));
                }
            };
            names.push(name);
            types.push(dtype.ok_or_else(|| format!("member {m}: no operand {operand:?}"))?);
        }
        let element = element_value(member.op, &types, member.out, &names)?;
        with_flags |= element.zero_divisor.is_some();
        body.push_str(&zero_divisor_check(&element));
        let _ = writeln!(body, "  let v{m} = {};", element.value);
    }
    let last = fused.members.len().checked_sub(1).ok_or("an empty group")?;
    let _ = write!(body, "  let value = v{last};");
    let mut kernel = per_output(site, &body, with_flags);
    kernel.label = "fused";
    Ok(kernel)
}
