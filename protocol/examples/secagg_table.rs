//! Prints the (n, dropout, corrupt) → (k, t) table of docs/secure-aggregation.md.
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
}
