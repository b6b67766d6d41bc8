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
//! - local training ([`crate::train::TrainOptions::cancel`]) checks
//!   [`CancelToken::is_cancelled`] between batches.
//!
//! Cancellation is permanent: a cancelled token stays cancelled. To go on
//! working after a cancellation, give the client a fresh token
//! ([`crate::DeviceClient::set_cancel_token`]).
//!
//! A [`CancelToken::child`] is cancelled at the moment its parent is, and
//! can also be cancelled alone: a caller that stops work for reasons of
//! its own (a time limit) besides its user's token watches a child, so
//! that the user's cancel reaches the work before its next step rather
//! than when some watcher next looks (a cancel noticed late lands after
//! training, where there is no progress left to keep).
//!
//! The token is tokio-util's `CancellationToken`, whose tree of children
//! is the well-kept form of this; this type fixes the few operations the
//! SDK promises.

use std::fmt;
use std::future::Future;

use tokio_util::sync::CancellationToken;

/// A cheap, cloneable cancellation flag that can also be awaited.
#[derive(Clone, Default)]
pub struct CancelToken {
    inner: CancellationToken,
}

impl CancelToken {
    pub fn new() -> CancelToken {
        CancelToken::default()
    }

    /// A token cancelled when this one is (at once, on the cancelling
    /// thread) or on its own; cancelling it leaves this one alone. A child
    /// of a cancelled token starts cancelled.
    pub fn child(&self) -> CancelToken {
        CancelToken {
            inner: self.inner.child_token(),
        }
    }

    /// Cancels every operation observing this token, a clone of it or a
    /// child. Idempotent.
    pub fn cancel(&self) {
        self.inner.cancel();
    }

    pub fn is_cancelled(&self) -> bool {
        self.inner.is_cancelled()
    }

    /// Completes once the token is cancelled (at once if it already is).
    pub async fn cancelled(&self) {
        self.inner.cancelled().await;
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
    fn a_child_is_cancelled_with_its_parent_at_once_but_not_the_other_way() {
        let parent = CancelToken::new();
        let (child, sibling) = (parent.child(), parent.child());
        child.cancel();
        assert!(child.is_cancelled() && !parent.is_cancelled() && !sibling.is_cancelled());
        // No watcher thread in between: the parent's cancel has reached
        // the child when `cancel` returns.
        parent.cancel();
        assert!(sibling.is_cancelled());
        assert!(
            parent.child().is_cancelled(),
            "a late child starts cancelled"
        );
        runtime().block_on(sibling.cancelled());
    }

    #[test]
    fn an_uncancelled_token_lets_the_future_finish() {
        let token = CancelToken::new();
        assert_eq!(runtime().block_on(token.run(async { 7 })), Some(7));
    }
}
