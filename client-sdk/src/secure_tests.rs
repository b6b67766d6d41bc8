//! The secure round's HTTP side: a whole round against an in-memory
//! aggregator behind a loopback server, and the waits, limits and error
//! mappings against scripted answers. The real server's endpoints are
//! exercised in `server/tests`.

use std::collections::{BTreeMap, BTreeSet};
use std::net::TcpListener;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use canopy_protocol::auth::{DeviceKey, HEADER_DEVICE};
use canopy_protocol::messages::{SecureTask, TrainingConfig};
use canopy_protocol::secagg::{Aggregator, SecAggConfig};
use canopy_protocol::update::{TensorSpec, UpdateLayout};

use super::*;
use crate::Trust;
use crate::client::tests::{Scripted, Seen, Step, fast, read_request, respond, runtime, scripted};
use crate::retry::RetryPolicy;
use crate::transport::REQUEST_TIMEOUT_MS;

const ROUND_ID: i64 = 7;
const JOB_ID: i64 = 3;
const STAGE_TIMEOUT_MS: u64 = 5_000;

fn plan(update_len: usize) -> Plan {
    SecAggConfig {
        enabled: true,
        max_weight: 100,
        ..SecAggConfig::default()
    }
    .plan(3, update_len)
    .expect("plan")
    .commit_graph(&GRAPH_SEED)
}

const GRAPH_SEED: [u8; 32] = [9; 32];

fn secure_task(update_len: usize, deadline_unix_ms: u64) -> Task {
    Task {
        kind: canopy_protocol::messages::TaskKind::Train,
        dataset: None,
        job_id: JOB_ID,
        round_id: ROUND_ID,
        round_number: 1,
        model_version_id: 1,
        model_digest: String::new(),
        model_size_bytes: 0,
        model_path: "/device/v1/models/1".to_string(),
        upload_path: "/device/v1/rounds/7/update".to_string(),
        upload_size_bytes: 0,
        deadline_unix_ms,
        training: TrainingConfig {
            epochs: 1,
            batch_size: 1,
            learning_rate: 0.1,
        },
        layout: UpdateLayout::new(vec![TensorSpec {
            name: "w".to_string(),
            shape: vec![update_len],
        }])
        .expect("layout"),
        secure_aggregation: Some(SecureTask {
            plan: plan(update_len),
            path: "/device/v1/rounds/7/secagg/".to_string(),
            stage_timeout_ms: STAGE_TIMEOUT_MS,
        }),
        policy: Default::default(),
        sub_round: None,
        privacy: None,
        compression: None,
    }
}

fn client(base: &str, device_id: i64, key: DeviceKey, policy: RetryPolicy) -> DeviceClient {
    let transport =
        crate::Transport::new(base, &Trust::PinnedSha256("ab".repeat(32))).expect("transport");
    let server_key = DeviceKey::generate().public_key_hex();
    DeviceClient::new(transport, device_id, key, &server_key)
        .expect("client")
        .with_retry_policy(policy)
}

fn in_an_hour() -> u64 {
    now_ms() + 3_600_000
}

/// The server's side of one round, as the protocol crate's reference
/// aggregator runs it: a stage closes once all three devices answered.
struct FakeRound {
    aggregator: Option<Aggregator>,
    devices: usize,
    answered: BTreeSet<u64>,
    /// The server's messages, by stage and recipient, once ready.
    ready: BTreeMap<(u8, u64), Vec<u8>>,
    sum: Option<(Vec<u32>, BTreeSet<u64>)>,
    content_types: BTreeSet<String>,
    polls_with_wait: usize,
}

