//! Backend choice, in one place: `cpu`, `gpu` or `auto`, as the CLI, the
//! agent and the SDK accept it.
//!
//! `auto` takes a hardware GPU (discrete, then integrated) when there is
//! one and the CPU otherwise: a CPU implementation of Vulkan (lavapipe)
//! is slower than the CPU backend, so `auto` never picks it, while `gpu`
//! takes any adapter, lavapipe included (that is how CI tests the GPU
//! code). The GPU device is opened once per process and shared.
//!
//! [`decide_auto`] is that rule, over adapter descriptions; every caller
//! (the CLI, the agent, the SDK and the mobile library through it) reaches
//! it through [`auto_decision`], which lists the adapters once per process
//! without opening any device, and logs the choice once with its reason.

use std::fmt;
use std::str::FromStr;
use std::sync::{Arc, OnceLock};

use crate::backend::{AdapterInfo, Backend};
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
/// follows [`auto_decision`], and falls back to the CPU, with a warning,
/// in the rare case that the hardware GPU it chose does not open.
pub fn open_backend(choice: BackendChoice) -> EngineResult<Arc<dyn Backend>> {
    match choice {
        BackendChoice::Cpu => Ok(Arc::new(CpuBackend)),
        BackendChoice::Gpu => Ok(Arc::new(shared_gpu()?)),
        BackendChoice::Auto => match auto_decision().choice {
            BackendChoice::Gpu => match shared_gpu() {
                Ok(gpu) => Ok(Arc::new(gpu)),
                Err(error) => {
                    tracing::warn!(%error, "auto: the hardware GPU does not open; training on the CPU");
                    Ok(Arc::new(CpuBackend))
                }
            },
            BackendChoice::Cpu | BackendChoice::Auto => Ok(Arc::new(CpuBackend)),
        },
    }
}

/// What `auto` resolved to, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AutoDecision {
    /// [`BackendChoice::Gpu`] or [`BackendChoice::Cpu`], never `Auto`.
    pub choice: BackendChoice,
    /// The hardware adapter `auto` trains on, when `choice` is the GPU.
    pub adapter: Option<AdapterInfo>,
    /// The choice and its reason in words, as logged: e.g. "auto: no
    /// hardware GPU (only llvmpipe, a software adapter); training on the CPU".
    pub reason: String,
}

impl fmt::Display for AutoDecision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.reason)
    }
}

/// Adapter kinds `auto` trains on, best first (as [`AdapterInfo::device_type`]
/// names them): a software rasteriser (`cpu`, e.g. lavapipe/llvmpipe) is
/// slower than the CPU backend, and a `virtual` or `other` adapter is not
/// known to be a GPU.
pub const AUTO_ADAPTER_TYPES: [&str; 2] = ["discrete", "integrated"];

/// The rule for `auto`, over the adapters found (in any order): the first
/// discrete GPU, else the first integrated one, else the CPU. Pure, so it
/// is tested over descriptions of machines the tests do not run on.
pub fn decide_auto(adapters: &[AdapterInfo]) -> AutoDecision {
    let hardware = AUTO_ADAPTER_TYPES
        .iter()
        .find_map(|kind| adapters.iter().find(|adapter| adapter.device_type == *kind));
    if let Some(adapter) = hardware {
        return AutoDecision {
            choice: BackendChoice::Gpu,
            adapter: Some(adapter.clone()),
            reason: format!(
                "auto: {} ({} GPU, {}); training on the GPU",
                adapter.name, adapter.device_type, adapter.api
            ),
        };
    }
    let why = if adapters.is_empty() {
        if cfg!(feature = "gpu") {
            "no GPU adapter found".to_string()
        } else {
            "this build has no GPU backend".to_string()
        }
    } else {
        let others: Vec<String> = adapters
            .iter()
            .map(|adapter| {
                format!(
                    "{}, {}",
                    adapter.name,
                    non_hardware_kind(&adapter.device_type)
                )
            })
            .collect();
        format!("no hardware GPU (only {})", others.join("; "))
    };
    AutoDecision {
        choice: BackendChoice::Cpu,
        adapter: None,
        reason: format!("auto: {why}; training on the CPU"),
    }
}

