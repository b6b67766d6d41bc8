//! Secure rounds (SecAgg+), on top of the durable round state.
//!
//! A secure round is `training` while its `secagg_stage` walks through
//! advertise → share → check → collect → consistency → unmask. Each stage
//! closes when every live participant has answered or its deadline passes;
//! whoever has not answered a key stage or sent its masked input by then is
//! dropped. Closing ShareCheck also excludes every device a neighbour
//! reported it could not open the shares of ([`excluded_by_receipts`]), as
//! if it had never shared
//! (a survivor that misses ConsistencyCheck or Unmasking stays in the sum), and the round fails as soon as more devices
//! have dropped out than the plan tolerates. Closing Unmasking rebuilds the
//! survivors' self-mask seeds and the dropouts' mask keys, removes every
//! mask from the running sum, and leaves the round `aggregating` with the
//! same Σwᵢ·Δᵢ and Σwᵢ a plain round keeps, for [`crate::orchestrator`] to
//! turn into the next model version.
//!
//! The protocol's messages are checked by `canopy_protocol::secagg`; this
//! module decides when stages close and what each device is sent.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use canopy_protocol::secagg::graph::Graph;
use canopy_protocol::secagg::server::{
    self as secagg_server, Advertisement, DroppedPeer, UnmaskBook,
};
use canopy_protocol::secagg::wire::Stage;
use canopy_protocol::secagg::{Plan, SecAggError, Session, arith};

use crate::db::{Db, now_ms};
use crate::fedavg;
use crate::round_failure::RoundFailure;
use crate::state::AppState;
use crate::store::jobs::JobSpec;
use crate::store::rounds::{self, ParticipantState, RoundRow, RoundState, Tx};
use crate::store::secagg::{self, SecureParticipant, SecureRound, SecureStage};
use canopy_term::error_chain as chain;

/// Why a secure round's state could not be read or advanced. A reason to
/// fail the round is not one of these: it is recorded on the round.
#[derive(Debug, thiserror::Error)]
pub enum SecureError {
    #[error("round {round} has ended; its graph is deleted")]
    Ended { round: i64 },
    #[error("round {round}'s graph cannot be built from its stored seed and participants")]
    Graph {
        round: i64,
        #[source]
        source: SecAggError,
    },
    #[error("the unmasking task of round {round} stopped before it finished")]
    Task {
        round: i64,
        #[source]
        source: tokio::task::JoinError,
    },
    #[error("the database failed while advancing a secure round")]
    Database(#[from] sqlx::Error),
}

/// Bytes of a stored advertisement: channel key, mask key, signature.
pub const KEYS_BYTES: usize = 32 + 32 + 64;

pub fn session(round: &SecureRound) -> Session {
    Session {
        job_id: round.job_id as u64,
        round_id: round.id as u64,
    }
}

pub fn graph(round: &SecureRound, participant_ids: &[u64]) -> Result<Graph, SecureError> {
    let seed = round.seed.ok_or(SecureError::Ended { round: round.id })?;
    Graph::new(&seed, participant_ids, round.plan.degree).map_err(|source| SecureError::Graph {
        round: round.id,
        source,
    })
}

/// How an advertisement is stored: channel key, mask key, signature.
pub fn keys_bytes(advertisement: &Advertisement) -> Vec<u8> {
    let mut keys = Vec::with_capacity(KEYS_BYTES);
    keys.extend_from_slice(&advertisement.channel_key);
    keys.extend_from_slice(&advertisement.mask_key);
    keys.extend_from_slice(&advertisement.signature);
    keys
}

/// The inverse of [`keys_bytes`].
pub fn advertisement(keys: &[u8]) -> Option<Advertisement> {
    if keys.len() != KEYS_BYTES {
        return None;
    }
    Some(Advertisement {
        channel_key: keys[..32].try_into().ok()?,
        mask_key: keys[32..64].try_into().ok()?,
        signature: keys[64..].try_into().ok()?,
    })
}

/// The round's graph and who got how far, from the participant rows: what
/// both the device API and unmasking decide from.
pub struct RoundGraph {
    pub graph: Graph,
    /// Devices that completed ShareKeys (dropped since or not).
    pub shared: BTreeSet<u64>,
    /// Devices whose masked input is in the sum.
    pub survivors: BTreeSet<u64>,
}

impl RoundGraph {
    pub fn build(
        round: &SecureRound,
        participants: &[SecureParticipant],
    ) -> Result<RoundGraph, SecureError> {
        let ids: Vec<u64> = participants.iter().map(|p| p.device_id as u64).collect();
        let ids_where = |keep: fn(&SecureParticipant) -> bool| {
            participants
                .iter()
                .filter(|p| keep(p))
                .map(|p| p.device_id as u64)
                .collect()
        };
        Ok(RoundGraph {
            graph: graph(round, &ids)?,
            shared: ids_where(|p| p.secagg_commitment.is_some()),
            survivors: ids_where(|p| p.state == ParticipantState::Uploaded),
        })
    }

