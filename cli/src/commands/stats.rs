//! `canopy model stats`: fits a model's input statistics alone, from the
//! training split of a dataset folder, with the moments and the writer
//! `canopy model train` and federated statistics rounds use.

use std::path::PathBuf;

use anyhow::{Context, Result};
use canopy_engine::stats::{InputMoments, InputStatsState, fit_model};
use clap::{ArgGroup, Args};

use super::load_for_model;
use crate::DataArgs;
use crate::files::{Hint, read_model_file, short_digest, write_model_file};
use crate::output::outln;

/// Where the fitted model goes is never implicit: overwriting the input
/// file replaces a version other files may name as their parent.
#[derive(Args)]
#[command(group(ArgGroup::new("destination").required(true).args(["output", "in_place"])))]
pub struct StatsArgs {
    /// The model file whose input statistics to fit.
    file: PathBuf,
    #[command(flatten)]
    data: DataArgs,
    /// Where to write the fitted model.
    #[arg(short, long)]
    output: Option<PathBuf>,
    /// Overwrite FILE with the fitted model.
    #[arg(long)]
    in_place: bool,
}

pub fn run(args: StatsArgs) -> Result<()> {
    let (mut model, parent) = read_model_file(&args.file)?;
    let before = InputStatsState::of(&model);
    if before == InputStatsState::Absent {
        return Err(anyhow::Error::new(Hint(
            "only models with a `Standardize` layer (every `canopy model new` architecture) have input statistics".into(),
        ))
        .context(format!(
            "model file `{}` has no input statistics (`input.mean`, `input.std`) to fit",
            args.file.display()
        )));
    }
    let (train, _) = load_for_model(&args.data.data, &model).map_err(|e| args.data.explain(e))?;
    let moments = InputMoments::of(&train);
    let stats = fit_model(&mut model, &moments).with_context(|| {
        format!(
            "cannot fit the input statistics of `{}` on `{}`",
            args.file.display(),
            args.data.data.display()
        )
    })?;
    let per_feature = moments.to_feature_stats()?;
    model.metadata.parent_digest = Some(parent);
    let output = args.output.as_ref().unwrap_or(&args.file);
    let digest = write_model_file(output, &model)?;
    let features = moments.features();
    let average =
        |values: &[f32]| values.iter().map(|&v| f64::from(v)).sum::<f64>() / features as f64;
    outln!(
        "fitted input statistics on {} training samples of {features} features: mean {:.4}, std {:.4} \
         (per feature: mean of means {:.4}, mean of stds {:.4}){}",
        moments.count,
        stats.mean,
        stats.std,
        average(&per_feature.mean),
        average(&per_feature.std),
        if before == InputStatsState::Fitted {
            "; replaced the fitted ones"
        } else {
            ""
        }
    )?;
    outln!(
        "wrote {} (digest {}, parent {})",
        output.display(),
        short_digest(&digest),
        short_digest(&parent)
    )?;
    Ok(())
}
