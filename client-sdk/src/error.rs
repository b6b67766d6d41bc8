//! What can go wrong in a device call, as one error type for the whole SDK.

use std::path::PathBuf;

use canopy_protocol::bounds::BoundsError;
use canopy_protocol::secagg::SecAggError;
use canopy_protocol::secagg::wire::Stage;

use crate::transport::ConnectProblem;
use crate::trust::TrustError;

#[derive(Debug, thiserror::Error)]
pub enum SdkError {
    #[error(transparent)]
    Trust(#[from] TrustError),
    #[error("server URL `{0}` is invalid")]
    BadUrl(String),
    #[error("cannot reach the server at {url}")]
    Transport {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("the server answered {status} ({code}): {message}")]
    Server {
        status: u16,
        code: String,
        message: String,
        /// The answer's `Retry-After` in milliseconds (its delta-seconds
        /// form; an HTTP date is not read): no retry comes sooner, see
        /// [`RetryPolicy::wait_after`](crate::RetryPolicy::wait_after).
        retry_after_ms: Option<u64>,
    },
    #[error("the server sent an unreadable {what}: {reason}")]
    BadResponse { what: &'static str, reason: String },
    #[error("model version {version_id} failed verification: {reason}")]
    ModelVerification { version_id: i64, reason: String },
    /// A task outside the bounds every device checks
    /// ([`canopy_protocol::bounds`]): refused before anything is downloaded
    /// or trained, since a buggy server or a forged task could otherwise
    /// make the device train forever or fill its disk.
    #[error(
        "round {round_id}'s task is refused: its `{}` is outside the bounds devices accept; \
         the job's settings must be fixed on the server",
        .source.field()
    )]
    InvalidTask {
        round_id: i64,
        #[source]
        source: BoundsError,
    },
    /// An evaluation this device computed is out of the protocol's bounds
    /// (a non-finite loss, no samples, ...); nothing was sent.
    #[error("the evaluation for round {round_id} cannot be reported: {reason}")]
    InvalidEvaluation { round_id: i64, reason: String },
    /// A request body of this device's own could not be serialised; no
    /// request was sent. A bug in the values given, not the server's.
    #[error("cannot encode the {what} to send")]
    Encode {
        what: &'static str,
        #[source]
        source: serde_json::Error,
    },
    /// The operation's [`CancelToken`](crate::CancelToken) fired.
    #[error("the operation was cancelled")]
    Cancelled,
    /// A response body ended cleanly but short of its announced length.
    /// Retryable: the download resumes from where it stopped.
    #[error("the download from {url} stopped after {received} of {expected} bytes")]
    Incomplete {
        url: String,
        received: u64,
        expected: u64,
    },
    /// A [`crate::blocking`] call was made on a thread that runs a tokio
    /// runtime, where blocking would stall (or panic) the runtime.
    #[error(
        "the blocking client was called from inside a tokio runtime; use the async \
         canopy_sdk::DeviceClient there, or call from a thread that runs no runtime"
    )]
    InsideRuntime,
    /// The blocking client could not start its runtime.
    #[error("cannot start the blocking client's runtime")]
    Runtime(#[source] std::io::Error),
    /// Reading or writing a file of the SDK's own (a partial download).
    #[error("cannot {action} {path}")]
    LocalFile {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A certificate that the device authority this client pins did not
    /// make for this device's id and key; nothing was sent.
    #[error(
        "the certificate given to device {device_id} does not hold under the pinned device \
         authority"
    )]
    Certificate {
        device_id: i64,
        #[source]
        source: canopy_protocol::device_cert::CertificateError,
    },
    /// A secure-aggregation call (see [`crate::secure`]) was given a task
    /// that has no `secure_aggregation`.
    #[error("round {round_id}'s task does not run secure aggregation")]
    NotSecure { round_id: i64 },
    /// This device's side of the protocol refused a server message (a bad
    /// signature, a replay, a request that would reveal a neighbour's
    /// input) or could not make its own (an update that does not fit the
    /// plan).
    #[error("secure aggregation of round {round_id} failed at {}", .stage.name())]
    SecureAggregation {
        round_id: i64,
        stage: Stage,
        #[source]
        source: SecAggError,
    },
    /// The server answered 410 to a stage call: the stage closed before
    /// this device's message came, the device was dropped from the round,
    /// or the round failed. `code` and `reason` are the server's.
    #[error(
        "the server ended this device's part in secure round {round_id} at {} ({code}): \
         {reason}",
        .stage.name()
    )]
    SecureRoundGone {
        round_id: i64,
        stage: Stage,
        code: String,
        reason: String,
    },
    /// The server answered 422 to a stage message: it refused the message
    /// itself, for the reason it gives.
    #[error(
        "the server refused this device's {} message of round {round_id} ({code}): {reason}",
        .stage.name()
    )]
    SecureMessageRefused {
        round_id: i64,
        stage: Stage,
        code: String,
        reason: String,
    },
    /// The server's message for a stage did not come within the stage's
    /// time limit (see [`crate::secure`]).
    #[error(
        "no {} message of round {round_id} came within {waited_ms} ms; the device gives up on \
         the secure round",
        .stage.name()
    )]
    StageTimeout {
        round_id: i64,
        stage: Stage,
        waited_ms: u64,
    },
}

impl SdkError {
    /// Why a request to a server that is there got no answer (it speaks
    /// HTTPS to an `http://` URL, its certificate is not trusted, ...),
    /// when the transport error says so; see [`ConnectProblem`].
    pub fn connect_problem(&self) -> Option<ConnectProblem> {
        match self {
            SdkError::Transport { url, source } => ConnectProblem::of(source, url),
            _ => None,
        }
    }

    /// The HTTP status, for errors the server answered.
    pub fn status(&self) -> Option<u16> {
        match self {
            SdkError::Server { status, .. } => Some(*status),
            SdkError::SecureRoundGone { .. } => Some(410),
            SdkError::SecureMessageRefused { .. } => Some(422),
            _ => None,
        }
    }
}

/// An error and its causes on one line, a repeated cause once: the one
/// rule, `canopy_term`'s, which the SDK links without its `binary` feature
/// (no clap or indicatif in apps). The app-facing client builds its
/// messages on it.
pub use canopy_term::error_chain;
