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

use crate::conn::ClientAddress;
use crate::db::now_ms;
use crate::metrics::{PoolLabels, RequestLabels};
use crate::request_slots::{CredentialRoute, Pool, RequestKind, SlotRefusal};
use crate::slots::{SlotError, UploadOwner, UploadSlot, UploadSlots};
use crate::state::AppState;
use crate::store::{devices, jobs};
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
    // Metrics tell an outsider the fleet's size and activity: any token
    // that can read the admin API may scrape them (`required_role`).
    let metrics_route =
        Router::new()
            .route("/metrics", get(metrics))
            .route_layer(middleware::from_fn_with_state(
                state.clone(),
                admin::require_role,
            ));
    let public = Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/api/v1/openapi.json", get(docs::openapi_json))
        .route("/api/v1/docs", get(docs::reference_page))
        .route("/api-docs.js", get(docs::reference_js))
        .route("/api-docs.css", get(docs::reference_css))
        .route("/", get(docs::index))
        .route("/dashboard", get(docs::dashboard))
        .route("/dashboard.js", get(docs::dashboard_js))
        .route("/dashboard-charts.js", get(docs::dashboard_charts_js))
        .route("/dashboard-icon.svg", get(docs::dashboard_icon))
        .route("/dashboard.css", get(docs::dashboard_css));
    Router::new()
        .merge(admin)
        .merge(device::router())
        .merge(metrics_route)
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
                // Outside the request slots, so that a client over its rate
                // costs no place and no body read.
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
                    take_request_slots,
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

/// Takes the places a request draws on by its kind (the rule is
/// `request_slots.rs`'s), answers 503 or 429 with `Retry-After` when it
/// gets none, and holds them until the answer. A task poll finds its
/// general place in its extensions ([`crate::request_slots::PollSlot`]), to give it back while
/// it waits; an enrollment's body is read here, in the enrollment pool,
/// before its handler runs (see [`read_enrollment_body`]).
async fn take_request_slots(
    State(state): State<AppState>,
    mut request: Request,
    next: Next,
) -> Response {
    let kind = RequestKind::of(request.method(), request.uri().path());
    let held = match state
        .request_slots
        .take(kind, client_address(&request))
        .await
    {
        Ok(held) => held,
        Err(refusal) => return slot_refused(&state, refusal).into_response(),
    };
    if let Some(poll) = &held.poll {
        request.extensions_mut().insert(poll.clone());
    }
    if kind == RequestKind::Enrollment {
        request = match read_enrollment_body(&state, request).await {
            Ok(request) => request,
            Err(error) => return error.into_response(),
        };
    }
    let response = next.run(request).await;
    drop(held);
    response
}

/// A refused request place, counted under the setting of the pool that
/// refused it, as its answer.
pub(crate) fn slot_refused(state: &AppState, refusal: SlotRefusal) -> ApiError {
    if let Some(pool) = refusal.pool() {
        state.metrics.refused(pool.setting());
    }
    ApiError::from(refusal)
}

/// The client a request came from, as per-address caps count it.
fn client_address(request: &Request) -> ClientAddress {
    let ip = request
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|info| info.0.ip())
        .unwrap_or(std::net::IpAddr::from([0, 0, 0, 0]));
    ClientAddress::from(ip)
}

/// How long an enrollment body may take before the minimum rate applies.
const BODY_RATE_GRACE: Duration = Duration::from_secs(1);

/// Reads an enrollment's body into memory: at most `max_json_bytes`,
/// within `enrollment_body_timeout_ms`, and after the first second at
/// `min_enrollment_body_bytes_per_second` at least (each byte received
/// buys the next its share of a second). A client with no credentials
/// then holds an enrollment place for seconds, never for the whole
/// `request_timeout_ms`; an honest body arrives with its headers.
async fn read_enrollment_body(state: &AppState, request: Request) -> Result<Request, ApiError> {
    let limits = &state.settings.limits;
    let max_bytes = limits.max_json_bytes;
    if admin::models::content_length(request.headers()).is_some_and(|n| n > max_bytes as u64) {
        return Err(enrollment_too_large(max_bytes));
    }
    let timeout = Duration::from_millis(limits.enrollment_body_timeout_ms);
    let rate = limits.min_enrollment_body_bytes_per_second.max(1) as f64;
    let (parts, body) = request.into_parts();
    let started = tokio::time::Instant::now();
    let mut stream = body.into_data_stream();
    let mut received = bytes::BytesMut::new();
    loop {
        let earned = BODY_RATE_GRACE + Duration::from_secs_f64(received.len() as f64 / rate);
        let deadline = started + earned.min(timeout);
        match tokio::time::timeout_at(deadline, stream.next()).await {
            Ok(None) => break,
            Ok(Some(Ok(chunk))) => {
                if received.len() + chunk.len() > max_bytes {
                    return Err(enrollment_too_large(max_bytes));
                }
                received.extend_from_slice(&chunk);
            }
            Ok(Some(Err(error))) => {
                return Err(ApiError::bad_request(format!(
                    "the enrollment body could not be read: {error}"
                )));
            }
            Err(_) => {
                state.metrics.refused("enrollment_body_timeout_ms");
                return Err(ApiError::new(
                    StatusCode::REQUEST_TIMEOUT,
                    "timeout",
                    format!(
                        "the enrollment body was too slow: {} bytes in {} ms; it must arrive \
                         within {} ms (limits.enrollment_body_timeout_ms) at {} bytes/s at least \
                         after its first second (limits.min_enrollment_body_bytes_per_second); \
                         hint: send the body with the request",
                        received.len(),
                        started.elapsed().as_millis(),
                        limits.enrollment_body_timeout_ms,
                        limits.min_enrollment_body_bytes_per_second
                    ),
                ));
            }
        }
    }
    Ok(Request::from_parts(parts, Body::from(received.freeze())))
}

