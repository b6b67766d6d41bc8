//! The binary update format: what a device uploads after training, namely
//! the change of every trainable parameter and the number of samples it
//! trained on (the weight of its update in federated averaging).
//!
//! Layout of an encoded update, all integers little-endian:
//!
//! ```text
//! magic        8 bytes  b"CANOPYUP"
//! version      u16      = 1
//! reserved     u16      = 0 (must be 0)
//! num_samples  u64      (1 ..= MAX_SAMPLES)
//! tensor_count u32
//! per tensor, in layout order:
//!   name_len u16, name (UTF-8, name_len bytes)
//!   dtype u8 (1 = f32, 2 = int8 blocks)
//!   rank u8 (<= MAX_RANK)
//!   dims: rank × u64
//! then the data of every tensor, in layout order, no padding:
//!   f32:         n × f32 LE
//!   int8 blocks: per block of INT8_BLOCK_VALUES values (the last one
//!                shorter): scale f32 LE (finite, >= 0), then one i8 per
//!                value (-127..=127); each value is i8 × scale
//! ```
//!
//! An int8 tensor is a compressed update ([`encode_update_int8`]): each
//! block's values are scaled by the block's largest magnitude to ±127 and
//! rounded stochastically, up or down with the probabilities that make the
//! decoded value's expectation the value itself, so that averaging many
//! devices' updates is unbiased. About a quarter of f32's bytes.
//!
//! The header repeats the layout the server already knows so that a device
//! training against the wrong model version is caught by name and shape
//! rather than by silently averaging unrelated numbers.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

pub const UPDATE_MAGIC: [u8; 8] = *b"CANOPYUP";
pub const UPDATE_VERSION: u16 = 1;
/// Large enough for any real dataset, small enough that sample-weighted sums
/// of many updates stay far from overflowing.
pub const MAX_SAMPLES: u64 = 1 << 40;
pub const MAX_RANK: usize = 8;
pub const MAX_TENSORS: usize = 4096;
pub const MAX_NAME_BYTES: usize = 256;
/// Upper bound on the total number of values in an update (4 GiB of f32),
/// so that every length computed from a layout fits in `usize` and `u64`.
pub const MAX_ELEMENTS: usize = 1 << 30;

const DTYPE_F32: u8 = 1;
const DTYPE_INT8_BLOCKS: u8 = 2;
/// Values per int8 block, each block with its own scale: 1.6 % overhead.
pub const INT8_BLOCK_VALUES: usize = 256;
/// The largest magnitude of an int8 value; −128 is not used, so that
/// the scale is symmetric.
const INT8_MAX: f32 = 127.0;
const FIXED_HEADER_LEN: usize = 8 + 2 + 2 + 8 + 4;
const F32_BYTES: usize = 4;

/// One trainable tensor of the update: its parameter name and shape.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
}

impl TensorSpec {
    /// Product of the dimensions (1 for a scalar). Saturates at `usize::MAX`
    /// for shapes that no valid layout can contain.
    pub fn num_elements(&self) -> usize {
        checked_elements(&self.shape).unwrap_or(usize::MAX)
    }

    fn header_len(&self) -> usize {
        2 + self.name.len() + 1 + 1 + 8 * self.shape.len()
    }
}

fn checked_elements(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
}

/// The ordered list of tensors an update must contain.
///
/// Deserialization goes through [`UpdateLayout::new`], so a layout received
/// as JSON obeys the same limits as one built in code.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "UnvalidatedLayout")]
pub struct UpdateLayout {
    pub tensors: Vec<TensorSpec>,
}

#[derive(Deserialize)]
struct UnvalidatedLayout {
    tensors: Vec<TensorSpec>,
}

impl TryFrom<UnvalidatedLayout> for UpdateLayout {
    type Error = UpdateError;

    fn try_from(raw: UnvalidatedLayout) -> Result<Self, Self::Error> {
        UpdateLayout::new(raw.tensors)
    }
}

/// The tensors of a statistics round's update: per input feature, the
/// mean and the mean of squares of a device's training inputs.
pub const STATISTICS_TENSORS: [&str; 2] = ["input.mean", "input.mean_sq"];

