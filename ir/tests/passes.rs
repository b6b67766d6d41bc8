//! Each optimisation pass on its own, on small hand-built graphs, with
//! exact assertions on the resulting structure; then the pipeline.

use std::cell::RefCell;

use canopy_ir::passes::{
    ConstEvaluator, eliminate_common_subexpressions, eliminate_dead_code, fold_constants, optimize,
    optimize_with_report, simplify,
};
use canopy_ir::verify::verify;
use canopy_ir::{
    BinaryOp, DType, Dim, Graph, IrResult, Op, ReduceKind, TensorData, TensorType, UnaryOp, ValueId,
};

type R = IrResult<()>;

fn f32s(dims: &[usize]) -> TensorType {
    TensorType::f32(dims)
}

fn count(g: &Graph, op: &str) -> usize {
    g.op_counts().get(op).copied().unwrap_or(0)
}

fn out(g: &Graph) -> ValueId {
    g.outputs()[0].1
}

/// Checks the invariants every pass promises: it verifies, and inputs and
/// outputs keep their names, order and types.
fn assert_same_signature(before: &Graph, after: &Graph) {
    verify(after).expect("pass output verifies");
    let sig = |g: &Graph| -> Vec<(String, TensorType)> {
        g.inputs()
            .iter()
            .map(|&i| (g.input_name(i).to_string(), g.ty(i).clone()))
            .collect()
    };
    assert_eq!(sig(before), sig(after));
    let outs = |g: &Graph| -> Vec<(String, TensorType)> {
        g.outputs()
            .iter()
            .map(|(n, v)| (n.clone(), g.ty(*v).clone()))
            .collect()
    };
    assert_eq!(outs(before), outs(after));
}

// ---- dead-code elimination ----------------------------------------------

#[test]
fn dce_drops_unreachable_chain_and_keeps_unused_inputs() -> R {
    let mut g = Graph::new();
    let x = g.input("x", f32s(&[2]))?;
    g.input("unused", f32s(&[3]))?;
    let dead = g.exp(x)?;
    let dead = g.log(dead)?;
    g.neg(dead)?;
    let y = g.relu(x)?;
    g.set_output("y", y)?;
    let d = eliminate_dead_code(&g)?;
    assert_same_signature(&g, &d);
    assert_eq!(d.len(), 3);
    assert_eq!(count(&d, "input"), 2);
    assert_eq!(count(&d, "relu"), 1);
    assert_eq!(d.input_names(), vec!["x", "unused"]);
    Ok(())
}

#[test]
fn dce_keeps_shared_nodes_and_outputs_that_are_inputs() -> R {
    let mut g = Graph::new();
    let x = g.input("x", f32s(&[2]))?;
    let e = g.exp(x)?;
    let a = g.add(e, e)?;
    let m = g.mul(e, a)?;
    g.relu(m)?; // dead
    g.set_output("a", a)?;
    g.set_output("m", m)?;
    g.set_output("x", x)?;
    let d = eliminate_dead_code(&g)?;
    assert_same_signature(&g, &d);
    assert_eq!(d.len(), 4);
    assert_eq!(d.find_output("x"), Some(d.inputs()[0]));
    // Nothing dead: the graph is returned as is.
    assert_eq!(eliminate_dead_code(&d)?, d);
    Ok(())
}

// ---- common-subexpression elimination -----------------------------------

#[test]
fn cse_merges_duplicated_subtrees() -> R {
    let mut g = Graph::new();
    let x = g.input("x", f32s(&[2, 3]))?;
    let c1 = g.scalar(2.0)?;
    let c2 = g.scalar(2.0)?;
    let a1 = g.mul(x, c1)?;
    let a1 = g.exp(a1)?;
    let b1 = g.sum(a1, &[1], false)?;
    let a2 = g.mul(x, c2)?;
    let a2 = g.exp(a2)?;
    let b2 = g.sum(a2, &[1], false)?;
    let y = g.add(b1, b2)?;
    g.set_output("y", y)?;
    g.set_output("b2", b2)?;
    let c = eliminate_common_subexpressions(&g)?;
    assert_same_signature(&g, &c);
    assert_eq!(c.len(), 6);
    for op in ["constant", "mul", "exp", "sum", "add"] {
        assert_eq!(count(&c, op), 1, "{op}");
    }
    let add = c.node(out(&c));
    assert_eq!(add.inputs[0], add.inputs[1]);
    assert_eq!(c.find_output("b2"), Some(add.inputs[0]));
    Ok(())
}

