//! A job's device policy, the conditions devices report, and the
//! withdrawal of a device that no longer meets the policy; and the other
//! checks a device makes of a task before it trains.

use canopy_protocol::bounds::BoundsError;
use canopy_protocol::messages::*;
use canopy_protocol::update::{TensorSpec, UpdateLayout};

fn plugged_in_on_wifi(battery_percent: u8) -> DeviceConditions {
    DeviceConditions {
        charging: true,
        unmetered_network: true,
        idle: true,
        battery_percent,
    }
}

fn strict() -> DevicePolicy {
    DevicePolicy {
        requires_charging: true,
        requires_unmetered_network: true,
        requires_idle: true,
        min_battery_percent: 30,
    }
}

#[test]
fn an_unrestricted_policy_takes_any_device() {
    let policy = DevicePolicy::default();
    assert!(policy.is_unrestricted());
    let worst = DeviceConditions::default();
    assert_eq!(policy.check(&worst), Ok(()));
    assert!(!strict().is_unrestricted());
}

#[test]
fn a_device_that_meets_every_requirement_is_eligible() {
    assert_eq!(strict().check(&plugged_in_on_wifi(30)), Ok(()));
    assert_eq!(strict().check(&plugged_in_on_wifi(100)), Ok(()));
}

#[test]
fn every_unmet_requirement_is_listed_by_name() {
    let conditions = DeviceConditions {
        charging: false,
        unmetered_network: false,
        idle: true,
        battery_percent: 12,
    };
    let ineligible = strict().check(&conditions).unwrap_err();
    assert_eq!(
        ineligible.unmet,
        vec![
            Unmet::Charging,
            Unmet::UnmeteredNetwork,
            Unmet::Battery {
                percent: 12,
                minimum: 30
            },
        ]
    );
    assert_eq!(
        ineligible.to_string(),
        "the job requires charging and an unmetered network; \
         battery 12% is under the job's minimum of 30%"
    );
    let fields: Vec<&str> = ineligible.unmet.iter().map(|u| u.field()).collect();
    assert_eq!(
        fields,
        [
            "requires_charging",
            "requires_unmetered_network",
            "min_battery_percent"
        ]
    );
}

#[test]
fn messages_read_well_for_one_or_three_requirements() {
    let unplugged = DeviceConditions {
        charging: false,
        ..plugged_in_on_wifi(90)
    };
    assert_eq!(
        strict().check(&unplugged).unwrap_err().to_string(),
        "the job requires charging"
    );
    let busy = DeviceConditions {
        charging: false,
        unmetered_network: false,
        idle: false,
        battery_percent: 90,
    };
    assert_eq!(
        strict().check(&busy).unwrap_err().to_string(),
        "the job requires charging, an unmetered network and an idle device"
    );
    let low = plugged_in_on_wifi(29);
    assert_eq!(
        strict().check(&low).unwrap_err().to_string(),
        "battery 29% is under the job's minimum of 30%"
    );
}

#[test]
fn a_requirement_the_policy_does_not_make_is_never_unmet() {
    let battery_only = DevicePolicy {
        min_battery_percent: 50,
        ..DevicePolicy::default()
    };
    let unplugged = DeviceConditions {
        battery_percent: 50,
        ..DeviceConditions::default()
    };
    assert_eq!(battery_only.check(&unplugged), Ok(()));
}

#[test]
fn battery_levels_are_percentages() {
    strict().validate().unwrap();
    let over = DevicePolicy {
        min_battery_percent: 150,
        ..DevicePolicy::default()
    };
    let error = over.validate().unwrap_err();
    assert!(
        error.contains("device_policy.min_battery_percent") && error.contains("150"),
        "{error}"
    );
    plugged_in_on_wifi(100).validate().unwrap();
    let error = plugged_in_on_wifi(101).validate().unwrap_err();
    assert!(error.contains("conditions.battery_percent"), "{error}");
    let beat = Heartbeat {
        conditions: Some(plugged_in_on_wifi(200)),
        ..Heartbeat::default()
    };
    let error = beat.validate().unwrap_err();
    assert!(
        error.contains("heartbeat.conditions.battery_percent"),
        "{error}"
    );
}

