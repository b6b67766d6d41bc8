//! Errors of decoding and importing an ONNX model. Each message names the
//! object (tensor, node with its op type, domain and opset, graph input or
//! output), the cause and, where one helps, a hint: the reader of the
//! message usually has only the file and the exporter that wrote it.

use canopy_ir::IrError;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum OnnxError {
    #[error(
        "{what} is {actual}, which exceeds the limit of {limit}; hint: import bounds every size an untrusted file declares (canopy_onnx::Limits); a model this large is not one a device can train, or the file is corrupt"
    )]
    LimitExceeded {
        what: String,
        actual: u64,
        limit: u64,
    },
    #[error(
        "the bytes are not a valid ONNX model; hint: the file may be truncated or not an ONNX file"
    )]
    Decode {
        #[source]
        source: prost::DecodeError,
    },
    #[error("the model has no main graph")]
    MissingGraph,
    #[error(
        "tensor `{tensor}` keeps its data in an external file ({location}), which import does not read; hint: save the model with all tensors inside the file (onnx.save_model(..., save_as_external_data=False))"
    )]
    ExternalData { tensor: String, location: String },
    #[error(
        "tensor `{tensor}` has data type {type_name} ({data_type}), which import does not support (FLOAT, INT64, INT32, BOOL){hint}"
    )]
    UnsupportedDataType {
        tensor: String,
        data_type: i32,
        type_name: &'static str,
        hint: &'static str,
    },
    #[error(
        "tensor `{tensor}` declares dims {dims:?}, {elements} elements, which exceeds the limit of {limit}; hint: import refuses a tensor over the limit before reading or allocating it; check that the exporter wrote the shape you meant, or that the file is not corrupt"
    )]
    TensorTooLarge {
        tensor: String,
        dims: Vec<i64>,
        elements: String,
        limit: usize,
    },
    #[error("tensor `{tensor}` is invalid: {cause}")]
    InvalidTensor { tensor: String, cause: String },
    #[error("{what} has an empty name; every {what} must be named")]
    EmptyName { what: String },
    #[error("the name `{name}` is defined twice: by {first} and by {second}")]
    DuplicateName {
        name: String,
        first: String,
        second: String,
    },
    #[error(
        "{node} reads `{value}`, which no graph input, initializer or earlier node defines; hint: nodes must be in topological order"
    )]
    UndefinedValue { node: String, value: String },
    #[error("graph output `{output}` is not defined by any input, initializer or node")]
    UndefinedOutput { output: String },
    #[error("graph output `{output}` is declared {declared} but imports as {imported}")]
    OutputType {
        output: String,
        declared: &'static str,
        imported: canopy_ir::DType,
    },
    #[error("graph input `{input}` cannot be imported: {cause}")]
    InvalidGraphInput { input: String, cause: String },
    #[error(
        "the model imports no opset for the default domain (\"\" or \"ai.onnx\"); hint: set opset_import"
    )]
    MissingDefaultOpset,
    #[error("the model imports the default domain at two versions, {first} and {second}")]
    ConflictingOpset { first: i64, second: i64 },
    #[error(
        "the model uses default-domain opset {version}; import supports opsets {min} to {max}; hint: convert it with onnx.version_converter"
    )]
    UnsupportedOpset { version: i64, min: i64, max: i64 },
    #[error(
        "{node}: op `{op_type}` of domain `{domain}` (opset {opset}) is not supported; import supports the default domain and `ai.onnx.ml`"
    )]
    UnsupportedDomain {
        node: String,
        op_type: String,
        domain: String,
        opset: String,
    },
    #[error(
        "{node}: op `{op_type}` of domain `{domain}` needs the model to import `{domain}` at one opset from {min} to {max}; it imports {found}; hint: re-export it (skl2onnx writes `ai.onnx.ml` opset 1)"
    )]
    UnsupportedDomainOpset {
        node: String,
        op_type: String,
        domain: String,
        found: String,
        min: i64,
        max: i64,
    },
    #[error(
        "{node}: op `{op_type}` of domain `{domain}` (opset {opset}) is not supported by import"
    )]
    UnsupportedOp {
        node: String,
        op_type: String,
        domain: String,
        opset: i64,
    },
    #[error("{node}: attribute `{attribute}` = {value} is not supported: {cause}")]
    UnsupportedAttribute {
        node: String,
        attribute: String,
        value: String,
        cause: String,
    },
    #[error("{node}: {cause}")]
    InvalidNode { node: String, cause: String },
    /// A control-flow node (If, Loop, Scan) valid in ONNX whose form
    /// canopy-ir's loops and branches cannot express: a loop with no
    /// constant bound, a scan along another axis, ….
    #[error("{node}: {cause}; hint: {hint}")]
    UnsupportedControlFlow {
        node: String,
        cause: String,
        hint: String,
    },
    /// canopy-ir refused the lowered node (shape or dtype mismatch).
    #[error("{node}: {source}")]
    Lowering {
        node: String,
        #[source]
        source: IrError,
    },
    #[error("graph output `{output}` cannot be set: {source}")]
    Output {
        output: String,
        #[source]
        source: IrError,
    },
    /// Export: an IR node with no ONNX lowering.
    #[error("cannot export node {node} ({op}): {cause}; hint: {hint}")]
    ExportUnsupported {
        node: String,
        op: &'static str,
        cause: String,
        hint: String,
    },
    /// Export: the graph or model cannot be written as ONNX as it stands
    /// (a name clash, an unbound parameter, a custom gradient that does
    /// not inline).
    #[error("cannot export {what}: {cause}; hint: {hint}")]
    Export {
        what: String,
        cause: String,
        hint: String,
    },
}

impl OnnxError {
    pub(crate) fn limit(what: impl Into<String>, actual: usize, limit: usize) -> OnnxError {
        OnnxError::LimitExceeded {
            what: what.into(),
            actual: actual as u64,
            limit: limit as u64,
        }
    }

    pub(crate) fn invalid_tensor(tensor: &str, cause: impl Into<String>) -> OnnxError {
        OnnxError::InvalidTensor {
            tensor: tensor.to_string(),
            cause: cause.into(),
        }
    }
}
