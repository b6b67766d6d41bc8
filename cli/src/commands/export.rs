//! `canopy model export FILE [--entry infer] -o model.onnx`: one entry
//! point of a model file as an ONNX model (default domain, opset 17) with
//! the model's current parameters as initializers, so a federated model
//! can be served by any ONNX runtime. One ONNX file holds one graph:
//! `--entry eval` writes the evaluation graph (loss and correct count
//! from `x` and labels `y`) instead.

use std::path::PathBuf;

use anyhow::{Context, Result};
use canopy_ir::model::ENTRY_INFER;
use canopy_onnx::{EXPORT_OPSET, ExportOptions, encode, export_model};
use clap::Args;

use super::import::onnx_error;
use crate::files::{OUTPUT_FILE_MODE, read_model_file, short_digest, write_atomic};
use crate::output::outln;

const EXPORT_HINT: &str = "`canopy model export` writes inference graphs (`infer`, `eval`); ARCHITECTURE.md (onnx/) lists what it lowers";

#[derive(Args)]
pub struct ExportArgs {
    /// The model file.
    file: PathBuf,
    /// The entry point to write: `infer` (logits from `x`), or `eval`
    /// (loss and correct count from `x` and labels `y`).
    #[arg(long, default_value = ENTRY_INFER)]
    entry: String,
    /// Where to write the ONNX model.
    #[arg(short, long)]
    out: PathBuf,
}

pub fn run(args: ExportArgs) -> Result<()> {
    let (model, digest) = read_model_file(&args.file)?;
    let shown = args.file.display();
    let options = ExportOptions {
        graph_name: format!("{}.{}", model.metadata.model_name, args.entry),
        doc_string: format!(
            "`{}` entry point of canopy model `{}` (sha256:{})",
            args.entry,
            model.metadata.model_name,
            short_digest(&digest)
        ),
        ..ExportOptions::default()
    };
    let proto = export_model(&model, &args.entry, &options)
        .map_err(|error| onnx_error(&error, format!("cannot export `{shown}`"), EXPORT_HINT))?;
    let bytes = encode(&proto);
    write_atomic(&args.out, &bytes, OUTPUT_FILE_MODE)
        .with_context(|| format!("cannot write ONNX file `{}`", args.out.display()))?;
    let graph = proto.graph.unwrap_or_default();
    let elements: i64 = graph
        .initializer
        .iter()
        .map(|t| t.dims.iter().product::<i64>())
        .sum();
    outln!(
        "exported `{shown}`: {} ({} ONNX nodes, {} initializers, {elements} elements), opset {EXPORT_OPSET} -> {} ({} bytes)",
        args.entry,
        graph.node.len(),
        graph.initializer.len(),
        args.out.display(),
        bytes.len()
    )?;
    Ok(())
}
