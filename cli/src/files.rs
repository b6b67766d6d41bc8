//! Reading and writing model files, with errors that name the file.

use std::path::Path;

use anyhow::{Context, Result};
use canopy_ir::Model;
use canopy_ir::format::{digest_hex, read_model, write_model};
use canopy_protocol::bounds::MAX_MODEL_BYTES;

/// The binaries' one hint type (`canopy_term::report`), printed as `hint:`.
pub use canopy_term::report::Hint;

/// Reads and parses a model file. Files over the size every tier shares
/// ([`MAX_MODEL_BYTES`]) are refused before they are loaded into memory.
pub fn read_model_file(path: &Path) -> Result<(Model, [u8; 32])> {
    let bytes = read_bounded(path, MAX_MODEL_BYTES)
        .with_context(|| format!("cannot read model file `{}`", path.display()))?;
    let digest = canopy_ir::format::digest(&bytes)
        .with_context(|| format!("`{}` is not a valid Canopy model file", path.display()))?;
    let model = read_model(&bytes)
        .with_context(|| format!("`{}` is not a valid Canopy model file", path.display()))?;
    Ok((model, digest))
}

/// A model file's bytes, checked to be a valid model (digest, structure)
/// and within [`MAX_MODEL_BYTES`], as they are to be sent.
pub fn read_model_bytes(path: &Path) -> Result<Vec<u8>> {
    let bytes = read_bounded(path, MAX_MODEL_BYTES)
        .with_context(|| format!("cannot read model file `{}`", path.display()))?;
    read_model(&bytes)
        .with_context(|| format!("`{}` is not a valid Canopy model file", path.display()))?;
    Ok(bytes)
}

/// A file's bytes, at most `limit` of them ([`canopy_files::read_bounded`]:
/// a regular file, refused before reading when over the limit, and cut
/// one byte past it if it grows). The error is the cause alone; callers
/// name the file in their own words.
pub fn read_bounded(path: &Path, limit: u64) -> Result<Vec<u8>> {
    canopy_files::read_bounded(path, limit).map_err(|error| anyhow::Error::new(error.cause))
}

/// The mode of the files the commands write (models, ONNX and `.npz`
/// outputs): made to be shared, so readable by all and writable by their
/// owner, as the shell makes files under the usual umask.
pub const OUTPUT_FILE_MODE: u32 = 0o644;

/// Writes atomically, so an interrupted write never leaves a truncated
/// model behind. Returns the digest.
pub fn write_model_file(path: &Path, model: &Model) -> Result<[u8; 32]> {
    let bytes = write_model(model).context("cannot serialise the model")?;
    let digest = canopy_ir::format::digest(&bytes).context("cannot digest the model")?;
    write_atomic(path, &bytes, OUTPUT_FILE_MODE)
        .with_context(|| format!("cannot write model file `{}`", path.display()))?;
    Ok(digest)
}

/// Replaces `path` with `bytes` through [`canopy_sdk::files::write_atomic`]
/// (a crash leaves the old file or the new one), with exactly `mode` on
/// Unix. The error names the step that failed and its cause; callers add
/// which file it was, in their own words.
pub fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> Result<()> {
    canopy_sdk::files::write_atomic(path, bytes, mode).map_err(|error| {
        anyhow::Error::new(error.source).context(format!("cannot {} it", error.action))
    })
}

pub fn short_digest(digest: &[u8; 32]) -> String {
    digest_hex(digest)[..16].to_string()
}
