//! Bounds that every tier checks: the server when a job or model is created,
//! devices when a task arrives, and the CLI and agent for local training.
//!
//! A device cannot trust the server's validation: a compromised or buggy
//! server, or anyone able to forge a task, could otherwise ask it to train
//! forever or download a model larger than its disk. So the bounds live
//! here, in the contract both ends link, and a change to one is a change
//! for all of them.

use crate::messages::{MAX_BATTERY_PERCENT, SubRound, Task, TaskKind, TrainingConfig};
use crate::update::UpdateError;

/// Most local epochs one task (or one local training run) may ask for.
pub const MAX_EPOCHS: u32 = 1_000;
/// Largest batch size; larger batches are a typo, not a plan.
pub const MAX_BATCH_SIZE: u32 = 65_536;
/// Largest learning rate; anything above diverges on every model we ship.
pub const MAX_LEARNING_RATE: f64 = 100.0;
/// Largest model file a device downloads or a tool reads (1 GiB). The
/// server's configurable `max_model_bytes` may not exceed it, so it never
/// accepts a model that devices would refuse.
pub const MAX_MODEL_BYTES: u64 = 1 << 30;
/// Largest clip norm a differentially private task may ask for: an update
/// a million long is already no bound at all.
pub const MAX_CLIP_NORM: f64 = 1e6;

/// A task, or one of its fields, outside the shared bounds.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum BoundsError {
    #[error("task field `{field}` is {value}, outside the allowed range {allowed}")]
    OutOfRange {
        field: &'static str,
        value: String,
        allowed: String,
    },
    #[error("task field `layout` is invalid")]
    Layout(#[source] UpdateError),
    #[error("task field `sub_round.secure_aggregation` is invalid: {0}")]
    SubRoundSecure(String),
    /// A private secure round whose noise is sized for a clip the task
    /// does not ask the device to apply: its update could move the sum
    /// past the sensitivity the noise covers.
    #[error(
        "task field `privacy.clip_norm` is {task}, and the secure round's noise is sized for \
         updates clipped to {plan}"
    )]
    PrivateClip { task: String, plan: f64 },
}

impl BoundsError {
    /// The field that broke a bound, as named in the task's JSON.
    pub fn field(&self) -> &'static str {
        match self {
            BoundsError::OutOfRange { field, .. } => field,
            BoundsError::Layout(_) => "layout",
            BoundsError::SubRoundSecure(_) => "sub_round.secure_aggregation",
            BoundsError::PrivateClip { .. } => "privacy.clip_norm",
        }
    }
}

fn check_u64(field: &'static str, value: u64, min: u64, max: u64) -> Result<(), BoundsError> {
    if (min..=max).contains(&value) {
        return Ok(());
    }
    Err(BoundsError::OutOfRange {
        field,
        value: value.to_string(),
        allowed: format!("{min}..={max}"),
    })
}

/// Checks the number of epochs, for tasks and for local training alike.
pub fn check_epochs(field: &'static str, epochs: u64) -> Result<(), BoundsError> {
    check_u64(field, epochs, 1, u64::from(MAX_EPOCHS))
}

/// Checks a batch size, for tasks and for local training alike.
pub fn check_batch_size(field: &'static str, batch_size: u64) -> Result<(), BoundsError> {
    check_u64(field, batch_size, 1, u64::from(MAX_BATCH_SIZE))
}

/// Checks a learning rate: finite, above zero, at most [`MAX_LEARNING_RATE`].
pub fn check_learning_rate(field: &'static str, rate: f64) -> Result<(), BoundsError> {
    if rate.is_finite() && rate > 0.0 && rate <= MAX_LEARNING_RATE {
        return Ok(());
    }
    Err(BoundsError::OutOfRange {
        field,
        value: rate.to_string(),
        allowed: format!("(0, {MAX_LEARNING_RATE}]"),
    })
}

/// Checks a clip norm: finite, above zero, at most [`MAX_CLIP_NORM`].
pub fn check_clip_norm(field: &'static str, norm: f64) -> Result<(), BoundsError> {
    if norm.is_finite() && norm > 0.0 && norm <= MAX_CLIP_NORM {
        return Ok(());
    }
    Err(BoundsError::OutOfRange {
        field,
        value: norm.to_string(),
        allowed: format!("(0, {MAX_CLIP_NORM}]"),
    })
}

