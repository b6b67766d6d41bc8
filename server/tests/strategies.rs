//! Server optimizers and learning-rate schedules through a real server:
//! the models a FedAdam job writes equal FedAdam computed here,
//! independently, and a `kill -9` in the middle of the job changes nothing
//! (the optimizer's state is durable), on SQLite and on PostgreSQL.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Result, ensure};
use bytes::Bytes;
use canopy_ir::Buffer;
use canopy_protocol::messages::Task;
use canopy_protocol::update::{UpdateLayout, encode_update};
use canopy_sdk::DeviceClient;
use canopy_server::strategy::StrategyName;
use serde_json::{Value, json};

use crate::support::{
    Database, TestServer, enroll_device, fetch_model, logreg_model_bytes, poll_task,
};

const JOB_TIMEOUT: Duration = Duration::from_secs(120);
const DEVICES: usize = 4;
const ROUNDS: u32 = 5;
const BASE_LR: f64 = 0.2;
const LR_FACTOR: f64 = 0.5;

/// A deterministic update of one device in one round, with values of
/// either sign and different sizes, so that the adaptive second moment
/// differs per coordinate.
fn delta(layout: &UpdateLayout, device_id: i64, round: u32) -> Vec<f32> {
    let mut state =
        (device_id as u64 * 7919 + u64::from(round)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (0..layout.num_elements())
        .map(|i| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let unit = (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            unit * 0.02 * (1.0 + (i % 5) as f32)
        })
        .collect()
}

fn samples_of(device_id: i64) -> u64 {
    10 + 5 * device_id as u64
}

fn spec(version_id: i64) -> Value {
    json!({
        "name": "fedadam-durability", "model_version_id": version_id, "rounds": ROUNDS,
        "min_devices": DEVICES, "target_devices": DEVICES, "over_selection": 0.0,
        "evaluation": {"fraction": 0.0}, "round_deadline_ms": 120_000, "local_epochs": 1, "batch_size": 8,
        "learning_rate": BASE_LR,
        "learning_rate_schedule": {"kind": "exponential", "factor": LR_FACTOR},
        "strategy": {"name": "fedadam", "server_learning_rate": 0.05, "tau": 0.01},
    })
}

async fn send(device: &DeviceClient, task: &Task) -> Result<()> {
    // The schedule reaches devices in the task: 0.2, 0.1, 0.05, ...
    let expected_lr = BASE_LR * LR_FACTOR.powi(task.round_number as i32 - 1);
    ensure!(
        (task.training.learning_rate - expected_lr).abs() < 1e-15,
        "round {} asks for lr {}, the schedule says {expected_lr}",
        task.round_number,
        task.training.learning_rate
    );
    device.download_model(task).await?;
    let values = delta(&task.layout, device.device_id, task.round_number);
    let encoded = encode_update(&task.layout, samples_of(device.device_id), &values)?;
    device.upload_update(task, Bytes::from(encoded)).await?;
    Ok(())
}

/// Runs the job; with `kill_in_round`, the server is killed with SIGKILL
/// after half of that round's updates and restarted.
async fn run_job(database: Database, kill_in_round: Option<u32>) -> Result<canopy_ir::Model> {
    let mut server = TestServer::start(database)?;
    let admin = server.admin();
    let version = admin.upload_model("logreg", logreg_model_bytes(11)).await?;
    let token = admin.enrollment_token(DEVICES as u32).await?;
    let mut devices = Vec::new();
    for _ in 0..DEVICES {
        devices.push(enroll_device(&server, &token).await?);
    }
    let job = admin
        .create_job(spec(version["id"].as_i64().unwrap_or_default()))
        .await?;
    for round in 1..=ROUNDS {
        let mut tasks = Vec::new();
        for device in &devices {
            let task = poll_task(device).await?;
            ensure!(
                task.round_number == round,
                "device in round {}",
                task.round_number
            );
            tasks.push(task);
        }
        let killed = kill_in_round == Some(round);
        let first = if killed { DEVICES / 2 } else { DEVICES };
        for (device, task) in devices.iter().zip(&tasks).take(first) {
            send(device, task).await?;
        }
        if killed {
            server.restart()?;
            for device in &mut devices {
                device.set_transport(server.transport());
            }
            for device in devices.iter().skip(first) {
                let task = poll_task(device).await?;
                ensure!(
                    task.round_number == round,
                    "the same round after the restart"
                );
                send(device, &task).await?;
            }
        }
        // Wait for the round's version before the next poll, so every
        // device polls the next round.
        wait_for_version(&server, round as i64 + 1).await?;
    }
    let admin = server.admin();
    let finished = admin.wait_for_job(job, JOB_TIMEOUT).await?;
    ensure!(finished["state"] == "completed", "{finished}");
    fetch_model(&admin, "logreg", i64::from(ROUNDS) + 1).await
}

async fn wait_for_version(server: &TestServer, version: i64) -> Result<()> {
    let admin = server.admin();
    let deadline = std::time::Instant::now() + JOB_TIMEOUT;
    loop {
        let reply = admin
            .get(&format!("/api/v1/models/logreg/versions/{version}"))
            .await?;
        if reply.status == 200 {
            return Ok(());
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "version {version} never appeared"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// FedAdam (Reddi et al. 2021, Algorithm 2) computed here from the same
/// updates, with the server's f32 model rounding after each round.
fn expected_fedadam(base: &canopy_ir::Model, layout: &UpdateLayout) -> BTreeMap<String, Vec<f32>> {
    let (lr, beta1, beta2, tau) = (0.05, 0.9, 0.99, 0.01);
    let mut theta = base.trainable_values().expect("f32 parameters");
    let mut m = vec![0.0f64; theta.len()];
    let mut v = vec![tau * tau; theta.len()];
    // Devices are enrolled 1..=DEVICES on a fresh database.
    let ids: Vec<i64> = (1..=DEVICES as i64).collect();
    for round in 1..=ROUNDS {
        let total: f64 = ids.iter().map(|&id| samples_of(id) as f64).sum();
        let updates: Vec<Vec<f32>> = ids.iter().map(|&id| delta(layout, id, round)).collect();
        for i in 0..theta.len() {
            let mean: f64 = ids
                .iter()
                .zip(&updates)
                .map(|(&id, u)| samples_of(id) as f64 * f64::from(u[i]))
                .sum::<f64>()
                / total;
            m[i] = beta1 * m[i] + (1.0 - beta1) * mean;
            v[i] = beta2 * v[i] + (1.0 - beta2) * mean * mean;
            theta[i] = (f64::from(theta[i]) + lr * m[i] / (v[i].sqrt() + tau)) as f32;
        }
    }
    let mut out = BTreeMap::new();
    let mut offset = 0;
    for tensor in &layout.tensors {
        let n: usize = tensor.shape.iter().product();
        out.insert(tensor.name.clone(), theta[offset..offset + n].to_vec());
        offset += n;
    }
    out
}

fn trainable(model: &canopy_ir::Model) -> BTreeMap<String, Vec<f32>> {
    model
        .parameters
        .iter()
        .filter(|p| p.trainable)
        .map(|p| match &p.data.buffer {
            Buffer::F32(values) => (p.name.clone(), values.clone()),
            _ => panic!("f32 parameter"),
        })
        .collect()
}

fn assert_close(got: &BTreeMap<String, Vec<f32>>, want: &BTreeMap<String, Vec<f32>>, what: &str) {
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>()
    );
    for (name, want) in want {
        for (i, (g, w)) in got[name].iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-6 * w.abs().max(1.0),
                "{what}: {name}[{i}] is {g}, expected {w}"
            );
        }
    }
}

async fn survives_kill_9(database: Database) -> Result<()> {
    let base = canopy_ir::format::read_model(&logreg_model_bytes(11))?;
    let layout = canopy_server::fedavg::layout_of(&base)?;
    let uninterrupted = trainable(&run_job(database, None).await?);
    let expected = expected_fedadam(&base, &layout);
    assert_close(&uninterrupted, &expected, "FedAdam through the server");
    // The state must matter, or losing it would go unnoticed: plain
    // FedAvg from the same updates ends elsewhere.
    let base_params = trainable(&base);
    let moved = uninterrupted.iter().any(|(name, values)| {
        values
            .iter()
            .zip(&base_params[name])
            .any(|(a, b)| (a - b).abs() > 1e-3)
    });
    ensure!(moved, "the job moved the model");
    let killed = trainable(&run_job(database, Some(3)).await?);
    assert_close(
        &killed,
        &uninterrupted,
        "killed in round 3 vs uninterrupted",
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fedadam_state_survives_kill_9_on_sqlite() -> Result<()> {
    survives_kill_9(Database::Sqlite).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fedadam_state_survives_kill_9_on_postgres() -> Result<()> {
    survives_kill_9(Database::Postgres).await
}

/// Strategy settings are checked at creation; the 422 names the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_strategy_settings_are_refused() -> Result<()> {
    let server = TestServer::start(Database::Sqlite)?;
    let admin = server.admin();
    let version = admin.upload_model("logreg", logreg_model_bytes(1)).await?;
    let id = version["id"].as_i64().unwrap_or_default();
    // An unknown name's refusal lists every strategy the enum has (the
    // CLI's help sends users to it).
    let every_name = StrategyName::ALL
        .iter()
        .map(|name| format!("`{name}`"))
        .collect::<Vec<_>>()
        .join(", ");
    let every_name = format!("expected one of {every_name}");
    for (patch, needle) in [
        (
            json!({"strategy": {"name": "fedavg", "beta1": 0.9}}),
            "`strategy.beta1` does not apply to `fedavg`",
        ),
        (
            json!({"strategy": {"name": "fedyogi", "beta2": 1.0}}),
            "strategy.beta2",
        ),
        (
            json!({"strategy": {"name": "fedadam", "tau": 0}}),
            "strategy.tau",
        ),
        (
            json!({"strategy": {"name": "fedprox", "proximal_mu": 0.0}}),
            "strategy.proximal_mu",
        ),
        (
            json!({"strategy": {"name": "fedadam", "proximal_mu": 1000.5}}),
            "strategy.proximal_mu",
        ),
        (
            json!({"strategy": {"name": "fedprox", "momentum": 0.9}}),
            "`strategy.momentum` does not apply to `fedprox`",
        ),
        (json!({"strategy": {"name": "sgd"}}), every_name.as_str()),
        (json!({"strategy": "fedavg"}), "strategy"),
        (
            json!({"learning_rate_schedule": {"kind": "cosine", "final_learning_rate": 1.0}}),
            "final_learning_rate",
        ),
        (
            json!({"learning_rate_schedule": {"kind": "step", "every_rounds": 0, "factor": 0.5}}),
            "every_rounds",
        ),
    ] {
        let mut body = spec(id);
        for (key, value) in patch.as_object().into_iter().flatten() {
            body[key] = value.clone();
        }
        let reply = admin.post("/api/v1/jobs", body).await?;
        ensure!(
            reply.status == 422,
            "{patch}: answered {} {}",
            reply.status,
            reply.body
        );
        let message = reply.body["error"]["message"].as_str().unwrap_or_default();
        ensure!(
            message.contains(needle),
            "{patch}: `{message}` does not name `{needle}`"
        );
    }
    Ok(())
}
