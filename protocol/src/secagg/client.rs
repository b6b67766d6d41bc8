//! The device's side of a round, as a state machine that consumes the
//! server's messages and produces its own, one stage at a time.
//!
//! The device keeps its secrets (two X25519 keys and the self-mask seed)
//! for the round only; they are zeroized when the `Client` is dropped. It
//! answers the unmask request once, and never reveals both kinds of share
//! of the same neighbour.
//!
//! Against a server that lies about who dropped out, telling different
//! devices different things, the device takes part in a ConsistencyCheck
//! (Bonawitz et al. 2017, §6, on the sparse graph of Bell et al. 2020): the
//! server sends every survivor the whole survivor set, each signs it with
//! its enrolled key, and a device reveals shares only once t of its
//! surviving neighbours have signed the very set it was sent. An honest
//! device signs one set, so two sets that disagree about a device D cannot
//! both gather t signatures among D's neighbours while 2t > k + (corrupt
//! neighbours), which the plan's (k, t) guarantee: the server cannot get
//! D's self-mask seed from some of them and the mask keys that remove D's
//! pairwise masks from others.

use std::collections::{BTreeMap, BTreeSet};

use ed25519_dalek::VerifyingKey;
use rand::rngs::SmallRng;
use rand::{RngCore, SeedableRng};
use sha2::{Digest, Sha256};
use x25519_dalek::StaticSecret;
use zeroize::Zeroize;

use super::crypto::{self, public_key, random_secret};
use super::graph::{self, Graph};
use super::mask::{self, Seed, Sign};
use super::params::Plan;
use super::shamir::{self, Share};
use super::wire::{self, Reader, SHARE_CIPHERTEXT_BYTES, SHARE_PLAINTEXT_BYTES, Session, Stage};
use super::{SecAggError, ShareKind, arith};
use crate::auth::DeviceKey;
use crate::device_cert::{self, Certificate, KeyTrust};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    Advertised,
    Shared,
    Checked,
    Masked,
    Signed,
    Unmasked,
}

struct PeerKeys {
    /// Agreed once, in ShareKeys, for both directions.
    channel: crypto::Channel,
    mask: [u8; 32],
    /// The neighbour's enrolled Ed25519 key, which signed its round keys
    /// and signs its survivor set: parsed once (a point decompression).
    device_key: VerifyingKey,
}

/// What a device got in IncomingShares: the shares it opened, by sender,
/// and the senders whose share it could not open.
type OpenedShares = (BTreeMap<u64, (Share, Share)>, BTreeSet<u64>);

/// The survivor set a device signed.
struct SurvivorView {
    /// What its signature and its neighbours' must cover.
    signed: Vec<u8>,
    /// Neighbours that shared keys with it and survived; the rest of those
    /// that shared dropped out.
    alive: BTreeSet<u64>,
}

pub struct Client {
    session: Session,
    device_id: u64,
    plan: Plan,
    /// Who vouches for the neighbours' enrolled keys.
    trust: KeyTrust,
    channel_secret: StaticSecret,
    mask_secret: StaticSecret,
    self_seed: Seed,
    step: Step,
    neighbours: BTreeMap<u64, PeerKeys>,
    /// Shares received from each neighbour that completed ShareKeys and
    /// was not excluded: the neighbours whose pairwise masks this device
    /// adds.
    received: BTreeMap<u64, (Share, Share)>,
    /// Neighbours whose shares this device could not open, as reported in
    /// its ShareReceipt: the server must exclude every one of them.
    unreadable: BTreeSet<u64>,
    /// Neighbours the server excluded from the round in Exclusions.
    excluded: BTreeSet<u64>,
    view: Option<SurvivorView>,
}

impl Drop for Client {
    fn drop(&mut self) {
        self.self_seed.zeroize();
        for (seed_share, key_share) in self.received.values_mut() {
            seed_share.ys.zeroize();
            key_share.ys.zeroize();
        }
    }
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("session", &self.session)
            .field("device_id", &self.device_id)
            .field("step", &self.step)
            .finish_non_exhaustive()
    }
}

/// Binds a self-mask seed without revealing it, so the server can tell a
/// correctly rebuilt seed from one rebuilt from bad shares.
pub fn seed_commitment(session: Session, device_id: u64, seed: &Seed) -> [u8; 32] {
    let mut hasher = Sha256::new();
    hasher.update(b"canopy-secagg-v1 self-mask seed");
    hasher.update(session.job_id.to_le_bytes());
    hasher.update(session.round_id.to_le_bytes());
    hasher.update(device_id.to_le_bytes());
    hasher.update(seed);
    hasher.finalize().into()
}

