//! Control flow: If, Loop and Scan, lowered to canopy-ir's `cond`,
//! `while_loop` and `scan`, each subgraph lowered as a body one scope down
//! ([`Importer::lower_body`]).
//!
//! ONNX bodies read outer values by name; canopy-ir's bodies are closed
//! graphs, so each outer value a body reads becomes one of its last inputs
//! (a scan's or a loop's constants, a branch's operands), threaded through
//! every scope between. canopy-ir's types are static, so a loop needs a
//! constant bound: a Loop with no `M`, or one computed at run time, is
//! refused, as is a Loop whose stacked outputs would have as many rows as a
//! run-time condition decides.

use canopy_ir::{
    Buffer, Cond, DType, Dim, Graph, IrResult, Op, Scan, Shape, TensorData, TensorType, ValueId,
    WhileLoop,
};

use super::Lowering;
use super::table::{Lower, OpEntry};
use crate::decode::dtype_of;
use crate::error::OnnxError;
use crate::import::{Body, BodySpec, Importer};
use crate::proto::{GraphProto, ValueInfoProto, type_proto};

pub(super) const OPS: &[OpEntry<Lower>] = &[
    OpEntry::values("If", |l| l.if_node()),
    OpEntry::values("Loop", |l| l.loop_node()),
    OpEntry::values("Scan", |l| l.scan_node()),
];

/// Whether `data` is a single `true`.
fn is_true(data: Option<&TensorData>) -> Option<bool> {
    match data.map(|d| &d.buffer) {
        Some(Buffer::Bool(v)) if v.len() == 1 => Some(v[0]),
        _ => None,
    }
}

fn bool_scalar() -> TensorType {
    TensorType::scalar(DType::Bool)
}

fn i64_scalar() -> TensorType {
    TensorType::scalar(DType::I64)
}

/// One input of a rebuilt body: one of its inputs, kept, or a new one.
enum Slot {
    Keep(ValueId),
    New(String, TensorType),
}

/// `graph` with its inputs declared as `slots` say, in that order; an
/// input no slot keeps must be unread. Node order follows input order in
/// canopy-ir, so a body whose inputs change is rebuilt node by node.
fn rebuild(graph: &Graph, slots: &[Slot]) -> IrResult<Graph> {
    let mut out = Graph::new();
    let mut map: Vec<Option<ValueId>> = vec![None; graph.len()];
    for slot in slots {
        match slot {
            Slot::Keep(input) => {
                let name = graph.input_name(*input).to_string();
                map[input.index()] = Some(out.input(name, graph.ty(*input).clone())?);
            }
            Slot::New(name, ty) => {
                out.input(name.clone(), ty.clone())?;
            }
        }
    }
    let dropped = |id: ValueId| {
        canopy_ir::IrError::Invalid(format!("the body's input {id} is read but was dropped"))
    };
    for (index, node) in graph.nodes().iter().enumerate() {
        if let Op::Input { .. } = node.op {
            continue;
        }
        let inputs = node
            .inputs
            .iter()
            .map(|&i| map[i.index()].ok_or_else(|| dropped(i)))
            .collect::<IrResult<Vec<_>>>()?;
        map[index] = Some(out.push(node.op.clone(), &inputs)?);
    }
    let outputs = graph
        .outputs()
        .iter()
        .map(|(name, v)| Ok((name.clone(), map[v.index()].ok_or_else(|| dropped(*v))?)))
        .collect::<IrResult<Vec<_>>>()?;
    out.set_outputs(outputs)?;
    Ok(out)
}

/// Whether a node of `graph` reads `value`, or `outputs` holds it.
fn is_read(graph: &Graph, value: ValueId, outputs: &[ValueId]) -> bool {
    outputs.contains(&value) || graph.nodes().iter().any(|n| n.inputs.contains(&value))
}

/// `base`, with `_` appended until no name of `taken` is it.
fn distinct(base: &str, taken: &[&str]) -> String {
    let mut name = base.to_string();
    while taken.contains(&name.as_str()) {
        name.push('_');
    }
    name
}

