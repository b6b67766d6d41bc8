//! A model: what one IR file holds — parameters, named entry points and
//! metadata.
//!
//! Entry-point conventions (shared by every tier):
//! - a graph input named `params/NAME` is bound to parameter `NAME`;
//! - `infer(params/…, x) -> (logits)`;
//! - `eval(params/…, x, y) -> (loss, correct)`;
//! - `train_step(params/…, state/NAME/SLOT…, x, y, lr, step, seed)
//!    -> (params/NAME for each trainable NAME, state/…, loss, correct)`.

use std::collections::BTreeMap;

use crate::data::TensorData;
use crate::error::{IrError, IrResult};
use crate::graph::Graph;

pub const ENTRY_INFER: &str = "infer";
pub const ENTRY_TRAIN_STEP: &str = "train_step";
pub const ENTRY_EVAL: &str = "eval";
/// Prefix of graph inputs and outputs bound to parameters.
pub const PARAM_PREFIX: &str = "params/";
/// Prefix of optimizer-state inputs and outputs of `train_step`.
pub const STATE_PREFIX: &str = "state/";

/// A named tensor of the model.
#[derive(Clone, Debug, PartialEq)]
pub struct Parameter {
    pub name: String,
    pub data: TensorData,
    /// Frozen parameters (false) get no gradient and no optimizer state.
    pub trainable: bool,
}

#[derive(Clone, Debug, PartialEq, Default)]
pub struct Metadata {
    pub model_name: String,
    /// SHA-256 digest of the model this one was derived from.
    pub parent_digest: Option<[u8; 32]>,
    /// Who wrote the file, e.g. `canopy 0.1.0`.
    pub producer: String,
    /// Free-form string pairs (architecture, optimizer, …).
    pub properties: BTreeMap<String, String>,
}

#[derive(Clone, Debug, PartialEq, Default)]
pub struct Model {
    pub metadata: Metadata,
    pub parameters: Vec<Parameter>,
    pub entry_points: BTreeMap<String, Graph>,
}

impl Model {
    pub fn parameter(&self, name: &str) -> Option<&Parameter> {
        self.parameters.iter().find(|p| p.name == name)
    }

    pub fn parameter_mut(&mut self, name: &str) -> Option<&mut Parameter> {
        self.parameters.iter_mut().find(|p| p.name == name)
    }

    pub fn entry(&self, name: &str) -> IrResult<&Graph> {
        self.entry_points
            .get(name)
            .ok_or_else(|| IrError::Invalid(format!("model has no entry point `{name}`")))
    }

    /// Names of the trainable parameters, in declaration order.
    pub fn trainable_names(&self) -> Vec<String> {
        self.parameters
            .iter()
            .filter(|p| p.trainable)
            .map(|p| p.name.clone())
            .collect()
    }

    /// Total elements of trainable parameters.
    pub fn trainable_elements(&self) -> usize {
        self.parameters
            .iter()
            .filter(|p| p.trainable)
            .map(|p| p.data.num_elements())
            .sum()
    }

    /// Checks that every entry point verifies and that every `params/NAME`
    /// input names a parameter of the same type.
    pub fn validate(&self) -> IrResult<()> {
        // A map, not `parameter()`'s scan: a hostile file may pair many
        // inputs with many parameters.
        let mut by_name = std::collections::HashMap::with_capacity(self.parameters.len());
        for p in &self.parameters {
            if by_name.insert(p.name.as_str(), p).is_some() {
                return Err(IrError::Invalid(format!(
                    "parameter `{}` is declared twice",
                    p.name
                )));
            }
        }
        for (entry, graph) in &self.entry_points {
            crate::verify::verify(graph)
                .map_err(|e| IrError::Invalid(format!("entry point `{entry}`: {e}")))?;
            for &input in graph.inputs() {
                let name = graph.input_name(input);
                let Some(param_name) = name.strip_prefix(PARAM_PREFIX) else {
                    continue;
                };
                let Some(param) = by_name.get(param_name) else {
                    return Err(IrError::Invalid(format!(
                        "entry point `{entry}` reads `{name}`, but the model has no parameter `{param_name}`"
                    )));
                };
                let want = param.data.tensor_type();
                if *graph.ty(input) != want {
                    return Err(IrError::Invalid(format!(
                        "entry point `{entry}` reads `{name}` as {}, but the parameter is {want}",
                        graph.ty(input)
                    )));
                }
            }
        }
        Ok(())
    }
}
