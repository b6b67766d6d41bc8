//! Elementwise ops: the unary and binary ones canopy-ir has as
//! `UnaryOp`/`BinaryOp`, selection (Where) and Cast.

use canopy_ir::{BinaryOp, DType, UnaryOp, ValueId};

use super::Lowering;
use super::table::{Lower, OpEntry};
use crate::decode::dtype_of;
use crate::error::OnnxError;
use crate::proto::data_type;

pub(super) const OPS: &[OpEntry<Lower>] = &[
    OpEntry::value("Abs", |l| l.unary(UnaryOp::Abs)),
    OpEntry::value("Erf", |l| l.unary(UnaryOp::Erf)),
    OpEntry::value("Exp", |l| l.unary(UnaryOp::Exp)),
    OpEntry::value("Log", |l| l.unary(UnaryOp::Log)),
    OpEntry::value("Neg", |l| l.unary(UnaryOp::Neg)),
    OpEntry::value("Not", |l| l.unary(UnaryOp::Not)),
    OpEntry::value("Reciprocal", |l| l.unary(UnaryOp::Reciprocal)),
    OpEntry::value("Relu", |l| l.unary(UnaryOp::Relu)),
    OpEntry::value("Sigmoid", |l| l.unary(UnaryOp::Sigmoid)),
    OpEntry::value("Sign", |l| l.unary(UnaryOp::Sign)),
    OpEntry::value("Softplus", |l| l.unary(UnaryOp::Softplus)),
    OpEntry::value("Sqrt", |l| l.unary(UnaryOp::Sqrt)),
    OpEntry::value("Tanh", |l| l.unary(UnaryOp::Tanh)),
    OpEntry::value("Add", |l| l.binary(BinaryOp::Add)),
    OpEntry::value("And", |l| l.binary(BinaryOp::And)),
    OpEntry::value("Div", |l| l.binary(BinaryOp::Div)),
    OpEntry::value("Equal", |l| l.binary(BinaryOp::Eq)),
    OpEntry::value("Greater", |l| l.binary(BinaryOp::Gt)),
    OpEntry::value("GreaterOrEqual", |l| l.binary(BinaryOp::Ge)),
    OpEntry::value("Less", |l| l.binary(BinaryOp::Lt)),
    OpEntry::value("LessOrEqual", |l| l.binary(BinaryOp::Le)),
    OpEntry::value("Max", |l| l.binary(BinaryOp::Maximum)),
    OpEntry::value("Min", |l| l.binary(BinaryOp::Minimum)),
    OpEntry::value("Mul", |l| l.binary(BinaryOp::Mul)),
    OpEntry::value("Or", |l| l.binary(BinaryOp::Or)),
    OpEntry::value("Pow", |l| l.binary(BinaryOp::Pow)),
    OpEntry::value("Sub", |l| l.binary(BinaryOp::Sub)),
    OpEntry::value("Where", |l| l.where_()),
    OpEntry::value("Cast", |l| l.cast()),
];

impl Lowering<'_, '_, '_> {
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

    fn where_(&mut self) -> Result<ValueId, OnnxError> {
        self.attrs.allow_only(&[])?;
        self.expect_inputs(3, 3)?;
        let (condition, a, b) = (self.input(0)?, self.input(1)?, self.input(2)?);
        let result = self.imp.graph.select(condition, a, b);
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
}
