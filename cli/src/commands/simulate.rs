//! `canopy simulate`: a federated job over many virtual devices, each
//! enrolled with its own key and shard and running the SDK's own code
//! (crate `canopy-sim`), against a server started in this process or the
//! one `canopy login` saved (`--login`). Prints the job's rounds as
//! `canopy job watch` does.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};
use canopy_sdk::{CancelToken, Transport};
use canopy_sim::fleet::{MAX_SPREAD, MAX_STEP_MS};
use canopy_sim::setup::{self, JobSettings, MAX_HIDDEN, MAX_ROUNDS};
use canopy_sim::{
    Attack, AttackKind, Fleet, FleetPart, FleetSettings, MAX_DEVICES, Partition, StepTime,
};
use canopy_term::progress::StepBar;
use clap::Args;
use reqwest::Method;
use serde_json::{Value, json};

use crate::output::{errln, outln};
use crate::remote::{Login, Payload, Remote, Subject};

use super::watch::{INTERRUPTED_EXIT, WatchEnd, watch};

/// The model every simulation pushes (a new version each run).
const MODEL_NAME: &str = "sim-mlp";
/// The held-out split the server evaluates each version on.
const TEST_DATASET: &str = "sim-test";
/// How often the rounds are read while the job runs.
const WATCH_INTERVAL_MS: u64 = 500;

#[derive(Args, Debug)]
pub struct SimulateArgs {
    /// Virtual devices to enroll, each with its own key and shard.
    #[arg(long, default_value_t = 100)]
    devices: usize,
    /// Devices each round trains; with --buffer-size, the devices that
    /// train at once.
    #[arg(long, default_value_t = 10)]
    per_round: u32,
    /// Federated rounds; with --buffer-size, versions.
    #[arg(long, default_value_t = 10)]
    rounds: u32,
    /// Run the job asynchronously (FedBuff): --per-round devices train at
    /// once, each on the newest version it can get, and every BUFFER_SIZE
    /// updates make a version, each weighted down by its staleness.
    #[arg(long)]
    buffer_size: Option<u32>,
    /// With --buffer-size: the oldest update a version takes, in versions.
    #[arg(long, default_value_t = 20, requires = "buffer_size")]
    max_staleness: u32,
    /// With --buffer-size: an update τ versions old weighs (1 + τ)^-E
    /// times its samples.
    #[arg(long, default_value_t = 0.5, requires = "buffer_size")]
    staleness_exponent: f64,
    /// `digits` (the bundled UCI digits), a folder of IDX files (its test
    /// files become the server's held-out set), or a CSV file (label last).
    #[arg(long, default_value = setup::BUNDLED_DIGITS)]
    data: String,
    /// How the training data is dealt to devices: `iid`,
    /// `dirichlet:ALPHA` (label skew; smaller is more skewed) or
    /// `shards:K` (K classes per device).
    #[arg(long, default_value = "dirichlet:0.5")]
    partition: Partition,
    /// Seeds the split, the partition, the model and the devices' keys.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Hidden units of the MLP (128 on MNIST: 101,770 parameters).
    #[arg(long, default_value_t = 32)]
    hidden: usize,
    /// Local epochs per round.
    #[arg(long, default_value_t = 1)]
    epochs: u32,
    #[arg(long, default_value_t = 16)]
    batch_size: u32,
    #[arg(long, default_value_t = 0.1)]
    learning_rate: f64,
    #[arg(long, default_value_t = 60_000)]
    round_deadline_ms: u64,
    /// The job's server strategy, as the jobs API takes it (JSON), e.g.
    /// '{"name": "fedavgm", "server_learning_rate": 0.5}'; FedAvg when
    /// left out (docs/strategies.md).
    #[arg(long, value_parser = parse_strategy)]
    strategy: Option<Value>,
    /// A differentially private job (DP-FedAvg, docs/privacy.md).
    #[command(flatten)]
    privacy: super::privacy::JobPrivacyArgs,
    /// Robust aggregation (docs/robustness.md).
    #[command(flatten)]
    robust: super::robust::JobRobustArgs,
    /// Compressed updates (docs/compression.md).
    #[command(flatten)]
    compression: super::compression::JobCompressionArgs,
    /// How many of the devices (the first ones) poison their updates, as
    /// --attack says, to try a robust rule against them.
    #[arg(long, default_value_t = 0)]
    attackers: usize,
    /// What the attackers send instead of their update Δ: `scale:F`
    /// (F·Δ) or `sign-flip[:F]` (−F·Δ).
    #[arg(long, default_value = "sign-flip", value_parser = AttackKind::parse)]
    attack: AttackKind,
    /// How often an idle device checks in for a task; by default about
    /// 1,000 check-ins a second over the fleet, each device every 1 to 30 s.
    #[arg(long, value_parser = clap::value_parser!(u64).range(100..=600_000))]
    check_in_ms: Option<u64>,
    /// Simulated device speed: the median time per training step, in
    /// milliseconds, each device's drawn log-normal (see --step-spread).
    /// By default devices run at the host's speed.
    #[arg(long)]
    step_ms: Option<f64>,
    /// How many times longer the slowest device's step takes than the
    /// fastest's, with --step-ms.
    #[arg(long, default_value_t = 10.0, requires = "step_ms")]
    step_spread: f64,
    /// Run against the server `canopy login` saved, instead of one started
    /// in this process. It must allow this many enrollments from one
    /// address (docs/simulate.md).
    #[arg(long)]
    login: bool,
    /// Host part I of P of the devices (`2/4`: the second quarter), to
    /// spread one simulation over P processes or machines against one
    /// server (--login; PostgreSQL behind it for more than one machine's
    /// fleet). Give every process the same settings but this one. Part 1
    /// pushes the model and creates the job; the others enroll their
    /// devices, wait for that job to appear and train in it until it ends.
    #[arg(long, value_parser = parse_part, requires = "login")]
    part: Option<Part>,
    /// Write the job's final model file here.
    #[arg(long)]
    save_model: Option<PathBuf>,
    /// Write the learning curve here as CSV: each version's number, its
    /// seconds since the job started, its central accuracy and loss, the
    /// updates it took and how long it took to make from them.
    #[arg(long)]
    curve: Option<PathBuf>,
}

