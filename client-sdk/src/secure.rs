//! The device's side of a secure-aggregation (SecAgg+) round over HTTP.
//!
//! A task whose `secure_aggregation` is set replaces the float upload with
//! the six stages of [`canopy_protocol::secagg`], against the endpoints
//! under [`SecureTask::path`]:
//!
//! 1. AdvertiseKeys: `POST advertise-keys`, then `GET neighbour-keys`;
//! 2. ShareKeys: `POST share-keys`, then `GET incoming-shares`;
//! 3. ShareCheck: `POST share-receipt` (the neighbours whose shares would
//!    not open), then `GET exclusions` (the neighbours the server excluded
//!    for it);
//! 4. MaskedInputCollection: `POST masked-input`, then `GET survivor-set`;
//! 5. ConsistencyCheck: `POST survivor-signature` (the survivor set, signed
//!    with the device's key), then `GET unmask-request`;
//! 6. Unmasking: `POST unmask-response`.
//!
//! The key stages, ShareCheck and ConsistencyCheck are short (each closes
//! once every device has answered, or after
//! [`SecureTask::stage_timeout_ms`]), while collection stays open until the
//! task's deadline. So a device exchanges and checks keys before it trains
//! and trains while the others do: [`DeviceClient::begin_secure_round`]
//! runs AdvertiseKeys and ShareKeys and sends its ShareReceipt, and
//! [`SecureRound::finish`] takes the trained update and does the rest. [`DeviceClient::run_secure_round`] does both for an
//! update trained beforehand.
//!
//! # Requests
//!
//! Every request goes through the client's [`RetryPolicy`](crate::RetryPolicy)
//! and races its [`CancelToken`](crate::CancelToken), as the client's other
//! calls do. A stage message is safe to send again: the server answers 409
//! to a second copy, which a retry after an attempt that may have landed
//! takes as "the first one was taken" (as [`DeviceClient::upload_update`]
//! does). Fetching the server's message is a plain read.
//!
//! Answers map to errors as follows: 410 (the stage closed before the
//! device's message came, the device was dropped, or the round failed) is
//! [`SdkError::SecureRoundGone`], and 422 (the server refused the device's
//! message) [`SdkError::SecureMessageRefused`], both with the server's code
//! and reason; other statuses are [`SdkError::Server`]. A server message
//! over its stage's size limit ([`Stage::max_bytes`] of the plan) is
//! refused unread as [`SdkError::BadResponse`].
//!
//! # Waiting
//!
//! The server's messages are long-polled (`wait_ms`, at most
//! [`MAX_STAGE_POLL_WAIT_MS`] per request; 202 means "not yet"). Each wait
//! is bounded, and ends in [`SdkError::StageTimeout`]:
//!
//! - NeighbourKeys, IncomingShares, Exclusions and UnmaskRequest: the
//!   server closes a
//!   short stage at most `stage_timeout_ms` after it opened, which was
//!   before the device sent its own message for it; so the device waits
//!   `stage_timeout_ms` plus [`STAGE_CLOSE_GRACE_MS`] from when it sent
//!   that message;
//! - SurvivorSet: collection closes at the task's deadline; the device
//!   waits until the round's end, `deadline_unix_ms` plus two stage
//!   timeouts (ConsistencyCheck and Unmasking) plus
//!   [`DEADLINE_CLOCK_SKEW_MS`], by its own clock;
//! - and no wait runs past that round bound either.
//!
//! The device's secrets for the round live in its [`SecureRound`] and are
//! zeroized when it is dropped; a round cannot be resumed after that (or
//! after a restart): the device is then one of the dropouts the round was
//! planned to survive.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use canopy_protocol::messages::{SecureTask, Task, secagg_endpoints};
use canopy_protocol::secagg::wire::{Session, Stage};
use canopy_protocol::secagg::{Client, Plan, SecAggError, arith};
use reqwest::{Method, StatusCode};
use tokio::time::Instant;

