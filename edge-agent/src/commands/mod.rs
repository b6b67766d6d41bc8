//! The one-shot subcommands; `run` lives in `daemon`, `status` in `status`.

pub mod aggregate;
pub mod certify;
pub mod data;
pub mod enroll;
pub mod install;
pub mod local;
