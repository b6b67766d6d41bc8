//! JSON bodies of the device API.
//!
//! Requests (device to server) reject unknown fields, so a typo in a client
//! fails loudly instead of being ignored. Responses accept unknown fields, so
//! a newer server can add fields without breaking older devices.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::update::{MAX_SAMPLES, UpdateLayout};

pub const MAX_BACKENDS: usize = 8;
pub const MAX_BACKEND_CHARS: usize = 32;
pub const MAX_OS_CHARS: usize = 64;
pub const MAX_TAGS: usize = 32;
pub const MAX_TAG_KEY_CHARS: usize = 64;
pub const MAX_TAG_VALUE_CHARS: usize = 256;
/// 16 TiB; anything above is a bug or a lie.
pub const MAX_MEMORY_MB: u64 = 1 << 24;
pub const MAX_HEARTBEAT_STATE_CHARS: usize = 64;
/// Adapter names are short ("NVIDIA H100 80GB HBM3", "Apple M2 Pro",
/// "llvmpipe (LLVM 15.0.6, 256 bits)"); drivers a little longer.
pub const MAX_ADAPTER_NAME_CHARS: usize = 128;
pub const MAX_ADAPTER_DRIVER_CHARS: usize = 128;

/// The class of device: `End` devices (phones, sensors) and `Edge` devices
/// (gateways, on-premise boxes) are scheduled into separate rounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    End,
    Edge,
}

impl Tier {
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::End => "end",
            Tier::Edge => "edge",
        }
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Tier {
    type Err = ParseTierError;

    fn from_str(s: &str) -> Result<Tier, ParseTierError> {
        match s {
            "end" => Ok(Tier::End),
            "edge" => Ok(Tier::Edge),
            other => Err(ParseTierError {
                given: other.chars().take(MAX_OS_CHARS).collect(),
            }),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("device tier `{given}` is unknown; expected `end` or `edge`")]
pub struct ParseTierError {
    pub given: String,
}

/// What a device can do, declared at enrollment and used for scheduling.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Capabilities {
    pub tier: Tier,
    /// Execution backends the device's engine offers, e.g. `cpu`.
    pub backends: Vec<String>,
    pub memory_mb: u64,
    pub os: String,
    /// Free-form labels that jobs can select devices by.
    #[serde(default)]
    pub tags: BTreeMap<String, String>,
    /// The adapter the device's `gpu` backend runs on. Only a device that
    /// offers `gpu` in `backends` may describe one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<GpuAdapter>,
}

/// The GPU behind a device's `gpu` backend, as its graphics API reports it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuAdapter {
    pub name: String,
    pub api: GpuApi,
    pub device_type: GpuDeviceType,
    /// Driver name and version, where the API reports them.
    #[serde(default)]
    pub driver: String,
}

/// The graphics API an adapter is driven through.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GpuApi {
    Vulkan,
    Metal,
    Dx12,
    Gl,
}

/// What kind of device an adapter is. `Cpu` is a software implementation
/// (Mesa's lavapipe, SwiftShader): it runs GPU code, slowly.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GpuDeviceType {
    Discrete,
    Integrated,
    Virtual,
    Cpu,
    Other,
}

/// The lowercase names both enums are sent as, and parsed from.
macro_rules! wire_names {
    ($type:ident, $what:literal, { $($variant:ident => $name:literal),+ $(,)? }) => {
        impl $type {
            pub const ALL: &'static [$type] = &[$($type::$variant),+];

            pub fn as_str(self) -> &'static str {
                match self {
                    $($type::$variant => $name),+
                }
            }
        }

        impl fmt::Display for $type {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromStr for $type {
            type Err = String;

            fn from_str(text: &str) -> Result<$type, String> {
                $type::ALL
                    .iter()
                    .copied()
                    .find(|value| value.as_str() == text)
                    .ok_or_else(|| {
                        let names: Vec<&str> = $type::ALL.iter().map(|v| v.as_str()).collect();
                        format!(
                            "{} `{}` is unknown; expected one of {}",
                            $what,
                            truncate_for_message(text),
                            names.join(", ")
                        )
                    })
            }
        }
    };
}

wire_names!(DeviceRole, "device role", {
    Device => "device", Aggregator => "aggregator",
});
wire_names!(GpuApi, "graphics API", {
    Vulkan => "vulkan", Metal => "metal", Dx12 => "dx12", Gl => "gl",
});
wire_names!(GpuDeviceType, "adapter type", {
    Discrete => "discrete", Integrated => "integrated", Virtual => "virtual",
    Cpu => "cpu", Other => "other",
});

impl GpuAdapter {
    fn validate(&self) -> Result<(), String> {
        let checks = [
            ("name", &self.name, 1, MAX_ADAPTER_NAME_CHARS),
            ("driver", &self.driver, 0, MAX_ADAPTER_DRIVER_CHARS),
        ];
        for (field, text, min_chars, max_chars) in checks {
            let chars = text.chars().count();
            if !(min_chars..=max_chars).contains(&chars) {
                return Err(format!(
                    "capabilities.gpu.{field} is {chars} characters; it must be {min_chars}..={max_chars}"
                ));
            }
            // As for `os`: no forged lines in server logs.
            if text.chars().any(char::is_control) {
                return Err(format!(
                    "capabilities.gpu.{field} contains control characters"
                ));
            }
        }
        Ok(())
    }
}

