//! Forward reference tests for every CPU kernel: small tensors with
//! expected values written out (computed by hand or by a naive reference
//! loop), broadcasting, conv/pool geometry, ties, index ops on inner axes,
//! and runtime errors that must be reported rather than panic.

use anyhow::Result;
mod common;

use canopy_engine::error::KernelError;
use canopy_engine::{Backend, CpuBackend, EngineError, Value};
use canopy_ir::{
    BinaryOp, Conv2dAttrs, DType, Dim, Graph, Op, Pool2dAttrs, ReduceKind, Shape, TensorType,
    UnaryOp,
};
use ndarray::{ArrayD, IxDyn};

// ---- helpers ---------------------------------------------------------------

fn f32s(shape: &[usize], data: &[f32]) -> Value {
    Value::F32(
        ArrayD::from_shape_vec(IxDyn(shape), data.to_vec()).expect("test data fits its shape"),
    )
}

fn i64s(shape: &[usize], data: &[i64]) -> Value {
    Value::I64(
        ArrayD::from_shape_vec(IxDyn(shape), data.to_vec()).expect("test data fits its shape"),
    )
}

fn i32s(shape: &[usize], data: &[i32]) -> Value {
    Value::I32(
        ArrayD::from_shape_vec(IxDyn(shape), data.to_vec()).expect("test data fits its shape"),
    )
}

fn bools(shape: &[usize], data: &[bool]) -> Value {
    Value::Bool(
        ArrayD::from_shape_vec(IxDyn(shape), data.to_vec()).expect("test data fits its shape"),
    )
}

fn range(shape: &[usize], first: f32) -> Value {
    let n: usize = shape.iter().product();
    let data: Vec<f32> = (0..n).map(|i| first + i as f32).collect();
    f32s(shape, &data)
}

fn type_of(v: &Value) -> TensorType {
    TensorType::new(v.dtype(), Shape::fixed(v.shape()))
}

/// Runs `op` on `inputs`. With `share_inputs`, the inputs are graph outputs
/// too, so the kernel gets them borrowed instead of owned.
fn run_op(op: &Op, inputs: &[Value], share_inputs: bool) -> Result<Value> {
    let mut g = Graph::new();
    let ids = inputs
        .iter()
        .enumerate()
        .map(|(i, v)| g.input(format!("x{i}"), type_of(v)))
        .collect::<Result<Vec<_>, _>>()?;
    let out = g.push(op.clone(), &ids)?;
    g.set_output("out", out)?;
    if share_inputs {
        for (i, &id) in ids.iter().enumerate() {
            g.set_output(format!("keep{i}"), id)?;
        }
    }
    let mut exe = CpuBackend.compile(&g)?;
    let mut outputs = exe.run(inputs.to_vec())?;
    // Every op also runs on the GPU, which must give the CPU's values.
    if let Some(gpu) = common::gpu_under_test() {
        let on_gpu = gpu
            .compile(&g)
            .and_then(|mut exe| exe.run(inputs.to_vec()))
            .unwrap_or_else(|e| panic!("{op:?}: the CPU ran it, the GPU failed: {e}"));
        for ((c, g), name) in outputs.iter().zip(&on_gpu).zip(["out", "keep"]) {
            common::assert_close_across_backends(&format!("{op:?} {name}"), c, g);
        }
    }
    Ok(outputs.swap_remove(0))
}

/// Runs `op` with owned and with borrowed operands; both must agree.
fn eval(op: Op, inputs: &[Value]) -> Value {
    let owned = run_op(&op, inputs, false).unwrap_or_else(|e| panic!("{op:?} (owned): {e}"));
    let shared = run_op(&op, inputs, true).unwrap_or_else(|e| panic!("{op:?} (shared): {e}"));
    assert_values_eq(&owned, &shared);
    owned
}

/// The kernel error of running `op`, which must fail in its kernel. The
/// engine error around it must name the node, the op and the operand
/// shapes.
fn eval_err(op: Op, inputs: &[Value]) -> KernelError {
    let error = match run_op(&op, inputs, false) {
        Ok(v) => panic!("{op:?} should fail, got {v:?}"),
        Err(e) => e,
    };
    match error.downcast::<EngineError>() {
        Ok(EngineError::Kernel {
            node: Some(_),
            op: name,
            operands,
            source,
        }) => {
            assert_eq!(name, op.name());
            let shapes: Vec<Vec<usize>> = inputs.iter().map(|v| v.shape().to_vec()).collect();
            assert_eq!(operands, shapes, "operand shapes of {op:?}");
            source
        }
        other => panic!("{op:?}: expected a kernel error, got {other:?}"),
    }
}

fn assert_values_eq(a: &Value, b: &Value) {
    match (a, b) {
        (Value::F32(x), Value::F32(y)) => {
            assert_eq!(x.shape(), y.shape());
            for (p, q) in x.iter().zip(y) {
                assert!(p.to_bits() == q.to_bits() || p == q, "{x:?} != {y:?}");
            }
        }
        _ => assert_eq!(a, b),
    }
}

/// f32 values within 1e-5 (relative above 1); NaN matches NaN.
fn assert_f32(v: &Value, shape: &[usize], expected: &[f32]) {
    let Value::F32(a) = v else {
        panic!("expected f32, got {v:?}");
    };
    assert_eq!(a.shape(), shape, "shape of {a:?}");
    let got: Vec<f32> = a.iter().copied().collect();
    assert_eq!(got.len(), expected.len());
    for (i, (&g, &e)) in got.iter().zip(expected).enumerate() {
        let close =
            (g.is_nan() && e.is_nan()) || g == e || (g - e).abs() <= 1e-5 * e.abs().max(1.0);
        assert!(
            close,
            "element {i}: got {g}, expected {e}\n got: {got:?}\nwant: {expected:?}"
        );
    }
}

fn conv(stride: [usize; 2], padding: [usize; 2], dilation: [usize; 2]) -> Conv2dAttrs {
    Conv2dAttrs {
        stride,
        padding,
        dilation,
    }
}

fn pool(kernel: [usize; 2], stride: [usize; 2], padding: [usize; 2]) -> Pool2dAttrs {
    Pool2dAttrs {
        kernel,
        stride,
        padding,
    }
}

// ---- unary -------------------------------------------------------------------

#[test]
fn unary_ops_on_mixed_signs() {
    let x = f32s(&[2, 2], &[-2.0, -0.5, 0.0, 1.5]);
    let cases: &[(UnaryOp, [f32; 4])] = &[
        (UnaryOp::Neg, [2.0, 0.5, 0.0, -1.5]),
        (UnaryOp::Abs, [2.0, 0.5, 0.0, 1.5]),
        (UnaryOp::Sign, [-1.0, -1.0, 0.0, 1.0]),
        (UnaryOp::Exp, [0.135_335_28, 0.606_530_66, 1.0, 4.481_689]),
        (UnaryOp::Square, [4.0, 0.25, 0.0, 2.25]),
        (
            UnaryOp::Reciprocal,
            [-0.5, -2.0, f32::INFINITY, 0.666_666_7],
        ),
        (UnaryOp::Relu, [0.0, 0.0, 0.0, 1.5]),
        (
            UnaryOp::Gelu,
            [-0.045_402_306, -0.154_286, 0.0, 1.399_571_6],
        ),
        (
            UnaryOp::Sigmoid,
            [0.119_202_92, 0.377_540_67, 0.5, 0.817_574_5],
        ),
        (
            UnaryOp::Tanh,
            [-0.964_027_6, -0.462_117_16, 0.0, 0.905_148_26],
        ),
        // References from Python's math.erf, in f64.
        (UnaryOp::Erf, [-0.995_322_3, -0.520_499_9, 0.0, 0.966_105_2]),
        (
            UnaryOp::GeluErf,
            [-0.045_500_264, -0.154_268_77, 0.0, 1.399_789_2],
        ),
        (
            UnaryOp::Softplus,
            [0.126_928, 0.474_077, std::f32::consts::LN_2, 1.701_413_3],
        ),
    ];
    for (op, expected) in cases {
        let out = eval(Op::Unary(*op), std::slice::from_ref(&x));
        assert_f32(&out, &[2, 2], expected);
    }
}

