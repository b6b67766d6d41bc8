//! Shamir secret sharing, t-of-k, over the prime field GF(2⁶¹ − 1).
//!
//! A secret of any length is cut into 7-byte chunks (56 bits, so every
//! chunk is a field element) and each chunk gets its own random polynomial
//! of degree t − 1. Fewer than t shares say nothing about any chunk; t
//! shares give all of them back by Lagrange interpolation at zero.
//! A Mersenne prime keeps reduction to a shift and an add.

use rand::Rng;

use super::SecAggError;

/// The field's modulus, 2⁶¹ − 1.
pub const PRIME: u64 = (1 << 61) - 1;
const CHUNK_BYTES: usize = 7;

/// The largest secret this module shares: the self-mask seed and the
/// X25519 secret key are both 32 bytes.
pub const MAX_SECRET_BYTES: usize = 64;

/// One share: the evaluation point and the polynomials' values there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Share {
    pub x: u64,
    pub ys: Vec<u64>,
}

pub fn chunks_for(secret_len: usize) -> usize {
    secret_len.div_ceil(CHUNK_BYTES)
}

fn reduce(value: u128) -> u64 {
    // value = hi·2⁶¹ + lo ≡ hi + lo (mod 2⁶¹ − 1).
    let folded = (value & u128::from(PRIME)) + (value >> 61);
    let folded = (folded & u128::from(PRIME)) + (folded >> 61);
    let folded = folded as u64;
    if folded >= PRIME {
        folded - PRIME
    } else {
        folded
    }
}

fn add(a: u64, b: u64) -> u64 {
    reduce(u128::from(a) + u128::from(b))
}

fn sub(a: u64, b: u64) -> u64 {
    reduce(u128::from(a) + u128::from(PRIME - b))
}

fn mul(a: u64, b: u64) -> u64 {
    reduce(u128::from(a) * u128::from(b))
}

fn pow(mut base: u64, mut exponent: u64) -> u64 {
    let mut result = 1;
    while exponent > 0 {
        if exponent & 1 == 1 {
            result = mul(result, base);
        }
        base = mul(base, base);
        exponent >>= 1;
    }
    result
}

fn inverse(a: u64) -> u64 {
    debug_assert_ne!(a, 0);
    pow(a, PRIME - 2)
}

/// The evaluation point of a device's share: its id plus one, so that no
/// device ever holds the secret itself (the value at zero).
pub fn point_of(device_id: u64) -> Result<u64, SecAggError> {
    if device_id >= PRIME - 1 {
        return Err(SecAggError::invalid(format!(
            "device id {device_id} is too large to be a share point"
        )));
    }
    Ok(device_id + 1)
}

/// Splits `secret` into one share per point in `xs`, any `threshold` of
/// which rebuild it.
pub fn split<R: Rng + ?Sized>(
    secret: &[u8],
    xs: &[u64],
    threshold: usize,
    rng: &mut R,
) -> Result<Vec<Share>, SecAggError> {
    if secret.is_empty() || secret.len() > MAX_SECRET_BYTES {
        return Err(SecAggError::invalid(format!(
            "a shared secret must be 1 to {MAX_SECRET_BYTES} bytes, got {}",
            secret.len()
        )));
    }
    if threshold == 0 || threshold > xs.len() {
        return Err(SecAggError::invalid(format!(
            "threshold {threshold} needs between 1 and {} share holders",
            xs.len()
        )));
    }
    check_points(xs.iter().copied())?;
    let mut shares: Vec<Share> = xs
        .iter()
        .map(|&x| Share {
            x,
            ys: Vec::with_capacity(chunks_for(secret.len())),
        })
        .collect();
    let mut coefficients = vec![0u64; threshold];
    for chunk in secret.chunks(CHUNK_BYTES) {
        let mut bytes = [0u8; 8];
        bytes[..chunk.len()].copy_from_slice(chunk);
        coefficients[0] = u64::from_le_bytes(bytes);
        for coefficient in &mut coefficients[1..] {
            *coefficient = rng.random_range(0..PRIME);
        }
        for share in &mut shares {
            share.ys.push(evaluate(&coefficients, share.x));
        }
    }
    Ok(shares)
}

fn evaluate(coefficients: &[u64], x: u64) -> u64 {
    coefficients
        .iter()
        .rev()
        .fold(0, |acc, &c| add(mul(acc, x), c))
}

