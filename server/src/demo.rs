//! `canopy-server demo`: one command that shows the whole loop on real
//! data. It starts a server on a free loopback port (SQLite in a temporary
//! directory, HTTPS with a development certificate), plays the ML engineer
//! (builds an MLP, uploads it, creates a job), spawns real `canopy-agent`
//! processes that each enroll over HTTPS with a non-IID shard of the
//! bundled UCI digits, and prints one row per round.
//!
//! Each version is evaluated twice, and the table shows both, under the
//! names `canopy job watch` uses: `federated acc`, the federated
//! evaluation (the devices' own held-out data, as the round's evaluation
//! reports it), and `central acc`, the central evaluation (the server's,
//! on the held-out split the demo uploads as a dataset). It talks to the
//! API over HTTPS with `reqwest`, trusting the server's development
//! certificate; it uses no SDK.

use canopy_term::outln;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use canopy_engine::data::{Dataset, LabelColumn, load_csv, partition_dirichlet};
use canopy_engine::optim::Optimizer;
use canopy_engine::zoo::{Architecture, ModelConfig, build_model, fit_input_stats};
use serde_json::{Value, json};

use canopy_server::config::{Limits, Settings};

/// The UCI digits, bundled so the demo runs from any directory.
const DIGITS_CSV_GZ: &[u8] = include_bytes!("../../datasets/digits/digits.csv.gz");
const MODEL_NAME: &str = "digits-mlp";
/// The held-out split, uploaded for the server's central evaluation.
const TEST_DATASET: &str = "digits-test";
const HIDDEN_UNITS: usize = 32;
const TEST_FRACTION: f64 = 0.2;
const MAX_DEVICES: usize = 200;
const MAX_ROUNDS: u32 = 200;
const ROUND_DEADLINE_MS: u64 = 30_000;
/// Signed requests per second each agent may make (see `demo_settings`).
const DEMO_DEVICE_REQUESTS_PER_SECOND: u32 = 200;
/// Rounds per page of the rounds list, its maximum.
const ROUNDS_PAGE: u32 = 100;
const AGENT_STOP_GRACE: Duration = Duration::from_secs(10);

#[derive(clap::Args, Debug, Clone)]
pub struct DemoArgs {
    /// Agents (devices) to spawn.
    #[arg(long, default_value_t = 10)]
    pub devices: usize,
    /// Federated rounds.
    #[arg(long, default_value_t = 12)]
    pub rounds: u32,
    /// Dirichlet concentration of the label skew between devices; smaller
    /// is more non-IID.
    #[arg(long = "non-iid", default_value_t = 0.5)]
    pub non_iid: f64,
    /// End with one JSON line: final_accuracy, rounds, seconds, per-round rows.
    #[arg(long)]
    pub json: bool,
    /// Keep the server running after the job, until Ctrl-C.
    #[arg(long)]
    pub keep: bool,
    /// Seed for the data split, the shards and the model.
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Run the job with secure aggregation (SecAgg+): the server sees only
    /// the sum of the devices' updates.
    #[arg(long)]
    pub secure: bool,
}

/// The demo's secure-aggregation settings: the devices that must answer
/// for a round to succeed (`min_devices`) fit inside the dropout tolerance.
fn secure_aggregation(args: &DemoArgs) -> serde_json::Value {
    json!({"enabled": args.secure, "max_dropout_fraction": 0.2, "clip": 1.0, "bits": 31})
}

