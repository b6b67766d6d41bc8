//! The server's signature over a model digest, so that a device can tell
//! that the model it downloaded was published by its own server even when
//! the bytes came through a cache or CDN.

use ed25519_dalek::Signer;
use serde::{Deserialize, Serialize};

use crate::keys;

pub const MODEL_SIGNATURE_DOMAIN: &str = "canopy-model-v1";
/// 64 hex characters: the model's content digest (SHA-256), as computed by
/// `canopy_ir::format::digest` and spelled by `canopy_ir::format::digest_hex`.
pub const HEADER_MODEL_DIGEST: &str = "x-canopy-model-digest";
/// 128 hex characters: [`ServerKey::sign_model`] of the digest.
pub const HEADER_MODEL_SIGNATURE: &str = "x-canopy-model-signature";

const DIGEST_HEX_LEN: usize = 64;

keys::signing_key_type!(
    /// The server's Ed25519 secret key for signing models.
    ServerKey
);

impl ServerKey {
    /// Hex signature over `MODEL_SIGNATURE_DOMAIN + "\n" + digest_hex + "\n"`.
    /// The digest is lowercased first so that both ends sign and verify the
    /// same bytes whatever spelling they were handed.
    pub fn sign_model(&self, digest_hex: &str) -> String {
        hex::encode(self.0.sign(&model_message(digest_hex)).to_bytes())
    }
}

fn model_message(digest_hex: &str) -> Vec<u8> {
    format!(
        "{MODEL_SIGNATURE_DOMAIN}\n{}\n",
        digest_hex.to_ascii_lowercase()
    )
    .into_bytes()
}

/// Checks that `signature_hex` is the server's signature over `digest_hex`.
pub fn verify_model_signature(
    server_public_key: &[u8; 32],
    digest_hex: &str,
    signature_hex: &str,
) -> Result<(), ModelSignatureError> {
    let digest_lower = digest_hex.to_ascii_lowercase();
    if !keys::is_lower_hex(&digest_lower, DIGEST_HEX_LEN) {
        return Err(ModelSignatureError::Malformed {
            reason: format!(
                "model digest must be {DIGEST_HEX_LEN} hex characters, got {} characters",
                digest_hex.len()
            ),
        });
    }
    let key = keys::verifying_key(server_public_key).map_err(|reason| {
        ModelSignatureError::Malformed {
            reason: format!("server public key: {reason}"),
        }
    })?;
    let signature =
        keys::parse_signature_hex(&signature_hex.to_ascii_lowercase()).map_err(|reason| {
            ModelSignatureError::Malformed {
                reason: format!("model signature: {reason}"),
            }
        })?;
    key.verify_strict(&model_message(&digest_lower), &signature)
        .map_err(|_| ModelSignatureError::Mismatch {
            digest: digest_lower,
        })
}

#[derive(Debug, thiserror::Error)]
pub enum ModelSignatureError {
    #[error("model signature is malformed: {reason}")]
    Malformed { reason: String },
    #[error(
        "model signature does not match digest {digest} under the server's public key; the model was altered or signed by a different server"
    )]
    Mismatch { digest: String },
}

/// 64 hex characters: the public key whose signature
/// [`HEADER_MODEL_SIGNATURE`] is. A device that does not trust it yet asks
/// the server for the endorsement chain that leads to it.
pub const HEADER_MODEL_KEY: &str = "x-canopy-model-key";
/// What a retiring key signs when it endorses its successor.
pub const KEY_ROTATION_DOMAIN: &str = "canopy-model-key-rotation-v1";
/// The most endorsements a device follows in one go, and the most the
/// server sends. A device that slept through more rotations than this
/// cannot follow them and has to enroll again.
pub const MAX_KEY_CHAIN_LEN: usize = 16;

