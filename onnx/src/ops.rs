//! One lowering per supported ONNX op, each following the ONNX operator
//! specification (opsets 13 to 21) for the attributes and defaults it
//! accepts. An attribute value canopy-ir cannot honour exactly is refused by
//! name rather than imported with different semantics.

use canopy_ir::{
    BinaryOp, Buffer, Conv2dAttrs, DType, Dim, IrResult, Op, Pool2dAttrs, ReduceKind, Shape,
    TensorData, UnaryOp, ValueId,
};

use crate::attrs::Attrs;
use crate::decode::{dtype_of, tensor_data};
use crate::error::OnnxError;
use crate::import::Importer;
use crate::proto::{NodeProto, data_type};

/// The ops import supports, for documentation and error hints.
pub const SUPPORTED_OPS: &[&str] = &[
    "Abs",
    "Add",
    "And",
    "ArgMax",
    "AveragePool",
    "Cast",
    "Concat",
    "Constant",
    "Conv",
    "Div",
    "Dropout",
    "Equal",
    "Erf",
    "Exp",
    "Expand",
    "Flatten",
    "Gather",
    "Gemm",
    "GlobalAveragePool",
    "Greater",
    "GreaterOrEqual",
    "Identity",
    "Less",
    "LessOrEqual",
    "Log",
    "LogSoftmax",
    "MatMul",
    "Max",
    "MaxPool",
    "Min",
    "Mul",
    "Neg",
    "Not",
    "Or",
    "Pad",
    "Pow",
    "Reciprocal",
    "ReduceMax",
    "ReduceMean",
    "ReduceSum",
    "Relu",
    "Reshape",
    "Sigmoid",
    "Sign",
    "Slice",
    "Softmax",
    "Softplus",
    "Sqrt",
    "Squeeze",
    "Sub",
    "Tanh",
    "Transpose",
    "Unsqueeze",
    "Where",
];

/// One node being lowered: the importer, the node, and its attributes.
/// `ops_ml` lowers the `ai.onnx.ml` ops with the same helpers.
pub(crate) struct Lowering<'i, 'a, 'n> {
    pub(crate) imp: &'i mut Importer<'a>,
    pub(crate) node: &'n NodeProto,
    pub(crate) attrs: Attrs<'n>,
}

/// Lowers `node` and binds its output name.
pub(crate) fn lower(
    imp: &mut Importer<'_>,
    node: &NodeProto,
    describe: &str,
) -> Result<(), OnnxError> {
    let attrs = Attrs { node, describe };
    let output = single_output(node, &attrs)?;
    let origin = format!("the output of {describe}");
    let mut lowering = Lowering { imp, node, attrs };
    match node.op_type.as_str() {
        "Identity" => {
            lowering.attrs.allow_only(&[])?;
            lowering.expect_inputs(1, 1)?;
            let source = lowering.input_name(0)?;
            lowering.imp.define_alias(output, origin, source, describe)
        }
        "Dropout" => {
            let source = lowering.dropout()?;
            lowering.imp.define_alias(output, origin, source, describe)
        }
        "Constant" => {
            let data = lowering.constant_value()?;
            lowering.imp.define_constant(output, origin, data)
        }
        _ => {
            let value = lowering.lower_value()?;
            lowering.imp.define_value(output, origin, value)
        }
    }
}

/// Every supported op has one required output; a second one (Dropout's
/// mask, MaxPool's indices) is refused, since import does not compute it.
fn single_output<'n>(node: &'n NodeProto, attrs: &Attrs<'_>) -> Result<&'n str, OnnxError> {
    let Some(first) = node.output.first() else {
        return Err(attrs.invalid("the node has no output"));
    };
    if let Some((position, extra)) = node
        .output
        .iter()
        .enumerate()
        .skip(1)
        .find(|(_, o)| !o.is_empty())
    {
        return Err(attrs.invalid(format!(
            "output {position} (`{extra}`) is not supported; import computes only the first output"
        )));
    }
    Ok(first)
}

impl<'n> Lowering<'_, '_, 'n> {
    pub(crate) fn describe(&self) -> &str {
        self.attrs.describe
    }

    pub(crate) fn ir<T>(&self, result: IrResult<T>) -> Result<T, OnnxError> {
        result.map_err(|source| OnnxError::Lowering {
            node: self.describe().to_string(),
            source,
        })
    }

