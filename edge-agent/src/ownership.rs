//! Who owns the data directory, and keeping it so. The daemon runs as a
//! dedicated system user (`install --user`, default `canopy-agent`), not
//! root, because it parses model files that arrive over the network; the
//! data directory belongs to that user. Operators still run `enroll`,
//! `data add` or `run` as root on it, so every file the agent writes
//! takes the owner of the folder it is written into when root writes it
//! ([`adopt_folder_owner`]): the service can always read what root wrote.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::files::hinted;

/// A local account, as `getent passwd` reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Account {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
}

/// Longest user name `useradd` accepts on common systems.
const MAX_USER_NAME_CHARS: usize = 32;
/// Most entries `give_tree` changes: the data directory holds a handful
/// of files, so anything near this is not an agent's data directory.
const MAX_TREE_ENTRIES: usize = 10_000;
/// Deepest folder `give_tree` descends into.
const MAX_TREE_DEPTH: usize = 8;

/// Checks a user name the way `useradd` does by default
/// (`[a-z_][a-z0-9_-]*`, at most 32 characters), and refuses root.
pub fn check_user_name(name: &str) -> Result<()> {
    let mut chars = name.chars();
    let valid = chars
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == '_')
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-')
        && name.len() <= MAX_USER_NAME_CHARS;
    if !valid {
        bail!(
            "user name `{}` is not valid: 1..={MAX_USER_NAME_CHARS} characters of [a-z0-9_-], starting with a letter or `_`",
            crate::files::truncate(name, 64)
        );
    }
    if name == "root" {
        return Err(hinted(
            "the daemon must not run as root: it parses model files that arrive over the network",
            "leave --user at its default, `canopy-agent`, or name another unprivileged user",
        ));
    }
    Ok(())
}

/// Looks `name` up with `getent passwd`; `Ok(None)` when there is no
/// such user.
pub fn lookup(name: &str) -> Result<Option<Account>> {
    let output = Command::new("getent")
        .args(["passwd", name])
        .output()
        .map_err(|error| {
            anyhow::Error::new(error).context(format!(
                "cannot run `getent passwd {name}` to look the user up"
            ))
        })?;
    // getent: 2 is "no such key"; anything else but 0 is a failure.
    match output.status.code() {
        Some(0) => parse_passwd_line(&String::from_utf8_lossy(&output.stdout), name).map(Some),
        Some(2) => Ok(None),
        _ => bail!(
            "`getent passwd {name}` failed ({}): {}",
            output.status,
            crate::files::truncate(String::from_utf8_lossy(&output.stderr).trim(), 200)
        ),
    }
}

/// Parses `name:x:uid:gid:gecos:home:shell`.
fn parse_passwd_line(text: &str, name: &str) -> Result<Account> {
    let line = text.lines().next().unwrap_or_default();
    let fields: Vec<&str> = line.split(':').collect();
    let number = |index: usize| -> Result<u32> {
        fields
            .get(index)
            .and_then(|field| field.parse().ok())
            .with_context(|| {
                format!(
                    "`getent passwd {name}` gave an unreadable entry: `{}`",
                    crate::files::truncate(line, 200)
                )
            })
    };
    if fields.first() != Some(&name) {
        bail!(
            "`getent passwd {name}` answered for another user: `{}`",
            crate::files::truncate(line, 200)
        );
    }
    Ok(Account {
        name: name.to_string(),
        uid: number(2)?,
        gid: number(3)?,
    })
}

/// The `useradd` command line that creates the service user: a system
/// account with its own group, the data directory as its home (not
/// created by useradd: install creates it 0700) and no login shell.
pub fn useradd_args(name: &str, data_dir: &Path) -> Vec<String> {
    vec![
        "--system".into(),
        "--user-group".into(),
        "--no-create-home".into(),
        "--home-dir".into(),
        data_dir.display().to_string(),
        "--shell".into(),
        "/usr/sbin/nologin".into(),
        "--comment".into(),
        "Canopy edge agent".into(),
        name.into(),
    ]
}

