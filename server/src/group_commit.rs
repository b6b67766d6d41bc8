//! Group commit: writes that arrive together share one transaction.
//!
//! Items queue under a key (a round's updates, the server's nonces); one
//! worker per key drains whatever has queued, up to a batch, into one
//! write, and answers each item from it. The worker is its own task, so a
//! request that goes away mid-write leaves nothing half-done: its item is
//! written and answered (to no one) with the rest. Taking a batch and
//! retiring the worker happen under the lock that [`GroupCommit::submit`]
//! checks, so an item is never left queued without a worker.
//!
//! Used by update folds (`api::device::folds`) and by the nonces of
//! signed requests (`store::devices::NonceBook`).

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::hash::Hash;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::oneshot;

/// Queues of items of type `T` by key `K`, each answered with an `A`.
pub struct GroupCommit<K, T, A> {
    queues: Arc<Mutex<Queues<K, T, A>>>,
}

struct Queues<K, T, A> {
    pending: HashMap<K, Vec<(T, oneshot::Sender<A>)>>,
    /// Keys with a worker draining them.
    active: HashSet<K>,
}

impl<K, T, A> Default for GroupCommit<K, T, A> {
    fn default() -> Self {
        GroupCommit {
            queues: Arc::new(Mutex::new(Queues {
                pending: HashMap::new(),
                active: HashSet::new(),
            })),
        }
    }
}

impl<K, T, A> GroupCommit<K, T, A>
where
    K: Hash + Eq + Clone + Send + 'static,
    T: Send + 'static,
    A: Send + 'static,
{
    /// Queues `item` under `key` and waits for its answer. When no worker
    /// drains `key`, this call starts one that writes batches of at most
    /// `max_batch` items with `write`, which must answer every item of its
    /// batch, in order. `None` when the worker stopped without answering
    /// (it panicked).
    pub async fn submit<W, Fut>(&self, key: K, item: T, max_batch: usize, write: W) -> Option<A>
    where
        W: FnMut(K, Vec<T>) -> Fut + Send + 'static,
        Fut: Future<Output = Vec<A>> + Send + 'static,
    {
        let (reply, answer) = oneshot::channel();
        let start_worker = {
            let mut queues = lock(&self.queues);
            queues
                .pending
                .entry(key.clone())
                .or_default()
                .push((item, reply));
            queues.active.insert(key.clone())
        };
        if start_worker {
            tokio::spawn(drain(self.queues.clone(), key, max_batch.max(1), write));
        }
        answer.await.ok()
    }
}

fn lock<K, T, A>(queues: &Mutex<Queues<K, T, A>>) -> MutexGuard<'_, Queues<K, T, A>> {
    queues.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Writes batches of `key`'s queue until it is empty, then retires.
async fn drain<K, T, A, W, Fut>(
    queues: Arc<Mutex<Queues<K, T, A>>>,
    key: K,
    max_batch: usize,
    mut write: W,
) where
    K: Hash + Eq + Clone,
    W: FnMut(K, Vec<T>) -> Fut,
    Fut: Future<Output = Vec<A>>,
{
    loop {
        let batch = {
            let mut queues = lock(&queues);
            let queue = queues.pending.entry(key.clone()).or_default();
            if queue.is_empty() {
                queues.pending.remove(&key);
                queues.active.remove(&key);
                return;
            }
            let take = queue.len().min(max_batch);
            queue.drain(..take).collect::<Vec<_>>()
        };
        let (items, replies): (Vec<T>, Vec<_>) = batch.into_iter().unzip();
        let answers = write(key.clone(), items).await;
        debug_assert_eq!(answers.len(), replies.len(), "one answer per item");
        for (reply, answer) in replies.into_iter().zip(answers) {
            // The request may have gone; what it asked for is done.
            let _ = reply.send(answer);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn items_queued_meanwhile_share_a_batch_and_each_gets_its_answer() {
        let commits: Arc<GroupCommit<u8, u32, (u32, usize)>> = Arc::default();
        let batches = Arc::new(Mutex::new(Vec::new()));
        let (open, gate) = tokio::sync::watch::channel(false);
        let submit = |item: u32| {
            let (commits, batches, gate) = (commits.clone(), batches.clone(), gate.clone());
            tokio::spawn(async move {
                let write = move |_key, items: Vec<u32>| {
                    let (batches, mut gate) = (batches.clone(), gate.clone());
                    async move {
                        // The first batch waits, so the rest queue behind it.
                        let _ = gate.wait_for(|open| *open).await;
                        batches.lock().unwrap().push(items.len());
                        items.iter().map(|&i| (i * 10, items.len())).collect()
                    }
                };
                commits.submit(1, item, 3, write).await
            })
        };
        let first = submit(0);
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        let rest: Vec<_> = (1..6).map(submit).collect();
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        open.send(true).unwrap();
        assert_eq!(first.await.unwrap(), Some((0, 1)));
        for (i, handle) in (1..6).zip(rest) {
            let (answer, _) = handle.await.unwrap().unwrap();
            assert_eq!(answer, i * 10);
        }
        // One alone, then the five queued behind it in batches of at most 3.
        assert_eq!(*batches.lock().unwrap(), vec![1, 3, 2]);
        assert!(
            lock(&commits.queues).active.is_empty(),
            "the worker retired"
        );
    }
}