use crate::client::{DeviceClient, validate_task};
use crate::error::SdkError;
use crate::retry;
use crate::train::LocalUpdate;
use crate::transport::{LimitedBody, now_ms, read_limited, server_error};

/// Longest `wait_ms` of one poll: well under the client's request timeout
/// and the idle timeouts of common proxies.
pub const MAX_STAGE_POLL_WAIT_MS: u64 = 25_000;
/// Shortest time between two polls, so that a server answering 202 at
/// once (one that ignores `wait_ms`) is not polled in a tight loop.
pub const MIN_STAGE_POLL_INTERVAL_MS: u64 = 1_000;
/// Time the server is given, past a key stage's timeout, to notice that
/// the stage is over, close it and answer.
pub const STAGE_CLOSE_GRACE_MS: u64 = 30_000;
/// How far the device's clock may be ahead of the server's before a wait
/// measured against the task's deadline ends early.
pub const DEADLINE_CLOCK_SKEW_MS: u64 = 60_000;
/// How long past the end of a wait a long poll may take to answer before
/// the connection is taken for dead.
const POLL_ANSWER_ALLOWANCE_MS: u64 = 10_000;

/// One stage message sent or received, for progress reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StageProgress {
    pub round_id: i64,
    /// The message: one of the device's (sent) or the server's (received).
    pub stage: Stage,
    pub bytes: usize,
    /// For a message sent, how long sending took, retries included; for
    /// one received, how long the device waited for it.
    pub elapsed_ms: u64,
}

impl StageProgress {
    /// Whether the device sent this message (else it received it).
    pub fn sent(&self) -> bool {
        self.stage.sent_by_device()
    }
}

/// Called after every message a [`SecureRound`] sends or receives.
pub type StageObserver = Arc<dyn Fn(&StageProgress) + Send + Sync>;

/// What a device's finished secure round amounts to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SecureReceipt {
    pub round_id: i64,
    /// The weight the update carries in the sum: its sample count, capped
    /// at the plan's `max_weight`.
    pub weight: u64,
    /// Size of the masked input the device sent.
    pub masked_input_bytes: u64,
}

/// A secure round in progress: keys exchanged, the update still to come.
///
/// Made by [`DeviceClient::begin_secure_round`]; [`SecureRound::finish`]
/// consumes it. It holds a clone of the client (connection pool, retry
/// policy and cancel token shared), and the round's secrets.
pub struct SecureRound {
    client: DeviceClient,
    task: Task,
    state: Client,
    /// When the ShareReceipt went out: Exclusions' wait counts from there,
    /// however long training took.
    checked_at: Instant,
    observer: Option<StageObserver>,
}

impl fmt::Debug for SecureRound {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SecureRound")
            .field("round_id", &self.task.round_id)
            .field("state", &self.state)
            .field("observed", &self.observer.is_some())
            .finish_non_exhaustive()
    }
}

fn endpoint(stage: Stage) -> &'static str {
    secagg_endpoints::of(stage)
}

/// What [`SdkError::BadResponse`] calls a server message.
fn message_name(stage: Stage) -> &'static str {
    match stage {
        Stage::AdvertiseKeys => "AdvertiseKeys message",
        Stage::NeighbourKeys => "NeighbourKeys message",
        Stage::ShareKeys => "ShareKeys message",
        Stage::IncomingShares => "IncomingShares message",
        Stage::ShareReceipt => "ShareReceipt message",
        Stage::Exclusions => "Exclusions message",
        Stage::MaskedInput => "MaskedInput message",
        Stage::SurvivorSet => "SurvivorSet message",
        Stage::SurvivorSignature => "SurvivorSignature message",
        Stage::UnmaskRequest => "UnmaskRequest message",
        Stage::UnmaskResponse => "UnmaskResponse message",
    }
}

fn secure_task(task: &Task) -> Result<&SecureTask, SdkError> {
    task.secure_aggregation.as_ref().ok_or(SdkError::NotSecure {
        round_id: task.round_id,
    })
}

fn protocol_error(task: &Task, stage: Stage, source: SecAggError) -> SdkError {
    SdkError::SecureAggregation {
        round_id: task.round_id,
        stage,
        source,
    }
}

