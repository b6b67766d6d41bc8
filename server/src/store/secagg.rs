//! The durable state of secure-aggregation rounds: the round's stage, plan
//! and graph seed, each participant's advertised keys, seed commitment,
//! survivor-set signature and revealed shares, and the share ciphertexts
//! in transit between devices. No individual plaintext update is ever stored: masked vectors are folded
//! into the round's running sum (`round_sums`) as they arrive and not kept.

use crate::store::row::any_row;
use canopy_protocol::secagg::Plan;

use super::rounds::{LEFT_STATES, PENDING_STATES, ParticipantState, RoundState, Tx};
use super::task_state::{self, Admission, TaskState, Value};
use super::{parse_state, text_enum};
use crate::db::{Db, now_ms};

text_enum! {
    /// The stages of a secure round while it is `training`, in order
    /// (variants compare by it).
    pub enum SecureStage {
        /// AdvertiseKeys.
        Advertise = "advertise",
        /// ShareKeys.
        Share = "share",
        /// ShareCheck: devices report the neighbours whose shares would
        /// not open; those are excluded before anyone masks.
        Check = "check",
        /// MaskedInputCollection, which includes training.
        Collect = "collect",
        /// ConsistencyCheck: survivors sign the survivor set.
        Consistency = "consistency",
        /// Unmasking.
        Unmask = "unmask",
    }
}

impl SecureStage {
    /// What the stage waits for from each live participant, spelled for
    /// SQL and for Rust side by side so the two cannot drift: the column
    /// left empty, and whether a participant's row holds it.
    pub fn answer(self) -> (&'static str, fn(&SecureParticipant) -> bool) {
        match self {
            SecureStage::Advertise => ("secagg_keys", |p| p.secagg_keys.is_some()),
            SecureStage::Share => ("secagg_commitment", |p| p.secagg_commitment.is_some()),
            SecureStage::Check => ("secagg_receipt", |p| p.secagg_receipt.is_some()),
            // `uploaded_ms` is set exactly when the state becomes uploaded.
            SecureStage::Collect => ("uploaded_ms", |p| p.state == ParticipantState::Uploaded),
            SecureStage::Consistency => ("secagg_signature", |p| p.secagg_signature.is_some()),
            SecureStage::Unmask => ("secagg_reveal", |p| p.secagg_reveal.is_some()),
        }
    }

    /// Whether `participant` has sent what this stage waits for.
    pub fn answered_by(self, participant: &SecureParticipant) -> bool {
        (self.answer().1)(participant)
    }

    /// The stage whose answer a participant's message in this stage builds
    /// on: shares need advertised keys, a receipt and a masked input need
    /// shares, and only a survivor (its masked input in the sum) signs the
    /// survivor set or helps unmask.
    pub fn builds_on(self) -> Option<SecureStage> {
        match self {
            SecureStage::Advertise => None,
            SecureStage::Share => Some(SecureStage::Advertise),
            SecureStage::Check | SecureStage::Collect => Some(SecureStage::Share),
            SecureStage::Consistency | SecureStage::Unmask => Some(SecureStage::Collect),
        }
    }
}

any_row! {
    #[derive(Clone, Debug)]
    struct SecureRoundRow {
        id: i64,
        job_id: i64,
        /// Named apart from the participant's state, which a joined read
        /// ([`round_and_participant`]) selects beside it.
        round_state: RoundState as String,
        status_message: String,
        secagg_stage: Option<String>,
        secagg_plan: Option<String>,
        secagg_seed: Option<Vec<u8>>,
        stage_deadline_ms: Option<i64>,
        deadline_ms: Option<i64>,
    }
}

/// A secure round as the device API and the orchestrator see it.
#[derive(Clone, Debug)]
pub struct SecureRound {
    pub id: i64,
    pub job_id: i64,
    pub state: RoundState,
    pub status_message: String,
    pub stage: SecureStage,
    pub plan: Plan,
    /// The graph's seed; deleted, with the rest, once the round ends.
    pub seed: Option<[u8; 32]>,
    pub stage_deadline_ms: i64,
    pub deadline_ms: i64,
}

