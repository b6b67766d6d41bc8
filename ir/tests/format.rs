//! The IR file format: bit-exact round trips and a corpus of malformed
//! files that must give errors (never panics).

use std::collections::{BTreeMap, BTreeSet};

use canopy_ir::format::{
    FORMAT_VERSION, FormatError, MAGIC, OPSET_VERSION, ReadLimits, digest, digest_hex, read_model,
    read_model_with_limits, write_model,
};
use canopy_ir::{
    BinaryOp, Buffer, Cond, Conv2dAttrs, CustomGrad, DType, Dim, Graph, Metadata, Model, Op,
    Parameter, Pool2dAttrs, ReduceKind, Scan, TensorData, TensorType, UnaryOp, ValueId, WhileLoop,
};
use sha2::{Digest, Sha256};

// ---- model builders ------------------------------------------------------

fn batch(dims: &[usize]) -> TensorType {
    let mut shape = vec![Dim::Batch];
    shape.extend(dims.iter().map(|&d| Dim::Fixed(d)));
    TensorType::new(DType::F32, shape)
}

fn f32_data(shape: Vec<usize>, f: impl Fn(usize) -> f32) -> TensorData {
    let n = shape.iter().product();
    TensorData::f32(shape, (0..n).map(f).collect()).unwrap()
}

fn tensor(shape: Vec<usize>, buffer: Buffer) -> TensorData {
    TensorData::new(shape, buffer).unwrap()
}

/// Awkward floats: NaNs with payloads, signed zeros, infinities, subnormals.
fn awkward(i: usize) -> f32 {
    match i % 8 {
        0 => f32::from_bits(0x7fc0_1234),
        1 => f32::from_bits(0xffa0_0001),
        2 => -0.0,
        3 => f32::INFINITY,
        4 => f32::NEG_INFINITY,
        5 => f32::from_bits(1),
        6 => f32::MAX,
        _ => i as f32 * 0.37 - 1.0,
    }
}

fn metadata() -> Metadata {
    let mut properties = BTreeMap::new();
    properties.insert("architecture".to_string(), "mlp \"small\"\n\tü".to_string());
    properties.insert("optimizer".to_string(), "sgd".to_string());
    properties.insert("z\u{1}ctl".to_string(), String::new());
    Metadata {
        model_name: "test/mlp ✓".to_string(),
        parent_digest: Some([0xab; 32]),
        producer: "canopy-ir tests".to_string(),
        properties,
    }
}

/// A two-layer MLP with infer and eval entry points.
fn mlp() -> Model {
    let w1 = f32_data(vec![4, 20], |i| i as f32 * 0.01 - 0.3);
    let b1 = f32_data(vec![20], awkward);
    let w2 = f32_data(vec![20, 3], |i| (i as f32).sin());
    let params = [("fc1.weight", w1), ("fc1.bias", b1), ("fc2.weight", w2)];
    let mut infer = Graph::new();
    let x = infer.input("x", batch(&[4])).unwrap();
    let logits = mlp_body(&mut infer, &params, x);
    infer.set_output("logits", logits).unwrap();
    let mut eval = Graph::new();
    let x = eval.input("x", batch(&[4])).unwrap();
    let y = eval.input("y", batch(&[3])).unwrap();
    let logits = mlp_body(&mut eval, &params, x);
    let lsm = eval.log_softmax(logits, 1).unwrap();
    let prod = eval.mul(lsm, y).unwrap();
    let total = eval.sum_all(prod).unwrap();
    let loss = eval.neg(total).unwrap();
    eval.set_output("loss", loss).unwrap();
    let parameters = params
        .into_iter()
        .map(|(name, data)| Parameter {
            name: name.to_string(),
            data,
            trainable: name != "fc1.bias",
        })
        .collect();
    Model {
        metadata: metadata(),
        parameters,
        entry_points: [("infer".to_string(), infer), ("eval".to_string(), eval)].into(),
    }
}

fn mlp_body(g: &mut Graph, params: &[(&str, TensorData)], x: ValueId) -> ValueId {
    let p: Vec<ValueId> = params
        .iter()
        .map(|(name, t)| g.input(format!("params/{name}"), t.tensor_type()).unwrap())
        .collect();
    let h = g.matmul(x, p[0]).unwrap();
    let h = g.add(h, p[1]).unwrap();
    let h = g.relu(h).unwrap();
    g.matmul(h, p[2]).unwrap()
}

/// A custom gradient for square, whose forward graph nests another custom
/// gradient and a data-section constant.
fn custom_square(depth: usize) -> CustomGrad {
    let ty = batch(&[9]);
    let mut fwd = Graph::new();
    let a = fwd.input("a", ty.clone()).unwrap();
    let y = if depth > 0 {
        let inner = custom_square(depth - 1);
        fwd.push(Op::CustomGrad(Box::new(inner)), &[a]).unwrap()
    } else {
        let big = fwd.constant(f32_data(vec![9], |_| 0.0)).unwrap();
        let big2 = fwd.constant(f32_data(vec![8, 9], awkward)).unwrap();
        let s = fwd.sum(big2, &[0], false).unwrap();
        let z = fwd.mul(s, big).unwrap();
        let sq = fwd.unary(UnaryOp::Square, a).unwrap();
        fwd.add(sq, z).unwrap()
    };
    fwd.set_output("y", y).unwrap();
    let mut bwd = Graph::new();
    let a = bwd.input("a", ty.clone()).unwrap();
    bwd.input("y", ty.clone()).unwrap();
    let dy = bwd.input("dy", ty).unwrap();
    let two = bwd.scalar(2.0).unwrap();
    let t = bwd.mul(two, a).unwrap();
    let da = bwd.mul(dy, t).unwrap();
    bwd.set_output("da", da).unwrap();
    CustomGrad {
        name: format!("square{depth}"),
        forward: fwd,
        backward: bwd,
    }
}

/// One graph using every op and every attribute.
fn all_ops_graph() -> Graph {
    let mut g = Graph::new();
    let x = g.input("x", batch(&[2, 6, 6])).unwrap();
    let w = g.input("params/w", TensorType::f32(&[3, 2, 3, 3])).unwrap();
    let seed = g.input("seed", TensorType::scalar(DType::I64)).unwrap();
    let conv = Conv2dAttrs {
        stride: [1, 1],
        padding: [1, 1],
        dilation: [1, 1],
    };
    let c = g.conv2d(x, w, conv).unwrap();
    let outs = vec![
        g.push(
            Op::Conv2dBackwardInput {
                attrs: conv,
                input_hw: [6, 6],
            },
            &[c, w],
        )
        .unwrap(),
        g.push(
            Op::Conv2dBackwardFilter {
                attrs: conv,
                kernel_hw: [3, 3],
            },
            &[x, c],
        )
        .unwrap(),
        window_ops(&mut g, c),
        g.push(
            Op::RandomUniform {
                shape: vec![Dim::Batch, Dim::Fixed(3)],
            },
            &[seed],
        )
        .unwrap(),
    ];
    let flat = g.reshape(c, vec![Dim::Batch, Dim::Fixed(108)]).unwrap();
    let mut outs2 = shape_ops(&mut g, flat);
    outs2.extend(outs);
    for (i, v) in outs2.into_iter().enumerate() {
        g.set_output(format!("out{i}"), v).unwrap();
    }
    g
}