/// softplus neither overflows nor rounds to zero at the extremes, and
/// log1p keeps the digits that log(1 + x) loses near 0 (in f32 that gives
/// 1.19e-7 for 1e-7), on every backend, to 1e-5 relative.
#[test]
fn softplus_and_log1p_stay_accurate_at_the_extremes() {
    let x = f32s(&[4], &[100.0, -30.0, 1e-7, -1e-7]);
    let cases: [(UnaryOp, [f32; 4]); 2] = [
        (
            UnaryOp::Softplus,
            [
                100.0,
                9.357_623e-14,
                std::f32::consts::LN_2,
                std::f32::consts::LN_2 - 5e-8,
            ],
        ),
        (
            UnaryOp::Log1p,
            [4.615_120_5, f32::NAN, 9.999_999_5e-8, -1.000_000_1e-7],
        ),
    ];
    for (op, expected) in cases {
        let mut g = Graph::new();
        let input = g.input("x", type_of(&x)).unwrap();
        let y = g.unary(op, input).unwrap();
        g.set_output("y", y).unwrap();
        let mut backends: Vec<Box<dyn Backend>> = vec![Box::new(CpuBackend)];
        backends.extend(common::gpu_under_test().map(|gpu| Box::new(gpu) as Box<dyn Backend>));
        for backend in backends {
            let out = backend.compile(&g).unwrap().run(vec![x.clone()]).unwrap();
            let got = out[0].as_f32().unwrap().iter().copied().collect::<Vec<_>>();
            for (g, e) in got.iter().zip(expected) {
                let close = (g.is_nan() && e.is_nan()) || (g - e).abs() <= 1e-5 * e.abs();
                assert!(
                    close,
                    "{op:?} on {}: got {got:?}, want {expected:?}",
                    backend.describe().backend
                );
            }
        }
    }
}

#[test]
fn unary_ops_on_positive_inputs() {
    let x = f32s(&[3], &[0.25, 1.0, 4.0]);
    assert_f32(
        &eval(Op::Unary(UnaryOp::Log1p), std::slice::from_ref(&x)),
        &[3],
        &[0.223_143_55, std::f32::consts::LN_2, 1.609_438],
    );
    let x = f32s(&[3], &[0.25, 1.0, 4.0]);
    assert_f32(
        &eval(Op::Unary(UnaryOp::Log), std::slice::from_ref(&x)),
        &[3],
        &[-1.386_294_4, 0.0, 1.386_294_4],
    );
    assert_f32(
        &eval(Op::Unary(UnaryOp::Sqrt), std::slice::from_ref(&x)),
        &[3],
        &[0.5, 1.0, 2.0],
    );
    assert_f32(
        &eval(Op::Unary(UnaryOp::Rsqrt), std::slice::from_ref(&x)),
        &[3],
        &[2.0, 1.0, 0.5],
    );
}

#[test]
fn relu_and_sign_propagate_nan() {
    let x = f32s(&[2], &[f32::NAN, -1.0]);
    assert_f32(
        &eval(Op::Unary(UnaryOp::Relu), std::slice::from_ref(&x)),
        &[2],
        &[f32::NAN, 0.0],
    );
    assert_f32(
        &eval(Op::Unary(UnaryOp::Sign), std::slice::from_ref(&x)),
        &[2],
        &[f32::NAN, -1.0],
    );
}

#[test]
fn logical_not() {
    let out = eval(
        Op::Unary(UnaryOp::Not),
        &[bools(&[3], &[true, false, true])],
    );
    assert_eq!(out, bools(&[3], &[false, true, false]));
}

#[test]
fn large_unary_runs_in_parallel_and_matches() {
    let n = 100_000;
    let data: Vec<f32> = (0..n).map(|i| i as f32 * 0.001 - 50.0).collect();
    let out = eval(Op::Unary(UnaryOp::Relu), &[f32s(&[n], &data)]);
    let expected: Vec<f32> = data.iter().map(|&v| v.max(0.0)).collect();
    assert_f32(&out, &[n], &expected);
}

// ---- binary ------------------------------------------------------------------

#[test]
fn add_same_shape() {
    let out = eval(
        Op::Binary(BinaryOp::Add),
        &[range(&[2, 2], 1.0), range(&[2, 2], 10.0)],
    );
    assert_f32(&out, &[2, 2], &[11.0, 13.0, 15.0, 17.0]);
}

#[test]
fn add_broadcasts_a_bias_row() {
    let out = eval(
        Op::Binary(BinaryOp::Add),
        &[range(&[2, 3], 0.0), f32s(&[3], &[10.0, 20.0, 30.0])],
    );
    assert_f32(&out, &[2, 3], &[10.0, 21.0, 32.0, 13.0, 24.0, 35.0]);
}

#[test]
fn sub_with_the_broadcast_operand_on_the_left() {
    // Only the right operand has the output shape, so the result reuses it
    // with the operands swapped: the order must still be a - b.
    let out = eval(
        Op::Binary(BinaryOp::Sub),
        &[f32s(&[3], &[10.0, 20.0, 30.0]), range(&[2, 3], 0.0)],
    );
    assert_f32(&out, &[2, 3], &[10.0, 19.0, 28.0, 7.0, 16.0, 25.0]);
}

#[test]
fn mul_broadcasts_column_against_row() {
    let out = eval(
        Op::Binary(BinaryOp::Mul),
        &[
            f32s(&[2, 1], &[2.0, 3.0]),
            f32s(&[1, 3], &[1.0, 10.0, 100.0]),
        ],
    );
    assert_f32(&out, &[2, 3], &[2.0, 20.0, 200.0, 3.0, 30.0, 300.0]);
}

#[test]
fn div_by_a_per_row_statistic() {
    let out = eval(
        Op::Binary(BinaryOp::Div),
        &[range(&[2, 3], 1.0), f32s(&[2, 1], &[2.0, 4.0])],
    );
    assert_f32(&out, &[2, 3], &[0.5, 1.0, 1.5, 1.0, 1.25, 1.5]);
}

#[test]
fn binary_with_scalar_operands() {
    let x = f32s(&[3], &[1.0, 2.0, 3.0]);
    let two = f32s(&[], &[2.0]);
    assert_f32(
        &eval(Op::Binary(BinaryOp::Pow), &[x.clone(), two.clone()]),
        &[3],
        &[1.0, 4.0, 9.0],
    );
    assert_f32(
        &eval(Op::Binary(BinaryOp::Sub), &[two.clone(), x.clone()]),
        &[3],
        &[1.0, 0.0, -1.0],
    );
    assert_f32(
        &eval(Op::Binary(BinaryOp::Div), &[two, x]),
        &[3],
        &[2.0, 1.0, 0.666_666_7],
    );
}

#[test]
fn broadcast_of_both_operands_to_a_new_shape() {
    let out = eval(
        Op::Binary(BinaryOp::Sub),
        &[f32s(&[3, 1], &[1.0, 2.0, 3.0]), f32s(&[2], &[10.0, 20.0])],
    );
    assert_f32(&out, &[3, 2], &[-9.0, -19.0, -8.0, -18.0, -7.0, -17.0]);
}

#[test]
fn maximum_and_minimum_propagate_nan() {
    let a = f32s(&[3], &[1.0, f32::NAN, 5.0]);
    let b = f32s(&[3], &[2.0, 0.0, f32::NAN]);
    assert_f32(
        &eval(Op::Binary(BinaryOp::Maximum), &[a.clone(), b.clone()]),
        &[3],
        &[2.0, f32::NAN, f32::NAN],
    );
    assert_f32(
        &eval(Op::Binary(BinaryOp::Minimum), &[a, b]),
        &[3],
        &[1.0, f32::NAN, f32::NAN],
    );
}

