//! Sets `cfg(canopy_forward_backend)` for this crate's targets: the
//! engine's conformance suites, which tests/conformance.rs includes, then
//! check forward results on this backend (engine/tests/common/mod.rs).

fn main() {
    println!("cargo::rustc-check-cfg=cfg(canopy_forward_backend)");
    println!("cargo::rustc-cfg=canopy_forward_backend");
}
