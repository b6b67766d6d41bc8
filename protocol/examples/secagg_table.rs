//! Prints the tables of docs/secure-aggregation.md: (n, dropout, corrupt)
//! → (k, t), and the fixed-point scale of a round at the default settings.
use canopy_protocol::secagg::SecAggConfig;
use canopy_protocol::secagg::params::choose_degree_and_threshold;

fn main() {
    println!("| n | dropouts | corrupt | k | t |");
    println!("|---|---|---|---|---|");
    for n in [10usize, 100, 1_000, 10_000, 100_000] {
        for (dropout, corrupt) in [(0.05, 0.0), (0.1, 0.0), (0.1, 0.05), (0.3, 0.0), (0.3, 0.1)] {
            let cell = match choose_degree_and_threshold(n, dropout, corrupt) {
                Ok((k, t)) => format!("{k} | {t}"),
                Err(_) => "refused | refused".to_string(),
            };
            println!(
                "| {n} | {:.0}% | {:.0}% | {cell} |",
                dropout * 100.0,
                corrupt * 100.0
            );
        }
    }
    println!();
    println!("| n | max_weight | levels per side | step (clip 1) |");
    println!("|---|---|---|---|");
    let defaults = SecAggConfig {
        enabled: true,
        ..SecAggConfig::default()
    };
    for n in [10usize, 100, 1_000, 8_256, 10_000, 100_000] {
        let scale = defaults
            .scale_for(n)
            .expect("the defaults hold every round size");
        println!(
            "| {n} | {} | {} | {:.1e} |",
            scale.max_weight,
            scale.levels,
            1.0 / scale.levels as f64
        );
    }
}
