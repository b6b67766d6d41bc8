//! Explicit bounds on everything an ONNX file declares. The file is
//! untrusted: each count and size is checked against these before anything
//! proportional to it is allocated or walked.

/// The bounds [`decode_model`](crate::decode_model) enforces.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// The whole serialized model. Checked before decoding, so the decoded
    /// structs (at most a small multiple of this) stay bounded too.
    pub max_model_bytes: usize,
    /// Nodes in the main graph, and in it and all its subgraphs (If
    /// branches, Loop and Scan bodies) together.
    pub max_nodes: usize,
    /// Initializers in the main graph.
    pub max_initializers: usize,
    /// Graph inputs plus outputs plus `value_info` entries.
    pub max_value_infos: usize,
    /// Elements in one tensor (initializer, Constant value or input).
    pub max_tensor_elements: usize,
    /// Rank of any tensor or declared shape (canopy-ir's own bound is 8).
    pub max_rank: usize,
    /// Attributes on one node.
    pub max_attributes: usize,
    /// Elements in one list-valued attribute (`ints`, `floats`, ...).
    pub max_attribute_elements: usize,
    /// Inputs or outputs of one node.
    pub max_node_arity: usize,
    /// Bytes in any name (node, value, tensor, attribute, domain, op type).
    pub max_name_bytes: usize,
    /// Entries in `opset_import`.
    pub max_opset_imports: usize,
    /// Levels of subgraphs nested in the main graph (an If branch or a
    /// Loop or Scan body is one level, a loop in it two). Bounds the
    /// recursion of validation and import; canopy-ir allows at most
    /// [`canopy_ir::verify::MAX_NESTING`], which a larger value is
    /// clamped to.
    pub max_graph_depth: usize,
    /// The largest trip count import accepts: a Loop's maximum `M`, a
    /// Scan's fixed number of steps. A loop's reverse pass keeps one carry
    /// per trip, so this bounds memory too; canopy-ir allows at most
    /// [`canopy_ir::control::MAX_WHILE_TRIPS`], which a larger value is
    /// clamped to.
    pub max_trips: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_model_bytes: 512 << 20,
            max_nodes: 100_000,
            max_initializers: 100_000,
            max_value_infos: 100_000,
            // 1 GiB of f32: far above any model we train on devices, far
            // below what would exhaust a server.
            max_tensor_elements: 1 << 28,
            max_rank: canopy_ir::graph::MAX_RANK,
            max_attributes: 64,
            max_attribute_elements: 4096,
            max_node_arity: 1024,
            max_name_bytes: 4096,
            max_opset_imports: 64,
            max_graph_depth: canopy_ir::verify::MAX_NESTING,
            max_trips: canopy_ir::control::MAX_WHILE_TRIPS,
        }
    }
}

impl Limits {
    /// [`Limits::max_graph_depth`], clamped to canopy-ir's bound.
    pub fn graph_depth(&self) -> usize {
        self.max_graph_depth.min(canopy_ir::verify::MAX_NESTING)
    }

    /// [`Limits::max_trips`], clamped to canopy-ir's bound.
    pub fn trips(&self) -> usize {
        self.max_trips.min(canopy_ir::control::MAX_WHILE_TRIPS)
    }
}
