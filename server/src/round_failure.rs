//! Why a round failed: [`RoundFailure`], built where the round fails (the
//! orchestrator, a secure round's stages, a cancellation) and recorded on
//! the round by [`RoundFailure::record`] as its text and its stable
//! [`FailureKind`].

use canopy_protocol::secagg::SecAggError;
use serde::Serialize;
use utoipa::ToSchema;

use crate::fedavg::FedAvgError;
use crate::store::jobs::JobState;
use crate::store::rounds::{self, RoundRow, RoundState, Tx};
use crate::store::text_enum;
use crate::strategy::StateError;

/// Why a round failed. Its text is what the round's and the job's
/// `status_message` say; its [`FailureKind`] is what clients branch on.
#[derive(Debug, thiserror::Error)]
pub enum RoundFailure {
    /// The round's job left `running` for good while the round was open.
    #[error("the job is {state}")]
    JobStopped { state: JobState },
    #[error("the job was cancelled")]
    Cancelled,
    #[error("only {arrived} of the {needed} updates needed arrived before the round closed")]
    TooFewUpdates { arrived: i64, needed: i64 },
    /// The round waited for devices past the job's
    /// `max_wait_for_devices_ms`; `shortfall` is why none could take part
    /// (what the round's status said while it waited).
    #[error(
        "no round could start within the job's `max_wait_for_devices_ms` of {limit_ms} ms: \
         {shortfall}"
    )]
    NoEligibleDevices { limit_ms: u64, shortfall: String },
    #[error("the job's strategy is invalid: {0}")]
    InvalidStrategy(String),
    /// The stored optimizer state is not the one this round follows.
    #[error("the stored strategy state has folded {folded} rounds, but this is round {round}")]
    StrategyStateOutOfStep { folded: i64, round: i64 },
    #[error(transparent)]
    StrategyState(#[from] StateError),
    /// The base model's file does not load; the detail is its error chain.
    #[error("the base model does not load: {0}")]
    BaseModel(String),
    /// The devices' mean update does not fit the model, or applying the
    /// step left a parameter that is not finite.
    #[error(transparent)]
    Averaging(#[from] FedAvgError),
    #[error("the averaged model does not serialise: {0}")]
    Serialise(String),
    #[error("the input statistics cannot be fitted: {0}")]
    Statistics(String),
    /// The selected devices do not fit the job's secure aggregation
    /// settings.
    #[error(transparent)]
    SecurePlan(SecAggError),
    /// More devices left a secure stage than the round tolerates.
    #[error(transparent)]
    SecureDropouts(SecAggError),
    /// The masks could not be removed from the secure sum.
    #[error("{0}")]
    Unmask(String),
    /// A differentially private job would pass its budget with this round.
    #[error(
        "the privacy budget is spent: this round, at sampling rate {sampling_rate}, would take \
         the job's epsilon from {spent} to {would_spend}, past its budget_epsilon of {budget}"
    )]
    PrivacyBudget {
        budget: f64,
        spent: f64,
        would_spend: f64,
        sampling_rate: f64,
    },
    /// A private round's noise or accountant could not be used.
    #[error("differential privacy: {0}")]
    Privacy(String),
    /// A robust round's stored updates could not be aggregated.
    #[error("robust aggregation: {0}")]
    Robust(String),
    /// An edge cannot sign a version its sub-round made: the cloud's
    /// delegation is missing or not for its key.
    #[error("the edge cannot sign its own version: {0}")]
    Delegation(String),
}

text_enum! {
    /// The cause of a round's failure, stable for clients to branch on;
    /// the round's `failure.message` says it in words.
    pub enum FailureKind {
        /// The job failed, completed or was cancelled while the round was
        /// open.
        JobStopped = "job_stopped",
        Cancelled = "cancelled",
        /// Fewer than `min_devices` updates arrived before the round closed.
        TooFewUpdates = "too_few_updates",
        /// Too few devices were eligible for the round to start within the
        /// job's `max_wait_for_devices_ms`; the job fails with it.
        NoEligibleDevices = "no_eligible_devices",
        /// The job's strategy settings cannot be used.
        InvalidStrategy = "invalid_strategy",
        /// The stored server-optimizer state does not fit this round.
        StrategyState = "strategy_state",
        /// The next model could not be built from the base model and the
        /// mean update.
        AggregationFailed = "aggregation_failed",
        /// Applying the step left a parameter that is not finite.
        ModelNotFinite = "model_not_finite",
        /// A statistics round's moments could not fit the input statistics.
        StatisticsUnfitted = "statistics_unfitted",
        /// The selected devices do not fit the secure aggregation settings.
        SecurePlanRefused = "secure_plan_refused",
        /// More devices left a secure stage than the round tolerates.
        SecureDropouts = "secure_dropouts",
        /// The secure sum could not be unmasked.
        UnmaskFailed = "unmask_failed",
        /// A differentially private job stopped, completed, before a round
        /// that would have passed its `budget_epsilon`.
        PrivacyBudget = "privacy_budget",
        /// A private round's noise secret or accountant state could not be
        /// used.
        PrivacyState = "privacy_state",
        /// The round failed before this server recorded causes.
        Unrecorded = "unrecorded",
    }
}

