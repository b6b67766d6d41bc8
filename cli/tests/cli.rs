//! The `canopy` binary as a user runs it: accuracy on real data, JSON
//! output, and errors that name the object and the cause without panicking.

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::{canopy, fails, last_json, ok, repo, scratch};

/// `canopy model new` of a logistic regression for the digits (64
/// inputs, 10 classes) at `model`.
fn new_digits_logreg(model: &str) {
    ok(canopy(&[
        "model",
        "new",
        "logreg",
        "--inputs",
        "64",
        "--classes",
        "10",
        "-o",
        model,
    ]));
}

fn mnist() -> String {
    repo().join("datasets/mnist-10k").display().to_string()
}

/// The MLP the tests train on MNIST: 784-128-10.
const MLP: &[&str] = &[
    "mlp",
    "--inputs",
    "784",
    "--hidden",
    "128",
    "--classes",
    "10",
];

/// How the MLP is trained: plain SGD.
const MLP_RECIPE: &[&str] = &["--lr", "0.1"];

/// How LeNet-5 is trained: SGD with momentum. Over initialiser and shuffle
/// seeds 0..5 it reaches 0.964–0.974 (mean 0.970) where plain SGD at 0.1
/// spreads over 0.953–0.973, so the target is not met by a lucky seed.
const LENET_RECIPE: &[&str] = &["--lr", "0.01", "--optimizer", "sgd:momentum=0.9"];

fn train_and_eval(arch: &[&str], extra: &[&str], name: &str) -> serde_json::Value {
    train_and_eval_for("5", arch, extra, name)
}

/// `model new` with the default seed, `model train` for `epochs` epochs on
/// the MNIST sample, then `model eval`'s JSON.
fn train_and_eval_for(
    epochs: &str,
    arch: &[&str],
    extra: &[&str],
    name: &str,
) -> serde_json::Value {
    let dir = scratch(name);
    let model = dir.join("m.canopy").display().to_string();
    let trained = dir.join("t.canopy").display().to_string();
    let mut new = vec!["model", "new"];
    new.extend_from_slice(arch);
    new.extend_from_slice(&["-o", &model]);
    ok(canopy(&new));
    let mut train = vec!["model", "train", &model, "--data"];
    let data = mnist();
    train.extend_from_slice(&[&data, "--epochs", epochs, "--batch", "64", "-o", &trained]);
    train.extend_from_slice(extra);
    ok(canopy(&train));
    last_json(&ok(canopy(&[
        "model", "eval", &trained, "--data", &data, "--json",
    ])))
}

#[test]
fn mlp_reaches_092_test_accuracy() {
    let eval = train_and_eval(MLP, MLP_RECIPE, "mlp");
    let accuracy = eval["accuracy"].as_f64().unwrap();
    assert!(accuracy >= 0.92, "MLP test accuracy {accuracy}");
    assert_eq!(eval["samples"], 1996);
    assert!(eval["loss"].as_f64().unwrap() < 0.5);
}

/// The GPU backend (lavapipe in CI, so slow but real) trains through the
/// CLI as the CPU does: the MLP, from the same seed, data and recipe (with
/// momentum, so the optimizer's state lives on the device), ends its epoch
/// with the CPU's test accuracy and loss. LeNet-5's convolutions are
/// checked against the CPU step by step in `engine/tests/gpu.rs`; an epoch
/// of them here took 104 s on lavapipe against the MLP's 12 s (2026-12-01),
/// the larger part of this suite's time in CI. `--backend gpu` takes any
/// adapter and fails when none opens.
#[test]
fn the_gpu_backend_trains_as_the_cpu_does() {
    if std::env::var("CANOPY_TEST_BACKENDS").as_deref() == Ok("cpu") {
        return;
    }
    let on = |backend: &str| {
        // LeNet-5's recipe, for its momentum.
        let recipe = [LENET_RECIPE, &["--backend", backend]].concat();
        train_and_eval_for("1", MLP, &recipe, &format!("mlp-{backend}"))
    };
    let (cpu, gpu) = (on("cpu"), on("gpu"));
    let metric = |eval: &serde_json::Value, name: &str| eval[name].as_f64().unwrap();
    assert!(
        metric(&cpu, "accuracy") >= 0.9,
        "the MLP after one epoch on the CPU: {cpu}"
    );
    // The backends sum in different orders, which an epoch of SGD steps
    // amplifies: LeNet-5's CPU bias gradients summed in stages instead of
    // one long run once moved its loss by 1.8e-3 (0.1659 against the
    // GPU's 0.1641) and its accuracy by 0.1 point. 2 % of the loss still
    // fails a backend that trains differently.
    let loss_gap = (metric(&gpu, "loss") - metric(&cpu, "loss")).abs();
    assert!(
        (metric(&gpu, "accuracy") - metric(&cpu, "accuracy")).abs() <= 0.002
            && loss_gap <= 0.02 * metric(&cpu, "loss"),
        "the MLP after one epoch: GPU {gpu} vs CPU {cpu}"
    );
}

