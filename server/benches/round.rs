//! Benchmark: one federated round of N simulated devices over loopback HTTPS.
//!
//! For each device count (1,000 and 2,000 by default) it starts a fresh
//! release `canopy-server` (SQLite, or the local PostgreSQL with
//! `--postgres`), uploads an MLP 784-128-10 (101,770 trainable f32
//! parameters), enrolls N devices, each with its own Ed25519 key and its
//! own TLS connection, and runs a one-round job with `min = target = N` and
//! no over-selection. Every device long-polls for its task, downloads and
//! verifies the model, encodes a random update of the model's layout and
//! uploads it. Devices run as tokio tasks in this process, at most
//! `--in-flight` (default 256) at once.
//!
//! It reports the round's wall time, updates folded per second, the
//! server's resident memory (idle after start-up, sampled peaks per phase,
//! `VmHWM`, and `VmRSS` after the round) and the bytes moved, then the
//! ratio of peak RSS between the largest and the smallest device count.
//! Each device count gets a fresh server process, since `VmHWM` never goes
//! down within one.
//!
//! ```text
//! cargo bench -p canopy-server --bench round
//! cargo bench -p canopy-server --bench round -- --devices 1000,2000 --postgres
//! ```
//!
//! `CANOPY_BENCH_LOG=DIR` keeps each run's server log in DIR.
//!
//! Options (or environment variables): `--devices N[,N…]`
//! (`CANOPY_BENCH_DEVICES`), `--postgres` / `--sqlite` (`CANOPY_BENCH_DB`),
//! `--in-flight N` (`CANOPY_BENCH_IN_FLIGHT`). PostgreSQL is reached at
//! `CANOPY_TEST_POSTGRES_URL` (default `postgres://postgres@127.0.0.1:5432/test`);
//! its own memory is not part of the server's RSS.
//!
//! Limits raised in the server's `--config` (see [`SERVER_CONFIG`]):
//! `sensitive_requests_per_minute`, because every simulated device enrolls
//! from 127.0.0.1 and the default of 120 a minute per address would spend
//! most of the run throttled; `max_connections_per_address`, for the same
//! reason; and `online_window_ms`, because the round
//! only selects devices seen within that window and enrolling thousands of
//! devices on a small machine can take longer than the default minute.
//! Everything else, `max_concurrent_uploads` (32 bodies in memory) included,
//! stays at its default, so the memory figures are those of a default server.
//!
//! Why a bound on devices in flight: the server's memory follows the number
//! of open connections and requests (TLS and HTTP buffers, upload bodies),
//! not the number of enrolled devices, so the bound is kept the same for
//! every N, and RSS that grows with N points at per-device state. 256 keeps
//! every upload slot and pooled connection busy, stays far below the
//! default `max_concurrent_requests` (4096) and the file-descriptor limit,
//! and makes each device's connection close when it is done. The devices
//! share the machine's cores with the server: on a small machine the
//! timings are those of the pair, and the table prints the load average so
//! that a run beside other work can be recognised.

#[path = "../tests/support/mod.rs"]
mod support;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, anyhow, bail};
use bytes::Bytes;
use canopy_engine::zoo::Architecture;
use canopy_protocol::update::encode_update;
use canopy_sdk::{DeviceClient, SdkError};
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use support::proc_stats::{RssSampler, proc_status_bytes};
use support::{Admin, Database, TestServer, enroll_device, model_bytes};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

/// The MLP 784-h-10's hidden width: 101,770 parameters at the default
/// 128, 1,009,660 at 1,270.
const DEFAULT_HIDDEN: usize = 128;

fn architecture(hidden: usize) -> Architecture {
    Architecture::Mlp {
        inputs: 784,
        hidden,
        classes: 10,
    }
}

fn expected_parameters(hidden: usize) -> i64 {
    (784 * hidden + hidden + hidden * 10 + 10) as i64
}
const DEFAULT_DEVICES: &[usize] = &[1_000, 2_000];
const DEFAULT_IN_FLIGHT: usize = 256;
/// Enrollments at once: each is one short write transaction.
const ENROLL_IN_FLIGHT: usize = 64;
/// A device's task poll; the server clamps it to `long_poll_max_ms`.
const POLL_WAIT_MS: u64 = 30_000;
/// Tries of each device request before the device gives up.
const MAX_ATTEMPTS: u32 = 3;
/// Long enough that no device of a healthy run is ever late.
const ROUND_DEADLINE_MS: u64 = 30 * 60_000;
const JOB_TIMEOUT: Duration = Duration::from_secs(300);
const MIB: f64 = 1024.0 * 1024.0;

