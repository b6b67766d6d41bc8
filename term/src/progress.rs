//! Training progress for the CLI and the agent, from the engine's one
//! training loop: a bar per epoch on a terminal, a structured log line
//! every `LOG_EVERY_BATCHES` batches otherwise.

use std::io::IsTerminal;
use std::ops::ControlFlow;

use canopy_engine::train::FitProgress;
use indicatif::{ProgressBar, ProgressStyle};

/// Batches between log lines when stderr is not a terminal.
pub const LOG_EVERY_BATCHES: usize = 100;

/// Turns [`FitProgress`] into bars or logs; never stops the loop.
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

    pub fn observe(&mut self, progress: FitProgress) -> ControlFlow<()> {
        match progress {
            FitProgress::Batch {
                epoch,
                done,
                batches,
                mean_loss,
                ..
            } => {
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
            FitProgress::Epoch(stats) => {
                if let Some(bar) = self.bar.take() {
                    bar.finish_and_clear();
                }
                tracing::debug!(
                    epoch = stats.epoch,
                    loss = stats.loss,
                    accuracy = stats.accuracy,
                    "epoch done"
                );
            }
        }
        ControlFlow::Continue(())
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