    /// [`unmask_sets`] from the whole round's rows.
    pub fn unmask_sets(&self, device: u64) -> (BTreeSet<u64>, BTreeSet<u64>) {
        let neighbours = self.graph.neighbours(device).unwrap_or_default();
        unmask_sets(
            neighbours
                .into_iter()
                .map(|n| (n, self.shared.contains(&n), self.survivors.contains(&n))),
        )
    }
}

/// What a survivor is asked to reveal, given each neighbour as (id, shared
/// keys, survived): the self-mask seed share of each that survived, the
/// mask-key share of each that shared keys but sent no masked input.
/// (survivors, dropouts).
pub fn unmask_sets(
    neighbours: impl IntoIterator<Item = (u64, bool, bool)>,
) -> (BTreeSet<u64>, BTreeSet<u64>) {
    let (mut survivors, mut dropouts) = (BTreeSet::new(), BTreeSet::new());
    for (id, _, survived) in neighbours.into_iter().filter(|&(_, shared, _)| shared) {
        if survived {
            survivors.insert(id);
        } else {
            dropouts.insert(id);
        }
    }
    (survivors, dropouts)
}

/// [`unmask_sets`] from the neighbours' own rows.
pub fn unmask_sets_of(neighbours: &[SecureParticipant]) -> (BTreeSet<u64>, BTreeSet<u64>) {
    unmask_sets(neighbours.iter().map(|p| {
        (
            p.device_id as u64,
            p.secagg_commitment.is_some(),
            p.state == ParticipantState::Uploaded,
        )
    }))
}

/// What the device API derives once per secure round and keeps: building
/// it per request read every participant's row for every request, O(n²)
/// rows a stage. Keyed by the round and its seed, so that a round that
/// starts over (a new seed) is never served an old value; the oldest are
/// let go past [`MAX_CACHED_ROUNDS`].
pub struct RoundCache<T> {
    entries: std::sync::Mutex<std::collections::VecDeque<(RoundKey, Arc<T>)>>,
    /// Rounds kept at most.
    capacity: usize,
    /// Held while a value is built, so that requests that miss together
    /// (every waiting device wakes when a stage opens) wait for one build
    /// instead of each reading the database.
    building: tokio::sync::Mutex<()>,
}

impl<T> Default for RoundCache<T> {
    fn default() -> Self {
        RoundCache::with_capacity(MAX_CACHED_ROUNDS)
    }
}

/// A round and its graph seed.
type RoundKey = (i64, [u8; 32]);

/// Rounds whose values are kept: more than the secure rounds one server
/// runs at once; a graph is 16 bytes a participant, a survivor set 8.
pub const MAX_CACHED_ROUNDS: usize = 64;

/// Rounds whose participant rows are kept ([`cached_key_rows`],
/// [`cached_unmask_rows`]): a row is a few hundred bytes, so at 100,000
/// participants a round's rows take tens of megabytes.
pub const MAX_CACHED_ROW_ROUNDS: usize = 4;

impl<T> RoundCache<T> {
    pub fn with_capacity(capacity: usize) -> Self {
        RoundCache {
            entries: Default::default(),
            capacity: capacity.max(1),
            building: Default::default(),
        }
    }

    /// The round's value, built by `build` the first time. Build only what
    /// is fixed from the round's current stage on.
    pub async fn get<F>(&self, round: &SecureRound, build: F) -> Result<Arc<T>, SecureError>
    where
        F: std::future::Future<Output = Result<T, SecureError>>,
    {
        let seed = round.seed.ok_or(SecureError::Ended { round: round.id })?;
        let key = (round.id, seed);
        if let Some(value) = self.lookup(&key) {
            return Ok(value);
        }
        let _building = self.building.lock().await;
        if let Some(value) = self.lookup(&key) {
            return Ok(value);
        }
        let built = Arc::new(build.await?);
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        entries.push_back((key, built.clone()));
        while entries.len() > self.capacity {
            entries.pop_front();
        }
        Ok(built)
    }

