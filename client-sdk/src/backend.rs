//! Which engine backend trains on this device.
//!
//! A device declares the backends it offers in its
//! [`Capabilities::backends`] at enrollment (names such as `cpu`, `gpu`,
//! `metal`, `nnapi`); [`choose_backend`] picks the one to run on from that
//! list, preferring an NPU, then a GPU, then the CPU. The engine runs the
//! CPU and, where a Vulkan, Metal or DX12 adapter opens, the GPU (wgpu);
//! the NPU is ONNX Runtime (`canopy-npu`) where its library loads, opened
//! once per process from the configuration [`configure_npu`] sets. An NPU
//! choice trains split: the frozen backbone in ONNX Runtime, the trainable
//! head on the CPU or GPU ([`BackendChoice::head`]). A choice whose backend
//! does not open falls back to the CPU and says why
//! ([`BackendChoice::fallback`]). Training builds its backend through this
//! module and nowhere else.
//!
//! `auto` ([`BackendChoice::auto`], and the `gpu` in
//! [`available_backends`]) is the engine's one rule,
//! [`canopy_engine::select::auto_decision`]: a hardware GPU (discrete,
//! then integrated) when there is one, else the CPU, never a software
//! adapter such as lavapipe; an explicit `gpu` ([`BackendChoice::gpu`])
//! takes any adapter.

use std::fmt;
use std::sync::{Arc, Mutex};

