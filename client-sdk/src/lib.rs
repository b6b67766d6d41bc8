//! The device side of the Canopy protocol: enrollment, signed requests,
//! task polling, verified model download and update upload, over HTTPS
//! with a pinned or CA-verified server certificate.
//!
//! This is the transport layer that the edge agent and mobile apps build
//! on; training itself is `canopy-engine`'s job.

mod client;
mod trust;

pub use client::{DeviceClient, DownloadedModel, SdkError, Transport, enroll};
pub use trust::{Trust, TrustError};