/// A retiring key's statement that `next_key` replaces it, and that its own
/// signatures stay acceptable until `previous_valid_until_ms` (Unix
/// milliseconds), so that models signed just before the rotation (or by a
/// server process that has not reloaded yet) still verify.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyEndorsement {
    /// Hex public key of the retiring key, which made `signature`.
    pub previous_key: String,
    /// Hex public key of its successor.
    pub next_key: String,
    pub previous_valid_until_ms: u64,
    /// 128 hex characters: Ed25519 over [`endorsement_message`].
    pub signature: String,
}

/// The bytes one key signs about another until a time, under `domain`:
/// `domain \n by hex \n about hex \n until_ms \n`. An endorsement and a
/// delegation are both such statements; their domains keep either from
/// passing for the other.
fn statement_message(domain: &str, by: &[u8; 32], about: &[u8; 32], until_ms: u64) -> Vec<u8> {
    format!(
        "{domain}\n{}\n{}\n{until_ms}\n",
        hex::encode(by),
        hex::encode(about)
    )
    .into_bytes()
}

/// Checks a statement's signature under its `by` key; returns both keys,
/// or what is wrong, naming which key (`by_name`, `about_name`).
fn verify_statement(
    domain: &str,
    (by_name, by_hex): (&str, &str),
    (about_name, about_hex): (&str, &str),
    until_ms: u64,
    signature_hex: &str,
) -> Result<([u8; 32], [u8; 32]), String> {
    let by = keys::parse_verifying_key_hex(by_hex).map_err(|e| format!("{by_name} key: {e}"))?;
    let about =
        keys::parse_verifying_key_hex(about_hex).map_err(|e| format!("{about_name} key: {e}"))?;
    let signature =
        keys::parse_signature_hex(signature_hex).map_err(|e| format!("signature: {e}"))?;
    let message = statement_message(domain, &by.to_bytes(), &about.to_bytes(), until_ms);
    by.verify_strict(&message, &signature)
        .map_err(|_| format!("the signature does not verify under the {by_name} key"))?;
    Ok((by.to_bytes(), about.to_bytes()))
}

/// The bytes a retiring key signs:
/// `KEY_ROTATION_DOMAIN \n previous hex \n next hex \n valid_until_ms \n`.
pub fn endorsement_message(
    previous_key: &[u8; 32],
    next_key: &[u8; 32],
    previous_valid_until_ms: u64,
) -> Vec<u8> {
    statement_message(
        KEY_ROTATION_DOMAIN,
        previous_key,
        next_key,
        previous_valid_until_ms,
    )
}

impl ServerKey {
    /// This key's endorsement of `next_key` as its successor.
    pub fn endorse(&self, next_key: &[u8; 32], previous_valid_until_ms: u64) -> KeyEndorsement {
        let previous_key = self.public_key();
        let message = endorsement_message(&previous_key, next_key, previous_valid_until_ms);
        KeyEndorsement {
            previous_key: hex::encode(previous_key),
            next_key: hex::encode(next_key),
            previous_valid_until_ms,
            signature: hex::encode(self.sign_message(&message)),
        }
    }
}

impl KeyEndorsement {
    /// Checks the signature under `previous_key`; returns both keys.
    pub fn verify(&self) -> Result<([u8; 32], [u8; 32]), KeyTrustError> {
        let bad = |reason: String| KeyTrustError::BadEndorsement {
            previous_key: self.previous_key.clone(),
            next_key: self.next_key.clone(),
            reason,
        };
        if self.previous_key.eq_ignore_ascii_case(&self.next_key) {
            return Err(bad("a key cannot endorse itself".to_string()));
        }
        verify_statement(
            KEY_ROTATION_DOMAIN,
            ("previous", &self.previous_key),
            ("next", &self.next_key),
            self.previous_valid_until_ms,
            &self.signature,
        )
        .map_err(bad)
    }
}

/// JSON of a [`ModelDelegation`]: present when [`HEADER_MODEL_KEY`] is a
/// key the server's own trusted key lets sign models for a while (an edge
/// aggregator's versions of its own), absent otherwise.
pub const HEADER_MODEL_DELEGATION: &str = "x-canopy-model-delegation";
/// What a trusted key signs when it lets another key sign models.
pub const DELEGATION_DOMAIN: &str = "canopy-model-delegation-v1";
/// Largest [`HEADER_MODEL_DELEGATION`] a device reads: the JSON of one
/// delegation is about 330 bytes.
pub const MAX_DELEGATION_BYTES: usize = 1_024;

