//! `canopy privacy`: plan a differentially private job's budget before it
//! runs, as Opacus's `get_noise_multiplier` lets its users. Both commands
//! are the `canopy-privacy` accountant, the one a job's server uses.

use anyhow::Result;
use canopy_privacy::plan::{self, Target};
use canopy_privacy::{Accountant, Conversion, Event, Orders, PrivacyError, Spent};
use clap::Args;

use crate::files::Hint;
use crate::output::outln;

/// What both commands share.
#[derive(Args)]
pub struct Common {
    /// The probability that each device takes part in a round (devices per
    /// round over the population), in [0, 1].
    #[arg(long, value_name = "Q", allow_negative_numbers = true)]
    sampling_rate: f64,
    /// Rounds (or steps) of the job.
    #[arg(long, value_name = "T", allow_negative_numbers = true)]
    steps: u64,
    /// δ of the (ε, δ) guarantee: well below one over the population.
    #[arg(long, value_name = "D", allow_negative_numbers = true)]
    delta: f64,
    /// How RDP becomes (ε, δ): `tight` (Balle et al. 2020, what Opacus and
    /// dp_accounting print) or `classic` (Mironov 2017).
    #[arg(long, default_value_t = Conversion::Tight, value_parser = parse_conversion)]
    conversion: Conversion,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct EpsilonArgs {
    #[command(flatten)]
    common: Common,
    /// The noise's standard deviation over the clip (the L2 sensitivity).
    #[arg(long, value_name = "S", allow_negative_numbers = true)]
    noise_multiplier: f64,
}

#[derive(Args)]
pub struct NoiseArgs {
    #[command(flatten)]
    common: Common,
    /// The ε the job may spend in all.
    #[arg(long, value_name = "E", allow_negative_numbers = true)]
    epsilon: f64,
}

/// A job's differential privacy (DP-FedAvg, docs/privacy.md), as `canopy
/// job create` and `canopy simulate` take it.
#[derive(Args, Clone, Debug, Default)]
pub struct JobPrivacyArgs {
    /// Differential privacy: the noise's standard deviation over the clip
    /// norm; plan it with `canopy privacy noise`. Needs --dp-clip-norm and
    /// --dp-delta.
    #[arg(
        long,
        value_name = "S",
        requires_all = ["dp_clip_norm", "dp_delta"],
        allow_negative_numbers = true
    )]
    pub dp_noise_multiplier: Option<f64>,
    /// The L2 norm each device's update is clipped to.
    #[arg(
        long,
        value_name = "C",
        requires = "dp_noise_multiplier",
        allow_negative_numbers = true
    )]
    pub dp_clip_norm: Option<f64>,
    /// δ of the job's (ε, δ) guarantee: well below one over the devices.
    #[arg(
        long,
        value_name = "D",
        requires = "dp_noise_multiplier",
        allow_negative_numbers = true
    )]
    pub dp_delta: Option<f64>,
    /// The most ε the job may spend: it stops before a round that would
    /// pass it.
    #[arg(
        long,
        value_name = "E",
        requires = "dp_noise_multiplier",
        allow_negative_numbers = true
    )]
    pub dp_budget_epsilon: Option<f64>,
    /// Adaptive clipping: after each round the clip moves toward the
    /// quantile Q of the updates' norms (0.5 when left out); --dp-clip-norm
    /// is then the first round's clip. Central DP only.
    #[arg(
        long,
        value_name = "Q",
        num_args = 0..=1,
        default_missing_value = "0.5",
        requires = "dp_noise_multiplier",
        allow_negative_numbers = true
    )]
    pub dp_adaptive_clip_quantile: Option<f64>,
    /// Adaptive clipping's step: the clip is multiplied by
    /// exp(−RATE·(unclipped fraction − Q)) each round (0.2 when left out).
    #[arg(
        long,
        value_name = "RATE",
        requires = "dp_adaptive_clip_quantile",
        allow_negative_numbers = true
    )]
    pub dp_adaptive_clip_rate: Option<f64>,
    /// Adaptive clipping's noise on the count of updates within the clip,
    /// as a standard deviation (the round's target over 20, or the noise
    /// multiplier if larger, when left out).
    #[arg(
        long,
        value_name = "STDDEV",
        requires = "dp_adaptive_clip_quantile",
        allow_negative_numbers = true
    )]
    pub dp_adaptive_clip_count_noise: Option<f64>,
}

