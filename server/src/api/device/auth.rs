//! Device authentication: every request after enrollment carries an
//! Ed25519 signature over its method, path, body digest, timestamp and
//! nonce (see `canopy_protocol::auth`). The server checks the clock window,
//! the signature against the key enrolled for the claimed device id, and
//! records the nonce so that a replay within the window is refused.
//!
//! Between the signature and the nonce, the device's request rate
//! (`device_requests_per_second`) and its requests in flight
//! (`max_requests_per_device`) are capped. A device refused there is told
//! to retry after a second, and until then its requests are refused before
//! its key is looked up or its signature checked (by
//! `api::refuse_throttled_devices`, in front of every route): a flood from one device
//! costs the server a header parse per request. (Only the device's own
//! verified requests can throttle it, so nobody can throttle another.) A device past its cap is refused
//! before its nonce is written: a burst from one device then costs the
//! database nothing, and other devices' requests do not queue behind it.
//! (The refused request was not carried out, so its nonce stays unused.)

use axum::body::{Body, HttpBody};
use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{HeaderMap, Method};
use bytes::{Bytes, BytesMut};
use canopy_protocol::auth::{self, SignedRequest};
use futures_util::StreamExt;
use sha2::{Digest, Sha256};
use std::sync::Arc;

use crate::api::admin::models::refuse_declared_over;
use crate::api::error::{ApiError, ApiResult};
use crate::db::now_ms;
use crate::device_keys::DeviceKey;
use crate::inflight::InFlightGuard;
use crate::state::AppState;

/// Bytes reserved up front for a body, whatever its declared length: more
/// arrive as it is read.
const MAX_BODY_PREALLOCATION_BYTES: usize = 64 << 20;

/// SHA-256 of the empty body, which GET requests must declare.
pub const EMPTY_SHA256: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

/// An authenticated device and the body digest its signature covers.
#[derive(Clone, Debug)]
pub struct DeviceAuth {
    pub device_id: i64,
    /// The enrolled key the request was signed with.
    pub public_key: [u8; 32],
    pub content_sha256: String,
    /// This request's place under `max_requests_per_device`, held until the
    /// handler returns.
    _in_flight: Arc<InFlightGuard<i64>>,
}

impl FromRequestParts<AppState> for DeviceAuth {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<DeviceAuth, ApiError> {
        let request = SignedRequest::from_headers(|name| {
            parts
                .headers
                .get(name)
                .and_then(|value| value.to_str().ok())
        })
        .map_err(|error| ApiError::unauthorized(error.to_string()))?;
        let now = u64::try_from(now_ms()).unwrap_or(0);
        auth::check_timestamp(&request, now)
            .map_err(|error| ApiError::unauthorized(error.to_string()))?;
        if parts.method == Method::GET && request.content_sha256 != EMPTY_SHA256 {
            return Err(ApiError::unauthorized(
                "a GET request must declare the SHA-256 of an empty body",
            ));
        }
        let device_id = request.device_id;
        let public_key = match state.device_keys.lookup(&state.db, device_id).await? {
            None => {
                return Err(ApiError::unauthorized(format!(
                    "device {device_id} is not enrolled"
                )));
            }
            Some(DeviceKey::Revoked) => {
                return Err(ApiError::unauthorized(format!(
                    "device {device_id} was revoked; enroll again with a new token"
                )));
            }
            Some(DeviceKey::Malformed) => {
                return Err(ApiError::internal(format!(
                    "device {device_id} has a malformed stored key"
                )));
            }
            Some(DeviceKey::Active(key)) => key,
        };
        let path = parts
            .uri
            .path_and_query()
            .map(|p| p.as_str())
            .unwrap_or_else(|| parts.uri.path());
        auth::verify_signature(&public_key, &request, parts.method.as_str(), path).map_err(
            |error| ApiError::unauthorized(format!("device {}: {error}", request.device_id)),
        )?;
        if state.device_limiter.check_key(&device_id).is_err() {
            state.metrics.refused("device_requests_per_second");
            state.throttled_devices.throttle(device_id, RETRY_AFTER);
            return Err(over_cap(
                device_id,
                &format!(
                    "is over its {} requests per second",
                    state.settings.limits.device_requests_per_second
                ),
            ));
        }
        let Some(in_flight) = state.device_requests.try_enter(device_id) else {
            state.metrics.refused("max_requests_per_device");
            state.throttled_devices.throttle(device_id, RETRY_AFTER);
            return Err(over_cap(
                device_id,
                &format!(
                    "already has {} requests in flight, its limit; wait for their answers",
                    state.device_requests.limit()
                ),
            ));
        };
        // A nonce must outlive every timestamp that could still pass the
        // clock check, so it is kept for twice the allowed skew.
        let expires_ms = now_ms() + 2 * auth::MAX_CLOCK_SKEW_MS as i64;
        if !state
            .nonces
            .record(&state.db, device_id, &request.nonce, expires_ms)
            .await?
        {
            return Err(ApiError::unauthorized(format!(
                "replayed request: device {} already used nonce {}",
                device_id, request.nonce
            )));
        }
        Ok(DeviceAuth {
            device_id,
            public_key,
            content_sha256: request.content_sha256,
            _in_flight: Arc::new(in_flight),
        })
    }
}

