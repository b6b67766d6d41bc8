//! Central evaluation in a sandbox (issue 36, items 1 and 4), through a
//! real server on SQLite and PostgreSQL:
//! - a model whose `eval` graph expands 64 inputs to `[N, 64, 2^24]` (1 TiB
//!   at the evaluation batch) is refused at job creation, naming the
//!   bound; let through by a raised static bound, it kills only its
//!   worker (memory limit), the round is recorded failed with the bound,
//!   the server stays up, a restart does not evaluate it again, and the
//!   job's other rounds go on;
//! - a slow chain of matmul + tanh layers is cut at
//!   `limits.central_eval_timeout_ms`, and another job's evaluation queued
//!   behind it waits at most about one evaluation slot;
//! - a cancelled job's pending evaluation is not run;
//! - a round whose attempts reached `limits.central_eval_attempts` (a
//!   server killed mid-evaluation, every time) is not tried again; a
//!   server killed mid-evaluation has counted the attempt, and its
//!   orphaned worker ends on its own.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use bytes::Bytes;
use canopy_engine::optim::Optimizer;
use canopy_engine::zoo::add_classifier_training;
use canopy_ir::model::{ENTRY_INFER, PARAM_PREFIX};
use canopy_ir::{DType, Dim, Graph, Model, Parameter, Shape, TensorData, TensorType, UnaryOp};
use canopy_protocol::messages::{Task, TaskKind};
use canopy_protocol::update::encode_update;
use canopy_sdk::DeviceClient;
use serde_json::{Value, json};

use crate::support::{
    Admin, Database, Reply, TestServer, enroll_device, logreg_model_bytes, poll_task,
};

const TIMEOUT: Duration = Duration::from_secs(90);
/// The expansion: each of 64 features repeated 2^24 times.
const EXPANSION: usize = 1 << 24;

fn digits_path() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../datasets/digits/digits.csv.gz")
}

async fn put_digits(admin: &Admin, name: &str) -> Result<()> {
    let form = reqwest::multipart::Form::new().part(
        "data",
        reqwest::multipart::Part::bytes(std::fs::read(digits_path())?).file_name("data.csv.gz"),
    );
    let response = admin
        .transport
        .http()
        .put(admin.transport.url(&format!("/api/v1/datasets/{name}")))
        .bearer_auth(&admin.token)
        .multipart(form)
        .send()
        .await?;
    ensure!(
        response.status() == 201,
        "dataset upload: {}",
        response.status()
    );
    Ok(())
}

fn spec(name: &str, version_id: i64, rounds: u32, dataset: Option<&str>) -> Value {
    let mut spec = json!({
        "name": name, "model_version_id": version_id, "rounds": rounds,
        "min_devices": 1, "target_devices": 1, "over_selection": 0.0,
        "round_deadline_ms": 60_000, "local_epochs": 1, "batch_size": 8, "learning_rate": 0.1,
        "evaluation": {"fraction": 0.0},
    });
    if let Some(dataset) = dataset {
        spec["evaluation"]["central_dataset"] = json!(dataset);
    }
    spec
}

fn f32_param(name: &str, shape: Vec<usize>, scale: f32) -> Parameter {
    let count: usize = shape.iter().product();
    let values = (0..count)
        .map(|i| ((i * 7919 % 97) as f32 / 97.0 - 0.5) * scale)
        .collect();
    Parameter {
        name: name.to_string(),
        data: TensorData::f32(shape, values).expect("parameter data"),
        trainable: true,
    }
}