#[test]
fn integer_arithmetic_truncates_and_wraps() {
    let a = i64s(&[4], &[7, -7, 9, i64::MAX]);
    let b = i64s(&[4], &[2, 2, -4, 1]);
    assert_eq!(
        eval(Op::Binary(BinaryOp::Div), &[a.clone(), b.clone()]),
        i64s(&[4], &[3, -3, -2, i64::MAX])
    );
    assert_eq!(
        eval(Op::Binary(BinaryOp::Add), &[a.clone(), b.clone()]),
        i64s(&[4], &[9, -5, 5, i64::MIN])
    );
    assert_eq!(
        eval(Op::Binary(BinaryOp::Maximum), &[a, b]),
        i64s(&[4], &[7, 2, 9, i64::MAX])
    );
    let c = i32s(&[2, 2], &[1, 2, 3, 4]);
    let d = i32s(&[2], &[10, 20]);
    assert_eq!(
        eval(Op::Binary(BinaryOp::Mul), &[c, d]),
        i32s(&[2, 2], &[10, 40, 30, 80])
    );
}

#[test]
fn integer_division_by_zero_is_an_error() {
    let err = eval_err(
        Op::Binary(BinaryOp::Div),
        &[i32s(&[2], &[1, 2]), i32s(&[2], &[1, 0])],
    );
    assert_eq!(err, KernelError::DivisionByZero);
}

#[test]
fn comparisons_produce_bool_with_broadcasting() {
    let a = f32s(&[2, 2], &[1.0, 2.0, 3.0, 4.0]);
    let b = f32s(&[2], &[2.0, 3.0]);
    let cases: &[(BinaryOp, [bool; 4])] = &[
        (BinaryOp::Eq, [false, false, false, false]),
        (BinaryOp::Ne, [true, true, true, true]),
        (BinaryOp::Lt, [true, true, false, false]),
        (BinaryOp::Le, [true, true, false, false]),
        (BinaryOp::Gt, [false, false, true, true]),
        (BinaryOp::Ge, [false, false, true, true]),
    ];
    for (op, expected) in cases {
        let out = eval(Op::Binary(*op), &[a.clone(), b.clone()]);
        assert_eq!(out, bools(&[2, 2], expected), "{op:?}");
    }
    let eq = eval(
        Op::Binary(BinaryOp::Eq),
        &[i64s(&[3], &[1, 5, 3]), i64s(&[], &[3])],
    );
    assert_eq!(eq, bools(&[3], &[false, false, true]));
    let ge = eval(
        Op::Binary(BinaryOp::Ge),
        &[bools(&[2], &[true, false]), bools(&[1], &[true])],
    );
    assert_eq!(ge, bools(&[2], &[true, false]));
}

#[test]
fn logical_and_or() {
    let a = bools(&[2, 2], &[true, true, false, false]);
    let b = bools(&[2], &[true, false]);
    assert_eq!(
        eval(Op::Binary(BinaryOp::And), &[a.clone(), b.clone()]),
        bools(&[2, 2], &[true, false, false, false])
    );
    assert_eq!(
        eval(Op::Binary(BinaryOp::Or), &[a, b]),
        bools(&[2, 2], &[true, true, true, false])
    );
}

#[test]
fn where_broadcasts_all_three_operands() {
    let cond = bools(&[2, 1], &[true, false]);
    let a = f32s(&[3], &[1.0, 2.0, 3.0]);
    let b = f32s(&[], &[-1.0]);
    let out = eval(Op::Where, &[cond, a, b]);
    assert_f32(&out, &[2, 3], &[1.0, 2.0, 3.0, -1.0, -1.0, -1.0]);
}

#[test]
fn where_selects_elementwise_on_any_dtype() {
    let cond = bools(&[4], &[true, false, false, true]);
    let out = eval(
        Op::Where,
        &[cond.clone(), range(&[4], 0.0), range(&[4], 10.0)],
    );
    assert_f32(&out, &[4], &[0.0, 11.0, 12.0, 3.0]);
    let out = eval(
        Op::Where,
        &[cond.clone(), i64s(&[4], &[1, 2, 3, 4]), i64s(&[1], &[0])],
    );
    assert_eq!(out, i64s(&[4], &[1, 0, 0, 4]));
    // Only the second branch has the output shape, so it is the one reused.
    let out = eval(
        Op::Where,
        &[cond, i32s(&[], &[7]), i32s(&[4], &[1, 2, 3, 4])],
    );
    assert_eq!(out, i32s(&[4], &[7, 2, 3, 7]));
}

// ---- cast --------------------------------------------------------------------

#[test]
fn cast_between_dtypes() {
    let x = f32s(&[5], &[-1.7, 2.9, 0.0, -0.2, 3.0]);
    assert_eq!(
        eval(Op::Cast { to: DType::I64 }, std::slice::from_ref(&x)),
        i64s(&[5], &[-1, 2, 0, 0, 3])
    );
    assert_eq!(
        eval(Op::Cast { to: DType::I32 }, std::slice::from_ref(&x)),
        i32s(&[5], &[-1, 2, 0, 0, 3])
    );
    assert_eq!(
        eval(Op::Cast { to: DType::Bool }, std::slice::from_ref(&x)),
        bools(&[5], &[true, true, false, true, true])
    );
    let flags = bools(&[2], &[true, false]);
    assert_f32(
        &eval(Op::Cast { to: DType::F32 }, std::slice::from_ref(&flags)),
        &[2],
        &[1.0, 0.0],
    );
    assert_eq!(
        eval(Op::Cast { to: DType::I64 }, std::slice::from_ref(&flags)),
        i64s(&[2], &[1, 0])
    );
    let wide = i64s(&[2], &[(1 << 32) + 5, -3]);
    assert_eq!(
        eval(Op::Cast { to: DType::I32 }, std::slice::from_ref(&wide)),
        i32s(&[2], &[5, -3])
    );
    assert_f32(
        &eval(Op::Cast { to: DType::F32 }, &[i32s(&[2], &[-4, 7])]),
        &[2],
        &[-4.0, 7.0],
    );
    assert_eq!(
        eval(Op::Cast { to: DType::Bool }, &[i32s(&[2], &[0, -2])]),
        bools(&[2], &[false, true])
    );
    assert_eq!(
        eval(Op::Cast { to: DType::F32 }, std::slice::from_ref(&x)),
        x
    );
}

// ---- matmul ------------------------------------------------------------------

#[test]
fn matmul_plain_and_transposed() {
    let a = range(&[2, 3], 1.0); // [[1,2,3],[4,5,6]]
    let b = range(&[3, 2], 1.0); // [[1,2],[3,4],[5,6]]
    let plain = Op::MatMul {
        transpose_a: false,
        transpose_b: false,
    };
    assert_f32(
        &eval(plain, &[a.clone(), b.clone()]),
        &[2, 2],
        &[22.0, 28.0, 49.0, 64.0],
    );
    // aᵀ·a: [3, 2]·[2, 3].
    let ta = Op::MatMul {
        transpose_a: true,
        transpose_b: false,
    };
    assert_f32(
        &eval(ta, &[a.clone(), a.clone()]),
        &[3, 3],
        &[17.0, 22.0, 27.0, 22.0, 29.0, 36.0, 27.0, 36.0, 45.0],
    );
    // a·aᵀ: [2, 3]·[3, 2].
    let tb = Op::MatMul {
        transpose_a: false,
        transpose_b: true,
    };
    assert_f32(
        &eval(tb, &[a.clone(), a]),
        &[2, 2],
        &[14.0, 32.0, 32.0, 77.0],
    );
    // bᵀ·bᵀ... both flags: [2, 3]·[3, 2] from b:[3,2] and b2:[2,3].
    let both = Op::MatMul {
        transpose_a: true,
        transpose_b: true,
    };
    let b2 = range(&[2, 3], 1.0);
    assert_f32(&eval(both, &[b, b2]), &[2, 2], &[22.0, 49.0, 28.0, 64.0]);
}

