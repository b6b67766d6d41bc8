//! The dashboard in a real browser: a server runs a job with real SDK
//! devices (training on the bundled digits, evaluating each version), and
//! `web/tests/dashboard.spec.mjs` drives Debian's Chromium through
//! `playwright-core` against it: the curves have one point per finished
//! round, with axis titles and an accuracy axis fitted to the data; the
//! pause and resume buttons change the job's state, and disabled ones stay
//! legible; the header shows the signed-in session; the form's errors
//! show beside it, and a job made with it is cancelled with its button;
//! the jobs list keeps its rounds column in view; the lineage and devices
//! views show what the API holds, rounds by number; the API reference page
//! (`/api/v1/docs`) shows the whole OpenAPI document: `POST /api/v1/jobs`'s
//! `JobSpec` body and its responses, a table of contents, Markdown; and
//! nothing breaks the content security policy. Screenshots (desktop and
//! 420 px) go to `$CANOPY_TEST_ARTIFACTS`, or `test-artifacts/dashboard`
//! in the target directory.
//!
//! Also here: the rounds list's `order=newest`, which the dashboard polls.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use bytes::Bytes;
use canopy_engine::data::{Dataset, LabelColumn, load_csv, partition_dirichlet};
use canopy_engine::zoo::{Architecture, ModelConfig, build_model, fit_input_stats};
use canopy_protocol::messages::{DatasetInfo, Heartbeat, RoundMetrics, Task, TaskKind};
use canopy_sdk::DeviceClient;
use serde_json::{Value, json};

use crate::support;
use crate::support::{Database, TestServer, enroll_device};

const CHROMIUM: &str = "/usr/bin/chromium";
const ROUNDS: u32 = 24;
/// Devices hold their uploads of this round until the browser has paused
/// and resumed the job, so the job cannot finish before the buttons are
/// tried, however slow the machine.
const HOLD_ROUND: u32 = 10;
/// The round whose first attempt device 0 declines, so it fails: its
/// participants show a drop reason, and the curves must not count it.
const DECLINED_ROUND: u32 = 3;
const DECLINE_REASON: &str = "battery low: below 15% and not charging";
const TASK_PAUSE: Duration = Duration::from_millis(200);
const BROWSER_TIMEOUT: Duration = Duration::from_secs(240);

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the server crate sits in the workspace")
        .to_path_buf()
}

/// Chromium and playwright-core must be installed; a missing one fails the
/// test with what to install (CI's `.ci/run` installs both). Returns the
/// main script to run (the others sit beside it).
fn require_browser_tools(chromium: &Path, web: &Path) -> Result<PathBuf> {
    if !chromium.exists() {
        bail!(
            "{} is missing; the dashboard's browser test drives Debian's Chromium\n  \
             hint: `apt-get install -y chromium` (`.ci/run` does this)",
            chromium.display()
        );
    }
    let playwright = web.join("node_modules/playwright-core/package.json");
    if !playwright.exists() {
        bail!(
            "{} is missing; the dashboard's browser test runs playwright-core from npm\n  \
             hint: `cd web && npm ci` (`.ci/run` does this)",
            playwright.display()
        );
    }
    let node = Command::new("node").arg("--version").output();
    if !node.is_ok_and(|output| output.status.success()) {
        bail!("`node` cannot run; the dashboard's browser test needs Node.js 20 or newer and npm");
    }
    Ok(web.join("tests/dashboard.spec.mjs"))
}

#[test]
fn missing_browser_tools_fail_with_what_to_install() {
    let empty = tempfile::tempdir().expect("a temporary directory");
    let chromium = repo_root().join("no-such-chromium");
    let error = require_browser_tools(&chromium, &repo_root().join("web")).unwrap_err();
    assert!(
        error.to_string().contains("apt-get install -y chromium"),
        "{error}"
    );
    let error = require_browser_tools(Path::new(CHROMIUM), empty.path());
    if Path::new(CHROMIUM).exists() {
        let error = error.unwrap_err().to_string();
        assert!(
            error.contains("playwright-core") && error.contains("npm ci"),
            "{error}"
        );
    }
}

fn artifacts_dir() -> Result<PathBuf> {
    let dir = match std::env::var_os("CANOPY_TEST_ARTIFACTS") {
        Some(dir) => PathBuf::from(dir).join("dashboard"),
        None => support::sibling_binary("x")
            .parent()
            .and_then(Path::parent)
            .context("the target directory")?
            .join("test-artifacts/dashboard"),
    };
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    Ok(dir)
}

