//! Caps on everything a file can claim. A file is untrusted input, so every
//! count and size it declares is checked against one of these before the
//! reader acts on it.

use crate::control::MAX_WHILE_TRIPS;
use crate::graph::{MAX_NODES, MAX_RANK};
use crate::verify::MAX_NESTING;

/// Hard ceiling on any dimension or integer attribute, whatever the limits
/// say: shape inference adds and doubles such values, and keeping them below
/// 2^32 keeps that arithmetic far from overflow on 64-bit targets.
pub const HARD_MAX_DIM: u64 = u32::MAX as u64;

/// Reader limits. Defaults suit real models; lower them for untrusted
/// uploads, raise them for unusually large models. Node count, rank,
/// nesting, dimension and trip-count limits are clamped to the IR's own
/// ceilings (`MAX_NODES`, `MAX_RANK`, `MAX_NESTING`, [`HARD_MAX_DIM`],
/// `MAX_WHILE_TRIPS`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadLimits {
    /// Whole file, preamble to last data byte.
    pub max_file_bytes: u64,
    /// The JSON header.
    pub max_header_bytes: u64,
    /// Graphs in the file: entry points plus every nested graph (custom
    /// gradients, loop bodies and conditions, branches).
    pub max_graphs: usize,
    pub max_nodes_per_graph: usize,
    pub max_parameters: usize,
    /// Elements of one parameter, constant or statically shaped value.
    pub max_tensor_elements: u64,
    /// Bytes of one name or metadata string.
    pub max_string_bytes: usize,
    pub max_properties: usize,
    pub max_rank: usize,
    /// Levels of graphs nested inside an entry point.
    pub max_nesting: usize,
    /// Largest dimension or integer attribute (axis, stride, padding, …).
    pub max_dim: u64,
    /// Largest `max_trips` of a `while_loop`: a loop keeps one carry per
    /// trip for its reverse pass, so this also bounds that memory.
    pub max_while_trips: usize,
}

impl Default for ReadLimits {
    fn default() -> Self {
        ReadLimits {
            max_file_bytes: 16 << 30,
            max_header_bytes: 64 << 20,
            max_graphs: 4096,
            max_nodes_per_graph: MAX_NODES,
            max_parameters: 1 << 16,
            max_tensor_elements: 1 << 32,
            max_string_bytes: 64 << 10,
            max_properties: 4096,
            max_rank: MAX_RANK,
            max_nesting: MAX_NESTING,
            max_dim: HARD_MAX_DIM,
            max_while_trips: MAX_WHILE_TRIPS,
        }
    }
}

impl ReadLimits {
    /// The limits with the IR's hard ceilings applied.
    pub(crate) fn clamped(&self) -> ReadLimits {
        ReadLimits {
            max_nodes_per_graph: self.max_nodes_per_graph.min(MAX_NODES),
            max_rank: self.max_rank.min(MAX_RANK),
            max_nesting: self.max_nesting.min(MAX_NESTING),
            max_dim: self.max_dim.min(HARD_MAX_DIM),
            max_while_trips: self.max_while_trips.min(MAX_WHILE_TRIPS),
            ..self.clone()
        }
    }
}