impl Capabilities {
    /// Checks the size limits and character sets, naming the offending field.
    pub fn validate(&self) -> Result<(), String> {
        if self.backends.len() > MAX_BACKENDS {
            return Err(format!(
                "capabilities.backends has {} entries, the limit is {MAX_BACKENDS}",
                self.backends.len()
            ));
        }
        for (index, backend) in self.backends.iter().enumerate() {
            let length = backend.chars().count();
            let charset_ok = backend
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-');
            if !(1..=MAX_BACKEND_CHARS).contains(&length) || !charset_ok {
                return Err(format!(
                    "capabilities.backends[{index}] `{}` must be 1..={MAX_BACKEND_CHARS} characters of [a-z0-9_-]",
                    truncate_for_message(backend)
                ));
            }
        }
        if self.memory_mb > MAX_MEMORY_MB {
            return Err(format!(
                "capabilities.memory_mb {} is above the limit of {MAX_MEMORY_MB}",
                self.memory_mb
            ));
        }
        let os_chars = self.os.chars().count();
        if os_chars > MAX_OS_CHARS {
            return Err(format!(
                "capabilities.os is {os_chars} characters, the limit is {MAX_OS_CHARS}"
            ));
        }
        // Control characters would let a device forge lines in server logs.
        if self.os.chars().any(char::is_control) {
            return Err("capabilities.os contains control characters".to_string());
        }
        if self.tags.len() > MAX_TAGS {
            return Err(format!(
                "capabilities.tags has {} entries, the limit is {MAX_TAGS}",
                self.tags.len()
            ));
        }
        for (key, value) in &self.tags {
            let key_chars = key.chars().count();
            let key_ok = key
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
            if !(1..=MAX_TAG_KEY_CHARS).contains(&key_chars) || !key_ok {
                return Err(format!(
                    "capabilities.tags key `{}` must be 1..={MAX_TAG_KEY_CHARS} characters of [A-Za-z0-9_.-]",
                    truncate_for_message(key)
                ));
            }
            let value_chars = value.chars().count();
            if value_chars > MAX_TAG_VALUE_CHARS {
                return Err(format!(
                    "capabilities.tags[`{key}`] is {value_chars} characters, the limit is {MAX_TAG_VALUE_CHARS}"
                ));
            }
            if value.chars().any(char::is_control) {
                return Err(format!(
                    "capabilities.tags[`{key}`] contains control characters"
                ));
            }
        }
        self.validate_gpu()
    }

    fn validate_gpu(&self) -> Result<(), String> {
        let offers_gpu = self.backends.iter().any(|backend| backend == "gpu");
        match &self.gpu {
            Some(adapter) if offers_gpu => adapter.validate(),
            Some(_) => Err(
                "capabilities.gpu describes an adapter, but capabilities.backends does not offer `gpu`"
                    .to_string(),
            ),
            // A device may offer `gpu` without knowing its adapter (an
            // older agent, or a platform that does not say).
            None => Ok(()),
        }
    }
}

/// Echoing a hostile multi-megabyte string into an error message would
/// defeat the limit it violated.
fn truncate_for_message(s: &str) -> String {
    const SHOWN_CHARS: usize = 64;
    let mut shown: String = s
        .chars()
        .take(SHOWN_CHARS)
        .map(|c| if c.is_control() { '\u{FFFD}' } else { c })
        .collect();
    if s.chars().nth(SHOWN_CHARS).is_some() {
        shown.push('…');
    }
    shown
}

/// `POST` body of enrollment: a one-time token and the device's new key.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnrollRequest {
    pub enrollment_token: String,
    /// 64 lowercase hex characters; see [`crate::auth::parse_public_key_hex`].
    pub public_key: String,
    pub capabilities: Capabilities,
    /// The role the device enrolls in; the token must be one of that role.
    #[serde(default)]
    pub role: DeviceRole,
}

/// What an enrolled device is to the server that enrolled it. A `device`
/// trains on its own data; an `aggregator` is an edge node that runs
/// sub-rounds over the end devices enrolled with it and answers for them
/// with one partial result (ARCHITECTURE.md, "The edge tier"). An
/// enrollment token enrolls devices of one role.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceRole {
    #[default]
    Device,
    Aggregator,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnrollResponse {
    pub device_id: i64,
    /// Key that model signatures verify against; see [`crate::model_sig`].
    pub server_public_key: String,
    pub heartbeat_interval_ms: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainingConfig {
    pub epochs: u32,
    pub batch_size: u32,
    pub learning_rate: f64,
}

/// What a task asks of a device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TaskKind {
    /// Train the model and send the change of its trainable parameters to
    /// `upload_path` (or through secure aggregation).
    #[default]
    Train,
    /// Evaluate the model on the device's held-out data and send an
    /// [`EvaluationReport`] to `upload_path`; no training, no update.
    Evaluate,
    /// A statistics round, before a job trains a model whose input
    /// statistics are unfitted: send the moments of the training split's
    /// inputs as an update in [`crate::update::statistics_layout`] (per
    /// feature, the mean and the mean of squares; the sample count as the
    /// weight) to `upload_path`. The server adds them up into the
    /// statistics of all the devices' data; no training.
    Statistics,
}

impl TaskKind {
    pub fn is_train(&self) -> bool {
        *self == TaskKind::Train
    }
}

