//! The data directory's layout, and reading and writing its files: every
//! read is size-capped, every write atomic ([`write_public`], through
//! `canopy_sdk::files`). The device key goes through the SDK's key store
//! ([`crate::config::store_key`]).

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

/// A hint attached to an error chain; printed last, as `hint:`.
#[derive(Debug)]
pub struct Hint(pub String);

impl std::fmt::Display for Hint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Hint {}

/// Builds an error whose chain ends in a hint: `error: {message}` then
/// `hint: {hint}`.
pub fn hinted(message: impl Into<String>, hint: impl Into<String>) -> anyhow::Error {
    anyhow::Error::new(Hint(hint.into())).context(message.into())
}

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

/// Reads a whole file of at most `limit` bytes. `Ok(None)` when it does
/// not exist.
pub fn read_bounded(path: &Path, limit: u64) -> Result<Option<Vec<u8>>> {
    let file = match fs::File::open(path) {
        Ok(file) => file,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(error) => return Err(open_error(path, error)),
    };
    let meta = file
        .metadata()
        .with_context(|| format!("cannot stat `{}`", path.display()))?;
    if meta.is_dir() {
        bail!("`{}` is a directory, not a file", path.display());
    }
    if meta.len() > limit {
        bail!(
            "`{}` is {} bytes, over the limit of {limit}",
            path.display(),
            meta.len()
        );
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    // One byte past the limit detects a file that grew after the stat.
    file.take(limit + 1)
        .read_to_end(&mut bytes)
        .with_context(|| format!("cannot read `{}`", path.display()))?;
    if bytes.len() as u64 > limit {
        bail!("`{}` is over the limit of {limit} bytes", path.display());
    }
    Ok(Some(bytes))
}

/// "cannot open", with a hint when permissions are the cause: an
/// installed agent's data directory belongs to its service user.
fn open_error(path: &Path, error: std::io::Error) -> anyhow::Error {
    let context = format!("cannot open `{}`", path.display());
    if error.kind() != std::io::ErrorKind::PermissionDenied {
        return anyhow::Error::new(error).context(context);
    }
    anyhow::Error::new(Hint(
        "an installed agent's data directory belongs to its service user (`canopy-agent` unless install was given --user): run this as root (sudo) or as that user".into(),
    ))
    .context(error.to_string())
    .context(context)
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
    canopy_sdk::files::write_atomic_with(
        path,
        contents,
        PUBLIC_FILE_MODE,
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
        let error = read_bounded(&path, 99).unwrap_err().to_string();
        assert!(error.contains("over the limit of 99"), "{error}");
        assert_eq!(read_bounded(&path, 100).unwrap().unwrap().len(), 100);
        assert!(read_bounded(&dir.join("absent"), 10).unwrap().is_none());
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn permission_errors_say_who_owns_the_data_directory() {
        let error = open_error(
            Path::new("/var/lib/canopy-agent/agent.toml"),
            std::io::Error::from(std::io::ErrorKind::PermissionDenied),
        );
        assert_eq!(
            error.to_string(),
            "cannot open `/var/lib/canopy-agent/agent.toml`"
        );
        let hint = error.downcast_ref::<Hint>().expect("a hint");
        assert!(hint.0.contains("run this as root"), "{}", hint.0);
        let missing = open_error(
            Path::new("x"),
            std::io::Error::from(std::io::ErrorKind::InvalidData),
        );
        assert!(missing.downcast_ref::<Hint>().is_none());
    }

    #[test]
    fn truncation_marks_and_strips_control_characters() {
        assert_eq!(truncate("abc", 5), "abc");
        assert_eq!(truncate("abcdef", 3), "abc…");
        assert_eq!(truncate("a\u{1b}b", 5), "a b");
    }
}
