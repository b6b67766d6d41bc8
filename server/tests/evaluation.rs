//! Federated evaluation through a real server: after each round, devices
//! evaluate the version that round produced on their held-out data, and
//! the round's metrics carry that accuracy, equal to evaluating the
//! downloaded version on the same data here; reports are checked, late or
//! repeated ones refused, and a job completes only once its last version's
//! evaluation has closed.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use bytes::Bytes;
use canopy_engine::data::{Dataset, LabelColumn, load_csv};
use canopy_protocol::messages::{Task, TaskKind};
use canopy_protocol::update::encode_update;
use canopy_sdk::DeviceClient;
use canopy_sdk::train::{EvalOptions, Evaluation, read_model};
use serde_json::{Value, json};

use crate::support::{
    Database, TestServer, enroll_device, fetch_model, logreg_model_bytes, poll_task,
};

const TIMEOUT: Duration = Duration::from_secs(60);

/// Three disjoint held-out sets from the bundled digits, one per device.
fn held_out_sets() -> Result<Vec<Dataset>> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../datasets/digits/digits.csv.gz");
    let data = load_csv(path, LabelColumn::Last)?;
    let n = data.len();
    Ok((0..3)
        .map(|i| data.subset(&(i * n / 10..(i + 1) * n / 10 - i * 7).collect::<Vec<_>>()))
        .collect())
}

fn spec(version_id: i64, rounds: u32, evaluation_deadline_ms: u64) -> Value {
    json!({
        "name": "federated-evaluation", "model_version_id": version_id, "rounds": rounds,
        "min_devices": 3, "target_devices": 3, "over_selection": 0.0,
        "round_deadline_ms": 60_000, "local_epochs": 1, "batch_size": 8, "learning_rate": 0.1,
        "evaluation": {"fraction": 1.0, "deadline_ms": evaluation_deadline_ms},
    })
}

/// Uploads a small deterministic update for a training task.
async fn train(device: &DeviceClient, task: &Task) -> Result<()> {
    ensure!(
        task.kind == TaskKind::Train,
        "expected a training task, got {task:?}"
    );
    device.download_model(task).await?;
    let values: Vec<f32> = (0..task.layout.num_elements())
        .map(|i| ((i as i64 * 37 + device.device_id * 11) % 19 - 9) as f32 * 1e-3)
        .collect();
    let encoded = encode_update(&task.layout, 20, &values)?;
    device.upload_update(task, Bytes::from(encoded)).await?;
    Ok(())
}

async fn evaluate(device: &DeviceClient, task: &Task, data: &Dataset) -> Result<Evaluation> {
    ensure!(
        task.kind == TaskKind::Evaluate,
        "expected an evaluation task, got {task:?}"
    );
    let model = device.download_model(task).await?;
    let model = read_model(&model.bytes)?;
    let evaluation = canopy_sdk::train::evaluate(&model, data, &EvalOptions::default())?;
    device.report_evaluation(task, &evaluation).await?;
    Ok(evaluation)
}

async fn round_view(server: &TestServer, round_id: i64) -> Result<Value> {
    server
        .admin()
        .ok(&format!("/api/v1/rounds/{round_id}"))
        .await
}