/// A trusted key's statement that `delegate_key`'s model signatures are
/// its own until `valid_until_ms` (Unix milliseconds). The cloud gives one
/// to an edge aggregator that makes versions of its own (a tiered job's
/// `edges.rounds` or `edges.asynchronous`), lasting its sub-round, so that
/// the edge's devices, which trust only the cloud's key, can verify those
/// versions. The delegate signs models under the same domain as any
/// server ([`ServerKey::sign_model`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelDelegation {
    /// Hex public key that made `signature`: one the device trusts.
    pub signer_key: String,
    /// Hex public key allowed to sign models.
    pub delegate_key: String,
    pub valid_until_ms: u64,
    /// 128 hex characters: Ed25519 over [`delegation_message`].
    pub signature: String,
}

/// The bytes a delegating key signs:
/// `DELEGATION_DOMAIN \n signer hex \n delegate hex \n valid_until_ms \n`.
pub fn delegation_message(signer: &[u8; 32], delegate: &[u8; 32], valid_until_ms: u64) -> Vec<u8> {
    statement_message(DELEGATION_DOMAIN, signer, delegate, valid_until_ms)
}

impl ServerKey {
    /// Lets `delegate` sign models as this key until `valid_until_ms`.
    pub fn delegate(&self, delegate: &[u8; 32], valid_until_ms: u64) -> ModelDelegation {
        let signer = self.public_key();
        let message = delegation_message(&signer, delegate, valid_until_ms);
        ModelDelegation {
            signer_key: hex::encode(signer),
            delegate_key: hex::encode(delegate),
            valid_until_ms,
            signature: hex::encode(self.sign_message(&message)),
        }
    }
}

impl ModelDelegation {
    /// Checks the signature under `signer_key`; returns the signer and the
    /// delegate.
    pub fn verify(&self) -> Result<([u8; 32], [u8; 32]), KeyTrustError> {
        verify_statement(
            DELEGATION_DOMAIN,
            ("signer", &self.signer_key),
            ("delegate", &self.delegate_key),
            self.valid_until_ms,
            &self.signature,
        )
        .map_err(|reason| KeyTrustError::BadDelegation {
            signer_key: self.signer_key.clone(),
            delegate_key: self.delegate_key.clone(),
            reason,
        })
    }

    /// Reads the [`HEADER_MODEL_DELEGATION`] value, within its size bound.
    pub fn from_header(value: &str) -> Result<ModelDelegation, KeyTrustError> {
        let bad = |reason: String| KeyTrustError::MalformedDelegation { reason };
        if value.len() > MAX_DELEGATION_BYTES {
            return Err(bad(format!(
                "it is {} bytes, over the limit of {MAX_DELEGATION_BYTES}",
                value.len()
            )));
        }
        serde_json::from_str(value).map_err(|error| bad(error.to_string()))
    }
}

/// `GET /device/v1/signing-keys`: the key the server signs with now, and
/// the endorsements that lead to it, oldest first (at most
/// [`MAX_KEY_CHAIN_LEN`], the most recent ones).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SigningKeys {
    pub current_key: String,
    pub endorsements: Vec<KeyEndorsement>,
}

/// A key a device used to sign with, still accepted until `valid_until_ms`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PreviousKey {
    pub key: [u8; 32],
    pub valid_until_ms: u64,
}

