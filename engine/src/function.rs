//! `Function`: model code that runs eagerly or as a compiled graph,
//! depending on the thread's [`Mode`].

use std::sync::Arc;

use canopy_ir::TensorType;

use crate::backend::{Backend, Executable};
use crate::cpu::CpuBackend;
use crate::error::EngineResult;
use crate::tensor::{Mode, Tensor, mode, trace};

type Body = dyn Fn(&[Tensor]) -> EngineResult<Vec<Tensor>>;

/// Most compiled signatures one `Function` keeps; a caller that feeds
/// ever-new shapes recompiles instead of growing without bound.
pub const MAX_CACHED_SIGNATURES: usize = 16;

/// A callable over tensors. In eager mode `call` runs the body op by op; in
/// graph mode the first call with a given input signature traces the body,
/// optimises the graph, compiles it on the backend and caches it.
pub struct Function {
    body: Box<Body>,
    backend: Arc<dyn Backend>,
    cache: Vec<(Vec<TensorType>, Box<dyn Executable>)>,
}

impl Function {
    pub fn new(body: impl Fn(&[Tensor]) -> EngineResult<Vec<Tensor>> + 'static) -> Function {
        Function::with_backend(Arc::new(CpuBackend), body)
    }

    pub fn with_backend(
        backend: Arc<dyn Backend>,
        body: impl Fn(&[Tensor]) -> EngineResult<Vec<Tensor>> + 'static,
    ) -> Function {
        Function {
            body: Box::new(body),
            backend,
            cache: Vec::new(),
        }
    }

    /// How many graphs have been compiled and kept.
    pub fn compiled_signatures(&self) -> usize {
        self.cache.len()
    }

    pub fn call(&mut self, args: &[Tensor]) -> EngineResult<Vec<Tensor>> {
        match mode() {
            Mode::Eager => (self.body)(args),
            Mode::Graph => self.call_compiled(args),
        }
    }

    fn call_compiled(&mut self, args: &[Tensor]) -> EngineResult<Vec<Tensor>> {
        let signature: Vec<TensorType> = args.iter().map(Tensor::ty).collect();
        let position = match self.cache.iter().position(|(s, _)| *s == signature) {
            Some(p) => p,
            None => self.compile(signature)?,
        };
        let values = args
            .iter()
            .map(|t| t.value().cloned())
            .collect::<EngineResult<Vec<_>>>()?;
        let outputs = self.cache[position].1.run(values)?;
        Ok(outputs.into_iter().map(Tensor::from_value).collect())
    }

    fn compile(&mut self, signature: Vec<TensorType>) -> EngineResult<usize> {
        let names: Vec<String> = (0..signature.len()).map(|i| format!("arg{i}")).collect();
        let inputs: Vec<(&str, TensorType)> = names
            .iter()
            .map(String::as_str)
            .zip(signature.iter().cloned())
            .collect();
        let body = &self.body;
        let graph = trace(&inputs, |args| {
            let outs = body(args)?;
            Ok(outs
                .into_iter()
                .enumerate()
                .map(|(i, t)| (format!("out{i}"), t))
                .collect())
        })?;
        let graph = crate::optimize_graph(&graph)?;
        let executable = self.backend.compile(&graph)?;
        if self.cache.len() >= MAX_CACHED_SIGNATURES {
            self.cache.remove(0);
        }
        self.cache.push((signature, executable));
        Ok(self.cache.len() - 1)
    }
}

impl std::fmt::Debug for Function {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Function")
            .field("backend", &self.backend.name())
            .field("compiled_signatures", &self.cache.len())
            .finish()
    }
}
