//! Recurrent layers on `scan`: each is one loop node whatever the
//! sequence length, so its graph, its gradient (a reverse scan) and its
//! file stay the same size for 8 steps or 8,000.
//!
//! Both follow PyTorch's equations and gate order, batch first: input
//! `[N, T, F]`, output every step's hidden state `[N, T, H]`, initial
//! state zero. The input's projection for all steps is one matmul before
//! the loop; inside it, one matmul by the hidden weights per step.
//! Weights are stored `[in, 3H]` or `[in, 4H]` (gates side by side), and
//! drawn from U(±1/√H), PyTorch's default.

use canopy_ir::{DType, Dim, Op};

use crate::error::{EngineError, EngineResult};
use crate::nn::{ForwardCtx, Init, Layer, ParamSpec, Params};
use crate::tensor::{ScanOptions, Tensor, apply, scan};

/// The two recurrent cells.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cell {
    Gru,
    Lstm,
}

impl Cell {
    pub fn name(self) -> &'static str {
        match self {
            Cell::Gru => "gru",
            Cell::Lstm => "lstm",
        }
    }

    pub fn parse(text: &str) -> Option<Cell> {
        [Cell::Gru, Cell::Lstm]
            .into_iter()
            .find(|cell| cell.name() == text)
    }

    /// Gates side by side in the weights: r, z, n; or i, f, g, o.
    fn gates(self) -> usize {
        match self {
            Cell::Gru => 3,
            Cell::Lstm => 4,
        }
    }
}

/// A recurrent layer: `[N, T, F]` → `[N, T, H]`.
pub struct Recurrent {
    pub name: String,
    pub cell: Cell,
    pub inputs: usize,
    pub hidden: usize,
    /// What reverse mode saves (see `canopy_ir::Scan`): 0, every step's
    /// values; k, every k-th state.
    pub checkpoint: usize,
    /// Trace every step as nodes of its own instead of one loop: the same
    /// function, for comparing graph sizes (its graph grows with T).
    pub unrolled: bool,
}

impl Recurrent {
    pub fn new(name: &str, cell: Cell, inputs: usize, hidden: usize) -> Recurrent {
        Recurrent {
            name: name.into(),
            cell,
            inputs,
            hidden,
            checkpoint: 0,
            unrolled: false,
        }
    }

    pub fn unrolled(mut self) -> Recurrent {
        self.unrolled = true;
        self
    }

    pub fn checkpoint(mut self, every: usize) -> Recurrent {
        self.checkpoint = every;
        self
    }

    fn param(&self, part: &str) -> String {
        format!("{}.{part}", self.name)
    }
}

impl Layer for Recurrent {
    fn params(&self) -> Vec<ParamSpec> {
        let width = self.cell.gates() * self.hidden;
        let bound = 1.0 / (self.hidden as f32).sqrt();
        let spec = |part: &str, shape: Vec<usize>| ParamSpec {
            name: self.param(part),
            shape,
            init: Init::Uniform { bound },
            trainable: true,
        };
        vec![
            spec("weight_ih", vec![self.inputs, width]),
            spec("weight_hh", vec![self.hidden, width]),
            spec("bias_ih", vec![width]),
            spec("bias_hh", vec![width]),
        ]
    }

    fn forward(&self, params: &Params, x: &Tensor, _: &ForwardCtx) -> EngineResult<Tensor> {
        let dims = x.dims();
        if dims.len() != 3 || dims[2] != Dim::Fixed(self.inputs) || x.ty().dtype != DType::F32 {
            return Err(EngineError::Shape(format!(
                "{} layer `{}` takes f32 [N, T, {}], got {}",
                self.cell.name(),
                self.name,
                self.inputs,
                x.ty()
            )));
        }
        let steps = x.transpose(vec![1, 0, 2])?;
        let projected = steps
            .matmul(params.get(&self.param("weight_ih"))?)?
            .add(params.get(&self.param("bias_ih"))?)?;
        let zeros = Tensor::scalar(0.0).broadcast_to(vec![dims[0], Dim::Fixed(self.hidden)])?;
        let carries = match self.cell {
            Cell::Gru => vec![zeros],
            Cell::Lstm => vec![zeros.clone(), zeros],
        };
        let consts = [
            params.get(&self.param("weight_hh"))?.clone(),
            params.get(&self.param("bias_hh"))?.clone(),
        ];
        let options = ScanOptions {
            reverse: false,
            checkpoint: self.checkpoint,
        };
        let (cell, hidden) = (self.cell, self.hidden);
        let step = |c: &[Tensor], x: &[Tensor], k: &[Tensor]| {
            let from_hidden = c[0].matmul(&k[0])?.add(&k[1])?;
            let next = match cell {
                Cell::Gru => gru_step(&c[0], &x[0], &from_hidden, hidden)?,
                Cell::Lstm => lstm_step(&c[1], &x[0], &from_hidden, hidden)?,
            };
            let output = next[0].clone();
            Ok((next, vec![output]))
        };
        let ys = if self.unrolled {
            unroll(&carries, &projected, &consts, step)?
        } else {
            scan(&carries, &[projected], &consts, options, step)?
                .1
                .remove(0)
        };
        ys.transpose(vec![1, 0, 2])
    }
}

