//! Atomic file writes: the one way the device side and the CLI replace a
//! file (the key store, checkpoints, the app client's storage, the edge
//! agent's files, the CLI's outputs and saved login).
//!
//! [`write_atomic`] writes the bytes to a new temporary file beside the
//! target, fsyncs it, renames it over the target and fsyncs the directory.
//! Why each step:
//!
//! - **Rename.** Replacing a name within one directory is a single step
//!   for the file system, so a crash or a kill at any instant leaves the
//!   old file or the new one, never a torn one. The temporary file lies
//!   beside the target because a rename cannot cross file systems.
//! - **Fsync before the rename.** Otherwise the new name may reach the
//!   disk before the data does, and a power cut leaves the target empty or
//!   partial (ext4's delayed allocation does exactly this).
//! - **Fsync of the directory after it.** The rename lives in the
//!   directory; until that is on disk, a power cut can bring back the old
//!   file after the caller was told the new one is written (a key the
//!   server enrolled, lost).
//! - **Exact mode** (Unix). The file is created with `mode` and then set to
//!   exactly `mode`: the umask can only take bits away, so the file is
//!   never wider than asked, not even for a moment, and a restrictive umask
//!   cannot leave a file unreadable by those it is meant for (a key file
//!   its owner cannot read, a systemd unit that only root can). Elsewhere
//!   the mode is ignored.
//! - **A fresh temporary name**, `.NAME.PID.RANDOM.tmp`, created with
//!   `create_new`: two writers (threads, processes) never share one, and
//!   an existing file or a link planted at that name is never opened. It
//!   is removed on any failure; only a crash leaves one behind.
//!
//! The two fsyncs are what a power cut needs, and all it needs: a crash or
//! a `kill -9` of the process leaves the old file or the new one without
//! them, since the kernel holds the written bytes and the rename either
//! way. They are also the slow part: a 4 KB fsync on a busy disk can take
//! over a second. [`write_atomic_as`] with [`Durability::ProcessCrash`]
//! leaves them out, for files rewritten often whose loss in a power cut
//! costs only being out of date (the edge agent's `status.json`, rewritten
//! at every step of every task).

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// A write that failed, and at which step.
#[derive(Debug, thiserror::Error)]
#[error("cannot {action} {}", path.display())]
pub struct WriteError {
    /// The step that failed, phrased to take the target as its object
    /// ("rename a temporary file over"), so callers can put it in their
    /// own messages.
    pub action: &'static str,
    /// The file being written (the target, not the temporary file).
    pub path: PathBuf,
    #[source]
    pub source: io::Error,
}

/// What a replaced file survives once the write has returned. Either way
/// a reader, or the next start after a crash, finds the old file or the
/// new one, never a torn one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Durability {
    /// A power cut too: the file is fsynced before the rename and its
    /// directory after it. For what must not be lost once written (keys,
    /// enrollments, checkpoints).
    PowerCut,
    /// A crash or a kill of the process, not a power cut, which may bring
    /// back the old file or leave an empty one: no fsync, so the write never
    /// waits for the disk. For files that are rewritten often and only
    /// report (a daemon's status).
    ProcessCrash,
}

/// Replaces `path` with `bytes` atomically, with exactly `mode` on Unix
/// (see the module doc), durable across a power cut. The parent directory
/// must exist.
pub fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> Result<(), WriteError> {
    write_atomic_with(path, bytes, mode, |_, _| Ok(()))
}

/// [`write_atomic`], running `prepare` on the open, still empty temporary
/// file (and its path) before the bytes are written: the edge agent gives
/// the file to the owner of the folder there, so no other owner ever holds
/// the content.
pub fn write_atomic_with(
    path: &Path,
    bytes: &[u8],
    mode: u32,
    prepare: impl FnOnce(&File, &Path) -> io::Result<()>,
) -> Result<(), WriteError> {
    write_atomic_as(path, bytes, mode, Durability::PowerCut, prepare)
}

