//! Messages about a real `canopy-server` (HTTPS with a self-signed
//! certificate, SQLite): errors that point to the fix when the server is
//! plainly there (`http://` against HTTPS, an unpinned certificate, another
//! certificate than the pinned one), expired tokens listed as expired, and
//! a log redirected to a file that is plain text.
//!
//! Needs `canopy-server` and `canopy-agent` beside `canopy` (as
//! `cargo test --workspace --release` builds them).

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use std::os::unix::fs::PermissionsExt;

const STARTUP_TIMEOUT: Duration = Duration::from_secs(60);

/// A workspace binary next to `canopy`.
fn binary(name: &str) -> Result<PathBuf> {
    let canopy = Path::new(env!("CARGO_BIN_EXE_canopy"));
    let path = canopy.with_file_name(format!("{name}{}", std::env::consts::EXE_SUFFIX));
    ensure!(
        path.exists(),
        "{} is missing; build it first: cargo build --release --bin {name} (or run \
         `cargo test --workspace --release`)",
        path.display()
    );
    Ok(path)
}

/// A `canopy-server serve --tls self-signed` whose stderr goes to
/// `server.log` in its data directory, as an operator redirects it.
struct Server {
    child: Child,
    dir: tempfile::TempDir,
    /// `https://127.0.0.1:PORT`.
    base: String,
    port: u16,
    fingerprint: String,
    admin_token: String,
}

