//! Training that resumes where a killed run stopped: a fit interrupted
//! mid-epoch, its trainer's state exported, and a new trainer restored
//! from it ends with the parameters and epoch statistics of an
//! uninterrupted fit on the same backend, bit for bit (the CPU, and the
//! GPU, whose kernels are as deterministic).

mod common;

use std::ops::ControlFlow;

use canopy_engine::data::Dataset;
use canopy_engine::nn::{
    Dropout, ForwardCtx, Layer, Linear, Params, ReLU, Sequential, Standardize, correct_count,
    softmax_cross_entropy,
};
use canopy_engine::optim::{INPUT_SEED, Optimizer};
use canopy_engine::tensor::trace;
use canopy_engine::train::{
    EpochStats, EpochSums, FitConfig, FitProgress, Trainer, TrainerState, fit, fit_with_trainer,
};
use canopy_engine::zoo::{
    Architecture, ENTRY_TRAIN_LOSS, ModelConfig, build_model, rebuild_train_step,
};
use canopy_engine::{Backend, CpuBackend, EngineError, Value, optimize_graph};
use canopy_ir::model::{ENTRY_TRAIN_STEP, PARAM_PREFIX};
use canopy_ir::{DType, Dim, Model, Shape, TensorType};

const FEATURES: usize = 8;
const HIDDEN: usize = 16;
const CLASSES: usize = 3;
const SEED: u64 = 11;

/// An MLP whose training pass drops a third of its hidden units: no zoo
/// architecture has dropout, so the MLP's `train_loss` is traced again with
/// a [`Dropout`] after its hidden layer and its `train_step` rebuilt.
fn dropout_mlp(optimizer: Optimizer) -> Model {
    let mut model = build_model(&ModelConfig {
        architecture: Architecture::Mlp {
            inputs: FEATURES,
            hidden: HIDDEN,
            classes: CLASSES,
        },
        seed: 1,
        optimizer,
        frozen_prefixes: vec![],
        producer: "resume test".into(),
    })
    .expect("model");
    let net = Sequential::new()
        .push(Standardize)
        .push(Linear::new("fc1", FEATURES, HIDDEN))
        .push(ReLU)
        .push(Dropout { p: 0.3 })
        .push(Linear::new("fc2", HIDDEN, CLASSES));
    let names: Vec<String> = model.parameters.iter().map(|p| p.name.clone()).collect();
    let mut inputs: Vec<(String, TensorType)> = model
        .parameters
        .iter()
        .map(|p| (format!("{PARAM_PREFIX}{}", p.name), p.data.tensor_type()))
        .collect();
    let n = inputs.len();
    let batch = |dims: Vec<Dim>, dtype| TensorType::new(dtype, Shape(dims));
    inputs.push((
        "x".into(),
        batch(vec![Dim::Batch, Dim::Fixed(FEATURES)], DType::F32),
    ));
    inputs.push(("y".into(), batch(vec![Dim::Batch], DType::I64)));
    inputs.push((INPUT_SEED.into(), TensorType::scalar(DType::I64)));
    let inputs: Vec<(&str, TensorType)> = inputs
        .iter()
        .map(|(name, ty)| (name.as_str(), ty.clone()))
        .collect();
    let graph = trace(&inputs, |args| {
        let params = Params(names.iter().cloned().zip(args.iter().cloned()).collect());
        let ctx = ForwardCtx::training(Some(args[n + 2].clone()));
        let logits = net.forward(&params, &args[n], &ctx)?;
        Ok(vec![
            ("loss".into(), softmax_cross_entropy(&logits, &args[n + 1])?),
            ("correct".into(), correct_count(&logits, &args[n + 1])?),
        ])
    })
    .expect("trace");
    let graph = optimize_graph(&graph).expect("optimize");
    model
        .entry_points
        .insert(ENTRY_TRAIN_LOSS.to_string(), graph);
    rebuild_train_step(&mut model, &optimizer).expect("train_step");
    model
}

/// 42 samples: ten batches of 4 per epoch, and a short one dropped.
fn data() -> Dataset {
    let samples = 42;
    let features = (0..samples * FEATURES)
        .map(|i| ((i * 37 + i / FEATURES * 11) % 17) as f32 / 17.0 - 0.5)
        .collect();
    let labels = (0..samples).map(|i| (i % CLASSES) as i64).collect();
    Dataset::new(features, vec![FEATURES], labels, CLASSES).expect("dataset")
}

