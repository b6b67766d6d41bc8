//! The edge tier end to end: a real cloud (`canopy-server serve`), real
//! edge aggregators (`canopy-agent aggregate`), and end devices that talk
//! to their edge through the SDK over real TLS, as they would to a cloud.
//!
//! The devices send updates the test makes and keeps, so the test computes
//! flat FedAvg over every end device itself and checks that the tiered
//! job's model equals it.

#[path = "../server/tests/support/mod.rs"]
mod support;

use std::process::Child;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use canopy_protocol::auth::DeviceKey;
use canopy_protocol::update::encode_update;
use canopy_sdk::DeviceClient;
use serde_json::{Value, json};
use support::edge::Edge;
use support::{Admin, Database, TestServer, fetch_model, poll_task};

const EDGES: usize = 3;
const DEVICES_PER_EDGE: usize = 4;
const ROUNDS: u32 = 3;
const JOB_TIMEOUT: Duration = Duration::from_secs(180);

/// An end device enrolled with an edge, as the SDK enrolls with any server.
async fn enroll_at_edge(edge: &Edge, token: &str) -> Result<(DeviceClient, String)> {
    let transport = edge.transport();
    let key = DeviceKey::generate();
    let enrolled = canopy_sdk::enroll(&transport, token, &key, support::capabilities()).await?;
    let client = DeviceClient::new(
        transport,
        enrolled.device_id,
        key,
        &enrolled.server_public_key,
    )?;
    Ok((client, enrolled.server_public_key))
}

/// What one end device sent in one round.
#[derive(Clone, Debug)]
struct Sent {
    round: u32,
    num_samples: u64,
    values: Vec<f32>,
}

/// A device's update for a round: distinct per device and round, and
/// known to the test, which computes flat FedAvg from it.
fn update_of(device: usize, round: u32, len: usize) -> (u64, Vec<f32>) {
    let num_samples = 5 + device as u64 * 3;
    let values = (0..len)
        .map(|k| ((device * 7 + round as usize * 13 + k) % 17) as f32 * 0.001 - 0.008)
        .collect();
    (num_samples, values)
}

/// Runs one device through every round: poll its edge, download the
/// version (the SDK verifies the cloud's signature on it), upload.
async fn play(device: DeviceClient, index: usize) -> Result<Vec<Sent>> {
    let mut sent = Vec::new();
    // Each sub-round is the edge's own one-round job, so the task's round
    // number is the edge's; the cloud's rounds come one after another.
    for round in 1..=ROUNDS {
        let task = poll_task(&device).await?;
        ensure!(
            task.sub_round.is_none(),
            "an end device got a sub-round: {task:?}"
        );
        let model = device
            .download_model(&task)
            .await
            .with_context(|| format!("device {index} cannot download in round {round}"))?;
        ensure!(model.digest == task.model_digest);
        let (num_samples, values) = update_of(index, round, task.layout.num_elements());
        let encoded = encode_update(&task.layout, num_samples, &values)?;
        device.upload_update(&task, encoded.into()).await?;
        sent.push(Sent {
            round,
            num_samples,
            values,
        });
    }
    Ok(sent)
}

/// The trainable parameters of a model, in layout order.
fn trainable(model: &canopy_ir::Model) -> Vec<f64> {
    model
        .parameters
        .iter()
        .filter(|parameter| parameter.trainable)
        .flat_map(|parameter| match &parameter.data.buffer {
            canopy_ir::data::Buffer::F32(values) => values.iter().map(|&v| f64::from(v)).collect(),
            _ => Vec::new(),
        })
        .collect()
}

