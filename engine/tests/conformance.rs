//! The gradient conformance suite: for every differentiable op, the VJP and
//! JVP rules (and the VJP of the VJP) match central finite differences on
//! random shapes and values, executed on the CPU backend.
//!
//! Inputs of piecewise ops are drawn away from their kinks (relu/abs at 0,
//! ties of max/maximum/pooling), since finite differences across a kink
//! measure neither side's derivative.

mod common;

use canopy_engine::Value;
use canopy_ir::autodiff::call_custom;
use canopy_ir::op::window_output_size;
use canopy_ir::{
    BinaryOp, Conv2dAttrs, DType, Dim, Graph, Op, Pool2dAttrs, ReduceKind, Shape, TensorType,
    UnaryOp,
};
use common::{Case, Tolerance};
use proptest::prelude::*;
use proptest::test_runner::Config;

fn config() -> Config {
    Config {
        cases: common::proptest_cases(),
        max_shrink_iters: 64,
        failure_persistence: None,
        ..Config::default()
    }
}

// ---- strategies ------------------------------------------------------------

/// How values are drawn, to keep finite differences away from kinks.
#[derive(Clone, Copy, Debug)]
enum Domain {
    Any,
    /// [0.5, 2): for log, sqrt, rsqrt, pow bases.
    Positive,
    /// |x| in [0.2, 2): for abs, relu, sign, reciprocal, divisors.
    AwayFromZero,
    /// Distinct values at least 0.1 apart: for max and pooling.
    Distinct,
}

fn values(n: usize, domain: Domain) -> BoxedStrategy<Vec<f32>> {
    match domain {
        Domain::Any => prop::collection::vec(-2.0f32..2.0, n).boxed(),
        Domain::Positive => prop::collection::vec(0.5f32..2.0, n).boxed(),
        Domain::AwayFromZero => prop::collection::vec((0.2f32..2.0, any::<bool>()), n)
            .prop_map(|v| {
                v.into_iter()
                    .map(|(m, neg)| if neg { -m } else { m })
                    .collect()
            })
            .boxed(),
        Domain::Distinct => {
            let grid: Vec<f32> = (0..n).map(|i| (i as f32 - n as f32 / 2.0) * 0.1).collect();
            Just(grid).prop_shuffle().boxed()
        }
    }
}

fn shape(min_rank: usize, max_rank: usize) -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(1usize..4, min_rank..=max_rank)
}

/// A shape together with values for it.
fn tensor(
    shape: impl Strategy<Value = Vec<usize>>,
    domain: Domain,
) -> impl Strategy<Value = (Vec<usize>, Vec<f32>)> {
    shape.prop_flat_map(move |s| {
        let n = s.iter().product();
        (Just(s), values(n, domain))
    })
}

/// A shape that broadcasts to `full`: some leading axes dropped, some axes
/// set to 1.
fn broadcastable(full: Vec<usize>) -> impl Strategy<Value = Vec<usize>> {
    let rank = full.len();
    (0..=rank, prop::collection::vec(any::<bool>(), rank)).prop_map(move |(drop, ones)| {
        full[drop..]
            .iter()
            .zip(&ones[drop..])
            .map(|(&d, &one)| if one { 1 } else { d })
            .collect()
    })
}

fn dims(shape: &[usize]) -> Vec<Dim> {
    shape.iter().map(|&d| Dim::Fixed(d)).collect()
}

