//! Federated jobs: what to train, on which devices, for how many rounds,
//! and the job's own state machine.

use crate::store::row::any_row;
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use canopy_protocol::bounds::{
    self, MAX_BATCH_SIZE, MAX_EPOCHS, MAX_LEARNING_RATE, MAX_SUB_ROUND_VERSIONS,
};
use canopy_protocol::messages::{DeviceRole, SubRound};
use canopy_protocol::secagg::noise::NoiseTarget;
use canopy_protocol::secagg::{Plan, SecAggConfig, SecAggError};
use canopy_protocol::update::MAX_SAMPLES;

use super::{Page, from_json, text_enum};
use crate::config::api_bounds::{
    MAX_DEVICES_PER_ROUND, MAX_FILTER_BACKENDS, MAX_FILTER_TAGS, MAX_JOB_NAME_CHARS,
    MAX_OVER_SELECTION, MAX_ROUND_DEADLINE_MS, MAX_ROUND_RETRIES, MAX_ROUNDS,
    MAX_WAIT_FOR_DEVICES_MS, MIN_ROUND_DEADLINE_MS, MIN_UPLINK_MS, MIN_WAIT_FOR_DEVICES_MS,
};
use crate::db::{Db, now_ms};
use canopy_protocol::messages::{DevicePolicy, GpuDeviceType};

use crate::privacy::DifferentialPrivacy;
use crate::robust::{RobustAggregation, Rule};
use crate::round_failure::RoundFailure;
use crate::strategy::{LearningRateSchedule, StrategySpec};

/// Which devices may take part. Empty fields match every device.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DeviceFilter {
    /// `end` or `edge`.
    #[serde(default)]
    pub tier: Option<String>,
    /// The device must report every one of these backends.
    #[serde(default)]
    #[schema(max_items = 8)]
    pub backends: Vec<String>,
    /// The device must carry every one of these tags with these values.
    #[serde(default)]
    pub tags: BTreeMap<String, String>,
    /// The device must have reported a GPU adapter of one of these types
    /// at enrollment: `["discrete", "integrated"]` asks for real GPUs, which
    /// `backends: ["gpu"]` alone does not (a software adapter such as
    /// lavapipe offers `gpu` too, as type `cpu`).
    #[serde(default)]
    #[schema(schema_with = gpu_types_schema)]
    pub gpu_types: Vec<GpuDeviceType>,
}

fn gpu_types_schema() -> utoipa::openapi::schema::Array {
    use utoipa::openapi::schema::{ArrayBuilder, ObjectBuilder, Type};
    let names = GpuDeviceType::ALL.iter().map(|kind| kind.as_str());
    ArrayBuilder::new()
        .items(
            ObjectBuilder::new()
                .schema_type(Type::String)
                .enum_values(Some(names)),
        )
        .max_items(Some(GpuDeviceType::ALL.len()))
        .unique_items(true)
        .build()
}

/// A job as an operator creates it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct JobSpec {
    // The `schema` bounds state `validate`'s limits in the OpenAPI document.
    #[schema(
        min_length = 1,
        max_length = 128,
        pattern = "^[^\\u0000-\\u001F\\u007F-\\u009F]*$"
    )]
    pub name: String,
    /// The model version the job starts from (`id` of a version).
    pub model_version_id: i64,
    /// Successful rounds to run.
    #[schema(minimum = 1, maximum = 100_000)]
    pub rounds: u32,
    /// Fewest updates that make a round succeed.
    #[schema(minimum = 1, maximum = 100_000)]
    pub min_devices: u32,
    /// Updates at which a round closes early; at least `min_devices`.
    #[schema(minimum = 1, maximum = 100_000)]
    pub target_devices: u32,
    /// Extra devices to select, as a fraction of the target, to absorb dropouts.
    #[serde(default = "default_over_selection")]
    #[schema(minimum = 0, maximum = 4)]
    pub over_selection: f64,
    /// How long devices have to upload, from the moment they are selected.
    #[schema(minimum = 1_000, maximum = 604_800_000)]
    pub round_deadline_ms: u64,
    #[schema(minimum = 1, maximum = 1_000)]
    pub local_epochs: u32,
    #[schema(minimum = 1, maximum = 65_536)]
    pub batch_size: u32,
    #[schema(exclusive_minimum = 0, maximum = 100)]
    pub learning_rate: f64,
    /// How each round's mean update becomes the next model (a server
    /// optimizer); FedAvg when left out. See `docs/strategies.md`.
    #[serde(default)]
    pub strategy: StrategySpec,
    /// How the devices' learning rate changes from round to round;
    /// constant when left out.
    #[serde(default)]
    pub learning_rate_schedule: LearningRateSchedule,
    #[serde(default)]
    pub filters: DeviceFilter,
    /// The states a device must be in to train or evaluate (mobile
    /// devices report them in their heartbeats): charging, an unmetered
    /// network, idle, a minimum battery level. Any device when left out.
    /// A device that does not meet it is not selected, and one that stops
    /// meeting it withdraws as `ineligible`, which is not a dropout.
    #[serde(default, deserialize_with = "strict_device_policy")]
    #[schema(value_type = DevicePolicySchema)]
    pub device_policy: DevicePolicy,
    /// The dataset devices train and evaluate on, by the name they
    /// registered it under (`canopy-agent data add NAME ...`). Only devices
    /// that report it, with samples of the model's input shape, are
    /// selected; when left out, each device uses its default dataset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(min_length = 1, max_length = 64, pattern = "^[A-Za-z0-9_.-]+$")]
    pub dataset: Option<String>,
    /// Failed attempts of one round before the job fails.
    #[serde(default = "default_round_retries")]
    #[schema(maximum = 100)]
    pub max_round_retries: u32,
    /// How long a round may wait for enough eligible devices, from when it
    /// opens (or the job is started or resumed), before the job fails
    /// with the reason it was waiting (failure kind
    /// `no_eligible_devices`). No limit when left out: the job waits, its
    /// status saying why, for devices to enroll or come online.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1_000, maximum = 1_209_600_000)]
    pub max_wait_for_devices_ms: Option<u64>,
    /// How each version the job produces is evaluated; by default every
    /// eligible online device (up to 100) evaluates it on its held-out
    /// data. See `docs/strategies.md`.
    #[serde(default)]
    pub evaluation: EvaluationSpec,
    /// SecAgg+: the server learns only the sum of the updates. See
    /// `docs/secure-aggregation.md`.
    #[serde(default, skip_serializing_if = "is_disabled")]
    #[schema(value_type = SecureAggregationSchema)]
    pub secure_aggregation: SecAggConfig,
    /// Most samples one end device's update may claim; an update that
    /// claims more is refused, so that no device outweighs the others by
    /// misstating its data. No bound beyond the protocol's (2⁴⁰) when
    /// left out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1, maximum = 1_099_511_627_776_u64)]
    pub max_samples_per_device: Option<u64>,
    /// Runs the job through edge aggregators: each round selects
    /// aggregators (devices enrolled with an `aggregator` token), counted
    /// by `min_devices` and `target_devices`, and each runs a sub-round
    /// over its own end devices as this says, then sends this server one
    /// weighted partial result. The job's FedAvg equals FedAvg over every
    /// end device. Flat (end devices straight to this server) when left
    /// out. See `docs/edge.md`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub edges: Option<EdgeTier>,
    /// Runs the job asynchronously (FedBuff, Nguyen et al. 2022): up to
    /// `concurrency` devices train at once, each on the newest version
    /// when it was selected, and every `target_devices` updates (the
    /// buffer size K) make a version, each update weighted down by its
    /// staleness. Each of `rounds` is one buffer. With `edges`, the
    /// devices are aggregators and an update is a sub-round's result.
    /// Synchronous rounds when left out. See `docs/strategies.md`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub asynchronous: Option<Asynchronous>,
    /// Central differential privacy (DP-FedAvg, McMahan et al. 2018):
    /// devices clip their updates to `clip_norm`, every update weighs the
    /// same, and each round's sum gets Gaussian noise of `noise_multiplier`
    /// times the clip. The job's ε is reported after every round, and it
    /// stops before a round that would pass `budget_epsilon`. Not private
    /// when left out. See `docs/privacy.md`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub differential_privacy: Option<DifferentialPrivacy>,
    /// Robust aggregation against poisoned updates: each round combines
    /// its updates by coordinate-wise `median`, `trimmed_mean`, `krum` or
    /// `multi_krum` instead of their weighted mean, each device weighing
    /// the same. The updates are stored in the blob store and aggregated
    /// block by block. FedAvg's mean when left out. See
    /// `docs/robustness.md`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub robust_aggregation: Option<RobustAggregation>,
    /// Compressed updates: devices send each tensor of at least
    /// `min_elements` values as int8, stochastically rounded with a scale
    /// per block of 256 (unbiased, about a quarter of f32's bytes), and
    /// the server decodes them before it folds. f32 when left out. See
    /// `docs/compression.md`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub update_compression: Option<UpdateCompression>,
}

