//! `canopy model bench`: the engine's speed figures.
//!
//! Every figure excludes start-up (data loading, tracing, compilation); the
//! timed region is the training or execution loop alone.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use canopy_engine::backend::AdapterInfo;
use canopy_engine::data::Dataset;
use canopy_engine::optim::Optimizer;
use canopy_engine::select::{BackendChoice, open_backend};
use canopy_engine::train::{FitConfig, FitProgress, Trainer, fit};
use canopy_engine::zoo::{Architecture, ENTRY_TRAIN_LOSS, ModelConfig, build_model};
use canopy_engine::{Backend, Executable, Value};
use canopy_ir::model::PARAM_PREFIX;
use canopy_ir::{Graph, Model, TensorType, autodiff};
use clap::{Args, ValueEnum};

use super::load_for_model;
use crate::output::progress::StepBar;
use crate::output::{errln, outln};

#[derive(Args)]
pub struct BenchArgs {
    /// MNIST-format folder for the training workloads.
    #[arg(long, default_value = "datasets/mnist-10k")]
    data: PathBuf,
    /// Epochs of the MLP workload.
    #[arg(long, default_value_t = 5)]
    epochs: usize,
    /// Epochs of the LeNet-5 workload.
    #[arg(long, default_value_t = 1)]
    lenet_epochs: usize,
    /// Timed training steps of the charlm workload (after 3 warm-up steps).
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    charlm_steps: u32,
    /// Print one JSON object and nothing else on stdout (a warning about a
    /// software adapter goes to stderr).
    #[arg(long)]
    json: bool,
    /// cpu, gpu (any Vulkan, Metal or DX12 adapter) or auto (a hardware
    /// GPU when there is one, else the CPU).
    #[arg(long, default_value_t = BackendChoice::Auto)]
    backend: BackendChoice,
    /// Which figures to measure, comma-separated; all when not given.
    #[arg(long, value_enum, value_delimiter = ',')]
    workloads: Vec<Workload>,
}

/// The MLP workload: MNIST's 784 pixels, 128 hidden units, 10 classes.
const MLP: Architecture = Architecture::Mlp {
    inputs: 784,
    hidden: 128,
    classes: 10,
};
/// The LeNet-5 workload, on MNIST's 10 classes.
const LENET5: Architecture = Architecture::LeNet5 { classes: 10 };
const BATCH: usize = 64;
const LR: f32 = 0.1;
/// How long each micro-benchmark runs.
const MEASURE: Duration = Duration::from_millis(600);

/// The recurrent workload's batch (`bench/jax_baselines.py` runs the same
/// one on JAX's `lax.scan`): one GRU of 256 over 80 characters of a
/// 77-character vocabulary with an 8-wide embedding.
const CHARLM_BATCH: usize = 32;
const CHARLM_WARM_UP_STEPS: usize = 3;

pub fn run(args: BenchArgs) -> Result<()> {
    let opened = open_backend(args.backend)?;
    let backend = opened.as_ref();
    let adapter = backend.describe().adapter;
    let software = adapter.as_ref().is_some_and(is_software);
    if let Some(adapter) = adapter.as_ref().filter(|_| software) {
        errln!(
            "warning: GPU adapter `{}` is a software implementation ({} on the CPU, such as Mesa's \
             lavapipe or llvmpipe): these figures are not a GPU's",
            adapter.name,
            adapter.api
        );
    }
    let workloads = Workload::selected(&args.workloads);
    let needs_data = workloads.iter().any(|w| w.needs_data());
    let mut report = Report::new(args.json, workloads.len() + usize::from(needs_data));
    report.line(format_args!(
        "backend: {}",
        super::describe_backend(backend)
    ))?;
    let data = if needs_data {
        report.steps.step("loading data");
        Some(Workloads::load(&args.data)?)
    } else {
        None
    };
    let bench = Bench {
        args: &args,
        backend,
        data: data.as_ref(),
    };
    let mut figures = serde_json::Map::new();
    for workload in workloads {
        report.steps.step(workload.step());
        bench.measure(workload, &mut report, &mut figures)?;
    }
    report.steps.finish();
    if args.json {
        figures.insert("threads".into(), rayon::current_num_threads().into());
        figures.insert("backend".into(), backend.name().into());
        figures.insert(
            "adapter".into(),
            serde_json::json!(adapter.as_ref().map(|a| serde_json::json!({
                "name": a.name, "api": a.api, "device_type": a.device_type, "driver": a.driver,
                "max_buffer_bytes": a.max_buffer_bytes, "software": software,
            }))),
        );
        outln!("{}", serde_json::Value::Object(figures))?;
    }
    Ok(())
}

