use std::path::PathBuf;

use anyhow::{Result, bail};
use canopy_engine::nn::Initializer;
use canopy_engine::optim::Optimizer;
use canopy_engine::recurrent::Cell;
use canopy_engine::stats::InputStatsState;
use canopy_engine::zoo::{Architecture, ModelConfig, build_model_with_init};
use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::{Args, ValueEnum};

use crate::files::{short_digest, write_model_file};
use crate::output::outln;

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Arch {
    Mlp,
    Lenet5,
    Logreg,
    /// Next-character prediction over a text dataset (embedding,
    /// recurrent layers, a linear map over the vocabulary).
    Charlm,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum CellArg {
    Gru,
    Lstm,
}

#[derive(Args)]
pub struct NewArgs {
    /// Architecture from the zoo.
    arch: Arch,
    /// Input features (mlp, logreg).
    #[arg(long, default_value_t = 784)]
    inputs: usize,
    /// Hidden units (mlp; charlm: per recurrent layer).
    #[arg(long, default_value_t = 128)]
    hidden: usize,
    /// Output classes (charlm: the vocabulary) [default: 10; charlm: 77,
    /// the Shakespeare dataset's characters and one for any other].
    #[arg(long)]
    classes: Option<usize>,
    /// Recurrent cell (charlm).
    #[arg(long, value_enum, default_value = "gru")]
    cell: CellArg,
    /// Recurrent layers (charlm).
    #[arg(long, default_value_t = 1)]
    layers: usize,
    /// Width of the character embedding (charlm).
    #[arg(long, default_value_t = 8)]
    embedding: usize,
    /// Characters the model reads before predicting the next (charlm).
    #[arg(long, default_value_t = 80)]
    sequence: usize,
    /// The FedAvg paper's Shakespeare model (charlm): two LSTM layers of
    /// 256 over an 8-wide embedding and 80 characters.
    #[arg(long, conflicts_with_all = ["cell", "layers", "hidden", "embedding", "sequence"])]
    fedavg: bool,
    /// Trace each recurrent layer step by step instead of as one loop
    /// (charlm): the same model, in a graph that grows with `--sequence`,
    /// for comparing sizes with `canopy model inspect`.
    #[arg(long)]
    unrolled: bool,
    /// Seed of the parameter initialiser.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Weight initialiser: `he` (He normal for layers a ReLU follows,
    /// Xavier for the others), `xavier` (Xavier uniform everywhere),
    /// `uniform` (U(±1/√fan_in), PyTorch's default) or `lecun` (LeCun
    /// normal, N(0, 1/fan_in), JAX/Flax's default).
    #[arg(long, default_value = Initializer::default().name(), value_parser = init_parser())]
    init: Initializer,
    /// Optimizer of the shipped `train_step`: sgd, adam, adamw, or a spec
    /// like `sgd:momentum=0.9,nesterov=true`.
    #[arg(long, default_value = "sgd")]
    optimizer: String,
    /// Freeze parameters whose name starts with this prefix (repeatable).
    #[arg(long)]
    freeze: Vec<String>,
    /// Output file.
    #[arg(short, long)]
    output: PathBuf,
}

/// Accepts exactly the engine's initialiser names, listed in `--help`.
fn init_parser() -> impl TypedValueParser<Value = Initializer> {
    PossibleValuesParser::new(Initializer::ALL.map(Initializer::name)).try_map(|name| {
        // Cannot fail: the possible values are the engine's own names.
        Initializer::parse(&name)
    })
}

/// Largest layer width accepted, so a typo cannot ask for terabytes.
const MAX_WIDTH: usize = 1 << 16;

/// Most recurrent layers accepted.
const MAX_LAYERS: usize = 16;
/// Longest sequence a charlm reads (the Shakespeare loader's own limit).
const MAX_SEQUENCE: usize = canopy_engine::data::MAX_SEQUENCE_LEN;

pub fn run(args: NewArgs) -> Result<()> {
    let classes = args.classes.unwrap_or(match args.arch {
        Arch::Charlm => canopy_engine::data::VOCABULARY_SIZE,
        _ => 10,
    });
    for (name, value, max) in [
        ("inputs", args.inputs, MAX_WIDTH),
        ("hidden", args.hidden, MAX_WIDTH),
        ("classes", classes, MAX_WIDTH),
        ("layers", args.layers, MAX_LAYERS),
        ("embedding", args.embedding, MAX_WIDTH),
        ("sequence", args.sequence, MAX_SEQUENCE),
    ] {
        if value == 0 || value > max {
            bail!("--{name} {value} is out of range (1..={max})");
        }
    }
    let architecture = match args.arch {
        Arch::Mlp => Architecture::Mlp {
            inputs: args.inputs,
            hidden: args.hidden,
            classes,
        },
        Arch::Lenet5 => Architecture::LeNet5 { classes },
        Arch::Logreg => Architecture::LogReg {
            inputs: args.inputs,
            classes,
        },
        Arch::Charlm if args.fedavg => Architecture::charlm_fedavg(classes),
        Arch::Charlm => Architecture::CharLm {
            vocabulary: classes,
            sequence: args.sequence,
            embedding: args.embedding,
            hidden: args.hidden,
            layers: args.layers,
            cell: match args.cell {
                CellArg::Gru => Cell::Gru,
                CellArg::Lstm => Cell::Lstm,
            },
            unrolled: false,
        },
    };
    let architecture = match architecture {
        Architecture::CharLm { .. } if args.unrolled => architecture.unrolled(),
        _ if args.unrolled => bail!("--unrolled applies to charlm only"),
        _ => architecture,
    };
    let config = ModelConfig {
        architecture,
        seed: args.seed,
        optimizer: Optimizer::parse(&args.optimizer)?,
        frozen_prefixes: args.freeze,
        producer: format!("canopy {}", env!("CARGO_PKG_VERSION")),
    };
    let model = build_model_with_init(&config, args.init)?;
    let digest = write_model_file(&args.output, &model)?;
    outln!(
        "wrote {} ({} parameters, {} trainable, digest {})",
        args.output.display(),
        model
            .parameters
            .iter()
            .map(|p| p.data.num_elements())
            .sum::<usize>(),
        model.trainable_elements(),
        short_digest(&digest)
    )?;
    if InputStatsState::of(&model) == InputStatsState::Unfitted {
        outln!(
            "input statistics (input.mean, input.std) are unfitted (mean 0, std 1): the first \
             federated job fits them in a statistics round, or fit them with `canopy model train` \
             or `canopy model stats {} --data DIR`",
            args.output.display()
        )?;
    }
    Ok(())
}
