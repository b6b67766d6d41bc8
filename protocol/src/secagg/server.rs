//! The server's side: checking each device's message against the stage and
//! what the device was sent, routing keys and shares, folding masked inputs
//! into one running sum, and removing the masks at the end.
//!
//! These are functions over explicit inputs rather than one stateful
//! object, because Canopy's server keeps a round's state in its database
//! (so that any server process can carry a round on, and a restart loses
//! nothing). [`Aggregator`] composes them in memory, for tests, benchmarks
//! and as the reference of the order the server must follow.

use std::collections::{BTreeMap, BTreeSet};

use x25519_dalek::StaticSecret;
use zeroize::Zeroize;

use super::client::{pairwise_sign, seed_commitment, verify_advertisement};
use super::crypto::{self, public_key};
use super::graph::Graph;
use super::mask::{self, Sign};
use super::params::Plan;
use super::shamir::{self, Share};
use super::wire::{self, Reader, SHARE_CIPHERTEXT_BYTES, Session, Stage};
use super::{SecAggError, ShareKind, arith};
use crate::device_cert::{Certificate, NO_CERTIFICATE};

/// A device's signed round keys.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Advertisement {
    pub channel_key: [u8; 32],
    pub mask_key: [u8; 32],
    pub signature: [u8; 64],
}

pub type Ciphertext = [u8; SHARE_CIPHERTEXT_BYTES];

/// Checks an AdvertiseKeys message from `device_id` and its signature by the
/// device's enrolled Ed25519 key.
pub fn read_advertisement(
    bytes: &[u8],
    session: Session,
    device_id: u64,
    device_key: &[u8; 32],
) -> Result<Advertisement, SecAggError> {
    let max = Stage::AdvertiseKeys.max_bytes(0);
    let mut reader = Reader::open(bytes, session, Stage::AdvertiseKeys, device_id, max)?;
    let advertisement = Advertisement {
        channel_key: reader.array()?,
        mask_key: reader.array()?,
        signature: reader.array()?,
    };
    reader.finish()?;
    verify_advertisement(
        session,
        device_id,
        device_key,
        &advertisement.channel_key,
        &advertisement.mask_key,
        &advertisement.signature,
    )?;
    Ok(advertisement)
}

/// One neighbour's keys in NeighbourKeys, with the enrolled key that
/// signed them and the device authority's certificate of that key (all
/// zero when the device has none).
#[derive(Clone, Debug)]
pub struct NeighbourEntry {
    pub id: u64,
    pub device_key: [u8; 32],
    pub certificate: Certificate,
    pub advertisement: Advertisement,
}

/// The graph (its seed, which the plan committed to, and the participants,
/// ascending), then the keys of the device's neighbours that advertised.
pub fn neighbour_keys_message(
    session: Session,
    recipient: u64,
    graph_seed: &[u8; 32],
    participants: impl ExactSizeIterator<Item = u64>,
    neighbours: &[NeighbourEntry],
) -> Vec<u8> {
    let mut out = wire::header(session, Stage::NeighbourKeys, recipient);
    out.extend_from_slice(graph_seed);
    out.reserve(4 + participants.len() * 8 + 4 + neighbours.len() * wire::NEIGHBOUR_ENTRY_BYTES);
    out.extend_from_slice(&(participants.len() as u32).to_le_bytes());
    for id in participants {
        out.extend_from_slice(&id.to_le_bytes());
    }
    out.extend_from_slice(&(neighbours.len() as u32).to_le_bytes());
    for entry in neighbours {
        out.extend_from_slice(&entry.id.to_le_bytes());
        out.extend_from_slice(&entry.device_key);
        out.extend_from_slice(&entry.certificate);
        out.extend_from_slice(&entry.advertisement.channel_key);
        out.extend_from_slice(&entry.advertisement.mask_key);
        out.extend_from_slice(&entry.advertisement.signature);
    }
    out
}

/// What a device sent in ShareKeys.
#[derive(Clone, Debug)]
pub struct ShareUpload {
    pub seed_commitment: [u8; 32],
    /// (recipient, ciphertext), one per neighbour it was sent keys of.
    pub ciphertexts: Vec<(u64, Ciphertext)>,
}

