//! `canopy-protocol`: the wire contract between the Canopy server and
//! devices: request signing, the binary update format, model signatures and
//! the JSON messages of the device API. It does no I/O.
//!
//! Both sides link this crate so that a change to the contract is a change
//! to one place, and the two ends cannot drift apart silently.

pub mod auth;
pub mod bounds;
pub mod device_cert;
pub mod messages;
pub mod model_sig;
pub mod secagg;
pub mod update;

mod keys;
