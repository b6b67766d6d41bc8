//! One wgpu device: adapter choice, the pipeline cache and buffer
//! creation within the adapter's limits.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::backend::AdapterInfo;
use crate::error::{EngineError, EngineResult};

use super::AdapterPreference;

/// Pipelines kept per context, at most; beyond it the cache is cleared
/// (a long-lived process that sees many batch sizes must not grow without
/// bound).
pub const MAX_CACHED_PIPELINES: usize = 4096;

/// Longest wait for one submission, in milliseconds: past it the device
/// is treated as hung and the run fails instead of blocking forever.
pub const SUBMISSION_TIMEOUT_MS: u64 = 120_000;

pub struct GpuContext {
    device: wgpu::Device,
    queue: wgpu::Queue,
    info: AdapterInfo,
    limits: wgpu::Limits,
    pipelines: Mutex<HashMap<String, Arc<wgpu::ComputePipeline>>>,
}

/// Adapters by preference: discrete, integrated, virtual, CPU, other.
pub(crate) fn ranked_adapters() -> Vec<wgpu::Adapter> {
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
        backends: wgpu::Backends::VULKAN | wgpu::Backends::METAL | wgpu::Backends::DX12,
        ..wgpu::InstanceDescriptor::new_without_display_handle_from_env()
    });
    let mut adapters = pollster::block_on(instance.enumerate_adapters(wgpu::Backends::all()));
    adapters.sort_by_key(|adapter| rank(adapter.get_info().device_type));
    adapters
}

fn rank(device_type: wgpu::DeviceType) -> u8 {
    match device_type {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Cpu => 3,
        wgpu::DeviceType::Other => 4,
    }
}

pub(crate) fn describe_adapter(adapter: &wgpu::Adapter) -> AdapterInfo {
    let info = adapter.get_info();
    let limits = adapter.limits();
    AdapterInfo {
        name: info.name,
        api: match info.backend {
            wgpu::Backend::Vulkan => "vulkan",
            wgpu::Backend::Metal => "metal",
            wgpu::Backend::Dx12 => "dx12",
            wgpu::Backend::Gl => "gl",
            wgpu::Backend::BrowserWebGpu => "webgpu",
            wgpu::Backend::Noop => "noop",
        }
        .to_string(),
        device_type: match info.device_type {
            wgpu::DeviceType::DiscreteGpu => "discrete",
            wgpu::DeviceType::IntegratedGpu => "integrated",
            wgpu::DeviceType::VirtualGpu => "virtual",
            wgpu::DeviceType::Cpu => "cpu",
            wgpu::DeviceType::Other => "other",
        }
        .to_string(),
        driver: format!("{} {}", info.driver, info.driver_info)
            .trim()
            .to_string(),
        max_buffer_bytes: limits
            .max_storage_buffer_binding_size
            .min(limits.max_buffer_size),
        max_workgroups_per_dimension: limits.max_compute_workgroups_per_dimension,
    }
}

impl GpuContext {
    pub fn open(preference: AdapterPreference) -> EngineResult<GpuContext> {
        let adapters = ranked_adapters();
        let found: Vec<String> = adapters
            .iter()
            .map(|a| {
                let d = describe_adapter(a);
                format!("{} ({}, {})", d.name, d.api, d.device_type)
            })
            .collect();
        let adapter = adapters
            .into_iter()
            .find(|adapter| {
                preference == AdapterPreference::Best || rank(adapter.get_info().device_type) <= 1
            })
            .ok_or_else(|| EngineError::Gpu {
                what: "adapter".to_string(),
                cause: if found.is_empty() {
                    "no Vulkan, Metal or DX12 adapter was found (on Linux, install a Vulkan \
                     driver, e.g. mesa-vulkan-drivers)"
                        .to_string()
                } else {
                    format!(
                        "no hardware GPU among the adapters found: {}",
                        found.join(", ")
                    )
                },
            })?;
        let info = describe_adapter(&adapter);
        // Ask for the adapter's own limits: a GPU's buffers are often far
        // larger than the WebGPU defaults.
        let limits = adapter.limits();
        let descriptor = wgpu::DeviceDescriptor {
            label: Some("canopy"),
            required_limits: limits.clone(),
            ..Default::default()
        };
        let (device, queue) =
            pollster::block_on(adapter.request_device(&descriptor)).map_err(|e| {
                EngineError::Gpu {
                    what: format!("device on {}", info.name),
                    cause: e.to_string(),
                }
            })?;
        tracing::info!(adapter = %info.name, api = %info.api, kind = %info.device_type, "GPU backend opened");
        Ok(GpuContext {
            device,
            queue,
            info,
            limits,
            pipelines: Mutex::new(HashMap::new()),
        })
    }

    pub fn adapter(&self) -> &AdapterInfo {
        &self.info
    }

    pub(crate) fn device(&self) -> &wgpu::Device {
        &self.device
    }

    pub(crate) fn queue(&self) -> &wgpu::Queue {
        &self.queue
    }

    pub(crate) fn max_workgroups(&self) -> u32 {
        self.limits.max_compute_workgroups_per_dimension
    }