/// What a device trusts to sign models: its current key, and the key that
/// one replaced while the replaced key's window lasts. It moves only along
/// endorsements verified by [`TrustedKeys::advance`].
///
/// Serialised as `{current_key, previous_key?, previous_valid_until_ms?}`
/// in hex, so that an app can persist it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "TrustedKeysRecord", into = "TrustedKeysRecord")]
pub struct TrustedKeys {
    current: [u8; 32],
    previous: Option<PreviousKey>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct TrustedKeysRecord {
    current_key: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    previous_key: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    previous_valid_until_ms: Option<u64>,
}

impl From<TrustedKeys> for TrustedKeysRecord {
    fn from(trust: TrustedKeys) -> TrustedKeysRecord {
        TrustedKeysRecord {
            current_key: hex::encode(trust.current),
            previous_key: trust.previous.map(|previous| hex::encode(previous.key)),
            previous_valid_until_ms: trust.previous.map(|previous| previous.valid_until_ms),
        }
    }
}

impl TryFrom<TrustedKeysRecord> for TrustedKeys {
    type Error = KeyTrustError;
    fn try_from(record: TrustedKeysRecord) -> Result<TrustedKeys, KeyTrustError> {
        TrustedKeys::from_hex(
            &record.current_key,
            record.previous_key.as_deref(),
            record.previous_valid_until_ms,
        )
    }
}

/// Parses a hex public key, naming it in the error.
pub fn parse_key_hex(key_hex: &str) -> Result<[u8; 32], KeyTrustError> {
    keys::parse_verifying_key_hex(key_hex)
        .map(|key| key.to_bytes())
        .map_err(|reason| KeyTrustError::MalformedKey {
            key: key_hex.chars().take(keys::PUBLIC_KEY_HEX_LEN).collect(),
            reason,
        })
}

impl TrustedKeys {
    /// Trust in one key, as learned at enrollment.
    pub fn new(current: [u8; 32]) -> TrustedKeys {
        TrustedKeys {
            current,
            previous: None,
        }
    }

    /// Trust as persisted: hex keys; the previous key and its window come
    /// together or not at all.
    pub fn from_hex(
        current_key: &str,
        previous_key: Option<&str>,
        previous_valid_until_ms: Option<u64>,
    ) -> Result<TrustedKeys, KeyTrustError> {
        let current = parse_key_hex(current_key)?;
        let previous = match (previous_key, previous_valid_until_ms) {
            (None, None) => None,
            (Some(key), Some(valid_until_ms)) => Some(PreviousKey {
                key: parse_key_hex(key)?,
                valid_until_ms,
            }),
            (Some(key), None) => {
                return Err(KeyTrustError::MalformedKey {
                    key: key.to_string(),
                    reason: "a previous key needs the end of its window".to_string(),
                });
            }
            (None, Some(_)) => {
                return Err(KeyTrustError::MalformedKey {
                    key: current_key.to_string(),
                    reason: "a previous key's window was given without the previous key"
                        .to_string(),
                });
            }
        };
        Ok(TrustedKeys { current, previous })
    }

    pub fn current(&self) -> [u8; 32] {
        self.current
    }

    pub fn current_hex(&self) -> String {
        hex::encode(self.current)
    }

    pub fn previous(&self) -> Option<PreviousKey> {
        self.previous
    }

    /// Whether a signature by `signer` is acceptable at `now_ms` without
    /// following any endorsement.
    pub fn accepts(&self, signer: &[u8; 32], now_ms: u64) -> Result<(), KeyTrustError> {
        if *signer == self.current {
            return Ok(());
        }
        match self.previous {
            Some(previous) if previous.key == *signer && now_ms <= previous.valid_until_ms => {
                Ok(())
            }
            Some(previous) if previous.key == *signer => Err(KeyTrustError::PreviousKeyExpired {
                key: hex::encode(signer),
                valid_until_ms: previous.valid_until_ms,
                now_ms,
            }),
            _ => Err(KeyTrustError::UnknownSigner {
                signer: hex::encode(signer),
                trusted: self.current_hex(),
            }),
        }
    }

    /// Checks a model signature by `signer` at `now_ms`: the signer must be
    /// accepted (see [`TrustedKeys::accepts`]) and the signature valid.
    pub fn verify_model(
        &self,
        signer: &[u8; 32],
        digest_hex: &str,
        signature_hex: &str,
        now_ms: u64,
    ) -> Result<(), KeyTrustError> {
        self.accepts(signer, now_ms)?;
        verify_model_signature(signer, digest_hex, signature_hex).map_err(|source| {
            KeyTrustError::Signature {
                signer: hex::encode(signer),
                source,
            }
        })
    }