#[test]
fn cse_does_not_merge_different_attributes() -> R {
    let mut g = Graph::new();
    let x = g.input("x", f32s(&[2, 2]))?;
    let s0 = g.sum(x, &[0], false)?;
    let s1 = g.sum(x, &[1], false)?;
    let m0 = g.reduce(ReduceKind::Max, x, &[0], false)?;
    let k0 = g.sum(x, &[0], true)?;
    let k0 = g.reshape(k0, vec![Dim::Fixed(2)])?;
    let t1 = g.transpose(x, vec![1, 0])?;
    let t2 = g.transpose(x, vec![1, 0])?;
    let mm = g.matmul_t(t1, t2, true, false)?;
    let mm2 = g.matmul_t(t1, t2, false, true)?;
    let a = g.add(s0, s1)?;
    let a = g.add(a, m0)?;
    let a = g.add(a, k0)?;
    let b = g.add(mm, mm2)?;
    g.set_output("a", a)?;
    g.set_output("b", b)?;
    let c = eliminate_common_subexpressions(&g)?;
    assert_same_signature(&g, &c);
    assert_eq!(count(&c, "sum"), 3);
    assert_eq!(count(&c, "max"), 1);
    assert_eq!(count(&c, "matmul"), 2);
    assert_eq!(
        count(&c, "transpose"),
        1,
        "only the identical transposes merge"
    );
    assert_eq!(c.len(), g.len() - 1);
    Ok(())
}

#[test]
fn cse_compares_constants_bitwise() -> R {
    let nan_a = f32::from_bits(0x7fc0_0000);
    let nan_b = f32::from_bits(0x7fc0_0001);
    let mut g = Graph::new();
    let x = g.input("x", f32s(&[]))?;
    let mut sum = x;
    for v in [nan_a, nan_a, nan_b, 0.0, -0.0, 1.0, 1.0] {
        let c = g.scalar(v)?;
        sum = g.add(sum, c)?;
    }
    // Same value, different shape: not the same constant.
    let shaped = g.constant(TensorData::f32(vec![1], vec![1.0]).expect("shape fits"))?;
    let sum = g.add(sum, shaped)?;
    g.set_output("y", sum)?;
    let c = eliminate_common_subexpressions(&g)?;
    assert_same_signature(&g, &c);
    // nan_a, nan_b, +0, -0, 1 (scalar) and 1 (shape [1]).
    assert_eq!(count(&c, "constant"), 6);
    assert_eq!(count(&c, "add"), 8, "adds read different partial sums");
    Ok(())
}

#[test]
fn cse_never_merges_inputs_but_merges_seeded_randoms() -> R {
    let mut g = Graph::new();
    let x = g.input("x", f32s(&[2]))?;
    let z = g.input("z", f32s(&[2]))?;
    let seed = g.input("seed", TensorType::scalar(DType::I64))?;
    let r1 = g.push(
        Op::RandomUniform {
            shape: vec![Dim::Fixed(2)],
        },
        &[seed],
    )?;
    let r2 = g.push(
        Op::RandomUniform {
            shape: vec![Dim::Fixed(2)],
        },
        &[seed],
    )?;
    let r3 = g.push(
        Op::RandomUniform {
            shape: vec![Dim::Fixed(3)],
        },
        &[seed],
    )?;
    let a = g.add(x, r1)?;
    let b = g.add(z, r2)?;
    let y = g.mul(a, b)?;
    g.set_output("y", y)?;
    g.set_output("r3", r3)?;
    let c = eliminate_common_subexpressions(&g)?;
    assert_same_signature(&g, &c);
    assert_eq!(count(&c, "input"), 3);
    assert_eq!(count(&c, "random_uniform"), 2);
    assert_eq!(count(&c, "add"), 2);
    Ok(())
}

// ---- simplification -----------------------------------------------------

