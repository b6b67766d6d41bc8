//! Mask expansion: a 16-byte seed becomes a vector of pseudorandom u32 words
//! by AES-128 in counter mode, added to (or subtracted from) an accumulator
//! in place.
//!
//! The accumulator works in wrapping u32 arithmetic, which is arithmetic
//! modulo 2³²; because 2^b divides 2³², reducing modulo 2^b at the end gives
//! the same result as reducing after every step. AES-128 rather than
//! AES-256: the seeds are 128-bit, and ten rounds instead of fourteen is
//! most of the server's unmasking time.

use aes::Aes128;
use ctr::cipher::{KeyIvInit, StreamCipher};

/// Words expanded per step; 16 KiB stays in the first-level cache.
const CHUNK_WORDS: usize = 4096;

pub type Seed = [u8; 16];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sign {
    Add,
    Subtract,
}

impl Sign {
    pub fn flip(self) -> Sign {
        match self {
            Sign::Add => Sign::Subtract,
            Sign::Subtract => Sign::Add,
        }
    }
}

/// acc ← acc ± PRG(seed), element-wise, modulo 2³².
pub fn apply(acc: &mut [u32], seed: &Seed, sign: Sign) {
    let mut cipher = ctr::Ctr128LE::<Aes128>::new(seed.into(), &[0u8; 16].into());
    let mut keystream = [0u8; CHUNK_WORDS * 4];
    for words in acc.chunks_mut(CHUNK_WORDS) {
        let bytes = &mut keystream[..words.len() * 4];
        bytes.fill(0);
        cipher.apply_keystream(bytes);
        let pairs = words.iter_mut().zip(bytes.chunks_exact(4));
        match sign {
            Sign::Add => pairs.for_each(|(w, k)| {
                *w = w.wrapping_add(u32::from_le_bytes([k[0], k[1], k[2], k[3]]));
            }),
            Sign::Subtract => pairs.for_each(|(w, k)| {
                *w = w.wrapping_sub(u32::from_le_bytes([k[0], k[1], k[2], k[3]]));
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adding_then_subtracting_a_mask_restores_the_vector() {
        let original: Vec<u32> = (0..10_000).map(|i| i * 7).collect();
        let mut v = original.clone();
        apply(&mut v, &[9; 16], Sign::Add);
        assert_ne!(v, original);
        let changed = v.iter().zip(&original).filter(|(a, b)| a != b).count();
        assert!(changed > 9_990, "the mask must touch nearly every element");
        apply(&mut v, &[9; 16], Sign::Subtract);
        assert_eq!(v, original);
    }

    #[test]
    fn masks_from_different_seeds_differ() {
        let mut a = vec![0u32; 64];
        let mut b = vec![0u32; 64];
        apply(&mut a, &[1; 16], Sign::Add);
        apply(&mut b, &[2; 16], Sign::Add);
        assert_ne!(a, b);
    }
}
