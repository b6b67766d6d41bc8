//! Acceptance 1: for random n, k and dropout patterns at every stage, the
//! unmasked aggregate equals exactly the sum of the surviving devices'
//! quantized inputs. Runs the protocol crate alone, with no server.

use std::collections::{BTreeMap, BTreeSet};

use canopy_protocol::auth::DeviceKey;
use canopy_protocol::device_cert::KeyTrust;
use canopy_protocol::secagg::params::Plan;
use canopy_protocol::secagg::wire::SHARE_CIPHERTEXT_BYTES;
use canopy_protocol::secagg::{Aggregator, Client, SecAggConfig, SecAggError, Session, arith};
use proptest::prelude::*;
use rand::{Rng, SeedableRng};

#[path = "support/honest.rs"]
mod honest;
use honest::HonestRound;

/// Which devices go silent before each of the six stages, and which seal
/// garbage for their neighbours in ShareKeys (they are excluded, as if they
/// had dropped out). One silent before ConsistencyCheck has its masked
/// input in the sum all the same.
#[derive(Clone, Debug, Default)]
struct Dropouts {
    before_advertise: BTreeSet<u64>,
    before_share: BTreeSet<u64>,
    garbage_shares: BTreeSet<u64>,
    before_check: BTreeSet<u64>,
    before_masked_input: BTreeSet<u64>,
    before_sign: BTreeSet<u64>,
    before_unmask: BTreeSet<u64>,
}

struct Outcome {
    sum: Vec<u32>,
    survivors: BTreeSet<u64>,
    inputs: BTreeMap<u64, Vec<u32>>,
}

