//! Runtime tensor values: typed n-dimensional arrays on the host.

use canopy_ir::{Buffer, DType, TensorData, TensorType};
use ndarray::{ArrayD, IxDyn};

use crate::error::EngineError;

/// A concrete tensor held by the CPU runtime and passed across the
/// `Executable` boundary.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    F32(ArrayD<f32>),
    I64(ArrayD<i64>),
    I32(ArrayD<i32>),
    Bool(ArrayD<bool>),
}

impl Value {
    pub fn dtype(&self) -> DType {
        match self {
            Value::F32(_) => DType::F32,
            Value::I64(_) => DType::I64,
            Value::I32(_) => DType::I32,
            Value::Bool(_) => DType::Bool,
        }
    }

    pub fn shape(&self) -> &[usize] {
        match self {
            Value::F32(a) => a.shape(),
            Value::I64(a) => a.shape(),
            Value::I32(a) => a.shape(),
            Value::Bool(a) => a.shape(),
        }
    }

    pub fn len(&self) -> usize {
        self.shape().iter().product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn f32(shape: &[usize], data: Vec<f32>) -> Result<Value, EngineError> {
        ArrayD::from_shape_vec(IxDyn(shape), data)
            .map(Value::F32)
            .map_err(|e| EngineError::Shape(format!("f32 tensor of shape {shape:?}: {e}")))
    }

    pub fn i64(shape: &[usize], data: Vec<i64>) -> Result<Value, EngineError> {
        ArrayD::from_shape_vec(IxDyn(shape), data)
            .map(Value::I64)
            .map_err(|e| EngineError::Shape(format!("i64 tensor of shape {shape:?}: {e}")))
    }

    pub fn scalar_f32(x: f32) -> Value {
        Value::F32(ArrayD::from_elem(IxDyn(&[]), x))
    }

    pub fn scalar_i64(x: i64) -> Value {
        Value::I64(ArrayD::from_elem(IxDyn(&[]), x))
    }

    pub fn zeros(dtype: DType, shape: &[usize]) -> Value {
        let shape = IxDyn(shape);
        match dtype {
            DType::F32 => Value::F32(ArrayD::zeros(shape)),
            DType::I64 => Value::I64(ArrayD::zeros(shape)),
            DType::I32 => Value::I32(ArrayD::zeros(shape)),
            DType::Bool => Value::Bool(ArrayD::from_elem(shape, false)),
        }
    }

    /// Step `t` of a stacked value: index `t` of its leading axis.
    pub fn step(&self, t: usize) -> Value {
        use ndarray::Axis;
        match self {
            Value::F32(a) => Value::F32(a.index_axis(Axis(0), t).to_owned()),
            Value::I64(a) => Value::I64(a.index_axis(Axis(0), t).to_owned()),
            Value::I32(a) => Value::I32(a.index_axis(Axis(0), t).to_owned()),
            Value::Bool(a) => Value::Bool(a.index_axis(Axis(0), t).to_owned()),
        }
    }

    /// Writes `step` at index `t` of this stacked value's leading axis.
    pub fn set_step(&mut self, t: usize, step: &Value) -> Result<(), EngineError> {
        use ndarray::Axis;
        let mismatch = |stacked: &[usize], got: &Value| {
            EngineError::Shape(format!(
                "a step of {}{:?} must be {stacked:?} without its leading axis, got {}{:?}",
                got.dtype(),
                stacked,
                got.dtype(),
                got.shape()
            ))
        };
        if self.dtype() != step.dtype() || self.shape().get(1..) != Some(step.shape()) {
            return Err(mismatch(self.shape(), step));
        }
        match (self, step) {
            (Value::F32(a), Value::F32(s)) => a.index_axis_mut(Axis(0), t).assign(s),
            (Value::I64(a), Value::I64(s)) => a.index_axis_mut(Axis(0), t).assign(s),
            (Value::I32(a), Value::I32(s)) => a.index_axis_mut(Axis(0), t).assign(s),
            (Value::Bool(a), Value::Bool(s)) => a.index_axis_mut(Axis(0), t).assign(s),
            _ => unreachable!("dtypes checked above"),
        }
        Ok(())
    }

    pub fn as_f32(&self) -> Result<&ArrayD<f32>, EngineError> {
        match self {
            Value::F32(a) => Ok(a),
            other => Err(EngineError::DType(format!(
                "expected f32, got {}",
                other.dtype()
            ))),
        }
    }

    pub fn into_f32(self) -> Result<ArrayD<f32>, EngineError> {
        match self {
            Value::F32(a) => Ok(a),
            other => Err(EngineError::DType(format!(
                "expected f32, got {}",
                other.dtype()
            ))),
        }
    }

    /// The single element of a one-element f32 tensor.
    pub fn to_scalar_f32(&self) -> Result<f32, EngineError> {
        let a = self.as_f32()?;
        a.iter()
            .next()
            .copied()
            .filter(|_| a.len() == 1)
            .ok_or_else(|| {
                EngineError::Shape(format!("expected one element, got shape {:?}", a.shape()))
            })
    }

    /// Row-major f32 elements (copies when the layout is not standard).
    pub fn to_f32_vec(&self) -> Result<Vec<f32>, EngineError> {
        Ok(self.as_f32()?.iter().copied().collect())
    }

    pub fn from_data(data: &TensorData) -> Value {
        let shape = IxDyn(&data.shape);
        let build = |len_ok: Result<Value, ndarray::ShapeError>| {
            len_ok.expect("TensorData guarantees element count matches shape")
        };
        match &data.buffer {
            Buffer::F32(v) => build(ArrayD::from_shape_vec(shape, v.clone()).map(Value::F32)),
            Buffer::I64(v) => build(ArrayD::from_shape_vec(shape, v.clone()).map(Value::I64)),
            Buffer::I32(v) => build(ArrayD::from_shape_vec(shape, v.clone()).map(Value::I32)),
            Buffer::Bool(v) => build(ArrayD::from_shape_vec(shape, v.clone()).map(Value::Bool)),
        }
    }

    pub fn to_data(&self) -> TensorData {
        let shape = self.shape().to_vec();
        let buffer = match self {
            Value::F32(a) => Buffer::F32(a.iter().copied().collect()),
            Value::I64(a) => Buffer::I64(a.iter().copied().collect()),
            Value::I32(a) => Buffer::I32(a.iter().copied().collect()),
            Value::Bool(a) => Buffer::Bool(a.iter().copied().collect()),
        };
        TensorData { shape, buffer }
    }

    /// Whether this value fits a declared type with the batch bound to `batch`.
    pub fn fits(&self, ty: &TensorType, batch: usize) -> bool {
        self.dtype() == ty.dtype && self.shape() == ty.shape.resolve(batch).as_slice()
    }
}
