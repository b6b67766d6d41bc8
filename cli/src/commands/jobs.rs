//! `canopy job create|ls|show|start|pause|resume|cancel`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Args;
use serde_json::{Map, Value, json};

use crate::commands::models::{find_version, latest_version, print_or_empty};
use crate::files::Hint;
use crate::output::{errln, outln};
use crate::remote::table::{Table, clean, escape};
use crate::remote::{self, Remote, Subject, ago, cell, print_json};

/// A spec file is a page of settings.
pub const MAX_SPEC_BYTES: u64 = 1 << 20;

/// Settings a job takes when neither the spec file nor a flag gives them.
const DEFAULTS: &[(&str, i64)] = &[
    ("rounds", 10),
    ("min_devices", 1),
    ("local_epochs", 1),
    ("batch_size", 32),
    ("round_deadline_ms", 60_000),
];
const DEFAULT_LEARNING_RATE: f64 = 0.05;

#[derive(Args)]
pub struct CreateArgs {
    /// A job spec (TOML or JSON, the API's JobSpec shape); flags override
    /// its settings.
    #[arg(long)]
    spec: Option<PathBuf>,
    /// The job's name (default: the model's name).
    #[arg(long)]
    name: Option<String>,
    /// Start from model NAME: NAME@VERSION pins a version (its number in
    /// `canopy model versions NAME`); NAME alone takes the newest, which
    /// may be another job's result.
    #[arg(long, value_name = "NAME[@VERSION]", conflicts_with = "version")]
    model: Option<String>,
    /// Start from this model version id (the ID column of `canopy model
    /// versions NAME`).
    #[arg(long)]
    version: Option<i64>,
    /// Successful rounds to run (default 10).
    #[arg(long)]
    rounds: Option<u32>,
    /// Fewest updates that make a round succeed (default 1).
    #[arg(long)]
    min_devices: Option<u32>,
    /// Updates at which a round closes early (default: --min-devices).
    #[arg(long)]
    target_devices: Option<u32>,
    /// Local epochs per round (default 1).
    #[arg(long)]
    epochs: Option<u32>,
    /// Local batch size (default 32).
    #[arg(long)]
    batch_size: Option<u32>,
    /// Devices' learning rate (default 0.05).
    #[arg(long)]
    lr: Option<f64>,
    /// Server optimizer (default fedavg): one of the names the server's
    /// OpenAPI document lists as `StrategyName`, which a refusal also names.
    #[arg(long)]
    strategy: Option<String>,
    /// How long devices have to upload, per round (default 60000).
    #[arg(long)]
    round_deadline_ms: Option<u64>,
    /// The dataset devices train on, by the name they registered it under.
    #[arg(long)]
    dataset: Option<String>,
    /// A dataset on the server to evaluate each version on.
    #[arg(long)]
    central_dataset: Option<String>,
    /// Fraction of the eligible devices that evaluate each version (0 to 1).
    #[arg(long)]
    eval_fraction: Option<f64>,
    /// Fail the job when a round has waited this long for enough eligible
    /// devices (default: wait, saying why, until they come).
    #[arg(long)]
    max_wait_for_devices_ms: Option<u64>,
    /// Secure aggregation (SecAgg+): the server learns only each round's sum.
    #[arg(long)]
    secure: bool,
    #[command(flatten)]
    privacy: super::privacy::JobPrivacyArgs,
    #[command(flatten)]
    robust: super::robust::JobRobustArgs,
    #[command(flatten)]
    compression: super::compression::JobCompressionArgs,
    /// Run the job through edge aggregators (docs/edge.md): rounds select
    /// aggregators, counted by --min-devices and --target-devices, and each
    /// runs a sub-round that needs at least this many of its end devices.
    #[arg(long)]
    edge_min_devices: Option<u32>,
    /// End devices at which a sub-round closes early (default:
    /// --edge-min-devices).
    #[arg(long, requires = "edge_min_devices")]
    edge_target_devices: Option<u32>,
    /// How long a sub-round runs (default: nine tenths of the round's
    /// deadline, leaving the rest for its result to reach the server).
    #[arg(long, requires = "edge_min_devices")]
    edge_deadline_ms: Option<u64>,
    /// Versions each aggregator makes from its own devices' updates before
    /// it sends its result (docs/edge.md, "Edges that make versions of
    /// their own"; default 1, a plain sub-round).
    #[arg(long, requires = "edge_min_devices")]
    edge_rounds: Option<u32>,
    /// Each aggregator buffers for its devices (FedBuff one tier down), this
    /// many training at once; every --edge-target-devices updates make
    /// one of its versions.
    #[arg(long, requires = "edge_min_devices")]
    edge_concurrency: Option<u32>,
    /// Start the job once it is created.
    #[arg(long)]
    start: bool,
    /// Print the job as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct ListArgs {
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct JobIdArgs {
    /// The job's id (`canopy job ls`).
    pub id: i64,
    #[arg(long)]
    pub json: bool,
}

/// What `--model` names: a model, and one of its versions or its newest.
#[derive(Debug, PartialEq)]
struct ModelChoice {
    name: String,
    version: Option<i64>,
}

impl ModelChoice {
    fn parse(text: &str) -> Result<ModelChoice> {
        let Some((name, version)) = text.split_once('@') else {
            return Ok(ModelChoice {
                name: text.to_string(),
                version: None,
            });
        };
        let number = version.parse::<i64>().ok().filter(|n| *n >= 1);
        let Some(number) = number else {
            return Err(Hint::attach(
                anyhow::anyhow!("`--model {text}` names version `{version}`, not a number from 1"),
                format!(
                    "give --model {name}@VERSION with a VERSION of `canopy model versions {name}`"
                ),
            ));
        };
        Ok(ModelChoice {
            name: name.to_string(),
            version: Some(number),
        })
    }

