//! Reading and writing model files, with errors that name the file.

use std::fs;
use std::path::Path;

use anyhow::{Context, Result};
use canopy_ir::Model;
use canopy_ir::format::{digest_hex, read_model, write_model};
use canopy_protocol::bounds::MAX_MODEL_BYTES;

/// A hint attached to an error chain; printed as `hint:`.
#[derive(Debug)]
pub struct Hint(pub String);

impl std::fmt::Display for Hint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Hint {}

impl Hint {
    /// `error` with `hint` printed after its causes. `main` finds a hint
    /// at the root of a chain, so the causes above it are kept as text.
    pub fn attach(error: anyhow::Error, hint: impl Into<String>) -> anyhow::Error {
        Hint::chain(error.chain().map(ToString::to_string).collect(), hint)
    }

    /// An error whose chain is `messages`, outermost first, then `hint`.
    pub fn chain(messages: Vec<String>, hint: impl Into<String>) -> anyhow::Error {
        messages
            .into_iter()
            .rev()
            .fold(anyhow::Error::new(Hint(hint.into())), |error, message| {
                error.context(message)
            })
    }
}

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

/// A file's bytes, refused before reading when over `limit` bytes.
pub fn read_bounded(path: &Path, limit: u64) -> Result<Vec<u8>> {
    let meta = fs::metadata(path)?;
    if meta.is_dir() {
        anyhow::bail!("it is a directory");
    }
    if meta.len() > limit {
        anyhow::bail!("it is {} bytes, over the limit of {limit}", meta.len());
    }
    Ok(fs::read(path)?)
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
