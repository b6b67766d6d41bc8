//! Central differential privacy: DP-FedAvg (McMahan, Ramage, Talwar, Zhang
//! 2018, "Learning Differentially Private Recurrent Language Models").
//!
//! A job with `differential_privacy` makes every round one release of the
//! Poisson-subsampled Gaussian mechanism, with device-level sensitivity:
//!
//! - each device clips its update to L2 norm C (the task's `privacy`), and
//!   the fold clips again what it takes (`store::rounds`), so that one
//!   device moves the sum by at most C whatever it sent;
//! - every update weighs the same (1, not its sample count, which would
//!   let one device outweigh the bound);
//! - the round's sum gets Gaussian noise of standard deviation σ·C per
//!   coordinate ([`add_noise`]) and is divided by the round's
//!   `target_devices`, the fixed denominator of the paper's estimator: a
//!   denominator that counted the updates would reveal how many arrived;
//! - the job's accountant (`canopy-privacy`) composes each round at the
//!   sampling rate it really had: devices selected over the devices that
//!   could have been ([`sampling_rate`]), and the job stops before a round
//!   that would take its ε past `budget_epsilon`.
//!
//! With `secure_aggregation` as well, the privacy is distributed instead
//! (`canopy_protocol::secagg::noise`): each device adds a share of Skellam
//! noise to its quantised update before masking, sized so that the
//! devices the round is sure to keep carry σ times the sensitivity between
//! them; the server adds nothing, and only ever unmasks a noisy sum. Each
//! round is then one release of the Skellam mechanism in the plan's
//! integer domain ([`DifferentialPrivacy::round`]).
//!
//! The central noise is drawn from a ChaCha20 stream keyed by a secret the server
//! makes for the job ([`new_noise_seed`]) and by the round's id, so that a
//! round aggregated again after a crash gets the same noise: the version it
//! makes does not depend on when the server died, and no second draw of
//! the same sum is ever made. The secret never leaves the database.

use canopy_privacy::skellam::Skellam;
use canopy_privacy::{Accountant, Bounds, Conversion, Event, Mechanism, Orders, limits};
use canopy_protocol::messages::TaskPrivacy;
use canopy_protocol::secagg::Plan;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use utoipa::ToSchema;

/// How the accountant's RDP becomes the ε a job reports and is held to:
/// the tighter conversion that Opacus and Google's `dp_accounting` use.
pub const CONVERSION: Conversion = Conversion::Tight;

/// A job's differential privacy settings: central DP-FedAvg, or with
/// `secure_aggregation` distributed DP, where devices add the noise before
/// masking. See `docs/privacy.md`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DifferentialPrivacy {
    /// σ: the standard deviation of the Gaussian noise added to each
    /// round's sum, over `clip_norm`.
    #[schema(exclusive_minimum = 0, maximum = 1_000_000)]
    pub noise_multiplier: f64,
    /// C: each device's update (all its trainable tensors together) is
    /// scaled down to this L2 norm when it is longer.
    #[schema(exclusive_minimum = 0, maximum = 1_000_000)]
    pub clip_norm: f64,
    /// δ of the job's (ε, δ) guarantee: well below one over the number of
    /// devices.
    #[schema(exclusive_minimum = 0, maximum = 1)]
    pub delta: f64,
    /// The most ε the job may spend: it stops, completed, before a round
    /// that would take it further. No limit when left out (ε is still
    /// reported after every round).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(exclusive_minimum = 0, maximum = 1_000_000)]
    pub budget_epsilon: Option<f64>,
    /// Adapt the clip to the updates, round by round (central DP only):
    /// `clip_norm` is then the first round's clip.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adaptive_clipping: Option<AdaptiveClipping>,
}

/// Adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy 2021): after each
/// round the clip moves geometrically toward the `target_quantile` of the
/// updates' norms, from a noisy count of the updates it left unclipped.
/// The count's noise is part of the job's privacy: the updates' sum gets
/// a little more noise, so that the two releases together are worth
/// exactly `noise_multiplier` ([`DifferentialPrivacy::sum_noise_multiplier`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AdaptiveClipping {
    /// γ: the fraction of updates the clip should leave unclipped (1: clip
    /// none, the clip growing past the longest).
    #[serde(default = "default_target_quantile")]
    #[schema(exclusive_minimum = 0, maximum = 1, default = 0.5)]
    pub target_quantile: f64,
    /// η: each round multiplies the clip by exp(−η·(unclipped fraction − γ)).
    #[serde(default = "default_clip_learning_rate")]
    #[schema(exclusive_minimum = 0, maximum = 10, default = 0.2)]
    pub learning_rate: f64,
    /// σ_b: the standard deviation of the noise on the count of unclipped
    /// updates. Left out, the round's target over 20 (the paper's choice)
    /// or the noise multiplier, whichever is larger.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(exclusive_minimum = 0, maximum = 1_000_000)]
    pub count_noise_stddev: Option<f64>,
}

