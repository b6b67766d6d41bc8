//! Runtime errors.

use canopy_ir::IrError;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Ir(#[from] IrError),
    #[error("shape error: {0}")]
    Shape(String),
    #[error("dtype error: {0}")]
    DType(String),
    /// A kernel failed on the values it was given (e.g. an index out of
    /// range); names the node and op.
    #[error("node %{node} ({op}): {cause}")]
    Kernel {
        node: usize,
        op: &'static str,
        cause: String,
    },
    #[error("input `{name}`: {cause}")]
    Input { name: String, cause: String },
    #[error("backend `{backend}` does not support {what}")]
    Unsupported { backend: String, what: String },
    #[error("data error in {path}: {cause}")]
    Data { path: String, cause: String },
    #[error("{0}")]
    Other(String),
}

pub type EngineResult<T> = Result<T, EngineError>;