impl JobPrivacyArgs {
    /// The fields of the job's `differential_privacy` these flags set (the
    /// server checks each and names the one out of bounds).
    pub fn fields(&self) -> serde_json::Map<String, serde_json::Value> {
        let mut fields = serde_json::Map::new();
        let flags = [
            ("noise_multiplier", self.dp_noise_multiplier),
            ("clip_norm", self.dp_clip_norm),
            ("delta", self.dp_delta),
            ("budget_epsilon", self.dp_budget_epsilon),
        ];
        for (name, value) in flags {
            if let Some(value) = value {
                fields.insert(name.into(), serde_json::json!(value));
            }
        }
        if let Some(quantile) = self.dp_adaptive_clip_quantile {
            let mut adaptive = serde_json::json!({"target_quantile": quantile});
            if let Some(rate) = self.dp_adaptive_clip_rate {
                adaptive["learning_rate"] = serde_json::json!(rate);
            }
            if let Some(stddev) = self.dp_adaptive_clip_count_noise {
                adaptive["count_noise_stddev"] = serde_json::json!(stddev);
            }
            fields.insert("adaptive_clipping".into(), adaptive);
        }
        fields
    }
}

fn parse_conversion(text: &str) -> Result<Conversion, String> {
    text.parse()
        .map_err(|error: PrivacyError| error.to_string())
}

/// Prints the ε that `--steps` rounds spend.
pub fn epsilon(args: EpsilonArgs) -> Result<()> {
    let common = &args.common;
    let mut accountant = Accountant::new(Orders::standard());
    accountant
        .compose(&Event::gaussian(
            common.sampling_rate,
            args.noise_multiplier,
            common.steps,
        ))
        .map_err(explain)?;
    let spent = accountant
        .epsilon(common.delta, common.conversion)
        .map_err(explain)?;
    print(common, args.noise_multiplier, &spent)
}

/// Prints the least noise multiplier that keeps `--steps` rounds within
/// `--epsilon`.
pub fn noise(args: NoiseArgs) -> Result<()> {
    let common = &args.common;
    let target = Target {
        epsilon: args.epsilon,
        delta: common.delta,
        sampling_rate: common.sampling_rate,
        steps: common.steps,
    };
    let plan =
        plan::noise_multiplier(target, common.conversion, &Orders::standard()).map_err(explain)?;
    print(common, plan.noise_multiplier, &plan.spent)
}

fn print(common: &Common, noise_multiplier: f64, spent: &Spent) -> Result<()> {
    let conversion = spent.conversion;
    if common.json {
        // serde_json writes an infinite ε (no order gives a bound) as null.
        let json = serde_json::json!({
            "epsilon": spent.epsilon,
            "delta": spent.delta,
            "order": spent.order,
            "conversion": conversion.name(),
            "conversion_source": conversion.source(),
            "mechanism": "poisson_subsampled_gaussian",
            "sampling_rate": common.sampling_rate,
            "noise_multiplier": noise_multiplier,
            "steps": common.steps,
        });
        outln!("{json}")?;
        return Ok(());
    }
    outln!("epsilon           {}", spent.epsilon)?;
    outln!("delta             {:e}", spent.delta)?;
    outln!("noise multiplier  {noise_multiplier}")?;
    outln!("sampling rate     {}", common.sampling_rate)?;
    outln!("steps             {}", common.steps)?;
    match spent.order {
        Some(order) => outln!("best order        {order}")?,
        None => outln!("best order        none (no order bounds this release)")?,
    }
    outln!("conversion        {conversion} ({})", conversion.source())?;
    outln!("mechanism         Poisson-subsampled Gaussian, Rényi DP accountant")?;
    Ok(())
}

/// The accountant's error, naming the flag and saying what to change.
fn explain(error: PrivacyError) -> anyhow::Error {
    let flag = format!("--{}", error.parameter().name().replace('_', "-"));
    match &error {
        PrivacyError::OutOfRange { value, bounds, .. } => {
            anyhow::anyhow!("{flag} is {value}, outside {bounds}")
        }
        PrivacyError::Unreachable { .. } => Hint::attach(
            anyhow::Error::new(error),
            "allow a larger --epsilon or --delta, or plan fewer --steps or a lower --sampling-rate",
        ),
        PrivacyError::UnknownConversion { .. } | PrivacyError::CorruptState { .. } => {
            anyhow::Error::new(error)
        }
    }
}
