//! Reverse mode through control flow, without unrolling: the VJP of a
//! `scan` is a reverse `scan`, and the VJP of a `cond` is a `cond` of its
//! branches' VJPs. Both are built from the one backward sweep
//! (`backward::backpropagate`) run on the body, so every op's rule is
//! written once.
//!
//! A scan's backward body needs values of its forward step. Those are its
//! *residuals*: the forward values its derivative nodes read. The rule
//! makes the primal scan stack them as extra results (`Graph::extend_tuple`),
//! and the reverse scan reads one step of each; values that depend only on
//! the loop's constants are recomputed in the backward body instead of
//! being stacked once per step.

use std::collections::HashMap;

use crate::autodiff::backward::backpropagate;
use crate::autodiff::util::zeros;
use crate::control::{Cond, Scan, WhileLoop};
use crate::data::TensorData;
use crate::error::{IrError, IrResult};
use crate::graph::{Graph, ValueId};
use crate::op::Op;
use crate::op::{BinaryOp, UnaryOp};
use crate::passes::eliminate_dead_code;
use crate::types::DType;
use crate::types::{Dim, TensorType};

/// The contributions of a `scan` node's operands (carries, xs, consts),
/// given its results' cotangents `cts`; `wanted[k]` says which operands
/// need one.
pub(super) fn scan_vjp(
    g: &mut Graph,
    scan: &Scan,
    x: &[ValueId],
    tuple: ValueId,
    cts: &[Option<ValueId>],
    wanted: &[bool],
) -> IrResult<Vec<Option<ValueId>>> {
    let plan = BodyVjp::new(scan, cts, wanted)?;
    if plan.outputs_len() == 0 {
        return Ok(vec![None; x.len()]);
    }
    let results_before = g.results(tuple).map_err(IrError::Invalid)?.len();
    let forward = plan.forward_body()?;
    let mut primal = scan.clone();
    primal.body = forward;
    g.extend_tuple(tuple, Op::Scan(Box::new(primal)))?;
    let mut stacked = Vec::with_capacity(plan.residuals.len());
    for r in 0..plan.residuals.len() {
        stacked.push(g.push(
            Op::Output {
                index: results_before + r,
            },
            &[tuple],
        )?);
    }
    let (c, s) = (scan.carries, scan.scanned);
    let mut operands = Vec::new();
    for &i in &plan.f32_carries {
        operands.push(seed(g, cts[i], x[i])?);
    }
    for &k in &plan.wanted_consts {
        let ty = g.ty(x[c + s + k]).clone();
        operands.push(zeros(g, &ty)?);
    }
    operands.extend(&stacked);
    operands.extend(&x[c..c + s]);
    operands.extend(plan.seeded_ys.iter().map(|&k| cts[c + k].expect("seeded")));
    operands.extend(&x[c + s..]);
    let reverse = Scan {
        body: plan.backward_body()?,
        carries: plan.f32_carries.len() + plan.wanted_consts.len(),
        scanned: stacked.len() + s + plan.seeded_ys.len(),
        length: scan.length,
        reverse: !scan.reverse,
        checkpoint: 0,
    };
    let results = g.push_tuple(Op::Scan(Box::new(reverse)), &operands)?;
    let mut contributions = vec![None; x.len()];
    let mut next = results.into_iter();
    for &i in &plan.f32_carries {
        contributions[i] = next.next();
    }
    for &k in &plan.wanted_consts {
        contributions[c + s + k] = next.next();
    }
    for &j in &plan.wanted_xs {
        contributions[c + j] = next.next();
    }
    Ok(contributions)
}

/// The contributions of a `cond` node's operands (the predicate, then the
/// branches' operands): a `cond` on the same predicate whose branches are
/// the VJPs of the primal branches. Each recomputes its branch's forward
/// values, so nothing is saved across the two sweeps.
pub(super) fn cond_vjp(
    g: &mut Graph,
    cond: &Cond,
    x: &[ValueId],
    cts: &[Option<ValueId>],
    wanted: &[bool],
) -> IrResult<Vec<Option<ValueId>>> {
    let wanted_operands: Vec<usize> = (1..x.len()).filter(|&k| wanted[k]).collect();
    let seeded: Vec<usize> = (0..cts.len()).filter(|&r| cts[r].is_some()).collect();
    if wanted_operands.is_empty() || seeded.is_empty() {
        return Ok(vec![None; x.len()]);
    }
    let wrt: Vec<usize> = wanted_operands.iter().map(|k| k - 1).collect();
    let adjoint = Cond {
        then_branch: branch_vjp(&cond.then_branch, &seeded, &wrt)?,
        else_branch: branch_vjp(&cond.else_branch, &seeded, &wrt)?,
    };
    let mut operands = x.to_vec();
    operands.extend(seeded.iter().map(|&r| cts[r].expect("seeded")));
    let grads = g.push_tuple(Op::Cond(Box::new(adjoint)), &operands)?;
    let mut contributions = vec![None; x.len()];
    for (&k, grad) in wanted_operands.iter().zip(grads) {
        contributions[k] = Some(grad);
    }
    Ok(contributions)
}

