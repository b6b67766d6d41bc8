//! NumPy `.npy` files (format versions 1-3): the magic `\x93NUMPY`, a
//! version, a little-endian header length, a Python-dict header giving
//! `descr`, `fortran_order` and `shape`, then the raw C-order elements.

use std::path::Path;

use ndarray::{ArrayD, IxDyn};

use super::data_err;
use super::dataset::{Dataset, check_total, finite_feature};
use super::limits::{DataBounds, MAX_CLASSES, MAX_DIMS, MAX_NPY_HEADER, MAX_SAMPLES};
use super::read::DataFile;
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

/// A validated header: the element type and the shape.
struct Header {
    dtype: Dtype,
    shape: Vec<usize>,
}

impl Header {
    fn elements(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Loads an `.npy` array of f4/f8/u1/i4/i8 as f32, values unchanged (u8
/// stays 0..255 here; only [`load_npy_dataset`] rescales pixels).
pub fn load_npy(path: impl AsRef<Path>) -> EngineResult<ArrayD<f32>> {
    let path = path.as_ref();
    let bounds = DataBounds::DEFAULT;
    let mut file = DataFile::open(path, &bounds)?;
    let header = read_header(&mut file, &bounds)?;
    let mut values = Vec::with_capacity(header.elements());
    read_body(&mut file, &header, |_, x| {
        values.push(x);
        Ok(())
    })?;
    ArrayD::from_shape_vec(IxDyn(&header.shape), values).map_err(|e| data_err(path, e.to_string()))
}

/// Builds a dataset from an images array `(N, ...)` and a labels array
/// `(N,)` of integers. u8 images are scaled to `[0, 1]` as with IDX files;
/// float images are kept as they are, and NaN or ±inf refused.
pub fn load_npy_dataset(
    images: impl AsRef<Path>,
    labels: impl AsRef<Path>,
) -> EngineResult<Dataset> {
    load_npy_dataset_within(images, labels, &DataBounds::DEFAULT)
}

/// [`load_npy_dataset`] under `bounds` ([`DataBounds`] says what they
/// cap; the two files share the byte bound).
pub fn load_npy_dataset_within(
    images: impl AsRef<Path>,
    labels: impl AsRef<Path>,
    bounds: &DataBounds,
) -> EngineResult<Dataset> {
    let (images, labels_path) = (images.as_ref(), labels.as_ref());
    let mut file = DataFile::open(images, bounds)?;
    let header = read_header(&mut file, bounds)?;
    if header.shape.len() < 2 {
        let cause = format!(
            "images array has shape {:?}; expected (samples, features...)",
            header.shape
        );
        return Err(data_err(images, cause));
    }
    let per_sample = header.elements() / header.shape[0].max(1);
    let scale = if header.dtype == Dtype::U8 {
        255.0
    } else {
        1.0
    };
    let mut features = Vec::with_capacity(header.elements());
    read_body(&mut file, &header, |i, x| {
        let x = finite_feature(x).map_err(|cause| {
            let (sample, value) = (i / per_sample, i % per_sample);
            format!("value {value} of sample {sample} is {x}: {cause}")
        })?;
        features.push(x / scale);
        Ok(())
    })?;
    let mut file = file.open_next(labels_path)?;
    let labels = read_npy_labels(&mut file, header.shape[0], bounds)?;
    Dataset::infer_classes(images, features, header.shape[1..].to_vec(), labels)
}

fn read_npy_labels(
    file: &mut DataFile,
    samples: usize,
    bounds: &DataBounds,
) -> EngineResult<Vec<i64>> {
    let header = read_header(file, bounds)?;
    if header.shape.len() != 1 {
        return Err(data_err(
            file.path(),
            format!(
                "labels array has shape {:?}; expected (samples,)",
                header.shape
            ),
        ));
    }
    if header.shape[0] != samples {
        let cause = format!(
            "labels file has {} items but images file has {samples}",
            header.shape[0]
        );
        return Err(data_err(file.path(), cause));
    }
    let ok = |y: f64| y.fract() == 0.0 && (0.0..MAX_CLASSES as f64).contains(&y);
    let mut labels = Vec::with_capacity(samples);
    let dtype = header.dtype;
    read_elements(file, &header, |i, bytes| {
        let y = to_f64(dtype, bytes);
        if !ok(y) {
            return Err(format!(
                "label {y} of item {i} is not a class index in 0..{MAX_CLASSES}"
            ));
        }
        labels.push(y as i64);
        Ok(())
    })?;
    Ok(labels)
}

/// Reads and checks the magic, the version and the header: well formed,
/// within the limits, and declaring no more bytes than the file may hold.
fn read_header(file: &mut DataFile, bounds: &DataBounds) -> EngineResult<Header> {
    let text = read_header_text(file)?;
    let err = |cause: String| data_err(file.path(), cause);
    let (dtype, shape) = parse_header(&text).map_err(err)?;
    let n = check_npy_shape(&shape).map_err(err)?;
    check_total(n, 1, bounds.max_values).map_err(|over| file.over(over))?;
    let bytes = (n as u64).saturating_mul(dtype.size() as u64);
    file.check_declared(bytes)?;
    Ok(Header { dtype, shape })
}

/// The header dictionary's text, after the magic, version and length.
fn read_header_text(file: &mut DataFile) -> EngineResult<String> {
    let mut fixed = [0u8; 12];
    let got = file.fill(&mut fixed[..8])?;
    let path = file.path().to_path_buf();
    let err = |cause: String| data_err(&path, cause);
    let short = |len: usize| format!("file is {len} bytes, too short for an .npy header");
    if got < 6 || &fixed[..6] != NPY_MAGIC {
        return Err(err("not an .npy file (missing \\x93NUMPY magic)".into()));
    }
    if got < 8 {
        return Err(err(short(got)));
    }
    let len_bytes = match fixed[6] {
        1 => 2,
        2 | 3 => 4,
        v => return Err(err(format!(".npy format version {v} is not supported"))),
    };
    let got = 8 + file.fill(&mut fixed[8..8 + len_bytes])?;
    if got < 8 + len_bytes {
        return Err(err(short(got)));
    }
    let len = match len_bytes {
        2 => u16::from_le_bytes([fixed[8], fixed[9]]) as usize,
        _ => u32::from_le_bytes([fixed[8], fixed[9], fixed[10], fixed[11]]) as usize,
    };
    if len > MAX_NPY_HEADER {
        return Err(err(format!(
            "header of {len} bytes exceeds the limit of {MAX_NPY_HEADER}"
        )));
    }
    let mut raw = vec![0u8; len];
    let read = file.fill(&mut raw)?;
    if read < len {
        return Err(err(short(got + read)));
    }
    String::from_utf8(raw).map_err(|_| err("header is not text".to_string()))
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
    shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| format!("shape {shape:?} overflows"))
}

/// Reads the elements `header` declares as f32, handing each, with its
/// flat index, to `take`; a cause from `take` is refused naming the file.
fn read_body(
    file: &mut DataFile,
    header: &Header,
    mut take: impl FnMut(usize, f32) -> Result<(), String>,
) -> EngineResult<()> {
    let dtype = header.dtype;
    read_elements(file, header, |i, bytes| take(i, to_f32(dtype, bytes)))
}

/// Reads the elements `header` declares, handing each one's bytes, with
/// its flat index, to `take`; the file must hold exactly those.
fn read_elements(
    file: &mut DataFile,
    header: &Header,
    mut take: impl FnMut(usize, &[u8]) -> Result<(), String>,
) -> EngineResult<()> {
    let size = header.dtype.size();
    let claimed = (header.elements() as u64).saturating_mul(size as u64);
    let path = file.path().to_path_buf();
    let mut index = 0usize;
    file.read_claimed_data(claimed, &header.shape, |chunk| {
        for element in chunk.chunks_exact(size) {
            take(index, element).map_err(|cause| data_err(&path, cause))?;
            index += 1;
        }
        Ok(())
    })
}

/// One little-endian element (of `dtype.size()` bytes) as f32.
fn to_f32(dtype: Dtype, c: &[u8]) -> f32 {
    match dtype {
        Dtype::U8 => f32::from(c[0]),
        Dtype::F32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]),
        Dtype::F64 => to_f64(dtype, c) as f32,
        Dtype::I32 | Dtype::I64 => to_i64(dtype, c) as f32,
    }
}

fn to_f64(dtype: Dtype, c: &[u8]) -> f64 {
    match dtype {
        Dtype::F64 => f64::from_le_bytes(arr8(c)),
        Dtype::F32 => f64::from(f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        _ => to_i64(dtype, c) as f64,
    }
}

/// Integer elements as i64 (labels are not routed through f32, which would
/// round large values); floats truncated.
fn to_i64(dtype: Dtype, c: &[u8]) -> i64 {
    match dtype {
        Dtype::U8 => i64::from(c[0]),
        Dtype::I32 => i64::from(i32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        Dtype::I64 => i64::from_le_bytes(arr8(c)),
        Dtype::F32 | Dtype::F64 => to_f64(dtype, c) as i64,
    }
}

fn arr8(c: &[u8]) -> [u8; 8] {
    [c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]
}
