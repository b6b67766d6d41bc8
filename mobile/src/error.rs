//! The one error type that crosses the boundary.
//!
//! Each variant keeps the name of the Rust error it comes from (an
//! [`SdkError`] variant keeps its own name), and its message is that
//! error's message with every cause after it, so Kotlin, Swift, Python and
//! C see what a Rust caller would. UniFFI passes it as a "flat" error: the
//! variant and the message. A panic inside the core never crosses: every
//! exported call runs under [`guard`], which turns it into
//! [`CanopyError::Internal`].

use std::panic::{AssertUnwindSafe, catch_unwind};

use canopy_sdk::SdkError;
use canopy_sdk::blocking::RunTaskError;
use canopy_sdk::train::TrainError;

/// What went wrong in a call, with the cause chain and, where one helps, a
/// hint, in `message`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, uniffi::Error)]
#[uniffi(flat_error)]
pub enum CanopyError {
    /// A setting given to the client cannot be used.
    #[error("{message}")]
    InvalidConfig { message: String },
    /// Training data given to `run_task` cannot be used.
    #[error("{message}")]
    InvalidData { message: String },
    /// The storage directory cannot be read or written.
    #[error("{message}")]
    Storage { message: String },
    /// A call that needs an enrolled device, before `enroll`.
    #[error("{message}")]
    NotEnrolled { message: String },
    /// `enroll` on a device that is enrolled already.
    #[error("{message}")]
    AlreadyEnrolled { message: String },
    /// `run_task` with no task accepted by `check_for_task`.
    #[error("{message}")]
    NoTask { message: String },
    /// The device's state does not meet the job's policy (charging,
    /// unmetered network, idle, battery); the task is kept for later.
    #[error("{message}")]
    Ineligible { message: String },
    /// The task is over one of the device's limits (memory, download).
    #[error("{message}")]
    OverLimit { message: String },
    /// The task's deadline passed; it was given up.
    #[error("{message}")]
    TaskExpired { message: String },
    /// The round went on without this device's update or report: it
    /// reached its target first (rounds select more devices than they
    /// need), its deadline passed, or it dropped the device. Nothing is
    /// kept; the next `check_for_task` brings the next task.
    #[error("{message}")]
    RoundClosed { message: String },
    /// The run hit the client's time limit; progress made in training is
    /// checkpointed (the message says at which step) and a later
    /// `run_task` resumes it.
    #[error("{message}")]
    TimeLimit { message: String },
    /// The cancel token fired; as for `TimeLimit`, the message says which
    /// step is checkpointed, or that none is.
    #[error("{message}")]
    Cancelled { message: String },
    /// Local training failed.
    #[error("{message}")]
    Training { message: String },
    /// The server certificate settings (pin, CA file) are unusable.
    #[error("{message}")]
    Trust { message: String },
    /// A device certificate the pinned device authority did not make for
    /// this device's id and enrolled key.
    #[error("{message}")]
    Certificate { message: String },
    #[error("{message}")]
    BadUrl { message: String },
    /// The server could not be reached.
    #[error("{message}")]
    Transport { message: String },
    /// The server answered with an error.
    #[error("{message}")]
    Server { message: String },
    #[error("{message}")]
    BadResponse { message: String },
    /// A downloaded model failed its digest or signature check.
    #[error("{message}")]
    ModelVerification { message: String },
    #[error("{message}")]
    InvalidTask { message: String },
    #[error("{message}")]
    InvalidEvaluation { message: String },
    #[error("{message}")]
    Encode { message: String },
    #[error("{message}")]
    Incomplete { message: String },
    #[error("{message}")]
    InsideRuntime { message: String },
    #[error("{message}")]
    Runtime { message: String },
    #[error("{message}")]
    LocalFile { message: String },
    #[error("{message}")]
    NotSecure { message: String },
    #[error("{message}")]
    SecureAggregation { message: String },
    #[error("{message}")]
    SecureRoundGone { message: String },
    #[error("{message}")]
    SecureMessageRefused { message: String },
    #[error("{message}")]
    StageTimeout { message: String },
    /// A bug: the core panicked. The panic's message is kept.
    #[error("{message}")]
    Internal { message: String },
}

