//! `canopy model import` refuses broken and hostile ONNX files with the
//! whole report a user sees: the error line naming the file, the cause
//! naming the object (node with op, domain and opset; tensor; limit), and a
//! hint. The files are written with onnx.helper
//! (`tests/reference/onnx_broken.py`, `requirements-dev.txt`), or cut and
//! grown from them here. Hostile sizes are refused before anything
//! proportional to them is allocated: those imports run under an address
//! space limit far below what the file declares.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use anyhow::{Result, ensure};
use canopy_onnx::Limits;
use common::{canopy, reference_script};

/// The address space `canopy model import` gets where a file declares
/// more: enough for the binary and a small model, a quarter of the 2 GiB
/// that `huge.onnx` declares.
const ADDRESS_SPACE_KIB: u64 = 512 << 10;

/// The general hint of import errors whose cause carries none.
const SUPPORTED_OPS_HINT: &str = "ARCHITECTURE.md (onnx/) lists the ops it supports";

/// What `canopy` printed on stderr for a failed command, by line kind.
#[derive(Debug)]
struct Report {
    error: String,
    causes: Vec<String>,
    hint: Option<String>,
}

impl Report {
    /// Checks the failed command left no model behind, and splits its
    /// stderr into `error:`, `Caused by:` and `hint:` lines.
    fn of(output: &Output, model: &Path) -> Result<Report> {
        let stderr = String::from_utf8_lossy(&output.stderr);
        ensure!(!output.status.success(), "the import succeeded: {stderr}");
        ensure!(!model.exists(), "a refused import left {model:?} behind");
        let mut lines = stderr.lines();
        let error = lines
            .next()
            .and_then(|line| line.strip_prefix("error: "))
            .ok_or_else(|| anyhow::anyhow!("no `error:` line first: {stderr}"))?
            .to_string();
        let mut report = Report {
            error,
            causes: Vec::new(),
            hint: None,
        };
        for line in lines {
            if let Some(cause) = line.strip_prefix("  Caused by: ") {
                ensure!(report.hint.is_none(), "a cause after the hint: {stderr}");
                report.causes.push(cause.to_string());
            } else if let Some(hint) = line.strip_prefix("  hint: ") {
                report.hint = Some(hint.to_string());
            } else {
                anyhow::bail!("an unexpected line {line:?} in: {stderr}");
            }
        }
        Ok(report)
    }

    /// The error line is `error`, the first cause contains each of
    /// `cause`, and the hint contains `hint`.
    fn expect(&self, error: &str, cause: &[&str], hint: &str) -> Result<()> {
        ensure!(
            self.error == error,
            "error line {:?}, not {error:?}",
            self.error
        );
        let first = self.causes.first().map_or("", String::as_str);
        for part in cause {
            ensure!(
                first.contains(part),
                "cause {first:?} lacks {part:?}: {self:?}"
            );
        }
        let shown = self.hint.as_deref().unwrap_or("");
        ensure!(shown.contains(hint), "hint {shown:?} lacks {hint:?}");
        Ok(())
    }
}

/// A directory holding the reference files, and where imports write.
struct Files {
    dir: tempfile::TempDir,
}

impl Files {
    fn new() -> Result<Files> {
        let dir = tempfile::tempdir()?;
        reference_script("onnx_broken.py", dir.path())?;
        Ok(Files { dir })
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn model(&self) -> PathBuf {
        self.path("out.canopy")
    }

    fn import_args<'a>(&self, onnx: &'a Path, model: &'a Path) -> [&'a str; 5] {
        [
            "model",
            "import",
            onnx.to_str().expect("a UTF-8 temp path"),
            "-o",
            model.to_str().expect("a UTF-8 temp path"),
        ]
    }

    /// `canopy model import NAME -o out.canopy`.
    fn import(&self, name: &str) -> Output {
        let (onnx, model) = (self.path(name), self.model());
        canopy(&self.import_args(&onnx, &model))
    }

    /// The same import, in a process that cannot map more than
    /// [`ADDRESS_SPACE_KIB`].
    fn import_in_little_memory(&self, name: &str) -> Result<Output> {
        let (onnx, model) = (self.path(name), self.model());
        Ok(Command::new("sh")
            .arg("-c")
            .arg(format!(
                "ulimit -v {ADDRESS_SPACE_KIB} && exec \"$0\" \"$@\""
            ))
            .arg(env!("CARGO_BIN_EXE_canopy"))
            .args(self.import_args(&onnx, &model))
            .env("CANOPY_LOG", "warn")
            .output()?)
    }

