//! Strategies: how a round's averaged update becomes the next model, and
//! which learning rate devices train with in each round.
//!
//! A round leaves the weighted mean of the devices' changes,
//! `Δ = Σ nᵢΔᵢ / Σ nᵢ` (see [`crate::fedavg`]). The server treats `Δ` as a
//! pseudo-gradient and takes one step of a server optimizer (Reddi et al.,
//! "Adaptive Federated Optimization", ICLR 2021, Algorithm 2; FedAvgM from
//! Hsu et al. 2019):
//!
//! | strategy     | state  | step added to θ                                  |
//! |--------------|--------|--------------------------------------------------|
//! | `fedavg`     | none   | `η·Δ`                                            |
//! | `fedavgm`    | m      | `m ← β·m + Δ`; `η·m`                             |
//! | `fedadagrad` | m, v   | `m ← β₁m + (1−β₁)Δ`; `v ← v + Δ²`; `η·m/(√v+τ)`  |
//! | `fedadam`    | m, v   | as above with `v ← β₂v + (1−β₂)Δ²`               |
//! | `fedyogi`    | m, v   | as above with `v ← v − (1−β₂)Δ²·sign(v − Δ²)`    |
//! | `fedprox`    | none   | `η·Δ`; devices add `μ/2·‖w − w_round‖²` to their loss |
//!
//! `v` starts at `τ²` (the paper's `v₋₁ ≥ τ²`), `m` at zero. The state is
//! one or two model-sized vectors, stored with the job and replaced in the
//! same transaction that writes the round's version, so a `kill -9` leaves
//! either the old model with the old state or the new with the new.
//!
//! Everything here is pure: no I/O, no database.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::store::text_enum;
use canopy_protocol::bounds::MAX_LEARNING_RATE;

text_enum! {
    /// The server optimizers. The name is what a job spec says.
    #[derive(Default)]
    pub enum StrategyName {
        #[default]
        Fedavg = "fedavg",
        Fedavgm = "fedavgm",
        Fedadagrad = "fedadagrad",
        Fedadam = "fedadam",
        Fedyogi = "fedyogi",
        /// FedAvg with the proximal term on the devices (`proximal_mu`,
        /// default 0.01).
        Fedprox = "fedprox",
    }
}

impl StrategyName {
    /// The one byte that names the strategy in a stored state, so a state
    /// is never read by the wrong optimizer. Stored: never renumber one.
    fn tag(self) -> u8 {
        match self {
            StrategyName::Fedavg => 0,
            StrategyName::Fedavgm => 1,
            StrategyName::Fedadagrad => 2,
            StrategyName::Fedadam => 3,
            StrategyName::Fedyogi => 4,
            StrategyName::Fedprox => 5,
        }
    }

    /// The strategy a stored state's tag names: the inverse of `tag`.
    fn from_tag(tag: u8) -> Option<StrategyName> {
        StrategyName::ALL.iter().copied().find(|s| s.tag() == tag)
    }
}

