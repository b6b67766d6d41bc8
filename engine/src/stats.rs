//! Input statistics from moments.
//!
//! A model's `Standardize` layer reads one global `input.mean` and
//! `input.std` (frozen parameters). They are fitted from per-feature sums
//! ([`InputMoments`]) rather than from the samples directly, because sums
//! merge exactly: a device can report its shard's moments, a server can
//! add them up, and the result equals the moments of all the data at once.
//! `canopy model train`, `canopy model stats` and a federated statistics
//! round therefore fit the same numbers by the same code:
//! [`InputMoments::of`], [`InputMoments::merge`], then [`fit_model`].
//!
//! The moments are kept per feature (per element of a flattened sample) so
//! per-feature statistics ([`InputMoments::to_feature_stats`]) come from
//! the same report as the global pair ([`InputMoments::to_input_stats`]).

use canopy_ir::{Model, TensorData};

use crate::data::limits::MAX_FEATURES_PER_SAMPLE;
use crate::data::{Dataset, FeatureStats};
use crate::error::{EngineError, EngineResult, Part};
use crate::nn::{INPUT_MEAN, INPUT_STD};
use crate::zoo::{PROP_INPUT_STATS, sample_shape};

/// Most features one set of moments may describe: a sample's element cap.
pub const MAX_STATS_FEATURES: usize = MAX_FEATURES_PER_SAMPLE;

/// Floor under which a standard deviation counts as zero. Dividing by it
/// would blow rounding noise up to huge inputs, so per-feature
/// standardisation maps such features to 0 and the global fit refuses
/// them (every input constant).
pub const MIN_STD: f32 = 1e-6;

/// Relative slack for rounding in accumulated sums. Sequential f64 sums of
/// n values are off by at most about n·ε relative; 1e-6 covers n up to
/// billions while still catching reports that cannot come from real data.
const ROUNDING_SLACK: f64 = 1e-6;

/// Why a set of moments or statistics cannot be used.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum StatsError {
    #[error("input moments describe no samples (count is 0)")]
    Empty,
    #[error("input moments have {sum} sums but {sum_sq} sums of squares")]
    Lengths { sum: usize, sum_sq: usize },
    #[error("input moments describe {got} features, outside 1..={max}")]
    FeatureLimit { got: usize, max: usize },
    #[error("input moments of {got} features do not fit {expected} ({of})")]
    FeatureCount {
        expected: usize,
        got: usize,
        of: String,
    },
    #[error(
        "input moments of feature {feature} are not finite (sum {sum}, sum of squares {sum_sq})"
    )]
    NotFinite {
        feature: usize,
        sum: f64,
        sum_sq: f64,
    },
    /// A sum of squares smaller than a sum of `count` values allows
    /// (Cauchy–Schwarz: sum² ≤ count·sum_sq), so no data could give it.
    #[error(
        "input moments of feature {feature} are inconsistent: sum {sum} is impossible for \
         {count} values whose squares sum to {sum_sq}"
    )]
    Inconsistent {
        feature: usize,
        count: u64,
        sum: f64,
        sum_sq: f64,
    },
    #[error("merging input moments overflows the sample count ({a} + {b})")]
    CountOverflow { a: u64, b: u64 },
    #[error(
        "cannot standardise inputs: the features have mean {mean} and std {std} \
         (every input is constant, or std is below {MIN_STD})"
    )]
    Constant { mean: f64, std: f64 },
}

/// Per-feature count, sum and sum of squares of a set of samples, in f64
/// so large datasets and many merged reports keep their precision.
#[derive(Clone, Debug, PartialEq)]
pub struct InputMoments {
    pub count: u64,
    pub sum: Vec<f64>,
    pub sum_sq: Vec<f64>,
}

/// The global statistics a model's `Standardize` layer applies.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct InputStats {
    pub mean: f32,
    pub std: f32,
}

/// Where a model stands with its input statistics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InputStatsState {
    /// The model has no `Standardize` layer (`input.mean` / `input.std`).
    Absent,
    /// Still the identity (mean 0, std 1): nothing was fitted yet.
    Unfitted,
    Fitted,
}

