//! Request slots by kind (issue 36, items 2 and 3): what a fleet of idle
//! devices or an attacker with no credentials can hold, and what stays
//! answered while they do. These tests measure latency and memory, so
//! they run one at a time (`SERIAL`) in a binary of their own:
//! - 10,000 devices each holding a task poll: an admin request, a
//!   heartbeat, an upload and `/readyz` are each answered within a second;
//! - 4,096 slow enrollment bodies from 36 addresses: admin requests are
//!   answered within a second throughout;
//! - the low items of item 7 that concern requests and connections:
//!   separate rate-limit buckets for enrollment and token creation, an
//!   HTTP/2 connection that only sends PINGs, and `/metrics` behind a token.
//!
//! Each load test prints its figures (`figures:` lines).

#[path = "support/raw.rs"]
mod raw;
mod support;

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use bytes::Bytes;
use canopy_protocol::auth::{self, DeviceKey};
use canopy_protocol::messages::{EnrollRequest, EnrollResponse, Heartbeat};
use canopy_protocol::update::encode_update;
use raw::{loopback, tls_from};
use serde_json::json;
use support::{Database, TestServer, capabilities, limits_file, logreg_model_bytes};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::task::JoinSet;

/// One measuring test at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The most any request the tests watch may take.
const ANSWERED_WITHIN: Duration = Duration::from_secs(1);

fn now_ms() -> u64 {
    u64::try_from(canopy_server::db::now_ms()).unwrap_or(0)
}

/// A reqwest client whose connections come from `source` and speak HTTP/2
/// (ALPN `h2`), so that one connection carries many requests.
fn h2_client_from(server: &TestServer, source: IpAddr) -> Result<reqwest::Client> {
    let mut config = server.trust().client_config()?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    // Prior knowledge too: with ALPN alone, the client learns that a new
    // connection speaks HTTP/2 only once it is open, so a burst of first
    // requests would each open one.
    Ok(reqwest::Client::builder()
        .use_preconfigured_tls(config)
        .http2_prior_knowledge()
        .local_address(source)
        .build()?)
}

/// Latencies in milliseconds, and their summary for a `figures:` line.
#[derive(Default)]
struct Latencies {
    samples_ms: Vec<f64>,
}

impl Latencies {
    fn add(&mut self, took: Duration) {
        self.samples_ms.push(took.as_secs_f64() * 1000.0);
    }

    fn quantile(&self, q: f64) -> f64 {
        let mut sorted = self.samples_ms.clone();
        sorted.sort_by(f64::total_cmp);
        if sorted.is_empty() {
            return f64::NAN;
        }
        let index = ((sorted.len() - 1) as f64 * q).round() as usize;
        sorted[index]
    }

    fn max(&self) -> Duration {
        Duration::from_secs_f64(self.quantile(1.0).max(0.0) / 1000.0)
    }

    fn summary(&self) -> String {
        format!(
            "n={} p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
            self.samples_ms.len(),
            self.quantile(0.5),
            self.quantile(0.99),
            self.quantile(1.0)
        )
    }
}

/// A device enrolled over `client`, with the key that signs its requests.
struct FleetDevice {
    id: i64,
    key: DeviceKey,
}

async fn enroll_over(
    server: &TestServer,
    client: &reqwest::Client,
    token: &str,
) -> Result<FleetDevice> {
    let key = DeviceKey::generate();
    let request = EnrollRequest {
        enrollment_token: token.to_string(),
        public_key: key.public_key_hex(),
        capabilities: capabilities(),
        role: Default::default(),
    };
    let url = server.transport().url("/device/v1/enroll");
    for _ in 0..20 {
        let response = client.post(&url).json(&request).send().await?;
        match response.status().as_u16() {
            201 => {
                let enrolled: EnrollResponse = response.json().await?;
                return Ok(FleetDevice {
                    id: enrolled.device_id,
                    key,
                });
            }
            429 | 503 => tokio::time::sleep(Duration::from_millis(200)).await,
            status => bail!("enrollment answered {status}: {}", response.text().await?),
        }
    }
    bail!("enrollment was refused 20 times")
}