/// Checks a ShareKeys message: exactly one ciphertext for each neighbour
/// whose keys the device was sent, and nothing for anyone else.
pub fn read_share_keys(
    bytes: &[u8],
    session: Session,
    sender: u64,
    recipients: &BTreeSet<u64>,
) -> Result<ShareUpload, SecAggError> {
    let max = Stage::ShareKeys.max_bytes(0);
    let mut reader = Reader::open(bytes, session, Stage::ShareKeys, sender, max)?;
    let seed_commitment = reader.array()?;
    let count = reader.count(recipients.len(), "shares")?;
    let mut ciphertexts = Vec::with_capacity(count);
    let mut seen = BTreeSet::new();
    for _ in 0..count {
        let to = reader.u64()?;
        let ciphertext: Ciphertext = reader.array()?;
        if !recipients.contains(&to) {
            return Err(SecAggError::rejected(
                "ShareKeys",
                format!(
                    "device {sender} addressed a share to device {to}, which is not its neighbour"
                ),
            ));
        }
        if !seen.insert(to) {
            return Err(SecAggError::rejected(
                "ShareKeys",
                format!("device {sender} sent device {to} two shares"),
            ));
        }
        ciphertexts.push((to, ciphertext));
    }
    reader.finish()?;
    if let Some(missing) = recipients.difference(&seen).next() {
        return Err(SecAggError::rejected(
            "ShareKeys",
            format!("device {sender} sent no share to its neighbour {missing}"),
        ));
    }
    Ok(ShareUpload {
        seed_commitment,
        ciphertexts,
    })
}

/// The shares addressed to `recipient`, as (sender, ciphertext).
pub fn incoming_shares_message(
    session: Session,
    recipient: u64,
    shares: &[(u64, Ciphertext)],
) -> Vec<u8> {
    let mut out = wire::header(session, Stage::IncomingShares, recipient);
    out.extend_from_slice(&(shares.len() as u32).to_le_bytes());
    for (from, ciphertext) in shares {
        out.extend_from_slice(&from.to_le_bytes());
        out.extend_from_slice(ciphertext);
    }
    out
}

/// Checks a ShareReceipt: the neighbours whose shares `sender` could not
/// open, each one of its neighbours in the graph. A device can go on only
/// while it holds t shares, so a receipt naming more than k - t is refused:
/// that also bounds how many neighbours one lying device can have
/// excluded.
pub fn read_share_receipt(
    bytes: &[u8],
    session: Session,
    sender: u64,
    neighbours: &BTreeSet<u64>,
    plan: &Plan,
) -> Result<Vec<u64>, SecAggError> {
    let max_reports = plan.degree.saturating_sub(plan.threshold);
    let reported = wire::read_id_list(
        bytes,
        session,
        Stage::ShareReceipt,
        sender,
        max_reports,
        "neighbours whose shares would not open",
    )?;
    if let Some(stranger) = reported.iter().find(|id| !neighbours.contains(id)) {
        return Err(SecAggError::rejected(
            "ShareReceipt",
            format!("device {sender} reports device {stranger}, which is not its neighbour"),
        ));
    }
    Ok(reported)
}

/// Who is excluded when ShareCheck closes: every device that some device
/// reported. The server cannot tell whether the sender sealed garbage or
/// the recipient lied, and either way excluding the sender before anyone
/// masks costs the round that one device, as if it had never shared; its
/// neighbours then neither mask with it nor hold its shares.
pub fn excluded_devices<'a>(receipts: impl IntoIterator<Item = &'a [u64]>) -> BTreeSet<u64> {
    receipts.into_iter().flatten().copied().collect()
}

/// The Exclusions sent to `recipient`: its neighbours that were excluded.
pub fn exclusions_message(
    session: Session,
    recipient: u64,
    excluded_neighbours: &BTreeSet<u64>,
) -> Vec<u8> {
    wire::id_list_message(
        session,
        Stage::Exclusions,
        recipient,
        excluded_neighbours.iter(),
    )
}

/// Checks a MaskedInput message and adds its vector into `sum`, modulo
/// 2^b. The individual vector is never materialised: it is added as it is
/// unpacked.
pub fn fold_masked_input(
    sum: &mut [u32],
    bytes: &[u8],
    session: Session,
    sender: u64,
    plan: &Plan,
) -> Result<(), SecAggError> {
    if sum.len() != plan.masked_len() {
        return Err(SecAggError::invalid(format!(
            "the running sum has {} values, the round's vectors {}",
            sum.len(),
            plan.masked_len()
        )));
    }
    let max = Stage::MaskedInput.max_bytes(plan.packed_bytes());
    let mut reader = Reader::open(bytes, session, Stage::MaskedInput, sender, max)?;
    let (bits, len) = (reader.u8()?, reader.u64()?);
    if u32::from(bits) != plan.bits || len != plan.masked_len() as u64 {
        return Err(SecAggError::rejected(
            "MaskedInput",
            format!(
                "device {sender} sent {len} values at {bits} bits; the round expects {} at {}",
                plan.masked_len(),
                plan.bits
            ),
        ));
    }
    let packed = reader.rest();
    if packed.len() != plan.packed_bytes() {
        return Err(SecAggError::rejected(
            "MaskedInput",
            format!(
                "device {sender}'s vector is {} bytes, {} values at {} bits take {}",
                packed.len(),
                plan.masked_len(),
                plan.bits,
                plan.packed_bytes()
            ),
        ));
    }
    // `add_packed` checks the whole vector before it adds anything.
    arith::add_packed(sum, packed, plan.bits)
        .map_err(|e| SecAggError::rejected("MaskedInput", format!("device {sender}: {e}")))
}

