use canopy_protocol::update::*;
use proptest::prelude::*;

fn spec(name: &str, shape: &[usize]) -> TensorSpec {
    TensorSpec {
        name: name.to_string(),
        shape: shape.to_vec(),
    }
}

fn layout() -> UpdateLayout {
    UpdateLayout::new(vec![
        spec("params/fc1.w", &[2, 3]),
        spec("params/fc1.b", &[4]),
        spec("scale", &[]),
    ])
    .unwrap()
}

fn values() -> Vec<f32> {
    // Values whose bit patterns survive only an exact roundtrip.
    vec![
        0.1,
        -0.0,
        1e-38,
        -3.5,
        7.25e9,
        f32::MIN_POSITIVE,
        1.0,
        2.0,
        f32::MAX,
        f32::MIN,
        0.3,
    ]
}

fn encoded() -> Vec<u8> {
    encode_update(&layout(), 17, &values()).unwrap()
}

// Byte offsets in `encoded()`.
const TENSOR_COUNT_AT: usize = 20;
const FIRST_DTYPE_AT: usize = 24 + 2 + "params/fc1.w".len();

fn data_offset(element: usize) -> usize {
    layout().header_len() + 4 * element
}

#[test]
fn roundtrip_is_bit_exact() {
    let bytes = encoded();
    let decoded = decode_update(&bytes, &layout()).unwrap();
    assert_eq!(decoded.num_samples, 17);
    let original: Vec<u32> = values().iter().map(|v| v.to_bits()).collect();
    let back: Vec<u32> = decoded.values.iter().map(|v| v.to_bits()).collect();
    assert_eq!(back, original);
}

#[test]
fn encoding_starts_with_documented_header() {
    let bytes = encoded();
    assert_eq!(&bytes[..8], b"CANOPYUP");
    assert_eq!(&bytes[8..10], &1u16.to_le_bytes());
    assert_eq!(&bytes[10..12], &[0, 0]);
    assert_eq!(&bytes[12..20], &17u64.to_le_bytes());
    assert_eq!(&bytes[20..24], &3u32.to_le_bytes());
    assert_eq!(&bytes[24..26], &12u16.to_le_bytes());
    assert_eq!(&bytes[26..38], b"params/fc1.w");
    assert_eq!(bytes[38], 1, "dtype f32");
    assert_eq!(bytes[39], 2, "rank");
    assert_eq!(&bytes[40..48], &2u64.to_le_bytes());
    assert_eq!(&bytes[48..56], &3u64.to_le_bytes());
    let data = layout().header_len();
    assert_eq!(&bytes[data..data + 4], &0.1f32.to_le_bytes());
}

#[test]
fn encoded_len_is_exact() {
    let layout = layout();
    assert_eq!(layout.num_elements(), 11);
    assert_eq!(encoded().len() as u64, layout.encoded_len());
    assert_eq!(layout.encoded_len(), layout.header_len() as u64 + 44);

    let empty = UpdateLayout::new(vec![]).unwrap();
    let bytes = encode_update(&empty, 1, &[]).unwrap();
    assert_eq!(bytes.len() as u64, empty.encoded_len());
    assert_eq!(
        decode_update(&bytes, &empty).unwrap().values,
        Vec::<f32>::new()
    );
}

#[test]
fn every_truncation_is_an_error() {
    let bytes = encoded();
    for len in 0..bytes.len() {
        let err = decode_update(&bytes[..len], &layout()).unwrap_err();
        assert!(
            matches!(err, UpdateError::Truncated { len: l, .. } if l == len),
            "truncated to {len}: {err:?}"
        );
        assert!(!err.is_content_error());
    }
}

#[test]
fn trailing_byte_is_rejected() {
    let mut bytes = encoded();
    bytes.push(0);
    assert!(matches!(
        decode_update(&bytes, &layout()),
        Err(UpdateError::TrailingBytes { extra: 1 })
    ));
}

