//! The app's training data, checked and turned into the engine's
//! `Dataset`.

use std::path::Path;

use canopy_engine::data::{Dataset, LabelColumn, load_csv, load_dir, load_npy_dataset};

use crate::error::CanopyError;
use crate::types::TrainingData;

/// The most feature values one call may pass (1 GiB of f32): an explicit
/// bound, before anything is copied.
pub const MAX_FEATURE_VALUES: u64 = 1 << 28;
/// The most dimensions of one sample: the protocol's, since a dataset's
/// shape is reported to the server in the heartbeat.
pub use canopy_protocol::messages::MAX_SAMPLE_RANK;

/// Little-endian f32 values from bytes; the length must be a multiple
/// of 4.
pub(crate) fn f32_from_le_bytes(bytes: &[u8]) -> Result<Vec<f32>, CanopyError> {
    from_le_bytes(bytes, "feature", "float32", "<f4", f32::from_le_bytes)
}

/// Little-endian i64 values from bytes; the length must be a multiple
/// of 8.
pub(crate) fn i64_from_le_bytes(bytes: &[u8]) -> Result<Vec<i64>, CanopyError> {
    from_le_bytes(bytes, "label", "int64", "<i8", i64::from_le_bytes)
}

/// Values of `N` little-endian bytes each; `what` and the type names
/// make the error say which array is ragged and how numpy writes it.
fn from_le_bytes<T, const N: usize>(
    bytes: &[u8],
    what: &str,
    type_name: &str,
    numpy: &str,
    decode: impl Fn([u8; N]) -> T,
) -> Result<Vec<T>, CanopyError> {
    let chunks = bytes.chunks_exact(N);
    if !chunks.remainder().is_empty() {
        return Err(CanopyError::data(format!(
            "the {what} bytes are {} long, not a multiple of {N}\n\
             hint: pass {type_name} values, little-endian (numpy: `array.astype('{numpy}').tobytes()`)",
            bytes.len()
        )));
    }
    Ok(chunks
        .map(|chunk| decode(chunk.try_into().expect("chunks_exact gives N bytes")))
        .collect())
}

pub(crate) fn load(data: TrainingData) -> Result<Dataset, CanopyError> {
    let dataset = match data {
        TrainingData::Arrays {
            features,
            sample_shape,
            labels,
            classes,
        } => from_arrays(features, &sample_shape, labels, classes)?,
        TrainingData::Bytes {
            features_f32le,
            sample_shape,
            labels,
            classes,
        } => {
            if features_f32le.len() as u64 > MAX_FEATURE_VALUES * 4 {
                return Err(CanopyError::data(format!(
                    "the training data has more than {MAX_FEATURE_VALUES} feature values"
                )));
            }
            from_arrays(
                f32_from_le_bytes(&features_f32le)?,
                &sample_shape,
                labels,
                classes,
            )?
        }
        TrainingData::File { path, labels_path } => from_file(Path::new(&path), labels_path)?,
    };
    if dataset.is_empty() {
        return Err(CanopyError::data(
            "the training data has no samples\nhint: give at least one sample",
        ));
    }
    Ok(dataset)
}

