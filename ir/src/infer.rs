//! Shape and dtype inference: one rule per op.
//!
//! Errors are plain causes; the caller wraps them with the node and op.

use crate::graph::MAX_RANK;
use crate::op::{BinaryOp, Conv2dAttrs, Op, Pool2dAttrs, ReduceKind, UnaryOp, window_output_size};
use crate::types::{DType, Dim, Shape, TensorType};

type Cause = String;

/// Infers the output type of `op` applied to inputs of `types`.
pub fn infer_type(op: &Op, types: &[&TensorType]) -> Result<TensorType, Cause> {
    if let Some(arity) = op.arity()
        && types.len() != arity
    {
        return Err(format!("expects {arity} inputs, got {}", types.len()));
    }
    let ty = infer_unchecked(op, types)?;
    if ty.rank() > MAX_RANK {
        return Err(format!(
            "result rank {} exceeds the limit of {MAX_RANK}",
            ty.rank()
        ));
    }
    Ok(ty)
}

fn infer_unchecked(op: &Op, t: &[&TensorType]) -> Result<TensorType, Cause> {
    match op {
        Op::Input { .. } => Err("input nodes are declared with Graph::input".into()),
        Op::Constant(data) => Ok(data.tensor_type()),
        Op::Unary(u) => unary(*u, t[0]),
        Op::Binary(b) => binary(*b, t[0], t[1]),
        Op::Where => {
            expect_dtype(t[0], DType::Bool, "condition")?;
            if t[1].dtype != t[2].dtype {
                return Err(format!("branches differ in dtype: {} vs {}", t[1], t[2]));
            }
            let shape = broadcast_shapes(&t[0].shape, &t[1].shape)?;
            let shape = broadcast_shapes(&shape, &t[2].shape)?;
            Ok(TensorType::new(t[1].dtype, shape))
        }
        Op::Cast { to } => Ok(TensorType::new(*to, t[0].shape.clone())),
        Op::MatMul {
            transpose_a,
            transpose_b,
        } => matmul(t[0], t[1], *transpose_a, *transpose_b),
        Op::Reduce {
            kind,
            axes,
            keep_dims,
        } => reduce(*kind, t[0], axes, *keep_dims),
        Op::Reshape { shape } => reshape(t[0], shape),
        Op::Transpose { perm } => transpose(t[0], perm),
        Op::Broadcast { shape } => {
            let target = Shape(shape.clone());
            let joined = broadcast_shapes(&t[0].shape, &target)?;
            if joined != target {
                return Err(format!("cannot broadcast {} to {target}", t[0].shape));
            }
            Ok(TensorType::new(t[0].dtype, target))
        }
        Op::Slice { axis, start, end } => slice(t[0], *axis, *start, *end),
        Op::Pad {
            axis,
            before,
            after,
        } => {
            let mut dims = t[0].shape.0.clone();
            let len = fixed_axis(&t[0].shape, *axis)?;
            dims[*axis] = Dim::Fixed(len + before + after);
            Ok(TensorType::new(t[0].dtype, Shape(dims)))
        }
        Op::Concat { axis } => concat(t, *axis),
        Op::Conv2d(attrs) => conv2d(t[0], t[1], attrs),
        Op::Conv2dBackwardInput { attrs, input_hw } => {
            conv2d_backward_input(t[0], t[1], attrs, *input_hw)
        }
        Op::Conv2dBackwardFilter { attrs, kernel_hw } => {
            conv2d_backward_filter(t[0], t[1], attrs, *kernel_hw)
        }
        Op::MaxPool2d(attrs) | Op::AvgPool2d(attrs) => pool2d(t[0], attrs),
        Op::MaxPool2dSelect(attrs) => {
            let out = pool2d(t[0], attrs)?;
            if t[1] != t[0] {
                return Err(format!("values {} must match the input {}", t[1], t[0]));
            }
            Ok(out)
        }
        Op::MaxPool2dBackward(attrs) => {
            let pooled = pool2d(t[0], attrs)?;
            if *t[1] != pooled {
                return Err(format!(
                    "gradient {} must have the pooled type {pooled}",
                    t[1]
                ));
            }
            Ok(t[0].clone())
        }
        Op::AvgPool2dBackward { attrs, input_hw } => {
            image(t[0], "gradient")?;
            let dims = &t[0].shape.0;
            let input = TensorType::new(
                DType::F32,
                Shape(vec![
                    dims[0],
                    dims[1],
                    Dim::Fixed(input_hw[0]),
                    Dim::Fixed(input_hw[1]),
                ]),
            );
            let pooled = pool2d(&input, attrs)?;
            if pooled != *t[0] {
                return Err(format!(
                    "gradient {} does not match pooling an input of spatial size {input_hw:?}",
                    t[0]
                ));
            }
            Ok(input)
        }
        Op::ArgMax { axis, keep_dims } => {
            expect_dtype(t[0], DType::F32, "input")?;
            check_axis(t[0], *axis)?;
            if t[0].shape.0[*axis] == Dim::Fixed(0) {
                return Err(format!("argmax over the empty axis {axis} of {}", t[0]));
            }
            let reduced = reduce(ReduceKind::Max, t[0], &[*axis], *keep_dims)?;
            Ok(TensorType::new(DType::I64, reduced.shape))
        }
        Op::Softmax { axis } | Op::LogSoftmax { axis } => {
            expect_dtype(t[0], DType::F32, "input")?;
            check_axis(t[0], *axis)?;
            Ok(t[0].clone())
        }
        Op::Gather { axis } => gather(t[0], t[1], *axis),
        Op::ScatterAdd { axis, dim_size } => scatter_add(t[0], t[1], *axis, *dim_size),
        Op::OneHot { depth } => {
            expect_index(t[0], "indices")?;
            let mut dims = t[0].shape.0.clone();
            dims.push(Dim::Fixed(*depth));
            Ok(TensorType::new(DType::F32, Shape(dims)))
        }
        Op::RandomUniform { shape } => {
            if t[0].dtype != DType::I64 || t[0].rank() != 0 {
                return Err(format!("seed must be an i64 scalar, got {}", t[0]));
            }
            Ok(TensorType::new(DType::F32, Shape(shape.clone())))
        }
        Op::Scan(_) | Op::Cond(_) | Op::WhileLoop(_) => {
            let results = op.results(t).expect("a control-flow op has results")?;
            Ok(results.into_iter().next().expect("results are never empty"))
        }
        Op::Output { .. } => Err("an output's type is its producer's; see Graph::push".into()),
        Op::CustomGrad(custom) => {
            let inputs = custom.forward.inputs();
            for (i, (&declared, given)) in inputs.iter().zip(t).enumerate() {
                let declared = custom.forward.ty(declared);
                if declared != *given {
                    return Err(format!(
                        "`{}` input {i} expects {declared}, got {given}",
                        custom.name
                    ));
                }
            }
            match custom.forward.outputs() {
                [(_, out)] => Ok(custom.forward.ty(*out).clone()),
                outs => Err(format!(
                    "`{}` forward graph must have exactly one output, has {}",
                    custom.name,
                    outs.len()
                )),
            }
        }
    }
}

