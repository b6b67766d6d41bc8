//! The `ai.onnx.ml` ops scikit-learn's ONNX exporter (skl2onnx) writes for
//! linear models and MLPs, lowered to canopy-ir. Each follows the ONNX-ML
//! operator specification and, where the specification leaves a choice
//! open (labels from raw scores, a zero norm, `multi_class`), ONNX
//! Runtime's kernel, which is what exported models are checked against.
//! Every op here has had one version since ml opset 1, unchanged up to
//! opset 5, so opsets 1 to 5 import alike.
//!
//! canopy-ir has tensors only, so ZipMap (a sequence of class → probability
//! maps) imports as its input, the `[batch, classes]` probability tensor
//! whose column `j` is the probability of class `classlabels_int64s[j]`.
//!
//! LinearClassifier holds its weights as attributes; they become the
//! tensors `NODE.coefficients` and `NODE.intercepts`, read like
//! initializers (trainable parameters with
//! [`ImportOptions::parameters`](crate::ImportOptions)), and the
//! probabilities are computed from them by differentiable ops, so an
//! imported scikit-learn model can be fine-tuned.

use canopy_ir::{BinaryOp, Buffer, DType, Dim, Op, ReduceKind, TensorData, UnaryOp, ValueId};

use super::table::{self, OpEntry};
use super::{Lowering, dims_product};
use crate::attrs::Attrs;
use crate::error::OnnxError;
use crate::import::Importer;
use crate::proto::NodeProto;

/// The ONNX-ML domain.
pub const ML_DOMAIN: &str = "ai.onnx.ml";
/// The `ai.onnx.ml` opsets import supports: every op below is unchanged
/// from 1 (what skl2onnx 1.20 writes) to 5 (the newest in ONNX 1.23).
pub const ML_MIN_OPSET: i64 = 1;
pub const ML_MAX_OPSET: i64 = 5;

/// The `ai.onnx.ml` ops, each with its lowering: what [`lower`]
/// dispatches on and [`SUPPORTED_ML_OPS`] lists.
const OPS: &[OpEntry<MlLower>] = &[
    OpEntry::outputs("LinearClassifier", |l| l.linear_classifier()),
    OpEntry::outputs("ZipMap", |l| l.zip_map()),
    OpEntry::one_output("Normalizer", |l| l.normalizer()),
    OpEntry::one_output("Scaler", |l| l.scaler()),
    OpEntry::one_output("ArrayFeatureExtractor", |l| l.array_feature_extractor()),
];

const ML_FAMILIES: &[&[OpEntry<MlLower>]] = &[OPS];

const ML_OP_NAMES: [&str; table::op_count(ML_FAMILIES)] = table::sorted_names(ML_FAMILIES);

/// The `ai.onnx.ml` ops import supports, sorted, for documentation and
/// hints; generated from the table dispatch reads.
pub const SUPPORTED_ML_OPS: &[&str] = &ML_OP_NAMES;

