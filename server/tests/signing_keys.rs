//! Model-signing key rotation end to end: real server processes, the real
//! `canopy-server signing-key rotate` binary against the same database,
//! and a device that follows the endorsement, keeps accepting the old key
//! inside its window, refuses it after, and refuses a signer that no
//! endorsement chain leads to.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, anyhow, bail, ensure};
use axum::Router;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use canopy_protocol::messages::Task;
use canopy_protocol::model_sig::{
    HEADER_MODEL_DELEGATION, HEADER_MODEL_DIGEST, HEADER_MODEL_KEY, HEADER_MODEL_SIGNATURE,
    ServerKey, SigningKeys,
};
use canopy_sdk::{DeviceClient, SdkError, Transport, Trust};
use serde_json::{Value, json};

use crate::support;
use crate::support::{Database, TestServer, enroll_device, logreg_model_bytes, poll_task};

/// The old key's window in the test: long enough to download through both
/// processes after the rotation, short enough to wait out.
const OVERLAP_MS: u64 = 5_000;
const RELOAD_WAIT: Duration = Duration::from_secs(10);

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn config(dir: &tempfile::TempDir, name: &str, reload_ms: u64) -> Result<String> {
    let path = dir.path().join(name);
    std::fs::write(
        &path,
        format!("[limits]\nsigning_key_reload_ms = {reload_ms}\n"),
    )?;
    Ok(path.to_str().context("utf-8 path")?.to_string())
}

fn signing_key_command(server: &TestServer, args: &[&str]) -> Result<String> {
    server.signing_key(args)
}

fn field<'a>(output: &'a str, prefix: &str) -> Result<&'a str> {
    output
        .lines()
        .find_map(|line| line.strip_prefix(prefix))
        .ok_or_else(|| anyhow!("no `{prefix}` line in:\n{output}"))
}

/// The signer an admin download through `server` names.
async fn signer_of(server: &TestServer, version: i64) -> Result<String> {
    let admin = server.admin();
    let response = admin
        .transport
        .http()
        .get(admin.transport.url(&format!(
            "/api/v1/models/logreg/versions/{version}/download"
        )))
        .bearer_auth(&admin.token)
        .send()
        .await?;
    ensure!(
        response.status() == 200,
        "download answered {}",
        response.status()
    );
    Ok(response
        .headers()
        .get(HEADER_MODEL_KEY)
        .and_then(|value| value.to_str().ok())
        .ok_or_else(|| anyhow!("no {HEADER_MODEL_KEY} header"))?
        .to_string())
}

