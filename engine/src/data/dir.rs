//! Loading a train/test pair from a folder, recognising the common layouts
//! by file name.

use std::path::{Path, PathBuf};

use super::csv::{LabelColumn, load_csv};
use super::data_err;
use super::dataset::Dataset;
use super::idx::load_idx;
use super::limits::MAX_DIR_ENTRIES;
use super::npy::load_npy_dataset;
use crate::error::EngineResult;

/// Share of a lone CSV file held out as the test set.
pub const DEFAULT_TEST_FRACTION: f64 = 0.2;

/// Seed of that split, fixed so every run sees the same test set.
pub const DEFAULT_SPLIT_SEED: u64 = 0x00ca_9097;

/// Loads `(train, test)` from a folder holding one of:
/// - IDX files `train-images*` + `train-labels*` and `test-images*` +
///   `test-labels*` (MNIST's `t10k-*` names also work), gzipped or not;
/// - the same names ending `.npy` (see [`load_npy_dataset`]);
/// - `train*.csv[.gz]` + `test*.csv[.gz]`, label in the last column;
/// - a single `*.csv[.gz]`, split stratified 80/20 with
///   [`DEFAULT_SPLIT_SEED`].
///
/// Both sets get the same class count (the larger of the two).
pub fn load_dir(dir: impl AsRef<Path>) -> EngineResult<(Dataset, Dataset)> {
    let dir = dir.as_ref();
    let names = list_files(dir)?;
    let find = |prefixes: &[&str], suffix: Option<&str>| find_one(dir, &names, prefixes, suffix);
    let (train, test) = if let Some(train_img) = find(&["train-images"], None)? {
        let train_lbl = require(dir, find(&["train-labels"], None)?, "train-labels*")?;
        let test_img = require(
            dir,
            find(&["test-images", "t10k-images"], None)?,
            "test-images*",
        )?;
        let test_lbl = require(
            dir,
            find(&["test-labels", "t10k-labels"], None)?,
            "test-labels*",
        )?;
        (
            load_pair(&train_img, &train_lbl)?,
            load_pair(&test_img, &test_lbl)?,
        )
    } else if let Some(train_csv) = find(&["train"], Some("csv"))? {
        let test_csv = require(dir, find(&["test"], Some("csv"))?, "test*.csv[.gz]")?;
        (
            load_csv(&train_csv, LabelColumn::Last)?,
            load_csv(&test_csv, LabelColumn::Last)?,
        )
    } else if let Some(csv) = find(&[""], Some("csv"))? {
        load_csv(&csv, LabelColumn::Last)?.split(DEFAULT_TEST_FRACTION, DEFAULT_SPLIT_SEED)?
    } else {
        let cause = format!("no dataset found: expected {DATASET_LAYOUTS} (found {names:?})");
        return Err(data_err(dir, cause));
    };
    harmonize(dir, train, test)
}

/// IDX unless the images file is an `.npy` array.
fn load_pair(images: &Path, labels: &Path) -> EngineResult<Dataset> {
    if images.extension().is_some_and(|e| e == "npy") {
        load_npy_dataset(images, labels)
    } else {
        load_idx(images, labels)
    }
}

/// Checks the two sets describe the same kind of sample and gives them a
/// common class count.
fn harmonize(dir: &Path, train: Dataset, test: Dataset) -> EngineResult<(Dataset, Dataset)> {
    if train.feature_shape() != test.feature_shape() {
        let cause = format!(
            "train samples have shape {:?} but test samples have {:?}",
            train.feature_shape(),
            test.feature_shape()
        );
        return Err(data_err(dir, cause));
    }
    let classes = train.num_classes().max(test.num_classes());
    Ok((
        train.with_num_classes(classes)?,
        test.with_num_classes(classes)?,
    ))
}

/// The folder layouts [`load_dir`] recognises, for error messages.
pub const DATASET_LAYOUTS: &str = "train-images*/train-labels* + test-* IDX or .npy files, \
     train*.csv[.gz] + test*.csv[.gz], or a single .csv[.gz]";

/// Regular file names in `dir`, sorted, skipping hidden files.
pub(crate) fn list_files(dir: &Path) -> EngineResult<Vec<String>> {
    // `read_dir` on a file says only "Not a directory": name the mix-up.
    if std::fs::metadata(dir).is_ok_and(|meta| meta.is_file()) {
        let cause = format!(
            "this is a file, but a dataset is a folder holding {DATASET_LAYOUTS}; give the \
             folder that holds it (a single .csv[.gz] in a folder is split 80/20 into train and \
             test)"
        );
        return Err(data_err(dir, cause));
    }
    let entries =
        std::fs::read_dir(dir).map_err(|e| data_err(dir, format!("cannot list folder: {e}")))?;
    let mut names = Vec::new();
    for entry in entries.take(MAX_DIR_ENTRIES + 1) {
        let entry = entry.map_err(|e| data_err(dir, format!("cannot list folder: {e}")))?;
        let is_file = entry
            .file_type()
            .is_ok_and(|t| t.is_file() || t.is_symlink());
        let name = entry.file_name().to_string_lossy().into_owned();
        if is_file && !name.starts_with('.') {
            names.push(name);
        }
    }
    if names.len() > MAX_DIR_ENTRIES {
        return Err(data_err(
            dir,
            format!("folder has more than {MAX_DIR_ENTRIES} files"),
        ));
    }
    names.sort();
    Ok(names)
}

/// The one file starting with any of `prefixes` (and, given `csv`, ending
/// `.csv` or `.csv.gz`); two candidates are an error rather than a guess.
fn find_one(
    dir: &Path,
    names: &[String],
    prefixes: &[&str],
    csv: Option<&str>,
) -> EngineResult<Option<PathBuf>> {
    let matches: Vec<&String> = names
        .iter()
        .filter(|n| prefixes.iter().any(|p| n.starts_with(p)))
        .filter(|n| {
            csv.is_none_or(|ext| {
                n.ends_with(&format!(".{ext}")) || n.ends_with(&format!(".{ext}.gz"))
            })
        })
        .collect();
    match matches.as_slice() {
        [] => Ok(None),
        [one] => Ok(Some(dir.join(one))),
        many => Err(data_err(
            dir,
            format!("ambiguous: several files match {prefixes:?}: {many:?}"),
        )),
    }
}

fn require(dir: &Path, found: Option<PathBuf>, what: &str) -> EngineResult<PathBuf> {
    found.ok_or_else(|| data_err(dir, format!("found training files but no {what} file")))
}
