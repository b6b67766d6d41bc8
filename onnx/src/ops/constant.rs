//! Ops import resolves without computing anything: Constant's value is
//! known at import time, and Identity and inference-mode Dropout make their
//! output another name for their input.

use canopy_ir::{Buffer, TensorData};

use super::Lowering;
use super::table::{Lower, OpEntry};
use crate::decode::tensor_data;
use crate::error::OnnxError;

pub(super) const OPS: &[OpEntry<Lower>] = &[
    OpEntry::constant("Constant", |l| l.constant_value()),
    OpEntry::alias("Identity", |l| l.identity()),
    OpEntry::alias("Dropout", |l| l.dropout()),
];

impl<'n> Lowering<'_, '_, 'n> {
    fn identity(&mut self) -> Result<&'n str, OnnxError> {
        self.attrs.allow_only(&[])?;
        self.expect_inputs(1, 1)?;
        self.input_name(0)
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
}