/// What `model bench` measures; `--workloads` picks some, run in this
/// order.
#[derive(Clone, Copy, PartialEq, Eq, Debug, ValueEnum)]
enum Workload {
    /// Training throughput of the MLP 784-128-10 (`--epochs`).
    Mlp,
    /// Training throughput of LeNet-5 (`--lenet-epochs`).
    Lenet5,
    /// Training throughput of the GRU character model (`--charlm-steps`).
    Charlm,
    /// Backward/forward time ratios of the MLP and LeNet-5.
    Ratios,
    /// LeNet-5's step time, full and with its backbone frozen.
    Steps,
    /// Node counts: the MLP's step before and after the passes, each
    /// model's step after the CPU's fusion.
    Nodes,
    /// Square matrix products of 256, 512 and 1024, in GFLOPS.
    Matmul,
}

impl Workload {
    /// `asked` in the enum's order without repeats; every workload when
    /// none was asked for.
    fn selected(asked: &[Workload]) -> Vec<Workload> {
        Workload::value_variants()
            .iter()
            .copied()
            .filter(|w| asked.is_empty() || asked.contains(w))
            .collect()
    }

    /// Whether it trains or runs on `--data`.
    fn needs_data(self) -> bool {
        matches!(
            self,
            Workload::Mlp | Workload::Lenet5 | Workload::Ratios | Workload::Steps
        )
    }

    /// Its step on the progress bar.
    fn step(self) -> &'static str {
        match self {
            Workload::Mlp => "mlp training",
            Workload::Lenet5 => "lenet5 training",
            Workload::Charlm => "charlm training",
            Workload::Ratios => "backward/forward ratios",
            Workload::Steps => "lenet5 steps",
            Workload::Nodes => "optimisation passes",
            Workload::Matmul => "matmul",
        }
    }
}

/// The two image models and their training sets from `--data`.
struct Workloads {
    mlp: Model,
    lenet: Model,
    mlp_train: Dataset,
    lenet_train: Dataset,
}

impl Workloads {
    fn load(data: &Path) -> Result<Workloads> {
        let mlp = model(MLP)?;
        let lenet = model(LENET5)?;
        let (mlp_train, _) = load_for_model(data, &mlp)?;
        let (lenet_train, _) = load_for_model(data, &lenet)?;
        Ok(Workloads {
            mlp,
            lenet,
            mlp_train,
            lenet_train,
        })
    }
}

/// What every workload measures with.
struct Bench<'a> {
    args: &'a BenchArgs,
    backend: &'a dyn Backend,
    /// Loaded when a workload needs it (`Workload::needs_data`).
    data: Option<&'a Workloads>,
}

