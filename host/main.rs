//! The `leasehold` binary.

mod cli;
mod config;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use leasehold::api::{self, ApiConfig, AppState};
use leasehold::bench::ClaimBench;
use leasehold::effects::model::ModelConfig;
use leasehold::executor::{Executor, ExecutorConfig};
use leasehold::plugins::{self, PluginSettings};
use leasehold::pool::{PoolConfig, WorkerPool};
use leasehold::reaper::{self, ReaperConfig};
use leasehold::runtime::{Runtime, RuntimeConfig};
use leasehold::store::{SqliteSync, Store, StoreError, StoreOptions};
use tokio::sync::watch;

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

// Parsed once at start-up: the size of the `serve` variant does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Run the service: the HTTP API, the worker pool and the reaper, on one
    /// database, until SIGTERM or Ctrl-C. Several hosts may share one
    /// PostgreSQL database.
    Serve {
        /// A TOML file with any of the options below (snake_case keys);
        /// flags and environment variables take precedence.
        #[arg(long, env = "LEASEHOLD_CONFIG")]
        config: Option<PathBuf>,
        #[command(flatten)]
        options: config::ServeOptions,
    },
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        bench: BenchCommand,
    },
    /// Register or list plugins (through the API).
    Plugins {
        #[command(flatten)]
        api: cli::Api,
        #[command(subcommand)]
        command: cli::PluginsCommand,
    },
    /// Submit a run (through the API).
    Submit {
        #[command(flatten)]
        api: cli::Api,
        #[command(flatten)]
        args: cli::SubmitArgs,
    },
    /// Inspect, answer and cancel runs (through the API).
    Runs {
        #[command(flatten)]
        api: cli::Api,
        #[command(subcommand)]
        command: cli::RunsCommand,
    },
    /// Print a thread's events; --follow streams new ones.
    Events {
        #[command(flatten)]
        api: cli::Api,
        #[command(flatten)]
        args: cli::EventsArgs,
    },
    /// Internal: `serve`'s compiler child. Reads a component on stdin and
    /// writes it compiled, for an engine of these settings, on stdout.
    #[command(name = "__compile", hide = true)]
    Compile {
        #[arg(long)]
        max_instances: u32,
        #[arg(long)]
        pool_max_memory_bytes: usize,
    },
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Whole-lifecycle throughput (submit, claim, instantiate, one effect,
    /// close) through the worker pool, against raw claim+close SQL, and
    /// submit→start latency at half the peak rate. Ends with one JSON line.
    E2e {
        /// Database URL. It must hold no runs. Default: a temporary SQLite
        /// file, removed afterwards.
        #[arg(long)]
        database_url: Option<String>,
        /// Runs per phase.
        #[arg(long, default_value_t = 2_000)]
        runs: i64,
        /// Workers (and baseline tasks). The default saturates both phases
        /// on a 2-core machine: with 8, neither the baseline (about 3900
        /// claim+close/s on PostgreSQL, against about 4500 with 64) nor the
        /// peak (whose closes wait on the batch in flight) is at its peak.
        #[arg(long, default_value_t = 64)]
        concurrency: usize,
        /// Tasks submitting runs in the peak phase, each one submit at a
        /// time (the host group-commits submits made at once). Default:
        /// --concurrency.
        #[arg(long)]
        submitters: Option<usize>,
        /// Rounds of (peak, baseline), alternating order; medians are
        /// reported.
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// The one-effect plugin (the Rust test plugin).
        #[arg(long, default_value = "target/plugins/testkit.wasm")]
        plugin_file: PathBuf,
        /// SQLite only: PRAGMA synchronous, as `serve --sqlite-synchronous`.
        #[arg(long, default_value = "full")]
        sqlite_synchronous: SqliteSync,
        /// No progress lines on stderr.
        #[arg(long)]
        quiet: bool,
    },
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
        #[arg(long, default_value = "full")]
        synchronous: SqliteSync,
        /// Rounds of (baseline, claim), alternating order; medians are reported.
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// No progress lines on stderr.
        #[arg(long)]
        quiet: bool,
    },
}