/// The layout of a statistics round's update for a model whose samples
/// have `features` elements. The weighted mean the server folds is then
/// the mean and mean of squares over every device's data, and the weight
/// total its sample count: the exact moments, from which the input
/// statistics are fitted.
pub fn statistics_layout(features: usize) -> Result<UpdateLayout, UpdateError> {
    UpdateLayout::new(
        STATISTICS_TENSORS
            .iter()
            .map(|name| TensorSpec {
                name: (*name).to_string(),
                shape: vec![features],
            })
            .collect(),
    )
}

impl UpdateLayout {
    /// Enforces the format's limits (tensor count, name length, rank, total
    /// size) and that names are non-empty and unique.
    pub fn new(tensors: Vec<TensorSpec>) -> Result<UpdateLayout, UpdateError> {
        let layout = UpdateLayout { tensors };
        layout.validate()?;
        Ok(layout)
    }

    /// The checks of [`UpdateLayout::new`], for layouts built field by field.
    /// Encoding and decoding run it too, since the fields are public.
    pub fn validate(&self) -> Result<(), UpdateError> {
        let layout_error = |reason: String| Err(UpdateError::Layout { reason });
        if self.tensors.len() > MAX_TENSORS {
            return layout_error(format!(
                "{} tensors, the limit is {MAX_TENSORS}",
                self.tensors.len()
            ));
        }
        let mut names = HashSet::with_capacity(self.tensors.len());
        let mut total: usize = 0;
        for (index, tensor) in self.tensors.iter().enumerate() {
            if tensor.name.is_empty() || tensor.name.len() > MAX_NAME_BYTES {
                return layout_error(format!(
                    "tensor {index} name is {} bytes, must be 1..={MAX_NAME_BYTES}",
                    tensor.name.len()
                ));
            }
            if !names.insert(tensor.name.as_str()) {
                return layout_error(format!(
                    "tensor name `{}` appears more than once",
                    tensor.name
                ));
            }
            if tensor.shape.len() > MAX_RANK {
                return layout_error(format!(
                    "tensor `{}` has rank {}, the limit is {MAX_RANK}",
                    tensor.name,
                    tensor.shape.len()
                ));
            }
            let elements = checked_elements(&tensor.shape)
                .and_then(|n| total.checked_add(n))
                .filter(|&n| n <= MAX_ELEMENTS);
            match elements {
                Some(n) => total = n,
                None => {
                    return layout_error(format!(
                        "tensor `{}` with shape {:?} brings the update above {MAX_ELEMENTS} values",
                        tensor.name, tensor.shape
                    ));
                }
            }
        }
        Ok(())
    }

    /// Total number of values across all tensors.
    pub fn num_elements(&self) -> usize {
        self.tensors
            .iter()
            .fold(0usize, |acc, t| acc.saturating_add(t.num_elements()))
    }

    /// Bytes before the tensor data.
    pub fn header_len(&self) -> usize {
        FIXED_HEADER_LEN
            + self
                .tensors
                .iter()
                .map(TensorSpec::header_len)
                .sum::<usize>()
    }

    /// Exact byte length of a valid encoding; servers use it as the upload
    /// size limit.
    pub fn encoded_len(&self) -> u64 {
        let data_len = (self.num_elements() as u64).saturating_mul(F32_BYTES as u64);
        (self.header_len() as u64).saturating_add(data_len)
    }
}

/// Encodes an update. `values` are all tensors concatenated in layout order.
/// Refuses non-finite values here rather than letting the server reject the
/// upload after the transfer.
pub fn encode_update(
    layout: &UpdateLayout,
    num_samples: u64,
    values: &[f32],
) -> Result<Vec<u8>, UpdateError> {
    encode_with(layout, num_samples, values, None)
}

/// Encodes an update with every tensor of at least `min_elements` values
/// as int8 blocks, stochastically rounded with `rng` (the rest f32).
pub fn encode_update_int8(
    layout: &UpdateLayout,
    num_samples: u64,
    values: &[f32],
    min_elements: u64,
    rng: &mut dyn rand::RngCore,
) -> Result<Vec<u8>, UpdateError> {
    encode_with(layout, num_samples, values, Some((min_elements, rng)))
}

