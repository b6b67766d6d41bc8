//! `canopy-sdk` against a real server over HTTPS: the blocking client
//! from a thread with no runtime, a download resumed after a cut
//! connection, cancellation of a long poll, retries across a server
//! restart, a throttled device that waits out `Retry-After`, and
//! certificate failures that are not retried.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use bytes::Bytes;
use canopy_engine::data::{LabelColumn, load_csv};
use canopy_engine::zoo::Architecture;
use canopy_protocol::auth::DeviceKey;
use canopy_protocol::messages::{Capabilities, Heartbeat, RoundMetrics, Task, Tier};
use canopy_sdk::train::{TrainOptions, train_task};
use canopy_sdk::{CancelToken, RetryPolicy, SdkError, Transport, Trust, blocking};
use serde_json::{Value, json};

use crate::support;
use crate::support::{Database, TestServer, fetch_model, logreg_model_bytes, model_bytes};

fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?)
}

/// What an app reports: the backends the engine runs here, and the GPU
/// adapter beside `gpu` (lavapipe in CI).
fn capabilities() -> Capabilities {
    let backends = canopy_sdk::available_backends();
    let gpu = backends
        .iter()
        .any(|backend| backend == "gpu")
        .then(canopy_sdk::gpu_adapter)
        .flatten();
    Capabilities {
        tier: Tier::Edge,
        backends,
        memory_mb: 2048,
        os: "linux".to_string(),
        tags: Default::default(),
        gpu,
    }
}

fn job_spec(version_id: &Value) -> Value {
    json!({
        "name": "sdk", "model_version_id": version_id, "rounds": 1,
        "min_devices": 1, "target_devices": 1, "over_selection": 0.0,
        "evaluation": {"fraction": 0.0}, "round_deadline_ms": 120_000, "local_epochs": 1, "batch_size": 16, "learning_rate": 0.1,
    })
}

/// Enrolls a fresh key through the blocking API; the client goes to `base`.
fn enroll_blocking(
    server: &TestServer,
    token: &str,
    base: &str,
    policy: RetryPolicy,
) -> Result<blocking::DeviceClient> {
    let key = DeviceKey::generate();
    let enrolled = blocking::enroll(&server.transport(), token, &key, capabilities())?;
    let transport = Transport::new(base, &server.trust())?;
    Ok(blocking::DeviceClient::new(
        transport,
        enrolled.device_id,
        key,
        &enrolled.server_public_key,
    )?
    .with_retry_policy(policy))
}

/// Polls until the device has a task.
fn poll(device: &blocking::DeviceClient) -> Result<Task> {
    for _ in 0..30 {
        if let Some(task) = device.next_task(2_000)? {
            return Ok(task);
        }
    }
    bail!("no task within 30 polls")
}

fn quick_retries() -> RetryPolicy {
    RetryPolicy {
        max_attempts: 8,
        initial_backoff_ms: 50,
        max_backoff_ms: 500,
        multiplier: 2.0,
    }
}

