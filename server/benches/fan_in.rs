//! Benchmark: the cloud's fan-in, flat against tiered, in one run.
//!
//! Flat: N end devices (200 by default) enrolled with the cloud, a job of
//! R rounds (3) that each take all N. Tiered: the same N devices spread
//! over E edge aggregators (4), each a real `canopy-agent aggregate`
//! process, and the same job through them (`edges`), so each cloud round
//! takes E results. Devices are SDK clients in this process over real TLS;
//! they download each round's model from their server (the cloud, or their
//! edge) and upload an update of the model's layout. The model is the
//! MLP 784-128-10 (101,770 trainable parameters).
//!
//! Per round, from the cloud's own counters (`/metrics`) and `/proc`: the
//! requests it answered, the update bytes it took in, the model bytes it
//! sent, its peak RSS (`VmHWM`, reset before the job), and the round's
//! wall time from its record. Then the ratios flat/tiered. The tiered job
//! runs again with half the devices behind the same edges: the cloud's
//! peak RSS should not follow the devices it never sees.
//!
//! ```text
//! cargo build --release -p canopy-agent --bin canopy-agent
//! cargo bench -p canopy-server --bench fan_in
//! cargo bench -p canopy-server --bench fan_in -- --devices 200 --edges 4 --rounds 3
//! ```

#[path = "../tests/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};
use bytes::Bytes;
use canopy_engine::zoo::Architecture;
use canopy_protocol::auth::DeviceKey;
use canopy_protocol::update::encode_update;
use canopy_sdk::{DeviceClient, Transport};
use serde_json::{Value, json};
use support::edge::Edge;
use support::proc_stats::{proc_status_bytes, reset_peak};
use support::{Database, TestServer, model_bytes, server_counters};
use tokio::task::JoinSet;

const MIB: f64 = 1024.0 * 1024.0;
const JOB_TIMEOUT: Duration = Duration::from_secs(600);
/// Every simulated device enrolls and connects from 127.0.0.1, for the
/// cloud and the edges alike.
const LIMITS: &str = "\
sensitive_requests_per_minute = 1000000
max_connections_per_address = 10000
online_window_ms = 3600000";

struct Options {
    devices: usize,
    edges: usize,
    rounds: u32,
}

fn parse_options() -> Result<Options> {
    let mut options = Options {
        devices: 200,
        edges: 4,
        rounds: 3,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || -> Result<usize> {
            args.next()
                .and_then(|v| v.parse().ok())
                .filter(|&v: &usize| v > 0)
                .ok_or_else(|| anyhow!("{arg} needs a positive number"))
        };
        match arg.as_str() {
            "--devices" => options.devices = value()?,
            "--edges" => options.edges = value()?,
            "--rounds" => options.rounds = u32::try_from(value()?)?,
            // `cargo bench` passes `--bench` to every bench binary.
            "--bench" => {}
            other => bail!(
                "unknown argument `{other}`; usage: fan_in [--devices N] [--edges E] [--rounds R]"
            ),
        }
    }
    ensure!(
        options.devices.is_multiple_of(options.edges) && options.devices / options.edges >= 2,
        "--devices must be a multiple of --edges, with at least 2 devices per edge"
    );
    Ok(options)
}

/// One run's figures, per cloud round.
struct Figures {
    label: String,
    cloud_takes: usize,
    requests: f64,
    bytes_in: f64,
    bytes_out: f64,
    peak_rss: u64,
    round_ms: f64,
}

/// Enrolls `n` devices with the server at `transport`.
async fn enroll(transport: &Transport, token: &str, n: usize) -> Result<Vec<DeviceClient>> {
    let mut devices = Vec::with_capacity(n);
    for _ in 0..n {
        let key = DeviceKey::generate();
        let enrolled = canopy_sdk::enroll(transport, token, &key, support::capabilities()).await?;
        devices.push(DeviceClient::new(
            transport.reconnect()?,
            enrolled.device_id,
            key,
            &enrolled.server_public_key,
        )?);
    }
    Ok(devices)
}

/// A device through `rounds` rounds: poll, download (verified), upload.
async fn play(device: DeviceClient, index: usize, rounds: u32) -> Result<()> {
    for round in 0..rounds {
        let task = loop {
            if let Some(task) = device.next_task(30_000).await? {
                break task;
            }
        };
        device.download_model(&task).await?;
        let values: Vec<f32> = (0..task.layout.num_elements())
            .map(|k| ((index + k + round as usize) % 13) as f32 * 1e-4)
            .collect();
        let update = encode_update(&task.layout, 10 + index as u64 % 7, &values)?;
        device.upload_update(&task, Bytes::from(update)).await?;
    }
    Ok(())
}

fn job(version: &Value, rounds: u32, takes: usize, per_edge: Option<usize>) -> Value {
    let mut spec = json!({
        "name": "fan-in", "model_version_id": version["id"], "rounds": rounds,
        "min_devices": takes, "target_devices": takes, "over_selection": 0.0,
        "round_deadline_ms": 600_000, "local_epochs": 1, "batch_size": 32,
        "learning_rate": 0.05, "evaluation": {"fraction": 0.0},
    });
    if let Some(per_edge) = per_edge {
        spec["edges"] = json!({"min_devices": per_edge, "target_devices": per_edge,
                               "over_selection": 0.0});
    }
    spec
}