fn expect_dtype(t: &TensorType, dtype: DType, role: &str) -> Result<(), Cause> {
    if t.dtype != dtype {
        return Err(format!("{role} must be {dtype}, got {t}"));
    }
    Ok(())
}

fn expect_index(t: &TensorType, role: &str) -> Result<(), Cause> {
    if !matches!(t.dtype, DType::I64 | DType::I32) {
        return Err(format!("{role} must be i64 or i32, got {t}"));
    }
    Ok(())
}

fn check_axis(t: &TensorType, axis: usize) -> Result<(), Cause> {
    if axis >= t.rank() {
        return Err(format!("axis {axis} is out of range for {t}"));
    }
    Ok(())
}

fn fixed_axis(shape: &Shape, axis: usize) -> Result<usize, Cause> {
    match shape.0.get(axis) {
        None => Err(format!("axis {axis} is out of range for {shape}")),
        Some(Dim::Batch) => Err(format!("axis {axis} of {shape} is the batch dimension")),
        Some(Dim::Fixed(n)) => Ok(*n),
    }
}

fn unary(op: UnaryOp, t: &TensorType) -> Result<TensorType, Cause> {
    let want = if op == UnaryOp::Not {
        DType::Bool
    } else {
        DType::F32
    };
    expect_dtype(t, want, "operand")?;
    Ok(t.clone())
}

