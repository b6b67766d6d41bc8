//! A secure round of 10,000 devices at the default settings, in process:
//! does it unmask exactly under 5 % and 10 % dropouts, and what does the
//! server spend on it (issue 17)?
//!
//! `cargo bench -p canopy-protocol --bench secagg_scale [-- --devices N]
//! [--params L]`
//!
//! The round itself is `tests/support/scale.rs`, which the test of the
//! same name also runs. The server's memory is the state
//! `Aggregator::held_bytes` counts at its largest, beside the whole
//! process's peak, devices included.

#[path = "../tests/support/scale.rs"]
mod scale;

struct Args {
    devices: usize,
    params: usize,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        devices: 10_000,
        params: 1_000,
    };
    let mut raw = std::env::args().skip(1);
    while let Some(arg) = raw.next() {
        let mut number = |name: &str| -> Result<usize, String> {
            raw.next()
                .and_then(|v| v.replace('_', "").parse().ok())
                .ok_or_else(|| format!("{name} takes a positive number"))
        };
        match arg.as_str() {
            "--devices" => args.devices = number("--devices")?,
            "--params" => args.params = number("--params")?,
            // `cargo bench` passes `--bench`.
            "--bench" => {}
            other => return Err(format!("unknown argument `{other}`")),
        }
    }
    Ok(args)
}

fn main() {
    let args = match parse_args() {
        Ok(args) => args,
        Err(message) => {
            eprintln!("error: {message}\nhint: secagg_scale [--devices N] [--params L]");
            std::process::exit(2);
        }
    };
    println!(
        "SecAgg+ at scale: {} devices, {} parameters, default settings; server calls \
         single-threaded on the main thread, devices on {} threads",
        args.devices,
        args.params,
        scale::threads()
    );
    for dropout in [0.05, 0.10] {
        match scale::simulate(args.devices, args.params, dropout) {
            Ok(report) => print_report(&report, args.devices, dropout),
            Err(message) => {
                eprintln!(
                    "error: the round with {:.0}% dropouts failed\nCaused by: {message}",
                    dropout * 100.0
                );
                std::process::exit(1);
            }
        }
    }
    if let Some(peak) = proc_status_field("VmHWM") {
        println!("process peak resident memory (devices included): {peak}");
    }
}

fn print_report(report: &scale::Report, n: usize, dropout: f64) {
    let plan = &report.plan;
    println!(
        "\n{:.0}% dropouts ({} of {n}, a fifth before each of the five stages): k = {}, t = {}, \
         max_weight {} at {} levels; {} survivors; the unmasked sum equals theirs exactly",
        dropout * 100.0,
        report.dropouts,
        plan.degree,
        plan.threshold,
        plan.max_weight,
        plan.levels,
        report.survivors
    );
    let server_total: std::time::Duration = report.server.iter().map(|(_, d)| *d).sum();
    for (label, duration) in &report.server {
        println!("  server {label:<36} {:>9.3} s", duration.as_secs_f64());
    }
    println!(
        "  server total{:<30} {:>9.3} s",
        "",
        server_total.as_secs_f64()
    );
    println!(
        "  devices, all of them, on {} threads       {:>9.3} s   (wall, whole round {:.3} s)",
        scale::threads(),
        report.devices.as_secs_f64(),
        report.whole.as_secs_f64()
    );
    println!(
        "  server state held at most                {:>9.1} MB  ({:.0} bytes per device)",
        report.held_bytes as f64 / 1e6,
        report.held_bytes as f64 / n as f64
    );
}

fn proc_status_field(name: &str) -> Option<String> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
        .map(|v| v.trim().to_string())
}
