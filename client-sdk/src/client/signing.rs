//! Request signing. Every device request carries an Ed25519 signature over
//! its method, path and query, the device id, the time, a fresh nonce and
//! the body's hash (`canopy_protocol::auth`). One builder,
//! [`DeviceClient::signed_request`], makes every signed request, so plain
//! calls and a download's ranged requests are signed the same way.

use bytes::Bytes;
use canopy_protocol::auth;
use reqwest::Method;

use super::DeviceClient;
use crate::error::SdkError;
use crate::transport::{check, now_ms};

/// A signed request, not sent yet; headers that are not signed (such as
/// `Range`) may still be added.
pub(super) struct SignedCall {
    url: String,
    request: reqwest::RequestBuilder,
}

impl SignedCall {
    pub(super) fn url(&self) -> &str {
        &self.url
    }

    pub(super) fn header(mut self, name: reqwest::header::HeaderName, value: String) -> SignedCall {
        self.request = self.request.header(name, value);
        self
    }

    /// Sends it; a failure to connect or to hear an answer is
    /// [`SdkError::Transport`]. The answer's status is not checked.
    pub(super) async fn send(self) -> Result<reqwest::Response, SdkError> {
        let SignedCall { url, request } = self;
        request
            .send()
            .await
            .map_err(|source| SdkError::Transport { url, source })
    }
}

impl DeviceClient {
    /// A request for `path` (query string included) carrying `body`,
    /// signed now with a fresh nonce. Each attempt of a retried call signs
    /// anew, so the server's replay check never refuses a retry.
    pub(super) fn signed_request(&self, method: Method, path: &str, body: Bytes) -> SignedCall {
        let signed = auth::sign_request(
            &self.key,
            self.device_id,
            method.as_str(),
            path,
            &body,
            now_ms(),
        );
        self.request_with(method, path, body, &signed)
    }

    /// The request with the given signature headers.
    fn request_with(
        &self,
        method: Method,
        path: &str,
        body: Bytes,
        signed: &auth::SignedRequest,
    ) -> SignedCall {
        let url = self.transport.url(path);
        let mut request = self.transport.http().request(method, &url);
        for (name, value) in signed.headers() {
            request = request.header(name, value);
        }
        if !body.is_empty() {
            request = request.header(reqwest::header::CONTENT_TYPE, "application/octet-stream");
        }
        SignedCall {
            url,
            request: request.body(body),
        }
    }

    /// Sends a signed request. `path` includes any query string.
    pub async fn signed(
        &self,
        method: Method,
        path: &str,
        body: Bytes,
    ) -> Result<reqwest::Response, SdkError> {
        self.signed_request(method, path, body).send().await
    }

    /// Sends a request with the given signature headers, unchecked.
    pub async fn send_signed(
        &self,
        method: Method,
        path: &str,
        body: Bytes,
        signed: &auth::SignedRequest,
    ) -> Result<reqwest::Response, SdkError> {
        self.request_with(method, path, body, signed).send().await
    }

    /// POSTs `value` as JSON, signed; a non-success answer is an error.
    /// `what` names the body if it cannot be serialised.
    pub(super) async fn signed_json<T: serde::Serialize>(
        &self,
        path: &str,
        what: &'static str,
        value: &T,
    ) -> Result<reqwest::Response, SdkError> {
        let body = serde_json::to_vec(value).map_err(|source| SdkError::Encode { what, source })?;
        check(self.signed(Method::POST, path, Bytes::from(body)).await?).await
    }
}
