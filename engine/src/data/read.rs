//! Reading whole files into memory, transparently gunzipping, under
//! [`MAX_FILE_BYTES`].

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;

use flate2::read::MultiGzDecoder;

use super::data_err;
use super::limits::MAX_FILE_BYTES;
use crate::error::EngineResult;

/// The two bytes every gzip stream starts with (RFC 1952).
const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// Reads `path`, decompressing it when it starts with the gzip magic (the
/// name is not trusted: `.gz` files are sometimes stored decompressed).
pub(crate) fn read_file(path: &Path) -> EngineResult<Vec<u8>> {
    let file = File::open(path).map_err(|e| data_err(path, format!("cannot open: {e}")))?;
    let len = file
        .metadata()
        .map_err(|e| data_err(path, format!("cannot stat: {e}")))?
        .len();
    if len > MAX_FILE_BYTES {
        return Err(data_err(path, too_big(len)));
    }
    let mut reader = BufReader::new(file);
    let mut head = Vec::with_capacity(2);
    (&mut reader)
        .take(2)
        .read_to_end(&mut head)
        .map_err(|e| data_err(path, format!("cannot read: {e}")))?;
    let rest = head.as_slice().chain(reader);
    if head == GZIP_MAGIC {
        read_capped(path, MultiGzDecoder::new(rest), "gzip stream is corrupt")
    } else {
        read_capped(path, rest, "cannot read")
    }
}

/// Reads at most one byte past the cap so an oversized stream (a gzip
/// bomb) is detected without ever buffering more than the cap.
fn read_capped(path: &Path, reader: impl Read, what: &str) -> EngineResult<Vec<u8>> {
    let mut out = Vec::new();
    reader
        .take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut out)
        .map_err(|e| data_err(path, format!("{what}: {e}")))?;
    if out.len() as u64 > MAX_FILE_BYTES {
        return Err(data_err(path, too_big(out.len() as u64)));
    }
    Ok(out)
}

fn too_big(len: u64) -> String {
    format!("file is larger than the {MAX_FILE_BYTES}-byte limit (at least {len} bytes)")
}

/// Multiplies dimensions with overflow and limit checks, so a header's
/// claimed sizes can be compared with reality before any allocation.
pub(crate) fn checked_product(dims: &[usize], limit: usize) -> Option<usize> {
    dims.iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .filter(|&n| n <= limit)
}
