//! Robust aggregation end to end: `canopy simulate` on the bundled UCI
//! digits, ten devices a round, three of them attackers that send their
//! update flipped and scaled by ten (`--attackers 3 --attack
//! sign-flip:10`), only scaled (`scale:10`) or only flipped
//! (`sign-flip`). FedAvg collapses (loses more than ten points to the
//! scaling, more than five to the flip alone); the median, the trimmed
//! mean, Krum and Multi-Krum each stay within three points of the clean
//! run against all three.
//! docs/robustness.md has the same on mnist-10k, and other attacks.

mod common;

use std::sync::OnceLock;

use common::{canopy, fails, simulate_curve};

const ROUNDS: &str = "10";

/// The job's central accuracy after its last round, from `--curve`.
fn final_accuracy(extra: &[&str]) -> f64 {
    let mut args = vec![
        "--devices",
        "10",
        "--per-round",
        "10",
        "--rounds",
        ROUNDS,
        "--partition",
        "iid",
    ];
    args.extend(extra);
    let rows = simulate_curve(&args, 10);
    assert_eq!(rows[9][0], ROUNDS, "{rows:?}");
    rows[9][2].parse().unwrap()
}

/// The clean run's final accuracy, run once for the three attacks' tests.
fn clean() -> f64 {
    static CLEAN: OnceLock<f64> = OnceLock::new();
    *CLEAN.get_or_init(|| {
        let clean = final_accuracy(&[]);
        assert!(clean > 0.85, "the clean run learns: {clean}");
        clean
    })
}

/// FedAvg's accuracy under `attack` is below `fedavg_at_most`, and every
/// robust rule's within three points of the clean run's.
fn robust_rules_hold_where_fedavg_collapses(attack: &str, fedavg_at_most: f64) {
    let attack = ["--attackers", "3", "--attack", attack];
    let fedavg = final_accuracy(&attack);
    assert!(fedavg < fedavg_at_most, "FedAvg under {attack:?}: {fedavg}");
    let rules: [&[&str]; 4] = [
        &["--robust", "median"],
        &["--robust", "trimmed_mean", "--trim-fraction", "0.3"],
        &["--robust", "krum", "--byzantine", "3"],
        &["--robust", "multi_krum", "--byzantine", "3"],
    ];
    let clean = clean();
    for rule in rules {
        let mut args = attack.to_vec();
        args.extend(rule);
        let robust = final_accuracy(&args);
        assert!(
            robust > clean - 0.03,
            "{rule:?} under {attack:?}: {robust}, clean {clean}"
        );
    }
}

// One test per attack, so that the test runner runs them side by side.

/// Flipped and scaled updates take FedAvg to chance.
#[test]
fn robust_rules_hold_where_fedavg_collapses_under_flipped_scaled_updates() {
    robust_rules_hold_where_fedavg_collapses("sign-flip:10", 0.3);
}

/// Updates only scaled (the mean stepping 3.7 times too far) cost FedAvg
/// more than ten points.
#[test]
fn robust_rules_hold_where_fedavg_collapses_under_scaled_updates() {
    robust_rules_hold_where_fedavg_collapses("scale:10", clean() - 0.1);
}

/// Updates only flipped (the mean stepping 0.4 as far) cost FedAvg more
/// than five points.
#[test]
fn robust_rules_hold_where_fedavg_collapses_under_flipped_updates() {
    robust_rules_hold_where_fedavg_collapses("sign-flip", clean() - 0.05);
}

/// A robust setting the server refuses comes back to the user named.
#[test]
fn a_bad_robust_setting_is_named() {
    let err = fails(canopy(&[
        "simulate",
        "--devices",
        "4",
        "--per-round",
        "4",
        "--rounds",
        "1",
        "--robust",
        "krum",
        "--byzantine",
        "1",
    ]));
    assert!(
        err.contains("`min_devices` must be at least 5, got 4"),
        "{err}"
    );
    let err = fails(canopy(&["simulate", "--attack", "scale"]));
    assert!(err.contains("`scale` needs its factor"), "{err}");
}
