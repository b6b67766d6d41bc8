//! How a binary's failed command ends: `error:` with the error, each cause
//! once as `  Caused by:`, then the [`Hint`], if the chain holds one, last
//! as `  hint:`. The one reporter and the one hint type of `canopy` and
//! `canopy-agent`.

use std::fmt;

/// What the user can do about an error: put in its chain with
/// [`Hint::attach`], [`Hint::chain`] or [`hinted`] (or as a context layer,
/// `.context(Hint(..))`), printed last by [`report`].
#[derive(Debug)]
pub struct Hint(pub String);

impl fmt::Display for Hint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Hint {}

impl Hint {
    /// `error` with `hint` printed after its causes. The hint becomes the
    /// chain's root, so the causes above it are kept as text.
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

/// An error of one message and a hint: `error: {message}`, then
/// `hint: {hint}`.
pub fn hinted(message: impl Into<String>, hint: impl Into<String>) -> anyhow::Error {
    Hint::chain(vec![message.into()], hint)
}

/// Prints `error` to stderr in the house style (see the module doc).
pub fn report(error: &anyhow::Error) {
    for line in report_lines(error) {
        errln!("{line}");
    }
}

/// The lines [`report`] prints.
pub fn report_lines(error: &anyhow::Error) -> Vec<String> {
    // anyhow's downcast finds a hint among the context layers too, which
    // the chain of `dyn Error`s shows only as their text.
    let hint = error
        .downcast_ref::<Hint>()
        .or_else(|| error.chain().find_map(|cause| cause.downcast_ref::<Hint>()));
    let mut lines = vec![format!("error: {error}")];
    for cause in error.chain().skip(1) {
        let text = cause.to_string();
        if cause.is::<Hint>() || hint.is_some_and(|hint| hint.0 == text) {
            continue;
        }
        lines.push(format!("  Caused by: {text}"));
    }
    if let Some(hint) = hint {
        lines.push(format!("  hint: {hint}"));
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    fn io(message: &str) -> anyhow::Error {
        anyhow::Error::new(std::io::Error::other(message.to_string()))
    }

    #[test]
    fn causes_come_once_and_the_hint_last() {
        let attached = Hint::attach(io("disk full").context("cannot write"), "free space")
            .context("cannot save the model");
        assert_eq!(
            report_lines(&attached),
            [
                "error: cannot save the model",
                "  Caused by: cannot write",
                "  Caused by: disk full",
                "  hint: free space",
            ]
        );
        assert_eq!(
            report_lines(&hinted("not enrolled", "run enroll")),
            ["error: not enrolled", "  hint: run enroll"]
        );
    }

    #[test]
    fn a_hint_given_as_a_context_layer_is_printed_last_not_as_a_cause() {
        let layered = io("permission denied")
            .context(Hint("chmod 600 it".into()))
            .context("cannot load the key");
        assert_eq!(
            report_lines(&layered),
            [
                "error: cannot load the key",
                "  Caused by: permission denied",
                "  hint: chmod 600 it",
            ]
        );
    }

    #[test]
    fn a_chain_without_a_hint_has_no_hint_line() {
        assert_eq!(
            report_lines(&io("refused").context("cannot connect")),
            ["error: cannot connect", "  Caused by: refused"]
        );
    }
}
