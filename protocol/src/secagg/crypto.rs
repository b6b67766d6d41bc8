//! Key agreement and share encryption.
//!
//! Each device makes two X25519 key pairs per round: a channel key, whose
//! agreements encrypt the Shamir shares it sends its neighbours, and a mask
//! key, whose agreements seed the pairwise masks. The mask key's secret
//! half is itself Shamir-shared, so that the server can remove a dropped
//! device's pairwise masks; that needs a static (reusable, exportable) key,
//! which is why this uses `x25519-dalek`'s `StaticSecret` rather than
//! `ring`'s single-use agreement keys. Both pairs are fresh each round.
//!
//! Agreements go through HKDF-SHA256 with an `info` that names the job, the
//! round, the purpose and both devices, so no key is ever valid in another
//! round or for another pair.

use rand::RngCore;
use ring::aead::{AES_256_GCM, Aad, LessSafeKey, Nonce, UnboundKey};
use ring::hkdf;
use x25519_dalek::{PublicKey, StaticSecret};
use zeroize::Zeroize;

use super::SecAggError;
use super::mask::Seed;
use super::wire::{SHARE_CIPHERTEXT_BYTES, SHARE_PLAINTEXT_BYTES, Session};

const SALT: &[u8] = b"canopy-secagg-v1";

pub fn random_secret() -> StaticSecret {
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    let secret = StaticSecret::from(bytes);
    bytes.zeroize();
    secret
}

fn info(session: Session, purpose: &[u8], a: u64, b: u64) -> Vec<u8> {
    let (low, high) = (a.min(b), a.max(b));
    let mut out = Vec::with_capacity(purpose.len() + 32);
    out.extend_from_slice(purpose);
    for value in [session.job_id, session.round_id, low, high] {
        out.extend_from_slice(&value.to_le_bytes());
    }
    out
}

/// The raw X25519 agreement, refusing low-order peer keys (for which the
/// shared secret would be known to everyone).
fn agree(own: &StaticSecret, peer: &[u8; 32], peer_id: u64) -> Result<[u8; 32], SecAggError> {
    let shared = own.diffie_hellman(&PublicKey::from(*peer));
    if !shared.was_contributory() {
        return Err(SecAggError::rejected(
            "public key",
            format!("device {peer_id}'s X25519 key is a low-order point"),
        ));
    }
    Ok(shared.to_bytes())
}

struct Len(usize);

impl hkdf::KeyType for Len {
    fn len(&self) -> usize {
        self.0
    }
}

fn derive(ikm: &[u8; 32], info: &[u8], out: &mut [u8]) {
    let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, SALT).extract(ikm);
    // Lengths here are fixed and far below HKDF's 255·32-byte limit.
    prk.expand(&[info], Len(out.len()))
        .and_then(|okm| okm.fill(out))
        .expect("HKDF output length is within bounds");
}

/// An `N`-byte key for one pair, one round and one `purpose`: the X25519
/// agreement through HKDF, the raw agreement wiped.
fn pair_key<const N: usize>(
    own: &StaticSecret,
    peer_key: &[u8; 32],
    session: Session,
    purpose: &[u8],
    own_id: u64,
    peer_id: u64,
) -> Result<[u8; N], SecAggError> {
    let mut shared = agree(own, peer_key, peer_id)?;
    let mut key = [0u8; N];
    derive(&shared, &info(session, purpose, own_id, peer_id), &mut key);
    shared.zeroize();
    Ok(key)
}

/// The seed of the mask two devices share, the same from either side.
pub fn pairwise_seed(
    own: &StaticSecret,
    peer_key: &[u8; 32],
    session: Session,
    own_id: u64,
    peer_id: u64,
) -> Result<Seed, SecAggError> {
    pair_key(own, peer_key, session, b"pairwise-mask", own_id, peer_id)
}

/// The AES-256-GCM key two devices' channel keys agree on, which seals
/// their shares in both directions. A device keeps it from ShareKeys to
/// MaskedInputCollection, so that each pair's agreement runs once, not
/// once to seal and again to open (X25519 is most of a device's CPU); it
/// is zeroized on drop.
pub struct Channel {
    key: [u8; 32],
}

impl Drop for Channel {
    fn drop(&mut self) {
        self.key.zeroize();
    }
}

impl Channel {
    pub fn agree(
        own: &StaticSecret,
        peer_key: &[u8; 32],
        session: Session,
        own_id: u64,
        peer_id: u64,
    ) -> Result<Channel, SecAggError> {
        let key = pair_key(own, peer_key, session, b"share-channel", own_id, peer_id)?;
        Ok(Channel { key })
    }

    fn aead(&self) -> LessSafeKey {
        let unbound = UnboundKey::new(&AES_256_GCM, &self.key).expect("32 bytes is an AES-256 key");
        LessSafeKey::new(unbound)
    }

