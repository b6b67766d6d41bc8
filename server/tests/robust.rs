//! Robust aggregation through a real server, on SQLite and PostgreSQL:
//! every version a robust job writes equals its rule (coordinate-wise
//! median, trimmed mean, Krum, Multi-Krum) computed here from the updates
//! the devices sent, two of seven of them poisoned (and claiming a million
//! samples each); a `kill -9` after half
//! a round's updates were stored changes nothing; the stored updates are
//! deleted once their round is over; bad settings are refused by name.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use bytes::Bytes;
use canopy_protocol::messages::Task;
use canopy_protocol::update::{UpdateLayout, encode_update};
use canopy_sdk::DeviceClient;
use serde_json::{Value, json};

use crate::support::{
    Database, TestServer, enroll_device, fetch_model, logreg_model_bytes, poll_task, trainable,
};

const JOB_TIMEOUT: Duration = Duration::from_secs(120);
/// Every device trains in every round.
const DEVICES: usize = 7;
/// The first two devices enrolled send poisoned updates.
const ATTACKERS: usize = 2;
const ROUNDS: u32 = 2;

/// A deterministic update: the honest ones scatter around a direction
/// they share; an attacker's is the same flipped and scaled by ten.
fn delta(layout: &UpdateLayout, device: usize, round: u32) -> Vec<f32> {
    let mut state = (device as u64 * 7919 + u64::from(round)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let attacker = device < ATTACKERS;
    (0..layout.num_elements())
        .map(|i| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let unit = (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            let honest = 0.01 * (1.0 + (i % 3) as f32) + 0.004 * unit;
            if attacker { -10.0 * honest } else { honest }
        })
        .collect()
}

fn spec(version_id: i64, robust: Value) -> Value {
    json!({
        "name": "robust", "model_version_id": version_id, "rounds": ROUNDS,
        "min_devices": DEVICES, "target_devices": DEVICES, "over_selection": 0.0,
        "evaluation": {"fraction": 0.0}, "round_deadline_ms": 120_000, "local_epochs": 1,
        "batch_size": 8, "learning_rate": 0.1,
        "robust_aggregation": robust,
    })
}

/// Each rule as the test computes it, independently of the server's code:
/// sorting whole columns, every distance in full.
#[derive(Clone, Copy, Debug)]
enum Expected {
    Median,
    TrimmedMean(usize),
    MultiKrum { byzantine: usize, selected: usize },
}

impl Expected {
    fn aggregate(self, updates: &[Vec<f32>]) -> Vec<f64> {
        let len = updates[0].len();
        let column = |j: usize| {
            let mut column: Vec<f64> = updates.iter().map(|u| f64::from(u[j])).collect();
            column.sort_by(f64::total_cmp);
            column
        };
        match self {
            Expected::Median => (0..len)
                .map(|j| {
                    let column = column(j);
                    let n = column.len();
                    if n % 2 == 1 {
                        column[n / 2]
                    } else {
                        0.5 * (column[n / 2 - 1] + column[n / 2])
                    }
                })
                .collect(),
            Expected::TrimmedMean(trim) => (0..len)
                .map(|j| {
                    let column = column(j);
                    let kept = &column[trim..column.len() - trim];
                    kept.iter().sum::<f64>() / kept.len() as f64
                })
                .collect(),
            Expected::MultiKrum {
                byzantine,
                selected,
            } => {
                let n = updates.len();
                let distance = |a: &[f32], b: &[f32]| -> f64 {
                    a.iter()
                        .zip(b)
                        .map(|(x, y)| (f64::from(*x) - f64::from(*y)).powi(2))
                        .sum()
                };
                let mut scored: Vec<(f64, usize)> = (0..n)
                    .map(|i| {
                        let mut to_others: Vec<f64> = (0..n)
                            .filter(|&j| j != i)
                            .map(|j| distance(&updates[i], &updates[j]))
                            .collect();
                        to_others.sort_by(f64::total_cmp);
                        (to_others[..n - byzantine - 2].iter().sum(), i)
                    })
                    .collect();
                scored.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
                let mut chosen: Vec<usize> = scored[..selected].iter().map(|s| s.1).collect();
                chosen.sort_unstable();
                assert!(
                    chosen.iter().all(|&i| i >= ATTACKERS),
                    "Krum chose an attacker"
                );
                (0..len)
                    .map(|j| {
                        chosen
                            .iter()
                            .map(|&i| f64::from(updates[i][j]))
                            .sum::<f64>()
                            / selected as f64
                    })
                    .collect()
            }
        }
    }
}

async fn send(device: &DeviceClient, index: usize, task: &Task) -> Result<()> {
    device.download_model(task).await?;
    let values = delta(&task.layout, index, task.round_number);
    // Attackers also claim many samples: a robust rule must ignore them.
    let samples = if index < ATTACKERS { 1_000_000 } else { 20 };
    let encoded = encode_update(&task.layout, samples, &values)?;
    device.upload_update(task, Bytes::from(encoded)).await?;
    Ok(())
}

/// The server's devices, in the order they enrolled (the first
/// `ATTACKERS` attack), each online.
async fn enroll_all(server: &TestServer) -> Result<Vec<DeviceClient>> {
    let token = server.admin().enrollment_token(DEVICES as u32).await?;
    let mut devices = Vec::new();
    for _ in 0..DEVICES {
        let device = enroll_device(server, &token).await?;
        device.next_task(0).await?;
        devices.push(device);
    }
    Ok(devices)
}

/// Runs a robust job to its end; with `kill_in_round`, the server is
/// killed with SIGKILL after half of that round's updates and restarted.
async fn run_job(
    server: &mut TestServer,
    devices: &mut [DeviceClient],
    version: &Value,
    robust: Value,
    kill_in_round: Option<u32>,
) -> Result<i64> {
    let version_id = version["id"].as_i64().unwrap_or_default();
    let job = server.admin().create_job(spec(version_id, robust)).await?;
    for round in 1..=ROUNDS {
        let mut tasks = Vec::new();
        for (index, device) in devices.iter().enumerate() {
            let task = poll_task(device).await?;
            ensure!(task.round_number == round, "round {}", task.round_number);
            tasks.push((index, task));
        }
        let killed = kill_in_round == Some(round);
        let first = if killed { DEVICES / 2 } else { DEVICES };
        for (index, task) in tasks.iter().take(first) {
            send(&devices[*index], *index, task).await?;
        }
        if killed {
            server.restart()?;
            for device in devices.iter_mut() {
                device.set_transport(server.transport());
            }
            for (index, _) in tasks.iter().skip(first) {
                let task = poll_task(&devices[*index]).await?;
                ensure!(
                    task.round_number == round,
                    "the same round after the restart"
                );
                send(&devices[*index], *index, &task).await?;
            }
        }
    }
    let finished = server.admin().wait_for_job(job, JOB_TIMEOUT).await?;
    ensure!(finished["state"] == "completed", "{finished}");
    Ok(job)
}

/// The model after `ROUNDS` rounds of `rule` over this test's updates,
/// each round's aggregate added to it (FedAvg's server step of one).
fn expected_model(base: &[f32], layout: &UpdateLayout, rule: Expected) -> Vec<f32> {
    let mut theta = base.to_vec();
    for round in 1..=ROUNDS {
        let updates: Vec<Vec<f32>> = (0..DEVICES).map(|d| delta(layout, d, round)).collect();
        for (parameter, step) in theta.iter_mut().zip(rule.aggregate(&updates)) {
            *parameter = (f64::from(*parameter) + step) as f32;
        }
    }
    theta
}

/// The job's last version against `rule` computed here.
async fn check_version(
    server: &TestServer,
    version: i64,
    rule: Expected,
    what: &str,
) -> Result<()> {
    let base = canopy_ir::format::read_model(&logreg_model_bytes(11))?;
    let layout = canopy_server::fedavg::layout_of(&base)?;
    let got = trainable(&fetch_model(&server.admin(), "logreg", version).await?);
    let want = expected_model(&trainable(&base), &layout, rule);
    ensure!(
        got.len() == want.len(),
        "{what}: {} parameters, the rule gives {}",
        got.len(),
        want.len()
    );
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        ensure!(
            (g - w).abs() <= 1e-6 * w.abs().max(1.0),
            "{what}: parameter {i} is {g}, the rule gives {w}"
        );
    }
    // The plain mean, which the attackers pull, is nowhere near.
    let mean = expected_model(&trainable(&base), &layout, Expected::TrimmedMean(0));
    let apart = got.iter().zip(&mean).any(|(g, m)| (g - m).abs() > 1e-3);
    ensure!(apart, "{what}: the version is FedAvg's");
    Ok(())
}

