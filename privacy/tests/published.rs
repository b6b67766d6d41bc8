//! The accountant against values that other libraries publish in their own
//! tests and tutorials, each cited where it is checked.

use canopy_privacy::{Accountant, Conversion, Event, Orders, gaussian};
use proptest::prelude::*;

fn relative(actual: f64, expected: f64) -> f64 {
    ((actual - expected) / expected).abs()
}

fn spent(
    q: f64,
    sigma: f64,
    steps: u64,
    orders: Orders,
    delta: f64,
    conversion: Conversion,
) -> (f64, Option<f64>) {
    let mut accountant = Accountant::new(orders);
    accountant
        .compose(&Event::gaussian(q, sigma, steps))
        .unwrap();
    let spent = accountant.epsilon(delta, conversion).unwrap();
    (spent.epsilon, spent.order)
}

#[test]
fn tensorflow_privacy_accountant_test() {
    // TensorFlow Privacy, rdp_accountant_test.py: q = 0.01, σ = 4, 10,000
    // steps, orders 2..32, δ = 1e-5, classic conversion: ε = 1.258575 at 20.
    let orders = Orders::new((2..=32).map(f64::from).collect()).unwrap();
    let (epsilon, order) = spent(0.01, 4.0, 10_000, orders, 1e-5, Conversion::Classic);
    assert!(relative(epsilon, 1.258_575) < 1e-4, "{epsilon}");
    assert_eq!(order, Some(20.0));
}

#[test]
fn dp_accounting_rdp_test() {
    // Google's dp_accounting, rdp_privacy_accountant_test.py
    // (test_compute_rdp_poisson_sampled_gaussian): q = 0.01, σ = 2.5, 50 steps.
    let orders = Orders::new(vec![1.5, 2.5, 5.0, 50.0, 100.0]).unwrap();
    let expected = [
        6.70579741e-4,
        1.08548710e-3,
        2.18075656e-3,
        2.38460375e-2,
        1.67416308e2,
    ];
    let mut accountant = Accountant::new(orders);
    accountant.compose(&Event::gaussian(0.01, 2.5, 50)).unwrap();
    for (rdp, expected) in accountant.rdp().iter().zip(expected) {
        assert!(relative(*rdp, expected) < 1e-4, "{rdp} vs {expected}");
    }
}

#[test]
fn opacus_accountant_test() {
    // Opacus, accountants_test.py (test_rdp_accountant): q = 0.04, σ = 1.5,
    // 90 epochs = 2,250 steps, δ = 1e-5, Opacus's orders: ε = 7.32911117.
    let fine = (1..100).map(|tenth| 1.0 + f64::from(tenth) / 10.0);
    let orders = Orders::new(fine.chain((12..64).map(f64::from)).collect()).unwrap();
    let (epsilon, _) = spent(0.04, 1.5, 2250, orders, 1e-5, Conversion::Tight);
    assert!(relative(epsilon, 7.329_111_17) < 1e-4, "{epsilon}");
}

#[test]
fn tensorflow_privacy_mnist_tutorial() {
    // TensorFlow Privacy's MNIST tutorial: batches of 256 from 60,000, σ =
    // 1.12, 60 epochs = 14,040 steps, δ = 1e-5: "ε = 2.92" (classic).
    let (epsilon, _) = spent(
        256.0 / 60_000.0,
        1.12,
        14_040,
        Orders::standard(),
        1e-5,
        Conversion::Classic,
    );
    assert!(relative(epsilon, 2.92) < 0.01, "{epsilon}");
}

#[test]
fn exact_cases() {
    let orders = Orders::new(vec![20.0]).unwrap();
    assert_eq!(gaussian::rdp(1.0, 10.0, &orders).unwrap(), vec![0.1]);
    assert_eq!(gaussian::rdp(0.0, 10.0, &orders).unwrap(), vec![0.0]);
    assert_eq!(
        gaussian::rdp(0.0, 0.5, &Orders::standard()).unwrap(),
        vec![0.0; 156]
    );
}

/// Φ, the standard normal's distribution function.
fn normal_cdf(x: f64) -> f64 {
    0.5 * libm::erfc(-x / std::f64::consts::SQRT_2)
}

/// The exact δ at which the Gaussian mechanism of noise σ (sensitivity 1)
/// is (ε, δ)-DP (Balle and Wang 2018, Theorem 8).
fn exact_gaussian_delta(epsilon: f64, sigma: f64) -> f64 {
    normal_cdf(-epsilon * sigma + 0.5 / sigma)
        - epsilon.exp() * normal_cdf(-epsilon * sigma - 0.5 / sigma)
}

#[test]
fn conversions_are_sound_and_not_loose_against_the_exact_gaussian() {
    for sigma in [0.8, 1.0, 2.0, 5.0] {
        for delta in [1e-3, 1e-5, 1e-9] {
            // The exact ε: δ(ε) falls as ε grows.
            let (mut low, mut high) = (0.0, 100.0);
            for _ in 0..200 {
                let middle = 0.5 * (low + high);
                if exact_gaussian_delta(middle, sigma) > delta {
                    low = middle;
                } else {
                    high = middle;
                }
            }
            for conversion in Conversion::ALL {
                let (epsilon, _) = spent(1.0, sigma, 1, Orders::standard(), delta, conversion);
                let context =
                    format!("σ {sigma} δ {delta} {conversion}: {epsilon} vs exact {high}");
                assert!(
                    exact_gaussian_delta(epsilon, sigma) <= delta * (1.0 + 1e-9),
                    "{context}"
                );
                assert!(epsilon <= 1.5 * high + 0.25, "{context}");
            }
        }
    }
}

#[test]
fn the_tight_conversion_is_never_above_the_classic() {
    for (q, sigma, steps) in [
        (0.01, 1.0, 1000),
        (0.1, 0.7, 100),
        (1.0, 3.0, 10),
        (1e-4, 20.0, 1),
    ] {
        let (tight, _) = spent(q, sigma, steps, Orders::standard(), 1e-6, Conversion::Tight);
        let (classic, _) = spent(
            q,
            sigma,
            steps,
            Orders::standard(),
            1e-6,
            Conversion::Classic,
        );
        assert!(
            tight <= classic,
            "q {q} σ {sigma} steps {steps}: {tight} > {classic}"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn epsilon_grows_with_steps_and_falls_with_noise(
        q in 1e-4f64..=1.0,
        sigma in 0.5f64..30.0,
        steps in 1u64..100_000,
        more_steps in 1u64..10_000,
        more_noise in 1.001f64..3.0,
        delta_exponent in 2i32..12,
        tight in any::<bool>(),
    ) {
        let delta = 10f64.powi(-delta_exponent);
        let conversion = if tight { Conversion::Tight } else { Conversion::Classic };
        let base = spent(q, sigma, steps, Orders::standard(), delta, conversion).0;
        let longer = spent(q, sigma, steps + more_steps, Orders::standard(), delta, conversion).0;
        let noisier = spent(q, sigma * more_noise, steps, Orders::standard(), delta, conversion).0;
        prop_assert!(longer >= base, "{} steps: {}, {} more: {}", steps, base, more_steps, longer);
        prop_assert!(noisier <= base, "σ {}: {}, σ {}: {}", sigma, base, sigma * more_noise, noisier);
        // And strictly, while anything is spent at all.
        if base > 0.0 {
            prop_assert!(longer > base);
            prop_assert!(noisier < base);
        }
    }
}