    /// Seals a share plaintext from `from` to `to`.
    pub fn seal(
        &self,
        session: Session,
        from: u64,
        to: u64,
        plaintext: &[u8; SHARE_PLAINTEXT_BYTES],
    ) -> Result<[u8; SHARE_CIPHERTEXT_BYTES], SecAggError> {
        let mut buffer = plaintext.to_vec();
        self.aead()
            .seal_in_place_append_tag(nonce(from), Aad::from(aad(session, from, to)), &mut buffer)
            .map_err(|_| SecAggError::invalid("AES-GCM sealing failed".to_string()))?;
        let mut out = [0u8; SHARE_CIPHERTEXT_BYTES];
        out.copy_from_slice(&buffer);
        buffer.zeroize();
        Ok(out)
    }

    /// Opens a share ciphertext that `from` sent to `to`; any change to it,
    /// or its use in another round or by another pair, fails
    /// authentication.
    pub fn open(
        &self,
        session: Session,
        from: u64,
        to: u64,
        ciphertext: &[u8; SHARE_CIPHERTEXT_BYTES],
    ) -> Result<[u8; SHARE_PLAINTEXT_BYTES], SecAggError> {
        let mut buffer = ciphertext.to_vec();
        let plain = self
            .aead()
            .open_in_place(nonce(from), Aad::from(aad(session, from, to)), &mut buffer)
            .map_err(|_| {
                SecAggError::rejected(
                    "IncomingShares",
                    format!(
                        "the share ciphertext from device {from} to device {to} fails \
                         authentication (tampered, or sealed for another round or device)"
                    ),
                )
            })?;
        let mut out = [0u8; SHARE_PLAINTEXT_BYTES];
        out.copy_from_slice(plain);
        buffer.zeroize();
        Ok(out)
    }
}

/// The pair's key is used once in each direction; the sender's id makes
/// the two nonces differ.
fn nonce(from: u64) -> Nonce {
    let mut bytes = [0u8; 12];
    bytes[..8].copy_from_slice(&from.to_le_bytes());
    Nonce::assume_unique_for_key(bytes)
}

fn aad(session: Session, from: u64, to: u64) -> [u8; 32] {
    let mut out = [0u8; 32];
    for (i, value) in [session.job_id, session.round_id, from, to]
        .iter()
        .enumerate()
    {
        out[i * 8..i * 8 + 8].copy_from_slice(&value.to_le_bytes());
    }
    out
}

/// Seals a share plaintext from `from` to `to`: [`Channel::seal`] with
/// the pair's channel agreed for this one message.
pub fn seal_share(
    own_channel: &StaticSecret,
    peer_channel: &[u8; 32],
    session: Session,
    from: u64,
    to: u64,
    plaintext: &[u8; SHARE_PLAINTEXT_BYTES],
) -> Result<[u8; SHARE_CIPHERTEXT_BYTES], SecAggError> {
    Channel::agree(own_channel, peer_channel, session, from, to)?.seal(session, from, to, plaintext)
}

/// [`Channel::open`] with the pair's channel agreed for this one message.
pub fn open_share(
    own_channel: &StaticSecret,
    peer_channel: &[u8; 32],
    session: Session,
    from: u64,
    to: u64,
    ciphertext: &[u8; SHARE_CIPHERTEXT_BYTES],
) -> Result<[u8; SHARE_PLAINTEXT_BYTES], SecAggError> {
    Channel::agree(own_channel, peer_channel, session, to, from)?
        .open(session, from, to, ciphertext)
}

pub fn public_key(secret: &StaticSecret) -> [u8; 32] {
    PublicKey::from(secret).to_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_sides_derive_the_same_seed_and_channel() {
        let session = Session {
            job_id: 1,
            round_id: 2,
        };
        let (a, b) = (random_secret(), random_secret());
        let seed_ab = pairwise_seed(&a, &public_key(&b), session, 10, 20).unwrap();
        let seed_ba = pairwise_seed(&b, &public_key(&a), session, 20, 10).unwrap();
        assert_eq!(seed_ab, seed_ba);
        let other = Session {
            job_id: 1,
            round_id: 3,
        };
        assert_ne!(
            seed_ab,
            pairwise_seed(&a, &public_key(&b), other, 10, 20).unwrap()
        );

        let plain = [5u8; SHARE_PLAINTEXT_BYTES];
        let sealed = seal_share(&a, &public_key(&b), session, 10, 20, &plain).unwrap();
        assert_eq!(
            open_share(&b, &public_key(&a), session, 10, 20, &sealed).unwrap(),
            plain
        );
        assert!(open_share(&b, &public_key(&a), other, 10, 20, &sealed).is_err());
        let mut tampered = sealed;
        tampered[3] ^= 1;
        assert!(open_share(&b, &public_key(&a), session, 10, 20, &tampered).is_err());
    }

    #[test]
    fn low_order_keys_are_refused() {
        let error = pairwise_seed(
            &random_secret(),
            &[0; 32],
            Session {
                job_id: 1,
                round_id: 1,
            },
            1,
            2,
        );
        assert!(error.unwrap_err().to_string().contains("low-order"));
    }
}
