//! What a job configures and what a round derives from it: the graph
//! degree k, the Shamir threshold t, the ring width b and the fixed-point
//! scale.
//!
//! k and t come from exact hypergeometric tails (a device's k neighbours
//! are a uniformly random k-subset of the other n − 1 devices), with two
//! targets per round, both as union bounds over the n devices:
//! - correctness: P[some surviving device has fewer than t neighbours that
//!   answer in Unmasking] ≤ 2⁻²⁰, counting corrupt devices as dropouts
//!   (they may withhold their shares);
//! - privacy: P[some honest device has at least 2t − k corrupt neighbours]
//!   ≤ 2⁻⁴⁰. Below that, the server cannot collect t shares of both an
//!   honest device's self-mask seed and its mask key, even by asking one
//!   half of its honest neighbours for one and the other half for the
//!   other, because each honest neighbour answers one kind only;
//! - privacy: P[the devices that drop out or are corrupt include k/2
//!   consecutive devices of the graph's ordering somewhere] ≤ 2⁻⁴⁰. Without
//!   such a run the honest survivors stay connected, so the server learns
//!   only their total, never the sum of a smaller group.

use serde::{Deserialize, Serialize};

use super::SecAggError;

pub const MIN_BITS: u32 = 8;
/// At most 32 bits per element, so that a masked upload is never larger
/// than the float32 update it replaces.
pub const MAX_BITS: u32 = 32;
/// Fewest fixed-point levels on each side of zero an update may keep.
pub const MIN_PRECISION_LEVELS: i64 = 127;
pub const MIN_PARTICIPANTS: usize = 3;
pub const MAX_PARTICIPANTS: usize = 100_000;
/// The largest graph degree before the complete graph; a bound on every
/// per-device message.
pub const MAX_DEGREE: usize = 1_024;
pub const MAX_WEIGHT: u64 = 1 << 20;
pub const MAX_CLIP: f64 = 1e6;
pub const MAX_DROPOUT_FRACTION: f64 = 0.5;
pub const MAX_CORRUPT_FRACTION: f64 = 0.3;
/// log₂ of the per-round failure probabilities the (k, t) choice targets.
pub const CORRECTNESS_LOG2: f64 = -20.0;
pub const PRIVACY_LOG2: f64 = -40.0;

/// A job's `secure_aggregation` settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecAggConfig {
    #[serde(default)]
    pub enabled: bool,
    /// Fraction of a round's devices that may drop out at any stage.
    #[serde(default = "default_dropout")]
    pub max_dropout_fraction: f64,
    /// Fraction of a round's devices that may collude with the server.
    #[serde(default = "default_corrupt")]
    pub max_corrupt_fraction: f64,
    /// Each coordinate of an update is clipped to [−clip, clip].
    #[serde(default = "default_clip")]
    pub clip: f64,
    /// Ring width b: masking works in Z_{2^b}, and each element travels in
    /// b bits.
    #[serde(default = "default_bits")]
    pub bits: u32,
    /// Sample-count weights are capped here, so that the weighted sum has
    /// a bound to fit under 2^b.
    #[serde(default = "default_max_weight")]
    pub max_weight: u64,
}

fn default_dropout() -> f64 {
    0.1
}
fn default_corrupt() -> f64 {
    0.0
}
fn default_clip() -> f64 {
    1.0
}
/// One bit under float32, so that the masked vector and the key exchange
/// together stay below a float32 upload; the bit costs half the precision.
fn default_bits() -> u32 {
    31
}
fn default_max_weight() -> u64 {
    1024
}

impl Default for SecAggConfig {
    fn default() -> Self {
        SecAggConfig {
            enabled: false,
            max_dropout_fraction: default_dropout(),
            max_corrupt_fraction: default_corrupt(),
            clip: default_clip(),
            bits: default_bits(),
            max_weight: default_max_weight(),
        }
    }
}

/// A round's public parameters, sent to every participant with its task.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Plan {
    /// Devices selected for the round.
    pub participants: usize,
    /// Neighbours per device (n − 1 means the complete graph).
    pub degree: usize,
    /// Shares needed to rebuild a secret.
    pub threshold: usize,
    pub bits: u32,
    pub clip: f64,
    /// Fixed-point levels on each side of zero: a clipped coordinate x
    /// becomes round(x · levels / clip).
    pub levels: i64,
    pub max_weight: u64,
    /// Devices that may drop out, over all stages, before the round fails.
    pub max_dropouts: usize,
    /// Trainable values per update; the masked vector has one more, the
    /// weight.
    pub update_len: usize,
}