#[test]
fn an_unknown_backend_is_refused_by_name() {
    let dir = scratch("bad-backend");
    let model = dir.join("m.canopy").display().to_string();
    new_digits_logreg(&model);
    let stderr = fails(canopy(&[
        "model",
        "eval",
        &model,
        "--data",
        "datasets/digits",
        "--backend",
        "tpu",
    ]));
    assert!(stderr.contains("unknown backend `tpu`"), "{stderr}");
}

/// Mesa's device-select layer makes libwayland print "error:
/// XDG_RUNTIME_DIR is invalid or not set" on every GPU probe in a
/// container or service; the binary turns the layer off first.
#[test]
fn probing_for_a_gpu_without_a_session_prints_nothing() {
    let dir = scratch("quiet-probe");
    let model = dir.join("m.canopy").display().to_string();
    new_digits_logreg(&model);
    for backend in ["auto", "gpu"] {
        let out = Command::new(env!("CARGO_BIN_EXE_canopy"))
            .args([
                "model",
                "eval",
                &model,
                "--data",
                "datasets/digits",
                "--json",
            ])
            .args(["--backend", backend])
            .env("CANOPY_LOG", "warn")
            .env_remove("XDG_RUNTIME_DIR")
            .env_remove("NODEVICE_SELECT")
            .current_dir(repo())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        if backend == "gpu" && std::env::var("CANOPY_TEST_BACKENDS").as_deref() == Ok("cpu") {
            continue;
        }
        assert!(out.status.success(), "--backend {backend}: {stderr}");
        assert!(stderr.is_empty(), "--backend {backend} printed: {stderr}");
    }
}

#[test]
fn lenet5_reaches_0965_test_accuracy() {
    let eval = train_and_eval(&["lenet5", "--classes", "10"], LENET_RECIPE, "lenet");
    let accuracy = eval["accuracy"].as_f64().unwrap();
    assert!(accuracy >= 0.965, "LeNet-5 test accuracy {accuracy}");
}

#[test]
fn frozen_backbone_with_adam_trains_only_the_head() {
    let dir = scratch("frozen");
    let model = dir.join("m.canopy").display().to_string();
    let trained = dir.join("t.canopy").display().to_string();
    ok(canopy(&["model", "new", "lenet5", "-o", &model]));
    let data = mnist();
    let out = ok(canopy(&[
        "model",
        "train",
        &model,
        "--data",
        &data,
        "--epochs",
        "1",
        "--lr",
        "0.001",
        "--optimizer",
        "adam",
        "--freeze",
        "conv",
        "--json",
        "-o",
        &trained,
    ]));
    assert!(last_json(&out)["accuracy"].as_f64().unwrap() > 0.5);
    let inspect = last_json(&ok(canopy(&["model", "inspect", &trained, "--json"])));
    for p in inspect["parameters"].as_array().unwrap() {
        let name = p["name"].as_str().unwrap();
        let frozen = name.starts_with("conv") || name.starts_with("input.");
        assert_eq!(p["trainable"].as_bool().unwrap(), !frozen, "{name}");
    }
    let step_ops = &inspect["entry_points"]["train_step"]["ops"];
    assert!(
        step_ops.get("conv2d_backward_filter").is_none(),
        "{step_ops}"
    );
}

