//! Fusion: which nodes a backend computes together in one kernel. The IR
//! graph is not touched: a fusion is a grouping of its nodes that the
//! backend's executor reads. The GPU plans one per batch size (with every
//! shape resolved); the CPU plans one per compiled graph, on symbolic shapes.
//!
//! **The rule** (the one home of it; each backend supplies a [`Rule`]).
//! Every node is in exactly one group, and a group's value is its *root*,
//! the one member that is materialised. A node joins its consumer's group
//! when
//! - it is elementwise for the backend (`Rule::elementwise`), and so is the
//!   root; or it may *head* a group (`Rule::head`: the CPU's matmul), the
//!   group has no head yet, and no member reads it other than elementwise
//!   (the head is computed first, into the group's buffer, and the
//!   elementwise members then run over that buffer while it is in cache);
//! - it has the group's output shape (operands of another shape, broadcast
//!   ones, stay *inputs* of the group and are read with broadcast indexing);
//! - it is not a graph output (returned values stay materialised);
//! - every one of its consumers is already in that group (so nothing
//!   outside the group ever needs its value);
//! - and the group stays within [`MAX_MEMBERS`] nodes and `Rule::max_inputs`
//!   distinct values read from outside the group (the GPU's bindings; the
//!   CPU's per-block readers).
//!
//! Nodes are visited from the last to the first, so a node's consumers
//! have been placed when it is; a node that cannot join starts a group of
//! its own. A group that hits a limit is simply closed: the node that did
//! not fit is the root of the next group, whose value the first group reads.
//!
//! *Why.* Each kernel launch costs a fixed amount (2–5 µs per GPU dispatch;
//! on the CPU a node's dispatch, allocation and pass over memory), and each
//! materialised intermediate is written and read back through memory; an
//! optimizer update or an activation's gradient is a chain of a handful of
//! elementwise nodes, which one kernel computes in registers or in a block
//! that stays in cache.

use canopy_ir::Graph;

/// The most nodes one fused kernel computes; bounds the GPU's generated
/// source and the CPU's per-block scratch.
pub const MAX_MEMBERS: usize = 32;

/// The most distinct values one fused kernel reads, before the GPU
/// adapter's binding limit lowers it.
pub const MAX_INPUTS: usize = 8;

/// What a backend can fuse, node by node (indices into the graph).
pub struct Rule<'a> {
    /// Whether the node computes each output element from the elements at
    /// the same (broadcast) position of its operands, in this backend's
    /// fused kernel.
    pub elementwise: &'a dyn Fn(usize) -> bool,
    /// Whether the node may be computed first into a group's buffer, the
    /// elementwise members following as its epilogue.
    pub head: &'a dyn Fn(usize) -> bool,
    /// Whether two nodes have the same output shape.
    pub same_shape: &'a dyn Fn(usize, usize) -> bool,
    pub max_inputs: usize,
}

/// One group: its members in topological order, the last being the root.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Group {
    pub members: Vec<usize>,
    /// Distinct values read from outside the group, in first-read order
    /// (in topological order of the members); these are the kernel's
    /// operands.
    pub inputs: Vec<usize>,
    /// The member computed first, into the group's buffer, if any.
    pub head: Option<usize>,
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
    /// Per root: its group's head, if it has one.
    head: Vec<Option<usize>>,
}

impl Fusion {
    /// No fusion: every node is its own group.
    pub fn none(graph: &Graph) -> Fusion {
        let n = graph.nodes().len();
        Fusion {
            root_of: (0..n).collect(),
            members: (0..n).map(|index| vec![index]).collect(),
            head: vec![None; n],
        }
    }

    /// Groups `graph`'s nodes by the module's rule, as `rule` allows.
    pub fn plan(graph: &Graph, rule: &Rule<'_>) -> Fusion {
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
            let Some(&first) = consumers[index].first() else {
                continue;
            };
            let root = fusion.root_of[first];
            let as_head = !(rule.elementwise)(index) && (rule.head)(index);
            let kind_fits = if as_head {
                fusion.head[root].is_none()
            } else {
                (rule.elementwise)(index)
            };
            let joins = kind_fits
                && !is_output[index]
                && (rule.elementwise)(root)
                && (rule.same_shape)(index, root)
                && consumers[index].iter().all(|&c| fusion.root_of[c] == root)
                && consumers[index]
                    .iter()
                    .all(|&c| fusion.head[root] != Some(c))
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
            if widened.len() > rule.max_inputs {
                continue;
            }
            inputs[root] = widened;
            fusion.root_of[index] = root;
            fusion.members[index].clear();
            fusion.members[root].push(index);
            if as_head {
                fusion.head[root] = Some(index);
            }
        }
        for members in &mut fusion.members {
            members.sort_unstable();
        }
        fusion.assert_invariants(graph, rule, &is_output);
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

    /// Whether `root`'s group computes more than its root.
    pub fn is_fused(&self, root: usize) -> bool {
        self.members[root].len() > 1
    }

    /// How many groups the graph's `nodes` form: the kernels a run launches
    /// for them.
    pub fn group_count(&self, nodes: impl IntoIterator<Item = usize>) -> usize {
        nodes
            .into_iter()
            .filter(|&index| !self.is_fused_away(index))
            .count()
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
        Group {
            members,
            inputs,
            head: self.head[root],
        }
    }

