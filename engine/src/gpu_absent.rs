//! The GPU backend's place in a build without the `gpu` feature (an app
//! library that leaves wgpu out: docs/mobile.md, "Size and speed").
//!
//! `GpuBackend` is uninhabited here: no value of it can exist, so code
//! written against the GPU backend compiles unchanged, and the one way
//! to get one, [`GpuBackend::new`], fails with an error that names the
//! build. Backend choice ([`crate::select`]) then falls back to the CPU
//! exactly as on a device whose GPU does not open.

use canopy_ir::Graph;

use crate::backend::{AdapterInfo, Backend, Executable};
use crate::error::{EngineError, EngineResult};

/// Which adapter to use (see the `gpu` feature's backend).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AdapterPreference {
    Best,
    HardwareOnly,
}

/// The wgpu backend, absent from this build.
#[derive(Clone, Debug)]
pub enum GpuBackend {}

impl GpuBackend {
    /// Always fails: this build has no GPU backend.
    pub fn new(_preference: AdapterPreference) -> EngineResult<GpuBackend> {
        Err(EngineError::Gpu {
            what: "backend".to_string(),
            cause: "this build of canopy-engine has no GPU backend (its `gpu` feature is off)"
                .to_string(),
        })
    }

    pub fn adapter(&self) -> &AdapterInfo {
        match *self {}
    }
}

impl Backend for GpuBackend {
    fn name(&self) -> &'static str {
        match *self {}
    }

    fn compile(&self, _graph: &Graph) -> EngineResult<Box<dyn Executable>> {
        match *self {}
    }
}

/// No adapters: there is no GPU backend to drive one.
pub fn list_adapters() -> Vec<AdapterInfo> {
    Vec::new()
}

/// No Vulkan loader is opened, so there is no layer to quiet.
pub fn quiet_device_select_layer() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choosing_the_gpu_in_this_build_fails_naming_the_feature_and_auto_takes_the_cpu() {
        let error = GpuBackend::new(AdapterPreference::Best).unwrap_err();
        assert!(
            error.to_string().contains("`gpu` feature is off"),
            "{error}"
        );
        assert!(crate::select::shared_gpu().is_err());
        let auto = crate::select::open_backend(crate::select::BackendChoice::Auto).expect("CPU");
        assert_eq!(auto.name(), "cpu");
        assert!(list_adapters().is_empty());
    }
}
