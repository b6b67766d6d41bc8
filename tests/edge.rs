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
    /// The device's index: the devices were enrolled edge by edge, so
    /// device i is edge i / DEVICES_PER_EDGE's.
    device: usize,
    round: u32,
    num_samples: u64,
    values: Vec<f32>,
}

/// A device's update for a round: known to the test, which computes flat
/// FedAvg from it, and unlike any other device's or round's in every run
/// of four values (a hash of device, round and position), so that a scan
/// that finds one has found that update.
fn update_of(device: usize, round: u32, len: usize) -> (u64, Vec<f32>) {
    let num_samples = 5 + device as u64 * 3;
    let values = (0..len)
        .map(|k| {
            let key = (device as u64) << 40 | u64::from(round) << 20 | k as u64;
            let bits = key.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
            (bits as f32 / (1u64 << 24) as f32 - 0.5) * 0.02
        })
        .collect();
    (num_samples, values)
}

/// How a device sends its update: plainly, or masked under SecAgg+.
#[derive(Clone, Copy, PartialEq)]
enum Sending {
    Plain,
    Secure,
}

/// Runs one device through every round: poll its edge, download the
/// version (the SDK verifies the cloud's signature on it), send.
async fn play(
    device: DeviceClient,
    index: usize,
    sending: Sending,
    rounds: u32,
) -> Result<Vec<Sent>> {
    let mut sent = Vec::new();
    // Each sub-round is the edge's own one-round job, so the task's round
    // number is the edge's; the cloud's rounds come one after another.
    for round in 1..=rounds {
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
        ensure!(
            task.secure_aggregation.is_some() == (sending == Sending::Secure),
            "device {index}'s task in round {round} is not as secure as the job"
        );
        match sending {
            Sending::Plain => {
                let encoded = encode_update(&task.layout, num_samples, &values)?;
                device.upload_update(&task, encoded.into()).await?;
            }
            Sending::Secure => {
                device
                    .run_secure_round(&task, &values, num_samples)
                    .await
                    .with_context(|| format!("device {index}'s secure round {round}"))?;
            }
        }
        sent.push(Sent {
            device: index,
            round,
            num_samples,
            values,
        });
    }
    Ok(sent)
}

/// The trainable parameters of a model, in layout order.
fn trainable(model: &canopy_ir::Model) -> Vec<f64> {
    support::trainable(model)
        .into_iter()
        .map(f64::from)
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

/// A finished tiered job of [`ROUNDS`] rounds over [`EDGES`] edges of
/// [`DEVICES_PER_EDGE`] devices each, and what each device sent.
struct TieredRun {
    cloud: TestServer,
    edges: Vec<Edge>,
    job: i64,
    /// The largest difference between the job's model and flat FedAvg
    /// over the devices' updates, computed here.
    distance: f64,
    sent: Vec<Sent>,
}

impl TieredRun {
    async fn run(sending: Sending) -> Result<TieredRun> {
        TieredRun::run_with(sending, |_| {}).await
    }

    /// [`TieredRun::run`] with the job's spec changed by `adjust` first.
    async fn run_with(sending: Sending, adjust: impl FnOnce(&mut Value)) -> Result<TieredRun> {
        let cloud = TestServer::start(Database::Sqlite)?;
        let cloud_admin = cloud.admin();
        let (edges, fleets, _) = tiered_fleet(&cloud, EDGES, DEVICES_PER_EDGE).await?;
        let players: Vec<_> = fleets
            .into_iter()
            .flatten()
            .enumerate()
            .map(|(index, device)| tokio::spawn(play(device, index, sending, ROUNDS)))
            .collect();
        let base_bytes = support::logreg_model_bytes(11);
        let base = canopy_ir::format::read_model(&base_bytes)?;
        let version = cloud_admin.upload_model("tiered", base_bytes).await?;
        let mut spec = tiered_job(&version, ROUNDS, EDGES, EDGES, DEVICES_PER_EDGE);
        if sending == Sending::Secure {
            spec["secure_aggregation"] = json!({"enabled": true});
        }
        adjust(&mut spec);
        let job = cloud_admin.create_job(spec).await?;
        let finished = completed(&cloud_admin, job, &edges).await?;
        let mut sent = Vec::new();
        for player in players {
            sent.extend(player.await??);
        }
        ensure!(sent.len() == EDGES * DEVICES_PER_EDGE * ROUNDS as usize);
        // The upload is version 1 and each round made one more.
        let final_version = 1 + i64::from(ROUNDS);
        let last = cloud_admin
            .ok(&format!("/api/v1/models/tiered/versions/{final_version}"))
            .await?;
        ensure!(
            last["id"] == finished["current_version_id"],
            "version {final_version} {last} is not the job's last {finished}"
        );
        let run = TieredRun {
            cloud,
            edges,
            job,
            distance: 0.0,
            sent,
        };
        let expected = flat_fedavg(&base, &run.by_round());
        let distance = distance(&cloud_admin, final_version, &expected).await?;
        round_trees_add_up(&cloud_admin, job, &run.by_round(), sending).await?;
        Ok(TieredRun { distance, ..run })
    }

    fn by_round(&self) -> Vec<Vec<&Sent>> {
        (1..=ROUNDS)
            .map(|round| self.sent.iter().filter(|s| s.round == round).collect())
            .collect()
    }
}

/// 1 cloud, 3 edges, 12 end devices, 3 rounds: the tiered job's model is
/// flat FedAvg over the 12 devices' updates, to 1e-6.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tiered_job_equals_flat_fedavg_over_every_end_device() -> Result<()> {
    let run = TieredRun::run(Sending::Plain).await?;
    ensure!(
        run.distance <= 1e-6,
        "the tiered model is {} from flat FedAvg",
        run.distance
    );
    // The secure test's scan, where nothing is secret: it finds the
    // devices' updates at their edges and the edges' sums at the cloud,
    // so its silence in the secure run means something.
    let leaks = secrecy::scan(&run, &QuantisationSteps::of_this_fleet()?)?;
    for (tier, what) in [("edge", "device"), ("the cloud", "partial")] {
        ensure!(
            leaks
                .iter()
                .any(|leak| leak.starts_with(tier) && leak.contains(what)),
            "the scan of a plain job finds no {what} at {tier}: {leaks:#?}"
        );
    }
    Ok(())
}

