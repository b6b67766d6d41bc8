use std::collections::HashMap;

use canopy_protocol::auth::*;

const NOW_MS: u64 = 1_700_000_000_000;
const DEVICE_ID: i64 = 42;
const PATH: &str = "/v1/rounds/7/update?attempt=1";

fn key(seed: u8) -> DeviceKey {
    DeviceKey::from_bytes(&[seed; 32])
}

fn signed() -> (DeviceKey, SignedRequest) {
    let key = key(7);
    let request = sign_request(&key, DEVICE_ID, "PUT", PATH, b"update bytes", NOW_MS);
    (key, request)
}

fn header_map(request: &SignedRequest) -> HashMap<&'static str, String> {
    request.headers().into_iter().collect()
}

fn parse(map: &HashMap<&'static str, String>) -> Result<SignedRequest, AuthError> {
    SignedRequest::from_headers(|name| map.get(name).map(String::as_str))
}

#[test]
fn sign_then_verify_roundtrips_through_headers() {
    let (key, request) = signed();
    assert_eq!(request.device_id, DEVICE_ID);
    assert_eq!(request.timestamp_ms, NOW_MS);
    assert_eq!(request.content_sha256, sha256_hex(b"update bytes"));
    assert_eq!(request.nonce.len(), 32);
    assert_eq!(request.signature.len(), 128);

    let parsed = parse(&header_map(&request)).unwrap();
    assert_eq!(parsed, request);
    verify_signature(&key.public_key(), &parsed, "PUT", PATH).unwrap();
    check_timestamp(&parsed, NOW_MS).unwrap();
}

#[test]
fn method_case_does_not_matter() {
    let (key, request) = signed();
    verify_signature(&key.public_key(), &request, "put", PATH).unwrap();
}

#[test]
fn nonces_are_fresh_per_request() {
    let key = key(1);
    let a = sign_request(&key, 1, "GET", "/v1/task", b"", NOW_MS);
    let b = sign_request(&key, 1, "GET", "/v1/task", b"", NOW_MS);
    assert_ne!(a.nonce, b.nonce);
    assert_ne!(a.signature, b.signature);
}

#[test]
fn empty_body_digest_is_sha256_of_nothing() {
    let request = sign_request(&key(1), 1, "GET", "/v1/task", b"", NOW_MS);
    assert_eq!(
        request.content_sha256,
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    );
}

#[test]
fn sign_with_digest_matches_sign_with_body() {
    let key = key(3);
    let digest = sha256_hex(b"body");
    let request =
        sign_request_with_digest(&key, 5, "POST", "/v1/x", &digest.to_uppercase(), NOW_MS);
    assert_eq!(request.content_sha256, digest);
    verify_signature(&key.public_key(), &request, "POST", "/v1/x").unwrap();
    // The lowercased digest must round-trip through header parsing.
    parse(&header_map(&request)).unwrap();
}

fn assert_bad_signature(result: Result<(), AuthError>) {
    match result {
        Err(AuthError::BadSignature) => {}
        other => panic!("expected BadSignature, got {other:?}"),
    }
}

#[test]
fn changing_any_signed_input_breaks_verification() {
    let (key, request) = signed();
    let public = key.public_key();

    assert_bad_signature(verify_signature(&public, &request, "POST", PATH));
    assert_bad_signature(verify_signature(
        &public,
        &request,
        "PUT",
        "/v1/rounds/8/update?attempt=1",
    ));
    assert_bad_signature(verify_signature(
        &public,
        &request,
        "PUT",
        "/v1/rounds/7/update",
    ));

    let mut tampered = request.clone();
    tampered.device_id += 1;
    assert_bad_signature(verify_signature(&public, &tampered, "PUT", PATH));

    let mut tampered = request.clone();
    tampered.timestamp_ms += 1;
    assert_bad_signature(verify_signature(&public, &tampered, "PUT", PATH));

    let mut tampered = request.clone();
    tampered.nonce = "0".repeat(32);
    assert_bad_signature(verify_signature(&public, &tampered, "PUT", PATH));

    let mut tampered = request.clone();
    tampered.content_sha256 = sha256_hex(b"other bytes");
    assert_bad_signature(verify_signature(&public, &tampered, "PUT", PATH));

    // Flip one bit of the signature itself.
    let mut tampered = request.clone();
    let mut bytes = hex::decode(&tampered.signature).unwrap();
    bytes[10] ^= 0x01;
    tampered.signature = hex::encode(bytes);
    assert_bad_signature(verify_signature(&public, &tampered, "PUT", PATH));
}

#[test]
fn signature_from_another_key_fails() {
    let (_, request) = signed();
    assert_bad_signature(verify_signature(
        &key(8).public_key(),
        &request,
        "PUT",
        PATH,
    ));
}

#[test]
fn bad_signature_message_names_the_cause() {
    assert_eq!(
        AuthError::BadSignature.to_string(),
        "signature does not match the device's public key"
    );
}

#[test]
fn every_missing_header_is_named() {
    let (_, request) = signed();
    for name in [
        HEADER_DEVICE,
        HEADER_TIMESTAMP,
        HEADER_NONCE,
        HEADER_CONTENT_SHA256,
        HEADER_SIGNATURE,
    ] {
        let mut map = header_map(&request);
        map.remove(name);
        match parse(&map) {
            Err(AuthError::MissingHeader { header }) => assert_eq!(header, name),
            other => panic!("removing {name}: expected MissingHeader, got {other:?}"),
        }
    }
    let mut map = header_map(&request);
    map.remove(HEADER_NONCE);
    assert_eq!(
        parse(&map).unwrap_err().to_string(),
        "header `x-canopy-nonce` is missing"
    );
}

