//! Per-request Ed25519 signatures: how a device proves that a request comes
//! from it and has not been altered in transit.
//!
//! The device signs [`canonical_request`] and sends the signature and its
//! inputs in the five `x-canopy-*` headers. The server rebuilds the canonical
//! bytes from the request it actually received, so any change to the method,
//! path, body or headers invalidates the signature. Replay protection needs
//! state (seen nonces), so it is the server's job; this module only bounds the
//! timestamp ([`check_timestamp`]) so that the nonce memory can be bounded too.

use ed25519_dalek::Signer;
use rand::RngCore;
use sha2::{Digest, Sha256};

use crate::keys;

/// Decimal device id, as issued at enrollment.
pub const HEADER_DEVICE: &str = "x-canopy-device";
/// Unix time of signing in milliseconds, decimal.
pub const HEADER_TIMESTAMP: &str = "x-canopy-timestamp";
/// 32 lowercase hex characters (16 random bytes).
pub const HEADER_NONCE: &str = "x-canopy-nonce";
/// 64 lowercase hex characters: SHA-256 of the body (of the empty body for GET).
pub const HEADER_CONTENT_SHA256: &str = "x-canopy-content-sha256";
/// 128 lowercase hex characters: Ed25519 signature of [`canonical_request`].
pub const HEADER_SIGNATURE: &str = "x-canopy-signature";
/// How far a request's timestamp may be from the server clock, either way.
pub const MAX_CLOCK_SKEW_MS: u64 = 300_000;
/// Prefix of the signed bytes, so a device signature can never be replayed
/// as a signature over anything else (for example a model digest).
pub const SIGNATURE_DOMAIN: &str = "canopy-device-request-v1";

const NONCE_BYTES: usize = 16;
const NONCE_HEX_LEN: usize = NONCE_BYTES * 2;
const SHA256_HEX_LEN: usize = 64;
/// `i64::MAX` has 19 digits; `u64::MAX` has 20.
const MAX_DEVICE_ID_DIGITS: usize = 19;
const MAX_TIMESTAMP_DIGITS: usize = 20;

keys::signing_key_type!(
    /// A device's Ed25519 secret key.
    DeviceKey
);

/// The authentication data of one request, as carried in its headers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SignedRequest {
    pub device_id: i64,
    pub timestamp_ms: u64,
    pub nonce: String,
    pub content_sha256: String,
    pub signature: String,
}

impl SignedRequest {
    /// The five header (name, value) pairs to attach to the HTTP request.
    pub fn headers(&self) -> [(&'static str, String); 5] {
        [
            (HEADER_DEVICE, self.device_id.to_string()),
            (HEADER_TIMESTAMP, self.timestamp_ms.to_string()),
            (HEADER_NONCE, self.nonce.clone()),
            (HEADER_CONTENT_SHA256, self.content_sha256.clone()),
            (HEADER_SIGNATURE, self.signature.clone()),
        ]
    }

    /// Parses the five headers; `get` returns a header's value by lowercase
    /// name. Validates formats (decimal id > 0, decimal timestamp, hex
    /// lengths) and names the header in errors.
    pub fn from_headers<'a>(
        get: impl Fn(&str) -> Option<&'a str>,
    ) -> Result<SignedRequest, AuthError> {
        let header =
            |name: &'static str| get(name).ok_or(AuthError::MissingHeader { header: name });

        let device_text = header(HEADER_DEVICE)?;
        let device_id = parse_decimal(HEADER_DEVICE, device_text, MAX_DEVICE_ID_DIGITS)?;
        let device_id = i64::try_from(device_id)
            .ok()
            .filter(|id| *id > 0)
            .ok_or_else(|| malformed(HEADER_DEVICE, "device id must be between 1 and 2^63-1"))?;

        let timestamp_ms = parse_decimal(
            HEADER_TIMESTAMP,
            header(HEADER_TIMESTAMP)?,
            MAX_TIMESTAMP_DIGITS,
        )?;
        let nonce = parse_hex(HEADER_NONCE, header(HEADER_NONCE)?, NONCE_HEX_LEN)?;
        let content_sha256 = parse_hex(
            HEADER_CONTENT_SHA256,
            header(HEADER_CONTENT_SHA256)?,
            SHA256_HEX_LEN,
        )?;
        let signature = parse_hex(
            HEADER_SIGNATURE,
            header(HEADER_SIGNATURE)?,
            keys::SIGNATURE_HEX_LEN,
        )?;

        Ok(SignedRequest {
            device_id,
            timestamp_ms,
            nonce,
            content_sha256,
            signature,
        })
    }
}

fn malformed(header: &'static str, reason: impl Into<String>) -> AuthError {
    AuthError::MalformedHeader {
        header,
        reason: reason.into(),
    }
}

/// Plain ASCII digits only: `u64::from_str` would also take a leading `+`,
/// which would give one value two spellings.
fn parse_decimal(header: &'static str, text: &str, max_digits: usize) -> Result<u64, AuthError> {
    if text.is_empty() || text.len() > max_digits || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(malformed(
            header,
            format!("expected 1 to {max_digits} decimal digits"),
        ));
    }
    text.parse::<u64>()
        .map_err(|e| malformed(header, format!("not a decimal number: {e}")))
}

