//! What a device allows one task to take: memory, download size, threads
//! and time. One home for the rule that refuses a task over them, which
//! the edge agent (`--max-memory-mb`) and the app-facing client
//! (`canopy-mobile`) both apply before anything is downloaded.
//!
//! Memory cannot be metered inside a process without a global allocator
//! of our own, which an app embedding the SDK may not want; so the limit
//! is applied to an upper estimate made before the task starts, from the
//! model's size and the data's.

use canopy_protocol::messages::Task;

/// Memory a task is assumed to need, as a multiple of its model file's
/// size: the file and the parsed model, parameters, gradients, optimizer
/// state and the update's before/after copies. Activations, which grow
/// with the batch, are not counted.
pub const MEMORY_FACTOR: u64 = 8;

/// The most threads a device may give training; more is refused as a
/// setting, not silently capped.
pub const MAX_THREADS: u32 = 256;

/// A device's limits for one task; `None` is no limit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceLimits {
    /// Memory training may use, in MiB (model and local data together).
    pub max_memory_mb: Option<u64>,
    /// The largest model file the device downloads, in bytes.
    pub max_download_bytes: Option<u64>,
    /// Threads training may run on (the CPU backend's kernels).
    pub max_threads: Option<u32>,
    /// How long one run of a task may take, in milliseconds, before it
    /// stops (and, where it checkpoints, resumes later).
    pub time_limit_ms: Option<u64>,
}

/// Why a device will not take a task.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LimitRefusal {
    #[error(
        "round {round_id}'s model is {model_bytes} bytes, over this device's download limit \
         of {limit_bytes} bytes"
    )]
    Download {
        round_id: i64,
        model_bytes: u64,
        limit_bytes: u64,
    },
    #[error(
        "round {round_id}'s task needs about {need_mb} MiB ({MEMORY_FACTOR}x the {model_bytes}-byte \
         model, plus {data_bytes} bytes of local data), over this device's memory limit of \
         {limit_mb} MiB"
    )]
    Memory {
        round_id: i64,
        model_bytes: u64,
        data_bytes: u64,
        need_mb: u64,
        limit_mb: u64,
    },
}

/// A setting of [`DeviceLimits`] that cannot be right.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the device limit `{field}` is {value}: {reason}")]
pub struct LimitSettingError {
    pub field: &'static str,
    pub value: u64,
    pub reason: &'static str,
}

impl DeviceLimits {
    /// Refuses limits that no task could meet or that name no real number
    /// of threads.
    pub fn validate(&self) -> Result<(), LimitSettingError> {
        let zero = |field, value: Option<u64>| match value {
            Some(0) => Err(LimitSettingError {
                field,
                value: 0,
                reason: "it must be at least 1, or unset for no limit",
            }),
            _ => Ok(()),
        };
        zero("max_memory_mb", self.max_memory_mb)?;
        zero("max_download_bytes", self.max_download_bytes)?;
        zero("time_limit_ms", self.time_limit_ms)?;
        zero("max_threads", self.max_threads.map(u64::from))?;
        match self.max_threads {
            Some(threads) if threads > MAX_THREADS => Err(LimitSettingError {
                field: "max_threads",
                value: u64::from(threads),
                reason: "over the SDK's maximum of 256",
            }),
            _ => Ok(()),
        }
    }

    /// Why `task` is over these limits with `data_bytes` of local data, if
    /// it is; checked before anything is downloaded.
    pub fn refusal(&self, task: &Task, data_bytes: u64) -> Option<LimitRefusal> {
        if let Some(limit_bytes) = self.max_download_bytes
            && task.model_size_bytes > limit_bytes
        {
            return Some(LimitRefusal::Download {
                round_id: task.round_id,
                model_bytes: task.model_size_bytes,
                limit_bytes,
            });
        }
        let limit_mb = self.max_memory_mb?;
        let need_mb = memory_needed_mb(task.model_size_bytes, data_bytes);
        (need_mb > limit_mb).then_some(LimitRefusal::Memory {
            round_id: task.round_id,
            model_bytes: task.model_size_bytes,
            data_bytes,
            need_mb,
            limit_mb,
        })
    }
}

/// The memory estimate, in MiB, of training a model of `model_bytes` on
/// `data_bytes` of local data.
pub fn memory_needed_mb(model_bytes: u64, data_bytes: u64) -> u64 {
    model_bytes
        .saturating_mul(MEMORY_FACTOR)
        .saturating_add(data_bytes)
        .div_ceil(1 << 20)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(model_size_bytes: u64) -> Task {
        serde_json::from_value(serde_json::json!({
            "job_id": 1, "round_id": 7, "round_number": 1, "model_version_id": 3,
            "model_digest": "", "model_size_bytes": model_size_bytes,
            "model_path": "/device/v1/models/3", "upload_path": "/device/v1/rounds/7/update",
            "upload_size_bytes": 0, "deadline_unix_ms": 0,
            "training": {"epochs": 1, "batch_size": 8, "learning_rate": 0.1},
            "layout": {"tensors": [{"name": "w", "shape": [2]}]},
        }))
        .expect("a task")
    }

    #[test]
    fn a_task_over_a_limit_is_refused_and_says_which() {
        let limits = DeviceLimits {
            max_memory_mb: Some(10),
            max_download_bytes: Some(2 << 20),
            ..DeviceLimits::default()
        };
        assert_eq!(limits.refusal(&task(1 << 20), 1 << 20), None);
        let download = limits.refusal(&task(3 << 20), 0).expect("over download");
        assert!(matches!(download, LimitRefusal::Download { .. }));
        assert!(
            download.to_string().contains("download limit"),
            "{download}"
        );
        let memory = limits
            .refusal(&task(1 << 20), 8 << 20)
            .expect("over memory");
        assert!(memory.to_string().contains("about 16 MiB"), "{memory}");
        assert_eq!(
            DeviceLimits::default().refusal(&task(u64::MAX), u64::MAX),
            None
        );
    }

    #[test]
    fn limits_no_task_can_meet_are_refused() {
        let zero_threads = DeviceLimits {
            max_threads: Some(0),
            ..DeviceLimits::default()
        };
        assert_eq!(zero_threads.validate().unwrap_err().field, "max_threads");
        let many = DeviceLimits {
            max_threads: Some(MAX_THREADS + 1),
            ..DeviceLimits::default()
        };
        assert!(many.validate().is_err());
        let zero_time = DeviceLimits {
            time_limit_ms: Some(0),
            ..DeviceLimits::default()
        };
        assert_eq!(zero_time.validate().unwrap_err().field, "time_limit_ms");
        assert!(DeviceLimits::default().validate().is_ok());
    }
}
