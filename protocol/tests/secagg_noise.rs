//! Distributed differential privacy under SecAgg+, at the protocol level:
//! over many rounds of the real protocol (devices quantise, add their
//! Skellam shares and mask; the server unmasks), the noise in the unmasked
//! sum has the variance the job configured, with and without dropouts.

use std::collections::BTreeSet;

use canopy_protocol::secagg::noise::NoiseTarget;
use canopy_protocol::secagg::params::Plan;
use canopy_protocol::secagg::{SecAggConfig, Session, arith};
use rand::{Rng, SeedableRng};

#[path = "support/honest.rs"]
mod honest;
use honest::HonestRound;

const DEVICES: usize = 20;
const VALUES: usize = 4_000;
const ROUNDS: u64 = 8;
const TARGET: NoiseTarget = NoiseTarget {
    noise_multiplier: 1.0,
    clip_norm: 2.0,
};

fn private_plan() -> Plan {
    let config = SecAggConfig {
        enabled: true,
        max_dropout_fraction: 0.1,
        ..SecAggConfig::default()
    };
    config.private_plan(DEVICES, VALUES, &TARGET).unwrap()
}

/// A device's update: random, clipped to the L2 norm as the SDK clips it.
fn update(rng: &mut impl Rng) -> Vec<f32> {
    let mut delta: Vec<f32> = (0..VALUES)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    canopy_protocol::update::clip_to_norm(&mut delta, TARGET.clip_norm);
    delta
}