fn len(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// Every differentiable unary op: all of `UnaryOp::ALL` but bool `not`, so
/// a new op is checked here as soon as it exists.
fn differentiable_unary() -> Vec<UnaryOp> {
    UnaryOp::ALL
        .into_iter()
        .filter(|&u| u != UnaryOp::Not)
        .collect()
}

fn unary_domain(op: UnaryOp) -> Domain {
    match op {
        UnaryOp::Log | UnaryOp::Sqrt | UnaryOp::Rsqrt | UnaryOp::Log1p => Domain::Positive,
        UnaryOp::Abs | UnaryOp::Sign | UnaryOp::Relu | UnaryOp::Reciprocal => Domain::AwayFromZero,
        _ => Domain::Any,
    }
}

/// A finer step for `div` and `pow`; the tolerances stay the default ones.
///
/// The second-order check differentiates the first-order VJP along `b`:
/// `−Σw₁·a/b² − Σw₂·u/b² + 2w₃·Σu·a/b³`, whose terms often nearly cancel.
/// A central difference is off by about `ε²·f‴/6`, for the last term
/// `4ε²·w₃·Σu·a/b⁵`: with `ε = 1e-2` and `|b|` near 0.3 that is ~0.2% of the
/// term but several percent of the small sum (CI saw 2.3035 vs 2.3665). The
/// rule is exact: on the shrunk case the difference converges to it as ε²
/// (off by 0.0099, 0.0025, 0.0006 at ε = 1e-2, 5e-3, 2.5e-3). `2.5e-3` cuts
/// the truncation 16-fold, while f32 rounding, which grows as 1/ε, stays
/// well under `atol`.
///
/// `pow` has the same trouble one order up: its second-order check takes
/// the third derivative of `w·u·b·aᵇ⁻¹` along `a`, `w·u·b(b−1)(b−2)(b−3)·aᵇ⁻⁴`,
/// which for a base near 0.5 and an exponent near −2 is thousands of times
/// `w·u` while the sum it lands in nearly cancels (CI saw 0.1353 vs 0.1316,
/// bound 0.0036; the case is `pow_small_base_negative_exponent`).
fn fine_step() -> Tolerance {
    Tolerance {
        eps: 2.5e-3,
        ..Tolerance::default()
    }
}

/// `reciprocal` takes `div`'s finer step: `1/x`'s third derivative is
/// `−6/x⁴`, so a central difference with `ε = 1e-2` is off by `ε²/x⁴`,
/// about 0.03 at `x = −0.23` (CI saw 0.2801 vs 0.2493, bound 0.019).
fn unary_tolerance(op: UnaryOp) -> Tolerance {
    match op {
        UnaryOp::Reciprocal => fine_step(),
        _ => Tolerance::default(),
    }
}

/// The case CI drew, fixed: `reciprocal` near its pole.
#[test]
fn reciprocal_near_its_pole() {
    let mut c = Case::new();
    let values = vec![
        -0.23422281,
        1.591751,
        -0.44300705,
        1.1925871,
        -1.2162267,
        1.1764303,
    ];
    let x = c.f32("x", &[3, 1, 2], values);
    let y = c.g.unary(UnaryOp::Reciprocal, x).unwrap();
    c.check_with(y, unary_tolerance(UnaryOp::Reciprocal));
}

/// The case CI drew, fixed: `pow` with a base near 0.5 and an exponent
/// near −2. On it the second-order difference converges to the rule as ε²
/// (0.13527, 0.13254, 0.13188 at ε = 1e-2, 5e-3, 2.5e-3, against an exact
/// 0.13165), so the step, not the rule, was off.
#[test]
fn pow_small_base_negative_exponent() {
    let mut c = Case::new();
    let a = c.f32("a", &[2], vec![0.555_548, 0.751_839_76]);
    let b = c.f32("b", &[1], vec![-1.944_261_1]);
    let y = c.g.binary(BinaryOp::Pow, a, b).unwrap();
    c.check_with(y, fine_step());
}

// ---- elementwise -------------------------------------------------------------

proptest! {
    #![proptest_config(config())]

    #[test]
    fn unary(
        (op, (s, x)) in prop::sample::select(differentiable_unary())
            .prop_flat_map(|op| (Just(op), tensor(shape(0, 3), unary_domain(op))))
    ) {
        let mut c = Case::new();
        let x = c.f32("x", &s, x);
        let y = c.g.unary(op, x).unwrap();
        c.check_with(y, unary_tolerance(op));
    }

    #[test]
    fn binary_with_broadcasting(
        op in prop::sample::select(vec![BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div, BinaryOp::Pow]),
        (full, small) in shape(0, 3).prop_flat_map(|s| (Just(s.clone()), broadcastable(s))),
        swap in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let (sa, sb) = if swap { (small, full) } else { (full, small) };
        let (da, db, tol) = match op {
            BinaryOp::Div => (Domain::Any, Domain::AwayFromZero, fine_step()),
            BinaryOp::Pow => (Domain::Positive, Domain::Any, fine_step()),
            _ => (Domain::Any, Domain::Any, Tolerance::default()),
        };
        let mut c = Case::new();
        let a = c.f32("a", &sa, sample(len(&sa), da, seed));
        let b = c.f32("b", &sb, sample(len(&sb), db, seed ^ 1));
        let y = c.g.binary(op, a, b).unwrap();
        c.check_with(y, tol);
    }

    /// Maximum and minimum: operands on interleaved grids, so they never
    /// come within 0.1 of each other.
    #[test]
    fn maximum_minimum(
        max in any::<bool>(),
        (full, small) in shape(0, 3).prop_flat_map(|s| (Just(s.clone()), broadcastable(s))),
        swap in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let (sa, sb) = if swap { (small, full) } else { (full, small) };
        let grid = |n: usize, offset: f32, seed: u64| -> Vec<f32> {
            let mut rng = common::Rng(seed);
            (0..n).map(|_| (rng.uniform() * 10.0).round() * 0.2 + offset).collect()
        };
        let mut c = Case::new();
        let a = c.f32("a", &sa, grid(len(&sa), 0.1, seed));
        let b = c.f32("b", &sb, grid(len(&sb), 0.0, seed ^ 7));
        let op = if max { BinaryOp::Maximum } else { BinaryOp::Minimum };
        let y = c.g.binary(op, a, b).unwrap();
        c.check(y);
    }

    #[test]
    fn where_with_broadcasting(
        full in shape(0, 3),
        seed in any::<u64>(),
    ) {
        let mut rng = common::Rng(seed);
        let pick = |rng: &mut common::Rng| -> Vec<usize> {
            full.iter().map(|&d| if rng.uniform() > 0.0 { d } else { 1 }).collect()
        };
        let (sc, sa, sb) = (pick(&mut rng), pick(&mut rng), pick(&mut rng));
        let cond: Vec<bool> = (0..len(&sc)).map(|_| rng.uniform() > 0.0).collect();
        let mut c = Case::new();
        let cnd = c.bool("c", &sc, cond);
        let a = c.f32("a", &sa, sample(len(&sa), Domain::Any, seed ^ 1));
        let b = c.f32("b", &sb, sample(len(&sb), Domain::Any, seed ^ 2));
        let y = c.g.select(cnd, a, b).unwrap();
        // A smooth consumer, so the branches' cotangents are not constant.
        let y = c.g.unary(UnaryOp::Tanh, y).unwrap();
        c.check(y);
    }

    #[test]
    fn cast_f32_to_f32((s, x) in tensor(shape(0, 3), Domain::Any)) {
        let mut c = Case::new();
        let x = c.f32("x", &s, x);
        let y = c.g.cast(x, canopy_ir::DType::F32).unwrap();
        let y = c.g.unary(UnaryOp::Square, y).unwrap();
        c.check(y);
    }
}

/// Values for a domain from a seed, where a strategy per shape is awkward.
fn sample(n: usize, domain: Domain, seed: u64) -> Vec<f32> {
    let mut rng = common::Rng(seed);
    (0..n)
        .map(|i| {
            let u = rng.uniform();
            match domain {
                Domain::Any => 2.0 * u,
                Domain::Positive => 1.25 + 0.75 * u,
                Domain::AwayFromZero => u.signum() * (0.2 + 1.8 * u.abs()),
                Domain::Distinct => (i as f32 - n as f32 / 2.0) * 0.1,
            }
        })
        .collect()
}

// ---- matmul --------------------------------------------------------------------

proptest! {
    #![proptest_config(config())]

    #[test]
    fn matmul_all_flags_and_batching(
        ta in any::<bool>(),
        tb in any::<bool>(),
        (m, k, n) in (1usize..4, 1usize..4, 1usize..4),
        (batch, batch_b) in shape(0, 2).prop_flat_map(|s| (Just(s.clone()), broadcastable(s))),
        swap in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let (ba, bb) = if swap { (batch_b, batch) } else { (batch, batch_b) };
        let mut sa = ba.clone();
        sa.extend(if ta { [k, m] } else { [m, k] });
        let mut sb = bb.clone();
        sb.extend(if tb { [n, k] } else { [k, n] });
        let mut c = Case::new();
        let a = c.f32("a", &sa, sample(len(&sa), Domain::Any, seed));
        let b = c.f32("b", &sb, sample(len(&sb), Domain::Any, seed ^ 1));
        let y = c.g.matmul_t(a, b, ta, tb).unwrap();
        c.check(y);
    }
}

// ---- reductions and shape ops ------------------------------------------------------

fn axes_of(rank: usize) -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(any::<bool>(), rank).prop_map(|pick| {
        pick.iter()
            .enumerate()
            .filter(|(_, p)| **p)
            .map(|(i, _)| i)
            .collect()
    })
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn reduce(
        kind in prop::sample::select(vec![ReduceKind::Sum, ReduceKind::Mean, ReduceKind::Max]),
        (s, axes) in shape(0, 3).prop_flat_map(|s| (Just(s.clone()), axes_of(s.len()))),
        keep_dims in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let domain = if kind == ReduceKind::Max { Domain::Distinct } else { Domain::Any };
        let mut c = Case::new();
        let x = c.f32("x", &s, shuffled(sample(len(&s), domain, seed), seed));
        let y = c.g.reduce(kind, x, &axes, keep_dims).unwrap();
        c.check(y);
    }

    /// Max over a tensor with exact ties splits the cotangent evenly.
    #[test]
    fn reduce_max_ties(rows in 1usize..4, seed in any::<u64>()) {
        let mut c = Case::new();
        let base = shuffled(sample(rows, Domain::Distinct, seed), seed);
        let x = c.f32("x", &[rows], base);
        let pair = c.g.push(Op::Concat { axis: 0 }, &[x, x]).unwrap();
        let y = c.g.reduce(ReduceKind::Max, pair, &[0], false).unwrap();
        c.check(y);
    }

    #[test]
    fn reshape((s, x) in tensor(shape(1, 3), Domain::Any), form in 0..3usize) {
        let target = match form {
            0 => vec![len(&s)],
            1 => s.iter().rev().copied().collect(),
            _ => vec![1, len(&s), 1],
        };
        let mut c = Case::new();
        let x = c.f32("x", &s, x);
        let y = c.g.reshape(x, dims(&target)).unwrap();
        let y = c.g.unary(UnaryOp::Sigmoid, y).unwrap();
        c.check(y);
    }

    #[test]
    fn transpose(
        ((s, x), perm) in tensor(shape(1, 4), Domain::Any)
            .prop_flat_map(|t| { let r = t.0.len(); (Just(t), Just((0..r).collect::<Vec<_>>()).prop_shuffle()) })
    ) {
        let mut c = Case::new();
        let x = c.f32("x", &s, x);
        let y = c.g.transpose(x, perm).unwrap();
        c.check(y);
    }

    #[test]
    fn broadcast(
        (full, small) in shape(0, 3).prop_flat_map(|s| (Just(s.clone()), broadcastable(s))),
        seed in any::<u64>(),
    ) {
        let mut c = Case::new();
        let x = c.f32("x", &small, sample(len(&small), Domain::Any, seed));
        let y = c.g.broadcast(x, dims(&full)).unwrap();
        let y = c.g.unary(UnaryOp::Tanh, y).unwrap();
        c.check(y);
    }

    #[test]
    fn slice((s, x) in tensor(shape(1, 3), Domain::Any), seed in any::<u64>()) {
        let axis = (seed as usize) % s.len();
        let start = (seed as usize >> 8) % s[axis];
        let end = start + 1 + (seed as usize >> 16) % (s[axis] - start);
        let mut c = Case::new();
        let x = c.f32("x", &s, x);
        let y = c.g.push(Op::Slice { axis, start, end }, &[x]).unwrap();
        c.check(y);
    }

    #[test]
    fn pad((s, x) in tensor(shape(1, 3), Domain::Any), axis in 0..3usize, before in 0..3usize, after in 0..3usize) {
        let axis = axis % s.len();
        let mut c = Case::new();
        let x = c.f32("x", &s, x);
        let y = c.g.push(Op::Pad { axis, before, after }, &[x]).unwrap();
        let y = c.g.unary(UnaryOp::Sigmoid, y).unwrap();
        c.check(y);
    }

    #[test]
    fn concat(
        s in shape(1, 3),
        axis in 0..3usize,
        lens in prop::collection::vec(1usize..4, 1..4),
        seed in any::<u64>(),
    ) {
        let axis = axis % s.len();
        let mut c = Case::new();
        let mut parts = Vec::new();
        for (i, &l) in lens.iter().enumerate() {
            let mut si = s.clone();
            si[axis] = l;
            parts.push(c.f32(&format!("x{i}"), &si, sample(len(&si), Domain::Any, seed ^ i as u64)));
        }
        let y = c.g.push(Op::Concat { axis }, &parts).unwrap();
        let y = c.g.unary(UnaryOp::Square, y).unwrap();
        c.check(y);
    }
}

