//! Control flow as ONNX's own (opset 17): `scan` as `Scan`, `cond` as
//! `If`, `while_loop` as `Loop`, each body or branch a subgraph. The
//! control-flow node's results are the ONNX node's outputs, named after
//! the `output` nodes that read them.
//!
//! A body reads the values it does not step through (a scan's or a loop's
//! constants, a branch's operands) from the outer scope, by name: ONNX
//! Runtime passes such a value to the body as it is, where a state
//! variable passed through unchanged would be copied from trip to trip.

use std::slice;

use canopy_ir::{Buffer, Cond, DType, Dim, Scan, TensorData, TensorType, ValueId, WhileLoop};

use super::{Exporter, attr_int, attr_ints, node_proto, value_info};
use crate::error::OnnxError;
use crate::proto::{AttributeProto, GraphProto, attribute_type};

fn attr_graph(name: &str, graph: GraphProto) -> AttributeProto {
    AttributeProto {
        name: name.to_string(),
        r#type: attribute_type::GRAPH,
        g: Some(graph),
        ..Default::default()
    }
}

fn operand_names(ex: &Exporter<'_>, id: ValueId) -> Vec<String> {
    let node = ex.graph().node(id);
    node.inputs.iter().map(|&i| ex.name(i)).collect()
}

/// ONNX `Scan`: the carries are its state variables, the `xs` its scan
/// inputs, the stacked `y`s its scan outputs; `reverse` reverses every
/// scan input and output, so step t still reads `xs[t]` and writes
/// `ys[t]`.
pub(super) fn scan<'g>(
    ex: &mut Exporter<'g>,
    id: ValueId,
    scan: &'g Scan,
) -> Result<(), OnnxError> {
    let operands = operand_names(ex, id);
    let base = ex.name(id);
    let body_base = format!("{base}/body");
    let body = &scan.body;
    let stepped = scan.carries + scan.scanned;
    let mut inputs = Vec::with_capacity(operands.len());
    let mut declared = Vec::with_capacity(stepped + 1);
    for (k, &input) in body.inputs().iter().enumerate() {
        if k < stepped {
            let name = ex.fresh(&format!("{body_base}/{}", body.input_name(input)));
            declared.push(value_info(&name, body.ty(input)));
            inputs.push(name);
        } else {
            inputs.push(operands[k].clone());
        }
    }
    let mut scan_inputs = operands[..stepped].to_vec();
    if scan.scanned == 0 {
        // ONNX's Scan counts its steps from a scan input, so a scan with
        // none steps through one of `length` elements that the body ignores.
        scan_inputs.push(steps(ex, id, scan.length, &base)?);
        let name = ex.fresh(&format!("{body_base}/step"));
        declared.push(value_info(&name, &TensorType::scalar(DType::Bool)));
    }
    let graph = ex.subgraph(body, &body_base, inputs, declared)?;
    let direction = i64::from(scan.reverse);
    let scanned = scan.scanned.max(1);
    let mut attrs = vec![
        attr_graph("body", graph),
        attr_int("num_scan_inputs", scanned as i64),
        attr_ints("scan_input_directions", &vec![direction; scanned]),
    ];
    let ys = scan.ys();
    if ys > 0 {
        attrs.push(attr_ints("scan_output_directions", &vec![direction; ys]));
    }
    let outputs = (0..scan.carries + ys)
        .map(|k| ex.result_name(id, k))
        .collect();
    ex.emit_outputs("Scan", scan_inputs, outputs, attrs);
    Ok(())
}

/// A tensor of `length` elements: the batch mask for the batch
/// dimension, else a constant false expanded to the length (an
/// initializer of that many elements would bloat the file).
fn steps(ex: &mut Exporter<'_>, id: ValueId, length: Dim, base: &str) -> Result<String, OnnxError> {
    match length {
        Dim::Batch => ex.batch_mask(id),
        Dim::Fixed(n) => {
            let no = TensorData::new(Vec::new(), Buffer::Bool(vec![false]))
                .expect("a scalar holds one element");
            let no = ex.constant(base, "step", &no);
            let shape = ex.constant_i64(base, "steps", &[n as i64]);
            Ok(ex.emit_temp(base, "Expand", vec![no, shape], Vec::new()))
        }
    }
}

