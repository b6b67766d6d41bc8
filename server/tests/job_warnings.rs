//! A job no device can qualify for, through real servers on SQLite and
//! PostgreSQL: its creation answers with a warning naming the cause (a
//! dataset no device has, an input no device's data fits, no device at
//! all) and a hint, by the rule selection applies; devices that could
//! qualify once their conditions change raise none; a job's
//! `max_wait_for_devices_ms` fails it with the reason it waited; and the
//! creation names the version the job starts from, whose provenance says
//! round numbers beside round ids.

use std::time::Duration;

use anyhow::{Result, ensure};
use bytes::Bytes;
use canopy_engine::zoo::Architecture;
use canopy_protocol::messages::{DatasetInfo, DeviceConditions, Heartbeat};
use canopy_protocol::update::encode_update;
use canopy_sdk::DeviceClient;
use serde_json::{Value, json};

use crate::support::{
    Admin, Database, TestServer, enroll_device, logreg_model_bytes, model_bytes, poll_task,
};

const TIMEOUT: Duration = Duration::from_secs(60);

fn spec(version: &Value, dataset: Option<&str>) -> Value {
    let mut spec = json!({
        "name": "warned", "model_version_id": version["id"], "rounds": 1, "min_devices": 1,
        "target_devices": 1, "over_selection": 0.0, "round_deadline_ms": 60_000,
        "local_epochs": 1, "batch_size": 8, "learning_rate": 0.1, "evaluation": {"fraction": 0.0},
    });
    if let Some(dataset) = dataset {
        spec["dataset"] = json!(dataset);
    }
    spec
}

async fn report_dataset(device: &DeviceClient, name: &str, sample_shape: &[u64]) -> Result<()> {
    device
        .heartbeat(&Heartbeat {
            state: Some("idle".into()),
            datasets: Some(vec![DatasetInfo {
                name: name.to_string(),
                samples: 500,
                sample_shape: sample_shape.to_vec(),
                classes: 10,
            }]),
            ..Heartbeat::default()
        })
        .await?;
    Ok(())
}

/// Creates a job (not started); returns the creation's answer.
async fn create(admin: &Admin, spec: Value) -> Result<Value> {
    let created = admin.post("/api/v1/jobs", spec).await?;
    ensure!(
        created.status == 201,
        "creation answered {}: {}",
        created.status,
        created.body
    );
    Ok(created.body)
}

/// The one warning of a creation, as `(message, hint)`.
fn warning(created: &Value) -> Result<(String, String)> {
    let warnings = created["warnings"].as_array().cloned().unwrap_or_default();
    ensure!(warnings.len() == 1, "expected one warning: {created}");
    let text = |field: &str| warnings[0][field].as_str().unwrap_or_default().to_string();
    Ok((text("message"), text("hint")))
}

fn ensure_contains(text: &str, parts: &[&str]) -> Result<()> {
    for part in parts {
        ensure!(text.contains(part), "`{text}` does not say `{part}`");
    }
    Ok(())
}

