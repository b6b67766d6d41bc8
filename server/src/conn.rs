//! Connection hygiene: what a client can hold before, between and around
//! its requests. Each bound is a `Limits` setting (see `docs/limits.md`).
//!
//! A connection passes, in order:
//! 1. [`ConnectionGate`], at accept: at most `max_connections` open in all
//!    and `max_connections_per_address` from one address (one /64 for IPv6),
//!    else it is closed at once, before any TLS work. The admitted socket is
//!    an [`Admitted`] stream, closed when no byte moves either way for
//!    `idle_timeout_ms`, whatever the protocol state, or when no request
//!    has been open on it for as long ([`RequestActivity`]): HTTP/2 PINGs
//!    and other frames that are not requests move bytes but do not count.
//! 2. The TLS handshake, within `tls_handshake_timeout_ms`.
//! 3. [`FirstByteDeadline`]: the first byte of the first request within
//!    `header_read_timeout_ms`. Until it arrives, hyper is still deciding
//!    between HTTP/1 and HTTP/2 and runs no timer of its own.
//! 4. hyper's own bounds ([`configure_http`]): each HTTP/1 request head
//!    within `header_read_timeout_ms` (this also closes idle keep-alive
//!    connections) and in a read buffer of twice `max_header_bytes`;
//!    HTTP/2 streams and header lists bounded likewise.
//!
//! *Why at the socket and not in the router:* a client that never finishes
//! its headers never becomes a request, so nothing in the router sees it.
//! Unbounded, 2,000 such connections held 789 MB of buffers.

use std::future::Future;
use std::io;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, Response};
use http_body_util::BodyExt;

use axum_server::accept::Accept;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};

use crate::config::Limits;
use crate::db::now_ms;
use crate::inflight::{InFlight, InFlightGuard};
use crate::metrics::Metrics;

/// Refusals are counted in metrics; the log says so at most this often, so
/// a flood cannot turn into a flood of log lines.
const REFUSAL_LOG_INTERVAL_MS: i64 = 10_000;

/// Sets hyper's per-connection bounds from the limits.
pub fn configure_http(builder: &mut Builder<TokioExecutor>, limits: &Limits) {
    let head_buffer_bytes = 2 * limits.max_header_bytes;
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_millis(limits.header_read_timeout_ms))
        .max_buf_size(head_buffer_bytes)
        // Twice the answered limit, so that requests between the two get
        // the JSON 431 from `api::bound_request_head`.
        .max_headers(2 * limits.max_header_count);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(limits.http2_max_concurrent_streams)
        .max_header_list_size(u32::try_from(head_buffer_bytes).unwrap_or(u32::MAX))
        .max_pending_accept_reset_streams(Some(limits.http2_max_concurrent_streams as usize));
}

/// A client as every per-address cap and rate counts it (connections,
/// enrollments in progress, credential requests): its address, an IPv6
/// client by its /64, since one host is routinely given a whole /64, and an
/// IPv4-mapped IPv6 address as the IPv4 address.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ClientAddress(IpAddr);

impl From<IpAddr> for ClientAddress {
    fn from(ip: IpAddr) -> ClientAddress {
        ClientAddress(match ip {
            IpAddr::V4(_) => ip,
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => IpAddr::V4(v4),
                None => {
                    let prefix = u128::from(v6) & !((1u128 << 64) - 1);
                    IpAddr::V6(Ipv6Addr::from(prefix))
                }
            },
        })
    }
}

impl std::fmt::Display for ClientAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            IpAddr::V4(v4) => write!(f, "{v4}"),
            IpAddr::V6(v6) => write!(f, "{v6}/64"),
        }
    }
}

/// Admits connections under the global and per-address caps.
#[derive(Clone)]
pub struct ConnectionGate {
    all: Arc<InFlight<()>>,
    per_address: Arc<InFlight<ClientAddress>>,
    idle: Duration,
    metrics: Arc<Metrics>,
    last_refusal_log_ms: Arc<AtomicI64>,
}

/// Why a connection was closed at accept.
#[derive(Clone, Copy, Debug)]
enum Refusal {
    ServerFull,
    AddressFull,
}

impl Refusal {
    fn label(self) -> &'static str {
        match self {
            Refusal::ServerFull => "max_connections",
            Refusal::AddressFull => "max_connections_per_address",
        }
    }
}

impl ConnectionGate {
    pub fn new(limits: &Limits, metrics: Arc<Metrics>) -> ConnectionGate {
        ConnectionGate {
            all: InFlight::new(limits.max_connections),
            per_address: InFlight::new(limits.max_connections_per_address),
            idle: Duration::from_millis(limits.idle_timeout_ms),
            metrics,
            last_refusal_log_ms: Arc::new(AtomicI64::new(0)),
        }
    }

