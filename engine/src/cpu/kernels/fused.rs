//! The fused kernel: a group of elementwise nodes (`crate::fuse`) computed
//! in one sweep over its output, block by block, each block's
//! intermediates kept in a scratch that stays in L1 and L2.
//!
//! Values are f32 inside a block; a bool is 0.0 or 1.0 there (comparisons
//! write it, `where` and the logical ops read it), so one scratch type
//! serves every member. Each member runs the same scalar function as its
//! own kernel (the tables in `elementwise.rs`), so a fused graph computes
//! bit for bit what the unfused one does.

use canopy_ir::{BinaryOp, DType, Op, UnaryOp};
use ndarray::{ArrayD, ArrayViewD, CowArray, IxDyn};
use rayon::prelude::*;

use super::Arg;
use super::elementwise::{
    Repeat, Run, lined_up, with_arithmetic_f32, with_comparison, with_unary_f32,
};
use super::tensor::{Element, Number, PAR_THRESHOLD};
use crate::error::KernelError;
use crate::fuse::MAX_INPUTS;
use crate::value::Value;

/// Elements per block: a member's dispatch is paid once per block, and a
/// group of a few members keeps its block's scratch (8 KiB a slot) in L1
/// and L2.
const BLOCK: usize = 2048;

/// Elements one parallel task takes (16 blocks).
const TASK: usize = 16 * BLOCK;

thread_local! {
    /// Each thread's block scratch, kept between runs: a run of a small
    /// group would otherwise spend as long allocating and zeroing it as
    /// computing. At most `(fuse::MAX_INPUTS + fuse::MAX_MEMBERS) × BLOCK`
    /// floats (320 KiB).
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Where one operand of a member comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// The kernel's `k`-th input, lined up with the output.
    Input(usize),
    /// The value of an earlier member.
    Member(usize),
}

/// One member: an elementwise op and where it reads its operands.
#[derive(Clone, Debug)]
pub struct Member {
    pub op: Op,
    pub operands: Vec<Source>,
}

/// A fused group ready to run: its members in order, the last being the
/// group's value.
#[derive(Clone, Debug)]
pub struct FusedKernel {
    pub inputs: usize,
    pub members: Vec<Member>,
    pub output: DType,
}

/// How a block reads one input.
enum Reader<'a> {
    /// The output buffer itself (an operand whose storage the kernel took
    /// over): read before the block is written, from a staged copy when
    /// the last member reads it other than in place.
    Buffer {
        staged: bool,
    },
    Lined(CowArray<'a, f32, IxDyn>, Repeat),
}

impl FusedKernel {
    /// Runs the group on `inputs` (f32 or bool, each broadcastable to
    /// `shape`). The first owned f32 input of the output's shape becomes
    /// the output buffer, as the elementwise kernels do in place.
    pub fn run(&self, inputs: Vec<Arg<'_>>, shape: &[usize]) -> Result<Value, KernelError> {
        if inputs.len() != self.inputs || self.inputs > MAX_INPUTS {
            return Err(KernelError::Operands {
                expected: self.inputs.min(MAX_INPUTS),
                got: inputs.len(),
            });
        }
        let (mut out, buffer, inputs) = take_buffer(inputs, shape);
        let as_f32: Vec<CowArray<'_, f32, IxDyn>> = inputs
            .iter()
            .map(|arg| match arg.as_ref().map(Arg::value) {
                None => Ok(CowArray::from(ArrayD::<f32>::zeros(IxDyn(&[])))),
                Some(Value::F32(a)) => Ok(CowArray::from(a.view())),
                Some(Value::Bool(a)) => Ok(CowArray::from(a.mapv(bool::to_f32))),
                Some(other) => Err(KernelError::DType {
                    role: "fused operand".to_string(),
                    expected: "f32 or bool",
                    got: other.dtype(),
                }),
            })
            .collect::<Result<_, _>>()?;
        let views: Vec<ArrayViewD<'_, f32>> = as_f32.iter().map(CowArray::view).collect();
        // Where the last member reads the buffer, if it does once and may
        // run in place: it then updates the output in place.
        let last = &self.members[self.members.len() - 1];
        let reads_buffer = |k: usize| {
            last.operands
                .iter()
                .filter(|&&s| s == Source::Input(k))
                .count()
        };
        let in_place = buffer
            .filter(|&k| reads_buffer(k) == 1 && runs_in_place(&last.op))
            .and_then(|k| last.operands.iter().position(|&s| s == Source::Input(k)));
        let readers = views
            .iter()
            .enumerate()
            .map(|(k, view)| {
                Ok(if Some(k) == buffer {
                    Reader::Buffer {
                        staged: reads_buffer(k) > 0 && in_place.is_none(),
                    }
                } else {
                    let (source, repeat) = lined_up(view, shape)?;
                    Reader::Lined(source, repeat)
                })
            })
            .collect::<Result<Vec<_>, KernelError>>()?;
        let dst = out.as_slice_mut().expect("standard layout");
        let sweep = |offset: usize, chunk: &mut [f32]| {
            let slots = self.inputs + self.members.len() - 1;
            SCRATCH.with_borrow_mut(|scratch| {
                let len = slots * BLOCK.min(chunk.len());
                if scratch.len() < len {
                    scratch.resize(len, 0.0);
                }
                for (k, block) in chunk.chunks_mut(BLOCK).enumerate() {
                    let at = offset + k * BLOCK;
                    self.block(&readers, in_place, at, block, &mut scratch[..len]);
                }
            });
        };
        if dst.len() >= PAR_THRESHOLD {
            super::hot::keep_hot();
            dst.par_chunks_mut(TASK)
                .enumerate()
                .for_each(|(i, chunk)| sweep(i * TASK, chunk));
        } else if !dst.is_empty() {
            sweep(0, dst);
        }
        Ok(match self.output {
            DType::Bool => Value::Bool(out.mapv(|v| v != 0.0)),
            _ => Value::F32(out),
        })
    }

