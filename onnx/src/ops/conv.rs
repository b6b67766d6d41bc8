//! 2-D convolution (Conv), with its optional per-channel bias.

use canopy_ir::{Conv2dAttrs, Dim, Shape, ValueId};

use super::Lowering;
use super::table::{Lower, OpEntry};
use crate::error::OnnxError;

pub(super) const OPS: &[OpEntry<Lower>] = &[OpEntry::value("Conv", |l| l.conv())];

impl Lowering<'_, '_, '_> {
    /// Y = conv(X, W) + B, group 1, symmetric padding.
    fn conv(&mut self) -> Result<ValueId, OnnxError> {
        self.attrs.allow_only(&[
            "auto_pad",
            "dilations",
            "group",
            "kernel_shape",
            "pads",
            "strides",
        ])?;
        self.expect_inputs(2, 3)?;
        let (x, w) = (self.input(0)?, self.input(1)?);
        self.expect_image(x, "X")?;
        self.expect_image(w, "W")?;
        self.attrs.allow_int_only(
            "group",
            1,
            "grouped and depthwise convolution are not supported",
        )?;
        let w_dims = self.dims(w);
        let kernel: Vec<i64> = w_dims
            .iter()
            .skip(2)
            .map(|d| d.fixed().and_then(|n| i64::try_from(n).ok()).unwrap_or(-1))
            .collect();
        let declared = self.attrs.ints("kernel_shape")?;
        if declared.is_some_and(|declared| declared != kernel.as_slice()) {
            return Err(self.attrs.invalid(format!(
                "kernel_shape {declared:?} differs from W's spatial size {kernel:?}"
            )));
        }
        let window = self.window(true)?;
        let attrs = Conv2dAttrs {
            stride: window.stride,
            padding: window.padding,
            dilation: window.dilation,
        };
        let y = self.imp.graph.conv2d(x, w, attrs);
        let y = self.ir(y)?;
        match self.optional_input_name(2).map(str::to_string) {
            None => Ok(y),
            Some(bias_name) => self.add_channel_bias(y, &bias_name),
        }
    }

    /// Adds a [C] bias to an NCHW tensor, as [1, C, 1, 1].
    fn add_channel_bias(&mut self, y: ValueId, bias_name: &str) -> Result<ValueId, OnnxError> {
        let bias = self.imp.value(bias_name, self.attrs.describe)?;
        let bias_dims = self.dims(bias);
        let [channels] = bias_dims.as_slice() else {
            return Err(self.attrs.invalid(format!(
                "B `{bias_name}` must be 1-D, got {}",
                Shape(bias_dims.clone())
            )));
        };
        let shaped = self.imp.graph.reshape(
            bias,
            vec![Dim::Fixed(1), *channels, Dim::Fixed(1), Dim::Fixed(1)],
        );
        let shaped = self.ir(shaped)?;
        let sum = self.imp.graph.add(y, shaped);
        self.ir(sum)
    }
}
