//! Logging set-up. Training progress (a bar on a terminal, structured
//! logs otherwise) is `canopy_term::progress`, shared with the agent.

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