    /// The most external inputs a fused kernel may read: its bindings are
    /// those, the output and the flag words, within the adapter's
    /// storage buffers per shader stage.
    pub(crate) fn max_fused_inputs(&self) -> usize {
        let per_stage = self.limits.max_storage_buffers_per_shader_stage as usize;
        super::fuse::MAX_INPUTS
            .min(per_stage.saturating_sub(2))
            .max(1)
    }

    /// A pipeline for `source`, compiled once per context.
    ///
    /// The cache's lock is not held while a kernel compiles: a compile
    /// takes milliseconds on a GPU's driver and up to a second on lavapipe
    /// (LLVM), and every thread that shares the context (the tests, a
    /// simulated fleet on one engine) waited on it. Two threads may then
    /// compile the same source at once; the first to finish is kept.
    pub(crate) fn pipeline(
        &self,
        label: &str,
        source: &str,
    ) -> EngineResult<Arc<wgpu::ComputePipeline>> {
        if let Some(pipeline) = self.cached_pipelines()?.get(source) {
            return Ok(pipeline.clone());
        }
        let compiled = Arc::new(self.compile_pipeline(label, source)?);
        let mut cache = self.cached_pipelines()?;
        if cache.len() >= MAX_CACHED_PIPELINES && !cache.contains_key(source) {
            cache.clear();
        }
        Ok(cache.entry(source.to_string()).or_insert(compiled).clone())
    }

    fn cached_pipelines(
        &self,
    ) -> EngineResult<MutexGuard<'_, HashMap<String, Arc<wgpu::ComputePipeline>>>> {
        self.pipelines
            .lock()
            .map_err(|_| EngineError::Internal("GPU pipeline cache poisoned".into()))
    }

    /// Compiles `source`; a validation error names the kernel. Error
    /// scopes are per thread in wgpu, so concurrent compiles catch only
    /// their own errors.
    fn compile_pipeline(&self, label: &str, source: &str) -> EngineResult<wgpu::ComputePipeline> {
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let module = self
            .device
            .create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some(label),
                source: wgpu::ShaderSource::Wgsl(source.into()),
            });
        let pipeline = self
            .device
            .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(label),
                layout: None,
                module: &module,
                entry_point: Some("main"),
                compilation_options: Default::default(),
                cache: None,
            });
        if let Some(error) = pollster::block_on(scope.pop()) {
            return Err(EngineError::Internal(format!(
                "GPU kernel `{label}` failed to build: {error}\n{source}"
            )));
        }
        Ok(pipeline)
    }

    /// A storage buffer of `bytes` (at least 4), or a clear error when it
    /// exceeds what the adapter can bind.
    pub(crate) fn storage_buffer(&self, what: &str, bytes: u64) -> EngineResult<wgpu::Buffer> {
        self.check_size(what, bytes)?;
        Ok(self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(what),
            size: bytes.max(4).next_multiple_of(4),
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        }))
    }

    pub(crate) fn staging_buffer(&self, bytes: u64) -> EngineResult<wgpu::Buffer> {
        self.check_size("the outputs' staging buffer", bytes)?;
        Ok(self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("staging"),
            size: bytes.max(4).next_multiple_of(4),
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        }))
    }

    fn check_size(&self, what: &str, bytes: u64) -> EngineResult<()> {
        if bytes > self.info.max_buffer_bytes {
            return Err(EngineError::Gpu {
                what: what.to_string(),
                cause: format!(
                    "needs {bytes} bytes, more than the {} bytes one buffer may hold on {}; \
                     use a smaller batch, or the CPU backend",
                    self.info.max_buffer_bytes, self.info.name
                ),
            });
        }
        Ok(())
    }

    /// Waits for `submission` (and the queue's work before it), within
    /// [`SUBMISSION_TIMEOUT_MS`]; for all the queue's work when `None`.
    ///
    /// A caller waits for its own submission, not the queue's latest:
    /// threads that share the context (the tests, a simulated fleet on
    /// one engine) would otherwise each wait for the others' work too.
    pub(crate) fn wait(&self, submission: Option<wgpu::SubmissionIndex>) -> EngineResult<()> {
        self.device
            .poll(wgpu::PollType::Wait {
                submission_index: submission,
                timeout: Some(std::time::Duration::from_millis(SUBMISSION_TIMEOUT_MS)),
            })
            .map(|_| ())
            .map_err(|e| EngineError::Gpu {
                what: format!("a submission on {}", self.info.name),
                cause: e.to_string(),
            })
    }

    /// Maps `staging` once `submission`, the last to write it, has run,
    /// and copies it out; `what` names the value read in errors.
    pub(crate) fn read(
        &self,
        staging: &wgpu::Buffer,
        submission: Option<wgpu::SubmissionIndex>,
        what: &str,
    ) -> EngineResult<Vec<u8>> {
        let (sender, receiver) = std::sync::mpsc::channel();
        staging.map_async(wgpu::MapMode::Read, .., move |result| {
            let _ = sender.send(result);
        });
        self.wait(submission)?;
        let failed = |cause: String| EngineError::Gpu {
            what: what.to_string(),
            cause,
        };
        receiver
            .recv()
            .map_err(|_| EngineError::Internal("GPU map callback never ran".into()))?
            .map_err(|e| failed(e.to_string()))?;
        let bytes = {
            let view = staging
                .get_mapped_range(..)
                .map_err(|e| failed(e.to_string()))?;
            view.to_vec()
        };
        staging.unmap();
        Ok(bytes)
    }
}
