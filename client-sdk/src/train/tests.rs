use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use canopy_engine::backend::ResidentRun;
use canopy_engine::{Backend, CpuBackend, EngineError, EngineResult, Executable, Value};
use canopy_ir::Graph;
use canopy_protocol::bounds::MAX_EPOCHS;
use canopy_protocol::messages::TrainingConfig;

use super::*;
use crate::checkpoint;
use crate::testing::TaskFixture;

/// The default fixture (a logistic regression, batches of 1, 64 samples)
/// for `epochs` epochs.
fn setup(epochs: u32) -> (Vec<u8>, Task, Dataset) {
    TaskFixture {
        epochs,
        ..TaskFixture::default()
    }
    .build()
}

/// Trains on `placement` with the default options.
fn train_placed(
    bytes: &[u8],
    task: &Task,
    data: &Dataset,
    seed: u64,
    placement: Placement<'_>,
) -> Result<LocalUpdate, TrainError> {
    train_on(bytes, task, data, seed, placement, &TrainOptions::default())
}

/// Trains with the default options.
fn train_plainly(bytes: &[u8], task: &Task, data: &Dataset, seed: u64) -> LocalUpdate {
    train_task(bytes, task, data, seed, &TrainOptions::default()).expect("training")
}

#[test]
fn a_cancelled_token_stops_training_before_the_first_batch() {
    let (bytes, task, data) = setup(1);
    let options = TrainOptions::default();
    options.cancel.cancel();
    assert!(matches!(
        train_task(&bytes, &task, &data, 1, &options),
        Err(TrainError::Cancelled)
    ));
}

#[test]
fn cancelling_from_another_thread_stops_training_between_batches() {
    // 4,096 samples, batch 1, the most epochs a task may ask for:
    // minutes of work uncancelled.
    let (bytes, task, data) = TaskFixture {
        epochs: MAX_EPOCHS,
        samples: 4_096,
        ..TaskFixture::default()
    }
    .build();
    let options = TrainOptions::default();
    let canceller = options.cancel.clone();
    let thread = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        canceller.cancel();
    });
    let started = Instant::now();
    let outcome = train_task(&bytes, &task, &data, 1, &options);
    assert!(matches!(outcome, Err(TrainError::Cancelled)), "{outcome:?}");
    assert!(started.elapsed() < Duration::from_secs(10));
    thread.join().expect("canceller");
}

#[test]
fn a_private_task_clips_the_update_it_sends() {
    let (bytes, mut task, data) = setup(2);
    let plain = train_plainly(&bytes, &task, &data, 7);
    let norm = canopy_protocol::update::l2_norm(&plain.delta);
    assert!(norm > 0.0, "training moved the model");
    // Half the update's own length: scaled to exactly that.
    task.privacy = Some(canopy_protocol::messages::TaskPrivacy {
        clip_norm: norm / 2.0,
    });
    let clipped = train_plainly(&bytes, &task, &data, 7);
    let clipped_norm = canopy_protocol::update::l2_norm(&clipped.delta);
    assert!(
        (clipped_norm - norm / 2.0).abs() < 1e-5 * norm,
        "{clipped_norm} vs {norm}"
    );
    for (c, p) in clipped.delta.iter().zip(&plain.delta) {
        assert!((c - p / 2.0).abs() <= 1e-6 * p.abs().max(1e-6), "{c} {p}");
    }
    // What it sends is what it clipped.
    let sent = canopy_protocol::update::decode_update(&clipped.encoded, &task.layout).unwrap();
    assert_eq!(sent.values, clipped.delta);
    // A bound it is within leaves it alone.
    task.privacy = Some(canopy_protocol::messages::TaskPrivacy {
        clip_norm: norm * 2.0,
    });
    assert_eq!(train_plainly(&bytes, &task, &data, 7).delta, plain.delta);
}

