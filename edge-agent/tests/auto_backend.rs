//! `canopy-agent run` with the default backend (`auto`) decides once, at
//! start, by the engine's one rule, and says so with the reason: on a
//! machine whose only adapter is a software one (lavapipe in CI) it never
//! opens that device, so no task pays for it.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use canopy_engine::select::{BackendChoice, decide_auto};

const ED25519_BASEPOINT: &str = "5866666666666666666666666666666666666666666666666666666666666666";

/// A local port nothing listens on.
fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

/// An agent data directory enrolled with a server that is not there, and
/// the bundled digits registered: enough for `run` to start and poll.
fn enrolled_with_nobody(data: &Path) {
    let digits = Path::new(env!("CARGO_MANIFEST_DIR")).join("../datasets/digits/digits.csv.gz");
    let added = Command::new(env!("CARGO_BIN_EXE_canopy-agent"))
        .arg("--data-dir")
        .arg(data)
        .args(["data", "add", "digits", "--kind", "csv", "--path"])
        .arg(&digits)
        .env("CANOPY_LOG", "warn")
        .env_remove("CANOPY_AGENT_DIR")
        .output()
        .unwrap();
    assert!(
        added.status.success(),
        "{}",
        String::from_utf8_lossy(&added.stderr)
    );
    let enrollment = format!(
        "server = \"https://127.0.0.1:{}\"\ndevice_id = 7\nserver_public_key = \"{ED25519_BASEPOINT}\"\n\
         heartbeat_interval_ms = 1000\nenrolled_unix_ms = 1\n\n[trust]\nkind = \"fingerprint\"\nsha256 = \"sha256:{}\"\n",
        closed_port(),
        "cd".repeat(32)
    );
    std::fs::write(data.join("agent.toml"), enrollment).unwrap();
    std::fs::write(data.join("device.key"), format!("{}\n", "11".repeat(32))).unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(
            data.join("device.key"),
            std::fs::Permissions::from_mode(0o600),
        )
        .unwrap();
    }
}

#[test]
fn the_default_backend_is_decided_once_at_start_by_the_engines_rule() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("agent");
    enrolled_with_nobody(&data);
    let log_path = tmp.path().join("agent.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_canopy-agent"))
        .arg("--data-dir")
        .arg(&data)
        .args(["run", "--poll-wait-ms", "1000"])
        .env("CANOPY_LOG", "info")
        .env("NO_COLOR", "1")
        .env("CANOPY_LOG_FORMAT", "text")
        .env_remove("CANOPY_AGENT_DIR")
        .stdout(Stdio::null())
        .stderr(Stdio::from(log))
        .spawn()
        .unwrap();
    let start = Instant::now();
    while !data.join("status.json").exists() && start.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(50));
    }
    // Polls fail against the closed port meanwhile; the decision came first.
    std::thread::sleep(Duration::from_millis(1500));
    let _ = child.kill();
    let _ = child.wait();
    let log = std::fs::read_to_string(&log_path).unwrap();

    // The rule over this machine's adapters, as the agent saw them.
    let expected = decide_auto(&canopy_engine::gpu::list_adapters());
    assert_eq!(
        log.matches("auto: ").count(),
        1,
        "the choice is logged once:\n{log}"
    );
    assert!(
        log.contains(&expected.reason),
        "the agent logs `{}`:\n{log}",
        expected.reason
    );
    if expected.choice == BackendChoice::Cpu {
        assert!(
            expected.reason.ends_with("training on the CPU"),
            "{}",
            expected.reason
        );
        assert!(
            !log.contains("GPU backend opened"),
            "with no hardware GPU the agent never opens an adapter:\n{log}"
        );
    }
}