/// The same fleet under an asynchronous job (FedBuff at the cloud over
/// its edges): as many edges train at once as a buffer takes, and an edge
/// that finished waits for the next buffer, so every buffer holds each
/// edge's sub-round on the newest version, none stale, and the job is
/// flat FedAvg again, to 1e-6, through the real edges.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_asynchronous_job_buffers_its_edges_results() -> Result<()> {
    let run = TieredRun::run_with(Sending::Plain, |spec| {
        spec["asynchronous"] = json!({"concurrency": EDGES, "max_staleness": 1});
    })
    .await?;
    ensure!(
        run.distance <= 1e-6,
        "the buffered tiered model is {} from flat FedAvg",
        run.distance
    );
    let rounds = run
        .cloud
        .admin()
        .ok(&format!("/api/v1/jobs/{}/rounds", run.job))
        .await?;
    let buffers = rounds["items"].as_array().map_or(0, Vec::len);
    ensure!(buffers == ROUNDS as usize, "{rounds}");
    for round in rounds["items"].as_array().into_iter().flatten() {
        ensure!(round["max_staleness"] == 1, "not a buffer: {round}");
    }
    Ok(())
}

/// Edges that buffer for their own devices (`edges.asynchronous`, two
/// versions of their own per result) under a cloud that buffers for its
/// edges. At each edge, two updates fill the first buffer into the edge's
/// first version, which the edge signs under the cloud's delegation and
/// its devices verify (their trust stays the cloud's key) and are handed
/// to train on; the other two, trained on the cloud's version, fold into
/// the second buffer one version stale. Each edge then sends the step
/// from the cloud's version to its last, weighing all four updates, and
/// the cloud's model is FedBuff over both tiers, computed here from what
/// the devices sent, to 1e-6, though the first edge is killed with SIGKILL
/// between its buffers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn edges_buffer_for_their_own_devices() -> Result<()> {
    const EDGES_HERE: usize = 2;
    let cloud = TestServer::start(Database::Sqlite)?;
    let admin = cloud.admin();
    let (mut edges, mut fleets, cloud_key) =
        tiered_fleet(&cloud, EDGES_HERE, DEVICES_PER_EDGE).await?;
    let base_bytes = support::logreg_model_bytes(13);
    let base = canopy_ir::format::read_model(&base_bytes)?;
    let version = admin.upload_model("tiered", base_bytes).await?;
    let mut spec = tiered_job(&version, 1, EDGES_HERE, EDGES_HERE, 2);
    spec["asynchronous"] = json!({"concurrency": EDGES_HERE, "max_staleness": 1});
    spec["edges"]["rounds"] = json!(2);
    spec["edges"]["asynchronous"] = json!({"concurrency": DEVICES_PER_EDGE, "max_staleness": 2});
    let job = admin.create_job(spec).await?;
    let mut results = Vec::new();
    for (e, (edge, devices)) in edges.iter_mut().zip(&mut fleets).enumerate() {
        // The first edge is killed with SIGKILL between its two buffers.
        let killed = e == 0;
        let result = buffer_at_edge(
            e * DEVICES_PER_EDGE,
            edge,
            devices,
            &base,
            &cloud_key,
            killed,
        )
        .await
        .with_context(|| edge.log())?;
        results.push(result);
    }
    completed(&admin, job, &edges).await?;
    // The cloud's one buffer: both edges' results on its version, fresh.
    let weight: f64 = results.iter().map(|(w, _)| *w as f64).sum();
    let expected: Vec<f64> = trainable(&base)
        .iter()
        .enumerate()
        .map(|(k, value)| {
            let sum: f64 = results
                .iter()
                .map(|(w, step)| *w as f64 * f64::from(step[k]))
                .sum();
            f64::from((value + sum / weight) as f32)
        })
        .collect();
    let worst = distance(&admin, 2, &expected).await?;
    ensure!(
        worst <= 1e-6,
        "the model is {worst} from FedBuff over both tiers"
    );
    // Each edge's account covers both its buffers: the four updates, and
    // the devices still training when it made its result, let go.
    let (_, participants) = first_round(&admin, job).await?;
    let reported = participants["items"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    ensure!(reported.len() == EDGES_HERE, "{participants}");
    for edge in &reported {
        let sub_round = &edge["sub_round"];
        let selected = sub_round["selected"].as_u64().unwrap_or(0);
        ensure!(
            sub_round["updates"] == 4
                && (6..=7).contains(&selected)
                && sub_round["dropouts"] == selected - 4
                && edge["num_samples"] == sub_round["samples"],
            "{edge}"
        );
        let reason = sub_round["dropout_reasons"][0]["reason"]
            .as_str()
            .unwrap_or_default();
        ensure!(reason.contains("made its result"), "{edge}");
    }
    Ok(())
}