fn default_target_quantile() -> f64 {
    0.5
}

fn default_clip_learning_rate() -> f64 {
    0.2
}

/// The smallest clip adaptive clipping may reach: a floor so that a run of
/// tiny updates cannot drive it to zero, where every update would be
/// scaled to nothing.
pub const MIN_ADAPTIVE_CLIP: f64 = 1e-6;

/// The bounds of adaptive clipping's settings (the schema states the
/// same; a test ties them).
const TARGET_QUANTILE: Bounds = Bounds::above(0.0, 1.0);
const CLIP_LEARNING_RATE: Bounds = Bounds::above(0.0, 10.0);
const COUNT_NOISE_STDDEV: Bounds = Bounds::above(0.0, 1e6);

impl AdaptiveClipping {
    fn check_fields(&self) -> Result<(), String> {
        let field = |name: &str| format!("adaptive_clipping.{name}");
        check(
            &field("target_quantile"),
            TARGET_QUANTILE,
            self.target_quantile,
        )?;
        check(
            &field("learning_rate"),
            CLIP_LEARNING_RATE,
            self.learning_rate,
        )?;
        if let Some(stddev) = self.count_noise_stddev {
            check(&field("count_noise_stddev"), COUNT_NOISE_STDDEV, stddev)?;
        }
        Ok(())
    }
}

impl DifferentialPrivacy {
    /// Each setting within its bounds, the error naming the field.
    pub fn check_fields(&self) -> Result<(), String> {
        check(
            "noise_multiplier",
            limits::NOISE_MULTIPLIER,
            self.noise_multiplier,
        )?;
        check("delta", limits::DELTA, self.delta)?;
        if let Some(budget) = self.budget_epsilon {
            check("budget_epsilon", limits::EPSILON, budget)?;
        }
        let clip = canopy_protocol::bounds::MAX_CLIP_NORM;
        check("clip_norm", Bounds::above(0.0, clip), self.clip_norm)?;
        match &self.adaptive_clipping {
            Some(adaptive) => adaptive.check_fields(),
            None => Ok(()),
        }
    }

    /// With adaptive clipping, whether rounds of `target_devices` can run:
    /// the count's noise must be worth less than the whole budget of
    /// noise, 2σ_b > σ, or nothing would be left for the updates' sum.
    pub fn check_adaptive(&self, target_devices: u32) -> Result<(), String> {
        let Some(count_stddev) = self.count_noise_stddev(target_devices) else {
            return Ok(());
        };
        if 2.0 * count_stddev > self.noise_multiplier {
            return Ok(());
        }
        Err(format!(
            "`differential_privacy.adaptive_clipping.count_noise_stddev` is {count_stddev}, and \
             adaptive clipping needs more than half the noise multiplier ({}): the count's \
             noise would spend the whole privacy budget, and leave none for the updates; \
             hint: raise `count_noise_stddev`, or leave it out for the default",
            self.noise_multiplier / 2.0
        ))
    }

    /// What each device's training task asks of its update: to clip it to
    /// `clip_norm`. With adaptive clipping nothing: the server must see
    /// whether each update was within the round's clip, so devices send
    /// them whole and the fold clips them (in central DP the server sees
    /// every update anyway).
    pub fn task(&self) -> Option<TaskPrivacy> {
        match self.adaptive_clipping {
            Some(_) => None,
            None => Some(TaskPrivacy {
                clip_norm: self.clip_norm,
            }),
        }
    }

    /// σ_b, the noise on the count of unclipped updates, for rounds of
    /// `target_devices`; `None` without adaptive clipping.
    pub fn count_noise_stddev(&self, target_devices: u32) -> Option<f64> {
        let adaptive = self.adaptive_clipping.as_ref()?;
        let default = (f64::from(target_devices) / 20.0).max(self.noise_multiplier);
        Some(adaptive.count_noise_stddev.unwrap_or(default))
    }