/// What an ml op's lowering does with the node's outputs.
#[derive(Clone, Copy)]
enum MlLower {
    /// Binds the outputs it computes itself (an op with several).
    Outputs(fn(&mut MlLowering<'_, '_, '_>) -> Result<(), OnnxError>),
    /// Computes the value of the op's single output.
    Value(fn(&mut MlLowering<'_, '_, '_>) -> Result<ValueId, OnnxError>),
}

impl OpEntry<MlLower> {
    const fn outputs(
        name: &'static str,
        lower: fn(&mut MlLowering<'_, '_, '_>) -> Result<(), OnnxError>,
    ) -> Self {
        OpEntry {
            name,
            lower: MlLower::Outputs(lower),
        }
    }

    const fn one_output(
        name: &'static str,
        lower: fn(&mut MlLowering<'_, '_, '_>) -> Result<ValueId, OnnxError>,
    ) -> Self {
        OpEntry {
            name,
            lower: MlLower::Value(lower),
        }
    }
}

const STRING_LABELS: &str = "canopy tensors hold numbers only, so string class labels cannot be imported; hint: encode the classes as integers before training (sklearn.preprocessing.LabelEncoder) and export again";

/// ONNX Runtime's SOFTMAX_ZERO leaves scores within this of zero out of
/// the normalisation (its `ComputeSoftmaxZero`).
const SOFTMAX_ZERO_EPSILON: f32 = 1e-7;

/// Lowers the `ai.onnx.ml` node `node`, read under ml opset `opset`, and
/// binds its outputs.
pub(crate) fn lower(
    imp: &mut Importer<'_>,
    node: &NodeProto,
    describe: &str,
    opset: i64,
) -> Result<(), OnnxError> {
    let attrs = Attrs { node, describe };
    let mut lowering = MlLowering {
        base: Lowering { imp, node, attrs },
    };
    let Some(op) = table::find(ML_FAMILIES, &node.op_type) else {
        return Err(OnnxError::UnsupportedOp {
            node: describe.to_string(),
            op_type: node.op_type.clone(),
            domain: ML_DOMAIN.to_string(),
            opset,
        });
    };
    match op.lower {
        MlLower::Outputs(lower_outputs) => lower_outputs(&mut lowering),
        MlLower::Value(lower_value) => {
            let output = lowering.single_output()?;
            let value = lower_value(&mut lowering)?;
            lowering.bind_output(Some(output), value)
        }
    }
}

/// LinearClassifier's `post_transform`, applied to the raw scores.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PostTransform {
    None,
    Logistic,
    Softmax,
    SoftmaxZero,
}

/// One ml node being lowered, with the default-domain lowering's helpers
/// (inputs, attributes, IR errors) in `base`; a separate type, so the two
/// sets of methods cannot clash.
struct MlLowering<'i, 'a, 'n> {
    base: Lowering<'i, 'a, 'n>,
}

impl<'n> MlLowering<'_, '_, 'n> {
    // ---- outputs and inputs ------------------------------------------------

    /// The node's first `COUNT` output names (`None` where absent); a named
    /// output past them is refused, since import does not compute it.
    fn ml_outputs<const COUNT: usize>(&self) -> Result<[Option<&'n str>; COUNT], OnnxError> {
        if self.base.node.output.is_empty() {
            return Err(self.base.attrs.invalid("the node has no output"));
        }
        if let Some((position, extra)) = self
            .base
            .node
            .output
            .iter()
            .enumerate()
            .skip(COUNT)
            .find(|(_, name)| !name.is_empty())
        {
            return Err(self.base.attrs.invalid(format!(
                "output {position} (`{extra}`) is not one the op defines; it has {COUNT}"
            )));
        }
        Ok(std::array::from_fn(|position| {
            self.base
                .node
                .output
                .get(position)
                .map(String::as_str)
                .filter(|name| !name.is_empty())
        }))
    }

    /// The name of the op's one output, which must be present.
    fn single_output(&self) -> Result<&'n str, OnnxError> {
        let [output] = self.ml_outputs::<1>()?;
        output.ok_or_else(|| self.base.attrs.invalid("output 0 is missing"))
    }

    /// String class labels cannot be imported ([`STRING_LABELS`]).
    fn refuse_string_labels(&self) -> Result<(), OnnxError> {
        if self.base.attrs.has("classlabels_strings") {
            return Err(self.base.attrs.unsupported(
                "classlabels_strings",
                "(strings)",
                STRING_LABELS,
            ));
        }
        Ok(())
    }

    fn bind_output(&mut self, name: Option<&str>, value: ValueId) -> Result<(), OnnxError> {
        let Some(name) = name else {
            return Ok(());
        };
        let origin = format!("the output of {}", self.base.describe());
        self.base.imp.define_value(name, origin, value)
    }

    /// Input `position` as f32. The ml ops compute in float and read
    /// integer inputs converted, as ONNX Runtime's kernels do.
    fn float_input(&mut self, position: usize) -> Result<ValueId, OnnxError> {
        let x = self.base.input(position)?;
        match self.base.imp.ty(x).dtype {
            DType::F32 => Ok(x),
            DType::I64 | DType::I32 => {
                let converted = self.base.imp.graph.cast(x, DType::F32);
                self.base.ir(converted)
            }
            DType::Bool => Err(self.base.attrs.invalid(format!(
                "input {position} is bool; the op reads float, int64 or int32"
            ))),
        }
    }

    /// `value`'s rank, which must be one of `ranks`.
    fn expect_rank(&self, value: ValueId, role: &str, ranks: &[usize]) -> Result<usize, OnnxError> {
        let ty = self.base.imp.ty(value);
        if !ranks.contains(&ty.rank()) {
            return Err(self
                .base
                .attrs
                .invalid(format!("{role} must have rank {ranks:?}, got {ty}")));
        }
        Ok(ty.rank())
    }

    /// The fixed size of `value`'s last axis (its features or classes).
    fn last_size(&self, value: ValueId, role: &str) -> Result<usize, OnnxError> {
        let ty = self.base.imp.ty(value);
        match ty.shape.0.last() {
            Some(Dim::Fixed(size)) => Ok(*size),
            _ => Err(self
                .base
                .attrs
                .invalid(format!("{role} {ty} must have a fixed last dimension"))),
        }
    }

    fn f32_constant(&mut self, values: &[f32]) -> Result<ValueId, OnnxError> {
        let data = TensorData::f32(vec![values.len()], values.to_vec())
            .ok_or_else(|| self.base.attrs.invalid("a constant does not form a vector"))?;
        let constant = self.base.imp.graph.constant(data);
        self.base.ir(constant)
    }

    fn scalar(&mut self, value: f32) -> Result<ValueId, OnnxError> {
        let scalar = self.base.imp.graph.scalar(value);
        self.base.ir(scalar)
    }

    fn apply_binary(&mut self, op: BinaryOp, a: ValueId, b: ValueId) -> Result<ValueId, OnnxError> {
        let result = self.base.imp.graph.binary(op, a, b);
        self.base.ir(result)
    }

    fn apply_unary(&mut self, op: UnaryOp, x: ValueId) -> Result<ValueId, OnnxError> {
        let result = self.base.imp.graph.unary(op, x);
        self.base.ir(result)
    }

    fn reduce_last(&mut self, kind: ReduceKind, x: ValueId) -> Result<ValueId, OnnxError> {
        let last = self.base.imp.ty(x).rank().saturating_sub(1);
        let result = self.base.imp.graph.reduce(kind, x, &[last], true);
        self.base.ir(result)
    }

    // ---- LinearClassifier --------------------------------------------------

    /// Scores `X·Wᵀ + b` ([batch, classes]); the label is the class of the
    /// largest raw score (the first on ties), the probabilities are the
    /// scores after `post_transform`.
    fn linear_classifier(&mut self) -> Result<(), OnnxError> {
        self.base.attrs.allow_only(&[
            "classlabels_ints",
            "classlabels_strings",
            "coefficients",
            "intercepts",
            "multi_class",
            "post_transform",
        ])?;
        self.base.expect_inputs(1, 1)?;
        let [label_name, scores_name] = self.ml_outputs::<2>()?;
        self.refuse_string_labels()?;
        let labels = self.required_ints("classlabels_ints")?;
        let intercepts = self.required_floats("intercepts")?;
        let classes = intercepts.len();
        if classes < 2 {
            return Err(self.base.attrs.unsupported(
                "intercepts",
                intercepts,
                "one score column (ONNX Runtime then derives a second class from its sign) is not supported; skl2onnx writes two columns for a binary classifier",
            ));
        }
        if labels.len() != classes {
            return Err(self.base.attrs.invalid(format!(
                "classlabels_ints has {} labels but intercepts {classes} classes",
                labels.len()
            )));
        }
        // ONNX Runtime computes the same for one-vs-rest (0) and
        // multinomial (1): post_transform carries the difference.
        let multi_class = self.base.attrs.int("multi_class", 0)?;
        if !matches!(multi_class, 0 | 1) {
            return Err(self.base.attrs.invalid(format!(
                "multi_class {multi_class} must be 0 (one-vs-rest) or 1 (multinomial)"
            )));
        }
        let transform = self.post_transform()?;
        let x = self.float_input(0)?;
        self.expect_rank(x, "X", &[2])?;
        let features = self.last_size(x, "X")?;
        let scores = self.linear_scores(x, features, intercepts)?;
        if label_name.is_some() {
            let label = self.class_labels(scores, labels)?;
            self.bind_output(label_name, label)?;
        }
        if scores_name.is_some() {
            let probabilities = self.apply_post_transform(scores, transform)?;
            self.bind_output(scores_name, probabilities)?;
        }
        Ok(())
    }

    fn required_ints(&self, name: &str) -> Result<&'n [i64], OnnxError> {
        self.base.attrs.ints(name)?.ok_or_else(|| {
            self.base
                .attrs
                .invalid(format!("required attribute `{name}` is missing"))
        })
    }

    fn required_floats(&self, name: &str) -> Result<&'n [f32], OnnxError> {
        self.base.attrs.floats(name)?.ok_or_else(|| {
            self.base
                .attrs
                .invalid(format!("required attribute `{name}` is missing"))
        })
    }

    /// `x·Wᵀ + b` with W [classes, features] and b [classes] made graph
    /// values named after the node.
    fn linear_scores(
        &mut self,
        x: ValueId,
        features: usize,
        intercepts: &[f32],
    ) -> Result<ValueId, OnnxError> {
        let classes = intercepts.len();
        let coefficients = self.required_floats("coefficients")?;
        if Some(coefficients.len()) != classes.checked_mul(features) {
            return Err(self.base.attrs.invalid(format!(
                "coefficients has {} values; {classes} classes × {features} features need {}",
                coefficients.len(),
                classes.saturating_mul(features)
            )));
        }
        let base = self.tensor_base_name()?;
        let weights = TensorData::f32(vec![classes, features], coefficients.to_vec())
            .ok_or_else(|| self.base.attrs.invalid("coefficients do not form a matrix"))?;
        let biases = TensorData::f32(vec![classes], intercepts.to_vec())
            .ok_or_else(|| self.base.attrs.invalid("intercepts do not form a vector"))?;
        let describe = self.base.attrs.describe;
        let w =
            self.base
                .imp
                .attribute_tensor(&format!("{base}.coefficients"), weights, describe)?;
        let b = self
            .base
            .imp
            .attribute_tensor(&format!("{base}.intercepts"), biases, describe)?;
        let product = self.base.imp.graph.matmul_t(x, w, false, true);
        let product = self.base.ir(product)?;
        self.apply_binary(BinaryOp::Add, product, b)
    }

    /// What the attribute tensors are named after: the node's name, or its
    /// first named output when it has none.
    fn tensor_base_name(&self) -> Result<&'n str, OnnxError> {
        std::iter::once(&self.base.node.name)
            .chain(&self.base.node.output)
            .map(String::as_str)
            .find(|name| !name.is_empty())
            .ok_or_else(|| {
                self.base
                    .attrs
                    .invalid("the node has neither a name nor a named output")
            })
    }