/// One job on a fresh cloud: flat when `edges` is 0.
async fn run(options: &Options, devices: usize, edges: usize) -> Result<Figures> {
    let label = match edges {
        0 => format!("flat, {devices} devices"),
        e => format!("{e} edges, {devices} devices"),
    };
    eprintln!("{label}: starting");
    let config = tempfile::tempdir()?;
    let config_path = support::limits_file(config.path(), LIMITS)?;
    let cloud = TestServer::start_with(Database::Sqlite, &["--config", &config_path])?;
    let admin = cloud.admin();
    let mut nodes = Vec::new();
    let mut fleet = Vec::new();
    if edges == 0 {
        let token = admin.enrollment_token(devices as u32).await?;
        fleet = enroll(&cloud.transport(), &token, devices).await?;
    } else {
        let token = admin
            .enrollment_token_for("aggregator", edges as u32)
            .await?;
        for _ in 0..edges {
            let mut edge = Edge::enroll(&cloud, &token)?;
            edge.extra_args = vec!["--config".to_string(), config_path.clone()];
            edge.start()?;
            let device_token = edge
                .admin()
                .enrollment_token((devices / edges) as u32)
                .await?;
            fleet.extend(enroll(&edge.transport(), &device_token, devices / edges).await?);
            nodes.push(edge);
        }
    }
    let architecture = Architecture::Mlp {
        inputs: 784,
        hidden: 128,
        classes: 10,
    };
    let version = admin
        .upload_model("fan-in", model_bytes(architecture, 7))
        .await?;
    let pid = cloud.pid().context("the cloud's pid")?;
    let before = server_counters(&admin).await?;
    reset_peak(pid).context("cannot reset the cloud's peak RSS")?;
    let mut players = JoinSet::new();
    for (index, device) in fleet.into_iter().enumerate() {
        players.spawn(play(device, index, options.rounds));
    }
    let takes = if edges == 0 { devices } else { edges };
    let per_edge = (edges > 0).then(|| devices / edges);
    let started = Instant::now();
    let job_id = admin
        .create_job(job(&version, options.rounds, takes, per_edge))
        .await?;
    let finished = admin.wait_for_job(job_id, JOB_TIMEOUT).await?;
    let peak_rss = proc_status_bytes(pid, "VmHWM").context("VmHWM")?;
    let after = server_counters(&admin).await?;
    if finished["state"] != "completed" {
        let logs: Vec<String> = nodes.iter().map(Edge::log).collect();
        bail!("{label}: job ended {finished}\n{}", logs.join("\n---\n"));
    }
    while let Some(joined) = players.join_next().await {
        joined??;
    }
    eprintln!("{label}: done in {:.1} s", started.elapsed().as_secs_f64());
    let rounds = admin.ok(&format!("/api/v1/jobs/{job_id}/rounds")).await?;
    let round_ms: Vec<f64> = rounds["items"]
        .as_array()
        .map(|items| {
            items
                .iter()
                .filter_map(|r| r["durations"]["total_ms"].as_f64())
                .collect()
        })
        .unwrap_or_default();
    let per_round = f64::from(options.rounds);
    Ok(Figures {
        label,
        cloud_takes: takes,
        requests: (after.requests - before.requests) / per_round,
        bytes_in: (after.bytes_in - before.bytes_in) / per_round,
        bytes_out: (after.bytes_out - before.bytes_out) / per_round,
        peak_rss,
        round_ms: round_ms.iter().sum::<f64>() / round_ms.len().max(1) as f64,
    })
}

fn print(figures: &[Figures]) {
    println!(
        "{:<24} {:>11} {:>14} {:>14} {:>14} {:>13} {:>11}",
        "run",
        "cloud takes",
        "requests/round",
        "bytes in/round",
        "bytes out/round",
        "peak RSS MiB",
        "round ms"
    );
    for f in figures {
        println!(
            "{:<24} {:>11} {:>14.0} {:>14.0} {:>14.0} {:>13.1} {:>11.0}",
            f.label,
            f.cloud_takes,
            f.requests,
            f.bytes_in,
            f.bytes_out,
            f.peak_rss as f64 / MIB,
            f.round_ms
        );
    }
    let (flat, tiered) = (&figures[0], &figures[1]);
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::INFINITY };
    println!(
        "flat / tiered: requests {:.1}x, bytes in {:.1}x, bytes out {:.1}x, peak RSS {:.2}x, round time {:.2}x",
        ratio(flat.requests, tiered.requests),
        ratio(flat.bytes_in, tiered.bytes_in),
        ratio(flat.bytes_out, tiered.bytes_out),
        ratio(flat.peak_rss as f64, tiered.peak_rss as f64),
        ratio(flat.round_ms, tiered.round_ms),
    );
    if let Some(half) = figures.get(2) {
        println!(
            "cloud peak RSS, tiered, {} / {}: {:.2}",
            tiered.label,
            half.label,
            ratio(tiered.peak_rss as f64, half.peak_rss as f64)
        );
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let options = parse_options()?;
    let mut figures = vec![
        run(&options, options.devices, 0).await?,
        run(&options, options.devices, options.edges).await?,
    ];
    let half = options.devices / 2;
    if half % options.edges == 0 && half / options.edges >= 2 {
        figures.push(run(&options, half, options.edges).await?);
    }
    print(&figures);
    Ok(())
}