fn config() -> FitConfig {
    FitConfig::new(3, 4, 0.05, SEED)
}

/// A value as raw bits, so that `-0.0` and `0.0` differ.
fn bits(state: &TrainerState) -> Vec<(String, Vec<u64>)> {
    state
        .values
        .iter()
        .map(|(name, value)| {
            let raw = match value {
                Value::F32(a) => a.iter().map(|v| u64::from(v.to_bits())).collect(),
                Value::I64(a) => a.iter().map(|v| *v as u64).collect(),
                Value::I32(a) => a.iter().map(|v| *v as u64).collect(),
                Value::Bool(a) => a.iter().map(|v| u64::from(*v)).collect(),
            };
            (name.clone(), raw)
        })
        .collect()
}

/// The state as a checkpoint file would give it back: each value through
/// the model format's tensor data.
fn through_tensor_data(state: &TrainerState) -> TrainerState {
    TrainerState {
        values: state
            .values
            .iter()
            .map(|(name, value)| (name.clone(), Value::from_data(&value.to_data())))
            .collect(),
        ..state.clone()
    }
}

fn uninterrupted(model: &Model, backend: &dyn Backend) -> (TrainerState, Vec<EpochStats>) {
    let mut trainer = Trainer::new(model, backend, SEED).expect("trainer");
    let epochs = fit(&mut trainer, &data(), &config(), &mut |_| {
        ControlFlow::Continue(())
    })
    .expect("fit");
    (trainer.export_state().expect("export"), epochs)
}

/// Where a run stopped: the fit position and the trainer's state.
struct Stopped {
    epoch: u32,
    done: usize,
    sums: EpochSums,
    state: TrainerState,
}

/// Runs until batch `at_batch` of epoch `at_epoch` (from 1) is next, and
/// exports the trainer's state there, as a checkpoint would.
fn interrupted(model: &Model, backend: &dyn Backend, at_epoch: u32, at_batch: usize) -> Stopped {
    let mut trainer = Trainer::new(model, backend, SEED).expect("trainer");
    let mut stopped = None;
    let outcome = fit_with_trainer(
        &mut trainer,
        &data(),
        &config(),
        &mut |trainer, progress| match progress {
            FitProgress::Batch {
                epoch, done, sums, ..
            } if epoch == at_epoch && done == at_batch => {
                let state = trainer.export_state().expect("export");
                stopped = Some(Stopped {
                    epoch,
                    done,
                    sums,
                    state,
                });
                ControlFlow::Break(())
            }
            _ => ControlFlow::Continue(()),
        },
    );
    assert!(
        matches!(outcome, Err(EngineError::Cancelled { .. })),
        "{outcome:?}"
    );
    stopped.expect("the observer stopped the run")
}

/// A new trainer restored from `stopped` and fitted to the end.
fn resumed(
    model: &Model,
    backend: &dyn Backend,
    stopped: &Stopped,
) -> (TrainerState, Vec<EpochStats>) {
    let mut trainer = Trainer::new(model, backend, SEED).expect("trainer");
    trainer
        .restore_state(&through_tensor_data(&stopped.state))
        .expect("restore");
    let full = config();
    let resume = FitConfig {
        start_epoch: stopped.epoch - 1,
        start_batch: stopped.done,
        start_sums: stopped.sums,
        epochs: full.epochs - (stopped.epoch - 1),
        ..full
    };
    let epochs = fit(&mut trainer, &data(), &resume, &mut |_| {
        ControlFlow::Continue(())
    })
    .expect("fit");
    (trainer.export_state().expect("export"), epochs)
}

fn check_resume_is_exact(optimizer: Optimizer) {
    check_resume_on(optimizer, &CpuBackend);
    if let Some(gpu) = common::gpu_under_test() {
        check_resume_on(optimizer, &gpu);
    }
}