/// The survivor set, sent to each survivor for ConsistencyCheck: every
/// device whose masked input is in the sum, ascending.
pub fn survivor_set_message(session: Session, recipient: u64, survivors: &[u64]) -> Vec<u8> {
    wire::id_list_message(session, Stage::SurvivorSet, recipient, survivors.iter())
}

/// Checks a SurvivorSignature: the sender's enrolled key over the survivor
/// set it was sent. A signature that does not verify is refused here, so
/// that one device's garbage never reaches its neighbours' unmask requests
/// (where any bad signature makes a device refuse).
pub fn read_survivor_signature(
    bytes: &[u8],
    session: Session,
    sender: u64,
    device_key: &[u8; 32],
    survivors: &[u64],
) -> Result<[u8; 64], SecAggError> {
    let max = Stage::SurvivorSignature.max_bytes(0);
    let mut reader = Reader::open(bytes, session, Stage::SurvivorSignature, sender, max)?;
    let signature: [u8; 64] = reader.array()?;
    reader.finish()?;
    let reject = |cause: String| SecAggError::rejected("SurvivorSignature", cause);
    let key = crate::keys::verifying_key(device_key)
        .map_err(|cause| reject(format!("device {sender}'s key: {cause}")))?;
    let signed = wire::survivors_signed_bytes(session, survivors);
    key.verify_strict(&signed, &ed25519_dalek::Signature::from_bytes(&signature))
        .map_err(|_| {
            reject(format!(
                "device {sender}'s signature does not cover this round's survivor set with its \
                 enrolled key"
            ))
        })?;
    Ok(signature)
}

/// A survivor's unmask request: the survivor-set signatures of its
/// neighbours that signed, as (id, signature).
pub fn unmask_request_message(
    session: Session,
    recipient: u64,
    signatures: &[(u64, [u8; 64])],
) -> Vec<u8> {
    let mut out = wire::header(session, Stage::UnmaskRequest, recipient);
    out.extend_from_slice(&(signatures.len() as u32).to_le_bytes());
    for (id, signature) in signatures {
        out.extend_from_slice(&id.to_le_bytes());
        out.extend_from_slice(signature);
    }
    out
}

/// One share a device revealed, of a neighbour's secret.
#[derive(Clone, Debug)]
pub struct Reveal {
    pub peer: u64,
    pub kind: ShareKind,
    pub share: Share,
}

/// Checks an UnmaskResponse: exactly the share kinds the device was asked
/// for, one per listed neighbour, never both of one neighbour.
pub fn read_unmask_response(
    bytes: &[u8],
    session: Session,
    sender: u64,
    survivors: &BTreeSet<u64>,
    dropped: &BTreeSet<u64>,
) -> Result<Vec<Reveal>, SecAggError> {
    let max = Stage::UnmaskResponse.max_bytes(0);
    let mut reader = Reader::open(bytes, session, Stage::UnmaskResponse, sender, max)?;
    let count = reader.count(survivors.len() + dropped.len(), "shares")?;
    let x = shamir::point_of(sender)?;
    let mut reveals = Vec::with_capacity(count);
    let mut seen = BTreeSet::new();
    let reject = |cause: String| Err(SecAggError::rejected("UnmaskResponse", cause));
    for _ in 0..count {
        let peer = reader.u64()?;
        let kind = match reader.u8()? {
            1 => ShareKind::SelfMaskSeed,
            2 => ShareKind::MaskKey,
            other => {
                return reject(format!(
                    "device {sender} sent a share of unknown kind {other}"
                ));
            }
        };
        let expected = if survivors.contains(&peer) {
            ShareKind::SelfMaskSeed
        } else if dropped.contains(&peer) {
            ShareKind::MaskKey
        } else {
            return reject(format!(
                "device {sender} revealed a share of device {peer}, which it was not asked about"
            ));
        };
        if !seen.insert(peer) {
            return reject(format!(
                "device {sender} revealed two shares of device {peer}; a device may reveal only one kind"
            ));
        }
        if kind != expected {
            return reject(format!(
                "device {sender} revealed device {peer}'s {} share; it was asked for the {} share",
                kind.name(),
                expected.name()
            ));
        }
        let ys = (0..kind.chunks())
            .map(|_| reader.u64())
            .collect::<Result<Vec<_>, _>>()?;
        if ys.iter().any(|&y| y >= shamir::PRIME) {
            return reject(format!(
                "device {sender}'s share of device {peer} is not a field element"
            ));
        }
        reveals.push(Reveal {
            peer,
            kind,
            share: Share { x, ys },
        });
    }
    reader.finish()?;
    Ok(reveals)
}

