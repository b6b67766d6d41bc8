//! From RDP to an (ε, δ) guarantee: for each order α the accountant holds
//! an RDP value r(α); each gives an ε for the requested δ, and the
//! guarantee is the smallest.

use std::fmt;
use std::str::FromStr;

use crate::error::{Parameter, PrivacyError};
use crate::limits;
use crate::orders::Orders;

/// How an order's RDP becomes ε.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Conversion {
    /// ε = r + ln(1/δ)/(α-1) (Mironov 2017, Proposition 3). What TensorFlow
    /// Privacy's accountant printed until 2021.
    Classic,
    /// ε = r + ln(1-1/α) - (ln δ + ln α)/(α-1) (Balle et al. 2020, Theorem
    /// 21; Canonne, Kamath, Steinke 2020, Proposition 12), and ε = 0 when
    /// the KL bound δ ≤ √(1-e^{-r}) already holds. Always at most the
    /// classic ε, by ln(α)/(α-1) - ln(1-1/α) or more; what Opacus and
    /// Google's `dp_accounting` use.
    #[default]
    Tight,
}

impl Conversion {
    pub const ALL: [Conversion; 2] = [Conversion::Classic, Conversion::Tight];

    pub fn name(self) -> &'static str {
        match self {
            Conversion::Classic => "classic",
            Conversion::Tight => "tight",
        }
    }

    /// Where the conversion is proved, for a reader of its output.
    pub fn source(self) -> &'static str {
        match self {
            Conversion::Classic => "Mironov 2017, Proposition 3",
            Conversion::Tight => "Balle et al. 2020, Theorem 21",
        }
    }

    /// ε at one order from its RDP `rdp`; infinite where the order says
    /// nothing.
    fn epsilon_at(self, order: f64, rdp: f64, delta: f64) -> f64 {
        if rdp.is_nan() || rdp == f64::INFINITY {
            return f64::INFINITY;
        }
        match self {
            Conversion::Classic => rdp - delta.ln() / (order - 1.0),
            Conversion::Tight => {
                if delta * delta + (-rdp).exp_m1() > 0.0 {
                    0.0
                } else if order > 1.01 {
                    // Unstable as α → 1, where it is never the best anyway.
                    rdp + (-1.0 / order).ln_1p() - (delta * order).ln() / (order - 1.0)
                } else {
                    f64::INFINITY
                }
            }
        }
    }
}

impl fmt::Display for Conversion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Conversion {
    type Err = PrivacyError;

    fn from_str(text: &str) -> Result<Conversion, PrivacyError> {
        Conversion::ALL
            .into_iter()
            .find(|conversion| conversion.name() == text)
            .ok_or_else(|| PrivacyError::UnknownConversion {
                given: text.to_string(),
            })
    }
}

/// A guarantee: (ε, δ)-DP, with the order that gave it (none when no order
/// gives a finite ε).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Spent {
    pub epsilon: f64,
    pub delta: f64,
    pub order: Option<f64>,
    pub conversion: Conversion,
}

/// The best ε over `orders` for RDP values `rdp` (one per order).
pub(crate) fn epsilon(
    orders: &Orders,
    rdp: &[f64],
    delta: f64,
    conversion: Conversion,
) -> Result<Spent, PrivacyError> {
    let delta = limits::DELTA.check(Parameter::Delta, delta)?;
    assert_eq!(orders.len(), rdp.len(), "one RDP value per order");
    let best = orders
        .as_slice()
        .iter()
        .zip(rdp)
        .map(|(&order, &rdp)| (conversion.epsilon_at(order, rdp, delta), order))
        .filter(|(epsilon, _)| epsilon.is_finite())
        .min_by(|a, b| a.0.total_cmp(&b.0));
    Ok(match best {
        Some((epsilon, order)) => Spent {
            epsilon: epsilon.max(0.0),
            delta,
            order: Some(order),
            conversion,
        },
        None => Spent {
            epsilon: f64::INFINITY,
            delta,
            order: None,
            conversion,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_ones_list_the_known() {
        for conversion in Conversion::ALL {
            assert_eq!(conversion.name().parse::<Conversion>(), Ok(conversion));
        }
        assert_eq!(
            "tighter".parse::<Conversion>().unwrap_err().to_string(),
            "unknown conversion `tighter`: expected classic or tight"
        );
    }

    #[test]
    fn pure_dp_rdp_converts_as_dp_accounting_computes_it_by_hand() {
        // dp_accounting's test: a constant RDP of 1.1 at orders 2..32 (pure
        // DP), δ = 1e-5, tight conversion: ε = 1.32783806176 at order 32.
        let orders = Orders::new((2..33).map(f64::from).collect()).unwrap();
        let rdp = vec![1.1; orders.len()];
        let spent = epsilon(&orders, &rdp, 1e-5, Conversion::Tight).unwrap();
        assert!((spent.epsilon - 1.327_838_061_76).abs() < 1e-9, "{spent:?}");
        assert_eq!(spent.order, Some(32.0));
        // The classic conversion of the same: 1.1 + ln(1e5)/31.
        let classic = epsilon(&orders, &rdp, 1e-5, Conversion::Classic).unwrap();
        assert!((classic.epsilon - (1.1 + 1e5f64.ln() / 31.0)).abs() < 1e-12);
        assert!(classic.epsilon > spent.epsilon);
    }

    #[test]
    fn nothing_spent_is_zero_and_nothing_known_is_infinite() {
        let orders = Orders::standard();
        let zero = vec![0.0; orders.len()];
        assert_eq!(
            epsilon(&orders, &zero, 1e-5, Conversion::Tight)
                .unwrap()
                .epsilon,
            0.0
        );
        let unknown = vec![f64::INFINITY; orders.len()];
        let spent = epsilon(&orders, &unknown, 1e-5, Conversion::Classic).unwrap();
        assert_eq!((spent.epsilon, spent.order), (f64::INFINITY, None));
        let error = epsilon(&orders, &zero, 0.0, Conversion::Tight).unwrap_err();
        assert_eq!(error.parameter(), Parameter::Delta);
    }
}
