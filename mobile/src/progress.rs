//! How often the app hears of training progress.
//!
//! A report crosses the binding into the app's runtime (the JVM, Swift,
//! Python) from the training thread, which takes that runtime's lock
//! and wakes its machinery; at every step of a small model that costs a
//! measurable share of the step (docs/mobile.md, "Size and speed"). A
//! progress bar needs a few updates a second, so reports are paced: the
//! first step's, then at most one per interval, and always the last
//! step's. Cancelling does not depend on reports: the cancel token is
//! read before every step.

use std::time::{Duration, Instant};

/// The default interval between progress reports.
pub const DEFAULT_PROGRESS_INTERVAL_MS: u64 = 100;

/// The longest interval accepted: a report at least once a day.
pub const MAX_PROGRESS_INTERVAL_MS: u64 = 86_400_000;

/// Decides which step reports reach the listener.
#[derive(Debug)]
pub(crate) struct Pace {
    interval: Duration,
    last: Option<Instant>,
}

impl Pace {
    /// Reports at most one per `interval_ms`; 0 reports every step.
    pub(crate) fn new(interval_ms: u64) -> Pace {
        Pace {
            interval: Duration::from_millis(interval_ms.min(MAX_PROGRESS_INTERVAL_MS)),
            last: None,
        }
    }

    /// Whether the report before step `steps_done` (of `total_steps`)
    /// goes out now.
    pub(crate) fn due(&mut self, steps_done: u64, total_steps: u64) -> bool {
        let now = Instant::now();
        let due = self.interval.is_zero()
            || steps_done + 1 >= total_steps
            || self
                .last
                .is_none_or(|last| now.duration_since(last) >= self.interval);
        if due {
            self.last = Some(now);
        }
        due
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_reports_every_step() {
        let mut pace = Pace::new(0);
        assert!((0..50).all(|step| pace.due(step, 50)));
    }

    #[test]
    fn a_long_interval_reports_the_first_and_the_last_step_only() {
        let mut pace = Pace::new(MAX_PROGRESS_INTERVAL_MS);
        let due: Vec<u64> = (0..50).filter(|&step| pace.due(step, 50)).collect();
        assert_eq!(due, vec![0, 49]);
    }

    #[test]
    fn a_short_interval_reports_again_once_it_has_passed() {
        let mut pace = Pace::new(20);
        assert!(pace.due(0, 1000));
        assert!(!pace.due(1, 1000));
        std::thread::sleep(Duration::from_millis(25));
        assert!(pace.due(2, 1000));
        assert!(!pace.due(3, 1000));
    }

    /// UniFFI's defaults are literals; they must spell this constant.
    #[test]
    fn the_binding_defaults_are_the_constant() {
        let field = format!(
            "#[uniffi(default = {DEFAULT_PROGRESS_INTERVAL_MS})]\n    pub progress_interval_ms: u64"
        );
        assert!(include_str!("types.rs").contains(&field));
        let argument = format!(
            "#[uniffi::method(default(progress_interval_ms = {DEFAULT_PROGRESS_INTERVAL_MS}))]"
        );
        assert!(include_str!("local.rs").contains(&argument));
    }

    #[test]
    fn an_interval_past_the_limit_is_cut_to_it() {
        assert_eq!(
            Pace::new(u64::MAX).interval,
            Duration::from_millis(MAX_PROGRESS_INTERVAL_MS)
        );
    }
}
