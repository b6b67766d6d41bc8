//! Training progress for the CLI and the agent: a bar per epoch on a
//! terminal, a structured log line every `LOG_EVERY_BATCHES` batches
//! otherwise. The callers feed it from the engine's training loop
//! (`canopy_engine::train::FitProgress`); this crate does not link the
//! engine, so that the server and the SDK can use it without it.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressStyle};

/// Batches between log lines when stderr is not a terminal.
pub const LOG_EVERY_BATCHES: usize = 100;

/// Shows an epoch's batches as a bar or as logs; never stops training.
pub struct FitBar {
    epochs: u32,
    terminal: bool,
    bar: Option<ProgressBar>,
}

impl FitBar {
    pub fn new(epochs: u32) -> FitBar {
        FitBar {
            epochs,
            terminal: std::io::stderr().is_terminal(),
            bar: None,
        }
    }

    /// Before each batch: `done` of `batches` in epoch `epoch` (from 1)
    /// have run, at a mean loss of `mean_loss` so far.
    pub fn batch(&mut self, epoch: u32, done: usize, batches: usize, mean_loss: f64) {
        if self.terminal {
            let bar = self
                .bar
                .get_or_insert_with(|| epoch_bar(batches, epoch, self.epochs));
            bar.set_position(done as u64);
            if done > 0 {
                bar.set_message(format!("loss {mean_loss:.4}"));
            }
        } else if done > 0 && done.is_multiple_of(LOG_EVERY_BATCHES) {
            tracing::info!(epoch, batch = done, batches, loss = mean_loss, "training");
        }
    }

    /// Epoch `epoch` finished with this training loss and accuracy.
    pub fn epoch_done(&mut self, epoch: u32, loss: f64, accuracy: f64) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
        tracing::debug!(epoch, loss, accuracy, "epoch done");
    }
}

fn epoch_bar(batches: usize, epoch: u32, epochs: u32) -> ProgressBar {
    let bar = ProgressBar::new(batches as u64).with_prefix(format!("epoch {epoch}/{epochs}"));
    let style = ProgressStyle::with_template(
        "{prefix:>12} [{bar:30}] {pos}/{len} batches  {msg}  ({elapsed}, eta {eta})",
    )
    .expect("static template is valid")
    .progress_chars("=> ");
    bar.set_style(style);
    bar
}

/// A command of several long steps (`canopy model bench`) as one bar on
/// a terminal: the steps done, the current one, and what it is doing.
/// Nothing when stderr is not a terminal, so logs and `--json` stay clean.
pub struct StepBar {
    bar: Option<ProgressBar>,
}

impl StepBar {
    pub fn new(steps: usize) -> StepBar {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::new(steps as u64);
            let style =
                ProgressStyle::with_template("[{bar:20}] {pos}/{len} {prefix}  {msg}  ({elapsed})")
                    .expect("static template is valid")
                    .progress_chars("=> ");
            bar.set_style(style);
            bar
        });
        StepBar { bar }
    }

    /// Whether the bar is drawn: callers skip building details otherwise.
    pub fn visible(&self) -> bool {
        self.bar.is_some()
    }

    /// Step `what` begins; the previous one is done.
    pub fn step(&mut self, what: &str) {
        if let Some(bar) = &self.bar {
            if !bar.prefix().is_empty() {
                bar.inc(1);
            }
            bar.set_prefix(what.to_string());
            bar.set_message("");
        }
    }

    /// What the current step is doing (`epoch 2/5, batch 300/937`).
    pub fn detail(&mut self, text: String) {
        if let Some(bar) = &self.bar {
            bar.set_message(text);
        }
    }

    /// Clears the bar, so that what is printed next starts a clean line.
    pub fn finish(self) {
        if let Some(bar) = self.bar {
            bar.finish_and_clear();
        }
    }

    /// Runs `print` with the bar out of the way, so a line printed while
    /// it shows is not drawn over.
    pub fn suspend<T>(&self, print: impl FnOnce() -> T) -> T {
        match &self.bar {
            Some(bar) => bar.suspend(print),
            None => print(),
        }
    }
}
