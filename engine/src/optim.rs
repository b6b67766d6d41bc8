//! Optimizers expressed in IR, and the builder of whole training steps.
//!
//! `build_train_step` turns a `train_loss` graph (params, x, y, seed →
//! loss, correct) into one graph
//! `train_step(params, state, x, y, seed, lr, step) → (params', state', loss, correct)`:
//! reverse-mode autodiff with respect to the trainable parameters, then the
//! optimizer's update rule, all as IR. A device runs it without any model
//! or optimizer code compiled in.

use std::collections::BTreeMap;
use std::fmt;

use canopy_ir::model::{PARAM_PREFIX, STATE_PREFIX};
use canopy_ir::{BinaryOp, DType, Graph, IrResult, TensorType, UnaryOp, ValueId, autodiff};

use crate::error::{EngineError, EngineResult, Part};

/// An optimizer and its hyperparameters (the learning rate is a graph input).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Optimizer {
    Sgd {
        momentum: f32,
        nesterov: bool,
        weight_decay: f32,
    },
    Adam {
        beta1: f32,
        beta2: f32,
        eps: f32,
        weight_decay: f32,
        /// AdamW: decay applied to the weights directly, not via the gradient.
        decoupled: bool,
    },
}

impl Optimizer {
    pub fn sgd() -> Optimizer {
        Optimizer::Sgd {
            momentum: 0.0,
            nesterov: false,
            weight_decay: 0.0,
        }
    }

    pub fn adam() -> Optimizer {
        Optimizer::Adam {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            decoupled: false,
        }
    }

    pub fn adamw(weight_decay: f32) -> Optimizer {
        Optimizer::Adam {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay,
            decoupled: true,
        }
    }

    /// The learning rate to train with when none is given: plain SGD 0.1;
    /// with momentum β, 0.1·(1 − β), since momentum multiplies the
    /// effective step by 1/(1 − β) (so 0.01 at β = 0.9); Adam and AdamW
    /// 0.001, Kingma & Ba's default, which PyTorch and Optax keep. Adam's
    /// step is about the learning rate whatever the gradient's scale, so
    /// SGD's 0.1 makes it diverge. The one home of these defaults.
    pub fn default_learning_rate(&self) -> f32 {
        match *self {
            Optimizer::Sgd { momentum, .. } => {
                three_significant_digits(0.1 * (1.0 - f64::from(momentum)))
            }
            Optimizer::Adam { .. } => 0.001,
        }
    }

