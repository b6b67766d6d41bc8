//! Planning a job's noise before it runs: the inverse of the accountant.

use crate::accountant::{Accountant, Event};
use crate::conversion::{Conversion, Spent};
use crate::error::{Bounds, Parameter, PrivacyError};
use crate::limits;
use crate::orders::Orders;

/// The least noise multiplier the search returns: below it, ε is in the
/// hundreds even for a single step, so a target that allows less noise is
/// met by this much.
pub const MIN_NOISE_MULTIPLIER: f64 = 1e-3;
/// How close the returned noise multiplier is to the least that meets the
/// target, relatively.
pub const RELATIVE_PRECISION: f64 = 1e-9;

/// What a target asks for: `steps` steps of the Gaussian mechanism at
/// `sampling_rate`, spending at most `epsilon` at `delta`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Target {
    pub epsilon: f64,
    pub delta: f64,
    pub sampling_rate: f64,
    pub steps: u64,
}

/// The noise multiplier found, and what it spends (at most the target).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NoisePlan {
    pub noise_multiplier: f64,
    pub spent: Spent,
}

/// The least noise multiplier (within [`RELATIVE_PRECISION`], from above,
/// and no less than [`MIN_NOISE_MULTIPLIER`]) whose ε for `target` is at
/// most the target's ε. ε falls as the noise grows, so a bisection on the
/// noise multiplier's logarithm finds it.
pub fn noise_multiplier(
    target: Target,
    conversion: Conversion,
    orders: &Orders,
) -> Result<NoisePlan, PrivacyError> {
    let epsilon = limits::EPSILON.check(Parameter::Epsilon, target.epsilon)?;
    limits::DELTA.check(Parameter::Delta, target.delta)?;
    Bounds::above(0.0, 1.0).check(Parameter::SamplingRate, target.sampling_rate)?;
    Bounds::closed(1.0, limits::MAX_STEPS as f64).check(Parameter::Steps, target.steps as f64)?;
    let spent = |noise_multiplier: f64| -> Result<Spent, PrivacyError> {
        let event = Event::gaussian(target.sampling_rate, noise_multiplier, target.steps);
        Accountant::new(orders.clone()).epsilon_after(&event, target.delta, conversion)
    };
    let plan = |noise_multiplier: f64| -> Result<NoisePlan, PrivacyError> {
        Ok(NoisePlan {
            noise_multiplier,
            spent: spent(noise_multiplier)?,
        })
    };
    let meets = |noise_multiplier: f64| -> Result<bool, PrivacyError> {
        Ok(spent(noise_multiplier)?.epsilon <= epsilon)
    };

    // A bracket: `low` misses the target, `high` meets it.
    let max = limits::NOISE_MULTIPLIER.high;
    let (mut low, mut high) = (0.5, 1.0);
    while !meets(high)? {
        if high >= max {
            return Err(PrivacyError::Unreachable {
                target_epsilon: epsilon,
                delta: target.delta,
                max_noise_multiplier: max,
                epsilon_at_max: spent(max)?.epsilon,
            });
        }
        low = high;
        high = (high * 2.0).min(max);
    }
    while meets(low)? {
        if low <= MIN_NOISE_MULTIPLIER {
            return plan(MIN_NOISE_MULTIPLIER);
        }
        high = low;
        low = (low / 2.0).max(MIN_NOISE_MULTIPLIER);
    }
    while high / low > 1.0 + RELATIVE_PRECISION {
        let middle = (low * high).sqrt();
        if meets(middle)? {
            high = middle;
        } else {
            low = middle;
        }
    }
    plan(high)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(epsilon: f64) -> Target {
        Target {
            epsilon,
            delta: 1e-5,
            sampling_rate: 0.04,
            steps: 2250,
        }
    }

    #[test]
    fn the_plan_meets_the_target_and_a_little_less_noise_misses_it() {
        let orders = Orders::standard();
        for epsilon in [0.5, 2.0, 8.0, 50.0] {
            let plan = noise_multiplier(target(epsilon), Conversion::Tight, &orders).unwrap();
            assert!(plan.spent.epsilon <= epsilon, "{plan:?}");
            let less = plan.noise_multiplier * (1.0 - 1e-6);
            let event = Event::gaussian(0.04, less, 2250);
            let missed = Accountant::new(orders.clone())
                .epsilon_after(&event, 1e-5, Conversion::Tight)
                .unwrap();
            assert!(
                missed.epsilon > epsilon,
                "{epsilon}: {less} spends {missed:?}"
            );
        }
    }

    #[test]
    fn opacus_plans_about_the_same_noise() {
        // Opacus's test: ε = 8, δ = 1e-5, q = 0.04, 90 epochs (2250 steps)
        // gives 1.425307617; Opacus stops its bisection within 0.01 of ε,
        // so the least noise multiplier is a little below its answer.
        let plan = noise_multiplier(target(8.0), Conversion::Tight, &Orders::standard()).unwrap();
        assert!(
            (1.415..=1.4253077).contains(&plan.noise_multiplier),
            "{plan:?}"
        );
    }

    #[test]
    fn impossible_and_bad_targets_are_refused_by_name() {
        let orders = Orders::standard();
        let everyone_forever = Target {
            epsilon: 1e-6,
            delta: 1e-12,
            sampling_rate: 1.0,
            steps: limits::MAX_STEPS,
        };
        let error = noise_multiplier(everyone_forever, Conversion::Tight, &orders).unwrap_err();
        assert!(matches!(error, PrivacyError::Unreachable { .. }), "{error}");
        assert_eq!(error.parameter(), Parameter::Epsilon);
        let bad = Target {
            steps: 0,
            ..target(1.0)
        };
        assert_eq!(
            noise_multiplier(bad, Conversion::Tight, &orders)
                .unwrap_err()
                .parameter(),
            Parameter::Steps
        );
        let bad = Target {
            sampling_rate: 0.0,
            ..target(1.0)
        };
        assert_eq!(
            noise_multiplier(bad, Conversion::Tight, &orders)
                .unwrap_err()
                .parameter(),
            Parameter::SamplingRate
        );
        let bad = target(f64::NAN);
        assert_eq!(
            noise_multiplier(bad, Conversion::Tight, &orders)
                .unwrap_err()
                .parameter(),
            Parameter::Epsilon
        );
    }

    #[test]
    fn a_generous_target_gets_the_least_noise_searched() {
        let generous = Target {
            epsilon: 1e6,
            delta: 1e-5,
            sampling_rate: 1e-6,
            steps: 1,
        };
        let plan = noise_multiplier(generous, Conversion::Tight, &Orders::standard()).unwrap();
        assert_eq!(plan.noise_multiplier, MIN_NOISE_MULTIPLIER);
    }
}