    /// The label of each row's largest score: the argmax itself when the
    /// labels are 0..classes, else the label at that position.
    fn class_labels(&mut self, scores: ValueId, labels: &[i64]) -> Result<ValueId, OnnxError> {
        let index = self.base.imp.graph.argmax(scores, 1, false);
        let index = self.base.ir(index)?;
        if labels.iter().copied().eq(0..labels.len() as i64) {
            return Ok(index);
        }
        let table =
            TensorData::new(vec![labels.len()], Buffer::I64(labels.to_vec())).ok_or_else(|| {
                self.base
                    .attrs
                    .invalid("classlabels_ints does not form a vector")
            })?;
        let table = self.base.imp.graph.constant(table);
        let table = self.base.ir(table)?;
        let picked = self
            .base
            .imp
            .graph
            .push(Op::Gather { axis: 0 }, &[table, index]);
        self.base.ir(picked)
    }

    fn post_transform(&self) -> Result<PostTransform, OnnxError> {
        let name = self.base.attrs.string("post_transform")?;
        match name.as_deref().unwrap_or("NONE") {
            "NONE" => Ok(PostTransform::None),
            "LOGISTIC" => Ok(PostTransform::Logistic),
            "SOFTMAX" => Ok(PostTransform::Softmax),
            "SOFTMAX_ZERO" => Ok(PostTransform::SoftmaxZero),
            "PROBIT" => Err(self.base.attrs.unsupported(
                "post_transform",
                "PROBIT",
                "ONNX Runtime computes it with an approximate inverse error function canopy-ir does not have",
            )),
            other => Err(self.base.attrs.invalid(format!(
                "post_transform `{other}` is not NONE, LOGISTIC, SOFTMAX, SOFTMAX_ZERO or PROBIT"
            ))),
        }
    }