    /// Checks a model signature by a delegate at `now_ms`: the delegation
    /// must be signed by a key this trust accepts, name `signer` as its
    /// delegate and still be valid, and the signature must verify under
    /// `signer`.
    pub fn verify_delegated_model(
        &self,
        delegation: &ModelDelegation,
        signer: &[u8; 32],
        digest_hex: &str,
        signature_hex: &str,
        now_ms: u64,
    ) -> Result<(), KeyTrustError> {
        let (delegator, delegate) = delegation.verify()?;
        self.accepts(&delegator, now_ms)?;
        if delegate != *signer {
            return Err(KeyTrustError::BadDelegation {
                signer_key: delegation.signer_key.clone(),
                delegate_key: delegation.delegate_key.clone(),
                reason: format!(
                    "the model was signed by key {}, not by the delegate",
                    hex::encode(signer)
                ),
            });
        }
        if now_ms > delegation.valid_until_ms {
            return Err(KeyTrustError::DelegationExpired {
                delegate_key: delegation.delegate_key.clone(),
                valid_until_ms: delegation.valid_until_ms,
                now_ms,
            });
        }
        verify_model_signature(signer, digest_hex, signature_hex).map_err(|source| {
            KeyTrustError::Signature {
                signer: hex::encode(signer),
                source,
            }
        })
    }