#[test]
fn a_task_outside_the_shared_bounds_is_refused_before_training() {
    let (bytes, mut task, data) = setup(MAX_EPOCHS + 1);
    let backend = Recording::default();
    let outcome = train_placed(&bytes, &task, &data, 1, Placement::One(&backend));
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
    let outcome = train_task(&bytes, &task, &data, 1, &TrainOptions::default());
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
    let on = |backend: BackendChoice| evaluate(&model, &data, &EvalOptions { backend, batch: 16 });
    let on_gpu = on(BackendChoice::gpu()).expect("GPU");
    let on_cpu = on(BackendChoice::cpu()).expect("CPU");
    assert_eq!(on_gpu.samples, on_cpu.samples);
    assert_eq!(on_gpu.accuracy, on_cpu.accuracy);
    assert!((on_gpu.loss - on_cpu.loss).abs() <= 1e-5 * on_cpu.loss.abs().max(1.0));
}

/// A model with a loop (a `charlm`) given the GPU trains and evaluates
/// there: the GPU runs loops, so the trainer opens on it with no fallback
/// to the CPU, and the update and the evaluation are the CPU's up to
/// float rounding. (The fallback itself: `placement::tests`, and
/// `training_runs_on_the_backend_it_is_given`.)
#[test]
fn a_loop_model_given_the_gpu_trains_and_evaluates_on_the_gpu() {
    if std::env::var("CANOPY_TEST_BACKENDS").as_deref() == Ok("cpu") {
        return;
    }
    let (bytes, task, data) = TaskFixture {
        architecture: canopy_engine::zoo::Architecture::CharLm {
            vocabulary: crate::testing::CLASSES,
            sequence: crate::testing::FEATURES,
            embedding: 2,
            hidden: 3,
            layers: 1,
            cell: canopy_engine::recurrent::Cell::Gru,
            unrolled: false,
        },
        ..TaskFixture::default()
    }
    .build();
    let gpu = BackendChoice::gpu();
    let model = canopy_ir::format::read_model(&bytes).expect("model");
    canopy_engine::train::Trainer::new(&model, gpu.engine_backend().as_ref(), 5)
        .expect("the GPU takes the charlm's training step, loop and all");
    assert_gpu_update_equals_cpus(&bytes, &task, &data, &gpu);
    let on = |backend: BackendChoice| evaluate(&model, &data, &EvalOptions { backend, batch: 16 });
    let (g, c) = (
        on(gpu).expect("GPU evaluation"),
        on(BackendChoice::cpu()).expect("CPU"),
    );
    assert_eq!((g.accuracy, g.samples), (c.accuracy, c.samples));
    assert!((g.loss - c.loss).abs() <= 1e-5 * c.loss.abs().max(1.0));
}

/// A task trained on the GPU gives the CPU's update, to 1e-4 of its
/// largest value: the same data, seed and loop, another backend.
#[test]
fn an_update_trained_on_the_gpu_equals_the_cpus() {
    if std::env::var("CANOPY_TEST_BACKENDS").as_deref() == Ok("cpu") {
        return;
    }
    let (bytes, task, data) = setup(3);
    let gpu = BackendChoice::gpu();
    assert_eq!(gpu.kind(), crate::BackendKind::Gpu, "{gpu}");
    assert_gpu_update_equals_cpus(&bytes, &task, &data, &gpu);
}

/// Trains `task` for 5 steps on the GPU and on the CPU: every value of the
/// update within 1e-4 of the CPU's largest, the losses within 1e-4.
fn assert_gpu_update_equals_cpus(bytes: &[u8], task: &Task, data: &Dataset, gpu: &BackendChoice) {
    let on_gpu = train_placed(
        bytes,
        task,
        data,
        5,
        Placement::One(gpu.engine_backend().as_ref()),
    )
    .expect("GPU training");
    let on_cpu =
        train_placed(bytes, task, data, 5, Placement::One(&CpuBackend)).expect("CPU training");
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
    let head = Recording::default();
    let placement = Placement::Split {
        backbone: &Refusing,
        head: &head,
    };
    let split = train_placed(&bytes, &task, &data, 9, placement).expect("train");
    assert_eq!(head.compiled.load(Ordering::SeqCst), 1, "the whole step");
    assert_eq!(head.runs.load(Ordering::SeqCst), 64);
    let plain = train_plainly(&bytes, &task, &data, 9);
    assert_eq!(split.encoded, plain.encoded);
}

