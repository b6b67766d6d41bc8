//! Robust aggregation: coordinate-wise median, trimmed mean, Krum and
//! Multi-Krum, for jobs whose devices may send poisoned updates.
//!
//! FedAvg's mean moves as far as any one update pulls it, so a few
//! devices that scale or flip their update steer the model wherever they
//! like. The rules here bound what `f` such devices can do:
//!
//! - **median** (Yin et al. 2018): each coordinate of the aggregate is the
//!   median of the devices' values for it;
//! - **trimmed mean** (Yin et al. 2018): each coordinate drops its
//!   `⌊β·n⌋` largest and smallest values and averages the rest;
//! - **Krum** (Blanchard et al. 2017): the one update whose `n − f − 2`
//!   nearest neighbours are closest to it (the sum of the squared L2
//!   distances); **Multi-Krum** averages the `m` best by that score.
//!
//! Every rule weighs devices the same: a sample count is the device's own
//! claim, and an attacker would claim many.
//!
//! They need every update, not a running sum, so a robust round stores
//! each update as a blob (`updates/{round}/{device}-{digest}`, raw f32)
//! when it accepts it, and aggregates them block by block: at most
//! [`BLOCK_BUDGET_BYTES`] of updates are in memory at once, whatever the
//! number of devices times the model's size. Krum first accumulates the
//! n × n squared distances over the blocks (n² f64), then averages its
//! chosen updates block by block as well.
//!
//! The blob is written and synced before the transaction that records the
//! device as uploaded names it, so after a crash an accepted update is
//! there to aggregate, and one that was not accepted is an orphan that the
//! round's sweep deletes with the rest once the round is over.

use std::ops::Range;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::blobs::{BlobError, BlobStore};
use crate::store::text_enum;

/// The most bytes of updates one block of an aggregation holds: with n
/// devices a block spans `BLOCK_BUDGET_BYTES / (4 n)` coordinates.
pub const BLOCK_BUDGET_BYTES: usize = 64 << 20;

/// Updates read at once while a block is gathered.
const READ_CONCURRENCY: usize = 16;

/// The most devices Krum scores: its distances are n² f64 (8 MB at 1,000)
/// and its work n²·d.
pub const MAX_KRUM_DEVICES: u32 = 1_000;

/// The most malicious devices Krum can be told of: a round needs more
/// than 2f + 2 of at most [`MAX_KRUM_DEVICES`].
pub const MAX_BYZANTINE: u32 = (MAX_KRUM_DEVICES - 3) / 2;

text_enum! {
    /// How a robust round combines the updates.
    pub enum RobustRule {
        /// Coordinate-wise median.
        Median = "median",
        /// Coordinate-wise mean of the values left after dropping the
        /// `trim_fraction` largest and smallest.
        TrimmedMean = "trimmed_mean",
        /// The update closest to its `n − byzantine − 2` nearest others.
        Krum = "krum",
        /// The mean of the `selected` updates with the best Krum scores.
        MultiKrum = "multi_krum",
    }
}

/// A job's robust aggregation. See `docs/robustness.md`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RobustAggregation {
    pub rule: RobustRule,
    /// β for `trimmed_mean` (required there, refused elsewhere): each
    /// coordinate drops `⌊β·n⌋` of its n values from each end; below 0.5,
    /// and at least the fraction of devices that may be malicious.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 0, exclusive_maximum = 0.5)]
    pub trim_fraction: Option<f64>,
    /// f for `krum` and `multi_krum` (required there, refused elsewhere):
    /// how many of a round's devices may be malicious. Every round then
    /// needs more than 2f + 2 updates, so `min_devices` must be at least
    /// 2f + 3.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 0, maximum = 498)]
    pub byzantine: Option<u32>,
    /// m for `multi_krum`: how many of the best-scored updates are
    /// averaged; n − f (the round's updates less `byzantine`) when left
    /// out, and never more than the round has.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1, maximum = 1_000)]
    pub selected: Option<u32>,
}

/// What a round aggregates with, resolved from the job's settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Rule {
    Median,
    TrimmedMean {
        trim_fraction: f64,
    },
    Krum {
        byzantine: usize,
    },
    MultiKrum {
        byzantine: usize,
        selected: Option<usize>,
    },
}