async fn warns_when_no_device_could_qualify(database: Database) -> Result<()> {
    let server = TestServer::start(database)?;
    let admin = server.admin();
    let logreg = admin.upload_model("logreg", logreg_model_bytes(1)).await?;
    let lenet = model_bytes(Architecture::LeNet5 { classes: 10 }, 1);
    let lenet = admin.upload_model("lenet", lenet).await?;

    let created = create(&admin, spec(&logreg, None)).await?;
    let (message, hint) = warning(&created)?;
    ensure_contains(&message, &["no device is enrolled yet", "at least 1"])?;
    ensure_contains(&hint, &["canopy device enroll-token"])?;
    ensure!(
        created["state"] == "created" && created["id"].is_i64(),
        "the job is created all the same: {created}"
    );
    ensure!(
        created["start_version"]["model"] == "logreg"
            && created["start_version"]["version"] == 1
            && created["start_version"]["id"] == logreg["id"],
        "the creation does not name the start version: {created}"
    );

    let token = admin.enrollment_token(3).await?;
    let mut devices = Vec::new();
    for _ in 0..3 {
        devices.push(enroll_device(&server, &token).await?);
    }
    // Devices that have reported no datasets yet (an agent enrolled but
    // not yet started) may still offer it: no warning.
    let created = create(&admin, spec(&logreg, Some("nope"))).await?;
    ensure!(
        created["warnings"].as_array().is_none_or(Vec::is_empty),
        "devices that have not reported their datasets are warned about: {created}"
    );
    for device in &devices {
        report_dataset(device, "digits", &[64]).await?;
    }
    // A dataset no device has.
    let (message, hint) = warning(&create(&admin, spec(&logreg, Some("nope"))).await?)?;
    ensure_contains(
        &message,
        &[
            "0 of the 3 enrolled devices could take part",
            "needs at least 1",
            "3 lack dataset `nope`",
        ],
    )?;
    ensure_contains(&hint, &["canopy-agent data add nope"])?;
    // An input no device's data fits.
    let (message, hint) = warning(&create(&admin, spec(&lenet, Some("digits"))).await?)?;
    ensure_contains(
        &message,
        &["3 have `digits` with samples of shape [64], but the model takes [1, 28, 28]"],
    )?;
    ensure_contains(
        &hint,
        &["push a model whose input takes samples of shape [64]"],
    )?;
    // Fewer devices than a round needs, filtered out by tier.
    let mut filtered = spec(&logreg, Some("digits"));
    filtered["filters"] = json!({"tier": "end"});
    let (message, hint) = warning(&create(&admin, filtered).await?)?;
    ensure_contains(&message, &["3 do not match the job's `filters`"])?;
    ensure_contains(&hint, &["widen the job's `filters`"])?;
    let mut too_many = spec(&logreg, Some("digits"));
    too_many["min_devices"] = json!(4);
    too_many["target_devices"] = json!(4);
    let (message, hint) = warning(&create(&admin, too_many).await?)?;
    ensure_contains(&message, &["3 of the 3 enrolled devices", "at least 4"])?;
    ensure_contains(&hint, &["enroll more devices, or lower `min_devices`"])?;

    // Conditions change: a device not charging now could qualify later,
    // so a policy that excludes it for now raises no warning.
    devices[0]
        .heartbeat(&Heartbeat {
            state: Some("idle".into()),
            conditions: Some(DeviceConditions {
                charging: false,
                unmetered_network: true,
                idle: true,
                battery_percent: 50,
            }),
            ..Heartbeat::default()
        })
        .await?;
    let mut charging = spec(&logreg, Some("digits"));
    charging["device_policy"] = json!({"requires_charging": true});
    let fits = create(&admin, charging).await?;
    ensure!(
        fits["warnings"] == json!([]),
        "devices that could qualify drew a warning: {fits}"
    );
    Ok(())
}

/// A job whose round waits past `max_wait_for_devices_ms` fails, saying
/// why it waited; the bound is checked at creation.
async fn the_wait_limit_fails_the_job_with_the_reason(database: Database) -> Result<()> {
    let server = TestServer::start(database)?;
    let admin = server.admin();
    let version = admin.upload_model("logreg", logreg_model_bytes(2)).await?;
    let token = admin.enrollment_token(1).await?;
    let device = enroll_device(&server, &token).await?;
    report_dataset(&device, "digits", &[64]).await?;

    let mut too_short = spec(&version, Some("nope"));
    too_short["max_wait_for_devices_ms"] = json!(999);
    let refused = admin.post("/api/v1/jobs", too_short).await?;
    ensure!(refused.status == 422, "{}", refused.body);
    ensure_contains(
        refused.body["error"]["message"]
            .as_str()
            .unwrap_or_default(),
        &["`max_wait_for_devices_ms` must be between 1000 and 1209600000, got 999"],
    )?;

    let mut limited = spec(&version, Some("nope"));
    limited["max_wait_for_devices_ms"] = json!(1_500);
    let job = admin.create_job(limited).await?;
    let waiting = admin
        .wait_for_status(job, "waiting for devices", TIMEOUT)
        .await?;
    ensure!(waiting["state"] == "running", "{waiting}");
    let failed = admin.wait_for_job(job, TIMEOUT).await?;
    ensure!(failed["state"] == "failed", "{failed}");
    let status = failed["status_message"].as_str().unwrap_or_default();
    ensure_contains(
        status,
        &[
            "round 1 attempt 1 failed",
            "`max_wait_for_devices_ms` of 1500 ms",
            "0 eligible online, the round needs at least 1",
            "1 lack dataset `nope`",
        ],
    )?;
    let rounds = admin.ok(&format!("/api/v1/jobs/{job}/rounds")).await?;
    let round = &rounds["items"][0];
    ensure!(
        round["failure"]["kind"] == "no_eligible_devices"
            && rounds["items"].as_array().is_some_and(|all| all.len() == 1),
        "one round, failed for want of devices, not retried: {rounds}"
    );
    ensure!(
        device.next_task(300).await?.is_none(),
        "the device lacking the dataset got a task"
    );
    Ok(())
}