/// Highest battery level, in percent.
pub const MAX_BATTERY_PERCENT: u8 = 100;

/// The state a device is in now, as a mobile app reads it from the
/// platform: what a job's [`DevicePolicy`] is checked against.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceConditions {
    /// Plugged in to a charger.
    pub charging: bool,
    /// On a network the user does not pay for by the byte (Wi-Fi, not
    /// cellular data).
    pub unmetered_network: bool,
    /// Not in use: the screen is off, or the platform says the device is
    /// idle.
    pub idle: bool,
    /// 0 to 100.
    pub battery_percent: u8,
}

impl DeviceConditions {
    /// Checks the battery level, naming the field as in a withdrawal.
    pub fn validate(&self) -> Result<(), String> {
        self.validate_as("conditions")
    }

    /// [`DeviceConditions::validate`], naming the field under `prefix`.
    fn validate_as(&self, prefix: &str) -> Result<(), String> {
        check_battery_percent(&format!("{prefix}.battery_percent"), self.battery_percent)
    }
}

/// A battery level is a percentage.
fn check_battery_percent(field: &str, percent: u8) -> Result<(), String> {
    if percent > MAX_BATTERY_PERCENT {
        return Err(format!(
            "`{field}` must be between 0 and {MAX_BATTERY_PERCENT}, got {percent}"
        ));
    }
    Ok(())
}

/// The states a device must be in to train for a job: a job's
/// `device_policy`, shipped in every task as [`Task::policy`]. The default
/// asks for nothing, so every device may train.
///
/// Devices check it before they train ([`DevicePolicy::check`]); a device
/// that no longer meets it withdraws ([`WithdrawTask`]) rather than
/// declining, and is not counted as a dropout. Unknown fields are ignored
/// (a policy reaches devices inside a task, a response), so a newer
/// server can add a requirement without breaking older devices; the
/// server refuses them in a job's config.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct DevicePolicy {
    /// Train only while plugged in.
    #[serde(default)]
    pub requires_charging: bool,
    /// Train only on an unmetered network.
    #[serde(default)]
    pub requires_unmetered_network: bool,
    /// Train only while the device is idle.
    #[serde(default)]
    pub requires_idle: bool,
    /// Train only with at least this much battery, 0 to 100; 0 asks for
    /// nothing.
    #[serde(default)]
    pub min_battery_percent: u8,
}

impl DevicePolicy {
    /// The fields of a policy as its JSON names them, so that a job's
    /// config can refuse any other name.
    pub const FIELDS: &'static [&'static str] = &[
        "requires_charging",
        "requires_unmetered_network",
        "requires_idle",
        "min_battery_percent",
    ];

    /// Checks the battery level, naming the field as a job's config does.
    pub fn validate(&self) -> Result<(), String> {
        check_battery_percent(
            "device_policy.min_battery_percent",
            self.min_battery_percent,
        )
    }

    /// True when the policy asks for nothing: every device may train.
    pub fn is_unrestricted(&self) -> bool {
        *self == DevicePolicy::default()
    }

    /// Whether a device in `conditions` may train; the error lists every
    /// requirement it does not meet.
    pub fn check(&self, conditions: &DeviceConditions) -> Result<(), Ineligible> {
        let flags = [
            (self.requires_charging, conditions.charging, Unmet::Charging),
            (
                self.requires_unmetered_network,
                conditions.unmetered_network,
                Unmet::UnmeteredNetwork,
            ),
            (self.requires_idle, conditions.idle, Unmet::Idle),
        ];
        let mut unmet: Vec<Unmet> = flags
            .into_iter()
            .filter(|&(required, met, _)| required && !met)
            .map(|(_, _, requirement)| requirement)
            .collect();
        if conditions.battery_percent < self.min_battery_percent {
            unmet.push(Unmet::Battery {
                percent: conditions.battery_percent,
                minimum: self.min_battery_percent,
            });
        }
        if unmet.is_empty() {
            Ok(())
        } else {
            Err(Ineligible { unmet })
        }
    }
}

/// One requirement of a [`DevicePolicy`] a device does not meet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Unmet {
    Charging,
    UnmeteredNetwork,
    Idle,
    /// The battery is at `percent`, under the policy's `minimum`.
    Battery {
        percent: u8,
        minimum: u8,
    },
}

impl Unmet {
    /// The policy field that asks for it.
    pub fn field(self) -> &'static str {
        match self {
            Unmet::Charging => "requires_charging",
            Unmet::UnmeteredNetwork => "requires_unmetered_network",
            Unmet::Idle => "requires_idle",
            Unmet::Battery { .. } => "min_battery_percent",
        }
    }

    /// What the job asks for, as a phrase ("the job requires charging").
    fn phrase(self) -> Option<&'static str> {
        match self {
            Unmet::Charging => Some("charging"),
            Unmet::UnmeteredNetwork => Some("an unmetered network"),
            Unmet::Idle => Some("an idle device"),
            Unmet::Battery { .. } => None,
        }
    }
}

/// A device whose conditions do not meet a job's [`DevicePolicy`]; the
/// message lists every unmet requirement and is meant to be shown to the
/// device's user, e.g. "the job requires charging and an unmetered
/// network; battery 12% is under the job's minimum of 30%".
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{}", describe_unmet(&self.unmet))]
pub struct Ineligible {
    /// In the policy's field order; never empty.
    pub unmet: Vec<Unmet>,
}

