//! `canopy-ir`: the compiler half of Canopy's engine.
//!
//! A functional graph IR ([`Graph`], [`Node`], [`Op`]) with static shape and
//! dtype inference and a verifier; automatic differentiation as IR-to-IR
//! transforms ([`autodiff`]); optimisation passes ([`passes`]); and the
//! versioned, digest-checked file format ([`format`](mod@format)).
//!
//! Architecture invariant: this crate does no I/O and no execution. It maps
//! bytes to graphs and graphs to graphs; running them is `canopy-engine`'s
//! job, and reading files is the caller's.

pub mod autodiff;
mod composite;
pub mod control;
pub mod cost;
pub mod data;
pub mod error;
pub mod format;
pub mod graph;
pub mod infer;
pub mod model;
pub mod op;
pub mod passes;
pub mod types;
pub mod verify;

pub use control::{Cond, Scan, WhileLoop};
pub use cost::{GraphCost, graph_cost};
pub use data::{Buffer, TensorData};
pub use error::{IrError, IrResult, NodeError};
pub use graph::{Graph, Node, ValueId};
pub use model::{Metadata, Model, Parameter};
pub use op::{
    BinaryOp, Conv2dAttrs, CustomGrad, GeluApproximation, Op, Pool2dAttrs, ReduceKind, UnaryOp,
};
pub use types::{DType, Dim, Shape, TensorType};