impl Client {
    /// Starts a round: fresh keys, and the signed AdvertiseKeys message.
    /// `trust` says whose word a neighbour's enrolled key is taken on: with
    /// [`KeyTrust::Authority`] the server cannot substitute keys.
    pub fn start(
        session: Session,
        device_id: u64,
        plan: Plan,
        device_key: &DeviceKey,
        trust: KeyTrust,
    ) -> Result<(Client, Vec<u8>), SecAggError> {
        plan.validate()?;
        shamir::point_of(device_id)?;
        let (channel_secret, mask_secret) = (random_secret(), random_secret());
        let mut self_seed = [0u8; 16];
        rand::rng().fill_bytes(&mut self_seed);
        let (channel, mask) = (public_key(&channel_secret), public_key(&mask_secret));
        let signed = wire::advertisement_signed_bytes(session, device_id, &channel, &mask);
        let mut message = signed;
        message.extend_from_slice(&device_key.sign_message(&message));
        let client = Client {
            session,
            device_id,
            plan,
            trust,
            channel_secret,
            mask_secret,
            self_seed,
            step: Step::Advertised,
            neighbours: BTreeMap::new(),
            received: BTreeMap::new(),
            unreadable: BTreeSet::new(),
            excluded: BTreeSet::new(),
            view: None,
        };
        Ok((client, message))
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    fn expect(&self, step: Step, doing: &str) -> Result<(), SecAggError> {
        if self.step != step {
            return Err(SecAggError::OutOfOrder(format!(
                "device {} cannot {doing} now: it is past {:?}",
                self.device_id, self.step
            )));
        }
        Ok(())
    }

    /// ShareKeys: checks the neighbours' signed keys, splits the self-mask
    /// seed and the mask key t-of-k among them, and seals each neighbour's
    /// shares to it.
    pub fn share_keys(&mut self, neighbour_keys: &[u8]) -> Result<Vec<u8>, SecAggError> {
        self.expect(Step::Advertised, "share its keys")?;
        let max = Stage::NeighbourKeys.max_bytes(0);
        let mut reader = Reader::open(
            neighbour_keys,
            self.session,
            Stage::NeighbourKeys,
            self.device_id,
            max,
        )?;
        let graph_neighbours = self.read_graph(&mut reader)?;
        let authority = self.pinned_authority()?;
        let count = reader.count(self.plan.degree, "neighbours")?;
        let mut neighbours = BTreeMap::new();
        for _ in 0..count {
            let id = reader.u64()?;
            if !graph_neighbours.contains(&id) {
                return Err(SecAggError::rejected(
                    "NeighbourKeys",
                    format!(
                        "device {id} is not device {}'s neighbour in the committed graph",
                        self.device_id
                    ),
                ));
            }
            let device_key: [u8; 32] = reader.array()?;
            let certificate: Certificate = reader.array()?;
            self.check_certificate(authority.as_ref(), id, &device_key, &certificate)?;
            let channel: [u8; 32] = reader.array()?;
            let mask: [u8; 32] = reader.array()?;
            let signature: [u8; 64] = reader.array()?;
            let device_key =
                verify_advertisement(self.session, id, &device_key, &channel, &mask, &signature)?;
            let channel = crypto::Channel::agree(
                &self.channel_secret,
                &channel,
                self.session,
                self.device_id,
                id,
            )?;
            let peer = PeerKeys {
                channel,
                mask,
                device_key,
            };
            if neighbours.insert(id, peer).is_some() {
                return Err(SecAggError::rejected(
                    "NeighbourKeys",
                    format!("device {id} appears twice"),
                ));
            }
        }
        reader.finish()?;
        if neighbours.len() < self.plan.threshold {
            return Err(SecAggError::Unrecoverable(format!(
                "only {} of device {}'s neighbours advertised keys; the round needs {}",
                neighbours.len(),
                self.device_id,
                self.plan.threshold
            )));
        }
        let message = self.seal_shares(&neighbours)?;
        self.neighbours = neighbours;
        self.step = Step::Shared;
        Ok(message)
    }

    /// The authority's key when the device pins one, parsed once for all
    /// its neighbours' certificates.
    fn pinned_authority(&self) -> Result<Option<VerifyingKey>, SecAggError> {
        match self.trust {
            KeyTrust::Server => Ok(None),
            KeyTrust::Authority(authority) => crate::keys::verifying_key(&authority)
                .map(Some)
                .map_err(|cause| {
                    self.untrusted_neighbour(device_cert::CertificateError::AuthorityKey(cause))
                }),
        }
    }

    /// A neighbour's enrolled key, taken on the pinned authority's word
    /// when there is one.
    fn check_certificate(
        &self,
        authority: Option<&VerifyingKey>,
        id: u64,
        device_key: &[u8; 32],
        certificate: &Certificate,
    ) -> Result<(), SecAggError> {
        let Some(authority) = authority else {
            return Ok(());
        };
        device_cert::verify_with(authority, id, device_key, certificate)
            .map_err(|cause| self.untrusted_neighbour(cause))
    }

    fn untrusted_neighbour(&self, cause: device_cert::CertificateError) -> SecAggError {
        SecAggError::rejected(
            "NeighbourKeys",
            format!(
                "{cause}; device {} takes a neighbour's key only on the word of the authority it \
                 pins",
                self.device_id
            ),
        )
    }

    /// The graph seed and the participants that open NeighbourKeys:
    /// checked against the plan's commitment, then this device's
    /// neighbours in the graph they make.
    fn read_graph(&self, reader: &mut Reader<'_>) -> Result<BTreeSet<u64>, SecAggError> {
        let reject = |cause: String| SecAggError::rejected("NeighbourKeys", cause);
        let seed: [u8; 32] = reader.array()?;
        if graph::commitment(&seed) != self.plan.graph_commitment {
            return Err(reject(
                "its graph seed is not the one the plan committed to before any round key \
                 existed: the server picked another graph"
                    .to_string(),
            ));
        }
        let count = reader.count(self.plan.participants, "participants")?;
        if count != self.plan.participants {
            return Err(reject(format!(
                "it lists {count} participants; the plan has {}",
                self.plan.participants
            )));
        }
        let participants = reader.ascending_ids(count)?;
        let graph = Graph::new(&seed, &participants, self.plan.degree)
            .map_err(|e| reject(format!("its graph: {e}")))?;
        let neighbours = graph.neighbours(self.device_id).ok_or_else(|| {
            reject(format!(
                "its participants leave out device {}",
                self.device_id
            ))
        })?;
        Ok(neighbours.into_iter().collect())
    }

    fn seal_shares(&self, neighbours: &BTreeMap<u64, PeerKeys>) -> Result<Vec<u8>, SecAggError> {
        let points = neighbours
            .keys()
            .map(|&id| shamir::point_of(id))
            .collect::<Result<Vec<_>, _>>()?;
        let mut rng = rand::rng();
        let t = self.plan.threshold;
        let seed_shares = shamir::split(&self.self_seed, &points, t, &mut rng)?;
        let mut key_bytes = self.mask_secret.to_bytes();
        let key_shares = shamir::split(&key_bytes, &points, t, &mut rng);
        key_bytes.zeroize();
        let key_shares = key_shares?;
        let mut message = wire::header(self.session, Stage::ShareKeys, self.device_id);
        message.extend_from_slice(&seed_commitment(
            self.session,
            self.device_id,
            &self.self_seed,
        ));
        message.extend_from_slice(&(neighbours.len() as u32).to_le_bytes());
        let entries = neighbours.iter().zip(seed_shares.iter().zip(&key_shares));
        for ((&to, keys), (seed_share, key_share)) in entries {
            let mut plain = [0u8; SHARE_PLAINTEXT_BYTES];
            let values = [self.device_id, to]
                .into_iter()
                .chain(seed_share.ys.iter().copied())
                .chain(key_share.ys.iter().copied());
            for (slot, value) in plain.chunks_exact_mut(8).zip(values) {
                slot.copy_from_slice(&value.to_le_bytes());
            }
            let sealed = keys.channel.seal(self.session, self.device_id, to, &plain);
            plain.zeroize();
            message.extend_from_slice(&to.to_le_bytes());
            message.extend_from_slice(&sealed?);
        }
        Ok(message)
    }

    /// ShareCheck: opens the shares the neighbours sent and answers with a
    /// ShareReceipt naming each neighbour whose share would not open
    /// (tampered with, sealed for another device, or garbage). Such a
    /// neighbour is not a reason to abort: the server excludes it from the
    /// round before anyone masks, as if it had never shared, so it costs
    /// the round only itself. Needs t readable shares, as masking does.
    pub fn check_shares(&mut self, incoming_shares: &[u8]) -> Result<Vec<u8>, SecAggError> {
        self.expect(Step::Shared, "check its neighbours' shares")?;
        let (received, unreadable) = self.open_incoming(incoming_shares)?;
        self.received = received;
        self.unreadable = unreadable;
        self.step = Step::Checked;
        Ok(wire::id_list_message(
            self.session,
            Stage::ShareReceipt,
            self.device_id,
            self.unreadable.iter(),
        ))
    }

    /// MaskedInputCollection: reads the server's Exclusions (which must
    /// name every neighbour this device reported), forgets the excluded
    /// neighbours' shares, then masks `input` (from [`arith::quantize`])
    /// with the self mask and one pairwise mask per remaining neighbour
    /// that shared, and bit-packs the result.
    pub fn masked_input(
        &mut self,
        exclusions: &[u8],
        input: &[u32],
    ) -> Result<Vec<u8>, SecAggError> {
        self.expect(Step::Checked, "send its masked input")?;
        if input.len() != self.plan.masked_len() {
            return Err(SecAggError::invalid(format!(
                "the input vector has {} values, the round expects {}",
                input.len(),
                self.plan.masked_len()
            )));
        }
        let modulus = self.plan.modulus_mask();
        if let Some(index) = input.iter().position(|&v| v & !modulus != 0) {
            return Err(SecAggError::invalid(format!(
                "input element {index} does not fit in {} bits",
                self.plan.bits
            )));
        }
        self.mask_and_pack(exclusions, |_| {
            |first: usize, chunk: &mut [u32]| {
                chunk.copy_from_slice(&input[first..first + chunk.len()]);
            }
        })
    }

    /// [`Client::masked_input`] of the update itself, quantized a window
    /// at a time where it is masked and packed: what a device sends. Each
    /// window of the vector rounds with its own coins, seeded from `rng`.
    pub fn masked_update<R: RngCore + ?Sized>(
        &mut self,
        exclusions: &[u8],
        update: &arith::Quantizer<'_>,
        rng: &mut R,
    ) -> Result<Vec<u8>, SecAggError> {
        self.expect(Step::Checked, "send its masked input")?;
        if update.plan() != &self.plan {
            return Err(SecAggError::invalid(
                "the update was checked against another round's plan".to_string(),
            ));
        }
        let coin_seed = rng.next_u64();
        // A private round's noise comes from a secret key of the device's
        // own, a stream per window so the windows can draw in parallel.
        let mut noise_key = [0u8; 32];
        if update.is_private() {
            rng.fill_bytes(&mut noise_key);
        }
        let message = self.mask_and_pack(exclusions, |first| {
            let mut coins = SmallRng::seed_from_u64(coin_seed.wrapping_add(first as u64));
            let mut noise = noise_stream(&noise_key, first);
            move |first: usize, chunk: &mut [u32]| {
                update.fill(first, chunk, &mut coins);
                update.add_noise(first, chunk, &mut noise);
            }
        });
        noise_key.zeroize();
        message
    }

    /// The MaskedInput message: the vector that `window_filler` makes
    /// (see [`mask::fill_mask_pack`]) under every mask, packed after the
    /// header.
    fn mask_and_pack<W, F>(
        &mut self,
        exclusions: &[u8],
        window_filler: W,
    ) -> Result<Vec<u8>, SecAggError>
    where
        W: Fn(usize) -> F + Sync,
        F: FnMut(usize, &mut [u32]),
    {
        self.apply_exclusions(exclusions)?;
        let len = self.plan.masked_len();
        let bits = self.plan.bits;
        let mut message = wire::header(self.session, Stage::MaskedInput, self.device_id);
        message.push(bits as u8);
        message.extend_from_slice(&(len as u64).to_le_bytes());
        let header_len = message.len();
        message.resize(header_len + arith::packed_len(len, bits), 0);
        let mut masks = Vec::with_capacity(self.received.len() + 1);
        masks.push((self.self_seed, Sign::Add));
        let derived = self.pairwise_masks(&mut masks);
        if derived.is_ok() {
            // All masks at once, over the device's cores: the expansion is
            // nearly all of a device's secure-aggregation time.
            let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
            let packed = &mut message[header_len..];
            mask::fill_mask_pack(len, &masks, bits, threads, packed, window_filler);
        }
        masks.iter_mut().for_each(|(seed, _)| seed.zeroize());
        derived?;
        self.step = Step::Masked;
        Ok(message)
    }

    /// Appends the pairwise mask of each neighbour whose shares this device
    /// holds, with its sign; on an error the caller still wipes what was
    /// appended.
    fn pairwise_masks(&self, masks: &mut Vec<(Seed, Sign)>) -> Result<(), SecAggError> {
        for &peer in self.received.keys() {
            let keys = &self.neighbours[&peer];
            let seed = crypto::pairwise_seed(
                &self.mask_secret,
                &keys.mask,
                self.session,
                self.device_id,
                peer,
            )?;
            masks.push((seed, pairwise_sign(self.device_id, peer)));
        }
        Ok(())
    }

    /// Checks the server's Exclusions against this device's receipt and
    /// drops the excluded neighbours' shares.
    fn apply_exclusions(&mut self, exclusions: &[u8]) -> Result<(), SecAggError> {
        let reject = |cause: String| SecAggError::rejected("Exclusions", cause);
        let excluded: BTreeSet<u64> = wire::read_id_list(
            exclusions,
            self.session,
            Stage::Exclusions,
            self.device_id,
            self.plan.degree,
            "excluded neighbours",
        )?
        .into_iter()
        .collect();
        if let Some(stranger) = excluded.iter().find(|id| !self.neighbours.contains_key(id)) {
            return Err(reject(format!(
                "it excludes device {stranger}, which is not one of device {}'s neighbours",
                self.device_id
            )));
        }
        if let Some(kept) = self.unreadable.difference(&excluded).next() {
            return Err(reject(format!(
                "it keeps device {kept} in the round, though device {} reported that device's \
                 shares unreadable: the server must exclude every device reported",
                self.device_id
            )));
        }
        for id in &excluded {
            if let Some((mut seed_share, mut key_share)) = self.received.remove(id) {
                seed_share.ys.zeroize();
                key_share.ys.zeroize();
            }
        }
        self.excluded = excluded;
        if self.received.len() < self.plan.threshold {
            return Err(SecAggError::Unrecoverable(format!(
                "only {} of device {}'s neighbours shared keys and were not excluded; the round \
                 needs {}",
                self.received.len(),
                self.device_id,
                self.plan.threshold
            )));
        }
        Ok(())
    }

    /// The shares in IncomingShares, by sender, and the senders whose
    /// share would not open or was addressed to someone else. A message
    /// that is malformed, or carries a share from a device that is not a
    /// neighbour, is refused whole: only the server can have made it so.
    fn open_incoming(&self, incoming: &[u8]) -> Result<OpenedShares, SecAggError> {
        let max = Stage::IncomingShares.max_bytes(0);
        let mut reader = Reader::open(
            incoming,
            self.session,
            Stage::IncomingShares,
            self.device_id,
            max,
        )?;
        let count = reader.count(self.plan.degree, "shares")?;
        let own_point = shamir::point_of(self.device_id)?;
        let (mut received, mut unreadable) = (BTreeMap::new(), BTreeSet::new());
        for _ in 0..count {
            let from = reader.u64()?;
            let ciphertext: [u8; SHARE_CIPHERTEXT_BYTES] = reader.array()?;
            let Some(keys) = self.neighbours.get(&from) else {
                return Err(SecAggError::rejected(
                    "IncomingShares",
                    format!(
                        "device {from} is not one of device {}'s neighbours",
                        self.device_id
                    ),
                ));
            };
            if received.contains_key(&from) || unreadable.contains(&from) {
                return Err(SecAggError::rejected(
                    "IncomingShares",
                    format!("device {from}'s shares appear twice"),
                ));
            }
            match self.open_share(keys, from, own_point, &ciphertext) {
                Some(shares) => received.insert(from, shares),
                None => {
                    unreadable.insert(from);
                    None
                }
            };
        }
        reader.finish()?;
        if received.len() < self.plan.threshold {
            return Err(SecAggError::Unrecoverable(format!(
                "only {} of device {}'s neighbours shared keys that it could open ({} would not \
                 open); the round needs {}",
                received.len(),
                self.device_id,
                unreadable.len(),
                self.plan.threshold
            )));
        }
        Ok((received, unreadable))
    }

    /// One neighbour's shares, or `None` when the ciphertext fails
    /// authentication or is addressed from or to another device.
    fn open_share(
        &self,
        keys: &PeerKeys,
        from: u64,
        own_point: u64,
        ciphertext: &[u8; SHARE_CIPHERTEXT_BYTES],
    ) -> Option<(Share, Share)> {
        let mut plain = keys
            .channel
            .open(self.session, from, self.device_id, ciphertext)
            .ok()?;
        let mut words: Vec<u64> = plain
            .chunks_exact(8)
            .map(|w| u64::from_le_bytes(w.try_into().expect("8-byte chunk")))
            .collect();
        plain.zeroize();
        let addressed = words[0] == from && words[1] == self.device_id;
        let shares = addressed.then(|| {
            let share = |ys: &[u64]| Share {
                x: own_point,
                ys: ys.to_vec(),
            };
            (share(&words[2..5]), share(&words[5..10]))
        });
        words.zeroize();
        shares
    }

    /// ConsistencyCheck: reads the survivor set the server claims (every
    /// device whose masked input is in the sum), checks that it includes
    /// this device and enough of the round and of its neighbours, and signs
    /// it with the device's enrolled key.
    pub fn sign_survivors(
        &mut self,
        survivor_set: &[u8],
        device_key: &DeviceKey,
    ) -> Result<Vec<u8>, SecAggError> {
        self.expect(Step::Masked, "sign the survivor set")?;
        let survivors = read_survivor_set(survivor_set, self.session, self.device_id, &self.plan)?;
        if survivors.binary_search(&self.device_id).is_err() {
            return Err(SecAggError::rejected(
                "SurvivorSet",
                format!(
                    "it leaves out device {} itself, which sent its masked input",
                    self.device_id
                ),
            ));
        }
        if let Some(excluded) = self
            .excluded
            .iter()
            .find(|id| survivors.binary_search(id).is_ok())
        {
            return Err(SecAggError::rejected(
                "SurvivorSet",
                format!(
                    "it lists device {excluded}, which the server excluded from the round before \
                     masking"
                ),
            ));
        }
        let needed = self.plan.participants - self.plan.max_dropouts;
        if survivors.len() < needed {
            return Err(SecAggError::Unrecoverable(format!(
                "the survivor set device {} was sent has {} devices; the round needs {needed}",
                self.device_id,
                survivors.len()
            )));
        }
        let alive: BTreeSet<u64> = self
            .received
            .keys()
            .copied()
            .filter(|id| survivors.binary_search(id).is_ok())
            .collect();
        self.check_enough_alive(alive.len())?;
        let signed = wire::survivors_signed_bytes(self.session, &survivors);
        let mut message = wire::header(self.session, Stage::SurvivorSignature, self.device_id);
        message.extend_from_slice(&device_key.sign_message(&signed));
        self.view = Some(SurvivorView { signed, alive });
        self.step = Step::Signed;
        Ok(message)
    }

    fn check_enough_alive(&self, alive: usize) -> Result<(), SecAggError> {
        if alive < self.plan.threshold {
            return Err(SecAggError::Unrecoverable(format!(
                "only {alive} of device {}'s neighbours survived; unmasking needs {}",
                self.device_id, self.plan.threshold
            )));
        }
        Ok(())
    }

    /// Unmasking: checks that t of its surviving neighbours signed the
    /// survivor set this device signed, then reveals, for each neighbour
    /// that shared keys with it, the share of its self-mask seed if it is
    /// in that set, and of its mask key if not. Answers once.
    pub fn unmask(&mut self, request: &[u8]) -> Result<Vec<u8>, SecAggError> {
        self.expect(Step::Signed, "answer an unmask request")?;
        let view = self.view.as_ref().expect("a signed survivor set");
        let max = Stage::UnmaskRequest.max_bytes(0);
        let mut reader = Reader::open(
            request,
            self.session,
            Stage::UnmaskRequest,
            self.device_id,
            max,
        )?;
        let count = reader.count(self.plan.degree, "signatures")?;
        let mut confirmed = BTreeSet::new();
        for _ in 0..count {
            let (peer, signature) = (reader.u64()?, reader.array::<64>()?);
            self.check_confirmation(view, &confirmed, peer, &signature)?;
            confirmed.insert(peer);
        }
        reader.finish()?;
        if confirmed.len() < self.plan.threshold {
            return Err(SecAggError::Unrecoverable(format!(
                "only {} of device {}'s surviving neighbours signed the survivor set it was \
                 sent; revealing shares needs {}",
                confirmed.len(),
                self.device_id,
                self.plan.threshold
            )));
        }
        // Past this point the device has answered; a second request for
        // this round gets nothing.
        self.step = Step::Unmasked;
        let mut message = wire::header(self.session, Stage::UnmaskResponse, self.device_id);
        message.extend_from_slice(&(self.received.len() as u32).to_le_bytes());
        for (&peer, (seed_share, key_share)) in &self.received {
            let (kind, share) = if view.alive.contains(&peer) {
                (ShareKind::SelfMaskSeed, seed_share)
            } else {
                (ShareKind::MaskKey, key_share)
            };
            message.extend_from_slice(&peer.to_le_bytes());
            message.push(kind as u8);
            for y in &share.ys {
                message.extend_from_slice(&y.to_le_bytes());
            }
        }
        Ok(message)
    }

    /// One neighbour's signature in an unmask request: from a surviving
    /// neighbour, once, over the set this device signed.
    fn check_confirmation(
        &self,
        view: &SurvivorView,
        confirmed: &BTreeSet<u64>,
        peer: u64,
        signature: &[u8; 64],
    ) -> Result<(), SecAggError> {
        let reject = |cause: String| Err(SecAggError::rejected("UnmaskRequest", cause));
        if !view.alive.contains(&peer) {
            return reject(format!(
                "it carries a signature of device {peer}, which is not a surviving neighbour of \
                 device {}",
                self.device_id
            ));
        }
        if confirmed.contains(&peer) {
            return reject(format!("device {peer}'s signature appears twice"));
        }
        let key = &self.neighbours[&peer].device_key;
        let signature = ed25519_dalek::Signature::from_bytes(signature);
        if key.verify_strict(&view.signed, &signature).is_err() {
            return reject(format!(
                "device {peer} did not sign the survivor set device {} was sent: the server \
                 sent the two devices different sets, or altered the signature",
                self.device_id
            ));
        }
        Ok(())
    }
}

/// Reads a SurvivorSet: at most the round's participants, in strictly
/// ascending order (one spelling per set, so equal sets hash equal).
pub fn read_survivor_set(
    bytes: &[u8],
    session: Session,
    device_id: u64,
    plan: &Plan,
) -> Result<Vec<u64>, SecAggError> {
    wire::read_id_list(
        bytes,
        session,
        Stage::SurvivorSet,
        device_id,
        plan.participants,
        "survivors",
    )
}

/// The lower id adds the pair's mask and the higher subtracts it, so the
/// two cancel in the sum.
pub fn pairwise_sign(own_id: u64, peer_id: u64) -> Sign {
    if own_id < peer_id {
        Sign::Add
    } else {
        Sign::Subtract
    }
}

/// Checks a neighbour's advertisement against its enrolled Ed25519 key, and
/// returns that key, parsed.
pub fn verify_advertisement(
    session: Session,
    device_id: u64,
    device_key: &[u8; 32],
    channel: &[u8; 32],
    mask: &[u8; 32],
    signature: &[u8; 64],
) -> Result<VerifyingKey, SecAggError> {
    let key = crate::keys::verifying_key(device_key).map_err(|cause| {
        SecAggError::rejected(
            "AdvertiseKeys",
            format!("device {device_id}'s key: {cause}"),
        )
    })?;
    let signed = wire::advertisement_signed_bytes(session, device_id, channel, mask);
    key.verify_strict(&signed, &ed25519_dalek::Signature::from_bytes(signature))
        .map(|()| key)
        .map_err(|_| {
            SecAggError::rejected(
                "AdvertiseKeys",
                format!(
                    "device {device_id}'s keys are not signed by its enrolled key for job {} \
                     round {}",
                    session.job_id, session.round_id
                ),
            )
        })
}

/// The noise stream of the window of the masked vector that starts at
/// word `first`: ChaCha12 keyed by the device's secret noise key and the
/// window.
fn noise_stream(key: &[u8; 32], first: usize) -> rand::rngs::StdRng {
    let mut window_key: [u8; 32] = Sha256::new()
        .chain_update(b"canopy secagg noise window v1")
        .chain_update(key)
        .chain_update((first as u64).to_le_bytes())
        .finalize()
        .into();
    let stream = rand::rngs::StdRng::from_seed(window_key);
    window_key.zeroize();
    stream
}
