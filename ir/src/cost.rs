//! The static cost of running a graph at one batch size: its floating-point
//! operations and the most bytes its values hold at once. Pure arithmetic
//! on the declared types, so a server can bound a model before anything
//! allocates (central evaluation, `server/src/central.rs`).
//!
//! Shapes come from files, so every count saturates at `u64::MAX` rather
//! than overflowing: an absurd graph costs "too much", never a panic.
//!
//! The memory model is the CPU executor's: a node's value lives from its
//! definition to its last reader (outputs to the end of the run), and
//! graph inputs and constants live the whole run (the caller's, or the
//! executable's, for every batch). The peak is the most live bytes while
//! any node runs, its operands included. In-place reuse only lowers the
//! real figure, so this is an upper bound of what the values need.

use crate::graph::{Graph, Node};
use crate::op::{Op, Pool2dAttrs};
use crate::types::TensorType;

/// What running a graph once costs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphCost {
    /// Floating-point (and comparable integer) operations: a multiply-add
    /// counts two.
    pub flops: u64,
    /// The most bytes live values hold at once.
    pub peak_bytes: u64,
}

/// Operations per element of a softmax or log-softmax: the max, the
/// subtraction, the exponential, the sum and the division or logarithm.
const SOFTMAX_FLOPS_PER_ELEMENT: u64 = 5;

/// The cost of running `graph` once with its batch dimension bound to
/// `batch`.
pub fn graph_cost(graph: &Graph, batch: usize) -> GraphCost {
    GraphCost {
        flops: flops(graph, batch),
        peak_bytes: peak_bytes(graph, batch),
    }
}

/// Elements of a value at this batch size.
fn elements(ty: &TensorType, batch: usize) -> u64 {
    ty.shape.dims().iter().fold(1u64, |count, dim| {
        count.saturating_mul(dim.resolve(batch) as u64)
    })
}

fn bytes(ty: &TensorType, batch: usize) -> u64 {
    elements(ty, batch).saturating_mul(ty.dtype.size_bytes() as u64)
}

/// A dimension of a value, counted from its end (1 when the rank is short).
fn dim_from_end(ty: &TensorType, from_end: usize, batch: usize) -> u64 {
    let dims = ty.shape.dims();
    dims.len()
        .checked_sub(from_end)
        .map_or(1, |i| dims[i].resolve(batch) as u64)
}

fn flops(graph: &Graph, batch: usize) -> u64 {
    graph.nodes().iter().fold(0u64, |total, node| {
        total.saturating_add(node_flops(graph, node, batch))
    })
}

/// One node's operations. Every op is listed, so a new op must be costed.
fn node_flops(graph: &Graph, node: &Node, batch: usize) -> u64 {
    let (op, out) = (&node.op, &node.ty);
    let operand = |i: usize| graph.ty(node.inputs[i]);
    let out_elements = elements(out, batch);
    match op {
        Op::Input { .. } | Op::Constant(_) => 0,
        // One operation (or copy) per output element.
        Op::Unary(_)
        | Op::Binary(_)
        | Op::Where
        | Op::Cast { .. }
        | Op::Reshape { .. }
        | Op::Transpose { .. }
        | Op::Broadcast { .. }
        | Op::Slice { .. }
        | Op::Pad { .. }
        | Op::Concat { .. }
        | Op::Gather { .. }
        | Op::OneHot { .. }
        | Op::RandomUniform { .. } => out_elements,
        // One per element read.
        Op::Reduce { .. } | Op::ArgMax { .. } => elements(operand(0), batch),
        Op::Softmax { .. } | Op::LogSoftmax { .. } => {
            out_elements.saturating_mul(SOFTMAX_FLOPS_PER_ELEMENT)
        }
        // Zeros of the output, then each update added.
        Op::ScatterAdd { .. } => out_elements.saturating_add(elements(operand(1), batch)),
        // 2·m·n·k for each of the broadcast batch's products.
        Op::MatMul { transpose_a, .. } => {
            let k = dim_from_end(operand(0), if *transpose_a { 2 } else { 1 }, batch);
            out_elements.saturating_mul(k).saturating_mul(2)
        }
        // x [N, C, H, W], w [O, C, KH, KW]: 2·C·KH·KW per output element.
        Op::Conv2d(_) => {
            let w = operand(1);
            let per_output = filter_volume(w, batch);
            out_elements.saturating_mul(per_output).saturating_mul(2)
        }
        // (dy, w): the convolution's products, run backwards.
        Op::Conv2dBackwardInput { .. } => {
            let per_output = filter_volume(operand(1), batch);
            elements(operand(0), batch)
                .saturating_mul(per_output)
                .saturating_mul(2)
        }
        // (x, dy) → w [O, C, KH, KW]: each dy element meets C·KH·KW inputs.
        Op::Conv2dBackwardFilter { .. } => elements(operand(1), batch)
            .saturating_mul(filter_volume(out, batch))
            .saturating_mul(2),
        Op::MaxPool2d(attrs) | Op::AvgPool2d(attrs) | Op::MaxPool2dSelect(attrs) => {
            window_flops(out_elements, attrs)
        }
        // (x, dy): each dy element searches its window in x.
        Op::MaxPool2dBackward(attrs) => {
            window_flops(elements(operand(1), batch), attrs).saturating_add(out_elements)
        }
        Op::AvgPool2dBackward { attrs, .. } => {
            window_flops(elements(operand(0), batch), attrs).saturating_add(out_elements)
        }
        Op::CustomGrad(custom) => flops(&custom.forward, batch),
        // The results are moved out of the tuple, not copied.
        Op::Output { .. } => 0,
        Op::Scan(scan) => {
            let trips = scan.length.resolve(batch) as u64;
            flops(&scan.body, batch).saturating_mul(trips)
        }
        // Costed as the dearer branch: either may run.
        Op::Cond(cond) => flops(&cond.then_branch, batch).max(flops(&cond.else_branch, batch)),
        Op::WhileLoop(w) => {
            let trip = flops(&w.body, batch).saturating_add(flops(&w.cond, batch));
            trip.saturating_mul(w.max_trips as u64)
        }
    }
}

