//! Test harness: real `canopy-server` processes over real HTTPS, on SQLite
//! or the local PostgreSQL, with devices that hold real Ed25519 keys.
#![allow(dead_code)]

pub mod edge;
pub mod proc_stats;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};
use bytes::Bytes;
use canopy_protocol::auth::DeviceKey;
use canopy_protocol::messages::{Capabilities, DeviceRole, Task, Tier};
use canopy_sdk::{DeviceClient, Transport, Trust};
use serde_json::{Value, json};

/// Writes a server config file holding `limits` (a TOML table body) in
/// `dir`; its path, for `--config`.
pub fn limits_file(dir: &std::path::Path, limits: &str) -> Result<String> {
    let path = dir.join("limits.toml");
    std::fs::write(&path, format!("[limits]\n{limits}\n"))?;
    Ok(path.display().to_string())
}

/// The PostgreSQL server tests use; CI sets it and fails if unreachable.
pub const POSTGRES_URL_VAR: &str = "CANOPY_TEST_POSTGRES_URL";
pub const DEFAULT_POSTGRES_URL: &str = "postgres://postgres@127.0.0.1:5432/test";
const STARTUP_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Database {
    Sqlite,
    Postgres,
}

pub fn postgres_admin_url() -> String {
    std::env::var(POSTGRES_URL_VAR).unwrap_or_else(|_| DEFAULT_POSTGRES_URL.to_string())
}

/// A fresh PostgreSQL database for one test, dropped with the server.
pub fn create_postgres_database() -> Result<(String, String)> {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let admin = postgres_admin_url();
    let name = format!(
        "canopy_test_{}_{}_{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed),
        Instant::now().elapsed().subsec_nanos() % 1000
    );
    psql(&admin, &format!("CREATE DATABASE {name}")).with_context(|| {
        format!("PostgreSQL is unreachable at {admin}; start it or set {POSTGRES_URL_VAR}")
    })?;
    let base = admin
        .rsplit_once('/')
        .map(|(base, _)| base)
        .unwrap_or(&admin);
    Ok((format!("{base}/{name}"), name))
}

/// Drops a database that [`create_postgres_database`] made.
pub fn drop_postgres_database(name: &str) -> Result<()> {
    psql(
        &postgres_admin_url(),
        &format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
    )
}

fn psql(url: &str, statement: &str) -> Result<()> {
    let output = Command::new("psql")
        .args([url, "-v", "ON_ERROR_STOP=1", "-q", "-c", statement])
        .output()
        .context("cannot run psql")?;
    if !output.status.success() {
        bail!(
            "psql `{statement}` failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(())
}

/// The `canopy-server` binary: cargo names it for the server's own tests;
/// elsewhere (workspace-level tests) it sits next to the test's `deps/`.
pub fn server_binary() -> PathBuf {
    if let Some(path) = option_env!("CARGO_BIN_EXE_canopy-server") {
        return PathBuf::from(path);
    }
    sibling_binary("canopy-server")
}

/// A workspace binary in the target directory this test runs from.
pub fn sibling_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test executable's path");
    let dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>/deps");
    dir.join(format!("{name}{}", std::env::consts::EXE_SUFFIX))
}

/// A temporary directory only its owner can read, as the server requires
/// of its data directory.
pub fn private_tempdir() -> Result<tempfile::TempDir> {
    let mut builder = tempfile::Builder::new();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        builder.permissions(std::fs::Permissions::from_mode(0o700));
    }
    Ok(builder.tempdir()?)
}

/// The port of the `listening on` URL a server printed. A server told to
/// listen on port 0 binds a free one itself, so no other test can take it
/// between the choice and the bind, as with a port picked beforehand.
fn listening_port(url: &str) -> Result<u16> {
    url.rsplit_once(':')
        .and_then(|(_, port)| port.trim_end_matches('/').parse().ok())
        .ok_or_else(|| anyhow!("`listening on {url}` names no port"))
}