fn window_ops(g: &mut Graph, c: ValueId) -> ValueId {
    let pool = Pool2dAttrs {
        kernel: [3, 3],
        stride: [2, 2],
        padding: [1, 1],
    };
    let mp = g.max_pool2d(c, pool).unwrap();
    let sel = g.push(Op::MaxPool2dSelect(pool), &[c, c]).unwrap();
    let mpb = g.push(Op::MaxPool2dBackward(pool), &[c, sel]).unwrap();
    let ap = g.avg_pool2d(mpb, pool).unwrap();
    let apb = g
        .push(
            Op::AvgPool2dBackward {
                attrs: pool,
                input_hw: [6, 6],
            },
            &[ap],
        )
        .unwrap();
    let both = g.add(apb, mpb).unwrap();
    let mp_up = g
        .push(
            Op::AvgPool2dBackward {
                attrs: pool,
                input_hw: [6, 6],
            },
            &[mp],
        )
        .unwrap();
    g.add(both, mp_up).unwrap()
}

/// Shape, reduction, index, elementwise, custom-gradient and control-flow
/// ops on [N, 108].
fn shape_ops(g: &mut Graph, flat: ValueId) -> Vec<ValueId> {
    let t = g.transpose(flat, vec![1, 0]).unwrap();
    let s = g.sum(flat, &[1], true).unwrap();
    let m = g.mean(flat, &[0, 1], false).unwrap();
    let mx = g.reduce(ReduceKind::Max, flat, &[1], false).unwrap();
    let b = g.broadcast(s, vec![Dim::Batch, Dim::Fixed(7)]).unwrap();
    let sl = g
        .push(
            Op::Slice {
                axis: 1,
                start: 2,
                end: 5,
            },
            &[flat],
        )
        .unwrap();
    let pd = g
        .push(
            Op::Pad {
                axis: 1,
                before: 1,
                after: 2,
            },
            &[sl],
        )
        .unwrap();
    let cat = g.push(Op::Concat { axis: 1 }, &[sl, pd]).unwrap();
    let sm = g.softmax(cat, 1).unwrap();
    let lsm = g.log_softmax(sm, 1).unwrap();
    let mut outs = vec![t, m, mx, b, lsm];
    outs.extend(index_ops(g, cat));
    outs.extend(elementwise_ops(g, cat));
    outs.extend(constant_ops(g));
    let custom = g
        .push(Op::CustomGrad(Box::new(custom_square(2))), &[cat])
        .unwrap();
    outs.push(custom);
    outs.extend(control_ops(g, cat));
    outs
}

/// A graph of `inputs` whose outputs are `body` applied to them.
fn graph_of(inputs: &[TensorType], body: impl Fn(&mut Graph, &[ValueId]) -> Vec<ValueId>) -> Graph {
    let mut g = Graph::new();
    let args: Vec<ValueId> = inputs
        .iter()
        .enumerate()
        .map(|(i, ty)| g.input(format!("in{i}"), ty.clone()).unwrap())
        .collect();
    for (i, v) in body(&mut g, &args).into_iter().enumerate() {
        g.set_output(format!("out{i}"), v).unwrap();
    }
    g
}

/// `scan` (reversed, over the batch), `cond`, `while_loop` and the
/// `output` nodes reading them, on cat: [N, 9].
fn control_ops(g: &mut Graph, cat: ValueId) -> Vec<ValueId> {
    let row = TensorType::f32(&[9]);
    let body = graph_of(&[row.clone(), row.clone()], |b, a| {
        let t = b.add(a[0], a[1]).unwrap();
        vec![t, t]
    });
    let scan = Scan {
        body,
        carries: 1,
        scanned: 1,
        length: Dim::Batch,
        reverse: true,
        checkpoint: 0,
    };
    let init = g.constant(TensorData::zeros(DType::F32, vec![9])).unwrap();
    let scanned = g
        .push_tuple(Op::Scan(Box::new(scan)), &[init, cat])
        .unwrap();
    let pred = g
        .constant(tensor(vec![], Buffer::Bool(vec![true])))
        .unwrap();
    let cond = Cond {
        then_branch: graph_of(std::slice::from_ref(&row), |b, a| {
            vec![b.exp(a[0]).unwrap()]
        }),
        else_branch: graph_of(&[row], |b, a| vec![b.neg(a[0]).unwrap()]),
    };
    let chosen = g
        .push_tuple(Op::Cond(Box::new(cond)), &[pred, scanned[0]])
        .unwrap();
    let count = TensorType::scalar(DType::I64);
    let w = WhileLoop {
        cond: graph_of(std::slice::from_ref(&count), |b, a| {
            let three = b.constant(TensorData::scalar_i64(3)).unwrap();
            vec![b.binary(BinaryOp::Lt, a[0], three).unwrap()]
        }),
        body: graph_of(&[count], |b, a| {
            let one = b.constant(TensorData::scalar_i64(1)).unwrap();
            vec![b.add(a[0], one).unwrap()]
        }),
        carries: 1,
        max_trips: 10,
    };
    let i0 = g.constant(TensorData::scalar_i64(0)).unwrap();
    let counted = g.push_tuple(Op::WhileLoop(Box::new(w)), &[i0]).unwrap();
    vec![scanned[1], chosen[0], counted[0], counted[1]]
}

