//! Fusion of elementwise nodes into one kernel, decided per plan (so per
//! batch size, with every shape resolved). The IR graph is not touched:
//! fusion is a grouping of its nodes that the plan reads.
//!
//! **The rule.** Every node is in exactly one group, and a group's value
//! is its *root*, the one member that is materialised in a buffer. A node
//! joins its consumer's group when
//! - it is elementwise (its kernel family is `Family::Elementwise`), and
//!   so is the root;
//! - it has the group's output shape and at least one element (operands
//!   of another shape, broadcast ones, stay *inputs* of the group and are
//!   read with broadcast indexing);
//! - it is not a graph output (returned values and the outputs that
//!   replace resident state stay materialised);
//! - every one of its consumers is already in that group (so nothing
//!   outside the group ever needs its value);
//! - and the group stays within [`MAX_MEMBERS`] nodes and the external
//!   input limit (distinct values read from outside the group), which
//!   keeps the bindings (inputs, output, flags) within the adapter's
//!   `maxStorageBuffersPerShaderStage`.
//!
//! Nodes are visited from the last to the first, so a node's consumers
//! have been placed when it is; a node that cannot join starts a group of
//! its own. A group that hits a limit is simply closed: the node that did
//! not fit is the root of the next group, whose value the first group reads.
//!
//! *Why.* Each dispatch inside one submission costs 2–5 µs on an H100
//! whatever it computes, and each materialised intermediate is written
//! and read back through memory; an optimizer update or an activation's
//! gradient is a chain of a handful of elementwise nodes, which one
//! kernel computes in registers.

use canopy_ir::{Graph, Op};

use super::kernels::Family;

/// The most nodes one fused kernel computes; bounds the generated source.
pub const MAX_MEMBERS: usize = 32;

/// The most distinct values one fused kernel reads, before the adapter's
/// binding limit lowers it.
pub const MAX_INPUTS: usize = 8;

/// One group: its members in topological order, the last being the root.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Group {
    pub members: Vec<usize>,
    /// Distinct values read from outside the group, in first-read order
    /// (in topological order of the members); these are the kernel's
    /// operand bindings.
    pub inputs: Vec<usize>,
}

impl Group {
    pub fn root(&self) -> usize {
        *self.members.last().expect("a group has its root")
    }
}

/// A graph's nodes grouped for one plan.
#[derive(Clone, Debug)]
pub struct Fusion {
    /// Per node: the root of its group (itself when materialised).
    root_of: Vec<usize>,
    /// Per root: its group's members (the other nodes have none).
    members: Vec<Vec<usize>>,
}

/// Whether the fused kernel generator computes `op` per element: the ops
/// of [`Family::Elementwise`]. A broadcast is one: inside a group it is
/// its operand read with broadcast indexing, as its own kernel reads it.
pub fn is_elementwise(op: &Op) -> bool {
    Family::of(op) == Family::Elementwise
}

impl Fusion {
    /// No fusion: every node is its own group.
    pub fn none(graph: &Graph) -> Fusion {
        let n = graph.nodes().len();
        Fusion {
            root_of: (0..n).collect(),
            members: (0..n).map(|index| vec![index]).collect(),
        }
    }

    /// Groups `graph`'s elementwise nodes by the module's rule, with
    /// `shapes` resolved for the plan and at most `max_inputs` external
    /// inputs per group.
    pub fn plan(graph: &Graph, shapes: &[Vec<usize>], max_inputs: usize) -> Fusion {
        let nodes = graph.nodes();
        let mut consumers: Vec<Vec<usize>> = vec![Vec::new(); nodes.len()];
        for (index, node) in nodes.iter().enumerate() {
            for input in &node.inputs {
                consumers[input.index()].push(index);
            }
        }
        let mut is_output = vec![false; nodes.len()];
        for (_, id) in graph.outputs() {
            is_output[id.index()] = true;
        }
        let mut fusion = Fusion::none(graph);
        // Per root: the distinct values its group reads from outside.
        let mut inputs: Vec<Vec<usize>> = nodes
            .iter()
            .map(|node| distinct(node.inputs.iter().map(|id| id.index())))
            .collect();
        for index in (0..nodes.len()).rev() {
            let fusible = is_elementwise(&nodes[index].op)
                && !is_output[index]
                && shapes[index].iter().product::<usize>() > 0;
            let Some(&first) = consumers[index].first() else {
                continue;
            };
            let root = fusion.root_of[first];
            let joins = fusible
                && is_elementwise(&nodes[root].op)
                && shapes[index] == shapes[root]
                && consumers[index].iter().all(|&c| fusion.root_of[c] == root)
                && fusion.members[root].len() < MAX_MEMBERS;
            if !joins {
                continue;
            }
            // The group reads this node's operands instead of its value.
            let widened = distinct(
                inputs[root]
                    .iter()
                    .copied()
                    .filter(|&v| v != index)
                    .chain(inputs[index].iter().copied()),
            );
            if widened.len() > max_inputs {
                continue;
            }
            inputs[root] = widened;
            fusion.root_of[index] = root;
            fusion.members[index].clear();
            fusion.members[root].push(index);
        }
        for members in &mut fusion.members {
            members.sort_unstable();
        }
        fusion.assert_invariants(graph, shapes, &is_output, max_inputs);
        fusion
    }

    /// The root of `index`'s group: where its value is computed.
    pub fn root_of(&self, index: usize) -> usize {
        self.root_of[index]
    }

    /// Whether `index` is computed inside another node's kernel and has no
    /// buffer of its own.
    pub fn is_fused_away(&self, index: usize) -> bool {
        self.root_of[index] != index
    }

