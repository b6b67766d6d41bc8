//! Content-addressed blob store for model files, on `object_store`.
//!
//! A blob's key is `sha256/AB/ABCDEF…`, from the model's content digest, so writing the
//! same model twice stores it once and a crash between writing a blob and
//! committing the row that names it leaves only an orphan, never a torn
//! file. Local disk by default; an `s3://`, `gs://` or `az://` URL selects a
//! cloud store when the server is built with the `cloud-blobs` feature.
//!
//! On local disk the blobs are the server's private files (`file_modes`):
//! the directories 0700 and the files 0600, whatever the umask. Each blob
//! is written here rather than by `object_store`, which creates files
//! and directories by the umask: to a temporary file made 0600, synced,
//! then renamed into place.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use futures_util::StreamExt;
use futures_util::stream::BoxStream;
use object_store::local::LocalFileSystem;
use object_store::path::Path as StorePath;
use object_store::{GetOptions, GetRange, ObjectStore, ObjectStoreExt, PutPayload};

#[derive(Debug, thiserror::Error)]
pub enum BlobError {
    #[error("cannot open the blob store at {location}")]
    Open {
        location: String,
        #[source]
        source: object_store::Error,
    },
    #[error("blob store URL `{url}` is not supported: {reason}")]
    UnsupportedUrl { url: String, reason: String },
    #[error("blob {digest} is missing from the blob store")]
    Missing { digest: String },
    #[error("blob store operation on {digest} failed")]
    Io {
        digest: String,
        #[source]
        source: object_store::Error,
    },
    #[error("blob {digest} is {size} bytes, over the {limit}-byte limit")]
    TooLarge {
        digest: String,
        size: u64,
        limit: u64,
    },
}

#[derive(Clone)]
pub struct BlobStore {
    store: Arc<dyn ObjectStore>,
    prefix: StorePath,
    pub location: String,
    /// The directory of a local store, whose blobs this module writes.
    local_root: Option<PathBuf>,
}

/// A blob's bytes, streamed, with its total size and the byte range sent.
pub struct BlobStream {
    pub size: u64,
    pub range: Range<u64>,
    pub stream: BoxStream<'static, Result<Bytes, object_store::Error>>,
}

impl BlobStore {
    /// Opens a local directory (created if missing) or, with the
    /// `cloud-blobs` feature, a cloud URL.
    pub fn open(location: &str) -> Result<BlobStore, BlobError> {
        if location.contains("://") && !location.starts_with("file://") {
            return open_url(location);
        }
        let dir = location.trim_start_matches("file://");
        open_private_dir(Path::new(dir)).map_err(|error| BlobError::Open {
            location: dir.to_string(),
            source: local_error(error),
        })?;
        let store = LocalFileSystem::new_with_prefix(dir).map_err(|source| BlobError::Open {
            location: dir.to_string(),
            source,
        })?;
        Ok(BlobStore {
            store: Arc::new(store),
            prefix: StorePath::default(),
            location: dir.to_string(),
            local_root: Some(PathBuf::from(dir)),
        })
    }

    fn key(&self, digest: &str) -> StorePath {
        let shard = digest.get(..2).unwrap_or("00");
        self.prefixed(format!("sha256/{shard}/{digest}"))
    }

    /// Stores `bytes` under `digest` unless a blob is already there.
    pub async fn put(&self, digest: &str, bytes: Bytes) -> Result<(), BlobError> {
        let key = self.key(digest);
        match self.store.head(&key).await {
            Ok(_) => return Ok(()),
            Err(object_store::Error::NotFound { .. }) => {}
            Err(source) => {
                return Err(BlobError::Io {
                    digest: digest.to_string(),
                    source,
                });
            }
        }
        self.write(key, digest, bytes).await
    }

    /// Writes `bytes` at `key`: on local disk as a private file, whole or
    /// not at all.
    async fn write(&self, key: StorePath, digest: &str, bytes: Bytes) -> Result<(), BlobError> {
        let io = |source| BlobError::Io {
            digest: digest.to_string(),
            source,
        };
        if let Some(root) = &self.local_root {
            let path = root.join(key.as_ref());
            return tokio::task::spawn_blocking(move || write_private(&path, &bytes))
                .await
                .map_err(|error| io(local_error(std::io::Error::other(error))))?
                .map_err(|error| io(local_error(error)));
        }
        self.store
            .put(&key, PutPayload::from_bytes(bytes))
            .await
            .map_err(io)?;
        Ok(())
    }