fn binary(op: BinaryOp, a: &TensorType, b: &TensorType) -> Result<TensorType, Cause> {
    if a.dtype != b.dtype {
        return Err(format!("operands differ in dtype: {a} vs {b}"));
    }
    let shape = broadcast_shapes(&a.shape, &b.shape)?;
    let dtype = if op.is_logical() {
        expect_dtype(a, DType::Bool, "operand")?;
        DType::Bool
    } else if op.is_comparison() {
        DType::Bool
    } else {
        if a.dtype == DType::Bool {
            return Err(format!("arithmetic on bool operands {a}"));
        }
        if op == BinaryOp::Pow && a.dtype != DType::F32 {
            return Err(format!("pow needs f32 operands, got {a}"));
        }
        a.dtype
    };
    Ok(TensorType::new(dtype, shape))
}

/// NumPy broadcasting of two static shapes.
pub fn broadcast_shapes(a: &Shape, b: &Shape) -> Result<Shape, Cause> {
    let rank = a.rank().max(b.rank());
    let mut dims = Vec::with_capacity(rank);
    for i in 0..rank {
        let da = dim_from_right(a, rank - 1 - i);
        let db = dim_from_right(b, rank - 1 - i);
        let d = match (da, db) {
            (x, y) if x == y => x,
            (Dim::Fixed(1), y) => y,
            (x, Dim::Fixed(1)) => x,
            _ => return Err(format!("shapes {a} and {b} do not broadcast")),
        };
        dims.push(d);
    }
    Ok(Shape(dims))
}

fn dim_from_right(s: &Shape, from_right: usize) -> Dim {
    let rank = s.rank();
    let total = from_right + 1;
    if total > rank {
        Dim::Fixed(1)
    } else {
        s.0[rank - total]
    }
}

fn matmul(a: &TensorType, b: &TensorType, ta: bool, tb: bool) -> Result<TensorType, Cause> {
    expect_dtype(a, DType::F32, "left operand")?;
    expect_dtype(b, DType::F32, "right operand")?;
    if a.rank() < 2 || b.rank() < 2 {
        return Err(format!("operands must have rank >= 2, got {a} and {b}"));
    }
    let (ra, rb) = (a.rank(), b.rank());
    let (m, ka) = swap_if(ta, a.shape.0[ra - 2], a.shape.0[ra - 1]);
    let (kb, n) = swap_if(tb, b.shape.0[rb - 2], b.shape.0[rb - 1]);
    if ka != kb {
        return Err(format!(
            "inner dimensions differ: {a}{} × {b}{}",
            if ta { "ᵀ" } else { "" },
            if tb { "ᵀ" } else { "" }
        ));
    }
    let batch_a = Shape(a.shape.0[..ra - 2].to_vec());
    let batch_b = Shape(b.shape.0[..rb - 2].to_vec());
    let mut dims = broadcast_shapes(&batch_a, &batch_b)?.0;
    dims.push(m);
    dims.push(n);
    Ok(TensorType::new(DType::F32, Shape(dims)))
}

fn swap_if(swap: bool, x: Dim, y: Dim) -> (Dim, Dim) {
    if swap { (y, x) } else { (x, y) }
}

fn reduce(
    kind: ReduceKind,
    t: &TensorType,
    axes: &[usize],
    keep: bool,
) -> Result<TensorType, Cause> {
    if t.dtype != DType::F32 && kind != ReduceKind::Max && kind != ReduceKind::Sum {
        return Err(format!("{kind:?} needs an f32 operand, got {t}"));
    }
    if t.dtype == DType::Bool {
        return Err(format!("cannot reduce a bool tensor {t}"));
    }
    if axes.windows(2).any(|w| w[0] >= w[1]) {
        return Err(format!("axes {axes:?} must be sorted and distinct"));
    }
    if let Some(&axis) = axes.iter().find(|&&a| a >= t.rank()) {
        return Err(format!("axis {axis} is out of range for {t}"));
    }
    let mut dims = Vec::with_capacity(t.rank());
    for (i, &d) in t.shape.0.iter().enumerate() {
        if !axes.contains(&i) {
            dims.push(d);
        } else if keep {
            dims.push(Dim::Fixed(1));
        }
    }
    Ok(TensorType::new(t.dtype, Shape(dims)))
}

