//! A task to train in tests: a zoo model, its training task and local data
//! to train it on. Shared by this crate's unit tests and its integration
//! tests, which turn on the `testing` feature (a dev-dependency of the
//! crate on itself); not part of the SDK's API.

use canopy_engine::data::Dataset;
use canopy_engine::optim::Optimizer;
use canopy_engine::zoo::{Architecture, ModelConfig, build_model};
use canopy_protocol::messages::{Task, TaskKind, TrainingConfig};

use crate::train::trainable_layout;

/// Features a sample of the fixture's data has.
pub const FEATURES: usize = 8;
/// Classes its labels take.
pub const CLASSES: usize = 3;

/// What to build: a model of `architecture` on [`FEATURES`] features and
/// [`CLASSES`] classes, with `frozen` frozen, and `samples` samples of
/// data. The default: a logistic regression, SGD, one epoch in batches of
/// one at learning rate 0.05, on 64 samples.
#[derive(Clone, Debug)]
pub struct TaskFixture {
    pub architecture: Architecture,
    /// Prefixes of the parameters to freeze.
    pub frozen: &'static [&'static str],
    /// As [`Optimizer::parse`] reads it.
    pub optimizer: &'static str,
    pub epochs: u32,
    pub batch_size: u32,
    pub learning_rate: f64,
    pub samples: usize,
}

impl Default for TaskFixture {
    fn default() -> TaskFixture {
        TaskFixture {
            architecture: Architecture::LogReg {
                inputs: FEATURES,
                classes: CLASSES,
            },
            frozen: &[],
            optimizer: "sgd",
            epochs: 1,
            batch_size: 1,
            learning_rate: 0.05,
            samples: 64,
        }
    }
}

impl TaskFixture {
    /// The default fixture with an MLP of `hidden` hidden units.
    pub fn mlp(hidden: usize) -> TaskFixture {
        TaskFixture {
            architecture: Architecture::Mlp {
                inputs: FEATURES,
                hidden,
                classes: CLASSES,
            },
            ..TaskFixture::default()
        }
    }

    /// The model file, its training task (layout and sizes filled in) and
    /// the data, labels cycling through the classes.
    pub fn build(&self) -> (Vec<u8>, Task, Dataset) {
        let model = build_model(&ModelConfig {
            architecture: self.architecture.clone(),
            seed: 1,
            optimizer: Optimizer::parse(self.optimizer).expect("optimizer"),
            frozen_prefixes: self.frozen.iter().map(|p| p.to_string()).collect(),
            producer: "canopy-sdk tests".to_string(),
        })
        .expect("model");
        let layout = trainable_layout(&model).expect("layout");
        let bytes = canopy_ir::format::write_model(&model).expect("bytes");
        let features = (0..self.samples * FEATURES)
            .map(|i| (i % 7) as f32 / 7.0)
            .collect();
        let labels = (0..self.samples).map(|i| (i % CLASSES) as i64).collect();
        let data = Dataset::new(features, vec![FEATURES], labels, CLASSES).expect("dataset");
        let task = Task {
            kind: TaskKind::Train,
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
                epochs: self.epochs,
                batch_size: self.batch_size,
                learning_rate: self.learning_rate,
            },
            layout,
            secure_aggregation: None,
            sub_round: None,
            privacy: None,
            compression: None,
            policy: Default::default(),
        };
        (bytes, task, data)
    }
}