    /// Reads a whole blob into memory, refusing blobs over `limit_bytes`.
    /// Model blobs carry their own digest, which `canopy_ir::format`
    /// verifies when the caller parses them.
    pub async fn get(&self, digest: &str, limit_bytes: u64) -> Result<Bytes, BlobError> {
        let result = self
            .store
            .get(&self.key(digest))
            .await
            .map_err(|source| not_found_or_io(digest, source))?;
        let size = result.meta.size;
        if size > limit_bytes {
            return Err(BlobError::TooLarge {
                digest: digest.to_string(),
                size,
                limit: limit_bytes,
            });
        }
        result.bytes().await.map_err(|source| BlobError::Io {
            digest: digest.to_string(),
            source,
        })
    }

    /// Where a robust round keeps one device's update: under the round, so
    /// that the round's updates are deleted together, and named by the
    /// update's digest too, so that a second upload from the device (which
    /// the round refuses) never replaces the one it accepted.
    fn update_key(&self, round_id: i64, device_id: i64, digest: &str) -> StorePath {
        self.prefixed(format!(
            "{}/{device_id}-{digest}",
            Self::round_dir(round_id)
        ))
    }

    fn round_dir(round_id: i64) -> String {
        format!("updates/{round_id}")
    }

    fn prefixed(&self, relative: String) -> StorePath {
        if self.prefix.as_ref().is_empty() {
            StorePath::from(relative)
        } else {
            StorePath::from(format!("{}/{relative}", self.prefix))
        }
    }

    /// Stores a robust round's update (written and synced before it is
    /// recorded, like a model blob).
    pub async fn put_update(
        &self,
        round_id: i64,
        device_id: i64,
        digest: &str,
        bytes: Bytes,
    ) -> Result<(), BlobError> {
        let key = self.update_key(round_id, device_id, digest);
        self.write(key, digest, bytes).await
    }

    /// `range` of the bytes of a robust round's stored update.
    pub async fn read_update(
        &self,
        round_id: i64,
        device_id: i64,
        digest: &str,
        range: Range<u64>,
    ) -> Result<Bytes, BlobError> {
        let options = GetOptions {
            range: Some(GetRange::Bounded(range)),
            ..GetOptions::default()
        };
        let key = self.update_key(round_id, device_id, digest);
        let result = self
            .store
            .get_opts(&key, options)
            .await
            .map_err(|source| not_found_or_io(digest, source))?;
        result.bytes().await.map_err(|source| BlobError::Io {
            digest: digest.to_string(),
            source,
        })
    }

    /// Deletes every update stored for a round, accepted or not; how many.
    pub async fn delete_round_updates(&self, round_id: i64) -> Result<usize, BlobError> {
        let dir = Self::round_dir(round_id);
        let io = |source| BlobError::Io {
            digest: dir.clone(),
            source,
        };
        if let Some(root) = &self.local_root {
            // The round's directory goes too, not only its files.
            let path = root.join(&dir);
            let removed = tokio::task::spawn_blocking(move || remove_dir(&path)).await;
            return removed
                .map_err(|error| io(local_error(std::io::Error::other(error))))?
                .map_err(|error| io(local_error(error)));
        }
        let prefix = self.prefixed(dir.clone());
        let listed: Vec<_> = self.store.list(Some(&prefix)).collect().await;
        let mut deleted = 0;
        for meta in listed {
            match self.store.delete(&meta.map_err(io)?.location).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => deleted += 1,
                Err(source) => return Err(io(source)),
            }
        }
        Ok(deleted)
    }

    /// Streams a blob, from `offset` to its end.
    pub async fn stream(&self, digest: &str, offset: u64) -> Result<BlobStream, BlobError> {
        let options = GetOptions {
            range: (offset > 0).then_some(GetRange::Offset(offset)),
            ..GetOptions::default()
        };
        let result = self
            .store
            .get_opts(&self.key(digest), options)
            .await
            .map_err(|source| not_found_or_io(digest, source))?;
        let size = result.meta.size;
        let range = result.range.clone();
        Ok(BlobStream {
            size,
            range,
            stream: result.into_stream().boxed(),
        })
    }
}

fn local_error(error: std::io::Error) -> object_store::Error {
    object_store::Error::Generic {
        store: "local",
        source: Box::new(error),
    }
}

