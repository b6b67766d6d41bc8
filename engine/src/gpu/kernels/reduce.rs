//! Folds along axes (sum, mean, max) and argmax.

use std::fmt::Write;

use canopy_ir::{DType, Op, ReduceKind};

use super::{Bind, Family, Kernel, Site, count, foreign, join_sum, per_output};
use crate::gpu::wgsl::{
    HELPERS, WORKGROUP, coordinates_named, declare, grid, load, store, strides, value_type,
    workgroup_tree, zero,
};

/// Whether an op of this family has a kernel over a first operand of
/// `first`.
pub fn check(op: &Op, first: DType) -> Result<(), String> {
    match (op, first) {
        (Op::Reduce { .. } | Op::ArgMax { .. }, DType::F32) => Ok(()),
        (
            Op::Reduce {
                kind: ReduceKind::Sum | ReduceKind::Max,
                ..
            },
            DType::I64 | DType::I32,
        ) => Ok(()),
        (Op::Reduce { .. }, _) => Err(format!("{} over {first}", op.name())),
        (Op::ArgMax { .. }, _) => Err(format!("{} on {first}", op.name())),
        (other, _) => Err(foreign(other, Family::Reduce)),
    }
}

pub fn generate(site: &Site<'_>) -> Result<Vec<Kernel>, String> {
    Ok(match site.op {
        Op::Reduce {
            kind,
            axes,
            keep_dims: _,
        } => vec![reduce(site, *kind, axes)],
        Op::ArgMax { axis, .. } => vec![argmax(site, *axis)],
        other => return Err(foreign(other, Family::Reduce)),
    })
}

/// One workgroup per output element: each invocation folds a strided share
/// of the reduced elements, then a tree in workgroup memory folds the
/// workgroup's partial results.
fn reduce(site: &Site<'_>, kind: ReduceKind, axes: &[usize]) -> Kernel {
    let (dtype, in_shape) = &site.operands[0];
    let in_strides = strides(in_shape);
    let kept: Vec<usize> = (0..in_shape.len()).filter(|a| !axes.contains(a)).collect();
    let reduced_shape: Vec<usize> = axes.iter().map(|&a| in_shape[a]).collect();
    let reduced: u64 = count(&reduced_shape);
    let outputs = count(&site.out.1);
    let ty = value_type(*dtype);
    let (identity, fold) = match (kind, dtype) {
        (ReduceKind::Max, DType::F32) => {
            ("bitcast<f32>(0xff800000u)".to_string(), "nan_max(acc, v)")
        }
        (ReduceKind::Max, DType::I32) => ("i32(-2147483648)".to_string(), "max(acc, v)"),
        (ReduceKind::Max, _) => (
            "vec2<u32>(0u, 0x80000000u)".to_string(),
            "select(acc, v, i64_lt(acc, v))",
        ),
        (_, DType::I64) => (zero(*dtype).to_string(), "i64_add(acc, v)"),
        _ => (zero(*dtype).to_string(), "acc + v"),
    };
    // The input offset of kept coordinates k0… and reduced coordinates r0….
    let kept_offset = join_sum(
        &kept
            .iter()
            .enumerate()
            .map(|(j, &a)| format!("k{j} * {}u", in_strides[a]))
            .collect::<Vec<_>>(),
    );
    let reduced_offset = join_sum(
        &axes
            .iter()
            .enumerate()
            .map(|(j, &a)| format!("r{j} * {}u", in_strides[a]))
            .collect::<Vec<_>>(),
    );
    let kept_shape: Vec<usize> = kept.iter().map(|&a| in_shape[a]).collect();
    let split = coordinates_named;
    let mean = if kind == ReduceKind::Mean && reduced == 0 {
        "  result = bitcast<f32>(0x7fc00000u);\n".to_string()
    } else if kind == ReduceKind::Mean {
        format!("  result = result / {reduced}.0;\n")
    } else {
        String::new()
    };
    let mut source = String::from(HELPERS);
    declare(&mut source, 0, "a0", *dtype, false);
    declare(&mut source, 1, "out", site.out.0, true);
    let groups = grid(outputs * u64::from(WORKGROUP), site.max_workgroups);
    let row = u64::from(groups[0]);
    let _ = write!(
        source,
        r#"var<workgroup> partial: array<{ty}, {WORKGROUP}>;
@compute @workgroup_size({WORKGROUP})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lane: u32) {{
  let o = wid.x + wid.y * {row}u;
  let live = o < {outputs}u;
{kept_split}
  var acc: {ty} = {identity};
  if (live) {{
    let base = {kept_offset};
    for (var r = lane; r < {reduced}u; r = r + {WORKGROUP}u) {{
{reduced_split}
      let v = {load};
      acc = {fold};
    }}
  }}
{tree}  if (live && lane == 0u) {{
    var result = partial[0];
{mean}    {store}
  }}
}}
"#,
        kept_split = split(&kept_shape, "o", "k"),
        reduced_split = split(&reduced_shape, "r", "r"),
        load = load("a0", *dtype, &format!("base + {reduced_offset}")),
        tree = workgroup_tree(&fold.replace("acc", "acc2")),
        store = store("out", site.out.0, "o", "result"),
    );
    Kernel {
        label: "reduce",
        source,
        workgroups: groups,
        bindings: vec![Bind::Operand(0), Bind::Output],
    }
}

/// One invocation per output scans its lane: the first maximum, a NaN
/// beating any number (the CPU's rule). The kept or dropped axis does not
/// change the output's element order.
fn argmax(site: &Site<'_>, axis: usize) -> Kernel {
    let shape = &site.operands[0].1;
    let n = shape[axis];
    let inner: usize = shape[axis + 1..].iter().product();
    let body = format!(
        r#"  let base = (i / {inner}u) * {n}u * {inner}u + i % {inner}u;
  var best = 0u;
  var best_value = a0[base];
  for (var j = 1u; j < {n}u; j = j + 1u) {{
    let v = a0[base + j * {inner}u];
    if (!is_nan_bits(best_value) && (is_nan_bits(v) || v > best_value)) {{ best = j; best_value = v; }}
  }}
  let value = vec2<u32>(best, 0u);"#
    );
    per_output(site, &body, false)
}
