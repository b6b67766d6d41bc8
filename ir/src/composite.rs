//! Ops defined by composition: argmax's builder, global average pooling,
//! layer and batch normalisation. Each normalisation is written once here
//! from primitives, so autodiff (every order), fusion and every backend
//! get it without a rule or kernel of its own; the doc comment on each
//! method is its semantics, as a variant's doc comment is in `op.rs`.
//!
//! Why not primitives: their derivatives are exactly the derivatives of
//! these compositions, and the primitives' rules are already checked
//! against finite differences; a fused primitive would be a speed choice,
//! for a backend to make by pattern, not a semantic one.

use crate::error::{IrError, IrResult};
use crate::graph::{Graph, ValueId};
use crate::op::{Op, UnaryOp};
use crate::types::Dim;

impl Graph {
    /// The index (i64) of the largest element along `axis` (see
    /// [`Op::ArgMax`]).
    pub fn argmax(&mut self, x: ValueId, axis: usize, keep_dims: bool) -> IrResult<ValueId> {
        self.push(Op::ArgMax { axis, keep_dims }, &[x])
    }

    /// Global average pooling: [N, C, H, W] → [N, C, 1, 1], the mean over
    /// H and W (ONNX `GlobalAveragePool`).
    pub fn global_avg_pool(&mut self, x: ValueId) -> IrResult<ValueId> {
        if self.ty(x).rank() != 4 {
            return Err(IrError::Invalid(format!(
                "global average pooling takes an [N, C, H, W] image, got {}",
                self.ty(x)
            )));
        }
        self.mean(x, &[2, 3], true)
    }

    /// Layer normalisation over the axes from `first_axis` on:
    /// (x − mean) / √(var + eps) · scale + bias, with mean and the biased
    /// variance over those axes; `scale` and `bias` have their shape (or
    /// broadcast to it).
    pub fn layer_norm(
        &mut self,
        x: ValueId,
        [scale, bias]: [ValueId; 2],
        first_axis: usize,
        eps: f32,
    ) -> IrResult<ValueId> {
        let rank = self.ty(x).rank();
        if first_axis >= rank {
            return Err(IrError::Invalid(format!(
                "layer norm from axis {first_axis} of {}",
                self.ty(x)
            )));
        }
        let axes: Vec<usize> = (first_axis..rank).collect();
        let (normalised, _, _) = self.standardise(x, &axes, eps)?;
        self.scale_and_shift(normalised, scale, bias)
    }

    /// Batch normalisation, inference form, channels on axis 1 of
    /// [N, C, …]: (x − mean) / √(var + eps) · scale + bias per channel, with
    /// the given running statistics; every parameter has shape [C].
    pub fn batch_norm_inference(
        &mut self,
        x: ValueId,
        [scale, bias, mean, var]: [ValueId; 4],
        eps: f32,
    ) -> IrResult<ValueId> {
        let [scale, bias, mean, var] = self.per_channel(x, [scale, bias, mean, var])?;
        let centred = self.sub(x, mean)?;
        let inv_std = self.inverse_std(var, eps)?;
        let normalised = self.mul(centred, inv_std)?;
        self.scale_and_shift(normalised, scale, bias)
    }

    /// Batch normalisation, training form: as the inference form with this
    /// batch's per-channel mean and biased variance (over every axis but
    /// 1). Returns (y, batch mean, batch variance), the statistics as [C],
    /// for the caller's running averages.
    pub fn batch_norm_training(
        &mut self,
        x: ValueId,
        [scale, bias]: [ValueId; 2],
        eps: f32,
    ) -> IrResult<(ValueId, ValueId, ValueId)> {
        let rank = self.ty(x).rank();
        let [scale, bias] = self.per_channel(x, [scale, bias])?;
        let axes: Vec<usize> = std::iter::once(0).chain(2..rank).collect();
        let (normalised, mean, var) = self.standardise(x, &axes, eps)?;
        let y = self.scale_and_shift(normalised, scale, bias)?;
        let channels = vec![self.ty(x).shape.0[1]];
        let mean = self.reshape(mean, channels.clone())?;
        let var = self.reshape(var, channels)?;
        Ok((y, mean, var))
    }

    /// (x − mean) / √(var + eps) over `axes`, with the kept-dims mean and
    /// biased variance.
    fn standardise(
        &mut self,
        x: ValueId,
        axes: &[usize],
        eps: f32,
    ) -> IrResult<(ValueId, ValueId, ValueId)> {
        let mean = self.mean(x, axes, true)?;
        let centred = self.sub(x, mean)?;
        let squared = self.unary(UnaryOp::Square, centred)?;
        let var = self.mean(squared, axes, true)?;
        let inv_std = self.inverse_std(var, eps)?;
        Ok((self.mul(centred, inv_std)?, mean, var))
    }

    fn inverse_std(&mut self, var: ValueId, eps: f32) -> IrResult<ValueId> {
        if !(eps.is_finite() && eps >= 0.0) {
            return Err(IrError::Invalid(format!(
                "normalisation epsilon {eps} must be finite and non-negative"
            )));
        }
        let eps = self.scalar(eps)?;
        let shifted = self.add(var, eps)?;
        self.unary(UnaryOp::Rsqrt, shifted)
    }

    fn scale_and_shift(&mut self, x: ValueId, scale: ValueId, bias: ValueId) -> IrResult<ValueId> {
        let scaled = self.mul(x, scale)?;
        self.add(scaled, bias)
    }

    /// Per-channel [C] parameters reshaped to [C, 1, …] so they broadcast
    /// against [N, C, …].
    fn per_channel<const K: usize>(
        &mut self,
        x: ValueId,
        params: [ValueId; K],
    ) -> IrResult<[ValueId; K]> {
        let shape = &self.ty(x).shape.0;
        if shape.len() < 2 {
            return Err(IrError::Invalid(format!(
                "batch norm takes [N, C, …], got {}",
                self.ty(x)
            )));
        }
        let mut target = vec![shape[1]];
        target.extend(std::iter::repeat_n(Dim::Fixed(1), shape.len() - 2));
        let mut out = params;
        for p in &mut out {
            if self.ty(*p).shape.0 != [target[0]] {
                return Err(IrError::Invalid(format!(
                    "a batch norm parameter must have shape [{}], got {}",
                    target[0],
                    self.ty(*p)
                )));
            }
            *p = self.reshape(*p, target.clone())?;
        }
        Ok(out)
    }
}
