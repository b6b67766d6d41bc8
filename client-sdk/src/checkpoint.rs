//! Checkpoints of a task's local training, so that training killed at any
//! step (mobile systems stop background work when they please) resumes
//! where it stopped, in a new process, and ends with the update an
//! uninterrupted run gives (bit for bit on the CPU).
//!
//! One file per task, at a path the caller chooses
//! ([`CheckpointSettings`]). [`crate::train::train_task`] writes it
//! every [`CheckpointSettings::every_steps`] steps and when cancelled,
//! resumes from it when it belongs to the same training, and deletes it
//! when training succeeds.
//!
//! # Format (version 1)
//!
//! ```text
//! magic "CANOPYCK" (8 bytes) | version, u32 little-endian | a model file
//! ```
//!
//! The model file is the Canopy IR format ([`canopy_ir::format`]), which
//! brings its bounds, its hardened reader and a SHA-256 of the whole
//! content: a torn or corrupted checkpoint fails to read, and is ignored
//! with a warning. It has no entry points; its parameters are the
//! trainer's state ([`canopy_engine::train::TrainerState`]), one per value
//! under its `train_step` input name (`params/NAME`, `state/NAME/SLOT`,
//! `anchor/NAME`); its metadata properties say which training it belongs
//! to ([`TaskIdentity`]: the task, the model's digest, the seed, the
//! data's fingerprint and the training settings) and where it stands (the
//! epochs and batches done, the epoch's running sums, the steps). Floats
//! are stored as their bits in hex, so they come back exactly.
//!
//! Writing is atomic ([`crate::files::write_atomic`]): a crash leaves the
//! old checkpoint or the new one. The file is readable by its owner only
//! ([`CHECKPOINT_FILE_MODE`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use canopy_engine::Value;
use canopy_engine::data::Dataset;
use canopy_engine::train::{EpochSums, TrainerState};
use canopy_ir::format::{FormatError, ReadLimits};
use canopy_ir::{Metadata, Model, Parameter};
use canopy_protocol::messages::Task;
use sha2::{Digest, Sha256};

/// The first eight bytes of a checkpoint file.
pub const CHECKPOINT_MAGIC: [u8; 8] = *b"CANOPYCK";
/// The checkpoint layout this crate writes and the only one it reads; a
/// checkpoint of another version is ignored (training starts over).
pub const CHECKPOINT_VERSION: u32 = 1;
/// Steps between checkpoints unless the caller says: on a phone's CPU a
/// step of a small model takes milliseconds, and writing a checkpoint
/// costs about a model's size in writes, so every 20 steps bounds the
/// work lost to a kill to a few seconds without wearing the storage.
pub const DEFAULT_CHECKPOINT_EVERY_STEPS: u32 = 20;
/// The largest checkpoint read or written: a model's parameters (at most
/// [`canopy_protocol::bounds::MAX_MODEL_BYTES`]), Adam's two slots per
/// trainable parameter and FedProx anchors.
pub const MAX_CHECKPOINT_BYTES: u64 = 4 * canopy_protocol::bounds::MAX_MODEL_BYTES;

/// The permission bits of a checkpoint file on Unix: its parameters were
/// trained on the device's data, which is not for other users to read.
pub const CHECKPOINT_FILE_MODE: u32 = 0o600;

/// The model name a checkpoint's model file carries.
const CHECKPOINT_MODEL_NAME: &str = "canopy-checkpoint";
/// Magic and version.
const ENVELOPE_LEN: usize = 12;

/// Where and how often [`crate::train::train_task`] checkpoints.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointSettings {
    /// The checkpoint file of this task. Use one path per task (e.g. named
    /// by the round): a checkpoint of another training found here is
    /// ignored and overwritten.
    pub path: PathBuf,
    /// Steps between checkpoints; 0 writes one only when training is
    /// cancelled. See [`DEFAULT_CHECKPOINT_EVERY_STEPS`].
    pub every_steps: u32,
}

