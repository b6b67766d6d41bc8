//! What can go wrong before a graph runs: the library, the providers, the
//! configuration. Failures of a compiled session reach callers as
//! `EngineError::Runtime` (or `Unsupported` for a graph ONNX cannot
//! express), through the `Backend` seam.

use std::path::PathBuf;

use crate::config::Provider;

/// Where the README explains how a device gets ONNX Runtime.
const LIBRARY_HINT: &str = "set ORT_DYLIB_PATH (or the backend's `library` setting) to an ONNX \
     Runtime shared library: `pip install onnxruntime` ships one in onnxruntime/capi/, Android's \
     onnxruntime-android AAR and Apple's onnxruntime-c package ship one for devices (README, \
     \"The NPU backend\")";

#[derive(Debug, thiserror::Error)]
pub enum NpuError {
    /// The ONNX Runtime library could not be loaded.
    #[error("cannot load the ONNX Runtime library `{}`; hint: {LIBRARY_HINT}", .path.display())]
    Library {
        path: PathBuf,
        #[source]
        source: ort::LoadDynamicError,
    },
    /// The library loaded, but its environment could not be created.
    #[error("cannot start ONNX Runtime from `{}`", .path.display())]
    Environment {
        path: PathBuf,
        #[source]
        source: ort::Error,
    },
    /// A process loads one ONNX Runtime library; a second path is refused.
    #[error(
        "ONNX Runtime is already loaded from `{}`, so `{}` cannot be loaded too; hint: give every \
         NPU backend of a process the same library",
        .loaded.display(), .requested.display()
    )]
    LibraryConflict { loaded: PathBuf, requested: PathBuf },
    /// A provider name that is not one of [`Provider::ALL`].
    #[error(
        "unknown execution provider `{name}`; hint: choose from nnapi, coreml, qnn, cann, \
         tensorrt, cuda, cpu"
    )]
    UnknownProvider { name: String },
    /// An empty preference list.
    #[error("no execution provider is listed; hint: list at least `cpu`")]
    NoProviderListed,
    /// None of the listed providers can be used with the loaded library.
    #[error(
        "none of the execution providers {} can be used with ONNX Runtime {version} from `{}` \
         ({}); hint: add `cpu` to the list, or load a build of ONNX Runtime with one of them",
        list(.wanted), .library.display(), .missing.join("; ")
    )]
    NoUsableProvider {
        wanted: Vec<Provider>,
        version: String,
        library: PathBuf,
        missing: Vec<String>,
    },
    /// ONNX Runtime failed while asking which providers it has.
    #[error("cannot list the execution providers of ONNX Runtime")]
    Providers {
        #[source]
        source: ort::Error,
    },
}

fn list(providers: &[Provider]) -> String {
    let names: Vec<&str> = providers.iter().map(|p| p.name()).collect();
    names.join(", ")
}
