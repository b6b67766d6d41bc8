//! Errors as values that become JSON responses:
//! `{"error": {"code": "...", "message": "..."}}`, everywhere.
//!
//! The only place where the domain's errors (database, blob store,
//! orchestrator, secure rounds) become HTTP answers. What went wrong inside
//! the server is logged with the request id and never sent: error chains
//! name tables, files and paths, which tell a client about the server and
//! nothing it can act on. The answer says where to look instead.

use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use canopy_protocol::messages::{ErrorBody, ErrorDetail};

use crate::blobs::BlobError;
use crate::db::DbError;
use crate::secure::SecureError;
use canopy_term::error_chain as chain;

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    /// Sent as `Retry-After` (seconds) with 429 and 503 answers.
    pub retry_after_s: Option<u64>,
    /// The cause inside the server: logged with the request id, never sent.
    detail: Option<String>,
}

tokio::task_local! {
    /// The id (`x-request-id`) of the request being answered.
    static REQUEST_ID: String;
}

/// Middleware, inside the layer that sets `x-request-id`: errors answered
/// while the request runs name its id, and so does their log line.
pub async fn with_request_id(request: Request, next: Next) -> Response {
    let id = request
        .headers()
        .get("x-request-id")
        .and_then(|value| value.to_str().ok())
        .map(str::to_string);
    match id {
        Some(id) => REQUEST_ID.scope(id, next.run(request)).await,
        None => next.run(request).await,
    }
}

fn request_id() -> Option<String> {
    REQUEST_ID.try_with(Clone::clone).ok()
}

pub type ApiResult<T> = Result<T, ApiError>;

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            code,
            message: message.into(),
            retry_after_s: None,
            detail: None,
        }
    }

    /// Keeps `detail` for the log; the answer only points to it.
    pub fn logging(mut self, detail: impl Into<String>) -> ApiError {
        self.detail = Some(detail.into());
        self
    }

    /// A client at one of its own caps: it may try again after `retry_after_s`.
    pub fn too_many(message: impl Into<String>, retry_after_s: u64) -> ApiError {
        ApiError::new(StatusCode::TOO_MANY_REQUESTS, "rate_limited", message)
            .retry_after(retry_after_s)
    }

    /// The server is at a shared limit: try again after `retry_after_s`.
    pub fn busy(message: impl Into<String>, retry_after_s: u64) -> ApiError {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "busy", message).retry_after(retry_after_s)
    }

    pub fn retry_after(mut self, seconds: u64) -> ApiError {
        self.retry_after_s = Some(seconds.max(1));
        self
    }

    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "bad_request", message)
    }

    pub fn unauthorized(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", message)
    }

    pub fn forbidden(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::FORBIDDEN, "forbidden", message)
    }

    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, "not_found", message)
    }

    pub fn conflict(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::CONFLICT, "conflict", message)
    }

    pub fn gone(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::GONE, "gone", message)
    }

    pub fn too_large(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large", message)
    }

    pub fn unprocessable(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "unprocessable", message)
    }

    /// A failure inside the server. `detail` goes to the log; the client
    /// is told only that it happened and under which request id.
    pub fn internal(detail: impl Into<String>) -> ApiError {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "internal error",
        )
        .logging(detail)
    }

    pub fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", message)
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} ({}): {}",
            self.status.as_u16(),
            self.code,
            self.message
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let request_id = request_id();
        let shown_id = request_id.as_deref().unwrap_or("-");
        let mut message = self.message;
        if let Some(detail) = &self.detail {
            tracing::error!(
                code = self.code, %message, cause = %detail, request_id = %shown_id,
                "request failed"
            );
            message = match &request_id {
                Some(id) => format!("{message}; see the server log (request id {id})"),
                None => format!("{message}; see the server log"),
            };
        } else if self.status.is_server_error() {
            tracing::error!(code = self.code, %message, request_id = %shown_id, "request failed");
        }
        let body = ErrorBody {
            error: ErrorDetail {
                code: self.code.to_string(),
                message,
            },
        };
        let mut response = (self.status, axum::Json(body)).into_response();
        if let Some(seconds) = self.retry_after_s {
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from(seconds),
            );
        }
        response
    }
}

impl From<crate::request_slots::SlotRefusal> for ApiError {
    fn from(refusal: crate::request_slots::SlotRefusal) -> ApiError {
        use crate::request_slots::SlotRefusal;
        match refusal {
            SlotRefusal::Busy { .. } => ApiError::busy(format!("{refusal}; retry shortly"), 1),
            SlotRefusal::PollsFull { .. } => {
                ApiError::busy(format!("{refusal}; poll again after Retry-After"), 1)
            }
            SlotRefusal::AddressBusy { .. } => {
                ApiError::too_many(format!("{refusal}; wait for their answers, then retry"), 1)
            }
            SlotRefusal::Closed => ApiError::unavailable(refusal.to_string()),
        }
    }
}

impl From<sqlx::Error> for ApiError {
    fn from(error: sqlx::Error) -> ApiError {
        match error {
            sqlx::Error::PoolTimedOut => {
                ApiError::unavailable("the database is busy; retry shortly")
            }
            other => ApiError::internal(format!("database error: {}", chain(&other))),
        }
    }
}

impl From<DbError> for ApiError {
    fn from(error: DbError) -> ApiError {
        ApiError::internal(chain(&error))
    }
}

impl From<BlobError> for ApiError {
    fn from(error: BlobError) -> ApiError {
        ApiError::internal(chain(&error))
    }
}

impl From<SecureError> for ApiError {
    fn from(error: SecureError) -> ApiError {
        match error {
            SecureError::Ended { .. } => ApiError::gone(error.to_string()),
            SecureError::Database(error) => error.into(),
            other => ApiError::internal(chain(&other)),
        }
    }
}

/// Axum's own rejections (bad JSON, bad path or query) in our JSON form.
macro_rules! rejection_into_api_error {
    ($($rejection:ty),* $(,)?) => {$(
        impl From<$rejection> for ApiError {
            fn from(rejection: $rejection) -> ApiError {
                let status = rejection.status();
                let code = if status == StatusCode::PAYLOAD_TOO_LARGE {
                    "payload_too_large"
                } else if status == StatusCode::UNSUPPORTED_MEDIA_TYPE {
                    "unsupported_media_type"
                } else if status == StatusCode::UNPROCESSABLE_ENTITY {
                    "unprocessable"
                } else {
                    "bad_request"
                };
                ApiError::new(status, code, rejection.body_text())
            }
        }
    )*};
}

rejection_into_api_error!(
    axum::extract::rejection::JsonRejection,
    axum::extract::rejection::PathRejection,
    axum::extract::rejection::QueryRejection,
    axum::extract::rejection::BytesRejection,
);

/// `axum::Json` whose rejection is an [`ApiError`].
#[derive(axum::extract::FromRequest)]
#[from_request(via(axum::Json), rejection(ApiError))]
pub struct Json<T>(pub T);

impl<T: serde::Serialize> IntoResponse for Json<T> {
    fn into_response(self) -> Response {
        axum::Json(self.0).into_response()
    }
}

/// `axum::extract::Path` whose rejection is an [`ApiError`].
#[derive(axum::extract::FromRequestParts)]
#[from_request(via(axum::extract::Path), rejection(ApiError))]
pub struct Path<T>(pub T);

/// `axum::extract::Query` whose rejection is an [`ApiError`].
#[derive(axum::extract::FromRequestParts)]
#[from_request(via(axum::extract::Query), rejection(ApiError))]
pub struct Query<T>(pub T);