impl SecAggConfig {
    /// Checks the settings alone, then that rounds of `min_devices` to
    /// `max_devices` devices can all run: k and t exist, and the weighted
    /// sum of `max_devices` updates fits in b bits.
    pub fn validate(&self, min_devices: usize, max_devices: usize) -> Result<(), SecAggError> {
        self.check_fields()?;
        self.plan(min_devices, 1)?;
        self.plan(max_devices, 1)?;
        Ok(())
    }

    /// Checks each setting's own range, whether or not secure aggregation
    /// is enabled, so that a job never stores a setting it would refuse.
    pub fn check_fields(&self) -> Result<(), SecAggError> {
        let config = |message: String| Err(SecAggError::Config(message));
        if !(0.0..=MAX_DROPOUT_FRACTION).contains(&self.max_dropout_fraction) {
            return config(format!(
                "max_dropout_fraction must be between 0 and {MAX_DROPOUT_FRACTION}, got {}",
                self.max_dropout_fraction
            ));
        }
        if !(0.0..=MAX_CORRUPT_FRACTION).contains(&self.max_corrupt_fraction) {
            return config(format!(
                "max_corrupt_fraction must be between 0 and {MAX_CORRUPT_FRACTION}, got {}",
                self.max_corrupt_fraction
            ));
        }
        if !(self.clip.is_finite() && self.clip > 0.0 && self.clip <= MAX_CLIP) {
            return config(format!(
                "clip must be a positive number up to {MAX_CLIP}, got {}",
                self.clip
            ));
        }
        if !(MIN_BITS..=MAX_BITS).contains(&self.bits) {
            return config(format!(
                "bits must be between {MIN_BITS} and {MAX_BITS} (a masked element may not be \
                 wider than the float32 it replaces), got {}",
                self.bits
            ));
        }
        if !(1..=MAX_WEIGHT).contains(&self.max_weight) {
            return config(format!(
                "max_weight must be between 1 and {MAX_WEIGHT}, got {}",
                self.max_weight
            ));
        }
        Ok(())
    }

    /// The parameters of a round of `participants` devices sending
    /// `update_len` values each.
    pub fn plan(&self, participants: usize, update_len: usize) -> Result<Plan, SecAggError> {
        self.check_fields()?;
        if !(MIN_PARTICIPANTS..=MAX_PARTICIPANTS).contains(&participants) {
            return Err(SecAggError::Config(format!(
                "secure aggregation needs {MIN_PARTICIPANTS} to {MAX_PARTICIPANTS} devices per \
                 round, got {participants} (with fewer than {MIN_PARTICIPANTS}, the sum gives \
                 each device's update away to the others)"
            )));
        }
        let levels = self.levels_for(participants)?;
        let (degree, threshold) = choose_degree_and_threshold(
            participants,
            self.max_dropout_fraction,
            self.max_corrupt_fraction,
        )?;
        Ok(Plan {
            participants,
            degree,
            threshold,
            bits: self.bits,
            clip: self.clip,
            levels,
            max_weight: self.max_weight,
            max_dropouts: (self.max_dropout_fraction * participants as f64).floor() as usize,
            update_len,
        })
    }

    /// The widest fixed-point scale under which n updates of weight ≤
    /// max_weight sum without overflow: |Σ wᵢ·qᵢ| ≤ n·W·L ≤ 2^(b−1) − 1, and
    /// Σ wᵢ ≤ n·W < 2^b.
    fn levels_for(&self, participants: usize) -> Result<i64, SecAggError> {
        let headroom = participants as u128 * u128::from(self.max_weight);
        let positive_range = (1u128 << (self.bits - 1)) - 1;
        let levels = positive_range / headroom;
        if levels < MIN_PRECISION_LEVELS as u128 {
            let needed = bits_needed(headroom);
            let remedy = if needed <= MAX_BITS {
                format!(
                    "raise bits to {needed}, lower max_weight, or select fewer devices per round"
                )
            } else {
                format!(
                    "that is over the {MAX_BITS}-bit limit, so lower max_weight or select fewer \
                     devices per round"
                )
            };
            return Err(SecAggError::Config(format!(
                "bits = {} could overflow: the sum of {participants} updates, each weighted up \
                 to max_weight = {} at the minimum {MIN_PRECISION_LEVELS} fixed-point levels per \
                 side, needs {needed} bits; {remedy}",
                self.bits, self.max_weight
            )));
        }
        Ok(levels.min(i64::MAX as u128) as i64)
    }
}