#[test]
fn blocking_client_runs_a_round_from_a_thread_without_a_runtime() -> Result<()> {
    assert!(tokio::runtime::Handle::try_current().is_err());
    let server = TestServer::start(Database::Sqlite)?;
    // The admin client is async; it runs on its own runtime, entered only
    // inside `block_on`, so the device calls below run with none.
    let rt = runtime()?;
    let admin = server.admin();
    let (version, token) = rt.block_on(async {
        let version = admin.upload_model("logreg", logreg_model_bytes(1)).await?;
        let token = admin.enrollment_token(1).await?;
        anyhow::Ok((version, token))
    })?;

    // The key goes through the key store, as an app would keep it.
    let dir = tempfile::tempdir()?;
    let key_path = dir.path().join("device.key");
    canopy_sdk::save_device_key(&key_path, &DeviceKey::generate())?;
    let key = canopy_sdk::load_device_key(&key_path)?;
    let enrolled = blocking::enroll(&server.transport(), &token, &key, capabilities())?;
    let device = blocking::DeviceClient::new(
        server.transport(),
        enrolled.device_id,
        key,
        &enrolled.server_public_key,
    )?
    .with_retry_policy(RetryPolicy::default());
    device.heartbeat(&Heartbeat {
        state: Some("idle".to_string()),
        round_id: None,
        ..Heartbeat::default()
    })?;
    assert_eq!(device.next_task(0)?, None, "no job yet");

    let job = rt.block_on(admin.create_job(job_spec(&version["id"])))?;
    let task = poll(&device)?;
    let model = device.download_model(&task)?;
    assert_eq!(model.digest, task.model_digest);
    assert_eq!(model.bytes.len() as u64, task.model_size_bytes);

    let digits = Path::new(env!("CARGO_MANIFEST_DIR")).join("../datasets/digits/digits.csv.gz");
    let (train, _test) = load_csv(digits, LabelColumn::Last)?.split(0.2, 17)?;
    let reported = capabilities();
    let choice = canopy_sdk::choose_backend(&reported);
    // The SDK prefers an NPU (ONNX Runtime, when its library loads), then
    // a GPU, then the CPU.
    let expected = if reported.backends.iter().any(|backend| backend == "npu") {
        canopy_sdk::BackendKind::Npu
    } else if reported.gpu.is_some() {
        canopy_sdk::BackendKind::Gpu
    } else {
        canopy_sdk::BackendKind::Cpu
    };
    assert_eq!(choice.kind(), expected, "{reported:?}");
    assert!(choice.fallback().is_none(), "{choice}");
    let options = TrainOptions {
        backend: choice,
        cancel: device.cancel_token().clone(),
        ..TrainOptions::default()
    };
    let update = train_task(&model.bytes, &task, &train, 5, &options)?;
    let receipt = device.upload_update(&task, Bytes::from(update.encoded))?;
    assert!(receipt.accepted);
    assert_eq!(receipt.round_id, task.round_id);
    assert_eq!(receipt.num_samples, train.len() as u64);
    device.report_metrics(&RoundMetrics {
        round_id: task.round_id,
        train_loss: Some(update.train_loss),
        eval_loss: None,
        eval_accuracy: None,
        eval_samples: None,
        train_duration_ms: Some(update.train_duration_ms),
    })?;

    let finished = rt.block_on(admin.wait_for_job(job, Duration::from_secs(60)))?;
    assert_eq!(finished["state"], "completed", "{finished}");
    let averaged = rt.block_on(fetch_model(&admin, "logreg", 2))?;
    assert!(!averaged.parameters.is_empty());

    // The one-call form an app uses: download, train, upload, report.
    let next_job = rt.block_on(admin.create_job(job_spec(&json!(2))))?;
    let task = poll(&device)?;
    assert_eq!(
        task.model_version_id, 2,
        "the second job starts from the first job's result"
    );
    let outcome = device.run_task(&task, &train, 6)?;
    assert!(outcome.receipt.accepted && outcome.train_loss.is_some_and(f64::is_finite));
    let finished = rt.block_on(admin.wait_for_job(next_job, Duration::from_secs(60)))?;
    assert_eq!(finished["state"], "completed", "{finished}");
    let round = rt.block_on(admin.ok(&format!("/api/v1/rounds/{}", task.round_id)))?;
    assert!(
        round["metrics"]["train_loss"].as_f64().is_some(),
        "run_task reports the loss: {round}"
    );
    Ok(())
}

/// A TCP proxy in front of the server that cuts the first connection to
/// carry more than `cut_after` bytes towards the client, once, and counts
/// what it saw.
struct CuttingProxy {
    port: u16,
    stats: Arc<ProxyStats>,
}

#[derive(Default)]
struct ProxyStats {
    armed: AtomicBool,
    connections: AtomicU64,
    cuts: AtomicU64,
    bytes_down: AtomicU64,
    stop: AtomicBool,
}

impl CuttingProxy {
    fn start(upstream_port: u16, cut_after: u64) -> Result<CuttingProxy> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let port = listener.local_addr()?.port();
        let stats = Arc::new(ProxyStats::default());
        stats.armed.store(true, Ordering::SeqCst);
        let shared = stats.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                if shared.stop.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(client) = client else { continue };
                let Ok(server) = TcpStream::connect(("127.0.0.1", upstream_port)) else {
                    continue;
                };
                shared.connections.fetch_add(1, Ordering::SeqCst);
                let (Ok(client_reader), Ok(server_writer)) =
                    (client.try_clone(), server.try_clone())
                else {
                    continue;
                };
                std::thread::spawn(move || pump_up(client_reader, server_writer));
                let stats = shared.clone();
                std::thread::spawn(move || pump_down(server, client, cut_after, &stats));
            }
        });
        Ok(CuttingProxy { port, stats })
    }

    fn base(&self) -> String {
        format!("https://127.0.0.1:{}", self.port)
    }
}