async fn wait_for(
    server: &TestServer,
    round_id: i64,
    what: &str,
    done: impl Fn(&Value) -> bool,
) -> Result<Value> {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let round = round_view(server, round_id).await?;
        if done(&round) {
            return Ok(round);
        }
        ensure!(Instant::now() < deadline, "{what} never happened: {round}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9
}

async fn every_version_is_evaluated(database: Database) -> Result<()> {
    let server = TestServer::start(database)?;
    let admin = server.admin();
    let version = admin.upload_model("logreg", logreg_model_bytes(4)).await?;
    let token = admin.enrollment_token(3).await?;
    let mut devices = Vec::new();
    for _ in 0..3 {
        devices.push(enroll_device(&server, &token).await?);
    }
    let held_out = held_out_sets()?;
    let job = admin
        .create_job(spec(version["id"].as_i64().unwrap_or_default(), 2, 60_000))
        .await?;

    for round in 1..=2u32 {
        let mut round_id = 0;
        for device in &devices {
            let task = poll_task(device).await?;
            ensure!(
                task.round_number == round,
                "round {} instead of {round}",
                task.round_number
            );
            round_id = task.round_id;
            train(device, &task).await?;
        }
        let view = wait_for(&server, round_id, "the round's evaluation opening", |r| {
            r["metrics"]["federated_eval_state"] == "open"
        })
        .await?;
        let produced = view["result_version_id"].as_i64().unwrap_or_default();
        // Every device is asked to evaluate the new version before it
        // trains again.
        let mut reports = Vec::new();
        for (device, data) in devices.iter().zip(&held_out) {
            let task = poll_task(device).await?;
            ensure!(
                task.round_id == round_id && task.model_version_id == produced,
                "{task:?}"
            );
            reports.push(evaluate(device, &task, data).await?);
        }
        let job_view = admin.ok(&format!("/api/v1/jobs/{job}")).await?;
        if round == 2 {
            // Round 2 was the last, but its version was still being
            // evaluated a moment ago; the job completes once that closes.
            ensure!(
                job_view["state"] == "running" || job_view["state"] == "completed",
                "{job_view}"
            );
        }
        let view = wait_for(&server, round_id, "the evaluation closing", |r| {
            r["metrics"]["federated_eval_state"] == "closed"
        })
        .await?;
        let metrics = &view["metrics"];
        // The round's accuracy is the sample-weighted mean of the reports...
        let samples: u64 = reports.iter().map(|r| r.samples).sum();
        let weighted: f64 = reports
            .iter()
            .map(|r| r.accuracy * r.samples as f64)
            .sum::<f64>()
            / samples as f64;
        let reported = metrics["federated_eval_accuracy"].as_f64().unwrap_or(-1.0);
        ensure!(
            close(reported, weighted),
            "round {round}: server {reported}, reports {weighted}"
        );
        ensure!(metrics["federated_eval_devices"] == 3, "{metrics}");
        ensure!(metrics["federated_eval_samples"] == samples, "{metrics}");
        // ... which is the produced version's accuracy on all the devices'
        // held-out data, computed here from the version downloaded.
        let model = fetch_model(&admin, "logreg", i64::from(round) + 1).await?;
        let (mut correct, mut total) = (0.0, 0u64);
        for data in &held_out {
            let e = canopy_sdk::train::evaluate(&model, data, &EvalOptions::default())?;
            correct += e.accuracy * e.samples as f64;
            total += e.samples;
        }
        ensure!(
            close(reported, correct / total as f64),
            "round {round}: {reported} vs {}",
            correct / total as f64
        );
    }
    let finished = admin.wait_for_job(job, TIMEOUT).await?;
    ensure!(finished["state"] == "completed", "{finished}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_version_is_evaluated_on_sqlite() -> Result<()> {
    every_version_is_evaluated(Database::Sqlite).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_version_is_evaluated_on_postgres() -> Result<()> {
    every_version_is_evaluated(Database::Postgres).await
}

/// Declines, silence, repeats, late and bad reports; the job waits for the
/// last version's evaluation to close before it completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evaluators_that_decline_or_stay_silent_are_dropped() -> Result<()> {
    let server = TestServer::start(Database::Sqlite)?;
    let admin = server.admin();
    let version = admin.upload_model("logreg", logreg_model_bytes(5)).await?;
    let token = admin.enrollment_token(3).await?;
    let mut devices = Vec::new();
    for _ in 0..3 {
        devices.push(enroll_device(&server, &token).await?);
    }
    let held_out = held_out_sets()?;
    let job = admin
        .create_job(spec(version["id"].as_i64().unwrap_or_default(), 1, 3_000))
        .await?;
    let mut round_id = 0;
    for device in &devices {
        let task = poll_task(device).await?;
        round_id = task.round_id;
        train(device, &task).await?;
    }
    let tasks = [
        poll_task(&devices[0]).await?,
        poll_task(&devices[1]).await?,
        poll_task(&devices[2]).await?,
    ];
    let first = evaluate(&devices[0], &tasks[0], &held_out[0]).await?;
    // A repeated report counts as sent (409 is "already have it").
    devices[0].report_evaluation(&tasks[0], &first).await?;
    devices[1]
        .decline_task(&tasks[1], "local dataset `digits` has no held-out samples")
        .await?;
    // Device 2 stays silent; the evaluation is still open, so the job,
    // whose only round has succeeded, is not complete yet.
    let job_view = admin.ok(&format!("/api/v1/jobs/{job}")).await?;
    ensure!(
        job_view["state"] == "running",
        "completed before its evaluation closed: {job_view}"
    );
    // Out-of-bounds values are refused before anything is stored.
    let bad = Evaluation {
        loss: 0.5,
        accuracy: 1.5,
        samples: 3,
    };
    let refused = devices[2].report_evaluation(&tasks[2], &bad).await;
    ensure!(refused.is_err(), "an accuracy of 1.5 was accepted");
    let view = wait_for(&server, round_id, "the evaluation deadline", |r| {
        r["metrics"]["federated_eval_state"] == "closed"
    })
    .await?;
    let metrics = &view["metrics"];
    ensure!(metrics["federated_eval_devices"] == 1, "{metrics}");
    ensure!(metrics["federated_eval_dropouts"] == 2, "{metrics}");
    ensure!(
        close(
            metrics["federated_eval_accuracy"].as_f64().unwrap_or(-1.0),
            first.accuracy
        ),
        "{metrics}"
    );
    // Too late now: 410, and the version is no longer the device's to download.
    let late = devices[2]
        .report_evaluation(
            &tasks[2],
            &Evaluation {
                loss: 0.5,
                accuracy: 0.5,
                samples: 3,
            },
        )
        .await;
    ensure!(
        late.as_ref().err().and_then(|e| e.status()) == Some(410),
        "late report: {late:?}"
    );
    let download = devices[2].download_model(&tasks[2]).await;
    ensure!(
        download.as_ref().err().and_then(|e| e.status()) == Some(404),
        "download after close: {:?}",
        download.err()
    );
    let finished = admin.wait_for_job(job, TIMEOUT).await?;
    ensure!(finished["state"] == "completed", "{finished}");
    Ok(())
}

/// With `fraction` 0 nobody is asked, and the job completes with its last round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn federated_evaluation_can_be_turned_off() -> Result<()> {
    let server = TestServer::start(Database::Sqlite)?;
    let admin = server.admin();
    let version = admin.upload_model("logreg", logreg_model_bytes(6)).await?;
    let token = admin.enrollment_token(3).await?;
    let mut devices = Vec::new();
    for _ in 0..3 {
        devices.push(enroll_device(&server, &token).await?);
    }
    let mut body = spec(version["id"].as_i64().unwrap_or_default(), 1, 60_000);
    body["evaluation"] = json!({"fraction": 0.0});
    let job = admin.create_job(body).await?;
    let mut round_id = 0;
    for device in &devices {
        let task = poll_task(device).await?;
        round_id = task.round_id;
        train(device, &task).await?;
    }
    let finished = admin.wait_for_job(job, TIMEOUT).await?;
    ensure!(finished["state"] == "completed", "{finished}");
    let metrics = round_view(&server, round_id).await?["metrics"].clone();
    ensure!(metrics["federated_eval_state"].is_null(), "{metrics}");
    ensure!(metrics["federated_eval_accuracy"].is_null(), "{metrics}");
    ensure!(
        devices[0].next_task(500).await?.is_none(),
        "a task after the job completed"
    );
    Ok(())
}
