//! Link settings for the app library (the cdylib), which cut its size
//! without touching its code (docs/mobile.md, "Size and speed"). Each is
//! given only where the target's linker is known to take it, and the
//! loader to run the result: a flag the linker does not know fails the
//! build, a packing the loader does not know fails at `dlopen`.

use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed={PACK_RELOCS}");
    let var = |name: &str| std::env::var(name).unwrap_or_default();
    let (os, env, arch) = (
        var("CARGO_CFG_TARGET_OS"),
        var("CARGO_CFG_TARGET_ENV"),
        var("CARGO_CFG_TARGET_ARCH"),
    );
    let gnu_linux = os == "linux" && env == "gnu";
    // Identical functions (drop glue, generic instantiations that compile
    // alike) kept once; Rust makes no promise that two functions have
    // distinct addresses, so folding all of them is sound. lld does it:
    // the NDK links Android with it, and rustc links x86_64 Linux with its
    // own from 1.90 on.
    if os == "android" || (gnu_linux && arch == "x86_64" && rustc_minor() >= 90) {
        println!("cargo:rustc-cdylib-link-arg=-Wl,--icf=all");
    }
    // Relative relocations packed: 0.65 MB of `.rela.dyn` become a few
    // KB. Android's loader reads its own packing from API 23 on. glibc
    // reads DT_RELR from 2.36 only (Ubuntu 22.04 has 2.35), so on Linux
    // it is asked for.
    if os == "android" {
        println!("cargo:rustc-cdylib-link-arg=-Wl,--pack-dyn-relocs=android");
    } else if gnu_linux && std::env::var(PACK_RELOCS).is_ok_and(|v| v == "1") {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-z,pack-relative-relocs");
    }
}

/// `CANOPY_PACK_RELOCS=1`: pack relocations for glibc 2.36 and later.
const PACK_RELOCS: &str = "CANOPY_PACK_RELOCS";

/// The minor version of the rustc building this crate; 0 when unknown.
fn rustc_minor() -> u32 {
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".to_string());
    Command::new(rustc)
        .arg("--version")
        .output()
        .ok()
        .and_then(|out| String::from_utf8(out.stdout).ok())
        .and_then(|text| {
            let version = text.split_whitespace().nth(1)?.to_string();
            version.split('.').nth(1)?.parse().ok()
        })
        .unwrap_or(0)
}