    /// The rule's guarantees, checked once per plan: a wrong grouping
    /// would read a value that was never computed.
    fn assert_invariants(&self, graph: &Graph, rule: &Rule<'_>, is_output: &[bool]) {
        let nodes = graph.nodes();
        for (root, members) in self.members.iter().enumerate() {
            if members.len() <= 1 {
                continue;
            }
            assert_eq!(self.root_of[root], root, "a group's root is its own");
            assert_eq!(members.last(), Some(&root), "the root is computed last");
            assert!(members.len() <= MAX_MEMBERS, "group of %{root} too large");
            let group = self.group(graph, root);
            assert!(
                group.inputs.len() <= rule.max_inputs,
                "group of %{root} reads too many values"
            );
            for &member in members {
                let is_head = group.head == Some(member);
                assert!(is_head || (rule.elementwise)(member));
                assert!((rule.same_shape)(member, root));
                assert!(member == root || !is_output[member]);
            }
            if let Some(head) = group.head {
                for &member in members {
                    assert!(
                        !nodes[member].inputs.iter().any(|i| i.index() == head)
                            || (rule.elementwise)(member),
                        "the head of %{root}'s group is read by a non-elementwise member"
                    );
                    assert!(
                        !nodes[head].inputs.iter().any(|i| i.index() == member),
                        "the head of %{root}'s group reads a member"
                    );
                }
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
    use canopy_ir::{Graph, Op, TensorType, ValueId};

    use super::*;

    fn fuse(graph: &Graph, max_inputs: usize, heads: bool) -> Fusion {
        let nodes = graph.nodes();
        let elementwise = |i: usize| {
            matches!(
                nodes[i].op,
                Op::Unary(_) | Op::Binary(_) | Op::Where | Op::Cast { .. } | Op::Broadcast { .. }
            )
        };
        let head = |i: usize| heads && matches!(nodes[i].op, Op::MatMul { .. });
        let same_shape = |a: usize, b: usize| nodes[a].ty.shape == nodes[b].ty.shape;
        Fusion::plan(
            graph,
            &Rule {
                elementwise: &elementwise,
                head: &head,
                same_shape: &same_shape,
                max_inputs,
            },
        )
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
        let fusion = fuse(&g, MAX_INPUTS, false);
        let group = fusion.group(&g, out.index());
        assert_eq!(group.members, ids(&[doubled, biased, out]));
        assert_eq!(group.inputs, ids(&[x, two, b]));
        assert_eq!(group.head, None);
        assert!(fusion.is_fused_away(doubled.index()));
        assert!(!fusion.is_fused_away(out.index()));
        assert_eq!(fusion.group_count(0..g.len()), g.len() - 2);
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
        let fusion = fuse(&g, MAX_INPUTS, true);
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
        let fusion = fuse(&g, MAX_INPUTS, false);
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
        let fusion = fuse(&g, 3, false);
        let group = fusion.group(&g, total.index());
        // (s + x4) + x5 reads s, x4, x5: a third add would read four.
        assert_eq!(group.members.len(), 2);
        assert_eq!(group.inputs.len(), 3);
    }

    #[test]
    fn a_matmul_heads_its_bias_and_activation_once_and_only_where_allowed() {
        let mut g = Graph::new();
        let x = g.input("x", TensorType::f32(&[4, 3])).unwrap();
        let w = g.input("w", TensorType::f32(&[3, 3])).unwrap();
        let b = g.input("b", TensorType::f32(&[3])).unwrap();
        let product = g.matmul(x, w).unwrap();
        let biased = g.add(product, b).unwrap();
        let hidden = g.relu(biased).unwrap();
        // A second matmul whose operand is the first group's value: it heads
        // its own group, never the first one.
        let again = g.matmul(hidden, w).unwrap();
        let out = g.exp(again).unwrap();
        g.set_output("out", out).unwrap();
        let fusion = fuse(&g, MAX_INPUTS, true);
        let first = fusion.group(&g, hidden.index());
        assert_eq!(first.members, ids(&[product, biased, hidden]));
        assert_eq!(first.head, Some(product.index()));
        assert_eq!(first.inputs, ids(&[x, w, b]));
        let second = fusion.group(&g, out.index());
        assert_eq!(second.members, ids(&[again, out]));
        assert_eq!(second.inputs, ids(&[hidden, w]));
        // Without heads, each matmul stays a kernel of its own.
        let plain = fuse(&g, MAX_INPUTS, false);
        assert!(!plain.is_fused_away(product.index()));
        assert_eq!(
            plain.group(&g, hidden.index()).members,
            ids(&[biased, hidden])
        );
    }

    #[test]
    fn a_square_matmul_never_heads_the_group_of_the_value_it_reads() {
        // relu(x) · w has relu's shape; relu may not join the matmul's group
        // as a member that feeds the head.
        let mut g = Graph::new();
        let x = g.input("x", TensorType::f32(&[3, 3])).unwrap();
        let w = g.input("w", TensorType::f32(&[3, 3])).unwrap();
        let r = g.relu(x).unwrap();
        let product = g.matmul(r, w).unwrap();
        let out = g.exp(product).unwrap();
        g.set_output("out", out).unwrap();
        let fusion = fuse(&g, MAX_INPUTS, true);
        assert_eq!(fusion.group(&g, out.index()).members, ids(&[product, out]));
        assert!(!fusion.is_fused_away(r.index()));
    }
}
