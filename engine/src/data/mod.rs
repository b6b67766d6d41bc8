//! Data loading: datasets in memory, file loaders (IDX, CSV, NPY, whole
//! folders), seeded batching and federated partitioning.
//!
//! Every loader reports failures as [`EngineError::Data`] naming the file
//! and the cause (or [`EngineError::OverBound`] past a bound it was
//! given), never panics on malformed input, streams its files (through
//! gzip, under a byte bound, never holding a whole file), and checks every
//! size a header claims against the bounds before allocating, all under
//! the explicit caps in [`limits`].
//!
//! [`EngineError::Data`]: crate::EngineError::Data
//! [`EngineError::OverBound`]: crate::EngineError::OverBound

mod batch;
#[cfg(test)]
mod bounds_tests;
mod csv;
mod dataset;
mod dir;
mod idx;
pub mod limits;
mod npy;
mod partition;
mod read;
mod shakespeare;

pub use batch::{Batch, Batches};
pub use csv::{
    CsvHeader, CsvOptions, LabelColumn, load_csv, load_csv_with, load_csv_within, write_csv,
};
pub use dataset::{Dataset, FeatureStats, reshapes_to};
pub use dir::{DEFAULT_SPLIT_SEED, DEFAULT_TEST_FRACTION, load_dir};
pub use idx::{load_idx, load_idx_labels, load_idx_within};
pub use npy::{load_npy, load_npy_dataset, load_npy_dataset_within};
pub use partition::{
    DEFAULT_MIN_CLIENT_SAMPLES, DirichletOptions, partition_by_label, partition_dirichlet,
    partition_dirichlet_sized, partition_dirichlet_with, partition_iid,
};
pub use shakespeare::{
    CHARACTERS, MAX_SEQUENCE_LEN, Part, Role, VOCABULARY_SIZE, char_index, load_shakespeare,
    most_frequent_character_baseline, next_character_samples, part_text, read_text_lines,
    train_lines,
};

use std::path::Path;

use crate::error::EngineError;

/// Builds the one error type every loader returns.
pub(crate) fn data_err(path: &Path, cause: impl Into<String>) -> EngineError {
    EngineError::Data {
        path: path.display().to_string(),
        cause: cause.into(),
    }
}