/// A branch's VJP as a graph: (operands…, cotangents of the `seeded`
/// results…) → the gradient of each operand in `wrt`.
fn branch_vjp(branch: &Graph, seeded: &[usize], wrt: &[usize]) -> IrResult<Graph> {
    let mut vjp = branch.clone();
    let n = branch.len();
    let mut seeds = Vec::with_capacity(seeded.len());
    for &r in seeded {
        let out = branch.outputs()[r].1;
        let name = fresh_input_name(&vjp, format!("cotangent/{r}"));
        let ct = vjp.input(name, branch.ty(out).clone())?;
        seeds.push((out, ct));
    }
    let wrt_ids: Vec<ValueId> = wrt.iter().map(|&k| branch.inputs()[k]).collect();
    let grads = backpropagate(&mut vjp, n, &seeds, &wrt_ids)?;
    let outputs = wrt
        .iter()
        .zip(grads)
        .map(|(k, grad)| (format!("grad/{k}"), grad))
        .collect();
    vjp.set_outputs(outputs)?;
    eliminate_dead_code(&vjp)
}

/// `name`, primed until no input of `graph` has it: a body differentiated
/// twice already has the first pass's cotangent inputs.
fn fresh_input_name(graph: &Graph, mut name: String) -> String {
    while graph.find_input(&name).is_some() {
        name.push('\'');
    }
    name
}

/// `name`, primed until no output in `outputs` has it: a body
/// differentiated twice already saves the first pass's residuals.
fn fresh_output_name(outputs: &[(String, ValueId)], mut name: String) -> String {
    while outputs.iter().any(|(taken, _)| *taken == name) {
        name.push('\'');
    }
    name
}

/// A result's cotangent, or zeros where none reached it.
fn seed(g: &mut Graph, ct: Option<ValueId>, like: ValueId) -> IrResult<ValueId> {
    match ct {
        Some(ct) => Ok(ct),
        None => {
            let ty = g.ty(like).clone();
            zeros(g, &ty)
        }
    }
}

/// Where a value of the differentiated body comes from.
#[derive(Clone, Copy, PartialEq)]
enum Role {
    Carry(usize),
    Step(usize),
    Const(usize),
    /// A cotangent input of the body's VJP: of carry `i`'s result, or of
    /// `ys[k]`.
    CarryCotangent(usize),
    YCotangent(usize),
    /// A forward value that depends only on constants: recomputed.
    Invariant,
    /// A forward value that changes from step to step.
    Varying,
    /// A node of the backward sweep.
    Backward,
}

/// One scan body differentiated: the body with its backward sweep appended
/// (`vjp`), each node's role, and the forward values the backward nodes
/// read (`residuals`, in node order).
struct BodyVjp<'a> {
    scan: &'a Scan,
    vjp: Graph,
    roles: Vec<Role>,
    residuals: Vec<ValueId>,
    /// Carries that are f32: each has a cotangent carried backwards.
    f32_carries: Vec<usize>,
    wanted_xs: Vec<usize>,
    wanted_consts: Vec<usize>,
    /// The `ys` whose stacked result has a cotangent.
    seeded_ys: Vec<usize>,
    /// The body's gradients: one per f32 carry, then per wanted x, then
    /// per wanted const.
    grads: Vec<ValueId>,
}

