//! Graph-to-graph optimisation and lowering passes.
//!
//! Every pass maps a graph to a new, verified graph with the same inputs
//! (names, order, types) and the same outputs (names, types).

mod cse;
mod dce;
mod fold;
mod inline;
mod pipeline;
mod rebuild;
mod simplify;

pub use cse::eliminate_common_subexpressions;
pub use dce::eliminate_dead_code;
pub use fold::{ConstEvaluator, fold_constants};
pub use inline::{has_custom_grad, inline_custom_grads};
pub use pipeline::{
    DEFAULT_FOLD_MAX_ELEMENTS, MAX_ROUNDS, PassReport, optimize, optimize_with_report,
};
pub use simplify::simplify;
