//! WGSL generators, one per op family: each turns a node with resolved
//! shapes into one or more kernels, with every shape baked into the source
//! as constants (so a pipeline is cached per op and shape).
//!
//! [`check`] is the compile-time half: it says whether an op, with these
//! element types, has a kernel, so an unsupported graph is refused before
//! anything reaches the device.

use std::fmt::Write;

use canopy_ir::{BinaryOp, Conv2dAttrs, DType, Op, Pool2dAttrs, ReduceKind, UnaryOp};

use super::gemm;
use super::wgsl::{
    HELPERS, WORKGROUP, broadcast_index, coordinates, coordinates_named, declare, flat_entry, grid,
    load, store, strides, value_type, workgroup_tree, zero,
};

/// One dispatch of one pipeline.
#[derive(Clone, Debug)]
pub struct Kernel {
    pub label: &'static str,
    pub source: String,
    pub workgroups: [u32; 3],
    /// What each binding is, in binding order.
    pub bindings: Vec<Bind>,
}

/// Flag words every run clears and reads back: an index out of range, an
/// integer division by zero; the words from [`FLAG_OUTPUTS`] on mark
/// outputs with a non-finite element.
pub const FLAG_INDEX_OUT_OF_RANGE: u32 = 0;
pub const FLAG_DIVISION_BY_ZERO: u32 = 1;
pub const FLAG_OUTPUTS: u32 = 2;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bind {
    /// The node's operand `k`.
    Operand(usize),
    Output,
    /// The run's flag words ([`FLAG_INDEX_OUT_OF_RANGE`], …).
    Flags,
}

/// A node's operands and result, shapes resolved.
pub struct Site<'a> {
    pub op: &'a Op,
    pub operands: Vec<(DType, Vec<usize>)>,
    pub out: (DType, Vec<usize>),
    pub max_workgroups: u32,
}

/// Whether the backend has a kernel for `op` with these operand and result
/// element types; the error says what is missing.
pub fn check(op: &Op, operands: &[DType], out: DType) -> Result<(), String> {
    let first = operands.first().copied().unwrap_or(out);
    match op {
        Op::Input { .. } | Op::Constant(_) => Ok(()),
        Op::Unary(UnaryOp::Not) => Ok(()),
        Op::Unary(u) if first == DType::F32 => Ok(unary_expr(*u, "x").map(|_| ())?),
        Op::Binary(b) => binary_expr(*b, first, "x", "y").map(|_| ()),
        Op::Where | Op::Cast { .. } => cast_expr(first, out, "x").map(|_| ()),
        Op::MatMul { .. } | Op::Softmax { .. } | Op::LogSoftmax { .. } | Op::ArgMax { .. }
            if first == DType::F32 =>
        {
            Ok(())
        }
        Op::Reduce { kind, .. } => match (kind, first) {
            (_, DType::F32) | (ReduceKind::Sum | ReduceKind::Max, DType::I64 | DType::I32) => {
                Ok(())
            }
            _ => Err(format!("{} over {first}", op.name())),
        },
        Op::Reshape { .. }
        | Op::Transpose { .. }
        | Op::Broadcast { .. }
        | Op::Slice { .. }
        | Op::Pad { .. }
        | Op::Concat { .. } => Ok(()),
        Op::Conv2d(_)
        | Op::Conv2dBackwardInput { .. }
        | Op::Conv2dBackwardFilter { .. }
        | Op::MaxPool2d(_)
        | Op::MaxPool2dSelect(_)
        | Op::MaxPool2dBackward(_)
        | Op::AvgPool2d(_)
        | Op::AvgPool2dBackward { .. }
            if operands.iter().all(|d| *d == DType::F32) =>
        {
            Ok(())
        }
        Op::Gather { .. }
        | Op::OneHot { .. }
        | Op::ScatterAdd { .. }
        | Op::RandomUniform { .. } => Ok(()),
        _ => Err(format!("{} on {first}", op.name())),
    }
}

