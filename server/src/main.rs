//! `canopy-server`: serve, migrate, manage API tokens, and run the demo.

mod demo;

use std::process::ExitCode;

use anyhow::Context;
use canopy_server::config::{LogFormat, ServeArgs, Settings};
use canopy_server::server::{open_database, serve};
use canopy_server::store::Page;
use canopy_server::store::tokens::{self, Role};
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
    Migrate(ServeArgs),
    /// Run a whole federated job on the bundled digits: a server, real
    /// canopy-agent processes, a per-round table. Nothing to configure.
    Demo(demo::DemoArgs),
    /// Manage admin API tokens, directly in the database.
    Token {
        #[command(subcommand)]
        command: TokenCommand,
    },
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
    },
    /// List tokens (never their secrets).
    List {
        #[command(flatten)]
        server: ServeArgs,
    },
    /// Revoke a token by id.
    Revoke {
        id: i64,
        #[command(flatten)]
        server: ServeArgs,
    },
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,sqlx=warn,tower_http=info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Pretty => builder.init(),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("error: cannot start the async runtime\n  Caused by: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}");
            for cause in error.chain().skip(1) {
                eprintln!("  Caused by: {cause}");
            }
            if let Some(hint) = hint(&error) {
                eprintln!("  hint: {hint}");
            }
            ExitCode::FAILURE
        }
    }
}

fn hint(error: &anyhow::Error) -> Option<&'static str> {
    let text = format!("{error:#}");
    if text.contains("Address already in use") {
        Some("another process is listening there; pick another --listen address")
    } else if text.contains("connect to the database") {
        Some("check --database-url (or CANOPY_DATABASE_URL) and that the database is running")
    } else {
        None
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Serve(args) => {
            let settings = Settings::resolve(&args)?;
            init_logging(settings.log_format);
            serve(settings).await?;
        }
        Command::Migrate(args) => {
            let settings = Settings::resolve(&args)?;
            init_logging(settings.log_format);
            open_database(&settings).await?;
            println!(
                "migrations applied to {}",
                canopy_server::db::redact(&settings.database_url)
            );
        }
        Command::Token { command } => token(command).await?,
        Command::Demo(args) => {
            let filter = if args.json { "error" } else { "warn" };
            let filter = tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(filter));
            tracing_subscriber::fmt()
                .with_env_filter(filter)
                .with_writer(std::io::stderr)
                .init();
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
        } => {
            let db = open_database(&Settings::resolve(&server)?).await?;
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
            println!("token id: {}", row.id);
            println!("{} token: {secret}", row.role);
        }
        TokenCommand::List { server } => {
            let db = open_database(&Settings::resolve(&server)?).await?;
            let mut after = 0;
            loop {
                let rows = tokens::list_api_tokens(&db, Page { after, limit: 500 }).await?;
                let Some(last) = rows.last() else { break };
                after = last.id;
                for row in &rows {
                    let state = if row.revoked_ms.is_some() {
                        "revoked"
                    } else {
                        "active"
                    };
                    println!(
                        "{:>6}  {:<8}  {:<7}  {}",
                        row.id, row.role, state, row.label
                    );
                }
            }
        }
        TokenCommand::Revoke { id, server } => {
            let db = open_database(&Settings::resolve(&server)?).await?;
            if !tokens::revoke_api_token(&db, id).await? {
                anyhow::bail!("API token {id} does not exist");
            }
            println!("revoked token {id}");
        }
    }
    Ok(())
}