fn index_ops(g: &mut Graph, cat: ValueId) -> Vec<ValueId> {
    let idx = g
        .constant(tensor(
            vec![2, 3],
            Buffer::I64(vec![0, 8, 3, -1, i64::MAX, 4]),
        ))
        .unwrap();
    let gathered = g.push(Op::Gather { axis: 1 }, &[cat, idx]).unwrap();
    let scattered = g
        .push(
            Op::ScatterAdd {
                axis: 1,
                dim_size: 9,
            },
            &[idx, gathered],
        )
        .unwrap();
    let idx32 = g
        .constant(tensor(vec![4], Buffer::I32(vec![0, 4, -7, i32::MIN])))
        .unwrap();
    let oh = g.push(Op::OneHot { depth: 5 }, &[idx32]).unwrap();
    let mm = g.matmul_t(cat, cat, true, false).unwrap();
    let a = g.constant(f32_data(vec![5, 3], awkward)).unwrap();
    let bb = g.constant(f32_data(vec![2, 5], awkward)).unwrap();
    let mm2 = g.matmul_t(a, bb, true, true).unwrap();
    let best = g
        .push(
            Op::ArgMax {
                axis: 1,
                keep_dims: true,
            },
            &[mm2],
        )
        .unwrap();
    vec![scattered, oh, mm, mm2, best]
}

/// Every unary and binary op, taken from `ALL` (the list the reader uses),
/// so a new op is in this model as soon as the reader knows it.
fn elementwise_ops(g: &mut Graph, x: ValueId) -> Vec<ValueId> {
    let mut v = x;
    for op in UnaryOp::ALL.into_iter().filter(|&u| u != UnaryOp::Not) {
        v = g.unary(op, v).unwrap();
    }
    let arithmetic = BinaryOp::ALL
        .into_iter()
        .filter(|b| !b.is_comparison() && !b.is_logical());
    for op in arithmetic {
        v = g.binary(op, v, x).unwrap();
    }
    let comparisons = BinaryOp::ALL.into_iter().filter(|b| b.is_comparison());
    let cmps: Vec<ValueId> = comparisons.map(|op| g.binary(op, v, x).unwrap()).collect();
    let mut logic = cmps[0];
    for (op, &c) in BinaryOp::ALL
        .into_iter()
        .filter(|b| b.is_logical())
        .zip(&cmps[1..])
    {
        logic = g.binary(op, logic, c).unwrap();
    }
    let n = g.unary(UnaryOp::Not, logic).unwrap();
    let w = g.select(n, v, x).unwrap();
    let i = g.cast(w, DType::I32).unwrap();
    let l = g.cast(i, DType::I64).unwrap();
    let l2 = g.add(l, l).unwrap();
    let f = g.cast(n, DType::F32).unwrap();
    vec![w, l2, f]
}

/// Constants of every dtype, inline and in the data section, and empty.
fn constant_ops(g: &mut Graph) -> Vec<ValueId> {
    let bools: Vec<bool> = (0..70).map(|i| i % 3 == 0).collect();
    let ints: Vec<i64> = (0..65).map(|i| i64::MIN + i).collect();
    let ints32: Vec<i32> = (0..100).map(|i| i * -77).collect();
    vec![
        g.constant(f32_data(vec![10, 10], awkward)).unwrap(),
        g.constant(f32_data(vec![64], awkward)).unwrap(),
        g.constant(tensor(vec![70], Buffer::Bool(bools))).unwrap(),
        g.constant(tensor(vec![2], Buffer::Bool(vec![true, false])))
            .unwrap(),
        g.constant(tensor(vec![5, 13], Buffer::I64(ints))).unwrap(),
        g.constant(tensor(vec![100], Buffer::I32(ints32))).unwrap(),
        g.constant(tensor(vec![0, 3], Buffer::F32(vec![]))).unwrap(),
        g.constant(tensor(vec![0], Buffer::I64(vec![]))).unwrap(),
        g.scalar(-0.0).unwrap(),
    ]
}

/// Parameters of every dtype, including empty and scalar ones.
fn all_ops_model() -> Model {
    let params = vec![
        ("w", f32_data(vec![3, 2, 3, 3], awkward), true),
        ("steps", tensor(vec![], Buffer::I64(vec![-5])), false),
        (
            "table",
            tensor(vec![3, 33], Buffer::I32((0..99).collect())),
            false,
        ),
        (
            "mask",
            tensor(
                vec![67],
                Buffer::Bool((0..67).map(|i| i % 2 == 1).collect()),
            ),
            false,
        ),
        ("empty", tensor(vec![4, 0], Buffer::F32(vec![])), true),
        (
            "nan",
            f32_data(vec![1], |_| f32::from_bits(0xff80_0001)),
            true,
        ),
    ];
    Model {
        metadata: Metadata::default(),
        parameters: params
            .into_iter()
            .map(|(name, data, trainable)| Parameter {
                name: name.to_string(),
                data,
                trainable,
            })
            .collect(),
        entry_points: [("train_step".to_string(), all_ops_graph())].into(),
    }
}

/// The ops that are not unary, binary or reductions; those come from
/// their `ALL` lists in [`all_op_names`].
const OTHER_OP_NAMES: &[&str] = &[
    "input",
    "constant",
    "where",
    "cast",
    "matmul",
    "reshape",
    "transpose",
    "broadcast",
    "slice",
    "pad",
    "concat",
    "conv2d",
    "conv2d_backward_input",
    "conv2d_backward_filter",
    "max_pool2d",
    "max_pool2d_select",
    "max_pool2d_backward",
    "avg_pool2d",
    "avg_pool2d_backward",
    "softmax",
    "log_softmax",
    "gather",
    "scatter_add",
    "one_hot",
    "argmax",
    "random_uniform",
    "custom_grad",
    "scan",
    "cond",
    "while_loop",
    "output",
];

/// Every op name the format knows.
fn all_op_names() -> BTreeSet<&'static str> {
    let unary = UnaryOp::ALL.into_iter().map(Op::Unary);
    let binary = BinaryOp::ALL.into_iter().map(Op::Binary);
    let reduce = ReduceKind::ALL.into_iter().map(|kind| Op::Reduce {
        kind,
        axes: Vec::new(),
        keep_dims: false,
    });
    let elementwise = unary.chain(binary).chain(reduce).map(|op| op.name());
    OTHER_OP_NAMES.iter().copied().chain(elementwise).collect()
}

fn collect_ops(g: &Graph, names: &mut BTreeSet<&'static str>) {
    for node in g.nodes() {
        names.insert(node.op.name());
        for sub in node.op.subgraphs() {
            collect_ops(sub, names);
        }
    }
}

// ---- file surgery helpers --------------------------------------------------

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

fn align64(n: usize) -> usize {
    n.div_ceil(64) * 64
}

/// (header JSON, data section) of a well-formed file.
fn split(file: &[u8]) -> (String, Vec<u8>) {
    let hl = u64_at(file, 16) as usize;
    let header = String::from_utf8(file[64..64 + hl].to_vec()).unwrap();
    (header, file[align64(64 + hl)..].to_vec())
}