fn shuffled(mut v: Vec<f32>, seed: u64) -> Vec<f32> {
    let mut rng = common::Rng(seed ^ 0xABCD);
    for i in (1..v.len()).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        v.swap(i, j);
    }
    v
}

// ---- convolution -----------------------------------------------------------------

/// Random convolution geometry: (N, C, O, input HW, kernel HW, attrs, output HW).
#[derive(Clone, Debug)]
struct ConvCase {
    n: usize,
    c: usize,
    o: usize,
    in_hw: [usize; 2],
    k_hw: [usize; 2],
    attrs: Conv2dAttrs,
    out_hw: [usize; 2],
}

fn conv_case() -> impl Strategy<Value = ConvCase> {
    let axis = (1usize..4, 1usize..3, 0usize..2, 1usize..3, 0usize..3);
    (1usize..3, 1usize..3, 1usize..3, axis.clone(), axis).prop_map(|(n, c, o, h, w)| {
        let mut in_hw = [0; 2];
        let mut k_hw = [0; 2];
        let mut out_hw = [0; 2];
        let mut attrs = Conv2dAttrs::default();
        for (i, (k, stride, pad, dil, extra)) in [h, w].into_iter().enumerate() {
            let span = dil * (k - 1) + 1;
            in_hw[i] = span.saturating_sub(2 * pad).max(1) + extra;
            k_hw[i] = k;
            attrs.stride[i] = stride;
            attrs.padding[i] = pad;
            attrs.dilation[i] = dil;
            out_hw[i] =
                window_output_size(in_hw[i], k, stride, pad, dil).expect("fits by construction");
        }
        ConvCase {
            n,
            c,
            o,
            in_hw,
            k_hw,
            attrs,
            out_hw,
        }
    })
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn conv2d(cc in conv_case(), seed in any::<u64>()) {
        let xs = [cc.n, cc.c, cc.in_hw[0], cc.in_hw[1]];
        let ws = [cc.o, cc.c, cc.k_hw[0], cc.k_hw[1]];
        let mut c = Case::new();
        let x = c.f32("x", &xs, sample(len(&xs), Domain::Any, seed));
        let w = c.f32("w", &ws, sample(len(&ws), Domain::Any, seed ^ 1));
        let y = c.g.conv2d(x, w, cc.attrs).unwrap();
        c.check(y);
    }

    #[test]
    fn conv2d_backward_input(cc in conv_case(), seed in any::<u64>()) {
        let dys = [cc.n, cc.o, cc.out_hw[0], cc.out_hw[1]];
        let ws = [cc.o, cc.c, cc.k_hw[0], cc.k_hw[1]];
        let mut c = Case::new();
        let dy = c.f32("dy", &dys, sample(len(&dys), Domain::Any, seed));
        let w = c.f32("w", &ws, sample(len(&ws), Domain::Any, seed ^ 1));
        let op = Op::Conv2dBackwardInput { attrs: cc.attrs, input_hw: cc.in_hw };
        let y = c.g.push(op, &[dy, w]).unwrap();
        c.check(y);
    }

    #[test]
    fn conv2d_backward_filter(cc in conv_case(), seed in any::<u64>()) {
        let xs = [cc.n, cc.c, cc.in_hw[0], cc.in_hw[1]];
        let dys = [cc.n, cc.o, cc.out_hw[0], cc.out_hw[1]];
        let mut c = Case::new();
        let x = c.f32("x", &xs, sample(len(&xs), Domain::Any, seed));
        let dy = c.f32("dy", &dys, sample(len(&dys), Domain::Any, seed ^ 1));
        let op = Op::Conv2dBackwardFilter { attrs: cc.attrs, kernel_hw: cc.k_hw };
        let y = c.g.push(op, &[x, dy]).unwrap();
        c.check(y);
    }
}