fn check_points(xs: impl Iterator<Item = u64>) -> Result<(), SecAggError> {
    let mut seen = std::collections::BTreeSet::new();
    for x in xs {
        if x == 0 || x >= PRIME {
            return Err(SecAggError::invalid(format!(
                "share point {x} is not a non-zero field element"
            )));
        }
        if !seen.insert(x) {
            return Err(SecAggError::invalid(format!(
                "share point {x} appears twice"
            )));
        }
    }
    Ok(())
}

/// Rebuilds a `secret_len`-byte secret from the first `threshold` shares.
pub fn reconstruct(
    shares: &[Share],
    threshold: usize,
    secret_len: usize,
) -> Result<Vec<u8>, SecAggError> {
    if threshold == 0 || shares.len() < threshold {
        return Err(SecAggError::invalid(format!(
            "{} shares cannot rebuild a secret that needs {threshold}",
            shares.len()
        )));
    }
    let used = &shares[..threshold];
    check_points(used.iter().map(|s| s.x))?;
    let chunks = chunks_for(secret_len);
    if let Some(bad) = used.iter().find(|s| s.ys.len() != chunks) {
        return Err(SecAggError::invalid(format!(
            "the share at point {} has {} chunks, a {secret_len}-byte secret has {chunks}",
            bad.x,
            bad.ys.len()
        )));
    }
    let weights = lagrange_at_zero(used);
    let mut secret = Vec::with_capacity(chunks * CHUNK_BYTES);
    for chunk in 0..chunks {
        let value = used
            .iter()
            .zip(&weights)
            .fold(0, |acc, (share, &w)| add(acc, mul(share.ys[chunk], w)));
        if value >= 1 << (8 * CHUNK_BYTES) {
            return Err(SecAggError::invalid(
                "the shares are inconsistent: a rebuilt chunk is out of range".to_string(),
            ));
        }
        secret.extend_from_slice(&value.to_le_bytes()[..CHUNK_BYTES]);
    }
    if secret[secret_len..].iter().any(|&b| b != 0) {
        return Err(SecAggError::invalid(
            "the shares are inconsistent: the rebuilt secret has stray bytes".to_string(),
        ));
    }
    secret.truncate(secret_len);
    Ok(secret)
}

/// λᵢ = Π_{j≠i} xⱼ / (xⱼ − xᵢ), so that f(0) = Σ λᵢ·f(xᵢ).
fn lagrange_at_zero(shares: &[Share]) -> Vec<u64> {
    shares
        .iter()
        .map(|si| {
            let (mut numerator, mut denominator) = (1u64, 1u64);
            for sj in shares.iter().filter(|sj| sj.x != si.x) {
                numerator = mul(numerator, sj.x);
                denominator = mul(denominator, sub(sj.x, si.x));
            }
            mul(numerator, inverse(denominator))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn any_threshold_subset_rebuilds_and_fewer_do_not() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let secret: Vec<u8> = (0..32u8).collect();
        let xs: Vec<u64> = (1..=9).map(|id| point_of(id * 13).unwrap()).collect();
        let shares = split(&secret, &xs, 5, &mut rng).unwrap();
        for start in 0..5 {
            let subset: Vec<Share> = shares[start..start + 5].to_vec();
            assert_eq!(reconstruct(&subset, 5, 32).unwrap(), secret);
        }
        // Four shares interpolate a degree-3 polynomial: not the secret.
        let short = reconstruct(&shares[..4], 4, 32);
        assert_ne!(short.ok(), Some(secret.clone()));
        assert!(reconstruct(&shares[..4], 5, 32).is_err());
    }

    #[test]
    fn a_tampered_share_is_caught_or_changes_the_secret() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(8);
        let secret = [0xAB; 32];
        let xs: Vec<u64> = (1..=4).collect();
        let mut shares = split(&secret, &xs, 3, &mut rng).unwrap();
        shares[0].ys[0] = add(shares[0].ys[0], 1);
        assert_ne!(reconstruct(&shares, 3, 32).ok(), Some(secret.to_vec()));
    }

    #[test]
    fn field_arithmetic_wraps_at_the_prime() {
        assert_eq!(add(PRIME - 1, 1), 0);
        assert_eq!(sub(0, 1), PRIME - 1);
        assert_eq!(mul(PRIME - 1, PRIME - 1), 1);
        assert_eq!(mul(inverse(12345), 12345), 1);
    }
}