#[test]
fn wrong_magic_version_and_reserved_are_rejected() {
    let mut bytes = encoded();
    bytes[0] = b'X';
    assert!(matches!(
        decode_update(&bytes, &layout()),
        Err(UpdateError::BadMagic)
    ));

    let mut bytes = encoded();
    bytes[8..10].copy_from_slice(&2u16.to_le_bytes());
    assert!(matches!(
        decode_update(&bytes, &layout()),
        Err(UpdateError::UnsupportedVersion { version: 2 })
    ));

    let mut bytes = encoded();
    bytes[10] = 1;
    let err = decode_update(&bytes, &layout()).unwrap_err();
    assert!(matches!(err, UpdateError::Reserved { value: 1 }));
    assert!(!err.is_content_error());
}

#[test]
fn sample_count_bounds() {
    for bad in [0, MAX_SAMPLES + 1, u64::MAX] {
        let mut bytes = encoded();
        bytes[12..20].copy_from_slice(&bad.to_le_bytes());
        assert!(matches!(
            decode_update(&bytes, &layout()),
            Err(UpdateError::SampleCount { num_samples }) if num_samples == bad
        ));
        assert!(matches!(
            encode_update(&layout(), bad, &values()),
            Err(UpdateError::SampleCount { .. })
        ));
    }
    let mut bytes = encoded();
    bytes[12..20].copy_from_slice(&MAX_SAMPLES.to_le_bytes());
    assert_eq!(
        decode_update(&bytes, &layout()).unwrap().num_samples,
        MAX_SAMPLES
    );
}

#[test]
fn wrong_tensor_count_is_rejected() {
    for count in [2u32, 4, u32::MAX] {
        let mut bytes = encoded();
        bytes[TENSOR_COUNT_AT..TENSOR_COUNT_AT + 4].copy_from_slice(&count.to_le_bytes());
        let err = decode_update(&bytes, &layout()).unwrap_err();
        assert!(
            matches!(err, UpdateError::TensorCount { expected: 3, got } if got == count as usize),
            "{err:?}"
        );
        assert!(err.is_content_error());
    }
}

#[test]
fn wrong_name_is_rejected_with_both_names() {
    let sent = UpdateLayout::new(vec![
        spec("params/fc1.w", &[2, 3]),
        spec("params/fc2.b", &[4]),
        spec("scale", &[]),
    ])
    .unwrap();
    let bytes = encode_update(&sent, 1, &values()).unwrap();
    let err = decode_update(&bytes, &layout()).unwrap_err();
    match &err {
        UpdateError::Name {
            index,
            expected,
            got,
        } => {
            assert_eq!(*index, 1);
            assert_eq!(expected, "params/fc1.b");
            assert_eq!(got, "params/fc2.b");
        }
        other => panic!("expected Name, got {other:?}"),
    }
    assert_eq!(
        err.to_string(),
        "update tensor 1 is named `params/fc2.b`, expected `params/fc1.b`"
    );
}

#[test]
fn wrong_dtype_is_rejected() {
    let mut bytes = encoded();
    assert_eq!(bytes[FIRST_DTYPE_AT], 1);
    bytes[FIRST_DTYPE_AT] = 3;
    let err = decode_update(&bytes, &layout()).unwrap_err();
    assert!(
        matches!(&err, UpdateError::DType { name, code: 3 } if name == "params/fc1.w"),
        "{err:?}"
    );
    assert!(err.to_string().contains("params/fc1.w"));
}

#[test]
fn transposed_shape_is_rejected() {
    let expected = UpdateLayout::new(vec![spec("params/fc1.w", &[784, 128])]).unwrap();
    let sent = UpdateLayout::new(vec![spec("params/fc1.w", &[128, 784])]).unwrap();
    let bytes = encode_update(&sent, 3, &vec![0.5; 784 * 128]).unwrap();
    let err = decode_update(&bytes, &expected).unwrap_err();
    assert!(matches!(err, UpdateError::Shape { .. }), "{err:?}");
    assert!(err.is_content_error());
    assert_eq!(
        err.to_string(),
        "tensor `params/fc1.w` has shape [128, 784], expected [784, 128]"
    );
}