impl Bench<'_> {
    fn data(&self) -> Result<&Workloads> {
        self.data
            .context("internal error: a workload that needs --data ran without it")
    }

    /// Runs `workload`, prints its lines and adds its JSON figures.
    fn measure(
        &self,
        workload: Workload,
        report: &mut Report,
        figures: &mut serde_json::Map<String, serde_json::Value>,
    ) -> Result<()> {
        let backend = self.backend;
        match workload {
            Workload::Mlp => {
                let data = self.data()?;
                let epochs = self.args.epochs;
                let rate = train_throughput(
                    &data.mlp,
                    &data.mlp_train,
                    epochs,
                    backend,
                    &mut report.steps,
                )?;
                report.line(format_args!(
                    "mlp 784-128-10 training: {rate:.0} samples/s ({epochs} epochs, batch {BATCH}, SGD {LR})"
                ))?;
                figures.insert("mlp_train_samples_per_s".into(), rate.into());
            }
            Workload::Lenet5 => {
                let data = self.data()?;
                let epochs = self.args.lenet_epochs;
                let rate = train_throughput(
                    &data.lenet,
                    &data.lenet_train,
                    epochs,
                    backend,
                    &mut report.steps,
                )?;
                report.line(format_args!(
                    "lenet5 training:         {rate:.0} samples/s ({epochs} epochs)"
                ))?;
                figures.insert("lenet5_train_samples_per_s".into(), rate.into());
            }
            Workload::Charlm => {
                let rate = charlm_throughput(backend, self.args.charlm_steps as usize)?;
                report.line(format_args!(
                    "charlm gru256 training:  {rate:.0} samples/s (sequence 80, batch {CHARLM_BATCH})"
                ))?;
                figures.insert("charlm_train_samples_per_s".into(), rate.into());
            }
            Workload::Ratios => {
                let data = self.data()?;
                let mlp = backward_forward_ratio(&data.mlp, &data.mlp_train, backend)?;
                let lenet = backward_forward_ratio(&data.lenet, &data.lenet_train, backend)?;
                report.line(format_args!(
                    "backward/forward time:   mlp {mlp:.2}, lenet5 {lenet:.2}"
                ))?;
                figures.insert("backward_forward_ratio".into(), mlp.into());
                figures.insert("lenet5_backward_forward_ratio".into(), lenet.into());
            }
            Workload::Steps => self.lenet_steps(report, figures)?,
            Workload::Nodes => node_counts(report, figures)?,
            Workload::Matmul => {
                let mut gflops = serde_json::Map::new();
                for n in [256, 512, 1024] {
                    report.steps.detail(format!("{n}x{n}"));
                    let rate = matmul_gflops(n, backend)?;
                    report.line(format_args!("matmul {n}x{n}:          {rate:.1} GFLOPS"))?;
                    gflops.insert(n.to_string(), rate.into());
                }
                figures.insert("matmul_gflops".into(), gflops.into());
            }
        }
        Ok(())
    }

    fn lenet_steps(
        &self,
        report: &mut Report,
        figures: &mut serde_json::Map<String, serde_json::Value>,
    ) -> Result<()> {
        let data = self.data()?;
        let full_ms = step_millis(&data.lenet, &data.lenet_train, self.backend)?;
        let frozen = model_frozen(LENET5, &["conv", "fc1"])?;
        let frozen_ms = step_millis(&frozen, &data.lenet_train, self.backend)?;
        report.line(format_args!(
            "lenet5 step, batch {BATCH}:  full {full_ms:.2} ms ({} nodes), frozen conv+fc1 {frozen_ms:.2} ms ({} nodes)",
            data.lenet.entry("train_step")?.len(),
            frozen.entry("train_step")?.len()
        ))?;
        figures.insert("lenet5_full_step_ms".into(), full_ms.into());
        figures.insert("lenet5_frozen_backbone_step_ms".into(), frozen_ms.into());
        Ok(())
    }
}

/// The MLP's step before and after the passes, and each model's step
/// after the CPU's fusion.
fn node_counts(
    report: &mut Report,
    figures: &mut serde_json::Map<String, serde_json::Value>,
) -> Result<()> {
    let (nodes_before, nodes_after) = mlp_pass_report()?;
    report.line(format_args!(
        "mlp train_step nodes:    {nodes_before} before passes, {nodes_after} after"
    ))?;
    figures.insert(
        "mlp_train_step_nodes_before_passes".into(),
        nodes_before.into(),
    );
    figures.insert(
        "mlp_train_step_nodes_after_passes".into(),
        nodes_after.into(),
    );
    let mut fusion = serde_json::Map::new();
    let models = [
        ("mlp", model(MLP)?),
        ("lenet5", model(LENET5)?),
        ("charlm", charlm_model()?),
    ];
    for (name, model) in models {
        let fused = canopy_engine::cpu::fusion_report(model.entry("train_step")?)?;
        report.line(format_args!(
            "{name} train_step on the CPU: {} nodes, {} after fusion ({} fused kernels at the top level)",
            fused.nodes,
            fused.after_fusion,
            fused.groups.len()
        ))?;
        fusion.insert(
            name.to_string(),
            serde_json::json!({"nodes": fused.nodes, "after_fusion": fused.after_fusion}),
        );
    }
    figures.insert("train_step_cpu_fusion".into(), fusion.into());
    Ok(())
}

/// wgpu's `DeviceType::Cpu` (`cpu`): Vulkan, Metal or DX12 implemented on
/// the CPU (Mesa's lavapipe and llvmpipe, WARP), which `--backend gpu`
/// accepts so that CI can run the GPU kernels.
fn is_software(adapter: &AdapterInfo) -> bool {
    adapter.device_type == "cpu"
}