/// [`write_atomic_with`] at the `durability` asked for: without the
/// fsyncs for [`Durability::ProcessCrash`].
pub fn write_atomic_as(
    path: &Path,
    bytes: &[u8],
    mode: u32,
    durability: Durability,
    prepare: impl FnOnce(&File, &Path) -> io::Result<()>,
) -> Result<(), WriteError> {
    let power_cut = durability == Durability::PowerCut;
    let fail = |action: &'static str| {
        move |source: io::Error| WriteError {
            action,
            path: path.to_path_buf(),
            source,
        }
    };
    let name = path.file_name().ok_or_else(|| {
        fail("name a temporary file for")(io::Error::new(
            io::ErrorKind::InvalidInput,
            "the path names no file",
        ))
    })?;
    let temporary = directory_of(path).join(format!(
        ".{}.{}.{:016x}.tmp",
        name.to_string_lossy(),
        std::process::id(),
        rand::random::<u64>()
    ));
    // Not removed when this fails: a name that exists is someone else's.
    let mut file =
        create_new_with_mode(&temporary, mode).map_err(fail("create a temporary file for"))?;
    let replaced = (|| {
        set_mode(&file, mode).map_err(fail("set the mode of"))?;
        prepare(&file, &temporary).map_err(fail("prepare a temporary file for"))?;
        file.write_all(bytes).map_err(fail("write"))?;
        if power_cut {
            file.sync_all().map_err(fail("sync"))?;
        }
        drop(file);
        std::fs::rename(&temporary, path).map_err(fail("rename a temporary file over"))
    })();
    if replaced.is_err() {
        let _ = std::fs::remove_file(&temporary);
    }
    replaced?;
    if power_cut {
        sync_parent(path).map_err(fail("sync the directory of"))?;
    }
    Ok(())
}

/// Makes a rename to `path` durable by fsyncing its directory (Unix;
/// elsewhere there is nothing to do here). A file system that cannot sync
/// a directory (some FUSE and network ones answer `EINVAL` or `ENOTSUP`)
/// is not an error: the rename is as durable as it makes it, and refusing
/// would make such a directory unusable.
pub fn sync_parent(path: &Path) -> io::Result<()> {
    #[cfg(unix)]
    match File::open(directory_of(path)).and_then(|directory| directory.sync_all()) {
        Err(error)
            if !matches!(
                error.kind(),
                io::ErrorKind::InvalidInput | io::ErrorKind::Unsupported
            ) =>
        {
            return Err(error);
        }
        _ => {}
    }
    #[cfg(not(unix))]
    let _ = path;
    Ok(())
}

/// The directory `path` is in; a bare file name is in ".".
fn directory_of(path: &Path) -> &Path {
    match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    }
}

#[cfg(unix)]
fn create_new_with_mode(path: &Path, mode: u32) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
}

#[cfg(not(unix))]
fn create_new_with_mode(path: &Path, _mode: u32) -> io::Result<File> {
    OpenOptions::new().write(true).create_new(true).open(path)
}

#[cfg(unix)]
fn set_mode(file: &File, mode: u32) -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    file.set_permissions(std::fs::Permissions::from_mode(mode))
}