/// Builds `op(x, c)` (or `op(c, x)` when `const_first`) for x: f32[2, 3]
/// and the given constant, simplifies, and returns (before, after).
fn binary_case(op: BinaryOp, c: TensorData, const_first: bool) -> IrResult<(Graph, Graph)> {
    let mut g = Graph::new();
    let x = g.input("x", f32s(&[2, 3]))?;
    let c = g.constant(c)?;
    let (a, b) = if const_first { (c, x) } else { (x, c) };
    let y = g.binary(op, a, b)?;
    g.set_output("y", y)?;
    let s = simplify(&g)?;
    assert_same_signature(&g, &s);
    Ok((g, s))
}

fn full(dims: &[usize], v: f32) -> TensorData {
    let n = dims.iter().product();
    TensorData::f32(dims.to_vec(), vec![v; n]).expect("shape fits")
}

#[test]
fn simplify_removes_binary_identities() -> R {
    let cases = [
        (BinaryOp::Mul, 1.0, false),
        (BinaryOp::Mul, 1.0, true),
        (BinaryOp::Add, 0.0, false),
        (BinaryOp::Add, 0.0, true),
        (BinaryOp::Add, -0.0, false),
        (BinaryOp::Sub, 0.0, false),
        (BinaryOp::Div, 1.0, false),
    ];
    for (op, v, const_first) in cases {
        // Scalars, rank-broadcast and full-shape constants all keep x's type.
        for dims in [&[][..], &[3][..], &[1, 3][..], &[2, 3][..]] {
            let (_, s) = binary_case(op, full(dims, v), const_first)?;
            assert_eq!(out(&s), s.inputs()[0], "{op:?} {v} {dims:?} {const_first}");
            assert_eq!(s.len(), 2, "the identity node is gone");
        }
    }
    Ok(())
}

#[test]
fn simplify_keeps_non_identities() -> R {
    let cases = [
        (BinaryOp::Mul, 0.0, false), // x*0 is not 0 for NaN or inf
        (BinaryOp::Mul, 2.0, false),
        (BinaryOp::Sub, 0.0, true), // 0-x
        (BinaryOp::Div, 1.0, true), // 1/x
        (BinaryOp::Add, 1.0, false),
        (BinaryOp::Pow, 1.0, false),
        (BinaryOp::Maximum, 0.0, false),
    ];
    for (op, v, const_first) in cases {
        let (g, s) = binary_case(op, full(&[], v), const_first)?;
        assert_eq!(s, g, "{op:?} {v} {const_first}");
    }
    // Not all elements are the identity.
    let mixed = TensorData::f32(vec![3], vec![1.0, 1.0, 2.0]).expect("shape fits");
    let (g, s) = binary_case(BinaryOp::Mul, mixed, false)?;
    assert_eq!(s, g);
    Ok(())
}

#[test]
fn simplify_does_not_drop_a_broadcasting_identity() -> R {
    // x: [3] times ones: [2, 3] has type [2, 3]; x alone would change it.
    let mut g = Graph::new();
    let x = g.input("x", f32s(&[3]))?;
    let ones = g.constant(full(&[2, 3], 1.0))?;
    let zeros = g.constant(full(&[2, 3], 0.0))?;
    let a = g.mul(x, ones)?;
    let b = g.add(zeros, x)?;
    let y = g.add(a, b)?;
    g.set_output("y", y)?;
    let s = simplify(&g)?;
    assert_same_signature(&g, &s);
    assert_eq!(s, g);
    Ok(())
}

#[test]
fn simplify_integer_identities() -> R {
    let mut g = Graph::new();
    let x = g.input(
        "x",
        TensorType::new(DType::I64, canopy_ir::Shape::fixed(&[4])),
    )?;
    let one = g.constant(TensorData::scalar_i64(1))?;
    let zero = g.constant(TensorData::scalar_i64(0))?;
    let a = g.mul(x, one)?;
    let b = g.add(a, zero)?;
    g.set_output("y", b)?;
    let s = simplify(&g)?;
    assert_same_signature(&g, &s);
    assert_eq!(out(&s), s.inputs()[0]);
    Ok(())
}

/// One input x of type `ty`, `build(g, x)` as the output; returns the
/// simplified graph.
fn unary_case(
    ty: TensorType,
    build: impl FnOnce(&mut Graph, ValueId) -> IrResult<ValueId>,
) -> IrResult<Graph> {
    let mut g = Graph::new();
    let x = g.input("x", ty)?;
    let y = build(&mut g, x)?;
    g.set_output("y", y)?;
    let s = simplify(&g)?;
    assert_same_signature(&g, &s);
    Ok(s)
}