/// Enrolls `n` devices, `in_flight` at a time, over HTTP/2 connections
/// from `addresses` loopback addresses.
async fn enroll_fleet(
    server: &Arc<TestServer>,
    token: &str,
    n: usize,
    addresses: usize,
    in_flight: usize,
) -> Result<Vec<FleetDevice>> {
    let clients: Vec<reqwest::Client> = (0..addresses)
        .map(|index| h2_client_from(server, loopback(100, index)))
        .collect::<Result<_>>()?;
    let next = Arc::new(AtomicUsize::new(0));
    let mut workers = JoinSet::new();
    for worker in 0..in_flight {
        let (server, client, token, next) = (
            server.clone(),
            clients[worker % addresses].clone(),
            token.to_string(),
            next.clone(),
        );
        workers.spawn(async move {
            let mut enrolled = Vec::new();
            while next.fetch_add(1, Ordering::Relaxed) < n {
                enrolled.push(enroll_over(&server, &client, &token).await?);
            }
            anyhow::Ok(enrolled)
        });
    }
    let mut fleet = Vec::with_capacity(n);
    while let Some(joined) = workers.join_next().await {
        fleet.extend(joined??);
    }
    Ok(fleet)
}

/// What the fleet's polls were answered.
#[derive(Default)]
struct PollCounts {
    sent: AtomicUsize,
    no_task: AtomicUsize,
    refused: AtomicUsize,
    /// Any other answer, by status (0: no answer).
    other: std::sync::Mutex<std::collections::BTreeMap<u16, usize>>,
}

impl PollCounts {
    fn other(&self) -> std::collections::BTreeMap<u16, usize> {
        self.other
            .lock()
            .map(|other| other.clone())
            .unwrap_or_default()
    }
}

/// Each device polls for a task again and again, as an idle agent does,
/// until `stop`: `per_connection` devices share one HTTP/2 connection.
fn hold_polls(
    server: &TestServer,
    fleet: Vec<FleetDevice>,
    per_connection: usize,
    addresses: usize,
    stop: Arc<AtomicBool>,
    counts: Arc<PollCounts>,
) -> Result<JoinSet<()>> {
    let path = "/device/v1/tasks/next?wait_ms=30000";
    let url = server.transport().url(path);
    let mut polls = JoinSet::new();
    let mut fleet = fleet.into_iter().peekable();
    let mut connection = 0;
    while fleet.peek().is_some() {
        let client = h2_client_from(server, loopback(50, connection % addresses))?;
        connection += 1;
        for device in fleet.by_ref().take(per_connection) {
            let (client, url, stop, counts) =
                (client.clone(), url.clone(), stop.clone(), counts.clone());
            polls.spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let signed =
                        auth::sign_request(&device.key, device.id, "GET", path, b"", now_ms());
                    let mut request = client.get(&url);
                    for (name, value) in signed.headers() {
                        request = request.header(name, value);
                    }
                    counts.sent.fetch_add(1, Ordering::Relaxed);
                    let status = match request.send().await {
                        Ok(response) => response.status().as_u16(),
                        Err(_) => 0,
                    };
                    match status {
                        204 => counts.no_task.fetch_add(1, Ordering::Relaxed),
                        429 | 503 => counts.refused.fetch_add(1, Ordering::Relaxed),
                        _ => {
                            if let Ok(mut other) = counts.other.lock() {
                                *other.entry(status).or_default() += 1;
                            }
                            0
                        }
                    };
                    if status != 204 {
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                }
            });
        }
    }
    Ok(polls)
}

/// The value of an OpenMetrics sample, e.g. `canopy_request_slots_in_use{pool="task_polls"}`.
async fn metric(server: &TestServer, sample: &str) -> Result<Option<f64>> {
    let response = server
        .transport()
        .http()
        .get(server.transport().url("/metrics"))
        .bearer_auth(&server.admin_token)
        .send()
        .await?;
    let text = response.text().await?;
    Ok(text.lines().find_map(|line| {
        let value = line.strip_prefix(sample)?.trim();
        value.parse().ok()
    }))
}

