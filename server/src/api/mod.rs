//! The HTTP surface: routes, middleware and the OpenAPI document.

pub mod admin;
pub mod device;
mod docs;
pub mod error;
pub mod pagination;

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, BodyDataStream};
use axum::extract::{ConnectInfo, MatchedPath, Request, State};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use futures_util::StreamExt;
use serde::Serialize;
use tower::ServiceBuilder;
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::compression::CompressionLayer;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::timeout::TimeoutLayer;
use tower_http::trace::TraceLayer;
use utoipa::ToSchema;

use crate::db::now_ms;
use crate::metrics::RequestLabels;
use crate::slots::{SlotError, UploadOwner, UploadSlot, UploadSlots};
use crate::state::AppState;
use crate::store::devices;
use canopy_term::error_chain as chain;
use error::ApiError;

pub use docs::ApiDoc;

/// The error body every route uses.
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorResponse {
    pub error: ErrorInfo,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorInfo {
    /// Stable, machine-readable: `unauthorized`, `not_found`, `conflict`, …
    pub code: String,
    /// For people: names the object and the cause.
    pub message: String,
}

/// The whole application, middleware included.
pub fn app(state: AppState) -> Router {
    let limits = &state.settings.limits;
    let admin = admin::router().route_layer(middleware::from_fn_with_state(
        state.clone(),
        admin::require_role,
    ));
    let public = Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/api/v1/openapi.json", get(docs::openapi_json))
        .route("/api/v1/docs", get(docs::reference_page))
        .route("/", get(docs::index))
        .route("/dashboard", get(docs::dashboard))
        .route("/dashboard.js", get(docs::dashboard_js))
        .route("/dashboard-charts.js", get(docs::dashboard_charts_js))
        .route("/dashboard-icon.svg", get(docs::dashboard_icon))
        .route("/dashboard.css", get(docs::dashboard_css));
    Router::new()
        .merge(admin)
        .merge(device::router())
        .merge(public)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(
            ServiceBuilder::new()
                .layer(middleware::from_fn(drain_unread_body))
                .layer(middleware::from_fn_with_state(
                    state.clone(),
                    refuse_throttled_devices,
                ))
                .layer(CatchPanicLayer::custom(panic_response))
                .layer(SetRequestIdLayer::x_request_id(MakeRequestUuid))
                .layer(TraceLayer::new_for_http().make_span_with(request_span))
                .layer(PropagateRequestIdLayer::x_request_id())
                .layer(middleware::from_fn(error::with_request_id))
                .layer(middleware::from_fn_with_state(
                    state.clone(),
                    record_latency,
                ))
                .layer(middleware::map_response(json_errors))
                .layer(middleware::from_fn_with_state(
                    state.clone(),
                    rate_limit_sensitive,
                ))
                .layer(CompressionLayer::new())
                .layer(TimeoutLayer::with_status_code(
                    StatusCode::REQUEST_TIMEOUT,
                    Duration::from_millis(limits.request_timeout_ms),
                ))
                .layer(middleware::from_fn_with_state(
                    state.clone(),
                    bound_request_head,
                ))
                .layer(middleware::from_fn_with_state(
                    state.clone(),
                    limit_concurrency,
                )),
        )
        .with_state(state)
}

/// Refuses, before any other work, a request claiming a device that is
/// throttled (see `api::device::auth`): the cheapest possible answer to a
/// flood, so that the server's time goes to other devices. Only a device's
/// own verified requests can throttle it, so trusting the claimed id here
/// lets nobody refuse another device's requests.
async fn refuse_throttled_devices(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    let claimed = request
        .headers()
        .get(canopy_protocol::auth::HEADER_DEVICE)
        .and_then(|value| value.to_str().ok())
        .and_then(|text| text.parse::<i64>().ok());
    if let Some(device_id) = claimed
        && state.throttled_devices.is_throttled(&device_id)
    {
        state.metrics.refused("device_requests_per_second");
        return device::auth::throttled(device_id).into_response();
    }
    next.run(request).await
}

/// `max_concurrent_requests` across every route. `Router::layer` wraps
/// each route on its own, so a `ConcurrencyLimitLayer` there was a limit per
/// route (one device's 4,096 polls filled the poll route for everyone); the
/// semaphore lives in the state, so every route draws on the same one. A
/// request waits for a place at most `request_queue_timeout_ms`, then gets
/// 503: a queue without a bound only turns overload into timeouts.
/// `/healthz` is exempt, so that an overloaded server is not also
/// restarted by its liveness probe.
async fn limit_concurrency(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    if request.uri().path() == "/healthz" {
        return next.run(request).await;
    }
    let limits = &state.settings.limits;
    let wait = Duration::from_millis(limits.request_queue_timeout_ms);
    let permit = match tokio::time::timeout(wait, state.request_slots.acquire()).await {
        Ok(Ok(permit)) => permit,
        Ok(Err(_)) => return ApiError::unavailable("the server is shutting down").into_response(),
        Err(_) => {
            state.metrics.refused("max_concurrent_requests");
            return ApiError::busy(
                format!(
                    "the server is serving its limit of {} requests and none finished within {} ms",
                    limits.max_concurrent_requests, limits.request_queue_timeout_ms
                ),
                1,
            )
            .into_response();
        }
    };
    let response = next.run(request).await;
    drop(permit);
    response
}

/// Answers over-long URIs (414) and header sections (431) with the JSON
/// error shape. hyper's parser refuses heads past twice these limits with
/// bare answers of its own (see `conn::configure_http`); everything between
/// reaches this check.
async fn bound_request_head(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    let limits = &state.settings.limits;
    let uri_bytes = request
        .uri()
        .path_and_query()
        .map_or(0, |path_and_query| path_and_query.as_str().len());
    if uri_bytes > limits.max_uri_bytes {
        state.metrics.refused("max_uri_bytes");
        return ApiError::new(
            StatusCode::URI_TOO_LONG,
            "uri_too_long",
            format!(
                "the request URI is {uri_bytes} bytes, over the {}-byte limit",
                limits.max_uri_bytes
            ),
        )
        .into_response();
    }
    let headers = request.headers();
    // As on the wire: `name: value\r\n`.
    let header_bytes: usize = headers
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len() + 4)
        .sum();
    if headers.len() > limits.max_header_count || header_bytes + uri_bytes > limits.max_header_bytes
    {
        state.metrics.refused("max_header_bytes");
        return ApiError::new(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "headers_too_large",
            format!(
                "the request has {} header fields in {header_bytes} bytes; the limits are {} fields \
                 and {} bytes of request line and headers",
                headers.len(),
                limits.max_header_count,
                limits.max_header_bytes
            ),
        )
        .into_response();
    }
    next.run(request).await
}