#[test]
fn logreg_trains_on_the_digits_csv() {
    let dir = scratch("digits");
    let model = dir.join("m.canopy").display().to_string();
    let trained = dir.join("t.canopy").display().to_string();
    new_digits_logreg(&model);
    let data = repo().join("datasets/digits").display().to_string();
    let out = ok(canopy(&[
        "model", "train", &model, "--data", &data, "--epochs", "20", "--batch", "32", "--lr",
        "0.1", "--json", "-o", &trained,
    ]));
    let accuracy = last_json(&out)["accuracy"].as_f64().unwrap();
    assert!(accuracy > 0.9, "digits accuracy {accuracy}");
}

#[test]
fn inspect_shows_entry_points_parameters_and_digest() {
    let dir = scratch("inspect");
    let model = dir.join("m.canopy").display().to_string();
    ok(canopy(&[
        "model", "new", "mlp", "--hidden", "16", "-o", &model,
    ]));
    let text = ok(canopy(&["model", "inspect", &model]));
    for needle in [
        "digest:    sha256:",
        "fc1.weight",
        "[784, 16]",
        "trainable",
        "frozen",
        "train_step",
        "infer",
        "eval",
        "matmul×",
        // The CPU runs a linear layer and its activation as one kernel.
        "fused:   ",
        "matmul+add+relu×1",
    ] {
        assert!(
            text.contains(needle),
            "inspect output lacks `{needle}`:\n{text}"
        );
    }
    let listed = ok(canopy(&["model", "inspect", &model, "--fused"]));
    assert!(
        listed.contains("matmul, %") && listed.contains("= fused["),
        "{listed}"
    );
    let json = last_json(&ok(canopy(&["model", "inspect", &model, "--json"])));
    let step = &json["entry_points"]["train_step"];
    let fused = &step["cpu_fusion"];
    assert_eq!(fused["nodes"], step["nodes"]);
    let (nodes, after) = (
        fused["nodes"].as_u64().unwrap(),
        fused["after_fusion"].as_u64().unwrap(),
    );
    assert!(after < nodes, "{fused}");
    assert!(
        fused["fused_kernels"].as_object().unwrap().len() >= 3,
        "{fused}"
    );
}

#[test]
fn bad_input_is_a_clean_error_naming_the_cause() {
    let dir = scratch("errors");
    let model = dir.join("m.canopy").display().to_string();
    let out_path = dir.join("o.canopy").display().to_string();
    let data = mnist();
    ok(canopy(&[
        "model", "new", "mlp", "--hidden", "8", "-o", &model,
    ]));

    let e = fails(canopy(&["model", "inspect", "/nonexistent/model.canopy"]));
    assert!(e.contains("/nonexistent/model.canopy"), "{e}");

    let corrupt = dir.join("corrupt.canopy");
    let mut bytes = std::fs::read(&model).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x55;
    std::fs::write(&corrupt, &bytes).unwrap();
    let e = fails(canopy(&["model", "inspect", corrupt.to_str().unwrap()]));
    assert!(e.contains("corrupt.canopy") && e.contains("digest"), "{e}");

    std::fs::write(dir.join("short.canopy"), &bytes[..10]).unwrap();
    fails(canopy(&[
        "model",
        "inspect",
        dir.join("short.canopy").to_str().unwrap(),
    ]));

    let small = dir.join("small.canopy").display().to_string();
    ok(canopy(&[
        "model", "new", "mlp", "--inputs", "100", "-o", &small,
    ]));
    let e = fails(canopy(&[
        "model", "train", &small, "--data", &data, "-o", &out_path,
    ]));
    assert!(
        e.contains("[1, 28, 28]") && e.contains("[100]"),
        "shape mismatch names both shapes: {e}"
    );

    let e = fails(canopy(&[
        "model", "train", &model, "--data", &data, "--epochs", "0", "-o", &out_path,
    ]));
    assert!(e.contains("--epochs"), "{e}");
    let e = fails(canopy(&[
        "model", "train", &model, "--data", &data, "--lr", "NaN", "-o", &out_path,
    ]));
    assert!(e.contains("--lr"), "{e}");
    let e = fails(canopy(&[
        "model", "train", &model, "--data", &data, "--freeze", "nope", "-o", &out_path,
    ]));
    assert!(e.contains("`nope` matches no parameter"), "{e}");
    let e = fails(canopy(&[
        "model",
        "train",
        &model,
        "--data",
        &data,
        "--optimizer",
        "rmsprop",
        "-o",
        &out_path,
    ]));
    assert!(e.contains("unknown optimizer `rmsprop`"), "{e}");
    let e = fails(canopy(&[
        "model",
        "train",
        &model,
        "--data",
        "/nonexistent/data",
        "-o",
        &out_path,
    ]));
    assert!(e.contains("/nonexistent/data"), "{e}");
    fails(canopy(&[
        "model", "new", "mlp", "--hidden", "0", "-o", &out_path,
    ]));
    assert!(
        !Path::new(&out_path).exists(),
        "no output is written on failure"
    );

    // clap's own usage errors exit non-zero too.
    let out = canopy(&["model", "train", &model, "--bogus"]);
    assert!(!out.status.success());
    assert!(!String::from_utf8_lossy(&out.stderr).contains("panicked"));
}