/// Checks a model file's size against [`MAX_MODEL_BYTES`].
pub fn check_model_bytes(field: &'static str, bytes: u64) -> Result<(), BoundsError> {
    check_u64(field, bytes, 0, MAX_MODEL_BYTES)
}

impl TrainingConfig {
    /// Checks every field against the shared bounds, naming the field as
    /// it appears in a task (`training.epochs`, …).
    pub fn validate(&self) -> Result<(), BoundsError> {
        check_epochs("training.epochs", u64::from(self.epochs))?;
        check_batch_size("training.batch_size", u64::from(self.batch_size))?;
        check_learning_rate("training.learning_rate", self.learning_rate)
    }
}

impl Task {
    /// What a device checks before it downloads or trains anything.
    pub fn validate(&self) -> Result<(), BoundsError> {
        self.training.validate()?;
        check_model_bytes("model_size_bytes", self.model_size_bytes)?;
        check_u64(
            "policy.min_battery_percent",
            u64::from(self.policy.min_battery_percent),
            0,
            u64::from(MAX_BATTERY_PERCENT),
        )?;
        if let Some(sub_round) = &self.sub_round {
            sub_round.validate()?;
            check_versions_only_in_training(self.kind, sub_round)?;
        }
        if let Some(privacy) = &self.privacy {
            check_clip_norm("privacy.clip_norm", privacy.clip_norm)?;
        }
        self.check_private_clip()?;
        if let Some(compression) = &self.compression {
            check_u64(
                "compression.int8_min_elements",
                compression.int8_min_elements,
                1,
                crate::update::MAX_ELEMENTS as u64,
            )?;
        }
        self.layout.validate().map_err(BoundsError::Layout)
    }
}

/// Only a training sub-round makes versions of its own: evaluating or
/// counting the cloud's version is one round of it, so an aggregator
/// neither trains nor signs anything for such a task.
fn check_versions_only_in_training(
    kind: TaskKind,
    sub_round: &SubRound,
) -> Result<(), BoundsError> {
    if kind == TaskKind::Train || !sub_round.makes_versions() {
        return Ok(());
    }
    let (field, value) = match &sub_round.asynchronous {
        Some(_) => ("sub_round.asynchronous", "present".to_string()),
        None => ("sub_round.rounds", sub_round.rounds.to_string()),
    };
    Err(BoundsError::OutOfRange {
        field,
        value,
        allowed: "one round and no buffers: only a `train` task's sub-round makes versions"
            .to_string(),
    })
}

impl Task {
    /// A secure round with device noise needs the device to clip its
    /// update to exactly the plan's clip.
    fn check_private_clip(&self) -> Result<(), BoundsError> {
        let Some(plan) = self.secure_aggregation.as_ref().map(|secure| &secure.plan) else {
            return Ok(());
        };
        if plan.device_noise.is_none() {
            return Ok(());
        }
        let clip = self.privacy.as_ref().map(|privacy| privacy.clip_norm);
        match clip {
            Some(clip) if clip == plan.clip => Ok(()),
            _ => Err(BoundsError::PrivateClip {
                task: clip.map_or("missing".to_string(), |clip| clip.to_string()),
                plan: plan.clip,
            }),
        }
    }
}

/// Most end devices one sub-round may ask for, as a cloud round's own.
pub const MAX_SUB_ROUND_DEVICES: u32 = 100_000;
/// Most over-selection a round or sub-round may ask for, as a fraction of
/// its target.
pub const MAX_OVER_SELECTION: f64 = 4.0;
/// Most versions an aggregator makes from its devices' updates for one
/// result (`sub_round.rounds`, a job's `edges.rounds`).
pub const MAX_SUB_ROUND_VERSIONS: u32 = 1_000;
/// Oldest update a buffer may take, in versions (`max_staleness`, for a
/// job's buffers and an aggregator's alike).
pub const MAX_STALENESS: u32 = 10_000;
/// Largest staleness exponent: at 4, an update 10 versions old already
/// weighs 10⁻⁴ of a fresh one.
pub const MAX_STALENESS_EXPONENT: f64 = 4.0;

