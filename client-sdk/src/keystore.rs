//! The device key on disk.
//!
//! The file holds the 32-byte Ed25519 secret as 64 lowercase hex digits
//! and a newline. Whoever can read it can act as the device, so:
//!
//! - [`save_device_key`] writes it with [`crate::files::write_atomic`]
//!   and mode `0600` (owner read and write, nothing for group and others),
//!   exactly that whatever the umask. A crash leaves either the old file
//!   or the new one, never a torn key, and the key is never readable by
//!   others, not even for a moment. An existing key at `path` is replaced.
//! - [`load_device_key`] refuses a file that grants any permission to
//!   group or others (as OpenSSH does for private keys): one readable by
//!   them may have been copied, one writable by them may have been swapped.
//!   It also refuses anything but a regular file, and files larger than
//!   [`MAX_KEY_FILE_BYTES`], before reading them.
//!
//! The permission checks are Unix behaviour (`cfg(unix)`: Linux, Android,
//! macOS, iOS). Elsewhere the file is written the same way, without a
//! mode, and loaded without a permission check; keep it in storage only
//! the app can reach. The owner of the file is not compared with the
//! running user; on Android and iOS each app has its own user or sandbox.

use std::path::{Path, PathBuf};

use canopy_files::BoundedFile;
use canopy_protocol::auth::DeviceKey;

/// The largest key file [`load_device_key`] reads. The key is 65 bytes;
/// the slack allows a `\r\n` or trailing spaces from hand editing.
pub const MAX_KEY_FILE_BYTES: u64 = 256;
/// The permission bits a key file must have on Unix.
pub const KEY_FILE_MODE: u32 = 0o600;

const KEY_HEX_LEN: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum KeyStoreError {
    /// The atomic write failed; the error names the step.
    #[error("cannot write the device key file")]
    Write(#[source] crate::files::WriteError),
    #[error(
        "the device key file {path} has mode {mode:04o}, which lets group or others at it; \
         it must be readable by its owner only (run `chmod 600 {path}`), and the key may \
         have been exposed"
    )]
    Permissions { path: PathBuf, mode: u32 },
    /// Missing, not a regular file, larger than [`MAX_KEY_FILE_BYTES`], or
    /// an I/O error ([`canopy_files::read_bounded`]'s rule).
    #[error("cannot read the device key file")]
    Read(#[source] canopy_files::ReadError),
    #[error("the device key file {path} does not hold a key: {reason}")]
    Malformed { path: PathBuf, reason: String },
}

/// Writes `key` to `path` atomically, with mode `0600` on Unix.
pub fn save_device_key(path: &Path, key: &DeviceKey) -> Result<(), KeyStoreError> {
    let mut text = hex::encode(key.to_bytes());
    text.push('\n');
    let written = crate::files::write_atomic(path, text.as_bytes(), KEY_FILE_MODE);
    // Overwrites the secret's copy; the compiler may elide it, so this is
    // hygiene, not a guarantee.
    let mut bytes = text.into_bytes();
    bytes.fill(0);
    written.map_err(KeyStoreError::Write)
}

/// Reads a key written by [`save_device_key`], refusing a file that group
/// or others may access (Unix), that is not a regular file or that is
/// larger than [`MAX_KEY_FILE_BYTES`].
pub fn load_device_key(path: &Path) -> Result<DeviceKey, KeyStoreError> {
    let file = BoundedFile::open(path, MAX_KEY_FILE_BYTES).map_err(KeyStoreError::Read)?;
    // The mode is the opened file's, so a file swapped in between the
    // check and the read cannot slip past it.
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = file.metadata().permissions().mode() & 0o7777;
        if mode & 0o077 != 0 {
            return Err(KeyStoreError::Permissions {
                path: path.to_path_buf(),
                mode,
            });
        }
    }
    let mut bytes = file.read_to_end().map_err(KeyStoreError::Read)?;
    let parsed = parse_key(path, &bytes);
    bytes.fill(0);
    parsed
}

