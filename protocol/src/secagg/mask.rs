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
use ctr::CtrCore;
use ctr::cipher::{Block, KeyIvInit, StreamCipherCore};
use ctr::flavors::Ctr128LE;
use zeroize::Zeroize;

/// AES blocks expanded per step: 2 KiB of keystream, which stays in the
/// first-level cache between being written and being added.
const CHUNK_BLOCKS: usize = 128;
const WORDS_PER_BLOCK: usize = 4;

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
///
/// PRG(seed) is the AES-128-CTR keystream under key `seed`, a zero nonce
/// and a little-endian 128-bit block counter from zero, read as
/// little-endian u32 words.
pub fn apply(acc: &mut [u32], seed: &Seed, sign: Sign) {
    let mut one = [(*seed, sign)];
    apply_many_at(acc, 0, &one);
    one[0].0.zeroize();
}

/// Every mask of `masks` applied to a window of the vector: `acc` holds its
/// words from `offset_words` on, which must be a whole number of keystream
/// blocks (a multiple of 4), so that the window's keystream starts at a
/// block.
///
/// The masks are applied chunk by chunk, all of them to one 2 KiB chunk
/// before the next: the chunk stays in the first-level cache while every
/// mask's keystream is written to a small buffer (no zero-fill and XOR) and
/// added from there, so the vector crosses memory once however many masks
/// there are, not once a mask. (Where AES-NI, not memory, is the limit,
/// as on the 2-core EPYC of `benches/secagg.rs`, that measures the same as
/// a pass a mask.) The buffer is wiped at the end.
pub fn apply_many_at(acc: &mut [u32], offset_words: usize, masks: &[(Seed, Sign)]) {
    assert!(
        offset_words.is_multiple_of(WORDS_PER_BLOCK),
        "a mask window starts at a keystream block"
    );
    // The counter block is the little-endian block index from zero.
    let first_block = ((offset_words / WORDS_PER_BLOCK) as u128).to_le_bytes();
    let mut cores: Vec<(CtrCore<Aes128, Ctr128LE>, Sign)> = masks
        .iter()
        .map(|(seed, sign)| (CtrCore::new(seed.into(), &first_block.into()), *sign))
        .collect();
    let mut keystream = [Block::<Aes128>::default(); CHUNK_BLOCKS];
    for words in acc.chunks_mut(CHUNK_BLOCKS * WORDS_PER_BLOCK) {
        let blocks = &mut keystream[..words.len().div_ceil(WORDS_PER_BLOCK)];
        for (core, sign) in &mut cores {
            // A 128-bit block counter cannot run out within one vector.
            core.write_keystream_blocks(blocks);
            match sign {
                Sign::Add => combine(words, blocks, u32::wrapping_add),
                Sign::Subtract => combine(words, blocks, u32::wrapping_sub),
            }
        }
    }
    // The keystream is the mask: leave none of it on the stack.
    for block in keystream.iter_mut() {
        block.as_mut_slice().zeroize();
    }
}

/// Words of the vector below which [`apply_all`] stays on the calling
/// thread: starting threads costs more than a few masks of this size.
const MIN_WORDS_PER_THREAD: usize = 1 << 16;

/// Applies every mask in `masks` to `acc`, the vector split by element
/// range over up to `threads` threads, each expanding its window of every
/// mask. The server's unmasking and a device's masking: many masks meet
/// one vector, and AES-CTR can start anywhere, so the work divides with no
/// coordination.
pub fn apply_all(acc: &mut [u32], masks: &[(Seed, Sign)], threads: usize) {
    let by_size = acc.len() / MIN_WORDS_PER_THREAD;
    let threads = threads.min(by_size).max(1);
    // Whole chunks per window, so that each window starts at a block.
    let step = CHUNK_BLOCKS * WORDS_PER_BLOCK;
    let window = acc.len().div_ceil(threads).div_ceil(step) * step;
    if threads == 1 || window >= acc.len() {
        apply_many_at(acc, 0, masks);
        return;
    }
    std::thread::scope(|scope| {
        for (index, part) in acc.chunks_mut(window).enumerate() {
            scope.spawn(move || apply_many_at(part, index * window, masks));
        }
    });
}