/// The kernels that compute one node.
pub fn generate(site: &Site<'_>) -> Result<Vec<Kernel>, String> {
    let op = site.op;
    Ok(match op {
        Op::Unary(_) | Op::Binary(_) | Op::Where | Op::Cast { .. } => vec![elementwise(site)?],
        Op::MatMul {
            transpose_a,
            transpose_b,
        } => vec![gemm::matmul(site, *transpose_a, *transpose_b)],
        Op::Reduce {
            kind,
            axes,
            keep_dims: _,
        } => vec![reduce(site, *kind, axes)],
        Op::Transpose { perm } => vec![transpose(site, perm)],
        Op::Broadcast { .. } => vec![broadcast(site)],
        Op::Slice { axis, start, .. } => vec![slice(site, *axis, *start)],
        Op::Pad { axis, before, .. } => vec![pad(site, *axis, *before)],
        Op::Concat { axis } => concat(site, *axis),
        Op::Softmax { axis } => vec![softmax(site, *axis, false)],
        Op::LogSoftmax { axis } => vec![softmax(site, *axis, true)],
        Op::OneHot { depth } => vec![one_hot(site, *depth)],
        Op::ArgMax { axis, .. } => vec![argmax(site, *axis)],
        Op::Gather { axis } => vec![gather(site, *axis)],
        Op::ScatterAdd { axis, dim_size } => vec![scatter_add(site, *axis, *dim_size)],
        Op::RandomUniform { .. } => vec![random_uniform(site)],
        Op::Conv2d(attrs) => vec![conv2d(site, attrs)],
        Op::Conv2dBackwardInput { attrs, .. } => vec![conv2d_backward_input(site, attrs)],
        Op::Conv2dBackwardFilter { attrs, .. } => vec![gemm::conv2d_backward_filter(site, attrs)],
        Op::MaxPool2d(attrs) => vec![max_pool(site, attrs, MaxPoolOutput::Max)],
        Op::MaxPool2dSelect(attrs) => vec![max_pool(site, attrs, MaxPoolOutput::Select)],
        Op::MaxPool2dBackward(attrs) => vec![max_pool_backward(site, attrs)],
        Op::AvgPool2d(attrs) => vec![avg_pool(site, attrs)],
        Op::AvgPool2dBackward { attrs, .. } => vec![avg_pool_backward(site, attrs)],
        Op::Input { .. } | Op::Constant(_) | Op::Reshape { .. } | Op::CustomGrad(_) => {
            return Err(format!("{} has no kernel of its own", op.name()));
        }
    })
}

fn count(shape: &[usize]) -> u64 {
    shape.iter().product::<usize>() as u64
}

/// Declarations: operands `a0…` (read-only), then `out`, in [`Bind`] order.
fn header(site: &Site<'_>, with_flags: bool) -> (String, Vec<Bind>) {
    let mut source = String::from(HELPERS);
    let mut bindings = Vec::new();
    for (k, (dtype, _)) in site.operands.iter().enumerate() {
        declare(&mut source, k, &format!("a{k}"), *dtype, false);
        bindings.push(Bind::Operand(k));
    }
    declare(&mut source, bindings.len(), "out", site.out.0, true);
    bindings.push(Bind::Output);
    if with_flags {
        let _ = writeln!(
            source,
            "@group(0) @binding({}) var<storage, read_write> flags: array<u32>;",
            bindings.len()
        );
        bindings.push(Bind::Flags);
    }
    (source, bindings)
}

/// A kernel with one invocation per output element; `body` computes
/// `value` (of the output's value type) from `i` and `c0…`.
fn per_output(site: &Site<'_>, label: &'static str, body: &str, with_flags: bool) -> Kernel {
    let (mut source, bindings) = header(site, with_flags);
    let n = count(&site.out.1);
    let groups = grid(n, site.max_workgroups);
    let full = format!(
        "{}{body}\n  {}",
        coordinates(&site.out.1, "i"),
        store("out", site.out.0, "i", "value")
    );
    flat_entry(&mut source, n, groups, &full);
    Kernel {
        label,
        source,
        workgroups: groups,
        bindings,
    }
}

// ---- elementwise -------------------------------------------------------

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
        other => return Err(format!("{} is not elementwise", other.name())),
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
    let label = if with_flags { "div" } else { site.op.name() };
    let body = format!(
        "{}  let value = {};",
        zero_divisor_check(&element),
        element.value
    );
    Ok(per_output(site, label, &body, with_flags))
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
    Ok(per_output(site, "fused", &body, with_flags))
}

// ---- layout --------------------------------------------------------------

/// An output element copied from one operand element found by `source`.
fn copy_from(site: &Site<'_>, label: &'static str, source: &str) -> Kernel {
    let value = load("a0", site.operands[0].0, source);
    per_output(site, label, &format!("  let value = {value};"), false)
}

