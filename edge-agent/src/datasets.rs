//! Local datasets: how each kind is found and loaded, the registry in
//! `datasets.toml`, the deterministic 10% held out for evaluation, and
//! shaping a dataset for a model.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use canopy_engine::data::{Dataset, LabelColumn, load_csv, load_idx, load_npy_dataset};
use canopy_sdk::local::LocalData;
use clap::ValueEnum;
use serde::{Deserialize, Serialize};

use crate::files::{DataDir, MAX_DATASETS_BYTES, hinted, read_text, write_public};

/// Most datasets one agent registers.
pub const MAX_DATASETS: usize = 256;
pub const MAX_NAME_CHARS: usize = 64;
/// Most entries listed when looking for IDX files in a folder.
const MAX_DIR_ENTRIES: usize = 10_000;

/// The file formats `data add` understands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum DataKind {
    /// IDX (MNIST) images + labels: a folder holding one `train-images*`
    /// and one `train-labels*` file (or one `*images*` and one `*labels*`
    /// file), or the images file with `--labels FILE`. Gzipped or not.
    Idx,
    /// One CSV or CSV.gz file, the label in the last column; a header
    /// line is detected.
    Csv,
    /// A folder holding `images.npy` and `labels.npy`, or the images
    /// file with `--labels FILE`.
    Npy,
    /// One UTF-8 text file (plain or `.gz`), for next-character models
    /// (`charlm`): every window of `--sequence` characters, labelled with
    /// the character after it. The last fifth of its lines is held out.
    Text,
}

impl DataKind {
    pub fn as_str(self) -> &'static str {
        match self {
            DataKind::Idx => "idx",
            DataKind::Csv => "csv",
            DataKind::Npy => "npy",
            DataKind::Text => "text",
        }
    }
}

/// Where a dataset's files are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DataSource {
    pub kind: DataKind,
    pub path: PathBuf,
    /// The labels file, when given separately.
    pub labels: Option<PathBuf>,
    /// Characters per sample, for `text` (80 when not given).
    pub sequence: Option<usize>,
}

/// Characters per sample of a `text` dataset when `--sequence` is not
/// given: what `canopy model new charlm` reads.
pub const DEFAULT_TEXT_SEQUENCE: usize = 80;

impl DataSource {
    /// The dataset, split once into what is trained on and what is held
    /// out: in line order for text, by the SDK's stratified rule otherwise.
    pub fn load_local(&self, name: &str) -> Result<LocalData> {
        if self.kind == DataKind::Text {
            if self.labels.is_some() {
                bail!("--labels is for idx and npy data; a text's labels are its next characters");
            }
            let lines = canopy_engine::data::read_text_lines(&self.path)
                .with_context(|| format!("cannot load text dataset `{}`", self.path.display()))?;
            let sequence = self.sequence.unwrap_or(DEFAULT_TEXT_SEQUENCE);
            let local = LocalData::text(name, &lines, sequence)
                .with_context(|| format!("cannot load text dataset `{}`", self.path.display()))?;
            if local.train.is_empty() {
                bail!(
                    "text dataset `{}` is too short: its training lines hold no window of {sequence} characters and the next",
                    self.path.display()
                );
            }
            return Ok(local);
        }
        if self.sequence.is_some() {
            bail!("--sequence is for text data");
        }
        let data = self.load()?;
        Ok(LocalData::split(name, &data)?)
    }

