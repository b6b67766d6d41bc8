//! Benchmark: asynchronous (FedBuff) against synchronous rounds with slow
//! devices, over several draws of the devices' speeds, in one run.
//!
//! For each seed, `canopy simulate` runs the same job on MNIST-10k (IID
//! over 20 devices, the MLP 784-128-10): synchronously, 20 devices a round
//! for `--rounds` rounds, then asynchronously, all 20 training at once and
//! a version every `--buffer-size` updates, once for each staleness
//! exponent of `--exponents` (an update τ versions old weighs
//! `(1 + τ)^-exponent`; 0.5, FedBuff's 1/√(1 + τ), is the job's default).
//! Each device's time per step is drawn log-normal from the seed (median
//! `--step-ms`, the slowest exactly `--spread` times the fastest), so a
//! synchronous round waits for its slowest device. The seed also deals the data, draws the
//! starting model and keys the devices: both runs of a seed share all of
//! it.
//!
//! Figures, per seed: the synchronous run's final central accuracy and
//! wall time, and for each exponent the time the asynchronous run first
//! reaches that accuracy, as a fraction of the synchronous run's wall time
//! (the issue's target: at most 0.5), and its own final accuracy; then,
//! per exponent, the median ratio and how many seeds met it. Every run's
//! learning curve (each version's seconds since the job started, central
//! accuracy and loss) is written under `--out` when it is given.
//!
//! ```text
//! cargo bench -p canopy-cli --bench fedbuff
//! cargo bench -p canopy-cli --bench fedbuff -- --seeds 7,8 --exponents 0.5 --out fedbuff-curves
//! ```

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail, ensure};

const CANOPY: &str = env!("CARGO_BIN_EXE_canopy");
/// The dataset, relative to the workspace root (the bench runs in `cli/`).
const DATA: &str = "../datasets/mnist-10k";
/// Most seeds one run takes: each costs about a minute, plus one for each
/// exponent.
const MAX_SEEDS: usize = 100;
/// Most staleness exponents one run compares.
const MAX_EXPONENTS: usize = 8;

struct Options {
    seeds: Vec<u64>,
    rounds: u32,
    buffer_size: u32,
    versions: u32,
    exponents: Vec<f64>,
    step_ms: f64,
    spread: f64,
    out: Option<PathBuf>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            seeds: vec![7, 8, 9, 10, 11],
            rounds: 30,
            buffer_size: 10,
            versions: 120,
            exponents: vec![0.5, 0.25],
            step_ms: 20.0,
            spread: 10.0,
            out: None,
        }
    }
}

fn parse_options() -> Result<Options> {
    let mut options = Options::default();
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        // `cargo bench` passes `--bench` to every bench binary.
        if flag == "--bench" {
            continue;
        }
        let mut value = || args.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--seeds" => options.seeds = comma_separated(&value()?, "--seeds")?,
            "--exponents" => options.exponents = comma_separated(&value()?, "--exponents")?,
            "--rounds" => options.rounds = value()?.parse().context("--rounds")?,
            "--buffer-size" => options.buffer_size = value()?.parse().context("--buffer-size")?,
            "--versions" => options.versions = value()?.parse().context("--versions")?,
            "--step-ms" => options.step_ms = value()?.parse().context("--step-ms")?,
            "--spread" => options.spread = value()?.parse().context("--spread")?,
            "--out" => options.out = Some(PathBuf::from(value()?)),
            other => bail!(
                "unknown option {other}; the options are --seeds, --exponents, --rounds, \
                 --buffer-size, --versions, --step-ms, --spread and --out"
            ),
        }
    }
    ensure!(
        (1..=MAX_SEEDS).contains(&options.seeds.len()),
        "--seeds takes 1 to {MAX_SEEDS} seeds, got {}",
        options.seeds.len()
    );
    ensure!(
        (1..=MAX_EXPONENTS).contains(&options.exponents.len()),
        "--exponents takes 1 to {MAX_EXPONENTS} exponents, got {}",
        options.exponents.len()
    );
    Ok(options)
}

/// A flag's comma-separated values, each parsed as `T`.
fn comma_separated<T>(text: &str, flag: &str) -> Result<Vec<T>>
where
    T: std::str::FromStr,
    T::Err: std::error::Error + Send + Sync + 'static,
{
    text.split(',')
        .map(|item| {
            let item = item.trim();
            item.parse()
                .with_context(|| format!("{flag}: {item:?} in a comma-separated list"))
        })
        .collect()
}

/// One version of a learning curve.
struct Point {
    seconds: f64,
    accuracy: f64,
}

/// Reads `canopy simulate --curve`'s CSV: version, seconds, central
/// accuracy, then columns this bench does not use.
fn read_curve(path: &Path) -> Result<Vec<Point>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the learning curve {}", path.display()))?;
    let mut points = Vec::new();
    for (number, line) in text.lines().enumerate().skip(1) {
        let fields: Vec<&str> = line.split(',').collect();
        let field = |i: usize| -> Result<f64> {
            fields
                .get(i)
                .and_then(|value| value.parse().ok())
                .with_context(|| {
                    format!(
                        "{} line {}: column {i} is not a number",
                        path.display(),
                        number + 1
                    )
                })
        };
        points.push(Point {
            seconds: field(1)?,
            accuracy: field(2)?,
        });
    }
    ensure!(!points.is_empty(), "{} has no versions", path.display());
    Ok(points)
}

