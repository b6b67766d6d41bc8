//! `data add` and `data list`.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};

use crate::datasets::{DataKind, DataSource, DatasetEntry, Registry, check_name};
use crate::files::{DataDir, absolute, now_ms};
use crate::output::outln;
use crate::ownership;

#[derive(Subcommand)]
pub enum DataCommand {
    /// Check that a dataset loads and register it; the first one added is
    /// the default.
    ///
    /// Kinds: `csv` is one CSV or CSV.gz file with the label in the last
    /// column. `idx` is a folder with `train-images*` and `train-labels*`
    /// IDX files (gzipped or not; a `test-*` pair beside them is ignored,
    /// since the agent holds out 10% of every dataset itself), or the
    /// images file with `--labels FILE`. `npy` is a folder with
    /// `images.npy` and `labels.npy`, or the images file with
    /// `--labels FILE`.
    Add(AddArgs),
    /// List the registered datasets (`*` marks the default).
    List,
}

#[derive(Args)]
pub struct AddArgs {
    /// Name to refer to the dataset by: 1..=64 characters of [A-Za-z0-9_.-].
    /// Adding a name again replaces its entry.
    name: String,
    #[arg(long, value_enum)]
    kind: DataKind,
    /// The file or folder; see the kinds above.
    #[arg(long)]
    path: PathBuf,
    /// The labels file, for `idx` and `npy` when --path names the images file.
    #[arg(long)]
    labels: Option<PathBuf>,
    /// Characters per sample, for `text` [default: 80, what `canopy model
    /// new charlm` reads].
    #[arg(long)]
    sequence: Option<usize>,
    /// Make this the default dataset.
    #[arg(long)]
    default: bool,
}

pub fn run(dir: &DataDir, command: DataCommand) -> Result<()> {
    match command {
        DataCommand::Add(args) => add(dir, args),
        DataCommand::List => list(dir),
    }
}

fn add(dir: &DataDir, args: AddArgs) -> Result<()> {
    check_name(&args.name)?;
    let source = DataSource {
        kind: args.kind,
        path: absolute(&args.path)?,
        labels: args.labels.as_deref().map(absolute).transpose()?,
        sequence: args.sequence,
    };
    let local = source
        .load_local(&args.name)
        .with_context(|| format!("dataset `{}` was not added", args.name))?;
    let data = &local.train;
    let samples = local.train.len() + local.holdout.len();
    let mut registry = Registry::load(dir)?;
    let entry = DatasetEntry {
        name: args.name.clone(),
        kind: source.kind,
        path: source.path.clone(),
        labels: source.labels.clone(),
        sequence: source.sequence,
        samples: samples as u64,
        feature_shape: data.feature_shape().to_vec(),
        classes: data.num_classes() as u64,
        added_unix_ms: now_ms(),
    };
    let replaced = registry.upsert(entry, args.default)?;
    dir.create()?;
    registry.save(dir)?;
    let counts: Vec<usize> = data
        .class_counts()
        .iter()
        .zip(local.holdout.class_counts())
        .map(|(a, b)| a + b)
        .collect();
    outln!(
        "{} dataset `{}`: {} samples, feature shape {:?}, {} classes (smallest class {} samples, largest {})",
        if replaced { "replaced" } else { "added" },
        args.name,
        samples,
        data.feature_shape(),
        data.num_classes(),
        counts.iter().min().copied().unwrap_or(0),
        counts.iter().max().copied().unwrap_or(0),
    )?;
    if registry.default.as_deref() == Some(args.name.as_str()) {
        outln!("`{}` is the default dataset", args.name)?;
    }
    for path in std::iter::once(&source.path).chain(source.labels.as_ref()) {
        if let Some(warning) = ownership::unreadable_by_service(&dir.root, path)? {
            outln!("warning: {warning}")?;
        }
    }
    Ok(())
}

fn list(dir: &DataDir) -> Result<()> {
    let registry = Registry::load(dir)?;
    if registry.datasets.is_empty() {
        outln!(
            "no datasets registered in `{}`; add one with `canopy-agent data add NAME --kind csv --path FILE`",
            dir.datasets().display()
        )?;
        return Ok(());
    }
    outln!(
        "  {:<20} {:<4} {:>9} {:<14} {:>7}  PATH",
        "NAME",
        "KIND",
        "SAMPLES",
        "SHAPE",
        "CLASSES"
    )?;
    for entry in &registry.datasets {
        let mark = if registry.default.as_deref() == Some(entry.name.as_str()) {
            '*'
        } else {
            ' '
        };
        let path = match &entry.labels {
            Some(labels) => format!("{} (labels {})", entry.path.display(), labels.display()),
            None => entry.path.display().to_string(),
        };
        outln!(
            "{mark} {:<20} {:<4} {:>9} {:<14} {:>7}  {path}",
            entry.name,
            entry.kind.as_str(),
            entry.samples,
            format!("{:?}", entry.feature_shape),
            entry.classes
        )?;
    }
    Ok(())
}