    /// σ_Δ, the noise multiplier of the updates' sum: σ itself, or with
    /// adaptive clipping (σ⁻² − (2σ_b)⁻²)^(−1/2), so that the sum and the
    /// count together (the count's sensitivity is ½) are one Gaussian
    /// release of multiplier σ (Andrew et al. 2021, Theorem 1), which is
    /// what the accountant composes.
    pub fn sum_noise_multiplier(&self, target_devices: u32) -> f64 {
        let sigma = self.noise_multiplier;
        match self.count_noise_stddev(target_devices) {
            Some(count) => (sigma.powi(-2) - (2.0 * count).powi(-2)).powf(-0.5),
            None => sigma,
        }
    }

    /// The noise's standard deviation per coordinate of the sum of a round
    /// that clipped to `clip_norm`.
    pub fn noise_stddev(&self, clip_norm: f64, target_devices: u32) -> f64 {
        self.sum_noise_multiplier(target_devices) * clip_norm
    }

    /// The next round's clip after a round that clipped to `clip_norm`:
    /// of its `accepted` updates, `unclipped` were within it; `count_noise`
    /// is the count's noise draw ([`count_noise`]). The count is centred,
    /// Σ(bᵢ − ½), so that one device moves it by ½, and estimated over the
    /// round's target, the fixed denominator the updates' mean uses too.
    pub fn next_clip(&self, round: &ClippedRound, count_noise: f64) -> f64 {
        let Some(adaptive) = &self.adaptive_clipping else {
            return round.clip_norm;
        };
        let centred = round.unclipped as f64 - round.accepted as f64 / 2.0 + count_noise;
        let unclipped_fraction = centred / f64::from(round.target_devices.max(1)) + 0.5;
        let step = -adaptive.learning_rate * (unclipped_fraction - adaptive.target_quantile);
        (round.clip_norm * step.exp())
            .clamp(MIN_ADAPTIVE_CLIP, canopy_protocol::bounds::MAX_CLIP_NORM)
    }

    /// One round at `sampling_rate`, for the accountant: the Gaussian noise
    /// the server adds, or in a secure round (its `plan`) the Skellam noise
    /// its devices' shares guarantee the sum, in the plan's integer domain.
    pub fn round(&self, sampling_rate: f64, plan: Option<&Plan>) -> Event {
        let Some((plan, noise)) = plan.and_then(|plan| Some((plan, plan.device_noise.as_ref()?)))
        else {
            return Event::gaussian(sampling_rate, self.noise_multiplier, 1);
        };
        let sensitivity = plan.sensitivity();
        Event {
            mechanism: Mechanism::Skellam(Skellam {
                variance: noise.guaranteed_variance(),
                l1_sensitivity: sensitivity.l1,
                l2_sensitivity: sensitivity.l2,
            }),
            sampling_rate,
            steps: 1,
        }
    }
}

/// What a private round's fold saw of its updates' norms.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ClippedRound {
    pub clip_norm: f64,
    /// Updates whose norm was at most the clip.
    pub unclipped: u64,
    pub accepted: u64,
    pub target_devices: u32,
}

/// Who adds a private job's noise.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum NoiseSource {
    /// Central DP (DP-FedAvg): the server adds Gaussian noise to the sum
    /// of the clipped updates it sees. Private against whoever gets the
    /// models, not against the server.
    Server,
    /// Distributed DP: with secure aggregation, each device adds a share
    /// of Skellam noise before masking, so the server only ever unmasks a
    /// noisy sum.
    Devices,
}

/// `value` within `bounds`, or the error naming `differential_privacy.{field}`.
fn check(field: &str, bounds: Bounds, value: f64) -> Result<(), String> {
    if bounds.contains(value) {
        return Ok(());
    }
    Err(format!(
        "`differential_privacy.{field}` must be in {bounds}, got {value}"
    ))
}

/// The sampling rate of a round that selected `selected` of the
/// `candidates` devices it could have: at most 1, and 1 when it could
/// choose from no more than it took (no amplification to claim).
pub fn sampling_rate(selected: usize, candidates: usize) -> f64 {
    if candidates == 0 || selected >= candidates {
        return 1.0;
    }
    selected as f64 / candidates as f64
}

