//! Reductions: ReduceSum, ReduceMean, ReduceMax and ArgMax.

use canopy_ir::{Op, ReduceKind, ValueId};

use super::Lowering;
use super::table::{Lower, OpEntry};
use crate::error::OnnxError;

pub(super) const OPS: &[OpEntry<Lower>] = &[
    OpEntry::value("ReduceSum", |l| l.reduce(ReduceKind::Sum)),
    OpEntry::value("ReduceMean", |l| l.reduce(ReduceKind::Mean)),
    OpEntry::value("ReduceMax", |l| l.reduce(ReduceKind::Max)),
    OpEntry::value("ArgMax", |l| l.argmax()),
];

impl Lowering<'_, '_, '_> {
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
        self.attrs.allow_int_only(
            "select_last_index",
            0,
            "canopy's argmax picks the first maximum",
        )?;
        let x = self.input(0)?;
        let rank = self.imp.ty(x).rank();
        let axis = self.axis("axis", self.attrs.int("axis", 0)?, rank, false)?;
        let keep_dims = self.attrs.int("keepdims", 1)? != 0;
        let result = self.imp.graph.push(Op::ArgMax { axis, keep_dims }, &[x]);
        self.ir(result)
    }
}
