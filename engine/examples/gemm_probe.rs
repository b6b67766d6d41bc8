//! Times single `general_mat_mul` calls at the MLP's shapes and at 1024³,
//! on one thread and split in two under rayon (the CPU backend's `gemm`
//! strategy). `cargo run --release --example gemm_probe -p canopy-engine`.
use ndarray::Array2;
use ndarray::linalg::general_mat_mul;
use std::time::Instant;

fn time(m: usize, k: usize, n: usize, ta: bool) -> f64 {
    let a = if ta {
        Array2::<f32>::ones((k, m))
    } else {
        Array2::<f32>::ones((m, k))
    };
    let b = Array2::<f32>::ones((k, n));
    let mut c = Array2::<f32>::zeros((m, n));
    let av = if ta { a.t() } else { a.view() };
    general_mat_mul(1.0, &av, &b, 0.0, &mut c);
    let runs = (2e9 / (2.0 * (m * k * n) as f64)).max(3.0) as usize;
    let t = Instant::now();
    for _ in 0..runs {
        general_mat_mul(1.0, &av, &b, 0.0, &mut c);
    }
    let s = t.elapsed().as_secs_f64() / runs as f64;
    2.0 * (m * k * n) as f64 / s / 1e9
}

fn time_split(m: usize, k: usize, n: usize) -> f64 {
    let a = Array2::<f32>::ones((m, k));
    let b = Array2::<f32>::ones((k, n));
    let mut c = Array2::<f32>::zeros((m, n));
    split(&a.view(), &b.view(), &mut c.view_mut());
    let runs = (2e9 / (2.0 * (m * k * n) as f64)).max(3.0) as usize;
    let t = Instant::now();
    for _ in 0..runs {
        split(&a.view(), &b.view(), &mut c.view_mut());
    }
    let s = t.elapsed().as_secs_f64() / runs as f64;
    2.0 * (m * k * n) as f64 / s / 1e9
}

fn main() {
    for (m, k, n, ta) in [
        (64, 784, 128, false),
        (784, 64, 128, true),
        (1024, 1024, 1024, false),
    ] {
        println!("{m}x{k}x{n} ta={ta}: {:.0} GFLOPS", time(m, k, n, ta));
        println!("   split: {:.0} GFLOPS", time_split(m, k, n));
    }
}

fn split(
    a: &ndarray::ArrayView2<f32>,
    b: &ndarray::ArrayView2<f32>,
    c: &mut ndarray::ArrayViewMut2<f32>,
) {
    use ndarray::Axis;
    let (m, n) = (a.nrows(), b.ncols());
    if m >= n {
        let (a0, a1) = a.view().split_at(Axis(0), m / 2);
        let (mut c0, mut c1) = c.view_mut().split_at(Axis(0), m / 2);
        rayon::join(
            || general_mat_mul(1.0, &a0, b, 0.0, &mut c0),
            || general_mat_mul(1.0, &a1, b, 0.0, &mut c1),
        );
    } else {
        let (b0, b1) = b.view().split_at(Axis(1), n / 2);
        let (mut c0, mut c1) = c.view_mut().split_at(Axis(1), n / 2);
        rayon::join(
            || general_mat_mul(1.0, a, &b0, 0.0, &mut c0),
            || general_mat_mul(1.0, a, &b1, 0.0, &mut c1),
        );
    }
}