    fn lower_value(&mut self) -> Result<ValueId, OnnxError> {
        match self.node.op_type.as_str() {
            "Add" => self.binary(BinaryOp::Add),
            "Sub" => self.binary(BinaryOp::Sub),
            "Mul" => self.binary(BinaryOp::Mul),
            "Div" => self.binary(BinaryOp::Div),
            "Relu" => self.unary(UnaryOp::Relu),
            "Sigmoid" => self.unary(UnaryOp::Sigmoid),
            "Tanh" => self.unary(UnaryOp::Tanh),
            "Erf" => self.unary(UnaryOp::Erf),
            "Softmax" => self.softmax(false),
            "LogSoftmax" => self.softmax(true),
            "Gemm" => self.gemm(),
            "MatMul" => self.matmul(),
            "Flatten" => self.flatten(),
            "Reshape" => self.reshape(),
            "Transpose" => self.transpose(),
            "Cast" => self.cast(),
            "Concat" => self.concat(),
            "Squeeze" => self.squeeze(),
            "Unsqueeze" => self.unsqueeze(),
            "Conv" => self.conv(),
            "MaxPool" => self.pool(false),
            "AveragePool" => self.pool(true),
            "GlobalAveragePool" => self.global_average_pool(),
            "Neg" => self.unary(UnaryOp::Neg),
            "Abs" => self.unary(UnaryOp::Abs),
            "Sign" => self.unary(UnaryOp::Sign),
            "Exp" => self.unary(UnaryOp::Exp),
            "Log" => self.unary(UnaryOp::Log),
            "Sqrt" => self.unary(UnaryOp::Sqrt),
            "Reciprocal" => self.unary(UnaryOp::Reciprocal),
            "Not" => self.unary(UnaryOp::Not),
            "Softplus" => self.unary(UnaryOp::Softplus),
            "Pow" => self.binary(BinaryOp::Pow),
            "Max" => self.binary(BinaryOp::Maximum),
            "Min" => self.binary(BinaryOp::Minimum),
            "Equal" => self.binary(BinaryOp::Eq),
            "Less" => self.binary(BinaryOp::Lt),
            "LessOrEqual" => self.binary(BinaryOp::Le),
            "Greater" => self.binary(BinaryOp::Gt),
            "GreaterOrEqual" => self.binary(BinaryOp::Ge),
            "And" => self.binary(BinaryOp::And),
            "Or" => self.binary(BinaryOp::Or),
            "Where" => self.where_(),
            "ReduceSum" => self.reduce(ReduceKind::Sum),
            "ReduceMean" => self.reduce(ReduceKind::Mean),
            "ReduceMax" => self.reduce(ReduceKind::Max),
            "ArgMax" => self.argmax(),
            "Expand" => self.expand(),
            "Slice" => self.slice(),
            "Pad" => self.pad(),
            "Gather" => self.gather(),
            _ => Err(OnnxError::UnsupportedOp {
                node: self.describe().to_string(),
                op_type: self.node.op_type.clone(),
                domain: if self.node.domain.is_empty() {
                    "ai.onnx".to_string()
                } else {
                    self.node.domain.clone()
                },
                opset: self.imp.opset,
            }),
        }
    }

    // ---- inputs ------------------------------------------------------------

    pub(crate) fn expect_inputs(&self, min: usize, max: usize) -> Result<(), OnnxError> {
        let count = self.node.input.len();
        if count < min || count > max {
            return Err(self
                .attrs
                .invalid(format!("takes {min} to {max} inputs, the node has {count}")));
        }
        Ok(())
    }

