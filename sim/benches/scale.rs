//! Benchmark: a simulated fleet at scale against a real cloud, flat and
//! behind edge aggregators, in one run.
//!
//! The cloud is a `canopy-server serve` process (SQLite) and each edge a
//! `canopy-agent aggregate` process; the devices are `canopy-sim` fleets in
//! this process, every device enrolled with its own key over real TLS and
//! training the MLP 784-128-10 (101,770 parameters) on its IID shard of
//! MNIST-10k (repeated as often as the fleet needs: this measures the
//! system, not accuracy). Federated evaluation is off, so each round is
//! training only.
//!
//! Figures, per cloud round: its wall time (the round's record), the
//! cloud's update bytes in and model bytes out (its `/metrics`), and the
//! cloud's peak RSS (`VmHWM`, reset before the job). Then the ratios flat
//! over tiered; the cloud's peak RSS flat with the same rounds over more
//! enrolled devices (`--sweep`); and the simulator's memory per idle
//! device: this process's RSS grown by enrolling the largest fleet,
//! divided by its devices (an upper bound: it includes what enrollment's
//! connections left to the allocator).
//!
//! ```text
//! cargo build --release -p canopy-agent -p canopy-server --bin canopy-agent --bin canopy-server
//! cargo bench -p canopy-sim --bench scale
//! cargo bench -p canopy-sim --bench scale -- --devices 100000 --per-round 10000 --edges 20 --rounds 1 --sweep 1000,100000
//! ```

#[path = "../../server/tests/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};
use canopy_engine::data::{Dataset, load_dir};
use canopy_sdk::{CancelToken, Transport};
use canopy_sim::setup::{self, JobSettings};
use canopy_sim::{Fleet, FleetSettings, Partition};
use serde_json::{Value, json};
use support::edge::Edge;
use support::proc_stats::{proc_status_bytes, reset_peak};
use support::{Admin, Database, TestServer, server_counters};

const MIB: f64 = 1024.0 * 1024.0;
const JOB_TIMEOUT: Duration = Duration::from_secs(3_600);
const SEED: u64 = 5;
const HIDDEN: usize = 128;
/// Every simulated device enrolls and connects from 127.0.0.1, for the
/// cloud and the edges alike, and checks in at most every 30 s.
const LIMITS: &str = "\
sensitive_requests_per_minute = 100000000
max_enrollments_per_address = 512
max_concurrent_enrollments = 512
max_connections_per_address = 20000
max_connections = 20000
online_window_ms = 3600000";

struct Options {
    devices: usize,
    per_round: usize,
    rounds: u32,
    edges: usize,
    sweep: Vec<usize>,
}

fn parse_options() -> Result<Options> {
    let mut options = Options {
        devices: 2_000,
        per_round: 200,
        rounds: 2,
        edges: 4,
        sweep: vec![500, 2_000],
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value =
            || -> Result<String> { args.next().ok_or_else(|| anyhow!("{arg} needs a value")) };
        let number = |text: String| -> Result<usize> {
            text.parse()
                .ok()
                .filter(|&v: &usize| v > 0)
                .ok_or_else(|| anyhow!("`{text}` is not a positive number"))
        };
        match arg.as_str() {
            "--devices" => options.devices = number(value()?)?,
            "--per-round" => options.per_round = number(value()?)?,
            "--rounds" => options.rounds = u32::try_from(number(value()?)?)?,
            "--edges" => options.edges = number(value()?)?,
            "--sweep" => {
                options.sweep = value()?
                    .split(',')
                    .map(|n| number(n.to_string()))
                    .collect::<Result<_>>()?
            }
            // `cargo bench` passes `--bench` to every bench binary.
            "--bench" => {}
            other => bail!(
                "unknown argument `{other}`; usage: scale [--devices N] [--per-round K] \
                 [--rounds R] [--edges E] [--sweep N1,N2,...]"
            ),
        }
    }
    ensure!(
        options.per_round <= options.devices && options.per_round.is_multiple_of(options.edges),
        "--per-round must be at most --devices and a multiple of --edges"
    );
    ensure!(
        options.devices.is_multiple_of(options.edges),
        "--devices must be a multiple of --edges"
    );
    Ok(options)
}

/// One run's figures, per cloud round.
struct Figures {
    label: String,
    enrolled: usize,
    bytes_in: f64,
    bytes_out: f64,
    peak_rss: u64,
    round_ms: f64,
    /// This process's RSS grown by enrolling the fleet, per device.
    idle_bytes_per_device: f64,
}

