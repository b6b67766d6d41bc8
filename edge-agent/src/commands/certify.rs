//! `certify`: hands the server the device authority's certificate of this
//! device's id and key, which the server relays to its neighbours in
//! secure rounds (see `canopy_protocol::device_cert`).

use anyhow::{Context, Result};
use clap::Args;

use crate::config::{AgentConfig, load_key};
use crate::files::{DataDir, hinted};
use crate::output::outln;

#[derive(Args)]
pub struct CertifyArgs {
    /// The certificate, 128 hex digits, as `canopy authority certify`
    /// printed it for this device's id and key (`canopy-agent status`).
    #[arg(long)]
    certificate: String,
}

pub fn run(dir: &DataDir, args: CertifyArgs) -> Result<()> {
    let agent = AgentConfig::require(dir)?;
    let key = load_key(&dir.key())?;
    let body = canopy_protocol::messages::DeviceCertificate {
        certificate: args.certificate.trim().to_string(),
    };
    let certificate = body.bytes().map_err(|cause| {
        hinted(
            format!("--certificate is not a certificate: {cause}"),
            "paste the 128 hex digits `canopy authority certify` printed",
        )
    })?;
    let client = agent.device_client(key)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime
        .block_on(client.install_certificate(&certificate))
        .with_context(|| format!("device {}'s certificate was not installed", agent.device_id))?;
    outln!(
        "installed the device authority's certificate of device {}",
        agent.device_id
    )?;
    Ok(())
}