    fn cannot_import(&self, name: &str) -> String {
        format!("cannot import `{}`", self.path(name).display())
    }
}

#[test]
fn an_unsupported_op_is_refused_naming_node_op_domain_and_opset() -> Result<()> {
    let files = Files::new()?;
    let report = Report::of(&files.import("unsupported.onnx"), &files.model())?;
    report.expect(
        &files.cannot_import("unsupported.onnx"),
        &["node `pick` (Hardmax, #0): op `Hardmax` of domain `ai.onnx` (opset 17) is not supported"],
        SUPPORTED_OPS_HINT,
    )?;
    ensure!(report.causes.len() == 1, "{report:?}");
    Ok(())
}

#[test]
fn external_data_is_refused_naming_the_tensor_and_its_file() -> Result<()> {
    let files = Files::new()?;
    ensure!(
        files.path("external.onnx.data").exists(),
        "onnx wrote no data file"
    );
    let report = Report::of(&files.import("external.onnx"), &files.model())?;
    report.expect(
        &files.cannot_import("external.onnx"),
        &[
            "tensor `fc.w` keeps its data in an external file (`external.onnx.data`)",
            "which import does not read",
        ],
        "save the model with all tensors inside the file (onnx.save_model(..., save_as_external_data=False))",
    )?;
    ensure!(report.causes.len() == 1, "{report:?}");
    Ok(())
}

#[test]
fn truncated_and_garbage_files_are_decode_errors_naming_the_file() -> Result<()> {
    let files = Files::new()?;
    let valid = std::fs::read(files.path("valid.onnx"))?;
    let imported = files.import("valid.onnx");
    ensure!(
        imported.status.success(),
        "{}",
        String::from_utf8_lossy(&imported.stderr)
    );
    std::fs::remove_file(files.model())?;

    std::fs::write(files.path("truncated.onnx"), &valid[..valid.len() / 2])?;
    std::fs::write(files.path("garbage.onnx"), b"not a protobuf at all")?;
    for name in ["truncated.onnx", "garbage.onnx"] {
        let report = Report::of(&files.import(name), &files.model())?;
        report.expect(
            &files.cannot_import(name),
            &["the bytes are not a valid ONNX model"],
            "the file may be truncated or not an ONNX file",
        )?;
        // The decoder's own account (which field, which wire type) follows.
        ensure!(
            report.causes.get(1).is_some_and(|c| c.contains("decode")),
            "{name}: {report:?}"
        );
    }
    Ok(())
}

#[test]
fn a_tensor_declaring_2_gib_is_refused_by_name_without_allocating_it() -> Result<()> {
    let files = Files::new()?;
    let size = std::fs::metadata(files.path("huge.onnx"))?.len();
    ensure!(size < 1024, "huge.onnx carries {size} bytes");
    // The same binary under the same limit imports a real model, so the
    // limit is not what refuses the hostile one.
    let valid = files.import_in_little_memory("valid.onnx")?;
    ensure!(
        valid.status.success(),
        "a small model does not import in {ADDRESS_SPACE_KIB} KiB of address space: {}",
        String::from_utf8_lossy(&valid.stderr)
    );
    std::fs::remove_file(files.model())?;

    let report = Report::of(&files.import_in_little_memory("huge.onnx")?, &files.model())?;
    let limit = Limits::default().max_tensor_elements;
    report.expect(
        &files.cannot_import("huge.onnx"),
        &[
            "tensor `huge` declares dims [536870912], 536870912 elements",
            &format!("exceeds the limit of {limit}"),
        ],
        "import refuses a tensor over the limit before reading or allocating it",
    )?;
    ensure!(report.causes.len() == 1, "{report:?}");
    Ok(())
}

#[test]
fn a_file_over_the_size_limit_is_refused_before_it_is_read() -> Result<()> {
    let files = Files::new()?;
    let limit = Limits::default().max_model_bytes as u64;
    // Sparse: the test writes nothing, and a reader that did not check the
    // size first would need the whole limit in memory.
    let big = files.path("big.onnx");
    std::fs::File::create(&big)?.set_len(limit + 1)?;
    let report = Report::of(&files.import_in_little_memory("big.onnx")?, &files.model())?;
    ensure!(
        report.error == format!("cannot read ONNX file `{}`", big.display()),
        "{report:?}"
    );
    ensure!(
        report.causes
            == [format!(
                "it is {} bytes, over the limit of {limit}",
                limit + 1
            )],
        "{report:?}"
    );
    Ok(())
}
