//! What checkpointing a scan buys and costs: the peak memory and the time
//! of a 1,000-step recurrence's gradient, saving every step's residuals
//! against saving every k-th carry (k = 25, the divisor nearest √1000)
//! and every carry (k = 1).
//!
//! The recurrence is a GRU cell (hidden 128, input 16, batch 16) whose
//! final state is the result, as in a sequence encoder, so what the
//! backward pass saves is what decides its memory.
//!
//! Memory: each variant runs once in a child process of this binary, with
//! glibc's mmap threshold fixed at 64 KiB so that every tensor of a step
//! is mapped and unmapped as it lives and dies; the peak is the child's
//! `VmHWM` (reset through `/proc/self/clear_refs` after setup) minus its
//! RSS at the reset. Time: the variants run interleaved in this process,
//! each round in a new order, and the medians are compared.
//!
//! `cargo bench -p canopy-engine --bench checkpoint [-- --rounds 5]`

use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use canopy_engine::{Backend, CpuBackend, Executable, Value};
use canopy_ir::autodiff::vjp;
use canopy_ir::{Dim, Graph, Op, Scan, TensorType, UnaryOp, ValueId};

const STEPS: usize = 1000;
const BATCH: usize = 16;
const HIDDEN: usize = 128;
const FEATURES: usize = 16;
const WRT: [&str; 3] = ["h0", "w", "u"];

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if let Some(at) = args.iter().position(|a| a == "--child") {
        let k: usize = args.get(at + 1).context("--child K")?.parse()?;
        println!("{}", child_peak_bytes(k)?);
        return Ok(());
    }
    let rounds: usize = match args.iter().position(|a| a == "--rounds") {
        Some(at) => args.get(at + 1).context("--rounds N")?.parse()?,
        None => 5,
    };
    let root = Scan::sqrt_checkpoint(STEPS);
    let variants = [0, root, 1];
    println!(
        "gradient of a {STEPS}-step GRU scan (hidden {HIDDEN}, input {FEATURES}, batch {BATCH}), CPU backend"
    );
    let mut peaks = Vec::new();
    for &k in &variants {
        peaks.push(measure_peak(k)?);
    }
    let times = measure_times(&variants, rounds)?;
    println!(
        "{:<34} {:>12} {:>10} {:>12} {:>10}",
        "saved for the backward pass", "peak MiB", "vs all", "median s", "vs all"
    );
    for (i, &k) in variants.iter().enumerate() {
        let what = match k {
            0 => "every step's residuals".to_string(),
            1 => "every carry (k = 1)".to_string(),
            k => format!("every {k}th carry (k = {k})"),
        };
        println!(
            "{what:<34} {:>12.1} {:>9.2}× {:>12.3} {:>9.2}×",
            peaks[i] as f64 / (1 << 20) as f64,
            peaks[0] as f64 / peaks[i].max(1) as f64,
            times[i],
            times[i] / times[0],
        );
    }
    println!(
        "(peak: memory falls by the 'vs all' factor; time: the checkpointed run takes 'vs all' times as long)"
    );
    Ok(())
}

