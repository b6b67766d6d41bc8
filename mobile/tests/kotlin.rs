//! The generated Kotlin for real: `tests/kotlin/Main.kt`, compiled with
//! the Kotlin bindings UniFFI generates from this build's cdylib, runs one
//! device through enroll -> task -> upload on the JVM, with JNA loading
//! the library, as an Android app does.
//!
//! Debian's `kotlin` (1.3) is too old for UniFFI's Kotlin; the compiler
//! used is the one inside the `kotlin-jupyter-kernel` package from PyPI
//! (`requirements-dev.txt`), JNA is Debian's `libjna-java` (`.ci/run`
//! installs both).

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail, ensure};
use canopy_bindgen::Language;
use canopy_protocol::device_cert::DeviceAuthority;

const JNA_JAR: &str = "/usr/share/java/jna.jar";

/// The kernel's `*-all.jar`, which holds the Kotlin compiler and stdlib.
fn kotlin_jar() -> Result<PathBuf> {
    let found = Command::new("python3")
        .args([
            "-c",
            "import pathlib, run_kotlin_kernel as k; \
             print(next(pathlib.Path(k.__file__).parent.glob('jars/*-all.jar')))",
        ])
        .output()
        .context("cannot run python3")?;
    if !found.status.success() {
        bail!(
            "the Kotlin compiler jar was not found: {}\nhint: pip install -r requirements-dev.txt \
             (kotlin-jupyter-kernel ships it)",
            String::from_utf8_lossy(&found.stderr).trim()
        );
    }
    Ok(PathBuf::from(String::from_utf8(found.stdout)?.trim()))
}

fn java(args: &[&std::ffi::OsStr]) -> Command {
    let mut command = Command::new("java");
    command.args(args);
    command
}

fn compile(out: &Path, kotlin: &Path) -> Result<PathBuf> {
    let sources = out.join("src");
    common::bindings(Language::Kotlin, &sources)?;
    let generated = sources.join("dev/canopy/canopy.kt");
    ensure!(
        generated.is_file(),
        "UniFFI wrote no {}",
        generated.display()
    );
    let classes = out.join("classes");
    let classpath = std::env::join_paths([kotlin, Path::new(JNA_JAR)])?;
    let main = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/kotlin/Main.kt");
    let compiled = java(&[
        "-cp".as_ref(),
        kotlin.as_os_str(),
        "org.jetbrains.kotlin.cli.jvm.K2JVMCompiler".as_ref(),
        "-no-stdlib".as_ref(),
        "-no-reflect".as_ref(),
        "-jvm-target".as_ref(),
        "17".as_ref(),
        "-cp".as_ref(),
        classpath.as_os_str(),
        "-d".as_ref(),
        classes.as_os_str(),
        generated.as_os_str(),
        main.as_os_str(),
    ])
    .output()
    .context("cannot run java; install a JDK 17")?;
    ensure!(
        compiled.status.success(),
        "kotlinc failed:\n{}{}",
        String::from_utf8_lossy(&compiled.stdout),
        String::from_utf8_lossy(&compiled.stderr)
    );
    Ok(classes)
}

#[tokio::test(flavor = "multi_thread")]
async fn generated_kotlin_enrolls_trains_and_uploads_on_the_jvm() -> Result<()> {
    ensure!(
        Path::new(JNA_JAR).is_file(),
        "{JNA_JAR} is missing; apt-get install libjna-java"
    );
    let kotlin = kotlin_jar()?;
    let out = tempfile::tempdir()?;
    let classes = compile(out.path(), &kotlin)?;
    let library_dir = common::cdylib()?
        .parent()
        .context("the cdylib's directory")?
        .to_path_buf();
    let (server, token, job) = common::server_with_job(1).await?;
    let classpath =
        std::env::join_paths([classes.as_path(), kotlin.as_path(), Path::new(JNA_JAR)])?;
    let run = java(&[
        format!("-Djna.library.path={}", library_dir.display()).as_ref(),
        "-cp".as_ref(),
        classpath.as_os_str(),
        "MainKt".as_ref(),
    ])
    .env("CANOPY_URL", &server.base)
    .env("CANOPY_FINGERPRINT", &server.fingerprint)
    .env("CANOPY_TOKEN", &token)
    .env("CANOPY_STORAGE", out.path().join("storage"))
    .env(
        "CANOPY_AUTHORITY",
        DeviceAuthority::generate().public_key_hex(),
    )
    .output()?;
    let stdout = String::from_utf8_lossy(&run.stdout);
    ensure!(
        run.status.success() && stdout.contains("\nok\n"),
        "the Kotlin client failed ({}):\n{stdout}\n{}",
        run.status,
        String::from_utf8_lossy(&run.stderr)
    );
    let done = common::completed(&server, job).await?;
    ensure!(done["rounds_completed"] == 1, "{done}");
    Ok(())
}