impl InputStatsState {
    /// The model's state. The metadata property [`PROP_INPUT_STATS`]
    /// (`unfitted` / `fitted`) decides; a file without the property (made
    /// by hand or by an older producer) counts as unfitted exactly when its
    /// statistics are still the identity `Standardize` starts from, mean 0
    /// and std 1, since no fit of real data yields exactly that.
    pub fn of(model: &Model) -> InputStatsState {
        let value = |name| {
            model
                .parameter(name)
                .and_then(|p| p.data.as_f32())
                .and_then(|v| v.first().copied())
        };
        let (Some(mean), Some(std)) = (value(INPUT_MEAN), value(INPUT_STD)) else {
            return InputStatsState::Absent;
        };
        let marker = model.metadata.properties.get(PROP_INPUT_STATS);
        match marker.map(String::as_str) {
            Some(text) if text == InputStatsState::Unfitted.marker() => InputStatsState::Unfitted,
            Some(text) if text == InputStatsState::Fitted.marker() => InputStatsState::Fitted,
            _ if mean == 0.0 && std == 1.0 => InputStatsState::Unfitted,
            _ => InputStatsState::Fitted,
        }
    }

    /// The value of [`PROP_INPUT_STATS`] that records this state.
    pub fn marker(self) -> &'static str {
        match self {
            InputStatsState::Absent => "absent",
            InputStatsState::Unfitted => "unfitted",
            InputStatsState::Fitted => "fitted",
        }
    }
}

impl InputMoments {
    /// No samples yet over `features` features; [`InputMoments::merge`]
    /// adds reports to it.
    pub fn empty(features: usize) -> InputMoments {
        InputMoments {
            count: 0,
            sum: vec![0.0; features],
            sum_sq: vec![0.0; features],
        }
    }

    /// The moments of every sample of `data`, each sample flattened.
    pub fn of(data: &Dataset) -> InputMoments {
        let features = data.feature_len();
        let mut moments = InputMoments::empty(features);
        for row in data.features().chunks_exact(features.max(1)) {
            for ((sum, sum_sq), &x) in moments.sum.iter_mut().zip(&mut moments.sum_sq).zip(row) {
                let x = f64::from(x);
                *sum += x;
                *sum_sq += x * x;
            }
        }
        moments.count = data.len() as u64;
        moments
    }

    /// Features per sample.
    pub fn features(&self) -> usize {
        self.sum.len()
    }

    /// Adds `other`'s samples. Leaves `self` unchanged on error.
    pub fn merge(&mut self, other: &InputMoments) -> EngineResult<()> {
        check_lengths(other)?;
        if other.features() != self.features() {
            return Err(StatsError::FeatureCount {
                expected: self.features(),
                got: other.features(),
                of: "the moments they merge into".into(),
            }
            .into());
        }
        let count = self
            .count
            .checked_add(other.count)
            .ok_or(StatsError::CountOverflow {
                a: self.count,
                b: other.count,
            })?;
        self.count = count;
        add_into(&mut self.sum, &other.sum);
        add_into(&mut self.sum_sq, &other.sum_sq);
        Ok(())
    }

    /// Checks that some non-empty data could have produced these moments:
    /// matching lengths within [`MAX_STATS_FEATURES`], a positive count,
    /// finite sums, and sums of squares that fit the sums.
    pub fn validate(&self) -> EngineResult<()> {
        check_lengths(self)?;
        if self.count == 0 {
            return Err(StatsError::Empty.into());
        }
        let count = self.count as f64;
        for (feature, (&sum, &sum_sq)) in self.sum.iter().zip(&self.sum_sq).enumerate() {
            if !(sum.is_finite() && sum_sq.is_finite()) {
                return Err(StatsError::NotFinite {
                    feature,
                    sum,
                    sum_sq,
                }
                .into());
            }
            if sum_sq < 0.0 || sum * sum > count * sum_sq * (1.0 + ROUNDING_SLACK) {
                return Err(StatsError::Inconsistent {
                    feature,
                    count: self.count,
                    sum,
                    sum_sq,
                }
                .into());
            }
        }
        Ok(())
    }

