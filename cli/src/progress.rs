//! Logging set-up, and training progress: a bar on a terminal,
//! structured logs otherwise, drawn by `canopy_term::progress` (shared
//! with the agent) from the engine's [`FitProgress`].

use std::ops::ControlFlow;

use canopy_engine::train::FitProgress;
use canopy_term::progress::FitBar;

/// Shows `progress` on `bar`; never stops training.
pub fn show(bar: &mut FitBar, progress: FitProgress) -> ControlFlow<()> {
    match progress {
        FitProgress::Batch {
            epoch,
            done,
            batches,
            mean_loss,
            ..
        } => bar.batch(epoch, done, batches, mean_loss),
        FitProgress::Epoch(stats) => bar.epoch_done(stats.epoch, stats.loss, stats.accuracy),
    }
    ControlFlow::Continue(())
}

/// Logs to stderr at `default_level`, or as `CANOPY_LOG` says.
pub fn init_logging(default_level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("CANOPY_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colour only on a terminal: a log redirected to a file stays text.
        .with_ansi(canopy_term::stderr_color())
        // With stderr closed the subscriber would report the failed write
        // with `eprintln!`, which panics; a lost log line is not worth that.
        .log_internal_errors(false)
        .with_target(false)
        .try_init();
}
