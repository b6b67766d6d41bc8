//! Splitting one dataset across simulated federated clients: IID, by
//! label (each client sees only a few classes) and the standard per-class
//! Dirichlet(alpha) label skew. Every partition assigns every sample to
//! exactly one client and is reproducible from its seed.

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Gamma};

use super::dataset::Dataset;
use super::limits::DIRICHLET_MAX_ATTEMPTS;
use crate::error::{EngineError, EngineResult};

/// Smallest client the default Dirichlet partition accepts (capped at an
/// equal share), so no client trains on a handful of samples.
pub const DEFAULT_MIN_CLIENT_SAMPLES: usize = 10;

/// Tuning for [`partition_dirichlet_with`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DirichletOptions {
    /// Every client must end up with at least this many samples.
    pub min_samples: usize,
    /// Redraws allowed before giving up on `min_samples`.
    pub max_attempts: usize,
    /// Stop giving a class to clients that already hold an equal share
    /// (the usual NIID-Bench rule), which keeps sizes from collapsing.
    pub balance: bool,
}

impl Default for DirichletOptions {
    fn default() -> Self {
        DirichletOptions {
            min_samples: DEFAULT_MIN_CLIENT_SAMPLES,
            max_attempts: DIRICHLET_MAX_ATTEMPTS,
            balance: true,
        }
    }
}

fn part_err(cause: impl Into<String>) -> EngineError {
    EngineError::Data {
        path: "<partition>".into(),
        cause: cause.into(),
    }
}

fn check_clients(data: &Dataset, num_clients: usize) -> EngineResult<()> {
    if num_clients == 0 {
        return Err(part_err("num_clients must be at least 1"));
    }
    if num_clients > data.len() {
        return Err(part_err(format!(
            "{num_clients} clients but only {} samples",
            data.len()
        )));
    }
    Ok(())
}

/// Builds each client's dataset, its samples kept in dataset order.
fn build(data: &Dataset, clients: Vec<Vec<usize>>) -> Vec<Dataset> {
    clients
        .into_iter()
        .map(|mut idx| {
            idx.sort_unstable();
            data.subset(&idx)
        })
        .collect()
}

/// Appends near-equal consecutive chunks of `idx` to `owners`' lists.
fn deal(idx: &[usize], owners: &[usize], clients: &mut [Vec<usize>]) {
    let (n, k) = (idx.len(), owners.len());
    for (j, &c) in owners.iter().enumerate() {
        clients[c].extend_from_slice(&idx[j * n / k..(j + 1) * n / k]);
    }
}

/// Shuffles all samples and deals them out in near-equal shares.
pub fn partition_iid(data: &Dataset, num_clients: usize, seed: u64) -> EngineResult<Vec<Dataset>> {
    check_clients(data, num_clients)?;
    let mut idx: Vec<usize> = (0..data.len()).collect();
    idx.shuffle(&mut StdRng::seed_from_u64(seed));
    let mut clients = vec![Vec::new(); num_clients];
    deal(&idx, &(0..num_clients).collect::<Vec<_>>(), &mut clients);
    Ok(build(data, clients))
}

/// Gives each client `labels_per_client` classes (all classes if there
/// are fewer) and splits each class's samples evenly among the clients
/// holding it. Classes go round-robin over a seeded permutation, so every
/// class is held by some client, holders per class differ by at most one,
/// and a client's classes are distinct.
pub fn partition_by_label(
    data: &Dataset,
    num_clients: usize,
    labels_per_client: usize,
    seed: u64,
) -> EngineResult<Vec<Dataset>> {
    check_clients(data, num_clients)?;
    if labels_per_client == 0 {
        return Err(part_err("labels_per_client must be at least 1"));
    }
    let by_class = data.indices_by_class();
    let mut present: Vec<usize> = (0..by_class.len())
        .filter(|&c| !by_class[c].is_empty())
        .collect();
    let per_client = labels_per_client.min(present.len());
    if num_clients.saturating_mul(per_client) < present.len() {
        let cause = format!(
            "{num_clients} clients x {per_client} labels cannot cover {} classes",
            present.len()
        );
        return Err(part_err(cause));
    }
    let mut rng = StdRng::seed_from_u64(seed);
    present.shuffle(&mut rng);
    let mut holders = vec![Vec::new(); by_class.len()];
    for slot in 0..num_clients * per_client {
        holders[present[slot % present.len()]].push(slot / per_client);
    }
    let mut clients = vec![Vec::new(); num_clients];
    for (mut idx, owners) in by_class.into_iter().zip(&holders) {
        idx.shuffle(&mut rng);
        deal(&idx, owners, &mut clients);
    }
    if let Some(empty) = clients.iter().position(Vec::is_empty) {
        return Err(part_err(format!(
            "client {empty} got no samples: its classes are too small to share among {num_clients} clients"
        )));
    }
    Ok(build(data, clients))
}