/// A frozen backbone the backbone's backend cannot take (it refuses
/// every graph, as ONNX Runtime an op export lacks) trains the whole
/// step on the head, with the one-backend update.
#[test]
fn a_backbone_the_backend_refuses_trains_on_the_head() {
    let (bytes, task, data) = TaskFixture {
        frozen: &["fc1"],
        ..TaskFixture::mlp(6)
    }
    .build();
    let head = Recording::default();
    let placement = Placement::Split {
        backbone: &Refusing,
        head: &head,
    };
    let split = train_placed(&bytes, &task, &data, 3, placement).expect("train");
    assert_eq!(
        head.runs.load(Ordering::SeqCst),
        64,
        "every step on the head"
    );
    let plain = train_placed(&bytes, &task, &data, 3, Placement::One(&CpuBackend)).expect("train");
    assert_eq!(split.encoded, plain.encoded);
}

#[test]
fn training_runs_on_the_backend_it_is_given() {
    let (bytes, task, data) = setup(2);
    let recording = Recording::default();
    let recorded =
        train_placed(&bytes, &task, &data, 9, Placement::One(&recording)).expect("train");
    assert_eq!(
        recording.compiled.load(Ordering::SeqCst),
        1,
        "one train_step"
    );
    // Batch 1: one step per sample and epoch, each a run of this backend.
    assert_eq!(recording.runs.load(Ordering::SeqCst), 2 * 64);
    // It wraps the CPU, so the update is the default path's, bit for bit.
    let plain = train_plainly(&bytes, &task, &data, 9);
    assert_eq!(recorded.encoded, plain.encoded);
    // A backend that cannot run the step (one without a kernel for one
    // of its ops) hands it to the CPU: the device's round is not lost.
    let refused = train_placed(&bytes, &task, &data, 9, Placement::One(&Refusing))
        .expect("the CPU takes the step over");
    assert_eq!(refused.encoded, plain.encoded);
}

/// An MLP trained with Adam in batches of 4 (16 steps an epoch), and
/// the logistic regression with SGD in batches of 1 (64 an epoch).
fn resumable_setups() -> Vec<(&'static str, Vec<u8>, Task, Dataset)> {
    let (bytes, task, data) = TaskFixture {
        optimizer: "adam",
        epochs: 3,
        batch_size: 4,
        ..TaskFixture::mlp(6)
    }
    .build();
    let (logreg_bytes, logreg_task, logreg_data) = setup(2);
    vec![
        ("mlp, adam", bytes, task, data),
        ("logreg, sgd", logreg_bytes, logreg_task, logreg_data),
    ]
}

/// Options that checkpoint at `path` every `every` steps, and record
/// every progress report; `stop_at` cancels `cancel` from the progress
/// callback once that many steps are done.
fn checkpointing(
    path: &std::path::Path,
    every: u32,
    stop_at: Option<u64>,
) -> (TrainOptions, Arc<std::sync::Mutex<Vec<TrainProgress>>>) {
    let heard = Arc::new(std::sync::Mutex::new(Vec::new()));
    let cancel = CancelToken::new();
    let (log, canceller) = (heard.clone(), cancel.clone());
    let progress: ProgressCallback = Arc::new(move |progress: TrainProgress| {
        log.lock().expect("progress log").push(progress);
        if stop_at.is_some_and(|stop| progress.steps_done >= stop) {
            canceller.cancel();
        }
    });
    let options = TrainOptions {
        cancel,
        checkpoint: Some(CheckpointSettings {
            path: path.to_path_buf(),
            every_steps: every,
        }),
        progress: Some(progress),
        ..TrainOptions::default()
    };
    (options, heard)
}