    fn admit(
        &self,
        stream: TcpStream,
        activity: Arc<RequestActivity>,
    ) -> io::Result<Admitted<TcpStream>> {
        let peer = stream.peer_addr()?;
        let key = ClientAddress::from(peer.ip());
        let Some(address) = self.per_address.try_enter(key) else {
            return Err(self.refuse(Refusal::AddressFull, peer));
        };
        let Some(all) = self.all.try_enter(()) else {
            return Err(self.refuse(Refusal::ServerFull, peer));
        };
        // Small writes (a poll's answer) go out at once.
        let _ = stream.set_nodelay(true);
        self.metrics.open_connections.inc();
        Ok(Admitted {
            inner: stream,
            _all: all,
            _address: address,
            metrics: self.metrics.clone(),
            idle: self.idle,
            last_activity: Instant::now(),
            requests: activity,
            timer: Box::pin(tokio::time::sleep(self.idle)),
        })
    }

    fn refuse(&self, refusal: Refusal, peer: SocketAddr) -> io::Error {
        self.metrics.refused(refusal.label());
        let now = now_ms();
        let last = self.last_refusal_log_ms.load(Ordering::Relaxed);
        if now - last >= REFUSAL_LOG_INTERVAL_MS
            && self
                .last_refusal_log_ms
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            tracing::warn!(
                %peer,
                limit = refusal.label(),
                "closing new connections at the connection limit; \
                 canopy_limit_refusals_total counts them"
            );
        }
        io::Error::new(io::ErrorKind::ConnectionRefused, refusal.label())
    }
}

impl<S> Accept<TcpStream, S> for ConnectionGate {
    type Stream = Admitted<TcpStream>;
    type Service = Tracked<S>;
    type Future = std::future::Ready<io::Result<(Admitted<TcpStream>, Tracked<S>)>>;

    fn accept(&self, stream: TcpStream, service: S) -> Self::Future {
        let activity = Arc::new(RequestActivity::new());
        let service = Tracked {
            inner: service,
            activity: activity.clone(),
        };
        std::future::ready(
            self.admit(stream, activity)
                .map(|admitted| (admitted, service)),
        )
    }
}

/// The requests open on one connection, and when the last one ended.
#[derive(Debug)]
pub struct RequestActivity {
    open: AtomicUsize,
    last_end: Mutex<Instant>,
}

impl RequestActivity {
    fn new() -> RequestActivity {
        RequestActivity {
            open: AtomicUsize::new(0),
            last_end: Mutex::new(Instant::now()),
        }
    }

    fn begin(self: &Arc<Self>) -> OpenRequest {
        self.open.fetch_add(1, Ordering::SeqCst);
        OpenRequest(self.clone())
    }

    /// Since when no request has been open; `None` while one is.
    fn idle_since(&self) -> Option<Instant> {
        let last_end = *self.last_end.lock().unwrap_or_else(PoisonError::into_inner);
        (self.open.load(Ordering::SeqCst) == 0).then_some(last_end)
    }
}

/// A request open on a connection, until its answer's body is sent (or
/// dropped).
struct OpenRequest(Arc<RequestActivity>);

impl Drop for OpenRequest {
    fn drop(&mut self) {
        *self
            .0
            .last_end
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Instant::now();
        self.0.open.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A connection's service, counting its requests open in the connection's
/// [`RequestActivity`] from their head to the end of their answer.
#[derive(Clone)]
pub struct Tracked<S> {
    inner: S,
    activity: Arc<RequestActivity>,
}

impl<S, B> tower::Service<Request<B>> for Tracked<S>
where
    S: tower::Service<Request<B>, Response = Response<Body>>,
    S::Future: Send + 'static,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Response<Body>, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let open = self.activity.begin();
        let answer = self.inner.call(request);
        Box::pin(async move {
            let response = answer.await?;
            Ok(response.map(|body| {
                // The body holds the request open until it is sent: a long
                // download is a request in progress.
                Body::new(body.map_frame(move |frame| {
                    let _open = &open;
                    frame
                }))
            }))
        })
    }
}

/// An admitted socket: holds its places under the caps until it is
/// dropped, and fails with `TimedOut` once no byte has moved either way
/// for the idle timeout.
pub struct Admitted<S> {
    inner: S,
    _all: InFlightGuard<()>,
    _address: InFlightGuard<ClientAddress>,
    metrics: Arc<Metrics>,
    idle: Duration,
    /// When a byte last moved either way.
    last_activity: Instant,
    requests: Arc<RequestActivity>,
    timer: Pin<Box<Sleep>>,
}

impl<S> Admitted<S> {
    /// Ready with an error once the connection has been idle too long;
    /// otherwise registers the timer with `cx` and stays pending.
    fn poll_idle(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        loop {
            let deadline = self.idle_deadline();
            if self.timer.deadline() != deadline {
                self.timer.as_mut().reset(deadline);
            }
            ready!(self.timer.as_mut().poll(cx));
            if let Some(idle) = self.idle_past_deadline() {
                return Poll::Ready(idle);
            }
        }
    }

