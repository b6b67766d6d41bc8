//! Mobile eligibility, on SQLite and on PostgreSQL, through real servers:
//! a job's `device_policy` ships in its tasks; a device that no longer
//! meets it withdraws as `ineligible`, which is not a dropout and does not
//! hold the round up; a withdrawal whose conditions meet the policy is
//! refused; devices whose reported conditions violate the policy are not
//! selected; and a policy out of bounds is refused when the job is created.
//! Roles: a token enrolls devices of its role alone, and rounds never
//! select an aggregator.

use std::time::{Duration, Instant};

use anyhow::{Result, bail, ensure};
use bytes::Bytes;
use canopy_protocol::auth::DeviceKey;
use canopy_protocol::messages::{
    DeviceConditions, DevicePolicy, DeviceRole, EnrollRequest, Heartbeat, Task,
};
use canopy_protocol::update::encode_update;
use canopy_sdk::DeviceClient;
use canopy_sdk::train::Evaluation;
use serde_json::{Value, json};

use crate::support;
use crate::support::{Admin, Database, TestServer, enroll_device, logreg_model_bytes, poll_task};

const JOB_TIMEOUT: Duration = Duration::from_secs(120);

fn conditions(charging: bool, battery_percent: u8) -> DeviceConditions {
    DeviceConditions {
        charging,
        unmetered_network: true,
        idle: true,
        battery_percent,
    }
}

fn job_spec(version: &Value, rounds: u32, min: u32, target: u32, policy: Value) -> Value {
    json!({
        "name": "eligibility", "model_version_id": version["id"], "rounds": rounds,
        "min_devices": min, "target_devices": target, "over_selection": 0.0,
        "round_deadline_ms": 120_000, "local_epochs": 1, "batch_size": 8,
        "learning_rate": 0.1, "evaluation": {"fraction": 0.0}, "device_policy": policy,
    })
}

async fn report(device: &DeviceClient, conditions: DeviceConditions) -> Result<()> {
    device
        .heartbeat(&Heartbeat {
            state: Some("idle".into()),
            conditions: Some(conditions),
            ..Heartbeat::default()
        })
        .await?;
    Ok(())
}

async fn upload(device: &DeviceClient, task: &Task) -> Result<()> {
    let values = vec![0.01; task.layout.num_elements()];
    let update = encode_update(&task.layout, 10, &values)?;
    device.upload_update(task, Bytes::from(update)).await?;
    Ok(())
}

fn participant(round: &Value, device: &DeviceClient) -> Value {
    round["participants"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["device_id"] == device.device_id)
        .cloned()
        .unwrap_or_default()
}

/// Waits until the job's status says `fragment`.
async fn assert_no_task(device: &DeviceClient, why: &str) -> Result<()> {
    let task = device.next_task(500).await?;
    ensure!(
        task.is_none(),
        "device {} got round {:?}, but {why}",
        device.device_id,
        task.map(|t| t.round_id)
    );
    Ok(())
}

/// A job's config names the field of a policy out of bounds, or unknown.
async fn bad_policies_are_refused(admin: &Admin, version: &Value) -> Result<()> {
    for (policy, fragment) in [
        (
            json!({"min_battery_percent": 150}),
            "device_policy.min_battery_percent",
        ),
        (json!({"requires_chargin": true}), "requires_chargin"),
    ] {
        let refused = admin
            .post("/api/v1/jobs", job_spec(version, 1, 1, 1, policy.clone()))
            .await?;
        let message = refused.body["error"]["message"]
            .as_str()
            .unwrap_or_default();
        ensure!(
            matches!(refused.status, 400 | 422) && message.contains(fragment),
            "{policy}: {} {}",
            refused.status,
            refused.body
        );
    }
    Ok(())
}