/// ONNX `If` on the predicate; each branch a subgraph with no inputs
/// that reads the operands from the outer scope.
pub(super) fn cond<'g>(
    ex: &mut Exporter<'g>,
    id: ValueId,
    cond: &'g Cond,
) -> Result<(), OnnxError> {
    let operands = operand_names(ex, id);
    let base = ex.name(id);
    let reads = operands[1..].to_vec();
    let then_branch = ex.subgraph(
        &cond.then_branch,
        &format!("{base}/then"),
        reads.clone(),
        Vec::new(),
    )?;
    let else_branch = ex.subgraph(
        &cond.else_branch,
        &format!("{base}/else"),
        reads,
        Vec::new(),
    )?;
    let outputs = (0..cond.then_branch.outputs().len())
        .map(|k| ex.result_name(id, k))
        .collect();
    let attrs = vec![
        attr_graph("then_branch", then_branch),
        attr_graph("else_branch", else_branch),
    ];
    ex.emit_outputs("If", vec![operands[0].clone()], outputs, attrs);
    Ok(())
}

/// ONNX `Loop` with `M = max_trips`. ONNX's body returns the condition of
/// the next trip, so the IR condition is inlined twice: before the loop,
/// on the initial carries (the loop's `cond` input), and at the end of the
/// body, on the new carries. The trip count is one more loop-carried
/// value, an i64 from 0 that each trip adds one to.
pub(super) fn while_loop<'g>(
    ex: &mut Exporter<'g>,
    id: ValueId,
    w: &'g WhileLoop,
) -> Result<(), OnnxError> {
    let operands = operand_names(ex, id);
    let base = ex.name(id);
    let carries = w.carries;
    let consts = &operands[carries..];

    let go = ex.fresh(&format!("{base}/go"));
    ex.enter(
        &w.cond,
        &format!("{base}/cond"),
        operands.clone(),
        slice::from_ref(&go),
    );
    ex.lower_scope()?;
    let nodes = ex.leave(slice::from_ref(&go));
    ex.extend(nodes);

    let body_base = format!("{base}/body");
    let iteration = ex.fresh(&format!("{body_base}/iteration"));
    let cond_in = ex.fresh(&format!("{body_base}/cond_in"));
    let carries_in: Vec<String> = w.body.inputs()[..carries]
        .iter()
        .map(|&input| ex.fresh(&format!("{body_base}/{}", w.body.input_name(input))))
        .collect();
    let trips_in = ex.fresh(&format!("{body_base}/trips"));
    let carries_out: Vec<String> = w
        .body
        .outputs()
        .iter()
        .map(|(name, _)| ex.fresh(&format!("{body_base}/{name}")))
        .collect();
    let mut inputs = carries_in.clone();
    inputs.extend_from_slice(consts);
    ex.enter(&w.body, &body_base, inputs, &carries_out);
    ex.lower_scope()?;
    let mut nodes = ex.leave(&carries_out);

    let go_next = ex.fresh(&format!("{body_base}/go"));
    let mut inputs = carries_out.clone();
    inputs.extend_from_slice(consts);
    ex.enter(
        &w.cond,
        &format!("{body_base}/cond"),
        inputs,
        slice::from_ref(&go_next),
    );
    ex.lower_scope()?;
    nodes.extend(ex.leave(slice::from_ref(&go_next)));

    let one = ex.constant_scalar_i64(&base, "one", 1);
    let trips_out = ex.fresh(&format!("{body_base}/trips_next"));
    nodes.push(node_proto(
        "Add",
        vec![trips_in.clone(), one],
        vec![trips_out.clone()],
        Vec::new(),
    ));

    let i64_scalar = TensorType::scalar(DType::I64);
    let bool_scalar = TensorType::scalar(DType::Bool);
    let mut declared = vec![
        value_info(&iteration, &i64_scalar),
        value_info(&cond_in, &bool_scalar),
    ];
    declared.extend(
        carries_in
            .iter()
            .zip(w.body.inputs())
            .map(|(name, &input)| value_info(name, w.body.ty(input))),
    );
    declared.push(value_info(&trips_in, &i64_scalar));
    let mut output = vec![value_info(&go_next, &bool_scalar)];
    output.extend(
        carries_out
            .iter()
            .zip(w.body.outputs())
            .map(|(name, (_, value))| value_info(name, w.body.ty(*value))),
    );
    output.push(value_info(&trips_out, &i64_scalar));
    let body = GraphProto {
        node: nodes,
        name: body_base,
        input: declared,
        output,
        ..Default::default()
    };

    let max_trips = ex.constant_scalar_i64(&base, "max_trips", w.max_trips as i64);
    let zero = ex.constant_scalar_i64(&base, "trips0", 0);
    let mut loop_inputs = vec![max_trips, go];
    loop_inputs.extend_from_slice(&operands[..carries]);
    loop_inputs.push(zero);
    let outputs = (0..=carries).map(|k| ex.result_name(id, k)).collect();
    ex.emit_outputs("Loop", loop_inputs, outputs, vec![attr_graph("body", body)]);
    Ok(())
}