fn describe_unmet(unmet: &[Unmet]) -> String {
    let wanted: Vec<&str> = unmet.iter().filter_map(|u| u.phrase()).collect();
    let mut clauses = Vec::new();
    if let Some((last, first)) = wanted.split_last() {
        let list = if first.is_empty() {
            (*last).to_string()
        } else {
            format!("{} and {last}", first.join(", "))
        };
        clauses.push(format!("the job requires {list}"));
    }
    for requirement in unmet {
        if let Unmet::Battery { percent, minimum } = requirement {
            clauses.push(format!(
                "battery {percent}% is under the job's minimum of {minimum}%"
            ));
        }
    }
    clauses.join("; ")
}

/// One round's work for one device.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Task {
    /// Training unless it says otherwise; evaluation tasks ask the device
    /// to evaluate the version round `round_id` produced.
    #[serde(default, skip_serializing_if = "TaskKind::is_train")]
    pub kind: TaskKind,
    pub job_id: i64,
    pub round_id: i64,
    pub round_number: u32,
    pub model_version_id: i64,
    /// The model's content digest (`canopy_ir::format::digest`), lowercase hex;
    /// the server signs it.
    pub model_digest: String,
    pub model_size_bytes: u64,
    /// Server path to download the model from.
    pub model_path: String,
    /// Server path to upload the update to.
    pub upload_path: String,
    /// Exact size the upload must have: `layout.encoded_len()`.
    pub upload_size_bytes: u64,
    pub deadline_unix_ms: u64,
    pub training: TrainingConfig,
    /// The registered dataset to train (or evaluate) on, when the job
    /// names one; otherwise the device's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dataset: Option<String>,
    pub layout: UpdateLayout,
    /// Present when the round runs secure aggregation: the device then sends
    /// nothing to `upload_path` and runs the four SecAgg+ stages under
    /// [`SecureTask::path`] instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secure_aggregation: Option<SecureTask>,
    /// The states the device must be in to do the task (the job's
    /// `device_policy`); unrestricted when absent. A device that no longer
    /// meets it withdraws ([`WithdrawTask`]).
    #[serde(default, skip_serializing_if = "DevicePolicy::is_unrestricted")]
    pub policy: DevicePolicy,
    /// Present in a tiered job's task to an aggregator (an edge node): run
    /// the round as a sub-round over the aggregator's own devices and
    /// upload their weighted mean update, with their total sample count
    /// as its `num_samples`, to `upload_path`. End devices never get one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sub_round: Option<SubRound>,
    /// Present in a training task of a differentially private job: the
    /// device clips its update to [`TaskPrivacy::clip_norm`] before it
    /// sends it, so that no device moves the sum by more than that.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub privacy: Option<TaskPrivacy>,
    /// Present in a training task of a job with compressed updates: the
    /// device sends its larger tensors as int8 blocks
    /// ([`crate::update::encode_update_int8`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compression: Option<TaskCompression>,
}

/// How a job with compressed updates asks devices to encode them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskCompression {
    /// Tensors of at least this many values go as int8 blocks, smaller
    /// ones (biases, norms) as f32.
    pub int8_min_elements: u64,
}

/// What a differentially private job asks of each device's update.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskPrivacy {
    /// The L2 norm the whole update (every trainable tensor together) is
    /// scaled down to when it is longer: [`crate::update::clip_to_norm`].
    pub clip_norm: f64,
}

/// What an aggregator's sub-round must do, from the cloud job's edge tier.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SubRound {
    /// Fewest end-device updates that make the sub-round succeed.
    pub min_devices: u32,
    /// End-device updates at which the sub-round closes early.
    pub target_devices: u32,
    /// Extra devices to select, as a fraction of the target.
    pub over_selection: f64,
    /// When the sub-round closes, before the cloud round's deadline so
    /// that the partial sum has time to reach the cloud.
    pub deadline_unix_ms: u64,
    /// Most samples one end device's update may claim; the cloud refuses
    /// an aggregator's update that claims more than [`SubRound::max_samples`].
    pub max_samples_per_device: u64,
    /// When the cloud job is secure: the SecAgg+ settings the sub-round
    /// runs under, so that the aggregator learns only its devices' sum
    /// (which it then masks for the cloud's round among the aggregators,
    /// whose plan comes in the task's `secure_aggregation`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secure_aggregation: Option<crate::secagg::SecAggConfig>,
    /// Versions the aggregator makes from its own devices' updates before
    /// it sends its one result, the difference between its last version
    /// and the task's (a training task's; others run one round). One, a
    /// plain sub-round whose result is its devices' weighted mean, when
    /// absent.
    #[serde(default = "one_version", skip_serializing_if = "is_one_version")]
    pub rounds: u32,
    /// When the aggregator buffers for its devices (FedBuff): its buffers'
    /// settings, `target_devices` being the buffer size. Its rounds are
    /// synchronous when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub asynchronous: Option<SubRoundBuffers>,
    /// When the sub-round makes versions of its own: the cloud's leave for
    /// the aggregator's key to sign them until the sub-round's deadline,
    /// which the aggregator hands its devices with each such version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delegation: Option<crate::model_sig::ModelDelegation>,
}

fn one_version() -> u32 {
    1
}

fn is_one_version(rounds: &u32) -> bool {
    *rounds == 1
}