/// What the server knows at the end of a round, for unmasking.
#[derive(Default)]
pub struct UnmaskBook {
    /// Devices whose masked input is in the sum: their seed commitments.
    pub survivors: BTreeMap<u64, [u8; 32]>,
    /// Devices that shared keys but whose masked input is not in the sum:
    /// their mask public key, and the surviving neighbours (with their mask
    /// public keys) that added a pairwise mask with them.
    pub dropped: BTreeMap<u64, DroppedPeer>,
    pub seed_shares: BTreeMap<u64, Vec<Share>>,
    pub key_shares: BTreeMap<u64, Vec<Share>>,
}

pub struct DroppedPeer {
    pub mask_key: [u8; 32],
    pub masked_with: Vec<(u64, [u8; 32])>,
}

impl UnmaskBook {
    pub fn add(&mut self, reveals: Vec<Reveal>) {
        for reveal in reveals {
            let book = match reveal.kind {
                ShareKind::SelfMaskSeed => &mut self.seed_shares,
                ShareKind::MaskKey => &mut self.key_shares,
            };
            book.entry(reveal.peer).or_default().push(reveal.share);
        }
    }
}

/// How many different threshold-sized windows of shares to try before
/// calling a device's shares inconsistent.
const MAX_REBUILD_ATTEMPTS: usize = 8;

/// Rebuilds each survivor's self-mask seed and each dropout's mask key from
/// the revealed shares, and removes every mask from `sum`, leaving the sum
/// of the survivors' inputs modulo 2^b.
pub fn unmask(
    sum: &mut [u32],
    plan: &Plan,
    session: Session,
    book: &UnmaskBook,
) -> Result<(), SecAggError> {
    // Secrets are rebuilt first, then every mask is expanded at once over
    // the cores: the expansion (AES over the whole vector, per mask) is
    // most of unmasking's time.
    // Sized up front so that no reallocation leaves seeds behind.
    let count = book.survivors.len()
        + book
            .dropped
            .values()
            .map(|p| p.masked_with.len())
            .sum::<usize>();
    let mut masks: Vec<(mask::Seed, Sign)> = Vec::with_capacity(count);
    let rebuilt = rebuild_masks(plan, session, book, &mut masks);
    if rebuilt.is_ok() {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        mask::apply_all(sum, &masks, threads);
    }
    masks.iter_mut().for_each(|(seed, _)| seed.zeroize());
    rebuilt?;
    let modulus = plan.modulus_mask();
    sum.iter_mut().for_each(|v| *v &= modulus);
    Ok(())
}

/// The masks to remove: each survivor's self mask, and each dropout's
/// pairwise mask with each surviving neighbour that added one, with the
/// sign that cancels it.
fn rebuild_masks(
    plan: &Plan,
    session: Session,
    book: &UnmaskBook,
    masks: &mut Vec<(mask::Seed, Sign)>,
) -> Result<(), SecAggError> {
    for (&device, commitment) in &book.survivors {
        let shares = book.seed_shares.get(&device).map_or(&[][..], Vec::as_slice);
        let mut seed = rebuild(
            shares,
            plan.threshold,
            16,
            device,
            "self-mask seed",
            |bytes| {
                let seed: [u8; 16] = bytes.try_into().expect("16 bytes");
                seed_commitment(session, device, &seed) == *commitment
            },
        )?;
        masks.push((
            seed.as_slice().try_into().expect("16 bytes"),
            Sign::Subtract,
        ));
        seed.zeroize();
    }
    for (&device, peer) in &book.dropped {
        let shares = book.key_shares.get(&device).map_or(&[][..], Vec::as_slice);
        let mut key = rebuild(shares, plan.threshold, 32, device, "mask key", |bytes| {
            let secret: [u8; 32] = bytes.try_into().expect("32 bytes");
            public_key(&StaticSecret::from(secret)) == peer.mask_key
        })?;
        let mut secret_bytes: [u8; 32] = key.as_slice().try_into().expect("32 bytes");
        key.zeroize();
        let secret = StaticSecret::from(secret_bytes);
        secret_bytes.zeroize();
        for (survivor, survivor_key) in &peer.masked_with {
            let seed = crypto::pairwise_seed(&secret, survivor_key, session, device, *survivor)?;
            masks.push((seed, pairwise_sign(*survivor, device).flip()));
        }
    }
    Ok(())
}

