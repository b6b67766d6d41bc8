//! What the binding tests share: the cdylib cargo built for them, the
//! bindings generated from it, and a real server with a one-round job.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use canopy_bindgen::Language;
use serde_json::json;

#[path = "../../../server/tests/support/mod.rs"]
pub mod support;

use support::{Database, TestServer};

/// `target/<profile>`, where cargo put the binaries and the cdylib.
pub fn target_dir() -> PathBuf {
    support::sibling_binary("x")
        .parent()
        .expect("target/<profile>")
        .to_path_buf()
}

/// The `canopy-mobile` cdylib built with the tests: cargo writes it to
/// `deps/` when it builds the tests, and copies it up only for `cargo
/// build`, so the newer of the two is the one this build made. Where
/// `CANOPY_MOBILE_CDYLIB` names a copy, that copy: `.ci/run` makes one,
/// since the `pip install ./mobile` it runs beside the tests rewrites
/// `deps/`'s.
pub fn cdylib() -> Result<PathBuf> {
    if let Some(copy) = std::env::var_os("CANOPY_MOBILE_CDYLIB") {
        let copy = PathBuf::from(copy);
        ensure!(
            copy.is_file(),
            "CANOPY_MOBILE_CDYLIB names {}, which is not a file",
            copy.display()
        );
        return Ok(copy);
    }
    let name = format!(
        "{}canopy_mobile{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    );
    let dir = target_dir();
    let modified = |path: &PathBuf| path.metadata().and_then(|m| m.modified()).ok();
    [dir.join("deps").join(&name), dir.join(&name)]
        .into_iter()
        .filter(|path| path.is_file())
        .max_by_key(modified)
        .with_context(|| {
            format!(
                "{name} is not in {}; run the tests with `cargo test --workspace --release`, which \
                 builds it",
                dir.display()
            )
        })
}

/// `language`'s bindings, generated into `out`.
pub fn bindings(language: Language, out: &Path) -> Result<()> {
    canopy_bindgen::generate(language, &cdylib()?, out)
}

/// A server with a model (logistic regression, its statistics fitted)
/// and a started job of one round for `devices` devices, without
/// federated evaluation; returns the
/// server, an enrollment token and the job id.
pub async fn server_with_job(devices: usize) -> Result<(TestServer, String, i64)> {
    let server = TestServer::start(Database::Sqlite)?;
    let admin = server.admin();
    let version = admin
        .upload_model("bindings", support::logreg_model_bytes(7))
        .await?;
    let token = admin.enrollment_token(devices as u32 + 1).await?;
    let job = admin
        .create_job(json!({
            "name": "bindings", "model_version_id": version["id"], "rounds": 1,
            "min_devices": devices, "target_devices": devices, "over_selection": 0.0,
            "round_deadline_ms": 300_000, "local_epochs": 1, "batch_size": 8,
            "learning_rate": 0.1,
            // The device leaves after its upload: no federated evaluation
            // for it to answer.
            "evaluation": {"fraction": 0.0},
        }))
        .await?;
    Ok((server, token, job))
}

/// Waits for the job to complete; the job's JSON.
pub async fn completed(server: &TestServer, job: i64) -> Result<serde_json::Value> {
    let done = server
        .admin()
        .wait_for_job(job, Duration::from_secs(300))
        .await?;
    ensure!(
        done["state"] == "completed",
        "the job did not complete: {done}"
    );
    Ok(done)
}

/// `count` samples of 64 features in 10 classes, as a flat row-major
/// vector and labels, deterministic.
pub fn samples(count: usize) -> (Vec<f32>, Vec<i64>) {
    let features = (0..count * 64)
        .map(|i| ((i * 7919) % 17) as f32 / 17.0)
        .collect();
    let labels = (0..count).map(|i| (i % 10) as i64).collect();
    (features, labels)
}
