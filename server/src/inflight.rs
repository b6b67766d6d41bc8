//! Counting what each client has in flight, so that no single client can
//! take a shared resource for itself.
//!
//! One rule serves every per-client cap: connections per address, requests
//! and task polls per device, uploads per device and round. A client at its
//! cap is refused at once, never queued: queueing would let one client's
//! backlog delay everyone behind it, which is exactly what the caps are for.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex, PoisonError};

/// Counts of in-flight work per key, each capped at `limit`.
pub struct InFlight<K: Hash + Eq + Clone> {
    limit: usize,
    counts: Mutex<HashMap<K, usize>>,
}

/// One unit of in-flight work; dropping it gives the unit back.
pub struct InFlightGuard<K: Hash + Eq + Clone> {
    owner: Arc<InFlight<K>>,
    key: K,
}

impl<K: Hash + Eq + Clone> InFlight<K> {
    pub fn new(limit: usize) -> Arc<InFlight<K>> {
        Arc::new(InFlight {
            limit,
            counts: Mutex::new(HashMap::new()),
        })
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Takes a unit for `key`, or `None` when `key` is at the limit.
    pub fn try_enter(self: &Arc<Self>, key: K) -> Option<InFlightGuard<K>> {
        let mut counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        let count = counts.entry(key.clone()).or_insert(0);
        if *count >= self.limit {
            return None;
        }
        *count += 1;
        Some(InFlightGuard {
            owner: self.clone(),
            key,
        })
    }

    /// Units in flight for `key`.
    pub fn count(&self, key: &K) -> usize {
        let counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        counts.get(key).copied().unwrap_or(0)
    }

    /// Keys with work in flight; the map never holds a key at zero, so its
    /// size is bounded by the work in flight, not by the clients ever seen.
    pub fn keys(&self) -> usize {
        let counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        counts.len()
    }
}

impl<K: Hash + Eq + Clone + std::fmt::Debug> std::fmt::Debug for InFlightGuard<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("InFlightGuard").field(&self.key).finish()
    }
}

impl<K: Hash + Eq + Clone> Drop for InFlightGuard<K> {
    fn drop(&mut self) {
        let mut counts = self
            .owner
            .counts
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(count) = counts.get_mut(&self.key) {
            *count -= 1;
            if *count == 0 {
                counts.remove(&self.key);
            }
        }
    }
}

/// Keys told to come back later (`Retry-After`). Until then, work claiming
/// such a key is refused without further checks. Only a key's own verified
/// work may put it here, so a forger cannot throttle somebody else.
pub struct Throttle<K: Hash + Eq + Clone> {
    until: Mutex<HashMap<K, std::time::Instant>>,
}

/// Throttled keys kept at most; past it expired ones are dropped first.
const MAX_THROTTLED: usize = 65_536;

impl<K: Hash + Eq + Clone> Default for Throttle<K> {
    fn default() -> Throttle<K> {
        Throttle {
            until: Mutex::new(HashMap::new()),
        }
    }
}

impl<K: Hash + Eq + Clone> Throttle<K> {
    pub fn throttle(&self, key: K, duration: std::time::Duration) {
        let now = std::time::Instant::now();
        let mut until = self.until.lock().unwrap_or_else(PoisonError::into_inner);
        if until.len() >= MAX_THROTTLED {
            until.retain(|_, deadline| *deadline > now);
            if until.len() >= MAX_THROTTLED {
                until.clear();
            }
        }
        until.insert(key, now + duration);
    }

    /// True while `key` is throttled.
    pub fn is_throttled(&self, key: &K) -> bool {
        let until = self.until.lock().unwrap_or_else(PoisonError::into_inner);
        until
            .get(key)
            .is_some_and(|deadline| *deadline > std::time::Instant::now())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_at_its_limit_is_refused_and_others_are_not() {
        let in_flight = InFlight::new(2);
        let a1 = in_flight.try_enter("a").unwrap();
        let _a2 = in_flight.try_enter("a").unwrap();
        assert!(in_flight.try_enter("a").is_none());
        let _b = in_flight.try_enter("b").unwrap();
        drop(a1);
        assert_eq!(in_flight.count(&"a"), 1);
        assert!(in_flight.try_enter("a").is_some());
    }

    #[test]
    fn a_throttle_expires() {
        let throttle = Throttle::default();
        throttle.throttle(7, std::time::Duration::from_millis(30));
        assert!(throttle.is_throttled(&7));
        assert!(!throttle.is_throttled(&8));
        std::thread::sleep(std::time::Duration::from_millis(40));
        assert!(!throttle.is_throttled(&7));
    }

    #[test]
    fn keys_at_zero_are_forgotten() {
        let in_flight = InFlight::new(1);
        for key in 0..1000 {
            drop(in_flight.try_enter(key).unwrap());
        }
        assert_eq!(in_flight.keys(), 0);
    }
}
