//! The one rule for the files and directories that hold the server's
//! secrets and data (the data directory, the SQLite database, TLS private
//! keys, blobs): no access at all for group or others. What the server
//! creates it creates with [`PRIVATE_DIR_MODE`] or [`PRIVATE_FILE_MODE`],
//! whatever the umask; what it is given it checks with [`open_to_others`].

use std::path::Path;

pub const PRIVATE_DIR_MODE: u32 = 0o700;
pub const PRIVATE_FILE_MODE: u32 = 0o600;

/// The mode (permission bits) of a file or directory that group or others
/// may access in any way; `None` when it is private (and off Unix).
pub fn open_to_others(meta: &std::fs::Metadata) -> Option<u32> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = meta.permissions().mode() & 0o7777;
        (mode & 0o077 != 0).then_some(mode)
    }
    #[cfg(not(unix))]
    {
        let _ = meta;
        None
    }
}

/// The `chmod` mode that makes `meta`'s file or directory private.
pub fn private_mode_for(meta: &std::fs::Metadata) -> u32 {
    if meta.is_dir() {
        PRIVATE_DIR_MODE
    } else {
        PRIVATE_FILE_MODE
    }
}

/// Sets `path` to the private mode for its kind, whatever it was.
pub fn make_private(path: &Path) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let meta = std::fs::metadata(path)?;
        let mode = private_mode_for(&meta);
        if meta.permissions().mode() & 0o7777 != mode {
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
        }
    }
    #[cfg(not(unix))]
    let _ = path;
    Ok(())
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn any_bit_for_group_or_others_is_open() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("key.pem");
        std::fs::write(&file, b"k").expect("write");
        for (mode, open) in [
            (0o600, false),
            (0o400, false),
            (0o700, false),
            (0o640, true),
            (0o604, true),
            (0o620, true),
            (0o601, true),
        ] {
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(mode)).expect("chmod");
            let meta = std::fs::metadata(&file).expect("meta");
            assert_eq!(open_to_others(&meta), open.then_some(mode), "{mode:o}");
        }
        make_private(&file).expect("private");
        let meta = std::fs::metadata(&file).expect("meta");
        assert_eq!(meta.permissions().mode() & 0o777, PRIVATE_FILE_MODE);
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
            .expect("chmod");
        make_private(dir.path()).expect("private");
        let meta = std::fs::metadata(dir.path()).expect("meta");
        assert_eq!(meta.permissions().mode() & 0o777, PRIVATE_DIR_MODE);
    }
}

/// Creates `dir` and its missing parents with [`PRIVATE_DIR_MODE`],
/// whatever the umask (which can only take bits away).
pub fn create_private_dir_all(dir: &Path) -> std::io::Result<()> {
    let mut builder = std::fs::DirBuilder::new();
    builder.recursive(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::DirBuilderExt;
        builder.mode(PRIVATE_DIR_MODE);
    }
    builder.create(dir)
}
