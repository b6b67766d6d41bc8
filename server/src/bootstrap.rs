//! A database's first start, and the rule that no later start is taken
//! for one.
//!
//! The first start of `serve` on a database creates its model-signing key
//! and issues the first admin token. Done again over a database that has
//! existed, it is a disaster that looks like success: a database that
//! lost its data (a SQLite log SQLite ignored, a PostgreSQL database
//! recreated) would start empty, with a new key that every enrolled device
//! refuses. So a start is a first start only when nothing says the
//! database existed:
//!
//! - the database's own history: its first admin token was issued (the
//!   setting is written only after its signing key exists);
//! - the data directory's marker, [`MARKER_FILE`], written durably once a
//!   start has completed the bootstrap (or found it done, for data
//!   directories from before the marker). It works on PostgreSQL too,
//!   whose data lives outside the data directory.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::db::{Db, now_ms, redact};
use crate::store::settings;
use crate::store::signing_keys::{self, SigningKeyError};

/// In the data directory: this directory's database has been started.
pub const MARKER_FILE: &str = "bootstrapped";

#[derive(Debug, thiserror::Error)]
pub enum BootstrapError {
    #[error(
        "the database {database} holds no model-signing key, but {evidence}; a first start \
         on it would issue a new admin token and a new model-signing key, whose models every \
         enrolled device refuses"
    )]
    KeysLost {
        database: String,
        evidence: Evidence,
    },
    #[error(
        "the database {database} has no record of its first admin token, but {} says this \
         data directory's database was started before; it is not that database, or it lost \
         its data",
        marker.display()
    )]
    AdminTokenLost { database: String, marker: PathBuf },
    #[error("cannot read {path}")]
    ReadMarker {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot write {path}")]
    WriteMarker {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot read the database's bootstrap state")]
    Sql(#[from] sqlx::Error),
    #[error("cannot read the database's model-signing keys")]
    SigningKeys(#[from] SigningKeyError),
}

/// What says a database existed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Evidence {
    /// The data directory's marker.
    Marker(PathBuf),
    /// The database's record that its first admin token was issued.
    AdminTokenIssued,
}

impl std::fmt::Display for Evidence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Evidence::Marker(path) => write!(
                f,
                "{} says this data directory's database was started before",
                path.display()
            ),
            Evidence::AdminTokenIssued => {
                f.write_str("it records that its first admin token was issued")
            }
        }
    }
}

impl BootstrapError {
    /// What the operator can do about it.
    pub fn hint(&self) -> Option<String> {
        let marker = match self {
            BootstrapError::KeysLost {
                evidence: Evidence::Marker(marker),
                ..
            }
            | BootstrapError::AdminTokenLost { marker, .. } => marker,
            BootstrapError::KeysLost { .. } => {
                return Some(
                    "check --database-url; restore the database from a backup (on SQLite, keep \
                     a copy of the database and its -wal file first)"
                        .to_string(),
                );
            }
            _ => return None,
        };
        Some(format!(
            "check --data-dir and --database-url; on SQLite, a damaged or missing -wal file \
             loses what was not yet checkpointed: keep a copy of every database file, and \
             restore from a backup; to start a new, empty database with this data directory \
             anyway, move {} aside",
            marker.display()
        ))
    }
}

/// The start about to happen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// A new database: its first key is created now.
    First,
    /// A database that has been started (or whose first start did not
    /// finish: the admin token is then issued by this one).
    Again,
}

/// What the database holds of a bootstrap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Found {
    has_keys: bool,
    admin_token_issued: bool,
}

/// The one decision; `marker` is the data directory's marker if it exists.
fn decide(found: Found, marker: Option<&Path>, database: &str) -> Result<Start, BootstrapError> {
    let database = database.to_string();
    match (found.has_keys, found.admin_token_issued, marker) {
        (true, true, _) | (true, false, None) => Ok(Start::Again),
        (false, false, None) => Ok(Start::First),
        (false, true, _) => Err(BootstrapError::KeysLost {
            database,
            evidence: Evidence::AdminTokenIssued,
        }),
        (false, false, Some(marker)) => Err(BootstrapError::KeysLost {
            database,
            evidence: Evidence::Marker(marker.to_path_buf()),
        }),
        (true, false, Some(marker)) => Err(BootstrapError::AdminTokenLost {
            database,
            marker: marker.to_path_buf(),
        }),
    }
}

