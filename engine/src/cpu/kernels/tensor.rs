//! Typed operands shared by the kernels: the element traits, an operand
//! that is either owned (reusable in place) or borrowed, and shape helpers.

use canopy_ir::DType;
use ndarray::{ArrayD, ArrayViewD, Axis, CowArray, IxDyn};

use super::Arg;
use crate::error::KernelError;
use crate::value::Value;

/// Element count from which a kernel spreads its work over rayon's threads;
/// below it, waking the pool costs more than the split saves.
pub const PAR_THRESHOLD: usize = 256 * 1024;

/// An element type a `Value` can hold.
pub trait Element: Copy + Default + PartialEq + PartialOrd + Send + Sync + 'static {
    const DTYPE: DType;
    fn from_value(value: Value) -> Option<ArrayD<Self>>;
    fn from_ref(value: &Value) -> Option<&ArrayD<Self>>;
    fn into_value(array: ArrayD<Self>) -> Value;
    fn to_f32(self) -> f32;
    fn to_i64(self) -> i64;
    fn to_i32(self) -> i32;
    fn to_bool(self) -> bool;
}

/// Arithmetic element types. Integer arithmetic wraps (as two's-complement
/// hardware does) instead of panicking on overflow.
pub trait Number: Element {
    const ZERO: Self;
    /// Integers have no value for `x / 0`; floats give ±inf or NaN.
    const DIVISION_BY_ZERO_IS_ERROR: bool;
    fn plus(self, other: Self) -> Self;
    fn minus(self, other: Self) -> Self;
    fn times(self, other: Self) -> Self;
    fn divide(self, other: Self) -> Self;
    /// The larger operand; NaN wins so that it propagates.
    fn maximum(self, other: Self) -> Self;
    /// The smaller operand; NaN wins so that it propagates.
    fn minimum(self, other: Self) -> Self;
}

macro_rules! element {
    ($t:ty, $variant:ident, $dtype:expr, |$x:ident| $f32:expr, $i64:expr, $i32:expr, $bool:expr) => {
        impl Element for $t {
            const DTYPE: DType = $dtype;
            fn from_value(value: Value) -> Option<ArrayD<Self>> {
                match value {
                    Value::$variant(a) => Some(a),
                    _ => None,
                }
            }
            fn from_ref(value: &Value) -> Option<&ArrayD<Self>> {
                match value {
                    Value::$variant(a) => Some(a),
                    _ => None,
                }
            }
            fn into_value(array: ArrayD<Self>) -> Value {
                Value::$variant(array)
            }
            fn to_f32(self) -> f32 {
                let $x = self;
                $f32
            }
            fn to_i64(self) -> i64 {
                let $x = self;
                $i64
            }
            fn to_i32(self) -> i32 {
                let $x = self;
                $i32
            }
            fn to_bool(self) -> bool {
                let $x = self;
                $bool
            }
        }
    };
}

// `as` from f32 truncates toward zero and saturates (NaN becomes 0), and
// between integers it wraps: the documented cast semantics.
element!(f32, F32, DType::F32, |x| x, x as i64, x as i32, x != 0.0);
element!(i64, I64, DType::I64, |x| x as f32, x, x as i32, x != 0);
element!(i32, I32, DType::I32, |x| x as f32, i64::from(x), x, x != 0);
element!(
    bool,
    Bool,
    DType::Bool,
    |x| f32::from(u8::from(x)),
    i64::from(x),
    i32::from(x),
    x
);

impl Number for f32 {
    const ZERO: Self = 0.0;
    const DIVISION_BY_ZERO_IS_ERROR: bool = false;
    fn plus(self, other: Self) -> Self {
        self + other
    }
    fn minus(self, other: Self) -> Self {
        self - other
    }
    fn times(self, other: Self) -> Self {
        self * other
    }
    fn divide(self, other: Self) -> Self {
        self / other
    }
    fn maximum(self, other: Self) -> Self {
        if self.is_nan() || self >= other {
            self
        } else {
            other
        }
    }
    fn minimum(self, other: Self) -> Self {
        if self.is_nan() || self <= other {
            self
        } else {
            other
        }
    }
}

