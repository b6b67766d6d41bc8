//! Model downloads: resumable transfers (`Range: bytes=N-`) into memory or
//! a part file, each checked against the server's signature over the
//! model's digest, under the device's trusted keys, and against the
//! content itself once whole. A task is checked against the shared bounds
//! before the first byte is asked for.

use std::fs::{File, OpenOptions};
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use bytes::Bytes;
use canopy_protocol::messages::Task;
use canopy_protocol::model_sig::{
    self, HEADER_MODEL_DELEGATION, HEADER_MODEL_DIGEST, HEADER_MODEL_KEY, HEADER_MODEL_SIGNATURE,
    KeyTrustError, ModelDelegation, SigningKeys, TrustedKeys,
};
use reqwest::{Method, StatusCode};

use super::DeviceClient;
use crate::error::{SdkError, error_chain};
use crate::retry::MAX_DOWNLOAD_REQUESTS;
use crate::transport::{LimitedBody, check, now_ms, read_limited};

/// Largest model a device downloads: the bound every tier shares.
pub use canopy_protocol::bounds::MAX_MODEL_BYTES;

/// Largest answer to `GET /device/v1/signing-keys`: a full chain of
/// [`model_sig::MAX_KEY_CHAIN_LEN`] endorsements is about 5 KiB.
pub const MAX_SIGNING_KEYS_BYTES: usize = 64 << 10;

/// A verified model file.
#[derive(Clone, Debug)]
pub struct DownloadedModel {
    pub version_id: i64,
    pub digest: String,
    pub bytes: Bytes,
    /// The server's signature over `digest`, as verified, and the key (hex)
    /// that made it: what an edge aggregator relays to its own devices.
    pub signature_hex: String,
    pub signer_key_hex: String,
}

/// A digest whose signature verified, with the signature and its key.
struct Verified {
    digest: String,
    signature_hex: String,
    signer_key_hex: String,
}

impl DeviceClient {
    /// The server's current model-signing key and the endorsements that
    /// lead to it.
    pub async fn signing_keys(&self) -> Result<SigningKeys, SdkError> {
        let path = "/device/v1/signing-keys";
        let mut response = check(self.signed(Method::GET, path, Bytes::new()).await?).await?;
        let bad = |reason: String| SdkError::BadResponse {
            what: "signing keys",
            reason,
        };
        let body = match read_limited(&mut response, MAX_SIGNING_KEYS_BYTES).await {
            Ok(LimitedBody::Complete(body)) => body,
            Ok(LimitedBody::TooLong { .. }) => {
                return Err(bad(format!(
                    "the answer is over the {MAX_SIGNING_KEYS_BYTES}-byte limit"
                )));
            }
            Err(source) => {
                return Err(SdkError::Transport {
                    url: self.transport.url(path),
                    source,
                });
            }
        };
        serde_json::from_slice(&body).map_err(|error| bad(error.to_string()))
    }

    /// Checks a download's signature under the trusted keys. A signer the
    /// device does not trust yet is looked up in the server's endorsement
    /// chain; the trust moves to it only if the chain leads there from the
    /// trusted key and the signature then verifies. With a delegation (an
    /// edge's own version), the delegating key is the one that must be
    /// trusted, and the delegation must name the signer and be current.
    async fn verify_model_signature(
        &self,
        version_id: i64,
        signer_hex: Option<&str>,
        digest: &str,
        signature: &str,
        delegation: Option<&str>,
    ) -> Result<(), SdkError> {
        let fail = |error: KeyTrustError| SdkError::ModelVerification {
            version_id,
            reason: error_chain(&error),
        };
        let trust = self.trusted_keys();
        let signer = match signer_hex {
            Some(hex) => model_sig::parse_key_hex(hex).map_err(fail)?,
            // A server from before key rotation names no signer: it signs
            // with the key the device enrolled under.
            None => trust.current(),
        };
        let now = now_ms();
        // An edge's own version: the key that must be trusted is the one
        // that delegated, and the signer is its delegate.
        let delegation = match delegation {
            Some(header) => Some(ModelDelegation::from_header(header).map_err(fail)?),
            None => None,
        };
        let verify = |trust: &TrustedKeys| match &delegation {
            Some(delegation) => {
                trust.verify_delegated_model(delegation, &signer, digest, signature, now)
            }
            None => trust.verify_model(&signer, digest, signature, now),
        };
        match verify(&trust) {
            Err(KeyTrustError::UnknownSigner { .. }) => {}
            verified => return verified.map_err(fail),
        }
        let trusted_signer = match &delegation {
            Some(delegation) => delegation.verify().map_err(fail)?.0,
            None => signer,
        };
        let chain = self.signing_keys().await?;
        let advanced = trust
            .advance(&trusted_signer, &chain.endorsements)
            .map_err(fail)?;
        verify(&advanced).map_err(fail)?;
        self.advance_trust(trust, advanced);
        Ok(())
    }