/// Rewrites the digest field so the digest check passes and the bytes reach
/// the parser; an independent implementation of the spec's digest rule.
fn fix_digest(file: &mut [u8]) {
    if file.len() < 64 {
        return;
    }
    let mut h = Sha256::new();
    h.update(&file[..32]);
    h.update(&file[64..]);
    let d: [u8; 32] = h.finalize().into();
    file[32..64].copy_from_slice(&d);
}

/// Builds a file from parts with a correct digest.
fn assemble(header: &str, data: &[u8]) -> Vec<u8> {
    let mut f = Vec::new();
    f.extend_from_slice(b"CANOPYIR");
    f.extend_from_slice(&1u16.to_le_bytes());
    f.extend_from_slice(&1u16.to_le_bytes());
    f.extend_from_slice(&0u32.to_le_bytes());
    f.extend_from_slice(&(header.len() as u64).to_le_bytes());
    f.extend_from_slice(&(data.len() as u64).to_le_bytes());
    f.extend_from_slice(&[0; 32]);
    f.extend_from_slice(header.as_bytes());
    f.resize(align64(f.len()), 0);
    f.extend_from_slice(data);
    fix_digest(&mut f);
    f
}

/// The file with its header edited by `edit` (which must change it).
fn edit_header(file: &[u8], edit: impl Fn(&str) -> String) -> Vec<u8> {
    let (header, data) = split(file);
    let edited = edit(&header);
    assert_ne!(edited, header, "the edit did not apply");
    assemble(&edited, &data)
}

fn replace_once(s: &str, from: &str, to: &str) -> String {
    assert!(s.contains(from), "`{from}` not in header");
    s.replacen(from, to, 1)
}

fn read_err(file: &[u8]) -> String {
    match read_model(file) {
        Ok(_) => panic!("malformed file was accepted"),
        Err(e) => e.to_string(),
    }
}

fn assert_err_contains(file: &[u8], parts: &[&str]) {
    let msg = read_err(file);
    for part in parts {
        assert!(
            msg.contains(part),
            "error `{msg}` does not contain `{part}`"
        );
    }
}

/// Anything the reader accepts must be exactly what the writer emits for
/// the model it decoded.
fn read_is_canonical(file: &[u8]) -> Result<(), FormatError> {
    let model = read_model(file)?;
    let again = write_model(&model).expect("a model read back must be writable");
    assert_eq!(again, file, "accepted file is not canonical");
    Ok(())
}

// ---- round trips -----------------------------------------------------------

fn assert_round_trip(model: &Model) -> Vec<u8> {
    let bytes = write_model(model).unwrap();
    assert_eq!(
        write_model(model).unwrap(),
        bytes,
        "writing is deterministic"
    );
    let back = read_model(&bytes).unwrap();
    assert_eq!(
        write_model(&back).unwrap(),
        bytes,
        "write→read→write is bit-exact"
    );
    assert_eq!(back.metadata, model.metadata);
    assert_eq!(
        back.entry_points.keys().collect::<Vec<_>>(),
        model.entry_points.keys().collect::<Vec<_>>()
    );
    assert_eq!(back.parameters.len(), model.parameters.len());
    for (a, b) in back.parameters.iter().zip(&model.parameters) {
        assert_eq!((&a.name, a.trainable), (&b.name, b.trainable));
        assert!(a.data.bit_eq(&b.data), "parameter `{}` changed", a.name);
    }
    bytes
}

#[test]
fn mlp_round_trips_bit_exact() {
    let model = mlp();
    let bytes = assert_round_trip(&model);
    assert_eq!(&bytes[..8], &MAGIC);
    assert_eq!(u16::from_le_bytes([bytes[8], bytes[9]]), FORMAT_VERSION);
    // Only v1 ops: the file declares opset 1, so a v1 reader reads it.
    assert_eq!(u16::from_le_bytes([bytes[10], bytes[11]]), 1);
    assert_eq!(bytes.len() % 64, 0, "the data section ends 64-aligned");
}

#[test]
fn a_file_declares_the_newest_opset_its_ops_need() {
    let mut bytes = write_model(&all_ops_model()).unwrap();
    assert_eq!(u16::from_le_bytes([bytes[10], bytes[11]]), OPSET_VERSION);
    assert_eq!(OPSET_VERSION, 3);
    // The same file claiming an older opset holds ops that opset lacks.
    bytes[10..12].copy_from_slice(&1u16.to_le_bytes());
    fix_digest(&mut bytes);
    let err = read_model(&bytes).unwrap_err().to_string();
    assert!(
        err.contains("opset-2 op") && err.contains("declares opset 1"),
        "{err}"
    );
    bytes[10..12].copy_from_slice(&2u16.to_le_bytes());
    fix_digest(&mut bytes);
    let err = read_model(&bytes).unwrap_err().to_string();
    assert!(
        err.contains("uses `scan`, an opset-3 op") && err.contains("declares opset 2"),
        "{err}"
    );
    // A newer opset than this reader knows is refused by number.
    bytes[10..12].copy_from_slice(&4u16.to_le_bytes());
    fix_digest(&mut bytes);
    let err = read_model(&bytes).unwrap_err().to_string();
    assert!(err.contains("unsupported opset version 4"), "{err}");
    // A newer opset than the ops need is a second encoding of the model.
    let mut v1 = write_model(&mlp()).unwrap();
    for claimed in [2u16, 3] {
        v1[10..12].copy_from_slice(&claimed.to_le_bytes());
        fix_digest(&mut v1);
        let err = read_model(&v1).unwrap_err().to_string();
        assert!(
            err.contains(&format!(
                "declares opset {claimed}, but its ops need only opset 1"
            )),
            "{err}"
        );
    }
}

#[test]
fn all_ops_round_trip_bit_exact() {
    let model = all_ops_model();
    let mut names = BTreeSet::new();
    for g in model.entry_points.values() {
        collect_ops(g, &mut names);
    }
    assert_eq!(names, all_op_names(), "the test model covers every op");
    let bytes = assert_round_trip(&model);
    let back = read_model(&bytes).unwrap();
    let g = &back.entry_points["train_step"];
    let g0 = &model.entry_points["train_step"];
    assert_eq!(g.len(), g0.len());
    for (a, b) in g.nodes().iter().zip(g0.nodes()) {
        assert_eq!((&a.inputs, &a.ty), (&b.inputs, &b.ty));
        match (&a.op, &b.op) {
            (Op::Constant(x), Op::Constant(y)) => assert!(x.bit_eq(y)),
            (Op::CustomGrad(_), Op::CustomGrad(_)) => {}
            (x, y) => assert_eq!(x, y),
        }
    }
    assert_eq!(g.outputs(), g0.outputs());
}