    /// `sgd`, `adam` or `adamw`: the kind, without its hyperparameters.
    pub fn name(&self) -> &'static str {
        match *self {
            Optimizer::Sgd { .. } => "sgd",
            Optimizer::Adam {
                decoupled: false, ..
            } => "adam",
            Optimizer::Adam {
                decoupled: true, ..
            } => "adamw",
        }
    }

    /// Optimizer state slots kept per trainable parameter.
    pub fn slots(&self) -> &'static [&'static str] {
        match self {
            Optimizer::Sgd { momentum, .. } if *momentum == 0.0 => &[],
            Optimizer::Sgd { .. } => &["velocity"],
            Optimizer::Adam { .. } => &["m", "v"],
        }
    }

    /// Parses `sgd`, `sgd:momentum=0.9,nesterov=true,weight_decay=1e-4`,
    /// `adam`, `adamw:weight_decay=0.01`, … (the form `Display` writes).
    pub fn parse(text: &str) -> EngineResult<Optimizer> {
        let (kind, args) = text.split_once(':').unwrap_or((text, ""));
        let mut opt = match kind {
            "sgd" => Optimizer::sgd(),
            "adam" => Optimizer::adam(),
            "adamw" => Optimizer::adamw(0.01),
            other => {
                return Err(EngineError::Optimizer(format!(
                    "unknown optimizer `{other}` (expected sgd, adam or adamw)"
                )));
            }
        };
        for pair in args.split(',').filter(|s| !s.is_empty()) {
            let (key, value) = pair.split_once('=').ok_or_else(|| {
                EngineError::Optimizer(format!("optimizer option `{pair}` is not key=value"))
            })?;
            opt.set(key.trim(), value.trim())?;
        }
        opt.check()?;
        Ok(opt)
    }

    fn set(&mut self, key: &str, value: &str) -> EngineResult<()> {
        let bad = || EngineError::Optimizer(format!("optimizer option `{key}={value}` is invalid"));
        let number = || value.parse::<f32>().map_err(|_| bad());
        match (self, key) {
            (Optimizer::Sgd { momentum, .. }, "momentum") => *momentum = number()?,
            (Optimizer::Sgd { nesterov, .. }, "nesterov") => {
                *nesterov = value.parse().map_err(|_| bad())?
            }
            (Optimizer::Sgd { weight_decay, .. }, "weight_decay")
            | (Optimizer::Adam { weight_decay, .. }, "weight_decay") => *weight_decay = number()?,
            (Optimizer::Adam { beta1, .. }, "beta1") => *beta1 = number()?,
            (Optimizer::Adam { beta2, .. }, "beta2") => *beta2 = number()?,
            (Optimizer::Adam { eps, .. }, "eps") => *eps = number()?,
            _ => return Err(bad()),
        }
        Ok(())
    }

    fn check(&self) -> EngineResult<()> {
        let ok = match *self {
            Optimizer::Sgd {
                momentum,
                weight_decay,
                nesterov,
            } => {
                (0.0..1.0).contains(&momentum)
                    && weight_decay >= 0.0
                    && weight_decay.is_finite()
                    && (!nesterov || momentum > 0.0)
            }
            Optimizer::Adam {
                beta1,
                beta2,
                eps,
                weight_decay,
                ..
            } => {
                (0.0..1.0).contains(&beta1)
                    && (0.0..1.0).contains(&beta2)
                    && eps > 0.0
                    && weight_decay >= 0.0
                    && weight_decay.is_finite()
            }
        };
        if ok {
            Ok(())
        } else {
            Err(EngineError::Optimizer(format!(
                "optimizer `{self}` has out-of-range hyperparameters (momentum and betas in [0, 1), \
                 nesterov needs momentum > 0, eps > 0, weight decay >= 0)"
            )))
        }
    }
}

impl fmt::Display for Optimizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Optimizer::Sgd {
                momentum,
                nesterov,
                weight_decay,
            } => write!(
                f,
                "sgd:momentum={momentum},nesterov={nesterov},weight_decay={weight_decay}"
            ),
            Optimizer::Adam {
                beta1,
                beta2,
                eps,
                weight_decay,
                ..
            } => write!(
                f,
                "{}:beta1={beta1},beta2={beta2},eps={eps},weight_decay={weight_decay}",
                self.name()
            ),
        }
    }
}

/// `x` (positive) to three significant digits, so a derived rate reads
/// as written (0.01, not 0.010000002).
fn three_significant_digits(x: f64) -> f32 {
    let scale = 10f64.powi(2 - x.log10().floor() as i32);
    ((x * scale).round() / scale) as f32
}

/// Names of the scalar inputs `train_step` adds to the loss graph's.
pub const INPUT_LR: &str = "lr";
pub const INPUT_STEP: &str = "step";
pub const INPUT_SEED: &str = "seed";

pub fn state_name(param: &str, slot: &str) -> String {
    format!("{STATE_PREFIX}{param}/{slot}")
}

/// Builds `train_step` from `train_loss` (outputs `loss` and `correct`),
/// differentiating only with respect to `trainable` parameter names.
pub fn build_train_step(
    train_loss: &Graph,
    trainable: &[String],
    optimizer: &Optimizer,
) -> EngineResult<Graph> {
    crate::optimize_graph(&build_train_step_unoptimized(
        train_loss, trainable, optimizer,
    )?)
}

