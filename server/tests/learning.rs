//! Devices that really learn: five devices hold non-IID shards of the UCI
//! digits, train the shipped `train_step` locally through `canopy-sdk`, and
//! the server's FedAvg versions get better on held-out data round by round.

use std::path::Path;
use std::time::Duration;

use anyhow::Result;
use bytes::Bytes;
use canopy_engine::data::{Dataset, LabelColumn, load_csv, partition_dirichlet};
use canopy_engine::zoo::{Architecture, ModelConfig, build_model, fit_input_stats};
use canopy_protocol::messages::RoundMetrics;
use canopy_sdk::DeviceClient;
use serde_json::json;

use crate::support::{Database, TestServer, enroll_device, fetch_model};

const DEVICES: usize = 5;
const ROUNDS: u32 = 4;

fn digits() -> Result<(Dataset, Dataset)> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../datasets/digits/digits.csv.gz");
    let data = load_csv(path, LabelColumn::Last)?;
    Ok(data.split(0.2, 17)?)
}

/// A device's loop: poll, download (verified), train locally, upload,
/// report; until the job has no more work for it.
async fn device_loop(device: DeviceClient, shard: Dataset, seed: u64) -> Result<usize> {
    let mut rounds = 0;
    let mut idle_polls = 0;
    while idle_polls < 3 {
        let Some(task) = device.next_task(2_000).await? else {
            idle_polls += 1;
            continue;
        };
        idle_polls = 0;
        let model = device.download_model(&task).await?;
        let (task_copy, data) = (task.clone(), shard.clone());
        let update = tokio::task::spawn_blocking(move || {
            canopy_sdk::train::train_task(
                &model.bytes,
                &task_copy,
                &data,
                seed + u64::from(task_copy.round_number),
                &canopy_sdk::train::TrainOptions::default(),
            )
        })
        .await??;
        device
            .upload_update(&task, Bytes::from(update.encoded))
            .await?;
        device
            .report_metrics(&RoundMetrics {
                round_id: task.round_id,
                train_loss: Some(update.train_loss),
                eval_loss: None,
                eval_accuracy: None,
                eval_samples: None,
                train_duration_ms: Some(update.train_duration_ms),
            })
            .await?;
        rounds += 1;
    }
    Ok(rounds)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn federated_training_on_non_iid_digits_improves_held_out_accuracy() -> Result<()> {
    let (train, test) = digits()?;
    let shards = partition_dirichlet(&train, DEVICES, 0.5, 3)?;
    let mut model = build_model(&ModelConfig {
        architecture: Architecture::LogReg {
            inputs: 64,
            classes: 10,
        },
        seed: 1,
        optimizer: canopy_engine::optim::Optimizer::parse("sgd")?,
        frozen_prefixes: Vec::new(),
        producer: "learning test".to_string(),
    })?;
    // The cloud fits the input statistics once (frozen parameters that
    // never travel in updates); devices need no preprocessing code.
    fit_input_stats(&mut model, &train)?;
    let server = TestServer::start(Database::Sqlite)?;
    let admin = server.admin();
    let version = admin
        .upload_model("digits", canopy_ir::format::write_model(&model)?)
        .await?;
    let token = admin.enrollment_token(DEVICES as u32).await?;
    let mut workers = Vec::new();
    for (index, shard) in shards.into_iter().enumerate() {
        let device = enroll_device(&server, &token).await?;
        workers.push(tokio::spawn(device_loop(device, shard, 100 * index as u64)));
    }
    let job = admin
        .create_job(json!({
            "name": "digits", "model_version_id": version["id"], "rounds": ROUNDS,
            "min_devices": DEVICES, "target_devices": DEVICES, "over_selection": 0.0,
            "evaluation": {"fraction": 0.0}, "round_deadline_ms": 60_000, "local_epochs": 2, "batch_size": 16, "learning_rate": 0.1,
        }))
        .await?;
    let finished = admin.wait_for_job(job, Duration::from_secs(180)).await?;
    assert_eq!(finished["state"], "completed", "{finished}");
    for worker in workers {
        assert_eq!(
            worker.await??,
            ROUNDS as usize,
            "every device trained every round"
        );
    }
    let mut accuracies = Vec::new();
    for version in 1..=i64::from(ROUNDS) + 1 {
        let model = fetch_model(&admin, "digits", version).await?;
        accuracies.push(
            canopy_sdk::train::evaluate(&model, &test, &canopy_sdk::train::EvalOptions::default())?
                .accuracy,
        );
    }
    eprintln!("held-out accuracy by version: {accuracies:?}");
    assert!(
        accuracies[0] < 0.3,
        "the untrained model guesses: {accuracies:?}"
    );
    assert!(
        accuracies[ROUNDS as usize] > 0.85,
        "FedAvg learns the digits: {accuracies:?}"
    );
    assert!(
        accuracies[ROUNDS as usize] > accuracies[1],
        "accuracy rises over rounds: {accuracies:?}"
    );
    let rounds = admin.ok(&format!("/api/v1/jobs/{job}/rounds")).await?;
    let losses: Vec<f64> = rounds["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| r["metrics"]["train_loss"].as_f64())
        .collect();
    assert_eq!(
        losses.len(),
        ROUNDS as usize,
        "every round reports a train loss: {rounds}"
    );
    assert!(
        losses[ROUNDS as usize - 1] < losses[0],
        "the devices' train loss falls: {losses:?}"
    );
    Ok(())
}