/// The CLI trains and reads within the bounds every tier shares
/// (`canopy_protocol::bounds`), and its errors name the flag or the file.
#[test]
fn training_settings_and_model_files_obey_the_shared_bounds() {
    use canopy_protocol::bounds::{MAX_BATCH_SIZE, MAX_EPOCHS, MAX_LEARNING_RATE, MAX_MODEL_BYTES};
    let dir = scratch("bounds");
    let model = dir.join("m.canopy").display().to_string();
    let out_path = dir.join("o.canopy").display().to_string();
    let data = mnist();
    ok(canopy(&[
        "model", "new", "mlp", "--hidden", "8", "-o", &model,
    ]));
    let over = [
        (
            "--epochs",
            (MAX_EPOCHS + 1).to_string(),
            format!("1..={MAX_EPOCHS}"),
        ),
        (
            "--batch",
            (MAX_BATCH_SIZE + 1).to_string(),
            format!("1..={MAX_BATCH_SIZE}"),
        ),
        (
            "--lr",
            (MAX_LEARNING_RATE * 2.0).to_string(),
            format!("(0, {MAX_LEARNING_RATE}]"),
        ),
    ];
    for (flag, value, allowed) in over {
        let e = fails(canopy(&[
            "model", "train", &model, "--data", &data, flag, &value, "-o", &out_path,
        ]));
        assert!(
            e.contains(&format!("{flag} {value} is out of range {allowed}")),
            "{e}"
        );
    }
    assert!(!Path::new(&out_path).exists());

    // A sparse file one byte over the cap: refused before it is read.
    let huge = dir.join("huge.canopy");
    std::fs::File::create(&huge)
        .unwrap()
        .set_len(MAX_MODEL_BYTES + 1)
        .unwrap();
    let e = fails(canopy(&["model", "inspect", huge.to_str().unwrap()]));
    assert!(
        e.contains("huge.canopy") && e.contains(&format!("over the limit of {MAX_MODEL_BYTES}")),
        "{e}"
    );
    let _ = std::fs::remove_file(&huge);
}

#[test]
fn readme_opens_with_the_main_job_and_the_ci_test_command() {
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let commands: Vec<&str> = readme
        .lines()
        .filter(|l| l.starts_with("    ") && !l.trim().is_empty())
        .map(str::trim)
        .take(2)
        .collect();
    assert!(
        commands[0].contains("--bin canopy-agent") && commands[0].contains("canopy-server -- demo"),
        "{commands:?}"
    );
    assert_eq!(commands[1], "cargo test --workspace --release");
    let ci = std::fs::read_to_string(repo().join(".ci/run")).unwrap();
    assert!(
        ci.contains("cargo test ") && ci.contains("README.md"),
        ".ci/run runs the README's command"
    );
}

/// The write end of a pipe whose read end is already closed: every
/// write to it fails with EPIPE, with no race against the reader.
fn closed_pipe() -> std::process::Stdio {
    let (reader, writer) = std::io::pipe().expect("a pipe");
    drop(reader);
    writer.into()
}

