//! The client's retry, resume and upload-idempotency decisions against a
//! scripted plain-HTTP/1.1 server on loopback, where every failure can be
//! staged exactly. The real server is exercised in `server/tests/sdk.rs`.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use canopy_protocol::auth::DeviceKey;
use canopy_protocol::messages::{Task, TrainingConfig};
use canopy_protocol::model_sig::{HEADER_MODEL_DIGEST, HEADER_MODEL_SIGNATURE, ServerKey};
use canopy_protocol::update::{TensorSpec, UpdateLayout, encode_update};

use super::download::{parse_content_range, part_path};
use super::*;
use crate::trust::Trust;
use std::path::Path;

/// One request as the scripted server read it.
#[derive(Clone, Debug)]
pub(crate) struct Seen {
    pub(crate) method: String,
    pub(crate) path: String,
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) body_len: usize,
    pub(crate) body: Vec<u8>,
}

impl Seen {
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(key, _)| key.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.as_str())
    }
}

/// What the server does with the n-th request: write these bytes, then
/// close the connection.
pub(crate) type Step = Box<dyn Fn(&Seen) -> Vec<u8> + Send>;

pub(crate) struct Scripted {
    pub(crate) base: String,
    pub(crate) seen: Arc<Mutex<Vec<Seen>>>,
}

pub(crate) fn read_request(stream: &mut TcpStream) -> Option<Seen> {
    let mut reader = BufReader::new(stream.try_clone().ok()?);
    let mut line = String::new();
    reader.read_line(&mut line).ok()?;
    let mut parts = line.split_whitespace();
    let method = parts.next()?.to_string();
    let path = parts.next()?.to_string();
    let mut headers = Vec::new();
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).ok()?;
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        let (name, value) = line.split_once(':')?;
        headers.push((name.trim().to_ascii_lowercase(), value.trim().to_string()));
    }
    let length = headers
        .iter()
        .find(|(name, _)| name == "content-length")
        .and_then(|(_, value)| value.parse::<usize>().ok())
        .unwrap_or(0);
    let mut body = vec![0; length];
    reader.read_exact(&mut body).ok()?;
    Some(Seen {
        method,
        path,
        headers,
        body_len: length,
        body,
    })
}

/// Serves `steps` in order, one connection per request; a request past
/// the script answers 500.
pub(crate) fn scripted(steps: Vec<Step>) -> Scripted {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("address"));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    std::thread::spawn(move || {
        let mut steps = steps.into_iter();
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            let Some(request) = read_request(&mut stream) else {
                continue;
            };
            log.lock().expect("log").push(request.clone());
            let reply = match steps.next() {
                Some(step) => step(&request),
                None => respond(
                    500,
                    &[],
                    br#"{"error":{"code":"internal","message":"off script"}}"#,
                ),
            };
            let _ = stream.write_all(&reply);
            let _ = stream.flush();
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
    });
    Scripted { base, seen }
}

pub(crate) fn respond(status: u16, headers: &[(&str, String)], body: &[u8]) -> Vec<u8> {
    respond_cut(status, headers, body, body.len(), body.len())
}

/// A response announcing `announced` body bytes and sending `sent` of
/// `body`.
fn respond_cut(
    status: u16,
    headers: &[(&str, String)],
    body: &[u8],
    announced: usize,
    sent: usize,
) -> Vec<u8> {
    let mut out = format!(
        "HTTP/1.1 {status} Scripted\r\nconnection: close\r\ncontent-length: {announced}\r\n"
    );
    for (name, value) in headers {
        out.push_str(&format!("{name}: {value}\r\n"));
    }
    out.push_str("\r\n");
    let mut bytes = out.into_bytes();
    bytes.extend_from_slice(&body[..sent]);
    bytes
}

