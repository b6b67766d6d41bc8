//! Fair shares (issue 11, acceptance 2): one device cannot take the upload
//! slots or the poll capacity from the others, and model uploads do not
//! buffer whole files per request. Real server processes over HTTPS.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use bytes::Bytes;
use canopy_protocol::auth;
use canopy_protocol::messages::Task;
use canopy_protocol::update::encode_update;
use canopy_sdk::DeviceClient;
use serde_json::json;
use tokio::sync::mpsc;

use crate::support::{
    Database, TestServer, enroll_device, limits_file, logreg_model_bytes, model_bytes, poll_task,
};

fn now_ms() -> u64 {
    u64::try_from(canopy_server::db::now_ms()).unwrap_or(0)
}

fn update_for(task: &Task) -> Result<Bytes> {
    let values = vec![0.001f32; task.layout.num_elements()];
    Ok(Bytes::from(encode_update(&task.layout, 10, &values)?))
}

/// Feeds the rest of a stalled body; dropping it ends the body.
type BodySender = mpsc::Sender<Result<Bytes, std::io::Error>>;
/// An upload's status, `Retry-After` and how long the answer took.
type Answer = (u16, Option<String>, Duration);

/// Starts a signed upload of `body`. With `stall`, it sends the first byte
/// and then nothing until the returned sender is dropped. The handle
/// resolves to the answer's status, `Retry-After` and how long it took.
fn signed_upload(
    server: &TestServer,
    device: &DeviceClient,
    task: &Task,
    body: &Bytes,
    stall: bool,
) -> (BodySender, tokio::task::JoinHandle<Result<Answer>>) {
    let signed = auth::sign_request_with_digest(
        device.key(),
        device.device_id,
        "PUT",
        &task.upload_path,
        &auth::sha256_hex(body),
        now_ms(),
    );
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(1);
    let first = if stall { body.slice(..1) } else { body.clone() };
    let stream = futures_util::stream::unfold((Some(first), rx), |(first, mut rx)| async move {
        match first {
            Some(first) => Some((Ok(first), (None, rx))),
            None => rx.recv().await.map(|item| (item, (None, rx))),
        }
    });
    let mut request = server
        .transport()
        .http()
        .put(server.transport().url(&task.upload_path))
        .header("content-length", body.len().to_string())
        .body(reqwest::Body::wrap_stream(stream));
    for (name, value) in signed.headers() {
        request = request.header(name, value);
    }
    let started = Instant::now();
    let handle = tokio::spawn(async move {
        let response = request.send().await?;
        let retry_after = response
            .headers()
            .get("retry-after")
            .and_then(|value| value.to_str().ok())
            .map(str::to_string);
        Ok((response.status().as_u16(), retry_after, started.elapsed()))
    });
    (tx, handle)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_device_cannot_hold_the_upload_slots() -> Result<()> {
    let config_dir = tempfile::tempdir()?;
    let config = limits_file(
        config_dir.path(),
        "max_concurrent_uploads = 2\nupload_slot_wait_ms = 1500\nupload_timeout_ms = 8000",
    )?;
    let server = TestServer::start_with(Database::Sqlite, &["--config", &config])?;
    let admin = server.admin();
    let version = admin.upload_model("fair", logreg_model_bytes(5)).await?;
    let token = admin.enrollment_token(3).await?;
    let mut devices = Vec::new();
    for _ in 0..3 {
        devices.push(enroll_device(&server, &token).await?);
    }
    let job = admin
        .create_job(json!({
            "name": "fair-uploads", "model_version_id": version["id"], "rounds": 1,
            "min_devices": 3, "target_devices": 3, "over_selection": 0.0,
            "evaluation": {"fraction": 0.0}, "round_deadline_ms": 120_000, "local_epochs": 1, "batch_size": 8,
            "learning_rate": 0.1, "strategy": {"name": "fedavg"}, "max_round_retries": 0,
        }))
        .await?;
    let mut tasks = Vec::new();
    for device in &devices {
        tasks.push(poll_task(device).await?);
    }
    let (a, b, c) = (&devices[0], &devices[1], &devices[2]);
    let bodies: Vec<Bytes> = tasks.iter().map(update_for).collect::<Result<_>>()?;

    // Device A opens 32 uploads and stalls each after one byte: one holds a
    // slot, the other 31 are refused at once.
    let mut a_senders = Vec::new();
    let mut a_uploads = Vec::new();
    for _ in 0..32 {
        let (tx, handle) = signed_upload(&server, a, &tasks[0], &bodies[0], true);
        a_senders.push(tx);
        a_uploads.push(handle);
    }
    let mut refused = 0;
    let mut a_held = None;
    for mut handle in a_uploads {
        match tokio::time::timeout(Duration::from_millis(2500), &mut handle).await {
            Ok(answer) => {
                let (status, _, elapsed) = answer??;
                // 409 (an upload to this round is in flight) or 429 (the
                // device's requests in flight): refused at once either way.
                ensure!(
                    status == 409 || status == 429,
                    "a second upload from A answered {status}"
                );
                // An answer given before the body is read waits up to 2 s
                // (`api::DRAIN_TIMEOUT`) for the rest of that body, so the
                // connection can be reused; a stalled body costs its own
                // sender those 2 s, nobody else.
                ensure!(
                    elapsed < Duration::from_secs(3),
                    "a refusal took {elapsed:?}"
                );
                refused += 1;
            }
            Err(_) => {
                ensure!(a_held.is_none(), "A holds more than one upload");
                a_held = Some(handle);
            }
        }
    }
    ensure!(
        refused == 31,
        "{refused} of A's 32 uploads were refused, expected 31"
    );
    let a_held = a_held.context("none of A's uploads holds a slot")?;

    // C stalls too: both slots are now taken by stalled uploads.
    let (c_sender, c_held) = signed_upload(&server, c, &tasks[2], &bodies[2], true);
    tokio::time::sleep(Duration::from_millis(300)).await;

    // B waits at most the slot wait, then is told when to come back.
    let (b_sender, b_first) = signed_upload(&server, b, &tasks[1], &bodies[1], false);
    drop(b_sender);
    let (status, retry_after, b_waited) = b_first.await??;
    println!(
        "figures: with both slots held by stalled uploads, B was answered {status} after {b_waited:?}"
    );
    ensure!(
        status == 503 && retry_after.is_some(),
        "B's upload while the slots were held answered {status}, Retry-After {retry_after:?}"
    );
    ensure!(
        b_waited < Duration::from_millis(1500 + 1000),
        "B waited {b_waited:?}; the slot wait is 1.5 s"
    );

    // The stalled uploads lose their slots at the upload timeout.
    for (held, name) in [(a_held, "A"), (c_held, "C")] {
        let (status, _, elapsed) = tokio::time::timeout(Duration::from_secs(10), held)
            .await
            .with_context(|| format!("{name}'s stalled upload was never answered"))???;
        ensure!(status == 408, "{name}'s stalled upload answered {status}");
        ensure!(
            elapsed < Duration::from_secs(8 + 3),
            "{name}'s stalled upload held its slot for {elapsed:?}"
        );
    }
    drop((a_senders, c_sender));

    // Every device then uploads normally and the round completes.
    for (device, (task, body)) in devices.iter().zip(tasks.iter().zip(&bodies)) {
        device.upload_update(task, body.clone()).await?;
    }
    let finished = admin.wait_for_job(job, Duration::from_secs(60)).await?;
    ensure!(finished["state"] == "completed", "job: {finished}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_model_uploads_do_not_buffer_each_file() -> Result<()> {
    const UPLOADS: usize = 4;
    let server = TestServer::start(Database::Sqlite)?;
    // About 64 MB: an MLP with a 20,000-unit hidden layer.
    let model = Bytes::from(model_bytes(
        canopy_engine::zoo::Architecture::Mlp {
            inputs: 784,
            hidden: 20_000,
            classes: 10,
        },
        9,
    ));
    let model_mib = model.len() as u64 >> 20;
    let before_kib = server.memory_kib("VmHWM")?;
    let mut uploads = Vec::new();
    for n in 0..UPLOADS {
        let admin = server.admin();
        let model = model.clone();
        uploads.push(tokio::spawn(async move {
            admin
                .upload_model(&format!("big-{n}"), model.to_vec())
                .await
        }));
    }
    for upload in uploads {
        let version = upload.await??;
        ensure!(version["size_bytes"] == model.len(), "upload: {version}");
    }
    let peak_kib = server.memory_kib("VmHWM")?;
    let growth_mib = peak_kib.saturating_sub(before_kib) >> 10;
    println!(
        "figures: {UPLOADS} concurrent uploads of a {model_mib} MiB model raised the server's peak RSS \
         by {growth_mib} MiB ({} MiB before, {} MiB peak)",
        before_kib >> 10,
        peak_kib >> 10
    );
    ensure!(
        growth_mib < 3 * model_mib,
        "peak RSS grew by {growth_mib} MiB for {UPLOADS} uploads of {model_mib} MiB; \
         one verification at a time needs about twice one model"
    );
    // Nothing is left in the staging directory.
    let staging = server.data_dir.path().join("staging");
    let left = std::fs::read_dir(&staging)
        .map(|dir| dir.count())
        .unwrap_or(0);
    ensure!(
        left == 0,
        "{left} staged files were left in {}",
        staging.display()
    );
    Ok(())
}