fn from_arrays(
    features: Vec<f32>,
    sample_shape: &[u32],
    labels: Vec<i64>,
    classes: u32,
) -> Result<Dataset, CanopyError> {
    if sample_shape.is_empty() || sample_shape.len() > MAX_SAMPLE_RANK {
        return Err(CanopyError::data(format!(
            "the sample shape {sample_shape:?} has {} dimensions; it needs 1 to {MAX_SAMPLE_RANK}\n\
             hint: a flat feature vector of n values has shape [n]",
            sample_shape.len()
        )));
    }
    let per_sample = sample_shape
        .iter()
        .try_fold(1u64, |n, &d| n.checked_mul(u64::from(d)))
        .filter(|&n| n > 0 && n <= MAX_FEATURE_VALUES)
        .ok_or_else(|| {
            CanopyError::data(format!(
                "the sample shape {sample_shape:?} has a zero dimension or more than \
                 {MAX_FEATURE_VALUES} values"
            ))
        })?;
    let expected = per_sample.saturating_mul(labels.len() as u64);
    if features.len() as u64 != expected {
        return Err(CanopyError::data(format!(
            "the training data has {} feature values, but {} labels of shape {sample_shape:?} \
             need {expected}\nhint: features are the samples' values one after another, row major",
            features.len(),
            labels.len()
        )));
    }
    if let Some(index) = canopy_engine::backend::first_non_finite(&features) {
        return Err(CanopyError::data(format!(
            "feature value {index} (sample {}) is {}; training needs finite numbers\n\
             hint: drop or impute the samples with missing values",
            index as u64 / per_sample,
            features[index]
        )));
    }
    let shape = sample_shape.iter().map(|&d| d as usize).collect();
    Dataset::new(features, shape, labels, classes as usize)
        .map_err(|error| CanopyError::data(crate::error::chain(&error, None)))
}

fn from_file(path: &Path, labels_path: Option<String>) -> Result<Dataset, CanopyError> {
    let loaded = match labels_path {
        Some(labels) => load_npy_dataset(path, labels),
        None if path.is_dir() => load_dir(path).map(|(train, _)| train),
        None => load_csv(path, LabelColumn::Last),
    };
    loaded.map_err(|error| {
        CanopyError::data(crate::error::chain(
            &error,
            Some(
                "give a CSV file with the label last, a directory of IDX or CSV files, or \
                 `.npy` images with `labels_path`",
            ),
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arrays(features: Vec<f32>, shape: Vec<u32>, labels: Vec<i64>) -> TrainingData {
        TrainingData::Arrays {
            features,
            sample_shape: shape,
            labels,
            classes: 3,
        }
    }

    #[test]
    fn arrays_of_the_wrong_size_or_with_nan_are_refused_by_name() {
        let short = load(arrays(vec![0.0; 5], vec![2], vec![0, 1, 2])).unwrap_err();
        assert_eq!(short.name(), "InvalidData");
        assert!(short.message().contains("need 6"), "{short}");
        let nan = load(arrays(vec![0.0, 1.0, f32::NAN, 0.0], vec![2], vec![0, 1])).unwrap_err();
        assert!(nan.message().contains("sample 1"), "{nan}");
        let label = load(arrays(vec![0.0; 4], vec![2], vec![0, 7])).unwrap_err();
        assert_eq!(label.name(), "InvalidData");
        let huge = load(arrays(vec![], vec![1 << 20, 1 << 20], vec![])).unwrap_err();
        assert!(huge.message().contains("more than"), "{huge}");
        let empty = load(arrays(vec![], vec![2], vec![])).unwrap_err();
        assert!(empty.message().contains("no samples"), "{empty}");
    }

    #[test]
    fn feature_bytes_decode_little_endian_and_refuse_a_ragged_length() {
        let bytes: Vec<u8> = [1.5f32, -2.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert_eq!(f32_from_le_bytes(&bytes).expect("decodes"), vec![1.5, -2.0]);
        let ragged = f32_from_le_bytes(&bytes[..7]).unwrap_err();
        assert_eq!(ragged.name(), "InvalidData");
        assert!(ragged.message().contains("7 long"), "{ragged}");
        assert!(
            ragged
                .message()
                .contains("\nhint: pass float32 values, little-endian"),
            "{ragged}"
        );
    }

    #[test]
    fn good_arrays_load() {
        let data = load(arrays(vec![0.5; 6], vec![2], vec![0, 1, 2])).expect("loads");
        assert_eq!(data.len(), 3);
        assert_eq!(data.feature_shape(), &[2]);
    }

    #[test]
    fn a_missing_file_names_it() {
        let error = load(TrainingData::File {
            path: "/nonexistent/data.csv".into(),
            labels_path: None,
        })
        .unwrap_err();
        assert!(error.message().contains("/nonexistent/data.csv"), "{error}");
        assert!(error.message().contains("hint:"), "{error}");
    }
}