text_enum! {
    /// How a job's devices compress their updates.
    pub enum CompressionScheme {
        /// int8 levels with a scale per block, stochastically rounded.
        Int8 = "int8",
    }
}

/// A job's compressed updates.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UpdateCompression {
    pub scheme: CompressionScheme,
    /// Tensors with fewer values (biases, norms) stay f32: they cost
    /// little and quantising them costs accuracy. TensorFlow Federated's
    /// threshold when left out.
    #[serde(default = "default_int8_min_elements")]
    #[schema(minimum = 1, maximum = 1_073_741_824_u64, default = 20_000)]
    pub min_elements: u64,
}

fn default_int8_min_elements() -> u64 {
    20_000
}

impl UpdateCompression {
    /// What each device's training task asks of its update.
    pub fn task(&self) -> canopy_protocol::messages::TaskCompression {
        canopy_protocol::messages::TaskCompression {
            int8_min_elements: self.min_elements,
        }
    }
}

/// An asynchronous job's settings (FedBuff). A round is a buffer: it
/// opens on the newest version, takes updates from devices selected in
/// it or in earlier buffers, and closes at `target_devices` updates (or
/// at its deadline with at least `min_devices`) into the next version.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Asynchronous {
    /// Devices training at once, over all the job's buffers; at least
    /// `target_devices`, or a buffer could never fill.
    #[schema(minimum = 1, maximum = 100_000)]
    pub concurrency: u32,
    /// Oldest update a buffer takes, in versions: one trained on the
    /// version of a buffer more than this many buffers back is refused
    /// (and its device freed for a new task).
    #[serde(default = "default_max_staleness")]
    #[schema(minimum = 1, maximum = 10_000, default = 20)]
    pub max_staleness: u32,
    /// An update `τ` versions old is weighted `(1 + τ)^-exponent` times
    /// its samples; FedBuff's `1/√(1 + τ)` when left out.
    #[serde(default = "default_staleness_exponent")]
    #[schema(minimum = 0, maximum = 4, default = 0.5)]
    pub staleness_exponent: f64,
}

pub use canopy_protocol::bounds::{MAX_STALENESS, MAX_STALENESS_EXPONENT};

fn default_max_staleness() -> u32 {
    20
}

fn default_staleness_exponent() -> f64 {
    0.5
}

impl Asynchronous {
    /// The weight of an update `staleness` versions old, per sample.
    pub fn staleness_weight(&self, staleness: u64) -> f64 {
        (1.0 + staleness as f64).powf(-self.staleness_exponent)
    }

    /// The settings' bounds, for buffers of `target_devices` (the job's,
    /// or with `prefix` `edges.` an aggregator's): each field is named as
    /// the job spells it.
    fn check(&self, prefix: &str, target_devices: u32) -> Result<(), String> {
        let field = |name: &str| format!("{prefix}asynchronous.{name}");
        check_range(
            &field("concurrency"),
            self.concurrency,
            1,
            MAX_DEVICES_PER_ROUND,
        )?;
        if target_devices > self.concurrency {
            return Err(format!(
                "`{prefix}target_devices` (the buffer size K, {target_devices}) is above `{}` \
                 ({}): a buffer would wait for more updates than devices train at once; lower \
                 `{prefix}target_devices` or raise `{}`",
                field("concurrency"),
                self.concurrency,
                field("concurrency"),
            ));
        }
        if self.max_staleness == 0 {
            return Err(format!(
                "`{}` must be at least 1, got 0: every device would have to finish before the \
                 next version, which is a synchronous round (leave `{prefix}asynchronous` out \
                 for that)",
                field("max_staleness")
            ));
        }
        check_range(
            &field("max_staleness"),
            self.max_staleness,
            1,
            MAX_STALENESS,
        )?;
        let exponent = self.staleness_exponent;
        if !(0.0..=MAX_STALENESS_EXPONENT).contains(&exponent) {
            return Err(out_of_range(
                &field("staleness_exponent"),
                exponent,
                0.0,
                MAX_STALENESS_EXPONENT,
            ));
        }
        Ok(())
    }
}

