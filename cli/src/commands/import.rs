//! `canopy model import FILE.onnx -o model.canopy`: an ONNX model as a
//! Canopy model file. The ONNX graph becomes the `infer` entry point; the
//! float initializers it reads become trainable parameters (`params/NAME`).
//! A classifier (an output shaped `[batch, classes]`) whose graph is
//! differentiable also gets `eval`, `train_loss` and `train_step` (softmax
//! cross-entropy on its logits, the optimizer and frozen set from flags),
//! so it trains, evaluates and is fine-tuned federatedly like a zoo model.
//! Decoding is bounded by `canopy_onnx::Limits`: the file is untrusted input.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{Context, Result, anyhow};
use canopy_engine::optim::Optimizer;
use canopy_engine::zoo::{ENTRY_TRAIN_LOSS, add_classifier_training, set_frozen};
use canopy_ir::model::{ENTRY_EVAL, ENTRY_TRAIN_STEP};
use canopy_ir::{Metadata, Model, Parameter};
use canopy_onnx::{ImportOptions, Limits, OnnxError, decode_model, import_model_with};
use clap::Args;

use crate::files::{Hint, read_bounded, short_digest, write_model_file};
use crate::output::outln;

const SUPPORTED_HINT: &str = "`canopy model import` reads default-domain ONNX, opsets 13 to 21, and the `ai.onnx.ml` ops of scikit-learn models, ml opsets 1 to 5; ARCHITECTURE.md (onnx/) lists the ops it supports";

/// The entry point an imported graph becomes.
const ENTRY_POINT: &str = "infer";

#[derive(Args)]
pub struct ImportArgs {
    /// The ONNX model file.
    file: PathBuf,
    /// Where to write the Canopy model file.
    #[arg(short, long)]
    out: PathBuf,
    /// The model's name in its metadata [default: the ONNX file's stem].
    #[arg(long)]
    name: Option<String>,
    /// Optimizer of the written `train_step`: sgd, adam, adamw, or a spec
    /// like `sgd:momentum=0.9,nesterov=true` [default: sgd].
    #[arg(long)]
    optimizer: Option<String>,
    /// Freeze parameters whose name starts with this prefix (repeatable):
    /// fine-tuning then trains and uploads only the others.
    #[arg(long)]
    freeze: Vec<String>,
    /// Write only `infer`: no training entry points.
    #[arg(long, conflicts_with_all = ["optimizer", "freeze"])]
    inference_only: bool,
}

/// What the import wrote besides `infer`.
enum Training {
    Written { optimizer: Optimizer },
    Skipped { reason: String },
    NotRequested,
}

/// Adds the training entry points when asked. A graph that cannot train
/// (no class scores, an op without a gradient) still imports for
/// inference, with the reason, unless the user asked for training
/// explicitly with `--optimizer` or `--freeze`.
fn add_training(model: &mut Model, args: &ImportArgs) -> Result<Training> {
    if args.inference_only {
        return Ok(Training::NotRequested);
    }
    let explicit = args.optimizer.is_some() || !args.freeze.is_empty();
    let optimizer = Optimizer::parse(args.optimizer.as_deref().unwrap_or("sgd"))?;
    set_frozen(model, &args.freeze)?;
    match add_classifier_training(model, &optimizer) {
        Ok(()) => Ok(Training::Written { optimizer }),
        Err(error) if !explicit => Ok(Training::Skipped {
            reason: error.to_string(),
        }),
        Err(error) => Err(Hint::attach(
            anyhow::Error::new(error).context("cannot write the training entry points"),
            "pass --inference-only to import the graph for inference alone",
        )),
    }
}

/// `error` under `context`, its own hint (an `OnnxError` message may end
/// in `; hint: …`) moved to the `hint:` line, else `fallback_hint`. The
/// one rendering of ONNX errors, for import and export.
pub fn onnx_error(error: &OnnxError, context: String, fallback_hint: &str) -> anyhow::Error {
    let mut messages = vec![context];
    messages.extend(
        std::iter::successors(Some(error as &dyn std::error::Error), |e| e.source())
            .map(ToString::to_string),
    );
    let (first, hint) = match messages[1].split_once("; hint: ") {
        Some((message, hint)) => (message.to_string(), hint.to_string()),
        None => (messages[1].clone(), fallback_hint.to_string()),
    };
    messages[1] = first;
    Hint::chain(messages, hint)
}

pub fn run(args: ImportArgs) -> Result<()> {
    let limits = Limits::default();
    let shown = args.file.display();
    let bytes = read_bounded(&args.file, limits.max_model_bytes as u64)
        .with_context(|| format!("cannot read ONNX file `{shown}`"))?;
    let options = ImportOptions { parameters: true };
    let imported = decode_model(&bytes, &limits)
        .and_then(|proto| Ok((import_model_with(&proto, &limits, options)?, proto)))
        .map_err(|error| onnx_error(&error, format!("cannot import `{shown}`"), SUPPORTED_HINT))?;
    let (imported, proto) = imported;
    let initializers: BTreeMap<&str, _> = imported
        .initializers
        .iter()
        .map(|(name, data)| (name.as_str(), data))
        .collect();
    let parameters = imported
        .parameters
        .iter()
        .map(|name| {
            let data = initializers
                .get(name.as_str())
                .copied()
                .cloned()
                .ok_or_else(|| anyhow!("parameter `{name}` has no initializer"))?;
            Ok(Parameter {
                name: name.clone(),
                data,
                trainable: true,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let name = args.name.clone().unwrap_or_else(|| {
        args.file.file_stem().map_or_else(
            || "imported".to_string(),
            |s| s.to_string_lossy().into_owned(),
        )
    });
    let mut properties = BTreeMap::new();
    properties.insert("imported_from".to_string(), "onnx".to_string());
    if !proto.producer_name.is_empty() {
        let producer = format!("{} {}", proto.producer_name, proto.producer_version);
        properties.insert("onnx_producer".to_string(), producer.trim().to_string());
    }
    let mut model = Model {
        metadata: Metadata {
            model_name: name,
            parent_digest: None,
            producer: format!("canopy {}", env!("CARGO_PKG_VERSION")),
            properties,
        },
        parameters,
        entry_points: BTreeMap::from([(ENTRY_POINT.to_string(), imported.graph)]),
    };
    let training = add_training(&mut model, &args)?;
    let digest = write_model_file(&args.out, &model)?;
    let elements: usize = model.parameters.iter().map(|p| p.data.num_elements()).sum();
    let entries = match &training {
        Training::Written { optimizer } => format!(
            ", {ENTRY_EVAL}, {ENTRY_TRAIN_LOSS}, {ENTRY_TRAIN_STEP} ({optimizer}, {} elements trainable)",
            model.trainable_elements()
        ),
        Training::Skipped { .. } | Training::NotRequested => String::new(),
    };
    outln!(
        "imported `{shown}`: {ENTRY_POINT} ({} nodes){entries}, {} parameters ({elements} elements) -> {} (sha256:{})",
        model.entry_points[ENTRY_POINT].len(),
        model.parameters.len(),
        args.out.display(),
        short_digest(&digest)
    )?;
    if let Training::Skipped { reason } = training {
        outln!(
            "no training entry points: {reason}; the model runs for inference (`canopy model run`)"
        )?;
    }
    Ok(())
}
