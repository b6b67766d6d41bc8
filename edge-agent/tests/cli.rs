//! The `canopy-agent` binary as an operator runs it, each test in its own
//! temporary data directory: install, data registration, status, offline
//! training and evaluation on the bundled digits, and enrollment failures
//! that leave nothing half-written. Enrollment and the daemon against a
//! real `canopy-server` are covered by the workspace's end-to-end tests.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use canopy_engine::optim::Optimizer;
use canopy_engine::zoo::{Architecture, ModelConfig, build_model};

fn agent(data_dir: &Path, args: &[&str]) -> Output {
    agent_logging(data_dir, args, "warn")
}

/// [`agent`] with its log filter (`CANOPY_LOG`) at `level`.
fn agent_logging(data_dir: &Path, args: &[&str], level: &str) -> Output {
    Command::new(env!("CARGO_BIN_EXE_canopy-agent"))
        .arg("--data-dir")
        .arg(data_dir)
        .args(args)
        .env("CANOPY_LOG", level)
        .env_remove("CANOPY_AGENT_DIR")
        .env_remove("CANOPY_ENROLL_TOKEN")
        .output()
        .expect("the canopy-agent binary runs")
}

fn digits() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../datasets/digits/digits.csv.gz")
        .display()
        .to_string()
}

fn ok(out: Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "canopy-agent failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Asserts a clean failure in the house style and returns stderr.
fn fails(out: Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "expected failure, stderr: {stderr}");
    assert!(!stderr.contains("panicked"), "panic: {stderr}");
    assert!(stderr.starts_with("error:"), "house error style: {stderr}");
    stderr
}

/// Every file under `dir`, relative.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                out.extend(files_under(&path));
            } else {
                out.push(path);
            }
        }
    }
    out
}

/// A fresh logistic-regression model file, as `canopy model new logreg
/// --inputs 64 --classes 10` writes it.
fn logreg_model(dir: &Path) -> String {
    logreg_model_with(dir, "sgd")
}

/// A logistic regression whose `train_step` runs `optimizer`.
fn logreg_model_with(dir: &Path, optimizer: &str) -> String {
    let model = build_model(&ModelConfig {
        architecture: Architecture::LogReg {
            inputs: 64,
            classes: 10,
        },
        seed: 0,
        optimizer: Optimizer::parse(optimizer).unwrap(),
        frozen_prefixes: Vec::new(),
        producer: "canopy-agent test".into(),
    })
    .unwrap();
    let path = dir.join(format!("logreg-{optimizer}.canopy"));
    std::fs::write(&path, canopy_ir::format::write_model(&model).unwrap()).unwrap();
    path.display().to_string()
}

/// The value after `label` on the line that starts with it.
fn number_after(stdout: &str, label: &str) -> f64 {
    let line = stdout
        .lines()
        .find(|l| l.starts_with(label))
        .unwrap_or_else(|| panic!("no `{label}` line in:\n{stdout}"));
    line[label.len()..]
        .split_whitespace()
        .next()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no number after `{label}` in `{line}`"))
}

/// An existing user for `install --user`, so tests never create system
/// users: `nobody` when the tests run as root (install refuses root
/// itself), otherwise the current user, the only one an unprivileged
/// process can give files to.
struct ServiceUser {
    name: String,
    uid: u32,
}

#[cfg(unix)]
fn service_user(tmp: &Path) -> ServiceUser {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let probe = tmp.join(".uid");
    std::fs::write(&probe, b"").unwrap();
    let my_uid = std::fs::metadata(&probe).unwrap().uid();
    std::fs::remove_file(&probe).unwrap();
    let name = if my_uid == 0 {
        // nobody must be able to reach the data directory inside.
        std::fs::set_permissions(tmp, std::fs::Permissions::from_mode(0o755)).unwrap();
        "nobody".to_string()
    } else {
        let out = Command::new("id").arg("-un").output().unwrap();
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    };
    let entry = Command::new("getent")
        .args(["passwd", &name])
        .output()
        .unwrap();
    let entry = String::from_utf8(entry.stdout).unwrap();
    let uid = entry.split(':').nth(2).unwrap().parse().unwrap();
    ServiceUser { name, uid }
}