/// An aggregator's buffers as its local job runs them: the settings the
/// cloud's job gave, back in the job's own form.
impl From<&canopy_protocol::messages::SubRoundBuffers> for Asynchronous {
    fn from(buffers: &canopy_protocol::messages::SubRoundBuffers) -> Self {
        Asynchronous {
            concurrency: buffers.concurrency,
            max_staleness: buffers.max_staleness,
            staleness_exponent: buffers.staleness_exponent,
        }
    }
}

impl From<&Asynchronous> for canopy_protocol::messages::SubRoundBuffers {
    fn from(settings: &Asynchronous) -> Self {
        canopy_protocol::messages::SubRoundBuffers {
            concurrency: settings.concurrency,
            max_staleness: settings.max_staleness,
            staleness_exponent: settings.staleness_exponent,
        }
    }
}

/// A tiered job's sub-rounds, which each selected aggregator runs over
/// its own end devices.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EdgeTier {
    /// Fewest end-device updates that make a sub-round succeed; an
    /// aggregator with fewer sends nothing.
    #[schema(minimum = 1, maximum = 100_000)]
    pub min_devices: u32,
    /// End-device updates at which a sub-round closes early.
    #[schema(minimum = 1, maximum = 100_000)]
    pub target_devices: u32,
    /// Extra end devices each aggregator selects, as a fraction of the target.
    #[serde(default = "default_over_selection")]
    #[schema(minimum = 0, maximum = 4)]
    pub over_selection: f64,
    /// How long a sub-round runs, from when its aggregator is selected;
    /// at least a second less than the job's `round_deadline_ms`, which
    /// leaves the partial result time to reach this server. Nine tenths
    /// of `round_deadline_ms` when left out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1_000, maximum = 604_799_000)]
    pub deadline_ms: Option<u64>,
    /// Versions each aggregator makes from its own devices' updates before
    /// it sends its one result: the difference between its last version
    /// and the round's (hierarchical FedAvg, or with `asynchronous`, an
    /// aggregator that buffers for its devices). Every round's sub-round
    /// must make them by `deadline_ms`. One, a plain sub-round whose
    /// result is its devices' weighted mean, when left out.
    #[serde(default = "one_edge_round", skip_serializing_if = "is_one_edge_round")]
    #[schema(minimum = 1, maximum = 1_000, default = 1)]
    pub rounds: u32,
    /// Each aggregator buffers for its own devices (FedBuff): up to
    /// `concurrency` of them train at once, each on the aggregator's newest
    /// version, and every `edges.target_devices` updates make its next
    /// version, each weighted down by its staleness. Synchronous sub-rounds
    /// when left out. See `docs/edge.md`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub asynchronous: Option<Asynchronous>,
}

fn one_edge_round() -> u32 {
    1
}

fn is_one_edge_round(rounds: &u32) -> bool {
    *rounds == 1
}

impl EdgeTier {
    /// End devices each sub-round selects: its target plus over-selection.
    pub fn selection_size(&self) -> u32 {
        bounds::selection_size(self.target_devices, self.over_selection)
    }
}

fn is_disabled(config: &SecAggConfig) -> bool {
    !config.enabled
}

/// A job's `device_policy`, refusing fields a policy does not have. The
/// protocol's type tolerates them (devices read it inside tasks, from
/// possibly newer servers), but a typo in a job's config must not leave
/// the job unrestricted.
fn strict_device_policy<'de, D>(deserializer: D) -> Result<DevicePolicy, D::Error>
where
    D: serde::Deserializer<'de>,
{
    use serde::de::Error;
    let fields = serde_json::Map::<String, serde_json::Value>::deserialize(deserializer)?;
    if let Some(unknown) = fields
        .keys()
        .find(|name| !DevicePolicy::FIELDS.contains(&name.as_str()))
    {
        return Err(D::Error::custom(format!(
            "`device_policy` has no field `{}`; expected {}",
            unknown.chars().take(64).collect::<String>(),
            DevicePolicy::FIELDS.join(", ")
        )));
    }
    serde_json::from_value(serde_json::Value::Object(fields)).map_err(D::Error::custom)
}

/// The OpenAPI shape of [`DevicePolicy`], which lives in `canopy-protocol`.
/// Every field may be left out (it then asks for nothing).
#[derive(ToSchema)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
pub struct DevicePolicySchema {
    /// Train only while plugged in.
    #[schema(required = false, default = false)]
    requires_charging: bool,
    /// Train only on an unmetered network (Wi-Fi, not cellular data).
    #[schema(required = false, default = false)]
    requires_unmetered_network: bool,
    /// Train only while the device is idle.
    #[schema(required = false, default = false)]
    requires_idle: bool,
    /// Train only with at least this much battery, in percent; 0 asks for
    /// nothing.
    #[schema(required = false, minimum = 0, maximum = 100, default = 0)]
    min_battery_percent: u8,
}

/// The OpenAPI shape of [`SecAggConfig`], which lives in `canopy-protocol`
/// (shared with devices, and free of the server's schema dependency).
/// Every field may be left out (it then takes its default) but none may
/// be `null`, which the protocol type refuses.
#[derive(ToSchema)]
#[allow(dead_code)]
pub struct SecureAggregationSchema {
    #[schema(required = false, default = false)]
    enabled: bool,
    /// Fraction of a round's devices that may drop out at any stage.
    #[schema(required = false, minimum = 0, maximum = 0.5, default = 0.1)]
    max_dropout_fraction: f64,
    /// Fraction of a round's devices that may collude with the server.
    #[schema(required = false, minimum = 0, maximum = 0.3, default = 0.0)]
    max_corrupt_fraction: f64,
    /// Each coordinate of an update is clipped to [-clip, clip].
    #[schema(
        required = false,
        exclusive_minimum = 0,
        maximum = 1_000_000,
        default = 1.0
    )]
    clip: f64,
    /// Ring width b: masking in Z_{2^b}, b bits per element on the wire.
    #[schema(required = false, minimum = 8, maximum = 32, default = 32)]
    bits: u32,
    /// Sample-count weights are capped here.
    #[schema(required = false, minimum = 1, maximum = 1_048_576, default = 1024)]
    max_weight: u64,
}