/// How an aggregator buffers its devices' updates (FedBuff), from the
/// cloud job's `edges.asynchronous`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SubRoundBuffers {
    /// Its devices training at once.
    pub concurrency: u32,
    /// Oldest update a buffer takes, in the aggregator's own versions.
    pub max_staleness: u32,
    /// An update `τ` versions old weighs `(1 + τ)^-exponent` times its
    /// samples.
    pub staleness_exponent: f64,
}

impl SubRound {
    /// Whether the aggregator makes versions of its own before its result:
    /// more than one round, or buffers (whose every buffer is a version).
    pub fn makes_versions(&self) -> bool {
        self.rounds > 1 || self.asynchronous.is_some()
    }

    /// The most end devices one of the sub-round's rounds takes updates
    /// from: those it selects, or for buffers those training at once.
    pub fn max_devices(&self) -> u32 {
        let selected = crate::bounds::selection_size(self.target_devices, self.over_selection);
        match &self.asynchronous {
            Some(buffers) => selected.max(buffers.concurrency),
            None => selected,
        }
    }

    /// The most samples an aggregator's result may claim: in each of its
    /// rounds, every device it may take an update from, each at its bound.
    pub fn max_samples(&self) -> u64 {
        u64::from(self.max_devices())
            .saturating_mul(u64::from(self.rounds.max(1)))
            .saturating_mul(self.max_samples_per_device)
    }
}

/// The secure-aggregation side of a task.
///
/// Stage endpoints, relative to `path`, all signed like every device call:
/// - `POST advertise-keys`, `POST share-keys`, `POST share-receipt`,
///   `POST masked-input`, `POST survivor-signature`, `POST unmask-response`:
///   the device's message as an
///   `application/octet-stream` body; 204 when taken, 409 when the device
///   already sent it, 422 when refused (the body says why), 410 when the
///   stage is over or the round failed.
/// - `GET neighbour-keys`, `GET incoming-shares`, `GET exclusions`,
///   `GET survivor-set`, `GET unmask-request`, with
///   an optional `wait_ms` long-poll: 200 with the server's message once the
///   previous stage has closed, 202 with an empty body while it is still
///   open, 410 when the device was dropped from the round or it failed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecureTask {
    pub plan: crate::secagg::Plan,
    /// Base path of the stage endpoints, e.g. `/device/v1/rounds/12/secagg`.
    pub path: String,
    /// How long each key stage, ShareCheck and ConsistencyCheck stays
    /// open; a device
    /// that has not heard back within about two of these after its
    /// deadline should give up.
    pub stage_timeout_ms: u64,
}

/// The stage endpoints under [`SecureTask::path`].
pub mod secagg_endpoints {
    use crate::secagg::wire::Stage;

    pub const ADVERTISE_KEYS: &str = "advertise-keys";
    pub const NEIGHBOUR_KEYS: &str = "neighbour-keys";
    pub const SHARE_KEYS: &str = "share-keys";
    pub const INCOMING_SHARES: &str = "incoming-shares";
    pub const SHARE_RECEIPT: &str = "share-receipt";
    pub const EXCLUSIONS: &str = "exclusions";
    pub const MASKED_INPUT: &str = "masked-input";
    pub const SURVIVOR_SET: &str = "survivor-set";
    pub const SURVIVOR_SIGNATURE: &str = "survivor-signature";
    pub const UNMASK_REQUEST: &str = "unmask-request";
    pub const UNMASK_RESPONSE: &str = "unmask-response";

    /// The endpoint of a stage's message.
    pub fn of(stage: Stage) -> &'static str {
        match stage {
            Stage::AdvertiseKeys => ADVERTISE_KEYS,
            Stage::NeighbourKeys => NEIGHBOUR_KEYS,
            Stage::ShareKeys => SHARE_KEYS,
            Stage::IncomingShares => INCOMING_SHARES,
            Stage::ShareReceipt => SHARE_RECEIPT,
            Stage::Exclusions => EXCLUSIONS,
            Stage::MaskedInput => MASKED_INPUT,
            Stage::SurvivorSet => SURVIVOR_SET,
            Stage::SurvivorSignature => SURVIVOR_SIGNATURE,
            Stage::UnmaskRequest => UNMASK_REQUEST,
            Stage::UnmaskResponse => UNMASK_RESPONSE,
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Heartbeat {
    /// What the device is doing, e.g. `idle` or `training`; informational.
    #[serde(default)]
    pub state: Option<String>,
    #[serde(default)]
    pub round_id: Option<i64>,
    /// The datasets the device can train on, by name; jobs that name a
    /// dataset select only devices that have it, with samples of the
    /// model's shape. `None` leaves what the server knows unchanged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub datasets: Option<Vec<DatasetInfo>>,
    /// The device's last error, for operators; `None` leaves it unchanged,
    /// an empty string clears it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// The device's state now (charging, network, idle, battery): the
    /// server selects only devices whose latest report meets a job's
    /// `device_policy`. `None` leaves what the server knows unchanged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conditions: Option<DeviceConditions>,
}

/// Most datasets a device reports.
pub const MAX_DATASETS: usize = 32;
/// Most characters of a dataset's name: the agent's registry rule.
pub const MAX_DATASET_NAME_CHARS: usize = 64;
/// Most dimensions of a dataset's samples.
pub const MAX_SAMPLE_RANK: usize = 8;
/// Most characters of a device's last error.
pub const MAX_LAST_ERROR_CHARS: usize = 512;

/// A dataset a device holds: what the server needs to decide whether the
/// device can train a model on it. The data never leaves the device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatasetInfo {
    /// 1 to 64 characters of `[A-Za-z0-9_.-]`.
    pub name: String,
    pub samples: u64,
    /// The shape of one sample, e.g. `[1, 28, 28]`.
    pub sample_shape: Vec<u64>,
    pub classes: u64,
}

/// Checks a dataset name: 1 to 64 characters of `[A-Za-z0-9_.-]`.
pub fn check_dataset_name(field: &str, name: &str) -> Result<(), String> {
    let ok = (1..=MAX_DATASET_NAME_CHARS).contains(&name.chars().count())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{field} `{}` must be 1 to {MAX_DATASET_NAME_CHARS} characters of [A-Za-z0-9_.-]",
            truncate_for_message(name)
        ))
    }
}

