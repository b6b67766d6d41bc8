//! One ONNX lowering per IR op (opset 17), each computing the op's IR
//! semantics; composed where ONNX has no single op for it.

use canopy_ir::{
    BinaryOp, Buffer, Conv2dAttrs, DType, Dim, Op, Pool2dAttrs, ReduceKind, TensorData, UnaryOp,
    ValueId,
};

use super::{Exporter, attr_int, attr_ints, onnx_data_type};
use crate::error::OnnxError;
use crate::proto::AttributeProto;

/// √(2/π), as the IR's tanh-GELU uses it.
const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_CUBIC: f32 = 0.044_715;

/// Lowers node `id`, whose value is named `ex.name(id)`.
pub(crate) fn lower<'g>(ex: &mut Exporter<'g>, id: ValueId) -> Result<(), OnnxError> {
    let node = ex.graph().node(id);
    let out = ex.name(id);
    let ins: Vec<String> = node.inputs.iter().map(|&i| ex.name(i)).collect();
    let first = ins.first().cloned().unwrap_or_default();
    match &node.op {
        Op::Input { .. } | Op::Constant(_) => {}
        Op::Unary(op) => unary(ex, *op, first, &out),
        Op::Binary(op) => binary(ex, *op, ins, &out),
        Op::Where => ex.emit("Where", ins, &out, Vec::new()),
        Op::Cast { to } => {
            let to = attr_int("to", i64::from(onnx_data_type(*to)));
            ex.emit("Cast", ins, &out, vec![to]);
        }
        Op::MatMul {
            transpose_a,
            transpose_b,
        } => matmul(ex, id, ins, [*transpose_a, *transpose_b], &out),
        Op::Reduce {
            kind,
            axes,
            keep_dims,
        } => reduce(ex, *kind, axes, *keep_dims, first, &out),
        Op::Reshape { shape } => reshape(ex, id, shape, first, &out)?,
        Op::Transpose { perm } => {
            let perm = attr_ints("perm", &as_i64(perm));
            ex.emit("Transpose", ins, &out, vec![perm]);
        }
        Op::Broadcast { shape } => broadcast(ex, id, shape, first, &out)?,
        Op::Slice { axis, start, end } => {
            let starts = ex.constant_i64(&out, "starts", &[*start as i64]);
            let ends = ex.constant_i64(&out, "ends", &[*end as i64]);
            let axes = ex.constant_i64(&out, "axes", &[*axis as i64]);
            ex.emit("Slice", vec![first, starts, ends, axes], &out, Vec::new());
        }
        Op::Pad {
            axis,
            before,
            after,
        } => {
            let rank = ex.ty(id).rank();
            let mut pads = vec![0i64; 2 * rank];
            pads[*axis] = *before as i64;
            pads[rank + axis] = *after as i64;
            let pads = ex.constant_i64(&out, "pads", &pads);
            ex.emit("Pad", vec![first, pads], &out, Vec::new());
        }
        Op::Concat { axis } => ex.emit("Concat", ins, &out, vec![attr_int("axis", *axis as i64)]),
        Op::Conv2d(attrs) => ex.emit("Conv", ins, &out, conv_attrs(attrs)),
        Op::MaxPool2d(attrs) => ex.emit("MaxPool", ins, &out, pool_attrs(attrs)),
        Op::AvgPool2d(attrs) => {
            let mut attrs = pool_attrs(attrs);
            // Padding counts as zeros in the IR's average.
            attrs.push(attr_int("count_include_pad", 1));
            ex.emit("AveragePool", ins, &out, attrs);
        }
        Op::ArgMax { axis, keep_dims } => {
            let attrs = vec![
                attr_int("axis", *axis as i64),
                attr_int("keepdims", i64::from(*keep_dims)),
                attr_int("select_last_index", 0),
            ];
            ex.emit("ArgMax", ins, &out, attrs);
        }
        Op::Softmax { axis } => ex.emit("Softmax", ins, &out, vec![attr_int("axis", *axis as i64)]),
        Op::LogSoftmax { axis } => {
            ex.emit(
                "LogSoftmax",
                ins,
                &out,
                vec![attr_int("axis", *axis as i64)],
            );
        }
        Op::Gather { axis } => ex.emit("Gather", ins, &out, vec![attr_int("axis", *axis as i64)]),
        Op::OneHot { depth } => one_hot(ex, id, *depth, first, &out),
        op @ Op::RandomUniform { .. } => {
            return Err(refuse(
                id,
                op,
                "ONNX's RandomUniform draws from another generator, so the values would differ",
                "export an inference graph (`infer`, `eval`), which draws no random numbers",
            ));
        }
        op @ (Op::ScatterAdd { .. }
        | Op::Conv2dBackwardInput { .. }
        | Op::Conv2dBackwardFilter { .. }
        | Op::MaxPool2dSelect(_)
        | Op::MaxPool2dBackward(_)
        | Op::AvgPool2dBackward { .. }) => {
            return Err(refuse(
                id,
                op,
                "it is a training-graph adjoint the exporter does not lower",
                "export an inference graph (`infer`, `eval`); training graphs run on canopy's backends",
            ));
        }
        Op::Scan(scan) => super::control::scan(ex, id, scan)?,
        Op::Cond(cond) => super::control::cond(ex, id, cond)?,
        Op::WhileLoop(w) => super::control::while_loop(ex, id, w)?,
        Op::Output { index } => {
            // The ONNX node names each result after its first reader, so
            // only a second reader of one result needs an Identity.
            let source = ex.result_name(node.inputs[0], *index);
            if source != out {
                ex.emit("Identity", vec![source], &out, Vec::new());
            }
        }
        op @ Op::CustomGrad(_) => {
            return Err(refuse(
                id,
                op,
                "a custom gradient is left after inlining",
                "verify the graph (`canopy model inspect`)",
            ));
        }
    }
    Ok(())
}

