//! Progress reporting: a bar on a terminal, structured logs otherwise.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressStyle};

pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("CANOPY_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // With stderr closed the subscriber would report the failed write
        // with `eprintln!`, which panics; a lost log line is not worth that.
        .log_internal_errors(false)
        .with_target(false)
        .try_init();
}

pub fn is_terminal() -> bool {
    std::io::stderr().is_terminal()
}

/// A bar over `len` steps when stderr is a terminal; hidden otherwise.
pub fn bar(len: u64, prefix: String) -> ProgressBar {
    if !is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len).with_prefix(prefix);
    let style = ProgressStyle::with_template(
        "{prefix:>10} [{bar:30}] {pos}/{len} batches  {msg}  ({elapsed}, eta {eta})",
    )
    .expect("static template is valid")
    .progress_chars("=> ");
    bar.set_style(style);
    bar
}
