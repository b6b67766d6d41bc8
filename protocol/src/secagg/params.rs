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
use super::noise::{DeviceNoise, NoiseTarget, RoundShape};

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
    /// [`graph::commitment`](super::graph::commitment) of the round's graph
    /// seed, sent with the task, before any device has made its round
    /// keys. A device checks the seed it is sent in NeighbourKeys against
    /// it, so the server cannot pick the graph after seeing the keys.
    /// Zero until [`Plan::commit_graph`].
    #[serde(default, with = "hex_32")]
    pub graph_commitment: [u8; 32],
    /// Distributed differential privacy: the Skellam noise each device adds
    /// before masking ([`super::noise`]). A device that does not know this
    /// field refuses the plan (unknown fields are denied), rather than send
    /// an update without its noise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_noise: Option<DeviceNoise>,
}

/// 32 bytes as 64 lowercase hex digits in JSON.
mod hex_32 {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(bytes: &[u8; 32], serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&hex::encode(bytes))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<[u8; 32], D::Error> {
        let text = String::deserialize(deserializer)?;
        let mut out = [0u8; 32];
        hex::decode_to_slice(&text, &mut out).map_err(|e| {
            serde::de::Error::custom(format!("graph_commitment: expected 64 hex digits: {e}"))
        })?;
        Ok(out)
    }
}

