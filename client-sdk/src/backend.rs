//! Which engine backend trains on this device.
//!
//! A device declares the backends it offers in its
//! [`Capabilities::backends`] at enrollment (names such as `cpu`, `gpu`,
//! `metal`, `nnapi`); [`choose_backend`] picks the one to run on from that
//! list, preferring an NPU, then a GPU, then the CPU. The engine runs the
//! CPU and, where a Vulkan, Metal or DX12 adapter opens, the GPU (wgpu);
//! an NPU choice, or a GPU choice on a device where no adapter opens,
//! falls back to the CPU and says why ([`BackendChoice::fallback`]).
//! Training builds its backend through this module and nowhere else.

use std::fmt;

use canopy_engine::CpuBackend;
use canopy_protocol::messages::{
    Capabilities, GpuAdapter, GpuDeviceType, MAX_ADAPTER_DRIVER_CHARS, MAX_ADAPTER_NAME_CHARS,
};

/// A kind of execution backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackendKind {
    /// The engine's CPU backend: always available.
    Cpu,
    /// The engine's GPU backend (wgpu: Vulkan, Metal, DX12), available
    /// where an adapter opens.
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

    /// Whether the engine can run this kind here: the CPU always, the GPU
    /// when an adapter opens (once per process), an NPU not yet.
    pub fn is_available(self) -> bool {
        match self {
            BackendKind::Cpu => true,
            BackendKind::Gpu => canopy_engine::select::shared_gpu().is_ok(),
            BackendKind::Npu => false,
        }
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

    /// The GPU, chosen outright; the CPU with the reason when no adapter
    /// opens.
    pub fn gpu() -> BackendChoice {
        match canopy_engine::select::shared_gpu() {
            Ok(_) => BackendChoice {
                kind: BackendKind::Gpu,
                fallback: None,
            },
            Err(error) => BackendChoice {
                kind: BackendKind::Cpu,
                fallback: Some(Fallback {
                    wanted: Some(BackendKind::Gpu),
                    reason: format!("{error}; training runs on the CPU"),
                }),
            },
        }
    }

    /// The engine backend to compile the model's graphs with.
    pub fn engine_backend(&self) -> Box<dyn canopy_engine::Backend> {
        match self.kind {
            BackendKind::Gpu => match canopy_engine::select::shared_gpu() {
                Ok(gpu) => Box::new(gpu),
                // `kind` is Gpu only once an adapter opened, and the
                // shared one stays open.
                Err(_) => Box::new(CpuBackend),
            },
            // No NPU backend yet: `choose_backend` never yields it.
            BackendKind::Cpu | BackendKind::Npu => Box::new(CpuBackend),
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

/// The backends the engine can run here, to report in
/// [`Capabilities::backends`] at enrollment: `cpu`, and `gpu` where an
/// adapter opens.
pub fn available_backends() -> Vec<String> {
    [BackendKind::Cpu, BackendKind::Gpu, BackendKind::Npu]
        .into_iter()
        .filter(|kind| kind.is_available())
        .map(|kind| kind.as_str().to_string())
        .collect()
}

/// The adapter the `gpu` backend runs on, to report in
/// [`Capabilities::gpu`] beside `gpu` in `backends`; `None` where no
/// adapter opens. Names are cut to the protocol's limits and stripped of
/// control characters, so the report always validates.
pub fn gpu_adapter() -> Option<GpuAdapter> {
    use canopy_engine::Backend;
    let adapter = canopy_engine::select::shared_gpu()
        .ok()?
        .describe()
        .adapter?;
    // The engine opens Vulkan, Metal and DX12 adapters only, and the
    // protocol names all three; anything else is not reported.
    let api = adapter.api.parse().ok()?;
    let clean = |text: &str, max_chars: usize| -> String {
        let cleaned: String = text
            .chars()
            .map(|c| if c.is_control() { ' ' } else { c })
            .take(max_chars)
            .collect();
        cleaned.trim().to_string()
    };
    let name = clean(&adapter.name, MAX_ADAPTER_NAME_CHARS);
    Some(GpuAdapter {
        name: if name.is_empty() {
            "unnamed adapter".to_string()
        } else {
            name
        },
        api,
        device_type: adapter.device_type.parse().unwrap_or(GpuDeviceType::Other),
        driver: clean(&adapter.driver, MAX_ADAPTER_DRIVER_CHARS),
    })
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
                    "the device reports a {kind} backend, but the engine cannot run one here; training runs on the CPU"
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
            gpu: None,
        }
    }

    #[test]
    fn a_cpu_device_gets_the_cpu_outright() {
        let choice = choose_backend(&reporting(&["cpu"]));
        assert_eq!(choice, BackendChoice::cpu());
        assert_eq!(choice, BackendChoice::default());
        assert_eq!(choice.engine_backend().name(), "cpu");
        assert_eq!(choice.to_string(), "cpu");
    }

    /// The GPU is tested for real wherever the suite runs (lavapipe in
    /// CI); `CANOPY_TEST_BACKENDS=cpu` is the only way to leave it out.
    fn gpu_expected() -> bool {
        std::env::var("CANOPY_TEST_BACKENDS").as_deref() != Ok("cpu")
    }

    #[test]
    fn the_gpu_adapter_report_validates_beside_the_gpu_backend() {
        let adapter = gpu_adapter();
        if !gpu_expected() {
            return;
        }
        let adapter = adapter.expect("an adapter opens wherever the GPU is tested");
        assert!(!adapter.name.is_empty());
        let capabilities = Capabilities {
            gpu: Some(adapter),
            ..reporting(&["cpu", "gpu"])
        };
        capabilities.validate().unwrap();
    }

    #[test]
    fn a_device_reporting_a_gpu_trains_on_it() {
        if !gpu_expected() {
            return;
        }
        assert_eq!(available_backends(), ["cpu", "gpu"]);
        for reported in [&["cpu", "vulkan"][..], &["metal"][..], &["gpu"][..]] {
            let choice = choose_backend(&reporting(reported));
            assert_eq!(choice.kind(), BackendKind::Gpu, "{reported:?}");
            assert_eq!(choice.fallback(), None);
            assert_eq!(choice.engine_backend().name(), "gpu");
        }
        assert_eq!(BackendChoice::gpu().kind(), BackendKind::Gpu);
    }

    #[test]
    fn an_npu_falls_back_to_the_cpu_with_a_reason() {
        for reported in [&["cpu", "gpu", "nnapi"][..], &["coreml", "cpu"][..]] {
            let choice = choose_backend(&reporting(reported));
            assert_eq!(choice.kind(), BackendKind::Cpu, "{reported:?}");
            let fallback = choice.fallback().expect("a fallback");
            assert_eq!(fallback.wanted, Some(BackendKind::Npu), "{reported:?}");
            assert!(
                fallback.reason.contains("cannot run one here"),
                "{}",
                fallback.reason
            );
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
