//! Link settings for the app library (the cdylib): docs/mobile.md,
//! "Size and speed".

fn main() {
    let target_os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    let target_env = std::env::var("CARGO_CFG_TARGET_ENV").unwrap_or_default();
    if target_os == "linux" && target_env == "gnu" {
        // Relative relocations packed as bitmaps (DT_RELR, glibc 2.36+):
        // 0.65 MB of `.rela.dyn` become a few KB.
        println!("cargo:rustc-cdylib-link-arg=-Wl,-z,pack-relative-relocs");
    }
    // Functions whose machine code is the same (drop glue, small
    // generic instantiations) kept once. `safe` folds only those whose
    // address is never taken, so no function pointer comparison changes.
    println!("cargo:rustc-cdylib-link-arg=-Wl,--icf=all");
}