fn simplifies_to_input(s: &Graph) -> bool {
    out(s) == s.inputs()[0]
}

#[test]
fn simplify_neg_neg() -> R {
    let s = unary_case(f32s(&[2]), |g, x| {
        let n = g.neg(x)?;
        g.neg(n)
    })?;
    assert!(simplifies_to_input(&s));
    // A triple negation keeps one.
    let s = unary_case(f32s(&[2]), |g, x| {
        let n = g.neg(x)?;
        let n = g.neg(n)?;
        g.neg(n)
    })?;
    let y = s.node(out(&s));
    assert_eq!(y.op, Op::Unary(UnaryOp::Neg));
    assert_eq!(y.inputs, vec![s.inputs()[0]]);
    Ok(())
}

#[test]
fn simplify_keeps_exp_log() -> R {
    let s = unary_case(f32s(&[2]), |g, x| {
        let l = g.log(x)?;
        g.exp(l)
    })?;
    assert_eq!(s.len(), 3);
    assert_eq!(s.node(out(&s)).op, Op::Unary(UnaryOp::Exp));
    Ok(())
}

#[test]
fn simplify_transposes() -> R {
    // Identity perm.
    let s = unary_case(f32s(&[2, 3]), |g, x| g.transpose(x, vec![0, 1]))?;
    assert!(simplifies_to_input(&s));
    // Two transposes composing to the identity.
    let s = unary_case(f32s(&[2, 3, 4]), |g, x| {
        let t = g.transpose(x, vec![1, 2, 0])?;
        g.transpose(t, vec![2, 0, 1])
    })?;
    assert!(simplifies_to_input(&s));
    // Two transposes composing to one: [2,3,4] → [3,2,4] → [3,4,2].
    let s = unary_case(f32s(&[2, 3, 4]), |g, x| {
        let t = g.transpose(x, vec![1, 0, 2])?;
        g.transpose(t, vec![0, 2, 1])
    })?;
    let y = s.node(out(&s));
    assert_eq!(
        y.op,
        Op::Transpose {
            perm: vec![1, 2, 0]
        }
    );
    assert_eq!(y.inputs, vec![s.inputs()[0]]);
    assert_eq!(y.ty, f32s(&[3, 4, 2]));
    // Three transposes collapse in one call.
    let s = unary_case(f32s(&[2, 3, 4]), |g, x| {
        let t = g.transpose(x, vec![1, 0, 2])?;
        let t = g.transpose(t, vec![0, 2, 1])?;
        g.transpose(t, vec![2, 1, 0])
    })?;
    let y = s.node(out(&s));
    assert_eq!(
        y.op,
        Op::Transpose {
            perm: vec![0, 2, 1]
        }
    );
    assert_eq!(y.inputs, vec![s.inputs()[0]]);
    Ok(())
}

#[test]
fn simplify_reshapes() -> R {
    let fixed = |d: &[usize]| d.iter().map(|&n| Dim::Fixed(n)).collect::<Vec<_>>();
    let s = unary_case(f32s(&[2, 3]), |g, x| g.reshape(x, fixed(&[2, 3])))?;
    assert!(simplifies_to_input(&s));
    let s = unary_case(f32s(&[2, 3]), |g, x| {
        let r = g.reshape(x, fixed(&[6]))?;
        g.reshape(r, fixed(&[2, 3]))
    })?;
    assert!(simplifies_to_input(&s));
    let s = unary_case(f32s(&[2, 3]), |g, x| {
        let r = g.reshape(x, fixed(&[6]))?;
        let r = g.reshape(r, fixed(&[1, 6]))?;
        g.reshape(r, fixed(&[3, 2]))
    })?;
    let y = s.node(out(&s));
    assert_eq!(
        y.op,
        Op::Reshape {
            shape: fixed(&[3, 2])
        }
    );
    assert_eq!(y.inputs, vec![s.inputs()[0]]);
    // With a batch dimension.
    let batched = TensorType::new(DType::F32, vec![Dim::Batch, Dim::Fixed(6)]);
    let s = unary_case(batched, |g, x| {
        let r = g.reshape(x, vec![Dim::Batch, Dim::Fixed(2), Dim::Fixed(3)])?;
        g.reshape(r, vec![Dim::Batch, Dim::Fixed(6)])
    })?;
    assert!(simplifies_to_input(&s));
    Ok(())
}