/// SIGKILL to a process, if it runs, and waits for it.
pub fn kill9(child: &mut Option<Child>) {
    if let Some(mut child) = child.take() {
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// What a starting server prints on stdout for tools to read.
pub struct Announced {
    /// On the very first start only.
    pub admin_token: Option<String>,
    pub fingerprint: String,
    pub base: String,
    pub port: u16,
}

/// Starts a server process (`canopy-server serve`, `canopy-agent
/// aggregate`) with its stderr appended to `log`, and reads what it
/// announces once it listens.
pub fn start_announcing(
    mut command: Command,
    program: &str,
    log: &Path,
) -> Result<(Child, Announced)> {
    let log_file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)?;
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(log_file))
        .spawn()
        .with_context(|| format!("cannot start {program}"))?;
    let announced = read_announcements(&mut child, program, log)?;
    Ok((child, announced))
}

/// Reads a starting server's stdout (`canopy-server serve`, `canopy-agent
/// aggregate`) up to its `listening on` line; `log` is shown if it never
/// comes.
pub fn read_announcements(child: &mut Child, program: &str, log: &Path) -> Result<Announced> {
    let stdout = child.stdout.take().ok_or_else(|| anyhow!("no stdout"))?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let started = Instant::now();
    let (mut admin_token, mut fingerprint) = (None, String::new());
    loop {
        let remaining = STARTUP_TIMEOUT
            .checked_sub(started.elapsed())
            .unwrap_or_default();
        let line = rx.recv_timeout(remaining).map_err(|_| {
            let log = std::fs::read_to_string(log).unwrap_or_default();
            anyhow!("{program} did not start within {STARTUP_TIMEOUT:?}; log:\n{log}")
        })?;
        if let Some(token) = line.strip_prefix("admin token: ") {
            admin_token = Some(token.to_string());
        } else if let Some(print) = line.strip_prefix("tls fingerprint: ") {
            fingerprint = print.to_string();
        } else if let Some(url) = line.strip_prefix("listening on ") {
            return Ok(Announced {
                admin_token,
                fingerprint,
                base: url.to_string(),
                port: listening_port(url)?,
            });
        }
    }
}

pub struct TestServer {
    child: Option<Child>,
    pub base: String,
    pub port: u16,
    pub fingerprint: String,
    pub admin_token: String,
    pub database: Database,
    pub database_url: String,
    pub data_dir: tempfile::TempDir,
    pg_name: Option<String>,
    extra_args: Vec<String>,
    /// The server's `RUST_LOG`.
    pub rust_log: String,
}

