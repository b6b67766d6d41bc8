//! Kernels that move elements: each output element is copied from one
//! operand element (or is padding), with the index arithmetic baked in.

use canopy_ir::Op;

use super::{Bind, Family, Kernel, Site, count, foreign, join_sum, per_output};
use crate::gpu::wgsl::{
    HELPERS, coordinates, declare, flat_entry, grid, load, store, strides, zero,
};

pub fn generate(site: &Site<'_>) -> Result<Vec<Kernel>, String> {
    Ok(match site.op {
        Op::Transpose { perm } => vec![transpose(site, perm)],
        Op::Slice { axis, start, .. } => vec![slice(site, *axis, *start)],
        Op::Pad { axis, before, .. } => vec![pad(site, *axis, *before)],
        Op::Concat { axis } => concat(site, *axis),
        other => return Err(foreign(other, Family::Shape)),
    })
}

/// An output element copied from one operand element found by `source`.
fn copy_from(site: &Site<'_>, source: &str) -> Kernel {
    let value = load("a0", site.operands[0].0, source);
    per_output(site, &format!("  let value = {value};"), false)
}

fn transpose(site: &Site<'_>, perm: &[usize]) -> Kernel {
    let in_strides = strides(&site.operands[0].1);
    let terms: Vec<String> = perm
        .iter()
        .enumerate()
        .map(|(axis, &from)| format!("c{axis} * {}u", in_strides[from]))
        .collect();
    copy_from(site, &join_sum(&terms))
}

fn slice(site: &Site<'_>, axis: usize, start: usize) -> Kernel {
    let in_strides = strides(&site.operands[0].1);
    let terms: Vec<String> = (0..site.out.1.len())
        .map(|a| {
            let offset = if a == axis {
                format!(" + {start}u")
            } else {
                String::new()
            };
            format!("(c{a}{offset}) * {}u", in_strides[a])
        })
        .collect();
    copy_from(site, &join_sum(&terms))
}

fn pad(site: &Site<'_>, axis: usize, before: usize) -> Kernel {
    let (dtype, in_shape) = &site.operands[0];
    let in_strides = strides(in_shape);
    let terms: Vec<String> = (0..in_shape.len())
        .map(|a| {
            let coordinate = if a == axis {
                format!("(c{a} - {before}u)")
            } else {
                format!("c{a}")
            };
            format!("{coordinate} * {}u", in_strides[a])
        })
        .collect();
    let inside = format!(
        "c{axis} >= {before}u && c{axis} < {}u",
        before + in_shape[axis]
    );
    let body = format!(
        "  var value = {};\n  if ({inside}) {{ value = {}; }}",
        zero(*dtype),
        load("a0", *dtype, &join_sum(&terms))
    );
    per_output(site, &body, false)
}

/// One kernel per operand, each writing its block of the output.
fn concat(site: &Site<'_>, axis: usize) -> Vec<Kernel> {
    let out_shape = &site.out.1;
    let out_strides = strides(out_shape);
    let mut offset = 0usize;
    let mut kernels = Vec::new();
    for (k, (dtype, shape)) in site.operands.iter().enumerate() {
        let mut source = String::from(HELPERS);
        declare(&mut source, 0, "a0", *dtype, false);
        declare(&mut source, 1, "out", *dtype, true);
        let terms: Vec<String> = (0..shape.len())
            .map(|a| {
                let shift = if a == axis {
                    format!(" + {offset}u")
                } else {
                    String::new()
                };
                format!("(c{a}{shift}) * {}u", out_strides[a])
            })
            .collect();
        let n = count(shape);
        let groups = grid(n, site.max_workgroups);
        let body = format!(
            "{}  let value = {};\n  {}",
            coordinates(shape, "i"),
            load("a0", *dtype, "i"),
            store("out", *dtype, &join_sum(&terms), "value")
        );
        flat_entry(&mut source, n, groups, &body);
        kernels.push(Kernel {
            label: site.op.name(),
            source,
            workgroups: groups,
            bindings: vec![Bind::Operand(k), Bind::Output],
        });
        offset += shape[axis];
    }
    kernels
}