impl RobustAggregation {
    /// Each field within its bounds and meant for the rule, the error
    /// naming it; `min_devices` is the job's, `selection_size` the most
    /// devices a round selects (and so the most updates it aggregates).
    pub fn check(&self, min_devices: u32, selection_size: u32) -> Result<Rule, String> {
        let field = |name: &str| format!("`robust_aggregation.{name}`");
        let refuse_unless = |name: &str, present: bool, rules: &str| {
            if present {
                return Err(format!(
                    "{} applies only to the {rules} rule, not `{}`",
                    field(name),
                    self.rule
                ));
            }
            Ok(())
        };
        let krum = matches!(self.rule, RobustRule::Krum | RobustRule::MultiKrum);
        if self.rule != RobustRule::TrimmedMean {
            refuse_unless(
                "trim_fraction",
                self.trim_fraction.is_some(),
                "`trimmed_mean`",
            )?;
        }
        if !krum {
            refuse_unless(
                "byzantine",
                self.byzantine.is_some(),
                "`krum` and `multi_krum`",
            )?;
        }
        if self.rule != RobustRule::MultiKrum {
            refuse_unless("selected", self.selected.is_some(), "`multi_krum`")?;
        }
        match self.rule {
            RobustRule::Median => Ok(Rule::Median),
            RobustRule::TrimmedMean => {
                let trim_fraction = self.trim_fraction.ok_or_else(|| {
                    format!("{} is required by `trimmed_mean`", field("trim_fraction"))
                })?;
                if !(0.0..0.5).contains(&trim_fraction) {
                    return Err(format!(
                        "{} must be at least 0 and below 0.5 (half trimmed from each end \
                         leaves nothing), got {trim_fraction}",
                        field("trim_fraction")
                    ));
                }
                Ok(Rule::TrimmedMean { trim_fraction })
            }
            RobustRule::Krum | RobustRule::MultiKrum => {
                if selection_size > MAX_KRUM_DEVICES {
                    return Err(format!(
                        "`robust_aggregation.rule` `{}` scores at most {MAX_KRUM_DEVICES} updates a \
                         round (its work is n² times the model's size), but the job's rounds \
                         select up to {selection_size} devices; lower `target_devices` or \
                         `over_selection`, or use `median` or `trimmed_mean`",
                        self.rule
                    ));
                }
                self.check_krum(min_devices)
            }
        }
    }

    fn check_krum(&self, min_devices: u32) -> Result<Rule, String> {
        let byzantine = self.byzantine.ok_or_else(|| {
            format!(
                "`robust_aggregation.byzantine` is required by `{}`: how many devices a round \
                 may have that are malicious",
                self.rule
            )
        })?;
        if byzantine > MAX_BYZANTINE {
            return Err(format!(
                "`robust_aggregation.byzantine` must be at most {MAX_BYZANTINE} (Krum scores at \
                 most {MAX_KRUM_DEVICES} updates), got {byzantine}"
            ));
        }
        let needed = 2 * u64::from(byzantine) + 3;
        if u64::from(min_devices) < needed {
            return Err(format!(
                "`robust_aggregation.byzantine` of {byzantine} needs rounds of more than 2f + 2 \
                 updates, so `min_devices` must be at least {needed}, got {min_devices}"
            ));
        }
        let byzantine = byzantine as usize;
        match self.rule {
            RobustRule::Krum => Ok(Rule::Krum { byzantine }),
            _ => {
                if let Some(selected) = self.selected.filter(|&m| m == 0 || m > MAX_KRUM_DEVICES) {
                    return Err(format!(
                        "`robust_aggregation.selected` must be between 1 and {MAX_KRUM_DEVICES}, \
                         got {selected}"
                    ));
                }
                let selected = self.selected.map(|m| m as usize);
                Ok(Rule::MultiKrum {
                    byzantine,
                    selected,
                })
            }
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RobustError {
    #[error("device {device_id}'s stored update cannot be read")]
    Read {
        device_id: i64,
        #[source]
        source: BlobError,
    },
    #[error(
        "device {device_id}'s stored update holds {got} bytes at {range:?}, where the round's \
         layout has {expected}"
    )]
    Truncated {
        device_id: i64,
        range: Range<u64>,
        expected: u64,
        got: u64,
    },
    #[error("no update was stored, so there is nothing to aggregate")]
    NoUpdates,
    #[error("the round has {devices} updates; Krum scores at most {MAX_KRUM_DEVICES}")]
    TooManyForKrum { devices: usize },
    #[error(
        "Krum with byzantine = {byzantine} needs more than {} updates; the round has {devices}",
        2 * byzantine + 2
    )]
    TooFewForKrum { devices: usize, byzantine: usize },
    #[error("the aggregation's worker stopped: {0}")]
    Worker(String),
}

/// One accepted update of a robust round, as the participant's row names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredUpdate {
    pub device_id: i64,
    pub digest: String,
}

