//! `install`: the data directory, the settings file and a systemd unit.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Args;

use crate::config::config_template;
use crate::files::{DataDir, absolute, write_public};

#[derive(Args)]
pub struct InstallArgs {
    /// Print what would be written, and write nothing.
    #[arg(long)]
    dry_run: bool,
    /// Installation prefix: the unit runs PREFIX/bin/canopy-agent and is
    /// written to PREFIX/lib/systemd/system/canopy-agent.service.
    #[arg(long, default_value = "/usr/local")]
    prefix: PathBuf,
}

/// How long systemd waits after SIGTERM: the daemon's grace period for a
/// running task plus time to upload and exit.
const STOP_TIMEOUT_S: u64 = crate::daemon::SHUTDOWN_GRACE.as_secs() + 15;

pub fn run(dir: &DataDir, args: InstallArgs) -> Result<()> {
    let data_dir = absolute(&dir.root)?;
    let prefix = absolute(&args.prefix)?;
    let binary = prefix.join("bin").join("canopy-agent");
    let unit_path = prefix.join("lib/systemd/system/canopy-agent.service");
    let unit = unit_file(&binary, &data_dir)?;
    let dir = DataDir::new(data_dir.clone());
    let config_path = dir.config();
    let keep_config = config_path.exists();
    if args.dry_run {
        println!("dry run: nothing is written");
        println!(
            "would create data directory {} (mode 700)",
            data_dir.display()
        );
        if keep_config {
            println!(
                "would keep existing settings file {}",
                config_path.display()
            );
        } else {
            println!("would write settings file {}:", config_path.display());
            print_indented(&config_template());
        }
        println!("would write systemd unit {}:", unit_path.display());
        print_indented(&unit);
        return Ok(());
    }
    dir.create()?;
    if keep_config {
        println!("kept existing settings file {}", config_path.display());
    } else {
        write_public(&config_path, config_template().as_bytes())
            .with_context(|| format!("cannot write settings file `{}`", config_path.display()))?;
        println!("wrote settings file {}", config_path.display());
    }
    if let Some(parent) = unit_path.parent() {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("cannot create folder `{}`", parent.display()))?;
    }
    write_public(&unit_path, unit.as_bytes())
        .with_context(|| format!("cannot write systemd unit `{}`", unit_path.display()))?;
    println!("wrote systemd unit {}", unit_path.display());
    println!();
    println!("next steps:");
    let mut step = 1;
    let current = std::env::current_exe().ok();
    if !binary.exists() {
        let from = current
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_else(|| "canopy-agent".into());
        println!("  {step}. install -m 0755 {from} {}", binary.display());
        step += 1;
    }
    let cli = format!("{} --data-dir {}", binary.display(), data_dir.display());
    println!(
        "  {step}. {cli} enroll --server https://SERVER:8443 --token TOKEN --fingerprint sha256:HEX"
    );
    println!("  {}. {cli} data add NAME --kind csv --path FILE", step + 1);
    println!(
        "  {}. edit {} to set limits (threads, memory, idle-only)",
        step + 2,
        config_path.display()
    );
    // An absolute path works for any prefix, inside systemd's search path
    // or not.
    println!(
        "  {}. systemctl daemon-reload && systemctl enable --now {}",
        step + 3,
        unit_path.display()
    );
    println!("  {}. {cli} status", step + 4);
    Ok(())
}

fn print_indented(text: &str) {
    for line in text.lines() {
        println!("    {line}");
    }
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
/// period, and a read-only system apart from the data directory (datasets
/// are only read). No `PrivateTmp`: datasets may live under /tmp.
pub fn unit_file(binary: &Path, data_dir: &Path) -> Result<String> {
    let exe = unit_arg(binary)?;
    let data = unit_arg(data_dir)?;
    Ok(format!(
        "[Unit]\n\
         Description=Canopy edge agent (federated learning)\n\
         After=network-online.target\n\
         Wants=network-online.target\n\
         \n\
         [Service]\n\
         Type=simple\n\
         ExecStart={exe} --data-dir {data} run\n\
         Restart=on-failure\n\
         RestartSec=10\n\
         KillSignal=SIGTERM\n\
         TimeoutStopSec={STOP_TIMEOUT_S}\n\
         Nice=10\n\
         Environment=CANOPY_LOG=info\n\
         NoNewPrivileges=yes\n\
         ProtectSystem=strict\n\
         ProtectHome=read-only\n\
         ReadWritePaths={data}\n\
         \n\
         [Install]\n\
         WantedBy=multi-user.target\n"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_unit_runs_the_daemon_on_the_data_dir() {
        let unit = unit_file(
            Path::new("/opt/canopy/bin/canopy-agent"),
            Path::new("/var/lib/canopy agent"),
        )
        .unwrap();
        assert!(unit.contains(
            "ExecStart=/opt/canopy/bin/canopy-agent --data-dir \"/var/lib/canopy agent\" run\n"
        ));
        assert!(unit.contains("TimeoutStopSec=35\n"));
        assert!(unit_file(Path::new("/bin/x"), Path::new("/a%b")).is_err());
    }
}
