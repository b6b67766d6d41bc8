//! `install`: the data directory, the settings file and a systemd unit.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Args;

use crate::config::config_template;
use crate::files::{DataDir, absolute, hinted, write_public};
use crate::output::outln;
use crate::ownership::{self, Account, check_user_name};

#[derive(Args)]
pub struct InstallArgs {
    /// Print what would be done, and do nothing.
    #[arg(long)]
    dry_run: bool,
    /// Installation prefix: the unit runs PREFIX/bin/canopy-agent and is
    /// written to PREFIX/lib/systemd/system/canopy-agent.service.
    #[arg(long, default_value = "/usr/local")]
    prefix: PathBuf,
    /// The system user the daemon runs as, never root; created with
    /// `useradd --system` if missing. It owns the data directory.
    #[arg(long, default_value = "canopy-agent")]
    user: String,
    /// Run this machine as an edge aggregator: the unit starts `aggregate`
    /// instead of `run` (enroll with `--role aggregator`). It listens on
    /// 127.0.0.1:9443 with a self-signed certificate; give it `--listen`
    /// and `--tls` with `systemctl edit canopy-agent`.
    #[arg(long)]
    aggregate: bool,
}

/// What the unit starts: the daemon that trains, or an edge aggregator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Service {
    Device,
    Aggregator,
}

impl Service {
    fn subcommand(self) -> &'static str {
        match self {
            Service::Device => "run",
            Service::Aggregator => "aggregate",
        }
    }

    fn description(self) -> &'static str {
        match self {
            Service::Device => "Canopy edge agent (federated learning)",
            Service::Aggregator => "Canopy edge aggregator (federated learning)",
        }
    }
}

/// How long systemd waits after SIGTERM: the daemon's grace period for a
/// running task plus time to upload and exit.
const STOP_TIMEOUT_S: u64 = crate::daemon::SHUTDOWN_GRACE.as_secs() + 15;

pub fn run(dir: &DataDir, args: InstallArgs) -> Result<()> {
    check_user_name(&args.user)?;
    let data_dir = absolute(&dir.root)?;
    let prefix = absolute(&args.prefix)?;
    let binary = prefix.join("bin").join("canopy-agent");
    let unit_path = prefix.join("lib/systemd/system/canopy-agent.service");
    let service = match args.aggregate {
        true => Service::Aggregator,
        false => Service::Device,
    };
    let unit = unit_file(&binary, &data_dir, &args.user, service)?;
    let existing = ownership::lookup(&args.user)?;
    if let Some(account) = &existing {
        refuse_root(account)?;
    }
    let dir = DataDir::new(data_dir.clone());
    if args.dry_run {
        return dry_run(&dir, existing.as_ref(), &args.user, &unit_path, &unit);
    }
    let account = match existing {
        Some(account) => {
            outln!("user {} exists (uid {})", account.name, account.uid)?;
            account
        }
        None => {
            let account = ownership::create_system_user(&args.user, &data_dir)?;
            refuse_root(&account)?;
            outln!("created system user {} (uid {})", account.name, account.uid)?;
            account
        }
    };
    create_data_dir(&dir, &account)?;
    write_settings(&dir)?;
    if let Some(parent) = unit_path.parent() {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("cannot create folder `{}`", parent.display()))?;
    }
    write_public(&unit_path, unit.as_bytes())
        .with_context(|| format!("cannot write systemd unit `{}`", unit_path.display()))?;
    outln!("wrote systemd unit {}", unit_path.display())?;
    next_steps(&dir, &binary, &unit_path, service)
}

fn refuse_root(account: &Account) -> Result<()> {
    if account.uid == 0 {
        return Err(hinted(
            format!(
                "user `{}` has uid 0; the daemon must not run as root",
                account.name
            ),
            "name an unprivileged user with --user",
        ));
    }
    Ok(())
}

fn dry_run(
    dir: &DataDir,
    existing: Option<&Account>,
    user: &str,
    unit_path: &Path,
    unit: &str,
) -> Result<()> {
    outln!("dry run: nothing is done")?;
    match existing {
        Some(account) => outln!("user {user} exists (uid {})", account.uid)?,
        None => outln!(
            "would create system user {user}: useradd {}",
            ownership::shell_words(&ownership::useradd_args(user, &dir.root))
        )?,
    }
    outln!(
        "would create data directory {} (mode 700) and give it, with everything in it, to {user}",
        dir.root.display()
    )?;
    let config_path = dir.config();
    if config_path.exists() {
        outln!(
            "would keep existing settings file {}",
            config_path.display()
        )?;
    } else {
        outln!("would write settings file {}:", config_path.display())?;
        print_indented(&config_template())?;
    }
    outln!("would write systemd unit {}:", unit_path.display())?;
    print_indented(unit)
}

