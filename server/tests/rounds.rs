//! Federated rounds end to end, on SQLite and on PostgreSQL, over real
//! HTTPS with real device keys: the aggregated models are checked against
//! FedAvg computed here, independently, and every kind of bad request is
//! refused without stopping the job.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{Result, ensure};
use bytes::Bytes;
use canopy_ir::Buffer;
use canopy_protocol::auth::{self, DeviceKey};
use canopy_protocol::messages::{
    Capabilities, GpuAdapter, GpuApi, GpuDeviceType, RoundMetrics, Task,
};
use canopy_protocol::update::{UpdateLayout, encode_update};
use canopy_sdk::{DeviceClient, SdkError};
use reqwest::Method;
use serde_json::{Value, json};

use crate::support::{
    Admin, Database, TestServer, capabilities, enroll_device, enroll_device_with, fetch_model,
    logreg_model_bytes, poll_task,
};

const JOB_TIMEOUT: Duration = Duration::from_secs(120);

/// A deterministic update: small values from a per-device, per-round seed.
fn delta(layout: &UpdateLayout, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    (0..layout.num_elements())
        .map(|_| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            ((z >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.02
        })
        .collect()
}

/// One accepted update, as the test remembers it.
#[derive(Clone)]
struct Sent {
    samples: u64,
    values: Vec<f32>,
}

/// FedAvg computed independently: θ + Σ nᵢΔᵢ / Σ nᵢ, per trainable tensor.
fn expected_params(base: &canopy_ir::Model, sent: &[Sent]) -> BTreeMap<String, Vec<f32>> {
    let total: f64 = sent.iter().map(|s| s.samples as f64).sum();
    let mut offset = 0;
    let mut out = BTreeMap::new();
    for parameter in base.parameters.iter().filter(|p| p.trainable) {
        let Buffer::F32(values) = &parameter.data.buffer else {
            panic!("f32 parameter")
        };
        let averaged = values
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let weighted: f64 = sent
                    .iter()
                    .map(|s| s.samples as f64 * f64::from(s.values[offset + i]))
                    .sum();
                (f64::from(*v) + weighted / total) as f32
            })
            .collect();
        offset += values.len();
        out.insert(parameter.name.clone(), averaged);
    }
    out
}

fn assert_params(model: &canopy_ir::Model, expected: &BTreeMap<String, Vec<f32>>) {
    for (name, want) in expected {
        let Buffer::F32(got) = &model.parameter(name).expect("parameter").data.buffer else {
            panic!("f32")
        };
        assert_eq!(got.len(), want.len(), "{name}");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-6 * w.abs().max(1.0),
                "{name}[{i}]: server {g}, FedAvg {w}"
            );
        }
    }
}

/// Downloads (verified), uploads a deterministic update, reports metrics.
async fn train(device: &DeviceClient, task: &Task, samples: u64) -> Result<Sent> {
    device.download_model(task).await?;
    let values = delta(
        &task.layout,
        device.device_id as u64 * 1000 + task.round_number as u64,
    );
    let encoded = encode_update(&task.layout, samples, &values)?;
    device.upload_update(task, Bytes::from(encoded)).await?;
    device
        .report_metrics(&RoundMetrics {
            round_id: task.round_id,
            train_loss: Some(0.5 + device.device_id as f64 / 100.0),
            eval_loss: None,
            eval_accuracy: Some(0.8),
            eval_samples: Some(samples),
            train_duration_ms: Some(12),
        })
        .await?;
    Ok(Sent { samples, values })
}

fn job_spec(version_id: i64, rounds: u32, min: u32, target: u32, deadline_ms: u64) -> Value {
    json!({
        "name": "fedavg-test", "model_version_id": version_id, "rounds": rounds,
        "min_devices": min, "target_devices": target, "over_selection": 0.0,
        "evaluation": {"fraction": 0.0}, "round_deadline_ms": deadline_ms, "local_epochs": 1, "batch_size": 8, "learning_rate": 0.1,
        "strategy": {"name": "fedavg"}, "max_round_retries": 3,
    })
}

fn status_of(result: Result<impl Sized, SdkError>) -> Option<u16> {
    result.err().and_then(|error| error.status())
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Every admin route in the OpenAPI document, with ids filled in.
async fn admin_routes(admin: &Admin) -> Result<Vec<(Method, String)>> {
    let doc = admin.ok("/api/v1/openapi.json").await?;
    let mut routes = Vec::new();
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for method in item.as_object().expect("operations").keys() {
            let concrete = path
                .replace("{name}", "logreg")
                .replace("{version}", "1")
                .replace("{id}", "1");
            routes.push((method.to_uppercase().parse()?, concrete));
        }
    }
    ensure!(
        routes.len() >= 20,
        "the OpenAPI document lists only {} operations",
        routes.len()
    );
    Ok(routes)
}

async fn refuses_unauthenticated_and_underprivileged(server: &TestServer) -> Result<()> {
    let anonymous = server.admin_as("");
    let forged =
        server.admin_as("cnpa_0000000000000000000000000000000000000000000000000000000000000000");
    for (method, path) in admin_routes(&server.admin()).await? {
        for client in [&anonymous, &forged] {
            let reply = client.send(method.clone(), &path, Some(json!({}))).await?;
            assert_eq!(
                reply.status, 401,
                "{method} {path} without a valid token: {}",
                reply.body
            );
            assert_eq!(
                reply.body["error"]["code"], "unauthorized",
                "{method} {path}"
            );
        }
    }
    let created = server
        .admin()
        .post(
            "/api/v1/tokens",
            json!({"role": "viewer", "label": "read-only"}),
        )
        .await?;
    assert_eq!(created.status, 201, "{}", created.body);
    let viewer = server.admin_as(created.body["secret"].as_str().unwrap_or_default());
    assert_eq!(viewer.get("/api/v1/jobs").await?.status, 200);
    for (path, body) in [
        ("/api/v1/jobs", job_spec(1, 1, 1, 1, 10_000)),
        (
            "/api/v1/enrollment-tokens",
            json!({"expires_in": "1h", "max_uses": 1}),
        ),
        ("/api/v1/jobs/1/pause", json!({})),
        ("/api/v1/tokens", json!({"role": "admin"})),
    ] {
        let reply = viewer.post(path, body).await?;
        assert_eq!(reply.status, 403, "viewer POST {path}: {}", reply.body);
    }
    let operator = server
        .admin()
        .post("/api/v1/tokens", json!({"role": "operator"}))
        .await?;
    let operator = server.admin_as(operator.body["secret"].as_str().unwrap_or_default());
    assert_eq!(
        operator.get("/api/v1/tokens").await?.status,
        403,
        "operators cannot manage tokens"
    );
    Ok(())
}

