//! `canopy-server`: serve, migrate, manage API tokens, and run the demo.

mod demo;

use std::process::ExitCode;

use anyhow::Context;
use canopy_server::config::{LogFormat, ServeArgs, Settings};
use canopy_server::db::{DbError, open_existing_database};
use canopy_server::server::{ServeError, open_database, serve};
use canopy_server::store::Page;
use canopy_server::store::tokens::{self, Role};
use canopy_term::outln;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "canopy-server",
    version,
    about = "The Canopy federated-learning server"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the server (applies migrations first).
    Serve(ServeArgs),
    /// Apply database migrations and exit.
    Migrate {
        #[command(flatten)]
        server: ServeArgs,
        #[command(flatten)]
        create: CreateFlag,
    },
    /// Run a whole federated job on the bundled digits: a server, real
    /// canopy-agent processes, a per-round table. Nothing to configure.
    Demo(demo::DemoArgs),
    /// Manage admin API tokens, directly in the database.
    Token {
        #[command(subcommand)]
        command: TokenCommand,
    },
    /// Rotate or list the model-signing keys, directly in the database.
    SigningKey {
        #[command(subcommand)]
        command: SigningKeyCommand,
    },
    /// One central evaluation, in a process of its own; `serve` starts it.
    #[command(hide = true, name = canopy_server::central::worker::SUBCOMMAND)]
    CentralWorker(canopy_server::central::worker::WorkerArgs),
}

#[derive(Subcommand)]
enum SigningKeyCommand {
    /// Replace the key models are signed with. The old key endorses the new
    /// one, so enrolled devices follow; the old key's signatures stay valid
    /// for the overlap, then its secret is erased. Running servers pick the
    /// new key up within `limits.signing_key_reload_ms`.
    Rotate {
        /// How long the old key's signatures stay valid, e.g. 7d or 12h
        /// (at most 90d).
        #[arg(long, default_value = "7d")]
        overlap: String,
        #[command(flatten)]
        server: ServeArgs,
    },
    /// List the keys (never their secrets).
    List {
        #[command(flatten)]
        server: ServeArgs,
    },
}

/// `token` and `migrate` manage an existing server's database: a missing
/// data directory or SQLite file is an error (a mistyped `--data-dir`),
/// unless the operator asks for a new database.
#[derive(clap::Args)]
struct CreateFlag {
    /// Create the data directory and SQLite database if they do not exist.
    #[arg(long)]
    create: bool,
}

impl CreateFlag {
    async fn open(&self, args: &ServeArgs) -> anyhow::Result<canopy_server::db::Db> {
        let settings = Settings::resolve(args)?;
        Ok(if self.create {
            open_database(&settings).await?
        } else {
            open_existing_database(&settings).await?
        })
    }
}

#[derive(Subcommand)]
enum TokenCommand {
    /// Issue a token and print its secret once.
    Create {
        #[arg(long)]
        role: Role,
        /// Lifetime such as 30d or 12h; no expiry when absent.
        #[arg(long)]
        expires: Option<String>,
        #[arg(long, default_value = "")]
        label: String,
        #[command(flatten)]
        server: ServeArgs,
        #[command(flatten)]
        create: CreateFlag,
    },
    /// List tokens (never their secrets).
    List {
        #[command(flatten)]
        server: ServeArgs,
        #[command(flatten)]
        create: CreateFlag,
    },
    /// Revoke a token by id.
    Revoke {
        id: i64,
        #[command(flatten)]
        server: ServeArgs,
        #[command(flatten)]
        create: CreateFlag,
    },
}

/// Logs go to stderr (stdout carries what a command prints for people and
/// scripts: `listening on`, the admin token), coloured only when stderr is
/// a terminal (`canopy_term::stderr_color`), so `2> server.log` is text.
fn init_logging(format: LogFormat, default_filter: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(canopy_term::stderr_color());
    let _ = match format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Pretty => builder.try_init(),
    };
}

/// What `serve` and `migrate` log unless `RUST_LOG` says otherwise.
const SERVER_LOG_FILTER: &str = "info,sqlx=warn,tower_http=info";

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(error) => return canopy_term::clap_exit(&error),
    };
    // The worker needs no runtime: its threads would only count against
    // its address-space limit.
    let cli = match cli.command {
        Command::CentralWorker(args) => return canopy_server::central::worker::run(args),
        command => Cli { command },
    };
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(error) => {
            canopy_term::errln!("error: cannot start the async runtime\n  Caused by: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) if canopy_term::is_stdout_closed(&*error) => {
            ExitCode::from(canopy_term::STDOUT_CLOSED_EXIT)
        }
        Err(error) => {
            canopy_term::errln!("error: {error}");
            for cause in error.chain().skip(1) {
                canopy_term::errln!("  Caused by: {cause}");
            }
            let own_hint = error
                .downcast_ref::<canopy_server::server::ServeError>()
                .and_then(canopy_server::server::ServeError::hint);
            if let Some(hint) = own_hint {
                canopy_term::errln!("  hint: {hint}");
            } else if let Some(hint) = hint(&error) {
                canopy_term::errln!("  hint: {hint}");
            }
            ExitCode::FAILURE
        }
    }
}

