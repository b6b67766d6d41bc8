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

/// Why a request to a server that is plainly there got no answer: the
/// failures whose fix is not "check that the server is running", told
/// apart from a request error's causes by [`ConnectProblem::of`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConnectProblem {
    /// `http://` against a server that speaks HTTPS: its TLS alert is no
    /// HTTP status line (hyper: "invalid HTTP version parsed").
    SpeaksHttps,
    /// `https://` against a server that speaks plain HTTP.
    SpeaksPlainHttp,
    /// No trusted CA issued the certificate (a self-signed server met
    /// with the public roots: rustls' `UnknownIssuer`).
    UntrustedCertificate,
    /// The certificate is not the one pinned by its SHA-256.
    PinMismatch,
    /// The certificate names other hosts than the URL's.
    WrongName,
    /// The certificate has expired or is not valid yet.
    OutsideValidity,
}

impl ConnectProblem {
    /// The problem `error` (a request's error, or any error that wraps
    /// one) shows, for the request to `url`; `None` when its causes name
    /// none of them.
    pub fn of(error: &(dyn std::error::Error + 'static), url: &str) -> Option<ConnectProblem> {
        let mut cause = Some(error);
        while let Some(current) = cause {
            if let Some(problem) = tls_problem(current) {
                return Some(problem);
            }
            // hyper's parse errors are not public by kind; its message is
            // the one trace of a TLS answer read as HTTP.
            if url.starts_with("http://") && current.to_string().contains(HYPER_BAD_VERSION) {
                return Some(ConnectProblem::SpeaksHttps);
            }
            cause = current.source();
        }
        None
    }

    /// What to do about it, naming the flags `canopy login` and
    /// `canopy-agent enroll` share (`--fingerprint`, `--ca-cert`).
    pub fn hint(self, url: &str) -> String {
        match self {
            ConnectProblem::SpeaksHttps => format!(
                "this server speaks HTTPS: use {}",
                with_scheme(url, "https://")
            ),
            ConnectProblem::SpeaksPlainHttp => format!(
                "this server speaks plain HTTP, not HTTPS: use {} (a server serves plain HTTP \
                 on a loopback address, or with --insecure-http)",
                with_scheme(url, "http://")
            ),
            ConnectProblem::UntrustedCertificate => "the server's certificate is not trusted: \
                 pin it with --fingerprint sha256:… (the `tls fingerprint:` line \
                 `canopy-server serve` prints) or trust its CA with --ca-cert FILE"
                .to_string(),
            ConnectProblem::PinMismatch => "the server's certificate is not the pinned one; if \
                 it was replaced, pin the new one with --fingerprint (the `tls fingerprint:` line \
                 `canopy-server serve` prints)"
                .to_string(),
            ConnectProblem::WrongName => "the server's certificate is for other names than the \
                 URL's host: use a name it lists, or pin the certificate with --fingerprint"
                .to_string(),
            ConnectProblem::OutsideValidity => "the server's certificate is outside its validity \
                 dates: check this machine's clock, or renew the certificate"
                .to_string(),
        }
    }
}

impl std::fmt::Display for ConnectProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ConnectProblem::SpeaksHttps => "it speaks HTTPS, not plain HTTP",
            ConnectProblem::SpeaksPlainHttp => "it speaks plain HTTP, not HTTPS",
            ConnectProblem::UntrustedCertificate => "its certificate is not trusted",
            ConnectProblem::PinMismatch => "its certificate is not the pinned one",
            ConnectProblem::WrongName => "its certificate is not for this host name",
            ConnectProblem::OutsideValidity => "its certificate is outside its validity dates",
        })
    }
}

/// hyper's message for a status line that is not HTTP/1.x.
const HYPER_BAD_VERSION: &str = "invalid HTTP version parsed";

fn with_scheme(url: &str, scheme: &str) -> String {
    let rest = url
        .strip_prefix("https://")
        .or_else(|| url.strip_prefix("http://"))
        .unwrap_or(url);
    format!("{scheme}{rest}")
}

/// The rustls error behind `cause`: a rustls error itself, or one inside
/// `io::Error`s (tokio-rustls wraps it in one, a connector may wrap that
/// again, and `io::Error::source` skips the wrapped error). The one walker
/// both [`ConnectProblem::of`] and the retry rule use.
pub(crate) fn tls_error_in<'a>(
    cause: &'a (dyn std::error::Error + 'static),
) -> Option<&'a rustls::Error> {
    let mut current = cause;
    loop {
        if let Some(tls) = current.downcast_ref::<rustls::Error>() {
            return Some(tls);
        }
        current = current.downcast_ref::<std::io::Error>()?.get_ref()?;
    }
}

