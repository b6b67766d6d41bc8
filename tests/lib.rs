//! End-to-end tests of the whole system: real `canopy-server` and
//! `canopy-agent` processes, talking HTTPS on loopback. The tests are in
//! `agents.rs`; they find the binaries in the target directory that
//! `cargo test --workspace` builds them into.