macro_rules! integer_number {
    ($t:ty) => {
        impl Number for $t {
            const ZERO: Self = 0;
            const DIVISION_BY_ZERO_IS_ERROR: bool = true;
            fn plus(self, other: Self) -> Self {
                self.wrapping_add(other)
            }
            fn minus(self, other: Self) -> Self {
                self.wrapping_sub(other)
            }
            fn times(self, other: Self) -> Self {
                self.wrapping_mul(other)
            }
            /// Truncates toward zero; MIN / -1 wraps. Callers rule out zero.
            fn divide(self, other: Self) -> Self {
                self.checked_div(other)
                    .unwrap_or_else(|| self.wrapping_neg())
            }
            fn maximum(self, other: Self) -> Self {
                self.max(other)
            }
            fn minimum(self, other: Self) -> Self {
                self.min(other)
            }
        }
    };
}

integer_number!(i64);
integer_number!(i32);

/// A typed operand: owned when the executor handed it over (the kernel may
/// reuse its buffer), borrowed otherwise.
pub enum Tensor<'a, T> {
    Owned(ArrayD<T>),
    Shared(&'a ArrayD<T>),
}

impl<T: Element> Tensor<'_, T> {
    pub fn shape(&self) -> &[usize] {
        match self {
            Tensor::Owned(a) => a.shape(),
            Tensor::Shared(a) => a.shape(),
        }
    }

    pub fn len(&self) -> usize {
        self.shape().iter().product()
    }

    pub fn view(&self) -> ArrayViewD<'_, T> {
        match self {
            Tensor::Owned(a) => a.view(),
            Tensor::Shared(a) => a.view(),
        }
    }

    /// An owned array in standard (row-major) layout, copying only when
    /// the operand is borrowed or laid out otherwise.
    pub fn into_standard(self) -> ArrayD<T> {
        match self {
            Tensor::Owned(a) if a.is_standard_layout() => a,
            other => to_standard(other.view()),
        }
    }
}

/// The operand `arg` as a tensor of `T`, or an error naming `role`.
pub fn tensor<'a, T: Element>(arg: Arg<'a>, role: &str) -> Result<Tensor<'a, T>, KernelError> {
    let dtype = arg.value().dtype();
    let typed = match arg {
        Arg::Owned(v) => T::from_value(v).map(Tensor::Owned),
        Arg::Shared(v) => T::from_ref(v).map(Tensor::Shared),
    };
    typed.ok_or_else(|| KernelError::DType {
        role: role.to_string(),
        expected: T::DTYPE.name(),
        got: dtype,
    })
}

/// A row-major copy of `view`.
///
/// A view whose last axis is contiguous (a slice along an outer axis, as
/// a recurrent cell takes each step's input) is copied a row at a time:
/// ndarray's own copy steps a dynamic-rank index per element, where a GRU
/// of 64 units spent 8 % of its training (the federated charlm test in
/// `tests/agents.rs` took 127 s of CPU instead of 146).
pub fn to_standard<T: Clone>(view: ArrayViewD<'_, T>) -> ArrayD<T> {
    let rows_contiguous =
        view.ndim() > 1 && !view.is_standard_layout() && view.strides().last() == Some(&1);
    if !rows_contiguous {
        return view.as_standard_layout().into_owned();
    }
    let mut elements = Vec::with_capacity(view.len());
    for row in view.lanes(Axis(view.ndim() - 1)) {
        match row.as_slice() {
            Some(row) => elements.extend_from_slice(row),
            None => elements.extend(row.iter().cloned()),
        }
    }
    ArrayD::from_shape_vec(view.raw_dim(), elements)
        .unwrap_or_else(|_| view.as_standard_layout().into_owned())
}

/// The row-major elements of `array`, borrowed when already contiguous.
pub fn standard<'b, T: Clone>(array: &'b ArrayViewD<'_, T>) -> CowArray<'b, T, IxDyn> {
    array.as_standard_layout()
}

