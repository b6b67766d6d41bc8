//! Acceptance: adversarial inputs. Shares addressed to the wrong device,
//! tampered ciphertexts, messages replayed from an earlier round, a request
//! for both kinds of share of one peer, duplicate device ids and vectors of
//! the wrong length are each refused with an error that names the message,
//! the device and the cause. After every attempt the round goes on with the
//! honest devices and unmasks to exactly their sum, and no device's masked
//! vector (even stripped of every mask the server legitimately learns)
//! gives its input away.
//!
//! Each test runs a real round of ten devices in memory (the same
//! `Client`/`Aggregator` pair as `secagg_exact.rs`) up to the stage under
//! test, injects the bad message, and then lets the round finish.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Debug;

use canopy_protocol::auth::DeviceKey;
use canopy_protocol::device_cert::{Certificate, DeviceAuthority, KeyTrust};
use canopy_protocol::secagg::client::{pairwise_sign, seed_commitment};
use canopy_protocol::secagg::crypto::{self, public_key, random_secret};
use canopy_protocol::secagg::graph::Graph;
use canopy_protocol::secagg::params::Plan;
use canopy_protocol::secagg::server::{self, UnmaskBook};
use canopy_protocol::secagg::wire::{
    self, HEADER_BYTES, SHARE_CIPHERTEXT_BYTES, SHARE_PLAINTEXT_BYTES, Stage,
};
use canopy_protocol::secagg::{
    Aggregator, Client, SecAggConfig, SecAggError, Session, ShareKind, arith, mask, shamir,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use x25519_dalek::StaticSecret;

const JOB: u64 = 7;
const DEVICES: usize = 10;
const UPDATE_LEN: usize = 64;
/// Where the header keeps the round id: after magic, version, stage and job.
const ROUND_ID_AT: usize = 4 + 1 + 1 + 8;
/// NeighbourKeys entry: id, enrolled key, certificate, channel key, mask
/// key, signature.
const KEYS_ENTRY: usize = wire::NEIGHBOUR_ENTRY_BYTES;
/// Where a NeighbourKeys entry keeps the enrolled key, the certificate and
/// the round keys with their signature.
const ENROLLED_AT: std::ops::Range<usize> = 8..40;
const CERTIFICATE_AT: std::ops::Range<usize> = 40..104;
const CHANNEL_AT: std::ops::Range<usize> = 104..136;
const MASK_AT: std::ops::Range<usize> = 136..168;
const ROUND_KEYS_FROM: usize = 104;
/// ShareKeys and IncomingShares entry: the other device's id and a ciphertext.
const SHARE_ENTRY: usize = 8 + SHARE_CIPHERTEXT_BYTES;
/// ShareKeys starts with the seed commitment.
const SHARE_KEYS_HEAD: usize = HEADER_BYTES + 32;
/// MaskedInput: bits (1 byte) and length (8 bytes) precede the packed vector.
const MASKED_BODY_AT: usize = HEADER_BYTES + 1 + 8;

// ---------------------------------------------------------------------------
// Error checks: the exact variant, the message refused, and what the cause
// says.

#[track_caller]
fn rejected<T: Debug>(result: Result<T, SecAggError>, message: &str, says: &[&str]) {
    let error = match result {
        Err(error @ SecAggError::Rejected { .. }) => error,
        other => panic!("expected {message} to be refused, got {other:?}"),
    };
    let text = error.to_string();
    let SecAggError::Rejected {
        message: refused,
        cause,
    } = error
    else {
        unreachable!("matched above")
    };
    assert_eq!(refused, message, "the wrong message was refused: {cause}");
    assert_eq!(text, format!("{message} refused: {cause}"));
    for needle in says {
        assert!(cause.contains(needle), "{text}\n  should say: {needle}");
    }
}

#[track_caller]
fn invalid<T: Debug>(result: Result<T, SecAggError>, says: &[&str]) {
    let text = match result {
        Err(SecAggError::Invalid(text)) => text,
        other => panic!("expected an Invalid error, got {other:?}"),
    };
    for needle in says {
        assert!(text.contains(needle), "{text}\n  should say: {needle}");
    }
}

#[track_caller]
fn out_of_order<T: Debug>(result: Result<T, SecAggError>, says: &[&str]) {
    let text = match result {
        Err(SecAggError::OutOfOrder(text)) => text,
        other => panic!("expected an OutOfOrder error, got {other:?}"),
    };
    for needle in says {
        assert!(text.contains(needle), "{text}\n  should say: {needle}");
    }
}

#[track_caller]
fn unrecoverable<T: Debug>(result: Result<T, SecAggError>, says: &[&str]) {
    let text = match result {
        Err(SecAggError::Unrecoverable(text)) => text,
        other => panic!("expected an Unrecoverable error, got {other:?}"),
    };
    for needle in says {
        assert!(text.contains(needle), "{text}\n  should say: {needle}");
    }
}

fn another_round(replayed: u64, current: u64) -> String {
    format!("it belongs to job {JOB} round {replayed}, not job {JOB} round {current}")
}

fn not_signed(device: u64, round_id: u64) -> String {
    format!(
        "device {device}'s keys are not signed by its enrolled key for job {JOB} round {round_id}"
    )
}

// ---------------------------------------------------------------------------
// Message surgery.

/// The neighbours a ShareReceipt reports.
fn reported(receipt: &[u8]) -> Vec<u64> {
    let count = u32::from_le_bytes(receipt[HEADER_BYTES..][..4].try_into().unwrap()) as usize;
    (0..count)
        .map(|i| u64_at(receipt, HEADER_BYTES + 4 + i * 8))
        .collect()
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
}

fn flip_bit(bytes: &[u8], at: usize) -> Vec<u8> {
    let mut out = bytes.to_vec();
    out[at] ^= 0x10;
    out
}

/// The same message with another round id in its header.
fn restamp(bytes: &[u8], round_id: u64) -> Vec<u8> {
    let mut out = bytes.to_vec();
    out[ROUND_ID_AT..ROUND_ID_AT + 8].copy_from_slice(&round_id.to_le_bytes());
    out
}

/// A message that ends in a u32 count and that many fixed-size entries,
/// each starting with a device id: NeighbourKeys, ShareKeys and
/// IncomingShares.
#[derive(Clone)]
struct List {
    head: Vec<u8>,
    entries: Vec<Vec<u8>>,
}

impl List {
    fn parse(bytes: &[u8], head: usize, entry: usize) -> List {
        let count = u32::from_le_bytes(bytes[head..head + 4].try_into().expect("4 bytes"));
        assert_eq!(
            bytes.len(),
            head + 4 + count as usize * entry,
            "a whole list"
        );
        List {
            head: bytes[..head].to_vec(),
            entries: bytes[head + 4..]
                .chunks(entry)
                .map(<[u8]>::to_vec)
                .collect(),
        }
    }

    fn bytes(&self) -> Vec<u8> {
        let mut out = self.head.clone();
        out.extend_from_slice(&(self.entries.len() as u32).to_le_bytes());
        self.entries.iter().for_each(|e| out.extend_from_slice(e));
        out
    }

    fn ids(&self) -> Vec<u64> {
        self.entries.iter().map(|e| u64_at(e, 0)).collect()
    }

    fn index_of(&self, id: u64) -> usize {
        self.ids()
            .iter()
            .position(|&e| e == id)
            .unwrap_or_else(|| panic!("device {id} is not listed"))
    }

    fn entry(&self, id: u64) -> &[u8] {
        &self.entries[self.index_of(id)]
    }

    fn entry_mut(&mut self, id: u64) -> &mut Vec<u8> {
        let at = self.index_of(id);
        &mut self.entries[at]
    }
}

/// Where NeighbourKeys' list of keys starts: after the graph seed and the
/// participants.
fn neighbour_keys_head(bytes: &[u8]) -> usize {
    let at = HEADER_BYTES + 32;
    let participants = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
    at + 4 + participants * 8
}

fn neighbour_keys(bytes: &[u8]) -> List {
    List::parse(bytes, neighbour_keys_head(bytes), KEYS_ENTRY)
}

fn share_keys(bytes: &[u8]) -> List {
    List::parse(bytes, SHARE_KEYS_HEAD, SHARE_ENTRY)
}

fn incoming_shares(bytes: &[u8]) -> List {
    List::parse(bytes, HEADER_BYTES, SHARE_ENTRY)
}

/// One revealed share of an UnmaskResponse: peer, kind byte, field elements.
type Revealed = (u64, u8, Vec<u64>);

fn response_entries(bytes: &[u8]) -> Vec<Revealed> {
    let count = u32::from_le_bytes(bytes[HEADER_BYTES..HEADER_BYTES + 4].try_into().unwrap());
    let mut at = HEADER_BYTES + 4;
    let mut out = Vec::new();
    for _ in 0..count {
        let (peer, kind) = (u64_at(bytes, at), bytes[at + 8]);
        at += 9;
        let chunks = if kind == ShareKind::SelfMaskSeed as u8 {
            ShareKind::SelfMaskSeed.chunks()
        } else {
            ShareKind::MaskKey.chunks()
        };
        let ys = (0..chunks).map(|i| u64_at(bytes, at + 8 * i)).collect();
        at += 8 * chunks;
        out.push((peer, kind, ys));
    }
    assert_eq!(at, bytes.len(), "a whole response");
    out
}

fn response_bytes(session: Session, device: u64, entries: &[Revealed]) -> Vec<u8> {
    let mut out = wire::header(session, Stage::UnmaskResponse, device);
    out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    for (peer, kind, ys) in entries {
        out.extend_from_slice(&peer.to_le_bytes());
        out.push(*kind);
        ys.iter()
            .for_each(|y| out.extend_from_slice(&y.to_le_bytes()));
    }
    out
}

/// The survivor-set signatures an UnmaskRequest carries, as (signer,
/// signature).
fn request_signatures(bytes: &[u8]) -> Vec<(u64, [u8; 64])> {
    List::parse(bytes, HEADER_BYTES, 8 + 64)
        .entries
        .iter()
        .map(|e| (u64_at(e, 0), e[8..].try_into().unwrap()))
        .collect()
}

/// A SurvivorSet with the ids as given, order and repeats included.
fn raw_survivor_set(session: Session, device: u64, ids: &[u64]) -> Vec<u8> {
    let mut out = wire::header(session, Stage::SurvivorSet, device);
    out.extend_from_slice(&(ids.len() as u32).to_le_bytes());
    ids.iter()
        .for_each(|id| out.extend_from_slice(&id.to_le_bytes()));
    out
}

/// The vector a MaskedInput message carries, as the server would add it.
fn unpack(plan: &Plan, bytes: &[u8]) -> Vec<u32> {
    let mut values = vec![0u32; plan.masked_len()];
    arith::add_packed(&mut values, &bytes[MASKED_BODY_AT..], plan.bits).expect("a packed vector");
    values
}

/// Positions where two vectors agree modulo 2^b.
fn agreeing(plan: &Plan, a: &[u32], b: &[u32]) -> usize {
    let modulus = plan.modulus_mask();
    a.iter()
        .zip(b)
        .filter(|&(x, y)| x & modulus == y & modulus)
        .count()
}

/// "Nearly all positions differ": a uniformly random b-bit mask leaves a
/// position unchanged with probability 2^-b.
#[track_caller]
fn assert_hidden(plan: &Plan, seen: &[u32], input: &[u32], what: &str) {
    let same = agreeing(plan, seen, input);
    assert!(
        same * 20 <= plan.masked_len(),
        "{what} agrees with the device's input in {same} of {} positions",
        plan.masked_len()
    );
}

// ---------------------------------------------------------------------------
// A round in memory, one step at a time, with every message kept.

fn config(bits: u32) -> SecAggConfig {
    SecAggConfig {
        enabled: true,
        max_dropout_fraction: 0.2,
        bits,
        max_weight: 1,
        ..SecAggConfig::default()
    }
}

fn plan(bits: u32) -> Plan {
    let plan = config(bits)
        .plan(DEVICES, UPDATE_LEN)
        .expect("a feasible plan");
    // The tests below rely on a sparse graph (some devices are not
    // neighbours) and on two tolerated dropouts.
    assert!(plan.degree < DEVICES - 1 && plan.degree < 2 * plan.threshold);
    assert_eq!(plan.max_dropouts, 2);
    plan
}

/// Three-digit ids, so that "device 101" never matches inside another id.
fn device_ids() -> Vec<u64> {
    (101..).take(DEVICES).collect()
}

fn enrol(ids: &[u64]) -> BTreeMap<u64, DeviceKey> {
    ids.iter().map(|&id| (id, DeviceKey::generate())).collect()
}

type Messages = BTreeMap<u64, Vec<u8>>;

#[derive(Clone, Default)]
struct Transcript {
    advertisements: Messages,
    neighbour_keys: Messages,
    share_keys: Messages,
    incoming_shares: Messages,
    share_receipts: Messages,
    exclusions: Messages,
    masked_inputs: Messages,
    survivor_sets: Messages,
    survivor_signatures: Messages,
    unmask_requests: Messages,
    unmask_responses: Messages,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Step {
    Advertise,
    DeliverAdvertisements,
    CloseAdvertising,
    Share,
    DeliverShares,
    CloseSharing,
    Check,
    DeliverReceipts,
    CloseChecking,
    Mask,
    DeliverMaskedInputs,
    CloseCollection,
    Sign,
    DeliverSignatures,
    CloseConsistency,
    Unmask,
    DeliverResponses,
    Finish,
}

struct Round {
    session: Session,
    plan: Plan,
    keys: BTreeMap<u64, DeviceKey>,
    /// Whose word the honest devices take on their neighbours' keys.
    trust: KeyTrust,
    server: Aggregator,
    clients: BTreeMap<u64, Client>,
    /// Devices the honest steps leave out: dropped, or driven by the test.
    silent: BTreeSet<u64>,
    inputs: BTreeMap<u64, Vec<u32>>,
    rng: StdRng,
    next: Step,
    sent: Transcript,
}

impl Round {
    fn new(round_id: u64) -> Round {
        Round::with(
            round_id,
            plan(24),
            enrol(&device_ids()),
            [round_id as u8; 32],
        )
    }

    fn with(
        round_id: u64,
        plan: Plan,
        keys: BTreeMap<u64, DeviceKey>,
        graph_seed: [u8; 32],
    ) -> Round {
        let session = Session {
            job_id: JOB,
            round_id,
        };
        let plan = plan.commit_graph(&graph_seed);
        let public: Vec<(u64, [u8; 32])> =
            keys.iter().map(|(&id, k)| (id, k.public_key())).collect();
        let server =
            Aggregator::new(session, plan.clone(), &graph_seed, &public).expect("an aggregator");
        Round {
            session,
            plan,
            keys,
            trust: KeyTrust::Server,
            server,
            clients: BTreeMap::new(),
            silent: BTreeSet::new(),
            inputs: BTreeMap::new(),
            rng: StdRng::seed_from_u64(round_id),
            next: Step::Advertise,
            sent: Transcript::default(),
        }
    }

    /// A round whose devices the authority certified, and whose honest
    /// devices pin it.
    fn certified(round_id: u64, authority: &DeviceAuthority) -> Round {
        let mut round = Round::new(round_id);
        round.trust = KeyTrust::Authority(authority.public_key());
        let certificates: Vec<(u64, Certificate)> = round
            .keys
            .iter()
            .map(|(&id, key)| (id, authority.certify(id, &key.public_key())))
            .collect();
        round.server.set_certificates(certificates);
        round
    }

    fn ids(&self) -> Vec<u64> {
        self.keys.keys().copied().collect()
    }

    fn all(&self) -> BTreeSet<u64> {
        self.keys.keys().copied().collect()
    }

    fn neighbours(&self, id: u64) -> Vec<u64> {
        self.server.graph().neighbours(id).expect("a participant")
    }

    /// A participant that is neither `id` nor one of its neighbours.
    fn stranger_to(&self, id: u64) -> u64 {
        let neighbours = self.neighbours(id);
        self.ids()
            .into_iter()
            .find(|&other| other != id && !neighbours.contains(&other))
            .expect("a sparse graph")
    }

    fn client(&mut self, id: u64) -> &mut Client {
        self.clients.get_mut(&id).expect("a started client")
    }

    /// `id` checks `incoming` in place of its IncomingShares; its receipt
    /// goes to the server with the others'. The neighbours it reports.
    fn check_with(&mut self, id: u64, incoming: &[u8]) -> Vec<u64> {
        assert_eq!(self.next, Step::Check, "check_with runs at Step::Check");
        let receipt = self
            .client(id)
            .check_shares(incoming)
            .unwrap_or_else(|e| panic!("device {id} could not check its shares: {e}"));
        self.sent.share_receipts.insert(id, receipt.clone());
        reported(&receipt)
    }

    fn silence(&mut self, id: u64) {
        self.silent.insert(id);
    }

    fn random_input(&mut self) -> Vec<u32> {
        let modulus = self.plan.modulus_mask();
        (0..self.plan.masked_len())
            .map(|_| self.rng.random::<u32>() & modulus)
            .collect()
    }

    /// Runs the honest steps up to, not including, `step`.
    fn run_until(&mut self, step: Step) {
        while self.next < step {
            self.step();
        }
        assert_eq!(self.next, step, "the round is already past {step:?}");
    }

    fn step(&mut self) {
        let session = self.session;
        let speaking = |messages: &Messages, silent: &BTreeSet<u64>| -> Messages {
            messages
                .iter()
                .filter(|(id, _)| !silent.contains(id))
                .map(|(&id, m)| (id, m.clone()))
                .collect()
        };
        fn fail(id: u64, doing: &str, e: SecAggError) -> ! {
            panic!("honest device {id} could not {doing}: {e}")
        }
        self.next = match self.next {
            Step::Advertise => {
                for id in self.ids() {
                    if self.silent.contains(&id) {
                        continue;
                    }
                    let (client, advertisement) =
                        Client::start(session, id, self.plan.clone(), &self.keys[&id], self.trust)
                            .unwrap_or_else(|e| fail(id, "start", e));
                    self.clients.insert(id, client);
                    self.sent.advertisements.insert(id, advertisement);
                }
                Step::DeliverAdvertisements
            }
            Step::DeliverAdvertisements => {
                for (id, m) in speaking(&self.sent.advertisements, &self.silent) {
                    self.server
                        .receive_advertisement(id, &m)
                        .unwrap_or_else(|e| fail(id, "advertise", e));
                }
                Step::CloseAdvertising
            }
            Step::CloseAdvertising => {
                self.sent.neighbour_keys = self.server.close_advertising().expect("advertising");
                Step::Share
            }
            Step::Share => {
                for (id, m) in speaking(&self.sent.neighbour_keys, &self.silent) {
                    let Some(client) = self.clients.get_mut(&id) else {
                        continue;
                    };
                    let reply = client
                        .share_keys(&m)
                        .unwrap_or_else(|e| fail(id, "share keys", e));
                    self.sent.share_keys.insert(id, reply);
                }
                Step::DeliverShares
            }
            Step::DeliverShares => {
                for (id, m) in speaking(&self.sent.share_keys, &self.silent) {
                    self.server
                        .receive_shares(id, &m)
                        .unwrap_or_else(|e| fail(id, "upload shares", e));
                }
                Step::CloseSharing
            }
            Step::CloseSharing => {
                self.sent.incoming_shares = self.server.close_sharing().expect("sharing");
                Step::Check
            }
            Step::Check => {
                for (id, m) in speaking(&self.sent.incoming_shares, &self.silent) {
                    // A receipt the test made already (see `check_with`).
                    if self.sent.share_receipts.contains_key(&id) {
                        continue;
                    }
                    let Some(client) = self.clients.get_mut(&id) else {
                        continue;
                    };
                    let reply = client
                        .check_shares(&m)
                        .unwrap_or_else(|e| fail(id, "check its shares", e));
                    self.sent.share_receipts.insert(id, reply);
                }
                Step::DeliverReceipts
            }
            Step::DeliverReceipts => {
                for (id, m) in speaking(&self.sent.share_receipts, &self.silent) {
                    self.server
                        .receive_share_receipt(id, &m)
                        .unwrap_or_else(|e| fail(id, "upload its receipt", e));
                }
                Step::CloseChecking
            }
            Step::CloseChecking => {
                self.sent.exclusions = self.server.close_checking().expect("checking");
                Step::Mask
            }
            Step::Mask => {
                for (id, m) in speaking(&self.sent.exclusions, &self.silent) {
                    if !self.clients.contains_key(&id) {
                        continue;
                    }
                    let input = self.random_input();
                    let reply = self
                        .client(id)
                        .masked_input(&m, &input)
                        .unwrap_or_else(|e| fail(id, "mask its input", e));
                    self.inputs.insert(id, input);
                    self.sent.masked_inputs.insert(id, reply);
                }
                Step::DeliverMaskedInputs
            }
            Step::DeliverMaskedInputs => {
                for (id, m) in speaking(&self.sent.masked_inputs, &self.silent) {
                    self.server
                        .receive_masked_input(id, &m)
                        .unwrap_or_else(|e| fail(id, "upload its masked input", e));
                }
                Step::CloseCollection
            }
            Step::CloseCollection => {
                self.sent.survivor_sets = self.server.close_collection().expect("collection");
                Step::Sign
            }
            Step::Sign => {
                for (id, m) in speaking(&self.sent.survivor_sets, &self.silent) {
                    let key = self.keys[&id].clone();
                    let reply = self
                        .client(id)
                        .sign_survivors(&m, &key)
                        .unwrap_or_else(|e| fail(id, "sign the survivor set", e));
                    self.sent.survivor_signatures.insert(id, reply);
                }
                Step::DeliverSignatures
            }
            Step::DeliverSignatures => {
                for (id, m) in speaking(&self.sent.survivor_signatures, &self.silent) {
                    self.server
                        .receive_survivor_signature(id, &m)
                        .unwrap_or_else(|e| fail(id, "upload its signature", e));
                }
                Step::CloseConsistency
            }
            Step::CloseConsistency => {
                self.sent.unmask_requests = self.server.close_consistency().expect("consistency");
                Step::Unmask
            }
            Step::Unmask => {
                for (id, m) in speaking(&self.sent.unmask_requests, &self.silent) {
                    let reply = self
                        .client(id)
                        .unmask(&m)
                        .unwrap_or_else(|e| fail(id, "unmask", e));
                    self.sent.unmask_responses.insert(id, reply);
                }
                Step::DeliverResponses
            }
            Step::DeliverResponses => {
                for (id, m) in speaking(&self.sent.unmask_responses, &self.silent) {
                    self.server
                        .receive_unmask_response(id, &m)
                        .unwrap_or_else(|e| fail(id, "upload its shares", e));
                }
                Step::Finish
            }
            Step::Finish => panic!("the round is over"),
        };
    }

    /// Lets the honest devices finish the round and checks that the server
    /// learns exactly the sum of `survivors`' inputs, and that each of
    /// their masked vectors on its own hides its input.
    fn finish_exactly(mut self, survivors: &BTreeSet<u64>) -> Transcript {
        self.run_until(Step::Finish);
        let (sum, unmasked) = self.server.finish().expect("the honest devices finish");
        assert_eq!(&unmasked, survivors, "the devices whose inputs are summed");
        let mut expected = vec![0u32; self.plan.masked_len()];
        for id in survivors {
            for (e, v) in expected.iter_mut().zip(&self.inputs[id]) {
                *e = e.wrapping_add(*v);
            }
        }
        expected
            .iter_mut()
            .for_each(|e| *e &= self.plan.modulus_mask());
        assert_eq!(sum, expected, "the sum of the honest survivors' inputs");
        for id in survivors {
            let masked = unpack(&self.plan, &self.sent.masked_inputs[id]);
            assert_hidden(
                &self.plan,
                &masked,
                &self.inputs[id],
                &format!("device {id}'s masked vector"),
            );
        }
        self.sent
    }
}

/// A device that follows the protocol's message formats with keys of its
/// own making, so that it can seal what an honest client would not.
struct Rogue {
    id: u64,
    key: DeviceKey,
    channel: StaticSecret,
    mask: StaticSecret,
    seed: [u8; 16],
}

impl Rogue {
    fn new(id: u64, key: DeviceKey) -> Rogue {
        Rogue {
            id,
            key,
            channel: random_secret(),
            mask: random_secret(),
            seed: rand::rng().random(),
        }
    }

    fn advertisement(&self, session: Session) -> Vec<u8> {
        let mut message = wire::advertisement_signed_bytes(
            session,
            self.id,
            &public_key(&self.channel),
            &public_key(&self.mask),
        );
        let signature = self.key.sign_message(&message);
        message.extend_from_slice(&signature);
        message
    }

    /// Real shares of its real secrets for every neighbour, each sealed to
    /// that neighbour; but the plaintext sealed for `victim` says it is
    /// addressed to `claimed`.
    fn share_keys(
        &self,
        session: Session,
        plan: &Plan,
        neighbour_keys_message: &[u8],
        victim: u64,
        claimed: u64,
    ) -> Vec<u8> {
        let peers: Vec<(u64, [u8; 32])> = neighbour_keys(neighbour_keys_message)
            .entries
            .iter()
            .map(|e| (u64_at(e, 0), e[CHANNEL_AT].try_into().unwrap()))
            .collect();
        let points: Vec<u64> = peers
            .iter()
            .map(|(id, _)| shamir::point_of(*id).unwrap())
            .collect();
        let mut rng = rand::rng();
        let seeds = shamir::split(&self.seed, &points, plan.threshold, &mut rng).unwrap();
        let keys = shamir::split(&self.mask.to_bytes(), &points, plan.threshold, &mut rng).unwrap();
        let mut message = wire::header(session, Stage::ShareKeys, self.id);
        message.extend_from_slice(&seed_commitment(session, self.id, &self.seed));
        message.extend_from_slice(&(peers.len() as u32).to_le_bytes());
        for ((to, channel), (seed, key)) in peers.iter().zip(seeds.iter().zip(&keys)) {
            let addressee = if *to == victim { claimed } else { *to };
            let words = [self.id, addressee]
                .into_iter()
                .chain(seed.ys.iter().copied())
                .chain(key.ys.iter().copied());
            let mut plain = [0u8; SHARE_PLAINTEXT_BYTES];
            for (slot, word) in plain.chunks_exact_mut(8).zip(words) {
                slot.copy_from_slice(&word.to_le_bytes());
            }
            let sealed =
                crypto::seal_share(&self.channel, channel, session, self.id, *to, &plain).unwrap();
            message.extend_from_slice(&to.to_le_bytes());
            message.extend_from_slice(&sealed);
        }
        message
    }
}

// ---------------------------------------------------------------------------
// Shares addressed to the wrong device.

#[test]
fn a_share_the_server_forwards_to_the_wrong_device_costs_the_round_only_its_sender() {
    let mut round = Round::new(1);
    round.run_until(Step::Check);
    let b = round.ids()[0];
    let a = round.neighbours(b)[0];
    let c = round
        .neighbours(a)
        .into_iter()
        .find(|&c| c != b)
        .expect("another neighbour");

    // C's whole IncomingShares, delivered to B: refused whole, and B's
    // state is unchanged.
    let for_c = round.sent.incoming_shares[&c].clone();
    let result = round.client(b).check_shares(&for_c);
    rejected(
        result,
        "IncomingShares",
        &[&format!("it names device {c}, not device {b}")],
    );

    // The ciphertext A sealed for C, handed to B in place of A's share for
    // B: B cannot open it, reports A instead of aborting, and the server
    // excludes A. The other nine devices' sum comes out exactly.
    let a_to_c = share_keys(&round.sent.share_keys[&a]).entry(c)[8..].to_vec();
    let mut incoming = incoming_shares(&round.sent.incoming_shares[&b]);
    incoming.entry_mut(a)[8..].copy_from_slice(&a_to_c);
    assert_eq!(round.check_with(b, &incoming.bytes()), vec![a]);
    round.run_until(Step::Mask);
    assert_eq!(round.server.excluded(), &BTreeSet::from([a]));
    let mut survivors = round.all();
    survivors.remove(&a);
    round.finish_exactly(&survivors);
}

#[test]
fn a_share_sealed_for_one_device_but_addressed_to_another_is_reported() {
    let mut round = Round::new(2);
    let rogue_id = round.ids()[0];
    let rogue = Rogue::new(rogue_id, round.keys[&rogue_id].clone());
    round.silence(rogue_id);
    round.run_until(Step::CloseAdvertising);
    let advertisement = rogue.advertisement(round.session);
    round
        .server
        .receive_advertisement(rogue_id, &advertisement)
        .expect("a validly signed advertisement");
    round.run_until(Step::DeliverShares);

    // The rogue seals B's share to B, but writes C as its addressee inside.
    let (b, c) = {
        let neighbours = round.neighbours(rogue_id);
        (neighbours[0], neighbours[1])
    };
    let upload = rogue.share_keys(
        round.session,
        &round.plan,
        &round.sent.neighbour_keys[&rogue_id],
        b,
        c,
    );
    round
        .server
        .receive_shares(rogue_id, &upload)
        .expect("the server cannot see inside the ciphertexts");
    round.run_until(Step::Check);

    // B takes the misaddressed share for one it cannot open: it reports
    // the rogue, which the server excludes, and goes on. The other nine
    // devices' sum comes out exactly.
    let incoming = round.sent.incoming_shares[&b].clone();
    assert_eq!(round.check_with(b, &incoming), vec![rogue_id]);
    let mut survivors = round.all();
    survivors.remove(&rogue_id);
    round.finish_exactly(&survivors);
}

#[test]
fn the_server_refuses_shares_addressed_to_a_device_that_was_not_sent_keys() {
    let mut round = Round::new(3);
    // X never advertises, so nobody is sent its keys.
    let x = round.ids()[DEVICES - 1];
    round.silence(x);
    round.run_until(Step::DeliverShares);
    let a = round.neighbours(x)[0];
    let stranger = round.stranger_to(a);
    let d = round.ids().into_iter().find(|&d| d != a && d != x).unwrap();
    let honest = share_keys(&round.sent.share_keys[&a]);
    assert!(!honest.ids().contains(&x), "A was not sent X's keys");
    let r = honest.ids()[0];

    let readdressed = |to: u64| {
        let mut forged = honest.clone();
        forged.entry_mut(r)[..8].copy_from_slice(&to.to_le_bytes());
        forged.bytes()
    };
    for to in [stranger, x, 999] {
        let result = round.server.receive_shares(a, &readdressed(to));
        rejected(
            result,
            "ShareKeys",
            &[&format!(
                "device {a} addressed a share to device {to}, which is not its neighbour"
            )],
        );
    }

    // Two shares for one neighbour, and none for another.
    let mut twice = honest.clone();
    twice.entries[1] = twice.entries[0].clone();
    let result = round.server.receive_shares(a, &twice.bytes());
    rejected(
        result,
        "ShareKeys",
        &[&format!("device {a} sent device {r} two shares")],
    );
    let mut missing = honest.clone();
    missing.entries.remove(0);
    let result = round.server.receive_shares(a, &missing.bytes());
    rejected(
        result,
        "ShareKeys",
        &[&format!("device {a} sent no share to its neighbour {r}")],
    );

    // A's upload passed off as D's, and an upload from X.
    let result = round.server.receive_shares(d, &honest.bytes());
    rejected(
        result,
        "ShareKeys",
        &[&format!("it names device {a}, not device {d}")],
    );
    let mut from_x = wire::header(round.session, Stage::ShareKeys, x);
    from_x.extend_from_slice(&honest.bytes()[HEADER_BYTES..]);
    let result = round.server.receive_shares(x, &from_x);
    rejected(
        result,
        "ShareKeys",
        &[&format!("device {x} did not advertise keys")],
    );

    let mut survivors = round.all();
    survivors.remove(&x);
    round.finish_exactly(&survivors);
}

// ---------------------------------------------------------------------------
// Tampered ciphertexts and signatures.

#[test]
fn a_tampered_share_ciphertext_is_reported_and_its_sender_excluded() {
    // The first byte of the ciphertext, one in the middle, the last of the
    // tag; then A's ciphertext relabelled as coming from another neighbour.
    let tampers = [
        Some(8),
        Some(8 + SHARE_PLAINTEXT_BYTES / 2),
        Some(SHARE_ENTRY - 1),
        None,
    ];
    for (round_id, tamper) in (40..).zip(tampers) {
        let mut round = Round::new(round_id);
        round.run_until(Step::Check);
        let b = round.ids()[3];
        let (a, other) = {
            let neighbours = round.neighbours(b);
            (neighbours[0], neighbours[1])
        };
        let mut tampered = incoming_shares(&round.sent.incoming_shares[&b]);
        let sender = match tamper {
            Some(at) => {
                tampered.entry_mut(a)[at] ^= 0x01;
                a
            }
            None => {
                let a_ciphertext = tampered.entry(a)[8..].to_vec();
                tampered.entry_mut(other)[8..].copy_from_slice(&a_ciphertext);
                other
            }
        };
        assert_eq!(round.check_with(b, &tampered.bytes()), vec![sender]);
        let mut survivors = round.all();
        survivors.remove(&sender);
        round.finish_exactly(&survivors);
    }
}

#[test]
fn a_tampered_or_forged_advertisement_is_refused_by_the_server() {
    let mut round = Round::new(5);
    round.run_until(Step::DeliverAdvertisements);
    let (a, b) = (round.ids()[0], round.ids()[1]);
    let honest = round.sent.advertisements[&a].clone();
    let signed = HEADER_BYTES + 64;

    // A bit flipped in the channel key, the mask key, the signature.
    for at in [HEADER_BYTES, HEADER_BYTES + 32, signed] {
        let result = round
            .server
            .receive_advertisement(a, &flip_bit(&honest, at));
        rejected(result, "AdvertiseKeys", &[&not_signed(a, 5)]);
    }
    // Keys of an attacker's making, signed by another enrolled device.
    let mut forged = wire::advertisement_signed_bytes(
        round.session,
        a,
        &public_key(&random_secret()),
        &public_key(&random_secret()),
    );
    let signature = round.keys[&b].sign_message(&forged);
    forged.extend_from_slice(&signature);
    let result = round.server.receive_advertisement(a, &forged);
    rejected(result, "AdvertiseKeys", &[&not_signed(a, 5)]);
    // A's genuine advertisement, presented as B's.
    let result = round.server.receive_advertisement(b, &honest);
    rejected(
        result,
        "AdvertiseKeys",
        &[&format!("it names device {a}, not device {b}")],
    );

    // None of these took A's or B's place: their own keys go through.
    let all = round.all();
    round.finish_exactly(&all);
}

#[test]
fn neighbour_keys_with_a_swapped_advertisement_are_refused_by_the_device() {
    let mut round = Round::new(6);
    round.run_until(Step::Share);
    let b = round.ids()[2];
    let (a, c) = {
        let neighbours = round.neighbours(b);
        (neighbours[0], neighbours[1])
    };
    let honest = neighbour_keys(&round.sent.neighbour_keys[&b]);
    let c_entry = honest.entry(c).to_vec();

    let mut attempts: Vec<List> = Vec::new();
    // An attacker's channel key, then mask key, in place of A's.
    for range in [CHANNEL_AT, MASK_AT] {
        let mut forged = honest.clone();
        forged.entry_mut(a)[range].copy_from_slice(&public_key(&random_secret()));
        attempts.push(forged);
    }
    // C's keys and signature under A's id and enrolled key.
    let mut swapped = honest.clone();
    swapped.entry_mut(a)[ROUND_KEYS_FROM..].copy_from_slice(&c_entry[ROUND_KEYS_FROM..]);
    attempts.push(swapped);
    // A's keys, vouched for by C's enrolled key.
    let mut wrong_key = honest.clone();
    wrong_key.entry_mut(a)[ENROLLED_AT].copy_from_slice(&c_entry[ENROLLED_AT]);
    attempts.push(wrong_key);

    for forged in attempts {
        let result = round.client(b).share_keys(&forged.bytes());
        rejected(result, "AdvertiseKeys", &[&not_signed(a, 6)]);
    }

    // B still trusts only the genuine keys and shares with them.
    let all = round.all();
    round.finish_exactly(&all);
}

// ---------------------------------------------------------------------------
// Replays.

#[test]
fn messages_replayed_from_an_earlier_round_are_refused() {
    let ids = device_ids();
    let keys = enrol(&ids);
    let graph_seed = [9; 32];
    let first = Round::with(1, plan(24), keys.clone(), graph_seed);
    let all = first.all();
    let old = first.finish_exactly(&all);

    // Round 2: the same devices, keys and graph; fresh round keys.
    let mut round = Round::with(2, plan(24), keys, graph_seed);
    let a = ids[4];
    let replay = another_round(1, 2);
    let says: [&str; 2] = [&replay, "a replay from another round"];

    round.run_until(Step::DeliverAdvertisements);
    for &id in &ids {
        let result = round
            .server
            .receive_advertisement(id, &old.advertisements[&id]);
        rejected(result, "AdvertiseKeys", &says);
    }
    // Re-stamped with the new round, the old signature no longer verifies.
    let restamped = restamp(&old.advertisements[&a], 2);
    let result = round.server.receive_advertisement(a, &restamped);
    rejected(result, "AdvertiseKeys", &[&not_signed(a, 2)]);

    round.run_until(Step::Share);
    let result = round.client(a).share_keys(&old.neighbour_keys[&a]);
    rejected(result, "NeighbourKeys", &says);
    // Round 1's keys, re-stamped: their signatures cover round 1.
    let result = round
        .client(a)
        .share_keys(&restamp(&old.neighbour_keys[&a], 2));
    let first_neighbour = neighbour_keys(&old.neighbour_keys[&a]).ids()[0];
    rejected(result, "AdvertiseKeys", &[&not_signed(first_neighbour, 2)]);

    round.run_until(Step::DeliverShares);
    for &id in &ids {
        let result = round.server.receive_shares(id, &old.share_keys[&id]);
        rejected(result, "ShareKeys", &says);
    }

    round.run_until(Step::Check);
    let result = round.client(a).check_shares(&old.incoming_shares[&a]);
    rejected(result, "IncomingShares", &says);
    // Re-stamped, none of round 1's ciphertexts open in round 2, and a
    // device that cannot open t shares cannot go on.
    let restamped = restamp(&old.incoming_shares[&a], 2);
    let result = round.client(a).check_shares(&restamped);
    unrecoverable(
        result,
        &[&format!(
            "only 0 of device {a}'s neighbours shared keys that it could open"
        )],
    );

    round.run_until(Step::DeliverReceipts);
    for &id in &ids {
        let result = round
            .server
            .receive_share_receipt(id, &old.share_receipts[&id]);
        rejected(result, "ShareReceipt", &says);
    }

    round.run_until(Step::Mask);
    let input = round.random_input();
    let result = round.client(a).masked_input(&old.exclusions[&a], &input);
    rejected(result, "Exclusions", &says);

    round.run_until(Step::DeliverMaskedInputs);
    for &id in &ids {
        let result = round
            .server
            .receive_masked_input(id, &old.masked_inputs[&id]);
        rejected(result, "MaskedInput", &says);
    }

    round.run_until(Step::Unmask);
    let result = round.client(a).unmask(&old.unmask_requests[&a]);
    rejected(result, "UnmaskRequest", &says);

    round.run_until(Step::DeliverResponses);
    for &id in &ids {
        let result = round
            .server
            .receive_unmask_response(id, &old.unmask_responses[&id]);
        rejected(result, "UnmaskResponse", &says);
    }

    // Nothing from round 1 got into round 2's sum.
    round.finish_exactly(&all);
}

#[test]
fn a_second_copy_of_a_message_in_the_same_round_is_refused() {
    let mut round = Round::new(7);
    let a = round.ids()[5];
    let again = format!("device {a} already sent one");

    round.run_until(Step::CloseAdvertising);
    let copy = round.sent.advertisements[&a].clone();
    rejected(
        round.server.receive_advertisement(a, &copy),
        "AdvertiseKeys",
        &[&again],
    );

    round.run_until(Step::DeliverShares);
    let copy = round.sent.neighbour_keys[&a].clone();
    out_of_order(
        round.client(a).share_keys(&copy),
        &[&format!("device {a} cannot share its keys now")],
    );
    round.run_until(Step::CloseSharing);
    let copy = round.sent.share_keys[&a].clone();
    rejected(
        round.server.receive_shares(a, &copy),
        "ShareKeys",
        &[&again],
    );

    round.run_until(Step::DeliverReceipts);
    let copy = round.sent.incoming_shares[&a].clone();
    out_of_order(
        round.client(a).check_shares(&copy),
        &[&format!(
            "device {a} cannot check its neighbours' shares now"
        )],
    );
    round.run_until(Step::CloseChecking);
    let copy = round.sent.share_receipts[&a].clone();
    rejected(
        round.server.receive_share_receipt(a, &copy),
        "ShareReceipt",
        &[&again],
    );

    round.run_until(Step::DeliverMaskedInputs);
    let (copy, input) = (round.sent.exclusions[&a].clone(), round.inputs[&a].clone());
    out_of_order(
        round.client(a).masked_input(&copy, &input),
        &[&format!("device {a} cannot send its masked input now")],
    );
    round.run_until(Step::CloseCollection);
    let copy = round.sent.masked_inputs[&a].clone();
    rejected(
        round.server.receive_masked_input(a, &copy),
        "MaskedInput",
        &[&again],
    );

    round.run_until(Step::DeliverResponses);
    let copy = round.sent.unmask_requests[&a].clone();
    out_of_order(
        round.client(a).unmask(&copy),
        &[&format!("device {a} cannot answer an unmask request now")],
    );
    round.run_until(Step::Finish);
    let copy = round.sent.unmask_responses[&a].clone();
    rejected(
        round.server.receive_unmask_response(a, &copy),
        "UnmaskResponse",
        &[&again],
    );

    // Had the second masked input been added, the sum would be off by A's.
    let all = round.all();
    round.finish_exactly(&all);
}

// ---------------------------------------------------------------------------
// ConsistencyCheck: the survivor set and its signatures.

#[test]
fn a_survivor_set_without_the_device_or_below_the_tolerance_is_refused() {
    let mut round = Round::new(14);
    round.run_until(Step::Sign);
    let session = round.session;
    let (a, b) = (round.ids()[0], round.ids()[1]);
    let key = round.keys[&b].clone();
    let without_b: Vec<u64> = round.ids().into_iter().filter(|&id| id != b).collect();
    rejected(
        round
            .client(b)
            .sign_survivors(&raw_survivor_set(session, b, &without_b), &key),
        "SurvivorSet",
        &[&format!(
            "it leaves out device {b} itself, which sent its masked input"
        )],
    );
    // More dropouts than the plan tolerates.
    let needed = DEVICES - round.plan.max_dropouts;
    let too_few: Vec<u64> = round.ids()[1..needed].to_vec();
    unrecoverable(
        round
            .client(b)
            .sign_survivors(&raw_survivor_set(session, b, &too_few), &key),
        &[&format!(
            "the survivor set device {b} was sent has {} devices; the round needs {needed}",
            needed - 1
        )],
    );
    // B's set, signed by A, and A's signature passed off as B's.
    round.run_until(Step::DeliverSignatures);
    let a_key = round.keys[&a].clone();
    let mut over_other = wire::header(session, Stage::SurvivorSignature, a);
    over_other
        .extend_from_slice(&a_key.sign_message(&wire::survivors_signed_bytes(session, &without_b)));
    let not_covered = format!(
        "device {a}'s signature does not cover this round's survivor set with its enrolled key"
    );
    rejected(
        round.server.receive_survivor_signature(a, &over_other),
        "SurvivorSignature",
        &[&not_covered],
    );
    let mut a_as_b = round.sent.survivor_signatures[&a].clone();
    a_as_b[HEADER_BYTES - 8..HEADER_BYTES].copy_from_slice(&b.to_le_bytes());
    rejected(
        round.server.receive_survivor_signature(b, &a_as_b),
        "SurvivorSignature",
        &[&format!(
            "device {b}'s signature does not cover this round's survivor set"
        )],
    );
    round.run_until(Step::CloseConsistency);
    let copy = round.sent.survivor_signatures[&a].clone();
    rejected(
        round.server.receive_survivor_signature(a, &copy),
        "SurvivorSignature",
        &[&format!("device {a} already sent one")],
    );
    let all = round.all();
    round.finish_exactly(&all);
}

#[test]
fn an_unmask_request_the_neighbours_did_not_confirm_is_refused() {
    let mut round = Round::new(8);
    round.run_until(Step::Unmask);
    let session = round.session;
    let t = round.plan.threshold;
    let b = round.ids()[1];
    let neighbours: BTreeSet<u64> = round.neighbours(b).into_iter().collect();
    let signed = request_signatures(&round.sent.unmask_requests[&b]);
    let signers: BTreeSet<u64> = signed.iter().map(|(id, _)| *id).collect();
    assert_eq!(signers, neighbours, "every neighbour signed");
    let (p, q) = (signed[0].0, signed[1].0);
    let stranger = round.stranger_to(b);
    let request =
        |signatures: &[(u64, [u8; 64])]| server::unmask_request_message(session, b, signatures);

    // P's signature over another survivor set: the server told P and B
    // different things.
    let other_set: Vec<u64> = round.ids().into_iter().filter(|&id| id != q).collect();
    let mut forged = signed.clone();
    forged[0].1 = round.keys[&p].sign_message(&wire::survivors_signed_bytes(session, &other_set));
    let did_not_sign = format!("device {p} did not sign the survivor set device {b} was sent");
    rejected(
        round.client(b).unmask(&request(&forged)),
        "UnmaskRequest",
        &[&did_not_sign],
    );
    // Q's signature passed off as P's.
    let mut forged = signed.clone();
    forged[0].1 = signed[1].1;
    rejected(
        round.client(b).unmask(&request(&forged)),
        "UnmaskRequest",
        &[&did_not_sign],
    );
    // A genuine signature over the same set, by a device that is not B's
    // neighbour.
    let mut forged = signed.clone();
    let all_ids = round.ids();
    let by_stranger =
        round.keys[&stranger].sign_message(&wire::survivors_signed_bytes(session, &all_ids));
    forged[0] = (stranger, by_stranger);
    rejected(
        round.client(b).unmask(&request(&forged)),
        "UnmaskRequest",
        &[&format!(
            "it carries a signature of device {stranger}, which is not a surviving neighbour of \
             device {b}"
        )],
    );
    // Fewer than t confirmations.
    unrecoverable(
        round.client(b).unmask(&request(&signed[..t - 1])),
        &[&format!(
            "only {} of device {b}'s surviving neighbours signed the survivor set it was sent; \
             revealing shares needs {t}",
            t - 1
        )],
    );

    // B answers the honest request once, and nothing after it.
    round.run_until(Step::DeliverResponses);
    out_of_order(
        round.client(b).unmask(&request(&signed)),
        &[&format!("device {b} cannot answer an unmask request now")],
    );

    // The server refuses a response that reveals the wrong kind, or both.
    let honest = response_entries(&round.sent.unmask_responses[&b]);
    let at_p = honest.iter().position(|(peer, ..)| *peer == p).unwrap();
    let at_q = honest.iter().position(|(peer, ..)| *peer == q).unwrap();
    let key_share_of_p: Revealed = (
        p,
        ShareKind::MaskKey as u8,
        vec![1; ShareKind::MaskKey.chunks()],
    );
    let mut wrong_kind = honest.clone();
    wrong_kind[at_p] = key_share_of_p.clone();
    let forged = response_bytes(session, b, &wrong_kind);
    let wrong_kind_says = format!(
        "device {b} revealed device {p}'s mask key share; it was asked for the self-mask seed \
         share"
    );
    rejected(
        server::read_unmask_response(&forged, session, b, &neighbours, &BTreeSet::new()),
        "UnmaskResponse",
        &[&wrong_kind_says],
    );
    rejected(
        round.server.receive_unmask_response(b, &forged),
        "UnmaskResponse",
        &[&wrong_kind_says],
    );
    // P's self-mask share, then its key share in place of Q's.
    let mut both_kinds: Vec<Revealed> = honest
        .iter()
        .filter(|(peer, ..)| *peer != q)
        .cloned()
        .collect();
    let after_p = both_kinds.iter().position(|(peer, ..)| *peer == p).unwrap() + 1;
    both_kinds.insert(after_p, key_share_of_p);
    rejected(
        round
            .server
            .receive_unmask_response(b, &response_bytes(session, b, &both_kinds)),
        "UnmaskResponse",
        &[&format!(
            "device {b} revealed two shares of device {p}; a device may reveal only one kind"
        )],
    );
    let mut about_stranger = honest.clone();
    about_stranger[at_q].0 = stranger;
    rejected(
        round
            .server
            .receive_unmask_response(b, &response_bytes(session, b, &about_stranger)),
        "UnmaskResponse",
        &[&format!(
            "device {b} revealed a share of device {stranger}, which it was not asked about"
        )],
    );
    let mut not_a_field_element = honest.clone();
    not_a_field_element[at_p].2[0] = shamir::PRIME;
    rejected(
        round
            .server
            .receive_unmask_response(b, &response_bytes(session, b, &not_a_field_element)),
        "UnmaskResponse",
        &[&format!(
            "device {b}'s share of device {p} is not a field element"
        )],
    );

    let all = round.all();
    round.finish_exactly(&all);
}

// ---------------------------------------------------------------------------
// A server that tells devices different survivor sets.

/// A round in which a server without ConsistencyCheck can unmask one
/// device's input: 100 devices on a sparse graph, and a tolerance of 30 %
/// dropouts, which leaves room to tell every device that k − t of its
/// neighbours dropped out.
fn attack_plan() -> (Plan, Vec<u64>) {
    let ids: Vec<u64> = (101..).take(100).collect();
    let config = SecAggConfig {
        max_dropout_fraction: 0.3,
        ..config(24)
    };
    let plan = config.plan(ids.len(), UPDATE_LEN).expect("a feasible plan");
    assert!(plan.degree < ids.len() - 1, "a sparse graph");
    (plan, ids)
}

/// Which of D's neighbours the server tells each device dropped out (it
/// tells everyone that D survived): each neighbour v of D is called
/// dropped by t of v's own neighbours, who then reveal v's mask-key share,
/// while every device is still told that t of its neighbours survived (or
/// it would refuse anyway) and is sent a set within the dropout tolerance.
/// D's neighbours, told D survived, reveal D's self-mask seed. No device
/// is asked for both shares of one peer. None if the graph leaves no such
/// assignment around D.
fn lies_around(graph: &Graph, plan: &Plan, d: u64) -> Option<BTreeMap<u64, BTreeSet<u64>>> {
    let capacity = (plan.degree - plan.threshold).min(plan.max_dropouts);
    let mut told: BTreeMap<u64, BTreeSet<u64>> = BTreeMap::new();
    let lies = |told: &BTreeMap<u64, BTreeSet<u64>>, x: u64| told.get(&x).map_or(0, BTreeSet::len);
    for v in graph.neighbours(d)? {
        let mut candidates: Vec<u64> = graph
            .neighbours(v)?
            .into_iter()
            .filter(|&x| x != d && lies(&told, x) < capacity)
            .collect();
        if candidates.len() < plan.threshold {
            return None;
        }
        candidates.sort_by_key(|&x| lies(&told, x));
        for &x in &candidates[..plan.threshold] {
            told.entry(x).or_default().insert(v);
        }
    }
    Some(told)
}

/// What the server got out of the attack.
struct Attack {
    /// Devices that answered their unmask request.
    answered: BTreeSet<u64>,
    /// Why the others refused.
    refusals: Vec<SecAggError>,
    /// D's input, if the server could strip every mask from D's vector.
    recovered: Option<Vec<u32>>,
    target_input: Vec<u32>,
}

/// Runs the attack on a fresh round. The server sends each device its
/// tailored survivor set, collects the signatures, and forwards to each
/// device those of its neighbours that signed the same set: all a server
/// can do with honest devices' signatures. With `forge`, it forwards
/// signatures it made with the neighbours' own keys instead: a round in
/// which the check is no obstacle, which is what the round was before
/// ConsistencyCheck.
fn attack(forge: bool) -> Attack {
    let (plan, ids) = attack_plan();
    let mut round = Round::with(15, plan.clone(), enrol(&ids), [15; 32]);
    round.run_until(Step::CloseCollection);
    let session = round.session;
    let graph = round.server.graph().clone();
    let (d, lies) = ids
        .iter()
        .find_map(|&d| Some((d, lies_around(&graph, &plan, d)?)))
        .expect("a device the attack can target");
    let set_for = |x: u64| -> Vec<u64> {
        let told = lies.get(&x).cloned().unwrap_or_default();
        ids.iter()
            .copied()
            .filter(|id| !told.contains(id))
            .collect()
    };

    let mut signed_set = BTreeMap::new();
    let mut signature = BTreeMap::new();
    for &x in &ids {
        let key = round.keys[&x].clone();
        let set = raw_survivor_set(session, x, &set_for(x));
        let message = round
            .client(x)
            .sign_survivors(&set, &key)
            .expect("a set within the tolerance is signed");
        let bytes: [u8; 64] = message[HEADER_BYTES..].try_into().unwrap();
        signature.insert(x, bytes);
        signed_set.insert(x, set_for(x));
    }

    let mut outcome = Attack {
        answered: BTreeSet::new(),
        refusals: Vec::new(),
        recovered: None,
        target_input: round.inputs[&d].clone(),
    };
    let mut book = UnmaskBook::default();
    for &x in &ids {
        let told = lies.get(&x).cloned().unwrap_or_default();
        let alive: BTreeSet<u64> = graph
            .neighbours(x)
            .unwrap()
            .into_iter()
            .filter(|y| !told.contains(y))
            .collect();
        let confirmations: Vec<(u64, [u8; 64])> = alive
            .iter()
            .filter_map(|&y| {
                if forge {
                    let statement = wire::survivors_signed_bytes(session, &set_for(x));
                    Some((y, round.keys[&y].sign_message(&statement)))
                } else {
                    (signed_set[&y] == signed_set[&x]).then(|| (y, signature[&y]))
                }
            })
            .collect();
        let request = server::unmask_request_message(session, x, &confirmations);
        match round.client(x).unmask(&request) {
            Ok(response) => {
                let reveals = server::read_unmask_response(&response, session, x, &alive, &told)
                    .expect("the shares the server asked for");
                book.add(reveals);
                outcome.answered.insert(x);
            }
            Err(refusal) => outcome.refusals.push(refusal),
        }
    }
    outcome.recovered = strip_every_mask(&round, &plan, &graph, d, &book);
    outcome
}

/// D's masked vector with its self mask and every pairwise mask removed,
/// if the revealed shares rebuild D's self-mask seed and the mask key of
/// each of D's neighbours.
fn strip_every_mask(
    round: &Round,
    plan: &Plan,
    graph: &Graph,
    d: u64,
    book: &UnmaskBook,
) -> Option<Vec<u32>> {
    let session = round.session;
    let t = plan.threshold;
    let seed_shares = book.seed_shares.get(&d)?;
    let seed: [u8; 16] = shamir::reconstruct(seed_shares, t, 16)
        .ok()?
        .try_into()
        .ok()?;
    let commitment: [u8; 32] = round.sent.share_keys[&d][HEADER_BYTES..SHARE_KEYS_HEAD]
        .try_into()
        .unwrap();
    if seed_commitment(session, d, &seed) != commitment {
        return None;
    }
    let mask_key_of = |id: u64| -> [u8; 32] {
        round.sent.advertisements[&id][HEADER_BYTES + 32..HEADER_BYTES + 64]
            .try_into()
            .unwrap()
    };
    let mut stripped = unpack(plan, &round.sent.masked_inputs[&d]);
    mask::apply(&mut stripped, &seed, mask::Sign::Subtract);
    for v in graph.neighbours(d).unwrap() {
        let shares = book.key_shares.get(&v)?;
        let key: [u8; 32] = shamir::reconstruct(shares, t, 32).ok()?.try_into().ok()?;
        let secret = StaticSecret::from(key);
        if public_key(&secret) != mask_key_of(v) {
            return None;
        }
        let seed = crypto::pairwise_seed(&secret, &mask_key_of(d), session, v, d).unwrap();
        mask::apply(&mut stripped, &seed, pairwise_sign(d, v).flip());
    }
    stripped.iter_mut().for_each(|v| *v &= plan.modulus_mask());
    Some(stripped)
}

/// Acceptance 3: the attack that ConsistencyCheck stops. With signatures
/// it could forge, the server strips every mask from D's vector and reads
/// D's input; with the devices' own signatures, every device it lied to
/// refuses, and D's input stays hidden.
#[test]
fn a_server_that_tells_devices_different_survivor_sets_learns_no_input() {
    let without_the_check = attack(true);
    assert_eq!(
        without_the_check.recovered.as_ref(),
        Some(&without_the_check.target_input),
        "with signatures it can forge, the server reads D's input"
    );
    assert!(without_the_check.refusals.is_empty());

    let with_the_check = attack(false);
    assert_eq!(with_the_check.recovered, None, "D's input stays hidden");
    assert!(!with_the_check.refusals.is_empty());
    for refusal in &with_the_check.refusals {
        let text = refusal.to_string();
        assert!(
            matches!(refusal, SecAggError::Unrecoverable(_))
                && text.contains("surviving neighbours signed the survivor set it was sent"),
            "{text}"
        );
    }
    // The devices that answered are those the server told the same thing
    // as t of their neighbours; what they revealed is consistent with one
    // survivor set, which is not enough.
    assert!(with_the_check.answered.len() < without_the_check.answered.len());
}

// ---------------------------------------------------------------------------
// A server that picks the graph after seeing the keys.

/// The round keys an advertisement carries, as NeighbourKeys lists them.
fn advertised(round: &Round, id: u64, message: &[u8]) -> server::NeighbourEntry {
    let at = HEADER_BYTES;
    let advertisement = server::Advertisement {
        channel_key: message[at..at + 32].try_into().unwrap(),
        mask_key: message[at + 32..at + 64].try_into().unwrap(),
        signature: message[at + 64..at + 128].try_into().unwrap(),
    };
    server::NeighbourEntry {
        id,
        device_key: round.keys[&id].public_key(),
        certificate: [0; 64],
        advertisement,
    }
}

/// Acceptance 3: the server, having seen which devices advertised (its own
/// among them), picks a graph in which most of the target's neighbours are
/// devices it controls. Had the plan not committed to the seed before any
/// key existed, the target would share its secrets with them, and the
/// server would rebuild both of the target's secrets from their shares;
/// with the commitment, the target refuses the graph.
#[test]
fn a_graph_picked_after_the_keys_is_refused() {
    let mut round = Round::new(16);
    let session = round.session;
    let t = round.plan.threshold;
    let ids = round.ids();
    let target = ids[0];
    // Half the round is the server's: devices it enrolled, with keys it holds.
    let rogues: BTreeMap<u64, Rogue> = ids[5..]
        .iter()
        .map(|&id| (id, Rogue::new(id, round.keys[&id].clone())))
        .collect();
    for &id in rogues.keys() {
        round.silence(id);
    }
    round.run_until(Step::CloseAdvertising);
    let mut adverts: BTreeMap<u64, Vec<u8>> = round.sent.advertisements.clone();
    for (&id, rogue) in &rogues {
        adverts.insert(id, rogue.advertisement(session));
    }
    // A seed whose graph gives the target t of the server's devices.
    let (picked, graph) = (0u8..=255)
        .map(|b| [b; 32])
        .map(|seed| (seed, Graph::new(&seed, &ids, round.plan.degree).unwrap()))
        .find(|(_, graph)| {
            let neighbours = graph.neighbours(target).unwrap();
            neighbours.iter().filter(|n| rogues.contains_key(n)).count() >= t
        })
        .expect("a graph that surrounds the target");
    let keys_in = |graph: &Graph| -> Vec<server::NeighbourEntry> {
        let neighbours = graph.neighbours(target).unwrap();
        neighbours
            .into_iter()
            .map(|n| advertised(&round, n, &adverts[&n]))
            .collect()
    };
    let picked_keys = keys_in(&graph);
    // And the committed seed, with one of the server's devices slipped in.
    let committed = [16u8; 32];
    let honest_graph = Graph::new(&committed, &ids, round.plan.degree).unwrap();
    let stranger = round.stranger_to(target);
    let mut slipped = keys_in(&honest_graph);
    slipped[0] = advertised(&round, stranger, &adverts[&stranger]);
    let message =
        server::neighbour_keys_message(session, target, &picked, ids.iter().copied(), &picked_keys);
    rejected(
        round.client(target).share_keys(&message),
        "NeighbourKeys",
        &["its graph seed is not the one the plan committed to before any round key existed"],
    );
    let message =
        server::neighbour_keys_message(session, target, &committed, ids.iter().copied(), &slipped);
    rejected(
        round.client(target).share_keys(&message),
        "NeighbourKeys",
        &[&format!(
            "device {stranger} is not device {target}'s neighbour in the committed graph"
        )],
    );

    // Without the commitment: a device given the picked seed as its plan's
    // (as if the seed were fixed after the keys) shares with the server's
    // devices, whose t shares rebuild both of its secrets.
    let plan = round.plan.clone().commit_graph(&picked);
    let (mut client, advertisement) = Client::start(
        session,
        target,
        plan,
        &round.keys[&target],
        KeyTrust::Server,
    )
    .unwrap();
    let message =
        server::neighbour_keys_message(session, target, &picked, ids.iter().copied(), &picked_keys);
    let shares = client
        .share_keys(&message)
        .expect("the picked graph is taken");
    assert_secrets_leak(session, target, t, &advertisement, &shares, &rogues);
}

/// What a server that holds the channel keys of `rogues` learns from the
/// target's ShareKeys: it opens their shares and rebuilds the target's
/// self-mask seed (checked against its commitment) and its mask key
/// (checked against the advertised public key), which unmask its input.
fn assert_secrets_leak(
    session: Session,
    target: u64,
    t: usize,
    advertisement: &[u8],
    shares: &[u8],
    rogues: &BTreeMap<u64, Rogue>,
) {
    let target_channel: [u8; 32] = advertisement[HEADER_BYTES..HEADER_BYTES + 32]
        .try_into()
        .unwrap();
    let target_mask: [u8; 32] = advertisement[HEADER_BYTES + 32..HEADER_BYTES + 64]
        .try_into()
        .unwrap();
    let (mut seed_shares, mut key_shares) = (Vec::new(), Vec::new());
    for entry in share_keys(shares).entries {
        let Some(rogue) = rogues.get(&u64_at(&entry, 0)) else {
            continue;
        };
        let ciphertext: [u8; SHARE_CIPHERTEXT_BYTES] = entry[8..].try_into().unwrap();
        let plain = crypto::open_share(
            &rogue.channel,
            &target_channel,
            session,
            target,
            rogue.id,
            &ciphertext,
        )
        .expect("sealed to the server's device");
        let words: Vec<u64> = plain
            .chunks_exact(8)
            .map(|w| u64::from_le_bytes(w.try_into().unwrap()))
            .collect();
        let x = shamir::point_of(rogue.id).unwrap();
        seed_shares.push(shamir::Share {
            x,
            ys: words[2..5].to_vec(),
        });
        key_shares.push(shamir::Share {
            x,
            ys: words[5..10].to_vec(),
        });
    }
    assert!(seed_shares.len() >= t);
    let seed: [u8; 16] = shamir::reconstruct(&seed_shares, t, 16)
        .unwrap()
        .try_into()
        .unwrap();
    let commitment: [u8; 32] = shares[HEADER_BYTES..SHARE_KEYS_HEAD].try_into().unwrap();
    assert_eq!(
        seed_commitment(session, target, &seed),
        commitment,
        "the self-mask seed leaks"
    );
    let key: [u8; 32] = shamir::reconstruct(&key_shares, t, 32)
        .unwrap()
        .try_into()
        .unwrap();
    assert_eq!(
        public_key(&StaticSecret::from(key)),
        target_mask,
        "the mask key leaks"
    );
}

// ---------------------------------------------------------------------------
// A server that substitutes neighbours' keys.

/// Acceptance 3: the server puts keys it made in place of t of the target's
/// neighbours' enrolled keys (and round keys signed by them), under the
/// neighbours' own ids. A device that takes enrolled keys on the server's
/// word seals its shares to the server, which rebuilds both of its secrets.
/// A device that pins the device authority refuses every substitution by
/// the neighbour's name, whatever certificate goes with it: none, the
/// neighbour's own (for its real key), one from another authority, or a
/// genuine one the authority made for a device the server enrolled.
#[test]
fn a_neighbour_key_the_server_substitutes_is_refused() {
    let authority = DeviceAuthority::generate();
    let mut round = Round::certified(18, &authority);
    let session = round.session;
    let t = round.plan.threshold;
    let target = round.ids()[0];
    round.run_until(Step::Share);
    let replaced = round.neighbours(target)[..t].to_vec();
    let impostors: BTreeMap<u64, Rogue> = replaced
        .iter()
        .map(|&id| (id, Rogue::new(id, DeviceKey::generate())))
        .collect();
    let honest = neighbour_keys(&round.sent.neighbour_keys[&target]);
    let enrolled_by_server = 999;
    let substituted = |certify: &dyn Fn(&Rogue, &[u8]) -> Certificate| -> Vec<u8> {
        let mut forged = honest.clone();
        for (&id, impostor) in &impostors {
            let entry = forged.entry_mut(id);
            let certificate = certify(impostor, entry);
            entry[ENROLLED_AT].copy_from_slice(&impostor.key.public_key());
            entry[CERTIFICATE_AT].copy_from_slice(&certificate);
            let advertisement = impostor.advertisement(session);
            entry[ROUND_KEYS_FROM..].copy_from_slice(&advertisement[HEADER_BYTES..]);
        }
        forged.bytes()
    };
    let other_authority = DeviceAuthority::generate();
    type Certify<'a> = &'a dyn Fn(&Rogue, &[u8]) -> Certificate;
    let attempts: [(Certify, &str); 4] = [
        (
            &|_, _| [0; 64],
            "has no certificate from the device authority",
        ),
        (
            &|_, entry| entry[CERTIFICATE_AT].try_into().unwrap(),
            "certificate was not made by the device authority for this id and key",
        ),
        (
            &|rogue, _| other_authority.certify(rogue.id, &rogue.key.public_key()),
            "certificate was not made by the device authority for this id and key",
        ),
        (
            &|rogue, _| authority.certify(enrolled_by_server, &rogue.key.public_key()),
            "certificate was not made by the device authority for this id and key",
        ),
    ];
    for (certify, says) in attempts {
        let first = format!("device {}", replaced[0]);
        rejected(
            round.client(target).share_keys(&substituted(certify)),
            "NeighbourKeys",
            &[&first, says, "the authority it pins"],
        );
    }

    // Without the pin, the same substitution hands the target's secrets over.
    let plan = round.plan.clone();
    let (mut trusting, advertisement) = Client::start(
        session,
        target,
        plan,
        &round.keys[&target],
        KeyTrust::Server,
    )
    .unwrap();
    let forged = substituted(&|_, _| [0; 64]);
    let shares = trusting
        .share_keys(&forged)
        .expect("the server's word is taken");
    assert_secrets_leak(session, target, t, &advertisement, &shares, &impostors);

    // The pinning target still takes the genuine keys, and the round sums.
    let all = round.all();
    round.finish_exactly(&all);
}

// ---------------------------------------------------------------------------
// Duplicate device ids.

#[test]
fn duplicate_device_ids_are_refused() {
    let ids = device_ids();
    let keys = enrol(&ids);
    let mut repeated: Vec<(u64, [u8; 32])> =
        keys.iter().map(|(&id, k)| (id, k.public_key())).collect();
    repeated[DEVICES - 1].0 = ids[0];
    let session = Session {
        job_id: JOB,
        round_id: 10,
    };
    let result = Aggregator::new(
        session,
        plan(24).commit_graph(&[1; 32]),
        &[1; 32],
        &repeated,
    )
    .map(|_| ());
    invalid(
        result,
        &[&format!(
            "the participant list repeats a device id ({DEVICES} ids, {} distinct)",
            DEVICES - 1
        )],
    );

    let mut round = Round::with(10, plan(24), keys, [10; 32]);
    let a = ids[0];
    // A second advertisement from A, with fresh, validly signed keys.
    round.run_until(Step::CloseAdvertising);
    let (_impostor, second) = Client::start(
        round.session,
        a,
        round.plan.clone(),
        &round.keys[&a],
        KeyTrust::Server,
    )
    .unwrap();
    rejected(
        round.server.receive_advertisement(a, &second),
        "AdvertiseKeys",
        &[&format!("device {a} already sent one")],
    );

    // NeighbourKeys that list one neighbour twice, or the device itself.
    round.run_until(Step::Share);
    let b = ids[1];
    let honest = neighbour_keys(&round.sent.neighbour_keys[&b]);
    let first = honest.ids()[0];
    let mut twice = honest.clone();
    twice.entries[1] = twice.entries[0].clone();
    rejected(
        round.client(b).share_keys(&twice.bytes()),
        "NeighbourKeys",
        &[&format!("device {first} appears twice")],
    );
    let mut own = honest.clone();
    let advertisement = &round.sent.advertisements[&b];
    let mut own_entry = b.to_le_bytes().to_vec();
    own_entry.extend_from_slice(&round.keys[&b].public_key());
    own_entry.extend_from_slice(&advertisement[HEADER_BYTES..]);
    own.entries[1] = own_entry;
    rejected(
        round.client(b).share_keys(&own.bytes()),
        "NeighbourKeys",
        &[&format!(
            "device {b} is not device {b}'s neighbour in the committed graph"
        )],
    );

    // IncomingShares with one sender's shares twice.
    round.run_until(Step::Check);
    let honest = incoming_shares(&round.sent.incoming_shares[&b]);
    let first = honest.ids()[0];
    let mut twice = honest.clone();
    twice.entries[1] = twice.entries[0].clone();
    rejected(
        round.client(b).check_shares(&twice.bytes()),
        "IncomingShares",
        &[&format!("device {first}'s shares appear twice")],
    );

    // A ShareReceipt, and Exclusions, that name a device twice.
    round.run_until(Step::DeliverReceipts);
    let twice = wire::id_list_message(round.session, Stage::ShareReceipt, b, [first, first].iter());
    rejected(
        round.server.receive_share_receipt(b, &twice),
        "ShareReceipt",
        &[&format!("device {first} is out of order or repeated")],
    );
    round.run_until(Step::Mask);
    let input = round.random_input();
    let twice = wire::id_list_message(round.session, Stage::Exclusions, b, [first, first].iter());
    rejected(
        round.client(b).masked_input(&twice, &input),
        "Exclusions",
        &[&format!("device {first} is out of order or repeated")],
    );

    // A SurvivorSet that lists a device twice, and one out of order.
    round.run_until(Step::Sign);
    let survivors: Vec<u64> = round.ids();
    let twice = [&survivors[..2], &survivors[1..DEVICES - 1]].concat();
    let key = round.keys[&b].clone();
    let session = round.session;
    rejected(
        round
            .client(b)
            .sign_survivors(&raw_survivor_set(session, b, &twice), &key),
        "SurvivorSet",
        &[&format!(
            "device {} is out of order or repeated; ids must ascend",
            survivors[1]
        )],
    );
    let mut swapped = survivors.clone();
    swapped.swap(0, 1);
    rejected(
        round
            .client(b)
            .sign_survivors(&raw_survivor_set(session, b, &swapped), &key),
        "SurvivorSet",
        &[&format!(
            "device {} is out of order or repeated",
            survivors[0]
        )],
    );

    // An UnmaskRequest that carries one neighbour's signature twice.
    round.run_until(Step::Unmask);
    let signatures = request_signatures(&round.sent.unmask_requests[&b]);
    let mut doubled = signatures.clone();
    doubled[1] = signatures[0];
    let request = server::unmask_request_message(round.session, b, &doubled);
    rejected(
        round.client(b).unmask(&request),
        "UnmaskRequest",
        &[&format!(
            "device {}'s signature appears twice",
            signatures[0].0
        )],
    );

    // The round runs on A's first keys; the second client never joined.
    let all = round.all();
    round.finish_exactly(&all);
}

// ---------------------------------------------------------------------------
// Vectors and messages of the wrong length.

#[test]
fn an_input_vector_of_the_wrong_length_or_width_is_refused_by_the_device() {
    let mut round = Round::new(11);
    round.run_until(Step::Mask);
    let b = round.ids()[7];
    let expects = round.plan.masked_len();
    let incoming = round.sent.incoming_shares[&b].clone();
    for len in [0, expects - 1, expects + 1, 2 * expects] {
        invalid(
            round.client(b).masked_input(&incoming, &vec![0; len]),
            &[&format!(
                "the input vector has {len} values, the round expects {expects}"
            )],
        );
    }
    for (at, value) in [(3, 1u32 << 24), (0, u32::MAX), (expects - 1, 0x8000_0000)] {
        let mut input = round.random_input();
        input[at] = value;
        invalid(
            round.client(b).masked_input(&incoming, &input),
            &[&format!("input element {at} does not fit in 24 bits")],
        );
    }
    let all = round.all();
    round.finish_exactly(&all);
}

#[test]
fn a_masked_input_of_the_wrong_length_is_refused_and_leaves_the_sum_unchanged() {
    // 20-bit elements, 65 of them: 1300 bits, so the last byte has 4 bits
    // of padding.
    let plan20 = plan(20);
    assert_ne!(plan20.masked_len() * 20 % 8, 0);
    let mut round = Round::with(12, plan20.clone(), enrol(&device_ids()), [12; 32]);
    round.run_until(Step::DeliverMaskedInputs);
    let session = round.session;
    let (a, b) = (round.ids()[0], round.ids()[1]);
    let honest = round.sent.masked_inputs[&a].clone();
    let packed = plan20.packed_bytes();
    let len = plan20.masked_len();

    let mut attempts: Vec<(Vec<u8>, String)> = Vec::new();
    attempts.push((
        honest[..honest.len() - 1].to_vec(),
        format!(
            "device {a}'s vector is {} bytes, {len} values at 20 bits take {packed}",
            packed - 1
        ),
    ));
    attempts.push((
        honest[..MASKED_BODY_AT].to_vec(),
        format!("device {a}'s vector is 0 bytes"),
    ));
    let mut longer = honest.clone();
    longer.push(0);
    attempts.push((
        longer,
        format!(
            "the message is {} bytes, the limit is {}",
            honest.len() + 1,
            honest.len()
        ),
    ));
    for declared in [len as u64 - 1, len as u64 + 1, 0, u64::MAX] {
        let mut forged = honest.clone();
        forged[HEADER_BYTES + 1..MASKED_BODY_AT].copy_from_slice(&declared.to_le_bytes());
        attempts.push((
            forged,
            format!("device {a} sent {declared} values at 20 bits; the round expects {len} at 20"),
        ));
    }
    // Values that do not fit in b bits: declared 32-bit, packed 32-bit.
    let mut wide = honest.clone();
    wide[HEADER_BYTES] = 32;
    attempts.push((
        wide,
        format!("device {a} sent {len} values at 32 bits; the round expects {len} at 20"),
    ));
    let mut repacked = honest[..MASKED_BODY_AT].to_vec();
    repacked[HEADER_BYTES] = 32;
    repacked.extend_from_slice(&arith::pack(&vec![0xFFFF_FFFF; len], 32));
    attempts.push((repacked, "the limit is".to_string()));
    // A 21st bit smuggled into the padding.
    let mut dirty = honest.clone();
    *dirty.last_mut().unwrap() |= 0x80;
    attempts.push((
        dirty,
        format!("device {a}: the packed vector's padding bits are not zero"),
    ));

    // A running sum that already holds B's vector.
    let mut sum = vec![0u32; len];
    server::fold_masked_input(&mut sum, &round.sent.masked_inputs[&b], session, b, &plan20)
        .unwrap();
    let before = sum.clone();
    for (forged, says) in &attempts {
        rejected(
            server::fold_masked_input(&mut sum, forged, session, a, &plan20),
            "MaskedInput",
            &[says.as_str()],
        );
        assert_eq!(sum, before, "a refused vector left the sum as it was");
        rejected(
            round.server.receive_masked_input(a, forged),
            "MaskedInput",
            &[says.as_str()],
        );
    }
    invalid(
        server::fold_masked_input(&mut sum[1..], &honest, session, a, &plan20),
        &[&format!("the running sum has {} values", len - 1)],
    );
    // The genuine vector does change it.
    server::fold_masked_input(&mut sum, &honest, session, a, &plan20).unwrap();
    assert_ne!(sum, before);

    // Had any refused vector reached the aggregator's sum, this would fail.
    let all = round.all();
    round.finish_exactly(&all);
}

#[test]
fn truncated_or_overlong_messages_are_refused_at_every_stage() {
    let mut round = Round::new(13);
    let (a, b) = (round.ids()[0], round.ids()[1]);
    let ends_early = |bytes: &[u8]| format!("it ends early, at byte {}", bytes.len());

    round.run_until(Step::DeliverAdvertisements);
    let advertisement = round.sent.advertisements[&a].clone();
    let short = &advertisement[..advertisement.len() - 1];
    rejected(
        round.server.receive_advertisement(a, short),
        "AdvertiseKeys",
        &[&ends_early(short)],
    );
    rejected(
        round
            .server
            .receive_advertisement(a, &advertisement[..HEADER_BYTES - 1]),
        "AdvertiseKeys",
        &["it is not a Canopy secure-aggregation message"],
    );

    round.run_until(Step::Share);
    let keys = round.sent.neighbour_keys[&b].clone();
    let short = &keys[..keys.len() - 10];
    rejected(
        round.client(b).share_keys(short),
        "NeighbourKeys",
        &[&ends_early(short)],
    );
    // A count above the degree is refused before anything is read.
    let mut inflated = keys.clone();
    let degree = round.plan.degree;
    let head = neighbour_keys_head(&keys);
    inflated[head..head + 4].copy_from_slice(&(degree as u32 + 1).to_le_bytes());
    rejected(
        round.client(b).share_keys(&inflated),
        "NeighbourKeys",
        &[&format!(
            "it lists {} neighbours, the limit is {degree}",
            degree + 1
        )],
    );

    round.run_until(Step::DeliverShares);
    let mut trailing = round.sent.share_keys[&a].clone();
    trailing.extend_from_slice(&[0; 3]);
    rejected(
        round.server.receive_shares(a, &trailing),
        "ShareKeys",
        &["3 unexpected bytes follow its body"],
    );

    round.run_until(Step::Check);
    let incoming = round.sent.incoming_shares[&b].clone();
    let short = &incoming[..incoming.len() - SHARE_ENTRY / 2];
    rejected(
        round.client(b).check_shares(short),
        "IncomingShares",
        &[&ends_early(short)],
    );

    // A receipt that reports more than k − t neighbours: its sender could
    // not go on, and it would exclude too many.
    round.run_until(Step::DeliverReceipts);
    let limit = round.plan.degree - round.plan.threshold;
    let too_many: Vec<u64> = round.neighbours(a)[..limit + 1].to_vec();
    let receipt = wire::id_list_message(round.session, Stage::ShareReceipt, a, too_many.iter());
    rejected(
        round.server.receive_share_receipt(a, &receipt),
        "ShareReceipt",
        &[&format!(
            "it lists {} neighbours whose shares would not open, the limit is {limit}",
            limit + 1
        )],
    );

    round.run_until(Step::Mask);
    let input = round.random_input();
    let exclusions = round.sent.exclusions[&b].clone();
    let short = &exclusions[..exclusions.len() - 1];
    rejected(
        round.client(b).masked_input(short, &input),
        "Exclusions",
        &[&ends_early(short)],
    );

    round.run_until(Step::Unmask);
    let request = round.sent.unmask_requests[&b].clone();
    let short = &request[..request.len() - 4];
    rejected(
        round.client(b).unmask(short),
        "UnmaskRequest",
        &[&ends_early(short)],
    );

    round.run_until(Step::DeliverResponses);
    let mut trailing = round.sent.unmask_responses[&b].clone();
    trailing.push(1);
    rejected(
        round.server.receive_unmask_response(b, &trailing),
        "UnmaskResponse",
        &["1 unexpected bytes follow its body"],
    );

    let all = round.all();
    round.finish_exactly(&all);
}

// ---------------------------------------------------------------------------
// Fewer aborts: a device whose shares do not open is excluded, not fatal.

/// Every ciphertext of a ShareKeys message with one bit flipped: what the
/// server cannot tell from an honest upload.
fn garbled(share_keys_message: &[u8]) -> Vec<u8> {
    let mut list = share_keys(share_keys_message);
    for entry in &mut list.entries {
        entry[8 + 3] ^= 0x80;
    }
    list.bytes()
}

#[test]
fn one_device_that_seals_garbage_shares_costs_the_round_only_itself() {
    let mut round = Round::new(50);
    let g = round.ids()[2];
    round.run_until(Step::DeliverShares);
    let garbage = garbled(&round.sent.share_keys[&g]);
    round.sent.share_keys.insert(g, garbage);
    round.run_until(Step::DeliverReceipts);

    // Every neighbour of G reports G, and only G; G itself reports nobody.
    let neighbours = round.neighbours(g);
    assert!(neighbours.len() >= round.plan.threshold);
    for (&id, receipt) in &round.sent.share_receipts {
        let expected = if neighbours.contains(&id) {
            vec![g]
        } else {
            vec![]
        };
        assert_eq!(reported(receipt), expected, "device {id}'s receipt");
    }
    round.run_until(Step::Mask);
    assert_eq!(round.server.excluded(), &BTreeSet::from([g]));
    assert!(
        !round.sent.exclusions.contains_key(&g),
        "an excluded device is sent no Exclusions"
    );
    // G's neighbours were told, and none of them masks with G.
    for n in &neighbours {
        let told = wire::read_id_list(
            &round.sent.exclusions[n],
            round.session,
            Stage::Exclusions,
            *n,
            round.plan.degree,
            "excluded",
        )
        .unwrap();
        assert_eq!(told, vec![g], "device {n}'s Exclusions");
    }

    // G masks anyway, with Exclusions it made itself: the server refuses it.
    let forged = wire::id_list_message(round.session, Stage::Exclusions, g, [].iter());
    let input = round.random_input();
    let masked = round.client(g).masked_input(&forged, &input).unwrap();
    round.run_until(Step::DeliverMaskedInputs);
    rejected(
        round.server.receive_masked_input(g, &masked),
        "MaskedInput",
        &[&format!("device {g} was excluded from the round")],
    );

    // The round loses G alone: the other nine devices' sum is exact.
    let mut survivors = round.all();
    survivors.remove(&g);
    round.finish_exactly(&survivors);
}

#[test]
fn a_device_keeps_its_shares_to_itself_when_the_server_breaks_too_many_or_hides_a_report() {
    // The server corrupts all but t - 1 of B's incoming shares: B cannot
    // mask with t neighbours, so it refuses to go on and sends nothing.
    let mut round = Round::new(51);
    round.run_until(Step::Check);
    let b = round.ids()[1];
    let mut corrupted = incoming_shares(&round.sent.incoming_shares[&b]);
    let t = round.plan.threshold;
    let senders = corrupted.ids();
    for &id in &senders[t - 1..] {
        corrupted.entry_mut(id)[8] ^= 1;
    }
    unrecoverable(
        round.client(b).check_shares(&corrupted.bytes()),
        &[&format!(
            "only {} of device {b}'s neighbours shared keys that it could open ({} would not open)",
            t - 1,
            senders.len() + 1 - t
        )],
    );

    // One corrupted share: B reports its sender A. Exclusions that keep A
    // in the round, or that name a device that is not B's neighbour, are
    // refused; so is a survivor set that lists A after it was excluded.
    let a = senders[0];
    let mut one = incoming_shares(&round.sent.incoming_shares[&b]);
    one.entry_mut(a)[8] ^= 1;
    assert_eq!(round.check_with(b, &one.bytes()), vec![a]);
    round.run_until(Step::Mask);
    let session = round.session;
    let exclusions = |ids: &[u64]| wire::id_list_message(session, Stage::Exclusions, b, ids.iter());
    let input = round.random_input();
    rejected(
        round.client(b).masked_input(&exclusions(&[]), &input),
        "Exclusions",
        &[&format!(
            "it keeps device {a} in the round, though device {b} reported that device's shares \
             unreadable"
        )],
    );
    let stranger = round.stranger_to(b);
    let mut both = vec![a, stranger];
    both.sort();
    rejected(
        round.client(b).masked_input(&exclusions(&both), &input),
        "Exclusions",
        &[&format!(
            "it excludes device {stranger}, which is not one of device {b}'s neighbours"
        )],
    );
    round.run_until(Step::Sign);
    let with_a = raw_survivor_set(session, b, &round.ids());
    let key = round.keys[&b].clone();
    rejected(
        round.client(b).sign_survivors(&with_a, &key),
        "SurvivorSet",
        &[&format!(
            "it lists device {a}, which the server excluded from the round"
        )],
    );
    let mut survivors = round.all();
    survivors.remove(&a);
    round.finish_exactly(&survivors);
}