#[test]
fn matmul_batched_with_broadcast_batch_dims() {
    let plain = Op::MatMul {
        transpose_a: false,
        transpose_b: false,
    };
    // [2, 2, 2] × [2, 2]: the right matrix is shared by both batches.
    let a = range(&[2, 2, 2], 1.0);
    let b = f32s(&[2, 2], &[1.0, 0.0, 1.0, 1.0]);
    assert_f32(
        &eval(plain.clone(), &[a.clone(), b]),
        &[2, 2, 2],
        &[3.0, 2.0, 7.0, 4.0, 11.0, 6.0, 15.0, 8.0],
    );
    // [2, 2] × [2, 2, 2]: the left matrix broadcasts.
    let left = f32s(&[2, 2], &[1.0, 1.0, 0.0, 2.0]);
    assert_f32(
        &eval(plain.clone(), &[left, a.clone()]),
        &[2, 2, 2],
        &[4.0, 6.0, 6.0, 8.0, 12.0, 14.0, 14.0, 16.0],
    );
    // [2, 1, 2, 2] × [3, 2, 2] → [2, 3, 2, 2] with a transposed right side.
    let lhs = f32s(&[2, 1, 2, 2], &[1.0, 0.0, 0.0, 1.0, 2.0, 0.0, 0.0, 2.0]);
    let rhs = range(&[3, 2, 2], 0.0);
    let tb = Op::MatMul {
        transpose_a: false,
        transpose_b: true,
    };
    let out = eval(tb, &[lhs, rhs]);
    #[rustfmt::skip]
    let expected = [
        0.0, 2.0, 1.0, 3.0,   4.0, 6.0, 5.0, 7.0,   8.0, 10.0, 9.0, 11.0,
        0.0, 4.0, 2.0, 6.0,   8.0, 12.0, 10.0, 14.0,   16.0, 20.0, 18.0, 22.0,
    ];
    assert_f32(&out, &[2, 3, 2, 2], &expected);
}

#[test]
fn matmul_with_empty_inner_dimension_is_zero() {
    let plain = Op::MatMul {
        transpose_a: false,
        transpose_b: false,
    };
    let out = eval(plain, &[f32s(&[2, 0], &[]), f32s(&[0, 3], &[])]);
    assert_f32(&out, &[2, 3], &[0.0; 6]);
}

// ---- reductions --------------------------------------------------------------

fn reduce(kind: ReduceKind, axes: &[usize], keep_dims: bool) -> Op {
    Op::Reduce {
        kind,
        axes: axes.to_vec(),
        keep_dims,
    }
}

#[test]
fn sum_over_leading_trailing_and_all_axes() {
    let x = range(&[2, 3], 1.0); // [[1,2,3],[4,5,6]]
    assert_f32(
        &eval(
            reduce(ReduceKind::Sum, &[0], false),
            std::slice::from_ref(&x),
        ),
        &[3],
        &[5.0, 7.0, 9.0],
    );
    assert_f32(
        &eval(
            reduce(ReduceKind::Sum, &[1], true),
            std::slice::from_ref(&x),
        ),
        &[2, 1],
        &[6.0, 15.0],
    );
    assert_f32(
        &eval(
            reduce(ReduceKind::Sum, &[0, 1], false),
            std::slice::from_ref(&x),
        ),
        &[],
        &[21.0],
    );
    assert_f32(
        &eval(
            reduce(ReduceKind::Sum, &[], false),
            std::slice::from_ref(&x),
        ),
        &[2, 3],
        &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
    );
}

#[test]
fn sum_over_middle_and_scattered_axes() {
    let x = range(&[2, 3, 2], 0.0);
    // Middle axis: [[0+2+4, 1+3+5], [6+8+10, 7+9+11]].
    assert_f32(
        &eval(
            reduce(ReduceKind::Sum, &[1], false),
            std::slice::from_ref(&x),
        ),
        &[2, 2],
        &[6.0, 9.0, 24.0, 27.0],
    );
    // Axes 0 and 2 (not contiguous): per middle index j, sum of x[i, j, k].
    assert_f32(
        &eval(
            reduce(ReduceKind::Sum, &[0, 2], true),
            std::slice::from_ref(&x),
        ),
        &[1, 3, 1],
        &[14.0, 22.0, 30.0],
    );
    assert_f32(
        &eval(reduce(ReduceKind::Mean, &[0, 2], false), &[x]),
        &[3],
        &[3.5, 5.5, 7.5],
    );
}

/// Three runs of reduced axes ([0], [2, 3] and [5] of a rank-6 operand,
/// as a conv bias gradient has two) against a sum written out by hand.
#[test]
fn reductions_over_several_runs_of_axes_match_a_direct_loop() {
    let shape = [2, 3, 2, 4, 3, 2];
    let x = range(&shape, -40.0);
    let Value::F32(array) = &x else {
        unreachable!()
    };
    let axes = [0, 2, 3, 5];
    let kept = [1, 4];
    let mut sums = [0.0f32; 9];
    let mut maxima = [f32::NEG_INFINITY; 9];
    for (index, &v) in array.indexed_iter() {
        let at = index[kept[0]] * 3 + index[kept[1]];
        sums[at] += v;
        maxima[at] = maxima[at].max(v);
    }
    let count = (2 * 2 * 4 * 2) as f32;
    let means: Vec<f32> = sums.iter().map(|s| s / count).collect();
    for (kind, want) in [
        (ReduceKind::Sum, sums.to_vec()),
        (ReduceKind::Mean, means),
        (ReduceKind::Max, maxima.to_vec()),
    ] {
        let kept_dims = eval(reduce(kind, &axes, true), std::slice::from_ref(&x));
        assert_f32(&kept_dims, &[1, 3, 1, 1, 3, 1], &want);
        let dropped = eval(reduce(kind, &axes, false), std::slice::from_ref(&x));
        assert_f32(&dropped, &[3, 3], &want);
    }
}

#[test]
fn mean_divides_by_the_reduced_count() {
    let x = range(&[2, 4], 1.0);
    assert_f32(
        &eval(
            reduce(ReduceKind::Mean, &[1], false),
            std::slice::from_ref(&x),
        ),
        &[2],
        &[2.5, 6.5],
    );
    assert_f32(
        &eval(reduce(ReduceKind::Mean, &[0], false), &[x]),
        &[4],
        &[3.0, 4.0, 5.0, 6.0],
    );
}

#[test]
fn max_over_f32_and_integers() {
    let x = f32s(&[2, 3], &[1.0, -5.0, 3.0, -2.0, -1.0, -7.0]);
    assert_f32(
        &eval(
            reduce(ReduceKind::Max, &[1], false),
            std::slice::from_ref(&x),
        ),
        &[2],
        &[3.0, -1.0],
    );
    assert_f32(
        &eval(reduce(ReduceKind::Max, &[0], false), &[x]),
        &[3],
        &[1.0, -1.0, 3.0],
    );
    let y = i64s(&[2, 2], &[-9, -3, 4, -20]);
    assert_eq!(
        eval(
            reduce(ReduceKind::Max, &[0], false),
            std::slice::from_ref(&y)
        ),
        i64s(&[2], &[4, -3])
    );
    assert_eq!(
        eval(reduce(ReduceKind::Sum, &[0, 1], false), &[y]),
        i64s(&[], &[-28])
    );
    let z = i32s(&[3], &[5, 6, 7]);
    assert_eq!(
        eval(reduce(ReduceKind::Sum, &[0], true), &[z]),
        i32s(&[1], &[18])
    );
}

#[test]
fn large_reductions_match_small_ones() {
    let (rows, cols) = (300, 200);
    let data: Vec<f32> = (0..rows * cols).map(|i| (i % 7) as f32).collect();
    let x = f32s(&[rows, cols], &data);
    let col_sums: Vec<f32> = (0..cols)
        .map(|c| (0..rows).map(|r| data[r * cols + c]).sum())
        .collect();
    let row_max: Vec<f32> = (0..rows)
        .map(|r| {
            data[r * cols..(r + 1) * cols]
                .iter()
                .copied()
                .fold(f32::MIN, f32::max)
        })
        .collect();
    assert_f32(
        &eval(
            reduce(ReduceKind::Sum, &[0], false),
            std::slice::from_ref(&x),
        ),
        &[cols],
        &col_sums,
    );
    assert_f32(
        &eval(
            reduce(ReduceKind::Max, &[1], false),
            std::slice::from_ref(&x),
        ),
        &[rows],
        &row_max,
    );
    let total: f32 = data.iter().sum();
    assert_f32(
        &eval(reduce(ReduceKind::Sum, &[0, 1], false), &[x]),
        &[],
        &[total],
    );
}