/// Creates the data directory (0700; missing folders above it with the
/// default mode), checks the service user can reach it, and gives it
/// and everything already in it to that user, so that files written
/// before install (an earlier `enroll` as root) are readable by the
/// service.
fn create_data_dir(dir: &DataDir, account: &Account) -> Result<()> {
    if let Some(parent) = dir.root.parent() {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("cannot create folder `{}`", parent.display()))?;
    }
    dir.create()?;
    // A data directory given as a link is the operator's choice: follow
    // that one link, and no link inside it.
    let real = std::fs::canonicalize(&dir.root)
        .with_context(|| format!("cannot resolve `{}`", dir.root.display()))?;
    ownership::check_reachable(account, &real)?;
    ownership::give_tree(&real, account)?;
    outln!(
        "data directory {} (mode 700) belongs to {}, with everything in it",
        dir.root.display(),
        account.name
    )?;
    Ok(())
}

fn write_settings(dir: &DataDir) -> Result<()> {
    let config_path = dir.config();
    if config_path.exists() {
        outln!("kept existing settings file {}", config_path.display())?;
        return Ok(());
    }
    write_public(&config_path, config_template().as_bytes())
        .with_context(|| format!("cannot write settings file `{}`", config_path.display()))?;
    outln!("wrote settings file {}", config_path.display())?;
    Ok(())
}

fn next_steps(dir: &DataDir, binary: &Path, unit_path: &Path, service: Service) -> Result<()> {
    outln!()?;
    outln!("next steps (as root: the data directory belongs to the service user):")?;
    let mut step = 1;
    let current = std::env::current_exe().ok();
    if !binary.exists() {
        let from = current
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_else(|| "canopy-agent".into());
        outln!("  {step}. install -m 0755 {from} {}", binary.display())?;
        step += 1;
    }
    let cli = format!("{} --data-dir {}", binary.display(), dir.root.display());
    let role = match service {
        Service::Device => "",
        Service::Aggregator => " --role aggregator",
    };
    outln!(
        "  {step}. {cli} enroll{role} --server https://SERVER:8443 --token TOKEN --fingerprint sha256:HEX"
    )?;
    match service {
        Service::Device => {
            outln!(
                "  {}. {cli} data add NAME --kind csv --path FILE   (a file the service user can read)",
                step + 1
            )?;
            outln!(
                "  {}. edit {} to set limits (threads, memory, idle-only)",
                step + 2,
                dir.config().display()
            )?;
        }
        Service::Aggregator => {
            outln!(
                "  {}. systemctl edit canopy-agent   (ExecStart= with `aggregate --listen \
                 0.0.0.0:9443 --tls-cert FILE --tls-key FILE`, to serve other machines)",
                step + 1
            )?;
            outln!(
                "  {}. edit {} if the defaults do not fit",
                step + 2,
                dir.config().display()
            )?;
        }
    }
    // An absolute path works for any prefix, inside systemd's search path
    // or not.
    outln!(
        "  {}. systemctl daemon-reload && systemctl enable --now {}",
        step + 3,
        unit_path.display()
    )?;
    outln!("  {}. {cli} status", step + 4)?;
    Ok(())
}

fn print_indented(text: &str) -> Result<()> {
    for line in text.lines() {
        outln!("    {line}")?;
    }
    Ok(())
}

/// Quotes a path for a systemd command line; refuses what systemd could
/// not read back.
fn unit_arg(path: &Path) -> Result<String> {
    let text = path
        .to_str()
        .with_context(|| format!("path `{}` is not UTF-8", path.display()))?;
    if text
        .chars()
        .any(|c| c.is_control() || matches!(c, '"' | '\\' | '%' | '$'))
    {
        bail!(
            "path `{}` contains characters a systemd unit cannot hold (quotes, backslashes, `%`, `$` or control characters)",
            path.display()
        );
    }
    Ok(if text.contains(char::is_whitespace) {
        format!("\"{text}\"")
    } else {
        text.to_string()
    })
}

