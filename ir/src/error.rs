//! Errors of graph construction, verification and transformation.

use crate::graph::ValueId;

/// An error about one node: it names the node, its op and the cause.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("node %{} ({op}): {cause}", node.index())]
pub struct NodeError {
    pub node: ValueId,
    pub op: &'static str,
    pub cause: String,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum IrError {
    #[error(transparent)]
    Node(#[from] NodeError),
    #[error("graph input `{0}` is declared twice")]
    DuplicateInput(String),
    #[error("graph output `{0}` is declared twice")]
    DuplicateOutput(String),
    #[error("graph has no input named `{0}`")]
    UnknownInput(String),
    #[error("graph has no output named `{0}`")]
    UnknownOutput(String),
    #[error("graph output `{name}` refers to %{value}, which does not exist")]
    DanglingOutput { name: String, value: usize },
    #[error("graph exceeds the limit of {limit} {what}")]
    LimitExceeded { what: &'static str, limit: usize },
    #[error("{0}")]
    Invalid(String),
}

pub type IrResult<T> = Result<T, IrError>;

pub(crate) fn node_error(node: ValueId, op: &'static str, cause: impl Into<String>) -> IrError {
    IrError::Node(NodeError {
        node,
        op,
        cause: cause.into(),
    })
}