/// The updates of one round in the blob store, each `len` f32 values.
pub struct RoundUpdates<'a> {
    pub blobs: &'a BlobStore,
    pub round_id: i64,
    pub updates: &'a [StoredUpdate],
    pub len: usize,
}

/// How many coordinates a block spans with `devices` updates.
pub fn block_len(devices: usize) -> usize {
    (BLOCK_BUDGET_BYTES / (4 * devices.max(1))).max(1)
}

impl RoundUpdates<'_> {
    /// The robust aggregate of the round's updates: the vector the rule
    /// gives, which the server's optimizer steps on as FedAvg's mean.
    pub async fn aggregate(&self, rule: Rule) -> Result<Vec<f64>, RobustError> {
        if self.updates.is_empty() {
            return Err(RobustError::NoUpdates);
        }
        match rule {
            Rule::Median => self.coordinate_wise(median).await,
            Rule::TrimmedMean { trim_fraction } => {
                let trim = trimmed_count(self.updates.len(), trim_fraction);
                self.coordinate_wise(move |column| trimmed_mean(column, trim))
                    .await
            }
            Rule::Krum { byzantine } => self.krum(byzantine, Some(1)).await,
            Rule::MultiKrum {
                byzantine,
                selected,
            } => self.krum(byzantine, selected).await,
        }
    }

    /// Applies `of_column` to each coordinate's n values, block by block.
    async fn coordinate_wise<F>(&self, of_column: F) -> Result<Vec<f64>, RobustError>
    where
        F: Fn(&mut [f32]) -> f64 + Send + Sync + Copy + 'static,
    {
        let mut aggregate = Vec::with_capacity(self.len);
        for range in self.blocks() {
            let block = self.read_block(range).await?;
            let part = blocking(move || block.coordinate_wise(of_column)).await?;
            aggregate.extend(part);
        }
        Ok(aggregate)
    }

    /// Krum's choice, averaged: the `selected` updates (n − f when `None`)
    /// with the smallest scores.
    async fn krum(
        &self,
        byzantine: usize,
        selected: Option<usize>,
    ) -> Result<Vec<f64>, RobustError> {
        let devices = self.updates.len();
        if devices > MAX_KRUM_DEVICES as usize {
            return Err(RobustError::TooManyForKrum { devices });
        }
        if devices <= 2 * byzantine + 2 {
            return Err(RobustError::TooFewForKrum { devices, byzantine });
        }
        let mut distances = vec![0.0f64; devices * devices];
        for range in self.blocks() {
            let block = self.read_block(range).await?;
            distances = blocking(move || {
                block.add_squared_distances(&mut distances);
                distances
            })
            .await?;
        }
        let chosen = krum_choice(
            &distances,
            devices,
            byzantine,
            selected.unwrap_or(devices - byzantine),
        );
        tracing::info!(
            round = self.round_id,
            chosen = ?chosen.iter().map(|&i| self.updates[i].device_id).collect::<Vec<_>>(),
            "Krum chose its updates"
        );
        let mut aggregate = Vec::with_capacity(self.len);
        for range in self.blocks() {
            let block = self.read_block(range).await?;
            let chosen = chosen.clone();
            aggregate.extend(blocking(move || block.mean_of(&chosen)).await?);
        }
        Ok(aggregate)
    }

    fn blocks(&self) -> impl Iterator<Item = Range<usize>> + use<> {
        let (len, step) = (self.len, block_len(self.updates.len()));
        (0..len.div_ceil(step)).map(move |i| i * step..((i + 1) * step).min(len))
    }

    /// Every update's values at `range`, [`READ_CONCURRENCY`] reads at a
    /// time.
    async fn read_block(&self, range: Range<usize>) -> Result<Block, RobustError> {
        let bytes = (range.start as u64 * 4)..(range.end as u64 * 4);
        let mut rows = Vec::with_capacity(self.updates.len());
        for chunk in self.updates.chunks(READ_CONCURRENCY) {
            // Owned futures: each read holds its own handle on the store.
            let reads: Vec<_> = chunk
                .iter()
                .map(|update| {
                    read_row(
                        self.blobs.clone(),
                        self.round_id,
                        update.clone(),
                        bytes.clone(),
                    )
                })
                .collect();
            rows.extend(futures_util::future::try_join_all(reads).await?);
        }
        Ok(Block {
            rows,
            width: range.len(),
        })
    }
}