/// A cloud with `edges` running aggregators, each with `per_edge` end
/// devices enrolled, and the cloud's model-signing key.
async fn tiered_fleet(
    cloud: &TestServer,
    edges: usize,
    per_edge: usize,
) -> Result<(Vec<Edge>, Vec<Vec<DeviceClient>>, String)> {
    let cloud_admin = cloud.admin();
    let token = cloud_admin
        .enrollment_token_for("aggregator", edges as u32)
        .await?;
    let cloud_key = cloud_admin.ok("/device/v1/server-key").await?;
    let cloud_key = cloud_key["server_public_key"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let (mut nodes, mut fleets) = (Vec::new(), Vec::new());
    for e in 0..edges {
        let mut edge = Edge::enroll(cloud, &token)?;
        edge.start()?;
        let device_token = edge
            .admin()
            .enrollment_token(per_edge as u32)
            .await
            .with_context(|| format!("edge {e}'s admin API: {}", edge.log()))?;
        let mut devices = Vec::new();
        for _ in 0..per_edge {
            let (device, pinned) = enroll_at_edge(&edge, &device_token).await?;
            // The edge relays the cloud's key: devices verify the cloud's
            // signature on every model, end to end.
            ensure!(
                pinned == cloud_key,
                "the edge handed out {pinned}, not the cloud's key {cloud_key}"
            );
            devices.push(device);
        }
        nodes.push(edge);
        fleets.push(devices);
    }
    Ok((nodes, fleets, cloud_key))
}

/// A tiered job's spec: `min`/`target` aggregators per round, each
/// sub-round `per_edge` devices.
fn tiered_job(version: &Value, rounds: u32, min: usize, target: usize, per_edge: usize) -> Value {
    json!({
        "name": "tiered",
        "model_version_id": version["id"],
        "rounds": rounds,
        "min_devices": min,
        "target_devices": target,
        "over_selection": 0.0,
        "round_deadline_ms": 60_000,
        "max_round_retries": 0,
        "local_epochs": 1,
        "batch_size": 8,
        "learning_rate": 0.1,
        "evaluation": {"fraction": 0.0},
        "edges": {
            "min_devices": per_edge,
            "target_devices": per_edge,
            "over_selection": 0.0,
            "deadline_ms": 50_000,
        },
    })
}

/// Flat FedAvg from `base` over each round's updates in turn, rounded to
/// f32 after each round as the cloud keeps its parameters.
fn flat_fedavg(base: &canopy_ir::Model, rounds: &[Vec<&Sent>]) -> Vec<f64> {
    let mut expected = trainable(base);
    for updates in rounds {
        let weight: f64 = updates.iter().map(|s| s.num_samples as f64).sum();
        for (k, value) in expected.iter_mut().enumerate() {
            let sum: f64 = updates
                .iter()
                .map(|s| s.num_samples as f64 * f64::from(s.values[k]))
                .sum();
            *value = f64::from((*value + sum / weight) as f32);
        }
    }
    expected
}

/// The largest difference between a version's trainable parameters and
/// `expected`.
async fn distance(admin: &Admin, version: i64, expected: &[f64]) -> Result<f64> {
    let got = trainable(&fetch_model(admin, "tiered", version).await?);
    ensure!(got.len() == expected.len(), "{} parameters", got.len());
    Ok(got
        .iter()
        .zip(expected)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f64, f64::max))
}

/// 1 cloud, 3 edges, 12 end devices, 3 rounds: the tiered job's model is
/// flat FedAvg over the 12 devices' updates, to 1e-6.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tiered_job_equals_flat_fedavg_over_every_end_device() -> Result<()> {
    let cloud = TestServer::start(Database::Sqlite)?;
    let cloud_admin = cloud.admin();
    let (edges, fleets, _) = tiered_fleet(&cloud, EDGES, DEVICES_PER_EDGE).await?;
    let players: Vec<_> = fleets
        .into_iter()
        .flatten()
        .enumerate()
        .map(|(index, device)| tokio::spawn(play(device, index)))
        .collect();
    let base_bytes = support::logreg_model_bytes(11);
    let base = canopy_ir::format::read_model(&base_bytes)?;
    let version = cloud_admin.upload_model("tiered", base_bytes).await?;
    let spec = tiered_job(&version, ROUNDS, EDGES, EDGES, DEVICES_PER_EDGE);
    let job = cloud_admin.create_job(spec).await?;
    let finished = cloud_admin.wait_for_job(job, JOB_TIMEOUT).await;
    let logs = || {
        edges
            .iter()
            .map(Edge::log)
            .collect::<Vec<_>>()
            .join("\n---\n")
    };
    let finished = finished.with_context(logs)?;
    ensure!(
        finished["state"] == "completed",
        "job {finished}\nedges:\n{}",
        logs()
    );
    let mut sent = Vec::new();
    for player in players {
        sent.extend(player.await??);
    }
    ensure!(sent.len() == EDGES * DEVICES_PER_EDGE * ROUNDS as usize);
    let by_round: Vec<Vec<&Sent>> = (1..=ROUNDS)
        .map(|round| sent.iter().filter(|s| s.round == round).collect())
        .collect();
    ensure!(
        by_round
            .iter()
            .all(|updates| updates.len() == EDGES * DEVICES_PER_EDGE)
    );
    // The upload is version 1 and each round made one more.
    let final_version = 1 + i64::from(ROUNDS);
    let last = cloud_admin
        .ok(&format!("/api/v1/models/tiered/versions/{final_version}"))
        .await?;
    ensure!(
        last["id"] == finished["current_version_id"],
        "version {final_version} {last} is not the job's last {finished}"
    );
    let worst = distance(&cloud_admin, final_version, &flat_fedavg(&base, &by_round)).await?;
    ensure!(
        worst <= 1e-6,
        "the tiered model is {worst} from flat FedAvg"
    );
    round_trees_add_up(&cloud_admin, job, &by_round).await
}