/// `words[i] = op(words[i], keystream word i)`. The keystream is read as
/// one flat run of little-endian words, with no per-block indexing, so the
/// loop compiles to vector adds (in a profiled secure round of 1M values
/// the add took about half the time of the VAES keystream it adds).
#[inline(always)]
fn combine(words: &mut [u32], blocks: &[Block<Aes128>], op: impl Fn(u32, u32) -> u32) {
    let keystream = Block::<Aes128>::slice_as_flattened(blocks);
    debug_assert!(keystream.len() >= words.len() * 4);
    for (w, k) in words.iter_mut().zip(keystream.chunks_exact(4)) {
        *w = op(*w, u32::from_le_bytes([k[0], k[1], k[2], k[3]]));
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
    fn the_mask_is_the_aes_128_ctr_keystream() {
        use ctr::cipher::StreamCipher;
        // AES-128 under the zero key of the zero block (FIPS-197 style
        // known answer): 66e94bd4 ef8a2c3b 884cfa59 ca342b2e.
        let mut first = vec![0u32; 4];
        apply(&mut first, &[0; 16], Sign::Add);
        assert_eq!(first, [0xd44b_e966, 0x3b2c_8aef, 0x59fa_4c88, 0x2e2b_34ca]);
        // Every length, chunk boundary and partial last block matches the
        // byte keystream of the ctr crate's stream cipher.
        for len in [0, 1, 3, 4, 5, 1023, 1024, 1025, 1027, 4096, 10_001] {
            let seed = [len as u8 ^ 0x5a; 16];
            let mut bytes = vec![0u8; len * 4];
            ctr::Ctr128LE::<Aes128>::new(&seed.into(), &[0u8; 16].into())
                .apply_keystream(&mut bytes);
            let expected: Vec<u32> = bytes
                .chunks_exact(4)
                .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
                .collect();
            let start: Vec<u32> = (0..len as u32)
                .map(|i| i.wrapping_mul(2_654_435_761))
                .collect();
            let mut added = start.clone();
            apply(&mut added, &seed, Sign::Add);
            let mut subtracted = start.clone();
            apply(&mut subtracted, &seed, Sign::Subtract);
            for i in 0..len {
                assert_eq!(
                    added[i],
                    start[i].wrapping_add(expected[i]),
                    "len {len}, word {i}"
                );
                assert_eq!(
                    subtracted[i],
                    start[i].wrapping_sub(expected[i]),
                    "len {len}, word {i}"
                );
            }
        }
    }

    #[test]
    fn masks_applied_over_threads_equal_masks_applied_in_turn() {
        // Lengths around the window and chunk boundaries, and a partial
        // last block.
        for len in [
            5,
            MIN_WORDS_PER_THREAD * 3 + 1,
            MIN_WORDS_PER_THREAD * 4 + 4097,
        ] {
            let start: Vec<u32> = (0..len as u32).map(|i| i.wrapping_mul(40_503)).collect();
            let masks: Vec<(Seed, Sign)> = (0..5u8)
                .map(|i| {
                    (
                        [i; 16],
                        if i % 2 == 0 {
                            Sign::Add
                        } else {
                            Sign::Subtract
                        },
                    )
                })
                .collect();
            let mut in_turn = start.clone();
            for (seed, sign) in &masks {
                apply(&mut in_turn, seed, *sign);
            }
            for threads in [1, 2, 3, 8] {
                let mut parallel = start.clone();
                apply_all(&mut parallel, &masks, threads);
                assert!(parallel == in_turn, "len {len}, {threads} threads");
            }
        }
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