    /// The group whose root is `root`, with its external inputs.
    pub fn group(&self, graph: &Graph, root: usize) -> Group {
        let members = self.members[root].clone();
        let nodes = graph.nodes();
        let inputs = distinct(
            members
                .iter()
                .flat_map(|&m| nodes[m].inputs.iter().map(|id| id.index()))
                .filter(|&v| self.root_of[v] != root),
        );
        Group { members, inputs }
    }

    /// The rule's guarantees, checked once per plan: a wrong grouping
    /// would read a buffer that was never written.
    fn assert_invariants(
        &self,
        graph: &Graph,
        shapes: &[Vec<usize>],
        is_output: &[bool],
        max_inputs: usize,
    ) {
        let nodes = graph.nodes();
        for (root, members) in self.members.iter().enumerate() {
            if members.len() <= 1 {
                continue;
            }
            assert_eq!(self.root_of[root], root, "a group's root is its own");
            assert_eq!(members.last(), Some(&root), "the root is computed last");
            assert!(members.len() <= MAX_MEMBERS, "group of %{root} too large");
            assert!(
                self.group(graph, root).inputs.len() <= max_inputs,
                "group of %{root} reads too many values"
            );
            for &member in members {
                assert!(is_elementwise(&nodes[member].op));
                assert_eq!(shapes[member], shapes[root]);
                assert!(member == root || !is_output[member]);
            }
        }
        for (index, node) in nodes.iter().enumerate() {
            for input in &node.inputs {
                let input = input.index();
                assert!(
                    !self.is_fused_away(input) || self.root_of[input] == self.root_of[index],
                    "%{input} is fused away but read by %{index} outside its group"
                );
            }
        }
    }
}

/// `values` without repeats, first occurrence kept.
fn distinct(values: impl Iterator<Item = usize>) -> Vec<usize> {
    let mut seen = Vec::new();
    for value in values {
        if !seen.contains(&value) {
            seen.push(value);
        }
    }
    seen
}

#[cfg(test)]
mod tests {
    use canopy_ir::{Graph, TensorType, ValueId};

    use super::*;

    fn shapes(graph: &Graph) -> Vec<Vec<usize>> {
        graph
            .nodes()
            .iter()
            .map(|node| node.ty.shape.resolve(1))
            .collect()
    }

    fn fuse(graph: &Graph, max_inputs: usize) -> Fusion {
        Fusion::plan(graph, &shapes(graph), max_inputs)
    }

    fn ids(values: &[ValueId]) -> Vec<usize> {
        values.iter().map(|v| v.index()).collect()
    }

    #[test]
    fn a_chain_with_a_broadcast_operand_is_one_group() {
        let mut g = Graph::new();
        let x = g.input("x", TensorType::f32(&[4, 5])).unwrap();
        let b = g.input("b", TensorType::f32(&[5])).unwrap();
        let two = g.scalar(2.0).unwrap();
        let doubled = g.mul(x, two).unwrap();
        let biased = g.add(doubled, b).unwrap();
        let out = g.exp(biased).unwrap();
        g.set_output("out", out).unwrap();
        let fusion = fuse(&g, MAX_INPUTS);
        let group = fusion.group(&g, out.index());
        assert_eq!(group.members, ids(&[doubled, biased, out]));
        assert_eq!(group.inputs, ids(&[x, two, b]));
        assert!(fusion.is_fused_away(doubled.index()));
        assert!(!fusion.is_fused_away(out.index()));
    }

    #[test]
    fn values_read_elsewhere_returned_or_of_another_shape_stay_roots() {
        let mut g = Graph::new();
        let x = g.input("x", TensorType::f32(&[4, 5])).unwrap();
        let b = g.input("b", TensorType::f32(&[5])).unwrap();
        let raised = g.exp(x).unwrap();
        let total = g.sum(raised, &[1], true).unwrap();
        let scaled = g.div(raised, total).unwrap();
        let negated_bias = g.neg(b).unwrap();
        let returned = g.add(scaled, negated_bias).unwrap();
        let out = g.relu(returned).unwrap();
        g.set_outputs(vec![("out".into(), out), ("returned".into(), returned)])
            .unwrap();
        let fusion = fuse(&g, MAX_INPUTS);
        // Read by a reduction, of a broadcast shape, and returned.
        for root in [raised, negated_bias, returned, out] {
            assert!(!fusion.is_fused_away(root.index()), "%{}", root.index());
        }
        assert_eq!(
            fusion.group(&g, returned.index()).members,
            ids(&[scaled, returned])
        );
        assert_eq!(fusion.group(&g, out.index()).members, ids(&[out]));
    }

    #[test]
    fn groups_stop_at_the_member_and_input_limits() {
        let mut g = Graph::new();
        let x = g.input("x", TensorType::f32(&[3])).unwrap();
        let mut value = x;
        for _ in 0..40 {
            value = g.neg(value).unwrap();
        }
        g.set_output("out", value).unwrap();
        let fusion = fuse(&g, MAX_INPUTS);
        let last = fusion.group(&g, value.index());
        assert_eq!(last.members.len(), MAX_MEMBERS);
        let first = fusion.group(&g, last.inputs[0]);
        assert_eq!(first.members.len(), 40 - MAX_MEMBERS);
        assert_eq!(first.inputs, ids(&[x]));

        let mut g = Graph::new();
        let mut total = g.input("x0", TensorType::f32(&[3])).unwrap();
        for k in 1..6 {
            let input = g.input(format!("x{k}"), TensorType::f32(&[3])).unwrap();
            total = g.add(total, input).unwrap();
        }
        g.set_output("total", total).unwrap();
        let fusion = fuse(&g, 3);
        let group = fusion.group(&g, total.index());
        // (s + x4) + x5 reads s, x4, x5: a third add would read four.
        assert_eq!(group.members.len(), 2);
        assert_eq!(group.inputs.len(), 3);
    }
}