fn error_body(code: &str) -> Vec<u8> {
    format!(r#"{{"error":{{"code":"{code}","message":"scripted"}}}}"#).into_bytes()
}

struct Fixture {
    model: Vec<u8>,
    digest: String,
    signature: String,
    server_key_hex: String,
}

fn fixture() -> Fixture {
    let config = canopy_engine::zoo::ModelConfig {
        architecture: canopy_engine::zoo::Architecture::Mlp {
            inputs: 64,
            hidden: 64,
            classes: 10,
        },
        seed: 3,
        optimizer: canopy_engine::optim::Optimizer::parse("sgd").expect("sgd"),
        frozen_prefixes: Vec::new(),
        producer: "sdk tests".to_string(),
    };
    let model = canopy_engine::zoo::build_model(&config).expect("model");
    let model = canopy_ir::format::write_model(&model).expect("bytes");
    let digest = canopy_ir::format::digest_hex(&canopy_ir::format::digest(&model).expect("digest"));
    let server_key = ServerKey::generate();
    Fixture {
        signature: server_key.sign_model(&digest),
        server_key_hex: server_key.public_key_hex(),
        model,
        digest,
    }
}

fn task(fixture: &Fixture) -> Task {
    Task {
        kind: canopy_protocol::messages::TaskKind::Train,
        dataset: None,
        job_id: 1,
        round_id: 7,
        round_number: 1,
        model_version_id: 3,
        model_digest: fixture.digest.clone(),
        model_size_bytes: fixture.model.len() as u64,
        model_path: "/device/v1/models/3".to_string(),
        upload_path: "/device/v1/rounds/7/update".to_string(),
        upload_size_bytes: 0,
        deadline_unix_ms: 0,
        training: TrainingConfig {
            epochs: 1,
            batch_size: 8,
            learning_rate: 0.1,
        },
        layout: UpdateLayout::new(vec![TensorSpec {
            name: "w".to_string(),
            shape: vec![2],
        }])
        .expect("layout"),
        secure_aggregation: None,
        sub_round: None,
        privacy: None,
        compression: None,
        policy: Default::default(),
    }
}

fn make_client(base: &str, server_key_hex: &str, policy: RetryPolicy) -> DeviceClient {
    let transport = Transport::new(base, &Trust::PinnedSha256("ab".repeat(32))).expect("transport");
    DeviceClient::new(transport, 5, DeviceKey::generate(), server_key_hex)
        .expect("client")
        .with_retry_policy(policy)
}

pub(crate) fn fast() -> RetryPolicy {
    RetryPolicy {
        max_attempts: 4,
        initial_backoff_ms: 1,
        max_backoff_ms: 5,
        multiplier: 2.0,
    }
}

pub(crate) fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

fn model_headers(fixture: &Fixture) -> Vec<(&'static str, String)> {
    vec![
        (HEADER_MODEL_DIGEST, fixture.digest.clone()),
        (HEADER_MODEL_SIGNATURE, fixture.signature.clone()),
    ]
}

/// 200 announcing the whole model, cut after `cut` bytes.
fn cut_at(fixture: &Fixture, cut: usize) -> Step {
    let (model, headers) = (fixture.model.clone(), model_headers(fixture));
    Box::new(move |_| respond_cut(200, &headers, &model, model.len(), cut))
}

/// 206 from the requested offset to the end.
fn rest(fixture: &Fixture) -> Step {
    let (model, headers) = (fixture.model.clone(), model_headers(fixture));
    Box::new(move |seen| {
        let start: usize = seen
            .header("range")
            .and_then(|range| range.strip_prefix("bytes="))
            .and_then(|range| range.strip_suffix('-'))
            .and_then(|start| start.parse().ok())
            .unwrap_or(0);
        let mut headers = headers.clone();
        headers.push((
            "content-range",
            format!("bytes {start}-{}/{}", model.len() - 1, model.len()),
        ));
        respond(206, &headers, &model[start..])
    })
}

#[test]
fn the_futures_are_send() {
    fn assert_send<T: Send>(_: &T) {}
    let fixture = fixture();
    let client = make_client("http://127.0.0.1:9", &fixture.server_key_hex, fast());
    let task = task(&fixture);
    assert_send(&client.next_task(0));
    assert_send(&client.download_model(&task));
    assert_send(&client.download_model_to(&task, Path::new("x")));
    assert_send(&client.upload_update(&task, Bytes::new()));
    assert_send(&client.heartbeat(&Heartbeat::default()));
}

#[test]
fn a_cut_download_resumes_with_a_range_request() {
    let fixture = fixture();
    assert!(fixture.model.len() > 20_000, "{}", fixture.model.len());
    let cut = fixture.model.len() / 3;
    let server = scripted(vec![cut_at(&fixture, cut), rest(&fixture)]);
    let client = make_client(&server.base, &fixture.server_key_hex, fast());
    let model = runtime()
        .block_on(client.download_model(&task(&fixture)))
        .expect("download resumes");
    assert_eq!(model.bytes.as_ref(), fixture.model.as_slice());
    assert_eq!(model.digest, fixture.digest);
    let seen = server.seen.lock().expect("log").clone();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[0].header("range"), None);
    assert_eq!(
        seen[1].header("range"),
        Some(format!("bytes={cut}-").as_str())
    );
    assert_eq!(seen[1].method, "GET");
    assert_eq!(seen[1].path, "/device/v1/models/3");
    assert!(
        seen[1].header("x-canopy-signature").is_some(),
        "every attempt is signed"
    );
    assert_ne!(
        seen[0].header("x-canopy-nonce"),
        seen[1].header("x-canopy-nonce"),
        "with a fresh nonce"
    );
}

