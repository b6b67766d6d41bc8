//! Keeps one rayon worker awake while kernels are splitting work.
//!
//! A training step splits many medium-sized kernels between the cores (a
//! GRU's 160 products per step, every few hundred microseconds). Between
//! two of them an idle rayon worker falls asleep, and waking it costs more
//! than half such a kernel: measured on 2 cores, splitting the MLP's
//! 64×784×128 layers made its training 0.61× as fast as not splitting
//! them. So every kernel calls [`keep_hot`] before it splits, and the first
//! call spawns a *keeper*: a rayon task that runs the pool's pending jobs
//! (`rayon::yield_now`, which steals the other half of each `join`) and
//! spins between them, until [`HOT_FOR`] has passed since the last split.
//! A step thus pays one wake-up, not one per kernel, and no thread beyond
//! rayon's exists, so matmul and every other kernel still share one pool.
//!
//! The cost is one core spinning for at most [`HOT_FOR`] after the last
//! split; the keeper never blocks anyone (it is not joined). There is one
//! keeper per process, in the pool of the split that spawned it: while it
//! lives, splits in another pool (an app running two) extend its time
//! without a keeper of their own, which costs them the wake-ups again but
//! nothing else.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How long the keeper spins after the last split. Longer than the gap
/// between the steps of a training loop (shuffling and gathering a batch
/// take tens of microseconds), short enough that nobody notices a core busy
/// after training ends.
pub const HOT_FOR: Duration = Duration::from_millis(2);

/// Spin iterations between two reads of the clock.
const SPINS_PER_CLOCK_READ: u32 = 64;

static KEEPER_ALIVE: AtomicBool = AtomicBool::new(false);
/// Nanoseconds since [`origin`] until which the keeper keeps spinning.
static HOT_UNTIL_NS: AtomicU64 = AtomicU64::new(0);

fn origin() -> Instant {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    *ORIGIN.get_or_init(Instant::now)
}

fn now_ns() -> u64 {
    u64::try_from(origin().elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// Called just before a kernel splits work with `rayon::join`: makes sure
/// a keeper is (or soon will be) awake to take the other half, and keeps
/// it awake for [`HOT_FOR`] more.
pub fn keep_hot() {
    if rayon::current_num_threads() < 2 {
        return;
    }
    let until = now_ns().saturating_add(HOT_FOR.as_nanos() as u64);
    HOT_UNTIL_NS.fetch_max(until, Ordering::Relaxed);
    if !KEEPER_ALIVE.swap(true, Ordering::AcqRel) {
        rayon::spawn(keeper);
    }
}

/// Whether a keeper is running now.
#[cfg(test)]
fn keeper_alive() -> bool {
    KEEPER_ALIVE.load(Ordering::Acquire)
}

fn keeper() {
    let mut spins = 0u32;
    loop {
        match rayon::yield_now() {
            Some(rayon::Yield::Executed) => continue,
            Some(rayon::Yield::Idle) => std::hint::spin_loop(),
            None => break,
        }
        spins += 1;
        if spins < SPINS_PER_CLOCK_READ {
            continue;
        }
        spins = 0;
        if now_ns() <= HOT_UNTIL_NS.load(Ordering::Relaxed) {
            continue;
        }
        KEEPER_ALIVE.store(false, Ordering::Release);
        // A `keep_hot` between the clock read and the store saw the keeper
        // alive and spawned none: it extended the deadline, so carry on,
        // unless another keeper has started since.
        let extended = now_ns() <= HOT_UNTIL_NS.load(Ordering::Relaxed);
        if !extended || KEEPER_ALIVE.swap(true, Ordering::AcqRel) {
            return;
        }
    }
    KEEPER_ALIVE.store(false, Ordering::Release);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_keeper_runs_while_splits_come_and_stops_after_hot_for() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        pool.install(|| {
            for _ in 0..20 {
                keep_hot();
                let (a, b) = rayon::join(
                    || (0..1000u64).sum::<u64>(),
                    || (0..1000u64).product::<u64>(),
                );
                assert_eq!((a, b), (499_500, 0));
            }
            assert!(keeper_alive(), "a keeper runs right after a split");
        });
        // Other tests in this binary may split products too and keep the
        // keeper awake for a while; none splits for seconds on end.
        let deadline = Instant::now() + Duration::from_secs(10);
        while keeper_alive() && Instant::now() < deadline {
            std::thread::sleep(HOT_FOR);
        }
        assert!(!keeper_alive(), "the keeper stops once HOT_FOR has passed");
    }
}