/// The bytes a node's value holds: all of a control-flow node's results
/// (an `output` reading one then counts it again until the tuple's last
/// reader, which only raises the bound).
fn node_bytes(graph: &Graph, index: usize, batch: usize) -> u64 {
    let node = &graph.nodes()[index];
    if !node.op.is_tuple() {
        return bytes(&node.ty, batch);
    }
    let results = graph
        .results(crate::ValueId(index as u32))
        .unwrap_or_else(|_| vec![node.ty.clone()]);
    results
        .iter()
        .fold(0u64, |sum, ty| sum.saturating_add(bytes(ty, batch)))
}

/// The most bytes an op's nested graphs hold while it runs.
fn inner_peak_bytes(op: &Op, batch: usize) -> u64 {
    match op {
        Op::CustomGrad(custom) => peak_bytes(&custom.forward, batch),
        _ => op
            .subgraphs()
            .iter()
            .map(|g| peak_bytes(g, batch))
            .max()
            .unwrap_or(0),
    }
}

/// C·KH·KW of a filter [O, C, KH, KW].
fn filter_volume(w: &TensorType, batch: usize) -> u64 {
    (1..=3).fold(1u64, |volume, from_end| {
        volume.saturating_mul(dim_from_end(w, from_end, batch))
    })
}

fn window_flops(windows: u64, attrs: &Pool2dAttrs) -> u64 {
    windows.saturating_mul((attrs.kernel[0] as u64).saturating_mul(attrs.kernel[1] as u64))
}

