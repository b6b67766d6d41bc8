use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, anyhow};
use canopy_engine::Backend;
use canopy_engine::EngineError;
use canopy_engine::data::Dataset;
use canopy_engine::optim::Optimizer;
use canopy_engine::select::{BackendChoice, open_backend};
use canopy_engine::train::{Divergence, DivergenceWatch, EvalStats, FitConfig, Trainer, fit};
use canopy_engine::zoo::{
    PROP_OPTIMIZER, class_count, fit_input_stats, model_optimizer, needs_input_stats,
    rebuild_train_step, set_frozen,
};
use canopy_ir::Model;
use canopy_protocol::bounds::{self, BoundsError};
use canopy_term::progress::FitBar;
use clap::Args;

use super::load_for_model;
use crate::DataArgs;
use crate::files::{Hint, read_model_file, short_digest, write_model_file};
use crate::output::{errln, outln};

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
    /// Learning rate; default: the optimizer's (sgd 0.1, sgd with
    /// momentum β 0.1·(1−β), adam and adamw 0.001).
    #[arg(long)]
    lr: Option<f32>,
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
    /// Write the output even when training diverges (an epoch's mean loss
    /// ends clearly above the first step's). Without it a diverging run
    /// stops at that epoch, writes nothing and fails.
    #[arg(long)]
    force: bool,
    /// cpu, gpu (any Vulkan, Metal or DX12 adapter) or auto (a hardware
    /// GPU when there is one, else the CPU).
    #[arg(long, default_value_t = BackendChoice::Auto)]
    backend: BackendChoice,
}

pub fn run(args: TrainArgs) -> Result<()> {
    check_args(&args)?;
    let (mut model, parent) = read_model_file(&args.file)?;
    retarget(&mut model, &args)?;
    let optimizer = model_optimizer(&model)?;
    let lr = learning_rate(&args, &optimizer)?;
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
    let started = Instant::now();
    let run = Run {
        args: &args,
        optimizer,
        lr,
        train: &train,
        test: &test,
        backend: backend.as_ref(),
    };
    let (last, diverged) = run.epochs(&mut model)?;
    model.metadata.parent_digest = Some(parent);
    let digest = write_model_file(&args.output, &model)?;
    let seconds = started.elapsed().as_secs_f64();
    human_line(
        args.json,
        format_args!(
            "wrote {}{} (digest {}, parent {}) in {seconds:.1} s",
            args.output.display(),
            if diverged.is_some() {
                ", diverged (--force)"
            } else {
                ""
            },
            short_digest(&digest),
            short_digest(&parent)
        ),
    )?;
    if let (true, Some(eval)) = (args.json, last) {
        outln!(
            "{}",
            serde_json::json!({
                "loss": eval.loss, "accuracy": eval.accuracy, "samples": eval.samples,
                "epochs": args.epochs, "seconds": seconds,
                // As the rate reads (0.001, not f32's 0.0010000000474974513).
                "learning_rate": lr.to_string().parse::<f64>().unwrap_or(f64::from(lr)),
                "optimizer": optimizer.to_string(), "diverged": diverged.is_some(),
            })
        )?;
    }
    Ok(())
}

/// A line for a person: on stdout, or on stderr under `--json`, whose
/// stdout is the one JSON document alone.
fn human_line(json: bool, line: std::fmt::Arguments<'_>) -> Result<()> {
    if json {
        canopy_term::write_error_line(line);
        Ok(())
    } else {
        Ok(canopy_term::write_line(line)?)
    }
}

/// One `canopy model train` run's settings, once resolved.
struct Run<'a> {
    args: &'a TrainArgs,
    optimizer: Optimizer,
    lr: f32,
    train: &'a Dataset,
    test: &'a Dataset,
    backend: &'a dyn Backend,
}

