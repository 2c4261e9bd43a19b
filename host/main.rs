//! The `leasehold` binary.

mod cli;
mod config;
mod harness;
mod serve;

use cli::{dev, new, replay, run};

use std::path::PathBuf;

use anyhow::Result;
use clap::{Parser, Subcommand};
use leasehold::bench::BenchCommand;

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
    /// Set, list and remove concurrency keys' limits and the rate limits of effects (through the API).
    Limits {
        #[command(flatten)]
        api: cli::Api,
        #[command(subcommand)]
        command: cli::limits::LimitsCommand,
    },
    /// Make, list, change, pause, delete and backfill schedules (through the API).
    Schedules {
        #[command(flatten)]
        api: cli::Api,
        #[command(subcommand)]
        command: cli::schedules::SchedulesCommand,
    },
    /// Print a thread's events; --follow streams new ones.
    Events {
        #[command(flatten)]
        api: cli::Api,
        #[command(flatten)]
        args: cli::EventsArgs,
    },
    /// Show a database's migrations and contract steps, or take the steps
    /// once every host runs this release (on the database, not the API).
    Schema {
        #[command(subcommand)]
        command: cli::schema::SchemaCommand,
    },
    /// Print the dashboard's address with the API token in its fragment
    /// (which browsers never send to the server): open it to sign in.
    Dashboard {
        #[command(flatten)]
        api: cli::Api,
    },
    /// Serve on a SQLite database of the project's own, rebuilding and
    /// re-registering a plugin project (from `leasehold new`) whenever it
    /// changes, and printing its runs as they go.
    Dev {
        #[command(flatten)]
        args: dev::DevArgs,
    },
    /// Write a new plugin project: the WIT, a build, a turn using typed
    /// helpers, a test and a README.
    New {
        #[command(flatten)]
        args: new::NewArgs,
    },
    /// Run one turn of a component to its end on a throwaway SQLite
    /// database (no service needed), printing its stream and its output.
    Run {
        #[command(flatten)]
        args: run::RunArgs,
    },
    /// Replay a run's recorded ledger against a component, offline:
    /// nothing is performed; the first call that differs is reported, with
    /// exit status 1. For checking a new version before shipping it.
    Replay {
        #[command(flatten)]
        args: replay::ReplayArgs,
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

fn init_logs(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("LEASEHOLD_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colour on a terminal only: a log file or journal gets plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_timer(leasehold::clock::LogTime);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// mimalloc, not the system's allocator: glibc's `malloc` and `free` took
/// about 15% of the host's CPU in a drain (docs/benchmarks.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
        Command::Serve { config, options } => serve::serve(options.resolve(config.as_deref())?).await,
        Command::Bench { bench: BenchCommand::HarnessAdapter { plugin_file } } => harness::run(&plugin_file).await,
        Command::Bench { bench } => bench.run().await,
        Command::Plugins { api, command } => cli::plugins(&api, command).await,
        Command::Submit { api, args } => cli::submit(&api, args).await,
        Command::Runs { api, command } => cli::runs(&api, command).await,
        Command::Events { api, args } => cli::events(&api, args).await,
        Command::Limits { api, command } => cli::limits::limits(&api, command).await,
        Command::Schedules { api, command } => cli::schedules::schedules(&api, command).await,
        Command::Dashboard { api } => cli::dashboard(&api).await,
        Command::New { args } => new::new(args),
        Command::Dev { args } => {
            let (cfg, project) = dev::resolve(args)?;
            serve::serve_with(cfg, Some(project)).await
        }
        Command::Run { args } => {
            if !run::run(args).await? {
                std::process::exit(1);
            }
            Ok(())
        }
        Command::Schema { command } => cli::schema::schema(command).await,
        Command::Replay { args } => {
            if !replay::replay(args).await? {
                std::process::exit(1);
            }
            Ok(())
        }
        Command::Compile { max_instances, pool_max_memory_bytes } => {
            leasehold::runtime::compile_stdio(max_instances, pool_max_memory_bytes)
        }
    }
}
