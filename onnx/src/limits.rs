//! Explicit bounds on everything an ONNX file declares. The file is
//! untrusted: each count and size is checked against these before anything
//! proportional to it is allocated or walked.

/// The bounds [`decode_model`](crate::decode_model) enforces.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// The whole serialized model. Checked before decoding, so the decoded
    /// structs (at most a small multiple of this) stay bounded too.
    pub max_model_bytes: usize,
    /// Nodes in the main graph.
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
        }
    }
}