impl TestServer {
    /// The arguments of `canopy login` to this server with `token`.
    pub fn login_args<'a>(&'a self, token: &'a str) -> [&'a str; 6] {
        [
            "login",
            &self.base,
            "--token",
            token,
            "--fingerprint",
            &self.fingerprint,
        ]
    }

    pub fn start(database: Database) -> Result<TestServer> {
        TestServer::start_with(database, &[])
    }

    /// `extra_args` go to `serve`, e.g. a `--config` file with limits.
    pub fn start_with(database: Database, extra_args: &[&str]) -> Result<TestServer> {
        TestServer::start_logging(database, extra_args, "info,sqlx=warn")
    }

    /// [`TestServer::start_with`] with the server's `RUST_LOG` filter.
    pub fn start_logging(
        database: Database,
        extra_args: &[&str],
        rust_log: &str,
    ) -> Result<TestServer> {
        let data_dir = private_tempdir()?;
        let (database_url, pg_name) = match database {
            Database::Sqlite => (
                format!(
                    "sqlite://{}?mode=rwc",
                    data_dir.path().join("canopy.db").display()
                ),
                None,
            ),
            Database::Postgres => {
                let (url, name) = create_postgres_database()?;
                (url, Some(name))
            }
        };
        let mut server = TestServer {
            child: None,
            base: String::new(),
            // The server binds a free port itself; restarts reuse it.
            port: 0,
            fingerprint: String::new(),
            admin_token: String::new(),
            database,
            database_url,
            data_dir,
            pg_name,
            extra_args: extra_args.iter().map(|s| s.to_string()).collect(),
            rust_log: rust_log.to_string(),
        };
        server.spawn()?;
        if server.admin_token.is_empty() {
            bail!("the first start printed no admin token");
        }
        Ok(server)
    }

    /// A second server process on the same database and blob store, as
    /// when one machine is not enough.
    pub fn second_process(&self) -> Result<TestServer> {
        let extra_args: Vec<&str> = self.extra_args.iter().map(String::as_str).collect();
        self.second_process_with(&extra_args)
    }

    /// [`TestServer::second_process`] with its own `extra_args` (e.g. a
    /// `--config` file with other limits) instead of this one's.
    pub fn second_process_with(&self, extra_args: &[&str]) -> Result<TestServer> {
        let blobs = self.data_dir.path().join("blobs").display().to_string();
        let mut extra_args: Vec<String> = extra_args.iter().map(|s| s.to_string()).collect();
        extra_args.extend(["--blob-store".to_string(), blobs]);
        let mut server = TestServer {
            child: None,
            base: String::new(),
            // The server binds a free port itself; restarts reuse it.
            port: 0,
            fingerprint: String::new(),
            admin_token: self.admin_token.clone(),
            database: self.database,
            database_url: self.database_url.clone(),
            data_dir: private_tempdir()?,
            pg_name: None,
            extra_args,
            rust_log: self.rust_log.clone(),
        };
        server.spawn()?;
        Ok(server)
    }

    pub fn log_path(&self) -> PathBuf {
        self.data_dir.path().join("server.log")
    }

    fn spawn(&mut self) -> Result<()> {
        let mut command = Command::new(server_binary());
        command
            .arg("serve")
            .arg("--data-dir")
            .arg(self.data_dir.path())
            .args(["--listen", &format!("127.0.0.1:{}", self.port)])
            .args(["--database-url", &self.database_url])
            .args(["--tls", "self-signed", "--log-format", "json"])
            .args(&self.extra_args)
            .env("RUST_LOG", &self.rust_log);
        let (child, announced) = start_announcing(command, "canopy-server", &self.log_path())?;
        self.admin_token = announced
            .admin_token
            .unwrap_or(std::mem::take(&mut self.admin_token));
        (self.fingerprint, self.base, self.port) =
            (announced.fingerprint, announced.base, announced.port);
        self.child = Some(child);
        Ok(())
    }

    /// SIGKILL: no shutdown code runs, as in a power cut.
    pub fn kill9(&mut self) {
        kill9(&mut self.child);
    }

    /// SIGTERM, then waits for the process to exit.
    pub fn terminate(&mut self) -> Result<std::process::ExitStatus> {
        let mut child = self
            .child
            .take()
            .ok_or_else(|| anyhow!("server not running"))?;
        let status = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()?;
        if !status.success() {
            bail!("kill -TERM failed");
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = child.try_wait()? {
                return Ok(status);
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                bail!("the server did not exit within 60 s of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Sends SIGTERM without waiting.
    pub fn signal_term(&self) -> Result<()> {
        let pid = self.pid().ok_or_else(|| anyhow!("server not running"))?;
        let status = Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()?;
        anyhow::ensure!(status.success(), "kill -TERM {pid} failed");
        Ok(())
    }

    /// Waits for the process to exit on its own.
    pub fn wait_exit(&mut self, timeout: Duration) -> Result<std::process::ExitStatus> {
        let mut child = self
            .child
            .take()
            .ok_or_else(|| anyhow!("server not running"))?;
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = child.try_wait()? {
                return Ok(status);
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                bail!("the server did not exit within {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn restart(&mut self) -> Result<()> {
        self.kill9();
        self.spawn()
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn trust(&self) -> Trust {
        Trust::PinnedSha256(self.fingerprint.clone())
    }

    /// `/metrics` as Prometheus scrapes it, with the admin token it needs.
    pub async fn metrics(&self) -> Result<String> {
        let transport = self.transport();
        Ok(transport
            .http()
            .get(transport.url("/metrics"))
            .bearer_auth(&self.admin_token)
            .send()
            .await?
            .text()
            .await?)
    }

    pub fn transport(&self) -> Transport {
        Transport::new(&self.base, &self.trust()).expect("transport")
    }

    pub fn admin(&self) -> Admin {
        self.admin_as(&self.admin_token)
    }

    pub fn admin_as(&self, token: &str) -> Admin {
        Admin {
            transport: self.transport(),
            token: token.to_string(),
        }
    }

    /// Runs `canopy-server signing-key ARGS` against this server's
    /// database, as an operator would; returns its stdout.
    pub fn signing_key(&self, args: &[&str]) -> Result<String> {
        let output = Command::new(server_binary())
            .arg("signing-key")
            .args(args)
            .arg("--data-dir")
            .arg(self.data_dir.path())
            .args(["--database-url", &self.database_url])
            .output()
            .context("cannot run canopy-server signing-key")?;
        let stdout = String::from_utf8_lossy(&output.stdout).to_string();
        if !output.status.success() {
            bail!(
                "signing-key {args:?} failed: {}{stdout}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        Ok(stdout)
    }

    /// Waits up to 10 s until the server signs models with `key_hex` (it
    /// reloads its keys every `limits.signing_key_reload_ms`).
    pub async fn wait_until_signing_with(&self, key_hex: &str) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let current = self.admin().ok("/device/v1/server-key").await?;
            if current["server_public_key"] == key_hex {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("the server did not pick up key {key_hex} within 10 s: {current}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.kill9();
        if let Some(name) = &self.pg_name {
            let _ = drop_postgres_database(name);
        }
    }
}

/// An admin API client with a bearer token.
pub struct Admin {
    pub transport: Transport,
    pub token: String,
}

/// Status and parsed JSON body (Null when empty or not JSON).
pub struct Reply {
    pub status: u16,
    pub body: Value,
}

impl Admin {
    pub async fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<Reply> {
        let mut request = self
            .transport
            .http()
            .request(method, self.transport.url(path))
            .bearer_auth(&self.token);
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await?;
        reply(response).await
    }

    pub async fn get(&self, path: &str) -> Result<Reply> {
        self.send(reqwest::Method::GET, path, None).await
    }

    pub async fn post(&self, path: &str, body: Value) -> Result<Reply> {
        self.send(reqwest::Method::POST, path, Some(body)).await
    }

    /// Posts a job that must be refused, 400 or 422, with a message that
    /// names `needle` (the field, the bound); `what` names the case.
    pub async fn job_refused(&self, body: Value, needle: &str, what: &str) -> Result<()> {
        let reply = self.post("/api/v1/jobs", body).await?;
        ensure!(
            reply.status == 422 || reply.status == 400,
            "{what}: answered {} {}",
            reply.status,
            reply.body
        );
        let message = reply.body["error"]["message"].as_str().unwrap_or_default();
        ensure!(
            message.contains(needle),
            "{what}: `{message}` does not name `{needle}`"
        );
        Ok(())
    }

    pub async fn post_bytes(&self, path: &str, bytes: Vec<u8>) -> Result<Reply> {
        let response = self
            .transport
            .http()
            .post(self.transport.url(path))
            .bearer_auth(&self.token)
            .header("content-type", "application/octet-stream")
            .body(bytes)
            .send()
            .await?;
        reply(response).await
    }

    /// GET that must succeed; returns the JSON body.
    pub async fn ok(&self, path: &str) -> Result<Value> {
        let reply = self.get(path).await?;
        if reply.status != 200 {
            bail!("GET {path} answered {}: {}", reply.status, reply.body);
        }
        Ok(reply.body)
    }

    pub async fn upload_model(&self, name: &str, bytes: Vec<u8>) -> Result<Value> {
        let reply = self
            .post_bytes(&format!("/api/v1/models/{name}/versions"), bytes)
            .await?;
        if reply.status != 201 {
            bail!("model upload answered {}: {}", reply.status, reply.body);
        }
        Ok(reply.body)
    }

    pub async fn enrollment_token(&self, max_uses: u32) -> Result<String> {
        self.enrollment_token_for("device", max_uses).await
    }

    /// A token that enrolls devices of `role` (`device` or `aggregator`).
    pub async fn enrollment_token_for(&self, role: &str, max_uses: u32) -> Result<String> {
        let reply = self
            .post(
                "/api/v1/enrollment-tokens",
                json!({"expires_in": "1h", "max_uses": max_uses, "label": "test", "role": role}),
            )
            .await?;
        if reply.status != 201 {
            bail!("enrollment token answered {}: {}", reply.status, reply.body);
        }
        Ok(reply.body["secret"]
            .as_str()
            .unwrap_or_default()
            .to_string())
    }

    pub async fn create_job(&self, spec: Value) -> Result<i64> {
        let reply = self.post("/api/v1/jobs", spec).await?;
        if reply.status != 201 {
            bail!("job creation answered {}: {}", reply.status, reply.body);
        }
        let id = reply.body["id"]
            .as_i64()
            .ok_or_else(|| anyhow!("no job id"))?;
        let start = self
            .post(&format!("/api/v1/jobs/{id}/start"), json!({}))
            .await?;
        if start.status != 200 {
            bail!("job start answered {}: {}", start.status, start.body);
        }
        Ok(id)
    }

    /// Polls a job until it leaves `running`, or fails after `timeout`.
    pub async fn wait_for_job(&self, id: i64, timeout: Duration) -> Result<Value> {
        let deadline = Instant::now() + timeout;
        loop {
            let job = self.ok(&format!("/api/v1/jobs/{id}")).await?;
            let state = job["state"].as_str().unwrap_or_default();
            if !matches!(state, "running" | "created" | "paused") {
                return Ok(job);
            }
            if Instant::now() > deadline {
                bail!("job {id} still {state} after {timeout:?}: {job}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Polls a secure round until its key stage is `stage`.
    pub async fn wait_for_stage(
        &self,
        round_id: i64,
        stage: &str,
        timeout: Duration,
    ) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let round = self.ok(&format!("/api/v1/rounds/{round_id}")).await?;
            if round["secure_stage"] == stage {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("round {round_id} never reached stage {stage}: {round}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Polls a job until its status message contains `fragment`.
    pub async fn wait_for_status(
        &self,
        id: i64,
        fragment: &str,
        timeout: Duration,
    ) -> Result<Value> {
        let deadline = Instant::now() + timeout;
        loop {
            let view = self.ok(&format!("/api/v1/jobs/{id}")).await?;
            let status = view["status_message"].as_str().unwrap_or_default();
            if status.contains(fragment) {
                return Ok(view);
            }
            if Instant::now() > deadline {
                bail!("job {id}'s status never said `{fragment}`: {view}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

async fn reply(response: reqwest::Response) -> Result<Reply> {
    let status = response.status().as_u16();
    let bytes = response.bytes().await?;
    let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    Ok(Reply { status, body })
}

pub fn capabilities() -> Capabilities {
    Capabilities {
        tier: Tier::Edge,
        backends: vec!["cpu".to_string()],
        memory_mb: 4096,
        os: "linux".to_string(),
        tags: Default::default(),
        gpu: None,
    }
}

/// Long-polls until the device is handed a task, or fails after 20 polls
/// of up to 3 s.
pub async fn poll_task(device: &DeviceClient) -> Result<Task> {
    for _ in 0..20 {
        if let Some(task) = device.next_task(3_000).await? {
            return Ok(task);
        }
    }
    bail!("device {} got no task", device.device_id)
}

/// Enrolls a device with a fresh key.
pub async fn enroll_device(server: &TestServer, token: &str) -> Result<DeviceClient> {
    enroll_device_with(server, token, capabilities()).await
}

/// Enrolls a device with a fresh key, reporting `capabilities`.
pub async fn enroll_device_with(
    server: &TestServer,
    token: &str,
    capabilities: Capabilities,
) -> Result<DeviceClient> {
    enroll_in(server, token, capabilities, DeviceRole::Device).await
}

/// Enrolls an aggregator (the test plays an edge) with a fresh key.
pub async fn enroll_aggregator(server: &TestServer, token: &str) -> Result<DeviceClient> {
    enroll_in(server, token, capabilities(), DeviceRole::Aggregator).await
}

async fn enroll_in(
    server: &TestServer,
    token: &str,
    capabilities: Capabilities,
    role: DeviceRole,
) -> Result<DeviceClient> {
    let transport = server.transport();
    let key = DeviceKey::generate();
    let enrolled = canopy_sdk::enroll_as(&transport, token, &key, capabilities, role).await?;
    Ok(DeviceClient::new(
        transport,
        enrolled.device_id,
        key,
        &enrolled.server_public_key,
    )?)
}

/// A small trainable model: logistic regression on 64 features, 10 classes.
pub fn logreg_model_bytes(seed: u64) -> Vec<u8> {
    model_bytes(
        canopy_engine::zoo::Architecture::LogReg {
            inputs: 64,
            classes: 10,
        },
        seed,
    )
}

/// A trainable model file of the given architecture, trained with SGD,
/// its input statistics declared fitted.
pub fn model_bytes(architecture: canopy_engine::zoo::Architecture, seed: u64) -> Vec<u8> {
    let config = canopy_engine::zoo::ModelConfig {
        architecture,
        seed,
        optimizer: canopy_engine::optim::Optimizer::parse("sgd").expect("sgd"),
        frozen_prefixes: Vec::new(),
        producer: "canopy-server tests".to_string(),
    };
    let mut model = canopy_engine::zoo::build_model(&config).expect("model builds");
    // These tests drive devices with synthetic updates, so the model's
    // input statistics are declared fitted (as the identity) and jobs
    // start training at once; `statistics.rs` runs the statistics round.
    model.metadata.properties.insert(
        canopy_engine::zoo::PROP_INPUT_STATS.into(),
        canopy_engine::stats::InputStatsState::Fitted
            .marker()
            .into(),
    );
    canopy_ir::format::write_model(&model).expect("model serialises")
}

/// Downloads a version's file through the admin API and parses it.
/// A server's counters that benches compare, from its Prometheus text.
#[derive(Clone, Copy, Debug, Default)]
pub struct ServerCounters {
    /// Requests answered, every route.
    pub requests: f64,
    /// Update bytes taken in.
    pub bytes_in: f64,
    /// Model bytes sent.
    pub bytes_out: f64,
}

/// [`ServerCounters`] read from `/metrics`.
pub async fn server_counters(admin: &Admin) -> Result<ServerCounters> {
    let text = admin
        .transport
        .http()
        .get(admin.transport.url("/metrics"))
        .bearer_auth(&admin.token)
        .send()
        .await?
        .text()
        .await?;
    let mut counters = ServerCounters::default();
    for line in text.lines().filter(|line| !line.starts_with('#')) {
        let Some((name, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let value: f64 = value.parse().unwrap_or(0.0);
        if name.starts_with("canopy_http_request_duration_seconds_count") {
            counters.requests += value;
        } else if name == "canopy_update_bytes_received_total" {
            counters.bytes_in += value;
        } else if name == "canopy_model_bytes_sent_total" {
            counters.bytes_out += value;
        }
    }
    Ok(counters)
}

/// A model's trainable parameters, in order, as one vector; the tests'
/// models train only f32 parameters.
pub fn trainable(model: &canopy_ir::Model) -> Vec<f32> {
    model
        .trainable_values()
        .expect("a test model's trainable parameters are f32")
}

pub async fn fetch_model(admin: &Admin, name: &str, version: i64) -> Result<canopy_ir::Model> {
    let response = admin
        .transport
        .http()
        .get(admin.transport.url(&format!(
            "/api/v1/models/{name}/versions/{version}/download"
        )))
        .bearer_auth(&admin.token)
        .send()
        .await?;
    if response.status() != 200 {
        bail!("download answered {}", response.status());
    }
    let bytes: Bytes = response.bytes().await?;
    Ok(canopy_ir::format::read_model(&bytes)?)
}
