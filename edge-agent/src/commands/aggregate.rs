//! `aggregate`: runs this enrolled aggregator as an edge node (the
//! `canopy-edge` crate). It serves its own end devices with the server's
//! device and admin APIs, and runs each round the cloud assigns it as a
//! sub-round over them, sending the cloud one weighted partial result.
//! Its server takes `canopy-server serve`'s flags; its database, blobs and
//! certificate live in `<data dir>/edge` unless `--edge-dir` says
//! otherwise.

use anyhow::{Context, Result};
use canopy_protocol::messages::DeviceRole;
use canopy_server::config::{ServeArgs, ServerArgs, Settings};
use clap::Args;

use crate::config::{AgentConfig, load_key};
use crate::daemon::TASK_RETRY;
use crate::files::{DataDir, Hint, hinted};

/// Where an edge listens unless `--listen` (or `CANOPY_LISTEN`, or a
/// `--config` file) says otherwise.
pub const DEFAULT_EDGE_LISTEN: &str = "127.0.0.1:9443";

#[derive(Args)]
pub struct AggregateArgs {
    /// The edge server's directory (database, blobs, certificate);
    /// default: `edge` inside the agent's data directory.
    #[arg(long, env = "CANOPY_EDGE_DIR")]
    edge_dir: Option<std::path::PathBuf>,
    #[command(flatten)]
    server: ServerArgs,
}

pub fn run(dir: &DataDir, args: AggregateArgs) -> Result<()> {
    let agent = AgentConfig::require(dir)?;
    if agent.role != DeviceRole::Aggregator {
        return Err(hinted(
            format!(
                "`{}` is enrolled as a {}, not an aggregator",
                dir.root.display(),
                agent.role
            ),
            "enroll this machine again with a token from `canopy device enroll-token --role \
             aggregator` and `canopy-agent enroll --role aggregator --force ...`",
        ));
    }
    let key = load_key(&dir.key())?;
    let cloud = agent.device_client(key)?.with_retry_policy(TASK_RETRY);
    let mut server = args.server;
    if server.listen.is_none() && server.config.is_none() {
        // Not the cloud's default port: an edge may share a machine with it.
        server.listen = Some(DEFAULT_EDGE_LISTEN.parse().expect("a valid address"));
    }
    let serve = ServeArgs {
        data_dir: Some(args.edge_dir.unwrap_or_else(|| dir.root.join("edge"))),
        log_format: None,
        server,
    };
    let settings = Settings::resolve(&serve).context("the edge server's settings are invalid")?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("canopy-edge")
        .build()
        .context("cannot start the async runtime")?;
    let edge = canopy_edge::EdgeSettings::default();
    runtime
        .block_on(canopy_edge::run(cloud, settings, edge))
        .map_err(|error| {
            let hint = error.hint();
            let error = anyhow::Error::new(error);
            match hint {
                Some(hint) => error.context(Hint(hint)),
                None => error,
            }
        })
}
