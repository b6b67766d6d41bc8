//! The federated statistics round through a real server: a job over a
//! model whose input statistics are unfitted first asks its devices for
//! the moments of their inputs (round 0, kind `statistics`), sums them,
//! and trains from a version with the statistics fitted, equal to fitting
//! them on all the devices' data at once; a report that cannot be moments
//! of real data is refused alone.

use std::path::Path;
use std::time::Duration;

use anyhow::{Result, ensure};
use bytes::Bytes;
use canopy_engine::data::{Dataset, LabelColumn, load_csv};
use canopy_engine::nn::{INPUT_MEAN, INPUT_STD};
use canopy_engine::stats::{InputMoments, InputStatsState};
use canopy_engine::zoo::{Architecture, ModelConfig, build_model};
use canopy_protocol::messages::TaskKind;
use canopy_protocol::update::{encode_update, statistics_layout};
use canopy_sdk::train::{TrainOptions, statistics_update, train_task};
use serde_json::json;

use crate::support::{Database, TestServer, enroll_device, poll_task};

const TIMEOUT: Duration = Duration::from_secs(60);

fn shards() -> Result<Vec<Dataset>> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../datasets/digits/digits.csv.gz");
    let data = load_csv(path, LabelColumn::Last)?;
    Ok((0..3)
        .map(|i| data.subset(&(i * 300..i * 300 + 100 + 50 * i).collect::<Vec<_>>()))
        .collect())
}

fn unfitted_model() -> Result<Vec<u8>> {
    let model = build_model(&ModelConfig {
        architecture: Architecture::Mlp {
            inputs: 64,
            hidden: 16,
            classes: 10,
        },
        seed: 3,
        optimizer: canopy_engine::optim::Optimizer::sgd(),
        frozen_prefixes: vec![],
        producer: "statistics test".into(),
    })?;
    ensure!(InputStatsState::of(&model) == InputStatsState::Unfitted);
    Ok(canopy_ir::format::write_model(&model)?)
}

fn scalar(model: &canopy_ir::Model, name: &str) -> f64 {
    model
        .parameter(name)
        .and_then(|p| p.data.as_f32())
        .and_then(|v| v.first().copied())
        .map(f64::from)
        .unwrap_or(f64::NAN)
}

async fn statistics_are_fitted_before_training(database: Database) -> Result<()> {
    let server = TestServer::start(database)?;
    let admin = server.admin();
    let uploaded = admin.upload_model("mlp", unfitted_model()?).await?;
    let original_id = uploaded["id"].as_i64().unwrap_or_default();
    let token = admin.enrollment_token(3).await?;
    let mut devices = Vec::new();
    for _ in 0..3 {
        devices.push(enroll_device(&server, &token).await?);
    }
    let data = shards()?;
    let job = admin
        .create_job(json!({
            "name": "statistics", "model_version_id": original_id, "rounds": 1,
            "min_devices": 3, "target_devices": 3, "over_selection": 0.0,
            "round_deadline_ms": 60_000, "local_epochs": 1, "batch_size": 16,
            "learning_rate": 0.1, "evaluation": {"fraction": 0.0},
        }))
        .await?;

    for (index, (device, shard)) in devices.iter().zip(&data).enumerate() {
        let task = poll_task(device).await?;
        ensure!(
            task.kind == TaskKind::Statistics && task.round_number == 0,
            "the first task is not the statistics round's: {task:?}"
        );
        ensure!(task.layout == statistics_layout(64)?, "{:?}", task.layout);
        let model = device.download_model(&task).await?;
        if index == 2 {
            // A mean of squares below the squared mean: no data has it.
            let mut bad = vec![1.0f32; 64];
            bad.extend(vec![0.5f32; 64]);
            let encoded = encode_update(&task.layout, 10, &bad)?;
            let refused = device.upload_update(&task, Bytes::from(encoded)).await;
            let message = format!(
                "{:?}",
                refused.expect_err("inconsistent moments are refused")
            );
            ensure!(message.contains("statistics for round"), "{message}");
        }
        let update = statistics_update(&model.bytes, &task, shard)?;
        device
            .upload_update(&task, Bytes::from(update.encoded))
            .await?;
    }

    let mut all = InputMoments::empty(64);
    for shard in &data {
        all.merge(&InputMoments::of(shard))?;
    }
    let expected = all.to_input_stats()?;
    for (device, shard) in devices.iter().zip(&data) {
        let task = poll_task(device).await?;
        ensure!(
            task.kind == TaskKind::Train && task.round_number == 1,
            "training does not follow the statistics round: {task:?}"
        );
        ensure!(
            task.model_version_id != original_id,
            "round 1 trains the unfitted model"
        );
        let model = device.download_model(&task).await?;
        let fitted = canopy_ir::format::read_model(&model.bytes)?;
        ensure!(InputStatsState::of(&fitted) == InputStatsState::Fitted);
        for (name, want) in [(INPUT_MEAN, expected.mean), (INPUT_STD, expected.std)] {
            let got = scalar(&fitted, name);
            ensure!(
                (got - f64::from(want)).abs() <= 1e-5 * f64::from(want).abs(),
                "{name}: fitted federatedly {got}, on all the data {want}"
            );
        }
        let update = train_task(&model.bytes, &task, shard, 1, &TrainOptions::default())?;
        device
            .upload_update(&task, Bytes::from(update.encoded))
            .await?;
    }
    let done = admin.wait_for_job(job, TIMEOUT).await?;
    ensure!(
        done["state"] == "completed" && done["rounds_completed"] == 1,
        "{done}"
    );
    let rounds = admin.ok(&format!("/api/v1/jobs/{job}/rounds")).await?;
    let kinds: Vec<(i64, String)> = rounds["items"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| {
            (
                r["number"].as_i64().unwrap_or(-1),
                r["kind"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect();
    ensure!(
        kinds == [(0, "statistics".to_string()), (1, "train".to_string())],
        "rounds: {kinds:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statistics_are_fitted_before_training_on_sqlite() -> Result<()> {
    statistics_are_fitted_before_training(Database::Sqlite).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statistics_are_fitted_before_training_on_postgres() -> Result<()> {
    statistics_are_fitted_before_training(Database::Postgres).await
}

/// Secure aggregation clips what devices send, so a secure job cannot fit
/// statistics federatedly: it is refused at creation, with the way out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secure_job_over_unfitted_statistics_is_refused() -> Result<()> {
    let server = TestServer::start(Database::Sqlite)?;
    let admin = server.admin();
    let uploaded = admin.upload_model("mlp", unfitted_model()?).await?;
    let reply = admin
        .post(
            "/api/v1/jobs",
            json!({
                "name": "secure", "model_version_id": uploaded["id"], "rounds": 1,
                "min_devices": 3, "target_devices": 3, "round_deadline_ms": 60_000,
                "local_epochs": 1, "batch_size": 16, "learning_rate": 0.1,
                "secure_aggregation": {"enabled": true},
            }),
        )
        .await?;
    let message = reply.body["error"]["message"].as_str().unwrap_or_default();
    ensure!(
        reply.status == 422
            && message.contains("unfitted input statistics")
            && message.contains("canopy model stats"),
        "{} {}",
        reply.status,
        reply.body
    );
    Ok(())
}
