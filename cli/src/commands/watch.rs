//! `canopy job watch ID`: one row per round as it finishes, until the job
//! ends. Exits 0 when the job completes, 1 when it fails or is cancelled,
//! and 130 on Ctrl-C, which stops the watching, not the job.

use std::collections::HashSet;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow};
use clap::Args;
use serde_json::Value;

use crate::files::Hint;
use crate::output::{errln, outln};
use crate::remote::table::{clean, escape};
use crate::remote::{self, MAX_LIST_PAGES, PAGE_SIZE, Remote, Subject, Unreachable, cell};

/// Exit status after Ctrl-C: 128 + SIGINT, what a shell shows for a C tool.
pub const INTERRUPTED_EXIT: u8 = 130;
/// How long the server may stay unreachable (a restart) before watching gives up.
pub const MAX_UNREACHABLE_MS: u64 = 60_000;

#[derive(Args)]
pub struct WatchArgs {
    /// The job's id (`canopy job ls`).
    id: i64,
    /// How often to ask the server, in milliseconds.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(100..=60_000))]
    interval_ms: u64,
}

/// How watching ended, short of an error.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum WatchEnd {
    Completed,
    Interrupted,
}

pub fn run(args: WatchArgs) -> Result<ExitCode> {
    let remote = Remote::from_saved()?;
    let id = args.id;
    let end = remote::block_on(async {
        tokio::select! {
            end = watch(&remote, id, Duration::from_millis(args.interval_ms)) => end,
            signal = tokio::signal::ctrl_c() => match signal {
                Ok(()) => Ok(WatchEnd::Interrupted),
                Err(error) => Err(anyhow!(error).context("cannot listen for Ctrl-C")),
            },
        }
    })?;
    match end {
        WatchEnd::Completed => Ok(ExitCode::SUCCESS),
        WatchEnd::Interrupted => {
            errln!(
                "stopped watching job {id}; the job goes on (`canopy job cancel {id}` stops it)"
            );
            Ok(ExitCode::from(INTERRUPTED_EXIT))
        }
    }
}

/// What has been shown so far.
#[derive(Default)]
struct Shown {
    /// Rounds printed, by id.
    rounds: HashSet<i64>,
    /// Every round up to this id is printed: where the next poll starts.
    printed_through: i64,
    status: String,
}

pub(crate) async fn watch(remote: &Remote, id: i64, interval: Duration) -> Result<WatchEnd> {
    let subject = Subject::job(id);
    let job = remote.get(&format!("/api/v1/jobs/{id}"), &subject).await?;
    outln!(
        "job {id} `{}`: {} rounds, from model version id {}",
        clean(&cell(&job["name"], 0)),
        cell(&job["spec"]["rounds"], 0),
        cell(&job["model_version_id"], 0)
    )?;
    outln!(
        "{:>5}  {:<10}  {:>7}  {:>10}  {:>13}  {:>14}  {:>11}  {:>7}",
        "round",
        "state",
        "devices",
        "train loss",
        "federated acc",
        "federated loss",
        "central acc",
        "seconds"
    )?;
    let mut shown = Shown::default();
    let mut unreachable_since: Option<Instant> = None;
    loop {
        match poll(remote, id, &subject, &mut shown).await {
            Ok(Some(end)) => return end,
            Ok(None) => unreachable_since = None,
            Err(error) if Unreachable::is(&error) => {
                let since = *unreachable_since.get_or_insert_with(|| {
                    errln!("the server is unreachable; still trying: {error}");
                    Instant::now()
                });
                if since.elapsed() > Duration::from_millis(MAX_UNREACHABLE_MS) {
                    return Err(error);
                }
            }
            Err(error) => return Err(error),
        }
        tokio::time::sleep(interval).await;
    }
}

/// One look at the job: prints the rounds that finished and says whether
/// the job ended (and how).
async fn poll(
    remote: &Remote,
    id: i64,
    subject: &Subject,
    shown: &mut Shown,
) -> Result<Option<Result<WatchEnd>>> {
    // The job first: rounds read after a finished job include its last.
    let job = remote.get(&format!("/api/v1/jobs/{id}"), subject).await?;
    let state = job["state"].as_str().unwrap_or_default().to_string();
    let ended = matches!(state.as_str(), "completed" | "failed" | "cancelled");
    let central = job["spec"]["evaluation"]
        .get("central_dataset")
        .is_some_and(|value| !value.is_null());
    let rounds = rounds_after(remote, id, shown.printed_through, subject).await?;
    let mut contiguous = true;
    for round in &rounds {
        let round_id = round["id"].as_i64().unwrap_or_default();
        if shown.rounds.contains(&round_id) {
            continue;
        }
        if ended || is_finished(round, central) {
            print_round(round)?;
            shown.rounds.insert(round_id);
            if contiguous {
                shown.printed_through = round_id;
            }
        } else {
            contiguous = false;
        }
    }
    // Whole, as every status: its cause comes last.
    let status = job["status_message"].as_str().unwrap_or_default();
    if !ended && status != shown.status && !status.is_empty() {
        errln!("job {id} is {state}: {}", escape(status));
    }
    shown.status = status.to_string();
    Ok(match state.as_str() {
        "completed" => {
            outln!(
                "job {id} completed: {} rounds, model version id {}",
                cell(&job["rounds_completed"], 0),
                cell(&job["current_version_id"], 0)
            )?;
            Some(Ok(WatchEnd::Completed))
        }
        "failed" => Some(Err(Hint::attach(
            anyhow!("{}", escape(status)).context(format!("job {id} failed")),
            format!(
                "see its settings with `canopy job show {id}` and its devices with `canopy device ls`"
            ),
        ))),
        "cancelled" => Some(Err(anyhow!("job {id} was cancelled"))),
        _ => None,
    })
}

