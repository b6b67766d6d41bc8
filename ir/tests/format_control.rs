//! The file format's control flow (opset 3): `scan`, `cond`, `while_loop`
//! and `output` round-trip exactly, nest within the reader's limits, and a
//! malformed control-flow node is refused naming the node and the cause.

use canopy_ir::control::MAX_WHILE_TRIPS;
use canopy_ir::format::{ReadLimits, read_model, read_model_with_limits, write_model};
use canopy_ir::{
    BinaryOp, Cond, DType, Dim, Graph, Model, Op, ReduceKind, Scan, TensorData, TensorType,
    ValueId, WhileLoop,
};
use sha2::{Digest, Sha256};

// ---- graphs ----------------------------------------------------------------

fn f32s(dims: &[usize]) -> TensorType {
    TensorType::f32(dims)
}

/// A constant large enough to live in the data section (over 64 elements),
/// with values that tell it apart from any other.
fn big(g: &mut Graph, rows: usize, cols: usize, seed: f32) -> ValueId {
    let values = (0..rows * cols).map(|i| seed + i as f32 * 0.25).collect();
    g.constant(TensorData::f32(vec![rows, cols], values).unwrap())
        .unwrap()
}

fn model(graph: Graph) -> Model {
    Model {
        entry_points: [("e".to_string(), graph)].into(),
        ..Model::default()
    }
}

/// The node index of the first node whose op matches.
fn position(g: &Graph, matches: impl Fn(&Op) -> bool) -> usize {
    g.nodes().iter().position(|n| matches(&n.op)).unwrap()
}

/// `scan` with one carry and one y: the running total of `xs · k` (plus a
/// data-section offset), over `length` steps of f32[3].
fn running_total(length: Dim, reverse: bool) -> Graph {
    let step = f32s(&[3]);
    let mut body = Graph::new();
    let total = body.input("total", step.clone()).unwrap();
    let x = body.input("x", step.clone()).unwrap();
    let k = body.input("k", TensorType::scalar(DType::F32)).unwrap();
    let offsets = big(&mut body, 70, 3, 1.0);
    let offset = body.sum(offsets, &[0], false).unwrap();
    let kx = body.mul(x, k).unwrap();
    let t = body.add(total, kx).unwrap();
    let t = body.add(t, offset).unwrap();
    body.set_output("total", t).unwrap();
    body.set_output("y", t).unwrap();

    let mut g = Graph::new();
    let xs_ty = TensorType::new(DType::F32, vec![length, Dim::Fixed(3)]);
    let xs = g.input("xs", xs_ty).unwrap();
    let init = g.constant(TensorData::zeros(DType::F32, vec![3])).unwrap();
    let k = g.scalar(0.5).unwrap();
    let scan = Scan {
        body,
        carries: 1,
        scanned: 1,
        length,
        reverse,
        checkpoint: 0,
    };
    let outs = g
        .push_tuple(Op::Scan(Box::new(scan)), &[init, xs, k])
        .unwrap();
    let &[total, ys] = &outs[..] else {
        panic!("a scan with one carry and one y has two results")
    };
    // A data-section tensor after the scan: the body's tensors come first.
    let after = big(&mut g, 30, 3, -7.0);
    let after = g.sum(after, &[0], false).unwrap();
    let total = g.add(total, after).unwrap();
    g.set_output("total", total).unwrap();
    g.set_output("ys", ys).unwrap();
    g
}

fn branch(negate: bool) -> Graph {
    let mut g = Graph::new();
    let a = g.input("a", f32s(&[2, 40])).unwrap();
    let c = big(&mut g, 2, 40, if negate { 3.0 } else { -3.0 });
    let r = if negate { g.neg(a) } else { g.exp(a) }.unwrap();
    let r = g.add(r, c).unwrap();
    g.set_output("r", r).unwrap();
    g
}

/// `cond` choosing exp or negation; each branch holds its own
/// data-section constant, so a swap of their tensors would show.
fn choose() -> Graph {
    let mut g = Graph::new();
    let pred = g.input("pred", TensorType::scalar(DType::Bool)).unwrap();
    let a = g.input("a", f32s(&[2, 40])).unwrap();
    let cond = Cond {
        then_branch: branch(false),
        else_branch: branch(true),
    };
    let r = g.push_tuple(Op::Cond(Box::new(cond)), &[pred, a]).unwrap();
    g.set_output("r", r[0]).unwrap();
    g
}

