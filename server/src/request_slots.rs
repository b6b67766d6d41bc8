//! Request slots by kind: which pools of places each request draws on
//! while it is served, written once ([`RequestKind::of`] and
//! [`RequestSlots::take`]).
//!
//! One pool for every route let one kind of traffic starve the others:
//! 4,200 idle devices each waiting in a task poll held all 4,096 places, and
//! 4,096 enrollment bodies trickling in from 36 addresses kept every admin
//! request at 503 for a minute. So each kind has its own rule:
//!
//! | kind | draws on |
//! |---|---|
//! | probe (`/healthz`, `/readyz`) | nothing: never refused for load |
//! | admin API | its reserve (`reserved_admin_requests`), else the general pool |
//! | device upload | its reserve (`reserved_upload_requests`), else the general pool |
//! | task poll | a waiting place (`max_waiting_polls`) for its whole life, and a general place only while it works ([`PollSlot`]) |
//! | enrollment | a place per address (`max_enrollments_per_address`) and in its own pool (`max_concurrent_enrollments`); its body is read there, against a deadline and a minimum rate, before the handler runs |
//! | other device requests | the general pool (`max_concurrent_requests`); one that waits (a secure stage message or fetch with `wait_ms`) gives its place back for the wait when a waiting place is free ([`PollSlot`]) |
//! | documents, unknown routes | the general pool |
//!
//! A reserve is tried first and the general pool second, so device traffic
//! can fill the general pool without reaching an operator or an upload,
//! while an admin burst past its reserve still has the general pool.

use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::http::Method;
use canopy_protocol::messages::secagg_endpoints;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::Limits;
use crate::conn::ClientAddress;
use crate::inflight::{InFlight, InFlightGuard};

/// What a request is, as far as the server's capacity goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestKind {
    /// `/healthz` and `/readyz`.
    Probe,
    /// The admin API under `/api/v1` (its documents aside).
    Admin,
    /// A device's task poll, which mostly waits.
    TaskPoll,
    /// A device's update or masked input: an update-sized body.
    DeviceUpload,
    /// `POST /device/v1/enroll`: a body from a client with no credentials.
    Enrollment,
    /// Every other device request.
    Device,
    /// Documents, the dashboard, metrics, and paths with no route.
    Public,
}

impl RequestKind {
    /// The one classification of requests by method and path.
    pub fn of(method: &Method, path: &str) -> RequestKind {
        if path == "/healthz" || path == "/readyz" {
            return RequestKind::Probe;
        }
        if let Some(api) = path.strip_prefix("/api/v1/") {
            return match api {
                "openapi.json" | "docs" => RequestKind::Public,
                _ => RequestKind::Admin,
            };
        }
        let Some(device) = path.strip_prefix("/device/v1/") else {
            return RequestKind::Public;
        };
        if device == "enroll" && method == Method::POST {
            return RequestKind::Enrollment;
        }
        if device == "tasks/next" && method == Method::GET {
            return RequestKind::TaskPoll;
        }
        let is_masked_input = |round: &str| {
            round
                .strip_suffix(secagg_endpoints::MASKED_INPUT)
                .is_some_and(|rest| rest.ends_with("/secagg/"))
        };
        if let Some(round) = device.strip_prefix("rounds/")
            && ((method == Method::PUT && round.ends_with("/update"))
                || (method == Method::POST && is_masked_input(round)))
        {
            return RequestKind::DeviceUpload;
        }
        RequestKind::Device
    }
}

/// The routes that mint credentials, each rate-limited per client address
/// (`sensitive_requests_per_minute`) in a bucket of its own, so that
/// devices enrolling from behind a NAT do not use up an operator's token
/// creations there, nor the reverse.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CredentialRoute {
    /// `POST /device/v1/enroll`.
    Enrollment,
    /// `POST /api/v1/tokens` and `POST /api/v1/enrollment-tokens`.
    TokenCreation,
}

impl CredentialRoute {
    pub fn of(method: &Method, path: &str) -> Option<CredentialRoute> {
        if method != Method::POST {
            return None;
        }
        match path {
            "/device/v1/enroll" => Some(CredentialRoute::Enrollment),
            "/api/v1/tokens" | "/api/v1/enrollment-tokens" => Some(CredentialRoute::TokenCreation),
            _ => None,
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            CredentialRoute::Enrollment => "enrollments",
            CredentialRoute::TokenCreation => "token creations",
        }
    }
}