    fn lookup(&self, key: &RoundKey) -> Option<Arc<T>> {
        let entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        entries
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
    }
}

/// Where a secure round stands: what a waiting long poll watches for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Progress {
    pub state: RoundState,
    pub stage: SecureStage,
    pub seed: Option<[u8; 32]>,
}

impl Progress {
    pub fn of(round: &SecureRound) -> Progress {
        Progress {
            state: round.state,
            stage: round.stage,
            seed: round.seed,
        }
    }
}

/// Each secure round's [`Progress`] as last read by any long poll in this
/// process. Between wake-ups a waiting poll re-reads the round, to see
/// stages that another server process closed; read here, 1,000 devices
/// waiting on one stage cost one database read per interval instead of
/// 1,000 (each a hand-off to the database's worker thread: at N = 1,000
/// the re-checks were about a quarter of a secure round's extra server
/// CPU).
#[derive(Default)]
pub struct ProgressSnapshots {
    entries: std::sync::Mutex<HashMap<i64, (Option<Progress>, std::time::Instant)>>,
    /// Held while one poll reads a stale round, so the others that woke
    /// at the same moment wait for its answer instead of reading too.
    refreshing: tokio::sync::Mutex<()>,
}

impl ProgressSnapshots {
    /// The round's progress, read at most `max_age` ago; `None` when it is
    /// not a secure round.
    pub async fn read(
        &self,
        db: &Db,
        round_id: i64,
        max_age: std::time::Duration,
    ) -> Result<Option<Progress>, sqlx::Error> {
        if let Some(progress) = self.fresh(round_id, max_age) {
            return Ok(progress);
        }
        let _refreshing = self.refreshing.lock().await;
        if let Some(progress) = self.fresh(round_id, max_age) {
            return Ok(progress);
        }
        let progress = secagg::get(&db.pool, round_id)
            .await?
            .map(|round| Progress::of(&round));
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        if entries.len() >= MAX_CACHED_ROUNDS {
            entries.retain(|_, (_, read)| read.elapsed() < max_age);
        }
        entries.insert(round_id, (progress, std::time::Instant::now()));
        Ok(progress)
    }

    fn fresh(&self, round_id: i64, max_age: std::time::Duration) -> Option<Option<Progress>> {
        let entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        let (progress, read) = entries.get(&round_id)?;
        (read.elapsed() < max_age).then_some(*progress)
    }
}

/// The round's graph, fixed once its participants are selected.
pub async fn cached_graph(
    state: &AppState,
    round: &SecureRound,
) -> Result<Arc<Graph>, SecureError> {
    let build = async {
        let ids = secagg::participant_ids(&state.db.pool, round.id).await?;
        graph(round, &ids)
    };
    state.secure_graphs.get(round, build).await
}

/// Every participant's row as it stands once ShareKeys has opened, by
/// device id, for what is fixed from then on: the advertised keys, the
/// enrolled key and its certificate. NeighbourKeys and the check of a
/// device's ShareKeys read their k neighbours here; read from the
/// database per request, those k-row reads were the server's largest
/// secure-only share of SQLite's time at N = 100 (437 reads of 22 rows).
pub async fn cached_key_rows(
    state: &AppState,
    round: &SecureRound,
) -> Result<Arc<Vec<SecureParticipant>>, SecureError> {
    debug_assert!(round.stage >= SecureStage::Share);
    let build = async { Ok(stage_rows(state, round).await?) };
    state.secure_key_rows.get(round, build).await
}

/// Every participant's row as it stands once Unmasking has opened, for
/// what is fixed from then on: who shared keys, who survived, and the
/// ConsistencyCheck signatures.
pub async fn cached_unmask_rows(
    state: &AppState,
    round: &SecureRound,
) -> Result<Arc<Vec<SecureParticipant>>, SecureError> {
    debug_assert!(round.stage >= SecureStage::Unmask);
    let build = async { Ok(stage_rows(state, round).await?) };
    state.secure_unmask_rows.get(round, build).await
}

/// The round's rows, by device id, without the revealed shares (which
/// Unmasking is still writing, and which no cached use reads).
async fn stage_rows(
    state: &AppState,
    round: &SecureRound,
) -> Result<Vec<SecureParticipant>, sqlx::Error> {
    let mut rows = secagg::participants(&state.db.pool, round.id).await?;
    for row in &mut rows {
        row.secagg_reveal = None;
    }
    Ok(rows)
}