/// A classifier on 64 features whose `infer` is `body(x)` then a dense
/// layer to 10 classes and a softmax, with training entry points written
/// as `canopy model import` writes them for an imported ONNX classifier.
fn classifier(
    mut parameters: Vec<Parameter>,
    features: usize,
    body: impl FnOnce(
        &mut Graph,
        canopy_ir::ValueId,
        &[canopy_ir::ValueId],
    ) -> Result<canopy_ir::ValueId>,
) -> Result<Vec<u8>> {
    parameters.push(f32_param("out.w", vec![features, 10], 0.1));
    parameters.push(f32_param("out.b", vec![10], 0.0));
    let mut infer = Graph::new();
    let mut params = Vec::new();
    for parameter in &parameters {
        params.push(infer.input(
            format!("{PARAM_PREFIX}{}", parameter.name),
            parameter.data.tensor_type(),
        )?);
    }
    let x = infer.input(
        "x",
        TensorType::new(DType::F32, Shape(vec![Dim::Batch, Dim::Fixed(64)])),
    )?;
    let (out_w, out_b) = (params[params.len() - 2], params[params.len() - 1]);
    let hidden = body(&mut infer, x, &params)?;
    let logits = infer.matmul(hidden, out_w)?;
    let logits = infer.add(logits, out_b)?;
    let probabilities = infer.softmax(logits, 1)?;
    infer.set_output("probabilities", probabilities)?;
    let mut model = Model {
        parameters,
        ..Model::default()
    };
    model.metadata.producer = "canopy-server tests".to_string();
    model.entry_points.insert(ENTRY_INFER.to_string(), infer);
    add_classifier_training(&mut model, &Optimizer::sgd())?;
    Ok(canopy_ir::format::write_model(&model)?)
}

/// The repro as an IR model: x [N, 64] → [N, 64, 1] → broadcast
/// to [N, 64, 2^24] → tanh → mean over the copies → [N, 64] → dense.
/// 4 GiB per sample at each of the broadcast and the tanh.
fn expanding_model() -> Result<Vec<u8>> {
    classifier(Vec::new(), 64, |graph, x, _| {
        let column = graph.reshape(x, vec![Dim::Batch, Dim::Fixed(64), Dim::Fixed(1)])?;
        let wide = graph.broadcast(
            column,
            vec![Dim::Batch, Dim::Fixed(64), Dim::Fixed(EXPANSION)],
        )?;
        let wide = graph.unary(UnaryOp::Tanh, wide)?;
        Ok(graph.mean(wide, &[2], false)?)
    })
}

/// `layers` matmul + tanh layers of width 256 sharing one weight: a
/// small file that evaluates for a long time.
fn chain_model(layers: usize) -> Result<Vec<u8>> {
    let parameters = vec![
        f32_param("in.w", vec![64, 256], 0.05),
        f32_param("chain.w", vec![256, 256], 0.05),
    ];
    classifier(parameters, 256, |graph, x, params| {
        let (w_in, w) = (params[0], params[1]);
        let mut h = graph.matmul(x, w_in)?;
        for _ in 0..layers {
            h = graph.matmul(h, w)?;
            h = graph.unary(UnaryOp::Tanh, h)?;
        }
        Ok(h)
    })
}

/// Uploads a small deterministic update.
async fn train(device: &DeviceClient, task: &Task) -> Result<()> {
    ensure!(
        task.kind == TaskKind::Train,
        "expected training, got {task:?}"
    );
    device.download_model(task).await?;
    let values: Vec<f32> = (0..task.layout.num_elements())
        .map(|i| ((i as i64 * 37 + i64::from(task.round_number) * 5) % 19 - 9) as f32 * 1e-3)
        .collect();
    let encoded = encode_update(&task.layout, 20, &values)?;
    device.upload_update(task, Bytes::from(encoded)).await?;
    Ok(())
}

/// The device trains the next task it is handed; returns the round's id.
async fn run_round(device: &DeviceClient) -> Result<i64> {
    let task = poll_task(device).await?;
    train(device, &task).await?;
    Ok(task.round_id)
}

async fn round(admin: &Admin, id: i64) -> Result<Value> {
    admin.ok(&format!("/api/v1/rounds/{id}")).await
}

