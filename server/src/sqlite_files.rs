//! Checks of a SQLite database's files before SQLite opens them, for the
//! two failures SQLite itself reports badly or not at all:
//!
//! - a file that is not a database at all, which SQLite reports only when
//!   a query first touches it (as "file is not a database" on every pooled
//!   connection until the pool's acquire timeout);
//! - a damaged write-ahead log. On opening, SQLite replays the `-wal` file
//!   up to the first frame whose salts or checksum do not match and
//!   silently discards everything after it, committed transactions
//!   included (<https://www.sqlite.org/fileformat2.html#walformat>); and
//!   a log whose header is damaged it ignores whole, so that a database
//!   never checkpointed opens empty and `serve` would start it afresh;
//! - a file that starts like a database but whose header fields or first
//!   page no SQLite database has, which SQLite reports as "file is not a
//!   database" on every connection until the pool gives up.
//!
//! Everything here is a pure function of the files' bytes, so each rule is
//! unit-tested on bytes built by hand as well as on files SQLite wrote.

use std::io::Read;
use std::path::{Path, PathBuf};

/// Every SQLite 3 database file starts with these 16 bytes.
const SQLITE_MAGIC: &[u8; 16] = b"SQLite format 3\0";
/// WAL magic numbers: the low bit says in which byte order the checksum
/// reads 32-bit words (0: little-endian, 1: big-endian).
const WAL_MAGIC_LE: u32 = 0x377f_0682;
const WAL_MAGIC_BE: u32 = 0x377f_0683;
const WAL_FORMAT_VERSION: u32 = 3_007_000;
const WAL_HEADER_BYTES: usize = 32;
const WAL_FRAME_HEADER_BYTES: usize = 24;
/// The database header, and the first byte of page 1's b-tree header.
const DATABASE_HEADER_BYTES: usize = 100;
const DATABASE_HEAD_BYTES: usize = DATABASE_HEADER_BYTES + 1;
/// Page 1 is the root of the schema table: a table b-tree page, leaf or
/// interior.
const TABLE_LEAF_PAGE: u8 = 0x0d;
const TABLE_INTERIOR_PAGE: u8 = 0x05;

#[derive(Debug, thiserror::Error)]
pub enum SqliteFileError {
    #[error("cannot read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a SQLite database (its first bytes are not the SQLite header)")]
    NotADatabase { path: PathBuf },
    #[error("the SQLite database {path} is damaged: {reason}")]
    DamagedDatabaseHeader { path: PathBuf, reason: String },
    #[error(
        "the write-ahead log {path} is damaged at frame {frame}: SQLite would stop replaying \
         there and silently drop the {lost_frames} frame(s) after it, {lost_commits} of them \
         ending committed transactions"
    )]
    DamagedWal {
        path: PathBuf,
        /// 1-based, as SQLite counts frames.
        frame: u64,
        lost_frames: u64,
        lost_commits: u64,
    },
    #[error(
        "the write-ahead log {path} has a damaged header ({fault}): SQLite would ignore the \
         whole log and silently drop {lost}"
    )]
    DamagedWalHeader {
        path: PathBuf,
        fault: WalHeaderFault,
        lost: WalLoss,
    },
}

/// Why SQLite would ignore a write-ahead log's header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WalHeaderFault {
    Magic,
    Version,
    PageSize,
    Checksum,
}

impl std::fmt::Display for WalHeaderFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            WalHeaderFault::Magic => "its magic number is not SQLite's",
            WalHeaderFault::Version => "its format version is not 3007000",
            WalHeaderFault::PageSize => "its page size is not a power of two from 512 to 65536",
            WalHeaderFault::Checksum => "its checksum does not match",
        })
    }
}

/// What a log with a damaged header holds, and SQLite would drop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WalLoss {
    /// Frames of the log's generation (the first frame's salts).
    Frames { frames: u64, commits: u64 },
    /// Bytes after the header, in frames of a page size nothing states.
    Unknown,
}

impl std::fmt::Display for WalLoss {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WalLoss::Frames { frames, commits } => write!(
                f,
                "the {frames} frame(s) in it, {commits} of them ending committed transactions"
            ),
            WalLoss::Unknown => f.write_str("every frame in it"),
        }
    }
}