impl SimulateArgs {
    fn check(&self) -> Result<()> {
        ensure!(
            (1..=MAX_DEVICES).contains(&self.devices),
            "--devices must be between 1 and {MAX_DEVICES}, got {}",
            self.devices
        );
        ensure!(
            self.per_round >= 1 && self.per_round as usize <= self.devices,
            "--per-round {} must be between 1 and --devices ({})",
            self.per_round,
            self.devices
        );
        ensure!(
            self.attackers <= self.devices,
            "--attackers {} must be at most --devices ({})",
            self.attackers,
            self.devices
        );
        if let Some(part) = self.part {
            ensure!(
                part.of <= self.devices,
                "--part {}/{} splits {} devices into more parts than devices: give P at most \
                 --devices",
                part.index,
                part.of,
                self.devices
            );
        }
        if let Some(buffer_size) = self.buffer_size {
            ensure!(
                (1..=self.per_round).contains(&buffer_size),
                "--buffer-size {buffer_size} must be between 1 and --per-round ({}), the devices \
                 that train at once: a version would wait for more updates than devices train",
                self.per_round
            );
            ensure!(
                self.max_staleness >= 1,
                "--max-staleness must be at least 1, got 0: a version would take only the \
                 updates trained on the one before it (leave --buffer-size out for \
                 synchronous rounds)"
            );
        }
        ensure!(
            (1..=MAX_ROUNDS).contains(&self.rounds),
            "--rounds must be between 1 and {MAX_ROUNDS}, got {}",
            self.rounds
        );
        ensure!(
            (1..=MAX_HIDDEN).contains(&self.hidden),
            "--hidden must be between 1 and {MAX_HIDDEN}, got {}",
            self.hidden
        );
        if let Some(step_ms) = self.step_ms {
            ensure!(
                step_ms.is_finite() && step_ms > 0.0 && step_ms <= MAX_STEP_MS,
                "--step-ms must be more than 0 and at most {MAX_STEP_MS}, got {step_ms}"
            );
            ensure!(
                self.step_spread.is_finite() && (1.0..=MAX_SPREAD).contains(&self.step_spread),
                "--step-spread must be between 1 and {MAX_SPREAD}, got {}",
                self.step_spread
            );
        }
        ensure!(
            self.learning_rate.is_finite() && self.learning_rate > 0.0,
            "--learning-rate must be a positive number, got {}",
            self.learning_rate
        );
        Ok(())
    }

