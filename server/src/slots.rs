//! Upload slots: how many request bodies of model or update size the
//! server reads at once, and who may hold them.
//!
//! Fairness rules, all enforced here:
//! - An upload's task is checked before it asks for a slot (the caller's
//!   job), so an upload that cannot be accepted never waits.
//! - One upload in flight per device and round: a second one is refused
//!   at once, so one device holds at most one slot per round however many
//!   requests it opens.
//! - Waiting for a slot is bounded (`upload_slot_wait_ms`), then 503 with
//!   `Retry-After`; holding one is bounded by the caller's read deadline
//!   (`upload_timeout_ms`). So one slow or hostile client delays another's
//!   upload by at most the slot wait.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Semaphore, SemaphorePermit};

use crate::inflight::{InFlight, InFlightGuard};

/// A device's upload to one round: `(device_id, round_id)`.
pub type UploadOwner = (i64, i64);

pub struct UploadSlots {
    /// The `Limits` setting that sizes these slots, for messages and metrics.
    pub setting: &'static str,
    slots: Semaphore,
    capacity: usize,
    wait: Duration,
    owners: Arc<InFlight<UploadOwner>>,
}

/// A held slot; dropping it frees the slot and the owner's place.
pub struct UploadSlot<'a> {
    _permit: SemaphorePermit<'a>,
    _owner: Option<InFlightGuard<UploadOwner>>,
}

#[derive(Debug, thiserror::Error)]
pub enum SlotError {
    #[error("device {device_id} already has an upload to round {round_id} in progress")]
    OwnerBusy { device_id: i64, round_id: i64 },
    #[error("all {slots} upload slots stayed busy for {waited_ms} ms")]
    Busy { slots: usize, waited_ms: u64 },
    #[error("the server is shutting down")]
    Closed,
}

impl UploadSlots {
    pub fn new(setting: &'static str, slots: usize, wait_ms: u64) -> UploadSlots {
        assert!(slots > 0, "Limits::validate refuses zero slots");
        UploadSlots {
            setting,
            slots: Semaphore::new(slots),
            capacity: slots,
            wait: Duration::from_millis(wait_ms),
            owners: InFlight::new(1),
        }
    }

    /// Takes a slot for `owner` (a device's upload to a round; `None` for
    /// an operator's model upload), waiting at most the slot wait.
    pub async fn acquire(&self, owner: Option<UploadOwner>) -> Result<UploadSlot<'_>, SlotError> {
        let owner = match owner {
            Some((device_id, round_id)) => Some(
                self.owners
                    .try_enter((device_id, round_id))
                    .ok_or(SlotError::OwnerBusy {
                        device_id,
                        round_id,
                    })?,
            ),
            None => None,
        };
        let permit = tokio::time::timeout(self.wait, self.slots.acquire())
            .await
            .map_err(|_| SlotError::Busy {
                slots: self.capacity(),
                waited_ms: self.wait.as_millis() as u64,
            })?
            .map_err(|_| SlotError::Closed)?;
        Ok(UploadSlot {
            _permit: permit,
            _owner: owner,
        })
    }

    /// Slots in all, free or held.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Refuses every later `acquire` (shutdown).
    pub fn close(&self) {
        self.slots.close();
    }
}