#[test]
fn install_dry_run_writes_nothing_and_shows_the_unit() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("agent");
    let prefix = tmp.path().join("prefix");
    let stdout = ok(agent(
        &data,
        &["install", "--dry-run", "--prefix", prefix.to_str().unwrap()],
    ));
    assert!(stdout.contains("[Service]"), "{stdout}");
    let exec = format!(
        "ExecStart={}/bin/canopy-agent --data-dir {} run",
        prefix.display(),
        data.display()
    );
    assert!(stdout.contains(&exec), "expected `{exec}` in:\n{stdout}");
    assert!(
        stdout.contains("[run]"),
        "shows the settings file: {stdout}"
    );
    assert!(files_under(tmp.path()).is_empty(), "dry run wrote files");
    assert!(
        !data.exists() && !prefix.exists(),
        "dry run created folders"
    );
}

#[test]
fn install_writes_the_unit_and_settings_and_keeps_edited_settings() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("agent");
    let prefix = tmp.path().join("prefix");
    let prefix_arg = prefix.to_str().unwrap();
    let user = service_user(tmp.path());
    let stdout = ok(agent(
        &data,
        &["install", "--prefix", prefix_arg, "--user", &user.name],
    ));
    let unit_path = prefix.join("lib/systemd/system/canopy-agent.service");
    let unit = std::fs::read_to_string(&unit_path).expect("unit written");
    assert!(unit.contains(&format!(
        "ExecStart={}/bin/canopy-agent --data-dir {} run\n",
        prefix.display(),
        data.display()
    )));
    assert!(unit.contains("WantedBy=multi-user.target"));
    assert!(unit.contains(&format!("ReadWritePaths={}", data.display())));
    let settings = data.join("config.toml");
    let text = std::fs::read_to_string(&settings).expect("settings written");
    assert!(text.contains("[run]"), "{text}");
    assert!(stdout.contains("next steps"), "{stdout}");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&data).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode & 0o077, 0, "the data dir is private: {mode:o}");
    }
    std::fs::write(&settings, "[run]\nmax_threads = 1\n").unwrap();
    let again = ok(agent(
        &data,
        &["install", "--prefix", prefix_arg, "--user", &user.name],
    ));
    assert!(again.contains("kept existing settings"), "{again}");
    assert_eq!(
        std::fs::read_to_string(&settings).unwrap(),
        "[run]\nmax_threads = 1\n"
    );
}

#[test]
fn data_add_reports_the_digits_and_data_list_shows_them() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("agent");
    let stdout = ok(agent(
        &data,
        &[
            "data",
            "add",
            "digits",
            "--kind",
            "csv",
            "--path",
            &digits(),
        ],
    ));
    assert!(stdout.contains("1797 samples"), "{stdout}");
    assert!(stdout.contains("[64]"), "feature shape: {stdout}");
    assert!(stdout.contains("10 classes"), "{stdout}");
    assert!(
        stdout.contains("default"),
        "the first is the default: {stdout}"
    );
    ok(agent(
        &data,
        &["data", "add", "more", "--kind", "csv", "--path", &digits()],
    ));
    let registry = std::fs::read_to_string(data.join("datasets.toml")).unwrap();
    assert!(registry.contains("default = \"digits\""), "{registry}");
    let list = ok(agent(&data, &["data", "list"]));
    let digits_line = list.lines().find(|l| l.contains("digits")).expect("listed");
    assert!(digits_line.starts_with('*'), "default marked: {list}");
    assert!(digits_line.contains("1797"), "{list}");
    assert!(
        list.lines()
            .any(|l| l.contains("more") && l.starts_with(' ')),
        "{list}"
    );
}

#[test]
fn data_list_with_nothing_registered_says_how_to_add() {
    let tmp = tempfile::tempdir().unwrap();
    let stdout = ok(agent(tmp.path(), &["data", "list"]));
    assert!(stdout.contains("no datasets registered"), "{stdout}");
}

