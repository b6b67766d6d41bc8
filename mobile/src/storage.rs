//! The client's storage directory: what survives the app being killed.
//!
//! | file | what |
//! |---|---|
//! | `device.key` | the device's Ed25519 key (mode 0600, `canopy_sdk::keystore`) |
//! | `enrollment.json` | device id, server URL, trusted model-signing keys, reported backends |
//! | `task.json` | the task `check_for_task` accepted, until it is done or given up |
//! | `model.canopy` | the task's model, downloaded (resumably) and verified |
//! | `checkpoint.bin` | training progress of the task (`canopy_sdk::checkpoint`) |
//! | `last_outcome.txt` | how the last task ended, for `status` |
//!
//! *Invariant:* every file is replaced atomically
//! (`canopy_sdk::files::write_atomic`: written beside, synced, renamed,
//! the directory synced), so a kill or a power cut at any instant leaves
//! the old file or the new one, never half of one. Files are the app
//! user's only (`FILE_MODE`). Reads are bounded; a file that does not
//! parse is an error that names it, never a panic.

use std::fs;
use std::path::{Path, PathBuf};

use canopy_protocol::messages::Task;
use canopy_protocol::model_sig::TrustedKeys;
use serde::{Deserialize, Serialize};

use crate::error::CanopyError;

/// The largest JSON file the client reads back (a task with a large
/// layout is the biggest).
const MAX_JSON_BYTES: u64 = 16 << 20;
/// The storage format, so a later library can migrate or refuse.
const ENROLLMENT_VERSION: u32 = 1;
/// The permission bits of the files written here (Unix): the app's user
/// only, like the key; nothing else has reason to read a client's storage.
const FILE_MODE: u32 = 0o600;

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Enrollment {
    pub version: u32,
    pub server_url: String,
    pub device_id: i64,
    pub trusted_keys: TrustedKeys,
    pub backends: Vec<String>,
}

impl Enrollment {
    pub fn new(
        server_url: &str,
        device_id: i64,
        trusted_keys: TrustedKeys,
        backends: Vec<String>,
    ) -> Self {
        Enrollment {
            version: ENROLLMENT_VERSION,
            server_url: server_url.to_string(),
            device_id,
            trusted_keys,
            backends,
        }
    }
}

#[derive(Clone, Debug)]
pub(crate) struct Storage {
    root: PathBuf,
}

impl Storage {
    /// Opens (creating, private to the app's user) the directory.
    pub fn open(dir: &str) -> Result<Storage, CanopyError> {
        if dir.trim().is_empty() {
            return Err(CanopyError::config(
                "the storage directory is empty\nhint: pass a directory private to the app, \
                 e.g. Android's filesDir or iOS's Application Support directory",
            ));
        }
        let root = PathBuf::from(dir);
        if !root.is_dir() {
            fs::create_dir_all(&root).map_err(|error| io_error("create", &root, &error))?;
            // A directory the client made is private to the app's user; one
            // the app made is left as it is (the key file is 0600 anyway).
            #[cfg(unix)]
            {
                use std::os::unix::fs::PermissionsExt;
                fs::set_permissions(&root, fs::Permissions::from_mode(0o700))
                    .map_err(|error| io_error("make private", &root, &error))?;
            }
        }
        Ok(Storage { root })
    }

    pub fn key_path(&self) -> PathBuf {
        self.root.join("device.key")
    }
    pub fn model_path(&self) -> PathBuf {
        self.root.join("model.canopy")
    }
    pub fn checkpoint_path(&self) -> PathBuf {
        self.root.join("checkpoint.bin")
    }
    fn enrollment_path(&self) -> PathBuf {
        self.root.join("enrollment.json")
    }
    fn task_path(&self) -> PathBuf {
        self.root.join("task.json")
    }
    fn outcome_path(&self) -> PathBuf {
        self.root.join("last_outcome.txt")
    }

    pub fn enrollment(&self) -> Result<Option<Enrollment>, CanopyError> {
        let Some(enrollment) = self.read_json::<Enrollment>(&self.enrollment_path())? else {
            return Ok(None);
        };
        if enrollment.version != ENROLLMENT_VERSION {
            return Err(CanopyError::storage(format!(
                "{} is of storage version {}, this library reads version {ENROLLMENT_VERSION}\n\
                 hint: use the library that wrote it, or unenroll and enroll again",
                self.enrollment_path().display(),
                enrollment.version
            )));
        }
        Ok(Some(enrollment))
    }

    pub fn save_enrollment(&self, enrollment: &Enrollment) -> Result<(), CanopyError> {
        self.write_json(&self.enrollment_path(), enrollment)
    }