/// How each version a job produces is evaluated.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EvaluationSpec {
    /// Fraction of the eligible online devices asked to evaluate each new
    /// version on their held-out data (federated evaluation); 0 turns it
    /// off. Evaluating costs a device a download and a forward pass, no
    /// training.
    #[serde(default = "default_evaluation_fraction")]
    #[schema(minimum = 0, maximum = 1, default = 1.0)]
    pub fraction: f64,
    /// At most this many devices evaluate each version.
    #[serde(default = "default_max_evaluators")]
    #[schema(minimum = 1, maximum = 100_000, default = 100)]
    pub max_devices: u32,
    /// How long devices have to report, from the end of the round; the
    /// round deadline when left out. The job completes once its last
    /// version's evaluation has closed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1_000, maximum = 604_800_000)]
    pub deadline_ms: Option<u64>,
    /// A dataset uploaded to the server (`PUT /api/v1/datasets/{name}`)
    /// on which the server evaluates each version the job produces
    /// (central evaluation); its samples must fit the model's input. The
    /// job completes once its last version's central evaluation is stored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(min_length = 1, max_length = 64, pattern = "^[A-Za-z0-9_.-]+$")]
    pub central_dataset: Option<String>,
}

impl Default for EvaluationSpec {
    fn default() -> Self {
        EvaluationSpec {
            fraction: default_evaluation_fraction(),
            max_devices: default_max_evaluators(),
            deadline_ms: None,
            central_dataset: None,
        }
    }
}

fn default_evaluation_fraction() -> f64 {
    1.0
}

fn default_max_evaluators() -> u32 {
    100
}

fn default_over_selection() -> f64 {
    0.3
}

fn default_round_retries() -> u32 {
    3
}

impl JobSpec {
    /// Checks every bound; the message names the field and the limit.
    pub fn validate(&self) -> Result<(), String> {
        self.check_name()?;
        self.check_rounds()?;
        self.check_training()?;
        self.check_filters()?;
        self.check_strategy()?;
        self.check_evaluation()?;
        self.device_policy.validate()?;
        self.check_edges()?;
        self.check_asynchronous()?;
        self.check_secure_aggregation()?;
        self.check_differential_privacy()?;
        self.check_update_compression()?;
        self.robust_rule().map(|_| ())
    }

    /// A job's compressed updates, and what they cannot be combined with.
    fn check_update_compression(&self) -> Result<(), String> {
        let Some(compression) = &self.update_compression else {
            return Ok(());
        };
        let most = canopy_protocol::update::MAX_ELEMENTS as u64;
        if !(1..=most).contains(&compression.min_elements) {
            return Err(format!(
                "`update_compression.min_elements` must be between 1 and {most}, got {}",
                compression.min_elements
            ));
        }
        let refused = |other: &str, why: &str| {
            Err(format!(
                "`update_compression` cannot be combined with `{other}`: {why}"
            ))
        };
        if self.secure_aggregation.enabled {
            return refused(
                "secure_aggregation",
                "a secure round's input is already SecAgg's own fixed-point encoding, masked so \
                 that every value is uniform over the ring, which int8 cannot shrink; a smaller \
                 `secure_aggregation.bits` is the secure round's compression",
            );
        }
        if self.edges.is_some() {
            return refused(
                "edges",
                "an edge's devices take their task from the edge's own job, and an edge sends \
                 its partial sum in f32",
            );
        }
        Ok(())
    }

    /// A robust job's rule, its settings checked, and what it cannot be
    /// combined with; `None` for FedAvg's mean.
    pub fn robust_rule(&self) -> Result<Option<Rule>, String> {
        let Some(robust) = &self.robust_aggregation else {
            return Ok(None);
        };
        let rule = robust.check(self.min_devices, self.selection_size())?;
        let refused = |other: &str, why: &str| {
            Err(format!(
                "`robust_aggregation` cannot be combined with `{other}`: {why}"
            ))
        };
        if self.secure_aggregation.enabled {
            return refused(
                "secure_aggregation",
                "the server sees only the masked sum of a secure round, never the individual \
                 updates a robust rule compares",
            );
        }
        if self.differential_privacy.is_some() {
            return refused(
                "differential_privacy",
                "DP-FedAvg's noise is calibrated to one clipped update's share of the mean, \
                 which a robust rule does not compute",
            );
        }
        if self.asynchronous.is_some() {
            return refused(
                "asynchronous",
                "a buffer's updates come from different versions and are weighted by their \
                 staleness, which the robust rules do not take",
            );
        }
        if self.edges.is_some() {
            return refused(
                "edges",
                "an edge sends the server one partial sum of its devices, not their updates",
            );
        }
        Ok(Some(rule))
    }

    /// A private job's settings, and what they cannot be combined with yet.
    fn check_differential_privacy(&self) -> Result<(), String> {
        let Some(privacy) = &self.differential_privacy else {
            return Ok(());
        };
        privacy.check_fields()?;
        let refused = |other: &str, why: &str| {
            Err(format!(
                "`differential_privacy` cannot be combined with `{other}`: {why}"
            ))
        };
        if self.asynchronous.is_some() {
            return refused(
                "asynchronous",
                "a buffer mixes updates of different versions, which the accountant's \
                 one release per round does not describe",
            );
        }
        if self.edges.is_some() {
            return refused(
                "edges",
                "an edge's partial sum is a weighted mean of its devices, not one clipped \
                 update per device",
            );
        }
        if privacy.adaptive_clipping.is_some() && self.secure_aggregation.enabled {
            return Err(
                "`differential_privacy.adaptive_clipping` cannot be combined with \
                 `secure_aggregation`: the server would have to see which updates the clip left \
                 whole, and a secure round shows it only their masked sum; hint: leave out \
                 `adaptive_clipping` and choose `clip_norm` (for instance as the median update \
                 norm of a run without secure aggregation)"
                    .to_string(),
            );
        }
        privacy.check_adaptive(self.target_devices)?;
        // With secure aggregation the privacy is distributed: devices add
        // the noise before masking (`JobSpec::round_plan`), checked against
        // the model's size when the job is created (`check_private_rounds`).
        Ok(())
    }

    /// An asynchronous job's settings, and what it cannot be combined with.
    fn check_asynchronous(&self) -> Result<(), String> {
        let Some(asynchronous) = &self.asynchronous else {
            return Ok(());
        };
        asynchronous.check("", self.target_devices)?;
        if self.secure_aggregation.enabled {
            return Err(
                "`asynchronous` cannot be combined with `secure_aggregation`: SecAgg+ unmasks \
                 the sum of one fixed cohort, and a buffer's updates come from devices selected \
                 in different buffers"
                    .to_string(),
            );
        }
        Ok(())
    }