    /// Downloads a task's model and checks, in order: that the task is
    /// within the shared bounds ([`SdkError::InvalidTask`] before any
    /// request), that the server's signature covers the digest the task
    /// named, and that the file's content matches that digest.
    ///
    /// A transfer that breaks resumes with `Range: bytes=N-` under the
    /// client's retry policy (see [`crate::retry`]); the server must answer
    /// 206 with a `Content-Range` that starts at N and ends at the size it
    /// announced, and carry the same digest. The whole file is verified at
    /// the end as if it had come in one piece.
    pub async fn download_model(&self, task: &Task) -> Result<DownloadedModel, SdkError> {
        super::validate_task(task)?;
        let mut sink = MemorySink(Vec::new());
        let verified = self.fetch_model(task, &mut sink).await?;
        let bytes = Bytes::from(sink.0);
        verify_content(&bytes, &verified.digest).map_err(|reason| SdkError::ModelVerification {
            version_id: task.model_version_id,
            reason,
        })?;
        Ok(DownloadedModel {
            version_id: task.model_version_id,
            digest: verified.digest,
            bytes,
            signature_hex: verified.signature_hex,
            signer_key_hex: verified.signer_key_hex,
        })
    }

    /// [`DeviceClient::download_model`] that keeps the bytes received so
    /// far in `<path>.<digest prefix>.part`, so that a download cut off by
    /// a crash, a cancellation or exhausted retries goes on from there the
    /// next time, for the same model. Once complete and verified, the file
    /// is renamed to `path` (replacing it) and also returned in memory. A
    /// partial file whose bytes turn out not to match the signed digest is
    /// deleted, and the download starts over once.
    pub async fn download_model_to(
        &self,
        task: &Task,
        path: &Path,
    ) -> Result<DownloadedModel, SdkError> {
        super::validate_task(task)?;
        let part = part_path(path, &task.model_digest);
        let mut started_over = false;
        loop {
            let mut sink = FileSink::open(&part, task.model_size_bytes)?;
            let resumed_from_disk = sink.len > 0;
            let verified = self.fetch_model(task, &mut sink).await?;
            sink.finish()?;
            let bytes = read_file(&part, MAX_MODEL_BYTES)?;
            if let Err(reason) = verify_content(&bytes, &verified.digest) {
                let _ = std::fs::remove_file(&part);
                if resumed_from_disk && !started_over {
                    started_over = true;
                    continue;
                }
                return Err(SdkError::ModelVerification {
                    version_id: task.model_version_id,
                    reason,
                });
            }
            std::fs::rename(&part, path).map_err(local_file("rename the download to", path))?;
            crate::files::sync_parent(path).map_err(local_file("sync the directory of", path))?;
            return Ok(DownloadedModel {
                version_id: task.model_version_id,
                digest: verified.digest,
                bytes: Bytes::from(bytes),
                signature_hex: verified.signature_hex,
                signer_key_hex: verified.signer_key_hex,
            });
        }
    }

    /// Fetches the model into `sink`, resuming after breaks; returns the
    /// digest whose server signature was verified. The content is checked
    /// by the caller.
    async fn fetch_model(&self, task: &Task, sink: &mut dyn Sink) -> Result<Verified, SdkError> {
        let policy = self.retry.normalized();
        let (mut failures, mut requests) = (0u32, 0u32);
        let mut verified = None;
        loop {
            requests += 1;
            let before = sink.len();
            let attempt = self.fetch_attempt(task, sink, &mut verified);
            let error = match self.cancel.run(attempt).await {
                None => return Err(SdkError::Cancelled),
                Some(Ok(())) => {
                    return verified.ok_or_else(|| SdkError::BadResponse {
                        what: "model download",
                        reason: "no response carried the model's digest".to_string(),
                    });
                }
                Some(Err(error)) => error,
            };
            // An attempt that brought new bytes shows that the link works:
            // only attempts in a row without progress use up the policy.
            if sink.len() > before {
                failures = 0;
            }
            failures += 1;
            if !error.is_retryable()
                || failures >= policy.max_attempts
                || requests >= MAX_DOWNLOAD_REQUESTS
            {
                return Err(error);
            }
            self.wait_to_retry(&policy, failures, &error).await?;
        }
    }

