//! The server's signature over a model digest, so that a device can tell
//! that the model it downloaded was published by its own server even when
//! the bytes came through a cache or CDN.

use ed25519_dalek::Signer;

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
