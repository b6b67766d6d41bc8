//! `canopy`: create, inspect, train, evaluate and benchmark Canopy models,
//! and drive a server through its admin API (`login`, `model push`, `job`,
//! `device`, `dataset`).
//!
//! Errors print as `error:` / `Caused by:` / `hint:` and exit non-zero;
//! nothing a user types or a file contains makes this binary panic, and
//! a closed stdout stops a command quietly with 141 (see the `canopy-term` crate).

mod commands;
mod files;
use canopy_term as output;
mod progress;
mod remote;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

/// Training allocates and frees the same large arrays every step (a
/// recurrent layer's stacked residuals are megabytes). glibc's malloc
/// returns such blocks to the kernel and faults them in again on the next
/// step, which cost a GRU 256 training step about 15 % (docs/speed.md);
/// mimalloc keeps them for reuse.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "canopy",
    version,
    about = "Canopy's tool: build, train and ship model files, and run federated jobs on a server"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Log in to a server: check the token and save the login (mode 0600).
    Login(commands::login::LoginArgs),
    /// Forget the saved login.
    Logout,
    /// Work with model files, and models on the server.
    #[command(subcommand)]
    Model(ModelCommand),
    /// Create, run and watch federated jobs on the server.
    #[command(subcommand)]
    Job(JobCommand),
    /// The devices enrolled with the server.
    #[command(subcommand)]
    Device(DeviceCommand),
    /// Datasets kept on the server, for central evaluation.
    #[command(subcommand)]
    Dataset(DatasetCommand),
    /// A device authority: certifies devices' keys for secure rounds. Run
    /// it where the server cannot read its key.
    #[command(subcommand)]
    Authority(AuthorityCommand),
    /// Plan a differentially private job: the ε a number of rounds spends,
    /// or the noise that keeps them within a target ε.
    #[command(subcommand)]
    Privacy(PrivacyCommand),
    /// Run a federated job over many virtual devices, each enrolled with
    /// its own key and data shard, against a server in this process or
    /// the one you logged in to.
    Simulate(Box<commands::simulate::SimulateArgs>),
    /// One central evaluation of a simulation's in-process server, in a
    /// process of its own; the server starts it.
    #[command(hide = true, name = canopy_sim::cloud::CENTRAL_WORKER)]
    CentralWorker(canopy_sim::cloud::CentralWorkerArgs),
}

#[derive(Subcommand)]
enum PrivacyCommand {
    /// The (ε, δ) that --steps rounds of the subsampled Gaussian mechanism
    /// spend at --sampling-rate and --noise-multiplier.
    Epsilon(commands::privacy::EpsilonArgs),
    /// The least noise multiplier that keeps --steps rounds at
    /// --sampling-rate within --epsilon at --delta.
    Noise(commands::privacy::NoiseArgs),
}

#[derive(Subcommand)]
enum AuthorityCommand {
    /// Make an authority key; prints its public key (for the server's
    /// --device-authority and the apps that pin it).
    New(commands::authority::NewArgs),
    /// Print the certificate of a device's id and enrolled key, which the
    /// device installs (`DeviceClient::install_certificate`).
    Certify(commands::authority::CertifyArgs),
}

#[derive(Subcommand)]
enum JobCommand {
    /// Create a job from flags or a spec file (TOML or JSON).
    Create(Box<commands::jobs::CreateArgs>),
    /// List jobs.
    Ls(commands::jobs::ListArgs),
    /// Show a job's settings and status.
    Show(commands::jobs::JobIdArgs),
    /// Start a created job.
    Start(commands::jobs::JobIdArgs),
    /// Pause a running job.
    Pause(commands::jobs::JobIdArgs),
    /// Resume a paused job.
    Resume(commands::jobs::JobIdArgs),
    /// Cancel a job.
    Cancel(commands::jobs::JobIdArgs),
    /// Print each round as it finishes until the job ends; exits 0 when it
    /// completes, 1 when it fails or is cancelled, 130 on Ctrl-C.
    Watch(commands::watch::WatchArgs),
}

#[derive(Subcommand)]
enum DeviceCommand {
    /// List devices: online, last seen, datasets, last error, tags.
    Ls(commands::devices::ListArgs),
    /// Issue a token devices enroll with (`canopy-agent enroll --token`);
    /// prints only its secret.
    EnrollToken(commands::devices::EnrollTokenArgs),
}

#[derive(Subcommand)]
enum DatasetCommand {
    /// Upload a dataset file (CSV, CSV.gz, IDX or NPY; --labels for images).
    Push(commands::datasets::PushArgs),
    /// List the server's datasets.
    Ls(commands::datasets::ListArgs),
    /// Delete a dataset from the server.
    Rm(commands::datasets::RemoveArgs),
}

#[derive(Subcommand)]
enum ModelCommand {
    /// Write a new model file with `infer`, `train_step` and `eval` entry points.
    New(commands::new::NewArgs),
    /// Print entry points, parameters, op counts and the digest.
    Inspect(commands::inspect::InspectArgs),
    /// Import an ONNX model as a model file: `infer`, and training entry points for a classifier.
    Import(commands::import::ImportArgs),
    /// Export an entry point (default `infer`) as an ONNX model, opset 17.
    Export(commands::export::ExportArgs),
    /// Run an entry point on .npy inputs and write its outputs to an .npz.
    Run(commands::run::RunArgs),
    /// Train a model on a dataset folder and write the result.
    Train(commands::train::TrainArgs),
    /// Evaluate a model on a dataset folder's test split.
    Eval(commands::eval::EvalArgs),
    /// Fit a model's input statistics on a dataset folder's training split.
    Stats(commands::stats::StatsArgs),
    /// Measure training throughput, backward/forward ratio and matmul speed.
    Bench(commands::bench::BenchArgs),
    /// Upload a model file as a new version of a model on the server.
    Push(commands::models::PushArgs),
    /// List the server's models.
    Ls(commands::models::ListArgs),
    /// List a model's versions on the server.
    Versions(commands::models::VersionsArgs),
}