/// Devices a round selects: its target plus over-selection, to absorb
/// dropouts. One rule for the cloud's rounds and the edges' sub-rounds.
pub fn selection_size(target_devices: u32, over_selection: f64) -> u32 {
    let extra = (f64::from(target_devices) * over_selection).ceil();
    target_devices.saturating_add(extra as u32)
}

impl SubRound {
    /// What an aggregator checks before it opens a sub-round.
    pub fn validate(&self) -> Result<(), BoundsError> {
        let max_devices = u64::from(MAX_SUB_ROUND_DEVICES);
        check_u64(
            "sub_round.min_devices",
            u64::from(self.min_devices),
            1,
            max_devices,
        )?;
        check_u64(
            "sub_round.target_devices",
            u64::from(self.target_devices),
            u64::from(self.min_devices),
            max_devices,
        )?;
        if !(0.0..=MAX_OVER_SELECTION).contains(&self.over_selection) {
            return Err(BoundsError::OutOfRange {
                field: "sub_round.over_selection",
                value: self.over_selection.to_string(),
                allowed: format!("0..={MAX_OVER_SELECTION}"),
            });
        }
        check_u64(
            "sub_round.max_samples_per_device",
            self.max_samples_per_device,
            1,
            crate::update::MAX_SAMPLES,
        )?;
        check_u64(
            "sub_round.rounds",
            u64::from(self.rounds),
            1,
            u64::from(MAX_SUB_ROUND_VERSIONS),
        )?;
        if let Some(buffers) = &self.asynchronous {
            check_u64(
                "sub_round.asynchronous.concurrency",
                u64::from(buffers.concurrency),
                u64::from(self.target_devices),
                max_devices,
            )?;
            check_u64(
                "sub_round.asynchronous.max_staleness",
                u64::from(buffers.max_staleness),
                1,
                u64::from(MAX_STALENESS),
            )?;
            if !(0.0..=MAX_STALENESS_EXPONENT).contains(&buffers.staleness_exponent) {
                return Err(BoundsError::OutOfRange {
                    field: "sub_round.asynchronous.staleness_exponent",
                    value: buffers.staleness_exponent.to_string(),
                    allowed: format!("0..={MAX_STALENESS_EXPONENT}"),
                });
            }
        }
        if self.makes_versions() && self.delegation.is_none() {
            return Err(BoundsError::OutOfRange {
                field: "sub_round.delegation",
                value: "absent".to_string(),
                allowed: "a delegation when the sub-round makes versions of its own".to_string(),
            });
        }
        if let Some(config) = &self.secure_aggregation {
            if !config.enabled {
                return Err(BoundsError::SubRoundSecure(
                    "it is present but not enabled".to_string(),
                ));
            }
            config
                .check_fields()
                .map_err(|error| BoundsError::SubRoundSecure(error.to_string()))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn training() -> TrainingConfig {
        TrainingConfig {
            epochs: 2,
            batch_size: 32,
            learning_rate: 0.05,
        }
    }

    fn buffering_sub_round() -> SubRound {
        SubRound {
            min_devices: 2,
            target_devices: 3,
            over_selection: 0.0,
            deadline_unix_ms: 1,
            max_samples_per_device: 100,
            secure_aggregation: None,
            delegation: Some(
                crate::model_sig::ServerKey::generate()
                    .delegate(&crate::model_sig::ServerKey::generate().public_key(), 1),
            ),
            rounds: 4,
            asynchronous: Some(crate::messages::SubRoundBuffers {
                concurrency: 5,
                max_staleness: 2,
                staleness_exponent: 0.5,
            }),
        }
    }

    #[test]
    fn a_buffering_sub_round_bounds_each_field_and_its_weight() {
        let sub_round = buffering_sub_round();
        sub_round.validate().unwrap();
        // Each buffer takes updates from up to the 5 devices training at
        // once, and the result spans 4 of them.
        assert_eq!(sub_round.max_devices(), 5);
        assert_eq!(sub_round.max_samples(), 5 * 4 * 100);
        let with = |change: fn(&mut SubRound)| {
            let mut sub_round = buffering_sub_round();
            change(&mut sub_round);
            sub_round.validate().unwrap_err().field()
        };
        assert_eq!(with(|s| s.rounds = 0), "sub_round.rounds");
        assert_eq!(with(|s| s.delegation = None), "sub_round.delegation");
        assert_eq!(
            with(|s| s.rounds = MAX_SUB_ROUND_VERSIONS + 1),
            "sub_round.rounds"
        );
        assert_eq!(
            with(|s| s.asynchronous.as_mut().unwrap().concurrency = 2),
            "sub_round.asynchronous.concurrency"
        );
        assert_eq!(
            with(|s| s.asynchronous.as_mut().unwrap().max_staleness = 0),
            "sub_round.asynchronous.max_staleness"
        );
        assert_eq!(
            with(|s| s.asynchronous.as_mut().unwrap().staleness_exponent = f64::NAN),
            "sub_round.asynchronous.staleness_exponent"
        );
        // A plain sub-round's wire form is unchanged: no `rounds`, no
        // `asynchronous`; and an old form still reads as one round.
        let plain = SubRound {
            rounds: 1,
            asynchronous: None,
            delegation: None,
            ..buffering_sub_round()
        };
        let json = serde_json::to_value(&plain).unwrap();
        for field in ["rounds", "asynchronous", "delegation"] {
            assert!(json.get(field).is_none(), "{json}");
        }
        let read: SubRound = serde_json::from_value(json).unwrap();
        assert_eq!(read, plain);
    }

    #[test]
    fn only_a_training_sub_round_makes_versions() {
        let buffering = buffering_sub_round();
        let rounds_only = SubRound {
            asynchronous: None,
            ..buffering_sub_round()
        };
        let plain = SubRound {
            rounds: 1,
            asynchronous: None,
            delegation: None,
            ..buffering_sub_round()
        };
        for sub_round in [&buffering, &rounds_only, &plain] {
            check_versions_only_in_training(TaskKind::Train, sub_round).unwrap();
        }
        for kind in [TaskKind::Evaluate, TaskKind::Statistics] {
            check_versions_only_in_training(kind, &plain).unwrap();
            let field = |sub_round| {
                check_versions_only_in_training(kind, sub_round)
                    .unwrap_err()
                    .field()
            };
            assert_eq!(field(&buffering), "sub_round.asynchronous");
            assert_eq!(field(&rounds_only), "sub_round.rounds");
        }
    }

    #[test]
    fn training_within_bounds_passes() {
        training().validate().unwrap();
        let edge = TrainingConfig {
            epochs: MAX_EPOCHS,
            batch_size: MAX_BATCH_SIZE,
            learning_rate: MAX_LEARNING_RATE,
        };
        edge.validate().unwrap();
    }

    #[test]
    fn each_field_out_of_bounds_is_named() {
        let cases = [
            (
                TrainingConfig {
                    epochs: 0,
                    ..training()
                },
                "training.epochs",
            ),
            (
                TrainingConfig {
                    epochs: MAX_EPOCHS + 1,
                    ..training()
                },
                "training.epochs",
            ),
            (
                TrainingConfig {
                    batch_size: 0,
                    ..training()
                },
                "training.batch_size",
            ),
            (
                TrainingConfig {
                    batch_size: MAX_BATCH_SIZE + 1,
                    ..training()
                },
                "training.batch_size",
            ),
            (
                TrainingConfig {
                    learning_rate: f64::NAN,
                    ..training()
                },
                "training.learning_rate",
            ),
            (
                TrainingConfig {
                    learning_rate: 0.0,
                    ..training()
                },
                "training.learning_rate",
            ),
            (
                TrainingConfig {
                    learning_rate: 1e9,
                    ..training()
                },
                "training.learning_rate",
            ),
        ];
        for (config, field) in cases {
            let error = config.validate().unwrap_err();
            assert_eq!(error.field(), field, "{config:?}");
            assert!(error.to_string().contains(field), "{error}");
        }
    }

    #[test]
    fn model_size_is_bounded() {
        check_model_bytes("model_size_bytes", MAX_MODEL_BYTES).unwrap();
        let error = check_model_bytes("model_size_bytes", MAX_MODEL_BYTES + 1).unwrap_err();
        assert!(error.to_string().contains("model_size_bytes"), "{error}");
    }
}
