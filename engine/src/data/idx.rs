//! IDX files, the MNIST format: a big-endian magic `0x0000TTNN` (TT the
//! element type, NN the number of dimensions), NN big-endian u32 sizes,
//! then the elements. Only unsigned bytes (TT = 0x08) are used by image
//! datasets, so only those are read.

use std::path::Path;

use super::data_err;
use super::dataset::{Dataset, check_total};
use super::limits::{MAX_CLASSES, MAX_DIMS, MAX_FEATURES_PER_SAMPLE, MAX_SAMPLES};
use super::read::{checked_product, read_file};
use crate::error::EngineResult;

/// IDX element type code for unsigned bytes.
const IDX_U8: u8 = 0x08;

/// A parsed IDX file: its sizes and the element bytes after the header.
struct Idx {
    dims: Vec<usize>,
    data: Vec<u8>,
}

/// Loads an images IDX file and its labels IDX file (each gzipped or not,
/// detected from the content) into a dataset. Pixels are scaled from u8 to
/// `[0, 1]`. Grey images `(N, H, W)` get an explicit channel axis,
/// `[1, H, W]`, the NCHW layout conv layers expect; use
/// [`Dataset::with_feature_shape`] for a flat `[H * W]`.
pub fn load_idx(images: impl AsRef<Path>, labels: impl AsRef<Path>) -> EngineResult<Dataset> {
    let (images, labels_path) = (images.as_ref(), labels.as_ref());
    let img = read_idx(images)?;
    if img.dims.len() < 2 {
        let cause = format!(
            "IDX magic {:#010x} is not an image file (expected 0x00000803)",
            magic(img.dims.len())
        );
        return Err(data_err(images, cause));
    }
    let labels = load_idx_labels(labels_path)?;
    if labels.len() != img.dims[0] {
        let cause = format!(
            "labels file has {} items but images file has {}",
            labels.len(),
            img.dims[0]
        );
        return Err(data_err(labels_path, cause));
    }
    let features = img.data.iter().map(|&b| f32::from(b) / 255.0).collect();
    Dataset::infer_classes(images, features, feature_shape(&img.dims), labels)
}

/// Loads a labels IDX file (magic 0x801: one u8 label per item).
pub fn load_idx_labels(path: impl AsRef<Path>) -> EngineResult<Vec<i64>> {
    let path = path.as_ref();
    let idx = read_idx(path)?;
    if idx.dims.len() != 1 {
        let cause = format!(
            "IDX magic {:#010x} is not a labels file (expected 0x00000801)",
            magic(idx.dims.len())
        );
        return Err(data_err(path, cause));
    }
    if let Some(&bad) = idx.data.iter().find(|&&b| usize::from(b) >= MAX_CLASSES) {
        return Err(data_err(
            path,
            format!("label {bad} exceeds the class limit"),
        ));
    }
    Ok(idx.data.iter().map(|&b| i64::from(b)).collect())
}

/// `(N, H, W)` becomes `[1, H, W]`; other ranks keep their per-sample shape.
fn feature_shape(dims: &[usize]) -> Vec<usize> {
    match dims {
        [_, h, w] => vec![1, *h, *w],
        [_, rest @ ..] => rest.to_vec(),
        [] => Vec::new(),
    }
}

fn magic(ndims: usize) -> u32 {
    (u32::from(IDX_U8) << 8) | ndims as u32
}

/// Reads and validates an IDX file of unsigned bytes: the header's sizes
/// must be within limits and account for every byte of the file exactly.
fn read_idx(path: &Path) -> EngineResult<Idx> {
    let bytes = read_file(path)?;
    let err = |cause: String| data_err(path, cause);
    let head = bytes.get(..4).ok_or_else(|| {
        err(format!(
            "file is {} bytes, too short for an IDX magic",
            bytes.len()
        ))
    })?;
    let magic = u32::from_be_bytes([head[0], head[1], head[2], head[3]]);
    let ndims = usize::from(head[3]);
    if head[..2] != [0, 0] || head[2] != IDX_U8 || ndims == 0 || ndims > MAX_DIMS {
        return Err(err(format!(
            "IDX magic {magic:#010x} is not an unsigned-byte IDX file with 1..={MAX_DIMS} dimensions \
             (expected 0x00000801 for labels or 0x00000803 for images)"
        )));
    }
    let header_len = 4 + 4 * ndims;
    let dims = parse_dims(&bytes, ndims).ok_or_else(|| {
        err(format!(
            "file is {} bytes, too short for a {ndims}-dimension IDX header",
            bytes.len()
        ))
    })?;
    check_dims(&dims).map_err(err)?;
    let claimed = dims.iter().product::<usize>();
    let actual = bytes.len() - header_len;
    if actual != claimed {
        let what = if actual < claimed {
            "truncated"
        } else {
            "has trailing bytes"
        };
        return Err(err(format!(
            "file {what}: header claims {dims:?} = {claimed} bytes of data, found {actual}"
        )));
    }
    let mut data = bytes;
    data.drain(..header_len);
    Ok(Idx { dims, data })
}

fn parse_dims(bytes: &[u8], ndims: usize) -> Option<Vec<usize>> {
    let raw = bytes.get(4..4 + 4 * ndims)?;
    Some(
        raw.chunks_exact(4)
            .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]) as usize)
            .collect(),
    )
}

/// Rejects sizes that are zero or beyond the limits before they are used.
fn check_dims(dims: &[usize]) -> Result<(), String> {
    let (n, rest) = dims.split_first().ok_or("IDX file has no dimensions")?;
    if *n == 0 || *n > MAX_SAMPLES {
        return Err(format!(
            "IDX file claims {n} items; expected 1..={MAX_SAMPLES}"
        ));
    }
    let per_item = checked_product(rest, MAX_FEATURES_PER_SAMPLE)
        .filter(|&d| d > 0)
        .ok_or_else(|| {
            format!(
                "IDX item shape {rest:?} is empty or exceeds {MAX_FEATURES_PER_SAMPLE} elements"
            )
        })?;
    check_total(*n, per_item).map(|_| ())
}