/// The most bytes live at once over the graph's schedule (node order).
fn peak_bytes(graph: &Graph, batch: usize) -> u64 {
    let nodes = graph.nodes();
    let end = nodes.len();
    // The last node that reads each value; outputs, inputs and constants
    // live to the end.
    let mut last_use: Vec<usize> = (0..end).collect();
    for (index, node) in nodes.iter().enumerate() {
        for input in &node.inputs {
            last_use[input.index()] = last_use[input.index()].max(index);
        }
        if matches!(node.op, Op::Input { .. } | Op::Constant(_)) {
            last_use[index] = end;
        }
    }
    for (_, value) in graph.outputs() {
        last_use[value.index()] = end;
    }
    let mut freed_after: Vec<u64> = vec![0; end];
    for (index, &last) in last_use.iter().enumerate() {
        if last < end {
            freed_after[last] = freed_after[last].saturating_add(node_bytes(graph, index, batch));
        }
    }
    let (mut live, mut peak) = (0u64, 0u64);
    for (index, node) in nodes.iter().enumerate() {
        live = live.saturating_add(node_bytes(graph, index, batch));
        // A call's or a loop's body holds its own values while it runs.
        let inner = inner_peak_bytes(&node.op, batch);
        peak = peak.max(live.saturating_add(inner));
        live = live.saturating_sub(freed_after[index]);
    }
    peak
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::TensorData;
    use crate::op::{Conv2dAttrs, UnaryOp};
    use crate::types::{DType, Dim, Shape};

    fn batch_input(graph: &mut Graph, name: &str, features: &[usize]) -> crate::ValueId {
        let mut dims = vec![Dim::Batch];
        dims.extend(features.iter().map(|&d| Dim::Fixed(d)));
        graph
            .input(name, TensorType::new(DType::F32, Shape(dims)))
            .expect("input")
    }

    /// x [N, 4] → matmul w1 [4, 3] → relu → matmul w2 [3, 2] → out.
    #[test]
    fn an_mlp_costs_its_products_and_holds_its_widest_step() {
        let mut graph = Graph::new();
        let w1 = graph.input("w1", TensorType::f32(&[4, 3])).expect("w1");
        let w2 = graph.input("w2", TensorType::f32(&[3, 2])).expect("w2");
        let x = batch_input(&mut graph, "x", &[4]);
        let h = graph.matmul(x, w1).expect("h");
        let a = graph.relu(h).expect("relu");
        let out = graph.matmul(a, w2).expect("out");
        graph.set_output("out", out).expect("output");
        let cost = graph_cost(&graph, 10);
        // 2·10·3·4 + 10·3 + 2·10·2·3.
        assert_eq!(cost.flops, 240 + 30 + 120);
        // Inputs live throughout: w1 48 B, w2 24 B, x 160 B = 232 B. h
        // (120 B) is live while relu writes a (120 B): 472 B. Then h
        // goes; out (80 B) beside a: 232 + 120 + 80 = 432 B.
        assert_eq!(cost.peak_bytes, 472);
        assert_eq!(graph_cost(&graph, 1).flops, 24 + 3 + 12);
    }

    /// x [N, 2, 5, 5] conv w [3, 2, 3, 3], stride 1, pad 1 → [N, 3, 5, 5].
    #[test]
    fn a_convolution_costs_two_per_filter_tap_per_output() {
        let mut graph = Graph::new();
        let x = batch_input(&mut graph, "x", &[2, 5, 5]);
        let w = graph
            .constant(TensorData::zeros(DType::F32, vec![3, 2, 3, 3]))
            .expect("w");
        let attrs = Conv2dAttrs {
            padding: [1, 1],
            ..Conv2dAttrs::default()
        };
        let y = graph.conv2d(x, w, attrs).expect("conv");
        let pooled = graph
            .max_pool2d(
                y,
                Pool2dAttrs {
                    kernel: [2, 2],
                    stride: [2, 2],
                    padding: [0, 0],
                },
            )
            .expect("pool");
        graph.set_output("y", pooled).expect("output");
        let cost = graph_cost(&graph, 4);
        // Output 4·3·5·5 = 300 elements, 2·2·3·3 = 36 each; the pool reads
        // 4 per output of 4·3·2·2 = 48.
        assert_eq!(cost.flops, 300 * 36 + 48 * 4);
        // x 800 B + w 216 B + y 1200 B + pooled 192 B, all live at the pool.
        assert_eq!(cost.peak_bytes, 800 + 216 + 1200 + 192);
    }

    /// The model: 64 features broadcast to [N, 64, 2^24], then a
    /// tanh: 4 GiB per sample at each, 2 TiB at a batch of 256.
    #[test]
    fn an_expansion_to_two_to_the_twenty_four_is_seen_before_it_runs() {
        let mut graph = Graph::new();
        let x = batch_input(&mut graph, "x", &[64]);
        let column = graph
            .reshape(x, vec![Dim::Batch, Dim::Fixed(64), Dim::Fixed(1)])
            .expect("reshape");
        let wide = graph
            .broadcast(
                column,
                vec![Dim::Batch, Dim::Fixed(64), Dim::Fixed(1 << 24)],
            )
            .expect("broadcast");
        let squashed = graph.unary(UnaryOp::Tanh, wide).expect("tanh");
        let mean = graph.mean(squashed, &[2], false).expect("mean");
        graph.set_output("mean", mean).expect("output");
        let one = graph_cost(&graph, 1);
        let gib = 1u64 << 30;
        assert!(one.peak_bytes > 8 * gib, "{}", one.peak_bytes);
        assert!(one.peak_bytes < 8 * gib + 4096, "{}", one.peak_bytes);
        let full = graph_cost(&graph, 256);
        assert!(full.peak_bytes > 2 * 1024 * gib, "{}", full.peak_bytes);
        // Broadcast, tanh and mean each touch 256·64·2^24 elements.
        assert!(full.flops >= (3 * 256 * 64) << 24, "{}", full.flops);
    }

    /// Shapes no machine holds saturate instead of overflowing.
    #[test]
    fn absurd_shapes_saturate() {
        let mut graph = Graph::new();
        let x = batch_input(&mut graph, "x", &[1 << 40, 1 << 40]);
        let y = graph.matmul_t(x, x, false, true).expect("matmul");
        graph.set_output("y", y).expect("output");
        let cost = graph_cost(&graph, usize::MAX);
        assert_eq!(cost.flops, u64::MAX);
        assert_eq!(cost.peak_bytes, u64::MAX);
    }
}