fn bits_needed(headroom: u128) -> u32 {
    let max_sum = headroom * MIN_PRECISION_LEVELS as u128;
    // Sign bit plus the magnitude.
    1 + (128 - max_sum.leading_zeros())
}

impl Plan {
    /// Length of the masked vector: the update and its weight.
    pub fn masked_len(&self) -> usize {
        self.update_len + 1
    }

    pub fn modulus_mask(&self) -> u32 {
        if self.bits == 32 {
            u32::MAX
        } else {
            (1u32 << self.bits) - 1
        }
    }

    /// Bytes of a bit-packed masked vector.
    pub fn packed_bytes(&self) -> usize {
        (self.masked_len() * self.bits as usize).div_ceil(8)
    }

    /// Checks a plan received from elsewhere before a device acts on it.
    pub fn validate(&self) -> Result<(), SecAggError> {
        let bad = |message: String| Err(SecAggError::Config(message));
        if !(MIN_PARTICIPANTS..=MAX_PARTICIPANTS).contains(&self.participants) {
            return bad(format!(
                "plan.participants {} is out of range",
                self.participants
            ));
        }
        let complete = self.participants - 1;
        if self.degree < 2 || self.degree > MAX_DEGREE {
            return bad(format!("plan.degree {} is out of range", self.degree));
        }
        if self.degree > complete {
            return bad(format!(
                "plan.degree {} exceeds the {complete} other devices",
                self.degree
            ));
        }
        if self.threshold <= self.degree / 2 || self.threshold > self.degree {
            return bad(format!(
                "plan.threshold {} must be above half the degree {} and at most the degree",
                self.threshold, self.degree
            ));
        }
        if !(MIN_BITS..=MAX_BITS).contains(&self.bits) {
            return bad(format!("plan.bits {} is out of range", self.bits));
        }
        if !(self.clip.is_finite() && self.clip > 0.0 && self.clip <= MAX_CLIP) {
            return bad(format!("plan.clip {} is out of range", self.clip));
        }
        let headroom = self.participants as u128 * u128::from(self.max_weight.max(1));
        if self.levels < 1
            || self.max_weight == 0
            || self.max_weight > MAX_WEIGHT
            || headroom * self.levels as u128 > (1u128 << (self.bits - 1)) - 1
        {
            return bad(format!(
                "plan.levels {} with max_weight {} could overflow {} bits",
                self.levels, self.max_weight, self.bits
            ));
        }
        if self.max_dropouts + self.threshold > self.participants {
            return bad(format!(
                "plan.max_dropouts {} leaves fewer than the threshold {} of {} devices",
                self.max_dropouts, self.threshold, self.participants
            ));
        }
        if self.update_len == 0 || self.update_len > crate::update::MAX_ELEMENTS {
            return bad(format!(
                "plan.update_len {} is out of range",
                self.update_len
            ));
        }
        Ok(())
    }
}

/// Smallest even degree (or the complete graph) whose smallest private
/// threshold also meets the correctness target.
pub fn choose_degree_and_threshold(
    participants: usize,
    dropout_fraction: f64,
    corrupt_fraction: f64,
) -> Result<(usize, usize), SecAggError> {
    let n = participants;
    let log_factorials = LogFactorials::new(n);
    let dropped = (dropout_fraction * n as f64).floor() as usize;
    let corrupt = (corrupt_fraction * n as f64).floor() as usize;
    let union = (n as f64).log2();
    // The complete graph only while it stays within the message bounds.
    let candidates = (2..n.saturating_sub(1).min(MAX_DEGREE + 1))
        .step_by(2)
        .chain((n - 1 <= MAX_DEGREE).then_some(n - 1));
    for degree in candidates {
        let others = n - 1;
        let tail = |bad: usize, at_least: usize| {
            log_factorials.hypergeometric_tail_log2(others, bad.min(others), degree, at_least)
        };
        let mut threshold = degree / 2 + 1;
        // Privacy: fewer than 2t − k corrupt neighbours, with margin.
        while threshold <= degree && tail(corrupt, 2 * threshold - degree) + union > PRIVACY_LOG2 {
            threshold += 1;
        }
        if threshold > degree {
            continue;
        }
        let silent = dropped + corrupt;
        // Privacy: the honest survivors stay connected, or the server would
        // learn the sum of each part separately.
        if degree < n - 1
            && log_factorials.run_removed_log2(n, silent, degree / 2) + union > PRIVACY_LOG2
        {
            continue;
        }
        // Correctness: more than k − t silent neighbours is a failure.
        if tail(silent, degree - threshold + 1) + union <= CORRECTNESS_LOG2 {
            return Ok((degree, threshold));
        }
    }
    Err(SecAggError::Config(format!(
        "no graph degree up to {} tolerates {:.0}% dropouts and {:.0}% corrupt devices among \
         {n} devices at the targeted failure probabilities (2^{CORRECTNESS_LOG2} and \
         2^{PRIVACY_LOG2}); lower the tolerances or select more devices",
        MAX_DEGREE.min(n - 1),
        dropout_fraction * 100.0,
        corrupt_fraction * 100.0
    )))
}