    fn part(&self) -> Part {
        self.part.unwrap_or(Part::WHOLE)
    }

    fn fleet(&self) -> FleetSettings {
        let hosted = self.part().range(self.devices);
        let mut settings = FleetSettings::new(hosted.len(), self.seed, "sim");
        if self.part.is_some() {
            settings.part = Some(FleetPart {
                first_device: hosted.start,
                all_devices: self.devices,
            });
        }
        if let Some(check_in_ms) = self.check_in_ms {
            settings.check_in_ms = check_in_ms;
        }
        settings.step_time = self.step_ms.map(|median_ms| StepTime {
            median_ms,
            spread: self.step_spread,
        });
        settings.attack = (self.attackers > 0).then_some(Attack {
            devices: self.attackers,
            kind: self.attack,
        });
        settings
    }

    fn job(&self) -> JobSettings {
        JobSettings {
            name: format!("simulate: {} devices, {}", self.devices, self.partition),
            rounds: self.rounds,
            per_round: self.per_round,
            epochs: self.epochs,
            batch_size: self.batch_size,
            learning_rate: self.learning_rate,
            round_deadline_ms: self.round_deadline_ms,
            central_dataset: Some(TEST_DATASET.to_string()),
            strategy: self.strategy.clone(),
            privacy: Some(self.privacy.fields())
                .filter(|fields| !fields.is_empty())
                .map(Value::Object),
            robust: self.robust.fields().map(Value::Object),
            compression: self.compression.fields().map(Value::Object),
            buffer: self.buffer_size.map(|buffer_size| setup::Buffer {
                size: buffer_size,
                max_staleness: self.max_staleness,
                staleness_exponent: self.staleness_exponent,
            }),
        }
    }
}

/// Most processes one simulation spreads over.
const MAX_PARTS: usize = 10_000;
/// How long a part other than the first waits for the job to appear.
const JOIN_WAIT_MS: u64 = 600_000;
/// How often it looks.
const JOIN_POLL_MS: u64 = 500;

/// A `--part I/P` value: this process hosts the I-th of P equal ranges of
/// the devices (the last ones take the remainder).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Part {
    /// From 1.
    index: usize,
    of: usize,
}

impl Part {
    const WHOLE: Part = Part { index: 1, of: 1 };

    /// The devices of `devices` this part hosts.
    fn range(self, devices: usize) -> std::ops::Range<usize> {
        (self.index - 1) * devices / self.of..self.index * devices / self.of
    }

    /// The part that creates the job.
    fn creates_job(self) -> bool {
        self.index == 1
    }
}

fn parse_part(text: &str) -> Result<Part, String> {
    let (index, of) = text
        .split_once('/')
        .ok_or_else(|| format!("expected I/P, e.g. 2/4, got `{text}`"))?;
    let number = |value: &str| {
        value
            .trim()
            .parse::<usize>()
            .map_err(|_| format!("expected I/P with whole numbers, e.g. 2/4, got `{text}`"))
    };
    let (index, of) = (number(index)?, number(of)?);
    if !(1..=MAX_PARTS).contains(&of) || !(1..=of).contains(&index) {
        return Err(format!(
            "expected I/P with 1 ≤ I ≤ P ≤ {MAX_PARTS}, got `{text}`"
        ));
    }
    Ok(Part { index, of })
}

/// A `--strategy` value: a JSON object (the server checks its fields).
fn parse_strategy(text: &str) -> Result<Value, String> {
    match serde_json::from_str::<Value>(text) {
        Ok(value) if value.is_object() => Ok(value),
        Ok(_) => Err("expected a JSON object, e.g. '{\"name\": \"fedavgm\"}'".to_string()),
        Err(error) => Err(format!("not JSON: {error}")),
    }
}

pub fn run(args: SimulateArgs) -> Result<ExitCode> {
    args.check()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the simulation's runtime")?;
    runtime.block_on(async {
        tokio::select! {
            end = simulate(&args) => end,
            signal = tokio::signal::ctrl_c() => match signal {
                Ok(()) => {
                    errln!("simulation stopped");
                    Ok(ExitCode::from(INTERRUPTED_EXIT))
                }
                Err(error) => Err(anyhow!(error).context("cannot listen for Ctrl-C")),
            },
        }
    })
}

