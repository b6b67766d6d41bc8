use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, anyhow};
use canopy_engine::CpuBackend;
use canopy_engine::data::Dataset;
use canopy_engine::optim::Optimizer;
use canopy_engine::train::{Evaluator, Trainer};
use canopy_engine::zoo::{
    PROP_OPTIMIZER, fit_input_stats, needs_input_stats, rebuild_train_step, set_frozen,
};
use canopy_ir::Model;
use canopy_protocol::bounds::{self, BoundsError};
use clap::Args;

use super::load_for_model;
use crate::DataArgs;
use crate::files::{read_model_file, short_digest, write_model_file};
use crate::output::outln;
use crate::progress;

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
    let mut trainer = Trainer::new(&model, &CpuBackend, args.seed)?;
    let mut last = None;
    let started = Instant::now();
    for epoch in 1..=args.epochs {
        let (loss, accuracy) = train_epoch(&mut trainer, &train, &args, epoch)
            .with_context(|| format!("training epoch {epoch} of `{}`", args.file.display()))?;
        trainer.write_back(&mut model)?;
        let eval = evaluate(&model, &test, args.batch)?;
        outln!(
            "epoch {epoch:>3}/{}  train loss {loss:.4}  train acc {accuracy:.4}  test loss {:.4}  test acc {:.4}",
            args.epochs,
            eval.loss,
            eval.accuracy
        )?;
        tracing::debug!(
            epoch,
            loss,
            accuracy,
            test_accuracy = eval.accuracy,
            "epoch done"
        );
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

/// Runs on a rayon worker, so each step's kernels fork and join inside the
/// pool rather than waking it from outside once per step.
fn train_epoch(
    trainer: &mut Trainer,
    train: &Dataset,
    args: &TrainArgs,
    epoch: usize,
) -> Result<(f64, f64)> {
    rayon::scope(|_| train_epoch_here(trainer, train, args, epoch))
}

fn train_epoch_here(
    trainer: &mut Trainer,
    train: &Dataset,
    args: &TrainArgs,
    epoch: usize,
) -> Result<(f64, f64)> {
    // A short final batch makes one high-variance step that can undo much
    // of an epoch at SGD learning rates; it is dropped (each epoch reshuffles,
    // so every sample is still seen) unless it is the whole dataset.
    let drop_last = train.len() >= args.batch;
    let batches = if drop_last {
        train.len() / args.batch
    } else {
        1
    } as u64;
    let bar = progress::bar(batches, format!("epoch {epoch}"));
    let (mut loss_sum, mut correct, mut seen) = (0.0f64, 0i64, 0usize);
    let shuffle_seed = args
        .seed
        .wrapping_mul(0x9E37_79B9)
        .wrapping_add(epoch as u64);
    for batch in train.batches(args.batch, Some(shuffle_seed), drop_last)? {
        let size = batch.len();
        let stats = trainer.step(batch.x, batch.y, args.lr)?;
        loss_sum += stats.loss as f64 * size as f64;
        correct += stats.correct;
        seen += size;
        bar.inc(1);
        bar.set_message(format!("loss {:.4}", loss_sum / seen as f64));
    }
    bar.finish_and_clear();
    let seen = seen.max(1) as f64;
    Ok((loss_sum / seen, correct as f64 / seen))
}

pub fn evaluate(
    model: &Model,
    test: &Dataset,
    batch: usize,
) -> Result<canopy_engine::train::EvalStats> {
    let mut evaluator = Evaluator::new(model, &CpuBackend)?;
    let (mut loss, mut correct) = (0.0f64, 0i64);
    for b in test.batches(batch, None, false)? {
        let (l, c) = evaluator.batch(b.x, b.y)?;
        loss += l;
        correct += c;
    }
    let samples = test.len();
    let n = samples.max(1) as f64;
    Ok(canopy_engine::train::EvalStats {
        loss: loss / n,
        accuracy: correct as f64 / n,
        samples,
    })
}
