//! Matrix products: Gemm and MatMul.

use canopy_ir::ValueId;

use super::Lowering;
use super::table::{Lower, OpEntry};
use crate::error::OnnxError;

pub(super) const OPS: &[OpEntry<Lower>] = &[
    OpEntry::value("Gemm", |l| l.gemm()),
    OpEntry::value("MatMul", |l| l.matmul()),
];

impl Lowering<'_, '_, '_> {
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
}
