//! `canopy simulate` against real agents: ten virtual devices reproduce
//! the model that ten `canopy-agent` processes train on the same shards,
//! model, job and seeds; and its settings are checked before anything
//! starts.

#[path = "../server/tests/support/mod.rs"]
mod support;

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use canopy_engine::data::write_csv;
use canopy_sim::Partition;
use canopy_sim::setup::{self, JobSettings};
use support::{Admin, Database, TestServer, fetch_model, sibling_binary};

const DEVICES: usize = 10;
const ROUNDS: u32 = 3;
const SEED: u64 = 11;
const HIDDEN: usize = 32;
const PARTITION: &str = "dirichlet:0.5";
const JOB_TIMEOUT: Duration = Duration::from_secs(180);

/// The job both runs train: every device in every round.
fn job_settings() -> JobSettings {
    JobSettings {
        name: "agents".into(),
        rounds: ROUNDS,
        per_round: DEVICES as u32,
        epochs: 1,
        batch_size: 16,
        learning_rate: 0.1,
        round_deadline_ms: 60_000,
        central_dataset: None,
        strategy: None,
        privacy: None,
        robust: None,
        compression: None,
        buffer: None,
    }
}

fn agent(dir: &Path, args: &[&str]) -> Command {
    let mut command = Command::new(sibling_binary("canopy-agent"));
    command
        .arg("--data-dir")
        .arg(dir)
        .args(args)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null());
    command
}