/// Where the figures go: lines on stdout for people, or nothing until the
/// one JSON document `--json` prints; and the progress bar on stderr.
struct Report {
    json: bool,
    steps: StepBar,
}

impl Report {
    fn new(json: bool, steps: usize) -> Report {
        Report {
            json,
            steps: StepBar::new(steps),
        }
    }

    /// A figure for people; with `--json`, stdout is the JSON alone.
    fn line(&self, text: std::fmt::Arguments<'_>) -> Result<()> {
        if !self.json {
            self.steps.suspend(|| outln!("{text}"))?;
        }
        Ok(())
    }
}

fn model(architecture: Architecture) -> Result<Model> {
    model_frozen(architecture, &[])
}

fn model_frozen(architecture: Architecture, frozen: &[&str]) -> Result<Model> {
    Ok(build_model(&ModelConfig {
        architecture,
        seed: 0,
        optimizer: Optimizer::sgd(),
        frozen_prefixes: frozen.iter().map(|p| p.to_string()).collect(),
        producer: "canopy bench".into(),
    })?)
}

/// Mean milliseconds of one training step over a fixed set of batches.
fn step_millis(model: &Model, train: &Dataset, backend: &dyn Backend) -> Result<f64> {
    let mut trainer = Trainer::new(model, backend, 0)?;
    let batches: Vec<_> = train.batches(BATCH, Some(7), true)?.take(40).collect();
    let (warm_up, timed) = batches.split_at(5);
    for b in warm_up {
        trainer.step(b.x.clone(), b.y.clone(), LR)?;
    }
    let started = Instant::now();
    for b in timed {
        trainer.step(b.x.clone(), b.y.clone(), LR)?;
    }
    Ok(1e3 * started.elapsed().as_secs_f64() / timed.len() as f64)
}

/// Node counts of the MLP's training step as traced and differentiated,
/// before and after the optimisation passes.
fn mlp_pass_report() -> Result<(usize, usize)> {
    let config = ModelConfig {
        architecture: MLP,
        seed: 0,
        optimizer: Optimizer::sgd(),
        frozen_prefixes: Vec::new(),
        producer: "canopy bench".into(),
    };
    let (loss, trainable) = canopy_engine::zoo::traced_train_loss(&config)?;
    let unoptimized =
        canopy_engine::optim::build_train_step_unoptimized(&loss, &trainable, &Optimizer::sgd())?;
    let (_, report) = canopy_ir::passes::optimize_with_report(
        &unoptimized,
        Some(&canopy_engine::fold::CpuConstEvaluator),
    )?;
    Ok((report.before, report.after))
}

/// Samples per second over the engine's training loop (shuffling and
/// batching included).
fn train_throughput(
    model: &Model,
    train: &Dataset,
    epochs: usize,
    backend: &dyn Backend,
    steps: &mut StepBar,
) -> Result<f64> {
    let mut trainer = Trainer::new(model, backend, 0)?;
    let config = FitConfig::new(epochs as u32, BATCH, LR, 0);
    let started = Instant::now();
    let stats = fit(&mut trainer, train, &config, &mut |progress| {
        // Only a drawn bar is worth the formatting inside the timed loop.
        if let (
            true,
            FitProgress::Batch {
                epoch,
                done,
                batches,
                ..
            },
        ) = (steps.visible(), progress)
        {
            steps.detail(format!("epoch {epoch}/{epochs}, batch {done}/{batches}"));
        }
        ControlFlow::Continue(())
    })?;
    let samples: usize = stats.iter().map(|e| e.samples).sum();
    Ok(samples as f64 / started.elapsed().as_secs_f64())
}

fn charlm_model() -> Result<Model> {
    model(Architecture::CharLm {
        vocabulary: 77,
        sequence: 80,
        embedding: 8,
        hidden: 256,
        layers: 1,
        cell: canopy_engine::recurrent::Cell::Gru,
        unrolled: false,
    })
}