/// A body that failed as it arrived: 408 when it stopped arriving and the
/// connection's idle timer (`limits.idle_timeout_ms`) ended it, the stall
/// that `limits.upload_timeout_ms` also answers 408 (with both at their
/// default, the idle timer fires first); 400 when it was cut off.
fn body_failed(what: &str, error: &axum::Error) -> ApiError {
    if timed_out(error) {
        ApiError::new(
            axum::http::StatusCode::REQUEST_TIMEOUT,
            "timeout",
            format!(
                "the {what} stopped arriving: no byte came within limits.idle_timeout_ms, \
                 and the connection was closed"
            ),
        )
    } else {
        ApiError::bad_request(format!("the {what} was cut off: {error}"))
    }
}

/// Whether a timeout of the connection's I/O is among the error's causes,
/// over HTTP/1 (an `io::Error`) or HTTP/2 (`h2` keeps the `io::Error`
/// but names no source).
fn timed_out(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(error);
    while let Some(error) = cause {
        let io = error.downcast_ref::<std::io::Error>().or_else(|| {
            error
                .downcast_ref::<h2::Error>()
                .and_then(h2::Error::get_io)
        });
        if io.is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut) {
            return true;
        }
        cause = error.source();
    }
    false
}

/// How long a device over one of its caps is refused.
const RETRY_AFTER: std::time::Duration = std::time::Duration::from_secs(1);

/// The answer to a device still inside its `Retry-After`.
pub fn throttled(device_id: i64) -> ApiError {
    over_cap(
        device_id,
        "was refused at one of its caps less than a second ago",
    )
}

fn over_cap(device_id: i64, cause: &str) -> ApiError {
    ApiError::too_many(
        format!(
            "device {device_id} {cause}; retry after {} s",
            RETRY_AFTER.as_secs()
        ),
        RETRY_AFTER.as_secs(),
    )
}

impl DeviceAuth {
    /// Reads a body of at most `limit` bytes (`over_limit` is the refusal
    /// past it), hashing each chunk as it arrives, and checks it is the
    /// body the signature covers. For model-sized bodies: hashed while
    /// each chunk is still in cache, rather than after the whole body is
    /// read, secure rounds' masked inputs took 0.7× the server's hashing
    /// time at N = 100 (plain updates were already read this way).
    pub async fn read_body(
        &self,
        body: Body,
        limit: u64,
        what: &str,
        over_limit: impl FnOnce() -> ApiError,
    ) -> ApiResult<Bytes> {
        // Room for the declared length, as far as the limit allows; a
        // body of unknown length grows as it arrives.
        let declared = HttpBody::size_hint(&body).lower().min(limit);
        let capacity = usize::try_from(declared).unwrap_or(usize::MAX);
        let mut buffer = BytesMut::with_capacity(capacity.min(MAX_BODY_PREALLOCATION_BYTES));
        let mut hasher = Sha256::new();
        let mut stream = body.into_data_stream();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|error| body_failed(what, &error))?;
            if (buffer.len() + chunk.len()) as u64 > limit {
                return Err(over_limit());
            }
            hasher.update(&chunk);
            buffer.extend_from_slice(&chunk);
        }
        self.check_digest(&hex::encode(hasher.finalize()))?;
        Ok(buffer.freeze())
    }

    /// [`DeviceAuth::read_body`] for a message with a byte limit of its
    /// own: refused from its declared length before any of it is read,
    /// and as `what` over the limit past it.
    pub async fn read_message(
        &self,
        headers: &HeaderMap,
        body: Body,
        limit: u64,
        what: &str,
    ) -> ApiResult<Bytes> {
        refuse_declared_over(headers, limit, what)?;
        let over_limit = || ApiError::too_large(format!("{what} is over the {limit}-byte limit"));
        self.read_body(body, limit, what, over_limit).await
    }

    fn check_digest(&self, actual: &str) -> Result<(), ApiError> {
        if actual != self.content_sha256 {
            return Err(ApiError::unauthorized(format!(
                "the body's SHA-256 is {actual}, but the signed header says {}",
                self.content_sha256
            )));
        }
        Ok(())
    }
}
