//! Content-addressed blob store for model files, on `object_store`.
//!
//! A blob's key is `sha256/AB/ABCDEF…`, from the model's content digest, so writing the
//! same model twice stores it once and a crash between writing a blob and
//! committing the row that names it leaves only an orphan, never a torn
//! file. Local disk by default; an `s3://`, `gs://` or `az://` URL selects a
//! cloud store when the server is built with the `cloud-blobs` feature.

use std::ops::Range;
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
        std::fs::create_dir_all(dir).map_err(|error| BlobError::Open {
            location: dir.to_string(),
            source: object_store::Error::Generic {
                store: "local",
                source: Box::new(error),
            },
        })?;
        let store = LocalFileSystem::new_with_prefix(dir).map_err(|source| BlobError::Open {
            location: dir.to_string(),
            source,
        })?;
        Ok(BlobStore {
            store: Arc::new(store),
            prefix: StorePath::default(),
            location: dir.to_string(),
        })
    }

    fn key(&self, digest: &str) -> StorePath {
        let shard = digest.get(..2).unwrap_or("00");
        let relative = format!("sha256/{shard}/{digest}");
        if self.prefix.as_ref().is_empty() {
            StorePath::from(relative)
        } else {
            StorePath::from(format!("{}/{relative}", self.prefix))
        }
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
        self.store
            .put(&key, PutPayload::from_bytes(bytes))
            .await
            .map_err(|source| BlobError::Io {
                digest: digest.to_string(),
                source,
            })?;
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
