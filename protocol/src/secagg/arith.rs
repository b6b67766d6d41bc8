//! Fixed-point arithmetic and the wire's bit packing.
//!
//! A device clips each coordinate of its update to [−clip, clip], scales it
//! to `levels` fixed-point steps per side, rounds stochastically (up with
//! probability equal to the fraction, so the rounding is unbiased), and
//! multiplies by its capped sample count. The last element of the vector is
//! that weight itself, so the server learns Σwᵢ the same way it learns
//! Σwᵢ·Δᵢ: only as a sum. Values live in Z_{2^b} as two's complement.

use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};

use super::SecAggError;
use super::noise::SkellamShares;
use super::params::Plan;

/// The device's input to the masking stage: the weighted, quantized update
/// followed by the weight, each reduced modulo 2^b. Value 2i rounds with
/// the low half of the coin generator's draw i, value 2i + 1 with its high
/// half.
pub fn quantize<R: Rng + ?Sized>(
    plan: &Plan,
    delta: &[f32],
    num_samples: u64,
    rng: &mut R,
) -> Result<Vec<u32>, SecAggError> {
    let update = Quantizer::new(plan, delta, num_samples)?;
    let mut caller = &mut *rng;
    let mut coins = SmallRng::from_rng(&mut caller);
    let mut out = vec![0u32; plan.masked_len()];
    update.fill(0, &mut out, &mut coins);
    let mut noise = rand::rngs::StdRng::from_rng(&mut caller);
    update.add_noise(0, &mut out, &mut noise);
    Ok(out)
}

/// An update checked against a round's plan, rounded a window at a time
/// where it is masked ([`crate::secagg::client::Client::masked_update`]),
/// so that no quantized vector of the model's size is ever written.
pub struct Quantizer<'a> {
    plan: Plan,
    delta: &'a [f32],
    weight: i64,
    /// Q32.32 fixed point: a coordinate scaled to levels carries its
    /// fraction in the low 32 bits, so that rounding is a shift and one
    /// comparison with the coin, with no float floor or compare (half the
    /// time of rounding in f64, measured).
    fixed_per_unit: f64,
    fixed_limit: f64,
    /// A private round's noise shares ([`Plan::device_noise`]).
    shares: Option<SkellamShares>,
}

