//! Fixed-point arithmetic and the wire's bit packing.
//!
//! A device clips each coordinate of its update to [−clip, clip], scales it
//! to `levels` fixed-point steps per side, rounds stochastically (up with
//! probability equal to the fraction, so the rounding is unbiased), and
//! multiplies by its capped sample count. The last element of the vector is
//! that weight itself, so the server learns Σwᵢ the same way it learns
//! Σwᵢ·Δᵢ: only as a sum. Values live in Z_{2^b} as two's complement.

use rand::Rng;

use super::SecAggError;
use super::params::Plan;

/// The device's input to the masking stage: the weighted, quantized update
/// followed by the weight, each reduced modulo 2^b.
pub fn quantize<R: Rng + ?Sized>(
    plan: &Plan,
    delta: &[f32],
    num_samples: u64,
    rng: &mut R,
) -> Result<Vec<u32>, SecAggError> {
    if delta.len() != plan.update_len {
        return Err(SecAggError::invalid(format!(
            "the update has {} values, the round expects {}",
            delta.len(),
            plan.update_len
        )));
    }
    if num_samples == 0 {
        return Err(SecAggError::invalid(
            "an update trained on zero samples has no weight".to_string(),
        ));
    }
    let weight = num_samples.min(plan.max_weight) as i64;
    let scale = plan.levels as f64 / plan.clip;
    let mask = plan.modulus_mask();
    let mut out = Vec::with_capacity(plan.masked_len());
    for (index, &value) in delta.iter().enumerate() {
        if !value.is_finite() {
            return Err(SecAggError::invalid(format!(
                "update element {index} is {value}; only finite values can be aggregated"
            )));
        }
        let scaled = f64::from(value).clamp(-plan.clip, plan.clip) * scale;
        let floor = scaled.floor();
        let up = rng.random::<f64>() < scaled - floor;
        let level = (floor as i64 + i64::from(up)).clamp(-plan.levels, plan.levels);
        out.push(((level * weight) as u32) & mask);
    }
    out.push(weight as u32 & mask);
    Ok(out)
}

/// Turns the unmasked sum back into Σwᵢ·Δᵢ (in the update's units) and Σwᵢ.
pub fn decode_sum(plan: &Plan, sum: &[u32]) -> Result<(Vec<f64>, u64), SecAggError> {
    if sum.len() != plan.masked_len() {
        return Err(SecAggError::invalid(format!(
            "the aggregate has {} values, the round expects {}",
            sum.len(),
            plan.masked_len()
        )));
    }
    let bits = plan.bits;
    let mask = plan.modulus_mask();
    let half = 1i64 << (bits - 1);
    let signed = |raw: u32| {
        let v = i64::from(raw & mask);
        if v >= half { v - (1i64 << bits) } else { v }
    };
    let step = plan.clip / plan.levels as f64;
    let (values, weight) = sum.split_at(plan.update_len);
    let weight_total = u64::from(weight[0] & mask);
    Ok((
        values
            .iter()
            .map(|&raw| signed(raw) as f64 * step)
            .collect(),
        weight_total,
    ))
}

/// Packs each value's low `bits` bits into a little-endian bit stream.
pub fn pack(values: &[u32], bits: u32) -> Vec<u8> {
    debug_assert!((1..=32).contains(&bits));
    if bits == 32 {
        return values.iter().flat_map(|v| v.to_le_bytes()).collect();
    }
    let mut out = Vec::with_capacity((values.len() * bits as usize).div_ceil(8));
    let mask = (1u64 << bits) - 1;
    let (mut buffer, mut filled) = (0u64, 0u32);
    for &value in values {
        buffer |= (u64::from(value) & mask) << filled;
        filled += bits;
        while filled >= 8 {
            out.push(buffer as u8);
            buffer >>= 8;
            filled -= 8;
        }
    }
    if filled > 0 {
        out.push(buffer as u8);
    }
    out
}