/// Runs one simulated job and returns its curve.
fn simulate(options: &Options, seed: u64, mode: &[String], curve: &Path) -> Result<Vec<Point>> {
    let output = Command::new(CANOPY)
        .arg("simulate")
        .args(["--devices", "20", "--per-round", "20", "--data", DATA])
        .args(["--partition", "iid", "--hidden", "128"])
        .args(["--seed", &seed.to_string()])
        .args(["--step-ms", &options.step_ms.to_string()])
        .args(["--step-spread", &options.spread.to_string()])
        .args(mode)
        .arg("--curve")
        .arg(curve)
        .output()
        .context("cannot start `canopy simulate`")?;
    ensure!(
        output.status.success(),
        "`canopy simulate --seed {seed} {}` failed: {}",
        mode.join(" "),
        String::from_utf8_lossy(&output.stderr)
    );
    read_curve(curve)
}

/// What one asynchronous run measured against its seed's synchronous one.
struct Asynchronous {
    /// When it first reached the synchronous run's final accuracy.
    reached_seconds: Option<f64>,
    final_accuracy: f64,
}

/// What one seed measured: the synchronous run, and an asynchronous run
/// per exponent, in `--exponents` order.
struct Comparison {
    seed: u64,
    sync_accuracy: f64,
    sync_seconds: f64,
    asynchronous: Vec<Asynchronous>,
}

impl Comparison {
    /// Each exponent's time to the synchronous final accuracy, as a
    /// fraction of the synchronous wall time (infinite when never).
    fn ratios(&self) -> impl Iterator<Item = f64> + '_ {
        self.asynchronous.iter().map(|run| {
            run.reached_seconds
                .map_or(f64::INFINITY, |seconds| seconds / self.sync_seconds)
        })
    }
}

fn compare(options: &Options, seed: u64, folder: &Path) -> Result<Comparison> {
    let sync_mode = vec!["--rounds".to_string(), options.rounds.to_string()];
    let sync_curve = folder.join(format!("sync-seed{seed}.csv"));
    let sync = simulate(options, seed, &sync_mode, &sync_curve)?;
    let non_empty = "read_curve refuses an empty curve";
    let last = sync.last().expect(non_empty);
    let mut asynchronous = Vec::new();
    for exponent in &options.exponents {
        let async_mode = vec![
            "--buffer-size".to_string(),
            options.buffer_size.to_string(),
            "--rounds".to_string(),
            options.versions.to_string(),
            "--staleness-exponent".to_string(),
            exponent.to_string(),
        ];
        let async_curve = folder.join(format!("async-seed{seed}-exponent{exponent}.csv"));
        let curve = simulate(options, seed, &async_mode, &async_curve)?;
        asynchronous.push(Asynchronous {
            reached_seconds: curve
                .iter()
                .find(|point| point.accuracy >= last.accuracy)
                .map(|point| point.seconds),
            final_accuracy: curve.last().expect(non_empty).accuracy,
        });
    }
    Ok(Comparison {
        seed,
        sync_accuracy: last.accuracy,
        sync_seconds: last.seconds,
        asynchronous,
    })
}

fn main() -> Result<()> {
    let options = parse_options()?;
    ensure!(
        Path::new(DATA).is_dir(),
        "{DATA} is missing: run the bench from the workspace with `cargo bench -p canopy-cli --bench fedbuff`"
    );
    let scratch = tempfile::tempdir()?;
    let folder = match &options.out {
        Some(out) => {
            std::fs::create_dir_all(out)
                .with_context(|| format!("cannot create {}", out.display()))?;
            out.clone()
        }
        None => scratch.path().to_path_buf(),
    };
    println!(
        "fedbuff: 20 devices, MNIST-10k IID, MLP 784-128-10, step {} ms median, slowest {}x the fastest; \
         synchronous {} rounds against buffers of {} ({} versions); each asynchronous column: \
         the time to the synchronous final accuracy as a fraction of its wall time, and its own final",
        options.step_ms, options.spread, options.rounds, options.buffer_size, options.versions
    );
    let columns: String = options
        .exponents
        .iter()
        .map(|exponent| format!(" {:>20}", format!("exponent {exponent}")))
        .collect();
    println!(
        "{:>5} {:>10} {:>9}{columns}",
        "seed", "sync final", "sync s"
    );
    let started = Instant::now();
    let mut ratios = vec![Vec::new(); options.exponents.len()];
    for &seed in &options.seeds {
        let comparison = compare(&options, seed, &folder)?;
        let cells: String = comparison
            .ratios()
            .zip(&comparison.asynchronous)
            .map(|(ratio, run)| {
                let shown = match ratio.is_finite() {
                    true => format!("{ratio:.2}"),
                    false => "never".to_string(),
                };
                format!(" {:>20}", format!("{shown} ({:.4})", run.final_accuracy))
            })
            .collect();
        println!(
            "{:>5} {:>10.4} {:>9.1}{cells}",
            comparison.seed, comparison.sync_accuracy, comparison.sync_seconds
        );
        for (all, ratio) in ratios.iter_mut().zip(comparison.ratios()) {
            all.push(ratio);
        }
    }
    for (exponent, mut ratios) in options.exponents.iter().zip(ratios) {
        ratios.sort_by(f64::total_cmp);
        let median = ratios[ratios.len() / 2];
        let met = ratios.iter().filter(|&&ratio| ratio <= 0.5).count();
        println!(
            "exponent {exponent}: median ratio {median:.2}; at most 0.5 on {met} of {} seeds",
            ratios.len()
        );
    }
    println!("{:.0} s in all", started.elapsed().as_secs_f64());
    if let Some(out) = &options.out {
        println!("curves written to {}", out.display());
    }
    Ok(())
}