/// A caller's mistake: a stage used in the wrong direction.
fn wrong_direction(task: &Task, stage: Stage, doing: &str) -> SdkError {
    protocol_error(
        task,
        stage,
        SecAggError::Invalid(format!(
            "a device cannot {doing} a {} message",
            stage.name()
        )),
    )
}

/// `{path}/{endpoint}`, after checking that the server's path is a plain
/// absolute path (the client appends to it and signs the result).
fn stage_path(task: &Task, secure: &SecureTask, stage: Stage) -> Result<String, SdkError> {
    let base = secure.path.trim_end_matches('/');
    let plain = base.starts_with('/')
        && !base.contains(['?', '#'])
        && !base.chars().any(|c| c.is_control() || c.is_whitespace());
    if !plain {
        return Err(SdkError::BadResponse {
            what: "task",
            reason: format!(
                "round {}'s secure_aggregation.path `{}` is not a plain absolute path",
                task.round_id,
                secure.path.chars().take(128).collect::<String>()
            ),
        });
    }
    Ok(format!("{base}/{}", endpoint(stage)))
}

/// Names the stage in the server's 410 and 422 answers.
fn stage_error(task: &Task, stage: Stage, error: SdkError) -> SdkError {
    match error {
        SdkError::Server {
            status: 410,
            code,
            message,
            ..
        } => SdkError::SecureRoundGone {
            round_id: task.round_id,
            stage,
            code,
            reason: message,
        },
        SdkError::Server {
            status: 422,
            code,
            message,
            ..
        } => SdkError::SecureMessageRefused {
            round_id: task.round_id,
            stage,
            code,
            reason: message,
        },
        other => other,
    }
}

/// How long, from now, a device waits for the server's `stage` message
/// before it gives up; see the [module documentation](self). `sent_ms_ago`
/// is how long ago the device sent the message that precedes it.
pub(crate) fn wait_limit_ms(
    stage_timeout_ms: u64,
    deadline_unix_ms: u64,
    stage: Stage,
    sent_ms_ago: u64,
    now_unix_ms: u64,
) -> u64 {
    // Past the deadline run ConsistencyCheck and Unmasking.
    let round_left_ms = deadline_unix_ms
        .saturating_add(stage_timeout_ms.saturating_mul(2))
        .saturating_add(DEADLINE_CLOCK_SKEW_MS)
        .saturating_sub(now_unix_ms);
    match stage {
        Stage::NeighbourKeys | Stage::IncomingShares | Stage::Exclusions | Stage::UnmaskRequest => {
            stage_timeout_ms
                .saturating_add(STAGE_CLOSE_GRACE_MS)
                .saturating_sub(sent_ms_ago)
                .min(round_left_ms)
        }
        Stage::SurvivorSet => round_left_ms,
        // The device's own messages are sent, never waited for.
        Stage::AdvertiseKeys
        | Stage::ShareKeys
        | Stage::ShareReceipt
        | Stage::MaskedInput
        | Stage::SurvivorSignature
        | Stage::UnmaskResponse => 0,
    }
}

/// The server's `stage` message in a 200 answer, refused unread over
/// `limit_bytes`.
async fn read_answer(
    task: &Task,
    stage: Stage,
    response: &mut reqwest::Response,
    limit_bytes: usize,
) -> Result<Bytes, SdkError> {
    let url = response.url().to_string();
    match read_limited(response, limit_bytes).await {
        Ok(LimitedBody::Complete(body)) => Ok(Bytes::from(body)),
        Ok(LimitedBody::TooLong { announced_bytes }) => Err(SdkError::BadResponse {
            what: message_name(stage),
            reason: format!(
                "round {}: it is {}, over its stage's limit of {limit_bytes} bytes",
                task.round_id,
                announced_bytes
                    .map_or_else(|| "longer".to_string(), |bytes| format!("{bytes} bytes"))
            ),
        }),
        Err(source) => Err(SdkError::Transport { url, source }),
    }
}