impl SqliteFileError {
    /// What the operator can do about it.
    pub fn hint(&self) -> Option<String> {
        match self {
            SqliteFileError::Read { .. } => None,
            SqliteFileError::NotADatabase { path }
            | SqliteFileError::DamagedDatabaseHeader { path, .. } => Some(format!(
                "check --data-dir / --database-url; if {} was the server's database, restore it \
                 from a backup",
                path.display()
            )),
            SqliteFileError::DamagedWal { path, frame, .. } => Some(move_aside_hint(
                path,
                &format!("committed work from frame {frame} on"),
            )),
            SqliteFileError::DamagedWalHeader { path, .. } => {
                Some(move_aside_hint(path, "all committed work in it"))
            }
        }
    }
}

/// The one hint for a damaged log, whichever part is damaged.
fn move_aside_hint(wal: &Path, lost: &str) -> String {
    format!(
        "keep a copy of {0} before anything else; to start from the last intact transaction \
         instead, stop every process using the database and move {0} aside ({lost} is then \
         lost), or restore from a backup",
        wal.display(),
    )
}

/// The `-wal` file next to a database file.
pub fn wal_path(database: &Path) -> PathBuf {
    let mut name = database.as_os_str().to_os_string();
    name.push("-wal");
    PathBuf::from(name)
}

/// Checks the database file and its write-ahead log, if they exist.
/// Missing files are no error here (SQLite creates them, or the caller
/// refuses a missing database itself).
pub fn check_files(database: &Path) -> Result<(), SqliteFileError> {
    let head = read_prefix(database, DATABASE_HEAD_BYTES)?;
    if let Some(head) = &head {
        check_database_header(database, head)?;
    }
    let page_size = head.as_deref().and_then(database_page_size);
    let wal = wal_path(database);
    let Some(bytes) = read_all(&wal)? else {
        return Ok(());
    };
    let check_wal = |bytes: &[u8]| check_wal_with(&wal, bytes, page_size);
    if check_wal(&bytes).is_ok() {
        return Ok(());
    }
    // Another process may be appending to the log while we read it (a
    // `token` command while `serve` runs): a frame read half-written
    // followed by a complete one looks like damage. Damage on disk reads
    // the same twice; a write in progress does not.
    std::thread::sleep(std::time::Duration::from_millis(200));
    match read_all(&wal)? {
        Some(again) => check_wal(&again),
        None => Ok(()),
    }
}

/// Checks the database header (the first 100 bytes) and the type of page
/// 1, given the file's first [`DATABASE_HEAD_BYTES`]: the fields every
/// SQLite 3 database has the same or from a short list
/// (<https://www.sqlite.org/fileformat2.html#the_database_header>). An
/// empty file is a valid empty database to SQLite.
pub fn check_database_header(path: &Path, head: &[u8]) -> Result<(), SqliteFileError> {
    if head.is_empty() {
        return Ok(());
    }
    if !head.starts_with(SQLITE_MAGIC) {
        return Err(SqliteFileError::NotADatabase {
            path: path.to_path_buf(),
        });
    }
    match database_header_fault(head) {
        None => Ok(()),
        Some(reason) => Err(SqliteFileError::DamagedDatabaseHeader {
            path: path.to_path_buf(),
            reason,
        }),
    }
}

/// What in a header that starts with the magic no database has.
fn database_header_fault(head: &[u8]) -> Option<String> {
    if head.len() < DATABASE_HEAD_BYTES {
        return Some(format!(
            "the file is {} bytes, shorter than one page",
            head.len()
        ));
    }
    if database_page_size(head).is_none() {
        let raw = u16::from_be_bytes([head[16], head[17]]);
        return Some(format!("its header states a page size of {raw}"));
    }
    let (write_version, read_version) = (head[18], head[19]);
    if !matches!(write_version, 1 | 2) || !matches!(read_version, 1 | 2) {
        return Some(format!(
            "its header states file format versions {write_version} and {read_version} \
             (1 or 2 each)"
        ));
    }
    if head[21..24] != [64, 32, 32] {
        return Some("its header's payload fractions are not 64, 32 and 32".to_string());
    }
    let schema_format = be32(head, 44);
    let text_encoding = be32(head, 56);
    if schema_format > 4 || text_encoding > 3 {
        return Some(format!(
            "its header states schema format {schema_format} and text encoding {text_encoding}"
        ));
    }
    let page_type = head[DATABASE_HEADER_BYTES];
    if page_type != TABLE_LEAF_PAGE && page_type != TABLE_INTERIOR_PAGE {
        return Some(format!(
            "its first page is not a table page (type byte {page_type:#04x})"
        ));
    }
    None
}