fn transpose(site: &Site<'_>, perm: &[usize]) -> Kernel {
    let in_strides = strides(&site.operands[0].1);
    let terms: Vec<String> = perm
        .iter()
        .enumerate()
        .map(|(axis, &from)| format!("c{axis} * {}u", in_strides[from]))
        .collect();
    copy_from(site, "transpose", &join_sum(&terms))
}

fn broadcast(site: &Site<'_>) -> Kernel {
    copy_from(
        site,
        "broadcast",
        &broadcast_index(&site.operands[0].1, &site.out.1),
    )
}

fn slice(site: &Site<'_>, axis: usize, start: usize) -> Kernel {
    let in_strides = strides(&site.operands[0].1);
    let terms: Vec<String> = (0..site.out.1.len())
        .map(|a| {
            let offset = if a == axis {
                format!(" + {start}u")
            } else {
                String::new()
            };
            format!("(c{a}{offset}) * {}u", in_strides[a])
        })
        .collect();
    copy_from(site, "slice", &join_sum(&terms))
}

fn pad(site: &Site<'_>, axis: usize, before: usize) -> Kernel {
    let (dtype, in_shape) = &site.operands[0];
    let in_strides = strides(in_shape);
    let terms: Vec<String> = (0..in_shape.len())
        .map(|a| {
            let coordinate = if a == axis {
                format!("(c{a} - {before}u)")
            } else {
                format!("c{a}")
            };
            format!("{coordinate} * {}u", in_strides[a])
        })
        .collect();
    let inside = format!(
        "c{axis} >= {before}u && c{axis} < {}u",
        before + in_shape[axis]
    );
    let body = format!(
        "  var value = {};\n  if ({inside}) {{ value = {}; }}",
        zero(*dtype),
        load("a0", *dtype, &join_sum(&terms))
    );
    per_output(site, "pad", &body, false)
}

/// One kernel per operand, each writing its block of the output.
fn concat(site: &Site<'_>, axis: usize) -> Vec<Kernel> {
    let out_shape = &site.out.1;
    let out_strides = strides(out_shape);
    let mut offset = 0usize;
    let mut kernels = Vec::new();
    for (k, (dtype, shape)) in site.operands.iter().enumerate() {
        let mut source = String::from(HELPERS);
        declare(&mut source, 0, "a0", *dtype, false);
        declare(&mut source, 1, "out", *dtype, true);
        let terms: Vec<String> = (0..shape.len())
            .map(|a| {
                let shift = if a == axis {
                    format!(" + {offset}u")
                } else {
                    String::new()
                };
                format!("(c{a}{shift}) * {}u", out_strides[a])
            })
            .collect();
        let n = count(shape);
        let groups = grid(n, site.max_workgroups);
        let body = format!(
            "{}  let value = {};\n  {}",
            coordinates(shape, "i"),
            load("a0", *dtype, "i"),
            store("out", *dtype, &join_sum(&terms), "value")
        );
        flat_entry(&mut source, n, groups, &body);
        kernels.push(Kernel {
            label: "concat",
            source,
            workgroups: groups,
            bindings: vec![Bind::Operand(k), Bind::Output],
        });
        offset += shape[axis];
    }
    kernels
}

fn join_sum(terms: &[String]) -> String {
    if terms.is_empty() {
        "0u".to_string()
    } else {
        terms.join(" + ")
    }
}

// ---- reductions ------------------------------------------------------------