    /// The version it names, as the server describes it.
    async fn resolve(&self, remote: &Remote) -> Result<Value> {
        match self.version {
            Some(version) => find_version(remote, &self.name, version).await,
            None => latest_version(remote, &self.name).await,
        }
    }
}

pub fn create(args: CreateArgs) -> Result<()> {
    let mut spec = match &args.spec {
        Some(path) => read_spec(path)?,
        None => Map::new(),
    };
    let choice = args.model.as_deref().map(ModelChoice::parse).transpose()?;
    let remote = Remote::from_saved()?;
    remote::block_on(async {
        if let Some(choice) = &choice {
            let version = choice.resolve(&remote).await?;
            spec.insert("model_version_id".into(), version["id"].clone());
        } else if let Some(id) = args.version {
            spec.insert("model_version_id".into(), json!(id));
        }
        let model_name = choice.as_ref().map(|choice| choice.name.as_str());
        apply_flags(&mut spec, &args, model_name)?;
        let subject = Subject::new("the job", None).missing(
            format!("model version id {}", cell(&spec["model_version_id"], 0)),
            &format!("canopy model versions {}", model_name.unwrap_or("NAME")),
        );
        let created = remote
            .post("/api/v1/jobs", Value::Object(spec), &subject)
            .await?;
        let id = created["id"]
            .as_i64()
            .context("the server's job has no id")?;
        let mut started = None;
        if args.start {
            let path = format!("/api/v1/jobs/{id}/start");
            started = Some(remote.post(&path, json!({}), &Subject::job(id)).await?);
        }
        print_warnings(&created);
        if args.json {
            return print_json(&created_view(created, started));
        }
        report_created(&created, args.start, choice.as_ref())
    })
}

/// The creation's answer, with the job as starting it left it.
fn created_view(mut created: Value, started: Option<Value>) -> Value {
    if let (Some(created), Some(Value::Object(started))) = (created.as_object_mut(), started) {
        created.extend(started);
    }
    created
}

/// The server's warnings about a job it created (why no round could start
/// with the devices enrolled now), on stderr, each with its hint.
fn print_warnings(created: &Value) {
    for warning in created["warnings"].as_array().into_iter().flatten() {
        errln!("warning: {}", escape(&cell(&warning["message"], 0)));
        errln!("  hint: {}", escape(&cell(&warning["hint"], 0)));
    }
}

/// What `job create` prints: the job and the version it starts from.
fn report_created(created: &Value, started: bool, choice: Option<&ModelChoice>) -> Result<()> {
    let id = cell(&created["id"], 0);
    let version = &created["start_version"];
    outln!(
        "created job {id} `{}` from model `{}` version {} (version id {}){}",
        clean(&cell(&created["name"], 0)),
        clean(&cell(&version["model"], 0)),
        cell(&version["version"], 0),
        cell(&created["model_version_id"], 0),
        if started { ", started" } else { "" }
    )?;
    // Taken as the newest, a version another job produced is worth a word.
    if choice.is_some_and(|choice| choice.version.is_none())
        && !version["produced_by_job"].is_null()
    {
        let name = clean(&cell(&version["model"], 0));
        let round = match version["produced_by_round_number"].as_i64() {
            Some(number) => format!(" in its round {number}"),
            None => String::new(),
        };
        outln!(
            "note: that is the newest version, produced by job {}{round}, not a pushed file; \
             pin another with --model {name}@VERSION (`canopy model versions {name}`)",
            cell(&version["produced_by_job"], 0),
        )?;
    }
    if started {
        outln!("watch it with `canopy job watch {id}`")?;
    } else {
        outln!("start it with `canopy job start {id}`")?;
    }
    Ok(())
}

/// A spec file as a JSON object: TOML for `.toml`, JSON otherwise.
fn read_spec(path: &Path) -> Result<Map<String, Value>> {
    let bytes = crate::files::read_bounded(path, MAX_SPEC_BYTES)
        .with_context(|| format!("cannot read the job spec `{}`", path.display()))?;
    let text = String::from_utf8(bytes)
        .with_context(|| format!("the job spec `{}` is not UTF-8 text", path.display()))?;
    let value: Value = if path.extension().is_some_and(|e| e == "toml") {
        let table: toml::Table = toml::from_str(&text)
            .with_context(|| format!("the job spec `{}` is not valid TOML", path.display()))?;
        serde_json::to_value(table)?
    } else {
        serde_json::from_str(&text).with_context(|| {
            format!(
                "the job spec `{}` is not valid JSON (name a TOML file `.toml`)",
                path.display()
            )
        })?
    };
    match value {
        Value::Object(map) => Ok(map),
        _ => bail!(
            "the job spec `{}` must be an object of settings",
            path.display()
        ),
    }
}

/// Writes the flags given into `spec`, then the defaults of settings
/// still missing. The server checks every bound; its errors name the field.
fn apply_flags(
    spec: &mut Map<String, Value>,
    args: &CreateArgs,
    model_name: Option<&str>,
) -> Result<()> {
    let mut set = |field: &str, value: Option<Value>| {
        if let Some(value) = value {
            spec.insert(field.to_string(), value);
        }
    };
    set("name", args.name.clone().map(Value::from));
    set("rounds", args.rounds.map(Value::from));
    set("min_devices", args.min_devices.map(Value::from));
    set("target_devices", args.target_devices.map(Value::from));
    set("local_epochs", args.epochs.map(Value::from));
    set("batch_size", args.batch_size.map(Value::from));
    set("learning_rate", args.lr.map(Value::from));
    set("round_deadline_ms", args.round_deadline_ms.map(Value::from));
    set("dataset", args.dataset.clone().map(Value::from));
    set(
        "max_wait_for_devices_ms",
        args.max_wait_for_devices_ms.map(Value::from),
    );
    if let Some(strategy) = &args.strategy {
        nested(spec, "strategy").insert("name".into(), json!(strategy));
    }
    if let Some(fraction) = args.eval_fraction {
        nested(spec, "evaluation").insert("fraction".into(), json!(fraction));
    }
    if let Some(dataset) = &args.central_dataset {
        nested(spec, "evaluation").insert("central_dataset".into(), json!(dataset));
    }
    if args.secure {
        nested(spec, "secure_aggregation").insert("enabled".into(), json!(true));
    }
    let privacy = args.privacy.fields();
    if !privacy.is_empty() {
        nested(spec, "differential_privacy").extend(privacy);
    }
    if let Some(robust) = args.robust.fields() {
        nested(spec, "robust_aggregation").extend(robust);
    }
    if let Some(compression) = args.compression.fields() {
        nested(spec, "update_compression").extend(compression);
    }
    if let Some(min) = args.edge_min_devices {
        let edges = nested(spec, "edges");
        edges.insert("min_devices".into(), json!(min));
        edges.insert(
            "target_devices".into(),
            json!(args.edge_target_devices.unwrap_or(min)),
        );
        if let Some(deadline_ms) = args.edge_deadline_ms {
            edges.insert("deadline_ms".into(), json!(deadline_ms));
        }
        if let Some(rounds) = args.edge_rounds {
            edges.insert("rounds".into(), json!(rounds));
        }
        if let Some(concurrency) = args.edge_concurrency {
            edges.insert("asynchronous".into(), json!({"concurrency": concurrency}));
        }
    }
    if !spec.contains_key("model_version_id") {
        return Err(Hint::attach(
            anyhow::anyhow!("the job names no model to start from"),
            "give --model NAME@VERSION (or NAME, its newest version) or --version ID \
             (`canopy model versions NAME`)",
        ));
    }
    if !spec.contains_key("name") {
        spec.insert("name".into(), json!(model_name.unwrap_or("job")));
    }
    for (field, default) in DEFAULTS {
        spec.entry(*field).or_insert(json!(default));
    }
    spec.entry("learning_rate")
        .or_insert(json!(DEFAULT_LEARNING_RATE));
    let min_devices = spec["min_devices"].clone();
    spec.entry("target_devices").or_insert(min_devices);
    Ok(())
}

/// The object under `field`, created empty when missing or not an object.
fn nested<'a>(spec: &'a mut Map<String, Value>, field: &str) -> &'a mut Map<String, Value> {
    let entry = spec
        .entry(field)
        .or_insert_with(|| Value::Object(Map::new()));
    if !entry.is_object() {
        *entry = Value::Object(Map::new());
    }
    entry.as_object_mut().expect("made an object above")
}