/// The standard label-skew partition: for each class, client shares are
/// drawn from Dirichlet(alpha, ..., alpha); small alpha (e.g. 0.1) gives
/// each client few dominant classes, large alpha (e.g. 100) is near-IID.
/// Uses [`DirichletOptions::default`], with the per-client minimum capped
/// at an equal share of the samples.
pub fn partition_dirichlet(
    data: &Dataset,
    num_clients: usize,
    alpha: f64,
    seed: u64,
) -> EngineResult<Vec<Dataset>> {
    let equal_share = data.len() / num_clients.max(1);
    let opts = DirichletOptions {
        min_samples: DEFAULT_MIN_CLIENT_SAMPLES.min(equal_share).max(1),
        ..DirichletOptions::default()
    };
    partition_dirichlet_with(data, num_clients, alpha, seed, &opts)
}

/// [`partition_dirichlet`] with explicit options. Redraws the whole
/// partition (continuing the seeded stream, so still reproducible) until
/// every client has `min_samples`, at most `max_attempts` times.
pub fn partition_dirichlet_with(
    data: &Dataset,
    num_clients: usize,
    alpha: f64,
    seed: u64,
    opts: &DirichletOptions,
) -> EngineResult<Vec<Dataset>> {
    check_clients(data, num_clients)?;
    let gamma = dirichlet_gamma(alpha)?;
    let by_class = data.indices_by_class();
    let mut rng = StdRng::seed_from_u64(seed);
    for _ in 0..opts.max_attempts {
        let clients = dirichlet_draw(&by_class, num_clients, &gamma, opts.balance, &mut rng);
        if clients.iter().all(|c| c.len() >= opts.min_samples) {
            return Ok(build(data, clients));
        }
    }
    Err(part_err(format!(
        "could not give all {num_clients} clients at least {} samples in {} draws with alpha {alpha}; \
         raise alpha, lower the minimum or use fewer clients",
        opts.min_samples, opts.max_attempts
    )))
}

/// The per-device label-skew partition of Hsu, Qi and Brown (2019): each
/// client's class mix is drawn from Dirichlet(alpha, ..., alpha) and the
/// clients get near-equal shares, each sample drawn from the client's mix
/// over the classes that still have samples. Unlike
/// [`partition_dirichlet`], which cuts each class among all clients and
/// leaves many clients with nothing when they outnumber the samples of a
/// class, every client gets its share: 1,000 clients on 8,000 samples
/// hold 8 each, however small alpha is.
pub fn partition_dirichlet_sized(
    data: &Dataset,
    num_clients: usize,
    alpha: f64,
    seed: u64,
) -> EngineResult<Vec<Dataset>> {
    check_clients(data, num_clients)?;
    let gamma = dirichlet_gamma(alpha)?;
    let mut rng = StdRng::seed_from_u64(seed);
    let mut by_class = data.indices_by_class();
    by_class
        .iter_mut()
        .for_each(|class| class.shuffle(&mut rng));
    let n = data.len();
    let mut clients = Vec::with_capacity(num_clients);
    let mut mix = vec![0.0; by_class.len()];
    for client in 0..num_clients {
        let share = (client + 1) * n / num_clients - client * n / num_clients;
        mix.iter_mut().for_each(|p| *p = gamma.sample(&mut rng));
        let mut idx = Vec::with_capacity(share);
        for _ in 0..share {
            let class = draw_class(&mix, &by_class, &mut rng);
            idx.push(
                by_class[class]
                    .pop()
                    .expect("draw_class picks a class with samples"),
            );
        }
        clients.push(idx);
    }
    Ok(build(data, clients))
}