/// The default fixture for 2 epochs, and a checkpoint's path in a fresh
/// temporary directory (deleted when the first is dropped).
fn checkpointed_setup() -> (tempfile::TempDir, PathBuf, (Vec<u8>, Task, Dataset)) {
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join("task.ckpt");
    (dir, path, setup(2))
}

/// One training (a model, its task, data and seed) with its checkpoint at
/// `path`, to stop part way and finish.
#[derive(Clone, Copy)]
struct Checkpointed<'a> {
    bytes: &'a [u8],
    task: &'a Task,
    data: &'a Dataset,
    seed: u64,
    path: &'a Path,
}

impl<'a> Checkpointed<'a> {
    fn new(bytes: &'a [u8], task: &'a Task, data: &'a Dataset, path: &'a Path) -> Self {
        Checkpointed {
            bytes,
            task,
            data,
            seed: 5,
            path,
        }
    }

    /// Trains until `steps` steps are done and checks that the run was
    /// cancelled there, leaving a checkpoint.
    fn stop_at(self, steps: u64) {
        let (options, _) = checkpointing(self.path, 10, Some(steps));
        let outcome = train_task(self.bytes, self.task, self.data, self.seed, &options);
        assert!(matches!(outcome, Err(TrainError::Cancelled)), "{outcome:?}");
        let info = checkpoint::peek(self.path).expect("a checkpoint after the cancel");
        assert_eq!(info.steps_done, steps);
        assert_eq!(info.round_id, self.task.round_id);
    }

    /// Trains to the end; returns the update and the step the run resumed
    /// from.
    fn finish(self) -> (LocalUpdate, u64) {
        let (options, heard) = checkpointing(self.path, 10, None);
        let update =
            train_task(self.bytes, self.task, self.data, self.seed, &options).expect("training");
        let heard = heard.lock().expect("progress log");
        let first = heard.first().expect("progress reported");
        let last = heard.last().expect("progress reported");
        assert_eq!(first.steps_done, first.resumed_from_step);
        assert_eq!(last.steps_done, last.total_steps, "{last:?}");
        assert!(!self.path.exists(), "the checkpoint is deleted on success");
        (update, first.resumed_from_step)
    }

    /// Trains to the end, which must resume from step `from` and give the
    /// uninterrupted run's update, bit for bit.
    fn finish_as_uninterrupted(self, from: u64, what: &str) {
        let whole = train_plainly(self.bytes, self.task, self.data, self.seed);
        let (resumed, resumed_from) = self.finish();
        assert_eq!(resumed_from, from, "{what}: resumed from");
        assert!(
            resumed.encoded == whole.encoded,
            "{what}: the encoded update differs"
        );
        let bits = |u: &LocalUpdate| u.delta.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&resumed), bits(&whole), "{what}: delta");
        assert_eq!(
            resumed.train_loss.to_bits(),
            whole.train_loss.to_bits(),
            "{what}: loss"
        );
    }
}

/// Cancelled from its progress callback, a run leaves a checkpoint; the
/// next call (new options, as a new process would make) resumes from it
/// and ends with the uninterrupted run's update, bit for bit.
#[test]
fn a_cancelled_run_resumes_from_its_checkpoint_to_the_uninterrupted_update() {
    let dir = tempfile::tempdir().expect("temporary directory");
    for (what, bytes, task, data) in resumable_setups() {
        let path = dir.path().join(format!("{what}.ckpt"));
        let run = Checkpointed::new(&bytes, &task, &data, &path);
        run.stop_at(37);
        run.finish_as_uninterrupted(37, what);
    }
}

