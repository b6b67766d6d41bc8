//! Secure aggregation: SecAgg+ (Bell et al., CCS 2020) over the rounds of
//! Bonawitz et al. (CCS 2017), so that the server learns only the sum of
//! the devices' updates. Besides their ConsistencyCheck, a ShareCheck round
//! of our own lets a device whose shares do not open be excluded before
//! anyone masks, instead of making its neighbours abort. `docs/secure-aggregation.md` says what this
//! implements and what it guarantees against whom.
//!
//! - [`params`]: the job's settings, and the (k, t, b, scale) of a round.
//! - [`graph`]: the random k-regular graph of who shares with whom.
//! - [`shamir`], [`crypto`], [`mask`]: the primitives.
//! - [`arith`]: fixed point, stochastic rounding and bit packing.
//! - [`noise`]: distributed differential privacy's Skellam shares.
//! - [`wire`]: the versioned, bounded binary messages.
//! - [`client`] and [`server`]: the two sides.

pub mod arith;
pub mod client;
pub mod crypto;
pub mod graph;
pub mod mask;
pub mod noise;
pub mod params;
pub mod server;
pub mod shamir;
pub mod wire;

pub use client::Client;
pub use params::{Plan, SecAggConfig};
pub use server::Aggregator;
pub use wire::Session;

/// Which secret a revealed share belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum ShareKind {
    SelfMaskSeed = 1,
    MaskKey = 2,
}

impl ShareKind {
    pub fn name(self) -> &'static str {
        match self {
            ShareKind::SelfMaskSeed => "self-mask seed",
            ShareKind::MaskKey => "mask key",
        }
    }

    /// Field elements per share: 16- and 32-byte secrets in 7-byte chunks.
    pub fn chunks(self) -> usize {
        match self {
            ShareKind::SelfMaskSeed => shamir::chunks_for(16),
            ShareKind::MaskKey => shamir::chunks_for(32),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SecAggError {
    /// A job's settings that cannot work; refused when the job is created.
    #[error("secure_aggregation: {0}")]
    Config(String),
    /// A message refused: which message, and why.
    #[error("{message} refused: {cause}")]
    Rejected {
        message: &'static str,
        cause: String,
    },
    /// Bad arguments to a local call.
    #[error("{0}")]
    Invalid(String),
    /// A message that arrived at the wrong stage.
    #[error("{0}")]
    OutOfOrder(String),
    /// Too many devices dropped out or misbehaved for the round to finish.
    #[error("the round cannot be unmasked: {0}")]
    Unrecoverable(String),
}

impl SecAggError {
    pub(crate) fn invalid(message: String) -> SecAggError {
        SecAggError::Invalid(message)
    }

    pub(crate) fn rejected(message: &'static str, cause: String) -> SecAggError {
        SecAggError::Rejected { message, cause }
    }
}
