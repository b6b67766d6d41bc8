//! Benchmark: the round-time tail of the demo's job.
//!
//! It runs `canopy-server demo --json` (the job `canopy-server demo`
//! runs: ten `canopy-agent` processes, each with a non-IID shard of the
//! UCI digits, an MLP 64-32-10, SQLite, HTTPS on loopback) for 200 rounds
//! and prints the distribution of the rounds' times as the server records
//! them (`durations.total_ms`: from the round's creation to its new
//! version): p50, p90, p99, max, and p99 / p50, the figure the tail is
//! judged by (issue 38: p99 at most twice p50); then the same for each
//! phase of a round (waiting for devices, from selection to closing, from
//! closing to the new version), to show where a slow round spent its time.
//!
//! The machine's own disk latency is the baseline of the same run: while
//! the job runs, a thread writes and fsyncs 4 KB in the same file system
//! every 250 ms and its p50 / p99 / max are printed beside the rounds',
//! with the load average before and after, so a run beside other work can
//! be recognised. A round waits on an fsync exactly when the tail follows
//! that column.
//!
//! ```text
//! cargo build --release -p canopy-agent --bin canopy-agent
//! cargo bench -p canopy-server --bench round_tail
//! cargo bench -p canopy-server --bench round_tail -- --rounds 50 --devices 10
//! ```
//!
//! Cargo builds `canopy-server` for the bench, but not `canopy-agent`,
//! which belongs to another package: the first command builds it into the
//! same directory, where the demo looks for it. The bench refuses to run
//! without it, and warns when its sources are newer than the binary.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result, bail, ensure};
use serde_json::Value;

/// The demo's own maximum, and the issue's sample size.
const DEFAULT_ROUNDS: u32 = 200;
/// The demo's default fleet.
const DEFAULT_DEVICES: u32 = 10;
/// The acceptance bound on p99 / p50.
const MAX_TAIL_RATIO: f64 = 2.0;
/// The phases of a round the demo's rows carry, as the server times them.
const PHASES: [&str; 3] = ["selecting_ms", "training_ms", "aggregating_ms"];
/// How often the disk probe writes and fsyncs its 4 KB.
const PROBE_INTERVAL: Duration = Duration::from_millis(250);
const PROBE_BYTES: usize = 4096;
/// Sources the agent binary is built from, relative to the workspace root,
/// checked for being newer than the binary.
const AGENT_SOURCES: [&str; 2] = ["edge-agent/src", "client-sdk/src"];

struct Options {
    rounds: u32,
    devices: u32,
}

fn options() -> Result<Options> {
    let mut options = Options {
        rounds: DEFAULT_ROUNDS,
        devices: DEFAULT_DEVICES,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut number = |name: &str| -> Result<u32> {
            let value = args
                .next()
                .with_context(|| format!("{name} needs a number"))?;
            value
                .parse()
                .with_context(|| format!("{name} {value} is not a whole number"))
        };
        match arg.as_str() {
            "--rounds" => options.rounds = number("--rounds")?,
            "--devices" => options.devices = number("--devices")?,
            // `cargo bench` passes `--bench` to every bench binary.
            "--bench" => {}
            other => bail!("unknown option `{other}`; options: --rounds N, --devices N"),
        }
    }
    Ok(options)
}

fn main() -> Result<()> {
    let options = options()?;
    let server = PathBuf::from(env!("CARGO_BIN_EXE_canopy-server"));
    check_agent(&server)?;
    let scratch = tempfile::Builder::new()
        .prefix("canopy-round-tail-")
        .tempdir()?;
    let load_before = load_average();
    let probe = DiskProbe::start(scratch.path().join("probe"))?;
    let started = Instant::now();
    let output = Command::new(&server)
        .args(["demo", "--json"])
        .args(["--rounds", &options.rounds.to_string()])
        .args(["--devices", &options.devices.to_string()])
        .env("TMPDIR", scratch.path())
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .context("cannot run canopy-server demo")?;
    let wall = started.elapsed();
    let fsync_ms = probe.stop();
    let load_after = load_average();
    ensure!(
        output.status.success(),
        "canopy-server demo failed ({})",
        output.status
    );
    let summary: Value = String::from_utf8_lossy(&output.stdout)
        .lines()
        .rev()
        .find_map(|line| serde_json::from_str(line).ok())
        .context("the demo printed no JSON summary")?;
    let rows = summary["per_round"]
        .as_array()
        .context("the summary has no per_round rows")?;
    let mut round_ms: Vec<f64> = rows
        .iter()
        .map(|row| row["seconds"].as_f64().unwrap_or(f64::NAN) * 1000.0)
        .collect();
    ensure!(
        round_ms.len() == options.rounds as usize && round_ms.iter().all(|ms| ms.is_finite()),
        "expected {} rounds with times, got {:?}",
        options.rounds,
        round_ms
    );
    let rounds = Tail::of(&mut round_ms);
    println!(
        "round_tail: demo job, {} devices, {} rounds in {:.1} s; final accuracy {:.3}",
        options.devices,
        options.rounds,
        wall.as_secs_f64(),
        summary["final_accuracy"].as_f64().unwrap_or(f64::NAN)
    );
    println!(
        "load average (1 min) {} before, {} after",
        load_before, load_after
    );
    println!("                      p50 ms    p90 ms    p99 ms    max ms   p99/p50");
    rounds.print("round time");
    for phase in PHASES {
        let mut phase_ms: Vec<f64> = rows.iter().filter_map(|row| row[phase].as_f64()).collect();
        if phase_ms.len() == rows.len() {
            Tail::of(&mut phase_ms).print(&format!("  {}", phase.trim_end_matches("_ms")));
        }
    }
    match fsync_ms {
        Some(mut samples) if !samples.is_empty() => {
            Tail::of(&mut samples).print("4 KB fsync (baseline)")
        }
        _ => println!("4 KB fsync (baseline): no samples"),
    }
    let slow = round_ms
        .iter()
        .filter(|&&ms| ms > MAX_TAIL_RATIO * rounds.p50)
        .count();
    println!(
        "rounds over {MAX_TAIL_RATIO}x p50: {slow} of {}; p99/p50 {:.2} ({} the bound of {MAX_TAIL_RATIO})",
        round_ms.len(),
        rounds.ratio(),
        if rounds.ratio() <= MAX_TAIL_RATIO {
            "within"
        } else {
            "over"
        }
    );
    Ok(())
}