    /// Follows `endorsements` from the current key to `signer`: each link
    /// must be signed by the key the previous link ended at. The result
    /// trusts `signer`, and the key before it until that key's window ends.
    /// Endorsements before the current key are skipped; ones after
    /// `signer` are not followed.
    pub fn advance(
        &self,
        signer: &[u8; 32],
        endorsements: &[KeyEndorsement],
    ) -> Result<TrustedKeys, KeyTrustError> {
        if endorsements.len() > MAX_KEY_CHAIN_LEN {
            return Err(KeyTrustError::ChainTooLong {
                len: endorsements.len(),
                max: MAX_KEY_CHAIN_LEN,
            });
        }
        if *signer == self.current {
            return Ok(*self);
        }
        let current_hex = self.current_hex();
        let unknown = || KeyTrustError::UnknownSigner {
            signer: hex::encode(signer),
            trusted: current_hex.clone(),
        };
        let start = endorsements
            .iter()
            .position(|link| link.previous_key == current_hex)
            .ok_or_else(unknown)?;
        let mut reached = self.current;
        for link in &endorsements[start..] {
            let (previous, next) = link.verify()?;
            if previous != reached {
                return Err(KeyTrustError::BadEndorsement {
                    previous_key: link.previous_key.clone(),
                    next_key: link.next_key.clone(),
                    reason: format!(
                        "the chain is broken: this link follows key {}",
                        hex::encode(reached)
                    ),
                });
            }
            if next == *signer {
                return Ok(TrustedKeys {
                    current: next,
                    previous: Some(PreviousKey {
                        key: previous,
                        valid_until_ms: link.previous_valid_until_ms,
                    }),
                });
            }
            reached = next;
        }
        Err(unknown())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum KeyTrustError {
    #[error(
        "model signing key {signer} is not trusted: no endorsement chain leads to it from the trusted key {trusted}"
    )]
    UnknownSigner { signer: String, trusted: String },
    #[error(
        "model signing key {key} was replaced, and its signatures were accepted only until {valid_until_ms} ms after the Unix epoch (now {now_ms})"
    )]
    PreviousKeyExpired {
        key: String,
        valid_until_ms: u64,
        now_ms: u64,
    },
    #[error("the key endorsement chain has {len} links, over the limit of {max}")]
    ChainTooLong { len: usize, max: usize },
    #[error("the endorsement of key {next_key} by key {previous_key} is invalid: {reason}")]
    BadEndorsement {
        previous_key: String,
        next_key: String,
        reason: String,
    },
    #[error("model signing key `{key}` is malformed: {reason}")]
    MalformedKey { key: String, reason: String },
    #[error(
        "the delegation of model signing to key {delegate_key} by key {signer_key} is invalid: {reason}"
    )]
    BadDelegation {
        signer_key: String,
        delegate_key: String,
        reason: String,
    },
    #[error("the `{}` header is malformed: {reason}", HEADER_MODEL_DELEGATION)]
    MalformedDelegation { reason: String },
    #[error(
        "model signing key {delegate_key} was allowed to sign models only until {valid_until_ms} ms after the Unix epoch (now {now_ms})"
    )]
    DelegationExpired {
        delegate_key: String,
        valid_until_ms: u64,
        now_ms: u64,
    },
    #[error("the model signature by key {signer} is invalid")]
    Signature {
        signer: String,
        #[source]
        source: ModelSignatureError,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    const DIGEST: &str = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff";

    /// K1 -> K2 -> K3, each window ending at 1_000 * its position.
    fn chain() -> (Vec<ServerKey>, Vec<KeyEndorsement>) {
        let keys: Vec<ServerKey> = (0..3).map(|_| ServerKey::generate()).collect();
        let links = keys
            .windows(2)
            .enumerate()
            .map(|(i, pair)| pair[0].endorse(&pair[1].public_key(), 1_000 * (i as u64 + 1)))
            .collect();
        (keys, links)
    }

    #[test]
    fn a_delegate_signs_as_the_trusted_key_until_its_delegation_ends() {
        let cloud = ServerKey::generate();
        let edge = ServerKey::generate();
        let trust = TrustedKeys::new(cloud.public_key());
        let delegation = cloud.delegate(&edge.public_key(), 5_000);
        let signature = edge.sign_model(DIGEST);
        let header = serde_json::to_string(&delegation).unwrap();
        let read = ModelDelegation::from_header(&header).unwrap();
        trust
            .verify_delegated_model(&read, &edge.public_key(), DIGEST, &signature, 5_000)
            .expect("a delegate's signature within its window");
        // Past its window.
        let error = trust
            .verify_delegated_model(&read, &edge.public_key(), DIGEST, &signature, 5_001)
            .unwrap_err();
        assert!(
            matches!(error, KeyTrustError::DelegationExpired { .. }),
            "{error}"
        );
        // A delegation lengthened after signing.
        let stretched = ModelDelegation {
            valid_until_ms: u64::MAX,
            ..delegation.clone()
        };
        let error = trust
            .verify_delegated_model(&stretched, &edge.public_key(), DIGEST, &signature, 6_000)
            .unwrap_err();
        assert!(
            matches!(error, KeyTrustError::BadDelegation { .. }),
            "{error}"
        );
        // Another key's signature under the delegation.
        let other = ServerKey::generate();
        let error = trust
            .verify_delegated_model(
                &delegation,
                &other.public_key(),
                DIGEST,
                &other.sign_model(DIGEST),
                0,
            )
            .unwrap_err();
        assert!(error.to_string().contains("not by the delegate"), "{error}");
        // A delegation by a key the device does not trust.
        let stranger = ServerKey::generate();
        let forged = stranger.delegate(&edge.public_key(), 5_000);
        let error = trust
            .verify_delegated_model(&forged, &edge.public_key(), DIGEST, &signature, 0)
            .unwrap_err();
        assert!(
            matches!(error, KeyTrustError::UnknownSigner { .. }),
            "{error}"
        );
        // A delegate's signature over another digest.
        let error = trust
            .verify_delegated_model(
                &delegation,
                &edge.public_key(),
                &DIGEST.replace('0', "1"),
                &signature,
                0,
            )
            .unwrap_err();
        assert!(matches!(error, KeyTrustError::Signature { .. }), "{error}");
        // An oversized or malformed header.
        let long = format!("{header}{}", " ".repeat(MAX_DELEGATION_BYTES));
        assert!(ModelDelegation::from_header(&long).is_err());
        assert!(ModelDelegation::from_header("{}").is_err());
    }

    #[test]
    fn the_current_key_verifies_and_a_tampered_signature_does_not() {
        let key = ServerKey::generate();
        let trust = TrustedKeys::new(key.public_key());
        let signature = key.sign_model(DIGEST);
        trust
            .verify_model(&key.public_key(), DIGEST, &signature, 0)
            .expect("the current key's signature");
        let other = ServerKey::generate().sign_model(DIGEST);
        let error = trust
            .verify_model(&key.public_key(), DIGEST, &other, 0)
            .unwrap_err();
        assert!(matches!(error, KeyTrustError::Signature { .. }), "{error}");
    }

    #[test]
    fn an_unknown_signer_is_refused_naming_it() {
        let trusted = ServerKey::generate();
        let stranger = ServerKey::generate();
        let trust = TrustedKeys::new(trusted.public_key());
        let error = trust
            .verify_model(
                &stranger.public_key(),
                DIGEST,
                &stranger.sign_model(DIGEST),
                0,
            )
            .unwrap_err();
        assert!(matches!(error, KeyTrustError::UnknownSigner { .. }));
        assert!(
            error.to_string().contains(&stranger.public_key_hex()),
            "{error}"
        );
        let error = trust.advance(&stranger.public_key(), &[]).unwrap_err();
        assert!(
            matches!(error, KeyTrustError::UnknownSigner { .. }),
            "{error}"
        );
    }

    #[test]
    fn one_endorsement_moves_trust_and_keeps_the_previous_key_for_its_window() {
        let (keys, links) = chain();
        let trust = TrustedKeys::new(keys[0].public_key());
        let moved = trust
            .advance(&keys[1].public_key(), &links)
            .expect("K1 -> K2");
        assert_eq!(moved.current(), keys[1].public_key());
        assert_eq!(
            moved.previous(),
            Some(PreviousKey {
                key: keys[0].public_key(),
                valid_until_ms: 1_000
            })
        );
        let old = keys[0].sign_model(DIGEST);
        moved
            .verify_model(&keys[0].public_key(), DIGEST, &old, 1_000)
            .expect("the previous key inside its window");
        let error = moved
            .verify_model(&keys[0].public_key(), DIGEST, &old, 1_001)
            .unwrap_err();
        assert!(
            matches!(error, KeyTrustError::PreviousKeyExpired { .. }),
            "{error}"
        );
        assert!(error.to_string().contains(&keys[0].public_key_hex()));
    }

    #[test]
    fn a_device_offline_through_two_rotations_follows_the_whole_chain() {
        let (keys, links) = chain();
        let trust = TrustedKeys::new(keys[0].public_key());
        let moved = trust
            .advance(&keys[2].public_key(), &links)
            .expect("K1 -> K3");
        assert_eq!(moved.current(), keys[2].public_key());
        assert_eq!(moved.previous().map(|p| p.key), Some(keys[1].public_key()));
        assert_eq!(moved.previous().map(|p| p.valid_until_ms), Some(2_000));
        // K1 is no longer trusted at all.
        let error = moved.accepts(&keys[0].public_key(), 0).unwrap_err();
        assert!(
            matches!(error, KeyTrustError::UnknownSigner { .. }),
            "{error}"
        );
        // A device already at K2 starts in the middle of the chain.
        let at_k2 = TrustedKeys::new(keys[1].public_key());
        assert_eq!(
            at_k2
                .advance(&keys[2].public_key(), &links)
                .unwrap()
                .current(),
            keys[2].public_key()
        );
    }

    #[test]
    fn a_forged_or_broken_link_is_refused() {
        let (keys, mut links) = chain();
        let trust = TrustedKeys::new(keys[0].public_key());
        // K2's endorsement of K3 replaced by a stranger's endorsement claiming to be K2's.
        let stranger = ServerKey::generate();
        let mut forged = stranger.endorse(&keys[2].public_key(), 2_000);
        forged.previous_key = keys[1].public_key_hex();
        links[1] = forged;
        let error = trust.advance(&keys[2].public_key(), &links).unwrap_err();
        assert!(
            matches!(error, KeyTrustError::BadEndorsement { .. }),
            "{error}"
        );
        // A valid link that does not continue from the key reached.
        let (other_keys, other_links) = chain();
        let (keys, links) = chain();
        let spliced = [links[0].clone(), other_links[0].clone()];
        let error = TrustedKeys::new(keys[0].public_key())
            .advance(&other_keys[1].public_key(), &spliced)
            .unwrap_err();
        assert!(
            matches!(&error, KeyTrustError::BadEndorsement { reason, .. } if reason.contains("broken")),
            "{error}"
        );
        // A stretched window is a different message: the signature breaks.
        let (keys, mut links) = chain();
        links[0].previous_valid_until_ms = u64::MAX;
        let error = TrustedKeys::new(keys[0].public_key())
            .advance(&keys[1].public_key(), &links)
            .unwrap_err();
        assert!(
            matches!(error, KeyTrustError::BadEndorsement { .. }),
            "{error}"
        );
    }

    #[test]
    fn a_chain_that_skips_the_trusted_key_or_stops_short_is_refused() {
        let (keys, links) = chain();
        // Trusting K1, offered only K2 -> K3.
        let error = TrustedKeys::new(keys[0].public_key())
            .advance(&keys[2].public_key(), &links[1..])
            .unwrap_err();
        assert!(
            matches!(error, KeyTrustError::UnknownSigner { .. }),
            "{error}"
        );
        // Trusting K1, signer K3, offered only K1 -> K2.
        let error = TrustedKeys::new(keys[0].public_key())
            .advance(&keys[2].public_key(), &links[..1])
            .unwrap_err();
        assert!(
            matches!(error, KeyTrustError::UnknownSigner { .. }),
            "{error}"
        );
    }

    #[test]
    fn chains_are_bounded() {
        let keys: Vec<ServerKey> = (0..MAX_KEY_CHAIN_LEN + 2)
            .map(|_| ServerKey::generate())
            .collect();
        let links: Vec<KeyEndorsement> = keys
            .windows(2)
            .map(|pair| pair[0].endorse(&pair[1].public_key(), 0))
            .collect();
        let trust = TrustedKeys::new(keys[0].public_key());
        let last = keys.last().unwrap().public_key();
        let error = trust.advance(&last, &links).unwrap_err();
        assert!(
            matches!(error, KeyTrustError::ChainTooLong { len, max } if len == MAX_KEY_CHAIN_LEN + 1 && max == MAX_KEY_CHAIN_LEN),
            "{error}"
        );
        let within = &links[..MAX_KEY_CHAIN_LEN];
        let reached = trust
            .advance(&keys[MAX_KEY_CHAIN_LEN].public_key(), within)
            .expect("a chain at the limit");
        assert_eq!(reached.current(), keys[MAX_KEY_CHAIN_LEN].public_key());
    }

    #[test]
    fn a_key_cannot_endorse_itself() {
        let key = ServerKey::generate();
        let link = key.endorse(&key.public_key(), 0);
        assert!(matches!(
            link.verify(),
            Err(KeyTrustError::BadEndorsement { .. })
        ));
    }

    #[test]
    fn trust_round_trips_through_json_and_refuses_half_a_previous_key() {
        let (keys, links) = chain();
        let moved = TrustedKeys::new(keys[0].public_key())
            .advance(&keys[1].public_key(), &links)
            .unwrap();
        let text = serde_json::to_string(&moved).unwrap();
        assert_eq!(serde_json::from_str::<TrustedKeys>(&text).unwrap(), moved);
        let half = format!(
            r#"{{"current_key":"{}","previous_key":"{}"}}"#,
            keys[1].public_key_hex(),
            keys[0].public_key_hex()
        );
        assert!(serde_json::from_str::<TrustedKeys>(&half).is_err());
        assert!(TrustedKeys::from_hex("zz", None, None).is_err());
    }
}
