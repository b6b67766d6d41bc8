//! Seeded uniform numbers: the op's splitmix64 sequence, the same on
//! every backend.

use canopy_ir::Op;

use super::{Family, Kernel, Site, foreign, per_output};
use crate::gpu::wgsl::load;

pub fn generate(site: &Site<'_>) -> Result<Vec<Kernel>, String> {
    match site.op {
        Op::RandomUniform { .. } => Ok(vec![random_uniform(site)]),
        other => Err(foreign(other, Family::Random)),
    }
}

/// The op's splitmix64 sequence with 64-bit arithmetic on u32 pairs.
fn random_uniform(site: &Site<'_>) -> Kernel {
    let seed = load("a0", site.operands[0].0, "0u");
    let body = format!(
        r#"  let seed = {seed};
  let golden = vec2<u32>(0x7F4A7C15u, 0x9E3779B9u);
  let z0 = add64(seed, i64_mul(vec2<u32>(i + 1u, 0u), golden));
  let value = f32(splitmix(z0).y >> 8u) / 16777216.0;"#
    );
    let mut kernel = per_output(site, &body, false);
    kernel.source.push_str(
        r#"
fn add64(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> { return i64_add(a, b); }
fn xorshift(z: vec2<u32>, s: u32) -> vec2<u32> {
  if (s >= 32u) { return vec2<u32>(z.x ^ (z.y >> (s - 32u)), z.y); }
  return vec2<u32>(z.x ^ ((z.x >> s) | (z.y << (32u - s))), z.y ^ (z.y >> s));
}
fn splitmix(z0: vec2<u32>) -> vec2<u32> {
  var z = xorshift(z0, 30u);
  z = i64_mul(z, vec2<u32>(0x1CE4E5B9u, 0xBF58476Du));
  z = xorshift(z, 27u);
  z = i64_mul(z, vec2<u32>(0x133111EBu, 0x94D049BBu));
  return xorshift(z, 31u);
}
"#,
    );
    kernel
}