async fn eligibility(database: Database) -> Result<()> {
    let server = TestServer::start(database)?;
    let admin = server.admin();
    let version = admin.upload_model("phones", logreg_model_bytes(3)).await?;
    bad_policies_are_refused(&admin, &version).await?;
    let token = admin.enrollment_token(4).await?;
    let (a, b, c, d) = (
        enroll_device(&server, &token).await?,
        enroll_device(&server, &token).await?,
        enroll_device(&server, &token).await?,
        enroll_device(&server, &token).await?,
    );
    // `d` is unplugged; `b` reports a state the policy takes; `a` and `c`
    // report nothing, and are selectable as before policies.
    report(&d, conditions(false, 90)).await?;
    report(&b, conditions(true, 80)).await?;
    let policy = json!({"requires_charging": true, "min_battery_percent": 50});
    // Room for all four, so only the policy keeps `d` out.
    let job = admin
        .create_job(job_spec(&version, 2, 2, 4, policy))
        .await?;
    let shown = admin.ok(&format!("/api/v1/jobs/{job}")).await?;
    ensure!(
        shown["spec"]["device_policy"]["min_battery_percent"] == 50,
        "{shown}"
    );
    let (task_a, task_b, task_c) = (
        poll_task(&a).await?,
        poll_task(&b).await?,
        poll_task(&c).await?,
    );
    let expected = DevicePolicy {
        requires_charging: true,
        min_battery_percent: 50,
        ..DevicePolicy::default()
    };
    ensure!(task_a.policy == expected, "task policy {:?}", task_a.policy);
    assert_no_task(&d, "its reported state violates the job's policy").await?;

    // `a` is unplugged at 12%: it withdraws, once or twice alike.
    let unplugged = conditions(false, 12);
    ensure!(task_a.policy.check(&unplugged).is_err());
    a.withdraw_task(&task_a, &unplugged).await?;
    a.withdraw_task(&task_a, &unplugged).await?;
    let late = encode_update(&task_a.layout, 10, &vec![0.0; task_a.layout.num_elements()])?;
    let refused = a.upload_update(&task_a, Bytes::from(late)).await;
    ensure!(
        refused.as_ref().err().and_then(|e| e.status()) == Some(410),
        "an upload after withdrawing: {refused:?}"
    );
    // `b` meets the policy, so it may not withdraw.
    let refused = b.withdraw_task(&task_b, &conditions(true, 80)).await;
    let error = refused.err().map(|e| e.to_string()).unwrap_or_default();
    ensure!(
        error.contains("422") && error.contains("eligible"),
        "an eligible withdrawal: {error}"
    );
    // `c` falls to 20% while it trains: its update still counts, but the
    // next round passes it over.
    report(&c, conditions(true, 20)).await?;
    upload(&b, &task_b).await?;
    upload(&c, &task_c).await?;

    let round = wait_for_round(&admin, task_a.round_id).await?;
    ensure!(round["state"] == "succeeded", "{round}");
    ensure!(round["metrics"]["dropouts"] == 0, "{round}");
    ensure!(round["metrics"]["ineligible"] == 1, "{round}");
    ensure!(round["metrics"]["updates_accepted"] == 2, "{round}");
    let withdrawn = participant(&round, &a);
    ensure!(withdrawn["state"] == "ineligible", "{round}");
    let reason = withdrawn["drop_reason"].as_str().unwrap_or_default();
    ensure!(
        reason.contains("the job requires charging")
            && reason.contains("battery 12% is under the job's minimum of 50%"),
        "{reason}"
    );

    // Round 2: `a` (its withdrawal said 12%), `c` and `d` are out.
    admin
        .wait_for_status(
            job,
            "3 report conditions the job's `device_policy` excludes",
            JOB_TIMEOUT,
        )
        .await?;
    let shown = admin
        .ok(&format!("/api/v1/devices/{}", d.device_id))
        .await?;
    ensure!(shown["conditions"]["charging"] == false, "{shown}");
    report(&c, conditions(true, 100)).await?;
    let (next_b, next_c) = (poll_task(&b).await?, poll_task(&c).await?);
    ensure!(next_b.round_id == next_c.round_id && next_b.round_id != task_a.round_id);
    assert_no_task(&a, "its withdrawal reported 12% battery").await?;
    assert_no_task(&d, "it is still unplugged").await?;
    upload(&b, &next_b).await?;
    upload(&c, &next_c).await?;
    let finished = admin.wait_for_job(job, JOB_TIMEOUT).await?;
    ensure!(finished["state"] == "completed", "{finished}");
    Ok(())
}

