//! The `Backend` over ONNX Runtime: a graph is exported to ONNX in memory
//! (`canopy_onnx::export_graph`), committed as one session on the
//! configured execution providers, and run on host values.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use canopy_engine::backend::{Backend, BackendInfo, Executable, HostResidency};
use canopy_engine::cpu::bind_batch;
use canopy_engine::{EngineError, EngineResult, Value};
use canopy_ir::{DType, Graph, ValueId};
use ndarray::{ArrayD, IxDyn};
use ort::session::{Session, SessionInputValue};
use ort::value::{DynValue, TensorElementType, TensorRef, ValueType};

use crate::config::{OrtConfig, Provider};
use crate::error::NpuError;
use crate::runtime::{self, Runtime};

/// The backend's name in reports and errors.
pub const BACKEND_NAME: &str = "npu";

/// A provider the configuration asked for that the loaded runtime cannot
/// use, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MissingProvider {
    pub provider: Provider,
    pub reason: String,
}

/// Sessions created and runs executed, over every executable of a backend:
/// proof of where a graph ran.
#[derive(Debug, Default)]
struct Counters {
    sessions: AtomicU64,
    runs: AtomicU64,
}

/// ONNX Runtime as a canopy backend.
pub struct OrtBackend {
    runtime: Arc<Runtime>,
    /// The usable providers, in the configured order.
    providers: Vec<Provider>,
    missing: Vec<MissingProvider>,
    counters: Arc<Counters>,
}

impl OrtBackend {
    /// Loads the runtime (once per process) and keeps the configured
    /// providers it can use. The others are logged as warnings and listed
    /// by [`OrtBackend::missing_providers`]; an error when none is left.
    pub fn open(config: &OrtConfig) -> Result<OrtBackend, NpuError> {
        if config.providers.is_empty() {
            return Err(NpuError::NoProviderListed);
        }
        let library = runtime::library_path(config.library.as_deref());
        let runtime = runtime::load(&library)?;
        let mut providers = Vec::new();
        let mut missing = Vec::new();
        for &provider in &config.providers {
            match usable(&runtime, provider)? {
                Ok(()) => providers.push(provider),
                Err(reason) => {
                    tracing::warn!(
                        "execution provider `{provider}` skipped: {reason} (ONNX Runtime {} from {})",
                        runtime.version,
                        runtime.library.display()
                    );
                    missing.push(MissingProvider { provider, reason });
                }
            }
        }
        if providers.is_empty() {
            return Err(NpuError::NoUsableProvider {
                wanted: config.providers.clone(),
                version: runtime.version.clone(),
                library: runtime.library.clone(),
                missing: missing
                    .iter()
                    .map(|m| format!("{}: {}", m.provider, m.reason))
                    .collect(),
            });
        }
        Ok(OrtBackend {
            runtime,
            providers,
            missing,
            counters: Arc::default(),
        })
    }

    /// The providers sessions are created with, in order of preference.
    pub fn providers(&self) -> &[Provider] {
        &self.providers
    }

    /// The configured providers the loaded runtime lacks, with the reason.
    pub fn missing_providers(&self) -> &[MissingProvider] {
        &self.missing
    }

    pub fn library(&self) -> &Path {
        &self.runtime.library
    }

    /// ONNX Runtime's release (`1.32`).
    pub fn runtime_version(&self) -> &str {
        &self.runtime.version
    }

    /// Sessions this backend has created (one per compiled graph).
    pub fn sessions_created(&self) -> u64 {
        self.counters.sessions.load(Ordering::Relaxed)
    }

    /// Session runs over all of this backend's executables.
    pub fn runs(&self) -> u64 {
        self.counters.runs.load(Ordering::Relaxed)
    }

    fn session(&self, graph: &Graph) -> EngineResult<Session> {
        let model = canopy_onnx::export_graph(graph, &canopy_onnx::ExportOptions::default())
            .map_err(|e| EngineError::Unsupported {
                backend: BACKEND_NAME.to_string(),
                what: e.to_string(),
            })?;
        let bytes = canopy_onnx::encode(&model);
        let dispatches: Vec<_> = self
            .providers
            .iter()
            .map(|&p| runtime::dispatch(p))
            .collect();
        let what = || {
            format!(
                "a session for a graph of {} nodes on {}",
                graph.len(),
                provider_list(&self.providers)
            )
        };
        let session = Session::builder(&self.runtime.environment)
            .and_then(|builder| {
                builder
                    .with_execution_providers(&dispatches)
                    .map_err(Into::into)
            })
            .and_then(|mut builder| builder.commit_from_memory(&bytes))
            .map_err(|source| runtime_error(what(), source))?;
        self.counters.sessions.fetch_add(1, Ordering::Relaxed);
        Ok(session)
    }
}