/// The pools, one place per request being served.
pub struct RequestSlots {
    general: Arc<Semaphore>,
    admin: Arc<Semaphore>,
    uploads: Arc<Semaphore>,
    waiting_polls: Arc<Semaphore>,
    enrollments: Arc<Semaphore>,
    enrollments_per_address: Arc<InFlight<ClientAddress>>,
    queue_wait: Duration,
    limits: PoolLimits,
}

/// The sizes, for messages and metrics.
#[derive(Clone, Copy, Debug)]
struct PoolLimits {
    general: usize,
    admin: usize,
    uploads: usize,
    waiting_polls: usize,
    enrollments: usize,
}

/// A pool, named by the setting that sizes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pool {
    General,
    Admin,
    Uploads,
    WaitingPolls,
    Enrollments,
    EnrollmentsPerAddress,
}

impl Pool {
    pub const ALL: [Pool; 6] = [
        Pool::General,
        Pool::Admin,
        Pool::Uploads,
        Pool::WaitingPolls,
        Pool::Enrollments,
        Pool::EnrollmentsPerAddress,
    ];

    /// The `Limits` setting that sizes it.
    pub fn setting(self) -> &'static str {
        match self {
            Pool::General => "max_concurrent_requests",
            Pool::Admin => "reserved_admin_requests",
            Pool::Uploads => "reserved_upload_requests",
            Pool::WaitingPolls => "max_waiting_polls",
            Pool::Enrollments => "max_concurrent_enrollments",
            Pool::EnrollmentsPerAddress => "max_enrollments_per_address",
        }
    }

    /// Its label in `canopy_request_slots_in_use`.
    pub fn label(self) -> &'static str {
        match self {
            Pool::General => "general",
            Pool::Admin => "admin",
            Pool::Uploads => "uploads",
            Pool::WaitingPolls => "task_polls",
            Pool::Enrollments => "enrollments",
            Pool::EnrollmentsPerAddress => "enrollment_addresses",
        }
    }
}

/// Why a request got no place.
#[derive(Debug, thiserror::Error)]
pub enum SlotRefusal {
    #[error(
        "the server is serving its limit of {limit} requests (limits.{}) and none finished \
         within {waited_ms} ms",
        pool.setting()
    )]
    Busy {
        pool: Pool,
        limit: usize,
        waited_ms: u64,
    },
    #[error("the server holds its limit of {limit} waiting task polls (limits.max_waiting_polls)")]
    PollsFull { limit: usize },
    #[error(
        "{address} already has {limit} enrollments in progress, its limit \
         (limits.max_enrollments_per_address)"
    )]
    AddressBusy {
        address: ClientAddress,
        limit: usize,
    },
    #[error("the server is shutting down")]
    Closed,
}

impl SlotRefusal {
    /// The pool that refused, for `canopy_limit_refusals_total`.
    pub fn pool(&self) -> Option<Pool> {
        match self {
            SlotRefusal::Busy { pool, .. } => Some(*pool),
            SlotRefusal::PollsFull { .. } => Some(Pool::WaitingPolls),
            SlotRefusal::AddressBusy { .. } => Some(Pool::EnrollmentsPerAddress),
            SlotRefusal::Closed => None,
        }
    }
}

/// The places a request holds until it is answered.
#[derive(Default)]
pub struct Held {
    _permits: Vec<OwnedSemaphorePermit>,
    _address: Option<InFlightGuard<ClientAddress>>,
    /// A device request's working place, which its handler gives back to
    /// wait.
    pub poll: Option<PollSlot>,
}

impl RequestSlots {
    pub fn new(limits: &Limits) -> RequestSlots {
        let sizes = PoolLimits {
            general: limits.max_concurrent_requests,
            admin: limits.reserved_admin_requests,
            uploads: limits.reserved_upload_requests,
            waiting_polls: limits.max_waiting_polls,
            enrollments: limits.max_concurrent_enrollments,
        };
        RequestSlots {
            general: Arc::new(Semaphore::new(sizes.general)),
            admin: Arc::new(Semaphore::new(sizes.admin)),
            uploads: Arc::new(Semaphore::new(sizes.uploads)),
            waiting_polls: Arc::new(Semaphore::new(sizes.waiting_polls)),
            enrollments: Arc::new(Semaphore::new(sizes.enrollments)),
            enrollments_per_address: InFlight::new(limits.max_enrollments_per_address),
            queue_wait: Duration::from_millis(limits.request_queue_timeout_ms),
            limits: sizes,
        }
    }