/// Creates the service user with `useradd` and returns it.
pub fn create_system_user(name: &str, data_dir: &Path) -> Result<Account> {
    let args = useradd_args(name, data_dir);
    let manual = format!("useradd {}", shell_words(&args));
    let output = Command::new("useradd")
        .args(&args)
        .output()
        .map_err(|error| {
            anyhow::Error::new(useradd_hint(&manual))
                .context(format!("cannot run `useradd` ({error})"))
                .context(format!("cannot create system user `{name}`"))
        })?;
    if !output.status.success() {
        return Err(anyhow::Error::new(useradd_hint(&manual))
            .context(format!(
                "useradd failed ({}): {}",
                output.status,
                crate::files::truncate(String::from_utf8_lossy(&output.stderr).trim(), 300)
            ))
            .context(format!("cannot create system user `{name}`")));
    }
    lookup(name)?.with_context(|| format!("user `{name}` is missing right after useradd"))
}

/// The hint for a user that could not be created.
fn useradd_hint(manual: &str) -> crate::files::Hint {
    crate::files::Hint(format!(
        "run install as root, or create the user yourself (`{manual}`) and run install again"
    ))
}

/// `args` as one shell line, quoting words with spaces.
pub fn shell_words(args: &[String]) -> String {
    args.iter()
        .map(|a| {
            if a.contains(char::is_whitespace) {
                format!("\"{a}\"")
            } else {
                a.clone()
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// Refuses a data directory the account cannot reach: every folder above
/// it must let the account through (search permission), or the service
/// fails at start with "permission denied".
#[cfg(unix)]
pub fn check_reachable(account: &Account, data_dir: &Path) -> Result<()> {
    match first_barrier(account, data_dir, false)? {
        None => Ok(()),
        Some(barrier) => Err(hinted(
            format!(
                "user `{}` cannot reach data directory `{}`: {barrier}",
                account.name,
                data_dir.display()
            ),
            format!(
                "choose a data directory under /var/lib (e.g. --data-dir /var/lib/canopy-agent), or `chmod o+x {}`",
                barrier.path.display()
            ),
        )),
    }
}

/// A warning when the owner of the data directory (the user the service
/// runs as) cannot read a dataset the operator registers, judged by
/// permission bits (ACLs aside); `None` when it can.
#[cfg(unix)]
pub fn unreadable_by_service(data_dir: &Path, dataset: &Path) -> Result<Option<String>> {
    use std::os::unix::fs::MetadataExt;
    let owner =
        fs::metadata(data_dir).with_context(|| format!("cannot stat `{}`", data_dir.display()))?;
    let account = Account {
        name: format!("uid {}", owner.uid()),
        uid: owner.uid(),
        gid: owner.gid(),
    };
    if account.uid == 0 {
        return Ok(None);
    }
    Ok(first_barrier(&account, dataset, true)?.map(|barrier| {
        format!(
            "the service runs as the data directory's owner ({}), which cannot read `{}`: {barrier}; `run` will fail on it",
            account.name,
            dataset.display()
        )
    }))
}

#[cfg(not(unix))]
pub fn unreadable_by_service(_data_dir: &Path, _dataset: &Path) -> Result<Option<String>> {
    Ok(None)
}

/// A folder or file whose permissions stop an account.
#[cfg(unix)]
pub struct Barrier {
    path: PathBuf,
    mode: u32,
    uid: u32,
}

#[cfg(unix)]
impl std::fmt::Display for Barrier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "`{}` (mode {:o}, owner uid {}) does not let it through",
            self.path.display(),
            self.mode,
            self.uid
        )
    }
}

/// The first folder above `path` that `account` may not search, or, with
/// `read_target`, `path` itself when the account may not read it (and
/// search it, for a folder). Missing folders are skipped: they are
/// created later, or reported by whatever opens them.
#[cfg(unix)]
fn first_barrier(account: &Account, path: &Path, read_target: bool) -> Result<Option<Barrier>> {
    use std::os::unix::fs::MetadataExt;
    let target = read_target.then_some(path);
    for folder in target.into_iter().chain(path.ancestors().skip(1)) {
        let meta = match fs::metadata(folder) {
            Ok(meta) => meta,
            Err(error) if error.kind() == io::ErrorKind::NotFound => continue,
            Err(error) => {
                return Err(anyhow::Error::new(error)
                    .context(format!("cannot stat `{}`", folder.display())));
            }
        };
        let wanted = match (folder == path, meta.is_dir()) {
            (true, true) => 0o5,
            (true, false) => 0o4,
            (false, _) => 0o1,
        };
        let shift = if meta.uid() == account.uid {
            6
        } else if meta.gid() == account.gid {
            3
        } else {
            0
        };
        if (meta.mode() >> shift) & wanted != wanted {
            return Ok(Some(Barrier {
                path: folder.to_path_buf(),
                mode: meta.mode() & 0o7777,
                uid: meta.uid(),
            }));
        }
    }
    Ok(None)
}

#[cfg(not(unix))]
pub fn check_reachable(_account: &Account, _data_dir: &Path) -> Result<()> {
    Ok(())
}

/// Gives `root` and everything under it to `account` (`chown -R`, but
/// refusing to follow links). Symbolic links are changed themselves,
/// never their targets, and never descended into. A regular file with
/// more than one hard link is refused: it may be another file on this
/// system linked in by whoever could write the folder. Returns how many
/// entries were changed.
#[cfg(unix)]
pub fn give_tree(root: &Path, account: &Account) -> Result<usize> {
    let mut changed = 0;
    let mut pending: Vec<(PathBuf, usize)> = vec![(root.to_path_buf(), 0)];
    while let Some((path, depth)) = pending.pop() {
        give_one(&path, account)?;
        changed += 1;
        if changed > MAX_TREE_ENTRIES {
            bail!(
                "`{}` holds over {MAX_TREE_ENTRIES} entries; not an agent data directory, not changing more owners",
                root.display()
            );
        }
        let meta = fs::symlink_metadata(&path)
            .with_context(|| format!("cannot stat `{}`", path.display()))?;
        if !meta.is_dir() {
            continue;
        }
        if depth >= MAX_TREE_DEPTH {
            bail!(
                "`{}` is nested deeper than {MAX_TREE_DEPTH} folders; not an agent data directory",
                path.display()
            );
        }
        let entries =
            fs::read_dir(&path).with_context(|| format!("cannot list `{}`", path.display()))?;
        for entry in entries {
            let entry = entry.with_context(|| format!("cannot list `{}`", path.display()))?;
            pending.push((entry.path(), depth + 1));
        }
    }
    Ok(changed)
}

#[cfg(unix)]
fn give_one(path: &Path, account: &Account) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let meta =
        fs::symlink_metadata(path).with_context(|| format!("cannot stat `{}`", path.display()))?;
    if meta.is_file() && meta.nlink() > 1 {
        return Err(hinted(
            format!(
                "`{}` has {} hard links; not giving it to user `{}`, since it may be another file on this system",
                path.display(),
                meta.nlink(),
                account.name
            ),
            "remove it, or replace it with a copy, and run install again",
        ));
    }
    if meta.uid() == account.uid && meta.gid() == account.gid {
        return Ok(());
    }
    std::os::unix::fs::lchown(path, Some(account.uid), Some(account.gid)).with_context(|| {
        format!(
            "cannot give `{}` to user `{}` (uid {})",
            path.display(),
            account.name,
            account.uid
        )
    })
}

