//! What `canopy` writes where, as a script and a person see it: `--json`
//! prints one JSON document and nothing else on stdout; logs go to stderr,
//! in colour only on a terminal (never with `NO_COLOR`); `model bench` on
//! a software GPU adapter says so; `--data` given a file says so.

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::{canopy, repo, scratch, succeeded};

/// The whole of stdout as one JSON document: what `| jq` needs.
fn stdout_json(out: &Output, what: &str) -> serde_json::Value {
    succeeded(out, what);
    serde_json::from_slice(&out.stdout).unwrap_or_else(|error| {
        panic!(
            "{what}: stdout is not one JSON document ({error}):\n{}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

fn digits_logreg(dir: &Path) -> String {
    let model = dir.join("logreg.canopy").display().to_string();
    let out = canopy(&[
        "model",
        "new",
        "logreg",
        "--inputs",
        "64",
        "--classes",
        "10",
        "-o",
        &model,
    ]);
    succeeded(&out, "model new");
    model
}

/// An MNIST-shaped IDX folder of `train` and `test` samples of noise: what
/// `model bench` needs to run its workloads, small enough to run in a test.
fn tiny_mnist(dir: &Path, train: u32, test: u32) -> String {
    fn write(dir: &Path, split: &str, samples: u32) {
        let mut images = vec![0, 0, 8, 3];
        for dimension in [samples, 28, 28] {
            images.extend_from_slice(&dimension.to_be_bytes());
        }
        images.extend((0..samples * 28 * 28).map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8));
        let mut labels = vec![0, 0, 8, 1];
        labels.extend_from_slice(&samples.to_be_bytes());
        labels.extend((0..samples).map(|i| (i % 10) as u8));
        std::fs::write(dir.join(format!("{split}-images-idx3-ubyte")), images).unwrap();
        std::fs::write(dir.join(format!("{split}-labels-idx1-ubyte")), labels).unwrap();
    }
    let data = dir.join("tiny-mnist");
    std::fs::create_dir_all(&data).unwrap();
    write(&data, "train", train);
    write(&data, "test", test);
    data.display().to_string()
}

#[test]
fn model_eval_json_prints_only_json() {
    let dir = scratch("eval-json");
    let model = digits_logreg(&dir);
    let data = repo().join("datasets/digits").display().to_string();
    let out = canopy(&[
        "model",
        "eval",
        &model,
        "--data",
        &data,
        "--json",
        "--backend",
        "cpu",
    ]);
    let eval = stdout_json(&out, "model eval --json");
    assert!(eval["accuracy"].is_f64(), "{eval}");
    assert!(eval["samples"].as_u64() > Some(0), "{eval}");
    // Without --json: the human line, and no JSON.
    let out = canopy(&["model", "eval", &model, "--data", &data, "--backend", "cpu"]);
    succeeded(&out, "model eval");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("accuracy") && !text.contains('{'), "{text}");
}

#[test]
fn model_train_json_prints_only_json() {
    let dir = scratch("train-json");
    let model = digits_logreg(&dir);
    let data = repo().join("datasets/digits").display().to_string();
    let trained = dir.join("trained.canopy").display().to_string();
    let out = canopy(&[
        "model",
        "train",
        &model,
        "--data",
        &data,
        "--epochs",
        "2",
        "--json",
        "--backend",
        "cpu",
        "-o",
        &trained,
    ]);
    let train = stdout_json(&out, "model train --json");
    assert!(train["accuracy"].as_f64() > Some(0.5), "{train}");
    assert_eq!(train["epochs"], 2, "{train}");
    // The epochs and the written file are still told, on stderr.
    let told = String::from_utf8_lossy(&out.stderr);
    assert!(
        told.contains("epoch   2/2") && told.contains("wrote"),
        "{told}"
    );
}

#[test]
fn model_bench_json_prints_only_json() {
    let dir = scratch("bench-json");
    let data = tiny_mnist(&dir, 1024, 64);
    let out = canopy(&[
        "model",
        "bench",
        "--data",
        &data,
        "--epochs",
        "1",
        "--charlm-steps",
        "1",
        "--json",
        "--backend",
        "cpu",
    ]);
    let bench = stdout_json(&out, "model bench --json");
    assert_eq!(bench["backend"], "cpu", "{bench}");
    // Without --workloads, every workload's figures.
    let figures = keys(&bench);
    assert_eq!(
        figures,
        [
            "adapter",
            "backend",
            "backward_forward_ratio",
            "charlm_train_samples_per_s",
            "lenet5_backward_forward_ratio",
            "lenet5_frozen_backbone_step_ms",
            "lenet5_full_step_ms",
            "lenet5_train_samples_per_s",
            "matmul_gflops",
            "mlp_train_samples_per_s",
            "mlp_train_step_nodes_after_passes",
            "mlp_train_step_nodes_before_passes",
            "threads",
            "train_step_cpu_fusion",
        ]
    );
    for figure in ["mlp_train_samples_per_s", "charlm_train_samples_per_s"] {
        assert!(bench[figure].as_f64() > Some(0.0), "{figure}: {bench}");
    }
    let fusion = &bench["train_step_cpu_fusion"]["charlm"];
    assert!(
        fusion["after_fusion"].as_u64() < fusion["nodes"].as_u64(),
        "{bench}"
    );
    assert!(bench["adapter"].is_null(), "{bench}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("software"),
        "no adapter, no warning: {stderr}"
    );
}

/// A JSON object's keys, sorted.
fn keys(object: &serde_json::Value) -> Vec<&str> {
    let mut keys: Vec<&str> = object
        .as_object()
        .expect("a JSON object")
        .keys()
        .map(String::as_str)
        .collect();
    keys.sort_unstable();
    keys
}

/// `--backend gpu` takes any adapter, lavapipe in CI: the figures then come
/// from the CPU, and the bench says so (on stderr, and as
/// `adapter.software` in the JSON).
#[test]
fn model_bench_on_a_software_adapter_says_so() {
    if std::env::var("CANOPY_TEST_BACKENDS").as_deref() == Ok("cpu") {
        return;
    }
    // Matrix products alone: a whole bench on lavapipe took 73 s, and the
    // warning comes before any workload.
    let out = canopy(&[
        "model",
        "bench",
        "--workloads",
        "matmul",
        "--json",
        "--backend",
        "gpu",
    ]);
    let bench = stdout_json(&out, "model bench --backend gpu --json");
    let figures = keys(&bench);
    assert_eq!(
        figures,
        ["adapter", "backend", "matmul_gflops", "threads"],
        "--workloads matmul measures matmul alone"
    );
    let adapter = &bench["adapter"];
    let software = adapter["device_type"] == "cpu";
    assert_eq!(adapter["software"], software, "{bench}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let warned = stderr.contains("is a software implementation")
        && stderr.contains("these figures are not a GPU's");
    assert_eq!(warned, software, "adapter {adapter}, stderr: {stderr}");
}

/// Logs redirected to a file carry no colour codes; on a terminal they do,
/// unless `NO_COLOR` is set. `script` gives the command a terminal.
#[test]
fn logs_are_coloured_only_on_a_terminal() {
    let dir = scratch("colour");
    let model = digits_logreg(&dir);
    let trained = dir.join("t.canopy").display().to_string();
    let data = repo().join("datasets/digits").display().to_string();
    let train = [
        "model", "train", &model, "--data", &data, "--epochs", "1", "-o", &trained,
    ];
    // `debug` logs every epoch's end, so there is a log line to look at.
    let redirected = Command::new(env!("CARGO_BIN_EXE_canopy"))
        .args(train)
        .env("CANOPY_LOG", "debug")
        .env_remove("NO_COLOR")
        .output()
        .unwrap();
    succeeded(&redirected, "model train");
    assert!(!redirected.stderr.is_empty(), "debug logs something");
    assert!(
        !redirected.stderr.contains(&0x1b),
        "ANSI codes in redirected logs: {}",
        String::from_utf8_lossy(&redirected.stderr)
    );
    assert!(!redirected.stdout.contains(&0x1b), "ANSI codes on stdout");

    let on_terminal = |no_color: Option<&str>| -> Vec<u8> {
        let command_line = std::iter::once(env!("CARGO_BIN_EXE_canopy"))
            .chain(train)
            .map(shell_quote)
            .collect::<Vec<_>>()
            .join(" ");
        let mut script = Command::new("script");
        script
            .args(["-q", "-e", "-c", &command_line, "/dev/null"])
            .env("CANOPY_LOG", "debug")
            .env("TERM", "xterm");
        match no_color {
            Some(value) => script.env("NO_COLOR", value),
            None => script.env_remove("NO_COLOR"),
        };
        let out = script
            .output()
            .expect("`script` (util-linux) gives the command a terminal");
        succeeded(&out, "model train under script");
        out.stdout
    };
    let coloured = String::from_utf8_lossy(&on_terminal(None)).to_string();
    assert!(
        has_log_colour(&coloured),
        "a terminal gets coloured logs: {coloured:?}"
    );
    let plain = String::from_utf8_lossy(&on_terminal(Some("1"))).to_string();
    assert!(plain.contains("epoch done"), "{plain:?}");
    assert!(
        !has_log_colour(&plain),
        "NO_COLOR logs carry no colour: {plain:?}"
    );
}

/// Whether `text` holds the SGR codes tracing colours a log line with (a
/// dimmed time, a coloured level); the progress bar's cursor codes are
/// not colour.
fn has_log_colour(text: &str) -> bool {
    text.contains("\x1b[2m") || text.contains("\x1b[3")
}

/// On a terminal, `model bench` shows its steps as a bar on stderr, while
/// stdout (`--json`) stays one JSON document.
#[test]
fn model_bench_shows_its_progress_on_a_terminal() {
    let dir = scratch("bench-progress");
    let data = tiny_mnist(&dir, 1024, 64);
    let json = dir.join("bench.json");
    let command_line = format!(
        "{} model bench --data {} --epochs 1 --charlm-steps 1 --json --backend cpu > {}",
        shell_quote(env!("CARGO_BIN_EXE_canopy")),
        shell_quote(&data),
        shell_quote(&json.display().to_string())
    );
    let out = Command::new("script")
        .args(["-q", "-e", "-c", &command_line, "/dev/null"])
        .env("CANOPY_LOG", "warn")
        .env("TERM", "xterm")
        .output()
        .expect("`script` (util-linux) gives the command a terminal");
    succeeded(&out, "model bench under script");
    let terminal = String::from_utf8_lossy(&out.stdout);
    assert!(
        terminal.contains("/8 charlm training") && terminal.contains("/8 matmul"),
        "the bar names the steps: {terminal:?}"
    );
    let written = std::fs::read(&json).unwrap();
    let bench: serde_json::Value = serde_json::from_slice(&written)
        .unwrap_or_else(|error| panic!("{error}: {}", String::from_utf8_lossy(&written)));
    assert!(
        bench["matmul_gflops"]["256"].as_f64() > Some(0.0),
        "{bench}"
    );
}

fn shell_quote(arg: &str) -> String {
    format!("'{}'", arg.replace('\'', r"'\''"))
}

/// `--data` names a folder; a file there is named as the mix-up, with the
/// folder to give instead.
#[test]
fn a_file_given_as_data_folder_is_named_with_a_hint() {
    let dir = scratch("data-file");
    let model = digits_logreg(&dir);
    let out_path = dir.join("o.canopy").display().to_string();
    let csv = dir.join("digits.csv");
    std::fs::write(&csv, "0,1,2\n").unwrap();
    let csv = csv.display().to_string();
    for args in [
        vec!["model", "stats", &model, "--data", &csv, "-o", &out_path],
        vec!["model", "eval", &model, "--data", &csv],
    ] {
        let out = canopy(&args);
        assert!(!out.status.success(), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.starts_with("error:"), "{stderr}");
        assert!(
            stderr.contains("this is a file, but a dataset is a folder"),
            "{args:?}: {stderr}"
        );
        assert!(!stderr.contains("cannot list folder"), "{stderr}");
        assert!(
            stderr.contains(&format!(
                "hint: --data takes a folder: give `--data {}`",
                dir.display()
            )),
            "{args:?}: {stderr}"
        );
    }
}