/// One edge's part in [`edges_buffer_for_their_own_devices`], played by its
/// four devices from index `first` on: the result the edge must send, as
/// its weight and its step from the cloud's version (f32, as encoded).
/// With `killed`, the edge is killed with SIGKILL once its first version
/// is made and started again: it serves that version with its signature
/// and the cloud's delegation from its database, and its second buffer
/// takes the two stale updates once each.
async fn buffer_at_edge(
    first: usize,
    edge: &mut Edge,
    devices: &mut [DeviceClient],
    base: &canopy_ir::Model,
    cloud_key: &str,
    killed: bool,
) -> Result<(u64, Vec<f32>)> {
    let mut tasks = Vec::new();
    for device in devices.iter() {
        tasks.push(poll_task(device).await?);
    }
    let len = tasks[0].layout.num_elements();
    let updates: Vec<(u64, Vec<f32>)> = (0..DEVICES_PER_EDGE)
        .map(|i| update_of(first + i, 1, len))
        .collect();
    for i in 0..2 {
        send(&devices[i], &tasks[i], &updates[i]).await?;
    }
    let mean = |from: usize| -> Vec<f64> {
        let pair = &updates[from..from + 2];
        let weight: f64 = pair.iter().map(|(n, _)| *n as f64).sum();
        (0..len)
            .map(|k| {
                let sum: f64 = pair.iter().map(|(n, v)| *n as f64 * f64::from(v[k])).sum();
                sum / weight
            })
            .collect()
    };
    // The first buffer made the edge's first version, and the second
    // buffer tops up, on that version, the places free of the four: at
    // least one of the two devices that filled the first (the other may
    // have been topped up into the first again as soon as it uploaded).
    let mut own = None;
    for (index, device) in devices[..2].iter().enumerate() {
        let task = poll_task(device).await?;
        if task.model_version_id != tasks[0].model_version_id {
            own = Some((index, task));
        }
    }
    let (index, own) = own.context("no device was handed the edge's own version")?;
    if killed {
        edge.kill9();
        edge.start()?;
        for device in devices.iter_mut() {
            device.set_transport(edge.transport());
        }
    }
    let device = &devices[index];
    let downloaded = device.download_model(&own).await?;
    ensure!(
        downloaded.signer_key_hex != cloud_key && device.trusted_keys().current_hex() == cloud_key,
        "the edge's version verified as signed by {}, and the device now trusts {}",
        downloaded.signer_key_hex,
        device.trusted_keys().current_hex()
    );
    let cloud_values = trainable(base);
    let own_values: Vec<f64> = cloud_values
        .iter()
        .zip(mean(0))
        .map(|(value, step)| f64::from((value + step) as f32))
        .collect();
    let got = trainable(&canopy_ir::format::read_model(&downloaded.bytes)?);
    let worst = got
        .iter()
        .zip(&own_values)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f64, f64::max);
    ensure!(
        worst <= 1e-6,
        "the edge's first version is {worst} from its buffer's mean"
    );
    // The other two trained on the cloud's version: one version stale at
    // the edge, each weighing 1/√2 of its samples.
    for i in 2..DEVICES_PER_EDGE {
        send(&devices[i], &tasks[i], &updates[i]).await?;
    }
    let (stale, late) = (2f64.powf(-0.5), mean(2));
    let step: Vec<f32> = (0..len)
        .map(|k| ((own_values[k] - cloud_values[k]) + stale * late[k]) as f32)
        .collect();
    let weight = updates.iter().map(|(n, _)| n).sum();
    Ok((weight, step))
}