impl FakeRound {
    fn post(&mut self, stage: Stage, device: u64, body: &[u8]) -> Result<(), String> {
        let aggregator = self.aggregator.as_mut().ok_or("the round is over")?;
        let taken = match stage {
            Stage::AdvertiseKeys => aggregator.receive_advertisement(device, body),
            Stage::ShareKeys => aggregator.receive_shares(device, body),
            Stage::ShareReceipt => aggregator.receive_share_receipt(device, body),
            Stage::MaskedInput => aggregator.receive_masked_input(device, body),
            Stage::SurvivorSignature => aggregator.receive_survivor_signature(device, body),
            Stage::UnmaskResponse => aggregator.receive_unmask_response(device, body),
            _ => return Err("not a device stage".to_string()),
        };
        taken.map_err(|error| error.to_string())?;
        self.answered.insert(device);
        if self.answered.len() < self.devices {
            return Ok(());
        }
        self.answered.clear();
        let (next, messages) = match stage {
            Stage::AdvertiseKeys => (Stage::NeighbourKeys, aggregator.close_advertising()),
            Stage::ShareKeys => (Stage::IncomingShares, aggregator.close_sharing()),
            Stage::ShareReceipt => (Stage::Exclusions, aggregator.close_checking()),
            Stage::MaskedInput => (Stage::SurvivorSet, aggregator.close_collection()),
            Stage::SurvivorSignature => (Stage::UnmaskRequest, aggregator.close_consistency()),
            _ => {
                let aggregator = self.aggregator.take().ok_or("the round is over")?;
                self.sum = Some(aggregator.finish().map_err(|error| error.to_string())?);
                return Ok(());
            }
        };
        for (id, message) in messages.map_err(|error| error.to_string())? {
            self.ready.insert((next as u8, id), message);
        }
        Ok(())
    }
}

fn stage_of(endpoint: &str) -> Option<Stage> {
    [
        Stage::AdvertiseKeys,
        Stage::NeighbourKeys,
        Stage::ShareKeys,
        Stage::IncomingShares,
        Stage::ShareReceipt,
        Stage::Exclusions,
        Stage::MaskedInput,
        Stage::SurvivorSet,
        Stage::SurvivorSignature,
        Stage::UnmaskRequest,
        Stage::UnmaskResponse,
    ]
    .into_iter()
    .find(|&stage| super::endpoint(stage) == endpoint)
}

/// A loopback server, one thread per connection, so that long polls of
/// several devices wait side by side.
fn serve_round(round: Arc<Mutex<FakeRound>>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("address"));
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            let round = round.clone();
            std::thread::spawn(move || {
                use std::io::Write;
                let Some(seen) = read_request(&mut stream) else {
                    return;
                };
                let reply = answer_round(&round, &seen);
                let _ = stream.write_all(&reply);
                let _ = stream.flush();
            });
        }
    });
    base
}