/// The round, if it runs secure aggregation and is past selection.
pub async fn get<'e, E>(executor: E, round_id: i64) -> Result<Option<SecureRound>, sqlx::Error>
where
    E: sqlx::Executor<'e, Database = sqlx::Any>,
{
    let row: Option<SecureRoundRow> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {ROUND_COLUMNS} FROM rounds r WHERE r.id = $1"
    )))
    .bind(round_id)
    .fetch_optional(executor)
    .await?;
    row.map_or(Ok(None), secure_round)
}

const ROUND_COLUMNS: &str = "r.id, r.job_id, r.state AS round_state, r.status_message, \
     r.secagg_stage, r.secagg_plan, r.secagg_seed, r.stage_deadline_ms, r.deadline_ms";

struct RoundAndParticipantRow {
    round: SecureRoundRow,
    participant: SecureParticipant,
}

/// Both halves read from the one joined row, each by its own columns.
impl<'r> sqlx::FromRow<'r, sqlx::any::AnyRow> for RoundAndParticipantRow {
    fn from_row(row: &'r sqlx::any::AnyRow) -> Result<Self, sqlx::Error> {
        Ok(Self {
            round: SecureRoundRow::from_row(row)?,
            participant: SecureParticipant::from_row(row)?,
        })
    }
}

/// The round and one of its participants in one read: what every device
/// request of a secure round starts with (each read is a hand-off to the
/// database's worker, and at 1,000 devices a secure round makes tens of
/// thousands). `None` when the device is not the round's participant or
/// the round does not exist; the round part is `None` when it is not a
/// secure round.
pub async fn round_and_participant<'e, E>(
    executor: E,
    round_id: i64,
    device_id: i64,
) -> Result<Option<(Option<SecureRound>, SecureParticipant)>, sqlx::Error>
where
    E: sqlx::Executor<'e, Database = sqlx::Any>,
{
    let row: Option<RoundAndParticipantRow> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {ROUND_COLUMNS}, {PARTICIPANT_COLUMNS} FROM rounds r \
         JOIN participants p ON p.round_id = r.id \
         JOIN devices d ON d.id = p.device_id \
         WHERE r.id = $1 AND p.device_id = $2"
    )))
    .bind(round_id)
    .bind(device_id)
    .fetch_optional(executor)
    .await?;
    let Some(RoundAndParticipantRow { round, participant }) = row else {
        return Ok(None);
    };
    Ok(Some((secure_round(round)?, participant)))
}

/// The row as a secure round; `None` for a plain round.
fn secure_round(row: SecureRoundRow) -> Result<Option<SecureRound>, sqlx::Error> {
    let (Some(stage), Some(plan)) = (row.secagg_stage, row.secagg_plan) else {
        return Ok(None);
    };
    let stage = parse_state("rounds.secagg_stage", stage)?;
    let plan: Plan = super::from_json("rounds.secagg_plan", &plan)?;
    let seed = row
        .secagg_seed
        .map(|seed| {
            <[u8; 32]>::try_from(seed).map_err(|_| {
                sqlx::Error::Decode(format!("round {}'s graph seed is not 32 bytes", row.id).into())
            })
        })
        .transpose()?;
    Ok(Some(SecureRound {
        id: row.id,
        job_id: row.job_id,
        state: row.round_state,
        status_message: row.status_message,
        stage,
        plan,
        seed,
        stage_deadline_ms: row.stage_deadline_ms.unwrap_or(0),
        deadline_ms: row.deadline_ms.unwrap_or(0),
    }))
}

