use std::path::PathBuf;

use anyhow::{Result, bail};
use canopy_engine::nn::Initializer;
use canopy_engine::optim::Optimizer;
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
}

#[derive(Args)]
pub struct NewArgs {
    /// Architecture from the zoo.
    arch: Arch,
    /// Input features (mlp, logreg).
    #[arg(long, default_value_t = 784)]
    inputs: usize,
    /// Hidden units (mlp).
    #[arg(long, default_value_t = 128)]
    hidden: usize,
    /// Output classes.
    #[arg(long, default_value_t = 10)]
    classes: usize,
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

pub fn run(args: NewArgs) -> Result<()> {
    for (name, value) in [
        ("inputs", args.inputs),
        ("hidden", args.hidden),
        ("classes", args.classes),
    ] {
        if value == 0 || value > MAX_WIDTH {
            bail!("--{name} {value} is out of range (1..={MAX_WIDTH})");
        }
    }
    let architecture = match args.arch {
        Arch::Mlp => Architecture::Mlp {
            inputs: args.inputs,
            hidden: args.hidden,
            classes: args.classes,
        },
        Arch::Lenet5 => Architecture::LeNet5 {
            classes: args.classes,
        },
        Arch::Logreg => Architecture::LogReg {
            inputs: args.inputs,
            classes: args.classes,
        },
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