/// Runs `canopy` with stdout a pipe whose read end is closed before it
/// writes anything, as a reader that quit (`| head -0`).
fn canopy_with_closed_stdout(args: &[&str]) -> Output {
    let child = Command::new(env!("CARGO_BIN_EXE_canopy"))
        .args(args)
        .env("CANOPY_LOG", "warn")
        .stdout(closed_pipe())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("the canopy binary runs");
    child.wait_with_output().expect("canopy exits")
}

#[test]
fn a_closed_stdout_stops_every_command_quietly() {
    let dir = scratch("closed-stdout");
    let model = dir.join("m.canopy").display().to_string();
    let trained = dir.join("t.canopy").display().to_string();
    let data = repo().join("datasets/digits").display().to_string();
    let logreg = [
        "model",
        "new",
        "logreg",
        "--inputs",
        "64",
        "--classes",
        "10",
        "-o",
        &model,
    ];
    let commands: Vec<Vec<&str>> = vec![
        vec!["--help"],
        vec!["--version"],
        vec!["model", "--help"],
        logreg.to_vec(),
        vec!["model", "inspect", &model],
        vec!["model", "inspect", &model, "--json"],
        vec![
            "model", "train", &model, "--data", &data, "--epochs", "1", "-o", &trained,
        ],
        vec!["model", "eval", &model, "--data", &data],
        vec!["model", "eval", &model, "--data", &data, "--json"],
        vec!["model", "stats", &model, "--data", &data, "-o", &trained],
    ];
    for args in commands {
        let out = canopy_with_closed_stdout(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !stderr.contains("panicked"),
            "`{args:?}` panicked: {stderr}"
        );
        assert!(stderr.is_empty(), "`{args:?}` stops quietly: {stderr}");
        // 128 + SIGPIPE, as a shell reports a C tool killed by SIGPIPE;
        // see the `canopy-term` crate.
        assert_eq!(out.status.code(), Some(141), "`{args:?}`: {stderr}");
    }
    assert!(
        Path::new(&model).exists(),
        "`model new` wrote before reporting"
    );
}

/// Training logs to stderr as it goes: with stderr closed the logs are
/// lost, not turned into a panic, and training completes.
#[test]
fn a_closed_stderr_does_not_stop_a_logging_command() {
    let dir = scratch("closed-stderr");
    let model = dir.join("m.canopy").display().to_string();
    let trained = dir.join("t.canopy").display().to_string();
    new_digits_logreg(&model);
    let data = repo().join("datasets/digits").display().to_string();
    let status = Command::new(env!("CARGO_BIN_EXE_canopy"))
        .args([
            "model", "train", &model, "--data", &data, "--epochs", "2", "-o", &trained,
        ])
        .env("CANOPY_LOG", "debug")
        .stdout(std::process::Stdio::null())
        .stderr(closed_pipe())
        .status()
        .unwrap();
    assert_eq!(status.code(), Some(0), "{status:?}");
    assert!(Path::new(&trained).exists(), "the model was written");
}

fn read_model(path: &str) -> canopy_ir::Model {
    canopy_ir::format::read_model(&std::fs::read(path).unwrap()).unwrap()
}

fn values<'m>(model: &'m canopy_ir::Model, name: &str) -> &'m [f32] {
    model.parameter(name).unwrap().data.as_f32().unwrap()
}

fn std_of(values: &[f32]) -> f64 {
    let n = values.len() as f64;
    let mean = values.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
    (values
        .iter()
        .map(|&v| (f64::from(v) - mean).powi(2))
        .sum::<f64>()
        / n)
        .sqrt()
}

/// One epoch from a fresh 784-128-10 MLP made with `new_flags`.
/// Test accuracy after one epoch of an MLP drawn with `init` from `seed`,
/// shuffled from the same seed.
fn one_epoch_accuracy(dir: &Path, init: &str, seed: u32) -> f64 {
    let model = dir.join("m.canopy").display().to_string();
    let trained = dir.join("t.canopy").display().to_string();
    let seed = seed.to_string();
    let mut new = vec!["model", "new", "mlp", "--inputs", "784", "--hidden", "128"];
    new.extend_from_slice(&["--classes", "10", "-o", &model]);
    new.extend_from_slice(&["--init", init, "--seed", &seed]);
    ok(canopy(&new));
    let data = mnist();
    let out = ok(canopy(&[
        "model", "train", &model, "--data", &data, "--epochs", "1", "--seed", &seed, "--json",
        "-o", &trained,
    ]));
    last_json(&out)["accuracy"].as_f64().unwrap()
}

