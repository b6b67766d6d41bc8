//! Distributed differential privacy: the Skellam noise each device adds to
//! its quantised update before masking (Agarwal, Kairouz, Liu 2021, "The
//! Skellam Mechanism for Differentially Private Federated Learning"), so
//! that the sum the server unmasks already carries the job's noise and no
//! party, the server included, ever sees an un-noised sum.
//!
//! The calibration, in a round's integer domain (L levels per clip C):
//! - an update clipped to L2 norm C becomes y = x·L/C with ‖y‖₂ ≤ L, and
//!   stochastic rounding moves each of its d coordinates by less than one,
//!   so one device moves the sum by at most Δ₂ = L + √d in L2 norm and
//!   Δ₁ = √d·L + d in L1 norm ([`Plan::sensitivity`]);
//! - the job's noise is σ·Δ₂ per coordinate of the sum. The devices that
//!   are in the sum and honest however the allowed dropouts and corrupt
//!   devices fall, g = n − max_dropouts − max_corrupt, must carry all of
//!   it, so each device adds Skellam noise of variance σ²·Δ₂²/g. With fewer
//!   dropouts the sum carries more (up to n/g times the variance), never
//!   less, and the accountant counts only what is guaranteed;
//! - the sum must not wrap the ring: n·L for the values, plus a bound that
//!   every coordinate's noise stays under with probability 1 − 2⁻⁴⁰ (the
//!   Chernoff bound on Skellam's tail, over all d coordinates:
//!   [`noise_bound`]), must fit in 2^(b−1) − 1. L is the largest that does;
//! - rounding must stay small beside the signal: L ≥ 10·√d (rounding adds
//!   at most a tenth to Δ₂, so to the noise) and L ≥ 127. A ring too narrow
//!   for that is refused, naming the bits it needs.
//!
//! Unlike the paper there is no random rotation: the per-coordinate bound
//! on the values is the worst case (a coordinate can hold the whole clip),
//! so a sum can never wrap whatever the updates are, at the cost of about
//! log₂ n more bits than a rotated, probabilistic bound would need.

use rand::Rng;
use rand_distr::{Distribution, Poisson};
use serde::{Deserialize, Serialize};

use super::SecAggError;
use super::params::{MIN_PRECISION_LEVELS, Plan};

/// The most rounding may add to a device's L2 sensitivity, as a share of
/// the clip: L ≥ √d / this.
pub const MAX_ROUNDING_SHARE: f64 = 0.1;
/// log₂ of the probability that some coordinate's noise reaches past the
/// room the plan leaves for it, and the sum wraps.
pub const WRAP_LOG2: f64 = -40.0;
/// The largest variance a device's share may have: each of its two Poisson
/// draws has mean at most 2⁴⁹, well inside the integers an f64 holds
/// exactly (2⁵³), so the draws are exact integers.
pub const MAX_DEVICE_VARIANCE: f64 = (1u64 << 50) as f64;

/// What a job's differential privacy asks of its secure rounds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NoiseTarget {
    /// σ: the sum's noise standard deviation over the L2 sensitivity.
    pub noise_multiplier: f64,
    /// C: each device's update is clipped to this L2 norm.
    pub clip_norm: f64,
}

/// The noise a private round's plan asks each device to add.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceNoise {
    /// Variance, in levels², of the symmetric Skellam share each device
    /// adds to every coordinate: the difference of two Poisson draws of
    /// mean `variance / 2`.
    pub variance: f64,
    /// Devices whose shares are in the sum whatever the allowed dropouts
    /// and corrupt devices do; together they carry the job's noise.
    pub guaranteed_devices: usize,
}

impl DeviceNoise {
    /// The variance per coordinate the unmasked sum is guaranteed.
    pub fn guaranteed_variance(&self) -> f64 {
        self.variance * self.guaranteed_devices as f64
    }
}

/// What one device can move a private round's sum by, in levels.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sensitivity {
    pub l1: f64,
    pub l2: f64,
}

impl Sensitivity {
    /// Of an update of `update_len` values at `levels` per clip.
    pub fn of(levels: i64, update_len: usize) -> Sensitivity {
        let root_d = (update_len as f64).sqrt();
        Sensitivity {
            l1: root_d * levels as f64 + update_len as f64,
            l2: levels as f64 + root_d,
        }
    }
}

impl Plan {
    /// One device's sensitivity in this plan's integer domain.
    pub fn sensitivity(&self) -> Sensitivity {
        Sensitivity::of(self.levels, self.update_len)
    }
}