/// The systemd unit: restart on failure, SIGTERM with time for the grace
/// period, and the daemon as `user`, never root, since it parses model
/// files from the network. The sandbox: a read-only system apart from
/// the data directory (datasets are only read; home directories stay
/// readable, since datasets may live there), no capabilities, no new
/// privileges, IP and Unix sockets only (Unix for the resolver), no
/// devices, kernel or clock changes, no W+X memory, and the system calls
/// of an ordinary service. No `PrivateTmp`: datasets may live under
/// /tmp, and the daemon keeps its own temporary files in the data
/// directory. No `MemoryMax`: the memory budget is `max_memory_mb` in
/// config.toml, which operators edit after install and the daemon
/// checks per task; the unit says how to add a hard cap.
pub fn unit_file(binary: &Path, data_dir: &Path, user: &str, service: Service) -> Result<String> {
    check_user_name(user)?;
    let exe = unit_arg(binary)?;
    let data = unit_arg(data_dir)?;
    let (description, subcommand) = (service.description(), service.subcommand());
    Ok(format!(
        "[Unit]\n\
         Description={description}\n\
         After=network-online.target\n\
         Wants=network-online.target\n\
         \n\
         [Service]\n\
         Type=simple\n\
         User={user}\n\
         ExecStart={exe} --data-dir {data} {subcommand}\n\
         Restart=on-failure\n\
         RestartSec=10\n\
         KillSignal=SIGTERM\n\
         TimeoutStopSec={STOP_TIMEOUT_S}\n\
         Nice=10\n\
         Environment=CANOPY_LOG=info\n\
         UMask=0077\n\
         # For a hard memory cap as well as max_memory_mb in config.toml:\n\
         # systemctl edit canopy-agent, then MemoryMax=2G under [Service].\n\
         NoNewPrivileges=yes\n\
         CapabilityBoundingSet=\n\
         AmbientCapabilities=\n\
         ProtectSystem=strict\n\
         ProtectHome=read-only\n\
         ReadWritePaths={data}\n\
         PrivateDevices=yes\n\
         ProtectKernelTunables=yes\n\
         ProtectKernelModules=yes\n\
         ProtectKernelLogs=yes\n\
         ProtectControlGroups=yes\n\
         ProtectClock=yes\n\
         ProtectHostname=yes\n\
         ProtectProc=invisible\n\
         RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX\n\
         RestrictNamespaces=yes\n\
         RestrictRealtime=yes\n\
         RestrictSUIDSGID=yes\n\
         LockPersonality=yes\n\
         MemoryDenyWriteExecute=yes\n\
         RemoveIPC=yes\n\
         SystemCallArchitectures=native\n\
         SystemCallFilter=@system-service\n\
         SystemCallErrorNumber=EPERM\n\
         \n\
         [Install]\n\
         WantedBy=multi-user.target\n"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unit() -> String {
        unit_for(Service::Device)
    }

    fn unit_for(service: Service) -> String {
        unit_file(
            Path::new("/opt/canopy/bin/canopy-agent"),
            Path::new("/var/lib/canopy agent"),
            "canopy-agent",
            service,
        )
        .unwrap()
    }

    #[test]
    fn the_unit_runs_the_daemon_on_the_data_dir() {
        let unit = unit();
        assert!(unit.contains(
            "ExecStart=/opt/canopy/bin/canopy-agent --data-dir \"/var/lib/canopy agent\" run\n"
        ));
        assert!(unit.contains("TimeoutStopSec=35\n"));
        assert!(unit.contains("ReadWritePaths=\"/var/lib/canopy agent\"\n"));
        assert!(
            unit_file(
                Path::new("/bin/x"),
                Path::new("/a%b"),
                "canopy-agent",
                Service::Device
            )
            .is_err()
        );
        // An aggregator's unit starts `aggregate` on the same directory.
        let aggregator = unit_for(Service::Aggregator);
        assert!(aggregator.contains(
            "ExecStart=/opt/canopy/bin/canopy-agent --data-dir \"/var/lib/canopy agent\" aggregate\n"
        ));
        assert!(aggregator.contains("Description=Canopy edge aggregator"));
    }

    /// Each `Key=value` line of the `[Service]` section.
    fn service_settings(unit: &str) -> Vec<(&str, &str)> {
        unit.split("[Service]\n")
            .nth(1)
            .unwrap()
            .split("\n[")
            .next()
            .unwrap()
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| l.split_once('='))
            .collect()
    }

    #[test]
    fn the_unit_runs_as_the_dedicated_user_in_a_sandbox() {
        let unit = unit();
        let settings = service_settings(&unit);
        let value = |key: &str| {
            settings
                .iter()
                .find(|(k, _)| *k == key)
                .map(|(_, v)| *v)
                .unwrap_or_else(|| panic!("no {key}= in:\n{unit}"))
        };
        assert_eq!(value("User"), "canopy-agent");
        assert!(
            !settings
                .iter()
                .any(|(k, v)| *v == "root" || *v == "0" && *k == "User"),
            "nothing runs as root:\n{unit}"
        );
        assert_eq!(value("NoNewPrivileges"), "yes");
        assert_eq!(value("CapabilityBoundingSet"), "", "no capabilities");
        assert_eq!(value("ProtectSystem"), "strict");
        assert_eq!(value("ProtectHome"), "read-only");
        assert_eq!(value("PrivateDevices"), "yes");
        assert_eq!(value("RestrictAddressFamilies"), "AF_INET AF_INET6 AF_UNIX");
        assert_eq!(value("SystemCallFilter"), "@system-service");
        assert_eq!(value("UMask"), "0077");
        let other = unit_file(
            Path::new("/bin/a"),
            Path::new("/var/lib/a"),
            "edge_ml",
            Service::Device,
        )
        .unwrap();
        assert!(other.contains("\nUser=edge_ml\n"), "{other}");
    }

    #[test]
    fn root_and_odd_user_names_are_refused() {
        for bad in ["root", "", "Canopy", "a b", "x:y", "-x", &"a".repeat(33)] {
            let error = unit_file(
                Path::new("/bin/a"),
                Path::new("/var/lib/a"),
                bad,
                Service::Device,
            );
            assert!(error.is_err(), "`{bad}` was accepted");
        }
        let error = format!("{:#}", check_user_name("root").unwrap_err());
        assert!(error.contains("must not run as root"), "{error}");
    }
}
