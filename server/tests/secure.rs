//! Secure aggregation through the real server, on SQLite and PostgreSQL:
//! devices run the protocol crate's `Client` over signed HTTPS, drop out
//! at different stages, and the aggregated model must equal FedAvg of
//! exactly the survivors' quantized updates. The privacy test then looks
//! for any survivor's plaintext update, as floats or as fixed point, in
//! every byte the server wrote: database files, blob store and logs.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use bytes::Bytes;
use canopy_protocol::device_cert::DeviceAuthority;
use canopy_protocol::messages::{
    CERTIFICATE_PATH, RoundMetrics, Task, secagg_endpoints as endpoints,
};
use canopy_protocol::secagg::{Client, Plan, Session, arith, wire};
use canopy_sdk::DeviceClient;
use rand::SeedableRng;
use reqwest::Method;
use serde_json::{Value, json};

use crate::support::{
    Admin, Database, TestServer, enroll_device, fetch_model, logreg_model_bytes, poll_task,
    trainable,
};

const JOB_TIMEOUT: Duration = Duration::from_secs(120);
/// Short, so that tests see silent devices dropped quickly.
const STAGE_TIMEOUT_MS: u64 = 1_500;

fn version_id(version: &Value) -> i64 {
    version["id"].as_i64().unwrap_or_default()
}

fn secure_job(version_id: i64, devices: u32, min: u32, dropout: f64, retries: u32) -> Value {
    json!({
        "name": "secure-test", "model_version_id": version_id, "rounds": 1,
        "min_devices": min, "target_devices": devices, "over_selection": 0.0,
        "evaluation": {"fraction": 0.0}, "round_deadline_ms": 60_000, "local_epochs": 1, "batch_size": 8, "learning_rate": 0.1,
        "max_round_retries": retries,
        "secure_aggregation": {
            "enabled": true, "max_dropout_fraction": dropout, "clip": 0.05, "bits": 32,
            "max_weight": 64,
        },
    })
}

/// A server whose key stages close after `STAGE_TIMEOUT_MS` without news.
fn start(database: Database, rust_log: &str) -> Result<(TestServer, tempfile::TempDir)> {
    start_timed(database, rust_log, STAGE_TIMEOUT_MS)
}

fn start_timed(
    database: Database,
    rust_log: &str,
    stage_timeout_ms: u64,
) -> Result<(TestServer, tempfile::TempDir)> {
    start_configured(database, rust_log, stage_timeout_ms, "")
}

/// As [`start_timed`], with `settings` (TOML lines) before the limits.
fn start_configured(
    database: Database,
    rust_log: &str,
    stage_timeout_ms: u64,
    settings: &str,
) -> Result<(TestServer, tempfile::TempDir)> {
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("server.toml");
    std::fs::write(
        &config,
        format!("{settings}[limits]\nsecagg_stage_timeout_ms = {stage_timeout_ms}\n"),
    )?;
    let server = TestServer::start_logging(
        database,
        &["--config", config.to_str().context("utf-8 path")?],
        rust_log,
    )?;
    Ok((server, dir))
}

fn stage_path(task: &Task, endpoint: &str) -> Result<String> {
    let secure = task
        .secure_aggregation
        .as_ref()
        .context("not a secure task")?;
    Ok(format!("{}/{endpoint}", secure.path))
}

/// Posts a stage message; returns the status and the error text.
async fn post(
    device: &DeviceClient,
    task: &Task,
    endpoint: &str,
    body: Vec<u8>,
) -> Result<(u16, String)> {
    let response = device
        .signed(
            Method::POST,
            &stage_path(task, endpoint)?,
            Bytes::from(body),
        )
        .await?;
    let status = response.status().as_u16();
    Ok((status, response.text().await.unwrap_or_default()))
}

async fn post_ok(device: &DeviceClient, task: &Task, endpoint: &str, body: Vec<u8>) -> Result<()> {
    let (status, text) = post(device, task, endpoint, body).await?;
    ensure!(
        status == 204,
        "{endpoint} from device {} answered {status}: {text}",
        device.device_id
    );
    Ok(())
}

/// Fetches a stage message, long-polling through 202s.
async fn fetch(device: &DeviceClient, task: &Task, endpoint: &str) -> Result<Vec<u8>> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let path = format!("{}?wait_ms=2000", stage_path(task, endpoint)?);
    while Instant::now() < deadline {
        let response = device.signed(Method::GET, &path, Bytes::new()).await?;
        match response.status().as_u16() {
            200 => return Ok(response.bytes().await?.to_vec()),
            202 => continue,
            other => bail!(
                "{endpoint} for device {} answered {other}: {}",
                device.device_id,
                response.text().await.unwrap_or_default()
            ),
        }
    }
    bail!(
        "{endpoint} for device {} never became ready",
        device.device_id
    )
}

/// A device's update for the test: deterministic, within the clip.
fn delta(len: usize, seed: u64) -> Vec<f32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..len)
        .map(|_| rand::Rng::random_range(&mut rng, -0.03f32..0.03))
        .collect()
}

struct Device {
    client: DeviceClient,
    task: Task,
    protocol: Option<Client>,
    delta: Vec<f32>,
    samples: u64,
    input: Vec<u32>,
}

impl Device {
    fn plan(&self) -> Plan {
        self.task
            .secure_aggregation
            .as_ref()
            .map(|s| s.plan.clone())
            .expect("secure task")
    }

    fn session(&self) -> Session {
        Session {
            job_id: self.task.job_id as u64,
            round_id: self.task.round_id as u64,
        }
    }

    async fn advertise(&mut self) -> Result<()> {
        let (client, message) = Client::start(
            self.session(),
            self.client.device_id as u64,
            self.plan(),
            self.client.key(),
            self.client.key_trust(),
        )?;
        self.protocol = Some(client);
        post_ok(&self.client, &self.task, endpoints::ADVERTISE_KEYS, message).await
    }

