//! A real edge aggregator, `canopy-agent aggregate`, for tests and
//! benches: enrolled with a cloud as an aggregator, started and killed
//! like a server.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use anyhow::{Result, ensure};
use canopy_sdk::{Transport, Trust};

use super::{Admin, TestServer, private_tempdir, sibling_binary, start_announcing};

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
        Edge::enroll_with(cloud, token, &[])
    }

    /// [`Edge::enroll`] with more of `enroll`'s arguments
    /// (`--device-authority HEX`).
    pub fn enroll_with(cloud: &TestServer, token: &str, extra_args: &[&str]) -> Result<Edge> {
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
            .args(extra_args)
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
        let mut command = self.command();
        command
            .arg("aggregate")
            .args(["--listen", &format!("127.0.0.1:{}", self.port)])
            .args(["--tls", "self-signed"])
            .args(&self.extra_args);
        let (child, announced) =
            start_announcing(command, "canopy-agent aggregate", &self.log_path())?;
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
        super::kill9(&mut self.child);
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