/// One round of the whole protocol; the devices in `silent` go quiet
/// before they send their masked input. Returns, per coordinate, the
/// unmasked sum less the sum of the updates it holds: the noise (and the
/// rounding, a quarter of a level per device at most).
fn round_noise(plan: &Plan, silent: &BTreeSet<u64>, seed: u64) -> Vec<f64> {
    let session = Session {
        job_id: 9,
        round_id: seed,
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let graph_seed: [u8; 32] = rng.random();
    let plan = plan.clone().commit_graph(&graph_seed);
    let updates: Vec<Vec<f32>> = (0..DEVICES).map(|_| update(&mut rng)).collect();
    let (mut round, exclusions) = HonestRound::start(session, &plan, &graph_seed, DEVICES);
    for (id, message) in exclusions {
        if silent.contains(&id) {
            continue;
        }
        // Trained on many samples: the weight is 1 all the same.
        let quantizer = arith::Quantizer::new(&plan, &updates[id as usize - 1], 500).unwrap();
        assert_eq!(quantizer.is_private(), plan.device_noise.is_some());
        let reply = round.clients[id as usize - 1]
            .masked_update(&message, &quantizer, &mut rand::rng())
            .unwrap();
        round.server.receive_masked_input(id, &reply).unwrap();
    }
    let (sum, survivors) = round.finish();
    assert_eq!(survivors.len(), DEVICES - silent.len());
    let (values, weight) = arith::decode_sum(&plan, &sum).unwrap();
    assert_eq!(weight, survivors.len() as u64, "every device weighs 1");
    (0..VALUES)
        .map(|i| {
            let held: f64 = survivors
                .iter()
                .map(|&id| f64::from(updates[id as usize - 1][i]))
                .sum();
            values[i] - held
        })
        .collect()
}

/// The noise's mean and variance per coordinate over `ROUNDS` rounds.
fn measured(plan: &Plan, silent: &BTreeSet<u64>, seed: u64) -> (f64, f64) {
    let noise: Vec<f64> = (0..ROUNDS)
        .flat_map(|round| round_noise(plan, silent, seed + round))
        .collect();
    let count = noise.len() as f64;
    let mean = noise.iter().sum::<f64>() / count;
    let variance = noise.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (count - 1.0);
    (mean, variance)
}

#[test]
fn the_unmasked_sum_carries_the_configured_noise_with_and_without_dropouts() {
    let plan = private_plan();
    let noise = plan.device_noise.clone().expect("a private plan");
    assert_eq!(plan.max_dropouts, 2);
    assert_eq!(noise.guaranteed_devices, DEVICES - 2);
    assert_eq!(plan.max_weight, 1);
    // σ·Δ₂ in levels, back in the update's units.
    let step = plan.clip / plan.levels as f64;
    let sensitivity = plan.sensitivity().l2 * step;
    let configured = (TARGET.noise_multiplier * sensitivity).powi(2);
    // Rounding moves Δ₂ above the clip by √d/L: a rounding error here.
    assert!(sensitivity / TARGET.clip_norm - 1.0 < 1e-4, "{sensitivity}");
    assert!((noise.guaranteed_variance() * step * step / configured - 1.0).abs() < 1e-12);

    // The allowed dropouts happen: the noise is the configured noise.
    let silent: BTreeSet<u64> = [4, 17].into();
    let (mean, variance) = measured(&plan, &silent, 100);
    let ratio = variance / configured;
    eprintln!("with 2 dropouts: variance {variance:.6e}, configured {configured:.6e} ({ratio:.4})");
    assert!((ratio - 1.0).abs() < 0.1, "{ratio}");
    let samples = (ROUNDS as usize * VALUES) as f64;
    assert!(
        mean.abs() < 5.0 * (variance / samples).sqrt(),
        "noise mean {mean}"
    );

    // None drop: the two devices' shares come on top, 20/18 of it.
    let (_, variance) = measured(&plan, &BTreeSet::new(), 200);
    let expected = configured * DEVICES as f64 / (DEVICES - 2) as f64;
    let ratio = variance / expected;
    eprintln!(
        "with no dropouts: variance {variance:.6e}, expected {expected:.6e} ({ratio:.4}), \
         configured {configured:.6e} ({:.4})",
        variance / configured
    );
    assert!((ratio - 1.0).abs() < 0.1, "{ratio}");
    assert!(variance / configured < 1.1 * DEVICES as f64 / 18.0);
}

#[test]
fn without_noise_the_same_rounds_hold_only_rounding() {
    // The measurement is not blind: a plan without noise, same rounds,
    // shows a variance millions of times smaller.
    let plan = Plan {
        device_noise: None,
        ..private_plan()
    };
    let (_, variance) = measured(&plan, &BTreeSet::new(), 300);
    let step = plan.clip / plan.levels as f64;
    // Stochastic rounding: at most a quarter of a level² per device.
    assert!(
        variance <= DEVICES as f64 * 0.25 * step * step,
        "{variance}"
    );
}

#[test]
fn a_plan_whose_noise_could_wrap_the_ring_is_refused() {
    let plan = private_plan();
    for (change, field) in [
        (
            Plan {
                levels: plan.levels + plan.levels / 10,
                ..plan.clone()
            },
            "no room",
        ),
        (
            Plan {
                max_weight: 5,
                ..plan.clone()
            },
            "every device weighs 1",
        ),
        (
            Plan {
                device_noise: plan.device_noise.clone().map(|mut noise| {
                    noise.variance = f64::NAN;
                    noise
                }),
                ..plan.clone()
            },
            "variance NaN",
        ),
        (
            Plan {
                device_noise: plan.device_noise.clone().map(|mut noise| {
                    noise.guaranteed_devices = DEVICES;
                    noise
                }),
                ..plan.clone()
            },
            "guaranteed_devices 20",
        ),
    ] {
        let error = change.validate().unwrap_err().to_string();
        assert!(error.contains(field), "{field}: {error}");
    }
    plan.validate().unwrap();
    // A device from before distributed DP refuses a private plan instead
    // of sending an update without noise: the field is unknown to it.
    let json = serde_json::to_value(&plan).unwrap();
    assert!(json.get("device_noise").is_some());
    let plain = serde_json::to_value(Plan {
        device_noise: None,
        ..plan
    })
    .unwrap();
    assert!(plain.get("device_noise").is_none());
}
