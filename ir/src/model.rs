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

    /// The trainable parameters' values one after another, in declaration
    /// order: the order an update's layout holds them. The one reader of
    /// them for devices, aggregators and tests alike; a trainable
    /// parameter that is not f32 has no place in an update, so it is an
    /// error, not skipped.
    pub fn trainable_values(&self) -> IrResult<Vec<f32>> {
        let mut values = Vec::with_capacity(self.trainable_elements());
        for parameter in self.parameters.iter().filter(|p| p.trainable) {
            let data = parameter.data.as_f32().ok_or_else(|| {
                IrError::Invalid(format!(
                    "trainable parameter `{}` is {}, and only f32 parameters train",
                    parameter.name,
                    parameter.data.buffer.dtype()
                ))
            })?;
            values.extend_from_slice(data);
        }
        Ok(values)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::Buffer;

    fn parameter(name: &str, data: TensorData, trainable: bool) -> Parameter {
        Parameter {
            name: name.to_string(),
            data,
            trainable,
        }
    }

    #[test]
    fn trainable_values_follow_declaration_order_and_skip_frozen() {
        let model = Model {
            parameters: vec![
                parameter("w", TensorData::f32(vec![2], vec![1.0, 2.0]).unwrap(), true),
                parameter(
                    "frozen",
                    TensorData::f32(vec![1], vec![9.0]).unwrap(),
                    false,
                ),
                parameter("b", TensorData::f32(vec![1], vec![3.0]).unwrap(), true),
            ],
            ..Model::default()
        };
        assert_eq!(model.trainable_values().unwrap(), vec![1.0, 2.0, 3.0]);
        assert_eq!(model.trainable_elements(), 3);
    }

    #[test]
    fn a_trainable_parameter_that_is_not_f32_is_named() {
        let steps = TensorData::new(vec![1], Buffer::I64(vec![4])).unwrap();
        let model = Model {
            parameters: vec![parameter("steps", steps, true)],
            ..Model::default()
        };
        let error = model.trainable_values().unwrap_err().to_string();
        assert!(error.contains("`steps` is i64"), "{error}");
    }
}