/// Each cloud round's tree: its aggregators, each with its account of
/// its sub-round, whose counts and samples are those of its devices.
async fn round_trees_add_up(admin: &Admin, job: i64, by_round: &[Vec<&Sent>]) -> Result<()> {
    let rounds = admin.ok(&format!("/api/v1/jobs/{job}/rounds")).await?;
    let rounds = rounds["items"].as_array().cloned().unwrap_or_default();
    ensure!(rounds.len() == by_round.len(), "{rounds:?}");
    for round in rounds {
        let number = round["number"].as_u64().unwrap_or(0) as usize;
        let participants = admin
            .ok(&format!("/api/v1/rounds/{}/participants", round["id"]))
            .await?;
        let edges = participants["items"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        ensure!(edges.len() == EDGES, "round {number}: {participants}");
        let mut samples = 0;
        for edge in &edges {
            let sub_round = &edge["sub_round"];
            ensure!(
                sub_round["selected"] == DEVICES_PER_EDGE
                    && sub_round["updates"] == DEVICES_PER_EDGE
                    && sub_round["dropouts"] == 0
                    && sub_round["bytes_in"].as_u64().is_some_and(|b| b > 0)
                    && edge["num_samples"] == sub_round["samples"],
                "round {number}: {edge}"
            );
            samples += sub_round["samples"].as_u64().unwrap_or(0);
        }
        let sent: u64 = by_round[number - 1].iter().map(|s| s.num_samples).sum();
        ensure!(
            samples == sent,
            "round {number}: {samples} samples, the devices sent {sent}"
        );
    }
    Ok(())
}

/// An edge killed with SIGKILL in the middle of its sub-round, after two
/// of its four devices uploaded, resumes it on restart: the two it had
/// accepted are in its sum once (their devices, unsure, upload again and
/// hear 409), the other two join, and the cloud's model is FedAvg over
/// the four.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_edge_killed_mid_sub_round_loses_and_double_counts_nothing() -> Result<()> {
    let cloud = TestServer::start(Database::Sqlite)?;
    let admin = cloud.admin();
    let (mut edges, mut fleets, _) = tiered_fleet(&cloud, 1, DEVICES_PER_EDGE).await?;
    let mut devices = fleets.remove(0);
    let base_bytes = support::logreg_model_bytes(12);
    let base = canopy_ir::format::read_model(&base_bytes)?;
    let version = admin.upload_model("tiered", base_bytes).await?;
    let job = admin
        .create_job(tiered_job(&version, 1, 1, 1, DEVICES_PER_EDGE))
        .await?;
    let mut tasks = Vec::new();
    for device in &devices {
        tasks.push(poll_task(device).await?);
    }
    let mut sent = Vec::new();
    let mut upload =
        |index: usize, task: &canopy_protocol::messages::Task| -> Result<(bytes::Bytes, Sent)> {
            let (num_samples, values) = update_of(index, 1, task.layout.num_elements());
            let encoded = encode_update(&task.layout, num_samples, &values)?;
            let record = Sent {
                round: 1,
                num_samples,
                values,
            };
            sent.push(record.clone());
            Ok((encoded.into(), record))
        };
    let mut encoded = Vec::new();
    for (index, task) in tasks.iter().enumerate() {
        encoded.push(upload(index, task)?.0);
    }
    for index in 0..2 {
        devices[index]
            .upload_update(&tasks[index], encoded[index].clone())
            .await?;
    }

    let edge = &mut edges[0];
    let pid = edge.child.as_ref().map(Child::id);
    edge.kill9();
    edge.start()?;
    ensure!(
        edge.child.as_ref().map(Child::id) != pid,
        "the edge did not restart"
    );
    for device in &mut devices {
        device.set_transport(edge.transport());
    }
    for index in 0..2 {
        let error = devices[index]
            .upload_update(&tasks[index], encoded[index].clone())
            .await
            .expect_err("a second upload of an accepted update");
        ensure!(error.status() == Some(409), "device {index}: {error:?}");
    }
    for index in 2..DEVICES_PER_EDGE {
        devices[index]
            .upload_update(&tasks[index], encoded[index].clone())
            .await?;
    }
    let finished = admin
        .wait_for_job(job, JOB_TIMEOUT)
        .await
        .with_context(|| edge.log())?;
    ensure!(
        finished["state"] == "completed",
        "{finished}\n{}",
        edge.log()
    );
    let round: Vec<&Sent> = sent.iter().collect();
    let worst = distance(&admin, 2, &flat_fedavg(&base, &[round])).await?;
    ensure!(
        worst <= 1e-6,
        "the model is {worst} from FedAvg over the four devices"
    );
    Ok(())
}

