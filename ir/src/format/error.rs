//! Errors of reading an IR file. Each message names the object (preamble,
//! header, parameter, entry point and node) and the cause, because the
//! reader of the message usually has only the file.

use crate::error::IrError;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FormatError {
    #[error("file is truncated: {what} needs {need} bytes, the file has {have}")]
    Truncated {
        what: &'static str,
        need: u64,
        have: u64,
    },
    #[error("file has {extra} trailing bytes after the data section")]
    TrailingBytes { extra: u64 },
    #[error("not a Canopy IR file: magic is {found:?}, expected \"CANOPYIR\"")]
    BadMagic { found: String },
    #[error("unsupported format version {found} (this reader supports up to {supported})")]
    UnsupportedVersion { found: u16, supported: u16 },
    #[error("unsupported opset version {found} (this reader supports up to {supported})")]
    UnsupportedOpset { found: u16, supported: u16 },
    #[error("unknown preamble flags {flags:#010x} (format version 1 defines none)")]
    UnknownFlags { flags: u32 },
    #[error("{what} is {value}, which exceeds the limit of {limit}")]
    LimitExceeded {
        what: String,
        value: u64,
        limit: u64,
    },
    #[error("content digest mismatch: header says {stored}, content hashes to {computed}")]
    DigestMismatch { stored: String, computed: String },
    #[error("header is not valid: {0}")]
    Header(String),
    #[error("header is not in canonical form ({0}); a model has exactly one encoding")]
    NonCanonical(String),
    #[error("unknown op `{op}` in {location}")]
    UnknownOp { op: String, location: String },
    /// A structural problem in one object of the file, e.g. a data range.
    #[error("{location}: {cause}")]
    Invalid { location: String, cause: String },
    /// A graph that decoded but does not verify; the source names the node.
    #[error("{location}: {source}")]
    Graph {
        location: String,
        #[source]
        source: IrError,
    },
    #[error("model is invalid: {0}")]
    Model(#[source] IrError),
}

impl FormatError {
    pub(crate) fn invalid(location: impl Into<String>, cause: impl Into<String>) -> FormatError {
        FormatError::Invalid {
            location: location.into(),
            cause: cause.into(),
        }
    }

    pub(crate) fn limit(what: impl Into<String>, value: u64, limit: u64) -> FormatError {
        FormatError::LimitExceeded {
            what: what.into(),
            value,
            limit,
        }
    }
}
