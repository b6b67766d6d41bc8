//! Benchmark: robust aggregation of a large round from the blob store,
//! with its peak memory.
//!
//! It stores `--devices` updates of `--params` f32 values each (1,000 ×
//! 1,000,000 by default: 4 GB) in a local blob store in a temporary
//! directory, as a robust round's uploads do, then aggregates them with
//! each rule (`canopy_server::robust`, block by block) and prints, per
//! rule, the seconds it took and its peak resident memory, as a ratio to
//! the updates' total size (what an aggregation that held them all would
//! need at least). The baseline of the same run is a plain mean read from
//! the same blobs, one whole update at a time: the I/O every rule also
//! does, with one model's memory.
//!
//! Krum's work is n²·d, so it runs on the first `--krum-devices` updates
//! (100 by default).
//!
//! ```text
//! cargo bench -p canopy-server --bench robust
//! cargo bench -p canopy-server --bench robust -- --devices 200 --params 100000
//! ```
//!
//! Peak memory is the process's `VmHWM`, reset before each rule through
//! `/proc/self/clear_refs` (Linux).

use std::time::Instant;

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use canopy_server::blobs::BlobStore;
use canopy_server::robust::{RoundUpdates, Rule, StoredUpdate, block_len};

struct Args {
    devices: usize,
    params: usize,
    krum_devices: usize,
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        devices: 1_000,
        params: 1_000_000,
        krum_devices: 100,
    };
    let mut words = std::env::args().skip(1);
    while let Some(word) = words.next() {
        let mut value = || -> Result<usize> {
            let text = words
                .next()
                .with_context(|| format!("{word} needs a value"))?;
            text.parse().with_context(|| format!("{word} {text}"))
        };
        match word.as_str() {
            "--devices" => args.devices = value()?,
            "--params" => args.params = value()?,
            "--krum-devices" => args.krum_devices = value()?,
            // cargo bench passes --bench.
            "--bench" => {}
            other => bail!("unknown argument {other}: --devices, --params, --krum-devices"),
        }
    }
    args.krum_devices = args.krum_devices.min(args.devices);
    Ok(args)
}

/// The process's peak resident memory since the last reset, in bytes.
fn peak_rss_bytes() -> Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let line = status
        .lines()
        .find(|line| line.starts_with("VmHWM:"))
        .context("no VmHWM in /proc/self/status")?;
    let kib: u64 = line
        .split_whitespace()
        .nth(1)
        .context("VmHWM's value")?
        .parse()?;
    Ok(kib * 1024)
}

fn reset_peak_rss() -> Result<()> {
    std::fs::write("/proc/self/clear_refs", "5").context("resetting VmHWM")
}

/// Device `device`'s update: deterministic, different per device.
fn update(device: usize, params: usize) -> Vec<u8> {
    let mut state = (device as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let mut bytes = Vec::with_capacity(params * 4);
    for _ in 0..params {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let value = (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
        bytes.extend_from_slice(&value.to_le_bytes());
    }
    bytes
}

const ROUND_ID: i64 = 1;

async fn store(blobs: &BlobStore, args: &Args) -> Result<Vec<StoredUpdate>> {
    let started = Instant::now();
    let mut stored = Vec::with_capacity(args.devices);
    for device in 0..args.devices {
        let digest = format!("{device:064x}");
        let device_id = device as i64 + 1;
        let bytes = Bytes::from(update(device, args.params));
        blobs
            .put_update(ROUND_ID, device_id, &digest, bytes)
            .await?;
        stored.push(StoredUpdate { device_id, digest });
    }
    println!(
        "stored {} updates of {} values ({:.1} GB) in {:.1} s",
        args.devices,
        args.params,
        (args.devices * args.params * 4) as f64 / 1e9,
        started.elapsed().as_secs_f64()
    );
    Ok(stored)
}

/// The baseline: the plain mean, each update read whole, one at a time.
async fn plain_mean(updates: &RoundUpdates<'_>) -> Result<Vec<f64>> {
    let mut sum = vec![0.0f64; updates.len];
    let bytes = 0..updates.len as u64 * 4;
    for update in updates.updates {
        let read = updates
            .blobs
            .read_update(
                updates.round_id,
                update.device_id,
                &update.digest,
                bytes.clone(),
            )
            .await?;
        for (total, chunk) in sum.iter_mut().zip(read.chunks_exact(4)) {
            *total += f64::from(f32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]));
        }
    }
    let n = updates.updates.len() as f64;
    sum.iter_mut().for_each(|total| *total /= n);
    Ok(sum)
}

struct Measured {
    seconds: f64,
    peak_bytes: u64,
}

async fn measure<F, Fut>(run: F) -> Result<Measured>
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = Result<Vec<f64>>>,
{
    reset_peak_rss()?;
    let started = Instant::now();
    let aggregate = run().await?;
    let seconds = started.elapsed().as_secs_f64();
    let peak_bytes = peak_rss_bytes()?;
    if aggregate.iter().any(|value| !value.is_finite()) {
        bail!("an aggregate is not finite");
    }
    Ok(Measured {
        seconds,
        peak_bytes,
    })
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = parse_args()?;
    let dir = tempfile::tempdir()?;
    let blobs = BlobStore::open(dir.path().to_str().context("utf-8 temp dir")?)?;
    let stored = store(&blobs, &args).await?;
    let all = RoundUpdates {
        blobs: &blobs,
        round_id: ROUND_ID,
        updates: &stored,
        len: args.params,
    };
    let total_bytes = (args.devices * args.params * 4) as f64;
    println!(
        "blocks of {} coordinates ({} devices)",
        block_len(args.devices),
        args.devices
    );
    println!(
        "{:<34} {:>9} {:>10} {:>14} {:>16}",
        "aggregation", "seconds", "× mean", "peak RSS (MB)", "÷ updates' size"
    );
    let baseline = measure(|| async { plain_mean(&all).await }).await?;
    let row = |name: &str, measured: &Measured, total_bytes: f64, baseline_s: f64| {
        println!(
            "{name:<34} {:>9.2} {:>10.2} {:>14.0} {:>16.4}",
            measured.seconds,
            measured.seconds / baseline_s,
            measured.peak_bytes as f64 / 1e6,
            measured.peak_bytes as f64 / total_bytes
        );
    };
    row(
        &format!("plain mean (baseline), n = {}", args.devices),
        &baseline,
        total_bytes,
        baseline.seconds,
    );
    for (name, rule) in [
        ("median", Rule::Median),
        (
            "trimmed mean (β = 0.1)",
            Rule::TrimmedMean { trim_fraction: 0.1 },
        ),
    ] {
        let measured = measure(|| async { Ok(all.aggregate(rule).await?) }).await?;
        row(
            &format!("{name}, n = {}", args.devices),
            &measured,
            total_bytes,
            baseline.seconds,
        );
    }
    let few = RoundUpdates {
        updates: &stored[..args.krum_devices],
        ..all
    };
    let few_bytes = (args.krum_devices * args.params * 4) as f64;
    let few_baseline = measure(|| async { plain_mean(&few).await }).await?;
    row(
        &format!("plain mean (baseline), n = {}", args.krum_devices),
        &few_baseline,
        few_bytes,
        few_baseline.seconds,
    );
    let byzantine = args.krum_devices.saturating_sub(3) / 2;
    let krum = Rule::Krum { byzantine };
    let measured = measure(|| async { Ok(few.aggregate(krum).await?) }).await?;
    row(
        &format!("Krum (f = {byzantine}), n = {}", args.krum_devices),
        &measured,
        few_bytes,
        few_baseline.seconds,
    );
    Ok(())
}