    fn apply_post_transform(
        &mut self,
        scores: ValueId,
        transform: PostTransform,
    ) -> Result<ValueId, OnnxError> {
        match transform {
            PostTransform::None => Ok(scores),
            PostTransform::Logistic => self.apply_unary(UnaryOp::Sigmoid, scores),
            PostTransform::Softmax => {
                let probabilities = self.base.imp.graph.softmax(scores, 1);
                self.base.ir(probabilities)
            }
            PostTransform::SoftmaxZero => self.softmax_zero(scores),
        }
    }

    /// ONNX Runtime's SOFTMAX_ZERO: a softmax over the scores farther than
    /// 1e-7 from zero; a score within it becomes `s·exp(-max)`, counted
    /// out of the sum (so exactly 0 stays 0).
    fn softmax_zero(&mut self, scores: ValueId) -> Result<ValueId, OnnxError> {
        let max = self.reduce_last(ReduceKind::Max, scores)?;
        let magnitude = self.apply_unary(UnaryOp::Abs, scores)?;
        let epsilon = self.scalar(SOFTMAX_ZERO_EPSILON)?;
        let counted = self.apply_binary(BinaryOp::Gt, magnitude, epsilon)?;
        let shifted = self.apply_binary(BinaryOp::Sub, scores, max)?;
        let exponentials = self.apply_unary(UnaryOp::Exp, shifted)?;
        let negated_max = self.apply_unary(UnaryOp::Neg, max)?;
        let scale = self.apply_unary(UnaryOp::Exp, negated_max)?;
        let near_zero = self.apply_binary(BinaryOp::Mul, scores, scale)?;
        let zero = self.scalar(0.0)?;
        let numerators = self.base.imp.graph.select(counted, exponentials, near_zero);
        let numerators = self.base.ir(numerators)?;
        let summed = self.base.imp.graph.select(counted, exponentials, zero);
        let summed = self.base.ir(summed)?;
        let total = self.reduce_last(ReduceKind::Sum, summed)?;
        self.apply_binary(BinaryOp::Div, numerators, total)
    }

