//! The cloud's side of a tiered job (`edges`), on SQLite and PostgreSQL,
//! with the test playing the aggregators through the SDK: rounds select
//! aggregators and hand them a sub-round; an aggregator's weighted mean,
//! with its total weight, makes FedAvg over its devices; and bad partial
//! results (from a device that is no aggregator, with a bad signature,
//! above the sub-round's weight bound, a second one, or a plain one in a
//! secure round) are refused and change nothing. The edge itself is
//! `tests/edge.rs`.

use std::time::Duration;

use anyhow::{Result, ensure};
use bytes::Bytes;
use canopy_protocol::auth::DeviceKey;
use canopy_protocol::update::encode_update;
use canopy_sdk::DeviceClient;
use serde_json::{Value, json};

use crate::support;
use crate::support::{
    Admin, Database, TestServer, enroll_aggregator, enroll_device, fetch_model, poll_task,
};

const PER_DEVICE: u64 = 100;
const SUB_ROUND_TARGET: u64 = 5;

fn tiered_spec(version: &Value, edges: Value) -> Value {
    json!({
        "name": "tiered", "model_version_id": version["id"], "rounds": 1,
        "min_devices": 2, "target_devices": 2, "over_selection": 0.0,
        "round_deadline_ms": 60_000, "local_epochs": 1, "batch_size": 8,
        "learning_rate": 0.1, "evaluation": {"fraction": 0.0},
        "max_samples_per_device": PER_DEVICE, "edges": edges,
    })
}

fn edges() -> Value {
    json!({"min_devices": 1, "target_devices": SUB_ROUND_TARGET, "over_selection": 0.0,
           "deadline_ms": 50_000})
}

async fn job_round(admin: &Admin, job: i64) -> Result<Value> {
    let rounds = admin.ok(&format!("/api/v1/jobs/{job}/rounds")).await?;
    Ok(rounds["items"][0].clone())
}

/// Every one of the `len` trainable values of `trained` is, to 1e-6,
/// `expected(k, the base model's value)`.
fn each_parameter_is(
    base: &canopy_ir::Model,
    trained: &canopy_ir::Model,
    len: usize,
    expected: impl Fn(usize, f32) -> f32,
) -> Result<()> {
    let (before, after) = (support::trainable(base), support::trainable(trained));
    ensure!(
        before.len() == len && after.len() == len,
        "{} and {} trainable values, not {len}",
        before.len(),
        after.len()
    );
    for (k, (old, new)) in before.iter().zip(&after).enumerate() {
        let want = expected(k, *old);
        ensure!((new - want).abs() <= 1e-6, "element {k}: {new} != {want}");
    }
    Ok(())
}

/// A cloud with a logistic-regression model uploaded as `name`: the
/// server, the model, and its version.
async fn cloud_with_model(
    database: Database,
    name: &str,
) -> Result<(TestServer, canopy_ir::Model, Value)> {
    let server = TestServer::start(database)?;
    let base_bytes = support::logreg_model_bytes(5);
    let base = canopy_ir::format::read_model(&base_bytes)?;
    let version = server.admin().upload_model(name, base_bytes).await?;
    Ok((server, base, version))
}

/// Two aggregators' mean updates of `len` values, different from each
/// other in every few elements.
fn two_means(len: usize) -> [Vec<f32>; 2] {
    [
        (0..len).map(|k| (k % 7) as f32 * 0.01).collect(),
        (0..len).map(|k| (k % 5) as f32 * -0.02).collect(),
    ]
}

/// Refused with `status`, saying `fragment`.
fn refused(error: canopy_sdk::SdkError, status: u16, fragment: &str) -> Result<()> {
    let text = canopy_sdk::error_chain(&error);
    ensure!(
        error.status() == Some(status) && text.contains(fragment),
        "expected {status} with `{fragment}`, got {:?}: {text}",
        error.status()
    );
    Ok(())
}

