//! Datasets per job through a real server: devices report the datasets
//! they registered in their heartbeats; a job that names one runs only on
//! the devices that have it (with samples that fit the model), tasks name
//! it, and when no device fits, the job's status says why before any
//! round is spent.

use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use bytes::Bytes;
use canopy_engine::zoo::Architecture;
use canopy_protocol::messages::{DatasetInfo, Heartbeat};
use canopy_protocol::update::encode_update;
use canopy_sdk::DeviceClient;
use serde_json::{Value, json};

use crate::support::{
    Database, TestServer, enroll_device, logreg_model_bytes, model_bytes, poll_task,
};

const TIMEOUT: Duration = Duration::from_secs(60);

fn dataset(name: &str, sample_shape: &[u64]) -> DatasetInfo {
    DatasetInfo {
        name: name.to_string(),
        samples: 500,
        sample_shape: sample_shape.to_vec(),
        classes: 10,
    }
}

async fn report(device: &DeviceClient, datasets: Vec<DatasetInfo>) -> Result<()> {
    device
        .heartbeat(&Heartbeat {
            state: Some("idle".into()),
            datasets: Some(datasets),
            ..Heartbeat::default()
        })
        .await?;
    Ok(())
}

fn spec(version_id: i64, dataset: &str, devices: u32) -> Value {
    json!({
        "name": "datasets-per-job", "model_version_id": version_id, "rounds": 1,
        "min_devices": devices, "target_devices": devices, "over_selection": 0.0,
        "round_deadline_ms": 60_000, "local_epochs": 1, "batch_size": 8, "learning_rate": 0.1,
        "dataset": dataset, "evaluation": {"fraction": 0.0},
    })
}

async fn job_status_containing(server: &TestServer, job_id: i64, text: &str) -> Result<Value> {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let job = server.admin().ok(&format!("/api/v1/jobs/{job_id}")).await?;
        if job["status_message"]
            .as_str()
            .is_some_and(|m| m.contains(text))
        {
            return Ok(job);
        }
        ensure!(
            Instant::now() < deadline,
            "the job's status never said `{text}`: {job}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn runs_on_devices_that_have_it(database: Database) -> Result<()> {
    let server = TestServer::start(database)?;
    let admin = server.admin();
    let version = admin.upload_model("logreg", logreg_model_bytes(4)).await?;
    let token = admin.enrollment_token(4).await?;
    let mut with = Vec::new();
    for _ in 0..2 {
        let device = enroll_device(&server, &token).await?;
        report(
            &device,
            vec![dataset("other", &[8, 8]), dataset("digits", &[64])],
        )
        .await?;
        with.push(device);
    }
    let without = enroll_device(&server, &token).await?;
    report(&without, vec![dataset("other", &[64])]).await?;
    let wrong_shape = enroll_device(&server, &token).await?;
    report(&wrong_shape, vec![dataset("digits", &[32])]).await?;

    let listed = admin
        .ok(&format!("/api/v1/devices/{}", with[0].device_id))
        .await?;
    ensure!(
        listed["datasets"][1]["name"] == "digits"
            && listed["datasets"][1]["sample_shape"] == json!([64]),
        "the device view does not show the reported datasets: {listed}"
    );

    let job = admin
        .create_job(spec(
            version["id"].as_i64().unwrap_or_default(),
            "digits",
            2,
        ))
        .await?;
    for device in &with {
        let task = poll_task(device).await?;
        ensure!(
            task.dataset.as_deref() == Some("digits"),
            "the task does not name the job's dataset: {task:?}"
        );
        device.download_model(&task).await?;
        let values = vec![0.001f32; task.layout.num_elements()];
        let encoded = encode_update(&task.layout, 10, &values)?;
        device.upload_update(&task, Bytes::from(encoded)).await?;
    }
    for device in [&without, &wrong_shape] {
        ensure!(
            device.next_task(500).await?.is_none(),
            "device {} without a fitting `digits` was handed a task",
            device.device_id
        );
    }
    let done = admin.wait_for_job(job, TIMEOUT).await?;
    ensure!(
        done["state"] == "completed",
        "the job did not complete: {done}"
    );
    Ok(())
}

/// A LeNet-5 takes `[1, 28, 28]` images; every device's `digits` has
/// 64 features: the job waits, saying so, instead of dropping devices.
async fn status_says_when_no_device_fits(database: Database) -> Result<()> {
    let server = TestServer::start(database)?;
    let admin = server.admin();
    let lenet = model_bytes(Architecture::LeNet5 { classes: 10 }, 1);
    let version = admin.upload_model("lenet", lenet).await?;
    let token = admin.enrollment_token(3).await?;
    let mut devices = Vec::new();
    for _ in 0..2 {
        let device = enroll_device(&server, &token).await?;
        report(&device, vec![dataset("digits", &[64])]).await?;
        devices.push(device);
    }
    let lacking = enroll_device(&server, &token).await?;
    report(&lacking, vec![dataset("mnist", &[1, 28, 28])]).await?;
    let job = admin
        .create_job(spec(
            version["id"].as_i64().unwrap_or_default(),
            "digits",
            2,
        ))
        .await?;
    let waiting = job_status_containing(&server, job, "0 eligible online").await?;
    let status = waiting["status_message"].as_str().unwrap_or_default();
    for expected in [
        "1 lack dataset `digits`",
        "2 have `digits` with samples of shape [64], but the model takes [1, 28, 28]",
    ] {
        ensure!(
            status.contains(expected),
            "the job's status `{status}` does not say `{expected}`"
        );
    }
    for device in devices.iter().chain([&lacking]) {
        ensure!(
            device.next_task(300).await?.is_none(),
            "device {} was handed a task for a model its data does not fit",
            device.device_id
        );
    }
    let rounds = admin.ok(&format!("/api/v1/jobs/{job}/rounds")).await?;
    ensure!(
        !rounds.to_string().contains("\"failed\""),
        "a round was spent on devices whose data does not fit: {rounds}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_on_devices_that_have_it_on_sqlite() -> Result<()> {
    runs_on_devices_that_have_it(Database::Sqlite).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_on_devices_that_have_it_on_postgres() -> Result<()> {
    runs_on_devices_that_have_it(Database::Postgres).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_says_when_no_device_fits_on_sqlite() -> Result<()> {
    status_says_when_no_device_fits(Database::Sqlite).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_says_when_no_device_fits_on_postgres() -> Result<()> {
    status_says_when_no_device_fits(Database::Postgres).await
}
