//! Bounded reads of local files: the one rule by which every Canopy crate
//! reads a file it was pointed at (the CLI's models, keys and inputs, the
//! SDK's key store, checkpoints and downloads, the agent's and the app
//! library's state files, the engine's data files).
//!
//! The rule, and why each part:
//!
//! - **Open once, check the opened file.** The checks use the open
//!   handle's metadata, so a file swapped in between a check and the read
//!   cannot slip past them.
//! - **Regular files only.** A directory opens on Unix and fails only at
//!   the read, with a message that names no cause a user would look for;
//!   a device (`/dev/zero`) never ends.
//! - **The size before the read.** A file over the limit is refused before
//!   a byte is read or allocated (a sparse file of the limit costs
//!   nothing to make).
//! - **One byte past the limit, at most.** A file may grow after the size
//!   check (a log, a download in progress): the read stops one byte past
//!   the limit, and that byte refuses the file, so the limit holds even
//!   then.
//!
//! A crate of its own, at the bottom of the crate graph (it depends on
//! nothing of Canopy's), so that the engine, the SDK, the app library and
//! the binaries can all use it; the server does not need the SDK for it.

use std::fs::{File, Metadata};
use std::io::{self, Read, Take};
use std::path::{Path, PathBuf};

/// A file that could not be read, and why.
#[derive(Debug, thiserror::Error)]
#[error("cannot read `{}`", path.display())]
pub struct ReadError {
    pub path: PathBuf,
    /// What went wrong, without the file's name: for callers that name
    /// the file in their own words ("cannot read model file `m.canopy`").
    #[source]
    pub cause: ReadFailure,
}

/// Why a bounded read failed. An I/O error is part of the message rather
/// than a source, so that the cause reads as one line under the caller's
/// own context; [`ReadFailure::io_error`] still gives it.
#[derive(Debug, thiserror::Error)]
pub enum ReadFailure {
    #[error("cannot open it: {0}")]
    Open(io::Error),
    #[error("cannot inspect it: {0}")]
    Inspect(io::Error),
    #[error("it is a directory")]
    Directory,
    /// A FIFO, a socket, a device.
    #[error("it is not a regular file")]
    NotAFile,
    #[error("it is {size} bytes, over the limit of {limit}")]
    TooLarge { size: u64, limit: u64 },
    #[error("it grew past the limit of {limit} bytes while it was read")]
    Grew { limit: u64 },
    #[error("the read failed: {0}")]
    Read(io::Error),
}

impl ReadFailure {
    /// The I/O error behind an open, inspect or read failure.
    pub fn io_error(&self) -> Option<&io::Error> {
        match self {
            ReadFailure::Open(error) | ReadFailure::Inspect(error) | ReadFailure::Read(error) => {
                Some(error)
            }
            _ => None,
        }
    }
}

impl ReadError {
    /// Whether the file does not exist: for callers to which a missing file
    /// is an answer ("not enrolled yet", "no checkpoint").
    pub fn is_not_found(&self) -> bool {
        matches!(&self.cause, ReadFailure::Open(error) if error.kind() == io::ErrorKind::NotFound)
    }
}

/// A regular file of at most `limit` bytes, opened for reading.
#[derive(Debug)]
pub struct BoundedFile {
    path: PathBuf,
    file: File,
    metadata: Metadata,
    limit: u64,
}

impl BoundedFile {
    /// Opens `path`, refusing anything but a regular file, and a file over
    /// `limit` bytes, before anything is read.
    pub fn open(path: &Path, limit: u64) -> Result<BoundedFile, ReadError> {
        let (file, metadata) = open_regular(path)?;
        if metadata.len() > limit {
            return Err(failed(
                path,
                ReadFailure::TooLarge {
                    size: metadata.len(),
                    limit,
                },
            ));
        }
        Ok(BoundedFile {
            path: path.to_path_buf(),
            file,
            metadata,
            limit,
        })
    }

    /// The opened file's metadata (its mode, for the key store).
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// The whole file; refused when it grew past the limit since it was
    /// opened.
    pub fn read_to_end(self) -> Result<Vec<u8>, ReadError> {
        let (path, limit) = (self.path.clone(), self.limit);
        // The size seen at open, as a hint only: the file may have changed.
        let expected = usize::try_from(self.metadata.len()).unwrap_or(0);
        let mut bytes = Vec::with_capacity(expected);
        self.into_reader()
            .read_to_end(&mut bytes)
            .map_err(|error| failed(&path, ReadFailure::Read(error)))?;
        if bytes.len() as u64 > limit {
            return Err(failed(&path, ReadFailure::Grew { limit }));
        }
        Ok(bytes)
    }

    /// The file as a stream cut one byte past the limit: a reader that gets
    /// more than `limit` bytes knows the file grew, and reads no further.
    pub fn into_reader(self) -> Take<File> {
        self.file.take(self.limit.saturating_add(1))
    }
}

