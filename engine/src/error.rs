//! Runtime errors.
//!
//! Each variant is one kind of failure a caller may want to tell apart
//! (a kernel refusing its operands, a diverged step, a model lacking a
//! parameter); the object and the numbers are fields, not text. Errors
//! that wrap another keep it as their `source`, so a report prints the
//! whole chain.

use std::fmt;

use canopy_ir::{DType, IrError};

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Ir(#[from] IrError),
    #[error("shape error: {0}")]
    Shape(String),
    #[error("dtype error: {0}")]
    DType(String),
    /// A kernel refused the values it was given. `node` is the graph node
    /// (`None` for an eager op); `operands` are the operands' shapes.
    #[error("{} ({op}) on operands of shape {operands:?}", Site(*node))]
    Kernel {
        node: Option<usize>,
        op: &'static str,
        operands: Vec<Vec<usize>>,
        #[source]
        source: KernelError,
    },
    /// A failure inside a loop body or branch, at one step of the node
    /// that runs it.
    #[error("node %{node} ({op}), step {step}")]
    Nested {
        node: usize,
        op: &'static str,
        step: usize,
        #[source]
        source: Box<EngineError>,
    },
    /// A graph input whose value does not fit its declared type.
    #[error("input `{name}`: {cause}")]
    Input { name: String, cause: String },
    /// A graph run with the wrong number of inputs.
    #[error("graph takes {} inputs ({}), got {got}", .expected.len(), .expected.join(", "))]
    InputCount { expected: Vec<String>, got: usize },
    /// A model or graph lacks something a runner or builder needs: `owner`
    /// names the one that lacks it (`train_step`, `the model`).
    #[error("{owner} has no {part} `{name}`")]
    Missing {
        owner: String,
        part: Part,
        name: String,
    },
    /// An entry point reads an input that no runner knows how to feed.
    #[error("{entry} has an input `{name}` that no runner knows how to feed")]
    Unfeedable { entry: String, name: String },
    /// A learning rate that is not a positive finite number.
    #[error("learning rate {0} must be a positive finite number")]
    LearningRate(f32),
    /// A step produced a non-finite loss or value; the trainer rolled its
    /// parameters and optimizer state back to step `rolled_back_to`.
    #[error(
        "training diverged at step {step}: {problem}; rolled back to the parameters of step \
         {rolled_back_to} (try a lower learning rate)"
    )]
    Diverged {
        step: u64,
        problem: NonFinite,
        rolled_back_to: u64,
    },
    /// A step's graph failed to run; the trainer rolled back to step
    /// `rolled_back_to`.
    #[error("step {step} failed (rolled back to step {rolled_back_to})")]
    Step {
        step: u64,
        rolled_back_to: u64,
        #[source]
        source: Box<EngineError>,
    },
    /// Training stopped at the caller's request, before a step of epoch
    /// `epoch`; `step` steps had run.
    #[error("training cancelled in epoch {epoch} after {step} steps")]
    Cancelled { epoch: u32, step: u64 },
    /// Every parameter of the model is frozen.
    #[error("every parameter is frozen: nothing to train")]
    NothingToTrain,
    /// An optimizer specification or hyperparameter that cannot be used.
    #[error("{0}")]
    Optimizer(String),
    /// A layer or model setting out of its range (dropout probability,
    /// freeze prefix, input statistics).
    #[error("{0}")]
    Setting(String),
    /// Tracing used outside its rules.
    #[error("{0}")]
    Trace(TraceError),
    /// A backend refusing, at `compile`, a graph it cannot run, so that
    /// the caller can fall back to the CPU, which runs every op.
    #[error("backend `{backend}` does not support {what}")]
    Unsupported { backend: String, what: String },
    /// The GPU could not be used: no adapter, a limit a graph exceeds, a
    /// lost device. `what` names the object, `cause` the reason.
    #[error("GPU backend: {what}: {cause}")]
    Gpu { what: String, cause: String },
    /// The runtime behind a backend failed (ONNX Runtime, for the NPU
    /// backend): `what` names the object (a session, an input, an output),
    /// `source` is the runtime's own error.
    #[error("{backend} backend: {what}")]
    Runtime {
        backend: String,
        what: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Input moments or statistics that cannot be used.
    #[error(transparent)]
    Stats(#[from] crate::stats::StatsError),
    #[error("data error in {path}: {cause}")]
    Data { path: String, cause: String },
    /// A data file past a bound its loader was given
    /// ([`DataBounds`](crate::data::limits::DataBounds)), told apart from
    /// [`EngineError::Data`] so that a caller can name the setting behind it.
    #[error("data error in {path}: {over}")]
    OverBound {
        path: String,
        over: crate::data::limits::OverBound,
    },
    /// A broken invariant of the engine itself, never bad input.
    #[error("internal error: {0}")]
    Internal(String),
}

pub type EngineResult<T> = Result<T, EngineError>;

/// Where a kernel ran, for [`EngineError::Kernel`].
struct Site(Option<usize>);

impl fmt::Display for Site {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(node) => write!(f, "node %{node}"),
            None => write!(f, "eager op"),
        }
    }
}

/// What a model or graph can lack, for [`EngineError::Missing`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    Input,
    Output,
    Parameter,
}

impl fmt::Display for Part {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Part::Input => "input",
            Part::Output => "output",
            Part::Parameter => "parameter",
        })
    }
}

/// The first non-finite value of a diverged step.
#[derive(Clone, Debug, PartialEq)]
pub enum NonFinite {
    Loss(f32),
    /// A carried output (a parameter or optimizer state), by name.
    Output(String),
}

impl fmt::Display for NonFinite {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NonFinite::Loss(loss) => write!(f, "loss is {loss}"),
            NonFinite::Output(name) => write!(f, "`{name}` is not finite"),
        }
    }
}

/// Misuses of graph-mode tracing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TraceError {
    #[error("no trace is active")]
    NotTracing,
    #[error("a tensor from another trace was used in this one")]
    ForeignTensor,
    #[error("a traced tensor has no value until its graph runs")]
    NoValue,
}

/// Why a kernel refused its operands or attributes. Kernels return it; the
/// executor wraps it in [`EngineError::Kernel`] with the node, the op and
/// the operand shapes.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum KernelError {
    /// An operand of a dtype the kernel does not take.
    #[error("{role} must be {expected}, got {got}")]
    DType {
        role: String,
        expected: &'static str,
        got: DType,
    },
    /// An operand of the wrong rank.
    #[error("{role} must have rank {expected}, got shape {got:?}")]
    Rank {
        role: String,
        expected: &'static str,
        got: Vec<usize>,
    },
    /// Operand shapes that do not fit each other or the node's type.
    #[error("{0}")]
    Shape(String),
    #[error("shapes {a:?} and {b:?} do not broadcast")]
    Broadcast { a: Vec<usize>, b: Vec<usize> },
    #[error("index {index} is out of range for axis {axis} of length {len}")]
    IndexOutOfRange { index: i64, axis: usize, len: usize },
    #[error("integer division by zero")]
    DivisionByZero,
    #[error("shape {0:?} has too many elements")]
    TooLarge(Vec<usize>),
    /// An attribute that does not fit the operands: an axis, a
    /// permutation, a window, a range.
    #[error("{0}")]
    Attribute(String),
    #[error("expects {expected} operands, got {got}")]
    Operands { expected: usize, got: usize },
    /// A broken invariant of the executor or a kernel, never bad input.
    #[error("internal error: {0}")]
    Internal(String),
}