/// The rows of `ids` among rows sorted by device id, in device order (as
/// a query ordered by device would give them).
pub fn rows_among(rows: &[SecureParticipant], ids: &[u64]) -> Vec<SecureParticipant> {
    let mut found: Vec<SecureParticipant> = ids
        .iter()
        .filter_map(|&id| {
            let at = rows
                .binary_search_by_key(&(id as i64), |row| row.device_id)
                .ok()?;
            Some(rows[at].clone())
        })
        .collect();
    found.sort_by_key(|row| row.device_id);
    found
}

/// The survivor set, fixed once MaskedInputCollection has closed: call it
/// from ConsistencyCheck on.
pub async fn cached_survivors(
    state: &AppState,
    round: &SecureRound,
) -> Result<Arc<Vec<u64>>, SecureError> {
    debug_assert!(round.stage >= SecureStage::Consistency);
    let build = async { Ok(secagg::survivor_ids(&state.db, round.id).await?) };
    state.secure_survivors.get(round, build).await
}

/// Whether a selected round could be made secure.
pub enum Begun {
    Started,
    /// The selected devices do not fit the job's tolerances: the cause to
    /// fail the round with.
    Refused(RoundFailure),
}

/// Makes a freshly selected round secure with its `plan`
/// ([`JobSpec::round_plan`]), or the reason there is none: AdvertiseKeys
/// opens.
pub async fn begin(
    state: &AppState,
    tx: &mut Tx<'_>,
    round_id: i64,
    plan: Result<Plan, SecAggError>,
) -> Result<Begun, SecureError> {
    let mut seed = [0u8; 32];
    rand::RngCore::fill_bytes(&mut rand::rng(), &mut seed);
    // Committed before any device has made its keys: devices check the
    // seed they are later sent against it.
    let plan = match plan {
        Ok(plan) => plan.commit_graph(&seed),
        Err(error) => return Ok(Begun::Refused(RoundFailure::SecurePlan(error))),
    };
    let deadline = now_ms() + stage_timeout_ms(state);
    secagg::begin(tx, round_id, &plan, &seed, deadline).await?;
    tracing::info!(
        round = round_id,
        participants = plan.participants,
        degree = plan.degree,
        threshold = plan.threshold,
        bits = plan.bits,
        max_dropouts = plan.max_dropouts,
        "secure round: AdvertiseKeys open"
    );
    Ok(Begun::Started)
}

fn stage_timeout_ms(state: &AppState) -> i64 {
    i64::try_from(state.settings.limits.secagg_stage_timeout_ms).unwrap_or(i64::MAX / 4)
}

/// What advancing a secure round did.
pub enum Advanced {
    /// Nothing to do yet, or a stage closed and the round goes on.
    Waiting { stage_changed: bool },
    /// The round failed, with the reason recorded.
    Failed,
    /// The aggregate is unmasked; the round is `aggregating`.
    Unmasked,
}

/// Closes the current stage if it is complete or past its deadline.
pub async fn advance(
    state: &AppState,
    tx: &mut Tx<'_>,
    round: &RoundRow,
    spec: &JobSpec,
) -> Result<Advanced, SecureError> {
    let Some(secure) = secagg::get(&mut **tx, round.id).await? else {
        return Ok(Advanced::Waiting {
            stage_changed: false,
        });
    };
    let participants = secagg::participants(&mut **tx, round.id).await?;
    let all_answered = participants
        .iter()
        .filter(|p| !p.state.has_left())
        .all(|p| secure.stage.answered_by(p));
    if !all_answered && now_ms() < stage_deadline_ms(&secure) {
        return Ok(Advanced::Waiting {
            stage_changed: false,
        });
    }
    match close_stage(state, tx, &secure, &participants).await? {
        StageClosed::Next(next) => {
            tracing::info!(round = round.id, stage = %next, "secure round: stage open");
            Ok(Advanced::Waiting {
                stage_changed: true,
            })
        }
        StageClosed::Unmasked => Ok(Advanced::Unmasked),
        StageClosed::Failed(failure) => {
            tracing::warn!(round = round.id, stage = %secure.stage, "secure round failed");
            let max_retries = i64::from(spec.max_round_retries);
            failure.record(tx, round, max_retries).await?;
            Ok(Advanced::Failed)
        }
    }
}

/// When the round's current stage closes whoever has answered:
/// MaskedInputCollection includes training, so it runs to the round's
/// deadline; the key stages have their own.
fn stage_deadline_ms(secure: &SecureRound) -> i64 {
    if secure.stage == SecureStage::Collect {
        secure.deadline_ms
    } else {
        secure.stage_deadline_ms
    }
}

