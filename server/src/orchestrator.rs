//! Drives every running job through its rounds.
//!
//! The orchestrator holds no state of its own: each tick reads the open
//! rounds from the database and advances each one inside a transaction
//! that holds its row lock (`FOR UPDATE SKIP LOCKED` on PostgreSQL), so
//! any number of server processes can run it, and a restarted process
//! carries on from whatever was committed.

use std::time::Duration;

use bytes::Bytes;
use canopy_protocol::messages::{DevicePolicy, DeviceRole, Tier};
use futures_util::StreamExt;
use rand::{Rng, SeedableRng};
use tokio::sync::watch;

use crate::blobs::BlobError;
use crate::db::now_ms;
use crate::fedavg;
use crate::round_failure::RoundFailure;
use crate::secure::{self, SecureError};
use crate::state::AppState;
use crate::store::evaluations;
use crate::store::jobs::{self, DeviceFilter, JobRow, JobSpec, JobState};
use crate::store::models::{self, NewVersion, VersionRow};
use crate::store::rounds::{self, CandidateRow, RoundKind, RoundRow, RoundState, Tx};
use crate::store::strategy as strategy_store;
use crate::store::{devices, from_json, secagg, uplinks};
use crate::strategy::{OptimizerState, ServerOptimizer};
use canopy_term::error_chain as chain;

