//! CPU kernels, one per op. `eval` is the single dispatch point.

use canopy_ir::{Op, TensorType};

use crate::value::Value;

/// A kernel argument: owned when this is the value's last use (so the
/// kernel may write into it), shared otherwise.
pub enum Arg<'a> {
    Owned(Value),
    Shared(&'a Value),
}

impl Arg<'_> {
    pub fn value(&self) -> &Value {
        match self {
            Arg::Owned(v) => v,
            Arg::Shared(v) => v,
        }
    }
}

/// Evaluates `op` on `args`. `out_ty` is the node's declared type and
/// `batch` the bound batch size; errors are plain causes.
pub fn eval(op: &Op, args: Vec<Arg<'_>>, out_ty: &TensorType, batch: usize) -> Result<Value, String> {
    let _ = (args, out_ty, batch);
    Err(format!("op `{}` has no CPU kernel yet", op.name()))
}