impl CanopyError {
    /// The variant's name, as every binding spells it.
    pub fn name(&self) -> &'static str {
        use CanopyError::*;
        match self {
            InvalidConfig { .. } => "InvalidConfig",
            InvalidData { .. } => "InvalidData",
            Storage { .. } => "Storage",
            NotEnrolled { .. } => "NotEnrolled",
            AlreadyEnrolled { .. } => "AlreadyEnrolled",
            NoTask { .. } => "NoTask",
            Ineligible { .. } => "Ineligible",
            OverLimit { .. } => "OverLimit",
            TaskExpired { .. } => "TaskExpired",
            RoundClosed { .. } => "RoundClosed",
            TimeLimit { .. } => "TimeLimit",
            Cancelled { .. } => "Cancelled",
            Training { .. } => "Training",
            Trust { .. } => "Trust",
            Certificate { .. } => "Certificate",
            BadUrl { .. } => "BadUrl",
            Transport { .. } => "Transport",
            Server { .. } => "Server",
            BadResponse { .. } => "BadResponse",
            ModelVerification { .. } => "ModelVerification",
            InvalidTask { .. } => "InvalidTask",
            InvalidEvaluation { .. } => "InvalidEvaluation",
            Encode { .. } => "Encode",
            Incomplete { .. } => "Incomplete",
            InsideRuntime { .. } => "InsideRuntime",
            Runtime { .. } => "Runtime",
            LocalFile { .. } => "LocalFile",
            NotSecure { .. } => "NotSecure",
            SecureAggregation { .. } => "SecureAggregation",
            SecureRoundGone { .. } => "SecureRoundGone",
            SecureMessageRefused { .. } => "SecureMessageRefused",
            StageTimeout { .. } => "StageTimeout",
            Internal { .. } => "Internal",
        }
    }

    /// The message, cause chain included.
    pub fn message(&self) -> String {
        self.to_string()
    }

    pub(crate) fn storage(message: impl Into<String>) -> CanopyError {
        CanopyError::Storage {
            message: message.into(),
        }
    }

    pub(crate) fn config(message: impl Into<String>) -> CanopyError {
        CanopyError::InvalidConfig {
            message: message.into(),
        }
    }

    pub(crate) fn data(message: impl Into<String>) -> CanopyError {
        CanopyError::InvalidData {
            message: message.into(),
        }
    }
}

/// `error` and each of its causes, `: `-separated
/// ([`canopy_sdk::error_chain`]), then `hint` if any.
pub(crate) fn chain(error: &dyn std::error::Error, hint: Option<&str>) -> String {
    let mut text = canopy_sdk::error_chain(error);
    if let Some(hint) = hint {
        text.push_str("\nhint: ");
        text.push_str(hint);
    }
    text
}

impl From<SdkError> for CanopyError {
    fn from(error: SdkError) -> CanopyError {
        let message = chain(&error, sdk_hint(&error));
        match error {
            SdkError::Trust(_) => CanopyError::Trust { message },
            SdkError::Certificate { .. } => CanopyError::Certificate { message },
            SdkError::BadUrl(_) => CanopyError::BadUrl { message },
            SdkError::Transport { .. } => CanopyError::Transport { message },
            SdkError::Server { .. } => CanopyError::Server { message },
            SdkError::BadResponse { .. } => CanopyError::BadResponse { message },
            SdkError::ModelVerification { .. } => CanopyError::ModelVerification { message },
            SdkError::InvalidTask { .. } => CanopyError::InvalidTask { message },
            SdkError::InvalidEvaluation { .. } => CanopyError::InvalidEvaluation { message },
            SdkError::Encode { .. } => CanopyError::Encode { message },
            SdkError::Cancelled => CanopyError::Cancelled { message },
            SdkError::Incomplete { .. } => CanopyError::Incomplete { message },
            SdkError::InsideRuntime => CanopyError::InsideRuntime { message },
            SdkError::Runtime(_) => CanopyError::Runtime { message },
            SdkError::LocalFile { .. } => CanopyError::LocalFile { message },
            SdkError::NotSecure { .. } => CanopyError::NotSecure { message },
            SdkError::SecureAggregation { .. } => CanopyError::SecureAggregation { message },
            SdkError::SecureRoundGone { .. } => CanopyError::SecureRoundGone { message },
            SdkError::SecureMessageRefused { .. } => CanopyError::SecureMessageRefused { message },
            SdkError::StageTimeout { .. } => CanopyError::StageTimeout { message },
        }
    }
}