impl CheckpointSettings {
    /// A checkpoint at `path` every [`DEFAULT_CHECKPOINT_EVERY_STEPS`].
    pub fn new(path: impl Into<PathBuf>) -> CheckpointSettings {
        CheckpointSettings {
            path: path.into(),
            every_steps: DEFAULT_CHECKPOINT_EVERY_STEPS,
        }
    }
}

/// What a checkpoint file says about itself, for status displays
/// ([`peek`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointInfo {
    pub job_id: i64,
    pub round_id: i64,
    pub model_version_id: i64,
    /// Training steps the checkpoint holds the result of.
    pub steps_done: u64,
    /// Steps of the whole training (epochs × batches per epoch).
    pub total_steps: u64,
    /// Epochs finished.
    pub epochs_done: u32,
    /// Batches done of the epoch after those.
    pub batches_done: u64,
    /// The file's size.
    pub bytes: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// The atomic write failed; the error names the step.
    #[error("cannot write the training checkpoint")]
    Write(#[source] crate::files::WriteError),
    #[error("cannot delete the training checkpoint {path}")]
    Delete {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the training checkpoint {path} is {size} bytes, more than the {MAX_CHECKPOINT_BYTES} a \
         checkpoint may be; hint: delete it, training then starts over"
    )]
    TooLarge { path: PathBuf, size: u64 },
    /// Not a regular file, over [`MAX_CHECKPOINT_BYTES`], or an I/O error.
    #[error(
        "the training checkpoint cannot be read (deleting it is safe: training then starts over)"
    )]
    Read(#[source] canopy_files::ReadError),
    #[error("{path} is not a version-{CHECKPOINT_VERSION} training checkpoint: {cause}")]
    NotACheckpoint { path: PathBuf, cause: String },
    #[error("the training checkpoint {path} is damaged (torn or corrupted)")]
    Damaged {
        path: PathBuf,
        #[source]
        source: FormatError,
    },
    #[error("the training checkpoint {path} has no valid `{field}`: {cause}")]
    Field {
        path: PathBuf,
        field: &'static str,
        cause: String,
    },
    #[error("the training state cannot be written as a checkpoint")]
    Encode(#[source] canopy_ir::IrError),
}

/// Which training a checkpoint belongs to: resuming is only right for the
/// same task, model, seed, data and settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct TaskIdentity {
    pub job_id: i64,
    pub round_id: i64,
    pub model_version_id: i64,
    /// The model file's digest, in hex.
    pub model_digest: String,
    pub seed: u64,
    pub samples: u64,
    /// [`data_fingerprint`] of the local data, in hex.
    pub data_sha256: String,
    pub epochs: u32,
    pub batch_size: u32,
    /// The learning rate's bits.
    pub learning_rate: u64,
}

impl TaskIdentity {
    /// The identity of training `task`'s model (`model_bytes`, already
    /// read and verified) on `data` with `seed`. Hashes the data: about a
    /// second per gigabyte.
    pub fn of(task: &Task, model_bytes: &[u8], data: &Dataset, seed: u64) -> TaskIdentity {
        let model_digest = canopy_ir::format::digest(model_bytes)
            .map(|d| canopy_ir::format::digest_hex(&d))
            .unwrap_or_else(|_| hex::encode(Sha256::digest(model_bytes)));
        TaskIdentity {
            job_id: task.job_id,
            round_id: task.round_id,
            model_version_id: task.model_version_id,
            model_digest,
            seed,
            samples: data.len() as u64,
            data_sha256: hex::encode(data_fingerprint(data)),
            epochs: task.training.epochs,
            batch_size: task.training.batch_size,
            learning_rate: task.training.learning_rate.to_bits(),
        }
    }

    /// Steps per epoch, as the engine's loop counts them.
    pub fn batches_per_epoch(&self) -> u64 {
        match u64::from(self.batch_size) {
            0 => 0,
            batch if self.samples >= batch => self.samples / batch,
            _ => 1,
        }
    }

    pub fn total_steps(&self) -> u64 {
        u64::from(self.epochs).saturating_mul(self.batches_per_epoch())
    }
}