/// The fewest levels a private round may keep for `update_len` values.
pub fn min_private_levels(update_len: usize) -> i64 {
    let rounding = ((update_len as f64).sqrt() / MAX_ROUNDING_SHARE).ceil() as i64;
    rounding.max(MIN_PRECISION_LEVELS)
}

/// A private round's scale: its levels and each device's noise.
#[derive(Clone, Debug, PartialEq)]
pub struct PrivateScale {
    pub levels: i64,
    pub noise: DeviceNoise,
}

/// The round's shape, as the private scale needs it.
#[derive(Clone, Copy, Debug)]
pub struct RoundShape {
    pub bits: u32,
    pub participants: usize,
    pub guaranteed_devices: usize,
    pub update_len: usize,
}

impl RoundShape {
    /// Each device's noise variance at `levels`, for `target`.
    fn device_variance(&self, levels: i64, noise_multiplier: f64) -> f64 {
        let l2 = Sensitivity::of(levels, self.update_len).l2;
        (noise_multiplier * l2).powi(2) / self.guaranteed_devices as f64
    }

    /// Whether a sum at `levels` (with each device's noise at
    /// `levels`) fits the ring with room for its noise, and every share
    /// stays exact.
    fn fits(&self, levels: i64, noise_multiplier: f64) -> bool {
        let variance = self.device_variance(levels, noise_multiplier);
        variance <= MAX_DEVICE_VARIANCE
            && sum_fits_ring(
                self.bits,
                self.participants,
                levels,
                variance,
                self.update_len,
            )
    }

    /// The fewest levels a private round may keep, if they fit: what a job
    /// is checked against when it is created, for each size its rounds
    /// may have.
    pub fn check_fewest_levels(&self, target: &NoiseTarget) -> Result<i64, SecAggError> {
        if self.guaranteed_devices == 0 {
            return Err(SecAggError::Config(format!(
                "with distributed differential privacy, the noise of the devices that stay \
                 and are honest must carry the round's noise, and rounds of {} devices \
                 guarantee none once the allowed dropouts and corrupt devices are counted; \
                 lower max_dropout_fraction or max_corrupt_fraction, or select more devices",
                self.participants
            )));
        }
        let fewest = min_private_levels(self.update_len);
        match self.fits(fewest, target.noise_multiplier) {
            true => Ok(fewest),
            false => Err(self.needs_bits(fewest, target.noise_multiplier)),
        }
    }

    /// The most levels a private round can keep, or the error naming the
    /// bits the fewest allowed levels need.
    pub fn scale(&self, target: &NoiseTarget) -> Result<PrivateScale, SecAggError> {
        let sigma = target.noise_multiplier;
        let fewest = self.check_fewest_levels(target)?;
        // Fitting is monotone in the levels: the largest that fits.
        let (mut good, mut bad) = (fewest, ((1i64 << (self.bits - 1)) - 1) + 1);
        while bad - good > 1 {
            let middle = good + (bad - good) / 2;
            match self.fits(middle, sigma) {
                true => good = middle,
                false => bad = middle,
            }
        }
        Ok(PrivateScale {
            levels: good,
            noise: DeviceNoise {
                variance: self.device_variance(good, sigma),
                guaranteed_devices: self.guaranteed_devices,
            },
        })
    }

    fn needs_bits(&self, fewest: i64, sigma: f64) -> SecAggError {
        let variance = self.device_variance(fewest, sigma);
        if variance > MAX_DEVICE_VARIANCE {
            // No ring helps: the shares themselves would be inexact.
            return SecAggError::Config(format!(
                "noise multiplier {sigma} is too large for distributed differential privacy: \
                 each of the {} devices guaranteed to stay would add noise of variance \
                 {variance:.3e} levels², over the {MAX_DEVICE_VARIANCE:.3e} that its Poisson \
                 draws can hold exactly; lower the noise multiplier, or select more devices \
                 per round",
                self.guaranteed_devices
            ));
        }
        let needed = (self.bits + 1..=64).find(|&bits| {
            let wider = RoundShape { bits, ..*self };
            wider.fits(fewest, sigma)
        });
        let remedy = match needed {
            Some(bits) if bits <= super::params::MAX_BITS => format!(
                "raise bits to {bits}, or select fewer devices per round or train fewer \
                 parameters"
            ),
            _ => format!(
                "that is over the {}-bit limit, so select fewer devices per round or train \
                 fewer parameters",
                super::params::MAX_BITS
            ),
        };
        let needed = needed.map_or("more than 64".to_string(), |bits| bits.to_string());
        SecAggError::Config(format!(
            "bits = {} could overflow with distributed differential privacy: the sum of {} \
             updates of {} values at the fewest {fewest} levels per clip (rounding within a \
             tenth of the clip), with noise multiplier {sigma} shared by the {} devices \
             guaranteed to stay, needs {needed} bits to never wrap; {remedy}",
            self.bits, self.participants, self.update_len, self.guaranteed_devices
        ))
    }
}