/// `build_train_step` before the optimisation passes (for reports).
pub fn build_train_step_unoptimized(
    train_loss: &Graph,
    trainable: &[String],
    optimizer: &Optimizer,
) -> EngineResult<Graph> {
    let wrt: Vec<String> = trainable
        .iter()
        .map(|p| format!("{PARAM_PREFIX}{p}"))
        .collect();
    let wrt_refs: Vec<&str> = wrt.iter().map(String::as_str).collect();
    let with_grads = autodiff::value_and_grad(train_loss, "loss", &wrt_refs)?;
    let mut g = Graph::new();
    let mut args = Vec::new();
    for &input in with_grads.inputs() {
        args.push(g.input(with_grads.input_name(input), with_grads.ty(input).clone())?);
    }
    let mut state: BTreeMap<String, ValueId> = BTreeMap::new();
    for (param, wrt_name) in trainable.iter().zip(&wrt) {
        let ty = with_grads
            .find_input(wrt_name)
            .map(|i| with_grads.ty(i).clone())
            .ok_or_else(|| EngineError::Missing {
                owner: "the loss graph".to_string(),
                part: Part::Input,
                name: wrt_name.clone(),
            })?;
        for slot in optimizer.slots() {
            let name = state_name(param, slot);
            state.insert(name.clone(), g.input(name, ty.clone())?);
        }
    }
    let lr = g.input(INPUT_LR, TensorType::scalar(DType::F32))?;
    let step = g.input(INPUT_STEP, TensorType::scalar(DType::F32))?;
    let values = g.inline(&with_grads, &args)?;
    let out_names: Vec<&str> = with_grads
        .outputs()
        .iter()
        .map(|(n, _)| n.as_str())
        .collect();
    let by_name: BTreeMap<&str, ValueId> = out_names.iter().copied().zip(values).collect();
    let mut outputs = Vec::new();
    let hyper = Hyper { lr, step };
    for (param, wrt_name) in trainable.iter().zip(&wrt) {
        let p = g.find_input(wrt_name).expect("declared above");
        let grad = by_name[format!("grad/{wrt_name}").as_str()];
        let update = apply_update(&mut g, optimizer, &hyper, p, grad, param, &state)?;
        outputs.push((wrt_name.clone(), update.param));
        for (slot, value) in update.state {
            outputs.push((state_name(param, slot), value));
        }
    }
    for name in ["loss", "correct"] {
        let value = by_name.get(name).ok_or_else(|| EngineError::Missing {
            owner: "the loss graph".to_string(),
            part: Part::Output,
            name: name.to_string(),
        })?;
        outputs.push((name.to_string(), *value));
    }
    g.set_outputs(outputs)?;
    Ok(g)
}

struct Hyper {
    lr: ValueId,
    step: ValueId,
}