fn sdk_hint(error: &SdkError) -> Option<&'static str> {
    match error {
        SdkError::Transport { .. } => Some(
            "check the server URL and that the device is online; calls are retried under the \
             client's retry policy",
        ),
        SdkError::Trust(_) => Some(
            "pin the fingerprint `canopy-server serve` prints (`sha256:` and 64 hex digits), or \
             give the PEM of the CA that signed the server's certificate",
        ),
        SdkError::Certificate { .. } => {
            Some("ask the device authority for a certificate of this device's id and enrolled key")
        }
        SdkError::ModelVerification { .. } => Some(
            "the download does not match what the server signed; it was discarded and nothing \
             was trained",
        ),
        _ => None,
    }
}

impl From<TrainError> for CanopyError {
    fn from(error: TrainError) -> CanopyError {
        let message = chain(&error, None);
        match error {
            TrainError::Cancelled => CanopyError::Cancelled { message },
            TrainError::InvalidTask(_) => CanopyError::InvalidTask { message },
            TrainError::NoData => CanopyError::InvalidData { message },
            _ => CanopyError::Training { message },
        }
    }
}

impl From<RunTaskError> for CanopyError {
    fn from(error: RunTaskError) -> CanopyError {
        match error {
            RunTaskError::Sdk(sdk) => sdk.into(),
            RunTaskError::Train(train) => train.into(),
        }
    }
}

/// Runs `call`, turning a panic into [`CanopyError::Internal`] with the
/// panic's message, so no unwinding reaches a foreign frame.
pub fn guard<T>(call: impl FnOnce() -> Result<T, CanopyError>) -> Result<T, CanopyError> {
    match catch_unwind(AssertUnwindSafe(call)) {
        Ok(result) => result,
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic with no message".to_string());
            Err(CanopyError::Internal {
                message: format!(
                    "the Canopy core panicked: {what}\nhint: this is a bug in Canopy; the \
                     client is still usable, and the storage directory was not left half-written \
                     (every file there is replaced atomically)"
                ),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_becomes_an_internal_error_with_its_message() {
        let result: Result<(), CanopyError> = guard(|| panic!("boom {}", 7));
        let error = result.unwrap_err();
        assert_eq!(error.name(), "Internal");
        assert!(error.message().contains("boom 7"), "{error}");
    }

    #[test]
    fn sdk_errors_keep_their_names_and_messages() {
        let error: CanopyError = SdkError::Cancelled.into();
        assert_eq!(error.name(), "Cancelled");
        assert_eq!(error.message(), SdkError::Cancelled.to_string());
        let server: CanopyError = SdkError::Server {
            status: 403,
            code: "forbidden".into(),
            message: "revoked".into(),
            retry_after_ms: None,
        }
        .into();
        assert_eq!(server.name(), "Server");
        assert!(
            server.message().contains("403 (forbidden): revoked"),
            "{server}"
        );
        let certificate: CanopyError = SdkError::Certificate {
            device_id: 7,
            source: canopy_protocol::device_cert::CertificateError::Forged { device_id: 7 },
        }
        .into();
        assert_eq!(certificate.name(), "Certificate");
        assert!(
            certificate
                .message()
                .contains("device 7's certificate was not made")
                && certificate
                    .message()
                    .contains("hint: ask the device authority"),
            "{certificate}"
        );
    }
}
