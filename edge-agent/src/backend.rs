//! The agent's `--backend`: the engine's choices (`cpu`, `gpu`, `auto`)
//! and `npu`, which the engine cannot know (ONNX Runtime lives in
//! `canopy-npu`, reached through the SDK), with the flags that say where
//! ONNX Runtime is and which execution providers to try.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use anyhow::Result;
use canopy_engine::select::BackendChoice;
use canopy_sdk::OrtConfig;
use clap::Args;

use crate::files::hinted;

/// Where the agent trains.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AgentBackend {
    /// One of the engine's backends.
    Engine(BackendChoice),
    /// A model's frozen backbone in ONNX Runtime (the NPU), the rest of
    /// each step on the CPU.
    Npu,
}

impl Default for AgentBackend {
    fn default() -> AgentBackend {
        AgentBackend::Engine(BackendChoice::default())
    }
}

impl AgentBackend {
    pub fn as_str(self) -> &'static str {
        match self {
            AgentBackend::Engine(choice) => choice.as_str(),
            AgentBackend::Npu => "npu",
        }
    }

    /// The SDK's backend for this choice: `auto` the engine's one rule
    /// (a hardware GPU when there is one, else the CPU: see
    /// [`canopy_sdk::BackendChoice::auto`]); `gpu` any adapter; `npu` the
    /// SDK's NPU choice (the CPU, with the reason, where ONNX Runtime does
    /// not open).
    pub fn sdk_choice(self) -> canopy_sdk::BackendChoice {
        match self {
            AgentBackend::Npu => canopy_sdk::BackendChoice::npu(),
            AgentBackend::Engine(BackendChoice::Auto) => canopy_sdk::BackendChoice::auto(),
            AgentBackend::Engine(BackendChoice::Gpu) => canopy_sdk::BackendChoice::gpu(),
            AgentBackend::Engine(BackendChoice::Cpu) => canopy_sdk::BackendChoice::cpu(),
        }
    }

    /// Settles the backend when the agent starts, so its first task does
    /// not pay for it: `auto` is decided (and logged once, with the
    /// reason), a `gpu` opened; a choice that falls back to the CPU says
    /// why. Each task's [`AgentBackend::sdk_choice`] then finds it settled.
    pub fn settle(self) {
        if let Some(fallback) = self.sdk_choice().fallback() {
            tracing::warn!(backend = %self, "{}", fallback.reason);
        }
    }
}

impl fmt::Display for AgentBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for AgentBackend {
    type Err = anyhow::Error;

    fn from_str(text: &str) -> Result<AgentBackend> {
        if text.trim().eq_ignore_ascii_case("npu") {
            return Ok(AgentBackend::Npu);
        }
        text.parse().map(AgentBackend::Engine).map_err(|_| {
            anyhow::anyhow!(
                "unknown backend `{}`; expected one of {}, npu",
                text.trim(),
                BackendChoice::NAMES.join(", ")
            )
        })
    }
}

/// Where ONNX Runtime is and which of its execution providers to try, for
/// `--backend npu`.
#[derive(Args, Clone, Debug, Default)]
pub struct OrtArgs {
    /// The ONNX Runtime shared library for `--backend npu`
    /// (libonnxruntime.so, .dylib, onnxruntime.dll); default:
    /// ORT_DYLIB_PATH, else the system's library search path.
    #[arg(long, value_name = "PATH")]
    ort_library: Option<PathBuf>,
    /// ONNX Runtime execution providers to try, in order of preference,
    /// comma-separated (nnapi, coreml, qnn, cann, tensorrt, cuda, cpu);
    /// default: all of them in that order.
    #[arg(long, value_name = "LIST")]
    ort_providers: Option<String>,
}

impl OrtArgs {
    /// These flags over config.toml's `run.ort_library` and
    /// `run.ort_providers`: a flag given wins, a missing one takes the file's.
    pub fn or(self, library: Option<PathBuf>, providers: Option<String>) -> OrtArgs {
        OrtArgs {
            ort_library: self.ort_library.or(library),
            ort_providers: self.ort_providers.or(providers),
        }
    }

    /// Hands the configuration to the SDK before anything opens the NPU.
    pub fn configure(&self) -> Result<()> {
        let mut config = OrtConfig {
            library: self.ort_library.clone(),
            ..OrtConfig::default()
        };
        if let Some(list) = &self.ort_providers {
            config.providers = OrtConfig::parse_providers(list)
                .map_err(|error| anyhow::Error::new(error).context("--ort-providers is invalid"))?;
        }
        canopy_sdk::configure_npu(config)?;
        Ok(())
    }

    /// Checks that ONNX Runtime opens with this configuration, for an
    /// agent asked to offer or train on the NPU.
    pub fn open(&self) -> Result<()> {
        self.configure()?;
        canopy_sdk::shared_npu().map_err(|error| {
            hinted(
                canopy_term::error_chain(&error),
                "pass --ort-library PATH (or set ORT_DYLIB_PATH) to an ONNX Runtime shared \
                 library, or choose --backend cpu",
            )
        })?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_to_the_engine_choices_and_npu() {
        for name in ["cpu", "gpu", "auto", "npu"] {
            assert_eq!(name.parse::<AgentBackend>().unwrap().as_str(), name);
        }
        assert_eq!(" NPU ".parse::<AgentBackend>().unwrap(), AgentBackend::Npu);
        let error = "tpu".parse::<AgentBackend>().unwrap_err().to_string();
        assert!(
            error.contains("unknown backend `tpu`") && error.contains("npu"),
            "{error}"
        );
    }

    /// `auto`, the default, is the engine's rule: on a machine with only a
    /// software adapter (lavapipe in CI) the agent trains on the CPU.
    #[test]
    fn the_default_backend_follows_the_engines_auto_rule() {
        let decision = canopy_engine::select::auto_decision();
        let choice = AgentBackend::default().sdk_choice();
        assert_eq!(
            choice.kind().as_str(),
            decision.choice.as_str(),
            "{decision}"
        );
        assert_eq!(
            AgentBackend::Engine(BackendChoice::Cpu).sdk_choice(),
            canopy_sdk::BackendChoice::cpu()
        );
    }

    #[test]
    fn ort_flags_win_over_config_toml_and_fill_from_it() {
        let flags = OrtArgs {
            ort_library: None,
            ort_providers: Some("cpu".into()),
        };
        let merged = flags.or(
            Some("/opt/ort/libonnxruntime.so".into()),
            Some("nnapi,cpu".into()),
        );
        assert_eq!(
            merged.ort_library.as_deref(),
            Some(std::path::Path::new("/opt/ort/libonnxruntime.so"))
        );
        assert_eq!(merged.ort_providers.as_deref(), Some("cpu"));
    }

    #[test]
    fn an_unknown_provider_is_refused_before_anything_opens() {
        let args = OrtArgs {
            ort_library: None,
            ort_providers: Some("nnapi,tpu".into()),
        };
        let error = format!("{:#}", args.configure().unwrap_err());
        assert!(
            error.contains("--ort-providers") && error.contains("`tpu`"),
            "{error}"
        );
    }
}