async fn tiers(database: Database) -> Result<()> {
    let (server, base, version) = cloud_with_model(database, "tiered").await?;
    let admin = server.admin();

    // Settings the tier cannot run are refused, naming the setting.
    for (edges, fragment) in [
        (
            json!({"min_devices": 1, "target_devices": 2, "deadline_ms": 59_500}),
            "edges.deadline_ms",
        ),
        (
            json!({"min_devices": 3, "target_devices": 2, "deadline_ms": 5_000}),
            "edges.target_devices",
        ),
    ] {
        let reply = admin
            .post("/api/v1/jobs", tiered_spec(&version, edges))
            .await?;
        ensure!(
            reply.status == 422 && reply.body.to_string().contains(fragment),
            "{fragment}: {} {}",
            reply.status,
            reply.body
        );
    }
    // Evaluation through the edges needs the uplink's time too.
    let mut short = tiered_spec(&version, edges());
    short["evaluation"] = json!({"fraction": 1.0, "deadline_ms": 5_000});
    let reply = admin.post("/api/v1/jobs", short).await?;
    ensure!(
        reply.status == 422
            && reply
                .body
                .to_string()
                .contains("`evaluation.deadline_ms` is 5000 ms"),
        "{} {}",
        reply.status,
        reply.body
    );

    // Secure aggregation needs three participants at each tier: the
    // error names the tier that has fewer.
    for (min_aggregators, min_devices, fragment) in [
        (3, 1, "in each sub-round"),
        (2, 3, "in the rounds among aggregators"),
    ] {
        let mut secure = tiered_spec(&version, edges());
        secure["min_devices"] = json!(min_aggregators);
        secure["target_devices"] = json!(3);
        secure["edges"]["min_devices"] = json!(min_devices);
        secure["secure_aggregation"] = json!({"enabled": true});
        let reply = admin.post("/api/v1/jobs", secure).await?;
        let body = reply.body.to_string();
        ensure!(
            reply.status == 422 && body.contains(fragment) && body.contains("needs 3 to"),
            "{fragment}: {} {body}",
            reply.status
        );
    }

    // With end devices alone, a tiered job says whom it waits for.
    let device = enroll_device(&server, &admin.enrollment_token(1).await?).await?;
    let created = admin
        .post("/api/v1/jobs", tiered_spec(&version, edges()))
        .await?;
    ensure!(created.status == 201, "{}", created.body);
    let warning = created.body["warnings"][0].to_string();
    ensure!(
        warning.contains("1 are end devices") && warning.contains("--role aggregator"),
        "{}",
        created.body
    );
    let lonely = created.body["id"].as_i64().unwrap_or_default();
    admin
        .post(&format!("/api/v1/jobs/{lonely}/cancel"), json!({}))
        .await?;

    let token = admin.enrollment_token_for("aggregator", 2).await?;
    let first = enroll_aggregator(&server, &token).await?;
    let second = enroll_aggregator(&server, &token).await?;
    let job = admin.create_job(tiered_spec(&version, edges())).await?;
    let task = poll_task(&first).await?;
    let other = poll_task(&second).await?;
    let sub_round = task
        .sub_round
        .clone()
        .expect("an aggregator's task has a sub-round");
    ensure!(
        sub_round.min_devices == 1
            && u64::from(sub_round.target_devices) == SUB_ROUND_TARGET
            && sub_round.max_samples_per_device == PER_DEVICE
            && task.deadline_unix_ms - sub_round.deadline_unix_ms == 10_000,
        "{task:?}"
    );
    ensure!(
        device.next_task(500).await?.is_none(),
        "a tiered job's round selected an end device"
    );

    let len = task.layout.num_elements();
    let [first_values, second_values] = two_means(len);
    let bound = SUB_ROUND_TARGET * PER_DEVICE;
    let partial = |samples: u64, values: &[f32]| -> Result<Bytes> {
        Ok(Bytes::from(encode_update(&task.layout, samples, values)?))
    };

    // A partial result from a device that is not the round's aggregator.
    let error = device
        .upload_update(&task, partial(10, &first_values)?)
        .await
        .expect_err("a device's partial result");
    refused(error, 403, "was not selected")?;
    // Signed with another key than the aggregator's.
    let forged = DeviceClient::new(
        server.transport(),
        first.device_id,
        DeviceKey::generate(),
        &hex::encode(first.server_public_key()),
    )?;
    let error = forged
        .upload_update(&task, partial(10, &first_values)?)
        .await
        .expect_err("a forged signature");
    ensure!(error.status() == Some(401), "{error:?}");
    // A weight its sub-round could not have gathered.
    let error = first
        .upload_update(&task, partial(bound + 1, &first_values)?)
        .await
        .expect_err("a weight above the bound");
    refused(error, 422, &format!("may claim at most {bound} samples"))?;
    let round = job_round(&admin, job).await?;
    ensure!(
        round["metrics"]["updates_accepted"] == 0 && round["state"] == "training",
        "{round}"
    );

    first
        .upload_update(&task, partial(bound, &first_values)?)
        .await?;
    let error = first
        .upload_update(&task, partial(bound, &first_values)?)
        .await
        .expect_err("a second partial result");
    refused(error, 409, "already uploaded")?;
    ensure!(job_round(&admin, job).await?["metrics"]["updates_accepted"] == 1);
    second
        .upload_update(&other, partial(PER_DEVICE, &second_values)?)
        .await?;
    let finished = admin.wait_for_job(job, Duration::from_secs(60)).await?;
    ensure!(finished["state"] == "completed", "{finished}");

    let (a, b) = (bound as f64, PER_DEVICE as f64);
    let trained = fetch_model(&admin, "tiered", 2).await?;
    each_parameter_is(&base, &trained, len, |k, old| {
        let mean = (a * f64::from(first_values[k]) + b * f64::from(second_values[k])) / (a + b);
        (f64::from(old) + mean) as f32
    })?;
    secure_rounds_take_no_plain_partial(&server, &admin, &version, [first, second]).await
}