impl DatasetInfo {
    pub fn validate(&self, index: usize) -> Result<(), String> {
        check_dataset_name(&format!("heartbeat.datasets[{index}].name"), &self.name)?;
        if self.samples > MAX_SAMPLES {
            return Err(format!(
                "heartbeat.datasets[{index}].samples {} is above the limit of {MAX_SAMPLES}",
                self.samples
            ));
        }
        if self.sample_shape.is_empty()
            || self.sample_shape.len() > MAX_SAMPLE_RANK
            || self.sample_shape.iter().any(|&d| d == 0 || d > MAX_SAMPLES)
        {
            return Err(format!(
                "heartbeat.datasets[{index}].sample_shape must have 1 to {MAX_SAMPLE_RANK} dimensions, each 1 to {MAX_SAMPLES}"
            ));
        }
        if self.classes > MAX_SAMPLES {
            return Err(format!(
                "heartbeat.datasets[{index}].classes {} is above the limit of {MAX_SAMPLES}",
                self.classes
            ));
        }
        Ok(())
    }
}

impl Heartbeat {
    /// Bounds the free-form state string before the server stores it.
    pub fn validate(&self) -> Result<(), String> {
        if let Some(state) = &self.state {
            let chars = state.chars().count();
            if chars > MAX_HEARTBEAT_STATE_CHARS {
                return Err(format!(
                    "heartbeat.state is {chars} characters, the limit is {MAX_HEARTBEAT_STATE_CHARS}"
                ));
            }
            if state.chars().any(char::is_control) {
                return Err("heartbeat.state contains control characters".to_string());
            }
        }
        if let Some(round_id) = self.round_id {
            if round_id <= 0 {
                return Err(format!(
                    "heartbeat.round_id {round_id} is not a valid id; ids are positive"
                ));
            }
        }
        if let Some(datasets) = &self.datasets {
            if datasets.len() > MAX_DATASETS {
                return Err(format!(
                    "heartbeat.datasets has {} entries, the limit is {MAX_DATASETS}",
                    datasets.len()
                ));
            }
            for (index, dataset) in datasets.iter().enumerate() {
                dataset.validate(index)?;
            }
        }
        if let Some(error) = &self.last_error {
            if error.chars().count() > MAX_LAST_ERROR_CHARS {
                return Err(format!(
                    "heartbeat.last_error is over {MAX_LAST_ERROR_CHARS} characters"
                ));
            }
        }
        if let Some(conditions) = &self.conditions {
            conditions.validate_as("heartbeat.conditions")?;
        }
        Ok(())
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeartbeatResponse {
    pub server_time_ms: u64,
    pub heartbeat_interval_ms: u64,
}

/// Dropout reasons a [`SubRoundReport`] carries at most.
pub const MAX_SUB_ROUND_REASONS: usize = 8;
/// Characters of one dropout reason in a [`SubRoundReport`].
pub const MAX_SUB_ROUND_REASON_CHARS: usize = 200;

/// An aggregator's account of its sub-round, posted to
/// `/device/v1/rounds/{round_id}/sub-round` before its result (or its
/// decline): what happened at the tier below, for the round's tree. It
/// names no end device.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SubRoundReport {
    pub round_id: i64,
    /// End devices the sub-round selected.
    pub selected: u32,
    /// Updates it accepted.
    pub updates: u32,
    /// Selected devices that declined or timed out, or were dropped.
    pub dropouts: u32,
    /// Devices that withdrew as no longer meeting the job's device policy.
    pub ineligible: u32,
    /// Dropouts by reason, most frequent first.
    #[serde(default)]
    pub dropout_reasons: Vec<DropoutCount>,
    /// Samples behind the accepted updates; absent for a secure
    /// sub-round, whose weight the cloud learns only inside the sum over
    /// its aggregators.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub samples: Option<u64>,
    /// Update bytes the aggregator took in, and model bytes it sent.
    pub bytes_in: u64,
    pub bytes_out: u64,
    /// From the sub-round's opening to its close.
    pub duration_ms: u64,
}

/// How many of a sub-round's devices dropped out for one reason.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DropoutCount {
    pub reason: String,
    pub devices: u32,
}

