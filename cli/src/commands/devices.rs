//! `canopy device ls`: the enrolled devices and what they report.

use anyhow::Result;
use canopy_protocol::messages::DeviceRole;
use clap::Args;
use serde_json::Value;

use crate::commands::models::print_or_empty;
use crate::remote::table::Table;
use crate::remote::{self, Remote, Subject, ago, cell, print_json};

#[derive(Args)]
pub struct ListArgs {
    #[arg(long)]
    json: bool,
}

pub fn list(args: ListArgs) -> Result<()> {
    let remote = Remote::from_saved()?;
    let devices = remote::block_on(async {
        remote
            .list_all("/api/v1/devices", &Subject::new("devices", None))
            .await
    })?;
    if args.json {
        return print_json(&devices);
    }
    let mut table = Table::new(&[
        "ID",
        "ROLE",
        "ONLINE",
        "LAST SEEN",
        "BACKENDS",
        "DATASETS",
        "LAST ERROR",
        "TAGS",
    ]);
    for device in &devices {
        table.row(vec![
            cell(&device["id"], 0),
            cell(&device["role"], 0),
            online(device),
            ago(device["last_seen_ms"].as_i64()),
            backends(device),
            datasets(&device["datasets"]),
            cell(&device["last_error"], 0),
            tags(&device["tags"]),
        ]);
    }
    print_or_empty(
        &table,
        "no devices enrolled yet; enroll one with `canopy-agent enroll`",
    )
}

fn online(device: &Value) -> String {
    if device["revoked"] == Value::Bool(true) {
        "revoked".into()
    } else if device["online"] == Value::Bool(true) {
        "yes".into()
    } else {
        "no".into()
    }
}

/// `cpu, gpu (NVIDIA H100 80GB HBM3, vulkan, discrete)`: the backends,
/// with the adapter behind `gpu` where the device reported one.
fn backends(device: &Value) -> String {
    let names: Vec<String> = device["backends"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|name| cell(name, 0))
        .collect();
    let gpu = &device["gpu"];
    let adapter = if gpu.is_object() {
        format!(
            " ({}, {}, {})",
            cell(&gpu["name"], 0),
            cell(&gpu["api"], 0),
            cell(&gpu["device_type"], 0)
        )
    } else {
        String::new()
    };
    if names.is_empty() {
        "-".into()
    } else {
        names.join(", ") + &adapter
    }
}

/// `digits (1617)`: each dataset's name and samples.
fn datasets(list: &Value) -> String {
    let names: Vec<String> = list
        .as_array()
        .into_iter()
        .flatten()
        .map(|d| format!("{} ({})", cell(&d["name"], 0), cell(&d["samples"], 0)))
        .collect();
    if names.is_empty() {
        "-".into()
    } else {
        names.join(", ")
    }
}

/// `site=lab-3,tier=edge`.
fn tags(map: &Value) -> String {
    let pairs: Vec<String> = map
        .as_object()
        .into_iter()
        .flatten()
        .map(|(key, value)| format!("{key}={}", cell(value, 0)))
        .collect();
    if pairs.is_empty() {
        "-".into()
    } else {
        pairs.join(",")
    }
}

#[derive(Args)]
pub struct EnrollTokenArgs {
    /// Devices that may enroll with it.
    #[arg(long, default_value_t = 1)]
    max_uses: u32,
    /// How long it is valid, e.g. 1h or 7d.
    #[arg(long, default_value = "1d")]
    expires: String,
    /// A note to tell tokens apart.
    #[arg(long, default_value = "")]
    label: String,
    /// The role of the devices it enrolls: `device`, which trains on its
    /// own data, or `aggregator`, an edge node.
    #[arg(long, default_value_t = DeviceRole::Device, value_parser = parse_role)]
    role: DeviceRole,
}

fn parse_role(text: &str) -> Result<DeviceRole, String> {
    text.parse()
}

/// Issues an enrollment token and prints only its secret, so that a shell
/// can keep it: `TOKEN=$(canopy device enroll-token --max-uses 3)`.
pub fn enroll_token(args: EnrollTokenArgs) -> Result<()> {
    let remote = Remote::from_saved()?;
    let created = remote::block_on(async {
        remote
            .post(
                "/api/v1/enrollment-tokens",
                serde_json::json!({
                    "max_uses": args.max_uses, "expires_in": args.expires, "label": args.label,
                    "role": args.role,
                }),
                &Subject::new("the enrollment token", None),
            )
            .await
    })?;
    let secret = created["secret"]
        .as_str()
        .ok_or_else(|| anyhow::anyhow!("the server's answer has no enrollment secret"))?;
    crate::output::outln!("{secret}")?;
    Ok(())
}