    /// Computes output elements `offset..offset + out.len()` into `out`.
    /// Inputs whose elements for the block lie in one slice (the output's
    /// shape, or a row the block falls within) are read where they lie,
    /// the output buffer included; other broadcast ones are first staged
    /// into `scratch`, as is every member but the last, which writes into
    /// `out`: in place when it reads the buffer once and may (the op
    /// kernels' in-place update), else from a staged copy of the buffer.
    /// `in_place` is the operand of the last member that is `out` itself.
    fn block(
        &self,
        readers: &[Reader<'_>],
        in_place: Option<usize>,
        offset: usize,
        out: &mut [f32],
        scratch: &mut [f32],
    ) {
        let n = out.len();
        let (staged, members) = scratch.split_at_mut(readers.len() * n);
        let last = &self.members[self.members.len() - 1];
        let is_staged = |reader: &Reader<'_>| match reader {
            Reader::Buffer { staged } => *staged,
            Reader::Lined(_, repeat) => repeat.contiguous(offset, n).is_none(),
        };
        for (k, reader) in readers.iter().enumerate() {
            if !is_staged(reader) {
                continue;
            }
            let slot = &mut staged[k * n..(k + 1) * n];
            match reader {
                Reader::Buffer { .. } => slot.copy_from_slice(out),
                Reader::Lined(source, repeat) => {
                    let src = source.as_slice().expect("standard layout");
                    repeat.for_runs(offset, slot, src, &mut |o, run| match run {
                        Run::Zip(s) => o.copy_from_slice(s),
                        Run::Splat(v) => o.fill(v),
                    });
                }
            }
        }
        let staged: &[f32] = staged;
        let staged_at = |k: usize| is_staged(&readers[k]);
        {
            let inputs = input_slices(readers, staged, out, &staged_at, (offset, n));
            for (j, member) in self.members[..self.members.len() - 1].iter().enumerate() {
                let (before, after) = members.split_at_mut(j * n);
                let (operands, count) = operands_of(member, &inputs, before, n);
                apply(&member.op, &operands[..count], None, &mut after[..n]);
            }
        }
        // The last member writes `out`: it reads the buffer's block in
        // place, or from its staged copy.
        let inputs = input_slices(readers, staged, &[], &staged_at, (offset, n));
        let (operands, count) = operands_of(last, &inputs, members, n);
        apply(&last.op, &operands[..count], in_place, out);
    }
}

/// Each input's elements for the block at `offset`: staged, the output
/// buffer's block (`buffer`), or the input's own slice.
fn input_slices<'s>(
    readers: &'s [Reader<'_>],
    staged: &'s [f32],
    buffer: &'s [f32],
    is_staged: &dyn Fn(usize) -> bool,
    (offset, n): (usize, usize),
) -> [&'s [f32]; MAX_INPUTS] {
    let mut inputs: [&[f32]; MAX_INPUTS] = [&[]; MAX_INPUTS];
    for ((k, reader), slot) in readers.iter().enumerate().zip(inputs.iter_mut()) {
        *slot = match reader {
            _ if is_staged(k) => &staged[k * n..(k + 1) * n],
            Reader::Buffer { .. } => buffer,
            Reader::Lined(source, repeat) => {
                let start = repeat
                    .contiguous(offset, n)
                    .expect("an input not staged lines up");
                &source.as_slice().expect("standard layout")[start..start + n]
            }
        };
    }
    inputs
}