fn elapsed_ms(since: Instant) -> u64 {
    u64::try_from(since.elapsed().as_millis()).unwrap_or(u64::MAX)
}

impl DeviceClient {
    /// Sends this device's message for `stage` (AdvertiseKeys, ShareKeys,
    /// ShareReceipt, MaskedInput, SurvivorSignature or UnmaskResponse): `POST {path}/{endpoint}`, expecting
    /// 204. Retried under the client's policy. After an attempt that may
    /// have landed (see [`crate::retry`]), a 409 counts as taken, and so
    /// does a 410 for the stages the device fetches an answer to: the
    /// stage may have closed with the message in it, and the fetch that
    /// follows is answered 410 if it was not.
    pub async fn post_secure_message(
        &self,
        task: &Task,
        stage: Stage,
        message: Bytes,
    ) -> Result<(), SdkError> {
        self.send_secure_message(task, stage, message, None)
            .await
            .map(drop)
    }

    /// [`DeviceClient::post_secure_message`] that asks the server to hold
    /// its answer up to `wait_ms` for the server's next message to this
    /// device ([`Stage::answer`]) and return it: `Some` with that message,
    /// `None` when the message was taken but the answer is not ready (fetch
    /// it with [`DeviceClient::wait_secure_message`]). One request instead
    /// of two per stage, for the device and the server.
    pub async fn post_secure_message_and_wait(
        &self,
        task: &Task,
        stage: Stage,
        message: Bytes,
        wait_ms: u64,
    ) -> Result<Option<Bytes>, SdkError> {
        self.send_secure_message(task, stage, message, Some(wait_ms))
            .await
    }

    async fn send_secure_message(
        &self,
        task: &Task,
        stage: Stage,
        message: Bytes,
        wait_ms: Option<u64>,
    ) -> Result<Option<Bytes>, SdkError> {
        let secure = secure_task(task)?;
        if !stage.sent_by_device() {
            return Err(wrong_direction(task, stage, "send"));
        }
        let limit_bytes = stage.max_bytes(secure.plan.packed_bytes());
        if message.len() > limit_bytes {
            return Err(protocol_error(
                task,
                stage,
                SecAggError::Invalid(format!(
                    "the message is {} bytes, over its stage's limit of {limit_bytes}",
                    message.len()
                )),
            ));
        }
        let answer = wait_ms.and(stage.answer());
        let path = match (answer, wait_ms) {
            (Some(_), Some(wait_ms)) => {
                format!("{}?wait_ms={wait_ms}", stage_path(task, secure, stage)?)
            }
            _ => stage_path(task, secure, stage)?,
        };
        let policy = self.retry_policy().normalized();
        let cancel = self.cancel_token();
        let mut failures = 0u32;
        let mut maybe_delivered = false;
        loop {
            let attempt = async {
                let mut response = self.signed(Method::POST, &path, message.clone()).await?;
                match (response.status(), answer) {
                    (StatusCode::NO_CONTENT, _) => Ok(None),
                    (StatusCode::OK, Some(answer)) => {
                        let limit_bytes = answer.max_bytes(secure.plan.packed_bytes());
                        read_answer(task, answer, &mut response, limit_bytes)
                            .await
                            .map(Some)
                    }
                    (status, _) if status.is_success() => Err(SdkError::BadResponse {
                        what: message_name(stage),
                        reason: format!(
                            "round {}: the server answered {status} to it, not 204",
                            task.round_id
                        ),
                    }),
                    _ => Err(stage_error(task, stage, server_error(response).await)),
                }
            };
            let error = match cancel.run(attempt).await {
                None => return Err(SdkError::Cancelled),
                Some(Ok(answer)) => return Ok(answer),
                Some(Err(error)) => error,
            };
            if maybe_delivered {
                match error.status() {
                    Some(409) => return Ok(None),
                    Some(410) if stage != Stage::UnmaskResponse => return Ok(None),
                    _ => {}
                }
            }
            failures += 1;
            maybe_delivered |= error.may_have_been_processed();
            if !error.is_retryable() || failures >= policy.max_attempts {
                return Err(error);
            }
            self.wait_to_retry(&policy, failures, &error).await?;
        }
    }