/// The server's `--config`; see the module documentation for why.
const SERVER_CONFIG: &str = "\
[limits]
# All simulated devices enroll from 127.0.0.1; the default is 120 a minute.
sensitive_requests_per_minute = 1000000
# Devices enrolled early must still count as online when the job starts.
online_window_ms = 3600000
# All simulated devices connect from 127.0.0.1; the default is 256.
max_connections_per_address = 10000
";

struct Options {
    devices: Vec<usize>,
    database: Database,
    in_flight: usize,
    hidden: usize,
    /// Each N runs twice, plain then with secure aggregation at its
    /// defaults, each on a fresh server, and the ratio is printed.
    secure: bool,
}

fn usage() -> String {
    "usage: round [--devices N[,N…]] [--postgres | --sqlite] [--in-flight N] [--hidden H] \
     [--secure]"
        .to_string()
}

fn parse_devices(text: &str) -> Result<Vec<usize>> {
    let counts = text
        .split(',')
        .map(|n| n.trim().parse::<usize>().ok().filter(|&n| n > 0))
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| anyhow!("--devices wants positive counts like 1000,2000, got `{text}`"))?;
    if counts.is_empty() {
        bail!("--devices names no count");
    }
    Ok(counts)
}

fn parse_options() -> Result<Options> {
    let mut options = Options {
        devices: DEFAULT_DEVICES.to_vec(),
        database: Database::Sqlite,
        in_flight: DEFAULT_IN_FLIGHT,
        hidden: DEFAULT_HIDDEN,
        secure: false,
    };
    if let Ok(text) = std::env::var("CANOPY_BENCH_DEVICES") {
        options.devices = parse_devices(&text)?;
    }
    if let Ok(text) = std::env::var("CANOPY_BENCH_DB") {
        options.database = match text.as_str() {
            "postgres" | "postgresql" => Database::Postgres,
            "sqlite" => Database::Sqlite,
            other => bail!("CANOPY_BENCH_DB must be sqlite or postgres, got `{other}`"),
        };
    }
    if let Ok(text) = std::env::var("CANOPY_BENCH_IN_FLIGHT") {
        options.in_flight = text.parse().context("CANOPY_BENCH_IN_FLIGHT")?;
    }
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((flag, value)) => (flag.to_string(), Some(value.to_string())),
            None => (arg.clone(), None),
        };
        let mut value = || {
            inline
                .clone()
                .or_else(|| args.next())
                .ok_or_else(|| anyhow!("{flag} needs a value; {}", usage()))
        };
        match flag.as_str() {
            "--devices" => options.devices = parse_devices(&value()?)?,
            "--in-flight" => {
                options.in_flight = value()?.parse().context("--in-flight")?;
            }
            "--hidden" => options.hidden = value()?.parse().context("--hidden")?,
            "--secure" => options.secure = true,
            "--postgres" => options.database = Database::Postgres,
            "--sqlite" => options.database = Database::Sqlite,
            // `cargo bench` passes `--bench` to every bench binary.
            "--bench" => {}
            "-h" | "--help" => {
                println!("{}", usage());
                std::process::exit(0);
            }
            other => bail!("unknown argument `{other}`; {}", usage()),
        }
    }
    if options.in_flight == 0 {
        bail!("--in-flight must be at least 1");
    }
    // A secure round's stages close only once every participant has
    // answered (or at a timeout that fails the round): all of them must be
    // in flight at once.
    if options.secure {
        let largest = options.devices.iter().copied().max().unwrap_or(0);
        options.in_flight = options.in_flight.max(largest);
    }
    if options.hidden == 0 {
        bail!("--hidden must be at least 1");
    }
    Ok(options)
}

fn db_name(database: Database) -> &'static str {
    match database {
        Database::Sqlite => "SQLite",
        Database::Postgres => "PostgreSQL",
    }
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// User plus system CPU time of a process so far, in seconds.
fn cpu_seconds(pid: u32) -> Option<f64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which is in parentheses: state is
    // field 3, utime 14 and stime 15 (1-based).
    let rest = &text[text.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // USER_HZ is 100 on every Linux configuration Rust targets.
    Some(ticks as f64 / 100.0)
}

/// What the devices saw, shared by their tasks.
#[derive(Default)]
struct DeviceStats {
    /// Per kind of failure: how many, and the first one in full.
    errors: Mutex<BTreeMap<String, (u64, String)>>,
    uploads_done: AtomicUsize,
    bytes_down: AtomicU64,
    bytes_up: AtomicU64,
    first_upload_ms: AtomicU64,
    upload_latency_ms: Mutex<Vec<u64>>,
}

impl DeviceStats {
    fn new() -> DeviceStats {
        DeviceStats {
            first_upload_ms: AtomicU64::new(u64::MAX),
            ..DeviceStats::default()
        }
    }