fn rebuild(
    shares: &[Share],
    threshold: usize,
    len: usize,
    device: u64,
    what: &str,
    is_right: impl Fn(&[u8]) -> bool,
) -> Result<Vec<u8>, SecAggError> {
    if shares.len() < threshold {
        return Err(SecAggError::Unrecoverable(format!(
            "only {} shares of device {device}'s {what} arrived; rebuilding it needs {threshold}",
            shares.len()
        )));
    }
    let windows = (shares.len() - threshold + 1).min(MAX_REBUILD_ATTEMPTS);
    for start in 0..windows {
        if let Ok(secret) = shamir::reconstruct(&shares[start..], threshold, len) {
            if is_right(&secret) {
                return Ok(secret);
            }
        }
    }
    Err(SecAggError::Unrecoverable(format!(
        "the {} shares of device {device}'s {what} are inconsistent: no {threshold} of them \
         rebuild the committed value",
        shares.len()
    )))
}

/// Fails the round once more devices have dropped out than the plan
/// tolerates: (k, t) were chosen for that many, and no more.
pub fn check_dropouts(plan: &Plan, remaining: usize, stage: Stage) -> Result<(), SecAggError> {
    let dropped = plan.participants.saturating_sub(remaining);
    if dropped > plan.max_dropouts {
        return Err(SecAggError::Unrecoverable(format!(
            "{dropped} of {} devices dropped out by the end of {}; the round tolerates {}",
            plan.participants,
            stage.name(),
            plan.max_dropouts
        )));
    }
    Ok(())
}

/// A whole round in memory, in the order Canopy's server runs it.
pub struct Aggregator {
    session: Session,
    plan: Plan,
    graph_seed: [u8; 32],
    graph: Graph,
    device_keys: BTreeMap<u64, [u8; 32]>,
    /// Device certificates relayed with the keys; absent ones go as zeros.
    certificates: BTreeMap<u64, Certificate>,
    stage: Stage,
    advertisements: BTreeMap<u64, Advertisement>,
    sent_keys_of: BTreeMap<u64, BTreeSet<u64>>,
    /// Who shared keys and was not excluded.
    uploads: BTreeMap<u64, ShareUpload>,
    receipts: BTreeMap<u64, Vec<u64>>,
    excluded: BTreeSet<u64>,
    sum: Vec<u32>,
    masked: BTreeSet<u64>,
    survivors: Vec<u64>,
    signatures: BTreeMap<u64, [u8; 64]>,
    requests: BTreeMap<u64, (BTreeSet<u64>, BTreeSet<u64>)>,
    book: UnmaskBook,
    answered: BTreeSet<u64>,
}

impl Aggregator {
    /// `device_keys`: each participant's enrolled Ed25519 public key.
    pub fn new(
        session: Session,
        plan: Plan,
        graph_seed: &[u8; 32],
        device_keys: &[(u64, [u8; 32])],
    ) -> Result<Aggregator, SecAggError> {
        plan.validate()?;
        let ids: Vec<u64> = device_keys.iter().map(|(id, _)| *id).collect();
        if ids.len() != plan.participants {
            return Err(SecAggError::invalid(format!(
                "the plan is for {} devices, {} were given",
                plan.participants,
                ids.len()
            )));
        }
        if plan.graph_commitment != super::graph::commitment(graph_seed) {
            return Err(SecAggError::invalid(
                "the plan commits to another graph seed (see Plan::commit_graph)".to_string(),
            ));
        }
        let graph = Graph::new(graph_seed, &ids, plan.degree)?;
        Ok(Aggregator {
            session,
            sum: vec![0; plan.masked_len()],
            plan,
            graph_seed: *graph_seed,
            graph,
            device_keys: device_keys.iter().copied().collect(),
            certificates: BTreeMap::new(),
            stage: Stage::AdvertiseKeys,
            advertisements: BTreeMap::new(),
            sent_keys_of: BTreeMap::new(),
            uploads: BTreeMap::new(),
            receipts: BTreeMap::new(),
            excluded: BTreeSet::new(),
            masked: BTreeSet::new(),
            survivors: Vec::new(),
            signatures: BTreeMap::new(),
            requests: BTreeMap::new(),
            book: UnmaskBook::default(),
            answered: BTreeSet::new(),
        })
    }

