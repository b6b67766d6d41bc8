//! `canopy model export` against ONNX Runtime: the zoo's MLP (on the
//! bundled digits) and LeNet-5 (on MNIST), trained for an epoch, and the
//! recurrent `charlm` (on Hamlet's lines; its GRU loop exports as an ONNX
//! `Scan`), exported (`infer` and `eval`), checked by `onnx.checker` and
//! run by ONNX Runtime in Python (`tests/reference/onnx_export.py`) on 200
//! real samples: the outputs equal `canopy model run`'s to 1e-5. The
//! exported `infer`, imported again with `canopy model import`, gives
//! bit-identical outputs on the CPU backend.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail, ensure};
use common::canopy;
use ndarray::ArrayD;
use ndarray_npy::NpzReader;

const INSTALL_HINT: &str = "hint: pip install -r requirements-dev.txt";
const TOLERANCE: f32 = 1e-5;

fn python() -> String {
    std::env::var("CANOPY_PYTHON").unwrap_or_else(|_| "python3".to_string())
}

fn reference(args: &[&str]) -> Result<()> {
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/reference/onnx_export.py"
    );
    let output = Command::new(python())
        .arg(script)
        .args(args)
        .output()
        .with_context(|| format!("cannot run `{}`; {INSTALL_HINT}", python()))?;
    if !output.status.success() {
        bail!(
            "the ONNX reference script failed ({args:?}): {}\n{INSTALL_HINT}",
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    Ok(())
}

/// Runs `canopy` and returns its stdout, failing with its stderr.
fn canopy_ok(args: &[&str]) -> Result<String> {
    let out = canopy(args);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    ensure!(
        out.status.success(),
        "canopy {args:?} failed:\n{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(stdout)
}

/// Every array of an `.npz` (f32 or i64) as f64, by name.
fn read_npz(path: &Path) -> Result<Vec<(String, String, ArrayD<f64>)>> {
    let mut reader = NpzReader::new(std::fs::File::open(path)?)?;
    let mut arrays = Vec::new();
    for name in reader.names()? {
        let name = name.trim_end_matches(".npy").to_string();
        let floats: Result<ArrayD<f32>, _> = reader.by_name(&name);
        let (dtype, array) = match floats {
            Ok(a) => ("f32", a.mapv(f64::from)),
            Err(_) => {
                let a: ArrayD<i64> = reader.by_name(&name)?;
                ("i64", a.mapv(|v| v as f64))
            }
        };
        arrays.push((name, dtype.to_string(), array));
    }
    arrays.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(arrays)
}

/// The largest difference between two `.npz` files with the same arrays
/// (names, dtypes and shapes).
fn max_difference(got: &Path, want: &Path) -> Result<f64> {
    let (got, want) = (read_npz(got)?, read_npz(want)?);
    let names = |arrays: &[(String, String, ArrayD<f64>)]| -> Vec<(String, String, Vec<usize>)> {
        arrays
            .iter()
            .map(|(n, d, a)| (n.clone(), d.clone(), a.shape().to_vec()))
            .collect()
    };
    ensure!(
        names(&got) == names(&want),
        "{:?} vs {:?}",
        names(&got),
        names(&want)
    );
    let mut worst = 0.0f64;
    for ((name, _, g), (_, _, w)) in got.iter().zip(&want) {
        for (a, b) in g.iter().zip(w) {
            ensure!(a.is_finite() && b.is_finite(), "{name}: {a} vs {b}");
            worst = worst.max((a - b).abs());
        }
    }
    Ok(worst)
}

struct ZooCase {
    name: &'static str,
    new_args: &'static [&'static str],
    data: &'static str,
    samples: &'static str,
}

fn datasets() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../datasets")
}

/// Trains `case` for an epoch and exports it; returns the ONNX files.
fn train_and_export(dir: &Path, case: &ZooCase) -> Result<(PathBuf, PathBuf, PathBuf)> {
    let fresh = dir.join(format!("{}.canopy", case.name));
    let trained = dir.join(format!("{}.trained.canopy", case.name));
    let mut new_args = vec!["model", "new"];
    new_args.extend(case.new_args);
    new_args.extend(["-o", fresh.to_str().unwrap()]);
    canopy_ok(&new_args)?;
    let data = datasets().join(case.data);
    canopy_ok(&[
        "model",
        "train",
        fresh.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--epochs",
        "1",
        "--backend",
        "cpu",
        "-o",
        trained.to_str().unwrap(),
    ])?;
    let (infer, eval) = export_entries(dir, case.name, &trained)?;
    Ok((trained, infer, eval))
}