impl Drop for CuttingProxy {
    fn drop(&mut self) {
        self.stats.stop.store(true, Ordering::SeqCst);
        // Wakes the accept loop so that it sees the flag.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

fn pump_up(mut from: TcpStream, mut to: TcpStream) {
    let _ = std::io::copy(&mut from, &mut to);
    let _ = to.shutdown(Shutdown::Write);
}

fn pump_down(mut from: TcpStream, mut to: TcpStream, cut_after: u64, stats: &ProxyStats) {
    let mut buffer = [0u8; 16 * 1024];
    let mut sent = 0u64;
    loop {
        let read = match from.read(&mut buffer) {
            Ok(0) | Err(_) => break,
            Ok(read) => read,
        };
        if sent + read as u64 > cut_after && stats.armed.swap(false, Ordering::SeqCst) {
            let keep = (cut_after - sent) as usize;
            let _ = to.write_all(&buffer[..keep]);
            stats.bytes_down.fetch_add(keep as u64, Ordering::SeqCst);
            stats.cuts.fetch_add(1, Ordering::SeqCst);
            let _ = to.shutdown(Shutdown::Both);
            let _ = from.shutdown(Shutdown::Both);
            return;
        }
        if to.write_all(&buffer[..read]).is_err() {
            break;
        }
        sent += read as u64;
        stats.bytes_down.fetch_add(read as u64, Ordering::SeqCst);
    }
    let _ = to.shutdown(Shutdown::Write);
}

#[test]
fn a_download_cut_mid_way_resumes_with_a_range_request() -> Result<()> {
    let server = TestServer::start(Database::Sqlite)?;
    let rt = runtime()?;
    let admin = server.admin();
    // About 1.1 MB, so the cut lands well inside the model.
    let model = model_bytes(
        Architecture::Mlp {
            inputs: 256,
            hidden: 1024,
            classes: 10,
        },
        2,
    );
    let size = model.len() as u64;
    let (version, token) = rt.block_on(async {
        let version = admin.upload_model("mlp", model.clone()).await?;
        let token = admin.enrollment_token(1).await?;
        anyhow::Ok((version, token))
    })?;
    let cut_after = 300_000;
    let proxy = CuttingProxy::start(server.port, cut_after)?;
    let device = enroll_blocking(&server, &token, &proxy.base(), quick_retries())?;
    rt.block_on(admin.create_job(job_spec(&version["id"])))?;
    let task = poll(&device)?;
    assert_eq!(task.model_size_bytes, size);
    assert_eq!(
        proxy.stats.cuts.load(Ordering::SeqCst),
        0,
        "the poll is not cut"
    );

    let dir = tempfile::tempdir()?;
    let target = dir.path().join("model.canopy");
    let downloaded = device.download_model_to(&task, &target)?;
    assert_eq!(downloaded.bytes.as_ref(), model.as_slice());
    assert_eq!(std::fs::read(&target)?, model);
    assert_eq!(
        proxy.stats.cuts.load(Ordering::SeqCst),
        1,
        "the download was cut"
    );
    assert!(
        proxy.stats.connections.load(Ordering::SeqCst) >= 2,
        "the client reconnected"
    );
    // The server counts every model response's length when it starts it:
    // the cut response counts the whole file, the resumed one what was
    // left. A restart from byte 0 would count exactly twice the size.
    let round = rt.block_on(admin.ok(&format!("/api/v1/rounds/{}", task.round_id)))?;
    let bytes_out = round["metrics"]["bytes_out"]
        .as_u64()
        .context("bytes_out")?;
    let down = proxy.stats.bytes_down.load(Ordering::SeqCst);
    eprintln!("model {size} bytes; server sent {bytes_out} in all; {down} bytes through the proxy");
    assert!(
        bytes_out > size && bytes_out < 2 * size,
        "a range request sent {} of {size} bytes again; bytes_out {bytes_out}",
        bytes_out.saturating_sub(size)
    );
    // And the bytes through the proxy show no second full copy.
    assert!(down < size + cut_after / 2, "{down} bytes went down");
    Ok(())
}

/// A zero-wait check-in is answered from the process's task board when
/// the device is not on it; a selection committed before the check-in
/// began must still be seen, however fresh the board was.
#[test]
fn a_zero_wait_check_in_sees_its_selection_at_once() -> Result<()> {
    let server = TestServer::start(Database::Sqlite)?;
    let rt = runtime()?;
    let admin = server.admin();
    let (version, token) = rt.block_on(async {
        let version = admin.upload_model("logreg", logreg_model_bytes(1)).await?;
        anyhow::Ok((version, admin.enrollment_token(1).await?))
    })?;
    let device = enroll_blocking(&server, &token, &server.base, RetryPolicy::default())?;
    assert_eq!(device.next_task(0)?, None, "no job yet");
    let job = rt.block_on(admin.create_job(job_spec(&version["id"])))?;
    let deadline = Instant::now() + Duration::from_secs(60);
    // Zero-wait check-ins keep the board fresh until the admin API shows
    // the selection committed; the check-in after that must find it.
    let selected = loop {
        ensure!(Instant::now() < deadline, "job {job} selected nobody");
        if let Some(task) = device.next_task(0)? {
            break task;
        }
        let rounds = rt.block_on(admin.ok(&format!("/api/v1/jobs/{job}/rounds")))?;
        let Some(round) = rounds["items"][0]["id"].as_i64() else {
            continue;
        };
        let participants =
            rt.block_on(admin.ok(&format!("/api/v1/rounds/{round}/participants")))?;
        if participants["items"]
            .as_array()
            .is_some_and(|p| !p.is_empty())
        {
            break device
                .next_task(0)?
                .context("selected, and the next zero-wait check-in found no task")?;
        }
    };
    assert_eq!(selected.job_id, job);
    Ok(())
}

#[test]
fn cancelling_a_long_poll_returns_promptly() -> Result<()> {
    let server = TestServer::start(Database::Sqlite)?;
    let rt = runtime()?;
    let token = rt.block_on(server.admin().enrollment_token(1))?;
    let mut device = enroll_blocking(&server, &token, &server.base, RetryPolicy::default())?;
    let cancel = device.cancel_token().clone();
    let canceller = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        cancel.cancel();
    });
    let started = Instant::now();
    let outcome = device.next_task(25_000);
    let waited = started.elapsed();
    canceller
        .join()
        .map_err(|_| anyhow::anyhow!("canceller panicked"))?;
    assert!(matches!(outcome, Err(SdkError::Cancelled)), "{outcome:?}");
    assert!(
        waited < Duration::from_secs(3),
        "cancelled after {waited:?}"
    );
    // Still cancelled until the token is replaced; then it works again.
    assert!(matches!(
        device.heartbeat(&Heartbeat::default()),
        Err(SdkError::Cancelled)
    ));
    device.set_cancel_token(CancelToken::new());
    device.heartbeat(&Heartbeat::default())?;
    assert_eq!(device.next_task(0)?, None);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_the_async_client_stops_a_poll_and_its_retries() -> Result<()> {
    let server = TestServer::start(Database::Sqlite)?;
    let token = server.admin().enrollment_token(1).await?;
    let device = support::enroll_device(&server, &token).await?;
    let cancel = CancelToken::new();
    let device = device
        .with_retry_policy(RetryPolicy::default())
        .with_cancel_token(cancel.clone());
    let poll = tokio::spawn(async move {
        let started = Instant::now();
        (device.next_task(25_000).await, started.elapsed())
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    cancel.cancel();
    let (outcome, waited) = poll.await?;
    assert!(matches!(outcome, Err(SdkError::Cancelled)), "{outcome:?}");
    assert!(
        waited < Duration::from_secs(3),
        "cancelled after {waited:?}"
    );
    Ok(())
}

#[test]
fn retries_ride_out_a_server_restart() -> Result<()> {
    let mut server = TestServer::start(Database::Sqlite)?;
    let rt = runtime()?;
    let token = rt.block_on(server.admin().enrollment_token(1))?;
    // Up to 19 waits of at most 0.2, 0.4, 0.8, 1.6, then 2 s each.
    let patient = RetryPolicy {
        max_attempts: 20,
        initial_backoff_ms: 200,
        max_backoff_ms: 2_000,
        multiplier: 2.0,
    };
    let device = enroll_blocking(&server, &token, &server.base, patient)?;
    device.heartbeat(&Heartbeat::default())?;
    server.kill9();
    let killed = Instant::now();
    let worker = std::thread::spawn(move || {
        let outcome = device.heartbeat(&Heartbeat::default());
        let poll = device.next_task(0);
        (outcome, poll, killed.elapsed())
    });
    std::thread::sleep(Duration::from_millis(1_500));
    server.restart()?;
    let (outcome, poll, took) = worker
        .join()
        .map_err(|_| anyhow::anyhow!("worker panicked"))?;
    let answer = outcome.context("the heartbeat outlived the restart")?;
    assert!(answer.heartbeat_interval_ms > 0);
    assert_eq!(poll?, None);
    ensure!(
        took >= Duration::from_millis(1_500),
        "the heartbeat must have waited for the restart, took {took:?}"
    );
    Ok(())
}

/// A device over its request rate is refused for the answer's
/// `Retry-After` (1 s); a retry inside that window is refused again. With
/// a 10 ms backoff, only honouring the header gets the calls through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_throttled_device_waits_out_retry_after() -> Result<()> {
    let dir = support::private_tempdir()?;
    let config = support::limits_file(dir.path(), "device_requests_per_second = 1")?;
    let server = TestServer::start_with(Database::Sqlite, &["--config", &config])?;
    let token = server.admin().enrollment_token(1).await?;
    // Each retry notice: the status that caused it and the wait.
    type Notices = std::sync::Mutex<Vec<(Option<u16>, Duration)>>;
    let notices: Arc<Notices> = Arc::default();
    let seen = Arc::clone(&notices);
    let device = support::enroll_device(&server, &token)
        .await?
        .with_retry_policy(RetryPolicy {
            max_attempts: 3,
            initial_backoff_ms: 10,
            max_backoff_ms: 10_000,
            multiplier: 1.0,
        })
        .with_retry_observer(Arc::new(move |notice| {
            let status = notice.error.status();
            seen.lock().unwrap().push((status, notice.wait));
        }));
    for beat in 0..6 {
        device
            .heartbeat(&Heartbeat::default())
            .await
            .with_context(|| format!("heartbeat {beat}"))?;
    }
    let notices = notices.lock().unwrap().clone();
    ensure!(
        !notices.is_empty(),
        "six heartbeats at once must pass a 1/s cap"
    );
    for (status, wait) in &notices {
        ensure!(
            *status == Some(429),
            "only throttling is retried here: {notices:?}"
        );
        ensure!(
            *wait >= Duration::from_secs(1),
            "a retry inside Retry-After is refused again: {notices:?}"
        );
    }
    Ok(())
}

#[test]
fn certificate_failures_are_reported_and_not_retried() -> Result<()> {
    let server = TestServer::start(Database::Sqlite)?;
    let key = DeviceKey::generate();
    for trust in [
        Trust::PinnedSha256(format!("sha256:{}", "00".repeat(32))),
        // The public roots do not include a self-signed development
        // certificate.
        Trust::SystemRoots,
    ] {
        let transport = Transport::new(&server.base, &trust)?;
        let error = blocking::enroll_with(
            &transport,
            "token",
            &key,
            capabilities(),
            &RetryPolicy::default(),
            &CancelToken::new(),
        )
        .expect_err("the certificate is refused");
        assert!(
            matches!(error, SdkError::Transport { .. }),
            "{trust:?}: {error:?}"
        );
        assert!(!error.is_retryable(), "{trust:?}: {error:?}");
    }
    // While a connection refused (the port is closed) is retried.
    let closed = {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        listener.local_addr()?.port()
    };
    let transport = Transport::new(&format!("https://127.0.0.1:{closed}"), &server.trust())?;
    let error =
        blocking::enroll(&transport, "token", &key, capabilities()).expect_err("nothing listens");
    assert!(error.is_retryable(), "{error:?}");
    Ok(())
}
