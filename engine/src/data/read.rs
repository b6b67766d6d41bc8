//! Reading data files as streams, transparently gunzipping, under the
//! byte bound of [`DataBounds`]: the one place a loader's bytes come from,
//! so no loader can decompress past the bound or buffer a whole file.

use std::io::{BufRead, BufReader, ErrorKind, Read, Take};
use std::path::{Path, PathBuf};

use flate2::bufread::MultiGzDecoder;

use super::data_err;
use super::limits::{DataBounds, OverBound};
use crate::error::{EngineError, EngineResult};

/// The two bytes every gzip stream starts with (RFC 1952).
const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// Bytes read at a time from a file's stream.
pub(crate) const CHUNK_BYTES: usize = 64 << 10;

/// One file of a dataset, read through: its bytes (gunzipped when it
/// starts with the gzip magic: the name is not trusted, `.gz` files are
/// sometimes stored decompressed), at most `allowed` of them. The stream
/// is cut one byte past `allowed`, so a gzip bomb decompresses no further.
pub(crate) struct DataFile {
    path: PathBuf,
    reader: BufReader<Take<Box<dyn Read>>>,
    allowed: u64,
    /// The dataset's whole byte bound, for the error.
    limit: u64,
    gzipped: bool,
}

impl DataFile {
    /// Opens the first (or only) file of a dataset, with the whole of
    /// `bounds.max_bytes` allowed.
    pub(crate) fn open(path: &Path, bounds: &DataBounds) -> EngineResult<DataFile> {
        DataFile::open_within(path, bounds.max_bytes, bounds.max_bytes)
    }

    /// Opens the next file of the same dataset (the labels after the
    /// images): the files of one dataset share its byte bound, so this one
    /// may yield what this file left of it.
    pub(crate) fn open_next(&self, path: &Path) -> EngineResult<DataFile> {
        let left = self.allowed.saturating_sub(self.consumed());
        DataFile::open_within(path, left, self.limit)
    }