impl Importer<'_> {
    /// `value` as a bool scalar: a condition may be any bool tensor of one
    /// element (PyTorch writes `[1]`).
    fn condition(&mut self, value: ValueId, what: &str, node: &str) -> Result<ValueId, OnnxError> {
        let ty = self.ty(value).clone();
        let one_element = ty.shape.0.iter().all(|&d| d == Dim::Fixed(1));
        if ty.dtype != DType::Bool || !one_element {
            return Err(OnnxError::InvalidNode {
                node: node.to_string(),
                cause: format!("{what} is {ty}; it must be a bool tensor of one element"),
            });
        }
        if ty.rank() == 0 {
            return Ok(value);
        }
        self.graph
            .reshape(value, Vec::new())
            .map_err(|source| OnnxError::Lowering {
                node: node.to_string(),
                source,
            })
    }
}

impl<'n> Lowering<'_, '_, 'n> {
    fn refuse(&self, cause: impl Into<String>, hint: impl Into<String>) -> OnnxError {
        OnnxError::UnsupportedControlFlow {
            node: self.describe().to_string(),
            cause: cause.into(),
            hint: hint.into(),
        }
    }

    /// The inputs a subgraph declares, typed as the node's operands make
    /// them (`types`): producers often leave a body's input types out, or
    /// leave their sizes symbolic. A declared element type must agree.
    fn body_inputs(
        &self,
        body: &GraphProto,
        role: &str,
        types: Vec<TensorType>,
    ) -> Result<Vec<(String, TensorType)>, OnnxError> {
        if body.input.len() != types.len() {
            return Err(self.attrs.invalid(format!(
                "its {role} declares {} inputs; it must declare {}",
                body.input.len(),
                types.len()
            )));
        }
        body.input
            .iter()
            .zip(types)
            .map(|(info, ty)| {
                check_element_type(info, &ty).map_err(|declared| {
                    self.attrs.invalid(format!(
                        "input `{}` of its {role} is declared {declared}, but the node gives it {ty}",
                        info.name
                    ))
                })?;
                Ok((info.name.clone(), ty))
            })
            .collect()
    }

    /// Every input of the node, none of them optional.
    fn all_inputs(&mut self, from: usize) -> Result<Vec<ValueId>, OnnxError> {
        (from..self.node.input.len())
            .map(|position| self.input(position))
            .collect()
    }

    /// ONNX `If`: a `cond` whose operands are the outer values either
    /// branch reads; the then branch is lowered first, the else branch
    /// reads its operands first, and the then branch takes the else
    /// branch's others as inputs it does not read.
    fn if_node(&mut self) -> Result<Vec<ValueId>, OnnxError> {
        self.attrs.allow_only(&["then_branch", "else_branch"])?;
        self.expect_inputs(1, 1)?;
        let branches = [
            self.attrs.graph("then_branch")?,
            self.attrs.graph("else_branch")?,
        ];
        for (role, branch) in ["then_branch", "else_branch"].iter().zip(branches) {
            if !branch.input.is_empty() {
                return Err(self.attrs.invalid(format!(
                    "its {role} declares inputs; an If branch has none and reads outer values by name"
                )));
            }
        }
        let describe = self.describe().to_string();
        let pred = self.input(0)?;
        let pred = self.imp.condition(pred, "the condition", &describe)?;
        let then_body = self.branch(branches[0], "then_branch", Vec::new())?;
        let else_body = self.branch(branches[1], "else_branch", then_body.captures.clone())?;
        let mut then_branch = then_body.graph;
        for (name, value) in &else_body.captures[then_body.captures.len()..] {
            let ty = self.imp.ty(*value).clone();
            self.ir(then_branch.input(name.clone(), ty))?;
        }
        let mut operands = vec![pred];
        operands.extend(else_body.captures.iter().map(|(_, v)| *v));
        let cond = Cond {
            then_branch,
            else_branch: else_body.graph,
        };
        let results = self
            .imp
            .graph
            .push_tuple(Op::Cond(Box::new(cond)), &operands);
        self.ir(results)
    }

