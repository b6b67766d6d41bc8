//! Helpers every CLI test binary shares.

use std::path::Path;
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
#[allow(dead_code)] // not every test binary runs a reference script
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