/// MNIST-10k's training images, repeated until there are `at_least`.
fn data(at_least: usize) -> Result<Dataset> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../datasets/mnist-10k");
    let (train, _) = load_dir(dir)?;
    let copies = at_least.div_ceil(train.len()).max(1);
    let features: Vec<f32> = (0..copies)
        .flat_map(|_| train.features().iter().copied())
        .collect();
    let labels: Vec<i64> = (0..copies)
        .flat_map(|_| train.labels().iter().copied())
        .collect();
    Ok(Dataset::new(
        features,
        train.feature_shape().to_vec(),
        labels,
        train.num_classes(),
    )?)
}

/// The job once it has left `running`. A busy machine (twenty edges and a
/// fleet on two cores) can stall an admin request past its timeout; that
/// is retried until the job's own timeout, not taken as the run's end.
async fn finished(admin: &Admin, job: i64) -> Result<Value> {
    let deadline = Instant::now() + JOB_TIMEOUT;
    loop {
        match admin.ok(&format!("/api/v1/jobs/{job}")).await {
            Ok(state) if !matches!(state["state"].as_str(), Some("running" | "created")) => {
                return Ok(state);
            }
            Ok(_) => {}
            Err(error) => eprintln!("job {job}: reading its state failed, retrying: {error:#}"),
        }
        ensure!(
            Instant::now() < deadline,
            "job {job} did not finish in {JOB_TIMEOUT:?}"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

fn own_rss() -> u64 {
    proc_status_bytes(std::process::id(), "VmRSS").unwrap_or(0)
}

/// Enrolls `shards` with the server at `transport`, checking in at the
/// pace of a fleet of `all` devices (every fleet of a run shares the
/// machine's one check-in budget).
async fn fleet(
    transport: Transport,
    token: &str,
    shards: Vec<Dataset>,
    all: usize,
) -> Result<Fleet> {
    let mut settings = FleetSettings::new(shards.len(), SEED, "mnist");
    settings.check_in_ms = FleetSettings::new(all, SEED, "mnist").check_in_ms;
    Ok(Fleet::enroll(transport, token, shards, settings, |_| {}).await?)
}

fn job(version: &Value, rounds: u32, per_round: usize, edges: usize) -> Value {
    let takes = if edges == 0 { per_round } else { edges };
    let settings = JobSettings {
        name: "scale".into(),
        rounds,
        per_round: takes as u32,
        epochs: 1,
        batch_size: 16,
        learning_rate: 0.05,
        round_deadline_ms: 1_800_000,
        central_dataset: None,
        strategy: None,
        privacy: None,
        robust: None,
        compression: None,
        buffer: None,
    };
    let mut body = settings.body(version["id"].as_i64().unwrap_or_default());
    body["evaluation"] = json!({"fraction": 0.0});
    if let Some(per_edge) = per_round.checked_div(edges) {
        body["edges"] = json!({"min_devices": per_edge, "target_devices": per_edge,
                               "over_selection": 0.0});
    }
    body
}

/// One job on a fresh cloud with `enrolled` devices: flat when `edges` is 0.
async fn run(
    options: &Options,
    enrolled: usize,
    per_round: usize,
    edges: usize,
) -> Result<Figures> {
    let label = match edges {
        0 => format!("flat, {enrolled} devices"),
        e => format!("{e} edges, {enrolled} devices"),
    };
    eprintln!("{label}: enrolling");
    let config = tempfile::tempdir()?;
    let config_path = support::limits_file(config.path(), LIMITS)?;
    let cloud = TestServer::start_with(Database::Sqlite, &["--config", &config_path])?;
    let admin = cloud.admin();
    let data = data(enrolled)?;
    let mut shards = Partition::Iid.deal(&data, enrolled, SEED)?;
    let model = setup::initial_model(&data, HIDDEN, SEED)?;
    drop(data);
    let before_enrolling = own_rss();
    let mut fleets = Vec::new();
    let mut edge_nodes = Vec::new();
    if edges == 0 {
        let token = admin.enrollment_token(enrolled as u32).await?;
        fleets.push(fleet(cloud.transport(), &token, shards, enrolled).await?);
    } else {
        let token = admin
            .enrollment_token_for("aggregator", edges as u32)
            .await?;
        let per_edge = enrolled / edges;
        for _ in 0..edges {
            let mut edge = Edge::enroll(&cloud, &token)?;
            edge.extra_args = vec!["--config".to_string(), config_path.clone()];
            edge.start()?;
            let device_token = edge.admin().enrollment_token(per_edge as u32).await?;
            let rest = shards.split_off(per_edge);
            fleets.push(fleet(edge.transport(), &device_token, shards, enrolled).await?);
            shards = rest;
            edge_nodes.push(edge);
        }
    }
    let idle_bytes_per_device = own_rss().saturating_sub(before_enrolling) as f64 / enrolled as f64;
    let version = admin.upload_model("scale", model).await?;
    let pid = cloud.pid().context("the cloud's pid")?;
    let before = server_counters(&admin).await?;
    reset_peak(pid).context("cannot reset the cloud's peak RSS")?;
    let stop = CancelToken::new();
    let mut running = tokio::task::JoinSet::new();
    for fleet in fleets {
        let stop = stop.clone();
        running.spawn(async move { fleet.run(stop).await });
    }
    eprintln!("{label}: running");
    let started = Instant::now();
    let job_id = admin
        .create_job(job(&version, options.rounds, per_round, edges))
        .await?;
    let finished = finished(&admin, job_id).await?;
    let peak_rss = proc_status_bytes(pid, "VmHWM").context("VmHWM")?;
    let after = server_counters(&admin).await?;
    stop.cancel();
    while running.join_next().await.is_some() {}
    if finished["state"] != "completed" {
        let logs: Vec<String> = edge_nodes.iter().map(Edge::log).collect();
        bail!("{label}: job ended {finished}\n{}", logs.join("\n---\n"));
    }
    eprintln!("{label}: done in {:.1} s", started.elapsed().as_secs_f64());
    let rounds = admin.ok(&format!("/api/v1/jobs/{job_id}/rounds")).await?;
    let round_ms: Vec<f64> = rounds["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| r["durations"]["total_ms"].as_f64())
        .collect();
    let per_round_count = f64::from(options.rounds);
    Ok(Figures {
        label,
        enrolled,
        bytes_in: (after.bytes_in - before.bytes_in) / per_round_count,
        bytes_out: (after.bytes_out - before.bytes_out) / per_round_count,
        peak_rss,
        round_ms: round_ms.iter().sum::<f64>() / round_ms.len().max(1) as f64,
        idle_bytes_per_device,
    })
}

fn print_heading() {
    println!(
        "{:<26} {:>15} {:>16} {:>13} {:>10} {:>17}",
        "run", "bytes in/round", "bytes out/round", "peak RSS MiB", "round s", "idle B/device"
    );
}

/// One run's row, printed as soon as it ends.
fn print_row(f: &Figures) {
    println!(
        "{:<26} {:>15.0} {:>16.0} {:>13.1} {:>10.1} {:>17.0}",
        f.label,
        f.bytes_in,
        f.bytes_out,
        f.peak_rss as f64 / MIB,
        f.round_ms / 1000.0,
        f.idle_bytes_per_device
    );
}

fn print_ratios(main: &[Figures], sweep: &[Figures]) {
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::INFINITY };
    let (flat, tiered) = (&main[0], &main[1]);
    println!(
        "flat / tiered: cloud bytes in {:.1}x, bytes out {:.1}x, peak RSS {:.2}x, round time {:.2}x",
        ratio(flat.bytes_in, tiered.bytes_in),
        ratio(flat.bytes_out, tiered.bytes_out),
        ratio(flat.peak_rss as f64, tiered.peak_rss as f64),
        ratio(flat.round_ms, tiered.round_ms),
    );
    if let (Some(small), Some(large)) = (sweep.first(), sweep.last()) {
        println!(
            "cloud peak RSS, flat, {} over {} enrolled devices: {:.2}",
            large.enrolled,
            small.enrolled,
            ratio(large.peak_rss as f64, small.peak_rss as f64)
        );
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let options = parse_options()?;
    print_heading();
    let mut main = Vec::new();
    for edges in [0, options.edges] {
        main.push(run(&options, options.devices, options.per_round, edges).await?);
        print_row(main.last().expect("a run"));
    }
    let smallest = options
        .sweep
        .iter()
        .copied()
        .min()
        .unwrap_or(options.devices);
    let sweep_round = options.per_round.min(smallest);
    let mut sweep = Vec::new();
    for &enrolled in &options.sweep {
        sweep.push(run(&options, enrolled, sweep_round, 0).await?);
        print_row(sweep.last().expect("a run"));
    }
    print_ratios(&main, &sweep);
    Ok(())
}