/// A round is shown once it ended and its evaluations are in: the
/// federated one closed and, for jobs with a central dataset, the central
/// result present.
fn is_finished(round: &Value, central: bool) -> bool {
    match round["state"].as_str() {
        Some("failed") => true,
        // A statistics round produces no version to evaluate.
        Some("succeeded") if round["kind"] == "statistics" => true,
        Some("succeeded") => {
            let metrics = &round["metrics"];
            metrics["federated_eval_state"] != "open"
                && (!central || !metrics["central_eval_accuracy"].is_null())
        }
        _ => false,
    }
}

/// The job's rounds with ids above `after`, oldest first.
async fn rounds_after(
    remote: &Remote,
    id: i64,
    after: i64,
    subject: &Subject,
) -> Result<Vec<Value>> {
    let mut rounds = Vec::new();
    let mut cursor = after;
    for _ in 0..MAX_LIST_PAGES {
        let mut page = remote
            .get(
                &format!("/api/v1/jobs/{id}/rounds?limit={PAGE_SIZE}&cursor={cursor}"),
                subject,
            )
            .await?;
        if let Some(items) = page.get_mut("items").and_then(Value::as_array_mut) {
            rounds.append(items);
        }
        match page["next_cursor"].as_str().and_then(|c| c.parse().ok()) {
            Some(next) if next > cursor => cursor = next,
            _ => break,
        }
    }
    Ok(rounds)
}

fn print_round(round: &Value) -> Result<()> {
    let metrics = &round["metrics"];
    let number = match round["attempt"].as_i64() {
        Some(attempt) if attempt > 1 => format!("{}.{attempt}", cell(&round["number"], 0)),
        _ => cell(&round["number"], 0),
    };
    let seconds = round["durations"]["total_ms"]
        .as_f64()
        .map(|ms| format!("{:.1}", ms / 1000.0))
        .unwrap_or_else(|| "-".into());
    outln!(
        "{:>5}  {:<10}  {:>7}  {:>10}  {:>13}  {:>14}  {:>11}  {:>7}",
        number,
        cell(&round["state"], 0),
        format!(
            "{}/{}",
            cell(&metrics["updates_accepted"], 0),
            cell(&round["selected"], 0)
        ),
        cell(&metrics["train_loss"], 4),
        cell(&metrics["federated_eval_accuracy"], 3),
        cell(&metrics["federated_eval_loss"], 4),
        cell(&metrics["central_eval_accuracy"], 3),
        seconds
    )?;
    if let Some(epsilon) = round["privacy"]["epsilon"].as_f64() {
        outln!(
            "       privacy: epsilon {epsilon:.4} spent after this round (sampling rate {}, \
             clip {})",
            cell(&round["privacy"]["sampling_rate"], 4),
            cell(&round["privacy"]["clip_norm"], 4)
        )?;
    }
    if round["kind"] == "statistics" && round["state"] == "succeeded" {
        outln!("       (input statistics fitted from the devices' data; training starts)")?;
    }
    if round["state"] == "failed" {
        outln!(
            "       round failed: {}",
            escape(&cell(&round["status_message"], 0))
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_round_is_shown_once_its_evaluations_are_in() {
        let round = |state: &str, federated: Value, central: Value| {
            json!({"state": state, "metrics": {
                "federated_eval_state": federated, "central_eval_accuracy": central}})
        };
        assert!(!is_finished(
            &round("training", json!(null), json!(null)),
            false
        ));
        assert!(!is_finished(
            &round("succeeded", json!("open"), json!(null)),
            false
        ));
        assert!(is_finished(
            &round("succeeded", json!("closed"), json!(null)),
            false
        ));
        assert!(is_finished(
            &round("succeeded", json!(null), json!(null)),
            false
        ));
        assert!(!is_finished(
            &round("succeeded", json!("closed"), json!(null)),
            true
        ));
        assert!(is_finished(
            &round("succeeded", json!("closed"), json!(0.9)),
            true
        ));
        assert!(is_finished(
            &round("failed", json!(null), json!(null)),
            true
        ));
    }
}
