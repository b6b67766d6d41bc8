//! Starting the server (issue 11, acceptance 3 and 4): a busy port fails at
//! once with its cause, the first admin token is printed by the start that
//! made it or the operator is told how to make one, and the files that hold
//! secrets are private. Runs the real `canopy-server` binary.

use std::io::{BufRead, BufReader, Read};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};

use crate::support;
use crate::support::server_binary;

fn serve_command(data_dir: &Path, port: u16) -> Command {
    let mut command = Command::new(server_binary());
    command
        .arg("serve")
        .arg("--data-dir")
        .arg(data_dir)
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--tls", "self-signed"])
        .env("RUST_LOG", "info,sqlx=warn");
    command
}

/// Runs `command` to its exit, killing it past `limit`.
fn run_within(mut command: Command, limit: Duration) -> Result<(Output, Duration)> {
    let started = Instant::now();
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    loop {
        if child.try_wait()?.is_some() {
            return Ok((child.wait_with_output()?, started.elapsed()));
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let output = child.wait_with_output()?;
            bail!(
                "still running after {limit:?}; stderr:\n{}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Starts `serve` and reads stdout until `listening on`; returns the child
/// and the stdout lines it printed.
fn start_serving(mut command: Command) -> Result<(Child, Vec<String>)> {
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let stdout = child.stdout.take().context("stdout")?;
    let mut lines = Vec::new();
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        let done = line.starts_with("listening on ");
        lines.push(line);
        if done {
            return Ok((child, lines));
        }
    }
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .context("stderr")?
        .read_to_string(&mut stderr)?;
    bail!("serve exited before listening: {lines:?}\n{stderr}")
}

fn stop(child: Child) -> Result<String> {
    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()?;
    let output = child.wait_with_output()?;
    Ok(String::from_utf8_lossy(&output.stderr).into_owned())
}

fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

#[test]
fn a_busy_port_fails_fast_and_creates_no_token() -> Result<()> {
    let work = tempfile::tempdir()?;
    let data_dir = work.path().join("data");
    let holder = TcpListener::bind("127.0.0.1:0")?;
    let port = holder.local_addr()?.port();
    for attempt in 0..20 {
        let (output, took) = run_within(serve_command(&data_dir, port), Duration::from_secs(5))
            .with_context(|| format!("attempt {attempt}"))?;
        let stderr = String::from_utf8_lossy(&output.stderr);
        ensure!(!output.status.success(), "attempt {attempt} exited 0");
        ensure!(
            stderr.contains("Address already in use") && stderr.contains("hint:"),
            "attempt {attempt} did not name the cause:\n{stderr}"
        );
        ensure!(
            !String::from_utf8_lossy(&output.stdout).contains("admin token"),
            "attempt {attempt} printed a token it cannot serve"
        );
        ensure!(
            took < Duration::from_secs(5),
            "attempt {attempt} took {took:?}"
        );
    }
    drop(holder);
    // None of the failed starts created the first admin token: the first
    // start that serves prints it.
    let port = free_port()?;
    let (child, lines) = start_serving(serve_command(&data_dir, port))?;
    ensure!(
        lines.iter().any(|line| line.starts_with("admin token: cnpa_")
            || line.starts_with("admin token: ")),
        "the first serving start printed no admin token: {lines:?}"
    );

    // A second server on the same data directory and port fails at once
    // too, instead of waiting on the first one's database.
    let (output, took) = run_within(serve_command(&data_dir, port), Duration::from_secs(5))?;
    ensure!(
        !output.status.success(),
        "a second server on a busy port exited 0"
    );
    ensure!(
        took < Duration::from_secs(5),
        "a second server took {took:?}"
    );
    stop(child)?;
    Ok(())
}

#[test]
fn a_token_that_could_not_be_printed_is_replaced_by_a_hint() -> Result<()> {
    let work = tempfile::tempdir()?;
    let data_dir = work.path().join("data");
    // stdout on /dev/full: every write fails, as on a closed or full pipe.
    let port = free_port()?;
    let mut command = serve_command(&data_dir, port);
    let mut child = command
        .stdout(std::fs::File::create("/dev/full")?)
        .stderr(Stdio::piped())
        .spawn()?;
    let mut stderr = BufReader::new(child.stderr.take().context("stderr")?);
    let mut said = String::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !said.contains("could not be printed") && Instant::now() < deadline {
        let mut line = String::new();
        if stderr.read_line(&mut line)? == 0 {
            break;
        }
        said.push_str(&line);
    }
    ensure!(
        said.contains("could not be printed")
            && said.contains("canopy-server token create --role admin"),
        "no hint when the token could not be printed:\n{said}"
    );
    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()?;
    child.wait()?;

    // The next start prints no token (one exists) but says how to make one.
    let port = free_port()?;
    let (child, lines) = start_serving(serve_command(&data_dir, port))?;
    ensure!(
        !lines.iter().any(|line| line.starts_with("admin token: ")),
        "a second token was printed: {lines:?}"
    );
    let stderr = stop(child)?;
    ensure!(
        stderr.contains("never shown") && stderr.contains("token create --role admin"),
        "the next start did not say how to get a token:\n{stderr}"
    );

    // Once a token was shown, starts are quiet about it.
    let fresh = work.path().join("fresh");
    let (child, lines) = start_serving(serve_command(&fresh, free_port()?))?;
    ensure!(
        lines.iter().any(|line| line.starts_with("admin token: ")),
        "{lines:?}"
    );
    stop(child)?;
    let (child, _) = start_serving(serve_command(&fresh, free_port()?))?;
    let stderr = stop(child)?;
    ensure!(
        !stderr.contains("never shown"),
        "a shown token was reported unshown:\n{stderr}"
    );
    Ok(())
}

#[cfg(unix)]
fn mode(path: &Path) -> Result<u32> {
    use std::os::unix::fs::PermissionsExt;
    Ok(std::fs::metadata(path)
        .with_context(|| format!("{}", path.display()))?
        .permissions()
        .mode()
        & 0o777)
}

#[cfg(unix)]
#[test]
fn serve_keeps_its_secrets_private() -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let work = tempfile::tempdir()?;
    // The data directory does not exist yet: serve creates it.
    let data_dir = work.path().join("canopy-data");
    let (child, _) = start_serving(serve_command(&data_dir, free_port()?))?;
    for (path, want) in [
        (data_dir.clone(), 0o700),
        (data_dir.join("canopy.db"), 0o600),
        (data_dir.join("canopy.db-wal"), 0o600),
        (data_dir.join("tls/self-signed-key.pem"), 0o600),
    ] {
        let got = mode(&path)?;
        ensure!(
            got == want,
            "{} has mode {got:o}, want {want:o}",
            path.display()
        );
    }
    stop(child)?;

    // Opened up to others, the data directory is refused, with the fix.
    std::fs::set_permissions(&data_dir, std::fs::Permissions::from_mode(0o755))?;
    let (output, _) = run_within(
        serve_command(&data_dir, free_port()?),
        Duration::from_secs(10),
    )?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    ensure!(
        !output.status.success(),
        "serve started on a 0755 data directory"
    );
    ensure!(
        stderr.contains("can be read by other users") && stderr.contains("chmod 700"),
        "the refusal does not say what to do:\n{stderr}"
    );

    // The same for the database file itself.
    std::fs::set_permissions(&data_dir, std::fs::Permissions::from_mode(0o700))?;
    std::fs::set_permissions(
        data_dir.join("canopy.db"),
        std::fs::Permissions::from_mode(0o644),
    )?;
    let (output, _) = run_within(
        serve_command(&data_dir, free_port()?),
        Duration::from_secs(10),
    )?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    ensure!(
        !output.status.success() && stderr.contains("chmod 600"),
        "serve started on a 0644 database:\n{stderr}"
    );
    Ok(())
}

/// Runs `canopy-server ARGS` with a stdout whose reader is already gone.
fn with_closed_stdout(args: &[&str]) -> Result<Output> {
    let (reader, writer) = std::io::pipe()?;
    drop(reader);
    Ok(Command::new(server_binary())
        .args(args)
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()?)
}

#[test]
fn a_closed_stdout_stops_commands_quietly() -> Result<()> {
    let work = tempfile::tempdir()?;
    let data_dir = work.path().join("data");
    let data = data_dir.to_str().context("utf-8 path")?;
    let created = Command::new(server_binary())
        .args([
            "token",
            "create",
            "--role",
            "viewer",
            "--data-dir",
            data,
            "--create",
        ])
        .output()?;
    ensure!(
        created.status.success(),
        "{}",
        String::from_utf8_lossy(&created.stderr)
    );
    for args in [
        vec!["--help"],
        vec!["token", "list", "--data-dir", data],
        vec!["token", "create", "--role", "viewer", "--data-dir", data],
        vec!["migrate", "--data-dir", data],
    ] {
        let output = with_closed_stdout(&args)?;
        let stderr = String::from_utf8_lossy(&output.stderr);
        ensure!(
            output.status.code() == Some(141) && !stderr.contains("panicked"),
            "`canopy-server {}` with stdout closed: {:?}\n{stderr}",
            args.join(" "),
            output.status
        );
    }
    // The token whose secret went nowhere was revoked, not left active.
    let listed = Command::new(server_binary())
        .args(["token", "list", "--data-dir", data])
        .output()?;
    let listed = String::from_utf8_lossy(&listed.stdout);
    ensure!(
        listed
            .lines()
            .filter(|line| line.contains("active"))
            .count()
            == 1
            && listed
                .lines()
                .filter(|line| line.contains("revoked"))
                .count()
                == 1,
        "expected the printed token active and the unprinted one revoked:\n{listed}"
    );
    Ok(())
}

/// `serve` on `server`'s data directory and database, as it was started.
fn serve_again(server: &support::TestServer) -> Command {
    let mut command = serve_command(server.data_dir.path(), free_port().unwrap_or(0));
    command.args(["--database-url", &server.database_url]);
    command
}

/// Runs `command`, which must refuse to start, and returns its stderr.
fn refused(command: Command) -> Result<String> {
    let (output, _) = run_within(command, Duration::from_secs(30))?;
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    ensure!(!output.status.success(), "it started:\n{stderr}");
    ensure!(
        !String::from_utf8_lossy(&output.stdout).contains("admin token: "),
        "it printed an admin token:\n{stderr}"
    );
    Ok(stderr)
}

/// Empties the server's database as a lost one would be: SQLite's files
/// gone, or the PostgreSQL database dropped and created again.
fn lose_database(server: &support::TestServer) -> Result<()> {
    match server.database {
        support::Database::Sqlite => {
            for name in ["canopy.db", "canopy.db-wal", "canopy.db-shm"] {
                let path = server.data_dir.path().join(name);
                if path.exists() {
                    std::fs::remove_file(&path)?;
                }
            }
        }
        support::Database::Postgres => {
            let name = server
                .database_url
                .rsplit('/')
                .next()
                .context("a database name")?;
            for statement in [
                format!("DROP DATABASE {name} WITH (FORCE)"),
                format!("CREATE DATABASE {name}"),
            ] {
                let status = Command::new("psql")
                    .args([&support::postgres_admin_url(), "-q", "-c", &statement])
                    .status()?;
                ensure!(status.success(), "psql `{statement}` failed");
            }
        }
    }
    Ok(())
}

/// Issue 36: a database that has been started and then lost its data
/// (SQLite's files gone, a PostgreSQL database recreated) is refused, not
/// started afresh with a new admin token and a new model-signing key that
/// every enrolled device would refuse. Moving the data directory's marker
/// aside is the operator's way to start a new database there anyway.
async fn a_lost_database_is_not_started_afresh(database: support::Database) -> Result<()> {
    let mut server = support::TestServer::start(database)?;
    let marker = server.data_dir.path().join("bootstrapped");
    ensure!(marker.is_file(), "the first start wrote no marker");
    #[cfg(unix)]
    ensure!(
        mode(&marker)? == 0o600,
        "the marker is {:o}",
        mode(&marker)?
    );
    server.kill9();
    lose_database(&server)?;
    let stderr = refused(serve_again(&server))?;
    for needle in [
        "holds no model-signing key",
        &format!("{} says", marker.display()),
        "hint:",
        &format!("move {} aside", marker.display()),
    ] {
        ensure!(stderr.contains(needle), "no `{needle}` in:\n{stderr}");
    }

    std::fs::rename(&marker, server.data_dir.path().join("bootstrapped.old"))?;
    let (child, lines) = start_serving(serve_again(&server))?;
    ensure!(
        lines.iter().any(|line| line.starts_with("admin token: ")),
        "a deliberate new start printed no admin token: {lines:?}"
    );
    stop(child)?;
    ensure!(marker.is_file(), "the new first start wrote no marker");
    Ok(())
}

#[test]
fn a_lost_sqlite_database_is_not_started_afresh() -> Result<()> {
    tokio::runtime::Runtime::new()?.block_on(a_lost_database_is_not_started_afresh(
        support::Database::Sqlite,
    ))
}

#[test]
fn a_lost_postgres_database_is_not_started_afresh() -> Result<()> {
    tokio::runtime::Runtime::new()?.block_on(a_lost_database_is_not_started_afresh(
        support::Database::Postgres,
    ))
}

/// The database's own history is evidence too, with no marker (a data
/// directory from before it, or a new one): a database that issued its
/// first admin token but holds no model-signing key is refused. And a
/// data directory from before the marker, over its database, starts as
/// before (no new token, the same key) and gains the marker.
#[tokio::test]
async fn the_database_history_and_old_data_directories() -> Result<()> {
    let mut server = support::TestServer::start(support::Database::Sqlite)?;
    let key = server.admin().ok("/device/v1/server-key").await?["server_public_key"].clone();
    ensure!(key.is_string(), "no key: {key}");
    server.kill9();
    let marker = server.data_dir.path().join("bootstrapped");
    std::fs::remove_file(&marker)?;

    let (child, lines) = start_serving(serve_again(&server))?;
    stop(child)?;
    ensure!(
        !lines.iter().any(|line| line.starts_with("admin token: ")),
        "an existing database issued another first admin token: {lines:?}"
    );
    ensure!(
        marker.is_file(),
        "an existing data directory gained no marker"
    );
    server.restart()?;
    let again = server.admin().ok("/device/v1/server-key").await?["server_public_key"].clone();
    ensure!(again == key, "the key changed from {key} to {again}");
    server.kill9();

    std::fs::remove_file(&marker)?;
    let url = format!(
        "sqlite://{}",
        server.data_dir.path().join("canopy.db").display()
    );
    let pool = sqlx::SqlitePool::connect(&url).await?;
    sqlx::query("DELETE FROM model_signing_keys")
        .execute(&pool)
        .await?;
    pool.close().await;
    let stderr = refused(serve_again(&server))?;
    ensure!(
        stderr.contains("holds no model-signing key")
            && stderr.contains("records that its first admin token was issued")
            && stderr.contains("hint:"),
        "{stderr}"
    );
    Ok(())
}

/// Issue 36: the TLS private key is held to the rule of every file the
/// server keeps secrets in: open to group or others, it is refused at
/// start, naming the file, its mode and the fix; the development key the
/// server wrote itself as well as one the operator gives.
#[cfg(unix)]
#[test]
fn a_tls_key_open_to_others_is_refused() -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let work = tempfile::tempdir()?;
    let data_dir = work.path().join("data");
    let (child, _) = start_serving(serve_command(&data_dir, free_port()?))?;
    stop(child)?;
    let key = data_dir.join("tls/self-signed-key.pem");
    let cert = data_dir.join("tls/self-signed-cert.pem");
    ensure!(mode(&data_dir.join("tls"))? == 0o700, "tls/ is not 0700");

    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o640))?;
    let (output, took) = run_within(
        serve_command(&data_dir, free_port()?),
        Duration::from_secs(10),
    )?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    ensure!(
        !output.status.success(),
        "served with a 0640 key:\n{stderr}"
    );
    for needle in [
        &format!("the TLS private key {}", key.display()),
        "mode 0640",
        &format!("chmod 600 {}", key.display()),
    ] {
        ensure!(stderr.contains(needle), "no `{needle}` in:\n{stderr}");
    }
    eprintln!("refused in {took:?}");

    // An operator's key file, given with --tls-cert/--tls-key.
    let given = work.path().join("given-key.pem");
    std::fs::copy(&key, &given)?;
    std::fs::set_permissions(&given, std::fs::Permissions::from_mode(0o644))?;
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600))?;
    let mut command = Command::new(server_binary());
    command
        .arg("serve")
        .arg("--data-dir")
        .arg(&data_dir)
        .args(["--listen", &format!("127.0.0.1:{}", free_port()?)])
        .arg("--tls-cert")
        .arg(&cert)
        .arg("--tls-key")
        .arg(&given);
    let (output, _) = run_within(command, Duration::from_secs(10))?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    ensure!(
        !output.status.success()
            && stderr.contains(&format!("the TLS private key {}", given.display()))
            && stderr.contains("mode 0644")
            && stderr.contains("chmod 600"),
        "a 0644 key given with --tls-key:\n{stderr}"
    );
    // Private again, both start.
    let (child, _) = start_serving(serve_command(&data_dir, free_port()?))?;
    stop(child)?;
    Ok(())
}