    /// Takes what a request of `kind` from `address` draws on: the rule of
    /// the module's table.
    pub async fn take(
        self: &Arc<Self>,
        kind: RequestKind,
        address: ClientAddress,
    ) -> Result<Held, SlotRefusal> {
        let mut held = Held::default();
        match kind {
            RequestKind::Probe => {}
            RequestKind::Admin => held
                ._permits
                .push(self.reserve_or_general(Pool::Admin).await?),
            RequestKind::DeviceUpload => {
                let working = self.reserve_or_general(Pool::Uploads).await?;
                held.poll = Some(PollSlot::working(self, working, false));
            }
            RequestKind::Device => {
                let working = self.wait_for(Pool::General).await?;
                held.poll = Some(PollSlot::working(self, working, false));
            }
            RequestKind::Public => held._permits.push(self.wait_for(Pool::General).await?),
            RequestKind::TaskPoll => {
                // Refused at once when full: a queue of polls waiting to
                // wait would only hold their connections longer.
                let waiting = self
                    .waiting_polls
                    .clone()
                    .try_acquire_owned()
                    .map_err(|_| SlotRefusal::PollsFull {
                        limit: self.limits.waiting_polls,
                    })?;
                held._permits.push(waiting);
                let general = self.wait_for(Pool::General).await?;
                held.poll = Some(PollSlot::working(self, general, true));
            }
            RequestKind::Enrollment => {
                let limit = self.enrollments_per_address.limit();
                held._address = Some(
                    self.enrollments_per_address
                        .try_enter(address)
                        .ok_or(SlotRefusal::AddressBusy { address, limit })?,
                );
                held._permits.push(self.wait_for(Pool::Enrollments).await?);
            }
        }
        Ok(held)
    }

    /// A place in `reserve`, or else in the general pool, whichever frees
    /// first within the queue wait.
    async fn reserve_or_general(&self, reserve: Pool) -> Result<OwnedSemaphorePermit, SlotRefusal> {
        let reserved = self.semaphore(reserve).clone();
        if let Ok(permit) = reserved.clone().try_acquire_owned() {
            return Ok(permit);
        }
        let either = async {
            tokio::select! {
                permit = reserved.acquire_owned() => permit,
                permit = self.general.clone().acquire_owned() => permit,
            }
        };
        self.within_queue_wait(Pool::General, either).await
    }

    async fn wait_for(&self, pool: Pool) -> Result<OwnedSemaphorePermit, SlotRefusal> {
        let semaphore = self.semaphore(pool).clone();
        self.within_queue_wait(pool, semaphore.acquire_owned())
            .await
    }

    async fn within_queue_wait(
        &self,
        pool: Pool,
        acquire: impl Future<Output = Result<OwnedSemaphorePermit, tokio::sync::AcquireError>>,
    ) -> Result<OwnedSemaphorePermit, SlotRefusal> {
        match tokio::time::timeout(self.queue_wait, acquire).await {
            Ok(Ok(permit)) => Ok(permit),
            Ok(Err(_)) => Err(SlotRefusal::Closed),
            Err(_) => Err(SlotRefusal::Busy {
                pool,
                limit: self.size(pool),
                waited_ms: u64::try_from(self.queue_wait.as_millis()).unwrap_or(u64::MAX),
            }),
        }
    }

    fn semaphore(&self, pool: Pool) -> &Arc<Semaphore> {
        match pool {
            Pool::General => &self.general,
            Pool::Admin => &self.admin,
            Pool::Uploads => &self.uploads,
            Pool::WaitingPolls => &self.waiting_polls,
            Pool::Enrollments | Pool::EnrollmentsPerAddress => &self.enrollments,
        }
    }

    fn size(&self, pool: Pool) -> usize {
        match pool {
            Pool::General => self.limits.general,
            Pool::Admin => self.limits.admin,
            Pool::Uploads => self.limits.uploads,
            Pool::WaitingPolls => self.limits.waiting_polls,
            Pool::Enrollments => self.limits.enrollments,
            Pool::EnrollmentsPerAddress => self.enrollments_per_address.limit(),
        }
    }

    /// Places taken in `pool` now (for the per-address cap: addresses with
    /// an enrollment in progress).
    pub fn in_use(&self, pool: Pool) -> usize {
        match pool {
            Pool::EnrollmentsPerAddress => self.enrollments_per_address.keys(),
            pool => self.size(pool) - self.semaphore(pool).available_permits(),
        }
    }
}