impl SecAggConfig {
    /// Checks the settings alone, then that a round of every size from
    /// `min_devices` to `max_devices` can run: its weighted sum fits in b
    /// bits, and some degree and threshold meet the targets. Sizes with no
    /// plan need not sit at the ends of the range (the dropout and corrupt
    /// counts are floors, and the degree is capped), so each is checked,
    /// and the error names those that fail.
    pub fn validate(&self, min_devices: usize, max_devices: usize) -> Result<(), SecAggError> {
        self.check_fields()?;
        check_participants(min_devices)?;
        check_participants(max_devices)?;
        if min_devices > max_devices {
            return Err(SecAggError::Config(format!(
                "the smallest round ({min_devices} devices) is larger than the largest \
                 ({max_devices})"
            )));
        }
        // The scale only tightens as rounds grow.
        self.scale_for(max_devices)?;
        let failing = sizes_without_a_graph(
            min_devices..=max_devices,
            self.max_dropout_fraction,
            self.max_corrupt_fraction,
        );
        let Some(first) = failing.ranges.first().map(|range| *range.start()) else {
            return Ok(());
        };
        let cause = choose_degree_and_threshold(
            first,
            self.max_dropout_fraction,
            self.max_corrupt_fraction,
        )
        .err()
        .map(|error| error.to_string())
        .unwrap_or_default();
        let unchecked = failing
            .unchecked_above
            .map(|above| format!(" (sizes above {} were not checked)", thousands(above)))
            .unwrap_or_default();
        Err(SecAggError::Config(format!(
            "rounds of {} devices have no plan{unchecked}: {}",
            name_ranges(&failing.ranges),
            cause.trim_start_matches("secure_aggregation: ")
        )))
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

    /// The settings of a tiered job's own rounds, whose participants are
    /// aggregators: each masks its sub-round's mean update weighted by the
    /// sub-round's total weight, at most `sub_round_devices` device
    /// weights, so the weight cap is that many times this one. The cap
    /// must hold whole for rounds of up to `max_aggregators` (where
    /// [`SecAggConfig::scale_for`] would shrink it, an aggregator's weight
    /// would be cut, and the job's FedAvg would no longer weight every end
    /// device alike), so such settings are refused here, naming the bits
    /// they need.
    pub fn for_aggregators(
        &self,
        sub_round_devices: u32,
        max_aggregators: usize,
    ) -> Result<SecAggConfig, SecAggError> {
        let max_weight = self.max_weight.saturating_mul(u64::from(sub_round_devices));
        if max_weight > MAX_WEIGHT {
            return Err(SecAggError::Config(format!(
                "an aggregator's weight can reach {} ({sub_round_devices} end devices at \
                 max_weight {}), over the {} a secure sum carries; lower max_weight or the \
                 sub-rounds' target_devices",
                thousands(max_weight as usize),
                self.max_weight,
                thousands(MAX_WEIGHT as usize)
            )));
        }
        let tier = SecAggConfig {
            max_weight,
            ..self.clone()
        };
        let n = max_aggregators.max(MIN_PARTICIPANTS);
        let kept = tier.scale_for(n)?.max_weight;
        if kept < max_weight {
            let needed = bits_needed(n as u128 * u128::from(max_weight));
            let remedy = bits_remedy(needed, "lower max_weight or the sub-rounds' target_devices");
            return Err(SecAggError::Config(format!(
                "rounds of {n} aggregators with weights up to {} ({sub_round_devices} end \
                 devices at max_weight {}) need {needed} bits at the minimum \
                 {MIN_PRECISION_LEVELS} levels per side, and bits = {}; {remedy}",
                thousands(max_weight as usize),
                self.max_weight,
                self.bits
            )));
        }
        Ok(tier)
    }

    /// The parameters of a round of `participants` devices sending
    /// `update_len` values each.
    pub fn plan(&self, participants: usize, update_len: usize) -> Result<Plan, SecAggError> {
        self.check_fields()?;
        check_participants(participants)?;
        let Scale { levels, max_weight } = self.scale_for(participants)?;
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
            max_weight,
            max_dropouts: (self.max_dropout_fraction * participants as f64).floor() as usize,
            update_len,
            graph_commitment: [0; 32],
            device_noise: None,
        })
    }

    /// The parameters of a round of `participants` devices under
    /// distributed differential privacy ([`super::noise`]): every device
    /// weighs 1 (a sample count would let one device outweigh the
    /// sensitivity), each coordinate is clipped to the L2 clip (no
    /// coordinate of a clipped update is longer), and the levels leave the
    /// ring room for the noise.
    pub fn private_plan(
        &self,
        participants: usize,
        update_len: usize,
        target: &NoiseTarget,
    ) -> Result<Plan, SecAggError> {
        self.check_fields()?;
        check_participants(participants)?;
        // First, so that a ring too narrow names the bits the noise needs.
        // A scale that fits leaves the plain plan's scale room too: weight
        // 1 at no fewer than its minimum levels.
        let scale = self.private_shape(participants, update_len).scale(target)?;
        Ok(Plan {
            clip: target.clip_norm,
            levels: scale.levels,
            max_weight: 1,
            device_noise: Some(scale.noise),
            ..self.plan(participants, update_len)?
        })
    }

    /// A private round of `participants` devices, as its scale sees it.
    fn private_shape(&self, participants: usize, update_len: usize) -> RoundShape {
        let round = RoundSize::new(
            participants,
            self.max_dropout_fraction,
            self.max_corrupt_fraction,
        );
        RoundShape {
            bits: self.bits,
            participants,
            guaranteed_devices: participants.saturating_sub(round.dropped + round.corrupt),
            update_len,
        }
    }

    /// What a job with distributed differential privacy, whose models
    /// train `update_len` values, needs beyond [`SecAggConfig::validate`]
    /// (which its caller runs): every round size from `min_devices` to
    /// `max_devices` must keep the fewest levels with room for its noise.
    pub fn validate_private_scale(
        &self,
        min_devices: usize,
        max_devices: usize,
        update_len: usize,
        target: &NoiseTarget,
    ) -> Result<(), SecAggError> {
        if update_len == 0 || update_len > crate::update::MAX_ELEMENTS {
            return Err(SecAggError::Config(format!(
                "a model of {update_len} trainable values cannot be aggregated"
            )));
        }
        (min_devices..=max_devices).try_for_each(|n| {
            let shape = self.private_shape(n, update_len);
            shape.check_fewest_levels(target).map(|_| ())
        })
    }

    /// The fixed-point scale of a round of n devices: the most levels L
    /// under which n updates of weight at most W sum without overflow,
    /// |Σ wᵢ·qᵢ| ≤ n·W·L ≤ 2^(b−1) − 1 (and Σ wᵢ ≤ n·W < 2^b).
    ///
    /// W is the job's `max_weight` while that leaves at least
    /// [`MIN_PRECISION_LEVELS`]; past that round size the weight cap
    /// shrinks with n instead, so that large rounds run at the default
    /// ring width (b = 31: `max_weight` 1,024 up to 8,256 devices, then
    /// 845 at 10,000 and 84 at 100,000). The plan carries the cap devices
    /// apply. Only when not even weight 1 leaves enough levels is the
    /// round refused, naming the bits it needs.
    pub fn scale_for(&self, participants: usize) -> Result<Scale, SecAggError> {
        let positive_range = (1u128 << (self.bits - 1)) - 1;
        let n = participants as u128;
        let affordable = positive_range / (n * MIN_PRECISION_LEVELS as u128);
        let max_weight = u128::from(self.max_weight).min(affordable);
        if max_weight == 0 {
            let needed = bits_needed(n);
            let remedy = bits_remedy(needed, "select fewer devices per round");
            return Err(SecAggError::Config(format!(
                "bits = {} could overflow: the sum of {participants} updates at the minimum \
                 {MIN_PRECISION_LEVELS} fixed-point levels per side needs {needed} bits even at \
                 weight 1; {remedy}",
                self.bits
            )));
        }
        let levels = positive_range / (n * max_weight);
        Ok(Scale {
            levels: levels.min(i64::MAX as u128) as i64,
            max_weight: max_weight as u64,
        })
    }
}

