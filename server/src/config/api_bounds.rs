//! Bounds on what the admin API accepts that are not operator settings.
//!
//! They are fixed at build time because the OpenAPI document states them
//! (`maximum`, `maxLength`, patterns), and a document that changed with a
//! server's configuration would not be a contract clients can generate
//! code from. `api::docs`'s tests check the document against each of them.
//! Training bounds that devices check too (epochs, batch size, learning
//! rate, model size) are `canopy_protocol::bounds`, not here; what an
//! operator sizes to the machine is [`super::Limits`].

use std::time::Duration;

/// Successful rounds one job may ask for.
pub const MAX_ROUNDS: u32 = 100_000;
/// `min_devices` and `target_devices` of a job, and of its edges'
/// sub-rounds (which aggregators check too).
pub const MAX_DEVICES_PER_ROUND: u32 = canopy_protocol::bounds::MAX_SUB_ROUND_DEVICES;
/// Extra devices selected, as a fraction of the target.
pub const MAX_OVER_SELECTION: f64 = canopy_protocol::bounds::MAX_OVER_SELECTION;
/// Time an edge's partial result has to reach the cloud: a tiered job's
/// sub-rounds close at least this long before its round's deadline.
pub const MIN_UPLINK_MS: u64 = 1_000;
/// A round's deadline, from selection: at least a second, at most a week.
pub const MIN_ROUND_DEADLINE_MS: u64 = 1_000;
pub const MAX_ROUND_DEADLINE_MS: u64 = 7 * 24 * 3_600_000;
/// How long a job's round may wait for devices, when the job sets a
/// limit: at least a second, at most 14 days.
pub const MIN_WAIT_FOR_DEVICES_MS: u64 = 1_000;
pub const MAX_WAIT_FOR_DEVICES_MS: u64 = 14 * 24 * 3_600_000;
/// Failed attempts of one round before its job fails.
pub const MAX_ROUND_RETRIES: u32 = 100;
/// A job's name, in characters (as JSON Schema's `maxLength` counts).
pub const MAX_JOB_NAME_CHARS: usize = 128;
/// Backends and tags a job's device filter may name.
pub const MAX_FILTER_BACKENDS: usize = 8;
pub const MAX_FILTER_TAGS: usize = 32;

/// A model's name, in bytes (ASCII only).
pub const MAX_MODEL_NAME_BYTES: usize = 64;
/// Parents followed by the lineage route.
pub const MAX_LINEAGE: usize = 1_000;

/// Participants included in a round's detail; page through the rest.
pub const DETAIL_PARTICIPANTS: i64 = 200;
/// Largest page of rounds, each of which carries its metrics.
pub const MAX_ROUNDS_PAGE: u32 = 100;

/// A token's label, in characters.
pub const MAX_LABEL_CHARS: usize = 128;
/// The longest lifetime of an API or enrollment token (10 years).
pub const MAX_TOKEN_LIFETIME: Duration = Duration::from_secs(10 * 365 * 86_400);
/// Enrollments one enrollment token may allow.
pub const MAX_ENROLLMENT_USES: u32 = 1_000_000;
