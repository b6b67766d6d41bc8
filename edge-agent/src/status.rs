//! `status.json`, the daemon's record of what it is doing and how its last
//! task went, and the `status` command that reports it together with the
//! enrollment and whether the server answers.

use std::time::Duration;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::config::AgentConfig;
use crate::datasets::Registry;
use crate::files::{
    DataDir, Durability, MAX_STATUS_BYTES, mode_of, read_text, truncate, write_public_as,
};
use crate::output::outln;

/// Longest error or detail text kept in the status file.
pub const MAX_DETAIL_CHARS: usize = 1000;
/// How long `status` waits for `/healthz`.
const HEALTH_TIMEOUT: Duration = Duration::from_secs(5);

/// How a task ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TaskResult {
    /// Still running (or the daemon died while it ran).
    InProgress,
    /// Trained and the update was accepted; or, for an evaluation task,
    /// the evaluation was reported.
    Uploaded,
    /// Refused before download, e.g. over `--max-memory-mb`.
    Refused,
    /// The round's deadline passed before the work was done.
    Expired,
    /// The server turned the update down (round closed, not selected).
    Rejected,
    /// Download, training or upload failed.
    Failed,
    /// The daemon was stopped and the grace period ran out.
    Abandoned,
}

impl TaskResult {
    pub fn as_str(self) -> &'static str {
        match self {
            TaskResult::InProgress => "in_progress",
            TaskResult::Uploaded => "uploaded",
            TaskResult::Refused => "refused",
            TaskResult::Expired => "expired",
            TaskResult::Rejected => "rejected",
            TaskResult::Failed => "failed",
            TaskResult::Abandoned => "abandoned",
        }
    }
}

/// What the daemon is doing: `status.json`'s `state`, and the heartbeat's
/// `state` on the wire, both as [`AgentState::as_str`] names it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "&'static str", try_from = "String")]
pub enum AgentState {
    /// Before the daemon has written its first status.
    #[default]
    Starting,
    /// Polling for a task.
    Idle,
    /// Not polling: `--only-when-idle` and the machine is busy.
    Deferred,
    /// A secure task's key stages, before the download.
    ExchangingKeys,
    Downloading,
    Training,
    /// An evaluation task: the round's version on the held-out split.
    Evaluating,
    /// A secure task's masked input and unmasking, after training.
    SecureAggregation,
    Uploading,
    Stopped,
}

impl AgentState {
    pub const ALL: [AgentState; 10] = [
        AgentState::Starting,
        AgentState::Idle,
        AgentState::Deferred,
        AgentState::ExchangingKeys,
        AgentState::Downloading,
        AgentState::Training,
        AgentState::Evaluating,
        AgentState::SecureAggregation,
        AgentState::Uploading,
        AgentState::Stopped,
    ];

    /// The state's one name, in `status.json`, the `status` command and
    /// heartbeats.
    pub fn as_str(self) -> &'static str {
        match self {
            AgentState::Starting => "starting",
            AgentState::Idle => "idle",
            AgentState::Deferred => "deferred",
            AgentState::ExchangingKeys => "exchanging-keys",
            AgentState::Downloading => "downloading",
            AgentState::Training => "training",
            AgentState::Evaluating => "evaluating",
            AgentState::SecureAggregation => "secure-aggregation",
            AgentState::Uploading => "uploading",
            AgentState::Stopped => "stopped",
        }
    }
}

impl std::fmt::Display for AgentState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<AgentState> for &'static str {
    fn from(state: AgentState) -> &'static str {
        state.as_str()
    }
}

impl TryFrom<String> for AgentState {
    type Error = String;

    fn try_from(name: String) -> Result<AgentState, String> {
        AgentState::ALL
            .into_iter()
            .find(|state| state.as_str() == name)
            .ok_or_else(|| format!("unknown agent state `{name}`"))
    }
}

/// One task, as the daemon saw it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TaskRecord {
    pub job_id: i64,
    pub round_id: i64,
    pub round_number: u32,
    pub model_version_id: i64,
    pub model_size_bytes: u64,
    pub received_unix_ms: u64,
    #[serde(default)]
    pub finished_unix_ms: Option<u64>,
    pub result: TaskResult,
    /// Why it was refused, rejected or failed.
    #[serde(default)]
    pub detail: Option<String>,
    #[serde(default)]
    pub num_samples: Option<u64>,
    #[serde(default)]
    pub train_loss: Option<f64>,
    #[serde(default)]
    pub train_duration_ms: Option<u64>,
    #[serde(default)]
    pub eval_accuracy: Option<f64>,
    #[serde(default)]
    pub eval_loss: Option<f64>,
    #[serde(default)]
    pub eval_samples: Option<u64>,
}

impl TaskRecord {
    pub fn finish(&mut self, result: TaskResult, detail: Option<String>) {
        self.result = result;
        self.detail = detail.map(|d| truncate(&d, MAX_DETAIL_CHARS));
        self.finished_unix_ms = Some(crate::files::now_ms());
    }
}