#[test]
fn model_new_draws_he_by_default_and_says_the_statistics_are_unfitted() {
    let dir = scratch("init");
    let model = dir.join("he.canopy").display().to_string();
    let out = ok(canopy(&[
        "model", "new", "mlp", "--hidden", "256", "-o", &model,
    ]));
    assert!(
        out.contains("input statistics (input.mean, input.std) are unfitted")
            && out.contains(&format!("canopy model stats {model} --data DIR")),
        "{out}"
    );
    let he = read_model(&model);
    assert_eq!(he.metadata.properties["initializer"], "he");
    let within = |actual: f64, expected: f64| (actual / expected - 1.0).abs() < 0.05;
    let fc1 = std_of(values(&he, "fc1.weight"));
    assert!(within(fc1, (2.0f64 / 784.0).sqrt()), "He fc1 std {fc1}");
    let fc2 = std_of(values(&he, "fc2.weight"));
    assert!(within(fc2, (2.0f64 / 266.0).sqrt()), "Xavier fc2 std {fc2}");

    let uniform = dir.join("uniform.canopy").display().to_string();
    ok(canopy(&[
        "model", "new", "mlp", "--hidden", "256", "--init", "uniform", "-o", &uniform,
    ]));
    let uniform = read_model(&uniform);
    assert_eq!(uniform.metadata.properties["initializer"], "uniform");
    assert!(
        values(&uniform, "fc1.weight")
            .iter()
            .all(|w| w.abs() <= 1.0 / 28.0)
    );
    assert!(values(&uniform, "fc1.bias").iter().any(|&b| b != 0.0));

    let error = fails(canopy(&[
        "model", "new", "mlp", "--init", "kaiming", "-o", &model,
    ]));
    assert!(
        error.contains("'kaiming'") && error.contains("he, xavier, uniform"),
        "{error}"
    );
}

#[test]
fn he_initialisation_learns_more_in_one_epoch_than_uniform() {
    let dir = scratch("init-epoch");
    // One seed is one draw of a noisy number (the test set has 1,996
    // samples); the claim is about the mean. Over seeds 0..5 the means
    // were 0.920 against 0.909, and He won on every seed.
    let seeds = 0..5;
    let mean = |init: &str| {
        seeds
            .clone()
            .map(|seed| one_epoch_accuracy(&dir, init, seed))
            .sum::<f64>()
            / seeds.len() as f64
    };
    let (he, uniform) = (mean("he"), mean("uniform"));
    assert!(
        he > uniform + 0.005 && he > 0.915,
        "mean he {he}, uniform {uniform}"
    );
}

#[test]
fn model_stats_fits_the_statistics_alone_into_a_new_version() {
    let dir = scratch("stats");
    let model = dir.join("m.canopy").display().to_string();
    let fitted = dir.join("f.canopy").display().to_string();
    let data = mnist();
    ok(canopy(&[
        "model", "new", "mlp", "--hidden", "16", "-o", &model,
    ]));
    let out = ok(canopy(&[
        "model", "stats", &model, "--data", &data, "-o", &fitted,
    ]));
    assert!(
        out.contains("on 8004 training samples of 784 features: mean 0.1309, std 0.3084")
            && out.contains("mean of means 0.1309, mean of stds 0.19"),
        "{out}"
    );
    let before = read_model(&model);
    assert_eq!(before.metadata.properties["input_stats"], "unfitted");
    let after = read_model(&fitted);
    assert_eq!(after.metadata.properties["input_stats"], "fitted");
    assert!((values(&after, "input.mean")[0] - 0.1309).abs() < 1e-4);
    assert!((values(&after, "input.std")[0] - 0.3084).abs() < 1e-4);
    let parent = canopy_ir::format::digest(&std::fs::read(&model).unwrap()).unwrap();
    assert_eq!(after.metadata.parent_digest, Some(parent));
    assert_eq!(values(&after, "fc1.weight"), values(&before, "fc1.weight"));

    // --in-place rewrites the file itself, and refitting says it replaced the fit.
    ok(canopy(&[
        "model",
        "stats",
        &model,
        "--data",
        &data,
        "--in-place",
    ]));
    assert_eq!(
        read_model(&model).metadata.properties["input_stats"],
        "fitted"
    );
    let out = ok(canopy(&[
        "model",
        "stats",
        &model,
        "--data",
        &data,
        "--in-place",
    ]));
    assert!(out.contains("replaced the fitted ones"), "{out}");
}