/// Makes a freshly selected round secure: AdvertiseKeys opens.
pub async fn begin(
    tx: &mut Tx<'_>,
    round_id: i64,
    plan: &Plan,
    seed: &[u8; 32],
    stage_deadline_ms: i64,
) -> Result<(), sqlx::Error> {
    let plan = serde_json::to_string(plan).map_err(|e| sqlx::Error::Encode(Box::new(e)))?;
    sqlx::query(
        "UPDATE rounds SET secagg_stage = $1, secagg_plan = $2, secagg_seed = $3, \
         stage_deadline_ms = $4 WHERE id = $5",
    )
    .bind(SecureStage::Advertise.as_str())
    .bind(plan)
    .bind(seed.to_vec())
    .bind(stage_deadline_ms)
    .bind(round_id)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

pub async fn set_stage(
    tx: &mut Tx<'_>,
    round_id: i64,
    stage: SecureStage,
    stage_deadline_ms: i64,
) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE rounds SET secagg_stage = $1, stage_deadline_ms = $2 WHERE id = $3")
        .bind(stage.as_str())
        .bind(stage_deadline_ms)
        .bind(round_id)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Every device selected for the round, dropped or not: the graph's nodes.
pub async fn participant_ids<'e, E>(executor: E, round_id: i64) -> Result<Vec<u64>, sqlx::Error>
where
    E: sqlx::Executor<'e, Database = sqlx::Any>,
{
    let rows: Vec<(i64,)> =
        sqlx::query_as("SELECT device_id FROM participants WHERE round_id = $1 ORDER BY device_id")
            .bind(round_id)
            .fetch_all(executor)
            .await?;
    Ok(rows.into_iter().map(|(id,)| id as u64).collect())
}

any_row! {
    /// One participant's progress through the stages.
    #[derive(Clone, Debug)]
    pub struct SecureParticipant {
        pub device_id: i64,
        pub state: ParticipantState as String,
        pub secagg_keys: Option<Vec<u8>>,
        pub secagg_commitment: Option<Vec<u8>>,
        pub secagg_reveal: Option<Vec<u8>>,
        /// ShareCheck's receipt: the neighbours whose shares the device could
        /// not open (see [`receipt_ids`]).
        pub secagg_receipt: Option<Vec<u8>>,
        /// The survivor set, signed in ConsistencyCheck.
        pub secagg_signature: Option<Vec<u8>>,
        pub public_key: Vec<u8>,
        /// The device authority's certificate of that key, if it has one.
        pub certificate: Option<Vec<u8>>,
    }
}

const PARTICIPANT_COLUMNS: &str = "p.device_id, p.state, p.secagg_keys, \
     p.secagg_commitment, p.secagg_reveal, p.secagg_receipt, p.secagg_signature, d.public_key, \
     d.certificate";

const PARTICIPANT_FROM: &str = "FROM participants p JOIN devices d ON d.id = p.device_id";

/// Every participant of the round, for the orchestrator's stage decisions
/// and for unmasking: O(n) rows of a few hundred bytes.
pub async fn participants<'e, E>(
    executor: E,
    round_id: i64,
) -> Result<Vec<SecureParticipant>, sqlx::Error>
where
    E: sqlx::Executor<'e, Database = sqlx::Any>,
{
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {PARTICIPANT_COLUMNS} {PARTICIPANT_FROM} WHERE p.round_id = $1 ORDER BY p.device_id"
    )))
    .bind(round_id)
    .fetch_all(executor)
    .await
}

