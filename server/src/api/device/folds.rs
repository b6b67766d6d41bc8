//! Group commit for update folds.
//!
//! Each fold rewrites the round's model-sized running sum, so folding one
//! update per transaction makes the database the bottleneck. Uploads to
//! the same round queue here instead; one worker per round drains whatever
//! has queued into a single transaction and answers every upload after
//! the commit, so an upload is acknowledged only once it is committed
//! (what a commit survives: ARCHITECTURE.md, "What a commit survives"). Plain
//! updates, secure rounds' masked inputs and their smaller stage messages
//! (keys, shares, signatures, revealed shares) each have a queue
//! ([`Foldable`]), drained by the server's one group commit
//! ([`crate::group_commit`]).

use std::future::Future;

use crate::api::error::ApiError;
use crate::group_commit::GroupCommit;
use crate::state::AppState;
use crate::store::rounds::{self, AcceptedUpdate, UploadRejection};
use canopy_term::error_chain as chain;

#[derive(Debug)]
pub enum FoldError<R> {
    Refused(R),
    Failed(ApiError),
}

/// What a round's fold worker folds, a batch per transaction.
pub trait Foldable: Sized + Send + 'static {
    /// Why one item of a batch was refused (the others still fold).
    type Refusal: Send + 'static;

    /// This kind's queue in the server's state.
    fn queue(state: &AppState) -> &FoldQueue<Self>;

    /// Folds `batch` into round `round_id` in one transaction: per item in
    /// order, the number accepted so far or why it was refused. An error
    /// fails the whole batch, and nothing of it is kept.
    fn fold_batch(
        state: &AppState,
        round_id: i64,
        batch: Vec<Self>,
    ) -> impl Future<Output = Result<Vec<Result<u64, Self::Refusal>>, sqlx::Error>> + Send;
}

impl Foldable for AcceptedUpdate {
    type Refusal = UploadRejection;

    fn queue(state: &AppState) -> &FoldQueue<Self> {
        &state.folds
    }

    /// An asynchronous job's updates wait, up to [`MAX_WAIT_FOR_BUFFER`],
    /// while its buffer is full or becoming a version and the next is not
    /// open yet; those that found room are answered with the rest.
    async fn fold_batch(
        state: &AppState,
        round_id: i64,
        batch: Vec<Self>,
    ) -> Result<Vec<Result<u64, UploadRejection>>, sqlx::Error> {
        let give_up = std::time::Instant::now() + MAX_WAIT_FOR_BUFFER;
        let mut answers: Vec<Option<Result<u64, UploadRejection>>> = Vec::new();
        answers.resize_with(batch.len(), || None);
        let mut waiting: Vec<(usize, Self)> = batch.into_iter().enumerate().collect();
        loop {
            let (places, updates): (Vec<usize>, Vec<Self>) = waiting.into_iter().unzip();
            let outcomes = rounds::accept_updates(&state.db, round_id, &updates).await?;
            let last_try = std::time::Instant::now() >= give_up;
            waiting = Vec::new();
            for ((place, update), outcome) in places.into_iter().zip(updates).zip(outcomes) {
                match outcome {
                    Err(UploadRejection::NoOpenBuffer { .. }) if !last_try => {
                        waiting.push((place, update));
                    }
                    outcome => answers[place] = Some(outcome),
                }
            }
            if waiting.is_empty() {
                let no_buffer = || Err(UploadRejection::NoOpenBuffer { round_id });
                return Ok(answers
                    .into_iter()
                    .map(|a| a.unwrap_or_else(no_buffer))
                    .collect());
            }
            tokio::time::sleep(BUFFER_POLL).await;
        }
    }
}

/// How long an update to an asynchronous job waits for its next buffer to
/// open: far longer than making a version takes.
pub const MAX_WAIT_FOR_BUFFER: std::time::Duration = std::time::Duration::from_secs(30);
/// How often a waiting update looks for the next buffer.
const BUFFER_POLL: std::time::Duration = std::time::Duration::from_millis(10);

/// A kind's queues of items by round, each answered with how many the
/// round had accepted with it, or why not.
pub type FoldQueue<T> = GroupCommit<i64, T, Result<u64, FoldError<<T as Foldable>::Refusal>>>;

/// Queues an item and waits until it is committed or refused.
pub async fn submit<T: Foldable>(
    state: &AppState,
    round_id: i64,
    item: T,
) -> Result<u64, FoldError<T::Refusal>> {
    let worker_state = state.clone();
    let max_batch = state.settings.limits.max_fold_batch;
    let write = move |round_id, items| fold_and_answer(worker_state.clone(), round_id, items);
    T::queue(state)
        .submit(round_id, item, max_batch, write)
        .await
        .unwrap_or_else(|| {
            Err(FoldError::Failed(ApiError::internal(
                "the fold worker stopped",
            )))
        })
}

/// Folds one batch into its round in one transaction and answers each
/// item; a failure of the transaction answers every item with it.
async fn fold_and_answer<T: Foldable>(
    state: AppState,
    round_id: i64,
    items: Vec<T>,
) -> Vec<Result<u64, FoldError<T::Refusal>>> {
    let count = items.len();
    match T::fold_batch(&state, round_id, items).await {
        Ok(outcomes) => {
            state.orchestrator_wake.notify_one();
            outcomes
                .into_iter()
                .map(|outcome| outcome.map_err(FoldError::Refused))
                .collect()
        }
        Err(error) => {
            let busy = matches!(error, sqlx::Error::PoolTimedOut);
            let message = chain(&error);
            tracing::error!(round = round_id, error = %message, "cannot fold a batch");
            let failure = || {
                FoldError::Failed(if busy {
                    ApiError::unavailable("the database is busy; retry the upload shortly")
                } else {
                    ApiError::internal(format!("cannot commit the batch: {message}"))
                })
            };
            (0..count).map(|_| Err(failure())).collect()
        }
    }
}
