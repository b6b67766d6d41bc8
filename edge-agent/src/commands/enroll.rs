//! `enroll`: a new device key, enrollment with a one-time token, and the
//! enrollment written to the data directory only once the server accepted.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use canopy_engine::select::BackendChoice;
use canopy_protocol::auth::DeviceKey;
use canopy_protocol::messages::{Capabilities, DeviceRole, MAX_MEMORY_MB, MAX_TAGS, Tier};
use clap::Args;

use crate::backend::{AgentBackend, OrtArgs};
use crate::config::{AgentConfig, MAX_URL_CHARS, TrustConfig, store_key};
use crate::files::{DataDir, absolute, hinted, now_ms};
use crate::output::outln;

fn parse_role(text: &str) -> Result<DeviceRole, String> {
    text.parse()
}

/// Longest enrollment token accepted.
const MAX_TOKEN_CHARS: usize = 1024;

#[derive(Args)]
pub struct EnrollArgs {
    /// The server's base URL, e.g. https://canopy.example.com:8443.
    #[arg(long)]
    server: String,
    /// One-time enrollment token (`canopy-server` admin API); may come
    /// from the environment so it stays out of the process list.
    #[arg(long, env = "CANOPY_ENROLL_TOKEN", hide_env_values = true)]
    token: String,
    /// Trust server certificates signed by the CAs in this PEM file.
    /// Without this or --fingerprint, an https server must have a
    /// certificate from a public CA.
    #[arg(long, conflicts_with = "fingerprint")]
    ca_cert: Option<PathBuf>,
    /// Trust exactly the server certificate with this SHA-256
    /// (`sha256:HEX`, as `canopy-server serve` prints it).
    #[arg(long)]
    fingerprint: Option<String>,
    /// A label jobs can select devices by, `key=value` (repeatable, at
    /// most 32).
    #[arg(long = "tag", value_name = "KEY=VALUE")]
    tags: Vec<String>,
    /// Pin this device authority (hex Ed25519 public key): in secure
    /// rounds, take a neighbour's key only with its certificate. Install
    /// this device's own with `canopy-agent certify`.
    #[arg(long)]
    device_authority: Option<String>,
    /// Replace an existing enrollment (and its device key).
    #[arg(long)]
    force: bool,
    /// `device` (the default) trains on this machine's data; `aggregator`
    /// makes it an edge node that serves its own end devices and runs the
    /// cloud's rounds over them (`canopy-agent aggregate`). The token must
    /// be of the same role (`canopy device enroll-token --role`).
    #[arg(long, default_value_t = DeviceRole::Device, value_parser = parse_role)]
    role: DeviceRole,
    /// The backends to offer jobs: cpu; gpu (the CPU and any Vulkan,
    /// Metal or DX12 adapter); auto (the CPU, and a hardware GPU when there
    /// is one); npu (the CPU, and ONNX Runtime for frozen backbones; an
    /// error when it does not open). A job's device filter can ask for
    /// `gpu` or `npu`.
    #[arg(long, default_value_t = AgentBackend::default())]
    backend: AgentBackend,
    #[command(flatten)]
    ort: OrtArgs,
}

/// The backend names to report for `choice`: always `cpu`; `gpu` when
/// the engine opens one for it; `npu` when ONNX Runtime opens (else an
/// error, with how to get it).
fn offered_backends(choice: AgentBackend, ort: &OrtArgs) -> Result<Vec<String>> {
    let choice = match choice {
        AgentBackend::Npu => {
            ort.open()
                .context("cannot offer the NPU backend (--backend npu)")?;
            return Ok(vec!["cpu".to_string(), "npu".to_string()]);
        }
        AgentBackend::Engine(choice) => choice,
    };
    let mut backends = vec!["cpu".to_string()];
    if choice != BackendChoice::Cpu {
        match canopy_engine::select::open_backend(choice) {
            Ok(backend) if backend.name() == "gpu" => {
                if let Some(adapter) = backend.describe().adapter {
                    tracing::info!(adapter = %adapter.name, api = %adapter.api, kind = %adapter.device_type, "offering the GPU");
                }
                backends.push("gpu".to_string());
            }
            Ok(_) => {}
            Err(error) => tracing::warn!(%error, "no GPU to offer; the CPU only"),
        }
    }
    Ok(backends)
}

