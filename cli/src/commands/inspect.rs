use std::path::PathBuf;

use anyhow::Result;
use canopy_ir::format::digest_hex;
use canopy_ir::model::{PARAM_PREFIX, STATE_PREFIX};
use clap::Args;

use crate::files::read_model_file;
use crate::output::outln;

#[derive(Args)]
pub struct InspectArgs {
    file: PathBuf,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

pub fn run(args: InspectArgs) -> Result<()> {
    let (model, digest) = read_model_file(&args.file)?;
    if args.json {
        outln!("{}", to_json(&model, &digest))?;
        return Ok(());
    }
    let meta = &model.metadata;
    outln!("model:     {}", meta.model_name)?;
    outln!("digest:    sha256:{}", digest_hex(&digest))?;
    outln!("producer:  {}", meta.producer)?;
    if let Some(parent) = &meta.parent_digest {
        outln!("parent:    sha256:{}", digest_hex(parent))?;
    }
    for (key, value) in &meta.properties {
        outln!("{key:<10} {value}")?;
    }
    outln!("\nparameters:")?;
    for p in &model.parameters {
        let kind = if p.trainable { "trainable" } else { "frozen" };
        outln!(
            "  {:<20} {:<5} {:<16} {kind}",
            p.name,
            p.data.dtype().name(),
            format!("{:?}", p.data.shape)
        )?;
    }
    outln!(
        "  total {} elements, {} trainable",
        model
            .parameters
            .iter()
            .map(|p| p.data.num_elements())
            .sum::<usize>(),
        model.trainable_elements()
    )?;
    outln!("\nentry points:")?;
    for (name, graph) in &model.entry_points {
        let inputs: Vec<String> = graph
            .inputs()
            .iter()
            .filter(|&&i| !graph.input_name(i).starts_with(PARAM_PREFIX))
            .map(|&i| format!("{}: {}", graph.input_name(i), graph.ty(i)))
            .collect();
        let outputs: Vec<String> = graph
            .outputs()
            .iter()
            .filter(|(n, _)| !n.starts_with(PARAM_PREFIX) && !n.starts_with(STATE_PREFIX))
            .map(|(n, v)| format!("{n}: {}", graph.ty(*v)))
            .collect();
        outln!("  {name} ({} nodes)", graph.len())?;
        outln!("    inputs:  {PARAM_PREFIX}*, {}", inputs.join(", "))?;
        outln!("    outputs: {}", outputs.join(", "))?;
        let counts: Vec<String> = graph
            .op_counts()
            .into_iter()
            .filter(|(op, _)| *op != "input")
            .map(|(op, n)| format!("{op}×{n}"))
            .collect();
        outln!("    ops:     {}", counts.join(" "))?;
    }
    Ok(())
}

fn to_json(model: &canopy_ir::Model, digest: &[u8; 32]) -> serde_json::Value {
    let params: Vec<_> = model
        .parameters
        .iter()
        .map(|p| {
            serde_json::json!({
                "name": p.name, "dtype": p.data.dtype().name(),
                "shape": p.data.shape, "trainable": p.trainable,
            })
        })
        .collect();
    let entries: serde_json::Map<String, serde_json::Value> = model
        .entry_points
        .iter()
        .map(|(name, g)| {
            (
                name.clone(),
                serde_json::json!({"nodes": g.len(), "ops": g.op_counts()}),
            )
        })
        .collect();
    serde_json::json!({
        "model": model.metadata.model_name,
        "digest": digest_hex(digest),
        "parameters": params,
        "entry_points": entries,
    })
}
