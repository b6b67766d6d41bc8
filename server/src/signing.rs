//! The model-signing key ring as each server process holds it: loaded at
//! start and reloaded from the database every
//! `limits.signing_key_reload_ms`, so that a rotation made by
//! `canopy-server signing-key rotate` (or another process) is picked up
//! without a restart.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use canopy_protocol::model_sig::SigningKeys;
use tokio::sync::watch;

use crate::state::AppState;
use crate::store::signing_keys::{self, Ring};

/// A model digest's signature and the key that made it.
pub struct ModelSignature {
    pub key_hex: String,
    pub signature_hex: String,
}

pub struct SigningRing(RwLock<Arc<Ring>>);

impl SigningRing {
    pub fn new(ring: Ring) -> SigningRing {
        SigningRing(RwLock::new(Arc::new(ring)))
    }

    fn ring(&self) -> Arc<Ring> {
        // A poisoned lock still holds a whole ring: replacing it is one store.
        match self.0.read() {
            Ok(ring) => ring.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Signs with the key in use.
    pub fn sign_model(&self, digest_hex: &str) -> ModelSignature {
        let ring = self.ring();
        ModelSignature {
            key_hex: ring.current.public_key_hex(),
            signature_hex: ring.current.sign_model(digest_hex),
        }
    }

    pub fn current_public_key_hex(&self) -> String {
        self.ring().current.public_key_hex()
    }

    /// The key in use and the endorsements that lead to it.
    pub fn chain(&self) -> SigningKeys {
        self.ring().chain.clone()
    }

    /// Swaps in `ring`; true when the key in use changed.
    fn replace(&self, ring: Ring) -> bool {
        let changed = self.ring().seq != ring.seq;
        match self.0.write() {
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
