//! The GPU's side of fusion (the rule is `crate::fuse`, shared with the
//! CPU): which nodes its generated kernels compute per element, decided per
//! plan, so per batch size, with every shape resolved. The IR graph is not
//! touched: fusion is a grouping of its nodes that the plan reads.
//!
//! A member is a node of [`Family::Elementwise`] with at least one element
//! (a broadcast is one: inside a group it is its operand read with
//! broadcast indexing, as its own kernel reads it). Nothing heads a GPU
//! group: a matmul stays its own dispatch. The input limit keeps a
//! kernel's bindings (inputs, output, flags) within the adapter's
//! `maxStorageBuffersPerShaderStage`.
//!
//! *Why.* Each dispatch inside one submission costs 2–5 µs on an H100
//! whatever it computes, and each materialised intermediate is written and
//! read back through memory.

use canopy_ir::{Graph, Op};

use super::kernels::Family;
pub use crate::fuse::{Fusion, Group, MAX_INPUTS};

/// Whether the fused kernel generator computes `op` per element: the ops
/// of [`Family::Elementwise`].
pub fn is_elementwise(op: &Op) -> bool {
    Family::of(op) == Family::Elementwise
}

/// Groups `graph`'s elementwise nodes, with `shapes` resolved for the plan
/// and at most `max_inputs` external inputs per group.
pub fn plan(graph: &Graph, shapes: &[Vec<usize>], max_inputs: usize) -> Fusion {
    let nodes = graph.nodes();
    let elementwise =
        |i: usize| is_elementwise(&nodes[i].op) && shapes[i].iter().product::<usize>() > 0;
    Fusion::plan(
        graph,
        &crate::fuse::Rule {
            elementwise: &elementwise,
            head: &|_| false,
            same_shape: &|a, b| shapes[a] == shapes[b],
            max_inputs,
        },
    )
}

#[cfg(test)]
mod tests {
    use canopy_ir::{Graph, TensorType};

    use super::*;

    #[test]
    fn a_matmul_never_joins_and_an_empty_value_stays_its_own() {
        let mut g = Graph::new();
        let x = g.input("x", TensorType::f32(&[4, 3])).unwrap();
        let w = g.input("w", TensorType::f32(&[3, 3])).unwrap();
        let product = g.matmul(x, w).unwrap();
        let raised = g.exp(product).unwrap();
        let out = g.neg(raised).unwrap();
        g.set_output("out", out).unwrap();
        let shapes: Vec<Vec<usize>> = g.nodes().iter().map(|n| n.ty.shape.resolve(1)).collect();
        let fusion = plan(&g, &shapes, MAX_INPUTS);
        assert_eq!(
            fusion.group(&g, out.index()).members,
            [raised.index(), out.index()]
        );
        assert!(!fusion.is_fused_away(product.index()));
        let empty: Vec<Vec<usize>> = shapes.iter().map(|_| vec![0]).collect();
        let fusion = plan(&g, &empty, MAX_INPUTS);
        assert!(!fusion.is_fused_away(raised.index()));
    }
}