/// One child per variant, three times; the median peak.
fn measure_peak(k: usize) -> Result<u64> {
    let exe = std::env::current_exe()?;
    let mut peaks = Vec::new();
    for _ in 0..3 {
        let out = Command::new(&exe)
            .args(["--child", &k.to_string()])
            .env("MALLOC_MMAP_THRESHOLD_", "65536")
            .output()?;
        if !out.status.success() {
            bail!(
                "child for k = {k} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        peaks.push(String::from_utf8(out.stdout)?.trim().parse::<u64>()?);
    }
    peaks.sort_unstable();
    Ok(peaks[1])
}

fn child_peak_bytes(k: usize) -> Result<u64> {
    let (mut exe, inputs) = prepared(k)?;
    std::fs::write("/proc/self/clear_refs", "5").context("resetting VmHWM")?;
    let before = status_bytes("VmRSS")?;
    exe.run(inputs)?;
    Ok(status_bytes("VmHWM")?.saturating_sub(before))
}

fn measure_times(variants: &[usize], rounds: usize) -> Result<Vec<f64>> {
    let mut prepared: Vec<_> = variants
        .iter()
        .map(|&k| prepared(k))
        .collect::<Result<_>>()?;
    let mut samples = vec![Vec::new(); variants.len()];
    for round in 0..rounds {
        for step in 0..variants.len() {
            let i = (step + round) % variants.len();
            let (exe, inputs) = &mut prepared[i];
            let started = Instant::now();
            exe.run(inputs.clone())?;
            samples[i].push(started.elapsed().as_secs_f64());
        }
    }
    Ok(samples
        .into_iter()
        .map(|mut s| {
            s.sort_by(f64::total_cmp);
            s[s.len() / 2]
        })
        .collect())
}

/// The compiled gradient graph for checkpoint `k`, and its inputs.
fn prepared(k: usize) -> Result<(Box<dyn Executable>, Vec<Value>)> {
    let graph = vjp(&gru_scan(k)?, &WRT)?;
    let exe = CpuBackend.compile(&graph)?;
    let inputs = graph
        .inputs()
        .iter()
        .enumerate()
        .map(|(i, &id)| {
            let shape = graph.ty(id).shape.resolve(1);
            let n: usize = shape.iter().product();
            let data = (0..n)
                .map(|j| ((i * 7919 + j * 104_729) % 1000) as f32 / 5000.0 - 0.1)
                .collect();
            Value::f32(&shape, data)
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok((exe, inputs))
}

/// A GRU over `STEPS` steps as one scan with checkpoint `k`:
/// z = σ(x·Uz + h·Wz), r = σ(x·Ur + h·Wr), n = tanh(x·Un + (r·h)·Wn),
/// h' = (1 − z)·n + z·h, with the three gates' matrices side by side.
fn gru_scan(checkpoint: usize) -> Result<Graph> {
    let mut body = Graph::new();
    let h = body.input("h", TensorType::f32(&[BATCH, HIDDEN]))?;
    let x = body.input("x", TensorType::f32(&[BATCH, FEATURES]))?;
    let w = body.input("w", TensorType::f32(&[HIDDEN, 3 * HIDDEN]))?;
    let u = body.input("u", TensorType::f32(&[FEATURES, 3 * HIDDEN]))?;
    let gate = |g: &mut Graph, v: ValueId, i: usize| {
        g.push(
            Op::Slice {
                axis: 1,
                start: i * HIDDEN,
                end: (i + 1) * HIDDEN,
            },
            &[v],
        )
    };
    let xu = body.matmul(x, u)?;
    let w_zr = body.push(
        Op::Slice {
            axis: 1,
            start: 0,
            end: 2 * HIDDEN,
        },
        &[w],
    )?;
    let w_n = body.push(
        Op::Slice {
            axis: 1,
            start: 2 * HIDDEN,
            end: 3 * HIDDEN,
        },
        &[w],
    )?;
    let hw = body.matmul(h, w_zr)?;
    let (xz, xr, xn) = (
        gate(&mut body, xu, 0)?,
        gate(&mut body, xu, 1)?,
        gate(&mut body, xu, 2)?,
    );
    let (hz, hr) = (gate(&mut body, hw, 0)?, gate(&mut body, hw, 1)?);
    let z_pre = body.add(xz, hz)?;
    let z = body.unary(UnaryOp::Sigmoid, z_pre)?;
    let r_pre = body.add(xr, hr)?;
    let r = body.unary(UnaryOp::Sigmoid, r_pre)?;
    let rh = body.mul(r, h)?;
    let rhw = body.matmul(rh, w_n)?;
    let n_pre = body.add(xn, rhw)?;
    let n = body.unary(UnaryOp::Tanh, n_pre)?;
    let one = body.scalar(1.0)?;
    let keep = body.sub(one, z)?;
    let fresh = body.mul(keep, n)?;
    let old = body.mul(z, h)?;
    let next = body.add(fresh, old)?;
    body.set_output("h", next)?;
    let mut g = Graph::new();
    let h0 = g.input("h0", TensorType::f32(&[BATCH, HIDDEN]))?;
    let xs = g.input("xs", TensorType::f32(&[STEPS, BATCH, FEATURES]))?;
    let w = g.input("w", TensorType::f32(&[HIDDEN, 3 * HIDDEN]))?;
    let u = g.input("u", TensorType::f32(&[FEATURES, 3 * HIDDEN]))?;
    let scan = Scan {
        body,
        carries: 1,
        scanned: 1,
        length: Dim::Fixed(STEPS),
        reverse: false,
        checkpoint,
    };
    let h = g.push_tuple(Op::Scan(Box::new(scan)), &[h0, xs, w, u])?[0];
    g.set_output("h", h)?;
    Ok(g)
}

fn status_bytes(field: &str) -> Result<u64> {
    let text = std::fs::read_to_string("/proc/self/status")?;
    text.lines()
        .find_map(|line| {
            let kb = line
                .strip_prefix(field)?
                .strip_prefix(':')?
                .trim()
                .strip_suffix("kB")?;
            kb.trim().parse::<u64>().ok()
        })
        .map(|kb| kb * 1024)
        .with_context(|| format!("{field} in /proc/self/status"))
}