#[test]
fn malformed_headers_are_named() {
    let (_, request) = signed();
    let long_digits = "9".repeat(25);
    let upper_nonce = request.nonce.to_uppercase();
    let short_sig = request.signature[..126].to_string();
    let cases: Vec<(&'static str, &str)> = vec![
        (HEADER_DEVICE, "0"),
        (HEADER_DEVICE, "-3"),
        (HEADER_DEVICE, "+3"),
        (HEADER_DEVICE, "abc"),
        (HEADER_DEVICE, ""),
        (HEADER_DEVICE, "9223372036854775808"), // i64::MAX + 1
        (HEADER_TIMESTAMP, "12.5"),
        (HEADER_TIMESTAMP, " 12"),
        (HEADER_TIMESTAMP, &long_digits),
        (HEADER_TIMESTAMP, "18446744073709551616"), // u64::MAX + 1
        (HEADER_NONCE, "abcd"),
        (HEADER_NONCE, &upper_nonce),
        (HEADER_NONCE, "zz000000000000000000000000000000"),
        (HEADER_CONTENT_SHA256, "00"),
        (HEADER_SIGNATURE, &short_sig),
    ];
    for (name, value) in cases {
        let mut map = header_map(&request);
        map.insert(name, value.to_string());
        match parse(&map) {
            Err(AuthError::MalformedHeader { header, .. }) => {
                assert_eq!(header, name, "value {value:?}")
            }
            other => panic!("{name}={value:?}: expected MalformedHeader, got {other:?}"),
        }
        assert!(
            parse(&map).unwrap_err().to_string().contains(name),
            "message should name {name}"
        );
    }
}

#[test]
fn largest_device_id_parses() {
    let (_, request) = signed();
    let mut map = header_map(&request);
    map.insert(HEADER_DEVICE, i64::MAX.to_string());
    assert_eq!(parse(&map).unwrap().device_id, i64::MAX);
}

#[test]
fn clock_skew_is_bounded_both_ways() {
    let (_, request) = signed();
    check_timestamp(&request, NOW_MS + MAX_CLOCK_SKEW_MS).unwrap();
    check_timestamp(&request, NOW_MS - MAX_CLOCK_SKEW_MS).unwrap();
    for now in [
        NOW_MS + MAX_CLOCK_SKEW_MS + 1,
        NOW_MS - MAX_CLOCK_SKEW_MS - 1,
    ] {
        match check_timestamp(&request, now) {
            Err(AuthError::ClockSkew {
                timestamp_ms,
                now_ms,
                max_skew_ms,
            }) => {
                assert_eq!(timestamp_ms, NOW_MS);
                assert_eq!(now_ms, now);
                assert_eq!(max_skew_ms, MAX_CLOCK_SKEW_MS);
            }
            other => panic!("expected ClockSkew, got {other:?}"),
        }
    }
    // Extremes must not overflow.
    check_timestamp(&request, 0).unwrap_err();
    check_timestamp(&request, u64::MAX).unwrap_err();
}

#[test]
fn clock_skew_message() {
    let mut request = signed().1;
    request.timestamp_ms = 123;
    let message = check_timestamp(&request, 400_123).unwrap_err().to_string();
    assert_eq!(
        message,
        "request timestamp 123 is 400000 ms away from the server clock (limit 300000 ms); check the device's clock"
    );
}

#[test]
fn canonical_request_layout() {
    let bytes = canonical_request("get", "/v1/task?x=1", 9, 1000, "ab", "cd");
    assert_eq!(
        String::from_utf8(bytes).unwrap(),
        "canopy-device-request-v1\nGET\n/v1/task?x=1\n9\n1000\nab\ncd\n"
    );
}

#[test]
fn public_key_hex_roundtrip_and_rejections() {
    let key = key(11);
    assert_eq!(
        parse_public_key_hex(&key.public_key_hex()).unwrap(),
        key.public_key()
    );

    for bad in [
        "",
        "00",
        &"g".repeat(64),
        &format!("{}00", key.public_key_hex()),
    ] {
        assert!(
            matches!(
                parse_public_key_hex(bad),
                Err(AuthError::BadPublicKey { .. })
            ),
            "{bad:?}"
        );
    }
    // y = 2 is not the y coordinate of any point on the curve.
    let mut not_on_curve = [0u8; 32];
    not_on_curve[0] = 2;
    assert!(matches!(
        parse_public_key_hex(&hex::encode(not_on_curve)),
        Err(AuthError::BadPublicKey { .. })
    ));
    // The identity point decodes but has small order.
    let mut identity = [0u8; 32];
    identity[0] = 1;
    assert!(matches!(
        parse_public_key_hex(&hex::encode(identity)),
        Err(AuthError::BadPublicKey { .. })
    ));
}

#[test]
fn device_key_bytes_roundtrip_and_debug_hides_secret() {
    let generated = DeviceKey::generate();
    let restored = DeviceKey::from_bytes(&generated.to_bytes());
    assert_eq!(restored.public_key(), generated.public_key());
    assert_ne!(DeviceKey::generate().public_key(), generated.public_key());

    let debug = format!("{generated:?}");
    assert!(debug.contains(&generated.public_key_hex()));
    assert!(!debug.contains(&hex::encode(generated.to_bytes())));
    let secret_bytes = format!("{:?}", generated.to_bytes());
    assert!(!debug.contains(&secret_bytes));
}

#[test]
fn sha256_hex_known_vector() {
    assert_eq!(
        sha256_hex(b"abc"),
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    );
}