/// The fixed-point scale of a round: levels per side and the weight cap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scale {
    pub levels: i64,
    pub max_weight: u64,
}

fn check_participants(participants: usize) -> Result<(), SecAggError> {
    if !(MIN_PARTICIPANTS..=MAX_PARTICIPANTS).contains(&participants) {
        return Err(SecAggError::Config(format!(
            "secure aggregation needs {MIN_PARTICIPANTS} to {MAX_PARTICIPANTS} devices per \
             round, got {participants} (with fewer than {MIN_PARTICIPANTS}, the sum gives \
             each device's update away to the others)"
        )));
    }
    Ok(())
}

/// What to do when a sum needs `needed` bits: raise `bits` to it where it
/// is allowed, else `otherwise`.
fn bits_remedy(needed: u32, otherwise: &str) -> String {
    if needed <= MAX_BITS {
        format!("raise bits to {needed}, or {otherwise}")
    } else {
        format!("that is over the {MAX_BITS}-bit limit, so {otherwise}")
    }
}

/// Ring width for `weight_units` (n·W) at the minimum levels.
fn bits_needed(weight_units: u128) -> u32 {
    let max_sum = weight_units * MIN_PRECISION_LEVELS as u128;
    // Sign bit plus the magnitude.
    1 + (128 - max_sum.leading_zeros())
}

