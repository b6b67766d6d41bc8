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
        } else if done > 0 && done % LOG_EVERY_BATCHES == 0 {
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
