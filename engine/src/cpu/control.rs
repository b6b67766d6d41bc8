//! Control flow on the CPU: each body or branch is a compiled
//! [`CpuExecutable`] run once per step. Carries move from step to step by
//! ownership, so an update in place stays in place; a loop's constants
//! (the weights of a recurrent layer) are borrowed at every step, never
//! copied.

use canopy_ir::{Cond, Op, Scan, TensorType, WhileLoop};

use super::CpuExecutable;
use super::kernels::Arg;
use crate::error::{EngineError, EngineResult};
use crate::value::Value;

/// One control-flow node about to run.
pub(super) struct Run<'n> {
    pub node: usize,
    pub op: &'n Op,
    pub bodies: &'n [CpuExecutable],
    pub results: &'n [TensorType],
    pub batch: usize,
}

impl Run<'_> {
    pub fn eval(&self, args: Vec<Arg<'_>>) -> EngineResult<Vec<Value>> {
        match self.op {
            Op::Scan(scan) => self.scan(scan, args),
            Op::Cond(cond) => self.cond(cond, args),
            Op::WhileLoop(w) => self.while_loop(w, args),
            op => Err(EngineError::Internal(format!(
                "`{}` is not a control-flow op",
                op.name()
            ))),
        }
    }

    fn nested(&self, step: usize) -> impl FnOnce(EngineError) -> EngineError + '_ {
        move |source| EngineError::Nested {
            node: self.node,
            op: self.op.name(),
            step,
            source: Box::new(source),
        }
    }

    fn scan(&self, scan: &Scan, args: Vec<Arg<'_>>) -> EngineResult<Vec<Value>> {
        let body = &self.bodies[0];
        let (c, s) = (scan.carries, scan.scanned);
        let length = scan.length.resolve(self.batch);
        let mut args = args.into_iter();
        let mut carries: Vec<Value> = args.by_ref().take(c).map(Arg::into_value).collect();
        let xs: Vec<Arg<'_>> = args.by_ref().take(s).collect();
        let consts: Vec<Arg<'_>> = args.collect();
        for (j, x) in xs.iter().enumerate() {
            if x.value().shape().first() != Some(&length) {
                return Err(EngineError::Shape(format!(
                    "scan node %{}: scanned input {j} has shape {:?}, not {length} steps",
                    self.node,
                    x.value().shape()
                )));
            }
        }
        let mut stacked: Vec<Value> = self.results[c..]
            .iter()
            .map(|ty| Value::zeros(ty.dtype, &ty.shape.resolve(self.batch)))
            .collect();
        for k in 0..length {
            let t = if scan.reverse { length - 1 - k } else { k };
            let mut inputs: Vec<Arg<'_>> = carries.drain(..).map(Arg::Owned).collect();
            inputs.extend(xs.iter().map(|x| Arg::Owned(x.value().step(t))));
            inputs.extend(consts.iter().map(|v| Arg::Shared(v.value())));
            let mut outputs = body.execute(inputs, self.batch).map_err(self.nested(t))?;
            let ys = outputs.split_off(c);
            carries = outputs;
            for (stack, y) in stacked.iter_mut().zip(&ys) {
                stack.set_step(t, y).map_err(self.nested(t))?;
            }
        }
        carries.extend(stacked);
        Ok(carries)
    }

    fn cond(&self, _cond: &Cond, args: Vec<Arg<'_>>) -> EngineResult<Vec<Value>> {
        let mut args = args.into_iter();
        let pred = args.next().expect("a cond has a predicate");
        let branch = if truth(pred.value())? { 0 } else { 1 };
        self.bodies[branch]
            .execute(args.collect(), self.batch)
            .map_err(self.nested(0))
    }

    fn while_loop(&self, w: &WhileLoop, args: Vec<Arg<'_>>) -> EngineResult<Vec<Value>> {
        let (cond, body) = (&self.bodies[0], &self.bodies[1]);
        let mut args = args.into_iter();
        let mut carries: Vec<Value> = args.by_ref().take(w.carries).map(Arg::into_value).collect();
        let consts: Vec<Arg<'_>> = args.collect();
        let mut trips = 0usize;
        while trips < w.max_trips {
            let mut inputs: Vec<Arg<'_>> = carries.iter().map(Arg::Shared).collect();
            inputs.extend(consts.iter().map(|v| Arg::Shared(v.value())));
            let go = cond
                .execute(inputs, self.batch)
                .map_err(self.nested(trips))?;
            if !truth(&go[0])? {
                break;
            }
            let mut inputs: Vec<Arg<'_>> = carries.drain(..).map(Arg::Owned).collect();
            inputs.extend(consts.iter().map(|v| Arg::Shared(v.value())));
            carries = body
                .execute(inputs, self.batch)
                .map_err(self.nested(trips))?;
            trips += 1;
        }
        carries.push(Value::scalar_i64(trips as i64));
        Ok(carries)
    }
}

fn truth(value: &Value) -> EngineResult<bool> {
    match value {
        Value::Bool(a) if a.ndim() == 0 => Ok(a[[]]),
        other => Err(EngineError::Shape(format!(
            "a condition must be a bool scalar, got {}{:?}",
            other.dtype(),
            other.shape()
        ))),
    }
}