/// Uploads `update` (samples, values) for `task`.
async fn send(
    device: &DeviceClient,
    task: &canopy_protocol::messages::Task,
    (num_samples, values): &(u64, Vec<f32>),
) -> Result<()> {
    let encoded = encode_update(&task.layout, *num_samples, values)?;
    device.upload_update(task, encoded.into()).await?;
    Ok(())
}

/// Each cloud round's tree: its aggregators, each with its account of
/// its sub-round, whose counts and samples are those of its devices. A
/// secure round's samples are inside its sum: the cloud holds no edge's.
async fn round_trees_add_up(
    admin: &Admin,
    job: i64,
    by_round: &[Vec<&Sent>],
    sending: Sending,
) -> Result<()> {
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
            if sending == Sending::Secure {
                ensure!(
                    edge["num_samples"].is_null(),
                    "round {number}: the cloud knows an edge's weight: {edge}"
                );
                continue;
            }
            samples += sub_round["samples"].as_u64().unwrap_or(0);
        }
        if sending == Sending::Secure {
            continue;
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
                device: index,
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

/// Waits for a job to complete; its failure shows the edges' logs.
async fn completed(admin: &Admin, job: i64, edges: &[Edge]) -> Result<Value> {
    let logs = || {
        edges
            .iter()
            .map(Edge::log)
            .collect::<Vec<_>>()
            .join("\n---\n")
    };
    let finished = admin
        .wait_for_job(job, JOB_TIMEOUT)
        .await
        .with_context(logs)?;
    ensure!(
        finished["state"] == "completed",
        "job {finished}\nedges:\n{}",
        logs()
    );
    Ok(finished)
}

/// A job's first round and its participants, as the admin API shows them.
async fn first_round(admin: &Admin, job: i64) -> Result<(Value, Value)> {
    let round = admin.ok(&format!("/api/v1/jobs/{job}/rounds")).await?["items"][0].clone();
    let participants = admin
        .ok(&format!("/api/v1/rounds/{}/participants", round["id"]))
        .await?;
    Ok((round, participants))
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
        let (round, participants) = first_round(&admin, job).await?;
        ensure!(
            round["metrics"]["updates_accepted"] == 1 && round["metrics"]["dropouts"] == 1,
            "{round}"
        );
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

/// An edge that makes two versions per sub-round, one of whose two devices
/// takes its first task and never answers: the first round closes by its
/// half of the edge's deadline with the other device's update, which
/// leaves the second round the other half, so that the edge still sends
/// the cloud both rounds' work. (Were the first round to wait for the
/// whole deadline, the second would open past it and fail the sub-round.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_silent_device_leaves_an_edges_later_rounds_their_time() -> Result<()> {
    const EDGE_DEADLINE_MS: u64 = 8_000;
    let cloud = TestServer::start(Database::Sqlite)?;
    let admin = cloud.admin();
    let (edges, fleets, _) = tiered_fleet(&cloud, 1, 2).await?;
    let mut devices = fleets.into_iter().flatten();
    let (Some(answering), Some(silent)) = (devices.next(), devices.next()) else {
        anyhow::bail!("the fleet has fewer than two devices");
    };
    let version = admin
        .upload_model("tiered", support::logreg_model_bytes(13))
        .await?;
    let mut spec = tiered_job(&version, 1, 1, 1, 2);
    spec["round_deadline_ms"] = json!(EDGE_DEADLINE_MS + 4_000);
    spec["edges"]["min_devices"] = json!(1);
    spec["edges"]["deadline_ms"] = json!(EDGE_DEADLINE_MS);
    spec["edges"]["rounds"] = json!(2);
    let job = admin.create_job(spec).await?;
    let started = std::time::Instant::now();
    let _never_answered = poll_task(&silent).await?;
    let mut first_round_closed = None;
    for round in 1..=2 {
        let task = poll_task(&answering).await?;
        if round == 2 {
            first_round_closed = Some(started.elapsed());
        }
        let (num_samples, values) = update_of(0, round, task.layout.num_elements());
        let encoded = encode_update(&task.layout, num_samples, &values)?;
        answering.upload_update(&task, encoded.into()).await?;
    }
    let finished = admin.wait_for_job(job, JOB_TIMEOUT).await?;
    ensure!(
        finished["state"] == "completed",
        "{finished}\n{}",
        edges[0].log()
    );
    let half = Duration::from_millis(EDGE_DEADLINE_MS / 2);
    ensure!(
        first_round_closed.is_some_and(|closed| closed <= half + Duration::from_secs(1)),
        "the edge's first round closed after {first_round_closed:?}, not by half its deadline"
    );
    let (round, participants) = first_round(&admin, job).await?;
    ensure!(round["metrics"]["updates_accepted"] == 1, "{round}");
    let sub_round = &participants["items"][0]["sub_round"];
    ensure!(
        sub_round["updates"] == 2 && sub_round["dropouts"] == 2,
        "the edge's result must hold both rounds' updates: {participants}"
    );
    Ok(())
}

/// The same fleet with secure aggregation at both tiers: each edge's
/// devices mask their updates for it (it learns their sum), and the edges
/// mask their sub-rounds' results for the cloud (it learns the sum over
/// the edges). The model equals flat FedAvg within the two tiers'
/// quantisation steps, and no plaintext update is kept where it must not
/// be.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_secure_tiered_job_equals_flat_fedavg_and_keeps_each_tier_secret() -> Result<()> {
    let run = TieredRun::run(Sending::Secure).await?;
    let steps = QuantisationSteps::of_this_fleet()?;
    // Each round adds at most one step of each tier to each value (the
    // edge's mean is within a device-tier step of the true mean, the
    // cloud's within a cloud-tier step of the edges'), and the f32 model
    // rounds a little.
    let bound = f64::from(ROUNDS) * (steps.device + steps.edge) + 1e-6;
    ensure!(
        run.distance <= bound,
        "the secure tiered model is {} from flat FedAvg, over the quantisation bound {bound}",
        run.distance
    );
    ensure!(
        run.distance > 0.0,
        "exactly flat FedAvg: was anything quantised?"
    );
    every_round_was_secure(&run).await?;
    let leaks = secrecy::scan(&run, &steps)?;
    ensure!(
        leaks.is_empty(),
        "plaintext kept where it must not be: {leaks:#?}"
    );
    Ok(())
}

