//! Structured control flow (opset 3): `scan`, `cond` and `while_loop`,
//! whose bodies are graphs, and `output`, which reads one result of them.
//!
//! A control-flow node is the one kind of node with several results. Its
//! own value is a tuple that only `output` nodes read (the verifier holds
//! every other reader to that), so every other op, pass and kernel keeps
//! seeing single-valued nodes. The node's `ty` is the type of its result 0,
//! so code that only asks for a type never meets a tuple.
//!
//! Bodies are ordinary graphs, verified as graphs (one level deeper), with
//! their signature checked here against the node's operands. The symbolic
//! batch dimension inside a body is the enclosing graph's.

use crate::graph::{Graph, MAX_RANK};
use crate::types::{DType, Dim, Shape, TensorType};

/// Upper bound on a `while_loop`'s `max_trips`: a bounded loop saves one
/// carry per trip for its reverse pass, so the bound is also a memory bound.
pub const MAX_WHILE_TRIPS: usize = 1 << 24;

/// `scan(body, carries…, xs…, consts…)`: a loop over the leading axis of
/// the `xs`, like `lax.scan`.
///
/// The body maps `(carry…, x_t…, const…)` to `(carry'…, y_t…)`; each
/// `x_t` is its `xs` operand without the leading axis, and each carry
/// keeps its type (the fixed point the verifier checks). The node's
/// results are the final carries, then each `y` stacked along a new
/// leading axis of `length`. Steps run in order of t, or from the last to
/// the first when `reverse` (the stacked `y` keep the index of their step
/// either way). `length` is the trip count: the leading dimension of every
/// `xs`, fixed or the symbolic batch; with no `xs` it alone gives the count.
///
/// `checkpoint` says what reverse mode saves for the backward pass; the
/// results are the same whatever it is. 0: every step's residuals (the
/// fastest). 1: only the carry entering each step, each step's body
/// recomputed backwards. k > 1: only every k-th carry, each segment of k
/// steps recomputed (saving its residuals) when the backward pass reaches
/// it, so memory falls from T steps of residuals to T/k carries plus k
/// steps, for one more forward pass; k must divide a fixed `length`
/// ([`Scan::sqrt_checkpoint`] picks the divisor nearest √T).
#[derive(Clone, Debug, PartialEq)]
pub struct Scan {
    pub body: Graph,
    pub carries: usize,
    pub scanned: usize,
    pub length: Dim,
    pub reverse: bool,
    pub checkpoint: usize,
}

/// `cond(pred, operands…)`: `then_branch(operands…)` when the bool scalar
/// `pred` is true, else `else_branch(operands…)`. Both branches take the
/// operands and return results of the same types; only the chosen one runs.
#[derive(Clone, Debug, PartialEq)]
pub struct Cond {
    pub then_branch: Graph,
    pub else_branch: Graph,
}

/// `while_loop(carries…, consts…)`: while `cond(carry…, const…)` (a bool
/// scalar) holds and fewer than `max_trips` trips have run,
/// `carry = body(carry…, const…)`. Results: the final carries, then the
/// trip count (an i64 scalar). Reaching `max_trips` ends the loop; it is
/// not an error, and the count says so.
#[derive(Clone, Debug, PartialEq)]
pub struct WhileLoop {
    pub cond: Graph,
    pub body: Graph,
    pub carries: usize,
    pub max_trips: usize,
}

type Cause = String;

fn input_types(g: &Graph) -> Vec<&TensorType> {
    g.inputs().iter().map(|&i| g.ty(i)).collect()
}

fn output_types(g: &Graph) -> Vec<&TensorType> {
    g.outputs().iter().map(|(_, v)| g.ty(*v)).collect()
}

fn expect_types(what: &str, expected: &[&TensorType], got: &[&TensorType]) -> Result<(), Cause> {
    if expected.len() != got.len() {
        return Err(format!(
            "{what}: expected {} values, got {}",
            expected.len(),
            got.len()
        ));
    }
    for (i, (e, g)) in expected.iter().zip(got).enumerate() {
        if e != g {
            return Err(format!("{what}: value {i} must be {e}, is {g}"));
        }
    }
    Ok(())
}

impl Scan {
    /// The divisor of `length` nearest √length (the smaller on a tie): the
    /// checkpoint interval that minimises T/k + k.
    pub fn sqrt_checkpoint(length: usize) -> usize {
        let root = (length as f64).sqrt();
        (1..=length.max(1))
            .filter(|&k| length.is_multiple_of(k))
            .min_by(|a, b| {
                let (da, db) = ((*a as f64 - root).abs(), (*b as f64 - root).abs());
                da.total_cmp(&db)
            })
            .unwrap_or(1)
    }

    pub fn consts(&self) -> usize {
        self.body
            .inputs()
            .len()
            .saturating_sub(self.carries + self.scanned)
    }

    pub fn ys(&self) -> usize {
        self.body.outputs().len().saturating_sub(self.carries)
    }