#[test]
fn data_add_of_a_missing_or_corrupt_file_fails_and_registers_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("agent");
    let missing = tmp.path().join("nope.csv");
    let stderr = fails(agent(
        &data,
        &[
            "data",
            "add",
            "x",
            "--kind",
            "csv",
            "--path",
            missing.to_str().unwrap(),
        ],
    ));
    assert!(stderr.contains("nope.csv"), "names the file: {stderr}");
    assert!(stderr.contains("dataset `x` was not added"), "{stderr}");
    assert!(
        stderr.to_lowercase().contains("no such file"),
        "names the cause: {stderr}"
    );

    let corrupt = tmp.path().join("corrupt.csv.gz");
    std::fs::write(&corrupt, [0x1f, 0x8b, 0x08, 0x00, 1, 2, 3, 4, 5, 6, 7]).unwrap();
    let stderr = fails(agent(
        &data,
        &[
            "data",
            "add",
            "x",
            "--kind",
            "csv",
            "--path",
            corrupt.to_str().unwrap(),
        ],
    ));
    assert!(stderr.contains("corrupt.csv.gz"), "{stderr}");
    assert!(stderr.contains("gzip"), "names the cause: {stderr}");

    let ragged = tmp.path().join("ragged.csv");
    std::fs::write(&ragged, "1,2,3\n4,5\n").unwrap();
    let stderr = fails(agent(
        &data,
        &[
            "data",
            "add",
            "x",
            "--kind",
            "csv",
            "--path",
            ragged.to_str().unwrap(),
        ],
    ));
    assert!(stderr.contains("ragged.csv"), "{stderr}");

    let stderr = fails(agent(
        &data,
        &[
            "data",
            "add",
            "x",
            "--kind",
            "idx",
            "--path",
            tmp.path().to_str().unwrap(),
        ],
    ));
    assert!(stderr.contains("no IDX images file"), "{stderr}");
    assert!(stderr.contains("hint:"), "{stderr}");

    let stderr = fails(agent(
        &data,
        &[
            "data",
            "add",
            "bad name",
            "--kind",
            "csv",
            "--path",
            &digits(),
        ],
    ));
    assert!(stderr.contains("dataset name `bad name`"), "{stderr}");
    assert!(!data.join("datasets.toml").exists(), "nothing registered");
}

#[test]
fn idx_folders_load_their_training_pair() {
    let tmp = tempfile::tempdir().unwrap();
    let mnist = Path::new(env!("CARGO_MANIFEST_DIR")).join("../datasets/mnist-10k");
    let stdout = ok(agent(
        tmp.path(),
        &[
            "data",
            "add",
            "mnist",
            "--kind",
            "idx",
            "--path",
            mnist.to_str().unwrap(),
        ],
    ));
    assert!(stdout.contains("[1, 28, 28]"), "{stdout}");
    assert!(stdout.contains("10 classes"), "{stdout}");
}

#[test]
fn status_when_not_enrolled_says_so() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("agent");
    let stdout = ok(agent(&data, &["status"]));
    assert!(stdout.contains("enrolled:      no"), "{stdout}");
    assert!(stdout.contains("canopy-agent enroll"), "says how: {stdout}");
    let json: serde_json::Value =
        serde_json::from_str(ok(agent(&data, &["status", "--json"])).trim()).expect("JSON");
    assert_eq!(json["enrolled"], false, "{json}");
    assert!(json["daemon"].is_null(), "{json}");
    assert!(!data.exists(), "status writes nothing");
}

#[test]
fn run_without_enrollment_fails_with_a_hint() {
    let tmp = tempfile::tempdir().unwrap();
    let stderr = fails(agent(tmp.path(), &["run"]));
    assert!(stderr.contains("not enrolled"), "{stderr}");
    assert!(
        stderr.contains("hint: run `canopy-agent enroll"),
        "{stderr}"
    );
}

#[test]
fn train_local_on_the_digits_improves_held_out_accuracy() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("agent");
    let model = logreg_model(tmp.path());
    ok(agent(
        &data,
        &[
            "data",
            "add",
            "digits",
            "--kind",
            "csv",
            "--path",
            &digits(),
        ],
    ));
    let stdout = ok(agent(
        &data,
        &[
            "train", "--local", "--model", &model, "--epochs", "5", "--batch", "32", "--lr", "0.1",
        ],
    ));
    let before = number_after(&stdout, "held-out accuracy before:");
    let after = number_after(&stdout, "held-out accuracy after:");
    assert!(before < 0.3, "an untrained model guesses: {stdout}");
    assert!(after > 0.85, "five epochs learn the digits: {stdout}");
    assert!(
        stdout.contains("1618 training samples, 179 held out"),
        "{stdout}"
    );
}

