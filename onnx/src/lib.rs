//! `canopy-onnx`: ONNX model import.
//!
//! The pipeline has two steps, both bounded by explicit [`Limits`]:
//!
//! 1. [`decode_model`] checks the byte length, decodes the protobuf with
//!    hand-written `prost` messages ([`proto`]), and validates what prost
//!    does not bound: counts of nodes, initializers, attributes and names,
//!    ranks, and every tensor (a supported data type, no external data, and
//!    a payload holding exactly `product(dims)` elements, computed with
//!    checked arithmetic and capped before anything is converted).
//! 2. [`import`] (or [`import_model`], which also returns the initializers
//!    by name) lowers the main graph to a [`canopy_ir::Graph`]: graph inputs
//!    that are not initializers become graph inputs (a symbolic first
//!    dimension becomes the batch dimension), initializers become constants,
//!    and each node of the default domain, opsets 13 to 21, is lowered by
//!    the op's ONNX semantics. [`SUPPORTED_OPS`] lists the ops. The
//!    `ai.onnx.ml` ops scikit-learn's exporter writes for linear models and
//!    MLPs (opsets 1 to 5, [`SUPPORTED_ML_OPS`]) are lowered too, ZipMap as
//!    its probability tensor. If, Loop and Scan become canopy-ir's `cond`,
//!    `while_loop` and `scan`, their subgraphs lowered as bodies that read
//!    outer values as inputs; a Loop needs a constant trip count.
//!
//! Anything import cannot reproduce exactly (an op, a domain, an opset, an
//! attribute value such as asymmetric padding or `count_include_pad=0` with
//! padding, a data type) is refused with an [`OnnxError`] naming the node,
//! op, domain and opset or the tensor, never imported with other semantics.
//! No input makes the crate panic.
//!
//! [`export_graph`] and [`export_model`] go the other way: a canopy-ir graph
//! (or a model's entry point with its parameters as initializers) as an
//! ONNX model, default domain, opset [`EXPORT_OPSET`], control flow as
//! ONNX's `Scan`, `If` and `Loop`; [`encode`] gives the file's bytes.
//!
//! Architecture invariant: like canopy-ir, this crate does no I/O; it maps
//! bytes to graphs.

mod attrs;
pub mod decode;
pub mod error;
pub mod export;
pub mod import;
pub mod limits;
mod ops;
pub mod proto;

pub use decode::{decode_model, tensor_data, validate_model, validate_tensor};
pub use error::OnnxError;
pub use export::{
    BATCH_DIM_PARAM, EXPORT_IR_VERSION, EXPORT_OPSET, ExportOptions, encode, export_graph,
    export_model,
};
pub use import::{
    ImportOptions, ImportedModel, MAX_OPSET, MIN_OPSET, import, import_model, import_model_with,
};
pub use limits::Limits;
pub use ops::SUPPORTED_OPS;
pub use ops::ml::{ML_DOMAIN, ML_MAX_OPSET, ML_MIN_OPSET, SUPPORTED_ML_OPS};
