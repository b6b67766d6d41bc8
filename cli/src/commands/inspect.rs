use std::path::PathBuf;

use anyhow::Result;
use canopy_engine::cpu::{FusionReport, fusion_report};
use canopy_ir::Graph;
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
    /// List every group of nodes the CPU backend fuses into one kernel,
    /// with its nodes, instead of a count of each kind.
    #[arg(long)]
    fused: bool,
}

pub fn run(args: InspectArgs) -> Result<()> {
    let (model, digest) = read_model_file(&args.file)?;
    if args.json {
        outln!("{}", to_json(&model, &digest)?)?;
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
        print_fusion(graph, args.fused)?;
    }
    Ok(())
}

/// How the CPU backend runs `graph`: its node count before and after
/// fusion, and its fused kernels (each listed with `all`, else counted by
/// kind).
fn print_fusion(graph: &Graph, all: bool) -> Result<()> {
    let report = fusion_report(graph)?;
    outln!(
        "    fused:   {} nodes -> {} on the CPU (loop bodies included), {} fused kernels at the top level",
        report.nodes,
        report.after_fusion,
        report.groups.len()
    )?;
    if all {
        for group in &report.groups {
            let members: Vec<String> = group
                .members
                .iter()
                .map(|&m| format!("%{m} {}", graph.nodes()[m].op.name()))
                .collect();
            let reads: Vec<String> = group.inputs.iter().map(|v| format!("%{v}")).collect();
            outln!(
                "      %{} = fused[{}] reads {}",
                group.root(),
                members.join(", "),
                reads.join(" ")
            )?;
        }
    } else if !report.groups.is_empty() {
        let kinds: Vec<String> = kernel_kinds(graph, &report)
            .into_iter()
            .map(|(kind, n)| format!("{kind}×{n}"))
            .collect();
        outln!("             {}", kinds.join(" "))?;
    }
    Ok(())
}

/// Each fused kernel's ops joined by `+`, counted, in order of first use.
fn kernel_kinds(graph: &Graph, report: &FusionReport) -> Vec<(String, usize)> {
    let mut kinds: Vec<(String, usize)> = Vec::new();
    for group in &report.groups {
        let kind: Vec<&str> = group
            .members
            .iter()
            .map(|&m| graph.nodes()[m].op.name())
            .collect();
        let kind = kind.join("+");
        match kinds.iter_mut().find(|(k, _)| *k == kind) {
            Some((_, n)) => *n += 1,
            None => kinds.push((kind, 1)),
        }
    }
    kinds
}

fn to_json(model: &canopy_ir::Model, digest: &[u8; 32]) -> Result<serde_json::Value> {
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
    let mut entries = serde_json::Map::new();
    for (name, g) in &model.entry_points {
        let report = fusion_report(g)?;
        let kernels: serde_json::Map<String, serde_json::Value> = kernel_kinds(g, &report)
            .into_iter()
            .map(|(kind, n)| (kind, n.into()))
            .collect();
        entries.insert(
            name.clone(),
            serde_json::json!({
                "nodes": g.len(),
                "ops": g.op_counts(),
                "cpu_fusion": {
                    "nodes": report.nodes,
                    "after_fusion": report.after_fusion,
                    "fused_kernels": kernels,
                },
            }),
        );
    }
    Ok(serde_json::json!({
        "model": model.metadata.model_name,
        "digest": digest_hex(digest),
        "parameters": params,
        "entry_points": entries,
    }))
}