/// True when a TLS certificate check failed somewhere in `error`'s causes:
/// retrying a pin or CA mismatch only repeats it. Other TLS failures (a
/// corrupted record, an alert) may be transient and stay retryable.
pub(crate) fn is_certificate_failure(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(error);
    while let Some(current) = cause {
        if let Some(tls) = tls_error_in(current) {
            return matches!(
                tls,
                rustls::Error::InvalidCertificate(_)
                    | rustls::Error::General(_)
                    | rustls::Error::NoCertificatesPresented
                    | rustls::Error::UnsupportedNameType
            ) || classify_tls(tls) == Some(ConnectProblem::PinMismatch);
        }
        cause = current.source();
    }
    false
}

fn tls_problem(cause: &(dyn std::error::Error + 'static)) -> Option<ConnectProblem> {
    classify_tls(tls_error_in(cause)?)
}

fn classify_tls(tls: &rustls::Error) -> Option<ConnectProblem> {
    use rustls::CertificateError as Cert;
    match tls {
        rustls::Error::InvalidMessage(_) => Some(ConnectProblem::SpeaksPlainHttp),
        rustls::Error::InvalidCertificate(
            Cert::UnknownIssuer | Cert::BadSignature | Cert::BadEncoding,
        ) => Some(ConnectProblem::UntrustedCertificate),
        rustls::Error::InvalidCertificate(
            Cert::NotValidForName | Cert::NotValidForNameContext { .. },
        ) => Some(ConnectProblem::WrongName),
        rustls::Error::InvalidCertificate(
            Cert::Expired
            | Cert::ExpiredContext { .. }
            | Cert::NotValidYet
            | Cert::NotValidYetContext { .. },
        ) => Some(ConnectProblem::OutsideValidity),
        rustls::Error::Other(rustls::OtherError(inner))
            if inner.downcast_ref::<crate::trust::PinMismatch>().is_some() =>
        {
            Some(ConnectProblem::PinMismatch)
        }
        _ => None,
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
    let retry_after_ms = retry_after_ms(response.headers());
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
        retry_after_ms,
    }
}

/// `Retry-After` as delta-seconds, in milliseconds. The server sends only
/// that form; an HTTP date or garbage reads as absent, and a huge value is
/// bounded later by the policy's `max_backoff_ms`.
fn retry_after_ms(headers: &reqwest::header::HeaderMap) -> Option<u64> {
    let seconds: u64 = headers
        .get(reqwest::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()?;
    Some(seconds.saturating_mul(1_000))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("error sending request")]
    struct Request(#[source] std::io::Error);

    fn wrapped(tls: rustls::Error) -> Request {
        Request(std::io::Error::new(std::io::ErrorKind::InvalidData, tls))
    }

    #[test]
    fn tls_failures_are_found_inside_io_errors() {
        let url = "https://127.0.0.1:8443";
        let unknown = wrapped(rustls::CertificateError::UnknownIssuer.into());
        assert_eq!(
            ConnectProblem::of(&unknown, url),
            Some(ConnectProblem::UntrustedCertificate)
        );
        let mismatch = wrapped(rustls::Error::Other(rustls::OtherError(
            std::sync::Arc::new(crate::trust::PinMismatch {
                actual: [1; 32],
                pinned: [2; 32],
            }),
        )));
        assert_eq!(
            ConnectProblem::of(&mismatch, url),
            Some(ConnectProblem::PinMismatch)
        );
        #[derive(Debug, thiserror::Error)]
        #[error("client error (Connect)")]
        struct Connect(#[source] Box<dyn std::error::Error + Send + Sync>);
        let boxed = Connect(Box::new(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            rustls::Error::from(rustls::CertificateError::UnknownIssuer),
        )));
        assert_eq!(
            ConnectProblem::of(&boxed, url),
            Some(ConnectProblem::UntrustedCertificate)
        );
        let refused = Request(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert_eq!(ConnectProblem::of(&refused, url), None);
    }

    #[test]
    fn the_hint_gives_the_url_with_the_right_scheme() {
        let hint = ConnectProblem::SpeaksHttps.hint("http://127.0.0.1:8443");
        assert_eq!(hint, "this server speaks HTTPS: use https://127.0.0.1:8443");
    }
}
