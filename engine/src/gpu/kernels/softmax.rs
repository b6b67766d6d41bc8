//! Softmax and log-softmax along an axis.

use std::fmt::Write;

use canopy_ir::{DType, Op};

use super::{Bind, Family, Kernel, Site, count, foreign};
use crate::gpu::wgsl::{HELPERS, WORKGROUP, declare, grid};

pub fn generate(site: &Site<'_>) -> Result<Vec<Kernel>, String> {
    Ok(match site.op {
        Op::Softmax { axis } => vec![softmax(site, *axis, false)],
        Op::LogSoftmax { axis } => vec![softmax(site, *axis, true)],
        other => return Err(foreign(other, Family::Softmax)),
    })
}

/// Softmax or log-softmax along `axis`: one workgroup per row, a tree for
/// the row's maximum, another for the sum of exponentials.
fn softmax(site: &Site<'_>, axis: usize, log: bool) -> Kernel {
    let shape = &site.out.1;
    let length = shape[axis];
    let inner: usize = shape[axis + 1..].iter().product();
    let rows = count(shape) / length.max(1) as u64;
    let groups = grid(rows * u64::from(WORKGROUP), site.max_workgroups);
    let row_stride = u64::from(groups[0]);
    let result = if log {
        "v - m - log(s)"
    } else {
        "exp(v - m) / s"
    };
    let mut source = String::from(HELPERS);
    declare(&mut source, 0, "a0", DType::F32, false);
    declare(&mut source, 1, "out", DType::F32, true);
    let _ = write!(
        source,
        r#"var<workgroup> partial: array<f32, {WORKGROUP}>;
@compute @workgroup_size({WORKGROUP})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lane: u32) {{
  let row = wid.x + wid.y * {row_stride}u;
  let live = row < {rows}u;
  let base = (row / {inner}u) * {length}u * {inner}u + row % {inner}u;
  var m = bitcast<f32>(0xff800000u);
  if (live) {{
    for (var j = lane; j < {length}u; j = j + {WORKGROUP}u) {{ m = max(m, a0[base + j * {inner}u]); }}
  }}
  partial[lane] = m;
  workgroupBarrier();
  for (var w = {half}u; w > 0u; w = w / 2u) {{
    if (lane < w) {{ partial[lane] = max(partial[lane], partial[lane + w]); }}
    workgroupBarrier();
  }}
  m = partial[0];
  workgroupBarrier();
  var s = 0.0;
  if (live) {{
    for (var j = lane; j < {length}u; j = j + {WORKGROUP}u) {{ s = s + exp(a0[base + j * {inner}u] - m); }}
  }}
  partial[lane] = s;
  workgroupBarrier();
  for (var w = {half}u; w > 0u; w = w / 2u) {{
    if (lane < w) {{ partial[lane] = partial[lane] + partial[lane + w]; }}
    workgroupBarrier();
  }}
  s = partial[0];
  if (live) {{
    for (var j = lane; j < {length}u; j = j + {WORKGROUP}u) {{
      let v = a0[base + j * {inner}u];
      out[base + j * {inner}u] = {result};
    }}
  }}
}}
"#,
        half = WORKGROUP / 2,
    );
    Kernel {
        label: site.op.name(),
        source,
        workgroups: groups,
        bindings: vec![Bind::Operand(0), Bind::Output],
    }
}