/// `Ok(Ok(()))` when `provider` can be registered, `Ok(Err(reason))` when
/// not.
fn usable(runtime: &Runtime, provider: Provider) -> Result<Result<(), String>, NpuError> {
    if !runtime::is_built_in(provider)? {
        return Ok(Err(format!(
            "this ONNX Runtime build has no {}",
            runtime::runtime_name(provider)
        )));
    }
    Ok(runtime::probe(runtime, provider))
}

fn provider_list(providers: &[Provider]) -> String {
    let names: Vec<&str> = providers.iter().map(|p| p.name()).collect();
    names.join(", ")
}

fn runtime_error(what: String, source: ort::Error) -> EngineError {
    EngineError::Runtime {
        backend: BACKEND_NAME.to_string(),
        what,
        source: Box::new(source),
    }
}

impl Backend for OrtBackend {
    fn name(&self) -> &'static str {
        BACKEND_NAME
    }

    fn compile(&self, graph: &Graph) -> EngineResult<Box<dyn Executable>> {
        canopy_ir::verify::verify(graph)?;
        let (exported, onnx_outputs) = with_positional_outputs(graph)?;
        let session = self.session(&exported)?;
        Ok(Box::new(OrtExecutable {
            session,
            onnx_outputs,
            graph: graph.clone(),
            input_names: graph.input_names().iter().map(|s| s.to_string()).collect(),
            output_names: graph.outputs().iter().map(|(n, _)| n.clone()).collect(),
            residency: HostResidency::default(),
            counters: self.counters.clone(),
        }))
    }

    fn describe(&self) -> BackendInfo {
        BackendInfo {
            backend: BACKEND_NAME.to_string(),
            adapter: None,
        }
    }
}

/// `graph` with its outputs renamed `output/0`, `output/1`, … (clear of
/// its input names), and those names: ONNX names every value once, so an
/// output may not share its input's name, as a resident update does
/// (`w` in, `w` out).
fn with_positional_outputs(graph: &Graph) -> EngineResult<(Graph, Vec<String>)> {
    let inputs = graph.input_names();
    let names: Vec<String> = (0..graph.outputs().len())
        .map(|position| {
            let mut name = format!("output/{position}");
            while inputs.contains(&name.as_str()) {
                name.insert(0, '_');
            }
            name
        })
        .collect();
    let mut renamed = graph.clone();
    let outputs = names
        .iter()
        .zip(graph.outputs())
        .map(|(name, (_, id))| (name.clone(), *id))
        .collect();
    renamed.set_outputs(outputs)?;
    Ok((renamed, names))
}

/// A graph as one ONNX Runtime session. Values stay on the host between
/// runs; resident ones are kept as `Value`s ([`HostResidency`]), as on the
/// CPU backend.
pub struct OrtExecutable {
    session: Session,
    /// The session's names for the graph's outputs, in order.
    onnx_outputs: Vec<String>,
    /// For input checks and output types.
    graph: Graph,
    input_names: Vec<String>,
    output_names: Vec<String>,
    residency: HostResidency,
    counters: Arc<Counters>,
}