#[cfg(not(unix))]
fn set_mode(_file: &File, _mode: u32) -> io::Result<()> {
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .expect("list")
            .map(|entry| entry.expect("entry").file_name().to_string_lossy().into())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn the_content_is_replaced_and_no_temporary_file_is_left() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("state.json");
        write_atomic(&path, b"first", 0o644).expect("write");
        assert_eq!(std::fs::read(&path).expect("read"), b"first");
        write_atomic(&path, b"second, longer", 0o644).expect("write over");
        assert_eq!(std::fs::read(&path).expect("read"), b"second, longer");
        write_atomic(&path, b"", 0o644).expect("write nothing");
        assert_eq!(std::fs::read(&path).expect("read"), b"");
        assert_eq!(names(dir.path()), ["state.json"]);
    }

    #[cfg(unix)]
    #[test]
    fn the_mode_is_exactly_the_one_asked_for() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("file");
        let mode_of =
            |path: &Path| std::fs::metadata(path).expect("stat").permissions().mode() & 0o7777;
        // Each write is a new inode with the new mode, whatever the old
        // file had and whatever this process's umask takes away.
        for mode in [0o600, 0o644, 0o640, 0o600, 0o666] {
            write_atomic(&path, b"x", mode).expect("write");
            assert_eq!(mode_of(&path), mode, "asked for {mode:o}");
        }
    }

    #[test]
    fn a_failed_rename_leaves_no_temporary_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let target = dir.path().join("taken");
        std::fs::create_dir(&target).expect("mkdir");
        std::fs::write(target.join("inside"), b"keep").expect("write");
        let error = write_atomic(&target, b"x", 0o600).expect_err("a directory is in the way");
        assert_eq!(error.action, "rename a temporary file over");
        assert_eq!(error.path, target);
        assert!(error.to_string().contains("taken"), "{error}");
        assert_eq!(names(dir.path()), ["taken"]);
        assert_eq!(names(&target), ["inside"]);
    }

    #[test]
    fn a_failed_preparation_leaves_no_temporary_file_and_no_target() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("agent.toml");
        let mut seen = None;
        let error = write_atomic_with(&path, b"x", 0o644, |file, temporary| {
            assert_eq!(file.metadata()?.len(), 0, "prepared before the write");
            seen = Some(temporary.to_path_buf());
            Err(io::Error::from(io::ErrorKind::PermissionDenied))
        })
        .expect_err("the preparation failed");
        assert_eq!(error.action, "prepare a temporary file for");
        let temporary = seen.expect("prepare ran");
        let name = temporary.file_name().expect("name").to_string_lossy();
        let pid = std::process::id().to_string();
        assert!(name.starts_with(".agent.toml.") && name.ends_with(".tmp"));
        assert!(name.contains(&pid), "{name}");
        assert_eq!(temporary.parent(), Some(dir.path()));
        assert!(names(dir.path()).is_empty());
    }

    #[test]
    fn a_missing_directory_or_no_file_name_is_an_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let error =
            write_atomic(&dir.path().join("absent/file"), b"x", 0o600).expect_err("no directory");
        assert_eq!(error.action, "create a temporary file for");
        assert_eq!(error.source.kind(), io::ErrorKind::NotFound);
        let error = write_atomic(Path::new("/"), b"x", 0o600).expect_err("no file name");
        assert_eq!(error.source.kind(), io::ErrorKind::InvalidInput);
    }

    #[cfg(unix)]
    #[test]
    fn a_write_without_fsync_is_still_a_whole_replacement() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("status.json");
        for (content, mode) in [(&b"{\"state\":\"idle\"}"[..], 0o644), (b"{}", 0o600)] {
            let mut prepared = false;
            write_atomic_as(&path, content, mode, Durability::ProcessCrash, |file, _| {
                prepared = file.metadata()?.len() == 0;
                Ok(())
            })
            .expect("write");
            assert!(prepared, "prepare ran on the empty temporary file");
            assert_eq!(std::fs::read(&path).expect("read"), content);
            let meta = std::fs::metadata(&path).expect("stat");
            assert_eq!(meta.permissions().mode() & 0o7777, mode);
        }
        assert_eq!(names(dir.path()), ["status.json"]);
        let target = dir.path().join("taken");
        std::fs::create_dir(&target).expect("mkdir");
        let error = write_atomic_as(
            &target,
            b"x",
            0o644,
            Durability::ProcessCrash,
            |_, _| Ok(()),
        )
        .expect_err("a directory is in the way");
        assert_eq!(error.action, "rename a temporary file over");
        assert_eq!(names(dir.path()), ["status.json", "taken"]);
    }

    #[test]
    fn a_bare_file_name_is_in_the_current_directory() {
        assert_eq!(directory_of(Path::new("state.json")), Path::new("."));
        assert_eq!(directory_of(Path::new("a/state.json")), Path::new("a"));
        sync_parent(Path::new("state.json")).expect("the current directory syncs");
    }
}