/// Options shared by commands that read datasets.
#[derive(Args, Clone, Debug)]
pub struct DataArgs {
    /// A folder with `train-*`/`test-*` IDX files, or CSV files.
    #[arg(long)]
    pub data: PathBuf,
}

impl DataArgs {
    /// `error`, from loading `--data`, with a hint when `--data` names a
    /// file instead of the folder that holds it (the engine's error names
    /// the mix-up; this says which folder to give).
    pub fn explain(&self, error: anyhow::Error) -> anyhow::Error {
        if !self.data.is_file() {
            return error;
        }
        let folder = self
            .data
            .parent()
            .filter(|parent| !parent.as_os_str().is_empty())
            .unwrap_or(std::path::Path::new("."));
        output::report::Hint::attach(
            error,
            format!(
                "--data takes a folder: give `--data {}` if the dataset's files are alone there, \
                 or move them into a folder of their own",
                folder.display()
            ),
        )
    }
}

fn main() -> ExitCode {
    // First, while this is the only thread (see the function's docs).
    canopy_engine::gpu::quiet_device_select_layer();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(error) => return output::clap_exit(&error),
    };
    // The worker needs no runtime and no log: its threads would count
    // against its address-space limit.
    let cli = match cli.command {
        Command::CentralWorker(args) => return canopy_sim::cloud::central_worker(args),
        command => Cli { command },
    };
    // A simulation runs a server in this process, whose logs of each
    // request (and each device's declined task, which the simulation
    // counts) would bury the round table; CANOPY_LOG still turns them on.
    let simulating = matches!(cli.command, Command::Simulate(_));
    progress::init_logging(if simulating {
        "warn,canopy_server::api::device=error"
    } else {
        "info"
    });
    let result: anyhow::Result<ExitCode> = match cli.command {
        Command::Job(JobCommand::Watch(args)) => commands::watch::run(args),
        Command::Simulate(args) => commands::simulate::run(*args),
        command => run(command).map(|()| ExitCode::SUCCESS),
    };
    match result {
        Ok(code) => code,
        Err(error) if output::is_stdout_closed(&*error) => {
            ExitCode::from(output::STDOUT_CLOSED_EXIT)
        }
        Err(error) => {
            output::report::report(&error);
            ExitCode::FAILURE
        }
    }
}

fn run(command: Command) -> anyhow::Result<()> {
    use commands::jobs::JobAction;
    match command {
        Command::Login(args) => commands::login::run(args),
        Command::Logout => commands::login::logout(),
        Command::Model(ModelCommand::New(args)) => commands::new::run(args),
        Command::Model(ModelCommand::Inspect(args)) => commands::inspect::run(args),
        Command::Model(ModelCommand::Import(args)) => commands::import::run(args),
        Command::Model(ModelCommand::Export(args)) => commands::export::run(args),
        Command::Model(ModelCommand::Run(args)) => commands::run::run(args),
        Command::Model(ModelCommand::Train(args)) => commands::train::run(args),
        Command::Model(ModelCommand::Eval(args)) => commands::eval::run(args),
        Command::Model(ModelCommand::Stats(args)) => commands::stats::run(args),
        Command::Model(ModelCommand::Bench(args)) => commands::bench::run(args),
        Command::Model(ModelCommand::Push(args)) => commands::models::push(args),
        Command::Model(ModelCommand::Ls(args)) => commands::models::list(args),
        Command::Model(ModelCommand::Versions(args)) => commands::models::versions(args),
        Command::Job(JobCommand::Create(args)) => commands::jobs::create(*args),
        Command::Job(JobCommand::Ls(args)) => commands::jobs::list(args),
        Command::Job(JobCommand::Show(args)) => commands::jobs::show(args),
        Command::Job(JobCommand::Start(args)) => commands::jobs::act(args, JobAction::Start),
        Command::Job(JobCommand::Pause(args)) => commands::jobs::act(args, JobAction::Pause),
        Command::Job(JobCommand::Resume(args)) => commands::jobs::act(args, JobAction::Resume),
        Command::Job(JobCommand::Cancel(args)) => commands::jobs::act(args, JobAction::Cancel),
        Command::Job(JobCommand::Watch(args)) => commands::watch::run(args).map(|_| ()),
        Command::Simulate(args) => commands::simulate::run(*args).map(|_| ()),
        Command::CentralWorker(_) => anyhow::bail!("the central worker runs on its own"),
        Command::Device(DeviceCommand::Ls(args)) => commands::devices::list(args),
        Command::Device(DeviceCommand::EnrollToken(args)) => commands::devices::enroll_token(args),
        Command::Dataset(DatasetCommand::Push(args)) => commands::datasets::push(args),
        Command::Dataset(DatasetCommand::Ls(args)) => commands::datasets::list(args),
        Command::Dataset(DatasetCommand::Rm(args)) => commands::datasets::remove(args),
        Command::Privacy(PrivacyCommand::Epsilon(args)) => commands::privacy::epsilon(args),
        Command::Privacy(PrivacyCommand::Noise(args)) => commands::privacy::noise(args),
        Command::Authority(AuthorityCommand::New(args)) => commands::authority::new(args),
        Command::Authority(AuthorityCommand::Certify(args)) => commands::authority::certify(args),
    }
}