#[test]
fn max_over_an_empty_axis_is_an_error() {
    let err = eval_err(reduce(ReduceKind::Max, &[1], false), &[f32s(&[2, 0], &[])]);
    assert!(
        matches!(&err, KernelError::Shape(cause) if cause.contains("empty axis")),
        "{err:?}"
    );
}

// ---- layout ops --------------------------------------------------------------

#[test]
fn reshape_keeps_row_major_order() {
    let op = Op::Reshape {
        shape: vec![Dim::Fixed(3), Dim::Fixed(2)],
    };
    assert_f32(
        &eval(op, &[range(&[2, 3], 0.0)]),
        &[3, 2],
        &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0],
    );
}

#[test]
fn reshape_of_a_transposed_value_uses_logical_order() {
    // Transpose then reshape inside one graph: the reshape sees the
    // transposed order, whatever the layout.
    let mut g = Graph::new();
    let x = g.input("x", TensorType::f32(&[2, 3])).expect("input");
    let t = g.transpose(x, vec![1, 0]).expect("transpose");
    let r = g.reshape(t, vec![Dim::Fixed(6)]).expect("reshape");
    g.set_output("r", r).expect("output");
    let out = CpuBackend
        .compile(&g)
        .expect("compile")
        .run(vec![range(&[2, 3], 0.0)])
        .expect("run");
    assert_f32(&out[0], &[6], &[0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
}

#[test]
fn reshape_binds_the_batch_dimension() {
    let mut g = Graph::new();
    let ty = TensorType::new(
        DType::F32,
        Shape(vec![Dim::Batch, Dim::Fixed(2), Dim::Fixed(2)]),
    );
    let x = g.input("x", ty).expect("input");
    let r = g
        .reshape(x, vec![Dim::Batch, Dim::Fixed(4)])
        .expect("reshape");
    g.set_output("r", r).expect("output");
    let out = CpuBackend
        .compile(&g)
        .expect("compile")
        .run(vec![range(&[3, 2, 2], 0.0)])
        .expect("run");
    let expected: Vec<f32> = (0..12).map(|i| i as f32).collect();
    assert_f32(&out[0], &[3, 4], &expected);
}

#[test]
fn transpose_general_permutation() {
    let x = range(&[2, 3, 4], 0.0);
    let out = eval(
        Op::Transpose {
            perm: vec![2, 0, 1],
        },
        &[x],
    );
    // out[k, i, j] = x[i, j, k] = 12 i + 4 j + k.
    let mut expected = Vec::new();
    for k in 0..4 {
        for i in 0..2 {
            for j in 0..3 {
                expected.push((12 * i + 4 * j + k) as f32);
            }
        }
    }
    assert_f32(&out, &[4, 2, 3], &expected);
    let ints = eval(
        Op::Transpose { perm: vec![1, 0] },
        &[i64s(&[2, 2], &[1, 2, 3, 4])],
    );
    assert_eq!(ints, i64s(&[2, 2], &[1, 3, 2, 4]));
}

#[test]
fn broadcast_to_a_larger_shape() {
    let op = Op::Broadcast {
        shape: vec![Dim::Fixed(2), Dim::Fixed(3)],
    };
    assert_f32(
        &eval(op.clone(), &[f32s(&[3], &[1.0, 2.0, 3.0])]),
        &[2, 3],
        &[1.0, 2.0, 3.0, 1.0, 2.0, 3.0],
    );
    assert_eq!(
        eval(op, &[bools(&[2, 1], &[true, false])]),
        bools(&[2, 3], &[true, true, true, false, false, false])
    );
}

#[test]
fn slice_along_an_inner_axis() {
    let op = Op::Slice {
        axis: 1,
        start: 1,
        end: 3,
    };
    assert_f32(
        &eval(op.clone(), &[range(&[2, 4], 0.0)]),
        &[2, 2],
        &[1.0, 2.0, 5.0, 6.0],
    );
    assert_eq!(
        eval(op, &[i32s(&[1, 4], &[9, 8, 7, 6])]),
        i32s(&[1, 2], &[8, 7])
    );
}

#[test]
fn pad_with_zeros() {
    let op = Op::Pad {
        axis: 0,
        before: 1,
        after: 2,
    };
    assert_f32(
        &eval(op, &[range(&[1, 2], 1.0)]),
        &[4, 2],
        &[0.0, 0.0, 1.0, 2.0, 0.0, 0.0, 0.0, 0.0],
    );
    let op = Op::Pad {
        axis: 1,
        before: 0,
        after: 1,
    };
    assert_eq!(
        eval(op, &[bools(&[2, 1], &[true, true])]),
        bools(&[2, 2], &[true, false, true, false])
    );
}

#[test]
fn concat_three_inputs_along_axis_1() {
    let out = eval(
        Op::Concat { axis: 1 },
        &[
            range(&[2, 1], 0.0),
            range(&[2, 2], 10.0),
            range(&[2, 1], 20.0),
        ],
    );
    assert_f32(
        &out,
        &[2, 4],
        &[0.0, 10.0, 11.0, 20.0, 1.0, 12.0, 13.0, 21.0],
    );
    let single = eval(Op::Concat { axis: 0 }, &[i64s(&[2], &[4, 5])]);
    assert_eq!(single, i64s(&[2], &[4, 5]));
}

// ---- convolution ---------------------------------------------------------------

#[test]
fn conv2d_valid_unit_stride() {
    let x = range(&[1, 1, 3, 3], 1.0);
    let w = f32s(&[1, 1, 2, 2], &[1.0, 2.0, 3.0, 4.0]);
    let out = eval(Op::Conv2d(Conv2dAttrs::default()), &[x, w]);
    assert_f32(&out, &[1, 1, 2, 2], &[37.0, 47.0, 67.0, 77.0]);
}

#[test]
fn conv2d_stride_2_padding_1() {
    let x = range(&[1, 1, 3, 3], 1.0);
    let w = f32s(&[1, 1, 2, 2], &[1.0, 2.0, 3.0, 4.0]);
    let out = eval(Op::Conv2d(conv([2, 2], [1, 1], [1, 1])), &[x, w]);
    assert_f32(&out, &[1, 1, 2, 2], &[4.0, 18.0, 36.0, 77.0]);
}

#[test]
fn conv2d_dilation_2_padding_1() {
    let x = range(&[1, 1, 4, 4], 1.0);
    let w = f32s(&[1, 1, 2, 2], &[1.0, 2.0, 3.0, 4.0]);
    let out = eval(Op::Conv2d(conv([1, 1], [1, 1], [2, 2])), &[x, w]);
    #[rustfmt::skip]
    let expected = [
        24.0, 43.0, 50.0, 21.0,
        44.0, 78.0, 88.0, 36.0,
        68.0, 118.0, 128.0, 52.0,
        20.0, 31.0, 34.0, 11.0,
    ];
    assert_f32(&out, &[1, 1, 4, 4], &expected);
}

/// N=2, C=2, H=3, W=4, O=2, 2×2 kernel, stride (1, 2), padding (1, 0).
struct MultiChannelCase {
    x: Value,
    w: Value,
    dy: Value,
    attrs: Conv2dAttrs,
}

fn multi_channel_case() -> MultiChannelCase {
    let x: Vec<f32> = (0..48).map(|i| ((i * 7) % 11) as f32 - 5.0).collect();
    let w: Vec<f32> = (0..16).map(|i| ((i * 5) % 7) as f32 - 3.0).collect();
    let dy: Vec<f32> = (0..32).map(|i| ((i * 3) % 5) as f32 - 2.0).collect();
    MultiChannelCase {
        x: f32s(&[2, 2, 3, 4], &x),
        w: f32s(&[2, 2, 2, 2], &w),
        dy: f32s(&[2, 2, 4, 2], &dy),
        attrs: conv([1, 2], [1, 0], [1, 1]),
    }
}

#[test]
fn conv2d_multi_channel_batch() {
    let case = multi_channel_case();
    let out = eval(Op::Conv2d(case.attrs), &[case.x, case.w]);
    #[rustfmt::skip]
    let expected = [
        0.0, -18.0, 20.0, 44.0, -20.0, -7.0, 26.0, -20.0,
        6.0, 6.0, 0.0, -16.0, 1.0, 18.0, -4.0, -9.0,
        -18.0, -3.0, 44.0, -20.0, -7.0, 17.0, -20.0, -11.0,
        6.0, 6.0, -16.0, 1.0, 18.0, 2.0, -9.0, -3.0,
    ];
    assert_f32(&out, &[2, 2, 4, 2], &expected);
}

#[test]
fn conv2d_backward_input_multi_channel() {
    let case = multi_channel_case();
    let op = Op::Conv2dBackwardInput {
        attrs: case.attrs,
        input_hw: [3, 4],
    };
    let out = eval(op, &[case.dy, case.w]);
    #[rustfmt::skip]
    let expected = [
        -5.0, 8.0, -4.0, 2.0, 2.0, -4.0, 8.0, -5.0, -1.0, -1.0, -5.0, 8.0,
        -9.0, 11.0, 6.0, -2.0, 6.0, 0.0, -9.0, -8.0, 6.0, -1.0, -9.0, 11.0,
        -4.0, 2.0, 2.0, -4.0, 8.0, -5.0, -1.0, -1.0, -5.0, 8.0, -4.0, 2.0,
        6.0, -2.0, 6.0, 0.0, -9.0, -8.0, 6.0, -1.0, -9.0, 11.0, 6.0, -2.0,
    ];
    assert_f32(&out, &[2, 2, 3, 4], &expected);
}

#[test]
fn conv2d_backward_filter_multi_channel() {
    let case = multi_channel_case();
    let op = Op::Conv2dBackwardFilter {
        attrs: case.attrs,
        kernel_hw: [2, 2],
    };
    let out = eval(op, &[case.x, case.dy]);
    #[rustfmt::skip]
    let expected = [
        -21.0, 30.0, 26.0, 30.0, 30.0, 26.0, 30.0, -21.0,
        26.0, 30.0, -2.0, -10.0, 30.0, -21.0, -10.0, -18.0,
    ];
    assert_f32(&out, &[2, 2, 2, 2], &expected);
}

#[test]
fn conv2d_gradients_with_dilation_and_padding() {
    let attrs = conv([1, 1], [1, 1], [2, 2]);
    let dy = range(&[1, 1, 4, 4], 1.0);
    let w = f32s(&[1, 1, 2, 2], &[1.0, 2.0, 3.0, 4.0]);
    let dx = eval(
        Op::Conv2dBackwardInput {
            attrs,
            input_hw: [4, 4],
        },
        &[dy.clone(), w],
    );
    #[rustfmt::skip]
    let expected_dx = [
        6.0, 17.0, 20.0, 14.0,
        16.0, 42.0, 52.0, 34.0,
        32.0, 82.0, 92.0, 58.0,
        30.0, 69.0, 76.0, 44.0,
    ];
    assert_f32(&dx, &[1, 1, 4, 4], &expected_dx);
    let x = range(&[1, 1, 4, 4], 1.0);
    let dw = eval(
        Op::Conv2dBackwardFilter {
            attrs,
            kernel_hw: [2, 2],
        },
        &[x, dy],
    );
    assert_f32(&dw, &[1, 1, 2, 2], &[696.0, 732.0, 732.0, 696.0]);
}

#[test]
fn pointwise_conv2d_and_its_gradients() {
    // 1×1 kernel: out[n, o] = Σ_c w[o, c] · x[n, c].
    let x = range(&[1, 2, 1, 2], 1.0); // channel 0: [1, 2], channel 1: [3, 4]
    let w = f32s(&[2, 2, 1, 1], &[1.0, 1.0, 2.0, -1.0]);
    let y = eval(Op::Conv2d(Conv2dAttrs::default()), &[x.clone(), w.clone()]);
    assert_f32(&y, &[1, 2, 1, 2], &[4.0, 6.0, -1.0, 0.0]);
    let dy = f32s(&[1, 2, 1, 2], &[1.0, 0.0, 0.0, 1.0]);
    let dx = eval(
        Op::Conv2dBackwardInput {
            attrs: Conv2dAttrs::default(),
            input_hw: [1, 2],
        },
        &[dy.clone(), w],
    );
    assert_f32(&dx, &[1, 2, 1, 2], &[1.0, 2.0, 1.0, -1.0]);
    let dw = eval(
        Op::Conv2dBackwardFilter {
            attrs: Conv2dAttrs::default(),
            kernel_hw: [1, 1],
        },
        &[x, dy],
    );
    assert_f32(&dw, &[2, 2, 1, 1], &[1.0, 3.0, 2.0, 4.0]);
}

#[test]
fn large_conv_batch_matches_per_image_results() {
    // Big enough to split the batch across threads: every image must get
    // the same result as the image computed alone.
    let (n, c, h, w, o) = (16, 3, 20, 20, 8);
    let data: Vec<f32> = (0..n * c * h * w)
        .map(|i| ((i * 13) % 17) as f32 - 8.0)
        .collect();
    let filt: Vec<f32> = (0..o * c * 9).map(|i| ((i * 5) % 9) as f32 - 4.0).collect();
    let attrs = conv([1, 1], [1, 1], [1, 1]);
    let x = f32s(&[n, c, h, w], &data);
    let wv = f32s(&[o, c, 3, 3], &filt);
    let all = eval(Op::Conv2d(attrs), &[x, wv.clone()]);
    let per_image = c * h * w;
    let one = eval(
        Op::Conv2d(attrs),
        &[f32s(&[1, c, h, w], &data[5 * per_image..6 * per_image]), wv],
    );
    let all = all.to_f32_vec().expect("f32");
    let one = one.to_f32_vec().expect("f32");
    assert_eq!(&all[5 * o * h * w..6 * o * h * w], &one[..]);
}

// ---- pooling -----------------------------------------------------------------

#[test]
fn max_pool_takes_the_first_maximum_on_ties() {
    #[rustfmt::skip]
    let x = f32s(&[1, 1, 4, 4], &[
        1.0, 3.0, 3.0, 0.0,
        2.0, 3.0, 0.0, 0.0,
        5.0, 5.0, 1.0, 2.0,
        5.0, 4.0, 2.0, 1.0,
    ]);
    let attrs = pool([2, 2], [2, 2], [0, 0]);
    assert_f32(
        &eval(Op::MaxPool2d(attrs), std::slice::from_ref(&x)),
        &[1, 1, 2, 2],
        &[3.0, 3.0, 5.0, 2.0],
    );
    // Values at the argmax positions (0,1), (0,2), (2,0), (2,3).
    let v = range(&[1, 1, 4, 4], 1.0);
    assert_f32(
        &eval(Op::MaxPool2dSelect(attrs), &[x.clone(), v]),
        &[1, 1, 2, 2],
        &[2.0, 3.0, 9.0, 12.0],
    );
    let dy = f32s(&[1, 1, 2, 2], &[10.0, 20.0, 30.0, 40.0]);
    #[rustfmt::skip]
    let expected = [
        0.0, 10.0, 20.0, 0.0,
        0.0, 0.0, 0.0, 0.0,
        30.0, 0.0, 0.0, 40.0,
        0.0, 0.0, 0.0, 0.0,
    ];
    assert_f32(
        &eval(Op::MaxPool2dBackward(attrs), &[x, dy]),
        &[1, 1, 4, 4],
        &expected,
    );
}

/// 2×2 windows at stride 2 (the CPU reads them two rows at a time): a NaN
/// wins its window, the first of equal maxima wins, and an odd last row and
/// column belong to no window.
#[test]
fn max_pool_two_by_two_takes_nan_and_the_first_maximum_and_skips_an_odd_edge() {
    let nan = f32::NAN;
    #[rustfmt::skip]
    let x = f32s(&[1, 1, 5, 5], &[
        1.0, 2.0,   7.0, 7.0,  99.0,
        nan, 0.0,   7.0, 6.0,  99.0,
        -3.0, -1.0, 4.0, nan,  99.0,
        -2.0, -1.0, nan, 9.0,  99.0,
        99.0, 99.0, 99.0, 99.0, 99.0,
    ]);
    let attrs = pool([2, 2], [2, 2], [0, 0]);
    assert_f32(
        &eval(Op::MaxPool2d(attrs), std::slice::from_ref(&x)),
        &[1, 1, 2, 2],
        &[nan, 7.0, -1.0, nan],
    );
    let dy = f32s(&[1, 1, 2, 2], &[1.0, 2.0, 3.0, 4.0]);
    #[rustfmt::skip]
    let expected = [
        0.0, 0.0, 2.0, 0.0, 0.0,
        1.0, 0.0, 0.0, 0.0, 0.0,
        0.0, 3.0, 0.0, 4.0, 0.0,
        0.0, 0.0, 0.0, 0.0, 0.0,
        0.0, 0.0, 0.0, 0.0, 0.0,
    ];
    assert_f32(
        &eval(Op::MaxPool2dBackward(attrs), &[x, dy]),
        &[1, 1, 5, 5],
        &expected,
    );
}

#[test]
fn max_pool_padding_never_wins() {
    let x = range(&[1, 1, 3, 3], -9.0).to_f32_vec().expect("f32");
    let x: Vec<f32> = x.iter().rev().copied().collect(); // -1, -2, ..., -9
    let x = f32s(&[1, 1, 3, 3], &x);
    let attrs = pool([2, 2], [2, 2], [1, 1]);
    assert_f32(
        &eval(Op::MaxPool2d(attrs), std::slice::from_ref(&x)),
        &[1, 1, 2, 2],
        &[-1.0, -2.0, -4.0, -5.0],
    );
    let dy = f32s(&[1, 1, 2, 2], &[1.0, 2.0, 3.0, 4.0]);
    assert_f32(
        &eval(Op::MaxPool2dBackward(attrs), &[x, dy]),
        &[1, 1, 3, 3],
        &[1.0, 2.0, 0.0, 3.0, 4.0, 0.0, 0.0, 0.0, 0.0],
    );
}

#[test]
fn max_pool_backward_accumulates_over_overlapping_windows() {
    let x = f32s(&[1, 1, 1, 3], &[1.0, 3.0, 2.0]);
    let attrs = pool([1, 2], [1, 1], [0, 0]);
    let dy = f32s(&[1, 1, 1, 2], &[1.0, 2.0]);
    assert_f32(
        &eval(Op::MaxPool2dBackward(attrs), &[x, dy]),
        &[1, 1, 1, 3],
        &[0.0, 3.0, 0.0],
    );
}

#[test]
fn max_pool_over_channels_and_batch() {
    let x = range(&[2, 2, 2, 2], 0.0);
    let out = eval(Op::MaxPool2d(pool([2, 2], [2, 2], [0, 0])), &[x]);
    assert_f32(&out, &[2, 2, 1, 1], &[3.0, 7.0, 11.0, 15.0]);
}

#[test]
fn avg_pool_counts_padding_as_zero() {
    let x = range(&[1, 1, 3, 3], 1.0);
    let attrs = pool([2, 2], [2, 2], [1, 1]);
    assert_f32(
        &eval(Op::AvgPool2d(attrs), &[x]),
        &[1, 1, 2, 2],
        &[0.25, 1.25, 2.75, 7.0],
    );
    let dy = f32s(&[1, 1, 2, 2], &[1.0, 2.0, 3.0, 4.0]);
    let op = Op::AvgPool2dBackward {
        attrs,
        input_hw: [3, 3],
    };
    assert_f32(
        &eval(op, &[dy]),
        &[1, 1, 3, 3],
        &[0.25, 0.5, 0.5, 0.75, 1.0, 1.0, 0.75, 1.0, 1.0],
    );
}

#[test]
fn avg_pool_backward_with_overlapping_windows() {
    let attrs = pool([2, 2], [1, 1], [0, 0]);
    let op = Op::AvgPool2dBackward {
        attrs,
        input_hw: [3, 3],
    };
    let out = eval(op, &[f32s(&[1, 1, 2, 2], &[1.0; 4])]);
    assert_f32(
        &out,
        &[1, 1, 3, 3],
        &[0.25, 0.5, 0.25, 0.5, 1.0, 0.5, 0.25, 0.5, 0.25],
    );
    let x = range(&[1, 1, 3, 3], 1.0);
    assert_f32(
        &eval(Op::AvgPool2d(attrs), &[x]),
        &[1, 1, 2, 2],
        &[3.0, 4.0, 6.0, 7.0],
    );
}

// ---- softmax -----------------------------------------------------------------

#[test]
fn softmax_and_log_softmax_on_the_last_axis() {
    let x = f32s(&[2, 3], &[1.0, 2.0, 3.0, 1001.0, 1002.0, 1003.0]);
    let p = [0.090_030_57, 0.244_728_48, 0.665_240_94];
    assert_f32(
        &eval(Op::Softmax { axis: 1 }, std::slice::from_ref(&x)),
        &[2, 3],
        &[p, p].concat(),
    );
    let lp = [-2.407_606, -1.407_606, -0.407_606];
    assert_f32(
        &eval(Op::LogSoftmax { axis: 1 }, &[x]),
        &[2, 3],
        &[lp, lp].concat(),
    );
}

#[test]
fn softmax_along_a_strided_axis() {
    // Columns [1, 3] and [2, 5].
    let x = f32s(&[2, 2], &[1.0, 2.0, 3.0, 5.0]);
    assert_f32(
        &eval(Op::Softmax { axis: 0 }, std::slice::from_ref(&x)),
        &[2, 2],
        &[0.119_202_92, 0.047_425_87, 0.880_797_1, 0.952_574_1],
    );
    assert_f32(
        &eval(Op::LogSoftmax { axis: 0 }, &[x]),
        &[2, 2],
        &[-2.126_928, -3.048_587_4, -0.126_928, -0.048_587_35],
    );
}

// ---- index ops -----------------------------------------------------------------

#[test]
fn gather_along_axis_0_and_1() {
    let data = range(&[3, 2], 0.0); // [[0,1],[2,3],[4,5]]
    let rows = eval(
        Op::Gather { axis: 0 },
        &[data.clone(), i64s(&[2, 2], &[2, 0, 1, 2])],
    );
    assert_f32(&rows, &[2, 2, 2], &[4.0, 5.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
    let cols = eval(Op::Gather { axis: 1 }, &[data, i32s(&[3], &[1, 1, 0])]);
    assert_f32(
        &cols,
        &[3, 3],
        &[1.0, 1.0, 0.0, 3.0, 3.0, 2.0, 5.0, 5.0, 4.0],
    );
    let ints = eval(
        Op::Gather { axis: 0 },
        &[i64s(&[3], &[7, 8, 9]), i64s(&[], &[2])],
    );
    assert_eq!(ints, i64s(&[], &[9]));
}

#[test]
fn gather_out_of_range_is_an_error() {
    let data = range(&[2, 3], 0.0);
    let err = eval_err(Op::Gather { axis: 1 }, &[data.clone(), i64s(&[2], &[0, 3])]);
    let out_of_range = KernelError::IndexOutOfRange {
        index: 3,
        axis: 1,
        len: 3,
    };
    assert_eq!(err, out_of_range);
    let err = eval_err(Op::Gather { axis: 0 }, &[data, i32s(&[1], &[-1])]);
    let out_of_range = KernelError::IndexOutOfRange {
        index: -1,
        axis: 0,
        len: 2,
    };
    assert_eq!(err, out_of_range);
}

#[test]
fn scatter_add_along_axis_1_sums_duplicates() {
    let indices = i64s(&[3], &[2, 0, 2]);
    let updates = range(&[2, 3], 1.0); // [[1,2,3],[4,5,6]]
    let out = eval(
        Op::ScatterAdd {
            axis: 1,
            dim_size: 4,
        },
        &[indices, updates],
    );
    assert_f32(&out, &[2, 4], &[2.0, 0.0, 4.0, 0.0, 5.0, 0.0, 10.0, 0.0]);
}

#[test]
fn scatter_add_along_axis_0_with_multi_dim_indices() {
    let indices = i32s(&[2, 2], &[1, 1, 0, 1]);
    let updates = range(&[2, 2, 2], 1.0);
    let out = eval(
        Op::ScatterAdd {
            axis: 0,
            dim_size: 3,
        },
        &[indices, updates],
    );
    // Row 1 gets [1,2] + [3,4] + [7,8]; row 0 gets [5,6].
    assert_f32(&out, &[3, 2], &[5.0, 6.0, 11.0, 14.0, 0.0, 0.0]);
}

#[test]
fn scatter_add_out_of_range_is_an_error() {
    let err = eval_err(
        Op::ScatterAdd {
            axis: 1,
            dim_size: 2,
        },
        &[i64s(&[2], &[0, 2]), range(&[1, 2], 0.0)],
    );
    let out_of_range = KernelError::IndexOutOfRange {
        index: 2,
        axis: 1,
        len: 2,
    };
    assert_eq!(err, out_of_range);
}

#[test]
fn one_hot_leaves_out_of_range_rows_zero() {
    let out = eval(Op::OneHot { depth: 3 }, &[i64s(&[2, 2], &[0, 2, 3, -1])]);
    #[rustfmt::skip]
    let expected = [
        1.0, 0.0, 0.0,   0.0, 0.0, 1.0,
        0.0, 0.0, 0.0,   0.0, 0.0, 0.0,
    ];
    assert_f32(&out, &[2, 2, 3], &expected);
    let out = eval(Op::OneHot { depth: 2 }, &[i32s(&[1], &[1])]);
    assert_f32(&out, &[1, 2], &[0.0, 1.0]);
}

// ---- random --------------------------------------------------------------------

#[test]
fn random_uniform_follows_the_splitmix64_recipe() {
    let op = Op::RandomUniform {
        shape: vec![Dim::Fixed(2), Dim::Fixed(3)],
    };
    let out = eval(op, &[i64s(&[], &[42])]);
    assert_f32(
        &out,
        &[2, 3],
        &[
            0.741_564_87,
            0.159_910_38,
            0.278_601_1,
            0.344_190_66,
            0.038_030_148,
            0.868_228,
        ],
    );
    let op = Op::RandomUniform {
        shape: vec![Dim::Fixed(3)],
    };
    assert_f32(
        &eval(op, &[i64s(&[], &[-7])]),
        &[3],
        &[0.422_334_2, 0.478_636_98, 0.907_001_4],
    );
}

#[test]
fn random_uniform_binds_the_batch_dimension() {
    let mut g = Graph::new();
    let x = g
        .input(
            "x",
            TensorType::new(DType::F32, Shape(vec![Dim::Batch, Dim::Fixed(2)])),
        )
        .expect("input");
    let seed = g
        .input("seed", TensorType::scalar(DType::I64))
        .expect("seed");
    let noise = g
        .push(
            Op::RandomUniform {
                shape: vec![Dim::Batch, Dim::Fixed(2)],
            },
            &[seed],
        )
        .expect("random");
    let y = g.add(x, noise).expect("add");
    g.set_output("y", y).expect("output");
    let out = CpuBackend
        .compile(&g)
        .expect("compile")
        .run(vec![f32s(&[3, 2], &[0.0; 6]), i64s(&[], &[42])])
        .expect("run");
    assert_eq!(out[0].shape(), &[3, 2]);
    let values = out[0].to_f32_vec().expect("f32");
    assert!((values[0] - 0.741_564_87).abs() < 1e-6);
    assert!(values.iter().all(|v| (0.0..1.0).contains(v)));
}

#[test]
fn transpose_of_large_and_batched_matrices() {
    // Larger than one tile in both directions, with ragged edges.
    let (rows, cols) = (45, 70);
    let x = range(&[rows, cols], 0.0);
    let out = eval(Op::Transpose { perm: vec![1, 0] }, &[x]);
    let expected: Vec<f32> = (0..cols)
        .flat_map(|c| (0..rows).map(move |r| (r * cols + c) as f32))
        .collect();
    assert_f32(&out, &[cols, rows], &expected);
    let batched = eval(
        Op::Transpose {
            perm: vec![0, 2, 1],
        },
        &[range(&[2, 2, 3], 0.0)],
    );
    assert_f32(
        &batched,
        &[2, 3, 2],
        &[0.0, 3.0, 1.0, 4.0, 2.0, 5.0, 6.0, 9.0, 7.0, 10.0, 8.0, 11.0],
    );
}

#[test]
fn degenerate_shapes_give_empty_or_zero_results() {
    let plain = Op::MatMul {
        transpose_a: false,
        transpose_b: false,
    };
    let out = eval(plain, &[f32s(&[0, 3], &[]), f32s(&[3, 2], &[0.0; 6])]);
    assert_f32(&out, &[0, 2], &[]);
    // No input channels: every output is an empty sum.
    let out = eval(
        Op::Conv2d(Conv2dAttrs::default()),
        &[f32s(&[1, 0, 2, 2], &[]), f32s(&[2, 0, 1, 1], &[])],
    );
    assert_f32(&out, &[1, 2, 2, 2], &[0.0; 8]);
    let out = eval(reduce(ReduceKind::Sum, &[1], false), &[f32s(&[2, 0], &[])]);
    assert_f32(&out, &[2], &[0.0, 0.0]);
    let out = eval(reduce(ReduceKind::Mean, &[1], false), &[f32s(&[1, 0], &[])]);
    assert_f32(&out, &[1], &[f32::NAN]);
    let out = eval(
        Op::MaxPool2d(pool([2, 2], [2, 2], [0, 0])),
        &[f32s(&[0, 1, 2, 2], &[])],
    );
    assert_f32(&out, &[0, 1, 1, 1], &[]);
    let out = eval(
        Op::Gather { axis: 0 },
        &[range(&[2, 2], 0.0), i64s(&[0], &[])],
    );
    assert_f32(&out, &[0, 2], &[]);
}

// ---- argmax ------------------------------------------------------------------

#[test]
fn argmax_takes_the_first_maximum_and_nan_wins() {
    let x = f32s(
        &[2, 4],
        &[
            1.0,
            3.0,
            3.0,
            -1.0,
            f32::NEG_INFINITY,
            2.0,
            f32::NAN,
            f32::NAN,
        ],
    );
    let out = eval(
        Op::ArgMax {
            axis: 1,
            keep_dims: false,
        },
        std::slice::from_ref(&x),
    );
    assert_eq!(out, Value::i64(&[2], vec![1, 2]).unwrap());
    let out = eval(
        Op::ArgMax {
            axis: 0,
            keep_dims: true,
        },
        std::slice::from_ref(&x),
    );
    assert_eq!(out, Value::i64(&[1, 4], vec![0, 0, 1, 1]).unwrap());
}

#[test]
fn argmax_of_a_middle_axis_keeps_the_others_in_order() {
    let data: Vec<f32> = (0..24).map(|i| ((i * 7) % 11) as f32).collect();
    let x = f32s(&[2, 3, 4], &data);
    let out = eval(
        Op::ArgMax {
            axis: 1,
            keep_dims: true,
        },
        std::slice::from_ref(&x),
    );
    // By hand: for each (outer, inner) the middle index of the largest.
    let mut want = Vec::new();
    for outer in 0..2 {
        for inner in 0..4 {
            let lane: Vec<f32> = (0..3).map(|j| data[(outer * 3 + j) * 4 + inner]).collect();
            let best = (0..3).fold(0, |b, j| if lane[j] > lane[b] { j } else { b });
            want.push(best as i64);
        }
    }
    assert_eq!(out, Value::i64(&[2, 1, 4], want).unwrap());
}