impl Run<'_> {
    /// Trains `model` for `--epochs`, evaluating after each and watching
    /// for divergence: the last evaluation, and the divergence `--force`
    /// let through. Without `--force` a diverged epoch ends the run with
    /// the error.
    fn epochs(&self, model: &mut Model) -> Result<(Option<EvalStats>, Option<Divergence>)> {
        let args = self.args;
        let mut trainer = Trainer::new(model, self.backend, args.seed)?;
        let mut watch = DivergenceWatch::new(class_count(model)?);
        let (mut last, mut diverged) = (None, None);
        for epoch in 1..=args.epochs {
            // One epoch of the engine's loop at a time, so the test set is
            // evaluated after each.
            let config = FitConfig {
                start_epoch: epoch as u32 - 1,
                ..FitConfig::new(1, args.batch, self.lr, args.seed)
            };
            let mut bar = FitBar::new(args.epochs as u32);
            let mut verdict = None;
            let stats = fit(&mut trainer, self.train, &config, &mut |p| {
                verdict = verdict.or(watch.observe(&p));
                crate::progress::show(&mut bar, p)
            })
            .map_err(|error| self.step_error(error))
            .with_context(|| format!("training epoch {epoch} of `{}`", args.file.display()))?;
            let stats = stats
                .last()
                .copied()
                .ok_or_else(|| anyhow!("no epoch ran"))?;
            trainer.write_back(model)?;
            let eval = evaluate(model, self.test, args.batch, self.backend)?;
            human_line(
                args.json,
                format_args!(
                    "epoch {epoch:>3}/{}  train loss {:.4}  train acc {:.4}  test loss {:.4}  test acc {:.4}",
                    args.epochs, stats.loss, stats.accuracy, eval.loss, eval.accuracy
                ),
            )?;
            last = Some(eval);
            if let Some(divergence) = verdict {
                if !args.force {
                    return Err(self.divergence_error(&divergence));
                }
                errln!("warning: {}", self.divergence_words(&divergence));
                errln!("  hint: {}", self.smaller_rate_hint());
                diverged = Some(divergence);
            }
        }
        Ok((last, diverged))
    }

    /// What diverged, with the optimizer and the learning rate that did it.
    fn divergence_words(&self, divergence: &Divergence) -> String {
        format!("{divergence} ({} at lr {})", self.optimizer.name(), self.lr)
    }

    /// What to try instead: a tenth of the rate, and the optimizer's
    /// default when the rate is above it.
    fn smaller_rate_hint(&self) -> String {
        let default = self.optimizer.default_learning_rate();
        let default_part = if default < self.lr {
            format!(" ({}'s default is {default})", self.optimizer.name())
        } else {
            String::new()
        };
        // A tenth of the rate as it reads (0.01, not f32's 0.010000001).
        let as_read: f64 = self.lr.to_string().parse().unwrap_or(f64::from(self.lr));
        format!(
            "train with a smaller learning rate, e.g. --lr {}{default_part}",
            as_read / 10.0
        )
    }

    /// A diverging run, stopped: nothing was written.
    fn divergence_error(&self, divergence: &Divergence) -> anyhow::Error {
        Hint::chain(
            vec![format!(
                "`{}` was not written: {}",
                self.args.output.display(),
                self.divergence_words(divergence)
            )],
            format!(
                "{}; or pass --force to write the diverged model anyway",
                self.smaller_rate_hint()
            ),
        )
    }

    /// A failed step, with the learning-rate hint when its loss or an
    /// updated value was not finite (the trainer rolled back; nothing is
    /// written).
    fn step_error(&self, error: EngineError) -> anyhow::Error {
        let non_finite = matches!(error, EngineError::Diverged { .. });
        let error = anyhow::Error::new(error);
        if non_finite {
            Hint::attach(error, self.smaller_rate_hint())
        } else {
            error
        }
    }
}

/// `--lr`, else the optimizer's default ([`Optimizer::default_learning_rate`]),
/// within the training bounds every tier shares.
fn learning_rate(args: &TrainArgs, optimizer: &Optimizer) -> Result<f32> {
    let lr = args.lr.unwrap_or_else(|| optimizer.default_learning_rate());
    bounds::check_learning_rate("--lr", f64::from(lr)).map_err(flag_error)?;
    if args.lr.is_none() {
        tracing::info!(
            "learning rate {lr}, {}'s default (--lr sets another)",
            optimizer.name()
        );
    }
    Ok(lr)
}

/// Refuses settings outside the training bounds every tier shares
/// (`canopy_protocol::bounds`), so a typo cannot run for days and a run
/// here is one a device would accept.
fn check_args(args: &TrainArgs) -> Result<()> {
    let count = |n: usize| u64::try_from(n).unwrap_or(u64::MAX);
    bounds::check_epochs("--epochs", count(args.epochs)).map_err(flag_error)?;
    bounds::check_batch_size("--batch", count(args.batch)).map_err(flag_error)?;
    if let Some(lr) = args.lr {
        bounds::check_learning_rate("--lr", f64::from(lr)).map_err(flag_error)?;
    }
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
