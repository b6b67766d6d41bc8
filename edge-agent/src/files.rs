//! The data directory's layout, and reading and writing its files: every
//! read is size-capped, every write is atomic (temporary file, then
//! rename). The device key goes through the SDK's key store
//! ([`crate::config::store_key`]).

use std::fs::{self, OpenOptions};
use std::io::{Read, Write};
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

/// Writes `contents` to `path` atomically with the given Unix mode: the
/// data goes to a fresh temporary file in the same folder, created with
/// that mode (never widened, never changed afterwards), is synced, and is
/// renamed over `path`. A crash leaves the old file or the new one.
/// Root writing into another user's folder gives the file to that user
/// ([`crate::ownership`]).
pub fn write_atomic(path: &Path, contents: &[u8], mode: u32) -> std::io::Result<()> {
    let tmp = temporary_sibling(path);
    let _ = fs::remove_file(&tmp);
    let result = (|| {
        let mut file = create_new_with_mode(&tmp, mode)?;
        crate::ownership::adopt_folder_owner(&file, &tmp)?;
        file.write_all(contents)?;
        file.sync_all()?;
        drop(file);
        fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result?;
    sync_parent(path);
    Ok(())
}

/// Writes an ordinary file: mode 0644 (less the umask).
pub fn write_public(path: &Path, contents: &[u8]) -> std::io::Result<()> {
    write_atomic(path, contents, 0o644)
}

/// `.NAME.tmp-PID` next to `path`, so the rename stays on one file system.
pub fn temporary_sibling(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.tmp-{}", std::process::id()))
}

#[cfg(unix)]
fn create_new_with_mode(path: &Path, mode: u32) -> std::io::Result<fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
}

#[cfg(not(unix))]
fn create_new_with_mode(path: &Path, _mode: u32) -> std::io::Result<fs::File> {
    OpenOptions::new().write(true).create_new(true).open(path)
}

/// Makes a rename durable; best effort (not every file system supports it).
fn sync_parent(path: &Path) {
    if let Some(parent) = path.parent() {
        if let Ok(dir) = fs::File::open(if parent.as_os_str().is_empty() {
            Path::new(".")
        } else {
            parent
        }) {
            let _ = dir.sync_all();
        }
    }
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

    #[cfg(unix)]
    #[test]
    fn files_are_created_with_the_mode_asked_for() {
        let dir = scratch("secret");
        let key = dir.join("private");
        write_atomic(&key, b"0123", 0o600).unwrap();
        assert_eq!(mode_of(&key), Some(0o600));
        assert_eq!(fs::read(&key).unwrap(), b"0123");
        assert!(!temporary_sibling(&key).exists(), "no temporary file left");
        let _ = fs::remove_dir_all(&dir);
    }

    #[cfg(unix)]
    #[test]
    fn replacing_a_world_readable_file_yields_the_new_mode() {
        use std::os::unix::fs::PermissionsExt;
        let dir = scratch("replace");
        let key = dir.join("private");
        fs::write(&key, b"old").unwrap();
        fs::set_permissions(&key, fs::Permissions::from_mode(0o644)).unwrap();
        write_atomic(&key, b"new", 0o600).unwrap();
        assert_eq!(mode_of(&key), Some(0o600), "the new inode has the new mode");
        assert_eq!(fs::read(&key).unwrap(), b"new");
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_stale_temporary_file_does_not_block_a_write() {
        let dir = scratch("stale");
        let path = dir.join("agent.toml");
        fs::write(temporary_sibling(&path), b"half").unwrap();
        write_public(&path, b"whole").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"whole");
        let _ = fs::remove_dir_all(&dir);
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
