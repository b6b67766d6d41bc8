//! Helpers every CLI test binary shares: the binary, the repository's
//! data, scratch folders, and what a successful or failed run printed.
// Each test binary uses a different subset of these.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use anyhow::{Context, Result, bail};

const INSTALL_HINT: &str = "hint: pip install -r requirements-dev.txt";

/// Runs the `canopy` binary built for these tests, with quiet logs.
pub fn canopy(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_canopy"))
        .args(args)
        .env("CANOPY_LOG", "warn")
        .output()
        .expect("the canopy binary runs")
}

/// Runs `cli/tests/reference/{script}` with `out_dir` as its argument, on
/// `$CANOPY_PYTHON` (default `python3`) with requirements-dev.txt installed.
pub fn reference_script(script: &str, out_dir: &Path) -> Result<()> {
    let python = std::env::var("CANOPY_PYTHON").unwrap_or_else(|_| "python3".to_string());
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/reference")
        .join(script);
    let output = Command::new(&python)
        .arg(&path)
        .arg(out_dir)
        .output()
        .with_context(|| format!("cannot run `{python}`; {INSTALL_HINT}"))?;
    if !output.status.success() {
        bail!(
            "the reference script {script} failed: {}\n{INSTALL_HINT}",
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(())
}

/// The repository's root (`datasets/` lives there).
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A fresh scratch folder per test, named after the test binary, the
/// process and `name`.
pub fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "canopy-cli-{}-{}-{name}",
        env!("CARGO_CRATE_NAME"),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Asserts `what` succeeded, showing both streams when it did not.
pub fn succeeded(out: &Output, what: &str) {
    assert!(
        out.status.success(),
        "{what} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Asserts a successful run and returns its stdout.
pub fn ok(out: Output) -> String {
    succeeded(&out, "canopy");
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// Asserts a clean failure in the house style and returns stderr.
pub fn fails(out: Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "expected failure, stderr: {stderr}");
    assert!(!stderr.contains("panicked"), "panic: {stderr}");
    assert!(stderr.starts_with("error:"), "house error style: {stderr}");
    stderr
}

/// The last line of stdout, parsed as JSON.
pub fn last_json(stdout: &str) -> serde_json::Value {
    serde_json::from_str(stdout.lines().last().expect("output")).expect("last line is JSON")
}

/// Runs `canopy simulate` with `args` and `--curve`, and returns the
/// curve's rows (one per version, split at commas, without the header).
/// The simulation must have made `versions` versions.
pub fn simulate_curve(args: &[&str], versions: usize) -> Vec<Vec<String>> {
    let dir = tempfile::tempdir().unwrap();
    let curve = dir.path().join("curve.csv");
    let mut all = vec!["simulate"];
    all.extend(args);
    all.extend(["--curve", curve.to_str().unwrap()]);
    let out = ok(canopy(&all));
    let csv = std::fs::read_to_string(&curve).unwrap();
    let rows: Vec<Vec<String>> = csv
        .lines()
        .skip(1)
        .map(|line| line.split(',').map(str::to_string).collect())
        .collect();
    assert_eq!(rows.len(), versions, "{csv}\n{out}");
    rows
}