    /// The device authority's certificates of the participants' enrolled
    /// keys, relayed in NeighbourKeys to devices that pin the authority.
    pub fn set_certificates(&mut self, certificates: impl IntoIterator<Item = (u64, Certificate)>) {
        self.certificates = certificates.into_iter().collect();
    }

    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    /// The bytes of round state this aggregator holds: ids, keys,
    /// ciphertexts, commitments, revealed shares and the running sum (the
    /// payloads, without the maps' own overhead). What a server holding a
    /// round in memory would hold; Canopy's server keeps the same in its
    /// database.
    pub fn held_bytes(&self) -> usize {
        const ID: usize = std::mem::size_of::<u64>();
        let sets = |sets: &mut dyn Iterator<Item = &BTreeSet<u64>>| -> usize {
            sets.map(|set| ID + set.len() * ID).sum()
        };
        let keys = self.device_keys.len() * (ID + 32)
            + self.certificates.len() * (ID + 64)
            + self.graph.len() * 2 * ID;
        let advertised = self.advertisements.len() * (ID + std::mem::size_of::<Advertisement>());
        let shares: usize = self
            .uploads
            .values()
            .map(|upload| ID + 32 + upload.ciphertexts.len() * (ID + SHARE_CIPHERTEXT_BYTES))
            .sum();
        let requested = sets(&mut self.requests.values().flat_map(|(s, d)| [s, d]))
            + sets(&mut self.sent_keys_of.values());
        let revealed: usize = [&self.book.seed_shares, &self.book.key_shares]
            .into_iter()
            .flat_map(|book| book.values().flatten())
            .map(|share| ID + share.ys.len() * ID)
            .sum();
        let sum = self.sum.len() * std::mem::size_of::<u32>();
        let consistency = self.survivors.len() * ID + self.signatures.len() * (ID + 64);
        let receipts: usize = self
            .receipts
            .values()
            .map(|r| ID + r.len() * ID)
            .sum::<usize>()
            + self.excluded.len() * ID;
        keys + advertised
            + receipts
            + consistency
            + shares
            + requested
            + revealed
            + sum
            + (self.masked.len() + self.answered.len()) * ID
    }

    fn expect(&self, stage: Stage, device: u64) -> Result<(), SecAggError> {
        if self.stage != stage {
            return Err(SecAggError::OutOfOrder(format!(
                "device {device}'s {} message arrived during {}",
                stage.name(),
                self.stage.name()
            )));
        }
        if !self.graph.contains(device) {
            return Err(SecAggError::rejected(
                stage.name(),
                format!("device {device} is not a participant of this round"),
            ));
        }
        Ok(())
    }

    fn duplicate(stage: Stage, device: u64) -> SecAggError {
        SecAggError::rejected(stage.name(), format!("device {device} already sent one"))
    }

    pub fn receive_advertisement(&mut self, device: u64, bytes: &[u8]) -> Result<(), SecAggError> {
        self.expect(Stage::AdvertiseKeys, device)?;
        if self.advertisements.contains_key(&device) {
            return Err(Self::duplicate(Stage::AdvertiseKeys, device));
        }
        let advertisement =
            read_advertisement(bytes, self.session, device, &self.device_keys[&device])?;
        self.advertisements.insert(device, advertisement);
        Ok(())
    }

    /// Ends AdvertiseKeys and returns each advertised device's NeighbourKeys.
    pub fn close_advertising(&mut self) -> Result<BTreeMap<u64, Vec<u8>>, SecAggError> {
        check_dropouts(&self.plan, self.advertisements.len(), Stage::AdvertiseKeys)?;
        self.stage = Stage::ShareKeys;
        let mut out = BTreeMap::new();
        for &device in self.advertisements.keys() {
            let neighbours: Vec<NeighbourEntry> = self
                .graph
                .neighbours(device)
                .unwrap_or_default()
                .into_iter()
                .filter_map(|n| {
                    Some(NeighbourEntry {
                        id: n,
                        device_key: self.device_keys[&n],
                        certificate: self.certificates.get(&n).copied().unwrap_or(NO_CERTIFICATE),
                        advertisement: self.advertisements.get(&n)?.clone(),
                    })
                })
                .collect();
            self.sent_keys_of
                .insert(device, neighbours.iter().map(|entry| entry.id).collect());
            let participants = self.graph.participants();
            let message = neighbour_keys_message(
                self.session,
                device,
                &self.graph_seed,
                participants,
                &neighbours,
            );
            out.insert(device, message);
        }
        Ok(out)
    }

