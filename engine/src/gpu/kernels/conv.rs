//! Convolution and its gradients: implicit GEMM (`gemm.rs`) where the
//! tile pays off, else a direct kernel with the window in a loop.

use canopy_ir::{Conv2dAttrs, Op};

use super::{Family, Kernel, Site, foreign, gemm, per_output};

pub fn generate(site: &Site<'_>) -> Result<Vec<Kernel>, String> {
    Ok(match site.op {
        Op::Conv2d(attrs) => vec![conv2d(site, attrs)],
        Op::Conv2dBackwardInput { attrs, .. } => vec![conv2d_backward_input(site, attrs)],
        Op::Conv2dBackwardFilter { attrs, .. } => vec![gemm::conv2d_backward_filter(site, attrs)],
        other => return Err(foreign(other, Family::Conv)),
    })
}

/// conv2d: implicit GEMM when the tile pays off ([`gemm::pays_off`]),
/// else one invocation per output with its window loop.
fn conv2d(site: &Site<'_>, attrs: &Conv2dAttrs) -> Kernel {
    let w = &site.operands[1].1;
    if gemm::pays_off(w[0], w[1] * w[2] * w[3]) {
        return gemm::conv2d(site, attrs);
    }
    let x = &site.operands[0].1;
    let (c, h, wd) = (x[1], x[2], x[3]);
    let (kh, kw) = (w[2], w[3]);
    let [sh, sw] = attrs.stride;
    let [ph, pw] = attrs.padding;
    let [dh, dw] = attrs.dilation;
    let body = format!(
        r#"  var value = 0.0;
  for (var ci = 0u; ci < {c}u; ci = ci + 1u) {{
    for (var ki = 0u; ki < {kh}u; ki = ki + 1u) {{
      let ih = i32(c2 * {sh}u + ki * {dh}u) - {ph}i;
      if (ih < 0i || ih >= {h}i) {{ continue; }}
      for (var kj = 0u; kj < {kw}u; kj = kj + 1u) {{
        let iw = i32(c3 * {sw}u + kj * {dw}u) - {pw}i;
        if (iw < 0i || iw >= {wd}i) {{ continue; }}
        value = value + a0[((c0 * {c}u + ci) * {h}u + u32(ih)) * {wd}u + u32(iw)] * a1[((c1 * {c}u + ci) * {kh}u + ki) * {kw}u + kj];
      }}
    }}
  }}"#
    );
    per_output(site, &body, false)
}

/// dx[n, c, ih, iw] = Σ dy[n, o, oh, ow] · w[o, c, ki, kj] over the outputs
/// whose window reads (ih, iw): implicit GEMM when the tile pays off,
/// else one invocation per input element.
fn conv2d_backward_input(site: &Site<'_>, attrs: &Conv2dAttrs) -> Kernel {
    let w = &site.operands[1].1;
    if gemm::pays_off(w[1], w[0] * w[2] * w[3]) {
        return gemm::conv2d_backward_input(site, attrs);
    }
    let dy = &site.operands[0].1;
    let (o, oh, ow) = (dy[1], dy[2], dy[3]);
    let (c, kh, kw) = (w[1], w[2], w[3]);
    let [sh, sw] = attrs.stride;
    let [ph, pw] = attrs.padding;
    let [dh, dw] = attrs.dilation;
    let body = format!(
        r#"  var value = 0.0;
  for (var oi = 0u; oi < {o}u; oi = oi + 1u) {{
    for (var ki = 0u; ki < {kh}u; ki = ki + 1u) {{
      let th = i32(c2) + {ph}i - i32(ki * {dh}u);
      if (th < 0i || th % {sh}i != 0i) {{ continue; }}
      let y = th / {sh}i;
      if (y >= {oh}i) {{ continue; }}
      for (var kj = 0u; kj < {kw}u; kj = kj + 1u) {{
        let tw = i32(c3) + {pw}i - i32(kj * {dw}u);
        if (tw < 0i || tw % {sw}i != 0i) {{ continue; }}
        let x = tw / {sw}i;
        if (x >= {ow}i) {{ continue; }}
        value = value + a0[((c0 * {o}u + oi) * {oh}u + u32(y)) * {ow}u + u32(x)] * a1[((oi * {c}u + c1) * {kh}u + ki) * {kw}u + kj];
      }}
    }}
  }}"#
    );
    per_output(site, &body, false)
}