/// One stored update's values at the byte range `bytes`.
async fn read_row(
    blobs: BlobStore,
    round_id: i64,
    update: StoredUpdate,
    bytes: Range<u64>,
) -> Result<Vec<f32>, RobustError> {
    let device_id = update.device_id;
    let read = blobs
        .read_update(round_id, device_id, &update.digest, bytes.clone())
        .await
        .map_err(|source| RobustError::Read { device_id, source })?;
    let expected = bytes.end - bytes.start;
    if read.len() as u64 != expected {
        return Err(RobustError::Truncated {
            device_id,
            range: bytes,
            expected,
            got: read.len() as u64,
        });
    }
    Ok(read
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect())
}

async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, RobustError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|error| RobustError::Worker(error.to_string()))
}

/// One block: each device's values for the same `width` coordinates.
pub struct Block {
    pub rows: Vec<Vec<f32>>,
    pub width: usize,
}

impl Block {
    fn coordinate_wise(&self, of_column: impl Fn(&mut [f32]) -> f64) -> Vec<f64> {
        let mut column = vec![0.0f32; self.rows.len()];
        (0..self.width)
            .map(|j| {
                for (value, row) in column.iter_mut().zip(&self.rows) {
                    *value = row[j];
                }
                of_column(&mut column)
            })
            .collect()
    }

    /// Adds each pair's squared L2 distance over this block to the n × n
    /// matrix `distances` (row-major, symmetric).
    pub fn add_squared_distances(&self, distances: &mut [f64]) {
        let n = self.rows.len();
        for i in 0..n {
            for j in i + 1..n {
                let d: f64 = self.rows[i]
                    .iter()
                    .zip(&self.rows[j])
                    .map(|(a, b)| {
                        let diff = f64::from(*a) - f64::from(*b);
                        diff * diff
                    })
                    .sum();
                distances[i * n + j] += d;
                distances[j * n + i] += d;
            }
        }
    }

    /// The unweighted mean of the rows `chosen`, in their order.
    fn mean_of(&self, chosen: &[usize]) -> Vec<f64> {
        let mut mean = vec![0.0f64; self.width];
        for &i in chosen {
            for (total, value) in mean.iter_mut().zip(&self.rows[i]) {
                *total += f64::from(*value);
            }
        }
        let count = chosen.len().max(1) as f64;
        mean.iter_mut().for_each(|total| *total /= count);
        mean
    }
}

/// The median of a column (the mean of the middle two when n is even).
pub fn median(column: &mut [f32]) -> f64 {
    let n = column.len();
    let (_, &mut upper, _) = column.select_nth_unstable_by(n / 2, f32::total_cmp);
    if n % 2 == 1 {
        return f64::from(upper);
    }
    // The lower middle is the largest of the half below the upper one.
    let lower = column[..n / 2]
        .iter()
        .copied()
        .max_by(f32::total_cmp)
        .unwrap_or(upper);
    0.5 * (f64::from(lower) + f64::from(upper))
}

/// How many values a trimmed mean drops from each end of n.
pub fn trimmed_count(n: usize, trim_fraction: f64) -> usize {
    let trim = (trim_fraction * n as f64).floor() as usize;
    // Below 0.5, so at least one value stays; the guard keeps it so.
    trim.min(n.saturating_sub(1) / 2)
}

/// The mean of a column without its `trim` smallest and largest values.
pub fn trimmed_mean(column: &mut [f32], trim: usize) -> f64 {
    let n = column.len();
    if trim > 0 {
        column.select_nth_unstable_by(trim - 1, f32::total_cmp);
        column[trim..].select_nth_unstable_by(n - 2 * trim, f32::total_cmp);
    }
    let kept = &column[trim..n - trim];
    kept.iter().map(|&v| f64::from(v)).sum::<f64>() / kept.len() as f64
}