// ---- pooling -------------------------------------------------------------------------

#[derive(Clone, Debug)]
struct PoolCase {
    x_shape: [usize; 4],
    attrs: Pool2dAttrs,
    out_shape: [usize; 4],
}

fn pool_case() -> impl Strategy<Value = PoolCase> {
    let axis = (1usize..4, 1usize..3, 0usize..2, 0usize..3);
    (1usize..3, 1usize..3, axis.clone(), axis).prop_map(|(n, c, h, w)| {
        let mut attrs = Pool2dAttrs {
            kernel: [1, 1],
            stride: [1, 1],
            padding: [0, 0],
        };
        let mut in_hw = [0; 2];
        let mut out_hw = [0; 2];
        for (i, (k, stride, pad, extra)) in [h, w].into_iter().enumerate() {
            let pad = pad.min(k / 2);
            attrs.kernel[i] = k;
            attrs.stride[i] = stride;
            attrs.padding[i] = pad;
            in_hw[i] = k.saturating_sub(2 * pad).max(1) + extra;
            out_hw[i] =
                window_output_size(in_hw[i], k, stride, pad, 1).expect("fits by construction");
        }
        PoolCase {
            x_shape: [n, c, in_hw[0], in_hw[1]],
            attrs,
            out_shape: [n, c, out_hw[0], out_hw[1]],
        }
    })
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn max_pool2d(pc in pool_case(), seed in any::<u64>()) {
        let mut c = Case::new();
        let x = c.f32("x", &pc.x_shape, shuffled(sample(len(&pc.x_shape), Domain::Distinct, 0), seed));
        let y = c.g.max_pool2d(x, pc.attrs).unwrap();
        // Square so the second-order check sees a non-constant cotangent.
        let y = c.g.unary(UnaryOp::Square, y).unwrap();
        c.check(y);
    }

    #[test]
    fn max_pool2d_select(pc in pool_case(), seed in any::<u64>()) {
        let mut c = Case::new();
        let x = c.f32("x", &pc.x_shape, shuffled(sample(len(&pc.x_shape), Domain::Distinct, 0), seed));
        let v = c.f32("v", &pc.x_shape, sample(len(&pc.x_shape), Domain::Any, seed));
        let y = c.g.push(Op::MaxPool2dSelect(pc.attrs), &[x, v]).unwrap();
        c.check(y);
    }

    #[test]
    fn max_pool2d_backward(pc in pool_case(), seed in any::<u64>()) {
        let mut c = Case::new();
        let x = c.f32("x", &pc.x_shape, shuffled(sample(len(&pc.x_shape), Domain::Distinct, 0), seed));
        let dy = c.f32("dy", &pc.out_shape, sample(len(&pc.out_shape), Domain::Any, seed));
        let y = c.g.push(Op::MaxPool2dBackward(pc.attrs), &[x, dy]).unwrap();
        c.check(y);
    }

    #[test]
    fn avg_pool2d(pc in pool_case(), seed in any::<u64>()) {
        let mut c = Case::new();
        let x = c.f32("x", &pc.x_shape, sample(len(&pc.x_shape), Domain::Any, seed));
        let y = c.g.avg_pool2d(x, pc.attrs).unwrap();
        c.check(y);
    }

    #[test]
    fn avg_pool2d_backward(pc in pool_case(), seed in any::<u64>()) {
        let mut c = Case::new();
        let dy = c.f32("dy", &pc.out_shape, sample(len(&pc.out_shape), Domain::Any, seed));
        let input_hw = [pc.x_shape[2], pc.x_shape[3]];
        let y = c.g.push(Op::AvgPool2dBackward { attrs: pc.attrs, input_hw }, &[dy]).unwrap();
        c.check(y);
    }
}

