//! WGSL text shared by the kernel generators: element types as the device
//! stores them, loads and stores, index arithmetic, and the helper
//! functions (stable transcendental functions, 64-bit integers).

use std::fmt::Write;

use canopy_ir::DType;

/// Invocations per workgroup of the one-dimensional kernels.
pub const WORKGROUP: u32 = 256;

/// Bytes one element of `dtype` takes on the device.
pub fn element_bytes(dtype: DType) -> u64 {
    match dtype {
        DType::I64 => 8,
        DType::F32 | DType::I32 | DType::Bool => 4,
    }
}

/// The storage array type of a buffer holding `dtype`.
fn storage_type(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "array<f32>",
        DType::I32 => "array<i32>",
        DType::Bool | DType::I64 => "array<u32>",
    }
}

/// The WGSL type one element is computed in.
pub fn value_type(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "f32",
        DType::I32 => "i32",
        DType::Bool => "bool",
        DType::I64 => "vec2<u32>",
    }
}

/// Declares binding `binding` as `name`, read-only or read-write.
pub fn declare(out: &mut String, binding: usize, name: &str, dtype: DType, writable: bool) {
    let access = if writable { "read_write" } else { "read" };
    let _ = writeln!(
        out,
        "@group(0) @binding({binding}) var<storage, {access}> {name}: {};",
        storage_type(dtype)
    );
}

/// An expression reading element `index` of `name`, as [`value_type`].
pub fn load(name: &str, dtype: DType, index: &str) -> String {
    match dtype {
        DType::F32 | DType::I32 => format!("{name}[{index}]"),
        DType::Bool => format!("({name}[{index}] != 0u)"),
        DType::I64 => format!("vec2<u32>({name}[2u * ({index})], {name}[2u * ({index}) + 1u])"),
    }
}

/// Statements writing `value` (a [`value_type`] expression) to element
/// `index` of `name`.
pub fn store(name: &str, dtype: DType, index: &str, value: &str) -> String {
    match dtype {
        DType::F32 | DType::I32 => format!("{name}[{index}] = {value};"),
        DType::Bool => format!("{name}[{index}] = select(0u, 1u, {value});"),
        DType::I64 => format!(
            "{{ let v = {value}; {name}[2u * ({index})] = v.x; {name}[2u * ({index}) + 1u] = v.y; }}"
        ),
    }
}

/// The zero of `dtype`, as [`value_type`].
pub fn zero(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "0.0",
        DType::I32 => "0i",
        DType::Bool => "false",
        DType::I64 => "vec2<u32>(0u, 0u)",
    }
}

/// Workgroup counts for `invocations` one-dimensional invocations of
/// [`WORKGROUP`] each, spread over x and y when x alone would exceed
/// `max_per_dimension`; the kernel recovers its index with
/// [`flat_index`].
pub fn grid(invocations: u64, max_per_dimension: u32) -> [u32; 3] {
    let groups = invocations.div_ceil(u64::from(WORKGROUP)).max(1);
    let max = u64::from(max_per_dimension.max(1));
    if groups <= max {
        return [groups as u32, 1, 1];
    }
    let y = groups.div_ceil(max);
    [max as u32, y.min(max) as u32, 1]
}

/// The entry point of a one-dimensional kernel over `count` items; the body
/// sees `i: u32`.
pub fn flat_entry(out: &mut String, count: u64, groups: [u32; 3], body: &str) {
    let row = u64::from(groups[0]) * u64::from(WORKGROUP);
    let _ = writeln!(
        out,
        "@compute @workgroup_size({WORKGROUP})\nfn main(@builtin(global_invocation_id) gid: vec3<u32>) {{\n  let i = gid.x + gid.y * {row}u;\n  if (i >= {count}u) {{ return; }}\n{body}\n}}"
    );
}

/// Statements folding each invocation's `acc` into `partial[0]` (a
/// workgroup array of [`WORKGROUP`] elements) with a tree; `fold` combines
/// `acc2`, the lane's partial result, with `v`, its partner's. Ends after
/// the last barrier, so any lane may read `partial[0]`.
pub fn workgroup_tree(fold: &str) -> String {
    format!(
        "  partial[lane] = acc;
  workgroupBarrier();
  for (var width = {half}u; width > 0u; width = width / 2u) {{
    if (lane < width) {{
      let v = partial[lane + width];
      let acc2 = partial[lane];
      partial[lane] = {fold};
    }}
    workgroupBarrier();
  }}
",
        half = WORKGROUP / 2
    )
}