    async fn share(&mut self) -> Result<()> {
        let keys = fetch(&self.client, &self.task, endpoints::NEIGHBOUR_KEYS).await?;
        let message = self
            .protocol
            .as_mut()
            .context("started")?
            .share_keys(&keys)?;
        post_ok(&self.client, &self.task, endpoints::SHARE_KEYS, message).await
    }

    /// ShareKeys with every ciphertext's first byte flipped: garbage the
    /// server cannot tell from shares.
    async fn share_garbled(&mut self) -> Result<()> {
        let keys = fetch(&self.client, &self.task, endpoints::NEIGHBOUR_KEYS).await?;
        let mut message = self
            .protocol
            .as_mut()
            .context("started")?
            .share_keys(&keys)?;
        let entries_at = wire::HEADER_BYTES + 32 + 4;
        let entry = 8 + wire::SHARE_CIPHERTEXT_BYTES;
        for at in (entries_at..message.len()).step_by(entry) {
            message[at + 8] ^= 0xff;
        }
        post_ok(&self.client, &self.task, endpoints::SHARE_KEYS, message).await
    }

    /// ShareCheck: opens the neighbours' shares and sends the receipt.
    async fn check(&mut self) -> Result<()> {
        let incoming = fetch(&self.client, &self.task, endpoints::INCOMING_SHARES).await?;
        let receipt = self
            .protocol
            .as_mut()
            .context("started")?
            .check_shares(&incoming)?;
        post_ok(&self.client, &self.task, endpoints::SHARE_RECEIPT, receipt).await
    }

    async fn masked_input(&mut self, seed: u64) -> Result<()> {
        let exclusions = fetch(&self.client, &self.task, endpoints::EXCLUSIONS).await?;
        let plan = self.plan();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        self.input = arith::quantize(&plan, &self.delta, self.samples, &mut rng)?;
        let message = self
            .protocol
            .as_mut()
            .context("started")?
            .masked_input(&exclusions, &self.input)?;
        post_ok(&self.client, &self.task, endpoints::MASKED_INPUT, message).await
    }

    async fn sign(&mut self) -> Result<()> {
        let survivors = fetch(&self.client, &self.task, endpoints::SURVIVOR_SET).await?;
        let message = self
            .protocol
            .as_mut()
            .context("started")?
            .sign_survivors(&survivors, self.client.key())?;
        post_ok(
            &self.client,
            &self.task,
            endpoints::SURVIVOR_SIGNATURE,
            message,
        )
        .await
    }

    async fn unmask(&mut self) -> Result<()> {
        let request = fetch(&self.client, &self.task, endpoints::UNMASK_REQUEST).await?;
        let message = self
            .protocol
            .as_mut()
            .context("started")?
            .unmask(&request)?;
        post_ok(
            &self.client,
            &self.task,
            endpoints::UNMASK_RESPONSE,
            message,
        )
        .await
    }

    async fn decline(&self) -> Result<()> {
        self.client.decline_task(&self.task, "test dropout").await?;
        Ok(())
    }
}

/// ConsistencyCheck, then Unmasking, for every device: each stage closes
/// once all have answered.
/// Every device through every stage, none dropping out; device i masks
/// its input rounded with seed `seed + i`.
async fn every_stage(devices: &mut [Device], seed: u64) -> Result<()> {
    for device in devices.iter_mut() {
        device.advertise().await?;
    }
    for device in devices.iter_mut() {
        device.share().await?;
    }
    for device in devices.iter_mut() {
        device.check().await?;
    }
    for (i, device) in devices.iter_mut().enumerate() {
        device.masked_input(seed + i as u64).await?;
    }
    sign_then_unmask(devices).await
}

async fn sign_then_unmask(devices: &mut [Device]) -> Result<()> {
    for device in devices.iter_mut() {
        device.sign().await?;
    }
    for device in devices.iter_mut() {
        device.unmask().await?;
    }
    Ok(())
}

async fn enroll_all(server: &TestServer, admin: &Admin, n: usize) -> Result<Vec<DeviceClient>> {
    let token = admin.enrollment_token(n as u32).await?;
    let mut devices = Vec::new();
    for _ in 0..n {
        devices.push(enroll_device(server, &token).await?);
    }
    Ok(devices)
}

async fn start_devices(clients: Vec<DeviceClient>) -> Result<Vec<Device>> {
    let mut devices = Vec::new();
    for (i, client) in clients.into_iter().enumerate() {
        let task = poll_task(&client).await?;
        let len = task.layout.num_elements();
        devices.push(Device {
            client,
            task,
            protocol: None,
            delta: delta(len, 100 + i as u64),
            samples: 20 + 7 * i as u64,
            input: Vec::new(),
        });
    }
    Ok(devices)
}

/// θ + Σ qᵢ / Σ wᵢ, from the survivors' own quantized inputs.
fn expected_params(
    base: &canopy_ir::Model,
    plan: &Plan,
    survivors: &[&Device],
) -> Result<Vec<f32>> {
    let mut sum = vec![0u32; plan.masked_len()];
    for device in survivors {
        for (s, v) in sum.iter_mut().zip(&device.input) {
            *s = s.wrapping_add(*v);
        }
    }
    let (weighted, weight) = arith::decode_sum(plan, &sum)?;
    let params: Vec<f64> = base
        .trainable_values()?
        .into_iter()
        .map(f64::from)
        .collect();
    Ok(params
        .iter()
        .zip(&weighted)
        .map(|(p, w)| (p + w / weight as f64) as f32)
        .collect())
}