// ---- softmax, indexing, custom gradients ------------------------------------------------

proptest! {
    #![proptest_config(config())]

    #[test]
    fn softmax_and_log_softmax((s, x) in tensor(shape(1, 3), Domain::Any), axis in 0..3usize, log in any::<bool>()) {
        let axis = axis % s.len();
        let mut c = Case::new();
        let x = c.f32("x", &s, x);
        let y = if log { c.g.log_softmax(x, axis) } else { c.g.softmax(x, axis) }.unwrap();
        c.check(y);
    }

    #[test]
    fn gather(
        (s, x) in tensor(shape(1, 3), Domain::Any),
        axis in 0..3usize,
        idx_shape in shape(0, 2),
        seed in any::<u64>(),
    ) {
        let axis = axis % s.len();
        let mut rng = common::Rng(seed);
        let idx: Vec<i64> = (0..len(&idx_shape)).map(|_| (rng.next_u64() % s[axis] as u64) as i64).collect();
        let mut c = Case::new();
        let x = c.f32("x", &s, x);
        let i = c.i64("i", &idx_shape, idx);
        let y = c.g.push(Op::Gather { axis }, &[x, i]).unwrap();
        let y = c.g.unary(UnaryOp::Square, y).unwrap();
        c.check(y);
    }

    #[test]
    fn scatter_add(
        outer in shape(0, 1),
        idx_shape in shape(0, 2),
        inner in shape(0, 1),
        dim_size in 1usize..4,
        seed in any::<u64>(),
    ) {
        let axis = outer.len();
        let mut rng = common::Rng(seed);
        let idx: Vec<i64> = (0..len(&idx_shape)).map(|_| (rng.next_u64() % dim_size as u64) as i64).collect();
        let us: Vec<usize> = outer.iter().chain(&idx_shape).chain(&inner).copied().collect();
        let mut c = Case::new();
        let i = c.i64("i", &idx_shape, idx);
        let u = c.f32("u", &us, sample(len(&us), Domain::Any, seed));
        let y = c.g.push(Op::ScatterAdd { axis, dim_size }, &[i, u]).unwrap();
        let y = c.g.unary(UnaryOp::Square, y).unwrap();
        c.check(y);
    }

    #[test]
    fn custom_grad((s, x) in tensor(shape(0, 3), Domain::Any), seed in any::<u64>()) {
        let ty = TensorType::f32(&s);
        let mut c = Case::new();
        let x = c.f32("x", &s, x);
        let w = c.f32("w", &s, sample(len(&s), Domain::Any, seed));
        let y = call_custom(&mut c.g, "scaled_sigmoid", scaled_sigmoid(&ty), scaled_sigmoid_backward(&ty), &[x, w]).unwrap();
        c.check(y);
    }
}