fn refuse(id: ValueId, op: &Op, cause: &str, hint: &str) -> OnnxError {
    OnnxError::ExportUnsupported {
        node: id.to_string(),
        op: op.name(),
        cause: cause.to_string(),
        hint: hint.to_string(),
    }
}

fn as_i64(values: &[usize]) -> Vec<i64> {
    values.iter().map(|&v| v as i64).collect()
}

fn unary(ex: &mut Exporter<'_>, op: UnaryOp, x: String, out: &str) {
    let single = match op {
        UnaryOp::Neg => "Neg",
        UnaryOp::Abs => "Abs",
        UnaryOp::Sign => "Sign",
        UnaryOp::Exp => "Exp",
        UnaryOp::Log => "Log",
        UnaryOp::Sqrt => "Sqrt",
        UnaryOp::Reciprocal => "Reciprocal",
        UnaryOp::Relu => "Relu",
        UnaryOp::Sigmoid => "Sigmoid",
        UnaryOp::Tanh => "Tanh",
        UnaryOp::Not => "Not",
        UnaryOp::Erf => "Erf",
        UnaryOp::Rsqrt => {
            let root = ex.emit_temp(out, "Sqrt", vec![x], Vec::new());
            return ex.emit("Reciprocal", vec![root], out, Vec::new());
        }
        UnaryOp::Square => return ex.emit("Mul", vec![x.clone(), x], out, Vec::new()),
        UnaryOp::Gelu => return gelu_tanh(ex, x, out),
        UnaryOp::GeluErf => return gelu_erf(ex, x, out),
        UnaryOp::Softplus => return softplus(ex, x, out),
        UnaryOp::Log1p => return log1p(ex, x, out),
    };
    ex.emit(single, vec![x], out, Vec::new());
}

/// 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x·x·x))), in the IR kernel's
/// order of operations.
fn gelu_tanh(ex: &mut Exporter<'_>, x: String, out: &str) {
    let cubic = ex.constant_f32(out, "cubic", GELU_CUBIC);
    let scale = ex.constant_f32(out, "sqrt_2_over_pi", SQRT_2_OVER_PI);
    let half = ex.constant_f32(out, "half", 0.5);
    let one = ex.constant_f32(out, "one", 1.0);
    let term = ex.emit_temp(out, "Mul", vec![cubic, x.clone()], Vec::new());
    let term = ex.emit_temp(out, "Mul", vec![term, x.clone()], Vec::new());
    let term = ex.emit_temp(out, "Mul", vec![term, x.clone()], Vec::new());
    let inner = ex.emit_temp(out, "Add", vec![x.clone(), term], Vec::new());
    let inner = ex.emit_temp(out, "Mul", vec![scale, inner], Vec::new());
    let tanh = ex.emit_temp(out, "Tanh", vec![inner], Vec::new());
    let factor = ex.emit_temp(out, "Add", vec![one, tanh], Vec::new());
    let half_x = ex.emit_temp(out, "Mul", vec![half, x], Vec::new());
    ex.emit("Mul", vec![half_x, factor], out, Vec::new());
}