/// Exports `infer` and `eval` of `model`; returns the ONNX files.
fn export_entries(dir: &Path, name: &str, model: &Path) -> Result<(PathBuf, PathBuf)> {
    let mut files = Vec::new();
    for entry in ["infer", "eval"] {
        let onnx = dir.join(format!("{name}.{entry}.onnx"));
        let stdout = canopy_ok(&[
            "model",
            "export",
            model.to_str().unwrap(),
            "--entry",
            entry,
            "-o",
            onnx.to_str().unwrap(),
        ])?;
        ensure!(
            stdout.contains(&format!("exported `{}`: {entry} (", model.display()))
                && stdout.contains("opset 17 ->"),
            "{stdout}"
        );
        files.push(onnx);
    }
    let [infer, eval] = <[PathBuf; 2]>::try_from(files).expect("two entries");
    Ok((infer, eval))
}

/// `model run` of `entry` on the case's samples into `out`.
fn canopy_run(model: &Path, entry: &str, dir: &Path, samples: &str, out: &Path) -> Result<()> {
    let x = format!("x={}", dir.join(format!("{samples}_x.npy")).display());
    let y = format!("y={}", dir.join(format!("{samples}_y.npy")).display());
    let mut args = vec![
        "model",
        "run",
        model.to_str().unwrap(),
        "--entry",
        entry,
        "--input",
        &x,
        "--backend",
        "cpu",
        "-o",
        out.to_str().unwrap(),
    ];
    if entry == "eval" {
        args.extend(["--input", &y]);
    }
    canopy_ok(&args).map(drop)
}

fn ort_run(onnx: &Path, dir: &Path, samples: &str, with_labels: bool, out: &Path) -> Result<()> {
    let x = format!("x={}", dir.join(format!("{samples}_x.npy")).display());
    let y = format!("y={}", dir.join(format!("{samples}_y.npy")).display());
    let mut args = vec!["run", onnx.to_str().unwrap(), out.to_str().unwrap(), &x];
    if with_labels {
        args.push(&y);
    }
    reference(&args)
}

#[test]
fn trained_zoo_models_export_to_onnx_and_match_onnx_runtime_and_import_back() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let dir = dir.path();
    reference(&[
        "inputs",
        datasets().to_str().unwrap(),
        dir.to_str().unwrap(),
    ])?;
    let cases = [
        ZooCase {
            name: "mlp",
            new_args: &["mlp", "--inputs", "64", "--hidden", "32"],
            data: "digits",
            samples: "digits",
        },
        ZooCase {
            name: "lenet5",
            new_args: &["lenet5"],
            data: "mnist-10k",
            samples: "mnist",
        },
    ];
    for case in &cases {
        let (trained, infer, eval) = train_and_export(dir, case)?;
        for (entry, onnx) in [("infer", &infer), ("eval", &eval)] {
            let ours = dir.join(format!("{}.{entry}.canopy.npz", case.name));
            let theirs = dir.join(format!("{}.{entry}.ort.npz", case.name));
            canopy_run(&trained, entry, dir, case.samples, &ours)?;
            ort_run(onnx, dir, case.samples, entry == "eval", &theirs)?;
            let difference = max_difference(&theirs, &ours)?;
            eprintln!(
                "{} {entry}: ONNX Runtime vs canopy, max |difference| {difference:e}",
                case.name
            );
            ensure!(
                difference <= f64::from(TOLERANCE),
                "{} {entry}: ONNX Runtime differs from canopy by {difference}",
                case.name
            );
        }

        // The export imports back to a model with the same outputs.
        let reimported = dir.join(format!("{}.reimported.canopy", case.name));
        canopy_ok(&[
            "model",
            "import",
            infer.to_str().unwrap(),
            "-o",
            reimported.to_str().unwrap(),
        ])?;
        let original = dir.join(format!("{}.infer.canopy.npz", case.name));
        let again = dir.join(format!("{}.reimported.npz", case.name));
        canopy_run(&reimported, "infer", dir, case.samples, &again)?;
        let difference = max_difference(&again, &original)?;
        eprintln!(
            "{} infer: re-imported vs original, max |difference| {difference:e}",
            case.name
        );
        ensure!(
            difference == 0.0,
            "{}: the re-imported export differs from the original by {difference}",
            case.name
        );
    }
    Ok(())
}

