use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, anyhow};
use canopy_engine::Backend;
use canopy_engine::data::Dataset;
use canopy_engine::optim::Optimizer;
use canopy_engine::select::{BackendChoice, open_backend};
use canopy_engine::train::{FitConfig, Trainer, fit};
use canopy_engine::zoo::{
    PROP_OPTIMIZER, fit_input_stats, needs_input_stats, rebuild_train_step, set_frozen,
};
use canopy_ir::Model;
use canopy_protocol::bounds::{self, BoundsError};
use canopy_term::progress::FitBar;
use clap::Args;

use super::load_for_model;
use crate::DataArgs;
use crate::files::{read_model_file, short_digest, write_model_file};
use crate::output::outln;

#[derive(Args)]
pub struct TrainArgs {
    /// The model file to start from.
    file: PathBuf,
    #[command(flatten)]
    data: DataArgs,
    #[arg(long, default_value_t = 5)]
    epochs: usize,
    #[arg(long, default_value_t = 64)]
    batch: usize,
    #[arg(long, default_value_t = 0.1)]
    lr: f32,
    /// Rebuild `train_step` with this optimizer (sgd, adam, adamw, or a spec
    /// like `sgd:momentum=0.9`); default: the one in the file.
    #[arg(long)]
    optimizer: Option<String>,
    /// Freeze parameters whose name starts with this prefix (repeatable).
    #[arg(long)]
    freeze: Vec<String>,
    /// Seed of shuffling and dropout.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Where to write the trained model.
    #[arg(short, long)]
    output: PathBuf,
    /// Print one JSON object with the final metrics as the last line.
    #[arg(long)]
    json: bool,
    /// cpu, gpu (any Vulkan, Metal or DX12 adapter) or auto (a hardware
    /// GPU when there is one, else the CPU).
    #[arg(long, default_value_t = BackendChoice::Auto)]
    backend: BackendChoice,
}

pub fn run(args: TrainArgs) -> Result<()> {
    check_args(&args)?;
    let (mut model, parent) = read_model_file(&args.file)?;
    retarget(&mut model, &args)?;
    let (train, test) = load_for_model(&args.data.data, &model)?;
    if needs_input_stats(&model) {
        fit_input_stats(&mut model, &train)?;
        tracing::info!(
            "fitted the input statistics on {} training samples",
            train.len()
        );
    }
    let backend = open_backend(args.backend)?;
    tracing::info!(backend = %super::describe_backend(backend.as_ref()), "training backend");
    let mut trainer = Trainer::new(&model, backend.as_ref(), args.seed)?;
    let started = Instant::now();
    let mut last = None;
    for epoch in 1..=args.epochs {
        // One epoch of the engine's loop at a time, so the test set is
        // evaluated after each.
        let config = FitConfig {
            start_epoch: epoch as u32 - 1,
            ..FitConfig::new(1, args.batch, args.lr, args.seed)
        };
        let mut bar = FitBar::new(args.epochs as u32);
        let stats = fit(&mut trainer, &train, &config, &mut |p| {
            crate::progress::show(&mut bar, p)
        })
        .with_context(|| format!("training epoch {epoch} of `{}`", args.file.display()))?;
        let stats = stats
            .last()
            .copied()
            .ok_or_else(|| anyhow!("no epoch ran"))?;
        trainer.write_back(&mut model)?;
        let eval = evaluate(&model, &test, args.batch, backend.as_ref())?;
        outln!(
            "epoch {epoch:>3}/{}  train loss {:.4}  train acc {:.4}  test loss {:.4}  test acc {:.4}",
            args.epochs,
            stats.loss,
            stats.accuracy,
            eval.loss,
            eval.accuracy
        )?;
        last = Some(eval);
    }
    model.metadata.parent_digest = Some(parent);
    let digest = write_model_file(&args.output, &model)?;
    let seconds = started.elapsed().as_secs_f64();
    outln!(
        "wrote {} (digest {}, parent {}) in {seconds:.1} s",
        args.output.display(),
        short_digest(&digest),
        short_digest(&parent)
    )?;
    if let (true, Some(eval)) = (args.json, last) {
        outln!(
            "{}",
            serde_json::json!({
                "loss": eval.loss, "accuracy": eval.accuracy, "samples": eval.samples,
                "epochs": args.epochs, "seconds": seconds,
            })
        )?;
    }
    Ok(())
}

/// Refuses settings outside the training bounds every tier shares
/// (`canopy_protocol::bounds`), so a typo cannot run for days and a run
/// here is one a device would accept.
fn check_args(args: &TrainArgs) -> Result<()> {
    let count = |n: usize| u64::try_from(n).unwrap_or(u64::MAX);
    bounds::check_epochs("--epochs", count(args.epochs)).map_err(flag_error)?;
    bounds::check_batch_size("--batch", count(args.batch)).map_err(flag_error)?;
    bounds::check_learning_rate("--lr", f64::from(args.lr)).map_err(flag_error)?;
    Ok(())
}

/// A broken bound in the CLI's words, naming the flag:
/// `--epochs 0 is out of range 1..=1000`.
fn flag_error(error: BoundsError) -> anyhow::Error {
    match error {
        BoundsError::OutOfRange {
            field,
            value,
            allowed,
        } => anyhow!("{field} {value} is out of range {allowed}"),
        other => other.into(),
    }
}

/// Applies `--freeze` and `--optimizer` by deriving a new `train_step` from
/// the file's `train_loss` graph.
fn retarget(model: &mut Model, args: &TrainArgs) -> Result<()> {
    if args.freeze.is_empty() && args.optimizer.is_none() {
        return Ok(());
    }
    if !args.freeze.is_empty() {
        set_frozen(model, &args.freeze)?;
    }
    let spec = match &args.optimizer {
        Some(spec) => spec.clone(),
        None => model
            .metadata
            .properties
            .get(PROP_OPTIMIZER)
            .cloned()
            .unwrap_or_else(|| "sgd".into()),
    };
    let optimizer = Optimizer::parse(&spec)?;
    rebuild_train_step(model, &optimizer)
        .context("cannot derive a training step from the model's `train_loss` graph")?;
    Ok(())
}

/// The engine's evaluation on `backend`, on rayon's pool.
pub fn evaluate(
    model: &Model,
    test: &Dataset,
    batch: usize,
    backend: &dyn Backend,
) -> Result<canopy_engine::train::EvalStats> {
    Ok(rayon::scope(|_| {
        canopy_engine::train::evaluate(model, test, batch, backend)
    })?)
}