/// A non-hardware adapter's kind in words.
fn non_hardware_kind(device_type: &str) -> String {
    match device_type {
        "cpu" => "a software adapter".to_string(),
        "virtual" => "a virtual adapter".to_string(),
        other => format!("an adapter of type `{other}`"),
    }
}

/// `auto` on this machine: decided once per process by [`decide_auto`]
/// over the adapters listed (no device is opened, so a machine with only a
/// software adapter never pays for opening it), and logged once. Call it
/// at start (the CLI's commands, `canopy-agent run`, the mobile client's
/// construction) so the first task does not pay for the probe either.
pub fn auto_decision() -> &'static AutoDecision {
    static DECISION: OnceLock<AutoDecision> = OnceLock::new();
    DECISION.get_or_init(|| {
        let decision = decide_auto(&crate::gpu::list_adapters());
        tracing::info!(backend = %decision.choice, "{}", decision.reason);
        decision
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn adapter(name: &str, device_type: &str) -> AdapterInfo {
        AdapterInfo {
            name: name.to_string(),
            api: "vulkan".to_string(),
            device_type: device_type.to_string(),
            driver: String::new(),
            max_buffer_bytes: 1 << 30,
            max_workgroups_per_dimension: 65_535,
        }
    }

    #[test]
    fn auto_never_takes_a_software_or_virtual_adapter() {
        let lavapipe = adapter("llvmpipe (LLVM 15.0.7, 256 bits)", "cpu");
        let decision = decide_auto(std::slice::from_ref(&lavapipe));
        assert_eq!(decision.choice, BackendChoice::Cpu);
        assert_eq!(decision.adapter, None);
        assert_eq!(
            decision.reason,
            "auto: no hardware GPU (only llvmpipe (LLVM 15.0.7, 256 bits), a software adapter); \
             training on the CPU"
        );
        let decision = decide_auto(&[adapter("virgl", "virtual"), lavapipe]);
        assert_eq!(decision.choice, BackendChoice::Cpu);
        assert!(
            decision
                .reason
                .contains("virgl, a virtual adapter; llvmpipe"),
            "{decision}"
        );
    }

    #[test]
    fn auto_with_no_adapter_takes_the_cpu_and_says_so() {
        let decision = decide_auto(&[]);
        assert_eq!(decision.choice, BackendChoice::Cpu);
        let expected = if cfg!(feature = "gpu") {
            "auto: no GPU adapter found; training on the CPU"
        } else {
            "auto: this build has no GPU backend; training on the CPU"
        };
        assert_eq!(decision.reason, expected);
    }

    #[test]
    fn auto_takes_an_integrated_gpu_over_software_and_a_discrete_one_over_both() {
        let software = adapter("llvmpipe", "cpu");
        let integrated = adapter("Intel(R) UHD Graphics 630", "integrated");
        let discrete = adapter("NVIDIA H200", "discrete");
        let decision = decide_auto(&[software.clone(), integrated.clone()]);
        assert_eq!(decision.choice, BackendChoice::Gpu);
        assert_eq!(decision.adapter.as_ref(), Some(&integrated));
        assert_eq!(
            decision.reason,
            "auto: Intel(R) UHD Graphics 630 (integrated GPU, vulkan); training on the GPU"
        );
        // In any order the adapters are listed.
        for listed in [
            vec![software.clone(), integrated.clone(), discrete.clone()],
            vec![discrete.clone(), integrated.clone(), software.clone()],
            vec![integrated.clone(), software, discrete.clone()],
        ] {
            let decision = decide_auto(&listed);
            assert_eq!(decision.choice, BackendChoice::Gpu);
            assert_eq!(decision.adapter.as_ref(), Some(&discrete), "{listed:?}");
        }
    }

    /// On this machine: the decision follows the rule over the adapters
    /// found, and `auto` opens the backend it names.
    #[test]
    fn auto_on_this_machine_follows_the_rule() {
        let decision = auto_decision();
        assert_eq!(*decision, decide_auto(&crate::gpu::list_adapters()));
        let backend = open_backend(BackendChoice::Auto).expect("auto always opens a backend");
        assert_eq!(backend.name(), decision.choice.as_str());
    }
}