#[test]
fn simplify_broadcast_cast_and_reductions() -> R {
    let batched = TensorType::new(DType::F32, vec![Dim::Batch, Dim::Fixed(3)]);
    let s = unary_case(batched, |g, x| {
        g.broadcast(x, vec![Dim::Batch, Dim::Fixed(3)])
    })?;
    assert!(simplifies_to_input(&s));
    let s = unary_case(f32s(&[3]), |g, x| {
        g.broadcast(x, vec![Dim::Fixed(2), Dim::Fixed(3)])
    })?;
    assert_eq!(count(&s, "broadcast"), 1);
    let s = unary_case(f32s(&[3]), |g, x| g.cast(x, DType::F32))?;
    assert!(simplifies_to_input(&s));
    let s = unary_case(f32s(&[3]), |g, x| g.cast(x, DType::I32))?;
    assert_eq!(count(&s, "cast"), 1);
    for kind in [ReduceKind::Sum, ReduceKind::Mean, ReduceKind::Max] {
        for keep in [false, true] {
            let s = unary_case(f32s(&[2, 3]), |g, x| g.reduce(kind, x, &[], keep))?;
            assert!(simplifies_to_input(&s), "{kind:?} {keep}");
        }
    }
    let s = unary_case(f32s(&[2, 3]), |g, x| g.sum(x, &[0], true))?;
    assert_eq!(count(&s, "sum"), 1);
    Ok(())
}

#[test]
fn simplify_slice_pad_concat_identities() -> R {
    let s = unary_case(f32s(&[2, 3]), |g, x| {
        g.push(
            Op::Slice {
                axis: 1,
                start: 0,
                end: 3,
            },
            &[x],
        )
    })?;
    assert!(simplifies_to_input(&s));
    let s = unary_case(f32s(&[2, 3]), |g, x| {
        g.push(
            Op::Slice {
                axis: 1,
                start: 1,
                end: 3,
            },
            &[x],
        )
    })?;
    assert_eq!(count(&s, "slice"), 1);
    let s = unary_case(f32s(&[2, 3]), |g, x| {
        g.push(
            Op::Pad {
                axis: 0,
                before: 0,
                after: 0,
            },
            &[x],
        )
    })?;
    assert!(simplifies_to_input(&s));
    let s = unary_case(f32s(&[2, 3]), |g, x| g.push(Op::Concat { axis: 0 }, &[x]))?;
    assert!(simplifies_to_input(&s));
    Ok(())
}

#[test]
fn simplify_absorbs_transposes_into_matmul() -> R {
    let mut g = Graph::new();
    let a = g.input("a", f32s(&[5, 3, 2]))?;
    let b = g.input("b", f32s(&[5, 4, 3]))?;
    let at = g.transpose(a, vec![0, 2, 1])?; // [5, 2, 3]
    let bt = g.transpose(b, vec![0, 2, 1])?; // [5, 3, 4]
    let y = g.matmul(at, bt)?; // [5, 2, 4]
    let z = g.matmul_t(at, b, false, true)?; // bᵀ given by flag
    g.set_output("y", y)?;
    g.set_output("z", z)?;
    let s = simplify(&g)?;
    assert_same_signature(&g, &s);
    let y = s.node(s.find_output("y").expect("y"));
    assert_eq!(
        y.op,
        Op::MatMul {
            transpose_a: true,
            transpose_b: true
        }
    );
    assert_eq!(y.inputs, vec![s.inputs()[0], s.inputs()[1]]);
    let z = s.node(s.find_output("z").expect("z"));
    assert_eq!(
        z.op,
        Op::MatMul {
            transpose_a: true,
            transpose_b: true
        }
    );
    assert_eq!(z.inputs, vec![s.inputs()[0], s.inputs()[1]]);
    // A transposed operand already flagged: the flags cancel.
    let mut g = Graph::new();
    let a = g.input("a", f32s(&[2, 3]))?;
    let b = g.input("b", f32s(&[3, 4]))?;
    let at = g.transpose(a, vec![1, 0])?;
    let y = g.matmul_t(at, b, true, false)?;
    g.set_output("y", y)?;
    let s = simplify(&g)?;
    let y = s.node(out(&s));
    assert_eq!(
        y.op,
        Op::MatMul {
            transpose_a: false,
            transpose_b: false
        }
    );
    assert_eq!(y.inputs, vec![s.inputs()[0], s.inputs()[1]]);
    Ok(())
}