use canopy_engine::CpuBackend;
use canopy_npu::{NpuError, OrtBackend, OrtConfig};
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
    /// An NPU through ONNX Runtime's execution providers (NNAPI, Core ML,
    /// Qualcomm QNN/Hexagon, ...), available where the runtime opens
    /// ([`shared_npu`]); it runs a training step's frozen backbone.
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
    /// when an adapter opens, the NPU when ONNX Runtime opens (each once
    /// per process).
    pub fn is_available(self) -> bool {
        match self {
            BackendKind::Cpu => true,
            BackendKind::Gpu => canopy_engine::select::shared_gpu().is_ok(),
            BackendKind::Npu => shared_npu().is_ok(),
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
    /// Where the trainable head runs: `kind` itself, except for the NPU,
    /// whose choice trains the head on the CPU or the GPU.
    head: BackendKind,
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
        BackendChoice::outright(BackendKind::Cpu)
    }

    fn outright(kind: BackendKind) -> BackendChoice {
        BackendChoice {
            kind,
            head: kind,
            fallback: None,
        }
    }

    fn cpu_instead(wanted: Option<BackendKind>, reason: String) -> BackendChoice {
        BackendChoice {
            fallback: Some(Fallback { wanted, reason }),
            ..BackendChoice::cpu()
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

    /// `auto`: the GPU when the engine's rule takes a hardware one
    /// ([`canopy_engine::select::auto_decision`], decided and logged once
    /// per process; no device is opened to decide), else the CPU outright;
    /// the CPU with the reason when the GPU it took does not open.
    pub fn auto() -> BackendChoice {
        match canopy_engine::select::auto_decision().choice {
            canopy_engine::select::BackendChoice::Gpu => BackendChoice::gpu(),
            canopy_engine::select::BackendChoice::Cpu
            | canopy_engine::select::BackendChoice::Auto => BackendChoice::cpu(),
        }
    }

    /// The GPU, chosen outright, on any adapter (a software one included);
    /// the CPU with the reason when no adapter opens.
    pub fn gpu() -> BackendChoice {
        match canopy_engine::select::shared_gpu() {
            Ok(_) => BackendChoice::outright(BackendKind::Gpu),
            Err(error) => BackendChoice::cpu_instead(
                Some(BackendKind::Gpu),
                format!("{error}; training runs on the CPU"),
            ),
        }
    }

    /// The NPU, chosen outright, with the head on the CPU; the CPU with the
    /// reason when ONNX Runtime does not open ([`configure_npu`]).
    pub fn npu() -> BackendChoice {
        match shared_npu() {
            Ok(_) => BackendChoice {
                head: BackendKind::Cpu,
                ..BackendChoice::outright(BackendKind::Npu)
            },
            Err(error) => BackendChoice::cpu_instead(
                Some(BackendKind::Npu),
                format!(
                    "{}; training runs on the CPU",
                    crate::error::error_chain(&error)
                ),
            ),
        }
    }

    /// This NPU choice with its head on the GPU where an adapter opens (a
    /// choice of another kind is returned as it is).
    pub fn with_gpu_head(self) -> BackendChoice {
        if self.kind == BackendKind::Npu && BackendKind::Gpu.is_available() {
            return BackendChoice {
                head: BackendKind::Gpu,
                ..self
            };
        }
        self
    }

    /// Where the trainable head, its gradient and the optimizer run: the
    /// CPU or the GPU (the choice's own kind unless it is the NPU).
    pub fn head(&self) -> BackendKind {
        self.head
    }

    /// The engine backend to compile whole graphs with: for an NPU choice,
    /// the head's (the NPU only runs a step's frozen backbone, see
    /// [`BackendChoice::npu_backend`]).
    pub fn engine_backend(&self) -> Box<dyn canopy_engine::Backend> {
        match self.head {
            BackendKind::Gpu => match canopy_engine::select::shared_gpu() {
                Ok(gpu) => Box::new(gpu),
                // `head` is Gpu only once an adapter opened, and the
                // shared one stays open.
                Err(_) => Box::new(CpuBackend),
            },
            BackendKind::Cpu | BackendKind::Npu => Box::new(CpuBackend),
        }
    }

    /// The NPU backend that runs the frozen backbone, for an NPU choice.
    pub fn npu_backend(&self) -> Option<Arc<OrtBackend>> {
        match self.kind {
            // `kind` is Npu only once the runtime opened, and the shared
            // one stays open.
            BackendKind::Npu => shared_npu().ok(),
            BackendKind::Cpu | BackendKind::Gpu => None,
        }
    }
}

/// Why the NPU backend is not there, or cannot be configured.
#[derive(Debug, thiserror::Error)]
pub enum NpuSetupError {
    /// ONNX Runtime did not open with the configuration in force.
    #[error("the NPU backend (ONNX Runtime) does not open")]
    Open(#[source] Arc<NpuError>),
    /// [`configure_npu`] after the backend opened with another
    /// configuration: a process loads one ONNX Runtime.
    #[error(
        "the NPU backend is already open with {open:?}, so it cannot be configured with \
         {requested:?}; hint: call `configure_npu` once, before anything uses the NPU"
    )]
    AlreadyOpen {
        open: OrtConfig,
        requested: OrtConfig,
    },
}

/// The process's NPU backend: the configuration in force and the outcome
/// of the last attempt to open it with that configuration.
struct NpuSlot {
    config: OrtConfig,
    opened: Option<Result<Arc<OrtBackend>, Arc<NpuError>>>,
}

static NPU: Mutex<Option<NpuSlot>> = Mutex::new(None);

fn npu_slot() -> std::sync::MutexGuard<'static, Option<NpuSlot>> {
    NPU.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Sets the configuration the process's NPU backend opens with (by
/// default [`OrtConfig::default`]: the library from `ORT_DYLIB_PATH`, every
/// provider). Call it before anything uses the NPU; once the backend is
/// open, only the same configuration is accepted. After a failed open a
/// new configuration is tried on the next use.
pub fn configure_npu(config: OrtConfig) -> Result<(), NpuSetupError> {
    let mut slot = npu_slot();
    if let Some(NpuSlot {
        config: open,
        opened: Some(Ok(_)),
    }) = slot.as_ref()
    {
        if *open != config {
            return Err(NpuSetupError::AlreadyOpen {
                open: open.clone(),
                requested: config,
            });
        }
        return Ok(());
    }
    *slot = Some(NpuSlot {
        config,
        opened: None,
    });
    Ok(())
}

/// The process's NPU backend, opened on first use with the configuration
/// [`configure_npu`] set. A failure is kept until the configuration
/// changes, so the library is not loaded again on every check.
pub fn shared_npu() -> Result<Arc<OrtBackend>, NpuSetupError> {
    let mut slot = npu_slot();
    let slot = slot.get_or_insert_with(|| NpuSlot {
        config: OrtConfig::default(),
        opened: None,
    });
    let config = &slot.config;
    slot.opened
        .get_or_insert_with(|| OrtBackend::open(config).map(Arc::new).map_err(Arc::new))
        .clone()
        .map_err(NpuSetupError::Open)
}

impl fmt::Display for BackendChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.kind)?;
        if self.head != self.kind {
            write!(f, " (backbone; head on the {})", self.head)?;
        }
        match &self.fallback {
            None => Ok(()),
            Some(fallback) => write!(f, " ({})", fallback.reason),
        }
    }
}

