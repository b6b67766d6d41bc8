//! The parent's side of a central evaluation worker (`worker.rs`): start
//! `canopy-server central-worker` on staged files, hold it to the
//! wall-clock timeout, read a bounded amount of its output, and say what
//! happened in words that name the bound it met.

use canopy_engine::data::limits::DataBounds;
use std::path::Path;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::process::Command;

use super::bounds::human_bytes;
use super::worker::{SUBCOMMAND, WorkerReport};

/// Bytes of each of the worker's stdout and stderr kept (the last ones);
/// the rest is read and dropped, so the worker never blocks on a pipe.
const OUTPUT_KEPT_BYTES: usize = 16 << 10;
/// Characters of the worker's stderr quoted in a reason.
const QUOTED_CHARS: usize = 300;
/// glibc reserves 64 MiB of address space per malloc arena, one per
/// thread up to 8 per core: under an address-space limit that reservation
/// would count as memory the evaluation never uses.
const MALLOC_ARENAS: &str = "2";

/// What one worker is given.
pub struct WorkerJob<'a> {
    pub model: &'a Path,
    pub data: &'a Path,
    pub labels: Option<&'a Path>,
    pub kind: &'a str,
    pub input_shape: &'a [usize],
    pub batch: usize,
}

/// The bounds one worker runs under (from `Limits`).
#[derive(Clone, Copy, Debug)]
pub struct WorkerBounds {
    pub memory_bytes: u64,
    pub timeout_ms: u64,
    /// What the dataset may cost to load: the bounds it was admitted
    /// under (`datasets::bounds`), held again in case they were lowered.
    pub dataset: DataBounds,
}

impl WorkerBounds {
    /// CPU seconds: the wall-clock timeout on every core, a backstop for
    /// a worker whose parent cannot kill it.
    fn cpu_seconds(&self) -> u64 {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get() as u64);
        (self.timeout_ms / 1000)
            .saturating_add(1)
            .saturating_mul(cores)
    }
}

/// Why a worker gave no report.
#[derive(Debug, thiserror::Error)]
pub enum WorkerFailure {
    #[error("cannot start the evaluation worker: {0}")]
    Spawn(#[source] std::io::Error),
    #[error(
        "the evaluation worker was killed after {} (limits.central_eval_timeout_ms = {timeout_ms})",
        seconds(*.timeout_ms)
    )]
    TimedOut { timeout_ms: u64 },
    #[error(
        "the evaluation worker ran out of its {} memory limit \
         (limits.central_eval_worker_memory_bytes = {memory_bytes}) and stopped: {stderr}",
        human_bytes(*.memory_bytes)
    )]
    OutOfMemory { memory_bytes: u64, stderr: String },
    #[error(
        "the evaluation worker used up its {cpu_seconds} s of CPU time (limits.central_eval_timeout_ms \
         on every core) and was killed"
    )]
    CpuTime { cpu_seconds: u64 },
    #[error("the evaluation worker stopped ({status}): {stderr}")]
    Crashed { status: String, stderr: String },
    #[error("the evaluation worker's report is not valid ({cause}): {stdout}")]
    BadReport { cause: String, stdout: String },
}

fn seconds(ms: u64) -> String {
    if ms.is_multiple_of(1000) {
        format!("{} s", ms / 1000)
    } else {
        format!("{:.1} s", ms as f64 / 1000.0)
    }
}

/// Runs one worker to its end or its timeout. Dropping the future (a
/// shutdown) kills the worker.
pub async fn run(job: &WorkerJob<'_>, bounds: WorkerBounds) -> Result<WorkerReport, WorkerFailure> {
    let program = std::env::current_exe().map_err(WorkerFailure::Spawn)?;
    let shape: Vec<String> = job.input_shape.iter().map(usize::to_string).collect();
    let mut command = Command::new(program);
    command
        .arg(SUBCOMMAND)
        .arg("--model")
        .arg(job.model)
        .arg("--data")
        .arg(job.data)
        .args(["--kind", job.kind])
        .arg(format!("--input-shape={}", shape.join(",")))
        .args(["--batch", &job.batch.to_string()])
        .args(["--memory-bytes", &bounds.memory_bytes.to_string()])
        .args(["--cpu-seconds", &bounds.cpu_seconds().to_string()])
        .args(["--max-dataset-bytes", &bounds.dataset.max_bytes.to_string()])
        .args([
            "--max-dataset-values",
            &bounds.dataset.max_values.to_string(),
        ])
        .env("MALLOC_ARENA_MAX", MALLOC_ARENAS)
        // A panic's message, not a backtrace, is what a reason can quote.
        .env("RUST_BACKTRACE", "0")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    if let Some(labels) = job.labels {
        command.arg("--labels").arg(labels);
    }
    let mut child = command.spawn().map_err(WorkerFailure::Spawn)?;
    // Held until the worker ends: its closing tells the worker we died.
    let _stdin = child.stdin.take();
    let stdout = tokio::spawn(read_tail(child.stdout.take()));
    let stderr = tokio::spawn(read_tail(child.stderr.take()));
    let limit = Duration::from_millis(bounds.timeout_ms);
    let status = match tokio::time::timeout(limit, child.wait()).await {
        Ok(status) => status.map_err(WorkerFailure::Spawn)?,
        Err(_) => {
            let _ = child.kill().await;
            return Err(WorkerFailure::TimedOut {
                timeout_ms: bounds.timeout_ms,
            });
        }
    };
    let stdout = stdout.await.unwrap_or_default();
    let stderr = stderr.await.unwrap_or_default();
    outcome(status, &stdout, &stderr, bounds)
}

