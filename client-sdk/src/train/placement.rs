//! Where a training step's graphs run: the whole step on one backend, or a
//! model's frozen backbone on another (the NPU) and the trainable head on
//! the first. Either way the step, and so the update, is the same.

use canopy_engine::train::Trainer;
use canopy_engine::{Backend, CpuBackend, EngineError};
use canopy_ir::Model;

use super::TrainError;

/// Where a training step runs.
#[derive(Clone, Copy)]
pub(super) enum Placement<'a> {
    /// The whole step on one backend.
    One(&'a dyn Backend),
    /// The frozen forward part (the backbone) on `backbone`, the trainable
    /// head, its gradient and the optimizer on `head`; the whole step on
    /// `head` when the model has no frozen backbone or `backbone` cannot
    /// run it. Either way the update has the same layout and values (the
    /// split computes the same step).
    Split {
        backbone: &'a dyn Backend,
        head: &'a dyn Backend,
    },
}

impl<'a> Placement<'a> {
    /// The step on `head`, its frozen backbone on `backbone` when there is
    /// one (a backend choice's NPU).
    pub(super) fn new(head: &'a dyn Backend, backbone: Option<&'a dyn Backend>) -> Placement<'a> {
        match backbone {
            Some(backbone) => Placement::Split { backbone, head },
            None => Placement::One(head),
        }
    }

    /// The trainer for `model`'s `train_step` placed here.
    pub(super) fn trainer(self, model: &Model, seed: u64) -> Result<Trainer, TrainError> {
        let (backbone, head) = match self {
            Placement::One(backend) => return one(model, backend, seed),
            Placement::Split { backbone, head } => (backbone, head),
        };
        if !has_frozen_backbone(model) {
            tracing::info!(
                "the whole training step runs on the {} backend: the model freezes no layer \
                 (at most its input statistics), so there is no backbone for the {}",
                head.name(),
                backbone.name()
            );
            return Ok(Trainer::new(model, head, seed)?);
        }
        match Trainer::split(model, backbone, head, seed) {
            Ok(trainer) => {
                tracing::info!(
                    backbone = backbone.name(),
                    head = head.name(),
                    "training with the frozen backbone on the {} backend and the head on the {}",
                    backbone.name(),
                    head.name()
                );
                Ok(trainer)
            }
            // No frozen part to split off, or an op the backbone's
            // backend cannot take: the whole step on the head instead.
            Err(why @ (EngineError::Setting(_) | EngineError::Unsupported { .. })) => {
                tracing::info!(
                    reason = %crate::error::error_chain(&why),
                    "the whole training step runs on the {} backend, none of it on the {}",
                    head.name(),
                    backbone.name()
                );
                Ok(Trainer::new(model, head, seed)?)
            }
            Err(other) => Err(other.into()),
        }
    }
}

/// The whole step on `backend` (see [`or_on_cpu`]).
fn one(model: &Model, backend: &dyn Backend, seed: u64) -> Result<Trainer, TrainError> {
    Ok(or_on_cpu(backend, "training step", |b| {
        Trainer::new(model, b, seed)
    })?)
}

/// `run` on `backend`, or on the CPU when `backend` refuses one of the
/// graph's ops (`EngineError::Unsupported`: an NPU runtime an op its
/// export lacks, a GPU an op it has no kernel for): the same result up to
/// float rounding, where failing would lose the device's round. The one
/// home of that rule, for training and evaluation alike.
pub(super) fn or_on_cpu<T>(
    backend: &dyn Backend,
    what: &str,
    run: impl Fn(&dyn Backend) -> Result<T, EngineError>,
) -> Result<T, EngineError> {
    match run(backend) {
        Err(why @ EngineError::Unsupported { .. }) if backend.name() != CpuBackend.name() => {
            tracing::warn!(
                reason = %crate::error::error_chain(&why),
                "the {} backend cannot run this model's {what}; running it on the CPU",
                backend.name()
            );
            run(&CpuBackend)
        }
        other => other,
    }
}

/// Whether `model` freezes a layer's parameters. The input statistics are
/// always frozen, but a session of their normalization alone costs a step
/// more than it saves, so they make no backbone.
fn has_frozen_backbone(model: &Model) -> bool {
    model
        .parameters
        .iter()
        .any(|p| !p.trainable && !p.name.starts_with(canopy_engine::nn::INPUT_STATS_PREFIX))
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use canopy_engine::{EngineResult, Executable};
    use canopy_ir::Graph;

    use super::*;

    /// A backend other than the CPU; what it can run is up to each test's
    /// `run`.
    struct Other;

    impl Backend for Other {
        fn name(&self) -> &'static str {
            "other"
        }

        fn compile(&self, graph: &Graph) -> EngineResult<Box<dyn Executable>> {
            CpuBackend.compile(graph)
        }
    }

    fn refusal(backend: &str) -> EngineError {
        EngineError::Unsupported {
            backend: backend.into(),
            what: "op `pow` (node %1): pow on i64".into(),
        }
    }

    /// Runs `or_on_cpu` from `first` with a `run` that fails on the
    /// backends `failing` names, with the error `fail` makes; returns its
    /// outcome (the backend that ran) and the backends asked, in order.
    fn asked(
        first: &dyn Backend,
        failing: &[&str],
        fail: fn(&str) -> EngineError,
    ) -> (Result<&'static str, EngineError>, Vec<&'static str>) {
        let names = RefCell::new(Vec::new());
        let outcome = or_on_cpu(first, "test", |backend| {
            names.borrow_mut().push(backend.name());
            if failing.contains(&backend.name()) {
                Err(fail(backend.name()))
            } else {
                Ok(backend.name())
            }
        });
        (outcome, names.into_inner())
    }

    #[test]
    fn a_refusal_runs_it_on_the_cpu_instead() {
        let (outcome, asked) = asked(&Other, &["other"], refusal);
        assert_eq!(outcome.expect("the CPU runs it"), "cpu");
        assert_eq!(asked, ["other", "cpu"]);
    }

    #[test]
    fn a_backend_that_runs_it_is_the_only_one_asked() {
        let (outcome, asked) = asked(&Other, &[], refusal);
        assert_eq!(outcome.expect("runs"), "other");
        assert_eq!(asked, ["other"]);
    }

    /// Only a refusal falls back: a failure of another kind (a GPU out of
    /// memory, a bad input) is the caller's to see, not hidden by a rerun.
    #[test]
    fn another_failure_is_returned_as_it_is() {
        let (outcome, asked) = asked(&Other, &["other"], |_| EngineError::Gpu {
            what: "pooled buffer 3".into(),
            cause: "needs more bytes than one buffer may hold".into(),
        });
        assert!(
            matches!(outcome, Err(EngineError::Gpu { .. })),
            "{outcome:?}"
        );
        assert_eq!(asked, ["other"]);
    }

    #[test]
    fn the_cpus_own_refusal_is_returned_not_retried() {
        let (outcome, asked) = asked(&CpuBackend, &["cpu"], refusal);
        assert!(
            matches!(outcome, Err(EngineError::Unsupported { .. })),
            "{outcome:?}"
        );
        assert_eq!(asked, ["cpu"]);
    }
}