impl Executable for OrtExecutable {
    fn run(&mut self, inputs: Vec<Value>) -> EngineResult<Vec<Value>> {
        if inputs.len() != self.input_names.len() {
            return Err(EngineError::InputCount {
                expected: self.input_names.clone(),
                got: inputs.len(),
            });
        }
        let pairs: Vec<(ValueId, &Value)> =
            self.graph.inputs().iter().copied().zip(&inputs).collect();
        bind_batch(&self.graph, &pairs)?;
        let standard: Vec<Value> = inputs.into_iter().map(standard_layout).collect();
        let fed = self
            .input_names
            .iter()
            .zip(&standard)
            .map(|(name, value)| Ok((name.as_str(), tensor_ref(name, value)?)))
            .collect::<EngineResult<Vec<(&str, SessionInputValue<'_>)>>>()?;
        let mut outputs = self
            .session
            .run(fed)
            .map_err(|source| runtime_error("a run of its session".to_string(), source))?;
        self.counters.runs.fetch_add(1, Ordering::Relaxed);
        self.graph
            .outputs()
            .iter()
            .zip(&self.onnx_outputs)
            .map(|((name, id), onnx_name)| {
                let value = outputs.remove(onnx_name.as_str()).ok_or_else(|| {
                    EngineError::Internal(format!("ONNX Runtime returned no output `{name}`"))
                })?;
                to_value(name, &value, self.graph.ty(*id).dtype)
            })
            .collect()
    }

    canopy_engine::host_resident_methods!();
}

/// `value` with its elements in row-major order, as ONNX Runtime reads
/// them (a transposed view is copied; anything else is moved).
fn standard_layout(value: Value) -> Value {
    fn standard<T: Clone>(array: ArrayD<T>) -> ArrayD<T> {
        if array.is_standard_layout() {
            array
        } else {
            array.as_standard_layout().into_owned()
        }
    }
    match value {
        Value::F32(a) => Value::F32(standard(a)),
        Value::I64(a) => Value::I64(standard(a)),
        Value::I32(a) => Value::I32(standard(a)),
        Value::Bool(a) => Value::Bool(standard(a)),
    }
}

/// A tensor over `value`'s elements, without a copy.
fn tensor_ref<'v>(name: &str, value: &'v Value) -> EngineResult<SessionInputValue<'v>> {
    fn view<'v, T: ort::value::PrimitiveTensorElementType + Clone + std::fmt::Debug + 'static>(
        name: &str,
        array: &'v ArrayD<T>,
    ) -> EngineResult<SessionInputValue<'v>> {
        let shape: Vec<i64> = array.shape().iter().map(|&d| d as i64).collect();
        let elements = array.as_slice().ok_or_else(|| {
            EngineError::Internal(format!("input `{name}` is not in row-major order"))
        })?;
        let tensor = TensorRef::from_array_view((shape, elements))
            .map_err(|source| runtime_error(format!("input `{name}`"), source))?;
        Ok(tensor.into())
    }
    match value {
        Value::F32(a) => view(name, a),
        Value::I64(a) => view(name, a),
        Value::I32(a) => view(name, a),
        Value::Bool(a) => view(name, a),
    }
}

/// Output `name` as a host value, checked against the dtype the graph
/// declares for it.
fn to_value(name: &str, value: &DynValue, want: DType) -> EngineResult<Value> {
    let element = match value.dtype() {
        ValueType::Tensor { ty, .. } => *ty,
        other => {
            return Err(EngineError::Internal(format!(
                "ONNX Runtime returned output `{name}` as {other:?}, not a tensor"
            )));
        }
    };
    let got = match element {
        TensorElementType::Float32 => Some(DType::F32),
        TensorElementType::Int64 => Some(DType::I64),
        TensorElementType::Int32 => Some(DType::I32),
        TensorElementType::Bool => Some(DType::Bool),
        _ => None,
    };
    if got != Some(want) {
        return Err(EngineError::DType(format!(
            "output `{name}`: ONNX Runtime returned {element:?} elements, the graph declares {want}"
        )));
    }
    let context = |source| runtime_error(format!("output `{name}`"), source);
    Ok(match want {
        DType::F32 => Value::F32(array(
            name,
            value.try_extract_tensor::<f32>().map_err(context)?,
        )?),
        DType::I64 => Value::I64(array(
            name,
            value.try_extract_tensor::<i64>().map_err(context)?,
        )?),
        DType::I32 => Value::I32(array(
            name,
            value.try_extract_tensor::<i32>().map_err(context)?,
        )?),
        DType::Bool => Value::Bool(array(
            name,
            value.try_extract_tensor::<bool>().map_err(context)?,
        )?),
    })
}

fn array<T: Clone>(
    name: &str,
    (shape, elements): (&ort::value::Shape, &[T]),
) -> EngineResult<ArrayD<T>> {
    let dims: Vec<usize> = shape.iter().map(|&d| d.max(0) as usize).collect();
    ArrayD::from_shape_vec(IxDyn(&dims), elements.to_vec())
        .map_err(|e| EngineError::Internal(format!("output `{name}` of shape {dims:?}: {e}")))
}