/// Whether a tensor of `elements` values goes as int8 blocks when an
/// update is compressed with `min_elements`.
pub fn is_int8(elements: usize, min_elements: u64) -> bool {
    elements as u64 >= min_elements.max(1)
}

/// Bytes of a tensor of `elements` values encoded as int8 blocks.
pub fn int8_data_len(elements: usize) -> usize {
    elements.div_ceil(INT8_BLOCK_VALUES) * F32_BYTES + elements
}

fn encode_with(
    layout: &UpdateLayout,
    num_samples: u64,
    values: &[f32],
    mut int8: Option<(u64, &mut dyn rand::RngCore)>,
) -> Result<Vec<u8>, UpdateError> {
    layout.validate()?;
    check_num_samples(num_samples)?;
    let expected_values = layout.num_elements();
    if values.len() != expected_values {
        return Err(UpdateError::ValueCount {
            expected: expected_values,
            got: values.len(),
        });
    }
    check_finite(layout, values)?;

    let capacity = usize::try_from(layout.encoded_len()).map_err(|_| UpdateError::Layout {
        reason: "the encoded update does not fit in this machine's address space".to_string(),
    })?;
    let mut out = Vec::with_capacity(capacity);
    out.extend_from_slice(&UPDATE_MAGIC);
    out.extend_from_slice(&UPDATE_VERSION.to_le_bytes());
    out.extend_from_slice(&0u16.to_le_bytes());
    out.extend_from_slice(&num_samples.to_le_bytes());
    // validate() bounds these conversions: tensors <= MAX_TENSORS, names
    // <= MAX_NAME_BYTES, rank <= MAX_RANK.
    out.extend_from_slice(&(layout.tensors.len() as u32).to_le_bytes());
    let quantised = |tensor: &TensorSpec, int8: &Option<(u64, &mut dyn rand::RngCore)>| {
        int8.as_ref()
            .is_some_and(|(min, _)| is_int8(tensor.num_elements(), *min))
    };
    for tensor in &layout.tensors {
        out.extend_from_slice(&(tensor.name.len() as u16).to_le_bytes());
        out.extend_from_slice(tensor.name.as_bytes());
        out.push(match quantised(tensor, &int8) {
            true => DTYPE_INT8_BLOCKS,
            false => DTYPE_F32,
        });
        out.push(tensor.shape.len() as u8);
        for &dim in &tensor.shape {
            out.extend_from_slice(&(dim as u64).to_le_bytes());
        }
    }
    let mut start = 0;
    for tensor in &layout.tensors {
        let end = start + tensor.num_elements();
        let quantise = quantised(tensor, &int8);
        match (&mut int8, quantise) {
            (Some((_, rng)), true) => push_int8(&mut out, &values[start..end], &mut **rng),
            _ => {
                for value in &values[start..end] {
                    out.extend_from_slice(&value.to_le_bytes());
                }
            }
        }
        start = end;
    }
    Ok(out)
}

/// Uniform in [0, 1): 24 random bits, as many as an f32's significand.
fn unit_uniform(rng: &mut dyn rand::RngCore) -> f32 {
    (rng.next_u32() >> 8) as f32 / (1u32 << 24) as f32
}

/// Appends `values` as int8 blocks: each block's scale is its largest
/// magnitude over 127, and each value `v` becomes `⌊v / scale + u⌋` for
/// `u` uniform in [0, 1), whose expectation is `v / scale`.
fn push_int8(out: &mut Vec<u8>, values: &[f32], rng: &mut dyn rand::RngCore) {
    for block in values.chunks(INT8_BLOCK_VALUES) {
        let largest = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let scale = largest / INT8_MAX;
        out.extend_from_slice(&scale.to_le_bytes());
        for &value in block {
            let level = match scale > 0.0 {
                true => (value / scale + unit_uniform(rng)).floor(),
                false => 0.0,
            };
            out.push(level.clamp(-INT8_MAX, INT8_MAX) as i8 as u8);
        }
    }
}

fn check_num_samples(num_samples: u64) -> Result<(), UpdateError> {
    if num_samples == 0 || num_samples > MAX_SAMPLES {
        return Err(UpdateError::SampleCount { num_samples });
    }
    Ok(())
}