/// Waits until `server` signs with `key` (it reloads the ring on its own).
async fn wait_until_signing_with(server: &TestServer, version: i64, key: &str) -> Result<()> {
    let deadline = Instant::now() + RELOAD_WAIT;
    while signer_of(server, version).await? != key {
        if Instant::now() > deadline {
            bail!("the server did not pick up key {key} within {RELOAD_WAIT:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

fn verification_reason(error: &SdkError) -> Result<&str> {
    match error {
        SdkError::ModelVerification { reason, .. } => Ok(reason),
        other => bail!("expected a verification failure, got: {other}"),
    }
}

async fn key_rotation_end_to_end(database: Database) -> Result<()> {
    let dir = tempfile::tempdir()?;
    // The stale process loads the ring at start and not again during the
    // test: it plays a process that has not reloaded yet.
    let stale_config = config(&dir, "stale.toml", 600_000)?;
    let fresh_config = config(&dir, "fresh.toml", 100)?;
    let stale = TestServer::start_with(database, &["--config", &stale_config])?;
    let fresh = stale.second_process_with(&["--config", &fresh_config])?;
    let admin = fresh.admin();
    let version = admin.upload_model("logreg", logreg_model_bytes(3)).await?;
    let version_number = version["version"].as_i64().context("version")?;
    let token = admin.enrollment_token(1).await?;
    let device = enroll_device(&fresh, &token).await?;
    let k1 = hex::encode(device.trusted_keys().current());
    admin
        .create_job(json!({
            "name": "rotation", "model_version_id": version["id"], "rounds": 1,
            "min_devices": 1, "target_devices": 1, "over_selection": 0.0,
            "evaluation": {"fraction": 0.0}, "round_deadline_ms": 120_000, "local_epochs": 1, "batch_size": 16,
            "learning_rate": 0.1,
        }))
        .await?;
    let task = poll_task(&device).await?;
    device.download_model(&task).await?;
    ensure!(device.trusted_keys().previous().is_none());

    let rotated =
        signing_key_command(&fresh, &["rotate", "--overlap", &format!("{OVERLAP_MS}ms")])?;
    let k2 = field(&rotated, "signing key: ")?.to_string();
    ensure!(field(&rotated, "previous key: ")? == k1, "{rotated}");
    let valid_until_ms: u64 = field(&rotated, "previous key valid until: ")?
        .rsplit_once('(')
        .and_then(|(_, ms)| ms.strip_suffix(" ms)"))
        .context("the window's end in ms")?
        .parse()?;
    ensure!(k2 != k1 && k2.len() == 64, "{rotated}");

    // The running process picks the new key up without a restart; the
    // device's next download is signed by K2, and it follows K1's
    // endorsement.
    wait_until_signing_with(&fresh, version_number, &k2).await?;
    device.download_model(&task).await?;
    let trusted = device.trusted_keys();
    ensure!(
        hex::encode(trusted.current()) == k2,
        "the device still trusts {k1}"
    );
    let previous = trusted.previous().context("K1 kept for its window")?;
    ensure!(hex::encode(previous.key) == k1);
    ensure!(previous.valid_until_ms == valid_until_ms);
    let chain = device.signing_keys().await?;
    ensure!(chain.current_key == k2 && chain.endorsements.len() == 1);

    // A process that has not reloaded still signs with K1: accepted inside
    // the window by a device that already moved on.
    ensure!(signer_of(&stale, version_number).await? == k1);
    let mut through_stale = device.clone();
    through_stale.set_transport(stale.transport());
    ensure!(
        now_ms() < valid_until_ms,
        "the test was too slow for its window"
    );
    through_stale.download_model(&task).await?;

    // After the window, K1's signature is refused.
    let wait = valid_until_ms.saturating_sub(now_ms()) + 50;
    tokio::time::sleep(Duration::from_millis(wait)).await;
    let error = through_stale
        .download_model(&task)
        .await
        .expect_err("K1 after its window");
    let reason = verification_reason(&error)?;
    ensure!(
        reason.contains(&k1) && reason.contains("replaced"),
        "{reason}"
    );
    ensure!(hex::encode(device.trusted_keys().current()) == k2);

    // The fresh process erases K1's secret once the window has ended;
    // the public key and endorsement stay.
    let deadline = Instant::now() + RELOAD_WAIT;
    loop {
        let listed = signing_key_command(&fresh, &["list"])?;
        let first = listed.lines().next().unwrap_or_default().to_string();
        let second = listed.lines().nth(1).unwrap_or_default().to_string();
        ensure!(first.contains(&k1) && second.contains(&k2), "{listed}");
        ensure!(
            second.contains("in use") && second.contains("secret kept"),
            "{listed}"
        );
        if first.contains("secret erased") {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "K1's secret was not erased:\n{listed}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let chain = device.signing_keys().await?;
    ensure!(chain.endorsements.len() == 1 && chain.endorsements[0].previous_key == k1);

    forged_signer_is_refused(&device, &task, chain.clone()).await?;
    forged_delegations_are_refused(&device, &task, chain).await
}

/// A server (a test-only HTTP server on a real socket) that signs the
/// model with keys of its own and hands the device delegations it made
/// itself, as an edge would hand the cloud's: every one is refused, by
/// name, and the device's trust stays where it was.
async fn forged_delegations_are_refused(
    device: &DeviceClient,
    task: &Task,
    real_chain: SigningKeys,
) -> Result<()> {
    let model = logreg_model_bytes(3);
    let digest = task.model_digest.clone();
    let forger = ServerKey::generate();
    let accomplice = ServerKey::generate();
    let delegation = |by: &ServerKey, to: &ServerKey| {
        serde_json::to_string(&by.delegate(&to.public_key(), u64::MAX)).unwrap_or_default()
    };
    // (the model's signer, the delegation header, what the refusal says);
    // a delegation by a trusted key that names another signer, or has
    // ended, is refused too (`model_sig`'s unit tests: only the real
    // server's key could make one here).
    let cases = [
        (
            &forger,
            delegation(&forger, &forger),
            "not trusted".to_string(),
        ),
        (
            &accomplice,
            delegation(&forger, &accomplice),
            "not trusted".to_string(),
        ),
        (
            &forger,
            "{\"signer_key\": 1}".to_string(),
            "header is malformed".to_string(),
        ),
        (&forger, "x".repeat(2_000), "over the limit".to_string()),
    ];
    let headers = std::sync::Arc::new(std::sync::Mutex::new(Vec::<(String, String)>::new()));
    let served_headers = headers.clone();
    let chain_json: Value = serde_json::to_value(&real_chain)?;
    let app = Router::new()
        .route(
            "/device/v1/models/{id}",
            get(move || {
                let model = model.clone();
                let mut response = model.into_response();
                let listed = served_headers.lock().map(|h| h.clone()).unwrap_or_default();
                for (name, value) in listed {
                    if let (Ok(name), Ok(value)) = (
                        header::HeaderName::try_from(name.as_str()),
                        header::HeaderValue::try_from(value.as_str()),
                    ) {
                        response.headers_mut().insert(name, value);
                    }
                }
                async move { response }
            }),
        )
        .route(
            "/device/v1/signing-keys",
            get(move || {
                let body = chain_json.clone();
                async move { axum::Json(body) }
            }),
        );
    let (through_forger, served) = serve_forger(device, app).await?;
    let trusted_before = device.trusted_keys();
    for (signer, header_value, refusal) in cases {
        if let Ok(mut slot) = headers.lock() {
            *slot = vec![
                (HEADER_MODEL_DIGEST.to_string(), digest.clone()),
                (
                    HEADER_MODEL_SIGNATURE.to_string(),
                    signer.sign_model(&digest),
                ),
                (HEADER_MODEL_KEY.to_string(), signer.public_key_hex()),
                (HEADER_MODEL_DELEGATION.to_string(), header_value.clone()),
            ];
        }
        let error = through_forger
            .download_model(task)
            .await
            .expect_err("a forged delegation");
        let reason = verification_reason(&error)?;
        ensure!(reason.contains(&refusal), "wanted {refusal:?} in: {reason}");
    }
    ensure!(device.trusted_keys() == trusted_before, "the trust moved");
    served.abort();
    Ok(())
}

/// Serves `app` on a real socket; `device` as a client of it instead of
/// its server, and the server's task.
async fn serve_forger(
    device: &DeviceClient,
    app: Router,
) -> Result<(DeviceClient, tokio::task::JoinHandle<std::io::Result<()>>)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    let served = tokio::spawn(async move { axum::serve(listener, app).await });
    let mut through_forger = device.clone();
    through_forger.set_transport(Transport::new(
        &base,
        &Trust::PinnedSha256("ab".repeat(32)),
    )?);
    Ok((through_forger, served))
}

/// A server (a test-only HTTP server on a real socket) that signs the model
/// with a key of its own and offers the real chain plus a link to its key
/// that it endorsed itself.
async fn forged_signer_is_refused(
    device: &DeviceClient,
    task: &Task,
    real_chain: SigningKeys,
) -> Result<()> {
    let model = logreg_model_bytes(3);
    let forger = ServerKey::generate();
    let mut forged_link = forger.endorse(&forger.public_key(), u64::MAX);
    forged_link.previous_key = real_chain.current_key.clone();
    forged_link.next_key = forger.public_key_hex();
    let mut chain = real_chain.clone();
    chain.endorsements.push(forged_link);
    chain.current_key = forger.public_key_hex();
    let digest = task.model_digest.clone();
    let headers = [
        (HEADER_MODEL_DIGEST, digest.clone()),
        (HEADER_MODEL_SIGNATURE, forger.sign_model(&digest)),
        (HEADER_MODEL_KEY, forger.public_key_hex()),
        (
            header::CONTENT_TYPE.as_str(),
            "application/octet-stream".to_string(),
        ),
    ];
    let chain_json: Value = serde_json::to_value(&chain)?;
    let unendorsed_json: Value = serde_json::to_value(&real_chain)?;
    let offer_forged_link = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let offer = offer_forged_link.clone();
    let app = Router::new()
        .route(
            "/device/v1/models/{id}",
            get(move || {
                let (model, headers) = (model.clone(), headers.clone());
                async move { (headers, model).into_response() }
            }),
        )
        .route(
            "/device/v1/signing-keys",
            get(move || {
                let body = if offer.load(std::sync::atomic::Ordering::SeqCst) {
                    chain_json.clone()
                } else {
                    unendorsed_json.clone()
                };
                async move { axum::Json(body) }
            }),
        );
    let (through_forger, served) = serve_forger(device, app).await?;
    let trusted_before = device.trusted_keys();

    let error = through_forger
        .download_model(task)
        .await
        .expect_err("a self-endorsed key");
    let reason = verification_reason(&error)?;
    ensure!(
        reason.contains(&forger.public_key_hex()) && reason.contains("invalid"),
        "{reason}"
    );
    offer_forged_link.store(false, std::sync::atomic::Ordering::SeqCst);
    let error = through_forger
        .download_model(task)
        .await
        .expect_err("a key no chain leads to");
    let reason = verification_reason(&error)?;
    ensure!(
        reason.contains(&forger.public_key_hex()) && reason.contains("not trusted"),
        "{reason}"
    );
    ensure!(device.trusted_keys() == trusted_before, "the trust moved");
    served.abort();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_key_is_followed_and_the_old_one_expires_sqlite() -> Result<()> {
    key_rotation_end_to_end(Database::Sqlite).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_key_is_followed_and_the_old_one_expires_postgres() -> Result<()> {
    key_rotation_end_to_end(Database::Postgres).await
}

/// A database from before the ring (its key in the `model_signing_key`
/// setting, no ring rows): on start, that key becomes the ring's first
/// key, so devices enrolled under it keep verifying, and the setting, a
/// second copy of the secret, is deleted.
async fn the_pre_ring_key_becomes_the_first_key_of_the_ring(database: Database) -> Result<()> {
    let mut server = TestServer::start(database)?;
    server.kill9();
    let legacy = ServerKey::generate();
    sqlx::any::install_default_drivers();
    let pool = sqlx::AnyPool::connect(&server.database_url).await?;
    sqlx::query("DELETE FROM model_signing_keys")
        .execute(&pool)
        .await?;
    sqlx::query(
        "INSERT INTO settings (name, value, created_ms) VALUES ('model_signing_key', $1, 0)",
    )
    .bind(legacy.to_bytes().to_vec())
    .execute(&pool)
    .await?;
    server.restart()?;
    let key = server.admin().ok("/device/v1/server-key").await?["server_public_key"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    ensure!(
        key == legacy.public_key_hex(),
        "the server signs with {key}"
    );
    let listed = signing_key_command(&server, &["list"])?;
    ensure!(listed.lines().count() == 1, "{listed}");
    ensure!(
        listed.contains(&key) && listed.contains("in use"),
        "{listed}"
    );
    let (settings,): (i64,) =
        sqlx::query_as("SELECT COUNT(*) FROM settings WHERE name = 'model_signing_key'")
            .fetch_one(&pool)
            .await?;
    ensure!(settings == 0, "the pre-ring secret is still in settings");
    pool.close().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pre_ring_key_becomes_the_first_key_sqlite() -> Result<()> {
    the_pre_ring_key_becomes_the_first_key_of_the_ring(Database::Sqlite).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pre_ring_key_becomes_the_first_key_postgres() -> Result<()> {
    the_pre_ring_key_becomes_the_first_key_of_the_ring(Database::Postgres).await
}

#[test]
fn an_overlap_over_the_limit_is_refused() -> Result<()> {
    let server = TestServer::start(Database::Sqlite)?;
    let error = signing_key_command(&server, &["rotate", "--overlap", "91d"]).expect_err("91 days");
    let text = error.to_string();
    ensure!(
        text.contains("over the limit") && text.contains("90 days"),
        "{text}"
    );
    let error =
        signing_key_command(&server, &["rotate", "--overlap", "soon"]).expect_err("not a duration");
    ensure!(error.to_string().contains("--overlap `soon`"), "{error}");
    let listed = signing_key_command(&server, &["list"])?;
    ensure!(listed.lines().count() == 1, "nothing rotated:\n{listed}");
    Ok(())
}

/// Both commands print with `outln!`: a reader that went away stops them
/// with 141, as every other command, not a panic.
#[test]
fn a_closed_stdout_stops_signing_key_commands_quietly() -> Result<()> {
    let server = TestServer::start(Database::Sqlite)?;
    for args in [&["list"][..], &["rotate", "--overlap", "1h"][..]] {
        let (reader, writer) = std::io::pipe()?;
        drop(reader);
        let output = std::process::Command::new(support::server_binary())
            .arg("signing-key")
            .args(args)
            .arg("--data-dir")
            .arg(server.data_dir.path())
            .args(["--database-url", &server.database_url])
            .stdout(writer)
            .stderr(std::process::Stdio::piped())
            .output()?;
        let stderr = String::from_utf8_lossy(&output.stderr);
        ensure!(
            output.status.code() == Some(141) && !stderr.contains("panicked"),
            "`signing-key {args:?}` with stdout closed: {:?}\n{stderr}",
            output.status
        );
    }
    Ok(())
}