fn parse_hex(header: &'static str, text: &str, len: usize) -> Result<String, AuthError> {
    if !keys::is_lower_hex(text, len) {
        return Err(malformed(
            header,
            format!(
                "expected {len} lowercase hex characters, got {} characters",
                text.len()
            ),
        ));
    }
    Ok(text.to_string())
}

/// Canonical bytes that are signed: [`SIGNATURE_DOMAIN`], METHOD (uppercase),
/// path_and_query, device_id, timestamp_ms, nonce, content_sha256, each
/// followed by `'\n'`.
///
/// Newline separation is unambiguous because no field can contain a raw
/// newline in a well-formed HTTP request, and the header fields are checked
/// to be digits or hex before they are used.
pub fn canonical_request(
    method: &str,
    path_and_query: &str,
    device_id: i64,
    timestamp_ms: u64,
    nonce: &str,
    content_sha256: &str,
) -> Vec<u8> {
    format!(
        "{SIGNATURE_DOMAIN}\n{}\n{path_and_query}\n{device_id}\n{timestamp_ms}\n{nonce}\n{content_sha256}\n",
        method.to_ascii_uppercase()
    )
    .into_bytes()
}

/// Signs a request with a fresh random nonce.
pub fn sign_request(
    key: &DeviceKey,
    device_id: i64,
    method: &str,
    path_and_query: &str,
    body: &[u8],
    now_ms: u64,
) -> SignedRequest {
    sign_request_with_digest(
        key,
        device_id,
        method,
        path_and_query,
        &sha256_hex(body),
        now_ms,
    )
}

/// Same as [`sign_request`], when the body's SHA-256 is already known
/// (streamed bodies). The digest is lowercased, since the server only accepts
/// the lowercase spelling.
pub fn sign_request_with_digest(
    key: &DeviceKey,
    device_id: i64,
    method: &str,
    path_and_query: &str,
    content_sha256_hex: &str,
    now_ms: u64,
) -> SignedRequest {
    let mut nonce_bytes = [0u8; NONCE_BYTES];
    rand::rng().fill_bytes(&mut nonce_bytes);
    let nonce = hex::encode(nonce_bytes);
    let content_sha256 = content_sha256_hex.to_ascii_lowercase();
    let message = canonical_request(
        method,
        path_and_query,
        device_id,
        now_ms,
        &nonce,
        &content_sha256,
    );
    let signature = hex::encode(key.0.sign(&message).to_bytes());
    SignedRequest {
        device_id,
        timestamp_ms: now_ms,
        nonce,
        content_sha256,
        signature,
    }
}

/// Checks the signature against the public key. Does not check time or nonce.
///
/// It also does not check that `content_sha256` matches the body; the server
/// hashes the body it received and compares, because only it has the body.
pub fn verify_signature(
    public_key: &[u8; 32],
    request: &SignedRequest,
    method: &str,
    path_and_query: &str,
) -> Result<(), AuthError> {
    let key =
        keys::verifying_key(public_key).map_err(|reason| AuthError::BadPublicKey { reason })?;
    let signature = keys::parse_signature_hex(&request.signature)
        .map_err(|reason| malformed(HEADER_SIGNATURE, reason))?;
    let message = canonical_request(
        method,
        path_and_query,
        request.device_id,
        request.timestamp_ms,
        &request.nonce,
        &request.content_sha256,
    );
    // Strict verification rejects malleable signature encodings, so one
    // signed request cannot be turned into a second, distinct-looking one.
    key.verify_strict(&message, &signature)
        .map_err(|_| AuthError::BadSignature)
}

/// Checks `|now - timestamp| <= MAX_CLOCK_SKEW_MS`.
pub fn check_timestamp(request: &SignedRequest, now_ms: u64) -> Result<(), AuthError> {
    if request.timestamp_ms.abs_diff(now_ms) > MAX_CLOCK_SKEW_MS {
        return Err(AuthError::ClockSkew {
            timestamp_ms: request.timestamp_ms,
            now_ms,
            max_skew_ms: MAX_CLOCK_SKEW_MS,
        });
    }
    Ok(())
}

/// Parses a 64-hex-character Ed25519 public key, rejecting values that are
/// not valid curve points or are small-order points.
pub fn parse_public_key_hex(s: &str) -> Result<[u8; 32], AuthError> {
    keys::parse_verifying_key_hex(s)
        .map(|key| key.to_bytes())
        .map_err(|reason| AuthError::BadPublicKey { reason })
}

/// Lowercase hex SHA-256, the spelling used in [`HEADER_CONTENT_SHA256`].
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("header `{header}` is missing")]
    MissingHeader { header: &'static str },
    #[error("header `{header}` is malformed: {reason}")]
    MalformedHeader {
        header: &'static str,
        reason: String,
    },
    #[error("device public key is invalid: {reason}")]
    BadPublicKey { reason: String },
    #[error("signature does not match the device's public key")]
    BadSignature,
    #[error(
        "request timestamp {timestamp_ms} is {} ms away from the server clock (limit {max_skew_ms} ms); check the device's clock",
        .timestamp_ms.abs_diff(*.now_ms)
    )]
    ClockSkew {
        timestamp_ms: u64,
        now_ms: u64,
        max_skew_ms: u64,
    },
}