/// Without `--lr`, an Adam model trains at Adam's rate (0.001), not SGD's
/// 0.1, and learns.
#[test]
fn train_takes_the_models_optimizers_learning_rate() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("agent");
    let model = logreg_model_with(tmp.path(), "adam");
    ok(agent(
        &data,
        &[
            "data",
            "add",
            "digits",
            "--kind",
            "csv",
            "--path",
            &digits(),
        ],
    ));
    let train = ["train", "--local", "--model", &model, "--epochs", "20"];
    let output = agent_logging(&data, &train, "info");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stdout}{stderr}");
    assert!(
        stderr.contains("learning rate 0.001, adam's default"),
        "{stderr}"
    );
    let after = number_after(&stdout, "held-out accuracy after:");
    assert!(
        after > 0.85,
        "twenty epochs of Adam learn the digits: {stdout}"
    );
}

#[test]
fn train_needs_local_and_sane_arguments() {
    let tmp = tempfile::tempdir().unwrap();
    let model = logreg_model(tmp.path());
    let stderr = fails(agent(tmp.path(), &["train", "--model", &model]));
    assert!(stderr.contains("hint: pass --local"), "{stderr}");
    let stderr = fails(agent(
        tmp.path(),
        &["train", "--local", "--model", &model, "--epochs", "0"],
    ));
    assert!(stderr.contains("--epochs 0 is out of range"), "{stderr}");
    let stderr = fails(agent(tmp.path(), &["train", "--local", "--model", &model]));
    assert!(stderr.contains("no dataset is registered"), "{stderr}");
    assert!(stderr.contains("hint:"), "{stderr}");
}

#[test]
fn eval_json_prints_one_json_object() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("agent");
    let model = logreg_model(tmp.path());
    let stdout = ok(agent(
        &data,
        &[
            "eval",
            "--model",
            &model,
            "--kind",
            "csv",
            "--path",
            &digits(),
            "--json",
        ],
    ));
    let json: serde_json::Value = serde_json::from_str(stdout.trim()).expect("one JSON object");
    let accuracy = json["accuracy"].as_f64().expect("accuracy");
    assert!((0.0..=1.0).contains(&accuracy), "{json}");
    assert!(json["loss"].as_f64().expect("loss") > 0.0, "{json}");
    // 10% of each class, rounded: 179 of 1797.
    assert_eq!(json["samples"], 179, "the held-out 10%: {json}");

    ok(agent(
        &data,
        &[
            "data",
            "add",
            "digits",
            "--kind",
            "csv",
            "--path",
            &digits(),
        ],
    ));
    let by_name: serde_json::Value = serde_json::from_str(
        ok(agent(
            &data,
            &["eval", "--model", &model, "--dataset", "digits", "--json"],
        ))
        .trim(),
    )
    .unwrap();
    assert_eq!(by_name, json, "same held-out split either way");
}

#[test]
fn eval_fails_clearly_on_bad_input() {
    let tmp = tempfile::tempdir().unwrap();
    let junk = tmp.path().join("junk.canopy");
    std::fs::write(&junk, b"not a model").unwrap();
    let stderr = fails(agent(
        tmp.path(),
        &[
            "eval",
            "--model",
            junk.to_str().unwrap(),
            "--kind",
            "csv",
            "--path",
            &digits(),
        ],
    ));
    assert!(
        stderr.contains("junk.canopy` is not a valid Canopy model file"),
        "{stderr}"
    );
    assert!(stderr.contains("Caused by:"), "{stderr}");

    // A model for other inputs: the shapes are named.
    let model = build_model(&ModelConfig {
        architecture: Architecture::LogReg {
            inputs: 10,
            classes: 10,
        },
        seed: 0,
        optimizer: Optimizer::parse("sgd").unwrap(),
        frozen_prefixes: Vec::new(),
        producer: "test".into(),
    })
    .unwrap();
    let path = tmp.path().join("ten.canopy");
    std::fs::write(&path, canopy_ir::format::write_model(&model).unwrap()).unwrap();
    let stderr = fails(agent(
        tmp.path(),
        &[
            "eval",
            "--model",
            path.to_str().unwrap(),
            "--kind",
            "csv",
            "--path",
            &digits(),
        ],
    ));
    assert!(
        stderr.contains("[64]") && stderr.contains("[10]"),
        "{stderr}"
    );

    let stderr = fails(agent(
        tmp.path(),
        &[
            "eval",
            "--model",
            path.to_str().unwrap(),
            "--dataset",
            "nope",
        ],
    ));
    assert!(
        stderr.contains("dataset `nope` is not registered"),
        "{stderr}"
    );
}

