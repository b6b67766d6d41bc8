//! The model-signing key ring as each server process holds it: loaded at
//! start and reloaded from the database every
//! `limits.signing_key_reload_ms`, so that a rotation made by
//! `canopy-server signing-key rotate` (or another process) is picked up
//! without a restart.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use canopy_protocol::model_sig::{ModelDelegation, ServerKey, SigningKeys};
use tokio::sync::watch;

use crate::db::Db;
use crate::state::AppState;
use crate::store::relayed_signatures;
use crate::store::signing_keys::{self, Ring};

/// A model digest's signature and the key that made it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelSignature {
    pub key_hex: String,
    pub signature_hex: String,
    /// When the key is an edge's, the cloud's leave for it to sign
    /// (`ModelDelegation`, as the JSON of its header).
    pub delegation: Option<String>,
}

/// What a server hands devices as a model's signature: its own key
/// ring's (the cloud), or, on an edge aggregator, the cloud's signatures
/// and key chain, relayed.
pub struct SigningRing {
    own: RwLock<Arc<Ring>>,
    /// On an edge: the cloud's key chain, which devices enrolled here pin
    /// and follow. Signatures are then read from `relayed_signatures`.
    relayed: Option<RwLock<Arc<SigningKeys>>>,
    /// On an edge: its own key (its enrolled aggregator key), which signs
    /// the versions its sub-rounds make under the cloud's delegation.
    delegate: Option<ServerKey>,
}

/// A digest an edge has no cloud signature for.
#[derive(Debug, thiserror::Error)]
pub enum SignatureError {
    #[error(
        "this edge holds no cloud signature for model digest {digest}; it relays only versions \
         it fetched from the cloud"
    )]
    NotRelayed { digest: String },
    #[error("cannot read the relayed signature of model digest {digest}")]
    Database {
        digest: String,
        #[source]
        source: sqlx::Error,
    },
}

impl SigningRing {
    pub fn new(ring: Ring) -> SigningRing {
        SigningRing {
            own: RwLock::new(Arc::new(ring)),
            relayed: None,
            delegate: None,
        }
    }

    /// An edge's ring: models carry the cloud's signatures, and devices
    /// are handed the cloud's `chain`; versions of its own are signed by
    /// `delegate` as the cloud lets it.
    pub fn relaying(ring: Ring, chain: SigningKeys, delegate: ServerKey) -> SigningRing {
        SigningRing {
            own: RwLock::new(Arc::new(ring)),
            relayed: Some(RwLock::new(Arc::new(chain))),
            delegate: Some(delegate),
        }
    }

    /// An edge's signature over a version of its own, under `delegation`,
    /// which must name this edge's key; the reason when it cannot sign.
    pub fn sign_as_delegate(
        &self,
        digest_hex: &str,
        delegation: &ModelDelegation,
    ) -> Result<ModelSignature, String> {
        let Some(key) = &self.delegate else {
            return Err("this server signs for itself and takes no delegation".to_string());
        };
        let (_, delegate) = delegation.verify().map_err(|error| error.to_string())?;
        if delegate != key.public_key() {
            return Err(format!(
                "the cloud's delegation names key {}, and this edge's key is {}",
                delegation.delegate_key,
                key.public_key_hex()
            ));
        }
        Ok(ModelSignature {
            key_hex: key.public_key_hex(),
            signature_hex: key.sign_model(digest_hex),
            delegation: Some(serde_json::to_string(delegation).map_err(|e| e.to_string())?),
        })
    }

    fn ring(&self) -> Arc<Ring> {
        // A poisoned lock still holds a whole ring: replacing it is one store.
        match self.own.read() {
            Ok(ring) => ring.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    fn relayed_chain(&self) -> Option<Arc<SigningKeys>> {
        let relayed = self.relayed.as_ref()?;
        Some(match relayed.read() {
            Ok(chain) => chain.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        })
    }

    /// Replaces the relayed chain with the cloud's latest; no-op on a
    /// server that signs for itself.
    pub fn set_relayed_chain(&self, chain: SigningKeys) {
        if let Some(relayed) = &self.relayed {
            match relayed.write() {
                Ok(mut slot) => *slot = Arc::new(chain),
                Err(poisoned) => *poisoned.into_inner() = Arc::new(chain),
            }
        }
    }

    /// The signature devices verify a model by: this server's own, or on
    /// an edge the cloud's, as relayed.
    pub async fn model_signature(
        &self,
        db: &Db,
        digest_hex: &str,
    ) -> Result<ModelSignature, SignatureError> {
        if self.relayed.is_none() {
            return Ok(self.sign_model(digest_hex));
        }
        relayed_signatures::get(db, digest_hex)
            .await
            .map_err(|source| SignatureError::Database {
                digest: digest_hex.to_string(),
                source,
            })?
            .ok_or_else(|| SignatureError::NotRelayed {
                digest: digest_hex.to_string(),
            })
    }

    /// The key in use's leave for `delegate` to sign models until
    /// `valid_until_ms`; none on an edge, which signs nothing as the cloud.
    pub fn delegate(
        &self,
        delegate: &[u8; 32],
        valid_until_ms: u64,
    ) -> Option<canopy_protocol::model_sig::ModelDelegation> {
        if self.relayed.is_some() {
            return None;
        }
        Some(self.ring().current.delegate(delegate, valid_until_ms))
    }

    /// Signs with the key in use.
    fn sign_model(&self, digest_hex: &str) -> ModelSignature {
        let ring = self.ring();
        ModelSignature {
            key_hex: ring.current.public_key_hex(),
            signature_hex: ring.current.sign_model(digest_hex),
            delegation: None,
        }
    }

    /// The key devices verify models by now: the cloud's on an edge.
    pub fn current_public_key_hex(&self) -> String {
        match self.relayed_chain() {
            Some(chain) => chain.current_key.clone(),
            None => self.ring().current.public_key_hex(),
        }
    }

    /// The key in use and the endorsements that lead to it.
    pub fn chain(&self) -> SigningKeys {
        match self.relayed_chain() {
            Some(chain) => (*chain).clone(),
            None => self.ring().chain.clone(),
        }
    }

    /// Swaps in `ring`; true when the key in use changed.
    fn replace(&self, ring: Ring) -> bool {
        let changed = self.ring().seq != ring.seq;
        match self.own.write() {
            Ok(mut slot) => *slot = Arc::new(ring),
            Err(poisoned) => *poisoned.into_inner() = Arc::new(ring),
        }
        changed
    }
}

/// Reloads the ring until `stop`; a failed reload keeps the ring it has
/// and tries again at the next tick.
pub async fn reload_periodically(state: AppState, mut stop: watch::Receiver<bool>) {
    let period = Duration::from_millis(state.settings.limits.signing_key_reload_ms.max(1));
    loop {
        tokio::select! {
            _ = tokio::time::sleep(period) => {}
            _ = stop.changed() => return,
        }
        if *stop.borrow() {
            return;
        }
        match signing_keys::load_ring(&state.db).await {
            Ok(ring) => {
                let key = ring.current.public_key_hex();
                if state.signing.replace(ring) {
                    tracing::info!(key = %key, "now signing models with a rotated key");
                }
            }
            Err(error) => {
                tracing::warn!(error = %error, "cannot reload the model-signing keys; keeping the ones loaded");
            }
        }
    }
}
