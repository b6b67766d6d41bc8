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
use aes::cipher::{Block, BlockCipherEncrypt, KeyInit};
use zeroize::Zeroize;

use super::arith;

/// AES blocks expanded per step: 8 KiB of keystream, which stays in the
/// first-level cache with the 8 KiB of the vector it is added to. Each
/// step costs the cipher a set-up (the VAES backend broadcasts its round
/// keys), so steps of 2 KiB took 1.12× the time of these (23 masks of 1M
/// words, one thread, interleaved runs).
const CHUNK_BLOCKS: usize = 512;
const WORDS_PER_BLOCK: usize = 4;
const CHUNK_WORDS: usize = CHUNK_BLOCKS * WORDS_PER_BLOCK;

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
/// The masks are applied chunk by chunk, all of them to one 8 KiB chunk
/// before the next: the chunk stays in the first-level cache while every
/// mask's keystream is written to a small buffer (no zero-fill and XOR) and
/// added from there, so the vector crosses memory once however many masks
/// there are, not once a mask. (Where AES-NI, not memory, is the limit,
/// as on the 2-core EPYC of `benches/secagg.rs`, that measures the same as
/// a pass a mask.) The buffer is wiped at the end.
pub fn apply_many_at(acc: &mut [u32], offset_words: usize, masks: &[(Seed, Sign)]) {
    let ciphers = ciphers(masks);
    let mut counters = Counters::new();
    let mut keystream = [Block::<Aes128>::default(); CHUNK_BLOCKS];
    let first_block = first_block(offset_words);
    for (index, words) in acc.chunks_mut(CHUNK_WORDS).enumerate() {
        let counters = counters.at(first_block + (index * CHUNK_BLOCKS) as u64, words.len());
        mask_chunk(&ciphers, counters, &mut keystream, words);
    }
    wipe(&mut keystream);
}

/// A device's masked input, written once, into its message: the vector of
/// `len` words is made chunk by chunk (`fill(first_word, chunk)`), every
/// mask is added to the chunk while it is in the first-level cache, and the
/// chunk is packed at `bits` into `packed`, which is exactly the packed
/// vector's bytes. Windows of the vector go to up to `threads` threads,
/// each with its own filler (`window_filler(first_word)`), so that making
/// the input, masking and packing all divide over the device's cores; and
/// no vector of the model's size is written besides the message.
pub fn fill_mask_pack<W, F>(
    len: usize,
    masks: &[(Seed, Sign)],
    bits: u32,
    threads: usize,
    packed: &mut [u8],
    window_filler: W,
) where
    W: Fn(usize) -> F + Sync,
    F: FnMut(usize, &mut [u32]),
{
    assert_eq!(packed.len(), arith::packed_len(len, bits), "packed length");
    let window = window_words(len, threads);
    if window >= len {
        fill_mask_pack_at(0, len, masks, bits, packed, window_filler(0));
        return;
    }
    // A chunk of 2,048 words packs to whole bytes at any width, so a window
    // of whole chunks starts at a byte.
    let window_bytes = window * bits as usize / 8;
    std::thread::scope(|scope| {
        for (index, bytes) in packed.chunks_mut(window_bytes).enumerate() {
            let first = index * window;
            let words = window.min(len - first);
            let window_filler = &window_filler;
            scope.spawn(move || {
                fill_mask_pack_at(first, words, masks, bits, bytes, window_filler(first));
            });
        }
    });
}

