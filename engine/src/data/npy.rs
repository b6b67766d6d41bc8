//! NumPy `.npy` files (format versions 1-3): the magic `\x93NUMPY`, a
//! version, a little-endian header length, a Python-dict header giving
//! `descr`, `fortran_order` and `shape`, then the raw C-order elements.

use std::path::Path;

use ndarray::{ArrayD, IxDyn};

use super::data_err;
use super::dataset::{Dataset, check_total};
use super::limits::{MAX_CLASSES, MAX_DIMS, MAX_NPY_HEADER, MAX_SAMPLES};
use super::read::read_file;
use crate::error::EngineResult;

const NPY_MAGIC: &[u8] = b"\x93NUMPY";

/// Element types read; all little-endian (or single bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dtype {
    F32,
    F64,
    U8,
    I32,
    I64,
}

impl Dtype {
    fn from_descr(descr: &str) -> Result<Dtype, String> {
        match descr {
            "<f4" => Ok(Dtype::F32),
            "<f8" => Ok(Dtype::F64),
            "|u1" | "<u1" => Ok(Dtype::U8),
            "<i4" => Ok(Dtype::I32),
            "<i8" => Ok(Dtype::I64),
            d if d.starts_with('>') => Err(format!("big-endian dtype {d:?} is not supported")),
            d => Err(format!(
                "dtype {d:?} is not supported (use f4, f8, u1, i4 or i8)"
            )),
        }
    }

    fn size(self) -> usize {
        match self {
            Dtype::U8 => 1,
            Dtype::F32 | Dtype::I32 => 4,
            Dtype::F64 | Dtype::I64 => 8,
        }
    }
}

/// A validated array: its element type, shape and raw element bytes.
struct Npy {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

/// Loads an `.npy` array of f4/f8/u1/i4/i8 as f32, values unchanged (u8
/// stays 0..255 here; only [`load_npy_dataset`] rescales pixels).
pub fn load_npy(path: impl AsRef<Path>) -> EngineResult<ArrayD<f32>> {
    let path = path.as_ref();
    let npy = read_npy(path)?;
    let values = to_f32(&npy);
    ArrayD::from_shape_vec(IxDyn(&npy.shape), values).map_err(|e| data_err(path, e.to_string()))
}

/// Builds a dataset from an images array `(N, ...)` and a labels array
/// `(N,)` of integers. u8 images are scaled to `[0, 1]` as with IDX files;
/// float images are kept as they are.
pub fn load_npy_dataset(
    images: impl AsRef<Path>,
    labels: impl AsRef<Path>,
) -> EngineResult<Dataset> {
    let (images, labels_path) = (images.as_ref(), labels.as_ref());
    let img = read_npy(images)?;
    if img.shape.len() < 2 {
        let cause = format!(
            "images array has shape {:?}; expected (samples, features...)",
            img.shape
        );
        return Err(data_err(images, cause));
    }
    let labels = read_npy_labels(labels_path)?;
    if labels.len() != img.shape[0] {
        let cause = format!(
            "labels file has {} items but images file has {}",
            labels.len(),
            img.shape[0]
        );
        return Err(data_err(labels_path, cause));
    }
    let mut features = to_f32(&img);
    if img.dtype == Dtype::U8 {
        features.iter_mut().for_each(|x| *x /= 255.0);
    }
    Dataset::infer_classes(images, features, img.shape[1..].to_vec(), labels)
}

fn read_npy_labels(path: &Path) -> EngineResult<Vec<i64>> {
    let npy = read_npy(path)?;
    if npy.shape.len() != 1 {
        return Err(data_err(
            path,
            format!(
                "labels array has shape {:?}; expected (samples,)",
                npy.shape
            ),
        ));
    }
    let labels: Vec<f64> = match npy.dtype {
        Dtype::F32 | Dtype::F64 => to_f32(&npy).into_iter().map(f64::from).collect(),
        _ => to_i64(&npy).into_iter().map(|y| y as f64).collect(),
    };
    let ok = |y: f64| y.fract() == 0.0 && (0.0..MAX_CLASSES as f64).contains(&y);
    if let Some((i, y)) = labels.iter().enumerate().find(|&(_, &y)| !ok(y)) {
        return Err(data_err(
            path,
            format!("label {y} of item {i} is not a class index in 0..{MAX_CLASSES}"),
        ));
    }
    Ok(labels.into_iter().map(|y| y as i64).collect())
}

/// Reads and validates a file: header well formed and within limits, and
/// the data exactly `prod(shape) * itemsize` bytes.
fn read_npy(path: &Path) -> EngineResult<Npy> {
    let bytes = read_file(path)?;
    let err = |cause: String| data_err(path, cause);
    let (header, start) = split_header(&bytes).map_err(err)?;
    let (dtype, shape) = parse_header(header).map_err(err)?;
    let n = check_npy_shape(&shape).map_err(err)?;
    let actual = bytes.len() - start;
    let claimed = n
        .checked_mul(dtype.size())
        .ok_or_else(|| err("array size overflows".into()))?;
    if actual != claimed {
        let what = if actual < claimed {
            "truncated"
        } else {
            "has trailing bytes"
        };
        return Err(err(format!(
            "file {what}: header claims shape {shape:?} = {claimed} bytes of data, found {actual}"
        )));
    }
    let mut data = bytes;
    data.drain(..start);
    Ok(Npy { dtype, shape, data })
}

/// Returns the header text and the offset where the data starts.
fn split_header(bytes: &[u8]) -> Result<(&str, usize), String> {
    if bytes.get(..6) != Some(NPY_MAGIC) {
        return Err("not an .npy file (missing \\x93NUMPY magic)".into());
    }
    let short = || {
        format!(
            "file is {} bytes, too short for an .npy header",
            bytes.len()
        )
    };
    let major = *bytes.get(6).ok_or_else(short)?;
    let (len, start) = match major {
        1 => (
            bytes
                .get(8..10)
                .map(|b| u16::from_le_bytes([b[0], b[1]]) as usize),
            10,
        ),
        2 | 3 => (
            bytes
                .get(8..12)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize),
            12,
        ),
        v => return Err(format!(".npy format version {v} is not supported")),
    };
    let len = len.ok_or_else(short)?;
    if len > MAX_NPY_HEADER {
        return Err(format!(
            "header of {len} bytes exceeds the limit of {MAX_NPY_HEADER}"
        ));
    }
    let raw = bytes.get(start..start + len).ok_or_else(short)?;
    let text = std::str::from_utf8(raw).map_err(|_| "header is not text".to_string())?;
    Ok((text, start + len))
}