/// A valid Ed25519 public key (the curve's base point), for hand-written
/// enrollments.
const ED25519_BASEPOINT: &str = "5866666666666666666666666666666666666666666666666666666666666666";

/// A local port nothing listens on.
fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

#[test]
fn enroll_against_an_unreachable_server_fails_and_writes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("agent");
    let port = closed_port();
    let fingerprint = format!("sha256:{}", "ab".repeat(32));
    for (server, trust) in [
        (
            format!("https://127.0.0.1:{port}"),
            Some(fingerprint.as_str()),
        ),
        (format!("http://127.0.0.1:{port}"), None),
        // No trust flag: public CA roots.
        (format!("https://127.0.0.1:{port}"), None),
    ] {
        let mut args = vec![
            "enroll", "--server", &server, "--token", "t0ken", "--tag", "site=lab",
        ];
        if let Some(trust) = trust {
            args.extend_from_slice(&["--fingerprint", trust]);
        }
        let stderr = fails(agent(&data, &args));
        assert!(
            stderr.contains(&format!(
                "enrollment with `{server}` failed; nothing was written"
            )),
            "{stderr}"
        );
        assert!(stderr.contains("cannot reach the server"), "{stderr}");
        assert!(stderr.contains("hint: check --server"), "{stderr}");
        assert!(!data.join("agent.toml").exists(), "no enrollment written");
        assert!(!data.join("device.key").exists(), "no key written");
        assert!(
            files_under(tmp.path()).is_empty(),
            "nothing at all written: {:?}",
            files_under(tmp.path())
        );
    }
}

#[test]
fn enroll_checks_its_arguments_before_calling_the_server() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("agent");
    let server = format!("https://127.0.0.1:{}", closed_port());
    let missing = tmp.path().join("missing-ca.pem");
    let stderr = fails(agent(
        &data,
        &[
            "enroll",
            "--server",
            &server,
            "--token",
            "t",
            "--ca-cert",
            missing.to_str().unwrap(),
        ],
    ));
    assert!(stderr.contains("missing-ca.pem` is not a file"), "{stderr}");
    let stderr = fails(agent(
        &data,
        &[
            "enroll",
            "--server",
            &server,
            "--token",
            "t",
            "--fingerprint",
            "ab",
            "--ca-cert",
            "x",
        ],
    ));
    assert!(
        stderr.contains("cannot be used with"),
        "one trust at a time: {stderr}"
    );
    let stderr = fails(agent(
        &data,
        &[
            "enroll",
            "--server",
            &server,
            "--token",
            "t",
            "--fingerprint",
            "sha256:xyz",
        ],
    ));
    assert!(stderr.contains("fingerprint `sha256:xyz`"), "{stderr}");
    let stderr = fails(agent(
        &data,
        &[
            "enroll",
            "--server",
            "ftp://x",
            "--token",
            "t",
            "--fingerprint",
            "ab",
        ],
    ));
    assert!(stderr.contains("not an http(s) URL"), "{stderr}");
    let stderr = fails(agent(
        &data,
        &[
            "enroll",
            "--server",
            &server,
            "--token",
            "t",
            "--fingerprint",
            &"ab".repeat(32),
            "--tag",
            "bad key=v",
        ],
    ));
    assert!(
        stderr.contains("capabilities.tags key `bad key`"),
        "{stderr}"
    );
    assert!(files_under(tmp.path()).is_empty());
}

