//! The HTTPS connection to one server, and reading its answers: bounded
//! bodies, error answers as [`SdkError::Server`], JSON answers.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use canopy_protocol::messages::ErrorBody;

use crate::error::SdkError;
use crate::trust::Trust;

/// How long opening a connection may take.
pub const CONNECT_TIMEOUT_MS: u64 = 10_000;
/// Covers the longest task poll the server allows, plus transfer time.
pub const REQUEST_TIMEOUT_MS: u64 = 120_000;

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
pub(crate) async fn check(response: reqwest::Response) -> Result<reqwest::Response, SdkError> {
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
pub(crate) async fn json<T: serde::de::DeserializeOwned>(
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
