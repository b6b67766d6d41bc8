//! Group commit for update folds.
//!
//! Each fold rewrites the round's model-sized running sum, so folding one
//! update per transaction makes the database the bottleneck. Uploads to
//! the same round queue here instead; one worker per round drains whatever
//! has queued into a single transaction and answers every upload after
//! the commit, so an upload is acknowledged only once it is durable.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use tokio::sync::oneshot;

use crate::api::error::ApiError;
use crate::state::AppState;
use crate::store::rounds::{self, AcceptedUpdate, UploadRejection};
use canopy_term::error_chain as chain;

type Reply = oneshot::Sender<Result<u64, FoldError>>;

#[derive(Debug)]
pub enum FoldError {
    Refused(UploadRejection),
    Failed(ApiError),
}

#[derive(Default)]
pub struct FoldQueue {
    inner: Mutex<Queues>,
}

#[derive(Default)]
struct Queues {
    pending: HashMap<i64, Vec<(AcceptedUpdate, Reply)>>,
    /// Rounds with a worker draining them.
    active: HashSet<i64>,
}

/// Queues an update and waits until it is committed or refused.
pub async fn submit(
    state: &AppState,
    round_id: i64,
    update: AcceptedUpdate,
) -> Result<u64, FoldError> {
    let (reply, answer) = oneshot::channel();
    let start_worker = {
        let mut queues = state
            .folds
            .inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        queues
            .pending
            .entry(round_id)
            .or_default()
            .push((update, reply));
        queues.active.insert(round_id)
    };
    if start_worker {
        tokio::spawn(drain(state.clone(), round_id));
    }
    answer.await.unwrap_or_else(|_| {
        Err(FoldError::Failed(ApiError::internal(
            "the fold worker stopped",
        )))
    })
}

/// Folds batches until the round's queue is empty, then retires. Taking
/// the batch and retiring happen under the same lock as `submit`'s check,
/// so an update is never left queued without a worker.
async fn drain(state: AppState, round_id: i64) {
    loop {
        let batch = {
            let mut queues = state
                .folds
                .inner
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            let queue = queues.pending.entry(round_id).or_default();
            if queue.is_empty() {
                queues.pending.remove(&round_id);
                queues.active.remove(&round_id);
                return;
            }
            let take = queue.len().min(state.settings.limits.max_fold_batch);
            queue.drain(..take).collect::<Vec<_>>()
        };
        let (updates, replies): (Vec<_>, Vec<_>) = batch.into_iter().unzip();
        match rounds::accept_updates(&state.db, round_id, &updates).await {
            Ok(outcomes) => {
                for (reply, outcome) in replies.into_iter().zip(outcomes) {
                    let _ = reply.send(outcome.map_err(FoldError::Refused));
                }
                state.orchestrator_wake.notify_one();
            }
            Err(error) => {
                let busy = matches!(error, sqlx::Error::PoolTimedOut);
                let message = chain(&error);
                tracing::error!(round = round_id, error = %message, "cannot fold a batch of updates");
                for reply in replies {
                    let failure = if busy {
                        ApiError::unavailable("the database is busy; retry the upload shortly")
                    } else {
                        ApiError::internal(format!("cannot fold the update: {message}"))
                    };
                    let _ = reply.send(Err(FoldError::Failed(failure)));
                }
            }
        }
    }
}