struct Agent {
    dir: PathBuf,
    child: Option<Child>,
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[derive(Clone, Debug, serde::Serialize)]
struct RoundRow {
    round: i64,
    participants: i64,
    selected: i64,
    /// In secure rounds the plain mean over devices: see [`SECURE_LOSS_NOTE`].
    train_loss: Option<f64>,
    /// Federated evaluation of the version this round produced: the
    /// devices' accuracy on their own held-out data, weighted by samples.
    federated_accuracy: Option<f64>,
    /// Central evaluation of that version: the server's accuracy on the
    /// held-out split uploaded as `digits-test`.
    central_accuracy: Option<f64>,
    seconds: f64,
    /// Where the round's time went, as the server recorded it (its
    /// `durations`): waiting for devices, from selection to closing, and
    /// from closing to the new version.
    selecting_ms: Option<i64>,
    training_ms: Option<i64>,
    aggregating_ms: Option<i64>,
    bytes_up: i64,
    bytes_down: i64,
}

/// How a secure round's training loss differs. A plain round weights each
/// device's reported loss by its sample count, which a secure round keeps
/// inside the masked sum.
const SECURE_LOSS_NOTE: &str = "train loss: in secure rounds, the plain mean over devices \
     (secure aggregation hides each device's sample count)";

/// Bytes in the table's KiB columns (binary, as the dashboard counts).
const KIB: i64 = 1024;

pub async fn run(args: DemoArgs) -> Result<()> {
    ensure!(
        (1..=MAX_DEVICES).contains(&args.devices),
        "--devices must be between 1 and {MAX_DEVICES}, got {}",
        args.devices
    );
    ensure!(
        (1..=MAX_ROUNDS).contains(&args.rounds),
        "--rounds must be between 1 and {MAX_ROUNDS}"
    );
    ensure!(
        args.non_iid.is_finite() && args.non_iid > 0.0,
        "--non-iid must be a positive number, got {}",
        args.non_iid
    );
    let started = Instant::now();
    let agent_bin = agent_binary()?;
    let work = tempfile::Builder::new().prefix("canopy-demo-").tempdir()?;
    let (train, test) = load_digits(work.path(), args.seed)?;
    let shards = partition_dirichlet(&train, args.devices, args.non_iid, args.seed)?;

    let running = canopy_server::server::start(demo_settings(work.path())).await?;
    let base = running.base_url();
    let fingerprint = running
        .fingerprint
        .clone()
        .context("the demo server has no certificate fingerprint")?;
    let token = running
        .admin_token
        .clone()
        .context("the demo server issued no admin token")?;
    let admin = Admin::new(&base, &work.path().join("server"), &token)?;
    say(
        &args,
        &format!("server: {base} (SQLite in {})", work.path().display()),
    )?;
    say(&args, &format!("dashboard: {base}/dashboard#token={token}"))?;
    say(&args, &format!("admin token: {token}"))?;
    if args.secure {
        say(
            &args,
            "secure aggregation (SecAgg+): the server learns only the sum of each round's updates",
        )?;
    }

    let model = build_digits_model(&train, args.seed)?;
    let version = admin.upload_model(model).await?;
    let test_csv = work.path().join("digits-test.csv");
    canopy_engine::data::write_csv(&test_csv, &test)?;
    admin.upload_dataset(TEST_DATASET, &test_csv).await?;
    say(
        &args,
        &format!(
            "held-out split ({} samples) uploaded as dataset `{TEST_DATASET}`: the server evaluates every version on it",
            test.len()
        ),
    )?;
    let enrollment = admin
        .post(
            "/api/v1/enrollment-tokens",
            json!({"expires_in": "1h", "max_uses": args.devices, "label": "demo"}),
        )
        .await?;
    let enrollment = enrollment["secret"]
        .as_str()
        .context("no enrollment secret")?
        .to_string();
    let mut agents = Vec::with_capacity(args.devices);
    for (index, shard) in shards.iter().enumerate() {
        agents.push(spawn_agent(
            &agent_bin,
            work.path(),
            index,
            shard,
            &base,
            &fingerprint,
            &enrollment,
        )?);
    }
    say(
        &args,
        &format!(
            "{} agents enrolled over HTTPS, each with a non-IID shard (alpha {})",
            args.devices, args.non_iid
        ),
    )?;

    let job = admin.create_job(&args, version).await?;
    let rows = watch_rounds(&admin, &args, job).await;
    let rows = match rows {
        Ok(rows) => rows,
        Err(error) => {
            report_agent_logs(&agents);
            return Err(error);
        }
    };
    let seconds = started.elapsed().as_secs_f64();
    stop_agents(&mut agents);
    let last = rows.last().context("the demo job finished no round")?;
    let final_accuracy = last.central_accuracy.with_context(|| {
        format!(
            "the server's central evaluation of round {} has no accuracy; its log says why",
            last.round
        )
    })?;
    let final_federated_accuracy = last.federated_accuracy;
    if !args.json || args.keep {
        outln!()?;
        outln!(
            "final central accuracy {final_accuracy:.3}, federated accuracy {} after {} rounds in {seconds:.1} s",
            accuracy_cell(final_federated_accuracy),
            rows.len()
        )?;
        outln!(
            "API:       {base}/api/v1   (reference: {base}/api/v1/docs, OpenAPI: {base}/api/v1/openapi.json)"
        )?;
        outln!("dashboard: {base}/dashboard#token={token}")?;
        outln!("certificate: {fingerprint}")?;
    }
    if args.keep {
        outln!("the server keeps running; press Ctrl-C to stop it")?;
        let _ = tokio::signal::ctrl_c().await;
    }
    running.shutdown().await?;
    if args.json {
        let summary = json!({
            "final_accuracy": final_accuracy,
            "final_federated_accuracy": final_federated_accuracy,
            "rounds": rows.len(),
            "seconds": seconds,
            "devices": args.devices,
            "non_iid": args.non_iid,
            "secure_aggregation": args.secure,
            "per_round": rows,
        });
        outln!("{summary}")?;
    }
    Ok(())
}

fn say(args: &DemoArgs, line: &str) -> Result<()> {
    if !args.json {
        outln!("{line}")?;
    }
    Ok(())
}

/// `canopy-agent` from the directory this binary runs from.
fn agent_binary() -> Result<PathBuf> {
    let exe = std::env::current_exe().context("cannot find the canopy-server executable")?;
    let agent = exe.with_file_name(format!("canopy-agent{}", std::env::consts::EXE_SUFFIX));
    if !agent.exists() {
        bail!(
            "the demo spawns canopy-agent processes, but {} does not exist\n  hint: build it next to canopy-server: cargo build --release --bin canopy-agent --bin canopy-server",
            agent.display()
        );
    }
    Ok(agent)
}

fn demo_settings(dir: &Path) -> Settings {
    let limits = Limits {
        // Every agent enrolls from 127.0.0.1.
        sensitive_requests_per_minute: 100_000,
        // A demo round takes about 0.1 s and each agent signs four or five
        // requests in it (poll, download, upload, metrics): some 50 a
        // second, past the default cap of 20 meant for devices whose rounds
        // take seconds. At the cap an agent is refused for a second and
        // waits it out (the SDK honours `Retry-After`), and the round
        // waits for it: one round in ten took 1-5 s instead of 0.1 s while
        // the SDK still retried inside that second (issue 38,
        // `benches/round_tail.rs`).
        device_requests_per_second: DEMO_DEVICE_REQUESTS_PER_SECOND,
        orchestrator_tick_ms: 50,
        ..Limits::default()
    };
    Settings::local(dir, limits)
}

fn load_digits(dir: &Path, seed: u64) -> Result<(Dataset, Dataset)> {
    let path = dir.join("digits.csv.gz");
    std::fs::write(&path, DIGITS_CSV_GZ)?;
    let data = load_csv(&path, LabelColumn::Last).context("cannot load the bundled digits")?;
    Ok(data.split(TEST_FRACTION, seed)?)
}

/// An MLP 64-32-10 with SGD; the input statistics are fitted once here,
/// in the cloud, and travel as frozen parameters.
fn build_digits_model(train: &Dataset, seed: u64) -> Result<Vec<u8>> {
    let mut model = build_model(&ModelConfig {
        architecture: Architecture::Mlp {
            inputs: 64,
            hidden: HIDDEN_UNITS,
            classes: 10,
        },
        seed,
        optimizer: Optimizer::parse("sgd")?,
        frozen_prefixes: Vec::new(),
        producer: format!("canopy-server demo {}", env!("CARGO_PKG_VERSION")),
    })?;
    model.metadata.model_name = MODEL_NAME.to_string();
    fit_input_stats(&mut model, train)?;
    Ok(canopy_ir::format::write_model(&model)?)
}

fn agent_command(bin: &Path, dir: &Path) -> Command {
    let mut command = Command::new(bin);
    command.arg("--data-dir").arg(dir).env("RUST_LOG", "warn");
    command
}

fn run_checked(mut command: Command, what: &str) -> Result<()> {
    let output = command
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("cannot run {what}"))?;
    if !output.status.success() {
        bail!(
            "{what} failed: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(())
}

fn spawn_agent(
    bin: &Path,
    work: &Path,
    index: usize,
    shard: &Dataset,
    base: &str,
    fingerprint: &str,
    enrollment: &str,
) -> Result<Agent> {
    let dir = work.join(format!("agent-{index:03}"));
    std::fs::create_dir_all(&dir)?;
    let shard_path = dir.join("shard.csv");
    canopy_engine::data::write_csv(&shard_path, shard)?;
    let mut enroll = agent_command(bin, &dir);
    enroll.args([
        "enroll",
        "--server",
        base,
        "--token",
        enrollment,
        "--fingerprint",
        fingerprint,
    ]);
    enroll.args(["--tag", &format!("demo-shard={index}")]);
    run_checked(enroll, &format!("canopy-agent enroll (agent {index})"))?;
    let mut add = agent_command(bin, &dir);
    add.args(["data", "add", "shard", "--kind", "csv", "--path"])
        .arg(&shard_path);
    run_checked(add, &format!("canopy-agent data add (agent {index})"))?;
    let log = std::fs::File::create(dir.join("agent.log"))?;
    let mut run = agent_command(bin, &dir);
    run.args(["run", "--max-threads", "1", "--poll-wait-ms", "5000"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(log));
    let child = run
        .spawn()
        .with_context(|| format!("cannot start canopy-agent run (agent {index})"))?;
    Ok(Agent {
        dir,
        child: Some(child),
    })
}

fn stop_agents(agents: &mut [Agent]) {
    for agent in agents.iter() {
        if let Some(child) = &agent.child {
            let _ = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
        }
    }
    let deadline = Instant::now() + AGENT_STOP_GRACE;
    for agent in agents.iter_mut() {
        if let Some(mut child) = agent.child.take() {
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn report_agent_logs(agents: &[Agent]) {
    for agent in agents {
        let log = std::fs::read_to_string(agent.dir.join("agent.log")).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(5).collect();
        if !tail.is_empty() {
            canopy_term::errln!("--- {} (last lines) ---", agent.dir.display());
            for line in tail.into_iter().rev() {
                canopy_term::errln!("{line}");
            }
        }
    }
}

/// Prints a row as each round finishes; returns the rows.
async fn watch_rounds(admin: &Admin, args: &DemoArgs, job: i64) -> Result<Vec<RoundRow>> {
    if !args.json {
        outln!()?;
        if args.secure {
            outln!("{SECURE_LOSS_NOTE}")?;
        }
        outln!(
            "round  devices  train loss  federated acc  central acc  seconds  up (KiB)  down (KiB)"
        )?;
    }
    let mut rows: Vec<RoundRow> = Vec::new();
    let deadline =
        Instant::now() + Duration::from_millis(ROUND_DEADLINE_MS * u64::from(args.rounds) * 2);
    // Every round up to this cursor has its row or has failed: the list is
    // read from there on, a page at a time (a job has more rounds than a
    // page holds).
    let mut settled: Option<String> = None;
    loop {
        let mut cursor = settled.clone();
        let mut all_settled = true;
        let mut pending = Vec::new();
        loop {
            let after = cursor
                .as_deref()
                .map(|cursor| format!("&cursor={cursor}"))
                .unwrap_or_default();
            let page = admin
                .get(&format!(
                    "/api/v1/jobs/{job}/rounds?limit={ROUNDS_PAGE}{after}"
                ))
                .await?;
            for round in page["items"].as_array().into_iter().flatten() {
                let number = round["number"].as_i64().unwrap_or_default();
                // A row waits for both evaluations of the round's version.
                let metrics = &round["metrics"];
                let evaluated = metrics["central_eval_state"] != "pending"
                    && metrics["federated_eval_state"] != "open";
                let done = round["state"] == "succeeded" && evaluated;
                all_settled &= done || round["state"] == "failed";
                if all_settled {
                    settled = round["id"].as_i64().map(|id| id.to_string());
                }
                if done && !rows.iter().any(|row| row.round == number) {
                    pending.push(round.clone());
                }
            }
            match page["next_cursor"].as_str() {
                Some(next) => cursor = Some(next.to_string()),
                None => break,
            }
        }
        for round in &pending {
            let row = round_row(round)?;
            if !args.json {
                let loss = match row.train_loss {
                    Some(loss) => format!("{loss:.4}"),
                    None if args.secure => "n/a".to_string(),
                    None => "-".to_string(),
                };
                outln!(
                    "{:>5}  {:>7}  {:>10}  {:>13}  {:>11}  {:>7.2}  {:>8}  {:>10}",
                    row.round,
                    format!("{}/{}", row.participants, row.selected),
                    loss,
                    accuracy_cell(row.federated_accuracy),
                    accuracy_cell(row.central_accuracy),
                    row.seconds,
                    row.bytes_up / KIB,
                    row.bytes_down / KIB,
                )?;
                let _ = std::io::stdout().flush();
            }
            rows.push(row);
        }
        let state = admin.get(&format!("/api/v1/jobs/{job}")).await?;
        match state["state"].as_str() {
            Some("completed") if rows.len() as u32 >= args.rounds => return Ok(rows),
            Some("failed" | "cancelled") => {
                bail!("the demo job stopped: {}", state["status_message"])
            }
            _ => {}
        }
        ensure!(
            Instant::now() < deadline,
            "the demo job did not finish in time: {state}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// An accuracy with three decimals, `-` when there is none.
fn accuracy_cell(accuracy: Option<f64>) -> String {
    accuracy.map_or_else(|| "-".to_string(), |accuracy| format!("{accuracy:.3}"))
}

fn round_row(round: &Value) -> Result<RoundRow> {
    ensure!(
        round["result_version_id"].is_i64(),
        "succeeded round {} names no version: {round}",
        round["number"]
    );
    let metrics = &round["metrics"];
    let durations = &round["durations"];
    Ok(RoundRow {
        round: round["number"].as_i64().unwrap_or_default(),
        participants: metrics["updates_accepted"].as_i64().unwrap_or_default(),
        selected: round["selected"].as_i64().unwrap_or_default(),
        train_loss: metrics["train_loss"].as_f64(),
        federated_accuracy: metrics["federated_eval_accuracy"].as_f64(),
        central_accuracy: metrics["central_eval_accuracy"].as_f64(),
        seconds: durations["total_ms"].as_f64().unwrap_or_default() / 1000.0,
        selecting_ms: durations["selecting_ms"].as_i64(),
        training_ms: durations["training_ms"].as_i64(),
        aggregating_ms: durations["aggregating_ms"].as_i64(),
        bytes_up: metrics["bytes_in"].as_i64().unwrap_or_default(),
        bytes_down: metrics["bytes_out"].as_i64().unwrap_or_default(),
    })
}

/// The admin API over HTTPS, trusting only the demo server's development
/// certificate.
struct Admin {
    http: reqwest::Client,
    base: String,
    token: String,
}

impl Admin {
    fn new(base: &str, data_dir: &Path, token: &str) -> Result<Admin> {
        let (cert, _key) = canopy_server::tls::self_signed(data_dir, None)?;
        let pem = std::fs::read(&cert)
            .with_context(|| format!("cannot read the demo certificate {}", cert.display()))?;
        let http = reqwest::Client::builder()
            .add_root_certificate(reqwest::Certificate::from_pem(&pem)?)
            .build()
            .context("cannot build the demo's HTTPS client")?;
        Ok(Admin {
            http,
            base: base.trim_end_matches('/').to_string(),
            token: token.to_string(),
        })
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// `PUT /api/v1/datasets/{name}` with the file as part `data`.
    async fn upload_dataset(&self, name: &str, path: &Path) -> Result<()> {
        let bytes = std::fs::read(path)?;
        let form = reqwest::multipart::Form::new().part(
            "data",
            reqwest::multipart::Part::bytes(bytes).file_name("data.csv"),
        );
        let response = self
            .http
            .put(self.url(&format!("/api/v1/datasets/{name}")))
            .bearer_auth(&self.token)
            .multipart(form)
            .send()
            .await?;
        Admin::check(response, "dataset upload").await?;
        Ok(())
    }

    async fn check(response: reqwest::Response, what: &str) -> Result<Value> {
        let status = response.status();
        let body: Value = response.json().await.unwrap_or(Value::Null);
        ensure!(status.is_success(), "{what} answered {status}: {body}");
        Ok(body)
    }

    async fn get(&self, path: &str) -> Result<Value> {
        let response = self
            .http
            .get(self.url(path))
            .bearer_auth(&self.token)
            .send()
            .await?;
        Admin::check(response, path).await
    }

    async fn post(&self, path: &str, body: Value) -> Result<Value> {
        let response = self
            .http
            .post(self.url(path))
            .bearer_auth(&self.token)
            .json(&body)
            .send()
            .await?;
        Admin::check(response, path).await
    }

    async fn upload_model(&self, bytes: Vec<u8>) -> Result<i64> {
        let response = self
            .http
            .post(self.url(&format!("/api/v1/models/{MODEL_NAME}/versions")))
            .bearer_auth(&self.token)
            .header("content-type", "application/octet-stream")
            .body(bytes)
            .send()
            .await?;
        let body = Admin::check(response, "model upload").await?;
        body["id"]
            .as_i64()
            .context("the upload answer has no version id")
    }

    async fn create_job(&self, args: &DemoArgs, version_id: i64) -> Result<i64> {
        let min_devices = (args.devices * 4).div_ceil(5).max(1);
        let job = self
            .post(
                "/api/v1/jobs",
                json!({
                    "name": "demo: federated digits", "model_version_id": version_id, "rounds": args.rounds,
                    "min_devices": min_devices, "target_devices": args.devices, "over_selection": 0.0,
                    "round_deadline_ms": ROUND_DEADLINE_MS, "local_epochs": 2, "batch_size": 16,
                    "learning_rate": 0.1, "max_round_retries": 3,
                    "secure_aggregation": secure_aggregation(args),
                    "evaluation": {"central_dataset": TEST_DATASET},
                }),
            )
            .await?;
        let id = job["id"].as_i64().context("the job answer has no id")?;
        self.post(&format!("/api/v1/jobs/{id}/start"), json!({}))
            .await?;
        Ok(id)
    }
}