/// Whether the sum of `participants` updates of `update_len` values at
/// `levels` per clip, each with a noise share of `device_variance`, stays
/// inside a ring of `bits` bits: the values' worst case n·L plus the
/// noise's [`noise_bound`] within 2^(b−1) − 1. The one rule the plan is
/// made by and checked against.
pub fn sum_fits_ring(
    bits: u32,
    participants: usize,
    levels: i64,
    device_variance: f64,
    update_len: usize,
) -> bool {
    let room = ((1u128 << (bits - 1)) - 1) as f64;
    let values = participants as f64 * levels as f64;
    let noise = noise_bound(device_variance * participants as f64, update_len);
    values + noise <= room
}

/// A bound that Skellam noise of `variance` per coordinate stays within,
/// in absolute value, on every one of `coordinates` coordinates but with
/// probability at most 2^[`WRAP_LOG2`].
///
/// For X = P₁ − P₂ with P₁, P₂ ~ Poisson(μ), μ = variance/2, the moment
/// generating function is exp(2μ(cosh t − 1)), so by Chernoff
/// P[X ≥ a] ≤ exp(√(4μ² + a²) − 2μ − a·asinh(a/2μ)) at the best t; the
/// bound is the smallest a at which 2·coordinates times that is 2^WRAP_LOG2.
pub fn noise_bound(variance: f64, coordinates: usize) -> f64 {
    if variance <= 0.0 || coordinates == 0 {
        return 0.0;
    }
    let mu = variance / 2.0;
    let target = WRAP_LOG2 * std::f64::consts::LN_2 - (2.0 * coordinates as f64).ln();
    // The log of the tail bound at a, which falls as a grows.
    let log_tail = |a: f64| {
        let root = (4.0 * mu * mu + a * a).sqrt();
        // √(4μ² + a²) − 2μ without the cancellation of two large terms.
        a * a / (root + 2.0 * mu) - a * (a / (2.0 * mu)).asinh()
    };
    let mut high = variance.sqrt().max(1.0);
    while log_tail(high) > target {
        high *= 2.0;
    }
    let mut low = 0.0;
    for _ in 0..200 {
        let middle = 0.5 * (low + high);
        if log_tail(middle) > target {
            low = middle;
        } else {
            high = middle;
        }
        if high - low <= 1e-9 * high {
            break;
        }
    }
    high.ceil()
}

/// Draws a device's noise shares: symmetric Skellam of a plan's variance.
#[derive(Clone, Copy, Debug)]
pub struct SkellamShares {
    poisson: Poisson<f64>,
}

impl SkellamShares {
    pub fn new(noise: &DeviceNoise) -> Result<SkellamShares, SecAggError> {
        let variance = noise.variance;
        if !(variance.is_finite() && variance > 0.0 && variance <= MAX_DEVICE_VARIANCE) {
            return Err(SecAggError::invalid(format!(
                "a device's noise variance must be positive and at most {MAX_DEVICE_VARIANCE}, \
                 got {variance}"
            )));
        }
        let poisson = Poisson::new(variance / 2.0).map_err(|error| {
            SecAggError::invalid(format!("noise of variance {variance}: {error}"))
        })?;
        Ok(SkellamShares { poisson })
    }

