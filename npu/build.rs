//! Sets `cfg(canopy_forward_backend)` for this crate's targets: the
//! engine's conformance suites, which tests/conformance.rs includes, then
//! check forward results on this backend (engine/tests/common/mod.rs).

fn main() {
    // Without a rerun-if-changed line, cargo reruns a build script whenever
    // any file of its package changes, and a rerun rebuilds this crate and
    // everything above it: an edit to one of npu/tests/ took 11 minutes to
    // rebuild on two cores instead of seconds.
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rustc-check-cfg=cfg(canopy_forward_backend)");
    println!("cargo::rustc-cfg=canopy_forward_backend");
}
