//! Automatic differentiation as IR-to-IR transforms.
//!
//! Every transform returns an ordinary [`Graph`]: the primal nodes are kept
//! as they are (same ids, so rules can read primal values) and the
//! derivative nodes are appended with the graph builder. Because rules only
//! emit ops that have rules themselves, the result can be differentiated
//! again (`grad(grad(f))`).
//!
//! - [`vjp`] / [`grad`] / [`value_and_grad`]: reverse mode; every VJP rule is
//!   in `backward.rs`.
//! - [`jvp`]: forward mode; every JVP rule is in `forward.rs`.
//! - [`custom_grad`] / [`call_custom`]: user-written backward rules.
//! - Control flow (`control.rs`): a `scan`'s VJP is a reverse `scan`, a
//!   `cond`'s a `cond`; a bounded `while_loop` is differentiated backwards
//!   as a `scan` of `max_trips` guarded steps, and a scan checkpointed
//!   every k steps as a scan of segments (see `Scan::checkpoint`).
//!
//! Only *active* nodes are differentiated: those that depend on a `wrt`
//! input and lead to a differentiated output (see `activity.rs`). A frozen
//! backbone therefore gets no derivative nodes at all. Rules still emit a
//! contribution for every operand, so each transform ends with the
//! dead-code pass ([`crate::passes::eliminate_dead_code`]), which drops
//! the ones no output reads.

mod activity;
mod backward;
mod control;
mod custom;
mod forward;
mod util;

pub use custom::{call_custom, custom_grad};

use crate::error::{IrError, IrResult};
use crate::graph::{Graph, ValueId};
use crate::passes::eliminate_dead_code;
use crate::types::DType;

/// Prefix of the cotangent inputs of a [`vjp`] graph.
pub const COTANGENT_PREFIX: &str = "cotangent/";
/// Prefix of the gradient outputs of [`vjp`], [`grad`] and [`value_and_grad`].
pub const GRAD_PREFIX: &str = "grad/";
/// Prefix of the tangent inputs and outputs of a [`jvp`] graph.
pub const TANGENT_PREFIX: &str = "tangent/";

/// Reverse mode with caller-supplied cotangents.
///
/// Inputs: the original inputs, then `cotangent/<out>` for each f32 output.
/// Outputs: the original outputs, then `grad/<w>` for each name in `wrt`.
pub fn vjp(graph: &Graph, wrt: &[&str]) -> IrResult<Graph> {
    let graph = &control::lower_for_reverse(graph)?;
    let wrt_ids = resolve_wrt(graph, wrt)?;
    let mut g = graph.clone();
    let mut seeds = Vec::new();
    for (name, value) in graph.outputs() {
        let ty = graph.ty(*value);
        if ty.dtype == DType::F32 {
            let cotangent = g.input(format!("{COTANGENT_PREFIX}{name}"), ty.clone())?;
            seeds.push((*value, cotangent));
        }
    }
    let grads = backward::backpropagate(&mut g, graph.len(), &seeds, &wrt_ids)?;
    finish(g, graph.outputs().to_vec(), wrt, grads)
}

/// The gradient of the f32 scalar `output`: outputs are only `grad/<w>`.
pub fn grad(graph: &Graph, output: &str, wrt: &[&str]) -> IrResult<Graph> {
    let (g, grads) = seeded_backward(graph, output, wrt)?;
    finish(g, Vec::new(), wrt, grads)
}

/// Like [`grad`], but keeps every original output (e.g. `loss` and an i64
/// `correct`) before the gradients.
pub fn value_and_grad(graph: &Graph, output: &str, wrt: &[&str]) -> IrResult<Graph> {
    let (g, grads) = seeded_backward(graph, output, wrt)?;
    finish(g, graph.outputs().to_vec(), wrt, grads)
}

/// Forward mode.
///
/// Inputs: the original inputs, then `tangent/<w>` for each name in `wrt`.
/// Outputs: the original outputs, then `tangent/<out>` for each f32 output.
pub fn jvp(graph: &Graph, wrt: &[&str]) -> IrResult<Graph> {
    let wrt_ids = resolve_wrt(graph, wrt)?;
    let mut g = graph.clone();
    let mut tangents = Vec::with_capacity(wrt.len());
    for (&name, &id) in wrt.iter().zip(&wrt_ids) {
        let tangent = g.input(format!("{TANGENT_PREFIX}{name}"), graph.ty(id).clone())?;
        tangents.push((id, tangent));
    }
    let targets: Vec<ValueId> = f32_outputs(graph).map(|(_, v)| v).collect();
    let out_tangents = forward::propagate(&mut g, graph.len(), &tangents, &targets)?;
    let mut outputs = graph.outputs().to_vec();
    for ((name, _), t) in f32_outputs(graph).zip(out_tangents) {
        outputs.push((format!("{TANGENT_PREFIX}{name}"), t));
    }
    g.set_outputs(outputs)?;
    eliminate_dead_code(&g)
}

/// Shared front half of [`grad`] and [`value_and_grad`]: seeds the scalar
/// `output` with 1.0 and backpropagates.
fn seeded_backward(graph: &Graph, output: &str, wrt: &[&str]) -> IrResult<(Graph, Vec<ValueId>)> {
    let graph = &control::lower_for_reverse(graph)?;
    let wrt_ids = resolve_wrt(graph, wrt)?;
    let value = graph
        .find_output(output)
        .ok_or_else(|| IrError::UnknownOutput(output.to_string()))?;
    let ty = graph.ty(value);
    if ty.dtype != DType::F32 || ty.rank() != 0 {
        return Err(IrError::Invalid(format!(
            "cannot take the gradient of output `{output}`: it is {ty}, not an f32 scalar"
        )));
    }
    let mut g = graph.clone();
    let seed = g.scalar(1.0)?;
    let grads = backward::backpropagate(&mut g, graph.len(), &[(value, seed)], &wrt_ids)?;
    Ok((g, grads))
}

/// Names the gradients, sets the outputs and drops dead nodes.
fn finish(
    mut g: Graph,
    mut outputs: Vec<(String, ValueId)>,
    wrt: &[&str],
    grads: Vec<ValueId>,
) -> IrResult<Graph> {
    for (&name, grad) in wrt.iter().zip(grads) {
        outputs.push((format!("{GRAD_PREFIX}{name}"), grad));
    }
    g.set_outputs(outputs)?;
    eliminate_dead_code(&g)
}

/// Looks up the `wrt` inputs; each must exist, be f32 and appear once.
fn resolve_wrt(graph: &Graph, wrt: &[&str]) -> IrResult<Vec<ValueId>> {
    let mut ids = Vec::with_capacity(wrt.len());
    for (i, &name) in wrt.iter().enumerate() {
        let id = graph
            .find_input(name)
            .ok_or_else(|| IrError::UnknownInput(name.to_string()))?;
        let ty = graph.ty(id);
        if ty.dtype != DType::F32 {
            return Err(IrError::Invalid(format!(
                "cannot differentiate with respect to input `{name}`: it is {ty}, only f32 inputs have derivatives"
            )));
        }
        if wrt[..i].contains(&name) {
            return Err(IrError::Invalid(format!(
                "input `{name}` is listed twice in the differentiation inputs"
            )));
        }
        ids.push(id);
    }
    Ok(ids)
}

fn f32_outputs(graph: &Graph) -> impl Iterator<Item = (&str, ValueId)> {
    graph
        .outputs()
        .iter()
        .filter(|(_, v)| graph.ty(*v).dtype == DType::F32)
        .map(|(n, v)| (n.as_str(), *v))
}