    pub fn receive_shares(&mut self, device: u64, bytes: &[u8]) -> Result<(), SecAggError> {
        self.expect(Stage::ShareKeys, device)?;
        if self.uploads.contains_key(&device) {
            return Err(Self::duplicate(Stage::ShareKeys, device));
        }
        let Some(recipients) = self.sent_keys_of.get(&device) else {
            return Err(SecAggError::rejected(
                "ShareKeys",
                format!("device {device} did not advertise keys"),
            ));
        };
        let upload = read_share_keys(bytes, self.session, device, recipients)?;
        self.uploads.insert(device, upload);
        Ok(())
    }

    /// Ends ShareKeys and returns each sharing device's IncomingShares.
    pub fn close_sharing(&mut self) -> Result<BTreeMap<u64, Vec<u8>>, SecAggError> {
        check_dropouts(&self.plan, self.uploads.len(), Stage::ShareKeys)?;
        self.stage = Stage::ShareReceipt;
        let mut inbox: BTreeMap<u64, Vec<(u64, Ciphertext)>> = BTreeMap::new();
        for (&from, upload) in &self.uploads {
            for (to, ciphertext) in &upload.ciphertexts {
                if self.uploads.contains_key(to) {
                    inbox.entry(*to).or_default().push((from, *ciphertext));
                }
            }
        }
        Ok(self
            .uploads
            .keys()
            .map(|&device| {
                let shares = inbox.remove(&device).unwrap_or_default();
                (
                    device,
                    incoming_shares_message(self.session, device, &shares),
                )
            })
            .collect())
    }

    pub fn receive_share_receipt(&mut self, device: u64, bytes: &[u8]) -> Result<(), SecAggError> {
        self.expect(Stage::ShareReceipt, device)?;
        if !self.uploads.contains_key(&device) {
            return Err(SecAggError::rejected(
                "ShareReceipt",
                format!("device {device} did not share its keys"),
            ));
        }
        if self.receipts.contains_key(&device) {
            return Err(Self::duplicate(Stage::ShareReceipt, device));
        }
        let neighbours = self.graph.neighbours(device).unwrap_or_default();
        let neighbours = neighbours.into_iter().collect();
        let reported = read_share_receipt(bytes, self.session, device, &neighbours, &self.plan)?;
        self.receipts.insert(device, reported);
        Ok(())
    }

    /// Ends ShareCheck: excludes every device reported (it counts as one
    /// that never shared), and returns each remaining device's Exclusions.
    pub fn close_checking(&mut self) -> Result<BTreeMap<u64, Vec<u8>>, SecAggError> {
        self.excluded = excluded_devices(self.receipts.values().map(Vec::as_slice));
        let excluded = &self.excluded;
        let remaining = self
            .receipts
            .keys()
            .filter(|id| !excluded.contains(id))
            .count();
        check_dropouts(&self.plan, remaining, Stage::ShareReceipt)?;
        self.uploads.retain(|id, _| !excluded.contains(id));
        self.stage = Stage::MaskedInput;
        Ok(self
            .receipts
            .keys()
            .filter(|id| !excluded.contains(id))
            .map(|&device| {
                let neighbours = self.graph.neighbours(device).unwrap_or_default();
                let excluded_neighbours = neighbours
                    .into_iter()
                    .filter(|id| excluded.contains(id))
                    .collect();
                let message = exclusions_message(self.session, device, &excluded_neighbours);
                (device, message)
            })
            .collect())
    }

    /// The devices excluded when ShareCheck closed.
    pub fn excluded(&self) -> &BTreeSet<u64> {
        &self.excluded
    }

    pub fn receive_masked_input(&mut self, device: u64, bytes: &[u8]) -> Result<(), SecAggError> {
        self.expect(Stage::MaskedInput, device)?;
        if self.excluded.contains(&device) {
            return Err(SecAggError::rejected(
                "MaskedInput",
                format!(
                    "device {device} was excluded from the round: a neighbour could not open \
                     its shares"
                ),
            ));
        }
        if !self.receipts.contains_key(&device) {
            return Err(SecAggError::rejected(
                "MaskedInput",
                format!("device {device} sent no ShareReceipt"),
            ));
        }
        if !self.uploads.contains_key(&device) {
            return Err(SecAggError::rejected(
                "MaskedInput",
                format!("device {device} did not share its keys"),
            ));
        }
        if self.masked.contains(&device) {
            return Err(Self::duplicate(Stage::MaskedInput, device));
        }
        fold_masked_input(&mut self.sum, bytes, self.session, device, &self.plan)?;
        self.masked.insert(device);
        Ok(())
    }