/// Samples per second of `charlm` training steps on random characters
/// (the speed of a step does not depend on the text).
fn charlm_throughput(backend: &dyn Backend, steps: usize) -> Result<f64> {
    let model = charlm_model()?;
    let samples = CHARLM_BATCH * (steps + CHARLM_WARM_UP_STEPS);
    // A fixed multiplicative hash: reproducible characters, no RNG state.
    let character = |i: usize| (i.wrapping_mul(2_654_435_761) >> 7) % 77;
    let features = (0..samples * 80).map(|i| character(i) as f32).collect();
    let labels = (0..samples).map(|i| character(i + 13) as i64).collect();
    let train = Dataset::new(features, vec![80], labels, 77)?;
    let mut trainer = Trainer::new(&model, backend, 0)?;
    let batches: Vec<_> = train.batches(CHARLM_BATCH, None, true)?.collect();
    let (warm_up, timed) = batches.split_at(CHARLM_WARM_UP_STEPS);
    for b in warm_up {
        trainer.step(b.x.clone(), b.y.clone(), LR)?;
    }
    let started = Instant::now();
    for b in timed {
        trainer.step(b.x.clone(), b.y.clone(), LR)?;
    }
    Ok((timed.len() * CHARLM_BATCH) as f64 / started.elapsed().as_secs_f64())
}

/// (time of forward+backward − time of forward) / time of forward, for the
/// loss graph and its `value_and_grad`, on one batch.
fn backward_forward_ratio(model: &Model, train: &Dataset, backend: &dyn Backend) -> Result<f64> {
    let forward = model.entry(ENTRY_TRAIN_LOSS)?.clone();
    let wrt: Vec<String> = model
        .parameters
        .iter()
        .filter(|p| p.trainable)
        .map(|p| format!("{PARAM_PREFIX}{}", p.name))
        .collect();
    let wrt: Vec<&str> = wrt.iter().map(String::as_str).collect();
    let both = canopy_engine::optimize_graph(&autodiff::value_and_grad(&forward, "loss", &wrt)?)?;
    let batch = train
        .batches(BATCH, None, true)?
        .next()
        .context("dataset is smaller than one batch")?;
    let forward_time = time_graph(&forward, model, &batch.x, &batch.y, backend)?;
    let both_time = time_graph(&both, model, &batch.x, &batch.y, backend)?;
    Ok((both_time - forward_time) / forward_time)
}

fn time_graph(
    graph: &Graph,
    model: &Model,
    x: &Value,
    y: &Value,
    backend: &dyn Backend,
) -> Result<f64> {
    let mut exec = backend.compile(graph)?;
    let inputs = || -> Result<Vec<Value>> {
        graph
            .inputs()
            .iter()
            .map(|&i| {
                let name = graph.input_name(i);
                Ok(match name {
                    "x" => x.clone(),
                    "y" => y.clone(),
                    "seed" => Value::scalar_i64(1),
                    _ => Value::from_data(
                        &model
                            .parameter(name.strip_prefix(PARAM_PREFIX).unwrap_or(name))
                            .with_context(|| format!("no parameter for input `{name}`"))?
                            .data,
                    ),
                })
            })
            .collect()
    };
    per_run_seconds(exec.as_mut(), inputs)
}

/// Mean seconds per run, after a warm-up run; input preparation is not timed.
fn per_run_seconds(
    exec: &mut dyn Executable,
    inputs: impl Fn() -> Result<Vec<Value>>,
) -> Result<f64> {
    exec.run(inputs()?)?;
    let (mut total, mut runs) = (Duration::ZERO, 0u32);
    while total < MEASURE {
        let prepared = inputs()?;
        let started = Instant::now();
        exec.run(prepared)?;
        total += started.elapsed();
        runs += 1;
    }
    Ok(total.as_secs_f64() / runs as f64)
}

fn matmul_gflops(n: usize, backend: &dyn Backend) -> Result<f64> {
    let mut g = Graph::new();
    let a = g.input("a", TensorType::f32(&[n, n]))?;
    let b = g.input("b", TensorType::f32(&[n, n]))?;
    let c = g.matmul(a, b)?;
    g.set_output("c", c)?;
    let mut exec = backend.compile(&g)?;
    let values: Vec<f32> = (0..n * n).map(|i| ((i % 17) as f32 - 8.0) / 8.0).collect();
    let operand = Value::f32(&[n, n], values)?;
    let seconds = per_run_seconds(exec.as_mut(), || Ok(vec![operand.clone(), operand.clone()]))?;
    Ok(2.0 * (n as f64).powi(3) / seconds / 1e9)
}
