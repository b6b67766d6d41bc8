//! Operating the server: shutdown, request ids, rate limits, health,
//! metrics, the token CLI, configuration and pagination.

use std::process::Command;
use std::time::Duration;

use anyhow::Result;
use bytes::Bytes;
use canopy_protocol::auth;
use canopy_protocol::update::encode_update;
use serde_json::json;

use crate::support;
use crate::support::{Database, TestServer, enroll_device, logreg_model_bytes};

fn server_bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_canopy-server"))
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// SIGTERM while an upload is half sent: the upload completes and is
/// accepted, then the process exits cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_in_flight_uploads() -> Result<()> {
    let mut server = TestServer::start(Database::Sqlite)?;
    let admin = server.admin();
    let version = admin.upload_model("logreg", logreg_model_bytes(1)).await?;
    let token = admin.enrollment_token(1).await?;
    let device = enroll_device(&server, &token).await?;
    let spec = json!({
        "name": "shutdown", "model_version_id": version["id"], "rounds": 1, "min_devices": 1,
        "target_devices": 1, "over_selection": 0.0, "evaluation": {"fraction": 0.0}, "round_deadline_ms": 60_000,
        "local_epochs": 1, "batch_size": 8, "learning_rate": 0.1,
    });
    admin.create_job(spec).await?;
    let task = loop {
        if let Some(task) = device.next_task(2_000).await? {
            break task;
        }
    };
    let values = vec![0.001f32; task.layout.num_elements()];
    let encoded = Bytes::from(encode_update(&task.layout, 12, &values)?);
    let signed = auth::sign_request(
        device.key(),
        device.device_id,
        "PUT",
        &task.upload_path,
        &encoded,
        now_ms(),
    );
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(4);
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    });
    let mut request = server
        .transport()
        .http()
        .put(server.transport().url(&task.upload_path))
        .header("content-length", encoded.len().to_string())
        .body(reqwest::Body::wrap_stream(stream));
    for (name, value) in signed.headers() {
        request = request.header(name, value);
    }
    let in_flight = tokio::spawn(request.send());
    let half = encoded.len() / 2;
    tx.send(Ok(encoded.slice(..half))).await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    server.signal_term()?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    tx.send(Ok(encoded.slice(half..))).await?;
    drop(tx);
    let response = in_flight.await??;
    assert_eq!(response.status(), 201, "the in-flight upload is accepted");
    let status =
        tokio::task::spawn_blocking(move || server.wait_exit(Duration::from_secs(30))).await??;
    assert!(status.success(), "clean exit after SIGTERM: {status}");
    Ok(())
}

#[tokio::test]
async fn responses_carry_request_ids_and_errors_are_json() -> Result<()> {
    let server = TestServer::start(Database::Sqlite)?;
    let http = server.transport().http().clone();
    let response = http.get(server.transport().url("/healthz")).send().await?;
    assert_eq!(response.status(), 200);
    let id = response
        .headers()
        .get("x-request-id")
        .map(|v| v.to_str().unwrap_or_default().to_string());
    assert!(
        id.is_some_and(|id| id.len() >= 32),
        "a generated request id"
    );
    let response = http
        .get(server.transport().url("/no/such/route"))
        .header("x-request-id", "client-chosen-id")
        .send()
        .await?;
    assert_eq!(response.status(), 404);
    assert_eq!(response.headers()["x-request-id"], "client-chosen-id");
    let body: serde_json::Value = response.json().await?;
    assert_eq!(body["error"]["code"], "not_found");
    assert_eq!(
        http.get(server.transport().url("/readyz"))
            .send()
            .await?
            .status(),
        200
    );
    let reply = server
        .admin()
        .post_bytes("/api/v1/jobs", b"{not json".to_vec())
        .await?;
    assert_eq!(reply.status, 415, "wrong content type: {}", reply.body);
    assert!(reply.body["error"]["message"].is_string());
    let reply = server
        .admin()
        .post("/api/v1/jobs", json!({"name": "x"}))
        .await?;
    assert_eq!(reply.status, 422, "{}", reply.body);
    let reply = server.admin().get("/api/v1/jobs/not-a-number").await?;
    assert_eq!(reply.status, 400, "{}", reply.body);
    let metrics = http
        .get(server.transport().url("/metrics"))
        .bearer_auth(&server.admin_token)
        .send()
        .await?
        .text()
        .await?;
    for family in [
        "canopy_online_devices",
        "canopy_http_request_duration_seconds_bucket",
        "canopy_update_bytes_received_total",
    ] {
        assert!(
            metrics.contains(family),
            "{family} missing from /metrics:\n{metrics}"
        );
    }
    Ok(())
}