    fn check_evaluation(&self) -> Result<(), String> {
        let evaluation = &self.evaluation;
        if !(0.0..=1.0).contains(&evaluation.fraction) {
            return Err(format!(
                "`evaluation.fraction` must be between 0 and 1, got {}",
                evaluation.fraction
            ));
        }
        check_range(
            "evaluation.max_devices",
            evaluation.max_devices,
            1,
            MAX_DEVICES_PER_ROUND,
        )?;
        if let Some(dataset) = &evaluation.central_dataset {
            canopy_protocol::messages::check_dataset_name("`evaluation.central_dataset`", dataset)?;
        }
        if let Some(deadline_ms) = evaluation.deadline_ms {
            check_range(
                "evaluation.deadline_ms",
                deadline_ms,
                MIN_ROUND_DEADLINE_MS,
                MAX_ROUND_DEADLINE_MS,
            )?;
        }
        Ok(())
    }

    /// How long evaluators have to report.
    pub fn evaluation_deadline_ms(&self) -> u64 {
        self.evaluation
            .deadline_ms
            .unwrap_or(self.round_deadline_ms)
    }

    fn check_strategy(&self) -> Result<(), String> {
        self.strategy.resolve()?;
        self.learning_rate_schedule.validate(self.learning_rate)
    }

    /// The learning rate devices train with in round `round` (1-based).
    pub fn learning_rate_at(&self, round: u32) -> f64 {
        self.learning_rate_schedule
            .at(self.learning_rate, round, self.rounds)
    }

    fn check_name(&self) -> Result<(), String> {
        // Characters, as the OpenAPI document's `maxLength` counts them.
        let name_len = self.name.chars().count();
        if name_len == 0 || name_len > MAX_JOB_NAME_CHARS {
            return Err(format!(
                "`name` must be 1 to {MAX_JOB_NAME_CHARS} characters, got {name_len}"
            ));
        }
        // They would let a name forge lines in logs, and PostgreSQL refuses NUL.
        if self.name.chars().any(char::is_control) {
            return Err("`name` contains control characters".to_string());
        }
        Ok(())
    }

    fn check_rounds(&self) -> Result<(), String> {
        check_range("rounds", self.rounds, 1, MAX_ROUNDS)?;
        check_selection(
            "",
            self.min_devices,
            self.target_devices,
            self.over_selection,
        )?;
        check_range(
            "round_deadline_ms",
            self.round_deadline_ms,
            MIN_ROUND_DEADLINE_MS,
            MAX_ROUND_DEADLINE_MS,
        )?;
        check_range(
            "max_round_retries",
            self.max_round_retries,
            0,
            MAX_ROUND_RETRIES,
        )?;
        if let Some(wait_ms) = self.max_wait_for_devices_ms {
            check_range(
                "max_wait_for_devices_ms",
                wait_ms,
                MIN_WAIT_FOR_DEVICES_MS,
                MAX_WAIT_FOR_DEVICES_MS,
            )?;
        }
        Ok(())
    }

    /// Devices refuse a task outside the protocol's bounds, so a job may not
    /// ask for one: the checks are the protocol's, worded as the server's
    /// own bounds are.
    fn check_training(&self) -> Result<(), String> {
        let (epochs, batch_size) = (self.local_epochs, self.batch_size);
        bounds::check_epochs("local_epochs", epochs.into())
            .map_err(|_| out_of_range("local_epochs", epochs, 1, MAX_EPOCHS))?;
        bounds::check_batch_size("batch_size", batch_size.into())
            .map_err(|_| out_of_range("batch_size", batch_size, 1, MAX_BATCH_SIZE))?;
        bounds::check_learning_rate("learning_rate", self.learning_rate).map_err(|_| {
            format!(
                "`learning_rate` must be finite, above 0 and at most {MAX_LEARNING_RATE}, got {}",
                self.learning_rate
            )
        })
    }

    fn check_filters(&self) -> Result<(), String> {
        if let Some(dataset) = &self.dataset {
            canopy_protocol::messages::check_dataset_name("`dataset`", dataset)?;
        }
        if let Some(tier) = &self.filters.tier {
            tier.parse::<canopy_protocol::messages::Tier>()
                .map_err(|_| format!("`filters.tier` must be `end` or `edge`, got `{tier}`"))?;
        }
        let types = &self.filters.gpu_types;
        if types
            .iter()
            .enumerate()
            .any(|(i, kind)| types[..i].contains(kind))
        {
            return Err("`filters.gpu_types` names a type twice".to_string());
        }
        if self.filters.backends.len() > MAX_FILTER_BACKENDS
            || self.filters.tags.len() > MAX_FILTER_TAGS
        {
            return Err(format!(
                "`filters` may name at most {MAX_FILTER_BACKENDS} backends and {MAX_FILTER_TAGS} tags"
            ));
        }
        Ok(())
    }

    /// Checks the secure settings at every tier the job runs: its own
    /// rounds (among aggregators, for a tiered job) and its sub-rounds.
    fn check_secure_aggregation(&self) -> Result<(), String> {
        self.secure_aggregation
            .check_fields()
            .map_err(|error| error.to_string())?;
        if !self.secure_aggregation.enabled {
            return Ok(());
        }
        let (min, max) = (self.min_devices, self.selection_size());
        let Some(edges) = &self.edges else {
            return self
                .secure_aggregation
                .validate(min as usize, max as usize)
                .map_err(|error| format!("{error} (rounds select {min} to {max} devices)"));
        };
        let sub_round_max = edges.selection_size();
        self.secure_aggregation
            .validate(edges.min_devices as usize, sub_round_max as usize)
            .map_err(|error| {
                format!(
                    "{error} (in each sub-round, among its aggregator's end devices: sub-rounds \
                     select {} to {sub_round_max} devices)",
                    edges.min_devices
                )
            })?;
        self.round_secure_aggregation()
            .and_then(|tier| tier.validate(min as usize, max as usize))
            .map_err(|error| {
                format!(
                    "{error} (in the rounds among aggregators: rounds select {min} to {max} \
                     aggregators)"
                )
            })
    }

    /// What the job's secure rounds must carry as distributed differential
    /// privacy: its `differential_privacy`, when it also has secure
    /// aggregation (the server then never sees an un-noised sum).
    pub fn noise_target(&self) -> Option<NoiseTarget> {
        let privacy = self.differential_privacy.as_ref()?;
        let devices = self.noise_source() == Some(crate::privacy::NoiseSource::Devices);
        devices.then_some(NoiseTarget {
            noise_multiplier: privacy.noise_multiplier,
            clip_norm: privacy.clip_norm,
        })
    }

    /// Who adds the noise of a private job; `None` for other jobs.
    pub fn noise_source(&self) -> Option<crate::privacy::NoiseSource> {
        self.differential_privacy.as_ref()?;
        Some(match self.secure_aggregation.enabled {
            true => crate::privacy::NoiseSource::Devices,
            false => crate::privacy::NoiseSource::Server,
        })
    }