fn check_finite(layout: &UpdateLayout, values: &[f32]) -> Result<(), UpdateError> {
    let mut start = 0;
    for tensor in &layout.tensors {
        let end = start + tensor.num_elements();
        if let Some(index) = values[start..end].iter().position(|v| !v.is_finite()) {
            return Err(UpdateError::NonFinite {
                name: tensor.name.clone(),
                index,
                value: values[start + index],
            });
        }
        start = end;
    }
    Ok(())
}

/// The L2 norm of an update: every trainable tensor's values together, in
/// f64 so that a million squares lose nothing.
pub fn l2_norm(values: &[f32]) -> f64 {
    values
        .iter()
        .map(|&value| f64::from(value) * f64::from(value))
        .sum::<f64>()
        .sqrt()
}

/// What an update is multiplied by to bring it within `clip_norm`: 1 when
/// it is no longer than that, `clip_norm / norm` when it is. The one rule
/// of a differentially private job's clipping: devices apply it to their
/// update ([`clip_to_norm`]), and the server to each update it folds, so
/// that one device moves the sum by at most `clip_norm` whatever it sent.
pub fn clip_scale(norm: f64, clip_norm: f64) -> f64 {
    if norm > clip_norm {
        clip_norm / norm
    } else {
        1.0
    }
}

/// Scales `values` down to L2 norm `clip_norm` when they are longer, and
/// returns their norm before.
pub fn clip_to_norm(values: &mut [f32], clip_norm: f64) -> f64 {
    let norm = l2_norm(values);
    let scale = clip_scale(norm, clip_norm);
    if scale < 1.0 {
        for value in values.iter_mut() {
            *value = (f64::from(*value) * scale) as f32;
        }
    }
    norm
}

/// A decoded update, checked against the layout it was decoded with.
#[derive(Clone, Debug, PartialEq)]
pub struct DecodedUpdate {
    pub num_samples: u64,
    /// All tensors concatenated in layout order.
    pub values: Vec<f32>,
}

/// Reads fixed-size fields from untrusted bytes, turning every short read
/// into [`UpdateError::Truncated`] instead of a panic.
struct Reader<'a> {
    bytes: &'a [u8],
    offset: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, needed: usize) -> Result<&'a [u8], UpdateError> {
        let truncated = UpdateError::Truncated {
            offset: self.offset,
            needed,
            len: self.bytes.len(),
        };
        let end = self.offset.checked_add(needed).ok_or(truncated.clone())?;
        let slice = self.bytes.get(self.offset..end).ok_or(truncated)?;
        self.offset = end;
        Ok(slice)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], UpdateError> {
        let mut array = [0u8; N];
        array.copy_from_slice(self.take(N)?);
        Ok(array)
    }

    fn u8(&mut self) -> Result<u8, UpdateError> {
        Ok(self.array::<1>()?[0])
    }

    fn u16(&mut self) -> Result<u16, UpdateError> {
        self.array().map(u16::from_le_bytes)
    }

    fn u32(&mut self) -> Result<u32, UpdateError> {
        self.array().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64, UpdateError> {
        self.array().map(u64::from_le_bytes)
    }
}

