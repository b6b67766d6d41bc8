//! `canopy-agent`: the daemon operators install on edge machines. It
//! enrolls the machine with a Canopy server (an Ed25519 device key kept in
//! its data directory), registers local datasets, and runs federated
//! rounds: it heartbeats, long-polls for tasks, trains the shipped
//! `train_step` on local data with `canopy-sdk`, uploads the update and
//! reports held-out metrics. `install` writes a systemd unit; `status`,
//! `train --local` and `eval` help an operator check a machine.
//!
//! Everything lives in one data directory (`--data-dir`, default
//! `./canopy-agent`): `device.key` (mode 0600), `agent.toml` (the
//! enrollment), `config.toml` (`run` settings), `datasets.toml` and
//! `status.json`.
//!
//! Errors print as `error:` / `Caused by:` / `hint:` and exit 1; a
//! closed stdout stops a command quietly with 141 (see the `canopy-term` crate). Logs are
//! structured `tracing` events on stderr, never on stdout: `CANOPY_LOG`
//! (else `RUST_LOG`) filters them, `CANOPY_LOG_FORMAT=json|text` picks the
//! format. The daemon (`run`) logs JSON when stderr is not a terminal (a
//! journal, a log file); every other command logs text, so its messages
//! read like its output. Colour only on a terminal, never with `NO_COLOR`.

mod backend;
mod commands;
mod config;
mod daemon;
mod datasets;
mod files;
use canopy_term as output;
mod ownership;
mod status;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

use crate::files::DataDir;

#[derive(Parser)]
#[command(
    name = "canopy-agent",
    version,
    about = "Canopy's edge agent: enroll this machine, register local data, and train federated rounds",
    after_help = "Files in the data directory: device.key (the device's private key, mode 0600), \
                  agent.toml (the enrollment), config.toml (run settings), datasets.toml, status.json."
)]
struct Cli {
    /// The agent's data directory.
    #[arg(
        long,
        global = true,
        env = "CANOPY_AGENT_DIR",
        default_value = "./canopy-agent"
    )]
    data_dir: PathBuf,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create the data directory, a settings file and a systemd unit
    /// (PREFIX/lib/systemd/system/canopy-agent.service), and print the
    /// next steps.
    Install(commands::install::InstallArgs),
    /// Generate this device's key and enroll it with a server using a
    /// one-time token. Nothing is written unless the server accepts.
    Enroll(commands::enroll::EnrollArgs),
    /// Install the device authority's certificate of this device's key, so
    /// that neighbours that pin the authority accept it in secure rounds.
    Certify(commands::certify::CertifyArgs),
    /// Register and list local datasets.
    #[command(subcommand)]
    Data(commands::data::DataCommand),
    /// Run the daemon: heartbeat, poll for tasks, train, upload. Stops on
    /// SIGTERM/SIGINT, letting a running task finish within 20 s.
    Run(daemon::RunArgs),
    /// Show the enrollment, whether the server answers, and the daemon's
    /// last task. Exits 0 whenever it could look ("not enrolled" is an
    /// answer; with --json, check `enrolled`).
    Status(StatusArgs),
    /// Train a model file on a registered dataset, offline, and print the
    /// held-out accuracy before and after.
    Train(commands::local::TrainArgs),
    /// Evaluate a model file on the held-out 10% of a dataset.
    Eval(commands::local::EvalArgs),
    /// Run this machine as an edge aggregator (enrolled with `--role
    /// aggregator`): serve end devices with the server's device API and
    /// run the cloud's rounds over them as sub-rounds. Takes
    /// `canopy-server serve`'s flags, but listens on 127.0.0.1:9443 unless
    /// `--listen` says otherwise; stops on SIGTERM/SIGINT.
    Aggregate(commands::aggregate::AggregateArgs),
}

#[derive(Args)]
struct StatusArgs {
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

fn main() -> ExitCode {
    // First, while this is the only thread (see the function's docs).
    canopy_engine::gpu::quiet_device_select_layer();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(error) => return output::clap_exit(&error),
    };
    init_logging(matches!(
        cli.command,
        Command::Run(_) | Command::Aggregate(_)
    ));
    let dir = DataDir::new(cli.data_dir);
    let result = match cli.command {
        Command::Install(args) => commands::install::run(&dir, args),
        Command::Enroll(args) => commands::enroll::run(&dir, args),
        Command::Certify(args) => commands::certify::run(&dir, args),
        Command::Data(command) => commands::data::run(&dir, command),
        Command::Run(args) => daemon::run(&dir, args),
        Command::Status(args) => status::run(&dir, args.json),
        Command::Train(args) => commands::local::train(&dir, args),
        Command::Eval(args) => commands::local::eval(&dir, args),
        Command::Aggregate(args) => commands::aggregate::run(&dir, args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) if output::is_stdout_closed(&*error) => {
            ExitCode::from(output::STDOUT_CLOSED_EXIT)
        }
        Err(error) => {
            output::report::report(&error);
            ExitCode::FAILURE
        }
    }
}

/// `daemon`: the command is `run`, whose logs go to a journal or a file
/// when stderr is not a terminal; a one-shot command's go to the person
/// who ran it, beside its output.
fn init_logging(daemon: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("CANOPY_LOG")
        .or_else(|_| tracing_subscriber::EnvFilter::try_from_env("RUST_LOG"))
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let json = match std::env::var("CANOPY_LOG_FORMAT").as_deref() {
        Ok("json") => true,
        Ok("text") => false,
        _ => daemon && !std::io::stderr().is_terminal(),
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(canopy_term::stderr_color())
        // When stderr is gone (a closed pipe, a journal that went away) the
        // subscriber would otherwise report the failed write with
        // `eprintln!`, which panics: the daemon must outlive its logs.
        .log_internal_errors(false)
        .with_target(false);
    let _ = if json {
        builder.json().flatten_event(true).try_init()
    } else {
        builder.try_init()
    };
}
