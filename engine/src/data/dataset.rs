//! The in-memory dataset: N samples of one fixed-shape f32 feature tensor
//! each, stored contiguously, with integer class labels.

use std::path::Path;

use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

use super::data_err;
use super::limits::{MAX_CLASSES, MAX_DIMS, MAX_ELEMENTS, MAX_FEATURES_PER_SAMPLE, OverBound};
use super::read::checked_product;
use crate::error::{EngineError, EngineResult};
// The floor on a standard deviation used to divide, so constant features
// (e.g. MNIST's always-black border pixels) map to 0 instead of NaN.
use crate::stats::{InputMoments, MIN_STD};

/// Path reported for datasets built in memory rather than loaded.
const IN_MEMORY: &str = "<in-memory dataset>";

/// N samples; sample `i` is `features[i * d .. (i + 1) * d]` with
/// `d = feature_shape.iter().product()`, labelled `labels[i]` in
/// `0..num_classes`. Fields are private so these invariants always hold.
#[derive(Clone, Debug, PartialEq)]
pub struct Dataset {
    features: Vec<f32>,
    feature_shape: Vec<usize>,
    labels: Vec<i64>,
    num_classes: usize,
}

/// Per-feature mean and standard deviation, computed on a training set
/// and applied unchanged to its test set.
#[derive(Clone, Debug, PartialEq)]
pub struct FeatureStats {
    pub mean: Vec<f32>,
    pub std: Vec<f32>,
}

impl Dataset {
    /// Builds a dataset after checking that the sizes agree and every label
    /// lies in `0..num_classes`.
    pub fn new(
        features: Vec<f32>,
        feature_shape: Vec<usize>,
        labels: Vec<i64>,
        num_classes: usize,
    ) -> EngineResult<Dataset> {
        Self::from_parts(
            Path::new(IN_MEMORY),
            features,
            feature_shape,
            labels,
            num_classes,
        )
    }

    /// Like [`Dataset::new`] with errors naming the file the parts came from.
    pub(crate) fn from_parts(
        path: &Path,
        features: Vec<f32>,
        feature_shape: Vec<usize>,
        labels: Vec<i64>,
        num_classes: usize,
    ) -> EngineResult<Dataset> {
        let d = check_shape(&feature_shape).map_err(|c| data_err(path, c))?;
        if num_classes > MAX_CLASSES {
            return Err(data_err(
                path,
                format!("{num_classes} classes exceeds the limit of {MAX_CLASSES}"),
            ));
        }
        if Some(features.len()) != labels.len().checked_mul(d) {
            let cause = format!(
                "{} feature values do not make {} samples of shape {feature_shape:?}",
                features.len(),
                labels.len()
            );
            return Err(data_err(path, cause));
        }
        if let Some((i, &y)) = labels
            .iter()
            .enumerate()
            .find(|&(_, &y)| !label_ok(y, num_classes))
        {
            let cause = format!("label {y} of sample {i} is outside 0..{num_classes}");
            return Err(data_err(path, cause));
        }
        Ok(Dataset {
            features,
            feature_shape,
            labels,
            num_classes,
        })
    }

    /// Builds a dataset whose class count is one more than the largest label.
    pub(crate) fn infer_classes(
        path: &Path,
        features: Vec<f32>,
        feature_shape: Vec<usize>,
        labels: Vec<i64>,
    ) -> EngineResult<Dataset> {
        let max = labels.iter().copied().max().unwrap_or(-1);
        let num_classes = usize::try_from(max.saturating_add(1)).unwrap_or(0);
        Self::from_parts(path, features, feature_shape, labels, num_classes)
    }

    pub fn len(&self) -> usize {
        self.labels.len()
    }

    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Shape of one sample, e.g. `[1, 28, 28]` or `[64]`.
    pub fn feature_shape(&self) -> &[usize] {
        &self.feature_shape
    }

    /// Elements per sample (the product of the feature shape).
    pub fn feature_len(&self) -> usize {
        self.feature_shape.iter().product()
    }

    pub fn num_classes(&self) -> usize {
        self.num_classes
    }

    /// All features, sample-major.
    pub fn features(&self) -> &[f32] {
        &self.features
    }

    pub fn labels(&self) -> &[i64] {
        &self.labels
    }

    /// Sample `i`'s features and label, or `None` past the end.
    pub fn sample(&self, i: usize) -> Option<(&[f32], i64)> {
        let d = self.feature_len();
        let label = *self.labels.get(i)?;
        Some((&self.features[i * d..(i + 1) * d], label))
    }

    /// Gives back `(features, feature_shape, labels, num_classes)`.
    pub fn into_parts(self) -> (Vec<f32>, Vec<usize>, Vec<i64>, usize) {
        (
            self.features,
            self.feature_shape,
            self.labels,
            self.num_classes,
        )
    }