#[test]
fn a_body_that_ends_short_without_a_length_resumes_too() {
    let fixture = fixture();
    let (model, headers) = (fixture.model.clone(), model_headers(&fixture));
    // No Content-Length: the body ends when the connection closes, cleanly.
    let unframed: Step = Box::new(move |_| {
        let mut out = String::from("HTTP/1.1 200 Scripted\r\nconnection: close\r\n");
        for (name, value) in &headers {
            out.push_str(&format!("{name}: {value}\r\n"));
        }
        out.push_str("\r\n");
        let mut bytes = out.into_bytes();
        bytes.extend_from_slice(&model[..7_000]);
        bytes
    });
    let server = scripted(vec![unframed, rest(&fixture)]);
    let client = make_client(&server.base, &fixture.server_key_hex, fast());
    let model = runtime()
        .block_on(client.download_model(&task(&fixture)))
        .expect("resumes");
    assert_eq!(model.bytes.as_ref(), fixture.model.as_slice());
    let seen = server.seen.lock().expect("log").clone();
    assert_eq!(seen[1].header("range"), Some("bytes=7000-"));
}

#[test]
fn without_retries_a_cut_download_is_a_retryable_transport_error() {
    let fixture = fixture();
    let server = scripted(vec![cut_at(&fixture, 1_000)]);
    let client = make_client(&server.base, &fixture.server_key_hex, RetryPolicy::none());
    let error = runtime()
        .block_on(client.download_model(&task(&fixture)))
        .expect_err("cut");
    assert!(matches!(error, SdkError::Transport { .. }), "{error:?}");
    assert!(error.is_retryable());
}

#[test]
fn a_content_range_that_does_not_continue_the_file_is_refused() {
    let fixture = fixture();
    let (model, headers) = (fixture.model.clone(), model_headers(&fixture));
    let wrong: Step = Box::new(move |_| {
        let mut headers = headers.clone();
        // Starts at 0, not where the first response stopped.
        headers.push((
            "content-range",
            format!("bytes 0-{}/{}", model.len() - 1, model.len()),
        ));
        respond(206, &headers, &model)
    });
    let server = scripted(vec![cut_at(&fixture, 5_000), wrong]);
    let client = make_client(&server.base, &fixture.server_key_hex, fast());
    let error = runtime()
        .block_on(client.download_model(&task(&fixture)))
        .expect_err("refused");
    assert!(
        matches!(&error, SdkError::BadResponse { reason, .. } if reason.contains("Content-Range")),
        "{error:?}"
    );
    assert_eq!(server.seen.lock().expect("log").len(), 2, "not retried");
}

#[test]
fn a_server_that_ignores_the_range_sends_the_whole_file_again() {
    let fixture = fixture();
    let (model, headers) = (fixture.model.clone(), model_headers(&fixture));
    let whole: Step = Box::new(move |_| respond(200, &headers, &model));
    let server = scripted(vec![cut_at(&fixture, 5_000), whole]);
    let client = make_client(&server.base, &fixture.server_key_hex, fast());
    let model = runtime()
        .block_on(client.download_model(&task(&fixture)))
        .expect("download");
    assert_eq!(model.bytes.as_ref(), fixture.model.as_slice());
}