#[test]
fn simplify_keeps_batch_axis_transposes_in_matmul() -> R {
    // perm [1, 0, 2] swaps batch axes, not the matrix axes.
    let mut g = Graph::new();
    let a = g.input("a", f32s(&[3, 5, 2]))?;
    let b = g.input("b", f32s(&[5, 2, 4]))?;
    let at = g.transpose(a, vec![1, 0, 2])?;
    let y = g.matmul(at, b)?;
    g.set_output("y", y)?;
    let s = simplify(&g)?;
    assert_eq!(s, g);
    Ok(())
}

#[test]
fn simplify_preserves_unused_inputs_and_output_types() -> R {
    let mut g = Graph::new();
    let x = g.input("x", f32s(&[2]))?;
    g.input("unused", TensorType::scalar(DType::Bool))?;
    let one = g.scalar(1.0)?;
    let y = g.mul(x, one)?;
    g.set_output("y", y)?;
    g.set_output("also_y", y)?;
    let s = simplify(&g)?;
    assert_same_signature(&g, &s);
    assert_eq!(s.find_output("also_y"), Some(s.inputs()[0]));
    Ok(())
}

// ---- constant folding ---------------------------------------------------

/// Folds f32 Add and Mul with scalar broadcasting; records every call.
#[derive(Default)]
struct AddMul {
    calls: RefCell<Vec<&'static str>>,
}

impl ConstEvaluator for AddMul {
    fn eval(&self, op: &Op, inputs: &[&TensorData], out_ty: &TensorType) -> Option<TensorData> {
        self.calls.borrow_mut().push(op.name());
        let f: fn(f32, f32) -> f32 = match op {
            Op::Binary(BinaryOp::Add) => |a, b| a + b,
            Op::Binary(BinaryOp::Mul) => |a, b| a * b,
            _ => return None,
        };
        let (a, b) = (inputs[0].as_f32()?, inputs[1].as_f32()?);
        let shape = out_ty.shape.as_fixed()?;
        let n: usize = shape.iter().product();
        let at = |v: &[f32], i: usize| {
            if v.len() == 1 {
                Some(v[0])
            } else {
                v.get(i).copied()
            }
        };
        let values = (0..n)
            .map(|i| Some(f(at(a, i)?, at(b, i)?)))
            .collect::<Option<Vec<f32>>>()?;
        TensorData::f32(shape, values)
    }
}

#[test]
fn fold_collapses_constant_chains() -> R {
    let mut g = Graph::new();
    let x = g.input("x", f32s(&[]))?;
    let c2 = g.scalar(2.0)?;
    let c3 = g.scalar(3.0)?;
    let c4 = g.scalar(4.0)?;
    let five = g.add(c2, c3)?;
    let twenty = g.mul(five, c4)?;
    let y = g.add(x, twenty)?;
    g.set_output("y", y)?;
    let ev = AddMul::default();
    let f = fold_constants(&g, &ev, 16)?;
    assert_same_signature(&g, &f);
    assert_eq!(f.len(), g.len());
    assert_eq!(count(&f, "constant"), 5);
    assert_eq!(count(&f, "mul"), 0);
    assert_eq!(count(&f, "add"), 1);
    let y = f.node(out(&f));
    let Op::Constant(data) = &f.node(y.inputs[1]).op else {
        panic!("the operand is folded");
    };
    assert_eq!(data.scalar_value_f32(), Some(20.0));
    assert_eq!(
        *ev.calls.borrow(),
        vec!["add", "mul"],
        "x + 20 is not evaluated"
    );
    Ok(())
}