/// Row-major strides of `shape`.
pub fn strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1usize; shape.len()];
    for axis in (0..shape.len().saturating_sub(1)).rev() {
        strides[axis] = strides[axis + 1] * shape[axis + 1];
    }
    strides
}

/// Statements that split flat index `index` of a row-major `shape` into
/// `c0`, `c1`, … (u32 coordinates).
pub fn coordinates(shape: &[usize], index: &str) -> String {
    coordinates_named(shape, index, "c")
}

/// [`coordinates`] with names `{prefix}0`, `{prefix}1`, ….
pub fn coordinates_named(shape: &[usize], index: &str, prefix: &str) -> String {
    let strides = strides(shape);
    let rest = format!("rest_{prefix}");
    let mut out = format!("  var {rest} = {index};\n");
    for (axis, stride) in strides.iter().enumerate() {
        let _ = writeln!(
            out,
            "  let {prefix}{axis} = {rest} / {stride}u; {rest} = {rest} % {stride}u;"
        );
    }
    out
}

/// The flat index, in an operand of shape `operand` broadcast to `out`,
/// of the element at output coordinates `c0`, `c1`, ….
pub fn broadcast_index(operand: &[usize], out: &[usize]) -> String {
    if operand == out {
        return "i".to_string();
    }
    let offset = out.len() - operand.len();
    let strides = strides(operand);
    let terms: Vec<String> = operand
        .iter()
        .enumerate()
        .filter(|(_, size)| **size != 1)
        .map(|(axis, _)| format!("c{} * {}u", axis + offset, strides[axis]))
        .collect();
    if terms.is_empty() {
        "0u".to_string()
    } else {
        terms.join(" + ")
    }
}