/// forward(x, w) = w·sigmoid(x)
fn scaled_sigmoid(ty: &TensorType) -> Graph {
    let mut g = Graph::new();
    let x = g.input("x", ty.clone()).unwrap();
    let w = g.input("w", ty.clone()).unwrap();
    let s = g.unary(UnaryOp::Sigmoid, x).unwrap();
    let y = g.mul(w, s).unwrap();
    g.set_output("y", y).unwrap();
    g
}

/// backward(x, w, y, dy) = (dy·w·s·(1 − s), dy·s) with s = y / w recomputed
/// as sigmoid(x) (w may be zero).
fn scaled_sigmoid_backward(ty: &TensorType) -> Graph {
    let mut g = Graph::new();
    let x = g.input("x", ty.clone()).unwrap();
    let w = g.input("w", ty.clone()).unwrap();
    let _y = g.input("y", ty.clone()).unwrap();
    let dy = g.input("dy", ty.clone()).unwrap();
    let s = g.unary(UnaryOp::Sigmoid, x).unwrap();
    let one = g.scalar(1.0).unwrap();
    let one_minus = g.sub(one, s).unwrap();
    let ds = g.mul(s, one_minus).unwrap();
    let dyw = g.mul(dy, w).unwrap();
    let dx = g.mul(dyw, ds).unwrap();
    let dw = g.mul(dy, s).unwrap();
    g.set_output("dx", dx).unwrap();
    g.set_output("dw", dw).unwrap();
    g
}

