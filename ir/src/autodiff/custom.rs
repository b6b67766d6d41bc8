//! Custom gradients: a forward graph with a user-written backward rule.

use crate::error::IrResult;
use crate::graph::{Graph, ValueId};
use crate::op::{CustomGrad, Op};

/// Builds a `CustomGrad` op after checking it with the verifier's rules:
/// `forward` maps the inputs to one output, and `backward` takes
/// (inputs…, y, dy) and returns one gradient per input, typed like it.
pub fn custom_grad(name: impl Into<String>, forward: Graph, backward: Graph) -> IrResult<Op> {
    let op = Op::CustomGrad(Box::new(CustomGrad {
        name: name.into(),
        forward,
        backward,
    }));
    // The verifier checks custom rules where they are used, so check a
    // one-node call of it rather than duplicating those rules here.
    let Op::CustomGrad(custom) = &op else {
        unreachable!("built just above")
    };
    let mut probe = Graph::new();
    let mut args = Vec::new();
    for (i, &input) in custom.forward.inputs().iter().enumerate() {
        args.push(probe.input(format!("arg{i}"), custom.forward.ty(input).clone())?);
    }
    let out = probe.push(op.clone(), &args)?;
    probe.set_output("out", out)?;
    crate::verify::verify(&probe)?;
    Ok(op)
}

/// Appends a call of a custom-gradient function to `g`: validates the rule
/// with [`custom_grad`] and applies it to `inputs`; returns its output.
pub fn call_custom(
    g: &mut Graph,
    name: impl Into<String>,
    forward: Graph,
    backward: Graph,
    inputs: &[ValueId],
) -> IrResult<ValueId> {
    let op = custom_grad(name, forward, backward)?;
    g.push(op, inputs)
}