fn reshape(t: &TensorType, target: &[Dim]) -> Result<TensorType, Cause> {
    let batch_in = t.shape.0.iter().filter(|&&d| d == Dim::Batch).count();
    let batch_out = target.iter().filter(|&&d| d == Dim::Batch).count();
    let fixed = |dims: &[Dim]| -> Option<usize> {
        dims.iter()
            .filter_map(|d| d.fixed())
            .try_fold(1usize, |acc, d| acc.checked_mul(d))
    };
    let (Some(fin), Some(fout)) = (fixed(&t.shape.0), fixed(target)) else {
        return Err("element count overflows".into());
    };
    if batch_in != batch_out || fin != fout {
        return Err(format!(
            "cannot reshape {} to {} (element counts differ)",
            t.shape,
            Shape(target.to_vec())
        ));
    }
    Ok(TensorType::new(t.dtype, Shape(target.to_vec())))
}

fn transpose(t: &TensorType, perm: &[usize]) -> Result<TensorType, Cause> {
    let mut seen = vec![false; t.rank()];
    if perm.len() != t.rank() {
        return Err(format!(
            "permutation {perm:?} does not fit rank {}",
            t.rank()
        ));
    }
    for &p in perm {
        if p >= t.rank() || std::mem::replace(&mut seen[p], true) {
            return Err(format!("{perm:?} is not a permutation of 0..{}", t.rank()));
        }
    }
    let dims = perm.iter().map(|&p| t.shape.0[p]).collect();
    Ok(TensorType::new(t.dtype, Shape(dims)))
}

fn slice(t: &TensorType, axis: usize, start: usize, end: usize) -> Result<TensorType, Cause> {
    let len = fixed_axis(&t.shape, axis)?;
    if start > end || end > len {
        return Err(format!(
            "range {start}..{end} is out of bounds for axis {axis} of length {len}"
        ));
    }
    let mut dims = t.shape.0.clone();
    dims[axis] = Dim::Fixed(end - start);
    Ok(TensorType::new(t.dtype, Shape(dims)))
}

fn concat(t: &[&TensorType], axis: usize) -> Result<TensorType, Cause> {
    let Some(first) = t.first() else {
        return Err("needs at least one input".into());
    };
    let mut total = 0usize;
    for (i, x) in t.iter().enumerate() {
        if x.dtype != first.dtype || x.rank() != first.rank() {
            return Err(format!("input {i} {x} does not match input 0 {first}"));
        }
        for (d, (a, b)) in x.shape.0.iter().zip(&first.shape.0).enumerate() {
            if d != axis && a != b {
                return Err(format!(
                    "input {i} {x} differs from input 0 {first} off the concat axis"
                ));
            }
        }
        total += fixed_axis(&x.shape, axis)?;
    }
    let mut dims = first.shape.0.clone();
    dims[axis] = Dim::Fixed(total);
    Ok(TensorType::new(first.dtype, Shape(dims)))
}

/// Checks an NCHW f32 image and returns (H, W), which must be static.
fn image(t: &TensorType, role: &str) -> Result<[usize; 2], Cause> {
    expect_dtype(t, DType::F32, role)?;
    if t.rank() != 4 {
        return Err(format!("{role} must be NCHW (rank 4), got {t}"));
    }
    Ok([fixed_axis(&t.shape, 2)?, fixed_axis(&t.shape, 3)?])
}

fn conv_out_hw(in_hw: [usize; 2], k_hw: [usize; 2], a: &Conv2dAttrs) -> Result<[usize; 2], Cause> {
    let mut out = [0; 2];
    for i in 0..2 {
        out[i] = window_output_size(in_hw[i], k_hw[i], a.stride[i], a.padding[i], a.dilation[i])
            .filter(|&o| o > 0 && a.dilation[i] > 0)
            .ok_or_else(|| format!("kernel {k_hw:?} with {a:?} does not fit input {in_hw:?}"))?;
    }
    Ok(out)
}

fn conv2d(x: &TensorType, w: &TensorType, a: &Conv2dAttrs) -> Result<TensorType, Cause> {
    let in_hw = image(x, "input")?;
    let k_hw = image(w, "filter")?;
    let [_, c_out, _, _] = fixed4(w, "filter")?;
    if x.shape.0[1] != w.shape.0[1] {
        return Err(format!("input channels of {x} differ from filter {w}"));
    }
    let out = conv_out_hw(in_hw, k_hw, a)?;
    let _ = c_out;
    Ok(TensorType::new(
        DType::F32,
        Shape(vec![
            x.shape.0[0],
            w.shape.0[0],
            Dim::Fixed(out[0]),
            Dim::Fixed(out[1]),
        ]),
    ))
}