/// SHA-256 of a dataset: its sample shape, classes, features and labels.
pub(crate) fn data_fingerprint(data: &Dataset) -> [u8; 32] {
    let mut hasher = Sha256::new();
    hasher.update(b"canopy dataset v1");
    hasher.update((data.feature_shape().len() as u64).to_le_bytes());
    for dim in data.feature_shape() {
        hasher.update((*dim as u64).to_le_bytes());
    }
    hasher.update((data.num_classes() as u64).to_le_bytes());
    hasher.update((data.len() as u64).to_le_bytes());
    // In chunks: one `update` per value would dominate the hashing.
    let mut buffer = Vec::with_capacity(8 << 10);
    for chunk in data.features().chunks(1 << 10) {
        buffer.clear();
        buffer.extend(chunk.iter().flat_map(|v| v.to_le_bytes()));
        hasher.update(&buffer);
    }
    for chunk in data.labels().chunks(1 << 10) {
        buffer.clear();
        buffer.extend(chunk.iter().flat_map(|v| v.to_le_bytes()));
        hasher.update(&buffer);
    }
    hasher.finalize().into()
}

/// Where in the training a checkpoint stands.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Position {
    /// Epochs finished.
    pub epoch: u32,
    /// Batches done of the next epoch.
    pub batch: usize,
    /// Their running sums.
    pub sums: EpochSums,
}

/// A checkpoint's content.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Checkpoint {
    pub identity: TaskIdentity,
    pub position: Position,
    /// Its `seed` is the identity's.
    pub state: TrainerState,
}

impl Checkpoint {
    /// Whether the position is one the identity's training passes through
    /// with the state's step count.
    pub fn is_consistent(&self) -> bool {
        let batches = self.identity.batches_per_epoch();
        let batch = self.position.batch as u64;
        let steps = u64::from(self.position.epoch)
            .saturating_mul(batches)
            .saturating_add(batch);
        self.position.epoch < self.identity.epochs
            && batch < batches
            && steps == self.state.steps
            && self.state.seed == self.identity.seed
    }

    fn info(&self, bytes: u64) -> CheckpointInfo {
        CheckpointInfo {
            job_id: self.identity.job_id,
            round_id: self.identity.round_id,
            model_version_id: self.identity.model_version_id,
            steps_done: self.state.steps,
            total_steps: self.identity.total_steps(),
            epochs_done: self.position.epoch,
            batches_done: self.position.batch as u64,
            bytes,
        }
    }
}

/// What the checkpoint at `path` holds, or `None` when there is none or it
/// does not read (see [`load`] for the reasons, logged at debug level).
/// Reads and verifies the whole file, which is a few times the model's
/// size.
pub fn peek(path: &Path) -> Option<CheckpointInfo> {
    match read_file(path) {
        Ok(Some(bytes)) => match decode(path, &bytes) {
            Ok(checkpoint) => Some(checkpoint.info(bytes.len() as u64)),
            Err(error) => {
                tracing::debug!(path = %path.display(), reason = %error, "no usable checkpoint");
                None
            }
        },
        Ok(None) => None,
        Err(error) => {
            tracing::debug!(path = %path.display(), reason = %error, "no usable checkpoint");
            None
        }
    }
}