    // ---- Normalizer, Scaler ------------------------------------------------

    /// Each row divided by its MAX (largest value), L1 or L2 norm; a row
    /// whose norm is 0 is left as it is (ONNX Runtime's rule). L1 of a
    /// softmax over the rows, which skl2onnx writes after every multinomial
    /// LinearClassifier, is the identity (to rounding, as ONNX Runtime's
    /// own division is): it is left out, so the graph's probabilities are
    /// the softmax, whose input a trainer reads as the logits.
    fn normalizer(&mut self) -> Result<ValueId, OnnxError> {
        self.base.attrs.allow_only(&["norm"])?;
        self.base.expect_inputs(1, 1)?;
        let norm = self
            .base
            .attrs
            .string("norm")?
            .unwrap_or_else(|| "MAX".to_string());
        let x = self.float_input(0)?;
        let rank = self.expect_rank(x, "X", &[1, 2])?;
        if norm == "L1" && self.base.imp.graph.node(x).op == (Op::Softmax { axis: rank - 1 }) {
            return Ok(x);
        }
        let divisor = match norm.as_str() {
            "MAX" => self.reduce_last(ReduceKind::Max, x)?,
            "L1" => {
                let magnitude = self.apply_unary(UnaryOp::Abs, x)?;
                self.reduce_last(ReduceKind::Sum, magnitude)?
            }
            "L2" => {
                let squares = self.apply_unary(UnaryOp::Square, x)?;
                let total = self.reduce_last(ReduceKind::Sum, squares)?;
                self.apply_unary(UnaryOp::Sqrt, total)?
            }
            other => {
                return Err(self
                    .base
                    .attrs
                    .invalid(format!("norm `{other}` is not MAX, L1 or L2")));
            }
        };
        let zero = self.scalar(0.0)?;
        let one = self.scalar(1.0)?;
        let is_zero = self.apply_binary(BinaryOp::Eq, divisor, zero)?;
        let safe = self.base.imp.graph.select(is_zero, one, divisor);
        let safe = self.base.ir(safe)?;
        self.apply_binary(BinaryOp::Div, x, safe)
    }

    /// `(X - offset) · scale`, per feature or with one value for all.
    /// They are preprocessing constants, never trainable parameters.
    fn scaler(&mut self) -> Result<ValueId, OnnxError> {
        self.base.attrs.allow_only(&["offset", "scale"])?;
        self.base.expect_inputs(1, 1)?;
        let scale = self.required_floats("scale")?;
        let offset = self.base.attrs.floats("offset")?.unwrap_or_default();
        let x = self.float_input(0)?;
        self.expect_rank(x, "X", &[1, 2])?;
        let features = self.last_size(x, "X")?;
        let valid = |values: &[f32]| values.len() == 1 || values.len() == features;
        if scale.len() != offset.len() || !valid(scale) {
            return Err(self.base.attrs.invalid(format!(
                "scale ({}) and offset ({}) must both have one value per feature ({features}) or one value",
                scale.len(),
                offset.len()
            )));
        }
        let offset = self.f32_constant(offset)?;
        let scale = self.f32_constant(scale)?;
        let centred = self.apply_binary(BinaryOp::Sub, x, offset)?;
        self.apply_binary(BinaryOp::Mul, centred, scale)
    }

