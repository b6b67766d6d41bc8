//! Central evaluation through a real server, on SQLite and PostgreSQL: a
//! job that names a held-out dataset uploaded to the server gets, on every
//! round, the accuracy of the version that round produced, equal to
//! evaluating the downloaded version on the same data with the engine
//! here; the job completes only once its last version is evaluated; a
//! server killed between a round's success and its evaluation evaluates
//! it after restart; an evaluation that cannot run is recorded with its
//! reason and does not fail the job.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use bytes::Bytes;
use canopy_engine::CpuBackend;
use canopy_engine::data::{Dataset, LabelColumn, load_csv};
use canopy_engine::train::{EVAL_BATCH, evaluate};
use canopy_protocol::messages::{Task, TaskKind};
use canopy_protocol::update::encode_update;
use canopy_sdk::DeviceClient;
use serde_json::{Value, json};

use crate::support::{
    Admin, Database, Reply, TestServer, enroll_device, fetch_model, logreg_model_bytes, poll_task,
};

const TIMEOUT: Duration = Duration::from_secs(60);
const DEVICES: usize = 2;

fn digits_path() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../datasets/digits/digits.csv.gz")
}

async fn put_dataset(admin: &Admin, name: &str, data: Vec<u8>) -> Result<Reply> {
    let form = reqwest::multipart::Form::new().part(
        "data",
        reqwest::multipart::Part::bytes(data).file_name("data.csv.gz"),
    );
    let response = admin
        .transport
        .http()
        .put(admin.transport.url(&format!("/api/v1/datasets/{name}")))
        .bearer_auth(&admin.token)
        .multipart(form)
        .send()
        .await?;
    let status = response.status().as_u16();
    let body = response.json().await.unwrap_or(Value::Null);
    Ok(Reply { status, body })
}

fn spec(version_id: i64, rounds: u32, dataset: &str) -> Value {
    json!({
        "name": "central-evaluation", "model_version_id": version_id, "rounds": rounds,
        "min_devices": DEVICES, "target_devices": DEVICES, "over_selection": 0.0,
        "round_deadline_ms": 60_000, "local_epochs": 1, "batch_size": 8, "learning_rate": 0.1,
        "evaluation": {"fraction": 0.0, "central_dataset": dataset},
    })
}

/// Uploads a small deterministic update, different per device and round.
async fn train(device: &DeviceClient, task: &Task) -> Result<()> {
    ensure!(
        task.kind == TaskKind::Train,
        "expected training, got {task:?}"
    );
    device.download_model(task).await?;
    let values: Vec<f32> = (0..task.layout.num_elements())
        .map(|i| {
            ((i as i64 * 37 + device.device_id * 11 + i64::from(task.round_number) * 5) % 19 - 9)
                as f32
                * 1e-2
        })
        .collect();
    let encoded = encode_update(&task.layout, 20, &values)?;
    device.upload_update(task, Bytes::from(encoded)).await?;
    Ok(())
}

/// Every device trains the round it is handed; returns the round's id.
async fn run_round(devices: &[DeviceClient], number: u32) -> Result<i64> {
    let mut round_id = 0;
    for device in devices {
        let task = poll_task(device).await?;
        ensure!(
            task.round_number == number,
            "round {} instead of {number}",
            task.round_number
        );
        round_id = task.round_id;
        train(device, &task).await?;
    }
    Ok(round_id)
}

async fn setup(server: &TestServer, seed: u64) -> Result<(i64, Vec<DeviceClient>)> {
    let admin = server.admin();
    let reply = put_dataset(&admin, "digits", std::fs::read(digits_path())?).await?;
    ensure!(reply.status == 201, "{}", reply.body);
    let version = admin
        .upload_model("logreg", logreg_model_bytes(seed))
        .await?;
    let token = admin.enrollment_token(DEVICES as u32).await?;
    let mut devices = Vec::new();
    for _ in 0..DEVICES {
        devices.push(enroll_device(server, &token).await?);
    }
    Ok((version["id"].as_i64().unwrap_or_default(), devices))
}

/// The round's central accuracy is the engine's evaluation of the version
/// it produced, downloaded here, on the same dataset.
async fn ensure_central_matches(admin: &Admin, round: &Value, digits: &Dataset) -> Result<()> {
    let metrics = &round["metrics"];
    ensure!(metrics["central_eval_state"] == "done", "{round}");
    ensure!(
        metrics["central_eval_samples"] == digits.len() as u64,
        "{metrics}"
    );
    let version_id = round["result_version_id"].as_i64().unwrap_or_default();
    let version = admin.ok("/api/v1/models/logreg/versions?limit=500").await?["items"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|v| v["id"].as_i64() == Some(version_id))
        .and_then(|v| v["version"].as_i64())
        .unwrap_or_default();
    let model = fetch_model(admin, "logreg", version).await?;
    let here = evaluate(&model, digits, EVAL_BATCH, &CpuBackend)?;
    let (accuracy, loss) = (
        metrics["central_eval_accuracy"].as_f64().unwrap_or(-1.0),
        metrics["central_eval_loss"].as_f64().unwrap_or(-1.0),
    );
    ensure!(
        (accuracy - here.accuracy).abs() <= 1e-9 && (loss - here.loss).abs() <= 1e-9,
        "round {}: server accuracy {accuracy} loss {loss}, here {} {}",
        round["number"],
        here.accuracy,
        here.loss
    );
    Ok(())
}

