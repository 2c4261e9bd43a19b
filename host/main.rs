//! The `leasehold` binary.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use leasehold::bench::ClaimBench;
use leasehold::reaper::{self, ReaperConfig};
use leasehold::store::{RunStatus, SqliteSync, Store};

#[derive(Parser)]
#[command(name = "leasehold", version, about = "A WebAssembly-plugin workflow host with fenced leases")]
struct Cli {
    /// Log format.
    #[arg(long, global = true, env = "LEASEHOLD_LOG_FORMAT", default_value = "text")]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Run the service: open (or create) the database, apply migrations and
    /// run the reaper until SIGTERM or Ctrl-C.
    Serve {
        /// Database URL: sqlite://PATH (created if missing) or postgres://….
        #[arg(long, env = "LEASEHOLD_DATABASE_URL", default_value = "sqlite://leasehold.db")]
        database_url: String,
        /// How often the reaper looks for expired leases, in milliseconds.
        #[arg(long, env = "LEASEHOLD_REAPER_INTERVAL_MS", default_value_t = 5_000)]
        reaper_interval_ms: u64,
    },
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        bench: BenchCommand,
    },
    /// Inspect runs.
    Runs {
        /// Database URL.
        #[arg(long, env = "LEASEHOLD_DATABASE_URL", default_value = "sqlite://leasehold.db")]
        database_url: String,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
        #[command(subcommand)]
        command: RunsCommand,
    },
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Claim throughput against a raw UPDATE … RETURNING baseline, in one
    /// run. Ends with one JSON line on stdout.
    Claim {
        /// Database URL. It must hold no runs but the bench's own. Default: a
        /// temporary SQLite file, removed afterwards.
        #[arg(long)]
        database_url: Option<String>,
        /// Runs loaded and claimed per phase.
        #[arg(long, default_value_t = 20_000)]
        runs: i64,
        /// Concurrent claiming tasks, one connection each.
        #[arg(long, default_value_t = 16)]
        concurrency: usize,
        /// Runs per claim statement.
        #[arg(long, default_value_t = 1)]
        batch: i64,
        /// Finished runs to load first (the claim path must ignore them).
        #[arg(long, default_value_t = 0)]
        finished: i64,
        /// SQLite only: PRAGMA synchronous.
        #[arg(long, default_value = "normal")]
        synchronous: SqliteSync,
        /// Rounds of (baseline, claim), alternating order; medians are reported.
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// No progress lines on stderr.
        #[arg(long)]
        quiet: bool,
    },
}

#[derive(Subcommand)]
enum RunsCommand {
    /// List runs, newest first.
    List {
        #[arg(long)]
        status: Option<String>,
        #[arg(long)]
        plugin: Option<String>,
        #[arg(long, default_value_t = 50)]
        limit: i64,
    },
    /// Show one run.
    Show { id: i64 },
}

fn init_logs(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("LEASEHOLD_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    init_logs(cli.log_format);
    match cli.command {
        Command::Serve { database_url, reaper_interval_ms } => serve(&database_url, reaper_interval_ms).await,
        Command::Bench { bench: BenchCommand::Claim { database_url, runs, concurrency, batch, finished, synchronous, rounds, quiet } } => {
            anyhow::ensure!(runs > 0 && concurrency > 0 && batch > 0 && rounds > 0, "--runs, --concurrency, --batch and --rounds must be positive");
            let temp = database_url.is_none().then(|| {
                std::env::temp_dir().join(format!("leasehold-bench-{}.db", std::process::id()))
            });
            let url = match (&database_url, &temp) {
                (Some(u), _) => u.clone(),
                (None, Some(p)) => format!("sqlite://{}", p.display()),
                (None, None) => unreachable!(),
            };
            let bench = ClaimBench { database_url: url, runs, concurrency, batch, finished, sqlite_sync: synchronous, rounds, progress: !quiet };
            let result = bench.run().await;
            if let Some(p) = temp {
                remove_sqlite(&p);
            }
            println!("{}", serde_json::to_string(&result?)?);
            Ok(())
        }
        Command::Runs { database_url, json, command } => runs(&database_url, json, command).await,
    }
}

fn remove_sqlite(path: &std::path::Path) {
    for suffix in ["", "-wal", "-shm"] {
        let mut p = PathBuf::from(path).into_os_string();
        p.push(suffix);
        let _ = std::fs::remove_file(p);
    }
}

async fn serve(database_url: &str, reaper_interval_ms: u64) -> Result<()> {
    let store = Store::connect(database_url)
        .await
        .with_context(|| format!("opening the database {database_url}"))?;
    tracing::info!(database = %database_url, backend = store.backend().name(), "leasehold is up");
    tracing::warn!("no plugins yet: the Wasm runtime and the HTTP API are not built yet; running the reaper only");
    let config = ReaperConfig::default();
    let mut tick = tokio::time::interval(Duration::from_millis(reaper_interval_ms.max(10)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let shutdown = shutdown_signal();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            _ = tick.tick() => {
                if let Err(e) = reaper::tick(&store, &config).await {
                    // A database hiccup must not take the service down; the
                    // next tick tries again.
                    tracing::error!(error = %e, "reaper tick failed");
                }
            }
        }
    }
    tracing::info!("shutting down");
    store.shutdown().await;
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("installing the SIGTERM handler");
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

async fn runs(database_url: &str, json: bool, command: RunsCommand) -> Result<()> {
    let store = Store::connect(database_url)
        .await
        .with_context(|| format!("opening the database {database_url}"))?;
    match command {
        RunsCommand::List { status, plugin, limit } => {
            let status = status
                .map(|s| s.parse::<RunStatus>())
                .transpose()
                .context("--status must be one of queued, running, waiting_input, waiting_takeover, completed, failed, aborted, cancelled")?;
            let runs = store.list_runs(status, plugin.as_deref(), None, limit).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&runs)?);
            } else {
                println!("{:>8}  {:<16}  {:<20}  {:>5}  {:>7}  THREAD", "ID", "STATUS", "PLUGIN", "FENCE", "ATTEMPT");
                for r in runs {
                    println!("{:>8}  {:<16}  {:<20}  {:>5}  {:>3}/{:<3}  {}", r.id, r.status, r.plugin, r.fence, r.attempt, r.max_attempts, r.thread_id);
                }
            }
        }
        RunsCommand::Show { id } => {
            let run = store.get_run(id).await?;
            println!("{}", serde_json::to_string_pretty(&run)?);
        }
    }
    Ok(())
}
