use std::path::PathBuf;

use anyhow::{Result, bail};
use canopy_engine::select::{BackendChoice, open_backend};
use clap::Args;

use super::load_for_model;
use super::train::evaluate;
use crate::DataArgs;
use crate::files::read_model_file;
use crate::output::outln;

#[derive(Args)]
pub struct EvalArgs {
    file: PathBuf,
    #[command(flatten)]
    data: DataArgs,
    #[arg(long, default_value_t = 256)]
    batch: usize,
    /// Print one JSON object, `loss`, `accuracy` and `samples`, and nothing
    /// else on stdout.
    #[arg(long)]
    json: bool,
    /// cpu, gpu (any Vulkan, Metal or DX12 adapter) or auto (a hardware
    /// GPU when there is one, else the CPU).
    #[arg(long, default_value_t = BackendChoice::Auto)]
    backend: BackendChoice,
}

pub fn run(args: EvalArgs) -> Result<()> {
    if args.batch == 0 || args.batch > 1 << 16 {
        bail!("--batch {} is out of range (1..=65536)", args.batch);
    }
    let (model, _) = read_model_file(&args.file)?;
    let (_, test) = load_for_model(&args.data.data, &model).map_err(|e| args.data.explain(e))?;
    let backend = open_backend(args.backend)?;
    let stats = evaluate(&model, &test, args.batch, backend.as_ref())?;
    if args.json {
        outln!(
            "{}",
            serde_json::json!({"loss": stats.loss, "accuracy": stats.accuracy, "samples": stats.samples})
        )?;
    } else {
        outln!(
            "{}: test loss {:.4}, accuracy {:.4} over {} samples",
            args.file.display(),
            stats.loss,
            stats.accuracy,
            stats.samples
        )?;
    }
    Ok(())
}
