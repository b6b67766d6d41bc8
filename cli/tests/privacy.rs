//! `canopy privacy`: the budget planner, as a user runs it, and the
//! commands docs/privacy.md and the README show, run as written.

mod common;

use common::{canopy, fails, ok, repo};

fn json(args: &[&str]) -> serde_json::Value {
    let mut with_json = args.to_vec();
    with_json.push("--json");
    let stdout = ok(canopy(&with_json));
    serde_json::from_str(stdout.trim()).unwrap_or_else(|error| panic!("{error}: {stdout}"))
}

const OPACUS_PLAN: [&str; 10] = [
    "--sampling-rate",
    "0.04",
    "--steps",
    "2250",
    "--delta",
    "1e-5",
    "--conversion",
    "tight",
    "--noise-multiplier",
    "1.5",
];

#[test]
fn epsilon_prints_the_accountants_answer_with_its_conversion() {
    let mut args = vec!["privacy", "epsilon"];
    args.extend(OPACUS_PLAN);
    let answer = json(&args);
    // Opacus's accountant test gives 7.32911117 for this plan.
    let epsilon = answer["epsilon"].as_f64().unwrap();
    assert!((epsilon / 7.329_111_17 - 1.0).abs() < 1e-4, "{answer}");
    assert_eq!(answer["conversion"], "tight");
    assert_eq!(answer["order"], 3.9);
    assert_eq!(answer["steps"], 2250);
    let text = ok(canopy(&args));
    assert!(text.contains("epsilon           7.329"), "{text}");
    assert!(text.contains("delta             1e-5"), "{text}");
    assert!(text.contains("tight (Balle et al. 2020"), "{text}");

    // The classic conversion says more, for the same plan.
    let conversion = args.len() - 3;
    args[conversion] = "classic";
    let classic = json(&args);
    assert!(classic["epsilon"].as_f64().unwrap() > epsilon, "{classic}");
}

#[test]
fn noise_finds_the_least_noise_within_the_target() {
    let base = [
        "--sampling-rate",
        "0.01",
        "--steps",
        "500",
        "--delta",
        "1e-6",
    ];
    let mut args = vec!["privacy", "noise", "--epsilon", "2"];
    args.extend(base);
    let plan = json(&args);
    let noise_multiplier = plan["noise_multiplier"].as_f64().unwrap();
    assert!(plan["epsilon"].as_f64().unwrap() <= 2.0, "{plan}");

    // Run back through `epsilon`: that noise meets the target, and 1 %
    // less does not.
    for (scale, meets) in [(1.0, true), (0.99, false)] {
        let noise = format!("{}", noise_multiplier * scale);
        let mut args = vec!["privacy", "epsilon", "--noise-multiplier", &noise];
        args.extend(base);
        let spent = json(&args)["epsilon"].as_f64().unwrap();
        assert_eq!(spent <= 2.0, meets, "noise {noise}: ε {spent}");
    }
}

