//! The binary messages of the six rounds.
//!
//! Every message starts with the same 30-byte header: magic `CNSA`, format
//! version, stage, job id, round id and the device the message is from (to
//! the server) or for (from the server), all little-endian. A reader checks
//! the header against what it expects before it looks at the body, so a
//! message replayed from another round, another job or another stage, or
//! meant for another device, is refused by name. Every count is bounded by
//! [`MAX_DEGREE`](super::params::MAX_DEGREE) and every length is exact.

use super::SecAggError;
use super::params::{MAX_DEGREE, MAX_PARTICIPANTS};

pub const MAGIC: [u8; 4] = *b"CNSA";
/// 2: the ConsistencyCheck round (SurvivorSet, SurvivorSignature), an
/// UnmaskRequest that carries the neighbours' signatures instead of lists,
/// and NeighbourKeys that carry the graph seed and the participants.
/// 3: NeighbourKeys carry each neighbour's device certificate.
/// 4: the ShareCheck round (ShareReceipt, Exclusions) between ShareKeys and
/// MaskedInputCollection.
pub const VERSION: u8 = 4;
pub const HEADER_BYTES: usize = 30;
/// One neighbour in NeighbourKeys: id, enrolled key, certificate (zero when
/// none), channel key, mask key, signature.
pub const NEIGHBOUR_ENTRY_BYTES: usize = 8 + 32 + 64 + 32 + 32 + 64;

/// A share ciphertext: sender, recipient, the self-mask seed's share and the
/// mask key's share, sealed with AES-256-GCM.
pub const SHARE_PLAINTEXT_BYTES: usize = 8 + 8 + 3 * 8 + 5 * 8;
pub const SHARE_CIPHERTEXT_BYTES: usize = SHARE_PLAINTEXT_BYTES + 16;

/// Which job and round a message belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Session {
    pub job_id: u64,
    pub round_id: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Stage {
    AdvertiseKeys = 1,
    NeighbourKeys = 2,
    ShareKeys = 3,
    IncomingShares = 4,
    MaskedInput = 5,
    UnmaskRequest = 6,
    UnmaskResponse = 7,
    SurvivorSet = 8,
    SurvivorSignature = 9,
    ShareReceipt = 10,
    Exclusions = 11,
}

impl Stage {
    fn from_byte(byte: u8) -> Option<Stage> {
        Some(match byte {
            1 => Stage::AdvertiseKeys,
            2 => Stage::NeighbourKeys,
            3 => Stage::ShareKeys,
            4 => Stage::IncomingShares,
            5 => Stage::MaskedInput,
            6 => Stage::UnmaskRequest,
            7 => Stage::UnmaskResponse,
            8 => Stage::SurvivorSet,
            9 => Stage::SurvivorSignature,
            10 => Stage::ShareReceipt,
            11 => Stage::Exclusions,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Stage::AdvertiseKeys => "AdvertiseKeys",
            Stage::NeighbourKeys => "NeighbourKeys",
            Stage::ShareKeys => "ShareKeys",
            Stage::IncomingShares => "IncomingShares",
            Stage::MaskedInput => "MaskedInput",
            Stage::UnmaskRequest => "UnmaskRequest",
            Stage::UnmaskResponse => "UnmaskResponse",
            Stage::SurvivorSet => "SurvivorSet",
            Stage::SurvivorSignature => "SurvivorSignature",
            Stage::ShareReceipt => "ShareReceipt",
            Stage::Exclusions => "Exclusions",
        }
    }

    /// Whether devices send this message (else the server does).
    pub fn sent_by_device(self) -> bool {
        matches!(
            self,
            Stage::AdvertiseKeys
                | Stage::ShareKeys
                | Stage::MaskedInput
                | Stage::SurvivorSignature
                | Stage::UnmaskResponse
                | Stage::ShareReceipt
        )
    }

    /// The server's message that answers this device message, if any: what
    /// the device fetches next, and what a POST with `wait_ms` returns.
    pub fn answer(self) -> Option<Stage> {
        match self {
            Stage::AdvertiseKeys => Some(Stage::NeighbourKeys),
            Stage::ShareKeys => Some(Stage::IncomingShares),
            Stage::ShareReceipt => Some(Stage::Exclusions),
            Stage::MaskedInput => Some(Stage::SurvivorSet),
            Stage::SurvivorSignature => Some(Stage::UnmaskRequest),
            _ => None,
        }
    }

    /// The largest body a message of this stage may have, for a plan with
    /// `masked_bytes` bytes of packed vector.
    pub fn max_bytes(self, masked_bytes: usize) -> usize {
        HEADER_BYTES
            + match self {
                Stage::AdvertiseKeys => 128,
                Stage::NeighbourKeys => {
                    32 + 4 + MAX_PARTICIPANTS * 8 + 4 + MAX_DEGREE * NEIGHBOUR_ENTRY_BYTES
                }
                Stage::ShareKeys => 32 + 4 + MAX_DEGREE * (8 + SHARE_CIPHERTEXT_BYTES),
                Stage::IncomingShares => 4 + MAX_DEGREE * (8 + SHARE_CIPHERTEXT_BYTES),
                Stage::ShareReceipt | Stage::Exclusions => 4 + MAX_DEGREE * 8,
                Stage::MaskedInput => 1 + 8 + masked_bytes,
                Stage::SurvivorSet => 4 + MAX_PARTICIPANTS * 8,
                Stage::SurvivorSignature => 64,
                Stage::UnmaskRequest => 4 + MAX_DEGREE * (8 + 64),
                Stage::UnmaskResponse => 4 + MAX_DEGREE * (8 + 1 + 5 * 8),
            }
    }
}

pub fn header(session: Session, stage: Stage, device_id: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_BYTES + 64);
    out.extend_from_slice(&MAGIC);
    out.push(VERSION);
    out.push(stage as u8);
    out.extend_from_slice(&session.job_id.to_le_bytes());
    out.extend_from_slice(&session.round_id.to_le_bytes());
    out.extend_from_slice(&device_id.to_le_bytes());
    out
}

