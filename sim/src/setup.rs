//! What a simulation sets up before its devices run: the data (the bundled
//! UCI digits, or a dataset on disk), the starting model, and the job's
//! settings. Tests that compare a simulation with real agents build the
//! same three from here.

use std::path::Path;

use canopy_engine::data::{Dataset, LabelColumn, load_csv, load_dir};
use canopy_engine::optim::Optimizer;
use canopy_engine::zoo::{Architecture, ModelConfig, build_model, fit_input_stats};
use serde_json::{Value, json};

/// The UCI digits (1,797 8x8 images; `datasets/README.md`), bundled so a
/// simulation runs from any directory with no data of its own.
pub const DIGITS_CSV_GZ: &[u8] = include_bytes!("../../datasets/digits/digits.csv.gz");
/// `--data` naming the bundled digits.
pub const BUNDLED_DIGITS: &str = "digits";
/// Share of a single-file dataset held out for the server's central
/// evaluation (a folder of IDX files brings its own test split).
pub const TEST_FRACTION: f64 = 0.2;
/// Most rounds a simulated job runs.
pub const MAX_ROUNDS: u32 = 10_000;
/// Most hidden units of the simulation's MLP.
pub const MAX_HIDDEN: usize = 4_096;

/// Why the data or the model could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error("cannot load --data {path}")]
    Load {
        path: String,
        #[source]
        source: Box<canopy_engine::EngineError>,
    },
    #[error("cannot write the bundled digits to {path}")]
    Bundled {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot build the simulation's model")]
    Model(#[source] canopy_engine::EngineError),
    #[error("cannot encode the simulation's model")]
    Encode(#[source] canopy_ir::IrError),
}

/// The devices' data and the server's held-out split.
pub struct SimData {
    pub train: Dataset,
    pub test: Dataset,
}

/// `--data`: the bundled digits, a folder of IDX files (its own train and
/// test split), or one CSV file (the label last; 20 % held out by `seed`).
/// `scratch` holds the bundled file while it is read.
pub fn load(data: &str, seed: u64, scratch: &Path) -> Result<SimData, SetupError> {
    let loaded = |source| SetupError::Load {
        path: data.to_string(),
        source: Box::new(source),
    };
    if data == BUNDLED_DIGITS {
        let path = scratch.join("digits.csv.gz");
        std::fs::write(&path, DIGITS_CSV_GZ).map_err(|source| SetupError::Bundled {
            path: path.display().to_string(),
            source,
        })?;
        return split_file(&path, seed).map_err(loaded);
    }
    let path = Path::new(data);
    if path.is_dir() {
        let (train, test) = load_dir(path).map_err(loaded)?;
        return Ok(SimData { train, test });
    }
    split_file(path, seed).map_err(loaded)
}

fn split_file(path: &Path, seed: u64) -> Result<SimData, canopy_engine::EngineError> {
    let all = load_csv(path, LabelColumn::Last)?;
    let (train, test) = all.split(TEST_FRACTION, seed)?;
    Ok(SimData { train, test })
}

/// An MLP for `train` (its flattened inputs, `hidden` units, its classes)
/// with SGD, the input statistics fitted on `train` in the cloud and
/// shipped as frozen parameters, as the demo's model is. With MNIST's 784
/// inputs and 128 hidden units it has 101,770 parameters.
pub fn initial_model(train: &Dataset, hidden: usize, seed: u64) -> Result<Vec<u8>, SetupError> {
    let inputs = train.feature_shape().iter().product();
    let mut model = build_model(&ModelConfig {
        architecture: Architecture::Mlp {
            inputs,
            hidden,
            classes: train.num_classes(),
        },
        seed,
        optimizer: Optimizer::parse("sgd").map_err(SetupError::Model)?,
        frozen_prefixes: Vec::new(),
        producer: format!("canopy simulate {}", env!("CARGO_PKG_VERSION")),
    })
    .map_err(SetupError::Model)?;
    model.metadata.model_name = "sim-mlp".to_string();
    fit_input_stats(&mut model, train).map_err(SetupError::Model)?;
    canopy_ir::format::write_model(&model).map_err(SetupError::Encode)
}

/// A simulated job's settings.
#[derive(Clone, Debug)]
pub struct JobSettings {
    pub name: String,
    pub rounds: u32,
    /// Devices each round trains (and needs).
    pub per_round: u32,
    pub epochs: u32,
    pub batch_size: u32,
    pub learning_rate: f64,
    pub round_deadline_ms: u64,
    /// The held-out dataset on the server that evaluates each version.
    pub central_dataset: Option<String>,
    /// The job's `strategy` (JSON); FedAvg when `None`.
    pub strategy: Option<Value>,
    /// The job's `differential_privacy` (JSON); not private when `None`.
    pub privacy: Option<Value>,
    /// The job's `robust_aggregation` (JSON); FedAvg's mean when `None`.
    pub robust: Option<Value>,
    /// The job's `update_compression` (JSON); f32 updates when `None`.
    pub compression: Option<Value>,
    /// Asynchronous rounds (FedBuff), with `per_round` devices training at
    /// once; synchronous rounds when `None`.
    pub buffer: Option<Buffer>,
}

/// An asynchronous job's buffer.
#[derive(Clone, Copy, Debug)]
pub struct Buffer {
    /// Updates per version (K).
    pub size: u32,
    /// The oldest update a version takes, in versions.
    pub max_staleness: u32,
    /// An update τ versions old weighs (1 + τ)^-exponent times its samples.
    pub staleness_exponent: f64,
}

impl JobSettings {
    /// The `POST /api/v1/jobs` body for a job from `model_version_id`.
    pub fn body(&self, model_version_id: i64) -> Value {
        let mut evaluation = json!({});
        if let Some(dataset) = &self.central_dataset {
            evaluation["central_dataset"] = json!(dataset);
        }
        let mut body = json!({
            "name": self.name,
            "model_version_id": model_version_id,
            "rounds": self.rounds,
            "min_devices": self.per_round,
            "target_devices": self.per_round,
            "over_selection": 0.0,
            "round_deadline_ms": self.round_deadline_ms,
            "local_epochs": self.epochs,
            "batch_size": self.batch_size,
            "learning_rate": self.learning_rate,
            "max_round_retries": 3,
            "evaluation": evaluation,
        });
        if let Some(strategy) = &self.strategy {
            body["strategy"] = strategy.clone();
        }
        if let Some(privacy) = &self.privacy {
            body["differential_privacy"] = privacy.clone();
        }
        if let Some(robust) = &self.robust {
            body["robust_aggregation"] = robust.clone();
        }
        if let Some(compression) = &self.compression {
            body["update_compression"] = compression.clone();
        }
        if let Some(buffer) = self.buffer {
            // A buffer at its deadline makes a version of what it has.
            body["min_devices"] = json!(1);
            body["target_devices"] = json!(buffer.size);
            body["asynchronous"] = json!({
                "concurrency": self.per_round,
                "max_staleness": buffer.max_staleness,
                "staleness_exponent": buffer.staleness_exponent,
            });
        }
        body
    }
}