#[cfg(not(unix))]
pub fn give_tree(_root: &Path, _account: &Account) -> Result<usize> {
    Ok(0)
}

/// The owner a file written at `path` by this process should take: the
/// owner of its folder, when this process is root (`my_uid` 0) and the
/// folder belongs to someone else. `None` leaves the file as created.
#[cfg(unix)]
fn owner_to_adopt(path: &Path, my_uid: u32) -> io::Result<Option<(u32, u32)>> {
    use std::os::unix::fs::MetadataExt;
    let folder = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    let folder = fs::metadata(folder)?;
    Ok((my_uid == 0 && folder.uid() != 0).then(|| (folder.uid(), folder.gid())))
}

/// Gives a file this process just created at `path`, still open as
/// `file`, to the owner of its folder when root wrote it into another
/// user's folder (see the module's doc). Through the open file, so a
/// link swapped in at `path` cannot redirect the change.
#[cfg(unix)]
pub fn adopt_folder_owner(file: &fs::File, path: &Path) -> io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let my_uid = file.metadata()?.uid();
    if let Some((uid, gid)) = owner_to_adopt(path, my_uid)? {
        std::os::unix::fs::fchown(file, Some(uid), Some(gid))?;
    }
    Ok(())
}

/// [`adopt_folder_owner`] for a file written by someone else's code (the
/// SDK's key store) and already closed; changes a link, never its target.
#[cfg(unix)]
pub fn adopt_folder_owner_at(path: &Path) -> io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let my_uid = fs::symlink_metadata(path)?.uid();
    if let Some((uid, gid)) = owner_to_adopt(path, my_uid)? {
        std::os::unix::fs::lchown(path, Some(uid), Some(gid))?;
    }
    Ok(())
}