/// Replay, forgery, oversize, wrong shape, NaN and duplicates, on a device
/// that holds a live task; ends with the device's valid upload.
async fn refuses_bad_device_requests(
    server: &TestServer,
    device: &DeviceClient,
    task: &Task,
    samples: u64,
) -> Result<Sent> {
    // A replayed request: the same signed headers, sent twice.
    let body = Bytes::from_static(b"{}");
    let signed = auth::sign_request(
        device.key(),
        device.device_id,
        "POST",
        "/device/v1/heartbeat",
        &body,
        now_ms(),
    );
    let first = device
        .send_signed(Method::POST, "/device/v1/heartbeat", body.clone(), &signed)
        .await?;
    assert_eq!(first.status(), 200);
    let replay = device
        .send_signed(Method::POST, "/device/v1/heartbeat", body.clone(), &signed)
        .await?;
    assert_eq!(replay.status(), 401, "a replayed request must be refused");
    assert!(replay.text().await?.contains("replayed"));

    // A forged signature: another key claims this device's id.
    let impostor = DeviceKey::generate();
    let forged = auth::sign_request(
        &impostor,
        device.device_id,
        "POST",
        "/device/v1/heartbeat",
        &body,
        now_ms(),
    );
    let reply = device
        .send_signed(Method::POST, "/device/v1/heartbeat", body.clone(), &forged)
        .await?;
    assert_eq!(reply.status(), 401, "a forged signature must be refused");

    // A body that is not the signed one.
    let signed = auth::sign_request(
        device.key(),
        device.device_id,
        "POST",
        "/device/v1/heartbeat",
        &body,
        now_ms(),
    );
    let swapped = device
        .send_signed(
            Method::POST,
            "/device/v1/heartbeat",
            Bytes::from_static(b"{ }"),
            &signed,
        )
        .await?;
    assert_eq!(
        swapped.status(),
        401,
        "a body other than the signed one must be refused"
    );

    oversize_upload_is_refused_unread(server, device, task).await?;

    // Wrong shape: the first tensor transposed, same byte count.
    let mut tensors = task.layout.tensors.clone();
    tensors[0].shape.reverse();
    let transposed = UpdateLayout::new(tensors)?;
    let values = delta(&task.layout, 7);
    let encoded = encode_update(&transposed, samples, &values)?;
    let reply = device.upload_update(task, Bytes::from(encoded)).await;
    assert_eq!(status_of(reply), Some(422), "a wrong shape must answer 422");

    // NaN: a valid encoding with one value overwritten.
    let mut encoded = encode_update(&task.layout, samples, &values)?;
    let at = encoded.len() - 4;
    encoded[at..].copy_from_slice(&f32::NAN.to_le_bytes());
    let reply = device.upload_update(task, Bytes::from(encoded)).await;
    match reply {
        Err(SdkError::Server {
            status: 422,
            message,
            ..
        }) => assert!(message.contains("NaN"), "{message}"),
        other => panic!("NaN must answer 422, got {other:?}"),
    }

    let sent = train(device, task, samples).await?;
    let again = encode_update(&task.layout, samples, &sent.values)?;
    assert_eq!(
        status_of(device.upload_update(task, Bytes::from(again)).await),
        Some(409),
        "a duplicate must answer 409"
    );
    Ok(sent)
}

/// Declares a body twice the model's update size and then never sends it:
/// the server must answer 413 from the headers alone.
async fn oversize_upload_is_refused_unread(
    server: &TestServer,
    device: &DeviceClient,
    task: &Task,
) -> Result<()> {
    let declared = task.upload_size_bytes * 2;
    let signed = auth::sign_request_with_digest(
        device.key(),
        device.device_id,
        "PUT",
        &task.upload_path,
        &"0".repeat(64),
        now_ms(),
    );
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(1);
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    });
    let mut request = server
        .transport()
        .http()
        .put(server.transport().url(&task.upload_path))
        .header("content-length", declared.to_string())
        .body(reqwest::Body::wrap_stream(stream));
    for (name, value) in signed.headers() {
        request = request.header(name, value);
    }
    let answered = tokio::time::timeout(Duration::from_secs(10), request.send()).await;
    drop(tx);
    let response = answered.map_err(|_| {
        anyhow::anyhow!("the server waited for an oversize body instead of refusing it")
    })??;
    assert_eq!(response.status(), 413, "oversize upload");

    // Without a length header, the server stops reading at the limit.
    let chunk = Bytes::from(vec![0u8; 64 << 10]);
    let chunks = (task.upload_size_bytes / chunk.len() as u64 + 4) as usize;
    let stream = futures_util::stream::iter(
        (0..chunks).map(move |_| Ok::<_, std::io::Error>(chunk.clone())),
    );
    let signed = auth::sign_request_with_digest(
        device.key(),
        device.device_id,
        "PUT",
        &task.upload_path,
        &"0".repeat(64),
        now_ms(),
    );
    let mut request = server
        .transport()
        .http()
        .put(server.transport().url(&task.upload_path))
        .body(reqwest::Body::wrap_stream(stream));
    for (name, value) in signed.headers() {
        request = request.header(name, value);
    }
    let status = match request.send().await {
        Ok(response) => response.status().as_u16(),
        // The server may close the connection once it has answered.
        Err(error) => {
            anyhow::ensure!(
                error.is_request() || error.is_body(),
                "unexpected error: {error}"
            );
            413
        }
    };
    assert_eq!(status, 413, "oversize chunked upload");
    Ok(())
}

