//! The data directory's layout, and reading and writing its files: every
//! read is size-capped, every write atomic ([`write_public`], through
//! `canopy_sdk::files`). The device key goes through the SDK's key store
//! ([`crate::config::store_key`]).

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
pub use canopy_sdk::files::Durability;

/// The binaries' one hint type and its constructor (`canopy_term::report`).
pub use canopy_term::report::{Hint, hinted};

/// Largest `agent.toml` / `config.toml` read.
pub const MAX_CONFIG_BYTES: u64 = 64 << 10;
/// Largest `datasets.toml` read.
pub const MAX_DATASETS_BYTES: u64 = 256 << 10;
/// Largest `status.json` read.
pub const MAX_STATUS_BYTES: u64 = 256 << 10;

/// The files of one agent installation, all under one folder.
#[derive(Clone, Debug)]
pub struct DataDir {
    pub root: PathBuf,
}

impl DataDir {
    pub fn new(root: PathBuf) -> DataDir {
        DataDir { root }
    }

    /// The Ed25519 device key, hex, mode 0600.
    pub fn key(&self) -> PathBuf {
        self.root.join("device.key")
    }

    /// The enrollment, written by `enroll`.
    pub fn agent(&self) -> PathBuf {
        self.root.join("agent.toml")
    }

    /// The operator's `run` settings, written by `install`.
    pub fn config(&self) -> PathBuf {
        self.root.join("config.toml")
    }

    /// The registered datasets, written by `data add`.
    pub fn datasets(&self) -> PathBuf {
        self.root.join("datasets.toml")
    }

    /// The daemon's state and last task, written by `run`.
    pub fn status(&self) -> PathBuf {
        self.root.join("status.json")
    }

    /// Creates the folder (mode 0700 on Unix: it holds the private key).
    pub fn create(&self) -> Result<()> {
        create_private_dir(&self.root)
            .with_context(|| format!("cannot create data directory `{}`", self.root.display()))
    }
}

#[cfg(unix)]
fn create_private_dir(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(path)
}

#[cfg(not(unix))]
fn create_private_dir(path: &Path) -> std::io::Result<()> {
    fs::create_dir_all(path)
}

/// Reads a whole file of at most `limit` bytes
/// ([`canopy_files::read_bounded`]); `Ok(None)` when it does not exist.
pub fn read_bounded(path: &Path, limit: u64) -> Result<Option<Vec<u8>>> {
    canopy_files::read_bounded_if_present(path, limit).map_err(with_owner_hint)
}

/// `error`, with a hint when permissions are the cause: an installed
/// agent's data directory belongs to its service user.
fn with_owner_hint(error: canopy_files::ReadError) -> anyhow::Error {
    let denied = error
        .cause
        .io_error()
        .is_some_and(|cause| cause.kind() == std::io::ErrorKind::PermissionDenied);
    if !denied {
        return anyhow::Error::new(error);
    }
    Hint::attach(
        anyhow::Error::new(error),
        "an installed agent's data directory belongs to its service user (`canopy-agent` unless install was given --user): run this as root (sudo) or as that user",
    )
}

/// Reads a UTF-8 text file of at most `limit` bytes; `Ok(None)` when absent.
pub fn read_text(path: &Path, limit: u64) -> Result<Option<String>> {
    match read_bounded(path, limit)? {
        None => Ok(None),
        Some(bytes) => String::from_utf8(bytes)
            .map(Some)
            .with_context(|| format!("`{}` is not UTF-8 text", path.display())),
    }
}

/// The mode of every file the agent writes but the key: exactly 0644
/// whatever the umask, since systemd reads the unit and the service user
/// reads what root wrote into its folder.
pub const PUBLIC_FILE_MODE: u32 = 0o644;

/// Writes an ordinary file atomically with [`PUBLIC_FILE_MODE`]
/// (`canopy_sdk::files::write_atomic`: a crash leaves the old file or the
/// new one). Root writing into another user's folder gives the file to
/// that user ([`crate::ownership`]) before anything is written to it.
pub fn write_public(path: &Path, contents: &[u8]) -> Result<(), canopy_sdk::files::WriteError> {
    write_public_as(path, contents, Durability::PowerCut)
}

/// [`write_public`] at the `durability` asked for (see
/// [`canopy_sdk::files::Durability`]).
pub fn write_public_as(
    path: &Path,
    contents: &[u8],
    durability: Durability,
) -> Result<(), canopy_sdk::files::WriteError> {
    canopy_sdk::files::write_atomic_as(
        path,
        contents,
        PUBLIC_FILE_MODE,
        durability,
        crate::ownership::adopt_folder_owner,
    )
}

/// The permission bits of a file, on Unix.
#[cfg(unix)]
pub fn mode_of(path: &Path) -> Option<u32> {
    use std::os::unix::fs::PermissionsExt;
    fs::metadata(path)
        .ok()
        .map(|m| m.permissions().mode() & 0o777)
}

#[cfg(not(unix))]
pub fn mode_of(_path: &Path) -> Option<u32> {
    None
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Makes `path` absolute against the current directory, without touching
/// the file system (it need not exist yet).
pub fn absolute(path: &Path) -> Result<PathBuf> {
    std::path::absolute(path).with_context(|| format!("cannot resolve `{}`", path.display()))
}

/// Cuts a message to `max` characters, so an error echoed from a server
/// or a file cannot blow up a status file or a log line.
pub fn truncate(text: &str, max: usize) -> String {
    let mut out: String = text
        .chars()
        .take(max)
        .map(|c| if c.is_control() && c != '\n' { ' ' } else { c })
        .collect();
    if text.chars().nth(max).is_some() {
        out.push('…');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("canopy-agent-files-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn reads_are_bounded() {
        let dir = scratch("bounded");
        let path = dir.join("big");
        fs::write(&path, vec![b'x'; 100]).unwrap();
        let error = format!("{:#}", read_bounded(&path, 99).unwrap_err());
        assert!(error.contains("over the limit of 99"), "{error}");
        let error = format!("{:#}", read_bounded(&dir, 99).unwrap_err());
        assert!(error.contains("it is a directory"), "{error}");
        assert_eq!(read_bounded(&path, 100).unwrap().unwrap().len(), 100);
        assert!(read_bounded(&dir.join("absent"), 10).unwrap().is_none());
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn permission_errors_say_who_owns_the_data_directory() {
        let denied = |kind| canopy_files::ReadError {
            path: "/var/lib/canopy-agent/agent.toml".into(),
            cause: canopy_files::ReadFailure::Open(std::io::Error::from(kind)),
        };
        let error = with_owner_hint(denied(std::io::ErrorKind::PermissionDenied));
        assert_eq!(
            error.to_string(),
            "cannot read `/var/lib/canopy-agent/agent.toml`"
        );
        let hint = error.downcast_ref::<Hint>().expect("a hint");
        assert!(hint.0.contains("run this as root"), "{}", hint.0);
        let missing = with_owner_hint(denied(std::io::ErrorKind::InvalidData));
        assert!(missing.downcast_ref::<Hint>().is_none());
    }

    #[test]
    fn truncation_marks_and_strips_control_characters() {
        assert_eq!(truncate("abc", 5), "abc");
        assert_eq!(truncate("abcdef", 3), "abc…");
        assert_eq!(truncate("a\u{1b}b", 5), "a b");
    }
}
