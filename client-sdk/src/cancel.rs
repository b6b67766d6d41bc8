//! Cooperative cancellation.
//!
//! A [`CancelToken`] is shared by cloning (an `Arc` inside). Any clone may
//! call [`CancelToken::cancel`], from any thread, runtime or none; every
//! operation that holds a clone notices:
//!
//! - the device client's requests (a long poll, a download, an upload and
//!   the sleeps between retries) race against [`CancelToken::cancelled`]
//!   and return [`SdkError::Cancelled`](crate::SdkError::Cancelled) as soon
//!   as it fires; the request in flight is dropped, which closes its stream;
//! - local training ([`crate::train::train_task_cancellable`]) checks
//!   [`CancelToken::is_cancelled`] between batches.
//!
//! Cancellation is permanent: a cancelled token stays cancelled. To go on
//! working after a cancellation, give the client a fresh token
//! ([`crate::DeviceClient::set_cancel_token`]).

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::Notify;

#[derive(Default)]
struct Inner {
    cancelled: AtomicBool,
    notify: Notify,
}

/// A cheap, cloneable cancellation flag that can also be awaited.
#[derive(Clone, Default)]
pub struct CancelToken {
    inner: Arc<Inner>,
}

impl CancelToken {
    pub fn new() -> CancelToken {
        CancelToken::default()
    }

    /// Cancels every operation observing this token or a clone of it.
    /// Idempotent.
    pub fn cancel(&self) {
        if !self.inner.cancelled.swap(true, Ordering::SeqCst) {
            self.inner.notify.notify_waiters();
        }
    }

    pub fn is_cancelled(&self) -> bool {
        self.inner.cancelled.load(Ordering::SeqCst)
    }

    /// Completes once the token is cancelled (at once if it already is).
    pub async fn cancelled(&self) {
        loop {
            let notified = self.inner.notify.notified();
            tokio::pin!(notified);
            // Registers interest before looking at the flag, so a `cancel`
            // between the look and the wait is not lost.
            notified.as_mut().enable();
            if self.is_cancelled() {
                return;
            }
            notified.await;
        }
    }

    /// Runs `future` unless the token fires first; `None` when cancelled.
    /// A token that is already cancelled wins without polling `future`.
    pub async fn run<F: Future>(&self, future: F) -> Option<F::Output> {
        tokio::select! {
            biased;
            () = self.cancelled() => None,
            output = future => Some(output),
        }
    }
}

impl fmt::Debug for CancelToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CancelToken")
            .field("cancelled", &self.is_cancelled())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
    }

    #[test]
    fn clones_share_one_flag() {
        let token = CancelToken::new();
        let clone = token.clone();
        assert!(!token.is_cancelled() && !clone.is_cancelled());
        clone.cancel();
        assert!(token.is_cancelled() && clone.is_cancelled());
        clone.cancel();
        assert!(token.is_cancelled(), "cancel is idempotent");
        assert_eq!(format!("{token:?}"), "CancelToken { cancelled: true }");
    }

    #[test]
    fn an_already_cancelled_token_completes_at_once_and_wins_the_race() {
        let token = CancelToken::new();
        token.cancel();
        runtime().block_on(async {
            token.cancelled().await;
            let polled = std::cell::Cell::new(false);
            let outcome = token.run(async { polled.set(true) }).await;
            assert_eq!(outcome, None);
            assert!(!polled.get(), "the future is not polled once cancelled");
        });
    }

    #[test]
    fn cancel_from_another_thread_wakes_a_waiter_promptly() {
        let token = CancelToken::new();
        let canceller = token.clone();
        let thread = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            canceller.cancel();
        });
        let started = Instant::now();
        let outcome = runtime()
            .block_on(async { token.run(tokio::time::sleep(Duration::from_secs(30))).await });
        assert_eq!(outcome, None);
        assert!(started.elapsed() < Duration::from_secs(5));
        thread.join().expect("canceller");
    }

    #[test]
    fn an_uncancelled_token_lets_the_future_finish() {
        let token = CancelToken::new();
        assert_eq!(runtime().block_on(token.run(async { 7 })), Some(7));
    }
}