pub fn list(args: ListArgs) -> Result<()> {
    let remote = Remote::from_saved()?;
    let jobs = remote::block_on(async {
        remote
            .list_all("/api/v1/jobs", &Subject::new("jobs", None))
            .await
    })?;
    if args.json {
        return print_json(&jobs);
    }
    // The status is last and whole: its cause comes at its end.
    let mut table = Table::new(&[
        "ID", "NAME", "STATE", "ROUNDS", "VERSION", "UPDATED", "STATUS",
    ])
    .with_whole_last_column();
    for job in &jobs {
        table.row(vec![
            cell(&job["id"], 0),
            cell(&job["name"], 0),
            cell(&job["state"], 0),
            format!(
                "{}/{}",
                cell(&job["rounds_completed"], 0),
                cell(&job["spec"]["rounds"], 0)
            ),
            cell(&job["current_version_id"], 0),
            ago(job["updated_ms"].as_i64()),
            cell(&job["status_message"], 0),
        ]);
    }
    print_or_empty(&table, "no jobs yet; create one with `canopy job create`")
}

pub fn show(args: JobIdArgs) -> Result<()> {
    let remote = Remote::from_saved()?;
    let job = remote::block_on(async {
        remote
            .get(&format!("/api/v1/jobs/{}", args.id), &Subject::job(args.id))
            .await
    })?;
    if args.json {
        return print_json(&job);
    }
    let spec = &job["spec"];
    let lines = [
        (
            "job",
            format!("{} `{}`", cell(&job["id"], 0), cell(&job["name"], 0)),
        ),
        ("state", cell(&job["state"], 0)),
        ("status", cell(&job["status_message"], 0)),
        (
            "rounds",
            format!(
                "{} of {} completed ({} failed attempts of the current one)",
                cell(&job["rounds_completed"], 0),
                cell(&spec["rounds"], 0),
                cell(&job["round_failures"], 0)
            ),
        ),
        (
            "model",
            format!(
                "started from version id {}, now version id {}",
                cell(&job["model_version_id"], 0),
                cell(&job["current_version_id"], 0)
            ),
        ),
        (
            "devices",
            format!(
                "{} to {} per round",
                cell(&spec["min_devices"], 0),
                cell(&spec["target_devices"], 0)
            ),
        ),
        (
            "training",
            format!(
                "{} epochs, batch {}, learning rate {}",
                cell(&spec["local_epochs"], 0),
                cell(&spec["batch_size"], 0),
                cell(&spec["learning_rate"], 4)
            ),
        ),
        ("strategy", cell(&spec["strategy"]["name"], 0)),
        ("dataset", cell(&spec["dataset"], 0)),
        ("created", ago(job["created_ms"].as_i64())),
        ("started", ago(job["started_ms"].as_i64())),
        ("finished", ago(job["finished_ms"].as_i64())),
    ];
    for (label, value) in lines {
        // The status is a reason, whole; the others are short.
        let shown = match label {
            "status" => escape(&value),
            _ => clean(&value),
        };
        outln!("{label:>9}: {shown}")?;
    }
    Ok(())
}