/// Declares [`StrategySpec`]: its `name`, then one optional setting per
/// entry with its doc and its bounds in the OpenAPI schema. `settings`
/// is generated beside it, so the check that refuses a setting the named
/// strategy does not use sees every one.
macro_rules! strategy_spec {
    ($($(#[doc = $doc:tt])* $field:ident ($($bound:tt)*),)+) => {
        /// A job's strategy as an operator writes it. Every setting may be
        /// left out and then takes its strategy's default; a setting the
        /// named strategy does not use is refused rather than ignored.
        #[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
        #[serde(deny_unknown_fields)]
        pub struct StrategySpec {
            #[serde(default)]
            pub name: StrategyName,
            $(
                $(#[doc = $doc])*
                #[serde(default, skip_serializing_if = "Option::is_none")]
                #[schema($($bound)*)]
                pub $field: Option<f64>,
            )+
        }

        impl StrategySpec {
            /// Every optional setting, by its field's name, with its value.
            fn settings(&self) -> [(&'static str, Option<f64>); [$(stringify!($field)),+].len()] {
                [$((stringify!($field), self.$field)),+]
            }
        }
    };
}

strategy_spec! {
    /// η, the server's step size (default 1 for fedavg and fedavgm, 0.01
    /// for the adaptive ones).
    server_learning_rate(exclusive_minimum = 0, maximum = 100),
    /// β of fedavgm (default 0.9).
    momentum(minimum = 0, exclusive_maximum = 1),
    /// β₁ of the adaptive strategies (default 0.9).
    beta1(minimum = 0, exclusive_maximum = 1),
    /// β₂ of fedadam and fedyogi (default 0.99).
    beta2(minimum = 0, exclusive_maximum = 1),
    /// τ, the adaptive strategies' degree of adaptivity (default 0.001).
    tau(exclusive_minimum = 0, maximum = 1),
    /// μ of FedProx's term `μ/2 · ‖w − w_round‖²` on the devices' loss
    /// (default 0.01 for fedprox; any strategy may add it).
    proximal_mu(exclusive_minimum = 0, maximum = 1000),
}

/// The settings every strategy takes besides its own: FedProx's term may
/// be added to any.
const ANY_STRATEGY: &[&str] = &["proximal_mu"];

/// FedProx's μ when a job names `fedprox` without one (Flower's and the
/// paper's common choice for non-IID image data).
pub const DEFAULT_PROXIMAL_MU: f64 = 0.01;

/// Largest server step size a job may ask for.
pub const MAX_SERVER_LEARNING_RATE: f64 = 100.0;
/// Largest τ: past it the adaptive strategies are plain momentum scaled
/// by 1/τ, and τ² would no longer be a small initial `v`.
pub const MAX_TAU: f64 = 1.0;

/// A resolved server optimizer: every setting has its value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ServerOptimizer {
    FedAvg {
        learning_rate: f64,
    },
    FedAvgM {
        learning_rate: f64,
        momentum: f64,
    },
    Adaptive {
        rule: AdaptiveRule,
        learning_rate: f64,
        beta1: f64,
        beta2: f64,
        tau: f64,
    },
}

/// How an adaptive strategy updates its second moment `v`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AdaptiveRule {
    Adagrad,
    Adam,
    Yogi,
}

impl StrategySpec {
    /// The μ devices train with: the job's, fedprox's default, or none.
    pub fn proximal_mu(&self) -> Result<Option<f64>, String> {
        let mu = match self.name {
            StrategyName::Fedprox => Some(self.proximal_mu.unwrap_or(DEFAULT_PROXIMAL_MU)),
            _ => self.proximal_mu,
        };
        if let Some(mu) = mu {
            canopy_engine::proximal::check_mu(mu).map_err(|_| {
                format!(
                    "`strategy.proximal_mu` must be above 0 and at most {}, got {mu}",
                    canopy_engine::proximal::MAX_PROXIMAL_MU
                )
            })?;
        }
        Ok(mu)
    }

    /// The optimizer this spec names, with defaults filled in; the error
    /// names the field and the cause.
    pub fn resolve(&self) -> Result<ServerOptimizer, String> {
        use StrategyName::*;
        let used: &[&str] = match self.name {
            Fedavg | Fedprox => &["server_learning_rate"],
            Fedavgm => &["server_learning_rate", "momentum"],
            Fedadagrad => &["server_learning_rate", "beta1", "tau"],
            Fedadam | Fedyogi => &["server_learning_rate", "beta1", "beta2", "tau"],
        };
        for (field, value) in self.settings() {
            if value.is_some() && !used.contains(&field) && !ANY_STRATEGY.contains(&field) {
                return Err(format!(
                    "`strategy.{field}` does not apply to `{}` (it takes {})",
                    self.name.as_str(),
                    used.iter()
                        .map(|f| format!("`{f}`"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            }
        }
        let adaptive = matches!(self.name, Fedadagrad | Fedadam | Fedyogi);
        let default_lr = if adaptive { 0.01 } else { 1.0 };
        let learning_rate = self.server_learning_rate.unwrap_or(default_lr);
        check_open_closed(
            "server_learning_rate",
            learning_rate,
            MAX_SERVER_LEARNING_RATE,
        )?;
        let beta = |field: &str, value: Option<f64>, default: f64| {
            let value = value.unwrap_or(default);
            if !(0.0..1.0).contains(&value) {
                return Err(format!(
                    "`strategy.{field}` must be at least 0 and below 1, got {value}"
                ));
            }
            Ok(value)
        };
        self.proximal_mu()?;
        Ok(match self.name {
            Fedavg | Fedprox => ServerOptimizer::FedAvg { learning_rate },
            Fedavgm => ServerOptimizer::FedAvgM {
                learning_rate,
                momentum: beta("momentum", self.momentum, 0.9)?,
            },
            Fedadagrad | Fedadam | Fedyogi => {
                let tau = self.tau.unwrap_or(1e-3);
                check_open_closed("tau", tau, MAX_TAU)?;
                ServerOptimizer::Adaptive {
                    rule: match self.name {
                        Fedadagrad => AdaptiveRule::Adagrad,
                        Fedadam => AdaptiveRule::Adam,
                        _ => AdaptiveRule::Yogi,
                    },
                    learning_rate,
                    beta1: beta("beta1", self.beta1, 0.9)?,
                    beta2: beta("beta2", self.beta2, 0.99)?,
                    tau,
                }
            }
        })
    }
}

fn check_open_closed(field: &str, value: f64, max: f64) -> Result<(), String> {
    if !(value.is_finite() && value > 0.0 && value <= max) {
        return Err(format!(
            "`strategy.{field}` must be above 0 and at most {max}, got {value}"
        ));
    }
    Ok(())
}

impl ServerOptimizer {
    pub fn name(&self) -> StrategyName {
        match self {
            ServerOptimizer::FedAvg { .. } => StrategyName::Fedavg,
            ServerOptimizer::FedAvgM { .. } => StrategyName::Fedavgm,
            ServerOptimizer::Adaptive { rule, .. } => match rule {
                AdaptiveRule::Adagrad => StrategyName::Fedadagrad,
                AdaptiveRule::Adam => StrategyName::Fedadam,
                AdaptiveRule::Yogi => StrategyName::Fedyogi,
            },
        }
    }

    /// The state before the first round, for a model of `len` trainable values.
    pub fn initial_state(&self, len: usize) -> OptimizerState {
        let slots = match *self {
            ServerOptimizer::FedAvg { .. } => vec![],
            ServerOptimizer::FedAvgM { .. } => vec![vec![0.0; len]],
            ServerOptimizer::Adaptive { tau, .. } => vec![vec![0.0; len], vec![tau * tau; len]],
        };
        OptimizerState {
            strategy: self.name(),
            rounds: 0,
            slots,
        }
    }

    /// Takes one step on the mean update `delta`: updates `state` and
    /// returns what to add to the trainable parameters.
    pub fn step(&self, state: &mut OptimizerState, delta: &[f64]) -> Result<Vec<f64>, StateError> {
        state.check(self.name(), delta.len())?;
        state.rounds += 1;
        Ok(match *self {
            ServerOptimizer::FedAvg { learning_rate } => {
                delta.iter().map(|d| learning_rate * d).collect()
            }
            ServerOptimizer::FedAvgM {
                learning_rate,
                momentum,
            } => {
                let m = &mut state.slots[0];
                m.iter_mut()
                    .zip(delta)
                    .map(|(m, d)| {
                        *m = momentum * *m + d;
                        learning_rate * *m
                    })
                    .collect()
            }
            ServerOptimizer::Adaptive {
                rule,
                learning_rate,
                beta1,
                beta2,
                tau,
            } => {
                let [m, v] = state.slots.as_mut_slice() else {
                    unreachable!("check() verified two slots");
                };
                let mut step = Vec::with_capacity(delta.len());
                for ((m, v), &d) in m.iter_mut().zip(v.iter_mut()).zip(delta) {
                    *m = beta1 * *m + (1.0 - beta1) * d;
                    let d2 = d * d;
                    *v = match rule {
                        AdaptiveRule::Adagrad => *v + d2,
                        AdaptiveRule::Adam => beta2 * *v + (1.0 - beta2) * d2,
                        AdaptiveRule::Yogi => *v - (1.0 - beta2) * d2 * (*v - d2).signum(),
                    };
                    step.push(learning_rate * *m / (v.max(0.0).sqrt() + tau));
                }
                step
            }
        })
    }
}

/// A server optimizer's state between rounds.
#[derive(Clone, Debug, PartialEq)]
pub struct OptimizerState {
    pub strategy: StrategyName,
    /// Rounds folded in so far; the round that reads this state is
    /// `rounds + 1`.
    pub rounds: u32,
    /// Model-sized vectors: `[m]` for fedavgm, `[m, v]` for the adaptive ones.
    pub slots: Vec<Vec<f64>>,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum StateError {
    #[error("the stored strategy state is {found:?}, the job runs {expected:?}")]
    WrongStrategy {
        expected: StrategyName,
        found: StrategyName,
    },
    #[error("the stored strategy state has {found} values per slot, the model {expected}")]
    WrongLength { expected: usize, found: usize },
    #[error("the stored strategy state is malformed: {0}")]
    Malformed(&'static str),
}

/// `CNPYSS` + version 1.
const STATE_MAGIC: &[u8; 7] = b"CNPYSS\x01";
/// Two slots is the most any strategy keeps.
const MAX_SLOTS: usize = 2;

impl OptimizerState {
    fn check(&self, strategy: StrategyName, len: usize) -> Result<(), StateError> {
        if self.strategy != strategy {
            return Err(StateError::WrongStrategy {
                expected: strategy,
                found: self.strategy,
            });
        }
        use StrategyName::*;
        let wanted_slots = match strategy {
            Fedavg | Fedprox => 0,
            Fedavgm => 1,
            Fedadagrad | Fedadam | Fedyogi => 2,
        };
        if self.slots.len() != wanted_slots {
            return Err(StateError::Malformed("wrong number of slots"));
        }
        if let Some(slot) = self.slots.iter().find(|s| s.len() != len) {
            return Err(StateError::WrongLength {
                expected: len,
                found: slot.len(),
            });
        }
        Ok(())
    }

    /// Magic, strategy tag, rounds (u32 LE), slot count (u8), slot length
    /// (u64 LE), then each slot's values as f64 LE. f64, so that a state
    /// read back is bit-identical to the one a process kept.
    pub fn encode(&self) -> Vec<u8> {
        let len = self.slots.first().map_or(0, Vec::len);
        let mut bytes = Vec::with_capacity(21 + 8 * len * self.slots.len());
        bytes.extend_from_slice(STATE_MAGIC);
        bytes.push(self.strategy.tag());
        bytes.extend_from_slice(&self.rounds.to_le_bytes());
        bytes.push(self.slots.len() as u8);
        bytes.extend_from_slice(&(len as u64).to_le_bytes());
        for slot in &self.slots {
            for value in slot {
                bytes.extend_from_slice(&value.to_le_bytes());
            }
        }
        bytes
    }

    pub fn decode(bytes: &[u8]) -> Result<OptimizerState, StateError> {
        let header = STATE_MAGIC.len() + 1 + 4 + 1 + 8;
        if bytes.len() < header || &bytes[..STATE_MAGIC.len()] != STATE_MAGIC {
            return Err(StateError::Malformed("bad header"));
        }
        let mut at = STATE_MAGIC.len();
        let strategy =
            StrategyName::from_tag(bytes[at]).ok_or(StateError::Malformed("unknown strategy"))?;
        at += 1;
        let rounds = u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
        at += 4;
        let slot_count = usize::from(bytes[at]);
        at += 1;
        let len = u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
        at += 8;
        if slot_count > MAX_SLOTS {
            return Err(StateError::Malformed("too many slots"));
        }
        let expected = usize::try_from(len)
            .ok()
            .and_then(|len| len.checked_mul(8 * slot_count))
            .filter(|&body| body == bytes.len() - at)
            .ok_or(StateError::Malformed("length does not match the header"))?;
        let values: Vec<f64> = bytes[at..at + expected]
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect();
        let len = len as usize;
        Ok(OptimizerState {
            strategy,
            rounds,
            slots: (0..slot_count)
                .map(|i| values[i * len..(i + 1) * len].to_vec())
                .collect(),
        })
    }
}

/// How the devices' learning rate changes from round to round.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum LearningRateSchedule {
    /// The job's `learning_rate` in every round.
    #[default]
    Constant,
    /// Multiplied by `factor` every `every_rounds` rounds.
    Step {
        #[schema(minimum = 1, maximum = 100_000)]
        every_rounds: u32,
        #[schema(exclusive_minimum = 0, maximum = 1)]
        factor: f64,
    },
    /// Multiplied by `factor` each round.
    Exponential {
        #[schema(exclusive_minimum = 0, maximum = 1)]
        factor: f64,
    },
    /// Cosine decay from `learning_rate` in round 1 to
    /// `final_learning_rate` in the job's last round.
    Cosine {
        #[schema(exclusive_minimum = 0, maximum = 100)]
        final_learning_rate: f64,
    },
}

impl LearningRateSchedule {
    pub fn validate(&self, base: f64) -> Result<(), String> {
        let factor_ok = |f: f64| f.is_finite() && f > 0.0 && f <= 1.0;
        match *self {
            LearningRateSchedule::Constant => Ok(()),
            LearningRateSchedule::Step {
                every_rounds,
                factor,
            } => {
                if every_rounds == 0 || every_rounds > crate::config::api_bounds::MAX_ROUNDS {
                    return Err(format!(
                        "`learning_rate_schedule.every_rounds` must be between 1 and {}, got {every_rounds}",
                        crate::config::api_bounds::MAX_ROUNDS
                    ));
                }
                factor_ok(factor).then_some(()).ok_or_else(|| {
                    format!(
                        "`learning_rate_schedule.factor` must be above 0 and at most 1, got {factor}"
                    )
                })
            }
            LearningRateSchedule::Exponential { factor } => {
                factor_ok(factor).then_some(()).ok_or_else(|| {
                    format!(
                        "`learning_rate_schedule.factor` must be above 0 and at most 1, got {factor}"
                    )
                })
            }
            LearningRateSchedule::Cosine {
                final_learning_rate,
            } => {
                if final_learning_rate.is_finite()
                    && final_learning_rate > 0.0
                    && final_learning_rate <= base
                {
                    Ok(())
                } else {
                    Err(format!(
                        "`learning_rate_schedule.final_learning_rate` must be above 0 and at most `learning_rate` ({base}), got {final_learning_rate}"
                    ))
                }
            }
        }
    }

    /// The learning rate of round `round` (1-based) of a `total`-round job.
    /// Never above `base`, and never below the smallest positive f64 step
    /// the protocol's bounds accept, so a device never refuses it.
    pub fn at(&self, base: f64, round: u32, total: u32) -> f64 {
        let elapsed = f64::from(round.saturating_sub(1));
        let rate = match *self {
            LearningRateSchedule::Constant => base,
            LearningRateSchedule::Step {
                every_rounds,
                factor,
            } => base * factor.powf(f64::from(round.saturating_sub(1) / every_rounds.max(1))),
            LearningRateSchedule::Exponential { factor } => base * factor.powf(elapsed),
            LearningRateSchedule::Cosine {
                final_learning_rate,
            } => {
                let span = f64::from(total.saturating_sub(1).max(1));
                let progress = (elapsed / span).min(1.0);
                final_learning_rate
                    + 0.5
                        * (base - final_learning_rate)
                        * (1.0 + (std::f64::consts::PI * progress).cos())
            }
        };
        rate.clamp(f64::MIN_POSITIVE, base.min(MAX_LEARNING_RATE))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: StrategyName) -> StrategySpec {
        StrategySpec {
            name,
            ..StrategySpec::default()
        }
    }

    #[test]
    fn fedavg_with_default_rate_adds_the_mean() {
        let opt = spec(StrategyName::Fedavg).resolve().unwrap();
        let mut state = opt.initial_state(2);
        assert_eq!(opt.step(&mut state, &[0.5, -1.0]).unwrap(), vec![0.5, -1.0]);
        assert_eq!(state.rounds, 1);
    }

    #[test]
    fn fedavgm_accumulates_momentum() {
        let opt = spec(StrategyName::Fedavgm).resolve().unwrap();
        let mut state = opt.initial_state(1);
        assert_eq!(opt.step(&mut state, &[1.0]).unwrap(), vec![1.0]);
        // m = 0.9·1 + 1
        assert!((opt.step(&mut state, &[1.0]).unwrap()[0] - 1.9).abs() < 1e-12);
    }

    /// Two rounds of each adaptive rule, written out by hand from the
    /// paper's update equations.
    #[test]
    fn adaptive_rules_match_the_paper() {
        let (lr, b1, b2, tau) = (0.01, 0.9, 0.99, 1e-3);
        let deltas = [0.2, -0.05];
        for (name, rule) in [
            (StrategyName::Fedadagrad, AdaptiveRule::Adagrad),
            (StrategyName::Fedadam, AdaptiveRule::Adam),
            (StrategyName::Fedyogi, AdaptiveRule::Yogi),
        ] {
            let opt = spec(name).resolve().unwrap();
            let mut state = opt.initial_state(1);
            let (mut m, mut v) = (0.0f64, tau * tau);
            for d in deltas {
                m = b1 * m + (1.0 - b1) * d;
                v = match rule {
                    AdaptiveRule::Adagrad => v + d * d,
                    AdaptiveRule::Adam => b2 * v + (1.0 - b2) * d * d,
                    AdaptiveRule::Yogi => v - (1.0 - b2) * d * d * (v - d * d).signum(),
                };
                let expected = lr * m / (v.sqrt() + tau);
                let got = opt.step(&mut state, &[d]).unwrap()[0];
                assert!(
                    (got - expected).abs() < 1e-15,
                    "{name:?}: {got} vs {expected}"
                );
            }
        }
    }

    #[test]
    fn settings_another_strategy_uses_are_refused() {
        let mut s = spec(StrategyName::Fedavg);
        s.beta1 = Some(0.9);
        let error = s.resolve().unwrap_err();
        assert!(
            error.contains("`strategy.beta1` does not apply to `fedavg`"),
            "{error}"
        );
        let mut s = spec(StrategyName::Fedadam);
        s.beta2 = Some(1.0);
        assert!(s.resolve().unwrap_err().contains("beta2"));
        s.beta2 = None;
        s.tau = Some(0.0);
        assert!(s.resolve().unwrap_err().contains("tau"));
        s.tau = None;
        s.server_learning_rate = Some(f64::NAN);
        assert!(s.resolve().unwrap_err().contains("server_learning_rate"));
    }

    #[test]
    fn state_round_trips_and_refuses_damage() {
        let opt = spec(StrategyName::Fedyogi).resolve().unwrap();
        let mut state = opt.initial_state(3);
        opt.step(&mut state, &[1.0, -2.0, 0.5]).unwrap();
        let bytes = state.encode();
        assert_eq!(OptimizerState::decode(&bytes).unwrap(), state);
        for cut in 0..bytes.len() {
            assert!(
                OptimizerState::decode(&bytes[..cut]).is_err(),
                "cut at {cut}"
            );
        }
        let mut other = bytes.clone();
        other[7] = 3; // tagged fedadam
        let read = OptimizerState::decode(&other).unwrap();
        assert!(matches!(
            opt.step(&mut read.clone(), &[0.0; 3]),
            Err(StateError::WrongStrategy { .. })
        ));
        assert!(matches!(
            opt.step(&mut state, &[0.0; 2]),
            Err(StateError::WrongLength {
                expected: 2,
                found: 3
            })
        ));
    }

    /// Before the table, `decode` kept its own list, which lacked FedProx.
    #[test]
    fn a_fedprox_state_decodes() {
        let state = OptimizerState {
            strategy: StrategyName::Fedprox,
            rounds: 2,
            slots: vec![],
        };
        assert_eq!(OptimizerState::decode(&state.encode()), Ok(state));
    }

    /// Every list of the strategies agrees with the enum: each strategy's
    /// name is what serde writes and reads and parses back, and its tag
    /// decodes back to it.
    #[test]
    fn every_strategy_round_trips_by_name_and_tag() {
        let mut tags = std::collections::BTreeSet::new();
        for &strategy in StrategyName::ALL {
            let name = serde_json::Value::from(strategy.as_str());
            assert_eq!(serde_json::to_value(strategy).unwrap(), name);
            assert_eq!(
                serde_json::from_value::<StrategyName>(name).unwrap(),
                strategy
            );
            assert_eq!(StrategyName::parse(strategy.as_str()), Some(strategy));
            assert!(tags.insert(strategy.tag()), "{strategy:?}'s tag is taken");
            let state = OptimizerState {
                strategy,
                rounds: 1,
                slots: vec![vec![0.5]],
            };
            assert_eq!(OptimizerState::decode(&state.encode()), Ok(state));
        }
    }

    #[test]
    fn schedules() {
        let step = LearningRateSchedule::Step {
            every_rounds: 2,
            factor: 0.5,
        };
        let rates: Vec<f64> = (1..=5).map(|r| step.at(0.1, r, 5)).collect();
        assert_eq!(rates, vec![0.1, 0.1, 0.05, 0.05, 0.025]);
        let exp = LearningRateSchedule::Exponential { factor: 0.5 };
        assert_eq!(exp.at(0.1, 3, 5), 0.025);
        let cos = LearningRateSchedule::Cosine {
            final_learning_rate: 0.01,
        };
        assert!((cos.at(0.1, 1, 5) - 0.1).abs() < 1e-15);
        assert!((cos.at(0.1, 3, 5) - 0.055).abs() < 1e-12);
        assert!((cos.at(0.1, 5, 5) - 0.01).abs() < 1e-15);
        assert!(
            (cos.at(0.1, 9, 5) - 0.01).abs() < 1e-15,
            "past the end it stays at the floor"
        );
        assert_eq!(LearningRateSchedule::Constant.at(0.1, 1_000, 5), 0.1);
        assert!(cos.validate(0.001).is_err(), "final above the base");
        assert!(exp.validate(0.1).is_ok());
        assert!(
            LearningRateSchedule::Exponential { factor: 0.0 }
                .validate(0.1)
                .is_err()
        );
        assert!(
            LearningRateSchedule::Step {
                every_rounds: 0,
                factor: 0.5
            }
            .validate(0.1)
            .is_err()
        );
    }
}
