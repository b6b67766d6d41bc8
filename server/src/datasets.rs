//! Held-out datasets on the server: which format an upload is (told from
//! its bytes, never its name), parsing it with `canopy-engine`'s loaders,
//! and the parsed datasets kept in memory for central evaluation.
//!
//! The loaders read files, so the parts are staged as files named `data`
//! and `labels` in a temporary directory under the data directory's
//! `staging/` (which the server empties at start); the engine's errors
//! name those files, which is how a refusal names the part at fault.

use std::collections::VecDeque;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use canopy_engine::EngineError;
use canopy_engine::data::limits::MAX_SAMPLES;
use canopy_engine::data::{Dataset, LabelColumn, load_csv, load_idx, load_npy_dataset};

use crate::store::datasets::DatasetKind;

/// The file names the parts are staged under.
pub const DATA_PART: &str = "data";
pub const LABELS_PART: &str = "labels";

const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];
const NPY_MAGIC: &[u8] = b"\x93NUMPY";
/// IDX element types (the third byte of the magic): u8, i8, i16, i32, f32, f64.
const IDX_TYPES: [u8; 6] = [0x08, 0x09, 0x0b, 0x0c, 0x0d, 0x0e];
/// Bytes read to tell the format.
const SNIFF_BYTES: u64 = 8;

/// Why an upload's bytes are not a dataset the server can evaluate on.
#[derive(Debug, thiserror::Error)]
pub enum ParseError {
    #[error("the `{part}` part is not a valid {kind} file: {cause}")]
    Invalid {
        part: &'static str,
        kind: DatasetKind,
        cause: String,
    },
    #[error(
        "an {kind} dataset needs its labels: the `data` part holds the samples, a `labels` part the labels"
    )]
    MissingLabels { kind: DatasetKind },
    #[error("a CSV dataset carries its labels in its last column, so it takes no `labels` part")]
    UnexpectedLabels,
    #[error("it has no samples")]
    Empty,
    #[error("it has {samples} samples, over the limit of {MAX_SAMPLES}")]
    TooManySamples { samples: usize },
    #[error("cannot read the staged parts")]
    Io(#[from] std::io::Error),
}

/// The format of a data file, from its first bytes (after gunzipping
/// them when it is gzipped): the IDX magic (two zero bytes, an element
/// type, a rank), the NPY magic, or else CSV text.
pub fn sniff(path: &Path) -> std::io::Result<DatasetKind> {
    let mut file = std::fs::File::open(path)?;
    let mut head = Vec::new();
    (&mut file).take(SNIFF_BYTES).read_to_end(&mut head)?;
    if head.starts_with(&GZIP_MAGIC) {
        let file = std::fs::File::open(path)?;
        head.clear();
        // A corrupt stream sniffs as CSV, whose loader then names the cause.
        let _ = flate2::read::MultiGzDecoder::new(file)
            .take(SNIFF_BYTES)
            .read_to_end(&mut head);
    }
    Ok(kind_of(&head))
}

fn kind_of(head: &[u8]) -> DatasetKind {
    match head {
        [0, 0, element, rank, ..] if IDX_TYPES.contains(element) && *rank > 0 => DatasetKind::Idx,
        _ if head.starts_with(NPY_MAGIC) => DatasetKind::Npy,
        _ => DatasetKind::Csv,
    }
}

/// Parses staged parts with the engine's loader for `kind`. Blocking.
pub fn parse(kind: DatasetKind, data: &Path, labels: Option<&Path>) -> Result<Dataset, ParseError> {
    let loaded = match (kind, labels) {
        (DatasetKind::Csv, None) => load_csv(data, LabelColumn::Last),
        (DatasetKind::Csv, Some(_)) => return Err(ParseError::UnexpectedLabels),
        (DatasetKind::Idx | DatasetKind::Npy, None) => {
            return Err(ParseError::MissingLabels { kind });
        }
        (DatasetKind::Idx, Some(labels)) => load_idx(data, labels),
        (DatasetKind::Npy, Some(labels)) => load_npy_dataset(data, labels),
    };
    let dataset = loaded.map_err(|error| invalid(kind, error))?;
    if dataset.is_empty() {
        return Err(ParseError::Empty);
    }
    if dataset.len() > MAX_SAMPLES {
        return Err(ParseError::TooManySamples {
            samples: dataset.len(),
        });
    }
    Ok(dataset)
}

