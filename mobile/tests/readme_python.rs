//! The README's Python program, as written, against the job the README's
//! "ML engineers" section creates: that section's commands run as
//! `tests/cli_admin.rs` runs them (a real `canopy-server`, three real
//! `canopy-agent`s, HTTPS with a pinned self-signed certificate), paused
//! before their last block (the job) while the program starts. Its first
//! run finds no job and must say why; its second run must skip
//! enrollment, take a task of the job, and print what it did.

use crate::common;
use crate::python_package;

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};

const CLI_SECTION: &str = "## ML engineers: run a federated job from the command line";
const APP_SECTION: &str = "## App developers: Kotlin, Swift, Python and C";
/// Where the README tells the reader to save the program.
const PROGRAM_PATH: &str = "quickstart/device.py";
/// How the README's program waits for a task, and how its first run here
/// (no job yet) waits instead.
const README_WAIT: &str = "check_for_task(60_000)";
const FIRST_RUN_WAIT: &str = "check_for_task(5_000)";
/// The server, the agents and their enrollment.
const AGENTS_TIMEOUT: Duration = Duration::from_secs(120);
/// A run of the program: it waits up to a minute for a task, more for a
/// round that closes without it.
const PROGRAM_TIMEOUT: Duration = Duration::from_secs(240);
/// The job, once the program has started: five rounds, and up to a
/// minute's wait for the evaluations of a device that left.
const JOB_TIMEOUT: Duration = Duration::from_secs(300);

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("mobile/ is inside the repository")
        .to_path_buf()
}

/// Each ```LANGUAGE block of a README section, in order.
fn blocks(readme: &str, heading: &str, language: &str) -> Result<Vec<String>> {
    let start = readme
        .find(&format!("\n{heading}\n"))
        .with_context(|| format!("README.md has no section `{heading}`"))?;
    let body = &readme[start + heading.len() + 2..];
    let body = body.find("\n## ").map_or(body, |end| &body[..end]);
    let fence = format!("```{language}");
    let mut found = Vec::new();
    let mut current: Option<String> = None;
    for line in body.lines() {
        match (&mut current, line.trim_end()) {
            (None, open) if open == fence => current = Some(String::new()),
            (Some(_), "```") => found.extend(current.take()),
            (Some(block), line) => {
                block.push_str(line);
                block.push('\n');
            }
            _ => {}
        }
    }
    ensure!(
        current.is_none(),
        "a {fence} block in `{heading}` is not closed"
    );
    Ok(found)
}

/// `canopy`, `canopy-server` and `canopy-agent`, which the README's
/// build command makes.
fn binaries() -> Result<PathBuf> {
    let dir = common::target_dir();
    for name in ["canopy", "canopy-server", "canopy-agent"] {
        ensure!(
            dir.join(name).exists(),
            "{} is missing; run `cargo build --release --bin canopy --bin canopy-agent --bin \
             canopy-server` first (`cargo test --workspace --release` builds them)",
            dir.join(name).display()
        );
    }
    Ok(dir)
}

/// The README's commands, run in `dir` as a reader runs them: `PATH`
/// with the binaries, the login kept in `dir/config`, the server on a
/// free port (its own variable; the commands stay as written).
struct Reader {
    dir: PathBuf,
    binaries: PathBuf,
    site: PathBuf,
}

impl Reader {
    fn path(&self) -> String {
        format!(
            "{}:{}",
            self.binaries.display(),
            std::env::var("PATH").unwrap_or_default()
        )
    }

    fn bash(&self, script: &str) -> Command {
        let mut command = Command::new("bash");
        command
            .args(["-c", &format!("set -euo pipefail\n{script}")])
            .current_dir(&self.dir)
            .env("PATH", self.path())
            .env("CANOPY_CONFIG_DIR", self.dir.join("config"))
            .env("CANOPY_LISTEN", "127.0.0.1:0")
            // As `pip install ./mobile` would make `import canopy` work.
            .env("PYTHONPATH", &self.site)
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .env("PYTHONUNBUFFERED", "1")
            .env_remove("CANOPY_ENROLL_TOKEN")
            .stdin(Stdio::null());
        command
    }

    fn file(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.join(name)).unwrap_or_default()
    }
}

/// A shell in a process group of its own, so that what it leaves in the
/// background (the server, the agents) stops with it.
struct Group(Child);

impl Drop for Group {
    fn drop(&mut self) {
        // Quiet: the group is usually gone already.
        let _ = Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", self.0.id())])
            .stderr(Stdio::null())
            .status();
        let _ = self.0.wait();
    }
}

fn wait_until(what: &str, timeout: Duration, mut done: impl FnMut() -> Result<bool>) -> Result<()> {
    let deadline = Instant::now() + timeout;
    while !done()? {
        ensure!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    Ok(())
}

/// Runs the program to its end with `on_line` seeing each line of its
/// stdout as it comes; its output.
fn run_program(
    reader: &Reader,
    run_line: &str,
    mut on_line: impl FnMut(&str) -> Result<()>,
) -> Result<Output> {
    let mut program = Group(
        reader
            .bash(run_line)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .spawn()?,
    );
    let stdout = program.0.stdout.take().context("the program's stdout")?;
    let stderr = program.0.stderr.take().context("the program's stderr")?;
    let (lines, received) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if lines.send(line).is_err() {
                break;
            }
        }
    });
    let errors = std::thread::spawn(move || std::io::read_to_string(stderr).unwrap_or_default());
    let deadline = Instant::now() + PROGRAM_TIMEOUT;
    let mut printed = String::new();
    loop {
        match received.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(line) => {
                on_line(&line)?;
                printed.push_str(&line);
                printed.push('\n');
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            // Dropping the group kills the program.
            Err(mpsc::RecvTimeoutError::Timeout) => {
                bail!("the program ran past {PROGRAM_TIMEOUT:?}; it printed:\n{printed}")
            }
        }
    }
    let status = program.0.wait()?;
    Ok(Output {
        status,
        stdout: printed.into_bytes(),
        stderr: errors.join().unwrap_or_default().into_bytes(),
    })
}