fn fill_mask_pack_at(
    first_word: usize,
    len: usize,
    masks: &[(Seed, Sign)],
    bits: u32,
    packed: &mut [u8],
    mut fill: impl FnMut(usize, &mut [u32]),
) {
    let ciphers = ciphers(masks);
    let mut counters = Counters::new();
    let mut keystream = [Block::<Aes128>::default(); CHUNK_BLOCKS];
    let mut chunk = [0u32; CHUNK_WORDS];
    let chunk_bytes = CHUNK_WORDS * bits as usize / 8;
    let first_block = first_block(first_word);
    for (index, out) in packed.chunks_mut(chunk_bytes).enumerate() {
        let start = index * CHUNK_WORDS;
        let words = &mut chunk[..CHUNK_WORDS.min(len - start)];
        fill(first_word + start, words);
        let counters = counters.at(first_block + (index * CHUNK_BLOCKS) as u64, words.len());
        mask_chunk(&ciphers, counters, &mut keystream, words);
        arith::pack_to(words, bits, out);
    }
    wipe(&mut keystream);
    chunk.zeroize();
}

/// Each mask's cipher, keyed by its seed (the round keys are wiped when
/// it drops).
fn ciphers(masks: &[(Seed, Sign)]) -> Vec<(Aes128, Sign)> {
    masks
        .iter()
        .map(|(seed, sign)| (Aes128::new(seed.into()), *sign))
        .collect()
}

/// The keystream block where word `offset_words` lies, which must start
/// a block.
fn first_block(offset_words: usize) -> u64 {
    assert!(
        offset_words.is_multiple_of(WORDS_PER_BLOCK),
        "a mask window starts at a keystream block"
    );
    (offset_words / WORDS_PER_BLOCK) as u64
}

/// The counter blocks of one chunk, which every mask encrypts: block i of
/// the keystream is AES-128 of i as a 128-bit little-endian integer (the
/// `ctr` crate's `Ctr128LE` with a zero nonce, which the tests check
/// against). A vector has fewer than 2⁶⁴ blocks, so the high eight bytes
/// stay zero and only the low eight are written, once a chunk however
/// many masks meet it, and each mask's cipher encrypts them into the
/// keystream buffer. The `ctr` crate's core, which makes each mask's
/// counters one block at a time, took 1.3× as long (23 masks of 1M words,
/// one thread). Counters are public: nothing here needs wiping.
struct Counters([Block<Aes128>; CHUNK_BLOCKS]);

impl Counters {
    fn new() -> Self {
        Counters([Block::<Aes128>::default(); CHUNK_BLOCKS])
    }

    /// The counters of the blocks that hold `words` words from block
    /// `first_block` on.
    fn at(&mut self, first_block: u64, words: usize) -> &[Block<Aes128>] {
        let blocks = &mut self.0[..words.div_ceil(WORDS_PER_BLOCK)];
        for (offset, block) in (0u64..).zip(blocks.iter_mut()) {
            block[..8].copy_from_slice(&(first_block + offset).to_le_bytes());
        }
        blocks
    }
}

/// Every mask added to (or subtracted from) one chunk of at most
/// [`CHUNK_WORDS`] words, each mask's keystream written to `keystream`
/// (no zero-fill and XOR) and added from there.
fn mask_chunk(
    ciphers: &[(Aes128, Sign)],
    counters: &[Block<Aes128>],
    keystream: &mut [Block<Aes128>; CHUNK_BLOCKS],
    words: &mut [u32],
) {
    let blocks = &mut keystream[..counters.len()];
    for (cipher, sign) in ciphers {
        cipher
            .encrypt_blocks_b2b(counters, blocks)
            .expect("counters and keystream have the same length");
        match sign {
            Sign::Add => combine(words, blocks, u32::wrapping_add),
            Sign::Subtract => combine(words, blocks, u32::wrapping_sub),
        }
    }
}

/// The keystream is the mask: none of it is left on the stack.
fn wipe(keystream: &mut [Block<Aes128>]) {
    for block in keystream.iter_mut() {
        block.as_mut_slice().zeroize();
    }
}

/// Words of the vector below which [`apply_all`] stays on the calling
/// thread: starting threads costs more than a few masks of this size.
const MIN_WORDS_PER_THREAD: usize = 1 << 16;

/// Words per thread's window of a `len`-word vector over up to `threads`
/// threads: whole chunks, so that each window starts at a keystream block
/// (and, packed, at a byte); `len` or more means one window.
fn window_words(len: usize, threads: usize) -> usize {
    let threads = threads.min(len / MIN_WORDS_PER_THREAD).max(1);
    len.div_ceil(threads).div_ceil(CHUNK_WORDS).max(1) * CHUNK_WORDS
}