/// An edge that stays down past its deadline: the cloud's round goes on
/// with the other edge when the job's minimum allows, and fails by it
/// otherwise, with the reason in the round's and the job's status.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_edge_down_past_its_deadline_leaves_the_round_to_the_others() -> Result<()> {
    let cloud = TestServer::start(Database::Sqlite)?;
    let admin = cloud.admin();
    let (mut edges, fleets, _) = tiered_fleet(&cloud, 2, 1).await?;
    // Down after it told the cloud it was online: the cloud selects it.
    edges[1].kill9();
    let mut fleets = fleets.into_iter();
    let device = fleets.next().and_then(|mut d| d.pop()).expect("a device");
    let base_bytes = support::logreg_model_bytes(13);
    let version = admin.upload_model("tiered", base_bytes).await?;
    let short = |min: usize| {
        let mut spec = tiered_job(&version, 1, min, 2, 1);
        spec["round_deadline_ms"] = json!(6_000);
        spec["edges"]["deadline_ms"] = json!(4_000);
        spec
    };
    for (min, state) in [(1, "completed"), (2, "failed")] {
        let job = admin.create_job(short(min)).await?;
        let task = poll_task(&device).await?;
        let (num_samples, values) = update_of(0, 1, task.layout.num_elements());
        let encoded = encode_update(&task.layout, num_samples, &values)?;
        device.upload_update(&task, encoded.into()).await?;
        let finished = admin.wait_for_job(job, JOB_TIMEOUT).await?;
        ensure!(
            finished["state"] == state,
            "min {min}: {finished}\n{}",
            edges[0].log()
        );
        let round = admin.ok(&format!("/api/v1/jobs/{job}/rounds")).await?["items"][0].clone();
        ensure!(
            round["metrics"]["updates_accepted"] == 1 && round["metrics"]["dropouts"] == 1,
            "{round}"
        );
        let participants = admin
            .ok(&format!("/api/v1/rounds/{}/participants", round["id"]))
            .await?;
        ensure!(
            participants
                .to_string()
                .contains("timeout: no update before the round's deadline"),
            "{participants}"
        );
        if state == "failed" {
            let status = finished["status_message"].as_str().unwrap_or_default();
            ensure!(
                status.contains("only 1 of the 2 updates needed arrived"),
                "{finished}"
            );
        }
    }
    Ok(())
}