fn init_logs(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("LEASEHOLD_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_timer(leasehold::clock::LogTime);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    init_logs(cli.log_format);
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: starting the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // One readable line (with its causes), not a backtrace.
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Serve { config, options } => serve(options.resolve(config.as_deref())?).await,
        Command::Bench { bench: BenchCommand::E2e { database_url, runs, concurrency, submitters, rounds, plugin_file, sqlite_synchronous, quiet } } => {
            let submitters = submitters.unwrap_or(concurrency);
            anyhow::ensure!(
                runs > 0 && concurrency > 0 && submitters > 0 && rounds > 0,
                "--runs, --concurrency, --submitters and --rounds must be positive"
            );
            let temp = database_url.is_none().then(|| {
                std::env::temp_dir().join(format!("leasehold-bench-e2e-{}.db", std::process::id()))
            });
            let url = match (&database_url, &temp) {
                (Some(u), _) => u.clone(),
                (_, Some(p)) => format!("sqlite://{}", p.display()),
                (None, None) => unreachable!(),
            };
            let bench = leasehold::bench_e2e::E2eBench {
                database_url: url,
                runs,
                concurrency,
                submitters,
                rounds,
                plugin_file,
                cache_dir: leasehold::runtime::default_cache_dir(),
                progress: !quiet,
                sqlite_sync: sqlite_synchronous,
            };
            let result = bench.run().await;
            if let Some(p) = temp {
                remove_sqlite(&p);
            }
            println!("{}", serde_json::to_string(&result?)?);
            Ok(())
        }
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
        Command::Plugins { api, command } => cli::plugins(&api, command).await,
        Command::Submit { api, args } => cli::submit(&api, args).await,
        Command::Runs { api, command } => cli::runs(&api, command).await,
        Command::Events { api, args } => cli::events(&api, args).await,
        Command::Compile { max_instances, pool_max_memory_bytes } => {
            leasehold::runtime::compile_stdio(max_instances, pool_max_memory_bytes)
        }
    }
}

fn remove_sqlite(path: &std::path::Path) {
    for suffix in ["", "-wal", "-shm"] {
        let mut p = PathBuf::from(path).into_os_string();
        p.push(suffix);
        let _ = std::fs::remove_file(p);
    }
}

async fn serve(cfg: config::Serve) -> Result<()> {
    if cfg.test_clock_skew_ms != 0 {
        leasehold::clock::set_skew_ms(cfg.test_clock_skew_ms);
        tracing::warn!(skew_ms = cfg.test_clock_skew_ms, "test setting: this host's wall clock is skewed");
    }
    let options = StoreOptions { sqlite_sync: cfg.sqlite_sync, ..StoreOptions::default() };
    let store = connect_with_retry(&cfg.database_url, options).await?;
    if cfg.sqlite_sync == SqliteSync::Normal && store.backend() == leasehold::Backend::Sqlite {
        tracing::warn!(
            "--sqlite-synchronous normal: a power loss or OS crash may lose the last commits, \
             and an unkeyed effect whose started record was lost would be made again"
        );
    }
    let mut runtime_config = RuntimeConfig {
        cache_dir: cfg.cache_dir.clone(),
        max_instances: cfg.max_instances,
        // Uploads compile in a child process, stopped with the request.
        compiler: Some(std::env::current_exe().context("finding this program, to compile components with")?),
        ..RuntimeConfig::default()
    };
    runtime_config.default_limits.segment_budget = cfg.segment_budget;
    let runtime = Arc::new(Runtime::new(runtime_config)?);
    if cfg.plugins_dir.is_dir() {
        let settings = PluginSettings { http_allow: cfg.http_allow.clone() };
        let loaded = plugins::load_dir(&store, &runtime, &cfg.plugins_dir, &settings)
            .await
            .with_context(|| format!("reading {}", cfg.plugins_dir.display()))?;
        tracing::info!(dir = %cfg.plugins_dir.display(), plugins = ?loaded, "plugins directory loaded");
    } else {
        tracing::info!(dir = %cfg.plugins_dir.display(), "no plugins directory; register plugins with `leasehold plugins add`");
    }
    let model = cfg.model_base_url.clone().map(|url| {
        let mut m = ModelConfig::new(url);
        if let Some(name) = &cfg.model {
            m.default_model = name.clone();
        }
        Arc::new(m)
    });
    if model.is_none() {
        tracing::info!("no --model-base-url: model.chat is denied to plugins");
    }
    // Guests' http never reaches this API unless an allow-list entry names
    // its port.
    let mut exec_config =
        ExecutorConfig { lease_ttl: cfg.lease_ttl, model, reserved: vec![cfg.listen], ..ExecutorConfig::default() };
    if let Some(owner) = &cfg.owner {
        exec_config.owner = owner.clone();
    }
    let owner = exec_config.owner.clone();
    let executor = Arc::new(Executor::new(store.clone(), runtime.clone(), exec_config));
    let pool = WorkerPool::start(store.clone(), executor, PoolConfig { workers: cfg.workers, poll: cfg.poll, claim_batch: cfg.claim_batch });

    let (stop_tx, stop_rx) = watch::channel(false);
    let reaper = tokio::spawn(reaper_loop(store.clone(), cfg.reaper_interval, stop_rx.clone()));
    let api_config = ApiConfig {
        token: cfg.api_token.clone(),
        allowed_hosts: cfg.allowed_hosts.clone(),
        max_body_bytes: cfg.max_body_bytes,
        max_component_bytes: cfg.max_component_bytes,
        request_timeout: cfg.request_timeout,
        ..ApiConfig::default()
    };
    let state = AppState::new(store.clone(), runtime, api_config, stop_rx.clone());
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .with_context(|| format!("listening on {}", cfg.listen))?;
    let mut server_stop = stop_rx.clone();
    let server = tokio::spawn(
        axum::serve(listener, api::router(state))
            .with_graceful_shutdown(async move {
                let _ = server_stop.wait_for(|s| *s).await;
            })
            .into_future(),
    );
    tracing::info!(
        listen = %cfg.listen,
        backend = store.backend().name(),
        database = %store.url_redacted(),
        workers = cfg.workers,
        owner = %owner,
        auth = cfg.api_token.is_some(),
        "leasehold is up"
    );
    match (&cfg.api_token, &cfg.token_file) {
        (Some(_), Some(file)) => tracing::info!(
            token_file = %file.display(),
            "clients send the API token in this file as Authorization: Bearer …; the CLI reads it from there"
        ),
        (Some(_), None) => {}
        (None, _) => tracing::warn!(
            listen = %cfg.listen,
            "--insecure: the API needs no token; anyone who can reach it may submit runs and replace plugins"
        ),
    }
    shutdown_signal().await;
    tracing::info!(grace = ?cfg.shutdown_grace, "shutting down: no new claims");
    let _ = stop_tx.send(true);
    pool.shutdown(cfg.shutdown_grace).await;
    let _ = reaper.await;
    match server.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::error!(error = %e, "HTTP server error"),
        Err(e) => tracing::error!(error = %e, "HTTP server task failed"),
    }
    store.shutdown().await;
    tracing::info!("stopped");
    Ok(())
}