/// The server the devices and the admin calls go to, and, when it runs in
/// this process, what stops it.
struct Target {
    login: Login,
    running: Option<canopy_sim::cloud::Running>,
}

async fn simulate(args: &SimulateArgs) -> Result<ExitCode> {
    let started = Instant::now();
    let scratch = tempfile::Builder::new()
        .prefix("canopy-simulate-")
        .tempdir()?;
    let data = setup::load(&args.data, args.seed, scratch.path())?;
    let part = args.part();
    let hosted = part.range(args.devices);
    let shards: Vec<_> = args
        .partition
        .deal(&data.train, args.devices, args.seed)
        .map_err(explain)?
        .drain(hosted.clone())
        .collect();
    let fleet_settings = args.fleet();
    let target = target(args, scratch.path(), &fleet_settings).await?;
    // Whatever ends the run, an in-process server stops before its
    // scratch directory (its database) is deleted.
    let outcome = async {
        let remote = Remote::new(target.login.clone())?;
        outln!(
            "server: {}{}",
            target.login.url,
            if target.running.is_some() {
                " (in this process, SQLite)"
            } else {
                ""
            }
        )?;

        let version = match part.creates_job() {
            true => {
                let version = push_model(&remote, &data.train, args).await?;
                push_test_split(&remote, &data.test, scratch.path()).await?;
                Some(version)
            }
            false => None,
        };
        let token = enrollment_token(&remote, shards.len()).await?;
        let transport = Transport::new(&target.login.url, &target.login.trust())?;
        let enrolling = Instant::now();
        let fleet = enroll(transport, &token, shards, fleet_settings).await?;
        outln!(
            "{} devices enrolled in {:.1} s ({} partition of {} samples; each idle device keeps {} bytes)",
            fleet.len(),
            enrolling.elapsed().as_secs_f64(),
            args.partition,
            data.train.len(),
            Fleet::idle_bytes_per_device()
        )?;

        if part != Part::WHOLE {
            outln!(
                "part {} of {}: devices {} to {} of {}",
                part.index,
                part.of,
                hosted.start,
                hosted.end,
                args.devices
            )?;
        }
        let job = match version {
            Some(version) => create_job(&remote, &args.job().body(version)).await?,
            None => join_job(&remote, &args.job().name).await?,
        };
        let fleet = Arc::new(fleet);
        let stop = CancelToken::new();
        let running_fleet = {
            let (fleet, stop) = (fleet.clone(), stop.clone());
            tokio::spawn(async move { fleet.run(stop).await })
        };
        let watched = watch(&remote, job, Duration::from_millis(WATCH_INTERVAL_MS)).await;
        stop.cancel();
        let report = running_fleet.await.context("the simulated fleet stopped")?;
        print_report(&report, started)?;
        let end = watched?;
        if let (WatchEnd::Completed, Some(path)) = (&end, &args.save_model) {
            save_model(&remote, job, path).await?;
            outln!("final model written to {}", path.display())?;
        }
        if let Some(path) = &args.curve {
            write_curve(&remote, job, path).await?;
            outln!("learning curve written to {}", path.display())?;
        }
        Ok(match end {
            WatchEnd::Completed => ExitCode::SUCCESS,
            WatchEnd::Interrupted => ExitCode::from(INTERRUPTED_EXIT),
        })
    }
    .await;
    if let Some(running) = target.running {
        let stopped = running.shutdown().await;
        if outcome.is_ok() {
            stopped?;
        }
    }
    outcome
}

