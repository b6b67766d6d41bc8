//! Composition: RDP adds up, order by order, over every release.

use crate::conversion::{self, Conversion, Spent};
use crate::error::{Bounds, Parameter, PrivacyError};
use crate::orders::Orders;
use crate::skellam::{self, Skellam};
use crate::{gaussian, limits};

/// The noise a release adds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Mechanism {
    /// Gaussian noise of standard deviation `noise_multiplier` times the L2
    /// sensitivity (the clip).
    Gaussian { noise_multiplier: f64 },
    /// Skellam noise in the integer domain (distributed DP).
    Skellam(Skellam),
}

/// `steps` releases of one mechanism, each over a Poisson sample with
/// probability `sampling_rate`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Event {
    pub mechanism: Mechanism,
    pub sampling_rate: f64,
    pub steps: u64,
}

impl Event {
    pub fn gaussian(sampling_rate: f64, noise_multiplier: f64, steps: u64) -> Event {
        Event {
            mechanism: Mechanism::Gaussian { noise_multiplier },
            sampling_rate,
            steps,
        }
    }

    /// The RDP of all the event's steps at each of `orders`.
    pub fn rdp(&self, orders: &Orders) -> Result<Vec<f64>, PrivacyError> {
        if self.steps > limits::MAX_STEPS {
            return Err(PrivacyError::OutOfRange {
                parameter: Parameter::Steps,
                value: self.steps as f64,
                bounds: Bounds::closed(0.0, limits::MAX_STEPS as f64),
            });
        }
        let one_step = match self.mechanism {
            Mechanism::Gaussian { noise_multiplier } => {
                gaussian::rdp(self.sampling_rate, noise_multiplier, orders)?
            }
            Mechanism::Skellam(noise) => skellam::rdp(self.sampling_rate, noise, orders)?,
        };
        let steps = self.steps as f64;
        // 0 steps of an infinite RDP spend nothing, not NaN.
        Ok(one_step
            .into_iter()
            .map(|rdp| if self.steps == 0 { 0.0 } else { rdp * steps })
            .collect())
    }
}

/// What a sequence of releases has spent, as RDP at each order.
#[derive(Debug, Clone, PartialEq)]
pub struct Accountant {
    orders: Orders,
    rdp: Vec<f64>,
    steps: u64,
}

impl Accountant {
    pub fn new(orders: Orders) -> Accountant {
        let rdp = vec![0.0; orders.len()];
        Accountant {
            orders,
            rdp,
            steps: 0,
        }
    }

    /// An accountant as one was saved: its orders, the RDP spent at each
    /// and the steps composed ([`Accountant::orders`], [`Accountant::rdp`],
    /// [`Accountant::steps`]). Refused when the values cannot be an
    /// accountant's: one per order, none negative or NaN.
    pub fn restore(orders: Orders, rdp: Vec<f64>, steps: u64) -> Result<Accountant, PrivacyError> {
        if rdp.len() != orders.len() {
            return Err(PrivacyError::CorruptState {
                reason: format!("{} RDP values for {} orders", rdp.len(), orders.len()),
            });
        }
        if let Some(bad) = rdp.iter().find(|value| value.is_nan() || **value < 0.0) {
            return Err(PrivacyError::CorruptState {
                reason: format!("an RDP value of {bad}"),
            });
        }
        Ok(Accountant { orders, rdp, steps })
    }

    /// Adds `event`'s releases. A refused event changes nothing.
    pub fn compose(&mut self, event: &Event) -> Result<(), PrivacyError> {
        let added = event.rdp(&self.orders)?;
        for (total, added) in self.rdp.iter_mut().zip(added) {
            *total += added;
        }
        self.steps = self.steps.saturating_add(event.steps);
        Ok(())
    }

    /// The (ε, δ) guarantee of everything composed so far.
    pub fn epsilon(&self, delta: f64, conversion: Conversion) -> Result<Spent, PrivacyError> {
        conversion::epsilon(&self.orders, &self.rdp, delta, conversion)
    }