/// `--backend npu` offers the NPU only where ONNX Runtime opens: with a
/// library that is not there, enrolment stops before calling the server,
/// names the library and says how to get one.
#[test]
fn enroll_on_the_npu_without_onnx_runtime_fails_with_a_hint() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("agent");
    let server = format!("https://127.0.0.1:{}", closed_port());
    let library = tmp.path().join("missing").join("libonnxruntime.so");
    let stderr = fails(agent(
        &data,
        &[
            "enroll",
            "--server",
            &server,
            "--token",
            "t",
            "--fingerprint",
            &"ab".repeat(32),
            "--backend",
            "npu",
            "--ort-library",
            library.to_str().unwrap(),
        ],
    ));
    assert!(
        stderr.contains("cannot offer the NPU backend")
            && stderr.contains("missing/libonnxruntime.so"),
        "{stderr}"
    );
    assert!(
        stderr.contains("hint:") && stderr.contains("--ort-library"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("enrollment with"),
        "the server is not called: {stderr}"
    );
    let stderr = fails(agent(
        &data,
        &[
            "enroll",
            "--server",
            &server,
            "--token",
            "t",
            "--fingerprint",
            &"ab".repeat(32),
            "--backend",
            "npu",
            "--ort-providers",
            "cpu,tpu",
        ],
    ));
    assert!(
        stderr.contains("--ort-providers") && stderr.contains("`tpu`"),
        "{stderr}"
    );
    assert!(files_under(tmp.path()).is_empty());
}

#[test]
fn enroll_refuses_to_replace_an_enrollment_without_force() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("agent");
    std::fs::create_dir_all(&data).unwrap();
    let old_server = format!("https://127.0.0.1:{}", closed_port());
    let enrollment = format!(
        "server = \"{old_server}\"\ndevice_id = 42\nserver_public_key = \"{}\"\n\
         heartbeat_interval_ms = 15000\nenrolled_unix_ms = 1\n\n[trust]\nkind = \"fingerprint\"\nsha256 = \"sha256:{}\"\n",
        ED25519_BASEPOINT,
        "cd".repeat(32)
    );
    std::fs::write(data.join("agent.toml"), &enrollment).unwrap();
    let server = format!("http://127.0.0.1:{}", closed_port());
    let stderr = fails(agent(
        &data,
        &["enroll", "--server", &server, "--token", "t"],
    ));
    assert!(
        stderr.contains(&format!("already enrolled (device 42 with {old_server})")),
        "{stderr}"
    );
    assert!(stderr.contains("hint: pass --force"), "{stderr}");
    // With --force it goes on to the server (unreachable here), and the
    // old enrollment survives the failure.
    let stderr = fails(agent(
        &data,
        &["enroll", "--server", &server, "--token", "t", "--force"],
    ));
    assert!(stderr.contains("cannot reach the server"), "{stderr}");
    assert_eq!(
        std::fs::read_to_string(data.join("agent.toml")).unwrap(),
        enrollment
    );

    let status = ok(agent(&data, &["status"]));
    assert!(status.contains("enrolled:      yes, device 42"), "{status}");
    assert!(status.contains("reachable:     no"), "{status}");
}

/// The write end of a pipe whose read end is already closed: every
/// write to it fails with EPIPE, with no race against the reader.
fn closed_pipe() -> std::process::Stdio {
    let (reader, writer) = std::io::pipe().expect("a pipe");
    drop(reader);
    writer.into()
}

/// Runs `canopy-agent` with stdout a pipe whose read end is closed before
/// the agent writes anything, as `… | head -0` or a reader that quit.
fn agent_with_closed_stdout(data_dir: &Path, args: &[&str]) -> Output {
    let child = Command::new(env!("CARGO_BIN_EXE_canopy-agent"))
        .arg("--data-dir")
        .arg(data_dir)
        .args(args)
        .env("CANOPY_LOG", "warn")
        .env_remove("CANOPY_AGENT_DIR")
        .stdout(closed_pipe())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("the canopy-agent binary runs");
    child.wait_with_output().expect("canopy-agent exits")
}

/// The exit status a closed stdout gives (see the `canopy-term` crate).
const STDOUT_CLOSED_EXIT: i32 = 141;