/// The job's learning curve against time, as CSV: a row per version a
/// training round (or buffer) made, timed from when the job started.
async fn write_curve(remote: &Remote, job: i64, path: &std::path::Path) -> Result<()> {
    let subject = Subject::new(format!("job {job}"), None);
    let detail = remote.get(&format!("/api/v1/jobs/{job}"), &subject).await?;
    let rounds = remote
        .list_all(&format!("/api/v1/jobs/{job}/rounds"), &subject)
        .await?;
    let started_ms = detail["started_ms"].as_i64().unwrap_or_default();
    let mut csv = String::from(
        "version,seconds,central_accuracy,central_loss,updates,aggregating_ms,bytes_in\n",
    );
    let made = rounds
        .iter()
        .filter(|round| round["state"] == "succeeded" && round["kind"] == "train");
    for round in made {
        let metrics = &round["metrics"];
        let finished_ms = round["finished_ms"].as_i64().unwrap_or(started_ms);
        csv.push_str(&format!(
            "{},{:.3},{},{},{},{},{}\n",
            round["number"],
            (finished_ms - started_ms) as f64 / 1000.0,
            metrics["central_eval_accuracy"],
            metrics["central_eval_loss"],
            metrics["updates_accepted"],
            round["durations"]["aggregating_ms"],
            metrics["bytes_in"],
        ));
    }
    std::fs::write(path, csv).with_context(|| format!("cannot write {}", path.display()))
}

/// What the devices did, and the first task they declined and why.
fn print_report(report: &canopy_sim::FleetReport, started: Instant) -> Result<()> {
    outln!(
        "devices: {} check-ins, {} updates, {} evaluations, {} tasks declined; {:.1} s in all",
        report.polls,
        report.trained,
        report.evaluated,
        report.failed,
        started.elapsed().as_secs_f64()
    )?;
    if let Some(first) = &report.first_failure {
        outln!("first task declined: {first}")?;
    }
    Ok(())
}

fn explain(error: canopy_sim::SimError) -> anyhow::Error {
    let hint = error.hint();
    let error = anyhow::Error::new(error);
    match hint {
        Some(hint) => crate::files::Hint::attach(error, hint),
        None => error,
    }
}

async fn target(
    args: &SimulateArgs,
    scratch: &std::path::Path,
    fleet: &FleetSettings,
) -> Result<Target> {
    if args.login {
        return Ok(Target {
            login: crate::remote::config::load()?,
            running: None,
        });
    }
    let running = canopy_sim::cloud::start(scratch, args.devices, fleet)
        .await
        .map_err(explain)?;
    let login = Login {
        url: running.base_url(),
        token: running
            .admin_token
            .clone()
            .context("the simulation's server issued no admin token")?,
        fingerprint: running.fingerprint.clone(),
        ca_cert: None,
    };
    Ok(Target {
        login,
        running: Some(running),
    })
}

async fn push_model(
    remote: &Remote,
    train: &canopy_engine::data::Dataset,
    args: &SimulateArgs,
) -> Result<i64> {
    let bytes = setup::initial_model(train, args.hidden, args.seed)?;
    let subject = Subject::new(format!("model `{MODEL_NAME}`"), Some("canopy model ls"));
    let version = remote
        .call(
            Method::POST,
            &format!("/api/v1/models/{MODEL_NAME}/versions"),
            Payload::Bytes {
                bytes,
                content_type: "application/octet-stream",
            },
            &subject,
        )
        .await?;
    version["id"]
        .as_i64()
        .context("the server's answer to the model upload has no version id")
}

async fn push_test_split(
    remote: &Remote,
    test: &canopy_engine::data::Dataset,
    scratch: &std::path::Path,
) -> Result<()> {
    let path = scratch.join("sim-test.csv");
    canopy_engine::data::write_csv(&path, test)?;
    let form = super::datasets::upload_form(&path, None).await?;
    remote
        .call(
            Method::PUT,
            &format!("/api/v1/datasets/{TEST_DATASET}"),
            Payload::Form(form),
            &Subject::new(
                format!("dataset `{TEST_DATASET}`"),
                Some("canopy dataset ls"),
            ),
        )
        .await?;
    Ok(())
}

async fn enrollment_token(remote: &Remote, devices: usize) -> Result<String> {
    let answer = remote
        .post(
            "/api/v1/enrollment-tokens",
            json!({"expires_in": "1d", "max_uses": devices, "label": "canopy simulate"}),
            &Subject::new("an enrollment token", None),
        )
        .await?;
    Ok(answer["secret"]
        .as_str()
        .context("the server's answer has no enrollment secret")?
        .to_string())
}