#[test]
fn a_tampered_model_or_a_wrong_signature_still_fails_after_a_resume() {
    let fixture = fixture();
    let (model, headers) = (fixture.model.clone(), model_headers(&fixture));
    let tampered: Step = Box::new(move |seen| {
        let start: usize = seen
            .header("range")
            .and_then(|r| r.strip_prefix("bytes="))
            .and_then(|r| r.strip_suffix('-'))
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let mut body = model[start..].to_vec();
        let last = body.len() - 1;
        body[last] ^= 0xff;
        let mut headers = headers.clone();
        headers.push((
            "content-range",
            format!("bytes {start}-{}/{}", model.len() - 1, model.len()),
        ));
        respond(206, &headers, &body)
    });
    let server = scripted(vec![cut_at(&fixture, 5_000), tampered]);
    let client = make_client(&server.base, &fixture.server_key_hex, fast());
    let error = runtime()
        .block_on(client.download_model(&task(&fixture)))
        .expect_err("tampered");
    assert!(
        matches!(error, SdkError::ModelVerification { .. }),
        "{error:?}"
    );

    let server = scripted(vec![cut_at(&fixture, 5_000)]);
    let other_key = ServerKey::generate().public_key_hex();
    let client = make_client(&server.base, &other_key, fast());
    let error = runtime()
        .block_on(client.download_model(&task(&fixture)))
        .expect_err("wrong signer");
    assert!(
        matches!(&error, SdkError::ModelVerification { reason, .. } if reason.contains("signature")),
        "{error:?}"
    );
    assert_eq!(server.seen.lock().expect("log").len(), 1, "not retried");
}

#[test]
fn download_to_a_file_resumes_from_the_part_file_of_an_earlier_call() {
    let fixture = fixture();
    let dir = tempfile::tempdir().expect("tempdir");
    let target = dir.path().join("model.canopy");
    let cut = fixture.model.len() / 2;
    let server = scripted(vec![cut_at(&fixture, cut), rest(&fixture)]);
    let task = task(&fixture);
    let once = make_client(&server.base, &fixture.server_key_hex, RetryPolicy::none());
    let runtime = runtime();
    runtime
        .block_on(once.download_model_to(&task, &target))
        .expect_err("the first call is cut off");
    let part = part_path(&target, &fixture.digest);
    assert_eq!(std::fs::metadata(&part).expect("part").len(), cut as u64);
    assert!(!target.exists());
    let model = runtime
        .block_on(once.download_model_to(&task, &target))
        .expect("the second call resumes");
    assert_eq!(model.bytes.as_ref(), fixture.model.as_slice());
    assert_eq!(std::fs::read(&target).expect("file"), fixture.model);
    assert!(!part.exists(), "the part file became the model");
    let seen = server.seen.lock().expect("log").clone();
    assert_eq!(
        seen[1].header("range"),
        Some(format!("bytes={cut}-").as_str())
    );
}

#[test]
fn a_corrupt_part_file_is_discarded_and_the_download_starts_over() {
    let fixture = fixture();
    let dir = tempfile::tempdir().expect("tempdir");
    let target = dir.path().join("model.canopy");
    let part = part_path(&target, &fixture.digest);
    std::fs::write(&part, vec![0x55; 4_000]).expect("garbage");
    let (model, headers) = (fixture.model.clone(), model_headers(&fixture));
    let whole: Step = Box::new(move |_| respond(200, &headers, &model));
    let server = scripted(vec![rest(&fixture), whole]);
    let client = make_client(&server.base, &fixture.server_key_hex, RetryPolicy::none());
    let model = runtime()
        .block_on(client.download_model_to(&task(&fixture), &target))
        .expect("starts over");
    assert_eq!(model.bytes.as_ref(), fixture.model.as_slice());
    let seen = server.seen.lock().expect("log").clone();
    assert_eq!(seen[0].header("range"), Some("bytes=4000-"));
    assert_eq!(seen[1].header("range"), None);
}