/// Deletes the checkpoint at `path` (a task given up); none is no error.
pub fn discard(path: &Path) -> Result<(), CheckpointError> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(CheckpointError::Delete {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// The checkpoint at `path`; `None` when there is no file.
pub(crate) fn load(path: &Path) -> Result<Option<Checkpoint>, CheckpointError> {
    match read_file(path)? {
        Some(bytes) => decode(path, &bytes).map(Some),
        None => Ok(None),
    }
}

/// Writes `checkpoint` to `path` atomically (see the module doc).
pub(crate) fn save(path: &Path, checkpoint: &Checkpoint) -> Result<(), CheckpointError> {
    let bytes = encode(checkpoint)?;
    if bytes.len() as u64 > MAX_CHECKPOINT_BYTES {
        return Err(CheckpointError::TooLarge {
            path: path.to_path_buf(),
            size: bytes.len() as u64,
        });
    }
    crate::files::write_atomic(path, &bytes, CHECKPOINT_FILE_MODE).map_err(CheckpointError::Write)
}

/// The file's bytes, `None` when there is none
/// ([`canopy_files::read_bounded`]: a regular file of at most
/// [`MAX_CHECKPOINT_BYTES`]).
fn read_file(path: &Path) -> Result<Option<Vec<u8>>, CheckpointError> {
    canopy_files::read_bounded_if_present(path, MAX_CHECKPOINT_BYTES).map_err(CheckpointError::Read)
}

fn encode(checkpoint: &Checkpoint) -> Result<Vec<u8>, CheckpointError> {
    let parameters = checkpoint
        .state
        .values
        .iter()
        .map(|(name, value)| Parameter {
            name: name.clone(),
            data: value.to_data(),
            trainable: false,
        })
        .collect();
    let model = Model {
        metadata: Metadata {
            model_name: CHECKPOINT_MODEL_NAME.to_string(),
            parent_digest: None,
            producer: format!("canopy-sdk {}", env!("CARGO_PKG_VERSION")),
            properties: properties(checkpoint),
        },
        parameters,
        entry_points: BTreeMap::new(),
    };
    let file = canopy_ir::format::write_model(&model).map_err(CheckpointError::Encode)?;
    let mut bytes = Vec::with_capacity(ENVELOPE_LEN + file.len());
    bytes.extend_from_slice(&CHECKPOINT_MAGIC);
    bytes.extend_from_slice(&CHECKPOINT_VERSION.to_le_bytes());
    bytes.extend_from_slice(&file);
    Ok(bytes)
}

fn properties(checkpoint: &Checkpoint) -> BTreeMap<String, String> {
    let (id, at) = (&checkpoint.identity, &checkpoint.position);
    let pairs = [
        ("job_id", id.job_id.to_string()),
        ("round_id", id.round_id.to_string()),
        ("model_version_id", id.model_version_id.to_string()),
        ("model_digest", id.model_digest.clone()),
        ("seed", id.seed.to_string()),
        ("samples", id.samples.to_string()),
        ("data_sha256", id.data_sha256.clone()),
        ("epochs", id.epochs.to_string()),
        ("batch_size", id.batch_size.to_string()),
        ("learning_rate", format!("{:016x}", id.learning_rate)),
        ("epochs_done", at.epoch.to_string()),
        ("batches_done", at.batch.to_string()),
        ("loss_sum", format!("{:016x}", at.sums.loss_sum.to_bits())),
        ("correct", at.sums.correct.to_string()),
        ("seen", at.sums.seen.to_string()),
        ("steps", checkpoint.state.steps.to_string()),
    ];
    pairs
        .into_iter()
        .map(|(key, value)| (key.to_string(), value))
        .collect()
}

fn decode(path: &Path, bytes: &[u8]) -> Result<Checkpoint, CheckpointError> {
    let not_one = |cause: String| CheckpointError::NotACheckpoint {
        path: path.to_path_buf(),
        cause,
    };
    let (envelope, file) = bytes.split_at_checked(ENVELOPE_LEN).ok_or_else(|| {
        not_one(format!(
            "it is {} bytes, shorter than a header",
            bytes.len()
        ))
    })?;
    if envelope[..8] != CHECKPOINT_MAGIC {
        return Err(not_one("it does not start with `CANOPYCK`".to_string()));
    }
    let mut version = [0u8; 4];
    version.copy_from_slice(&envelope[8..]);
    let version = u32::from_le_bytes(version);
    if version != CHECKPOINT_VERSION {
        return Err(not_one(format!("it is version {version}")));
    }
    let limits = ReadLimits {
        max_file_bytes: MAX_CHECKPOINT_BYTES,
        ..ReadLimits::default()
    };
    let model = canopy_ir::format::read_model_with_limits(file, &limits).map_err(|source| {
        CheckpointError::Damaged {
            path: path.to_path_buf(),
            source,
        }
    })?;
    if model.metadata.model_name != CHECKPOINT_MODEL_NAME {
        return Err(not_one(format!(
            "it holds the model `{}`",
            model.metadata.model_name
        )));
    }
    from_model(path, model)
}

fn from_model(path: &Path, model: Model) -> Result<Checkpoint, CheckpointError> {
    let fields = Fields {
        path,
        properties: &model.metadata.properties,
    };
    let identity = TaskIdentity {
        job_id: fields.number("job_id")?,
        round_id: fields.number("round_id")?,
        model_version_id: fields.number("model_version_id")?,
        model_digest: fields.text("model_digest")?,
        seed: fields.number("seed")?,
        samples: fields.number("samples")?,
        data_sha256: fields.text("data_sha256")?,
        epochs: fields.number("epochs")?,
        batch_size: fields.number("batch_size")?,
        learning_rate: fields.bits("learning_rate")?,
    };
    let position = Position {
        epoch: fields.number("epochs_done")?,
        batch: fields.number("batches_done")?,
        sums: EpochSums {
            loss_sum: f64::from_bits(fields.bits("loss_sum")?),
            correct: fields.number("correct")?,
            seen: fields.number("seen")?,
        },
    };
    let state = TrainerState {
        seed: identity.seed,
        steps: fields.number("steps")?,
        values: model
            .parameters
            .iter()
            .map(|p| (p.name.clone(), Value::from_data(&p.data)))
            .collect(),
    };
    Ok(Checkpoint {
        identity,
        position,
        state,
    })
}

/// A checkpoint's metadata properties, read with the file named in errors.
struct Fields<'a> {
    path: &'a Path,
    properties: &'a BTreeMap<String, String>,
}

impl Fields<'_> {
    fn text(&self, field: &'static str) -> Result<String, CheckpointError> {
        self.properties
            .get(field)
            .cloned()
            .ok_or_else(|| self.error(field, "it is missing".to_string()))
    }

    fn number<T: FromStr>(&self, field: &'static str) -> Result<T, CheckpointError> {
        let text = self.text(field)?;
        text.parse()
            .map_err(|_| self.error(field, format!("`{text}` is not a number in range")))
    }

    /// A float's bits, as 16 hex digits.
    fn bits(&self, field: &'static str) -> Result<u64, CheckpointError> {
        let text = self.text(field)?;
        match text.len() {
            16 => u64::from_str_radix(&text, 16).ok(),
            _ => None,
        }
        .ok_or_else(|| self.error(field, format!("`{text}` is not 16 hex digits")))
    }

    fn error(&self, field: &'static str, cause: String) -> CheckpointError {
        CheckpointError::Field {
            path: self.path.to_path_buf(),
            field,
            cause,
        }
    }
}