/// `status.json`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct AgentStatus {
    #[serde(default)]
    pub pid: Option<u32>,
    #[serde(default)]
    pub state: AgentState,
    #[serde(default)]
    pub updated_unix_ms: u64,
    #[serde(default)]
    pub started_unix_ms: Option<u64>,
    #[serde(default)]
    pub device_id: Option<i64>,
    #[serde(default)]
    pub dataset: Option<String>,
    #[serde(default)]
    pub tasks_uploaded: u64,
    /// Tasks that ended any other way.
    #[serde(default)]
    pub tasks_not_uploaded: u64,
    #[serde(default)]
    pub last_error: Option<String>,
    #[serde(default)]
    pub last_error_unix_ms: Option<u64>,
    #[serde(default)]
    pub last_task: Option<TaskRecord>,
}

impl AgentStatus {
    pub fn load(dir: &DataDir) -> Result<Option<AgentStatus>> {
        let path = dir.status();
        let Some(text) = read_text(&path, MAX_STATUS_BYTES)? else {
            return Ok(None);
        };
        serde_json::from_str(&text)
            .map(Some)
            .with_context(|| format!("status file `{}` is invalid", path.display()))
    }

    /// Writes the file atomically, stamping the time, without waiting for
    /// the disk ([`Durability::ProcessCrash`]): the daemon rewrites it at
    /// every step of every task, on the task's path, where two fsyncs on a
    /// busy disk cost a round seconds. It only reports: a power cut that
    /// brings back an older file, or leaves an empty one, costs the
    /// counters and the last task's record, and a daemon starting over an
    /// unreadable one logs it and starts afresh. A `kill -9` leaves the
    /// old file or the new one, as before.
    pub fn save(&mut self, dir: &DataDir) -> Result<()> {
        self.updated_unix_ms = crate::files::now_ms();
        let path = dir.status();
        let mut text = serde_json::to_string_pretty(self).context("cannot serialise the status")?;
        text.push('\n');
        write_public_as(&path, text.as_bytes(), Durability::ProcessCrash)
            .with_context(|| format!("cannot write status file `{}`", path.display()))
    }

    pub fn set_error(&mut self, error: &str) {
        self.last_error = Some(truncate(error, MAX_DETAIL_CHARS));
        self.last_error_unix_ms = Some(crate::files::now_ms());
    }
}

/// Whether a process with this id exists (Linux: `/proc/PID`).
fn process_alive(pid: u32) -> Option<bool> {
    if cfg!(target_os = "linux") {
        Some(std::path::Path::new(&format!("/proc/{pid}")).exists())
    } else {
        None
    }
}

/// `GET /healthz` over the enrolled trust; `Err` says why it failed.
fn check_server(agent: &AgentConfig) -> std::result::Result<(), String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the async runtime: {e}"))?;
    runtime.block_on(async {
        let transport = canopy_sdk::Transport::new(&agent.server, &agent.trust.to_trust())
            .map_err(|e| canopy_term::error_chain(&e))?;
        let response = transport
            .http()
            .get(transport.url("/healthz"))
            .timeout(HEALTH_TIMEOUT)
            .send()
            .await
            .map_err(|e| canopy_term::error_chain(&e))?;
        if response.status().is_success() {
            Ok(())
        } else {
            Err(format!("/healthz answered {}", response.status()))
        }
    })
}