/// Creates the store's directory private, or makes an existing one
/// private: one created by an earlier version followed the umask (0755,
/// usually), but sat in the private data directory unless placed
/// elsewhere, so it is tightened with a warning rather than refused.
fn open_private_dir(dir: &Path) -> std::io::Result<()> {
    crate::file_modes::create_private_dir_all(dir)?;
    let meta = std::fs::metadata(dir)?;
    if let Some(mode) = crate::file_modes::open_to_others(&meta) {
        tracing::warn!(
            path = %dir.display(),
            mode = format!("{mode:04o}"),
            "the blob store could be read by other users; made it 0700"
        );
        crate::file_modes::make_private(dir)?;
    }
    Ok(())
}

/// `create_dir_all` with every directory it creates 0700.
/// Writes a blob as a private file: a temporary file beside it, created
/// 0600 (the umask can only take bits away), synced, renamed into place,
/// so that a reader sees no blob or the whole one.
fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let parent = path
        .parent()
        .ok_or_else(|| std::io::Error::other("a blob path has a directory"))?;
    crate::file_modes::create_private_dir_all(parent)?;
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let unique = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".{}.{unique}.tmp", std::process::id()));
    let temporary = parent.join(name);
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(crate::file_modes::PRIVATE_FILE_MODE);
    }
    let written = options.open(&temporary).and_then(|mut file| {
        file.write_all(bytes)?;
        file.sync_all()
    });
    match written.and_then(|()| std::fs::rename(&temporary, path)) {
        Ok(()) => Ok(()),
        Err(error) => {
            let _ = std::fs::remove_file(&temporary);
            Err(error)
        }
    }
}

/// Removes a directory of blobs and what it holds; how many files.
fn remove_dir(path: &Path) -> std::io::Result<usize> {
    let files = match std::fs::read_dir(path) {
        Ok(entries) => entries.count(),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(error) => return Err(error),
    };
    std::fs::remove_dir_all(path)?;
    Ok(files)
}

fn not_found_or_io(digest: &str, source: object_store::Error) -> BlobError {
    match source {
        object_store::Error::NotFound { .. } => BlobError::Missing {
            digest: digest.to_string(),
        },
        source => BlobError::Io {
            digest: digest.to_string(),
            source,
        },
    }
}

#[cfg(feature = "cloud-blobs")]
fn open_url(location: &str) -> Result<BlobStore, BlobError> {
    let url = url::Url::parse(location).map_err(|error| BlobError::UnsupportedUrl {
        url: location.to_string(),
        reason: error.to_string(),
    })?;
    let (store, prefix) = object_store::parse_url(&url).map_err(|source| BlobError::Open {
        location: location.to_string(),
        source,
    })?;
    Ok(BlobStore {
        store: Arc::from(store),
        prefix,
        location: location.to_string(),
        local_root: None,
    })
}

#[cfg(not(feature = "cloud-blobs"))]
fn open_url(location: &str) -> Result<BlobStore, BlobError> {
    Err(BlobError::UnsupportedUrl {
        url: location.to_string(),
        reason: "this build has local blob storage only; rebuild canopy-server with \
                 `--features cloud-blobs` for S3, GCS and Azure"
            .to_string(),
    })
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn mode(path: &Path) -> u32 {
        std::fs::metadata(path).expect("meta").permissions().mode() & 0o777
    }

    /// A store directory an earlier version left 0755 is made 0700, and a
    /// blob is written 0600 in 0700 directories, then read back whole.
    #[tokio::test]
    async fn local_blobs_are_private_and_whole() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().join("blobs");
        std::fs::create_dir(&root).expect("mkdir");
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let store = BlobStore::open(root.to_str().expect("utf-8")).expect("open");
        assert_eq!(mode(&root), 0o700);
        let digest = "ab".repeat(32);
        let bytes = Bytes::from(vec![7u8; 100_000]);
        store.put(&digest, bytes.clone()).await.expect("put");
        store.put(&digest, bytes.clone()).await.expect("put again");
        let file = root.join("sha256").join("ab").join(&digest);
        assert_eq!(mode(&file), 0o600);
        assert_eq!(mode(&root.join("sha256")), 0o700);
        assert_eq!(mode(&root.join("sha256/ab")), 0o700);
        assert_eq!(store.get(&digest, 1 << 20).await.expect("get"), bytes);
        let entries = std::fs::read_dir(root.join("sha256/ab"))
            .expect("dir")
            .count();
        assert_eq!(entries, 1, "a temporary file was left behind");
    }
}
