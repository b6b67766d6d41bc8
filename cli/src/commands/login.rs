//! `canopy login` and `canopy logout`: the saved login every admin
//! command uses.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use crate::output::outln;
use crate::remote::{self, Login, Remote, Subject, config};

#[derive(Args)]
pub struct LoginArgs {
    /// The server's base URL, e.g. https://127.0.0.1:8443.
    url: String,
    /// An admin API token (`canopy-server token create --role operator`).
    #[arg(long, env = "CANOPY_TOKEN", hide_env_values = true)]
    token: String,
    /// Pin the server's certificate by its SHA-256 (`sha256:HEX`, as
    /// `canopy-server serve` prints it).
    #[arg(long)]
    fingerprint: Option<String>,
    /// Trust the CA certificates in this PEM file instead of the public roots.
    #[arg(long, conflicts_with = "fingerprint")]
    ca_cert: Option<PathBuf>,
}

/// Checks the token by listing jobs (which any role may), then saves.
pub fn run(args: LoginArgs) -> Result<()> {
    let login = Login {
        url: args.url.trim_end_matches('/').to_string(),
        token: args.token,
        fingerprint: args.fingerprint,
        ca_cert: args.ca_cert,
    };
    let remote = Remote::new(login.clone())?;
    remote::block_on(async {
        remote
            .get("/api/v1/jobs?limit=1", &Subject::new("the job list", None))
            .await
    })?;
    let path = config::save(&login)?;
    outln!("logged in to {}; saved to {}", login.url, path.display())?;
    Ok(())
}

pub fn logout() -> Result<()> {
    match config::remove()? {
        Some(login) => outln!("logged out of {}", login.url)?,
        None => outln!("not logged in")?,
    }
    Ok(())
}