    /// One branch of an If, reading `captured` first.
    fn branch(
        &mut self,
        branch: &GraphProto,
        role: &str,
        captured: Vec<(String, ValueId)>,
    ) -> Result<Body<()>, OnnxError> {
        let describe = self.describe().to_string();
        let role = format!("the {role} of {describe}");
        let spec = BodySpec {
            graph: branch,
            role: role.clone(),
            inputs: Vec::new(),
            constants: Vec::new(),
            captured,
        };
        self.imp.lower_body(spec, &describe, |imp| {
            let outputs = imp.body_outputs(&branch.output, 0, &role)?;
            imp.graph
                .set_outputs(outputs)
                .map_err(|source| OnnxError::Lowering { node: role, source })
        })
    }

    /// ONNX `Scan`: its state variables are the carries, its scan inputs
    /// the `xs`, its scan outputs the stacked `y`s. canopy-ir's scan steps
    /// through the leading axis, every input and output in one direction.
    fn scan_node(&mut self) -> Result<Vec<ValueId>, OnnxError> {
        self.attrs.allow_only(&[
            "body",
            "num_scan_inputs",
            "scan_input_directions",
            "scan_output_directions",
            "scan_input_axes",
            "scan_output_axes",
        ])?;
        let body = self.attrs.graph("body")?;
        let count = self.node.input.len();
        let scanned = self.attrs.required_int("num_scan_inputs")?;
        let scanned = usize::try_from(scanned)
            .ok()
            .filter(|&s| s >= 1 && s <= count)
            .ok_or_else(|| {
                self.attrs.invalid(format!(
                    "num_scan_inputs is {scanned}; it must be from 1 to the node's {count} inputs"
                ))
            })?;
        let states = count - scanned;
        if body.output.len() < states {
            return Err(self.attrs.invalid(format!(
                "its body returns {} values, fewer than its {states} state variables",
                body.output.len()
            )));
        }
        let ys = body.output.len() - states;
        let operands = self.all_inputs(0)?;
        let reverse = self.scan_direction(scanned, ys)?;
        let mut types: Vec<TensorType> = operands[..states]
            .iter()
            .map(|&v| self.imp.ty(v).clone())
            .collect();
        for (position, &x) in operands[states..].iter().enumerate() {
            let ty = self.imp.ty(x).clone();
            let Some((_, step)) = ty.shape.0.split_first() else {
                return Err(self.attrs.invalid(format!(
                    "scan input {position} is a scalar; a scan input needs an axis to step through"
                )));
            };
            types.push(TensorType::new(ty.dtype, Shape(step.to_vec())));
        }
        self.scan_axes("scan_input_axes", &operands[states..])?;
        self.scan_axes("scan_output_axes", &[])?;
        let length = self.imp.ty(operands[states]).shape.0[0];
        if let Dim::Fixed(steps) = length {
            self.check_trips("steps", steps)?;
        }
        let describe = self.describe().to_string();
        let role = format!("the body of {describe}");
        let spec = BodySpec {
            graph: body,
            role: role.clone(),
            inputs: self.body_inputs(body, "body", types)?,
            constants: Vec::new(),
            captured: Vec::new(),
        };
        let lowered = self.imp.lower_body(spec, &describe, |imp| {
            let outputs = imp.body_outputs(&body.output, 0, &role)?;
            imp.graph
                .set_outputs(outputs)
                .map_err(|source| OnnxError::Lowering { node: role, source })
        })?;
        let scan = Scan {
            body: lowered.graph,
            carries: states,
            scanned,
            length,
            reverse,
            checkpoint: 0,
        };
        let mut operands = operands;
        operands.extend(lowered.captures.iter().map(|(_, v)| *v));
        let results = self
            .imp
            .graph
            .push_tuple(Op::Scan(Box::new(scan)), &operands);
        self.ir(results)
    }

