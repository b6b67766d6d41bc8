//! The saved login: which server, with which token, trusted how. One TOML
//! file, `config.toml`, in `$CANOPY_CONFIG_DIR` or else the user's
//! configuration directory (`$XDG_CONFIG_HOME/canopy`, `~/.config/canopy`).
//!
//! The file holds a bearer token, so it is written like a private key,
//! through `canopy_sdk::files::write_atomic` with mode 0600 (its directory,
//! when missing, is created 0700): a crash leaves the old login or the new
//! one, and the token is never readable by others, not even for a moment.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use canopy_sdk::Trust;
use serde::{Deserialize, Serialize};

use crate::files::{Hint, write_atomic};

/// Names the directory that holds `config.toml`, overriding the default.
pub const CONFIG_DIR_VAR: &str = "CANOPY_CONFIG_DIR";
pub const CONFIG_FILE_NAME: &str = "config.toml";
/// A login is a URL, a token and a fingerprint: a few hundred bytes.
pub const MAX_CONFIG_BYTES: u64 = 64 << 10;
/// Only its owner may read the file: the token is a credential.
const CONFIG_FILE_MODE: u32 = 0o600;

/// How to reach and authenticate to one server.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Login {
    /// The server's base URL, e.g. `https://canopy.example.com:8443`.
    pub url: String,
    /// An admin API bearer token (`canopy-server token create`).
    pub token: String,
    /// The pinned SHA-256 of the server's certificate (`sha256:HEX`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fingerprint: Option<String>,
    /// A PEM file of CA certificates to trust instead of the public roots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_cert: Option<PathBuf>,
}

impl Login {
    /// A pinned fingerprint, else a CA file, else the public web PKI.
    pub fn trust(&self) -> Trust {
        match (&self.fingerprint, &self.ca_cert) {
            (Some(fingerprint), _) => Trust::PinnedSha256(fingerprint.clone()),
            (None, Some(path)) => Trust::CaFile(path.clone()),
            (None, None) => Trust::SystemRoots,
        }
    }
}

/// Where the login lives.
pub fn config_path() -> Result<PathBuf> {
    let dir = match std::env::var_os(CONFIG_DIR_VAR) {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => {
            use etcetera::BaseStrategy;
            etcetera::choose_base_strategy()
                .context("cannot find your configuration directory")
                .map_err(|error| {
                    Hint::attach(
                        error,
                        format!(
                            "set {CONFIG_DIR_VAR} to the directory the login should be kept in"
                        ),
                    )
                })?
                .config_dir()
                .join("canopy")
        }
    };
    Ok(dir.join(CONFIG_FILE_NAME))
}

/// The saved login; not being logged in is an error that says how to.
pub fn load() -> Result<Login> {
    let path = config_path()?;
    load_from(&path)
}

pub fn load_from(path: &Path) -> Result<Login> {
    let metadata = match std::fs::metadata(path) {
        Ok(metadata) => metadata,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            return Err(anyhow::Error::new(Hint(
                "log in first: canopy login URL --token T [--fingerprint sha256:…]".into(),
            ))
            .context(format!(
                "not logged in to a Canopy server (no {})",
                path.display()
            )));
        }
        Err(error) => {
            return Err(anyhow::Error::new(error)
                .context(format!("cannot read the login file {}", path.display())));
        }
    };
    if !metadata.is_file() || metadata.len() > MAX_CONFIG_BYTES {
        bail!(
            "the login file {} is not a file of at most {MAX_CONFIG_BYTES} bytes; remove it and run `canopy login` again",
            path.display()
        );
    }
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the login file {}", path.display()))?;
    toml::from_str(&text)
        .with_context(|| format!("the login file {} is damaged", path.display()))
        .map_err(|error| {
            Hint::attach(
                error,
                "run `canopy login URL --token T` again to rewrite it",
            )
        })
}

/// Saves `login` atomically with mode 0600; returns the file's path.
pub fn save(login: &Login) -> Result<PathBuf> {
    let path = config_path()?;
    save_to(&path, login)?;
    Ok(path)
}

pub fn save_to(path: &Path, login: &Login) -> Result<()> {
    let dir = path
        .parent()
        .filter(|dir| !dir.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let context = || format!("cannot save the login to {}", path.display());
    create_private_dir(dir).with_context(context)?;
    let text = toml::to_string(login).with_context(context)?;
    write_atomic(path, text.as_bytes(), CONFIG_FILE_MODE).with_context(context)
}

/// Removes the saved login; false when there was none.
pub fn remove() -> Result<Option<Login>> {
    let path = config_path()?;
    let login = match load_from(&path) {
        Ok(login) => Some(login),
        Err(_) if !path.exists() => return Ok(None),
        Err(_) => None,
    };
    std::fs::remove_file(&path)
        .with_context(|| format!("cannot remove the login file {}", path.display()))?;
    Ok(login)
}

fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    let mut builder = std::fs::DirBuilder::new();
    builder.recursive(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::DirBuilderExt;
        builder.mode(0o700);
    }
    builder.create(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn login() -> Login {
        Login {
            url: "https://127.0.0.1:8443".into(),
            token: "cnpa_secret".into(),
            fingerprint: Some(format!("sha256:{}", "ab".repeat(32))),
            ca_cert: None,
        }
    }

    #[test]
    fn a_saved_login_reads_back_and_only_its_owner_can_read_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nested/config.toml");
        save_to(&path, &login()).unwrap();
        assert_eq!(load_from(&path).unwrap(), login());
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        // Saving again replaces it and leaves no temporary file behind.
        let mut other = login();
        other.token = "cnpa_other".into();
        save_to(&path, &other).unwrap();
        assert_eq!(load_from(&path).unwrap(), other);
        let names: Vec<_> = std::fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|entry| entry.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("config.toml")]);
    }

    #[test]
    fn missing_oversized_and_damaged_files_are_refused_with_a_way_out() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.toml");
        let error = format!("{:#}", load_from(&path).unwrap_err());
        assert!(error.contains("not logged in"), "{error}");
        assert!(error.contains("canopy login URL --token T"), "{error}");

        std::fs::write(&path, "url = 3").unwrap();
        let error = format!("{:#}", load_from(&path).unwrap_err());
        assert!(error.contains("is damaged"), "{error}");

        std::fs::write(&path, vec![b'#'; MAX_CONFIG_BYTES as usize + 1]).unwrap();
        let error = format!("{:#}", load_from(&path).unwrap_err());
        assert!(error.contains("at most"), "{error}");
    }
}