    /// The name of required input `position`.
    pub(crate) fn input_name(&self, position: usize) -> Result<&'n str, OnnxError> {
        match self.node.input.get(position) {
            Some(name) if !name.is_empty() => Ok(name),
            _ => Err(self
                .attrs
                .invalid(format!("required input {position} is missing"))),
        }
    }

    /// The name of optional input `position`; an empty name means absent.
    fn optional_input_name(&self, position: usize) -> Option<&'n str> {
        self.node
            .input
            .get(position)
            .map(String::as_str)
            .filter(|name| !name.is_empty())
    }

    pub(crate) fn input(&mut self, position: usize) -> Result<ValueId, OnnxError> {
        let name = self.input_name(position)?.to_string();
        self.imp.value(&name, self.attrs.describe)
    }

    /// A constant integer vector (a shape or axes) from input `position`,
    /// at most `max_rank` long.
    fn constant_ints(&self, position: usize, role: &str) -> Result<Vec<i64>, OnnxError> {
        self.constant_ints_up_to(position, role, self.imp.limits.max_rank)
    }

    /// [`Self::constant_ints`] with at most `max_len` entries (a Pad's
    /// pads hold two per axis).
    fn constant_ints_up_to(
        &self,
        position: usize,
        role: &str,
        max_len: usize,
    ) -> Result<Vec<i64>, OnnxError> {
        let name = self.input_name(position)?;
        let Some(data) = self.imp.constant(name, self.describe())? else {
            return Err(self.attrs.invalid(format!(
                "the {role} `{name}` must be a constant (an initializer or a Constant node); computed {role}s are not supported"
            )));
        };
        // Checked before copying: the constant may be large.
        if data.shape.len() > 1 || data.buffer.len() > max_len {
            return Err(self.attrs.invalid(format!(
                "the {role} `{name}` must be a 1-D list of at most {max_len} entries, got shape {:?}",
                data.shape
            )));
        }
        let values: Vec<i64> = match &data.buffer {
            Buffer::I64(v) => v.clone(),
            Buffer::I32(v) => v.iter().map(|&x| i64::from(x)).collect(),
            other => {
                return Err(self.attrs.invalid(format!(
                    "the {role} `{name}` must be int64, got {}",
                    other.dtype()
                )));
            }
        };
        Ok(values)
    }

    pub(crate) fn dims(&self, value: ValueId) -> Vec<Dim> {
        self.imp.ty(value).shape.0.clone()
    }

    /// `axis` in `[-rank, rank)` (or `[-rank, rank]` when `inclusive`) as an
    /// index.
    fn axis(
        &self,
        name: &str,
        axis: i64,
        rank: usize,
        inclusive: bool,
    ) -> Result<usize, OnnxError> {
        let rank_i = i64::try_from(rank).unwrap_or(i64::MAX);
        let upper = if inclusive { rank_i } else { rank_i - 1 };
        if axis < -rank_i || axis > upper {
            return Err(self
                .attrs
                .invalid(format!("{name} {axis} is out of range for rank {rank}")));
        }
        let normalized = if axis < 0 { axis + rank_i } else { axis };
        usize::try_from(normalized)
            .map_err(|_| self.attrs.invalid(format!("{name} {axis} is invalid")))
    }

    // ---- elementwise -------------------------------------------------------

    fn binary(&mut self, op: BinaryOp) -> Result<ValueId, OnnxError> {
        self.attrs.allow_only(&[])?;
        self.expect_inputs(2, 2)?;
        let (a, b) = (self.input(0)?, self.input(1)?);
        let result = self.imp.graph.binary(op, a, b);
        self.ir(result)
    }

    fn unary(&mut self, op: UnaryOp) -> Result<ValueId, OnnxError> {
        self.attrs.allow_only(&[])?;
        self.expect_inputs(1, 1)?;
        let x = self.input(0)?;
        let result = self.imp.graph.unary(op, x);
        self.ir(result)
    }

    /// Opset 13+ semantics: normalise along one axis (default -1).
    fn softmax(&mut self, log: bool) -> Result<ValueId, OnnxError> {
        self.attrs.allow_only(&["axis"])?;
        self.expect_inputs(1, 1)?;
        let x = self.input(0)?;
        let axis = self.axis(
            "axis",
            self.attrs.int("axis", -1)?,
            self.imp.ty(x).rank(),
            false,
        )?;
        let result = if log {
            self.imp.graph.log_softmax(x, axis)
        } else {
            self.imp.graph.softmax(x, axis)
        };
        self.ir(result)
    }

    /// Inference semantics: the output is the input. A `training_mode`
    /// input must be a constant false, since import has no training mode.
    fn dropout(&mut self) -> Result<&'n str, OnnxError> {
        self.attrs.allow_only(&["seed"])?;
        self.expect_inputs(1, 3)?;
        if let Some(mode) = self.optional_input_name(2) {
            let training = self.imp.constant(mode, self.describe())?;
            let is_false = matches!(training.map(|d| &d.buffer), Some(Buffer::Bool(v)) if v.iter().all(|&b| !b));
            if !is_false {
                return Err(self.attrs.invalid(format!(
                    "training_mode `{mode}` must be a constant false; import runs dropout in inference mode"
                )));
            }
        }
        self.input_name(0)
    }

    // ---- linear algebra ----------------------------------------------------

    /// Y = alpha·A'·B' + beta·C, where ' is an optional transpose and C
    /// broadcasts to Y's shape.
    fn gemm(&mut self) -> Result<ValueId, OnnxError> {
        self.attrs
            .allow_only(&["alpha", "beta", "transA", "transB"])?;
        self.expect_inputs(2, 3)?;
        let (a, b) = (self.input(0)?, self.input(1)?);
        for (role, value) in [("A", a), ("B", b)] {
            if self.imp.ty(value).rank() != 2 {
                let ty = self.imp.ty(value).clone();
                return Err(self.attrs.invalid(format!("{role} must be 2-D, got {ty}")));
            }
        }
        let transpose_a = self.attrs.int("transA", 0)? != 0;
        let transpose_b = self.attrs.int("transB", 0)? != 0;
        let alpha = self.attrs.float("alpha", 1.0)?;
        let beta = self.attrs.float("beta", 1.0)?;
        let product = self.imp.graph.matmul_t(a, b, transpose_a, transpose_b);
        let mut y = self.ir(product)?;
        if alpha != 1.0 {
            y = self.scale(y, alpha)?;
        }
        let Some(c_name) = self.optional_input_name(2).map(str::to_string) else {
            return Ok(y);
        };
        let mut c = self.imp.value(&c_name, self.attrs.describe)?;
        if beta != 1.0 {
            c = self.scale(c, beta)?;
        }
        let y_type = self.imp.ty(y).clone();
        let sum = self.imp.graph.add(y, c);
        let sum = self.ir(sum)?;
        if *self.imp.ty(sum) != y_type {
            return Err(self.attrs.invalid(format!(
                "C `{c_name}` does not broadcast to the product's type {y_type}"
            )));
        }
        Ok(sum)
    }

    fn scale(&mut self, x: ValueId, factor: f32) -> Result<ValueId, OnnxError> {
        let factor = self.imp.graph.scalar(factor);
        let factor = self.ir(factor)?;
        let result = self.imp.graph.mul(x, factor);
        self.ir(result)
    }

    /// NumPy matmul for operands of rank 2 or more (batch dims broadcast).
    fn matmul(&mut self) -> Result<ValueId, OnnxError> {
        self.attrs.allow_only(&[])?;
        self.expect_inputs(2, 2)?;
        let (a, b) = (self.input(0)?, self.input(1)?);
        if self.imp.ty(a).rank() < 2 || self.imp.ty(b).rank() < 2 {
            let (ta, tb) = (self.imp.ty(a).clone(), self.imp.ty(b).clone());
            return Err(self.attrs.invalid(format!(
                "1-D operands are not supported yet (got {ta} and {tb}); reshape them to 2-D"
            )));
        }
        let result = self.imp.graph.matmul(a, b);
        self.ir(result)
    }

    // ---- shapes ------------------------------------------------------------

    /// [d0 · … · d(axis-1), d(axis) · … · d(rank-1)].
    fn flatten(&mut self) -> Result<ValueId, OnnxError> {
        self.attrs.allow_only(&["axis"])?;
        self.expect_inputs(1, 1)?;
        let x = self.input(0)?;
        let dims = self.dims(x);
        let axis = self.axis("axis", self.attrs.int("axis", 1)?, dims.len(), true)?;
        let (outer, inner) = dims.split_at(axis);
        let (Some(outer), Some(inner)) = (dims_product(outer), dims_product(inner)) else {
            return Err(self.attrs.invalid(format!(
                "cannot flatten {} at axis {axis}: the batch dimension would merge with other dimensions",
                Shape(dims.clone())
            )));
        };
        let result = self.imp.graph.reshape(x, vec![outer, inner]);
        self.ir(result)
    }

    fn reshape(&mut self) -> Result<ValueId, OnnxError> {
        self.attrs.allow_only(&["allowzero"])?;
        self.expect_inputs(2, 2)?;
        let x = self.input(0)?;
        let requested = self.constant_ints(1, "shape")?;
        if self.attrs.int("allowzero", 0)? != 0 && requested.contains(&0) {
            return Err(self.attrs.unsupported(
                "allowzero",
                1,
                "a 0 in the shape would mean an empty dimension, which import does not support",
            ));
        }
        let target = self.reshape_target(&self.dims(x), &requested)?;
        let result = self.imp.graph.reshape(x, target);
        self.ir(result)
    }

    /// ONNX Reshape's target: 0 copies the input dimension at that position,
    /// -1 (at most once) takes whatever the element count leaves. With a
    /// batch dimension, -1 is the batch dimension when the fixed sizes
    /// already match.
    fn reshape_target(&self, input: &[Dim], requested: &[i64]) -> Result<Vec<Dim>, OnnxError> {
        let mut target: Vec<Option<Dim>> = Vec::with_capacity(requested.len());
        for (position, &size) in requested.iter().enumerate() {
            target.push(match size {
                0 => Some(*input.get(position).ok_or_else(|| {
                    self.attrs.invalid(format!(
                        "shape entry {position} is 0 but the input has rank {}",
                        input.len()
                    ))
                })?),
                -1 => None,
                n if n > 0 => Some(Dim::Fixed(usize::try_from(n).map_err(|_| {
                    self.attrs
                        .invalid(format!("shape entry {n} does not fit in usize"))
                })?)),
                n => return Err(self.attrs.invalid(format!("shape entry {n} is invalid"))),
            });
        }
        let unknown: Vec<usize> = target
            .iter()
            .enumerate()
            .filter(|(_, d)| d.is_none())
            .map(|(i, _)| i)
            .collect();
        match unknown.as_slice() {
            [] => {}
            [position] => {
                let known: Vec<Dim> = target.iter().flatten().copied().collect();
                let inferred = infer_minus_one(input, &known).ok_or_else(|| {
                    self.attrs.invalid(format!(
                        "cannot infer -1 in shape {requested:?} for input {}",
                        Shape(input.to_vec())
                    ))
                })?;
                if let Some(slot) = target.get_mut(*position) {
                    *slot = Some(inferred);
                }
            }
            _ => {
                return Err(self
                    .attrs
                    .invalid(format!("shape {requested:?} has more than one -1")));
            }
        }
        Ok(target.into_iter().flatten().collect())
    }

    fn transpose(&mut self) -> Result<ValueId, OnnxError> {
        self.attrs.allow_only(&["perm"])?;
        self.expect_inputs(1, 1)?;
        let x = self.input(0)?;
        let rank = self.imp.ty(x).rank();
        let perm: Vec<usize> = match self.attrs.ints("perm")? {
            None => (0..rank).rev().collect(),
            Some(perm) => {
                let as_usize: Option<Vec<usize>> =
                    perm.iter().map(|&p| usize::try_from(p).ok()).collect();
                let is_permutation = as_usize.as_ref().is_some_and(|p| {
                    let mut sorted = p.clone();
                    sorted.sort_unstable();
                    sorted.iter().copied().eq(0..rank)
                });
                match as_usize {
                    Some(p) if is_permutation => p,
                    _ => {
                        return Err(self
                            .attrs
                            .invalid(format!("perm {perm:?} is not a permutation of 0..{rank}")));
                    }
                }
            }
        };
        let result = self.imp.graph.transpose(x, perm);
        self.ir(result)
    }

    /// `saturate` (opset 19) only affects float8 targets, which are refused.
    fn cast(&mut self) -> Result<ValueId, OnnxError> {
        self.attrs.allow_only(&["to", "saturate"])?;
        self.expect_inputs(1, 1)?;
        let x = self.input(0)?;
        let to = self.attrs.required_int("to")?;
        let dtype: Option<DType> = i32::try_from(to).ok().and_then(dtype_of);
        let Some(dtype) = dtype else {
            let name = i32::try_from(to).map_or("an unknown type", data_type::name);
            return Err(self.attrs.unsupported(
                "to",
                to,
                format!("casting to {name} is not supported (FLOAT, INT64, INT32, BOOL are)"),
            ));
        };
        let result = self.imp.graph.cast(x, dtype);
        self.ir(result)
    }

    fn concat(&mut self) -> Result<ValueId, OnnxError> {
        self.attrs.allow_only(&["axis"])?;
        self.expect_inputs(1, self.imp.limits.max_node_arity)?;
        let mut values = Vec::with_capacity(self.node.input.len());
        for position in 0..self.node.input.len() {
            values.push(self.input(position)?);
        }
        let rank = values.first().map_or(0, |&v| self.imp.ty(v).rank());
        let axis = self.axis("axis", self.attrs.required_int("axis")?, rank, false)?;
        let result = self.imp.graph.push(canopy_ir::Op::Concat { axis }, &values);
        self.ir(result)
    }

    /// Opset 13+: axes is an optional input; without it every size-1
    /// dimension goes.
    fn squeeze(&mut self) -> Result<ValueId, OnnxError> {
        self.attrs.allow_only(&[])?;
        self.expect_inputs(1, 2)?;
        let x = self.input(0)?;
        let dims = self.dims(x);
        let axes: Vec<usize> = match self.optional_input_name(1) {
            None => (0..dims.len())
                .filter(|&i| dims.get(i) == Some(&Dim::Fixed(1)))
                .collect(),
            Some(_) => {
                let raw = self.constant_ints(1, "axes")?;
                let mut axes = Vec::with_capacity(raw.len());
                for axis in raw {
                    let axis = self.axis("axis", axis, dims.len(), false)?;
                    if dims.get(axis) != Some(&Dim::Fixed(1)) {
                        return Err(self.attrs.invalid(format!(
                            "axis {axis} of {} does not have size 1",
                            Shape(dims.clone())
                        )));
                    }
                    axes.push(axis);
                }
                axes
            }
        };
        let kept: Vec<Dim> = dims
            .iter()
            .enumerate()
            .filter(|(i, _)| !axes.contains(i))
            .map(|(_, d)| *d)
            .collect();
        let result = self.imp.graph.reshape(x, kept);
        self.ir(result)
    }

    /// Opset 13+: axes is a required input, indexing the output's rank.
    fn unsqueeze(&mut self) -> Result<ValueId, OnnxError> {
        self.attrs.allow_only(&[])?;
        self.expect_inputs(2, 2)?;
        let x = self.input(0)?;
        let dims = self.dims(x);
        let raw = self.constant_ints(1, "axes")?;
        let out_rank = dims.len() + raw.len();
        if out_rank > self.imp.limits.max_rank {
            return Err(self.attrs.invalid(format!(
                "the output rank {out_rank} exceeds the limit of {}",
                self.imp.limits.max_rank
            )));
        }
        let mut axes = Vec::with_capacity(raw.len());
        for axis in raw {
            let axis = self.axis("axis", axis, out_rank, false)?;
            if axes.contains(&axis) {
                return Err(self.attrs.invalid(format!("axis {axis} is given twice")));
            }
            axes.push(axis);
        }
        let mut remaining = dims.iter();
        let target: Vec<Dim> = (0..out_rank)
            .filter_map(|i| {
                if axes.contains(&i) {
                    Some(Dim::Fixed(1))
                } else {
                    remaining.next().copied()
                }
            })
            .collect();
        let result = self.imp.graph.reshape(x, target);
        self.ir(result)
    }

    // ---- constants ---------------------------------------------------------

    /// Exactly one of `value`, `value_float(s)`, `value_int(s)`.
    fn constant_value(&mut self) -> Result<TensorData, OnnxError> {
        let known = [
            "value",
            "value_float",
            "value_floats",
            "value_int",
            "value_ints",
        ];
        self.attrs.allow_only(&known)?;
        self.expect_inputs(0, 0)?;
        if self.node.attribute.len() != 1 {
            return Err(self
                .attrs
                .invalid("a Constant needs exactly one value attribute"));
        }
        let data = if let Some(tensor) = self.attrs.tensor("value")? {
            let fallback = format!("{}.value", self.node.name);
            let name = if tensor.name.is_empty() {
                &fallback
            } else {
                &tensor.name
            };
            tensor_data(tensor, name, self.imp.limits)?
        } else if self.attrs.has("value_float") {
            TensorData::scalar_f32(self.attrs.float("value_float", 0.0)?)
        } else if self.attrs.has("value_int") {
            TensorData::new(
                Vec::new(),
                Buffer::I64(vec![self.attrs.int("value_int", 0)?]),
            )
            .ok_or_else(|| self.attrs.invalid("value_int does not form a scalar"))?
        } else if let Some(floats) = self.attrs.floats("value_floats")? {
            TensorData::new(vec![floats.len()], Buffer::F32(floats.to_vec()))
                .ok_or_else(|| self.attrs.invalid("value_floats does not form a vector"))?
        } else {
            let ints = self.attrs.ints("value_ints")?.unwrap_or_default();
            TensorData::new(vec![ints.len()], Buffer::I64(ints.to_vec()))
                .ok_or_else(|| self.attrs.invalid("value_ints does not form a vector"))?
        };
        Ok(data)
    }

    // ---- convolution and pooling -------------------------------------------

    fn expect_image(&self, value: ValueId, role: &str) -> Result<(), OnnxError> {
        let ty = self.imp.ty(value);
        if ty.rank() != 4 {
            return Err(self.attrs.invalid(format!(
                "{role} must be rank 4 (NCHW; only 2-D windows are supported), got {ty}"
            )));
        }
        Ok(())
    }

    /// Y = conv(X, W) + B, group 1, symmetric padding.
    fn conv(&mut self) -> Result<ValueId, OnnxError> {
        self.attrs.allow_only(&[
            "auto_pad",
            "dilations",
            "group",
            "kernel_shape",
            "pads",
            "strides",
        ])?;
        self.expect_inputs(2, 3)?;
        let (x, w) = (self.input(0)?, self.input(1)?);
        self.expect_image(x, "X")?;
        self.expect_image(w, "W")?;
        let group = self.attrs.int("group", 1)?;
        if group != 1 {
            return Err(self.attrs.unsupported(
                "group",
                group,
                "grouped and depthwise convolution are not supported",
            ));
        }
        let w_dims = self.dims(w);
        let kernel: Vec<i64> = w_dims
            .iter()
            .skip(2)
            .map(|d| d.fixed().and_then(|n| i64::try_from(n).ok()).unwrap_or(-1))
            .collect();
        let declared = self.attrs.ints("kernel_shape")?;
        if declared.is_some_and(|declared| declared != kernel.as_slice()) {
            return Err(self.attrs.invalid(format!(
                "kernel_shape {declared:?} differs from W's spatial size {kernel:?}"
            )));
        }
        let window = self.window(true)?;
        let attrs = Conv2dAttrs {
            stride: window.stride,
            padding: window.padding,
            dilation: window.dilation,
        };
        let y = self.imp.graph.conv2d(x, w, attrs);
        let y = self.ir(y)?;
        match self.optional_input_name(2).map(str::to_string) {
            None => Ok(y),
            Some(bias_name) => self.add_channel_bias(y, &bias_name),
        }
    }

    /// Adds a [C] bias to an NCHW tensor, as [1, C, 1, 1].
    fn add_channel_bias(&mut self, y: ValueId, bias_name: &str) -> Result<ValueId, OnnxError> {
        let bias = self.imp.value(bias_name, self.attrs.describe)?;
        let bias_dims = self.dims(bias);
        let [channels] = bias_dims.as_slice() else {
            return Err(self.attrs.invalid(format!(
                "B `{bias_name}` must be 1-D, got {}",
                Shape(bias_dims.clone())
            )));
        };
        let shaped = self.imp.graph.reshape(
            bias,
            vec![Dim::Fixed(1), *channels, Dim::Fixed(1), Dim::Fixed(1)],
        );
        let shaped = self.ir(shaped)?;
        let sum = self.imp.graph.add(y, shaped);
        self.ir(sum)
    }

    /// MaxPool, or AveragePool with `average`.
    fn pool(&mut self, average: bool) -> Result<ValueId, OnnxError> {
        let mut known = vec![
            "auto_pad",
            "ceil_mode",
            "dilations",
            "kernel_shape",
            "pads",
            "strides",
        ];
        known.push(if average {
            "count_include_pad"
        } else {
            "storage_order"
        });
        self.attrs.allow_only(&known)?;
        self.expect_inputs(1, 1)?;
        let x = self.input(0)?;
        self.expect_image(x, "X")?;
        let ceil_mode = self.attrs.int("ceil_mode", 0)?;
        if ceil_mode != 0 {
            return Err(self.attrs.unsupported(
                "ceil_mode",
                ceil_mode,
                "canopy's pooling rounds the output size down",
            ));
        }
        let kernel = match self.attrs.ints("kernel_shape")? {
            Some(kernel) => self.pair("kernel_shape", kernel)?,
            None => {
                return Err(self
                    .attrs
                    .invalid("required attribute `kernel_shape` is missing"));
            }
        };
        let window = self.window(false)?;
        let count_include_pad = self.attrs.int("count_include_pad", 0)?;
        if average && count_include_pad == 0 && window.padding != [0, 0] {
            return Err(self.attrs.unsupported(
                "count_include_pad",
                count_include_pad,
                "with padding, ONNX then divides by the number of real elements, but canopy's avg_pool2d counts padding as zeros (count_include_pad=1); hint: export with count_include_pad=1 or without padding",
            ));
        }
        let attrs = Pool2dAttrs {
            kernel,
            stride: window.stride,
            padding: window.padding,
        };
        let result = if average {
            self.imp.graph.avg_pool2d(x, attrs)
        } else {
            self.imp.graph.max_pool2d(x, attrs)
        };
        self.ir(result)
    }

    /// Mean over every spatial axis, keeping them as size 1.
    fn global_average_pool(&mut self) -> Result<ValueId, OnnxError> {
        self.attrs.allow_only(&[])?;
        self.expect_inputs(1, 1)?;
        let x = self.input(0)?;
        let rank = self.imp.ty(x).rank();
        if rank < 3 {
            let ty = self.imp.ty(x).clone();
            return Err(self.attrs.invalid(format!(
                "X must have spatial axes (rank 3 or more), got {ty}"
            )));
        }
        let axes: Vec<usize> = (2..rank).collect();
        let result = self.imp.graph.mean(x, &axes, true);
        self.ir(result)
    }

    /// Strides, symmetric pads and (for Conv) dilations of a 2-D window.
    fn window(&self, dilation_allowed: bool) -> Result<Window, OnnxError> {
        let auto_pad = self
            .attrs
            .string("auto_pad")?
            .unwrap_or_else(|| "NOTSET".to_string());
        let pads = self.attrs.ints("pads")?.unwrap_or(&[0, 0, 0, 0]);
        match auto_pad.as_str() {
            "NOTSET" => {}
            "VALID" if pads.iter().all(|&p| p == 0) => {}
            "VALID" => {
                return Err(self.attrs.invalid(format!(
                    "auto_pad VALID is given together with pads {pads:?}"
                )));
            }
            other => {
                return Err(self.attrs.unsupported(
                    "auto_pad",
                    other,
                    "only NOTSET and VALID are supported; hint: export with explicit pads",
                ));
            }
        }
        let [top, left, bottom, right] = pads else {
            return Err(self.attrs.invalid(format!(
                "pads {pads:?} must have 4 entries for a 2-D window"
            )));
        };
        if top != bottom || left != right {
            return Err(self.attrs.unsupported("pads", pads, "asymmetric padding (begin != end) is not supported; canopy pads both sides equally"));
        }
        let padding = self.non_negative_pair("pads", &[*top, *left])?;
        let stride = self.pair("strides", self.attrs.ints("strides")?.unwrap_or(&[1, 1]))?;
        let dilations = self.attrs.ints("dilations")?.unwrap_or(&[1, 1]);
        let dilation = self.pair("dilations", dilations)?;
        if !dilation_allowed && dilation != [1, 1] {
            return Err(self.attrs.unsupported(
                "dilations",
                dilations,
                "dilated pooling is not supported",
            ));
        }
        Ok(Window {
            stride,
            padding,
            dilation,
        })
    }

    /// Two positive sizes.
    fn pair(&self, name: &str, values: &[i64]) -> Result<[usize; 2], OnnxError> {
        let pair = self.non_negative_pair(name, values)?;
        if pair.contains(&0) {
            return Err(self
                .attrs
                .invalid(format!("{name} {values:?} must be positive")));
        }
        Ok(pair)
    }

    fn non_negative_pair(&self, name: &str, values: &[i64]) -> Result<[usize; 2], OnnxError> {
        let invalid = || {
            self.attrs
                .invalid(format!("{name} {values:?} must be two non-negative sizes"))
        };
        let [first, second] = values else {
            return Err(invalid());
        };
        let first = usize::try_from(*first).map_err(|_| invalid())?;
        let second = usize::try_from(*second).map_err(|_| invalid())?;
        Ok([first, second])
    }
}