fn update() -> Vec<u8> {
    let layout = UpdateLayout::new(vec![TensorSpec {
        name: "w".to_string(),
        shape: vec![2],
    }])
    .expect("layout");
    encode_update(&layout, 42, &[0.5, -0.5]).expect("encode")
}

fn receipt(status: u16) -> Step {
    Box::new(move |seen| {
        let body = format!(
            r#"{{"round_id":7,"accepted":true,"num_samples":42,"bytes":{}}}"#,
            seen.body_len
        );
        respond(
            status,
            &[("content-type", "application/json".to_string())],
            body.as_bytes(),
        )
    })
}

fn answer(status: u16, code: &'static str) -> Step {
    Box::new(move |_| {
        respond(
            status,
            &[("content-type", "application/json".to_string())],
            &error_body(code),
        )
    })
}

/// Reads the request, then closes without answering: the answer is lost.
fn hang_up() -> Step {
    Box::new(|_| Vec::new())
}

#[test]
fn a_409_after_a_lost_answer_means_the_earlier_upload_was_accepted() {
    let fixture = fixture();
    let server = scripted(vec![hang_up(), answer(409, "conflict")]);
    let client = make_client(&server.base, &fixture.server_key_hex, fast());
    let encoded = update();
    let receipt = runtime()
        .block_on(client.upload_update(&task(&fixture), Bytes::from(encoded.clone())))
        .expect("treated as accepted");
    assert_eq!(
        receipt,
        UploadReceipt {
            round_id: 7,
            accepted: true,
            num_samples: 42,
            bytes: encoded.len() as u64,
        }
    );
    let seen = server.seen.lock().expect("log").clone();
    assert_eq!(seen.len(), 2);
    assert!(
        seen.iter()
            .all(|s| s.method == "PUT" && s.body_len == encoded.len())
    );
}

#[test]
fn a_409_is_an_error_when_no_earlier_attempt_can_have_landed() {
    let fixture = fixture();
    for script in [
        vec![answer(409, "conflict")],
        vec![answer(503, "unavailable"), answer(409, "conflict")],
        vec![answer(429, "rate_limited"), answer(409, "conflict")],
    ] {
        let steps = script.len();
        let server = scripted(script);
        let client = make_client(&server.base, &fixture.server_key_hex, fast());
        let error = runtime()
            .block_on(client.upload_update(&task(&fixture), Bytes::from(update())))
            .expect_err("a real duplicate");
        assert_eq!(error.status(), Some(409));
        assert_eq!(server.seen.lock().expect("log").len(), steps);
    }
}

#[test]
fn uploads_retry_transient_answers_and_not_permanent_ones() {
    let fixture = fixture();
    let server = scripted(vec![
        answer(502, "internal"),
        answer(504, "internal"),
        receipt(201),
    ]);
    let client = make_client(&server.base, &fixture.server_key_hex, fast());
    let receipt = runtime()
        .block_on(client.upload_update(&task(&fixture), Bytes::from(update())))
        .expect("third time");
    assert_eq!(receipt.num_samples, 42);

    let server = scripted(vec![answer(422, "unprocessable"), receipt_step()]);
    let client = make_client(&server.base, &fixture.server_key_hex, fast());
    let error = runtime()
        .block_on(client.upload_update(&task(&fixture), Bytes::from(update())))
        .expect_err("422");
    assert_eq!(error.status(), Some(422));
    assert_eq!(server.seen.lock().expect("log").len(), 1);
}

fn receipt_step() -> Step {
    receipt(201)
}

#[test]
fn retries_give_up_after_max_attempts_with_the_last_error() {
    let fixture = fixture();
    let server = scripted(vec![
        answer(503, "unavailable"),
        answer(503, "unavailable"),
        answer(500, "internal"),
        answer(503, "unavailable"),
    ]);
    let policy = RetryPolicy {
        max_attempts: 3,
        ..fast()
    };
    let client = make_client(&server.base, &fixture.server_key_hex, policy);
    let error = runtime()
        .block_on(client.heartbeat(&Heartbeat::default()))
        .expect_err("gives up");
    assert_eq!(error.status(), Some(500));
    assert_eq!(server.seen.lock().expect("log").len(), 3);
}

