//! Running a task's training on local data: the shipped `train_step` graph
//! runs in the engine, and what leaves the device is the change of the
//! trainable parameters only, in the binary update format.

use std::time::Instant;

use canopy_engine::Backend;
use canopy_engine::data::Dataset;
use std::ops::ControlFlow;

use canopy_engine::EngineError;
use canopy_engine::train::{FitConfig, FitProgress, Trainer, fit};
use canopy_ir::{Buffer, Model};
use canopy_protocol::bounds::BoundsError;
use canopy_protocol::messages::Task;
use canopy_protocol::update::{TensorSpec, UpdateLayout, encode_update};

use crate::backend::BackendChoice;
use crate::cancel::CancelToken;

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The task asks for more than the shared bounds allow
    /// ([`canopy_protocol::bounds`]); nothing was trained.
    #[error(
        "the task's `{}` is outside the bounds devices accept; the job's settings must be fixed \
         on the server",
        .0.field()
    )]
    InvalidTask(#[source] BoundsError),
    #[error("the model file does not load")]
    Model(#[source] canopy_ir::format::FormatError),
    #[error("the model's trainable parameters do not match the task's layout: {0}")]
    Layout(String),
    #[error("the local dataset is empty, so there is nothing to train on")]
    NoData,
    #[error("training failed")]
    Engine(#[from] canopy_engine::EngineError),
    #[error("the update cannot be encoded")]
    Encode(#[from] canopy_protocol::update::UpdateError),
    #[error("training was cancelled")]
    Cancelled,
}

/// How [`train_task_with`] runs.
#[derive(Clone, Debug, Default)]
pub struct TrainOptions {
    /// The backend to compile `train_step` with; the CPU by default. Pick it
    /// with [`crate::backend::choose_backend`] from the device's
    /// capabilities.
    pub backend: BackendChoice,
    /// Checked before every batch; a cancelled token stops training with
    /// [`TrainError::Cancelled`] (nothing is encoded or uploaded).
    pub cancel: CancelToken,
}

/// The result of one task's local training.
#[derive(Clone, Debug)]
pub struct LocalUpdate {
    /// The encoded update, ready to upload.
    pub encoded: Vec<u8>,
    pub num_samples: u64,
    /// Sample-weighted mean loss over the last epoch.
    pub train_loss: f64,
    pub train_duration_ms: u64,
}

/// A statistics task ([`canopy_protocol::messages::TaskKind::Statistics`]):
/// the moments of `data`'s inputs, shaped for the model, as an update in
/// the task's layout (per feature, the mean and the mean of squares; the
/// sample count as the weight). Nothing is trained; the samples never
/// leave the device, only these sums.
pub fn statistics_update(
    model_bytes: &[u8],
    task: &Task,
    data: &Dataset,
) -> Result<LocalUpdate, TrainError> {
    let started = Instant::now();
    if data.is_empty() {
        return Err(TrainError::NoData);
    }
    let model = canopy_ir::format::read_model(model_bytes).map_err(TrainError::Model)?;
    let shape = canopy_engine::zoo::sample_shape(&model)?;
    let shaped = data.clone().with_feature_shape(&shape)?;
    let moments = canopy_engine::stats::InputMoments::of(&shaped);
    let expected = canopy_protocol::update::statistics_layout(moments.features())?;
    if expected != task.layout {
        return Err(TrainError::Layout(format!(
            "a statistics task for samples of {} features has layout {:?}, the task {:?}",
            moments.features(),
            expected.tensors,
            task.layout.tensors
        )));
    }
    let count = moments.count as f64;
    let values: Vec<f32> = moments
        .sum
        .iter()
        .chain(&moments.sum_sq)
        .map(|total| (total / count) as f32)
        .collect();
    let encoded = encode_update(&task.layout, moments.count, &values)?;
    Ok(LocalUpdate {
        encoded,
        num_samples: moments.count,
        train_loss: 0.0,
        train_duration_ms: started.elapsed().as_millis() as u64,
    })
}

/// Held-out loss and accuracy of a model on local data.
#[derive(Clone, Copy, Debug)]
pub struct Evaluation {
    pub loss: f64,
    pub accuracy: f64,
    pub samples: u64,
}

fn trainable_layout(model: &Model) -> Result<UpdateLayout, TrainError> {
    let tensors = model
        .parameters
        .iter()
        .filter(|p| p.trainable)
        .map(|p| TensorSpec {
            name: p.name.clone(),
            shape: p.data.shape.clone(),
        })
        .collect();
    UpdateLayout::new(tensors).map_err(|error| TrainError::Layout(error.to_string()))
}

fn trainable_values(model: &Model) -> Vec<f32> {
    let mut values = Vec::with_capacity(model.trainable_elements());
    for parameter in model.parameters.iter().filter(|p| p.trainable) {
        if let Buffer::F32(data) = &parameter.data.buffer {
            values.extend_from_slice(data);
        }
    }
    values
}

/// Trains a task's model on `data` for the task's epochs and returns the
/// encoded change of its trainable parameters. Runs on the CPU and cannot
/// be cancelled; see [`train_task_cancellable`] and [`train_task_with`].
pub fn train_task(
    model_bytes: &[u8],
    task: &Task,
    data: &Dataset,
    seed: u64,
) -> Result<LocalUpdate, TrainError> {
    train_task_with(model_bytes, task, data, seed, &TrainOptions::default())
}

/// [`train_task`] that checks `cancel` between batches and returns
/// [`TrainError::Cancelled`] once it fires. A batch in progress finishes
/// first, so the delay is at most one training step.
pub fn train_task_cancellable(
    model_bytes: &[u8],
    task: &Task,
    data: &Dataset,
    seed: u64,
    cancel: &CancelToken,
) -> Result<LocalUpdate, TrainError> {
    let options = TrainOptions {
        backend: BackendChoice::default(),
        cancel: cancel.clone(),
    };
    train_task_with(model_bytes, task, data, seed, &options)
}

/// [`train_task`] on a chosen backend, cancellable between batches. An NPU
/// choice trains split: the step's frozen backbone in ONNX Runtime, the
/// rest on the choice's head backend ([`Placement::Split`]).
pub fn train_task_with(
    model_bytes: &[u8],
    task: &Task,
    data: &Dataset,
    seed: u64,
    options: &TrainOptions,
) -> Result<LocalUpdate, TrainError> {
    let head = options.backend.engine_backend();
    let npu = options.backend.npu_backend();
    let placement = match &npu {
        Some(npu) => Placement::Split {
            backbone: npu.as_ref(),
            head: head.as_ref(),
        },
        None => Placement::One(head.as_ref()),
    };
    train_on(model_bytes, task, data, seed, placement, &options.cancel)
}

/// Where a training step runs.
#[derive(Clone, Copy)]
enum Placement<'a> {
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

impl Placement<'_> {
    /// The trainer for `model`'s `train_step` placed here.
    fn trainer(self, model: &Model, seed: u64) -> Result<Trainer, TrainError> {
        let (backbone, head) = match self {
            Placement::One(backend) => return Ok(Trainer::new(model, backend, seed)?),
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

/// Whether `model` freezes a layer's parameters. The input statistics are
/// always frozen, but a session of their normalization alone costs a step
/// more than it saves, so they make no backbone.
fn has_frozen_backbone(model: &Model) -> bool {
    model
        .parameters
        .iter()
        .any(|p| !p.trainable && !p.name.starts_with(canopy_engine::nn::INPUT_STATS_PREFIX))
}

/// The training loop on `placement`, which compiles and runs `train_step`.
/// The task is checked against the shared bounds first, so that its epochs
/// and batch size bound the loop.
fn train_on(
    model_bytes: &[u8],
    task: &Task,
    data: &Dataset,
    seed: u64,
    placement: Placement<'_>,
    cancel: &CancelToken,
) -> Result<LocalUpdate, TrainError> {
    check_cancelled(cancel)?;
    task.validate().map_err(TrainError::InvalidTask)?;
    if data.is_empty() {
        return Err(TrainError::NoData);
    }
    let started = Instant::now();
    let mut model = canopy_ir::format::read_model(model_bytes).map_err(TrainError::Model)?;
    let layout = trainable_layout(&model)?;
    if layout != task.layout {
        return Err(TrainError::Layout(format!(
            "the model has {} trainable tensors ({} values), the task {} ({} values)",
            layout.tensors.len(),
            layout.num_elements(),
            task.layout.tensors.len(),
            task.layout.num_elements()
        )));
    }
    let before = trainable_values(&model);
    let mut trainer = placement.trainer(&model, seed)?;
    let train_loss = run_epochs(&mut trainer, task, data, seed, cancel)?;
    trainer.write_back(&mut model)?;
    let delta: Vec<f32> = trainable_values(&model)
        .iter()
        .zip(&before)
        .map(|(after, before)| after - before)
        .collect();
    let num_samples = data.len() as u64;
    let encoded = encode_update(&task.layout, num_samples, &delta)?;
    Ok(LocalUpdate {
        encoded,
        num_samples,
        train_loss,
        train_duration_ms: started.elapsed().as_millis() as u64,
    })
}

fn check_cancelled(cancel: &CancelToken) -> Result<(), TrainError> {
    if cancel.is_cancelled() {
        return Err(TrainError::Cancelled);
    }
    Ok(())
}

/// The task's epochs over `data` (validated, so bounded) in the engine's
/// one loop ([`canopy_engine::train::fit`]), checking `cancel` before
/// every batch; returns the last epoch's sample-weighted mean loss.
fn run_epochs(
    trainer: &mut Trainer,
    task: &Task,
    data: &Dataset,
    seed: u64,
    cancel: &CancelToken,
) -> Result<f64, TrainError> {
    let config = FitConfig {
        start_epoch: 0,
        epochs: task.training.epochs,
        batch: task.training.batch_size as usize,
        learning_rate: task.training.learning_rate as f32,
        seed,
    };
    let mut observe = |_: FitProgress| {
        if cancel.is_cancelled() {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    };
    match fit(trainer, data, &config, &mut observe) {
        Ok(epochs) => Ok(epochs.last().map_or(0.0, |e| e.loss)),
        Err(EngineError::Cancelled { .. }) => Err(TrainError::Cancelled),
        Err(other) => Err(other.into()),
    }
}

/// Evaluates a model file on local data.
pub fn evaluate(
    model_bytes: &[u8],
    data: &Dataset,
    batch: usize,
) -> Result<Evaluation, TrainError> {
    let model = canopy_ir::format::read_model(model_bytes).map_err(TrainError::Model)?;
    evaluate_model(&model, data, batch)
}

/// Evaluates a downloaded model file on `data` (an evaluation task's work).
pub fn evaluate_file(model_bytes: &[u8], data: &Dataset) -> Result<Evaluation, TrainError> {
    let model = canopy_ir::format::read_model(model_bytes).map_err(TrainError::Model)?;
    evaluate_model(&model, data, EVAL_BATCH)
}

/// Samples per forward pass when evaluating.
pub use canopy_engine::train::EVAL_BATCH;

/// The engine's evaluation ([`canopy_engine::train::evaluate`]) on the
/// backend [`BackendChoice::default`] picks, as a device reports it.
pub fn evaluate_model(
    model: &Model,
    data: &Dataset,
    batch: usize,
) -> Result<Evaluation, TrainError> {
    evaluate_model_on(model, data, batch, &BackendChoice::default())
}

/// [`evaluate_model`] on a chosen backend, the one a device trains on; for
/// an NPU choice, its head backend (the CPU or GPU).
pub fn evaluate_model_on(
    model: &Model,
    data: &Dataset,
    batch: usize,
    backend: &BackendChoice,
) -> Result<Evaluation, TrainError> {
    if data.is_empty() {
        return Err(TrainError::NoData);
    }
    // Not the NPU: the `eval` graph would go to ONNX Runtime whole, loss
    // and accuracy included, with no split to keep the ops export cannot
    // take on the CPU, so an exported-op gap would fail the evaluation
    // outright; and a device evaluates a few batches per round, where a
    // session's export and creation would cost about what it saves.
    let backend = backend.engine_backend();
    let stats = canopy_engine::train::evaluate(model, data, batch, backend.as_ref())?;
    Ok(Evaluation {
        loss: stats.loss,
        accuracy: stats.accuracy,
        samples: stats.samples as u64,
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::{Duration, Instant};

    use canopy_engine::backend::ResidentRun;
    use canopy_engine::{CpuBackend, EngineError, EngineResult, Executable, Value};
    use canopy_ir::Graph;
    use canopy_protocol::bounds::MAX_EPOCHS;
    use canopy_protocol::messages::TrainingConfig;

    use super::*;

    fn setup(epochs: u32) -> (Vec<u8>, Task, Dataset) {
        setup_with(epochs, 64)
    }

    fn setup_with(epochs: u32, samples: usize) -> (Vec<u8>, Task, Dataset) {
        let logreg = canopy_engine::zoo::Architecture::LogReg {
            inputs: 8,
            classes: 3,
        };
        setup_model(logreg, &[], epochs, samples)
    }

    /// `architecture` on 8 features and 3 classes, `frozen` frozen.
    fn setup_model(
        architecture: canopy_engine::zoo::Architecture,
        frozen: &[&str],
        epochs: u32,
        samples: usize,
    ) -> (Vec<u8>, Task, Dataset) {
        let config = canopy_engine::zoo::ModelConfig {
            architecture,
            seed: 1,
            optimizer: canopy_engine::optim::Optimizer::parse("sgd").expect("sgd"),
            frozen_prefixes: frozen.iter().map(|p| p.to_string()).collect(),
            producer: "sdk train tests".to_string(),
        };
        let model = canopy_engine::zoo::build_model(&config).expect("model");
        let layout = trainable_layout(&model).expect("layout");
        let bytes = canopy_ir::format::write_model(&model).expect("bytes");
        let features = (0..samples * 8).map(|i| (i % 7) as f32 / 7.0).collect();
        let labels = (0..samples).map(|i| (i % 3) as i64).collect();
        let data = Dataset::new(features, vec![8], labels, 3).expect("dataset");
        let task = Task {
            kind: canopy_protocol::messages::TaskKind::Train,
            dataset: None,
            job_id: 1,
            round_id: 1,
            round_number: 1,
            model_version_id: 1,
            model_digest: String::new(),
            model_size_bytes: bytes.len() as u64,
            model_path: String::new(),
            upload_path: String::new(),
            upload_size_bytes: layout.encoded_len(),
            deadline_unix_ms: 0,
            training: TrainingConfig {
                epochs,
                batch_size: 1,
                learning_rate: 0.05,
            },
            layout,
            secure_aggregation: None,
        };
        (bytes, task, data)
    }

    #[test]
    fn a_cancelled_token_stops_training_before_the_first_batch() {
        let (bytes, task, data) = setup(1);
        let token = CancelToken::new();
        token.cancel();
        assert!(matches!(
            train_task_cancellable(&bytes, &task, &data, 1, &token),
            Err(TrainError::Cancelled)
        ));
    }

    #[test]
    fn cancelling_from_another_thread_stops_training_between_batches() {
        // 4,096 samples, batch 1, the most epochs a task may ask for:
        // minutes of work uncancelled.
        let (bytes, task, data) = setup_with(MAX_EPOCHS, 4_096);
        let token = CancelToken::new();
        let canceller = token.clone();
        let thread = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            canceller.cancel();
        });
        let started = Instant::now();
        let outcome = train_task_cancellable(&bytes, &task, &data, 1, &token);
        assert!(matches!(outcome, Err(TrainError::Cancelled)), "{outcome:?}");
        assert!(started.elapsed() < Duration::from_secs(10));
        thread.join().expect("canceller");
    }

    #[test]
    fn a_task_outside_the_shared_bounds_is_refused_before_training() {
        let (bytes, mut task, data) = setup(MAX_EPOCHS + 1);
        let backend = Recording::default();
        let outcome = train_on(
            &bytes,
            &task,
            &data,
            1,
            Placement::One(&backend),
            &CancelToken::new(),
        );
        let Err(TrainError::InvalidTask(bounds)) = &outcome else {
            panic!("an out-of-bounds task trained: {outcome:?}");
        };
        assert_eq!(bounds.field(), "training.epochs");
        let error = outcome.unwrap_err();
        assert!(error.to_string().contains("training.epochs"), "{error}");
        assert_eq!(
            backend.compiled.load(Ordering::SeqCst),
            0,
            "nothing compiled"
        );
        task.training = TrainingConfig {
            epochs: 1,
            batch_size: 0,
            ..task.training
        };
        let outcome = train_task(&bytes, &task, &data, 1);
        assert!(
            matches!(&outcome, Err(TrainError::InvalidTask(b)) if b.field() == "training.batch_size"),
            "{outcome:?}"
        );
    }

    /// The CPU backend, counting what it compiles and runs.
    #[derive(Default)]
    struct Recording {
        compiled: AtomicUsize,
        runs: Arc<AtomicUsize>,
    }

    struct RecordingExecutable {
        inner: Box<dyn Executable>,
        runs: Arc<AtomicUsize>,
    }

    impl Backend for Recording {
        fn name(&self) -> &'static str {
            "recording"
        }

        fn compile(&self, graph: &Graph) -> EngineResult<Box<dyn Executable>> {
            self.compiled.fetch_add(1, Ordering::SeqCst);
            Ok(Box::new(RecordingExecutable {
                inner: CpuBackend.compile(graph)?,
                runs: self.runs.clone(),
            }))
        }
    }

    impl Executable for RecordingExecutable {
        fn run(&mut self, inputs: Vec<Value>) -> EngineResult<Vec<Value>> {
            self.runs.fetch_add(1, Ordering::SeqCst);
            self.inner.run(inputs)
        }

        fn input_names(&self) -> &[String] {
            self.inner.input_names()
        }

        fn output_names(&self) -> &[String] {
            self.inner.output_names()
        }

        fn make_resident(&mut self, values: Vec<(usize, Value)>) -> EngineResult<()> {
            self.inner.make_resident(values)
        }

        fn run_resident(&mut self, inputs: Vec<Value>) -> EngineResult<ResidentRun> {
            self.runs.fetch_add(1, Ordering::SeqCst);
            self.inner.run_resident(inputs)
        }

        fn read_resident(&mut self) -> EngineResult<Vec<(usize, Value)>> {
            self.inner.read_resident()
        }

        fn snapshot_resident(&mut self) -> EngineResult<()> {
            self.inner.snapshot_resident()
        }

        fn restore_resident(&mut self) -> EngineResult<()> {
            self.inner.restore_resident()
        }
    }

    /// A backend that can run nothing, as a GPU backend refuses an op.
    struct Refusing;

    impl Backend for Refusing {
        fn name(&self) -> &'static str {
            "refusing"
        }

        fn compile(&self, _graph: &Graph) -> EngineResult<Box<dyn Executable>> {
            Err(EngineError::Unsupported {
                backend: "refusing".into(),
                what: "anything".into(),
            })
        }
    }

    /// Evaluation on the GPU gives the CPU's loss and accuracy.
    #[test]
    fn an_evaluation_on_the_gpu_equals_the_cpus() {
        if std::env::var("CANOPY_TEST_BACKENDS").as_deref() == Ok("cpu") {
            return;
        }
        let (bytes, _, data) = setup(1);
        let model = canopy_ir::format::read_model(&bytes).expect("model");
        let on_gpu = evaluate_model_on(&model, &data, 16, &BackendChoice::gpu()).expect("GPU");
        let on_cpu = evaluate_model_on(&model, &data, 16, &BackendChoice::cpu()).expect("CPU");
        assert_eq!(on_gpu.samples, on_cpu.samples);
        assert_eq!(on_gpu.accuracy, on_cpu.accuracy);
        assert!((on_gpu.loss - on_cpu.loss).abs() <= 1e-5 * on_cpu.loss.abs().max(1.0));
    }

    /// A task trained on the GPU gives the CPU's update, to 1e-4 of its
    /// largest value: the same data, seed and loop, another backend.
    #[test]
    fn an_update_trained_on_the_gpu_equals_the_cpus() {
        if std::env::var("CANOPY_TEST_BACKENDS").as_deref() == Ok("cpu") {
            return;
        }
        let (bytes, task, data) = setup(3);
        let cancel = CancelToken::new();
        let gpu = BackendChoice::gpu();
        assert_eq!(gpu.kind(), crate::BackendKind::Gpu, "{gpu}");
        let on_gpu = train_on(
            &bytes,
            &task,
            &data,
            5,
            Placement::One(gpu.engine_backend().as_ref()),
            &cancel,
        )
        .expect("GPU training");
        let on_cpu = train_on(
            &bytes,
            &task,
            &data,
            5,
            Placement::One(&CpuBackend),
            &cancel,
        )
        .expect("CPU training");
        let decode = |u: &LocalUpdate| {
            canopy_protocol::update::decode_update(&u.encoded, &task.layout)
                .expect("decodes")
                .values
        };
        let (g, c) = (decode(&on_gpu), decode(&on_cpu));
        let scale = c.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        assert!(scale > 0.0, "training moved the parameters");
        for (i, (a, b)) in g.iter().zip(&c).enumerate() {
            assert!((a - b).abs() <= 1e-4 * scale, "value {i}: GPU {a}, CPU {b}");
        }
        assert!((on_gpu.train_loss - on_cpu.train_loss).abs() <= 1e-4 * on_cpu.train_loss);
    }

    /// A split placement for a model that freezes nothing but its input
    /// statistics trains the whole step on the head (the backbone backend,
    /// which refuses everything, is never asked): the update is the
    /// one-backend update, bit for bit.
    #[test]
    fn a_split_that_cannot_happen_trains_the_whole_step_on_the_head() {
        let (bytes, task, data) = setup(1);
        let cancel = CancelToken::new();
        let head = Recording::default();
        let placement = Placement::Split {
            backbone: &Refusing,
            head: &head,
        };
        let split = train_on(&bytes, &task, &data, 9, placement, &cancel).expect("train");
        assert_eq!(head.compiled.load(Ordering::SeqCst), 1, "the whole step");
        assert_eq!(head.runs.load(Ordering::SeqCst), 64);
        let plain = train_task(&bytes, &task, &data, 9).expect("train");
        assert_eq!(split.encoded, plain.encoded);
    }

    /// A frozen backbone the backbone's backend cannot take (it refuses
    /// every graph, as ONNX Runtime an op export lacks) trains the whole
    /// step on the head, with the one-backend update.
    #[test]
    fn a_backbone_the_backend_refuses_trains_on_the_head() {
        let mlp = canopy_engine::zoo::Architecture::Mlp {
            inputs: 8,
            hidden: 6,
            classes: 3,
        };
        let (bytes, task, data) = setup_model(mlp, &["fc1"], 1, 64);
        let head = Recording::default();
        let placement = Placement::Split {
            backbone: &Refusing,
            head: &head,
        };
        let cancel = CancelToken::new();
        let split = train_on(&bytes, &task, &data, 3, placement, &cancel).expect("train");
        assert_eq!(
            head.runs.load(Ordering::SeqCst),
            64,
            "every step on the head"
        );
        let plain = train_on(
            &bytes,
            &task,
            &data,
            3,
            Placement::One(&CpuBackend),
            &cancel,
        )
        .expect("train");
        assert_eq!(split.encoded, plain.encoded);
    }

    #[test]
    fn training_runs_on_the_backend_it_is_given() {
        let (bytes, task, data) = setup(2);
        let recording = Recording::default();
        let cancel = CancelToken::new();
        let recorded =
            train_on(&bytes, &task, &data, 9, Placement::One(&recording), &cancel).expect("train");
        assert_eq!(
            recording.compiled.load(Ordering::SeqCst),
            1,
            "one train_step"
        );
        // Batch 1: one step per sample and epoch, each a run of this backend.
        assert_eq!(recording.runs.load(Ordering::SeqCst), 2 * 64);
        // It wraps the CPU, so the update is the default path's, bit for bit.
        let plain = train_task(&bytes, &task, &data, 9).expect("train");
        assert_eq!(recorded.encoded, plain.encoded);
        let refused = train_on(&bytes, &task, &data, 9, Placement::One(&Refusing), &cancel);
        assert!(
            matches!(
                &refused,
                Err(TrainError::Engine(EngineError::Unsupported { backend, .. })) if backend == "refusing"
            ),
            "{refused:?}"
        );
    }
}
