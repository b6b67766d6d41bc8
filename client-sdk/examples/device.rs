//! A device in Rust, on the SDK's blocking API: it enrolls on its first
//! run (later runs find the enrollment in their storage directory), offers
//! its CSV file as the dataset `digits`, and runs one task of a job that
//! names that dataset. The README's "Rust programs" block is this file
//! from its `use` lines down, and `tests/agents.rs` runs it against a job.
//!
//!     CANOPY_ENROLL_TOKEN=cnpe_… cargo run --release -p canopy-sdk --example device -- \
//!         https://127.0.0.1:8443 sha256:… quickstart/agent-0/digits.csv quickstart/rust-device

use std::path::Path;

use anyhow::{Context, Result, bail};
use canopy_engine::data::{LabelColumn, load_csv};
use canopy_protocol::auth::DeviceKey;
use canopy_protocol::messages::{Capabilities, EnrollResponse, Heartbeat, TaskKind, Tier};
use canopy_sdk::blocking::{DeviceClient, enroll};
use canopy_sdk::{Transport, Trust, describe_dataset, load_device_key, save_device_key};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [url, fingerprint, data_file, storage] = &args[..] else {
        bail!("usage: device URL FINGERPRINT DATA.csv STORAGE_DIR");
    };
    let transport = Transport::new(url, &Trust::PinnedSha256(fingerprint.clone()))?;
    let device = enrolled_device(transport, Path::new(storage))?;
    // A tenth is held out for evaluation tasks. Jobs that name a dataset
    // (`--dataset digits`) select only devices that offer it.
    let (train, held_out) = load_csv(data_file, LabelColumn::Last)?.split(0.1, 7)?;
    let digits = describe_dataset("digits", &train)?; // size, sample shape, classes
    device.heartbeat(&Heartbeat {
        datasets: Some(vec![digits]),
        ..Heartbeat::default()
    })?;
    let task = device
        .next_task(30_000)? // the server's longest poll (`long_poll_max_ms`)
        .context("no task within 30 s: is a job running with `--dataset digits`?")?;
    let data = match task.kind {
        TaskKind::Evaluate => &held_out,
        TaskKind::Train | TaskKind::Statistics => &train,
    };
    // Downloads the model (digest, signature and content checked), trains,
    // evaluates or fits statistics, and uploads (masked, in a secure round).
    let outcome = device.run_task(&task, data, 7)?;
    let loss = outcome
        .train_loss
        .map_or("-".into(), |loss| format!("{loss:.4}"));
    println!(
        "{:?} task of job {}, round {}: {} samples, train loss {loss}, {} bytes sent",
        task.kind,
        task.job_id,
        task.round_number,
        outcome.receipt.num_samples,
        outcome.receipt.bytes
    );
    Ok(())
}

/// The device `storage` holds, enrolled with the token in
/// `CANOPY_ENROLL_TOKEN` on the first run.
fn enrolled_device(transport: Transport, storage: &Path) -> Result<DeviceClient> {
    let key_path = storage.join("device.key");
    let enrollment_path = storage.join("enrollment.json");
    if !enrollment_path.exists() {
        let token = std::env::var("CANOPY_ENROLL_TOKEN").context(
            "the first run enrolls: set CANOPY_ENROLL_TOKEN (canopy device enroll-token)",
        )?;
        std::fs::create_dir_all(storage)?;
        let key = DeviceKey::generate();
        save_device_key(&key_path, &key)?; // mode 0600
        let capabilities = Capabilities {
            tier: Tier::End,
            backends: vec!["cpu".to_string()],
            memory_mb: 4096,
            os: std::env::consts::OS.to_string(),
            tags: Default::default(),
            gpu: None,
        };
        let enrolled = enroll(&transport, &token, &key, capabilities)?;
        std::fs::write(&enrollment_path, serde_json::to_vec(&enrolled)?)?;
    }
    let enrolled: EnrollResponse = serde_json::from_slice(&std::fs::read(&enrollment_path)?)?;
    let key = load_device_key(&key_path)?;
    Ok(DeviceClient::new(
        transport,
        enrolled.device_id,
        key,
        &enrolled.server_public_key,
    )?)
}
