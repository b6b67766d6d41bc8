//! The static bounds on a central evaluation, checked from the `eval`
//! graph's shapes before anything runs (`canopy_ir::cost`): its peak
//! memory at the evaluation batch (halved until it fits, down to 1) and
//! its operations over the whole dataset. The one rule for job creation
//! (`api/admin/jobs.rs`) and for each evaluation.

use canopy_engine::train::EVAL_BATCH;
use canopy_ir::model::ENTRY_EVAL;
use canopy_ir::{Graph, Model, graph_cost};

use crate::config::Limits;

/// How one central evaluation runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EvalPlan {
    /// Samples per batch: `EVAL_BATCH`, or less where its values would
    /// not fit `limits.central_eval_memory_bytes`.
    pub batch: usize,
    /// Bytes the graph's values hold at once at that batch.
    pub peak_bytes: u64,
    /// Operations over every batch of the dataset.
    pub flops: u64,
}

/// Why a model cannot be evaluated centrally within the limits.
#[derive(Debug, thiserror::Error)]
pub enum OverBound {
    #[error("the model has no `eval` entry point to evaluate it with")]
    NoEval,
    #[error(
        "its `eval` graph needs {} at batch 1, over limits.central_eval_memory_bytes = {}; \
         hint: raise the limit if the worker's memory allows (limits.central_eval_worker_memory_bytes), \
         or evaluate a smaller model",
        human_bytes(*.peak_bytes),
        human_bytes(*.bound)
    )]
    Memory { peak_bytes: u64, bound: u64 },
    #[error(
        "its `eval` graph takes {} operations over the dataset's {samples} samples (at batch \
         {batch}), over limits.central_eval_flops = {}; hint: raise the limit, or name a smaller \
         central dataset",
        scientific(*.flops),
        scientific(*.bound)
    )]
    Flops {
        flops: u64,
        bound: u64,
        samples: u64,
        batch: usize,
    },
}

/// The batch and cost of evaluating `model` on `samples` samples, or why
/// it is over the limits.
pub fn plan(model: &Model, samples: u64, limits: &Limits) -> Result<EvalPlan, OverBound> {
    let graph = model.entry(ENTRY_EVAL).map_err(|_| OverBound::NoEval)?;
    plan_graph(graph, samples.max(1), limits)
}

fn plan_graph(graph: &Graph, samples: u64, limits: &Limits) -> Result<EvalPlan, OverBound> {
    let bound = limits.central_eval_memory_bytes;
    let mut batch = EVAL_BATCH.min(usize::try_from(samples).unwrap_or(usize::MAX));
    let cost = loop {
        let cost = graph_cost(graph, batch);
        if cost.peak_bytes <= bound {
            break cost;
        }
        if batch == 1 {
            let peak_bytes = cost.peak_bytes;
            return Err(OverBound::Memory { peak_bytes, bound });
        }
        batch /= 2;
    };
    let (peak_bytes, flops) = (
        cost.peak_bytes,
        dataset_flops(graph, samples, batch, cost.flops),
    );
    if flops > limits.central_eval_flops {
        return Err(OverBound::Flops {
            flops,
            bound: limits.central_eval_flops,
            samples,
            batch,
        });
    }
    Ok(EvalPlan {
        batch,
        peak_bytes,
        flops,
    })
}

/// Every full batch (`batch_flops` each), then the short last one
/// (evaluation keeps it).
fn dataset_flops(graph: &Graph, samples: u64, batch: usize, batch_flops: u64) -> u64 {
    let per_batch = batch as u64;
    let full = batch_flops.saturating_mul(samples / per_batch);
    let rest = usize::try_from(samples % per_batch).unwrap_or(0);
    match rest {
        0 => full,
        rest => full.saturating_add(graph_cost(graph, rest).flops),
    }
}

/// Bytes in binary units: `4 GiB`, `1.5 TiB`.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut unit = 0;
    while unit + 1 < UNITS.len() && bytes >> (10 * (unit + 2)) > 0 {
        unit += 1;
    }
    let scale = 1u64 << (10 * (unit + 1));
    if bytes.is_multiple_of(scale) {
        format!("{} {}", bytes / scale, UNITS[unit])
    } else {
        format!("{:.1} {}", bytes as f64 / scale as f64, UNITS[unit])
    }
}

fn scientific(count: u64) -> String {
    format!("{:.1e}", count as f64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use canopy_ir::{DType, Dim, Shape, TensorType};

    /// x [N, 1024] → tanh: 4 KiB a sample for x and 4 KiB for the tanh.
    fn wide() -> Graph {
        let mut graph = Graph::new();
        let x = graph
            .input(
                "x",
                TensorType::new(DType::F32, Shape(vec![Dim::Batch, Dim::Fixed(1024)])),
            )
            .expect("x");
        let y = graph.unary(canopy_ir::UnaryOp::Tanh, x).expect("tanh");
        graph.set_output("y", y).expect("output");
        graph
    }

    #[test]
    fn the_batch_is_halved_until_the_values_fit() {
        let limits = Limits {
            central_eval_memory_bytes: 64 * 8192,
            ..Limits::default()
        };
        let plan = plan_graph(&wide(), 1000, &limits).expect("fits at 64");
        assert_eq!(plan.batch, 64);
        assert_eq!(plan.peak_bytes, 64 * 8192);
        // 1000 tanh elements of 1024 each, whatever the batch.
        assert_eq!(plan.flops, 1000 * 1024);
        let small = plan_graph(&wide(), 10, &Limits::default()).expect("fits");
        assert_eq!(small.batch, 10, "no batch larger than the dataset");
    }

    #[test]
    fn over_the_bounds_is_refused_naming_the_setting() {
        let tight = Limits {
            central_eval_memory_bytes: 4096,
            ..Limits::default()
        };
        let error = plan_graph(&wide(), 10, &tight).unwrap_err().to_string();
        assert!(
            error.contains("needs 8 KiB at batch 1, over limits.central_eval_memory_bytes = 4 KiB"),
            "{error}"
        );
        let slow = Limits {
            central_eval_flops: 1000,
            ..Limits::default()
        };
        let error = plan_graph(&wide(), 10, &slow).unwrap_err().to_string();
        assert!(
            error.contains("1.0e4 operations")
                && error.contains("limits.central_eval_flops = 1.0e3"),
            "{error}"
        );
    }

    #[test]
    fn bytes_read_as_an_operator_writes_them() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(4 << 30), "4 GiB");
        assert_eq!(human_bytes(1 << 40), "1 TiB");
        assert_eq!(human_bytes((8 << 30) + 256), "8.0 GiB");
        assert_eq!(human_bytes(1536 << 20), "1.5 GiB");
        assert_eq!(human_bytes(u64::MAX), "16.0 EiB");
    }
}
