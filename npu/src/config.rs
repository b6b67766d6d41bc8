//! What the NPU backend is configured with: where the ONNX Runtime library
//! is, and which execution providers to try, in order of preference.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use crate::error::NpuError;

/// An ONNX Runtime execution provider the backend can ask for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Provider {
    /// Android's Neural Networks API (the NPU, GPU or DSP behind it).
    Nnapi,
    /// Apple's Core ML (the Neural Engine, the GPU or the CPU).
    CoreMl,
    /// Qualcomm's AI Engine Direct (the Hexagon NPU).
    Qnn,
    /// Huawei's Compute Architecture for Neural Networks (Ascend NPUs).
    Cann,
    TensorRt,
    Cuda,
    /// ONNX Runtime's own CPU kernels, in every build.
    Cpu,
}

impl Provider {
    /// Every provider, in the default order of preference: NPUs first,
    /// then NVIDIA GPUs, then the CPU.
    pub const ALL: [Provider; 7] = [
        Provider::Nnapi,
        Provider::CoreMl,
        Provider::Qnn,
        Provider::Cann,
        Provider::TensorRt,
        Provider::Cuda,
        Provider::Cpu,
    ];

    /// The name configuration uses (`nnapi`, `coreml`, …).
    pub fn name(self) -> &'static str {
        match self {
            Provider::Nnapi => "nnapi",
            Provider::CoreMl => "coreml",
            Provider::Qnn => "qnn",
            Provider::Cann => "cann",
            Provider::TensorRt => "tensorrt",
            Provider::Cuda => "cuda",
            Provider::Cpu => "cpu",
        }
    }
}

impl fmt::Display for Provider {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Provider {
    type Err = NpuError;

    fn from_str(text: &str) -> Result<Provider, NpuError> {
        let wanted = text.trim().to_ascii_lowercase();
        Provider::ALL
            .into_iter()
            .find(|p| p.name() == wanted)
            .ok_or_else(|| NpuError::UnknownProvider {
                name: text.to_string(),
            })
    }
}

/// The backend's configuration, as the agent or a test gives it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OrtConfig {
    /// The ONNX Runtime shared library (`libonnxruntime.so`,
    /// `libonnxruntime.dylib`, `onnxruntime.dll`); `None` takes
    /// `ORT_DYLIB_PATH`, then the platform's library search path.
    pub library: Option<PathBuf>,
    /// Execution providers in order of preference. Those the loaded
    /// runtime lacks are reported and skipped; ONNX Runtime runs each node
    /// on the first remaining provider that supports it.
    pub providers: Vec<Provider>,
}

impl Default for OrtConfig {
    fn default() -> OrtConfig {
        OrtConfig {
            library: None,
            providers: Provider::ALL.to_vec(),
        }
    }
}

impl OrtConfig {
    /// Parses a comma-separated preference list (`nnapi,cpu`).
    pub fn parse_providers(list: &str) -> Result<Vec<Provider>, NpuError> {
        let providers = list
            .split(',')
            .filter(|name| !name.trim().is_empty())
            .map(str::parse)
            .collect::<Result<Vec<Provider>, NpuError>>()?;
        if providers.is_empty() {
            return Err(NpuError::NoProviderListed);
        }
        Ok(providers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn provider_names_round_trip() {
        for provider in Provider::ALL {
            assert_eq!(provider.name().parse::<Provider>().unwrap(), provider);
        }
        assert_eq!(
            OrtConfig::parse_providers(" QNN, cpu ").unwrap(),
            [Provider::Qnn, Provider::Cpu]
        );
    }

    #[test]
    fn an_unknown_or_empty_list_is_refused() {
        let error = OrtConfig::parse_providers("nnapi,npu").unwrap_err();
        assert!(error.to_string().contains("`npu`"), "{error}");
        assert!(matches!(
            OrtConfig::parse_providers(" , "),
            Err(NpuError::NoProviderListed)
        ));
    }
}
