//! The SDK's NPU choice for real: ONNX Runtime (the `onnxruntime` wheel's
//! library, or `ORT_DYLIB_PATH`) runs a frozen backbone while the CPU
//! trains the head, and the update is the all-CPU update.

#[path = "../../npu/tests/common/mod.rs"]
mod ort;

use std::sync::Mutex;

use canopy_engine::data::Dataset;
use canopy_protocol::messages::Task;
use canopy_protocol::update::decode_update;
use canopy_sdk::testing::TaskFixture;
use canopy_sdk::train::{LocalUpdate, TrainOptions, train_task};
use canopy_sdk::{BackendChoice, BackendKind, OrtConfig, Provider, configure_npu, shared_npu};

/// The tests read the shared backend's counters, so they run one at a time.
static NPU_USE: Mutex<()> = Mutex::new(());

fn npu_config() -> OrtConfig {
    ort::config(&[Provider::Cpu])
}

fn npu_choice() -> BackendChoice {
    configure_npu(npu_config()).expect("configure the NPU backend");
    let choice = BackendChoice::npu();
    assert_eq!(choice.kind(), BackendKind::Npu, "{choice}");
    assert_eq!(choice.head(), BackendKind::Cpu);
    choice
}

/// An MLP with `frozen` frozen, its task (2 epochs, batch 4) and 64
/// samples.
fn setup(frozen: &'static [&'static str]) -> (Vec<u8>, Task, Dataset) {
    TaskFixture {
        frozen,
        epochs: 2,
        batch_size: 4,
        learning_rate: 0.1,
        ..TaskFixture::mlp(16)
    }
    .build()
}

fn train(bytes: &[u8], task: &Task, data: &Dataset, backend: BackendChoice) -> LocalUpdate {
    let options = TrainOptions {
        backend,
        ..TrainOptions::default()
    };
    train_task(bytes, task, data, 7, &options).expect("training")
}

/// The values of the update, decoded in the task's layout.
fn values(update: &LocalUpdate, task: &Task) -> Vec<f32> {
    decode_update(&update.encoded, &task.layout)
        .expect("the update decodes in the task's layout")
        .values
}

fn assert_close(npu: &[f32], cpu: &[f32]) {
    assert_eq!(npu.len(), cpu.len());
    let scale = cpu.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    assert!(scale > 0.0, "training moved the parameters");
    for (i, (a, b)) in npu.iter().zip(cpu).enumerate() {
        assert!((a - b).abs() <= 1e-4 * scale, "value {i}: NPU {a}, CPU {b}");
    }
}

#[test]
fn an_npu_choice_trains_the_frozen_backbone_in_onnx_runtime() {
    let _one = NPU_USE.lock().unwrap_or_else(|p| p.into_inner());
    let (bytes, task, data) = setup(&["fc1"]);
    let choice = npu_choice();
    let npu = shared_npu().expect("the NPU opened");
    let (sessions, runs) = (npu.sessions_created(), npu.runs());
    let on_npu = train(&bytes, &task, &data, choice);
    assert_eq!(npu.sessions_created(), sessions + 1, "one backbone session");
    // 64 samples in batches of 4, 2 epochs: one backbone run per step.
    assert_eq!(npu.runs(), runs + 2 * 16);
    let on_cpu = train(&bytes, &task, &data, BackendChoice::cpu());
    assert_close(&values(&on_npu, &task), &values(&on_cpu, &task));
    assert!((on_npu.train_loss - on_cpu.train_loss).abs() <= 1e-4 * on_cpu.train_loss);
}

#[test]
fn with_nothing_frozen_an_npu_choice_trains_on_its_head() {
    let _one = NPU_USE.lock().unwrap_or_else(|p| p.into_inner());
    let (bytes, task, data) = setup(&[]);
    let choice = npu_choice();
    let npu = shared_npu().expect("the NPU opened");
    let (sessions, runs) = (npu.sessions_created(), npu.runs());
    let on_npu = train(&bytes, &task, &data, choice);
    assert_eq!(
        (npu.sessions_created(), npu.runs()),
        (sessions, runs),
        "nothing ran in ONNX Runtime"
    );
    let on_cpu = train(&bytes, &task, &data, BackendChoice::cpu());
    assert_eq!(on_npu.encoded, on_cpu.encoded, "the whole step on the CPU");
}

/// A device reporting an NPU and a GPU trains the backbone on the NPU and
/// the head on the GPU (lavapipe in CI; the CPU with
/// `CANOPY_TEST_BACKENDS=cpu`).
#[test]
fn a_device_reporting_an_npu_gets_it_with_the_head_on_its_gpu() {
    let _one = NPU_USE.lock().unwrap_or_else(|p| p.into_inner());
    npu_choice();
    let capabilities = canopy_protocol::messages::Capabilities {
        tier: canopy_protocol::messages::Tier::End,
        backends: vec!["cpu".into(), "vulkan".into(), "nnapi".into()],
        memory_mb: 2048,
        os: "android".to_string(),
        tags: Default::default(),
        gpu: None,
    };
    let choice = canopy_sdk::choose_backend(&capabilities);
    assert_eq!(choice.kind(), BackendKind::Npu, "{choice}");
    assert_eq!(choice.fallback(), None);
    let gpu_expected = std::env::var("CANOPY_TEST_BACKENDS").as_deref() != Ok("cpu");
    let head = if gpu_expected {
        BackendKind::Gpu
    } else {
        BackendKind::Cpu
    };
    assert_eq!(choice.head(), head, "{choice}");
    assert_eq!(choice.engine_backend().name(), head.as_str());
    assert!(
        choice.npu_backend().is_some(),
        "the backbone runs in ONNX Runtime"
    );
}

#[test]
fn the_npu_cannot_be_reconfigured_once_open() {
    let _one = NPU_USE.lock().unwrap_or_else(|p| p.into_inner());
    npu_choice();
    configure_npu(npu_config()).expect("the same configuration again is fine");
    let other = OrtConfig {
        providers: vec![Provider::Nnapi, Provider::Cpu],
        ..npu_config()
    };
    let error = configure_npu(other).unwrap_err().to_string();
    assert!(
        error.contains("already open") && error.contains("hint:"),
        "{error}"
    );
    let reported = canopy_sdk::available_backends();
    assert!(reported.contains(&"npu".to_string()), "{reported:?}");
}