/// Whether [`advance`] could move the round now, read without the write
/// lock or any participant's row: false only while a secure round's stage
/// still waits for answers before its deadline. Every stage message wakes
/// the orchestrator; without this each wake took the write lock and read
/// every participant, so devices' writes queued behind N reads of N rows.
/// `advance` decides again under the lock, from the rows.
pub async fn may_advance(db: &Db, round: &SecureRound) -> Result<bool, SecureError> {
    if round.state != RoundState::Training || now_ms() >= stage_deadline_ms(round) {
        return Ok(true);
    }
    Ok(secagg::unanswered(&db.pool, round.id, round.stage).await? == 0)
}

/// What closing a stage did.
enum StageClosed {
    /// The next stage is open.
    Next(SecureStage),
    /// Unmasking closed: the aggregate is stored.
    Unmasked,
    /// The round fails, for this cause.
    Failed(RoundFailure),
}

/// The message a stage waits for, and the stage after it.
fn stage_message(stage: SecureStage) -> (Stage, Option<SecureStage>) {
    match stage {
        SecureStage::Advertise => (Stage::AdvertiseKeys, Some(SecureStage::Share)),
        SecureStage::Share => (Stage::ShareKeys, Some(SecureStage::Check)),
        SecureStage::Check => (Stage::ShareReceipt, Some(SecureStage::Collect)),
        SecureStage::Collect => (Stage::MaskedInput, Some(SecureStage::Consistency)),
        SecureStage::Consistency => (Stage::SurvivorSignature, Some(SecureStage::Unmask)),
        SecureStage::Unmask => (Stage::UnmaskResponse, None),
    }
}

async fn close_stage(
    state: &AppState,
    tx: &mut Tx<'_>,
    secure: &SecureRound,
    participants: &[SecureParticipant],
) -> Result<StageClosed, SecureError> {
    let reporters = match secure.stage {
        SecureStage::Check => excluded_by_receipts(participants),
        _ => BTreeMap::new(),
    };
    let remaining = participants
        .iter()
        .filter(|p| !p.state.has_left() && secure.stage.answered_by(p))
        .filter(|p| !reporters.contains_key(&(p.device_id as u64)))
        .count();
    let (message, next) = stage_message(secure.stage);
    if let Err(error) = secagg_server::check_dropouts(&secure.plan, remaining, message) {
        return Ok(StageClosed::Failed(RoundFailure::SecureDropouts(error)));
    }
    let Some(next) = next else {
        return unmask_round(tx, secure, participants, remaining).await;
    };
    if !reporters.is_empty() {
        secagg::exclude(tx, secure.id, &reporters).await?;
        tracing::warn!(
            round = secure.id,
            excluded = ?reporters.keys().collect::<Vec<_>>(),
            "secure round: devices excluded, their neighbours could not open their shares"
        );
    }
    secagg::drop_laggards(tx, secure.id, secure.stage).await?;
    let deadline = match next {
        SecureStage::Collect => secure.deadline_ms,
        _ => now_ms() + stage_timeout_ms(state),
    };
    secagg::set_stage(tx, secure.id, next, deadline).await?;
    Ok(StageClosed::Next(next))
}

/// The devices ShareCheck excludes, each with the devices that reported
/// it: the rule is `canopy_protocol::secagg::server::excluded_devices`, over
/// every receipt stored (receipts are taken only while ShareCheck is open,
/// so after it closes this never changes).
pub fn excluded_by_receipts(participants: &[SecureParticipant]) -> BTreeMap<u64, Vec<u64>> {
    let receipts: Vec<(u64, Vec<u64>)> = participants
        .iter()
        .filter_map(|p| {
            let reported = secagg::receipt_ids(p.secagg_receipt.as_deref()?);
            Some((p.device_id as u64, reported))
        })
        .collect();
    let excluded = secagg_server::excluded_devices(receipts.iter().map(|(_, r)| r.as_slice()));
    excluded
        .into_iter()
        .map(|device| {
            let by = receipts
                .iter()
                .filter(|(_, reported)| reported.contains(&device))
                .map(|(reporter, _)| *reporter)
                .collect();
            (device, by)
        })
        .collect()
}

/// The devices ShareCheck excluded, fixed once it has closed: call it from
/// MaskedInputCollection on.
pub async fn cached_exclusions(
    state: &AppState,
    round: &SecureRound,
) -> Result<Arc<BTreeSet<u64>>, SecureError> {
    debug_assert!(round.stage >= SecureStage::Collect);
    let build = async {
        let participants = secagg::participants(&state.db.pool, round.id).await?;
        Ok(excluded_by_receipts(&participants).into_keys().collect())
    };
    state.secure_exclusions.get(round, build).await
}