impl SubRoundReport {
    /// Counts that add up and reasons within their bounds.
    pub fn validate(&self) -> Result<(), String> {
        if self.round_id <= 0 {
            return Err(format!(
                "sub-round report's round_id {} is not an id",
                self.round_id
            ));
        }
        let answered =
            u64::from(self.updates) + u64::from(self.dropouts) + u64::from(self.ineligible);
        if answered > u64::from(self.selected) {
            return Err(format!(
                "the sub-round report counts {answered} devices that answered, but {} selected",
                self.selected
            ));
        }
        if self.dropout_reasons.len() > MAX_SUB_ROUND_REASONS {
            return Err(format!(
                "the sub-round report has {} dropout reasons, at most {MAX_SUB_ROUND_REASONS}",
                self.dropout_reasons.len()
            ));
        }
        let mut counted = 0u64;
        for count in &self.dropout_reasons {
            let chars = count.reason.chars().count();
            if chars > MAX_SUB_ROUND_REASON_CHARS || count.reason.chars().any(char::is_control) {
                return Err(format!(
                    "a dropout reason is {chars} characters or has control characters; at most \
                     {MAX_SUB_ROUND_REASON_CHARS} printable ones"
                ));
            }
            counted += u64::from(count.devices);
        }
        if counted > u64::from(self.dropouts) {
            return Err(format!(
                "the dropout reasons count {counted} devices, the report {} dropouts",
                self.dropouts
            ));
        }
        Ok(())
    }
}

/// Training and evaluation results a device reports for a round.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoundMetrics {
    pub round_id: i64,
    #[serde(default)]
    pub train_loss: Option<f64>,
    #[serde(default)]
    pub eval_loss: Option<f64>,
    #[serde(default)]
    pub eval_accuracy: Option<f64>,
    #[serde(default)]
    pub eval_samples: Option<u64>,
    #[serde(default)]
    pub train_duration_ms: Option<u64>,
}

impl RoundMetrics {
    /// Values must be finite, accuracy in [0, 1], losses >= 0, so that one
    /// broken device cannot poison the round's aggregated metrics.
    pub fn validate(&self) -> Result<(), String> {
        if self.round_id <= 0 {
            return Err(format!(
                "metrics.round_id {} is not a valid id; ids are positive",
                self.round_id
            ));
        }
        for (field, loss) in [
            ("train_loss", self.train_loss),
            ("eval_loss", self.eval_loss),
        ] {
            if let Some(loss) = loss {
                if !loss.is_finite() || loss < 0.0 {
                    return Err(format!(
                        "metrics.{field} {loss} must be a finite number >= 0"
                    ));
                }
            }
        }
        if let Some(accuracy) = self.eval_accuracy {
            if !(0.0..=1.0).contains(&accuracy) {
                return Err(format!(
                    "metrics.eval_accuracy {accuracy} must be between 0 and 1"
                ));
            }
        }
        if let Some(samples) = self.eval_samples {
            if samples > MAX_SAMPLES {
                return Err(format!(
                    "metrics.eval_samples {samples} is above the limit of {MAX_SAMPLES}"
                ));
            }
        }
        Ok(())
    }
}

/// A device's evaluation of the version a round produced, on its held-out
/// data: the answer to a [`TaskKind::Evaluate`] task.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EvaluationReport {
    pub round_id: i64,
    /// Mean loss per sample.
    pub loss: f64,
    pub accuracy: f64,
    pub samples: u64,
}

impl EvaluationReport {
    /// Finite loss >= 0, accuracy in [0, 1], at least one sample and at
    /// most [`MAX_SAMPLES`], so that one device cannot poison the round's
    /// weighted mean.
    pub fn validate(&self) -> Result<(), String> {
        if self.round_id <= 0 {
            return Err(format!(
                "evaluation.round_id {} is not a valid id; ids are positive",
                self.round_id
            ));
        }
        if !self.loss.is_finite() || self.loss < 0.0 {
            return Err(format!(
                "evaluation.loss {} must be a finite number >= 0",
                self.loss
            ));
        }
        if !(0.0..=1.0).contains(&self.accuracy) {
            return Err(format!(
                "evaluation.accuracy {} must be between 0 and 1",
                self.accuracy
            ));
        }
        if self.samples == 0 || self.samples > MAX_SAMPLES {
            return Err(format!(
                "evaluation.samples {} must be between 1 and {MAX_SAMPLES}",
                self.samples
            ));
        }
        Ok(())
    }
}

/// The device-API paths of a round's tasks, so that the server's routes
/// and every device build them alike.
pub mod task_paths {
    use super::{Task, TaskKind};

    pub fn upload(kind: TaskKind, round_id: i64) -> String {
        match kind {
            TaskKind::Train | TaskKind::Statistics => {
                format!("/device/v1/rounds/{round_id}/update")
            }
            TaskKind::Evaluate => format!("/device/v1/rounds/{round_id}/evaluation"),
        }
    }

    pub fn decline(task: &Task) -> String {
        match task.kind {
            TaskKind::Train | TaskKind::Statistics => {
                format!("/device/v1/rounds/{}/decline", task.round_id)
            }
            TaskKind::Evaluate => {
                format!("/device/v1/rounds/{}/evaluation/decline", task.round_id)
            }
        }
    }

    /// Where a device that no longer meets the task's policy withdraws
    /// ([`super::WithdrawTask`]); evaluation tasks at their own path, as
    /// for [`decline`].
    pub fn withdraw(task: &Task) -> String {
        match task.kind {
            TaskKind::Train | TaskKind::Statistics => {
                format!("/device/v1/rounds/{}/withdraw", task.round_id)
            }
            TaskKind::Evaluate => {
                format!("/device/v1/rounds/{}/evaluation/withdraw", task.round_id)
            }
        }
    }
}

