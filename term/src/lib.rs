//! Standard output and standard error for every command of Canopy's
//! binaries (`canopy-agent`, `canopy`, `canopy-server`): the one place that
//! decides what a closed stdout means. A crate of its own so that the
//! server shares the rule without linking device code. `println!` panics when the reader of a pipe has
//! gone (`canopy-agent status | head -1`); commands write through
//! [`outln!`] instead, and `main` passes clap's help through
//! [`clap_exit`].
//!
//! A closed stdout stops the command where it is, quietly, with exit
//! status [`STDOUT_CLOSED_EXIT`] = 141 = 128 + SIGPIPE. That is what a
//! shell reports for `cat`, `grep` or any C tool killed by SIGPIPE at the
//! same point, so scripts with `set -o pipefail` treat these binaries
//! like them; and since the command did not finish (an `install` cut
//! short has not written its unit), 0 would claim a success it did not
//! have. Rust ignores SIGPIPE, and restoring its default would need
//! `unsafe` and would let a closed journal kill the agent's daemon, so
//! the status is chosen here instead. The daemon (`canopy-agent run`)
//! never writes to stdout: its logs are `tracing` events on stderr, whose
//! writer drops write errors.

use std::fmt;
use std::io::{ErrorKind, Write};

/// Exit status when stdout is closed under a command: 128 + SIGPIPE (13).
pub const STDOUT_CLOSED_EXIT: u8 = 141;

#[derive(Debug, thiserror::Error)]
pub enum OutputError {
    /// Stdout's reader went away; `main` turns it into a quiet exit with
    /// [`STDOUT_CLOSED_EXIT`].
    #[error("standard output was closed")]
    Closed,
    /// Any other failure (a full disk behind `>`).
    #[error("cannot write to standard output")]
    Write(#[source] std::io::Error),
}

/// Writes one line to stdout.
pub fn write_line(args: fmt::Arguments<'_>) -> Result<(), OutputError> {
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_fmt(args)
        .and_then(|()| stdout.write_all(b"\n"))
    {
        Ok(()) => Ok(()),
        Err(error) if error.kind() == ErrorKind::BrokenPipe => Err(OutputError::Closed),
        Err(error) => Err(OutputError::Write(error)),
    }
}

/// Whether `error` is, or was caused by, a closed stdout. Takes any error
/// (`&*anyhow_error` too) and walks its causes.
pub fn is_stdout_closed(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut current = Some(error);
    while let Some(cause) = current {
        if matches!(
            cause.downcast_ref::<OutputError>(),
            Some(OutputError::Closed)
        ) {
            return true;
        }
        current = cause.source();
    }
    false
}

/// Prints clap's answer (help, version or a usage error) and gives the
/// exit status: clap's own, or [`STDOUT_CLOSED_EXIT`] when stdout closed
/// under `--help`.
#[cfg(feature = "binary")]
pub fn clap_exit(error: &clap::Error) -> std::process::ExitCode {
    use std::process::ExitCode;
    match error.print() {
        Err(cause) if cause.kind() == ErrorKind::BrokenPipe => ExitCode::from(STDOUT_CLOSED_EXIT),
        _ => ExitCode::from(u8::try_from(error.exit_code()).unwrap_or(2)),
    }
}

/// Writes one line to stderr, dropping errors: with stderr gone there is
/// nowhere left to report them, and a message must never become a panic.
pub fn write_error_line(args: fmt::Arguments<'_>) {
    let mut stderr = std::io::stderr().lock();
    let _ = stderr
        .write_fmt(args)
        .and_then(|()| stderr.write_all(b"\n"));
}

/// Whether what a binary writes to stderr (its logs, its progress) may
/// carry ANSI colour: only when stderr is a terminal, and never when
/// `NO_COLOR` is set to a non-empty value (<https://no-color.org>). A log
/// redirected to a file, a pipe or the journal stays plain text. The one
/// rule for `canopy`, `canopy-agent` and `canopy-server`.
pub fn stderr_color() -> bool {
    use std::io::IsTerminal;
    color_allowed(
        std::io::stderr().is_terminal(),
        std::env::var_os("NO_COLOR").as_deref(),
    )
}

/// [`stderr_color`]'s rule, for a stream that is or is not a terminal and
/// the value of `NO_COLOR`.
pub fn color_allowed(terminal: bool, no_color: Option<&std::ffi::OsStr>) -> bool {
    terminal && no_color.is_none_or(std::ffi::OsStr::is_empty)
}

/// `println!` that returns `Err(OutputError::Closed)` instead of panicking
/// when stdout is a closed pipe: `outln!("{x}")?;`.
#[macro_export]
macro_rules! outln {
    () => {
        $crate::write_line(format_args!(""))
    };
    ($($arg:tt)*) => {
        $crate::write_line(format_args!($($arg)*))
    };
}

/// `eprintln!` that cannot panic.
#[macro_export]
macro_rules! errln {
    ($($arg:tt)*) => {
        $crate::write_error_line(format_args!($($arg)*))
    };
}

#[cfg(feature = "binary")]
pub mod progress;
#[cfg(feature = "binary")]
pub mod report;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn colour_needs_a_terminal_and_no_no_color() {
        use std::ffi::OsStr;
        assert!(color_allowed(true, None));
        assert!(color_allowed(true, Some(OsStr::new(""))));
        assert!(!color_allowed(true, Some(OsStr::new("1"))));
        assert!(!color_allowed(false, None));
    }

    #[test]
    fn a_closed_stdout_is_found_under_any_wrapping() {
        #[derive(Debug, thiserror::Error)]
        #[error("listing tokens")]
        struct Wrapper(#[source] OutputError);
        assert!(is_stdout_closed(&Wrapper(OutputError::Closed)));
        let other = Wrapper(OutputError::Write(std::io::Error::other("disk full")));
        assert!(!is_stdout_closed(&other));
    }
}

/// An error and its causes on one line, for logs, status files, stored
/// reasons and the app library's messages: the one rule for it, so the
/// SDK (which links this crate without its `binary` feature) and the
/// binaries write a chain alike. A cause whose message its parent already
/// ends with (errors that repeat their source) is not repeated.
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let next = cause.to_string();
        if !text.ends_with(&next) {
            text.push_str(": ");
            text.push_str(&next);
        }
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod chain_tests {
    use super::error_chain;

    #[derive(Debug, thiserror::Error)]
    #[error("cannot read the model")]
    struct Outer(#[source] std::io::Error);

    #[derive(Debug, thiserror::Error)]
    #[error("upload failed: disk full")]
    struct Repeating(#[source] std::io::Error);

    #[test]
    fn causes_follow_on_one_line_and_are_not_repeated() {
        let io = || std::io::Error::other("disk full");
        assert_eq!(
            error_chain(&Outer(io())),
            "cannot read the model: disk full"
        );
        assert_eq!(error_chain(&Repeating(io())), "upload failed: disk full");
    }
}