/// A device's message of a key stage, ConsistencyCheck or Unmasking, as
/// stored: each is taken once, while its stage is open, and a round's
/// queued writes commit together (group commit, as for updates), since a
/// transaction per message made the database the bottleneck of those
/// stages.
pub enum StageWrite {
    /// AdvertiseKeys: channel key, mask key and signature.
    Keys { device_id: i64, keys: Vec<u8> },
    /// ShareKeys: the seed commitment and the ciphertexts sealed for the
    /// neighbours, as (recipient, ciphertext).
    Shares {
        device_id: i64,
        commitment: [u8; 32],
        ciphertexts: Vec<(u64, Vec<u8>)>,
    },
    /// ShareCheck: the neighbours whose shares would not open.
    Receipt { device_id: i64, reported: Vec<u64> },
    /// ConsistencyCheck: the signed survivor set.
    Signature { device_id: i64, signature: [u8; 64] },
    /// Unmasking: the revealed shares.
    Reveal { device_id: i64, reveal: Vec<u8> },
    /// A server message sent to a device: counted as the round's traffic
    /// out, and always taken.
    Sent { bytes: u64 },
}

/// A queued write with the size of the message it came in, counted as
/// the round's traffic once taken.
pub struct QueuedWrite {
    pub write: StageWrite,
    pub message_bytes: u64,
}

/// Applies a batch of one round's writes in one transaction: per write,
/// whether it was taken (false: the device already sent one, or the stage
/// or the device's state no longer allow it).
pub async fn save_stage_writes(
    db: &Db,
    round_id: i64,
    writes: &[QueuedWrite],
) -> Result<Vec<bool>, sqlx::Error> {
    let _writer = db.write_lock().await;
    let mut tx = db.pool.begin().await?;
    let mut taken = Vec::with_capacity(writes.len());
    let (mut bytes_in, mut bytes_out) = (0u64, 0u64);
    for queued in writes {
        if let StageWrite::Sent { bytes } = queued.write {
            bytes_out = bytes_out.saturating_add(bytes);
            taken.push(true);
            continue;
        }
        let saved = save_write(&mut tx, round_id, &queued.write).await?;
        if saved {
            bytes_in = bytes_in.saturating_add(queued.message_bytes);
        }
        taken.push(saved);
    }
    sqlx::query(
        "UPDATE rounds SET bytes_in = bytes_in + $1, bytes_out = bytes_out + $2 WHERE id = $3",
    )
    .bind(i64::try_from(bytes_in).unwrap_or(i64::MAX))
    .bind(i64::try_from(bytes_out).unwrap_or(i64::MAX))
    .bind(round_id)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(taken)
}

async fn save_write(
    tx: &mut Tx<'_>,
    round_id: i64,
    write: &StageWrite,
) -> Result<bool, sqlx::Error> {
    let (sql, device_id, value): (String, i64, Vec<u8>) = match write {
        StageWrite::Keys { device_id, keys } => (
            format!(
                "UPDATE participants SET secagg_keys = $1, \
                 delivered_ms = COALESCE(delivered_ms, {now}) WHERE round_id = $2 \
                 AND device_id = $3 AND secagg_keys IS NULL AND state IN {PENDING_STATES} \
                 AND {open}",
                now = now_ms(),
                open = stage_open(SecureStage::Advertise),
            ),
            *device_id,
            keys.clone(),
        ),
        StageWrite::Shares {
            device_id,
            commitment,
            ..
        } => (
            format!(
                "UPDATE participants SET secagg_commitment = $1 WHERE round_id = $2 \
                 AND device_id = $3 AND secagg_commitment IS NULL AND secagg_keys IS NOT NULL \
                 AND state IN {PENDING_STATES} AND {}",
                stage_open(SecureStage::Share)
            ),
            *device_id,
            commitment.to_vec(),
        ),
        StageWrite::Receipt {
            device_id,
            reported,
        } => (
            format!(
                "UPDATE participants SET secagg_receipt = $1 WHERE round_id = $2 \
                 AND device_id = $3 AND secagg_receipt IS NULL AND secagg_commitment IS NOT NULL \
                 AND state IN {PENDING_STATES} AND {}",
                stage_open(SecureStage::Check)
            ),
            *device_id,
            reported.iter().flat_map(|id| id.to_le_bytes()).collect(),
        ),
        StageWrite::Signature {
            device_id,
            signature,
        } => (
            format!(
                "UPDATE participants SET secagg_signature = $1 WHERE round_id = $2 \
                 AND device_id = $3 AND secagg_signature IS NULL AND state = 'uploaded' AND {}",
                stage_open(SecureStage::Consistency)
            ),
            *device_id,
            signature.to_vec(),
        ),
        StageWrite::Sent { .. } => return Ok(true),
        StageWrite::Reveal { device_id, reveal } => (
            format!(
                "UPDATE participants SET secagg_reveal = $1 WHERE round_id = $2 \
                 AND device_id = $3 AND secagg_reveal IS NULL AND state = 'uploaded' AND {}",
                stage_open(SecureStage::Unmask)
            ),
            *device_id,
            reveal.clone(),
        ),
    };
    let saved = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(value)
        .bind(round_id)
        .bind(device_id)
        .execute(&mut **tx)
        .await?;
    if saved.rows_affected() != 1 {
        return Ok(false);
    }
    if let StageWrite::Shares { ciphertexts, .. } = write {
        insert_shares(tx, round_id, device_id, ciphertexts).await?;
    }
    Ok(true)
}

