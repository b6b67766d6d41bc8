//! What can go wrong, by the parameter it concerns.

use std::fmt;

/// A parameter of an accounting question. Its [`name`](Parameter::name) is
/// the one callers show: the CLI turns it into a flag (`sampling_rate` →
/// `--sampling-rate`), a job's settings use it as the field's name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parameter {
    SamplingRate,
    NoiseMultiplier,
    Steps,
    Delta,
    Epsilon,
    Order,
    Orders,
    Variance,
    L1Sensitivity,
    L2Sensitivity,
    Conversion,
}

impl Parameter {
    pub fn name(self) -> &'static str {
        match self {
            Parameter::SamplingRate => "sampling_rate",
            Parameter::NoiseMultiplier => "noise_multiplier",
            Parameter::Steps => "steps",
            Parameter::Delta => "delta",
            Parameter::Epsilon => "epsilon",
            Parameter::Order => "order",
            Parameter::Orders => "orders",
            Parameter::Variance => "variance",
            Parameter::L1Sensitivity => "l1_sensitivity",
            Parameter::L2Sensitivity => "l2_sensitivity",
            Parameter::Conversion => "conversion",
        }
    }
}

impl fmt::Display for Parameter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PrivacyError {
    /// A value outside what the accountant is defined for, or beyond its
    /// limits.
    #[error("{parameter} is {value}, outside {bounds}")]
    OutOfRange {
        parameter: Parameter,
        value: f64,
        bounds: Bounds,
    },
    /// No noise multiplier up to [`crate::limits::NOISE_MULTIPLIER`]'s
    /// upper end keeps the spent ε at or below the target.
    #[error(
        "no noise multiplier up to {max_noise_multiplier} keeps epsilon at or below \
         {target_epsilon} at delta {delta:e}: that much noise still spends {epsilon_at_max}"
    )]
    Unreachable {
        target_epsilon: f64,
        delta: f64,
        max_noise_multiplier: f64,
        epsilon_at_max: f64,
    },
    /// A saved accountant whose values cannot be one.
    #[error("a saved accountant cannot be used: {reason}")]
    CorruptState { reason: String },
    #[error("unknown conversion `{given}`: expected {}", crate::Conversion::ALL.map(|c| c.name()).join(" or "))]
    UnknownConversion { given: String },
}

impl PrivacyError {
    /// The parameter a caller should change.
    pub fn parameter(&self) -> Parameter {
        match self {
            PrivacyError::OutOfRange { parameter, .. } => *parameter,
            PrivacyError::Unreachable { .. } => Parameter::Epsilon,
            PrivacyError::UnknownConversion { .. } => Parameter::Conversion,
            PrivacyError::CorruptState { .. } => Parameter::Orders,
        }
    }
}

/// An interval of finite numbers a parameter must lie in. The check and the
/// error's text both come from it, so they cannot disagree.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bounds {
    pub low: f64,
    pub high: f64,
    pub low_open: bool,
}

impl Bounds {
    /// `[low, high]`.
    pub const fn closed(low: f64, high: f64) -> Bounds {
        Bounds {
            low,
            high,
            low_open: false,
        }
    }

    /// `(low, high]`.
    pub const fn above(low: f64, high: f64) -> Bounds {
        Bounds {
            low,
            high,
            low_open: true,
        }
    }

    pub fn contains(&self, value: f64) -> bool {
        let above_low = if self.low_open {
            value > self.low
        } else {
            value >= self.low
        };
        value.is_finite() && above_low && value <= self.high
    }

    /// `value`, or the error that names `parameter` and these bounds.
    pub fn check(&self, parameter: Parameter, value: f64) -> Result<f64, PrivacyError> {
        if self.contains(value) {
            Ok(value)
        } else {
            Err(PrivacyError::OutOfRange {
                parameter,
                value,
                bounds: *self,
            })
        }
    }
}

impl fmt::Display for Bounds {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let open = if self.low_open { '(' } else { '[' };
        write!(f, "{open}{}, {}]", self.low, self.high)
    }
}
