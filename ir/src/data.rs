//! Concrete tensor contents carried by the IR: constants and parameters.

use crate::types::{DType, Shape, TensorType};

/// Typed element storage, row-major.
#[derive(Clone, Debug, PartialEq)]
pub enum Buffer {
    F32(Vec<f32>),
    I64(Vec<i64>),
    I32(Vec<i32>),
    Bool(Vec<bool>),
}

impl Buffer {
    pub fn dtype(&self) -> DType {
        match self {
            Buffer::F32(_) => DType::F32,
            Buffer::I64(_) => DType::I64,
            Buffer::I32(_) => DType::I32,
            Buffer::Bool(_) => DType::Bool,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Buffer::F32(v) => v.len(),
            Buffer::I64(v) => v.len(),
            Buffer::I32(v) => v.len(),
            Buffer::Bool(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn zeros(dtype: DType, len: usize) -> Buffer {
        match dtype {
            DType::F32 => Buffer::F32(vec![0.0; len]),
            DType::I64 => Buffer::I64(vec![0; len]),
            DType::I32 => Buffer::I32(vec![0; len]),
            DType::Bool => Buffer::Bool(vec![false; len]),
        }
    }

    /// Little-endian bytes, the layout of the file format's data section.
    pub fn to_le_bytes(&self) -> Vec<u8> {
        match self {
            Buffer::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Buffer::I64(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Buffer::I32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Buffer::Bool(v) => v.iter().map(|&b| u8::from(b)).collect(),
        }
    }

    /// Decodes little-endian bytes; `None` when the length does not fit the
    /// dtype or a bool byte is neither 0 nor 1.
    pub fn from_le_bytes(dtype: DType, bytes: &[u8]) -> Option<Buffer> {
        if !bytes.len().is_multiple_of(dtype.size_bytes()) {
            return None;
        }
        Some(match dtype {
            DType::F32 => Buffer::F32(
                bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ),
            DType::I32 => Buffer::I32(
                bytes
                    .chunks_exact(4)
                    .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ),
            DType::I64 => Buffer::I64(
                bytes
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().expect("chunk of 8")))
                    .collect(),
            ),
            DType::Bool => Buffer::Bool(
                bytes
                    .iter()
                    .map(|&b| match b {
                        0 => Some(false),
                        1 => Some(true),
                        _ => None,
                    })
                    .collect::<Option<Vec<bool>>>()?,
            ),
        })
    }

    /// Bitwise equality, so that constants holding NaN still compare equal to
    /// themselves (used by CSE).
    pub fn bit_eq(&self, other: &Buffer) -> bool {
        match (self, other) {
            (Buffer::F32(a), Buffer::F32(b)) => {
                a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
            }
            _ => self == other,
        }
    }
}

/// A concrete tensor: a fixed shape and its elements.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorData {
    pub shape: Vec<usize>,
    pub buffer: Buffer,
}

impl TensorData {
    /// Builds a tensor; `None` when the element count does not match the shape.
    pub fn new(shape: Vec<usize>, buffer: Buffer) -> Option<TensorData> {
        let count = shape
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))?;
        (count == buffer.len()).then_some(TensorData { shape, buffer })
    }

    pub fn scalar_f32(value: f32) -> TensorData {
        TensorData {
            shape: Vec::new(),
            buffer: Buffer::F32(vec![value]),
        }
    }

    pub fn scalar_i64(value: i64) -> TensorData {
        TensorData {
            shape: Vec::new(),
            buffer: Buffer::I64(vec![value]),
        }
    }

    pub fn f32(shape: Vec<usize>, values: Vec<f32>) -> Option<TensorData> {
        TensorData::new(shape, Buffer::F32(values))
    }

    pub fn zeros(dtype: DType, shape: Vec<usize>) -> TensorData {
        let len = shape.iter().product();
        TensorData {
            shape,
            buffer: Buffer::zeros(dtype, len),
        }
    }

    pub fn dtype(&self) -> DType {
        self.buffer.dtype()
    }

    pub fn num_elements(&self) -> usize {
        self.buffer.len()
    }

    pub fn tensor_type(&self) -> TensorType {
        TensorType::new(self.dtype(), Shape::fixed(&self.shape))
    }

    pub fn as_f32(&self) -> Option<&[f32]> {
        match &self.buffer {
            Buffer::F32(v) => Some(v),
            _ => None,
        }
    }

    /// The single value of a one-element f32 tensor.
    pub fn scalar_value_f32(&self) -> Option<f32> {
        match &self.buffer {
            Buffer::F32(v) if v.len() == 1 => Some(v[0]),
            _ => None,
        }
    }

    pub fn bit_eq(&self, other: &TensorData) -> bool {
        self.shape == other.shape && self.buffer.bit_eq(&other.buffer)
    }
}