#[test]
fn fold_respects_max_elements() -> R {
    let build = || -> IrResult<Graph> {
        let mut g = Graph::new();
        let a = g.constant(full(&[4], 1.0))?;
        let b = g.constant(full(&[4], 2.0))?;
        let y = g.add(a, b)?;
        g.set_output("y", y)?;
        Ok(g)
    };
    let g = build()?;
    let ev = AddMul::default();
    assert_eq!(fold_constants(&g, &ev, 3)?, g);
    assert!(
        ev.calls.borrow().is_empty(),
        "oversized nodes are not even evaluated"
    );
    let f = fold_constants(&g, &ev, 4)?;
    assert_eq!(count(&f, "add"), 0);
    let Op::Constant(data) = &f.node(out(&f)).op else {
        panic!("folded");
    };
    assert_eq!(data.as_f32(), Some(&[3.0f32; 4][..]));
    Ok(())
}

#[test]
fn fold_skips_batch_typed_nodes_and_unsupported_ops() -> R {
    let mut g = Graph::new();
    let x = g.input(
        "x",
        TensorType::new(DType::F32, vec![Dim::Batch, Dim::Fixed(2)]),
    )?;
    let c = g.constant(full(&[2], 1.0))?;
    let b = g.broadcast(c, vec![Dim::Batch, Dim::Fixed(2)])?;
    let e = g.exp(c)?; // the evaluator declines exp
    let y = g.add(x, b)?;
    let y = g.add(y, e)?;
    g.set_output("y", y)?;
    let ev = AddMul::default();
    let f = fold_constants(&g, &ev, 1 << 20)?;
    assert_eq!(f, g);
    assert_eq!(*ev.calls.borrow(), vec!["exp"]);
    Ok(())
}

/// Returns a scalar whatever it is asked: a faulty evaluator.
struct Wrong;

impl ConstEvaluator for Wrong {
    fn eval(&self, _: &Op, _: &[&TensorData], _: &TensorType) -> Option<TensorData> {
        Some(TensorData::scalar_f32(0.0))
    }
}

#[test]
fn fold_ignores_results_of_the_wrong_type() -> R {
    let mut g = Graph::new();
    let a = g.constant(full(&[2], 1.0))?;
    let y = g.add(a, a)?;
    g.set_output("y", y)?;
    assert_eq!(fold_constants(&g, &Wrong, 16)?, g);
    Ok(())
}

// ---- the pipeline -------------------------------------------------------

/// A graph with dead code, identities, a foldable constant, a double
/// negation, a transpose pair and a duplicate exp.
fn messy_graph() -> IrResult<Graph> {
    let mut g = Graph::new();
    let x = g.input("x", f32s(&[2, 3]))?;
    g.input("unused", f32s(&[4]))?;
    let one = g.scalar(1.0)?;
    let two = g.scalar(2.0)?;
    let three = g.scalar(3.0)?;
    let five = g.add(two, three)?;
    let a = g.mul(x, one)?;
    let n = g.neg(a)?;
    let n = g.neg(n)?;
    let e1 = g.exp(n)?;
    let e2 = g.exp(x)?;
    let s = g.add(e1, e2)?;
    let t = g.mul(s, five)?;
    let tt = g.transpose(t, vec![1, 0])?;
    let tt = g.transpose(tt, vec![1, 0])?;
    let dead = g.log(x)?;
    g.relu(dead)?;
    g.set_output("y", tt)?;
    Ok(g)
}

#[test]
fn optimize_reaches_a_fixpoint_with_folding() -> R {
    let g = messy_graph()?;
    let ev = AddMul::default();
    let (o, report) = optimize_with_report(&g, Some(&ev))?;
    assert_same_signature(&g, &o);
    // x, unused, 5, exp(x), add, mul.
    assert_eq!(o.len(), 6);
    assert_eq!(count(&o, "input"), 2);
    assert_eq!(count(&o, "constant"), 1);
    assert_eq!(count(&o, "exp"), 1);
    assert_eq!(count(&o, "add"), 1);
    assert_eq!(count(&o, "mul"), 1);
    assert_eq!((report.before, report.after), (g.len(), 6));
    let work = |pass: &str| {
        report
            .per_pass
            .iter()
            .find(|(p, _)| *p == pass)
            .map(|p| p.1)
    };
    assert_eq!(work("fold"), Some(1));
    assert_eq!(work("cse"), Some(1));
    assert!(work("simplify") >= Some(3));
    assert!(work("dce").is_some());
    // Idempotent: a second run changes nothing.
    let again = optimize(&o, Some(&ev))?;
    assert_eq!(again, o);
    Ok(())
}