/// One workgroup per output element: each invocation folds a strided share
/// of the reduced elements, then a tree in workgroup memory folds the
/// workgroup's partial results.
fn reduce(site: &Site<'_>, kind: ReduceKind, axes: &[usize]) -> Kernel {
    let (dtype, in_shape) = &site.operands[0];
    let in_strides = strides(in_shape);
    let kept: Vec<usize> = (0..in_shape.len()).filter(|a| !axes.contains(a)).collect();
    let reduced_shape: Vec<usize> = axes.iter().map(|&a| in_shape[a]).collect();
    let reduced: u64 = count(&reduced_shape);
    let outputs = count(&site.out.1);
    let ty = value_type(*dtype);
    let (identity, fold) = match (kind, dtype) {
        (ReduceKind::Max, DType::F32) => {
            ("bitcast<f32>(0xff800000u)".to_string(), "nan_max(acc, v)")
        }
        (ReduceKind::Max, DType::I32) => ("i32(-2147483648)".to_string(), "max(acc, v)"),
        (ReduceKind::Max, _) => (
            "vec2<u32>(0u, 0x80000000u)".to_string(),
            "select(acc, v, i64_lt(acc, v))",
        ),
        (_, DType::I64) => (zero(*dtype).to_string(), "i64_add(acc, v)"),
        _ => (zero(*dtype).to_string(), "acc + v"),
    };
    // The input offset of kept coordinates k0… and reduced coordinates r0….
    let kept_offset = join_sum(
        &kept
            .iter()
            .enumerate()
            .map(|(j, &a)| format!("k{j} * {}u", in_strides[a]))
            .collect::<Vec<_>>(),
    );
    let reduced_offset = join_sum(
        &axes
            .iter()
            .enumerate()
            .map(|(j, &a)| format!("r{j} * {}u", in_strides[a]))
            .collect::<Vec<_>>(),
    );
    let kept_shape: Vec<usize> = kept.iter().map(|&a| in_shape[a]).collect();
    let split = coordinates_named;
    let mean = if kind == ReduceKind::Mean && reduced == 0 {
        "  result = bitcast<f32>(0x7fc00000u);\n".to_string()
    } else if kind == ReduceKind::Mean {
        format!("  result = result / {reduced}.0;\n")
    } else {
        String::new()
    };
    let mut source = String::from(HELPERS);
    declare(&mut source, 0, "a0", *dtype, false);
    declare(&mut source, 1, "out", site.out.0, true);
    let groups = grid(outputs * u64::from(WORKGROUP), site.max_workgroups);
    let row = u64::from(groups[0]);
    let _ = write!(
        source,
        r#"var<workgroup> partial: array<{ty}, {WORKGROUP}>;
@compute @workgroup_size({WORKGROUP})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lane: u32) {{
  let o = wid.x + wid.y * {row}u;
  let live = o < {outputs}u;
{kept_split}
  var acc: {ty} = {identity};
  if (live) {{
    let base = {kept_offset};
    for (var r = lane; r < {reduced}u; r = r + {WORKGROUP}u) {{
{reduced_split}
      let v = {load};
      acc = {fold};
    }}
  }}
{tree}  if (live && lane == 0u) {{
    var result = partial[0];
{mean}    {store}
  }}
}}
"#,
        kept_split = split(&kept_shape, "o", "k"),
        reduced_split = split(&reduced_shape, "r", "r"),
        load = load("a0", *dtype, &format!("base + {reduced_offset}")),
        tree = workgroup_tree(&fold.replace("acc", "acc2")),
        store = store("out", site.out.0, "o", "result"),
    );
    Kernel {
        label: "reduce",
        source,
        workgroups: groups,
        bindings: vec![Bind::Operand(0), Bind::Output],
    }
}

/// Softmax or log-softmax along `axis`: one workgroup per row, a tree for
/// the row's maximum, another for the sum of exponentials.
fn softmax(site: &Site<'_>, axis: usize, log: bool) -> Kernel {
    let shape = &site.out.1;
    let length = shape[axis];
    let inner: usize = shape[axis + 1..].iter().product();
    let rows = count(shape) / length.max(1) as u64;
    let groups = grid(rows * u64::from(WORKGROUP), site.max_workgroups);
    let row_stride = u64::from(groups[0]);
    let result = if log {
        "v - m - log(s)"
    } else {
        "exp(v - m) / s"
    };
    let mut source = String::from(HELPERS);
    declare(&mut source, 0, "a0", DType::F32, false);
    declare(&mut source, 1, "out", DType::F32, true);
    let _ = write!(
        source,
        r#"var<workgroup> partial: array<f32, {WORKGROUP}>;
@compute @workgroup_size({WORKGROUP})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lane: u32) {{
  let row = wid.x + wid.y * {row_stride}u;
  let live = row < {rows}u;
  let base = (row / {inner}u) * {length}u * {inner}u + row % {inner}u;
  var m = bitcast<f32>(0xff800000u);
  if (live) {{
    for (var j = lane; j < {length}u; j = j + {WORKGROUP}u) {{ m = max(m, a0[base + j * {inner}u]); }}
  }}
  partial[lane] = m;
  workgroupBarrier();
  for (var w = {half}u; w > 0u; w = w / 2u) {{
    if (lane < w) {{ partial[lane] = max(partial[lane], partial[lane + w]); }}
    workgroupBarrier();
  }}
  m = partial[0];
  workgroupBarrier();
  var s = 0.0;
  if (live) {{
    for (var j = lane; j < {length}u; j = j + {WORKGROUP}u) {{ s = s + exp(a0[base + j * {inner}u] - m); }}
  }}
  partial[lane] = s;
  workgroupBarrier();
  for (var w = {half}u; w > 0u; w = w / 2u) {{
    if (lane < w) {{ partial[lane] = partial[lane] + partial[lane + w]; }}
    workgroupBarrier();
  }}
  s = partial[0];
  if (live) {{
    for (var j = lane; j < {length}u; j = j + {WORKGROUP}u) {{
      let v = a0[base + j * {inner}u];
      out[base + j * {inner}u] = {result};
    }}
  }}
}}
"#,
        half = WORKGROUP / 2,
    );
    Kernel {
        label: if log { "log_softmax" } else { "softmax" },
        source,
        workgroups: groups,
        bindings: vec![Bind::Operand(0), Bind::Output],
    }
}