/// Percentiles by nearest rank.
struct Tail {
    p50: f64,
    p90: f64,
    p99: f64,
    max: f64,
}

impl Tail {
    fn of(samples: &mut [f64]) -> Tail {
        samples.sort_by(f64::total_cmp);
        let rank = |q: f64| {
            let index = (q * samples.len() as f64).ceil() as usize;
            samples[index.clamp(1, samples.len()) - 1]
        };
        Tail {
            p50: rank(0.50),
            p90: rank(0.90),
            p99: rank(0.99),
            max: samples[samples.len() - 1],
        }
    }

    fn ratio(&self) -> f64 {
        self.p99 / self.p50
    }

    fn print(&self, name: &str) {
        println!(
            "{name:<21} {:>7.1}   {:>7.1}   {:>7.1}   {:>7.1}   {:>7.2}",
            self.p50,
            self.p90,
            self.p99,
            self.max,
            self.ratio()
        );
    }
}

/// Writes and fsyncs 4 KB every [`PROBE_INTERVAL`] until stopped; the
/// latencies in milliseconds.
struct DiskProbe {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Vec<f64>>,
}

impl DiskProbe {
    fn start(path: PathBuf) -> Result<DiskProbe> {
        use std::io::{Seek, Write};
        let mut file = std::fs::File::create(&path)
            .with_context(|| format!("cannot create {}", path.display()))?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::spawn(move || {
            let block = [0x5au8; PROBE_BYTES];
            let mut samples = Vec::new();
            while !stopped.load(Ordering::Relaxed) {
                let started = Instant::now();
                let synced = file
                    .rewind()
                    .and_then(|()| file.write_all(&block))
                    .and_then(|()| file.sync_all());
                if synced.is_err() {
                    break;
                }
                samples.push(started.elapsed().as_secs_f64() * 1000.0);
                std::thread::sleep(PROBE_INTERVAL);
            }
            samples
        });
        Ok(DiskProbe { stop, thread })
    }

    fn stop(self) -> Option<Vec<f64>> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().ok()
    }
}

/// `canopy-agent` beside the server binary, where the demo spawns it from.
fn check_agent(server: &Path) -> Result<()> {
    let agent = server.with_file_name(format!("canopy-agent{}", std::env::consts::EXE_SUFFIX));
    let built = match std::fs::metadata(&agent).and_then(|meta| meta.modified()) {
        Ok(built) => built,
        Err(_) => bail!(
            "the demo spawns {}, which is not built\n  hint: cargo build --release -p canopy-agent --bin canopy-agent",
            agent.display()
        ),
    };
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let newer: Vec<PathBuf> = AGENT_SOURCES
        .iter()
        .flat_map(|dir| newer_sources(&workspace.join(dir), built))
        .collect();
    if let Some(first) = newer.first() {
        eprintln!(
            "warning: {} is older than {} of its sources ({} first); the figures are those of the older agent\n  hint: cargo build --release -p canopy-agent --bin canopy-agent",
            agent.display(),
            newer.len(),
            first.display()
        );
    }
    Ok(())
}

/// The `.rs` files under `dir` modified after `than`.
fn newer_sources(dir: &Path, than: SystemTime) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return found;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            found.extend(newer_sources(&path, than));
        } else if path.extension().is_some_and(|ext| ext == "rs")
            && entry
                .metadata()
                .and_then(|meta| meta.modified())
                .is_ok_and(|modified| modified > than)
        {
            found.push(path);
        }
    }
    found
}

/// The 1-minute load average, as `/proc/loadavg` has it.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|text| text.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "unknown".to_string())
}
