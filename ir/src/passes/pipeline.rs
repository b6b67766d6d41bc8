//! The optimisation pipeline: simplify, fold, CSE and DCE, repeated until
//! a round changes nothing.

use crate::error::IrResult;
use crate::graph::Graph;

use super::cse::eliminate_common_subexpressions_counted;
use super::dce::eliminate_dead_code_counted;
use super::fold::{ConstEvaluator, fold_constants_counted};
use super::simplify::simplify_counted;

/// Rounds of the pipeline; each round that does anything removes or
/// rewrites at least one node, so real graphs settle in two or three.
pub const MAX_ROUNDS: usize = 16;
/// The largest constant (in elements) that [`optimize`] folds into the
/// graph: folding a broadcast or one-hot must not bloat the model.
pub const DEFAULT_FOLD_MAX_ELEMENTS: usize = 4096;

/// What the pipeline did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PassReport {
    /// Node count before and after.
    pub before: usize,
    pub after: usize,
    /// For each pass, summed over rounds: rewrites applied (`simplify`),
    /// nodes folded (`fold`), nodes merged (`cse`), nodes removed (`dce`).
    /// `fold` is listed only when an evaluator was given.
    pub per_pass: Vec<(&'static str, usize)>,
}

impl PassReport {
    fn add(&mut self, pass: &'static str, work: usize) {
        match self.per_pass.iter_mut().find(|(p, _)| *p == pass) {
            Some(slot) => slot.1 += work,
            None => self.per_pass.push((pass, work)),
        }
    }
}

/// Optimises `g`; constants are folded only when an evaluator is given.
pub fn optimize(g: &Graph, evaluator: Option<&dyn ConstEvaluator>) -> IrResult<Graph> {
    Ok(optimize_with_report(g, evaluator)?.0)
}

/// As [`optimize`], also reporting what each pass did.
///
/// Runs rounds of simplify → fold → CSE → DCE until a round does no work
/// at all (so the result is a fixpoint and optimising it again changes
/// nothing), or [`MAX_ROUNDS`] have run.
pub fn optimize_with_report(
    g: &Graph,
    evaluator: Option<&dyn ConstEvaluator>,
) -> IrResult<(Graph, PassReport)> {
    let mut report = PassReport {
        before: g.len(),
        ..PassReport::default()
    };
    // Dead code first, so no later pass spends time on it.
    let (mut current, removed) = eliminate_dead_code_counted(g)?;
    report.add("dce", removed);
    for _ in 0..MAX_ROUNDS {
        let (next, work) = round(&current, evaluator, &mut report)?;
        current = next;
        if work == 0 {
            break;
        }
    }
    report.after = current.len();
    Ok((current, report))
}

/// One round of every pass; returns the graph and the total work done.
fn round(
    g: &Graph,
    evaluator: Option<&dyn ConstEvaluator>,
    report: &mut PassReport,
) -> IrResult<(Graph, usize)> {
    let (mut g, simplified) = simplify_counted(g)?;
    report.add("simplify", simplified);
    let mut work = simplified;
    if let Some(evaluator) = evaluator {
        let (folded_graph, folded) =
            fold_constants_counted(&g, evaluator, DEFAULT_FOLD_MAX_ELEMENTS)?;
        report.add("fold", folded);
        (g, work) = (folded_graph, work + folded);
    }
    let (g, merged) = eliminate_common_subexpressions_counted(&g)?;
    report.add("cse", merged);
    let (g, removed) = eliminate_dead_code_counted(&g)?;
    report.add("dce", removed);
    Ok((g, work + merged + removed))
}