/// Selection, reductions, broadcasting, slicing, padding and gathering:
/// the ops canopy's own export writes, so an exported model imports back.
impl Lowering<'_, '_, '_> {
    fn where_(&mut self) -> Result<ValueId, OnnxError> {
        self.attrs.allow_only(&[])?;
        self.expect_inputs(3, 3)?;
        let (condition, a, b) = (self.input(0)?, self.input(1)?, self.input(2)?);
        let result = self.imp.graph.select(condition, a, b);
        self.ir(result)
    }

    /// `raw` axes in [-rank, rank) as sorted, distinct indices.
    fn sorted_axes(&self, raw: &[i64], rank: usize) -> Result<Vec<usize>, OnnxError> {
        let mut axes = Vec::with_capacity(raw.len());
        for &axis in raw {
            axes.push(self.axis("axis", axis, rank, false)?);
        }
        axes.sort_unstable();
        if axes.windows(2).any(|pair| pair[0] == pair[1]) {
            return Err(self
                .attrs
                .invalid(format!("axes {raw:?} name an axis twice")));
        }
        Ok(axes)
    }

    /// Axes are an input for ReduceSum (opset 13) and every reduction from
    /// opset 18, an attribute before; none means every axis, or the
    /// identity with `noop_with_empty_axes`.
    fn reduce(&mut self, kind: ReduceKind) -> Result<ValueId, OnnxError> {
        let axes_as_input = kind == ReduceKind::Sum || self.imp.opset >= 18;
        if axes_as_input {
            self.attrs
                .allow_only(&["keepdims", "noop_with_empty_axes"])?;
            self.expect_inputs(1, 2)?;
        } else {
            self.attrs.allow_only(&["axes", "keepdims"])?;
            self.expect_inputs(1, 1)?;
        }
        let x = self.input(0)?;
        let rank = self.imp.ty(x).rank();
        let raw = if !axes_as_input {
            self.attrs.ints("axes")?.map(<[i64]>::to_vec)
        } else if self.optional_input_name(1).is_some() {
            Some(self.constant_ints(1, "axes")?)
        } else {
            None
        };
        let raw = match raw {
            Some(raw) if !raw.is_empty() => raw,
            _ if self.attrs.int("noop_with_empty_axes", 0)? != 0 => return Ok(x),
            _ => (0..rank as i64).collect(),
        };
        let axes = self.sorted_axes(&raw, rank)?;
        let keep_dims = self.attrs.int("keepdims", 1)? != 0;
        let result = self.imp.graph.reduce(kind, x, &axes, keep_dims);
        self.ir(result)
    }

    fn argmax(&mut self) -> Result<ValueId, OnnxError> {
        self.attrs
            .allow_only(&["axis", "keepdims", "select_last_index"])?;
        self.expect_inputs(1, 1)?;
        let last = self.attrs.int("select_last_index", 0)?;
        if last != 0 {
            return Err(self.attrs.unsupported(
                "select_last_index",
                last,
                "canopy's argmax picks the first maximum",
            ));
        }
        let x = self.input(0)?;
        let rank = self.imp.ty(x).rank();
        let axis = self.axis("axis", self.attrs.int("axis", 0)?, rank, false)?;
        let keep_dims = self.attrs.int("keepdims", 1)? != 0;
        let result = self.imp.graph.push(Op::ArgMax { axis, keep_dims }, &[x]);
        self.ir(result)
    }

    /// Bidirectional broadcasting against a constant shape; a 1 facing the
    /// batch dimension keeps it.
    fn expand(&mut self) -> Result<ValueId, OnnxError> {
        self.attrs.allow_only(&[])?;
        self.expect_inputs(2, 2)?;
        let x = self.input(0)?;
        let requested = self.constant_ints(1, "shape")?;
        let dims = self.dims(x);
        let rank = dims.len().max(requested.len());
        let mut target = Vec::with_capacity(rank);
        for axis in 0..rank {
            let have = (axis + dims.len()).checked_sub(rank).map(|i| dims[i]);
            let want = (axis + requested.len())
                .checked_sub(rank)
                .map(|i| requested[i]);
            let dim = match (have, want) {
                (Some(dim), None | Some(1)) => dim,
                (None | Some(Dim::Fixed(1)), Some(n)) if n > 0 => Dim::Fixed(n as usize),
                (Some(Dim::Fixed(size)), Some(n)) if size as i64 == n => Dim::Fixed(size),
                _ => {
                    return Err(self.attrs.invalid(format!(
                        "cannot broadcast {} to shape {requested:?}",
                        Shape(dims.clone())
                    )));
                }
            };
            target.push(dim);
        }
        let result = self.imp.graph.broadcast(x, target);
        self.ir(result)
    }

    /// Constant starts, ends and axes, steps of 1, indices clamped as ONNX
    /// specifies; the batch dimension can only be kept whole.
    fn slice(&mut self) -> Result<ValueId, OnnxError> {
        self.attrs.allow_only(&[])?;
        self.expect_inputs(3, 5)?;
        let mut x = self.input(0)?;
        let dims = self.dims(x);
        let starts = self.constant_ints(1, "starts")?;
        let ends = self.constant_ints(2, "ends")?;
        let axes = match self.optional_input_name(3) {
            Some(_) => self.constant_ints(3, "axes")?,
            None => (0..starts.len() as i64).collect(),
        };
        if self.optional_input_name(4).is_some() {
            let steps = self.constant_ints(4, "steps")?;
            if steps.iter().any(|&step| step != 1) {
                return Err(self.attrs.invalid(format!(
                    "steps {steps:?} are not supported; only steps of 1 are"
                )));
            }
        }
        if starts.len() != ends.len() || starts.len() != axes.len() {
            return Err(self.attrs.invalid(format!(
                "starts {starts:?}, ends {ends:?} and axes {axes:?} differ in length"
            )));
        }
        self.sorted_axes(&axes, dims.len())?;
        for ((&start, &end), &axis) in starts.iter().zip(&ends).zip(&axes) {
            let axis = self.axis("axis", axis, dims.len(), false)?;
            let size = match dims[axis] {
                Dim::Fixed(size) => size as i64,
                Dim::Batch if start == 0 && end >= i64::from(i32::MAX) => continue,
                Dim::Batch => {
                    return Err(self.attrs.invalid(format!(
                        "slicing the batch dimension (axis {axis}) is not supported"
                    )));
                }
            };
            let clamp = |index: i64| {
                if index < 0 {
                    (index.saturating_add(size)).max(0)
                } else {
                    index.min(size)
                }
            };
            let (start, end) = (clamp(start), clamp(end));
            if start == 0 && end == size {
                continue;
            }
            let slice = Op::Slice {
                axis,
                start: start as usize,
                end: end.max(start) as usize,
            };
            let result = self.imp.graph.push(slice, &[x]);
            x = self.ir(result)?;
        }
        Ok(x)
    }

    /// Constant-mode padding with zeros, by constant non-negative pads.
    fn pad(&mut self) -> Result<ValueId, OnnxError> {
        self.attrs.allow_only(&["mode"])?;
        self.expect_inputs(2, 3)?;
        let mode = self
            .attrs
            .string("mode")?
            .unwrap_or_else(|| "constant".to_string());
        if mode != "constant" {
            return Err(self
                .attrs
                .unsupported("mode", mode, "only constant padding is supported"));
        }
        let mut x = self.input(0)?;
        let dims = self.dims(x);
        let rank = dims.len();
        let pads = self.constant_ints_up_to(1, "pads", 2 * self.imp.limits.max_rank)?;
        if pads.len() != 2 * rank {
            return Err(self.attrs.invalid(format!(
                "pads {pads:?} must hold two entries per axis of a rank-{rank} input"
            )));
        }
        if let Some(name) = self.optional_input_name(2) {
            let value = self.imp.constant(name, self.describe())?;
            let zero = match value.map(|data| &data.buffer) {
                Some(Buffer::F32(v)) => v.iter().all(|&x| x == 0.0),
                Some(Buffer::I64(v)) => v.iter().all(|&x| x == 0),
                Some(Buffer::I32(v)) => v.iter().all(|&x| x == 0),
                Some(Buffer::Bool(v)) => v.iter().all(|&x| !x),
                None => false,
            };
            if !zero {
                return Err(self.attrs.invalid(format!(
                    "constant_value `{name}` must be a constant zero; canopy pads with zeros"
                )));
            }
        }
        for (axis, dim) in dims.iter().enumerate() {
            let (before, after) = (pads[axis], pads[rank + axis]);
            if before == 0 && after == 0 {
                continue;
            }
            if before < 0 || after < 0 || *dim == Dim::Batch {
                return Err(self.attrs.invalid(format!(
                    "pads {pads:?}: axis {axis} ({dim}) can only be padded by non-negative sizes, and the batch dimension not at all"
                )));
            }
            let pad = Op::Pad {
                axis,
                before: before as usize,
                after: after as usize,
            };
            let result = self.imp.graph.push(pad, &[x]);
            x = self.ir(result)?;
        }
        Ok(x)
    }

    fn gather(&mut self) -> Result<ValueId, OnnxError> {
        self.attrs.allow_only(&["axis"])?;
        self.expect_inputs(2, 2)?;
        let (data, indices) = (self.input(0)?, self.input(1)?);
        let rank = self.imp.ty(data).rank();
        let axis = self.axis("axis", self.attrs.int("axis", 0)?, rank, false)?;
        let result = self.imp.graph.push(Op::Gather { axis }, &[data, indices]);
        self.ir(result)
    }
}