    /// Whether the scan runs backwards: every scan input and output must
    /// go one way (ONNX lets each go its own).
    fn scan_direction(&self, scanned: usize, ys: usize) -> Result<bool, OnnxError> {
        let mut directions = Vec::new();
        for (attribute, count) in [
            ("scan_input_directions", scanned),
            ("scan_output_directions", ys),
        ] {
            let Some(values) = self.attrs.ints(attribute)? else {
                directions.extend(std::iter::repeat_n((attribute, 0), count));
                continue;
            };
            if values.len() != count {
                return Err(self.attrs.invalid(format!(
                    "{attribute} has {} entries for {count} scan values",
                    values.len()
                )));
            }
            for &d in values {
                if d != 0 && d != 1 {
                    return Err(self.attrs.invalid(format!(
                        "{attribute} holds {d}; a direction is 0 (forward) or 1 (reverse)"
                    )));
                }
                directions.push((attribute, d));
            }
        }
        let reverse = directions.first().is_some_and(|&(_, d)| d == 1);
        if let Some(&(attribute, _)) = directions.iter().find(|&&(_, d)| (d == 1) != reverse) {
            return Err(self.refuse(
                format!(
                    "{attribute} mixes directions ({:?} and {:?}); canopy's scan runs every input and output one way",
                    self.attrs.ints("scan_input_directions")?.unwrap_or_default(),
                    self.attrs.ints("scan_output_directions")?.unwrap_or_default()
                ),
                "reverse the inputs or outputs that differ (a Slice with step -1) outside the Scan",
            ));
        }
        Ok(reverse)
    }

    /// canopy's scan steps through the leading axis: `attribute` may only
    /// name axis 0 (negative axes count from the end of `values`' ranks;
    /// an output's rank is not known yet, so it must say 0).
    fn scan_axes(&self, attribute: &str, values: &[ValueId]) -> Result<(), OnnxError> {
        let Some(axes) = self.attrs.ints(attribute)? else {
            return Ok(());
        };
        if !values.is_empty() && axes.len() != values.len() {
            return Err(self.attrs.invalid(format!(
                "{attribute} has {} entries for {} scan inputs",
                axes.len(),
                values.len()
            )));
        }
        for (position, &axis) in axes.iter().enumerate() {
            let rank = values.get(position).map(|&v| self.imp.ty(v).rank() as i64);
            let leading = axis == 0 || rank.is_some_and(|r| axis == -r);
            if !leading {
                return Err(self.refuse(
                    format!("{attribute} = {axes:?} scans along axis {axis}; canopy's scan steps through axis 0"),
                    "transpose that axis to the front before the Scan (and back after it)",
                ));
            }
        }
        Ok(())
    }

    fn check_trips(&self, what: &str, trips: usize) -> Result<(), OnnxError> {
        let limit = self.imp.limits.trips();
        if trips > limit {
            return Err(OnnxError::limit(
                format!("the {what} of {}", self.describe()),
                trips,
                limit,
            ));
        }
        Ok(())
    }