#[test]
fn optimize_without_an_evaluator_does_not_fold() -> R {
    let g = messy_graph()?;
    let (o, report) = optimize_with_report(&g, None)?;
    assert_same_signature(&g, &o);
    // x, unused, 2, 3, 2+3, exp(x), add, mul.
    assert_eq!(o.len(), 8);
    assert_eq!(count(&o, "add"), 2);
    assert!(report.per_pass.iter().all(|(p, _)| *p != "fold"));
    assert_eq!(optimize(&o, None)?, o);
    Ok(())
}

#[test]
fn optimize_leaves_an_optimal_graph_alone() -> R {
    let mut g = Graph::new();
    let x = g.input("x", f32s(&[2, 3]))?;
    let w = g.input("w", f32s(&[3, 4]))?;
    let y = g.matmul(x, w)?;
    let y = g.relu(y)?;
    g.set_output("y", y)?;
    let (o, report) = optimize_with_report(&g, Some(&AddMul::default()))?;
    assert_eq!(o, g);
    assert!(report.per_pass.iter().all(|&(_, n)| n == 0));
    Ok(())
}

/// A custom gradient inside a loop body, inside a branch, is inlined there:
/// no backend sees a `custom_grad` node at any depth.
#[test]
fn custom_gradients_are_inlined_inside_loop_bodies_and_branches() -> R {
    use canopy_ir::autodiff::custom_grad;
    use canopy_ir::passes::{has_custom_grad, inline_custom_grads};
    use canopy_ir::{Cond, Scan};

    let mut forward = Graph::new();
    let x = forward.input("x", f32s(&[3]))?;
    let y = forward.unary(UnaryOp::Sigmoid, x)?;
    forward.set_output("y", y)?;
    let mut backward = Graph::new();
    let _ = backward.input("x", f32s(&[3]))?;
    let y = backward.input("y", f32s(&[3]))?;
    let dy = backward.input("dy", f32s(&[3]))?;
    let dx = backward.mul(dy, y)?;
    backward.set_output("dx", dx)?;
    let rule = custom_grad("sigmoid", forward, backward)?;

    // A branch that calls the rule, in a scan body over a carry.
    let branch = |with_rule: bool| -> IrResult<Graph> {
        let mut b = Graph::new();
        let h = b.input("h", f32s(&[3]))?;
        let out = if with_rule {
            b.push(rule.clone(), &[h])?
        } else {
            b.neg(h)?
        };
        b.set_output("h", out)?;
        Ok(b)
    };
    let mut body = Graph::new();
    let flag = body.input("flag", TensorType::scalar(DType::Bool))?;
    let h = body.input("h", f32s(&[3]))?;
    let cond = Cond {
        then_branch: branch(true)?,
        else_branch: branch(false)?,
    };
    let picked = body.push_tuple(Op::Cond(Box::new(cond)), &[flag, h])?;
    body.set_outputs(vec![("flag".into(), flag), ("h".into(), picked[0])])?;
    let mut g = Graph::new();
    let flag = g.input("flag", TensorType::scalar(DType::Bool))?;
    let h0 = g.input("h0", f32s(&[3]))?;
    let scan = Scan {
        body,
        carries: 2,
        scanned: 0,
        length: Dim::Fixed(4),
        reverse: false,
        checkpoint: 0,
    };
    let results = g.push_tuple(Op::Scan(Box::new(scan)), &[flag, h0])?;
    g.set_output("h", results[1])?;
    verify(&g)?;
    assert!(has_custom_grad(&g));

    let inlined = inline_custom_grads(&g)?;
    verify(&inlined)?;
    assert!(!has_custom_grad(&inlined));
    let Op::Scan(scan) = &inlined.nodes()[results[0].index() - 1].op else {
        // The scan keeps its place: inputs first, then the scan.
        panic!("{:?}", inlined.op_counts());
    };
    let Op::Cond(cond) = &scan.body.nodes()[2].op else {
        panic!("{:?}", scan.body.op_counts());
    };
    assert_eq!(cond.then_branch.op_counts().get("sigmoid"), Some(&1));
    assert_eq!(cond.else_branch.op_counts().get("neg"), Some(&1));
    Ok(())
}
