//! The load tests of issue 11, which measure time and memory and so run one
//! at a time (`SERIAL`), in a test binary of their own, with nothing else
//! competing for the two cores:
//! - slow headers (acceptance 1): 2,000 TLS connections that send header
//!   lines and never the blank line. The server's memory must stay bounded
//!   while they are held, each must be closed within the header timeout,
//!   and an honest device must complete a federated round meanwhile;
//! - a poll storm (acceptance 2): one device's 4,096 long polls must not
//!   delay another device's poll by more than a second.
//!
//! Each prints its figures for the closing note.

#[path = "support/raw.rs"]
mod raw;
mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use bytes::Bytes;
use canopy_protocol::auth;
use canopy_protocol::messages::RoundMetrics;
use canopy_protocol::update::encode_update;
use raw::{http_client_from, loopback, tls_from};
use serde_json::json;
use support::{Database, TestServer, enroll_device, logreg_model_bytes, poll_task};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::Semaphore;

/// One measuring test at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const CONNECTIONS: usize = 2_000;
/// Spread over this many client addresses, under the default per-address cap.
const ADDRESSES: usize = 8;
/// The default `header_read_timeout_ms`.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// Headers each connection sends before stalling: just under the 32 KiB
/// hyper keeps for a request head at the default `max_header_bytes`, the
/// most a connection can make the server buffer.
const HEADER_BYTES: usize = 30 << 10;
const RSS_LIMIT_KIB: u64 = 150 << 10;

/// Sends a request line and `HEADER_BYTES` of header lines, then one more
/// line every second, never the blank line. Returns how long after its
/// first byte the server closed it, or `None` if it was still open at 30 s.
async fn hold_slow_headers(
    server_addr: std::net::SocketAddr,
    connector: tokio_rustls::TlsConnector,
    source: std::net::IpAddr,
    handshakes: Arc<Semaphore>,
    counts: Arc<Counts>,
) -> Result<Option<Duration>> {
    let permit = handshakes.acquire_owned().await?;
    let mut tls = tls_from(&connector, source, server_addr).await?;
    drop(permit);
    let mut head = String::from("GET /healthz HTTP/1.1\r\nHost: localhost\r\n");
    let line = format!("X-Padding: {}\r\n", "a".repeat(100));
    while head.len() + line.len() < HEADER_BYTES {
        head.push_str(&line);
    }
    tls.write_all(head.as_bytes()).await?;
    tls.flush().await?;
    let first_byte = Instant::now();
    counts.established.fetch_add(1, Ordering::Relaxed);
    let mut buffer = [0u8; 1024];
    while first_byte.elapsed() < Duration::from_secs(30) {
        tokio::select! {
            read = tls.read(&mut buffer) => {
                // An answer (408, 431) or EOF or a reset: the server let go.
                let _ = read;
                counts.closed.fetch_add(1, Ordering::Relaxed);
                return Ok(Some(first_byte.elapsed()));
            }
            _ = tokio::time::sleep(Duration::from_secs(1)) => {
                if tls.write_all(b"X-Still-Here: 1\r\n").await.is_err() {
                    counts.closed.fetch_add(1, Ordering::Relaxed);
                    return Ok(Some(first_byte.elapsed()));
                }
            }
        }
    }
    Ok(None)
}

fn now_ms() -> u64 {
    u64::try_from(canopy_server::db::now_ms()).unwrap_or(0)
}

#[derive(Default)]
struct Counts {
    established: AtomicUsize,
    closed: AtomicUsize,
}

impl Counts {
    fn held(&self) -> usize {
        self.established.load(Ordering::Relaxed) - self.closed.load(Ordering::Relaxed)
    }
}