    fn record_error(&self, what: &str, error: &SdkError) {
        let kind = match error {
            SdkError::Server { status, code, .. } => format!("{what}: {status} {code}"),
            SdkError::Transport { .. } => format!("{what}: transport error"),
            SdkError::ModelVerification { .. } => format!("{what}: verification failed"),
            _ => format!("{what}: other error"),
        };
        // At most 400 characters, cut on a character boundary.
        let example: String = canopy_term::error_chain(error).chars().take(400).collect();
        if let Ok(mut errors) = self.errors.lock() {
            let entry = errors.entry(kind).or_insert((0, example));
            entry.0 += 1;
        }
    }

    fn error_summary(&self) -> String {
        let errors = self.errors.lock().map(|e| e.clone()).unwrap_or_default();
        if errors.is_empty() {
            return "none".to_string();
        }
        errors
            .iter()
            .map(|(kind, (count, example))| format!("{count}× {kind} (first: {example})"))
            .collect::<Vec<_>>()
            .join("\n  ")
    }

    fn error_count(&self) -> u64 {
        self.errors
            .lock()
            .map(|e| e.values().map(|(count, _)| count).sum())
            .unwrap_or_default()
    }
}

/// Runs `call` up to [`MAX_ATTEMPTS`] times, counting every failure.
async fn attempt<T, F: Future<Output = Result<T, SdkError>>>(
    stats: &DeviceStats,
    what: &'static str,
    mut call: impl FnMut() -> F,
) -> Result<T> {
    let mut tries = 0;
    loop {
        tries += 1;
        match call().await {
            Ok(value) => return Ok(value),
            Err(error) => {
                stats.record_error(what, &error);
                if tries >= MAX_ATTEMPTS {
                    return Err(error).context(what);
                }
                tokio::time::sleep(Duration::from_millis(200 * u64::from(tries))).await;
            }
        }
    }
}

/// One device's part in the round: poll, download, "train", upload.
async fn simulate_device(
    device: DeviceClient,
    stats: Arc<DeviceStats>,
    secure: bool,
) -> Result<()> {
    let give_up = Instant::now() + JOB_TIMEOUT;
    let task = loop {
        if let Some(task) = attempt(&stats, "poll", || device.next_task(POLL_WAIT_MS)).await? {
            break task;
        }
        if Instant::now() > give_up {
            bail!(
                "device {} got no task within {JOB_TIMEOUT:?}",
                device.device_id
            );
        }
    };
    let model = attempt(&stats, "download", || device.download_model(&task)).await?;
    stats
        .bytes_down
        .fetch_add(model.bytes.len() as u64, Ordering::Relaxed);
    drop(model);
    let mut rng = rand::rngs::StdRng::seed_from_u64(device.device_id as u64);
    let values: Vec<f32> = (0..task.layout.num_elements())
        .map(|_| rng.random_range(-0.01f32..0.01))
        .collect();
    let samples = rng.random_range(10..=100u64);
    if secure {
        // The six stages through the SDK; the "upload" is the masked
        // input, and its latency the whole secure exchange.
        let sent_ms = unix_ms();
        stats.first_upload_ms.fetch_min(sent_ms, Ordering::Relaxed);
        let started = Instant::now();
        let receipt = device
            .run_secure_round(&task, &values, samples)
            .await
            .inspect_err(|error| stats.record_error("secure round", error))
            .context("secure round")?;
        stats
            .bytes_up
            .fetch_add(receipt.masked_input_bytes, Ordering::Relaxed);
        stats.uploads_done.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut latencies) = stats.upload_latency_ms.lock() {
            latencies.push(started.elapsed().as_millis() as u64);
        }
        return Ok(());
    }
    let encoded = Bytes::from(encode_update(&task.layout, samples, &values)?);
    drop(values);
    if encoded.len() as u64 != task.upload_size_bytes {
        bail!(
            "the update is {} bytes, the task asked for {}",
            encoded.len(),
            task.upload_size_bytes
        );
    }
    let sent_ms = unix_ms();
    stats.first_upload_ms.fetch_min(sent_ms, Ordering::Relaxed);
    let started = Instant::now();
    let receipt = attempt(&stats, "upload", || {
        device.upload_update(&task, encoded.clone())
    })
    .await?;
    let latency = started.elapsed().as_millis() as u64;
    stats.bytes_up.fetch_add(receipt.bytes, Ordering::Relaxed);
    stats.uploads_done.fetch_add(1, Ordering::Relaxed);
    if let Ok(mut latencies) = stats.upload_latency_ms.lock() {
        latencies.push(latency);
    }
    Ok(())
}