/// Opens the database, retrying with backoff while it is unreachable (a
/// host may start before its database). Says at once when it cannot be
/// reached, and why; never logs its password. Ctrl-C gives up.
async fn connect_with_retry(url: &str, options: StoreOptions) -> Result<Store> {
    let shown = leasehold::redact::url(url);
    let mut backoff = Duration::from_millis(500);
    let give_up = shutdown_signal();
    tokio::pin!(give_up);
    loop {
        // One connection first: a pool's connect retries quietly for its
        // whole acquire timeout before it reports anything.
        let opened = match Store::probe(url, Duration::from_secs(10)).await {
            Ok(()) => Store::connect_with(url, options.clone()).await,
            Err(e) => Err(e),
        };
        match opened {
            Ok(store) => return Ok(store),
            Err(e @ (StoreError::Config(_) | StoreError::Migrate(_))) => {
                return Err(anyhow::Error::new(e).context(format!("opening the database {shown}")));
            }
            Err(e) => {
                tracing::warn!(database = %shown, error = %e, ?backoff, "the database cannot be reached; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = &mut give_up => anyhow::bail!("interrupted while waiting for the database {shown}"),
                }
                backoff = (backoff * 2).min(Duration::from_secs(10));
            }
        }
    }
}

/// Every write of the reaper is fenced, so any number of hosts may run it.
async fn reaper_loop(store: Store, every: Duration, mut stop: watch::Receiver<bool>) {
    let config = ReaperConfig::default();
    let mut tick = tokio::time::interval(every.max(Duration::from_millis(10)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let metrics = leasehold::metrics::global();
    loop {
        tokio::select! {
            _ = async { let _ = stop.wait_for(|s| *s).await; } => return,
            _ = tick.tick() => match reaper::tick(&store, &config).await {
                Ok(report) => {
                    metrics.reaped_resumable.fetch_add(report.resumable.len() as u64, Ordering::Relaxed);
                    metrics.reaped_aborted.fetch_add(report.aborted.len() as u64, Ordering::Relaxed);
                    if !report.resumable.is_empty() || !report.aborted.is_empty() {
                        tracing::info!(resumable = ?report.resumable, aborted = ?report.aborted, "reaped expired runs");
                    }
                }
                // A database hiccup must not take the service down.
                Err(e) => tracing::warn!(error = %e, "reaper tick failed"),
            },
        }
    }
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
