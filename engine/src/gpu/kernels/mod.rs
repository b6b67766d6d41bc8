//! WGSL generators, one module per op family (as the CPU's
//! `cpu/kernels/`): each turns a node with resolved shapes into one or
//! more kernels, with every shape baked into the source as constants (so
//! a pipeline is cached per op and shape).
//!
//! [`check`] is the compile-time half: it says whether an op, with these
//! element types, has a kernel, so an unsupported graph is refused before
//! anything reaches the device.
//!
//! [`Family::of`] is the one place an op is given its family: a match
//! without a wildcard, so a new op is a compile error there until it has
//! one. [`check`] and [`generate`] dispatch on the family, again without a
//! wildcard, and fusion (`fuse::is_elementwise`) and the plan read it, so
//! no other list of ops has to be kept in step.

use std::fmt::Write;

use canopy_ir::{DType, Op};

use super::wgsl::{HELPERS, coordinates, declare, flat_entry, grid, store};

mod conv;
mod elementwise;
mod gemm;
mod index;
mod pool;
mod random;
mod reduce;
mod shape;
mod softmax;

pub use elementwise::{FusedMember, FusedOperand, FusedSite, fused_elementwise};

/// One dispatch of one pipeline.
#[derive(Clone, Debug)]
pub struct Kernel {
    pub label: &'static str,
    pub source: String,
    pub workgroups: [u32; 3],
    /// What each binding is, in binding order.
    pub bindings: Vec<Bind>,
}

/// Flag words every run clears and reads back: an index out of range, an
/// integer division by zero; the words from [`FLAG_OUTPUTS`] on mark
/// outputs with a non-finite element.
pub const FLAG_INDEX_OUT_OF_RANGE: u32 = 0;
pub const FLAG_DIVISION_BY_ZERO: u32 = 1;
pub const FLAG_OUTPUTS: u32 = 2;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bind {
    /// The node's operand `k`.
    Operand(usize),
    Output,
    /// The run's flag words ([`FLAG_INDEX_OUT_OF_RANGE`], …).
    Flags,
}

/// A node's operands and result, shapes resolved.
pub struct Site<'a> {
    pub op: &'a Op,
    pub operands: Vec<(DType, Vec<usize>)>,
    pub out: (DType, Vec<usize>),
    pub max_workgroups: u32,
}

/// The kernel families; each one that has kernels is a module of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// Values with a buffer and no kernel: graph inputs (fed or resident),
    /// constants (uploaded once) and reshapes (the same elements in the
    /// same order, so their operand's buffer).
    NoKernel,
    /// Custom gradients, inlined before a graph is compiled, so never
    /// checked or planned.
    Inlined,
    /// `elementwise.rs`: each output element from the operand elements at
    /// its (broadcast) position; the only family fusion groups.
    Elementwise,
    /// `gemm.rs`: batched matmul on the tiled GEMM.
    MatMul,
    /// `reduce.rs`: folds along axes, and argmax.
    Reduce,
    /// `shape.rs`: copies that move elements (transpose, slice, pad,
    /// concat).
    Shape,
    /// `softmax.rs`: softmax and log-softmax along an axis.
    Softmax,
    /// `index.rs`: ops that read integer indices.
    Index,
    /// `random.rs`: seeded uniform numbers.
    Random,
    /// `conv.rs`: convolution and its gradients.
    Conv,
    /// `pool.rs`: pooling and its adjoints.
    Pool,
    /// Control flow (`scan`, `cond`, `while_loop` and their `output`s):
    /// no kernel of its own; the plan runs each loop or branch from the
    /// host over its bodies' plans (`control.rs`), and an `output` is the
    /// buffer its result is written to.
    ControlFlow,
}

#[cfg(test)]
canopy_ir::all_variants! {
    /// Every family, for the test that each one generates kernels.
    Family [NoKernel, Inlined, Elementwise, MatMul, Reduce, Shape, Softmax, Index, Random, Conv, Pool, ControlFlow]
}

