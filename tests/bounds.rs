//! A real server made to send a task beyond the bounds every device checks
//! (`canopy_protocol::bounds`): the job is created through the API, which
//! validates it, and its stored settings are then edited in the database,
//! as a buggy or compromised server would send them. The SDK refuses the
//! task, naming the field, before downloading or training anything.

#[path = "../server/tests/support/mod.rs"]
mod support;

use anyhow::{Context, Result, bail, ensure};
use canopy_engine::data::Dataset;
use canopy_protocol::bounds::MAX_EPOCHS;
use canopy_sdk::SdkError;
use canopy_sdk::train::{TrainError, TrainOptions, train_task};
use serde_json::{Value, json};
use support::{Admin, Database, TestServer, enroll_device, logreg_model_bytes, poll_task};

fn job_spec(version_id: &Value) -> Value {
    json!({
        "name": "bounds", "model_version_id": version_id, "rounds": 1,
        "min_devices": 1, "target_devices": 1, "over_selection": 0.0,
        "evaluation": {"fraction": 0.0}, "round_deadline_ms": 120_000, "local_epochs": 1, "batch_size": 16, "learning_rate": 0.1,
    })
}

/// Bytes the server has sent for the job's first round's model.
async fn bytes_out(admin: &Admin, job: i64) -> Result<i64> {
    let rounds = admin.ok(&format!("/api/v1/jobs/{job}/rounds")).await?;
    let round = rounds["items"][0]["id"].as_i64().context("no round")?;
    let detail = admin.ok(&format!("/api/v1/rounds/{round}")).await?;
    detail["metrics"]["bytes_out"]
        .as_i64()
        .with_context(|| format!("no bytes_out: {detail}"))
}

/// A dataset shaped for `logreg_model_bytes`: 64 features, 10 classes.
fn data() -> Result<Dataset> {
    let samples = 32;
    let features = (0..samples * 64).map(|i| (i % 13) as f32 / 13.0).collect();
    let labels = (0..samples).map(|i| (i % 10) as i64).collect();
    Ok(Dataset::new(features, vec![64], labels, 10)?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_refuses_a_task_beyond_the_shared_bounds() -> Result<()> {
    let server = TestServer::start(Database::Postgres)?;
    let admin = server.admin();
    let model = logreg_model_bytes(1);
    let version = admin.upload_model("logreg", model.clone()).await?;
    let token = admin.enrollment_token(1).await?;
    let device = enroll_device(&server, &token).await?;
    let job = admin.create_job(job_spec(&version["id"])).await?;
    let epochs = MAX_EPOCHS * 5;
    canopy_e2e::tamper_job_setting(
        &server.database_url,
        job,
        "local_epochs",
        &epochs.to_string(),
    )?;

    let task = poll_task(&device).await?;
    ensure!(
        task.training.epochs == epochs,
        "the server sent {:?}, not the tampered epochs",
        task.training
    );
    let error = match device.download_model(&task).await {
        Ok(_) => bail!("a task asking for {epochs} epochs was downloaded"),
        Err(error) => error,
    };
    let SdkError::InvalidTask { round_id, source } = &error else {
        bail!("expected InvalidTask, got {error:?}");
    };
    assert_eq!(*round_id, task.round_id);
    assert_eq!(source.field(), "training.epochs");
    assert!(error.to_string().contains("training.epochs"), "{error}");
    let dir = tempfile::tempdir()?;
    let to_file = device
        .download_model_to(&task, &dir.path().join("model"))
        .await;
    assert!(
        matches!(to_file, Err(SdkError::InvalidTask { .. })),
        "{to_file:?}"
    );
    assert_eq!(
        std::fs::read_dir(dir.path())?.count(),
        0,
        "not even a part file"
    );
    // Training refuses the task too, whatever model bytes it is given.
    let trained = train_task(&model, &task, &data()?, 1, &TrainOptions::default());
    assert!(
        matches!(&trained, Err(TrainError::InvalidTask(b)) if b.field() == "training.epochs"),
        "{trained:?}"
    );
    assert_eq!(bytes_out(&admin, job).await?, 0, "no model byte was sent");

    // With the setting restored the same device downloads the model, so
    // the count above would have shown a download.
    canopy_e2e::tamper_job_setting(&server.database_url, job, "local_epochs", "1")?;
    let task = poll_task(&device).await?;
    assert_eq!(task.training.epochs, 1);
    let downloaded = device.download_model(&task).await?;
    assert_eq!(downloaded.bytes.len(), model.len());
    assert_eq!(bytes_out(&admin, job).await?, model.len() as i64);
    Ok(())
}
