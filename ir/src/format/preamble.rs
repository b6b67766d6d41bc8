//! The fixed 64-byte preamble: magic, versions, flags, section lengths and
//! the content digest. It is parsed before anything else and tells the
//! reader exactly how long the file must be.

use sha2::{Digest, Sha256};

use super::error::FormatError;
use super::limits::ReadLimits;
use super::{ALIGN, FORMAT_VERSION, MAGIC, OPSET_VERSION};

pub(crate) const PREAMBLE_LEN: usize = 64;
const DIGEST_START: usize = 32;

/// The decoded preamble of a file whose length matches it.
#[derive(Debug)]
pub(crate) struct Preamble {
    /// The op-set version the file declares.
    pub opset: u16,
    pub header_len: usize,
    pub data_len: usize,
    pub digest: [u8; 32],
}

impl Preamble {
    /// Where the data section starts: after the header, padded to 64.
    pub fn data_start(&self) -> usize {
        align(PREAMBLE_LEN + self.header_len)
    }
}

pub(crate) fn align(n: usize) -> usize {
    n.div_ceil(ALIGN) * ALIGN
}

/// Assembles a file; the digest covers everything but its own field.
/// `opset` is the newest op-set version the model's ops need.
pub(crate) fn assemble(header: &[u8], data: &[u8], opset: u16) -> Vec<u8> {
    debug_assert!((1..=OPSET_VERSION).contains(&opset));
    let data_start = align(PREAMBLE_LEN + header.len());
    let mut out = Vec::with_capacity(data_start + data.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&opset.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&(header.len() as u64).to_le_bytes());
    out.extend_from_slice(&(data.len() as u64).to_le_bytes());
    out.extend_from_slice(&[0; 32]);
    out.extend_from_slice(header);
    out.resize(data_start, 0);
    out.extend_from_slice(data);
    let digest = content_digest(&out);
    out[DIGEST_START..PREAMBLE_LEN].copy_from_slice(&digest);
    out
}

/// SHA-256 of the file with the digest field left out. Callers ensure the
/// file is at least a preamble long.
pub(crate) fn content_digest(file: &[u8]) -> [u8; 32] {
    let mut hasher = Sha256::new();
    hasher.update(&file[..DIGEST_START]);
    hasher.update(&file[PREAMBLE_LEN..]);
    hasher.finalize().into()
}

/// Parses the preamble and checks that the file is exactly as long as it
/// says, so later slicing by these lengths cannot go out of bounds.
pub(crate) fn parse(file: &[u8], limits: &ReadLimits) -> Result<Preamble, FormatError> {
    let have = file.len() as u64;
    if have > limits.max_file_bytes {
        return Err(FormatError::limit(
            "file size in bytes",
            have,
            limits.max_file_bytes,
        ));
    }
    let Some(pre) = file.get(..PREAMBLE_LEN) else {
        return Err(FormatError::Truncated {
            what: "the preamble",
            need: PREAMBLE_LEN as u64,
            have,
        });
    };
    check_identity(pre)?;
    let header_len = u64_at(pre, 16);
    let data_len = u64_at(pre, 24);
    if header_len > limits.max_header_bytes {
        return Err(FormatError::limit(
            "header length",
            header_len,
            limits.max_header_bytes,
        ));
    }
    if data_len > limits.max_file_bytes {
        return Err(FormatError::limit(
            "data section length",
            data_len,
            limits.max_file_bytes,
        ));
    }
    if !data_len.is_multiple_of(ALIGN as u64) {
        return Err(FormatError::invalid(
            "preamble",
            format!("data section length {data_len} is not a multiple of {ALIGN}"),
        ));
    }
    // In u128 so that lengths near u64::MAX cannot overflow the sum.
    let align = ALIGN as u128;
    let need =
        (PREAMBLE_LEN as u128 + header_len as u128).div_ceil(align) * align + data_len as u128;
    check_length(u64::try_from(need).unwrap_or(u64::MAX), have)?;
    let mut digest = [0; 32];
    digest.copy_from_slice(&pre[DIGEST_START..]);
    Ok(Preamble {
        opset: u16::from_le_bytes([pre[10], pre[11]]),
        header_len: header_len as usize,
        data_len: data_len as usize,
        digest,
    })
}

fn check_identity(pre: &[u8]) -> Result<(), FormatError> {
    if pre[..8] != MAGIC {
        return Err(FormatError::BadMagic {
            found: String::from_utf8_lossy(&pre[..8]).into_owned(),
        });
    }
    let version = u16::from_le_bytes([pre[8], pre[9]]);
    if version != FORMAT_VERSION {
        return Err(FormatError::UnsupportedVersion {
            found: version,
            supported: FORMAT_VERSION,
        });
    }
    let opset = u16::from_le_bytes([pre[10], pre[11]]);
    if opset == 0 || opset > OPSET_VERSION {
        return Err(FormatError::UnsupportedOpset {
            found: opset,
            supported: OPSET_VERSION,
        });
    }
    let flags = u32::from_le_bytes([pre[12], pre[13], pre[14], pre[15]]);
    if flags != 0 {
        return Err(FormatError::UnknownFlags { flags });
    }
    Ok(())
}

fn check_length(need: u64, have: u64) -> Result<(), FormatError> {
    if have < need {
        return Err(FormatError::Truncated {
            what: "the header and data section",
            need,
            have,
        });
    }
    if have > need {
        return Err(FormatError::TrailingBytes { extra: have - need });
    }
    Ok(())
}

fn u64_at(pre: &[u8], at: usize) -> u64 {
    let mut b = [0; 8];
    b.copy_from_slice(&pre[at..at + 8]);
    u64::from_le_bytes(b)
}