/// Negative control: the checker must reject a wrong rule. A custom sigmoid
/// whose backward forgets the (1 − y) factor has to fail the check.
#[test]
#[should_panic(expected = "vjp grad/x")]
#[cfg_attr(
    canopy_forward_backend,
    ignore = "npu/tests/conformance.rs checks forward results only"
)]
fn checker_rejects_a_wrong_gradient() {
    let ty = TensorType::f32(&[3]);
    let mut forward = Graph::new();
    let x = forward.input("x", ty.clone()).unwrap();
    let y = forward.unary(UnaryOp::Sigmoid, x).unwrap();
    forward.set_output("y", y).unwrap();
    let mut backward = Graph::new();
    let _x = backward.input("x", ty.clone()).unwrap();
    let y = backward.input("y", ty.clone()).unwrap();
    let dy = backward.input("dy", ty.clone()).unwrap();
    let dx = backward.mul(dy, y).unwrap();
    backward.set_output("dx", dx).unwrap();

    let mut c = Case::new();
    let x = c.f32("x", &[3], vec![-1.0, 0.5, 2.0]);
    let y = call_custom(&mut c.g, "bad_sigmoid", forward, backward, &[x]).unwrap();
    c.check(y);
}

proptest! {
    #![proptest_config(config())]

    /// Graphs over the symbolic batch dimension: broadcasting against it,
    /// and Mean/Max over it, whose element count is only known at run time.
    #[test]
    fn batch_dimension(batch in 1usize..5, kind in prop::sample::select(vec![ReduceKind::Mean, ReduceKind::Max]), seed in any::<u64>()) {
        let mut g = Graph::new();
        let x_ty = TensorType::new(DType::F32, Shape(vec![Dim::Batch, Dim::Fixed(3)]));
        let x = g.input("x", x_ty).unwrap();
        let b = g.input("b", TensorType::f32(&[3])).unwrap();
        let h = g.add(x, b).unwrap();
        let h = g.unary(UnaryOp::Tanh, h).unwrap();
        let pooled = g.reduce(kind, h, &[0], false).unwrap();
        let mean = g.mean(h, &[0, 1], true).unwrap();
        let y = g.mul(pooled, mean).unwrap();
        g.set_output("y", y).unwrap();
        let xs = shuffled(sample(batch * 3, Domain::Distinct, 0), seed);
        let inputs = vec![
            Value::f32(&[batch, 3], xs).unwrap(),
            Value::f32(&[3], sample(3, Domain::Any, seed)).unwrap(),
        ];
        common::check_vjp_jvp(&g, &inputs);
    }
}