/// A bounds-checked cursor over a message, positioned after its header.
pub struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
    what: &'static str,
}

impl<'a> Reader<'a> {
    /// Checks the header: magic, version, stage, session and device.
    pub fn open(
        bytes: &'a [u8],
        session: Session,
        stage: Stage,
        device_id: u64,
        max_bytes: usize,
    ) -> Result<Reader<'a>, SecAggError> {
        let what = stage.name();
        let reject = |cause: String| Err(SecAggError::rejected(what, cause));
        if bytes.len() > max_bytes {
            return reject(format!(
                "the message is {} bytes, the limit is {max_bytes}",
                bytes.len()
            ));
        }
        if bytes.len() < HEADER_BYTES || bytes[..4] != MAGIC {
            return reject("it is not a Canopy secure-aggregation message".to_string());
        }
        if bytes[4] != VERSION {
            return reject(format!(
                "format version {} is not supported (this build speaks {VERSION})",
                bytes[4]
            ));
        }
        let got_stage = Stage::from_byte(bytes[5]);
        if got_stage != Some(stage) {
            let name = got_stage.map_or("an unknown stage", Stage::name);
            return reject(format!("it belongs to {name}"));
        }
        let mut reader = Reader { bytes, at: 6, what };
        let (job_id, round_id, device) = (reader.u64()?, reader.u64()?, reader.u64()?);
        if job_id != session.job_id || round_id != session.round_id {
            return reject(format!(
                "it belongs to job {job_id} round {round_id}, not job {} round {} (a replay \
                 from another round?)",
                session.job_id, session.round_id
            ));
        }
        if device != device_id {
            return reject(format!("it names device {device}, not device {device_id}"));
        }
        Ok(reader)
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], SecAggError> {
        if self.bytes.len() - self.at < n {
            return Err(SecAggError::rejected(
                self.what,
                format!("it ends early, at byte {}", self.bytes.len()),
            ));
        }
        let out = &self.bytes[self.at..self.at + n];
        self.at += n;
        Ok(out)
    }

    pub fn array<const N: usize>(&mut self) -> Result<[u8; N], SecAggError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    pub fn u8(&mut self) -> Result<u8, SecAggError> {
        Ok(self.take(1)?[0])
    }

    pub fn u32(&mut self) -> Result<u32, SecAggError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    pub fn u64(&mut self) -> Result<u64, SecAggError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A count, refused above `max`.
    pub fn count(&mut self, max: usize, of: &str) -> Result<usize, SecAggError> {
        let n = self.u32()? as usize;
        if n > max {
            return Err(SecAggError::rejected(
                self.what,
                format!("it lists {n} {of}, the limit is {max}"),
            ));
        }
        Ok(n)
    }

    pub fn rest(&mut self) -> &'a [u8] {
        let out = &self.bytes[self.at..];
        self.at = self.bytes.len();
        out
    }

    /// `count` device ids in strictly ascending order (one spelling per
    /// set, so that equal sets hash equal).
    pub fn ascending_ids(&mut self, count: usize) -> Result<Vec<u64>, SecAggError> {
        let mut ids: Vec<u64> = Vec::with_capacity(count);
        for _ in 0..count {
            let id = self.u64()?;
            if ids.last().is_some_and(|&last| last >= id) {
                return Err(SecAggError::rejected(
                    self.what,
                    format!("device {id} is out of order or repeated; ids must ascend"),
                ));
            }
            ids.push(id);
        }
        Ok(ids)
    }

    /// Refuses trailing bytes.
    pub fn finish(self) -> Result<(), SecAggError> {
        if self.at != self.bytes.len() {
            return Err(SecAggError::rejected(
                self.what,
                format!(
                    "{} unexpected bytes follow its body",
                    self.bytes.len() - self.at
                ),
            ));
        }
        Ok(())
    }
}

