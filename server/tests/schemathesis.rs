//! Schemathesis against the admin API: every operation of
//! `/api/v1/openapi.json`, with an admin token, on SQLite and PostgreSQL,
//! in every phase (examples, coverage, fuzzing, stateful). Fails on any 5xx, any response that breaks the document (status code,
//! content type, headers, body schema), and any request the server answers
//! against the document (schema-invalid data accepted, schema-valid data
//! rejected, auth ignored, resources that vanish or outlive deletion).
//! Which checks run where is in `schemathesis.toml` next to this file.
//!
//! Needs Schemathesis: `pip install -r requirements-dev.txt`.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::json;

use crate::support::{Database, TestServer, enroll_device, logreg_model_bytes};

/// Test cases per operation and phase; with the coverage phase's own cases
/// this takes about half a minute per database on a 2-core machine.
/// `CANOPY_SCHEMATHESIS_MAX_EXAMPLES` overrides it for a deeper local run.
const MAX_EXAMPLES: u32 = 50;
const MAX_EXAMPLES_VAR: &str = "CANOPY_SCHEMATHESIS_MAX_EXAMPLES";
const SCHEMATHESIS_TIMEOUT: Duration = Duration::from_secs(600);
const INSTALL_HINT: &str = "hint: pip install -r requirements-dev.txt";
/// Every phase Schemathesis has, asked for by name: a phase that did not
/// run (the stateful one finds no links, say) fails the test.
const PHASES: [&str; 4] = ["Examples", "Coverage", "Fuzzing", "Stateful"];

/// The interpreter `.ci/run` installs `requirements-dev.txt` into.
fn python() -> String {
    std::env::var("CANOPY_PYTHON").unwrap_or_else(|_| "python3".to_string())
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the server crate lives in the workspace")
        .to_path_buf()
}

/// `python3 -m schemathesis.cli`: the interpreter `.ci/run` installs it
/// with, whether or not pip's script directory is on `PATH`.
fn schemathesis() -> tokio::process::Command {
    let mut command = tokio::process::Command::new(python());
    command.args(["-m", "schemathesis.cli"]);
    command
}