    /// The plan of one of the job's secure rounds: `participants` devices
    /// (aggregators, for a tiered job) sending `update_len` values each,
    /// with each device's noise when the job is private.
    pub fn round_plan(&self, participants: usize, update_len: usize) -> Result<Plan, SecAggError> {
        let config = self.round_secure_aggregation()?;
        match self.noise_target() {
            Some(target) => config.private_plan(participants, update_len, &target),
            None => config.plan(participants, update_len),
        }
    }

    /// A private secure job's rounds against its model's `update_len`
    /// trainable values: every round size must leave room for the noise
    /// in the ring, or the job is refused naming the bits it needs. The
    /// graph of each size is [`JobSpec::validate`]'s.
    pub fn check_private_rounds(&self, update_len: usize) -> Result<(), String> {
        let Some(target) = self.noise_target() else {
            return Ok(());
        };
        let (min, max) = (self.min_devices, self.selection_size());
        self.secure_aggregation
            .validate_private_scale(min as usize, max as usize, update_len, &target)
            .map_err(|error| {
                format!(
                    "{error} (rounds select {min} to {max} devices, and the model trains \
                     {update_len} values)"
                )
            })
    }

    /// The SecAgg+ settings of the job's own rounds: the job's, or for a
    /// tiered job the aggregators' tier ([`SecAggConfig::for_aggregators`]),
    /// whose weights are whole sub-rounds'. The sub-rounds run under the
    /// job's own settings ([`JobSpec::sub_round`]).
    pub fn round_secure_aggregation(&self) -> Result<SecAggConfig, SecAggError> {
        match &self.edges {
            None => Ok(self.secure_aggregation.clone()),
            Some(edges) => self
                .secure_aggregation
                .for_aggregators(edges.selection_size(), self.selection_size() as usize),
        }
    }

    /// Devices to select for a round: the target plus over-selection; in
    /// an asynchronous job, the devices that train at once.
    pub fn selection_size(&self) -> u32 {
        match &self.asynchronous {
            Some(asynchronous) => asynchronous.concurrency,
            None => bounds::selection_size(self.target_devices, self.over_selection),
        }
    }

    /// The role of the devices the job's rounds select: aggregators for a
    /// tiered job, end devices otherwise.
    pub fn selects(&self) -> DeviceRole {
        match self.edges {
            Some(_) => DeviceRole::Aggregator,
            None => DeviceRole::Device,
        }
    }

    /// The sub-round an aggregator runs for a round whose task is due at
    /// `deadline_unix_ms`, for a tiered job: it closes `round_deadline_ms
    /// - edges.deadline_ms` before the round, the uplink's time.
    pub fn sub_round(&self, deadline_unix_ms: u64) -> Option<SubRound> {
        let edges = self.edges.as_ref()?;
        let uplink_ms = self.uplink_ms(edges);
        Some(SubRound {
            min_devices: edges.min_devices,
            target_devices: edges.target_devices,
            over_selection: edges.over_selection,
            deadline_unix_ms: deadline_unix_ms.saturating_sub(uplink_ms),
            max_samples_per_device: self.max_samples_per_device.unwrap_or(MAX_SAMPLES),
            secure_aggregation: self
                .secure_aggregation
                .enabled
                .then(|| self.secure_aggregation.clone()),
            rounds: edges.rounds,
            asynchronous: edges.asynchronous.as_ref().map(Into::into),
            // The task's builder signs one for the aggregator it goes to.
            delegation: None,
        })
    }

    /// The sub-round in which an aggregator has its own devices evaluate a
    /// version of a tiered job, for an evaluation task due at
    /// `deadline_unix_ms`: every eligible device of its own, up to
    /// `evaluation.max_devices`, reporting the uplink's time before the
    /// task is due. Unmasked: evaluation reports are not secret.
    pub fn evaluation_sub_round(&self, deadline_unix_ms: u64) -> Option<SubRound> {
        let edges = self.edges.as_ref()?;
        Some(SubRound {
            min_devices: 1,
            target_devices: self.evaluation.max_devices,
            over_selection: 0.0,
            deadline_unix_ms: deadline_unix_ms.saturating_sub(self.uplink_ms(edges)),
            max_samples_per_device: self.max_samples_per_device.unwrap_or(MAX_SAMPLES),
            secure_aggregation: None,
            rounds: 1,
            asynchronous: None,
            delegation: None,
        })
    }

    /// The time a sub-round's outcome has to reach this server: the
    /// round's deadline less the sub-round's.
    fn uplink_ms(&self, edges: &EdgeTier) -> u64 {
        self.round_deadline_ms
            .saturating_sub(self.edge_deadline_ms(edges))
    }

    /// Writes the defaults that depend on other settings into the spec,
    /// so that the stored job, and every reader of it, says what runs.
    pub fn fill_defaults(&mut self) {
        let round_deadline_ms = self.round_deadline_ms;
        if let Some(edges) = self.edges.as_mut() {
            edges
                .deadline_ms
                .get_or_insert(default_edge_deadline_ms(round_deadline_ms));
        }
    }

    /// How long a tiered job's sub-rounds run: `edges.deadline_ms`, or
    /// nine tenths of the round's deadline.
    fn edge_deadline_ms(&self, edges: &EdgeTier) -> u64 {
        edges
            .deadline_ms
            .unwrap_or(default_edge_deadline_ms(self.round_deadline_ms))
    }

    /// An aggregator's own versions: how many per result, and its buffers.
    fn check_edge_versions(&self, edges: &EdgeTier) -> Result<(), String> {
        check_range("edges.rounds", edges.rounds, 1, MAX_SUB_ROUND_VERSIONS)?;
        if let Some(buffers) = &edges.asynchronous {
            buffers.check("edges.", edges.target_devices)?;
        }
        let own_versions = edges.rounds > 1 || edges.asynchronous.is_some();
        if own_versions && self.secure_aggregation.enabled {
            return Err(
                "`edges.rounds` above 1 and `edges.asynchronous` cannot be combined with \
                 `secure_aggregation`: an aggregator that makes versions of its own must see \
                 each of them, and the aggregators' SecAgg+ ring is sized for one sub-round's \
                 weight; hint: leave both out, and each aggregator sends one masked sub-round"
                    .to_string(),
            );
        }
        Ok(())
    }

