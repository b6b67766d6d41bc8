//! Device authentication: every request after enrollment carries an
//! Ed25519 signature over its method, path, body digest, timestamp and
//! nonce (see `canopy_protocol::auth`). The server checks the clock window,
//! the signature against the key enrolled for the claimed device id, and
//! records the nonce so that a replay within the window is refused.

use axum::extract::FromRequestParts;
use axum::http::Method;
use axum::http::request::Parts;
use canopy_protocol::auth::{self, SignedRequest};

use crate::db::now_ms;
use crate::error::ApiError;
use crate::state::AppState;
use crate::store::devices;

/// SHA-256 of the empty body, which GET requests must declare.
pub const EMPTY_SHA256: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

/// An authenticated device and the body digest its signature covers.
#[derive(Clone, Debug)]
pub struct DeviceAuth {
    pub device_id: i64,
    pub content_sha256: String,
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
        let device = devices::get(&state.db, request.device_id)
            .await?
            .ok_or_else(|| {
                ApiError::unauthorized(format!("device {} is not enrolled", request.device_id))
            })?;
        if device.revoked_ms.is_some() {
            return Err(ApiError::unauthorized(format!(
                "device {} was revoked; enroll again with a new token",
                device.id
            )));
        }
        let public_key: [u8; 32] = device.public_key.as_slice().try_into().map_err(|_| {
            ApiError::internal(format!("device {} has a malformed stored key", device.id))
        })?;
        let path = parts
            .uri
            .path_and_query()
            .map(|p| p.as_str())
            .unwrap_or_else(|| parts.uri.path());
        auth::verify_signature(&public_key, &request, parts.method.as_str(), path).map_err(
            |error| ApiError::unauthorized(format!("device {}: {error}", request.device_id)),
        )?;
        // A nonce must outlive every timestamp that could still pass the
        // clock check, so it is kept for twice the allowed skew.
        let expires_ms = now_ms() + 2 * auth::MAX_CLOCK_SKEW_MS as i64;
        if !devices::use_nonce(&state.db, device.id, &request.nonce, expires_ms).await? {
            return Err(ApiError::unauthorized(format!(
                "replayed request: device {} already used nonce {}",
                device.id, request.nonce
            )));
        }
        Ok(DeviceAuth {
            device_id: device.id,
            content_sha256: request.content_sha256,
        })
    }
}

impl DeviceAuth {
    /// Checks that a body read in full is the one the signature covers.
    pub fn check_body(&self, body: &[u8]) -> Result<(), ApiError> {
        let actual = auth::sha256_hex(body);
        if actual != self.content_sha256 {
            return Err(ApiError::unauthorized(format!(
                "the body's SHA-256 is {actual}, but the signed header says {}",
                self.content_sha256
            )));
        }
        Ok(())
    }
}