    /// Ends MaskedInputCollection and returns each survivor's SurvivorSet.
    pub fn close_collection(&mut self) -> Result<BTreeMap<u64, Vec<u8>>, SecAggError> {
        check_dropouts(&self.plan, self.masked.len(), Stage::MaskedInput)?;
        self.stage = Stage::SurvivorSignature;
        self.survivors = self.masked.iter().copied().collect();
        Ok(self
            .masked
            .iter()
            .map(|&device| {
                let message = survivor_set_message(self.session, device, &self.survivors);
                (device, message)
            })
            .collect())
    }

    pub fn receive_survivor_signature(
        &mut self,
        device: u64,
        bytes: &[u8],
    ) -> Result<(), SecAggError> {
        self.expect(Stage::SurvivorSignature, device)?;
        if !self.masked.contains(&device) {
            return Err(SecAggError::rejected(
                "SurvivorSignature",
                format!("device {device} sent no masked input"),
            ));
        }
        if self.signatures.contains_key(&device) {
            return Err(Self::duplicate(Stage::SurvivorSignature, device));
        }
        let key = &self.device_keys[&device];
        let signature = read_survivor_signature(bytes, self.session, device, key, &self.survivors)?;
        self.signatures.insert(device, signature);
        Ok(())
    }

    /// Ends ConsistencyCheck and returns each survivor's UnmaskRequest.
    pub fn close_consistency(&mut self) -> Result<BTreeMap<u64, Vec<u8>>, SecAggError> {
        check_dropouts(&self.plan, self.signatures.len(), Stage::SurvivorSignature)?;
        self.stage = Stage::UnmaskResponse;
        let shared = |id: &u64| self.uploads.contains_key(id);
        let mut out = BTreeMap::new();
        for &device in &self.masked {
            let neighbours = self.graph.neighbours(device).unwrap_or_default();
            let signatures: Vec<(u64, [u8; 64])> = neighbours
                .iter()
                .filter_map(|n| Some((*n, *self.signatures.get(n)?)))
                .collect();
            let (survivors, dropped): (BTreeSet<u64>, BTreeSet<u64>) = neighbours
                .into_iter()
                .filter(shared)
                .partition(|id| self.masked.contains(id));
            out.insert(
                device,
                unmask_request_message(self.session, device, &signatures),
            );
            self.requests.insert(device, (survivors, dropped));
        }
        Ok(out)
    }

    pub fn receive_unmask_response(
        &mut self,
        device: u64,
        bytes: &[u8],
    ) -> Result<(), SecAggError> {
        self.expect(Stage::UnmaskResponse, device)?;
        let Some((survivors, dropped)) = self.requests.get(&device) else {
            return Err(SecAggError::rejected(
                "UnmaskResponse",
                format!("device {device} was not asked to unmask"),
            ));
        };
        if self.answered.contains(&device) {
            return Err(Self::duplicate(Stage::UnmaskResponse, device));
        }
        let reveals = read_unmask_response(bytes, self.session, device, survivors, dropped)?;
        self.book.add(reveals);
        self.answered.insert(device);
        Ok(())
    }

    /// Removes the masks; returns the sum of the survivors' inputs and
    /// their ids.
    pub fn finish(mut self) -> Result<(Vec<u32>, BTreeSet<u64>), SecAggError> {
        check_dropouts(&self.plan, self.answered.len(), Stage::UnmaskResponse)?;
        for &device in &self.masked {
            self.book
                .survivors
                .insert(device, self.uploads[&device].seed_commitment);
        }
        for &device in self.uploads.keys().filter(|d| !self.masked.contains(d)) {
            let masked_with = self
                .graph
                .neighbours(device)
                .unwrap_or_default()
                .into_iter()
                .filter(|n| self.masked.contains(n))
                .map(|n| (n, self.advertisements[&n].mask_key))
                .collect();
            self.book.dropped.insert(
                device,
                DroppedPeer {
                    mask_key: self.advertisements[&device].mask_key,
                    masked_with,
                },
            );
        }
        unmask(&mut self.sum, &self.plan, self.session, &self.book)?;
        Ok((self.sum, self.masked))
    }
}
