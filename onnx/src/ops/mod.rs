//! One lowering per supported ONNX op, each following the ONNX operator
//! specification (opsets 13 to 21) for the attributes and defaults it
//! accepts. An attribute value canopy-ir cannot honour exactly is refused by
//! name rather than imported with different semantics.
//!
//! Each op family is a module holding its lowerings and the table `OPS`
//! that names its ops; [`FAMILIES`] gathers the tables, [`lower`] dispatches
//! through them and [`SUPPORTED_OPS`] is generated from them (`table`), so
//! there is no second list to keep in step. `ml` does the same for the
//! `ai.onnx.ml` ops. This module holds what every family shares: the node
//! being lowered and its inputs.

use canopy_ir::{Buffer, Dim, IrResult, ValueId};

use crate::attrs::Attrs;
use crate::error::OnnxError;
use crate::import::Importer;
use crate::proto::NodeProto;
use table::{Lower, OpEntry};

mod constant;
mod control;
mod conv;
mod elementwise;
mod index;
mod matmul;
pub(crate) mod ml;
mod pool;
mod reduce;
mod shape;
mod softmax;
mod table;
mod window;

/// Every default-domain op family's table: what [`lower`] dispatches on.
const FAMILIES: &[&[OpEntry<Lower>]] = &[
    elementwise::OPS,
    softmax::OPS,
    matmul::OPS,
    conv::OPS,
    pool::OPS,
    reduce::OPS,
    shape::OPS,
    index::OPS,
    constant::OPS,
    control::OPS,
];

const OP_NAMES: [&str; table::op_count(FAMILIES)] = table::sorted_names(FAMILIES);

/// The ops import supports, sorted, for documentation and error hints;
/// generated from the op families' tables, which dispatch reads too.
pub const SUPPORTED_OPS: &[&str] = &OP_NAMES;

/// One node being lowered: the importer, the node, and its attributes.
/// `ml` lowers the `ai.onnx.ml` ops with the same helpers.
pub(crate) struct Lowering<'i, 'a, 'n> {
    pub(crate) imp: &'i mut Importer<'a>,
    pub(crate) node: &'n NodeProto,
    pub(crate) attrs: Attrs<'n>,
}

/// Lowers `node` by its op's table entry and binds its outputs' names.
pub(crate) fn lower(
    imp: &mut Importer<'_>,
    node: &NodeProto,
    describe: &str,
) -> Result<(), OnnxError> {
    let attrs = Attrs { node, describe };
    let Some(op) = table::find(FAMILIES, &node.op_type) else {
        return Err(OnnxError::UnsupportedOp {
            node: describe.to_string(),
            op_type: node.op_type.clone(),
            domain: if node.domain.is_empty() {
                "ai.onnx".to_string()
            } else {
                node.domain.clone()
            },
            opset: imp.opset,
        });
    };
    let origin = format!("the output of {describe}");
    let mut lowering = Lowering { imp, node, attrs };
    match op.lower {
        Lower::Value(lower_value) => {
            let output = single_output(node, &lowering.attrs)?;
            let value = lower_value(&mut lowering)?;
            lowering.imp.define_value(output, origin, value)
        }
        Lower::Alias(lower_alias) => {
            let output = single_output(node, &lowering.attrs)?;
            let source = lower_alias(&mut lowering)?;
            lowering.imp.define_alias(output, origin, source, describe)
        }
        Lower::Constant(lower_constant) => {
            let output = single_output(node, &lowering.attrs)?;
            let data = lower_constant(&mut lowering)?;
            lowering.imp.define_constant(output, origin, data)
        }
        Lower::Values(lower_values) => {
            let values = lower_values(&mut lowering)?;
            bind_outputs(lowering.imp, node, describe, values)
        }
    }
}

/// Binds each named output of `node` to its value, in order; an empty
/// name is an output the model does not use.
fn bind_outputs(
    imp: &mut Importer<'_>,
    node: &NodeProto,
    describe: &str,
    values: Vec<ValueId>,
) -> Result<(), OnnxError> {
    if node.output.len() > values.len() {
        return Err(OnnxError::InvalidNode {
            node: describe.to_string(),
            cause: format!(
                "the node has {} outputs; it computes {}",
                node.output.len(),
                values.len()
            ),
        });
    }
    for (position, (name, value)) in node.output.iter().zip(values).enumerate() {
        if !name.is_empty() {
            imp.define_value(name, format!("output {position} of {describe}"), value)?;
        }
    }
    Ok(())
}

/// Every op but the control-flow ones has one required output; a second one (Dropout's
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