    fn check_edges(&self) -> Result<(), String> {
        if let Some(bound) = self.max_samples_per_device {
            check_range("max_samples_per_device", bound, 1, MAX_SAMPLES)?;
        }
        let Some(edges) = &self.edges else {
            return Ok(());
        };
        check_selection(
            "edges.",
            edges.min_devices,
            edges.target_devices,
            edges.over_selection,
        )?;
        self.check_edge_versions(edges)?;
        let latest_ms = self.round_deadline_ms.saturating_sub(MIN_UPLINK_MS);
        check_range(
            "edges.deadline_ms",
            self.edge_deadline_ms(edges),
            MIN_ROUND_DEADLINE_MS.min(latest_ms),
            latest_ms,
        )
        .map_err(|e| {
            format!(
                "{e}: a sub-round must close at least {MIN_UPLINK_MS} ms before the round's \
                 `round_deadline_ms`, so that its result can reach this server"
            )
        })?;
        // Evaluation sub-rounds leave the same time for their report.
        let uplink_ms = self.uplink_ms(edges);
        if self.evaluation.fraction > 0.0
            && self.evaluation_deadline_ms() < uplink_ms + MIN_ROUND_DEADLINE_MS
        {
            return Err(format!(
                "`evaluation.deadline_ms` is {} ms, but a tiered job's evaluation must last at \
                 least {MIN_ROUND_DEADLINE_MS} ms more than the {uplink_ms} ms its aggregators \
                 have to report (`round_deadline_ms` less `edges.deadline_ms`)",
                self.evaluation_deadline_ms()
            ));
        }
        Ok(())
    }
}

/// A round's (or, with `prefix` `edges.`, a sub-round's) counts: at least
/// one device, a target not below the minimum, over-selection in bounds.
fn check_selection(
    prefix: &str,
    min_devices: u32,
    target_devices: u32,
    over_selection: f64,
) -> Result<(), String> {
    let min_field = format!("{prefix}min_devices");
    check_range(&min_field, min_devices, 1, MAX_DEVICES_PER_ROUND)?;
    check_range(
        &format!("{prefix}target_devices"),
        target_devices,
        min_devices,
        MAX_DEVICES_PER_ROUND,
    )
    .map_err(|e| format!("{e} (it may not be below `{min_field}`)"))?;
    if !(0.0..=MAX_OVER_SELECTION).contains(&over_selection) {
        return Err(format!(
            "`{prefix}over_selection` must be between 0 and {MAX_OVER_SELECTION}, got {over_selection}"
        ));
    }
    Ok(())
}

/// A sub-round's deadline when the job sets none: nine tenths of the
/// round's, the rest for the result to reach the cloud.
fn default_edge_deadline_ms(round_deadline_ms: u64) -> u64 {
    round_deadline_ms / 10 * 9
}

fn check_range<T: PartialOrd + std::fmt::Display>(
    field: &str,
    value: T,
    low: T,
    high: T,
) -> Result<(), String> {
    if value < low || value > high {
        return Err(out_of_range(field, value, low, high));
    }
    Ok(())
}

fn out_of_range<T: std::fmt::Display>(field: &str, value: T, low: T, high: T) -> String {
    format!("`{field}` must be between {low} and {high}, got {value}")
}

text_enum! {
    /// The states of a job. Rounds run only while it is `running`.
    pub enum JobState {
        Created = "created",
        Running = "running",
        Paused = "paused",
        Completed = "completed",
        Failed = "failed",
        Cancelled = "cancelled",
    }
}

/// An operator's command on a job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JobAction {
    Start,
    Pause,
    Resume,
    Cancel,
}

impl JobAction {
    /// The states the action applies to and the state it leads to.
    fn transition(self) -> (&'static [JobState], JobState) {
        use JobState::*;
        match self {
            JobAction::Start => (&[Created], Running),
            JobAction::Pause => (&[Running], Paused),
            JobAction::Resume => (&[Paused], Running),
            JobAction::Cancel => (&[Created, Running, Paused], Cancelled),
        }
    }

    pub fn verb(self) -> &'static str {
        match self {
            JobAction::Start => "start",
            JobAction::Pause => "pause",
            JobAction::Resume => "resume",
            JobAction::Cancel => "cancel",
        }
    }
}

any_row! {
    #[derive(Clone, Debug)]
    pub struct JobRow {
        pub id: i64,
        pub name: String,
        pub model_version_id: i64,
        pub current_version_id: i64,
        pub config: String,
        pub state: JobState as String,
        pub rounds_completed: i64,
        pub round_failures: i64,
        pub status_message: String,
        pub created_ms: i64,
        pub updated_ms: i64,
        pub started_ms: Option<i64>,
        pub finished_ms: Option<i64>,
        /// A differentially private job's ε spent so far (at its δ); `None`
        /// before its first round, and for any other job.
        pub dp_epsilon: Option<f64>,
        /// With adaptive clipping, the clip its next round takes; `None`
        /// before its first round has adapted it, and for any other job.
        pub dp_clip_norm: Option<f64>,
    }
}

pub const JOB_COLUMNS: &str = "id, name, model_version_id, current_version_id, config, state, \
     rounds_completed, round_failures, status_message, created_ms, updated_ms, started_ms, \
     finished_ms, dp_epsilon, dp_clip_norm";

impl JobRow {
    pub fn spec(&self) -> Result<JobSpec, sqlx::Error> {
        from_json("jobs.config", &self.config)
    }
}

pub async fn insert(db: &Db, spec: &JobSpec) -> Result<JobRow, sqlx::Error> {
    let now = now_ms();
    let _writer = db.write_lock().await;
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "INSERT INTO jobs (name, model_version_id, current_version_id, config, state, \
         created_ms, updated_ms, dp_noise_seed) VALUES ($1, $2, $2, $3, 'created', $4, $4, $5) \
         RETURNING {JOB_COLUMNS}"
    )))
    .bind(spec.name.clone())
    .bind(spec.model_version_id)
    .bind(serde_json::to_string(spec).unwrap_or_default())
    .bind(now)
    .bind(
        spec.differential_privacy
            .as_ref()
            .map(|_| crate::privacy::new_noise_seed()),
    )
    .fetch_one(&db.pool)
    .await
}

/// A private job's noise secret and saved accountant. The secret is read
/// only here, by the orchestrator, and never leaves the server.
pub async fn privacy_state(
    tx: &mut super::rounds::Tx<'_>,
    id: i64,
) -> Result<(Option<String>, Option<String>), sqlx::Error> {
    let row: Option<(Option<String>, Option<String>)> =
        sqlx::query_as("SELECT dp_noise_seed, dp_accountant FROM jobs WHERE id = $1")
            .bind(id)
            .fetch_optional(&mut **tx)
            .await?;
    Ok(row.unwrap_or((None, None)))
}