#[test]
fn nan_payloads_and_negative_zero_survive() {
    let bytes = write_model(&all_ops_model()).unwrap();
    let back = read_model(&bytes).unwrap();
    let nan = back.parameter("nan").unwrap().data.as_f32().unwrap()[0];
    assert_eq!(nan.to_bits(), 0xff80_0001);
    let w = back.parameter("w").unwrap().data.as_f32().unwrap();
    assert_eq!(w[0].to_bits(), 0x7fc0_1234);
    assert_eq!(w[2].to_bits(), (-0.0f32).to_bits());
    let g = &back.entry_points["train_step"];
    let scalar = g.nodes().iter().rev().find_map(|n| match &n.op {
        Op::Constant(t) if t.shape.is_empty() && t.dtype() == DType::F32 => t.scalar_value_f32(),
        _ => None,
    });
    assert_eq!(scalar.unwrap().to_bits(), (-0.0f32).to_bits());
}

#[test]
fn empty_model_round_trips() {
    let bytes = assert_round_trip(&Model::default());
    assert_eq!(bytes.len() % 64, 0);
}

#[test]
fn digest_is_the_stored_content_hash() {
    let bytes = write_model(&mlp()).unwrap();
    let d = digest(&bytes).unwrap();
    assert_eq!(&d[..], &bytes[32..64]);
    let mut h = Sha256::new();
    h.update(&bytes[..32]);
    h.update(&bytes[64..]);
    assert_eq!(d, <[u8; 32]>::from(h.finalize()));
    let hex = digest_hex(&d);
    assert_eq!(hex.len(), 64);
    assert!(
        hex.chars()
            .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
    );
    // Different models have different identities.
    let mut other = mlp();
    other.parameters[0].trainable = false;
    assert_ne!(digest(&write_model(&other).unwrap()).unwrap(), d);
}