/// The page size a database header states, if it is one SQLite allows
/// (a power of two from 512 to 65536, the last stored as 1).
fn database_page_size(head: &[u8]) -> Option<usize> {
    let raw = u16::from_be_bytes([*head.get(16)?, *head.get(17)?]);
    let size = if raw == 1 { 65_536 } else { usize::from(raw) };
    valid_page_size(size).then_some(size)
}

fn valid_page_size(size: usize) -> bool {
    size.is_power_of_two() && (512..=65_536).contains(&size)
}

/// The WAL's header fields that frames are checked against.
struct WalHeader {
    big_endian_checksums: bool,
    page_size: usize,
    salts: [u8; 8],
    checksum: (u32, u32),
}

fn be32(bytes: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

/// The WAL header, or why SQLite would ignore the whole log (wrong
/// magic, version or page size, or a header checksum mismatch): SQLite
/// then treats the log as empty. The caller has at least
/// [`WAL_HEADER_BYTES`].
fn parse_wal_header(header: &[u8]) -> Result<WalHeader, WalHeaderFault> {
    let magic = be32(header, 0);
    if magic != WAL_MAGIC_LE && magic != WAL_MAGIC_BE {
        return Err(WalHeaderFault::Magic);
    }
    let big_endian_checksums = magic & 1 == 1;
    if be32(header, 4) != WAL_FORMAT_VERSION {
        return Err(WalHeaderFault::Version);
    }
    let page_size = be32(header, 8) as usize;
    if !valid_page_size(page_size) {
        return Err(WalHeaderFault::PageSize);
    }
    let checksum = wal_checksum(big_endian_checksums, (0, 0), &header[..24]);
    if checksum != (be32(header, 24), be32(header, 28)) {
        return Err(WalHeaderFault::Checksum);
    }
    let mut salts = [0; 8];
    salts.copy_from_slice(&header[16..24]);
    Ok(WalHeader {
        big_endian_checksums,
        page_size,
        salts,
        checksum,
    })
}

/// SQLite's WAL checksum: a running pair over 32-bit words taken two at a
/// time, `s0 += x[i] + s1; s1 += x[i+1] + s0`, wrapping, with the words
/// read in the byte order the magic number names. `data.len()` is a
/// multiple of 8 (headers and pages always are).
pub fn wal_checksum(big_endian: bool, seed: (u32, u32), data: &[u8]) -> (u32, u32) {
    let word = |chunk: &[u8]| {
        let bytes = [chunk[0], chunk[1], chunk[2], chunk[3]];
        if big_endian {
            u32::from_be_bytes(bytes)
        } else {
            u32::from_le_bytes(bytes)
        }
    };
    let (mut s0, mut s1) = seed;
    for pair in data.chunks_exact(8) {
        s0 = s0.wrapping_add(word(&pair[..4])).wrapping_add(s1);
        s1 = s1.wrapping_add(word(&pair[4..])).wrapping_add(s0);
    }
    (s0, s1)
}

/// One frame as SQLite's recovery judges it.
struct Frame<'a> {
    header: &'a [u8],
    page: &'a [u8],
}

impl Frame<'_> {
    fn has_salts(&self, salts: &[u8; 8]) -> bool {
        &self.header[8..16] == salts
    }

    fn is_commit(&self) -> bool {
        be32(self.header, 4) != 0
    }

    fn stored_checksum(&self) -> (u32, u32) {
        (be32(self.header, 16), be32(self.header, 20))
    }

    /// The running checksum through this frame, if the frame is intact
    /// when chained from `seed` (the previous frame's checksum).
    fn verify(&self, header: &WalHeader, seed: (u32, u32)) -> Option<(u32, u32)> {
        if be32(self.header, 0) == 0 || !self.has_salts(&header.salts) {
            return None;
        }
        let checksum = wal_checksum(header.big_endian_checksums, seed, &self.header[..8]);
        let checksum = wal_checksum(header.big_endian_checksums, checksum, self.page);
        (checksum == self.stored_checksum()).then_some(checksum)
    }
}