/// The largest quantisation step of each tier in this test's rounds.
struct QuantisationSteps {
    /// Of a sub-round of [`DEVICES_PER_EDGE`] devices.
    device: f64,
    /// Of a cloud round of [`EDGES`] aggregators.
    edge: f64,
}

impl QuantisationSteps {
    fn of_this_fleet() -> Result<QuantisationSteps> {
        use canopy_protocol::secagg::SecAggConfig;
        let config = SecAggConfig {
            enabled: true,
            ..SecAggConfig::default()
        };
        let sub_round = config.plan(DEVICES_PER_EDGE, 1)?;
        let cloud = config
            .for_aggregators(DEVICES_PER_EDGE as u32, EDGES)?
            .plan(EDGES, 1)?;
        Ok(QuantisationSteps {
            device: config.clip / sub_round.levels as f64,
            edge: config.clip / cloud.levels as f64,
        })
    }
}

/// Both tiers ran SecAgg+: every cloud round and every edge's sub-round
/// has a secure stage, and every participant at both tiers uploaded no
/// plain update.
async fn every_round_was_secure(run: &TieredRun) -> Result<()> {
    let mut admins = vec![("the cloud".to_string(), run.cloud.admin(), Some(run.job))];
    for (e, edge) in run.edges.iter().enumerate() {
        admins.push((format!("edge {e}"), edge.admin(), None));
    }
    for (who, admin, only_job) in admins {
        let jobs = admin.ok("/api/v1/jobs").await?;
        let jobs = jobs["items"].as_array().cloned().unwrap_or_default();
        let ids: Vec<i64> = jobs
            .iter()
            .filter_map(|job| job["id"].as_i64())
            .filter(|id| only_job.is_none_or(|only| only == *id))
            .collect();
        ensure!(!ids.is_empty(), "{who} has no jobs");
        for id in ids {
            let rounds = admin.ok(&format!("/api/v1/jobs/{id}/rounds")).await?;
            for round in rounds["items"].as_array().cloned().unwrap_or_default() {
                ensure!(
                    round["secure_stage"].is_string() && round["state"] == "succeeded",
                    "{who}'s round is not a finished secure round: {round}"
                );
            }
        }
    }
    Ok(())
}

/// Scans each tier's files (database, its journal, blobs, logs) for the
/// updates that tier must never see in plaintext.
mod secrecy {
    use std::path::{Path, PathBuf};

    use anyhow::{Result, ensure};

    use super::{DEVICES_PER_EDGE, QuantisationSteps, ROUNDS, Sent, TieredRun};

    /// Four consecutive values of something secret, and how closely a
    /// stored copy may differ from them (a quantised copy is not exact).
    #[derive(Clone, Debug)]
    struct Needle {
        name: String,
        values: [f64; 4],
        tolerance: f64,
    }

    const RUN: usize = 4;

