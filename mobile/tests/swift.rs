//! Swift: the toolchain cannot be installed on this machine (Linux CI,
//! no Swift package in Debian's archive here), so the bindings are
//! generated from this build's cdylib and checked for the API an iOS app
//! calls, not compiled. docs/mobile.md shows the XCFramework build.

use crate::common;

use anyhow::{Result, ensure};
use canopy_bindgen::Language;

#[test]
fn swift_bindings_are_generated_with_the_whole_api() -> Result<()> {
    let out = tempfile::tempdir()?;
    common::bindings(Language::Swift, out.path())?;
    let mut names: Vec<String> = std::fs::read_dir(out.path())?
        .filter_map(|entry| entry.ok())
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let swift = names
        .iter()
        .find(|name| name.ends_with(".swift"))
        .ok_or_else(|| anyhow::anyhow!("no .swift file among {names:?}"))?;
    ensure!(
        names.iter().any(|name| name.ends_with("FFI.h"))
            && names.iter().any(|name| name.ends_with(".modulemap")),
        "the C header and module map Swift imports are missing: {names:?}"
    );
    let source = std::fs::read_to_string(out.path().join(swift))?;
    for api in [
        "class CanopyClient",
        "func enroll(",
        "func reportConditions(",
        "func checkForTask(",
        "func runTask(",
        "func status(",
        "func unenroll(",
        "func installCertificate(",
        "deviceAuthority",
        "protocol ProgressListener",
        "enum CanopyError",
        "struct ClientConfig",
        "enum TrainingData",
    ] {
        ensure!(source.contains(api), "{swift} lacks `{api}`");
    }
    Ok(())
}