/// Reads `descr`, `fortran_order` and `shape` from the header dict.
fn parse_header(header: &str) -> Result<(Dtype, Vec<usize>), String> {
    let descr = dict_value(header, "descr")?;
    let descr = descr
        .strip_prefix('\'')
        .and_then(|s| s.split('\'').next())
        .ok_or_else(|| format!("header 'descr' is not a simple dtype string: {header:?}"))?;
    let dtype = Dtype::from_descr(descr)?;
    let fortran = dict_value(header, "fortran_order")?;
    if fortran.starts_with("True") {
        return Err(
            "array is stored in Fortran (column-major) order; save it with \
                    numpy.ascontiguousarray or fortran_order=False"
                .into(),
        );
    }
    if !fortran.starts_with("False") {
        return Err(format!(
            "header 'fortran_order' is neither True nor False: {header:?}"
        ));
    }
    Ok((dtype, parse_shape(dict_value(header, "shape")?)?))
}

/// The text following `'key':` in the header, leading spaces trimmed.
fn dict_value<'a>(header: &'a str, key: &str) -> Result<&'a str, String> {
    let pat = format!("'{key}':");
    let at = header
        .find(&pat)
        .ok_or_else(|| format!("header has no '{key}' entry: {header:?}"))?;
    Ok(header[at + pat.len()..].trim_start())
}

/// Parses a tuple such as `(10000, 28, 28)`, `(5,)` or `()`.
fn parse_shape(text: &str) -> Result<Vec<usize>, String> {
    let inner = text
        .strip_prefix('(')
        .and_then(|s| s.split(')').next())
        .ok_or_else(|| format!("header 'shape' is not a tuple: {text:?}"))?;
    let dims: Vec<&str> = inner
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    if dims.len() > MAX_DIMS {
        return Err(format!(
            "array has {} dimensions; the limit is {MAX_DIMS}",
            dims.len()
        ));
    }
    dims.iter()
        .map(|d| {
            d.parse::<usize>()
                .map_err(|_| format!("shape entry {d:?} is not a size"))
        })
        .collect()
}

/// Element count of the claimed shape, after overflow and limit checks.
fn check_npy_shape(shape: &[usize]) -> Result<usize, String> {
    let n = shape.first().copied().unwrap_or(1);
    if n > MAX_SAMPLES {
        return Err(format!(
            "array claims {n} items; the limit is {MAX_SAMPLES}"
        ));
    }
    let per_item = shape
        .get(1..)
        .unwrap_or(&[])
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d));
    let per_item = per_item.ok_or_else(|| format!("shape {shape:?} overflows"))?;
    check_total(n, per_item)
}

fn to_f32(npy: &Npy) -> Vec<f32> {
    let d = &npy.data;
    match npy.dtype {
        Dtype::U8 => d.iter().map(|&b| f32::from(b)).collect(),
        Dtype::F32 => d
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::F64 => d
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(arr8(c)) as f32)
            .collect(),
        Dtype::I32 => d
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f32)
            .collect(),
        Dtype::I64 => d
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(arr8(c)) as f32)
            .collect(),
    }
}

/// Integer arrays as i64 (labels are not routed through f32, which would
/// round large values).
fn to_i64(npy: &Npy) -> Vec<i64> {
    let d = &npy.data;
    match npy.dtype {
        Dtype::U8 => d.iter().map(|&b| i64::from(b)).collect(),
        Dtype::I32 => d
            .chunks_exact(4)
            .map(|c| i64::from(i32::from_le_bytes([c[0], c[1], c[2], c[3]])))
            .collect(),
        Dtype::I64 => d
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(arr8(c)))
            .collect(),
        Dtype::F32 | Dtype::F64 => Vec::new(),
    }
}

fn arr8(c: &[u8]) -> [u8; 8] {
    [c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]
}