    /// ONNX `Loop`, with its constant maximum trip count `M`.
    ///
    /// The body runs only while the condition holds, so its condition
    /// input is the constant true inside it. When the condition can never
    /// turn false (no initial condition or a constant true, and a body
    /// that returns a constant true or its condition input: PyTorch's
    /// `for` loop) the loop runs exactly `M` trips: a `scan` of `M` steps
    /// with no scanned inputs, whose stacked outputs are the Loop's scan
    /// outputs. Otherwise it is a `while_loop` of at most `M` trips that
    /// carries the condition. Either carries the iteration number when the
    /// body reads it.
    fn loop_node(&mut self) -> Result<Vec<ValueId>, OnnxError> {
        self.attrs.allow_only(&["body"])?;
        let body = self.attrs.graph("body")?;
        let count = self.node.input.len();
        if count < 2 {
            return Err(self.attrs.invalid(format!(
                "takes M, cond and the loop-carried values (either of the first two may be empty), the node has {count} inputs"
            )));
        }
        let describe = self.describe().to_string();
        let max_trips = self.max_trips()?;
        let initial = match self.optional_input_name(1) {
            None => None,
            Some(name) => match is_true(self.imp.constant(name, &describe)?) {
                Some(true) => None,
                _ => {
                    let value = self.imp.value(name, &describe)?;
                    Some(
                        self.imp
                            .condition(value, "the condition `cond`", &describe)?,
                    )
                }
            },
        };
        let carried = self.all_inputs(2)?;
        let n = carried.len();
        if body.output.len() < n + 1 {
            return Err(self.attrs.invalid(format!(
                "its body returns {} values; it must return the condition and the {n} loop-carried values first",
                body.output.len()
            )));
        }
        let mut types = vec![i64_scalar(), bool_scalar()];
        types.extend(carried.iter().map(|&v| self.imp.ty(v).clone()));
        let declared = self.body_inputs(body, "body", types)?;
        let [iteration, condition] = [&declared[0].0, &declared[1].0];
        // Declared in the body's order after the carried values, so a
        // for loop's scan needs no rebuild when it keeps the iteration.
        let mut inputs = declared[2..].to_vec();
        inputs.push(declared[0].clone());
        let role = format!("the body of {describe}");
        let spec = BodySpec {
            graph: body,
            role: role.clone(),
            inputs,
            constants: vec![(
                condition.clone(),
                TensorData::new(Vec::new(), Buffer::Bool(vec![true]))
                    .expect("a scalar holds one element"),
            )],
            captured: Vec::new(),
        };
        let lowered = self.imp.lower_body(spec, &describe, |imp| {
            // Read first, so a constant condition makes no node.
            let go = &body.output[0].name;
            let always = is_true(imp.constant(go, &role)?) == Some(true);
            let go = match always {
                true => None,
                false => {
                    let value = imp.value(go, &role)?;
                    Some(imp.condition(value, "the condition the body returns", &role)?)
                }
            };
            let outputs = imp.body_outputs(&body.output[1..], 1, &role)?;
            Ok((go, outputs))
        })?;
        let Body {
            mut graph,
            captures,
            result: (go, outputs),
        } = lowered;
        let (carried_out, stacked) = outputs.split_at(n);
        let iteration_in = graph
            .find_input(iteration)
            .expect("the iteration number is a declared input");
        let values: Vec<ValueId> = outputs.iter().map(|(_, v)| *v).collect();
        let counts = is_read(&graph, iteration_in, &values);
        let mut body_outputs = carried_out.to_vec();
        let mut slots: Vec<Slot> = graph.inputs()[..n].iter().map(|&i| Slot::Keep(i)).collect();
        let taken: Vec<&str> = outputs.iter().map(|(name, _)| name.as_str()).collect();
        if counts {
            let one = TensorData::new(Vec::new(), Buffer::I64(vec![1]))
                .expect("a scalar holds one element");
            let one = self.ir(graph.constant(one))?;
            let next = self.ir(graph.add(iteration_in, one))?;
            body_outputs.push((distinct(&format!("{iteration}/next"), &taken), next));
            slots.push(Slot::Keep(iteration_in));
        }
        let carries = n + usize::from(counts);
        let always = initial.is_none() && go.is_none();
        let mut operands = carried;
        if counts {
            let zero = TensorData::new(Vec::new(), Buffer::I64(vec![0]))
                .expect("a scalar holds one element");
            let zero = self.imp.graph.constant(zero);
            operands.push(self.ir(zero)?);
        }
        let consts: Vec<ValueId> = captures.iter().map(|(_, v)| *v).collect();
        let inputs_after = graph.inputs()[n + 1..].to_vec();
        if always {
            body_outputs.extend_from_slice(stacked);
            self.ir(graph.set_outputs(body_outputs))?;
            slots.extend(inputs_after.into_iter().map(Slot::Keep));
            let body = self.ir(rebuild(&graph, &slots))?;
            let scan = Scan {
                body,
                carries,
                scanned: 0,
                length: Dim::Fixed(max_trips),
                reverse: false,
                checkpoint: 0,
            };
            operands.extend(consts);
            let results = self
                .imp
                .graph
                .push_tuple(Op::Scan(Box::new(scan)), &operands);
            let mut results = self.ir(results)?;
            // The Loop's outputs: the carried values, then the stacked ones
            // (the scan's results after the iteration number).
            results.drain(n..carries);
            return Ok(results);
        }
        if let Some((name, _)) = stacked.first() {
            return Err(self.refuse(
                format!(
                    "its scan output `{name}` would have a row per trip, and its condition decides the trips at run time; canopy's shapes are static"
                ),
                "make the condition constant true (a for loop of M trips), or carry the values instead of stacking them",
            ));
        }
        let true_ = TensorData::new(Vec::new(), Buffer::Bool(vec![true]))
            .expect("a scalar holds one element");
        let go = match go {
            Some(go) => go,
            None => self.ir(graph.constant(true_.clone()))?,
        };
        let go_name = distinct(condition, &taken);
        body_outputs.push((go_name.clone(), go));
        self.ir(graph.set_outputs(body_outputs))?;
        slots.push(Slot::New(go_name.clone(), bool_scalar()));
        slots.extend(inputs_after.into_iter().map(Slot::Keep));
        let body = self.ir(rebuild(&graph, &slots))?;
        let mut cond = Graph::new();
        for &input in body.inputs() {
            let ty = body.ty(input).clone();
            let id = self.ir(cond.input(body.input_name(input).to_string(), ty))?;
            if body.input_name(input) == go_name {
                self.ir(cond.set_output(go_name.clone(), id))?;
            }
        }
        let initial = match initial {
            Some(value) => value,
            None => {
                let go = self.imp.graph.constant(true_);
                self.ir(go)?
            }
        };
        operands.push(initial);
        operands.extend(consts);
        let w = WhileLoop {
            cond,
            body,
            carries: carries + 1,
            max_trips,
        };
        let results = self
            .imp
            .graph
            .push_tuple(Op::WhileLoop(Box::new(w)), &operands);
        let mut results = self.ir(results)?;
        results.truncate(n);
        Ok(results)
    }

