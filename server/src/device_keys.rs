//! Enrolled device keys, kept in memory for a few seconds.
//!
//! Every signed request needs its device's public key before anything else
//! can be decided about it, including whether the device is over its own
//! request cap. Read from the database each time, a burst from one device
//! (4,096 polls) queued every other device's requests behind its reads in
//! the connection pool for seconds. Cached, a refused request costs a
//! signature check and no database work.
//!
//! A revocation is seen at once by the process that makes it (it calls
//! [`DeviceKeys::forget`]) and within [`KEY_TTL`] by every other server
//! process on the same database.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::db::Db;
use crate::store::devices;

/// How long a key read from the database is trusted.
pub const KEY_TTL: Duration = Duration::from_secs(5);
/// Entries kept at most; past it the cache starts over (a re-read each).
const MAX_ENTRIES: usize = 65_536;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKey {
    Active([u8; 32]),
    Revoked,
    /// The stored key is not 32 bytes: a corrupt row, never a client error.
    Malformed,
}

#[derive(Default)]
pub struct DeviceKeys {
    entries: Mutex<HashMap<i64, (DeviceKey, Instant)>>,
}

impl DeviceKeys {
    /// The device's key, or `None` when no such device is enrolled.
    pub async fn lookup(&self, db: &Db, device_id: i64) -> Result<Option<DeviceKey>, sqlx::Error> {
        if let Some(key) = self.cached(device_id) {
            return Ok(Some(key));
        }
        let Some(row) = devices::get(db, device_id).await? else {
            // Not cached: an id unknown now may be enrolled a moment later.
            return Ok(None);
        };
        let key = if row.revoked_ms.is_some() {
            DeviceKey::Revoked
        } else {
            match <[u8; 32]>::try_from(row.public_key.as_slice()) {
                Ok(key) => DeviceKey::Active(key),
                Err(_) => DeviceKey::Malformed,
            }
        };
        let mut entries = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
        if entries.len() >= MAX_ENTRIES {
            entries.clear();
        }
        entries.insert(device_id, (key, Instant::now()));
        Ok(Some(key))
    }

    fn cached(&self, device_id: i64) -> Option<DeviceKey> {
        let entries = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
        let (key, fetched) = entries.get(&device_id)?;
        (fetched.elapsed() < KEY_TTL).then_some(*key)
    }

    /// Drops a device's entry, so that this process sees its revocation at once.
    pub fn forget(&self, device_id: i64) {
        let mut entries = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
        entries.remove(&device_id);
    }
}