/// Why a new job's budget cannot pay for even one round, if so: its first
/// round, choosing `selection_size` of the `enrolled` devices (the
/// smallest sampling rate the devices enrolled now allow), would spend
/// more than the whole budget. `plan` is that round's, for a secure job.
pub fn budget_below_one_round(
    privacy: &DifferentialPrivacy,
    selection_size: u32,
    enrolled: u64,
    plan: Option<&Plan>,
) -> Result<Option<String>, String> {
    let Some(budget) = privacy.budget_epsilon else {
        return Ok(None);
    };
    let candidates = usize::try_from(enrolled).unwrap_or(usize::MAX);
    let rate = sampling_rate(selection_size as usize, candidates);
    let accountant = Accountant::new(Orders::standard());
    let one_round = accountant
        .epsilon_after(&privacy.round(rate, plan), privacy.delta, CONVERSION)
        .map_err(|error| error.to_string())?
        .epsilon;
    if one_round <= budget {
        return Ok(None);
    }
    Ok(Some(format!(
        "`differential_privacy.budget_epsilon` is {budget}, below what one round spends: epsilon \
         {one_round} at sampling rate {rate} ({selection_size} of the {enrolled} devices enrolled \
         now); hint: raise `budget_epsilon` or `noise_multiplier`, select fewer devices a round, \
         or enroll more devices first"
    )))
}

/// A new job's noise secret: 32 bytes from the operating system's
/// generator, as hex.
pub fn new_noise_seed() -> String {
    let mut seed = [0u8; 32];
    rand::rng().fill(&mut seed);
    hex::encode(seed)
}

/// Adds the round's Gaussian noise, of standard deviation `stddev`, to each
/// coordinate of `sum`: the same noise for the same job secret and round,
/// however often the round is aggregated.
pub fn add_noise(
    sum: &mut [f64],
    seed_hex: &str,
    round_id: i64,
    stddev: f64,
) -> Result<(), String> {
    let mut stream = noise_stream(seed_hex, b"canopy dp-fedavg round noise v1", round_id)?;
    for value in sum.iter_mut() {
        let normal: f64 = stream.sample(rand_distr::StandardNormal);
        *value += stddev * normal;
    }
    Ok(())
}

/// The noise on a round's count of unclipped updates (adaptive clipping),
/// of standard deviation `stddev`: from the job's secret and the round,
/// as [`add_noise`], on a stream of its own.
pub fn count_noise(seed_hex: &str, round_id: i64, stddev: f64) -> Result<f64, String> {
    let mut stream = noise_stream(seed_hex, b"canopy dp adaptive clip count v1", round_id)?;
    let normal: f64 = stream.sample(rand_distr::StandardNormal);
    Ok(stddev * normal)
}

/// The ChaCha20 stream of one use (`domain`) of a round's noise, keyed by
/// the job's secret.
fn noise_stream(seed_hex: &str, domain: &[u8], round_id: i64) -> Result<ChaCha20Rng, String> {
    let seed = hex::decode(seed_hex)
        .ok()
        .filter(|seed| seed.len() == 32)
        .ok_or_else(|| "the job's noise secret is not 32 bytes of hex".to_string())?;
    let key: [u8; 32] = Sha256::new()
        .chain_update(domain)
        .chain_update(&seed)
        .chain_update(round_id.to_le_bytes())
        .finalize()
        .into();
    Ok(ChaCha20Rng::from_seed(key))
}

/// The accountant as a job keeps it, in `jobs.dp_accountant`: each order
/// and RDP value by its bits, so that it reads back exactly (infinite RDP
/// too, which JSON has no number for).
#[derive(Debug, Serialize, Deserialize)]
struct SavedAccountant {
    order_bits: Vec<u64>,
    rdp_bits: Vec<u64>,
    steps: u64,
}

/// A job's accountant from its saved text; a new one when there is none.
pub fn load_accountant(saved: Option<&str>) -> Result<Accountant, String> {
    let Some(text) = saved else {
        return Ok(Accountant::new(Orders::standard()));
    };
    let saved: SavedAccountant = serde_json::from_str(text)
        .map_err(|error| format!("the job's saved privacy accountant does not parse: {error}"))?;
    let orders = saved.order_bits.into_iter().map(f64::from_bits).collect();
    let orders = Orders::new(orders).map_err(|error| error.to_string())?;
    let rdp = saved.rdp_bits.into_iter().map(f64::from_bits).collect();
    Accountant::restore(orders, rdp, saved.steps).map_err(|error| error.to_string())
}