/// A device request's working place (general, or an upload's), which it
/// gives back while it waits ([`PollSlot::while_waiting`]) and takes again,
/// in the general pool, to build its answer. A task poll holds a waiting
/// place for its whole life; any other device request that waits (a
/// secure stage message or fetch with `wait_ms`) takes one for the wait
/// only, and when none is free it waits holding its working place, as
/// every request did before the pools were split. Dropping every copy
/// gives the places back.
#[derive(Clone)]
pub struct PollSlot {
    slots: Arc<RequestSlots>,
    general: Arc<Mutex<Option<OwnedSemaphorePermit>>>,
    /// Whether the request already holds a waiting place (task polls).
    holds_waiting_place: bool,
}

impl PollSlot {
    fn working(
        slots: &Arc<RequestSlots>,
        permit: OwnedSemaphorePermit,
        holds_waiting_place: bool,
    ) -> PollSlot {
        PollSlot {
            slots: slots.clone(),
            general: Arc::new(Mutex::new(Some(permit))),
            holds_waiting_place,
        }
    }

    /// Runs `wait` without the working place, then takes a general one
    /// again (within the queue wait, like any request) for the work after
    /// it.
    pub async fn while_waiting<F: Future>(&self, wait: F) -> Result<F::Output, SlotRefusal> {
        let _waiting = if self.holds_waiting_place {
            None
        } else {
            match self.slots.waiting_polls.clone().try_acquire_owned() {
                Ok(place) => Some(place),
                // No waiting place: wait as before, holding the work place.
                Err(_) => return Ok(wait.await),
            }
        };
        drop(self.lock().take());
        let output = wait.await;
        let permit = self.slots.wait_for(Pool::General).await?;
        *self.lock() = Some(permit);
        Ok(output)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<OwnedSemaphorePermit>> {
        self.general.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl std::fmt::Debug for PollSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PollSlot")
            .field("working", &self.lock().is_some())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits {
            max_concurrent_requests: 2,
            reserved_admin_requests: 1,
            reserved_upload_requests: 1,
            max_waiting_polls: 3,
            max_concurrent_enrollments: 2,
            max_enrollments_per_address: 1,
            request_queue_timeout_ms: 50,
            ..Limits::default()
        }
    }

    fn address(last: u8) -> ClientAddress {
        ClientAddress::from(std::net::IpAddr::from([127, 0, 0, last]))
    }

    #[test]
    fn requests_are_classified_by_method_and_path() {
        let cases = [
            (Method::GET, "/healthz", RequestKind::Probe),
            (Method::GET, "/readyz", RequestKind::Probe),
            (Method::GET, "/api/v1/jobs", RequestKind::Admin),
            (Method::POST, "/api/v1/tokens", RequestKind::Admin),
            (Method::GET, "/api/v1/openapi.json", RequestKind::Public),
            (Method::GET, "/metrics", RequestKind::Public),
            (Method::GET, "/dashboard", RequestKind::Public),
            (Method::GET, "/device/v1/tasks/next", RequestKind::TaskPoll),
            (Method::POST, "/device/v1/enroll", RequestKind::Enrollment),
            (Method::GET, "/device/v1/enroll", RequestKind::Device),
            (
                Method::PUT,
                "/device/v1/rounds/7/update",
                RequestKind::DeviceUpload,
            ),
            (
                Method::POST,
                "/device/v1/rounds/7/secagg/masked-input",
                RequestKind::DeviceUpload,
            ),
            (
                Method::POST,
                "/device/v1/rounds/7/secagg/share-keys",
                RequestKind::Device,
            ),
            (Method::POST, "/device/v1/heartbeat", RequestKind::Device),
        ];
        for (method, path, kind) in cases {
            assert_eq!(RequestKind::of(&method, path), kind, "{method} {path}");
        }
    }

    #[tokio::test]
    async fn a_full_general_pool_leaves_the_reserves_and_probes() {
        let slots = Arc::new(RequestSlots::new(&limits()));
        let _a = slots.take(RequestKind::Device, address(1)).await.unwrap();
        let _b = slots.take(RequestKind::Device, address(1)).await.unwrap();
        let refused = slots.take(RequestKind::Device, address(1)).await;
        assert!(
            matches!(
                refused,
                Err(SlotRefusal::Busy {
                    pool: Pool::General,
                    ..
                })
            ),
            "{:?}",
            refused.err()
        );
        let _admin = slots.take(RequestKind::Admin, address(1)).await.unwrap();
        let _upload = slots
            .take(RequestKind::DeviceUpload, address(1))
            .await
            .unwrap();
        slots.take(RequestKind::Probe, address(1)).await.unwrap();
        assert_eq!(slots.in_use(Pool::General), 2);
        assert_eq!(slots.in_use(Pool::Admin), 1);
    }

    /// A request that takes its places for `kind`, then waits (as
    /// `while_waiting`) until `woken` turns true; it has given back what it
    /// gives back for the wait once this returns.
    async fn wait_until_woken(
        slots: &Arc<RequestSlots>,
        kind: RequestKind,
        address: ClientAddress,
        woken: &tokio::sync::watch::Receiver<bool>,
    ) -> tokio::task::JoinHandle<Result<(), SlotRefusal>> {
        let held = slots.take(kind, address).await.unwrap();
        let slot = held.poll.clone().expect("a device request can wait");
        let mut woken = woken.clone();
        let waiter = tokio::spawn(async move {
            let _held = held;
            slot.while_waiting(async move {
                let _ = woken.wait_for(|woken| *woken).await;
            })
            .await
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        waiter
    }

    #[tokio::test]
    async fn waiting_polls_give_back_their_general_place() {
        // Three waiting polls and two general places.
        let slots = Arc::new(RequestSlots::new(&limits()));
        let (wake, woken) = tokio::sync::watch::channel(false);
        let mut waiting = Vec::new();
        for _ in 0..3 {
            waiting.push(wait_until_woken(&slots, RequestKind::TaskPoll, address(1), &woken).await);
        }
        assert_eq!(slots.in_use(Pool::WaitingPolls), 3);
        assert_eq!(
            slots.in_use(Pool::General),
            0,
            "waiting polls hold general places"
        );
        let refused = slots.take(RequestKind::TaskPoll, address(1)).await;
        assert!(matches!(refused, Err(SlotRefusal::PollsFull { limit: 3 })));
        let device = slots.take(RequestKind::Device, address(2)).await;
        assert!(device.is_ok(), "{:?}", device.err());
        drop(device);
        // Woken, each takes a general place again to answer.
        wake.send(true).unwrap();
        for poll in waiting {
            poll.await.unwrap().unwrap();
        }
        assert_eq!(slots.in_use(Pool::General), 0);
        assert_eq!(slots.in_use(Pool::WaitingPolls), 0);
    }

    #[tokio::test]
    async fn a_device_request_that_waits_gives_back_its_place_while_a_waiting_place_is_free() {
        // Two general places, three waiting places: two secure stage
        // messages waiting for their stage leave the general pool free.
        let slots = Arc::new(RequestSlots::new(&limits()));
        let (wake, woken) = tokio::sync::watch::channel(false);
        let mut waiting = Vec::new();
        for kind in [RequestKind::Device, RequestKind::DeviceUpload] {
            waiting.push(wait_until_woken(&slots, kind, address(1), &woken).await);
        }
        assert_eq!(
            slots.in_use(Pool::General),
            0,
            "waiters hold general places"
        );
        assert_eq!(
            slots.in_use(Pool::Uploads),
            0,
            "a waiter holds the upload reserve"
        );
        assert_eq!(slots.in_use(Pool::WaitingPolls), 2);
        // With the waiting places taken, a request waits in its own place.
        let fill = slots.waiting_polls.clone().try_acquire_owned().unwrap();
        let kept = wait_until_woken(&slots, RequestKind::Device, address(2), &woken).await;
        assert_eq!(
            slots.in_use(Pool::General),
            1,
            "no waiting place: it keeps its own"
        );
        wake.send(true).unwrap();
        for wait in waiting {
            wait.await.unwrap().unwrap();
        }
        kept.await.unwrap().unwrap();
        drop(fill);
        assert_eq!(slots.in_use(Pool::General), 0);
        assert_eq!(slots.in_use(Pool::WaitingPolls), 0);
    }

    #[tokio::test]
    async fn enrollments_are_capped_per_address() {
        let slots = Arc::new(RequestSlots::new(&limits()));
        let _first = slots
            .take(RequestKind::Enrollment, address(1))
            .await
            .unwrap();
        let refused = slots.take(RequestKind::Enrollment, address(1)).await;
        assert!(matches!(
            refused,
            Err(SlotRefusal::AddressBusy { limit: 1, .. })
        ));
        let _other = slots
            .take(RequestKind::Enrollment, address(2))
            .await
            .unwrap();
        let full = slots.take(RequestKind::Enrollment, address(3)).await;
        assert!(matches!(
            full,
            Err(SlotRefusal::Busy {
                pool: Pool::Enrollments,
                ..
            })
        ));
        assert_eq!(slots.in_use(Pool::General), 0);
    }
}
