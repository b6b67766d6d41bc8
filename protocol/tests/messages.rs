use std::collections::BTreeMap;

use canopy_protocol::messages::*;
use canopy_protocol::update::{TensorSpec, UpdateLayout};

fn capabilities() -> Capabilities {
    Capabilities {
        tier: Tier::Edge,
        backends: vec!["cpu".into(), "cuda_12-x".into()],
        memory_mb: 8192,
        os: "linux-aarch64 6.1".into(),
        tags: BTreeMap::from([("site.zone-1".to_string(), "north".to_string())]),
        gpu: None,
    }
}

fn with_gpu() -> Capabilities {
    Capabilities {
        backends: vec!["cpu".into(), "gpu".into()],
        gpu: Some(GpuAdapter {
            name: "llvmpipe (LLVM 15.0.6, 256 bits)".into(),
            api: GpuApi::Vulkan,
            device_type: GpuDeviceType::Cpu,
            driver: "llvmpipe Mesa 22.3.6".into(),
        }),
        ..capabilities()
    }
}

#[test]
fn a_gpu_adapter_is_reported_checked_and_sent_by_name() {
    let caps = with_gpu();
    caps.validate().unwrap();
    let json = serde_json::to_value(&caps).unwrap();
    assert_eq!(json["gpu"]["api"], "vulkan");
    assert_eq!(json["gpu"]["device_type"], "cpu");
    assert_eq!(serde_json::from_value::<Capabilities>(json).unwrap(), caps);
    // Without one, the field is left out, and an older body still parses.
    let json = serde_json::to_value(capabilities()).unwrap();
    assert!(json.get("gpu").is_none(), "{json}");

    let mut caps = with_gpu();
    caps.backends = vec!["cpu".into()];
    assert_invalid(&caps, "does not offer `gpu`");
    let mut caps = with_gpu();
    caps.gpu.as_mut().unwrap().name = String::new();
    assert_invalid(&caps, "capabilities.gpu.name is 0 characters");
    let mut caps = with_gpu();
    caps.gpu.as_mut().unwrap().name = "n".repeat(MAX_ADAPTER_NAME_CHARS + 1);
    assert_invalid(&caps, "capabilities.gpu.name is 129 characters");
    let mut caps = with_gpu();
    caps.gpu.as_mut().unwrap().driver = "ok\nFORGED LOG LINE".into();
    assert_invalid(&caps, "capabilities.gpu.driver contains control characters");
    let mut caps = with_gpu();
    caps.gpu.as_mut().unwrap().name = "n".repeat(MAX_ADAPTER_NAME_CHARS);
    caps.gpu.as_mut().unwrap().driver = "d".repeat(MAX_ADAPTER_DRIVER_CHARS);
    caps.validate().unwrap();
}

#[test]
fn adapter_apis_and_types_parse_only_their_names() {
    for api in GpuApi::ALL {
        assert_eq!(api.as_str().parse::<GpuApi>().unwrap(), *api);
        assert_eq!(serde_json::to_string(api).unwrap(), format!("\"{api}\""));
    }
    for kind in GpuDeviceType::ALL {
        assert_eq!(kind.as_str().parse::<GpuDeviceType>().unwrap(), *kind);
    }
    let error = "opencl".parse::<GpuApi>().unwrap_err();
    assert_eq!(
        error,
        "graphics API `opencl` is unknown; expected one of vulkan, metal, dx12, gl"
    );
    let body = r#"{"name": "x", "api": "glide", "device_type": "discrete"}"#;
    assert!(serde_json::from_str::<GpuAdapter>(body).is_err());
}

fn assert_invalid(caps: &Capabilities, fragment: &str) {
    let err = caps.validate().unwrap_err();
    assert!(err.contains(fragment), "expected {fragment:?} in {err:?}");
}

