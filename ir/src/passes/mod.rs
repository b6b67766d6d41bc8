//! Graph-to-graph optimisation and lowering passes.

mod inline;

pub use inline::inline_custom_grads;
