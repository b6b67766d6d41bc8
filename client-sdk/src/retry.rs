//! Retries with capped exponential backoff and full jitter.
//!
//! A [`DeviceClient`](crate::DeviceClient) holds one [`RetryPolicy`] and
//! applies it to `next_task`, `download_model`, `upload_update`,
//! `heartbeat`, `report_metrics` and each request of a secure round
//! ([`crate::secure`], whose stage messages are repeated safely the way
//! uploads are). Every attempt is a new request with a
//! fresh signature (new nonce and timestamp), so the server's replay check
//! never refuses a retry. The default client policy is
//! [`RetryPolicy::none`], one attempt, which is how the client behaved
//! before it had retries; opt in with
//! [`DeviceClient::with_retry_policy`](crate::DeviceClient::with_retry_policy),
//! usually with [`RetryPolicy::default`].
//!
//! # What is retried
//!
//! [`SdkError::is_retryable`] decides:
//!
//! - transport failures: the connection could not be opened, was cut, or
//!   timed out, and a download whose body ended short
//!   ([`SdkError::Incomplete`]). Not retried: a request that could not be built, and TLS
//!   certificate failures (a pin or CA mismatch does not heal by itself);
//! - the server's 408 (request timeout), 429 (rate limited), 502, 503 and
//!   504 (a proxy or the server is overloaded, restarting or shutting down);
//! - the server's 500 too: it answers 500 for database failures (a lost
//!   database connection, a failed fold transaction) as well as for bugs;
//!   the former heal within seconds, and losing a round's update to one is
//!   worse than the bounded cost of retrying a deterministic 500 a few
//!   times;
//! - never any other 4xx: 400, 401 (signature, clock or revocation), 403,
//!   404, 409 (duplicate), 410 (round closed), 413 and 422 are answers about
//!   the request itself, and repeating it cannot change them. Nor are model
//!   verification failures or unreadable answers retried.
//!
//! A client may carry a [`RetryObserver`]
//! ([`DeviceClient::with_retry_observer`](crate::DeviceClient::with_retry_observer)),
//! told of every failed attempt before the wait that follows it, e.g. to
//! log it; the SDK itself logs nothing.
//!
//! # Retry-After
//!
//! A 429 or 503 carries the server's `Retry-After`: a device over its
//! request rate is refused for that long, and an attempt inside the window
//! only extends the refusal. So the wait before a retry is never shorter
//! than it ([`RetryPolicy::wait_after`]); the jittered backoff still applies
//! when it is longer, and the server's figure is capped by
//! [`RetryPolicy::max_backoff_ms`], so a server cannot park a device for
//! longer than its policy allows.
//!
//! # Uploads
//!
//! An upload is safe to repeat because the server folds at most one update
//! per device and round and answers `409 Conflict` to any later one. The
//! retrying upload therefore takes a 409 on attempt *n* > 1 as "an earlier
//! attempt of this call was accepted" exactly when one of the earlier
//! attempts failed in a way that leaves open whether the server folded it:
//! the connection broke after the request was sent (any transport error
//! other than a failure to connect), or the server or a proxy answered 408,
//! 500, 502 or 504 (the fold may have committed while the answer was being
//! lost or timed out). It then returns a receipt built locally (see
//! [`DeviceClient::upload_update`](crate::DeviceClient::upload_update)).
//! A 409 on the first attempt, or after earlier attempts that were all
//! refused before the body was processed (failure to connect, 429, 503), is
//! returned as the error it is: the device had uploaded before this call.
//!
//! # Downloads
//!
//! A download that breaks after receiving bytes resumes with
//! `Range: bytes=N-` instead of starting over. Attempts that receive no new
//! byte count against `max_attempts`; an attempt that made progress resets
//! the count, since the link works; [`MAX_DOWNLOAD_REQUESTS`] bounds the
//! total.

use std::sync::Arc;
use std::time::Duration;

use crate::cancel::CancelToken;
use crate::error::SdkError;
use crate::transport::is_certificate_failure;

/// Upper bound on [`RetryPolicy::max_attempts`].
pub const MAX_ATTEMPTS_CAP: u32 = 20;
/// Upper bound on [`RetryPolicy::max_backoff_ms`]: five minutes.
pub const MAX_BACKOFF_CAP_MS: u64 = 300_000;
/// Upper bound on [`RetryPolicy::multiplier`].
pub const MAX_MULTIPLIER: f64 = 10.0;
/// Requests one model download may make in all, resumptions included.
pub const MAX_DOWNLOAD_REQUESTS: u32 = 100;

