//! Job control, selection and device filters.

use std::time::Duration;

use anyhow::{Result, ensure};
use bytes::Bytes;
use canopy_protocol::update::encode_update;
use serde_json::{Value, json};

use crate::support;
use crate::support::{Database, TestServer, enroll_device, logreg_model_bytes};

fn spec(version: &Value, min: u32, target: u32, over_selection: f64, filters: Value) -> Value {
    json!({
        "name": "control", "model_version_id": version["id"], "rounds": 1, "min_devices": min,
        "target_devices": target, "over_selection": over_selection, "evaluation": {"fraction": 0.0}, "round_deadline_ms": 60_000,
        "local_epochs": 1, "batch_size": 8, "learning_rate": 0.1, "filters": filters,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_pause_resume_cancel() -> Result<()> {
    let server = TestServer::start(Database::Sqlite)?;
    let admin = server.admin();
    let version = admin.upload_model("logreg", logreg_model_bytes(2)).await?;
    let token = admin.enrollment_token(1).await?;
    let device = enroll_device(&server, &token).await?;
    let created = admin
        .post("/api/v1/jobs", spec(&version, 1, 1, 0.0, json!({})))
        .await?;
    assert_eq!(created.status, 201, "{}", created.body);
    let id = created.body["id"].as_i64().unwrap_or_default();
    let act = |verb: &'static str| {
        let admin = &admin;
        async move {
            admin
                .post(&format!("/api/v1/jobs/{id}/{verb}"), json!({}))
                .await
        }
    };
    let refused = act("pause").await?;
    assert_eq!(refused.status, 409, "a created job cannot be paused");
    assert!(
        refused.body["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("it is created")
    );
    assert_eq!(act("start").await?.body["state"], "running");
    assert_eq!(act("start").await?.status, 409, "already running");
    assert_eq!(act("pause").await?.body["state"], "paused");
    assert!(
        device.next_task(1_000).await?.is_none(),
        "a paused job selects no devices"
    );
    assert_eq!(act("resume").await?.body["state"], "running");
    let task = loop {
        if let Some(task) = device.next_task(2_000).await? {
            break task;
        }
    };
    assert_eq!(act("cancel").await?.body["state"], "cancelled");
    assert_eq!(act("cancel").await?.status, 409);
    let round = admin
        .ok(&format!("/api/v1/rounds/{}", task.round_id))
        .await?;
    assert_eq!(round["state"], "failed");
    assert!(
        round["status_message"]
            .as_str()
            .unwrap_or_default()
            .contains("cancelled")
    );
    assert_eq!(round["failure"]["kind"], "cancelled", "{round}");
    assert_eq!(round["failure"]["message"], round["status_message"]);
    let update = encode_update(&task.layout, 5, &vec![0.0; task.layout.num_elements()])?;
    let status = device
        .upload_update(&task, Bytes::from(update))
        .await
        .err()
        .and_then(|e| e.status());
    assert_eq!(
        status,
        Some(410),
        "uploads to a cancelled job's round are gone"
    );
    assert_eq!(
        admin
            .post("/api/v1/jobs/999/start", json!({}))
            .await?
            .status,
        404
    );
    Ok(())
}

/// Over-selection picks extra devices; the round closes at the target and
/// the extra device's upload is late (410). Filters keep other devices out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_selection_and_filters() -> Result<()> {
    let server = TestServer::start(Database::Sqlite)?;
    let admin = server.admin();
    let version = admin.upload_model("logreg", logreg_model_bytes(4)).await?;
    let token = admin.enrollment_token(4).await?;
    let mut devices = Vec::new();
    for _ in 0..4 {
        devices.push(enroll_device(&server, &token).await?);
    }
    let outsider = devices.pop().expect("four devices");
    for device in &devices {
        let tagged = admin
            .send(
                reqwest::Method::PUT,
                &format!("/api/v1/devices/{}/tags", device.device_id),
                Some(json!({"tags": {"site": "lab"}})),
            )
            .await?;
        assert_eq!(tagged.status, 200, "{}", tagged.body);
        assert_eq!(tagged.body["tags"]["site"], "lab");
    }
    let filters = json!({"tier": "edge", "backends": ["cpu"], "tags": {"site": "lab"}});
    let job = admin.create_job(spec(&version, 2, 2, 0.5, filters)).await?;
    let mut tasks = Vec::new();
    for device in &devices {
        let task = device.next_task(10_000).await?;
        ensure!(
            task.is_some(),
            "device {} was not selected",
            device.device_id
        );
        tasks.push(task.unwrap_or_else(|| unreachable!()));
    }
    assert!(
        outsider.next_task(500).await?.is_none(),
        "an untagged device is filtered out"
    );
    for (device, task) in devices.iter().zip(&tasks).take(2) {
        let update = encode_update(&task.layout, 3, &vec![0.01; task.layout.num_elements()])?;
        device.upload_update(task, Bytes::from(update)).await?;
    }
    let finished = admin.wait_for_job(job, Duration::from_secs(60)).await?;
    assert_eq!(finished["state"], "completed");
    let late = encode_update(
        &tasks[2].layout,
        3,
        &vec![0.01; tasks[2].layout.num_elements()],
    )?;
    let status = devices[2]
        .upload_update(&tasks[2], Bytes::from(late))
        .await
        .err()
        .and_then(|e| e.status());
    assert_eq!(
        status,
        Some(410),
        "the over-selected device's upload is late"
    );
    let round = admin
        .ok(&format!("/api/v1/rounds/{}", tasks[0].round_id))
        .await?;
    assert_eq!(round["selected"], 3, "target 2 with 50% over-selection");
    assert_eq!(round["metrics"]["dropouts"], 1);
    let rejected = admin
        .post("/api/v1/jobs", spec(&version, 3, 2, 0.0, json!({})))
        .await?;
    assert_eq!(rejected.status, 422, "target below min: {}", rejected.body);
    assert!(
        rejected.body["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("target_devices")
    );
    Ok(())
}

/// Posts each job and checks it is refused (422) with `wanted` in its
/// message.
async fn each_is_refused(admin: &support::Admin, cases: Vec<(Value, &str)>) -> Result<()> {
    for (body, wanted) in cases {
        let refused = admin.post("/api/v1/jobs", body).await?;
        let message = refused.body["error"]["message"]
            .as_str()
            .unwrap_or_default();
        ensure!(refused.status == 422, "{}", refused.body);
        ensure!(message.contains(wanted), "wanted {wanted:?} in: {message}");
    }
    Ok(())
}

/// Asynchronous settings that cannot work are refused, each naming the
/// setting and why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_asynchronous_settings_are_refused() -> Result<()> {
    let server = TestServer::start(Database::Sqlite)?;
    let admin = server.admin();
    let version = admin.upload_model("logreg", logreg_model_bytes(3)).await?;
    let with = |target: u32, asynchronous: Value, extra: Value| {
        let mut body = spec(&version, 1, target, 0.0, json!({}));
        body["asynchronous"] = asynchronous;
        for (key, value) in extra.as_object().cloned().unwrap_or_default() {
            body[key] = value;
        }
        body
    };
    let cases = vec![
        (
            with(30, json!({"concurrency": 20}), json!({})),
            "`target_devices` (the buffer size K, 30) is above `asynchronous.concurrency` (20)",
        ),
        (
            with(2, json!({"concurrency": 20, "max_staleness": 0}), json!({})),
            "`asynchronous.max_staleness` must be at least 1, got 0",
        ),
        (
            with(2, json!({"concurrency": 0}), json!({})),
            "`asynchronous.concurrency` must be between 1 and",
        ),
        (
            with(
                2,
                json!({"concurrency": 4, "staleness_exponent": 9.0}),
                json!({}),
            ),
            "`asynchronous.staleness_exponent` must be between 0 and 4",
        ),
        (
            with(
                2,
                json!({"concurrency": 4}),
                json!({"secure_aggregation": {"enabled": true}}),
            ),
            "`asynchronous` cannot be combined with `secure_aggregation`",
        ),
        (
            with(2, json!({"concurrency": 4, "buffer": 3}), json!({})),
            "unknown field `buffer`",
        ),
    ];
    each_is_refused(&admin, cases).await?;
    let accepted = admin
        .post(
            "/api/v1/jobs",
            with(2, json!({"concurrency": 4}), json!({})),
        )
        .await?;
    assert_eq!(accepted.status, 201, "{}", accepted.body);
    assert_eq!(accepted.body["spec"]["asynchronous"]["max_staleness"], 20);
    assert_eq!(
        accepted.body["spec"]["asynchronous"]["staleness_exponent"],
        0.5
    );
    Ok(())
}

/// Edge settings that make versions of their own are bounded and named
/// like the job's: `edges.rounds`, `edges.asynchronous.*`, and their
/// refusal with secure aggregation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_edge_version_settings_are_refused() -> Result<()> {
    let server = TestServer::start(Database::Sqlite)?;
    let admin = server.admin();
    let version = admin.upload_model("logreg", logreg_model_bytes(3)).await?;
    let with = |edges: Value, extra: Value| {
        let mut body = spec(&version, 1, 2, 0.0, json!({}));
        body["edges"] = json!({"min_devices": 2, "target_devices": 4});
        for (key, value) in edges.as_object().cloned().unwrap_or_default() {
            body["edges"][key] = value;
        }
        for (key, value) in extra.as_object().cloned().unwrap_or_default() {
            body[key] = value;
        }
        body
    };
    let cases = vec![
        (
            with(json!({"rounds": 0}), json!({})),
            "`edges.rounds` must be between 1 and 1000",
        ),
        (
            with(json!({"rounds": 1001}), json!({})),
            "`edges.rounds` must be between 1 and 1000",
        ),
        (
            with(json!({"asynchronous": {"concurrency": 3}}), json!({})),
            "`edges.target_devices` (the buffer size K, 4) is above \
             `edges.asynchronous.concurrency` (3)",
        ),
        (
            with(
                json!({"asynchronous": {"concurrency": 8, "max_staleness": 0}}),
                json!({}),
            ),
            "`edges.asynchronous.max_staleness` must be at least 1, got 0",
        ),
        (
            with(
                json!({"asynchronous": {"concurrency": 8, "staleness_exponent": -1.0}}),
                json!({}),
            ),
            "`edges.asynchronous.staleness_exponent` must be between 0 and 4",
        ),
        (
            with(
                json!({"rounds": 2, "min_devices": 3}),
                json!({"secure_aggregation": {"enabled": true}, "min_devices": 3,
                       "target_devices": 3}),
            ),
            "`edges.rounds` above 1 and `edges.asynchronous` cannot be combined with \
             `secure_aggregation`",
        ),
    ];
    each_is_refused(&admin, cases).await?;
    let accepted = admin
        .post(
            "/api/v1/jobs",
            with(
                json!({"rounds": 3, "asynchronous": {"concurrency": 8}}),
                json!({}),
            ),
        )
        .await?;
    assert_eq!(accepted.status, 201, "{}", accepted.body);
    let edges = &accepted.body["spec"]["edges"];
    assert_eq!(edges["rounds"], 3, "{edges}");
    assert_eq!(edges["asynchronous"]["max_staleness"], 20, "{edges}");
    Ok(())
}

/// A model devices cannot train is stored, but a job on it is refused with
/// the reason found when it was uploaded, not a guess.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn untrainable_models_say_why() -> Result<()> {
    let server = TestServer::start(Database::Sqlite)?;
    let admin = server.admin();
    let trainable = canopy_ir::format::read_model(&logreg_model_bytes(5))?;
    let mut no_step = trainable.clone();
    no_step
        .entry_points
        .remove(canopy_ir::model::ENTRY_TRAIN_STEP);
    let mut frozen = trainable;
    for parameter in &mut frozen.parameters {
        parameter.trainable = false;
    }
    let cases = [
        ("no-step", no_step, "no `train_step` entry point"),
        ("frozen", frozen, "no trainable parameters"),
    ];
    for (name, model, reason) in cases {
        let version = admin
            .upload_model(name, canopy_ir::format::write_model(&model)?)
            .await?;
        assert_eq!(version["trainable"], false, "{version}");
        let stored = version["untrainable_reason"].as_str().unwrap_or_default();
        ensure!(stored.contains(reason), "{name}: stored reason `{stored}`");
        let refused = admin
            .post("/api/v1/jobs", spec(&version, 1, 1, 0.0, json!({})))
            .await?;
        assert_eq!(refused.status, 422, "{}", refused.body);
        let message = refused.body["error"]["message"]
            .as_str()
            .unwrap_or_default();
        ensure!(
            message.contains(reason) && message.contains(&format!("model `{name}` version 1")),
            "{name}: {message}"
        );
    }
    let fetched = admin.ok("/api/v1/models/frozen/versions/1").await?;
    ensure!(
        fetched["untrainable_reason"]
            .as_str()
            .is_some_and(|stored| stored.contains("no trainable parameters")),
        "the reason is kept with the version: {fetched}"
    );
    Ok(())
}
