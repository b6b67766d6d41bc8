//! A failure inside the server is answered without its cause. Database
//! and blob error chains name tables, files and paths: they go to the log,
//! under the request id that the answer names, and the client is told where
//! to look.

use std::process::Command;

use anyhow::{Context, Result, ensure};
use serde_json::Value;

use crate::support::{Database, TestServer, logreg_model_bytes};

/// Status, `x-request-id` and body of an admin GET.
async fn get(server: &TestServer, path: &str) -> Result<(u16, String, Value)> {
    let admin = server.admin();
    let response = admin
        .transport
        .http()
        .get(admin.transport.url(path))
        .bearer_auth(&admin.token)
        .send()
        .await?;
    let status = response.status().as_u16();
    let request_id = response
        .headers()
        .get("x-request-id")
        .and_then(|value| value.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let body = serde_json::from_slice(&response.bytes().await?).unwrap_or(Value::Null);
    Ok((status, request_id, body))
}

/// Checks that a 500 says nothing of its cause, names its request id, and
/// that the server's log line for that request holds `cause`.
fn check_hidden(server: &TestServer, answer: &(u16, String, Value), cause: &str) -> Result<()> {
    let (status, request_id, body) = answer;
    ensure!(*status == 500, "expected a 500, got {status}: {body}");
    ensure!(!request_id.is_empty(), "the answer has no x-request-id");
    assert_eq!(body["error"]["code"], "internal", "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    let data_dir = server.data_dir.path().display().to_string();
    for leak in [
        "sqlite",
        "postgres",
        "database",
        "relation",
        "sqlx",
        "blob",
        "No such file",
        "os error",
        cause,
        &data_dir,
    ] {
        ensure!(
            !message.to_lowercase().contains(&leak.to_lowercase()),
            "the answer shows `{leak}`: {message}"
        );
    }
    ensure!(
        message.contains(&format!("see the server log (request id {request_id})")),
        "the answer does not say where to look: {message}"
    );
    let log = server.log();
    let logged = log
        .lines()
        .find(|line| line.contains(request_id.as_str()) && line.contains("request failed"))
        .with_context(|| format!("no log line for request {request_id}:\n{log}"))?;
    ensure!(
        logged.contains(cause),
        "the log line for request {request_id} lacks `{cause}`: {logged}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_and_blob_failures_are_logged_not_sent() -> Result<()> {
    let server = TestServer::start(Database::Postgres)?;
    let version = server
        .admin()
        .upload_model("logreg", logreg_model_bytes(1))
        .await?;
    let digest = version["digest"].as_str().unwrap_or_default().to_string();

    // The model file goes missing from the blob store.
    let blob = server
        .data_dir
        .path()
        .join("blobs/sha256")
        .join(&digest[..2])
        .join(&digest);
    std::fs::remove_file(&blob).with_context(|| format!("removing {}", blob.display()))?;
    let answer = get(&server, "/api/v1/models/logreg/versions/1/download").await?;
    check_hidden(&server, &answer, "is missing from the blob store")?;

    // A table disappears from under the running server.
    let output = Command::new("psql")
        .args([&server.database_url, "-v", "ON_ERROR_STOP=1", "-q", "-c"])
        .arg("ALTER TABLE jobs RENAME TO jobs_gone")
        .output()
        .context("cannot run psql")?;
    ensure!(
        output.status.success(),
        "psql: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let answer = get(&server, "/api/v1/jobs").await?;
    check_hidden(&server, &answer, r#"relation \"jobs\" does not exist"#)?;
    Ok(())
}