#[test]
fn huge_declared_rank_is_a_shape_error_not_an_allocation() {
    let mut bytes = encoded();
    bytes[FIRST_DTYPE_AT + 1] = 255;
    let err = decode_update(&bytes, &layout()).unwrap_err();
    assert!(
        matches!(
            err,
            UpdateError::Shape { .. } | UpdateError::Truncated { .. }
        ),
        "{err:?}"
    );
}

#[test]
fn non_finite_values_are_rejected_with_name_and_index() {
    for (value, word) in [
        (f32::NAN, "NaN"),
        (f32::INFINITY, "+inf"),
        (f32::NEG_INFINITY, "-inf"),
    ] {
        let mut bytes = encoded();
        let at = data_offset(6 + 3); // params/fc1.b element 3
        bytes[at..at + 4].copy_from_slice(&value.to_le_bytes());
        let err = decode_update(&bytes, &layout()).unwrap_err();
        match &err {
            UpdateError::NonFinite { name, index, .. } => {
                assert_eq!(name, "params/fc1.b");
                assert_eq!(*index, 3);
            }
            other => panic!("expected NonFinite, got {other:?}"),
        }
        assert_eq!(
            err.to_string(),
            format!("tensor `params/fc1.b` element 3 is {word}; updates must be finite")
        );
    }
}

#[test]
fn encoder_refuses_non_finite_and_wrong_value_count() {
    let mut bad = values();
    bad[0] = f32::NAN;
    assert!(matches!(
        encode_update(&layout(), 1, &bad),
        Err(UpdateError::NonFinite { ref name, index: 0, .. }) if name == "params/fc1.w"
    ));
    assert!(matches!(
        encode_update(&layout(), 1, &values()[..10]),
        Err(UpdateError::ValueCount {
            expected: 11,
            got: 10
        })
    ));
}

#[test]
fn layout_limits() {
    assert!(UpdateLayout::new(vec![spec("a", &[1]), spec("a", &[2])]).is_err());
    assert!(UpdateLayout::new(vec![spec("", &[1])]).is_err());
    assert!(UpdateLayout::new(vec![spec(&"n".repeat(MAX_NAME_BYTES), &[1])]).is_ok());
    assert!(UpdateLayout::new(vec![spec(&"n".repeat(MAX_NAME_BYTES + 1), &[1])]).is_err());
    assert!(UpdateLayout::new(vec![spec("r", &[1; MAX_RANK])]).is_ok());
    assert!(UpdateLayout::new(vec![spec("r", &[1; MAX_RANK + 1])]).is_err());
    assert!(UpdateLayout::new(vec![spec("big", &[usize::MAX, 2])]).is_err());
    assert!(UpdateLayout::new(vec![spec("big", &[MAX_ELEMENTS + 1])]).is_err());
    assert!(
        UpdateLayout::new(vec![
            spec("a", &[MAX_ELEMENTS / 2 + 1]),
            spec("b", &[MAX_ELEMENTS / 2])
        ])
        .is_err()
    );
    let many: Vec<_> = (0..=MAX_TENSORS)
        .map(|i| spec(&format!("t{i}"), &[1]))
        .collect();
    assert!(UpdateLayout::new(many[..MAX_TENSORS].to_vec()).is_ok());
    let err = UpdateLayout::new(many).unwrap_err();
    assert!(matches!(err, UpdateError::Layout { .. }));

    // Layouts built field by field are checked when used.
    let unchecked = UpdateLayout {
        tensors: vec![spec("x", &[1]), spec("x", &[1])],
    };
    assert!(matches!(
        encode_update(&unchecked, 1, &[0.0, 0.0]),
        Err(UpdateError::Layout { .. })
    ));
    assert!(matches!(
        decode_update(&encoded(), &unchecked),
        Err(UpdateError::Layout { .. })
    ));
}

#[test]
fn layout_json_roundtrips_and_is_validated_on_deserialize() {
    let json = serde_json::to_string(&layout()).unwrap();
    assert_eq!(
        json,
        r#"{"tensors":[{"name":"params/fc1.w","shape":[2,3]},{"name":"params/fc1.b","shape":[4]},{"name":"scale","shape":[]}]}"#
    );
    let back: UpdateLayout = serde_json::from_str(&json).unwrap();
    assert_eq!(back, layout());

    let duplicate = r#"{"tensors":[{"name":"a","shape":[1]},{"name":"a","shape":[1]}]}"#;
    let err = serde_json::from_str::<UpdateLayout>(duplicate).unwrap_err();
    assert!(err.to_string().contains("appears more than once"), "{err}");
}