#[test]
fn header_is_inspectable_json_with_named_ops() {
    let bytes = write_model(&all_ops_model()).unwrap();
    let (header, data) = split(&bytes);
    assert!(header.contains(r#"{"op":"conv2d","stride":[1,1],"padding":[1,1],"dilation":[1,1],"inputs":[0,1],"type":{"dtype":"f32","shape":["N",3,6,6]}}"#), "{header}");
    assert!(header.contains(r#""op":"custom_grad","name":"square2","forward":{"nodes":"#));
    assert_eq!(data.len() % 64, 0);
}

#[test]
fn writer_rejects_invalid_models() {
    let mut model = mlp();
    model.parameters[0].data.shape = vec![5, 20];
    assert!(
        write_model(&model).is_err(),
        "parameter type differs from the graph input"
    );
    let mut model = mlp();
    model.parameters.push(Parameter {
        name: "loose".into(),
        data: TensorData {
            shape: vec![3],
            buffer: Buffer::F32(vec![1.0]),
        },
        trainable: true,
    });
    let err = write_model(&model).unwrap_err().to_string();
    assert!(
        err.contains("loose") && err.contains("does not match"),
        "{err}"
    );
}

// ---- malformed corpus --------------------------------------------------------

fn valid_files() -> Vec<Vec<u8>> {
    vec![
        write_model(&mlp()).unwrap(),
        write_model(&all_ops_model()).unwrap(),
    ]
}

#[test]
fn truncated_at_every_offset_is_an_error() {
    for file in valid_files() {
        for len in 0..file.len() {
            let err = read_model(&file[..len]).unwrap_err();
            assert!(err.to_string().contains("truncated"), "at {len}: {err}");
        }
    }
}

#[test]
fn every_byte_flip_in_preamble_and_header_is_rejected() {
    for file in valid_files() {
        let header_end = 64 + u64_at(&file, 16) as usize;
        for at in 0..header_end {
            for mask in [0x01u8, 0x02, 0x20, 0x80, 0xff] {
                let mut bad = file.clone();
                bad[at] ^= mask;
                // Without a digest fix every flip is caught (most by the digest).
                assert!(read_model(&bad).is_err(), "flip {mask:#x} at {at} accepted");
                // With the digest fixed the flip reaches the parser, which may
                // legitimately accept it (e.g. a changed name), but then the
                // file must be canonical.
                fix_digest(&mut bad);
                let _ = read_is_canonical(&bad);
            }
        }
    }
}

#[test]
fn header_flip_without_digest_fix_is_a_digest_mismatch() {
    let file = write_model(&mlp()).unwrap();
    let mut bad = file.clone();
    bad[100] ^= 1;
    assert_err_contains(
        &bad,
        &["content digest mismatch: header says", "content hashes to"],
    );
    let mut bad = file;
    let last = bad.len() - 1;
    bad[last] ^= 1;
    assert_err_contains(&bad, &["content digest mismatch"]);
}

#[test]
fn newer_versions_are_rejected() {
    let file = write_model(&mlp()).unwrap();
    let mut bad = file.clone();
    bad[8..10].copy_from_slice(&3u16.to_le_bytes());
    fix_digest(&mut bad);
    assert_eq!(
        read_err(&bad),
        "unsupported format version 3 (this reader supports up to 1)"
    );
    assert!(digest(&bad).is_err());
    let mut bad = file.clone();
    bad[10..12].copy_from_slice(&4u16.to_le_bytes());
    fix_digest(&mut bad);
    assert_eq!(
        read_err(&bad),
        "unsupported opset version 4 (this reader supports up to 3)"
    );
    let mut bad = file.clone();
    bad[12] = 1;
    fix_digest(&mut bad);
    assert_err_contains(&bad, &["unknown preamble flags"]);
    let mut bad = file;
    bad[..8].copy_from_slice(b"CANOPYIX");
    assert_err_contains(&bad, &["not a Canopy IR file"]);
}

#[test]
fn unknown_op_is_named_with_entry_point_and_node() {
    let file = write_model(&mlp()).unwrap();
    let bad = edit_header(&file, |h| {
        replace_once(h, r#""op":"relu""#, r#""op":"foo""#)
    });
    let msg = read_err(&bad);
    // Entry points are stored by name: eval, then infer.
    assert!(
        msg.starts_with("unknown op `foo` in entry point `eval`, node "),
        "{msg}"
    );
    let file = write_model(&all_ops_model()).unwrap();
    let bad = edit_header(&file, |h| {
        let at = h.find(r#""name":"square0""#).unwrap();
        let (a, b) = h.split_at(at);
        format!("{a}{}", b.replacen(r#""op":"square""#, r#""op":"cube""#, 1))
    });
    assert_err_contains(
        &bad,
        &[
            "unknown op `cube` in entry point `train_step`, node",
            "custom gradient `square0` forward, node 5",
        ],
    );
}

#[test]
fn huge_claimed_lengths_are_errors_not_allocations() {
    let file = write_model(&mlp()).unwrap();
    for (field, value) in [
        (16, u64::MAX),
        (16, 1 << 40),
        (24, u64::MAX),
        (24, 1 << 40),
        (24, 64),
    ] {
        let mut bad = file.clone();
        bad[field..field + 8].copy_from_slice(&value.to_le_bytes());
        fix_digest(&mut bad);
        assert!(read_model(&bad).is_err());
        assert!(digest(&bad).is_err());
    }
    // A parameter claiming 10^12 elements in a small file.
    let bad = edit_header(&file, |h| {
        replace_once(h, r#""shape":[4,20]"#, r#""shape":[1000000,1000000]"#)
    });
    assert_err_contains(
        &bad,
        &[
            "parameter `fc1.weight`",
            "element count",
            "exceeds the limit",
        ],
    );
    let limits = ReadLimits {
        max_tensor_elements: u64::MAX,
        ..ReadLimits::default()
    };
    let err = read_model_with_limits(&bad, &limits)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("parameter `fc1.weight`: data holds 320 bytes"),
        "{err}"
    );
    let bad = edit_header(&file, |h| {
        replace_once(
            h,
            r#""offset":0,"bytes":320"#,
            r#""offset":0,"bytes":4000000000000"#,
        )
    });
    let err = read_model_with_limits(&bad, &limits)
        .unwrap_err()
        .to_string();
    assert!(err.contains("data holds 4000000000000 bytes"), "{err}");
}

#[test]
fn data_ranges_must_fit_and_be_packed() {
    let file = write_model(&mlp()).unwrap();
    let (header, _) = split(&file);
    assert!(
        header.contains(r#""data":{"offset":320,"bytes":80}"#),
        "{header}"
    );
    let cases = [
        (
            r#""offset":320,"bytes":80"#,
            r#""offset":330,"bytes":80"#,
            "data offset 330 is not aligned to 64 bytes",
        ),
        (
            r#""offset":320,"bytes":80"#,
            r#""offset":4096,"bytes":80"#,
            "parameter `fc1.bias`: data range 4096..4176 exceeds the data section of 704 bytes",
        ),
        (
            r#""offset":320,"bytes":80"#,
            r#""offset":256,"bytes":80"#,
            "overlaps the previous tensor",
        ),
        (
            r#""offset":320,"bytes":80"#,
            r#""offset":384,"bytes":80"#,
            "leaves a gap",
        ),
        (
            r#""offset":320,"bytes":80"#,
            r#""offset":18446744073709551552,"bytes":80"#,
            "exceeds the data section",
        ),
        (
            r#""offset":320,"bytes":80"#,
            r#""offset":320,"bytes":84"#,
            "data holds 84 bytes, but its dtype and shape need 80",
        ),
    ];
    for (from, to, want) in cases {
        let bad = edit_header(&file, |h| replace_once(h, from, to));
        assert_err_contains(&bad, &[want]);
    }
}

#[test]
fn data_section_must_hold_exactly_the_tensors() {
    let file = write_model(&mlp()).unwrap();
    let (header, mut data) = split(&file);
    data.extend_from_slice(&[0; 64]);
    assert_err_contains(
        &assemble(&header, &data),
        &["data section", "tensors end at"],
    );
    let (header, mut data) = split(&file);
    data[420] = 7; // padding after fc1.bias (320..400)
    assert_err_contains(
        &assemble(&header, &data),
        &["data section", "padding is not zero"],
    );
    let (header, mut data) = split(&file);
    data.truncate(data.len() - 64);
    assert_err_contains(&assemble(&header, &data), &["exceeds the data section"]);
}

#[test]
fn trailing_garbage_and_padding_are_rejected() {
    let file = write_model(&mlp()).unwrap();
    let mut bad = file.clone();
    bad.extend_from_slice(b"garbage");
    fix_digest(&mut bad);
    assert_err_contains(&bad, &["7 trailing bytes"]);
    let hl = u64_at(&file, 16) as usize;
    if !(64 + hl).is_multiple_of(64) {
        let mut bad = file;
        bad[64 + hl] = 1;
        fix_digest(&mut bad);
        assert_err_contains(&bad, &["header padding"]);
    }
}

#[test]
fn bad_dtypes_are_rejected() {
    let file = write_model(&mlp()).unwrap();
    let bad = edit_header(&file, |h| {
        replace_once(
            h,
            r#""dtype":"f32","shape":[4,20]"#,
            r#""dtype":"f16","shape":[4,20]"#,
        )
    });
    assert_err_contains(&bad, &["parameter `fc1.weight`: invalid dtype `f16`"]);
    let bad = edit_header(&file, |h| {
        replace_once(h, r#""type":{"dtype":"f32""#, r#""type":{"dtype":"bf16""#)
    });
    assert_err_contains(&bad, &["entry point `eval`, node 0: invalid dtype `bf16`"]);
    let file = write_model(&all_ops_model()).unwrap();
    let bad = edit_header(&file, |h| replace_once(h, r#""to":"i32""#, r#""to":"u8""#));
    assert_err_contains(&bad, &["invalid dtype `u8`"]);
}

#[test]
fn bool_bytes_must_be_zero_or_one() {
    let model = all_ops_model();
    let file = write_model(&model).unwrap();
    let (header, mut data) = split(&file);
    // The mask parameter is the fourth one: w (216 bytes, padded to 256),
    // steps (8 → 320), table (396 → 768), then mask.
    assert!(header.contains(r#""name":"mask","dtype":"bool","shape":[67],"trainable":false,"data":{"offset":768,"bytes":67}"#), "{header}");
    data[768] = 2;
    assert_err_contains(
        &assemble(&header, &data),
        &["parameter `mask`", "byte other than 0 or 1"],
    );
    let bad = edit_header(&file, |h| {
        replace_once(h, r#""value":"0100""#, r#""value":"0102""#)
    });
    assert_err_contains(&bad, &["byte other than 0 or 1"]);
}

#[test]
fn shape_and_element_count_must_agree() {
    let file = write_model(&all_ops_model()).unwrap();
    // An inline constant with one element too few.
    let bad = edit_header(&file, |h| {
        replace_once(h, r#""value":"0100""#, r#""value":"01""#)
    });
    assert_err_contains(
        &bad,
        &["inline `value` holds 1 bytes, but type bool needs 2"],
    );
    let bad = edit_header(&file, |h| {
        replace_once(h, r#""value":"0100""#, r#""value":"01G0""#)
    });
    assert_err_contains(&bad, &["not lowercase hex"]);
    let bad = edit_header(&file, |h| {
        replace_once(h, r#""shape":[3,33]"#, r#""shape":[3,34]"#)
    });
    assert_err_contains(
        &bad,
        &["parameter `table`: data holds 396 bytes, but its dtype and shape need 408"],
    );
    // Small constants must be inline, large ones in the data section.
    let bad = edit_header(&file, |h| {
        replace_once(
            h,
            r#""bytes":520},"inputs":[],"type":{"dtype":"i64","shape":[5,13]}"#,
            r#""bytes":104},"inputs":[],"type":{"dtype":"i64","shape":[1,13]}"#,
        )
    });
    assert_err_contains(&bad, &["constant of 13 elements must be inline"]);
    let bad = edit_header(&file, |h| {
        replace_once(
            h,
            r#""type":{"dtype":"f32","shape":[64]}"#,
            r#""type":{"dtype":"f32","shape":[65]}"#,
        )
    });
    assert_err_contains(
        &bad,
        &["constant of 65 elements must live in the data section"],
    );
}

#[test]
fn out_of_range_value_ids_are_reported_with_node_and_op() {
    let file = write_model(&mlp()).unwrap();
    let bad = edit_header(&file, |h| {
        replace_once(
            h,
            r#""op":"relu","inputs":["#,
            r#""op":"relu","inputs":[99,"#,
        )
    });
    assert_err_contains(
        &bad,
        &[
            "entry point `eval`",
            "(relu)",
            "reads %99, which is not defined before it",
        ],
    );
    let bad = edit_header(&file, |h| {
        replace_once(
            h,
            r#""outputs":[{"name":"loss","value":"#,
            r#""outputs":[{"name":"loss","value":1000"#,
        )
    });
    assert_err_contains(&bad, &["graph output `loss` refers to %"]);
    let bad = edit_header(&file, |h| {
        replace_once(h, r#""inputs":[0,1]"#, r#""inputs":[0,4294967296]"#)
    });
    assert_err_contains(&bad, &["header is not valid"]);
}

#[test]
fn type_errors_name_the_node_and_op() {
    let file = write_model(&mlp()).unwrap();
    let bad = edit_header(&file, |h| {
        replace_once(
            h,
            r#""op":"relu","inputs":[5],"type":{"dtype":"f32","shape":["N",20]}"#,
            r#""op":"relu","inputs":[5],"type":{"dtype":"f32","shape":["N",21]}"#,
        )
    });
    assert_err_contains(
        &bad,
        &[
            "entry point `infer`: node %6 (relu): declared type f32[N, 21] differs from inferred type f32[N, 20]",
        ],
    );
}

#[test]
fn duplicate_names_are_rejected() {
    let file = write_model(&mlp()).unwrap();
    let bad = edit_header(&file, |h| {
        replace_once(h, r#""name":"fc1.bias""#, r#""name":"fc1.weight""#)
    });
    assert_err_contains(&bad, &["parameter `fc1.weight`: is declared twice"]);
    let bad = edit_header(&file, |h| {
        replace_once(
            h,
            r#""entry_points":{"eval":"#,
            r#""entry_points":{"infer":"#,
        )
    });
    assert!(read_model(&bad).is_err());
    let bad = edit_header(&file, |h| {
        replace_once(h, r#""optimizer":"sgd""#, r#""architecture":"sgd""#)
    });
    assert_err_contains(&bad, &["property `architecture` is declared twice"]);
    let bad = edit_header(&file, |h| {
        replace_once(
            h,
            r#""op":"input","name":"y""#,
            r#""op":"input","name":"x""#,
        )
    });
    assert_err_contains(&bad, &["graph input `x` is declared twice"]);
    let file = write_model(&all_ops_model()).unwrap();
    let bad = edit_header(&file, |h| {
        replace_once(h, r#"{"name":"out1","#, r#"{"name":"out0","#)
    });
    assert_err_contains(&bad, &["graph output `out0` is declared twice"]);
}

#[test]
fn duplicate_entry_point_keys_are_named() {
    let model = Model {
        entry_points: [
            ("a".to_string(), Graph::new()),
            ("b".to_string(), Graph::new()),
        ]
        .into(),
        ..Model::default()
    };
    let file = write_model(&model).unwrap();
    let bad = edit_header(&file, |h| replace_once(h, r#""b":{"#, r#""a":{"#));
    assert_err_contains(&bad, &["entry point `a` is declared twice"]);
    let bad = edit_header(&file, |h| h.replace(r#""a":{"#, r#""c":{"#));
    assert_err_contains(&bad, &["not in canonical form", "sorted"]);
}

#[test]
fn attributes_are_exact() {
    let file = write_model(&all_ops_model()).unwrap();
    let bad = edit_header(&file, |h| {
        replace_once(h, r#""op":"conv2d","stride":[1,1],"#, r#""op":"conv2d","#)
    });
    assert_err_contains(
        &bad,
        &["entry point `train_step`, node 3: op `conv2d` lacks attribute `stride`"],
    );
    let bad = edit_header(&file, |h| {
        replace_once(h, r#""op":"conv2d","#, r#""op":"conv2d","axis":1,"#)
    });
    assert_err_contains(&bad, &["op `conv2d` has no attribute `axis`"]);
    let bad = edit_header(&file, |h| {
        replace_once(h, r#""op":"conv2d","#, r#""op":"conv2d","colour":1,"#)
    });
    assert_err_contains(&bad, &["header is not valid", "unknown field `colour`"]);
    let bad = edit_header(&file, |h| {
        replace_once(h, r#""stride":[1,1]"#, r#""stride":[1,5000000000]"#)
    });
    assert_err_contains(&bad, &["attribute `stride` = 5000000000 exceeds the limit"]);
    let bad = edit_header(&file, |h| {
        replace_once(h, r#""perm":[1,0]"#, r#""perm":[1,0,2,3,4,5,6,7,8]"#)
    });
    assert_err_contains(&bad, &["attribute `perm` has 9 entries"]);
}

#[test]
fn constant_placement_is_canonical() {
    let file = write_model(&all_ops_model()).unwrap();
    let (header, _) = split(&file);
    // The 64-element constant is inline; the 65-element one is in the data section.
    assert!(header.contains(r#""type":{"dtype":"f32","shape":[64]}"#));
    let bad = edit_header(&file, |h| {
        let at = h.find(r#""op":"constant","data""#).unwrap();
        format!(
            "{}{}",
            &h[..at],
            h[at..].replacen(
                r#""op":"constant","data":{"#,
                r#""op":"constant","value":"00","data":{"#,
                1
            )
        )
    });
    assert_err_contains(&bad, &["constant has both `value` and `data`"]);
}

#[test]
fn non_canonical_json_is_rejected() {
    let file = write_model(&mlp()).unwrap();
    let bad = edit_header(&file, |h| format!("{h} "));
    assert_err_contains(&bad, &["not in canonical form"]);
    let bad = edit_header(&file, |h| h.replacen(r#"{"model":{"#, r#"{ "model":{"#, 1));
    assert_err_contains(&bad, &["not in canonical form"]);
    let bad = edit_header(&file, |h| {
        replace_once(
            h,
            r#""producer":"canopy-ir tests""#,
            r#""producer":"canopy-ir te\u0073ts""#,
        )
    });
    assert_err_contains(&bad, &["not in canonical form"]);
    let bad = edit_header(&file, |h| {
        replace_once(h, r#""parent_digest":"abab"#, r#""parent_digest":"ABab"#)
    });
    assert_err_contains(&bad, &["parent digest is not 64 lowercase hex digits"]);
    let bad = edit_header(&file, |h| format!("{h}{h}"));
    assert_err_contains(&bad, &["header is not valid"]);
    let bad = assemble("", &[]);
    assert_err_contains(&bad, &["header is not valid"]);
    let long = format!("N{}", "x".repeat(100_000));
    let bad = edit_header(&file, |h| {
        replace_once(h, r#""shape":["N",4]"#, &format!(r#""shape":["{long}",4]"#))
    });
    let msg = read_err(&bad);
    assert!(
        msg.contains("header is not valid") && msg.len() < 1000,
        "{msg}"
    );
    let bad = assemble("\u{feff}{}", &[]);
    assert_err_contains(&bad, &["header is not valid"]);
}

#[test]
fn deep_json_nesting_is_rejected_before_parsing() {
    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    assert_err_contains(&assemble(&deep, &[]), &["nesting depth"]);
    // Custom gradients nested deeper than the verifier allows.
    let model = Model {
        entry_points: [("e".to_string(), nested_graph(8))].into(),
        ..Model::default()
    };
    let file = write_model(&model).unwrap();
    read_is_canonical(&file).unwrap();
    let limits = ReadLimits {
        max_nesting: 3,
        ..ReadLimits::default()
    };
    let err = read_model_with_limits(&file, &limits)
        .unwrap_err()
        .to_string();
    assert!(err.contains("nesting depth"), "{err}");
}

fn nested_graph(depth: usize) -> Graph {
    let mut g = Graph::new();
    let a = g.input("a", batch(&[9])).unwrap();
    let y = g
        .push(Op::CustomGrad(Box::new(custom_square(depth - 1))), &[a])
        .unwrap();
    g.set_output("y", y).unwrap();
    g
}

#[test]
fn limits_are_enforced() {
    let file = write_model(&all_ops_model()).unwrap();
    let tight = [
        ReadLimits {
            max_file_bytes: 100,
            ..ReadLimits::default()
        },
        ReadLimits {
            max_header_bytes: 100,
            ..ReadLimits::default()
        },
        ReadLimits {
            max_graphs: 3,
            ..ReadLimits::default()
        },
        ReadLimits {
            max_nodes_per_graph: 10,
            ..ReadLimits::default()
        },
        ReadLimits {
            max_parameters: 2,
            ..ReadLimits::default()
        },
        ReadLimits {
            max_tensor_elements: 50,
            ..ReadLimits::default()
        },
        ReadLimits {
            max_string_bytes: 3,
            ..ReadLimits::default()
        },
        ReadLimits {
            max_rank: 2,
            ..ReadLimits::default()
        },
        ReadLimits {
            max_dim: 5,
            ..ReadLimits::default()
        },
    ];
    for limits in tight {
        let err = read_model_with_limits(&file, &limits).unwrap_err();
        assert!(
            matches!(
                err,
                FormatError::LimitExceeded { .. } | FormatError::Invalid { .. }
            ),
            "{limits:?}: {err}"
        );
        assert!(err.to_string().contains("limit"), "{err}");
    }
    let mlp_file = write_model(&mlp()).unwrap();
    let limits = ReadLimits {
        max_properties: 1,
        ..ReadLimits::default()
    };
    assert_err_contains_with(
        &mlp_file,
        &limits,
        "number of properties is 3, which exceeds the limit of 1",
    );
}

fn assert_err_contains_with(file: &[u8], limits: &ReadLimits, want: &str) {
    let err = read_model_with_limits(file, limits)
        .unwrap_err()
        .to_string();
    assert!(err.contains(want), "`{err}` lacks `{want}`");
}

#[test]
fn model_level_validation_runs_after_decoding() {
    let file = write_model(&mlp()).unwrap();
    let bad = edit_header(&file, |h| {
        replace_once(h, r#""name":"fc2.weight""#, r#""name":"fc3.weight""#)
    });
    assert_err_contains(&bad, &["model is invalid", "no parameter `fc2.weight`"]);
}

/// Regression inputs found by fuzzing, and hand-made malformed files.
#[test]
fn malformed_corpus_gives_errors() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/malformed");
    let entries: Vec<_> = std::fs::read_dir(dir)
        .expect("the malformed corpus is checked in")
        .map(|e| e.unwrap().path())
        .collect();
    assert!(entries.len() >= 8, "corpus has {} files", entries.len());
    for path in entries {
        let bytes = std::fs::read(&path).unwrap();
        let error = read_model(&bytes).expect_err(&format!("{} must be rejected", path.display()));
        assert!(!error.to_string().is_empty());
        // With the digest repaired the parser itself must still cope.
        let mut repaired = bytes;
        fix_digest(&mut repaired);
        let _ = read_is_canonical(&repaired);
    }
}

/// Writes valid files as fuzzing seeds when CANOPY_FORMAT_SEED_DIR is set
/// (see fuzz/README.md); a no-op otherwise.
#[test]
#[ignore = "a tool, not a check: writes fuzz seeds when CANOPY_FORMAT_SEED_DIR is set"]
fn write_fuzz_seeds() {
    let Ok(dir) = std::env::var("CANOPY_FORMAT_SEED_DIR") else {
        return;
    };
    std::fs::create_dir_all(&dir).unwrap();
    let models = [
        ("mlp", mlp()),
        ("all_ops", all_ops_model()),
        ("empty", Model::default()),
    ];
    for (name, model) in models {
        std::fs::write(format!("{dir}/{name}.canopy"), write_model(&model).unwrap()).unwrap();
    }
}