fn fixed4(t: &TensorType, role: &str) -> Result<[usize; 4], Cause> {
    let dims = t
        .shape
        .as_fixed()
        .ok_or_else(|| format!("{role} {t} must have a static shape"))?;
    Ok([dims[0], dims[1], dims[2], dims[3]])
}

fn conv2d_backward_input(
    dy: &TensorType,
    w: &TensorType,
    a: &Conv2dAttrs,
    input_hw: [usize; 2],
) -> Result<TensorType, Cause> {
    image(dy, "gradient")?;
    let k_hw = image(w, "filter")?;
    let x = TensorType::new(
        DType::F32,
        Shape(vec![
            dy.shape.0[0],
            w.shape.0[1],
            Dim::Fixed(input_hw[0]),
            Dim::Fixed(input_hw[1]),
        ]),
    );
    let y = conv2d(&x, w, a)?;
    if y != *dy {
        return Err(format!(
            "gradient {dy} does not match the forward output {y}"
        ));
    }
    let _ = k_hw;
    Ok(x)
}

fn conv2d_backward_filter(
    x: &TensorType,
    dy: &TensorType,
    a: &Conv2dAttrs,
    kernel_hw: [usize; 2],
) -> Result<TensorType, Cause> {
    image(x, "input")?;
    image(dy, "gradient")?;
    let c_in = fixed_axis(&x.shape, 1)?;
    let c_out = fixed_axis(&dy.shape, 1)?;
    let w = TensorType::f32(&[c_out, c_in, kernel_hw[0], kernel_hw[1]]);
    let y = conv2d(x, &w, a)?;
    if y != *dy {
        return Err(format!(
            "gradient {dy} does not match the forward output {y}"
        ));
    }
    Ok(w)
}

fn pool2d(x: &TensorType, a: &Pool2dAttrs) -> Result<TensorType, Cause> {
    let in_hw = image(x, "input")?;
    let mut out = [0; 2];
    for i in 0..2 {
        if a.padding[i] * 2 > a.kernel[i] {
            return Err(format!(
                "padding {:?} exceeds half the kernel {:?}",
                a.padding, a.kernel
            ));
        }
        out[i] = window_output_size(in_hw[i], a.kernel[i], a.stride[i], a.padding[i], 1)
            .filter(|&o| o > 0 && a.kernel[i] > 0)
            .ok_or_else(|| format!("window {a:?} does not fit input {in_hw:?}"))?;
    }
    Ok(TensorType::new(
        DType::F32,
        Shape(vec![
            x.shape.0[0],
            x.shape.0[1],
            Dim::Fixed(out[0]),
            Dim::Fixed(out[1]),
        ]),
    ))
}

fn gather(data: &TensorType, idx: &TensorType, axis: usize) -> Result<TensorType, Cause> {
    check_axis(data, axis)?;
    expect_index(idx, "indices")?;
    let mut dims = data.shape.0[..axis].to_vec();
    dims.extend_from_slice(&idx.shape.0);
    dims.extend_from_slice(&data.shape.0[axis + 1..]);
    Ok(TensorType::new(data.dtype, Shape(dims)))
}

fn scatter_add(
    idx: &TensorType,
    updates: &TensorType,
    axis: usize,
    dim_size: usize,
) -> Result<TensorType, Cause> {
    expect_index(idx, "indices")?;
    expect_dtype(updates, DType::F32, "updates")?;
    let (ri, ru) = (idx.rank(), updates.rank());
    if ru < axis + ri || updates.shape.0[axis..axis + ri] != idx.shape.0[..] {
        return Err(format!(
            "updates {updates} do not fit indices {idx} at axis {axis}"
        ));
    }
    let mut dims = updates.shape.0[..axis].to_vec();
    dims.push(Dim::Fixed(dim_size));
    dims.extend_from_slice(&updates.shape.0[axis + ri..]);
    Ok(TensorType::new(DType::F32, Shape(dims)))
}
