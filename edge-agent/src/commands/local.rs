//! `train --local` and `eval`: offline checks that this machine can train
//! and evaluate a model on its registered data, on the same held-out 10%
//! the daemon evaluates on.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use std::ops::ControlFlow;

use canopy_engine::Backend;
use canopy_engine::data::Dataset;
use canopy_engine::select::{BackendChoice, open_backend};
use canopy_engine::train::{EvalStats, FitConfig, FitProgress, Trainer, fit};
use canopy_engine::zoo::{fit_input_stats, model_optimizer, needs_input_stats};
use canopy_ir::Model;
use canopy_protocol::bounds::{
    MAX_BATCH_SIZE, MAX_EPOCHS, MAX_LEARNING_RATE, MAX_MODEL_BYTES, check_batch_size, check_epochs,
    check_learning_rate,
};
use canopy_sdk::local::fit_to_model;
use canopy_term::progress::FitBar;
use clap::Args;

use crate::datasets::{DataKind, DataSource, Registry};
use crate::files::{DataDir, hinted, read_bounded};
use crate::output::outln;

#[derive(Args)]
pub struct TrainArgs {
    /// Train on this machine only; nothing is sent anywhere (required: the
    /// daemon, `run`, is how the agent trains for a server).
    #[arg(long)]
    local: bool,
    /// The model file (with a `train_step` entry point).
    #[arg(long)]
    model: PathBuf,
    /// A registered dataset; default: the default one.
    #[arg(long)]
    dataset: Option<String>,
    #[arg(long, default_value_t = 1)]
    epochs: u32,
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// The learning rate; default: the model's optimizer's (0.1 for SGD,
    /// 0.001 for Adam), as `canopy model train` takes it.
    #[arg(long)]
    lr: Option<f32>,
    /// Seed of the shuffling.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// cpu, gpu (any Vulkan, Metal or DX12 adapter) or auto (a hardware
    /// GPU when there is one, else the CPU).
    #[arg(long, default_value_t = BackendChoice::Auto)]
    backend: BackendChoice,
}

#[derive(Args)]
#[command(group = clap::ArgGroup::new("source").required(true).args(["dataset", "kind"]))]
pub struct EvalArgs {
    /// The model file.
    #[arg(long)]
    model: PathBuf,
    /// A registered dataset.
    #[arg(long, conflicts_with_all = ["kind", "path", "labels", "sequence"])]
    dataset: Option<String>,
    /// An unregistered dataset's kind (see `data add --help`).
    #[arg(long, value_enum, requires = "path")]
    kind: Option<DataKind>,
    /// An unregistered dataset's file or folder.
    #[arg(long, requires = "kind")]
    path: Option<PathBuf>,
    /// The labels file, for `idx` and `npy` when --path names the images file.
    #[arg(long, requires = "kind")]
    labels: Option<PathBuf>,
    /// Characters per sample, for `text` [default: 80].
    #[arg(long, requires = "kind")]
    sequence: Option<usize>,
    #[arg(long, default_value_t = 256)]
    batch: usize,
    /// Print one JSON object `{"accuracy", "loss", "samples"}` and nothing else.
    #[arg(long)]
    json: bool,
    /// cpu, gpu or auto, as for `train`.
    #[arg(long, default_value_t = BackendChoice::Auto)]
    backend: BackendChoice,
}

fn read_model(path: &Path) -> Result<Model> {
    // The largest model a device downloads is the largest it reads.
    let bytes = read_bounded(path, MAX_MODEL_BYTES)
        .with_context(|| format!("cannot read model file `{}`", path.display()))?
        .ok_or_else(|| anyhow::anyhow!("model file `{}` does not exist", path.display()))?;
    canopy_ir::format::read_model(&bytes)
        .with_context(|| format!("`{}` is not a valid Canopy model file", path.display()))
}

fn check_batch(batch: usize) -> Result<()> {
    // The bounds a task's batch size is held to, so a typo cannot run for
    // days.
    if check_batch_size("--batch", batch as u64).is_err() {
        bail!("--batch {batch} is out of range (1..={MAX_BATCH_SIZE})");
    }
    Ok(())
}

/// The held-out evaluation of `model` on `backend` (on rayon's pool, where
/// the CPU's kernels fork and join).
fn evaluate(
    model: &Model,
    data: &Dataset,
    batch: usize,
    backend: &dyn Backend,
) -> Result<EvalStats> {
    rayon::scope(|_| canopy_engine::train::evaluate(model, data, batch, backend))
        .context("evaluation failed")
}

