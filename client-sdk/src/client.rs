//! The HTTPS device client.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use canopy_protocol::auth::{self, DeviceKey};
use canopy_protocol::messages::{
    Capabilities, EnrollRequest, EnrollResponse, ErrorBody, Heartbeat, HeartbeatResponse,
    RoundMetrics, Task, UploadReceipt,
};
use canopy_protocol::model_sig::{
    self, HEADER_MODEL_DIGEST, HEADER_MODEL_KEY, HEADER_MODEL_SIGNATURE, KeyTrustError,
    SigningKeys, TrustedKeys,
};
use canopy_protocol::secagg::SecAggError;
use canopy_protocol::secagg::wire::Stage;
use reqwest::{Method, StatusCode};

use crate::cancel::CancelToken;
use crate::retry::{self, MAX_DOWNLOAD_REQUESTS, RetryPolicy};
use crate::trust::{Trust, TrustError};

/// Largest model this client downloads.
pub const MAX_MODEL_BYTES: u64 = 1 << 30;
pub const CONNECT_TIMEOUT_MS: u64 = 10_000;
/// Covers the longest task poll the server allows, plus transfer time.
pub const REQUEST_TIMEOUT_MS: u64 = 120_000;
/// Largest answer to `GET /device/v1/signing-keys`: a full chain of
/// [`model_sig::MAX_KEY_CHAIN_LEN`] endorsements is about 5 KiB.
pub const MAX_SIGNING_KEYS_BYTES: usize = 64 << 10;

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
    },
    #[error("the server sent an unreadable {what}: {reason}")]
    BadResponse { what: &'static str, reason: String },
    #[error("model version {version_id} failed verification: {reason}")]
    ModelVerification { version_id: i64, reason: String },
    /// The operation's [`CancelToken`] fired.
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

/// A connection to one server, trusted one way.
///
/// Clones share one connection pool. Connections belong to the tokio
/// runtime that opened them, so a transport used under one runtime should
/// not be used under another; [`Transport::reconnect`] makes one with a
/// fresh pool (the blocking client does so).
#[derive(Clone, Debug)]
pub struct Transport {
    base: String,
    http: reqwest::Client,
    trust: Trust,
}

impl Transport {
    pub fn new(base_url: &str, trust: &Trust) -> Result<Transport, SdkError> {
        let base = base_url.trim_end_matches('/').to_string();
        if !(base.starts_with("https://") || base.starts_with("http://")) {
            return Err(SdkError::BadUrl(base_url.to_string()));
        }
        let http = reqwest::Client::builder()
            .tls_backend_preconfigured(trust.client_config()?)
            .connect_timeout(Duration::from_millis(CONNECT_TIMEOUT_MS))
            .timeout(Duration::from_millis(REQUEST_TIMEOUT_MS))
            .build()
            .map_err(|source| SdkError::Transport {
                url: base.clone(),
                source,
            })?;
        Ok(Transport {
            base,
            http,
            trust: trust.clone(),
        })
    }

    /// The same server and trust with a new, empty connection pool, e.g.
    /// after the server restarted or to move to another runtime.
    pub fn reconnect(&self) -> Result<Transport, SdkError> {
        Transport::new(&self.base, &self.trust)
    }

    pub fn trust(&self) -> &Trust {
        &self.trust
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    pub fn http(&self) -> &reqwest::Client {
        &self.http
    }
}

/// An error and its causes on one line.
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Most bytes of an error answer the client reads; the server's JSON error
/// bodies are a few hundred.
pub(crate) const MAX_ERROR_BODY_BYTES: usize = 64 << 10;

/// A body read up to a limit.
pub(crate) enum LimitedBody {
    Complete(Vec<u8>),
    /// The body is longer than the limit: announced as `announced_bytes`
    /// by Content-Length, or found so while reading (`None`).
    TooLong {
        announced_bytes: Option<u64>,
    },
}

/// Reads a body of at most `limit_bytes` without ever holding more: an
/// announced length over the limit is refused before reading, and an
/// unannounced one as soon as it passes the limit.
pub(crate) async fn read_limited(
    response: &mut reqwest::Response,
    limit_bytes: usize,
) -> Result<LimitedBody, reqwest::Error> {
    if let Some(length) = response.content_length() {
        if length > limit_bytes as u64 {
            return Ok(LimitedBody::TooLong {
                announced_bytes: Some(length),
            });
        }
    }
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await? {
        if body.len() + chunk.len() > limit_bytes {
            return Ok(LimitedBody::TooLong {
                announced_bytes: None,
            });
        }
        body.extend_from_slice(&chunk);
    }
    Ok(LimitedBody::Complete(body))
}

/// Turns a non-success answer into [`SdkError::Server`].
async fn check(response: reqwest::Response) -> Result<reqwest::Response, SdkError> {
    if response.status().is_success() {
        return Ok(response);
    }
    Err(server_error(response).await)
}

/// [`SdkError::Server`] with the code and message of the answer's JSON
/// error body, or the start of the body when it is not one.
pub(crate) async fn server_error(mut response: reqwest::Response) -> SdkError {
    let status = response.status();
    // A body cut off in transit or over the limit still has a status worth
    // reporting; what was read of it becomes the message.
    let body = match read_limited(&mut response, MAX_ERROR_BODY_BYTES).await {
        Ok(LimitedBody::Complete(body)) => body,
        Ok(LimitedBody::TooLong { .. }) | Err(_) => Vec::new(),
    };
    let (code, message) = match serde_json::from_slice::<ErrorBody>(&body) {
        Ok(error) => (error.error.code, error.error.message),
        Err(_) => (
            "unknown".to_string(),
            String::from_utf8_lossy(&body).chars().take(500).collect(),
        ),
    };
    SdkError::Server {
        status: status.as_u16(),
        code,
        message,
    }
}

/// Reads and parses a JSON answer. A body cut off in transit is a
/// (retryable) transport error; one that does not parse is not.
async fn json<T: serde::de::DeserializeOwned>(
    response: reqwest::Response,
    what: &'static str,
) -> Result<T, SdkError> {
    let url = response.url().to_string();
    let bytes = response
        .bytes()
        .await
        .map_err(|source| SdkError::Transport { url, source })?;
    serde_json::from_slice(&bytes).map_err(|error| SdkError::BadResponse {
        what,
        reason: error.to_string(),
    })
}

/// Enrolls a device key with an enrollment token.
pub async fn enroll(
    transport: &Transport,
    enrollment_token: &str,
    key: &DeviceKey,
    capabilities: Capabilities,
) -> Result<EnrollResponse, SdkError> {
    let url = transport.url("/device/v1/enroll");
    let request = EnrollRequest {
        enrollment_token: enrollment_token.to_string(),
        public_key: key.public_key_hex(),
        capabilities,
    };
    let response = transport
        .http
        .post(&url)
        .json(&request)
        .send()
        .await
        .map_err(|source| SdkError::Transport { url, source })?;
    json(check(response).await?, "enrollment answer").await
}

/// [`enroll`] that retries under `policy`, but only failures that show the
/// server did not act on the request: the connection could not be opened,
/// or the server answered 429 or 503 before doing anything. Enrollment is
/// not idempotent (a second try with the same key answers 409 and its
/// device id is lost), so a request that may have been carried out is
/// never repeated. Every attempt and wait races `cancel`.
pub async fn enroll_with(
    transport: &Transport,
    enrollment_token: &str,
    key: &DeviceKey,
    capabilities: Capabilities,
    policy: &RetryPolicy,
    cancel: &CancelToken,
) -> Result<EnrollResponse, SdkError> {
    let policy = policy.normalized();
    let mut failures = 0;
    loop {
        let attempt = enroll(transport, enrollment_token, key, capabilities.clone());
        let error = match cancel.run(attempt).await {
            None => return Err(SdkError::Cancelled),
            Some(Ok(enrolled)) => return Ok(enrolled),
            Some(Err(error)) => error,
        };
        failures += 1;
        if !error.is_retryable()
            || error.may_have_been_processed()
            || failures >= policy.max_attempts
        {
            return Err(error);
        }
        retry::sleep(cancel, policy.backoff(failures - 1)).await?;
    }
}

/// A verified model file.
#[derive(Clone, Debug)]
pub struct DownloadedModel {
    pub version_id: i64,
    pub digest: String,
    pub bytes: Bytes,
}

/// An enrolled device: signs every request with its key.
///
/// The client holds a [`RetryPolicy`] (none by default: one attempt) and a
/// [`CancelToken`] (never cancelled by default) that `next_task`,
/// `download_model`, `download_model_to`, `upload_update`, `heartbeat`,
/// `report_metrics` and the secure-aggregation calls ([`crate::secure`])
/// observe; see [`crate::retry`] for what is retried.
/// `signed` and `send_signed` are single raw requests and observe neither.
/// Clones share the connection pool, the policy is copied, and the token
/// is shared (cancelling it cancels every clone's work).
///
/// Models are verified under the client's [`TrustedKeys`]. A download
/// signed by a key the device does not trust yet makes the client fetch
/// the server's endorsement chain and follow it (see
/// [`TrustedKeys::advance`]); the trust moves only along a valid chain from
/// the key it held. Clones share the trust. Persist
/// [`DeviceClient::trusted_keys`] after a task and construct with
/// [`DeviceClient::with_trusted_keys`], or a restarted device falls back to
/// its enrollment key.
#[derive(Clone, Debug)]
pub struct DeviceClient {
    pub transport: Transport,
    pub device_id: i64,
    key: DeviceKey,
    trust: Arc<Mutex<TrustedKeys>>,
    retry: RetryPolicy,
    cancel: CancelToken,
}

impl DeviceClient {
    pub fn new(
        transport: Transport,
        device_id: i64,
        key: DeviceKey,
        server_public_key_hex: &str,
    ) -> Result<DeviceClient, SdkError> {
        let server_public_key =
            auth::parse_public_key_hex(server_public_key_hex).map_err(|error| {
                SdkError::BadResponse {
                    what: "server public key",
                    reason: error.to_string(),
                }
            })?;
        Ok(DeviceClient::with_trusted_keys(
            transport,
            device_id,
            key,
            TrustedKeys::new(server_public_key),
        ))
    }

    /// A client that trusts `trusted` for model signatures, e.g. as
    /// persisted from [`DeviceClient::trusted_keys`].
    pub fn with_trusted_keys(
        transport: Transport,
        device_id: i64,
        key: DeviceKey,
        trusted: TrustedKeys,
    ) -> DeviceClient {
        DeviceClient {
            transport,
            device_id,
            key,
            trust: Arc::new(Mutex::new(trusted)),
            retry: RetryPolicy::none(),
            cancel: CancelToken::new(),
        }
    }

    /// The client with this retry policy; e.g. `RetryPolicy::default()`.
    pub fn with_retry_policy(mut self, policy: RetryPolicy) -> DeviceClient {
        self.retry = policy;
        self
    }

    pub fn set_retry_policy(&mut self, policy: RetryPolicy) {
        self.retry = policy;
    }

    pub fn retry_policy(&self) -> &RetryPolicy {
        &self.retry
    }

    /// The client observing `token`: cancelling it (or any clone of it)
    /// makes the operation in progress, and every later one, return
    /// [`SdkError::Cancelled`].
    pub fn with_cancel_token(mut self, token: CancelToken) -> DeviceClient {
        self.cancel = token;
        self
    }

    /// Replaces the token, e.g. with a fresh one after a cancellation.
    pub fn set_cancel_token(&mut self, token: CancelToken) {
        self.cancel = token;
    }

    pub fn cancel_token(&self) -> &CancelToken {
        &self.cancel
    }

    /// The model-signing key the device trusts now: the one given at
    /// construction until a rotation was followed.
    pub fn server_public_key(&self) -> [u8; 32] {
        self.trusted_keys().current()
    }

    /// What the device trusts to sign models; persist it when it changes.
    pub fn trusted_keys(&self) -> TrustedKeys {
        // The lock only guards a `Copy` value, so a poisoned one is whole.
        *self
            .trust
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Moves the trust from `from` to `to`, unless another call moved it
    /// meanwhile (that call followed a valid chain too).
    fn advance_trust(&self, from: TrustedKeys, to: TrustedKeys) {
        let mut trust = self
            .trust
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if *trust == from {
            *trust = to;
        }
    }

    /// The server's current model-signing key and the endorsements that
    /// lead to it.
    pub async fn signing_keys(&self) -> Result<SigningKeys, SdkError> {
        let path = "/device/v1/signing-keys";
        let mut response = check(self.signed(Method::GET, path, Bytes::new()).await?).await?;
        let bad = |reason: String| SdkError::BadResponse {
            what: "signing keys",
            reason,
        };
        let body = match read_limited(&mut response, MAX_SIGNING_KEYS_BYTES).await {
            Ok(LimitedBody::Complete(body)) => body,
            Ok(LimitedBody::TooLong { .. }) => {
                return Err(bad(format!(
                    "the answer is over the {MAX_SIGNING_KEYS_BYTES}-byte limit"
                )));
            }
            Err(source) => {
                return Err(SdkError::Transport {
                    url: self.transport.url(path),
                    source,
                });
            }
        };
        serde_json::from_slice(&body).map_err(|error| bad(error.to_string()))
    }

    /// Checks a download's signature under the trusted keys. A signer the
    /// device does not trust yet is looked up in the server's endorsement
    /// chain; the trust moves to it only if the chain leads there from the
    /// trusted key and the signature then verifies.
    async fn verify_model_signature(
        &self,
        version_id: i64,
        signer_hex: Option<&str>,
        digest: &str,
        signature: &str,
    ) -> Result<(), SdkError> {
        let fail = |error: KeyTrustError| SdkError::ModelVerification {
            version_id,
            reason: error_chain(&error),
        };
        let trust = self.trusted_keys();
        let signer = match signer_hex {
            Some(hex) => model_sig::parse_key_hex(hex).map_err(fail)?,
            // A server from before key rotation names no signer: it signs
            // with the key the device enrolled under.
            None => trust.current(),
        };
        let now = now_ms();
        match trust.verify_model(&signer, digest, signature, now) {
            Err(KeyTrustError::UnknownSigner { .. }) => {}
            verified => return verified.map_err(fail),
        }
        let chain = self.signing_keys().await?;
        let advanced = trust.advance(&signer, &chain.endorsements).map_err(fail)?;
        advanced
            .verify_model(&signer, digest, signature, now)
            .map_err(fail)?;
        self.advance_trust(trust, advanced);
        Ok(())
    }

    /// Swaps the connection, e.g. after the server restarted.
    pub fn set_transport(&mut self, transport: Transport) {
        self.transport = transport;
    }

    pub fn key(&self) -> &DeviceKey {
        &self.key
    }

    /// Sends a signed request. `path` includes any query string.
    pub async fn signed(
        &self,
        method: Method,
        path: &str,
        body: Bytes,
    ) -> Result<reqwest::Response, SdkError> {
        let signed = auth::sign_request(
            &self.key,
            self.device_id,
            method.as_str(),
            path,
            &body,
            now_ms(),
        );
        self.send_signed(method, path, body, &signed).await
    }

    /// Sends a request with the given signature headers, unchecked.
    pub async fn send_signed(
        &self,
        method: Method,
        path: &str,
        body: Bytes,
        signed: &auth::SignedRequest,
    ) -> Result<reqwest::Response, SdkError> {
        let url = self.transport.url(path);
        let mut request = self.transport.http.request(method, &url);
        for (name, value) in signed.headers() {
            request = request.header(name, value);
        }
        if !body.is_empty() {
            request = request.header(reqwest::header::CONTENT_TYPE, "application/octet-stream");
        }
        request
            .body(body)
            .send()
            .await
            .map_err(|source| SdkError::Transport { url, source })
    }

    async fn signed_json<T: serde::Serialize>(
        &self,
        path: &str,
        value: &T,
    ) -> Result<reqwest::Response, SdkError> {
        let body = serde_json::to_vec(value).map_err(|error| SdkError::BadResponse {
            what: "request",
            reason: error.to_string(),
        })?;
        check(self.signed(Method::POST, path, Bytes::from(body)).await?).await
    }

    pub async fn heartbeat(&self, beat: &Heartbeat) -> Result<HeartbeatResponse, SdkError> {
        retry::retrying(&self.retry, &self.cancel, || async {
            json(
                self.signed_json("/device/v1/heartbeat", beat).await?,
                "heartbeat answer",
            )
            .await
        })
        .await
    }

    /// Waits up to `wait_ms` for a task; `None` when there is none.
    /// Repeating a poll is safe: the server hands a device its task again
    /// until the device uploads.
    pub async fn next_task(&self, wait_ms: u64) -> Result<Option<Task>, SdkError> {
        let path = format!("/device/v1/tasks/next?wait_ms={wait_ms}");
        retry::retrying(&self.retry, &self.cancel, || async {
            let response = check(self.signed(Method::GET, &path, Bytes::new()).await?).await?;
            if response.status() == StatusCode::NO_CONTENT {
                return Ok(None);
            }
            json(response, "task").await.map(Some)
        })
        .await
    }

    /// Downloads a task's model and checks, in order: the size limit, that
    /// the server's signature covers the digest the task named, and that
    /// the file's content matches that digest.
    ///
    /// A transfer that breaks resumes with `Range: bytes=N-` under the
    /// client's retry policy (see [`crate::retry`]); the server must answer
    /// 206 with a `Content-Range` that starts at N and ends at the size it
    /// announced, and carry the same digest. The whole file is verified at
    /// the end as if it had come in one piece.
    pub async fn download_model(&self, task: &Task) -> Result<DownloadedModel, SdkError> {
        let mut sink = MemorySink(Vec::new());
        let digest = self.fetch_model(task, &mut sink).await?;
        let bytes = Bytes::from(sink.0);
        verify_content(&bytes, &digest).map_err(|reason| SdkError::ModelVerification {
            version_id: task.model_version_id,
            reason,
        })?;
        Ok(DownloadedModel {
            version_id: task.model_version_id,
            digest,
            bytes,
        })
    }

    /// [`DeviceClient::download_model`] that keeps the bytes received so
    /// far in `<path>.<digest prefix>.part`, so that a download cut off by
    /// a crash, a cancellation or exhausted retries goes on from there the
    /// next time, for the same model. Once complete and verified, the file
    /// is renamed to `path` (replacing it) and also returned in memory. A
    /// partial file whose bytes turn out not to match the signed digest is
    /// deleted, and the download starts over once.
    pub async fn download_model_to(
        &self,
        task: &Task,
        path: &Path,
    ) -> Result<DownloadedModel, SdkError> {
        let part = part_path(path, &task.model_digest);
        let mut started_over = false;
        loop {
            let mut sink = FileSink::open(&part, task.model_size_bytes)?;
            let resumed_from_disk = sink.len > 0;
            let digest = self.fetch_model(task, &mut sink).await?;
            sink.finish()?;
            let bytes = read_file(&part, MAX_MODEL_BYTES)?;
            if let Err(reason) = verify_content(&bytes, &digest) {
                let _ = std::fs::remove_file(&part);
                if resumed_from_disk && !started_over {
                    started_over = true;
                    continue;
                }
                return Err(SdkError::ModelVerification {
                    version_id: task.model_version_id,
                    reason,
                });
            }
            std::fs::rename(&part, path).map_err(local_file("rename the download to", path))?;
            sync_parent(path)?;
            return Ok(DownloadedModel {
                version_id: task.model_version_id,
                digest,
                bytes: Bytes::from(bytes),
            });
        }
    }

    /// Fetches the model into `sink`, resuming after breaks; returns the
    /// digest whose server signature was verified. The content is checked
    /// by the caller.
    async fn fetch_model(&self, task: &Task, sink: &mut dyn Sink) -> Result<String, SdkError> {
        let version_id = task.model_version_id;
        if task.model_size_bytes > MAX_MODEL_BYTES {
            return Err(SdkError::ModelVerification {
                version_id,
                reason: format!(
                    "it is {} bytes, over the {MAX_MODEL_BYTES}-byte limit",
                    task.model_size_bytes
                ),
            });
        }
        let policy = self.retry.normalized();
        let (mut failures, mut requests) = (0u32, 0u32);
        let mut verified = None;
        loop {
            requests += 1;
            let before = sink.len();
            let attempt = self.fetch_attempt(task, sink, &mut verified);
            let error = match self.cancel.run(attempt).await {
                None => return Err(SdkError::Cancelled),
                Some(Ok(())) => {
                    return verified.ok_or_else(|| SdkError::BadResponse {
                        what: "model download",
                        reason: "no response carried the model's digest".to_string(),
                    });
                }
                Some(Err(error)) => error,
            };
            // An attempt that brought new bytes shows that the link works:
            // only attempts in a row without progress use up the policy.
            if sink.len() > before {
                failures = 0;
            }
            failures += 1;
            if !error.is_retryable()
                || failures >= policy.max_attempts
                || requests >= MAX_DOWNLOAD_REQUESTS
            {
                return Err(error);
            }
            retry::sleep(&self.cancel, policy.backoff(failures - 1)).await?;
        }
    }

    /// One request of a download: from `sink.len()` on, to the end.
    async fn fetch_attempt(
        &self,
        task: &Task,
        sink: &mut dyn Sink,
        verified: &mut Option<String>,
    ) -> Result<(), SdkError> {
        let version_id = task.model_version_id;
        let fail = |reason: String| SdkError::ModelVerification { version_id, reason };
        let bad = |reason: String| SdkError::BadResponse {
            what: "model download",
            reason,
        };
        let size = task.model_size_bytes;
        // A complete file on disk still needs the signed headers: fetch its
        // last byte again. Anything longer than the model is not this model.
        if sink.len() > size {
            sink.truncate(0)?;
        } else if size > 0 && sink.len() == size {
            sink.truncate(size - 1)?;
        }
        let offset = sink.len();
        let path = task.model_path.as_str();
        let signed = auth::sign_request(&self.key, self.device_id, "GET", path, &[], now_ms());
        let url = self.transport.url(path);
        let mut request = self.transport.http.get(&url);
        for (name, value) in signed.headers() {
            request = request.header(name, value);
        }
        if offset > 0 {
            request = request.header(reqwest::header::RANGE, format!("bytes={offset}-"));
        }
        let response = request.send().await.map_err(|source| SdkError::Transport {
            url: url.clone(),
            source,
        })?;
        let mut response = check(response).await?;
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .and_then(|value| value.to_str().ok())
                .map(str::to_string)
        };
        let digest = header(HEADER_MODEL_DIGEST).ok_or_else(|| {
            fail(format!(
                "the response has no `{HEADER_MODEL_DIGEST}` header"
            ))
        })?;
        match verified.as_deref() {
            Some(known) if known == digest => {}
            Some(known) => {
                return Err(fail(format!(
                    "the server sent digest {digest} after {known} for the same download"
                )));
            }
            None => {
                let signature = header(HEADER_MODEL_SIGNATURE).ok_or_else(|| {
                    fail(format!(
                        "the response has no `{HEADER_MODEL_SIGNATURE}` header"
                    ))
                })?;
                if digest != task.model_digest {
                    return Err(fail(format!(
                        "the server sent digest {digest}, the task named {}",
                        task.model_digest
                    )));
                }
                let signer = header(HEADER_MODEL_KEY);
                self.verify_model_signature(version_id, signer.as_deref(), &digest, &signature)
                    .await?;
                *verified = Some(digest);
            }
        }
        let total = match response.status() {
            StatusCode::PARTIAL_CONTENT if offset > 0 => {
                let range = header(reqwest::header::CONTENT_RANGE.as_str())
                    .ok_or_else(|| bad("a 206 answer has no Content-Range header".to_string()))?;
                let (start, end, total) = parse_content_range(&range)
                    .ok_or_else(|| bad(format!("Content-Range `{range}` is malformed")))?;
                if start != offset || end.checked_add(1) != Some(total) {
                    return Err(bad(format!(
                        "asked for bytes {offset}- and got Content-Range `{range}`"
                    )));
                }
                if let Some(length) = response.content_length() {
                    if length != total - offset {
                        return Err(bad(format!(
                            "Content-Length {length} does not match Content-Range `{range}`"
                        )));
                    }
                }
                total
            }
            StatusCode::PARTIAL_CONTENT => {
                return Err(bad(
                    "a 206 answer to a request for the whole file".to_string()
                ));
            }
            StatusCode::OK => {
                // The server ignored the range: take the whole file again.
                if offset > 0 {
                    sink.truncate(0)?;
                }
                response.content_length().unwrap_or(size)
            }
            status => return Err(bad(format!("unexpected status {status}"))),
        };
        if total > MAX_MODEL_BYTES {
            return Err(fail(format!(
                "it is {total} bytes, over the {MAX_MODEL_BYTES}-byte limit"
            )));
        }
        if size > 0 && total != size {
            return Err(fail(format!(
                "the server sends {total} bytes, the task announced {size}"
            )));
        }
        sink.reserve(total);
        while let Some(chunk) = response
            .chunk()
            .await
            .map_err(|source| SdkError::Transport {
                url: url.clone(),
                source,
            })?
        {
            if sink.len() + chunk.len() as u64 > total {
                return Err(fail(format!(
                    "the server sent more than the {total} bytes it announced"
                )));
            }
            sink.append(&chunk)?;
        }
        if sink.len() < total {
            return Err(SdkError::Incomplete {
                url,
                received: sink.len(),
                expected: total,
            });
        }
        Ok(())
    }

    /// Uploads an update, retrying under the client's policy.
    ///
    /// When a retry is answered 409 and an earlier attempt of this call may
    /// have reached the server (see [`crate::retry`]), the earlier attempt
    /// was folded in, and this returns a receipt built locally:
    /// `accepted: true`, the task's round, `num_samples` from the update's
    /// header and `bytes` its length. A 409 on the first attempt is an
    /// error: the device had uploaded before this call. After
    /// [`SdkError::Cancelled`] or another error the update may or may not
    /// have been accepted; a later upload answering 409 says it was.
    pub async fn upload_update(
        &self,
        task: &Task,
        encoded: Bytes,
    ) -> Result<UploadReceipt, SdkError> {
        let policy = self.retry.normalized();
        let mut failures = 0u32;
        let mut maybe_delivered = false;
        loop {
            let attempt = async {
                let response = check(
                    self.signed(Method::PUT, &task.upload_path, encoded.clone())
                        .await?,
                )
                .await?;
                json::<UploadReceipt>(response, "upload receipt").await
            };
            let error = match self.cancel.run(attempt).await {
                None => return Err(SdkError::Cancelled),
                Some(Ok(receipt)) => return Ok(receipt),
                Some(Err(error)) => error,
            };
            if maybe_delivered && error.status() == Some(409) {
                return Ok(UploadReceipt {
                    round_id: task.round_id,
                    accepted: true,
                    num_samples: encoded_samples(&encoded),
                    bytes: encoded.len() as u64,
                });
            }
            failures += 1;
            maybe_delivered |= error.may_have_been_processed();
            if !error.is_retryable() || failures >= policy.max_attempts {
                return Err(error);
            }
            retry::sleep(&self.cancel, policy.backoff(failures - 1)).await?;
        }
    }

    pub async fn report_metrics(&self, metrics: &RoundMetrics) -> Result<(), SdkError> {
        let path = format!("/device/v1/rounds/{}/metrics", metrics.round_id);
        retry::retrying(&self.retry, &self.cancel, || async {
            self.signed_json(&path, metrics).await?;
            Ok(())
        })
        .await
    }

    /// Gives up a task this device cannot do, with a reason the server
    /// logs; the server stops handing it out and counts a dropout at once.
    pub async fn decline_task(&self, task: &Task, reason: &str) -> Result<(), SdkError> {
        let decline = canopy_protocol::messages::DeclineTask {
            round_id: task.round_id,
            reason: reason
                .chars()
                .take(canopy_protocol::messages::MAX_DECLINE_REASON_CHARS)
                .collect(),
        };
        let path = format!("/device/v1/rounds/{}/decline", task.round_id);
        retry::retrying(&self.retry, &self.cancel, || async {
            self.signed_json(&path, &decline).await?;
            Ok(())
        })
        .await
    }
}

/// `num_samples` from an encoded update's header (bytes 12..20, little
/// endian; see `canopy_protocol::update`); 0 if it is too short.
fn encoded_samples(encoded: &[u8]) -> u64 {
    encoded
        .get(12..20)
        .and_then(|bytes| bytes.try_into().ok())
        .map(u64::from_le_bytes)
        .unwrap_or(0)
}

/// Parses `bytes START-END/TOTAL`.
fn parse_content_range(value: &str) -> Option<(u64, u64, u64)> {
    let rest = value.trim().strip_prefix("bytes ")?;
    let (range, total) = rest.split_once('/')?;
    let (start, end) = range.split_once('-')?;
    let number = |text: &str| {
        let text = text.trim();
        if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        text.parse::<u64>().ok()
    };
    let (start, end, total) = (number(start)?, number(end)?, number(total)?);
    (start <= end && end < total).then_some((start, end, total))
}

/// Where downloaded bytes go.
trait Sink: Send {
    fn len(&self) -> u64;
    fn reserve(&mut self, _total: u64) {}
    fn append(&mut self, chunk: &[u8]) -> Result<(), SdkError>;
    fn truncate(&mut self, len: u64) -> Result<(), SdkError>;
}

struct MemorySink(Vec<u8>);

impl Sink for MemorySink {
    fn len(&self) -> u64 {
        self.0.len() as u64
    }

    fn reserve(&mut self, total: u64) {
        // Up to 64 MiB ahead; beyond that the vector grows as bytes come.
        let wanted = usize::try_from(total.min(64 << 20)).unwrap_or(0);
        self.0.reserve(wanted.saturating_sub(self.0.len()));
    }

    fn append(&mut self, chunk: &[u8]) -> Result<(), SdkError> {
        self.0.extend_from_slice(chunk);
        Ok(())
    }

    fn truncate(&mut self, len: u64) -> Result<(), SdkError> {
        self.0.truncate(usize::try_from(len).unwrap_or(usize::MAX));
        Ok(())
    }
}

fn local_file(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> SdkError {
    let path = path.to_path_buf();
    move |source| SdkError::LocalFile {
        action,
        path,
        source,
    }
}

/// `<path>.<first 16 hex digits of the digest>.part`, beside `path`.
fn part_path(path: &Path, digest: &str) -> PathBuf {
    let prefix: String = digest
        .chars()
        .filter(char::is_ascii_hexdigit)
        .take(16)
        .collect();
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".{prefix}.part"));
    path.with_file_name(name)
}

/// A partial download on disk. Writes are plain blocking writes of one
/// network chunk each; they are short next to the network time.
struct FileSink {
    file: File,
    path: PathBuf,
    len: u64,
}

impl FileSink {
    fn open(path: &Path, size: u64) -> Result<FileSink, SdkError> {
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(local_file("open", path))?;
        let mut len = file.metadata().map_err(local_file("inspect", path))?.len();
        if len > size {
            file.set_len(0).map_err(local_file("truncate", path))?;
            len = 0;
        }
        file.seek(SeekFrom::Start(len))
            .map_err(local_file("seek in", path))?;
        Ok(FileSink {
            file,
            path: path.to_path_buf(),
            len,
        })
    }

    fn finish(&mut self) -> Result<(), SdkError> {
        self.file.sync_all().map_err(local_file("sync", &self.path))
    }
}

impl Sink for FileSink {
    fn len(&self) -> u64 {
        self.len
    }

    fn append(&mut self, chunk: &[u8]) -> Result<(), SdkError> {
        self.file
            .write_all(chunk)
            .map_err(local_file("write", &self.path))?;
        self.len += chunk.len() as u64;
        Ok(())
    }

    fn truncate(&mut self, len: u64) -> Result<(), SdkError> {
        self.file
            .set_len(len)
            .map_err(local_file("truncate", &self.path))?;
        self.file
            .seek(SeekFrom::Start(len))
            .map_err(local_file("seek in", &self.path))?;
        self.len = len;
        Ok(())
    }
}

/// Makes a rename in `path`'s directory durable (Unix; elsewhere a no-op).
fn sync_parent(path: &Path) -> Result<(), SdkError> {
    #[cfg(unix)]
    if let Some(parent) = path.parent() {
        let parent = if parent.as_os_str().is_empty() {
            Path::new(".")
        } else {
            parent
        };
        File::open(parent)
            .and_then(|directory| directory.sync_all())
            .map_err(local_file("sync the directory of", path))?;
    }
    #[cfg(not(unix))]
    let _ = path;
    Ok(())
}

/// Reads a whole file of at most `limit` bytes.
fn read_file(path: &Path, limit: u64) -> Result<Vec<u8>, SdkError> {
    let file = File::open(path).map_err(local_file("open", path))?;
    let mut bytes = Vec::new();
    file.take(limit + 1)
        .read_to_end(&mut bytes)
        .map_err(local_file("read", path))?;
    if bytes.len() as u64 > limit {
        return Err(SdkError::LocalFile {
            action: "read",
            path: path.to_path_buf(),
            source: std::io::Error::other(format!("it is over the {limit}-byte limit")),
        });
    }
    Ok(bytes)
}

/// Checks that a model file's stored digest is `digest` and that its
/// content hashes to it (a full read verifies every byte).
fn verify_content(bytes: &[u8], digest: &str) -> Result<(), String> {
    let stored = canopy_ir::format::digest(bytes).map_err(|error| error.to_string())?;
    let stored = canopy_ir::format::digest_hex(&stored);
    if stored != digest {
        return Err(format!(
            "the file's digest is {stored}, the signed one {digest}"
        ));
    }
    canopy_ir::format::read_model(bytes)
        .map(|_| ())
        .map_err(|error| format!("the file does not match its digest or is invalid: {error}"))
}

#[cfg(test)]
#[path = "client_tests.rs"]
pub(crate) mod tests;
