//! `canopy`: create, inspect, train, evaluate and benchmark Canopy models.
//!
//! Errors print as `error:` / `Caused by:` / `hint:` and exit non-zero;
//! nothing a user types or a file contains makes this binary panic, and
//! a closed stdout stops a command quietly with 141 (see the `canopy-term` crate).

mod commands;
mod files;
use canopy_term as output;
mod progress;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

use crate::output::errln;

#[derive(Parser)]
#[command(
    name = "canopy",
    version,
    about = "Canopy's model tool: build, train and ship IR model files"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Work with model files.
    #[command(subcommand)]
    Model(ModelCommand),
}

#[derive(Subcommand)]
enum ModelCommand {
    /// Write a new model file with `infer`, `train_step` and `eval` entry points.
    New(commands::new::NewArgs),
    /// Print entry points, parameters, op counts and the digest.
    Inspect(commands::inspect::InspectArgs),
    /// Train a model on a dataset folder and write the result.
    Train(commands::train::TrainArgs),
    /// Evaluate a model on a dataset folder's test split.
    Eval(commands::eval::EvalArgs),
    /// Measure training throughput, backward/forward ratio and matmul speed.
    Bench(commands::bench::BenchArgs),
}

/// Options shared by commands that read datasets.
#[derive(Args, Clone, Debug)]
pub struct DataArgs {
    /// A folder with `train-*`/`test-*` IDX files, or CSV files.
    #[arg(long)]
    pub data: PathBuf,
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(error) => return output::clap_exit(&error),
    };
    progress::init_logging();
    let result = match cli.command {
        Command::Model(ModelCommand::New(args)) => commands::new::run(args),
        Command::Model(ModelCommand::Inspect(args)) => commands::inspect::run(args),
        Command::Model(ModelCommand::Train(args)) => commands::train::run(args),
        Command::Model(ModelCommand::Eval(args)) => commands::eval::run(args),
        Command::Model(ModelCommand::Bench(args)) => commands::bench::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) if output::is_stdout_closed(&*error) => {
            ExitCode::from(output::STDOUT_CLOSED_EXIT)
        }
        Err(error) => {
            report(&error);
            ExitCode::FAILURE
        }
    }
}

/// Prints an error chain in the house style; a `Hint` anywhere in the
/// chain is printed last.
fn report(error: &anyhow::Error) {
    errln!("error: {error}");
    let mut hint = None;
    for cause in error.chain().skip(1) {
        match cause.downcast_ref::<files::Hint>() {
            Some(h) => hint = Some(h.0.clone()),
            None => errln!("  Caused by: {cause}"),
        }
    }
    if let Some(h) = error
        .downcast_ref::<files::Hint>()
        .map(|h| h.0.clone())
        .or(hint)
    {
        errln!("  hint: {h}");
    }
}