/// Share rows one INSERT writes at most: 2 + 2 × 256 parameters, far
/// below SQLite's 32,766 and PostgreSQL's 65,535.
const SHARE_ROWS_PER_INSERT: usize = 256;

/// A device's share ciphertexts, k rows in one statement (up to
/// [`SHARE_ROWS_PER_INSERT`]) rather than one statement a row: each
/// statement is a hand-off to SQLite's worker thread, and a row a
/// statement was 22 of a device's 90 statements in a secure round at
/// N = 100.
async fn insert_shares(
    tx: &mut Tx<'_>,
    round_id: i64,
    device_id: i64,
    ciphertexts: &[(u64, Vec<u8>)],
) -> Result<(), sqlx::Error> {
    for batch in ciphertexts.chunks(SHARE_ROWS_PER_INSERT) {
        // $1 and $2 (round, sender) are shared by every row.
        let rows: Vec<String> = (0..batch.len())
            .map(|row| format!("($1, ${}, $2, ${})", 3 + 2 * row, 4 + 2 * row))
            .collect();
        let sql = format!(
            "INSERT INTO secagg_shares (round_id, to_device, from_device, ciphertext) VALUES {}",
            rows.join(", ")
        );
        let mut insert = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(round_id)
            .bind(device_id);
        for (to, ciphertext) in batch {
            insert = insert.bind(*to as i64).bind(ciphertext.as_slice());
        }
        insert.execute(&mut **tx).await?;
    }
    Ok(())
}

/// The condition that round $2 is training in `stage`.
fn stage_open(stage: SecureStage) -> String {
    format!(
        "EXISTS (SELECT 1 FROM rounds r WHERE r.id = $2 AND r.state = 'training' \
         AND r.secagg_stage = '{}')",
        stage.as_str()
    )
}

/// The ciphertexts sealed for `device_id`, as (sender, ciphertext).
pub async fn incoming_shares(
    db: &Db,
    round_id: i64,
    device_id: i64,
) -> Result<Vec<(u64, Vec<u8>)>, sqlx::Error> {
    let rows: Vec<(i64, Vec<u8>)> = sqlx::query_as(
        // Every sender that completed ShareKeys, even one that dropped out
        // since: the server unmasks on the basis that each surviving
        // neighbour of a sender received its shares and masked with it.
        "SELECT from_device, ciphertext FROM secagg_shares \
         WHERE round_id = $1 AND to_device = $2 ORDER BY from_device",
    )
    .bind(round_id)
    .bind(device_id)
    .fetch_all(&db.pool)
    .await?;
    Ok(rows.into_iter().map(|(from, c)| (from as u64, c)).collect())
}