/// acc[i] += the i-th packed value, modulo 2³². `packed` must hold exactly
/// `acc.len()` values, with zero padding bits.
pub fn add_packed(acc: &mut [u32], packed: &[u8], bits: u32) -> Result<(), SecAggError> {
    let expected = (acc.len() * bits as usize).div_ceil(8);
    if packed.len() != expected {
        return Err(SecAggError::invalid(format!(
            "the packed vector is {} bytes; {} values at {bits} bits take {expected}",
            packed.len(),
            acc.len()
        )));
    }
    if bits == 32 {
        for (a, w) in acc.iter_mut().zip(packed.chunks_exact(4)) {
            *a = a.wrapping_add(u32::from_le_bytes([w[0], w[1], w[2], w[3]]));
        }
        return Ok(());
    }
    let mask = (1u64 << bits) - 1;
    let (mut buffer, mut filled) = (0u64, 0u32);
    let mut bytes = packed.iter();
    for a in acc.iter_mut() {
        while filled < bits {
            // The length check above guarantees enough bytes.
            buffer |= u64::from(*bytes.next().unwrap_or(&0)) << filled;
            filled += 8;
        }
        *a = a.wrapping_add((buffer & mask) as u32);
        buffer >>= bits;
        filled -= bits;
    }
    if buffer != 0 {
        return Err(SecAggError::invalid(
            "the packed vector's padding bits are not zero".to_string(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::secagg::params::SecAggConfig;
    use rand::SeedableRng;

    #[test]
    fn packing_round_trips_at_every_width() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        for bits in 1..=32u32 {
            let mask = if bits == 32 {
                u32::MAX
            } else {
                (1 << bits) - 1
            };
            let values: Vec<u32> = (0..37).map(|_| rng.random::<u32>() & mask).collect();
            let packed = pack(&values, bits);
            assert_eq!(packed.len(), (37 * bits as usize).div_ceil(8));
            let mut acc = vec![0u32; 37];
            add_packed(&mut acc, &packed, bits).unwrap();
            assert_eq!(acc, values, "bits = {bits}");
        }
    }

    #[test]
    fn stochastic_rounding_is_unbiased_and_weights_add_up() {
        let config = SecAggConfig {
            enabled: true,
            clip: 1.0,
            bits: 32,
            max_weight: 4,
            ..SecAggConfig::default()
        };
        let trials = 2000;
        let plan = config.plan(trials, 3).unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(2);
        let delta = [0.3f32, -2.0, 1e-7];
        let mut sum = vec![0u32; 4];
        for _ in 0..trials {
            let q = quantize(&plan, &delta, 3, &mut rng).unwrap();
            for (s, v) in sum.iter_mut().zip(q) {
                *s = s.wrapping_add(v);
            }
        }
        let (values, weight) = decode_sum(&plan, &sum).unwrap();
        assert_eq!(weight, 3 * trials as u64);
        let mean = |i: usize| values[i] / weight as f64;
        assert!((mean(0) - 0.3).abs() < 1e-4, "{}", mean(0));
        assert_eq!(mean(1), -1.0, "clipped");
        assert!(mean(2).abs() < 1e-5);
    }

    #[test]
    fn non_finite_values_and_wrong_lengths_are_refused() {
        let plan = SecAggConfig::default().plan(10, 2).unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let error = quantize(&plan, &[1.0, f32::NAN], 1, &mut rng).unwrap_err();
        assert!(error.to_string().contains("element 1 is NaN"), "{error}");
        assert!(quantize(&plan, &[1.0], 1, &mut rng).is_err());
        let mut acc = vec![0u32; 3];
        assert!(add_packed(&mut acc, &[0u8; 4], 12).is_err(), "short");
        assert!(
            add_packed(&mut acc, &[0, 0, 0, 0, 0xF0], 12).is_err(),
            "dirty padding"
        );
    }
}