/// Refuses a log in which SQLite's replay would stop at a damaged frame
/// while later frames of the same log generation (same salts) exist, with
/// at least one of them ending a transaction: committed data would be
/// dropped without a word.
///
/// Normal logs pass: a torn last frame (a crash mid-write) has nothing of
/// its generation after it, and frames left from before the last log reset
/// carry older salts.
///
/// A log whose header SQLite rejects SQLite treats as empty, whatever
/// follows it. SQLite writes the header whole before any frame of a
/// generation, so a bad header before committed frames is damage, and is
/// refused as such.
pub fn check_wal(path: &Path, bytes: &[u8]) -> Result<(), SqliteFileError> {
    check_wal_with(path, bytes, None)
}

/// [`check_wal`], with the page size the database header states, to
/// count the frames behind a damaged log header.
fn check_wal_with(
    path: &Path,
    bytes: &[u8],
    database_page_size: Option<usize>,
) -> Result<(), SqliteFileError> {
    let Some(header) = bytes.get(..WAL_HEADER_BYTES) else {
        return Ok(());
    };
    let header = match parse_wal_header(header) {
        Ok(header) => header,
        Err(fault) => {
            let page_size = Some(be32(header, 8) as usize)
                .filter(|&size| valid_page_size(size))
                .or(database_page_size);
            return match loss_behind_bad_header(bytes, page_size) {
                None => Ok(()),
                Some(lost) => Err(SqliteFileError::DamagedWalHeader {
                    path: path.to_path_buf(),
                    fault,
                    lost,
                }),
            };
        }
    };
    let frames = frames(bytes, header.page_size);
    let mut running = header.checksum;
    for (index, frame) in frames.iter().enumerate() {
        if let Some(next) = frame.verify(&header, running) {
            running = next;
            continue;
        }
        // A frame of an older generation ends this log normally.
        if !frame.has_salts(&header.salts) {
            return Ok(());
        }
        let later: Vec<&Frame> = frames[index + 1..]
            .iter()
            .filter(|later| later.has_salts(&header.salts))
            .collect();
        let lost_commits = later.iter().filter(|later| later.is_commit()).count() as u64
            + u64::from(frame.is_commit());
        if later.is_empty() || lost_commits == 0 {
            // A torn last frame, or an unfinished last transaction.
            return Ok(());
        }
        return Err(SqliteFileError::DamagedWal {
            path: path.to_path_buf(),
            frame: index as u64 + 1,
            lost_frames: later.len() as u64 + 1,
            lost_commits,
        });
    }
    Ok(())
}

/// The complete frames after the log header, for pages of `page_size`.
fn frames(bytes: &[u8], page_size: usize) -> Vec<Frame<'_>> {
    bytes[WAL_HEADER_BYTES..]
        .chunks_exact(WAL_FRAME_HEADER_BYTES + page_size)
        .map(|chunk| Frame {
            header: &chunk[..WAL_FRAME_HEADER_BYTES],
            page: &chunk[WAL_FRAME_HEADER_BYTES..],
        })
        .collect()
}

/// What SQLite would drop with a log whose header it ignores: the frames
/// of the first frame's generation, when some of them end a transaction.
/// `None` when nothing committed is there (no complete frame, or an
/// unfinished first transaction). Without a page size, any byte after
/// the header counts.
fn loss_behind_bad_header(bytes: &[u8], page_size: Option<usize>) -> Option<WalLoss> {
    let rest = &bytes[WAL_HEADER_BYTES..];
    let Some(page_size) = page_size else {
        return rest
            .iter()
            .any(|&byte| byte != 0)
            .then_some(WalLoss::Unknown);
    };
    let frames = frames(bytes, page_size);
    let first = frames.first()?;
    let generation: Vec<&Frame> = frames
        .iter()
        .filter(|frame| frame.header[8..16] == first.header[8..16] && be32(frame.header, 0) != 0)
        .collect();
    let commits = generation.iter().filter(|frame| frame.is_commit()).count() as u64;
    (commits > 0).then_some(WalLoss::Frames {
        frames: generation.len() as u64,
        commits,
    })
}

