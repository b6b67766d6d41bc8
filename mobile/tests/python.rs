//! The Python package's pytest suite (`mobile/python/tests`), against the
//! cdylib this build made, laid out as `pip install ./mobile` lays it out
//! ([`python_package`]).

use crate::common;
use crate::python_package;

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, ensure};

#[test]
fn the_python_package_passes_its_pytest_suite_against_a_real_server() -> Result<()> {
    let site = tempfile::tempdir()?;
    python_package::lay_out(site.path())?;
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let tests = manifest.join("python/tests");
    let digits = manifest.join("../datasets/digits/digits.csv.gz");
    let run = Command::new("python3")
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-x"])
        .arg(&tests)
        .env("PYTHONPATH", site.path())
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("CANOPY_BIN_DIR", common::target_dir())
        .env("CANOPY_DIGITS", &digits)
        .output()
        .context(
            "cannot run python3 -m pytest; install it (pip install -r requirements-dev.txt)",
        )?;
    let output = format!(
        "{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    println!("{output}");
    ensure!(run.status.success(), "pytest failed:\n{output}");
    ensure!(output.contains(" passed"), "pytest ran no test:\n{output}");
    Ok(())
}
