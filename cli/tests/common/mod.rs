//! Helpers every CLI test binary shares.

use std::process::{Command, Output};

/// Runs the `canopy` binary built for these tests, with quiet logs.
pub fn canopy(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_canopy"))
        .args(args)
        .env("CANOPY_LOG", "warn")
        .output()
        .expect("the canopy binary runs")
}