/// Saves a private job's accountant, the ε it has spent and, with
/// adaptive clipping, its next round's clip, in the transaction that
/// records the round's version.
pub async fn record_privacy(
    tx: &mut super::rounds::Tx<'_>,
    id: i64,
    accountant: &str,
    epsilon: f64,
    next_clip_norm: Option<f64>,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE jobs SET dp_accountant = $1, dp_epsilon = $2, \
         dp_clip_norm = COALESCE($3, dp_clip_norm) WHERE id = $4",
    )
    .bind(accountant)
    .bind(epsilon)
    .bind(next_clip_norm)
    .bind(id)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// The ε each running private job has spent (jobs that have finished a
/// private round), for `/metrics`.
pub async fn privacy_spent_by_running_jobs(db: &Db) -> Result<Vec<(i64, f64)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, dp_epsilon FROM jobs WHERE state = 'running' AND dp_epsilon IS NOT NULL \
         ORDER BY id",
    )
    .fetch_all(&db.pool)
    .await
}

pub async fn get(db: &Db, id: i64) -> Result<Option<JobRow>, sqlx::Error> {
    get_with(&db.pool, id).await
}

/// [`get`] on any executor, e.g. inside a transaction.
pub async fn get_with<'e, E>(executor: E, id: i64) -> Result<Option<JobRow>, sqlx::Error>
where
    E: sqlx::Executor<'e, Database = sqlx::Any>,
{
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {JOB_COLUMNS} FROM jobs WHERE id = $1"
    )))
    .bind(id)
    .fetch_optional(executor)
    .await
}

/// Running jobs with no open round: the ones the orchestrator should open
/// a round for. Column names are unambiguous here, so `JOB_COLUMNS` serves.
pub async fn waiting_for_round(db: &Db) -> Result<Vec<JobRow>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {JOB_COLUMNS} FROM jobs WHERE state = 'running' AND NOT EXISTS \
         (SELECT 1 FROM rounds r WHERE r.job_id = jobs.id AND r.state IN {})",
        super::rounds::OPEN_STATES
    )))
    .fetch_all(&db.pool)
    .await
}

/// Points a job that has not finished a round yet at the version its
/// rounds start from (the job's model with what the job adds to it).
pub async fn set_start_version(
    tx: &mut super::rounds::Tx<'_>,
    id: i64,
    version_id: i64,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE jobs SET current_version_id = $1, updated_ms = $2 \
         WHERE id = $3 AND rounds_completed = 0",
    )
    .bind(version_id)
    .bind(now_ms())
    .bind(id)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// `running` → `failed` with a reason, for a job that cannot go on (its
/// model cannot take what the job asks of it).
pub async fn fail(
    tx: &mut super::rounds::Tx<'_>,
    id: i64,
    reason: &str,
) -> Result<(), sqlx::Error> {
    let now = now_ms();
    sqlx::query(
        "UPDATE jobs SET state = 'failed', finished_ms = $1, updated_ms = $1, \
         status_message = $2 WHERE id = $3 AND state = 'running'",
    )
    .bind(now)
    .bind(reason)
    .bind(id)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// `running` → `completed`, once every round has run and been evaluated
/// (`status_message` empty), or once a private job has spent its budget
/// (the message says so).
pub async fn complete(
    tx: &mut super::rounds::Tx<'_>,
    id: i64,
    status_message: &str,
) -> Result<(), sqlx::Error> {
    let now = now_ms();
    sqlx::query(
        "UPDATE jobs SET state = 'completed', finished_ms = $1, updated_ms = $1, \
         status_message = $2 WHERE id = $3 AND state = 'running'",
    )
    .bind(now)
    .bind(status_message)
    .bind(id)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

pub async fn list(db: &Db, page: Page) -> Result<Vec<JobRow>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {JOB_COLUMNS} FROM jobs WHERE id > $1 ORDER BY id LIMIT $2"
    )))
    .bind(page.after)
    .bind(page.limit)
    .fetch_all(&db.pool)
    .await
}

#[derive(Debug, thiserror::Error)]
pub enum ActionError {
    #[error("job {id} does not exist")]
    NotFound { id: i64 },
    #[error("cannot {verb} job {id}: it is {state}")]
    WrongState {
        id: i64,
        verb: &'static str,
        state: JobState,
    },
    #[error(transparent)]
    Sql(#[from] sqlx::Error),
}

/// Applies an operator's action as a compare-and-set on the state, so two
/// racing requests cannot both succeed. Cancelling also fails the open
/// round, so its devices get 410 on upload.
pub async fn apply_action(db: &Db, id: i64, action: JobAction) -> Result<JobRow, ActionError> {
    let (from, to) = action.transition();
    let now = now_ms();
    let _writer = db.write_lock().await;
    let mut tx = db.pool.begin().await?;
    let job: Option<JobRow> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {JOB_COLUMNS} FROM jobs WHERE id = $1{}",
        db.for_update()
    )))
    .bind(id)
    .fetch_optional(&mut *tx)
    .await?;
    let job = job.ok_or(ActionError::NotFound { id })?;
    if !from.contains(&job.state) {
        return Err(ActionError::WrongState {
            id,
            verb: action.verb(),
            state: job.state,
        });
    }
    let finished = matches!(to, JobState::Cancelled).then_some(now);
    let row: JobRow = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "UPDATE jobs SET state = $1, updated_ms = $2, started_ms = COALESCE(started_ms, $3), \
         finished_ms = COALESCE($4, finished_ms), status_message = $5 WHERE id = $6 RETURNING {JOB_COLUMNS}"
    )))
    .bind(to.as_str())
    .bind(now)
    .bind((to == JobState::Running).then_some(now))
    .bind(finished)
    .bind(match action {
        JobAction::Cancel => "cancelled by an operator",
        JobAction::Pause => "paused by an operator",
        _ => "",
    })
    .bind(id)
    .fetch_one(&mut *tx)
    .await?;
    if action == JobAction::Cancel {
        super::rounds::fail_open_round(db, &mut tx, id, &RoundFailure::Cancelled, now).await?;
    }
    tx.commit().await?;
    Ok(row)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_compression_schema_states_the_formats_bounds() {
        use utoipa::PartialSchema;
        let schema = serde_json::to_value(UpdateCompression::schema()).unwrap();
        let min_elements = &schema["properties"]["min_elements"];
        assert_eq!(
            min_elements["maximum"],
            canopy_protocol::update::MAX_ELEMENTS as u64
        );
        assert_eq!(min_elements["default"], default_int8_min_elements());
    }
}