    /// One long poll for the server's message of `stage` (NeighbourKeys,
    /// IncomingShares, Exclusions, SurvivorSet or UnmaskRequest): `GET {path}/{endpoint}?wait_ms=N`.
    /// `Some` with the message on 200, `None` on 202 (the previous stage is
    /// still open). Retried under the client's policy.
    pub async fn poll_secure_message(
        &self,
        task: &Task,
        stage: Stage,
        wait_ms: u64,
    ) -> Result<Option<Bytes>, SdkError> {
        let secure = secure_task(task)?;
        if stage.sent_by_device() {
            return Err(wrong_direction(task, stage, "fetch"));
        }
        let path = format!("{}?wait_ms={wait_ms}", stage_path(task, secure, stage)?);
        let limit_bytes = stage.max_bytes(secure.plan.packed_bytes());
        self.retrying(|| async {
            let mut response = self.signed(Method::GET, &path, Bytes::new()).await?;
            match response.status() {
                StatusCode::OK => read_answer(task, stage, &mut response, limit_bytes)
                    .await
                    .map(Some),
                StatusCode::ACCEPTED => Ok(None),
                status if status.is_success() => Err(SdkError::BadResponse {
                    what: message_name(stage),
                    reason: format!(
                        "round {}: the server answered {status}, not 200 or 202",
                        task.round_id
                    ),
                }),
                _ => Err(stage_error(task, stage, server_error(response).await)),
            }
        })
        .await
    }

    /// Polls for the server's message of `stage` until it comes, or
    /// `wait_limit_ms` have passed ([`SdkError::StageTimeout`]). Polls at
    /// least once, so a message that is already there is fetched even
    /// with no time left.
    pub async fn wait_secure_message(
        &self,
        task: &Task,
        stage: Stage,
        wait_limit_ms: u64,
    ) -> Result<Bytes, SdkError> {
        let started = Instant::now();
        let give_up = started + Duration::from_millis(wait_limit_ms);
        let timed_out = || SdkError::StageTimeout {
            round_id: task.round_id,
            stage,
            waited_ms: elapsed_ms(started),
        };
        loop {
            let poll_started = Instant::now();
            // Rounded up to whole milliseconds: a fraction of one left is
            // still worth a wait.
            let remaining = give_up.saturating_duration_since(poll_started);
            let remaining_ms = remaining.as_nanos().div_ceil(1_000_000);
            let wait_ms = u64::try_from(remaining_ms)
                .unwrap_or(u64::MAX)
                .min(MAX_STAGE_POLL_WAIT_MS);
            // The poll, retries included, may run until the limit and an
            // answer's travel time past it, not on to the client's request
            // timeout on a connection that went silent.
            let answer_by =
                give_up.max(poll_started) + Duration::from_millis(POLL_ANSWER_ALLOWANCE_MS);
            let poll = self.poll_secure_message(task, stage, wait_ms);
            match tokio::time::timeout_at(answer_by, poll).await {
                Err(_) => return Err(timed_out()),
                Ok(Ok(Some(message))) => return Ok(message),
                Ok(Ok(None)) => {}
                Ok(Err(error)) => return Err(error),
            }
            let now = Instant::now();
            if now >= give_up {
                return Err(timed_out());
            }
            let pace = Duration::from_millis(MIN_STAGE_POLL_INTERVAL_MS)
                .saturating_sub(now - poll_started)
                .min(give_up - now);
            retry::sleep(self.cancel_token(), pace).await?;
        }
    }

    /// Starts a secure round: fresh round keys, AdvertiseKeys, the
    /// neighbours' keys, this device's ShareKeys message sent, and its
    /// neighbours' shares checked (ShareCheck's receipt sent). Call it
    /// before training; see [`SecureRound::finish`].
    pub async fn begin_secure_round(&self, task: &Task) -> Result<SecureRound, SdkError> {
        SecureRound::begin(self, task, None).await
    }