/// The operator actions on a job, by the path the API gives them.
#[derive(Clone, Copy, Debug)]
pub enum JobAction {
    Start,
    Pause,
    Resume,
    Cancel,
}

impl JobAction {
    fn verb(self) -> &'static str {
        match self {
            JobAction::Start => "start",
            JobAction::Pause => "pause",
            JobAction::Resume => "resume",
            JobAction::Cancel => "cancel",
        }
    }
}

pub fn act(args: JobIdArgs, action: JobAction) -> Result<()> {
    let remote = Remote::from_saved()?;
    let id = args.id;
    let job = remote::block_on(async {
        remote
            .post(
                &format!("/api/v1/jobs/{id}/{}", action.verb()),
                json!({}),
                &Subject::job(id),
            )
            .await
    })?;
    if args.json {
        return print_json(&job);
    }
    outln!("job {id} is now {}", cell(&job["state"], 0))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Harness {
        #[command(flatten)]
        args: CreateArgs,
    }

    fn args(flags: &[&str]) -> CreateArgs {
        Harness::parse_from(std::iter::once("create").chain(flags.iter().copied())).args
    }

    #[test]
    fn flags_override_the_spec_and_defaults_fill_the_rest() {
        let mut spec: Map<String, Value> = serde_json::from_value(json!({
            "model_version_id": 4, "rounds": 3, "learning_rate": 0.5,
            "strategy": {"name": "fedavg", "momentum": 0.9},
        }))
        .unwrap();
        let flags = args(&[
            "--rounds",
            "7",
            "--strategy",
            "fedavgm",
            "--secure",
            "--eval-fraction",
            "0.5",
            "--central-dataset",
            "digits-test",
            "--epochs",
            "2",
        ]);
        apply_flags(&mut spec, &flags, Some("digits")).unwrap();
        assert_eq!(
            Value::Object(spec),
            json!({
                "model_version_id": 4, "name": "digits", "rounds": 7, "learning_rate": 0.5,
                "strategy": {"name": "fedavgm", "momentum": 0.9},
                "secure_aggregation": {"enabled": true},
                "evaluation": {"fraction": 0.5, "central_dataset": "digits-test"},
                "min_devices": 1, "target_devices": 1, "local_epochs": 2, "batch_size": 32,
                "round_deadline_ms": 60000,
            })
        );
    }

    #[test]
    fn edge_flags_make_a_tiered_job() {
        let mut spec: Map<String, Value> =
            serde_json::from_value(json!({"model_version_id": 4})).unwrap();
        let flags = args(&["--min-devices", "2", "--edge-min-devices", "5"]);
        apply_flags(&mut spec, &flags, None).unwrap();
        assert_eq!(
            spec["edges"],
            json!({"min_devices": 5, "target_devices": 5})
        );
        let mut spec: Map<String, Value> =
            serde_json::from_value(json!({"model_version_id": 4})).unwrap();
        let flags = args(&[
            "--edge-min-devices",
            "5",
            "--edge-target-devices",
            "8",
            "--edge-deadline-ms",
            "30000",
        ]);
        apply_flags(&mut spec, &flags, None).unwrap();
        assert_eq!(
            spec["edges"],
            json!({"min_devices": 5, "target_devices": 8, "deadline_ms": 30000})
        );
        let mut spec: Map<String, Value> =
            serde_json::from_value(json!({"model_version_id": 4})).unwrap();
        let flags = args(&[
            "--edge-min-devices",
            "5",
            "--edge-rounds",
            "4",
            "--edge-concurrency",
            "20",
        ]);
        apply_flags(&mut spec, &flags, None).unwrap();
        assert_eq!(
            spec["edges"],
            json!({"min_devices": 5, "target_devices": 5, "rounds": 4,
                   "asynchronous": {"concurrency": 20}})
        );
        let mut spec = Map::new();
        spec.insert("model_version_id".into(), json!(4));
        apply_flags(&mut spec, &args(&[]), None).unwrap();
        assert!(!spec.contains_key("edges"), "{spec:?}");
    }

    #[test]
    fn dp_flags_make_a_private_job() {
        let mut spec: Map<String, Value> =
            serde_json::from_value(json!({"model_version_id": 4})).unwrap();
        let flags = args(&[
            "--dp-noise-multiplier",
            "1.1",
            "--dp-clip-norm",
            "0.5",
            "--dp-delta",
            "1e-6",
            "--dp-budget-epsilon",
            "3",
        ]);
        apply_flags(&mut spec, &flags, None).unwrap();
        assert_eq!(
            spec["differential_privacy"],
            json!({"noise_multiplier": 1.1, "clip_norm": 0.5, "delta": 1e-6, "budget_epsilon": 3.0})
        );
        // A noise multiplier alone is not a plan: clap asks for the rest.
        let lonely = Harness::try_parse_from(["create", "--dp-noise-multiplier", "1"]);
        let error = lonely
            .err()
            .map(|error| error.to_string())
            .unwrap_or_default();
        assert!(error.contains("--dp-clip-norm"), "{error}");
        let mut spec = Map::new();
        spec.insert("model_version_id".into(), json!(4));
        apply_flags(&mut spec, &args(&[]), None).unwrap();
        assert!(!spec.contains_key("differential_privacy"), "{spec:?}");
        // Adaptive clipping: the quantile alone takes the default; a rate
        // comes with it.
        for (extra, adaptive) in [
            (
                vec!["--dp-adaptive-clip-quantile"],
                json!({"target_quantile": 0.5}),
            ),
            (
                vec![
                    "--dp-adaptive-clip-quantile",
                    "0.7",
                    "--dp-adaptive-clip-rate",
                    "0.1",
                ],
                json!({"target_quantile": 0.7, "learning_rate": 0.1}),
            ),
            (
                vec![
                    "--dp-adaptive-clip-quantile",
                    "--dp-adaptive-clip-count-noise",
                    "2",
                ],
                json!({"target_quantile": 0.5, "count_noise_stddev": 2.0}),
            ),
        ] {
            let mut spec = with_version();
            let mut all = vec!["--dp-noise-multiplier", "1", "--dp-clip-norm", "1"];
            all.extend(["--dp-delta", "1e-6"]);
            all.extend(extra);
            apply_flags(&mut spec, &args(&all), None).unwrap();
            assert_eq!(spec["differential_privacy"]["adaptive_clipping"], adaptive);
        }
    }

    #[test]
    fn robust_flags_make_a_robust_job() {
        let mut spec = with_version();
        let flags = args(&[
            "--robust",
            "multi_krum",
            "--byzantine",
            "3",
            "--krum-selected",
            "5",
        ]);
        apply_flags(&mut spec, &flags, None).unwrap();
        assert_eq!(
            spec["robust_aggregation"],
            json!({"rule": "multi_krum", "byzantine": 3, "selected": 5})
        );
        let mut spec = with_version();
        let flags = args(&["--robust", "trimmed_mean", "--trim-fraction", "0.2"]);
        apply_flags(&mut spec, &flags, None).unwrap();
        assert_eq!(
            spec["robust_aggregation"],
            json!({"rule": "trimmed_mean", "trim_fraction": 0.2})
        );
        // A rule's setting without a rule is a mistake clap names.
        let lonely = Harness::try_parse_from(["create", "--byzantine", "1"]);
        let error = lonely.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(error.contains("--robust"), "{error}");
        let mut spec = with_version();
        apply_flags(&mut spec, &args(&[]), None).unwrap();
        assert!(!spec.contains_key("robust_aggregation"), "{spec:?}");
        let mut spec = with_version();
        let flags = args(&["--compress", "int8", "--int8-min-elements", "1000"]);
        apply_flags(&mut spec, &flags, None).unwrap();
        assert_eq!(
            spec["update_compression"],
            json!({"scheme": "int8", "min_elements": 1000})
        );
    }

    fn with_version() -> Map<String, Value> {
        serde_json::from_value(json!({"model_version_id": 4})).unwrap()
    }

    #[test]
    fn model_at_version_pins_a_version_and_a_bad_one_is_named() {
        let choice = |name: &str, version| ModelChoice {
            name: name.to_string(),
            version,
        };
        assert_eq!(
            ModelChoice::parse("digits").unwrap(),
            choice("digits", None)
        );
        assert_eq!(
            ModelChoice::parse("digits@3").unwrap(),
            choice("digits", Some(3))
        );
        for bad in ["digits@", "digits@0", "digits@x", "digits@-1", "digits@1@2"] {
            let text = format!("{:#}", ModelChoice::parse(bad).unwrap_err());
            assert!(text.contains("not a number from 1"), "{bad}: {text}");
            assert!(
                text.contains("canopy model versions digits"),
                "{bad}: {text}"
            );
        }
    }

    #[test]
    fn the_wait_limit_is_a_spec_setting() {
        let mut spec: Map<String, Value> =
            serde_json::from_value(json!({"model_version_id": 4})).unwrap();
        apply_flags(
            &mut spec,
            &args(&["--max-wait-for-devices-ms", "5000"]),
            None,
        )
        .unwrap();
        assert_eq!(spec["max_wait_for_devices_ms"], 5000);
    }

    #[test]
    fn a_job_without_a_model_is_refused_before_anything_is_sent() {
        let mut spec = Map::new();
        let error = apply_flags(&mut spec, &args(&["--rounds", "2"]), None).unwrap_err();
        let text = format!("{error:#}");
        assert!(text.contains("names no model"), "{text}");
        assert!(text.contains("--model NAME"), "{text}");
    }

    #[test]
    fn spec_files_are_toml_or_json_objects_and_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let toml_path = dir.path().join("job.toml");
        std::fs::write(
            &toml_path,
            "name = \"x\"\nmodel_version_id = 2\n[strategy]\nname = \"fedadam\"\n",
        )
        .unwrap();
        let spec = read_spec(&toml_path).unwrap();
        assert_eq!(spec["strategy"]["name"], "fedadam");
        assert_eq!(spec["model_version_id"], 2);

        let json_path = dir.path().join("job.json");
        std::fs::write(&json_path, "[1, 2]").unwrap();
        assert!(format!("{:#}", read_spec(&json_path).unwrap_err()).contains("object"));

        std::fs::write(&json_path, vec![b' '; MAX_SPEC_BYTES as usize + 1]).unwrap();
        assert!(format!("{:#}", read_spec(&json_path).unwrap_err()).contains("over the limit"));
    }
}