    /// Every run of four values of `values`, as needles.
    fn needles(name: &str, values: &[f64], tolerance: f64) -> Vec<Needle> {
        values
            .chunks_exact(RUN)
            .enumerate()
            .map(|(at, run)| Needle {
                name: format!("{name} at value {}", at * RUN),
                values: [run[0], run[1], run[2], run[3]],
                tolerance,
            })
            .collect()
    }

    /// A device's update as sent, and as a plain fold keeps it (times its
    /// weight).
    fn device_needles(sent: &Sent) -> Vec<Needle> {
        let values: Vec<f64> = sent.values.iter().map(|&v| f64::from(v)).collect();
        let weighted: Vec<f64> = values.iter().map(|v| v * sent.num_samples as f64).collect();
        let name = format!("device {}'s round {} update", sent.device, sent.round);
        let mut found = needles(&name, &values, 1e-9);
        found.extend(needles(&format!("{name}, weighted"), &weighted, 1e-6));
        found
    }

    /// An edge's partial result for a round, as its mean (what a plain
    /// uplink carries) and as its weighted sum (what it unmasks), each
    /// within the device tier's quantisation.
    fn edge_needles(edge: usize, round: u32, devices: &[&Sent], step: f64) -> Vec<Needle> {
        let weight: f64 = devices.iter().map(|s| s.num_samples as f64).sum();
        let len = devices[0].values.len();
        let sum: Vec<f64> = (0..len)
            .map(|k| {
                devices
                    .iter()
                    .map(|s| s.num_samples as f64 * f64::from(s.values[k]))
                    .sum()
            })
            .collect();
        let mean: Vec<f64> = sum.iter().map(|v| v / weight).collect();
        let name = format!("edge {edge}'s round {round} partial");
        let mut found = needles(&format!("{name} mean"), &mean, step + 1e-7);
        found.extend(needles(&format!("{name} sum"), &sum, weight * step + 1e-6));
        found
    }

    /// What each tier keeps that it must not: one line per file that
    /// holds a secret of another tier, naming the tier, the secret and
    /// where.
    pub fn scan(run: &TieredRun, steps: &QuantisationSteps) -> Result<Vec<String>> {
        let mut per_edge: Vec<Vec<Needle>> = vec![Vec::new(); run.edges.len()];
        let mut every_device = Vec::new();
        for sent in &run.sent {
            let found = device_needles(sent);
            per_edge[sent.device / DEVICES_PER_EDGE].extend(found.iter().cloned());
            every_device.extend(found);
        }
        let mut cloud_needles = every_device;
        for round in 1..=ROUNDS {
            for edge in 0..run.edges.len() {
                let devices: Vec<&Sent> = run
                    .sent
                    .iter()
                    .filter(|s| s.round == round && s.device / DEVICES_PER_EDGE == edge)
                    .collect();
                cloud_needles.extend(edge_needles(edge, round, &devices, steps.device));
            }
        }
        let mut leaks = Vec::new();
        for (e, edge) in run.edges.iter().enumerate() {
            leaks.extend(needles_in(
                &format!("edge {e}"),
                edge.dir.path(),
                &per_edge[e],
            )?);
        }
        let cloud_dir = run.cloud.data_dir.path();
        leaks.extend(needles_in("the cloud", cloud_dir, &cloud_needles)?);
        Ok(leaks)
    }

    fn needles_in(tier: &str, dir: &Path, needles: &[Needle]) -> Result<Vec<String>> {
        ensure!(!needles.is_empty(), "nothing to look for at {tier}");
        let files = files_under(dir)?;
        ensure!(
            files
                .iter()
                .any(|(path, _)| path.extension().is_some_and(|e| e == "db"))
                && files
                    .iter()
                    .any(|(path, _)| path.extension().is_some_and(|e| e == "log")),
            "{tier}'s files hold no database or no log: {:?}",
            files.iter().map(|(path, _)| path).collect::<Vec<_>>()
        );
        let mut leaks = Vec::new();
        for (path, bytes) in &files {
            if let Some((needle, offset, width)) = find(bytes, needles) {
                leaks.push(format!(
                    "{tier} keeps {} in {} at byte {offset}, as {width}-byte values",
                    needle.name,
                    path.display()
                ));
            }
            let text = String::from_utf8_lossy(bytes);
            for needle in needles.iter().filter(|n| n.tolerance < 1e-6) {
                let printed = format!("{}", needle.values[0] as f32);
                if printed.len() >= 8 && text.contains(&printed) {
                    leaks.push(format!(
                        "{tier} prints {} ({printed}) in {}",
                        needle.name,
                        path.display()
                    ));
                }
            }
        }
        Ok(leaks)
    }

    fn files_under(dir: &Path) -> Result<Vec<(PathBuf, Vec<u8>)>> {
        let mut files = Vec::new();
        let mut stack = vec![dir.to_path_buf()];
        while let Some(dir) = stack.pop() {
            for entry in std::fs::read_dir(&dir)? {
                let path = entry?.path();
                if path.is_dir() {
                    stack.push(path);
                } else if path.is_file() {
                    files.push((path.clone(), std::fs::read(&path)?));
                }
            }
        }
        Ok(files)
    }

