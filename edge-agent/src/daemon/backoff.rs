//! Exponential backoff with jitter, bounded.

use std::time::Duration;

use rand::Rng;

/// Delays of `base · 2^n`, capped at `max`, each drawn uniformly from the
/// upper half of that value ("equal jitter"), so a fleet that lost its
/// server at the same instant does not come back at the same instant.
#[derive(Clone, Debug)]
pub struct Backoff {
    base: Duration,
    max: Duration,
    failures: u32,
}

impl Backoff {
    pub fn new(base: Duration, max: Duration) -> Backoff {
        Backoff {
            base,
            max: max.max(base),
            failures: 0,
        }
    }

    /// The delay before the next attempt; grows with each call.
    pub fn next_delay(&mut self) -> Duration {
        let ceiling = self
            .base
            .saturating_mul(1u32 << self.failures.min(20))
            .min(self.max);
        self.failures = self.failures.saturating_add(1);
        let half = ceiling / 2;
        let jitter_ms = rand::rng().random_range(0..=half.as_millis() as u64);
        half + Duration::from_millis(jitter_ms)
    }

    pub fn failures(&self) -> u32 {
        self.failures
    }

    pub fn reset(&mut self) {
        self.failures = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_grow_stay_bounded_and_reset() {
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        let mut last_ceiling = Duration::ZERO;
        for n in 0..40u32 {
            let delay = backoff.next_delay();
            let ceiling =
                (Duration::from_millis(100) * 2u32.pow(n.min(20))).min(Duration::from_secs(5));
            assert!(delay <= ceiling, "attempt {n}: {delay:?} > {ceiling:?}");
            assert!(
                delay >= ceiling / 2,
                "attempt {n}: {delay:?} < half of {ceiling:?}"
            );
            assert!(ceiling >= last_ceiling);
            last_ceiling = ceiling;
        }
        assert_eq!(backoff.failures(), 40);
        backoff.reset();
        assert!(backoff.next_delay() <= Duration::from_millis(100));
    }
}
