//! Transfer learning end to end: LeNet-5 is pretrained in the cloud on the
//! MNIST digits 0–4, shipped with its convolutional backbone and first
//! dense layer frozen, and fine-tuned federatedly by devices that hold only
//! the digits 5–9. Only the head's parameters travel up.

#[path = "../server/tests/support/mod.rs"]
mod support;

use std::path::Path;
use std::time::Duration;

use anyhow::{Result, ensure};
use bytes::Bytes;
use canopy_engine::CpuBackend;
use canopy_engine::data::{Dataset, load_dir, partition_iid};
use canopy_engine::optim::Optimizer;
use canopy_engine::train::Trainer;
use canopy_engine::zoo::{
    Architecture, ModelConfig, build_model, fit_input_stats, rebuild_train_step, set_frozen,
};
use canopy_sdk::DeviceClient;
use serde_json::json;
use support::{Database, TestServer, enroll_device, fetch_model};

const DEVICES: usize = 4;
const ROUNDS: u32 = 8;
/// LeNet-5's head: fc2 (120×84 + 84) and fc3 (84×10 + 10).
const HEAD_ELEMENTS: usize = 120 * 84 + 84 + 84 * 10 + 10;

fn digits_in(data: &Dataset, labels: std::ops::RangeInclusive<i64>) -> Dataset {
    let indices: Vec<usize> = (0..data.len())
        .filter(|&i| labels.contains(&data.labels()[i]))
        .collect();
    data.subset(&indices)
}

/// The cloud's part: pretrain on 0–4, then freeze the backbone.
fn pretrained_backbone(train_low: &Dataset) -> Result<Vec<u8>> {
    let mut model = build_model(&ModelConfig {
        architecture: Architecture::LeNet5 { classes: 10 },
        seed: 11,
        optimizer: Optimizer::parse("sgd")?,
        frozen_prefixes: Vec::new(),
        producer: "transfer test".to_string(),
    })?;
    fit_input_stats(&mut model, train_low)?;
    let mut trainer = Trainer::new(&model, &CpuBackend, 11)?;
    for epoch in 0..2 {
        for batch in train_low.batches(64, Some(epoch), true)? {
            trainer.step(batch.x, batch.y, 0.05)?;
        }
    }
    trainer.write_back(&mut model)?;
    set_frozen(&mut model, &["conv".to_string(), "fc1".to_string()])?;
    rebuild_train_step(&mut model, &Optimizer::parse("sgd")?)?;
    Ok(canopy_ir::format::write_model(&model)?)
}

async fn fine_tune(device: DeviceClient, shard: Dataset, seed: u64) -> Result<Vec<u64>> {
    let mut upload_sizes = Vec::new();
    for _ in 0..ROUNDS {
        let task = loop {
            if let Some(task) = device.next_task(5_000).await? {
                break task;
            }
        };
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
        let receipt = device
            .upload_update(&task, Bytes::from(update.encoded))
            .await?;
        upload_sizes.push(receipt.bytes);
    }
    Ok(upload_sizes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_backbone_head_fine_tuned_federatedly_on_new_classes() -> Result<()> {
    let (train, test) =
        load_dir(Path::new(env!("CARGO_MANIFEST_DIR")).join("../datasets/mnist-10k"))?;
    let model_bytes = tokio::task::spawn_blocking({
        let low = digits_in(&train, 0..=4);
        move || pretrained_backbone(&low)
    })
    .await??;
    let full_model_elements = canopy_ir::format::read_model(&model_bytes)?
        .parameters
        .iter()
        .filter(|p| !p.name.starts_with("input."))
        .map(|p| p.data.num_elements())
        .sum::<usize>();
    let high_train = digits_in(&train, 5..=9);
    let high_test = digits_in(&test, 5..=9);

    let server = TestServer::start(Database::Sqlite)?;
    let admin = server.admin();
    let version = admin.upload_model("lenet-transfer", model_bytes).await?;
    assert_eq!(
        version["trainable_elements"], HEAD_ELEMENTS,
        "only the head is trainable: {version}"
    );
    let base = fetch_model(&admin, "lenet-transfer", 1).await?;
    let before = canopy_sdk::train::evaluate(
        &base,
        &high_test,
        &canopy_sdk::train::EvalOptions::default(),
    )?
    .accuracy;

    let token = admin.enrollment_token(DEVICES as u32).await?;
    let mut workers = Vec::new();
    for (index, shard) in partition_iid(&high_train, DEVICES, 5)?
        .into_iter()
        .enumerate()
    {
        let device = enroll_device(&server, &token).await?;
        workers.push(tokio::spawn(fine_tune(device, shard, 31 * index as u64)));
    }
    let job = admin
        .create_job(json!({
            "name": "transfer", "model_version_id": version["id"], "rounds": ROUNDS,
            "min_devices": DEVICES, "target_devices": DEVICES, "over_selection": 0.0,
            "evaluation": {"fraction": 0.0}, "round_deadline_ms": 120_000, "local_epochs": 2, "batch_size": 32, "learning_rate": 0.1,
        }))
        .await?;
    let finished = admin.wait_for_job(job, Duration::from_secs(300)).await?;
    ensure!(finished["state"] == "completed", "{finished}");
    let head_bytes = (HEAD_ELEMENTS * 4) as u64;
    for worker in workers {
        for size in worker.await?? {
            assert!(
                size >= head_bytes && size < head_bytes + 1024,
                "an upload is the head plus a small header: {size} bytes for a {head_bytes}-byte head"
            );
            assert!(
                size * 4 < (full_model_elements * 4) as u64,
                "far below the whole model's {full_model_elements} parameters"
            );
        }
    }
    let tuned = fetch_model(&admin, "lenet-transfer", i64::from(ROUNDS) + 1).await?;
    for (old, new) in base.parameters.iter().zip(&tuned.parameters) {
        if !old.trainable {
            assert_eq!(old.data, new.data, "frozen `{}` is untouched", old.name);
        }
    }
    let after = canopy_sdk::train::evaluate(
        &tuned,
        &high_test,
        &canopy_sdk::train::EvalOptions::default(),
    )?
    .accuracy;
    eprintln!(
        "accuracy on the digits 5-9: {before:.3} before fine-tuning, {after:.3} after {ROUNDS} rounds"
    );
    assert!(
        after >= 0.9,
        "fine-tuned head on the new classes: {after:.3} (before {before:.3})"
    );
    Ok(())
}