struct LogFactorials(Vec<f64>);

impl LogFactorials {
    fn new(n: usize) -> Self {
        let mut table = Vec::with_capacity(n + 1);
        let mut acc = 0.0f64;
        table.push(0.0);
        for i in 1..=n {
            acc += (i as f64).ln();
            table.push(acc);
        }
        LogFactorials(table)
    }

    fn ln_choose(&self, n: usize, k: usize) -> f64 {
        self.0[n] - self.0[k] - self.0[n - k]
    }

    /// log₂ of the chance that `run` given positions of a random ordering of
    /// `n` all fall among `removed` random devices. In the Harary graph,
    /// survivors on either side of a run of k/2 removed devices are not
    /// joined, and the graph splits only where there are two such runs.
    fn run_removed_log2(&self, n: usize, removed: usize, run: usize) -> f64 {
        if removed < run {
            return f64::NEG_INFINITY;
        }
        (self.ln_choose(n - run, removed - run) - self.ln_choose(n, removed))
            / std::f64::consts::LN_2
    }

    /// log₂ P[X ≥ at_least] for X ~ Hypergeometric(population, marked, draws).
    fn hypergeometric_tail_log2(
        &self,
        population: usize,
        marked: usize,
        draws: usize,
        at_least: usize,
    ) -> f64 {
        let top = marked.min(draws);
        let low = at_least.max(draws.saturating_sub(population - marked));
        if low > top {
            return f64::NEG_INFINITY;
        }
        let total = self.ln_choose(population, draws);
        let terms: Vec<f64> = (low..=top)
            .map(|i| {
                self.ln_choose(marked, i) + self.ln_choose(population - marked, draws - i) - total
            })
            .collect();
        let peak = terms.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = terms.iter().map(|t| (t - peak).exp()).sum();
        (peak + sum.ln()) / std::f64::consts::LN_2
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_give_a_sparse_graph_for_large_rounds() {
        let (k, t) = choose_degree_and_threshold(1000, 0.1, 0.05).unwrap();
        assert!(k < 200, "k = {k}");
        assert!(t > k / 2 && t <= k);
        // Three of ten may drop: every survivor needs t of its k
        // neighbours left, and no run of k/2 consecutive dropouts.
        assert_eq!(choose_degree_and_threshold(10, 0.3, 0.0).unwrap(), (8, 5));
        assert_eq!(
            choose_degree_and_threshold(6, 0.34, 0.0).unwrap(),
            (5, 3),
            "complete graph"
        );
    }

    #[test]
    fn an_overflowing_configuration_names_the_bits_it_needs() {
        let config = SecAggConfig {
            enabled: true,
            bits: 24,
            ..SecAggConfig::default()
        };
        let error = config.validate(10, 1000).unwrap_err().to_string();
        assert!(error.contains("bits = 24 could overflow"), "{error}");
        assert!(error.contains("needs 28 bits"), "{error}");
        SecAggConfig { bits: 28, ..config }
            .validate(10, 1000)
            .unwrap();
    }

    #[test]
    fn impossible_tolerances_are_refused() {
        let error = choose_degree_and_threshold(5, 0.5, 0.3).unwrap_err();
        assert!(error.to_string().contains("no graph degree"), "{error}");
    }

    #[test]
    fn hypergeometric_tail_matches_a_direct_count() {
        let table = LogFactorials::new(20);
        // 3 marked among 10, draw 4: P[X ≥ 2] = (C(3,2)C(7,2) + C(3,3)C(7,1)) / C(10,4).
        let expected = (3.0 * 21.0 + 7.0) / 210.0f64;
        let got = table.hypergeometric_tail_log2(10, 3, 4, 2).exp2();
        assert!((got - expected).abs() < 1e-12, "{got} vs {expected}");
    }
}
