//! Typed, checked access to a node's attributes.

use crate::error::OnnxError;
use crate::proto::{AttributeProto, GraphProto, NodeProto, TensorProto, attribute_type};

/// A node's attributes, with the node's description for error messages.
pub(crate) struct Attrs<'a> {
    pub(crate) node: &'a NodeProto,
    pub(crate) describe: &'a str,
}

impl<'a> Attrs<'a> {
    /// Refuses any attribute outside `known` and any duplicate: an
    /// attribute we would ignore could change what the op computes.
    pub(crate) fn allow_only(&self, known: &[&str]) -> Result<(), OnnxError> {
        for (index, attribute) in self.node.attribute.iter().enumerate() {
            if !known.contains(&attribute.name.as_str()) {
                return Err(OnnxError::UnsupportedAttribute {
                    node: self.describe.to_string(),
                    attribute: attribute.name.clone(),
                    value: "(any value)".to_string(),
                    cause: format!("import does not know this attribute; it knows {known:?}"),
                });
            }
            let seen_before = self
                .node
                .attribute
                .iter()
                .take(index)
                .any(|earlier| earlier.name == attribute.name);
            if seen_before {
                return Err(self.invalid(format!("attribute `{}` is given twice", attribute.name)));
            }
        }
        Ok(())
    }

    pub(crate) fn invalid(&self, cause: impl Into<String>) -> OnnxError {
        OnnxError::InvalidNode {
            node: self.describe.to_string(),
            cause: cause.into(),
        }
    }

    pub(crate) fn unsupported(
        &self,
        attribute: &str,
        value: impl std::fmt::Debug,
        cause: impl Into<String>,
    ) -> OnnxError {
        OnnxError::UnsupportedAttribute {
            node: self.describe.to_string(),
            attribute: attribute.to_string(),
            value: format!("{value:?}"),
            cause: cause.into(),
        }
    }

    fn find(&self, name: &str, want: i32) -> Result<Option<&'a AttributeProto>, OnnxError> {
        let Some(attribute) = self.node.attribute.iter().find(|a| a.name == name) else {
            return Ok(None);
        };
        // Writers older than IR 3 leave `type` unset; accept that.
        if attribute.r#type != want && attribute.r#type != attribute_type::UNDEFINED {
            return Err(self.invalid(format!(
                "attribute `{name}` has attribute type {}, expected {want}",
                attribute.r#type
            )));
        }
        Ok(Some(attribute))
    }

    pub(crate) fn has(&self, name: &str) -> bool {
        self.node.attribute.iter().any(|a| a.name == name)
    }

    pub(crate) fn int(&self, name: &str, default: i64) -> Result<i64, OnnxError> {
        Ok(self
            .find(name, attribute_type::INT)?
            .map_or(default, |a| a.i))
    }

    /// Refuses the int attribute `name` unless it is `allowed` (or absent,
    /// defaulting to it): another value asks for semantics canopy does not
    /// have, which `cause` names.
    pub(crate) fn allow_int_only(
        &self,
        name: &str,
        allowed: i64,
        cause: &str,
    ) -> Result<(), OnnxError> {
        let value = self.int(name, allowed)?;
        if value != allowed {
            return Err(self.unsupported(name, value, cause));
        }
        Ok(())
    }

    pub(crate) fn required_int(&self, name: &str) -> Result<i64, OnnxError> {
        self.find(name, attribute_type::INT)?
            .map(|a| a.i)
            .ok_or_else(|| self.invalid(format!("required attribute `{name}` is missing")))
    }

    pub(crate) fn float(&self, name: &str, default: f32) -> Result<f32, OnnxError> {
        Ok(self
            .find(name, attribute_type::FLOAT)?
            .map_or(default, |a| a.f))
    }

    pub(crate) fn ints(&self, name: &str) -> Result<Option<&'a [i64]>, OnnxError> {
        Ok(self
            .find(name, attribute_type::INTS)?
            .map(|a| a.ints.as_slice()))
    }

    pub(crate) fn floats(&self, name: &str) -> Result<Option<&'a [f32]>, OnnxError> {
        Ok(self
            .find(name, attribute_type::FLOATS)?
            .map(|a| a.floats.as_slice()))
    }

    pub(crate) fn string(&self, name: &str) -> Result<Option<String>, OnnxError> {
        Ok(self
            .find(name, attribute_type::STRING)?
            .map(|a| String::from_utf8_lossy(&a.s).into_owned()))
    }

    pub(crate) fn tensor(&self, name: &str) -> Result<Option<&'a TensorProto>, OnnxError> {
        match self.find(name, attribute_type::TENSOR)? {
            None => Ok(None),
            Some(attribute) => attribute
                .t
                .as_ref()
                .map(Some)
                .ok_or_else(|| self.invalid(format!("attribute `{name}` holds no tensor"))),
        }
    }

    /// The required graph attribute `name` (a Loop's body, an If's branch).
    pub(crate) fn graph(&self, name: &str) -> Result<&'a GraphProto, OnnxError> {
        self.find(name, attribute_type::GRAPH)?
            .ok_or_else(|| self.invalid(format!("required attribute `{name}` is missing")))?
            .g
            .as_ref()
            .ok_or_else(|| self.invalid(format!("attribute `{name}` holds no graph")))
    }
}