    /// The same samples viewed with another per-sample shape of the same
    /// size, e.g. `[784]` for an MLP or `[1, 28, 28]` for a conv net.
    pub fn with_feature_shape(mut self, shape: &[usize]) -> EngineResult<Dataset> {
        let d = check_shape(shape).map_err(EngineError::Shape)?;
        if !reshapes_to(&self.feature_shape, shape) {
            let cause = format!(
                "cannot view samples of shape {:?} ({} elements) as {shape:?} ({d} elements)",
                self.feature_shape,
                self.feature_len()
            );
            return Err(EngineError::Shape(cause));
        }
        self.feature_shape = shape.to_vec();
        Ok(self)
    }

    /// Declares more classes than the labels show, e.g. so a test split
    /// missing the top class agrees with its training split.
    pub fn with_num_classes(mut self, num_classes: usize) -> EngineResult<Dataset> {
        let max_label = self.labels.iter().copied().max().unwrap_or(-1);
        if num_classes > MAX_CLASSES || (max_label >= 0 && max_label as usize >= num_classes) {
            let cause =
                format!("cannot declare {num_classes} classes: largest label is {max_label}");
            return Err(EngineError::Shape(cause));
        }
        self.num_classes = num_classes;
        Ok(self)
    }

    /// The samples at `indices`, in that order (repeats allowed).
    ///
    /// # Panics
    /// If an index is out of range, like slice indexing; see
    /// [`Dataset::try_subset`] for a checked version.
    pub fn subset(&self, indices: &[usize]) -> Dataset {
        match self.try_subset(indices) {
            Ok(d) => d,
            Err(e) => panic!("{e}"),
        }
    }

    /// [`Dataset::subset`] that reports an out-of-range index as an error.
    pub fn try_subset(&self, indices: &[usize]) -> EngineResult<Dataset> {
        if let Some(&bad) = indices.iter().find(|&&i| i >= self.len()) {
            let cause = format!("subset index {bad} out of range for {} samples", self.len());
            return Err(EngineError::Shape(cause));
        }
        let mut features = Vec::with_capacity(indices.len() * self.feature_len());
        let mut labels = Vec::with_capacity(indices.len());
        self.gather(indices, &mut features, &mut labels);
        Ok(Dataset {
            features,
            feature_shape: self.feature_shape.clone(),
            labels,
            num_classes: self.num_classes,
        })
    }

    /// Appends the samples at `indices` (already checked in range) to the
    /// buffers: one contiguous copy per sample, the batching hot path.
    pub(crate) fn gather(&self, indices: &[usize], x: &mut Vec<f32>, y: &mut Vec<i64>) {
        let d = self.feature_len();
        x.reserve(indices.len() * d);
        y.reserve(indices.len());
        for &i in indices {
            x.extend_from_slice(&self.features[i * d..(i + 1) * d]);
            y.push(self.labels[i]);
        }
    }

    /// Multiplies every feature by `factor` (e.g. 1/255 for raw pixels).
    pub fn scale(&mut self, factor: f32) {
        self.features.iter_mut().for_each(|x| *x *= factor);
    }

    /// Maps every feature `x` to `(x - mean) / std` with one global pair,
    /// e.g. MNIST's customary (0.1307, 0.3081).
    pub fn normalize(&mut self, mean: f32, std: f32) -> EngineResult<()> {
        if !(std.is_finite() && std > 0.0 && mean.is_finite()) {
            return Err(EngineError::Shape(format!(
                "cannot normalize with mean {mean}, std {std}"
            )));
        }
        let inv = 1.0 / std;
        self.features
            .iter_mut()
            .for_each(|x| *x = (*x - mean) * inv);
        Ok(())
    }

    /// Global mean and standard deviation over all feature values.
    pub fn global_stats(&self) -> (f32, f32) {
        let n = self.features.len().max(1) as f64;
        let mean = self.features.iter().map(|&x| x as f64).sum::<f64>() / n;
        let var = self
            .features
            .iter()
            .map(|&x| (x as f64 - mean).powi(2))
            .sum::<f64>()
            / n;
        (mean as f32, var.sqrt() as f32)
    }

    /// Per-feature mean and standard deviation (population), accumulated
    /// in f64 so large datasets do not lose precision.
    pub fn feature_stats(&self) -> FeatureStats {
        InputMoments::of(self).feature_stats_unchecked()
    }

    /// Standardizes each feature to zero mean, unit variance and returns
    /// the statistics used, to apply to the matching test set with
    /// [`Dataset::apply_stats`].
    pub fn standardize(&mut self) -> FeatureStats {
        let stats = self.feature_stats();
        self.apply_unchecked(&stats);
        stats
    }

