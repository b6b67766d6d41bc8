//! Arithmetic on logarithms, where the accountant's sums live: their terms
//! span hundreds of orders of magnitude.

/// ln(eˣ + eʸ).
pub(crate) fn log_add(x: f64, y: f64) -> f64 {
    let (low, high) = if x < y { (x, y) } else { (y, x) };
    if low == f64::NEG_INFINITY {
        return high;
    }
    high + (low - high).exp().ln_1p()
}

/// ln of the sum of the exponentials of `terms`.
pub(crate) fn log_sum_exp(terms: impl IntoIterator<Item = f64>) -> f64 {
    terms.into_iter().fold(f64::NEG_INFINITY, log_add)
}

/// ln |C(n, k)|, the binomial coefficient for any real `n` (negative for
/// some `k > n` when `n` is not an integer).
pub(crate) fn log_binomial(n: f64, k: f64) -> f64 {
    libm::lgamma(n + 1.0) - libm::lgamma(k + 1.0) - libm::lgamma(n - k + 1.0)
}

/// ln erfc(x), accurate where erfc(x) itself underflows.
pub(crate) fn log_erfc(x: f64) -> f64 {
    // erfc(20) is 5e-176, well inside f64; past it, the asymptotic series
    // erfc(x) = e^(-x²)/(x√π) · Σ (-1)ⁿ (2n-1)!!/(2x²)ⁿ has terms below
    // 1e-14 by the sixth.
    const ASYMPTOTIC_FROM: f64 = 20.0;
    if x < ASYMPTOTIC_FROM {
        return libm::erfc(x).ln();
    }
    let inverse_two_x_squared = 1.0 / (2.0 * x * x);
    let mut term = 1.0;
    let mut series = 1.0;
    for n in 1..=6 {
        term *= -f64::from(2 * n - 1) * inverse_two_x_squared;
        series += term;
    }
    -x * x - (x * std::f64::consts::PI.sqrt()).ln() + series.ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_erfc_is_continuous_where_the_series_takes_over() {
        // Where erfc itself is still well inside f64, the series agrees.
        for x in [20.0, 20.5, 23.0, 26.0] {
            let direct = libm::erfc(x).ln();
            assert!(((log_erfc(x) - direct) / direct).abs() < 1e-13, "{x}");
        }
        // Past erfc's underflow the logarithm stays finite and close to -x².
        let far = log_erfc(100.0);
        assert!((far + 10_000.0 + (100.0 * std::f64::consts::PI.sqrt()).ln()).abs() < 1e-4);
        assert_eq!(log_erfc(-40.0), 2f64.ln());
    }

    #[test]
    fn log_binomial_matches_small_cases_and_fractional_signs_are_dropped() {
        assert!((log_binomial(10.0, 3.0) - 120f64.ln()).abs() < 1e-12);
        // C(1.5, 3) = 1.5 · 0.5 · (-0.5) / 6 = -0.0625.
        assert!((log_binomial(1.5, 3.0) - 0.0625f64.ln()).abs() < 1e-12);
    }

    #[test]
    fn log_add_handles_zero_and_ordering() {
        assert_eq!(log_add(f64::NEG_INFINITY, 1.0), 1.0);
        assert!((log_add(0.0, 0.0) - 2f64.ln()).abs() < 1e-15);
        assert!(
            (log_sum_exp([1.0, 2.0, 3.0]) - (1f64.exp() + 2f64.exp() + 3f64.exp()).ln()).abs()
                < 1e-12
        );
    }
}
