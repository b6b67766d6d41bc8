//! A secure round of many devices in one process, at the default
//! settings, checked for an exact sum: shared by the `secagg_scale` bench
//! (which prints its figures) and test (which runs it in CI).
//!
//! The devices run on every core between the server's calls; the server's
//! calls run on the calling thread alone and are timed per stage.
//! Dropouts are spread evenly over the five stages.

use std::collections::BTreeMap;
use std::thread;
use std::time::{Duration, Instant};

use canopy_protocol::auth::DeviceKey;
use canopy_protocol::device_cert::KeyTrust;
use canopy_protocol::secagg::{Aggregator, Client, Plan, SecAggConfig, Session};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const SESSION: Session = Session {
    job_id: 9,
    round_id: 1,
};

/// The server's side of one stage, fed each device's message.
type Receive<'a> = dyn FnMut(u64, &[u8]) -> Result<(), String> + 'a;

/// What one simulated round did and cost.
pub struct Report {
    pub plan: Plan,
    pub dropouts: usize,
    pub survivors: usize,
    /// The server's time per stage, single-threaded.
    pub server: Vec<(&'static str, Duration)>,
    /// Wall time of all devices' work, on every core.
    pub devices: Duration,
    pub whole: Duration,
    /// The most round state the aggregator held ([`Aggregator::held_bytes`]).
    pub held_bytes: usize,
}

pub fn threads() -> usize {
    thread::available_parallelism().map_or(1, |n| n.get())
}

/// Runs `work` on each live device's slot, in parallel.
fn on_devices<T: Send>(slots: &mut [(u64, Option<T>)], work: impl Fn(u64, &mut T) + Sync) {
    let chunk = slots.len().div_ceil(threads()).max(1);
    thread::scope(|scope| {
        for part in slots.chunks_mut(chunk) {
            let work = &work;
            scope.spawn(move || {
                for (id, slot) in part.iter_mut() {
                    if let Some(state) = slot {
                        work(*id, state);
                    }
                }
            });
        }
    });
}

/// Device state through the round.
struct Device {
    client: Client,
    outbox: Option<Vec<u8>>,
    inbox: Option<Vec<u8>>,
    input: Vec<u32>,
}

pub fn simulate(n: usize, params: usize, dropout: f64) -> Result<Report, String> {
    let config = SecAggConfig {
        enabled: true,
        ..SecAggConfig::default()
    };
    let plan = config.plan(n, params).map_err(|e| e.to_string())?;
    let keys: Vec<(u64, DeviceKey)> = (1..=n as u64)
        .map(|id| (id, DeviceKey::generate()))
        .collect();
    let public: Vec<(u64, [u8; 32])> = keys.iter().map(|(id, k)| (*id, k.public_key())).collect();
    let mut rng = SmallRng::seed_from_u64(n as u64);
    // Which stage each dropout goes silent before: 0..5, evenly.
    let dropouts = (dropout * n as f64).floor() as usize;
    let mut silent_before: BTreeMap<u64, usize> = BTreeMap::new();
    while silent_before.len() < dropouts {
        let stage = silent_before.len() % 5;
        silent_before
            .entry(rng.random_range(1..=n as u64))
            .or_insert(stage);
    }
    let goes_silent = |id: u64, stage: usize| silent_before.get(&id) == Some(&stage);

    let mut timings: Vec<(&str, Duration)> = Vec::new();
    let devices_start = Instant::now();
    let mut device_time = Duration::ZERO;

    let start = Instant::now();
    let graph_seed: [u8; 32] = rng.random();
    let plan = plan.commit_graph(&graph_seed);
    let mut server =
        Aggregator::new(SESSION, plan.clone(), &graph_seed, &public).map_err(|e| e.to_string())?;
    timings.push(("set up (graph)", start.elapsed()));

    // AdvertiseKeys.
    let begun = Instant::now();
    let mut devices: Vec<(u64, Option<Device>)> = thread::scope(|scope| {
        let chunk = keys.len().div_ceil(threads());
        let parts: Vec<_> = keys
            .chunks(chunk)
            .map(|part| {
                let plan = &plan;
                scope.spawn(move || {
                    part.iter()
                        .map(|(id, key)| {
                            let (client, message) =
                                Client::start(SESSION, *id, plan.clone(), key, KeyTrust::Server)
                                    .expect("Client::start");
                            let device = Device {
                                client,
                                outbox: Some(message),
                                inbox: None,
                                input: Vec::new(),
                            };
                            (*id, Some(device))
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        parts
            .into_iter()
            .flat_map(|part| part.join().expect("a device thread"))
            .collect()
    });
    device_time += begun.elapsed();
    let deliver = |devices: &mut Vec<(u64, Option<Device>)>,
                   stage: usize,
                   receive: &mut Receive<'_>|
     -> Result<(), String> {
        for (id, slot) in devices.iter_mut() {
            if goes_silent(*id, stage) {
                *slot = None;
            }
            if let Some(device) = slot {
                if let Some(message) = device.outbox.take() {
                    receive(*id, &message)?;
                }
            }
        }
        Ok(())
    };
    let start = Instant::now();
    deliver(&mut devices, 0, &mut |id, m| {
        server
            .receive_advertisement(id, m)
            .map_err(|e| e.to_string())
    })?;
    let replies = server.close_advertising().map_err(|e| e.to_string())?;
    timings.push(("AdvertiseKeys", start.elapsed()));
    hand_out(&mut devices, replies);

    // ShareKeys.
    let begun = Instant::now();
    on_devices(&mut devices, |_, device| {
        let inbox = device.inbox.take().expect("NeighbourKeys");
        device.outbox = Some(device.client.share_keys(&inbox).expect("share_keys"));
    });
    device_time += begun.elapsed();
    let start = Instant::now();
    deliver(&mut devices, 1, &mut |id, m| {
        server.receive_shares(id, m).map_err(|e| e.to_string())
    })?;
    let replies = server.close_sharing().map_err(|e| e.to_string())?;
    timings.push(("ShareKeys", start.elapsed()));
    hand_out(&mut devices, replies);

    // ShareCheck (nobody goes silent here: those that do before masking
    // are the same to the round).
    let begun = Instant::now();
    on_devices(&mut devices, |_, device| {
        let inbox = device.inbox.take().expect("IncomingShares");
        device.outbox = Some(device.client.check_shares(&inbox).expect("check_shares"));
    });
    device_time += begun.elapsed();
    let start = Instant::now();
    deliver(&mut devices, usize::MAX, &mut |id, m| {
        server
            .receive_share_receipt(id, m)
            .map_err(|e| e.to_string())
    })?;
    let replies = server.close_checking().map_err(|e| e.to_string())?;
    timings.push(("ShareCheck", start.elapsed()));
    hand_out(&mut devices, replies);

    // MaskedInputCollection.
    let begun = Instant::now();
    let modulus = plan.modulus_mask();
    let len = plan.masked_len();
    on_devices(&mut devices, |id, device| {
        let mut rng = SmallRng::seed_from_u64(id);
        device.input = (0..len).map(|_| rng.random::<u32>() & modulus).collect();
        let inbox = device.inbox.take().expect("Exclusions");
        device.outbox = Some(
            device
                .client
                .masked_input(&inbox, &device.input)
                .expect("masked_input"),
        );
    });
    device_time += begun.elapsed();
    let start = Instant::now();
    let mut expected = vec![0u32; len];
    deliver(&mut devices, 2, &mut |id, m| {
        server
            .receive_masked_input(id, m)
            .map_err(|e| e.to_string())
    })?;
    let folded = start.elapsed();
    for (_, device) in devices.iter().filter_map(|(id, d)| Some((id, d.as_ref()?))) {
        for (e, v) in expected.iter_mut().zip(&device.input) {
            *e = e.wrapping_add(*v);
        }
    }
    let start = Instant::now();
    let replies = server.close_collection().map_err(|e| e.to_string())?;
    timings.push(("MaskedInputCollection", folded + start.elapsed()));
    let held_bytes = server.held_bytes();
    hand_out(&mut devices, replies);

    // ConsistencyCheck.
    let begun = Instant::now();
    on_devices(&mut devices, |id, device| {
        let inbox = device.inbox.take().expect("SurvivorSet");
        let key = &keys[id as usize - 1].1;
        let signature = device.client.sign_survivors(&inbox, key);
        device.outbox = Some(signature.expect("sign_survivors"));
    });
    device_time += begun.elapsed();
    let start = Instant::now();
    deliver(&mut devices, 3, &mut |id, m| {
        server
            .receive_survivor_signature(id, m)
            .map_err(|e| e.to_string())
    })?;
    let replies = server.close_consistency().map_err(|e| e.to_string())?;
    timings.push(("ConsistencyCheck", start.elapsed()));
    let held_bytes = held_bytes.max(server.held_bytes());
    hand_out(&mut devices, replies);

    // Unmasking.
    let begun = Instant::now();
    on_devices(&mut devices, |_, device| {
        let inbox = device.inbox.take().expect("UnmaskRequest");
        device.outbox = Some(device.client.unmask(&inbox).expect("unmask"));
    });
    device_time += begun.elapsed();
    let start = Instant::now();
    deliver(&mut devices, 4, &mut |id, m| {
        server
            .receive_unmask_response(id, m)
            .map_err(|e| e.to_string())
    })?;
    let held_bytes = held_bytes.max(server.held_bytes());
    let (sum, survivors) = server.finish().map_err(|e| e.to_string())?;
    timings.push(("Unmasking (rebuild, remove masks)", start.elapsed()));
    let total = devices_start.elapsed();

    expected.iter_mut().for_each(|v| *v &= modulus);
    if sum != expected {
        return Err(format!(
            "the unmasked sum differs from the survivors' sum at {} of {} elements",
            sum.iter().zip(&expected).filter(|(a, b)| a != b).count(),
            len
        ));
    }
    Ok(Report {
        plan,
        dropouts,
        survivors: survivors.len(),
        server: timings,
        devices: device_time,
        whole: total,
        held_bytes,
    })
}

fn hand_out(devices: &mut [(u64, Option<Device>)], mut replies: BTreeMap<u64, Vec<u8>>) {
    for (id, slot) in devices.iter_mut() {
        match replies.remove(id) {
            Some(reply) => {
                if let Some(device) = slot {
                    device.inbox = Some(reply);
                }
            }
            // Dropped by the server: no message for it.
            None => *slot = None,
        }
    }
}
