//! `canopy model train`'s learning rate and divergence, as a user meets
//! them: the default rate follows the optimizer, and a run whose loss
//! rises past its start says so, names the loss and the rate, hints at a
//! smaller one and writes nothing unless `--force`.

mod common;

use std::path::Path;
use std::process::Output;

use common::{canopy, last_json, ok, scratch};

fn digits() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../datasets/digits")
        .display()
        .to_string()
}

/// A digits MLP (64 → 32 → 10) made with `optimizer` at `path`.
fn new_digits_mlp(path: &str, optimizer: &str) {
    ok(canopy(&[
        "model",
        "new",
        "mlp",
        "--inputs",
        "64",
        "--hidden",
        "32",
        "--classes",
        "10",
        "--optimizer",
        optimizer,
        "-o",
        path,
    ]));
}

/// `canopy model train` of `model` on the digits for `epochs`, with
/// `extra` flags, writing `output`, JSON last.
fn train(model: &str, output: &str, epochs: &str, extra: &[&str]) -> Output {
    let data = digits();
    let mut args = vec![
        "model", "train", model, "--data", &data, "--epochs", epochs, "--json", "-o", output,
    ];
    args.extend_from_slice(extra);
    canopy(&args)
}

#[test]
fn the_default_learning_rate_follows_the_optimizer() {
    let dir = scratch("defaults");
    for (optimizer, expected) in [
        ("sgd", 0.1),
        ("sgd:momentum=0.9", 0.01),
        ("adam", 0.001),
        ("adamw", 0.001),
    ] {
        let model = dir.join("m.canopy").display().to_string();
        let out = dir.join("t.canopy").display().to_string();
        new_digits_mlp(&model, optimizer);
        let result = last_json(&ok(train(&model, &out, "1", &[])));
        let lr = result["learning_rate"].as_f64().unwrap();
        assert!(
            (lr - expected).abs() < 1e-6,
            "{optimizer}: learning rate {lr}, expected {expected}"
        );
        assert_eq!(result["diverged"], false, "{optimizer}: {result}");
        // `--optimizer` on the command line picks the default too.
        let result = last_json(&ok(train(&model, &out, "1", &["--optimizer", "adam"])));
        assert!((result["learning_rate"].as_f64().unwrap() - 0.001).abs() < 1e-6);
        // And `--lr` wins over every default.
        let result = last_json(&ok(train(&model, &out, "1", &["--lr", "0.02"])));
        assert!((result["learning_rate"].as_f64().unwrap() - 0.02).abs() < 1e-6);
    }
}

/// The case in small: a model trained with Adam, fine-tuned with
/// its head alone at a rate far too large for Adam.
#[test]
fn a_diverging_fine_tune_says_so_and_writes_nothing_without_force() {
    let dir = scratch("fine-tune");
    let model = dir.join("m.canopy").display().to_string();
    let trained = dir.join("trained.canopy").display().to_string();
    let tuned = dir.join("tuned.canopy").display().to_string();
    new_digits_mlp(&model, "adam");
    let result = last_json(&ok(train(&model, &trained, "5", &["--lr", "0.01"])));
    assert!(
        result["accuracy"].as_f64().unwrap() > 0.85,
        "the starting point learned: {result}"
    );

    let out = train(&trained, &tuned, "2", &["--freeze", "fc1", "--lr", "1"]);
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "a diverging run fails: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    // Under --json the epochs are told on stderr too, before the error.
    assert!(
        stderr.lines().any(|line| line.starts_with("error:")),
        "house error style: {stderr}"
    );
    assert!(
        stderr.contains("training diverged")
            && stderr.contains("mean training loss")
            && stderr.contains("adam at lr 1"),
        "names the loss, the optimizer and the rate: {stderr}"
    );
    assert!(
        stderr.contains("hint: train with a smaller learning rate, e.g. --lr 0.1")
            && stderr.contains("adam's default is 0.001")
            && stderr.contains("--force"),
        "hints at a smaller rate and at --force: {stderr}"
    );
    assert!(stderr.contains("tuned.canopy` was not written"), "{stderr}");
    assert!(!Path::new(&tuned).exists(), "nothing is written");

    // With --force it warns and writes, and the JSON says it diverged.
    let out = train(
        &trained,
        &tuned,
        "2",
        &["--freeze", "fc1", "--lr", "1", "--force"],
    );
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    let stdout = ok(out);
    assert!(
        stderr.contains("warning: training diverged") && stderr.contains("hint: train with"),
        "{stderr}"
    );
    // Under --json the written file is told on stderr; stdout is the JSON alone.
    assert!(stderr.contains("diverged (--force)"), "{stderr}");
    assert_eq!(last_json(&stdout)["diverged"], true);
    assert_eq!(stdout.lines().count(), 1, "{stdout}");
    assert!(Path::new(&tuned).exists(), "--force writes the output");

    // The same fine-tune at Adam's default rate learns, and says nothing.
    let out = train(&trained, &tuned, "2", &["--freeze", "fc1"]);
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    let result = last_json(&ok(out));
    assert!(!stderr.contains("diverged"), "{stderr}");
    assert_eq!(result["diverged"], false);
    assert!(result["accuracy"].as_f64().unwrap() > 0.85, "{result}");
}

/// A step whose loss is not finite stops the run (the engine rolls back),
/// with the same hint.
#[test]
fn a_non_finite_loss_fails_with_the_learning_rate_hint() {
    let dir = scratch("non-finite");
    let model = dir.join("m.canopy").display().to_string();
    let out_path = dir.join("t.canopy").display().to_string();
    new_digits_mlp(&model, "sgd");
    let out = train(&model, &out_path, "3", &["--lr", "100"]);
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(stderr.contains("diverged"), "{stderr}");
    assert!(
        stderr.contains(
            "hint: train with a smaller learning rate, e.g. --lr 10 (sgd's default is 0.1)"
        ),
        "{stderr}"
    );
    assert!(!Path::new(&out_path).exists());
}