pub fn run(dir: &DataDir, args: EnrollArgs) -> Result<()> {
    if let Some(existing) = existing_enrollment(dir)? {
        if !args.force {
            return Err(hinted(
                format!("`{}` is already enrolled ({existing})", dir.root.display()),
                "pass --force to enroll again; the old device key is replaced and the old device stops working",
            ));
        }
    }
    let server = args.server.trim_end_matches('/').to_string();
    check_server_url(&server)?;
    if args.token.is_empty() || args.token.chars().count() > MAX_TOKEN_CHARS {
        bail!("--token must be 1..={MAX_TOKEN_CHARS} characters");
    }
    let trust = trust_config(&server, &args)?;
    let tags = parse_tags(&args.tags)?;
    let backends = offered_backends(args.backend, &args.ort)?;
    let gpu = if backends.iter().any(|backend| backend == "gpu") {
        canopy_sdk::gpu_adapter()
    } else {
        None
    };
    let capabilities = Capabilities {
        tier: Tier::Edge,
        backends,
        gpu,
        memory_mb: total_memory_mb().unwrap_or(0).min(MAX_MEMORY_MB),
        os: format!("{}-{}", std::env::consts::OS, std::env::consts::ARCH),
        tags: tags.clone(),
    };
    capabilities
        .validate()
        .map_err(|reason| anyhow::anyhow!("the device's capabilities are invalid: {reason}"))?;
    if let Some(authority) = &args.device_authority {
        canopy_protocol::auth::parse_public_key_hex(authority).map_err(|cause| {
            hinted(
                format!("--device-authority is not an Ed25519 public key: {cause}"),
                "give the 64 hex digits `canopy authority new` printed",
            )
        })?;
    }
    // Nothing is written until the server has accepted the key, so a
    // failed enrollment leaves the data directory as it was.
    let key = DeviceKey::generate();
    let transport = canopy_sdk::Transport::new(&server, &trust.to_trust())
        .with_context(|| format!("cannot set up a connection to `{server}`"))?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let response = runtime
        .block_on(canopy_sdk::enroll_as(
            &transport,
            &args.token,
            &key,
            capabilities,
            args.role,
        ))
        .map_err(|error| {
            let hint = match (error.status(), error.connect_problem()) {
                (Some(401 | 403), _) => "the token may be used up, expired or revoked; ask the operator for a new one".to_string(),
                (Some(_), _) => "check the server's logs".to_string(),
                // The server is there, and says what is wrong.
                (None, Some(problem)) => problem.hint(&server),
                (None, None) => "check --server and that the server is running; on a certificate error, pass the fingerprint `canopy-server serve --tls self-signed` prints as --fingerprint, or the server's CA as --ca-cert".to_string(),
            };
            anyhow::Error::new(error).context(crate::files::Hint(hint))
        })
        .with_context(|| format!("enrollment with `{server}` failed; nothing was written"))?;
    canopy_protocol::auth::parse_public_key_hex(&response.server_public_key).map_err(|e| {
        anyhow::anyhow!(
            "the server's public key `{}` is invalid: {e}",
            crate::files::truncate(&response.server_public_key, 80)
        )
    })?;
    if response.device_id <= 0 {
        bail!(
            "the server assigned an invalid device id {}",
            response.device_id
        );
    }
    let config = AgentConfig {
        server: server.clone(),
        device_id: response.device_id,
        server_public_key: response.server_public_key,
        previous_server_key: None,
        previous_server_key_valid_until_ms: None,
        heartbeat_interval_ms: response.heartbeat_interval_ms,
        enrolled_unix_ms: now_ms(),
        trust,
        tags,
        device_authority: args.device_authority,
        role: args.role,
    };
    dir.create()?;
    let key_path = dir.key();
    store_key(&key_path, &key)?;
    if let Err(error) = config.save(dir) {
        // Without agent.toml the key is an orphan: leave no half enrollment.
        let _ = std::fs::remove_file(&key_path);
        return Err(error);
    }
    outln!(
        "enrolled as {} {} with {server}; key {} (mode 600), enrollment {}",
        config.role,
        config.device_id,
        key_path.display(),
        dir.agent().display()
    )?;
    if config.trust == TrustConfig::PlainHttp {
        outln!(
            "warning: plain HTTP; traffic to the server is not encrypted (use https outside a loopback test)"
        )?;
    }
    match config.role {
        DeviceRole::Device => outln!(
            "next: `canopy-agent --data-dir {} data add NAME --kind csv --path FILE`, then `canopy-agent --data-dir {} run`",
            dir.root.display(),
            dir.root.display()
        )?,
        DeviceRole::Aggregator => outln!(
            "next: `canopy-agent --data-dir {} aggregate --listen 0.0.0.0:9443 --tls self-signed`, then enroll end devices with it",
            dir.root.display()
        )?,
    }
    Ok(())
}