fn digits() -> Result<(Dataset, Dataset)> {
    let path = repo_root().join("datasets/digits/digits.csv.gz");
    let data = load_csv(path, LabelColumn::Last)?;
    Ok(data.split(0.2, 17)?)
}

fn digits_model(train: &Dataset) -> Result<Vec<u8>> {
    let mut model = build_model(&ModelConfig {
        architecture: Architecture::LogReg {
            inputs: 64,
            classes: 10,
        },
        seed: 1,
        optimizer: canopy_engine::optim::Optimizer::parse("sgd")?,
        frozen_prefixes: Vec::new(),
        producer: "dashboard browser test".to_string(),
    })?;
    fit_input_stats(&mut model, train)?;
    Ok(canopy_ir::format::write_model(&model)?)
}

struct Device {
    client: DeviceClient,
    index: usize,
    shard: Dataset,
    held_out: Dataset,
}

/// What the devices share with the test: when to release the held round,
/// and when to stop.
#[derive(Default)]
struct Gates {
    released: AtomicBool,
    stop: AtomicBool,
}

/// A device's loop: train tasks run the shipped `train_step` on the
/// device's shard, evaluation tasks evaluate the version on its held-out
/// data; until the test says stop.
async fn device_loop(device: Device, gates: Arc<Gates>) -> Result<()> {
    let mut declined = false;
    while !gates.stop.load(Ordering::Relaxed) {
        let Some(task) = device.client.next_task(1_000).await? else {
            continue;
        };
        match task.kind {
            TaskKind::Evaluate => {
                let model = device.client.download_model(&task).await?;
                let model = canopy_sdk::train::read_model(&model.bytes)?;
                let options = canopy_sdk::train::EvalOptions::default();
                let evaluation = canopy_sdk::train::evaluate(&model, &device.held_out, &options)?;
                device.client.report_evaluation(&task, &evaluation).await?;
            }
            TaskKind::Statistics => {
                let model = device.client.download_model(&task).await?;
                let update =
                    canopy_sdk::train::statistics_update(&model.bytes, &task, &device.shard)?;
                device
                    .client
                    .upload_update(&task, Bytes::from(update.encoded))
                    .await?;
            }
            TaskKind::Train => {
                if device.index == 0 && task.round_number == DECLINED_ROUND && !declined {
                    declined = true;
                    device.client.decline_task(&task, DECLINE_REASON).await?;
                    continue;
                }
                train(&device, &task, &gates).await?;
            }
        }
        // A task costs about seven signed requests; unpaced, a device on
        // a fast machine passes the server's 20 requests per second.
        tokio::time::sleep(TASK_PAUSE).await;
    }
    Ok(())
}

async fn train(device: &Device, task: &Task, gates: &Gates) -> Result<()> {
    let model = device.client.download_model(task).await?;
    let (task_copy, data, seed) = (task.clone(), device.shard.clone(), device.index as u64);
    let update = tokio::task::spawn_blocking(move || {
        canopy_sdk::train::train_task(
            &model.bytes,
            &task_copy,
            &data,
            seed * 1000 + u64::from(task_copy.round_number),
            &canopy_sdk::train::TrainOptions::default(),
        )
    })
    .await??;
    while task.round_number >= HOLD_ROUND && !gates.released.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    device
        .client
        .upload_update(task, Bytes::from(update.encoded))
        .await?;
    device
        .client
        .report_metrics(&RoundMetrics {
            round_id: task.round_id,
            train_loss: Some(update.train_loss),
            eval_loss: None,
            eval_accuracy: None,
            eval_samples: None,
            train_duration_ms: Some(update.train_duration_ms),
        })
        .await?;
    Ok(())
}