// ---- indices -------------------------------------------------------------

/// Reads an index operand element as i32, flagging values outside
/// [0, limit) (an i64 must also fit in 32 bits).
fn index_value(dtype: DType, at: &str) -> String {
    match dtype {
        DType::I64 => format!(
            "select(-1i, bitcast<i32>(a1[2u * ({at})]), a1[2u * ({at}) + 1u] == select(0u, 0xffffffffu, bitcast<i32>(a1[2u * ({at})]) < 0))"
        ),
        _ => format!("a1[{at}]"),
    }
}

/// One invocation per output scans its lane: the first maximum, a NaN
/// beating any number (the CPU's rule). The kept or dropped axis does not
/// change the output's element order.
fn argmax(site: &Site<'_>, axis: usize) -> Kernel {
    let shape = &site.operands[0].1;
    let n = shape[axis];
    let inner: usize = shape[axis + 1..].iter().product();
    let body = format!(
        r#"  let base = (i / {inner}u) * {n}u * {inner}u + i % {inner}u;
  var best = 0u;
  var best_value = a0[base];
  for (var j = 1u; j < {n}u; j = j + 1u) {{
    let v = a0[base + j * {inner}u];
    if (!is_nan_bits(best_value) && (is_nan_bits(v) || v > best_value)) {{ best = j; best_value = v; }}
  }}
  let value = vec2<u32>(best, 0u);"#
    );
    per_output(site, "argmax", &body, false)
}

fn one_hot(site: &Site<'_>, depth: usize) -> Kernel {
    let (dtype, _) = site.operands[0];
    let index = match dtype {
        DType::I64 => "select(-1i, bitcast<i32>(a0[2u * row]), a0[2u * row + 1u] == select(0u, 0xffffffffu, bitcast<i32>(a0[2u * row]) < 0))".to_string(),
        _ => "a0[row]".to_string(),
    };
    let body = format!(
        "  let row = i / {depth}u;\n  let position = i32(i % {depth}u);\n  let value = select(0.0, 1.0, {index} == position);"
    );
    per_output(site, "one_hot", &body, false)
}

fn gather(site: &Site<'_>, axis: usize) -> Kernel {
    let (data_dtype, data_shape) = &site.operands[0];
    let (index_dtype, index_shape) = &site.operands[1];
    let index_rank = index_shape.len();
    let data_strides = strides(data_shape);
    let index_strides = strides(index_shape);
    let index_at = join_sum(
        &(0..index_rank)
            .map(|j| format!("c{} * {}u", axis + j, index_strides[j]))
            .collect::<Vec<_>>(),
    );
    let mut terms: Vec<String> = (0..axis)
        .map(|a| format!("c{a} * {}u", data_strides[a]))
        .collect();
    terms.push(format!("u32(idx) * {}u", data_strides[axis]));
    for (a, stride) in data_strides.iter().enumerate().skip(axis + 1) {
        terms.push(format!("c{} * {stride}u", a + index_rank - 1));
    }
    let body = format!(
        "  let idx = {};\n  var value = {};\n  if (idx < 0i || idx >= {}i) {{ flags[{FLAG_INDEX_OUT_OF_RANGE}u] = 1u; }} else {{ value = {}; }}",
        index_value(*index_dtype, &index_at),
        zero(*data_dtype),
        data_shape[axis],
        load("a0", *data_dtype, &join_sum(&terms))
    );
    per_output(site, "gather", &body, true)
}

