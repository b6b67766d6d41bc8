//! Central differential privacy (DP-FedAvg) through a real server, on
//! SQLite and PostgreSQL: every version a private job writes equals
//! DP-FedAvg computed here from the same updates (each clipped, each
//! weighing one, the round's noise, the fixed denominator), the noise has
//! the configured scale, the job's ε after each round is the accountant's
//! for the sampling rates its rounds had, a `kill -9` mid-round changes
//! none of it, and the job stops, completed, before the round that would
//! pass its budget.

use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use bytes::Bytes;
use canopy_privacy::{Accountant, Conversion, Event, Orders};
use canopy_protocol::messages::Task;
use canopy_protocol::update::{UpdateLayout, clip_to_norm, encode_update};
use canopy_sdk::DeviceClient;
use serde_json::{Value, json};

use crate::support::{
    Database, TestServer, enroll_device, fetch_model, logreg_model_bytes, poll_task, trainable,
};

const JOB_TIMEOUT: Duration = Duration::from_secs(120);
const DEVICES: usize = 6;
const TARGET: usize = 4;
const ROUNDS: u32 = 3;
const NOISE_MULTIPLIER: f64 = 1.0;
const CLIP_NORM: f64 = 0.05;
const DELTA: f64 = 1e-5;

/// A deterministic update of one device in one round. Device 1's is far
/// shorter than the clip norm (left as it is), every other device's far
/// longer (scaled down to it).
fn delta(layout: &UpdateLayout, device_id: i64, round: u32) -> Vec<f32> {
    let mut state =
        (device_id as u64 * 7919 + u64::from(round)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let scale = if device_id == 1 { 1e-3 } else { 1.0 };
    (0..layout.num_elements())
        .map(|i| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let unit = (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            scale * unit * 0.02 * (1.0 + (i % 5) as f32)
        })
        .collect()
}

/// Sample counts that differ by device: a private round must ignore them.
fn samples_of(device_id: i64) -> u64 {
    10 + 50 * device_id as u64
}

/// The ε the accountant gives `rounds` rounds at the rate every round of
/// this test has: 4 of 6 devices.
fn epsilon_after(rounds: u64) -> f64 {
    let rate = TARGET as f64 / DEVICES as f64;
    let mut accountant = Accountant::new(Orders::standard());
    accountant
        .compose(&Event::gaussian(rate, NOISE_MULTIPLIER, rounds))
        .unwrap();
    accountant
        .epsilon(DELTA, Conversion::Tight)
        .unwrap()
        .epsilon
}

/// A budget that two rounds fit and three do not.
fn budget() -> f64 {
    0.5 * (epsilon_after(2) + epsilon_after(3))
}

fn spec(version_id: i64) -> Value {
    json!({
        "name": "dp-fedavg", "model_version_id": version_id, "rounds": ROUNDS,
        "min_devices": TARGET, "target_devices": TARGET, "over_selection": 0.0,
        "evaluation": {"fraction": 0.0}, "round_deadline_ms": 120_000, "local_epochs": 1,
        "batch_size": 8, "learning_rate": 0.1,
        "differential_privacy": {
            "noise_multiplier": NOISE_MULTIPLIER, "clip_norm": CLIP_NORM, "delta": DELTA,
            "budget_epsilon": budget(),
        },
    })
}

/// The job with adaptive clipping, at its defaults.
fn adaptive_spec(version_id: i64) -> Value {
    let mut spec = spec(version_id);
    spec["differential_privacy"]["adaptive_clipping"] = json!({});
    spec
}

async fn send(device: &DeviceClient, task: &Task, adaptive: bool) -> Result<()> {
    match (&task.privacy, adaptive) {
        // The server must see whether each update was within the clip.
        (None, true) => {}
        (Some(privacy), false) => ensure!(privacy.clip_norm == CLIP_NORM, "{privacy:?}"),
        (privacy, _) => bail!("adaptive {adaptive}, the task asks for {privacy:?}"),
    }
    device.download_model(task).await?;
    // Sent unclipped: the server's clipping is what is under test here
    // (the SDK's is `a_private_task_clips_the_update_it_sends`).
    let values = delta(&task.layout, device.device_id, task.round_number);
    let encoded = encode_update(&task.layout, samples_of(device.device_id), &values)?;
    device.upload_update(task, Bytes::from(encoded)).await?;
    Ok(())
}

/// One round as it ran: its id and the devices selected for it.
struct RoundRun {
    id: i64,
    number: u32,
    devices: Vec<i64>,
}

/// Every device asks for a task at once; the selected ones get it.
async fn selected_tasks(devices: &[DeviceClient]) -> Result<Vec<(usize, Task)>> {
    loop {
        let polls = devices.iter().map(|device| device.next_task(2_000));
        let answers = futures_util::future::join_all(polls).await;
        let mut tasks = Vec::new();
        for (index, answer) in answers.into_iter().enumerate() {
            if let Some(task) = answer? {
                tasks.push((index, task));
            }
        }
        if !tasks.is_empty() {
            ensure!(tasks.len() == TARGET, "{} devices got a task", tasks.len());
            return Ok(tasks);
        }
    }
}

/// Runs the job; with `kill_in_round`, the server is killed with SIGKILL
/// after half of that round's updates and restarted.
async fn run_job(
    database: Database,
    kill_in_round: Option<u32>,
    adaptive: bool,
) -> Result<(TestServer, i64, Vec<RoundRun>)> {
    let mut server = TestServer::start(database)?;
    let admin = server.admin();
    let version = admin.upload_model("logreg", logreg_model_bytes(11)).await?;
    let token = admin.enrollment_token(DEVICES as u32).await?;
    let mut devices = Vec::new();
    for _ in 0..DEVICES {
        let device = enroll_device(&server, &token).await?;
        // Online before the job starts, so each round chooses 4 of 6.
        device.next_task(0).await?;
        devices.push(device);
    }
    let version_id = version["id"].as_i64().unwrap_or_default();
    let job = match adaptive {
        true => admin.create_job(adaptive_spec(version_id)).await?,
        false => admin.create_job(spec(version_id)).await?,
    };
    let mut runs = Vec::new();
    for round in 1..ROUNDS {
        let tasks = selected_tasks(&devices).await?;
        ensure!(tasks.iter().all(|(_, task)| task.round_number == round));
        let killed = kill_in_round == Some(round);
        let first = if killed { TARGET / 2 } else { TARGET };
        for (index, task) in tasks.iter().take(first) {
            send(&devices[*index], task, adaptive).await?;
        }
        if killed {
            server.restart()?;
            for device in &mut devices {
                device.set_transport(server.transport());
            }
            for (index, _) in tasks.iter().skip(first) {
                let task = poll_task(&devices[*index]).await?;
                ensure!(
                    task.round_number == round,
                    "the same round after the restart"
                );
                send(&devices[*index], &task, adaptive).await?;
            }
        }
        runs.push(RoundRun {
            id: tasks[0].1.round_id,
            number: round,
            devices: tasks
                .iter()
                .map(|(index, _)| devices[*index].device_id)
                .collect(),
        });
        if round == 1 {
            // While the job runs, Prometheus shows what it has spent.
            let gauge = gauge_after(&server, job, 1).await?;
            ensure!(
                (gauge / epsilon_after(1) - 1.0).abs() < 1e-9,
                "gauge {gauge}"
            );
        }
    }
    let finished = server.admin().wait_for_job(job, JOB_TIMEOUT).await?;
    ensure!(finished["state"] == "completed", "{finished}");
    Ok((server, job, runs))
}

/// The job's noise secret, read where only the server keeps it.
async fn noise_seed(server: &TestServer, job: i64) -> Result<String> {
    sqlx::any::install_default_drivers();
    let pool = sqlx::any::AnyPoolOptions::new()
        .max_connections(1)
        .connect(&server.database_url)
        .await?;
    let seed: Option<String> = sqlx::query_scalar("SELECT dp_noise_seed FROM jobs WHERE id = $1")
        .bind(job)
        .fetch_one(&pool)
        .await?;
    pool.close().await;
    seed.context("a private job has a noise secret")
}

/// How each round clipped, and the noise multiplier of its sum.
struct Clipping {
    /// Each round's clip, in order.
    clips: Vec<f64>,
    sum_noise_multiplier: f64,
}

impl Clipping {
    fn fixed(rounds: usize) -> Clipping {
        Clipping {
            clips: vec![CLIP_NORM; rounds],
            sum_noise_multiplier: NOISE_MULTIPLIER,
        }
    }
}

/// DP-FedAvg over the rounds as they ran: each selected device's update
/// clipped, summed with weight one, plus the round's noise drawn from the
/// job's secret `seed` (none: without noise), over the target, added to
/// the model (FedAvg's server step of one).
fn expected_dp_fedavg(
    base: &[f32],
    layout: &UpdateLayout,
    runs: &[RoundRun],
    seed: Option<&str>,
    clipping: &Clipping,
) -> Result<Vec<f32>> {
    let mut theta = base.to_vec();
    for (run, &clip) in runs.iter().zip(&clipping.clips) {
        let mut sum = vec![0.0f64; theta.len()];
        for &device in &run.devices {
            let mut update = delta(layout, device, run.number);
            clip_to_norm(&mut update, clip);
            for (total, value) in sum.iter_mut().zip(&update) {
                *total += f64::from(*value);
            }
        }
        if let Some(seed) = seed {
            let stddev = clipping.sum_noise_multiplier * clip;
            canopy_server::privacy::add_noise(&mut sum, seed, run.id, stddev)
                .map_err(anyhow::Error::msg)?;
        }
        for (parameter, total) in theta.iter_mut().zip(&sum) {
            *parameter = (f64::from(*parameter) + total / TARGET as f64) as f32;
        }
    }
    Ok(theta)
}

async fn private_job(database: Database, kill_in_round: Option<u32>) -> Result<()> {
    let base = canopy_ir::format::read_model(&logreg_model_bytes(11))?;
    let layout = canopy_server::fedavg::layout_of(&base)?;
    let (server, job, runs) = run_job(database, kill_in_round, false).await?;
    let admin = server.admin();

    // Stopped before round 3, whose ε would pass the budget.
    let job_view = admin.ok(&format!("/api/v1/jobs/{job}")).await?;
    ensure!(job_view["rounds_completed"] == 2, "{job_view}");
    let status = job_view["status_message"].as_str().unwrap_or_default();
    ensure!(
        status.contains("stopped before round 3: the privacy budget is spent"),
        "{status}"
    );
    let spent = job_view["privacy"]["epsilon"].as_f64().unwrap_or_default();
    ensure!(
        (spent / epsilon_after(2) - 1.0).abs() < 1e-9,
        "the job spent {spent}, the accountant says {}",
        epsilon_after(2)
    );
    ensure!(job_view["privacy"]["budget_epsilon"].as_f64() == Some(budget()));
    let rounds = admin.ok(&format!("/api/v1/jobs/{job}/rounds")).await?;
    let items = rounds["items"].as_array().context("rounds")?;
    let by_number = |number: i64| -> Option<&Value> {
        items.iter().rev().find(|round| round["number"] == number)
    };
    for number in 1..=2 {
        let round = by_number(number).context("round")?;
        let rate = round["privacy"]["sampling_rate"]
            .as_f64()
            .unwrap_or_default();
        ensure!(
            (rate - TARGET as f64 / DEVICES as f64).abs() < 1e-12,
            "{round}"
        );
        let epsilon = round["privacy"]["epsilon"].as_f64().unwrap_or_default();
        ensure!(
            (epsilon / epsilon_after(number as u64) - 1.0).abs() < 1e-9,
            "{round}"
        );
    }
    let third = by_number(3).context("round 3 was opened and stopped")?;
    ensure!(third["failure"]["kind"] == "privacy_budget", "{third}");
    ensure!(third["selected"] == 0, "{third}");

    // Every version is DP-FedAvg of what was sent, with the round's noise.
    let seed = noise_seed(&server, job).await?;
    let got = trainable(&fetch_model(&admin, "logreg", 3).await?);
    let fixed = Clipping::fixed(runs.len());
    let want = expected_dp_fedavg(&trainable(&base), &layout, &runs, Some(&seed), &fixed)?;
    ensure!(
        got.len() == want.len(),
        "{} parameters, DP-FedAvg gives {}",
        got.len(),
        want.len()
    );
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        ensure!(
            (g - w).abs() <= 1e-6 * w.abs().max(1.0),
            "parameter {i} is {g}, DP-FedAvg gives {w}"
        );
    }

    // And the noise has the configured scale: what the model moved by,
    // less the clipped updates, over 650 coordinates and two rounds.
    let noiseless = expected_dp_fedavg(&trainable(&base), &layout, &runs, None, &fixed)?;
    let residuals: Vec<f64> = got
        .iter()
        .zip(&noiseless)
        .map(|(g, n)| f64::from(g - n) * TARGET as f64)
        .collect();
    let variance = residuals.iter().map(|r| r * r).sum::<f64>() / residuals.len() as f64;
    // Two rounds of noise σC each add up to a variance of 2(σC)². A
    // variance from 650 draws has a relative standard error of √(2/650),
    // 5.5 %: 30 % is five of them, and any mistake of scale (σ for σC, the
    // sum for the mean) is a factor of 16 or more.
    let expected = 2.0 * (NOISE_MULTIPLIER * CLIP_NORM).powi(2);
    ensure!(
        (variance / expected - 1.0).abs() < 0.3,
        "the noise's variance is {variance}, configured {expected}"
    );

    // Prometheus shows running jobs only; ε stays on the finished job.
    let gauge = format!("canopy_job_privacy_epsilon{{job_id=\"{job}\"}}");
    ensure!(
        !server.metrics().await?.contains(&gauge),
        "a finished job's gauge lingers"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dp_fedavg_is_exact_and_stops_at_its_budget_on_sqlite() -> Result<()> {
    private_job(Database::Sqlite, None).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dp_fedavg_survives_kill_9_on_sqlite() -> Result<()> {
    private_job(Database::Sqlite, Some(2)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dp_fedavg_survives_kill_9_on_postgres() -> Result<()> {
    private_job(Database::Postgres, Some(2)).await
}

/// Adaptive clipping (Andrew et al. 2021), at its defaults: devices send
/// their updates whole, the fold clips each to the round's clip and counts
/// those within it, and after each round the clip moves by
/// exp(−η·(b̃ − γ)), b̃ the noisy, centred fraction within it; the updates'
/// sum gets σ_Δ = (σ⁻² − (2σ_b)⁻²)^(−1/2) times the clip, so that the
/// accountant's Gaussian of multiplier σ covers both releases. Device 1's
/// update is within any clip here, every other's far past it. A kill -9
/// in round 2 changes nothing.
async fn adaptive_job(database: Database) -> Result<()> {
    let base = canopy_ir::format::read_model(&logreg_model_bytes(11))?;
    let layout = canopy_server::fedavg::layout_of(&base)?;
    let (server, job, runs) = run_job(database, Some(2), true).await?;
    let admin = server.admin();
    let seed = noise_seed(&server, job).await?;
    // The defaults: γ = ½, η = 0.2, σ_b = max(target/20, σ) = 1.
    let (quantile, rate, count_stddev) = (0.5, 0.2, 1.0f64);
    let mut clips = vec![CLIP_NORM];
    for run in &runs {
        let clip = *clips.last().context("a clip")?;
        let within = run
            .devices
            .iter()
            .filter(|&&device| {
                let update = delta(&layout, device, run.number);
                let norm = update
                    .iter()
                    .map(|v| f64::from(*v).powi(2))
                    .sum::<f64>()
                    .sqrt();
                norm <= clip
            })
            .count() as f64;
        let noise = canopy_server::privacy::count_noise(&seed, run.id, count_stddev)
            .map_err(anyhow::Error::msg)?;
        let fraction = (within - TARGET as f64 / 2.0 + noise) / TARGET as f64 + 0.5;
        clips.push(clip * (-rate * (fraction - quantile)).exp());
    }
    let rounds = admin.ok(&format!("/api/v1/jobs/{job}/rounds")).await?;
    let items = rounds["items"].as_array().context("rounds")?;
    for (run, clip) in runs.iter().zip(&clips) {
        let round = items
            .iter()
            .find(|round| round["id"] == run.id)
            .context("the round")?;
        let shown = round["privacy"]["clip_norm"].as_f64().unwrap_or_default();
        ensure!((shown / clip - 1.0).abs() < 1e-12, "clip {clip}: {round}");
    }
    let job_view = admin.ok(&format!("/api/v1/jobs/{job}")).await?;
    let next = job_view["privacy"]["clip_norm"]
        .as_f64()
        .unwrap_or_default();
    ensure!(
        (next / clips[runs.len()] - 1.0).abs() < 1e-12,
        "the next clip is {next}, expected {}",
        clips[runs.len()]
    );
    ensure!(clips[1] != CLIP_NORM, "the clip moved: {clips:?}");
    // Both releases together are the same Gaussian: the same ε as before.
    let spent = job_view["privacy"]["epsilon"].as_f64().unwrap_or_default();
    ensure!((spent / epsilon_after(2) - 1.0).abs() < 1e-9, "{job_view}");

    let clipping = Clipping {
        clips: clips[..runs.len()].to_vec(),
        sum_noise_multiplier: (NOISE_MULTIPLIER.powi(-2) - (2.0 * count_stddev).powi(-2))
            .powf(-0.5),
    };
    let got = trainable(&fetch_model(&admin, "logreg", 3).await?);
    let want = expected_dp_fedavg(&trainable(&base), &layout, &runs, Some(&seed), &clipping)?;
    ensure!(got.len() == want.len());
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        ensure!(
            (g - w).abs() <= 1e-6 * w.abs().max(1.0),
            "parameter {i} is {g}, adaptive DP-FedAvg gives {w}"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adaptive_clipping_follows_the_noisy_quantile_through_kill_9_on_sqlite() -> Result<()> {
    adaptive_job(Database::Sqlite).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adaptive_clipping_follows_the_noisy_quantile_through_kill_9_on_postgres() -> Result<()> {
    adaptive_job(Database::Postgres).await
}

/// Settings are checked at creation; the 422 names the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_privacy_settings_are_refused_by_name() -> Result<()> {
    let server = TestServer::start(Database::Sqlite)?;
    let admin = server.admin();
    let version = admin.upload_model("logreg", logreg_model_bytes(1)).await?;
    let id = version["id"].as_i64().unwrap_or_default();
    let dp = |patch: Value| {
        let mut settings = json!({"noise_multiplier": 1.0, "clip_norm": 1.0, "delta": 1e-5});
        for (key, value) in patch.as_object().into_iter().flatten() {
            settings[key] = value.clone();
        }
        json!({"differential_privacy": settings})
    };
    for (patch, needle) in [
        (
            dp(json!({"noise_multiplier": 0.0})),
            "`differential_privacy.noise_multiplier` must be in (0, 1000000]",
        ),
        (
            dp(json!({"noise_multiplier": -2.0})),
            "differential_privacy.noise_multiplier",
        ),
        (
            dp(json!({"clip_norm": 0.0})),
            "`differential_privacy.clip_norm` must be in (0, 1000000]",
        ),
        (
            dp(json!({"delta": 0.0})),
            "`differential_privacy.delta` must be in (0, 1]",
        ),
        (
            dp(json!({"budget_epsilon": -1.0})),
            "`differential_privacy.budget_epsilon` must be in (0, 1000000]",
        ),
        (dp(json!({"sigma": 1.0})), "sigma"),
        (
            dp(json!({"adaptive_clipping": {"target_quantile": 0.0}})),
            "`differential_privacy.adaptive_clipping.target_quantile` must be in (0, 1]",
        ),
        (
            dp(json!({"adaptive_clipping": {"learning_rate": 11.0}})),
            "`differential_privacy.adaptive_clipping.learning_rate` must be in (0, 10]",
        ),
        (
            dp(json!({"adaptive_clipping": {"count_noise_stddev": 0.5}})),
            "`differential_privacy.adaptive_clipping.count_noise_stddev` is 0.5, and adaptive \
             clipping needs more than half the noise multiplier (0.5)",
        ),
        (
            {
                let mut patch = dp(json!({"adaptive_clipping": {}}));
                patch["secure_aggregation"] = json!({"enabled": true});
                patch
            },
            "`differential_privacy.adaptive_clipping` cannot be combined with \
             `secure_aggregation`",
        ),
        (
            dp(json!({"budget_epsilon": 0.001})),
            "`differential_privacy.budget_epsilon` is 0.001, below what one round spends",
        ),
        (
            {
                let mut patch = dp(json!({}));
                patch["secure_aggregation"] = json!({"enabled": true, "bits": 11});
                patch
            },
            "bits = 11 could overflow with distributed differential privacy",
        ),
        (
            {
                let mut patch = dp(json!({}));
                patch["asynchronous"] = json!({"concurrency": 4});
                patch
            },
            "`differential_privacy` cannot be combined with `asynchronous`",
        ),
    ] {
        let mut body = spec(id);
        body.as_object_mut()
            .context("spec")?
            .remove("differential_privacy");
        for (key, value) in patch.as_object().into_iter().flatten() {
            body[key] = value.clone();
        }
        admin.job_refused(body, needle, &patch.to_string()).await?;
    }
    Ok(())
}

/// The CLI's planner and a job agree: a job reports ε by the conversion
/// `canopy privacy epsilon` prints by default.
#[test]
fn the_job_conversion_is_the_planners_default() {
    assert_eq!(canopy_server::privacy::CONVERSION, Conversion::default());
}

/// Waits until the running job has finished `rounds` rounds, then reads
/// its ε from `/metrics`.
async fn gauge_after(server: &TestServer, job: i64, rounds: i64) -> Result<f64> {
    let admin = server.admin();
    let deadline = std::time::Instant::now() + JOB_TIMEOUT;
    loop {
        let view = admin.ok(&format!("/api/v1/jobs/{job}")).await?;
        if view["rounds_completed"] == rounds {
            break;
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "round {rounds} never finished: {view}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let gauge = format!("canopy_job_privacy_epsilon{{job_id=\"{job}\"}} ");
    let text = server.metrics().await?;
    let value = text
        .lines()
        .find_map(|line| line.strip_prefix(&gauge))
        .with_context(|| format!("no `{gauge}` in /metrics:\n{text}"))?;
    Ok(value.trim().parse()?)
}
