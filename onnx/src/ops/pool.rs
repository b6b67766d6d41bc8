//! 2-D pooling (MaxPool, AveragePool) and GlobalAveragePool.

use canopy_ir::{Pool2dAttrs, ValueId};

use super::Lowering;
use super::table::{Lower, OpEntry};
use crate::error::OnnxError;

pub(super) const OPS: &[OpEntry<Lower>] = &[
    OpEntry::value("MaxPool", |l| l.pool(false)),
    OpEntry::value("AveragePool", |l| l.pool(true)),
    OpEntry::value("GlobalAveragePool", |l| l.global_average_pool()),
];

impl Lowering<'_, '_, '_> {
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
        self.attrs.allow_int_only(
            "ceil_mode",
            0,
            "canopy's pooling rounds the output size down",
        )?;
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
}