/// The backends a device left to choose (`auto`) trains on here, to
/// report in [`Capabilities::backends`] at enrollment: `cpu`; `gpu` where
/// the engine's `auto` takes a hardware GPU (a software adapter such as
/// lavapipe is not offered: `auto` never trains on it); and `npu` where
/// ONNX Runtime opens.
pub fn available_backends() -> Vec<String> {
    [BackendKind::Cpu, BackendKind::Gpu, BackendKind::Npu]
        .into_iter()
        .filter(|kind| match kind {
            BackendKind::Gpu => BackendChoice::auto().kind() == BackendKind::Gpu,
            BackendKind::Cpu | BackendKind::Npu => kind.is_available(),
        })
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
/// reports one (with the head on a reported GPU), else a GPU, else the
/// CPU. A kind the engine cannot run here falls back to the CPU, with the
/// reason; so does a report that names no known backend (the CPU is always
/// there).
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
        Some(BackendKind::Npu) if BackendKind::Npu.is_available() => {
            let choice = BackendChoice::npu();
            if reported.contains(&BackendKind::Gpu) {
                choice.with_gpu_head()
            } else {
                choice
            }
        }
        Some(kind) if kind.is_available() => BackendChoice::outright(kind),
        Some(kind) => BackendChoice::cpu_instead(
            Some(kind),
            format!(
                "the device reports a {kind} backend, but the engine cannot run one here; training runs on the CPU"
            ),
        ),
        None => BackendChoice::cpu_instead(
            None,
            format!(
                "the device reports no backend the SDK knows ({:?}); training runs on the CPU, which every device has",
                capabilities.backends
            ),
        ),
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

    /// These tests run without ONNX Runtime, whatever `ORT_DYLIB_PATH`
    /// says: the process's NPU points at a library that is not there
    /// (tests/npu.rs runs it for real, in a process of its own).
    fn without_npu() {
        configure_npu(OrtConfig {
            library: Some("/nonexistent/libonnxruntime.so".into()),
            ..OrtConfig::default()
        })
        .expect("nothing opened the NPU in this process");
    }

    #[test]
    fn a_device_reporting_a_gpu_trains_on_it() {
        without_npu();
        if !gpu_expected() {
            return;
        }
        for reported in [&["cpu", "vulkan"][..], &["metal"][..], &["gpu"][..]] {
            let choice = choose_backend(&reporting(reported));
            assert_eq!(choice.kind(), BackendKind::Gpu, "{reported:?}");
            assert_eq!(choice.fallback(), None);
            assert_eq!(choice.engine_backend().name(), "gpu");
        }
        assert_eq!(BackendChoice::gpu().kind(), BackendKind::Gpu);
    }

    /// `auto` and what a device offers follow the engine's one rule: on a
    /// machine with only a software adapter (lavapipe in CI) the CPU, and
    /// `gpu` is not offered, though an explicit `gpu` still takes it.
    #[test]
    fn auto_and_the_offered_backends_follow_the_engines_rule() {
        without_npu();
        let decision = canopy_engine::select::auto_decision();
        let auto = BackendChoice::auto();
        assert_eq!(auto.kind().as_str(), decision.choice.as_str(), "{decision}");
        assert_eq!(auto.fallback(), None);
        let offered = available_backends();
        match auto.kind() {
            BackendKind::Gpu => assert_eq!(offered, ["cpu", "gpu"]),
            _ => assert_eq!(offered, ["cpu"], "{decision}"),
        }
        if gpu_expected() {
            assert_eq!(BackendChoice::gpu().kind(), BackendKind::Gpu);
        }
    }

    #[test]
    fn an_npu_falls_back_to_the_cpu_with_a_reason() {
        without_npu();
        let chosen = BackendChoice::npu();
        assert_eq!(chosen.kind(), BackendKind::Cpu);
        let reason = &chosen.fallback().expect("a fallback").reason;
        assert!(
            reason.contains("/nonexistent/libonnxruntime.so") && reason.contains("ORT_DYLIB_PATH"),
            "the reason names the library and how to get one: {reason}"
        );
        assert!(chosen.npu_backend().is_none());
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
