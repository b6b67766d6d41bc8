//! Max and average pooling and their adjoints, one invocation per output
//! element; padding never wins a max and counts as zero in an average.

use canopy_ir::{Op, Pool2dAttrs};

use super::{Family, Kernel, Site, foreign, per_output};

pub fn generate(site: &Site<'_>) -> Result<Vec<Kernel>, String> {
    Ok(match site.op {
        Op::MaxPool2d(attrs) => vec![max_pool(site, attrs, MaxPoolOutput::Max)],
        Op::MaxPool2dSelect(attrs) => vec![max_pool(site, attrs, MaxPoolOutput::Select)],
        Op::MaxPool2dBackward(attrs) => vec![max_pool_backward(site, attrs)],
        Op::AvgPool2d(attrs) => vec![avg_pool(site, attrs)],
        Op::AvgPool2dBackward { attrs, .. } => vec![avg_pool_backward(site, attrs)],
        other => return Err(foreign(other, Family::Pool)),
    })
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum MaxPoolOutput {
    Max,
    Select,
}

/// WGSL for the argmax (first on ties, row-major, a NaN winning as on the
/// CPU) of window (oh, ow) of plane `plane` of `a0`, as `best_at` (-1 when
/// the window is all padding). NaN is tested on the bits: a shader compiler
/// may fold `v != v` to false.
fn window_argmax(attrs: &Pool2dAttrs, in_hw: [usize; 2], oh: &str, ow: &str) -> String {
    let [kh, kw] = attrs.kernel;
    let [sh, sw] = attrs.stride;
    let [ph, pw] = attrs.padding;
    let [h, w] = in_hw;
    format!(
        r#"    var best = bitcast<f32>(0xff800000u);
    var best_at = -1i;
    for (var ki = 0u; ki < {kh}u; ki = ki + 1u) {{
      let ih = i32({oh} * {sh}u + ki) - {ph}i;
      if (ih < 0i || ih >= {h}i) {{ continue; }}
      for (var kj = 0u; kj < {kw}u; kj = kj + 1u) {{
        let iw = i32({ow} * {sw}u + kj) - {pw}i;
        if (iw < 0i || iw >= {w}i) {{ continue; }}
        let at = i32(plane * {hw}u) + ih * {w}i + iw;
        let v = a0[u32(at)];
        let v_nan = (bitcast<u32>(v) & 0x7fffffffu) > 0x7f800000u;
        let best_nan = (bitcast<u32>(best) & 0x7fffffffu) > 0x7f800000u;
        if (best_at < 0i || v > best || (v_nan && !best_nan)) {{ best = v; best_at = at; }}
      }}
    }}
"#,
        hw = h * w,
    )
}

fn max_pool(site: &Site<'_>, attrs: &Pool2dAttrs, output: MaxPoolOutput) -> Kernel {
    let x = &site.operands[0].1;
    let out = &site.out.1;
    let search = window_argmax(attrs, [x[2], x[3]], "c2", "c3");
    let result = match output {
        MaxPoolOutput::Max => "best",
        MaxPoolOutput::Select => "select(0.0, a1[u32(max(best_at, 0i))], best_at >= 0i)",
    };
    let body = format!(
        "  let plane = c0 * {}u + c1;\n{search}  let value = {result};",
        out[1]
    );
    per_output(site, &body, false)
}

/// The output positions whose windows contain input position (c2, c3),
/// as loops over `y` and `xo` (the body follows).
fn windows_containing(attrs: &Pool2dAttrs, out_hw: [usize; 2]) -> String {
    let [kh, kw] = attrs.kernel;
    let [sh, sw] = attrs.stride;
    let [ph, pw] = attrs.padding;
    let [oh, ow] = out_hw;
    format!(
        r#"  for (var y = 0u; y < {oh}u; y = y + 1u) {{
    let top = i32(y * {sh}u) - {ph}i;
    if (i32(c2) < top || i32(c2) >= top + {kh}i) {{ continue; }}
    for (var xo = 0u; xo < {ow}u; xo = xo + 1u) {{
      let left = i32(xo * {sw}u) - {pw}i;
      if (i32(c3) < left || i32(c3) >= left + {kw}i) {{ continue; }}
"#
    )
}

fn max_pool_backward(site: &Site<'_>, attrs: &Pool2dAttrs) -> Kernel {
    let x = &site.operands[0].1;
    let dy = &site.operands[1].1;
    let (oh, ow) = (dy[2], dy[3]);
    let plane_hw = x[2] * x[3];
    let body = format!(
        "  let plane = c0 * {channels}u + c1;\n  let here = i32(plane * {plane_hw}u + c2 * {w}u + c3);\n  var value = 0.0;\n{loops}{search}      if (best_at == here) {{ value = value + a1[(plane * {oh}u + y) * {ow}u + xo]; }}\n    }}\n  }}",
        channels = x[1],
        w = x[3],
        loops = windows_containing(attrs, [oh, ow]),
        search = window_argmax(attrs, [x[2], x[3]], "y", "xo"),
    );
    per_output(site, &body, false)
}

fn avg_pool(site: &Site<'_>, attrs: &Pool2dAttrs) -> Kernel {
    let x = &site.operands[0].1;
    let [kh, kw] = attrs.kernel;
    let [sh, sw] = attrs.stride;
    let [ph, pw] = attrs.padding;
    let (h, w) = (x[2], x[3]);
    let body = format!(
        r#"  let plane = c0 * {channels}u + c1;
  var total = 0.0;
  for (var ki = 0u; ki < {kh}u; ki = ki + 1u) {{
    let ih = i32(c2 * {sh}u + ki) - {ph}i;
    if (ih < 0i || ih >= {h}i) {{ continue; }}
    for (var kj = 0u; kj < {kw}u; kj = kj + 1u) {{
      let iw = i32(c3 * {sw}u + kj) - {pw}i;
      if (iw < 0i || iw >= {w}i) {{ continue; }}
      total = total + a0[plane * {hw}u + u32(ih) * {w}u + u32(iw)];
    }}
  }}
  let value = total / {area}.0;"#,
        channels = x[1],
        hw = h * w,
        area = kh * kw,
    );
    per_output(site, &body, false)
}

fn avg_pool_backward(site: &Site<'_>, attrs: &Pool2dAttrs) -> Kernel {
    let dy = &site.operands[0].1;
    let out = &site.out.1;
    let (oh, ow) = (dy[2], dy[3]);
    let body = format!(
        "  let plane = c0 * {channels}u + c1;\n  var total = 0.0;\n{loops}      total = total + a0[(plane * {oh}u + y) * {ow}u + xo];\n    }}\n  }}\n  let value = total / {area}.0;",
        channels = out[1],
        loops = windows_containing(attrs, [oh, ow]),
        area = attrs.kernel[0] * attrs.kernel[1],
    );
    per_output(site, &body, false)
}