/// scatter_add(indices, updates): each output element sums, in order, the
/// updates whose index names its position (no float atomics in WGSL, and
/// this order matches the CPU's sum).
fn scatter_add(site: &Site<'_>, axis: usize, dim_size: usize) -> Kernel {
    let (index_dtype, index_shape) = &site.operands[0];
    let (_, updates_shape) = &site.operands[1];
    let index_count = count(index_shape);
    let index_rank = index_shape.len();
    let update_strides = strides(updates_shape);
    let out_rank = site.out.1.len();
    let outer: Vec<String> = (0..axis)
        .map(|a| format!("c{a} * {}u", update_strides[a]))
        .collect();
    let inner: Vec<String> = (axis + 1..out_rank)
        .map(|a| format!("c{a} * {}u", update_strides[a + index_rank - 1]))
        .collect();
    let index_split = coordinates_named(index_shape, "j", "q");
    let at: Vec<String> = (0..index_rank)
        .map(|j| format!("q{j} * {}u", update_strides[axis + j]))
        .collect();
    let read_index = match index_dtype {
        DType::I64 => "select(-1i, bitcast<i32>(a0[2u * j]), a0[2u * j + 1u] == select(0u, 0xffffffffu, bitcast<i32>(a0[2u * j]) < 0))".to_string(),
        _ => "a0[j]".to_string(),
    };
    let body = format!(
        "  var value = 0.0;\n  for (var j = 0u; j < {index_count}u; j = j + 1u) {{\n    let idx = {read_index};\n    if (idx < 0i || idx >= {dim_size}i) {{ flags[{FLAG_INDEX_OUT_OF_RANGE}u] = 1u; continue; }}\n    if (u32(idx) != c{axis}) {{ continue; }}\n{index_split}    value = value + a1[{outer} + {at} + {inner}];\n  }}",
        outer = join_sum(&outer),
        at = join_sum(&at),
        inner = join_sum(&inner),
    );
    per_output(site, "scatter_add", &body, true)
}