#[test]
fn tensor_spec_num_elements() {
    assert_eq!(spec("s", &[]).num_elements(), 1);
    assert_eq!(spec("m", &[3, 4, 5]).num_elements(), 60);
    assert_eq!(spec("z", &[3, 0]).num_elements(), 0);
    assert_eq!(spec("o", &[usize::MAX, 2]).num_elements(), usize::MAX);
}

/// A layout with one large tensor (int8 at the default threshold) and a
/// small one (f32).
fn int8_layout() -> UpdateLayout {
    UpdateLayout::new(vec![spec("w", &[100, 300]), spec("b", &[10])]).unwrap()
}

fn int8_values() -> Vec<f32> {
    (0..30_010)
        .map(|i| ((i as f32) * 0.37).sin() * (1.0 + (i % 7) as f32))
        .collect()
}

fn int8_encoded(seed: u64) -> Vec<u8> {
    use rand::SeedableRng;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    encode_update_int8(&int8_layout(), 5, &int8_values(), 20_000, &mut rng).unwrap()
}

#[test]
fn int8_is_a_quarter_of_f32_and_each_value_within_one_level() {
    let values = int8_values();
    let bytes = int8_encoded(1);
    let f32_len = encode_update(&int8_layout(), 5, &values).unwrap().len();
    let expected = int8_layout().header_len() + int8_data_len(30_000) + 10 * 4;
    assert_eq!(bytes.len(), expected);
    let ratio = bytes.len() as f64 / f32_len as f64;
    assert!((0.25..0.26).contains(&ratio), "{ratio}");
    let decoded = decode_update(&bytes, &int8_layout()).unwrap();
    assert_eq!(decoded.num_samples, 5);
    // The f32 tensor is exact; each int8 value is within one level of its
    // block's scale.
    assert_eq!(&decoded.values[30_000..], &values[30_000..]);
    for (block, chunk) in values[..30_000].chunks(INT8_BLOCK_VALUES).enumerate() {
        let scale = chunk.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 127.0;
        let start = block * INT8_BLOCK_VALUES;
        for (i, v) in chunk.iter().enumerate() {
            let got = decoded.values[start + i];
            assert!((got - v).abs() <= scale * 1.0001, "{v} became {got}");
        }
    }
}

/// Stochastic rounding is unbiased: the mean of many encodings of the same
/// values converges on them. One draw errs by at most half a level in
/// standard deviation, so a mean of 400 by a 40th of one; the bound, over
/// 30,000 values, is 6 of those, and the bias of rounding to the nearest
/// level instead would be 20.
#[test]
fn int8_rounding_is_unbiased() {
    let values = int8_values();
    let draws = 400;
    let mut mean = vec![0.0f64; values.len()];
    for seed in 0..draws {
        let decoded = decode_update(&int8_encoded(seed), &int8_layout()).unwrap();
        for (total, v) in mean.iter_mut().zip(&decoded.values) {
            *total += f64::from(*v) / draws as f64;
        }
    }
    let largest = 7.0f64;
    let level = largest / 127.0;
    let worst = values
        .iter()
        .zip(&mean)
        .map(|(v, m)| (f64::from(*v) - m).abs())
        .fold(0.0, f64::max);
    assert!(worst < 6.0 * 0.5 * level / 20.0, "{worst} vs level {level}");
    // And the rounding is random: two seeds differ.
    assert_ne!(int8_encoded(1), int8_encoded(2));
}