/// ½·x·(1 + erf(x/√2)).
fn gelu_erf(ex: &mut Exporter<'_>, x: String, out: &str) {
    let inv_sqrt2 = ex.constant_f32(out, "inv_sqrt2", std::f32::consts::FRAC_1_SQRT_2);
    let half = ex.constant_f32(out, "half", 0.5);
    let one = ex.constant_f32(out, "one", 1.0);
    let scaled = ex.emit_temp(out, "Mul", vec![x.clone(), inv_sqrt2], Vec::new());
    let erf = ex.emit_temp(out, "Erf", vec![scaled], Vec::new());
    let factor = ex.emit_temp(out, "Add", vec![one, erf], Vec::new());
    let half_x = ex.emit_temp(out, "Mul", vec![half, x], Vec::new());
    ex.emit("Mul", vec![half_x, factor], out, Vec::new());
}

/// max(x, 0) + log1p(e^(−|x|)), the IR's stable form; ONNX's Softplus
/// leaves the formula to the runtime.
fn softplus(ex: &mut Exporter<'_>, x: String, out: &str) {
    let zero = ex.constant_f32(out, "zero", 0.0);
    let positive = ex.emit_temp(out, "Max", vec![x.clone(), zero], Vec::new());
    let magnitude = ex.emit_temp(out, "Abs", vec![x], Vec::new());
    let negated = ex.emit_temp(out, "Neg", vec![magnitude], Vec::new());
    let decay = ex.emit_temp(out, "Exp", vec![negated], Vec::new());
    let tail = ex.fresh(&format!("{out}/log1p"));
    log1p(ex, decay, &tail);
    ex.emit("Add", vec![positive, tail], out, Vec::new());
}

/// log(1 + x) accurate near 0 with no Log1p op: with u = 1 + x rounded,
/// log(u)·x/(u − 1) cancels the rounding of u (Goldberg, "What every
/// computer scientist should know about floating-point arithmetic",
/// theorem 4); x itself where u = 1, and u where u = ∞.
fn log1p(ex: &mut Exporter<'_>, x: String, out: &str) {
    let one = ex.constant_f32(out, "one", 1.0);
    let zero = ex.constant_f32(out, "zero", 0.0);
    let infinity = ex.constant_f32(out, "infinity", f32::INFINITY);
    let u = ex.emit_temp(out, "Add", vec![one.clone(), x.clone()], Vec::new());
    let rounding = ex.emit_temp(out, "Sub", vec![u.clone(), one], Vec::new());
    let log = ex.emit_temp(out, "Log", vec![u.clone()], Vec::new());
    let ratio = ex.emit_temp(out, "Div", vec![x.clone(), rounding.clone()], Vec::new());
    let corrected = ex.emit_temp(out, "Mul", vec![log, ratio], Vec::new());
    let infinite = ex.emit_temp(out, "Equal", vec![u.clone(), infinity], Vec::new());
    let finite = ex.emit_temp(out, "Where", vec![infinite, u, corrected], Vec::new());
    let exact = ex.emit_temp(out, "Equal", vec![rounding, zero], Vec::new());
    ex.emit("Where", vec![exact, x, finite], out, Vec::new());
}

