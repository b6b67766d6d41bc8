//! Element types, dimensions and tensor types of IR values.

use std::fmt;

/// Element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    F32,
    I64,
    I32,
    Bool,
}

impl DType {
    pub const ALL: [DType; 4] = [DType::F32, DType::I64, DType::I32, DType::Bool];

    /// Bytes one element occupies in the file format.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::I64 => 8,
            DType::Bool => 1,
        }
    }

    pub fn is_float(self) -> bool {
        self == DType::F32
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::I64 => "i64",
            DType::I32 => "i32",
            DType::Bool => "bool",
        }
    }

    /// Stable numeric tag used by the file format.
    pub fn tag(self) -> u8 {
        match self {
            DType::F32 => 0,
            DType::I64 => 1,
            DType::I32 => 2,
            DType::Bool => 3,
        }
    }

    pub fn from_tag(tag: u8) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.tag() == tag)
    }

    pub fn from_name(name: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.name() == name)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One dimension of a static shape.
///
/// `Batch` is the single symbolic dimension: it is bound when a graph runs,
/// from the leading dimension of the inputs that carry it, so one graph
/// serves every batch size.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dim {
    Fixed(usize),
    Batch,
}

impl Dim {
    pub fn fixed(self) -> Option<usize> {
        match self {
            Dim::Fixed(n) => Some(n),
            Dim::Batch => None,
        }
    }

    /// The concrete size, with the batch dimension bound to `batch`.
    pub fn resolve(self, batch: usize) -> usize {
        match self {
            Dim::Fixed(n) => n,
            Dim::Batch => batch,
        }
    }
}

impl fmt::Display for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Dim::Fixed(n) => write!(f, "{n}"),
            Dim::Batch => f.write_str("N"),
        }
    }
}

impl From<usize> for Dim {
    fn from(n: usize) -> Self {
        Dim::Fixed(n)
    }
}

/// A static shape, possibly with symbolic batch dimensions.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
pub struct Shape(pub Vec<Dim>);

impl Shape {
    pub fn scalar() -> Shape {
        Shape(Vec::new())
    }

    pub fn fixed(dims: &[usize]) -> Shape {
        Shape(dims.iter().map(|&d| Dim::Fixed(d)).collect())
    }

    pub fn rank(&self) -> usize {
        self.0.len()
    }

    pub fn dims(&self) -> &[Dim] {
        &self.0
    }

    pub fn has_batch(&self) -> bool {
        self.0.contains(&Dim::Batch)
    }

    /// Concrete dimensions, with the batch dimension bound to `batch`.
    pub fn resolve(&self, batch: usize) -> Vec<usize> {
        self.0.iter().map(|d| d.resolve(batch)).collect()
    }

    /// Concrete dimensions when the shape has no batch dimension.
    pub fn as_fixed(&self) -> Option<Vec<usize>> {
        self.0.iter().map(|d| d.fixed()).collect()
    }

    /// Element count when the shape is fully static.
    pub fn num_elements(&self) -> Option<usize> {
        self.as_fixed().map(|dims| dims.iter().product::<usize>())
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

impl From<Vec<Dim>> for Shape {
    fn from(dims: Vec<Dim>) -> Self {
        Shape(dims)
    }
}

/// The static type of an SSA value: element type and shape.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorType {
    pub dtype: DType,
    pub shape: Shape,
}

impl TensorType {
    pub fn new(dtype: DType, shape: impl Into<Shape>) -> Self {
        TensorType {
            dtype,
            shape: shape.into(),
        }
    }

    pub fn f32(dims: &[usize]) -> Self {
        TensorType::new(DType::F32, Shape::fixed(dims))
    }

    pub fn scalar(dtype: DType) -> Self {
        TensorType::new(dtype, Shape::scalar())
    }

    pub fn rank(&self) -> usize {
        self.shape.rank()
    }
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.dtype, self.shape)
    }
}