/// Why the orchestrator could not advance a round this tick; it logs the
/// error and tries again on the next. A reason for a round to fail is not
/// one of these: it is recorded on the round.
#[derive(Debug, thiserror::Error)]
pub enum OrchestratorError {
    #[error("round {round}'s job {job} is missing")]
    MissingJob { round: i64, job: i64 },
    #[error("round {round} vanished inside its transaction")]
    RoundVanished { round: i64 },
    #[error("round {round}'s base model version {version} is missing")]
    MissingVersion { round: i64, version: i64 },
    #[error("the aggregation task of round {round} stopped before it finished")]
    Task {
        round: i64,
        #[source]
        source: tokio::task::JoinError,
    },
    #[error("the averaged model of round {round} has no digest")]
    Digest {
        round: i64,
        #[source]
        source: canopy_ir::format::FormatError,
    },
    #[error("job {job}'s privacy accountant cannot be used: {reason}")]
    Privacy { job: i64, reason: String },
    #[error("cannot read the input shape of model version {version}: {reason}")]
    InputShape { version: i64, reason: String },
    #[error("the blob store failed")]
    Blob(#[from] BlobError),
    #[error(transparent)]
    Secure(#[from] SecureError),
    #[error("the database failed")]
    Database(#[from] sqlx::Error),
}

pub async fn run(state: AppState, mut shutdown: watch::Receiver<bool>) {
    let limits = &state.settings.limits;
    let tick = Duration::from_millis(limits.orchestrator_tick_ms.max(10));
    let prune_every_ms = i64::try_from(limits.nonce_prune_interval_ms).unwrap_or(i64::MAX);
    let mut last_prune_ms = 0;
    loop {
        if let Err(error) = tick_once(&state).await {
            tracing::warn!(error = %chain(&error), "orchestrator tick failed; retrying");
        }
        if now_ms() - last_prune_ms > prune_every_ms {
            last_prune_ms = now_ms();
            if let Err(error) = devices::prune_nonces(&state.db).await {
                tracing::warn!(error = %chain(&error), "cannot prune device nonces");
            }
            // The limiter keeps a cell per client address; forget idle ones.
            state.sensitive_limiter.retain_recent();
            state.sensitive_limiter.shrink_to_fit();
            state.device_limiter.retain_recent();
            state.device_limiter.shrink_to_fit();
        }
        tokio::select! {
            _ = tokio::time::sleep(tick) => {}
            _ = state.orchestrator_wake.notified() => {}
            _ = shutdown.changed() => {}
        }
        if *shutdown.borrow() {
            tracing::info!("orchestrator stopped");
            return;
        }
    }
}

pub async fn tick_once(state: &AppState) -> Result<(), OrchestratorError> {
    close_evaluations(state).await?;
    open_rounds(state).await?;
    let per_tick = i64::from(state.settings.limits.max_rounds_per_tick);
    for round_id in rounds::open_round_ids(&state.db, per_tick).await? {
        if let Err(error) = advance(state, round_id).await {
            tracing::warn!(round = round_id, error = %chain(&error), "cannot advance round");
        }
    }
    delete_stored_updates(state).await
}

/// Deletes the updates robust rounds stored once the rounds are over
/// (succeeded or failed): deleted first and recorded after, so a crash
/// between the two only deletes them again.
async fn delete_stored_updates(state: &AppState) -> Result<(), OrchestratorError> {
    let per_tick = i64::from(state.settings.limits.max_rounds_per_tick);
    for round_id in rounds::keeping_updates(&state.db, per_tick).await? {
        let deleted = state.blobs.delete_round_updates(round_id).await?;
        rounds::updates_deleted(&state.db, round_id).await?;
        tracing::debug!(
            round = round_id,
            deleted,
            "deleted a robust round's stored updates"
        );
    }
    Ok(())
}

/// Closes the federated evaluations whose evaluators have all answered or
/// whose deadline has passed.
async fn close_evaluations(state: &AppState) -> Result<(), OrchestratorError> {
    let per_tick = i64::from(state.settings.limits.max_rounds_per_tick);
    for round_id in evaluations::due(&state.db, per_tick).await? {
        let _writer = state.db.write_lock().await;
        let mut tx = state.db.pool.begin().await?;
        if evaluations::close(&mut tx, round_id).await? {
            tracing::info!(round = round_id, "closed federated evaluation");
        }
        tx.commit().await?;
    }
    Ok(())
}

/// Opens the next round of every running job that has none open, and
/// completes a job that has run all its rounds once its last version's
/// evaluation has closed.
async fn open_rounds(state: &AppState) -> Result<(), OrchestratorError> {
    let waiting = jobs::waiting_for_round(&state.db).await?;
    for job in waiting {
        let spec = job.spec()?;
        if job.rounds_completed == 0 && evaluates_for_the_cloud(state, &job).await? {
            open_evaluation_sub_round(state, &job, &spec).await?;
            continue;
        }
        let start = match job.rounds_completed {
            0 => prepare_start(state, &job, &spec).await?,
            _ => Start::Ready,
        };
        let kind = match start {
            Start::Stopped => continue,
            Start::Statistics => RoundKind::Statistics,
            Start::Ready => RoundKind::Train,
        };
        let _writer = state.db.write_lock().await;
        let mut tx = state.db.pool.begin().await?;
        if job.rounds_completed >= i64::from(spec.rounds) {
            if !evaluations::job_has_open(&mut tx, job.id).await? {
                jobs::complete(&mut tx, job.id, "").await?;
                tracing::info!(job = job.id, "job completed");
            }
            tx.commit().await?;
            continue;
        }
        let Some(job) = jobs::get_with(&mut *tx, job.id).await? else {
            continue;
        };
        let new = next_round(&job, &spec, kind);
        let opened = rounds::open_round(&mut tx, &new).await?;
        tx.commit().await?;
        if let Some(round_id) = opened {
            tracing::info!(
                job = job.id,
                round = round_id,
                number = new.number,
                kind = kind.as_str(),
                attempt = new.attempt,
                "opened round"
            );
        }
    }
    Ok(())
}

/// The job's next round of `kind`, from the job as read under the writer
/// lock: a statistics round is number 0, a training round the one after
/// those completed, and its attempt counts the failures before it.
fn next_round(job: &JobRow, spec: &JobSpec, kind: RoundKind) -> rounds::NewRound {
    rounds::NewRound {
        kind,
        job_id: job.id,
        number: match kind {
            RoundKind::Statistics => 0,
            RoundKind::Train => job.rounds_completed + 1,
        },
        attempt: job.round_failures + 1,
        base_version_id: job.current_version_id,
        target_devices: i64::from(spec.target_devices),
        min_devices: i64::from(spec.min_devices),
        max_staleness: match kind {
            RoundKind::Statistics => None,
            RoundKind::Train => spec
                .asynchronous
                .as_ref()
                .map(|asynchronous| i64::from(asynchronous.max_staleness)),
        },
        clip_norm: match kind {
            RoundKind::Statistics => None,
            // Adaptive clipping moves the job's clip after each round.
            RoundKind::Train => spec
                .differential_privacy
                .as_ref()
                .map(|dp| job.dp_clip_norm.unwrap_or(dp.clip_norm)),
        },
        robust_rule: match kind {
            RoundKind::Statistics => None,
            RoundKind::Train => spec.robust_aggregation.as_ref().map(|robust| robust.rule),
        },
    }
}

/// On an edge, whether the job is the evaluation sub-round of a cloud
/// round: its devices evaluate the cloud's version, and nothing trains.
async fn evaluates_for_the_cloud(state: &AppState, job: &JobRow) -> Result<bool, sqlx::Error> {
    let uplink = uplinks::for_job(&state.db.pool, job.id).await?;
    Ok(uplink.is_some_and(|uplink| uplink.kind == uplinks::UplinkKind::Evaluation))
}

/// An edge's evaluation sub-round: one round whose result is the job's
/// version (the cloud's), succeeded at once, and the federated evaluation
/// of that version by the edge's devices, as a cloud round's version is
/// evaluated. The job completes when the evaluation closes (at once when
/// no device could be asked), and the edge reports the evaluation's
/// summary to the cloud (`canopy-edge`).
async fn open_evaluation_sub_round(
    state: &AppState,
    job: &JobRow,
    spec: &JobSpec,
) -> Result<(), OrchestratorError> {
    let writer = state.db.write_lock().await;
    let mut tx = state.db.pool.begin().await?;
    let Some(job) = jobs::get_with(&mut *tx, job.id).await? else {
        return Ok(());
    };
    let new = next_round(&job, spec, RoundKind::Train);
    let Some(round_id) = rounds::open_round(&mut tx, &new).await? else {
        return Ok(());
    };
    let round = reload(&mut tx, round_id).await?;
    let evaluating = open_evaluation(state, &mut tx, &round, spec).await?;
    let rounds = i64::from(spec.rounds);
    rounds::succeed(&mut tx, &round, job.current_version_id, rounds, evaluating).await?;
    let announcing = state.announcing();
    tx.commit().await?;
    drop(announcing);
    drop(writer);
    tracing::info!(
        job = job.id,
        round = round_id,
        evaluating,
        "opened an evaluation sub-round"
    );
    Ok(())
}

/// What a job needs before its first training round.
enum Start {
    /// Open the training round.
    Ready,
    /// Open a statistics round first: the model's input statistics are
    /// unfitted.
    Statistics,
    /// The job failed (its model cannot take what the job asks).
    Stopped,
}

/// Before a job's first training round: a statistics round when the job's
/// model has unfitted input statistics (not in secure jobs: see
/// `docs/strategies.md`), then, for FedProx, the version with the
/// proximal `train_step` derived from the model's `train_loss`, once, as
/// a version of the job with the (fitted) model as its parent.
async fn prepare_start(
    state: &AppState,
    job: &JobRow,
    spec: &JobSpec,
) -> Result<Start, OrchestratorError> {
    let current = models::get_version(&state.db, job.current_version_id)
        .await?
        .ok_or(OrchestratorError::MissingVersion {
            round: 0,
            version: job.current_version_id,
        })?;
    let derived_here = current.job_id == Some(job.id);
    let mu = spec.strategy.proximal_mu().ok().flatten();
    let wants_statistics = !derived_here && !spec.secure_aggregation.enabled;
    let proximal_done = derived_here && current.round_id.is_none();
    if !wants_statistics && (mu.is_none() || proximal_done) {
        return Ok(Start::Ready);
    }
    let limit = state.settings.limits.max_model_bytes;
    let bytes = state.blobs.get(&current.digest, limit).await?;
    if wants_statistics {
        let probe = bytes.clone();
        let unfitted = tokio::task::spawn_blocking(move || {
            canopy_ir::format::read_model(&probe).is_ok_and(|model| {
                canopy_engine::stats::InputStatsState::of(&model)
                    == canopy_engine::stats::InputStatsState::Unfitted
            })
        })
        .await
        .map_err(|source| OrchestratorError::Task { round: 0, source })?;
        if unfitted {
            return Ok(Start::Statistics);
        }
    }
    let Some(mu) = mu else {
        return Ok(Start::Ready);
    };
    let derived = tokio::task::spawn_blocking(move || derive_proximal(&bytes, mu))
        .await
        .map_err(|source| OrchestratorError::Task { round: 0, source })?;
    let stored = match derived {
        Ok(file) => Ok(put_blob(state, &file, None).await?),
        Err(reason) => Err(reason),
    };
    let _writer = state.db.write_lock().await;
    let mut tx = state.db.pool.begin().await?;
    let stored = match stored {
        Ok(stored) => stored,
        Err(reason) => {
            let reason = format!(
                "version {} of model `{}` cannot train with FedProx: {reason}",
                current.version, current.model_name
            );
            jobs::fail(&mut tx, job.id, &reason).await?;
            tx.commit().await?;
            tracing::warn!(job = job.id, %reason, "job failed before its first round");
            return Ok(Start::Stopped);
        }
    };
    let version = insert_version(&mut tx, &current, &stored, job.id, None).await?;
    jobs::set_start_version(&mut tx, job.id, version.id).await?;
    tx.commit().await?;
    tracing::info!(
        job = job.id,
        version = version.version,
        mu,
        "derived the FedProx train_step"
    );
    Ok(Start::Ready)
}

/// A model file the server derived, written to the blob store: its
/// digest and size, for [`insert_version`].
struct StoredBlob {
    digest: String,
    size_bytes: u64,
}

/// Writes a derived model file to the blob store. It runs before the
/// transaction that records the version, outside the writer lock: the
/// blob's `fsync` can take a second on a loaded disk, and uploads to every
/// other round wait on that lock. A blob whose transaction never commits
/// is content-addressed, so writing it again is harmless.
async fn put_blob(
    state: &AppState,
    file: &[u8],
    round_id: Option<i64>,
) -> Result<StoredBlob, OrchestratorError> {
    let digest = canopy_ir::format::digest(file)
        .map(|d| canopy_ir::format::digest_hex(&d))
        .map_err(|source| OrchestratorError::Digest {
            round: round_id.unwrap_or(0),
            source,
        })?;
    state.blobs.put(&digest, Bytes::from(file.to_vec())).await?;
    Ok(StoredBlob {
        digest,
        size_bytes: file.len() as u64,
    })
}

/// Records a stored blob as the child version of `parent`, produced by
/// `job_id` (and `round_id`, when a round made it).
async fn insert_version(
    tx: &mut Tx<'_>,
    parent: &VersionRow,
    stored: &StoredBlob,
    job_id: i64,
    round_id: Option<i64>,
) -> Result<VersionRow, OrchestratorError> {
    let layout = parent.layout()?;
    Ok(models::insert_version(
        tx,
        &NewVersion {
            model_name: &parent.model_name,
            digest: &stored.digest,
            size_bytes: stored.size_bytes,
            layout: &layout,
            untrainable_reason: None,
            parent_version_id: Some(parent.id),
            job_id: Some(job_id),
            round_id,
        },
    )
    .await?)
}

/// The model file with FedProx's term in its `train_step`, with the
/// original as its parent. An error is why the model cannot have it.
fn derive_proximal(base: &[u8], mu: f64) -> Result<Vec<u8>, String> {
    let mut model = canopy_ir::format::read_model(base)
        .map_err(|error| format!("the model does not load: {}", chain(&error)))?;
    canopy_engine::proximal::make_proximal(&mut model, mu).map_err(|error| chain(&error))?;
    model.metadata.parent_digest = canopy_ir::format::digest(base).ok();
    canopy_ir::format::write_model(&model)
        .map_err(|error| format!("the derived model does not serialise: {error}"))
}

/// Advances one round by as many states as it can go now.
async fn advance(state: &AppState, round_id: i64) -> Result<(), OrchestratorError> {
    if !worth_advancing(state, round_id).await? {
        return Ok(());
    }
    let writer = state.db.write_lock().await;
    let mut tx = state.db.pool.begin().await?;
    let Some(round) = rounds::claim(&state.db, &mut tx, round_id).await? else {
        return Ok(());
    };
    let job =
        jobs::get_with(&mut *tx, round.job_id)
            .await?
            .ok_or(OrchestratorError::MissingJob {
                round: round_id,
                job: round.job_id,
            })?;
    let spec = job.spec()?;
    match job.state {
        JobState::Running => {}
        JobState::Paused | JobState::Created => return Ok(()),
        other => {
            let failure = RoundFailure::JobStopped { state: other };
            failure.record(&mut tx, &round, i64::MAX).await?;
            tx.commit().await?;
            return Ok(());
        }
    }
    let mut notify_devices = false;
    let mut notify_secure = false;
    let mut round = round;
    let mut outcome = None;
    if round.state == RoundState::Selecting {
        match select(state, &mut tx, &round, &job, &spec).await? {
            Selected::Training => notify_devices = true,
            Selected::Waiting => {}
            Selected::Failed => outcome = Some(RoundState::Failed),
        }
        round = reload(&mut tx, round.id).await?;
    } else if round.state == RoundState::Training
        && round.is_buffer()
        && round.updates_accepted < round.target_devices
    {
        // A full buffer closes below: a device selected into it now
        // would train on a version already one behind.
        notify_devices |= top_up(state, &mut tx, &round, &spec).await?;
        round = reload(&mut tx, round.id).await?;
    }
    if round.state == RoundState::Training && spec.secure_aggregation.enabled {
        match secure::advance(state, &mut tx, &round, &spec).await? {
            secure::Advanced::Waiting { stage_changed } => notify_secure |= stage_changed,
            secure::Advanced::Failed => {
                notify_secure = true;
                outcome = Some(RoundState::Failed);
            }
            secure::Advanced::Unmasked => notify_secure = true,
        }
        round = reload(&mut tx, round.id).await?;
    } else if let Some(closing) =
        close_reason(&round).filter(|_| round.state == RoundState::Training)
    {
        rounds::close(&mut tx, round.id, closing.drop_reason).await?;
        tracing::info!(
            round = round.id,
            updates = round.updates_accepted,
            "closed round"
        );
        round = reload(&mut tx, round.id).await?;
    }
    let announcing = notify_devices.then(|| state.announcing());
    tx.commit().await?;
    drop(announcing);
    drop(writer);
    if round.is_buffer() && round.state == RoundState::Training {
        let expired = rounds::expire_buffered(&state.db, round.job_id).await?;
        if expired > 0 {
            tracing::info!(
                job = round.job_id,
                expired,
                "dropped devices past their deadline"
            );
        }
    }
    if notify_secure || notify_devices {
        state.secagg_progress.notify_waiters();
    }
    if round.state == RoundState::Aggregating {
        outcome = aggregate(state, &round, &job, &spec).await?;
        if round.is_buffer() && outcome == Some(RoundState::Succeeded) {
            // The next buffer is open: top it up with devices now.
            state.orchestrator_wake.notify_one();
        }
    }
    if let Some(outcome) = outcome {
        state.metrics.round_finished(outcome.as_str());
    }
    Ok(())
}

/// Whether [`advance`] could change the round now, from a few reads and
/// no lock: a secure round whose running job's stage still waits for its
/// devices cannot (see [`secure::may_advance`]).
async fn worth_advancing(state: &AppState, round_id: i64) -> Result<bool, OrchestratorError> {
    let Some(secure) = secagg::get(&state.db.pool, round_id).await? else {
        return Ok(true);
    };
    let job = jobs::get_with(&state.db.pool, secure.job_id).await?;
    if job.is_none_or(|job| job.state != JobState::Running) {
        return Ok(true);
    }
    Ok(secure::may_advance(&state.db, &secure).await?)
}

async fn reload(tx: &mut Tx<'_>, id: i64) -> Result<RoundRow, OrchestratorError> {
    rounds::get_with(&mut **tx, id)
        .await?
        .ok_or(OrchestratorError::RoundVanished { round: id })
}

/// The version a round starts from.
async fn base_version(state: &AppState, round: &RoundRow) -> Result<VersionRow, OrchestratorError> {
    models::get_version(&state.db, round.base_version_id)
        .await?
        .ok_or(OrchestratorError::MissingVersion {
            round: round.id,
            version: round.base_version_id,
        })
}

/// What selection did to a round.
enum Selected {
    /// Devices were selected: the round trains.
    Training,
    /// Too few devices are eligible; the round's status says why.
    Waiting,
    /// The round failed: its job's secure aggregation refused the devices,
    /// or it waited past the job's `max_wait_for_devices_ms`.
    Failed,
}

/// Picks devices by reservoir sampling over the eligible ones, so memory
/// is bounded by the selection size however many devices are online.
async fn select(
    state: &AppState,
    tx: &mut Tx<'_>,
    round: &RoundRow,
    job: &JobRow,
    spec: &JobSpec,
) -> Result<Selected, OrchestratorError> {
    let Sample {
        chosen,
        eligibility,
        busy,
        input_shape,
    } = sample_for(state, tx, round, spec).await?;
    let eligible = eligibility.eligible;
    if eligible + busy < spec.min_devices as usize {
        let shortfall = format!(
            "{eligible} eligible online, the round needs at least {}{}",
            spec.min_devices,
            eligibility.why_not(
                "online devices",
                spec.dataset.as_deref(),
                input_shape.as_deref()
            )
        );
        if let Some(failure) = waited_too_long(round, job, spec, &shortfall) {
            // Waiting again would not bring devices either: the job fails.
            failure.record(tx, round, 0).await?;
            return Ok(Selected::Failed);
        }
        let message = format!("waiting for devices: {shortfall}");
        if message != round.status_message {
            rounds::set_status(tx, round.id, &message).await?;
        }
        return Ok(Selected::Waiting);
    }
    // A secure training round's plan, made once: a private round is
    // accounted by its noise below, and `secure::begin` commits to it.
    let plan = match spec.secure_aggregation.enabled && round.kind == RoundKind::Train {
        true => {
            let base = base_version(state, round).await?;
            let update_len = usize::try_from(base.trainable_elements).unwrap_or(usize::MAX);
            Some(spec.round_plan(chosen.len(), update_len))
        }
        false => None,
    };
    if let (Some(privacy), RoundKind::Train) = (&spec.differential_privacy, round.kind) {
        let sampling_rate = crate::privacy::sampling_rate(chosen.len(), eligible + busy);
        let planned = plan.as_ref().and_then(|plan| plan.as_ref().ok());
        let event = privacy.round(sampling_rate, planned);
        if let Some(stop) = privacy_budget_stop(tx, job, privacy, &event, sampling_rate).await? {
            if let RoundFailure::Privacy(_) = stop {
                // What was spent is unknown: the job cannot go on.
                stop.record(tx, round, 0).await?;
                return Ok(Selected::Failed);
            }
            // The last version's evaluations are the job's result: it
            // stops once they are in, as a job that ran all its rounds
            // completes.
            if evaluations::job_has_open(tx, job.id).await? {
                let message = format!("{stop}; stopping once the last version is evaluated");
                if message != round.status_message {
                    rounds::set_status(tx, round.id, &message).await?;
                }
                return Ok(Selected::Waiting);
            }
            rounds::stop_job(tx, round, &stop).await?;
            tracing::info!(round = round.id, job = job.id, reason = %stop, "job stopped");
            return Ok(Selected::Failed);
        }
        rounds::set_sampling_rate(tx, round.id, sampling_rate).await?;
    }
    let now = now_ms();
    let mut deadline = now + i64::try_from(spec.round_deadline_ms).unwrap_or(i64::MAX / 2);
    if let Some(closes_by) = sub_round_deadline(tx, job.id).await? {
        let rounds_left = i64::from(spec.rounds) - round.number + 1;
        deadline = deadline.min(share_of_sub_round(closes_by, now, rounds_left));
    }
    crate::store::task_state::open::<rounds::ParticipantState>(tx, round.id, &chosen, deadline)
        .await?;
    if let Some(plan) = plan {
        let begun = secure::begin(state, tx, round.id, plan).await?;
        if let secure::Begun::Refused(failure) = begun {
            let round = reload(tx, round.id).await?;
            failure
                .record(tx, &round, i64::from(spec.max_round_retries))
                .await?;
            return Ok(Selected::Failed);
        }
    }
    tracing::info!(
        round = round.id,
        selected = chosen.len(),
        eligible,
        "selected devices"
    );
    Ok(Selected::Training)
}

/// Why a private job must stop before this round, if it must: the round,
/// at `sampling_rate`, would take its ε past its budget. A saved
/// accountant that cannot be read fails it: spending on without knowing
/// what was spent is what a budget forbids.
async fn privacy_budget_stop(
    tx: &mut Tx<'_>,
    job: &JobRow,
    privacy: &crate::privacy::DifferentialPrivacy,
    event: &canopy_privacy::Event,
    sampling_rate: f64,
) -> Result<Option<RoundFailure>, OrchestratorError> {
    let Some(budget) = privacy.budget_epsilon else {
        return Ok(None);
    };
    let (_, saved) = jobs::privacy_state(tx, job.id).await?;
    let accountant = match crate::privacy::load_accountant(saved.as_deref()) {
        Ok(accountant) => accountant,
        Err(reason) => return Ok(Some(RoundFailure::Privacy(reason))),
    };
    let (spent, after) = match (
        crate::privacy::epsilon(&accountant, privacy.delta),
        accountant.epsilon_after(event, privacy.delta, crate::privacy::CONVERSION),
    ) {
        (Ok(spent), Ok(after)) => (spent, after.epsilon),
        (Err(reason), _) => return Ok(Some(RoundFailure::Privacy(reason))),
        (_, Err(error)) => return Ok(Some(RoundFailure::Privacy(error.to_string()))),
    };
    Ok((after > budget).then_some(RoundFailure::PrivacyBudget {
        budget,
        spent,
        would_spend: after,
        sampling_rate,
    }))
}

/// Who selection would add to a training round now, and why others could not take part.
struct Sample {
    chosen: Vec<i64>,
    eligibility: Eligibility,
    /// Devices the job holds busy already: an asynchronous job's, training
    /// on earlier buffers, which count against its concurrency and toward
    /// a buffer's minimum; none for a synchronous round.
    busy: usize,
    input_shape: Option<Vec<u64>>,
}

/// A uniform sample of the free eligible devices for a training round,
/// as many as the job's selection size less the devices it holds busy.
async fn sample_for(
    state: &AppState,
    tx: &mut Tx<'_>,
    round: &RoundRow,
    spec: &JobSpec,
) -> Result<Sample, OrchestratorError> {
    let busy = match round.is_buffer() {
        true => usize::try_from(rounds::busy_in_job(tx, round.job_id).await?).unwrap_or(0),
        false => 0,
    };
    let wanted = (spec.selection_size() as usize).saturating_sub(busy);
    let input_shape = match (&spec.dataset, wanted) {
        (Some(_), 1..) => Some(model_input_shape(state, round.base_version_id).await?),
        _ => None,
    };
    let (chosen, eligibility) = match wanted {
        0 => (Vec::new(), Eligibility::default()),
        _ => {
            let shape = input_shape.as_deref();
            sample_eligible(state, tx, Some(round.id), spec, shape, wanted).await?
        }
    };
    Ok(Sample {
        chosen,
        eligibility,
        busy,
        input_shape,
    })
}

/// Keeps an asynchronous job's `concurrency` devices training: selects
/// free eligible devices into its open buffer for the places that devices
/// which uploaded, dropped or expired have left. Whether it selected any.
async fn top_up(
    state: &AppState,
    tx: &mut Tx<'_>,
    round: &RoundRow,
    spec: &JobSpec,
) -> Result<bool, OrchestratorError> {
    let Sample { chosen, busy, .. } = sample_for(state, tx, round, spec).await?;
    if chosen.is_empty() {
        return Ok(false);
    }
    rounds::top_up(tx, round.id, &chosen).await?;
    tracing::debug!(
        round = round.id,
        selected = chosen.len(),
        busy,
        "topped up the buffer"
    );
    Ok(true)
}

/// On an edge, when the job runs a sub-round: the time it must close by,
/// the cloud's sub-round deadline, however late its devices came (its
/// synchronous rounds share it: [`share_of_sub_round`]).
async fn sub_round_deadline(
    tx: &mut Tx<'_>,
    job_id: i64,
) -> Result<Option<i64>, OrchestratorError> {
    let Some(uplink) = uplinks::for_job(&mut **tx, job_id).await? else {
        return Ok(None);
    };
    let task: canopy_protocol::messages::Task =
        from_json("uplinks.cloud_task", &uplink.cloud_task)?;
    Ok(task
        .sub_round
        .map(|sub_round| i64::try_from(sub_round.deadline_unix_ms).unwrap_or(i64::MAX)))
}

/// When a sub-round's round must close: the rounds still to run, this one
/// included, share what is left of the cloud's deadline evenly. A round
/// that waits on a silent device then leaves the later ones their time,
/// and the edge a result to send, instead of closing at the deadline
/// itself and leaving the next round none (which would fail the
/// sub-round, and lose the rounds made).
fn share_of_sub_round(closes_by: i64, now: i64, rounds_left: i64) -> i64 {
    now + closes_by.saturating_sub(now).max(0) / rounds_left.max(1)
}

/// The failure of a round that has waited for devices longer than its
/// job's `max_wait_for_devices_ms`, counted from when it opened or the job
/// was last started or resumed (a paused job's round does not wait).
fn waited_too_long(
    round: &RoundRow,
    job: &JobRow,
    spec: &JobSpec,
    shortfall: &str,
) -> Option<RoundFailure> {
    let limit_ms = spec.max_wait_for_devices_ms?;
    let since_ms = round.created_ms.max(job.updated_ms);
    let waited_ms = u64::try_from(now_ms() - since_ms).unwrap_or(0);
    (waited_ms >= limit_ms).then(|| RoundFailure::NoEligibleDevices {
        limit_ms,
        shortfall: shortfall.to_string(),
    })
}

/// Where one device stands with a job, by [`classify`]: eligible, or the
/// first check it fails.
#[derive(Debug, PartialEq)]
enum Verdict {
    Eligible,
    /// It is an aggregator (an edge node), which trains on no data of its
    /// own: a flat job's rounds select end devices.
    Aggregator,
    /// It is an end device, which a tiered job (`edges`) reaches through
    /// the aggregators it selects.
    EndDevice,
    /// It does not match the job's `filters`.
    FilteredOut,
    /// It has no device authority's certificate, which a secure job needs.
    Uncertified,
    /// It has reported no datasets yet: an agent reports them when it
    /// starts, an SDK app when it registers one, so it may still qualify.
    Unreported,
    /// It does not report the job's dataset.
    LacksDataset,
    /// Its copy of the dataset has samples of this shape, which the
    /// model's input does not take.
    WrongShape(Vec<u64>),
    /// Its latest reported conditions violate the job's device policy.
    PolicyExcludes,
}

impl Verdict {
    /// Whether the device could take part once its conditions change: the
    /// checks before the policy's depend on what the device is and holds,
    /// the policy's on what it is doing now.
    fn could_qualify(&self) -> bool {
        matches!(
            self,
            Verdict::Eligible | Verdict::PolicyExcludes | Verdict::Unreported
        )
    }
}

/// The one rule for whether a device may take part in a job's round:
/// it has the role the job selects (an end device, or an aggregator for a
/// tiered job), passes the job's filters, holds a device certificate if the job is
/// secure and the server has a device authority (`needs_certificate`),
/// reports the job's dataset with samples the model's input takes (for a
/// job that names one), and its latest reported conditions, if any, meet
/// the job's device policy. Selection applies it to the online devices
/// that are free, job creation to every enrolled one.
fn classify(
    candidate: &CandidateRow,
    spec: &JobSpec,
    input_shape: Option<&[u64]>,
    needs_certificate: bool,
) -> Result<Verdict, sqlx::Error> {
    let wanted = spec.selects();
    if candidate.role != wanted.as_str() {
        return Ok(match wanted {
            DeviceRole::Device => Verdict::Aggregator,
            DeviceRole::Aggregator => Verdict::EndDevice,
        });
    }
    if !matches_filter(candidate, &spec.filters)? {
        return Ok(Verdict::FilteredOut);
    }
    if needs_certificate && candidate.certified == 0 {
        return Ok(Verdict::Uncertified);
    }
    // An aggregator's devices hold the data; its own sub-round checks them.
    if let Some(name) = spec
        .dataset
        .as_ref()
        .filter(|_| wanted == DeviceRole::Device)
    {
        if candidate.datasets.is_none() {
            return Ok(Verdict::Unreported);
        }
        let datasets = devices::parse_datasets(candidate.datasets.as_deref())?;
        match datasets.into_iter().find(|d| &d.name == name) {
            None => return Ok(Verdict::LacksDataset),
            Some(d) if input_shape.is_some_and(|shape| !sample_fits(&d.sample_shape, shape)) => {
                return Ok(Verdict::WrongShape(d.sample_shape));
            }
            Some(_) => {}
        }
    }
    if !meets_policy(candidate, &spec.device_policy)? {
        return Ok(Verdict::PolicyExcludes);
    }
    Ok(Verdict::Eligible)
}

/// Devices that pin the authority refuse an uncertified neighbour, so
/// selecting one would fail its neighbours' round.
fn needs_certificate(state: &AppState, spec: &JobSpec) -> bool {
    spec.secure_aggregation.enabled && state.settings.device_authority.is_some()
}

/// How many devices were eligible, and why the others could not take part.
#[derive(Debug, Default)]
struct Eligibility {
    eligible: usize,
    /// Aggregators, which a flat job's rounds do not select.
    aggregators: usize,
    /// End devices, which a tiered job's rounds do not select.
    end_devices: usize,
    /// Devices that do not match the job's `filters`.
    filtered_out: usize,
    /// Devices whose latest reported conditions violate the job's device
    /// policy (not charging, on a metered network, ...).
    ineligible_conditions: usize,
    /// Devices without a device authority's certificate, which a secure
    /// job's devices would refuse as neighbours.
    uncertified: usize,
    /// Devices that have reported no datasets yet.
    unreported: usize,
    /// Devices that do not report the job's dataset.
    lacking_dataset: usize,
    /// Devices whose copy of the dataset has another sample shape, with
    /// one such shape as an example.
    wrong_shape: usize,
    example_shape: Option<Vec<u64>>,
}

impl Eligibility {
    /// Counts one device's verdict.
    fn count(&mut self, verdict: Verdict) {
        match verdict {
            Verdict::Eligible => self.eligible += 1,
            Verdict::Aggregator => self.aggregators += 1,
            Verdict::EndDevice => self.end_devices += 1,
            Verdict::FilteredOut => self.filtered_out += 1,
            Verdict::Uncertified => self.uncertified += 1,
            Verdict::Unreported => self.unreported += 1,
            Verdict::LacksDataset => self.lacking_dataset += 1,
            Verdict::WrongShape(shape) => {
                self.wrong_shape += 1;
                self.example_shape.get_or_insert(shape);
            }
            Verdict::PolicyExcludes => self.ineligible_conditions += 1,
        }
    }

    /// The reasons, as a clause about the other devices of `population`.
    fn why_not(
        &self,
        population: &str,
        dataset: Option<&str>,
        input_shape: Option<&[u64]>,
    ) -> String {
        let mut reasons = Vec::new();
        if self.aggregators > 0 {
            reasons.push(format!(
                "{} are aggregators (edge nodes), which train on no data of their own",
                self.aggregators
            ));
        }
        if self.end_devices > 0 {
            reasons.push(format!(
                "{} are end devices, which a tiered job (`edges`) reaches through its aggregators",
                self.end_devices
            ));
        }
        if self.filtered_out > 0 {
            reasons.push(format!(
                "{} do not match the job's `filters`",
                self.filtered_out
            ));
        }
        if self.ineligible_conditions > 0 {
            reasons.push(format!(
                "{} report conditions the job's `device_policy` excludes",
                self.ineligible_conditions
            ));
        }
        if self.uncertified > 0 {
            reasons.push(format!(
                "{} have no certificate from the device authority, which a secure round needs",
                self.uncertified
            ));
        }
        if let Some(dataset) = dataset {
            self.dataset_reasons(dataset, input_shape, &mut reasons);
        }
        if reasons.is_empty() {
            String::new()
        } else {
            format!(" (of the other {population}, {})", reasons.join("; "))
        }
    }

    /// What would make more devices eligible, one hint per reason; when
    /// none stands out, more devices or a lower `min_devices`.
    fn hints(&self, dataset: Option<&str>, input_shape: Option<&[u64]>) -> Vec<String> {
        let mut hints = Vec::new();
        if self.end_devices > 0 {
            hints.push(
                "enroll edge aggregators with a token from `canopy device enroll-token --role \
                 aggregator` and start them with `canopy-agent aggregate`"
                    .to_string(),
            );
        }
        if self.filtered_out > 0 {
            hints.push(
                "widen the job's `filters` (`canopy device ls` shows the devices' tier, \
                 backends and tags)"
                    .to_string(),
            );
        }
        if self.uncertified > 0 {
            hints.push(
                "certify the devices with `canopy authority certify` (README, Secure aggregation)"
                    .to_string(),
            );
        }
        if let Some(dataset) = dataset {
            if self.unreported > 0 {
                hints.push(
                    "start the devices: an agent reports its datasets when it runs, an app \
                     when it registers one"
                        .to_string(),
                );
            }
            if self.lacking_dataset > 0 {
                hints.push(format!(
                    "register `{dataset}` on the devices (`canopy-agent data add {dataset} ...`), \
                     or name a dataset they report (`canopy device ls` lists them)"
                ));
            }
            if let (Some(example), Some(input)) = (&self.example_shape, input_shape) {
                hints.push(format!(
                    "push a model whose input takes samples of shape {example:?}, or register \
                     data whose samples fit the model's {input:?}"
                ));
            }
        }
        if hints.is_empty() {
            hints.push("enroll more devices, or lower `min_devices`".to_string());
        }
        hints
    }

    fn dataset_reasons(
        &self,
        dataset: &str,
        input_shape: Option<&[u64]>,
        reasons: &mut Vec<String>,
    ) {
        if self.unreported > 0 {
            reasons.push(format!("{} have reported no datasets yet", self.unreported));
        }
        if self.lacking_dataset > 0 {
            reasons.push(format!("{} lack dataset `{dataset}`", self.lacking_dataset));
        }
        if let (Some(example), Some(input)) = (&self.example_shape, input_shape) {
            reasons.push(format!(
                "{} have `{dataset}` with samples of shape {example:?}, but the model takes {input:?}",
                self.wrong_shape
            ));
        }
    }
}

/// A uniform sample of up to `capacity` eligible online devices (by
/// [`classify`]) that are free (and not yet in the round they would train
/// in, `training_round`), by reservoir sampling, so memory is
/// bounded by the sample however many devices are online.
async fn sample_eligible(
    state: &AppState,
    tx: &mut Tx<'_>,
    training_round: Option<i64>,
    spec: &JobSpec,
    input_shape: Option<&[u64]>,
    capacity: usize,
) -> Result<(Vec<i64>, Eligibility), OrchestratorError> {
    let window = i64::try_from(state.settings.limits.online_window_ms).unwrap_or(i64::MAX);
    let mut rng = rand::rngs::StdRng::from_os_rng();
    let mut chosen: Vec<i64> = Vec::with_capacity(capacity);
    let mut eligibility = Eligibility::default();
    let needs_certificate = needs_certificate(state, spec);
    let mut candidates = rounds::candidates(tx, now_ms() - window, training_round);
    while let Some(candidate) = candidates.next().await {
        let candidate = candidate?;
        let verdict = classify(&candidate, spec, input_shape, needs_certificate)?;
        let eligible = verdict == Verdict::Eligible;
        eligibility.count(verdict);
        if !eligible {
            continue;
        }
        if chosen.len() < capacity {
            chosen.push(candidate.id);
        } else {
            let slot = rng.random_range(0..eligibility.eligible);
            if slot < capacity {
                chosen[slot] = candidate.id;
            }
        }
    }
    Ok((chosen, eligibility))
}

/// Why no round of a job could start with the devices enrolled now, and
/// what to do about it.
#[derive(Debug)]
pub(crate) struct Shortfall {
    pub message: String,
    pub hint: String,
}

/// Why no round of a job on `version_id` could start with the devices
/// enrolled now, if so: fewer than `min_devices` of them could ever be
/// eligible by [`classify`], counting those its device policy excludes
/// for now (conditions change, as do being online and being free).
/// Checked when a job is created, so the operator hears at once rather
/// than from a job that waits; devices may still enroll later.
pub(crate) async fn shortfall_at_creation(
    state: &AppState,
    spec: &JobSpec,
    version_id: i64,
) -> Result<Option<Shortfall>, OrchestratorError> {
    let input_shape = match spec.dataset {
        Some(_) => Some(model_input_shape(state, version_id).await?),
        None => None,
    };
    let needed = spec.min_devices as usize;
    let needs_certificate = needs_certificate(state, spec);
    let (mut enrolled, mut could_qualify) = (0usize, 0usize);
    let mut eligibility = Eligibility::default();
    let mut candidates = rounds::enrolled_candidates(&state.db);
    while let Some(candidate) = candidates.next().await {
        let verdict = classify(&candidate?, spec, input_shape.as_deref(), needs_certificate)?;
        enrolled += 1;
        if verdict.could_qualify() {
            could_qualify += 1;
            if could_qualify >= needed {
                return Ok(None);
            }
        } else {
            eligibility.count(verdict);
        }
    }
    if enrolled == 0 {
        return Ok(Some(Shortfall {
            message: format!("no device is enrolled yet, and each round needs at least {needed}"),
            hint: "enroll devices with a token from `canopy device enroll-token`; the job waits \
                   for them"
                .to_string(),
        }));
    }
    let dataset = spec.dataset.as_deref();
    let why_not = eligibility.why_not("enrolled devices", dataset, input_shape.as_deref());
    Ok(Some(Shortfall {
        message: format!(
            "{could_qualify} of the {enrolled} enrolled devices could take part, and each round \
             needs at least {needed}{why_not}"
        ),
        hint: eligibility
            .hints(dataset, input_shape.as_deref())
            .join("; "),
    }))
}

/// Whether a device's samples fit the model's input: the engine's rule
/// for viewing samples in another shape (IDX `[1, 28, 28]` images feed an
/// MLP's `[784]`).
pub(crate) fn sample_fits(sample_shape: &[u64], input_shape: &[u64]) -> bool {
    let dims = |shape: &[u64]| -> Option<Vec<usize>> {
        shape.iter().map(|&d| usize::try_from(d).ok()).collect()
    };
    match (dims(sample_shape), dims(input_shape)) {
        (Some(from), Some(to)) => canopy_engine::data::reshapes_to(&from, &to),
        _ => false,
    }
}

/// The shape of one input sample of a model version, read from its
/// `infer` graph once and cached.
pub(crate) async fn model_input_shape(
    state: &AppState,
    version_id: i64,
) -> Result<Vec<u64>, OrchestratorError> {
    if let Some(shape) = state.cached_input_shape(version_id) {
        return Ok(shape);
    }
    let version = models::get_version(&state.db, version_id).await?.ok_or(
        OrchestratorError::MissingVersion {
            round: 0,
            version: version_id,
        },
    )?;
    let bytes = state
        .blobs
        .get(&version.digest, state.settings.limits.max_model_bytes)
        .await?;
    let shape = tokio::task::spawn_blocking(move || {
        let model = canopy_ir::format::read_model(&bytes).map_err(|e| e.to_string())?;
        canopy_engine::zoo::sample_shape(&model)
            .map(|dims| dims.into_iter().map(|d| d as u64).collect::<Vec<u64>>())
            .map_err(|e| e.to_string())
    })
    .await
    .map_err(|source| OrchestratorError::Task { round: 0, source })?
    .map_err(|reason| OrchestratorError::InputShape {
        version: version_id,
        reason,
    })?;
    state.cache_input_shape(version_id, shape.clone());
    Ok(shape)
}

/// Opens the federated evaluation of the version `round` produced: a
/// uniform sample of `fraction` of the eligible online devices, at most
/// `max_devices`. Returns whether it is open (anyone was asked).
async fn open_evaluation(
    state: &AppState,
    tx: &mut Tx<'_>,
    round: &RoundRow,
    spec: &JobSpec,
) -> Result<bool, OrchestratorError> {
    let evaluation = &spec.evaluation;
    // A tiered job asks aggregators (`sample_eligible` selects what the
    // job's rounds select), and each asks its own devices.
    if evaluation.fraction <= 0.0 {
        return Ok(false);
    }
    let capacity = evaluation.max_devices as usize;
    let input_shape = match spec.dataset {
        Some(_) => Some(model_input_shape(state, round.base_version_id).await?),
        None => None,
    };
    let (mut chosen, eligibility) =
        sample_eligible(state, tx, None, spec, input_shape.as_deref(), capacity).await?;
    let eligible = eligibility.eligible;
    // Any sub-sample of a uniform sample is uniform.
    let wanted = ((eligible as f64) * evaluation.fraction).ceil() as usize;
    chosen.truncate(wanted.min(capacity));
    let deadline = now_ms() + i64::try_from(spec.evaluation_deadline_ms()).unwrap_or(i64::MAX / 2);
    crate::store::task_state::open::<evaluations::EvaluatorState>(tx, round.id, &chosen, deadline)
        .await?;
    tracing::info!(
        round = round.id,
        evaluators = chosen.len(),
        eligible,
        "opened federated evaluation"
    );
    Ok(!chosen.is_empty())
}

/// Whether a device may train under the job's device policy, by the
/// conditions it last reported; a device that never reported any (an
/// edge agent, an older app) is taken at its word, as before policies.
fn meets_policy(candidate: &CandidateRow, policy: &DevicePolicy) -> Result<bool, sqlx::Error> {
    if policy.is_unrestricted() {
        return Ok(true);
    }
    let conditions = devices::parse_conditions(candidate.conditions.as_deref())?;
    Ok(conditions.is_none_or(|conditions| policy.check(&conditions).is_ok()))
}

fn matches_filter(candidate: &CandidateRow, filter: &DeviceFilter) -> Result<bool, sqlx::Error> {
    if let Some(tier) = &filter.tier {
        let wanted: Option<Tier> = tier.parse().ok();
        if wanted.map(|t| t.to_string()).as_deref() != Some(candidate.tier.as_str()) {
            return Ok(false);
        }
    }
    if !filter.backends.is_empty() {
        let backends: Vec<String> = from_json("devices.backends", &candidate.backends)?;
        if !filter.backends.iter().all(|b| backends.contains(b)) {
            return Ok(false);
        }
    }
    if !filter.tags.is_empty() {
        let tags: std::collections::BTreeMap<String, String> =
            from_json("devices.tags", &candidate.tags)?;
        if !filter.tags.iter().all(|(k, v)| tags.get(k) == Some(v)) {
            return Ok(false);
        }
    }
    if !filter.gpu_types.is_empty() {
        let gpu: Option<canopy_protocol::messages::GpuAdapter> = candidate
            .gpu
            .as_deref()
            .map(|text| from_json("devices.gpu", text))
            .transpose()?;
        if !gpu.is_some_and(|gpu| filter.gpu_types.contains(&gpu.device_type)) {
            return Ok(false);
        }
    }
    Ok(true)
}

/// A round closes at its target, at its deadline, or when every selected
/// device has uploaded, declined or withdrawn; the answer is what the
/// devices still working are told as their drop reason. While a round
/// trains, participants leave `selected`/`delivered` only by uploading,
/// declining (which counts a dropout) or withdrawing as ineligible (which
/// counts in `ineligible`), so the count of those still working is
/// arithmetic, not a scan (which would make each upload's check cost
/// O(devices)).
fn close_reason(round: &RoundRow) -> Option<Closing> {
    let answered = round.updates_accepted + round.dropouts + round.ineligible;
    let past_deadline = round
        .deadline_ms
        .is_some_and(|deadline| now_ms() >= deadline);
    let drop_reason = if round.is_buffer() {
        // A full buffer's devices train on: a later buffer takes their
        // updates. A buffer's deadline is its own devices' too.
        if round.updates_accepted >= round.target_devices {
            return Some(Closing { drop_reason: None });
        }
        past_deadline.then_some("timeout: no update before the buffer's deadline")?
    } else if round.updates_accepted >= round.target_devices {
        "not needed: the round reached its target before this device uploaded"
    } else if answered >= round.selected_count {
        // Every device has answered, so no one is left to drop.
        "not needed: every selected device had answered"
    } else if past_deadline {
        "timeout: no update before the round's deadline"
    } else {
        return None;
    };
    Some(Closing {
        drop_reason: Some(drop_reason),
    })
}

/// A training round that closes now.
struct Closing {
    /// Why its devices still pending drop out; `None` when they train on
    /// (a full buffer of an asynchronous job).
    drop_reason: Option<&'static str>,
}

/// Writes the round's result as a new version, or records why the round
/// failed. Returns the round's final state, for the metrics, or `None`
/// when the round was not this call's to finish.
///
/// The work (reading the sum, stepping the optimizer, serialising and
/// writing the file with its `fsync`) runs before the writer lock is
/// taken, so uploads to other rounds never wait on it. That is safe
/// because an aggregating round takes no uploads and its job's optimizer
/// state changes only when the round itself finishes: what the work read
/// is still true when the short transaction below records it, which
/// checks the round is still aggregating with the same updates. A crash
/// between the two leaves the round aggregating, and the next tick does
/// the work again.
async fn aggregate(
    state: &AppState,
    round: &RoundRow,
    job: &JobRow,
    spec: &JobSpec,
) -> Result<Option<RoundState>, OrchestratorError> {
    // An edge's sub-round keeps its result where its last round would
    // make a version; its earlier rounds (`edges.rounds`) make versions of
    // the edge's own.
    let last = round.number >= i64::from(spec.rounds);
    let uplink = uplinks::for_job(&state.db.pool, job.id).await?;
    if let Some(uplink) = uplink.as_ref().filter(|_| last) {
        return keep_partial(state, round, job, spec, uplink).await;
    }
    let base = base_version(state, round).await?;
    let next = match next_version(state, round, job, spec, &base).await? {
        Ok(next) => {
            let stored = put_blob(state, next.file(), Some(round.id)).await?;
            match uplink
                .as_ref()
                .map(|uplink| sign_own_version(state, uplink, &stored))
            {
                Some(Err(failure)) => Err(failure),
                signed => Ok((next, stored, signed.and_then(Result::ok))),
            }
        }
        Err(failure) => Err(failure),
    };
    let _writer = state.db.write_lock().await;
    let mut tx = state.db.pool.begin().await?;
    if !still_aggregating(state, &mut tx, round, job).await? {
        return Ok(None);
    }
    let outcome = match next {
        Ok((next, stored, signed)) => {
            let version = insert_version(&mut tx, &base, &stored, job.id, Some(round.id)).await?;
            if let Some(signed) = &signed {
                crate::store::relayed_signatures::put(&mut tx, &version.digest, signed).await?;
            }
            match next {
                NextVersion::Trained {
                    optimizer_state, ..
                } => {
                    finish_training(state, &mut tx, round, job, spec, &version, &optimizer_state)
                        .await?
                }
                NextVersion::Fitted { stats, .. } => {
                    finish_statistics(&mut tx, round, job, &version, &stats).await?
                }
            }
            RoundState::Succeeded
        }
        Err(failure) => {
            let max_retries = i64::from(spec.max_round_retries);
            failure.record(&mut tx, round, max_retries).await?
        }
    };
    // A version made may open its federated evaluation: tasks for devices.
    let announcing = (outcome == RoundState::Succeeded).then(|| state.announcing());
    tx.commit().await?;
    drop(announcing);
    Ok(Some(outcome))
}

/// An edge's signature over a version its sub-round made (one of
/// `edges.rounds`, or a buffer), under the cloud's delegation in the
/// sub-round's task: its devices, which trust only the cloud's key, take
/// it on that leave.
fn sign_own_version(
    state: &AppState,
    uplink: &uplinks::UplinkRow,
    stored: &StoredBlob,
) -> Result<crate::signing::ModelSignature, RoundFailure> {
    let task: canopy_protocol::messages::Task = serde_json::from_str(&uplink.cloud_task)
        .map_err(|error| RoundFailure::Delegation(format!("the cloud's task: {error}")))?;
    let delegation = task
        .sub_round
        .and_then(|sub_round| sub_round.delegation)
        .ok_or_else(|| RoundFailure::Delegation("the cloud's task carries none".to_string()))?;
    state
        .signing
        .sign_as_delegate(&stored.digest, &delegation)
        .map_err(RoundFailure::Delegation)
}

/// Whether the round, claimed in `tx`, still aggregates the updates it
/// did when `round` was read, under a running job. A job paused or stopped
/// meanwhile is the next tick's to handle.
async fn still_aggregating(
    state: &AppState,
    tx: &mut Tx<'_>,
    round: &RoundRow,
    job: &JobRow,
) -> Result<bool, OrchestratorError> {
    let Some(current) = rounds::claim(&state.db, tx, round.id).await? else {
        return Ok(false);
    };
    let running = jobs::get_with(&mut **tx, job.id)
        .await?
        .is_some_and(|job| job.state == JobState::Running);
    Ok(running
        && current.state == RoundState::Aggregating
        && current.updates_accepted == round.updates_accepted
        && current.weight_total == round.weight_total)
}

/// An edge's sub-round closes: where a cloud round would write a version,
/// it keeps its result, with its weight, in its uplink row for the cloud
/// (`canopy-edge` sends it), in the transaction that closes the round; or
/// it fails by the same rules as any round. The result is computed before
/// the writer lock, as `aggregate`'s version is, and kept only if the
/// round still holds the updates it was computed from.
async fn keep_partial(
    state: &AppState,
    round: &RoundRow,
    job: &JobRow,
    spec: &JobSpec,
    uplink: &uplinks::UplinkRow,
) -> Result<Option<RoundState>, OrchestratorError> {
    let result = sub_round_result(state, round, job, uplink).await?;
    let _writer = state.db.write_lock().await;
    let mut tx = state.db.pool.begin().await?;
    if !still_aggregating(state, &mut tx, round, job).await? {
        return Ok(None);
    }
    let (partial, weight) = match result {
        Ok(result) => result,
        Err(failure) => {
            let max_retries = i64::from(spec.max_round_retries);
            let outcome = failure.record(&mut tx, round, max_retries).await?;
            tx.commit().await?;
            return Ok(Some(outcome));
        }
    };
    uplinks::keep_partial(&mut tx, job.id, &partial, weight).await?;
    rounds::succeed_partial(&mut tx, round).await?;
    if round.is_buffer() {
        let reason = "not needed: the sub-round made its result before this device uploaded";
        rounds::drop_buffered(&mut tx, job.id, reason).await?;
    }
    tx.commit().await?;
    tracing::info!(
        job = job.id,
        round = round.id,
        updates = round.updates_accepted,
        samples = weight,
        "sub-round closed; its result waits for the uplink"
    );
    Ok(Some(RoundState::Succeeded))
}

/// A closed sub-round's encoded result with its weight, or why the round
/// fails. A sub-round of one round sends its devices' weighted mean,
/// weighing their samples. One that made versions of its own sends the
/// step from the cloud's version to its last, plus the last round's mean,
/// weighing the samples of all its rounds: to the cloud, the progress of
/// one participant that trained on that much data. The uplink's cloud task
/// is written once, with the sub-round, so the row read before still holds.
async fn sub_round_result(
    state: &AppState,
    round: &RoundRow,
    job: &JobRow,
    uplink: &uplinks::UplinkRow,
) -> Result<Result<(Vec<u8>, u64), RoundFailure>, OrchestratorError> {
    if round.updates_accepted < round.min_devices {
        return Ok(Err(RoundFailure::TooFewUpdates {
            arrived: round.updates_accepted,
            needed: round.min_devices,
        }));
    }
    let task: canopy_protocol::messages::Task =
        from_json("uplinks.cloud_task", &uplink.cloud_task)?;
    // A read transaction (no writer lock): one snapshot of the two reads.
    let mut tx = state.db.pool.begin().await?;
    let sum = rounds::update_sum(&mut tx, round.id).await?;
    let earlier_samples = rounds::earlier_samples(&mut tx, job.id, round.id).await?;
    tx.rollback().await?;
    let sum = sum
        .map(|bytes| fedavg::decode_sum(&bytes))
        .unwrap_or_default();
    let weight_total = u64::try_from(round.weight_total).unwrap_or(0);
    let mut mean = match fedavg::mean_update(&task.layout, &sum, weight_total) {
        Ok(mean) => mean,
        Err(error) => return Ok(Err(error.into())),
    };
    if round.base_version_id != job.model_version_id {
        match own_progress(state, round, job, &task.layout).await? {
            Ok(progress) => mean.iter_mut().zip(progress).for_each(|(m, p)| *m += p),
            Err(failure) => return Ok(Err(failure)),
        }
    }
    let weight = weight_total.saturating_add(earlier_samples);
    let encoded = fedavg::encode_result(&task.layout, &mean, weight);
    Ok(encoded
        .map(|bytes| (bytes, weight))
        .map_err(RoundFailure::from))
}

/// The step an edge's own versions have taken, from the cloud's version
/// its sub-round began on to the base of `round`, in layout order.
async fn own_progress(
    state: &AppState,
    round: &RoundRow,
    job: &JobRow,
    layout: &canopy_protocol::update::UpdateLayout,
) -> Result<Result<Vec<f64>, RoundFailure>, OrchestratorError> {
    let limit = state.settings.limits.max_model_bytes;
    let mut files = Vec::with_capacity(2);
    for id in [job.model_version_id, round.base_version_id] {
        let version =
            models::get_version(&state.db, id)
                .await?
                .ok_or(OrchestratorError::MissingVersion {
                    round: round.id,
                    version: id,
                })?;
        files.push(state.blobs.get(&version.digest, limit).await?);
    }
    let layout = layout.clone();
    let progress = tokio::task::spawn_blocking(move || {
        let read = |bytes: &[u8]| {
            canopy_ir::format::read_model(bytes)
                .map_err(|error| RoundFailure::BaseModel(chain(&error)))
        };
        let (first, last) = (read(&files[0])?, read(&files[1])?);
        Ok(fedavg::difference(&first, &last, &layout)?)
    });
    progress.await.map_err(|source| OrchestratorError::Task {
        round: round.id,
        source,
    })
}

/// The file of the version a round produces, with what goes with it.
enum NextVersion {
    /// A training round's: the job's server optimizer stepped on the
    /// devices' mean update, and the optimizer's state after the step.
    Trained {
        file: Vec<u8>,
        optimizer_state: OptimizerState,
    },
    /// A statistics round's: the model with its input statistics fitted.
    Fitted {
        file: Vec<u8>,
        stats: canopy_engine::stats::InputStats,
    },
}

impl NextVersion {
    fn file(&self) -> &[u8] {
        match self {
            NextVersion::Trained { file, .. } | NextVersion::Fitted { file, .. } => file,
        }
    }
}

/// Builds the round's next version from its base and the devices' sum;
/// an `Err` inside is why the round fails.
async fn next_version(
    state: &AppState,
    round: &RoundRow,
    job: &JobRow,
    spec: &JobSpec,
    base: &VersionRow,
) -> Result<Result<NextVersion, RoundFailure>, OrchestratorError> {
    if round.updates_accepted < round.min_devices {
        return Ok(Err(RoundFailure::TooFewUpdates {
            arrived: round.updates_accepted,
            needed: round.min_devices,
        }));
    }
    let layout = base.layout()?;
    // A read transaction (no writer lock): one snapshot of the two reads.
    let mut tx = state.db.pool.begin().await?;
    let optimizer = match round.kind {
        RoundKind::Statistics => None,
        RoundKind::Train => {
            match strategy_state(&mut tx, round, job, spec, layout.num_elements()).await? {
                Ok(optimizer) => Some(optimizer),
                Err(failure) => return Ok(Err(failure)),
            }
        }
    };
    let sum = rounds::update_sum(&mut tx, round.id).await?;
    let noise_seed = match spec.differential_privacy {
        Some(_) => jobs::privacy_state(&mut tx, job.id).await?.0,
        None => None,
    };
    let robust = round.robust_rule()?.is_some();
    let stored = match robust {
        true => rounds::stored_updates(&mut tx, round.id).await?,
        false => Vec::new(),
    };
    tx.rollback().await?;
    let mut sum = sum
        .map(|bytes| fedavg::decode_sum(&bytes))
        .unwrap_or_default();
    let mut weight_total = u64::try_from(round.weight_total).unwrap_or(0);
    if robust {
        let updates = crate::robust::RoundUpdates {
            blobs: &state.blobs,
            round_id: round.id,
            updates: &stored,
            len: layout.num_elements(),
        };
        match robust_aggregate(spec, &updates).await {
            Ok(aggregate) => (sum, weight_total) = (aggregate, 1),
            Err(failure) => return Ok(Err(failure)),
        }
    }
    if let (Some(privacy), RoundKind::Train) = (&spec.differential_privacy, round.kind) {
        // DP-FedAvg: the clipped sum plus noise, over the round's target
        // (a fixed denominator: the count of updates is not released). A
        // secure round's sum carries its devices' noise already.
        if spec.noise_target().is_none() {
            let seed = noise_seed.unwrap_or_default();
            let clip_norm = round.clip_norm.unwrap_or(privacy.clip_norm);
            let target = u32::try_from(round.target_devices).unwrap_or(u32::MAX);
            let stddev = privacy.noise_stddev(clip_norm, target);
            if let Err(reason) = crate::privacy::add_noise(&mut sum, &seed, round.id, stddev) {
                return Ok(Err(RoundFailure::Privacy(reason)));
            }
        }
        weight_total = u64::try_from(round.target_devices).unwrap_or(1).max(1);
    }
    let limit = state.settings.limits.max_model_bytes;
    let bytes = state.blobs.get(&base.digest, limit).await?;
    let built = tokio::task::spawn_blocking(move || match optimizer {
        Some(optimizer) => build_next_model(&bytes, &layout, &sum, weight_total, optimizer),
        None => build_fitted_model(&bytes, &sum, weight_total),
    });
    built.await.map_err(|source| OrchestratorError::Task {
        round: round.id,
        source,
    })
}

/// A robust round's aggregate of its stored updates by the job's rule, or
/// why the round fails.
async fn robust_aggregate(
    spec: &JobSpec,
    updates: &crate::robust::RoundUpdates<'_>,
) -> Result<Vec<f64>, RoundFailure> {
    let rule = match spec.robust_rule() {
        Ok(Some(rule)) => rule,
        Ok(None) => return Err(RoundFailure::Robust("the job has no robust rule".into())),
        Err(reason) => return Err(RoundFailure::Robust(reason)),
    };
    updates
        .aggregate(rule)
        .await
        .map_err(|error| RoundFailure::Robust(chain(&error)))
}

/// Composes a private round into its job's accountant, and records the ε
/// the job has spent after it, on the job and on the round, in the
/// transaction that records the round's version: a crash keeps both or
/// neither. A round selected before its sampling rate was recorded is
/// accounted at rate 1, the most it could have spent.
async fn account_for_round(
    tx: &mut Tx<'_>,
    round: &RoundRow,
    job: &JobRow,
    privacy: &crate::privacy::DifferentialPrivacy,
) -> Result<(), OrchestratorError> {
    let (seed, saved) = jobs::privacy_state(tx, job.id).await?;
    // A secure round is accounted by the noise its plan guaranteed.
    let plan = crate::store::secagg::get(&mut **tx, round.id)
        .await?
        .map(|secure| secure.plan);
    let composed = crate::privacy::load_accountant(saved.as_deref()).and_then(|mut accountant| {
        let event = privacy.round(round.dp_sampling_rate.unwrap_or(1.0), plan.as_ref());
        accountant
            .compose(&event)
            .map_err(|error| error.to_string())?;
        let epsilon = crate::privacy::epsilon(&accountant, privacy.delta)?;
        Ok((accountant, epsilon))
    });
    let next_clip = match privacy.adaptive_clipping {
        Some(_) => Some(adapted_clip(round, job, privacy, seed.as_deref())?),
        None => None,
    };
    let (accountant, epsilon) = composed.map_err(|reason| OrchestratorError::Privacy {
        job: job.id,
        reason,
    })?;
    let saved = crate::privacy::save_accountant(&accountant);
    jobs::record_privacy(tx, job.id, &saved, epsilon, next_clip).await?;
    rounds::set_epsilon(tx, round.id, epsilon).await?;
    Ok(())
}

/// The clip adaptive clipping gives the round after `round`, from how many
/// of its updates the fold found within its clip and the count's noise,
/// drawn from the job's noise secret `seed`.
fn adapted_clip(
    round: &RoundRow,
    job: &JobRow,
    privacy: &crate::privacy::DifferentialPrivacy,
    seed: Option<&str>,
) -> Result<f64, OrchestratorError> {
    let privacy_error = |reason: String| OrchestratorError::Privacy {
        job: job.id,
        reason,
    };
    let target_devices = u32::try_from(round.target_devices).unwrap_or(u32::MAX);
    let stddev = privacy.count_noise_stddev(target_devices).unwrap_or(0.0);
    let noise = crate::privacy::count_noise(seed.unwrap_or_default(), round.id, stddev)
        .map_err(privacy_error)?;
    let clipped = crate::privacy::ClippedRound {
        clip_norm: round.clip_norm.unwrap_or(privacy.clip_norm),
        unclipped: u64::try_from(round.dp_unclipped).unwrap_or(0),
        accepted: u64::try_from(round.updates_accepted).unwrap_or(0),
        target_devices,
    };
    Ok(privacy.next_clip(&clipped, noise))
}

/// A training round's end, once its version is stored: the federated and
/// central evaluations of it, and the optimizer's state for the next round.
async fn finish_training(
    state: &AppState,
    tx: &mut Tx<'_>,
    round: &RoundRow,
    job: &JobRow,
    spec: &JobSpec,
    version: &VersionRow,
    optimizer_state: &OptimizerState,
) -> Result<(), OrchestratorError> {
    if let Some(privacy) = &spec.differential_privacy {
        account_for_round(tx, round, job, privacy).await?;
    }
    let last = round.number >= i64::from(spec.rounds);
    // An asynchronous job's devices are busy training, so only its last
    // version is evaluated federatedly; the central evaluation takes each.
    let evaluating = match round.is_buffer() && !last {
        true => false,
        false => open_evaluation(state, tx, round, spec).await?,
    };
    // Central evaluation runs after the commit (`central.rs`); marking it
    // pending here makes it durable and holds the job open until it is done.
    let central = spec.evaluation.central_dataset.is_some();
    if central {
        evaluations::await_central(tx, round.id).await?;
    }
    let awaiting = evaluating || central;
    rounds::succeed(tx, round, version.id, i64::from(spec.rounds), awaiting).await?;
    if last {
        strategy_store::delete(tx, job.id).await?;
    } else {
        let encoded = optimizer_state.encode();
        strategy_store::put(tx, job.id, i64::from(optimizer_state.rounds), &encoded).await?;
    }
    if round.is_buffer() {
        next_buffer(tx, job.id, spec, last).await?;
    }
    tracing::info!(
        job = job.id, round = round.id, number = round.number, updates = round.updates_accepted,
        samples = round.weight_total, version = version.version, digest = %version.digest,
        "round succeeded"
    );
    Ok(())
}

/// After an asynchronous job's buffer made its version: the next buffer,
/// open at once on that version so that updates keep folding; or, after
/// the last, every device still training is let go.
async fn next_buffer(
    tx: &mut Tx<'_>,
    job_id: i64,
    spec: &JobSpec,
    last: bool,
) -> Result<(), OrchestratorError> {
    if last {
        let reason = "not needed: the job made its last version before this device uploaded";
        rounds::drop_buffered(tx, job_id, reason).await?;
        return Ok(());
    }
    let Some(job) = jobs::get_with(&mut **tx, job_id).await? else {
        return Ok(());
    };
    let new = next_round(&job, spec, RoundKind::Train);
    let mut deadline = now_ms() + i64::try_from(spec.round_deadline_ms).unwrap_or(i64::MAX / 2);
    if let Some(closes_by) = sub_round_deadline(tx, job_id).await? {
        deadline = deadline.min(closes_by);
    }
    if let Some(round_id) = rounds::open_buffer(tx, &new, deadline).await? {
        tracing::debug!(
            job = job_id,
            round = round_id,
            number = new.number,
            "opened buffer"
        );
    }
    Ok(())
}

/// A statistics round's end: its version, the model with the input
/// statistics the devices' moments fit, is the one the job's first
/// training round starts from.
async fn finish_statistics(
    tx: &mut Tx<'_>,
    round: &RoundRow,
    job: &JobRow,
    version: &VersionRow,
    stats: &canopy_engine::stats::InputStats,
) -> Result<(), OrchestratorError> {
    rounds::succeed_statistics(tx, round, version.id).await?;
    tracing::info!(
        job = job.id, round = round.id, devices = round.updates_accepted,
        samples = round.weight_total, mean = stats.mean, std = stats.std,
        version = version.version, digest = %version.digest, "input statistics fitted federatedly"
    );
    Ok(())
}

/// The model with its input statistics fitted from a statistics round's
/// sum: `Σ nᵢ·meanᵢ` and `Σ nᵢ·mean_sqᵢ` per feature, which are exactly
/// `Σx` and `Σx²` over all the devices' samples, `count` of them.
fn build_fitted_model(base: &[u8], sum: &[f64], count: u64) -> Result<NextVersion, RoundFailure> {
    fit_model(base, sum, count).map_err(RoundFailure::Statistics)
}

/// [`build_fitted_model`]'s work; an error is why the statistics cannot
/// be fitted.
fn fit_model(base: &[u8], sum: &[f64], count: u64) -> Result<NextVersion, String> {
    let mut model = canopy_ir::format::read_model(base)
        .map_err(|error| format!("the base model does not load: {}", chain(&error)))?;
    let features = sum.len() / 2;
    let moments = canopy_engine::stats::InputMoments {
        count,
        sum: sum[..features].to_vec(),
        sum_sq: sum[features..2 * features].to_vec(),
    };
    moments
        .validate_for(&model)
        .map_err(|error| chain(&error))?;
    let stats =
        canopy_engine::stats::fit_model(&mut model, &moments).map_err(|error| chain(&error))?;
    model.metadata.parent_digest = canopy_ir::format::digest(base).ok();
    let file = canopy_ir::format::write_model(&model)
        .map_err(|error| format!("the fitted model does not serialise: {error}"))?;
    Ok(NextVersion::Fitted { file, stats })
}

/// The job's server optimizer and its state before this round: the stored
/// one, or a fresh one before the first successful round. An `Err` inside
/// is why the round fails (a spec or state that cannot be used).
async fn strategy_state(
    tx: &mut Tx<'_>,
    round: &RoundRow,
    job: &JobRow,
    spec: &JobSpec,
    len: usize,
) -> Result<Result<(ServerOptimizer, OptimizerState), RoundFailure>, OrchestratorError> {
    let optimizer = match spec.strategy.resolve() {
        Ok(optimizer) => optimizer,
        Err(reason) => return Ok(Err(RoundFailure::InvalidStrategy(reason))),
    };
    let Some((rounds_folded, bytes)) = strategy_store::get(tx, job.id).await? else {
        return Ok(Ok((optimizer, optimizer.initial_state(len))));
    };
    // A round's number is one past the job's successful rounds, and the
    // state is replaced with each, so they must agree.
    if rounds_folded != round.number - 1 {
        return Ok(Err(RoundFailure::StrategyStateOutOfStep {
            folded: rounds_folded,
            round: round.number,
        }));
    }
    Ok(OptimizerState::decode(&bytes)
        .map(|state| (optimizer, state))
        .map_err(RoundFailure::StrategyState))
}

/// Parses the base model, steps the job's server optimizer on the mean
/// update, and serialises the result with its lineage.
fn build_next_model(
    base: &[u8],
    layout: &canopy_protocol::update::UpdateLayout,
    sum: &[f64],
    weight_total: u64,
    (optimizer, mut optimizer_state): (ServerOptimizer, OptimizerState),
) -> Result<NextVersion, RoundFailure> {
    let mut model = canopy_ir::format::read_model(base)
        .map_err(|error| RoundFailure::BaseModel(chain(&error)))?;
    let parent_digest = canopy_ir::format::digest(base).ok();
    let mean = fedavg::mean_update(layout, sum, weight_total)?;
    let step = optimizer.step(&mut optimizer_state, &mean)?;
    fedavg::apply_step(&mut model, layout, &step)?;
    model.metadata.parent_digest = parent_digest;
    let file = canopy_ir::format::write_model(&model)
        .map_err(|error| RoundFailure::Serialise(error.to_string()))?;
    Ok(NextVersion::Trained {
        file,
        optimizer_state,
    })
}