fn check_resume_on(optimizer: Optimizer, backend: &dyn Backend) {
    let model = dropout_mlp(optimizer);
    let (whole, whole_epochs) = uninterrupted(&model, backend);
    assert_eq!(whole.steps, 30, "three epochs of ten batches");
    for (epoch, batch) in [(2, 7), (1, 1), (3, 0)] {
        let stopped = interrupted(&model, backend, epoch, batch);
        assert_eq!(
            stopped.state.steps,
            u64::from(epoch - 1) * 10 + batch as u64
        );
        let (after, epochs) = resumed(&model, backend, &stopped);
        assert_eq!(after.steps, whole.steps);
        assert!(
            bits(&after) == bits(&whole),
            "{optimizer} on {}: resumed after batch {batch} of epoch {epoch}, the state differs",
            backend.name()
        );
        // The epoch resumed mid-way reports the uninterrupted epoch's mean.
        let tail = &whole_epochs[whole_epochs.len() - epochs.len()..];
        assert_eq!(
            epochs,
            tail,
            "{optimizer} on {}: epoch statistics",
            backend.name()
        );
    }
}

#[test]
fn sgd_with_momentum_resumes_bit_for_bit() {
    check_resume_is_exact(Optimizer::parse("sgd:momentum=0.9").expect("sgd"));
}

#[test]
fn adam_resumes_bit_for_bit() {
    check_resume_is_exact(Optimizer::adam());
}

/// The dropout test model really drops: its step draws random numbers, so
/// the step count and seed restored are what keep the masks the same.
#[test]
fn the_test_model_draws_dropout_masks() {
    let model = dropout_mlp(Optimizer::adam());
    let step = model.entry(ENTRY_TRAIN_STEP).expect("train_step");
    assert!(
        step.nodes()
            .iter()
            .any(|node| node.op.name() == "random_uniform")
    );
    let state = interrupted(&model, &CpuBackend, 1, 3).state;
    let mut other_seed = Trainer::new(&model, &CpuBackend, SEED + 1).expect("trainer");
    let refused = other_seed.restore_state(&state);
    assert!(
        matches!(&refused, Err(EngineError::Setting(m)) if m.contains("seeded")),
        "{refused:?}"
    );
}

/// A state that does not fit the trainer is refused naming the value,
/// and the trainer is left as it was.
#[test]
fn a_state_of_another_model_is_refused_naming_the_value() {
    let model = dropout_mlp(Optimizer::adam());
    let state = interrupted(&model, &CpuBackend, 1, 2).state;
    let mut trainer = Trainer::new(&model, &CpuBackend, SEED).expect("trainer");
    let fresh = trainer.export_state().expect("export");

    let mut reshaped = state.clone();
    let (name, value) = &mut reshaped.values[0];
    let name = name.clone();
    *value = Value::zeros(DType::F32, &[1, 2, 3]);
    let refused = trainer.restore_state(&reshaped).unwrap_err();
    let text = refused.to_string();
    assert!(text.contains(&name) && text.contains("hint"), "{text}");

    let mut missing = state.clone();
    let (gone, _) = missing.values.pop().expect("a value");
    let refused = trainer.restore_state(&missing).unwrap_err();
    assert!(refused.to_string().contains(&gone), "{refused}");

    let mut extra = state.clone();
    extra
        .values
        .push(("state/nothing/m".into(), Value::scalar_f32(0.0)));
    let refused = trainer.restore_state(&extra).unwrap_err();
    assert!(refused.to_string().contains("state/nothing/m"), "{refused}");

    // A frozen value (the input statistics: no step writes them) that
    // differs belongs to another model.
    let mut frozen = state.clone();
    let (name, value) = frozen
        .values
        .iter_mut()
        .find(|(name, _)| name.ends_with("input.std"))
        .expect("input statistics");
    let name = name.clone();
    *value = Value::F32(value.as_f32().expect("f32").mapv(|v| v * 2.0));
    let refused = trainer.restore_state(&frozen).unwrap_err();
    assert!(refused.to_string().contains(&name), "{refused}");

    assert!(bits(&trainer.export_state().expect("export")) == bits(&fresh));
    assert_eq!(trainer.steps(), 0);
}

/// A resume position past the epoch's batches is refused before a step.
#[test]
fn a_start_batch_past_the_epoch_is_refused() {
    let model = dropout_mlp(Optimizer::sgd());
    let mut trainer = Trainer::new(&model, &CpuBackend, SEED).expect("trainer");
    let config = FitConfig {
        start_batch: 10,
        ..config()
    };
    let refused = fit(&mut trainer, &data(), &config, &mut |_| {
        ControlFlow::Continue(())
    });
    assert!(
        matches!(&refused, Err(EngineError::Setting(m)) if m.contains("batch 10")),
        "{refused:?}"
    );
    assert_eq!(trainer.steps(), 0);
}