impl<'a> Quantizer<'a> {
    /// Refuses an update of the wrong length, with no samples, or with a
    /// value that is not finite.
    pub fn new(plan: &Plan, delta: &'a [f32], num_samples: u64) -> Result<Self, SecAggError> {
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
        if let Some(index) = first_non_finite(delta) {
            return Err(SecAggError::invalid(format!(
                "update element {index} is {}; only finite values can be aggregated",
                delta[index]
            )));
        }
        // |levels| < 2³¹ (the plan checks its ring), so ±levels·2³² fits
        // in an i64.
        debug_assert!(plan.levels < 1 << 31);
        let shares = plan
            .device_noise
            .as_ref()
            .map(SkellamShares::new)
            .transpose()?;
        Ok(Quantizer {
            plan: plan.clone(),
            delta,
            weight: num_samples.min(plan.max_weight) as i64,
            fixed_per_unit: plan.levels as f64 / plan.clip * TWO_TO_32,
            fixed_limit: plan.levels as f64 * TWO_TO_32,
            shares,
        })
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Words `first..first + out.len()` of the input, the values rounded in
    /// order with coins from `coins`, two a draw (a last odd one takes a
    /// draw's high half). The rounding needs unbiased coins, not secret
    /// ones: the masks hide the input, rounding included.
    pub fn fill(&self, first: usize, out: &mut [u32], coins: &mut SmallRng) {
        let mask = self.plan.modulus_mask();
        let values_end = self.plan.update_len.saturating_sub(first).min(out.len());
        let (values, weight_slot) = out.split_at_mut(values_end);
        let delta = &self.delta[first.min(self.delta.len())..][..values_end];
        let mut value_pairs = values.chunks_exact_mut(2);
        let mut delta_pairs = delta.chunks_exact(2);
        for (slots, pair) in (&mut value_pairs).zip(&mut delta_pairs) {
            let draw = coins.next_u64();
            slots[0] = self.round(pair[0], draw as u32) & mask;
            slots[1] = self.round(pair[1], (draw >> 32) as u32) & mask;
        }
        if let ([slot], [value]) = (value_pairs.into_remainder(), delta_pairs.remainder()) {
            *slot = self.round(*value, coins.next_u32()) & mask;
        }
        // The weight is the word after the values, and the last.
        debug_assert!(weight_slot.len() <= 1);
        if let Some(slot) = weight_slot.first_mut() {
            *slot = self.weight as u32 & mask;
        }
    }

    /// Whether the round asks this device for noise shares.
    pub fn is_private(&self) -> bool {
        self.shares.is_some()
    }

    /// Adds a private round's noise share to each value among words
    /// `first..first + out.len()` (not to the weight), drawn from `noise`,
    /// which must be secret: whoever could replay it could subtract the
    /// noise. Nothing in a round without noise.
    pub fn add_noise<R: Rng + ?Sized>(&self, first: usize, out: &mut [u32], noise: &mut R) {
        let Some(shares) = &self.shares else {
            return;
        };
        let mask = self.plan.modulus_mask();
        let values_end = self.plan.update_len.saturating_sub(first).min(out.len());
        for slot in &mut out[..values_end] {
            // Two's complement: adding the share modulo 2³², then reducing
            // to b bits, adds it modulo 2^b.
            *slot = slot.wrapping_add(shares.sample(noise) as u32) & mask;
        }
    }

    /// The value's level times the weight, modulo 2³².
    #[inline(always)]
    fn round(&self, value: f32, coin: u32) -> u32 {
        // Truncated toward zero: within 2⁻³² of a level of the value.
        let fixed = (f64::from(value) * self.fixed_per_unit)
            .clamp(-self.fixed_limit, self.fixed_limit) as i64;
        // Up with probability (fraction · 2³²) / 2³²; never past ±levels,
        // whose fraction is zero.
        let up = (fixed as u32) > coin;
        let level = (fixed >> 32) + i64::from(up);
        (level * self.weight) as u32
    }
}

const TWO_TO_32: f64 = 4_294_967_296.0;

/// Values checked together by [`first_non_finite`].
const FINITE_CHECK_RUN: usize = 256;

/// The index of the first value that is not finite. Runs of values are
/// checked with no early exit, which compiles to vector compares (a
/// search that stops at the first hit checks one value at a time); only
/// a run that holds one is searched.
fn first_non_finite(values: &[f32]) -> Option<usize> {
    values
        .chunks(FINITE_CHECK_RUN)
        .enumerate()
        .find(|(_, run)| run.iter().fold(false, |bad, v| bad | !v.is_finite()))
        .and_then(|(index, run)| {
            let within = run.iter().position(|v| !v.is_finite())?;
            Some(index * FINITE_CHECK_RUN + within)
        })
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
    let mut out = vec![0u8; packed_len(values.len(), bits)];
    pack_to(values, bits, &mut out);
    out
}

/// Bytes that `count` values take at `bits` bits.
pub fn packed_len(count: usize, bits: u32) -> usize {
    (count * bits as usize).div_ceil(8)
}

/// [`pack`] into `out`, which must be exactly [`packed_len`] bytes: a
/// window of a message, so that the masked input is written once, where
/// it is sent from.
pub fn pack_to(values: &[u32], bits: u32, out: &mut [u8]) {
    debug_assert!((1..=32).contains(&bits));
    assert_eq!(out.len(), packed_len(values.len(), bits), "packed length");
    if bits == 32 {
        for (bytes, value) in out.chunks_exact_mut(4).zip(values) {
            bytes.copy_from_slice(&value.to_le_bytes());
        }
        return;
    }
    let mask = (1u64 << bits) - 1;
    // Fewer than 32 bits wait in the buffer between values, so adding one
    // of at most 31 never overflows it; whole 32-bit words leave at once.
    let (mut buffer, mut filled, mut written) = (0u64, 0u32, 0usize);
    for &value in values {
        buffer |= (u64::from(value) & mask) << filled;
        filled += bits;
        if filled >= 32 {
            out[written..written + 4].copy_from_slice(&(buffer as u32).to_le_bytes());
            written += 4;
            buffer >>= 32;
            filled -= 32;
        }
    }
    let tail = &mut out[written..];
    tail.copy_from_slice(&buffer.to_le_bytes()[..tail.len()]);
}

/// acc[i] += the i-th packed value, modulo 2³². `packed` must hold exactly
/// `acc.len()` values, with zero padding bits; both are checked before
/// `acc` is touched, so a refused vector leaves it as it was.
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
    // The bits after the last value, in the last byte, must be zero.
    let padding = packed.len() * 8 - acc.len() * bits as usize;
    if padding > 0 && packed[packed.len() - 1] >> (8 - padding) != 0 {
        return Err(SecAggError::invalid(
            "the packed vector's padding bits are not zero".to_string(),
        ));
    }
    let width = bits as usize;
    let mask = (1u64 << bits) - 1;
    // Value i starts at bit i·b; the 8 bytes from byte ⌊i·b/8⌋ hold all of
    // it (b + 7 ≤ 64). Values whose window fits in `packed` read it whole.
    let whole = if packed.len() >= 8 {
        (((packed.len() - 7) * 8 - 1) / width + 1).min(acc.len())
    } else {
        0
    };
    let (head, tail) = acc.split_at_mut(whole);
    for (i, a) in head.iter_mut().enumerate() {
        let bit = i * width;
        let start = bit / 8;
        let window = u64::from_le_bytes(
            packed[start..start + 8]
                .try_into()
                .expect("an 8-byte window"),
        );
        *a = a.wrapping_add(((window >> (bit % 8)) & mask) as u32);
    }
    for (i, a) in tail.iter_mut().enumerate() {
        let bit = (whole + i) * width;
        let start = bit / 8;
        let mut window = [0u8; 8];
        let available = &packed[start..packed.len().min(start + 8)];
        window[..available.len()].copy_from_slice(available);
        *a = a.wrapping_add(((u64::from_le_bytes(window) >> (bit % 8)) & mask) as u32);
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
            for len in [0, 1, 7, 37, 1000] {
                let values: Vec<u32> = (0..len).map(|_| rng.random::<u32>() & mask).collect();
                let packed = pack(&values, bits);
                assert_eq!(packed.len(), (len * bits as usize).div_ceil(8));
                let start: Vec<u32> = (0..len).map(|_| rng.random::<u32>()).collect();
                let mut acc = start.clone();
                add_packed(&mut acc, &packed, bits).unwrap();
                let expected: Vec<u32> = start
                    .iter()
                    .zip(&values)
                    .map(|(s, v)| s.wrapping_add(*v))
                    .collect();
                assert_eq!(acc, expected, "bits = {bits}, len = {len}");
            }
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
        let plan = config.plan(trials, 4).unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(2);
        let delta = [0.3f32, -2.0, 1e-7, -0.3];
        let mut sum = vec![0u32; 5];
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
        assert!((mean(3) + 0.3).abs() < 1e-4, "{}", mean(3));
    }