#[test]
fn a_closed_stdout_stops_every_command_quietly() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("agent");
    let model = logreg_model(tmp.path());
    let prefix = tmp.path().join("prefix");
    let digits = digits();
    let commands: Vec<Vec<&str>> = vec![
        vec!["--help"],
        vec!["--version"],
        vec!["data", "--help"],
        vec!["status"],
        vec!["status", "--json"],
        vec!["data", "list"],
        vec!["install", "--dry-run", "--prefix", prefix.to_str().unwrap()],
        vec!["data", "add", "digits", "--kind", "csv", "--path", &digits],
        // Now with a dataset registered: a listing with rows.
        vec!["data", "list"],
        vec!["eval", "--model", &model, "--dataset", "digits", "--json"],
        vec![
            "train",
            "--local",
            "--model",
            &model,
            "--epochs",
            "1",
            "--dataset",
            "digits",
        ],
    ];
    for args in commands {
        let out = agent_with_closed_stdout(&data, &args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !stderr.contains("panicked"),
            "`{args:?}` panicked: {stderr}"
        );
        assert!(stderr.is_empty(), "`{args:?}` stops quietly: {stderr}");
        assert_eq!(
            out.status.code(),
            Some(STDOUT_CLOSED_EXIT),
            "`{args:?}`: {stderr}"
        );
    }
    // `data add` registers before it reports, so the dataset is there.
    let list = ok(agent(&data, &["data", "list"]));
    assert!(list.contains("digits"), "{list}");
}

/// Waits up to `limit` for `child` to exit.
fn wait_for_exit(
    child: &mut std::process::Child,
    limit: std::time::Duration,
) -> Option<std::process::ExitStatus> {
    let start = std::time::Instant::now();
    while start.elapsed() < limit {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status);
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    None
}

/// The daemon outlives its stdout and stderr (a journal that went away):
/// it keeps retrying an unreachable server, logging into closed pipes,
/// and still stops cleanly on SIGTERM.
#[cfg(unix)]
#[test]
fn the_daemon_survives_closed_stdout_and_stderr() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("agent");
    ok(agent(
        &data,
        &[
            "data",
            "add",
            "digits",
            "--kind",
            "csv",
            "--path",
            &digits(),
        ],
    ));
    let enrollment = format!(
        "server = \"https://127.0.0.1:{}\"\ndevice_id = 7\nserver_public_key = \"{ED25519_BASEPOINT}\"\n\
         heartbeat_interval_ms = 1000\nenrolled_unix_ms = 1\n\n[trust]\nkind = \"fingerprint\"\nsha256 = \"sha256:{}\"\n",
        closed_port(),
        "cd".repeat(32)
    );
    std::fs::write(data.join("agent.toml"), enrollment).unwrap();
    {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let mut key = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(data.join("device.key"))
            .unwrap();
        writeln!(key, "{}", "11".repeat(32)).unwrap();
    }
    let mut child = Command::new(env!("CARGO_BIN_EXE_canopy-agent"))
        .arg("--data-dir")
        .arg(&data)
        .args(["run", "--poll-wait-ms", "1000"])
        .env("CANOPY_LOG", "debug")
        .env_remove("CANOPY_AGENT_DIR")
        .stdout(closed_pipe())
        .stderr(closed_pipe())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    while !data.join("status.json").exists() && start.elapsed().as_secs() < 30 {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    // Time for heartbeats and polls to fail and be logged.
    std::thread::sleep(std::time::Duration::from_millis(2500));
    assert!(
        child.try_wait().unwrap().is_none(),
        "the daemon died with its output closed: {:?}",
        child.try_wait()
    );
    let status: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(data.join("status.json")).unwrap()).unwrap();
    assert!(
        status["last_error"].is_string(),
        "it did try the server: {status}"
    );
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let exit = wait_for_exit(&mut child, std::time::Duration::from_secs(30));
    assert!(
        exit.is_some_and(|s| s.success()),
        "stops cleanly on SIGTERM: {exit:?}"
    );
}

/// With stderr closed too, an error still ends in exit status 1 (the
/// report is lost, not turned into a panic's 101).
#[test]
fn an_error_with_stderr_closed_exits_1() {
    let tmp = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_canopy-agent"))
        .arg("--data-dir")
        .arg(tmp.path())
        .args(["data", "add", "x", "--kind", "csv", "--path"])
        .arg(tmp.path().join("missing.csv"))
        .env("CANOPY_LOG", "debug")
        .env_remove("CANOPY_AGENT_DIR")
        .stdout(closed_pipe())
        .stderr(closed_pipe())
        .status()
        .unwrap();
    assert_eq!(out.code(), Some(1), "{out:?}");
}

