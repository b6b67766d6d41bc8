//! The JSON header's records. These serde types are private to the format
//! module so that the IR types themselves stay serde-free; `write` and
//! `read` translate between the two.
//!
//! Field order here is the canonical key order of the file (serde emits
//! struct fields in declaration order), so reordering fields is a format
//! change.

use std::fmt;

use serde::de::{self, MapAccess, Visitor};
use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct HeaderRec {
    pub model: MetadataRec,
    pub parameters: Vec<ParamRec>,
    pub entry_points: OrderedMap<GraphRec>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct MetadataRec {
    pub name: String,
    /// Lowercase hex, or null.
    pub parent_digest: Option<String>,
    pub producer: String,
    pub properties: OrderedMap<String>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ParamRec {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<u64>,
    pub trainable: bool,
    pub data: DataRef,
}

/// A byte range of the data section, relative to its start.
#[derive(Serialize, Deserialize, Clone, Copy)]
#[serde(deny_unknown_fields)]
pub(crate) struct DataRef {
    pub offset: u64,
    pub bytes: u64,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct GraphRec {
    pub nodes: Vec<NodeRec>,
    pub outputs: Vec<OutputRec>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct OutputRec {
    pub name: String,
    pub value: u32,
}

/// One node: the op name, then only the attributes that op has, then its
/// inputs and declared type. Which attributes an op has is `ops.rs`'s
/// business; here every attribute is optional.
#[derive(Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(crate) struct NodeRec {
    pub op: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transpose_a: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transpose_b: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub axes: Option<Vec<u64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep_dims: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shape: Option<Vec<DimRec>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub perm: Option<Vec<u64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub axis: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub before: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dim_size: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub depth: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel: Option<[u64; 2]>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stride: Option<[u64; 2]>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub padding: Option<[u64; 2]>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dilation: Option<[u64; 2]>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_hw: Option<[u64; 2]>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel_hw: Option<[u64; 2]>,
    /// A small constant's bytes, inline as lowercase hex.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    /// A large constant's bytes in the data section.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<DataRef>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forward: Option<Box<GraphRec>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backward: Option<Box<GraphRec>>,
    // Opset 3: control flow. The scalars come before the graphs so that
    // a reader of the JSON sees a loop's shape before its body, and the
    // graphs keep the order in which their tensors are packed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub carries: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scanned: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub length: Option<DimRec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reverse: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_trips: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cond: Option<Box<GraphRec>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body: Option<Box<GraphRec>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub then_branch: Option<Box<GraphRec>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub else_branch: Option<Box<GraphRec>>,
    pub inputs: Vec<u32>,
    #[serde(rename = "type")]
    pub ty: TypeRec,
}

impl NodeRec {
    /// The attributes this record carries, for rejecting ones its op lacks.
    pub fn present_attrs(&self) -> impl Iterator<Item = &'static str> {
        [
            ("name", self.name.is_some()),
            ("to", self.to.is_some()),
            ("transpose_a", self.transpose_a.is_some()),
            ("transpose_b", self.transpose_b.is_some()),
            ("axes", self.axes.is_some()),
            ("keep_dims", self.keep_dims.is_some()),
            ("shape", self.shape.is_some()),
            ("perm", self.perm.is_some()),
            ("axis", self.axis.is_some()),
            ("start", self.start.is_some()),
            ("end", self.end.is_some()),
            ("before", self.before.is_some()),
            ("after", self.after.is_some()),
            ("dim_size", self.dim_size.is_some()),
            ("depth", self.depth.is_some()),
            ("kernel", self.kernel.is_some()),
            ("stride", self.stride.is_some()),
            ("padding", self.padding.is_some()),
            ("dilation", self.dilation.is_some()),
            ("input_hw", self.input_hw.is_some()),
            ("kernel_hw", self.kernel_hw.is_some()),
            ("value", self.value.is_some()),
            ("data", self.data.is_some()),
            ("forward", self.forward.is_some()),
            ("backward", self.backward.is_some()),
            ("index", self.index.is_some()),
            ("carries", self.carries.is_some()),
            ("scanned", self.scanned.is_some()),
            ("length", self.length.is_some()),
            ("reverse", self.reverse.is_some()),
            ("checkpoint", self.checkpoint.is_some()),
            ("max_trips", self.max_trips.is_some()),
            ("cond", self.cond.is_some()),
            ("body", self.body.is_some()),
            ("then_branch", self.then_branch.is_some()),
            ("else_branch", self.else_branch.is_some()),
        ]
        .into_iter()
        .filter_map(|(name, present)| present.then_some(name))
    }
}

#[derive(Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(crate) struct TypeRec {
    pub dtype: String,
    pub shape: Vec<DimRec>,
}

/// A dimension: a number, or `"N"` for the batch dimension.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum DimRec {
    Fixed(u64),
    Batch,
}

impl Serialize for DimRec {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            DimRec::Fixed(n) => s.serialize_u64(*n),
            DimRec::Batch => s.serialize_str("N"),
        }
    }
}

impl<'de> Deserialize<'de> for DimRec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(DimVisitor)
    }
}

struct DimVisitor;

impl Visitor<'_> for DimVisitor {
    type Value = DimRec;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a dimension: a non-negative integer or \"N\"")
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<DimRec, E> {
        Ok(DimRec::Fixed(v))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<DimRec, E> {
        match v {
            "N" => Ok(DimRec::Batch),
            _ => Err(E::invalid_value(de::Unexpected::Str(v), &self)),
        }
    }
}

/// A JSON object read as an ordered list of pairs, so that duplicate and
/// unsorted keys reach the decoder (which names them) instead of being
/// silently merged by a map type.
pub(crate) struct OrderedMap<V>(pub Vec<(String, V)>);

impl<V: Serialize> Serialize for OrderedMap<V> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            map.serialize_entry(k, v)?;
        }
        map.end()
    }
}

impl<'de, V: Deserialize<'de>> Deserialize<'de> for OrderedMap<V> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_map(PairsVisitor(std::marker::PhantomData))
    }
}

struct PairsVisitor<V>(std::marker::PhantomData<V>);

impl<'de, V: Deserialize<'de>> Visitor<'de> for PairsVisitor<V> {
    type Value = OrderedMap<V>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut access: A) -> Result<Self::Value, A::Error> {
        // No pre-allocation from a size hint: the hint could be attacker-chosen.
        let mut pairs = Vec::new();
        while let Some(pair) = access.next_entry()? {
            pairs.push(pair);
        }
        Ok(OrderedMap(pairs))
    }
}
