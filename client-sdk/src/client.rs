//! The HTTPS device client.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use canopy_protocol::auth::{self, DeviceKey};
use canopy_protocol::messages::{
    Capabilities, EnrollRequest, EnrollResponse, ErrorBody, Heartbeat, HeartbeatResponse,
    RoundMetrics, Task, UploadReceipt,
};
use canopy_protocol::model_sig::{self, HEADER_MODEL_DIGEST, HEADER_MODEL_SIGNATURE};
use reqwest::{Method, StatusCode};

use crate::trust::{Trust, TrustError};

/// Largest model this client downloads.
pub const MAX_MODEL_BYTES: u64 = 1 << 30;
pub const CONNECT_TIMEOUT_MS: u64 = 10_000;
/// Covers the longest task poll the server allows, plus transfer time.
pub const REQUEST_TIMEOUT_MS: u64 = 120_000;

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
}

impl SdkError {
    /// The HTTP status, for errors the server answered.
    pub fn status(&self) -> Option<u16> {
        match self {
            SdkError::Server { status, .. } => Some(*status),
            _ => None,
        }
    }
}

/// A connection to one server, trusted one way.
#[derive(Clone, Debug)]
pub struct Transport {
    base: String,
    http: reqwest::Client,
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
        Ok(Transport { base, http })
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    pub fn http(&self) -> &reqwest::Client {
        &self.http
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Turns a non-success answer into [`SdkError::Server`].
async fn check(response: reqwest::Response) -> Result<reqwest::Response, SdkError> {
    let status = response.status();
    if status.is_success() {
        return Ok(response);
    }
    let body = response.bytes().await.unwrap_or_default();
    let (code, message) = match serde_json::from_slice::<ErrorBody>(&body) {
        Ok(error) => (error.error.code, error.error.message),
        Err(_) => (
            "unknown".to_string(),
            String::from_utf8_lossy(&body).chars().take(500).collect(),
        ),
    };
    Err(SdkError::Server {
        status: status.as_u16(),
        code,
        message,
    })
}

async fn json<T: serde::de::DeserializeOwned>(
    response: reqwest::Response,
    what: &'static str,
) -> Result<T, SdkError> {
    let bytes = response
        .bytes()
        .await
        .map_err(|error| SdkError::BadResponse {
            what,
            reason: error.to_string(),
        })?;
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

/// A verified model file.
#[derive(Clone, Debug)]
pub struct DownloadedModel {
    pub version_id: i64,
    pub digest: String,
    pub bytes: Bytes,
}

/// An enrolled device: signs every request with its key.
#[derive(Debug)]
pub struct DeviceClient {
    pub transport: Transport,
    pub device_id: i64,
    key: DeviceKey,
    server_public_key: [u8; 32],
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
        Ok(DeviceClient {
            transport,
            device_id,
            key,
            server_public_key,
        })
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
        json(
            self.signed_json("/device/v1/heartbeat", beat).await?,
            "heartbeat answer",
        )
        .await
    }

    /// Waits up to `wait_ms` for a task; `None` when there is none.
    pub async fn next_task(&self, wait_ms: u64) -> Result<Option<Task>, SdkError> {
        let path = format!("/device/v1/tasks/next?wait_ms={wait_ms}");
        let response = check(self.signed(Method::GET, &path, Bytes::new()).await?).await?;
        if response.status() == StatusCode::NO_CONTENT {
            return Ok(None);
        }
        json(response, "task").await.map(Some)
    }

    /// Downloads a task's model and checks, in order: the size limit, that
    /// the server's signature covers the digest the task named, and that
    /// the file's content matches that digest.
    pub async fn download_model(&self, task: &Task) -> Result<DownloadedModel, SdkError> {
        let version_id = task.model_version_id;
        let fail = |reason: String| SdkError::ModelVerification { version_id, reason };
        if task.model_size_bytes > MAX_MODEL_BYTES {
            return Err(fail(format!(
                "it is {} bytes, over the {MAX_MODEL_BYTES}-byte limit",
                task.model_size_bytes
            )));
        }
        let response = check(
            self.signed(Method::GET, &task.model_path, Bytes::new())
                .await?,
        )
        .await?;
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .and_then(|value| value.to_str().ok())
                .map(str::to_string)
                .ok_or_else(|| fail(format!("the response has no `{name}` header")))
        };
        let digest = header(HEADER_MODEL_DIGEST)?;
        let signature = header(HEADER_MODEL_SIGNATURE)?;
        if digest != task.model_digest {
            return Err(fail(format!(
                "the server sent digest {digest}, the task named {}",
                task.model_digest
            )));
        }
        model_sig::verify_model_signature(&self.server_public_key, &digest, &signature)
            .map_err(|error| fail(error.to_string()))?;
        let bytes = response
            .bytes()
            .await
            .map_err(|error| fail(format!("the download was cut off: {error}")))?;
        verify_content(&bytes, &digest).map_err(fail)?;
        Ok(DownloadedModel {
            version_id,
            digest,
            bytes,
        })
    }

    pub async fn upload_update(
        &self,
        task: &Task,
        encoded: Bytes,
    ) -> Result<UploadReceipt, SdkError> {
        let response = check(self.signed(Method::PUT, &task.upload_path, encoded).await?).await?;
        json(response, "upload receipt").await
    }

    pub async fn report_metrics(&self, metrics: &RoundMetrics) -> Result<(), SdkError> {
        let path = format!("/device/v1/rounds/{}/metrics", metrics.round_id);
        self.signed_json(&path, metrics).await?;
        Ok(())
    }
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
