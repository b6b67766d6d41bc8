//! Which engine backend trains on this device.
//!
//! A device declares the backends it offers in its
//! [`Capabilities::backends`] at enrollment (names such as `cpu`, `gpu`,
//! `metal`, `nnapi`); [`choose_backend`] picks the one to run on from that
//! list, preferring an NPU, then a GPU, then the CPU. Only the CPU backend
//! exists in `canopy-engine` today, so a GPU or NPU choice falls back to
//! the CPU and says why ([`BackendChoice::fallback`]). When a GPU (wgpu)
//! or NPU-delegate backend lands, it becomes available here, in
//! [`BackendChoice::engine_backend`], and nowhere else in the SDK changes:
//! training already builds its backend through this module.

use std::fmt;

use canopy_engine::CpuBackend;
use canopy_protocol::messages::Capabilities;

/// A kind of execution backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackendKind {
    /// The engine's CPU backend: always available.
    Cpu,
    /// A GPU backend (Vulkan, Metal, CUDA, OpenCL, WebGPU). Not yet
    /// available: chosen, it falls back to [`BackendKind::Cpu`].
    Gpu,
    /// An NPU delegate (NNAPI, Core ML, Qualcomm QNN/Hexagon). Not yet
    /// available: chosen, it falls back to [`BackendKind::Cpu`].
    Npu,
}

impl BackendKind {
    /// The canonical name, as reported in [`Capabilities::backends`].
    pub fn as_str(self) -> &'static str {
        match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Gpu => "gpu",
            BackendKind::Npu => "npu",
        }
    }

    /// The kind a reported backend name stands for; `None` for names the
    /// SDK does not know, which are ignored.
    pub fn from_reported(name: &str) -> Option<BackendKind> {
        match name {
            "cpu" => Some(BackendKind::Cpu),
            "gpu" | "cuda" | "metal" | "vulkan" | "opencl" | "webgpu" | "wgpu" => {
                Some(BackendKind::Gpu)
            }
            "npu" | "nnapi" | "coreml" | "ane" | "qnn" | "hexagon" => Some(BackendKind::Npu),
            _ => None,
        }
    }

    /// Whether this build's engine can run this kind. Only the CPU today.
    pub fn is_available(self) -> bool {
        matches!(self, BackendKind::Cpu)
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why the backend that runs is not the one the device's report pointed to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fallback {
    /// The kind the report pointed to; `None` when it named no known kind.
    pub wanted: Option<BackendKind>,
    pub reason: String,
}

/// The backend to run on, and why it is not a better one if it is not.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackendChoice {
    kind: BackendKind,
    fallback: Option<Fallback>,
}

impl Default for BackendChoice {
    /// The CPU, with no fallback: what a CPU-only device gets.
    fn default() -> BackendChoice {
        BackendChoice::cpu()
    }
}

impl BackendChoice {
    /// The CPU, chosen outright.
    pub fn cpu() -> BackendChoice {
        BackendChoice {
            kind: BackendKind::Cpu,
            fallback: None,
        }
    }

    /// The kind that runs; always one that [`BackendKind::is_available`].
    pub fn kind(&self) -> BackendKind {
        self.kind
    }

    /// Set when the device's report pointed elsewhere.
    pub fn fallback(&self) -> Option<&Fallback> {
        self.fallback.as_ref()
    }

    /// The engine backend to compile the model's graphs with.
    pub fn engine_backend(&self) -> Box<dyn canopy_engine::Backend> {
        match self.kind {
            // The only kind `choose_backend` yields today; a GPU or NPU
            // backend gets its arm here when the engine has one.
            BackendKind::Cpu | BackendKind::Gpu | BackendKind::Npu => Box::new(CpuBackend),
        }
    }
}

impl fmt::Display for BackendChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.fallback {
            None => write!(f, "{}", self.kind),
            Some(fallback) => write!(f, "{} ({})", self.kind, fallback.reason),
        }
    }
}

