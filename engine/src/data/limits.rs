//! Explicit caps on everything a data file can claim. They bound memory
//! use on malformed or hostile input: a header is never trusted to size an
//! allocation before it has been checked against these and against the
//! bytes actually present.
//!
//! A caller that sizes its own bounds (the server, from its `Limits`)
//! passes [`DataBounds`] to the `*_within` loaders; the others load under
//! [`DataBounds::DEFAULT`], these caps.

use std::fmt;

/// Largest dataset accepted, its files together, measured after gzip
/// decompression (2 GiB).
pub const MAX_FILE_BYTES: u64 = 2 << 30;

/// Most samples in one dataset.
pub const MAX_SAMPLES: usize = 50_000_000;

/// Most f32 elements in one dataset's features (4 GiB of f32).
pub const MAX_ELEMENTS: usize = 1 << 30;

/// Most elements in one sample's feature tensor (a 4096x4096 image).
pub const MAX_FEATURES_PER_SAMPLE: usize = 1 << 24;

/// Most dimensions of an IDX or NPY array, sample axis included.
pub const MAX_DIMS: usize = 8;

/// Most columns in one CSV row.
pub const MAX_CSV_COLUMNS: usize = 65_536;

/// Longest CSV line in bytes (16 MiB: 65,536 columns of 256 characters),
/// so that a file without line breaks is refused at this size, not read
/// whole into one line.
pub const MAX_CSV_LINE_BYTES: usize = 16 << 20;

/// Largest class count; labels must lie in `0..MAX_CLASSES`.
pub const MAX_CLASSES: usize = 100_000;

/// Longest NPY header dictionary in bytes (numpy itself writes < 4 KiB).
pub const MAX_NPY_HEADER: usize = 65_536;

/// Most directory entries `load_dir` will look through.
pub const MAX_DIR_ENTRIES: usize = 10_000;

/// How many times `partition_dirichlet` redraws before giving up on the
/// per-client minimum.
pub const DIRICHLET_MAX_ATTEMPTS: usize = 1_000;

/// What loading one dataset may cost: the bytes its files hold together,
/// counted as they come out of gzip (so a small file that decompresses
/// to a lot stops at `max_bytes`, never past it), and the f32 values its
/// features hold (samples × values per sample), checked against the
/// shape a header declares before anything is allocated for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DataBounds {
    pub max_bytes: u64,
    pub max_values: usize,
}

impl DataBounds {
    /// The engine's own caps, [`MAX_FILE_BYTES`] and [`MAX_ELEMENTS`].
    pub const DEFAULT: DataBounds = DataBounds {
        max_bytes: MAX_FILE_BYTES,
        max_values: MAX_ELEMENTS,
    };
}

impl Default for DataBounds {
    fn default() -> DataBounds {
        DataBounds::DEFAULT
    }
}

/// Which of a [`DataBounds`] a file went past, and by how much; the
/// file is named by the [`EngineError::OverBound`] that carries it.
///
/// [`EngineError::OverBound`]: crate::EngineError::OverBound
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OverBound {
    /// The dataset's files decompress to more than `limit` bytes together
    /// (reading stopped one byte past it), or a header declares more.
    Bytes { limit: u64 },
    /// The features would hold `values` values, more than `limit`.
    Values { values: u64, limit: u64 },
}

impl fmt::Display for OverBound {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OverBound::Bytes { limit } => write!(
                f,
                "decompresses to more than {limit} bytes, the most a dataset's files may hold together"
            ),
            OverBound::Values { values, limit } => write!(
                f,
                "holds {values} values, more than the {limit} a dataset may hold"
            ),
        }
    }
}