fn answer_round(round: &Mutex<FakeRound>, seen: &Seen) -> Vec<u8> {
    let refuse = |status: u16, message: String| {
        let body = format!(r#"{{"error":{{"code":"refused","message":{message:?}}}}}"#);
        respond(status, &[], body.as_bytes())
    };
    let (path, query) = seen.path.split_once('?').unwrap_or((&seen.path, ""));
    let Some(endpoint) = path.strip_prefix("/device/v1/rounds/7/secagg/") else {
        return refuse(404, format!("no route {path}"));
    };
    let Some(stage) = stage_of(endpoint) else {
        return refuse(404, format!("no stage {endpoint}"));
    };
    let Some(device) = seen
        .header(HEADER_DEVICE)
        .and_then(|id| id.parse::<u64>().ok())
    else {
        return refuse(401, "unsigned".to_string());
    };
    if seen.method == "POST" {
        let mut round = round.lock().expect("round");
        if let Some(content_type) = seen.header("content-type") {
            round.content_types.insert(content_type.to_string());
        }
        return match round.post(stage, device, &seen.body) {
            Ok(()) => respond(204, &[], b""),
            Err(message) => refuse(422, message),
        };
    }
    let wait_ms: u64 = query
        .strip_prefix("wait_ms=")
        .and_then(|ms| ms.parse().ok())
        .unwrap_or(0);
    round.lock().expect("round").polls_with_wait += usize::from(query.starts_with("wait_ms="));
    let until = std::time::Instant::now() + Duration::from_millis(wait_ms);
    loop {
        if let Some(message) = round
            .lock()
            .expect("round")
            .ready
            .get(&(stage as u8, device))
        {
            return respond(200, &[], message);
        }
        if std::time::Instant::now() >= until {
            return respond(202, &[], b"");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A round of three devices against a fresh [`FakeRound`].
struct RoundFixture {
    base: String,
    round: Arc<Mutex<FakeRound>>,
    /// (device id, key) of the three participants.
    devices: Vec<(i64, DeviceKey)>,
    task: Task,
    plan: Plan,
}

fn round_fixture(update_len: usize) -> RoundFixture {
    let task = secure_task(update_len, in_an_hour());
    let plan = task
        .secure_aggregation
        .as_ref()
        .expect("secure")
        .plan
        .clone();
    let devices: Vec<(i64, DeviceKey)> = [11, 12, 13]
        .into_iter()
        .map(|id| (id, DeviceKey::generate()))
        .collect();
    let public: Vec<(u64, [u8; 32])> = devices
        .iter()
        .map(|(id, key)| (*id as u64, key.public_key()))
        .collect();
    let aggregator = Aggregator::new(
        Session {
            job_id: JOB_ID as u64,
            round_id: ROUND_ID as u64,
        },
        plan.clone(),
        &GRAPH_SEED,
        &public,
    )
    .expect("aggregator");
    let round = Arc::new(Mutex::new(FakeRound {
        aggregator: Some(aggregator),
        devices: devices.len(),
        answered: BTreeSet::new(),
        ready: BTreeMap::new(),
        sum: None,
        content_types: BTreeSet::new(),
        polls_with_wait: 0,
    }));
    RoundFixture {
        base: serve_round(round.clone()),
        round,
        devices,
        task,
        plan,
    }
}

/// Checks the unmasked sum against the updates and their weights: each
/// device's rounding is off by at most one step per unit of weight.
fn assert_sum_matches(fixture: &RoundFixture, deltas: &[Vec<f32>], weights: &[u64]) {
    let plan = &fixture.plan;
    let (sum, survivors) = fixture
        .round
        .lock()
        .expect("round")
        .sum
        .clone()
        .expect("the round finished");
    assert_eq!(survivors.len(), deltas.len());
    let (values, weight) = arith::decode_sum(plan, &sum).expect("decode");
    assert_eq!(weight, weights.iter().sum::<u64>());
    let step = plan.clip / plan.levels as f64;
    for (index, value) in values.iter().enumerate() {
        let expected: f64 = deltas
            .iter()
            .zip(weights)
            .map(|(delta, &w)| f64::from(delta[index]).clamp(-plan.clip, plan.clip) * w as f64)
            .sum();
        assert!(
            (value - expected).abs() <= step * weight as f64,
            "element {index}: {value} vs {expected}"
        );
    }
}

#[test]
fn three_devices_run_a_whole_round_and_the_server_learns_only_the_sum() {
    let fixture = round_fixture(6);
    let (task, plan) = (&fixture.task, &fixture.plan);
    let clients: Vec<DeviceClient> = fixture
        .devices
        .iter()
        .map(|(id, key)| client(&fixture.base, *id, key.clone(), fast()))
        .collect();
    let deltas: Vec<Vec<f32>> = vec![
        vec![0.5, -0.25, 0.0, 1.0, -1.0, 0.125],
        vec![0.25, 0.25, -0.5, 0.0, 3.0, 0.0],
        vec![-0.75, 0.5, 0.5, 0.5, 0.0, -0.125],
    ];
    let samples = [10u64, 20, 500];
    let events = Arc::new(Mutex::new(Vec::new()));
    let log = events.clone();
    let observer: StageObserver = Arc::new(move |progress: &StageProgress| {
        log.lock().expect("events").push(*progress);
    });
    let receipts = runtime().block_on(async {
        // Keys first, side by side, as devices do before they train.
        let (a, b, c) = tokio::join!(
            clients[0].begin_secure_round_observed(task, observer.clone()),
            clients[1].begin_secure_round(task),
            clients[2].begin_secure_round(task),
        );
        let (a, b, c) = (a.expect("a"), b.expect("b"), c.expect("c"));
        assert_eq!(a.round_id(), ROUND_ID);
        assert_eq!(a.plan(), plan);
        let (a, b, c) = tokio::join!(
            a.finish(&deltas[0], samples[0]),
            b.finish(&deltas[1], samples[1]),
            c.finish(&deltas[2], samples[2]),
        );
        [a.expect("a"), b.expect("b"), c.expect("c")]
    });
    assert_eq!(receipts[0].weight, 10);
    assert_eq!(receipts[2].weight, 100, "capped at max_weight");
    assert_eq!(
        receipts[0].masked_input_bytes as usize,
        Stage::MaskedInput.max_bytes(plan.packed_bytes())
    );
    let weights: Vec<u64> = receipts.iter().map(|r| r.weight).collect();
    assert_sum_matches(&fixture, &deltas, &weights);
    let round = fixture.round.lock().expect("round");
    assert_eq!(
        round.content_types,
        BTreeSet::from(["application/octet-stream".to_string()])
    );
    assert!(round.polls_with_wait >= 15, "{}", round.polls_with_wait);
    let events = events.lock().expect("events");
    let stages: Vec<(Stage, bool)> = events.iter().map(|e| (e.stage, e.sent())).collect();
    assert_eq!(
        stages,
        [
            (Stage::AdvertiseKeys, true),
            (Stage::NeighbourKeys, false),
            (Stage::ShareKeys, true),
            (Stage::IncomingShares, false),
            (Stage::ShareReceipt, true),
            (Stage::Exclusions, false),
            (Stage::MaskedInput, true),
            (Stage::SurvivorSet, false),
            (Stage::SurvivorSignature, true),
            (Stage::UnmaskRequest, false),
            (Stage::UnmaskResponse, true),
        ]
    );
    assert!(events.iter().all(|e| e.round_id == ROUND_ID && e.bytes > 0));
}

#[test]
fn blocking_clients_run_a_round_from_their_own_threads() {
    let fixture = round_fixture(3);
    let deltas = vec![
        vec![0.1f32, 0.2, 0.3],
        vec![-0.1, 0.0, 0.5],
        vec![0.9, -0.9, 0.0],
    ];
    let threads: Vec<_> = fixture
        .devices
        .iter()
        .zip(deltas.clone())
        .map(|((id, key), delta)| {
            let device = crate::blocking::DeviceClient::from_async(client(
                &fixture.base,
                *id,
                key.clone(),
                fast(),
            ))
            .expect("blocking client");
            let task = fixture.task.clone();
            std::thread::spawn(move || {
                let round = device.begin_secure_round(&task)?;
                device.finish_secure_round(round, &delta, 4)
            })
        })
        .collect();
    for thread in threads {
        let receipt = thread.join().expect("thread").expect("round");
        assert_eq!(receipt.weight, 4);
    }
    assert_sum_matches(&fixture, &deltas, &[4, 4, 4]);
}

#[test]
fn the_futures_are_send() {
    fn assert_send<T: Send>(_: &T) {}
    let task = secure_task(2, in_an_hour());
    let device = client("http://127.0.0.1:9", 5, DeviceKey::generate(), fast());
    assert_send(&device.begin_secure_round(&task));
    assert_send(&device.run_secure_round(&task, &[0.0, 0.0], 1));
    assert_send(&device.wait_secure_message(&task, Stage::NeighbourKeys, 10));
}

#[test]
fn wait_limits_follow_the_stage_timeout_and_the_deadline() {
    let timeout = 60_000;
    let now = 1_000_000_000;
    let far = now + 10_000_000;
    let key_wait = timeout + STAGE_CLOSE_GRACE_MS;
    // Key stages: from the device's own message, whatever the deadline.
    assert_eq!(
        wait_limit_ms(timeout, far, Stage::NeighbourKeys, 0, now),
        key_wait
    );
    assert_eq!(
        wait_limit_ms(timeout, far, Stage::IncomingShares, 20_000, now),
        key_wait - 20_000
    );
    // Training took longer than the stage: one immediate poll remains.
    assert_eq!(
        wait_limit_ms(timeout, far, Stage::IncomingShares, 10 * key_wait, now),
        0
    );
    // UnmaskRequest: from the device's signature, like a key stage.
    assert_eq!(
        wait_limit_ms(timeout, far, Stage::UnmaskRequest, 5_000, now),
        key_wait - 5_000
    );
    // SurvivorSet: until the deadline, plus ConsistencyCheck, Unmasking
    // and the clock allowance.
    let deadline = now + 120_000;
    assert_eq!(
        wait_limit_ms(timeout, deadline, Stage::SurvivorSet, 0, now),
        120_000 + 2 * timeout + DEADLINE_CLOCK_SKEW_MS
    );
    // No wait outlives the round: here it ends 20 s from now.
    let passed = now - (2 * timeout + DEADLINE_CLOCK_SKEW_MS) + 20_000;
    assert_eq!(
        wait_limit_ms(timeout, passed, Stage::NeighbourKeys, 0, now),
        20_000
    );
    assert_eq!(
        wait_limit_ms(timeout, 0, Stage::SurvivorSet, 0, now),
        0,
        "a round long over"
    );
    assert_eq!(
        wait_limit_ms(u64::MAX, u64::MAX, Stage::NeighbourKeys, 0, now),
        u64::MAX - now,
        "saturates"
    );
    for stage in [
        Stage::AdvertiseKeys,
        Stage::ShareKeys,
        Stage::MaskedInput,
        Stage::SurvivorSignature,
        Stage::UnmaskResponse,
    ] {
        assert_eq!(wait_limit_ms(timeout, far, stage, 0, now), 0);
    }
}

fn status(code: u16) -> Step {
    Box::new(move |_| respond(code, &[], b""))
}

fn refused(code: u16, error: &'static str, message: &'static str) -> Step {
    Box::new(move |_| {
        let body = format!(r#"{{"error":{{"code":"{error}","message":"{message}"}}}}"#);
        respond(
            code,
            &[("content-type", "application/json".to_string())],
            body.as_bytes(),
        )
    })
}

fn secure_client(server: &Scripted) -> DeviceClient {
    client(&server.base, 5, DeviceKey::generate(), fast())
}

#[test]
fn a_410_names_the_stage_and_carries_the_servers_reason() {
    let server = scripted(vec![refused(
        410,
        "dropped",
        "device 5 missed ShareKeys and was dropped",
    )]);
    let task = secure_task(2, in_an_hour());
    let error = runtime()
        .block_on(secure_client(&server).wait_secure_message(&task, Stage::IncomingShares, 5_000))
        .expect_err("gone");
    match &error {
        SdkError::SecureRoundGone {
            round_id,
            stage,
            code,
            reason,
        } => {
            assert_eq!(
                (*round_id, *stage, code.as_str()),
                (ROUND_ID, Stage::IncomingShares, "dropped")
            );
            assert!(reason.contains("missed ShareKeys"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    let text = error.to_string();
    assert!(
        text.contains("round 7") && text.contains("IncomingShares") && text.contains("dropped"),
        "{text}"
    );
    assert_eq!(error.status(), Some(410));
    assert!(!error.is_retryable());
    let seen = server.seen.lock().expect("log").clone();
    assert_eq!(seen.len(), 1, "not retried");
    assert_eq!(seen[0].method, "GET");
    assert_eq!(
        seen[0].path, "/device/v1/rounds/7/secagg/incoming-shares?wait_ms=5000",
        "the trailing slash of the task's path is dropped"
    );
    assert!(seen[0].header("x-canopy-signature").is_some(), "signed");
}

#[test]
fn a_422_to_a_post_is_a_refusal_of_that_message() {
    let server = scripted(vec![refused(
        422,
        "secagg_rejected",
        "ShareKeys refused: device 9 appears twice",
    )]);
    let task = secure_task(2, in_an_hour());
    let error = runtime()
        .block_on(secure_client(&server).post_secure_message(
            &task,
            Stage::ShareKeys,
            Bytes::from_static(b"CNSA"),
        ))
        .expect_err("refused");
    assert!(
        matches!(&error, SdkError::SecureMessageRefused { stage: Stage::ShareKeys, code, reason, .. }
            if code == "secagg_rejected" && reason.contains("appears twice")),
        "{error:?}"
    );
    assert_eq!(error.status(), Some(422));
    let seen = server.seen.lock().expect("log").clone();
    assert_eq!(seen.len(), 1, "not retried");
    assert_eq!(seen[0].method, "POST");
    assert_eq!(seen[0].path, "/device/v1/rounds/7/secagg/share-keys");
    assert_eq!(seen[0].body, b"CNSA");
}

#[test]
fn a_post_retries_and_takes_a_409_after_a_lost_answer_as_taken() {
    let lost: Step = Box::new(|_| Vec::new());
    let server = scripted(vec![lost, refused(409, "conflict", "already sent")]);
    let task = secure_task(2, in_an_hour());
    runtime()
        .block_on(secure_client(&server).post_secure_message(
            &task,
            Stage::AdvertiseKeys,
            Bytes::from_static(b"keys"),
        ))
        .expect("the first attempt landed");
    assert_eq!(server.seen.lock().expect("log").len(), 2);

    // A 409 with no earlier attempt is the error it is.
    let server = scripted(vec![refused(409, "conflict", "already sent")]);
    let error = runtime()
        .block_on(secure_client(&server).post_secure_message(
            &task,
            Stage::AdvertiseKeys,
            Bytes::from_static(b"keys"),
        ))
        .expect_err("duplicate");
    assert_eq!(error.status(), Some(409));
}

#[test]
fn a_410_after_a_lost_answer_leaves_the_verdict_to_the_next_fetch() {
    let task = secure_task(2, in_an_hour());
    let post = |stage: Stage| {
        let lost: Step = Box::new(|_| Vec::new());
        let server = scripted(vec![lost, refused(410, "gone", "the stage is over")]);
        let outcome = runtime().block_on(secure_client(&server).post_secure_message(
            &task,
            stage,
            Bytes::from_static(b"x"),
        ));
        assert_eq!(server.seen.lock().expect("log").len(), 2);
        outcome
    };
    // The stage may have closed with the message in it; the fetch of the
    // server's answer says which.
    post(Stage::MaskedInput).expect("maybe taken");
    // Nothing follows UnmaskResponse: the 410 is all there is to know.
    let error = post(Stage::UnmaskResponse).expect_err("gone");
    assert!(
        matches!(
            error,
            SdkError::SecureRoundGone {
                stage: Stage::UnmaskResponse,
                ..
            }
        ),
        "{error:?}"
    );
}

#[test]
fn a_post_answered_with_another_success_than_204_is_refused() {
    let server = scripted(vec![status(200)]);
    let task = secure_task(2, in_an_hour());
    let error = runtime()
        .block_on(secure_client(&server).post_secure_message(
            &task,
            Stage::MaskedInput,
            Bytes::from_static(b"x"),
        ))
        .expect_err("200");
    assert!(
        matches!(&error, SdkError::BadResponse { what: "MaskedInput message", reason } if reason.contains("not 204")),
        "{error:?}"
    );
}

#[test]
fn a_server_message_over_its_stage_limit_is_refused_unread() {
    let task = secure_task(2, in_an_hour());
    let limit = Stage::UnmaskRequest.max_bytes(0);
    let oversized = vec![0u8; limit + 1];
    let exact = vec![7u8; limit];
    let (big, fits) = (oversized.clone(), exact.clone());
    let server = scripted(vec![
        Box::new(move |_| respond(200, &[], &big)),
        Box::new(move |_| respond(200, &[], &fits)),
    ]);
    let device = secure_client(&server);
    let rt = runtime();
    let error = rt
        .block_on(device.poll_secure_message(&task, Stage::UnmaskRequest, 0))
        .expect_err("too big");
    assert!(
        matches!(&error, SdkError::BadResponse { what: "UnmaskRequest message", reason }
            if reason.contains(&format!("{} bytes", limit + 1)) && reason.contains(&limit.to_string())),
        "{error:?}"
    );
    let message = rt
        .block_on(device.poll_secure_message(&task, Stage::UnmaskRequest, 0))
        .expect("at the limit")
        .expect("a message");
    assert_eq!(message.len(), limit);
}

#[test]
fn an_unannounced_body_over_the_limit_is_cut_off_while_reading() {
    let task = secure_task(2, in_an_hour());
    let limit = Stage::NeighbourKeys.max_bytes(0);
    let body = vec![1u8; limit + 10];
    let server = scripted(vec![Box::new(move |_| {
        // No Content-Length: the body ends when the connection closes.
        let mut out = b"HTTP/1.1 200 Scripted\r\nconnection: close\r\n\r\n".to_vec();
        out.extend_from_slice(&body);
        out
    })]);
    let error = runtime()
        .block_on(secure_client(&server).poll_secure_message(&task, Stage::NeighbourKeys, 0))
        .expect_err("too big");
    assert!(
        matches!(&error, SdkError::BadResponse { reason, .. } if reason.contains("longer")),
        "{error:?}"
    );
}

#[test]
fn polling_goes_on_through_202s_and_retries_transient_failures() {
    let server = scripted(vec![
        status(202),
        refused(503, "unavailable", "restarting"),
        status(202),
        Box::new(|_| respond(200, &[], b"neighbours")),
    ]);
    let task = secure_task(2, in_an_hour());
    let started = std::time::Instant::now();
    let message = runtime()
        .block_on(secure_client(&server).wait_secure_message(&task, Stage::NeighbourKeys, 60_000))
        .expect("message");
    assert_eq!(message.as_ref(), b"neighbours");
    // Two 202s answered at once: paced, not a tight loop.
    let paced = Duration::from_millis(2 * MIN_STAGE_POLL_INTERVAL_MS);
    assert!(started.elapsed() >= paced, "{:?}", started.elapsed());
    let seen = server.seen.lock().expect("log").clone();
    assert_eq!(seen.len(), 4);
    assert!(
        seen.iter()
            .all(|s| s.path == "/device/v1/rounds/7/secagg/neighbour-keys?wait_ms=25000"),
        "each poll waits at most MAX_STAGE_POLL_WAIT_MS: {seen:?}"
    );
}

#[test]
fn a_stage_that_never_closes_ends_in_a_timeout_naming_the_stage() {
    let answers = Arc::new(AtomicUsize::new(0));
    let count = answers.clone();
    let always_202: Vec<Step> = (0..20)
        .map(|_| {
            let count = count.clone();
            Box::new(move |_: &Seen| {
                count.fetch_add(1, Ordering::SeqCst);
                respond(202, &[], b"")
            }) as Step
        })
        .collect();
    let server = scripted(always_202);
    let task = secure_task(2, in_an_hour());
    let started = std::time::Instant::now();
    let error = runtime()
        .block_on(secure_client(&server).wait_secure_message(&task, Stage::UnmaskRequest, 300))
        .expect_err("timeout");
    assert!(
        matches!(error, SdkError::StageTimeout { round_id: ROUND_ID, stage: Stage::UnmaskRequest, waited_ms } if waited_ms >= 300),
        "{error:?}"
    );
    assert!(error.to_string().contains("UnmaskRequest"), "{error}");
    assert!(started.elapsed() < Duration::from_secs(5));
    let seen = server.seen.lock().expect("log").clone();
    assert_eq!(
        seen[0].path,
        "/device/v1/rounds/7/secagg/unmask-request?wait_ms=300"
    );
    assert_eq!(
        seen.last().map(|s| s.path.as_str()),
        Some("/device/v1/rounds/7/secagg/unmask-request?wait_ms=0"),
        "a last poll at the limit"
    );
    assert_eq!(answers.load(Ordering::SeqCst), 2);
}

#[test]
fn a_message_already_there_is_fetched_with_no_time_left() {
    let server = scripted(vec![Box::new(|_| respond(200, &[], b"shares"))]);
    let task = secure_task(2, in_an_hour());
    let message = runtime()
        .block_on(secure_client(&server).wait_secure_message(&task, Stage::IncomingShares, 0))
        .expect("message");
    assert_eq!(message.as_ref(), b"shares");
}

#[test]
fn cancelling_ends_a_wait_promptly() {
    let server = scripted((0..50).map(|_| status(202)).collect());
    let task = secure_task(2, in_an_hour());
    let token = crate::CancelToken::new();
    let device = secure_client(&server).with_cancel_token(token.clone());
    let canceller = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        token.cancel();
    });
    let started = std::time::Instant::now();
    let error = runtime()
        .block_on(device.wait_secure_message(&task, Stage::NeighbourKeys, 60_000))
        .expect_err("cancelled");
    assert!(matches!(error, SdkError::Cancelled), "{error:?}");
    assert!(started.elapsed() < Duration::from_secs(5));
    canceller.join().expect("canceller");
}

#[test]
fn misuse_is_refused_before_any_request() {
    let server = scripted(Vec::new());
    let device = secure_client(&server);
    let rt = runtime();
    let mut plain = secure_task(2, in_an_hour());
    plain.secure_aggregation = None;
    let error = rt
        .block_on(device.begin_secure_round(&plain))
        .expect_err("not secure");
    assert!(
        matches!(error, SdkError::NotSecure { round_id: ROUND_ID }),
        "{error:?}"
    );
    assert!(error.to_string().contains("round 7"), "{error}");

    let task = secure_task(2, in_an_hour());
    let error = rt
        .block_on(device.post_secure_message(&task, Stage::NeighbourKeys, Bytes::new()))
        .expect_err("a server stage");
    assert!(
        matches!(&error, SdkError::SecureAggregation { stage: Stage::NeighbourKeys, source, .. }
            if source.to_string().contains("cannot send")),
        "{error:?}"
    );
    let error = rt
        .block_on(device.poll_secure_message(&task, Stage::MaskedInput, 0))
        .expect_err("a device stage");
    assert!(
        matches!(error, SdkError::SecureAggregation { .. }),
        "{error:?}"
    );
    let limit = Stage::AdvertiseKeys.max_bytes(0);
    let error = rt
        .block_on(device.post_secure_message(
            &task,
            Stage::AdvertiseKeys,
            Bytes::from(vec![0; limit + 1]),
        ))
        .expect_err("too big");
    assert!(error.to_string().contains("AdvertiseKeys"), "{error}");

    // A plan for another layout is refused before the device advertises.
    let mut other = secure_task(2, in_an_hour());
    other.secure_aggregation.as_mut().expect("secure").plan = plan(3);
    let error = rt
        .block_on(device.begin_secure_round(&other))
        .expect_err("mismatch");
    assert!(
        matches!(&error, SdkError::SecureAggregation { stage: Stage::AdvertiseKeys, source, .. }
            if source.to_string().contains("3 values")),
        "{error:?}"
    );

    let mut odd = secure_task(2, in_an_hour());
    odd.secure_aggregation.as_mut().expect("secure").path = "rounds/7?x=1".to_string();
    let error = rt
        .block_on(device.begin_secure_round(&odd))
        .expect_err("odd path");
    assert!(
        matches!(&error, SdkError::BadResponse { what: "task", reason } if reason.contains("plain absolute path")),
        "{error:?}"
    );
    assert!(server.seen.lock().expect("log").is_empty(), "no request");
}

#[test]
fn an_update_that_does_not_fit_the_plan_fails_before_masking() {
    let server = scripted(Vec::new());
    let task = secure_task(2, in_an_hour());
    // A round past its key stages, built directly: `finish` quantizes
    // before it fetches anything, so a bad update costs no request.
    let device = secure_client(&server);
    let secure = task.secure_aggregation.clone().expect("secure");
    let (state, _) = Client::start(
        Session {
            job_id: JOB_ID as u64,
            round_id: ROUND_ID as u64,
        },
        5,
        secure.plan,
        device.key(),
        device.key_trust(),
    )
    .expect("start");
    let round = SecureRound {
        client: device,
        task,
        state,
        checked_at: Instant::now(),
        observer: None,
    };
    let outcome = runtime().block_on(round.finish(&[f32::NAN, 0.0], 3));
    assert!(
        matches!(&outcome, Err(SdkError::SecureAggregation { stage: Stage::MaskedInput, source, .. })
            if source.to_string().contains("NaN")),
        "{outcome:?}"
    );
    assert!(server.seen.lock().expect("log").is_empty(), "no request");
}

#[test]
fn a_silent_connection_does_not_outlast_the_stage_limit() {
    // Accepts connections and never answers.
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("address"));
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in listener.incoming().take(4) {
            held.push(stream);
        }
        std::thread::sleep(Duration::from_secs(60));
    });
    let task = secure_task(2, in_an_hour());
    let device = client(&base, 5, DeviceKey::generate(), RetryPolicy::none());
    // Paused time: the limit and the answer allowance pass at once, while
    // the client's 120 s request timeout never comes.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .expect("runtime");
    let error = runtime
        .block_on(device.wait_secure_message(&task, Stage::NeighbourKeys, 100))
        .expect_err("silent");
    assert!(
        matches!(error, SdkError::StageTimeout { stage: Stage::NeighbourKeys, waited_ms, .. }
            if (100 + POLL_ANSWER_ALLOWANCE_MS..REQUEST_TIMEOUT_MS).contains(&waited_ms)),
        "{error:?}"
    );
}
