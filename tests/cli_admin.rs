//! The `canopy` admin commands against real servers: the README's "ML
//! engineers" section and then its device-authority commands run as
//! written (a real `canopy-server`, real
//! `canopy-agent` processes, HTTPS with a pinned self-signed certificate,
//! SQLite), and the errors a user meets (not logged in, a bad token, an
//! unknown job, a server that is down) and Ctrl-C during `job watch`.

#[path = "../server/tests/support/mod.rs"]
mod support;

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use support::{Database, TestServer, sibling_binary};

/// The README sections this test runs, by their headings, in this order:
/// the second continues from what the first leaves.
const README_SECTIONS: [&str; 4] = [
    "## ML engineers: run a federated job from the command line",
    "## Secure aggregation",
    "## Operators: run an edge aggregator",
    "## ML engineers: simulate a thousand devices",
];
/// The sections: a server, three agents and a five-round job; the server
/// again with a device authority, three certified agents and a three-round
/// secure job; the server again, an edge aggregator with three agents, and
/// a three-round job through it; then a simulation of 1,000 devices for
/// five rounds, against its own in-process server.
const README_TIMEOUT: Duration = Duration::from_secs(300);
const WATCH_TIMEOUT: Duration = Duration::from_secs(30);

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ is inside the repository")
        .to_path_buf()
}

/// The directory holding `canopy`, `canopy-server` and `canopy-agent`.
fn binaries() -> Result<PathBuf> {
    let canopy = sibling_binary("canopy");
    for name in ["canopy", "canopy-server", "canopy-agent"] {
        let binary = sibling_binary(name);
        ensure!(
            binary.exists(),
            "{} is missing; run the tests with `cargo test --workspace`",
            binary.display()
        );
    }
    Ok(canopy.parent().context("binary directory")?.to_path_buf())
}

/// The shell commands of a README section: its ```sh blocks, in order.
fn section_commands(readme: &str, heading: &str) -> Result<String> {
    let start = readme
        .find(&format!("{heading}\n"))
        .with_context(|| format!("README.md has no section `{heading}`"))?;
    let body = &readme[start + heading.len()..];
    let body = body.find("\n## ").map_or(body, |end| &body[..end]);
    let mut script = String::new();
    let mut in_block = false;
    for line in body.lines() {
        match (in_block, line.trim_end()) {
            (false, "```sh") => in_block = true,
            (true, "```") => in_block = false,
            (true, line) => {
                script.push_str(line);
                script.push('\n');
            }
            _ => {}
        }
    }
    ensure!(!in_block, "a ```sh block in `{heading}` is not closed");
    ensure!(!script.is_empty(), "`{heading}` has no ```sh blocks");
    Ok(script)
}

/// A shell running a script in a process group of its own, so that what
/// it leaves in the background (a server, agents) is stopped with it.
struct Script {
    child: Child,
}

impl Script {
    fn start(dir: &Path, script: &str, binaries: &Path) -> Result<Script> {
        let path = dir.join("readme.sh");
        std::fs::write(&path, format!("set -euo pipefail\n{script}"))?;
        let child = Command::new("bash")
            .arg(&path)
            .current_dir(dir)
            .env("PATH", path_with(binaries))
            .env("CANOPY_CONFIG_DIR", dir.join("config"))
            // A free port instead of 8443, through the server's own
            // environment variable; the commands stay as written.
            .env("CANOPY_LISTEN", "127.0.0.1:0")
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(dir.join("stdout"))?)
            .stderr(std::fs::File::create(dir.join("stderr"))?)
            .process_group(0)
            .spawn()?;
        Ok(Script { child })
    }

    fn wait(&mut self, timeout: Duration) -> Result<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            ensure!(
                Instant::now() < deadline,
                "the README's commands ran past {timeout:?}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for Script {
    fn drop(&mut self) {
        // The group's id is the shell's pid; it stops whatever is left.
        let _ = Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", self.child.id())])
            .status();
        let _ = self.child.wait();
    }
}

fn path_with(binaries: &Path) -> String {
    format!(
        "{}:{}",
        binaries.display(),
        std::env::var("PATH").unwrap_or_default()
    )
}