/// Enrolls `n` devices, `ENROLL_IN_FLIGHT` at a time. Each device then gets
/// a fresh transport, so the enrollment connection closes and the server
/// holds no idle connection per enrolled device while it waits.
async fn enroll_all(
    server: &Arc<TestServer>,
    token: &str,
    n: usize,
    label: &str,
) -> Result<Vec<DeviceClient>> {
    let permits = Arc::new(Semaphore::new(ENROLL_IN_FLIGHT));
    let mut set = JoinSet::new();
    for _ in 0..n {
        let (server, token, permits) = (server.clone(), token.to_string(), permits.clone());
        set.spawn(async move {
            let _permit = permits.acquire_owned().await?;
            let mut device = enroll_device(&server, &token).await?;
            device.transport = server.transport();
            anyhow::Ok(device)
        });
    }
    let mut devices = Vec::with_capacity(n);
    let step = (n / 5).max(1);
    while let Some(joined) = set.join_next().await {
        devices.push(joined??);
        if devices.len() % step == 0 {
            eprintln!("{label} enrolled {}/{n}", devices.len());
        }
    }
    Ok(devices)
}

/// Runs every device, at most `in_flight` at once.
async fn run_devices(
    devices: Vec<DeviceClient>,
    in_flight: usize,
    stats: Arc<DeviceStats>,
    label: &str,
    secure: bool,
) -> Vec<anyhow::Error> {
    let n = devices.len();
    let permits = Arc::new(Semaphore::new(in_flight));
    let mut set = JoinSet::new();
    for device in devices {
        let (permits, stats) = (permits.clone(), stats.clone());
        set.spawn(async move {
            let _permit = permits.acquire_owned().await?;
            simulate_device(device, stats, secure).await
        });
    }
    let mut failures = Vec::new();
    let mut finished = 0;
    let step = (n / 10).max(1);
    let started = Instant::now();
    while let Some(joined) = set.join_next().await {
        finished += 1;
        match joined {
            Ok(Ok(())) => {}
            Ok(Err(error)) => failures.push(error),
            Err(error) => failures.push(error.into()),
        }
        if finished % step == 0 {
            eprintln!(
                "{label} devices done {finished}/{n} ({} uploaded, {} failed) at {:.1} s",
                stats.uploads_done.load(Ordering::Relaxed),
                failures.len(),
                started.elapsed().as_secs_f64()
            );
        }
    }
    failures
}

/// Every participant of a round, page by page.
async fn all_participants(admin: &Admin, round_id: i64) -> Result<Vec<Value>> {
    let mut items = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let path = match &cursor {
            Some(c) => format!("/api/v1/rounds/{round_id}/participants?limit=500&cursor={c}"),
            None => format!("/api/v1/rounds/{round_id}/participants?limit=500"),
        };
        let page = admin.ok(&path).await?;
        items.extend(page["items"].as_array().cloned().unwrap_or_default());
        match page["next_cursor"].as_str() {
            Some(next) => cursor = Some(next.to_string()),
            None => return Ok(items),
        }
    }
}