/// A short description of an existing enrollment, or of a stray key.
fn existing_enrollment(dir: &DataDir) -> Result<Option<String>> {
    match AgentConfig::load(dir) {
        Ok(Some(config)) => Ok(Some(format!(
            "device {} with {}",
            config.device_id, config.server
        ))),
        Ok(None) if dir.key().exists() => Ok(Some(format!(
            "a device key exists at `{}`",
            dir.key().display()
        ))),
        Ok(None) => Ok(None),
        Err(error) => Ok(Some(format!("an unreadable enrollment: {error:#}"))),
    }
}

fn check_server_url(server: &str) -> Result<()> {
    if server.chars().count() > MAX_URL_CHARS {
        bail!("--server is longer than {MAX_URL_CHARS} characters");
    }
    if !(server.starts_with("https://") || server.starts_with("http://")) {
        return Err(hinted(
            format!(
                "--server `{}` is not an http(s) URL",
                crate::files::truncate(server, 200)
            ),
            "use the URL `canopy-server serve` prints, e.g. https://127.0.0.1:8443",
        ));
    }
    Ok(())
}

fn trust_config(server: &str, args: &EnrollArgs) -> Result<TrustConfig> {
    let trust = match (&args.fingerprint, &args.ca_cert) {
        (Some(sha256), _) => TrustConfig::Fingerprint {
            sha256: sha256.trim().to_string(),
        },
        (None, Some(path)) => {
            let path = absolute(path)?;
            if !path.is_file() {
                bail!("--ca-cert `{}` is not a file", path.display());
            }
            TrustConfig::CaFile { path }
        }
        (None, None) if server.starts_with("http://") => TrustConfig::PlainHttp,
        (None, None) => TrustConfig::SystemRoots,
    };
    // Checks the fingerprint's form or the CA file's content now.
    trust
        .to_trust()
        .client_config()
        .context("the server trust is invalid")?;
    Ok(trust)
}

/// Parses `--tag key=value` flags into the capability map; the protocol's
/// limits on tag keys and values are checked by `Capabilities::validate`.
fn parse_tags(raw: &[String]) -> Result<BTreeMap<String, String>> {
    if raw.len() > MAX_TAGS {
        bail!("{} --tag flags given, the limit is {MAX_TAGS}", raw.len());
    }
    let mut tags = BTreeMap::new();
    for tag in raw {
        let (key, value) = tag.split_once('=').ok_or_else(|| {
            anyhow::anyhow!(
                "--tag `{}` is not KEY=VALUE",
                crate::files::truncate(tag, 80)
            )
        })?;
        if tags.insert(key.to_string(), value.to_string()).is_some() {
            bail!("--tag `{key}` is given twice");
        }
    }
    Ok(tags)
}

/// Total memory from `/proc/meminfo`, where there is one.
fn total_memory_mb() -> Option<u64> {
    let text = crate::files::read_text(std::path::Path::new("/proc/meminfo"), 64 << 10).ok()??;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_parse_and_are_bounded() {
        let tags = parse_tags(&["site=lab".into(), "gpu=".into(), "a=b=c".into()]).unwrap();
        assert_eq!(tags["site"], "lab");
        assert_eq!(tags["gpu"], "");
        assert_eq!(tags["a"], "b=c");
        assert!(parse_tags(&["novalue".into()]).is_err());
        assert!(parse_tags(&["a=1".into(), "a=2".into()]).is_err());
        let many: Vec<String> = (0..33).map(|i| format!("k{i}=v")).collect();
        assert!(
            parse_tags(&many)
                .unwrap_err()
                .to_string()
                .contains("limit is 32")
        );
    }
}