fn dataset_info(name: &str, data: &Dataset) -> DatasetInfo {
    DatasetInfo {
        name: name.to_string(),
        samples: data.len() as u64,
        sample_shape: vec![64],
        classes: 10,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_shows_and_controls_a_running_job_in_chromium() -> Result<()> {
    let script = require_browser_tools(Path::new(CHROMIUM), &repo_root().join("web"))?;
    let artifacts = artifacts_dir()?;
    let (train_set, test_set) = digits()?;
    let server = TestServer::start(Database::Sqlite)?;
    let admin = server.admin();
    let version = admin
        .upload_model("digits", digits_model(&train_set)?)
        .await?;
    let token = admin.enrollment_token(4).await?;

    let shards = partition_dirichlet(&train_set, 3, 1.0, 5)?;
    let third = test_set.len() / 3;
    let gates = Arc::new(Gates::default());
    let mut workers = Vec::new();
    for (index, shard) in shards.into_iter().enumerate() {
        let client = enroll_device(&server, &token).await?;
        let held_out = test_set.subset(&(index * third..(index + 1) * third).collect::<Vec<_>>());
        client
            .heartbeat(&Heartbeat {
                state: Some("idle".to_string()),
                round_id: None,
                datasets: Some(vec![dataset_info("digits", &shard)]),
                last_error: None,
                conditions: None,
            })
            .await?;
        let device = Device {
            client,
            index,
            shard,
            held_out,
        };
        workers.push(tokio::spawn(device_loop(device, gates.clone())));
    }
    // A fourth device that holds other data and reports an error: never
    // selected for the digits job, shown on the devices view.
    let idle = enroll_device(&server, &token).await?;
    idle.heartbeat(&Heartbeat {
        state: Some("idle".to_string()),
        round_id: None,
        datasets: Some(vec![DatasetInfo {
            name: "photos".to_string(),
            samples: 120,
            sample_shape: vec![3, 32, 32],
            classes: 4,
        }]),
        last_error: Some(
            "dataset `digits` failed to load: /data/digits.csv: permission denied".to_string(),
        ),
        conditions: None,
    })
    .await?;

    // All of digits, kept on the server: each version is evaluated on it
    // centrally, for the dashboard's third curve.
    let digits = std::fs::read(repo_root().join("datasets/digits/digits.csv.gz"))?;
    let form = reqwest::multipart::Form::new().part(
        "data",
        reqwest::multipart::Part::bytes(digits).file_name("digits.csv.gz"),
    );
    let uploaded = admin
        .transport
        .http()
        .put(admin.transport.url("/api/v1/datasets/digits-all"))
        .bearer_auth(&admin.token)
        .multipart(form)
        .send()
        .await?;
    anyhow::ensure!(
        uploaded.status() == 201,
        "dataset upload answered {}",
        uploaded.status()
    );
    let job = admin
        .create_job(json!({
            "name": "digits-dashboard", "model_version_id": version["id"], "rounds": ROUNDS,
            "min_devices": 3, "target_devices": 3, "over_selection": 0.0, "dataset": "digits",
            "round_deadline_ms": 60_000, "local_epochs": 1, "batch_size": 16, "learning_rate": 0.1,
            "strategy": {"name": "fedavgm", "momentum": 0.5},
            "learning_rate_schedule": {"kind": "exponential", "factor": 0.97},
            "evaluation": {"fraction": 1.0, "deadline_ms": 30_000, "central_dataset": "digits-all"},
        }))
        .await?;

    let resumed = artifacts.join("resumed");
    let _ = std::fs::remove_file(&resumed);
    let mut browser = Command::new("node")
        .arg(&script)
        .current_dir(repo_root())
        .env("CANOPY_URL", &server.base)
        .env("CANOPY_TOKEN", &server.admin_token)
        .env("CANOPY_JOB_ID", job.to_string())
        .env("CANOPY_MODEL_VERSION_ID", version["id"].to_string())
        .env("CANOPY_ROUNDS", ROUNDS.to_string())
        .env("CANOPY_DECLINE_REASON", DECLINE_REASON)
        .env("CANOPY_ARTIFACTS", &artifacts)
        .env("CANOPY_RESUMED_FILE", &resumed)
        .env("CANOPY_CHROMIUM", CHROMIUM)
        .stdin(Stdio::null())
        .spawn()
        .context("cannot start node")?;

    // Release the held round once the browser has paused and resumed the
    // job (the script then writes `resumed`), or once the script has ended
    // (so a failure cannot hang here).
    let started = Instant::now();
    let status = loop {
        if let Some(status) = browser.try_wait()? {
            break status;
        }
        if resumed.exists() {
            gates.released.store(true, Ordering::Relaxed);
        }
        if started.elapsed() > BROWSER_TIMEOUT {
            let _ = browser.kill();
            let _ = browser.wait();
            bail!(
                "the browser script ran past {BROWSER_TIMEOUT:?}; screenshots so far are in {}",
                artifacts.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    gates.released.store(true, Ordering::Relaxed);
    gates.stop.store(true, Ordering::Relaxed);
    for worker in workers {
        worker.await??;
    }
    ensure!(
        status.success(),
        "the browser script failed ({status}); its output is above, screenshots in {}; server log:\n{}",
        artifacts.display(),
        server
            .log()
            .lines()
            .rev()
            .take(40)
            .collect::<Vec<_>>()
            .join("\n")
    );
    let finished = admin.ok(&format!("/api/v1/jobs/{job}")).await?;
    assert_eq!(finished["state"], "completed", "{finished}");
    for shot in [
        "dashboard-desktop.png",
        "dashboard-420px.png",
        "lineage-desktop.png",
        "lineage-420px.png",
        "form-error-desktop.png",
        "api-reference-top.png",
        "api-reference-create-job.png",
        "api-reference-420px.png",
    ] {
        let size = std::fs::metadata(artifacts.join(shot))
            .map(|m| m.len())
            .unwrap_or(0);
        assert!(
            size > 10_000,
            "{shot} was saved in {} ({size} bytes)",
            artifacts.display()
        );
    }
    Ok(())
}

/// `order=newest` pages a job's rounds from the latest back, and its
/// cursor leads to earlier rounds; a bad order is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rounds_page_newest_first() -> Result<()> {
    let server = TestServer::start(Database::Sqlite)?;
    let admin = server.admin();
    let version = admin
        .upload_model("paged", support::logreg_model_bytes(3))
        .await?;
    let token = admin.enrollment_token(1).await?;
    let device = enroll_device(&server, &token).await?;
    let job = admin
        .create_job(json!({
            "name": "paged", "model_version_id": version["id"], "rounds": 5,
            "min_devices": 1, "target_devices": 1, "over_selection": 0.0,
            "round_deadline_ms": 60_000, "local_epochs": 1, "batch_size": 8, "learning_rate": 0.1,
            "evaluation": {"fraction": 0.0},
        }))
        .await?;
    for _ in 0..5 {
        let task = support::poll_task(&device).await?;
        device.download_model(&task).await?;
        let values = vec![1e-3f32; task.layout.num_elements()];
        let update = canopy_protocol::update::encode_update(&task.layout, 10, &values)?;
        device.upload_update(&task, Bytes::from(update)).await?;
    }
    let finished = admin.wait_for_job(job, Duration::from_secs(60)).await?;
    assert_eq!(finished["state"], "completed", "{finished}");

    let numbers = |page: &Value| -> Vec<i64> {
        page["items"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|r| r["number"].as_i64())
            .collect()
    };
    let oldest = admin.ok(&format!("/api/v1/jobs/{job}/rounds")).await?;
    assert_eq!(numbers(&oldest), [1, 2, 3, 4, 5]);
    let first = admin
        .ok(&format!("/api/v1/jobs/{job}/rounds?order=newest&limit=2"))
        .await?;
    assert_eq!(numbers(&first), [5, 4], "{first}");
    let cursor = first["next_cursor"].as_str().context("a next page")?;
    let second = admin
        .ok(&format!(
            "/api/v1/jobs/{job}/rounds?order=newest&limit=2&cursor={cursor}"
        ))
        .await?;
    assert_eq!(numbers(&second), [3, 2], "{second}");
    let cursor = second["next_cursor"].as_str().context("a last page")?;
    let last = admin
        .ok(&format!(
            "/api/v1/jobs/{job}/rounds?order=newest&limit=2&cursor={cursor}"
        ))
        .await?;
    assert_eq!(numbers(&last), [1], "{last}");
    assert!(last["next_cursor"].is_null(), "{last}");
    let explicit = admin
        .ok(&format!("/api/v1/jobs/{job}/rounds?order=oldest&limit=2"))
        .await?;
    assert_eq!(numbers(&explicit), [1, 2]);

    let refused = admin
        .get(&format!("/api/v1/jobs/{job}/rounds?order=sideways"))
        .await?;
    assert_eq!(refused.status, 400, "{}", refused.body);
    Ok(())
}

/// A tiered job's round as the dashboard shows it: the test plays two
/// aggregators, each reporting its sub-round (one with a device that timed
/// out) and uploading its result, then `web/tests/tiers.spec.mjs` checks
/// the round's tree in Chromium and takes its screenshots.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_shows_a_tiered_rounds_tree_in_chromium() -> Result<()> {
    use canopy_protocol::messages::{DropoutCount, SubRoundReport};
    let main = require_browser_tools(Path::new(CHROMIUM), &repo_root().join("web"))?;
    let script = main.with_file_name("tiers.spec.mjs");
    let artifacts = artifacts_dir()?;
    let server = TestServer::start(Database::Sqlite)?;
    let admin = server.admin();
    let version = admin
        .upload_model("tiered", support::logreg_model_bytes(3))
        .await?;
    let token = admin.enrollment_token_for("aggregator", 2).await?;
    let mut aggregators = Vec::new();
    for _ in 0..2 {
        aggregators.push(support::enroll_aggregator(&server, &token).await?);
    }
    let job = admin
        .create_job(json!({
            "name": "tiered", "model_version_id": version["id"], "rounds": 1,
            "min_devices": 2, "target_devices": 2, "over_selection": 0.0,
            "round_deadline_ms": 60_000, "local_epochs": 1, "batch_size": 8,
            "learning_rate": 0.1, "evaluation": {"fraction": 0.0},
            "edges": {"min_devices": 3, "target_devices": 5, "over_selection": 0.0},
        }))
        .await?;
    for (aggregator, (selected, updates, dropped)) in aggregators.iter().zip([(5, 4, 1), (3, 3, 0)])
    {
        let task = support::poll_task(aggregator).await?;
        let report = SubRoundReport {
            round_id: task.round_id,
            selected,
            updates,
            dropouts: dropped,
            ineligible: 0,
            dropout_reasons: (dropped > 0)
                .then(|| DropoutCount {
                    reason: "timeout: no update before the round's deadline".to_string(),
                    devices: dropped,
                })
                .into_iter()
                .collect(),
            samples: Some(u64::from(updates) * 10),
            bytes_in: u64::from(updates) * 2_600,
            bytes_out: u64::from(selected) * 12_000,
            duration_ms: 1_250,
        };
        aggregator.report_sub_round(&report).await?;
        let values = vec![0.01; task.layout.num_elements()];
        let update = canopy_protocol::update::encode_update(
            &task.layout,
            report.samples.unwrap_or(1),
            &values,
        )?;
        aggregator.upload_update(&task, Bytes::from(update)).await?;
    }
    let finished = admin.wait_for_job(job, Duration::from_secs(60)).await?;
    ensure!(finished["state"] == "completed", "{finished}");
    let async_job = asynchronous_job(&server).await?;
    let private_job = private_job(&server).await?;

    let status = Command::new("node")
        .arg(&script)
        .current_dir(repo_root())
        .env("CANOPY_URL", &server.base)
        .env("CANOPY_TOKEN", &server.admin_token)
        .env("CANOPY_JOB_ID", job.to_string())
        .env("CANOPY_ASYNC_JOB_ID", async_job.to_string())
        .env("CANOPY_PRIVATE_JOB_ID", private_job.to_string())
        .env("CANOPY_ARTIFACTS", &artifacts)
        .env("CANOPY_CHROMIUM", CHROMIUM)
        .stdin(Stdio::null())
        .status()
        .context("cannot start node")?;
    ensure!(
        status.success(),
        "the browser script failed ({status}); its output is above, screenshots in {}",
        artifacts.display()
    );
    for shot in [
        "tiered-round-desktop.png",
        "tiered-round-420px.png",
        "asynchronous-job.png",
        "private-job.png",
    ] {
        let size = std::fs::metadata(artifacts.join(shot))
            .map(|m| m.len())
            .unwrap_or(0);
        ensure!(
            size > 10_000,
            "{shot} was saved in {} ({size} bytes)",
            artifacts.display()
        );
    }
    Ok(())
}

/// A finished asynchronous job: two end devices, one training at a time
/// each, a version from every update, three versions.
/// A differentially private job that spends its budget: three devices,
/// two a round (sampling rate 2/3), and a budget that two rounds fit and
/// a third would pass, so it stops, completed, after two.
async fn private_job(server: &TestServer) -> Result<i64> {
    use canopy_privacy::{Accountant, Conversion, Event, Orders};
    let epsilon_after = |rounds: u64| -> Result<f64> {
        let mut accountant = Accountant::new(Orders::standard());
        accountant.compose(&Event::gaussian(2.0 / 3.0, 1.0, rounds))?;
        Ok(accountant.epsilon(1e-5, Conversion::Tight)?.epsilon)
    };
    let budget = 0.5 * (epsilon_after(2)? + epsilon_after(3)?);
    let admin = server.admin();
    let version = admin
        .upload_model("private", support::logreg_model_bytes(7))
        .await?;
    let token = admin.enrollment_token(3).await?;
    let mut devices = Vec::new();
    for _ in 0..3 {
        let device = support::enroll_device(server, &token).await?;
        // The job's dataset, which no other device on this server holds:
        // online before the job starts, so each round chooses 2 of 3.
        device
            .heartbeat(&Heartbeat {
                state: Some("idle".to_string()),
                round_id: None,
                datasets: Some(vec![DatasetInfo {
                    name: "private".to_string(),
                    samples: 50,
                    sample_shape: vec![64],
                    classes: 10,
                }]),
                last_error: None,
                conditions: None,
            })
            .await?;
        device.next_task(0).await?;
        devices.push(device);
    }
    let job = admin
        .create_job(json!({
            "name": "private", "model_version_id": version["id"], "rounds": 5, "dataset": "private",
            "min_devices": 2, "target_devices": 2, "over_selection": 0.0,
            "round_deadline_ms": 60_000, "local_epochs": 1, "batch_size": 8,
            "learning_rate": 0.1, "evaluation": {"fraction": 0.0},
            "differential_privacy": {"noise_multiplier": 1.0, "clip_norm": 0.5,
                                     "delta": 1e-5, "budget_epsilon": budget},
        }))
        .await?;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let view = admin.ok(&format!("/api/v1/jobs/{job}")).await?;
        if view["state"] != "running" && view["state"] != "created" {
            ensure!(view["state"] == "completed", "{view}");
            ensure!(view["rounds_completed"] == 2, "{view}");
            return Ok(job);
        }
        ensure!(
            Instant::now() < deadline,
            "the private job did not finish: {view}"
        );
        for device in &devices {
            if let Some(task) = device.next_task(100).await? {
                let values = vec![0.01; task.layout.num_elements()];
                let update = canopy_protocol::update::encode_update(&task.layout, 10, &values)?;
                device.upload_update(&task, Bytes::from(update)).await?;
            }
        }
    }
}

async fn asynchronous_job(server: &TestServer) -> Result<i64> {
    let admin = server.admin();
    let version = admin
        .upload_model("buffered", support::logreg_model_bytes(5))
        .await?;
    let token = admin.enrollment_token(2).await?;
    let mut devices = Vec::new();
    for _ in 0..2 {
        devices.push(support::enroll_device(server, &token).await?);
    }
    let job = admin
        .create_job(json!({
            "name": "buffered", "model_version_id": version["id"], "rounds": 3,
            "min_devices": 1, "target_devices": 1, "over_selection": 0.0,
            "round_deadline_ms": 60_000, "local_epochs": 1, "batch_size": 8,
            "learning_rate": 0.1, "evaluation": {"fraction": 0.0},
            "asynchronous": {"concurrency": 2},
        }))
        .await?;
    for number in 1..=3u32 {
        let device = &devices[(number % 2) as usize];
        let task = support::poll_task(device).await?;
        let values = vec![0.01; task.layout.num_elements()];
        let update = canopy_protocol::update::encode_update(&task.layout, 10, &values)?;
        device.upload_update(&task, Bytes::from(update)).await?;
        device
            .report_metrics(&canopy_protocol::messages::RoundMetrics {
                round_id: task.round_id,
                train_loss: Some(1.0 / f64::from(number)),
                eval_loss: None,
                eval_accuracy: None,
                eval_samples: None,
                train_duration_ms: Some(5),
            })
            .await?;
        let rounds = admin.ok(&format!("/api/v1/jobs/{job}")).await?;
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let mut made = rounds["rounds_completed"].as_i64().unwrap_or(0);
        while made < i64::from(number) {
            ensure!(
                std::time::Instant::now() < deadline,
                "buffer {number} made no version"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
            let job = admin.ok(&format!("/api/v1/jobs/{job}")).await?;
            made = job["rounds_completed"].as_i64().unwrap_or(0);
        }
    }
    let finished = admin.wait_for_job(job, Duration::from_secs(60)).await?;
    ensure!(finished["state"] == "completed", "{finished}");
    Ok(job)
}