impl Server {
    fn start() -> Result<Server> {
        let dir = tempfile::Builder::new()
            .permissions(std::fs::Permissions::from_mode(0o700))
            .tempdir()?;
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let log = std::fs::File::create(dir.path().join("server.log"))?;
        let mut child = Command::new(binary("canopy-server")?)
            .args(["serve", "--tls", "self-signed", "--data-dir"])
            .arg(dir.path().join("data"))
            .args(["--listen", &format!("127.0.0.1:{port}")])
            // Whatever the environment says, the default: a person's log.
            .env_remove("CANOPY_LOG_FORMAT")
            .env_remove("NO_COLOR")
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log))
            .spawn()
            .context("cannot start canopy-server")?;
        let stdout = child.stdout.take().context("no stdout")?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut server = Server {
            child,
            dir,
            base: String::new(),
            port,
            fingerprint: String::new(),
            admin_token: String::new(),
        };
        let started = Instant::now();
        while server.base.is_empty() {
            let left = STARTUP_TIMEOUT.saturating_sub(started.elapsed());
            let line = rx.recv_timeout(left).map_err(|_| {
                anyhow::anyhow!(
                    "canopy-server did not start within {STARTUP_TIMEOUT:?}; log:\n{}",
                    server.log()
                )
            })?;
            if let Some(token) = line.strip_prefix("admin token: ") {
                server.admin_token = token.to_string();
            } else if let Some(fingerprint) = line.strip_prefix("tls fingerprint: ") {
                server.fingerprint = fingerprint.to_string();
            } else if let Some(url) = line.strip_prefix("listening on ") {
                server.base = url.to_string();
            }
        }
        ensure!(!server.admin_token.is_empty(), "no admin token printed");
        ensure!(!server.fingerprint.is_empty(), "no fingerprint printed");
        Ok(server)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default()
    }

    /// `canopy-server ARGS --data-dir DIR` on this server's database.
    fn manage(&self, args: &[&str]) -> Result<Output> {
        Ok(Command::new(binary("canopy-server")?)
            .args(args)
            .arg("--data-dir")
            .arg(self.dir.path().join("data"))
            .env("RUST_LOG", "warn")
            .output()?)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `canopy` with a config directory of its own, so no saved login leaks in.
struct Cli {
    config: tempfile::TempDir,
}

impl Cli {
    fn new() -> Result<Cli> {
        Ok(Cli {
            config: tempfile::tempdir()?,
        })
    }

    fn run(&self, args: &[&str]) -> Result<Output> {
        Ok(Command::new(env!("CARGO_BIN_EXE_canopy"))
            .args(args)
            .env("CANOPY_CONFIG_DIR", self.config.path())
            .env("CANOPY_LOG", "warn")
            .env_remove("CANOPY_TOKEN")
            .output()?)
    }

    /// Runs a command that must fail in the house style; its stderr.
    fn fails(&self, args: &[&str]) -> Result<String> {
        let out = self.run(args)?;
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        ensure!(!out.status.success(), "{args:?} succeeded: {stderr}");
        ensure!(stderr.starts_with("error:"), "{args:?}: {stderr}");
        ensure!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        Ok(stderr)
    }
}

fn contains_all(text: &str, parts: &[&str]) -> Result<()> {
    for part in parts {
        ensure!(text.contains(part), "missing `{part}` in:\n{text}");
    }
    Ok(())
}

const SERVER_IS_DOWN_HINT: &str = "check that the server is running";

#[test]
fn plain_http_against_the_https_server_says_to_use_https() -> Result<()> {
    let server = Server::start()?;
    let cli = Cli::new()?;
    let http = format!("http://127.0.0.1:{}", server.port);
    let stderr = cli.fails(&["login", &http, "--token", &server.admin_token])?;
    contains_all(
        &stderr,
        &[
            &format!("error: cannot talk to the Canopy server at {http}: it speaks HTTPS"),
            &format!(
                "hint: this server speaks HTTPS: use https://127.0.0.1:{}",
                server.port
            ),
        ],
    )?;
    ensure!(!stderr.contains(SERVER_IS_DOWN_HINT), "{stderr}");

    // The agent shares the diagnosis (the SDK's).
    let agent_dir = tempfile::tempdir()?;
    let out = Command::new(binary("canopy-agent")?)
        .arg("--data-dir")
        .arg(agent_dir.path())
        .args(["enroll", "--server", &http, "--token", "cnpe_x"])
        .env("CANOPY_LOG", "warn")
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(!out.status.success(), "{stderr}");
    contains_all(&stderr, &["hint: this server speaks HTTPS: use https://"])?;
    ensure!(!stderr.contains("that the server is running"), "{stderr}");
    Ok(())
}

#[test]
fn an_unpinned_or_other_certificate_says_how_to_pin_it() -> Result<()> {
    let server = Server::start()?;
    let cli = Cli::new()?;
    let stderr = cli.fails(&["login", &server.base, "--token", &server.admin_token])?;
    contains_all(
        &stderr,
        &[
            "its certificate is not trusted",
            "UnknownIssuer",
            "hint: the server's certificate is not trusted: pin it with --fingerprint sha256:",
            "--ca-cert FILE",
        ],
    )?;
    ensure!(!stderr.contains(SERVER_IS_DOWN_HINT), "{stderr}");

    let other = format!("sha256:{}", "ab".repeat(32));
    let stderr = cli.fails(&[
        "login",
        &server.base,
        "--token",
        &server.admin_token,
        "--fingerprint",
        &other,
    ])?;
    contains_all(
        &stderr,
        &[
            "its certificate is not the pinned one",
            &format!("does not match the pinned {other}"),
            "hint: the server's certificate is not the pinned one",
        ],
    )?;
    ensure!(!stderr.contains(SERVER_IS_DOWN_HINT), "{stderr}");

    // Pinned right, it works; a server that is down still gets that hint.
    let out = cli.run(&[
        "login",
        &server.base,
        "--token",
        &server.admin_token,
        "--fingerprint",
        &server.fingerprint,
    ])?;
    ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    drop(server);
    let stderr = cli.fails(&["job", "ls"])?;
    contains_all(
        &stderr,
        &["cannot reach the Canopy server", SERVER_IS_DOWN_HINT],
    )?;
    Ok(())
}

#[test]
fn expired_tokens_are_listed_as_expired() -> Result<()> {
    let server = Server::start()?;
    let created = server.manage(&[
        "token",
        "create",
        "--role",
        "viewer",
        "--expires",
        "1s",
        "--label",
        "short-lived",
    ])?;
    ensure!(
        created.status.success(),
        "{}",
        String::from_utf8_lossy(&created.stderr)
    );
    let stdout = String::from_utf8_lossy(&created.stdout);
    let id = stdout
        .lines()
        .find_map(|line| line.strip_prefix("token id: "))
        .context("token create prints the id")?
        .to_string();
    let secret = stdout
        .lines()
        .find_map(|line| line.strip_prefix("viewer token: "))
        .context("token create prints the secret")?
        .to_string();
    std::thread::sleep(Duration::from_millis(1_500));

    let listed = server.manage(&["token", "list"])?;
    let listed = String::from_utf8_lossy(&listed.stdout).to_string();
    let line = listed
        .lines()
        .find(|line| line.contains("short-lived"))
        .with_context(|| format!("token {id} is listed:\n{listed}"))?;
    ensure!(
        line.split_whitespace().nth(2) == Some("expired"),
        "token {id} is listed as expired: {line}"
    );
    let admin = listed
        .lines()
        .find(|line| line.split_whitespace().nth(1) == Some("admin"))
        .with_context(|| format!("the admin token is listed:\n{listed}"))?;
    ensure!(admin.split_whitespace().nth(2) == Some("active"), "{admin}");

    // The admin API lists it so too, and it no longer logs in.
    let cli = Cli::new()?;
    let tokens = api_get(&server, "/api/v1/tokens")?;
    let item = tokens["items"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|item| matches!((item["id"].as_i64(), id.parse::<i64>()), (Some(a), Ok(b)) if a == b))
        .with_context(|| format!("token {id} in {tokens}"))?;
    ensure!(item["state"] == "expired", "{item}");
    let stderr = cli.fails(&[
        "login",
        &server.base,
        "--token",
        &secret,
        "--fingerprint",
        &server.fingerprint,
    ])?;
    contains_all(&stderr, &["refused the token"])?;
    Ok(())
}

/// `GET path` with the admin token, pinned to the server's certificate.
fn api_get(server: &Server, path: &str) -> Result<serde_json::Value> {
    let transport = canopy_sdk::Transport::new(
        &server.base,
        &canopy_sdk::Trust::PinnedSha256(server.fingerprint.clone()),
    )?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let response = transport
            .http()
            .get(transport.url(path))
            .bearer_auth(&server.admin_token)
            .send()
            .await?;
        let status = response.status();
        let body: serde_json::Value = serde_json::from_slice(&response.bytes().await?)?;
        if !status.is_success() {
            bail!("{path} answered {status}: {body}");
        }
        Ok::<_, anyhow::Error>(body)
    })
}

#[test]
fn a_redirected_server_log_is_plain_text() -> Result<()> {
    let server = Server::start()?;
    // A request, so that the log has more than start-up lines.
    api_get(&server, "/api/v1/jobs")?;
    let log = std::fs::read(server.dir.path().join("server.log"))?;
    let text = String::from_utf8_lossy(&log);
    ensure!(text.contains("INFO"), "the log has info lines:\n{text}");
    ensure!(
        !log.contains(&0x1b),
        "ANSI escape codes in a redirected log:\n{text:?}"
    );
    Ok(())
}