    /// Applies statistics from [`Dataset::standardize`] (usually computed
    /// on another split). Constant features (std ~ 0) become 0.
    pub fn apply_stats(&mut self, stats: &FeatureStats) -> EngineResult<()> {
        let d = self.feature_len();
        if stats.mean.len() != d || stats.std.len() != d {
            let cause = format!(
                "stats for {} / {} features applied to samples of {d} features",
                stats.mean.len(),
                stats.std.len()
            );
            return Err(EngineError::Shape(cause));
        }
        self.apply_unchecked(stats);
        Ok(())
    }

    fn apply_unchecked(&mut self, stats: &FeatureStats) {
        let inv: Vec<f32> = stats.std.iter().map(|&s| 1.0 / s.max(MIN_STD)).collect();
        for row in self
            .features
            .chunks_exact_mut(self.feature_shape.iter().product::<usize>().max(1))
        {
            for ((x, &m), &k) in row.iter_mut().zip(&stats.mean).zip(&inv) {
                *x = (*x - m) * k;
            }
        }
    }

    /// Samples per class, indexed by label.
    pub fn class_counts(&self) -> Vec<usize> {
        let mut counts = vec![0; self.num_classes];
        for &y in &self.labels {
            counts[y as usize] += 1;
        }
        counts
    }

    /// Indices of each class's samples, in dataset order.
    pub(crate) fn indices_by_class(&self) -> Vec<Vec<usize>> {
        let mut by_class = vec![Vec::new(); self.num_classes];
        for (i, &y) in self.labels.iter().enumerate() {
            by_class[y as usize].push(i);
        }
        by_class
    }

    /// Stratified split: each class sends `round(n_c * test_fraction)` of
    /// its samples, chosen with `seed`, to the test set, so both sets keep
    /// the class balance. Both keep the original sample order.
    pub fn split(&self, test_fraction: f64, seed: u64) -> EngineResult<(Dataset, Dataset)> {
        if !(0.0..=1.0).contains(&test_fraction) {
            return Err(EngineError::Shape(format!(
                "test fraction {test_fraction} is not in [0, 1]"
            )));
        }
        let mut rng = StdRng::seed_from_u64(seed);
        let (mut train, mut test) = (Vec::new(), Vec::new());
        for mut idx in self.indices_by_class() {
            idx.shuffle(&mut rng);
            let n_test = (idx.len() as f64 * test_fraction).round() as usize;
            test.extend_from_slice(&idx[..n_test]);
            train.extend_from_slice(&idx[n_test..]);
        }
        train.sort_unstable();
        test.sort_unstable();
        Ok((self.subset(&train), self.subset(&test)))
    }
}

fn label_ok(y: i64, num_classes: usize) -> bool {
    y >= 0 && (y as u64) < num_classes as u64
}

/// Checks a per-sample shape against the limits; returns its element count.
fn check_shape(shape: &[usize]) -> Result<usize, String> {
    if shape.is_empty() || shape.len() > MAX_DIMS {
        return Err(format!(
            "feature shape {shape:?} must have 1..={MAX_DIMS} dimensions"
        ));
    }
    match checked_product(shape, MAX_FEATURES_PER_SAMPLE) {
        Some(d) if d > 0 => Ok(d),
        _ => Err(format!(
            "feature shape {shape:?} must have 1..={MAX_FEATURES_PER_SAMPLE} elements"
        )),
    }
}

/// Checks that `n` samples of `d` values fit `max_values` (and the
/// engine's own cap); the total.
pub(crate) fn check_total(n: usize, d: usize, max_values: usize) -> Result<usize, OverBound> {
    let limit = max_values.min(MAX_ELEMENTS);
    n.checked_mul(d)
        .filter(|&t| t <= limit)
        .ok_or(OverBound::Values {
            values: (n as u64).saturating_mul(d as u64),
            limit: limit as u64,
        })
}

/// The one rule for feature values, every loader's: NaN and ±inf are
/// refused, since every loss computed on them is NaN (a central
/// evaluation would be stored with no loss). `Err` is the cause, for the
/// loader to say where the value is.
pub(crate) fn finite_feature(x: f32) -> Result<f32, &'static str> {
    if x.is_finite() {
        Ok(x)
    } else {
        Err("not a finite number")
    }
}

/// Whether samples of shape `from` can be viewed as `to`, the rule of
/// [`Dataset::with_feature_shape`] (the same number of elements), so the
/// server can tell from a device's report whether its data fits a model.
pub fn reshapes_to(from: &[usize], to: &[usize]) -> bool {
    let elements = |shape: &[usize]| shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
    matches!((elements(from), elements(to)), (Some(a), Some(b)) if a == b)
}
