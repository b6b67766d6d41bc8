//! Softmax and LogSoftmax along one axis.

use canopy_ir::ValueId;

use super::Lowering;
use super::table::{Lower, OpEntry};
use crate::error::OnnxError;

pub(super) const OPS: &[OpEntry<Lower>] = &[
    OpEntry::value("Softmax", |l| l.softmax(false)),
    OpEntry::value("LogSoftmax", |l| l.softmax(true)),
];

impl Lowering<'_, '_, '_> {
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
}