/// Eight devices; one declines before AdvertiseKeys, one goes silent before
/// ShareKeys (dropped at the stage timeout), one declines after fetching
/// its shares. The other five finish, and the model equals FedAvg of
/// exactly their quantized updates.
async fn secure_round_matches_survivors(database: Database) -> Result<()> {
    let (server, _config) = start(database, "info,sqlx=warn")?;
    let admin = server.admin();
    let version = admin.upload_model("logreg", logreg_model_bytes(5)).await?;
    let version_id = version["id"].as_i64().unwrap_or_default();
    let clients = enroll_all(&server, &admin, 8).await?;
    let job = admin
        .create_job(secure_job(version_id, 8, 5, 0.375, 0))
        .await?;
    let base = fetch_model(&admin, "logreg", 1).await?;
    let mut devices = start_devices(clients).await?;
    let plan = devices[0].plan();
    ensure!(
        plan.participants == 8 && plan.max_dropouts == 3,
        "plan: {plan:?}"
    );

    devices[7].decline().await?;
    for device in &mut devices[..7] {
        device.advertise().await?;
    }
    // A second advertisement is refused; the stage then closes at once.
    let (status, text) = post(
        &devices[0].client,
        &devices[0].task,
        endpoints::ADVERTISE_KEYS,
        vec![0; 10],
    )
    .await?;
    ensure!(
        status == 409 || status == 410,
        "duplicate advertisement: {status} {text}"
    );
    for device in &mut devices[..6] {
        device.share().await?;
    }
    // Device 6 stays silent; ShareKeys closes at its timeout without it.
    for device in &mut devices[..5] {
        device.check().await?;
    }
    devices[5].masked_input_fetch_only().await?;
    devices[5].decline().await?;
    for (i, device) in devices[..5].iter_mut().enumerate() {
        device.masked_input(900 + i as u64).await?;
        // Losses 1..=5: the server cannot weight them by the sample counts
        // inside the masked sum, so the round's loss is their plain mean.
        device
            .client
            .report_metrics(&RoundMetrics {
                round_id: device.task.round_id,
                train_loss: Some(1.0 + i as f64),
                eval_loss: None,
                eval_accuracy: None,
                eval_samples: None,
                train_duration_ms: None,
            })
            .await?;
    }
    sign_then_unmask(&mut devices[..5]).await?;
    let finished = admin.wait_for_job(job, JOB_TIMEOUT).await?;
    ensure!(finished["state"] == "completed", "job: {finished}");
    let round = admin
        .ok(&format!("/api/v1/rounds/{}", devices[0].task.round_id))
        .await?;
    ensure!(round["state"] == "succeeded", "round: {round}");
    ensure!(round["metrics"]["updates_accepted"] == 5, "round: {round}");
    ensure!(round["metrics"]["dropouts"] == 3, "round: {round}");
    let loss = round["metrics"]["train_loss"].as_f64();
    ensure!(
        loss.is_some_and(|loss| (loss - 3.0).abs() < 1e-9),
        "the mean of losses 1..=5 is 3: {round}"
    );

    let next = fetch_model(&admin, "logreg", 2).await?;
    let survivors: Vec<&Device> = devices[..5].iter().collect();
    let expected = expected_params(&base, &plan, &survivors)?;
    let got = trainable(&next);
    ensure!(got.len() == expected.len());
    for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
        ensure!((g - e).abs() <= 1e-6, "parameter {i}: {g} vs {e}");
    }
    // The quantized FedAvg is also close to the float one.
    let total: f64 = survivors.iter().map(|d| d.samples as f64).sum();
    let base_values = trainable(&base);
    for i in 0..got.len() {
        let float: f64 = survivors
            .iter()
            .map(|d| d.delta[i] as f64 * d.samples as f64)
            .sum::<f64>()
            / total;
        let step = plan.clip / plan.levels as f64;
        ensure!(
            ((got[i] - base_values[i]) as f64 - float).abs() <= step + 1e-6,
            "parameter {i}"
        );
    }
    Ok(())
}

