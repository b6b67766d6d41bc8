//! The op tables import dispatches on. Each op family lists its ops once,
//! beside their lowerings; dispatch looks a node's op type up in the
//! tables and the public lists of supported ops are generated from the same
//! tables at compile time, so an op cannot be dispatched without being
//! listed, or listed without being dispatched.

use canopy_ir::{TensorData, ValueId};

use super::Lowering;
use crate::error::OnnxError;

/// One supported op: its ONNX name and how it is lowered (`Lower` for the
/// default domain, the ml module's own kind for `ai.onnx.ml`).
pub(crate) struct OpEntry<L> {
    pub(crate) name: &'static str,
    pub(crate) lower: L,
}

/// What a default-domain op's lowering gives the node's output.
#[derive(Clone, Copy)]
pub(crate) enum Lower {
    /// A new value the lowering computes.
    Value(fn(&mut Lowering<'_, '_, '_>) -> Result<ValueId, OnnxError>),
    /// The input the returned name refers to: the output is another name
    /// for it (Identity, inference-mode Dropout).
    Alias(for<'l, 'i, 'a, 'n> fn(&'l mut Lowering<'i, 'a, 'n>) -> Result<&'n str, OnnxError>),
    /// A constant known at import time (Constant).
    Constant(fn(&mut Lowering<'_, '_, '_>) -> Result<TensorData, OnnxError>),
    /// One new value per output, in order (If, Loop and Scan, whose
    /// outputs are a control-flow node's results).
    Values(fn(&mut Lowering<'_, '_, '_>) -> Result<Vec<ValueId>, OnnxError>),
}

impl OpEntry<Lower> {
    pub(crate) const fn value(
        name: &'static str,
        lower: fn(&mut Lowering<'_, '_, '_>) -> Result<ValueId, OnnxError>,
    ) -> Self {
        OpEntry {
            name,
            lower: Lower::Value(lower),
        }
    }

    pub(crate) const fn alias(
        name: &'static str,
        lower: for<'l, 'i, 'a, 'n> fn(&'l mut Lowering<'i, 'a, 'n>) -> Result<&'n str, OnnxError>,
    ) -> Self {
        OpEntry {
            name,
            lower: Lower::Alias(lower),
        }
    }

    pub(crate) const fn constant(
        name: &'static str,
        lower: fn(&mut Lowering<'_, '_, '_>) -> Result<TensorData, OnnxError>,
    ) -> Self {
        OpEntry {
            name,
            lower: Lower::Constant(lower),
        }
    }
}

impl OpEntry<Lower> {
    pub(crate) const fn values(
        name: &'static str,
        lower: fn(&mut Lowering<'_, '_, '_>) -> Result<Vec<ValueId>, OnnxError>,
    ) -> Self {
        OpEntry {
            name,
            lower: Lower::Values(lower),
        }
    }
}

/// The entry named `op_type`, if a table holds one.
pub(crate) fn find<L>(
    families: &'static [&'static [OpEntry<L>]],
    op_type: &str,
) -> Option<&'static OpEntry<L>> {
    families
        .iter()
        .flat_map(|family| family.iter())
        .find(|entry| entry.name == op_type)
}

/// How many ops the tables hold.
pub(crate) const fn op_count<L>(families: &[&[OpEntry<L>]]) -> usize {
    let (mut count, mut family) = (0, 0);
    while family < families.len() {
        count += families[family].len();
        family += 1;
    }
    count
}

/// Every op name of the tables, sorted. Evaluated while compiling: a name
/// two entries share (one would shadow the other in [`find`]) stops the
/// build.
pub(crate) const fn sorted_names<L, const COUNT: usize>(
    families: &[&[OpEntry<L>]],
) -> [&'static str; COUNT] {
    assert!(
        op_count(families) == COUNT,
        "COUNT is not the tables' op count"
    );
    let mut names = [""; COUNT];
    let (mut next, mut family) = (0, 0);
    while family < families.len() {
        let mut entry = 0;
        while entry < families[family].len() {
            // Insertion sort: move the new name down to its place.
            let mut place = next;
            names[place] = families[family][entry].name;
            while place > 0 && str_before(names[place], names[place - 1]) {
                let earlier = names[place - 1];
                names[place - 1] = names[place];
                names[place] = earlier;
                place -= 1;
            }
            next += 1;
            entry += 1;
        }
        family += 1;
    }
    let mut index = 1;
    while index < COUNT {
        assert!(
            str_before(names[index - 1], names[index]),
            "an op name appears twice in the op tables"
        );
        index += 1;
    }
    names
}

/// Byte-wise `a < b`, as `str`'s `Ord` compares (which is not const).
const fn str_before(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let mut index = 0;
    while index < a.len() && index < b.len() {
        if a[index] != b[index] {
            return a[index] < b[index];
        }
        index += 1;
    }
    a.len() < b.len()
}