/// A class with samples left, by `mix` over those classes, or by how many
/// samples each has left when the mix gives them no weight (it underflowed,
/// or its classes ran out).
fn draw_class(mix: &[f64], by_class: &[Vec<usize>], rng: &mut StdRng) -> usize {
    let left = |c: usize| !by_class[c].is_empty();
    let weight: f64 = (0..mix.len()).filter(|&c| left(c)).map(|c| mix[c]).sum();
    let by_mix = weight > 0.0 && weight.is_finite();
    let total = if by_mix {
        weight
    } else {
        by_class.iter().map(Vec::len).sum::<usize>() as f64
    };
    let mut target = rng.random::<f64>() * total;
    let mut last = None;
    for c in (0..mix.len()).filter(|&c| left(c)) {
        let w = if by_mix {
            mix[c]
        } else {
            by_class[c].len() as f64
        };
        if target < w {
            return c;
        }
        target -= w;
        last = Some(c);
    }
    last.expect("a client's share never exceeds the samples left")
}

/// The Gamma(alpha, 1) that Dirichlet(alpha, ..., alpha) draws are
/// normalised from, once alpha is checked.
fn dirichlet_gamma(alpha: f64) -> EngineResult<Gamma<f64>> {
    if !(alpha.is_finite() && alpha > 0.0) {
        return Err(part_err(format!(
            "alpha must be a positive finite number, got {alpha}"
        )));
    }
    Gamma::new(alpha, 1.0).map_err(|e| part_err(format!("alpha {alpha}: {e}")))
}

/// One full draw: each class's shuffled samples are cut at the cumulative
/// Dirichlet proportions.
fn dirichlet_draw(
    by_class: &[Vec<usize>],
    num_clients: usize,
    gamma: &Gamma<f64>,
    balance: bool,
    rng: &mut StdRng,
) -> Vec<Vec<usize>> {
    let total: usize = by_class.iter().map(Vec::len).sum();
    let cap = total as f64 / num_clients as f64;
    let mut clients: Vec<Vec<usize>> = vec![Vec::new(); num_clients];
    for class in by_class.iter().filter(|c| !c.is_empty()) {
        let mut idx = class.clone();
        idx.shuffle(rng);
        let mut p: Vec<f64> = (0..num_clients).map(|_| gamma.sample(rng)).collect();
        if balance && clients.iter().any(|c| (c.len() as f64) < cap) {
            p.iter_mut()
                .zip(&clients)
                .filter(|(_, c)| c.len() as f64 >= cap)
                .for_each(|(x, _)| *x = 0.0);
        }
        cut(&idx, &mut p, rng, &mut clients);
    }
    clients
}

/// Normalizes `p` and hands out `idx` at the cumulative cut points. When
/// every draw underflowed to 0 (tiny alpha), the class goes to one client,
/// the alpha -> 0 limit, picked at random.
fn cut(idx: &[usize], p: &mut [f64], rng: &mut StdRng, clients: &mut [Vec<usize>]) {
    let sum: f64 = p.iter().sum();
    if !(sum > 0.0 && sum.is_finite()) {
        let pick = rng.random_range(0..p.len());
        p.iter_mut()
            .enumerate()
            .for_each(|(j, x)| *x = f64::from(u8::from(j == pick)));
    }
    let sum: f64 = p.iter().sum();
    let n = idx.len();
    let (mut acc, mut start) = (0.0, 0);
    for (j, &pj) in p.iter().enumerate() {
        acc += pj / sum;
        let end = if j + 1 == p.len() {
            n
        } else {
            ((acc * n as f64).round() as usize).min(n)
        };
        let end = end.max(start);
        clients[j].extend_from_slice(&idx[start..end]);
        start = end;
    }
}
