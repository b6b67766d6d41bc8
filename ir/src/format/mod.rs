//! The Canopy IR file format, version 1: a [`Model`] as bytes and back.
//!
//! Layout (specified in full in `docs/ir-format.md`): a 64-byte preamble
//! (magic, format and opset versions, flags, header and data lengths, a
//! SHA-256 content digest), a compact JSON header describing metadata,
//! parameters and entry-point graphs, zero padding to a 64-byte boundary,
//! then the little-endian tensor data section with every tensor 64-byte
//! aligned.
//!
//! Encoding is canonical: the writer is deterministic and the reader accepts
//! only the exact bytes the writer would produce for the model it decodes,
//! so a model's identity is its digest. The reader treats the file as
//! untrusted: it never panics, checks every length before slicing or
//! allocating, and caps every count with [`ReadLimits`].
//!
//! Like the rest of this crate it does no I/O: bytes in, bytes out.

mod error;
mod hex;
mod limits;
mod ops;
mod preamble;
mod read;
mod schema;
mod write;

pub use error::FormatError;
pub use limits::{HARD_MAX_DIM, ReadLimits};

use crate::error::IrResult;
use crate::model::Model;

/// The first eight bytes of every IR file.
pub const MAGIC: [u8; 8] = *b"CANOPYIR";
/// The file layout version this crate writes and the newest it reads.
pub const FORMAT_VERSION: u16 = 1;
/// The op-set version (op names, attributes and semantics) this crate
/// writes and the newest it reads. 3 added control flow (`scan`, `cond`,
/// `while_loop`, `output`); a file declares the newest its ops need, so
/// files of opsets 1 and 2 read as before.
pub const OPSET_VERSION: u16 = 3;
/// Alignment of the data section and of every tensor in it, in bytes.
pub const ALIGN: usize = 64;
/// Constants with at most this many elements are stored inline in the
/// header; larger ones live in the data section.
pub const INLINE_MAX_ELEMENTS: usize = 64;

/// Serialises a model after validating it. Identical models give identical
/// bytes.
pub fn write_model(model: &Model) -> IrResult<Vec<u8>> {
    write::write_model(model)
}

/// Reads a model with the default [`ReadLimits`].
pub fn read_model(bytes: &[u8]) -> Result<Model, FormatError> {
    read_model_with_limits(bytes, &ReadLimits::default())
}

/// Reads a model, verifying the digest, every graph and the model.
pub fn read_model_with_limits(bytes: &[u8], limits: &ReadLimits) -> Result<Model, FormatError> {
    read::read_model(bytes, &limits.clamped())
}

/// The content digest stored in a file's preamble. Only the preamble is
/// checked (magic, versions, lengths against the file size); the digest
/// itself is verified by [`read_model`], not here.
pub fn digest(bytes: &[u8]) -> Result<[u8; 32], FormatError> {
    Ok(preamble::parse(bytes, &ReadLimits::default())?.digest)
}

/// Lowercase hex of a digest, as shown in error messages and metadata.
pub fn digest_hex(d: &[u8; 32]) -> String {
    hex::encode(d)
}