/// Waits until the round's central evaluation has left `pending` (and the
/// round has succeeded); returns the round.
async fn wait_central(admin: &Admin, id: i64, timeout: Duration) -> Result<Value> {
    let deadline = Instant::now() + timeout;
    loop {
        let round = round(admin, id).await?;
        let state = round["metrics"]["central_eval_state"]
            .as_str()
            .unwrap_or_default();
        if round["state"] == "succeeded" && matches!(state, "done" | "failed") {
            return Ok(round);
        }
        ensure!(
            Instant::now() < deadline,
            "round {id}'s central evaluation is still `{state}` after {timeout:?}: {round}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until the round has succeeded and its evaluation is pending.
async fn wait_pending(admin: &Admin, id: i64) -> Result<()> {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let round = round(admin, id).await?;
        if round["state"] == "succeeded" {
            ensure!(
                round["metrics"]["central_eval_state"] == "pending",
                "{round}"
            );
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "the round never succeeded: {round}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn reason(round: &Value) -> String {
    round["metrics"]["central_eval_error"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

fn config_file(dir: &Path, limits: &str) -> Result<String> {
    let path = dir.join("canopy.toml");
    std::fs::write(&path, format!("[limits]\n{limits}"))?;
    Ok(path.to_string_lossy().into_owned())
}

/// One enrolled device.
async fn device(server: &TestServer) -> Result<DeviceClient> {
    let token = server.admin().enrollment_token(1).await?;
    enroll_device(server, &token).await
}

/// Item 1 (a): at the default bounds the model is refused at job creation,
/// 422 naming the bound and its setting; without a central dataset it is
/// an ordinary job.
async fn the_expanding_model_is_refused_at_job_creation(database: Database) -> Result<()> {
    let server = TestServer::start(database)?;
    let admin = server.admin();
    put_digits(&admin, "digits").await?;
    let version = admin.upload_model("expanding", expanding_model()?).await?;
    let version_id = version["id"].as_i64().unwrap_or_default();
    let refused = admin
        .post(
            "/api/v1/jobs",
            spec("expanding", version_id, 1, Some("digits")),
        )
        .await?;
    let message = refused.body["error"]["message"]
        .as_str()
        .or(refused.body["message"].as_str())
        .map(str::to_string)
        .unwrap_or_else(|| refused.body.to_string());
    println!("job creation answered {}: {message}", refused.status);
    ensure!(
        refused.status == 422,
        "answered {}: {}",
        refused.status,
        refused.body
    );
    ensure!(
        message.contains("limits.central_eval_memory_bytes") && message.contains("at batch 1"),
        "{message}"
    );
    let Reply { status, body } = admin
        .post(
            "/api/v1/jobs",
            spec("expanding-no-central", version_id, 1, None),
        )
        .await?;
    ensure!(status == 201, "without a central dataset: {status} {body}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_expanding_model_is_refused_at_job_creation_on_sqlite() -> Result<()> {
    the_expanding_model_is_refused_at_job_creation(Database::Sqlite).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_expanding_model_is_refused_at_job_creation_on_postgres() -> Result<()> {
    the_expanding_model_is_refused_at_job_creation(Database::Postgres).await
}

/// Item 1 (b): let through by a raised static bound, the 1 TiB evaluation
/// dies in its worker, under a 512 MiB memory limit.
async fn the_expanding_model_kills_only_its_worker(database: Database) -> Result<()> {
    let work = tempfile::tempdir()?;
    let config = config_file(
        work.path(),
        "central_eval_memory_bytes = 4398046511104\n\
         central_eval_flops = 1000000000000000000\n\
         central_eval_worker_memory_bytes = 536870912\n",
    )?;
    let mut server = TestServer::start_with(database, &["--config", &config])?;
    let admin = server.admin();
    put_digits(&admin, "digits").await?;
    let version = admin.upload_model("expanding", expanding_model()?).await?;
    let version_id = version["id"].as_i64().unwrap_or_default();
    let device = device(&server).await?;
    let job = admin
        .create_job(spec("expanding", version_id, 2, Some("digits")))
        .await?;
    let pid = server.pid();
    let first = run_round(&device).await?;
    let evaluated = wait_central(&admin, first, TIMEOUT).await?;
    let why = reason(&evaluated);
    println!("round {first}: {why}");
    ensure!(
        evaluated["metrics"]["central_eval_state"] == "failed",
        "{evaluated}"
    );
    ensure!(
        why.contains("memory") && why.contains("limits.central_eval_worker_memory_bytes"),
        "{why}"
    );
    ensure!(server.pid() == pid, "the server process changed");
    let health = admin.get("/healthz").await?;
    ensure!(health.status == 200, "healthz answered {}", health.status);

    // The job's other round goes on, and the job finishes.
    let second = run_round(&device).await?;
    let finished = admin.wait_for_job(job, TIMEOUT).await?;
    ensure!(finished["state"] == "completed", "{finished}");
    let second = wait_central(&admin, second, TIMEOUT).await?;
    ensure!(
        second["metrics"]["central_eval_state"] == "failed",
        "{second}"
    );

    // A restart does not evaluate the failed rounds again.
    let log_before = server.log().len();
    server.restart()?;
    let admin = server.admin();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = round(&admin, first).await?;
    ensure!(
        reason(&after) == why,
        "the round changed after a restart: {after}"
    );
    let log = server.log();
    let since_restart = &log[log_before.min(log.len())..];
    ensure!(
        !since_restart.contains("central evaluation started"),
        "the restarted server evaluated again:\n{since_restart}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_expanding_model_kills_only_its_worker_on_sqlite() -> Result<()> {
    the_expanding_model_kills_only_its_worker(Database::Sqlite).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_expanding_model_kills_only_its_worker_on_postgres() -> Result<()> {
    the_expanding_model_kills_only_its_worker(Database::Postgres).await
}

const TIMEOUT_MS: u64 = 3_000;
/// What one evaluation slot may take beyond the timeout: starting a
/// worker, a tick, and the tiny model's own evaluation.
const SLOT_SLACK: Duration = Duration::from_secs(4);

/// Item 4: a slow job's evaluations are cut at the timeout, and another
/// job's evaluation, queued behind four of them, waits about one slot.
async fn a_slow_evaluation_is_cut_and_does_not_hold_other_jobs(database: Database) -> Result<()> {
    let work = tempfile::tempdir()?;
    let config = config_file(
        work.path(),
        &format!(
            "central_eval_timeout_ms = {TIMEOUT_MS}\ncentral_eval_flops = 1000000000000000000\n"
        ),
    )?;
    let server = TestServer::start_with(database, &["--config", &config])?;
    let admin = server.admin();
    put_digits(&admin, "digits").await?;
    let slow = admin.upload_model("chain", chain_model(1500)?).await?;
    let tiny = admin.upload_model("logreg", logreg_model_bytes(3)).await?;
    let device = device(&server).await?;
    let slow_job = admin
        .create_job(spec(
            "slow",
            slow["id"].as_i64().unwrap_or_default(),
            5,
            Some("digits"),
        ))
        .await?;
    let mut slow_rounds = Vec::new();
    for _ in 0..5 {
        slow_rounds.push(run_round(&device).await?);
    }
    let tiny_job = admin
        .create_job(spec(
            "tiny",
            tiny["id"].as_i64().unwrap_or_default(),
            1,
            Some("digits"),
        ))
        .await?;
    let tiny_round = run_round(&device).await?;
    wait_pending(&admin, tiny_round).await?;
    let queued = Instant::now();
    let evaluated = wait_central(&admin, tiny_round, TIMEOUT).await?;
    let waited = queued.elapsed();
    println!(
        "the tiny job's evaluation waited {:.2} s behind the slow job's (timeout {} s)",
        waited.as_secs_f64(),
        TIMEOUT_MS / 1000
    );
    ensure!(
        evaluated["metrics"]["central_eval_state"] == "done",
        "{evaluated}"
    );
    ensure!(
        waited <= Duration::from_millis(TIMEOUT_MS) + SLOT_SLACK,
        "the tiny job waited {waited:?}, more than one evaluation slot"
    );
    let first = wait_central(&admin, slow_rounds[0], TIMEOUT).await?;
    let why = reason(&first);
    println!("slow round: {why}");
    ensure!(
        first["metrics"]["central_eval_state"] == "failed",
        "{first}"
    );
    ensure!(
        why.contains("limits.central_eval_timeout_ms") && why.contains("3 s"),
        "{why}"
    );
    for job in [slow_job, tiny_job] {
        let finished = admin.wait_for_job(job, TIMEOUT).await?;
        ensure!(finished["state"] == "completed", "{finished}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_evaluation_is_cut_and_does_not_hold_other_jobs_on_sqlite() -> Result<()> {
    a_slow_evaluation_is_cut_and_does_not_hold_other_jobs(Database::Sqlite).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_evaluation_is_cut_and_does_not_hold_other_jobs_on_postgres() -> Result<()> {
    a_slow_evaluation_is_cut_and_does_not_hold_other_jobs(Database::Postgres).await
}

/// A job whose round succeeded under a tick too slow to evaluate it, then
/// the server is killed with the round pending. Returns the server, the
/// job, the round and the config file to rewrite before restarting.
async fn pending_round(
    database: Database,
    work: &Path,
    limits: &str,
) -> Result<(TestServer, DeviceClient, i64, i64, String)> {
    let config = config_file(work, &format!("orchestrator_tick_ms = 600000\n{limits}"))?;
    let server = TestServer::start_with(database, &["--config", &config])?;
    let admin = server.admin();
    put_digits(&admin, "digits").await?;
    let version = admin.upload_model("logreg", logreg_model_bytes(7)).await?;
    let device = device(&server).await?;
    let job = admin
        .create_job(spec(
            "pending",
            version["id"].as_i64().unwrap_or_default(),
            1,
            Some("digits"),
        ))
        .await?;
    let round_id = run_round(&device).await?;
    wait_pending(&admin, round_id).await?;
    Ok((server, device, job, round_id, config))
}

/// A cancelled job's pending evaluation is not run: it is recorded as
/// failed, saying why.
async fn a_cancelled_jobs_evaluation_is_not_run(database: Database) -> Result<()> {
    let work = tempfile::tempdir()?;
    let (mut server, _device, job, round_id, config) =
        pending_round(database, work.path(), "").await?;
    let cancelled = server
        .admin()
        .post(&format!("/api/v1/jobs/{job}/cancel"), json!({}))
        .await?;
    ensure!(cancelled.status == 200, "{}", cancelled.body);
    server.kill9();
    std::fs::write(&config, "[limits]\norchestrator_tick_ms = 100\n")?;
    server.restart()?;
    let admin = server.admin();
    let round = wait_central(&admin, round_id, TIMEOUT).await?;
    let why = reason(&round);
    println!("cancelled job's round: {why}");
    ensure!(
        round["metrics"]["central_eval_state"] == "failed",
        "{round}"
    );
    ensure!(why.contains("cancelled"), "{why}");
    let log = server.log();
    ensure!(
        !log.contains("central evaluation started") && !log.contains("central evaluation stored"),
        "the cancelled job's round was evaluated"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_jobs_evaluation_is_not_run_on_sqlite() -> Result<()> {
    a_cancelled_jobs_evaluation_is_not_run(Database::Sqlite).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_jobs_evaluation_is_not_run_on_postgres() -> Result<()> {
    a_cancelled_jobs_evaluation_is_not_run(Database::Postgres).await
}

async fn execute(server: &TestServer, statement: &'static str, round_id: i64) -> Result<()> {
    match server.database {
        Database::Sqlite => {
            let pool = sqlx::sqlite::SqlitePoolOptions::new()
                .max_connections(1)
                .connect(&server.database_url)
                .await?;
            sqlx::query(statement).bind(round_id).execute(&pool).await?;
            pool.close().await;
        }
        Database::Postgres => {
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(1)
                .connect(&server.database_url)
                .await?;
            sqlx::query(statement).bind(round_id).execute(&pool).await?;
            pool.close().await;
        }
    }
    Ok(())
}

async fn attempts(server: &TestServer, round_id: i64) -> Result<i64> {
    let statement = "SELECT central_eval_attempts FROM rounds WHERE id = $1";
    Ok(match server.database {
        Database::Sqlite => {
            let pool = sqlx::sqlite::SqlitePoolOptions::new()
                .max_connections(1)
                .connect(&server.database_url)
                .await?;
            let count = sqlx::query_scalar(statement)
                .bind(round_id)
                .fetch_one(&pool)
                .await?;
            pool.close().await;
            count
        }
        Database::Postgres => {
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(1)
                .connect(&server.database_url)
                .await?;
            let count = sqlx::query_scalar(statement)
                .bind(round_id)
                .fetch_one(&pool)
                .await?;
            pool.close().await;
            count
        }
    })
}

/// A round whose every attempt died with its server (here: the count set
/// to the limit while the server is down) is recorded failed, naming the
/// count, and no worker starts; an ordinary evaluation counts one attempt.
async fn an_attempt_count_at_the_limit_is_not_retried(database: Database) -> Result<()> {
    let work = tempfile::tempdir()?;
    let (mut server, device, _job, round_id, config) =
        pending_round(database, work.path(), "central_eval_attempts = 2\n").await?;
    server.kill9();
    execute(
        &server,
        "UPDATE rounds SET central_eval_attempts = 2 WHERE id = $1",
        round_id,
    )
    .await?;
    std::fs::write(
        &config,
        "[limits]\norchestrator_tick_ms = 100\ncentral_eval_attempts = 2\n",
    )?;
    server.restart()?;
    let admin = server.admin();
    let round = wait_central(&admin, round_id, TIMEOUT).await?;
    let why = reason(&round);
    println!("round at its attempt limit: {why}");
    ensure!(
        round["metrics"]["central_eval_state"] == "failed",
        "{round}"
    );
    ensure!(
        why.contains("2 times") && why.contains("limits.central_eval_attempts"),
        "{why}"
    );
    ensure!(
        !server.log().contains("central evaluation started"),
        "a worker started for a round at its attempt limit"
    );
    ensure!(attempts(&server, round_id).await? == 2, "the count moved");

    // An ordinary evaluation commits its attempt before its worker starts.
    let version = admin.upload_model("logreg2", logreg_model_bytes(8)).await?;
    let job = admin
        .create_job(spec(
            "counted",
            version["id"].as_i64().unwrap_or_default(),
            1,
            Some("digits"),
        ))
        .await?;
    let counted = run_round(&device).await?;
    let done = wait_central(&admin, counted, TIMEOUT).await?;
    ensure!(done["metrics"]["central_eval_state"] == "done", "{done}");
    ensure!(attempts(&server, counted).await? == 1, "one attempt");
    let finished = admin.wait_for_job(job, TIMEOUT).await?;
    ensure!(finished["state"] == "completed", "{finished}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_count_at_the_limit_is_not_retried_on_sqlite() -> Result<()> {
    an_attempt_count_at_the_limit_is_not_retried(Database::Sqlite).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_count_at_the_limit_is_not_retried_on_postgres() -> Result<()> {
    an_attempt_count_at_the_limit_is_not_retried(Database::Postgres).await
}

/// Processes whose command line mentions `needle` (the worker's staged
/// paths lie under its server's data directory).
fn workers_of(needle: &str) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|entry| {
            let entry = entry.ok()?;
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let cmdline = std::fs::read(entry.path().join("cmdline")).ok()?;
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            (cmdline.contains("central-worker") && cmdline.contains(needle)).then_some(pid)
        })
        .collect()
}

/// A server killed mid-evaluation: the attempt was already counted, and
/// its worker, orphaned, ends on its own.
async fn a_server_killed_mid_evaluation_counted_the_attempt(database: Database) -> Result<()> {
    let work = tempfile::tempdir()?;
    let config = config_file(
        work.path(),
        "central_eval_timeout_ms = 60000\ncentral_eval_flops = 1000000000000000000\n",
    )?;
    let mut server = TestServer::start_with(database, &["--config", &config])?;
    let admin = server.admin();
    put_digits(&admin, "digits").await?;
    // Evaluates for well over ten seconds.
    let slow = admin.upload_model("chain", chain_model(8000)?).await?;
    let device = device(&server).await?;
    admin
        .create_job(spec(
            "killed",
            slow["id"].as_i64().unwrap_or_default(),
            1,
            Some("digits"),
        ))
        .await?;
    let round_id = run_round(&device).await?;
    let needle = server.data_dir.path().display().to_string();
    let deadline = Instant::now() + TIMEOUT;
    while workers_of(&needle).is_empty() {
        ensure!(
            Instant::now() < deadline,
            "no worker started:\n{}",
            server.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    server.kill9();
    let killed = Instant::now();
    while !workers_of(&needle).is_empty() {
        ensure!(
            killed.elapsed() < Duration::from_secs(2),
            "the orphaned worker still runs 2 s after its server died"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!(
        "the orphaned worker ended {:.2} s after its server",
        killed.elapsed().as_secs_f64()
    );
    ensure!(
        attempts(&server, round_id).await? == 1,
        "the attempt was not counted"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_mid_evaluation_counted_the_attempt_on_sqlite() -> Result<()> {
    a_server_killed_mid_evaluation_counted_the_attempt(Database::Sqlite).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_mid_evaluation_counted_the_attempt_on_postgres() -> Result<()> {
    a_server_killed_mid_evaluation_counted_the_attempt(Database::Postgres).await
}