    /// Loads samples of a kind that is not text, naming the dataset's
    /// path in every error.
    fn load(&self) -> Result<Dataset> {
        let loaded = match (self.kind, &self.labels) {
            (DataKind::Text, _) => unreachable!("load_local reads text by lines"),
            (DataKind::Csv, Some(_)) => bail!(
                "--labels is for idx and npy data; a CSV file holds its labels in the last column"
            ),
            (DataKind::Csv, None) => {
                if self.path.is_dir() {
                    bail!(
                        "`{}` is a folder; --kind csv takes one .csv or .csv.gz file",
                        self.path.display()
                    );
                }
                load_csv(&self.path, LabelColumn::Last)
            }
            (DataKind::Idx, Some(labels)) => load_idx(&self.path, labels),
            (DataKind::Idx, None) => {
                let (images, labels) = find_idx_pair(&self.path)?;
                load_idx(images, labels)
            }
            (DataKind::Npy, Some(labels)) => load_npy_dataset(&self.path, labels),
            (DataKind::Npy, None) => {
                if !self.path.is_dir() {
                    bail!(
                        "`{}` is not a folder; --kind npy takes a folder holding images.npy and labels.npy, or the images file with --labels FILE",
                        self.path.display()
                    );
                }
                load_npy_dataset(self.path.join("images.npy"), self.path.join("labels.npy"))
            }
        };
        let data = loaded.with_context(|| {
            format!(
                "cannot load {} dataset `{}`",
                self.kind.as_str(),
                self.path.display()
            )
        })?;
        if data.is_empty() {
            bail!("dataset `{}` has no samples", self.path.display());
        }
        Ok(data)
    }
}

/// The images and labels IDX files in `dir`: `train-images*` and
/// `train-labels*` when present (a `test-*` pair beside them is ignored:
/// the agent holds out its own 10%), else the one `*images*` and the one
/// `*labels*` file.
fn find_idx_pair(dir: &Path) -> Result<(PathBuf, PathBuf)> {
    if !dir.is_dir() {
        return Err(hinted(
            format!("`{}` is not a folder", dir.display()),
            "--kind idx takes a folder with train-images*/train-labels* files, or an images file with --labels FILE",
        ));
    }
    let mut names = Vec::new();
    let entries =
        std::fs::read_dir(dir).with_context(|| format!("cannot list `{}`", dir.display()))?;
    for entry in entries.take(MAX_DIR_ENTRIES + 1) {
        let entry = entry.with_context(|| format!("cannot list `{}`", dir.display()))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.starts_with('.') && entry.path().is_file() {
            names.push(name);
        }
    }
    if names.len() > MAX_DIR_ENTRIES {
        bail!(
            "`{}` holds more than {MAX_DIR_ENTRIES} files",
            dir.display()
        );
    }
    names.sort();
    let pick = |what: &str| -> Result<PathBuf> {
        let prefixed: Vec<&String> = names
            .iter()
            .filter(|n| n.starts_with(&format!("train-{what}")))
            .collect();
        let candidates = if prefixed.is_empty() {
            names.iter().filter(|n| n.contains(what)).collect()
        } else {
            prefixed
        };
        match candidates.as_slice() {
            [one] => Ok(dir.join(one)),
            [] => Err(hinted(
                format!("`{}` holds no IDX {what} file", dir.display()),
                format!(
                    "expected a file named train-{what}* (or one name containing `{what}`); found {names:?}"
                ),
            )),
            many => Err(hinted(
                format!("`{}` holds several {what} files: {many:?}", dir.display()),
                "name the images file with --path and the labels file with --labels",
            )),
        }
    };
    Ok((pick("images")?, pick("labels")?))
}

/// One registered dataset, with what was learned when it was added.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatasetEntry {
    pub name: String,
    pub kind: DataKind,
    /// Absolute path of the file or folder.
    pub path: PathBuf,
    /// Absolute path of the labels file, when given separately.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<PathBuf>,
    /// Characters per sample, for `text`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sequence: Option<usize>,
    pub samples: u64,
    pub feature_shape: Vec<usize>,
    pub classes: u64,
    pub added_unix_ms: u64,
}

impl DatasetEntry {
    pub fn source(&self) -> DataSource {
        DataSource {
            kind: self.kind,
            path: self.path.clone(),
            labels: self.labels.clone(),
            sequence: self.sequence,
        }
    }
}

/// `datasets.toml`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Registry {
    /// The dataset `run`, `train` and `eval` use when none is named.
    pub default: Option<String>,
    #[serde(default, rename = "dataset")]
    pub datasets: Vec<DatasetEntry>,
}

