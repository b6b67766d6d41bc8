//! Shape and layout ops: reshaping (Flatten, Reshape, Squeeze,
//! Unsqueeze), Transpose, Concat, broadcasting (Expand), Slice and Pad.

use canopy_ir::{Buffer, Dim, Op, Shape, ValueId};

use super::table::{Lower, OpEntry};
use super::{Lowering, dims_product};
use crate::error::OnnxError;

pub(super) const OPS: &[OpEntry<Lower>] = &[
    OpEntry::value("Flatten", |l| l.flatten()),
    OpEntry::value("Reshape", |l| l.reshape()),
    OpEntry::value("Squeeze", |l| l.squeeze()),
    OpEntry::value("Unsqueeze", |l| l.unsqueeze()),
    OpEntry::value("Transpose", |l| l.transpose()),
    OpEntry::value("Concat", |l| l.concat()),
    OpEntry::value("Expand", |l| l.expand()),
    OpEntry::value("Slice", |l| l.slice()),
    OpEntry::value("Pad", |l| l.pad()),
];

impl Lowering<'_, '_, '_> {
    /// [d0 · … · d(axis-1), d(axis) · … · d(rank-1)].
    fn flatten(&mut self) -> Result<ValueId, OnnxError> {
        self.attrs.allow_only(&["axis"])?;
        self.expect_inputs(1, 1)?;
        let x = self.input(0)?;
        let dims = self.dims(x);
        let axis = self.axis("axis", self.attrs.int("axis", 1)?, dims.len(), true)?;
        let (outer, inner) = dims.split_at(axis);
        let (Some(outer), Some(inner)) = (dims_product(outer), dims_product(inner)) else {
            return Err(self.attrs.invalid(format!(
                "cannot flatten {} at axis {axis}: the batch dimension would merge with other dimensions",
                Shape(dims.clone())
            )));
        };
        let result = self.imp.graph.reshape(x, vec![outer, inner]);
        self.ir(result)
    }

    fn reshape(&mut self) -> Result<ValueId, OnnxError> {
        self.attrs.allow_only(&["allowzero"])?;
        self.expect_inputs(2, 2)?;
        let x = self.input(0)?;
        let requested = self.constant_ints(1, "shape")?;
        if self.attrs.int("allowzero", 0)? != 0 && requested.contains(&0) {
            return Err(self.attrs.unsupported(
                "allowzero",
                1,
                "a 0 in the shape would mean an empty dimension, which import does not support",
            ));
        }
        let target = self.reshape_target(&self.dims(x), &requested)?;
        let result = self.imp.graph.reshape(x, target);
        self.ir(result)
    }

    /// ONNX Reshape's target: 0 copies the input dimension at that position,
    /// -1 (at most once) takes whatever the element count leaves. With a
    /// batch dimension, -1 is the batch dimension when the fixed sizes
    /// already match.
    fn reshape_target(&self, input: &[Dim], requested: &[i64]) -> Result<Vec<Dim>, OnnxError> {
        let mut target: Vec<Option<Dim>> = Vec::with_capacity(requested.len());
        for (position, &size) in requested.iter().enumerate() {
            target.push(match size {
                0 => Some(*input.get(position).ok_or_else(|| {
                    self.attrs.invalid(format!(
                        "shape entry {position} is 0 but the input has rank {}",
                        input.len()
                    ))
                })?),
                -1 => None,
                n if n > 0 => Some(Dim::Fixed(usize::try_from(n).map_err(|_| {
                    self.attrs
                        .invalid(format!("shape entry {n} does not fit in usize"))
                })?)),
                n => return Err(self.attrs.invalid(format!("shape entry {n} is invalid"))),
            });
        }
        let unknown: Vec<usize> = target
            .iter()
            .enumerate()
            .filter(|(_, d)| d.is_none())
            .map(|(i, _)| i)
            .collect();
        match unknown.as_slice() {
            [] => {}
            [position] => {
                let known: Vec<Dim> = target.iter().flatten().copied().collect();
                let inferred = infer_minus_one(input, &known).ok_or_else(|| {
                    self.attrs.invalid(format!(
                        "cannot infer -1 in shape {requested:?} for input {}",
                        Shape(input.to_vec())
                    ))
                })?;
                if let Some(slot) = target.get_mut(*position) {
                    *slot = Some(inferred);
                }
            }
            _ => {
                return Err(self
                    .attrs
                    .invalid(format!("shape {requested:?} has more than one -1")));
            }
        }
        Ok(target.into_iter().flatten().collect())
    }

    fn transpose(&mut self) -> Result<ValueId, OnnxError> {
        self.attrs.allow_only(&["perm"])?;
        self.expect_inputs(1, 1)?;
        let x = self.input(0)?;
        let rank = self.imp.ty(x).rank();
        let perm: Vec<usize> = match self.attrs.ints("perm")? {
            None => (0..rank).rev().collect(),
            Some(perm) => {
                let as_usize: Option<Vec<usize>> =
                    perm.iter().map(|&p| usize::try_from(p).ok()).collect();
                let is_permutation = as_usize.as_ref().is_some_and(|p| {
                    let mut sorted = p.clone();
                    sorted.sort_unstable();
                    sorted.iter().copied().eq(0..rank)
                });
                match as_usize {
                    Some(p) if is_permutation => p,
                    _ => {
                        return Err(self
                            .attrs
                            .invalid(format!("perm {perm:?} is not a permutation of 0..{rank}")));
                    }
                }
            }
        };
        let result = self.imp.graph.transpose(x, perm);
        self.ir(result)
    }

    fn concat(&mut self) -> Result<ValueId, OnnxError> {
        self.attrs.allow_only(&["axis"])?;
        self.expect_inputs(1, self.imp.limits.max_node_arity)?;
        let mut values = Vec::with_capacity(self.node.input.len());
        for position in 0..self.node.input.len() {
            values.push(self.input(position)?);
        }
        let rank = values.first().map_or(0, |&v| self.imp.ty(v).rank());
        let axis = self.axis("axis", self.attrs.required_int("axis")?, rank, false)?;
        let result = self.imp.graph.push(canopy_ir::Op::Concat { axis }, &values);
        self.ir(result)
    }

    /// Opset 13+: axes is an optional input; without it every size-1
    /// dimension goes.
    fn squeeze(&mut self) -> Result<ValueId, OnnxError> {
        self.attrs.allow_only(&[])?;
        self.expect_inputs(1, 2)?;
        let x = self.input(0)?;
        let dims = self.dims(x);
        let axes: Vec<usize> = match self.optional_input_name(1) {
            None => (0..dims.len())
                .filter(|&i| dims.get(i) == Some(&Dim::Fixed(1)))
                .collect(),
            Some(_) => {
                let raw = self.constant_ints(1, "axes")?;
                let mut axes = Vec::with_capacity(raw.len());
                for axis in raw {
                    let axis = self.axis("axis", axis, dims.len(), false)?;
                    if dims.get(axis) != Some(&Dim::Fixed(1)) {
                        return Err(self.attrs.invalid(format!(
                            "axis {axis} of {} does not have size 1",
                            Shape(dims.clone())
                        )));
                    }
                    axes.push(axis);
                }
                axes
            }
        };
        let kept: Vec<Dim> = dims
            .iter()
            .enumerate()
            .filter(|(i, _)| !axes.contains(i))
            .map(|(_, d)| *d)
            .collect();
        let result = self.imp.graph.reshape(x, kept);
        self.ir(result)
    }

    /// Opset 13+: axes is a required input, indexing the output's rank.
    fn unsqueeze(&mut self) -> Result<ValueId, OnnxError> {
        self.attrs.allow_only(&[])?;
        self.expect_inputs(2, 2)?;
        let x = self.input(0)?;
        let dims = self.dims(x);
        let raw = self.constant_ints(1, "axes")?;
        let out_rank = dims.len() + raw.len();
        if out_rank > self.imp.limits.max_rank {
            return Err(self.attrs.invalid(format!(
                "the output rank {out_rank} exceeds the limit of {}",
                self.imp.limits.max_rank
            )));
        }
        let mut axes = Vec::with_capacity(raw.len());
        for axis in raw {
            let axis = self.axis("axis", axis, out_rank, false)?;
            if axes.contains(&axis) {
                return Err(self.attrs.invalid(format!("axis {axis} is given twice")));
            }
            axes.push(axis);
        }
        let mut remaining = dims.iter();
        let target: Vec<Dim> = (0..out_rank)
            .filter_map(|i| {
                if axes.contains(&i) {
                    Some(Dim::Fixed(1))
                } else {
                    remaining.next().copied()
                }
            })
            .collect();
        let result = self.imp.graph.reshape(x, target);
        self.ir(result)
    }

    /// Bidirectional broadcasting against a constant shape; a 1 facing the
    /// batch dimension keeps it.
    fn expand(&mut self) -> Result<ValueId, OnnxError> {
        self.attrs.allow_only(&[])?;
        self.expect_inputs(2, 2)?;
        let x = self.input(0)?;
        let requested = self.constant_ints(1, "shape")?;
        let dims = self.dims(x);
        let rank = dims.len().max(requested.len());
        let mut target = Vec::with_capacity(rank);
        for axis in 0..rank {
            let have = (axis + dims.len()).checked_sub(rank).map(|i| dims[i]);
            let want = (axis + requested.len())
                .checked_sub(rank)
                .map(|i| requested[i]);
            let dim = match (have, want) {
                (Some(dim), None | Some(1)) => dim,
                (None | Some(Dim::Fixed(1)), Some(n)) if n > 0 => Dim::Fixed(n as usize),
                (Some(Dim::Fixed(size)), Some(n)) if size as i64 == n => Dim::Fixed(size),
                _ => {
                    return Err(self.attrs.invalid(format!(
                        "cannot broadcast {} to shape {requested:?}",
                        Shape(dims.clone())
                    )));
                }
            };
            target.push(dim);
        }
        let result = self.imp.graph.broadcast(x, target);
        self.ir(result)
    }

    /// Constant starts, ends and axes, steps of 1, indices clamped as ONNX
    /// specifies; the batch dimension can only be kept whole.
    fn slice(&mut self) -> Result<ValueId, OnnxError> {
        self.attrs.allow_only(&[])?;
        self.expect_inputs(3, 5)?;
        let mut x = self.input(0)?;
        let dims = self.dims(x);
        let starts = self.constant_ints(1, "starts")?;
        let ends = self.constant_ints(2, "ends")?;
        let axes = match self.optional_input_name(3) {
            Some(_) => self.constant_ints(3, "axes")?,
            None => (0..starts.len() as i64).collect(),
        };
        if self.optional_input_name(4).is_some() {
            let steps = self.constant_ints(4, "steps")?;
            if steps.iter().any(|&step| step != 1) {
                return Err(self.attrs.invalid(format!(
                    "steps {steps:?} are not supported; only steps of 1 are"
                )));
            }
        }
        if starts.len() != ends.len() || starts.len() != axes.len() {
            return Err(self.attrs.invalid(format!(
                "starts {starts:?}, ends {ends:?} and axes {axes:?} differ in length"
            )));
        }
        self.sorted_axes(&axes, dims.len())?;
        for ((&start, &end), &axis) in starts.iter().zip(&ends).zip(&axes) {
            let axis = self.axis("axis", axis, dims.len(), false)?;
            let size = match dims[axis] {
                Dim::Fixed(size) => size as i64,
                Dim::Batch if start == 0 && end >= i64::from(i32::MAX) => continue,
                Dim::Batch => {
                    return Err(self.attrs.invalid(format!(
                        "slicing the batch dimension (axis {axis}) is not supported"
                    )));
                }
            };
            let clamp = |index: i64| {
                if index < 0 {
                    (index.saturating_add(size)).max(0)
                } else {
                    index.min(size)
                }
            };
            let (start, end) = (clamp(start), clamp(end));
            if start == 0 && end == size {
                continue;
            }
            let slice = Op::Slice {
                axis,
                start: start as usize,
                end: end.max(start) as usize,
            };
            let result = self.imp.graph.push(slice, &[x]);
            x = self.ir(result)?;
        }
        Ok(x)
    }

    /// Constant-mode padding with zeros, by constant non-negative pads.
    fn pad(&mut self) -> Result<ValueId, OnnxError> {
        self.attrs.allow_only(&["mode"])?;
        self.expect_inputs(2, 3)?;
        let mode = self
            .attrs
            .string("mode")?
            .unwrap_or_else(|| "constant".to_string());
        if mode != "constant" {
            return Err(self
                .attrs
                .unsupported("mode", mode, "only constant padding is supported"));
        }
        let mut x = self.input(0)?;
        let dims = self.dims(x);
        let rank = dims.len();
        let pads = self.constant_ints_up_to(1, "pads", 2 * self.imp.limits.max_rank)?;
        if pads.len() != 2 * rank {
            return Err(self.attrs.invalid(format!(
                "pads {pads:?} must hold two entries per axis of a rank-{rank} input"
            )));
        }
        if let Some(name) = self.optional_input_name(2) {
            let value = self.imp.constant(name, self.describe())?;
            let zero = match value.map(|data| &data.buffer) {
                Some(Buffer::F32(v)) => v.iter().all(|&x| x == 0.0),
                Some(Buffer::I64(v)) => v.iter().all(|&x| x == 0),
                Some(Buffer::I32(v)) => v.iter().all(|&x| x == 0),
                Some(Buffer::Bool(v)) => v.iter().all(|&x| !x),
                None => false,
            };
            if !zero {
                return Err(self.attrs.invalid(format!(
                    "constant_value `{name}` must be a constant zero; canopy pads with zeros"
                )));
            }
        }
        for (axis, dim) in dims.iter().enumerate() {
            let (before, after) = (pads[axis], pads[rank + axis]);
            if before == 0 && after == 0 {
                continue;
            }
            if before < 0 || after < 0 || *dim == Dim::Batch {
                return Err(self.attrs.invalid(format!(
                    "pads {pads:?}: axis {axis} ({dim}) can only be padded by non-negative sizes, and the batch dimension not at all"
                )));
            }
            let pad = Op::Pad {
                axis,
                before: before as usize,
                after: after as usize,
            };
            let result = self.imp.graph.push(pad, &[x]);
            x = self.ir(result)?;
        }
        Ok(x)
    }
}

/// The size -1 stands for, given the input dims and the known target dims.
fn infer_minus_one(input: &[Dim], known: &[Dim]) -> Option<Dim> {
    let count = |dims: &[Dim]| -> Option<(usize, usize)> {
        let batches = dims.iter().filter(|&&d| d == Dim::Batch).count();
        let fixed = dims
            .iter()
            .filter_map(|d| d.fixed())
            .try_fold(1usize, |acc, d| acc.checked_mul(d))?;
        Some((batches, fixed))
    };
    let (input_batches, input_fixed) = count(input)?;
    let (known_batches, known_fixed) = count(known)?;
    if known_fixed == 0 {
        return None;
    }
    if input_batches == known_batches {
        return (input_fixed % known_fixed == 0).then(|| Dim::Fixed(input_fixed / known_fixed));
    }
    (input_batches == known_batches + 1 && input_fixed == known_fixed).then_some(Dim::Batch)
}