/// `canopy-agent status`: always exits 0 when it could look; "not
/// enrolled" and "unreachable" are answers, not failures.
pub fn run(dir: &DataDir, as_json: bool) -> Result<()> {
    let agent = AgentConfig::load(dir)?;
    let status = AgentStatus::load(dir)?;
    let registry = Registry::load(dir)?;
    let reachable = agent.as_ref().map(check_server);
    let key_mode = mode_of(&dir.key());
    // What `canopy authority certify` needs: the id and this public key.
    let public_key = crate::config::load_key(&dir.key())
        .ok()
        .map(|key| key.public_key_hex());
    let running = status
        .as_ref()
        .and_then(|s| s.pid.filter(|_| s.state != AgentState::Stopped))
        .and_then(process_alive);
    if as_json {
        let value = json!({
            "data_dir": dir.root.display().to_string(),
            "enrolled": agent.is_some(),
            "device_id": agent.as_ref().map(|a| a.device_id),
            "server": agent.as_ref().map(|a| a.server.clone()),
            "trust": agent.as_ref().map(|a| a.trust.describe()),
            "tags": agent.as_ref().map(|a| a.tags.clone()),
            "key_mode": key_mode.map(|m| format!("{m:o}")),
            "public_key": public_key,
            "device_authority": agent.as_ref().and_then(|a| a.device_authority.clone()),
            "server_reachable": reachable.as_ref().map(|r| r.is_ok()),
            "server_error": reachable.as_ref().and_then(|r| r.as_ref().err().cloned()),
            "datasets": registry.datasets.len(),
            "default_dataset": registry.default,
            "daemon_running": running,
            "daemon": status,
        });
        outln!("{value}")?;
        return Ok(());
    }
    outln!("data dir:      {}", dir.root.display())?;
    match &agent {
        None => {
            outln!("enrolled:      no")?;
            outln!(
                "               enroll with `canopy-agent enroll --server URL --token TOKEN --fingerprint SHA256`"
            )?;
        }
        Some(agent) => {
            outln!("enrolled:      yes, device {}", agent.device_id)?;
            outln!("server:        {}", agent.server)?;
            outln!("trust:         {}", agent.trust.describe())?;
            if let Some(mode) = key_mode {
                let warning = if mode & 0o077 != 0 {
                    " (too open: should be 600)"
                } else {
                    ""
                };
                outln!("device key:    mode {mode:o}{warning}")?;
            }
            if let Some(public_key) = &public_key {
                outln!("public key:    {public_key}")?;
            }
            if let Some(authority) = &agent.device_authority {
                outln!("authority:     {authority} (pinned for secure rounds)")?;
            }
            match reachable.as_ref() {
                Some(Ok(())) => outln!("reachable:     yes (/healthz ok)")?,
                Some(Err(error)) => outln!("reachable:     no: {error}")?,
                None => {}
            }
        }
    }
    outln!(
        "datasets:      {} registered{}",
        registry.datasets.len(),
        registry
            .default
            .as_ref()
            .map(|d| format!(", default `{d}`"))
            .unwrap_or_default()
    )?;
    match &status {
        None => outln!("daemon:        has not run (no status.json)")?,
        Some(status) => {
            let alive = match running {
                Some(true) => " (running)",
                Some(false) => " (not running)",
                None => "",
            };
            outln!(
                "daemon:        {}{alive}, pid {}, updated {}",
                status.state,
                status.pid.map(|p| p.to_string()).unwrap_or("-".into()),
                ago(status.updated_unix_ms)
            )?;
            outln!(
                "tasks:         {} uploaded, {} not uploaded",
                status.tasks_uploaded,
                status.tasks_not_uploaded
            )?;
            if let Some(error) = &status.last_error {
                outln!(
                    "last error:    {error} ({})",
                    status.last_error_unix_ms.map(ago).unwrap_or_default()
                )?;
            }
            match &status.last_task {
                None => outln!("last task:     none yet")?,
                Some(task) => {
                    outln!(
                        "last task:     job {} round {} (#{}), model version {}: {}{}",
                        task.job_id,
                        task.round_id,
                        task.round_number,
                        task.model_version_id,
                        task.result.as_str(),
                        task.detail
                            .as_ref()
                            .map(|d| format!(": {d}"))
                            .unwrap_or_default()
                    )?;
                    if let (Some(acc), Some(loss)) = (task.eval_accuracy, task.train_loss) {
                        outln!(
                            "               held-out accuracy {acc:.4} before training, train loss {loss:.4}, {} samples, {} ms",
                            task.num_samples.unwrap_or(0),
                            task.train_duration_ms.unwrap_or(0)
                        )?;
                    }
                }
            }
        }
    }
    Ok(())
}

fn ago(unix_ms: u64) -> String {
    let now = crate::files::now_ms();
    if unix_ms == 0 {
        return "never".into();
    }
    let seconds = now.saturating_sub(unix_ms) / 1000;
    match seconds {
        0..=119 => format!("{seconds} s ago"),
        120..=7199 => format!("{} min ago", seconds / 60),
        _ => format!("{} h ago", seconds / 3600),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fails to compile when a state is added, until it is added to
    /// [`AgentState::ALL`] too (and so to parsing).
    fn listed(state: AgentState) -> bool {
        match state {
            AgentState::Starting
            | AgentState::Idle
            | AgentState::Deferred
            | AgentState::ExchangingKeys
            | AgentState::Downloading
            | AgentState::Training
            | AgentState::Evaluating
            | AgentState::SecureAggregation
            | AgentState::Uploading
            | AgentState::Stopped => AgentState::ALL.contains(&state),
        }
    }

    #[test]
    fn every_state_has_one_name_that_round_trips() {
        let mut names = std::collections::HashSet::new();
        for state in AgentState::ALL {
            assert!(listed(state));
            assert!(names.insert(state.as_str()), "{state} named twice");
            let json = serde_json::to_string(&state).expect("serialise");
            assert_eq!(json, format!("\"{}\"", state.as_str()));
            let back: AgentState = serde_json::from_str(&json).expect("parse");
            assert_eq!(back, state);
            assert_eq!(state.to_string(), state.as_str());
        }
        // The names status files and heartbeats have always carried.
        assert_eq!(AgentState::ExchangingKeys.as_str(), "exchanging-keys");
        assert_eq!(AgentState::SecureAggregation.as_str(), "secure-aggregation");
        assert!(serde_json::from_str::<AgentState>("\"napping\"").is_err());
    }

    #[test]
    fn a_status_file_keeps_its_state_by_name() {
        let status = AgentStatus {
            state: AgentState::Training,
            ..AgentStatus::default()
        };
        let text = serde_json::to_string(&status).expect("serialise");
        assert!(text.contains("\"state\":\"training\""), "{text}");
        let back: AgentStatus = serde_json::from_str(&text).expect("parse");
        assert_eq!(back.state, AgentState::Training);
        let without: AgentStatus = serde_json::from_str("{}").expect("parse");
        assert_eq!(without.state, AgentState::Starting);
    }
}