impl Family {
    /// The family of `op`'s kernels.
    pub fn of(op: &Op) -> Family {
        match op {
            Op::Input { .. } | Op::Constant(_) | Op::Reshape { .. } => Family::NoKernel,
            Op::CustomGrad(_) => Family::Inlined,
            Op::Scan(_) | Op::Cond(_) | Op::WhileLoop(_) | Op::Output { .. } => Family::ControlFlow,
            Op::Unary(_) | Op::Binary(_) | Op::Where | Op::Cast { .. } | Op::Broadcast { .. } => {
                Family::Elementwise
            }
            Op::MatMul { .. } => Family::MatMul,
            Op::Reduce { .. } | Op::ArgMax { .. } => Family::Reduce,
            Op::Transpose { .. } | Op::Slice { .. } | Op::Pad { .. } | Op::Concat { .. } => {
                Family::Shape
            }
            Op::Softmax { .. } | Op::LogSoftmax { .. } => Family::Softmax,
            Op::Gather { .. } | Op::ScatterAdd { .. } | Op::OneHot { .. } => Family::Index,
            Op::RandomUniform { .. } => Family::Random,
            Op::Conv2d(_) | Op::Conv2dBackwardInput { .. } | Op::Conv2dBackwardFilter { .. } => {
                Family::Conv
            }
            Op::MaxPool2d(_)
            | Op::MaxPool2dSelect(_)
            | Op::MaxPool2dBackward(_)
            | Op::AvgPool2d(_)
            | Op::AvgPool2dBackward { .. } => Family::Pool,
        }
    }
}

/// Whether the backend has a kernel for `op` with these operand and result
/// element types; the error says what is missing.
pub fn check(op: &Op, operands: &[DType], out: DType) -> Result<(), String> {
    let first = operands.first().copied().unwrap_or(out);
    let refused = || Err(format!("{} on {first}", op.name()));
    match Family::of(op) {
        // A control-flow node's bodies are checked as graphs of their own
        // (`program.rs`).
        Family::NoKernel | Family::Shape | Family::Index | Family::Random | Family::ControlFlow => {
            Ok(())
        }
        Family::Inlined => Err(format!("{} is inlined before compiling", op.name())),
        Family::Elementwise => elementwise::check(op, first, out),
        Family::Reduce => reduce::check(op, first),
        Family::MatMul | Family::Softmax if first == DType::F32 => Ok(()),
        Family::Conv | Family::Pool if operands.iter().all(|d| *d == DType::F32) => Ok(()),
        Family::MatMul | Family::Softmax | Family::Conv | Family::Pool => refused(),
    }
}

/// The kernels that compute one node; none for [`Family::NoKernel`].
pub fn generate(site: &Site<'_>) -> Result<Vec<Kernel>, String> {
    match Family::of(site.op) {
        Family::NoKernel => Ok(Vec::new()),
        Family::Inlined => Err(format!("{} has no kernel of its own", site.op.name())),
        Family::ControlFlow => Err(format!(
            "{} has no kernel: the plan runs it from the host",
            site.op.name()
        )),
        Family::Elementwise => elementwise::generate(site),
        Family::MatMul => gemm::generate(site),
        Family::Reduce => reduce::generate(site),
        Family::Shape => shape::generate(site),
        Family::Softmax => softmax::generate(site),
        Family::Index => index::generate(site),
        Family::Random => random::generate(site),
        Family::Conv => conv::generate(site),
        Family::Pool => pool::generate(site),
    }
}

/// The error of a family's generator handed an op [`Family::of`] puts in
/// another family.
fn foreign(op: &Op, family: Family) -> String {
    format!("{} is not in the {family:?} family", op.name())
}

fn count(shape: &[usize]) -> u64 {
    shape.iter().product::<usize>() as u64
}

/// Declarations: operands `a0…` (read-only), then `out`, in [`Bind`] order.
fn header(site: &Site<'_>, with_flags: bool) -> (String, Vec<Bind>) {
    let mut source = String::from(HELPERS);
    let mut bindings = Vec::new();
    for (k, (dtype, _)) in site.operands.iter().enumerate() {
        declare(&mut source, k, &format!("a{k}"), *dtype, false);
        bindings.push(Bind::Operand(k));
    }
    declare(&mut source, bindings.len(), "out", site.out.0, true);
    bindings.push(Bind::Output);
    if with_flags {
        let _ = writeln!(
            source,
            "@group(0) @binding({}) var<storage, read_write> flags: array<u32>;",
            bindings.len()
        );
        bindings.push(Bind::Flags);
    }
    (source, bindings)
}

/// A kernel labelled by the node's op, with one invocation per output
/// element; `body` computes `value` (of the output's value type) from `i`
/// and `c0…`.
fn per_output(site: &Site<'_>, body: &str, with_flags: bool) -> Kernel {
    let (mut source, bindings) = header(site, with_flags);
    let n = count(&site.out.1);
    let groups = grid(n, site.max_workgroups);
    let full = format!(
        "{}{body}\n  {}",
        coordinates(&site.out.1, "i"),
        store("out", site.out.0, "i", "value")
    );
    flat_entry(&mut source, n, groups, &full);
    Kernel {
        label: site.op.name(),
        source,
        workgroups: groups,
        bindings,
    }
}