    /// The first needle found in `bytes` at any byte offset, as
    /// consecutive little-endian f32s or f64s, with its offset and width.
    fn find<'a>(bytes: &[u8], needles: &'a [Needle]) -> Option<(&'a Needle, usize, usize)> {
        let mut by_first: Vec<(f64, &Needle)> = needles.iter().map(|n| (n.values[0], n)).collect();
        by_first.sort_by(|a, b| a.0.total_cmp(&b.0));
        let widest = needles.iter().map(|n| n.tolerance).fold(0.0, f64::max);
        for width in [4usize, 8] {
            let read = |at: usize| -> f64 {
                match width {
                    4 => f64::from(f32::from_le_bytes(bytes[at..at + 4].try_into().unwrap())),
                    _ => f64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()),
                }
            };
            for offset in 0..bytes.len().saturating_sub(width * RUN - 1) {
                let first = read(offset);
                if !first.is_finite() {
                    continue;
                }
                let from = by_first.partition_point(|(v, _)| *v < first - widest);
                for (value, needle) in &by_first[from..] {
                    if *value > first + widest {
                        break;
                    }
                    let matches = (0..RUN).all(|k| {
                        (read(offset + k * width) - needle.values[k]).abs() <= needle.tolerance
                    });
                    if matches {
                        return Some((needle, offset, width));
                    }
                }
            }
        }
        None
    }
}

/// An edge that restarts during a secure cloud round cannot mask its
/// result for it (its round keys lived only in its process): once its
/// sub-round closes it declines the cloud's task, saying why, and the
/// cloud's round, which tolerates no dropout among 3 aggregators, fails
/// then, long before its deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_edge_restarted_during_a_secure_round_declines_at_once() -> Result<()> {
    let cloud = TestServer::start(Database::Sqlite)?;
    let admin = cloud.admin();
    let (mut edges, fleets, _) = tiered_fleet(&cloud, EDGES, DEVICES_PER_EDGE).await?;
    let version = admin
        .upload_model("tiered", support::logreg_model_bytes(14))
        .await?;
    let mut spec = tiered_job(&version, 1, EDGES, EDGES, DEVICES_PER_EDGE);
    spec["secure_aggregation"] = json!({"enabled": true});
    let started = std::time::Instant::now();
    let job = admin.create_job(spec).await?;
    let keyed = "exchanged keys with the other aggregators";
    while !edges[0].log().contains(keyed) {
        ensure!(
            started.elapsed() < Duration::from_secs(60),
            "edge 0 never exchanged keys: {}",
            edges[0].log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    edges[0].kill9();
    edges[0].start()?;
    let players: Vec<_> = fleets
        .into_iter()
        .flatten()
        .enumerate()
        .map(|(index, device)| tokio::spawn(play(device, index, Sending::Secure, 1)))
        .collect();
    let finished = admin.wait_for_job(job, JOB_TIMEOUT).await?;
    let elapsed = started.elapsed();
    ensure!(finished["state"] == "failed", "{finished}");
    let (round, participants) = first_round(&admin, job).await?;
    ensure!(
        participants
            .to_string()
            .contains("restarted during the cloud's secure round"),
        "{participants}\n{}",
        edges[0].log()
    );
    ensure!(
        elapsed < Duration::from_secs(45),
        "the round took {elapsed:?}, as if it had waited for its 60 s deadline: {round}"
    );
    // Its devices' sub-round itself completed on the restarted edge.
    for player in players {
        player.await??;
    }
    Ok(())
}

/// A tiered job's versions are evaluated through its edges: each asks its
/// own devices, and reports their sample-weighted mean with their samples
/// as its own, so the cloud's federated evaluation is the sample-weighted
/// mean over every end device that reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tiered_jobs_version_is_evaluated_by_every_end_device() -> Result<()> {
    use canopy_protocol::messages::TaskKind;
    use canopy_sdk::train::Evaluation;

    let cloud = TestServer::start(Database::Sqlite)?;
    let admin = cloud.admin();
    let (edges, fleets, _) = tiered_fleet(&cloud, 2, 3).await?;
    let version = admin
        .upload_model("tiered", support::logreg_model_bytes(15))
        .await?;
    let mut spec = tiered_job(&version, 1, 2, 2, 3);
    spec["evaluation"] = json!({"fraction": 1.0});
    let job = admin.create_job(spec).await?;
    let evaluation_of = |index: usize| Evaluation {
        loss: 0.5 + 0.1 * index as f64,
        accuracy: 0.6 + 0.05 * index as f64,
        samples: 10 + 7 * index as u64,
    };
    let players: Vec<_> = fleets
        .into_iter()
        .flatten()
        .enumerate()
        .map(|(index, device)| {
            tokio::spawn(async move {
                let task = poll_task(&device).await?;
                ensure!(task.kind == TaskKind::Train, "device {index}: {task:?}");
                let (num_samples, values) = update_of(index, 1, task.layout.num_elements());
                let encoded = encode_update(&task.layout, num_samples, &values)?;
                device.upload_update(&task, encoded.into()).await?;
                let task = poll_task(&device).await?;
                ensure!(task.kind == TaskKind::Evaluate, "device {index}: {task:?}");
                device
                    .report_evaluation(&task, &evaluation_of(index))
                    .await?;
                anyhow::Ok(())
            })
        })
        .collect();
    completed(&admin, job, &edges).await?;
    for player in players {
        player.await??;
    }
    let reports: Vec<Evaluation> = (0..6).map(evaluation_of).collect();
    let samples: u64 = reports.iter().map(|r| r.samples).sum();
    let mean = |of: fn(&Evaluation) -> f64| {
        reports
            .iter()
            .map(|r| of(r) * r.samples as f64)
            .sum::<f64>()
            / samples as f64
    };
    let (round, _) = first_round(&admin, job).await?;
    let detail = admin.ok(&format!("/api/v1/rounds/{}", round["id"])).await?;
    let metrics = &detail["metrics"];
    let close = |field: &str, expected: f64| {
        metrics[field]
            .as_f64()
            .is_some_and(|got| (got - expected).abs() <= 1e-9)
    };
    ensure!(
        metrics["federated_eval_samples"] == samples
            && metrics["federated_eval_devices"] == 2
            && close("federated_eval_loss", mean(|r| r.loss))
            && close("federated_eval_accuracy", mean(|r| r.accuracy)),
        "{metrics}"
    );
    Ok(())
}