#[test]
fn tier_text_forms() {
    assert_eq!("end".parse::<Tier>().unwrap(), Tier::End);
    assert_eq!("edge".parse::<Tier>().unwrap(), Tier::Edge);
    assert_eq!(Tier::Edge.to_string(), "edge");
    assert_eq!(serde_json::to_string(&Tier::End).unwrap(), r#""end""#);
    let err = "Edge".parse::<Tier>().unwrap_err();
    assert_eq!(
        err.to_string(),
        "device tier `Edge` is unknown; expected `end` or `edge`"
    );
    assert!(serde_json::from_str::<Tier>(r#""cloud""#).is_err());
}

#[test]
fn valid_capabilities_pass_and_limits_hold_at_the_edge() {
    capabilities().validate().unwrap();

    let mut caps = capabilities();
    caps.backends = (0..MAX_BACKENDS).map(|i| format!("b{i}")).collect();
    caps.backends[0] = "a".repeat(MAX_BACKEND_CHARS);
    caps.os = "o".repeat(MAX_OS_CHARS);
    caps.memory_mb = MAX_MEMORY_MB;
    caps.tags = (0..MAX_TAGS)
        .map(|i| (format!("k{i}"), "v".repeat(MAX_TAG_VALUE_CHARS)))
        .collect();
    caps.tags
        .insert("K".repeat(MAX_TAG_KEY_CHARS), String::new());
    caps.tags.remove("k0");
    caps.validate().unwrap();
}

#[test]
fn capabilities_limits_are_enforced() {
    let mut caps = capabilities();
    caps.backends = (0..=MAX_BACKENDS).map(|i| format!("b{i}")).collect();
    assert_invalid(&caps, "capabilities.backends has 9 entries");

    for bad in ["", "CUDA", "gpu!", &"a".repeat(MAX_BACKEND_CHARS + 1)] {
        let mut caps = capabilities();
        caps.backends.push(bad.to_string());
        assert_invalid(&caps, "capabilities.backends[2]");
    }

    let mut caps = capabilities();
    caps.memory_mb = MAX_MEMORY_MB + 1;
    assert_invalid(&caps, "capabilities.memory_mb");

    let mut caps = capabilities();
    caps.os = "o".repeat(MAX_OS_CHARS + 1);
    assert_invalid(&caps, "capabilities.os");

    let mut caps = capabilities();
    caps.os = "linux\nforged log line".into();
    assert_invalid(&caps, "capabilities.os contains control characters");

    let mut caps = capabilities();
    caps.tags = (0..=MAX_TAGS)
        .map(|i| (format!("k{i}"), String::new()))
        .collect();
    assert_invalid(&caps, "capabilities.tags has 33 entries");

    for bad_key in ["", "has space", "ключ", &"k".repeat(MAX_TAG_KEY_CHARS + 1)] {
        let mut caps = capabilities();
        caps.tags.insert(bad_key.to_string(), "v".into());
        assert_invalid(&caps, "capabilities.tags key");
    }

    let mut caps = capabilities();
    caps.tags
        .insert("k".into(), "v".repeat(MAX_TAG_VALUE_CHARS + 1));
    assert_invalid(&caps, "capabilities.tags[`k`]");
}

#[test]
fn long_offending_values_are_cut_in_messages() {
    let mut caps = capabilities();
    caps.backends.push("X".repeat(10_000));
    let err = caps.validate().unwrap_err();
    assert!(err.len() < 300, "{} bytes", err.len());
}

#[test]
fn requests_reject_unknown_fields_and_default_optionals() {
    let json = r#"{
        "enrollment_token": "tok",
        "public_key": "00",
        "capabilities": {"tier": "end", "backends": ["cpu"], "memory_mb": 512, "os": "android"}
    }"#;
    let request: EnrollRequest = serde_json::from_str(json).unwrap();
    assert_eq!(request.capabilities.tier, Tier::End);
    assert!(request.capabilities.tags.is_empty());

    let extra = json.replace("\"tok\",", "\"tok\", \"admin\": true,");
    assert!(serde_json::from_str::<EnrollRequest>(&extra).is_err());
    let nested_extra = json.replace("\"os\": \"android\"", "\"os\": \"android\", \"gpu\": 1");
    assert!(serde_json::from_str::<EnrollRequest>(&nested_extra).is_err());

    let heartbeat: Heartbeat = serde_json::from_str("{}").unwrap();
    assert_eq!(heartbeat, Heartbeat::default());
    assert!(serde_json::from_str::<Heartbeat>(r#"{"cpu": 3}"#).is_err());

    let metrics: RoundMetrics = serde_json::from_str(r#"{"round_id": 4}"#).unwrap();
    assert_eq!(metrics.train_loss, None);
    assert!(serde_json::from_str::<RoundMetrics>(r#"{"round_id": 4, "loss": 1}"#).is_err());
}

#[test]
fn responses_tolerate_new_fields() {
    let response: HeartbeatResponse = serde_json::from_str(
        r#"{"server_time_ms": 1, "heartbeat_interval_ms": 30000, "added_later": "x"}"#,
    )
    .unwrap();
    assert_eq!(response.heartbeat_interval_ms, 30_000);
}

#[test]
fn round_metrics_validation() {
    let good = RoundMetrics {
        round_id: 3,
        train_loss: Some(0.5),
        eval_loss: Some(0.0),
        eval_accuracy: Some(1.0),
        eval_samples: Some(100),
        train_duration_ms: Some(1234),
    };
    good.validate().unwrap();

    let cases: Vec<(RoundMetrics, &str)> = vec![
        (
            RoundMetrics {
                train_loss: Some(f64::NAN),
                ..good.clone()
            },
            "metrics.train_loss",
        ),
        (
            RoundMetrics {
                eval_loss: Some(-0.1),
                ..good.clone()
            },
            "metrics.eval_loss",
        ),
        (
            RoundMetrics {
                eval_loss: Some(f64::INFINITY),
                ..good.clone()
            },
            "metrics.eval_loss",
        ),
        (
            RoundMetrics {
                eval_accuracy: Some(1.01),
                ..good.clone()
            },
            "metrics.eval_accuracy",
        ),
        (
            RoundMetrics {
                eval_accuracy: Some(-0.01),
                ..good.clone()
            },
            "metrics.eval_accuracy",
        ),
        (
            RoundMetrics {
                eval_accuracy: Some(f64::NAN),
                ..good.clone()
            },
            "metrics.eval_accuracy",
        ),
        (
            RoundMetrics {
                round_id: 0,
                ..good.clone()
            },
            "metrics.round_id",
        ),
        (
            RoundMetrics {
                eval_samples: Some(u64::MAX),
                ..good.clone()
            },
            "metrics.eval_samples",
        ),
    ];
    for (metrics, fragment) in cases {
        let err = metrics.validate().unwrap_err();
        assert!(err.contains(fragment), "expected {fragment:?} in {err:?}");
    }
}

#[test]
fn heartbeat_validation() {
    Heartbeat {
        state: Some("training".into()),
        round_id: Some(2),
        ..Heartbeat::default()
    }
    .validate()
    .unwrap();
    assert!(
        Heartbeat {
            state: Some("s".repeat(MAX_HEARTBEAT_STATE_CHARS + 1)),
            round_id: None,
            ..Heartbeat::default()
        }
        .validate()
        .is_err()
    );
    assert!(
        Heartbeat {
            state: None,
            round_id: Some(-1),
            ..Heartbeat::default()
        }
        .validate()
        .is_err()
    );
}

#[test]
fn task_json_roundtrip_with_layout() {
    let layout = UpdateLayout::new(vec![TensorSpec {
        name: "params/w".into(),
        shape: vec![2, 2],
    }])
    .unwrap();
    let task = Task {
        kind: canopy_protocol::messages::TaskKind::Train,
        dataset: None,
        job_id: 1,
        round_id: 2,
        round_number: 3,
        model_version_id: 4,
        model_digest: "ab".repeat(32),
        model_size_bytes: 1000,
        model_path: "/v1/models/4".into(),
        upload_path: "/v1/rounds/2/update".into(),
        upload_size_bytes: layout.encoded_len(),
        deadline_unix_ms: 1_700_000_000_000,
        training: TrainingConfig {
            epochs: 1,
            batch_size: 32,
            learning_rate: 0.01,
        },
        layout,
        secure_aggregation: None,
        sub_round: None,
        policy: Default::default(),
        privacy: Some(canopy_protocol::messages::TaskPrivacy { clip_norm: 0.5 }),
        compression: Some(canopy_protocol::messages::TaskCompression {
            int8_min_elements: 20_000,
        }),
    };
    let json = serde_json::to_string(&task).unwrap();
    let back: Task = serde_json::from_str(&json).unwrap();
    assert_eq!(back, task);

    // A differentially private task's clip norm is bounded and named.
    for (clip_norm, ok) in [(1.0, true), (0.0, false), (f64::NAN, false), (2e6, false)] {
        let mut task = task.clone();
        task.privacy = Some(canopy_protocol::messages::TaskPrivacy { clip_norm });
        let result = task.validate();
        assert_eq!(result.is_ok(), ok, "{clip_norm}: {result:?}");
        if let Err(error) = result {
            assert_eq!(error.field(), "privacy.clip_norm");
        }
    }

    // A layout that breaks the limits cannot arrive inside a task.
    let value: serde_json::Value = serde_json::from_str(&json).unwrap();
    let mut bad = value.clone();
    bad["layout"]["tensors"][0]["name"] = serde_json::Value::String(String::new());
    assert!(serde_json::from_value::<Task>(bad).is_err());
}

#[test]
fn error_body_shape() {
    let body = ErrorBody::new(
        "bad_signature",
        "signature does not match the device's public key",
    );
    assert_eq!(
        serde_json::to_string(&body).unwrap(),
        r#"{"error":{"code":"bad_signature","message":"signature does not match the device's public key"}}"#
    );
    let receipt = UploadReceipt {
        round_id: 1,
        accepted: true,
        num_samples: 10,
        bytes: 99,
    };
    let back: UploadReceipt =
        serde_json::from_str(&serde_json::to_string(&receipt).unwrap()).unwrap();
    assert_eq!(back, receipt);
    let enroll = EnrollResponse {
        device_id: 5,
        server_public_key: "k".into(),
        heartbeat_interval_ms: 1,
    };
    let back: EnrollResponse =
        serde_json::from_str(&serde_json::to_string(&enroll).unwrap()).unwrap();
    assert_eq!(back, enroll);
}

#[test]
fn heartbeat_datasets_and_errors_are_bounded() {
    let dataset = |name: &str, shape: Vec<u64>| DatasetInfo {
        name: name.to_string(),
        samples: 100,
        sample_shape: shape,
        classes: 10,
    };
    let beat = |datasets: Vec<DatasetInfo>| Heartbeat {
        datasets: Some(datasets),
        ..Heartbeat::default()
    };
    beat(vec![dataset("mnist-10k", vec![1, 28, 28])])
        .validate()
        .unwrap();
    let bad_name = beat(vec![dataset("no spaces", vec![64])])
        .validate()
        .unwrap_err();
    assert!(
        bad_name.contains("heartbeat.datasets[0].name"),
        "{bad_name}"
    );
    let bad_shape = beat(vec![dataset("a", vec![])]).validate().unwrap_err();
    assert!(bad_shape.contains("sample_shape"), "{bad_shape}");
    assert!(beat(vec![dataset("a", vec![0])]).validate().is_err());
    assert!(beat(vec![dataset("a", vec![1; 9])]).validate().is_err());
    let too_many = beat(vec![dataset("a", vec![2]); MAX_DATASETS + 1])
        .validate()
        .unwrap_err();
    assert!(too_many.contains("limit is 32"), "{too_many}");
    let long_error = Heartbeat {
        last_error: Some("e".repeat(MAX_LAST_ERROR_CHARS + 1)),
        ..Heartbeat::default()
    };
    assert!(long_error.validate().is_err());
}

#[test]
fn evaluation_reports_are_bounded() {
    let report = EvaluationReport {
        round_id: 3,
        loss: 0.4,
        accuracy: 0.9,
        samples: 50,
    };
    report.validate().unwrap();
    for (bad, field) in [
        (
            EvaluationReport {
                round_id: 0,
                ..report.clone()
            },
            "round_id",
        ),
        (
            EvaluationReport {
                loss: f64::NAN,
                ..report.clone()
            },
            "loss",
        ),
        (
            EvaluationReport {
                loss: -1.0,
                ..report.clone()
            },
            "loss",
        ),
        (
            EvaluationReport {
                accuracy: 1.01,
                ..report.clone()
            },
            "accuracy",
        ),
        (
            EvaluationReport {
                samples: 0,
                ..report.clone()
            },
            "samples",
        ),
    ] {
        let error = bad.validate().unwrap_err();
        assert!(error.contains(field), "{error}");
    }
    assert!(
        serde_json::from_str::<EvaluationReport>(
            r#"{"round_id":1,"loss":0,"accuracy":0,"samples":1,"x":1}"#
        )
        .is_err()
    );
}

fn sub_round_report() -> SubRoundReport {
    SubRoundReport {
        round_id: 3,
        selected: 10,
        updates: 7,
        dropouts: 2,
        ineligible: 1,
        dropout_reasons: vec![DropoutCount {
            reason: "timeout: no update before the round's deadline".into(),
            devices: 2,
        }],
        samples: Some(700),
        bytes_in: 7_000,
        bytes_out: 10_000,
        duration_ms: 1_500,
    }
}

/// A sub-round report's counts add up and its reasons stay in bounds;
/// each way of breaking that is named.
#[test]
fn sub_round_reports_add_up() {
    sub_round_report().validate().unwrap();
    let too_many = SubRoundReport {
        updates: 8,
        ..sub_round_report()
    };
    let error = too_many.validate().unwrap_err();
    assert!(error.contains("10 selected"), "{error}");
    let mut reasons = sub_round_report();
    reasons.dropout_reasons[0].devices = 3;
    let error = reasons.validate().unwrap_err();
    assert!(error.contains("count 3 devices"), "{error}");
    let mut long = sub_round_report();
    long.dropout_reasons[0].reason = "x".repeat(MAX_SUB_ROUND_REASON_CHARS + 1);
    assert!(long.validate().is_err());
    let mut forged = sub_round_report();
    forged.dropout_reasons[0].reason = "ok\nERROR forged log line".into();
    assert!(forged.validate().is_err());
    let mut many = sub_round_report();
    many.dropout_reasons = vec![
        DropoutCount {
            reason: "r".into(),
            devices: 0,
        };
        MAX_SUB_ROUND_REASONS + 1
    ];
    assert!(many.validate().is_err());
    let json = serde_json::to_value(sub_round_report()).unwrap();
    assert_eq!(
        serde_json::from_value::<SubRoundReport>(json).unwrap(),
        sub_round_report()
    );
}