#[cfg(not(unix))]
pub fn adopt_folder_owner(_file: &fs::File, _path: &Path) -> io::Result<()> {
    Ok(())
}

#[cfg(not(unix))]
pub fn adopt_folder_owner_at(_path: &Path) -> io::Result<()> {
    Ok(())
}

#[cfg(all(test, unix))]
mod tests {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    use super::*;

    /// This process's uid, from a file it creates.
    fn my_uid(dir: &Path) -> u32 {
        let probe = dir.join(".uid-probe");
        fs::write(&probe, b"").unwrap();
        let uid = fs::metadata(&probe).unwrap().uid();
        fs::remove_file(&probe).unwrap();
        uid
    }

    /// Another user to hand files to: `nobody` when this test runs as
    /// root (only root can give files away); otherwise the current user,
    /// the one change an unprivileged process may make.
    fn recipient(dir: &Path) -> Account {
        let uid = my_uid(dir);
        if uid == 0 {
            lookup("nobody").unwrap().expect("a `nobody` user")
        } else {
            Account {
                name: "me".into(),
                uid,
                gid: fs::metadata(dir).unwrap().gid(),
            }
        }
    }

    #[test]
    fn passwd_lines_parse_and_users_are_looked_up() {
        assert_eq!(
            parse_passwd_line(
                "canopy-agent:x:998:997:Canopy:/var/lib/c:/usr/sbin/nologin\n",
                "canopy-agent"
            )
            .unwrap(),
            Account {
                name: "canopy-agent".into(),
                uid: 998,
                gid: 997
            }
        );
        assert!(parse_passwd_line("other:x:1:1::/:/bin/sh", "canopy-agent").is_err());
        assert!(parse_passwd_line("canopy-agent:x:uid:1::/:/bin/sh", "canopy-agent").is_err());
        assert_eq!(lookup("root").unwrap().unwrap().uid, 0);
        assert_eq!(lookup("no-such-user-canopy-test").unwrap(), None);
    }

    #[test]
    fn the_tree_goes_to_the_user_without_following_links() {
        let tmp = tempfile::tempdir().unwrap();
        let account = recipient(tmp.path());
        let root = tmp.path().join("agent");
        fs::create_dir_all(root.join("sub")).unwrap();
        fs::write(root.join("agent.toml"), b"x").unwrap();
        fs::write(root.join("sub/deep"), b"x").unwrap();
        let outside = tmp.path().join("outside");
        fs::write(&outside, b"not the agent's").unwrap();
        let outside_uid = fs::metadata(&outside).unwrap().uid();
        std::os::unix::fs::symlink(&outside, root.join("link")).unwrap();
        assert_eq!(give_tree(&root, &account).unwrap(), 5);
        for path in ["", "agent.toml", "sub", "sub/deep", "link"] {
            let meta = fs::symlink_metadata(root.join(path)).unwrap();
            assert_eq!(
                (meta.uid(), meta.gid()),
                (account.uid, account.gid),
                "{path}"
            );
        }
        assert_eq!(
            fs::metadata(&outside).unwrap().uid(),
            outside_uid,
            "link target untouched"
        );

        // A hard link may be any file on the system: refused.
        fs::remove_file(root.join("link")).unwrap();
        fs::hard_link(&outside, root.join("hard")).unwrap();
        let error = format!("{:#}", give_tree(&root, &account).unwrap_err());
        assert!(error.contains("has 2 hard links"), "{error}");
        assert_eq!(fs::metadata(&outside).unwrap().uid(), outside_uid);
    }

