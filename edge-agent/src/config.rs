//! The agent's TOML files: `agent.toml` (the enrollment, machine-written
//! by `enroll`), `config.toml` (the operator's `run` settings, written
//! once by `install`), and the device key.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use canopy_protocol::auth::DeviceKey;
use canopy_protocol::messages::DeviceRole;
use canopy_sdk::{Trust, TrustedKeys};
use serde::{Deserialize, Serialize};

use crate::backend::AgentBackend;
use crate::files::{DataDir, Hint, MAX_CONFIG_BYTES, hinted, read_text, write_public};

/// Longest server URL accepted.
pub const MAX_URL_CHARS: usize = 2048;

/// How the agent trusts the server's certificate.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum TrustConfig {
    /// The SHA-256 of the server's certificate (`sha256:HEX`), pinned.
    Fingerprint { sha256: String },
    /// A PEM file of CA certificates, by absolute path.
    CaFile { path: PathBuf },
    /// The public web PKI roots compiled into the SDK, for a server whose
    /// certificate comes from a public CA.
    SystemRoots,
    /// Plain HTTP (loopback development servers only): nothing to trust.
    #[serde(rename = "none")]
    PlainHttp,
}

impl TrustConfig {
    /// The SDK's trust; `None` for plain HTTP, where no TLS happens.
    pub fn to_trust(&self) -> Trust {
        match self {
            TrustConfig::Fingerprint { sha256 } => Trust::PinnedSha256(sha256.clone()),
            TrustConfig::CaFile { path } => Trust::CaFile(path.clone()),
            // The SDK builds a TLS configuration even for `http://` URLs,
            // where it goes unused.
            TrustConfig::SystemRoots | TrustConfig::PlainHttp => Trust::SystemRoots,
        }
    }

    pub fn describe(&self) -> String {
        match self {
            TrustConfig::Fingerprint { sha256 } => format!("pinned certificate {sha256}"),
            TrustConfig::CaFile { path } => format!("CA file {}", path.display()),
            TrustConfig::SystemRoots => "public CA roots".to_string(),
            TrustConfig::PlainHttp => "none (plain HTTP)".to_string(),
        }
    }
}

/// `agent.toml`: who this device is and which server it belongs to.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    pub server: String,
    pub device_id: i64,
    /// Hex Ed25519 key the server signs models with: the one given at
    /// enrollment, until the daemon follows a rotation and rewrites it.
    pub server_public_key: String,
    /// The key `server_public_key` replaced, accepted until
    /// `previous_server_key_valid_until_ms` (Unix ms). Both are absent in
    /// files written before key rotation, and until the first rotation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_server_key: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_server_key_valid_until_ms: Option<u64>,
    /// The interval the server asked for at enrollment; heartbeats adopt
    /// whatever later answers say.
    pub heartbeat_interval_ms: u64,
    pub enrolled_unix_ms: u64,
    pub trust: TrustConfig,
    #[serde(default)]
    pub tags: BTreeMap<String, String>,
    /// Hex Ed25519 public key of the device authority this device pins:
    /// in secure rounds it takes a neighbour's key only with the
    /// authority's certificate. Absent: it takes the server's word.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_authority: Option<String>,
    /// `device`, or `aggregator` for an edge node (`canopy-agent
    /// aggregate`); files written before roles are devices.
    #[serde(default)]
    pub role: DeviceRole,
}

impl AgentConfig {
    /// `Ok(None)` when the data directory holds no enrollment.
    pub fn load(dir: &DataDir) -> Result<Option<AgentConfig>> {
        let path = dir.agent();
        let Some(text) = read_text(&path, MAX_CONFIG_BYTES)? else {
            return Ok(None);
        };
        let config: AgentConfig = toml::from_str(&text)
            .with_context(|| format!("enrollment file `{}` is invalid", path.display()))?;
        config
            .check()
            .with_context(|| format!("enrollment file `{}` is invalid", path.display()))?;
        Ok(Some(config))
    }