impl RoundFailure {
    pub fn kind(&self) -> FailureKind {
        match self {
            RoundFailure::JobStopped { .. } => FailureKind::JobStopped,
            RoundFailure::Cancelled => FailureKind::Cancelled,
            RoundFailure::TooFewUpdates { .. } => FailureKind::TooFewUpdates,
            RoundFailure::NoEligibleDevices { .. } => FailureKind::NoEligibleDevices,
            RoundFailure::InvalidStrategy(_) => FailureKind::InvalidStrategy,
            RoundFailure::StrategyStateOutOfStep { .. } | RoundFailure::StrategyState(_) => {
                FailureKind::StrategyState
            }
            RoundFailure::Averaging(FedAvgError::NonFinite { .. }) => FailureKind::ModelNotFinite,
            RoundFailure::BaseModel(_)
            | RoundFailure::Averaging(_)
            | RoundFailure::Serialise(_)
            | RoundFailure::Robust(_)
            | RoundFailure::Delegation(_) => FailureKind::AggregationFailed,
            RoundFailure::Statistics(_) => FailureKind::StatisticsUnfitted,
            RoundFailure::SecurePlan(_) => FailureKind::SecurePlanRefused,
            RoundFailure::SecureDropouts(_) => FailureKind::SecureDropouts,
            RoundFailure::Unmask(_) => FailureKind::UnmaskFailed,
            RoundFailure::PrivacyBudget { .. } => FailureKind::PrivacyBudget,
            RoundFailure::Privacy(_) => FailureKind::PrivacyState,
        }
    }

    /// Fails the round with this cause (its job too, once it has failed
    /// more than `max_retries` times) and logs it: the one place a round
    /// fails. Returns the round's final state, for the metrics.
    pub async fn record(
        &self,
        tx: &mut Tx<'_>,
        round: &RoundRow,
        max_retries: i64,
    ) -> Result<RoundState, sqlx::Error> {
        rounds::fail(tx, round, self, max_retries).await?;
        tracing::warn!(
            round = round.id,
            job = round.job_id,
            number = round.number,
            kind = self.kind().as_str(),
            reason = %self,
            "round failed"
        );
        Ok(RoundState::Failed)
    }
}

/// Why a round failed, as the admin API gives it.
#[derive(Debug, Serialize, ToSchema)]
pub struct FailureView {
    pub kind: FailureKind,
    /// The cause in words: the round's `status_message`.
    pub message: String,
}

impl FailureView {
    /// The failure of a round, if it failed. A kind this server does not
    /// know (a newer server wrote it) reads as `unrecorded`.
    pub fn of(round: &RoundRow) -> Option<FailureView> {
        (round.state == RoundState::Failed).then(|| FailureView {
            kind: round
                .failure_kind
                .as_deref()
                .and_then(FailureKind::parse)
                .unwrap_or(FailureKind::Unrecorded),
            message: round.status_message.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The stored text of each cause is the text the round recorded
    /// before the causes were typed, so messages clients read are unchanged.
    #[test]
    fn the_text_is_unchanged_and_each_cause_has_its_kind() {
        let cases = [
            (
                RoundFailure::TooFewUpdates {
                    arrived: 1,
                    needed: 2,
                },
                "only 1 of the 2 updates needed arrived before the round closed",
                "too_few_updates",
            ),
            (
                RoundFailure::JobStopped {
                    state: JobState::Failed,
                },
                "the job is failed",
                "job_stopped",
            ),
            (
                RoundFailure::Cancelled,
                "the job was cancelled",
                "cancelled",
            ),
            (
                RoundFailure::NoEligibleDevices {
                    limit_ms: 2_000,
                    shortfall: "0 eligible online, the round needs at least 1".into(),
                },
                "no round could start within the job's `max_wait_for_devices_ms` of 2000 ms: \
                 0 eligible online, the round needs at least 1",
                "no_eligible_devices",
            ),
            (
                RoundFailure::Averaging(FedAvgError::NonFinite {
                    name: "w".into(),
                    index: 3,
                }),
                "the averaged value of `w` at 3 is not finite",
                "model_not_finite",
            ),
            (
                RoundFailure::PrivacyBudget {
                    budget: 2.0,
                    spent: 1.5,
                    would_spend: 2.25,
                    sampling_rate: 0.5,
                },
                "the privacy budget is spent: this round, at sampling rate 0.5, would take the \
                 job's epsilon from 1.5 to 2.25, past its budget_epsilon of 2",
                "privacy_budget",
            ),
            (
                RoundFailure::Averaging(FedAvgError::NoWeight),
                "no update was accepted, so there is nothing to average",
                "aggregation_failed",
            ),
        ];
        for (failure, text, kind) in cases {
            assert_eq!(failure.to_string(), text);
            assert_eq!(failure.kind().as_str(), kind);
            assert_eq!(FailureKind::parse(kind), Some(failure.kind()));
            assert_eq!(
                serde_json::to_value(failure.kind()).unwrap(),
                serde_json::Value::from(kind)
            );
        }
    }
}