/// Applies every mask in `masks` to `acc`, the vector split by element
/// range over up to `threads` threads, each expanding its window of every
/// mask. The server's unmasking: many masks meet one vector, and AES-CTR
/// can start anywhere, so the work divides with no coordination.
pub fn apply_all(acc: &mut [u32], masks: &[(Seed, Sign)], threads: usize) {
    let window = window_words(acc.len(), threads);
    if window >= acc.len() {
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
/// loop compiles to vector adds (in profiled secure rounds of 1M values
/// the add took a quarter to a half of the time of the VAES keystream it
/// adds).
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
        use ctr::cipher::{KeyIvInit, StreamCipher, StreamCipherSeek};
        // AES-128 under the zero key of the zero block (FIPS-197 style
        // known answer): 66e94bd4 ef8a2c3b 884cfa59 ca342b2e.
        let mut first = vec![0u32; 4];
        apply(&mut first, &[0; 16], Sign::Add);
        assert_eq!(first, [0xd44b_e966, 0x3b2c_8aef, 0x59fa_4c88, 0x2e2b_34ca]);
        // Every length, chunk boundary and partial last block matches the
        // byte keystream of the ctr crate's stream cipher.
        for len in [
            0,
            1,
            3,
            4,
            5,
            1023,
            1024,
            1025,
            1027,
            CHUNK_WORDS - 1,
            CHUNK_WORDS + 3,
            4096,
            10_001,
        ] {
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
            // A window from a later block starts the keystream there.
            let offset_words = (len / 2) & !(WORDS_PER_BLOCK - 1);
            let mut window = start[offset_words..].to_vec();
            apply_many_at(&mut window, offset_words, &[(seed, Sign::Add)]);
            let mut from_offset = vec![0u8; window.len() * 4];
            let mut stream = ctr::Ctr128LE::<Aes128>::new(&seed.into(), &[0u8; 16].into());
            stream.seek(offset_words as u64 * 4);
            stream.apply_keystream(&mut from_offset);
            for (i, word) in window.iter().enumerate() {
                let key = u32::from_le_bytes(from_offset[i * 4..][..4].try_into().unwrap());
                assert_eq!(
                    *word,
                    start[offset_words + i].wrapping_add(key),
                    "len {len}, window from word {offset_words}, word {i}"
                );
            }
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
    fn filled_masked_and_packed_in_chunks_equals_masking_then_packing() {
        let masks: Vec<(Seed, Sign)> = (0..4u8)
            .map(|i| {
                (
                    [i ^ 0x33; 16],
                    if i == 2 { Sign::Subtract } else { Sign::Add },
                )
            })
            .collect();
        for len in [
            0,
            1,
            511,
            513,
            MIN_WORDS_PER_THREAD * 2 + 3,
            MIN_WORDS_PER_THREAD * 3,
        ] {
            let input: Vec<u32> = (0..len as u32)
                .map(|i| i.wrapping_mul(2_246_822_519))
                .collect();
            let mut masked = input.clone();
            apply_all(&mut masked, &masks, 1);
            for bits in [31, 32, 17] {
                let expected = arith::pack(&masked, bits);
                for threads in [1, 2, 3, 8] {
                    let mut packed = vec![0u8; expected.len()];
                    // Each window's filler sees only its own words, in order.
                    fill_mask_pack(len, &masks, bits, threads, &mut packed, |window| {
                        let mut next = window;
                        let input = &input;
                        move |first: usize, chunk: &mut [u32]| {
                            assert_eq!(first, next, "chunks come in order");
                            next += chunk.len();
                            chunk.copy_from_slice(&input[first..next]);
                        }
                    });
                    assert!(
                        packed == expected,
                        "len {len}, {bits} bits, {threads} threads"
                    );
                }
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