/// The devices whose masked input is in the sum, ascending: once
/// MaskedInputCollection has closed, the survivor set of ConsistencyCheck.
pub async fn survivor_ids(db: &Db, round_id: i64) -> Result<Vec<u64>, sqlx::Error> {
    let rows: Vec<(i64,)> = sqlx::query_as(
        "SELECT device_id FROM participants WHERE round_id = $1 AND state = 'uploaded' \
         ORDER BY device_id",
    )
    .bind(round_id)
    .fetch_all(&db.pool)
    .await?;
    Ok(rows.into_iter().map(|(id,)| id as u64).collect())
}

/// How many live participants have not yet sent what `stage` waits for:
/// one count, without the rows, so that the orchestrator can tell a stage
/// that still waits without taking the write lock.
pub async fn unanswered<'e, E>(
    executor: E,
    round_id: i64,
    stage: SecureStage,
) -> Result<i64, sqlx::Error>
where
    E: sqlx::Executor<'e, Database = sqlx::Any>,
{
    let (missing_column, _) = stage.answer();
    let (count,): (i64,) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT COUNT(*) FROM participants WHERE round_id = $1 \
         AND state NOT IN {LEFT_STATES} AND {missing_column} IS NULL"
    )))
    .bind(round_id)
    .fetch_one(executor)
    .await?;
    Ok(count)
}

/// Drops the live participants that did not send what `stage` waits for
/// by its close; returns how many.
pub async fn drop_laggards(
    tx: &mut Tx<'_>,
    round_id: i64,
    stage: SecureStage,
) -> Result<u64, sqlx::Error> {
    let (missing_column, _) = stage.answer();
    // Survivors of Collect are no longer pending: nobody is dropped for
    // ConsistencyCheck or Unmasking.
    let dropped = sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE participants SET state = 'dropped', drop_reason = $2 WHERE round_id = $1 \
         AND state IN {PENDING_STATES} AND {missing_column} IS NULL"
    )))
    .bind(round_id)
    .bind(format!(
        "timeout: sent nothing for the secure `{stage}` stage before it closed"
    ))
    .execute(&mut **tx)
    .await?;
    sqlx::query("UPDATE rounds SET dropouts = dropouts + $1 WHERE id = $2")
        .bind(dropped.rows_affected() as i64)
        .bind(round_id)
        .execute(&mut **tx)
        .await?;
    Ok(dropped.rows_affected())
}

/// The neighbours a stored ShareCheck receipt reports (8-byte
/// little-endian ids, as [`StageWrite::Receipt`] stores them).
pub fn receipt_ids(stored: &[u8]) -> Vec<u64> {
    stored
        .chunks_exact(8)
        .map(|id| u64::from_le_bytes(id.try_into().expect("8-byte chunk")))
        .collect()
}