/// `while_loop` counting `i` up to `limit` while doubling `acc`: two
/// carries, one constant operand, at most `max_trips` trips. Its cond and
/// body each hold a data-section constant.
fn count_to(max_trips: usize) -> Graph {
    let operands = |g: &mut Graph| {
        let i = g.input("i", TensorType::scalar(DType::I64)).unwrap();
        let acc = g.input("acc", TensorType::scalar(DType::F32)).unwrap();
        let limit = g.input("limit", TensorType::scalar(DType::I64)).unwrap();
        (i, acc, limit)
    };
    let mut cond = Graph::new();
    let (i, acc, limit) = operands(&mut cond);
    let cap = big(&mut cond, 10, 10, 100.0);
    let cap = cond.mean(cap, &[0, 1], false).unwrap();
    let below = cond.binary(BinaryOp::Lt, i, limit).unwrap();
    let small = cond.binary(BinaryOp::Lt, acc, cap).unwrap();
    let go = cond.binary(BinaryOp::And, below, small).unwrap();
    cond.set_output("go", go).unwrap();
    let mut body = Graph::new();
    let (i, acc, _) = operands(&mut body);
    let one = body.constant(TensorData::scalar_i64(1)).unwrap();
    let next = body.add(i, one).unwrap();
    let factor = big(&mut body, 9, 9, 2.0);
    let factor = body
        .reduce(ReduceKind::Max, factor, &[0, 1], false)
        .unwrap();
    let doubled = body.mul(acc, factor).unwrap();
    body.set_output("i", next).unwrap();
    body.set_output("acc", doubled).unwrap();

    let mut g = Graph::new();
    let limit = g.input("limit", TensorType::scalar(DType::I64)).unwrap();
    let i0 = g.constant(TensorData::scalar_i64(0)).unwrap();
    let acc0 = g.scalar(1.0).unwrap();
    let w = WhileLoop {
        cond,
        body,
        carries: 2,
        max_trips,
    };
    let outs = g
        .push_tuple(Op::WhileLoop(Box::new(w)), &[i0, acc0, limit])
        .unwrap();
    for (name, v) in ["i", "acc", "trips"].into_iter().zip(outs) {
        g.set_output(name, v).unwrap();
    }
    g
}

/// `cond` whose then branch runs a scan over the rows of its operand and
/// whose else branch sums them.
fn scan_in_branch() -> Graph {
    let rows = f32s(&[4, 3]);
    let mut then_branch = Graph::new();
    let xs = then_branch.input("xs", rows.clone()).unwrap();
    let init = then_branch.constant(TensorData::zeros(DType::F32, vec![3]));
    let mut body = Graph::new();
    let total = body.input("total", f32s(&[3])).unwrap();
    let x = body.input("x", f32s(&[3])).unwrap();
    let t = body.add(total, x).unwrap();
    body.set_output("total", t).unwrap();
    let scan = Scan {
        body,
        carries: 1,
        scanned: 1,
        length: Dim::Fixed(4),
        reverse: true,
        checkpoint: 2,
    };
    let total = then_branch
        .push_tuple(Op::Scan(Box::new(scan)), &[init.unwrap(), xs])
        .unwrap();
    then_branch.set_output("total", total[0]).unwrap();
    let mut else_branch = Graph::new();
    let xs = else_branch.input("xs", rows.clone()).unwrap();
    let s = else_branch.sum(xs, &[0], false).unwrap();
    else_branch.set_output("total", s).unwrap();

    let mut g = Graph::new();
    let pred = g.input("pred", TensorType::scalar(DType::Bool)).unwrap();
    let xs = g.input("xs", rows).unwrap();
    let cond = Cond {
        then_branch,
        else_branch,
    };
    let r = g.push_tuple(Op::Cond(Box::new(cond)), &[pred, xs]).unwrap();
    g.set_output("total", r[0]).unwrap();
    g
}