impl Plan {
    /// The plan with its commitment to the round's graph seed.
    pub fn commit_graph(mut self, graph_seed: &[u8; 32]) -> Plan {
        self.graph_commitment = super::graph::commitment(graph_seed);
        self
    }

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
        if let Some(noise) = &self.device_noise {
            self.validate_noise(noise)?;
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

    /// A private plan's noise: shares a device can draw exactly, carried by
    /// devices the round keeps, with every device weighing 1 and room in
    /// the ring for the noise of all participants.
    fn validate_noise(&self, noise: &DeviceNoise) -> Result<(), SecAggError> {
        let bad = |message: String| Err(SecAggError::Config(message));
        let variance = noise.variance;
        if !(variance.is_finite()
            && variance > 0.0
            && variance <= super::noise::MAX_DEVICE_VARIANCE)
        {
            return bad(format!(
                "plan.device_noise.variance {variance} is out of range"
            ));
        }
        let kept = self.participants.saturating_sub(self.max_dropouts);
        if noise.guaranteed_devices == 0 || noise.guaranteed_devices > kept {
            return bad(format!(
                "plan.device_noise.guaranteed_devices {} is not between 1 and the {kept} \
                 devices the round keeps",
                noise.guaranteed_devices
            ));
        }
        if self.max_weight != 1 {
            return bad(format!(
                "plan.max_weight is {} in a private round, where every device weighs 1",
                self.max_weight
            ));
        }
        let (n, d) = (self.participants, self.update_len);
        if !super::noise::sum_fits_ring(self.bits, n, self.levels, variance, d) {
            return bad(format!(
                "plan.levels {} leave no room in {} bits for the noise of variance {variance} \
                 from each of {} devices",
                self.levels, self.bits, self.participants
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
    let table = LogFactorials::new(n);
    let round = RoundSize::new(n, dropout_fraction, corrupt_fraction);
    round.search(&table).ok_or_else(|| {
        SecAggError::Config(format!(
            "no graph degree up to {} tolerates {:.0}% dropouts and {:.0}% corrupt devices \
                 among {n} devices at the targeted failure probabilities (2^{CORRECTNESS_LOG2} \
                 and 2^{PRIVACY_LOG2}); lower the tolerances or select more devices",
            MAX_DEGREE.min(n - 1),
            dropout_fraction * 100.0,
            corrupt_fraction * 100.0
        ))
    })
}

/// The most sizes without a plan that [`sizes_without_a_graph`] looks
/// for before it stops: a size with none tries every degree (about a
/// millisecond), a size with one nearly always its first.
pub const MAX_FAILING_SIZES_CHECKED: usize = 1_000;

/// The round sizes in `sizes` for which no degree meets the targets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SizesWithoutAGraph {
    /// Ascending, disjoint.
    pub ranges: Vec<std::ops::RangeInclusive<usize>>,
    /// Set when the search stopped after [`MAX_FAILING_SIZES_CHECKED`]
    /// failing sizes: the sizes above this one were not checked.
    pub unchecked_above: Option<usize>,
}

/// Checks each size in `sizes`. Only whether a plan exists matters here,
/// not which degree is smallest, so each size first tries the degree that
/// worked for the size before it (which nearly always works), and searches
/// all only if not: 3..=100,000 at the default tolerances takes tens of
/// milliseconds.
pub fn sizes_without_a_graph(
    sizes: std::ops::RangeInclusive<usize>,
    dropout_fraction: f64,
    corrupt_fraction: f64,
) -> SizesWithoutAGraph {
    let table = LogFactorials::new(*sizes.end());
    let mut out = SizesWithoutAGraph {
        ranges: Vec::new(),
        unchecked_above: None,
    };
    let (mut last_good, mut failed): (Option<usize>, usize) = (None, 0);
    for n in sizes {
        if failed == MAX_FAILING_SIZES_CHECKED {
            out.unchecked_above = Some(n - 1);
            break;
        }
        let round = RoundSize::new(n, dropout_fraction, corrupt_fraction);
        let warm = last_good.filter(|&degree| round.is_candidate(degree));
        let found = warm
            .filter(|&degree| round.check(&table, degree, None).1)
            .or_else(|| round.search(&table).map(|(degree, _)| degree));
        match (found, out.ranges.last_mut()) {
            (Some(degree), _) => last_good = Some(degree),
            (None, Some(range)) if *range.end() + 1 == n => *range = *range.start()..=n,
            (None, _) => out.ranges.push(n..=n),
        }
        failed += usize::from(found.is_none());
    }
    out
}

/// "2,170 to 2,188 and 4,001": ranges as a person reads them, the first
/// few only.
fn name_ranges(ranges: &[std::ops::RangeInclusive<usize>]) -> String {
    const SHOWN: usize = 4;
    let mut names: Vec<String> = ranges
        .iter()
        .take(SHOWN)
        .map(|range| match range.end() - range.start() {
            0 => thousands(*range.start()),
            _ => format!(
                "{} to {}",
                thousands(*range.start()),
                thousands(*range.end())
            ),
        })
        .collect();
    if ranges.len() > SHOWN {
        names.push(format!("{} more ranges", ranges.len() - SHOWN));
    }
    match names.split_last() {
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} and {last}", rest.join(", ")),
        None => String::new(),
    }
}

/// `n` with commas between thousands: 2,189.
pub fn thousands(n: usize) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// One round size's tolerances, for the degree search.
struct RoundSize {
    n: usize,
    /// ⌊δn⌋ and ⌊γn⌋.
    dropped: usize,
    corrupt: usize,
    /// log₂ n: each target is a union bound over the n devices.
    union: f64,
}

impl RoundSize {
    fn new(n: usize, dropout_fraction: f64, corrupt_fraction: f64) -> RoundSize {
        RoundSize {
            n,
            dropped: (dropout_fraction * n as f64).floor() as usize,
            corrupt: (corrupt_fraction * n as f64).floor() as usize,
            union: (n as f64).log2(),
        }
    }

    /// Even degrees from 2 up to [`MAX_DEGREE`] below n − 1, then the
    /// complete graph while it stays within the message bounds.
    fn candidates(&self) -> impl Iterator<Item = usize> + use<> {
        let n = self.n;
        (2..n.saturating_sub(1).min(MAX_DEGREE + 1))
            .step_by(2)
            .chain((n - 1 <= MAX_DEGREE).then_some(n - 1))
    }

    fn is_candidate(&self, degree: usize) -> bool {
        let complete = self.n - 1;
        (degree < complete && degree.is_multiple_of(2) && degree <= MAX_DEGREE)
            || (degree == complete && complete <= MAX_DEGREE)
    }

    /// The first candidate degree that meets all three targets, with its
    /// smallest threshold.
    fn search(&self, table: &LogFactorials) -> Option<(usize, usize)> {
        let mut known: Option<(usize, usize)> = None;
        for degree in self.candidates() {
            let (threshold, meets) = self.check(table, degree, known);
            if meets {
                return threshold.map(|t| (degree, t));
            }
            if let Some(t) = threshold {
                known = Some((degree, t));
            }
        }
        None
    }

    /// Whether `degree` meets all three targets: the smallest private
    /// threshold (if any), and whether the other two targets hold at it.
    /// `known`, a smaller degree's smallest private threshold, bounds this
    /// one's from below: two more neighbours add at most two corrupt ones,
    /// so t(k + 2j) ≥ t(k) + j, and the search starts there instead of at
    /// k/2 + 1 (it then nearly always stops at its first or second step).
    fn check(
        &self,
        table: &LogFactorials,
        degree: usize,
        known: Option<(usize, usize)>,
    ) -> (Option<usize>, bool) {
        let others = self.n - 1;
        let tail = |bad: usize, at_least: usize| {
            table.hypergeometric_tail_log2(others, bad.min(others), degree, at_least)
        };
        // Privacy: fewer than 2t − k corrupt neighbours, with margin.
        let private = |t: usize| tail(self.corrupt, 2 * t - degree) + self.union <= PRIVACY_LOG2;
        let lowest = match known {
            Some((smaller, t)) if smaller < degree => t + (degree - smaller) / 2,
            _ => 0,
        };
        let threshold = (lowest.max(degree / 2 + 1)..=degree).find(|&t| private(t));
        let Some(threshold) = threshold else {
            return (None, false);
        };
        let silent = self.dropped + self.corrupt;
        // Privacy: the honest survivors stay connected, or the server
        // would learn the sum of each part separately.
        if degree < others
            && table.run_removed_log2(self.n, silent, degree / 2) + self.union > PRIVACY_LOG2
        {
            return (Some(threshold), false);
        }
        // Correctness: more than k − t silent neighbours is a failure.
        let correct = tail(silent, degree - threshold + 1) + self.union <= CORRECTNESS_LOG2;
        (Some(threshold), correct)
    }
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
    ///
    /// The terms rise to the mode and fall after it, so the sum starts at
    /// the largest term in range and walks outwards, stopping in each
    /// direction once a term is below 2⁻⁶⁰ of the largest: the sum is exact
    /// to that relative error, and costs a few standard deviations of
    /// terms instead of all `draws` of them.
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
        let term = |i: usize| {
            self.ln_choose(marked, i) + self.ln_choose(population - marked, draws - i) - total
        };
        let mode = ((draws + 1) * (marked + 1) / (population + 2)).clamp(low, top);
        let peak = term(mode);
        let negligible = peak - 60.0 * std::f64::consts::LN_2;
        let mut sum = 1.0;
        for i in (mode + 1)..=top {
            let t = term(i);
            if t < negligible {
                break;
            }
            sum += (t - peak).exp();
        }
        for i in (low..mode).rev() {
            let t = term(i);
            if t < negligible {
                break;
            }
            sum += (t - peak).exp();
        }
        (peak + f64::ln(sum)) / std::f64::consts::LN_2
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
            bits: 16,
            ..SecAggConfig::default()
        };
        let error = config.validate(10, 1000).unwrap_err().to_string();
        assert!(error.contains("bits = 16 could overflow"), "{error}");
        assert!(error.contains("needs 18 bits even at weight 1"), "{error}");
        SecAggConfig { bits: 18, ..config }
            .validate(10, 1000)
            .unwrap();
    }

    #[test]
    fn the_weight_cap_shrinks_with_the_round_at_the_default_width() {
        let config = SecAggConfig {
            enabled: true,
            ..SecAggConfig::default()
        };
        for (n, max_weight) in [
            (10, 1024),
            (8_256, 1024),
            (8_257, 1023),
            (10_000, 845),
            (100_000, 84),
        ] {
            let plan = config.plan(n, 1000).unwrap();
            assert_eq!(plan.max_weight, max_weight, "n = {n}");
            assert!(
                plan.levels >= MIN_PRECISION_LEVELS,
                "n = {n}: {}",
                plan.levels
            );
            plan.validate().unwrap();
        }
        // The most levels the cap leaves: one more would overflow.
        let plan = config.plan(100_000, 1).unwrap();
        let fits = |levels: i64| {
            100_000u128 * u128::from(plan.max_weight) * (levels as u128) < (1u128 << 30)
        };
        assert!(fits(plan.levels) && !fits(plan.levels + 1));
        config.validate(3, MAX_PARTICIPANTS).unwrap();
        let too_many = config.validate(3, MAX_PARTICIPANTS + 1).unwrap_err();
        assert!(
            too_many
                .to_string()
                .contains("3 to 100000 devices per round"),
            "{too_many}"
        );
    }

    #[test]
    fn the_aggregators_tier_carries_whole_sub_round_weights() {
        let config = SecAggConfig {
            enabled: true,
            ..SecAggConfig::default()
        };
        // 3 aggregators of 4 devices each: every aggregator's weight, up
        // to 4 × 1,024, is kept whole, and the sum still has headroom.
        let tier = config.for_aggregators(4, 3).unwrap();
        assert_eq!(tier.max_weight, 4 * 1024);
        let plan = tier.plan(3, 10).unwrap();
        assert_eq!(plan.max_weight, 4 * 1024);
        assert_eq!(plan.levels, ((1i64 << 30) - 1) / (3 * 4 * 1024));
        // 100 aggregators of 100 devices at 1,024 would need the cap cut:
        // refused, naming the bits, not silently reweighted.
        let error = config.for_aggregators(100, 100).unwrap_err().to_string();
        assert!(
            error.contains("rounds of 100 aggregators")
                && error.contains("need 32 bits")
                && error.contains("raise bits to 32"),
            "{error}"
        );
        let fits = SecAggConfig {
            max_weight: 8,
            ..config.clone()
        };
        assert_eq!(fits.for_aggregators(100, 100).unwrap().max_weight, 800);
        // A weight past what a secure sum carries at all.
        let error = config.for_aggregators(2_000, 3).unwrap_err().to_string();
        assert!(error.contains("over the 1,048,576"), "{error}");
    }

    #[test]
    fn every_size_in_the_range_is_checked_and_the_gaps_are_named() {
        let config = SecAggConfig {
            enabled: true,
            max_dropout_fraction: 0.1,
            max_corrupt_fraction: 0.2,
            ..SecAggConfig::default()
        };
        // Both ends have a plan; sizes inside do not.
        config.plan(3, 1).unwrap();
        config.plan(2_189, 1).unwrap();
        let error = config.validate(3, 2_189).unwrap_err().to_string();
        assert!(
            error.contains(
                "rounds of 2,170 to 2,171, 2,175 to 2,176, 2,180 to 2,182 and 2,185 to 2,188 \
                 devices have no plan"
            ),
            "{error}"
        );
        assert!(error.contains("no graph degree up to 1024"), "{error}");
        config.validate(2_100, 2_169).unwrap();
        for n in [2_172, 2_174, 2_177, 2_183, 2_184] {
            config.plan(n, 1).unwrap();
        }
        // A long stretch without a plan: named up to where the search
        // stopped, and said to stop there.
        let refused = SecAggConfig {
            max_dropout_fraction: 0.3,
            max_corrupt_fraction: 0.1,
            ..config
        };
        let error = refused.validate(3, 5_000).unwrap_err().to_string();
        assert!(
            error.contains(
                "rounds of 10 and 1,260 to 2,258 devices have no plan (sizes above 2,258 were \
                 not checked): no graph degree up to 9 tolerates"
            ),
            "{error}"
        );
    }

    #[test]
    fn the_range_check_agrees_with_the_search_at_every_size() {
        for (dropout, corrupt) in [(0.0, 0.0), (0.1, 0.0), (0.3, 0.1), (0.5, 0.3), (0.2, 0.25)] {
            let failing = sizes_without_a_graph(3..=400, dropout, corrupt);
            assert_eq!(failing.unchecked_above, None);
            for n in 3..=400 {
                let fails = failing.ranges.iter().any(|range| range.contains(&n));
                let searched = choose_degree_and_threshold(n, dropout, corrupt);
                assert_eq!(
                    fails,
                    searched.is_err(),
                    "n = {n}, δ = {dropout}, γ = {corrupt}"
                );
            }
        }
    }

    #[test]
    fn ranges_read_as_a_person_writes_them() {
        assert_eq!(name_ranges(&[2_170..=2_188]), "2,170 to 2,188");
        assert_eq!(name_ranges(&[5..=5, 7..=9]), "5 and 7 to 9");
        let many: Vec<_> = (0..6).map(|i| i * 10..=i * 10).collect();
        assert_eq!(name_ranges(&many), "0, 10, 20, 30 and 2 more ranges");
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