fn enrollment_too_large(max_bytes: usize) -> ApiError {
    ApiError::too_large(format!(
        "the enrollment body is over {max_bytes} bytes (limits.max_json_bytes)"
    ))
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

/// Credential routes (see [`CredentialRoute`]) rate-limited per route
/// and client address, before anything else is done for them.
async fn rate_limit_sensitive(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    if let Some(route) = CredentialRoute::of(request.method(), request.uri().path()) {
        let address = client_address(&request);
        if let Err(not_until) = state.sensitive_limiter.check_key(&(route, address)) {
            state.metrics.refused("sensitive_requests_per_minute");
            let wait = not_until.wait_time_from(governor::clock::Clock::now(
                &governor::clock::DefaultClock::default(),
            ));
            let seconds = wait.as_secs().max(1);
            return ApiError::too_many(
                format!(
                    "too many {} from {address}, over limits.sensitive_requests_per_minute ({}); \
                     retry in {seconds} s",
                    route.describe(),
                    state.settings.limits.sensitive_requests_per_minute
                ),
                seconds,
            )
            .into_response();
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

/// How long one database ping answers `/readyz` for.
const READINESS_REUSE: Duration = Duration::from_secs(1);

/// Ready when the database answers and the server is not draining.
/// `/readyz` takes no request slot, so it is never refused for load; so
/// that a flood of probes cannot turn into a flood of database pings, one
/// ping at a time answers every probe waiting for it, and for a second
/// after.
async fn readyz(State(state): State<AppState>) -> Result<axum::Json<Health>, ApiError> {
    if state.is_shutting_down() {
        return Err(ApiError::unavailable("the server is shutting down"));
    }
    let mut last = state.readiness.lock().await;
    let answered = match *last {
        Some((at, answered)) if at.elapsed() < READINESS_REUSE => answered,
        _ => {
            let answered = match state.db.ping().await {
                Ok(()) => true,
                Err(error) => {
                    tracing::warn!(error = %chain(&error), "readiness: the database does not answer");
                    false
                }
            };
            *last = Some((Instant::now(), answered));
            answered
        }
    };
    drop(last);
    if !answered {
        return Err(ApiError::unavailable("the database does not answer"));
    }
    Ok(axum::Json(Health { status: "ready" }))
}

async fn metrics(State(state): State<AppState>) -> Response {
    let window = i64::try_from(state.settings.limits.online_window_ms).unwrap_or(i64::MAX);
    if let Ok(online) = devices::count_online(&state.db, now_ms() - window).await {
        state.metrics.online_devices.set(online);
    }
    if let Ok(spent) = jobs::privacy_spent_by_running_jobs(&state.db).await {
        let gauges = &state.metrics.privacy_epsilon;
        gauges.clear();
        for (job_id, epsilon) in spent {
            let labels = crate::metrics::JobLabels {
                job_id: job_id.to_string(),
            };
            gauges.get_or_create(&labels).set(epsilon);
        }
    }
    for pool in Pool::ALL {
        let in_use = i64::try_from(state.request_slots.in_use(pool)).unwrap_or(i64::MAX);
        state
            .metrics
            .request_slots_in_use
            .get_or_create(&PoolLabels { pool: pool.label() })
            .set(in_use);
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

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use governor::{Quota, RateLimiter};

    use super::*;

    fn from(ip: &str) -> Request {
        let mut request = Request::new(Body::empty());
        let peer = SocketAddr::new(ip.parse().expect("an address"), 443);
        request.extensions_mut().insert(ConnectInfo(peer));
        request
    }

    /// The credential rate and the enrollment cap count an IPv6 client by
    /// its /64, as the connection gate does: one host holds a whole /64.
    #[test]
    fn credential_limits_count_an_ipv6_client_by_its_64() {
        let (a, b) = (from("2001:db8:1:2::a"), from("2001:db8:1:2:ffff::b"));
        let other = from("2001:db8:1:3::a");
        assert_eq!(client_address(&a), client_address(&b));
        assert_ne!(client_address(&a), client_address(&other));
        let limiter = RateLimiter::keyed(Quota::per_minute(NonZeroU32::MIN));
        let enrollment = |request: &Request| (CredentialRoute::Enrollment, client_address(request));
        assert!(limiter.check_key(&enrollment(&a)).is_ok());
        assert!(
            limiter.check_key(&enrollment(&b)).is_err(),
            "a second address of the same /64 got a fresh bucket"
        );
        assert!(limiter.check_key(&enrollment(&other)).is_ok());
        let tokens = (CredentialRoute::TokenCreation, client_address(&b));
        assert!(
            limiter.check_key(&tokens).is_ok(),
            "token creation shares enrollment's bucket"
        );
    }
}