#[test]
fn the_readme_section_runs_a_job_to_completion() -> Result<()> {
    let readme = std::fs::read_to_string(repo_root().join("README.md"))?;
    let build = readme
        .lines()
        .find(|line| line.trim_start().starts_with("cargo build --release"))
        .context("README.md has no build command")?;
    for binary in [
        "--bin canopy ",
        "--bin canopy-agent ",
        "--bin canopy-server ",
    ] {
        ensure!(
            build.contains(binary),
            "the README's build command `{build}` lacks `{binary}`"
        );
    }
    let script = README_SECTIONS
        .iter()
        .map(|heading| section_commands(&readme, heading))
        .collect::<Result<Vec<_>>>()?
        .concat();
    let binaries = binaries()?;
    let dir = tempfile::tempdir()?;
    std::os::unix::fs::symlink(repo_root().join("datasets"), dir.path().join("datasets"))?;
    let mut run = Script::start(dir.path(), &script, &binaries)?;
    let status = run.wait(README_TIMEOUT);
    let stdout = std::fs::read_to_string(dir.path().join("stdout"))?;
    let stderr = std::fs::read_to_string(dir.path().join("stderr"))?;
    let server_log =
        std::fs::read_to_string(dir.path().join("quickstart/server.log")).unwrap_or_default();
    let report = format!(
        "stdout:\n{stdout}\nstderr:\n{stderr}\nserver log (end):\n{}",
        tail(&server_log, 30)
    );
    ensure!(status?.success(), "the README's commands failed\n{report}");

    ensure!(
        stdout.contains("logged in to https://127.0.0.1:"),
        "{report}"
    );
    ensure!(
        stdout.contains("pushed quickstart/digits.canopy as model `digits` version 1"),
        "{report}"
    );
    ensure!(stdout.contains("created job 1 `digits-fedavg`"), "{report}");
    ensure!(stdout.contains("job 1 completed: 5 rounds"), "{report}");
    // One row per round, each with its federated evaluation, and learning.
    let rows: Vec<Vec<&str>> = watch_rows(&stdout, 1)
        .into_iter()
        .filter(|cells| cells[1] == "succeeded")
        .collect();
    let numbers: Vec<&str> = rows.iter().map(|cells| cells[0]).collect();
    // Round 0 fitted the new model's input statistics from the agents'
    // data; rounds 1 to 5 trained.
    ensure!(
        numbers == ["0", "1", "2", "3", "4", "5"],
        "rounds {numbers:?}\n{report}"
    );
    ensure!(
        stdout.contains("input statistics fitted from the devices' data"),
        "{report}"
    );
    for cells in &rows {
        ensure!(
            cells[2] == "3/3",
            "every round has its three devices: {cells:?}\n{report}"
        );
    }
    let last_accuracy: f64 = rows[5][4]
        .parse()
        .context("the last round's eval accuracy")?;
    ensure!(
        last_accuracy > 0.8,
        "accuracy after 5 rounds is {last_accuracy}\n{report}"
    );
    // The server evaluated each version on the pushed `digits-test`.
    for cells in &rows[1..] {
        let central: f64 = cells[6]
            .parse()
            .with_context(|| format!("round {}'s central accuracy\n{report}", cells[0]))?;
        ensure!((0.0..=1.0).contains(&central), "{cells:?}\n{report}");
    }
    let last_central: f64 = rows[5][6].parse()?;
    ensure!(
        last_central > 0.8,
        "central accuracy after 5 rounds is {last_central}\n{report}"
    );
    // `device ls` showed the three agents with their dataset.
    let online = stdout
        .lines()
        .filter(|line| line.contains(" yes ") && line.contains("digits ("))
        .count();
    ensure!(
        online == 3,
        "`canopy device ls` listed {online} online devices\n{report}"
    );
    secure_section_ran(&stdout, &report)?;
    let edge_log =
        std::fs::read_to_string(dir.path().join("quickstart/edge.log")).unwrap_or_default();
    edge_section_ran(&stdout, &edge_log, &report)?;
    simulate_section_ran(&stdout, &report)
}

