//! FedProx (Li et al., "Federated Optimization in Heterogeneous
//! Networks", 2020): each device minimises its loss plus
//! `μ/2 · ‖w − w_round‖²`, which keeps local models near the round's
//! global model when the devices' data differ (non-IID).
//!
//! The term is written into the model file, not into a device's code: a
//! proximal model's `train_step` is derived from `train_loss` plus the
//! term, with one extra input per trainable parameter, `anchor/NAME`, the
//! parameter's value when training began. The [`crate::train::Trainer`]
//! feeds the anchors from the model it was built from, so every device
//! that runs `train_step` trains FedProx without knowing about it, and the
//! server can turn any model with a `train_loss` into a proximal one.
//!
//! Architecture invariant: `μ` lives in the model's properties
//! ([`PROP_PROXIMAL_MU`]) and [`crate::zoo::rebuild_train_step`] reads it,
//! so rebuilding the step (another optimizer, a frozen backbone) keeps the
//! term.

use canopy_ir::model::PARAM_PREFIX;
use canopy_ir::{Graph, Model, ValueId};

use crate::error::{EngineError, EngineResult, Part};

/// Prefix of the anchor inputs: `anchor/NAME` is parameter `NAME`'s value
/// at the start of local training.
pub const ANCHOR_PREFIX: &str = "anchor/";
/// The model property holding `μ`; absent on models without the term.
pub const PROP_PROXIMAL_MU: &str = "proximal_mu";
/// Largest `μ` accepted: far past any useful value (the paper tunes
/// 0.001 to 1), low enough that the term cannot overflow a step.
pub const MAX_PROXIMAL_MU: f64 = 1_000.0;

pub fn anchor_name(param: &str) -> String {
    format!("{ANCHOR_PREFIX}{param}")
}

/// Checks `μ`: finite, positive and at most [`MAX_PROXIMAL_MU`].
pub fn check_mu(mu: f64) -> EngineResult<()> {
    if mu.is_finite() && mu > 0.0 && mu <= MAX_PROXIMAL_MU {
        Ok(())
    } else {
        Err(EngineError::Setting(format!(
            "FedProx mu {mu} is out of range: it must be above 0 and at most {MAX_PROXIMAL_MU}"
        )))
    }
}

/// The `μ` a model's `train_step` was derived with, if any.
pub fn proximal_mu(model: &Model) -> EngineResult<Option<f64>> {
    let Some(text) = model.metadata.properties.get(PROP_PROXIMAL_MU) else {
        return Ok(None);
    };
    let mu: f64 = text.parse().map_err(|_| {
        EngineError::Setting(format!(
            "model property `{PROP_PROXIMAL_MU}` is `{text}`, not a number"
        ))
    })?;
    check_mu(mu)?;
    Ok(Some(mu))
}

/// `train_loss` with `μ/2 · Σ ‖p − anchor/p‖²` over the `trainable`
/// parameters added to its `loss` output; other outputs pass through.
pub fn proximal_train_loss(
    train_loss: &Graph,
    trainable: &[String],
    mu: f64,
) -> EngineResult<Graph> {
    check_mu(mu)?;
    let mut g = Graph::new();
    let mut args = Vec::new();
    for &input in train_loss.inputs() {
        args.push(g.input(train_loss.input_name(input), train_loss.ty(input).clone())?);
    }
    let values = g.inline(train_loss, &args)?;
    let mut outputs: Vec<(String, ValueId)> = train_loss
        .outputs()
        .iter()
        .map(|(name, _)| name.clone())
        .zip(values)
        .collect();
    let loss = outputs
        .iter_mut()
        .find(|(name, _)| name == "loss")
        .ok_or_else(|| missing("the loss graph", Part::Output, "loss"))?;
    let mut penalty: Option<ValueId> = None;
    for param in trainable {
        let input_name = format!("{PARAM_PREFIX}{param}");
        let p = g
            .find_input(&input_name)
            .ok_or_else(|| missing("the loss graph", Part::Input, &input_name))?;
        let anchor = g.input(anchor_name(param), g.ty(p).clone())?;
        let distance = g.sub(p, anchor)?;
        let squared = g.unary(canopy_ir::UnaryOp::Square, distance)?;
        let total = g.sum_all(squared)?;
        penalty = Some(match penalty {
            None => total,
            Some(sum) => g.add(sum, total)?,
        });
    }
    if let Some(penalty) = penalty {
        let half_mu = g.scalar((mu / 2.0) as f32)?;
        let scaled = g.mul(half_mu, penalty)?;
        loss.1 = g.add(loss.1, scaled)?;
    }
    g.set_outputs(outputs)?;
    Ok(g)
}

/// Makes `model` proximal with `mu` (or changes its `μ`), rebuilding
/// `train_step` with the optimizer it was built with.
pub fn make_proximal(model: &mut Model, mu: f64) -> EngineResult<()> {
    check_mu(mu)?;
    let optimizer = crate::zoo::model_optimizer(model)?;
    model
        .metadata
        .properties
        .insert(PROP_PROXIMAL_MU.into(), mu.to_string());
    crate::zoo::rebuild_train_step(model, &optimizer)
}

fn missing(owner: &str, part: Part, name: &str) -> EngineError {
    EngineError::Missing {
        owner: owner.to_string(),
        part,
        name: name.to_string(),
    }
}