/// Helper functions every kernel may call; WGSL drops the unused ones.
pub const HELPERS: &str = r#"
fn stable_tanh(x: f32) -> f32 {
  let t = exp(-2.0 * abs(x));
  return sign(x) * (1.0 - t) / (1.0 + t);
}
fn stable_sigmoid(x: f32) -> f32 {
  let e = exp(-abs(x));
  return select(e / (1.0 + e), 1.0 / (1.0 + e), x >= 0.0);
}
fn gelu_tanh(x: f32) -> f32 {
  return 0.5 * x * (1.0 + stable_tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
}
// WGSL has no erf: the Maclaurin series to x¹³ below 0.5 (error < 1e-9),
// else Abramowitz & Stegun 7.1.26 (absolute error < 1.5e-7).
fn erf_f32(x: f32) -> f32 {
  let a = abs(x);
  if (a < 0.5) {
    let z = x * x;
    let p = 1.0 + z * (-1.0 / 3.0 + z * (0.1 + z * (-1.0 / 42.0 + z * (1.0 / 216.0 + z * (-1.0 / 1320.0 + z * (1.0 / 9360.0))))));
    return 1.1283791670955126 * x * p;
  }
  let t = 1.0 / (1.0 + 0.3275911 * a);
  let poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))));
  let r = 1.0 - poly * exp(-a * a);
  return select(r, -r, x < 0.0);
}
fn gelu_erf(x: f32) -> f32 {
  return 0.5 * x * (1.0 + erf_f32(x * 0.7071067811865476));
}
// log(1 + x) accurately near 0. Vulkan only bounds log's error absolutely
// (2^-21 near 1), which is no relative bound at all for small results, so
// |x| <= 1/2 takes the series 2·atanh(s), s = x / (2 + x) <= 1/3, to s¹³
// (error < 1e-7 relative).
fn log1p_f32(x: f32) -> f32 {
  if (is_nan_bits(x)) { return x; }
  if (abs(x) > 0.5) { return log(1.0 + x); }
  let s = x / (2.0 + x);
  let z = s * s;
  return 2.0 * s * (1.0 + z * (1.0 / 3.0 + z * (0.2 + z * (1.0 / 7.0 + z * (1.0 / 9.0 + z * (1.0 / 11.0 + z / 13.0))))));
}
fn softplus(x: f32) -> f32 {
  if (is_nan_bits(x)) { return x; }
  return max(x, 0.0) + log1p_f32(exp(-abs(x)));
}
fn pow_real(x: f32, y: f32) -> f32 {
  if (y == 0.0) { return 1.0; }
  if (x == 0.0) { return select(0.0, bitcast<f32>(0x7f800000u), y < 0.0); }
  let magnitude = exp2(y * log2(abs(x)));
  if (x > 0.0) { return magnitude; }
  if (floor(y) != y) { return bitcast<f32>(0x7fc00000u); }
  let odd = (floor(y * 0.5) * 2.0) != y;
  return select(magnitude, -magnitude, odd);
}
fn is_nan_bits(x: f32) -> bool {
  return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u;
}
fn nan_max(x: f32, y: f32) -> f32 {
  if (is_nan_bits(x)) { return x; }
  if (is_nan_bits(y)) { return y; }
  return max(x, y);
}
fn nan_min(x: f32, y: f32) -> f32 {
  if (is_nan_bits(x)) { return x; }
  if (is_nan_bits(y)) { return y; }
  return min(x, y);
}
fn is_finite_bits(x: f32) -> bool {
  return (bitcast<u32>(x) & 0x7f800000u) != 0x7f800000u;
}
fn i64_from_i32(x: i32) -> vec2<u32> {
  return vec2<u32>(bitcast<u32>(x), select(0u, 0xffffffffu, x < 0));
}
fn i64_to_f32(v: vec2<u32>) -> f32 {
  // Through the magnitude: high * 2^32 + low in f32 cancels to 0 for a
  // small negative value (-8 is -2^32 + 4294967288).
  let m = i64_abs(v);
  let f = f32(m.y) * 4294967296.0 + f32(m.x);
  return select(f, -f, i64_negative(v));
}
fn i64_add(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> {
  let lo = a.x + b.x;
  return vec2<u32>(lo, a.y + b.y + select(0u, 1u, lo < a.x));
}
fn i64_sub(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> {
  return vec2<u32>(a.x - b.x, a.y - b.y - select(0u, 1u, a.x < b.x));
}
fn i64_lt(a: vec2<u32>, b: vec2<u32>) -> bool {
  let ah = bitcast<i32>(a.y);
  let bh = bitcast<i32>(b.y);
  return ah < bh || (ah == bh && a.x < b.x);
}
fn i64_eq(a: vec2<u32>, b: vec2<u32>) -> bool {
  return a.x == b.x && a.y == b.y;
}
fn mul32(a: u32, b: u32) -> vec2<u32> {
  let a0 = a & 0xffffu; let a1 = a >> 16u; let b0 = b & 0xffffu; let b1 = b >> 16u;
  let p00 = a0 * b0; let p01 = a0 * b1; let p10 = a1 * b0; let p11 = a1 * b1;
  let mid = (p00 >> 16u) + (p01 & 0xffffu) + (p10 & 0xffffu);
  let lo = (p00 & 0xffffu) | (mid << 16u);
  let hi = p11 + (p01 >> 16u) + (p10 >> 16u) + (mid >> 16u);
  return vec2<u32>(lo, hi);
}
fn i64_mul(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> {
  let low = mul32(a.x, b.x);
  return vec2<u32>(low.x, low.y + a.x * b.y + a.y * b.x);
}
fn i64_negative(a: vec2<u32>) -> bool {
  return (a.y & 0x80000000u) != 0u;
}
fn i64_abs(a: vec2<u32>) -> vec2<u32> {
  return select(a, i64_sub(vec2<u32>(0u, 0u), a), i64_negative(a));
}
fn u64_lt(a: vec2<u32>, b: vec2<u32>) -> bool {
  return a.y < b.y || (a.y == b.y && a.x < b.x);
}
fn i64_div(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> {
  if (b.x == 0u && b.y == 0u) { return vec2<u32>(0u, 0u); }
  let n = i64_abs(a);
  let d = i64_abs(b);
  var q = vec2<u32>(0u, 0u);
  var r = vec2<u32>(0u, 0u);
  for (var bit = 63i; bit >= 0i; bit = bit - 1i) {
    r = vec2<u32>(r.x << 1u, (r.y << 1u) | (r.x >> 31u));
    if (bit >= 32i) { r.x = r.x | ((n.y >> u32(bit - 32i)) & 1u); } else { r.x = r.x | ((n.x >> u32(bit)) & 1u); }
    if (!u64_lt(r, d)) {
      r = i64_sub(r, d);
      if (bit >= 32i) { q.y = q.y | (1u << u32(bit - 32i)); } else { q.x = q.x | (1u << u32(bit)); }
    }
  }
  return select(q, i64_sub(vec2<u32>(0u, 0u), q), i64_negative(a) != i64_negative(b));
}
"#;
