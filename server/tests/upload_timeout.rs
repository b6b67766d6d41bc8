//! A stalled device upload is answered 408, as `limits.upload_timeout_ms`
//! documents, whichever timer ends it: the upload timeout, or the
//! connection's idle timeout, which a body that stops arriving also meets
//! (issue 36: with both at their default 60 s, the idle timer fired first
//! and the upload was answered 400, "cut off"). Real server processes over
//! HTTPS.

use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use bytes::Bytes;
use canopy_protocol::auth;
use canopy_protocol::update::encode_update;
use futures_util::StreamExt;
use serde_json::json;

use crate::support::{
    Database, TestServer, enroll_device, limits_file, logreg_model_bytes, poll_task,
};

/// Uploads the first byte of a valid, signed update and then nothing;
/// returns the answer's status, body and when it came.
async fn stalled_upload(limits: &str) -> Result<(u16, String, Duration)> {
    let config_dir = tempfile::tempdir()?;
    let config = limits_file(config_dir.path(), limits)?;
    let server = TestServer::start_with(Database::Sqlite, &["--config", &config])?;
    let admin = server.admin();
    let version = admin.upload_model("stall", logreg_model_bytes(5)).await?;
    let token = admin.enrollment_token(1).await?;
    let device = enroll_device(&server, &token).await?;
    admin
        .create_job(json!({
            "name": "stall", "model_version_id": version["id"], "rounds": 1,
            "min_devices": 1, "target_devices": 1, "over_selection": 0.0,
            "evaluation": {"fraction": 0.0}, "round_deadline_ms": 120_000, "local_epochs": 1,
            "batch_size": 8, "learning_rate": 0.1, "max_round_retries": 0,
        }))
        .await?;
    let task = poll_task(&device).await?;
    let values = vec![0.001f32; task.layout.num_elements()];
    let body = Bytes::from(encode_update(&task.layout, 10, &values)?);
    let now = u64::try_from(canopy_server::db::now_ms())?;
    let signed = auth::sign_request_with_digest(
        device.key(),
        device.device_id,
        "PUT",
        &task.upload_path,
        &auth::sha256_hex(&body),
        now,
    );
    // One byte, then a body that never ends (the stream stays pending).
    let first = body.slice(..1);
    let stream = futures_util::stream::once(async move { Ok::<_, std::io::Error>(first) })
        .chain(futures_util::stream::pending());
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
    let response = tokio::time::timeout(Duration::from_secs(30), request.send()).await??;
    let status = response.status().as_u16();
    let text = response.text().await.unwrap_or_default();
    Ok((status, text, started.elapsed()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_upload_is_408_when_the_idle_timer_ends_it_too() -> Result<()> {
    // The defaults' relation, scaled down: both timers at the same length.
    let (status, text, took) =
        stalled_upload("upload_timeout_ms = 3000\nidle_timeout_ms = 3000\nlong_poll_max_ms = 1000")
            .await?;
    println!("figures: equal timers: {status} after {took:?}: {text}");
    ensure!(status == 408, "answered {status} after {took:?}: {text}");
    ensure!(
        text.contains("limits."),
        "the answer names no limit: {text}"
    );
    ensure!(took < Duration::from_secs(3 + 3), "answered after {took:?}");

    // An idle timeout shorter than the upload timeout ends the stall first.
    let (status, text, took) = stalled_upload(
        "upload_timeout_ms = 20000\nidle_timeout_ms = 2500\nlong_poll_max_ms = 1000",
    )
    .await?;
    println!("figures: idle timer first: {status} after {took:?}: {text}");
    ensure!(status == 408, "answered {status} after {took:?}: {text}");
    ensure!(
        text.contains("limits.idle_timeout_ms"),
        "the answer does not name the idle timeout: {text}"
    );
    ensure!(took < Duration::from_secs(2 + 4), "answered after {took:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_upload_is_408_at_the_upload_timeout() -> Result<()> {
    let (status, text, took) = stalled_upload(
        "upload_timeout_ms = 2000\nidle_timeout_ms = 20000\nlong_poll_max_ms = 1000",
    )
    .await?;
    println!("figures: upload timer first: {status} after {took:?}: {text}");
    ensure!(status == 408, "answered {status} after {took:?}: {text}");
    ensure!(
        text.contains("limits.upload_timeout_ms"),
        "the answer does not name the upload timeout: {text}"
    );
    ensure!(took < Duration::from_secs(2 + 3), "answered after {took:?}");
    Ok(())
}
