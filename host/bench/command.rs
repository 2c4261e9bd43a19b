//! The `leasehold bench` subcommands: parse, run, print one JSON line.

use std::path::PathBuf;

use anyhow::Result;
use clap::Subcommand;

use super::claim::ClaimBench;
use super::dashboard::DashboardBench;
use super::drain::DrainBench;
use super::fairness::FairnessBench;
use super::e2e::E2eBench;
use super::submit::SubmitBench;
use crate::store::SqliteSync;

#[derive(Subcommand)]
pub enum BenchCommand {
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
    /// How fast the worker pool drains a backlog of queued runs of the
    /// test plugin, from first claim to last close on the database clock.
    /// Ends with one JSON line; with --peers, one line that also holds the
    /// peers' drains of the same backlog and the ratios.
    Drain {
        /// Database URL. It must hold no runs. Default: a temporary SQLite
        /// file, removed afterwards.
        #[arg(long)]
        database_url: Option<String>,
        /// Runs in the backlog.
        #[arg(long, default_value_t = 20_000)]
        runs: i64,
        /// `kv.put`s per run; 0 is a no-op turn.
        #[arg(long, default_value_t = 0)]
        steps: u64,
        /// `kv.get`s per run instead (each a ledger write of its own, where
        /// puts are held for the close). Not with `--steps`.
        #[arg(long, default_value_t = 0)]
        gets: u64,
        /// Worker pool size, as `serve --workers`.
        #[arg(long, default_value_t = 64)]
        workers: usize,
        /// Most runs per claim statement, as `serve --claim-batch`.
        #[arg(long, default_value_t = 64)]
        claim_batch: usize,
        /// The pool's local queue, as `serve --prefetch`. [default: as
        /// serve's: PostgreSQL 4 × --workers, at least 64; SQLite 64 below 8
        /// workers, else 0]
        #[arg(long)]
        prefetch: Option<usize>,
        /// Rounds; medians are reported.
        #[arg(long, default_value_t = 1)]
        rounds: usize,
        /// The test plugin.
        #[arg(long, default_value = "target/plugins/testkit.wasm")]
        plugin_file: PathBuf,
        /// SQLite only: PRAGMA synchronous, as `serve --sqlite-synchronous`.
        #[arg(long, default_value = "full")]
        sqlite_synchronous: SqliteSync,
        /// PostgreSQL: the vacuum loop's threshold, as `serve
        /// --pg-vacuum-dead-rows` (0: off).
        #[arg(long, default_value_t = 50_000)]
        pg_vacuum_dead_rows: i64,
        /// Give the backlog's runs this many concurrency keys, round robin
        /// (0: none).
        #[arg(long, default_value_t = 0)]
        keys: usize,
        /// With --keys: each key's limit (default: none, so keys only take
        /// turns).
        #[arg(long)]
        limit: Option<i64>,
        /// Before the drain, fill the table with this many finished runs of
        /// another plugin (completed, retention not yet due): does the
        /// claim slow down as history grows?
        #[arg(long, default_value_t = 0)]
        finished: i64,
        /// Before the drain, this many runs of another plugin that are open
        /// but not claimable: half asleep (queued, due in a day), half
        /// waiting for input that never comes.
        #[arg(long, default_value_t = 0)]
        sleeping: i64,
        /// Then run this script (`../shared/peers/run`) on the same
        /// PostgreSQL server with the same number of jobs and report
        /// leasehold's rate over each peer's. PostgreSQL only.
        #[arg(long)]
        peers: Option<PathBuf>,
        /// No progress lines on stderr.
        #[arg(long)]
        quiet: bool,
    },
    /// Fair shares: a small concurrency key's submit-to-start wait (p50,
    /// p99) alone, and beside a large key's backlog of --backlog runs; the
    /// ratio of the p99s. One JSON line.
    Fairness {
        /// Database URL. It must hold no runs. Default: a temporary SQLite
        /// file, removed afterwards.
        #[arg(long)]
        database_url: Option<String>,
        /// The large key's queued runs.
        #[arg(long, default_value_t = 100_000)]
        backlog: i64,
        /// The small key's runs, submitted one every --gap-ms.
        #[arg(long, default_value_t = 100)]
        small: usize,
        #[arg(long, default_value_t = 20)]
        gap_ms: u64,
        #[arg(long, default_value_t = 64)]
        workers: usize,
        #[arg(long, default_value_t = 64)]
        claim_batch: usize,
        /// As `serve --prefetch`. [default: as serve's]
        #[arg(long)]
        prefetch: Option<usize>,
        #[arg(long, default_value = "target/plugins/testkit.wasm")]
        plugin_file: PathBuf,
        #[arg(long, default_value = "full")]
        sqlite_synchronous: SqliteSync,
        /// No progress lines on stderr.
        #[arg(long)]
        quiet: bool,
    },
    /// The dashboard on a large database: loads --runs finished runs (once;
    /// a database it loaded before is reused), then times each page's API
    /// requests and, with Chromium and playwright-core (scripts/toolchains),
    /// each page from navigation to its data rendered. One JSON line.
    Dashboard {
        /// Database URL: an empty database, or one this bench loaded.
        #[arg(long)]
        database_url: String,
        #[arg(long, default_value_t = 1_000_000)]
        runs: i64,
        /// Timed loads of each page and request; medians are reported.
        #[arg(long, default_value_t = 7)]
        loads: usize,
        #[arg(long, default_value = "target/plugins/testkit.wasm")]
        plugin_file: PathBuf,
        #[arg(long, default_value = "tests/browser/timings.mjs")]
        script: PathBuf,
        #[arg(long, env = "CHROMIUM", default_value = "/usr/bin/chromium")]
        chromium: PathBuf,
        #[arg(long)]
        quiet: bool,
    },
    /// How fast the HTTP API takes runs in: keep-alive clients each
    /// submitting one run at a time while the worker pool drains, then
    /// batch submits. Ends with one JSON line.
    Submit {
        /// Database URL. It must hold no runs. Default: a temporary SQLite
        /// file, removed afterwards.
        #[arg(long)]
        database_url: Option<String>,
        /// Runs per phase.
        #[arg(long, default_value_t = 20_000)]
        runs: i64,
        /// Keep-alive clients, each one `POST /v1/runs` at a time.
        #[arg(long, default_value_t = 64)]
        clients: usize,
        /// Runs per `POST /v1/runs:batch` in the batch phase.
        #[arg(long, default_value_t = 1_000)]
        batch: usize,
        /// Clients of the batch phase.
        #[arg(long, default_value_t = 4)]
        batch_clients: usize,
        /// Worker pool size, draining during the single phase.
        #[arg(long, default_value_t = 64)]
        workers: usize,
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
    /// leasehold as an adapter of the public PostgreSQL job-queue benchmark
    /// harness (benches/harness/README.md): serves a host in this process
    /// on DATABASE_URL with WORKER_COUNT workers, registers the test plugin
    /// as `harness-noop` through the API, submits runs through the API's
    /// batch submit at the harness's rate and prints the harness's JSONL
    /// metrics on stdout. Reads the harness's environment (PRODUCER_RATE,
    /// PRODUCER_PACING, JOB_WORK_MS, SAMPLE_EVERY_S, …); the host's own
    /// settings come from the usual LEASEHOLD_* variables. Runs until
    /// SIGTERM.
    HarnessAdapter {
        /// The test plugin's component (`scripts/build-plugins` builds it).
        #[arg(long, env = "LEASEHOLD_HARNESS_PLUGIN", default_value = "target/plugins/testkit.wasm")]
        plugin_file: PathBuf,
    },
}

impl BenchCommand {
    /// Runs the bench and prints its result as one JSON line on stdout.
    pub async fn run(self) -> Result<()> {
        match self {
            // It serves a host, which is the binary's (`leasehold bench
            // harness-adapter` runs it there).
            BenchCommand::HarnessAdapter { .. } => anyhow::bail!("the harness adapter runs in the leasehold binary"),
            BenchCommand::E2e { database_url, runs, concurrency, submitters, rounds, plugin_file, sqlite_synchronous, quiet } => {
                let submitters = submitters.unwrap_or(concurrency);
                anyhow::ensure!(
                    runs > 0 && concurrency > 0 && submitters > 0 && rounds > 0,
                    "--runs, --concurrency, --submitters and --rounds must be positive"
                );
                let db = BenchDb::new(database_url.clone(), "leasehold-bench-e2e");
                let url = db.url.clone();
                let bench = E2eBench {
                    database_url: url,
                    runs,
                    concurrency,
                    submitters,
                    rounds,
                    plugin_file,
                    cache_dir: crate::runtime::default_cache_dir(),
                    progress: !quiet,
                    sqlite_sync: sqlite_synchronous,
                };
                let result = bench.run().await;
                drop(db);
                println!("{}", serde_json::to_string(&result?)?);
                Ok(())
            }
            BenchCommand::Fairness { database_url, backlog, small, gap_ms, workers, claim_batch, prefetch, plugin_file, sqlite_synchronous, quiet } => {
                anyhow::ensure!(backlog > 0 && small > 0 && workers > 0 && claim_batch > 0, "--backlog, --small, --workers and --claim-batch must be positive");
                let db = BenchDb::new(database_url, "leasehold-bench-fairness");
                let url = db.url.clone();
                let bench = FairnessBench {
                    database_url: url.clone(),
                    backlog,
                    small,
                    gap_ms,
                    workers,
                    claim_batch,
                    prefetch: prefetch.unwrap_or_else(|| serves_prefetch(&url, workers)),
                    plugin_file,
                    cache_dir: crate::runtime::default_cache_dir(),
                    progress: !quiet,
                    sqlite_sync: sqlite_synchronous,
                };
                let result = bench.run().await;
                drop(db);
                println!("{}", serde_json::to_string(&result?)?);
                Ok(())
            }
            BenchCommand::Drain { database_url, runs, steps, gets, workers, claim_batch, prefetch, rounds, plugin_file, sqlite_synchronous, pg_vacuum_dead_rows, keys, limit, finished, sleeping, peers, quiet } => {
                anyhow::ensure!(
                    runs > 0 && workers > 0 && claim_batch > 0 && rounds > 0,
                    "--runs, --workers, --claim-batch and --rounds must be positive"
                );
                anyhow::ensure!(steps == 0 || gets == 0, "--steps and --gets are two workloads: give one");
                anyhow::ensure!(limit.is_none() || keys > 0, "--limit is each key's: give --keys too");
                anyhow::ensure!(finished >= 0 && sleeping >= 0, "--finished and --sleeping count runs: give 0 or more");
                if let Some(l) = limit {
                    crate::store::concurrency::check_concurrency(l).map_err(anyhow::Error::msg)?;
                }
                if peers.is_some() && database_url.as_deref().is_none_or(|u| u.starts_with("sqlite:")) {
                    anyhow::bail!("--peers needs a PostgreSQL --database-url: the peers run on PostgreSQL");
                }
                let db = BenchDb::new(database_url.clone(), "leasehold-bench-drain");
                let url = db.url.clone();
                let bench = DrainBench {
                    database_url: url.clone(),
                    runs,
                    steps,
                    gets,
                    workers,
                    claim_batch,
                    prefetch: prefetch.unwrap_or_else(|| serves_prefetch(&url, workers)),
                    rounds,
                    plugin_file,
                    cache_dir: crate::runtime::default_cache_dir(),
                    progress: !quiet,
                    sqlite_sync: sqlite_synchronous,
                    pg_vacuum_dead_rows,
                    keys,
                    limit,
                    finished,
                    sleeping,
                };
                let result = bench.run().await;
                drop(db);
                let result = result?;
                match peers {
                    None => println!("{}", serde_json::to_string(&result)?),
                    Some(script) => {
                        let lines = super::peers::run(&script, &url, runs)?;
                        let ratios = super::peers::ratios(result.runs_per_sec, &lines);
                        let out = serde_json::json!({ "drain": result, "peers": lines, "ratios": ratios });
                        println!("{out}");
                    }
                }
                Ok(())
            }
            BenchCommand::Submit { database_url, runs, clients, batch, batch_clients, workers, plugin_file, sqlite_synchronous, quiet } => {
                anyhow::ensure!(
                    runs > 0 && clients > 0 && batch_clients > 0 && workers > 0,
                    "--runs, --clients, --batch-clients and --workers must be positive"
                );
                anyhow::ensure!((1..=crate::store::MAX_SUBMIT_BATCH).contains(&batch), "--batch must be 1 to {}", crate::store::MAX_SUBMIT_BATCH);
                let db = BenchDb::new(database_url.clone(), "leasehold-bench-submit");
                let bench = SubmitBench {
                    database_url: db.url.clone(),
                    runs,
                    clients,
                    batch,
                    batch_clients,
                    workers,
                    plugin_file,
                    cache_dir: crate::runtime::default_cache_dir(),
                    progress: !quiet,
                    sqlite_sync: sqlite_synchronous,
                };
                let result = bench.run().await;
                drop(db);
                println!("{}", serde_json::to_string(&result?)?);
                Ok(())
            }
            BenchCommand::Dashboard { database_url, runs, loads, plugin_file, script, chromium, quiet } => {
                anyhow::ensure!(runs > 0 && loads > 0, "--runs and --loads must be positive");
                let bench = DashboardBench { database_url, runs, plugin_file, script, chromium, loads, progress: !quiet };
                println!("{}", serde_json::to_string(&bench.run().await?)?);
                Ok(())
            }
            BenchCommand::Claim { database_url, runs, concurrency, batch, finished, synchronous, rounds, quiet } => {
                anyhow::ensure!(runs > 0 && concurrency > 0 && batch > 0 && rounds > 0, "--runs, --concurrency, --batch and --rounds must be positive");
                let db = BenchDb::new(database_url.clone(), "leasehold-bench");
                let url = db.url.clone();
                let bench = ClaimBench { database_url: url, runs, concurrency, batch, finished, sqlite_sync: synchronous, rounds, progress: !quiet };
                let result = bench.run().await;
                drop(db);
                println!("{}", serde_json::to_string(&result?)?);
                Ok(())
            }
        }
    }
}

/// The bench's database: the given URL, or a temporary SQLite file that is
/// removed (with its WAL files) when this is dropped.
struct BenchDb {
    url: String,
    temp: Option<PathBuf>,
}

impl BenchDb {
    fn new(url: Option<String>, name: &str) -> BenchDb {
        match url {
            Some(url) => BenchDb { url, temp: None },
            None => {
                let path = std::env::temp_dir().join(format!("{name}-{}.db", std::process::id()));
                BenchDb { url: format!("sqlite://{}", path.display()), temp: Some(path) }
            }
        }
    }
}

impl Drop for BenchDb {
    fn drop(&mut self) {
        let Some(path) = &self.temp else { return };
        for suffix in ["", "-wal", "-shm"] {
            let mut p = path.clone().into_os_string();
            p.push(suffix);
            let _ = std::fs::remove_file(p);
        }
    }
}

/// `serve`'s local queue for `workers` on the database at `url`.
fn serves_prefetch(url: &str, workers: usize) -> usize {
    let backend = crate::store::Backend::from_url(url).unwrap_or(crate::store::Backend::Sqlite);
    crate::pool::PoolConfig::default_prefetch(workers, backend)
}