fn hint(error: &anyhow::Error) -> Option<String> {
    let database = error.chain().find_map(|cause| {
        cause
            .downcast_ref::<DbError>()
            .or(match cause.downcast_ref::<ServeError>() {
                Some(ServeError::Db(inner)) => Some(inner),
                _ => None,
            })
    });
    if let Some(hint) = database.and_then(DbError::hint) {
        return Some(hint);
    }
    let text = format!("{error:#}");
    if text.contains("Address already in use") {
        Some("another process is listening there; pick another --listen address".to_string())
    } else {
        None
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Serve(args) => {
            let settings = Settings::resolve(&args)?;
            init_logging(settings.log_format, SERVER_LOG_FILTER);
            serve(settings).await?;
        }
        Command::Migrate { server, create } => {
            let settings = Settings::resolve(&server)?;
            init_logging(settings.log_format, SERVER_LOG_FILTER);
            create.open(&server).await?;
            outln!(
                "migrations applied to {}",
                canopy_server::db::redact(&settings.database_url)
            )?;
        }
        Command::Token { command } => token(command).await?,
        Command::SigningKey { command } => signing_key(command).await?,
        // Dispatched in `main`, before the runtime starts.
        Command::CentralWorker(_) => anyhow::bail!("the central worker runs without a runtime"),
        Command::Demo(args) => {
            init_logging(LogFormat::Pretty, if args.json { "error" } else { "warn" });
            demo::run(args).await?;
        }
    }
    Ok(())
}

async fn token(command: TokenCommand) -> anyhow::Result<()> {
    match command {
        TokenCommand::Create {
            role,
            expires,
            label,
            server,
            create,
        } => {
            let db = create.open(&server).await?;
            let expires_ms = match expires {
                Some(text) => {
                    let lifetime = canopy_server::api::admin::tokens::parse_lifetime(&text)
                        .map_err(anyhow::Error::msg)?;
                    Some(canopy_server::db::now_ms() + lifetime.as_millis() as i64)
                }
                None => None,
            };
            let (row, secret) = tokens::create_api_token(&db, role, &label, expires_ms)
                .await
                .context("cannot store the token")?;
            let shown = outln!("token id: {}", row.id)
                .and_then(|()| outln!("{} token: {secret}", row.role));
            if let Err(error) = shown {
                // Only the hash is kept: a secret nobody saw is a token
                // nobody can use, so it is not left active.
                tokens::revoke_api_token(&db, row.id)
                    .await
                    .context("cannot revoke the token whose secret could not be printed")?;
                return Err(anyhow::Error::new(error).context(format!(
                    "token {} was revoked: its secret could not be printed",
                    row.id
                )));
            }
        }
        TokenCommand::List { server, create } => {
            let db = create.open(&server).await?;
            let now_ms = canopy_server::db::now_ms();
            let mut after = 0;
            loop {
                let rows = tokens::list_api_tokens(&db, Page { after, limit: 500 }).await?;
                let Some(last) = rows.last() else { break };
                after = last.id;
                for row in &rows {
                    let expiry = match row.expires_ms {
                        Some(ms) => format!("expiry {}", utc(ms)),
                        None => "no expiry".to_string(),
                    };
                    outln!(
                        "{:>6}  {:<8}  {:<7}  {:<32}  {}",
                        row.id,
                        row.role,
                        row.state(now_ms),
                        expiry,
                        row.label
                    )?;
                }
            }
        }
        TokenCommand::Revoke { id, server, create } => {
            let db = create.open(&server).await?;
            if !tokens::revoke_api_token(&db, id).await? {
                anyhow::bail!("API token {id} does not exist");
            }
            outln!("revoked token {id}")?;
        }
    }
    Ok(())
}

async fn signing_key(command: SigningKeyCommand) -> anyhow::Result<()> {
    use canopy_server::store::signing_keys;
    match command {
        SigningKeyCommand::Rotate { overlap, server } => {
            let overlap = humantime::parse_duration(&overlap).map_err(|error| {
                anyhow::anyhow!("--overlap `{overlap}` is not a duration like 7d or 12h: {error}")
            })?;
            let db = open_database(&Settings::resolve(&server)?).await?;
            let rotation = signing_keys::rotate(&db, overlap)
                .await
                .context("cannot rotate the model-signing key")?;
            outln!("signing key: {}", rotation.public_key_hex)?;
            outln!("previous key: {}", rotation.previous_public_key_hex)?;
            outln!(
                "previous key valid until: {} ({} ms)",
                utc(rotation.previous_valid_until_ms),
                rotation.previous_valid_until_ms
            )?;
        }
        SigningKeyCommand::List { server } => {
            let db = open_database(&Settings::resolve(&server)?).await?;
            let keys = signing_keys::list(&db).await?;
            let now = canopy_server::db::now_ms();
            let current = keys.last().map(|key| key.seq);
            for key in &keys {
                let state = match key.valid_until_ms {
                    _ if Some(key.seq) == current => "in use".to_string(),
                    Some(until) if until >= now => format!("accepted until {}", utc(until)),
                    Some(until) => format!("retired {}", utc(until)),
                    None => "replaced".to_string(),
                };
                let secret = if key.has_secret {
                    "secret kept"
                } else {
                    "secret erased"
                };
                outln!(
                    "{:>4}  {}  created {}  {state}  {secret}",
                    key.seq,
                    key.public_key_hex,
                    utc(key.created_ms)
                )?;
            }
        }
    }
    Ok(())
}

/// RFC 3339 in UTC, to the second.
fn utc(ms: i64) -> String {
    let at =
        std::time::UNIX_EPOCH + std::time::Duration::from_millis(u64::try_from(ms).unwrap_or(0));
    humantime::format_rfc3339_seconds(at).to_string()
}