// ---- composites: normalisation and global pooling --------------------------------

/// ε large enough that the finite differences stay well conditioned when a
/// random lane happens to have a small variance; the composition does not
/// depend on its value.
const NORM_EPS: f32 = 0.1;

proptest! {
    #![proptest_config(config())]

    #[test]
    fn layer_norm(s in shape(2, 3), from_last in 1usize..3, seed in any::<u64>()) {
        let first = s.len() - from_last.min(s.len() - 1);
        let mut c = Case::new();
        let x = c.f32("x", &s, sample(len(&s), Domain::Any, seed));
        let p = &s[first..];
        let scale = c.f32("scale", p, sample(len(p), Domain::Any, seed ^ 1));
        let bias = c.f32("bias", p, sample(len(p), Domain::Any, seed ^ 2));
        let y = c.g.layer_norm(x, [scale, bias], first, NORM_EPS).unwrap();
        c.check(y);
    }

    #[test]
    fn batch_norm_inference(n in 1usize..3, ch in 1usize..4, hw in 1usize..3, seed in any::<u64>()) {
        let s = [n, ch, hw, hw];
        let mut c = Case::new();
        let x = c.f32("x", &s, sample(len(&s), Domain::Any, seed));
        let scale = c.f32("scale", &[ch], sample(ch, Domain::Any, seed ^ 1));
        let bias = c.f32("bias", &[ch], sample(ch, Domain::Any, seed ^ 2));
        let mean = c.f32("mean", &[ch], sample(ch, Domain::Any, seed ^ 3));
        let var = c.f32("var", &[ch], sample(ch, Domain::Positive, seed ^ 4));
        let y = c.g.batch_norm_inference(x, [scale, bias, mean, var], NORM_EPS).unwrap();
        c.check(y);
    }

    #[test]
    fn batch_norm_training(n in 1usize..3, ch in 1usize..4, rest in shape(0, 2), seed in any::<u64>()) {
        let s: Vec<usize> = [n, ch].into_iter().chain(rest).collect();
        for output in 0..3 {
            let mut c = Case::new();
            let x = c.f32("x", &s, sample(len(&s), Domain::Any, seed));
            let scale = c.f32("scale", &[ch], sample(ch, Domain::Any, seed ^ 1));
            let bias = c.f32("bias", &[ch], sample(ch, Domain::Any, seed ^ 2));
            let (y, mean, var) = c.g.batch_norm_training(x, [scale, bias], NORM_EPS).unwrap();
            c.check([y, mean, var][output]);
        }
    }

    #[test]
    fn global_avg_pool(n in 1usize..3, ch in 1usize..3, h in 1usize..4, w in 1usize..4, seed in any::<u64>()) {
        let s = [n, ch, h, w];
        let mut c = Case::new();
        let x = c.f32("x", &s, sample(len(&s), Domain::Any, seed));
        let y = c.g.global_avg_pool(x).unwrap();
        c.check(y);
    }
}
