//! Backend choice, in one place: `cpu`, `gpu` or `auto`, as the CLI, the
//! agent and the SDK accept it.
//!
//! `auto` takes a hardware GPU (discrete, then integrated) when there is
//! one and the CPU otherwise: a CPU implementation of Vulkan (lavapipe)
//! is slower than the CPU backend, so `auto` never picks it, while `gpu`
//! takes any adapter, lavapipe included (that is how CI tests the GPU
//! code). The GPU device is opened once per process and shared.

use std::fmt;
use std::str::FromStr;
use std::sync::{Arc, OnceLock};

use crate::backend::Backend;
use crate::cpu::CpuBackend;
use crate::error::{EngineError, EngineResult};
use crate::gpu::{AdapterPreference, GpuBackend};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum BackendChoice {
    Cpu,
    Gpu,
    #[default]
    Auto,
}

impl BackendChoice {
    pub const NAMES: [&'static str; 3] = ["cpu", "gpu", "auto"];

    pub fn as_str(self) -> &'static str {
        match self {
            BackendChoice::Cpu => "cpu",
            BackendChoice::Gpu => "gpu",
            BackendChoice::Auto => "auto",
        }
    }
}

impl fmt::Display for BackendChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for BackendChoice {
    type Err = EngineError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text.trim().to_ascii_lowercase().as_str() {
            "cpu" => Ok(BackendChoice::Cpu),
            "gpu" => Ok(BackendChoice::Gpu),
            "auto" => Ok(BackendChoice::Auto),
            other => Err(EngineError::Setting(format!(
                "unknown backend `{other}`; expected one of {}",
                BackendChoice::NAMES.join(", ")
            ))),
        }
    }
}

/// The process's GPU backend on any adapter, opened on first use.
pub fn shared_gpu() -> EngineResult<GpuBackend> {
    static GPU: OnceLock<Result<GpuBackend, (String, String)>> = OnceLock::new();
    GPU.get_or_init(|| {
        GpuBackend::new(AdapterPreference::Best).map_err(|e| match e {
            EngineError::Gpu { what, cause } => (what, cause),
            other => ("adapter".to_string(), other.to_string()),
        })
    })
    .clone()
    .map_err(|(what, cause)| EngineError::Gpu { what, cause })
}

/// The backend for `choice`: `gpu` fails when no adapter opens; `auto`
/// falls back to the CPU when there is no hardware GPU.
pub fn open_backend(choice: BackendChoice) -> EngineResult<Arc<dyn Backend>> {
    match choice {
        BackendChoice::Cpu => Ok(Arc::new(CpuBackend)),
        BackendChoice::Gpu => Ok(Arc::new(shared_gpu()?)),
        BackendChoice::Auto => match shared_gpu() {
            Ok(gpu)
                if matches!(
                    gpu.adapter().device_type.as_str(),
                    "discrete" | "integrated"
                ) =>
            {
                Ok(Arc::new(gpu))
            }
            _ => Ok(Arc::new(CpuBackend)),
        },
    }
}