/// What `canopy simulate` printed: 1,000 devices enrolled, five rounds of
/// 100 updates each, and the server's accuracy rising.
fn simulate_section_ran(stdout: &str, report: &str) -> Result<()> {
    ensure!(stdout.contains("1000 devices enrolled"), "{report}");
    let rows: Vec<Vec<&str>> = stdout
        .lines()
        .skip_while(|line| !line.starts_with("job 1 `simulate: 1000 devices"))
        .take_while(|line| !line.starts_with("job 1 completed"))
        .map(|line| line.split_whitespace().collect::<Vec<_>>())
        .filter(|cells| cells.len() == 8 && cells[1] == "succeeded" && cells[2] == "100/100")
        .collect();
    ensure!(
        rows.len() == 5,
        "{} simulated rounds of 100/100\n{report}",
        rows.len()
    );
    let (first, last): (f64, f64) = (rows[0][6].parse()?, rows[4][6].parse()?);
    ensure!(
        last > first && last > 0.5,
        "the simulation's central accuracy went from {first} to {last}\n{report}"
    );
    Ok(())
}

/// What the edge aggregator's commands printed: the edge enrolled as an
/// aggregator, three agents enrolled with the edge, and the tiered job's
/// rounds each answered by the one aggregator; and what the edge logged:
/// each of its three sub-rounds made a version of its own (`--edge-rounds
/// 2`), which its agents verified and trained on, before its result.
fn edge_section_ran(stdout: &str, edge_log: &str, report: &str) -> Result<()> {
    ensure!(stdout.contains("enrolled as aggregator"), "{report}");
    ensure!(stdout.contains("created job 3 `digits-tiered`"), "{report}");
    ensure!(stdout.contains("job 3 completed: 3 rounds"), "{report}");
    let rows = watch_rows(stdout, 3)
        .into_iter()
        .filter(|cells| cells[1] == "succeeded" && cells[2] == "1/1")
        .count();
    ensure!(rows == 3, "{rows} tiered rounds with 1/1\n{report}");
    let own_versions = edge_log.matches("round succeeded").count();
    let results = edge_log.matches("sub-round closed").count();
    ensure!(
        own_versions == 3 && results == 3,
        "the edge logged {own_versions} versions of its own and {results} results\n{}",
        tail(edge_log, 30)
    );
    Ok(())
}

/// What the device-authority commands printed: each agent's certificate
/// installed, and the secure job's rounds run by the three certified
/// agents (the uncertified agents of the first section are never chosen).
fn secure_section_ran(stdout: &str, report: &str) -> Result<()> {
    let installed = stdout
        .matches("installed the device authority's certificate")
        .count();
    ensure!(
        installed == 3,
        "{installed} certificates installed\n{report}"
    );
    ensure!(stdout.contains("created job 2 `digits-secure`"), "{report}");
    ensure!(stdout.contains("job 2 completed: 3 rounds"), "{report}");
    let secure_rows = watch_rows(stdout, 2)
        .into_iter()
        .filter(|cells| cells[1] == "succeeded" && cells[2] == "3/3")
        .count();
    ensure!(
        secure_rows == 3,
        "{secure_rows} secure rounds with 3/3\n{report}"
    );
    Ok(())
}