/// The first `limit` bytes of a file, or `None` if it does not exist.
fn read_prefix(path: &Path, limit: usize) -> Result<Option<Vec<u8>>, SqliteFileError> {
    let file = match std::fs::File::open(path) {
        Ok(file) => file,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(SqliteFileError::Read {
                path: path.to_path_buf(),
                source,
            });
        }
    };
    let mut head = Vec::with_capacity(limit);
    file.take(limit as u64)
        .read_to_end(&mut head)
        .map_err(|source| SqliteFileError::Read {
            path: path.to_path_buf(),
            source,
        })?;
    Ok(Some(head))
}

/// A whole file, or `None` if it does not exist. The WAL is bounded, so it
/// fits in memory: checkpointed in the background every
/// `limits.sqlite_checkpoint_interval_ms`, and by any commit past
/// [`crate::db::WAL_BACKSTOP_PAGES`] pages (40 MB), or past SQLite's
/// 1,000 when that interval is 0.
fn read_all(path: &Path) -> Result<Option<Vec<u8>>, SqliteFileError> {
    match std::fs::read(path) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(SqliteFileError::Read {
            path: path.to_path_buf(),
            source,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: usize = 512;

    /// A log SQLite would accept: a header, then `frames` of
    /// (page number, commit size, page fill byte), chained checksums.
    fn build_wal(big_endian: bool, salts: [u8; 8], frames: &[(u32, u32, u8)]) -> Vec<u8> {
        let mut bytes = Vec::new();
        let magic = if big_endian {
            WAL_MAGIC_BE
        } else {
            WAL_MAGIC_LE
        };
        bytes.extend(magic.to_be_bytes());
        bytes.extend(WAL_FORMAT_VERSION.to_be_bytes());
        bytes.extend((PAGE as u32).to_be_bytes());
        bytes.extend(0u32.to_be_bytes());
        bytes.extend(salts);
        let mut running = wal_checksum(big_endian, (0, 0), &bytes);
        bytes.extend(running.0.to_be_bytes());
        bytes.extend(running.1.to_be_bytes());
        for &(page_number, commit, fill) in frames {
            let mut frame = Vec::new();
            frame.extend(page_number.to_be_bytes());
            frame.extend(commit.to_be_bytes());
            frame.extend(salts);
            let page: Vec<u8> = (0..PAGE).map(|i| fill.wrapping_add(i as u8)).collect();
            running = wal_checksum(big_endian, running, &frame[..8]);
            running = wal_checksum(big_endian, running, &page);
            frame.extend(running.0.to_be_bytes());
            frame.extend(running.1.to_be_bytes());
            frame.extend(page);
            bytes.extend(frame);
        }
        bytes
    }

    fn frame_at(index: usize) -> usize {
        WAL_HEADER_BYTES + index * (WAL_FRAME_HEADER_BYTES + PAGE)
    }

    const SALTS: [u8; 8] = [1, 2, 3, 4, 5, 6, 7, 8];
    /// Two transactions of two pages each.
    const TWO_COMMITS: [(u32, u32, u8); 4] = [(1, 0, 10), (2, 2, 20), (1, 0, 30), (2, 2, 40)];

    #[test]
    fn checksum_follows_the_specification_on_known_words() {
        // Two word pairs, little-endian words: s0 = 1 + 0, s1 = 2 + 1;
        // then s0 = 1 + 3 + 3 = 7, s1 = 3 + 4 + 7 = 14.
        let data = [1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 4, 0, 0, 0];
        assert_eq!(wal_checksum(false, (0, 0), &data), (7, 14));
        // The same bytes read big-endian are other words.
        assert_eq!(
            wal_checksum(true, (0, 0), &data[..8]),
            (0x0100_0000, 0x0300_0000)
        );
        // Wrapping, not overflowing.
        let max = [0xff; 8];
        assert_eq!(
            wal_checksum(false, (u32::MAX, u32::MAX), &max),
            (u32::MAX.wrapping_mul(3), u32::MAX.wrapping_mul(5))
        );
    }

    #[test]
    fn an_intact_log_passes_in_both_byte_orders() {
        for big_endian in [false, true] {
            let wal = build_wal(big_endian, SALTS, &TWO_COMMITS);
            check_wal(Path::new("x-wal"), &wal).expect("intact");
        }
    }

    #[test]
    fn a_damaged_early_frame_before_a_later_commit_is_refused() {
        let mut wal = build_wal(false, SALTS, &TWO_COMMITS);
        wal[frame_at(1) + WAL_FRAME_HEADER_BYTES + 100] ^= 0x01;
        let error = check_wal(Path::new("/d/canopy.db-wal"), &wal).unwrap_err();
        match &error {
            SqliteFileError::DamagedWal {
                frame,
                lost_frames,
                lost_commits,
                ..
            } => {
                assert_eq!((*frame, *lost_frames, *lost_commits), (2, 3, 2));
            }
            other => panic!("{other:?}"),
        }
        let text = error.to_string();
        assert!(
            text.contains("/d/canopy.db-wal") && text.contains("frame 2"),
            "{text}"
        );
        let hint = error.hint().unwrap();
        assert!(hint.contains("move /d/canopy.db-wal aside"), "{hint}");
    }

    #[test]
    fn a_damaged_checksum_field_is_damage_too() {
        let mut wal = build_wal(true, SALTS, &TWO_COMMITS);
        wal[frame_at(0) + 16] ^= 0x80;
        assert!(matches!(
            check_wal(Path::new("w"), &wal),
            Err(SqliteFileError::DamagedWal { frame: 1, .. })
        ));
    }

    #[test]
    fn a_torn_last_frame_is_a_normal_crash() {
        let mut wal = build_wal(false, SALTS, &TWO_COMMITS);
        // Damaged last frame, complete in length.
        let last = frame_at(3) + WAL_FRAME_HEADER_BYTES + 7;
        wal[last] ^= 0xff;
        check_wal(Path::new("w"), &wal).expect("torn last frame");
        // Cut short mid-frame.
        let wal = build_wal(false, SALTS, &TWO_COMMITS);
        check_wal(Path::new("w"), &wal[..frame_at(3) + 100]).expect("cut mid-frame");
    }

    #[test]
    fn an_unfinished_last_transaction_loses_nothing_committed() {
        // Frame 3 damaged, frame 4 of the same generation but no commit.
        let frames = [(1, 0, 10), (2, 2, 20), (1, 0, 30), (2, 0, 40)];
        let mut wal = build_wal(false, SALTS, &frames);
        wal[frame_at(2) + WAL_FRAME_HEADER_BYTES] ^= 0x01;
        check_wal(Path::new("w"), &wal).expect("nothing committed after the damage");
    }

    #[test]
    fn frames_of_an_older_generation_are_ignored() {
        // An older, longer log, overwritten from the start by a new
        // generation with other salts: its tail is stale, not damage.
        let old = build_wal(false, [9; 8], &TWO_COMMITS);
        let new = build_wal(false, SALTS, &TWO_COMMITS[..2]);
        let mut wal = old.clone();
        wal[..new.len()].copy_from_slice(&new);
        check_wal(Path::new("w"), &wal).expect("stale frames");
    }

    #[test]
    fn each_header_fault_is_named() {
        for (at, fault) in [
            (0, WalHeaderFault::Magic),
            (5, WalHeaderFault::Version),
            (9, WalHeaderFault::PageSize),
            (17, WalHeaderFault::Checksum),
            (25, WalHeaderFault::Checksum),
        ] {
            let mut wal = build_wal(false, SALTS, &TWO_COMMITS);
            wal[at] ^= 0x01;
            assert_eq!(
                parse_wal_header(&wal[..WAL_HEADER_BYTES]).err(),
                Some(fault),
                "byte {at}"
            );
        }
    }

    #[test]
    fn a_damaged_header_before_committed_frames_is_refused() {
        for at in [0, 5, 17, 25, 31] {
            let mut wal = build_wal(false, SALTS, &TWO_COMMITS);
            wal[at] ^= 0x01;
            let error = check_wal(Path::new("/d/canopy.db-wal"), &wal).unwrap_err();
            match &error {
                SqliteFileError::DamagedWalHeader { lost, .. } => assert_eq!(
                    *lost,
                    WalLoss::Frames {
                        frames: 4,
                        commits: 2
                    },
                    "byte {at}"
                ),
                other => panic!("byte {at}: {other:?}"),
            }
            let text = error.to_string();
            assert!(
                text.contains("/d/canopy.db-wal has a damaged header")
                    && text.contains("2 of them ending committed transactions"),
                "{text}"
            );
            let hint = error.hint().unwrap();
            assert!(
                hint.contains("keep a copy of /d/canopy.db-wal")
                    && hint.contains("move /d/canopy.db-wal aside"),
                "{hint}"
            );
        }
    }

    #[test]
    fn without_the_header_page_size_the_database_states_it() {
        let mut wal = build_wal(false, SALTS, &TWO_COMMITS);
        wal[9] ^= 0x01;
        let lost = |page_size| match check_wal_with(Path::new("w"), &wal, page_size) {
            Err(SqliteFileError::DamagedWalHeader { lost, .. }) => lost,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            lost(Some(PAGE)),
            WalLoss::Frames {
                frames: 4,
                commits: 2
            }
        );
        assert_eq!(lost(None), WalLoss::Unknown);
    }

    #[test]
    fn a_damaged_header_with_nothing_committed_behind_it_passes() {
        let damaged = |mut wal: Vec<u8>| {
            wal[25] ^= 0x01;
            check_wal(Path::new("w"), &wal)
        };
        let wal = build_wal(false, SALTS, &TWO_COMMITS);
        damaged(wal[..WAL_HEADER_BYTES].to_vec()).expect("a header alone");
        damaged(wal[..frame_at(1) - 1].to_vec()).expect("a partial first frame");
        let unfinished = build_wal(false, SALTS, &[(1, 0, 10), (2, 0, 20)]);
        damaged(unfinished).expect("an unfinished first transaction");
        let mut zeros = wal[..WAL_HEADER_BYTES].to_vec();
        zeros.extend(std::iter::repeat_n(0, 3 * (WAL_FRAME_HEADER_BYTES + PAGE)));
        zeros[0] ^= 0x01;
        check_wal_with(Path::new("w"), &zeros, None).expect("zeros after the header");
        check_wal(Path::new("w"), &[]).expect("an empty log");
    }

    /// The first 101 bytes of a new database in WAL mode, as SQLite
    /// writes them (page size 4096, empty schema).
    fn database_head() -> Vec<u8> {
        let mut head = SQLITE_MAGIC.to_vec();
        head.extend([0x10, 0x00, 2, 2, 0, 64, 32, 32]);
        head.resize(DATABASE_HEADER_BYTES, 0);
        head.push(TABLE_LEAF_PAGE);
        head
    }

    #[test]
    fn a_header_no_database_has_is_refused_by_field() {
        let path = Path::new("/d/canopy.db");
        check_database_header(path, &database_head()).expect("a new database");
        for (at, value, needle) in [
            (16, 0x03, "page size of 768"),
            (18, 7, "file format versions 7 and 2"),
            (22, 0, "payload fractions"),
            (47, 9, "schema format 9"),
            (59, 4, "text encoding 4"),
            (100, 0x0a, "not a table page (type byte 0x0a)"),
        ] {
            let mut head = database_head();
            head[at] = value;
            let error = check_database_header(path, &head).unwrap_err();
            let text = error.to_string();
            assert!(
                text.contains("the SQLite database /d/canopy.db is damaged")
                    && text.contains(needle),
                "byte {at}: {text}"
            );
            assert!(error.hint().unwrap().contains("restore it from a backup"));
        }
        let short = &database_head()[..40];
        let text = check_database_header(path, short).unwrap_err().to_string();
        assert!(text.contains("shorter than one page"), "{text}");
    }

    #[test]
    fn garbage_is_not_a_database_but_empty_is() {
        let path = Path::new("/d/canopy.db");
        let error = check_database_header(path, b"\x8b\x13 random bytes..").unwrap_err();
        assert!(
            error
                .to_string()
                .contains("/d/canopy.db is not a SQLite database")
        );
        check_database_header(path, b"").expect("empty file");
        check_database_header(path, &database_head()).expect("header");
    }
}