/// Waits until the server has deleted every robust round's stored
/// updates (it does once each round is over).
async fn updates_deleted(server: &TestServer) -> Result<()> {
    let dir = server.data_dir.path().join("blobs").join("updates");
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let left = match std::fs::read_dir(&dir) {
            Ok(entries) => entries.count(),
            Err(_) => 0,
        };
        if left == 0 {
            return Ok(());
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "{left} rounds' updates are still stored in {}",
            dir.display()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Four robust jobs, one after another, on one server: each rule's
/// versions are exact, and none is FedAvg's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_rule_is_exact_against_two_attackers_of_seven() -> Result<()> {
    let mut server = TestServer::start(Database::Sqlite)?;
    let version = server
        .admin()
        .upload_model("logreg", logreg_model_bytes(11))
        .await?;
    let mut devices = enroll_all(&server).await?;
    let jobs = [
        (json!({"rule": "median"}), Expected::Median),
        (
            // ⌊0.3 · 7⌋ = 2 from each end.
            json!({"rule": "trimmed_mean", "trim_fraction": 0.3}),
            Expected::TrimmedMean(2),
        ),
        (
            json!({"rule": "krum", "byzantine": 2}),
            Expected::MultiKrum {
                byzantine: 2,
                selected: 1,
            },
        ),
        (
            json!({"rule": "multi_krum", "byzantine": 2}),
            Expected::MultiKrum {
                byzantine: 2,
                selected: DEVICES - 2,
            },
        ),
    ];
    let mut last_version = 1;
    for (robust, expected) in jobs {
        let what = robust.to_string();
        run_job(&mut server, &mut devices, &version, robust, None).await?;
        // Each job starts from the uploaded version 1 and adds ROUNDS.
        last_version += i64::from(ROUNDS);
        check_version(&server, last_version, expected, &what).await?;
    }
    updates_deleted(&server).await
}

async fn survives_kill_9(database: Database) -> Result<()> {
    let mut server = TestServer::start(database)?;
    let version = server
        .admin()
        .upload_model("logreg", logreg_model_bytes(11))
        .await?;
    let mut devices = enroll_all(&server).await?;
    let robust = json!({"rule": "median"});
    run_job(&mut server, &mut devices, &version, robust, Some(2)).await?;
    check_version(&server, 1 + i64::from(ROUNDS), Expected::Median, "median").await?;
    updates_deleted(&server).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_robust_round_survives_kill_9_on_sqlite() -> Result<()> {
    survives_kill_9(Database::Sqlite).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_robust_round_survives_kill_9_on_postgres() -> Result<()> {
    survives_kill_9(Database::Postgres).await
}

/// Settings are checked at creation; the 422 names the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_robust_settings_are_refused_by_name() -> Result<()> {
    let server = TestServer::start(Database::Sqlite)?;
    let admin = server.admin();
    let version = admin.upload_model("logreg", logreg_model_bytes(1)).await?;
    let id = version["id"].as_i64().unwrap_or_default();
    let cases = [
        (
            json!({"robust_aggregation": {"rule": "trimmed_mean", "trim_fraction": 0.5}}),
            "`robust_aggregation.trim_fraction` must be at least 0 and below 0.5",
        ),
        (
            json!({"robust_aggregation": {"rule": "trimmed_mean"}}),
            "`robust_aggregation.trim_fraction` is required",
        ),
        (
            json!({"robust_aggregation": {"rule": "median", "trim_fraction": 0.1}}),
            "`robust_aggregation.trim_fraction` applies only to the `trimmed_mean` rule",
        ),
        (
            json!({"robust_aggregation": {"rule": "krum", "byzantine": 3}}),
            "`min_devices` must be at least 9, got 7",
        ),
        (
            json!({"robust_aggregation": {"rule": "average"}}),
            "average",
        ),
        (
            json!({"robust_aggregation": {"rule": "median", "beta": 1}}),
            "beta",
        ),
        (
            json!({"robust_aggregation": {"rule": "median"},
                   "secure_aggregation": {"enabled": true}}),
            "`robust_aggregation` cannot be combined with `secure_aggregation`: the server sees \
             only the masked sum",
        ),
        (
            json!({"robust_aggregation": {"rule": "median"},
                   "differential_privacy": {"noise_multiplier": 1.0, "clip_norm": 1.0,
                                            "delta": 1e-5}}),
            "`robust_aggregation` cannot be combined with `differential_privacy`",
        ),
    ];
    for (patch, needle) in cases {
        let mut body = spec(id, Value::Null);
        body.as_object_mut()
            .context("spec")?
            .remove("robust_aggregation");
        for (key, value) in patch.as_object().into_iter().flatten() {
            body[key] = value.clone();
        }
        admin.job_refused(body, needle, &patch.to_string()).await?;
    }
    Ok(())
}