/// The engine's error, with the staged file's path replaced by its part.
fn invalid(kind: DatasetKind, error: EngineError) -> ParseError {
    match error {
        EngineError::Data { path, cause } => {
            let part = if Path::new(&path).file_name() == Some(LABELS_PART.as_ref()) {
                LABELS_PART
            } else {
                DATA_PART
            };
            ParseError::Invalid { part, kind, cause }
        }
        other => ParseError::Invalid {
            part: DATA_PART,
            kind,
            cause: canopy_term::error_chain(&other),
        },
    }
}

/// A temporary directory holding an upload's or a blob's parts as files.
pub struct Staged {
    dir: tempfile::TempDir,
    pub has_labels: bool,
}

impl Staged {
    pub fn new_in(staging: &Path) -> std::io::Result<Staged> {
        std::fs::create_dir_all(staging)?;
        Ok(Staged {
            dir: tempfile::TempDir::new_in(staging)?,
            has_labels: false,
        })
    }

    pub fn data(&self) -> PathBuf {
        self.dir.path().join(DATA_PART)
    }

    pub fn labels(&self) -> PathBuf {
        self.dir.path().join(LABELS_PART)
    }

    /// The format, then the parsed dataset. Blocking.
    pub fn parse(&self) -> Result<(DatasetKind, Dataset), ParseError> {
        let kind = sniff(&self.data())?;
        let labels = self.has_labels.then(|| self.labels());
        Ok((kind, parse(kind, &self.data(), labels.as_deref())?))
    }
}

/// Parsed datasets by digest and sample shape, least recently used
/// dropped first past `capacity` (`limits.max_cached_datasets`).
pub struct DatasetCache {
    entries: Mutex<VecDeque<(String, Arc<Dataset>)>>,
    capacity: usize,
}

impl DatasetCache {
    pub fn new(capacity: usize) -> DatasetCache {
        DatasetCache {
            entries: Mutex::new(VecDeque::new()),
            capacity: capacity.max(1),
        }
    }

    /// The dataset with this digest whose samples have `shape`.
    pub fn get(&self, digest: &str, shape: &[usize]) -> Option<Arc<Dataset>> {
        let mut entries = self.entries.lock().ok()?;
        let position = entries
            .iter()
            .position(|(d, data)| d == digest && data.feature_shape() == shape)?;
        let entry = entries.remove(position)?;
        let found = entry.1.clone();
        entries.push_front(entry);
        Some(found)
    }

    pub fn insert(&self, digest: &str, dataset: Arc<Dataset>) {
        if let Ok(mut entries) = self.entries.lock() {
            entries.retain(|(d, data)| {
                !(d == digest && data.feature_shape() == dataset.feature_shape())
            });
            entries.push_front((digest.to_string(), dataset));
            entries.truncate(self.capacity);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_are_told_from_their_first_bytes() {
        assert_eq!(kind_of(&[0, 0, 8, 3, 0, 0, 0, 1]), DatasetKind::Idx);
        assert_eq!(kind_of(&[0, 0, 8, 1]), DatasetKind::Idx);
        assert_eq!(kind_of(b"\x93NUMPY\x01\x00"), DatasetKind::Npy);
        assert_eq!(kind_of(b"a,b,label\n"), DatasetKind::Csv);
        assert_eq!(kind_of(b"1,2,3\n"), DatasetKind::Csv);
        // Two zero bytes with an unknown element type are no IDX file.
        assert_eq!(kind_of(&[0, 0, 0x42, 3]), DatasetKind::Csv);
        assert_eq!(kind_of(&[]), DatasetKind::Csv);
    }

    #[test]
    fn the_cache_keeps_the_most_recently_used() {
        let dataset = |shape: Vec<usize>| {
            let features = vec![0.0; shape.iter().product::<usize>() * 2];
            Arc::new(Dataset::new(features, shape, vec![0, 1], 2).expect("dataset"))
        };
        let cache = DatasetCache::new(2);
        cache.insert("a", dataset(vec![4]));
        cache.insert("b", dataset(vec![4]));
        assert!(cache.get("a", &[4]).is_some(), "a is now the most recent");
        cache.insert("c", dataset(vec![4]));
        assert!(cache.get("b", &[4]).is_none(), "b was the least recent");
        assert!(cache.get("a", &[4]).is_some());
        assert!(
            cache.get("a", &[2, 2]).is_none(),
            "another shape is another entry"
        );
    }
}
