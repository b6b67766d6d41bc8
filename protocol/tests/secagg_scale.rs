//! Issue 17, acceptance 2: a round of 10,000 devices at the default
//! settings unmasks exactly with 10 % of them dropping out, a fifth
//! before each of the five stages (`cargo bench --bench secagg_scale` also runs 5 % and
//! prints what the server spent).

#[path = "support/scale.rs"]
mod scale;

#[test]
fn ten_thousand_devices_at_the_defaults_unmask_exactly_with_ten_percent_dropouts() {
    let report = scale::simulate(10_000, 100, 0.10).unwrap_or_else(|message| panic!("{message}"));
    // The default ring (31 bits) holds 10,000 weighted updates because
    // the weight cap shrinks with the round.
    assert_eq!(report.plan.bits, 31);
    assert_eq!(report.plan.max_weight, 845);
    assert_eq!(report.dropouts, 1_000);
    // Those silent before ConsistencyCheck or Unmasking are still in the
    // sum.
    assert_eq!(report.survivors, 10_000 - 600);
    // The round's state is per device, dominated by the k ciphertexts a
    // device sends (k · 112 bytes); nothing grows with n².
    let per_device = report.held_bytes / 10_000;
    assert!(
        per_device <= 42 * 112 + 2_000,
        "{per_device} bytes per device"
    );
    let server: std::time::Duration = report.server.iter().map(|(_, d)| *d).sum();
    println!(
        "server {:.2} s, devices {:.2} s of a {:.2} s round, {per_device} bytes per device",
        server.as_secs_f64(),
        report.devices.as_secs_f64(),
        report.whole.as_secs_f64()
    );
}