async fn federated_job_matches_fedavg(database: Database) -> Result<()> {
    let server = TestServer::start(database)?;
    let admin = server.admin();
    refuses_unauthenticated_and_underprivileged(&server).await?;

    let invalid = admin
        .post_bytes(
            "/api/v1/models/logreg/versions",
            b"CANOPYIR but not really".to_vec(),
        )
        .await?;
    assert_eq!(invalid.status, 422, "an invalid IR file: {}", invalid.body);
    assert!(
        invalid.body["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("invalid")
    );

    let version = admin.upload_model("logreg", logreg_model_bytes(7)).await?;
    assert_eq!(version["version"], 1);
    let token = admin.enrollment_token(4).await?;
    let mut devices = Vec::new();
    for _ in 0..4 {
        devices.push(enroll_device(&server, &token).await?);
    }
    let Err(exhausted) = enroll_device(&server, &token).await else {
        panic!("a fifth enrollment must fail");
    };
    assert!(format!("{exhausted:#}").contains("used 4 times"));

    let job = admin
        .create_job(job_spec(
            version["id"].as_i64().unwrap_or_default(),
            2,
            3,
            4,
            60_000,
        ))
        .await?;
    let mut base = fetch_model(&admin, "logreg", 1).await?;
    for round in 1..=2 {
        let mut sent = Vec::new();
        for (index, device) in devices.iter().enumerate() {
            let task = poll_task(device).await?;
            assert_eq!(task.round_number, round);
            let samples = 10 * (index as u64 + 1);
            if round == 1 && index == 0 {
                sent.push(refuses_bad_device_requests(&server, device, &task, samples).await?);
            } else {
                sent.push(train(device, &task, samples).await?);
            }
        }
        let expected = expected_params(&base, &sent);
        let job_state = wait_for_rounds(&admin, job, round).await?;
        let version_number = i64::from(round) + 1;
        let produced = fetch_model(&admin, "logreg", version_number).await?;
        assert_params(&produced, &expected);
        assert!(
            produced.metadata.parent_digest.is_some(),
            "lineage in the file"
        );
        let lineage = admin
            .ok(&format!(
                "/api/v1/models/logreg/versions/{version_number}/lineage"
            ))
            .await?;
        assert_eq!(lineage["chain"][0]["produced_by_job"], job);
        assert_eq!(lineage["chain"][1]["version"], version_number - 1, "parent");
        assert!(job_state["rounds_completed"].as_i64() >= Some(i64::from(round)));
        base = produced;
    }
    let finished = admin.wait_for_job(job, JOB_TIMEOUT).await?;
    assert_eq!(finished["state"], "completed", "{finished}");
    let rounds = admin.ok(&format!("/api/v1/jobs/{job}/rounds")).await?;
    let first = &rounds["items"][0];
    assert_eq!(first["state"], "succeeded");
    assert_eq!(first["metrics"]["updates_accepted"], 4);
    assert_eq!(first["metrics"]["samples"], 100);
    assert!(
        (first["metrics"]["eval_accuracy"]
            .as_f64()
            .unwrap_or_default()
            - 0.8)
            .abs()
            < 1e-9
    );
    assert!(
        first["metrics"]["bytes_in"].as_i64() > Some(0)
            && first["metrics"]["bytes_out"].as_i64() > Some(0)
    );
    let detail = admin.ok(&format!("/api/v1/rounds/{}", first["id"])).await?;
    let participants = detail["participants"].as_array().map(Vec::len);
    assert_eq!(participants, Some(4), "{detail}");
    assert!(
        detail["participants"]
            .as_array()
            .into_iter()
            .flatten()
            .all(|p| p["state"] == "uploaded")
    );

    let late = devices[0].next_task(100).await?;
    assert!(late.is_none(), "no task after the job completed");
    let metrics = reqwest_text(&server, "/metrics").await?;
    assert!(
        metrics.contains("canopy_updates_accepted_total 8"),
        "{metrics}"
    );
    Ok(())
}

async fn reqwest_text(server: &TestServer, path: &str) -> Result<String> {
    // With the admin token: `/metrics` needs one.
    Ok(server
        .transport()
        .http()
        .get(server.transport().url(path))
        .bearer_auth(&server.admin_token)
        .send()
        .await?
        .text()
        .await?)
}

/// Waits until the job has completed `round` rounds; returns the job.
async fn wait_for_rounds(admin: &Admin, job: i64, round: u32) -> Result<Value> {
    let deadline = std::time::Instant::now() + JOB_TIMEOUT;
    loop {
        let state = admin.ok(&format!("/api/v1/jobs/{job}")).await?;
        if state["rounds_completed"].as_i64() >= Some(i64::from(round)) {
            return Ok(state);
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "round {round} did not finish: {state}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Nonces are written in batches (`NonceBook`): of one signed request sent
/// eight times at once (the device's in-flight cap) exactly one is taken,
/// and 64 distinct requests from eight devices sent at once all are.
async fn nonces_hold_under_concurrency(database: Database) -> Result<()> {
    let server = TestServer::start(database)?;
    let token = server.admin().enrollment_token(8).await?;
    let mut devices = Vec::new();
    for _ in 0..8 {
        devices.push(enroll_device(&server, &token).await?);
    }
    let path = "/device/v1/heartbeat";
    let body = Bytes::from_static(b"{}");
    let sign = |device: &DeviceClient| {
        auth::sign_request(
            device.key(),
            device.device_id,
            "POST",
            path,
            &body,
            now_ms(),
        )
    };
    let statuses = |sent: Vec<Result<reqwest::Response, SdkError>>| -> Result<Vec<u16>> {
        Ok(sent
            .into_iter()
            .map(|r| r.map(|r| r.status().as_u16()))
            .collect::<Result<_, _>>()?)
    };

    let signed = sign(&devices[0]);
    let replays = futures_util::future::join_all(
        (0..8).map(|_| devices[0].send_signed(Method::POST, path, body.clone(), &signed)),
    )
    .await;
    let mut replays = statuses(replays)?;
    replays.sort_unstable();
    assert_eq!(replays, [200, 401, 401, 401, 401, 401, 401, 401]);

    let requests: Vec<_> = devices
        .iter()
        .flat_map(|device| (0..8).map(move |_| device))
        .map(|device| (device, sign(device)))
        .collect();
    let distinct = futures_util::future::join_all(
        requests
            .iter()
            .map(|(device, signed)| device.send_signed(Method::POST, path, body.clone(), signed)),
    )
    .await;
    let distinct = statuses(distinct)?;
    assert!(distinct.iter().all(|&s| s == 200), "{distinct:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nonces_hold_under_concurrency_on_sqlite() -> Result<()> {
    nonces_hold_under_concurrency(Database::Sqlite).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nonces_hold_under_concurrency_on_postgres() -> Result<()> {
    nonces_hold_under_concurrency(Database::Postgres).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn federated_job_on_sqlite() -> Result<()> {
    federated_job_matches_fedavg(Database::Sqlite).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn federated_job_on_postgres() -> Result<()> {
    federated_job_matches_fedavg(Database::Postgres).await
}

/// kill -9 mid-round, restart: accepted updates survive, none is counted
/// twice, and the job completes with exactly FedAvg of the four updates.
async fn survives_kill_9(database: Database) -> Result<()> {
    let mut server = TestServer::start(database)?;
    let admin = server.admin();
    let version = admin.upload_model("logreg", logreg_model_bytes(3)).await?;
    let token = admin.enrollment_token(4).await?;
    let mut devices = Vec::new();
    for _ in 0..4 {
        devices.push(enroll_device(&server, &token).await?);
    }
    let job = admin
        .create_job(job_spec(
            version["id"].as_i64().unwrap_or_default(),
            1,
            4,
            4,
            120_000,
        ))
        .await?;
    let base = fetch_model(&admin, "logreg", 1).await?;
    let mut tasks = Vec::new();
    for device in &devices {
        tasks.push(poll_task(device).await?);
    }
    let mut sent = Vec::new();
    for (device, task) in devices.iter().zip(&tasks).take(2) {
        sent.push(train(device, task, 25).await?);
    }

    server.restart()?;
    let admin = server.admin();
    let round = admin
        .ok(&format!("/api/v1/rounds/{}", tasks[0].round_id))
        .await?;
    assert_eq!(
        round["metrics"]["updates_accepted"], 2,
        "accepted updates survive kill -9: {round}"
    );
    assert_eq!(round["state"], "training");
    // Clients reconnect through a fresh transport (the old connections died).
    let mut devices = devices;
    for device in &mut devices {
        device.set_transport(server.transport());
    }
    for (device, (task, earlier)) in devices.iter().zip(tasks.iter().zip(&sent)) {
        let again = encode_update(&task.layout, earlier.samples, &earlier.values)?;
        assert_eq!(
            status_of(device.upload_update(task, Bytes::from(again)).await),
            Some(409),
            "re-sent after restart"
        );
    }
    for device in devices.iter().skip(2) {
        let task = poll_task(device).await?;
        assert_eq!(
            task.round_id, tasks[0].round_id,
            "the same task is handed out again"
        );
        sent.push(train(device, &task, 40).await?);
    }
    let finished = admin.wait_for_job(job, JOB_TIMEOUT).await?;
    assert_eq!(finished["state"], "completed", "{finished}");
    assert_params(
        &fetch_model(&admin, "logreg", 2).await?,
        &expected_params(&base, &sent),
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_mid_round_on_sqlite() -> Result<()> {
    survives_kill_9(Database::Sqlite).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_mid_round_on_postgres() -> Result<()> {
    survives_kill_9(Database::Postgres).await
}

/// A round that misses its minimum fails cleanly, writes no version, and
/// is retried; late uploads answer 410.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_round_is_retried_without_a_version() -> Result<()> {
    let server = TestServer::start(Database::Sqlite)?;
    let admin = server.admin();
    let version = admin.upload_model("logreg", logreg_model_bytes(5)).await?;
    let token = admin.enrollment_token(2).await?;
    let a = enroll_device(&server, &token).await?;
    let b = enroll_device(&server, &token).await?;
    let job = admin
        .create_job(job_spec(
            version["id"].as_i64().unwrap_or_default(),
            1,
            2,
            2,
            1_500,
        ))
        .await?;
    let task_a = poll_task(&a).await?;
    let task_b = poll_task(&b).await?;
    train(&a, &task_a, 10).await?;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let round = admin
            .ok(&format!("/api/v1/rounds/{}", task_a.round_id))
            .await?;
        if round["state"] == "failed" {
            assert!(
                round["status_message"]
                    .as_str()
                    .unwrap_or_default()
                    .contains("only 1 of the 2"),
                "{round}"
            );
            assert_eq!(round["failure"]["kind"], "too_few_updates", "{round}");
            assert_eq!(round["metrics"]["dropouts"], 1);
            let silent = round["participants"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|p| p["device_id"] == b.device_id)
                .cloned()
                .unwrap_or_default();
            assert_eq!(silent["state"], "dropped", "{round}");
            assert!(
                silent["drop_reason"]
                    .as_str()
                    .unwrap_or_default()
                    .starts_with("timeout: no update before the round's deadline"),
                "{silent}"
            );
            break;
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "round did not fail: {round}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let late = encode_update(&task_b.layout, 10, &delta(&task_b.layout, 1))?;
    assert_eq!(
        status_of(b.upload_update(&task_b, Bytes::from(late)).await),
        Some(410),
        "late upload"
    );
    let versions = admin.ok("/api/v1/models/logreg/versions").await?;
    assert_eq!(
        versions["items"].as_array().map(Vec::len),
        Some(1),
        "a failed round writes no version"
    );

    let retry_a = poll_task(&a).await?;
    let retry_b = poll_task(&b).await?;
    assert_ne!(retry_a.round_id, task_a.round_id, "a new attempt");
    train(&a, &retry_a, 10).await?;
    train(&b, &retry_b, 10).await?;
    let finished = admin.wait_for_job(job, JOB_TIMEOUT).await?;
    assert_eq!(finished["state"], "completed", "{finished}");
    let rounds = admin.ok(&format!("/api/v1/jobs/{job}/rounds")).await?;
    let states: Vec<_> = rounds["items"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| {
            (
                r["number"].clone(),
                r["attempt"].clone(),
                r["state"].clone(),
            )
        })
        .collect();
    assert_eq!(
        states,
        vec![
            (json!(1), json!(1), json!("failed")),
            (json!(1), json!(2), json!("succeeded"))
        ]
    );
    Ok(())
}

/// Two server processes on one PostgreSQL database, devices split between
/// them: every round is aggregated exactly once, to exactly FedAvg.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_share_one_postgres() -> Result<()> {
    let first = TestServer::start(Database::Postgres)?;
    let second = first.second_process()?;
    let admin = first.admin();
    let version = admin.upload_model("logreg", logreg_model_bytes(11)).await?;
    let token = admin.enrollment_token(4).await?;
    let mut devices = Vec::new();
    for index in 0..4 {
        let server = if index % 2 == 0 { &first } else { &second };
        devices.push(enroll_device(server, &token).await?);
    }
    let job = admin
        .create_job(job_spec(
            version["id"].as_i64().unwrap_or_default(),
            3,
            4,
            4,
            60_000,
        ))
        .await?;
    let mut base = fetch_model(&admin, "logreg", 1).await?;
    for round in 1..=3 {
        let mut sent = Vec::new();
        for (index, device) in devices.iter().enumerate() {
            let task = poll_task(device).await?;
            sent.push(train(device, &task, 5 + index as u64).await?);
        }
        wait_for_rounds(&second.admin(), job, round).await?;
        let produced = fetch_model(&second.admin(), "logreg", i64::from(round) + 1).await?;
        assert_params(&produced, &expected_params(&base, &sent));
        base = produced;
    }
    let finished = admin.wait_for_job(job, JOB_TIMEOUT).await?;
    assert_eq!(finished["state"], "completed");
    let versions = admin.ok("/api/v1/models/logreg/versions").await?;
    assert_eq!(
        versions["items"].as_array().map(Vec::len),
        Some(4),
        "one version per round, no duplicates"
    );
    let rounds = admin.ok(&format!("/api/v1/jobs/{job}/rounds")).await?;
    assert_eq!(
        rounds["items"].as_array().map(Vec::len),
        Some(3),
        "{rounds}"
    );
    Ok(())
}

/// A signed `GET /device/v1/models/{version}`, with an optional `Range`.
async fn get_model(
    server: &TestServer,
    device: &DeviceClient,
    version_id: i64,
    range_from: Option<u64>,
) -> Result<(u16, Bytes)> {
    let path = format!("/device/v1/models/{version_id}");
    let signed = auth::sign_request(device.key(), device.device_id, "GET", &path, b"", now_ms());
    let mut request = server
        .transport()
        .http()
        .get(format!("{}{path}", server.base));
    for (name, value) in signed.headers() {
        request = request.header(name, value);
    }
    if let Some(from) = range_from {
        request = request.header("range", format!("bytes={from}-"));
    }
    let response = request.send().await?;
    Ok((response.status().as_u16(), response.bytes().await?))
}

/// Asserts a 404 whose message names the device and the version, and
/// that says nothing about whether the version exists.
async fn assert_no_task(server: &TestServer, device: &DeviceClient, version_id: i64) -> Result<()> {
    let (status, body) = get_model(server, device, version_id, None).await?;
    let text = String::from_utf8_lossy(&body);
    ensure!(
        status == 404,
        "device {} fetched model version {version_id} without a task: {status} {text}",
        device.device_id
    );
    ensure!(
        text.contains(&format!("device {}", device.device_id))
            && text.contains(&format!("model version {version_id}")),
        "the refusal names neither device nor version: {text}"
    );
    Ok(())
}

/// `filters.gpu_types` selects by the adapter a device reported at
/// enrollment: a job that asks for a hardware GPU goes to the device with a
/// discrete one, not to one with a software adapter (which offers `gpu`
/// too) nor to one without a GPU. The admin API shows the adapter.
async fn a_job_can_ask_for_a_hardware_gpu(database: Database) -> Result<()> {
    let server = TestServer::start(database)?;
    let admin = server.admin();
    let version = admin.upload_model("gpu", logreg_model_bytes(1)).await?;
    let version_id = version["id"].as_i64().expect("version id");
    let token = admin.enrollment_token(3).await?;
    let with_gpu = |device_type| Capabilities {
        backends: vec!["cpu".to_string(), "gpu".to_string()],
        gpu: Some(GpuAdapter {
            name: format!("test {device_type} adapter"),
            api: GpuApi::Vulkan,
            device_type,
            driver: "test driver 1.0".to_string(),
        }),
        ..capabilities()
    };
    let software = enroll_device_with(&server, &token, with_gpu(GpuDeviceType::Cpu)).await?;
    let without = enroll_device(&server, &token).await?;
    let discrete = enroll_device_with(&server, &token, with_gpu(GpuDeviceType::Discrete)).await?;
    let shown = admin
        .ok(&format!("/api/v1/devices/{}", discrete.device_id))
        .await?;
    ensure!(
        shown["gpu"]
            == json!({"name": "test discrete adapter", "api": "vulkan", "device_type": "discrete", "driver": "test driver 1.0"}),
        "{shown}"
    );
    let shown = admin
        .ok(&format!("/api/v1/devices/{}", without.device_id))
        .await?;
    ensure!(shown["gpu"].is_null(), "{shown}");

    for (filter, problem) in [
        (json!(["discrete", "discrete"]), "names a type twice"),
        (json!(["tpu"]), "tpu"),
    ] {
        let mut spec = job_spec(version_id, 1, 1, 3, 120_000);
        spec["filters"] = json!({"gpu_types": filter});
        let refused = admin.send(Method::POST, "/api/v1/jobs", Some(spec)).await?;
        ensure!(
            (400..500).contains(&refused.status) && refused.body.to_string().contains(problem),
            "{filter}: {} {}",
            refused.status,
            refused.body
        );
    }

    // Up to three devices per round, so only the filter keeps two out.
    let mut spec = job_spec(version_id, 1, 1, 3, 120_000);
    spec["filters"] = json!({"gpu_types": ["discrete", "integrated"]});
    admin.create_job(spec).await?;
    let task = poll_task(&discrete).await?;
    ensure!(
        task.model_version_id == version_id,
        "task on {}",
        task.model_version_id
    );
    for other in [&software, &without] {
        ensure!(
            other.next_task(500).await?.is_none(),
            "device {} has no hardware GPU but got a task",
            other.device_id
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_can_ask_for_a_hardware_gpu_on_sqlite() -> Result<()> {
    a_job_can_ask_for_a_hardware_gpu(Database::Sqlite).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_can_ask_for_a_hardware_gpu_on_postgres() -> Result<()> {
    a_job_can_ask_for_a_hardware_gpu(Database::Postgres).await
}

/// A device may download a model version only while it has a task on it:
/// not before the job, not another model's version, not another device's
/// task, not after the round; a resumed (Range) download of its open task
/// works.
async fn model_downloads_need_a_task(database: Database) -> Result<()> {
    let server = TestServer::start(database)?;
    let admin = server.admin();
    let base = admin.upload_model("task", logreg_model_bytes(1)).await?;
    let other = admin.upload_model("other", logreg_model_bytes(2)).await?;
    let base_id = base["id"].as_i64().expect("version id");
    let other_id = other["id"].as_i64().expect("version id");
    let size = base["size_bytes"].as_u64().expect("size");
    let token = admin.enrollment_token(2).await?;
    let chosen = enroll_device(&server, &token).await?;
    let bystander = enroll_device(&server, &token).await?;

    assert_no_task(&server, &chosen, base_id).await?;
    // A version that does not exist answers the same.
    assert_no_task(&server, &chosen, base_id + 1000).await?;

    let tags = admin
        .send(
            Method::PUT,
            &format!("/api/v1/devices/{}/tags", chosen.device_id),
            Some(json!({"tags": {"pick": "yes"}})),
        )
        .await?;
    ensure!(
        tags.status == 200,
        "tagging answered {}: {}",
        tags.status,
        tags.body
    );
    let mut spec = job_spec(base_id, 1, 1, 1, 120_000);
    spec["filters"] = json!({"tags": {"pick": "yes"}});
    let job = admin.create_job(spec).await?;
    let task = poll_task(&chosen).await?;
    ensure!(
        task.model_version_id == base_id,
        "task on {}",
        task.model_version_id
    );

    let (status, whole) = get_model(&server, &chosen, base_id, None).await?;
    ensure!(
        status == 200 && whole.len() as u64 == size,
        "download answered {status}"
    );
    let (status, tail) = get_model(&server, &chosen, base_id, Some(size / 2)).await?;
    ensure!(status == 206, "a resumed download answered {status}");
    ensure!(
        tail[..] == whole[(size / 2) as usize..],
        "the resumed bytes differ"
    );
    assert_no_task(&server, &chosen, other_id).await?;
    assert_no_task(&server, &bystander, base_id).await?;

    train(&chosen, &task, 10).await?;
    let finished = admin.wait_for_job(job, JOB_TIMEOUT).await?;
    ensure!(finished["state"] == "completed", "job ended {finished}");
    assert_no_task(&server, &chosen, base_id).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_downloads_need_a_task_on_sqlite() -> Result<()> {
    model_downloads_need_a_task(Database::Sqlite).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_downloads_need_a_task_on_postgres() -> Result<()> {
    model_downloads_need_a_task(Database::Postgres).await
}

/// A device that declines says why, and the round's participants show it;
/// the round closes as soon as everyone has answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declining_device_says_why() -> Result<()> {
    let server = TestServer::start(Database::Sqlite)?;
    let admin = server.admin();
    let version = admin.upload_model("logreg", logreg_model_bytes(6)).await?;
    let token = admin.enrollment_token(2).await?;
    let a = enroll_device(&server, &token).await?;
    let b = enroll_device(&server, &token).await?;
    let job = admin
        .create_job(job_spec(
            version["id"].as_i64().unwrap_or_default(),
            1,
            1,
            2,
            120_000,
        ))
        .await?;
    let task_a = poll_task(&a).await?;
    let task_b = poll_task(&b).await?;
    let reason = "the model takes inputs of shape [64], the dataset `digits` has [784]";
    a.decline_task(&task_a, reason).await?;
    train(&b, &task_b, 10).await?;
    let finished = admin.wait_for_job(job, JOB_TIMEOUT).await?;
    assert_eq!(finished["state"], "completed", "{finished}");
    let round = admin
        .ok(&format!("/api/v1/rounds/{}", task_a.round_id))
        .await?;
    let declined = round["participants"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["device_id"] == a.device_id)
        .cloned()
        .unwrap_or_default();
    assert_eq!(declined["state"], "dropped", "{round}");
    assert_eq!(
        declined["drop_reason"],
        format!("declined: {reason}"),
        "{round}"
    );
    Ok(())
}

/// An asynchronous job's spec: `buffer` updates per version, `concurrency`
/// devices training at once, updates at most `max_staleness` versions old.
fn async_spec(version_id: i64, rounds: u32, buffer: u32, concurrency: u32) -> Value {
    let mut spec = job_spec(version_id, rounds, 1, buffer, 120_000);
    spec["asynchronous"] = json!({"concurrency": concurrency, "max_staleness": 1});
    spec
}

/// The trainable parameters of a model, in the order devices send them.
type Params = Vec<(String, Vec<f32>)>;

fn params_of(model: &canopy_ir::Model) -> Params {
    model
        .parameters
        .iter()
        .filter(|p| p.trainable)
        .map(|p| {
            let Buffer::F32(values) = &p.data.buffer else {
                panic!("f32 parameter")
            };
            (p.name.clone(), values.clone())
        })
        .collect()
}

/// FedBuff computed independently: the buffer's version is
/// θ + Σ (1+τᵢ)^-½·nᵢ·Δᵢ / Σ nᵢ over the updates it took, each with its
/// staleness τᵢ.
fn fedbuff_step(params: &Params, folded: &[(&Sent, u32)]) -> Params {
    let total: f64 = folded.iter().map(|(s, _)| s.samples as f64).sum();
    let mut offset = 0;
    let mut out = Vec::new();
    for (name, values) in params {
        let stepped = values
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let weighted: f64 = folded
                    .iter()
                    .map(|(s, staleness)| {
                        let weight = (1.0 + f64::from(*staleness)).powf(-0.5);
                        weight * s.samples as f64 * f64::from(s.values[offset + i])
                    })
                    .sum();
                (f64::from(*v) + weighted / total) as f32
            })
            .collect();
        offset += values.len();
        out.push((name.clone(), stepped));
    }
    out
}

fn assert_version(model: &canopy_ir::Model, params: &Params) {
    assert_params(model, &params.iter().cloned().collect());
}

/// Waits until round `id` has succeeded (its buffer became a version).
async fn wait_for_version(admin: &Admin, round_id: i64) -> Result<Value> {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let round = admin.ok(&format!("/api/v1/rounds/{round_id}")).await?;
        if round["state"] == "succeeded" {
            return Ok(round);
        }
        ensure!(
            round["state"] != "failed" && std::time::Instant::now() < deadline,
            "buffer {round_id} did not become a version: {round}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A device's next task, which must be on buffer `number`.
async fn task_in(device: &DeviceClient, number: u32) -> Result<Task> {
    let task = poll_task(device).await?;
    ensure!(
        task.round_number == number,
        "device {} got a task of buffer {}, not {number}",
        device.device_id,
        task.round_number
    );
    Ok(task)
}

/// The id of an asynchronous job's buffer `number`.
async fn buffer_id(admin: &Admin, job: i64, number: u32) -> Result<i64> {
    let rounds = admin
        .ok(&format!("/api/v1/jobs/{job}/rounds?limit=100"))
        .await?;
    let items = rounds["items"].as_array().cloned().unwrap_or_default();
    items
        .iter()
        .find(|round| round["number"] == number)
        .and_then(|round| round["id"].as_i64())
        .ok_or_else(|| anyhow::anyhow!("job {job} has no buffer {number}: {rounds}"))
}

/// FedBuff, step by step with three devices, buffers of two and a
/// maximum staleness of one. Devices take whatever task the server gives
/// them (it keeps all three busy, selecting a device again as soon as it
/// is free and not yet in the open buffer), and upload in a fixed order;
/// each version is checked against FedBuff computed here, with each
/// update's staleness the versions made since its task's buffer opened.
/// A device keeps training across a buffer's close, a too-stale update is
/// refused with its reason and the device freed, and the participants
/// record where each update went.
async fn buffers_match_fedbuff(database: Database) -> Result<()> {
    let server = TestServer::start(database)?;
    let admin = server.admin();
    let version = admin.upload_model("logreg", logreg_model_bytes(11)).await?;
    let token = admin.enrollment_token(3).await?;
    let mut devices = Vec::new();
    for _ in 0..3 {
        devices.push(enroll_device(&server, &token).await?);
    }
    let version_id = version["id"].as_i64().unwrap_or_default();
    let job = admin.create_job(async_spec(version_id, 4, 2, 3)).await?;
    let mut params = params_of(&fetch_model(&admin, "logreg", 1).await?);
    let mut held: Vec<Option<Task>> = vec![None, None, None];
    for device in 0..3 {
        held[device] = Some(task_in(&devices[device], 1).await?);
    }
    // A and B fill buffer 1, then 2; C's task from buffer 1 is then two
    // versions old and refused; C and A fill buffer 3, B (staleness 1)
    // and C buffer 4.
    let (a, b, c) = (0, 1, 2);
    let order = [a, b, a, b, c, c, a, b, c];
    let (mut open, mut folded) = (1u32, Vec::new());
    let mut stale_refused = None;
    for (step, &device) in order.iter().enumerate() {
        let task = match held[device].take() {
            Some(task) => task,
            None => poll_task(&devices[device]).await?,
        };
        let staleness = open - task.round_number;
        if staleness > 1 {
            refuses_stale(&devices[device], &task).await?;
            stale_refused = Some((task.round_id, devices[device].device_id));
            continue;
        }
        let samples = 10 * (device as u64 + 1) + step as u64;
        let sent = train(&devices[device], &task, samples).await?;
        folded.push((sent, staleness, task.round_id, devices[device].device_id));
        if folded.len() < 2 {
            continue;
        }
        let buffer = buffer_id(&admin, job, open).await?;
        let made = wait_for_version(&admin, buffer).await?;
        assert_eq!(made["metrics"]["updates_accepted"], 2, "{made}");
        let weights: Vec<(&Sent, u32)> = folded.iter().map(|(s, t, _, _)| (s, *t)).collect();
        params = fedbuff_step(&params, &weights);
        assert_version(
            &fetch_model(&admin, "logreg", i64::from(open) + 1).await?,
            &params,
        );
        for (_, staleness, round_id, device_id) in &folded {
            let row = participant(&admin, *round_id, *device_id).await?;
            assert_eq!(row["folded_round_id"], buffer, "{row}");
            assert_eq!(row["staleness"], *staleness, "{row}");
        }
        folded.clear();
        open += 1;
    }
    let finished = admin.wait_for_job(job, JOB_TIMEOUT).await?;
    assert_eq!(finished["state"], "completed", "{finished}");
    assert_eq!(open, 5, "four buffers made four versions");
    let (round_id, device_id) = stale_refused.expect("C's update was too stale");
    let row = participant(&admin, round_id, device_id).await?;
    assert_eq!(row["state"], "dropped", "{row}");
    let first = admin
        .ok(&format!(
            "/api/v1/rounds/{}",
            buffer_id(&admin, job, 1).await?
        ))
        .await?;
    assert_eq!(first["max_staleness"], 1, "{first}");
    Ok(())
}

/// A device's update trained on a version too old: refused with 410 and
/// the setting named.
async fn refuses_stale(device: &DeviceClient, task: &Task) -> Result<()> {
    let values = delta(&task.layout, 99);
    let encoded = encode_update(&task.layout, 5, &values)?;
    let refused = device.upload_update(task, Bytes::from(encoded)).await;
    let message = refused
        .as_ref()
        .err()
        .map(|error| format!("{error:#}"))
        .unwrap_or_default();
    assert_eq!(status_of(refused), Some(410), "a stale update is gone");
    assert!(message.contains("max_staleness"), "{message}");
    Ok(())
}

/// A participant's row, from its round's detail.
async fn participant(admin: &Admin, round_id: i64, device_id: i64) -> Result<Value> {
    let round = admin.ok(&format!("/api/v1/rounds/{round_id}")).await?;
    let rows = round["participants"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    rows.into_iter()
        .find(|row| row["device_id"] == device_id)
        .ok_or_else(|| anyhow::anyhow!("device {device_id} is not in round {round_id}: {round}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asynchronous_buffers_match_fedbuff_on_sqlite() -> Result<()> {
    buffers_match_fedbuff(Database::Sqlite).await
}

/// kill -9 of the server while a buffer fills, restart: the update it
/// took survives, the same update sent again is refused, the device that
/// was training on across the close still lands in the next buffer with
/// its staleness, and every version is exactly FedBuff's.
async fn buffers_survive_kill_9(database: Database) -> Result<()> {
    let mut server = TestServer::start(database)?;
    let admin = server.admin();
    let version = admin.upload_model("logreg", logreg_model_bytes(13)).await?;
    let token = admin.enrollment_token(3).await?;
    let mut devices = Vec::new();
    for _ in 0..3 {
        devices.push(enroll_device(&server, &token).await?);
    }
    let version_id = version["id"].as_i64().unwrap_or_default();
    let job = admin.create_job(async_spec(version_id, 2, 2, 3)).await?;
    let mut params = params_of(&fetch_model(&admin, "logreg", 1).await?);
    let mut tasks = Vec::new();
    for device in &devices {
        tasks.push(task_in(device, 1).await?);
    }
    let sent_a1 = train(&devices[0], &tasks[0], 10).await?;

    server.restart()?;
    let admin = server.admin();
    for device in &mut devices {
        device.set_transport(server.transport());
    }
    let buffer1 = admin
        .ok(&format!("/api/v1/rounds/{}", tasks[0].round_id))
        .await?;
    assert_eq!(buffer1["metrics"]["updates_accepted"], 1, "{buffer1}");
    let again = encode_update(&tasks[0].layout, sent_a1.samples, &sent_a1.values)?;
    assert_eq!(
        status_of(
            devices[0]
                .upload_update(&tasks[0], Bytes::from(again))
                .await
        ),
        Some(409),
        "re-sent after restart"
    );
    let sent_b1 = train(&devices[1], &tasks[1], 20).await?;
    if let Err(e) = wait_for_version(&admin, tasks[0].round_id).await {
        eprintln!("{}", server.log());
        return Err(e);
    }
    params = fedbuff_step(&params, &[(&sent_a1, 0), (&sent_b1, 0)]);
    assert_version(&fetch_model(&admin, "logreg", 2).await?, &params);

    let a2 = task_in(&devices[0], 2).await?;
    let sent_c1 = train(&devices[2], &tasks[2], 30).await?;
    let sent_a2 = train(&devices[0], &a2, 10).await?;
    params = fedbuff_step(&params, &[(&sent_c1, 1), (&sent_a2, 0)]);
    let finished = admin.wait_for_job(job, JOB_TIMEOUT).await?;
    assert_eq!(finished["state"], "completed", "{finished}");
    assert_version(&fetch_model(&admin, "logreg", 3).await?, &params);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asynchronous_kill_9_on_sqlite() -> Result<()> {
    buffers_survive_kill_9(Database::Sqlite).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asynchronous_kill_9_on_postgres() -> Result<()> {
    buffers_survive_kill_9(Database::Postgres).await
}
