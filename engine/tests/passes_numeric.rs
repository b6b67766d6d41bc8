//! The optimisation pipeline must not change what a graph computes: each
//! graph runs on the CPU backend before and after `optimize` with the same
//! random inputs, and the outputs must agree.

use canopy_engine::fold::CpuConstEvaluator;
use canopy_engine::{Backend, CpuBackend, Value};
use canopy_ir::passes::{ConstEvaluator, optimize_with_report};
use canopy_ir::{DType, Dim, Graph, Shape, TensorData, TensorType, ValueId};

const TOLERANCE: f32 = 1e-5;

/// A deterministic pseudo-random stream (xorshift), so failures reproduce.
struct Rng(u64);

impl Rng {
    fn next_f32(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }

    fn values(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next_f32()).collect()
    }
}

/// Random values for every input of `g`, with the batch dimension bound
/// to `batch`; index inputs get in-range class ids.
fn random_inputs(g: &Graph, batch: usize, classes: i64, rng: &mut Rng) -> Vec<Value> {
    g.inputs()
        .iter()
        .map(|&i| {
            let shape = g.ty(i).shape.resolve(batch);
            let n = shape.iter().product();
            match g.ty(i).dtype {
                DType::F32 => Value::f32(&shape, rng.values(n)).expect("shape fits"),
                DType::I64 => {
                    let ids = (0..n).map(|k| (k as i64 * 7 + 3) % classes).collect();
                    Value::i64(&shape, ids).expect("shape fits")
                }
                other => panic!("no random inputs of {other}"),
            }
        })
        .collect()
}

fn run(g: &Graph, inputs: Vec<Value>) -> Vec<Value> {
    let mut exe = CpuBackend.compile(g).expect("compiles");
    exe.run(inputs).expect("runs")
}

/// Optimises `g`, checks the signature is kept and the node count did not
/// grow, and compares both graphs' outputs on the same inputs.
fn assert_optimize_preserves_outputs(g: &Graph, batch: usize, classes: i64) -> Graph {
    let evaluator: &dyn ConstEvaluator = &CpuConstEvaluator;
    let (opt, report) = optimize_with_report(g, Some(evaluator)).expect("optimizes");
    assert_eq!(g.input_names(), opt.input_names());
    assert!(opt.len() <= g.len(), "{report:?}");
    let inputs = random_inputs(g, batch, classes, &mut Rng(0x2545_F491_4F6C_DD1D));
    let before = run(g, inputs.clone());
    let after = run(&opt, inputs);
    assert_eq!(before.len(), after.len());
    for ((name, _), (b, a)) in g.outputs().iter().zip(before.iter().zip(&after)) {
        assert_eq!(b.shape(), a.shape(), "output {name}");
        let (b, a) = (b.to_f32_vec().expect("f32"), a.to_f32_vec().expect("f32"));
        for (x, y) in b.iter().zip(&a) {
            let scale = x.abs().max(1.0);
            assert!(
                (x - y).abs() <= TOLERANCE * scale,
                "output {name}: {x} vs {y}"
            );
        }
    }
    opt
}

fn fixed(dims: &[usize]) -> Vec<Dim> {
    dims.iter().map(|&d| Dim::Fixed(d)).collect()
}

/// Two dense layers, log-softmax cross-entropy and accuracy-style outputs,
/// with the redundancy an autodiff or a layer library tends to leave.
fn mlp() -> anyhow::Result<Graph> {
    let mut g = Graph::new();
    let x = g.input(
        "x",
        TensorType::new(DType::F32, vec![Dim::Batch, Dim::Fixed(4)]),
    )?;
    let labels = g.input("labels", TensorType::new(DType::I64, vec![Dim::Batch]))?;
    let w1 = g.input("params/w1", TensorType::f32(&[4, 8]))?;
    let b1 = g.input("params/b1", TensorType::f32(&[8]))?;
    let w2 = g.input("params/w2", TensorType::f32(&[8, 3]))?;
    let b2 = g.input("params/b2", TensorType::f32(&[3]))?;
    let one = g.scalar(1.0)?;
    let h = g.matmul(x, w1)?;
    let h = g.add(h, b1)?;
    let h = g.relu(h)?;
    let h = g.mul(h, one)?;
    // w2 reached through a transpose pair and a transposed matmul operand.
    let w2t = g.transpose(w2, vec![1, 0])?;
    let w2tt = g.transpose(w2t, vec![1, 0])?;
    let w2ttt = g.transpose(w2tt, vec![1, 0])?;
    let logits = g.matmul_t(h, w2ttt, false, true)?;
    let logits = g.add(logits, b2)?;
    let logp = g.log_softmax(logits, 1)?;
    let onehot = g.push(canopy_ir::Op::OneHot { depth: 3 }, &[labels])?;
    let picked = g.mul(logp, onehot)?;
    let per_example = g.sum(picked, &[1], false)?;
    let per_example2 = g.sum(picked, &[1], false)?;
    let nll = g.neg(per_example)?;
    let loss = g.mean(nll, &[0], false)?;
    let check = g.neg(per_example2)?;
    let check = g.neg(check)?;
    g.set_output("loss", loss)?;
    g.set_output("logits", logits)?;
    g.set_output("check", check)?;
    Ok(g)
}