#[cfg(unix)]
#[test]
fn install_gives_the_data_dir_to_a_dedicated_user_and_the_unit_runs_as_it() {
    use std::os::unix::fs::MetadataExt;
    let tmp = tempfile::tempdir().unwrap();
    let user = service_user(tmp.path());
    let data = tmp.path().join("agent");
    let prefix = tmp.path().join("prefix");
    // Something written as the operator before install: install hands it
    // over too.
    ok(agent(
        &data,
        &[
            "data",
            "add",
            "digits",
            "--kind",
            "csv",
            "--path",
            &digits(),
        ],
    ));
    let stdout = ok(agent(
        &data,
        &[
            "install",
            "--prefix",
            prefix.to_str().unwrap(),
            "--user",
            &user.name,
        ],
    ));
    assert!(
        stdout.contains(&format!("user {} exists", user.name)),
        "{stdout}"
    );
    let unit_path = prefix.join("lib/systemd/system/canopy-agent.service");
    let unit = std::fs::read_to_string(&unit_path).unwrap();
    assert!(unit.contains(&format!("\nUser={}\n", user.name)), "{unit}");
    for file in ["", "datasets.toml", "config.toml"] {
        let uid = std::fs::metadata(data.join(file)).unwrap().uid();
        assert_eq!(uid, user.uid, "`{file}` belongs to {}", user.name);
    }
    // What the operator writes afterwards (as root) goes to the user too.
    ok(agent(
        &data,
        &["data", "add", "more", "--kind", "csv", "--path", &digits()],
    ));
    assert_eq!(
        std::fs::metadata(data.join("datasets.toml")).unwrap().uid(),
        user.uid
    );
    verify_unit(&prefix, &unit_path);
}

/// `systemd-analyze verify` on the written unit, when systemd's tools are
/// installed; the binary the unit starts must exist for it.
#[cfg(unix)]
fn verify_unit(prefix: &Path, unit_path: &Path) {
    let bin = prefix.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_canopy-agent"), bin.join("canopy-agent"))
        .unwrap();
    let out = match Command::new("systemd-analyze")
        .arg("verify")
        .arg(unit_path)
        .output()
    {
        Ok(out) => out,
        Err(error) => {
            println!("skipped `systemd-analyze verify`: cannot run systemd-analyze ({error})");
            return;
        }
    };
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "systemd-analyze verify: {stderr}");
    let unit_name = unit_path.display().to_string();
    for line in stderr.lines().filter(|l| l.contains(&unit_name)) {
        // `nobody` is a user systemd warns about by name; anything else
        // about this unit (an unknown key, a bad value) is a defect.
        assert!(
            line.contains("Special user nobody configured"),
            "systemd-analyze verify: {line}"
        );
    }
}

#[test]
fn install_refuses_root_and_a_dry_run_creates_no_user() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("agent");
    let prefix = tmp.path().join("prefix");
    let prefix = prefix.to_str().unwrap();
    let stderr = fails(agent(
        &data,
        &["install", "--prefix", prefix, "--user", "root"],
    ));
    assert!(stderr.contains("must not run as root"), "{stderr}");
    assert!(stderr.contains("hint:"), "{stderr}");
    let missing = "canopy-test-nouser";
    let stdout = ok(agent(
        &data,
        &[
            "install",
            "--dry-run",
            "--prefix",
            prefix,
            "--user",
            missing,
        ],
    ));
    assert!(
        stdout.contains(&format!(
            "would create system user {missing}: useradd --system --user-group"
        )),
        "{stdout}"
    );
    assert!(stdout.contains(&format!("User={missing}")), "{stdout}");
    let looked_up = Command::new("getent")
        .args(["passwd", missing])
        .output()
        .unwrap();
    assert!(!looked_up.status.success(), "the dry run created the user");
    assert!(
        files_under(tmp.path()).is_empty(),
        "the dry run wrote files"
    );
}