/// The text [`load_accountant`] reads back.
pub fn save_accountant(accountant: &Accountant) -> String {
    let saved = SavedAccountant {
        order_bits: accountant
            .orders()
            .as_slice()
            .iter()
            .map(|order| order.to_bits())
            .collect(),
        rdp_bits: accountant
            .rdp()
            .iter()
            .map(|value| value.to_bits())
            .collect(),
        steps: accountant.steps(),
    };
    serde_json::to_string(&saved).unwrap_or_default()
}

/// The ε an accountant has spent at `delta`.
pub fn epsilon(accountant: &Accountant, delta: f64) -> Result<f64, String> {
    accountant
        .epsilon(delta, CONVERSION)
        .map(|spent| spent.epsilon)
        .map_err(|error| error.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> DifferentialPrivacy {
        DifferentialPrivacy {
            noise_multiplier: 1.0,
            clip_norm: 0.5,
            delta: 1e-5,
            budget_epsilon: Some(3.0),
            adaptive_clipping: None,
        }
    }

    fn adaptive(count_noise_stddev: Option<f64>) -> DifferentialPrivacy {
        DifferentialPrivacy {
            adaptive_clipping: Some(AdaptiveClipping {
                target_quantile: 0.5,
                learning_rate: 0.2,
                count_noise_stddev,
            }),
            ..settings()
        }
    }

    #[test]
    fn adaptive_clipping_splits_the_noise_and_moves_the_clip_within_bounds() {
        // Fixed clipping: the sum gets all of σ, and devices clip.
        assert_eq!(settings().sum_noise_multiplier(100), 1.0);
        assert_eq!(settings().task().map(|task| task.clip_norm), Some(0.5));
        // σ_b = 100/20 = 5: (1 − 1/100)^(−1/2).
        let paper = adaptive(None);
        assert_eq!(paper.count_noise_stddev(100), Some(5.0));
        let expected = (1.0f64 - 0.01).powf(-0.5);
        assert!((paper.sum_noise_multiplier(100) - expected).abs() < 1e-15);
        // Few devices: σ_b is σ, and the sum's share is (1 − ¼)^(−1/2).
        assert_eq!(paper.count_noise_stddev(4), Some(1.0));
        assert!((paper.sum_noise_multiplier(4) - 0.75f64.powf(-0.5)).abs() < 1e-15);
        assert_eq!(
            paper.task(),
            None,
            "the server counts, so devices send whole"
        );
        assert!(adaptive(Some(0.5)).check_adaptive(100).is_err());
        assert!(adaptive(Some(0.51)).check_adaptive(100).is_ok());
        // Half within the clip at γ = ½ keeps it; all within shrinks it by
        // e^(−0.1); the floor and the ceiling hold.
        let round = |clip_norm, unclipped| ClippedRound {
            clip_norm,
            unclipped,
            accepted: 10,
            target_devices: 10,
        };
        assert_eq!(paper.next_clip(&round(0.5, 5), 0.0), 0.5);
        let shrunk = paper.next_clip(&round(0.5, 10), 0.0);
        assert!((shrunk - 0.5 * (-0.1f64).exp()).abs() < 1e-15);
        assert_eq!(paper.next_clip(&round(1e-6, 10), 0.0), MIN_ADAPTIVE_CLIP);
        let ceiling = canopy_protocol::bounds::MAX_CLIP_NORM;
        assert_eq!(paper.next_clip(&round(ceiling, 0), 0.0), ceiling);
        assert_eq!(settings().next_clip(&round(0.5, 10), 3.0), 0.5);
    }

    #[test]
    fn bad_settings_name_their_field() {
        assert_eq!(settings().check_fields(), Ok(()));
        let cases = [
            (
                DifferentialPrivacy {
                    noise_multiplier: 0.0,
                    ..settings()
                },
                "noise_multiplier",
            ),
            (
                DifferentialPrivacy {
                    noise_multiplier: -1.0,
                    ..settings()
                },
                "noise_multiplier",
            ),
            (
                DifferentialPrivacy {
                    clip_norm: f64::NAN,
                    ..settings()
                },
                "clip_norm",
            ),
            (
                DifferentialPrivacy {
                    delta: 0.0,
                    ..settings()
                },
                "delta",
            ),
            (
                DifferentialPrivacy {
                    delta: 2.0,
                    ..settings()
                },
                "delta",
            ),
            (
                DifferentialPrivacy {
                    budget_epsilon: Some(0.0),
                    ..settings()
                },
                "budget_epsilon",
            ),
        ];
        for (settings, field) in cases {
            let error = settings.check_fields().unwrap_err();
            assert!(
                error.starts_with(&format!("`differential_privacy.{field}` must be in ")),
                "{error}"
            );
        }
    }

    #[test]
    fn the_schema_states_the_accountants_bounds() {
        use utoipa::PartialSchema;
        let schema = serde_json::to_value(DifferentialPrivacy::schema()).unwrap();
        let property = |name: &str| schema["properties"][name].clone();
        assert_eq!(
            property("noise_multiplier")["maximum"],
            limits::NOISE_MULTIPLIER.high
        );
        assert_eq!(property("delta")["maximum"], limits::DELTA.high);
        assert_eq!(
            property("clip_norm")["maximum"],
            canopy_protocol::bounds::MAX_CLIP_NORM
        );
        let budget = property("budget_epsilon");
        assert!(
            budget
                .to_string()
                .contains(&limits::EPSILON.high.to_string()),
            "{budget}"
        );
        let adaptive = serde_json::to_value(AdaptiveClipping::schema()).unwrap();
        for (name, bounds) in [
            ("target_quantile", TARGET_QUANTILE),
            ("learning_rate", CLIP_LEARNING_RATE),
            ("count_noise_stddev", COUNT_NOISE_STDDEV),
        ] {
            let property = adaptive["properties"][name].to_string();
            assert!(
                property.contains(&format!("\"maximum\":{}", bounds.high)),
                "{property}"
            );
            assert!(property.contains("\"exclusiveMinimum\":0"), "{property}");
        }
    }

    #[test]
    fn noise_is_the_same_for_a_round_and_differs_between_rounds() {
        let seed = new_noise_seed();
        let draw = |round_id| {
            let mut sum = vec![0.0; 20_000];
            add_noise(&mut sum, &seed, round_id, 2.0).unwrap();
            sum
        };
        let first = draw(7);
        assert_eq!(first, draw(7));
        assert_ne!(first, draw(8));
        // Its standard deviation is the one asked for, its mean zero
        // (20,000 draws: the sample's std is within 3 % with near certainty).
        let mean = first.iter().sum::<f64>() / first.len() as f64;
        let variance = first.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / first.len() as f64;
        assert!(mean.abs() < 0.06, "{mean}");
        assert!(
            (variance.sqrt() / 2.0 - 1.0).abs() < 0.03,
            "{}",
            variance.sqrt()
        );
        assert!(add_noise(&mut [0.0], "beef", 1, 1.0).is_err());
    }

    #[test]
    fn a_saved_accountant_reads_back() {
        let mut accountant = Accountant::new(Orders::standard());
        accountant.compose(&settings().round(0.1, None)).unwrap();
        accountant.compose(&settings().round(0.2, None)).unwrap();
        let back = load_accountant(Some(&save_accountant(&accountant))).unwrap();
        assert_eq!(back, accountant);
        assert!(load_accountant(Some("{}")).is_err());
        assert_eq!(load_accountant(None).unwrap().steps(), 0);
    }

    #[test]
    fn a_budget_one_round_would_pass_is_named() {
        let tight = DifferentialPrivacy {
            budget_epsilon: Some(0.01),
            ..settings()
        };
        let refusal = budget_below_one_round(&tight, 10, 100, None)
            .unwrap()
            .unwrap();
        assert!(
            refusal.contains("sampling rate 0.1 (10 of the 100 devices"),
            "{refusal}"
        );
        assert_eq!(budget_below_one_round(&settings(), 10, 100, None), Ok(None));
        let unlimited = DifferentialPrivacy {
            budget_epsilon: None,
            ..settings()
        };
        assert_eq!(budget_below_one_round(&unlimited, 10, 10, None), Ok(None));
    }

    #[test]
    fn sampling_rates_never_claim_more_than_the_selection() {
        assert_eq!(sampling_rate(10, 100), 0.1);
        assert_eq!(sampling_rate(10, 10), 1.0);
        assert_eq!(sampling_rate(0, 0), 1.0);
    }
}