/// One round of a one-device job: poll, download, upload, report.
async fn honest_round(server: &TestServer) -> Result<Duration> {
    let admin = server.admin();
    let version = admin.upload_model("load", logreg_model_bytes(3)).await?;
    let token = admin.enrollment_token(1).await?;
    let device = enroll_device(server, &token).await?;
    let started = Instant::now();
    let job = admin
        .create_job(json!({
            "name": "during-load", "model_version_id": version["id"], "rounds": 1,
            "min_devices": 1, "target_devices": 1, "over_selection": 0.0,
            "evaluation": {"fraction": 0.0}, "round_deadline_ms": 60_000, "local_epochs": 1, "batch_size": 8,
            "learning_rate": 0.1, "strategy": {"name": "fedavg"}, "max_round_retries": 0,
        }))
        .await?;
    let task = poll_task(&device).await?;
    device.download_model(&task).await?;
    let values = vec![0.001f32; task.layout.num_elements()];
    let update = encode_update(&task.layout, 10, &values)?;
    device.upload_update(&task, Bytes::from(update)).await?;
    device
        .report_metrics(&RoundMetrics {
            round_id: task.round_id,
            train_loss: Some(0.5),
            eval_loss: None,
            eval_accuracy: Some(0.5),
            eval_samples: Some(10),
            train_duration_ms: Some(1),
        })
        .await?;
    let finished = admin.wait_for_job(job, Duration::from_secs(60)).await?;
    ensure!(
        finished["state"] == "completed",
        "the honest job did not complete: {finished}"
    );
    Ok(started.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_headers_neither_grow_memory_nor_stop_a_round() -> Result<()> {
    let _serial = SERIAL.lock().await;
    let server = TestServer::start(Database::Sqlite)?;
    let baseline_kib = server.memory_kib("VmRSS")?;
    let connector = server.tls_connector()?;
    let counts = Arc::new(Counts::default());
    // Handshakes in flight at once, so that the attack is not limited by
    // the TLS handshake timeout on two cores.
    let handshakes = Arc::new(Semaphore::new(64));
    let attack_started = Instant::now();
    let mut attackers = Vec::with_capacity(CONNECTIONS);
    for n in 0..CONNECTIONS {
        let (connector, counts, handshakes) =
            (connector.clone(), counts.clone(), handshakes.clone());
        let (addr, source) = (server.socket_addr(), loopback(2, n % ADDRESSES));
        attackers.push(tokio::spawn(hold_slow_headers(
            addr, connector, source, handshakes, counts,
        )));
    }
    // Every connection is held (established, none closed yet) ...
    let mut peak_kib = 0;
    while counts.held() < CONNECTIONS {
        ensure!(
            counts.closed.load(Ordering::Relaxed) == 0,
            "connections were closed before all {CONNECTIONS} were established ({} were)",
            counts.established.load(Ordering::Relaxed)
        );
        if attack_started.elapsed() > HEADER_TIMEOUT || attackers.iter().any(|a| a.is_finished()) {
            let mut failures = Vec::new();
            for attacker in attackers.iter_mut().filter(|a| a.is_finished()).take(3) {
                failures.push(format!("{:?}", attacker.await));
            }
            anyhow::bail!(
                "only {} of {CONNECTIONS} connections were established after {:?}; first ends: {failures:?}",
                counts.established.load(Ordering::Relaxed),
                attack_started.elapsed()
            );
        }
        peak_kib = peak_kib.max(server.memory_kib("VmRSS")?);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let all_held_after = attack_started.elapsed();
    // ... and while they are, an honest device runs a round, and memory is
    // sampled until the first of them is closed.
    let honest = {
        let server = &server;
        async move { honest_round(server).await }
    };
    let watch = async {
        let mut peak_kib = peak_kib;
        let mut held_samples = 0;
        // Until the first is closed, or past when all should have been.
        let give_up = Instant::now() + HEADER_TIMEOUT + Duration::from_secs(5);
        while counts.held() == CONNECTIONS && Instant::now() < give_up {
            peak_kib = peak_kib.max(server.memory_kib("VmRSS")?);
            held_samples += 1;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        anyhow::Ok((peak_kib, held_samples))
    };
    let (round, watched) = tokio::join!(honest, watch);
    let round_duration = round?;
    let (peak_kib, held_samples) = watched?;
    ensure!(
        round_duration < HEADER_TIMEOUT,
        "the honest round took {round_duration:?}, longer than the connections were held"
    );

    let mut closed_after = Vec::with_capacity(CONNECTIONS);
    for attacker in attackers {
        closed_after.push(attacker.await??);
    }
    let still_open = closed_after
        .iter()
        .filter(|closed| closed.is_none())
        .count();
    let mut closed: Vec<Duration> = closed_after.into_iter().flatten().collect();
    closed.sort();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let after_kib = server.memory_kib("VmRSS")?;
    println!(
        "figures: {CONNECTIONS} slow-header TLS connections from {ADDRESSES} addresses, \
         {HEADER_BYTES} header bytes each; all held after {:?}; \
         server RSS {} MiB before, peak {} MiB while held ({held_samples} samples), {} MiB after; \
         closed {:?} to {:?} after their first byte (median {:?}); \
         honest round completed in {:?}",
        all_held_after,
        baseline_kib >> 10,
        peak_kib >> 10,
        after_kib >> 10,
        closed.first(),
        closed.last(),
        closed.get(closed.len() / 2),
        round_duration,
    );
    ensure!(
        still_open == 0,
        "{still_open} connections were still open at 30 s"
    );
    let latest = closed.last().copied().unwrap_or_default();
    ensure!(
        latest <= HEADER_TIMEOUT + Duration::from_secs(2),
        "a connection was closed only {latest:?} after its first byte; the header timeout is {HEADER_TIMEOUT:?}"
    );
    ensure!(
        peak_kib < RSS_LIMIT_KIB,
        "the server's RSS reached {} MiB while the connections were held",
        peak_kib >> 10
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_device_cannot_hold_the_polls() -> Result<()> {
    const POLLS: usize = 4_096;
    const CLIENTS: usize = 32;
    let _serial = SERIAL.lock().await;
    let server = TestServer::start(Database::Sqlite)?;
    let token = server.admin().enrollment_token(2).await?;
    let a = enroll_device(&server, &token).await?;
    let b = another_device(&server, token)?;

    // A's polls come over 32 HTTP/2 connections from 16 addresses, 128
    // streams each, so that all 4,096 reach the server at once.
    let path = "/device/v1/tasks/next?wait_ms=30000";
    let mut storm = Vec::with_capacity(POLLS);
    let storm_started = Instant::now();
    for client_index in 0..CLIENTS {
        let client = http_client_from(&server, loopback(40, client_index % 16))?;
        for _ in 0..POLLS / CLIENTS {
            let signed = auth::sign_request(a.key(), a.device_id, "GET", path, b"", now_ms());
            let mut request = client.get(server.transport().url(path));
            for (name, value) in signed.headers() {
                request = request.header(name, value);
            }
            storm.push(tokio::spawn(async move {
                let response = request.send().await?;
                anyhow::Ok((response.status().as_u16(), Instant::now()))
            }));
        }
    }
    tokio::time::sleep(Duration::from_millis(200)).await;

    let latencies = b.measure()?;
    let slowest =
        Duration::from_millis(latencies.iter().map(|(_, took)| *took).max().unwrap_or(0) as u64);
    println!("B's polls (at ms, took ms): {latencies:?}");

    let mut refused = 0;
    let mut waiting = 0;
    let mut last_refusal = Duration::ZERO;
    // One deadline for all of A's polls, not ten seconds each: the two
    // the cap lets wait would otherwise cost twenty.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    for poll in storm {
        match tokio::time::timeout_at(deadline, poll).await {
            Ok(status) => {
                let (status, answered) = status??;
                ensure!(status == 429, "one of A's polls answered {status}");
                refused += 1;
                last_refusal = last_refusal.max(answered.duration_since(storm_started));
            }
            Err(_) => waiting += 1,
        }
    }
    println!(
        "figures: during {POLLS} long polls from one device, another device's poll took at most {slowest:?}; \
         {refused} of them refused with 429, the last {last_refusal:?} after the storm began, {waiting} left waiting"
    );
    ensure!(
        slowest < Duration::from_secs(1),
        "another device's poll took {slowest:?} during the storm"
    );
    ensure!(
        waiting <= 2,
        "{waiting} of A's polls were left waiting; the cap is 2"
    );
    Ok(())
}

/// Device B of the poll storm: another device, so its own thread and
/// runtime (not queued behind A's client tasks in this process), enrolled
/// and connected before the storm, as a polling device's connection is
/// kept. `measure` polls for 3 s and returns (at ms, took ms) per poll.
struct AnotherDevice {
    go: std::sync::mpsc::Sender<()>,
    done: std::thread::JoinHandle<Result<Measured>>,
}

/// (at ms, took ms) per poll.
type Measured = Vec<(u128, u128)>;

fn another_device(server: &TestServer, token: String) -> Result<AnotherDevice> {
    let (base, trust) = (server.base.clone(), server.trust());
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<()>>();
    let (go, go_rx) = std::sync::mpsc::channel::<()>();
    let done = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        runtime.block_on(async move {
            let enrolled = async {
                let transport = canopy_sdk::Transport::new(&base, &trust)?;
                let key = auth::DeviceKey::generate();
                let reply =
                    canopy_sdk::enroll(&transport, &token, &key, support::capabilities()).await?;
                let b = canopy_sdk::DeviceClient::new(
                    transport,
                    reply.device_id,
                    key,
                    &reply.server_public_key,
                )?;
                ensure!(
                    b.next_task(0).await?.is_none(),
                    "B got a task, but no job exists"
                );
                anyhow::Ok(b)
            }
            .await;
            let b = match enrolled {
                Ok(b) => {
                    let _ = ready_tx.send(Ok(()));
                    b
                }
                Err(error) => {
                    let _ = ready_tx.send(Err(anyhow::anyhow!("{error:#}")));
                    return Err(error);
                }
            };
            go_rx.recv()?;
            let mut latencies = Vec::new();
            let measuring = Instant::now();
            while measuring.elapsed() < Duration::from_secs(3) {
                let started = Instant::now();
                ensure!(
                    b.next_task(0).await?.is_none(),
                    "B got a task, but no job exists"
                );
                latencies.push((
                    measuring.elapsed().as_millis(),
                    started.elapsed().as_millis(),
                ));
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Ok(latencies)
        })
    });
    ready_rx.recv()??;
    Ok(AnotherDevice { go, done })
}

impl AnotherDevice {
    fn measure(self) -> Result<Measured> {
        self.go.send(())?;
        self.done
            .join()
            .map_err(|_| anyhow::anyhow!("device B's thread panicked"))?
    }
}