/// The last `OUTPUT_KEPT_BYTES` of a pipe, read to its end.
async fn read_tail(pipe: Option<impl AsyncRead + Unpin>) -> Vec<u8> {
    let Some(mut pipe) = pipe else {
        return Vec::new();
    };
    let mut kept = Vec::new();
    let mut chunk = vec![0u8; 8 << 10];
    loop {
        match pipe.read(&mut chunk).await {
            Ok(0) | Err(_) => return kept,
            Ok(read) => {
                kept.extend_from_slice(&chunk[..read]);
                if kept.len() > OUTPUT_KEPT_BYTES {
                    kept.drain(..kept.len() - OUTPUT_KEPT_BYTES);
                }
            }
        }
    }
}

fn outcome(
    status: ExitStatus,
    stdout: &[u8],
    stderr: &[u8],
    bounds: WorkerBounds,
) -> Result<WorkerReport, WorkerFailure> {
    let stderr_text = quote(stderr);
    if status.success() {
        let text = String::from_utf8_lossy(stdout);
        let line = text.lines().rev().find(|line| !line.trim().is_empty());
        return serde_json::from_str(line.unwrap_or_default()).map_err(|error| {
            WorkerFailure::BadReport {
                cause: error.to_string(),
                stdout: quote(stdout),
            }
        });
    }
    if let Some(line) = out_of_memory(&String::from_utf8_lossy(stderr)) {
        return Err(WorkerFailure::OutOfMemory {
            memory_bytes: bounds.memory_bytes,
            stderr: quote(line.as_bytes()),
        });
    }
    if cpu_limit(status) {
        return Err(WorkerFailure::CpuTime {
            cpu_seconds: bounds.cpu_seconds(),
        });
    }
    Err(WorkerFailure::Crashed {
        status: describe(status),
        stderr: if stderr_text.is_empty() {
            "it wrote nothing on stderr".to_string()
        } else {
            stderr_text
        },
    })
}

/// The line in which Rust's runtime or the C library says an allocation
/// failed (an abort, a capacity panic, ENOMEM from a thread or a mapping).
fn out_of_memory(stderr: &str) -> Option<&str> {
    const SIGNS: [&str; 4] = [
        "memory allocation of",
        "capacity overflow",
        "Cannot allocate memory",
        "out of memory",
    ];
    stderr
        .lines()
        .find(|line| SIGNS.iter().any(|sign| line.contains(sign)))
}

#[cfg(unix)]
fn cpu_limit(status: ExitStatus) -> bool {
    use std::os::unix::process::ExitStatusExt;
    const SIGXCPU: i32 = 24;
    status.signal() == Some(SIGXCPU)
}

#[cfg(not(unix))]
fn cpu_limit(_status: ExitStatus) -> bool {
    false
}

#[cfg(unix)]
fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit status {code}"),
        (None, Some(9)) => {
            "killed by signal 9, SIGKILL: perhaps the kernel's out-of-memory killer".to_string()
        }
        (None, Some(6)) => "aborted, signal 6".to_string(),
        (None, Some(signal)) => format!("killed by signal {signal}"),
        (None, None) => status.to_string(),
    }
}

#[cfg(not(unix))]
fn describe(status: ExitStatus) -> String {
    status.to_string()
}

/// The end of the worker's stderr, on one line, cut to `QUOTED_CHARS`.
fn quote(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let joined: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty())
        .collect();
    let joined = joined.join(" | ");
    let count = joined.chars().count();
    if count <= QUOTED_CHARS {
        joined
    } else {
        let tail: String = joined.chars().skip(count - QUOTED_CHARS).collect();
        format!("…{tail}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_allocation_failure_reads_as_the_memory_bound() {
        let bounds = WorkerBounds {
            memory_bytes: 512 << 20,
            timeout_ms: 3000,
            dataset: DataBounds::DEFAULT,
        };
        let status = std::process::Command::new("sh")
            .args(["-c", "exit 134"])
            .status()
            .expect("sh");
        let error = outcome(
            status,
            b"",
            b"memory allocation of 1099511627776 bytes failed\n",
            bounds,
        )
        .unwrap_err()
        .to_string();
        assert!(
            error.contains("ran out of its 512 MiB memory limit")
                && error.contains("limits.central_eval_worker_memory_bytes")
                && error.contains("1099511627776"),
            "{error}"
        );
        let timed_out = WorkerFailure::TimedOut { timeout_ms: 3000 }.to_string();
        assert!(
            timed_out.contains("killed after 3 s (limits.central_eval_timeout_ms = 3000)"),
            "{timed_out}"
        );
    }

    #[test]
    fn a_report_is_the_last_line_of_stdout() {
        let bounds = WorkerBounds {
            memory_bytes: 1 << 30,
            timeout_ms: 1000,
            dataset: DataBounds::DEFAULT,
        };
        let status = std::process::Command::new("true").status().expect("true");
        let report = outcome(
            status,
            b"{\"outcome\":\"done\",\"loss\":0.5,\"accuracy\":0.75,\"samples\":4}\n",
            b"",
            bounds,
        )
        .expect("a report");
        assert_eq!(
            report,
            WorkerReport::Done {
                loss: 0.5,
                accuracy: 0.75,
                samples: 4
            }
        );
        let garbage = outcome(status, b"not json", b"", bounds).unwrap_err();
        assert!(
            matches!(garbage, WorkerFailure::BadReport { .. }),
            "{garbage}"
        );
    }
}
