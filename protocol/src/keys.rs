//! Ed25519 key plumbing shared by device and server keys.

use ed25519_dalek::{Signature, SigningKey, VerifyingKey};
use rand::RngCore;

pub(crate) const SIGNATURE_HEX_LEN: usize = 128;
pub(crate) const PUBLIC_KEY_HEX_LEN: usize = 64;

pub(crate) fn generate_signing_key() -> SigningKey {
    let mut secret = [0u8; 32];
    rand::rng().fill_bytes(&mut secret);
    SigningKey::from_bytes(&secret)
}

/// True when `s` is exactly `len` lowercase hex digits. Upper case is refused
/// so that every value has exactly one spelling on the wire.
pub(crate) fn is_lower_hex(s: &str, len: usize) -> bool {
    s.len() == len
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Decodes and validates a public key, refusing points that are not on the
/// curve and small-order ("weak") points, for which signatures prove nothing.
pub(crate) fn parse_verifying_key_hex(s: &str) -> Result<VerifyingKey, String> {
    if s.len() != PUBLIC_KEY_HEX_LEN {
        return Err(format!(
            "expected {PUBLIC_KEY_HEX_LEN} hex characters, got {}",
            s.len()
        ));
    }
    let mut bytes = [0u8; 32];
    hex::decode_to_slice(s, &mut bytes).map_err(|e| format!("not hex: {e}"))?;
    verifying_key(&bytes)
}

pub(crate) fn verifying_key(bytes: &[u8; 32]) -> Result<VerifyingKey, String> {
    let key = VerifyingKey::from_bytes(bytes)
        .map_err(|_| "not a valid Ed25519 curve point".to_string())?;
    if key.is_weak() {
        return Err("small-order Ed25519 point; it cannot authenticate anything".to_string());
    }
    Ok(key)
}

/// Parses a signature given as 128 lowercase hex digits.
pub(crate) fn parse_signature_hex(s: &str) -> Result<Signature, String> {
    if !is_lower_hex(s, SIGNATURE_HEX_LEN) {
        return Err(format!(
            "expected {SIGNATURE_HEX_LEN} lowercase hex characters, got {} characters",
            s.len()
        ));
    }
    let mut bytes = [0u8; 64];
    hex::decode_to_slice(s, &mut bytes).map_err(|e| format!("not hex: {e}"))?;
    Ok(Signature::from_bytes(&bytes))
}

/// Declares a newtype over an Ed25519 signing key with the accessors both
/// key kinds share, and a `Debug` that shows only the public half (keys end
/// up in logs via `{:?}`).
macro_rules! signing_key_type {
    ($(#[$meta:meta])* $name:ident) => {
        $(#[$meta])*
        #[derive(Clone)]
        pub struct $name(ed25519_dalek::SigningKey);

        impl $name {
            /// A fresh key from the operating system's random source.
            pub fn generate() -> $name {
                $name($crate::keys::generate_signing_key())
            }

            pub fn from_bytes(secret: &[u8; 32]) -> $name {
                $name(ed25519_dalek::SigningKey::from_bytes(secret))
            }

            /// The secret key; store it only where its owner keeps credentials.
            pub fn to_bytes(&self) -> [u8; 32] {
                self.0.to_bytes()
            }

            pub fn public_key(&self) -> [u8; 32] {
                self.0.verifying_key().to_bytes()
            }

            pub fn public_key_hex(&self) -> String {
                hex::encode(self.public_key())
            }

            /// An Ed25519 signature over `message`.
            pub fn sign_message(&self, message: &[u8]) -> [u8; 64] {
                use ed25519_dalek::Signer;
                self.0.sign(message).to_bytes()
            }
        }

        impl std::fmt::Debug for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($name))
                    .field("public_key", &self.public_key_hex())
                    .finish_non_exhaustive()
            }
        }
    };
}
pub(crate) use signing_key_type;