/// Decides whether this is the database's first start, refusing one over
/// a database that has existed, and on a first start creates its first
/// model-signing key. Runs after migrations, before the ring is loaded.
pub async fn prepare(
    db: &Db,
    data_dir: &Path,
    database_url: &str,
) -> Result<Start, BootstrapError> {
    let found = Found {
        has_keys: signing_keys::has_keys(db).await?,
        admin_token_issued: settings::admin_token_issued(db).await?,
    };
    let marker = marker_path(data_dir);
    let exists = marker
        .try_exists()
        .map_err(|source| BootstrapError::ReadMarker {
            path: marker.clone(),
            source,
        })?;
    let start = decide(
        found,
        exists.then_some(marker.as_path()),
        &redact(database_url),
    )?;
    if start == Start::First {
        signing_keys::create_first_key(db).await?;
    }
    Ok(start)
}

pub fn marker_path(data_dir: &Path) -> PathBuf {
    data_dir.join(MARKER_FILE)
}

/// Writes the marker once the bootstrap is done (the key exists and the
/// first admin token was issued), unless it is there: a fresh file 0600,
/// fsynced, renamed into place, the directory fsynced, so that a crash
/// leaves no marker or a whole one.
pub fn record(data_dir: &Path, database_url: &str) -> Result<(), BootstrapError> {
    let marker = marker_path(data_dir);
    let written = |source| BootstrapError::WriteMarker {
        path: marker.clone(),
        source,
    };
    if marker.try_exists().map_err(written)? {
        return Ok(());
    }
    let text = format!(
        "The database of this Canopy data directory has been started: its model-signing key \
         exists and its first admin token was issued.\n`canopy-server serve` refuses to start \
         a new database with this data directory while this file exists.\n\
         database: {}\nrecorded_ms: {}\n",
        redact(database_url),
        now_ms()
    );
    let temporary = data_dir.join(format!(".{MARKER_FILE}.{}.tmp", std::process::id()));
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut file = options.open(&temporary).map_err(written)?;
    file.write_all(text.as_bytes()).map_err(written)?;
    file.sync_all().map_err(written)?;
    drop(file);
    std::fs::rename(&temporary, &marker).map_err(written)?;
    // The rename is durable once the directory is.
    #[cfg(unix)]
    std::fs::File::open(data_dir)
        .and_then(|dir| dir.sync_all())
        .map_err(written)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const DB: &str = "sqlite:///d/canopy.db";

    fn found(has_keys: bool, admin_token_issued: bool) -> Found {
        Found {
            has_keys,
            admin_token_issued,
        }
    }

    #[test]
    fn only_an_empty_database_without_a_marker_is_a_first_start() {
        let marker = Path::new("/d/bootstrapped");
        assert_eq!(decide(found(false, false), None, DB).unwrap(), Start::First);
        assert_eq!(decide(found(true, true), None, DB).unwrap(), Start::Again);
        assert_eq!(
            decide(found(true, true), Some(marker), DB).unwrap(),
            Start::Again
        );
        // A first start that failed between the key and the token.
        assert_eq!(decide(found(true, false), None, DB).unwrap(), Start::Again);
    }

    #[test]
    fn a_database_that_existed_is_never_started_afresh() {
        let marker = Path::new("/d/bootstrapped");
        let error = decide(found(false, false), Some(marker), DB).unwrap_err();
        let text = error.to_string();
        assert!(
            text.contains("sqlite:///d/canopy.db holds no model-signing key")
                && text.contains("/d/bootstrapped says"),
            "{text}"
        );
        assert!(error.hint().unwrap().contains("move /d/bootstrapped aside"));
        for marker in [None, Some(marker)] {
            let error = decide(found(false, true), marker, DB).unwrap_err();
            assert!(
                matches!(
                    &error,
                    BootstrapError::KeysLost {
                        evidence: Evidence::AdminTokenIssued,
                        ..
                    }
                ),
                "{error:?}"
            );
            assert!(error.hint().is_some());
        }
        let error = decide(found(true, false), Some(marker), DB).unwrap_err();
        assert!(
            error
                .to_string()
                .contains("no record of its first admin token"),
            "{error}"
        );
    }

    #[test]
    fn the_marker_is_written_once_and_private() {
        let dir = tempfile::tempdir().expect("tempdir");
        record(dir.path(), "postgres://u:secret@h/db").expect("written");
        let marker = marker_path(dir.path());
        let text = std::fs::read_to_string(&marker).expect("marker");
        assert!(text.contains("database: postgres://u:***@h/db"), "{text}");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&marker)
                .expect("meta")
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        std::fs::write(&marker, "kept").expect("overwrite");
        record(dir.path(), DB).expect("again");
        assert_eq!(std::fs::read_to_string(&marker).expect("marker"), "kept");
        let left: Vec<_> = std::fs::read_dir(dir.path()).expect("dir").collect();
        assert_eq!(left.len(), 1, "a temporary file was left behind");
    }
}