async fn every_round_is_evaluated_centrally(database: Database) -> Result<()> {
    let server = TestServer::start(database)?;
    let admin = server.admin();
    let (version_id, devices) = setup(&server, 4).await?;
    let job = admin.create_job(spec(version_id, 3, "digits")).await?;
    for number in 1..=3 {
        run_round(&devices, number).await?;
    }
    let finished = admin.wait_for_job(job, TIMEOUT).await?;
    ensure!(finished["state"] == "completed", "{finished}");
    let rounds = admin.ok(&format!("/api/v1/jobs/{job}/rounds")).await?;
    let rounds: Vec<&Value> = rounds["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|r| r["state"] == "succeeded")
        .collect();
    ensure!(rounds.len() == 3, "{rounds:?}");
    let digits = load_csv(digits_path(), LabelColumn::Last)?;
    let mut losses = Vec::new();
    for round in &rounds {
        ensure_central_matches(&admin, round, &digits).await?;
        losses.push(round["metrics"]["central_eval_loss"].as_f64());
    }
    // Each round's own version is evaluated, not one version three times
    // (the synthetic updates are small: the loss moves, the accuracy may
    // not).
    losses.dedup();
    ensure!(losses.len() == 3, "rounds share a central loss: {losses:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_round_is_evaluated_centrally_on_sqlite() -> Result<()> {
    every_round_is_evaluated_centrally(Database::Sqlite).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_round_is_evaluated_centrally_on_postgres() -> Result<()> {
    every_round_is_evaluated_centrally(Database::Postgres).await
}

/// A slow tick leaves the succeeded round pending (central evaluation
/// looks for work once per tick, and the orchestrator acts on uploads at
/// once), so the server is killed between the round's success and its
/// evaluation; after a restart with the normal tick it is evaluated and
/// the job completes.
async fn central_evaluation_survives_a_kill(database: Database) -> Result<()> {
    let work = tempfile::tempdir()?;
    let config = work.path().join("canopy.toml");
    std::fs::write(&config, "[limits]\norchestrator_tick_ms = 600000\n")?;
    let config_arg = config.to_string_lossy().into_owned();
    let mut server = TestServer::start_with(database, &["--config", &config_arg])?;
    let admin = server.admin();
    let (version_id, devices) = setup(&server, 5).await?;
    let job = admin.create_job(spec(version_id, 1, "digits")).await?;
    let round_id = run_round(&devices, 1).await?;
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let round = admin.ok(&format!("/api/v1/rounds/{round_id}")).await?;
        if round["state"] == "succeeded" {
            ensure!(
                round["metrics"]["central_eval_state"] == "pending",
                "{round}"
            );
            ensure!(
                round["metrics"]["central_eval_accuracy"].is_null(),
                "{round}"
            );
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "the round never succeeded: {round}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let view = admin.ok(&format!("/api/v1/jobs/{job}")).await?;
    ensure!(
        view["state"] == "running",
        "completed before its central evaluation: {view}"
    );

    server.kill9();
    std::fs::write(&config, "[limits]\norchestrator_tick_ms = 100\n")?;
    server.restart()?;
    let admin = server.admin();
    let finished = admin.wait_for_job(job, TIMEOUT).await?;
    ensure!(finished["state"] == "completed", "{finished}");
    let round = admin.ok(&format!("/api/v1/rounds/{round_id}")).await?;
    let digits = load_csv(digits_path(), LabelColumn::Last)?;
    ensure_central_matches(&admin, &round, &digits).await?;
    ensure!(
        server.log().contains("central evaluation stored"),
        "the restarted server did not log the evaluation"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn central_evaluation_survives_a_kill_on_sqlite() -> Result<()> {
    central_evaluation_survives_a_kill(Database::Sqlite).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn central_evaluation_survives_a_kill_on_postgres() -> Result<()> {
    central_evaluation_survives_a_kill(Database::Postgres).await
}

/// Labels the model has no class for: the evaluation is recorded as
/// failed, with the engine's reason, and the job still completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_central_evaluation_is_recorded_and_the_job_completes() -> Result<()> {
    let server = TestServer::start(Database::Sqlite)?;
    let admin = server.admin();
    let (version_id, devices) = setup(&server, 6).await?;
    // 64 features, labels 0..=20 for a 10-class model.
    let rows: String = (0..21)
        .map(|label| {
            let features: Vec<String> = (0..64).map(|i| ((i + label) % 16).to_string()).collect();
            format!("{},{label}\n", features.join(","))
        })
        .collect();
    let reply = put_dataset(&admin, "many-classes", rows.into_bytes()).await?;
    ensure!(reply.status == 201, "{}", reply.body);
    let job = admin
        .create_job(spec(version_id, 1, "many-classes"))
        .await?;
    let round_id = run_round(&devices, 1).await?;
    let finished = admin.wait_for_job(job, TIMEOUT).await?;
    ensure!(finished["state"] == "completed", "{finished}");
    let round = admin.ok(&format!("/api/v1/rounds/{round_id}")).await?;
    let metrics = &round["metrics"];
    ensure!(metrics["central_eval_state"] == "failed", "{metrics}");
    ensure!(metrics["central_eval_accuracy"].is_null(), "{metrics}");
    let reason = metrics["central_eval_error"].as_str().unwrap_or_default();
    ensure!(
        reason.contains("`many-classes`")
            && reason.contains("label 10")
            && reason.contains("10 classes"),
        "{reason}"
    );
    Ok(())
}
