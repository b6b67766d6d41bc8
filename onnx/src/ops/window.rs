//! The 2-D window attributes convolution and pooling share: the NCHW
//! operand check, strides, symmetric pads and dilations.

use canopy_ir::ValueId;

use super::Lowering;
use crate::error::OnnxError;

impl Lowering<'_, '_, '_> {
    pub(super) fn expect_image(&self, value: ValueId, role: &str) -> Result<(), OnnxError> {
        let ty = self.imp.ty(value);
        if ty.rank() != 4 {
            return Err(self.attrs.invalid(format!(
                "{role} must be rank 4 (NCHW; only 2-D windows are supported), got {ty}"
            )));
        }
        Ok(())
    }

    /// Strides, symmetric pads and (for Conv) dilations of a 2-D window.
    pub(super) fn window(&self, dilation_allowed: bool) -> Result<Window, OnnxError> {
        let auto_pad = self
            .attrs
            .string("auto_pad")?
            .unwrap_or_else(|| "NOTSET".to_string());
        let pads = self.attrs.ints("pads")?.unwrap_or(&[0, 0, 0, 0]);
        match auto_pad.as_str() {
            "NOTSET" => {}
            "VALID" if pads.iter().all(|&p| p == 0) => {}
            "VALID" => {
                return Err(self.attrs.invalid(format!(
                    "auto_pad VALID is given together with pads {pads:?}"
                )));
            }
            other => {
                return Err(self.attrs.unsupported(
                    "auto_pad",
                    other,
                    "only NOTSET and VALID are supported; hint: export with explicit pads",
                ));
            }
        }
        let [top, left, bottom, right] = pads else {
            return Err(self.attrs.invalid(format!(
                "pads {pads:?} must have 4 entries for a 2-D window"
            )));
        };
        if top != bottom || left != right {
            return Err(self.attrs.unsupported("pads", pads, "asymmetric padding (begin != end) is not supported; canopy pads both sides equally"));
        }
        let padding = self.non_negative_pair("pads", &[*top, *left])?;
        let stride = self.pair("strides", self.attrs.ints("strides")?.unwrap_or(&[1, 1]))?;
        let dilations = self.attrs.ints("dilations")?.unwrap_or(&[1, 1]);
        let dilation = self.pair("dilations", dilations)?;
        if !dilation_allowed && dilation != [1, 1] {
            return Err(self.attrs.unsupported(
                "dilations",
                dilations,
                "dilated pooling is not supported",
            ));
        }
        Ok(Window {
            stride,
            padding,
            dilation,
        })
    }

    /// Two positive sizes.
    pub(super) fn pair(&self, name: &str, values: &[i64]) -> Result<[usize; 2], OnnxError> {
        let pair = self.non_negative_pair(name, values)?;
        if pair.contains(&0) {
            return Err(self
                .attrs
                .invalid(format!("{name} {values:?} must be positive")));
        }
        Ok(pair)
    }

    fn non_negative_pair(&self, name: &str, values: &[i64]) -> Result<[usize; 2], OnnxError> {
        let invalid = || {
            self.attrs
                .invalid(format!("{name} {values:?} must be two non-negative sizes"))
        };
        let [first, second] = values else {
            return Err(invalid());
        };
        let first = usize::try_from(*first).map_err(|_| invalid())?;
        let second = usize::try_from(*second).map_err(|_| invalid())?;
        Ok([first, second])
    }
}

/// A 2-D window's attributes, checked.
pub(super) struct Window {
    pub(super) stride: [usize; 2],
    pub(super) padding: [usize; 2],
    pub(super) dilation: [usize; 2],
}
