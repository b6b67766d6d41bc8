//! Compressed updates end to end: `canopy simulate` on the bundled UCI
//! digits with `--compress int8` uploads about a quarter of the bytes of
//! the same job in f32 and learns as well. docs/compression.md has the
//! same on mnist-10k.

mod common;

use common::{canopy, fails, simulate_curve};

/// The job's central accuracy after its last round and the bytes its
/// rounds' updates took, from `--curve`.
fn run(extra: &[&str]) -> (f64, u64) {
    let mut args = vec![
        // Every device every round: the two runs differ only in the
        // encoding.
        "--devices",
        "10",
        "--per-round",
        "10",
        "--rounds",
        "10",
    ];
    args.extend(extra);
    let rows = simulate_curve(&args, 10);
    let bytes = rows.iter().map(|row| row[6].parse::<u64>().unwrap()).sum();
    (rows[9][2].parse().unwrap(), bytes)
}

#[test]
fn int8_updates_take_a_quarter_of_the_bytes_and_learn_as_well() {
    let (f32_accuracy, f32_bytes) = run(&[]);
    // The digits MLP's weights have 2,048 and 320 values; its biases stay
    // f32.
    let (int8_accuracy, int8_bytes) = run(&["--compress", "int8", "--int8-min-elements", "300"]);
    let ratio = int8_bytes as f64 / f32_bytes as f64;
    assert!(
        (0.25..0.30).contains(&ratio),
        "int8 {int8_bytes} bytes, f32 {f32_bytes}: {ratio}"
    );
    assert!(
        (int8_accuracy - f32_accuracy).abs() < 0.01,
        "int8 {int8_accuracy}, f32 {f32_accuracy}"
    );
}

#[test]
fn a_bad_compression_setting_is_named() {
    let err = fails(canopy(&["simulate", "--rounds", "1", "--compress", "int4"]));
    assert!(err.contains("int4"), "{err}");
    let err = fails(canopy(&[
        "simulate",
        "--rounds",
        "1",
        "--compress",
        "int8",
        "--int8-min-elements",
        "0",
    ]));
    assert!(
        err.contains("`update_compression.min_elements` must be between 1"),
        "{err}"
    );
}