fn checked(mut command: Command, what: &str) -> Result<Output> {
    let output = command
        .output()
        .with_context(|| format!("cannot run {what}"))?;
    ensure!(
        output.status.success(),
        "{what} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(output)
}

struct Agents(Vec<Child>);

impl Drop for Agents {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The trainable parameters of model `name`'s version with id `id`.
async fn trainable_of(admin: &Admin, name: &str, id: i64) -> Result<Vec<f64>> {
    let versions = admin
        .ok(&format!("/api/v1/models/{name}/versions?limit=100"))
        .await?;
    let number = versions["items"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|v| v["id"].as_i64() == Some(id))
        .and_then(|v| v["version"].as_i64())
        .with_context(|| format!("no version with id {id}: {versions}"))?;
    Ok(trainable(&fetch_model(admin, name, number).await?))
}

fn trainable(model: &canopy_ir::Model) -> Vec<f64> {
    support::trainable(model)
        .into_iter()
        .map(f64::from)
        .collect()
}

/// Ten agents, each enrolled in turn with shard k of the simulation's own
/// partition, train the simulation's model under its job settings.
async fn agents_model(work: &Path) -> Result<Vec<f64>> {
    let data = setup::load(setup::BUNDLED_DIGITS, SEED, work)?;
    let partition: Partition = PARTITION.parse().map_err(anyhow::Error::msg)?;
    let shards = partition.deal(&data.train, DEVICES, SEED)?;
    let server = TestServer::start(Database::Sqlite)?;
    let admin = server.admin();
    let model = setup::initial_model(&data.train, HIDDEN, SEED)?;
    let version = admin.upload_model("sim-mlp", model).await?;
    let token = admin.enrollment_token(DEVICES as u32).await?;
    let mut agents = Agents(Vec::new());
    for (index, shard) in shards.iter().enumerate() {
        let dir = work.join(format!("agent-{index}"));
        std::fs::create_dir_all(&dir)?;
        let csv = dir.join("shard.csv");
        write_csv(&csv, shard)?;
        let enroll = [
            "enroll",
            "--server",
            &server.base,
            "--token",
            &token,
            "--fingerprint",
            &server.fingerprint,
            "--backend",
            "cpu",
        ];
        checked(agent(&dir, &enroll), "canopy-agent enroll")?;
        let add = [
            "data",
            "add",
            "sim",
            "--kind",
            "csv",
            "--path",
            csv.to_str().unwrap_or_default(),
        ];
        checked(agent(&dir, &add), "canopy-agent data add")?;
        let log = std::fs::File::create(dir.join("agent.log"))?;
        let child = agent(
            &dir,
            &["run", "--max-threads", "1", "--poll-wait-ms", "2000"],
        )
        .stdout(Stdio::null())
        .stderr(Stdio::from(log))
        .spawn()?;
        agents.0.push(child);
    }
    let body = job_settings().body(version["id"].as_i64().unwrap_or_default());
    let job_id = admin.create_job(body).await?;
    let done = admin.wait_for_job(job_id, JOB_TIMEOUT).await?;
    ensure!(
        done["state"] == "completed",
        "the agents' job ended: {done}"
    );
    trainable_of(
        &admin,
        "sim-mlp",
        done["current_version_id"].as_i64().unwrap_or_default(),
    )
    .await
}

fn simulate(args: &[&str]) -> Result<Output> {
    Ok(Command::new(sibling_binary("canopy"))
        .arg("simulate")
        .args(args)
        .env("HOME", std::env::temp_dir())
        .stdin(Stdio::null())
        .output()?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_simulated_devices_reproduce_ten_real_agents() -> Result<()> {
    let work = tempfile::tempdir()?;
    let expected = agents_model(work.path()).await?;
    let saved = work.path().join("simulated.canopy");
    let (devices, rounds, seed, hidden) = (
        DEVICES.to_string(),
        ROUNDS.to_string(),
        SEED.to_string(),
        HIDDEN.to_string(),
    );
    let output = simulate(&[
        "--devices",
        &devices,
        "--per-round",
        &devices,
        "--rounds",
        &rounds,
        "--seed",
        &seed,
        "--hidden",
        &hidden,
        "--partition",
        PARTITION,
        "--epochs",
        "1",
        "--batch-size",
        "16",
        "--learning-rate",
        "0.1",
        "--save-model",
        saved.to_str().unwrap_or_default(),
    ])?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    ensure!(
        output.status.success(),
        "canopy simulate failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    for heading in ["round", "federated acc", "central acc"] {
        ensure!(stdout.contains(heading), "no `{heading}` column:\n{stdout}");
    }
    let simulated = trainable(&canopy_ir::format::read_model(&std::fs::read(&saved)?)?);
    ensure!(
        simulated.len() == expected.len(),
        "{} against {} parameters",
        simulated.len(),
        expected.len()
    );
    let distance = simulated
        .iter()
        .zip(&expected)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    println!("largest difference from the agents' model: {distance:e}");
    ensure!(
        distance <= 1e-6,
        "the simulation's model is {distance} from the agents'"
    );
    // A control: the model moved in training, so equal means something.
    let initial = setup::initial_model(
        &setup::load(setup::BUNDLED_DIGITS, SEED, work.path())?.train,
        HIDDEN,
        SEED,
    )?;
    let initial = trainable(&canopy_ir::format::read_model(&initial)?);
    let moved = initial
        .iter()
        .zip(&expected)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    ensure!(moved > 1e-3, "training moved the model only {moved}");
    Ok(())
}

#[test]
fn bad_settings_are_refused_naming_the_setting() -> Result<()> {
    let cases: [(&[&str], &str); 13] = [
        (
            &["--devices", "10", "--per-round", "11"],
            "--per-round 11 must be between 1 and --devices (10)",
        ),
        (&["--devices", "0"], "--devices must be between 1 and"),
        (
            &["--devices", "2000000"],
            "--devices must be between 1 and 1000000",
        ),
        (
            &["--partition", "dirichlet:0"],
            "`0` is not a Dirichlet concentration",
        ),
        (&["--partition", "halves"], "`halves` is not a partition"),
        (
            &["--devices", "5000"],
            "--partition dirichlet:0.5 cannot deal 1438 samples to 5000 devices",
        ),
        (&["--step-ms", "0"], "--step-ms must be more than 0"),
        (
            &["--step-ms", "10", "--step-spread", "0.5"],
            "--step-spread must be between 1 and 1000",
        ),
        (
            &["--per-round", "4", "--buffer-size", "5"],
            "--buffer-size 5 must be between 1 and --per-round (4), the devices that train at once",
        ),
        (
            &["--buffer-size", "2", "--max-staleness", "0"],
            "--max-staleness must be at least 1, got 0",
        ),
        (
            &["--login", "--part", "3/2"],
            "expected I/P with 1 ≤ I ≤ P ≤ 10000, got `3/2`",
        ),
        (&["--part", "1/2"], "--login"),
        (
            &[
                "--login",
                "--devices",
                "10",
                "--per-round",
                "5",
                "--part",
                "1/20",
            ],
            "--part 1/20 splits 10 devices into more parts than devices",
        ),
    ];
    for (args, expected) in cases {
        let output = simulate(args)?;
        let stderr = String::from_utf8_lossy(&output.stderr);
        ensure!(!output.status.success(), "{args:?} was accepted");
        ensure!(
            stderr.contains(expected),
            "{args:?}: expected `{expected}` in:\n{stderr}"
        );
    }
    Ok(())
}

/// `canopy simulate --buffer-size`: an asynchronous job runs to its last
/// version, and `--curve` writes one row per version, each evaluated.
#[test]
fn an_asynchronous_simulation_writes_its_curve() -> Result<()> {
    let work = tempfile::tempdir()?;
    let curve = work.path().join("curve.csv");
    let curve_arg = curve.display().to_string();
    let args = [
        "--devices",
        "8",
        "--per-round",
        "6",
        "--buffer-size",
        "3",
        "--rounds",
        "4",
        "--partition",
        "iid",
        "--curve",
        &curve_arg,
    ];
    let output = simulate(&args)?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    ensure!(
        output.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    ensure!(stdout.contains("completed: 4 rounds"), "{stdout}");
    let text = std::fs::read_to_string(&curve)?;
    let rows: Vec<Vec<&str>> = text
        .lines()
        .skip(1)
        .map(|l| l.split(',').collect())
        .collect();
    ensure!(rows.len() == 4, "one row per version:\n{text}");
    for (i, row) in rows.iter().enumerate() {
        ensure!(row[0] == (i + 1).to_string(), "versions in order:\n{text}");
        let accuracy: f64 = row[2].parse()?;
        ensure!(
            (0.0..=1.0).contains(&accuracy),
            "an evaluated version:\n{text}"
        );
        let updates: u32 = row[4].parse()?;
        ensure!(updates == 3, "a buffer takes exactly its size:\n{text}");
    }
    Ok(())
}

/// One simulation spread over two `canopy simulate` processes against one
/// server on PostgreSQL, each hosting half the devices: part 1 creates
/// the job, part 2 joins it, and every round needs all ten devices, so
/// neither could finish it alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_share_one_simulation() -> Result<()> {
    let server = TestServer::start(Database::Postgres)?;
    let admin = server.admin();
    let home = tempfile::tempdir()?;
    let canopy = |args: &[&str]| {
        let mut command = Command::new(sibling_binary("canopy"));
        command
            .args(args)
            .env("HOME", home.path())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        command
    };
    let login = canopy(&server.login_args(&admin.token)).output()?;
    ensure!(
        login.status.success(),
        "{}",
        String::from_utf8_lossy(&login.stderr)
    );
    let part = |part: &str| {
        canopy(&[
            "simulate",
            "--login",
            "--devices",
            "10",
            "--per-round",
            "10",
            "--rounds",
            "2",
            "--partition",
            "iid",
            "--part",
            part,
        ])
        .spawn()
    };
    // The joining part starts first: it waits for the job to appear.
    let second = part("2/2")?;
    let first = part("1/2")?;
    let (first, second) = (first.wait_with_output()?, second.wait_with_output()?);
    let mut outputs = Vec::new();
    for (name, output) in [("part 1", first), ("part 2", second)] {
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        ensure!(
            output.status.success(),
            "{name} failed:\n{stdout}\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
        // Five devices, each in both rounds.
        ensure!(stdout.contains(", 10 updates,"), "{name}:\n{stdout}");
        outputs.push(stdout);
    }
    ensure!(
        outputs[0].contains("part 1 of 2: devices 0 to 5 of 10")
            && outputs[1].contains("part 2 of 2: devices 5 to 10 of 10")
            && outputs[1].contains("joined job"),
        "{outputs:#?}"
    );
    let jobs = admin.ok("/api/v1/jobs").await?;
    let job = &jobs["items"][0];
    ensure!(job["state"] == "completed", "{jobs}");
    let rounds = admin
        .ok(&format!("/api/v1/jobs/{}/rounds", job["id"]))
        .await?;
    let rounds = rounds["items"].as_array().cloned().unwrap_or_default();
    ensure!(rounds.len() == 2, "{rounds:?}");
    for round in rounds {
        ensure!(
            round["metrics"]["updates_accepted"] == 10,
            "every round took all ten devices' updates: {round}"
        );
    }
    Ok(())
}
