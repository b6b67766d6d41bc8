//! The device side of the Canopy protocol: enrollment, signed requests,
//! task polling, verified model download and update upload, over HTTPS
//! with a pinned or CA-verified server certificate.
//!
//! `train` runs a task's shipped `train_step` in `canopy-engine` on local
//! data and produces the update; the edge agent and mobile apps build on
//! both.

mod client;
pub mod train;
mod trust;

pub use client::{DeviceClient, DownloadedModel, SdkError, Transport, enroll};
pub use trust::{Trust, TrustError};