/// Decodes and checks against the expected layout: magic, version, reserved,
/// sample count bounds, tensor count, each name, dtype, shape, exact total
/// length (no trailing bytes), and that every value is finite.
///
/// Never panics, and allocates for the values only after the header has
/// matched `expected` and the length is exact, so hostile counts in the
/// header cannot make it allocate.
pub fn decode_update(bytes: &[u8], expected: &UpdateLayout) -> Result<DecodedUpdate, UpdateError> {
    expected.validate()?;
    let mut reader = Reader { bytes, offset: 0 };

    if reader.array::<8>()? != UPDATE_MAGIC {
        return Err(UpdateError::BadMagic);
    }
    let version = reader.u16()?;
    if version != UPDATE_VERSION {
        return Err(UpdateError::UnsupportedVersion { version });
    }
    let reserved = reader.u16()?;
    if reserved != 0 {
        return Err(UpdateError::Reserved { value: reserved });
    }
    let num_samples = reader.u64()?;
    check_num_samples(num_samples)?;
    let tensor_count = reader.u32()?;
    if usize::try_from(tensor_count).ok() != Some(expected.tensors.len()) {
        return Err(UpdateError::TensorCount {
            expected: expected.tensors.len(),
            got: usize::try_from(tensor_count).unwrap_or(usize::MAX),
        });
    }

    let mut dtypes = Vec::with_capacity(expected.tensors.len());
    for (index, tensor) in expected.tensors.iter().enumerate() {
        let name_len = usize::from(reader.u16()?);
        let name = reader.take(name_len)?;
        if name != tensor.name.as_bytes() {
            return Err(UpdateError::Name {
                index,
                expected: tensor.name.clone(),
                got: printable_name(name),
            });
        }
        let dtype = reader.u8()?;
        if dtype != DTYPE_F32 && dtype != DTYPE_INT8_BLOCKS {
            return Err(UpdateError::DType {
                name: tensor.name.clone(),
                code: dtype,
            });
        }
        dtypes.push(dtype);
        // The rank is a u8, so even a hostile header cannot make this read
        // more than 255 dims.
        let rank = usize::from(reader.u8()?);
        let mut shape = Vec::with_capacity(rank);
        for _ in 0..rank {
            let dim = reader.u64()?;
            shape.push(usize::try_from(dim).unwrap_or(usize::MAX));
        }
        if shape != tensor.shape {
            return Err(UpdateError::Shape {
                name: tensor.name.clone(),
                expected: tensor.shape.clone(),
                got: shape,
            });
        }
    }

    // validate() capped the element count at MAX_ELEMENTS, so this cannot
    // overflow.
    let value_count = expected.num_elements();
    let data_len: usize = expected
        .tensors
        .iter()
        .zip(&dtypes)
        .map(|(tensor, &dtype)| match dtype {
            DTYPE_INT8_BLOCKS => int8_data_len(tensor.num_elements()),
            _ => tensor.num_elements() * F32_BYTES,
        })
        .sum();
    let remaining = bytes.len() - reader.offset;
    if remaining < data_len {
        return Err(UpdateError::Truncated {
            offset: reader.offset,
            needed: data_len,
            len: bytes.len(),
        });
    }
    if remaining > data_len {
        return Err(UpdateError::TrailingBytes {
            extra: remaining - data_len,
        });
    }

    let mut values = Vec::with_capacity(value_count);
    for (tensor, &dtype) in expected.tensors.iter().zip(&dtypes) {
        match dtype {
            DTYPE_INT8_BLOCKS => read_int8(&mut reader, tensor, &mut values)?,
            _ => read_f32(&mut reader, tensor, &mut values)?,
        }
    }
    Ok(DecodedUpdate {
        num_samples,
        values,
    })
}

fn read_f32(
    reader: &mut Reader<'_>,
    tensor: &TensorSpec,
    values: &mut Vec<f32>,
) -> Result<(), UpdateError> {
    for index in 0..tensor.num_elements() {
        let value = f32::from_le_bytes(reader.array()?);
        if !value.is_finite() {
            return Err(UpdateError::NonFinite {
                name: tensor.name.clone(),
                index,
                value,
            });
        }
        values.push(value);
    }
    Ok(())
}

/// Decodes a tensor's int8 blocks into f32: each value its level times
/// its block's scale.
fn read_int8(
    reader: &mut Reader<'_>,
    tensor: &TensorSpec,
    values: &mut Vec<f32>,
) -> Result<(), UpdateError> {
    let elements = tensor.num_elements();
    for block in 0..elements.div_ceil(INT8_BLOCK_VALUES) {
        let scale = f32::from_le_bytes(reader.array()?);
        if !(scale.is_finite() && scale >= 0.0) {
            return Err(UpdateError::Int8Scale {
                name: tensor.name.clone(),
                block,
                value: scale,
            });
        }
        let first = block * INT8_BLOCK_VALUES;
        let count = (elements - first).min(INT8_BLOCK_VALUES);
        for (offset, &byte) in reader.take(count)?.iter().enumerate() {
            let level = byte as i8;
            if level == i8::MIN {
                return Err(UpdateError::Int8Level {
                    name: tensor.name.clone(),
                    index: first + offset,
                });
            }
            let value = f32::from(level) * scale;
            if !value.is_finite() {
                return Err(UpdateError::NonFinite {
                    name: tensor.name.clone(),
                    index: first + offset,
                    value,
                });
            }
            values.push(value);
        }
    }
    Ok(())
}