    /// The result types for operands of types `t`.
    pub fn results(&self, t: &[&TensorType]) -> Result<Vec<TensorType>, Cause> {
        let body_in = input_types(&self.body);
        let body_out = output_types(&self.body);
        let (c, s) = (self.carries, self.scanned);
        if c + s > body_in.len() || c > body_out.len() {
            return Err(format!(
                "the body takes {} values and returns {}, fewer than {c} carries and {s} scanned inputs need",
                body_in.len(),
                body_out.len()
            ));
        }
        if t.len() != body_in.len() {
            return Err(format!(
                "the body takes {} values, the node has {} operands",
                body_in.len(),
                t.len()
            ));
        }
        if self.checkpoint > 1 {
            match self.length {
                Dim::Fixed(n) if n.is_multiple_of(self.checkpoint) => {}
                Dim::Fixed(n) => {
                    return Err(format!(
                        "checkpoint {} does not divide the length {n}; Scan::sqrt_checkpoint({n}) = {} does",
                        self.checkpoint,
                        Scan::sqrt_checkpoint(n)
                    ));
                }
                Dim::Batch => {
                    return Err(format!(
                        "checkpoint {} needs a fixed length, not the batch dimension",
                        self.checkpoint
                    ));
                }
            }
        }
        expect_types("initial carries", &body_in[..c], &t[..c])?;
        expect_types(
            "the body's carries out (a carry keeps its type)",
            &body_in[..c],
            &body_out[..c],
        )?;
        for (j, x) in t[c..c + s].iter().enumerate() {
            let Some((&lead, rest)) = x.shape.0.split_first() else {
                return Err(format!(
                    "scanned input {j} is a scalar; it needs a leading axis"
                ));
            };
            if lead != self.length {
                return Err(format!(
                    "scanned input {j} is {x}, whose leading axis is not the length {}",
                    self.length
                ));
            }
            let step = TensorType::new(x.dtype, Shape(rest.to_vec()));
            if *body_in[c + j] != step {
                return Err(format!(
                    "the body takes step {j} as {}, but one step of {x} is {step}",
                    body_in[c + j]
                ));
            }
        }
        expect_types("constants", &body_in[c + s..], &t[c + s..])?;
        let mut results: Vec<TensorType> = t[..c].iter().map(|&x| x.clone()).collect();
        for y in &body_out[c..] {
            if y.rank() + 1 > MAX_RANK {
                return Err(format!("stacking {y} exceeds the rank limit of {MAX_RANK}"));
            }
            let mut dims = vec![self.length];
            dims.extend_from_slice(&y.shape.0);
            results.push(TensorType::new(y.dtype, Shape(dims)));
        }
        nonempty(results)
    }
}

impl Cond {
    pub fn results(&self, t: &[&TensorType]) -> Result<Vec<TensorType>, Cause> {
        let Some((pred, operands)) = t.split_first() else {
            return Err("needs a predicate".into());
        };
        if pred.dtype != DType::Bool || pred.rank() != 0 {
            return Err(format!("the predicate must be a bool scalar, is {pred}"));
        }
        expect_types(
            "then branch inputs",
            &input_types(&self.then_branch),
            operands,
        )?;
        expect_types(
            "else branch inputs",
            &input_types(&self.else_branch),
            operands,
        )?;
        let then_out = output_types(&self.then_branch);
        expect_types(
            "else branch results (the then branch's types)",
            &then_out,
            &output_types(&self.else_branch),
        )?;
        nonempty(then_out.into_iter().cloned().collect())
    }
}

impl WhileLoop {
    pub fn results(&self, t: &[&TensorType]) -> Result<Vec<TensorType>, Cause> {
        if self.max_trips == 0 || self.max_trips > MAX_WHILE_TRIPS {
            return Err(format!(
                "max_trips is {}; it must be between 1 and {MAX_WHILE_TRIPS}",
                self.max_trips
            ));
        }
        let c = self.carries;
        if c > t.len() {
            return Err(format!("{c} carries, but only {} operands", t.len()));
        }
        expect_types("body inputs", &input_types(&self.body), t)?;
        expect_types("cond inputs", &input_types(&self.cond), t)?;
        expect_types(
            "body results (a carry keeps its type)",
            &t[..c],
            &output_types(&self.body),
        )?;
        let bool_scalar = TensorType::new(DType::Bool, Shape(vec![]));
        expect_types("cond result", &[&bool_scalar], &output_types(&self.cond))?;
        let mut results: Vec<TensorType> = t[..c].iter().map(|&x| x.clone()).collect();
        results.push(TensorType::new(DType::I64, Shape(vec![])));
        Ok(results)
    }
}

fn nonempty(results: Vec<TensorType>) -> Result<Vec<TensorType>, Cause> {
    if results.is_empty() {
        return Err("has no results".into());
    }
    Ok(results)
}