    /// [`InputMoments::validate`], then checks the feature count against
    /// the input of `model`.
    pub fn validate_for(&self, model: &Model) -> EngineResult<()> {
        self.validate()?;
        let shape = sample_shape(model)?;
        let expected: usize = shape.iter().product();
        if self.features() != expected {
            return Err(StatsError::FeatureCount {
                expected,
                got: self.features(),
                of: format!(
                    "the input of model `{}`, samples of shape {shape:?}",
                    model.metadata.model_name
                ),
            }
            .into());
        }
        Ok(())
    }

    /// Per-feature mean and population std, as [`Dataset::feature_stats`].
    pub fn to_feature_stats(&self) -> EngineResult<FeatureStats> {
        self.validate()?;
        Ok(self.feature_stats_unchecked())
    }

    /// Per-feature statistics with no checks; an empty set gives zeros.
    pub(crate) fn feature_stats_unchecked(&self) -> FeatureStats {
        let count = self.count.max(1) as f64;
        let (mean, std) = self
            .sum
            .iter()
            .zip(&self.sum_sq)
            .map(|(&sum, &sum_sq)| {
                let (mean, std) = mean_std(count, sum, sum_sq);
                (mean as f32, std as f32)
            })
            .unzip();
        FeatureStats { mean, std }
    }

    /// The global mean and std over every feature value, which a model's
    /// `Standardize` layer applies (global, so constant pixels such as
    /// MNIST's border cannot cause a division by zero). Refuses a std
    /// under [`MIN_STD`].
    pub fn to_input_stats(&self) -> EngineResult<InputStats> {
        self.validate()?;
        let values = self.count as f64 * self.features() as f64;
        let (mean, std) = mean_std(values, self.sum.iter().sum(), self.sum_sq.iter().sum());
        if std < f64::from(MIN_STD) {
            return Err(StatsError::Constant { mean, std }.into());
        }
        Ok(InputStats {
            mean: mean as f32,
            std: std as f32,
        })
    }
}

/// Fits `model`'s input statistics from `moments` and marks them fitted:
/// the one writer of `input.mean` / `input.std`, used by `canopy model
/// train`, `canopy model stats` and federated fits alike. Returns what it
/// wrote.
pub fn fit_model(model: &mut Model, moments: &InputMoments) -> EngineResult<InputStats> {
    moments.validate_for(model)?;
    let stats = moments.to_input_stats()?;
    for name in [INPUT_MEAN, INPUT_STD] {
        if model.parameter(name).is_none() {
            return Err(EngineError::Missing {
                owner: format!("model `{}`", model.metadata.model_name),
                part: Part::Parameter,
                name: name.to_string(),
            });
        }
    }
    for (name, value) in [(INPUT_MEAN, stats.mean), (INPUT_STD, stats.std)] {
        if let Some(param) = model.parameter_mut(name) {
            param.data = TensorData::scalar_f32(value);
        }
    }
    model.metadata.properties.insert(
        PROP_INPUT_STATS.into(),
        InputStatsState::Fitted.marker().into(),
    );
    Ok(stats)
}

/// Mean and population std of `count` values from their sum and sum of
/// squares: the one home of this rule. The variance E[x²] − mean² loses
/// the digits the two terms share, so a variance within rounding of
/// E[x²] counts as zero (a constant feature), never as a tiny positive
/// value that would later divide.
fn mean_std(count: f64, sum: f64, sum_sq: f64) -> (f64, f64) {
    let mean = sum / count;
    let mean_sq = sum_sq / count;
    let variance = mean_sq - mean * mean;
    if variance <= mean_sq * 8.0 * f64::EPSILON {
        return (mean, 0.0);
    }
    (mean, variance.sqrt())
}

fn check_lengths(moments: &InputMoments) -> Result<(), StatsError> {
    let (sum, sum_sq) = (moments.sum.len(), moments.sum_sq.len());
    if sum != sum_sq {
        return Err(StatsError::Lengths { sum, sum_sq });
    }
    if sum == 0 || sum > MAX_STATS_FEATURES {
        return Err(StatsError::FeatureLimit {
            got: sum,
            max: MAX_STATS_FEATURES,
        });
    }
    Ok(())
}

