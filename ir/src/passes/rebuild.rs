//! The forward-sweep rebuilder every pass shares: it copies a graph node by
//! node into a fresh one, remembering where each old value went.
//!
//! Passes never edit a graph in place; they decide, per node, to copy it,
//! replace it or forward it to an existing value. Because nodes are in
//! topological order, one sweep sees every operand already rewritten.

use crate::error::{IrError, IrResult};
use crate::graph::{Graph, ValueId};
use crate::op::Op;

pub(crate) struct Rebuild<'a> {
    pub(crate) src: &'a Graph,
    pub(crate) out: Graph,
    /// Old value index → new value; `None` for nodes dropped so far.
    map: Vec<Option<ValueId>>,
    pass: &'static str,
}

impl<'a> Rebuild<'a> {
    pub(crate) fn new(src: &'a Graph, pass: &'static str) -> Rebuild<'a> {
        Rebuild {
            src,
            out: Graph::new(),
            map: vec![None; src.len()],
            pass,
        }
    }

    /// The new value standing for old value `old`.
    pub(crate) fn get(&self, old: ValueId) -> IrResult<ValueId> {
        self.map[old.index()].ok_or_else(|| {
            IrError::Invalid(format!("{}: {old} is read after being dropped", self.pass))
        })
    }

    /// The new values standing for old node `old`'s operands.
    pub(crate) fn operands(&self, old: ValueId) -> IrResult<Vec<ValueId>> {
        self.src
            .node(old)
            .inputs
            .iter()
            .map(|&i| self.get(i))
            .collect()
    }

    /// Records that old value `old` is now `new`. Types must match: every
    /// pass is type-preserving, which is what keeps output types intact.
    pub(crate) fn bind(&mut self, old: ValueId, new: ValueId) -> IrResult<()> {
        let (was, now) = (self.src.ty(old), self.out.ty(new));
        if was != now {
            return Err(IrError::Invalid(format!(
                "{}: {old} changed type from {was} to {now}",
                self.pass
            )));
        }
        self.map[old.index()] = Some(new);
        Ok(())
    }

    /// Re-declares old input node `old`, keeping its name, type and position.
    pub(crate) fn copy_input(&mut self, old: ValueId) -> IrResult<ValueId> {
        let name = self.src.input_name(old).to_string();
        let new = self.out.input(name, self.src.ty(old).clone())?;
        self.bind(old, new)?;
        Ok(new)
    }

    /// Appends `op(inputs)` (new values) as the replacement of `old`.
    pub(crate) fn emit(&mut self, old: ValueId, op: Op, inputs: &[ValueId]) -> IrResult<ValueId> {
        let new = self.out.push(op, inputs)?;
        self.bind(old, new)?;
        Ok(new)
    }

    /// Copies old node `old` unchanged (operands remapped).
    pub(crate) fn copy(&mut self, old: ValueId) -> IrResult<ValueId> {
        if matches!(self.src.node(old).op, Op::Input { .. }) {
            return self.copy_input(old);
        }
        let inputs = self.operands(old)?;
        self.emit(old, self.src.node(old).op.clone(), &inputs)
    }

    /// Remaps the outputs and verifies the result.
    pub(crate) fn finish(mut self) -> IrResult<Graph> {
        let outputs = self
            .src
            .outputs()
            .iter()
            .map(|(name, v)| Ok((name.clone(), self.get(*v)?)))
            .collect::<IrResult<Vec<_>>>()?;
        self.out.set_outputs(outputs)?;
        crate::verify::verify(&self.out)?;
        Ok(self.out)
    }
}

/// Old value ids of a graph, in node order.
pub(crate) fn ids(g: &Graph) -> impl Iterator<Item = ValueId> {
    (0..g.len()).map(|i| ValueId(i as u32))
}
