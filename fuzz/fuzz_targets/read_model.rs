//! Feeds arbitrary bytes to `read_model`. Whatever it accepts must be
//! canonical: writing the decoded model again reproduces the input exactly.
//!
//! Random bytes almost never carry a valid SHA-256 digest, so each input is
//! also tried with its digest recomputed, and an input starting with `{` is
//! wrapped as `header JSON ‖ 0x00 ‖ data section` into a file with a correct
//! preamble, so that mutations reach the JSON decoder and the verifier.
#![no_main]

use canopy_ir::format::{digest, read_model, write_model};
use libfuzzer_sys::fuzz_target;
use sha2::{Digest, Sha256};

fuzz_target!(|data: &[u8]| {
    check(data);
    if data.len() >= 64 {
        let mut fixed = data.to_vec();
        fix_digest(&mut fixed);
        check(&fixed);
    }
    if data.first() == Some(&b'{') {
        check(&wrap(data));
    }
});

fn check(bytes: &[u8]) {
    let _ = digest(bytes);
    if let Ok(model) = read_model(bytes) {
        let again = write_model(&model).expect("a model that was read must be writable");
        assert!(
            again == bytes,
            "re-serialising an accepted file changed its bytes"
        );
    }
}

fn fix_digest(file: &mut [u8]) {
    let mut h = Sha256::new();
    h.update(&file[..32]);
    h.update(&file[64..]);
    let d: [u8; 32] = h.finalize().into();
    file[32..64].copy_from_slice(&d);
}

/// `header ‖ 0x00 ‖ data` → a file whose preamble and digest are right.
fn wrap(input: &[u8]) -> Vec<u8> {
    let split = input.iter().position(|&b| b == 0).unwrap_or(input.len());
    let header = &input[..split];
    let data = input.get(split + 1..).unwrap_or(&[]);
    let data_len = data.len().div_ceil(64) * 64;
    let mut f = Vec::with_capacity(128 + header.len() + data_len);
    f.extend_from_slice(b"CANOPYIR");
    f.extend_from_slice(&1u16.to_le_bytes());
    f.extend_from_slice(&1u16.to_le_bytes());
    f.extend_from_slice(&0u32.to_le_bytes());
    f.extend_from_slice(&(header.len() as u64).to_le_bytes());
    f.extend_from_slice(&(data_len as u64).to_le_bytes());
    f.extend_from_slice(&[0; 32]);
    f.extend_from_slice(header);
    f.resize(f.len().div_ceil(64) * 64, 0);
    f.extend_from_slice(data);
    f.resize(f.len() + data_len - data.len(), 0);
    fix_digest(&mut f);
    f
}
