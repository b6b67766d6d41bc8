//! The process's ONNX Runtime: the library, loaded once from a path
//! (`ort`'s `load-dynamic`, so nothing is linked or downloaded at build
//! time), its one environment, and the execution providers it offers.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use ort::environment::Environment;
use ort::ep::{self, ExecutionProvider, ExecutionProviderDispatch};
use ort::session::Session;

use crate::config::Provider;
use crate::error::NpuError;

/// The environment variable `ort` itself reads, and the backend's
/// fallback when its configuration names no library.
pub const LIBRARY_VARIABLE: &str = "ORT_DYLIB_PATH";

/// A loaded ONNX Runtime.
pub struct Runtime {
    pub library: PathBuf,
    /// `1.32`: the release the library reports (major and minor).
    pub version: String,
    pub environment: Environment,
}

/// ONNX Runtime allows one environment per process and `ort` one library,
/// so both live here for the life of the process.
static RUNTIME: Mutex<Option<Arc<Runtime>>> = Mutex::new(None);

/// The library a configuration asks for: its own path, else
/// `ORT_DYLIB_PATH`, else the platform's name for it on the search path.
pub fn library_path(configured: Option<&Path>) -> PathBuf {
    if let Some(path) = configured {
        return path.to_path_buf();
    }
    match std::env::var_os(LIBRARY_VARIABLE) {
        Some(path) if !path.is_empty() => PathBuf::from(path),
        _ => PathBuf::from(format!(
            "{}onnxruntime{}",
            std::env::consts::DLL_PREFIX,
            std::env::consts::DLL_SUFFIX
        )),
    }
}

/// The process's runtime, loading the library at `path` on first use. A
/// failed load leaves nothing behind, so a later call may try another path.
pub fn load(path: &Path) -> Result<Arc<Runtime>, NpuError> {
    let mut slot = RUNTIME
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(runtime) = slot.as_ref() {
        if same_file(&runtime.library, path) {
            return Ok(runtime.clone());
        }
        return Err(NpuError::LibraryConflict {
            loaded: runtime.library.clone(),
            requested: path.to_path_buf(),
        });
    }
    let builder = ort::init_from(path).map_err(|source| NpuError::Library {
        path: path.to_path_buf(),
        source,
    })?;
    let environment = builder
        .with_name("canopy")
        .with_telemetry(false)
        .build()
        .map_err(|source| NpuError::Environment {
            path: path.to_path_buf(),
            source,
        })?;
    let runtime = Arc::new(Runtime {
        library: path.to_path_buf(),
        version: ort::util::probe(path).map_or_else(
            || "(unknown version)".to_string(),
            |minor| format!("1.{minor}"),
        ),
        environment,
    });
    *slot = Some(runtime.clone());
    Ok(runtime)
}

fn same_file(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

/// ONNX Runtime's name for a provider, as its build reports them.
pub fn runtime_name(provider: Provider) -> &'static str {
    match provider {
        Provider::Nnapi => ep::NNAPI::NAME,
        Provider::CoreMl => ep::CoreML::NAME,
        Provider::Qnn => ep::QNN::NAME,
        Provider::Cann => ep::CANN::NAME,
        Provider::TensorRt => ep::TensorRT::NAME,
        Provider::Cuda => ep::CUDA::NAME,
        Provider::Cpu => ep::CPU::NAME,
    }
}

/// Whether the loaded build has `provider` compiled in.
pub fn is_built_in(provider: Provider) -> Result<bool, NpuError> {
    let available = match provider {
        Provider::Nnapi => ep::NNAPI::is_available(),
        Provider::CoreMl => ep::CoreML::is_available(),
        Provider::Qnn => ep::QNN::is_available(),
        Provider::Cann => ep::CANN::is_available(),
        Provider::TensorRt => ep::TensorRT::is_available(),
        Provider::Cuda => ep::CUDA::is_available(),
        Provider::Cpu => ep::CPU::is_available(),
    };
    available.map_err(|source| NpuError::Providers { source })
}

/// The provider with its default options, failing the session build when
/// it cannot be registered (the backend probes each one first).
pub fn dispatch(provider: Provider) -> ExecutionProviderDispatch {
    let dispatch = match provider {
        Provider::Nnapi => ep::NNAPI::default().build(),
        Provider::CoreMl => ep::CoreML::default().build(),
        Provider::Qnn => ep::QNN::default().build(),
        Provider::Cann => ep::CANN::default().build(),
        Provider::TensorRt => ep::TensorRT::default().build(),
        Provider::Cuda => ep::CUDA::default().build(),
        Provider::Cpu => ep::CPU::default().with_arena_allocator(true).build(),
    };
    dispatch.error_on_failure()
}

/// Registers `provider` alone on a fresh session builder: a provider can
/// be compiled in and still fail here (CUDA without its libraries, QNN
/// without its backend library). `Err` carries ONNX Runtime's reason.
pub fn probe(runtime: &Runtime, provider: Provider) -> Result<(), String> {
    let builder = Session::builder(&runtime.environment).map_err(|e| e.to_string())?;
    builder
        .with_execution_providers([dispatch(provider)])
        .map(drop)
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_configured_path_wins_over_the_environment() {
        let configured = Path::new("/opt/vendor/libonnxruntime.so");
        assert_eq!(library_path(Some(configured)), configured);
    }
}