/// Rebuilds the secrets, removes the masks and stores the aggregate.
async fn unmask_round(
    tx: &mut Tx<'_>,
    secure: &SecureRound,
    participants: &[SecureParticipant],
    answered: usize,
) -> Result<StageClosed, SecureError> {
    let started = std::time::Instant::now();
    let sum = rounds::update_sum(tx, secure.id).await?.unwrap_or_default();
    let secure_round = secure.clone();
    let rows = participants.to_vec();
    let unmasked = tokio::task::spawn_blocking(move || unmask_sum(&secure_round, &rows, &sum))
        .await
        .map_err(|source| SecureError::Task {
            round: secure.id,
            source,
        })?;
    let (values, weight_total) = match unmasked {
        Ok(done) => done,
        Err(reason) => return Ok(StageClosed::Failed(RoundFailure::Unmask(reason))),
    };
    secagg::store_aggregate(tx, secure.id, &fedavg::encode_sum(&values), weight_total).await?;
    // How long reading the masked sum, removing the masks and storing
    // the aggregate took, apart from waiting for the devices' shares.
    tracing::info!(
        round = secure.id,
        survivors = answered,
        unmask_ms = started.elapsed().as_millis() as u64,
        "secure round: unmasked"
    );
    Ok(StageClosed::Unmasked)
}

/// The CPU-bound part of unmasking. Errors are reasons to fail the round.
fn unmask_sum(
    secure: &SecureRound,
    participants: &[SecureParticipant],
    sum_bytes: &[u8],
) -> Result<(Vec<f64>, u64), String> {
    let plan = &secure.plan;
    let round_graph = RoundGraph::build(secure, participants).map_err(|error| chain(&error))?;
    let (graph, shared, survivors) = (
        &round_graph.graph,
        &round_graph.shared,
        &round_graph.survivors,
    );
    let by_id: BTreeMap<u64, &SecureParticipant> = participants
        .iter()
        .map(|p| (p.device_id as u64, p))
        .collect();
    let mask_key = |id: u64| {
        by_id[&id]
            .secagg_keys
            .as_deref()
            .and_then(advertisement)
            .map(|a| a.mask_key)
            .ok_or_else(|| format!("device {id}'s advertised keys are missing"))
    };
    let session = session(secure);
    let mut book = UnmaskBook::default();
    for &id in survivors {
        let commitment: [u8; 32] = by_id[&id]
            .secagg_commitment
            .as_deref()
            .and_then(|c| c.try_into().ok())
            .ok_or_else(|| format!("device {id}'s seed commitment is missing"))?;
        book.survivors.insert(id, commitment);
        if let Some(reveal) = &by_id[&id].secagg_reveal {
            let (s, d) = round_graph.unmask_sets(id);
            let reveals = secagg_server::read_unmask_response(reveal, session, id, &s, &d)
                .map_err(|e| e.to_string())?;
            book.add(reveals);
        }
    }
    for &id in shared.difference(survivors) {
        let neighbours = graph.neighbours(id).unwrap_or_default();
        let masked_with = neighbours
            .into_iter()
            .filter(|n| survivors.contains(n))
            .map(|n| Ok((n, mask_key(n)?)))
            .collect::<Result<Vec<_>, String>>()?;
        book.dropped.insert(
            id,
            DroppedPeer {
                mask_key: mask_key(id)?,
                masked_with,
            },
        );
    }
    let mut sum = decode_masked_sum(sum_bytes, plan)?;
    secagg_server::unmask(&mut sum, plan, session, &book).map_err(|e| e.to_string())?;
    arith::decode_sum(plan, &sum).map_err(|e| e.to_string())
}

/// The stored masked sum: the 32-bit packing (little-endian u32 words), or
/// zeros before any.
pub fn decode_masked_sum(bytes: &[u8], plan: &Plan) -> Result<Vec<u32>, String> {
    let mut sum = vec![0; plan.masked_len()];
    if !bytes.is_empty() {
        arith::add_packed(&mut sum, bytes, 32)
            .map_err(|error| format!("the stored masked sum is unreadable: {error}"))?;
    }
    Ok(sum)
}

pub fn encode_masked_sum(sum: &[u32]) -> Vec<u8> {
    arith::pack(sum, 32)
}