    /// When the connection becomes idle: no byte moving, or no request
    /// open, for the idle timeout. Neither moves earlier as time passes,
    /// so a timer set to it never fires late.
    fn idle_deadline(&self) -> Instant {
        let bytes = self.last_activity + self.idle;
        match self.requests.idle_since() {
            Some(since) => bytes.min(since + self.idle),
            None => bytes,
        }
    }

    fn idle_past_deadline(&self) -> Option<io::Error> {
        (self.idle_deadline() <= Instant::now()).then(|| {
            io::Error::new(
                io::ErrorKind::TimedOut,
                "connection idle past limits.idle_timeout_ms",
            )
        })
    }
}

impl<S> Drop for Admitted<S> {
    fn drop(&mut self) {
        self.metrics.open_connections.dec();
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Admitted<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        match Pin::new(&mut self.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    self.last_activity = Instant::now();
                    // Bytes that are not a request (HTTP/2 PINGs) keep
                    // arriving, but do not keep the connection.
                    if let Some(idle) = self.idle_past_deadline() {
                        return Poll::Ready(Err(idle));
                    }
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending => self.poll_idle(cx).map(Err),
            ready => ready,
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Admitted<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match Pin::new(&mut self.inner).poll_write(cx, buf) {
            Poll::Ready(Ok(written)) => {
                if written > 0 {
                    self.last_activity = Instant::now();
                }
                Poll::Ready(Ok(written))
            }
            Poll::Pending => self.poll_idle(cx).map(Err),
            ready => ready,
        }
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match Pin::new(&mut self.inner).poll_write_vectored(cx, bufs) {
            Poll::Ready(Ok(written)) => {
                if written > 0 {
                    self.last_activity = Instant::now();
                }
                Poll::Ready(Ok(written))
            }
            Poll::Pending => self.poll_idle(cx).map(Err),
            ready => ready,
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Wraps an acceptor (the TLS one, or the gate for plain HTTP) so that the
/// connection's first byte of application data must arrive within a
/// deadline.
#[derive(Clone)]
pub struct FirstByteDeadline<A> {
    inner: A,
    deadline: Duration,
}

impl<A> FirstByteDeadline<A> {
    pub fn new(inner: A, deadline: Duration) -> FirstByteDeadline<A> {
        FirstByteDeadline { inner, deadline }
    }
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<A, I, S> Accept<I, S> for FirstByteDeadline<A>
where
    A: Accept<I, S>,
    A::Future: Send + 'static,
    A::Stream: Send + 'static,
    A::Service: Send + 'static,
{
    type Stream = FirstByte<A::Stream>;
    type Service = A::Service;
    type Future = BoxFuture<io::Result<(FirstByte<A::Stream>, A::Service)>>;

    fn accept(&self, stream: I, service: S) -> Self::Future {
        let accepted = self.inner.accept(stream, service);
        let deadline = self.deadline;
        Box::pin(async move {
            let (stream, service) = accepted.await?;
            Ok((
                FirstByte {
                    inner: stream,
                    deadline: Some(Box::pin(tokio::time::sleep(deadline))),
                },
                service,
            ))
        })
    }
}

/// A stream whose first read must produce data before a deadline.
pub struct FirstByte<S> {
    inner: S,
    /// Dropped once the first byte has arrived.
    deadline: Option<Pin<Box<Sleep>>>,
}

impl<S: AsyncRead + Unpin> AsyncRead for FirstByte<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        let Some(deadline) = self.deadline.as_mut() else {
            return polled;
        };
        match &polled {
            Poll::Ready(Ok(())) if buf.filled().len() > before => self.deadline = None,
            Poll::Pending if deadline.as_mut().poll(cx).is_ready() => {
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "no request within limits.header_read_timeout_ms",
                )));
            }
            _ => {}
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for FirstByte<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv6_clients_are_counted_per_64_and_mapped_ipv4_as_ipv4() {
        let a: IpAddr = "2001:db8:1:2:aaaa::1".parse().unwrap();
        let b: IpAddr = "2001:db8:1:2:bbbb::9".parse().unwrap();
        let other: IpAddr = "2001:db8:1:3::1".parse().unwrap();
        let key = ClientAddress::from;
        assert_eq!(key(a), key(b));
        assert_ne!(key(a), key(other));
        assert_eq!(key(a).to_string(), "2001:db8:1:2::/64");
        let mapped: IpAddr = "::ffff:10.1.2.3".parse().unwrap();
        assert_eq!(key(mapped), key("10.1.2.3".parse().unwrap()));
    }
}
