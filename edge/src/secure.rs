//! A secure cloud round, where the aggregators are the SecAgg+
//! participants (docs/secure-aggregation.md, "Tiers").
//!
//! The edge exchanges its round keys with the cloud as soon as it takes
//! the task, while its sub-round runs (itself secure among its end
//! devices, so the edge learns only their sum). When the sub-round has
//! closed, it masks the sub-round's mean update, weighted by the
//! sub-round's total weight, and finishes the cloud's stages: the cloud
//! learns only the sum over its aggregators.
//!
//! The round's secrets live in this process alone, as a device's do: an
//! edge that restarts in the middle of a secure cloud round cannot mask
//! for it any more, and is one of the dropouts the cloud's plan survives.
//! It tells the cloud so at once (a decline) instead of leaving the cloud
//! to wait for its deadline.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use canopy_protocol::messages::Task;
use canopy_sdk::{DeviceClient, SecureRound};
use canopy_term::error_chain as chain;

/// Where the edge's part in one secure cloud round stands.
enum Session {
    /// AdvertiseKeys, ShareKeys and ShareCheck are under way.
    Exchanging,
    /// Keys exchanged: the round waits for the sub-round's result.
    Keyed(Box<SecureRound>),
    /// The masked result is on its way; the uplink is this session's.
    Masking,
    /// The cloud's round went on without this edge: why.
    Lost(String),
}

/// The secure cloud rounds this process takes part in, by cloud round id.
#[derive(Clone, Default)]
pub struct Sessions {
    inner: Arc<Mutex<HashMap<i64, Session>>>,
}

impl Sessions {
    fn sessions(&self) -> MutexGuard<'_, HashMap<i64, Session>> {
        // A panic elsewhere cannot leave the map half-written: every
        // change is a single insert or remove.
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Starts the key stages of a secure cloud round in the background.
    pub fn begin(&self, cloud: &DeviceClient, task: &Task) {
        let round_id = task.round_id;
        self.sessions().insert(round_id, Session::Exchanging);
        let (cloud, task, sessions) = (cloud.clone(), task.clone(), self.clone());
        tokio::spawn(async move {
            let session = match cloud.begin_secure_round(&task).await {
                Ok(round) => {
                    tracing::info!(
                        round = round_id,
                        "exchanged keys with the other aggregators"
                    );
                    Session::Keyed(Box::new(round))
                }
                Err(error) => {
                    let reason = chain(&error);
                    tracing::warn!(round = round_id, %reason, "the cloud's secure round started without this aggregator");
                    Session::Lost(format!(
                        "the cloud's secure round went on without this aggregator: {reason}"
                    ))
                }
            };
            // Only into the place it left: a round the uplink has ended
            // meanwhile (its sub-round failed) keeps no keys.
            if let Some(place @ Session::Exchanging) = sessions.sessions().get_mut(&round_id) {
                *place = session;
            }
        });
    }

    /// Takes the round's keys for its closed sub-round's result: `None`
    /// while they are still being exchanged or the masked result is
    /// already on its way, or why the edge is out of the round.
    pub fn turn(&self, round_id: i64) -> Result<Option<Box<SecureRound>>, String> {
        let mut sessions = self.sessions();
        match sessions.remove(&round_id) {
            Some(Session::Keyed(round)) => {
                sessions.insert(round_id, Session::Masking);
                Ok(Some(round))
            }
            Some(Session::Lost(reason)) => {
                sessions.insert(round_id, Session::Lost(reason.clone()));
                Err(reason)
            }
            Some(waiting @ (Session::Exchanging | Session::Masking)) => {
                sessions.insert(round_id, waiting);
                Ok(None)
            }
            None => Err(
                "this aggregator restarted during the cloud's secure round, and its \
                 round keys died with its process (they are never written down), so it cannot \
                 mask its result for this round"
                    .to_string(),
            ),
        }
    }

    /// The round is over for this edge: its keys (if any) are dropped.
    pub fn end(&self, round_id: i64) {
        self.sessions().remove(&round_id);
    }
}