/// The steps of a scan traced one after another: `xs` [T, …] → the
/// first per-step output stacked [T, …].
fn unroll<F>(carries: &[Tensor], xs: &Tensor, consts: &[Tensor], step: F) -> EngineResult<Tensor>
where
    F: Fn(&[Tensor], &[Tensor], &[Tensor]) -> EngineResult<(Vec<Tensor>, Vec<Tensor>)>,
{
    let dims = xs.dims();
    let Some(&Dim::Fixed(steps)) = dims.first() else {
        return Err(EngineError::Shape(format!(
            "unrolling needs a fixed length, got {}",
            xs.ty()
        )));
    };
    let mut carries = carries.to_vec();
    let mut outputs = Vec::with_capacity(steps);
    for t in 0..steps {
        let slice = apply(
            Op::Slice {
                axis: 0,
                start: t,
                end: t + 1,
            },
            &[xs],
        )?;
        let x = slice.reshape(dims[1..].to_vec())?;
        let (next, ys) = step(&carries, &[x], consts)?;
        let mut stacked_dims = vec![Dim::Fixed(1)];
        stacked_dims.extend(ys[0].dims());
        outputs.push(ys[0].reshape(stacked_dims)?);
        carries = next;
    }
    let parts: Vec<&Tensor> = outputs.iter().collect();
    apply(Op::Concat { axis: 0 }, &parts)
}

/// Gate `index` of `[N, gates·H]`.
fn gate(t: &Tensor, index: usize, hidden: usize) -> EngineResult<Tensor> {
    let op = Op::Slice {
        axis: 1,
        start: index * hidden,
        end: (index + 1) * hidden,
    };
    apply(op, &[t])
}

/// r = σ(x_r + h_r), z = σ(x_z + h_z), n = tanh(x_n + r·h_n),
/// h' = (1 − z)·n + z·h = n + z·(h − n).
fn gru_step(h: &Tensor, x: &Tensor, from_h: &Tensor, hidden: usize) -> EngineResult<Vec<Tensor>> {
    let part = |t: &Tensor, i| gate(t, i, hidden);
    let r = part(x, 0)?.add(&part(from_h, 0)?)?.sigmoid()?;
    let z = part(x, 1)?.add(&part(from_h, 1)?)?.sigmoid()?;
    let n = part(x, 2)?.add(&r.mul(&part(from_h, 2)?)?)?.tanh()?;
    let next = n.add(&z.mul(&h.sub(&n)?)?)?;
    Ok(vec![next])
}

/// i, f, o = σ(x + h·W + b) per gate, g = tanh(…), c' = f·c + i·g,
/// h' = o·tanh(c'). Carries (h, c).
fn lstm_step(c: &Tensor, x: &Tensor, from_h: &Tensor, hidden: usize) -> EngineResult<Vec<Tensor>> {
    let pre = |i| gate(x, i, hidden)?.add(&gate(from_h, i, hidden)?);
    let input = pre(0)?.sigmoid()?;
    let forget = pre(1)?.sigmoid()?;
    let candidate = pre(2)?.tanh()?;
    let output = pre(3)?.sigmoid()?;
    let cell = forget.mul(c)?.add(&input.mul(&candidate)?)?;
    let next = output.mul(&cell.tanh()?)?;
    Ok(vec![next, cell])
}

/// f32 indices `[N, …]` as i64, for an [`crate::nn::Embedding`] fed from a
/// dataset, whose features are f32 (integers below 2^24 are exact).
pub struct Indices;

impl Layer for Indices {
    fn forward(&self, _: &Params, x: &Tensor, _: &ForwardCtx) -> EngineResult<Tensor> {
        x.cast(DType::I64)
    }
}

/// The last step of a sequence: `[N, T, H]` → `[N, H]`.
pub struct LastStep;

impl Layer for LastStep {
    fn forward(&self, _: &Params, x: &Tensor, _: &ForwardCtx) -> EngineResult<Tensor> {
        let dims = x.dims();
        let (Some(&batch), Some(&Dim::Fixed(steps)), Some(&width)) =
            (dims.first(), dims.get(1), dims.get(2))
        else {
            return Err(EngineError::Shape(format!(
                "the last step needs [N, T, H] with a fixed T, got {}",
                x.ty()
            )));
        };
        let last = apply(
            Op::Slice {
                axis: 1,
                start: steps - 1,
                end: steps,
            },
            &[x],
        )?;
        last.reshape(vec![batch, width])
    }
}