fn run_round(
    plan: &Plan,
    ids: &[u64],
    dropouts: &Dropouts,
    seed: u64,
) -> Result<Outcome, SecAggError> {
    let session = Session {
        job_id: 3,
        round_id: 77,
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let keys: BTreeMap<u64, DeviceKey> =
        ids.iter().map(|&id| (id, DeviceKey::generate())).collect();
    let public: Vec<(u64, [u8; 32])> = keys.iter().map(|(&id, k)| (id, k.public_key())).collect();
    let graph_seed: [u8; 32] = rng.random();
    let plan = &plan.clone().commit_graph(&graph_seed);
    let mut server = Aggregator::new(session, plan.clone(), &graph_seed, &public)?;
    let mut clients = BTreeMap::new();
    for &id in ids {
        if dropouts.before_advertise.contains(&id) {
            continue;
        }
        let (client, advertisement) =
            Client::start(session, id, plan.clone(), &keys[&id], KeyTrust::Server)?;
        server.receive_advertisement(id, &advertisement)?;
        clients.insert(id, client);
    }
    for (id, neighbour_keys) in server.close_advertising()? {
        if dropouts.before_share.contains(&id) {
            continue;
        }
        let mut shares = clients.get_mut(&id).unwrap().share_keys(&neighbour_keys)?;
        if dropouts.garbage_shares.contains(&id) {
            shares = garble_ciphertexts(&shares);
        }
        server.receive_shares(id, &shares)?;
    }
    for (id, incoming) in server.close_sharing()? {
        if dropouts.before_check.contains(&id) {
            continue;
        }
        let receipt = clients.get_mut(&id).unwrap().check_shares(&incoming)?;
        server.receive_share_receipt(id, &receipt)?;
    }
    let mut inputs = BTreeMap::new();
    let mask = plan.modulus_mask();
    for (id, incoming) in server.close_checking()? {
        if dropouts.before_masked_input.contains(&id) {
            continue;
        }
        let input: Vec<u32> = (0..plan.masked_len())
            .map(|_| rng.random::<u32>() & mask)
            .collect();
        let masked = clients
            .get_mut(&id)
            .unwrap()
            .masked_input(&incoming, &input)?;
        server.receive_masked_input(id, &masked)?;
        inputs.insert(id, input);
    }
    for (id, survivor_set) in server.close_collection()? {
        if dropouts.before_sign.contains(&id) {
            continue;
        }
        let signature = clients
            .get_mut(&id)
            .unwrap()
            .sign_survivors(&survivor_set, &keys[&id])?;
        server.receive_survivor_signature(id, &signature)?;
    }
    for (id, request) in server.close_consistency()? {
        if dropouts.before_sign.contains(&id) || dropouts.before_unmask.contains(&id) {
            continue;
        }
        let response = clients.get_mut(&id).unwrap().unmask(&request)?;
        server.receive_unmask_response(id, &response)?;
    }
    let (sum, survivors) = server.finish()?;
    Ok(Outcome {
        sum,
        survivors,
        inputs,
    })
}

/// A ShareKeys message with one bit of every ciphertext flipped: what the
/// server cannot tell from a good one.
fn garble_ciphertexts(shares: &[u8]) -> Vec<u8> {
    const HEADER_AND_COMMITMENT: usize = 30 + 32;
    const ENTRY: usize = 8 + SHARE_CIPHERTEXT_BYTES;
    let mut out = shares.to_vec();
    let count = u32::from_le_bytes(out[HEADER_AND_COMMITMENT..][..4].try_into().unwrap());
    for i in 0..count as usize {
        out[HEADER_AND_COMMITMENT + 4 + i * ENTRY + 8 + 5] ^= 1;
    }
    out
}

fn expected_sum(outcome: &Outcome, plan: &Plan) -> Vec<u32> {
    let mut expected = vec![0u32; plan.masked_len()];
    for id in &outcome.survivors {
        for (e, v) in expected.iter_mut().zip(&outcome.inputs[id]) {
            *e = e.wrapping_add(*v);
        }
    }
    expected.iter().map(|v| v & plan.modulus_mask()).collect()
}

/// Spreads up to `budget` dropouts over the six stages and garbage shares
/// at random.
fn dropout_pattern(ids: &[u64], budget: usize, seed: u64) -> Dropouts {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut pool: Vec<u64> = ids.to_vec();
    let mut dropouts = Dropouts::default();
    let count = rng.random_range(0..=budget);
    for _ in 0..count {
        let id = pool.swap_remove(rng.random_range(0..pool.len()));
        match rng.random_range(0..7) {
            0 => dropouts.before_advertise.insert(id),
            1 => dropouts.before_share.insert(id),
            2 => dropouts.garbage_shares.insert(id),
            3 => dropouts.before_check.insert(id),
            4 => dropouts.before_masked_input.insert(id),
            5 => dropouts.before_sign.insert(id),
            _ => dropouts.before_unmask.insert(id),
        };
    }
    dropouts
}

fn plan_for(n: usize, dropout: f64, bits: u32, len: usize) -> Plan {
    let config = SecAggConfig {
        enabled: true,
        max_dropout_fraction: dropout,
        bits,
        max_weight: 1,
        ..SecAggConfig::default()
    };
    config.plan(n, len).expect("a feasible plan")
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn the_unmasked_sum_is_exactly_the_survivors_sum(
        n in 3usize..40,
        dropout in prop_oneof![Just(0.0), Just(0.1), Just(0.2), Just(0.3)],
        bits in prop_oneof![Just(16u32), Just(20), Just(32)],
        len in 1usize..200,
        seed in any::<u64>(),
    ) {
        let config_ok = SecAggConfig { enabled: true, max_dropout_fraction: dropout, bits, max_weight: 1, ..SecAggConfig::default() }
            .plan(n, len);
        prop_assume!(config_ok.is_ok());
        let plan = plan_for(n, dropout, bits, len);
        // Ids need not be dense or ordered.
        let ids: Vec<u64> = (0..n as u64).map(|i| 1 + i * 7919 % 100_003).collect();
        let dropouts = dropout_pattern(&ids, plan.max_dropouts, seed);
        let outcome = run_round(&plan, &ids, &dropouts, seed).expect("a round within tolerance completes");
        let dropped: usize = [
            &dropouts.before_advertise,
            &dropouts.before_share,
            &dropouts.garbage_shares,
            &dropouts.before_check,
            &dropouts.before_masked_input,
        ]
            .iter().map(|s| s.len()).sum();
        prop_assert_eq!(outcome.survivors.len(), n - dropped);
        let expected = expected_sum(&outcome, &plan);
        prop_assert_eq!(outcome.sum, expected);
    }
}

#[test]
fn graphs_sparser_than_complete_are_exercised() {
    // 60 devices with 10% dropouts: k < n − 1, so the sparse Harary graph,
    // not the complete one, carries the round.
    let plan = plan_for(60, 0.1, 24, 50);
    assert!(plan.degree < 59, "degree {}", plan.degree);
    let ids: Vec<u64> = (1..=60).collect();
    for seed in 0..4 {
        let dropouts = dropout_pattern(&ids, plan.max_dropouts, seed);
        let outcome = run_round(&plan, &ids, &dropouts, seed).unwrap();
        assert_eq!(outcome.sum, expected_sum(&outcome, &plan));
    }
}

#[test]
fn past_the_tolerance_the_round_fails_with_a_reason() {
    let plan = plan_for(20, 0.1, 24, 10);
    let ids: Vec<u64> = (1..=20).collect();
    let dropouts = Dropouts {
        before_masked_input: ids[..plan.max_dropouts + 1].iter().copied().collect(),
        ..Dropouts::default()
    };
    let Err(error) = run_round(&plan, &ids, &dropouts, 1) else {
        panic!("a round past its dropout tolerance must fail");
    };
    let message = error.to_string();
    assert!(
        message.contains("dropped out by the end of MaskedInput"),
        "{message}"
    );
    assert!(
        message.contains(&format!("tolerates {}", plan.max_dropouts)),
        "{message}"
    );
}

#[test]
fn quantized_updates_average_back_to_the_float_mean() {
    let config = SecAggConfig {
        enabled: true,
        ..SecAggConfig::default()
    };
    let n = 12;
    // Long enough for the device's windows over two or more cores, each
    // quantizing with its own coins: some chunks start past the first.
    let len = 2 * 65_536 + 1_001;
    let plan = config.plan(n, len).unwrap().commit_graph(&[5; 32]);
    let session = Session {
        job_id: 1,
        round_id: 1,
    };
    let mut rng = rand::rngs::StdRng::seed_from_u64(9);
    let updates: Vec<(Vec<f32>, u64)> = (0..n)
        .map(|_| {
            (
                (0..len).map(|_| rng.random_range(-0.5f32..0.5)).collect(),
                rng.random_range(10..300),
            )
        })
        .collect();
    let (mut round, exclusions) = HonestRound::start(session, &plan, &[5; 32], n);
    for (id, message) in exclusions {
        let (delta, samples) = &updates[id as usize - 1];
        if id == 1 {
            // Rounded for another plan, the update is refused, and the
            // device can still send the right one.
            let other = Plan {
                levels: plan.levels - 1,
                ..plan.clone()
            };
            let wrong = arith::Quantizer::new(&other, delta, *samples).unwrap();
            let error = round.clients[0]
                .masked_update(&message, &wrong, &mut rng)
                .unwrap_err();
            assert!(
                error.to_string().contains("another round's plan"),
                "{error}"
            );
        }
        let update = arith::Quantizer::new(&plan, delta, *samples).unwrap();
        let reply = round.clients[id as usize - 1]
            .masked_update(&message, &update, &mut rng)
            .unwrap();
        round.server.receive_masked_input(id, &reply).unwrap();
    }
    let (sum, _) = round.finish();
    let (weighted, weight) = arith::decode_sum(&plan, &sum).unwrap();
    let expected_weight: u64 = updates.iter().map(|(_, w)| *w).sum();
    assert_eq!(weight, expected_weight);
    for i in 0..len {
        let exact: f64 = updates
            .iter()
            .map(|(d, w)| f64::from(d[i]) * *w as f64)
            .sum::<f64>()
            / expected_weight as f64;
        let got = weighted[i] / weight as f64;
        // One fixed-point step per device at most, averaged.
        assert!(
            (got - exact).abs() <= plan.clip / plan.levels as f64,
            "{i}: {got} vs {exact}"
        );
    }
}