fn binary(ex: &mut Exporter<'_>, op: BinaryOp, ins: Vec<String>, out: &str) {
    let op_type = match op {
        BinaryOp::Add => "Add",
        BinaryOp::Sub => "Sub",
        BinaryOp::Mul => "Mul",
        BinaryOp::Div => "Div",
        BinaryOp::Pow => "Pow",
        BinaryOp::Maximum => "Max",
        BinaryOp::Minimum => "Min",
        BinaryOp::Eq => "Equal",
        BinaryOp::Lt => "Less",
        BinaryOp::Le => "LessOrEqual",
        BinaryOp::Gt => "Greater",
        BinaryOp::Ge => "GreaterOrEqual",
        BinaryOp::And => "And",
        BinaryOp::Or => "Or",
        BinaryOp::Ne => {
            let equal = ex.emit_temp(out, "Equal", ins, Vec::new());
            return ex.emit("Not", vec![equal], out, Vec::new());
        }
    };
    ex.emit(op_type, ins, out, Vec::new());
}

/// Gemm for two matrices (its transpose flags are the IR's); otherwise a
/// Transpose of the last two axes of each flagged operand, then MatMul.
fn matmul(ex: &mut Exporter<'_>, id: ValueId, ins: Vec<String>, transposes: [bool; 2], out: &str) {
    let operands = &ex.graph().node(id).inputs;
    let ranks: Vec<usize> = operands.iter().map(|&v| ex.ty(v).rank()).collect();
    if ranks == [2, 2] {
        let attrs = [("transA", transposes[0]), ("transB", transposes[1])]
            .into_iter()
            .filter(|(_, flag)| *flag)
            .map(|(name, _)| attr_int(name, 1))
            .collect();
        return ex.emit("Gemm", ins, out, attrs);
    }
    let mut operands = Vec::with_capacity(2);
    for ((name, rank), transpose) in ins.into_iter().zip(ranks).zip(transposes) {
        if !transpose {
            operands.push(name);
            continue;
        }
        let mut perm: Vec<i64> = (0..rank as i64).collect();
        perm.swap(rank - 2, rank - 1);
        let attrs = vec![attr_ints("perm", &perm)];
        operands.push(ex.emit_temp(out, "Transpose", vec![name], attrs));
    }
    ex.emit("MatMul", operands, out, Vec::new());
}

/// ReduceSum takes its axes as an input (opset 13); ReduceMean and
/// ReduceMax as an attribute until opset 18. No axes is the identity in
/// the IR but "every axis" in ONNX.
fn reduce(
    ex: &mut Exporter<'_>,
    kind: ReduceKind,
    axes: &[usize],
    keep_dims: bool,
    x: String,
    out: &str,
) {
    if axes.is_empty() {
        return ex.emit("Identity", vec![x], out, Vec::new());
    }
    let keepdims = attr_int("keepdims", i64::from(keep_dims));
    let axes = as_i64(axes);
    match kind {
        ReduceKind::Sum => {
            let axes = ex.constant_i64(out, "axes", &axes);
            ex.emit("ReduceSum", vec![x, axes], out, vec![keepdims]);
        }
        ReduceKind::Mean | ReduceKind::Max => {
            let op_type = if kind == ReduceKind::Mean {
                "ReduceMean"
            } else {
                "ReduceMax"
            };
            ex.emit(
                op_type,
                vec![x],
                out,
                vec![attr_ints("axes", &axes), keepdims],
            );
        }
    }
}

/// A constant shape: one batch dimension is -1, and a 0 needs
/// `allowzero`, since ONNX otherwise reads it as "copy the input's size".
/// Two batch dimensions would need run-time shape arithmetic.
fn reshape(
    ex: &mut Exporter<'_>,
    id: ValueId,
    shape: &[Dim],
    x: String,
    out: &str,
) -> Result<(), OnnxError> {
    let batches = shape.iter().filter(|&&d| d == Dim::Batch).count();
    let has_zero = shape.contains(&Dim::Fixed(0));
    if batches > 1 || (batches == 1 && has_zero) {
        let op = &ex.graph().node(id).op;
        return Err(refuse(
            id,
            op,
            &format!(
                "its target shape {shape:?} has the batch dimension twice, or with an empty dimension"
            ),
            "reshape to a single batch dimension with no empty one",
        ));
    }
    let sizes: Vec<i64> = shape
        .iter()
        .map(|d| d.fixed().map_or(-1, |n| n as i64))
        .collect();
    let target = ex.constant_i64(out, "shape", &sizes);
    let attrs = if has_zero {
        vec![attr_int("allowzero", 1)]
    } else {
        Vec::new()
    };
    ex.emit("Reshape", vec![x, target], out, attrs);
    Ok(())
}