/// GET `path` with the admin token over `transport` (whose connection is
/// kept, as an operator's client keeps it); the status and how long it took.
async fn timed_get(
    server: &TestServer,
    transport: &canopy_sdk::Transport,
    path: &str,
) -> Result<(u16, Duration)> {
    let started = Instant::now();
    let response = transport
        .http()
        .get(transport.url(path))
        .bearer_auth(&server.admin_token)
        .timeout(Duration::from_secs(10))
        .send()
        .await?;
    let status = response.status().as_u16();
    let _ = response.bytes().await?;
    Ok((status, started.elapsed()))
}

/// What the admin API, a heartbeat and `/readyz` answered while watched.
#[derive(Default)]
struct Watched {
    admin: Latencies,
    heartbeat: Latencies,
    readyz: Latencies,
    failures: Vec<String>,
}

/// Watches the admin API, `/readyz` and (with a device) heartbeats every
/// 250 ms for `duration`.
async fn watch(
    server: &TestServer,
    transport: &canopy_sdk::Transport,
    device: Option<&canopy_sdk::DeviceClient>,
    duration: Duration,
) -> Result<Watched> {
    let mut watched = Watched::default();
    let until = Instant::now() + duration;
    while Instant::now() < until {
        let (status, took) = timed_get(server, transport, "/api/v1/jobs").await?;
        watched.admin.add(took);
        if status != 200 {
            watched
                .failures
                .push(format!("GET /api/v1/jobs answered {status}"));
        }
        let (status, took) = timed_get(server, transport, "/readyz").await?;
        watched.readyz.add(took);
        if status != 200 {
            watched
                .failures
                .push(format!("GET /readyz answered {status}"));
        }
        if let Some(device) = device {
            let started = Instant::now();
            let beat = device.heartbeat(&idle_heartbeat()).await;
            watched.heartbeat.add(started.elapsed());
            if let Err(error) = beat {
                watched.failures.push(format!("heartbeat failed: {error}"));
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    Ok(watched)
}

fn idle_heartbeat() -> Heartbeat {
    Heartbeat {
        state: Some("idle".to_string()),
        round_id: None,
        datasets: None,
        last_error: None,
        conditions: None,
    }
}

fn check_latencies(what: &str, latencies: &Latencies) -> Result<()> {
    ensure!(!latencies.samples_ms.is_empty(), "no {what} was measured");
    ensure!(
        latencies.max() < ANSWERED_WITHIN,
        "a {what} took {:?} ({})",
        latencies.max(),
        latencies.summary()
    );
    Ok(())
}

const FLEET: usize = 10_000;
/// Streams per HTTP/2 connection the server allows (the default
/// `http2_max_concurrent_streams`): 313 connections carry the fleet's polls.
const POLLS_PER_CONNECTION: usize = 32;
/// Client addresses the fleet's connections come from, under the default
/// 256 connections per address.
const FLEET_ADDRESSES: usize = 8;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_waiting_polls_leave_the_server_answering() -> Result<()> {
    let _serial = SERIAL.lock().await;
    let dir = support::private_tempdir()?;
    // Every device enrolls from a few loopback addresses; the default of
    // 120 a minute per address would throttle the set-up.
    let config = limits_file(
        dir.path(),
        "sensitive_requests_per_minute = 1000000\nonline_window_ms = 3600000",
    )?;
    let server = Arc::new(TestServer::start_with(
        Database::Sqlite,
        &["--config", &config],
    )?);
    let admin = server.admin();
    let version = admin.upload_model("fleet", logreg_model_bytes(5)).await?;
    let token = admin.enrollment_token(u32::try_from(FLEET + 1)?).await?;

    let enroll_started = Instant::now();
    let fleet = enroll_fleet(&server, &token, FLEET, 16, 64).await?;
    let enroll_took = enroll_started.elapsed();
    let mut probe_capabilities = capabilities();
    probe_capabilities
        .tags
        .insert("role".to_string(), "probe".to_string());
    let probe = support::enroll_device_with(&server, &token, probe_capabilities).await?;
    let rss_enrolled_kib = server.memory_kib("VmRSS")?;
    let operator = server.transport();

    let stop = Arc::new(AtomicBool::new(false));
    let counts = Arc::new(PollCounts::default());
    let polls_started = Instant::now();
    let mut polls = hold_polls(
        &server,
        fleet,
        POLLS_PER_CONNECTION,
        FLEET_ADDRESSES,
        stop.clone(),
        counts.clone(),
    )?;
    // The server counts the polls waiting; measuring starts when the whole
    // fleet waits, or after 40 s, and the watch covers the set-up too.
    let waiting_sample = "canopy_request_slots_in_use{pool=\"task_polls\"}";
    let mut early = Watched::default();
    let mut all_waiting_after = None;
    while polls_started.elapsed() < Duration::from_secs(40) {
        let watched = watch(&server, &operator, Some(&probe), Duration::from_millis(500)).await?;
        early.failures.extend(watched.failures);
        if metric(&server, waiting_sample).await?.unwrap_or(0.0) >= FLEET as f64 {
            all_waiting_after = Some(polls_started.elapsed());
            break;
        }
    }
    let watched = watch(&server, &operator, Some(&probe), Duration::from_secs(5)).await?;

    // An upload while they wait: a one-device job for the probe device.
    let job = admin
        .create_job(json!({
            "name": "probe", "model_version_id": version["id"], "rounds": 1,
            "min_devices": 1, "target_devices": 1, "over_selection": 0.0,
            "evaluation": {"fraction": 0.0}, "round_deadline_ms": 60_000, "local_epochs": 1,
            "batch_size": 8, "learning_rate": 0.1, "filters": {"tags": {"role": "probe"}},
        }))
        .await?;
    let task_started = Instant::now();
    let task = support::poll_task(&probe).await?;
    let task_took = task_started.elapsed();
    probe.download_model(&task).await?;
    let values = vec![0.001f32; task.layout.num_elements()];
    let update = encode_update(&task.layout, 10, &values)?;
    let upload_started = Instant::now();
    let uploaded = probe.upload_update(&task, Bytes::from(update)).await;
    let upload_took = upload_started.elapsed();
    let after = watch(&server, &operator, Some(&probe), Duration::from_secs(2)).await?;
    let waiting_at_end = metric(&server, waiting_sample).await?;

    stop.store(true, Ordering::Relaxed);
    let rss_hwm_kib = server.memory_kib("VmHWM")?;
    let rss_kib = server.memory_kib("VmRSS")?;
    println!(
        "figures: {FLEET} devices enrolled in {enroll_took:.1?}; their polls over {} HTTP/2 \
         connections from {FLEET_ADDRESSES} addresses all waiting after {all_waiting_after:?} \
         ({} sent, {} answered 204, {} refused, others by status {:?}); while they waited: admin GET \
         /api/v1/jobs {}; heartbeat {}; /readyz {}; the probe's task after {task_took:.1?}, \
         its upload in {upload_took:.1?}; polls waiting at the end: {waiting_at_end:?}; server \
         RSS {} MiB after enrollment, {} MiB with the polls waiting, peak (VmHWM) {} MiB; \
         during the arrival of the polls: {:?}",
        FLEET.div_ceil(POLLS_PER_CONNECTION),
        counts.sent.load(Ordering::Relaxed),
        counts.no_task.load(Ordering::Relaxed),
        counts.refused.load(Ordering::Relaxed),
        counts.other(),
        watched.admin.summary(),
        watched.heartbeat.summary(),
        watched.readyz.summary(),
        rss_enrolled_kib >> 10,
        rss_kib >> 10,
        rss_hwm_kib >> 10,
        early.failures,
    );
    polls.abort_all();
    admin
        .post(&format!("/api/v1/jobs/{job}/cancel"), json!({}))
        .await?;

    // While the fleet's 10,000 polls arrive at once, each needs a general
    // place for its signature check and first look, so a heartbeat (a
    // general place too) may be told to retry then; the admin API and
    // `/readyz` may not, and nothing may fail once the polls wait.
    let failures: Vec<&String> = early
        .failures
        .iter()
        .filter(|failure| !failure.starts_with("heartbeat"))
        .chain(&watched.failures)
        .chain(&after.failures)
        .collect();
    ensure!(
        failures.is_empty(),
        "while the fleet polled: {} failures, first {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    for (what, latencies) in [
        ("admin request", &watched.admin),
        ("heartbeat", &watched.heartbeat),
        ("/readyz", &watched.readyz),
        ("admin request after the upload", &after.admin),
    ] {
        check_latencies(what, latencies)?;
    }
    uploaded.context("the probe's upload while the fleet waited")?;
    ensure!(
        upload_took < ANSWERED_WITHIN,
        "the upload took {upload_took:?}"
    );
    ensure!(
        all_waiting_after.is_some(),
        "the server never counted {FLEET} polls waiting"
    );
    ensure!(
        counts.other().is_empty(),
        "fleet polls were answered {:?}",
        counts.other()
    );
    Ok(())
}

/// Slow enrollment bodies: the attack of item 3.
const SLOW_ENROLLMENTS: usize = 4_096;
const ATTACK_ADDRESSES: usize = 36;
/// How long the attack is held while admin requests are watched.
const HOLD: Duration = Duration::from_secs(15);
const RAMP_UP: Duration = Duration::from_secs(3);

/// Sends enrollments whose body trickles (a byte every 500 ms, never
/// finishing) over `client`, one after another until `stop`; an answer
/// (408, 429, 503) is followed by the next try after its `Retry-After`.
async fn trickle_enrollments(
    client: reqwest::Client,
    url: String,
    stop: Arc<AtomicBool>,
    answered: Arc<AtomicUsize>,
) {
    while !stop.load(Ordering::Relaxed) {
        let stop_body = stop.clone();
        let body = futures_util::stream::unfold(0u32, move |sent| {
            let stop = stop_body.clone();
            async move {
                if sent > 0 {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                if stop.load(Ordering::Relaxed) {
                    return None;
                }
                let chunk = if sent == 0 { "{" } else { " " };
                Some((Ok::<_, std::io::Error>(Bytes::from(chunk)), sent + 1))
            }
        });
        let sent = client
            .post(&url)
            .header("content-type", "application/json")
            .body(reqwest::Body::wrap_stream(body))
            .send()
            .await;
        answered.fetch_add(1, Ordering::Relaxed);
        let retry_after = sent
            .ok()
            .and_then(|response| {
                response
                    .headers()
                    .get("retry-after")?
                    .to_str()
                    .ok()?
                    .parse::<u64>()
                    .ok()
            })
            .unwrap_or(1);
        tokio::time::sleep(Duration::from_secs(retry_after.clamp(1, 5))).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_enrollment_bodies_leave_the_admin_api_answering() -> Result<()> {
    let _serial = SERIAL.lock().await;
    let server = TestServer::start(Database::Sqlite)?;
    let url = server.transport().url("/device/v1/enroll");
    let stop = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(AtomicUsize::new(0));
    let mut attack = JoinSet::new();
    let connections = SLOW_ENROLLMENTS.div_ceil(POLLS_PER_CONNECTION);
    for connection in 0..connections {
        let client = h2_client_from(&server, loopback(10, connection % ATTACK_ADDRESSES))?;
        for _ in 0..POLLS_PER_CONNECTION {
            attack.spawn(trickle_enrollments(
                client.clone(),
                url.clone(),
                stop.clone(),
                answered.clone(),
            ));
        }
    }
    // The attack's connections and first requests are set up (in this
    // process, on the same two cores) before the watch starts.
    tokio::time::sleep(RAMP_UP).await;
    let started = Instant::now();
    let watched = watch(&server, &server.transport(), None, HOLD).await?;
    let answers_during_hold = answered.load(Ordering::Relaxed);
    stop.store(true, Ordering::Relaxed);
    let rss_hwm_kib = server.memory_kib("VmHWM")?;
    println!(
        "figures: {SLOW_ENROLLMENTS} slow enrollment bodies over {connections} HTTP/2 \
         connections from {ATTACK_ADDRESSES} addresses, held {:.1?}: admin GET /api/v1/jobs {}; \
         /readyz {}; {answers_during_hold} attack requests answered (refused or timed out); \
         server peak RSS (VmHWM) {} MiB",
        started.elapsed(),
        watched.admin.summary(),
        watched.readyz.summary(),
        rss_hwm_kib >> 10
    );
    attack.abort_all();
    ensure!(
        watched.failures.is_empty(),
        "during the attack: {} failures, first {:?}",
        watched.failures.len(),
        &watched.failures[..watched.failures.len().min(5)]
    );
    check_latencies("admin request", &watched.admin)?;
    check_latencies("/readyz", &watched.readyz)?;
    Ok(())
}

/// A slow body gets 408 with a message naming the limit, and a client
/// over its enrollments in progress gets 429 with `Retry-After`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_enrollment_body_is_cut_and_an_address_is_capped() -> Result<()> {
    let _serial = SERIAL.lock().await;
    let dir = support::private_tempdir()?;
    let config = limits_file(dir.path(), "max_enrollments_per_address = 2")?;
    let server = TestServer::start_with(Database::Sqlite, &["--config", &config])?;
    let connector = server.tls_connector()?;
    let source = loopback(200, 0);
    // One byte of a 400-byte body, then nothing: two are held, two more
    // are over the address's cap.
    let mut held = Vec::new();
    let mut answers = Vec::new();
    for _ in 0..4 {
        let mut tls = tls_from(&connector, source, server.socket_addr()).await?;
        tls.write_all(
            b"POST /device/v1/enroll HTTP/1.1\r\nHost: localhost\r\n\
              Content-Type: application/json\r\nContent-Length: 400\r\n\r\n{",
        )
        .await?;
        tls.flush().await?;
        held.push(tls);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let started = Instant::now();
    for mut tls in held {
        let mut answer = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(30), async {
            let mut buffer = [0u8; 4096];
            loop {
                let n = tls.read(&mut buffer).await?;
                if n == 0 {
                    break;
                }
                answer.extend_from_slice(&buffer[..n]);
                if answer.windows(4).any(|w| w == b"\r\n\r\n") && answer.ends_with(b"}") {
                    break;
                }
            }
            anyhow::Ok(())
        })
        .await;
        ensure!(
            read.is_ok(),
            "an enrollment with a stalled body was never answered"
        );
        answers.push((
            started.elapsed(),
            String::from_utf8_lossy(&answer).to_string(),
        ));
    }
    let statuses: Vec<&str> = answers
        .iter()
        .map(|(_, answer)| answer.split(' ').nth(1).unwrap_or(""))
        .collect();
    println!(
        "stalled enrollments answered: {statuses:?} after {:?}",
        answers.iter().map(|(t, _)| *t).collect::<Vec<_>>()
    );
    let timed_out: Vec<&(Duration, String)> = answers
        .iter()
        .filter(|(_, a)| a.starts_with("HTTP/1.1 408"))
        .collect();
    let capped: Vec<&(Duration, String)> = answers
        .iter()
        .filter(|(_, a)| a.starts_with("HTTP/1.1 429"))
        .collect();
    ensure!(
        timed_out.len() == 2 && capped.len() == 2,
        "of 4 stalled enrollments from one address with a cap of 2, {} were answered 408 and \
         {} 429: {answers:?}",
        timed_out.len(),
        capped.len()
    );
    for (after, answer) in &timed_out {
        ensure!(
            *after < Duration::from_secs(10),
            "a stalled enrollment body was cut only after {after:?}"
        );
        ensure!(
            answer.contains("enrollment_body_timeout_ms"),
            "the 408 does not name its limit: {answer}"
        );
    }
    for (_, answer) in &capped {
        ensure!(
            answer.to_ascii_lowercase().contains("retry-after"),
            "the 429 has no Retry-After: {answer}"
        );
    }
    Ok(())
}

/// Enrollment and token creation are rate-limited in separate buckets: a
/// device enrolling at its rate does not lock an operator behind the
/// same address out of creating tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enrollment_does_not_use_up_token_creation() -> Result<()> {
    let _serial = SERIAL.lock().await;
    let dir = support::private_tempdir()?;
    let config = limits_file(dir.path(), "sensitive_requests_per_minute = 3")?;
    let server = TestServer::start_with(Database::Sqlite, &["--config", &config])?;
    let client = raw::http_client_from(&server, loopback(220, 0))?;
    let url = server.transport().url("/device/v1/enroll");
    let mut statuses = Vec::new();
    for _ in 0..5 {
        let body = json!({"enrollment_token": "wrong", "public_key": DeviceKey::generate().public_key_hex(), "capabilities": capabilities()});
        statuses.push(
            client
                .post(&url)
                .json(&body)
                .send()
                .await?
                .status()
                .as_u16(),
        );
    }
    ensure!(
        statuses.contains(&429),
        "five enrollments at 3 a minute were never refused: {statuses:?}"
    );
    let created = client
        .post(server.transport().url("/api/v1/enrollment-tokens"))
        .bearer_auth(&server.admin_token)
        .json(&json!({"expires_in": "1h", "max_uses": 1, "label": "after enrollments"}))
        .send()
        .await?;
    let status = created.status().as_u16();
    ensure!(
        status == 201,
        "an enrollment token from the same address answered {status} after enrollments \
         used their rate: {}",
        created.text().await?
    );
    Ok(())
}

/// `/metrics` answers only a token that can read the admin API.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_need_a_token() -> Result<()> {
    let _serial = SERIAL.lock().await;
    let server = TestServer::start(Database::Sqlite)?;
    let http = server.transport().http().clone();
    let url = server.transport().url("/metrics");
    let anonymous = http.get(&url).send().await?;
    ensure!(
        anonymous.status() == 401,
        "/metrics without a token answered {}",
        anonymous.status()
    );
    let viewer = server
        .admin()
        .post(
            "/api/v1/tokens",
            json!({"role": "viewer", "label": "scraper", "expires_in": "1h"}),
        )
        .await?;
    ensure!(
        viewer.status == 201,
        "token creation answered {}: {}",
        viewer.status,
        viewer.body
    );
    let secret = viewer.body["secret"].as_str().unwrap_or_default();
    let scraped = http.get(&url).bearer_auth(secret).send().await?;
    ensure!(
        scraped.status() == 200,
        "/metrics with a viewer token answered {}",
        scraped.status()
    );
    let text = scraped.text().await?;
    ensure!(text.contains("canopy_"), "no metrics in:\n{text}");
    Ok(())
}

/// An HTTP/2 connection that sends only PINGs (each answered, so bytes
/// keep moving) is closed once no request has been open for
/// `idle_timeout_ms`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_only_pings_is_closed() -> Result<()> {
    let _serial = SERIAL.lock().await;
    let dir = support::private_tempdir()?;
    let config = limits_file(
        dir.path(),
        "idle_timeout_ms = 3000\nlong_poll_max_ms = 1000",
    )?;
    let server = TestServer::start_with(Database::Sqlite, &["--config", &config])?;
    let mut tls_config = server.trust().client_config()?;
    tls_config.alpn_protocols = vec![b"h2".to_vec()];
    let connector = tokio_rustls::TlsConnector::from(Arc::new(tls_config));
    let mut tls = tls_from(&connector, loopback(230, 0), server.socket_addr()).await?;
    // The client preface and an empty SETTINGS frame.
    tls.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await?;
    tls.write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0]).await?;
    tls.flush().await?;
    let opened = Instant::now();
    let (mut reader, mut writer) = tokio::io::split(tls);
    let pinger = tokio::spawn(async move {
        let mut ping = vec![0, 0, 8, 6, 0, 0, 0, 0, 0];
        ping.extend_from_slice(b"canopy!!");
        loop {
            if writer.write_all(&ping).await.is_err() || writer.flush().await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    });
    let closed = tokio::time::timeout(Duration::from_secs(15), async {
        let mut buffer = [0u8; 4096];
        loop {
            match reader.read(&mut buffer).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
    pinger.abort();
    let held = opened.elapsed();
    println!("figures: a PING-only HTTP/2 connection was held {held:.1?} (idle_timeout_ms 3000)");
    ensure!(
        closed.is_ok(),
        "a connection sending only PINGs was still open after {held:?}; idle_timeout_ms is 3 s"
    );
    ensure!(
        held < Duration::from_secs(6),
        "the PING-only connection was closed only after {held:?}"
    );
    Ok(())
}