/// A message whose body is a set of device ids: a count, then the ids in
/// strictly ascending order (SurvivorSet, ShareReceipt, Exclusions).
pub fn id_list_message<'a>(
    session: Session,
    stage: Stage,
    device_id: u64,
    ids: impl ExactSizeIterator<Item = &'a u64>,
) -> Vec<u8> {
    let mut out = header(session, stage, device_id);
    out.reserve(4 + ids.len() * 8);
    out.extend_from_slice(&(ids.len() as u32).to_le_bytes());
    for id in ids {
        out.extend_from_slice(&id.to_le_bytes());
    }
    out
}

/// Reads an [`id_list_message`] of at most `max_count` ids.
pub fn read_id_list(
    bytes: &[u8],
    session: Session,
    stage: Stage,
    device_id: u64,
    max_count: usize,
    of: &str,
) -> Result<Vec<u64>, SecAggError> {
    let mut reader = Reader::open(bytes, session, stage, device_id, stage.max_bytes(0))?;
    let count = reader.count(max_count, of)?;
    let ids = reader.ascending_ids(count)?;
    reader.finish()?;
    Ok(ids)
}

/// The bytes a device's advertisement signature covers.
pub fn advertisement_signed_bytes(
    session: Session,
    device_id: u64,
    channel_key: &[u8; 32],
    mask_key: &[u8; 32],
) -> Vec<u8> {
    let mut out = header(session, Stage::AdvertiseKeys, device_id);
    out.extend_from_slice(channel_key);
    out.extend_from_slice(mask_key);
    out
}

/// The bytes a survivor's ConsistencyCheck signature covers: the session
/// and a hash of the whole survivor set, so that two devices' signatures
/// agree exactly when they were sent the same set.
pub fn survivors_signed_bytes(session: Session, survivors: &[u64]) -> Vec<u8> {
    use sha2::{Digest, Sha256};
    let mut hasher = Sha256::new();
    for id in survivors {
        hasher.update(id.to_le_bytes());
    }
    let mut out = b"canopy-secagg-v2 survivors".to_vec();
    out.extend_from_slice(&session.job_id.to_le_bytes());
    out.extend_from_slice(&session.round_id.to_le_bytes());
    out.extend_from_slice(&(survivors.len() as u64).to_le_bytes());
    out.extend_from_slice(&hasher.finalize());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_header_binds_session_stage_and_device() {
        let session = Session {
            job_id: 4,
            round_id: 9,
        };
        let mut message = header(session, Stage::MaskedInput, 7);
        message.push(1);
        let open = |s, stage, d| {
            Reader::open(&message, s, stage, d, 1000)
                .err()
                .map(|e| e.to_string())
        };
        assert!(open(session, Stage::MaskedInput, 7).is_none());
        let replay = open(
            Session {
                job_id: 4,
                round_id: 8,
            },
            Stage::MaskedInput,
            7,
        )
        .unwrap();
        assert!(
            replay.contains("job 4 round 9, not job 4 round 8"),
            "{replay}"
        );
        let stage = open(session, Stage::ShareKeys, 7).unwrap();
        assert!(stage.contains("it belongs to MaskedInput"), "{stage}");
        let device = open(session, Stage::MaskedInput, 8).unwrap();
        assert!(device.contains("names device 7, not device 8"), "{device}");
        assert!(Reader::open(&message, session, Stage::MaskedInput, 7, 10).is_err());
        assert!(Reader::open(&message[..20], session, Stage::MaskedInput, 7, 100).is_err());
    }
}