/// Takes an upload slot (see `slots.rs`) and turns a refusal into its
/// answer: 409 for a device that already has an upload to this round in
/// flight, 503 with `Retry-After` when every slot stayed busy.
pub(crate) async fn upload_slot<'a>(
    state: &AppState,
    slots: &'a UploadSlots,
    owner: Option<UploadOwner>,
) -> Result<UploadSlot<'a>, ApiError> {
    slots.acquire(owner).await.map_err(|error| {
        state.metrics.refused(slots.setting);
        match error {
            SlotError::OwnerBusy { .. } => ApiError::conflict(format!(
                "{error}; wait for its answer instead of sending it again"
            )),
            SlotError::Busy { .. } => ApiError::busy(
                format!("{error} (limits.{}); retry shortly", slots.setting),
                1,
            ),
            SlotError::Closed => ApiError::unavailable(error.to_string()),
        }
    })
}

/// Reads a body within `limits.upload_timeout_ms`, so that a slot is never
/// held by a client that stops sending.
pub(crate) async fn within_upload_timeout<T>(
    state: &AppState,
    what: &str,
    read: impl std::future::Future<Output = Result<T, ApiError>>,
) -> Result<T, ApiError> {
    let timeout_ms = state.settings.limits.upload_timeout_ms;
    tokio::time::timeout(Duration::from_millis(timeout_ms), read)
        .await
        .unwrap_or_else(|_| {
            state.metrics.refused("upload_timeout_ms");
            Err(ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                "timeout",
                format!(
                    "the {what} did not arrive within {timeout_ms} ms (limits.upload_timeout_ms); \
                     its upload slot was given back"
                ),
            ))
        })
}