/// Takes the devices ShareCheck excluded out of the round, as if they had
/// never shared: dropped, with the reason, their seed commitment cleared
/// (so nothing of theirs is rebuilt) and their ciphertexts deleted.
/// `reporters` names, per excluded device, who reported it.
pub async fn exclude(
    tx: &mut Tx<'_>,
    round_id: i64,
    reporters: &std::collections::BTreeMap<u64, Vec<u64>>,
) -> Result<(), sqlx::Error> {
    for (&device_id, by) in reporters {
        let by: Vec<String> = by.iter().map(u64::to_string).collect();
        sqlx::query(
            "UPDATE participants SET state = 'dropped', drop_reason = $3, \
             secagg_commitment = NULL WHERE round_id = $1 AND device_id = $2",
        )
        .bind(round_id)
        .bind(device_id as i64)
        .bind(format!(
            "excluded: device(s) {} could not open the shares it sealed for them",
            by.join(", ")
        ))
        .execute(&mut **tx)
        .await?;
        sqlx::query("DELETE FROM secagg_shares WHERE round_id = $1 AND from_device = $2")
            .bind(round_id)
            .bind(device_id as i64)
            .execute(&mut **tx)
            .await?;
    }
    sqlx::query("UPDATE rounds SET dropouts = dropouts + $1 WHERE id = $2")
        .bind(reporters.len() as i64)
        .bind(round_id)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// A masked input as it arrived, waiting in the round's fold queue.
pub struct MaskedUpload {
    pub device_id: i64,
    /// The MaskedInput message.
    pub message: bytes::Bytes,
}

/// Folds a batch of masked inputs into the round's running sum and marks
/// each accepted device uploaded, in one transaction under the round's
/// lock: the sum is read and written once per batch, not once per input
/// (group commit, as for plain updates). `open` turns the stored sum into
/// its working form and `close` back; `add` checks one message and adds
/// it, or refuses it with an error, which leaves the sum and that device
/// unchanged while the rest of the batch goes on. Per upload in order: the
/// number of masked inputs accepted so far, or why it was refused.
pub async fn fold_masked_batch<S, E>(
    db: &Db,
    round_id: i64,
    uploads: &[MaskedUpload],
    open: impl FnOnce(Option<Vec<u8>>) -> Result<S, String>,
    add: impl Fn(&mut S, &MaskedUpload) -> Result<(), E>,
    close: impl FnOnce(&S) -> Vec<u8>,
) -> Result<Vec<Result<u64, MaskedRejection<E>>>, sqlx::Error> {
    let _slot = db.round_write_slot().await;
    let _writer = db.write_lock().await;
    let mut tx = db.pool.begin().await?;
    let round: Option<(String, Option<String>)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT state, secagg_stage FROM rounds WHERE id = $1{}",
        db.for_update()
    )))
    .bind(round_id)
    .fetch_optional(&mut *tx)
    .await?;
    let Some((state, stage)) = round else {
        return Ok(uploads
            .iter()
            .map(|_| Err(MaskedRejection::Closed))
            .collect());
    };
    let state: RoundState = parse_state("rounds.state", state)?;
    let stage = stage
        .map(|stage| parse_state("rounds.secagg_stage", stage))
        .transpose()?;
    if state != RoundState::Training || stage != Some(SecureStage::Collect) {
        return Ok(uploads
            .iter()
            .map(|_| Err(MaskedRejection::Closed))
            .collect());
    }
    let stored = super::rounds::update_sum(&mut tx, round_id).await?;
    let mut sum = open(stored).map_err(|message| sqlx::Error::Decode(message.into()))?;
    let now = now_ms();
    let mut outcomes = Vec::with_capacity(uploads.len());
    let (mut accepted, mut bytes_in) = (0i64, 0i64);
    let mut seen = std::collections::HashSet::new();
    for upload in uploads {
        let outcome = match eligibility(&mut tx, round_id, upload.device_id).await? {
            Err(rejection) => Err(rejection),
            // Two of one device's inputs in the same batch.
            Ok(()) if !seen.insert(upload.device_id) => Err(MaskedRejection::Duplicate),
            Ok(()) => add(&mut sum, upload).map_err(MaskedRejection::Refused),
        };
        if outcome.is_ok() {
            let size = i64::try_from(upload.message.len()).unwrap_or(i64::MAX);
            mark_uploaded(&mut tx, round_id, upload.device_id, size, now).await?;
            accepted += 1;
            bytes_in = bytes_in.saturating_add(size);
        }
        outcomes.push(outcome);
    }
    if accepted == 0 {
        return Ok(outcomes.into_iter().map(|o| o.map(|()| 0)).collect());
    }
    super::rounds::store_sum(&mut tx, round_id, close(&sum)).await?;
    let batch = super::rounds::BatchCount {
        accepted,
        bytes_in,
        ..Default::default()
    };
    let counted = super::rounds::count_batch(&mut tx, round_id, batch).await?;
    tx.commit().await?;
    Ok(super::rounds::numbered(outcomes, counted))
}