/// The op's splitmix64 sequence with 64-bit arithmetic on u32 pairs.
fn random_uniform(site: &Site<'_>) -> Kernel {
    let seed = load("a0", site.operands[0].0, "0u");
    let body = format!(
        r#"  let seed = {seed};
  let golden = vec2<u32>(0x7F4A7C15u, 0x9E3779B9u);
  let z0 = add64(seed, i64_mul(vec2<u32>(i + 1u, 0u), golden));
  let value = f32(splitmix(z0).y >> 8u) / 16777216.0;"#
    );
    let mut kernel = per_output(site, "random_uniform", &body, false);
    kernel.source.push_str(
        r#"
fn add64(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> { return i64_add(a, b); }
fn xorshift(z: vec2<u32>, s: u32) -> vec2<u32> {
  if (s >= 32u) { return vec2<u32>(z.x ^ (z.y >> (s - 32u)), z.y); }
  return vec2<u32>(z.x ^ ((z.x >> s) | (z.y << (32u - s))), z.y ^ (z.y >> s));
}
fn splitmix(z0: vec2<u32>) -> vec2<u32> {
  var z = xorshift(z0, 30u);
  z = i64_mul(z, vec2<u32>(0x1CE4E5B9u, 0xBF58476Du));
  z = xorshift(z, 27u);
  z = i64_mul(z, vec2<u32>(0x133111EBu, 0x94D049BBu));
  return xorshift(z, 31u);
}
"#,
    );
    kernel
}

// ---- convolution and pooling ------------------------------------------------

/// conv2d: implicit GEMM when the tile pays off ([`gemm::pays_off`]),
/// else one invocation per output with its window loop.
fn conv2d(site: &Site<'_>, attrs: &Conv2dAttrs) -> Kernel {
    let w = &site.operands[1].1;
    if gemm::pays_off(w[0], w[1] * w[2] * w[3]) {
        return gemm::conv2d(site, attrs);
    }
    let x = &site.operands[0].1;
    let (c, h, wd) = (x[1], x[2], x[3]);
    let (kh, kw) = (w[2], w[3]);
    let [sh, sw] = attrs.stride;
    let [ph, pw] = attrs.padding;
    let [dh, dw] = attrs.dilation;
    let body = format!(
        r#"  var value = 0.0;
  for (var ci = 0u; ci < {c}u; ci = ci + 1u) {{
    for (var ki = 0u; ki < {kh}u; ki = ki + 1u) {{
      let ih = i32(c2 * {sh}u + ki * {dh}u) - {ph}i;
      if (ih < 0i || ih >= {h}i) {{ continue; }}
      for (var kj = 0u; kj < {kw}u; kj = kj + 1u) {{
        let iw = i32(c3 * {sw}u + kj * {dw}u) - {pw}i;
        if (iw < 0i || iw >= {wd}i) {{ continue; }}
        value = value + a0[((c0 * {c}u + ci) * {h}u + u32(ih)) * {wd}u + u32(iw)] * a1[((c1 * {c}u + ci) * {kh}u + ki) * {kw}u + kj];
      }}
    }}
  }}"#
    );
    per_output(site, "conv2d", &body, false)
}

/// dx[n, c, ih, iw] = Σ dy[n, o, oh, ow] · w[o, c, ki, kj] over the outputs
/// whose window reads (ih, iw): implicit GEMM when the tile pays off,
/// else one invocation per input element.
fn conv2d_backward_input(site: &Site<'_>, attrs: &Conv2dAttrs) -> Kernel {
    let w = &site.operands[1].1;
    if gemm::pays_off(w[1], w[0] * w[2] * w[3]) {
        return gemm::conv2d_backward_input(site, attrs);
    }
    let dy = &site.operands[0].1;
    let (o, oh, ow) = (dy[1], dy[2], dy[3]);
    let (c, kh, kw) = (w[1], w[2], w[3]);
    let [sh, sw] = attrs.stride;
    let [ph, pw] = attrs.padding;
    let [dh, dw] = attrs.dilation;
    let body = format!(
        r#"  var value = 0.0;
  for (var oi = 0u; oi < {o}u; oi = oi + 1u) {{
    for (var ki = 0u; ki < {kh}u; ki = ki + 1u) {{
      let th = i32(c2) + {ph}i - i32(ki * {dh}u);
      if (th < 0i || th % {sh}i != 0i) {{ continue; }}
      let y = th / {sh}i;
      if (y >= {oh}i) {{ continue; }}
      for (var kj = 0u; kj < {kw}u; kj = kj + 1u) {{
        let tw = i32(c3) + {pw}i - i32(kj * {dw}u);
        if (tw < 0i || tw % {sw}i != 0i) {{ continue; }}
        let x = tw / {sw}i;
        if (x >= {ow}i) {{ continue; }}
        value = value + a0[((c0 * {o}u + oi) * {oh}u + u32(y)) * {ow}u + u32(x)] * a1[((oi * {c}u + c1) * {kh}u + ki) * {kw}u + kj];
      }}
    }}
  }}"#
    );
    per_output(site, "conv2d_backward_input", &body, false)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum MaxPoolOutput {
    Max,
    Select,
}

/// WGSL for the argmax (first on ties, row-major) of window (oh, ow) of
/// plane `plane` of `a0`, as `best_at` (-1 when the window is all padding).
fn window_argmax(attrs: &Pool2dAttrs, in_hw: [usize; 2], oh: &str, ow: &str) -> String {
    let [kh, kw] = attrs.kernel;
    let [sh, sw] = attrs.stride;
    let [ph, pw] = attrs.padding;
    let [h, w] = in_hw;
    format!(
        r#"    var best = bitcast<f32>(0xff800000u);
    var best_at = -1i;
    for (var ki = 0u; ki < {kh}u; ki = ki + 1u) {{
      let ih = i32({oh} * {sh}u + ki) - {ph}i;
      if (ih < 0i || ih >= {h}i) {{ continue; }}
      for (var kj = 0u; kj < {kw}u; kj = kj + 1u) {{
        let iw = i32({ow} * {sw}u + kj) - {pw}i;
        if (iw < 0i || iw >= {w}i) {{ continue; }}
        let at = i32(plane * {hw}u) + ih * {w}i + iw;
        let v = a0[u32(at)];
        if (best_at < 0i || v > best) {{ best = v; best_at = at; }}
      }}
    }}
"#,
        hw = h * w,
    )
}

fn max_pool(site: &Site<'_>, attrs: &Pool2dAttrs, output: MaxPoolOutput) -> Kernel {
    let x = &site.operands[0].1;
    let out = &site.out.1;
    let search = window_argmax(attrs, [x[2], x[3]], "c2", "c3");
    let result = match output {
        MaxPoolOutput::Max => "best",
        MaxPoolOutput::Select => "select(0.0, a1[u32(max(best_at, 0i))], best_at >= 0i)",
    };
    let body = format!(
        "  let plane = c0 * {}u + c1;\n{search}  let value = {result};",
        out[1]
    );
    per_output(
        site,
        if output == MaxPoolOutput::Max {
            "max_pool2d"
        } else {
            "max_pool2d_select"
        },
        &body,
        false,
    )
}

/// The output positions whose windows contain input position (c2, c3),
/// as loops over `y` and `xo` (the body follows).
fn windows_containing(attrs: &Pool2dAttrs, out_hw: [usize; 2]) -> String {
    let [kh, kw] = attrs.kernel;
    let [sh, sw] = attrs.stride;
    let [ph, pw] = attrs.padding;
    let [oh, ow] = out_hw;
    format!(
        r#"  for (var y = 0u; y < {oh}u; y = y + 1u) {{
    let top = i32(y * {sh}u) - {ph}i;
    if (i32(c2) < top || i32(c2) >= top + {kh}i) {{ continue; }}
    for (var xo = 0u; xo < {ow}u; xo = xo + 1u) {{
      let left = i32(xo * {sw}u) - {pw}i;
      if (i32(c3) < left || i32(c3) >= left + {kw}i) {{ continue; }}
"#
    )
}

fn max_pool_backward(site: &Site<'_>, attrs: &Pool2dAttrs) -> Kernel {
    let x = &site.operands[0].1;
    let dy = &site.operands[1].1;
    let (oh, ow) = (dy[2], dy[3]);
    let plane_hw = x[2] * x[3];
    let body = format!(
        "  let plane = c0 * {channels}u + c1;\n  let here = i32(plane * {plane_hw}u + c2 * {w}u + c3);\n  var value = 0.0;\n{loops}{search}      if (best_at == here) {{ value = value + a1[(plane * {oh}u + y) * {ow}u + xo]; }}\n    }}\n  }}",
        channels = x[1],
        w = x[3],
        loops = windows_containing(attrs, [oh, ow]),
        search = window_argmax(attrs, [x[2], x[3]], "y", "xo"),
    );
    per_output(site, "max_pool2d_backward", &body, false)
}

fn avg_pool(site: &Site<'_>, attrs: &Pool2dAttrs) -> Kernel {
    let x = &site.operands[0].1;
    let [kh, kw] = attrs.kernel;
    let [sh, sw] = attrs.stride;
    let [ph, pw] = attrs.padding;
    let (h, w) = (x[2], x[3]);
    let body = format!(
        r#"  let plane = c0 * {channels}u + c1;
  var total = 0.0;
  for (var ki = 0u; ki < {kh}u; ki = ki + 1u) {{
    let ih = i32(c2 * {sh}u + ki) - {ph}i;
    if (ih < 0i || ih >= {h}i) {{ continue; }}
    for (var kj = 0u; kj < {kw}u; kj = kj + 1u) {{
      let iw = i32(c3 * {sw}u + kj) - {pw}i;
      if (iw < 0i || iw >= {w}i) {{ continue; }}
      total = total + a0[plane * {hw}u + u32(ih) * {w}u + u32(iw)];
    }}
  }}
  let value = total / {area}.0;"#,
        channels = x[1],
        hw = h * w,
        area = kh * kw,
    );
    per_output(site, "avg_pool2d", &body, false)
}

fn avg_pool_backward(site: &Site<'_>, attrs: &Pool2dAttrs) -> Kernel {
    let dy = &site.operands[0].1;
    let out = &site.out.1;
    let (oh, ow) = (dy[2], dy[3]);
    let body = format!(
        "  let plane = c0 * {channels}u + c1;\n  var total = 0.0;\n{loops}      total = total + a0[(plane * {oh}u + y) * {ow}u + xo];\n    }}\n  }}\n  let value = total / {area}.0;",
        channels = out[1],
        loops = windows_containing(attrs, [oh, ow]),
        area = attrs.kernel[0] * attrs.kernel[1],
    );
    per_output(site, "avg_pool2d_backward", &body, false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grids_spill_into_y_past_the_per_dimension_limit() {
        assert_eq!(grid(10, 65_535), [1, 1, 1]);
        assert_eq!(grid(256 * 70_000, 65_535), [65_535, 2, 1]);
    }

    #[test]
    fn i64_arithmetic_without_a_kernel_is_refused_by_name() {
        let on_i64 = |op| check(&Op::Binary(op), &[DType::I64, DType::I64], DType::I64);
        for op in [BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div] {
            assert_eq!(on_i64(op), Ok(()), "{op:?}");
        }
        assert_eq!(on_i64(BinaryOp::Pow), Err("pow on i64".to_string()));
    }
}