#[test]
fn mlp_forward_and_loss_survive_optimize() -> anyhow::Result<()> {
    let g = mlp()?;
    let opt = assert_optimize_preserves_outputs(&g, 5, 3);
    let counts = opt.op_counts();
    assert_eq!(
        counts.get("transpose"),
        None,
        "transposes absorbed into matmul"
    );
    assert_eq!(counts.get("sum"), Some(&1), "duplicate sums merged");
    assert_eq!(counts.get("neg"), Some(&1), "double negation removed");
    Ok(())
}

fn constant(g: &mut Graph, dims: &[usize], rng: &mut Rng) -> anyhow::Result<ValueId> {
    let n = dims.iter().product();
    let data = TensorData::f32(dims.to_vec(), rng.values(n)).expect("shape fits");
    Ok(g.constant(data)?)
}

/// Mostly constant subgraphs (foldable), identities and duplicates around
/// two real inputs.
fn foldable() -> anyhow::Result<Graph> {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut g = Graph::new();
    let x = g.input("x", TensorType::f32(&[2, 3]))?;
    let z = g.input(
        "z",
        TensorType::new(DType::F32, Shape(vec![Dim::Batch, Dim::Fixed(3)])),
    )?;
    g.input("unused", TensorType::scalar(DType::F32))?;
    let a = constant(&mut g, &[3, 4], &mut rng)?;
    let b = constant(&mut g, &[4], &mut rng)?;
    let two = g.scalar(2.0)?;
    let zero = g.scalar(0.0)?;
    // A constant chain: exp(a) * 2 + b, reshaped there and back, transposed.
    let ea = g.exp(a)?;
    let ea = g.mul(ea, two)?;
    let ea = g.add(ea, b)?;
    let r = g.reshape(ea, fixed(&[12]))?;
    let r = g.reshape(r, fixed(&[3, 4]))?;
    let rt = g.transpose(r, vec![1, 0])?; // [4, 3]
    let y = g.matmul_t(x, rt, false, true)?; // [2, 4]
    let y = g.sub(y, zero)?;
    // The same subtree again, so CSE has work after folding.
    let ea2 = g.exp(a)?;
    let ea2 = g.mul(ea2, two)?;
    let y2 = g.matmul(x, ea2)?;
    let y = g.add(y, y2)?;
    let y = g.cast(y, DType::F32)?;
    // A batch-dimension broadcast of a constant must stay unfolded.
    let bz = g.broadcast(b, vec![Dim::Batch, Dim::Fixed(4)])?;
    let zw = g.matmul(z, a)?;
    let zw = g.add(zw, bz)?;
    let zw = g.sum(zw, &[], false)?;
    let dead = g.exp(x)?;
    g.log(dead)?;
    g.set_output("y", y)?;
    g.set_output("zw", zw)?;
    Ok(g)
}

#[test]
fn foldable_graph_survives_optimize() -> anyhow::Result<()> {
    let g = foldable()?;
    let opt = assert_optimize_preserves_outputs(&g, 3, 1);
    let counts = opt.op_counts();
    assert_eq!(counts.get("exp"), None, "constant exps folded");
    assert_eq!(counts.get("reshape"), None);
    assert_eq!(counts.get("transpose"), None);
    assert_eq!(
        counts.get("broadcast"),
        Some(&1),
        "batch-typed nodes are not folded"
    );
    // 3 inputs; constants a, b, exp(a)·2 and exp(a)·2 + b; x·C twice and
    // their sum; the broadcast, z·a and its sum with it.
    assert_eq!(opt.len(), 13, "{} → {}", g.len(), opt.len());
    assert_eq!(counts.get("constant"), Some(&4));
    assert_eq!(counts.get("matmul"), Some(&3));
    Ok(())
}

#[test]
fn cpu_evaluator_declines_what_it_cannot_run() {
    let op = canopy_ir::Op::Binary(canopy_ir::BinaryOp::Add);
    let a = TensorData::f32(vec![2], vec![1.0, 2.0]).expect("shape fits");
    let b = TensorData::f32(vec![3], vec![1.0, 2.0, 3.0]).expect("shape fits");
    // Shapes that do not broadcast: no graph to build, so no result.
    assert!(
        CpuConstEvaluator
            .eval(&op, &[&a, &b], &TensorType::f32(&[3]))
            .is_none()
    );
    // A declared type that differs from the op's.
    assert!(
        CpuConstEvaluator
            .eval(&op, &[&a, &a], &TensorType::f32(&[3]))
            .is_none()
    );
}

#[test]
fn cpu_evaluator_adds() {
    let op = canopy_ir::Op::Binary(canopy_ir::BinaryOp::Add);
    let a = TensorData::f32(vec![2], vec![1.0, 2.0]).expect("shape fits");
    let out = CpuConstEvaluator.eval(&op, &[&a, &a], &TensorType::f32(&[2]));
    assert_eq!(out, TensorData::f32(vec![2], vec![2.0, 4.0]));
}