    /// Loads the enrollment, failing with a hint when there is none.
    pub fn require(dir: &DataDir) -> Result<AgentConfig> {
        AgentConfig::load(dir)?.ok_or_else(|| {
            hinted(
                format!(
                    "this agent is not enrolled: `{}` does not exist",
                    dir.agent().display()
                ),
                "run `canopy-agent enroll --server URL --token TOKEN --fingerprint SHA256` first (with the same --data-dir)",
            )
        })
    }

    fn check(&self) -> Result<()> {
        if self.server.chars().count() > MAX_URL_CHARS {
            bail!("`server` is longer than {MAX_URL_CHARS} characters");
        }
        if self.device_id <= 0 {
            bail!("`device_id` {} is not a valid id", self.device_id);
        }
        self.trusted_keys()?;
        self.pinned_authority()?;
        if self.tags.len() > canopy_protocol::messages::MAX_TAGS {
            bail!(
                "`tags` has {} entries, the limit is {}",
                self.tags.len(),
                canopy_protocol::messages::MAX_TAGS
            );
        }
        Ok(())
    }

    /// The device authority this device pins, if any.
    pub fn pinned_authority(&self) -> Result<Option<[u8; 32]>> {
        self.device_authority
            .as_deref()
            .map(canopy_protocol::auth::parse_public_key_hex)
            .transpose()
            .context("`device_authority` is not an Ed25519 public key")
    }

    /// The client this enrollment makes with `key`: its server and TLS
    /// trust, the model-signing keys it trusts and the device authority it
    /// pins, so that no command that talks to the server forgets one.
    pub fn device_client(&self, key: DeviceKey) -> Result<canopy_sdk::DeviceClient> {
        let transport = canopy_sdk::Transport::new(&self.server, &self.trust.to_trust())
            .with_context(|| format!("cannot set up a connection to `{}`", self.server))?;
        let client = canopy_sdk::DeviceClient::with_trusted_keys(
            transport,
            self.device_id,
            key,
            self.trusted_keys()?,
        );
        Ok(match self.pinned_authority()? {
            Some(authority) => client.with_device_authority(authority),
            None => client,
        })
    }

    /// The model-signing keys this device trusts.
    pub fn trusted_keys(&self) -> Result<TrustedKeys> {
        TrustedKeys::from_hex(
            &self.server_public_key,
            self.previous_server_key.as_deref(),
            self.previous_server_key_valid_until_ms,
        )
        .context("`server_public_key` or `previous_server_key` is invalid")
    }

    pub fn set_trusted_keys(&mut self, trusted: TrustedKeys) {
        self.server_public_key = trusted.current_hex();
        self.previous_server_key = trusted.previous().map(|p| hex::encode(p.key));
        self.previous_server_key_valid_until_ms = trusted.previous().map(|p| p.valid_until_ms);
    }

    pub fn save(&self, dir: &DataDir) -> Result<()> {
        let path = dir.agent();
        let body = toml::to_string(self).context("cannot serialise the enrollment")?;
        let text = format!(
            "# Written by `canopy-agent enroll` (and by `run` when the server's model-signing key\n# is rotated); `enroll --force` replaces it.\n{body}"
        );
        write_public(&path, text.as_bytes())
            .with_context(|| format!("cannot write enrollment file `{}`", path.display()))
    }
}

/// `config.toml`: defaults for `run`, which its flags override.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    #[serde(default)]
    pub run: RunSettings,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunSettings {
    pub dataset: Option<String>,
    pub max_threads: Option<usize>,
    pub max_memory_mb: Option<u64>,
    pub only_when_idle: Option<bool>,
    pub poll_wait_ms: Option<u64>,
    /// `cpu`, `gpu`, `auto` or `npu`.
    #[serde(default, with = "backend_name")]
    pub backend: Option<AgentBackend>,
    /// The ONNX Runtime shared library for `npu` (`--ort-library`).
    pub ort_library: Option<PathBuf>,
    /// ONNX Runtime execution providers in order of preference
    /// (`--ort-providers`), e.g. `"nnapi,cpu"`.
    pub ort_providers: Option<String>,
}