#[test]
fn entry_points_that_cannot_be_exported_are_refused_with_a_hint() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let model = dir.path().join("lenet5.canopy");
    canopy_ok(&["model", "new", "lenet5", "-o", model.to_str().unwrap()])?;
    let onnx = dir.path().join("out.onnx");
    let cases = [
        ("train_step", "a training-graph adjoint"),
        ("predict", "entry point `predict`"),
    ];
    for (entry, cause) in cases {
        let out = canopy(&[
            "model",
            "export",
            model.to_str().unwrap(),
            "--entry",
            entry,
            "-o",
            onnx.to_str().unwrap(),
        ]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{entry} was exported");
        assert!(
            stderr.contains("cannot export") && stderr.contains(cause) && stderr.contains("hint:"),
            "{stderr}"
        );
        assert!(!onnx.exists(), "{entry} left a file behind");
    }
    Ok(())
}

/// Windows of `sequence` characters of Hamlet's held-out lines, every
/// `stride`-th, as `charlm_x.npy` (character indices as f32, as the model
/// reads them) and `charlm_y.npy` (the next character's index).
fn write_hamlet_windows(dir: &Path, sequence: usize, stride: usize) -> Result<()> {
    use canopy_engine::data::{Part, char_index, load_shakespeare};
    let roles = load_shakespeare(datasets().join("shakespeare"))?;
    // The play's longest role is Hamlet's (`Ham.` in the text).
    let hamlet = roles
        .iter()
        .filter(|role| role.play == "hamlet")
        .max_by_key(|role| role.lines.len())
        .context("the play `hamlet` in datasets/shakespeare")?;
    let text: Vec<f32> = hamlet
        .text(Part::Test)
        .chars()
        .map(|c| char_index(c) as f32)
        .collect();
    let starts: Vec<usize> = (0..text.len().saturating_sub(sequence))
        .step_by(stride)
        .take(SAMPLES)
        .collect();
    ensure!(starts.len() == SAMPLES, "Hamlet's test lines are too short");
    let x: Vec<f32> = starts
        .iter()
        .flat_map(|&s| text[s..s + sequence].iter().copied())
        .collect();
    let y: Vec<i64> = starts.iter().map(|&s| text[s + sequence] as i64).collect();
    ndarray_npy::write_npy(
        dir.join("charlm_x.npy"),
        &ndarray::Array2::from_shape_vec((SAMPLES, sequence), x)?,
    )?;
    ndarray_npy::write_npy(dir.join("charlm_y.npy"), &ndarray::Array1::from(y))?;
    Ok(())
}

/// Samples the charlm test runs: as many as the reference inputs.
const SAMPLES: usize = 200;

/// `canopy model new charlm`: a GRU over 80 characters, one `scan` node,
/// exports as one ONNX `Scan` (the model stays the size of one step, not
/// of 80) that ONNX Runtime runs on Hamlet's lines with canopy's logits,
/// loss and accuracy; the export imports back to bit-identical logits.
#[test]
fn a_charlm_exports_its_loop_and_matches_onnx_runtime_and_imports_back() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let dir = dir.path();
    let model = dir.join("charlm.canopy");
    canopy_ok(&["model", "new", "charlm", "-o", model.to_str().unwrap()])?;
    write_hamlet_windows(dir, 80, 7)?;
    let (infer, eval) = export_entries(dir, "charlm", &model)?;

    let bytes = std::fs::read(&infer)?;
    let onnx = canopy_onnx::decode_model(&bytes, &canopy_onnx::Limits::default())?;
    let graph = onnx.graph.context("a main graph")?;
    let scans = graph.node.iter().filter(|n| n.op_type == "Scan").count();
    ensure!(
        scans == 1 && graph.node.len() < 40,
        "{} nodes, {scans} Scan",
        graph.node.len()
    );

    for (entry, onnx) in [("infer", &infer), ("eval", &eval)] {
        let ours = dir.join(format!("charlm.{entry}.canopy.npz"));
        let theirs = dir.join(format!("charlm.{entry}.ort.npz"));
        canopy_run(&model, entry, dir, "charlm", &ours)?;
        ort_run(onnx, dir, "charlm", entry == "eval", &theirs)?;
        let difference = max_difference(&theirs, &ours)?;
        eprintln!("charlm {entry}: ONNX Runtime vs canopy, max |difference| {difference:e}");
        ensure!(
            difference <= f64::from(TOLERANCE),
            "charlm {entry}: ONNX Runtime differs from canopy by {difference}"
        );
    }

    let reimported = dir.join("charlm.reimported.canopy");
    canopy_ok(&[
        "model",
        "import",
        infer.to_str().unwrap(),
        "-o",
        reimported.to_str().unwrap(),
    ])?;
    let again = dir.join("charlm.reimported.npz");
    canopy_run(&reimported, "infer", dir, "charlm", &again)?;
    let difference = max_difference(&again, &dir.join("charlm.infer.canopy.npz"))?;
    ensure!(
        difference == 0.0,
        "charlm: the re-imported export differs from the original by {difference}"
    );
    Ok(())
}
