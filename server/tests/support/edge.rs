//! A real edge aggregator, `canopy-agent aggregate`, for tests and
//! benches: enrolled with a cloud as an aggregator, started and killed
//! like a server.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use anyhow::{Context, Result, ensure};
use canopy_sdk::{Transport, Trust};

use super::{Admin, TestServer, private_tempdir, read_announcements, sibling_binary};

/// One edge aggregator: the agent's data directory and, while it runs,
/// its `aggregate` process with what it announced.
pub struct Edge {
    pub dir: tempfile::TempDir,
    pub child: Option<Child>,
    pub base: String,
    pub port: u16,
    pub fingerprint: String,
    pub admin_token: String,
    /// `aggregate`'s arguments after `--listen` and `--tls`.
    pub extra_args: Vec<String>,
}

impl Edge {
    pub fn command(&self) -> Command {
        let mut command = Command::new(sibling_binary("canopy-agent"));
        command
            .arg("--data-dir")
            .arg(self.dir.path())
            .env("RUST_LOG", "info,sqlx=warn")
            .env_remove("CANOPY_LOG")
            .env_remove("CANOPY_EDGE_DIR")
            .env_remove("CANOPY_CONFIG");
        command
    }

    /// Enrolls a new edge with the cloud as an aggregator.
    pub fn enroll(cloud: &TestServer, token: &str) -> Result<Edge> {
        let edge = Edge {
            dir: private_tempdir()?,
            child: None,
            base: String::new(),
            port: 0,
            fingerprint: String::new(),
            admin_token: String::new(),
            extra_args: Vec::new(),
        };
        let output = edge
            .command()
            .args(["enroll", "--server", &cloud.base, "--token", token])
            .args(["--fingerprint", &cloud.fingerprint, "--role", "aggregator"])
            .stdin(Stdio::null())
            .output()?;
        ensure!(
            output.status.success(),
            "aggregator enrollment failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        Ok(edge)
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("aggregate.log")
    }

    /// Starts `aggregate` on its port (a free one the first time).
    pub fn start(&mut self) -> Result<()> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())?;
        let mut child = self
            .command()
            .arg("aggregate")
            .args(["--listen", &format!("127.0.0.1:{}", self.port)])
            .args(["--tls", "self-signed"])
            .args(&self.extra_args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log))
            .spawn()
            .context("cannot start canopy-agent aggregate")?;
        let announced = read_announcements(&mut child, "canopy-agent aggregate", &self.log_path())?;
        if let Some(token) = announced.admin_token {
            self.admin_token = token;
        }
        self.fingerprint = announced.fingerprint;
        self.base = announced.base;
        self.port = announced.port;
        self.child = Some(child);
        Ok(())
    }

    /// SIGKILL: no shutdown code runs, as in a power cut.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn transport(&self) -> Transport {
        Transport::new(&self.base, &Trust::PinnedSha256(self.fingerprint.clone()))
            .expect("transport")
    }

    pub fn admin(&self) -> Admin {
        Admin {
            transport: self.transport(),
            token: self.admin_token.clone(),
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }
}

impl Drop for Edge {
    fn drop(&mut self) {
        self.kill9();
    }
}