/// Device authorities at both tiers: the cloud's certifies its
/// aggregators (each pins it and installs its certificate with
/// `canopy-agent certify`), each edge's its own end devices (each pins
/// its edge's authority), and a secure tiered job, whose key exchanges at
/// both tiers then carry and check the certificates, completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn device_authorities_certify_both_tiers_of_a_secure_job() -> Result<()> {
    use canopy_protocol::device_cert::DeviceAuthority;

    let cloud_authority = DeviceAuthority::generate();
    let cloud_hex = cloud_authority.public_key_hex();
    let cloud = TestServer::start_with(Database::Sqlite, &["--device-authority", &cloud_hex])?;
    let admin = cloud.admin();
    let token = admin
        .enrollment_token_for("aggregator", EDGES as u32)
        .await?;
    let mut edges = Vec::new();
    let mut players = Vec::new();
    for e in 0..EDGES {
        let mut edge = Edge::enroll_with(&cloud, &token, &["--device-authority", &cloud_hex])?;
        let status = edge.command().args(["status", "--json"]).output()?;
        let status: Value = serde_json::from_slice(&status.stdout)?;
        let id = status["device_id"]
            .as_u64()
            .context("the edge's device id")?;
        let mut key = [0u8; 32];
        hex::decode_to_slice(status["public_key"].as_str().unwrap_or_default(), &mut key)?;
        let certificate = hex::encode(cloud_authority.certify(id, &key));
        let certified = edge
            .command()
            .args(["certify", "--certificate", &certificate])
            .output()?;
        ensure!(
            certified.status.success(),
            "edge {e}: {}",
            String::from_utf8_lossy(&certified.stderr)
        );
        let edge_authority = DeviceAuthority::generate();
        edge.extra_args = vec![
            "--device-authority".to_string(),
            edge_authority.public_key_hex(),
        ];
        edge.start()?;
        let device_token = edge
            .admin()
            .enrollment_token(DEVICES_PER_EDGE as u32)
            .await?;
        for d in 0..DEVICES_PER_EDGE {
            let (device, _) = enroll_at_edge(&edge, &device_token).await?;
            let device = device.with_device_authority(edge_authority.public_key());
            let certificate =
                edge_authority.certify(device.device_id as u64, &device.key().public_key());
            device.install_certificate(&certificate).await?;
            let index = e * DEVICES_PER_EDGE + d;
            players.push(tokio::spawn(play(device, index, Sending::Secure, 1)));
        }
        edges.push(edge);
    }
    let version = admin
        .upload_model("tiered", support::logreg_model_bytes(16))
        .await?;
    let mut spec = tiered_job(&version, 1, EDGES, EDGES, DEVICES_PER_EDGE);
    spec["secure_aggregation"] = json!({"enabled": true});
    let job = admin.create_job(spec).await?;
    completed(&admin, job, &edges).await?;
    for player in players {
        player.await??;
    }
    Ok(())
}
