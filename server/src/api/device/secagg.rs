//! The device side of secure rounds: eleven endpoints under
//! `/device/v1/rounds/{round_id}/secagg/`, one per message of the six
//! stages (see `canopy_protocol::messages::SecureTask`).
//!
//! Every message is checked by `canopy_protocol::secagg` before anything is
//! stored: its header binds it to this job, round, stage and device, so a
//! replay from another round is refused by name. What a device may post
//! depends on the stage and on what it has already sent; what it may fetch
//! is computed from the graph and the stored stage results, so any server
//! process answers the same.

use std::collections::BTreeSet;
use std::fmt::Display;

use axum::body::Body;
use axum::extract::{Extension, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use canopy_protocol::device_cert;
use canopy_protocol::messages::secagg_endpoints as endpoints;
use canopy_protocol::secagg::server as secagg_server;
use canopy_protocol::secagg::wire::Stage;
use canopy_protocol::secagg::{SecAggError, Session};

use super::POLL_RECHECK_MS;
use super::auth::DeviceAuth;
use super::folds::{self, FoldError, FoldQueue, Foldable};
use super::tasks::PollQuery;
use super::{poll_wait, waiting};
use crate::api::error::{ApiError, ApiResult, Path, Query};
use crate::api::{upload_slot, within_upload_timeout};
use crate::request_slots::PollSlot;
use crate::secure;
use crate::state::AppState;
use crate::store::rounds::{ParticipantState, RoundState};
use crate::store::secagg::{
    self, MaskedUpload, QueuedWrite, SecureParticipant, SecureRound, SecureStage, StageWrite,
};

/// The message a device posts during `stage`: the one table the endpoint
/// lookups below are read from.
fn posted_message(stage: SecureStage) -> Stage {
    match stage {
        SecureStage::Advertise => Stage::AdvertiseKeys,
        SecureStage::Share => Stage::ShareKeys,
        SecureStage::Check => Stage::ShareReceipt,
        SecureStage::Collect => Stage::MaskedInput,
        SecureStage::Consistency => Stage::SurvivorSignature,
        SecureStage::Unmask => Stage::UnmaskResponse,
    }
}

/// The stage during which a device posts to `endpoint`.
fn posted_stage(endpoint: &str) -> ApiResult<SecureStage> {
    let posted_there = |stage: &SecureStage| endpoints::of(posted_message(*stage)) == endpoint;
    SecureStage::ALL
        .iter()
        .copied()
        .find(posted_there)
        .ok_or_else(|| unknown_endpoint(endpoint))
}

/// The stage from which `endpoint` can be fetched: the server's answer to
/// one stage's message, ready once the next stage has opened.
fn fetched_stage(endpoint: &str) -> ApiResult<SecureStage> {
    let answers = |stage: SecureStage| posted_message(stage).answer().map(endpoints::of);
    SecureStage::ALL
        .windows(2)
        .find(|pair| answers(pair[0]) == Some(endpoint))
        .map(|pair| pair[1])
        .ok_or_else(|| unknown_endpoint(endpoint))
}

/// Maps a refused protocol message to its HTTP answer.
fn refusal(error: SecAggError) -> ApiError {
    match error {
        SecAggError::OutOfOrder(message) => ApiError::conflict(message),
        other => ApiError::unprocessable(other.to_string()),
    }
}

fn unknown_endpoint(endpoint: &str) -> ApiError {
    let shown: String = endpoint.chars().take(64).collect();
    ApiError::not_found(format!("there is no secure-aggregation endpoint `{shown}`"))
}

async fn load(
    state: &AppState,
    round_id: i64,
    device_id: i64,
) -> ApiResult<(SecureRound, SecureParticipant)> {
    let not_secure =
        || ApiError::not_found(format!("round {round_id} does not run secure aggregation"));
    match secagg::round_and_participant(&state.db.pool, round_id, device_id).await? {
        Some((Some(round), participant)) => Ok((round, participant)),
        Some((None, _)) => Err(not_secure()),
        // Which is missing, the round or the device's place in it: a
        // second read, on this rare path only.
        None => match secagg::get(&state.db.pool, round_id).await? {
            None => Err(not_secure()),
            Some(_) => Err(ApiError::not_found(format!(
                "device {device_id} was not selected for round {round_id}"
            ))),
        },
    }
}

/// 410 when the round is over or the device was dropped from it.
fn check_live(round: &SecureRound, participant: &SecureParticipant) -> ApiResult<()> {
    if round.state != RoundState::Training {
        let reason = if round.status_message.is_empty() {
            String::new()
        } else {
            format!(": {}", round.status_message)
        };
        return Err(ApiError::gone(format!(
            "round {} is {}{reason}",
            round.id, round.state
        )));
    }
    if participant.state == ParticipantState::Dropped {
        return Err(ApiError::gone(format!(
            "device {} was dropped from round {}: it missed a stage deadline or declined",
            participant.device_id, round.id
        )));
    }
    if participant.state == ParticipantState::Ineligible {
        return Err(ApiError::gone(format!(
            "device {} withdrew from round {}: it no longer met the job's device policy",
            participant.device_id, round.id
        )));
    }
    Ok(())
}

/// Takes a device's stage message: 204. With `wait_ms`, the answer waits
/// for the server's next message to that device (NeighbourKeys after
/// AdvertiseKeys, and so on) and carries it with 200, which saves the
/// device the request that would fetch it; 204 still means "taken", when
/// it is not ready by then or cannot be built (the device then fetches it
/// and learns why).
pub async fn post_message(
    State(state): State<AppState>,
    device: DeviceAuth,
    slot: Option<Extension<PollSlot>>,
    Path((round_id, endpoint)): Path<(i64, String)>,
    Query(query): Query<PollQuery>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Response> {
    let open_stage = posted_stage(&endpoint)?;
    let message = posted_message(open_stage);
    let device_id = device.device_id;
    // Listening before the message is taken, so that a stage that closes
    // on it is never missed.
    let woken = state.secagg_progress.notified();
    let round = take_message(&state, device, round_id, open_stage, headers, body).await?;
    let taken = StatusCode::NO_CONTENT.into_response();
    let (Some(wait_ms), Some(answer)) = (query.wait_ms, message.answer()) else {
        return Ok(taken);
    };
    let wait = poll_wait(Some(wait_ms), state.settings.limits.long_poll_max_ms);
    let deadline = tokio::time::Instant::now() + wait;
    let endpoint = endpoints::of(answer);
    // The round was read just before the message was stored, in the stage
    // the message belongs to, so the answer (from the next stage) cannot
    // be ready: wait for the stage to move before reading the round again,
    // one read a message less.
    let moved = waiting(
        &state,
        slot.as_deref(),
        wait_for_progress(&state, &round, woken, deadline),
    );
    match moved.await {
        Ok(Ok(true)) => {}
        _ => return Ok(taken),
    }
    match await_message(
        &state,
        slot.as_deref(),
        round_id,
        device_id,
        endpoint,
        deadline,
    )
    .await
    {
        Ok(Some(answer)) => Ok(answer),
        Ok(None) | Err(_) => Ok(taken),
    }
}

/// Checks and stores a device's stage message; the round as it was read
/// before, in the message's stage. Whatever it holds (an upload slot for a
/// masked input) is released on return, before any wait.
async fn take_message(
    state: &AppState,
    device: DeviceAuth,
    round_id: i64,
    open_stage: SecureStage,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<SecureRound> {
    let message = posted_message(open_stage);
    let (round, participant) = load(state, round_id, device.device_id).await?;
    check_live(&round, &participant)?;
    let limit = message.max_bytes(round.plan.packed_bytes()) as u64;
    let what = format!("{} message", message.name());
    let _slot = match message {
        Stage::MaskedInput => Some(
            upload_slot(
                state,
                &state.upload_slots,
                Some((device.device_id, round_id)),
            )
            .await?,
        ),
        _ => None,
    };
    let read = device.read_message(&headers, body, limit, &what);
    let bytes = within_upload_timeout(state, &what, read).await?;
    if round.stage != open_stage {
        let (verb, code): (&str, fn(String) -> ApiError) = if round.stage > open_stage {
            ("is over", |m| ApiError::gone(m))
        } else {
            ("has not started", |m| ApiError::conflict(m))
        };
        return Err(code(format!(
            "{} for round {round_id} {verb}; the round is in stage `{}`",
            message.name(),
            round.stage
        )));
    }
    let device_id = device.device_id;
    check_sender(&round, &participant, open_stage)?;
    let stage_message = StageMessage {
        state,
        round: &round,
        sender: &participant,
        bytes: &bytes,
    };
    let write = match open_stage {
        SecureStage::Advertise => Some(stage_message.advertise()?),
        SecureStage::Share => Some(stage_message.share_keys().await?),
        SecureStage::Check => Some(stage_message.share_receipt().await?),
        SecureStage::Collect => {
            masked_input(state, &round, device_id, bytes.clone()).await?;
            None
        }
        SecureStage::Consistency => Some(stage_message.survivor_signature().await?),
        SecureStage::Unmask => Some(stage_message.unmask_response().await?),
    };
    if let Some(write) = write {
        save(state, &round, message, device_id, write, bytes.len()).await?;
    }
    tracing::debug!(
        round = round_id,
        device = device_id,
        stage = message.name(),
        "secure message taken"
    );
    state.orchestrator_wake.notify_one();
    Ok(round)
}

/// What a stage message asks of its sender, checked before the message
/// itself: that it did not send this stage's message before, and that it
/// sent the earlier one this message builds on (409 otherwise). A masked
/// input's fold checks both again under the round's lock.
fn check_sender(
    round: &SecureRound,
    participant: &SecureParticipant,
    stage: SecureStage,
) -> ApiResult<()> {
    let (device_id, message) = (participant.device_id, posted_message(stage));
    if stage.answered_by(participant) {
        return Err(duplicate(message, round, device_id));
    }
    match stage.builds_on() {
        Some(earlier) if !earlier.answered_by(participant) => Err(ApiError::conflict(format!(
            "device {device_id} sent no {} message in round {}, and its {} message builds on it",
            posted_message(earlier).name(),
            round.id,
            message.name()
        ))),
        _ => Ok(()),
    }
}

fn duplicate(message: Stage, round: &SecureRound, device_id: i64) -> ApiError {
    ApiError::conflict(format!(
        "device {device_id} already sent its {} message for round {}",
        message.name(),
        round.id
    ))
}

/// A conditional write that changed nothing: another request of the same
/// device won the race, or the stage closed between the check and the write.
fn not_taken(message: Stage, round: &SecureRound, device_id: i64) -> ApiError {
    ApiError::conflict(format!(
        "device {device_id}'s {} message for round {} was not taken: it already sent one, or \
         the stage closed meanwhile",
        message.name(),
        round.id
    ))
}

/// The neighbours of `device_id` that advertised keys: the set it was sent
/// in NeighbourKeys and must address shares to. From ShareKeys on.
async fn advertised_neighbours(
    state: &AppState,
    round: &SecureRound,
    device_id: i64,
) -> ApiResult<Vec<SecureParticipant>> {
    let rows = secure::cached_key_rows(state, round).await?;
    let neighbours = neighbour_rows(state, round, &rows, device_id).await?;
    Ok(neighbours
        .into_iter()
        .filter(|p| p.secagg_keys.is_some())
        .collect())
}

/// The rows of a device's graph neighbours, from a round's cached `rows`.
async fn neighbour_rows(
    state: &AppState,
    round: &SecureRound,
    rows: &[SecureParticipant],
    device_id: i64,
) -> ApiResult<Vec<SecureParticipant>> {
    let graph = secure::cached_graph(state, round).await?;
    let neighbours = graph.neighbours(device_id as u64).unwrap_or_default();
    Ok(secure::rows_among(rows, &neighbours))
}

/// A device's stage message, read and its sender checked, with what
/// checking its contents needs. Each method below parses a message of one
/// stage with `canopy_protocol::secagg` into the write that stores it
/// ([`take_message`] saves it); a masked input is folded instead
/// ([`masked_input`]).
struct StageMessage<'a> {
    state: &'a AppState,
    round: &'a SecureRound,
    sender: &'a SecureParticipant,
    bytes: &'a [u8],
}

impl StageMessage<'_> {
    /// Parses the message with `read`, which is given its bytes, the
    /// round's session and the sender; 409 or 422 when it is refused.
    fn read<T>(
        &self,
        read: impl FnOnce(&[u8], Session, u64) -> Result<T, SecAggError>,
    ) -> ApiResult<T> {
        let sender = self.sender.device_id as u64;
        read(self.bytes, secure::session(self.round), sender).map_err(refusal)
    }

    fn advertise(&self) -> ApiResult<StageWrite> {
        let key = enrolled_key(self.sender)?;
        let advertisement = self.read(|bytes, session, id| {
            secagg_server::read_advertisement(bytes, session, id, &key)
        })?;
        let keys = secure::keys_bytes(&advertisement);
        Ok(StageWrite::Keys {
            device_id: self.sender.device_id,
            keys,
        })
    }

    /// Shares addressed to exactly the neighbours that advertised keys.
    async fn share_keys(&self) -> ApiResult<StageWrite> {
        let device_id = self.sender.device_id;
        let recipients: BTreeSet<u64> = advertised_neighbours(self.state, self.round, device_id)
            .await?
            .iter()
            .map(|p| p.device_id as u64)
            .collect();
        let upload = self.read(|bytes, session, id| {
            secagg_server::read_share_keys(bytes, session, id, &recipients)
        })?;
        let ciphertexts = upload.ciphertexts.iter();
        Ok(StageWrite::Shares {
            device_id,
            commitment: upload.seed_commitment,
            ciphertexts: ciphertexts.map(|(to, c)| (*to, c.to_vec())).collect(),
        })
    }

    /// A ShareCheck receipt: at most k - t of the device's graph
    /// neighbours, which the stage's close excludes.
    async fn share_receipt(&self) -> ApiResult<StageWrite> {
        let device_id = self.sender.device_id;
        let graph = secure::cached_graph(self.state, self.round).await?;
        let neighbours = graph.neighbours(device_id as u64).unwrap_or_default();
        let (neighbours, plan) = (neighbours.into_iter().collect(), &self.round.plan);
        let reported = self.read(|bytes, session, id| {
            secagg_server::read_share_receipt(bytes, session, id, &neighbours, plan)
        })?;
        Ok(StageWrite::Receipt {
            device_id,
            reported,
        })
    }

    /// A survivor's signature of the set the round holds, checked here so
    /// that no neighbour is ever sent a bad one.
    async fn survivor_signature(&self) -> ApiResult<StageWrite> {
        let survivors = secure::cached_survivors(self.state, self.round).await?;
        let key = enrolled_key(self.sender)?;
        let signature = self.read(|bytes, session, id| {
            secagg_server::read_survivor_signature(bytes, session, id, &key, &survivors)
        })?;
        Ok(StageWrite::Signature {
            device_id: self.sender.device_id,
            signature,
        })
    }

    /// A survivor's revealed shares, for exactly its neighbours among the
    /// survivors and the dropouts.
    async fn unmask_response(&self) -> ApiResult<StageWrite> {
        let device_id = self.sender.device_id;
        let (survivors, dropped) = unmask_sets(self.state, self.round, device_id).await?;
        self.read(|bytes, session, id| {
            secagg_server::read_unmask_response(bytes, session, id, &survivors, &dropped)
        })?;
        Ok(StageWrite::Reveal {
            device_id,
            reveal: self.bytes.to_vec(),
        })
    }
}

async fn masked_input(
    state: &AppState,
    round: &SecureRound,
    device_id: i64,
    bytes: Bytes,
) -> ApiResult<()> {
    let upload = MaskedUpload {
        device_id,
        message: bytes,
    };
    let rejection = match folds::submit(state, round.id, upload).await {
        Ok(accepted) => {
            tracing::info!(
                round = round.id,
                device = device_id,
                accepted,
                "masked input folded"
            );
            return Ok(());
        }
        Err(FoldError::Failed(error)) => return Err(error),
        Err(FoldError::Refused(rejection)) => rejection,
    };
    Err(match rejection {
        secagg::MaskedRejection::Refused(error) => error,
        secagg::MaskedRejection::Duplicate => duplicate(Stage::MaskedInput, round, device_id),
        secagg::MaskedRejection::Closed => ApiError::gone(format!(
            "round {} no longer collects masked inputs",
            round.id
        )),
        secagg::MaskedRejection::NotEligible => ApiError::conflict(format!(
            "device {device_id} did not complete ShareKeys in round {}, or was dropped",
            round.id
        )),
    })
}

/// Masked inputs fold a batch per transaction, like plain updates: the
/// masked sum is decoded and rewritten once per batch. Checking and adding
/// a message is a few milliseconds per million values, under the round's
/// lock.
impl Foldable for MaskedUpload {
    type Refusal = secagg::MaskedRejection<ApiError>;

    fn queue(state: &AppState) -> &FoldQueue<Self> {
        &state.masked_folds
    }

    async fn fold_batch(
        state: &AppState,
        round_id: i64,
        batch: Vec<Self>,
    ) -> Result<Vec<Result<u64, Self::Refusal>>, sqlx::Error> {
        let Some(round) = secagg::get(&state.db.pool, round_id).await? else {
            return Ok(batch
                .iter()
                .map(|_| Err(secagg::MaskedRejection::Closed))
                .collect());
        };
        let (session, plan) = (secure::session(&round), &round.plan);
        secagg::fold_masked_batch(
            &state.db,
            round_id,
            &batch,
            |stored| secure::decode_masked_sum(stored.as_deref().unwrap_or_default(), plan),
            |sum, upload| {
                let sender = upload.device_id as u64;
                secagg_server::fold_masked_input(sum, &upload.message, session, sender, plan)
                    .map_err(refusal)
            },
            |sum| secure::encode_masked_sum(sum),
        )
        .await
    }
}

/// A value this server checked and stored at its size, read back; a 500
/// naming it when the database holds something else.
fn stored<const N: usize>(bytes: &[u8], device_id: impl Display, what: &str) -> ApiResult<[u8; N]> {
    bytes.try_into().map_err(|_| {
        ApiError::internal(format!(
            "device {device_id}'s stored {what} is not {N} bytes"
        ))
    })
}

fn enrolled_key(participant: &SecureParticipant) -> ApiResult<[u8; 32]> {
    stored(&participant.public_key, participant.device_id, "key")
}

/// A neighbour as NeighbourKeys lists it: its advertised keys, the enrolled
/// key that signed them and the authority's certificate (zeros if none).
fn neighbour_entry(participant: &SecureParticipant) -> ApiResult<secagg_server::NeighbourEntry> {
    let device_id = participant.device_id;
    let advertisement = participant
        .secagg_keys
        .as_deref()
        .and_then(secure::advertisement)
        .ok_or_else(|| {
            ApiError::internal(format!(
                "device {device_id}'s stored advertisement is malformed"
            ))
        })?;
    let certificate = match participant.certificate.as_deref() {
        Some(bytes) => stored(bytes, device_id, "certificate")?,
        None => device_cert::NO_CERTIFICATE,
    };
    Ok(secagg_server::NeighbourEntry {
        id: participant.device_id as u64,
        device_key: enrolled_key(participant)?,
        certificate,
        advertisement,
    })
}

/// Queues a device's message for the round's next group commit and waits
/// for it: 409 if it was not taken.
async fn save(
    state: &AppState,
    round: &SecureRound,
    message: Stage,
    device_id: i64,
    write: StageWrite,
    message_bytes: usize,
) -> ApiResult<()> {
    let queued = QueuedWrite {
        write,
        message_bytes: message_bytes as u64,
    };
    match folds::submit(state, round.id, queued).await {
        Ok(_) => Ok(()),
        Err(FoldError::Refused(NotTaken)) => Err(not_taken(message, round, device_id)),
        Err(FoldError::Failed(error)) => Err(error),
    }
}

/// Counts a server message against the round's traffic, in the round's
/// next group commit.
async fn count_sent(state: &AppState, round_id: i64, bytes: usize) -> ApiResult<()> {
    let queued = QueuedWrite {
        write: StageWrite::Sent {
            bytes: bytes as u64,
        },
        message_bytes: 0,
    };
    match folds::submit(state, round_id, queued).await {
        Ok(_) | Err(FoldError::Refused(NotTaken)) => Ok(()),
        Err(FoldError::Failed(error)) => Err(error),
    }
}

/// A stage write that changed nothing.
pub struct NotTaken;

/// Stage messages commit a batch per transaction, like updates: one
/// write transaction (and one fsync) per batch instead of per message.
impl Foldable for QueuedWrite {
    type Refusal = NotTaken;

    fn queue(state: &AppState) -> &FoldQueue<Self> {
        &state.stage_writes
    }

    async fn fold_batch(
        state: &AppState,
        round_id: i64,
        batch: Vec<Self>,
    ) -> Result<Vec<Result<u64, NotTaken>>, sqlx::Error> {
        let taken = secagg::save_stage_writes(&state.db, round_id, &batch).await?;
        Ok(taken
            .into_iter()
            .map(|taken| if taken { Ok(0) } else { Err(NotTaken) })
            .collect())
    }
}

/// The survivors and dropouts a survivor is asked about.
async fn unmask_sets(
    state: &AppState,
    round: &SecureRound,
    device_id: i64,
) -> ApiResult<(BTreeSet<u64>, BTreeSet<u64>)> {
    let rows = secure::cached_unmask_rows(state, round).await?;
    let neighbours = neighbour_rows(state, round, &rows, device_id).await?;
    Ok(secure::unmask_sets_of(&neighbours))
}

pub async fn get_message(
    State(state): State<AppState>,
    device: DeviceAuth,
    slot: Option<Extension<PollSlot>>,
    Path((round_id, endpoint)): Path<(i64, String)>,
    Query(query): Query<PollQuery>,
) -> ApiResult<Response> {
    let wait = poll_wait(query.wait_ms, state.settings.limits.long_poll_max_ms);
    let deadline = tokio::time::Instant::now() + wait;
    let answer = await_message(
        &state,
        slot.as_deref(),
        round_id,
        device.device_id,
        &endpoint,
        deadline,
    )
    .await?;
    Ok(answer.unwrap_or_else(|| StatusCode::ACCEPTED.into_response()))
}

/// The server's message at `endpoint` for the device (200), once the stage
/// that produces it has closed; `None` if that is not by `deadline`.
async fn await_message(
    state: &AppState,
    slot: Option<&PollSlot>,
    round_id: i64,
    device_id: i64,
    endpoint: &str,
    deadline: tokio::time::Instant,
) -> ApiResult<Option<Response>> {
    let ready_stage = fetched_stage(endpoint)?;
    loop {
        let woken = state.secagg_progress.notified();
        let (round, participant) = load(state, round_id, device_id).await?;
        check_live(&round, &participant)?;
        if round.stage >= ready_stage {
            let body = build_message(state, &round, &participant, endpoint).await?;
            count_sent(state, round_id, body.len()).await?;
            let response = (
                StatusCode::OK,
                [(header::CONTENT_TYPE, "application/octet-stream")],
                body,
            );
            return Ok(Some(response.into_response()));
        }
        if !waiting(
            state,
            slot,
            wait_for_progress(state, &round, woken, deadline),
        )
        .await??
        {
            return Ok(None);
        }
    }
}

/// Waits until this process is told that rounds moved, a re-check finds
/// that this one did (another server process may have moved it), or
/// `deadline`. False at the deadline or on shutdown. The re-checks read
/// the snapshot every poll of this process shares.
async fn wait_for_progress(
    state: &AppState,
    round: &SecureRound,
    woken: tokio::sync::futures::Notified<'_>,
    deadline: tokio::time::Instant,
) -> ApiResult<bool> {
    let seen = secure::Progress::of(round);
    let interval = std::time::Duration::from_millis(POLL_RECHECK_MS);
    tokio::pin!(woken);
    loop {
        let now = tokio::time::Instant::now();
        if now >= deadline || state.is_shutting_down() {
            return Ok(false);
        }
        tokio::select! {
            _ = &mut woken => return Ok(true),
            _ = tokio::time::sleep_until((now + interval).min(deadline)) => {}
        }
        let current = state
            .secure_progress
            .read(&state.db, round.id, interval)
            .await?;
        if current != Some(seen) {
            return Ok(true);
        }
    }
}

async fn build_message(
    state: &AppState,
    round: &SecureRound,
    participant: &SecureParticipant,
    endpoint: &str,
) -> ApiResult<Vec<u8>> {
    let device_id = participant.device_id;
    let session = secure::session(round);
    match endpoint {
        endpoints::NEIGHBOUR_KEYS => {
            let neighbours = advertised_neighbours(state, round, device_id).await?;
            let entries = neighbours
                .iter()
                .map(neighbour_entry)
                .collect::<ApiResult<Vec<_>>>()?;
            let graph = secure::cached_graph(state, round).await?;
            let seed = round.seed.ok_or_else(|| {
                ApiError::gone(format!(
                    "round {} has ended; its graph is deleted",
                    round.id
                ))
            })?;
            Ok(secagg_server::neighbour_keys_message(
                session,
                device_id as u64,
                &seed,
                graph.participants(),
                &entries,
            ))
        }
        endpoints::INCOMING_SHARES => {
            if participant.secagg_commitment.is_none() {
                return Err(ApiError::gone(format!(
                    "device {device_id} did not complete ShareKeys in round {}",
                    round.id
                )));
            }
            let rows = secagg::incoming_shares(&state.db, round.id, device_id).await?;
            let shares = rows
                .into_iter()
                .map(|(from, share)| Ok((from, stored(&share, from, "share")?)))
                .collect::<ApiResult<Vec<_>>>()?;
            Ok(secagg_server::incoming_shares_message(
                session,
                device_id as u64,
                &shares,
            ))
        }
        endpoints::EXCLUSIONS => {
            let excluded = secure::cached_exclusions(state, round).await?;
            let graph = secure::cached_graph(state, round).await?;
            let neighbours = graph.neighbours(device_id as u64).unwrap_or_default();
            let excluded_neighbours = neighbours
                .into_iter()
                .filter(|id| excluded.contains(id))
                .collect();
            Ok(secagg_server::exclusions_message(
                session,
                device_id as u64,
                &excluded_neighbours,
            ))
        }
        endpoints::SURVIVOR_SET => {
            check_survivor(round, participant)?;
            let survivors = secure::cached_survivors(state, round).await?;
            Ok(secagg_server::survivor_set_message(
                session,
                device_id as u64,
                &survivors,
            ))
        }
        _ => {
            check_survivor(round, participant)?;
            let rows = secure::cached_unmask_rows(state, round).await?;
            let neighbours = neighbour_rows(state, round, &rows, device_id).await?;
            let signatures = neighbours
                .iter()
                .filter_map(|p| Some((p.device_id as u64, p.secagg_signature.as_deref()?)))
                .map(|(id, signature)| Ok((id, stored(signature, id, "signature")?)))
                .collect::<ApiResult<Vec<_>>>()?;
            Ok(secagg_server::unmask_request_message(
                session,
                device_id as u64,
                &signatures,
            ))
        }
    }
}

/// 410 for a device whose masked input is not in the sum: it has no part
/// in ConsistencyCheck or Unmasking.
fn check_survivor(round: &SecureRound, participant: &SecureParticipant) -> ApiResult<()> {
    if participant.state != ParticipantState::Uploaded {
        return Err(ApiError::gone(format!(
            "device {} sent no masked input in round {}",
            participant.device_id, round.id
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_endpoint_belongs_to_its_stage() {
        use SecureStage::*;
        let fetched = [
            (endpoints::NEIGHBOUR_KEYS, Share),
            (endpoints::INCOMING_SHARES, Check),
            (endpoints::EXCLUSIONS, Collect),
            (endpoints::SURVIVOR_SET, Consistency),
            (endpoints::UNMASK_REQUEST, Unmask),
        ];
        for (endpoint, stage) in fetched {
            assert_eq!(fetched_stage(endpoint).ok(), Some(stage), "{endpoint}");
            assert!(posted_stage(endpoint).is_err(), "{endpoint} is posted");
        }
        assert_eq!(posted_stage(endpoints::SHARE_RECEIPT).ok(), Some(Check));
        assert_eq!(posted_stage(endpoints::UNMASK_RESPONSE).ok(), Some(Unmask));
        assert!(fetched_stage(endpoints::MASKED_INPUT).is_err());
    }
}