    #[test]
    fn files_root_writes_into_a_users_folder_go_to_that_user() {
        let tmp = tempfile::tempdir().unwrap();
        let account = recipient(tmp.path());
        let folder = tmp.path().join("agent");
        fs::create_dir(&folder).unwrap();
        give_tree(&folder, &account).unwrap();
        let path = folder.join("agent.toml");
        crate::files::write_public(&path, b"x").unwrap();
        let meta = fs::metadata(&path).unwrap();
        assert_eq!((meta.uid(), meta.gid()), (account.uid, account.gid));
        let key = folder.join("device.key");
        crate::config::store_key(&key, &canopy_protocol::auth::DeviceKey::generate()).unwrap();
        let meta = fs::metadata(&key).unwrap();
        assert_eq!((meta.uid(), meta.gid()), (account.uid, account.gid));
        assert_eq!(meta.mode() & 0o777, 0o600, "still private");
        if my_uid(tmp.path()) != 0 {
            println!("not root: checked only that files stay with their writer");
        }
        // Root's own folder keeps root's files root's.
        let own = tmp.path().join("own.toml");
        crate::files::write_public(&own, b"x").unwrap();
        assert_eq!(fs::metadata(&own).unwrap().uid(), my_uid(tmp.path()));
    }

    #[test]
    fn a_data_dir_the_user_cannot_reach_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let stranger = Account {
            name: "stranger".into(),
            uid: 4_000_000_001,
            gid: 4_000_000_001,
        };
        let closed = tmp.path().join("closed");
        let data = closed.join("agent");
        fs::create_dir_all(&data).unwrap();
        fs::set_permissions(tmp.path(), fs::Permissions::from_mode(0o755)).unwrap();
        fs::set_permissions(&closed, fs::Permissions::from_mode(0o700)).unwrap();
        let error = format!("{:#}", check_reachable(&stranger, &data).unwrap_err());
        assert!(
            error.contains("user `stranger` cannot reach data directory"),
            "{error}"
        );
        assert!(
            error.contains(&format!("`{}` (mode 700", closed.display())),
            "{error}"
        );
        fs::set_permissions(&closed, fs::Permissions::from_mode(0o711)).unwrap();
        check_reachable(&stranger, &data).unwrap();
    }

    #[test]
    fn a_dataset_the_service_cannot_read_is_named() {
        let tmp = tempfile::tempdir().unwrap();
        fs::set_permissions(tmp.path(), fs::Permissions::from_mode(0o755)).unwrap();
        let account = recipient(tmp.path());
        let data = tmp.path().join("agent");
        fs::create_dir(&data).unwrap();
        give_tree(&data, &account).unwrap();
        let dataset = tmp.path().join("digits.csv");
        fs::write(&dataset, b"1,2\n").unwrap();
        fs::set_permissions(&dataset, fs::Permissions::from_mode(0o644)).unwrap();
        assert_eq!(unreadable_by_service(&data, &dataset).unwrap(), None);
        fs::set_permissions(&dataset, fs::Permissions::from_mode(0o000)).unwrap();
        let warning = unreadable_by_service(&data, &dataset)
            .unwrap()
            .expect("a warning");
        assert!(
            warning.contains(&format!("cannot read `{}`", dataset.display())),
            "{warning}"
        );
        assert!(warning.contains("(mode 0,"), "{warning}");
    }
}