#[test]
fn bad_values_are_refused_naming_the_flag() {
    let cases: [(&[&str], &str); 6] = [
        (
            &[
                "epsilon",
                "--sampling-rate",
                "1.5",
                "--noise-multiplier",
                "1",
                "--steps",
                "10",
                "--delta",
                "1e-5",
            ],
            "error: --sampling-rate is 1.5, outside [0, 1]",
        ),
        (
            &[
                "epsilon",
                "--sampling-rate",
                "0.1",
                "--noise-multiplier",
                "NaN",
                "--steps",
                "10",
                "--delta",
                "1e-5",
            ],
            "error: --noise-multiplier is NaN, outside (0, 1000000]",
        ),
        (
            &[
                "epsilon",
                "--sampling-rate",
                "0.1",
                "--noise-multiplier",
                "1",
                "--steps",
                "10",
                "--delta",
                "0",
            ],
            "error: --delta is 0, outside (0, 1]",
        ),
        (
            &[
                "noise",
                "--sampling-rate",
                "0.1",
                "--epsilon",
                "-1",
                "--steps",
                "10",
                "--delta",
                "1e-5",
            ],
            "error: --epsilon is -1, outside (0, 1000000]",
        ),
        (
            &[
                "noise",
                "--sampling-rate",
                "0.1",
                "--epsilon",
                "1",
                "--steps",
                "0",
                "--delta",
                "1e-5",
            ],
            "error: --steps is 0, outside [1, 1000000000]",
        ),
        (
            &[
                "epsilon",
                "--sampling-rate",
                "0.1",
                "--noise-multiplier",
                "1",
                "--steps",
                "10000000000",
                "--delta",
                "1e-5",
            ],
            "error: --steps is 10000000000, outside [0, 1000000000]",
        ),
    ];
    for (args, expected) in cases {
        let mut full = vec!["privacy"];
        full.extend(args);
        let stderr = fails(canopy(&full));
        assert!(stderr.starts_with(expected), "{full:?}: {stderr}");
    }

    let stderr = fails(canopy(&[
        "privacy",
        "noise",
        "--sampling-rate",
        "1",
        "--epsilon",
        "1e-6",
        "--steps",
        "1000000000",
        "--delta",
        "1e-12",
    ]));
    assert!(
        stderr.contains("no noise multiplier up to 1000000 keeps epsilon"),
        "{stderr}"
    );
    assert!(
        stderr.contains("hint: allow a larger --epsilon"),
        "{stderr}"
    );

    let stderr = fails(canopy(&[
        "privacy",
        "epsilon",
        "--sampling-rate",
        "0.1",
        "--noise-multiplier",
        "1",
        "--steps",
        "10",
        "--delta",
        "1e-5",
        "--conversion",
        "exact",
    ]));
    assert!(stderr.contains("expected classic or tight"), "{stderr}");
}

#[test]
fn the_commands_in_docs_privacy_and_the_readme_run_as_written() {
    let page = std::fs::read_to_string(repo().join("docs/privacy.md")).unwrap();
    let block = page
        .split("```sh\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("docs/privacy.md has a sh block");
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let commands: Vec<&str> = block
        .lines()
        .chain(readme.lines())
        .filter(|line| line.starts_with("canopy privacy "))
        .map(|line| line.split("  #").next().unwrap())
        .collect();
    assert_eq!(commands.len(), 4, "{commands:?}");
    for command in commands {
        let args: Vec<&str> = command.split_whitespace().skip(1).collect();
        let stdout = ok(canopy(&args));
        assert!(stdout.starts_with("epsilon "), "{command}: {stdout}");
    }
}

/// A private job end to end: `canopy simulate` with the `--dp-*` flags
/// `canopy job create` shares. Each round prints the ε the planner gives
/// for that many rounds at its sampling rate (10 of 40 devices), and the
/// job stops, completed, before the round that would pass its budget.
#[test]
fn a_simulated_private_job_reports_its_epsilon_and_stops_at_its_budget() {
    let planned = |rounds: u32| -> f64 {
        let steps = rounds.to_string();
        json(&[
            "privacy",
            "epsilon",
            "--sampling-rate",
            "0.25",
            "--noise-multiplier",
            "1",
            "--steps",
            &steps,
            "--delta",
            "1e-3",
        ])["epsilon"]
            .as_f64()
            .unwrap()
    };
    // Four rounds fit in the budget, five do not.
    let budget = (planned(4) + planned(5)) / 2.0;
    let budget = format!("{budget}");
    let out = ok(canopy(&[
        "simulate",
        "--devices",
        "40",
        "--per-round",
        "10",
        "--rounds",
        "8",
        "--dp-noise-multiplier",
        "1",
        "--dp-clip-norm",
        "1",
        "--dp-delta",
        "1e-3",
        "--dp-budget-epsilon",
        &budget,
    ]));
    let spent: Vec<f64> = out
        .lines()
        .filter_map(|line| line.trim().strip_prefix("privacy: epsilon "))
        .map(|rest| rest.split(' ').next().unwrap().parse().unwrap())
        .collect();
    assert_eq!(spent.len(), 4, "{out}");
    for (round, epsilon) in (1..).zip(&spent) {
        assert!(
            (epsilon - planned(round)).abs() < 1e-4,
            "round {round}: {epsilon}\n{out}"
        );
    }
    assert!(
        out.contains("round failed: the privacy budget is spent"),
        "{out}"
    );
    assert!(out.contains("completed: 4 rounds"), "{out}");
}