/// How much of a request body its handler left unread the server still
/// reads and drops, and for how long, so the connection can be reused.
const DRAIN_LIMIT_BYTES: usize = 1 << 20;
const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);

/// An HTTP/1 answer sent before the request body was read in full (a 401
/// from the auth layer, a 415, a 429, a 404, a 413 part-way) leaves the rest
/// of the body on the connection. hyper then closes the connection after the
/// answer unless the rest has already arrived, and it does so without saying
/// so: a client that reuses the connection loses its next request. So the
/// rest is read here (up to [`DRAIN_LIMIT_BYTES`], for [`DRAIN_TIMEOUT`]),
/// and when it cannot be, the answer says `Connection: close`.
async fn drain_unread_body(request: Request, next: Next) -> Response {
    let has_body = request.version() <= axum::http::Version::HTTP_11
        && (request.headers().contains_key(header::TRANSFER_ENCODING)
            || admin::models::content_length(request.headers()).is_some_and(|length| length > 0));
    if !has_body {
        return next.run(request).await;
    }
    // A body declared too large to drain is not waited for at all.
    let too_large_to_drain = admin::models::content_length(request.headers())
        .is_some_and(|length| length > DRAIN_LIMIT_BYTES as u64);
    let (parts, body) = request.into_parts();
    let shared = SharedBody {
        stream: Arc::new(Mutex::new(body.into_data_stream())),
        finished: Arc::new(AtomicBool::new(false)),
    };
    let rest = shared.clone();
    let mut response = next
        .run(Request::from_parts(parts, Body::from_stream(shared)))
        .await;
    if rest.finished.load(Ordering::Relaxed) {
        return response;
    }
    if too_large_to_drain {
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
        return response;
    }
    let drained = tokio::time::timeout(DRAIN_TIMEOUT, async {
        let mut rest = rest;
        let mut read = 0usize;
        while let Some(chunk) = rest.next().await {
            match chunk {
                Ok(chunk) if read + chunk.len() <= DRAIN_LIMIT_BYTES => read += chunk.len(),
                _ => return false,
            }
        }
        true
    })
    .await
    .unwrap_or(false);
    if !drained {
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    response
}

/// A request body that the middleware can go on reading after the handler
/// has dropped its copy; `finished` tells whether it was read to the end.
#[derive(Clone)]
struct SharedBody {
    stream: Arc<Mutex<BodyDataStream>>,
    finished: Arc<AtomicBool>,
}

impl futures_util::Stream for SharedBody {
    type Item = Result<bytes::Bytes, axum::Error>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let mut stream = self.stream.lock().unwrap_or_else(PoisonError::into_inner);
        let polled = stream.poll_next_unpin(cx);
        if let Poll::Ready(None) = polled {
            self.finished.store(true, Ordering::Relaxed);
        }
        polled
    }
}

fn request_span(request: &Request) -> tracing::Span {
    let request_id = request
        .headers()
        .get("x-request-id")
        .and_then(|value| value.to_str().ok())
        .unwrap_or("-");
    tracing::info_span!(
        "request",
        method = %request.method(),
        path = %request.uri().path(),
        request_id = %request_id,
    )
}

fn panic_response(_: Box<dyn std::any::Any + Send + 'static>) -> Response {
    ApiError::internal("the server hit a bug while handling this request; it was logged")
        .into_response()
}

async fn not_found(request: Request) -> ApiError {
    ApiError::not_found(format!(
        "no route for {} {}",
        request.method(),
        request.uri().path()
    ))
}

async fn method_not_allowed(request: Request) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        format!(
            "{} is not allowed on {}",
            request.method(),
            request.uri().path()
        ),
    )
}