fn add_into(total: &mut [f64], part: &[f64]) {
    total.iter_mut().zip(part).for_each(|(t, p)| *t += p);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 40 samples of 6 features on different scales, one of them constant.
    fn sample_data() -> Dataset {
        let features = (0..40 * 6)
            .map(|i| {
                let (sample, feature) = (i / 6, i % 6);
                match feature {
                    0 => 0.25,
                    f => ((sample * 37 + f * 11) % 17) as f32 * f as f32 - 3.0,
                }
            })
            .collect();
        let labels = (0..40).map(|i| i % 3).collect();
        Dataset::new(features, vec![6], labels, 3).unwrap()
    }

    fn close(a: f64, b: f64, tolerance: f64) -> bool {
        (a - b).abs() <= tolerance * b.abs().max(1.0)
    }

    #[test]
    fn halves_merged_equal_the_whole() {
        let data = sample_data();
        let first: Vec<usize> = (0..17).collect();
        let rest: Vec<usize> = (17..40).collect();
        let mut merged = InputMoments::of(&data.subset(&first));
        merged
            .merge(&InputMoments::of(&data.subset(&rest)))
            .unwrap();
        let whole = InputMoments::of(&data);
        assert_eq!(merged.count, whole.count);
        for (a, b) in merged.sum.iter().zip(&whole.sum) {
            assert!(close(*a, *b, 1e-9), "sum {a} vs {b}");
        }
        for (a, b) in merged.sum_sq.iter().zip(&whole.sum_sq) {
            assert!(close(*a, *b, 1e-9), "sum of squares {a} vs {b}");
        }
        let mut from_empty = InputMoments::empty(6);
        from_empty.merge(&whole).unwrap();
        assert_eq!(from_empty, whole);
    }

    #[test]
    fn statistics_equal_the_two_pass_fits_on_the_same_data() {
        let data = sample_data();
        let moments = InputMoments::of(&data);
        let global = moments.to_input_stats().unwrap();
        let (mean, std) = data.global_stats();
        assert!(close(global.mean.into(), mean.into(), 1e-6), "{global:?}");
        assert!(close(global.std.into(), std.into(), 1e-6), "{global:?}");

        let per_feature = moments.to_feature_stats().unwrap();
        let n = data.len() as f64;
        for feature in 0..6 {
            let column: Vec<f64> = (0..data.len())
                .map(|i| f64::from(data.sample(i).unwrap().0[feature]))
                .collect();
            let mean = column.iter().sum::<f64>() / n;
            let std = (column.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n).sqrt();
            assert!(close(per_feature.mean[feature].into(), mean, 1e-6));
            assert!(close(per_feature.std[feature].into(), std, 1e-6));
        }
        assert_eq!(per_feature.std[0], 0.0, "a constant feature has std 0");
        assert_eq!(per_feature, data.feature_stats());
    }

    #[test]
    fn merge_refuses_another_feature_count_and_keeps_its_moments() {
        let mut moments = InputMoments::of(&sample_data());
        let before = moments.clone();
        let error = moments.merge(&InputMoments::empty(5)).unwrap_err();
        assert!(
            error.to_string().contains("5 features do not fit 6"),
            "{error}"
        );
        let overflow = InputMoments {
            count: u64::MAX,
            ..InputMoments::empty(6)
        };
        assert!(matches!(
            moments.merge(&overflow),
            Err(EngineError::Stats(StatsError::CountOverflow { .. }))
        ));
        assert_eq!(moments, before);
    }

    #[test]
    fn validation_refuses_moments_no_data_could_give() {
        let good = InputMoments::of(&sample_data());
        good.validate().unwrap();
        let refused = |moments: InputMoments| match moments.validate() {
            Err(EngineError::Stats(error)) => error,
            other => panic!("accepted {moments:?}: {other:?}"),
        };
        assert_eq!(
            refused(InputMoments::empty(6)),
            StatsError::Empty,
            "no samples"
        );
        let mut short = good.clone();
        short.sum_sq.pop();
        assert!(matches!(refused(short), StatsError::Lengths { .. }));
        let mut nan = good.clone();
        nan.sum[2] = f64::NAN;
        assert!(matches!(
            refused(nan),
            StatsError::NotFinite { feature: 2, .. }
        ));
        let mut negative = good.clone();
        negative.sum_sq[1] = -1.0;
        assert!(matches!(refused(negative), StatsError::Inconsistent { .. }));
        let mut impossible = good.clone();
        impossible.sum[3] = (good.count as f64 * good.sum_sq[3]).sqrt() * 1.01;
        assert!(matches!(
            refused(impossible),
            StatsError::Inconsistent { feature: 3, .. }
        ));
        let none = InputMoments {
            count: 1,
            sum: vec![],
            sum_sq: vec![],
        };
        assert!(matches!(
            refused(none),
            StatsError::FeatureLimit { got: 0, .. }
        ));
        let too_many = InputMoments {
            count: 1,
            ..InputMoments::empty(MAX_STATS_FEATURES + 1)
        };
        assert!(matches!(refused(too_many), StatsError::FeatureLimit { .. }));
    }

    #[test]
    fn constant_inputs_have_no_global_standardisation() {
        let data = Dataset::new(vec![0.3; 4 * 10], vec![4], vec![0; 10], 1).unwrap();
        let error = InputMoments::of(&data).to_input_stats().unwrap_err();
        assert!(
            matches!(error, EngineError::Stats(StatsError::Constant { .. })),
            "{error}"
        );
    }

    fn small_mlp() -> Model {
        let config = crate::zoo::ModelConfig {
            architecture: crate::zoo::Architecture::Mlp {
                inputs: 6,
                hidden: 4,
                classes: 3,
            },
            seed: 1,
            optimizer: crate::optim::Optimizer::sgd(),
            frozen_prefixes: vec![],
            producer: "test".into(),
        };
        crate::zoo::build_model(&config).unwrap()
    }

    fn scalar(model: &Model, name: &str) -> f32 {
        model.parameter(name).unwrap().data.as_f32().unwrap()[0]
    }

    #[test]
    fn fitting_writes_the_statistics_and_marks_them_fitted() {
        let mut model = small_mlp();
        assert_eq!(InputStatsState::of(&model), InputStatsState::Unfitted);
        let data = sample_data();
        let stats = fit_model(&mut model, &InputMoments::of(&data)).unwrap();
        assert_eq!(InputStatsState::of(&model), InputStatsState::Fitted);
        assert_eq!(scalar(&model, INPUT_MEAN), stats.mean);
        assert_eq!(scalar(&model, INPUT_STD), stats.std);
        let (mean, std) = data.global_stats();
        assert!(close(stats.mean.into(), mean.into(), 1e-6));
        assert!(close(stats.std.into(), std.into(), 1e-6));
        model.validate().unwrap();
    }

    #[test]
    fn fitting_refuses_moments_of_another_input_size_and_leaves_the_model() {
        let mut model = small_mlp();
        let before = model.clone();
        let five = Dataset::new(vec![1.0, 2.0, 3.0, 4.0, 5.0], vec![5], vec![0], 1).unwrap();
        let error = fit_model(&mut model, &InputMoments::of(&five)).unwrap_err();
        let text = error.to_string();
        assert!(
            text.contains("5 features do not fit 6") && text.contains("model `mlp`"),
            "{text}"
        );
        assert_eq!(model, before);
    }

    #[test]
    fn a_file_without_the_marker_is_unfitted_only_at_the_identity() {
        let mut model = small_mlp();
        model.metadata.properties.remove(PROP_INPUT_STATS);
        assert_eq!(InputStatsState::of(&model), InputStatsState::Unfitted);
        model.parameter_mut(INPUT_STD).unwrap().data = TensorData::scalar_f32(0.3);
        assert_eq!(InputStatsState::of(&model), InputStatsState::Fitted);
        model.parameters.retain(|p| p.name != INPUT_MEAN);
        assert_eq!(InputStatsState::of(&model), InputStatsState::Absent);
    }
}