/// Most characters a decline reason may have.
pub const MAX_DECLINE_REASON_CHARS: usize = 512;

/// Where a device ends its own enrollment (a signed `POST` with the body
/// `{}`): the server revokes its key, as an operator's revoke does.
pub const UNENROLL_PATH: &str = "/device/v1/unenroll";

/// Where a device hands the server the device authority's certificate of
/// its enrolled key (a signed `POST` of [`DeviceCertificate`]), for the
/// server to relay to its neighbours in secure rounds (see
/// [`crate::device_cert`]).
pub const CERTIFICATE_PATH: &str = "/device/v1/certificate";

/// The device authority's certificate of the sender's id and enrolled key.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceCertificate {
    /// 128 lowercase hex digits: the authority's Ed25519 signature.
    pub certificate: String,
}

impl DeviceCertificate {
    pub fn new(certificate: &crate::device_cert::Certificate) -> DeviceCertificate {
        DeviceCertificate {
            certificate: hex::encode(certificate),
        }
    }

    /// The certificate's bytes, or why `certificate` is not one.
    pub fn bytes(&self) -> Result<crate::device_cert::Certificate, String> {
        crate::keys::parse_signature_hex(&self.certificate)
            .map(|signature| signature.to_bytes())
            .map_err(|cause| format!("`certificate`: {cause}"))
    }
}

/// A device gives up a task it cannot do (a model that fails verification,
/// one over its memory limit), so the server stops handing it out and the
/// round need not wait for the deadline on its account.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeclineTask {
    pub round_id: i64,
    pub reason: String,
}

impl DeclineTask {
    pub fn validate(&self) -> Result<(), String> {
        check_round_and_reason(self.round_id, &self.reason)
    }
}

/// The checks a decline and a withdrawal share: a real round id, and a
/// reason of bounded length with no control characters.
fn check_round_and_reason(round_id: i64, reason: &str) -> Result<(), String> {
    if round_id <= 0 {
        return Err(format!("`round_id` must be positive, got {round_id}"));
    }
    let chars = reason.chars().count();
    if chars > MAX_DECLINE_REASON_CHARS {
        return Err(format!(
            "`reason` has {chars} characters, over the limit of {MAX_DECLINE_REASON_CHARS}"
        ));
    }
    if reason.chars().any(char::is_control) {
        return Err("`reason` may not contain control characters".to_string());
    }
    Ok(())
}

/// A device gives up a task because it no longer meets the job's
/// [`DevicePolicy`] (unplugged, off Wi-Fi, in use, low battery). Unlike a
/// [`DeclineTask`], it is not counted as a dropout: the server records the
/// participant as `ineligible`, once it has checked that `conditions`
/// really violate the policy (it refuses a withdrawal whose conditions
/// meet it with 422). `reason` (at most [`MAX_DECLINE_REASON_CHARS`]) is
/// the device's own words, e.g. [`Ineligible`]'s message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WithdrawTask {
    pub round_id: i64,
    pub conditions: DeviceConditions,
    pub reason: String,
}

impl WithdrawTask {
    pub fn validate(&self) -> Result<(), String> {
        check_round_and_reason(self.round_id, &self.reason)?;
        self.conditions.validate()
    }
}

/// The error code of the 409 a device gets when it withdraws from a task
/// it already withdrew from: the withdrawal stands.
pub const ERROR_ALREADY_WITHDRAWN: &str = "already_withdrawn";

/// The error code of the 404 a device gets when it downloads a model
/// version it has no open task on: most often its round closed between
/// the task and the download (it had the updates it needed). The same for
/// a version that does not exist, so that a device learns nothing about
/// versions it was not sent.
pub const ERROR_NO_OPEN_TASK: &str = "no_open_task";

/// The server's answer to an accepted upload.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UploadReceipt {
    pub round_id: i64,
    pub accepted: bool,
    pub num_samples: u64,
    pub bytes: u64,
}

/// Body of every non-2xx response of the device API.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorDetail {
    /// Stable, machine-readable, e.g. `bad_signature`.
    pub code: String,
    /// For humans; may change between versions.
    pub message: String,
}

impl ErrorBody {
    pub fn new(code: impl Into<String>, message: impl Into<String>) -> ErrorBody {
        ErrorBody {
            error: ErrorDetail {
                code: code.into(),
                message: message.into(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `wire_names!` spells each variant as serde does: one name on the
    /// wire, in the database and in messages.
    #[test]
    fn wire_names_are_serdes() {
        fn check<T: Serialize + FromStr + fmt::Display + Copy + PartialEq + fmt::Debug>(all: &[T])
        where
            T::Err: fmt::Debug,
        {
            for value in all {
                let json = serde_json::to_string(value).unwrap();
                assert_eq!(json, format!("\"{value}\""));
                assert_eq!(value.to_string().parse::<T>().unwrap(), *value);
            }
        }
        check(DeviceRole::ALL);
        check(GpuApi::ALL);
        check(GpuDeviceType::ALL);
        assert_eq!(
            "relay".parse::<DeviceRole>().unwrap_err(),
            "device role `relay` is unknown; expected one of device, aggregator"
        );
    }
}
