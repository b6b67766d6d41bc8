//! Device certificates: a device authority's Ed25519 signature that binds a
//! device id to the key the device enrolled with.
//!
//! Why they exist: in a secure round the server relays every device's
//! enrolled key to its neighbours (NeighbourKeys), and a device trusts its
//! neighbours' round keys because those enrolled keys signed them. A server
//! that could put a key of its own in a neighbour's place would receive the
//! shares of the device's self-mask seed and mask key meant for that
//! neighbour; with t such neighbours it unmasks the device's input. A
//! certified key cannot be replaced by a server that does not hold the
//! authority's signing key, and a device that pins the authority
//! ([`KeyTrust::Authority`]) refuses a neighbour whose key the authority did
//! not certify for that neighbour's id.
//!
//! The authority is run apart from the server: by the app's own backend,
//! which already knows its users, or by an operator with an offline key. The
//! certificate binds the id as well as the key, so that a server cannot
//! present a device it controls in an honest neighbour's place either.
//!
//! Architecture Invariant: this module is pure; the bytes a certificate
//! signs are defined once, in [`signed_bytes`].

use ed25519_dalek::VerifyingKey;

use crate::keys::{signing_key_type, verifying_key};

pub const CERTIFICATE_BYTES: usize = 64;
/// Domain separation: no other signature in Canopy starts with these bytes.
const DOMAIN: &[u8] = b"canopy device certificate v1\0";

/// An authority's signature over (device id, enrolled key).
pub type Certificate = [u8; CERTIFICATE_BYTES];
/// How NeighbourKeys says a device has no certificate: no Ed25519
/// signature is all zeros.
pub const NO_CERTIFICATE: Certificate = [0; CERTIFICATE_BYTES];

signing_key_type!(
    /// The signing key of a device authority. Keep it away from the server:
    /// a server that holds it can substitute keys again.
    DeviceAuthority
);

impl DeviceAuthority {
    /// Certifies that `device_key` is the key of device `device_id`.
    pub fn certify(&self, device_id: u64, device_key: &[u8; 32]) -> Certificate {
        self.sign_message(&signed_bytes(device_id, device_key))
    }
}

/// Whom a device believes about its neighbours' enrolled keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyTrust {
    /// The server's word: enough against a server that follows the
    /// protocol, not against one that substitutes keys.
    Server,
    /// Only keys this authority certified (its Ed25519 public key).
    Authority([u8; 32]),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CertificateError {
    #[error("the device authority's public key is not usable: {0}")]
    AuthorityKey(String),
    #[error("device {device_id} has no certificate from the device authority")]
    Missing { device_id: u64 },
    #[error(
        "device {device_id}'s certificate was not made by the device authority for this id and \
         key"
    )]
    Forged { device_id: u64 },
}

/// What a certificate signs: the domain, the id (little-endian) and the key.
pub fn signed_bytes(device_id: u64, device_key: &[u8; 32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(DOMAIN.len() + 8 + 32);
    out.extend_from_slice(DOMAIN);
    out.extend_from_slice(&device_id.to_le_bytes());
    out.extend_from_slice(device_key);
    out
}

/// Checks that `authority` certified `device_key` as device `device_id`'s
/// key. [`NO_CERTIFICATE`] is how the wire says "none".
pub fn verify(
    authority: &[u8; 32],
    device_id: u64,
    device_key: &[u8; 32],
    certificate: &Certificate,
) -> Result<(), CertificateError> {
    let authority = verifying_key(authority).map_err(CertificateError::AuthorityKey)?;
    verify_with(&authority, device_id, device_key, certificate)
}

/// [`verify`] with the authority's key already parsed: a device checking
/// all its neighbours' certificates parses it once, not once a neighbour
/// (each parse is a point decompression, a square root in the field).
pub fn verify_with(
    authority: &VerifyingKey,
    device_id: u64,
    device_key: &[u8; 32],
    certificate: &Certificate,
) -> Result<(), CertificateError> {
    if *certificate == NO_CERTIFICATE {
        return Err(CertificateError::Missing { device_id });
    }
    authority
        .verify_strict(
            &signed_bytes(device_id, device_key),
            &ed25519_dalek::Signature::from_bytes(certificate),
        )
        .map_err(|_| CertificateError::Forged { device_id })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::DeviceKey;

    #[test]
    fn a_certificate_holds_for_its_id_and_key_only() {
        let authority = DeviceAuthority::generate();
        let (device, other) = (DeviceKey::generate(), DeviceKey::generate());
        let certificate = authority.certify(7, &device.public_key());
        let public = authority.public_key();
        assert_eq!(
            verify(&public, 7, &device.public_key(), &certificate),
            Ok(())
        );
        assert_eq!(
            verify(&public, 8, &device.public_key(), &certificate),
            Err(CertificateError::Forged { device_id: 8 })
        );
        assert_eq!(
            verify(&public, 7, &other.public_key(), &certificate),
            Err(CertificateError::Forged { device_id: 7 })
        );
        let impostor = DeviceAuthority::generate().certify(7, &device.public_key());
        assert_eq!(
            verify(&public, 7, &device.public_key(), &impostor),
            Err(CertificateError::Forged { device_id: 7 })
        );
        assert_eq!(
            verify(&public, 7, &device.public_key(), &[0; 64]),
            Err(CertificateError::Missing { device_id: 7 })
        );
        assert!(matches!(
            verify(&[0; 32], 7, &device.public_key(), &certificate),
            Err(CertificateError::AuthorityKey(_))
        ));
    }
}
