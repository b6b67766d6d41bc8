//! IDX files, the MNIST format: a big-endian magic `0x0000TTNN` (TT the
//! element type, NN the number of dimensions), NN big-endian u32 sizes,
//! then the elements. Only unsigned bytes (TT = 0x08) are used by image
//! datasets, so only those are read.

use std::path::Path;

use super::data_err;
use super::dataset::{Dataset, check_total};
use super::limits::{DataBounds, MAX_CLASSES, MAX_DIMS, MAX_FEATURES_PER_SAMPLE, MAX_SAMPLES};
use super::read::{DataFile, checked_product};
use crate::error::EngineResult;

/// IDX element type code for unsigned bytes.
const IDX_U8: u8 = 0x08;

/// Loads an images IDX file and its labels IDX file (each gzipped or not,
/// detected from the content) into a dataset. Pixels are scaled from u8 to
/// `[0, 1]`. Grey images `(N, H, W)` get an explicit channel axis,
/// `[1, H, W]`, the NCHW layout conv layers expect; use
/// [`Dataset::with_feature_shape`] for a flat `[H * W]`.
pub fn load_idx(images: impl AsRef<Path>, labels: impl AsRef<Path>) -> EngineResult<Dataset> {
    load_idx_within(images, labels, &DataBounds::DEFAULT)
}

/// [`load_idx`] under `bounds` ([`DataBounds`] says what they cap; the
/// two files share the byte bound).
pub fn load_idx_within(
    images: impl AsRef<Path>,
    labels: impl AsRef<Path>,
    bounds: &DataBounds,
) -> EngineResult<Dataset> {
    let (images, labels_path) = (images.as_ref(), labels.as_ref());
    let mut file = DataFile::open(images, bounds)?;
    let dims = read_header(&mut file)?;
    if dims.len() < 2 {
        let cause = format!(
            "IDX magic {:#010x} is not an image file (expected 0x00000803)",
            magic(dims.len())
        );
        return Err(data_err(images, cause));
    }
    let values = check_dims(&file, &dims, bounds)?;
    let mut features = Vec::with_capacity(values);
    read_body(&mut file, &dims, |bytes| {
        features.extend(bytes.iter().map(|&b| f32::from(b) / 255.0));
    })?;
    let mut file = file.open_next(labels_path)?;
    let labels = read_labels(&mut file, Some(dims[0]))?;
    Dataset::infer_classes(images, features, feature_shape(&dims), labels)
}

/// Loads a labels IDX file (magic 0x801: one u8 label per item).
pub fn load_idx_labels(path: impl AsRef<Path>) -> EngineResult<Vec<i64>> {
    let bounds = DataBounds::DEFAULT;
    let mut file = DataFile::open(path.as_ref(), &bounds)?;
    read_labels(&mut file, None)
}

/// The labels of a labels file, whose header must declare `expected`
/// items when the images file is known.
fn read_labels(file: &mut DataFile, expected: Option<usize>) -> EngineResult<Vec<i64>> {
    let dims = read_header(file)?;
    if dims.len() != 1 {
        let cause = format!(
            "IDX magic {:#010x} is not a labels file (expected 0x00000801)",
            magic(dims.len())
        );
        return Err(data_err(file.path(), cause));
    }
    if let Some(expected) = expected.filter(|&n| n != dims[0]) {
        let cause = format!(
            "labels file has {} items but images file has {expected}",
            dims[0]
        );
        return Err(data_err(file.path(), cause));
    }
    check_count(dims[0]).map_err(|cause| data_err(file.path(), cause))?;
    file.check_declared(dims[0] as u64)?;
    let mut labels = Vec::with_capacity(dims[0]);
    read_body(file, &dims, |bytes| {
        labels.extend(bytes.iter().map(|&b| i64::from(b)));
    })?;
    if let Some(&bad) = labels.iter().find(|&&y| y as usize >= MAX_CLASSES) {
        return Err(data_err(
            file.path(),
            format!("label {bad} exceeds the class limit"),
        ));
    }
    Ok(labels)
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

/// Reads and checks an IDX header of unsigned bytes: the magic and the
/// sizes, nothing after them.
fn read_header(file: &mut DataFile) -> EngineResult<Vec<usize>> {
    let mut head = [0u8; 4];
    let got = file.fill(&mut head)?;
    let path = file.path().to_path_buf();
    let err = |cause: String| data_err(&path, cause);
    if got < head.len() {
        return Err(err(format!(
            "file is {got} bytes, too short for an IDX magic"
        )));
    }
    let magic = u32::from_be_bytes(head);
    let ndims = usize::from(head[3]);
    if head[..2] != [0, 0] || head[2] != IDX_U8 || ndims == 0 || ndims > MAX_DIMS {
        return Err(err(format!(
            "IDX magic {magic:#010x} is not an unsigned-byte IDX file with 1..={MAX_DIMS} dimensions \
             (expected 0x00000801 for labels or 0x00000803 for images)"
        )));
    }
    let mut raw = vec![0u8; 4 * ndims];
    let got = file.fill(&mut raw)?;
    if got < raw.len() {
        return Err(err(format!(
            "file is {} bytes, too short for a {ndims}-dimension IDX header",
            4 + got
        )));
    }
    Ok(raw
        .chunks_exact(4)
        .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]) as usize)
        .collect())
}

/// Reads the elements the header `dims` declares, handing them to `take`
/// chunk by chunk; the file must hold exactly those.
fn read_body(file: &mut DataFile, dims: &[usize], take: impl FnMut(&[u8])) -> EngineResult<()> {
    let mut take = take;
    let claimed = dims.iter().product::<usize>() as u64;
    file.read_claimed_data(claimed, dims, |chunk| {
        take(chunk);
        Ok(())
    })
}

fn check_count(n: usize) -> Result<(), String> {
    if n == 0 || n > MAX_SAMPLES {
        return Err(format!(
            "IDX file claims {n} items; expected 1..={MAX_SAMPLES}"
        ));
    }
    Ok(())
}

/// Rejects sizes that are zero or beyond the limits before they are used;
/// the values the images hold.
fn check_dims(file: &DataFile, dims: &[usize], bounds: &DataBounds) -> EngineResult<usize> {
    let err = |cause: String| data_err(file.path(), cause);
    let (n, rest) = dims
        .split_first()
        .ok_or_else(|| err("IDX file has no dimensions".into()))?;
    check_count(*n).map_err(err)?;
    let per_item = checked_product(rest, MAX_FEATURES_PER_SAMPLE)
        .filter(|&d| d > 0)
        .ok_or_else(|| {
            err(format!(
                "IDX item shape {rest:?} is empty or exceeds {MAX_FEATURES_PER_SAMPLE} elements"
            ))
        })?;
    let values = check_total(*n, per_item, bounds.max_values).map_err(|over| file.over(over))?;
    file.check_declared(values as u64)?;
    Ok(values)
}