    pub fn task(&self) -> Result<Option<Task>, CanopyError> {
        self.read_json(&self.task_path())
    }

    pub fn save_task(&self, task: &Task) -> Result<(), CanopyError> {
        self.write_json(&self.task_path(), task)
    }

    /// Forgets the task and everything kept for it.
    pub fn clear_task(&self) -> Result<(), CanopyError> {
        for path in [self.task_path(), self.checkpoint_path(), self.model_path()] {
            remove_if_present(&path)?;
        }
        // Partial downloads: `model.canopy.<digest prefix>.part`.
        let entries =
            fs::read_dir(&self.root).map_err(|error| io_error("list", &self.root, &error))?;
        for entry in entries.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.starts_with("model.canopy.") && name.ends_with(".part") {
                remove_if_present(&entry.path())?;
            }
        }
        Ok(())
    }

    pub fn last_outcome(&self) -> Result<Option<String>, CanopyError> {
        Ok(read_bounded(&self.outcome_path(), MAX_JSON_BYTES)?
            .map(|bytes| String::from_utf8_lossy(&bytes).into_owned()))
    }

    pub fn save_outcome(&self, outcome: &str) -> Result<(), CanopyError> {
        write_atomic(&self.outcome_path(), outcome.as_bytes())
    }

    /// Removes everything the client keeps: the key, the enrollment, the
    /// task and its files.
    pub fn wipe(&self) -> Result<(), CanopyError> {
        self.clear_task()?;
        for path in [self.enrollment_path(), self.key_path(), self.outcome_path()] {
            remove_if_present(&path)?;
        }
        Ok(())
    }

    fn read_json<T: for<'de> Deserialize<'de>>(
        &self,
        path: &Path,
    ) -> Result<Option<T>, CanopyError> {
        let Some(bytes) = read_bounded(path, MAX_JSON_BYTES)? else {
            return Ok(None);
        };
        serde_json::from_slice(&bytes).map(Some).map_err(|error| {
            CanopyError::storage(format!(
                "{} is not a valid client file: {error}\nhint: {FOREIGN_FILE_HINT}",
                path.display()
            ))
        })
    }

    fn write_json<T: Serialize>(&self, path: &Path, value: &T) -> Result<(), CanopyError> {
        let bytes = serde_json::to_vec_pretty(value).map_err(|error| {
            CanopyError::storage(format!("cannot encode {}: {error}", path.display()))
        })?;
        write_atomic(path, &bytes)
    }
}

/// The hint for a storage operation the system refused.
const STORAGE_HINT: &str = "the storage directory must be writable by the app and have free space";

/// The hint for a file the client did not write as it is.
const FOREIGN_FILE_HINT: &str =
    "it was written by another program or damaged; unenroll to start over";

fn io_error(action: &str, path: &Path, error: &std::io::Error) -> CanopyError {
    CanopyError::storage(format!(
        "cannot {action} {}: {error}\nhint: {STORAGE_HINT}",
        path.display()
    ))
}

fn remove_if_present(path: &Path) -> Result<(), CanopyError> {
    match fs::remove_file(path) {
        Err(error) if error.kind() != std::io::ErrorKind::NotFound => {
            Err(io_error("remove", path, &error))
        }
        _ => Ok(()),
    }
}

/// A file the client wrote ([`canopy_files::read_bounded`]); `None` when
/// there is none.
fn read_bounded(path: &Path, limit: u64) -> Result<Option<Vec<u8>>, CanopyError> {
    canopy_files::read_bounded_if_present(path, limit).map_err(|error| {
        let hint = match error.cause.io_error() {
            Some(_) => STORAGE_HINT,
            None => FOREIGN_FILE_HINT,
        };
        CanopyError::storage(crate::error::chain(&error, Some(hint)))
    })
}

fn write_atomic(path: &Path, contents: &[u8]) -> Result<(), CanopyError> {
    canopy_sdk::files::write_atomic(path, contents, FILE_MODE)
        .map_err(|error| io_error(error.action, path, &error.source))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_damaged_file_is_an_error_that_names_it() {
        let dir = tempfile::tempdir().unwrap();
        let storage = Storage::open(dir.path().to_str().unwrap()).unwrap();
        fs::write(dir.path().join("task.json"), b"{\"round_id\": 3").unwrap();
        let error = storage.task().unwrap_err();
        assert_eq!(error.name(), "Storage");
        assert!(error.message().contains("task.json"), "{error}");
        fs::write(
            dir.path().join("task.json"),
            vec![b' '; (MAX_JSON_BYTES + 1) as usize],
        )
        .unwrap();
        assert!(storage.task().unwrap_err().message().contains("over"));
        assert!(storage.enrollment().unwrap().is_none());
    }
}