fn parse_key(path: &Path, bytes: &[u8]) -> Result<DeviceKey, KeyStoreError> {
    let malformed = |reason: String| KeyStoreError::Malformed {
        path: path.to_path_buf(),
        reason,
    };
    let text = std::str::from_utf8(bytes)
        .map_err(|_| malformed("it is not text".to_string()))?
        .trim();
    if text.len() != KEY_HEX_LEN {
        return Err(malformed(format!(
            "expected {KEY_HEX_LEN} hex digits, found {} characters",
            text.chars().count()
        )));
    }
    let mut secret = [0u8; 32];
    hex::decode_to_slice(text, &mut secret)
        .map_err(|error| malformed(format!("not hex: {error}")))?;
    let key = DeviceKey::from_bytes(&secret);
    secret.fill(0);
    Ok(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_saved_key_loads_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("device.key");
        let key = DeviceKey::generate();
        save_device_key(&path, &key).expect("save");
        let loaded = load_device_key(&path).expect("load");
        assert_eq!(loaded.to_bytes(), key.to_bytes());
        let text = std::fs::read_to_string(&path).expect("read");
        assert_eq!(text, format!("{}\n", hex::encode(key.to_bytes())));
        // Replacing is atomic and leaves no temporary file behind.
        let second = DeviceKey::generate();
        save_device_key(&path, &second).expect("save again");
        assert_eq!(
            load_device_key(&path).expect("load").public_key(),
            second.public_key()
        );
        let entries: Vec<_> = std::fs::read_dir(dir.path())
            .expect("list")
            .map(|entry| entry.expect("entry").file_name())
            .collect();
        assert_eq!(entries, [std::ffi::OsString::from("device.key")]);
    }

    #[cfg(unix)]
    #[test]
    fn the_file_is_created_with_mode_0600() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("device.key");
        // An existing, world-readable file is replaced, not reused.
        std::fs::write(&path, "old").expect("write");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        save_device_key(&path, &DeviceKey::generate()).expect("save");
        let mode = std::fs::metadata(&path).expect("stat").permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "mode {mode:o}");
    }

    #[cfg(unix)]
    #[test]
    fn a_file_open_to_group_or_others_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("device.key");
        save_device_key(&path, &DeviceKey::generate()).expect("save");
        for mode in [0o644, 0o640, 0o604, 0o620, 0o602, 0o660] {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).expect("chmod");
            match load_device_key(&path) {
                Err(KeyStoreError::Permissions { mode: found, .. }) => assert_eq!(found, mode),
                other => panic!("mode {mode:o} must be refused, got {other:?}"),
            }
        }
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let message = load_device_key(&path).expect_err("refused").to_string();
        assert!(
            message.contains("0644") && message.contains("chmod 600"),
            "{message}"
        );
        for mode in [0o600, 0o400] {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).expect("chmod");
            load_device_key(&path).expect("owner-only modes load");
        }
    }

    #[cfg(unix)]
    fn private_file(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let path = dir.join(name);
        std::fs::write(&path, bytes).expect("write");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        path
    }

    #[cfg(unix)]
    #[test]
    fn oversized_malformed_and_odd_files_are_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let big = private_file(dir.path(), "big", &vec![b'a'; 10_000]);
        assert!(matches!(
            load_device_key(&big),
            Err(KeyStoreError::Read(canopy_files::ReadError {
                cause: canopy_files::ReadFailure::TooLarge { size: 10_000, .. },
                ..
            }))
        ));
        let short = private_file(dir.path(), "short", b"abcd\n");
        assert!(matches!(
            load_device_key(&short),
            Err(KeyStoreError::Malformed { .. })
        ));
        let not_hex = private_file(dir.path(), "not-hex", "zz".repeat(32).as_bytes());
        assert!(matches!(
            load_device_key(&not_hex),
            Err(KeyStoreError::Malformed { .. })
        ));
        let key = DeviceKey::generate();
        let crlf = format!("{}\r\n", hex::encode(key.to_bytes()));
        let edited = private_file(dir.path(), "edited", crlf.as_bytes());
        assert_eq!(
            load_device_key(&edited).expect("crlf loads").public_key(),
            key.public_key()
        );
        assert!(matches!(
            load_device_key(dir.path()),
            Err(KeyStoreError::Read(canopy_files::ReadError {
                cause: canopy_files::ReadFailure::Directory,
                ..
            }))
        ));
        assert!(matches!(
            load_device_key(&dir.path().join("missing")),
            Err(KeyStoreError::Read(error)) if error.is_not_found()
        ));
    }
}