struct Update {
    param: ValueId,
    state: Vec<(&'static str, ValueId)>,
}

fn apply_update(
    g: &mut Graph,
    optimizer: &Optimizer,
    hyper: &Hyper,
    p: ValueId,
    grad: ValueId,
    param: &str,
    state: &BTreeMap<String, ValueId>,
) -> IrResult<Update> {
    let slot = |s: &str| state[&state_name(param, s)];
    match *optimizer {
        Optimizer::Sgd {
            momentum,
            nesterov,
            weight_decay,
        } => {
            let grad = add_scaled(g, grad, p, weight_decay)?;
            if momentum == 0.0 {
                let param = descend(g, p, hyper.lr, grad)?;
                return Ok(Update {
                    param,
                    state: vec![],
                });
            }
            // v' = μ·v + g; step along g + μ·v' (Nesterov) or v'.
            let velocity = add_scaled(g, grad, slot("velocity"), momentum)?;
            let direction = if nesterov {
                add_scaled(g, grad, velocity, momentum)?
            } else {
                velocity
            };
            let param = descend(g, p, hyper.lr, direction)?;
            Ok(Update {
                param,
                state: vec![("velocity", velocity)],
            })
        }
        Optimizer::Adam {
            beta1,
            beta2,
            eps,
            weight_decay,
            decoupled,
        } => {
            let grad = if decoupled {
                grad
            } else {
                add_scaled(g, grad, p, weight_decay)?
            };
            let m = ema(g, slot("m"), grad, beta1)?;
            let grad_sq = g.unary(UnaryOp::Square, grad)?;
            let v = ema(g, slot("v"), grad_sq, beta2)?;
            let m_hat = bias_correct(g, m, beta1, hyper.step)?;
            let v_hat = bias_correct(g, v, beta2, hyper.step)?;
            let root = g.unary(UnaryOp::Sqrt, v_hat)?;
            let eps = g.scalar(eps)?;
            let denom = g.add(root, eps)?;
            let mut direction = g.div(m_hat, denom)?;
            if decoupled {
                direction = add_scaled(g, direction, p, weight_decay)?;
            }
            let param = descend(g, p, hyper.lr, direction)?;
            Ok(Update {
                param,
                state: vec![("m", m), ("v", v)],
            })
        }
    }
}

/// a + factor·b (just a when factor is 0).
fn add_scaled(g: &mut Graph, a: ValueId, b: ValueId, factor: f32) -> IrResult<ValueId> {
    if factor == 0.0 {
        return Ok(a);
    }
    let factor = g.scalar(factor)?;
    let scaled = g.mul(factor, b)?;
    g.add(a, scaled)
}

/// p − lr·direction.
fn descend(g: &mut Graph, p: ValueId, lr: ValueId, direction: ValueId) -> IrResult<ValueId> {
    let step = g.mul(lr, direction)?;
    g.sub(p, step)
}

/// β·avg + (1−β)·x.
fn ema(g: &mut Graph, avg: ValueId, x: ValueId, beta: f32) -> IrResult<ValueId> {
    let b = g.scalar(beta)?;
    let kept = g.mul(b, avg)?;
    let rest = g.scalar(1.0 - beta)?;
    let fresh = g.mul(rest, x)?;
    g.add(kept, fresh)
}

/// x / (1 − β^step), Adam's bias correction; `step` counts from 1.
fn bias_correct(g: &mut Graph, x: ValueId, beta: f32, step: ValueId) -> IrResult<ValueId> {
    let b = g.scalar(beta)?;
    let power = g.binary(BinaryOp::Pow, b, step)?;
    let one = g.scalar(1.0)?;
    let denom = g.sub(one, power)?;
    g.div(x, denom)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_learning_rate_depends_on_the_optimizer() {
        let rate = |spec: &str| Optimizer::parse(spec).unwrap().default_learning_rate();
        assert_eq!(rate("sgd"), 0.1);
        assert_eq!(rate("sgd:momentum=0.9"), 0.01);
        assert_eq!(rate("sgd:momentum=0.9").to_string(), "0.01");
        assert_eq!(rate("sgd:momentum=0.9,nesterov=true"), 0.01);
        assert_eq!(rate("sgd:momentum=0.5"), 0.05);
        assert_eq!(rate("sgd:momentum=0.99"), 0.001);
        assert_eq!(rate("adam"), 0.001);
        assert_eq!(rate("adamw"), 0.001);
        assert_eq!(rate("adamw:weight_decay=0.1"), 0.001);
        let names = ["sgd", "sgd:momentum=0.9", "adam", "adamw:weight_decay=0.1"]
            .map(|spec| Optimizer::parse(spec).unwrap().name());
        assert_eq!(names, ["sgd", "sgd", "adam", "adamw"]);
        // Even a momentum near 1 leaves a usable, positive rate.
        for spec in ["sgd", "sgd:momentum=0.99", "adam", "adamw"] {
            let lr = rate(spec);
            assert!(lr > 0.0 && lr.is_finite(), "{spec}: {lr}");
        }
    }
}