#[test]
fn policies_parse_with_defaults_and_tolerate_new_fields() {
    let policy: DevicePolicy = serde_json::from_str(r#"{"requires_charging": true}"#).unwrap();
    assert_eq!(
        policy,
        DevicePolicy {
            requires_charging: true,
            ..DevicePolicy::default()
        }
    );
    // A policy reaches devices inside a task, a response.
    let newer: DevicePolicy =
        serde_json::from_str(r#"{"min_battery_percent": 40, "requires_5g": true}"#).unwrap();
    assert_eq!(newer.min_battery_percent, 40);
    // Its field list is the one a job's config is checked against.
    let written = serde_json::to_value(strict()).unwrap();
    let names: Vec<&str> = written
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    let mut expected = DevicePolicy::FIELDS.to_vec();
    expected.sort_unstable();
    assert_eq!(names, expected);
}

#[test]
fn conditions_are_a_request_and_refuse_unknown_fields() {
    let json =
        r#"{"charging": true, "unmetered_network": false, "idle": true, "battery_percent": 80}"#;
    let conditions: DeviceConditions = serde_json::from_str(json).unwrap();
    assert_eq!(conditions.battery_percent, 80);
    let extra = json.replace("80", "80, \"temperature\": 40");
    assert!(serde_json::from_str::<DeviceConditions>(&extra).is_err());
    let beat: Heartbeat =
        serde_json::from_str(&format!(r#"{{"state": "idle", "conditions": {json}}}"#)).unwrap();
    assert_eq!(beat.conditions, Some(conditions));
    // Older agents send no conditions, and none are written for them.
    let old: Heartbeat = serde_json::from_str(r#"{"state": "idle"}"#).unwrap();
    assert_eq!(old.conditions, None);
    assert!(!serde_json::to_string(&old).unwrap().contains("conditions"));
}

fn task(policy: DevicePolicy) -> Task {
    let layout = UpdateLayout::new(vec![TensorSpec {
        name: "params/w".into(),
        shape: vec![2],
    }])
    .unwrap();
    Task {
        kind: TaskKind::Train,
        job_id: 1,
        round_id: 9,
        round_number: 1,
        model_version_id: 4,
        model_digest: "ab".repeat(32),
        model_size_bytes: 1000,
        model_path: "/device/v1/models/4".into(),
        upload_path: "/device/v1/rounds/9/update".into(),
        upload_size_bytes: layout.encoded_len(),
        deadline_unix_ms: 1_700_000_000_000,
        training: TrainingConfig {
            epochs: 1,
            batch_size: 8,
            learning_rate: 0.1,
        },
        dataset: None,
        layout,
        secure_aggregation: None,
        sub_round: None,
        privacy: None,
        compression: None,
        policy,
    }
}

#[test]
fn tasks_carry_the_policy_and_old_tasks_still_parse() {
    let unrestricted = serde_json::to_value(task(DevicePolicy::default())).unwrap();
    assert!(unrestricted.get("policy").is_none(), "{unrestricted}");
    let back: Task = serde_json::from_value(unrestricted).unwrap();
    assert!(back.policy.is_unrestricted());

    let with_policy = task(strict());
    let json = serde_json::to_value(&with_policy).unwrap();
    assert_eq!(json["policy"]["min_battery_percent"], 30);
    let back: Task = serde_json::from_value(json).unwrap();
    assert_eq!(back, with_policy);
}

#[test]
fn a_task_with_an_impossible_battery_minimum_is_refused_by_devices() {
    let mut impossible = task(DevicePolicy::default());
    impossible.policy.min_battery_percent = 101;
    let error = impossible.validate().unwrap_err();
    assert!(matches!(error, BoundsError::OutOfRange { .. }), "{error}");
    assert_eq!(error.field(), "policy.min_battery_percent");
}

#[test]
fn withdrawals_have_their_own_paths_and_checks() {
    let train = task(strict());
    assert_eq!(task_paths::withdraw(&train), "/device/v1/rounds/9/withdraw");
    let evaluate = Task {
        kind: TaskKind::Evaluate,
        ..task(strict())
    };
    assert_eq!(
        task_paths::withdraw(&evaluate),
        "/device/v1/rounds/9/evaluation/withdraw"
    );

    let withdrawal = WithdrawTask {
        round_id: 9,
        conditions: plugged_in_on_wifi(10),
        reason: "battery 10% is under the job's minimum of 30%".into(),
    };
    withdrawal.validate().unwrap();
    let json = serde_json::to_string(&withdrawal).unwrap();
    assert_eq!(
        serde_json::from_str::<WithdrawTask>(&json).unwrap(),
        withdrawal
    );
    let extra = json.replacen('{', r#"{"force": true, "#, 1);
    assert!(serde_json::from_str::<WithdrawTask>(&extra).is_err());
    for (bad, fragment) in [
        (
            WithdrawTask {
                round_id: 0,
                ..withdrawal.clone()
            },
            "round_id",
        ),
        (
            WithdrawTask {
                reason: "x".repeat(MAX_DECLINE_REASON_CHARS + 1),
                ..withdrawal.clone()
            },
            "reason",
        ),
        (
            WithdrawTask {
                reason: "line\nforged".into(),
                ..withdrawal.clone()
            },
            "control characters",
        ),
        (
            WithdrawTask {
                conditions: plugged_in_on_wifi(101),
                ..withdrawal.clone()
            },
            "conditions.battery_percent",
        ),
    ] {
        let error = bad.validate().unwrap_err();
        assert!(error.contains(fragment), "{fragment}: {error}");
    }
}

#[test]
fn a_private_secure_task_must_ask_for_the_clip_its_noise_is_sized_for() {
    use canopy_protocol::secagg::SecAggConfig;
    use canopy_protocol::secagg::noise::NoiseTarget;

    let target = NoiseTarget {
        noise_multiplier: 1.0,
        clip_norm: 0.5,
    };
    let plan = SecAggConfig::default()
        .private_plan(10, 2, &target)
        .unwrap();
    let mut private = task(DevicePolicy::default());
    private.secure_aggregation = Some(SecureTask {
        plan,
        path: "/device/v1/rounds/9/secagg".into(),
        stage_timeout_ms: 1_000,
    });
    for clip in [None, Some(0.25)] {
        private.privacy = clip.map(|clip_norm| TaskPrivacy { clip_norm });
        let error = private.validate().unwrap_err();
        assert_eq!(error.field(), "privacy.clip_norm", "{error}");
        assert!(
            error
                .to_string()
                .contains("sized for updates clipped to 0.5"),
            "{error}"
        );
    }
    private.privacy = Some(TaskPrivacy { clip_norm: 0.5 });
    private.validate().unwrap();
}