/// The backends this build of the SDK can run, to report in
/// [`Capabilities::backends`] at enrollment: `["cpu"]` for now.
pub fn available_backends() -> Vec<String> {
    [BackendKind::Cpu, BackendKind::Gpu, BackendKind::Npu]
        .into_iter()
        .filter(|kind| kind.is_available())
        .map(|kind| kind.as_str().to_string())
        .collect()
}

/// Picks the backend to run on from what the device reports: an NPU if it
/// reports one, else a GPU, else the CPU. A kind the engine cannot run yet
/// falls back to the CPU, with the reason; so does a report that names no
/// known backend (the CPU is always there).
pub fn choose_backend(capabilities: &Capabilities) -> BackendChoice {
    let reported: Vec<BackendKind> = capabilities
        .backends
        .iter()
        .filter_map(|name| BackendKind::from_reported(name))
        .collect();
    let best = [BackendKind::Npu, BackendKind::Gpu, BackendKind::Cpu]
        .into_iter()
        .find(|kind| reported.contains(kind));
    match best {
        Some(kind) if kind.is_available() => BackendChoice {
            kind,
            fallback: None,
        },
        Some(kind) => BackendChoice {
            kind: BackendKind::Cpu,
            fallback: Some(Fallback {
                wanted: Some(kind),
                reason: format!(
                    "the device reports a {kind} backend, but the engine has no {kind} backend yet; training runs on the CPU"
                ),
            }),
        },
        None => BackendChoice {
            kind: BackendKind::Cpu,
            fallback: Some(Fallback {
                wanted: None,
                reason: format!(
                    "the device reports no backend the SDK knows ({:?}); training runs on the CPU, which every device has",
                    capabilities.backends
                ),
            }),
        },
    }
}

#[cfg(test)]
mod tests {
    use canopy_protocol::messages::Tier;

    use super::*;

    fn reporting(backends: &[&str]) -> Capabilities {
        Capabilities {
            tier: Tier::End,
            backends: backends.iter().map(|name| name.to_string()).collect(),
            memory_mb: 2048,
            os: "android".to_string(),
            tags: Default::default(),
        }
    }

    #[test]
    fn a_cpu_device_gets_the_cpu_outright() {
        let choice = choose_backend(&reporting(&["cpu"]));
        assert_eq!(choice, BackendChoice::cpu());
        assert_eq!(choice, BackendChoice::default());
        assert_eq!(choice.engine_backend().name(), "cpu");
        assert_eq!(choice.to_string(), "cpu");
        assert_eq!(available_backends(), ["cpu"]);
    }

    #[test]
    fn gpu_and_npu_fall_back_to_the_cpu_with_a_reason() {
        for (reported, wanted) in [
            (&["cpu", "vulkan"][..], BackendKind::Gpu),
            (&["metal"][..], BackendKind::Gpu),
            (&["cpu", "gpu", "nnapi"][..], BackendKind::Npu),
            (&["coreml", "cpu"][..], BackendKind::Npu),
        ] {
            let choice = choose_backend(&reporting(reported));
            assert_eq!(choice.kind(), BackendKind::Cpu, "{reported:?}");
            let fallback = choice.fallback().expect("a fallback");
            assert_eq!(fallback.wanted, Some(wanted), "{reported:?}");
            assert!(fallback.reason.contains("yet"), "{}", fallback.reason);
            assert_eq!(choice.engine_backend().name(), "cpu");
        }
    }

    #[test]
    fn an_empty_or_unknown_report_still_runs_on_the_cpu() {
        for reported in [&[][..], &["tpu-v9"][..]] {
            let choice = choose_backend(&reporting(reported));
            assert_eq!(choice.kind(), BackendKind::Cpu);
            assert_eq!(choice.fallback().and_then(|f| f.wanted), None);
            assert!(choice.fallback().is_some());
        }
        assert_eq!(
            BackendKind::from_reported("CPU"),
            None,
            "names are lowercase"
        );
    }
}