/// An untrusted name for an error message: lossy UTF-8, cut to a length
/// that keeps log lines readable.
fn printable_name(bytes: &[u8]) -> String {
    let cut = &bytes[..bytes.len().min(MAX_NAME_BYTES)];
    let mut name: String = String::from_utf8_lossy(cut)
        .chars()
        .map(|c| if c.is_control() { '\u{FFFD}' } else { c })
        .collect();
    if cut.len() < bytes.len() {
        name.push('…');
    }
    name
}

fn describe_non_finite(value: &f32) -> &'static str {
    if value.is_nan() {
        "NaN"
    } else if value.is_sign_positive() {
        "+inf"
    } else {
        "-inf"
    }
}

#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum UpdateError {
    #[error("update does not start with the magic bytes `CANOPYUP`; it is not a Canopy update")]
    BadMagic,
    #[error(
        "update format version {version} is not supported; this build reads version {UPDATE_VERSION}"
    )]
    UnsupportedVersion { version: u16 },
    #[error("update header reserved field is {value}, must be 0")]
    Reserved { value: u16 },
    #[error(
        "update is truncated: {needed} bytes needed at offset {offset}, but the update is {len} bytes long"
    )]
    Truncated {
        offset: usize,
        needed: usize,
        len: usize,
    },
    #[error("update has {extra} unexpected bytes after the last tensor")]
    TrailingBytes { extra: usize },
    #[error("update sample count {num_samples} is outside 1..={MAX_SAMPLES}")]
    SampleCount { num_samples: u64 },
    #[error("update has {got} tensors, expected {expected}")]
    TensorCount { expected: usize, got: usize },
    #[error("update tensor {index} is named `{got}`, expected `{expected}`")]
    Name {
        index: usize,
        expected: String,
        got: String,
    },
    #[error(
        "tensor `{name}` has dtype code {code}; only 1 (f32) and 2 (int8 blocks) are supported"
    )]
    DType { name: String, code: u8 },
    #[error(
        "tensor `{name}` int8 block {block} has scale {value}; a scale must be finite and at \
         least 0"
    )]
    Int8Scale {
        name: String,
        block: usize,
        value: f32,
    },
    #[error("tensor `{name}` element {index} is the int8 level -128; levels are -127..=127")]
    Int8Level { name: String, index: usize },
    #[error("tensor `{name}` has shape {got:?}, expected {expected:?}")]
    Shape {
        name: String,
        expected: Vec<usize>,
        got: Vec<usize>,
    },
    #[error("tensor `{name}` element {index} is {}; updates must be finite", describe_non_finite(.value))]
    NonFinite {
        name: String,
        index: usize,
        value: f32,
    },
    #[error("update has {got} values, the layout needs {expected}")]
    ValueCount { expected: usize, got: usize },
    #[error("invalid update layout: {reason}")]
    Layout { reason: String },
}

impl UpdateError {
    /// True for errors about the content's meaning (sample count, tensor
    /// count, names, dtype, shape, non-finite values, value count) as opposed
    /// to framing (magic, version, reserved, length) or an invalid layout.
    /// Servers answer 422 for both kinds; the split is for logs and metrics,
    /// since content errors usually mean a device trained the wrong model.
    pub fn is_content_error(&self) -> bool {
        match self {
            UpdateError::SampleCount { .. }
            | UpdateError::TensorCount { .. }
            | UpdateError::Name { .. }
            | UpdateError::DType { .. }
            | UpdateError::Shape { .. }
            | UpdateError::NonFinite { .. }
            | UpdateError::Int8Scale { .. }
            | UpdateError::Int8Level { .. }
            | UpdateError::ValueCount { .. } => true,
            UpdateError::BadMagic
            | UpdateError::UnsupportedVersion { .. }
            | UpdateError::Reserved { .. }
            | UpdateError::Truncated { .. }
            | UpdateError::TrailingBytes { .. }
            | UpdateError::Layout { .. } => false,
        }
    }
}