#[test]
fn model_stats_errors_name_the_cause() {
    let dir = scratch("stats-errors");
    let model = dir.join("m.canopy").display().to_string();
    let out_path = dir.join("o.canopy").display().to_string();
    let data = mnist();
    ok(canopy(&[
        "model", "new", "mlp", "--hidden", "8", "-o", &model,
    ]));

    let error = fails(canopy(&["model", "stats", &model, "--data", &data]));
    assert!(
        error.contains("--output") && error.contains("--in-place"),
        "{error}"
    );

    let missing = dir.join("no-such-data").display().to_string();
    let error = fails(canopy(&[
        "model", "stats", &model, "--data", &missing, "-o", &out_path,
    ]));
    assert!(
        error.contains(&format!("cannot load dataset `{missing}`"))
            && error.contains("No such file"),
        "{error}"
    );

    let six = dir.join("six.canopy").display().to_string();
    ok(canopy(&[
        "model", "new", "mlp", "--inputs", "6", "-o", &six,
    ]));
    let error = fails(canopy(&[
        "model", "stats", &six, "--data", &data, "-o", &out_path,
    ]));
    assert!(
        error.contains("has samples of shape [1, 28, 28], but the model `mlp` expects [6]"),
        "{error}"
    );
    assert!(
        !Path::new(&out_path).exists(),
        "no file is written on error"
    );

    let error = fails(canopy(&[
        "model", "stats", &data, "--data", &data, "-o", &out_path,
    ]));
    assert!(error.contains("cannot read model file"), "{error}");
}

/// `canopy authority new` writes a 0600 key and prints its public key;
/// `certify` prints a certificate that holds for that id and key only; a
/// key that exists, a malformed device key and a file that is not a key
/// are refused with the house error style.
#[test]
fn an_authority_certifies_a_device_key() {
    use canopy_protocol::auth::DeviceKey;
    use canopy_protocol::device_cert;

    let dir = scratch("authority");
    let key_file = dir.join("authority.key");
    let key = key_file.to_str().unwrap();
    let public_hex = ok(canopy(&["authority", "new", "--out", key]));
    let mut public = [0u8; 32];
    hex::decode_to_slice(public_hex.trim(), &mut public).expect("64 hex digits");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&key_file).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "the key is a secret");
    }
    let stderr = fails(canopy(&["authority", "new", "--out", key]));
    assert!(
        stderr.contains("already exists") && stderr.contains("--force"),
        "{stderr}"
    );

    let device = DeviceKey::generate();
    let certify = |id: &str, device_key: &str| {
        canopy(&[
            "authority",
            "certify",
            "--key",
            key,
            "--device",
            id,
            "--device-key",
            device_key,
        ])
    };
    let printed = ok(certify("17", &device.public_key_hex()));
    let mut certificate = [0u8; 64];
    hex::decode_to_slice(printed.trim(), &mut certificate).expect("128 hex digits");
    assert_eq!(
        device_cert::verify(&public, 17, &device.public_key(), &certificate),
        Ok(())
    );
    assert!(device_cert::verify(&public, 18, &device.public_key(), &certificate).is_err());

    let stderr = fails(certify("17", "not-a-key"));
    assert!(
        stderr.contains("--device-key is not an Ed25519 public key"),
        "{stderr}"
    );
    std::fs::write(dir.join("bad.key"), "zz\n").unwrap();
    let bad = dir.join("bad.key");
    let stderr = fails(canopy(&[
        "authority",
        "certify",
        "--key",
        bad.to_str().unwrap(),
        "--device",
        "1",
        "--device-key",
        &device.public_key_hex(),
    ]));
    assert!(stderr.contains("is not an authority key"), "{stderr}");
}