/// How often and how patiently a failed request is repeated.
///
/// The wait before retry *k* (k = 0 for the second attempt) is drawn
/// uniformly from `[0, min(max_backoff_ms, initial_backoff_ms *
/// multiplier^k)]` ("full jitter"), so that devices cut off together do not
/// come back together. Out-of-range fields are clamped by
/// [`RetryPolicy::normalized`], which every use goes through: at most
/// [`MAX_ATTEMPTS_CAP`] attempts, waits of at most [`MAX_BACKOFF_CAP_MS`],
/// a multiplier in `[1, MAX_MULTIPLIER]`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RetryPolicy {
    /// Attempts in all, the first included; 1 means no retry.
    pub max_attempts: u32,
    pub initial_backoff_ms: u64,
    pub max_backoff_ms: u64,
    pub multiplier: f64,
}

impl Default for RetryPolicy {
    /// Five attempts, waits capped at 0.25 s, 0.5 s, 1 s, 2 s: a server
    /// restart of a few seconds is ridden out, a dead server is reported
    /// within about four seconds of waiting.
    fn default() -> RetryPolicy {
        RetryPolicy {
            max_attempts: 5,
            initial_backoff_ms: 250,
            max_backoff_ms: 30_000,
            multiplier: 2.0,
        }
    }
}

impl RetryPolicy {
    /// One attempt, no retry.
    pub const fn none() -> RetryPolicy {
        RetryPolicy {
            max_attempts: 1,
            initial_backoff_ms: 0,
            max_backoff_ms: 0,
            multiplier: 1.0,
        }
    }

    /// The policy with every field in range: `max_attempts` in
    /// `1..=MAX_ATTEMPTS_CAP`, `max_backoff_ms <= MAX_BACKOFF_CAP_MS`,
    /// `initial_backoff_ms <= max_backoff_ms`, and a finite `multiplier` in
    /// `[1, MAX_MULTIPLIER]` (NaN becomes 2).
    pub fn normalized(&self) -> RetryPolicy {
        let max_backoff_ms = self.max_backoff_ms.min(MAX_BACKOFF_CAP_MS);
        let multiplier = if self.multiplier.is_nan() {
            2.0
        } else {
            self.multiplier.clamp(1.0, MAX_MULTIPLIER)
        };
        RetryPolicy {
            max_attempts: self.max_attempts.clamp(1, MAX_ATTEMPTS_CAP),
            initial_backoff_ms: self.initial_backoff_ms.min(max_backoff_ms),
            max_backoff_ms,
            multiplier,
        }
    }

    /// The longest wait before retry `retry` (0 before the second attempt).
    pub fn backoff_ceiling(&self, retry: u32) -> Duration {
        let policy = self.normalized();
        let exponent = i32::try_from(retry).unwrap_or(i32::MAX);
        let grown = policy.initial_backoff_ms as f64 * policy.multiplier.powi(exponent);
        let ms = if grown.is_finite() {
            grown.min(policy.max_backoff_ms as f64) as u64
        } else {
            policy.max_backoff_ms
        };
        Duration::from_millis(ms)
    }

    /// The wait before retry `retry` after `error`: the random
    /// [`backoff`](RetryPolicy::backoff), or the server's `Retry-After`
    /// when that is longer (capped by `max_backoff_ms`). The one rule every
    /// retry loop of the SDK, and the agent's poll loop, waits by.
    pub fn wait_after(&self, retry: u32, error: &SdkError) -> Duration {
        self.wait_after_with(retry, error, rand::random::<f64>())
    }

    /// [`wait_after`](RetryPolicy::wait_after) for a given draw `unit`.
    pub fn wait_after_with(&self, retry: u32, error: &SdkError, unit: f64) -> Duration {
        let backoff = self.backoff_with(retry, unit);
        let floor_ms = match error {
            SdkError::Server {
                retry_after_ms: Some(ms),
                ..
            } => (*ms).min(self.normalized().max_backoff_ms),
            _ => 0,
        };
        backoff.max(Duration::from_millis(floor_ms))
    }

    /// A random wait before retry `retry`, uniform in
    /// `[0, backoff_ceiling(retry)]`.
    pub fn backoff(&self, retry: u32) -> Duration {
        self.backoff_with(retry, rand::random::<f64>())
    }