impl<'a> BodyVjp<'a> {
    fn new(scan: &'a Scan, cts: &[Option<ValueId>], wanted: &[bool]) -> IrResult<BodyVjp<'a>> {
        let body = &scan.body;
        let (c, s, n) = (scan.carries, scan.scanned, body.len());
        let is_f32 = |k: usize| body.ty(body.inputs()[k]).dtype == DType::F32;
        let f32_carries: Vec<usize> = (0..c).filter(|&i| is_f32(i)).collect();
        let wanted_xs: Vec<usize> = (0..s).filter(|&j| wanted[c + j] && is_f32(c + j)).collect();
        let wanted_consts: Vec<usize> = (0..scan.consts())
            .filter(|&k| wanted[c + s + k] && is_f32(c + s + k))
            .collect();
        let out_f32 = |r: usize| body.ty(body.outputs()[r].1).dtype == DType::F32;
        let seeded_ys: Vec<usize> = (0..scan.ys())
            .filter(|&k| cts[c + k].is_some() && out_f32(c + k))
            .collect();

        let mut vjp = body.clone();
        let mut seeds = Vec::new();
        let mut roles = vec![Role::Varying; n];
        for &i in &f32_carries {
            let out = body.outputs()[i].1;
            let name = fresh_input_name(&vjp, format!("cotangent/carry/{i}"));
            seeds.push((out, vjp.input(name, body.ty(out).clone())?));
        }
        for &k in &seeded_ys {
            let out = body.outputs()[c + k].1;
            let name = fresh_input_name(&vjp, format!("cotangent/y/{k}"));
            seeds.push((out, vjp.input(name, body.ty(out).clone())?));
        }
        let input = |k: usize| body.inputs()[k];
        let mut wrt: Vec<ValueId> = f32_carries.iter().map(|&i| input(i)).collect();
        wrt.extend(wanted_xs.iter().map(|&j| input(c + j)));
        wrt.extend(wanted_consts.iter().map(|&k| input(c + s + k)));
        let grads = backpropagate(&mut vjp, n, &seeds, &wrt)?;

        for (k, &id) in body.inputs().iter().enumerate() {
            roles[id.index()] = match k {
                _ if k < c => Role::Carry(k),
                _ if k < c + s => Role::Step(k - c),
                _ => Role::Const(k - c - s),
            };
        }
        roles.extend((n..vjp.len()).map(|_| Role::Backward));
        let cotangent_inputs = &vjp.inputs()[body.inputs().len()..];
        for (&id, &i) in cotangent_inputs.iter().zip(&f32_carries) {
            roles[id.index()] = Role::CarryCotangent(i);
        }
        for (&id, &k) in cotangent_inputs[f32_carries.len()..].iter().zip(&seeded_ys) {
            roles[id.index()] = Role::YCotangent(k);
        }
        classify_forward(&vjp, &mut roles);
        let recompute = scan.checkpoint == 1;
        let residuals = residuals(&vjp, &roles, &grads, recompute);
        Ok(BodyVjp {
            scan,
            vjp,
            roles,
            residuals,
            f32_carries,
            wanted_xs,
            wanted_consts,
            seeded_ys,
            grads,
        })
    }

    /// Results of the reverse scan.
    fn outputs_len(&self) -> usize {
        self.f32_carries.len() + self.wanted_consts.len() + self.wanted_xs.len()
    }

    /// The primal body, now also returning each residual of its step
    /// (after its own results, so the primal results keep their indices).
    fn forward_body(&self) -> IrResult<Graph> {
        if self.scan.checkpoint == 1 {
            // Recomputing: the body as it was (nested loops not saving
            // their residuals either), plus the carries it saves.
            let mut body = self.scan.body.clone();
            let mut outputs = body.outputs().to_vec();
            for (r, &id) in self.residuals.iter().enumerate() {
                outputs.push((fresh_output_name(&outputs, format!("residual/{r}")), id));
            }
            body.set_outputs(outputs)?;
            return Ok(body);
        }
        let mut body = Graph::new();
        let mut map: Vec<Option<ValueId>> = vec![None; self.vjp.len()];
        for (index, node) in self.vjp.nodes().iter().enumerate() {
            let value = match self.roles[index] {
                Role::Carry(_) | Role::Step(_) | Role::Const(_) => {
                    let Op::Input { name } = &node.op else {
                        unreachable!("body inputs are input nodes")
                    };
                    body.input(name.clone(), node.ty.clone())?
                }
                Role::Invariant | Role::Varying => {
                    let inputs = remap(&map, &node.inputs)?;
                    body.push(node.op.clone(), &inputs)?
                }
                _ => continue,
            };
            map[index] = Some(value);
        }
        let mut outputs: Vec<(String, ValueId)> = self
            .scan
            .body
            .outputs()
            .iter()
            .map(|(name, v)| Ok((name.clone(), remap(&map, &[*v])?[0])))
            .collect::<IrResult<_>>()?;
        for (r, &id) in self.residuals.iter().enumerate() {
            let name = fresh_output_name(&outputs, format!("residual/{r}"));
            outputs.push((name, remap(&map, &[id])?[0]));
        }
        body.set_outputs(outputs)?;
        Ok(body)
    }

    /// The reverse scan's body: (cotangents of the f32 carries…, gradient
    /// sums of the wanted consts…, one step of each residual…, of each x…,
    /// of each seeded y's cotangent…, the consts…) → (the carries'
    /// cotangents one step earlier…, the sums with this step's…, the wanted
    /// xs' gradients…).
    fn backward_body(&self) -> IrResult<Graph> {
        let (c, s) = (self.scan.carries, self.scan.scanned);
        let vjp = &self.vjp;
        let body = &self.scan.body;
        let mut h = Graph::new();
        let mut map: Vec<Option<ValueId>> = vec![None; vjp.len()];
        let ty = |id: ValueId| vjp.ty(id).clone();
        let role_input = |role: Role| -> ValueId {
            let position = self.roles.iter().position(|&r| r == role).expect("role");
            ValueId(position as u32)
        };
        for &i in &self.f32_carries {
            let id = role_input(Role::CarryCotangent(i));
            map[id.index()] = Some(h.input(format!("cotangent/carry/{i}"), ty(id))?);
        }
        let mut sums = Vec::new();
        for &k in &self.wanted_consts {
            sums.push(h.input(format!("sum/{k}"), ty(body.inputs()[c + s + k]))?);
        }
        for (r, &id) in self.residuals.iter().enumerate() {
            map[id.index()] = Some(h.input(format!("residual/{r}"), ty(id))?);
        }
        for j in 0..s {
            let id = body.inputs()[c + j];
            map[id.index()] = Some(h.input(format!("step/{j}"), ty(id))?);
        }
        for &k in &self.seeded_ys {
            let id = role_input(Role::YCotangent(k));
            map[id.index()] = Some(h.input(format!("cotangent/y/{k}"), ty(id))?);
        }
        for k in 0..self.scan.consts() {
            let id = body.inputs()[c + s + k];
            map[id.index()] = Some(h.input(format!("const/{k}"), ty(id))?);
        }
        for (index, node) in vjp.nodes().iter().enumerate() {
            let copy = match self.roles[index] {
                Role::Invariant => !matches!(node.op, Op::Input { .. }),
                // Recomputing: the step's forward values from its carries.
                Role::Varying => self.scan.checkpoint == 1,
                Role::Backward => map[index].is_none(),
                _ => false,
            };
            if copy && map[index].is_none() {
                let inputs = remap(&map, &node.inputs)?;
                map[index] = Some(h.push(node.op.clone(), &inputs)?);
            }
        }
        let grad = |k: usize| remap(&map, &[self.grads[k]]).map(|v| v[0]);
        let mut outputs = Vec::new();
        for (k, &i) in self.f32_carries.iter().enumerate() {
            outputs.push((format!("cotangent/carry/{i}"), grad(k)?));
        }
        let after_xs = self.f32_carries.len() + self.wanted_xs.len();
        for (k, (&const_k, sum)) in self.wanted_consts.iter().zip(sums).enumerate() {
            let total = h.add(sum, grad(after_xs + k)?)?;
            outputs.push((format!("sum/{const_k}"), total));
        }
        for (k, &j) in self.wanted_xs.iter().enumerate() {
            outputs.push((format!("grad/step/{j}"), grad(self.f32_carries.len() + k)?));
        }
        h.set_outputs(outputs)?;
        eliminate_dead_code(&h)
    }
}

fn remap(map: &[Option<ValueId>], ids: &[ValueId]) -> IrResult<Vec<ValueId>> {
    ids.iter()
        .map(|id| {
            map[id.index()].ok_or_else(|| {
                IrError::Invalid(format!(
                    "scan autodiff: {id} is read where the loop does not have it"
                ))
            })
        })
        .collect()
}

/// Marks the forward values among the body's nodes: invariant when every
/// operand is a constant or invariant, else varying. An `output` that the
/// sweep appended to read a nested loop's new results is forward too.
fn classify_forward(vjp: &Graph, roles: &mut [Role]) {
    for (index, node) in vjp.nodes().iter().enumerate() {
        let forward = match roles[index] {
            Role::Varying | Role::Invariant => true,
            Role::Backward => {
                matches!(node.op, Op::Output { .. })
                    && matches!(
                        roles[node.inputs[0].index()],
                        Role::Varying | Role::Invariant
                    )
            }
            _ => continue,
        };
        if !forward || matches!(node.op, Op::Input { .. }) {
            continue;
        }
        let invariant = node
            .inputs
            .iter()
            .all(|i| matches!(roles[i.index()], Role::Const(_) | Role::Invariant));
        roles[index] = if invariant {
            Role::Invariant
        } else {
            Role::Varying
        };
    }
}

/// The varying forward values (and carries) that backward nodes or the
/// gradients read: each is stacked by the primal scan.
fn residuals(vjp: &Graph, roles: &[Role], grads: &[ValueId], recompute: bool) -> Vec<ValueId> {
    let mut read = vec![false; vjp.len()];
    if recompute {
        // Only carries are saved; whatever reads them is recomputed.
        for node in vjp.nodes() {
            for input in &node.inputs {
                read[input.index()] = true;
            }
        }
        for grad in grads {
            read[grad.index()] = true;
        }
        return (0..vjp.len())
            .filter(|&i| read[i] && matches!(roles[i], Role::Carry(_)))
            .map(|i| ValueId(i as u32))
            .collect();
    }
    for (index, node) in vjp.nodes().iter().enumerate() {
        if roles[index] == Role::Backward {
            for input in &node.inputs {
                read[input.index()] = true;
            }
        }
    }
    for grad in grads {
        read[grad.index()] = true;
    }
    (0..vjp.len())
        .filter(|&i| read[i] && matches!(roles[i], Role::Varying | Role::Carry(_)))
        .filter(|&i| !vjp.nodes()[i].op.is_tuple())
        .map(|i| ValueId(i as u32))
        .collect()
}

/// The tangent of a control-flow node: a node of the same kind that
/// carries tangents beside the primal values, and for each primal result
/// the index of its tangent among that node's results (`None` for results
/// that are not f32). `t[k]` is the tangent of operand `k`, if any.
pub(super) fn tuple_jvp(
    g: &mut Graph,
    op: &Op,
    x: &[ValueId],
    t: &[Option<ValueId>],
) -> IrResult<(ValueId, Vec<Option<usize>>)> {
    match op {
        Op::Scan(scan) => scan_jvp(g, scan, x, t),
        Op::Cond(cond) => cond_jvp(g, cond, x, t),
        Op::WhileLoop(w) => while_jvp(g, w, x, t),
        _ => Err(IrError::Invalid(format!(
            "forward mode through `{}` is not built yet",
            op.name()
        ))),
    }
}

/// `scan` in forward mode: a scan whose body is the body's JVP, each
/// carry paired with its tangent, each step input with its tangent.
fn scan_jvp(
    g: &mut Graph,
    scan: &Scan,
    x: &[ValueId],
    t: &[Option<ValueId>],
) -> IrResult<(ValueId, Vec<Option<usize>>)> {
    let body = &scan.body;
    let (c, s) = (scan.carries, scan.scanned);
    let is_f32 = |k: usize| body.ty(body.inputs()[k]).dtype == DType::F32;
    // Carries always carry a tangent: one step's may be zero, the next's not.
    let f32_carries: Vec<usize> = (0..c).filter(|&i| is_f32(i)).collect();
    let moving = |k: usize| t[k].is_some() && is_f32(k);
    let xs: Vec<usize> = (c..c + s).filter(|&k| moving(k)).collect();
    let consts: Vec<usize> = (c + s..x.len()).filter(|&k| moving(k)).collect();
    let groups = [
        (0..c).collect::<Vec<_>>(),
        f32_carries.clone(),
        (c..c + s).collect(),
        xs.clone(),
        (c + s..x.len()).collect(),
        consts.clone(),
    ];
    let (jvp_body, f32_outputs) = reordered_jvp(body, &groups, c)?;
    let mut operands = x[..c].to_vec();
    for &i in &f32_carries {
        operands.push(seed(g, t[i], x[i])?);
    }
    operands.extend(&x[c..c + s]);
    operands.extend(xs.iter().map(|&k| t[k].expect("moving")));
    operands.extend(&x[c + s..]);
    operands.extend(consts.iter().map(|&k| t[k].expect("moving")));
    let tangent_scan = Scan {
        body: jvp_body,
        carries: c + f32_carries.len(),
        scanned: s + xs.len(),
        length: scan.length,
        reverse: scan.reverse,
        checkpoint: scan.checkpoint,
    };
    let tuple = g.push(Op::Scan(Box::new(tangent_scan)), &operands)?;
    // Results: carries, their tangents, ys, their tangents.
    let ys = scan.ys();
    let nf_carries = f32_carries.len();
    let mut map = vec![None; c + ys];
    for (p, &i) in f32_carries.iter().enumerate() {
        map[i] = Some(c + p);
    }
    let mut p = 0;
    for (k, slot) in map[c..].iter_mut().enumerate() {
        if f32_outputs.contains(&(c + k)) {
            *slot = Some(c + nf_carries + ys + p);
            p += 1;
        }
    }
    Ok((tuple, map))
}

/// `cond` in forward mode: a `cond` of the branches' JVPs.
fn cond_jvp(
    g: &mut Graph,
    cond: &Cond,
    x: &[ValueId],
    t: &[Option<ValueId>],
) -> IrResult<(ValueId, Vec<Option<usize>>)> {
    let n = x.len() - 1;
    let branch = &cond.then_branch;
    let moving: Vec<usize> = (0..n)
        .filter(|&k| t[k + 1].is_some() && branch.ty(branch.inputs()[k]).dtype == DType::F32)
        .collect();
    let groups = [(0..n).collect::<Vec<_>>(), moving.clone()];
    let results = branch.outputs().len();
    let (then_branch, f32_outputs) = reordered_jvp(&cond.then_branch, &groups, results)?;
    let (else_branch, _) = reordered_jvp(&cond.else_branch, &groups, results)?;
    let mut operands = x.to_vec();
    operands.extend(moving.iter().map(|&k| t[k + 1].expect("moving")));
    let tuple = g.push(
        Op::Cond(Box::new(Cond {
            then_branch,
            else_branch,
        })),
        &operands,
    )?;
    let mut map = vec![None; results];
    for (p, &r) in f32_outputs.iter().enumerate() {
        map[r] = Some(results + p);
    }
    Ok((tuple, map))
}

/// The JVP of `graph` with its inputs declared in the order `groups` gives:
/// input positions, alternately primal (every group at an even place) and
/// tangent (odd places, tangents of the positions listed). Its outputs are
/// ordered primal `0..split`, their tangents, primal `split..`, their
/// tangents, so a scan's carries stay first. Returns it and the positions
/// of the f32 outputs (those with tangents).
fn reordered_jvp(
    graph: &Graph,
    groups: &[Vec<usize>],
    split: usize,
) -> IrResult<(Graph, Vec<usize>)> {
    let name = |k: usize| graph.input_name(graph.inputs()[k]).to_string();
    let wrt: Vec<String> = groups
        .iter()
        .skip(1)
        .step_by(2)
        .flatten()
        .map(|&k| name(k))
        .collect();
    let wrt_refs: Vec<&str> = wrt.iter().map(String::as_str).collect();
    let jvp = crate::autodiff::jvp(graph, &wrt_refs)?;
    let primal_count = graph.inputs().len();
    let mut h = Graph::new();
    let mut args: Vec<Option<ValueId>> = vec![None; jvp.inputs().len()];
    let mut tangent_position = primal_count;
    for (g_index, group) in groups.iter().enumerate() {
        let tangent = g_index % 2 == 1;
        for &k in group {
            let (slot, label) = if tangent {
                tangent_position += 1;
                (tangent_position - 1, format!("tangent/{}", name(k)))
            } else {
                (k, name(k))
            };
            let ty = jvp.ty(jvp.inputs()[slot]).clone();
            args[slot] = Some(h.input(label, ty)?);
        }
    }
    let args: Vec<ValueId> = args
        .into_iter()
        .map(|a| a.expect("every input declared"))
        .collect();
    let outs = h.inline(&jvp, &args)?;
    let primal_outputs = graph.outputs().len();
    let f32_outputs: Vec<usize> = (0..primal_outputs)
        .filter(|&r| graph.ty(graph.outputs()[r].1).dtype == DType::F32)
        .collect();
    let names: Vec<String> = jvp.outputs().iter().map(|(n, _)| n.clone()).collect();
    let mut order: Vec<usize> = (0..split).collect();
    let tangent_of =
        |r: usize| primal_outputs + f32_outputs.iter().position(|&o| o == r).expect("f32");
    order.extend(
        f32_outputs
            .iter()
            .filter(|&&r| r < split)
            .map(|&r| tangent_of(r)),
    );
    order.extend(split..primal_outputs);
    order.extend(
        f32_outputs
            .iter()
            .filter(|&&r| r >= split)
            .map(|&r| tangent_of(r)),
    );
    h.set_outputs(order.iter().map(|&o| (names[o].clone(), outs[o])).collect())?;
    Ok((h, f32_outputs))
}

/// `while_loop` in forward mode: the same loop carrying each f32 carry's
/// tangent beside it; the condition reads only the primal carries.
fn while_jvp(
    g: &mut Graph,
    w: &WhileLoop,
    x: &[ValueId],
    t: &[Option<ValueId>],
) -> IrResult<(ValueId, Vec<Option<usize>>)> {
    let body = &w.body;
    let c = w.carries;
    let is_f32 = |k: usize| body.ty(body.inputs()[k]).dtype == DType::F32;
    let f32_carries: Vec<usize> = (0..c).filter(|&i| is_f32(i)).collect();
    let consts: Vec<usize> = (c..x.len())
        .filter(|&k| t[k].is_some() && is_f32(k))
        .collect();
    let groups = [
        (0..c).collect::<Vec<_>>(),
        f32_carries.clone(),
        (c..x.len()).collect(),
        consts.clone(),
    ];
    let (jvp_body, _) = reordered_jvp(body, &groups, c)?;
    // The condition takes the JVP body's inputs and reads the primal ones.
    let mut cond = Graph::new();
    let mut primal = Vec::new();
    for (position, &input) in jvp_body.inputs().iter().enumerate() {
        let name = jvp_body.input_name(input).to_string();
        let id = cond.input(name, jvp_body.ty(input).clone())?;
        let tangent = (c..c + f32_carries.len()).contains(&position)
            || position >= c + f32_carries.len() + (x.len() - c);
        if !tangent {
            primal.push(id);
        }
    }
    let go = cond.inline(&w.cond, &primal)?;
    cond.set_outputs(vec![("go".into(), go[0])])?;
    let mut operands = x[..c].to_vec();
    for &i in &f32_carries {
        operands.push(seed(g, t[i], x[i])?);
    }
    operands.extend(&x[c..]);
    operands.extend(consts.iter().map(|&k| t[k].expect("moving")));
    let tangent_loop = WhileLoop {
        cond,
        body: jvp_body,
        carries: c + f32_carries.len(),
        max_trips: w.max_trips,
    };
    let tuple = g.push(Op::WhileLoop(Box::new(tangent_loop)), &operands)?;
    let mut map = vec![None; c + 1];
    for (p, &i) in f32_carries.iter().enumerate() {
        map[i] = Some(c + p);
    }
    Ok((tuple, map))
}

/// A bounded `while_loop` as the `scan` reverse mode differentiates: one
/// step per allowed trip, each running the body under a `cond` that is
/// true while the loop would still run. The scan carries the loop's
/// carries, then its trip count and a `done` flag, so its results start
/// with the loop's. Reverse mode saves a residual per allowed trip (zeros
/// after the last real one), which is what makes the loop differentiable
/// backwards: JAX's `while_loop` is not.
pub(crate) fn while_as_scan(w: &WhileLoop) -> IrResult<Scan> {
    let c = w.carries;
    let names: Vec<String> = w
        .body
        .inputs()
        .iter()
        .map(|&i| w.body.input_name(i).to_string())
        .collect();
    let types: Vec<TensorType> = w
        .body
        .inputs()
        .iter()
        .map(|&i| w.body.ty(i).clone())
        .collect();
    let mut body = Graph::new();
    let mut carries = Vec::new();
    for k in 0..c {
        carries.push(body.input(names[k].clone(), types[k].clone())?);
    }
    let trips_name = fresh_among(&names, "trips");
    let done_name = fresh_among(&names, "done");
    let trips = body.input(trips_name.clone(), TensorType::scalar(DType::I64))?;
    let done = body.input(done_name.clone(), TensorType::scalar(DType::Bool))?;
    let mut operands = carries.clone();
    for k in c..names.len() {
        operands.push(body.input(names[k].clone(), types[k].clone())?);
    }
    let wants = body.inline(&w.cond, &operands)?[0];
    let running = body.unary(UnaryOp::Not, done)?;
    let go = body.binary(BinaryOp::And, running, wants)?;
    let mut identity = Graph::new();
    let mut kept = Vec::new();
    for k in 0..names.len() {
        let id = identity.input(names[k].clone(), types[k].clone())?;
        if k < c {
            kept.push((w.body.outputs()[k].0.clone(), id));
        }
    }
    identity.set_outputs(kept)?;
    let step = Cond {
        then_branch: w.body.clone(),
        else_branch: identity,
    };
    let mut guarded = vec![go];
    guarded.extend(&operands);
    let next = body.push_tuple(Op::Cond(Box::new(step)), &guarded)?;
    let counted = body.cast(go, DType::I64)?;
    let trips_next = body.add(trips, counted)?;
    let stopped = body.unary(UnaryOp::Not, go)?;
    let mut outputs: Vec<(String, ValueId)> = w
        .body
        .outputs()
        .iter()
        .zip(next)
        .map(|((name, _), v)| (name.clone(), v))
        .collect();
    outputs.push((trips_name, trips_next));
    outputs.push((done_name, stopped));
    body.set_outputs(outputs)?;
    Ok(Scan {
        body,
        carries: c + 2,
        scanned: 0,
        length: Dim::Fixed(w.max_trips),
        reverse: false,
        checkpoint: 0,
    })
}

fn fresh_among(names: &[String], base: &str) -> String {
    let mut name = base.to_string();
    while names.contains(&name) {
        name.push('\'');
    }
    name
}

/// `graph` with every `while_loop` (in it and in the graphs nested in
/// it) replaced by [`while_as_scan`], for reverse mode; the rest is
/// copied as it is, so every output keeps its name and value.
pub(crate) fn lower_for_reverse(graph: &Graph) -> IrResult<Graph> {
    if !needs_lowering(graph) {
        return Ok(graph.clone());
    }
    let mut out = Graph::new();
    let mut map: Vec<ValueId> = Vec::with_capacity(graph.len());
    // The results standing for each checkpointed scan's.
    let mut segmented: HashMap<usize, Vec<ValueId>> = HashMap::new();
    for (index, node) in graph.nodes().iter().enumerate() {
        let inputs: Vec<ValueId> = node.inputs.iter().map(|i| map[i.index()]).collect();
        let id = match &node.op {
            Op::Output { index: result } if segmented.contains_key(&node.inputs[0].index()) => {
                segmented[&node.inputs[0].index()][*result]
            }
            Op::Scan(scan) if scan.checkpoint > 1 => {
                let mut scan = (**scan).clone();
                scan.body = lower_for_reverse(&scan.body)?;
                let results = segments(&mut out, &scan, &inputs)?;
                let first = results[0];
                segmented.insert(index, results);
                first
            }
            Op::Input { name } => out.input(name.clone(), node.ty.clone())?,
            Op::WhileLoop(w) => {
                let mut w = (**w).clone();
                w.cond = lower_for_reverse(&w.cond)?;
                w.body = lower_for_reverse(&w.body)?;
                let scan = while_as_scan(&w)?;
                let c = w.carries;
                let mut operands = inputs[..c].to_vec();
                operands.push(out.constant(TensorData::scalar_i64(0))?);
                operands.push(out.constant(TensorData::zeros(DType::Bool, vec![]))?);
                operands.extend(&inputs[c..]);
                out.push(Op::Scan(Box::new(scan)), &operands)?
            }
            op => out.push(op.map_control_bodies(lower_for_reverse)?, &inputs)?,
        };
        map.push(id);
    }
    let outputs = graph
        .outputs()
        .iter()
        .map(|(name, v)| (name.clone(), map[v.index()]))
        .collect();
    out.set_outputs(outputs)?;
    Ok(out)
}

/// Whether `graph` (or a graph nested in it) has a `while_loop` or a
/// scan checkpointed in segments.
fn needs_lowering(graph: &Graph) -> bool {
    graph.nodes().iter().any(|node| {
        let lowered = match &node.op {
            Op::WhileLoop(_) => true,
            Op::Scan(scan) => scan.checkpoint > 1,
            _ => false,
        };
        lowered || node.op.subgraphs().into_iter().any(needs_lowering)
    })
}

/// A scan checkpointed every k steps as two: an outer scan over its T/k
/// segments that saves only the carry entering each (checkpoint 1), whose
/// body is an inner scan over one segment's k steps that saves its
/// residuals (checkpoint 0) when the backward pass recomputes it. The
/// `xs` and stacked `ys` are reshaped between [T, …] and [T/k, k, …].
/// Returns the values standing for the scan's results.
fn segments(g: &mut Graph, scan: &Scan, operands: &[ValueId]) -> IrResult<Vec<ValueId>> {
    let Dim::Fixed(length) = scan.length else {
        return Err(IrError::Invalid(
            "checkpointing needs a fixed length".into(),
        ));
    };
    let (c, s, k) = (scan.carries, scan.scanned, scan.checkpoint);
    let count = length / k;
    let inner = Scan {
        body: scan.body.clone(),
        length: Dim::Fixed(k),
        checkpoint: 0,
        ..scan.clone()
    };
    let body_inputs = scan.body.inputs();
    let mut outer_body = Graph::new();
    let mut args = Vec::with_capacity(body_inputs.len());
    for (position, &input) in body_inputs.iter().enumerate() {
        let mut ty = scan.body.ty(input).clone();
        if (c..c + s).contains(&position) {
            ty.shape.0.insert(0, Dim::Fixed(k));
        }
        args.push(outer_body.input(scan.body.input_name(input).to_string(), ty)?);
    }
    let results = outer_body.push_tuple(Op::Scan(Box::new(inner)), &args)?;
    let names = scan.body.outputs().iter().map(|(name, _)| name.clone());
    outer_body.set_outputs(names.zip(results).collect())?;
    let outer = Scan {
        body: outer_body,
        length: Dim::Fixed(count),
        checkpoint: 1,
        ..scan.clone()
    };
    let mut outer_operands = operands[..c].to_vec();
    for &xs in &operands[c..c + s] {
        let mut dims = g.ty(xs).shape.0.clone();
        dims.splice(0..1, [Dim::Fixed(count), Dim::Fixed(k)]);
        outer_operands.push(g.reshape(xs, dims)?);
    }
    outer_operands.extend(&operands[c + s..]);
    let mut results = g.push_tuple(Op::Scan(Box::new(outer)), &outer_operands)?;
    for stacked in &mut results[c..] {
        let mut dims = g.ty(*stacked).shape.0.clone();
        dims.splice(0..2, [Dim::Fixed(length)]);
        *stacked = g.reshape(*stacked, dims)?;
    }
    Ok(results)
}