    /// One request of a download: from `sink.len()` on, to the end.
    async fn fetch_attempt(
        &self,
        task: &Task,
        sink: &mut dyn Sink,
        verified: &mut Option<Verified>,
    ) -> Result<(), SdkError> {
        let version_id = task.model_version_id;
        let fail = |reason: String| SdkError::ModelVerification { version_id, reason };
        let bad = |reason: String| SdkError::BadResponse {
            what: "model download",
            reason,
        };
        let size = task.model_size_bytes;
        // A complete file on disk still needs the signed headers: fetch its
        // last byte again. Anything longer than the model is not this model.
        if sink.len() > size {
            sink.truncate(0)?;
        } else if size > 0 && sink.len() == size {
            sink.truncate(size - 1)?;
        }
        let offset = sink.len();
        let mut request = self.signed_request(Method::GET, &task.model_path, Bytes::new());
        if offset > 0 {
            request = request.header(reqwest::header::RANGE, format!("bytes={offset}-"));
        }
        let url = request.url().to_string();
        let response = request.send().await?;
        let mut response = check(response).await?;
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .and_then(|value| value.to_str().ok())
                .map(str::to_string)
        };
        let digest = header(HEADER_MODEL_DIGEST).ok_or_else(|| {
            fail(format!(
                "the response has no `{HEADER_MODEL_DIGEST}` header"
            ))
        })?;
        match verified.as_ref().map(|known| known.digest.as_str()) {
            Some(known) if known == digest => {}
            Some(known) => {
                return Err(fail(format!(
                    "the server sent digest {digest} after {known} for the same download"
                )));
            }
            None => {
                let signature = header(HEADER_MODEL_SIGNATURE).ok_or_else(|| {
                    fail(format!(
                        "the response has no `{HEADER_MODEL_SIGNATURE}` header"
                    ))
                })?;
                if digest != task.model_digest {
                    return Err(fail(format!(
                        "the server sent digest {digest}, the task named {}",
                        task.model_digest
                    )));
                }
                let signer = header(HEADER_MODEL_KEY);
                let delegation = header(HEADER_MODEL_DELEGATION);
                self.verify_model_signature(
                    version_id,
                    signer.as_deref(),
                    &digest,
                    &signature,
                    delegation.as_deref(),
                )
                .await?;
                let signer_key_hex =
                    signer.unwrap_or_else(|| hex::encode(self.trusted_keys().current()));
                *verified = Some(Verified {
                    digest,
                    signature_hex: signature,
                    signer_key_hex,
                });
            }
        }
        let total = match response.status() {
            StatusCode::PARTIAL_CONTENT if offset > 0 => {
                let range = header(reqwest::header::CONTENT_RANGE.as_str())
                    .ok_or_else(|| bad("a 206 answer has no Content-Range header".to_string()))?;
                let (start, end, total) = parse_content_range(&range)
                    .ok_or_else(|| bad(format!("Content-Range `{range}` is malformed")))?;
                if start != offset || end.checked_add(1) != Some(total) {
                    return Err(bad(format!(
                        "asked for bytes {offset}- and got Content-Range `{range}`"
                    )));
                }
                if let Some(length) = response.content_length() {
                    if length != total - offset {
                        return Err(bad(format!(
                            "Content-Length {length} does not match Content-Range `{range}`"
                        )));
                    }
                }
                total
            }
            StatusCode::PARTIAL_CONTENT => {
                return Err(bad(
                    "a 206 answer to a request for the whole file".to_string()
                ));
            }
            StatusCode::OK => {
                // The server ignored the range: take the whole file again.
                if offset > 0 {
                    sink.truncate(0)?;
                }
                response.content_length().unwrap_or(size)
            }
            status => return Err(bad(format!("unexpected status {status}"))),
        };
        if total > MAX_MODEL_BYTES {
            return Err(fail(format!(
                "it is {total} bytes, over the {MAX_MODEL_BYTES}-byte limit"
            )));
        }
        if size > 0 && total != size {
            return Err(fail(format!(
                "the server sends {total} bytes, the task announced {size}"
            )));
        }
        sink.reserve(total);
        while let Some(chunk) = response
            .chunk()
            .await
            .map_err(|source| SdkError::Transport {
                url: url.clone(),
                source,
            })?
        {
            if sink.len() + chunk.len() as u64 > total {
                return Err(fail(format!(
                    "the server sent more than the {total} bytes it announced"
                )));
            }
            sink.append(&chunk)?;
        }
        if sink.len() < total {
            return Err(SdkError::Incomplete {
                url,
                received: sink.len(),
                expected: total,
            });
        }
        Ok(())
    }
}