/// Versions say the number of the round that made them beside its id, and
/// the number of their parent; an unknown model's versions are a 404.
async fn versions_name_round_numbers(database: Database) -> Result<()> {
    let server = TestServer::start(database)?;
    let admin = server.admin();
    let version = admin.upload_model("logreg", logreg_model_bytes(3)).await?;
    // A first job's round, cancelled, so round ids and numbers part.
    let cancelled = admin.create_job(spec(&version, None)).await?;
    admin
        .wait_for_status(cancelled, "waiting for devices", TIMEOUT)
        .await?;
    let reply = admin
        .post(&format!("/api/v1/jobs/{cancelled}/cancel"), json!({}))
        .await?;
    ensure!(reply.status == 200, "{}", reply.body);

    let token = admin.enrollment_token(1).await?;
    let device = enroll_device(&server, &token).await?;
    let job = admin.create_job(spec(&version, None)).await?;
    let task = poll_task(&device).await?;
    let update = encode_update(&task.layout, 5, &vec![0.01; task.layout.num_elements()])?;
    device.upload_update(&task, Bytes::from(update)).await?;
    let done = admin.wait_for_job(job, TIMEOUT).await?;
    ensure!(done["state"] == "completed", "{done}");

    let versions = admin.ok("/api/v1/models/logreg/versions").await?;
    let produced = versions["items"]
        .as_array()
        .and_then(|items| items.last().cloned())
        .unwrap_or_default();
    ensure!(
        produced["produced_by_round"] == task.round_id
            && produced["produced_by_round_number"] == 1
            && produced["produced_by_job"] == job
            && produced["parent_version"] == 1
            && produced["parent_version_id"] == version["id"],
        "round {} (number 1) of job {job} made {produced}",
        task.round_id
    );
    ensure!(
        task.round_id != 1,
        "the cancelled job's round should have taken id 1"
    );
    let lineage = admin
        .ok(&format!(
            "/api/v1/models/logreg/versions/{}/lineage",
            produced["version"]
        ))
        .await?;
    ensure!(
        lineage["chain"][0]["produced_by_round_number"] == 1
            && lineage["chain"][1]["produced_by_round_number"].is_null(),
        "{lineage}"
    );

    let missing = admin.get("/api/v1/models/nosuch/versions").await?;
    ensure!(missing.status == 404, "{}", missing.body);
    ensure_contains(
        missing.body["error"]["message"]
            .as_str()
            .unwrap_or_default(),
        &["model `nosuch` does not exist"],
    )?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warns_when_no_device_could_qualify_on_sqlite() -> Result<()> {
    warns_when_no_device_could_qualify(Database::Sqlite).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warns_when_no_device_could_qualify_on_postgres() -> Result<()> {
    warns_when_no_device_could_qualify(Database::Postgres).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wait_limit_fails_the_job_with_the_reason_on_sqlite() -> Result<()> {
    the_wait_limit_fails_the_job_with_the_reason(Database::Sqlite).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wait_limit_fails_the_job_with_the_reason_on_postgres() -> Result<()> {
    the_wait_limit_fails_the_job_with_the_reason(Database::Postgres).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn versions_name_round_numbers_on_sqlite() -> Result<()> {
    versions_name_round_numbers(Database::Sqlite).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn versions_name_round_numbers_on_postgres() -> Result<()> {
    versions_name_round_numbers(Database::Postgres).await
}