/// Turns every error response that is not already JSON (timeouts, the
/// body-limit layer, the concurrency layer) into the JSON error shape.
async fn json_errors(response: Response) -> Response {
    let status = response.status();
    let is_json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|value| value.as_bytes().starts_with(b"application/json"));
    if status.as_u16() < 400 || is_json {
        return response;
    }
    let code = match status {
        StatusCode::REQUEST_TIMEOUT => "timeout",
        StatusCode::PAYLOAD_TOO_LARGE => "payload_too_large",
        StatusCode::TOO_MANY_REQUESTS => "rate_limited",
        StatusCode::METHOD_NOT_ALLOWED => "method_not_allowed",
        s if s.is_server_error() => "internal",
        _ => "bad_request",
    };
    let reason = status.canonical_reason().unwrap_or("error");
    let mut json =
        ApiError::new(status, code, format!("{reason} ({})", status.as_u16())).into_response();
    for name in [
        header::RETRY_AFTER,
        header::HeaderName::from_static("x-request-id"),
    ] {
        if let Some(value) = response.headers().get(&name) {
            json.headers_mut().insert(name, value.clone());
        }
    }
    json
}

async fn record_latency(State(state): State<AppState>, request: Request, next: Next) -> Response {
    let started = Instant::now();
    // Clients choose methods freely; only standard ones become labels, so
    // the label set stays bounded.
    let method = match *request.method() {
        Method::GET
        | Method::POST
        | Method::PUT
        | Method::DELETE
        | Method::PATCH
        | Method::HEAD
        | Method::OPTIONS => request.method().to_string(),
        _ => "OTHER".to_string(),
    };
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map(|path| path.as_str().to_string())
        .unwrap_or_else(|| "unmatched".to_string());
    let response = next.run(request).await;
    state
        .metrics
        .request_seconds
        .get_or_create(&RequestLabels {
            method,
            route,
            status: response.status().as_u16(),
        })
        .observe(started.elapsed().as_secs_f64());
    response
}

/// Routes that mint credentials, rate-limited per client address.
fn is_sensitive(method: &Method, path: &str) -> bool {
    method == Method::POST
        && matches!(
            path,
            "/device/v1/enroll" | "/api/v1/tokens" | "/api/v1/enrollment-tokens"
        )
}

async fn rate_limit_sensitive(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    if is_sensitive(request.method(), request.uri().path()) {
        let ip = request
            .extensions()
            .get::<ConnectInfo<SocketAddr>>()
            .map(|info| info.0.ip())
            .unwrap_or(std::net::IpAddr::from([0, 0, 0, 0]));
        if let Err(not_until) = state.sensitive_limiter.check_key(&ip) {
            let wait = not_until.wait_time_from(governor::clock::Clock::now(
                &governor::clock::DefaultClock::default(),
            ));
            let mut response = ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limited",
                format!(
                    "too many credential requests from {ip}; retry in {} s",
                    wait.as_secs().max(1)
                ),
            )
            .into_response();
            if let Ok(value) = HeaderValue::from_str(&wait.as_secs().max(1).to_string()) {
                response.headers_mut().insert(header::RETRY_AFTER, value);
            }
            return response;
        }
    }
    next.run(request).await
}

#[derive(Serialize)]
struct Health {
    status: &'static str,
}

async fn healthz() -> axum::Json<Health> {
    axum::Json(Health { status: "ok" })
}

/// Ready when the database answers and the server is not draining.
async fn readyz(State(state): State<AppState>) -> Result<axum::Json<Health>, ApiError> {
    if state.is_shutting_down() {
        return Err(ApiError::unavailable("the server is shutting down"));
    }
    state.db.ping().await.map_err(|error| {
        ApiError::unavailable("the database does not answer").logging(chain(&error))
    })?;
    Ok(axum::Json(Health { status: "ready" }))
}

async fn metrics(State(state): State<AppState>) -> Response {
    let window = i64::try_from(state.settings.limits.online_window_ms).unwrap_or(i64::MAX);
    if let Ok(online) = devices::count_online(&state.db, now_ms() - window).await {
        state.metrics.online_devices.set(online);
    }
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.encode(),
    )
        .into_response()
}
