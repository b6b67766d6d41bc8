//! Explicit caps on everything a data file can claim. They bound memory
//! use on malformed or hostile input: a header is never trusted to size an
//! allocation before it has been checked against these and against the
//! bytes actually present.

/// Largest file accepted, measured after gzip decompression (2 GiB).
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

/// Largest class count; labels must lie in `0..MAX_CLASSES`.
pub const MAX_CLASSES: usize = 100_000;

/// Longest NPY header dictionary in bytes (numpy itself writes < 4 KiB).
pub const MAX_NPY_HEADER: usize = 65_536;

/// Most directory entries `load_dir` will look through.
pub const MAX_DIR_ENTRIES: usize = 10_000;

/// How many times `partition_dirichlet` redraws before giving up on the
/// per-client minimum.
pub const DIRICHLET_MAX_ATTEMPTS: usize = 1_000;