/// Krum's scores from the n × n squared distances: each update's sum of
/// its `n − f − 2` smallest distances to the others; the indices of the
/// `selected` smallest scores, ties to the lower index.
pub fn krum_choice(distances: &[f64], n: usize, byzantine: usize, selected: usize) -> Vec<usize> {
    let neighbours = n.saturating_sub(byzantine + 2).max(1);
    let mut scores: Vec<(f64, usize)> = (0..n)
        .map(|i| {
            let mut row: Vec<f64> = (0..n)
                .filter(|&j| j != i)
                .map(|j| distances[i * n + j])
                .collect();
            row.sort_by(f64::total_cmp);
            (row.iter().take(neighbours).sum(), i)
        })
        .collect();
    scores.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let mut chosen: Vec<usize> = scores
        .iter()
        .take(selected.clamp(1, n))
        .map(|&(_, i)| i)
        .collect();
    chosen.sort_unstable();
    chosen
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_of_odd_and_even_columns() {
        assert_eq!(median(&mut [3.0, -1.0, 7.0]), 3.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(&mut [5.0]), 5.0);
        assert_eq!(median(&mut [9.0, 9.0, -1.0, 9.0]), 9.0);
    }

    #[test]
    fn a_trimmed_mean_drops_each_end() {
        let mut column = [100.0, 1.0, 2.0, 3.0, -100.0, 4.0];
        assert_eq!(trimmed_mean(&mut column, 1), 2.5);
        assert_eq!(trimmed_mean(&mut [1.0, 2.0, 6.0], 0), 3.0);
        // Two attackers at each end of ten, trimmed at 0.2.
        let mut column = [1e6, 1e6, -1e6, -1e6, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        assert_eq!(trimmed_mean(&mut column, trimmed_count(10, 0.2)), 3.5);
        assert_eq!(trimmed_count(10, 0.3), 3);
        assert_eq!(trimmed_count(2, 0.49), 0);
        assert_eq!(trimmed_count(3, 0.49), 1);
    }

    /// Three honest updates near each other and two far: Krum picks the
    /// honest one in the middle, Multi-Krum the honest three.
    #[test]
    fn krum_chooses_among_the_honest() {
        let rows = vec![
            vec![1.0, 1.0],
            vec![1.1, 0.9],
            vec![0.9, 1.1],
            vec![-10.0, -10.0],
            vec![10.0, 50.0],
        ];
        let block = Block { rows, width: 2 };
        let n = 5;
        let mut distances = vec![0.0; n * n];
        block.add_squared_distances(&mut distances);
        assert_eq!(krum_choice(&distances, n, 1, 1), vec![0]);
        assert_eq!(krum_choice(&distances, n, 1, 3), vec![0, 1, 2]);
        let mean = block.mean_of(&[0, 1, 2]);
        assert!((mean[0] - 1.0).abs() < 1e-6 && (mean[1] - 1.0).abs() < 1e-6);
    }

    #[test]
    fn the_schema_states_the_bounds() {
        use utoipa::PartialSchema;
        let schema = serde_json::to_value(RobustAggregation::schema()).unwrap();
        let text = |name: &str| schema["properties"][name].to_string();
        assert!(text("byzantine").contains(&format!("\"maximum\":{MAX_BYZANTINE}")));
        assert!(text("selected").contains(&format!("\"maximum\":{MAX_KRUM_DEVICES}")));
        assert!(text("trim_fraction").contains("\"exclusiveMaximum\":0.5"));
    }

    #[test]
    fn settings_are_checked_by_name() {
        let robust = |rule, trim_fraction, byzantine, selected| RobustAggregation {
            rule,
            trim_fraction,
            byzantine,
            selected,
        };
        let err = robust(RobustRule::TrimmedMean, Some(0.5), None, None).check(10, 10);
        assert!(
            err.unwrap_err()
                .contains("`robust_aggregation.trim_fraction`")
        );
        let err = robust(RobustRule::TrimmedMean, Some(f64::NAN), None, None).check(10, 10);
        assert!(err.unwrap_err().contains("trim_fraction"));
        let err = robust(RobustRule::Median, Some(0.1), None, None).check(10, 10);
        assert!(
            err.unwrap_err()
                .contains("applies only to the `trimmed_mean`")
        );
        let err = robust(RobustRule::Krum, None, Some(4), None).check(10, 10);
        assert!(
            err.unwrap_err()
                .contains("`min_devices` must be at least 11")
        );
        let err = robust(RobustRule::Krum, None, None, None).check(10, 10);
        assert!(
            err.unwrap_err()
                .contains("`robust_aggregation.byzantine` is required")
        );
        let err = robust(RobustRule::Krum, None, Some(499), None).check(u32::MAX, 10);
        assert!(err.unwrap_err().contains("at most 498"));
        let err = robust(RobustRule::MultiKrum, None, Some(1), Some(0)).check(10, 10);
        assert!(err.unwrap_err().contains("`robust_aggregation.selected`"));
        assert_eq!(
            robust(RobustRule::Krum, None, Some(3), None).check(10, 10),
            Ok(Rule::Krum { byzantine: 3 })
        );
        let err = robust(RobustRule::Krum, None, Some(3), None).check(10, 1_001);
        assert!(err.unwrap_err().contains("select up to 1001 devices"));
        assert!(
            robust(RobustRule::Median, None, None, None)
                .check(10, 100_000)
                .is_ok()
        );
    }
}