/// Parses `bytes START-END/TOTAL`.
pub(super) fn parse_content_range(value: &str) -> Option<(u64, u64, u64)> {
    let rest = value.trim().strip_prefix("bytes ")?;
    let (range, total) = rest.split_once('/')?;
    let (start, end) = range.split_once('-')?;
    let number = |text: &str| {
        let text = text.trim();
        if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        text.parse::<u64>().ok()
    };
    let (start, end, total) = (number(start)?, number(end)?, number(total)?);
    (start <= end && end < total).then_some((start, end, total))
}

/// Where downloaded bytes go.
trait Sink: Send {
    fn len(&self) -> u64;
    fn reserve(&mut self, _total: u64) {}
    fn append(&mut self, chunk: &[u8]) -> Result<(), SdkError>;
    fn truncate(&mut self, len: u64) -> Result<(), SdkError>;
}

struct MemorySink(Vec<u8>);

impl Sink for MemorySink {
    fn len(&self) -> u64 {
        self.0.len() as u64
    }

    fn reserve(&mut self, total: u64) {
        // Up to 64 MiB ahead; beyond that the vector grows as bytes come.
        let wanted = usize::try_from(total.min(64 << 20)).unwrap_or(0);
        self.0.reserve(wanted.saturating_sub(self.0.len()));
    }

    fn append(&mut self, chunk: &[u8]) -> Result<(), SdkError> {
        self.0.extend_from_slice(chunk);
        Ok(())
    }

    fn truncate(&mut self, len: u64) -> Result<(), SdkError> {
        self.0.truncate(usize::try_from(len).unwrap_or(usize::MAX));
        Ok(())
    }
}

fn local_file(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> SdkError {
    let path = path.to_path_buf();
    move |source| SdkError::LocalFile {
        action,
        path,
        source,
    }
}

/// `<path>.<first 16 hex digits of the digest>.part`, beside `path`.
pub(super) fn part_path(path: &Path, digest: &str) -> PathBuf {
    let prefix: String = digest
        .chars()
        .filter(char::is_ascii_hexdigit)
        .take(16)
        .collect();
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".{prefix}.part"));
    path.with_file_name(name)
}

/// A partial download on disk. Writes are plain blocking writes of one
/// network chunk each; they are short next to the network time.
struct FileSink {
    file: File,
    path: PathBuf,
    len: u64,
}

impl FileSink {
    fn open(path: &Path, size: u64) -> Result<FileSink, SdkError> {
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(local_file("open", path))?;
        let mut len = file.metadata().map_err(local_file("inspect", path))?.len();
        if len > size {
            file.set_len(0).map_err(local_file("truncate", path))?;
            len = 0;
        }
        file.seek(SeekFrom::Start(len))
            .map_err(local_file("seek in", path))?;
        Ok(FileSink {
            file,
            path: path.to_path_buf(),
            len,
        })
    }

    fn finish(&mut self) -> Result<(), SdkError> {
        self.file.sync_all().map_err(local_file("sync", &self.path))
    }
}

impl Sink for FileSink {
    fn len(&self) -> u64 {
        self.len
    }

    fn append(&mut self, chunk: &[u8]) -> Result<(), SdkError> {
        self.file
            .write_all(chunk)
            .map_err(local_file("write", &self.path))?;
        self.len += chunk.len() as u64;
        Ok(())
    }

    fn truncate(&mut self, len: u64) -> Result<(), SdkError> {
        self.file
            .set_len(len)
            .map_err(local_file("truncate", &self.path))?;
        self.file
            .seek(SeekFrom::Start(len))
            .map_err(local_file("seek in", &self.path))?;
        self.len = len;
        Ok(())
    }
}

/// Reads a whole file of at most `limit` bytes ([`canopy_files::read_bounded`]).
fn read_file(path: &Path, limit: u64) -> Result<Vec<u8>, SdkError> {
    canopy_files::read_bounded(path, limit)
        .map_err(|error| local_file("read", path)(std::io::Error::other(error.cause)))
}

/// Checks that a model file's stored digest is `digest` and that its
/// content hashes to it (a full read verifies every byte).
fn verify_content(bytes: &[u8], digest: &str) -> Result<(), String> {
    let stored = canopy_ir::format::digest(bytes).map_err(|error| error.to_string())?;
    let stored = canopy_ir::format::digest_hex(&stored);
    if stored != digest {
        return Err(format!(
            "the file's digest is {stored}, the signed one {digest}"
        ));
    }
    canopy_ir::format::read_model(bytes)
        .map(|_| ())
        .map_err(|error| format!("the file does not match its digest or is invalid: {error}"))
}