impl Device {
    /// Fetches IncomingShares and stops there, as a device that crashes
    /// before checking them.
    async fn masked_input_fetch_only(&mut self) -> Result<()> {
        fetch(&self.client, &self.task, endpoints::INCOMING_SHARES).await?;
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secure_round_on_sqlite() -> Result<()> {
    secure_round_matches_survivors(Database::Sqlite).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secure_round_on_postgres() -> Result<()> {
    secure_round_matches_survivors(Database::Postgres).await
}

/// Past the dropout tolerance the round fails with the reason in its
/// status, and no model version is written.
/// Devices that pin a device authority, on a server configured with it:
/// the server refuses a certificate the authority did not make for the
/// sender (422, with a hint) before it can fail anyone's round, selects
/// only certified devices for the secure job (saying why the others
/// wait), relays the certificates in NeighbourKeys, and the round sums
/// exactly the certified devices' inputs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certified_devices_run_a_secure_round_and_uncertified_ones_wait() -> Result<()> {
    let authority = DeviceAuthority::generate();
    let settings = format!("device_authority = \"{}\"\n", authority.public_key_hex());
    let (server, _config) = start_configured(
        Database::Sqlite,
        "info,sqlx=warn",
        STAGE_TIMEOUT_MS,
        &settings,
    )?;
    let admin = server.admin();
    let version = admin.upload_model("logreg", logreg_model_bytes(5)).await?;
    let clients: Vec<DeviceClient> = enroll_all(&server, &admin, 5)
        .await?
        .into_iter()
        .map(|client| client.with_device_authority(authority.public_key()))
        .collect();
    let certify = |client: &DeviceClient| {
        authority.certify(client.device_id as u64, &client.key().public_key())
    };

    // The SDK checks a certificate against the authority it pins...
    let other = certify(&clients[1]);
    let error = clients[0].install_certificate(&other).await.unwrap_err();
    ensure!(
        error
            .to_string()
            .contains("does not hold under the pinned device authority"),
        "{error}"
    );
    // ...and the server against its own, whatever a device sends.
    let unpinned = clients[0].clone().with_device_authority([0; 32]);
    let body = json!({ "certificate": hex::encode(other) });
    let (status, text) = signed_post(&unpinned, CERTIFICATE_PATH, &body).await?;
    ensure!(
        status == 422
            && text.contains("not made by the device authority for this id and key")
            && text.contains("hint: ask the device authority"),
        "{status} {text}"
    );

    for client in &clients[..3] {
        client.install_certificate(&certify(client)).await?;
    }
    let job = admin
        .create_job(secure_job(version_id(&version), 5, 4, 0.25, 0))
        .await?;
    // Three certified devices are too few; the job says why the others wait.
    let waiting = admin
        .wait_for_status(
            job,
            "have no certificate from the device authority",
            JOB_TIMEOUT,
        )
        .await?;
    ensure!(
        waiting["status_message"]
            .as_str()
            .unwrap_or_default()
            .contains("3 eligible"),
        "{waiting}"
    );
    clients[3]
        .install_certificate(&certify(&clients[3]))
        .await?;

    let certified: Vec<DeviceClient> = clients[..4].to_vec();
    let base = fetch_model(&admin, "logreg", 1).await?;
    let mut devices = start_devices(certified).await?;
    ensure!(
        clients[4].next_task(500).await?.is_none(),
        "the uncertified device was selected"
    );
    let plan = devices[0].plan();
    ensure!(plan.participants == 4, "plan: {plan:?}");
    every_stage(&mut devices, 700).await?;
    let finished = admin.wait_for_job(job, JOB_TIMEOUT).await?;
    ensure!(finished["state"] == "completed", "job: {finished}");
    let next = fetch_model(&admin, "logreg", 2).await?;
    let survivors: Vec<&Device> = devices.iter().collect();
    let expected = expected_params(&base, &plan, &survivors)?;
    for (i, (g, e)) in trainable(&next).iter().zip(&expected).enumerate() {
        ensure!((g - e).abs() <= 1e-6, "parameter {i}: {g} vs {e}");
    }
    Ok(())
}

/// Posts a signed JSON body; returns the status and the answer's text.
async fn signed_post(device: &DeviceClient, path: &str, body: &Value) -> Result<(u16, String)> {
    let bytes = Bytes::from(serde_json::to_vec(body)?);
    let response = device.signed(Method::POST, path, bytes).await?;
    let status = response.status().as_u16();
    Ok((status, response.text().await.unwrap_or_default()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_tolerance_the_round_fails_cleanly() -> Result<()> {
    let (server, _config) = start(Database::Sqlite, "info,sqlx=warn")?;
    let admin = server.admin();
    let version = admin.upload_model("logreg", logreg_model_bytes(6)).await?;
    let version_id = version["id"].as_i64().unwrap_or_default();
    let clients = enroll_all(&server, &admin, 6).await?;
    let job = admin
        .create_job(secure_job(version_id, 6, 3, 0.2, 0))
        .await?;
    let mut devices = start_devices(clients).await?;
    ensure!(devices[0].plan().max_dropouts == 1);
    for device in &mut devices {
        device.advertise().await?;
    }
    for device in &mut devices {
        device.share().await?;
    }
    for device in &mut devices {
        device.check().await?;
    }
    // The stage closes once all six receipts are in, in its own time: a
    // decline before then would count in ShareReceipt, not MaskedInput.
    admin
        .wait_for_stage(devices[0].task.round_id, "collect", JOB_TIMEOUT)
        .await?;
    devices[4].decline().await?;
    devices[5].decline().await?;
    for (i, device) in devices[..4].iter_mut().enumerate() {
        device.masked_input(i as u64).await?;
    }
    let finished = admin.wait_for_job(job, JOB_TIMEOUT).await?;
    ensure!(finished["state"] == "failed", "job: {finished}");
    let round = admin
        .ok(&format!("/api/v1/rounds/{}", devices[0].task.round_id))
        .await?;
    let reason = round["status_message"].as_str().unwrap_or_default();
    ensure!(round["state"] == "failed", "round: {round}");
    ensure!(
        reason.contains("2 of 6 devices dropped out by the end of MaskedInput")
            && reason.contains("tolerates 1"),
        "reason: {reason}"
    );
    ensure!(
        round["failure"]["kind"] == "secure_dropouts",
        "failure: {}",
        round["failure"]
    );
    let versions = admin.ok("/api/v1/models/logreg/versions").await?;
    ensure!(
        versions["items"].as_array().map(Vec::len) == Some(1),
        "versions: {versions}"
    );
    // The survivors are told the round is over.
    let response = devices[0]
        .client
        .signed(
            Method::GET,
            &stage_path(&devices[0].task, endpoints::UNMASK_REQUEST)?,
            Bytes::new(),
        )
        .await?;
    ensure!(
        response.status().as_u16() == 410,
        "unmask request after failure: {}",
        response.status()
    );
    Ok(())
}

/// Job creation refuses settings whose sum could overflow, and says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overflowing_configuration_is_refused_at_job_creation() -> Result<()> {
    let (server, _config) = start(Database::Sqlite, "info,sqlx=warn")?;
    let admin = server.admin();
    let version = admin.upload_model("logreg", logreg_model_bytes(7)).await?;
    let mut spec = secure_job(
        version["id"].as_i64().unwrap_or_default(),
        1000,
        900,
        0.1,
        0,
    );
    spec["secure_aggregation"]["bits"] = json!(16);
    let reply = admin.post("/api/v1/jobs", spec).await?;
    let message = reply.body["error"]["message"].as_str().unwrap_or_default();
    ensure!(reply.status == 422, "{} {}", reply.status, reply.body);
    ensure!(message.contains("bits = 16 could overflow"), "{message}");
    // 100,000 devices at the default settings: accepted, the weight cap
    // shrinking with the round (issue 17).
    let mut spec = secure_job(version_id(&version), 100_000, 3, 0.1, 0);
    spec["secure_aggregation"] = json!({"enabled": true});
    let reply = admin.post("/api/v1/jobs", spec).await?;
    ensure!(reply.status == 201, "{} {}", reply.status, reply.body);
    // Every size in the selection range is checked, not only its ends.
    let mut spec = secure_job(version_id(&version), 2_189, 3, 0.1, 0);
    spec["secure_aggregation"]["max_corrupt_fraction"] = json!(0.2);
    let reply = admin.post("/api/v1/jobs", spec).await?;
    let message = reply.body["error"]["message"].as_str().unwrap_or_default();
    ensure!(reply.status == 422, "{} {}", reply.status, reply.body);
    ensure!(
        message.contains("rounds of 2,170 to 2,171, 2,175 to 2,176, 2,180 to 2,182 and 2,185 to 2,188 devices have no plan"),
        "{message}"
    );
    // Settings out of range are refused even with secure aggregation off.
    let mut spec = secure_job(version["id"].as_i64().unwrap_or_default(), 4, 4, 0.1, 0);
    spec["secure_aggregation"]["enabled"] = json!(false);
    spec["secure_aggregation"]["max_weight"] = json!(0);
    let reply = admin.post("/api/v1/jobs", spec).await?;
    let message = reply.body["error"]["message"].as_str().unwrap_or_default();
    ensure!(reply.status == 422, "{} {}", reply.status, reply.body);
    ensure!(
        message.contains("max_weight must be between 1"),
        "{message}"
    );
    Ok(())
}

/// Distributed differential privacy: a job with both `secure_aggregation`
/// and `differential_privacy` plans each device's Skellam noise, devices
/// add it before masking, and the server adds none of its own: the model
/// is the base plus exactly the devices' noisy inputs over the round's
/// target, and the round reports the ε of the noise its plan guarantees.
/// A ring too narrow for the noise is refused at creation, naming the bits
/// it needs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_private_secure_round_carries_its_devices_noise() -> Result<()> {
    use canopy_privacy::skellam::Skellam;
    use canopy_privacy::{Accountant, Conversion, Event, Mechanism, Orders};

    let (server, _config) = start(Database::Sqlite, "info,sqlx=warn")?;
    let admin = server.admin();
    let version = admin.upload_model("logreg", logreg_model_bytes(3)).await?;
    let clients = enroll_all(&server, &admin, 4).await?;
    let mut spec = secure_job(version_id(&version), 4, 3, 0.25, 0);
    let (noise_multiplier, clip_norm, delta_dp) = (1.0, 0.5, 1e-5);
    spec["differential_privacy"] = json!({
        "noise_multiplier": noise_multiplier, "clip_norm": clip_norm, "delta": delta_dp,
    });
    // Narrow rings first: enough for the values (12 bits hold 4 × 255
    // levels), not with room for the noise.
    spec["secure_aggregation"]["bits"] = json!(12);
    let reply = admin.post("/api/v1/jobs", spec.clone()).await?;
    let message = reply.body["error"]["message"].as_str().unwrap_or_default();
    ensure!(reply.status == 422, "{} {}", reply.status, reply.body);
    ensure!(
        message.contains("bits = 12 could overflow with distributed differential privacy")
            && message.contains("needs 13 bits")
            && message.contains("raise bits to 13")
            && message.contains("the model trains 650 values"),
        "{message}"
    );
    spec["secure_aggregation"]["bits"] = json!(32);
    let job = admin.create_job(spec).await?;
    let base = fetch_model(&admin, "logreg", 1).await?;
    let mut devices = start_devices(clients).await?;
    let plan = devices[0].plan();
    let noise = plan.device_noise.clone().context("a private plan")?;
    ensure!(
        plan.max_weight == 1 && plan.clip == clip_norm && plan.max_dropouts == 1,
        "plan: {plan:?}"
    );
    // One allowed dropout, one corrupt device at most: three devices carry
    // the whole noise.
    ensure!(noise.guaranteed_devices == 3, "plan: {plan:?}");
    let task_clip = devices[0].task.privacy.as_ref().map(|p| p.clip_norm);
    ensure!(
        task_clip == Some(clip_norm),
        "the task asks devices to clip"
    );

    every_stage(&mut devices, 40).await?;
    let finished = admin.wait_for_job(job, JOB_TIMEOUT).await?;
    ensure!(finished["state"] == "completed", "job: {finished}");

    // Base + Σ inputs / target (the fixed denominator), and nothing else.
    let mut sum = vec![0u32; plan.masked_len()];
    for device in &devices {
        for (total, value) in sum.iter_mut().zip(&device.input) {
            *total = total.wrapping_add(*value);
        }
    }
    let (noisy_sum, weight) = arith::decode_sum(&plan, &sum)?;
    ensure!(weight == 4, "every device weighs 1: {weight}");
    let base_values = trainable(&base);
    let got = trainable(&fetch_model(&admin, "logreg", 2).await?);
    ensure!(got.len() == base_values.len() && got.len() == plan.update_len);
    for i in 0..got.len() {
        let expected = base_values[i] as f64 + noisy_sum[i] / 4.0;
        ensure!(
            (got[i] as f64 - expected).abs() <= 1e-6,
            "parameter {i}: {} vs {expected}",
            got[i]
        );
    }
    // The inputs hold noise of about σ·C·√(4/3) per coordinate of the sum
    // (four devices' shares, planned for three).
    let sum_of_updates = |i: usize| devices.iter().map(|d| f64::from(d.delta[i])).sum::<f64>();
    let noise_variance = (0..got.len())
        .map(|i| (noisy_sum[i] - sum_of_updates(i)).powi(2))
        .sum::<f64>()
        / got.len() as f64;
    let planned = (noise_multiplier * clip_norm).powi(2) * 4.0 / 3.0;
    ensure!(
        (noise_variance / planned - 1.0).abs() < 0.25,
        "noise variance {noise_variance} against {planned}"
    );

    // ε of the Skellam release the plan guarantees, at sampling rate 1.
    let sensitivity = plan.sensitivity();
    let event = Event {
        mechanism: Mechanism::Skellam(Skellam {
            variance: noise.guaranteed_variance(),
            l1_sensitivity: sensitivity.l1,
            l2_sensitivity: sensitivity.l2,
        }),
        sampling_rate: 1.0,
        steps: 1,
    };
    let mut accountant = Accountant::new(Orders::standard());
    accountant.compose(&event)?;
    let expected = accountant.epsilon(delta_dp, Conversion::Tight)?.epsilon;
    let round = admin
        .ok(&format!("/api/v1/rounds/{}", devices[0].task.round_id))
        .await?;
    let epsilon = round["privacy"]["epsilon"].as_f64().unwrap_or_default();
    ensure!(
        (epsilon / expected - 1.0).abs() < 1e-9,
        "round ε {epsilon} against {expected}: {round}"
    );
    Ok(())
}

/// Wrong stage, wrong round, wrong length and unknown endpoints are refused
/// by name; the round still completes with the honest devices.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_messages_are_refused_and_the_round_goes_on() -> Result<()> {
    let (server, _config) = start(Database::Sqlite, "info,sqlx=warn")?;
    let admin = server.admin();
    let version = admin.upload_model("logreg", logreg_model_bytes(8)).await?;
    let version_id = version["id"].as_i64().unwrap_or_default();
    let clients = enroll_all(&server, &admin, 4).await?;
    let job = admin
        .create_job(secure_job(version_id, 4, 4, 0.0, 0))
        .await?;
    let mut devices = start_devices(clients).await?;
    // Enrolled after the round chose its devices: not in it.
    let bystander = enroll_all(&server, &admin, 1).await?.remove(0);
    let (status, text) = post(
        &bystander,
        &devices[0].task,
        endpoints::ADVERTISE_KEYS,
        vec![1],
    )
    .await?;
    ensure!(
        status == 404
            && text.contains(&format!(
                "device {} was not selected for round {}",
                bystander.device_id, devices[0].task.round_id
            )),
        "a device outside the round: {status} {text}"
    );
    let elsewhere = stage_path(&devices[0].task, endpoints::ADVERTISE_KEYS)?.replace(
        &format!("/rounds/{}/", devices[0].task.round_id),
        &format!("/rounds/{}/", devices[0].task.round_id + 1000),
    );
    let response = devices[0]
        .client
        .signed(Method::POST, &elsewhere, Bytes::from(vec![1]))
        .await?;
    let status = response.status().as_u16();
    let text = response.text().await.unwrap_or_default();
    ensure!(
        status == 404 && text.contains("does not run secure aggregation"),
        "a round that does not exist: {status} {text}"
    );
    let (status, _) = post(
        &devices[0].client,
        &devices[0].task,
        endpoints::SHARE_KEYS,
        vec![1],
    )
    .await?;
    ensure!(status == 409, "ShareKeys during AdvertiseKeys: {status}");
    let (status, _) = post(&devices[0].client, &devices[0].task, "bogus", vec![1]).await?;
    ensure!(status == 404, "unknown endpoint: {status}");
    // An advertisement for another round is refused by name.
    let other = Session {
        job_id: devices[0].task.job_id as u64,
        round_id: 999,
    };
    let (_, foreign) = Client::start(
        other,
        devices[0].client.device_id as u64,
        devices[0].plan(),
        devices[0].client.key(),
        devices[0].client.key_trust(),
    )?;
    let (status, text) = post(
        &devices[0].client,
        &devices[0].task,
        endpoints::ADVERTISE_KEYS,
        foreign,
    )
    .await?;
    ensure!(
        status == 422 && text.contains("round 999"),
        "{status} {text}"
    );
    for device in &mut devices {
        device.advertise().await?;
    }
    for device in &mut devices {
        device.share().await?;
    }
    for device in &mut devices {
        device.check().await?;
    }
    // A masked vector one value short.
    let plan = devices[0].plan();
    let mut short = wire::header(
        devices[0].session(),
        wire::Stage::MaskedInput,
        devices[0].client.device_id as u64,
    );
    short.push(plan.bits as u8);
    short.extend_from_slice(&(plan.masked_len() as u64 - 1).to_le_bytes());
    short.extend_from_slice(&vec![0u8; (plan.masked_len() - 1) * 4]);
    fetch(&devices[0].client, &devices[0].task, endpoints::EXCLUSIONS).await?;
    let (status, text) = post(
        &devices[0].client,
        &devices[0].task,
        endpoints::MASKED_INPUT,
        short,
    )
    .await?;
    ensure!(
        status == 422 && text.contains("the round expects"),
        "{status} {text}"
    );
    for (i, device) in devices.iter_mut().enumerate() {
        device.masked_input(i as u64).await?;
    }
    sign_then_unmask(&mut devices).await?;
    let finished = admin.wait_for_job(job, JOB_TIMEOUT).await?;
    ensure!(finished["state"] == "completed", "job: {finished}");
    Ok(())
}

/// Acceptance 3: no individual plaintext update reaches the database, the
/// blob store or the logs, even at the most verbose log level. Every
/// stored byte is searched for every run of four consecutive values of
/// each device's update, as float32 and as its quantized fixed point,
/// mid-round (after the masked inputs are folded) and after the job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_plaintext_update_reaches_the_database_blobs_or_logs() -> Result<()> {
    // The search takes a while; the stages must not time out meanwhile.
    let (server, _config) = start_timed(Database::Sqlite, "trace", 60_000)?;
    let admin = server.admin();
    let version = admin.upload_model("logreg", logreg_model_bytes(9)).await?;
    let version_id = version["id"].as_i64().unwrap_or_default();
    let clients = enroll_all(&server, &admin, 5).await?;
    let job = admin
        .create_job(secure_job(version_id, 5, 5, 0.0, 0))
        .await?;
    let mut devices = start_devices(clients).await?;
    for device in &mut devices {
        device.advertise().await?;
    }
    for device in &mut devices {
        device.share().await?;
    }
    for device in &mut devices {
        device.check().await?;
    }
    for (i, device) in devices.iter_mut().enumerate() {
        device.masked_input(i as u64).await?;
    }
    let needles = plaintext_windows(&devices);
    ensure!(
        needles.len() > 500,
        "too few windows to search: {}",
        needles.len()
    );
    let mid_round = find_any(server.data_dir.path(), &needles)?;
    ensure!(
        mid_round.is_empty(),
        "plaintext update bytes found mid-round in {mid_round:?}"
    );
    sign_then_unmask(&mut devices).await?;
    let finished = admin.wait_for_job(job, JOB_TIMEOUT).await?;
    ensure!(finished["state"] == "completed", "job: {finished}");
    let after = find_any(server.data_dir.path(), &needles)?;
    ensure!(
        after.is_empty(),
        "plaintext update bytes found after the job in {after:?}"
    );
    // The search can fail: the same bytes, written into the data dir, are found.
    let planted = server.data_dir.path().join("planted.bin");
    std::fs::write(
        &planted,
        devices[2]
            .delta
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect::<Vec<u8>>(),
    )?;
    ensure!(
        !find_any(server.data_dir.path(), &needles)?.is_empty(),
        "the search finds planted bytes"
    );
    std::fs::remove_file(planted)?;
    Ok(())
}

/// Every 16-byte run of four consecutive update values, as float32 bytes,
/// as text (how a log would print them) and as quantized u32 bytes; runs
/// that are mostly zeros are skipped, as they would match anything.
fn plaintext_windows(devices: &[Device]) -> HashSet<Vec<u8>> {
    let mut needles = HashSet::new();
    for device in devices {
        for run in device.delta.windows(4) {
            needles.insert(run.iter().flat_map(|v| v.to_le_bytes()).collect());
            needles.insert(format!("{}, {}, {}, {}", run[0], run[1], run[2], run[3]).into_bytes());
        }
        for run in device
            .input
            .windows(4)
            .filter(|run| run.iter().all(|v| *v != 0))
        {
            needles.insert(run.iter().flat_map(|v| v.to_le_bytes()).collect());
        }
    }
    needles
}

/// Files under `dir` (database, WAL, blobs, log) that contain any needle.
/// A bitset over each needle's first eight bytes screens every offset
/// cheaply, so gigabytes of trace logs are searched in seconds.
fn find_any(dir: &Path, needles: &HashSet<Vec<u8>>) -> Result<BTreeMap<String, usize>> {
    const PREFIX: usize = 8;
    let slot = |bytes: &[u8]| {
        let word = u64::from_le_bytes(bytes[..PREFIX].try_into().expect("8 bytes"));
        (word.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40) as usize
    };
    let mut screen = vec![false; 1 << 24];
    for needle in needles {
        screen[slot(needle)] = true;
    }
    let mut hits = BTreeMap::new();
    let mut files = 0;
    for entry in walk(dir)? {
        let bytes = std::fs::read(&entry)?;
        files += 1;
        let count = (0..bytes.len().saturating_sub(PREFIX - 1))
            .filter(|&at| screen[slot(&bytes[at..])])
            .filter(|&at| needles.iter().any(|n| bytes[at..].starts_with(n)))
            .count();
        if count > 0 {
            hits.insert(entry.display().to_string(), count);
        }
    }
    ensure!(
        files >= 3,
        "expected the database, blobs and log under {}",
        dir.display()
    );
    Ok(hits)
}

fn walk(dir: &Path) -> Result<Vec<std::path::PathBuf>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            out.extend(walk(&path)?);
        } else {
            out.push(path);
        }
    }
    Ok(out)
}