impl Registry {
    pub fn load(dir: &DataDir) -> Result<Registry> {
        let path = dir.datasets();
        let Some(text) = read_text(&path, MAX_DATASETS_BYTES)? else {
            return Ok(Registry::default());
        };
        let registry: Registry = toml::from_str(&text)
            .with_context(|| format!("dataset registry `{}` is invalid", path.display()))?;
        if registry.datasets.len() > MAX_DATASETS {
            bail!(
                "dataset registry `{}` has {} datasets, the limit is {MAX_DATASETS}",
                path.display(),
                registry.datasets.len()
            );
        }
        Ok(registry)
    }

    pub fn save(&self, dir: &DataDir) -> Result<()> {
        let path = dir.datasets();
        let body = toml::to_string(self).context("cannot serialise the dataset registry")?;
        let text = format!("# Written by `canopy-agent data add`.\n{body}");
        write_public(&path, text.as_bytes())
            .with_context(|| format!("cannot write dataset registry `{}`", path.display()))
    }

    pub fn get(&self, name: &str) -> Option<&DatasetEntry> {
        self.datasets.iter().find(|d| d.name == name)
    }

    /// The named dataset, or the default one.
    pub fn resolve(&self, dir: &DataDir, name: Option<&str>) -> Result<&DatasetEntry> {
        let hint = "register one with `canopy-agent data add NAME --kind csv --path FILE`";
        let name = match name.or(self.default.as_deref()) {
            Some(name) => name,
            None => {
                return Err(hinted(
                    format!("no dataset is registered in `{}`", dir.datasets().display()),
                    hint,
                ));
            }
        };
        self.get(name).ok_or_else(|| {
            let known: Vec<&str> = self.datasets.iter().map(|d| d.name.as_str()).collect();
            hinted(
                format!("dataset `{name}` is not registered (registered: {known:?})"),
                hint,
            )
        })
    }

    /// Adds or replaces `entry`; returns whether it replaced one. The
    /// first dataset added becomes the default.
    pub fn upsert(&mut self, entry: DatasetEntry, make_default: bool) -> Result<bool> {
        let name = entry.name.clone();
        let replaced = if let Some(slot) = self.datasets.iter_mut().find(|d| d.name == name) {
            *slot = entry;
            true
        } else {
            if self.datasets.len() >= MAX_DATASETS {
                bail!("{MAX_DATASETS} datasets are registered already, the limit");
            }
            self.datasets.push(entry);
            false
        };
        if make_default || self.default.is_none() {
            self.default = Some(name);
        }
        Ok(replaced)
    }
}

/// Dataset names: 1..=64 characters of `[A-Za-z0-9_.-]`.
pub fn check_name(name: &str) -> Result<()> {
    let ok = (1..=MAX_NAME_CHARS).contains(&name.chars().count())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
    if !ok {
        bail!(
            "dataset name `{}` must be 1..={MAX_NAME_CHARS} characters of [A-Za-z0-9_.-]",
            crate::files::truncate(name, MAX_NAME_CHARS)
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str) -> DatasetEntry {
        DatasetEntry {
            name: name.into(),
            kind: DataKind::Csv,
            path: PathBuf::from("/data/x.csv"),
            labels: None,
            sequence: None,
            samples: 10,
            feature_shape: vec![4],
            classes: 2,
            added_unix_ms: 0,
        }
    }

    #[test]
    fn the_first_dataset_is_the_default_and_names_are_unique() {
        let mut registry = Registry::default();
        assert!(!registry.upsert(entry("a"), false).unwrap());
        assert!(!registry.upsert(entry("b"), false).unwrap());
        assert_eq!(registry.default.as_deref(), Some("a"));
        assert!(registry.upsert(entry("b"), true).unwrap(), "replaced");
        assert_eq!(registry.datasets.len(), 2);
        assert_eq!(registry.default.as_deref(), Some("b"));
        let text = toml::to_string(&registry).unwrap();
        assert_eq!(toml::from_str::<Registry>(&text).unwrap(), registry);
    }

    #[test]
    fn names_are_checked() {
        check_name("digits-v2.1_a").unwrap();
        assert!(check_name("").is_err());
        assert!(check_name("a b").is_err());
        assert!(check_name(&"x".repeat(65)).is_err());
    }
}