    /// One share: exact, since each draw is an integer below 2⁵³.
    pub fn sample<R: Rng + ?Sized>(&self, rng: &mut R) -> i64 {
        self.poisson.sample(rng) as i64 - self.poisson.sample(rng) as i64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    /// The exact Skellam tail by summing its probabilities, for small μ.
    fn exact_two_sided_tail(mu: f64, a: i64) -> f64 {
        // P[X = k] = e^{-2μ} I_k(2μ); the modified Bessel function by its
        // series, in logs.
        let bessel = |k: i64| {
            let x = 2.0 * mu;
            let mut total = 0.0;
            let mut log_term = (k as f64) * (x / 2.0).ln() - ln_factorial(k as u64);
            for m in 0..400u64 {
                total += log_term.exp();
                log_term +=
                    2.0 * (x / 2.0).ln() - ((m + 1) as f64).ln() - ((m + 1 + k as u64) as f64).ln();
            }
            total * (-x).exp()
        };
        2.0 * (a..a + 400).map(bessel).sum::<f64>()
    }

    fn ln_factorial(n: u64) -> f64 {
        (1..=n).map(|i| (i as f64).ln()).sum()
    }

    #[test]
    fn the_noise_bound_holds_the_exact_tail_and_is_near_it() {
        // One coordinate: 2⁻⁴⁰ · ... at variance 50 (μ = 25).
        let bound = noise_bound(50.0, 1);
        let exact = exact_two_sided_tail(25.0, bound as i64);
        assert!(exact <= 2f64.powf(WRAP_LOG2), "tail {exact} at {bound}");
        // Chernoff is within a few units of where the exact tail crosses.
        let before = exact_two_sided_tail(25.0, bound as i64 - 6);
        assert!(
            before > 2f64.powf(WRAP_LOG2),
            "tail {before} at {}",
            bound - 6.0
        );
        // Large variance: close to the Gaussian's √(2 ln(2d/p))·σ.
        let variance = 1e12;
        let d = 100_000;
        let gaussian = (2.0 * (2.0 * d as f64 / 2f64.powf(WRAP_LOG2)).ln()).sqrt() * 1e6;
        let bound = noise_bound(variance, d);
        assert!(
            bound >= gaussian * 0.999 && bound <= gaussian * 1.01,
            "{bound} vs {gaussian}"
        );
        assert_eq!(noise_bound(0.0, d), 0.0);
    }

    #[test]
    fn shares_have_the_planned_variance() {
        let noise = DeviceNoise {
            variance: 1e9,
            guaranteed_devices: 1,
        };
        let shares = SkellamShares::new(&noise).unwrap();
        let mut rng = StdRng::seed_from_u64(7);
        let n = 40_000;
        let draws: Vec<f64> = (0..n).map(|_| shares.sample(&mut rng) as f64).collect();
        let mean = draws.iter().sum::<f64>() / n as f64;
        let variance = draws.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
        // The sample variance's standard error is about √(2/n) = 0.7 %.
        assert!((variance / 1e9 - 1.0).abs() < 0.03, "{variance}");
        assert!(mean.abs() < 4.0 * (1e9f64 / n as f64).sqrt(), "{mean}");
        for bad in [
            0.0,
            -1.0,
            f64::NAN,
            f64::INFINITY,
            MAX_DEVICE_VARIANCE * 2.0,
        ] {
            let noise = DeviceNoise {
                variance: bad,
                ..noise.clone()
            };
            assert!(SkellamShares::new(&noise).is_err(), "{bad}");
        }
    }

    const UNIT: NoiseTarget = NoiseTarget {
        noise_multiplier: 1.0,
        clip_norm: 1.0,
    };

    /// Rounds of 100 devices, 90 guaranteed, training 100,000 values.
    fn hundred_devices(bits: u32) -> RoundShape {
        RoundShape {
            bits,
            participants: 100,
            guaranteed_devices: 90,
            update_len: 100_000,
        }
    }

    #[test]
    fn the_scale_fills_the_ring_and_never_more() {
        let shape = hundred_devices(31);
        let scale = shape.scale(&UNIT).unwrap();
        assert!(shape.fits(scale.levels, 1.0));
        assert!(!shape.fits(scale.levels + 1, 1.0));
        // Values take most of the ring; the noise the rest.
        let room = ((1u64 << 30) - 1) as f64;
        let values = 100.0 * scale.levels as f64;
        assert!(values > 0.85 * room && values <= room, "{values}");
        // The guaranteed devices carry σ·Δ₂.
        let l2 = Sensitivity::of(scale.levels, 100_000).l2;
        let carried = scale.noise.guaranteed_variance();
        assert!((carried / l2.powi(2) - 1.0).abs() < 1e-12);
    }

    #[test]
    fn a_narrow_ring_is_refused_naming_the_bits_it_needs() {
        let shape = hundred_devices(16);
        let error = shape.scale(&UNIT).unwrap_err().to_string();
        // 100·3163 values plus about 10·3163 of noise: 19 bits of magnitude.
        assert!(error.contains("bits = 16 could overflow"), "{error}");
        assert!(error.contains("needs 20 bits"), "{error}");
        assert!(error.contains("raise bits to 20"), "{error}");
        let wider = RoundShape { bits: 20, ..shape };
        assert!(wider.scale(&UNIT).is_ok());
        let loud = NoiseTarget {
            noise_multiplier: 1e6,
            ..UNIT
        };
        let error = hundred_devices(32).scale(&loud).unwrap_err().to_string();
        assert!(
            error.contains("noise multiplier 1000000 is too large"),
            "{error}"
        );
        let none = RoundShape {
            guaranteed_devices: 0,
            ..shape
        };
        let error = none.scale(&UNIT).unwrap_err().to_string();
        assert!(error.contains("guarantee none"), "{error}");
    }
}