#[cfg(test)]
mod tests {
    use canopy_engine::Value;

    use super::*;

    fn sample() -> Checkpoint {
        let identity = TaskIdentity {
            job_id: 3,
            round_id: 7,
            model_version_id: 2,
            model_digest: "ab".repeat(32),
            seed: 5,
            samples: 10,
            data_sha256: "cd".repeat(32),
            epochs: 2,
            batch_size: 4,
            learning_rate: 0.05f64.to_bits(),
        };
        let weights = Value::f32(&[2, 3], vec![0.5, -0.0, 1e-30, f32::MAX, -2.25, 3.0]);
        let state = TrainerState {
            seed: 5,
            steps: 3,
            values: vec![
                ("params/linear.weight".into(), weights.expect("weights")),
                ("state/linear.weight/m".into(), Value::scalar_f32(0.1)),
                ("params/count".into(), Value::scalar_i64(-4)),
            ],
        };
        Checkpoint {
            identity,
            position: Position {
                epoch: 1,
                batch: 1,
                sums: EpochSums {
                    loss_sum: 0.1 + 0.2,
                    correct: 3,
                    seen: 4,
                },
            },
            state,
        }
    }

    #[test]
    fn a_checkpoint_reads_back_exactly() {
        let checkpoint = sample();
        assert!(checkpoint.is_consistent(), "2 batches an epoch, 1 + 1 done");
        let bytes = encode(&checkpoint).expect("encode");
        assert_eq!(&bytes[..8], b"CANOPYCK");
        let back = decode(Path::new("x"), &bytes).expect("decode");
        assert_eq!(back, checkpoint);
        assert_eq!(
            back.position.sums.loss_sum.to_bits(),
            (0.1f64 + 0.2).to_bits()
        );
    }