fn join_sum(terms: &[String]) -> String {
    if terms.is_empty() {
        "0u".to_string()
    } else {
        terms.join(" + ")
    }
}

#[cfg(test)]
mod tests {
    use canopy_ir::{
        BinaryOp, Conv2dAttrs, CustomGrad, Dim, Graph, Pool2dAttrs, ReduceKind, Shape, TensorType,
        UnaryOp,
    };

    use super::*;

    #[test]
    fn grids_spill_into_y_past_the_per_dimension_limit() {
        assert_eq!(grid(10, 65_535), [1, 1, 1]);
        assert_eq!(grid(256 * 70_000, 65_535), [65_535, 2, 1]);
    }

    #[test]
    fn i64_arithmetic_without_a_kernel_is_refused_by_name() {
        let on_i64 = |op| check(&Op::Binary(op), &[DType::I64, DType::I64], DType::I64);
        for op in [BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Div] {
            assert_eq!(on_i64(op), Ok(()), "{op:?}");
        }
        assert_eq!(on_i64(BinaryOp::Pow), Err("pow on i64".to_string()));
    }

    fn site<'a>(op: &'a Op, operands: &[(DType, &[usize])], out: (DType, &[usize])) -> Site<'a> {
        Site {
            op,
            operands: operands.iter().map(|(d, s)| (*d, s.to_vec())).collect(),
            out: (out.0, out.1.to_vec()),
            max_workgroups: 65_535,
        }
    }

    /// What a plan relies on: one output binding, operand bindings that
    /// exist, and an entry point.
    fn assert_well_formed(kernels: &[Kernel], operand_count: usize, what: &str) {
        for kernel in kernels {
            let outputs = kernel.bindings.iter().filter(|b| **b == Bind::Output);
            assert_eq!(outputs.count(), 1, "{what}: output bindings");
            for bind in &kernel.bindings {
                if let Bind::Operand(k) = bind {
                    assert!(*k < operand_count, "{what} binds operand {k}");
                }
            }
            assert!(kernel.source.contains("fn main("), "{what}: no entry point");
        }
    }

    /// Every unary, binary, reduction and cast on every element type (the
    /// lists come from the IR's enums): what `check` accepts has a kernel,
    /// what it refuses is refused by the op's name.
    #[test]
    fn every_elementwise_op_and_reduction_on_every_dtype_has_a_kernel_or_is_refused_by_name() {
        let shape: &[usize] = &[2, 3];
        let mut cases: Vec<(Op, Vec<DType>, DType)> = Vec::new();
        for dtype in DType::ALL {
            for op in UnaryOp::ALL {
                cases.push((Op::Unary(op), vec![dtype], dtype));
            }
            for op in BinaryOp::ALL {
                let out = if op.is_comparison() {
                    DType::Bool
                } else {
                    dtype
                };
                cases.push((Op::Binary(op), vec![dtype; 2], out));
            }
            for kind in ReduceKind::ALL {
                let op = Op::Reduce {
                    kind,
                    axes: vec![1],
                    keep_dims: true,
                };
                cases.push((op, vec![dtype], dtype));
            }
            for to in DType::ALL {
                cases.push((Op::Cast { to }, vec![dtype], to));
            }
            cases.push((Op::Where, vec![DType::Bool, dtype, dtype], dtype));
        }
        let mut accepted = 0;
        for (op, operand_types, out) in &cases {
            let what = format!("{} on {operand_types:?}", op.name());
            let out_shape: &[usize] = match op {
                Op::Reduce { .. } => &[2, 1],
                _ => shape,
            };
            match check(op, operand_types, *out) {
                Ok(()) => {
                    let operands: Vec<(DType, &[usize])> =
                        operand_types.iter().map(|d| (*d, shape)).collect();
                    let kernels = generate(&site(op, &operands, (*out, out_shape)))
                        .unwrap_or_else(|e| panic!("{what} is accepted but: {e}"));
                    assert_eq!(kernels.len(), 1, "{what}");
                    assert_well_formed(&kernels, operands.len(), &what);
                    accepted += 1;
                }
                Err(refusal) => {
                    let named = refusal.contains(op.name());
                    assert!(named, "{what} refused without its name: {refusal}");
                }
            }
        }
        assert!(accepted > cases.len() / 2, "{accepted} of {}", cases.len());
    }

    /// A small graph with an op of every family on real shapes.
    fn graph_of_every_family() -> Graph {
        let mut g = Graph::new();
        let x = g.input("x", TensorType::f32(&[2, 3, 8, 8])).unwrap();
        let w = g.input("w", TensorType::f32(&[4, 3, 3, 3])).unwrap();
        let seed = g.input("seed", TensorType::scalar(DType::I64)).unwrap();
        let labels = g
            .input("labels", TensorType::new(DType::I64, Shape::fixed(&[2])))
            .unwrap();
        let conv = g.push(Op::Conv2d(Conv2dAttrs::default()), &[x, w]).unwrap();
        let window = Pool2dAttrs {
            kernel: [2, 2],
            stride: [2, 2],
            padding: [0, 0],
        };
        let pooled = g.push(Op::MaxPool2d(window), &[conv]).unwrap();
        let active = g.push(Op::Unary(UnaryOp::Relu), &[pooled]).unwrap();
        let flat = g
            .reshape(active, vec![Dim::Fixed(2), Dim::Fixed(36)])
            .unwrap();
        let turned = g.push(Op::Transpose { perm: vec![1, 0] }, &[flat]).unwrap();
        let product = g
            .push(
                Op::MatMul {
                    transpose_a: false,
                    transpose_b: false,
                },
                &[flat, turned],
            )
            .unwrap();
        let probabilities = g.push(Op::Softmax { axis: 1 }, &[product]).unwrap();
        let picked = g
            .push(Op::Gather { axis: 0 }, &[probabilities, labels])
            .unwrap();
        let total = g.sum(picked, &[1], false).unwrap();
        let noise = g
            .push(
                Op::RandomUniform {
                    shape: vec![Dim::Fixed(2)],
                },
                &[seed],
            )
            .unwrap();
        let out = g.add(total, noise).unwrap();
        g.set_output("out", out).unwrap();
        g
    }

    /// Each family's generator on real shapes, and every family covered
    /// (`Family::ALL` comes from the same list as a match without a
    /// wildcard, so a new family is missing here until the graph has one).
    #[test]
    fn every_family_generates_kernels_for_the_ops_check_accepts() {
        let g = graph_of_every_family();
        let mut seen = [false; Family::ALL.len()];
        for (index, node) in g.nodes().iter().enumerate() {
            let family = Family::of(&node.op);
            let what = format!("node %{index} ({})", node.op.name());
            let operands: Vec<(DType, Vec<usize>)> = node
                .inputs
                .iter()
                .map(|id| (g.ty(*id).dtype, g.ty(*id).shape.resolve(1)))
                .collect();
            let types: Vec<DType> = operands.iter().map(|(d, _)| *d).collect();
            check(&node.op, &types, node.ty.dtype).unwrap_or_else(|e| panic!("{what}: {e}"));
            let site = Site {
                op: &node.op,
                operands,
                out: (node.ty.dtype, node.ty.shape.resolve(1)),
                max_workgroups: 65_535,
            };
            let kernels = generate(&site).unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(kernels.is_empty(), family == Family::NoKernel, "{what}");
            assert_well_formed(&kernels, node.inputs.len(), &what);
            seen[family.position()] = true;
        }
        let mut body = Graph::new();
        let y = body.input("y", TensorType::f32(&[2])).unwrap();
        body.set_output("y", y).unwrap();
        let custom = Op::CustomGrad(Box::new(CustomGrad {
            name: "identity".to_string(),
            forward: body.clone(),
            backward: body,
        }));
        let refusal = check(&custom, &[DType::F32], DType::F32).unwrap_err();
        assert!(refusal.contains("custom_grad"), "{refusal}");
        seen[Family::of(&custom).position()] = true;
        // Control flow passes the check and has no kernel of its own: the
        // plan runs it (engine/tests/control_flow.rs runs every construct).
        let output = Op::Output { index: 0 };
        assert_eq!(check(&output, &[DType::F32], DType::F32), Ok(()));
        let refusal = generate(&site(&output, &[(DType::F32, &[2])], (DType::F32, &[2])))
            .expect_err("no kernel for an output");
        assert!(refusal.contains("output"), "{refusal}");
        seen[Family::of(&output).position()] = true;
        let missing: Vec<Family> = Family::ALL
            .into_iter()
            .filter(|family| !seen[family.position()])
            .collect();
        assert!(missing.is_empty(), "no op in the test graph: {missing:?}");
    }
}
