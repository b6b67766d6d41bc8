//! What every layer shares about errors. HTTP answers are `api::error`'s.

/// Formats an error and its chain of causes on one line, for logs and for
/// the reasons stored on failed rounds.
pub fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