    #[test]
    fn values_on_a_level_never_move_and_clipped_values_stay_at_the_end() {
        let config = SecAggConfig {
            enabled: true,
            clip: 2.0,
            ..SecAggConfig::default()
        };
        let plan = config.plan(100, 10).unwrap();
        let step = plan.clip / plan.levels as f64;
        // Whole levels (the fraction is zero: no coin moves them), the
        // clip's ends, and values past them.
        let delta = [
            0.0f32,
            (3.0 * step) as f32,
            (-5.0 * step) as f32,
            2.0,
            -2.0,
            7.5,
            -1e30,
        ];
        let expected = [
            0,
            3,
            -5,
            plan.levels,
            -plan.levels,
            plan.levels,
            -plan.levels,
        ];
        let mut rng = rand::rngs::StdRng::seed_from_u64(4);
        for _ in 0..200 {
            let mut plan = plan.clone();
            plan.update_len = delta.len();
            let q = quantize(&plan, &delta, 1, &mut rng).unwrap();
            let (values, _) = decode_sum(&plan, &q).unwrap();
            for (i, (&value, &level)) in values.iter().zip(&expected).enumerate() {
                assert_eq!((value / step).round() as i64, level, "value {i}");
                assert!(
                    (value - level as f64 * step).abs() < step * 1e-6,
                    "value {i}"
                );
            }
        }
    }

