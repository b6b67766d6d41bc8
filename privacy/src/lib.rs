//! Differential-privacy accounting: how much privacy a job spends.
//!
//! A job that clips each device's update and adds noise to their sum is a
//! composition of subsampled mechanisms, one per round. This crate bounds
//! what the composition spends in Rényi differential privacy (RDP, Mironov
//! 2017), order by order, and converts that to an (ε, δ) guarantee:
//!
//! - [`gaussian`]: the Poisson-subsampled Gaussian mechanism (Mironov,
//!   Talwar, Zhang 2019), which central DP-FedAvg is.
//! - [`skellam`]: the Skellam mechanism (Agarwal, Kairouz, Liu 2021), the
//!   integer noise of distributed DP under secure aggregation, subsampled by
//!   the general Poisson bound of Zhu and Wang (2019, Theorem 5).
//! - [`conversion`]: RDP to (ε, δ), the classic way (Mironov 2017) and the
//!   tighter way current libraries use (Balle et al. 2020; Canonne, Kamath,
//!   Steinke 2020).
//! - [`Accountant`]: composition over rounds, each with its own sampling
//!   rate and noise.
//! - [`plan`]: the inverse, the noise multiplier that keeps a planned job
//!   within a target ε.
//!
//! Every function is pure, and every input is checked against [`limits`]:
//! a value outside them is an error that names the parameter, never a NaN
//! in the answer.
//!
//! No mature Rust crate does this accounting (ARCHITECTURE.md says so);
//! the published values of TensorFlow Privacy, Google's `dp_accounting` and
//! Opacus are this crate's tests.

#![forbid(unsafe_code)]

mod accountant;
pub mod conversion;
mod error;
pub mod gaussian;
mod logspace;
mod orders;
pub mod plan;
pub mod skellam;

pub use accountant::{Accountant, Event, Mechanism};
pub use conversion::{Conversion, Spent};
pub use error::{Bounds, Parameter, PrivacyError};
pub use orders::Orders;

/// The bounds of every parameter. Callers that take these settings (the
/// CLI, a job's DP settings) check them here, so there is one rule.
pub mod limits {
    use crate::error::Bounds;

    /// The probability that a device (or an example) takes part in a step.
    pub const SAMPLING_RATE: Bounds = Bounds::closed(0.0, 1.0);
    /// Noise standard deviation over the L2 sensitivity. Above a million
    /// the spent ε is below any number worth printing.
    pub const NOISE_MULTIPLIER: Bounds = Bounds::above(0.0, 1e6);
    /// δ of an (ε, δ) guarantee.
    pub const DELTA: Bounds = Bounds::above(0.0, 1.0);
    /// A target or budget ε.
    pub const EPSILON: Bounds = Bounds::above(0.0, 1e6);
    /// Rényi orders: above 1; at most 1024, which no useful guarantee needs
    /// to pass and which bounds the cost of an integer order's sum.
    pub const ORDER: Bounds = Bounds::above(1.0, 1024.0);
    /// The variance of Skellam noise, per coordinate, in the integer domain.
    pub const VARIANCE: Bounds = Bounds::above(0.0, 1e30);
    /// A Skellam mechanism's sensitivities, in the integer domain.
    pub const SENSITIVITY: Bounds = Bounds::above(0.0, 1e30);
    /// Steps (rounds) composed in one call: a billion is beyond any job.
    pub const MAX_STEPS: u64 = 1_000_000_000;
    /// The most orders an accountant tracks.
    pub const MAX_ORDERS: usize = 1024;
    /// The most terms of a fractional order's series before the order is
    /// given up as not converging (its RDP taken as infinite, which is
    /// safe: the order then never gives the minimum).
    pub const MAX_SERIES_TERMS: u32 = 1000;
}