#[test]
fn cancelling_stops_a_call_waiting_on_a_silent_server() {
    // Accepts connections and never answers.
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("address"));
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in listener.incoming().take(4) {
            held.push(stream);
        }
        std::thread::sleep(Duration::from_secs(30));
    });
    let fixture = fixture();
    let token = CancelToken::new();
    let client =
        make_client(&base, &fixture.server_key_hex, fast()).with_cancel_token(token.clone());
    let canceller = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        token.cancel();
    });
    let started = std::time::Instant::now();
    let error = runtime()
        .block_on(client.next_task(30_000))
        .expect_err("cancelled");
    assert!(matches!(error, SdkError::Cancelled), "{error:?}");
    assert!(started.elapsed() < Duration::from_secs(5));
    canceller.join().expect("canceller");
}

#[test]
fn content_ranges_parse_strictly() {
    assert_eq!(parse_content_range("bytes 5-9/10"), Some((5, 9, 10)));
    assert_eq!(parse_content_range("bytes 0-0/1"), Some((0, 0, 1)));
    for bad in [
        "bytes 5-9/9",
        "bytes 9-5/10",
        "bytes */10",
        "bytes 5-/10",
        "bytes +5-9/10",
        "items 5-9/10",
        "bytes 5-9/*",
    ] {
        assert_eq!(parse_content_range(bad), None, "{bad}");
    }
    assert_eq!(encoded_samples(&update()), 42);
    assert_eq!(encoded_samples(b"short"), 0);
}

#[test]
fn a_body_that_cannot_be_serialised_is_our_error_and_sends_nothing() {
    let server = scripted(Vec::new());
    let client = make_client(&server.base, &fixture().server_key_hex, fast());
    // JSON object keys must be strings: serde_json refuses this map.
    let body: std::collections::BTreeMap<(u8, u8), u8> = [((1, 2), 3)].into();
    let error = runtime()
        .block_on(client.signed_json("/device/v1/heartbeat", "heartbeat", &body))
        .expect_err("unserialisable");
    assert!(
        matches!(
            error,
            SdkError::Encode {
                what: "heartbeat",
                ..
            }
        ),
        "{error:?}"
    );
    assert!(
        error.to_string().contains("cannot encode the heartbeat"),
        "{error}"
    );
    assert!(!error.is_retryable());
    assert!(server.seen.lock().expect("log").is_empty(), "no request");
}

#[test]
fn the_retry_observer_hears_every_retry_before_its_wait() {
    let fixture = fixture();
    let server = scripted(vec![
        answer(503, "unavailable"),
        answer(502, "bad_gateway"),
        Box::new(|_| respond(204, &[], b"")),
        hang_up(),
        receipt(200),
    ]);
    let heard = Arc::new(Mutex::new(Vec::new()));
    let log = heard.clone();
    let observer: crate::RetryObserver = Arc::new(move |notice: &crate::RetryNotice<'_>| {
        let entry = (notice.failures, notice.error.status(), notice.wait);
        log.lock().expect("log").push(entry);
    });
    let client =
        make_client(&server.base, &fixture.server_key_hex, fast()).with_retry_observer(observer);
    let rt = runtime();
    assert_eq!(rt.block_on(client.next_task(0)).expect("polled"), None);
    let uploaded = rt.block_on(client.upload_update(&task(&fixture), Bytes::from(update())));
    assert!(uploaded.expect("uploaded").accepted);
    let heard = heard.lock().expect("log");
    let outline: Vec<(u32, Option<u16>)> = heard.iter().map(|(n, s, _)| (*n, *s)).collect();
    // Two retries of the poll, then one of the upload (a lost answer).
    assert_eq!(outline, [(1, Some(503)), (2, Some(502)), (1, None)]);
    let ceiling = Duration::from_millis(fast().max_backoff_ms);
    assert!(
        heard.iter().all(|(_, _, wait)| *wait <= ceiling),
        "{heard:?}"
    );
}
