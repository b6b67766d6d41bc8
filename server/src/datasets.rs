//! Held-out datasets on the server: which format an upload is (told from
//! its bytes, never its name), and parsing it with `canopy-engine`'s
//! loaders (at upload, and in central evaluation's worker process).
//!
//! The loaders read files, so the parts are staged as files named `data`
//! and `labels` in a temporary directory under the data directory's
//! `staging/` (which the server empties at start); the engine's errors
//! name those files, which is how a refusal names the part at fault.
//! They are staged as uploaded, gzipped or not (the stored blob is the
//! upload's bytes); the loaders stream them through gzip under
//! [`bounds`], so a dataset stops decompressing at
//! `limits.max_dataset_bytes`, and a header declaring more than
//! `limits.max_dataset_values` values is refused before anything is
//! allocated for them.

use std::io::Read;
use std::path::{Path, PathBuf};

use canopy_engine::EngineError;
use canopy_engine::data::limits::{DataBounds, MAX_SAMPLES, OverBound};
use canopy_engine::data::{
    CsvOptions, Dataset, LabelColumn, load_csv_within, load_idx_within, load_npy_dataset_within,
};
use canopy_protocol::messages::{MAX_DATASET_NAME_CHARS, check_dataset_name};

use crate::config::Limits;
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

/// What one dataset may cost to load, from the operator's limits.
pub fn bounds(limits: &Limits) -> DataBounds {
    DataBounds {
        max_bytes: limits.max_dataset_bytes,
        max_values: limits.max_dataset_values,
    }
}

/// The setting behind a bound a dataset went past.
pub fn setting(over: &OverBound) -> &'static str {
    match over {
        OverBound::Bytes { .. } => "limits.max_dataset_bytes",
        OverBound::Values { .. } => "limits.max_dataset_values",
    }
}

/// The rule for a new dataset's name: 1 to 64 characters of
/// `[A-Za-z0-9_.-]`, starting with a letter or digit, so that a name is
/// never a path segment (`.`, `..`), a hidden file (`.x`) or an option
/// (`-rf`) wherever an operator's tools put it. Names stored before the
/// rule are still looked up with the wider character rule alone
/// (`check_dataset_name`), so they can be read and removed.
pub fn check_new_name(name: &str) -> Result<(), String> {
    let starts_well = name
        .bytes()
        .next()
        .is_some_and(|b| b.is_ascii_alphanumeric());
    if starts_well && check_dataset_name("dataset name", name).is_ok() {
        return Ok(());
    }
    Err(format!(
        "dataset name `{}` must be 1 to {MAX_DATASET_NAME_CHARS} characters of [A-Za-z0-9_.-], \
         starting with a letter or digit",
        name.chars()
            .take(MAX_DATASET_NAME_CHARS + 1)
            .collect::<String>()
    ))
}

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
    #[error("the `{part}` part {over} ({})", setting(.over))]
    OverBound { part: &'static str, over: OverBound },
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

/// Parses staged parts with the engine's loader for `kind` under
/// `bounds` (see [`bounds`]). Blocking.
pub fn parse_within(
    kind: DatasetKind,
    data: &Path,
    labels: Option<&Path>,
    bounds: &DataBounds,
) -> Result<Dataset, ParseError> {
    let csv = CsvOptions {
        label: LabelColumn::Last,
        ..CsvOptions::default()
    };
    let loaded = match (kind, labels) {
        (DatasetKind::Csv, None) => load_csv_within(data, &csv, bounds),
        (DatasetKind::Csv, Some(_)) => return Err(ParseError::UnexpectedLabels),
        (DatasetKind::Idx | DatasetKind::Npy, None) => {
            return Err(ParseError::MissingLabels { kind });
        }
        (DatasetKind::Idx, Some(labels)) => load_idx_within(data, labels, bounds),
        (DatasetKind::Npy, Some(labels)) => load_npy_dataset_within(data, labels, bounds),
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
        EngineError::Data { path, cause } => ParseError::Invalid {
            part: part_of(&path),
            kind,
            cause,
        },
        EngineError::OverBound { path, over } => ParseError::OverBound {
            part: part_of(&path),
            over,
        },
        other => ParseError::Invalid {
            part: DATA_PART,
            kind,
            cause: canopy_term::error_chain(&other),
        },
    }
}

/// The part a staged file holds.
fn part_of(path: &str) -> &'static str {
    if Path::new(path).file_name() == Some(LABELS_PART.as_ref()) {
        LABELS_PART
    } else {
        DATA_PART
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

    /// The format, then the dataset parsed under `bounds`. Blocking.
    pub fn parse(&self, bounds: &DataBounds) -> Result<(DatasetKind, Dataset), ParseError> {
        let kind = sniff(&self.data())?;
        let labels = self.has_labels.then(|| self.labels());
        let dataset = parse_within(kind, &self.data(), labels.as_deref(), bounds)?;
        Ok((kind, dataset))
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
    fn new_names_start_with_a_letter_or_digit() {
        for good in ["a", "9", "digits", "x.y-z_1", &"n".repeat(64)] {
            assert!(check_new_name(good).is_ok(), "{good:?}");
        }
        for bad in [
            "",
            "..",
            ".",
            ".hidden",
            "-rf",
            "_x",
            "a b",
            "a/b",
            "é",
            &"n".repeat(65),
        ] {
            let error = check_new_name(bad).expect_err(bad);
            assert!(error.contains("starting with a letter or digit"), "{error}");
        }
        // Names stored before the rule are still names to look up.
        for legacy in ["..", ".hidden", "-rf"] {
            assert!(check_dataset_name("name", legacy).is_ok(), "{legacy:?}");
        }
    }
}