/// Issue 36: the blob store is private whatever the umask: with `umask
/// 000`, a model's blob is 0600 and its directories 0700.
#[cfg(unix)]
#[tokio::test]
async fn blobs_are_private_whatever_the_umask() -> Result<()> {
    let work = tempfile::tempdir()?;
    let data_dir = work.path().join("data");
    let port = free_port()?;
    let mut command = Command::new("sh");
    command
        .arg("-c")
        .arg("umask 000; exec \"$0\" \"$@\"")
        .arg(server_binary())
        .arg("serve")
        .arg("--data-dir")
        .arg(&data_dir)
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--tls", "self-signed"]);
    let (child, lines) = start_serving(command)?;
    let token = lines
        .iter()
        .find_map(|line| line.strip_prefix("admin token: "))
        .context("no admin token")?;
    let fingerprint = lines
        .iter()
        .find_map(|line| line.strip_prefix("tls fingerprint: "))
        .context("no fingerprint")?;
    let admin = support::Admin {
        transport: canopy_sdk::Transport::new(
            &format!("https://127.0.0.1:{port}"),
            &canopy_sdk::Trust::PinnedSha256(fingerprint.to_string()),
        )?,
        token: token.to_string(),
    };
    admin
        .upload_model("private", support::logreg_model_bytes(3))
        .await?;
    stop(child)?;
    let blobs = data_dir.join("blobs");
    let mut checked = 0;
    let mut pending = vec![blobs.clone()];
    while let Some(dir) = pending.pop() {
        ensure!(
            mode(&dir)? == 0o700,
            "{} is {:o}",
            dir.display(),
            mode(&dir)?
        );
        checked += 1;
        for entry in std::fs::read_dir(&dir)? {
            let path = entry?.path();
            if path.is_dir() {
                pending.push(path);
            } else {
                ensure!(
                    mode(&path)? == 0o600,
                    "{} is {:o}",
                    path.display(),
                    mode(&path)?
                );
                checked += 1;
            }
        }
    }
    ensure!(
        checked >= 4,
        "only {checked} entries under {}",
        blobs.display()
    );
    Ok(())
}