/// A run killed without warning resumes from its last periodic
/// checkpoint: copied aside after step 30's, put back after the run.
#[test]
fn a_killed_run_resumes_from_its_last_periodic_checkpoint() {
    let (_dir, path, (bytes, task, data)) = checkpointed_setup();
    let aside = path.with_file_name("aside.ckpt");
    let run = Checkpointed::new(&bytes, &task, &data, &path);
    let (mut options, _) = checkpointing(&path, 10, None);
    let (from, to) = (path.clone(), aside.clone());
    options.progress = Some(Arc::new(move |progress: TrainProgress| {
        if progress.steps_done == 31 {
            std::fs::copy(&from, &to).expect("copy the checkpoint");
        }
    }));
    train_task(&bytes, &task, &data, run.seed, &options).expect("training");
    assert_eq!(checkpoint::peek(&aside).map(|i| i.steps_done), Some(30));
    std::fs::rename(&aside, &path).expect("put back");
    run.finish_as_uninterrupted(30, "killed after step 30");
}

/// Spoils a checkpoint file's bytes.
type Damage = fn(&mut Vec<u8>);

/// A checkpoint with a flipped byte or cut short is ignored: training
/// starts from the first step and gives the right update.
#[test]
fn a_damaged_checkpoint_is_ignored() {
    let (_dir, path, (bytes, task, data)) = checkpointed_setup();
    let run = Checkpointed::new(&bytes, &task, &data, &path);
    let damages: [(&str, Damage); 4] = [
        ("a flipped byte", |b| {
            let middle = b.len() / 2;
            b[middle] ^= 0x01;
        }),
        ("a flipped magic", |b| b[3] ^= 0x20),
        ("cut short", |b| b.truncate(b.len() - 100)),
        ("emptied", |b| b.clear()),
    ];
    for (what, damage) in damages {
        run.stop_at(21);
        let mut file = std::fs::read(&path).expect("checkpoint");
        damage(&mut file);
        std::fs::write(&path, &file).expect("damage");
        assert!(checkpoint::peek(&path).is_none(), "{what}");
        run.finish_as_uninterrupted(0, what);
    }
}

/// A checkpoint of another seed, round, learning rate or data is not this
/// training's: ignored (and overwritten).
#[test]
fn a_checkpoint_of_other_training_is_ignored() {
    let (_dir, path, (bytes, task, data)) = checkpointed_setup();
    let run = Checkpointed::new(&bytes, &task, &data, &path);
    run.stop_at(21);
    Checkpointed { seed: 6, ..run }.finish_as_uninterrupted(0, "another seed");

    for change in [(|t: &mut Task| t.round_id += 1) as fn(&mut Task), |t| {
        t.training.learning_rate = 0.04
    }] {
        run.stop_at(21);
        let mut other = task.clone();
        change(&mut other);
        let (_, from) = Checkpointed {
            task: &other,
            ..run
        }
        .finish();
        assert_eq!(from, 0);
    }
    run.stop_at(21);
    let other_data = Dataset::new(
        data.features().iter().map(|v| v + 1.0).collect(),
        vec![8],
        data.labels().to_vec(),
        3,
    )
    .expect("dataset");
    let (_, from) = Checkpointed {
        data: &other_data,
        ..run
    }
    .finish();
    assert_eq!(from, 0, "other data");
}

/// Progress counts every step once, in order, with the totals.
#[test]
fn progress_is_reported_before_every_step_and_at_the_end() {
    let (_dir, path, (bytes, task, data)) = checkpointed_setup();
    let (options, heard) = checkpointing(&path, 0, None);
    train_task(&bytes, &task, &data, 5, &options).expect("training");
    let heard = heard.lock().expect("progress log");
    let steps: Vec<u64> = heard.iter().map(|p| p.steps_done).collect();
    assert_eq!(steps, (0..=128).collect::<Vec<_>>());
    let last = heard.last().expect("the end");
    assert_eq!((last.epoch, last.epochs, last.batch), (2, 2, 64));
    assert_eq!((last.batches_per_epoch, last.total_steps), (64, 128));
    assert!(last.mean_loss > 0.0);
    assert!(format!("{options:?}").contains("checkpoint"));
}