    /// The Loop's `M`: required, a known constant (canopy types a loop by
    /// its bound), from 1 to the trip limit.
    fn max_trips(&self) -> Result<usize, OnnxError> {
        let describe = self.describe();
        let Some(name) = self.optional_input_name(0) else {
            return Err(self.refuse(
                "it has no maximum trip count M, so only its condition bounds it; canopy's loops need a bound",
                "export the loop with a trip count (a Python `for` over a range, or a `while` with a known maximum)",
            ));
        };
        let Some(data) = self.imp.constant(name, describe)? else {
            return Err(self.refuse(
                format!(
                    "its maximum trip count M (`{name}`) is computed at run time; canopy's loops need a constant bound"
                ),
                "export the model with static shapes, so that the trip count is a constant (an initializer or a Constant node)",
            ));
        };
        let m = match &data.buffer {
            Buffer::I64(v) if v.len() == 1 => v[0],
            _ => {
                return Err(self.attrs.invalid(format!(
                    "M (`{name}`) is {} {:?}; it must be one int64",
                    data.dtype(),
                    data.shape
                )));
            }
        };
        let Ok(trips) = usize::try_from(m) else {
            return Err(self.refuse(
                format!("its maximum trip count M (`{name}`) is {m}, so it never runs"),
                "remove the loop: its outputs are its initial values",
            ));
        };
        if trips == 0 {
            return Err(self.refuse(
                format!("its maximum trip count M (`{name}`) is 0, so it never runs"),
                "remove the loop: its outputs are its initial values",
            ));
        }
        self.check_trips("maximum trip count M", trips)?;
        Ok(trips)
    }
}

/// `Err(declared type name)` when `info` declares an element type other
/// than `ty`'s; an undeclared one agrees.
fn check_element_type(info: &ValueInfoProto, ty: &TensorType) -> Result<(), String> {
    let Some(type_proto::Value::TensorType(tensor)) =
        info.r#type.as_ref().and_then(|t| t.value.as_ref())
    else {
        return Ok(());
    };
    if tensor.elem_type == crate::proto::data_type::UNDEFINED
        || dtype_of(tensor.elem_type) == Some(ty.dtype)
    {
        return Ok(());
    }
    Err(crate::proto::data_type::name(tensor.elem_type).to_string())
}