struct Window {
    stride: [usize; 2],
    padding: [usize; 2],
    dilation: [usize; 2],
}

/// The product of `dims` as one dimension: fixed when all are fixed, the
/// batch dimension when it is the only one not of size 1; `None` when it
/// would be batch times a size canopy cannot express.
pub(crate) fn dims_product(dims: &[Dim]) -> Option<Dim> {
    let batches = dims.iter().filter(|&&d| d == Dim::Batch).count();
    let fixed = dims
        .iter()
        .filter_map(|d| d.fixed())
        .try_fold(1usize, |acc, d| acc.checked_mul(d))?;
    match batches {
        0 => Some(Dim::Fixed(fixed)),
        1 if fixed == 1 => Some(Dim::Batch),
        _ => None,
    }
}

/// The size -1 stands for, given the input dims and the known target dims.
fn infer_minus_one(input: &[Dim], known: &[Dim]) -> Option<Dim> {
    let count = |dims: &[Dim]| -> Option<(usize, usize)> {
        let batches = dims.iter().filter(|&&d| d == Dim::Batch).count();
        let fixed = dims
            .iter()
            .filter_map(|d| d.fixed())
            .try_fold(1usize, |acc, d| acc.checked_mul(d))?;
        Some((batches, fixed))
    };
    let (input_batches, input_fixed) = count(input)?;
    let (known_batches, known_fixed) = count(known)?;
    if known_fixed == 0 {
        return None;
    }
    if input_batches == known_batches {
        return (input_fixed % known_fixed == 0).then(|| Dim::Fixed(input_fixed / known_fixed));
    }
    (input_batches == known_batches + 1 && input_fixed == known_fixed).then_some(Dim::Batch)
}