/// kill -9 in the middle of MaskedInputCollection, then a restart: the
/// masked sum, the keys and the shares survive, a re-sent masked input is
/// refused as a duplicate rather than counted twice, and the round
/// completes with exactly the five devices' sum.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secure_round_survives_kill_9() -> Result<()> {
    let (mut server, _config) = start_timed(Database::Sqlite, "info,sqlx=warn", 60_000)?;
    let admin = server.admin();
    let version = admin.upload_model("logreg", logreg_model_bytes(10)).await?;
    let version_id = version["id"].as_i64().unwrap_or_default();
    let clients = enroll_all(&server, &admin, 5).await?;
    let job = admin
        .create_job(secure_job(version_id, 5, 4, 0.2, 0))
        .await?;
    let base = fetch_model(&admin, "logreg", 1).await?;
    let mut devices = start_devices(clients).await?;
    let plan = devices[0].plan();
    for device in &mut devices {
        device.advertise().await?;
    }
    for device in &mut devices {
        device.share().await?;
    }
    for device in &mut devices {
        device.check().await?;
    }
    for (i, device) in devices[..2].iter_mut().enumerate() {
        device.masked_input(40 + i as u64).await?;
    }
    let resend = {
        let device = &mut devices[0];
        let incoming = fetch(&device.client, &device.task, endpoints::INCOMING_SHARES).await;
        ensure!(
            incoming.is_ok(),
            "shares stay available to a device that already sent"
        );
        device.input.clone()
    };

    server.restart()?;
    let admin = server.admin();
    for device in &mut devices {
        device.client.set_transport(server.transport());
    }
    let round = admin
        .ok(&format!("/api/v1/rounds/{}", devices[0].task.round_id))
        .await?;
    ensure!(
        round["metrics"]["updates_accepted"] == 2,
        "after restart: {round}"
    );
    ensure!(round["secure_stage"] == "collect", "after restart: {round}");
    // The same device's second masked input is refused, not folded twice.
    let mut again = wire::header(
        devices[0].session(),
        wire::Stage::MaskedInput,
        devices[0].client.device_id as u64,
    );
    again.push(plan.bits as u8);
    again.extend_from_slice(&(plan.masked_len() as u64).to_le_bytes());
    again.extend_from_slice(&arith::pack(&resend, plan.bits));
    let (status, text) = post(
        &devices[0].client,
        &devices[0].task,
        endpoints::MASKED_INPUT,
        again,
    )
    .await?;
    ensure!(status == 409, "re-sent masked input: {status} {text}");
    for (i, device) in devices[2..].iter_mut().enumerate() {
        device.masked_input(42 + i as u64).await?;
    }
    sign_then_unmask(&mut devices).await?;
    let finished = admin.wait_for_job(job, JOB_TIMEOUT).await?;
    ensure!(finished["state"] == "completed", "job: {finished}");
    let next = fetch_model(&admin, "logreg", 2).await?;
    let expected = expected_params(&base, &plan, &devices.iter().collect::<Vec<_>>())?;
    for (i, (g, e)) in trainable(&next).iter().zip(&expected).enumerate() {
        ensure!((g - e).abs() <= 1e-6, "parameter {i}: {g} vs {e}");
    }
    Ok(())
}