    /// The guarantee this accountant would give after also composing
    /// `event`: what a job checks before a round that might exceed its
    /// budget.
    pub fn epsilon_after(
        &self,
        event: &Event,
        delta: f64,
        conversion: Conversion,
    ) -> Result<Spent, PrivacyError> {
        let mut next = self.clone();
        next.compose(event)?;
        next.epsilon(delta, conversion)
    }

    pub fn orders(&self) -> &Orders {
        &self.orders
    }

    /// The RDP spent at each order.
    pub fn rdp(&self) -> &[f64] {
        &self.rdp
    }

    /// How many steps have been composed.
    pub fn steps(&self) -> u64 {
        self.steps
    }
}

impl Default for Accountant {
    fn default() -> Accountant {
        Accountant::new(Orders::standard())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn composition_adds_order_by_order() {
        let mut once = Accountant::default();
        once.compose(&Event::gaussian(0.01, 1.1, 100)).unwrap();
        once.compose(&Event::gaussian(0.02, 1.1, 50)).unwrap();
        let mut apart = Accountant::default();
        for _ in 0..100 {
            apart.compose(&Event::gaussian(0.01, 1.1, 1)).unwrap();
        }
        for _ in 0..50 {
            apart.compose(&Event::gaussian(0.02, 1.1, 1)).unwrap();
        }
        assert_eq!(once.steps(), 150);
        for (a, b) in once.rdp().iter().zip(apart.rdp()) {
            assert!((a - b).abs() <= 1e-12 * a.max(1e-300), "{a} {b}");
        }
        let after = Accountant::default()
            .epsilon_after(&Event::gaussian(0.01, 1.1, 100), 1e-5, Conversion::Tight)
            .unwrap();
        let mut composed = Accountant::default();
        composed.compose(&Event::gaussian(0.01, 1.1, 100)).unwrap();
        assert_eq!(after, composed.epsilon(1e-5, Conversion::Tight).unwrap());
    }

    #[test]
    fn a_refused_event_changes_nothing() {
        let mut accountant = Accountant::default();
        accountant.compose(&Event::gaussian(0.1, 1.0, 10)).unwrap();
        let before = accountant.clone();
        let error = accountant
            .compose(&Event::gaussian(0.1, -1.0, 10))
            .unwrap_err();
        assert_eq!(error.parameter(), Parameter::NoiseMultiplier);
        let error = accountant
            .compose(&Event::gaussian(0.1, 1.0, limits::MAX_STEPS + 1))
            .unwrap_err();
        assert_eq!(error.parameter(), Parameter::Steps);
        assert_eq!(accountant, before);
    }

    #[test]
    fn a_restored_accountant_is_the_one_saved_and_a_corrupt_one_is_refused() {
        let mut accountant = Accountant::default();
        accountant.compose(&Event::gaussian(0.1, 1.0, 7)).unwrap();
        let restored = Accountant::restore(
            accountant.orders().clone(),
            accountant.rdp().to_vec(),
            accountant.steps(),
        )
        .unwrap();
        assert_eq!(restored, accountant);
        let short = Accountant::restore(Orders::standard(), vec![0.0; 3], 0);
        assert!(
            matches!(short, Err(PrivacyError::CorruptState { .. })),
            "{short:?}"
        );
        let mut negative = accountant.rdp().to_vec();
        negative[0] = -1.0;
        let refused = Accountant::restore(Orders::standard(), negative, 7).unwrap_err();
        assert_eq!(
            refused.to_string(),
            "a saved accountant cannot be used: an RDP value of -1"
        );
    }

    #[test]
    fn zero_steps_spend_nothing() {
        let mut accountant = Accountant::default();
        let skellam = Skellam {
            variance: 10.0,
            l1_sensitivity: 1.0,
            l2_sensitivity: 1.0,
        };
        accountant
            .compose(&Event {
                mechanism: Mechanism::Skellam(skellam),
                sampling_rate: 0.5,
                steps: 0,
            })
            .unwrap();
        assert!(accountant.rdp().iter().all(|&rdp| rdp == 0.0));
    }
}
