//! `canopy model push|ls|versions`: models on the server.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use reqwest::Method;
use serde_json::Value;

use crate::files::read_model_bytes;
use crate::output::outln;
use crate::remote::table::Table;
use crate::remote::{self, Payload, Remote, Subject, ago, cell, print_json, short};

#[derive(Args)]
pub struct PushArgs {
    /// The model file (`canopy model new`, `canopy model train`).
    file: PathBuf,
    /// The model to add it to as a new version; created if it does not exist.
    name: String,
    /// Print the stored version as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct ListArgs {
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct VersionsArgs {
    /// The model's name.
    name: String,
    #[arg(long)]
    json: bool,
}

fn model_subject(name: &str) -> Subject {
    Subject::new(format!("model `{name}`"), Some("canopy model ls"))
}

/// Uploads a model file, checked here first so a bad file fails before it
/// travels.
pub fn push(args: PushArgs) -> Result<()> {
    let bytes = read_model_bytes(&args.file)?;
    let remote = Remote::from_saved()?;
    let version = remote::block_on(async {
        remote
            .call(
                Method::POST,
                &format!("/api/v1/models/{}/versions", args.name),
                Payload::Bytes {
                    bytes,
                    content_type: "application/octet-stream",
                },
                &model_subject(&args.name),
            )
            .await
    })?;
    if args.json {
        return print_json(&version);
    }
    outln!(
        "pushed {} as model `{}` version {} (version id {}, digest {}, {} bytes)",
        args.file.display(),
        args.name,
        cell(&version["version"], 0),
        cell(&version["id"], 0),
        cell(&version["digest"], 0),
        cell(&version["size_bytes"], 0),
    )?;
    if version["trainable"] == Value::Bool(false) {
        outln!(
            "note: devices cannot train it: {}",
            cell(&version["untrainable_reason"], 0)
        )?;
    }
    Ok(())
}

pub fn list(args: ListArgs) -> Result<()> {
    let remote = Remote::from_saved()?;
    let models = remote::block_on(async {
        remote
            .list_all("/api/v1/models", &Subject::new("models", None))
            .await
    })?;
    if args.json {
        return print_json(&models);
    }
    let mut table = Table::new(&["NAME", "VERSIONS", "CREATED"]);
    for model in &models {
        table.row(vec![
            cell(&model["name"], 0),
            cell(&model["versions"], 0),
            ago(model["created_ms"].as_i64()),
        ]);
    }
    print_or_empty(
        &table,
        "no models yet; push one with `canopy model push FILE NAME`",
    )
}

pub fn versions(args: VersionsArgs) -> Result<()> {
    let remote = Remote::from_saved()?;
    let versions = remote::block_on(async {
        remote
            .list_all(
                &format!("/api/v1/models/{}/versions", args.name),
                &model_subject(&args.name),
            )
            .await
    })?;
    if args.json {
        return print_json(&versions);
    }
    // PARENT and ROUND are numbers as people count them (version 3 of
    // this model, round 2 of that job); ID is what `--version` takes.
    let mut table = Table::new(&[
        "VERSION",
        "ID",
        "PARENT",
        "JOB",
        "ROUND",
        "TRAINABLE",
        "BYTES",
        "DIGEST",
        "CREATED",
    ]);
    for version in &versions {
        table.row(vec![
            cell(&version["version"], 0),
            cell(&version["id"], 0),
            cell(&version["parent_version"], 0),
            cell(&version["produced_by_job"], 0),
            cell(&version["produced_by_round_number"], 0),
            cell(&version["trainable"], 0),
            cell(&version["size_bytes"], 0),
            short(version["digest"].as_str().unwrap_or("-"), 16).to_string(),
            ago(version["created_ms"].as_i64()),
        ]);
    }
    print_or_empty(
        &table,
        &format!(
            "model `{}` has no versions; push one with `canopy model push FILE {}`",
            args.name, args.name
        ),
    )
}

/// Version `version` (its number, as `canopy model versions` shows it) of
/// model `name`.
pub async fn find_version(remote: &Remote, name: &str, version: i64) -> Result<Value> {
    let subject = Subject::new(
        format!("model `{name}` version {version}"),
        Some(&format!("canopy model versions {name}")),
    );
    remote
        .get(
            &format!("/api/v1/models/{name}/versions/{version}"),
            &subject,
        )
        .await
}

/// The newest version of a model, as the server lists them (oldest first).
pub async fn latest_version(remote: &Remote, name: &str) -> Result<Value> {
    let versions = remote
        .list_all(
            &format!("/api/v1/models/{name}/versions"),
            &model_subject(name),
        )
        .await?;
    versions
        .into_iter()
        .last()
        .with_context(|| format!("model `{name}` has no versions on {}", remote.url()))
        .map_err(|error| {
            crate::files::Hint::attach(
                error,
                format!("push one with `canopy model push FILE {name}`, or see `canopy model ls`"),
            )
        })
}

pub fn print_or_empty(table: &Table, empty: &str) -> Result<()> {
    if table.is_empty() {
        outln!("{empty}")?;
        return Ok(());
    }
    table.print()
}