/// The rows `canopy job watch JOB` printed, split into cells: the lines
/// of eight cells between its heading and its last line.
fn watch_rows(stdout: &str, job: i64) -> Vec<Vec<&str>> {
    stdout
        .lines()
        .skip_while(|line| !line.starts_with(&format!("job {job} `")))
        .take_while(|line| !line.starts_with(&format!("job {job} completed")))
        .map(|line| line.split_whitespace().collect::<Vec<_>>())
        .filter(|cells| cells.len() == 8)
        .collect()
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// `canopy` with its own login directory.
struct Cli {
    config: tempfile::TempDir,
    binary: PathBuf,
}

impl Cli {
    fn new() -> Result<Cli> {
        Ok(Cli {
            config: tempfile::tempdir()?,
            binary: binaries()?.join("canopy"),
        })
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut command = Command::new(&self.binary);
        command
            .args(args)
            .env("CANOPY_CONFIG_DIR", self.config.path())
            .env_remove("CANOPY_TOKEN")
            .stdin(Stdio::null());
        command
    }

    fn run(&self, args: &[&str]) -> Result<Output> {
        Ok(self.command(args).output()?)
    }

    fn ok(&self, args: &[&str]) -> Result<String> {
        let output = self.run(args)?;
        ensure!(
            output.status.success(),
            "canopy {args:?} failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    }

    /// Runs a command that must fail with status 1; returns its stderr.
    fn fails(&self, args: &[&str]) -> Result<String> {
        let output = self.run(args)?;
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        ensure!(
            output.status.code() == Some(1),
            "canopy {args:?} exited {:?}, not 1: {stderr}",
            output.status
        );
        Ok(stderr)
    }

    fn login(&self, server: &TestServer, token: &str) -> Result<Output> {
        self.run(&[
            "login",
            &server.base,
            "--token",
            token,
            "--fingerprint",
            &server.fingerprint,
        ])
    }

    fn config_file(&self) -> PathBuf {
        self.config.path().join("config.toml")
    }
}

fn assert_lines(stderr: &str, expected: &[&str]) -> Result<()> {
    for line in expected {
        ensure!(stderr.contains(line), "stderr lacks `{line}`:\n{stderr}");
    }
    Ok(())
}

#[test]
fn commands_before_login_say_how_to_log_in() -> Result<()> {
    let cli = Cli::new()?;
    for args in [
        &["job", "ls"][..],
        &["model", "ls"],
        &["device", "ls"],
        &["job", "watch", "1"],
    ] {
        let stderr = cli.fails(args)?;
        assert_lines(
            &stderr,
            &[
                "error: not logged in to a Canopy server",
                "hint: log in first: canopy login URL --token T",
            ],
        )?;
    }
    Ok(())
}

#[test]
fn a_bad_token_is_refused_at_login_and_nothing_is_saved() -> Result<()> {
    let server = TestServer::start(Database::Sqlite)?;
    let cli = Cli::new()?;
    let output = cli.login(&server, "cnpa_not-a-token")?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    ensure!(output.status.code() == Some(1), "{stderr}");
    assert_lines(
        &stderr,
        &[
            &format!("error: the server at {} refused the token", server.base),
            "Caused by: 401 unauthorized",
            &format!(
                "hint: the token is unknown, expired or revoked: get a new one (`canopy-server token create --role operator`) and run `canopy login {} --token T`",
                server.base
            ),
        ],
    )?;
    ensure!(!cli.config_file().exists(), "a refused login was saved");

    // A good token logs in, with the file readable by its owner only; a
    // token revoked afterwards gets the same answer on the next command.
    let output = cli.login(&server, &server.admin_token)?;
    ensure!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(cli.config_file())?.permissions().mode();
    ensure!(mode & 0o777 == 0o600, "the login file has mode {mode:o}");
    let wrong =
        std::fs::read_to_string(cli.config_file())?.replace(&server.admin_token, "cnpa_revoked");
    std::fs::write(cli.config_file(), wrong)?;
    let stderr = cli.fails(&["job", "ls"])?;
    assert_lines(&stderr, &["refused the token", "401 unauthorized"])?;
    Ok(())
}

#[test]
fn an_unknown_job_is_named_with_where_to_look() -> Result<()> {
    let server = TestServer::start(Database::Sqlite)?;
    let cli = Cli::new()?;
    ensure!(cli.login(&server, &server.admin_token)?.status.success());
    for args in [
        &["job", "show", "999"][..],
        &["job", "start", "999"],
        &["job", "watch", "999"],
    ] {
        let stderr = cli.fails(args)?;
        assert_lines(
            &stderr,
            &[
                &format!("error: job 999 does not exist on {}", server.base),
                "Caused by: 404 not_found: job 999 does not exist",
                "hint: see what exists with `canopy job ls`",
            ],
        )?;
    }
    let stderr = cli.fails(&["job", "create", "--model", "nothing-here", "--rounds", "1"])?;
    assert_lines(
        &stderr,
        &[
            &format!(
                "error: model `nothing-here` does not exist on {}",
                server.base
            ),
            "Caused by: 404 not_found: model `nothing-here` does not exist",
            "hint: see what exists with `canopy model ls`",
        ],
    )?;
    let stderr = cli.fails(&["model", "versions", "nothing-here"])?;
    assert_lines(
        &stderr,
        &[
            &format!(
                "error: model `nothing-here` does not exist on {}",
                server.base
            ),
            "hint: see what exists with `canopy model ls`",
        ],
    )?;
    // A version id that does not exist is named, not "the job".
    let stderr = cli.fails(&["job", "create", "--version", "999", "--rounds", "1"])?;
    assert_lines(
        &stderr,
        &[
            &format!(
                "error: model version id 999 does not exist on {}",
                server.base
            ),
            "Caused by: 404 not_found: model version 999 does not exist",
            "hint: see what exists with `canopy model versions NAME`",
        ],
    )?;
    Ok(())
}

#[test]
fn a_server_that_is_down_is_named_by_its_url() -> Result<()> {
    let mut server = TestServer::start(Database::Sqlite)?;
    let cli = Cli::new()?;
    ensure!(cli.login(&server, &server.admin_token)?.status.success());
    server.kill9();
    let stderr = cli.fails(&["job", "ls"])?;
    assert_lines(
        &stderr,
        &[
            &format!("error: cannot reach the Canopy server at {}", server.base),
            &format!(
                "hint: check that the server is running and listening at {}",
                server.base
            ),
        ],
    )?;
    Ok(())
}

/// A job that waits for devices that never come, so it stays running.
fn waiting_job(cli: &Cli, dir: &Path) -> Result<()> {
    push_tiny(cli, dir)?;
    let created = cli.ok(&[
        "job", "create", "--model", "tiny", "--rounds", "2", "--start",
    ])?;
    ensure!(
        created
            .contains("created job 1 `tiny` from model `tiny` version 1 (version id 1), started"),
        "{created}"
    );
    Ok(())
}

/// Pushes `canopy model new logreg --inputs 4` as model `tiny`.
fn push_tiny(cli: &Cli, dir: &Path) -> Result<()> {
    let model = dir.join("m.canopy");
    let model = model.to_str().context("utf-8 path")?;
    cli.ok(&[
        "model",
        "new",
        "logreg",
        "--inputs",
        "4",
        "--classes",
        "3",
        "-o",
        model,
    ])?;
    let pushed = cli.ok(&["model", "push", model, "tiny"])?;
    ensure!(pushed.contains("as model `tiny` version 1"), "{pushed}");
    Ok(())
}

/// Enrolls one device that reports dataset `digits` (4 features).
fn enroll_device_with_digits(server: &TestServer) -> Result<()> {
    use canopy_protocol::messages::{DatasetInfo, Heartbeat};
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        let token = server.admin().enrollment_token(1).await?;
        let device = support::enroll_device(server, &token).await?;
        device
            .heartbeat(&Heartbeat {
                state: Some("idle".into()),
                datasets: Some(vec![DatasetInfo {
                    name: "digits".into(),
                    samples: 100,
                    sample_shape: vec![4],
                    classes: 3,
                }]),
                ..Heartbeat::default()
            })
            .await?;
        Ok(())
    })
}

/// Starts `canopy job watch 1` and waits for its table's header.
fn start_watch(cli: &Cli) -> Result<(Child, mpsc::Receiver<String>)> {
    let mut child = cli
        .command(&["job", "watch", "1", "--interval-ms", "200"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let stdout = child.stdout.take().context("watch's stdout")?;
    let (lines, received) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if lines.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + WATCH_TIMEOUT;
    loop {
        let line = received.recv_timeout(deadline.saturating_duration_since(Instant::now()))?;
        if line.trim_start().starts_with("round") {
            return Ok((child, received));
        }
    }
}

fn wait_exit(child: &mut Child) -> Result<(std::process::ExitStatus, String)> {
    let deadline = Instant::now() + WATCH_TIMEOUT;
    loop {
        if let Some(status) = child.try_wait()? {
            let mut stderr = String::new();
            if let Some(mut pipe) = child.stderr.take() {
                std::io::Read::read_to_string(&mut pipe, &mut stderr)?;
            }
            return Ok((status, stderr));
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            bail!("watch did not exit within {WATCH_TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn ctrl_c_stops_watching_not_the_job_and_a_cancelled_job_fails_the_watch() -> Result<()> {
    let server = TestServer::start(Database::Sqlite)?;
    let cli = Cli::new()?;
    ensure!(cli.login(&server, &server.admin_token)?.status.success());
    let dir = tempfile::tempdir()?;
    waiting_job(&cli, dir.path())?;

    let (mut watch, _lines) = start_watch(&cli)?;
    let status = Command::new("kill")
        .args(["-INT", &watch.id().to_string()])
        .status()?;
    ensure!(status.success());
    let (status, stderr) = wait_exit(&mut watch)?;
    ensure!(
        status.code() == Some(130),
        "watch exited {status:?} on Ctrl-C: {stderr}"
    );
    assert_lines(&stderr, &["stopped watching job 1; the job goes on"])?;
    let shown = cli.ok(&["job", "show", "1", "--json"])?;
    let job: serde_json::Value = serde_json::from_str(&shown)?;
    ensure!(job["state"] == "running", "Ctrl-C changed the job: {job}");

    // Cancelled while watched: the watch ends with status 1 and says why.
    let (mut watch, _lines) = start_watch(&cli)?;
    let cancelled = cli.ok(&["job", "cancel", "1"])?;
    ensure!(cancelled.contains("job 1 is now cancelled"), "{cancelled}");
    let (status, stderr) = wait_exit(&mut watch)?;
    ensure!(
        status.code() == Some(1),
        "watch exited {status:?} on a cancelled job: {stderr}"
    );
    assert_lines(&stderr, &["error: job 1 was cancelled"])?;
    // A second cancel is refused, with the way to see the job's state.
    let stderr = cli.fails(&["job", "cancel", "1"])?;
    assert_lines(
        &stderr,
        &[
            "Caused by: 409 conflict",
            "hint: see its state with `canopy job show 1`",
        ],
    )?;
    Ok(())
}

/// The issue's acceptance: a job no device can qualify for is warned about
/// at creation (cause and hint), `job watch` prints the whole reason it
/// waits and, when its `--max-wait-for-devices-ms` runs out, the whole
/// reason it failed, exiting 1; `job show` and `job ls` print it whole.
#[test]
fn a_job_no_device_can_qualify_for_is_warned_about_and_its_wait_limit_ends_the_watch() -> Result<()>
{
    let server = TestServer::start(Database::Sqlite)?;
    let cli = Cli::new()?;
    ensure!(cli.login(&server, &server.admin_token)?.status.success());
    let dir = tempfile::tempdir()?;
    push_tiny(&cli, dir.path())?;
    enroll_device_with_digits(&server)?;

    let stderr = cli.fails(&["job", "create", "--model", "tiny@9", "--rounds", "1"])?;
    assert_lines(
        &stderr,
        &[
            &format!(
                "error: model `tiny` version 9 does not exist on {}",
                server.base
            ),
            "hint: see what exists with `canopy model versions tiny`",
        ],
    )?;
    // `canopy model new` leaves the input statistics unfitted, so the
    // round that waits is round 0, the statistics round.
    let created = cli.run(&[
        "job",
        "create",
        "--model",
        "tiny@1",
        "--dataset",
        "nope",
        "--rounds",
        "1",
        "--max-wait-for-devices-ms",
        "3000",
        "--start",
    ])?;
    let (stdout, stderr) = (
        String::from_utf8_lossy(&created.stdout),
        String::from_utf8_lossy(&created.stderr),
    );
    ensure!(created.status.success(), "{stderr}");
    ensure!(
        stdout.contains("created job 1 `tiny` from model `tiny` version 1 (version id 1), started"),
        "{stdout}"
    );
    let reason = "0 eligible online, the round needs at least 1 \
                  (of the other online devices, 1 lack dataset `nope`)";
    assert_lines(
        &stderr,
        &[
            "warning: 0 of the 1 enrolled devices could take part, and each round needs at \
             least 1 (of the other enrolled devices, 1 lack dataset `nope`)",
            "  hint: register `nope` on the devices (`canopy-agent data add nope ...`)",
        ],
    )?;

    let mut watch = cli
        .command(&["job", "watch", "1", "--interval-ms", "200"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let mut stdout = watch.stdout.take().context("watch's stdout")?;
    let (status, stderr) = wait_exit(&mut watch)?;
    let mut printed = String::new();
    std::io::Read::read_to_string(&mut stdout, &mut printed)?;
    ensure!(
        status.code() == Some(1),
        "watch exited {status:?} on a job that failed: {stderr}"
    );
    assert_lines(
        &stderr,
        &[
            &format!("job 1 is running: waiting for devices: {reason}"),
            "error: job 1 failed",
            &format!(
                "Caused by: round 0 attempt 1 failed: no round could start within the job's \
                 `max_wait_for_devices_ms` of 3000 ms: {reason}"
            ),
        ],
    )?;
    ensure!(
        printed.contains("round failed: no round could start") && printed.contains(reason),
        "{printed}"
    );
    for args in [&["job", "show", "1"][..], &["job", "ls"]] {
        let shown = cli.ok(args)?;
        ensure!(
            shown.contains(reason),
            "canopy {args:?} cut the status:\n{shown}"
        );
    }
    Ok(())
}