async fn check_installed() -> Result<()> {
    let output = schemathesis()
        .arg("--version")
        .output()
        .await
        .with_context(|| format!("cannot run `{}`; {INSTALL_HINT}", python()))?;
    if !output.status.success() {
        bail!(
            "Schemathesis is not installed for `{}`: {}\n{INSTALL_HINT}",
            python(),
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(())
}

/// Gives the run something to find behind every id route: model version 1,
/// device 1, job 1 (running, so round 1 exists) and job 2 (created).
async fn seed(server: &TestServer) -> Result<()> {
    let admin = server.admin();
    admin
        .upload_model("seed", logreg_model_bytes(1))
        .await
        .context("seeding model `seed`")?;
    let token = admin.enrollment_token(1).await?;
    enroll_device(server, &token)
        .await
        .context("seeding a device")?;
    let spec = json!({
        "name": "seed", "model_version_id": 1, "rounds": 2, "min_devices": 1,
        "target_devices": 1, "round_deadline_ms": 600_000, "local_epochs": 1,
        "batch_size": 8, "learning_rate": 0.1,
    });
    admin
        .create_job(spec.clone())
        .await
        .context("seeding job 1")?;
    let created = admin.post("/api/v1/jobs", spec).await?;
    if created.status != 201 {
        bail!(
            "seeding job 2 answered {}: {}",
            created.status,
            created.body
        );
    }
    Ok(())
}

fn operation_count(document: &serde_json::Value) -> usize {
    document["paths"]
        .as_object()
        .map(|paths| {
            paths
                .values()
                .filter_map(|item| item.as_object())
                .map(|item| {
                    item.keys()
                        .filter(|key| {
                            matches!(
                                key.as_str(),
                                "get" | "put" | "post" | "delete" | "patch" | "head" | "options"
                            )
                        })
                        .count()
                })
                .sum()
        })
        .unwrap_or(0)
}

async fn run_schemathesis(database: Database) -> Result<()> {
    check_installed().await?;
    let work = tempfile::tempdir()?;
    // The default of 120 credential requests a minute would answer most of
    // the run's token creations with 429 (documented, so green, but the 201
    // path would go untested); the limiter has its own test in operations.rs.
    let config = work.path().join("canopy.toml");
    std::fs::write(
        &config,
        "[limits]\nsensitive_requests_per_minute = 1000000\n",
    )?;
    let config = config.to_string_lossy().into_owned();
    let server = TestServer::start_with(database, &["--config", &config])?;
    seed(&server).await?;
    let document = server.admin().ok("/api/v1/openapi.json").await?;
    let operations = operation_count(&document);
    if operations == 0 {
        bail!("/api/v1/openapi.json lists no operations");
    }

    let max_examples = match std::env::var(MAX_EXAMPLES_VAR) {
        Ok(text) => text
            .parse::<u32>()
            .ok()
            .filter(|n| *n > 0)
            .with_context(|| format!("{MAX_EXAMPLES_VAR} `{text}` is not a positive integer"))?,
        Err(_) => MAX_EXAMPLES,
    };
    let started = Instant::now();
    let mut command = schemathesis();
    command
        .arg("--config-file")
        .arg(repo_root().join("server/tests/schemathesis.toml"))
        .arg("--no-color")
        .arg("run")
        .arg(format!("{}/api/v1/openapi.json", server.base))
        .args([
            "--header",
            &format!("Authorization: Bearer {}", server.admin_token),
        ])
        // The harness's certificate is self-signed.
        .args(["--tls-verify", "false"])
        .args(["--max-examples", &max_examples.to_string()])
        .args(["--phases", &PHASES.join(",").to_lowercase()])
        .args(["--request-timeout", "30"])
        // `.hypothesis/` and `.schemathesis/` land here, not in the repo.
        .current_dir(work.path())
        .stdin(Stdio::null())
        .kill_on_drop(true);
    let output = tokio::time::timeout(SCHEMATHESIS_TIMEOUT, command.output())
        .await
        .with_context(|| {
            format!("Schemathesis ({database:?}) did not finish within {SCHEMATHESIS_TIMEOUT:?}")
        })?
        .context("cannot run Schemathesis")?;
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    // Shown with `--nocapture`: the warnings tell where the run is thin.
    eprintln!(
        "{report}\nSchemathesis on {database:?} took {:.1} s",
        started.elapsed().as_secs_f64()
    );
    if !output.status.success() {
        // The server's warnings and errors, which name the cause of a 5xx.
        let log = server.log();
        let mut problems: Vec<&str> = log
            .lines()
            .filter(|line| {
                line.contains("\"level\":\"WARN\"") || line.contains("\"level\":\"ERROR\"")
            })
            .collect();
        problems.drain(..problems.len().saturating_sub(40));
        bail!(
            "Schemathesis found problems in the admin API on {database:?} ({}):\n{report}\n\
             the server's last warnings and errors:\n{}",
            output.status,
            problems.join("\n")
        );
    }
    // Guards against a filter or a schema change that silently drops
    // operations, and against a phase that was skipped.
    let phases = PHASES.iter().map(|phase| format!("✅ {phase}"));
    for expected in [
        format!("Selected: {operations}/{operations}"),
        format!("Tested: {operations}"),
    ]
    .into_iter()
    .chain(phases)
    {
        if !report.contains(&expected) {
            bail!(
                "Schemathesis on {database:?} did not test all {operations} operations in every phase (no `{expected}`):\n{report}"
            );
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn admin_api_matches_its_openapi_document_on_sqlite() -> Result<()> {
    run_schemathesis(Database::Sqlite).await
}

#[tokio::test(flavor = "multi_thread")]
async fn admin_api_matches_its_openapi_document_on_postgres() -> Result<()> {
    run_schemathesis(Database::Postgres).await
}