#[tokio::test]
async fn credential_routes_are_rate_limited() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("server.toml");
    std::fs::write(&config, "[limits]\nsensitive_requests_per_minute = 3\n")?;
    let server = TestServer::start_with(
        Database::Sqlite,
        &["--config", config.to_str().unwrap_or_default()],
    )?;
    let admin = server.admin();
    let body = json!({"expires_in": "1h", "max_uses": 1});
    for _ in 0..3 {
        assert_eq!(
            admin
                .post("/api/v1/enrollment-tokens", body.clone())
                .await?
                .status,
            201
        );
    }
    let limited = admin.post("/api/v1/enrollment-tokens", body).await?;
    assert_eq!(limited.status, 429, "{}", limited.body);
    assert_eq!(limited.body["error"]["code"], "rate_limited");
    assert_eq!(
        admin.get("/api/v1/enrollment-tokens").await?.status,
        200,
        "reads are not limited"
    );
    Ok(())
}

#[tokio::test]
async fn lists_page_with_a_capped_cursor() -> Result<()> {
    let server = TestServer::start(Database::Sqlite)?;
    let admin = server.admin();
    for _ in 0..5 {
        admin.enrollment_token(1).await?;
    }
    let mut seen = Vec::new();
    let mut path = "/api/v1/enrollment-tokens?limit=2".to_string();
    loop {
        let page = admin.ok(&path).await?;
        let items = page["items"].as_array().cloned().unwrap_or_default();
        assert!(items.len() <= 2);
        seen.extend(
            items
                .iter()
                .map(|item| item["id"].as_i64().unwrap_or_default()),
        );
        match page["next_cursor"].as_str() {
            Some(cursor) => path = format!("/api/v1/enrollment-tokens?limit=2&cursor={cursor}"),
            None => break,
        }
    }
    assert_eq!(seen, vec![1, 2, 3, 4, 5]);
    for bad in ["limit=0", "limit=100000", "cursor=abc", "cursor=-4"] {
        let reply = admin
            .get(&format!("/api/v1/enrollment-tokens?{bad}"))
            .await?;
        assert_eq!(reply.status, 400, "{bad}: {}", reply.body);
    }
    Ok(())
}

#[tokio::test]
async fn token_cli_issues_and_revokes_tokens() -> Result<()> {
    let server = TestServer::start(Database::Sqlite)?;
    let output = server_bin()
        .args([
            "token",
            "create",
            "--role",
            "viewer",
            "--expires",
            "30d",
            "--label",
            "ci",
        ])
        .env("CANOPY_DATABASE_URL", &server.database_url)
        .output()?;
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let stdout = String::from_utf8(output.stdout)?;
    let secret = stdout
        .lines()
        .find_map(|line| line.strip_prefix("viewer token: "))
        .unwrap_or_default()
        .to_string();
    let id = stdout
        .lines()
        .find_map(|line| line.strip_prefix("token id: "))
        .unwrap_or_default()
        .to_string();
    let viewer = server.admin_as(&secret);
    assert_eq!(viewer.get("/api/v1/devices").await?.status, 200);
    assert_eq!(
        viewer
            .post(
                "/api/v1/enrollment-tokens",
                json!({"expires_in": "1h", "max_uses": 1})
            )
            .await?
            .status,
        403
    );
    let listed = server_bin()
        .args(["token", "list", "--database-url", &server.database_url])
        .output()?;
    assert!(
        String::from_utf8_lossy(&listed.stdout).contains("viewer"),
        "token list shows the token"
    );
    let revoked = server_bin()
        .args([
            "token",
            "revoke",
            &id,
            "--database-url",
            &server.database_url,
        ])
        .output()?;
    assert!(
        revoked.status.success(),
        "{}",
        String::from_utf8_lossy(&revoked.stderr)
    );
    assert_eq!(
        viewer.get("/api/v1/devices").await?.status,
        401,
        "a revoked token stops working"
    );
    let missing = server_bin()
        .args([
            "token",
            "revoke",
            "999",
            "--database-url",
            &server.database_url,
        ])
        .output()?;
    assert!(!missing.status.success());
    assert!(String::from_utf8_lossy(&missing.stderr).contains("API token 999 does not exist"));
    Ok(())
}

#[test]
fn migrate_and_configuration_errors_are_clear() -> Result<()> {
    let dir = support::private_tempdir()?;
    let output = server_bin()
        .args(["migrate", "--create"])
        .env("CANOPY_DATA_DIR", dir.path())
        .output()?;
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        dir.path().join("canopy.db").exists(),
        "SQLite in the data directory by default"
    );

    let output = server_bin()
        .args(["serve", "--listen", "0.0.0.0:0"])
        .env("CANOPY_DATA_DIR", dir.path())
        .output()?;
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("error: refusing plain HTTP") && stderr.contains("--insecure-http"),
        "{stderr}"
    );

    let output = server_bin()
        .args(["migrate", "--database-url", "mysql://nope"])
        .output()?;
    assert!(String::from_utf8_lossy(&output.stderr).contains("is not supported"));
    let output = server_bin()
        .args([
            "migrate",
            "--database-url",
            "postgres://nobody@127.0.0.1:1/none",
        ])
        .output()?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("cannot connect to the database") && stderr.contains("hint:"),
        "{stderr}"
    );
    Ok(())
}