/// A secure tiered job: each aggregator's task carries the secure
/// sub-round's settings and the aggregators' plan, whose weight cap is a
/// whole sub-round's; a plain partial result is refused and changes
/// nothing (it would show the cloud that edge's sum).
async fn secure_rounds_take_no_plain_partial(
    server: &TestServer,
    admin: &Admin,
    version: &Value,
    aggregators: [DeviceClient; 2],
) -> Result<()> {
    let token = admin.enrollment_token_for("aggregator", 1).await?;
    let third = enroll_aggregator(server, &token).await?;
    let mut spec = tiered_spec(version, edges());
    spec["min_devices"] = json!(3);
    spec["target_devices"] = json!(3);
    spec["edges"]["min_devices"] = json!(3);
    spec["secure_aggregation"] = json!({"enabled": true});
    let job = admin.create_job(spec).await?;
    let [first, second] = aggregators;
    let mut tasks = Vec::new();
    for aggregator in [&first, &second, &third] {
        tasks.push(poll_task(aggregator).await?);
    }
    let task = &tasks[0];
    let (sub_round, plan) = match (&task.sub_round, &task.secure_aggregation) {
        (Some(sub_round), Some(secure)) => (sub_round, &secure.plan),
        _ => anyhow::bail!("a secure tiered task without its two tiers: {task:?}"),
    };
    let device_tier = sub_round
        .secure_aggregation
        .as_ref()
        .filter(|config| config.enabled);
    ensure!(
        device_tier.is_some_and(|config| config.max_weight == 1024)
            && plan.participants == 3
            && plan.max_weight == SUB_ROUND_TARGET * 1024,
        "{task:?}"
    );
    let values = vec![0.01f32; task.layout.num_elements()];
    let plain = Bytes::from(encode_update(&task.layout, 10, &values)?);
    let error = first
        .upload_update(task, plain)
        .await
        .expect_err("a plain partial in a secure round");
    refused(error, 422, "runs secure aggregation")?;
    let round = job_round(admin, job).await?;
    ensure!(
        round["metrics"]["updates_accepted"] == 0 && round["secure_stage"].is_string(),
        "{round}"
    );
    admin
        .post(&format!("/api/v1/jobs/{job}/cancel"), json!({}))
        .await?;
    Ok(())
}

/// An asynchronous tiered job: the cloud buffers its edges' results
/// (FedBuff over aggregators). Two aggregators train at once, a buffer
/// takes one result: the first makes version 1, and the second, trained
/// on version 0, lands in the next buffer one version stale, weighing
/// 1/√2 of its own mean.
async fn asynchronous_tiers(database: Database) -> Result<()> {
    let (server, base, version) = cloud_with_model(database, "buffered").await?;
    let admin = server.admin();
    let token = admin.enrollment_token_for("aggregator", 2).await?;
    let first = enroll_aggregator(&server, &token).await?;
    let second = enroll_aggregator(&server, &token).await?;
    let mut spec = tiered_spec(&version, edges());
    spec["name"] = json!("buffered");
    spec["rounds"] = json!(2);
    spec["min_devices"] = json!(1);
    spec["target_devices"] = json!(1);
    spec["asynchronous"] = json!({"concurrency": 2, "max_staleness": 2});
    let job = admin.create_job(spec).await?;
    let task = poll_task(&first).await?;
    let other = poll_task(&second).await?;
    ensure!(
        task.sub_round.is_some() && other.sub_round.is_some() && task.round_id == other.round_id,
        "both aggregators run a sub-round for the first buffer: {task:?} {other:?}"
    );

    let len = task.layout.num_elements();
    let [first_values, second_values] = two_means(len);
    let partial = |samples: u64, values: &[f32]| -> Result<Bytes> {
        Ok(Bytes::from(encode_update(&task.layout, samples, values)?))
    };
    first
        .upload_update(&task, partial(3 * PER_DEVICE, &first_values)?)
        .await?;
    second
        .upload_update(&other, partial(PER_DEVICE, &second_values)?)
        .await?;
    let finished = admin.wait_for_job(job, Duration::from_secs(60)).await?;
    ensure!(finished["state"] == "completed", "{finished}");

    let first_buffer = admin
        .ok(&format!("/api/v1/rounds/{}", task.round_id))
        .await?;
    let late = first_buffer["participants"]
        .as_array()
        .and_then(|all| all.iter().find(|p| p["device_id"] == second.device_id))
        .cloned()
        .unwrap_or_default();
    ensure!(
        late["staleness"] == 1 && late["folded_round_id"] != task.round_id,
        "the second aggregator's result went to the next buffer, one version stale: \
         {first_buffer}"
    );
    let trained = fetch_model(&admin, "buffered", 3).await?;
    let stale_weight = 2f64.sqrt().recip();
    each_parameter_is(&base, &trained, len, |k, old| {
        let version_1 = (f64::from(old) + f64::from(first_values[k])) as f32;
        (f64::from(version_1) + stale_weight * f64::from(second_values[k])) as f32
    })?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asynchronous_tiers_on_sqlite() -> Result<()> {
    asynchronous_tiers(Database::Sqlite).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asynchronous_tiers_on_postgres() -> Result<()> {
    asynchronous_tiers(Database::Postgres).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiers_on_sqlite() -> Result<()> {
    tiers(Database::Sqlite).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiers_on_postgres() -> Result<()> {
    tiers(Database::Postgres).await
}