/// `run.backend` as its name in config.toml.
mod backend_name {
    use crate::backend::AgentBackend;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(value: &Option<AgentBackend>, s: S) -> Result<S::Ok, S::Error> {
        match value {
            Some(choice) => s.serialize_some(choice.as_str()),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<AgentBackend>, D::Error> {
        Option::<String>::deserialize(d)?
            .map(|name| name.parse().map_err(serde::de::Error::custom))
            .transpose()
    }
}

impl FileConfig {
    pub fn load(dir: &DataDir) -> Result<FileConfig> {
        let path = dir.config();
        match read_text(&path, MAX_CONFIG_BYTES)? {
            None => Ok(FileConfig::default()),
            Some(text) => toml::from_str(&text)
                .with_context(|| format!("settings file `{}` is invalid", path.display())),
        }
    }
}

/// The template `install` writes: every setting present, commented out.
pub fn config_template() -> String {
    "# canopy-agent settings. Flags given to `canopy-agent run` override these.\n\
     [run]\n\
     # Registered dataset to train on (`canopy-agent data list`); default: the first added.\n\
     # dataset = \"digits\"\n\
     # Threads for training (rayon's pool); default: one per core.\n\
     # max_threads = 2\n\
     # Refuse tasks whose model file size x 8 exceeds this many MiB.\n\
     # max_memory_mb = 2048\n\
     # Defer polling while the 1-minute load average per core is above 0.5.\n\
     # only_when_idle = false\n\
     # How long one task poll waits at the server, in milliseconds.\n\
     # poll_wait_ms = 25000\n\
     # Engine backend: cpu, gpu (any Vulkan/Metal/DX12 adapter), auto\n\
     # (a hardware GPU when there is one, else the CPU) or npu (frozen\n\
     # backbones in ONNX Runtime: see `canopy-agent run --help`, --ort-library).\n\
     # backend = \"auto\"\n\
     # The ONNX Runtime library for npu; default: ORT_DYLIB_PATH, else the system's.\n\
     # ort_library = \"/opt/onnxruntime/lib/libonnxruntime.so\"\n\
     # Execution providers to try, in order; default: all, as `run --help` lists.\n\
     # ort_providers = \"nnapi,cpu\"\n"
        .to_string()
}

/// Stores the device key in `device.key` through the SDK's key store:
/// 64 hex digits and a newline, in a temporary file created with mode
/// 0600, synced and renamed over the old key, so the key is never
/// readable by others and a crash never leaves a torn key. Written by
/// root into the service user's data directory, it goes to that user.
pub fn store_key(path: &Path, key: &DeviceKey) -> Result<()> {
    canopy_sdk::save_device_key(path, key)
        .with_context(|| format!("cannot write device key `{}`", path.display()))?;
    crate::ownership::adopt_folder_owner_at(path).with_context(|| {
        format!(
            "cannot give device key `{}` to the data directory's owner",
            path.display()
        )
    })
}

/// Reads `device.key`; refuses a key file that group or others can read
/// or write, as OpenSSH does.
pub fn load_key(path: &Path) -> Result<DeviceKey> {
    if !path.exists() {
        return Err(hinted(
            format!("device key `{}` does not exist", path.display()),
            "enroll again with `canopy-agent enroll --force`",
        ));
    }
    canopy_sdk::load_device_key(path).map_err(|error| {
        let hint = match error {
            canopy_sdk::KeyStoreError::Permissions { .. } => format!(
                "run `chmod 600 {}`, or enroll again with `canopy-agent enroll --force` if the key may have leaked",
                path.display()
            ),
            _ => "enroll again with `canopy-agent enroll --force`".to_string(),
        };
        anyhow::Error::new(error)
            .context(Hint(hint))
            .context("cannot load this device's key")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agent_config_round_trips_through_toml() {
        let config = AgentConfig {
            server: "https://127.0.0.1:8443".into(),
            device_id: 7,
            server_public_key: DeviceKey::generate().public_key_hex(),
            previous_server_key: Some(DeviceKey::generate().public_key_hex()),
            previous_server_key_valid_until_ms: Some(1_700_000_000_000),
            heartbeat_interval_ms: 15_000,
            enrolled_unix_ms: 1,
            trust: TrustConfig::Fingerprint {
                sha256: format!("sha256:{}", "cd".repeat(32)),
            },
            tags: BTreeMap::from([("site".to_string(), "lab".to_string())]),
            device_authority: Some(DeviceKey::generate().public_key_hex()),
            role: DeviceRole::Aggregator,
        };
        let text = toml::to_string(&config).unwrap();
        let back: AgentConfig = toml::from_str(&text).unwrap();
        assert_eq!(back, config);
        back.check().unwrap();
        let trusted = back.trusted_keys().unwrap();
        assert_eq!(trusted.current_hex(), config.server_public_key);
        assert_eq!(
            trusted.previous().map(|p| p.valid_until_ms),
            Some(1_700_000_000_000)
        );
    }

    /// `agent.toml` from before key rotation has no previous key: it loads,
    /// trusting its one key; a previous key without its window is refused.
    #[test]
    fn an_enrollment_without_a_previous_key_still_loads() {
        let key = DeviceKey::generate().public_key_hex();
        let old = format!(
            "server = \"https://127.0.0.1:8443\"\ndevice_id = 3\nserver_public_key = \"{key}\"\n\
             heartbeat_interval_ms = 15000\nenrolled_unix_ms = 1\n\
             [trust]\nkind = \"system_roots\"\n"
        );
        let config: AgentConfig = toml::from_str(&old).unwrap();
        config.check().unwrap();
        assert_eq!(config.role, DeviceRole::Device);
        let trusted = config.trusted_keys().unwrap();
        assert_eq!(trusted.current_hex(), key);
        assert!(trusted.previous().is_none());
        let half = AgentConfig {
            previous_server_key: Some(DeviceKey::generate().public_key_hex()),
            ..config
        };
        let error = format!("{:#}", half.check().unwrap_err());
        assert!(error.contains("previous"), "{error}");
    }

    #[test]
    fn the_settings_template_parses_to_defaults() {
        let parsed: FileConfig = toml::from_str(&config_template()).unwrap();
        assert_eq!(parsed, FileConfig::default());
        let set: FileConfig =
            toml::from_str("[run]\nmax_threads = 2\nonly_when_idle = true\n").unwrap();
        assert_eq!(set.run.max_threads, Some(2));
        assert!(
            toml::from_str::<FileConfig>("[run]\nmax_thread = 2\n").is_err(),
            "typos fail"
        );
    }

    #[cfg(unix)]
    #[test]
    fn the_device_key_is_stored_0600_and_loads_back() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("canopy-agent-key-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("device.key");
        // A stale, world-readable key is replaced by a new file, 0600 from
        // its creation.
        std::fs::write(&path, "old").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let key = DeviceKey::generate();
        store_key(&path, &key).unwrap();
        assert_eq!(crate::files::mode_of(&path), Some(0o600));
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text, format!("{}\n", hex::encode(key.to_bytes())));
        assert_eq!(
            load_key(&path).unwrap().public_key_hex(),
            key.public_key_hex()
        );
        assert_eq!(
            std::fs::read_dir(&dir).unwrap().count(),
            1,
            "no temporary file left behind"
        );
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).unwrap();
        let error = format!("{:#}", load_key(&path).unwrap_err());
        assert!(error.contains("cannot load this device's key"), "{error}");
        assert!(error.contains("chmod 600"), "{error}");
        let missing = load_key(&dir.join("absent.key")).unwrap_err().to_string();
        assert!(missing.contains("does not exist"), "{missing}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
