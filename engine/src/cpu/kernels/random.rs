//! Counter-based uniform random numbers: element `i` depends only on the
//! seed and `i`, so every backend (and every thread split) agrees.

use rayon::prelude::*;

use super::Arg;
use super::tensor::{PAR_THRESHOLD, checked_len, from_vec, tensor};
use crate::error::KernelError;
use crate::value::Value;

/// The golden-ratio increment of splitmix64.
const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// 2^24: the top 24 bits of a draw become an f32 in [0, 1) exactly.
const TWO_POW_24: f32 = 16_777_216.0;

/// f32 values in [0, 1) of `shape` from an i64 scalar seed.
pub fn random_uniform(seed: Arg<'_>, shape: &[usize]) -> Result<Value, KernelError> {
    let seed = tensor::<i64>(seed, "seed")?;
    let seed = match (seed.len(), seed.view().first()) {
        // The bits of the seed, reinterpreted: negative seeds are valid.
        (1, Some(&s)) => s as u64,
        _ => {
            return Err(KernelError::Shape(format!(
                "seed must be a scalar, got shape {:?}",
                seed.shape()
            )));
        }
    };
    let len = checked_len(shape)?;
    let draw = |i: usize| uniform(seed, i as u64);
    let values: Vec<f32> = if len >= PAR_THRESHOLD {
        super::hot::keep_hot();
        (0..len).into_par_iter().map(draw).collect()
    } else {
        (0..len).map(draw).collect()
    };
    from_vec(shape, values).map(Value::F32)
}

/// Element `index` of the stream for `seed`, as specified in the op set.
fn uniform(seed: u64, index: u64) -> f32 {
    let z = seed.wrapping_add(index.wrapping_add(1).wrapping_mul(GAMMA));
    (splitmix64(z) >> 40) as f32 / TWO_POW_24
}

fn splitmix64(mut z: u64) -> u64 {
    z ^= z >> 30;
    z = z.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z ^= z >> 27;
    z = z.wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