async fn enroll(
    transport: Transport,
    token: &str,
    shards: Vec<canopy_engine::data::Dataset>,
    settings: FleetSettings,
) -> Result<Fleet> {
    let total = shards.len();
    let mut bar = StepBar::new(1);
    bar.step("enrolling devices");
    let bar = std::sync::Mutex::new(bar);
    let progress = |done: usize| {
        if done.is_multiple_of(64) || done == total {
            let mut bar = bar.lock().unwrap_or_else(|p| p.into_inner());
            bar.detail(format!("{done}/{total}"));
        }
    };
    let fleet = Fleet::enroll(transport, token, shards, settings, progress).await;
    bar.into_inner().unwrap_or_else(|p| p.into_inner()).finish();
    fleet.map_err(explain)
}

/// The job part 1 of the simulation created: the newest job named `name`
/// that has not ended, once it appears.
async fn join_job(remote: &Remote, name: &str) -> Result<i64> {
    let waiting = Instant::now();
    loop {
        let jobs = remote
            .list_all("/api/v1/jobs", &Subject::new("jobs", None))
            .await?;
        let found = jobs
            .iter()
            .filter(|job| {
                job["name"] == name && matches!(job["state"].as_str(), Some("created" | "running"))
            })
            .filter_map(|job| job["id"].as_i64())
            .max();
        if let Some(id) = found {
            outln!("joined job {id} `{name}`")?;
            return Ok(id);
        }
        if waiting.elapsed() >= Duration::from_millis(JOIN_WAIT_MS) {
            let error = anyhow!(
                "no job `{name}` appeared on the server in {} s",
                JOIN_WAIT_MS / 1_000
            );
            return Err(crate::files::Hint::attach(
                error,
                "start part 1 (`--part 1/P`) with the same settings against the same server: it \
                 creates the job the other parts join",
            ));
        }
        tokio::time::sleep(Duration::from_millis(JOIN_POLL_MS)).await;
    }
}

async fn create_job(remote: &Remote, body: &Value) -> Result<i64> {
    let job = remote
        .post(
            "/api/v1/jobs",
            body.clone(),
            &Subject::new("the simulated job", None),
        )
        .await?;
    let id = job["id"].as_i64().context("the job answer has no id")?;
    remote
        .post(
            &format!("/api/v1/jobs/{id}/start"),
            json!({}),
            &Subject::job(id),
        )
        .await?;
    Ok(id)
}

/// The job's current version, downloaded to `path`.
async fn save_model(remote: &Remote, job: i64, path: &std::path::Path) -> Result<()> {
    let subject = Subject::job(job);
    let job_view = remote.get(&format!("/api/v1/jobs/{job}"), &subject).await?;
    let id = job_view["current_version_id"]
        .as_i64()
        .context("the job names no current version")?;
    let versions = remote
        .list_all(
            &format!("/api/v1/models/{MODEL_NAME}/versions"),
            &Subject::new(format!("model `{MODEL_NAME}`"), Some("canopy model ls")),
        )
        .await?;
    let number = versions
        .iter()
        .find(|v| v["id"].as_i64() == Some(id))
        .and_then(|v| v["version"].as_i64())
        .with_context(|| format!("model `{MODEL_NAME}` lists no version with id {id}"))?;
    let response = remote
        .request(
            Method::GET,
            &format!("/api/v1/models/{MODEL_NAME}/versions/{number}/download"),
            Payload::Empty,
        )
        .send()
        .await?;
    if !response.status().is_success() {
        bail!("downloading the final model answered {}", response.status());
    }
    let bytes = response.bytes().await?;
    crate::files::write_atomic(path, &bytes, 0o644)
        .with_context(|| format!("cannot write the final model to {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_cover_the_devices_once() {
        for (devices, parts) in [(10, 3), (7, 7), (100_000, 6), (5, 1)] {
            let mut next = 0;
            for index in 1..=parts {
                let range = Part { index, of: parts }.range(devices);
                assert_eq!(range.start, next, "{devices} devices in {parts} parts");
                assert!(
                    !range.is_empty(),
                    "part {index}/{parts} of {devices} is empty"
                );
                next = range.end;
            }
            assert_eq!(next, devices);
        }
    }

    #[test]
    fn a_part_is_i_of_p() {
        assert_eq!(parse_part("2/4"), Ok(Part { index: 2, of: 4 }));
        for bad in ["0/4", "5/4", "2", "a/b", "1/0", "1/10001"] {
            assert!(parse_part(bad).is_err(), "{bad}");
        }
    }
}