/// The slices `member` reads for one block of `n` elements: inputs as
/// given, earlier members from their scratch slots.
fn operands_of<'s>(
    member: &Member,
    inputs: &[&'s [f32]],
    members: &'s [f32],
    n: usize,
) -> ([&'s [f32]; MAX_OPERANDS], usize) {
    let mut operands: [&[f32]; MAX_OPERANDS] = [&[]; MAX_OPERANDS];
    for (slot, source) in operands.iter_mut().zip(&member.operands) {
        *slot = match *source {
            Source::Input(k) => inputs[k],
            Source::Member(m) => &members[m * n..(m + 1) * n],
        };
    }
    (operands, member.operands.len())
}

/// The most operands of an elementwise op (`where`'s three).
const MAX_OPERANDS: usize = 3;

/// Splits off the output buffer: the first owned f32 input of `shape`, or
/// a new one. Returns it, the position of the input it was, and the
/// inputs (that one left as `None`: it is read from the buffer).
fn take_buffer<'a>(
    inputs: Vec<Arg<'a>>,
    shape: &[usize],
) -> (ArrayD<f32>, Option<usize>, Vec<Option<Arg<'a>>>) {
    let mut inputs: Vec<Option<Arg<'a>>> = inputs.into_iter().map(Some).collect();
    let position = inputs.iter().position(|arg| {
        matches!(arg, Some(Arg::Owned(Value::F32(a))) if a.shape() == shape && a.is_standard_layout())
    });
    let out = match position.and_then(|k| inputs[k].take()) {
        Some(Arg::Owned(Value::F32(a))) => a,
        _ => ArrayD::zeros(IxDyn(shape)),
    };
    (out, position, inputs)
}

/// One member over one block: `dst[i] = op(operands[..][i])`. With
/// `at = Some(k)`, operand `k` is `dst` itself (its slice in `operands`
/// is not read): the op runs in place, as the op kernels do on an owned
/// operand. Only ops for which [`runs_in_place`] holds take `Some`.
fn apply(op: &Op, operands: &[&[f32]], at: Option<usize>, dst: &mut [f32]) {
    let truth = |v: bool| f32::from(u8::from(v));
    match (op, operands) {
        (Op::Unary(u), [x]) => with_unary_f32!(*u, f => map1(dst, x, at, f), not => {
            debug_assert_eq!(*u, UnaryOp::Not);
            map1(dst, x, at, |s| truth(s == 0.0))
        }),
        (Op::Binary(BinaryOp::And), [x, y]) => {
            map2(dst, [x, y], at, |p, q| truth(p != 0.0 && q != 0.0))
        }
        (Op::Binary(BinaryOp::Or), [x, y]) => {
            map2(dst, [x, y], at, |p, q| truth(p != 0.0 || q != 0.0))
        }
        (Op::Binary(b), [x, y]) => {
            with_arithmetic_f32!(*b, f => map2(dst, [x, y], at, f), other => {
                with_comparison!(*b, f => map2(dst, [x, y], at, |p, q| truth(f(p, q))), other => {
                    unreachable!("fusion admits only arithmetic, comparisons and logic")
                })
            })
        }
        (Op::Where, [c, x, y]) => {
            assert!(at.is_none(), "`where` does not run in place");
            for (((d, &c), &p), &q) in dst.iter_mut().zip(*c).zip(*x).zip(*y) {
                *d = if c != 0.0 { p } else { q };
            }
        }
        (Op::Cast { to: DType::Bool }, [x]) => map1(dst, x, at, |s| truth(s.to_bool())),
        (Op::Cast { .. } | Op::Broadcast { .. }, [x]) => map1(dst, x, at, |s| s),
        (op, _) => unreachable!("`{}` is not fusible on the CPU", op.name()),
    }
}

/// Whether `op` may run with one operand being its destination: every
/// fusible op but `where`.
fn runs_in_place(op: &Op) -> bool {
    !matches!(op, Op::Where)
}

fn map1(dst: &mut [f32], x: &[f32], at: Option<usize>, f: impl Fn(f32) -> f32) {
    match at {
        None => dst.iter_mut().zip(x).for_each(|(d, &s)| *d = f(s)),
        Some(_) => dst.iter_mut().for_each(|d| *d = f(*d)),
    }
}

fn map2(dst: &mut [f32], [x, y]: [&[f32]; 2], at: Option<usize>, f: impl Fn(f32, f32) -> f32) {
    match at {
        None => {
            for ((d, &p), &q) in dst.iter_mut().zip(x).zip(y) {
                *d = f(p, q);
            }
        }
        Some(0) => dst.iter_mut().zip(y).for_each(|(d, &q)| *d = f(*d, q)),
        Some(_) => dst.iter_mut().zip(x).for_each(|(d, &p)| *d = f(p, *d)),
    }
}

/// Whether the fused kernel computes `op` with these operand and result
/// dtypes: the elementwise ops over f32 and bool.
pub fn fusible(op: &Op, operands: &[DType], result: DType) -> bool {
    let scalar = |d: &DType| matches!(d, DType::F32 | DType::Bool);
    let kind = matches!(
        op,
        Op::Unary(_) | Op::Binary(_) | Op::Where | Op::Cast { .. } | Op::Broadcast { .. }
    );
    kind && scalar(&result) && operands.iter().all(scalar)
}
