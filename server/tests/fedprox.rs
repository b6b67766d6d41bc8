//! FedProx through a real server: the server derives the proximal
//! `train_step` from the model's `train_loss` once, as a version of the
//! job whose parent is the model; devices train it unchanged (the anchors
//! are the downloaded parameters), and a job over a model without
//! `train_loss` is refused with the reason.

use std::path::Path;
use std::time::Duration;

use anyhow::{Result, ensure};
use bytes::Bytes;
use canopy_engine::data::{Dataset, LabelColumn, load_csv};
use canopy_engine::proximal::{ANCHOR_PREFIX, make_proximal, proximal_mu};
use canopy_engine::zoo::ENTRY_TRAIN_LOSS;
use canopy_ir::model::ENTRY_TRAIN_STEP;
use canopy_sdk::train::{TrainOptions, train_task};
use serde_json::{Value, json};

use crate::support::{Database, TestServer, enroll_device, logreg_model_bytes, poll_task};

const TIMEOUT: Duration = Duration::from_secs(60);
const MU: f64 = 0.5;

fn shards() -> Result<Vec<Dataset>> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../datasets/digits/digits.csv.gz");
    let data = load_csv(path, LabelColumn::Last)?;
    Ok((0..2)
        .map(|i| data.subset(&(i * 200..(i + 1) * 200).collect::<Vec<_>>()))
        .collect())
}

fn spec(version_id: i64) -> Value {
    json!({
        "name": "fedprox", "model_version_id": version_id, "rounds": 2,
        "min_devices": 2, "target_devices": 2, "over_selection": 0.0,
        "round_deadline_ms": 60_000, "local_epochs": 1, "batch_size": 16, "learning_rate": 0.1,
        "evaluation": {"fraction": 0.0},
        "strategy": {"name": "fedprox", "proximal_mu": MU},
    })
}

async fn devices_train_the_derived_step(database: Database) -> Result<()> {
    let server = TestServer::start(database)?;
    let admin = server.admin();
    let original = logreg_model_bytes(4);
    let uploaded = admin.upload_model("logreg", original.clone()).await?;
    let original_id = uploaded["id"].as_i64().unwrap_or_default();
    let token = admin.enrollment_token(2).await?;
    let devices = [
        enroll_device(&server, &token).await?,
        enroll_device(&server, &token).await?,
    ];
    let data = shards()?;
    let job = admin.create_job(spec(original_id)).await?;

    // What the server should have derived, computed here.
    let mut expected = canopy_ir::format::read_model(&original)?;
    make_proximal(&mut expected, MU)?;
    let expected_bytes = canopy_ir::format::write_model(&expected)?;

    for round in 1..=2u32 {
        for (device, shard) in devices.iter().zip(&data) {
            let task = poll_task(device).await?;
            ensure!(
                task.round_number == round,
                "round {} instead of {round}",
                task.round_number
            );
            let model = device.download_model(&task).await?;
            let downloaded = canopy_ir::format::read_model(&model.bytes)?;
            ensure!(
                proximal_mu(&downloaded)? == Some(MU),
                "round {round}: the model devices train is not proximal"
            );
            let anchors = downloaded
                .entry(ENTRY_TRAIN_STEP)?
                .input_names()
                .iter()
                .filter(|n| n.starts_with(ANCHOR_PREFIX))
                .count();
            ensure!(
                anchors == downloaded.trainable_names().len(),
                "{anchors} anchors"
            );
            let seed = device.device_id as u64;
            let update = train_task(&model.bytes, &task, shard, seed, &TrainOptions::default())?;
            if round == 1 {
                ensure!(
                    task.model_version_id != original_id,
                    "round 1 trains the uploaded version, not a derived one"
                );
                let independent = train_task(
                    &expected_bytes,
                    &task,
                    shard,
                    seed,
                    &TrainOptions::default(),
                )?;
                ensure!(
                    independent.encoded == update.encoded,
                    "the server's proximal step trains differently from make_proximal here"
                );
            }
            device
                .upload_update(&task, Bytes::from(update.encoded))
                .await?;
        }
    }
    let done = admin.wait_for_job(job, TIMEOUT).await?;
    ensure!(done["state"] == "completed", "{done}");
    let versions = admin.ok("/api/v1/models/logreg/versions").await?;
    let items = versions["items"].as_array().cloned().unwrap_or_default();
    let derived = items
        .iter()
        .find(|v| v["version"] == 2)
        .cloned()
        .unwrap_or(Value::Null);
    ensure!(
        derived["parent_version_id"] == original_id && derived["produced_by_job"] == job,
        "the derived version's lineage: {derived}"
    );
    ensure!(
        items.len() == 4,
        "versions: uploaded, derived and one per round: {versions}"
    );
    Ok(())
}

async fn a_model_without_train_loss_is_refused(database: Database) -> Result<()> {
    let server = TestServer::start(database)?;
    let admin = server.admin();
    let mut model = canopy_ir::format::read_model(&logreg_model_bytes(4))?;
    model.entry_points.remove(ENTRY_TRAIN_LOSS);
    let uploaded = admin
        .upload_model("no-loss", canopy_ir::format::write_model(&model)?)
        .await?;
    let reply = admin
        .post(
            "/api/v1/jobs",
            spec(uploaded["id"].as_i64().unwrap_or_default()),
        )
        .await?;
    let message = reply.body["error"]["message"].as_str().unwrap_or_default();
    ensure!(
        reply.status == 422
            && message.contains("model `no-loss` version 1")
            && message.contains(ENTRY_TRAIN_LOSS)
            && message.contains("hint:"),
        "{} {}",
        reply.status,
        reply.body
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn devices_train_the_derived_step_on_sqlite() -> Result<()> {
    devices_train_the_derived_step(Database::Sqlite).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn devices_train_the_derived_step_on_postgres() -> Result<()> {
    devices_train_the_derived_step(Database::Postgres).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_without_train_loss_is_refused_on_sqlite() -> Result<()> {
    a_model_without_train_loss_is_refused(Database::Sqlite).await
}