    #[test]
    fn every_value_takes_its_own_coin() {
        // The rule, one value at a time: value 2i rounds with draw i's low
        // half, 2i+1 with its high half, a last odd value with a fresh
        // draw's high half; the same seed gives the same input.
        for len in [1, 2, 3, 1023, 1024, 1025, 2047, 2048, 2049, 5000] {
            let config = SecAggConfig {
                enabled: true,
                clip: 1.0,
                ..SecAggConfig::default()
            };
            let mut plan = config.plan(100, 10).unwrap();
            plan.update_len = len;
            let delta: Vec<f32> = (0..len)
                .map(|i| ((i * 37) % 200) as f32 / 100.0 - 1.0)
                .collect();
            let quantized =
                quantize(&plan, &delta, 7, &mut rand::rngs::StdRng::seed_from_u64(9)).unwrap();
            let mut coins = SmallRng::from_rng(&mut rand::rngs::StdRng::seed_from_u64(9));
            let mut expected_coins = Vec::with_capacity(len);
            while expected_coins.len() + 1 < len {
                let draw = coins.next_u64();
                expected_coins.extend([draw as u32, (draw >> 32) as u32]);
            }
            if expected_coins.len() < len {
                expected_coins.push(coins.next_u32());
            }
            let scale = plan.levels as f64 / plan.clip;
            for (i, (&q, &coin)) in quantized.iter().zip(&expected_coins).enumerate() {
                // Up when the coin is below the fraction in 2⁻³² units;
                // a coin within one unit of it may go either way (the
                // fixed point truncates the fraction).
                let scaled = f64::from(delta[i]) * scale;
                let threshold = (scaled - scaled.floor()) * TWO_TO_32;
                let level = |up: bool| ((scaled.floor() as i64 + i64::from(up)) * 7) as u32;
                let close = (f64::from(coin) - threshold).abs() <= 1.0;
                let up = f64::from(coin) < threshold;
                assert!(
                    q == level(up) & plan.modulus_mask()
                        || close && q == level(!up) & plan.modulus_mask(),
                    "len {len}, value {i}"
                );
            }
            assert_eq!(quantized[len], 7, "the weight follows the values");
        }
    }

    #[test]
    fn the_first_non_finite_value_is_found_in_any_run() {
        let len = FINITE_CHECK_RUN * 3 + 17;
        assert_eq!(first_non_finite(&vec![1.5f32; len]), None);
        assert_eq!(first_non_finite(&[]), None);
        let edges = [
            0,
            1,
            FINITE_CHECK_RUN - 1,
            FINITE_CHECK_RUN,
            2 * FINITE_CHECK_RUN + 5,
            len - 1,
        ];
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            for &at in &edges {
                let mut values = vec![-2.0f32; len];
                values[at] = bad;
                // A later one does not hide the first.
                values[len - 1] = f32::NAN;
                assert_eq!(first_non_finite(&values), Some(at), "{bad} at {at}");
            }
        }
        // The largest finite values and subnormals are finite.
        let extremes = [f32::MAX, f32::MIN, f32::MIN_POSITIVE / 2.0, -0.0];
        assert_eq!(first_non_finite(&extremes), None);
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
            add_packed(&mut acc, &[1, 2, 3, 4, 0xF0], 12).is_err(),
            "dirty padding"
        );
        assert_eq!(acc, [0; 3], "a refused vector adds nothing");
    }
}