    /// [`DeviceClient::begin_secure_round`] that reports every message sent
    /// and received, in this call and in [`SecureRound::finish`], to
    /// `observer`.
    pub async fn begin_secure_round_observed(
        &self,
        task: &Task,
        observer: StageObserver,
    ) -> Result<SecureRound, SdkError> {
        SecureRound::begin(self, task, Some(observer)).await
    }

    /// A whole secure round for an update trained beforehand: `delta` is
    /// the change of the trainable parameters in layout order (what the
    /// float upload would carry) and `num_samples` its sample count.
    /// Prefer [`DeviceClient::begin_secure_round`] before training and
    /// [`SecureRound::finish`] after it, which does not hold up the key
    /// stages for the length of the training.
    pub async fn run_secure_round(
        &self,
        task: &Task,
        delta: &[f32],
        num_samples: u64,
    ) -> Result<SecureReceipt, SdkError> {
        self.begin_secure_round(task)
            .await?
            .finish(delta, num_samples)
            .await
    }
}

impl SecureRound {
    async fn begin(
        client: &DeviceClient,
        task: &Task,
        observer: Option<StageObserver>,
    ) -> Result<SecureRound, SdkError> {
        let secure = secure_task(task)?;
        validate_task(task)?;
        let start_error = |source| protocol_error(task, Stage::AdvertiseKeys, source);
        let id = |what: &str, value: i64| {
            u64::try_from(value).map_err(|_| {
                start_error(SecAggError::Invalid(format!(
                    "{what} {value} is negative; ids are positive"
                )))
            })
        };
        let session = Session {
            job_id: id("job id", task.job_id)?,
            round_id: id("round id", task.round_id)?,
        };
        let device_id = id("device id", client.device_id)?;
        // A plan for another model would fail only at masking, after the
        // device had held up both key stages.
        let layout_len = task.layout.num_elements();
        if secure.plan.update_len != layout_len {
            return Err(start_error(SecAggError::Invalid(format!(
                "the plan is for updates of {} values, the task's layout has {layout_len}",
                secure.plan.update_len
            ))));
        }
        let (state, advertisement) = Client::start(
            session,
            device_id,
            secure.plan.clone(),
            client.key(),
            client.key_trust(),
        )
        .map_err(start_error)?;
        let mut round = SecureRound {
            client: client.clone(),
            task: task.clone(),
            state,
            checked_at: Instant::now(),
            observer,
        };
        let neighbour_keys = round.exchange(Stage::AdvertiseKeys, advertisement).await?;
        let shares = round
            .state
            .share_keys(&neighbour_keys)
            .map_err(|source| protocol_error(&round.task, Stage::ShareKeys, source))?;
        let incoming = round.exchange(Stage::ShareKeys, shares).await?;
        let receipt = round
            .state
            .check_shares(&incoming)
            .map_err(|source| protocol_error(&round.task, Stage::ShareReceipt, source))?;
        round.send(Stage::ShareReceipt, receipt).await?;
        round.checked_at = Instant::now();
        Ok(round)
    }

    pub fn round_id(&self) -> i64 {
        self.task.round_id
    }

    pub fn task(&self) -> &Task {
        &self.task
    }

    pub fn plan(&self) -> &Plan {
        self.state.plan()
    }

