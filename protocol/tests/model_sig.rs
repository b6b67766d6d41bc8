use canopy_protocol::model_sig::*;

const DIGEST: &str = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";

#[test]
fn sign_then_verify() {
    let key = ServerKey::from_bytes(&[5; 32]);
    let signature = key.sign_model(DIGEST);
    assert_eq!(signature.len(), 128);
    verify_model_signature(&key.public_key(), DIGEST, &signature).unwrap();
    // Upper-case digests name the same model.
    verify_model_signature(&key.public_key(), &DIGEST.to_uppercase(), &signature).unwrap();
    // Ed25519 is deterministic, so the published signature is stable.
    assert_eq!(key.sign_model(DIGEST), signature);
}

#[test]
fn tampered_digest_or_signature_fails() {
    let key = ServerKey::from_bytes(&[5; 32]);
    let signature = key.sign_model(DIGEST);

    let other_digest = format!("0{}", &DIGEST[1..]);
    match verify_model_signature(&key.public_key(), &other_digest, &signature) {
        Err(ModelSignatureError::Mismatch { digest }) => assert_eq!(digest, other_digest),
        other => panic!("expected Mismatch, got {other:?}"),
    }

    let mut bytes = hex::decode(&signature).unwrap();
    bytes[0] ^= 0x80;
    let err = verify_model_signature(&key.public_key(), DIGEST, &hex::encode(bytes)).unwrap_err();
    assert!(
        matches!(err, ModelSignatureError::Mismatch { .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains(DIGEST));

    let other_server = ServerKey::from_bytes(&[6; 32]);
    assert!(matches!(
        verify_model_signature(&other_server.public_key(), DIGEST, &signature),
        Err(ModelSignatureError::Mismatch { .. })
    ));
}

#[test]
fn device_request_signature_is_not_a_model_signature() {
    // Same key bytes for both roles: the domain prefix must still keep the
    // two kinds of signature apart.
    let server = ServerKey::from_bytes(&[9; 32]);
    let device = canopy_protocol::auth::DeviceKey::from_bytes(&[9; 32]);
    let request =
        canopy_protocol::auth::sign_request_with_digest(&device, 1, "GET", "/", DIGEST, 1);
    assert!(verify_model_signature(&server.public_key(), DIGEST, &request.signature).is_err());
}

#[test]
fn malformed_inputs_are_reported_as_malformed() {
    let key = ServerKey::from_bytes(&[5; 32]);
    let signature = key.sign_model(DIGEST);
    for (digest, sig) in [
        ("abc", signature.as_str()),
        (&"x".repeat(64), signature.as_str()),
        (DIGEST, "00"),
        (DIGEST, &"q".repeat(128)),
    ] {
        assert!(
            matches!(
                verify_model_signature(&key.public_key(), digest, sig),
                Err(ModelSignatureError::Malformed { .. })
            ),
            "{digest:?} {sig:?}"
        );
    }
    let mut identity = [0u8; 32];
    identity[0] = 1;
    assert!(matches!(
        verify_model_signature(&identity, DIGEST, &signature),
        Err(ModelSignatureError::Malformed { .. })
    ));
}

#[test]
fn server_key_roundtrip_and_debug_hides_secret() {
    let key = ServerKey::generate();
    assert_eq!(
        ServerKey::from_bytes(&key.to_bytes()).public_key(),
        key.public_key()
    );
    assert_eq!(key.public_key_hex(), hex::encode(key.public_key()));
    let debug = format!("{key:?}");
    assert!(debug.contains(&key.public_key_hex()));
    assert!(!debug.contains(&hex::encode(key.to_bytes())));
}