fn text(output: &Output) -> String {
    format!(
        "exit: {:?}\nstdout:\n{}\nstderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

#[test]
fn the_readme_python_program_takes_a_task_of_the_cli_sections_job() -> Result<()> {
    let readme = std::fs::read_to_string(repo_root().join("README.md"))?;
    let cli = blocks(&readme, CLI_SECTION, "sh")?;
    ensure!(
        cli.len() == 3 && cli[2].contains("canopy job create"),
        "the CLI section's blocks are no longer server, agents, job: {cli:#?}"
    );
    let [program] = &blocks(&readme, APP_SECTION, "python")?[..] else {
        bail!("`{APP_SECTION}` must hold one ```python block, the program");
    };
    let [run_line] = &blocks(&readme, APP_SECTION, "sh")?[..] else {
        bail!("`{APP_SECTION}` must hold one ```sh block, how to run the program");
    };
    ensure!(
        run_line.contains(PROGRAM_PATH),
        "the run line does not run {PROGRAM_PATH}: {run_line}"
    );

    let dir = tempfile::tempdir()?;
    let site = dir.path().join("site");
    python_package::lay_out(&site)?;
    std::os::unix::fs::symlink(repo_root().join("datasets"), dir.path().join("datasets"))?;
    let reader = Reader {
        dir: dir.path().to_path_buf(),
        binaries: binaries()?,
        site,
    };
    // The section up to its job, a pause while the program starts, then
    // the job.
    let script = format!(
        "{}{}touch agents.started\nuntil [ -e program.waiting ]; do sleep 0.2; done\n{}",
        cli[0], cli[1], cli[2]
    );
    let mut section = Group(
        reader
            .bash(&script)
            .stdout(std::fs::File::create(dir.path().join("stdout"))?)
            .stderr(std::fs::File::create(dir.path().join("stderr"))?)
            .process_group(0)
            .spawn()?,
    );
    let report = |reader: &Reader| {
        format!(
            "the CLI section's stdout:\n{}\nstderr:\n{}\nserver log (end):\n{}",
            reader.file("stdout"),
            reader.file("stderr"),
            tail(&reader.file("quickstart/server.log"), 30)
        )
    };
    wait_until("the CLI section's agents", AGENTS_TIMEOUT, || {
        if let Some(status) = section.0.try_wait()? {
            bail!(
                "the CLI section ended early ({status})\n{}",
                report(&reader)
            );
        }
        Ok(dir.path().join("agents.started").exists())
    })?;
    // No job yet: the program enrolls, offers `digits`, waits and says why
    // no task came. This run alone waits 5 s instead of the README's
    // minute; the second runs the program exactly as written.
    let waits = program.matches(README_WAIT).count();
    ensure!(
        waits == 1,
        "the program must wait with `{README_WAIT}` once, found {waits}"
    );
    std::fs::write(
        dir.path().join(PROGRAM_PATH),
        program.replace(README_WAIT, FIRST_RUN_WAIT),
    )?;
    let first = run_program(&reader, run_line, |_| Ok(()))?;
    let first_text = text(&first);
    let stdout = String::from_utf8_lossy(&first.stdout);
    let stderr = String::from_utf8_lossy(&first.stderr);
    ensure!(first.status.code() == Some(1), "{first_text}");
    ensure!(
        stdout.contains("offers `digits` (") && stdout.contains("waiting for a task"),
        "{first_text}"
    );
    for expected in [
        "no task came within 5000 ms",
        "It offers `digits` (",
        "samples of [64], 10 classes)",
        "hint: `canopy job ls`",
    ] {
        ensure!(
            stderr.contains(expected),
            "lacks `{expected}`:\n{first_text}"
        );
    }
    ensure!(!stderr.contains("Traceback"), "{first_text}");

    std::fs::write(dir.path().join(PROGRAM_PATH), program)?;
    // The second run finds its enrollment (enrolling again would raise
    // AlreadyEnrolled); once it waits, the section creates its job, which
    // selects it with the agents.
    let waiting = dir.path().join("program.waiting");
    let second = run_program(&reader, run_line, |line| {
        if line.contains("waiting for a task") {
            std::fs::write(&waiting, "")?;
        }
        Ok(())
    })?;
    let second_text = text(&second);
    ensure!(
        second.status.success(),
        "{second_text}\n{}",
        report(&reader)
    );
    println!("the program's second run:\n{second_text}");
    let stdout = String::from_utf8_lossy(&second.stdout);
    let summary = stdout
        .lines()
        .find(|line| line.contains(" task of job 1, round "))
        .with_context(|| format!("no summary of the task:\n{second_text}"))?;
    ensure!(
        ["train task", "statistics task", "evaluate task"]
            .iter()
            .any(|kind| summary.starts_with(kind))
            && summary.contains(" samples, ")
            && summary.contains(" bytes sent"),
        "{summary}"
    );
    ensure!(summary.len() < 300, "the summary is not short: {summary}");

    wait_until("the job to complete", JOB_TIMEOUT, || {
        Ok(section.0.try_wait()?.is_some())
    })?;
    let status = section.0.wait()?;
    ensure!(
        status.success(),
        "the CLI section failed\n{}",
        report(&reader)
    );
    ensure!(
        reader.file("stdout").contains("job 1 completed: 5 rounds"),
        "{}",
        report(&reader)
    );
    Ok(())
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