async fn wait_for_round(admin: &Admin, round_id: i64) -> Result<Value> {
    let deadline = Instant::now() + JOB_TIMEOUT;
    loop {
        let round = admin.ok(&format!("/api/v1/rounds/{round_id}")).await?;
        if !matches!(
            round["state"].as_str(),
            Some("selecting" | "training" | "aggregating")
        ) {
            return Ok(round);
        }
        if Instant::now() > deadline {
            bail!("round {round_id} still open: {round}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ineligible_devices_withdraw_and_are_not_selected_on_sqlite() -> Result<()> {
    eligibility(Database::Sqlite).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ineligible_devices_withdraw_and_are_not_selected_on_postgres() -> Result<()> {
    eligibility(Database::Postgres).await
}

/// An evaluator that is no longer idle withdraws from its evaluation: it
/// is `ineligible`, not a dropout, and the evaluation closes without
/// waiting for it.
async fn evaluators_withdraw(database: Database) -> Result<()> {
    let server = TestServer::start(database)?;
    let admin = server.admin();
    let version = admin.upload_model("phones", logreg_model_bytes(5)).await?;
    let token = admin.enrollment_token(2).await?;
    let (e, f) = (
        enroll_device(&server, &token).await?,
        enroll_device(&server, &token).await?,
    );
    let mut spec = job_spec(&version, 1, 2, 2, json!({"requires_idle": true}));
    spec["evaluation"] = json!({"fraction": 1.0});
    let job = admin.create_job(spec).await?;
    let (train_e, train_f) = (poll_task(&e).await?, poll_task(&f).await?);
    upload(&e, &train_e).await?;
    upload(&f, &train_f).await?;
    let (eval_e, eval_f) = (poll_task(&e).await?, poll_task(&f).await?);
    ensure!(eval_e.policy.requires_idle, "{:?}", eval_e.policy);
    let busy = DeviceConditions {
        idle: false,
        ..conditions(true, 90)
    };
    let refused = e.withdraw_task(&eval_e, &conditions(true, 90)).await;
    ensure!(
        refused.as_ref().err().and_then(|e| e.status()) == Some(422),
        "an idle evaluator withdrew: {refused:?}"
    );
    e.withdraw_task(&eval_e, &busy).await?;
    e.withdraw_task(&eval_e, &busy).await?;
    let evaluation = Evaluation {
        loss: 0.4,
        accuracy: 0.7,
        samples: 5,
    };
    f.report_evaluation(&eval_f, &evaluation).await?;
    let finished = admin.wait_for_job(job, JOB_TIMEOUT).await?;
    ensure!(finished["state"] == "completed", "{finished}");
    let round = admin
        .ok(&format!("/api/v1/rounds/{}", train_e.round_id))
        .await?;
    let metrics = &round["metrics"];
    ensure!(metrics["federated_eval_ineligible"] == 1, "{metrics}");
    ensure!(metrics["federated_eval_dropouts"] == 0, "{metrics}");
    ensure!(metrics["federated_eval_devices"] == 1, "{metrics}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evaluators_withdraw_on_sqlite() -> Result<()> {
    evaluators_withdraw(Database::Sqlite).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evaluators_withdraw_on_postgres() -> Result<()> {
    evaluators_withdraw(Database::Postgres).await
}

/// Enrolls a fresh key in `role` with `token` straight over HTTP (the SDK
/// enrolls devices); the status and body of the answer.
async fn enroll_in_role(
    server: &TestServer,
    token: &str,
    role: DeviceRole,
) -> Result<(u16, Value)> {
    let request = EnrollRequest {
        enrollment_token: token.to_string(),
        public_key: DeviceKey::generate().public_key_hex(),
        capabilities: support::capabilities(),
        role,
    };
    let transport = server.transport();
    let url = transport.url("/device/v1/enroll");
    let response = transport.http().post(&url).json(&request).send().await?;
    Ok((response.status().as_u16(), response.json().await?))
}

async fn enrollment_token(admin: &Admin, role: &str) -> Result<(i64, String)> {
    let created = admin
        .post(
            "/api/v1/enrollment-tokens",
            json!({"expires_in": "1h", "max_uses": 2, "role": role}),
        )
        .await?;
    ensure!(created.status == 201, "{}", created.body);
    ensure!(created.body["role"] == role, "{}", created.body);
    let id = created.body["id"].as_i64().unwrap_or_default();
    Ok((
        id,
        created.body["secret"].as_str().unwrap_or_default().into(),
    ))
}

async fn token_uses(admin: &Admin, id: i64) -> Result<i64> {
    let tokens = admin.ok("/api/v1/enrollment-tokens").await?;
    let token = tokens["items"]
        .as_array()
        .and_then(|items| items.iter().find(|token| token["id"] == id))
        .cloned()
        .unwrap_or_default();
    Ok(token["uses"].as_i64().unwrap_or(-1))
}

/// A token enrolls devices of its role alone (a refusal names both roles
/// and spends nothing), the device list shows each device's role, and a
/// job's rounds never select an aggregator, saying so.
async fn roles(database: Database) -> Result<()> {
    let server = TestServer::start(database)?;
    let admin = server.admin();
    let (aggregators, aggregator_secret) = enrollment_token(&admin, "aggregator").await?;
    let (devices, device_secret) = enrollment_token(&admin, "device").await?;

    let (status, body) = enroll_in_role(&server, &aggregator_secret, DeviceRole::Device).await?;
    let message = body["error"]["message"].as_str().unwrap_or_default();
    ensure!(
        status == 403
            && message.contains(&format!(
                "enrollment token {aggregators} enrolls aggregators"
            ))
            && message.contains("asked to enroll as device")
            && message.contains("--role device"),
        "{status} {body}"
    );
    let (status, body) = enroll_in_role(&server, &device_secret, DeviceRole::Aggregator).await?;
    ensure!(
        status == 403
            && body["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("enrolls devices") && m.contains("as aggregator")),
        "{status} {body}"
    );
    ensure!(
        token_uses(&admin, aggregators).await? == 0,
        "a refusal spent a use"
    );
    ensure!(
        token_uses(&admin, devices).await? == 0,
        "a refusal spent a use"
    );

    let (status, body) =
        enroll_in_role(&server, &aggregator_secret, DeviceRole::Aggregator).await?;
    ensure!(status == 201, "{status} {body}");
    let aggregator = body["device_id"].as_i64().unwrap_or_default();
    let device = enroll_device(&server, &device_secret).await?;
    let listed = admin.ok("/api/v1/devices").await?;
    let role_of = |id: i64| {
        listed["items"]
            .as_array()
            .and_then(|items| items.iter().find(|d| d["id"] == id))
            .map(|d| d["role"].clone())
            .unwrap_or_default()
    };
    ensure!(role_of(aggregator) == "aggregator", "{listed}");
    ensure!(role_of(device.device_id) == "device", "{listed}");

    // Both are online; a job that needs two devices has one.
    let version = admin.upload_model("roles", logreg_model_bytes(3)).await?;
    let created = admin
        .post("/api/v1/jobs", job_spec(&version, 1, 2, 2, json!({})))
        .await?;
    let warning = created.body["warnings"][0]["message"]
        .as_str()
        .unwrap_or_default();
    ensure!(
        warning.contains("1 of the 2 enrolled devices could take part")
            && warning.contains("1 are aggregators (edge nodes)"),
        "{}",
        created.body
    );
    let id = created.body["id"].as_i64().unwrap_or_default();
    admin
        .post(&format!("/api/v1/jobs/{id}/start"), json!({}))
        .await?;
    admin
        .wait_for_status(
            id,
            "1 are aggregators (edge nodes)",
            Duration::from_secs(30),
        )
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_enroll_their_role_and_jobs_skip_aggregators_on_sqlite() -> Result<()> {
    roles(Database::Sqlite).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_enroll_their_role_and_jobs_skip_aggregators_on_postgres() -> Result<()> {
    roles(Database::Postgres).await
}