    /// The wait for a given draw `unit` in `[0, 1]` (clamped): `unit ×
    /// backoff_ceiling(retry)`. [`RetryPolicy::backoff`] draws it at random.
    pub fn backoff_with(&self, retry: u32, unit: f64) -> Duration {
        let unit = if unit.is_nan() {
            0.0
        } else {
            unit.clamp(0.0, 1.0)
        };
        self.backoff_ceiling(retry).mul_f64(unit)
    }
}

/// A failed attempt that is about to be repeated.
#[derive(Debug)]
pub struct RetryNotice<'a> {
    /// Attempts that failed so far in this call (1 after the first).
    pub failures: u32,
    /// The wait before the next attempt.
    pub wait: Duration,
    pub error: &'a SdkError,
}

/// Told of every retry of a client's calls, before its wait; see
/// [`DeviceClient::with_retry_observer`](crate::DeviceClient::with_retry_observer).
pub type RetryObserver = Arc<dyn Fn(&RetryNotice<'_>) + Send + Sync>;

/// Waits the backoff before the retry that follows `failures` failed
/// attempts, after telling `observer`; cancelled by `cancel`.
pub(crate) async fn wait_to_retry(
    policy: &RetryPolicy,
    cancel: &CancelToken,
    observer: Option<&RetryObserver>,
    failures: u32,
    error: &SdkError,
) -> Result<(), SdkError> {
    let wait = policy.wait_after(failures.saturating_sub(1), error);
    if let Some(observer) = observer {
        observer(&RetryNotice {
            failures,
            wait,
            error,
        });
    }
    sleep(cancel, wait).await
}

/// Sleeps unless cancelled first.
pub(crate) async fn sleep(cancel: &CancelToken, wait: Duration) -> Result<(), SdkError> {
    if wait.is_zero() {
        return if cancel.is_cancelled() {
            Err(SdkError::Cancelled)
        } else {
            Ok(())
        };
    }
    cancel
        .run(tokio::time::sleep(wait))
        .await
        .ok_or(SdkError::Cancelled)
}

/// Runs `attempt` until it succeeds, fails with an error that is not
/// [retryable](SdkError::is_retryable), or `policy` runs out, sleeping the
/// jittered backoff between attempts. Every attempt and every sleep races
/// `cancel`, which turns into [`SdkError::Cancelled`]. Returns the last
/// error when the attempts run out.
///
/// Useful for an application's own calls; the client's methods use it
/// with the client's policy and token.
pub async fn retrying<T, F, Fut>(
    policy: &RetryPolicy,
    cancel: &CancelToken,
    attempt: F,
) -> Result<T, SdkError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, SdkError>>,
{
    retrying_observed(policy, cancel, None, attempt).await
}

/// [`retrying`] that tells `observer` of every retry.
pub(crate) async fn retrying_observed<T, F, Fut>(
    policy: &RetryPolicy,
    cancel: &CancelToken,
    observer: Option<&RetryObserver>,
    mut attempt: F,
) -> Result<T, SdkError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, SdkError>>,
{
    let policy = policy.normalized();
    let mut failures = 0u32;
    loop {
        let error = match cancel.run(attempt()).await {
            None => return Err(SdkError::Cancelled),
            Some(Ok(value)) => return Ok(value),
            Some(Err(error)) => error,
        };
        failures += 1;
        if !error.is_retryable() || failures >= policy.max_attempts {
            return Err(error);
        }
        wait_to_retry(&policy, cancel, observer, failures, &error).await?;
    }
}

impl SdkError {
    /// Whether repeating the request may succeed; see the [module
    /// documentation](crate::retry) for the list and the reasons.
    pub fn is_retryable(&self) -> bool {
        match self {
            SdkError::Transport { source, .. } => transport_is_retryable(source),
            SdkError::Server { status, .. } => matches!(status, 408 | 429 | 500 | 502 | 503 | 504),
            SdkError::Incomplete { .. } => true,
            _ => false,
        }
    }

    /// Whether the server may have carried out the request although this
    /// error came back: the request may have been delivered and its answer
    /// lost, or the server gave up waiting while the work went on.
    pub(crate) fn may_have_been_processed(&self) -> bool {
        match self {
            SdkError::Transport { source, .. } => !source.is_connect() && !source.is_builder(),
            SdkError::Server { status, .. } => matches!(status, 408 | 500 | 502 | 504),
            _ => false,
        }
    }
}

fn transport_is_retryable(error: &reqwest::Error) -> bool {
    !(error.is_builder() || error.is_redirect() || is_certificate_failure(error))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server(status: u16) -> SdkError {
        SdkError::Server {
            status,
            code: "x".into(),
            message: "y".into(),
            retry_after_ms: None,
        }
    }

    #[test]
    fn defaults_are_sane_and_within_the_caps() {
        let policy = RetryPolicy::default();
        assert_eq!(policy, policy.normalized());
        assert!(policy.max_attempts > 1 && policy.max_attempts <= MAX_ATTEMPTS_CAP);
        assert!(policy.initial_backoff_ms > 0);
        assert!(policy.max_backoff_ms <= MAX_BACKOFF_CAP_MS);
        assert_eq!(RetryPolicy::none().normalized().max_attempts, 1);
    }

    #[test]
    fn out_of_range_fields_are_clamped() {
        let wild = RetryPolicy {
            max_attempts: 0,
            initial_backoff_ms: u64::MAX,
            max_backoff_ms: u64::MAX,
            multiplier: f64::INFINITY,
        }
        .normalized();
        assert_eq!(wild.max_attempts, 1);
        assert_eq!(wild.max_backoff_ms, MAX_BACKOFF_CAP_MS);
        assert_eq!(wild.initial_backoff_ms, MAX_BACKOFF_CAP_MS);
        assert_eq!(wild.multiplier, MAX_MULTIPLIER);
        let many = RetryPolicy {
            max_attempts: u32::MAX,
            multiplier: f64::NAN,
            ..RetryPolicy::default()
        }
        .normalized();
        assert_eq!(many.max_attempts, MAX_ATTEMPTS_CAP);
        assert_eq!(many.multiplier, 2.0);
        let shrinking = RetryPolicy {
            multiplier: 0.1,
            ..RetryPolicy::default()
        };
        assert_eq!(shrinking.normalized().multiplier, 1.0);
    }

    #[test]
    fn the_ceiling_grows_exponentially_up_to_the_maximum() {
        let policy = RetryPolicy {
            max_attempts: 10,
            initial_backoff_ms: 100,
            max_backoff_ms: 1_000,
            multiplier: 2.0,
        };
        let ceilings: Vec<u64> = (0..6)
            .map(|k| policy.backoff_ceiling(k).as_millis() as u64)
            .collect();
        assert_eq!(ceilings, [100, 200, 400, 800, 1_000, 1_000]);
        // Huge exponents saturate instead of overflowing.
        assert_eq!(policy.backoff_ceiling(u32::MAX), Duration::from_secs(1));
        let capped = RetryPolicy {
            max_backoff_ms: u64::MAX,
            ..policy
        };
        assert_eq!(
            capped.backoff_ceiling(1_000),
            Duration::from_millis(MAX_BACKOFF_CAP_MS)
        );
    }

    #[test]
    fn jitter_spans_zero_to_the_ceiling() {
        let policy = RetryPolicy {
            max_attempts: 10,
            initial_backoff_ms: 100,
            max_backoff_ms: 10_000,
            multiplier: 3.0,
        };
        assert_eq!(policy.backoff_with(2, 0.0), Duration::ZERO);
        assert_eq!(policy.backoff_with(2, 1.0), Duration::from_millis(900));
        assert_eq!(policy.backoff_with(2, 0.5), Duration::from_millis(450));
        assert_eq!(policy.backoff_with(2, 7.0), Duration::from_millis(900));
        assert_eq!(policy.backoff_with(2, f64::NAN), Duration::ZERO);
        let draws: Vec<Duration> = (0..2_000).map(|_| policy.backoff(2)).collect();
        let ceiling = policy.backoff_ceiling(2);
        assert!(draws.iter().all(|wait| *wait <= ceiling));
        // Full jitter: the draws cover the range, low and high.
        assert!(draws.iter().any(|wait| *wait < ceiling / 4));
        assert!(draws.iter().any(|wait| *wait > ceiling * 3 / 4));
        let distinct: std::collections::HashSet<_> = draws.iter().collect();
        assert!(distinct.len() > 100, "waits are random");
    }

    #[test]
    fn retryable_statuses_are_transient_ones_only() {
        for status in [408, 429, 500, 502, 503, 504] {
            assert!(server(status).is_retryable(), "{status}");
        }
        for status in [400, 401, 403, 404, 409, 410, 413, 416, 422, 501] {
            assert!(!server(status).is_retryable(), "{status}");
        }
        assert!(!SdkError::Cancelled.is_retryable());
        let short = SdkError::Incomplete {
            url: "https://x/m".into(),
            received: 1,
            expected: 2,
        };
        assert!(short.is_retryable());
        let verification = SdkError::ModelVerification {
            version_id: 1,
            reason: "bad".into(),
        };
        assert!(!verification.is_retryable());
        // A 409 after these may mean an earlier upload went through.
        for status in [408, 500, 502, 504] {
            assert!(server(status).may_have_been_processed(), "{status}");
        }
        for status in [429, 503, 401, 409] {
            assert!(!server(status).may_have_been_processed(), "{status}");
        }
    }

    #[test]
    fn retry_after_is_a_floor_capped_by_the_policy() {
        let policy = RetryPolicy {
            max_attempts: 5,
            initial_backoff_ms: 100,
            max_backoff_ms: 5_000,
            multiplier: 2.0,
        };
        let told = |ms| SdkError::Server {
            status: 429,
            code: "too_many_requests".into(),
            message: "slow down".into(),
            retry_after_ms: Some(ms),
        };
        // Shorter backoff: the server's figure wins.
        assert_eq!(
            policy.wait_after_with(0, &told(1_000), 1.0),
            Duration::from_millis(1_000)
        );
        // Longer backoff: the backoff stands.
        assert_eq!(
            policy.wait_after_with(6, &told(1_000), 1.0),
            Duration::from_millis(5_000)
        );
        // A server cannot park the device past the policy's patience.
        assert_eq!(
            policy.wait_after_with(0, &told(3_600_000), 0.0),
            Duration::from_millis(5_000)
        );
        // Without the header, the plain backoff.
        assert_eq!(
            policy.wait_after_with(0, &server(429), 0.5),
            Duration::from_millis(50)
        );
    }

    #[test]
    fn certificate_failures_are_found_inside_nested_io_errors() {
        use std::io::{Error, ErrorKind};
        let nested = |tls: rustls::Error| Error::other(Error::new(ErrorKind::InvalidData, tls));
        let pin = nested(rustls::Error::General("pin mismatch".into()));
        assert!(is_certificate_failure(&pin));
        // The pinning verifier's own error, as the handshake returns it.
        let pinned = nested(rustls::Error::Other(rustls::OtherError(
            std::sync::Arc::new(crate::trust::PinMismatch {
                actual: [1; 32],
                pinned: [0; 32],
            }),
        )));
        assert!(is_certificate_failure(&pinned));
        let expired = nested(rustls::Error::InvalidCertificate(
            rustls::CertificateError::Expired,
        ));
        assert!(is_certificate_failure(&expired));
        assert!(!is_certificate_failure(&nested(
            rustls::Error::DecryptError
        )));
        assert!(!is_certificate_failure(&Error::new(
            ErrorKind::ConnectionReset,
            "reset"
        )));
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
    }

    #[test]
    fn retrying_stops_at_max_attempts_and_at_permanent_errors() {
        let fast = RetryPolicy {
            max_attempts: 4,
            initial_backoff_ms: 1,
            max_backoff_ms: 2,
            multiplier: 2.0,
        };
        let cancel = CancelToken::new();
        let rt = runtime();
        let mut calls = 0;
        let result: Result<(), _> = rt.block_on(retrying(&fast, &cancel, || {
            calls += 1;
            async { Err(server(503)) }
        }));
        assert_eq!(result.err().and_then(|e| e.status()), Some(503));
        assert_eq!(calls, 4);

        let mut calls = 0;
        let result: Result<(), _> = rt.block_on(retrying(&fast, &cancel, || {
            calls += 1;
            async { Err(server(422)) }
        }));
        assert_eq!(result.err().and_then(|e| e.status()), Some(422));
        assert_eq!(calls, 1, "a 422 is not retried");

        let mut calls = 0;
        let result = rt.block_on(retrying(&fast, &cancel, || {
            calls += 1;
            let outcome = if calls < 3 {
                Err(server(502))
            } else {
                Ok(calls)
            };
            async move { outcome }
        }));
        assert_eq!(result.ok(), Some(3));
    }

    #[test]
    fn a_cancelled_retry_sleep_returns_promptly() {
        let slow = RetryPolicy {
            max_attempts: 5,
            initial_backoff_ms: 60_000,
            max_backoff_ms: 60_000,
            multiplier: 1.0,
        };
        let cancel = CancelToken::new();
        let canceller = cancel.clone();
        let thread = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            canceller.cancel();
        });
        let started = std::time::Instant::now();
        let result: Result<(), _> =
            runtime().block_on(retrying(&slow, &cancel, || async { Err(server(503)) }));
        assert!(matches!(result, Err(SdkError::Cancelled)), "{result:?}");
        assert!(started.elapsed() < Duration::from_secs(10));
        thread.join().expect("canceller");
    }
}