    // ---- ArrayFeatureExtractor, ZipMap -------------------------------------

    /// The elements of X's last axis at the int64 indices Y (flattened):
    /// X.shape[..-1] ++ [count], or [1, count] for a 1-D X (ONNX Runtime's
    /// shape). Constant indices are range-checked here, computed ones when
    /// the graph runs.
    fn array_feature_extractor(&mut self) -> Result<ValueId, OnnxError> {
        self.base.attrs.allow_only(&[])?;
        self.base.expect_inputs(2, 2)?;
        let x = self.base.input(0)?;
        let rank = self.base.imp.ty(x).rank();
        if rank == 0 {
            return Err(self
                .base
                .attrs
                .invalid("X must have at least one dimension"));
        }
        self.check_constant_indices(x)?;
        let indices = self.base.input(1)?;
        let index_type = self.base.imp.ty(indices).clone();
        if index_type.dtype != DType::I64 {
            return Err(self
                .base
                .attrs
                .invalid(format!("Y must be int64, got {index_type}")));
        }
        let count = dims_product(&index_type.shape.0).ok_or_else(|| {
            self.base.attrs.invalid(format!(
                "Y {index_type} cannot be flattened: the batch dimension would merge with other dimensions"
            ))
        })?;
        let flat = self.base.imp.graph.reshape(indices, vec![count]);
        let flat = self.base.ir(flat)?;
        let picked = self
            .base
            .imp
            .graph
            .push(Op::Gather { axis: rank - 1 }, &[x, flat]);
        let picked = self.base.ir(picked)?;
        if rank > 1 {
            return Ok(picked);
        }
        let shaped = self
            .base
            .imp
            .graph
            .reshape(picked, vec![Dim::Fixed(1), count]);
        self.base.ir(shaped)
    }

    fn check_constant_indices(&self, x: ValueId) -> Result<(), OnnxError> {
        let name = self.base.input_name(1)?;
        let Some(data) = self.base.imp.constant(name, self.base.describe())? else {
            return Ok(());
        };
        let Buffer::I64(indices) = &data.buffer else {
            return Ok(());
        };
        let size = self.base.imp.ty(x).shape.0.last().and_then(|d| d.fixed());
        let out_of_range = indices.iter().find(|&&i| {
            i < 0 || size.is_some_and(|size| usize::try_from(i).is_ok_and(|i| i >= size))
        });
        match (out_of_range, size) {
            (Some(index), Some(size)) => Err(self.base.attrs.invalid(format!(
                "index {index} in Y `{name}` is outside X's last axis of size {size}"
            ))),
            (Some(index), None) => Err(self
                .base
                .attrs
                .invalid(format!("index {index} in Y `{name}` is negative"))),
            (None, _) => Ok(()),
        }
    }

    /// The probability tensor itself (see the module documentation): the
    /// keys must name its columns.
    fn zip_map(&mut self) -> Result<(), OnnxError> {
        self.base
            .attrs
            .allow_only(&["classlabels_int64s", "classlabels_strings"])?;
        self.base.expect_inputs(1, 1)?;
        let output = self.single_output()?;
        self.refuse_string_labels()?;
        let keys = self.required_ints("classlabels_int64s")?;
        let x = self.base.input(0)?;
        let ty = self.base.imp.ty(x).clone();
        if ty.dtype != DType::F32 || ty.rank() != 2 {
            return Err(self
                .base
                .attrs
                .invalid(format!("X must be a 2-D float tensor, got {ty}")));
        }
        let columns = self.last_size(x, "X")?;
        if keys.len() != columns {
            return Err(self.base.attrs.invalid(format!(
                "classlabels_int64s has {} keys for {columns} columns",
                keys.len()
            )));
        }
        let source = self.base.input_name(0)?;
        let origin = format!("the output of {}", self.base.describe());
        self.base
            .imp
            .define_alias(output, origin, source, self.base.attrs.describe)
    }
}