    /// Finishes the round with the trained update: `delta` is the change
    /// of the trainable parameters in layout order (what the float upload
    /// would carry), `num_samples` its sample count. Waits for the
    /// Exclusions, sends the masked input, signs the survivor set
    /// (which comes after the task's deadline at the latest), then answers
    /// the unmask request.
    pub async fn finish(
        mut self,
        delta: &[f32],
        num_samples: u64,
    ) -> Result<SecureReceipt, SdkError> {
        // Checked first: an update that does not fit the plan fails here,
        // before any more of the round's time is spent. It is quantized
        // where it is masked.
        let update = arith::Quantizer::new(self.state.plan(), delta, num_samples)
            .map_err(|source| protocol_error(&self.task, Stage::MaskedInput, source))?;
        let exclusions = self.receive(Stage::Exclusions, self.checked_at).await?;
        let masked = self
            .state
            .masked_update(&exclusions, &update, &mut rand::rng())
            .map_err(|source| protocol_error(&self.task, Stage::MaskedInput, source))?;
        let masked_input_bytes = masked.len() as u64;
        let survivor_set = self.exchange(Stage::MaskedInput, masked).await?;
        let signature = self
            .state
            .sign_survivors(&survivor_set, self.client.key())
            .map_err(|source| protocol_error(&self.task, Stage::SurvivorSignature, source))?;
        let request = self.exchange(Stage::SurvivorSignature, signature).await?;
        let response = self
            .state
            .unmask(&request)
            .map_err(|source| protocol_error(&self.task, Stage::UnmaskResponse, source))?;
        self.send(Stage::UnmaskResponse, response).await?;
        Ok(SecureReceipt {
            round_id: self.task.round_id,
            weight: num_samples.min(self.state.plan().max_weight),
            masked_input_bytes,
        })
    }

    /// [`SecureRound::finish`] with the update [`crate::train`] produced:
    /// its values, which its float encoding holds exactly (f32), so they
    /// are not decoded again; `finish` checks their count and finiteness.
    pub async fn finish_update(self, update: &LocalUpdate) -> Result<SecureReceipt, SdkError> {
        self.finish(&update.delta, update.num_samples).await
    }

    async fn send(&self, stage: Stage, message: Vec<u8>) -> Result<(), SdkError> {
        let started = Instant::now();
        let bytes = message.len();
        self.client
            .post_secure_message(&self.task, stage, Bytes::from(message))
            .await?;
        self.report(stage, bytes, started);
        Ok(())
    }

    /// Sends `message` and gets the server's answer to it: with the POST
    /// when it is ready in time (one request), else by long poll. A message
    /// answered with its POST reports the wait in both its events.
    async fn exchange(&self, stage: Stage, message: Vec<u8>) -> Result<Bytes, SdkError> {
        let answer = stage
            .answer()
            .expect("exchange is called for messages the server answers");
        let started = Instant::now();
        let bytes = message.len();
        let wait_ms = self
            .wait_limit_ms(answer, started)?
            .min(MAX_STAGE_POLL_WAIT_MS);
        let answered = self
            .client
            .post_secure_message_and_wait(&self.task, stage, Bytes::from(message), wait_ms)
            .await?;
        self.report(stage, bytes, started);
        match answered {
            Some(body) => {
                self.report(answer, body.len(), started);
                Ok(body)
            }
            None => self.receive(answer, started).await,
        }
    }

    /// How long, from now, to wait for the server's `stage` message; see
    /// [`wait_limit_ms`].
    fn wait_limit_ms(&self, stage: Stage, sent_at: Instant) -> Result<u64, SdkError> {
        let secure = secure_task(&self.task)?;
        Ok(wait_limit_ms(
            secure.stage_timeout_ms,
            self.task.deadline_unix_ms,
            stage,
            elapsed_ms(sent_at),
            now_ms(),
        ))
    }

    /// Waits for the server's `stage` message; `sent_at` is when the
    /// device sent the message it answers.
    async fn receive(&self, stage: Stage, sent_at: Instant) -> Result<Bytes, SdkError> {
        let started = Instant::now();
        let limit_ms = self.wait_limit_ms(stage, sent_at)?;
        let message = self
            .client
            .wait_secure_message(&self.task, stage, limit_ms)
            .await?;
        self.report(stage, message.len(), started);
        Ok(message)
    }

    fn report(&self, stage: Stage, bytes: usize, started: Instant) {
        if let Some(observer) = &self.observer {
            observer(&StageProgress {
                round_id: self.task.round_id,
                stage,
                bytes,
                elapsed_ms: elapsed_ms(started),
            });
        }
    }
}

#[cfg(test)]
#[path = "secure_tests.rs"]
mod tests;