/// The bytes of the regular file `path`, at most `limit` of them (see the
/// crate's doc for the rule).
pub fn read_bounded(path: &Path, limit: u64) -> Result<Vec<u8>, ReadError> {
    BoundedFile::open(path, limit)?.read_to_end()
}

/// [`read_bounded`], with `None` for a file that does not exist.
pub fn read_bounded_if_present(path: &Path, limit: u64) -> Result<Option<Vec<u8>>, ReadError> {
    match read_bounded(path, limit) {
        Err(error) if error.is_not_found() => Ok(None),
        read => read.map(Some),
    }
}

/// Opens `path` for reading, refusing anything but a regular file; the
/// check is on the opened file. For readers that bound what they take
/// from the file themselves (the engine's data files, bounded after
/// decompression).
pub fn open_regular(path: &Path) -> Result<(File, Metadata), ReadError> {
    let file = File::open(path).map_err(|error| failed(path, ReadFailure::Open(error)))?;
    let metadata = file
        .metadata()
        .map_err(|error| failed(path, ReadFailure::Inspect(error)))?;
    if metadata.is_dir() {
        return Err(failed(path, ReadFailure::Directory));
    }
    if !metadata.is_file() {
        return Err(failed(path, ReadFailure::NotAFile));
    }
    Ok((file, metadata))
}

fn failed(path: &Path, cause: ReadFailure) -> ReadError {
    ReadError {
        path: path.to_path_buf(),
        cause,
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    fn file_of(dir: &Path, name: &str, len: usize) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, vec![b'x'; len]).expect("write");
        path
    }

    #[test]
    fn a_file_at_the_limit_is_read_whole() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = file_of(dir.path(), "at", 100);
        assert_eq!(read_bounded(&path, 100).expect("read").len(), 100);
        assert_eq!(read_bounded(&path, 1000).expect("read").len(), 100);
    }

    #[test]
    fn a_file_over_the_limit_is_refused_naming_file_size_and_limit() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = file_of(dir.path(), "over", 100);
        let error = read_bounded(&path, 99).expect_err("over");
        assert!(matches!(
            error.cause,
            ReadFailure::TooLarge {
                size: 100,
                limit: 99
            }
        ));
        assert_eq!(
            error.to_string(),
            format!("cannot read `{}`", path.display())
        );
        assert_eq!(
            error.cause.to_string(),
            "it is 100 bytes, over the limit of 99"
        );
    }

    #[test]
    fn a_directory_and_a_device_are_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let error = read_bounded(dir.path(), 10).expect_err("a directory");
        assert!(matches!(error.cause, ReadFailure::Directory), "{error:?}");
        #[cfg(unix)]
        {
            let error = read_bounded(Path::new("/dev/zero"), 10).expect_err("a device");
            assert!(matches!(error.cause, ReadFailure::NotAFile), "{error:?}");
        }
    }

    #[test]
    fn a_missing_file_is_none_only_where_absence_is_an_answer() {
        let dir = tempfile::tempdir().expect("tempdir");
        let missing = dir.path().join("missing");
        let error = read_bounded(&missing, 10).expect_err("missing");
        assert!(error.is_not_found());
        assert_eq!(
            error.cause.io_error().map(io::Error::kind),
            Some(io::ErrorKind::NotFound)
        );
        assert!(
            read_bounded_if_present(&missing, 10)
                .expect("absent")
                .is_none()
        );
        let present = file_of(dir.path(), "present", 3);
        assert_eq!(
            read_bounded_if_present(&present, 10).expect("read"),
            Some(b"xxx".to_vec())
        );
    }

    #[test]
    fn a_file_that_grows_after_the_size_check_is_cut_and_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = file_of(dir.path(), "growing", 10);
        let opened = BoundedFile::open(&path, 10).expect("within the limit at open");
        let mut appender = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .expect("append");
        appender.write_all(&[b'y'; 1000]).expect("grow");
        drop(appender);
        let mut taken = Vec::new();
        BoundedFile::open(&path, 2000)
            .expect("reopen")
            .into_reader()
            .read_to_end(&mut taken)
            .expect("read");
        assert_eq!(taken.len(), 1010, "the file did grow");
        let error = opened.read_to_end().expect_err("grew");
        assert!(
            matches!(error.cause, ReadFailure::Grew { limit: 10 }),
            "{error:?}"
        );
        let mut cut = Vec::new();
        let mut reader = BoundedFile::open(&path, 1010).expect("open").into_reader();
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .and_then(|mut file| file.write_all(&[b'z'; 50]))
            .expect("grow again");
        reader.read_to_end(&mut cut).expect("read");
        assert_eq!(cut.len(), 1011, "one byte past the limit, no further");
    }
}