/// A graph taking `c: f32[3]` whose result comes from scans nested
/// `levels` deep, each a two-step scan with no scanned inputs whose body
/// is the next level.
fn nested_scans(levels: usize) -> Graph {
    let mut g = Graph::new();
    let c = g.input("c", f32s(&[3])).unwrap();
    let next = if levels == 0 {
        let one = g.scalar(1.0).unwrap();
        g.add(c, one).unwrap()
    } else {
        let scan = Scan {
            body: nested_scans(levels - 1),
            carries: 1,
            scanned: 0,
            length: Dim::Fixed(2),
            reverse: false,
            checkpoint: 0,
        };
        g.push_tuple(Op::Scan(Box::new(scan)), &[c]).unwrap()[0]
    };
    g.set_output("c", next).unwrap();
    g
}

// ---- file helpers ----------------------------------------------------------

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

fn align64(n: usize) -> usize {
    n.div_ceil(64) * 64
}

fn opset(file: &[u8]) -> u16 {
    u16::from_le_bytes([file[10], file[11]])
}

fn header(file: &[u8]) -> String {
    let len = u64_at(file, 16) as usize;
    String::from_utf8(file[64..64 + len].to_vec()).unwrap()
}

/// The digest rule of docs/ir-format.md, independently of the writer.
fn fix_digest(file: &mut [u8]) {
    let mut h = Sha256::new();
    h.update(&file[..32]);
    h.update(&file[64..]);
    let d: [u8; 32] = h.finalize().into();
    file[32..64].copy_from_slice(&d);
}

/// `file` with its header replaced by `edit`'s (which must change it),
/// keeping its magic, versions, flags and data section, with a correct
/// digest, so the edit reaches the decoder.
fn edit_header(file: &[u8], edit: impl Fn(&str) -> String) -> Vec<u8> {
    let old = header(file);
    let new = edit(&old);
    assert_ne!(new, old, "the edit did not apply");
    let data = &file[align64(64 + old.len())..];
    let mut f = file[..16].to_vec();
    f.extend_from_slice(&(new.len() as u64).to_le_bytes());
    f.extend_from_slice(&(data.len() as u64).to_le_bytes());
    f.extend_from_slice(&[0; 32]);
    f.extend_from_slice(new.as_bytes());
    f.resize(align64(f.len()), 0);
    f.extend_from_slice(data);
    fix_digest(&mut f);
    f
}

fn replace_once(s: &str, from: &str, to: &str) -> String {
    assert!(s.contains(from), "`{from}` not in header");
    s.replacen(from, to, 1)
}

/// Removes the first `"key":{…}` member (with its leading comma) from
/// JSON whose strings hold no braces.
fn remove_object(json: &str, key: &str) -> String {
    let start = json.find(&format!(",\"{key}\":{{")).unwrap();
    let open = start + key.len() + 4;
    let mut depth = 0;
    for (i, b) in json.bytes().enumerate().skip(open) {
        match b {
            b'{' => depth += 1,
            b'}' => depth -= 1,
            _ => {}
        }
        if depth == 0 {
            return format!("{}{}", &json[..start], &json[i + 1..]);
        }
    }
    panic!("unbalanced JSON")
}

fn read_err(file: &[u8], limits: &ReadLimits) -> String {
    match read_model_with_limits(file, limits) {
        Ok(_) => panic!("the file was accepted"),
        Err(e) => e.to_string(),
    }
}

fn assert_err(file: &[u8], limits: &ReadLimits, want: &str) {
    let err = read_err(file, limits);
    assert!(err.contains(want), "`{err}` lacks `{want}`");
}

/// Writes `graph` as entry point `e`, reads it back, and checks that the
/// graph is equal and that writing it again gives the same bytes.
fn assert_round_trip(graph: Graph) -> Vec<u8> {
    let model = model(graph);
    let bytes = write_model(&model).unwrap();
    let back = read_model(&bytes).unwrap();
    assert_eq!(back.entry_points, model.entry_points);
    assert_eq!(
        write_model(&back).unwrap(),
        bytes,
        "write→read→write is bit-exact"
    );
    assert_eq!(opset(&bytes), 3, "control flow is opset 3");
    bytes
}