pub fn train(dir: &DataDir, args: TrainArgs) -> Result<()> {
    if !args.local {
        return Err(hinted(
            "`train` only runs locally",
            "pass --local for an offline run; `canopy-agent run` trains for a server",
        ));
    }
    if check_epochs("--epochs", u64::from(args.epochs)).is_err() {
        bail!(
            "--epochs {} is out of range (1..={MAX_EPOCHS})",
            args.epochs
        );
    }
    check_batch(args.batch)?;
    let mut model = read_model(&args.model)?;
    let lr = learning_rate(&args, &model)?;
    let registry = Registry::load(dir)?;
    let entry = registry.resolve(dir, args.dataset.as_deref())?;
    let local = entry
        .source()
        .load_local(&entry.name)
        .with_context(|| format!("cannot load registered dataset `{}`", entry.name))?;
    let (train, test) = (local.train, local.holdout);
    let context = || {
        format!(
            "dataset `{}` does not fit model `{}`",
            entry.name,
            args.model.display()
        )
    };
    let train = fit_to_model(&train, &model)
        .with_context(context)?
        .into_owned();
    let test = fit_to_model(&test, &model)
        .with_context(context)?
        .into_owned();
    if test.is_empty() {
        bail!(
            "dataset `{}` has too few samples ({}) to hold any out for evaluation",
            entry.name,
            train.len()
        );
    }
    if needs_input_stats(&model) {
        fit_input_stats(&mut model, &train).context("cannot fit the model's input statistics")?;
        tracing::info!(
            samples = train.len(),
            "fitted the model's input statistics on the training split"
        );
    }
    let backend = open_backend(args.backend)?;
    tracing::info!(backend = %describe(backend.as_ref()), "training backend");
    let before = evaluate(&model, &test, 256, backend.as_ref())?;
    outln!(
        "dataset `{}`: {} training samples, {} held out",
        entry.name,
        train.len(),
        test.len()
    )?;
    outln!(
        "held-out accuracy before: {:.4} (loss {:.4})",
        before.accuracy,
        before.loss
    )?;
    let started = Instant::now();
    let mut trainer = Trainer::new(&model, backend.as_ref(), args.seed)
        .with_context(|| format!("cannot prepare `{}` for training", args.model.display()))?;
    let config = FitConfig::new(args.epochs, args.batch, lr, args.seed);
    let mut bar = FitBar::new(args.epochs);
    let mut printed: Result<()> = Ok(());
    let mut observe = |progress: FitProgress| {
        if let FitProgress::Batch {
            epoch,
            done,
            batches,
            mean_loss,
            ..
        } = progress
        {
            bar.batch(epoch, done, batches, mean_loss);
        }
        if let FitProgress::Epoch(epoch) = progress {
            bar.epoch_done(epoch.epoch, epoch.loss, epoch.accuracy);
            printed = outln!(
                "epoch {:>3}/{}  train loss {:.4}  train accuracy {:.4}",
                epoch.epoch,
                args.epochs,
                epoch.loss,
                epoch.accuracy
            )
            .map_err(anyhow::Error::from);
            if printed.is_err() {
                return ControlFlow::Break(());
            }
        }
        ControlFlow::Continue(())
    };
    let fitted = fit(&mut trainer, &train, &config, &mut observe);
    printed?;
    fitted.with_context(|| format!("training `{}`", args.model.display()))?;
    trainer.write_back(&mut model)?;
    let after = evaluate(&model, &test, 256, backend.as_ref())?;
    outln!(
        "held-out accuracy after:  {:.4} (loss {:.4})",
        after.accuracy,
        after.loss
    )?;
    outln!(
        "held-out accuracy {:.4} -> {:.4} in {:.1} s",
        before.accuracy,
        after.accuracy,
        started.elapsed().as_secs_f64()
    )?;
    Ok(())
}

/// The backend's name, with the adapter for a GPU.
fn describe(backend: &dyn Backend) -> String {
    let info = backend.describe();
    match info.adapter {
        Some(adapter) => format!("{} ({}, {})", info.backend, adapter.name, adapter.api),
        None => info.backend,
    }
}

pub fn eval(dir: &DataDir, args: EvalArgs) -> Result<()> {
    check_batch(args.batch)?;
    let model = read_model(&args.model)?;
    let (name, source) = match (&args.dataset, args.kind, &args.path) {
        (Some(name), _, _) => {
            let registry = Registry::load(dir)?;
            let entry = registry.resolve(dir, Some(name))?;
            (format!("`{}`", entry.name), entry.source())
        }
        (None, Some(kind), Some(path)) => (
            format!("`{}`", path.display()),
            DataSource {
                kind,
                path: path.clone(),
                labels: args.labels.clone(),
                sequence: args.sequence,
            },
        ),
        _ => bail!("give --dataset NAME, or --kind and --path"),
    };
    let local = source.load_local(&name)?;
    let samples = local.train.len() + local.holdout.len();
    let test = local.holdout;
    let test = fit_to_model(&test, &model).with_context(|| {
        format!(
            "dataset {name} does not fit model `{}`",
            args.model.display()
        )
    })?;
    if test.is_empty() {
        bail!("dataset {name} has too few samples ({samples}) to hold any out for evaluation");
    }
    let backend = open_backend(args.backend)?;
    let stats = evaluate(&model, &test, args.batch, backend.as_ref())?;
    if args.json {
        outln!(
            "{}",
            serde_json::json!({"accuracy": stats.accuracy, "loss": stats.loss, "samples": stats.samples})
        )?;
    } else {
        outln!(
            "{} on the held-out 10% of {name}: accuracy {:.4}, loss {:.4} over {} samples",
            args.model.display(),
            stats.accuracy,
            stats.loss,
            stats.samples
        )?;
    }
    Ok(())
}

/// `--lr`, else the default of the optimizer the model's `train_step` was
/// built with, within the training bounds every tier shares.
fn learning_rate(args: &TrainArgs, model: &Model) -> Result<f32> {
    let optimizer = model_optimizer(model)
        .with_context(|| format!("cannot read `{}`'s optimizer", args.model.display()))?;
    let lr = args.lr.unwrap_or_else(|| optimizer.default_learning_rate());
    if check_learning_rate("--lr", f64::from(lr)).is_err() {
        bail!("--lr {lr} must be a positive finite number at most {MAX_LEARNING_RATE}");
    }
    if args.lr.is_none() {
        tracing::info!(
            "learning rate {lr}, {}'s default (--lr sets another)",
            optimizer.name()
        );
    }
    Ok(lr)
}