#[test]
fn hostile_int8_blocks_are_refused_by_name() {
    let offset = int8_layout().header_len();
    let mut bytes = int8_encoded(1);
    bytes[offset..offset + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    let err = decode_update(&bytes, &int8_layout()).unwrap_err();
    assert!(
        matches!(&err, UpdateError::Int8Scale { name, block: 0, .. } if name == "w"),
        "{err:?}"
    );
    let mut bytes = int8_encoded(1);
    bytes[offset..offset + 4].copy_from_slice(&(-1.0f32).to_le_bytes());
    assert!(matches!(
        decode_update(&bytes, &int8_layout()),
        Err(UpdateError::Int8Scale { .. })
    ));
    let mut bytes = int8_encoded(1);
    bytes[offset + 4 + 3] = 0x80;
    let err = decode_update(&bytes, &int8_layout()).unwrap_err();
    assert!(
        matches!(&err, UpdateError::Int8Level { name, index: 3 } if name == "w"),
        "{err:?}"
    );
    let bytes = int8_encoded(1);
    for cut in [offset + 2, offset + 100, bytes.len() - 1] {
        assert!(decode_update(&bytes[..cut], &int8_layout()).is_err());
    }
    // A zero block is all zeros, whatever the rounding.
    use rand::SeedableRng;
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let zeros = vec![0.0f32; 30_010];
    let encoded = encode_update_int8(&int8_layout(), 1, &zeros, 1, &mut rng).unwrap();
    let decoded = decode_update(&encoded, &int8_layout()).unwrap();
    assert!(decoded.values.iter().all(|v| *v == 0.0));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode_update(&bytes, &layout());
    }

    // Random tails after a valid prefix reach the per-tensor and data checks,
    // which fully random bytes almost never do.
    #[test]
    fn valid_prefix_with_random_tail_never_panics(
        cut in 0usize..120,
        tail in proptest::collection::vec(any::<u8>(), 0..200),
    ) {
        let mut bytes = encoded();
        bytes.truncate(cut.min(bytes.len()));
        bytes.extend_from_slice(&tail);
        let _ = decode_update(&bytes, &layout());
    }

    #[test]
    fn single_byte_corruption_never_panics_or_passes_silently(
        at in 0usize..100,
        xor in 1u8..=255,
    ) {
        let mut bytes = encoded();
        let at = at % bytes.len();
        bytes[at] ^= xor;
        // Only a change in the data region or the sample count can still
        // decode; the header must match exactly.
        if let Ok(decoded) = decode_update(&bytes, &layout()) {
            prop_assert!(
                at >= layout().header_len() || (12..20).contains(&at),
                "corruption at {} decoded to {:?}", at, decoded
            );
        }
    }

    #[test]
    fn roundtrip_random_values(
        samples in 1u64..=MAX_SAMPLES,
        raw in proptest::collection::vec(any::<f32>().prop_filter("finite", |v| v.is_finite()), 11),
    ) {
        let bytes = encode_update(&layout(), samples, &raw).unwrap();
        prop_assert_eq!(bytes.len() as u64, layout().encoded_len());
        let decoded = decode_update(&bytes, &layout()).unwrap();
        prop_assert_eq!(decoded.num_samples, samples);
        let a: Vec<u32> = raw.iter().map(|v| v.to_bits()).collect();
        let b: Vec<u32> = decoded.values.iter().map(|v| v.to_bits()).collect();
        prop_assert_eq!(a, b);
    }
}

#[test]
fn clipping_scales_a_long_update_to_the_norm_and_leaves_a_short_one() {
    use canopy_protocol::update::{clip_scale, clip_to_norm, l2_norm};
    // 3-4-12 has norm 13.
    let mut long = vec![3.0f32, -4.0, 12.0];
    assert_eq!(clip_to_norm(&mut long, 6.5), 13.0);
    assert_eq!(long, vec![1.5, -2.0, 6.0]);
    assert!((l2_norm(&long) - 6.5).abs() < 1e-6);
    let mut short = vec![0.3f32, -0.4];
    assert!((clip_to_norm(&mut short, 1.0) - 0.5).abs() < 1e-7);
    assert_eq!(short, vec![0.3, -0.4]);
    // A zero update is left alone, not divided by its zero norm.
    assert_eq!(clip_scale(0.0, 1.0), 1.0);
    let mut zero = vec![0.0f32; 4];
    assert_eq!(clip_to_norm(&mut zero, 1.0), 0.0);
    assert_eq!(zero, vec![0.0; 4]);
}