// ---- round trips -----------------------------------------------------------

#[test]
fn a_scan_round_trips() {
    let bytes = assert_round_trip(running_total(Dim::Fixed(5), false));
    let h = header(&bytes);
    // The scalars, then the body; the results are read by `output` nodes.
    assert!(
        h.contains(r#"{"op":"scan","carries":1,"scanned":1,"length":5,"reverse":false,"checkpoint":0,"body":{"nodes":[{"op":"input","name":"total","#),
        "{h}"
    );
    assert!(
        h.contains(
            r#"{"op":"output","index":1,"inputs":[3],"type":{"dtype":"f32","shape":[5,3]}}"#
        ),
        "{h}"
    );
}

#[test]
fn a_reverse_scan_over_the_batch_round_trips() {
    let bytes = assert_round_trip(running_total(Dim::Batch, true));
    let h = header(&bytes);
    assert!(
        h.contains(r#""length":"N","reverse":true,"checkpoint":0,"body":"#),
        "{h}"
    );
    assert!(
        h.contains(r#""type":{"dtype":"f32","shape":["N",3]}"#),
        "{h}"
    );
}

#[test]
fn a_cond_round_trips() {
    let bytes = assert_round_trip(choose());
    let h = header(&bytes);
    assert!(h.contains(r#"{"op":"cond","then_branch":{"nodes":"#), "{h}");
    assert!(h.contains(r#"]},"else_branch":{"nodes":"#), "{h}");
}

#[test]
fn a_while_loop_round_trips() {
    let bytes = assert_round_trip(count_to(100));
    let h = header(&bytes);
    assert!(
        h.contains(r#"{"op":"while_loop","carries":2,"max_trips":100,"cond":{"nodes":"#),
        "{h}"
    );
    assert!(h.contains(r#"]},"body":{"nodes":"#), "{h}");
    // The trip count, result 2, is an i64 scalar.
    assert!(
        h.contains(r#"{"op":"output","index":2,"inputs":[3],"type":{"dtype":"i64","shape":[]}}"#),
        "{h}"
    );
}

#[test]
fn a_scan_nested_in_a_branch_round_trips() {
    let bytes = assert_round_trip(scan_in_branch());
    let h = header(&bytes);
    assert!(
        h.contains(r#"{"op":"cond","then_branch":{"nodes":[{"op":"input","name":"xs","#),
        "{h}"
    );
    assert!(h.contains(
        r#""op":"scan","carries":1,"scanned":1,"length":4,"reverse":true,"checkpoint":2,"body":"#
    ));
}

#[test]
fn graphs_nested_as_deep_as_the_verifier_allows_read_back() {
    // Also a check of the header's JSON depth bound, which must leave room
    // for eight levels of loop bodies.
    assert_round_trip(nested_scans(8));
    assert!(write_model(&model(nested_scans(9))).is_err());
}

// ---- refusals --------------------------------------------------------------

#[test]
fn nesting_beyond_the_limit_is_refused_naming_the_node_and_depth() {
    let file = write_model(&model(nested_scans(3))).unwrap();
    let at = |max_nesting| ReadLimits {
        max_nesting,
        ..ReadLimits::default()
    };
    assert!(read_model_with_limits(&file, &at(3)).is_ok());
    // Each level is node 1 (the scan) of the graph above it.
    assert_eq!(
        read_err(&file, &at(2)),
        "entry point `e`, node 1, scan body, node 1, scan body, node 1: \
         nested graph depth is 3, which exceeds the limit of 2"
    );
    // Two levels too deep is refused before the header is parsed.
    assert_eq!(
        read_err(&file, &at(1)),
        "header JSON nesting depth is 14, which exceeds the limit of 13"
    );
    // Branches nest like bodies.
    let file = write_model(&model(scan_in_branch())).unwrap();
    assert_err(
        &file,
        &at(1),
        "entry point `e`, node 2, cond then_branch, node 2: nested graph depth is 2, which exceeds the limit of 1",
    );
    let file = write_model(&model(count_to(10))).unwrap();
    assert_err(
        &file,
        &at(0),
        "entry point `e`, node 3: nested graph depth is 1, which exceeds the limit of 0",
    );
}

#[test]
fn nested_graphs_count_against_max_graphs() {
    // The entry point and two branches.
    let file = write_model(&model(choose())).unwrap();
    let limits = |max_graphs| ReadLimits {
        max_graphs,
        ..ReadLimits::default()
    };
    assert!(read_model_with_limits(&file, &limits(3)).is_ok());
    assert_err(
        &file,
        &limits(2),
        "number of graphs is 3, which exceeds the limit of 2",
    );
}

#[test]
fn max_trips_over_the_limit_is_refused_naming_it() {
    let graph = count_to(100);
    let node = position(&graph, |op| matches!(op, Op::WhileLoop(_)));
    let file = write_model(&model(graph)).unwrap();
    let limits = ReadLimits {
        max_while_trips: 50,
        ..ReadLimits::default()
    };
    assert_eq!(
        read_err(&file, &limits),
        format!(
            "entry point `e`, node {node}: attribute `max_trips` is 100, which exceeds the limit of 50"
        )
    );
    // The IR's own bound is the default and cannot be raised.
    let at_bound = edit_header(&file, |h| {
        replace_once(
            h,
            r#""max_trips":100"#,
            &format!(r#""max_trips":{MAX_WHILE_TRIPS}"#),
        )
    });
    assert!(read_model(&at_bound).is_ok());
    let over = edit_header(&file, |h| {
        replace_once(
            h,
            r#""max_trips":100"#,
            &format!(r#""max_trips":{}"#, MAX_WHILE_TRIPS + 1),
        )
    });
    let unbounded = ReadLimits {
        max_while_trips: usize::MAX,
        ..ReadLimits::default()
    };
    for limits in [ReadLimits::default(), unbounded] {
        assert_err(
            &over,
            &limits,
            &format!(
                "attribute `max_trips` is {}, which exceeds the limit of {MAX_WHILE_TRIPS}",
                MAX_WHILE_TRIPS + 1
            ),
        );
    }
    // Zero trips is within the limit but not a loop: the verifier says so.
    let zero = edit_header(&file, |h| {
        replace_once(h, r#""max_trips":100"#, r#""max_trips":0"#)
    });
    assert_err(
        &zero,
        &ReadLimits::default(),
        "max_trips is 0; it must be between 1 and",
    );
}

#[test]
fn control_flow_attributes_are_exact() {
    let graph = running_total(Dim::Fixed(5), false);
    let node = position(&graph, |op| matches!(op, Op::Scan(_)));
    let file = write_model(&model(graph)).unwrap();
    let limits = ReadLimits::default();
    let at = format!("entry point `e`, node {node}: ");
    for attr in [
        r#""reverse":false,"#,
        r#""checkpoint":0,"#,
        r#""length":5,"#,
        r#""carries":1,"#,
    ] {
        let name = attr.split('"').nth(1).unwrap();
        let bad = edit_header(&file, |h| replace_once(h, attr, ""));
        assert_eq!(
            read_err(&bad, &limits),
            format!("{at}op `scan` lacks attribute `{name}`")
        );
    }
    let bad = edit_header(&file, |h| remove_object(h, "body"));
    assert_eq!(
        read_err(&bad, &limits),
        format!("{at}op `scan` lacks attribute `body`")
    );
    let bad = edit_header(&file, |h| {
        replace_once(h, r#""op":"scan","#, r#""op":"scan","max_trips":3,"#)
    });
    assert_err(&bad, &limits, "op `scan` has no attribute `max_trips`");
    let bad = edit_header(&file, |h| {
        replace_once(h, r#""op":"output","index":0,"#, r#""op":"output","#)
    });
    assert_err(&bad, &limits, "op `output` lacks attribute `index`");
    let bad = edit_header(&file, |h| {
        replace_once(
            h,
            r#""op":"output","index":0,"#,
            r#""op":"output","index":0,"axis":0,"#,
        )
    });
    assert_err(&bad, &limits, "op `output` has no attribute `axis`");

    let file = write_model(&model(choose())).unwrap();
    let bad = edit_header(&file, |h| remove_object(h, "else_branch"));
    assert_err(&bad, &limits, "op `cond` lacks attribute `else_branch`");
    let file = write_model(&model(count_to(10))).unwrap();
    let bad = edit_header(&file, |h| remove_object(h, "cond"));
    assert_err(&bad, &limits, "op `while_loop` lacks attribute `cond`");
}

#[test]
fn a_scan_length_is_bounded_like_a_dimension() {
    let file = write_model(&model(running_total(Dim::Fixed(5), false))).unwrap();
    let bad = edit_header(&file, |h| {
        replace_once(h, r#""length":5"#, r#""length":4294967296"#)
    });
    assert_err(
        &bad,
        &ReadLimits::default(),
        "attribute `length` = 4294967296 exceeds the limit of 4294967295",
    );
    let bad = edit_header(&file, |h| {
        replace_once(h, r#""length":5"#, r#""length":"M""#)
    });
    assert_err(&bad, &ReadLimits::default(), "header is not valid");
    // A length that disagrees with the scanned input is the verifier's.
    let bad = edit_header(&file, |h| {
        replace_once(h, r#""length":5"#, r#""length":"N""#)
    });
    assert_err(
        &bad,
        &ReadLimits::default(),
        "whose leading axis is not the length N",
    );
}

#[test]
fn an_output_past_the_results_is_refused() {
    let file = write_model(&model(running_total(Dim::Fixed(5), false))).unwrap();
    let bad = edit_header(&file, |h| {
        replace_once(
            h,
            r#""op":"output","index":1,"#,
            r#""op":"output","index":2,"#,
        )
    });
    assert_err(
        &bad,
        &ReadLimits::default(),
        "(output): reads result 2 of %3, which has 2",
    );
}

#[test]
fn control_flow_needs_a_file_declaring_opset_3() {
    let mut file = write_model(&model(choose())).unwrap();
    file[10..12].copy_from_slice(&2u16.to_le_bytes());
    fix_digest(&mut file);
    assert_err(
        &file,
        &ReadLimits::default(),
        "entry point `e` uses `cond`, an opset-3 op, but the file declares opset 2",
    );
}

#[test]
fn data_section_tensors_follow_the_nested_graphs_in_attribute_order() {
    // The loop's cond holds a 100-element constant and its body an
    // 81-element one; both are in the data section, cond's first.
    let file = write_model(&model(count_to(10))).unwrap();
    let h = header(&file);
    let cond_data = h.find(r#""data":{"offset":0,"bytes":400}"#).unwrap();
    let body_data = h.find(r#""data":{"offset":448,"bytes":324}"#).unwrap();
    assert!(cond_data < body_data, "{h}");
    let back = read_model(&file).unwrap();
    let Op::WhileLoop(w) = &back.entry_points["e"].nodes()[3].op else {
        panic!("node 3 is the loop")
    };
    let Op::Constant(cap) = &w.cond.nodes()[3].op else {
        panic!("node 3 of the cond is its constant")
    };
    let want: Vec<f32> = (0..100).map(|i| 100.0 + i as f32 * 0.25).collect();
    assert_eq!(cap.as_f32().unwrap(), &want[..]);
}

/// A file's control-flow node with many results is read in time linear in
/// them: each `output` looks its type up instead of re-deriving all of
/// them (quadratically, 50,000 results would take the reader hours).
#[test]
fn a_node_with_many_results_reads_back() {
    let results = 50_000;
    let mut branch = Graph::new();
    let x = branch.input("x", f32s(&[])).unwrap();
    branch
        .set_outputs((0..results).map(|r| (format!("r{r}"), x)).collect())
        .unwrap();
    let cond = Cond {
        then_branch: branch.clone(),
        else_branch: branch,
    };
    let mut g = Graph::new();
    let pred = g.input("pred", TensorType::scalar(DType::Bool)).unwrap();
    let x = g.input("x", f32s(&[])).unwrap();
    let outs = g.push_tuple(Op::Cond(Box::new(cond)), &[pred, x]).unwrap();
    g.set_output("last", outs[results - 1]).unwrap();
    let bytes = write_model(&model(g.clone())).unwrap();
    assert_eq!(read_model(&bytes).unwrap().entry_points["e"], g);
}
