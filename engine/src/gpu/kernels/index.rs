//! Ops that read integer indices: gather, its adjoint scatter-add, and
//! one-hot. An index out of range sets [`FLAG_INDEX_OUT_OF_RANGE`].

use canopy_ir::{DType, Op};

use super::{FLAG_INDEX_OUT_OF_RANGE, Family, Kernel, Site, count, foreign, join_sum, per_output};
use crate::gpu::wgsl::{coordinates_named, load, strides, zero};

pub fn generate(site: &Site<'_>) -> Result<Vec<Kernel>, String> {
    Ok(match site.op {
        Op::Gather { axis } => vec![gather(site, *axis)],
        Op::ScatterAdd { axis, dim_size } => vec![scatter_add(site, *axis, *dim_size)],
        Op::OneHot { depth } => vec![one_hot(site, *depth)],
        other => return Err(foreign(other, Family::Index)),
    })
}

/// Reads an index operand element as i32, flagging values outside
/// [0, limit) (an i64 must also fit in 32 bits).
fn index_value(dtype: DType, at: &str) -> String {
    match dtype {
        DType::I64 => format!(
            "select(-1i, bitcast<i32>(a1[2u * ({at})]), a1[2u * ({at}) + 1u] == select(0u, 0xffffffffu, bitcast<i32>(a1[2u * ({at})]) < 0))"
        ),
        _ => format!("a1[{at}]"),
    }
}

fn one_hot(site: &Site<'_>, depth: usize) -> Kernel {
    let (dtype, _) = site.operands[0];
    let index = match dtype {
        DType::I64 => "select(-1i, bitcast<i32>(a0[2u * row]), a0[2u * row + 1u] == select(0u, 0xffffffffu, bitcast<i32>(a0[2u * row]) < 0))".to_string(),
        _ => "a0[row]".to_string(),
    };
    let body = format!(
        "  let row = i / {depth}u;\n  let position = i32(i % {depth}u);\n  let value = select(0.0, 1.0, {index} == position);"
    );
    per_output(site, &body, false)
}

fn gather(site: &Site<'_>, axis: usize) -> Kernel {
    let (data_dtype, data_shape) = &site.operands[0];
    let (index_dtype, index_shape) = &site.operands[1];
    let index_rank = index_shape.len();
    let data_strides = strides(data_shape);
    let index_strides = strides(index_shape);
    let index_at = join_sum(
        &(0..index_rank)
            .map(|j| format!("c{} * {}u", axis + j, index_strides[j]))
            .collect::<Vec<_>>(),
    );
    let mut terms: Vec<String> = (0..axis)
        .map(|a| format!("c{a} * {}u", data_strides[a]))
        .collect();
    terms.push(format!("u32(idx) * {}u", data_strides[axis]));
    for (a, stride) in data_strides.iter().enumerate().skip(axis + 1) {
        terms.push(format!("c{} * {stride}u", a + index_rank - 1));
    }
    let body = format!(
        "  let idx = {};\n  var value = {};\n  if (idx < 0i || idx >= {}i) {{ flags[{FLAG_INDEX_OUT_OF_RANGE}u] = 1u; }} else {{ value = {}; }}",
        index_value(*index_dtype, &index_at),
        zero(*data_dtype),
        data_shape[axis],
        load("a0", *data_dtype, &join_sum(&terms))
    );
    per_output(site, &body, true)
}

/// scatter_add(indices, updates): each output element sums, in order, the
/// updates whose index names its position (no float atomics in WGSL, and
/// this order matches the CPU's sum).
fn scatter_add(site: &Site<'_>, axis: usize, dim_size: usize) -> Kernel {
    let (index_dtype, index_shape) = &site.operands[0];
    let (_, updates_shape) = &site.operands[1];
    let index_count = count(index_shape);
    let index_rank = index_shape.len();
    let update_strides = strides(updates_shape);
    let out_rank = site.out.1.len();
    let outer: Vec<String> = (0..axis)
        .map(|a| format!("c{a} * {}u", update_strides[a]))
        .collect();
    let inner: Vec<String> = (axis + 1..out_rank)
        .map(|a| format!("c{a} * {}u", update_strides[a + index_rank - 1]))
        .collect();
    let index_split = coordinates_named(index_shape, "j", "q");
    let at: Vec<String> = (0..index_rank)
        .map(|j| format!("q{j} * {}u", update_strides[axis + j]))
        .collect();
    let read_index = match index_dtype {
        DType::I64 => "select(-1i, bitcast<i32>(a0[2u * j]), a0[2u * j + 1u] == select(0u, 0xffffffffu, bitcast<i32>(a0[2u * j]) < 0))".to_string(),
        _ => "a0[j]".to_string(),
    };
    let body = format!(
        "  var value = 0.0;\n  for (var j = 0u; j < {index_count}u; j = j + 1u) {{\n    let idx = {read_index};\n    if (idx < 0i || idx >= {dim_size}i) {{ flags[{FLAG_INDEX_OUT_OF_RANGE}u] = 1u; continue; }}\n    if (u32(idx) != c{axis}) {{ continue; }}\n{index_split}    value = value + a1[{outer} + {at} + {inner}];\n  }}",
        outer = join_sum(&outer),
        at = join_sum(&at),
        inner = join_sum(&inner),
    );
    per_output(site, &body, true)
}
