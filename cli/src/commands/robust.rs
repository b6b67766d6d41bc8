//! The `--robust*` flags of `canopy job create` and `canopy simulate`: a
//! job's `robust_aggregation` (docs/robustness.md). The server checks
//! every setting and names the one it refuses.

use clap::Args;
use serde_json::{Map, Value, json};

#[derive(Args, Debug, Default)]
pub struct JobRobustArgs {
    /// Aggregate each round robustly, against poisoned updates: `median`,
    /// `trimmed_mean`, `krum` or `multi_krum` (docs/robustness.md).
    #[arg(long, value_name = "RULE")]
    pub robust: Option<String>,
    /// With `--robust trimmed_mean`: the fraction of each coordinate's
    /// values dropped from each end (below 0.5).
    #[arg(
        long,
        value_name = "BETA",
        requires = "robust",
        allow_negative_numbers = true
    )]
    pub trim_fraction: Option<f64>,
    /// With `--robust krum` or `multi_krum`: how many of a round's devices
    /// may be malicious (rounds then need at least 2f + 3 devices).
    #[arg(long, value_name = "F", requires = "robust")]
    pub byzantine: Option<u32>,
    /// With `--robust multi_krum`: how many of the best-scored updates
    /// are averaged (n − f when left out).
    #[arg(long, value_name = "M", requires = "robust")]
    pub krum_selected: Option<u32>,
}

impl JobRobustArgs {
    /// The job's `robust_aggregation`, if `--robust` was given.
    pub fn fields(&self) -> Option<Map<String, Value>> {
        let rule = self.robust.as_ref()?;
        let mut fields = Map::new();
        fields.insert("rule".into(), json!(rule));
        if let Some(fraction) = self.trim_fraction {
            fields.insert("trim_fraction".into(), json!(fraction));
        }
        if let Some(byzantine) = self.byzantine {
            fields.insert("byzantine".into(), json!(byzantine));
        }
        if let Some(selected) = self.krum_selected {
            fields.insert("selected".into(), json!(selected));
        }
        Some(fields)
    }
}
