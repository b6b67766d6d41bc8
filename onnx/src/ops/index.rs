//! Indexing: Gather.

use canopy_ir::{Op, ValueId};

use super::Lowering;
use super::table::{Lower, OpEntry};
use crate::error::OnnxError;

pub(super) const OPS: &[OpEntry<Lower>] = &[OpEntry::value("Gather", |l| l.gather())];

impl Lowering<'_, '_, '_> {
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