/// The last lines of the server log that are warnings or errors.
fn log_problems(server: &TestServer) -> String {
    let problems = summarize_problems(&server.log());
    if problems.is_empty() {
        "(no warnings or errors in the server log)".to_string()
    } else {
        problems
            .iter()
            .map(|(what, count)| format!("  {count}× {what}"))
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// WARN and ERROR events of a JSON server log, grouped by level, message,
/// error and route, most frequent first. The bootstrap admin-token warning,
/// which every fresh server logs, is left out.
fn summarize_problems(log: &str) -> Vec<(String, u64)> {
    let mut groups: BTreeMap<String, u64> = BTreeMap::new();
    for line in log.lines() {
        let Ok(event) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        let level = event["level"].as_str().unwrap_or_default();
        if level != "WARN" && level != "ERROR" {
            continue;
        }
        let fields = &event["fields"];
        let message = fields["message"].as_str().unwrap_or_default();
        if message.starts_with("issued the first admin token") {
            continue;
        }
        let mut key = format!("{level} {message}");
        if let Some(error) = fields["error"].as_str() {
            key = format!("{key}: {}", error.chars().take(200).collect::<String>());
        }
        if let Some(path) = event["span"]["path"].as_str() {
            key = format!(
                "{key} [{} {path}]",
                event["span"]["method"].as_str().unwrap_or("")
            );
        }
        *groups.entry(key).or_default() += 1;
    }
    let mut groups: Vec<(String, u64)> = groups.into_iter().collect();
    groups.sort_by_key(|group| std::cmp::Reverse(group.1));
    groups
}

/// The 1-minute load average, to judge whether other work shared the CPUs.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|text| text.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "?".to_string())
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let index = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[index.min(sorted.len() - 1)]
}

struct RunReport {
    devices: usize,
    secure: bool,
    /// Secure rounds: seconds in AdvertiseKeys, ShareKeys,
    /// MaskedInputCollection (training included), ConsistencyCheck and
    /// Unmasking, from the server log's stage events.
    stages: Option<[f64; 6]>,
    update_bytes: u64,
    enroll_s: f64,
    /// Job `started_ms` → `finished_ms`, server stamps.
    job_s: f64,
    /// Round `training_ms` and `aggregating_ms`, server stamps.
    training_s: f64,
    aggregating_s: f64,
    /// First upload sent → round `finished_ms`.
    first_upload_to_done_s: f64,
    /// Accepted updates over first → last `uploaded_ms`.
    folded_per_s: f64,
    /// Server CPU seconds from job start to job completed.
    server_cpu_s: f64,
    /// CPU time of this process, where the devices run, over the same span.
    devices_cpu_s: f64,
    upload_p50_ms: u64,
    upload_p99_ms: u64,
    rss_idle: u64,
    rss_peak_enroll: u64,
    rss_peak_round: u64,
    hwm: u64,
    rss_after: u64,
    rss_settled: u64,
    bytes_in: i64,
    bytes_out: i64,
    client_bytes_up: u64,
    client_bytes_down: u64,
    errors: String,
    error_count: u64,
    /// WARN and ERROR events the server logged, grouped.
    log_problems: Vec<(String, u64)>,
    /// 1-minute load average before and after the round.
    load: (String, String),
    wall_s: f64,
}

async fn run_once(options: &Options, n: usize, secure: bool) -> Result<RunReport> {
    let bench_started = Instant::now();
    let mode = if secure { " secure" } else { "" };
    let label = format!("[{} N={n}{mode}]", db_name(options.database));
    let config_dir = tempfile::tempdir()?;
    let config_path = config_dir.path().join("server.toml");
    std::fs::write(&config_path, SERVER_CONFIG)?;
    eprintln!("{label} starting canopy-server");
    // `CANOPY_BENCH_RUST_LOG=FILTER` sets the server's log filter (e.g.
    // `debug` for each request's timing, read with CANOPY_BENCH_LOG).
    let rust_log =
        std::env::var("CANOPY_BENCH_RUST_LOG").unwrap_or_else(|_| "info,sqlx=warn".to_string());
    let server = Arc::new(TestServer::start_logging(
        options.database,
        &["--config", config_path.to_str().context("temp path")?],
        &rust_log,
    )?);
    let pid = server.pid().context("server pid")?;
    let admin = server.admin();
    admin.ok("/api/v1/jobs").await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss_idle = proc_status_bytes(pid, "VmRSS").context("VmRSS")?;
    let sampler = RssSampler::start(pid);
    eprintln!(
        "{label} server pid {pid}, idle RSS {:.1} MiB",
        rss_idle as f64 / MIB
    );

    let version = admin
        .upload_model("bench-mlp", model_bytes(architecture(options.hidden), 7))
        .await?;
    let version_id = version["id"].as_i64().context("version id")?;
    let elements = version["trainable_elements"].as_i64().unwrap_or(0);
    let expected = expected_parameters(options.hidden);
    if elements != expected {
        bail!("the model has {elements} trainable parameters, expected {expected}");
    }
    eprintln!(
        "{label} uploaded model version {version_id}: {elements} parameters, {} bytes",
        version["size_bytes"]
    );

    let token = admin.enrollment_token(u32::try_from(n)?).await?;
    let enroll_started = Instant::now();
    let devices = enroll_all(&server, &token, n, &label).await?;
    let enroll_s = enroll_started.elapsed().as_secs_f64();
    let rss_peak_enroll = sampler.take_peak(pid);
    eprintln!(
        "{label} enrolled {n} devices in {enroll_s:.1} s; RSS {:.1} MiB",
        proc_status_bytes(pid, "VmRSS").unwrap_or(0) as f64 / MIB
    );

    let cpu_before = cpu_seconds(pid).unwrap_or(0.0);
    let devices_cpu_before = cpu_seconds(std::process::id()).unwrap_or(0.0);
    let load_before = load_average();
    let n32 = u32::try_from(n)?;
    let job_id = admin
        .create_job(json!({
            "name": format!("bench-{n}"),
            "model_version_id": version_id,
            "rounds": 1,
            "min_devices": n32,
            "target_devices": n32,
            "over_selection": 0.0,
            "evaluation": {"fraction": 0.0}, "round_deadline_ms": ROUND_DEADLINE_MS,
            "local_epochs": 1,
            "batch_size": 32,
            "learning_rate": 0.1,
            "max_round_retries": 0,
            // The defaults: 10% dropout tolerance, 31 bits, max_weight
            // 1,024; the random updates stay inside the default clip.
            "secure_aggregation": {"enabled": secure},
        }))
        .await?;
    eprintln!(
        "{label} started job {job_id}; running {n} devices, {} in flight",
        options.in_flight
    );
    let stats = Arc::new(DeviceStats::new());
    let failures = run_devices(devices, options.in_flight, stats.clone(), &label, secure).await;
    if !failures.is_empty() {
        let _ = admin
            .post(&format!("/api/v1/jobs/{job_id}/cancel"), json!({}))
            .await;
        bail!(
            "{} of {n} devices failed; first: {:#}\ndevice errors: {}\nserver log:\n{}",
            failures.len(),
            failures[0],
            stats.error_summary(),
            log_problems(&server)
        );
    }
    let job = admin.wait_for_job(job_id, JOB_TIMEOUT).await?;
    let server_cpu_s = cpu_seconds(pid).unwrap_or(0.0) - cpu_before;
    let devices_cpu_s = cpu_seconds(std::process::id()).unwrap_or(0.0) - devices_cpu_before;
    let rss_after = proc_status_bytes(pid, "VmRSS").context("VmRSS")?;
    let rss_peak_round = sampler.take_peak(pid);
    let hwm = proc_status_bytes(pid, "VmHWM").context("VmHWM")?;
    if job["state"] != "completed" {
        bail!(
            "job {job_id} ended {}: {}\nserver log:\n{}",
            job["state"],
            job["status_message"],
            log_problems(&server)
        );
    }
    eprintln!("{label} job completed; collecting figures");
    let rounds = admin.ok(&format!("/api/v1/jobs/{job_id}/rounds")).await?;
    let round = rounds["items"]
        .as_array()
        .and_then(|items| items.last())
        .cloned()
        .context("the job has no round")?;
    let round_id = round["id"].as_i64().context("round id")?;
    let accepted = round["metrics"]["updates_accepted"].as_i64().unwrap_or(0);
    if accepted != n as i64 {
        bail!("the round accepted {accepted} updates, expected {n}");
    }
    let participants = all_participants(&admin, round_id).await?;
    let uploaded: Vec<i64> = participants
        .iter()
        .filter_map(|p| p["uploaded_ms"].as_i64())
        .collect();
    let first_accept = uploaded.iter().min().copied().unwrap_or(0);
    let last_accept = uploaded.iter().max().copied().unwrap_or(0);
    let ms = |value: &Value| value.as_i64().unwrap_or(0);
    let job_s = (ms(&job["finished_ms"]) - ms(&job["started_ms"])) as f64 / 1e3;
    let round_done_ms = ms(&round["finished_ms"]);
    let first_sent = stats.first_upload_ms.load(Ordering::Relaxed) as i64;
    let mut latencies = stats
        .upload_latency_ms
        .lock()
        .map(|l| l.clone())
        .unwrap_or_default();
    latencies.sort_unstable();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss_settled = proc_status_bytes(pid, "VmRSS").unwrap_or(0);
    let client_bytes_up = stats.bytes_up.load(Ordering::Relaxed);
    let log = server.log();
    // `CANOPY_BENCH_LOG=DIR` keeps each run's server log there, to read
    // what the table sums up (per-request timings, stage events).
    if let Ok(dir) = std::env::var("CANOPY_BENCH_LOG") {
        let mode = if secure { "secure" } else { "plain" };
        let path = std::path::Path::new(&dir).join(format!("round-{n}-{mode}.log"));
        std::fs::write(&path, &log).with_context(|| format!("cannot write {}", path.display()))?;
    }
    let stages = secure.then(|| secure_stages(&log)).flatten();
    let report = RunReport {
        devices: n,
        secure,
        stages,
        update_bytes: client_bytes_up / n as u64,
        enroll_s,
        job_s,
        training_s: ms(&round["durations"]["training_ms"]) as f64 / 1e3,
        aggregating_s: ms(&round["durations"]["aggregating_ms"]) as f64 / 1e3,
        first_upload_to_done_s: (round_done_ms - first_sent) as f64 / 1e3,
        folded_per_s: accepted as f64 / ((last_accept - first_accept).max(1) as f64 / 1e3),
        server_cpu_s,
        devices_cpu_s,
        upload_p50_ms: percentile(&latencies, 0.5),
        upload_p99_ms: percentile(&latencies, 0.99),
        rss_idle,
        rss_peak_enroll,
        rss_peak_round,
        hwm,
        rss_after,
        rss_settled,
        bytes_in: round["metrics"]["bytes_in"].as_i64().unwrap_or(0),
        bytes_out: round["metrics"]["bytes_out"].as_i64().unwrap_or(0),
        client_bytes_up,
        client_bytes_down: stats.bytes_down.load(Ordering::Relaxed),
        errors: stats.error_summary(),
        log_problems: summarize_problems(&log),
        load: (load_before, load_average()),
        error_count: stats.error_count(),
        wall_s: bench_started.elapsed().as_secs_f64(),
    };
    eprintln!(
        "{label} done: job {:.2} s, {:.0} updates/s, peak RSS {:.1} MiB",
        report.job_s,
        report.folded_per_s,
        report.hwm as f64 / MIB
    );
    drop(sampler);
    Ok(report)
}

/// Seconds of the day of a JSON log event's RFC 3339 `timestamp`: stage
/// lengths need only differences within one run.
fn event_seconds(event: &Value) -> Option<f64> {
    let stamp = event["timestamp"].as_str()?;
    let time = stamp.split('T').nth(1)?.trim_end_matches('Z');
    let time = time.split(['+', '-']).next()?;
    let mut parts = time.split(':');
    let (h, m, s) = (parts.next()?, parts.next()?, parts.next()?);
    Some(h.parse::<f64>().ok()? * 3600.0 + m.parse::<f64>().ok()? * 60.0 + s.parse::<f64>().ok()?)
}

/// The secure round's stage lengths from the server log: AdvertiseKeys
/// opens, then each next stage, then "unmasked".
fn secure_stages(log: &str) -> Option<[f64; 6]> {
    let mut marks: BTreeMap<&str, f64> = BTreeMap::new();
    for line in log.lines() {
        let Ok(event) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        let fields = &event["fields"];
        let key = match (fields["message"].as_str(), fields["stage"].as_str()) {
            (Some("secure round: AdvertiseKeys open"), _) => "advertise",
            (Some("secure round: stage open"), Some("share")) => "share",
            (Some("secure round: stage open"), Some("check")) => "check",
            (Some("secure round: stage open"), Some("collect")) => "collect",
            (Some("secure round: stage open"), Some("consistency")) => "consistency",
            (Some("secure round: stage open"), Some("unmask")) => "unmask",
            (Some("secure round: unmasked"), _) => "done",
            _ => continue,
        };
        if let Some(at) = event_seconds(&event) {
            marks.entry(key).or_insert(at);
        }
    }
    let at = |key: &str| marks.get(key).copied();
    let (a, s, h, c, k, u, d) = (
        at("advertise")?,
        at("share")?,
        at("check")?,
        at("collect")?,
        at("consistency")?,
        at("unmask")?,
        at("done")?,
    );
    Some([s - a, h - s, c - h, k - c, u - k, d - u])
}

/// How one row of the table shows a run.
type Cell = Box<dyn Fn(&RunReport) -> String>;

fn print_table(options: &Options, reports: &[RunReport]) {
    let mib = |bytes: u64| format!("{:.1}", bytes as f64 / MIB);
    let mb = |bytes: i64| format!("{:.1}", bytes as f64 / 1e6);
    let stage = |i: usize| -> Cell {
        Box::new(move |r: &RunReport| r.stages.map_or("-".to_string(), |s| format!("{:.2}", s[i])))
    };
    let rows: Vec<(&str, Cell)> = vec![
        (
            "enroll N devices (s)",
            Box::new(|r| format!("{:.1}", r.enroll_s)),
        ),
        (
            "round wall: job start → completed (s)",
            Box::new(|r| format!("{:.2}", r.job_s)),
        ),
        (
            "  of which training: selected → closed (s)",
            Box::new(|r| format!("{:.2}", r.training_s)),
        ),
        (
            "  of which aggregating: closed → new version (s)",
            Box::new(|r| format!("{:.2}", r.aggregating_s)),
        ),
        ("  secure: AdvertiseKeys (s)", stage(0)),
        ("  secure: ShareKeys (s)", stage(1)),
        ("  secure: ShareCheck (s)", stage(2)),
        (
            "  secure: MaskedInputCollection, training included (s)",
            stage(3),
        ),
        ("  secure: ConsistencyCheck (s)", stage(4)),
        ("  secure: Unmasking (s)", stage(5)),
        (
            "first upload sent → round succeeded (s)",
            Box::new(|r| format!("{:.2}", r.first_upload_to_done_s)),
        ),
        (
            "updates folded/s (first → last accepted)",
            Box::new(|r| format!("{:.0}", r.folded_per_s)),
        ),
        (
            "server CPU time, job start → completed (s)",
            Box::new(|r| format!("{:.1}", r.server_cpu_s)),
        ),
        (
            "devices' CPU time (this process, same span) (s)",
            Box::new(|r| format!("{:.1}", r.devices_cpu_s)),
        ),
        (
            "upload latency p50 / p99 (ms)",
            Box::new(|r| format!("{} / {}", r.upload_p50_ms, r.upload_p99_ms)),
        ),
        (
            "server RSS idle after start-up (MiB) [baseline]",
            Box::new(move |r| mib(r.rss_idle)),
        ),
        (
            "server RSS peak while enrolling (MiB, sampled)",
            Box::new(move |r| mib(r.rss_peak_enroll)),
        ),
        (
            "server RSS peak during the round (MiB, sampled)",
            Box::new(move |r| mib(r.rss_peak_round)),
        ),
        (
            "server peak RSS, VmHWM (MiB)",
            Box::new(move |r| mib(r.hwm)),
        ),
        (
            "server RSS right after the round, VmRSS (MiB)",
            Box::new(move |r| mib(r.rss_after)),
        ),
        (
            "server RSS 2 s later (MiB)",
            Box::new(move |r| mib(r.rss_settled)),
        ),
        (
            "bytes up, server count (MB)",
            Box::new(move |r| mb(r.bytes_in)),
        ),
        (
            "bytes down, server count (MB)",
            Box::new(move |r| mb(r.bytes_out)),
        ),
        (
            "bytes up / down, device count (MB)",
            Box::new(move |r| {
                format!(
                    "{} / {}",
                    mb(r.client_bytes_up as i64),
                    mb(r.client_bytes_down as i64)
                )
            }),
        ),
        (
            "device request errors (retried)",
            Box::new(|r| r.error_count.to_string()),
        ),
        (
            "server log WARN/ERROR lines",
            Box::new(|r| {
                r.log_problems
                    .iter()
                    .map(|(_, n)| n)
                    .sum::<u64>()
                    .to_string()
            }),
        ),
        (
            "machine load average before / after round",
            Box::new(|r| format!("{} / {}", r.load.0, r.load.1)),
        ),
        (
            "bench wall time for this N (s)",
            Box::new(|r| format!("{:.1}", r.wall_s)),
        ),
    ];
    let width = rows
        .iter()
        .map(|(name, _)| name.chars().count())
        .max()
        .unwrap_or(0);
    let update_bytes = reports.first().map(|r| r.update_bytes).unwrap_or(0);
    println!();
    println!(
        "Canopy round benchmark: {}, MLP 784-{}-10 ({} f32 parameters, \
         {update_bytes}-byte updates), {} devices in flight, loopback HTTPS",
        db_name(options.database),
        options.hidden,
        expected_parameters(options.hidden),
        options.in_flight
    );
    print!("{:width$}", "");
    for report in reports {
        let mode = if report.secure { " secure" } else { "" };
        print!("  {:>14}", format!("N={}{mode}", report.devices));
    }
    println!();
    for (name, cell) in &rows {
        let pad = width - name.chars().count();
        print!("{name}{:pad$}", "");
        for report in reports {
            print!("  {:>14}", cell(report));
        }
        println!();
    }
    for report in reports.iter().filter(|r| r.error_count > 0) {
        println!(
            "device errors at N={}:\n  {}",
            report.devices, report.errors
        );
    }
    for report in reports.iter().filter(|r| !r.log_problems.is_empty()) {
        println!("server log problems at N={}:", report.devices);
        for (what, count) in report.log_problems.iter().take(10) {
            println!("  {count}× {what}");
        }
    }
    for secure in reports.iter().filter(|r| r.secure) {
        if let Some(plain) = reports
            .iter()
            .find(|r| !r.secure && r.devices == secure.devices)
        {
            println!(
                "secure / plain at N={}: round wall {:.2} s / {:.2} s = {:.2}x; server CPU {:.2}x; \
                 devices' CPU {:.2}x",
                secure.devices,
                secure.job_s,
                plain.job_s,
                secure.job_s / plain.job_s,
                secure.server_cpu_s / plain.server_cpu_s.max(1e-9),
                secure.devices_cpu_s / plain.devices_cpu_s.max(1e-9)
            );
        }
    }
    let plain: Vec<&RunReport> = reports.iter().filter(|r| !r.secure).collect();
    if let (Some(small), Some(large)) = (
        plain.iter().min_by_key(|r| r.devices),
        plain.iter().max_by_key(|r| r.devices),
    ) && large.devices > small.devices
    {
        let above = |r: &RunReport| r.hwm.saturating_sub(r.rss_idle).max(1) as f64;
        println!(
            "peak RSS N={} / N={}: {:.2} (VmHWM); growth above idle: {:.2}",
            large.devices,
            small.devices,
            large.hwm as f64 / small.hwm as f64,
            above(large) / above(small)
        );
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let options = parse_options()?;
    let started = Instant::now();
    let mut reports = Vec::new();
    for &n in &options.devices {
        reports.push(run_once(&options, n, false).await?);
        if options.secure {
            reports.push(run_once(&options, n, true).await?);
        }
    }
    print_table(&options, &reports);
    println!("total bench time: {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}
