//! Canopy's device simulator, behind `canopy simulate`: many virtual
//! devices against a real server, each enrolled with its own key, holding
//! its own shard, and running the SDK's own code for every request and
//! every computation (`canopy_sdk::local`, which the edge agent runs too).
//!
//! Codemap: [`partition`] deals a dataset out to the devices; [`fleet`]
//! enrolls them and runs them (check-ins, tasks, uploads); [`cloud`] is the
//! in-process server a simulation runs against unless it names one;
//! [`setup`] the data, the starting model and the job's settings.
//!
//! *Why devices check in instead of long-polling:* a real fleet of 100,000
//! phones does not hold 100,000 open requests; each device checks in now
//! and then, as Papaya's do. A virtual device that is not working on a
//! task is a slot of a few bytes (its id and the index its key derives
//! from), and is materialised (key, client, its data split) only for a
//! check-in or a task.

pub mod cloud;
pub mod fleet;
pub mod partition;
pub mod setup;

pub use fleet::{Attack, AttackKind, Fleet, FleetPart, FleetReport, FleetSettings, StepTime};
pub use partition::Partition;

/// Most devices one simulation process hosts.
pub const MAX_DEVICES: usize = 1_000_000;

/// Why a simulation cannot start or go on.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("--partition {partition} cannot deal {samples} samples to {devices} devices: {cause}")]
    Partition {
        partition: Partition,
        devices: usize,
        samples: usize,
        cause: String,
    },
    #[error("--devices {devices} is more than one simulation hosts ({MAX_DEVICES})")]
    TooManyDevices { devices: usize },
    #[error("--devices must be at least 1")]
    NoDevices,
    #[error(
        "this process would host devices {first} to {end} of {all}, which are not all among \
         them (or more than one simulation hosts, {MAX_DEVICES})"
    )]
    BadPart {
        first: usize,
        end: usize,
        all: usize,
    },
    #[error("simulated device {index} could not enroll")]
    Enroll {
        index: usize,
        #[source]
        source: canopy_sdk::SdkError,
    },
    #[error("simulated device {index} (device id {device_id}) could not report its dataset")]
    Heartbeat {
        index: usize,
        device_id: i64,
        #[source]
        source: canopy_sdk::SdkError,
    },
    #[error("simulated device {index} cannot offer its shard")]
    Dataset {
        index: usize,
        #[source]
        source: canopy_sdk::UnofferableDataset,
    },
    #[error("the simulated devices' client cannot be built")]
    Client(#[source] canopy_sdk::SdkError),
    #[error("the simulation's server did not start")]
    Server(#[source] canopy_server::server::ServeError),
}

impl SimError {
    /// What to do about it.
    pub fn hint(&self) -> Option<String> {
        match self {
            SimError::Partition { .. } => Some(
                "use fewer devices, a larger dataset, or a less skewed partition (a larger \
                 dirichlet alpha, more classes per shard)"
                    .into(),
            ),
            SimError::Enroll { .. } => Some(
                "the server must allow as many enrollments from this address as there are \
                 devices: see `sensitive_requests_per_minute` and `max_enrollments_per_address` \
                 in docs/limits.md, and give the enrollment token enough uses"
                    .into(),
            ),
            _ => None,
        }
    }
}