/// Whether a device may send its masked input now: it completed ShareKeys,
/// is still in the round, and has not sent one.
async fn eligibility<E>(
    tx: &mut Tx<'_>,
    round_id: i64,
    device_id: i64,
) -> Result<Result<(), MaskedRejection<E>>, sqlx::Error> {
    let participant: Option<(String, Option<Vec<u8>>)> = sqlx::query_as(
        "SELECT state, secagg_commitment FROM participants WHERE round_id = $1 AND device_id = $2",
    )
    .bind(round_id)
    .bind(device_id)
    .fetch_optional(&mut **tx)
    .await?;
    let Some((participant, commitment)) = participant else {
        return Ok(Err(MaskedRejection::NotEligible));
    };
    let participant: ParticipantState = parse_state("participants.state", participant)?;
    // The round collects masked inputs: the caller checked it under its lock.
    Ok(match task_state::admit(Some(participant.phase()), true) {
        Admission::Answered => Err(MaskedRejection::Duplicate),
        Admission::Taken if commitment.is_some() => Ok(()),
        _ => Err(MaskedRejection::NotEligible),
    })
}

/// Moves an admitted participant to `uploaded`. Under the round's lock
/// it is still pending; if not, the batch is aborted rather than count an
/// input whose sender the round no longer holds.
async fn mark_uploaded(
    tx: &mut Tx<'_>,
    round_id: i64,
    device_id: i64,
    size: i64,
    now: i64,
) -> Result<(), sqlx::Error> {
    let columns = [
        ("uploaded_ms", Value::Int(now)),
        ("update_bytes", Value::Int(size)),
    ];
    let uploaded = ParticipantState::Uploaded;
    if task_state::move_pending(tx, round_id, device_id, uploaded, &columns).await? {
        return Ok(());
    }
    Err(sqlx::Error::Protocol(format!(
        "device {device_id} left round {round_id} while its masked input was folded"
    )))
}

/// Why a masked vector was not folded in.
#[derive(Debug)]
pub enum MaskedRejection<E> {
    /// The round is not collecting masked inputs (any more).
    Closed,
    Duplicate,
    /// The device did not complete ShareKeys, or was dropped.
    NotEligible,
    Refused(E),
}

/// Replaces the masked sum with the unmasked aggregate (Σwᵢ·Δᵢ as f64, and
/// Σwᵢ), the same form plain rounds keep, and closes the round for
/// aggregation.
pub async fn store_aggregate(
    tx: &mut Tx<'_>,
    round_id: i64,
    sum: &[u8],
    weight_total: u64,
) -> Result<(), sqlx::Error> {
    let closed = sqlx::query(
        "UPDATE rounds SET weight_total = $1, state = 'aggregating', \
         closed_ms = $2 WHERE id = $3 AND state = 'training'",
    )
    .bind(i64::try_from(weight_total).unwrap_or(i64::MAX))
    .bind(now_ms())
    .bind(round_id)
    .execute(&mut **tx)
    .await?;
    if closed.rows_affected() == 1 {
        super::rounds::store_sum(tx, round_id, sum.to_vec()).await?;
    }
    Ok(())
}

/// Deletes everything secure aggregation kept for a round once it has
/// ended: shares, keys, commitments and revealed shares.
pub async fn purge(tx: &mut Tx<'_>, round_id: i64) -> Result<(), sqlx::Error> {
    sqlx::query("DELETE FROM secagg_shares WHERE round_id = $1")
        .bind(round_id)
        .execute(&mut **tx)
        .await?;
    sqlx::query(
        "UPDATE participants SET secagg_keys = NULL, secagg_commitment = NULL, \
         secagg_reveal = NULL, secagg_receipt = NULL, secagg_signature = NULL \
         WHERE round_id = $1",
    )
    .bind(round_id)
    .execute(&mut **tx)
    .await?;
    sqlx::query("UPDATE rounds SET secagg_seed = NULL WHERE id = $1")
        .bind(round_id)
        .execute(&mut **tx)
        .await?;
    Ok(())
}