    /// Whatever byte is flipped or wherever the file is cut, reading fails
    /// with an error (never a panic, never another checkpoint).
    #[test]
    fn every_flipped_byte_and_every_cut_is_detected() {
        let bytes = encode(&sample()).expect("encode");
        let path = Path::new("task.ckpt");
        for at in 0..bytes.len() {
            let mut damaged = bytes.clone();
            damaged[at] ^= 0x10;
            assert!(decode(path, &damaged).is_err(), "byte {at} flipped");
            assert!(decode(path, &bytes[..at]).is_err(), "cut at {at}");
        }
    }

    #[test]
    fn another_version_is_not_read() {
        let mut bytes = encode(&sample()).expect("encode");
        bytes[8] = 2;
        let error = decode(Path::new("task.ckpt"), &bytes).unwrap_err();
        assert!(error.to_string().contains("version 2"), "{error}");
        assert!(error.to_string().contains("task.ckpt"), "{error}");
    }

    /// A well-formed model file that lacks a property is refused naming it.
    #[test]
    fn a_missing_field_is_named() {
        let checkpoint = sample();
        let mut model = canopy_ir::format::read_model(&encode(&checkpoint).expect("encode")[12..])
            .expect("model");
        model.metadata.properties.remove("loss_sum");
        let mut bytes = encode(&checkpoint).expect("encode")[..12].to_vec();
        bytes.extend(canopy_ir::format::write_model(&model).expect("write"));
        let error = decode(Path::new("task.ckpt"), &bytes).unwrap_err();
        assert!(
            matches!(
                &error,
                CheckpointError::Field {
                    field: "loss_sum",
                    ..
                }
            ),
            "{error}"
        );
    }

    #[test]
    fn saving_replaces_the_file_atomically_and_peek_reads_it() {
        let dir = tempfile::tempdir().expect("temporary directory");
        let path = dir.path().join("task.ckpt");
        assert!(peek(&path).is_none());
        let mut checkpoint = sample();
        save(&path, &checkpoint).expect("save");
        checkpoint.state.steps = 2;
        checkpoint.position.batch = 0;
        save(&path, &checkpoint).expect("save over");
        let info = peek(&path).expect("a checkpoint");
        assert_eq!((info.steps_done, info.total_steps), (2, 4));
        assert_eq!((info.epochs_done, info.batches_done), (1, 0));
        assert_eq!(info.bytes, std::fs::metadata(&path).expect("file").len());
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .expect("listing")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(names, ["task.ckpt"], "no temporary file left");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).expect("file").permissions().mode();
            assert_eq!(mode & 0o777, CHECKPOINT_FILE_MODE, "mode {mode:o}");
        }
        assert_eq!(load(&path).expect("load"), Some(checkpoint));
        discard(&path).expect("discard");
        discard(&path).expect("discarding nothing");
        assert_eq!(load(&path).expect("load"), None);
    }

    #[test]
    fn an_inconsistent_position_is_not_resumed() {
        let mut checkpoint = sample();
        checkpoint.state.steps = 4;
        assert!(!checkpoint.is_consistent(), "steps");
        let mut checkpoint = sample();
        checkpoint.position.batch = 2;
        checkpoint.state.steps = 4;
        assert!(!checkpoint.is_consistent(), "batch past the epoch");
        let mut checkpoint = sample();
        checkpoint.position = Position {
            epoch: 2,
            batch: 0,
            sums: EpochSums::default(),
        };
        checkpoint.state.steps = 4;
        assert!(!checkpoint.is_consistent(), "training done");
    }
}