/// Expand to the fixed sizes (it broadcasts both ways, so a batch
/// dimension is written as 1 and one the operand has is kept); a batch
/// dimension the operand lacks comes from `Where(batch mask, v, v)`.
fn broadcast(
    ex: &mut Exporter<'_>,
    id: ValueId,
    shape: &[Dim],
    x: String,
    out: &str,
) -> Result<(), OnnxError> {
    let operand = &ex.ty(ex.graph().node(id).inputs[0]).shape.0;
    let offset = shape.len() - operand.len();
    let sizes: Vec<i64> = shape
        .iter()
        .map(|d| d.fixed().map_or(1, |n| n as i64))
        .collect();
    let added: Vec<usize> = (0..shape.len())
        .filter(|&axis| shape[axis] == Dim::Batch)
        .filter(|&axis| axis < offset || operand[axis - offset] != Dim::Batch)
        .collect();
    let target = ex.constant_i64(out, "shape", &sizes);
    let [axis] = added[..] else {
        if added.is_empty() {
            ex.emit("Expand", vec![x, target], out, Vec::new());
            return Ok(());
        }
        let op = &ex.graph().node(id).op;
        return Err(refuse(
            id,
            op,
            &format!("it adds the batch dimension more than once ({shape:?})"),
            "broadcast to a shape with one batch dimension",
        ));
    };
    let expanded = ex.emit_temp(out, "Expand", vec![x, target], Vec::new());
    let mask = ex.batch_mask(id)?;
    let mut mask_shape = vec![1i64; shape.len()];
    mask_shape[axis] = -1;
    let mask_shape = ex.constant_i64(out, "mask_shape", &mask_shape);
    let mask = ex.emit_temp(out, "Reshape", vec![mask, mask_shape], Vec::new());
    ex.emit(
        "Where",
        vec![mask, expanded.clone(), expanded],
        out,
        Vec::new(),
    );
    Ok(())
}

/// indices[..., None] == [0, 1, …, depth − 1], as f32: an index outside
/// [0, depth) matches no class, so its row is zeros (ONNX's OneHot would
/// wrap a negative index).
fn one_hot(ex: &mut Exporter<'_>, id: ValueId, depth: usize, indices: String, out: &str) {
    let index_dtype = ex.ty(ex.graph().node(id).inputs[0]).dtype;
    let classes = match index_dtype {
        DType::I32 => Buffer::I32((0..depth as i32).collect()),
        _ => Buffer::I64((0..depth as i64).collect()),
    };
    let classes = TensorData::new(vec![depth], classes).expect("a vector of `depth` elements");
    let classes = ex.constant(out, "classes", &classes);
    let last = ex.constant_i64(out, "axes", &[-1]);
    let column = ex.emit_temp(out, "Unsqueeze", vec![indices, last], Vec::new());
    let hit = ex.emit_temp(out, "Equal", vec![column, classes], Vec::new());
    let to = attr_int("to", i64::from(onnx_data_type(DType::F32)));
    ex.emit("Cast", vec![hit], out, vec![to]);
}

fn pair(values: [usize; 2]) -> Vec<i64> {
    as_i64(&values)
}

/// Symmetric padding as ONNX's [top, left, bottom, right].
fn pads(padding: [usize; 2]) -> Vec<i64> {
    let [h, w] = padding.map(|p| p as i64);
    vec![h, w, h, w]
}

fn conv_attrs(attrs: &Conv2dAttrs) -> Vec<AttributeProto> {
    vec![
        attr_ints("strides", &pair(attrs.stride)),
        attr_ints("pads", &pads(attrs.padding)),
        attr_ints("dilations", &pair(attrs.dilation)),
    ]
}

fn pool_attrs(attrs: &Pool2dAttrs) -> Vec<AttributeProto> {
    vec![
        attr_ints("kernel_shape", &pair(attrs.kernel)),
        attr_ints("strides", &pair(attrs.stride)),
        attr_ints("pads", &pads(attrs.padding)),
    ]
}