/// Issue 17, acceptance 4: a device that seals garbage for its neighbours
/// costs the round that device only. Its neighbours report it in
/// ShareCheck instead of aborting; the server excludes it before anyone
/// masks, turns its masked input away, and the others' FedAvg comes out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_whose_shares_do_not_open_costs_the_round_only_itself() -> Result<()> {
    let (server, _config) = start(Database::Sqlite, "info")?;
    let admin = server.admin();
    let version = admin.upload_model("logreg", logreg_model_bytes(9)).await?;
    let version_id = version["id"].as_i64().unwrap_or_default();
    let clients = enroll_all(&server, &admin, 5).await?;
    let job = admin
        .create_job(secure_job(version_id, 5, 4, 0.2, 0))
        .await?;
    let base = fetch_model(&admin, "logreg", 1).await?;
    let mut devices = start_devices(clients).await?;
    let plan = devices[0].plan();
    ensure!(plan.degree > plan.threshold, "plan: {plan:?}");
    for device in &mut devices[..4] {
        device.advertise().await?;
    }
    // The last advertisement asks the server to wait for the stage to
    // close and carries NeighbourKeys back with it (post-and-wait).
    let last = &mut devices[4];
    let (client, advertisement) = Client::start(
        last.session(),
        last.client.device_id as u64,
        last.plan(),
        last.client.key(),
        last.client.key_trust(),
    )?;
    last.protocol = Some(client);
    let with_wait = format!("{}?wait_ms=20000", endpoints::ADVERTISE_KEYS);
    let response = last
        .client
        .signed(
            Method::POST,
            &stage_path(&last.task, &with_wait)?,
            Bytes::from(advertisement),
        )
        .await?;
    ensure!(
        response.status() == 200,
        "post-and-wait: {}",
        response.status()
    );
    let answered = response.bytes().await?.to_vec();
    let fetched = fetch(&last.client, &last.task, endpoints::NEIGHBOUR_KEYS).await?;
    ensure!(
        answered == fetched,
        "the answer is the NeighbourKeys message"
    );
    for device in &mut devices[..4] {
        device.share().await?;
    }
    devices[4].share_garbled().await?;
    for device in &mut devices {
        device.check().await?;
    }
    let garbage = devices[4].client.device_id;
    for (i, device) in devices[..4].iter_mut().enumerate() {
        device.masked_input(60 + i as u64).await?;
    }
    // The excluded device is out of the round: it gets no Exclusions and
    // its masked input is turned away.
    let refused = devices[4].masked_input(64).await;
    let refused = format!(
        "{:#}",
        refused.err().context("the excluded device's input")?
    );
    ensure!(
        refused.contains("410") && refused.contains(&format!("device {garbage} was dropped")),
        "{refused}"
    );
    sign_then_unmask(&mut devices[..4]).await?;
    let finished = admin.wait_for_job(job, JOB_TIMEOUT).await?;
    ensure!(finished["state"] == "completed", "job: {finished}");
    let round = admin
        .ok(&format!("/api/v1/rounds/{}", devices[0].task.round_id))
        .await?;
    ensure!(round["metrics"]["updates_accepted"] == 4, "round: {round}");
    ensure!(round["metrics"]["dropouts"] == 1, "round: {round}");
    let excluded = round["participants"]
        .as_array()
        .and_then(|all| all.iter().find(|p| p["device_id"] == garbage))
        .context("the excluded participant")?;
    let reason = excluded["drop_reason"].as_str().unwrap_or_default();
    ensure!(
        excluded["state"] == "dropped" && reason.starts_with("excluded: device(s) "),
        "participant: {excluded}"
    );
    let next = fetch_model(&admin, "logreg", 2).await?;
    let expected = expected_params(&base, &plan, &devices[..4].iter().collect::<Vec<_>>())?;
    for (i, (g, e)) in trainable(&next).iter().zip(&expected).enumerate() {
        ensure!((g - e).abs() <= 1e-6, "parameter {i}: {g} vs {e}");
    }
    Ok(())
}