    /// Opens `path` with `allowed` bytes left of the dataset's `limit`.
    fn open_within(path: &Path, allowed: u64, limit: u64) -> EngineResult<DataFile> {
        // A regular file only (`canopy_files`' rule): a directory would
        // fail only at the first read, with a cause no one looks for.
        let (file, _) =
            canopy_files::open_regular(path).map_err(|e| data_err(path, e.cause.to_string()))?;
        let mut buffered = BufReader::new(file);
        let head = buffered
            .fill_buf()
            .map_err(|e| data_err(path, format!("cannot read: {e}")))?;
        let gzipped = head.starts_with(&GZIP_MAGIC);
        let stream: Box<dyn Read> = if gzipped {
            Box::new(MultiGzDecoder::new(buffered))
        } else {
            Box::new(buffered)
        };
        Ok(DataFile {
            path: path.to_path_buf(),
            reader: BufReader::with_capacity(CHUNK_BYTES, stream.take(allowed.saturating_add(1))),
            allowed,
            limit,
            gzipped,
        })
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes taken from the stream so far (read ahead included).
    pub(crate) fn consumed(&self) -> u64 {
        self.allowed.saturating_add(1) - self.reader.get_ref().limit()
    }

    /// The error for going past the byte bound.
    pub(crate) fn over_bytes(&self) -> EngineError {
        self.over(OverBound::Bytes { limit: self.limit })
    }

    pub(crate) fn over(&self, over: OverBound) -> EngineError {
        EngineError::OverBound {
            path: self.path.display().to_string(),
            over,
        }
    }

    /// Refuses a header that declares `bytes` more bytes than the file
    /// may still yield, before anything is read or allocated for them.
    pub(crate) fn check_declared(&self, bytes: u64) -> EngineResult<()> {
        let left = self.allowed.saturating_sub(self.consumed_by_caller());
        if bytes > left {
            return Err(self.over_bytes());
        }
        Ok(())
    }

    /// Bytes handed to the caller so far (read ahead excluded).
    fn consumed_by_caller(&self) -> u64 {
        self.consumed() - self.reader.buffer().len() as u64
    }

    fn checked<T>(&self, result: std::io::Result<T>) -> EngineResult<T> {
        if self.reader.get_ref().limit() == 0 {
            return Err(self.over_bytes());
        }
        result.map_err(|e| {
            let what = if self.gzipped {
                "gzip stream is corrupt"
            } else {
                "cannot read"
            };
            data_err(&self.path, format!("{what}: {e}"))
        })
    }

    /// Fills `buf` unless the stream ends first; the bytes read.
    pub(crate) fn fill(&mut self, buf: &mut [u8]) -> EngineResult<usize> {
        let mut filled = 0;
        while filled < buf.len() {
            let read = match self.reader.read(&mut buf[filled..]) {
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                other => other,
            };
            match self.checked(read)? {
                0 => break,
                n => filled += n,
            }
        }
        Ok(filled)
    }

    /// Reads the rest of the stream (bounded) and says how many bytes it held.
    pub(crate) fn rest_len(&mut self) -> EngineResult<u64> {
        let copied = std::io::copy(&mut self.reader, &mut std::io::sink());
        self.checked(copied)
    }

    /// The next line, without its `\n` (nor a `\r` before it), into `line`;
    /// false at the end of the stream. A line longer than `max_bytes` is
    /// refused once that many bytes are read.
    pub(crate) fn read_line(&mut self, line: &mut Vec<u8>, max_bytes: usize) -> EngineResult<bool> {
        line.clear();
        let cap = max_bytes as u64 + 1;
        let read = (&mut self.reader).take(cap).read_until(b'\n', line);
        if self.checked(read)? == 0 {
            return Ok(false);
        }
        if line.len() > max_bytes {
            let cause = format!("a line is longer than {max_bytes} bytes, the limit");
            return Err(data_err(&self.path, cause));
        }
        if line.last() == Some(&b'\n') {
            line.pop();
            if line.last() == Some(&b'\r') {
                line.pop();
            }
        }
        Ok(true)
    }

    /// Reads `len` bytes of data in chunks, handing each to `take`: so a
    /// file's data is converted as it arrives, never held whole. Says
    /// how many arrived, less than `len` when the file is cut short.
    pub(crate) fn read_data(
        &mut self,
        len: u64,
        mut take: impl FnMut(&[u8]) -> EngineResult<()>,
    ) -> EngineResult<u64> {
        let mut chunk = vec![0u8; CHUNK_BYTES];
        let mut done = 0u64;
        while done < len {
            let want = (len - done).min(CHUNK_BYTES as u64) as usize;
            let got = self.fill(&mut chunk[..want])?;
            take(&chunk[..got])?;
            done += got as u64;
            if got < want {
                break;
            }
        }
        Ok(done)
    }

    /// Reads exactly the `len` bytes of data a header claims for `shape`,
    /// handing them to `take` as [`read_data`](Self::read_data) does; a
    /// file cut short, or with bytes after them, is refused by name.
    pub(crate) fn read_claimed_data(
        &mut self,
        len: u64,
        shape: &[usize],
        take: impl FnMut(&[u8]) -> EngineResult<()>,
    ) -> EngineResult<()> {
        let actual = self.read_data(len, take)?;
        let trailing = if actual == len { self.rest_len()? } else { 0 };
        if actual == len && trailing == 0 {
            return Ok(());
        }
        let what = if actual < len {
            "truncated"
        } else {
            "has trailing bytes"
        };
        let found = actual + trailing;
        Err(data_err(
            &self.path,
            format!(
                "file {what}: header claims shape {shape:?} = {len} bytes of data, found {found}"
            ),
        ))
    }
}

/// Multiplies dimensions with overflow and limit checks, so a header's
/// claimed sizes can be compared with reality before any allocation.
pub(crate) fn checked_product(dims: &[usize], limit: usize) -> Option<usize> {
    dims.iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .filter(|&n| n <= limit)
}