/// The elements of a standard-layout array as a slice.
pub fn as_slice<'a, T>(array: &'a CowArray<'_, T, IxDyn>) -> Result<&'a [T], KernelError> {
    array
        .as_slice()
        .ok_or_else(|| KernelError::Internal("expected a contiguous array".to_string()))
}

/// The element count of `shape`, or an error when it overflows.
pub fn checked_len(shape: &[usize]) -> Result<usize, KernelError> {
    shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .filter(|&n| n <= isize::MAX as usize / 8)
        .ok_or_else(|| KernelError::TooLarge(shape.to_vec()))
}

/// A tensor of `shape` filled with `value`, after checking its size.
pub fn filled<T: Clone>(shape: &[usize], value: T) -> Result<ArrayD<T>, KernelError> {
    checked_len(shape)?;
    Ok(ArrayD::from_elem(IxDyn(shape), value))
}

/// An array of `shape` from row-major elements.
pub fn from_vec<T>(shape: &[usize], data: Vec<T>) -> Result<ArrayD<T>, KernelError> {
    let len = data.len();
    ArrayD::from_shape_vec(IxDyn(shape), data)
        .map_err(|e| KernelError::Internal(format!("{len} elements for shape {shape:?}: {e}")))
}

/// NumPy broadcasting of two concrete shapes.
pub fn broadcast_shapes(a: &[usize], b: &[usize]) -> Result<Vec<usize>, KernelError> {
    let rank = a.len().max(b.len());
    let from_right = |s: &[usize], i: usize| if i < s.len() { s[s.len() - 1 - i] } else { 1 };
    let mut dims = vec![0; rank];
    for i in 0..rank {
        let (x, y) = (from_right(a, i), from_right(b, i));
        dims[rank - 1 - i] = match (x, y) {
            _ if x == y => x,
            (1, _) => y,
            (_, 1) => x,
            _ => {
                return Err(KernelError::Broadcast {
                    a: a.to_vec(),
                    b: b.to_vec(),
                });
            }
        };
    }
    Ok(dims)
}

/// `view` broadcast to `shape`, or an error naming both.
pub fn broadcast_to<'b, T>(
    view: &'b ArrayViewD<'_, T>,
    shape: &[usize],
) -> Result<ArrayViewD<'b, T>, KernelError> {
    view.broadcast(IxDyn(shape))
        .ok_or_else(|| KernelError::Broadcast {
            a: view.shape().to_vec(),
            b: shape.to_vec(),
        })
}

/// Checks that `axis` exists in a tensor of `rank`.
pub fn check_axis(axis: usize, rank: usize) -> Result<(), KernelError> {
    if axis >= rank {
        return Err(KernelError::Attribute(format!(
            "axis {axis} is out of range for rank {rank}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use ndarray::{ArrayD, Axis, IxDyn, Slice};

    use super::to_standard;

    /// Every kind of view a kernel copies: contiguous rows (a slice along
    /// an outer axis, reversed or strided outer axes) and strided rows (a
    /// transpose, a strided last axis), against ndarray's own copy.
    #[test]
    fn a_copy_keeps_every_element_in_row_major_order() {
        let array = ArrayD::from_shape_vec(IxDyn(&[3, 4, 5]), (0..60).collect::<Vec<i32>>())
            .expect("60 elements");
        let mut transposed = array.view();
        transposed.swap_axes(0, 2);
        let mut reversed = array.view();
        reversed.invert_axis(Axis(0));
        let views = [
            array.view(),
            array.slice_axis(Axis(1), Slice::from(1..3)),
            array.slice_axis(Axis(0), Slice::new(0, None, 2)),
            reversed,
            transposed,
            array.slice_axis(Axis(2), Slice::new(0, None, 2)),
            array.slice_axis(Axis(1), Slice::from(2..2)),
        ];
        for view in views {
            let expected = view.as_standard_layout().into_owned();
            let copied = to_standard(view);
            assert!(copied.is_standard_layout());
            assert_eq!(copied, expected);
        }
    }
}
