//! The C ABI for real: `tests/c/client.c`, compiled against the header
//! cbindgen generates, runs one device through enroll -> task -> upload
//! against a real server, under valgrind, with no error and no leak.

use crate::common;

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, ensure};
use canopy_bindgen::Language;
use canopy_protocol::device_cert::DeviceAuthority;

fn compile(out: &Path) -> Result<std::path::PathBuf> {
    common::bindings(Language::C, out)?;
    let library = common::cdylib()?;
    let lib_dir = library.parent().context("the cdylib's directory")?;
    let program = out.join("client");
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/client.c");
    let compiled = Command::new("cc")
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-g", "-O1"])
        .arg("-I")
        .arg(out)
        .arg(&source)
        .arg("-o")
        .arg(&program)
        .arg(format!("-L{}", lib_dir.display()))
        .arg(format!("-Wl,-rpath,{}", lib_dir.display()))
        .args(["-lcanopy_mobile", "-lm"])
        .output()
        .context("cannot run cc; install a C compiler (build-essential)")?;
    ensure!(
        compiled.status.success(),
        "cc failed:\n{}",
        String::from_utf8_lossy(&compiled.stderr)
    );
    Ok(program)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_c_program_enrolls_trains_and_uploads_under_valgrind() -> Result<()> {
    let out = tempfile::tempdir()?;
    let program = compile(out.path())?;
    let header = std::fs::read_to_string(out.path().join("canopy.h"))?;
    ensure!(header.contains("canopy_client_run_task") && header.contains("CANOPY_OK"));
    let (server, token, job) = common::server_with_job(1).await?;
    let storage = out.path().join("storage");
    let run = Command::new("valgrind")
        .args([
            "--error-exitcode=99",
            "--leak-check=full",
            "--errors-for-leak-kinds=definite,indirect",
            "--show-leak-kinds=definite,indirect",
        ])
        .arg(format!(
            "--suppressions={}",
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/c/valgrind.supp")
                .display()
        ))
        .arg(&program)
        .env("CANOPY_URL", &server.base)
        .env("CANOPY_FINGERPRINT", &server.fingerprint)
        .env("CANOPY_TOKEN", &token)
        .env("CANOPY_STORAGE", &storage)
        .env(
            "CANOPY_AUTHORITY",
            DeviceAuthority::generate().public_key_hex(),
        )
        .output()
        .context("cannot run valgrind; install it (apt-get install valgrind)")?;
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    ensure!(
        run.status.success(),
        "the C client failed ({}):\n{stdout}\n{stderr}",
        run.status
    );
    ensure!(stdout.contains("\nok\n"), "{stdout}");
    ensure!(
        stderr.contains("ERROR SUMMARY: 0 errors"),
        "valgrind found errors:\n{stderr}"
    );
    let done = common::completed(&server, job).await?;
    ensure!(done["rounds_completed"] == 1, "{done}");
    Ok(())
}