#[tokio::test]
async fn revoked_credentials_cannot_enroll_or_authenticate() -> Result<()> {
    let server = TestServer::start(Database::Sqlite)?;
    let admin = server.admin();
    let created = admin
        .post(
            "/api/v1/enrollment-tokens",
            json!({"expires_in": "1h", "max_uses": 5}),
        )
        .await?;
    let secret = created.body["secret"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let device = enroll_device(&server, &secret).await?;
    let id = created.body["id"].as_i64().unwrap_or_default();
    assert_eq!(
        admin
            .post(&format!("/api/v1/enrollment-tokens/{id}/revoke"), json!({}))
            .await?
            .status,
        204
    );
    let refused = enroll_device(&server, &secret)
        .await
        .err()
        .map(|e| format!("{e:#}"))
        .unwrap_or_default();
    assert!(
        refused.contains("401") && refused.contains("revoked"),
        "{refused}"
    );
    assert!(
        device.next_task(10).await.is_ok(),
        "enrolled devices stay enrolled"
    );
    let revoked = admin
        .post(
            &format!("/api/v1/devices/{}/revoke", device.device_id),
            json!({}),
        )
        .await?;
    assert_eq!(revoked.body["revoked"], true);
    let status = device.next_task(10).await.err().and_then(|e| e.status());
    assert_eq!(status, Some(401), "a revoked device cannot authenticate");
    Ok(())
}

/// `--tls-cert`/`--tls-key` serve the operator's certificate; a client
/// pinning another certificate refuses the connection.
#[tokio::test]
async fn serves_certificate_files_and_pinning_is_enforced() -> Result<()> {
    let first = TestServer::start(Database::Sqlite)?;
    let cert = first.data_dir.path().join("tls/self-signed-cert.pem");
    let key = first.data_dir.path().join("tls/self-signed-key.pem");
    let dir = support::private_tempdir()?;
    let mut child = server_bin()
        .args(["serve", "--listen", "127.0.0.1:0", "--tls-cert"])
        .arg(&cert)
        .arg("--tls-key")
        .arg(&key)
        .env("CANOPY_DATA_DIR", dir.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()?;
    let stdout = child.stdout.take().expect("stdout");
    let base = tokio::task::spawn_blocking(move || {
        use std::io::BufRead;
        std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .find_map(|line| line.strip_prefix("listening on ").map(str::to_string))
    })
    .await?
    .unwrap_or_default();
    assert!(base.starts_with("https://"), "{base}");
    let pinned = canopy_sdk::Transport::new(&base, &first.trust())?;
    let health = pinned.http().get(pinned.url("/healthz")).send().await;
    let wrong =
        canopy_sdk::Transport::new(&base, &canopy_sdk::Trust::PinnedSha256("00".repeat(32)))?;
    let refused = wrong.http().get(wrong.url("/healthz")).send().await;
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(health?.status(), 200);
    assert!(
        refused.is_err(),
        "a client pinning another certificate must not connect"
    );
    Ok(())
}

/// The front page and the dashboard are served from this origin with a
/// strict content security policy, and the API routes its script reads
/// exist.
#[tokio::test]
async fn dashboard_is_served_locked_down() -> Result<()> {
    let server = TestServer::start(Database::Sqlite)?;
    let http = server.transport().http().clone();
    // The front page too: links only, under the same policy.
    let front = http.get(server.transport().url("/")).send().await?;
    assert_eq!(front.status(), 200);
    assert_eq!(
        front.headers()["content-security-policy"],
        "default-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
    );
    assert!(front.text().await?.contains("href=\"/dashboard\""));
    let page = http
        .get(server.transport().url("/dashboard"))
        .send()
        .await?;
    assert_eq!(page.status(), 200);
    let csp = page.headers()["content-security-policy"]
        .to_str()?
        .to_string();
    assert!(csp.contains("default-src 'self'"), "{csp}");
    assert!(
        page.text()
            .await?
            .contains("<script type=\"module\" src=\"/dashboard.js\">")
    );
    let mut script = String::new();
    for path in ["/dashboard.js", "/dashboard-charts.js"] {
        let text = http
            .get(server.transport().url(path))
            .send()
            .await?
            .text()
            .await?;
        assert!(
            !text.contains("innerHTML"),
            "{path}: API values must never become HTML"
        );
        script.push_str(&text);
    }
    let admin = server.admin();
    for path in ["/api/v1/jobs?limit=100", "/api/v1/devices?limit=500"] {
        assert!(script.contains(path.split('?').next().unwrap_or_default()));
        assert_eq!(admin.get(path).await?.status, 200, "{path}");
    }
    assert_eq!(
        http.get(server.transport().url("/dashboard.css"))
            .send()
            .await?
            .status(),
        200
    );
    Ok(())
}
