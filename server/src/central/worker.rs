//! The central evaluation worker: `canopy-server central-worker`, a child
//! process the server starts for each evaluation (`sandbox.rs`). It
//! bounds itself first (address space, CPU seconds), then loads the
//! model and the dataset its parent staged as files, evaluates on the
//! CPU and writes one [`WorkerReport`] as JSON on stdout.
//!
//! *Why a process:* an allocation past the address-space limit aborts the
//! process that makes it (Rust's allocation failure is an abort, not an
//! error), so only a process of its own lets a model that expands to a
//! terabyte fail alone. The parent holds the worker's stdin; when the
//! parent dies, however, the worker sees its stdin close and exits.

use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;

use canopy_engine::CpuBackend;
use canopy_engine::data::Dataset;
use canopy_engine::data::limits::DataBounds;
use canopy_engine::train::EvalStats;
use canopy_term::error_chain as chain;
use serde::{Deserialize, Serialize};

use crate::datasets;
use crate::store::datasets::DatasetKind;

/// The subcommand's name (hidden from `--help`).
pub const SUBCOMMAND: &str = "central-worker";
/// Exit status of a worker whose parent went away.
const ORPHANED_EXIT: u8 = 3;
/// Exit status of a worker that could not bound itself.
const UNBOUNDED_EXIT: u8 = 4;

/// What the parent passes; every path is in a staging directory of its own.
#[derive(clap::Args, Debug, Clone)]
pub struct WorkerArgs {
    /// The model file.
    #[arg(long)]
    pub model: PathBuf,
    /// The dataset's data part, and its labels part for IDX and NPY.
    #[arg(long)]
    pub data: PathBuf,
    #[arg(long)]
    pub labels: Option<PathBuf>,
    /// The dataset's format: csv, idx or npy.
    #[arg(long)]
    pub kind: String,
    /// The model's sample shape, comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub input_shape: Vec<usize>,
    /// Samples per batch (from the static bounds).
    #[arg(long)]
    pub batch: usize,
    /// The address-space limit, in bytes.
    #[arg(long)]
    pub memory_bytes: u64,
    /// The CPU-time limit, in seconds.
    #[arg(long)]
    pub cpu_seconds: u64,
    /// The dataset's bounds (`limits.max_dataset_bytes` and
    /// `limits.max_dataset_values`), as at upload.
    #[arg(long)]
    pub max_dataset_bytes: u64,
    #[arg(long)]
    pub max_dataset_values: usize,
}

/// The one line a worker writes on stdout.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum WorkerReport {
    Done {
        loss: f64,
        accuracy: f64,
        samples: u64,
    },
    /// The evaluation cannot be done (the reason is recorded on the round).
    Refused { reason: String },
}

/// The worker's `main`.
pub fn run(args: WorkerArgs) -> ExitCode {
    if let Err(error) = bound_self(args.memory_bytes, args.cpu_seconds) {
        canopy_term::errln!("error: the central evaluation worker cannot limit itself: {error}");
        return ExitCode::from(UNBOUNDED_EXIT);
    }
    exit_with_parent();
    let report = match evaluate(&args) {
        Ok(stats) if !stats.loss.is_finite() => WorkerReport::Refused {
            reason: format!(
                "the loss is {}: the dataset or the model holds a value that is not finite",
                stats.loss
            ),
        },
        Ok(stats) => WorkerReport::Done {
            loss: stats.loss,
            accuracy: stats.accuracy,
            samples: stats.samples as u64,
        },
        Err(reason) => WorkerReport::Refused { reason },
    };
    let line = serde_json::to_string(&report).unwrap_or_else(|_| "{}".to_string());
    match canopy_term::outln!("{line}") {
        Ok(()) => ExitCode::SUCCESS,
        Err(_) => ExitCode::from(canopy_term::STDOUT_CLOSED_EXIT),
    }
}

/// Address space and CPU seconds, hard limits (the worker cannot raise
/// them again); and first in line for the kernel's out-of-memory killer.
#[cfg(unix)]
fn bound_self(memory_bytes: u64, cpu_seconds: u64) -> std::io::Result<()> {
    use rlimit::Resource;
    rlimit::setrlimit(Resource::AS, memory_bytes, memory_bytes)?;
    // SIGXCPU at the soft limit, SIGKILL a second later.
    rlimit::setrlimit(Resource::CPU, cpu_seconds, cpu_seconds.saturating_add(1))?;
    // Best effort: only Linux has it, and raising one's own score needs
    // no privilege.
    let _ = std::fs::write("/proc/self/oom_score_adj", "1000");
    Ok(())
}

#[cfg(not(unix))]
fn bound_self(_memory_bytes: u64, _cpu_seconds: u64) -> std::io::Result<()> {
    Err(std::io::Error::other(
        "process limits need a Unix system; central evaluation is not available here",
    ))
}

/// Exits when stdin closes: the parent holds it open for the worker's
/// whole life, so a closed stdin means the parent died (a `kill -9`
/// leaves no one to kill the worker).
fn exit_with_parent() {
    let watcher = std::thread::Builder::new()
        .name("parent-watch".to_string())
        .stack_size(64 << 10)
        .spawn(|| {
            let mut byte = [0u8; 1];
            loop {
                match std::io::stdin().read(&mut byte) {
                    Ok(0) | Err(_) => std::process::exit(i32::from(ORPHANED_EXIT)),
                    Ok(_) => {}
                }
            }
        });
    if watcher.is_err() {
        std::process::exit(i32::from(ORPHANED_EXIT));
    }
}

fn evaluate(args: &WorkerArgs) -> Result<EvalStats, String> {
    let bytes = std::fs::read(&args.model)
        .map_err(|error| format!("cannot read the staged model: {error}"))?;
    let model = canopy_ir::format::read_model(&bytes)
        .map_err(|error| format!("the model does not load: {}", chain(&error)))?;
    drop(bytes);
    let dataset = load_dataset(args)?;
    // The engine scores a label past the model's classes as a wrong
    // prediction, which would report a number that means nothing.
    let classes = canopy_engine::zoo::class_count(&model)
        .map_err(|error| format!("the model's classes are unknown: {}", chain(&error)))?;
    if let Some(&label) = dataset
        .labels()
        .iter()
        .find(|&&l| l as u64 >= classes as u64)
    {
        return Err(format!(
            "the dataset has label {label}, but the model predicts {classes} classes (0 to {})",
            classes.saturating_sub(1)
        ));
    }
    canopy_engine::train::evaluate(&model, &dataset, args.batch.max(1), &CpuBackend)
        .map_err(|error| format!("the engine cannot evaluate the model: {}", chain(&error)))
}

/// The staged parts, parsed, with samples shaped for the model.
fn load_dataset(args: &WorkerArgs) -> Result<Dataset, String> {
    let kind = DatasetKind::parse(&args.kind)
        .ok_or_else(|| format!("`{}` is not a dataset format", args.kind))?;
    let bounds = DataBounds {
        max_bytes: args.max_dataset_bytes,
        max_values: args.max_dataset_values,
    };
    let dataset = datasets::parse_within(kind, &args.data, args.labels.as_deref(), &bounds)
        .map_err(|error| format!("the dataset does not parse: {}", chain(&error)))?;
    let shape = &args.input_shape;
    if dataset.feature_shape() == shape.as_slice() {
        return Ok(dataset);
    }
    let from = dataset.feature_shape().to_vec();
    dataset
        .with_feature_shape(shape)
        .map_err(|_| format!("its samples have shape {from:?}, but the model takes {shape:?}"))
}
