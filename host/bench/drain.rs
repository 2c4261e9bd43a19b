//! `leasehold bench drain`: how fast the real worker pool drains a backlog.
//!
//! Loads `runs` queued runs of the test plugin the way a user's backlog
//! looks (each with its thread, its `submitted` event and its secret,
//! written by the batch submit, [`Store::create_runs`]), then starts the
//! worker pool that `serve` runs and times it to the last close. Each run
//! is a no-op turn (`steps` 0), makes `steps` `kv.put`s, or `gets`
//! `kv.get`s. The rate is
//! measured on the database clock, from the first claim (the earliest
//! `started_at`) to the last close (the latest `finished_at`), and over the
//! first and the last tenth of the runs to finish, so a drain that slows
//! as it goes shows it. It also reports this process's CPU time per run
//! (on SQLite that includes the database's work, which runs in process).
//!
//! This is the workload of `../shared/peers/run` (graphile-worker and
//! pg-boss draining pre-queued no-op jobs), so the two compare as a ratio
//! measured in one sitting.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use sqlx::Row;

use super::BenchError;
use crate::executor::Executor;
use crate::pool::{PoolConfig, WorkerPool};
use crate::maintenance::vacuum::VacuumConfig;
use crate::store::{MAX_SUBMIT_BATCH, NewRun, RunStatus, SqliteSync, Store, StoreError, StoreOptions, sql};

/// The plugin the bench registers: the Rust test plugin.
const PLUGIN: &str = "bench-drain";

/// The plugin name of the runs loaded beside the backlog (`--finished`,
/// `--sleeping`): never registered, so never run.
const BALLAST: &str = "bench-drain-ballast";

/// Settings of `bench drain`. The CLI's defaults are in brackets.
pub struct DrainBench {
    pub database_url: String,
    /// Runs loaded and drained per round. [20,000]
    pub runs: i64,
    /// `kv.put`s per run; 0 is a no-op turn. [0]
    pub steps: u64,
    /// `kv.get`s per run instead of puts: each is a ledger write of its
    /// own (puts are held for the close). [0]
    pub gets: u64,
    /// The pool's workers. [64]
    pub workers: usize,
    /// Most runs per claim statement. [64]
    pub claim_batch: usize,
    /// The pool's local queue ([`PoolConfig::prefetch`]). [0]
    pub prefetch: usize,
    /// Rounds; medians are reported. [1]
    pub rounds: usize,
    /// The test plugin's component (`scripts/build-plugins` builds it).
    pub plugin_file: PathBuf,
    pub cache_dir: PathBuf,
    pub progress: bool,
    /// SQLite's `synchronous`. [full]
    pub sqlite_sync: SqliteSync,
    /// PostgreSQL: the vacuum loop `serve` runs beside the pool
    /// ([`VacuumConfig::dead_rows`]; 0 is off). [50,000]
    pub pg_vacuum_dead_rows: i64,
    /// Concurrency keys the backlog's runs carry, round robin (0: none).
    pub keys: usize,
    /// Each key's limit (`None`: none).
    pub limit: Option<i64>,
    /// Finished runs of another plugin in the table before the drain. [0]
    pub finished: i64,
    /// Open runs of another plugin that are not claimable during the
    /// drain: half queued with a wake-up a day away (a durable sleep),
    /// half waiting for input. [0]
    pub sleeping: i64,
}

/// The one JSON line the bench ends with.
#[derive(Debug, Clone, Serialize)]
pub struct DrainResult {
    pub backend: &'static str,
    pub runs: i64,
    pub steps: u64,
    pub gets: u64,
    pub workers: usize,
    pub claim_batch: usize,
    pub prefetch: usize,
    pub rounds: usize,
    /// First claim to last close, on the database clock (median of rounds).
    pub runs_per_sec: f64,
    /// Over the first tenth of the runs to finish.
    pub first_tenth_per_sec: f64,
    /// Over the last tenth of the runs to finish.
    pub last_tenth_per_sec: f64,
    /// This process's CPU time (user and system, all threads) per run.
    pub cpu_us_per_run: f64,
    /// How long loading the backlog took, in seconds.
    pub load_s: f64,
    /// Closes written per commit: how full the group-commit batches ran.
    pub closes_per_commit: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sqlite_synchronous: Option<SqliteSync>,
    /// PostgreSQL: the vacuum loop's threshold, and the vacuums it ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pg_vacuum_dead_rows: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pg_vacuums: Option<u64>,
    /// Concurrency keys, and each one's limit.
    pub keys: usize,
    pub limit: Option<i64>,
    /// Finished, and sleeping or waiting, runs beside the backlog.
    pub finished: i64,
    pub sleeping: i64,
}

/// One round's figures.
struct Round {
    vacuums: u64,
    rate: f64,
    first: f64,
    last: f64,
    cpu_us: f64,
    load_s: f64,
    closes_per_commit: f64,
}

impl DrainBench {
    pub async fn run(&self) -> Result<DrainResult, BenchError> {
        let opts = StoreOptions {
            max_connections: Some(self.workers as u32 + 8),
            sqlite_sync: self.sqlite_sync,
            ..Default::default()
        };
        let store = Store::connect_with(&self.database_url, opts).await?;
        let exec = super::executor_with_plugin(&store, &self.plugin_file, &self.cache_dir, PLUGIN, self.workers, "bench-drain").await?;
        self.load_ballast(&store).await?;
        let rounds = self.rounds.max(1);
        let mut done = Vec::with_capacity(rounds);
        for round in 0..rounds {
            if round > 0 {
                clear(&store, PLUGIN, false).await?;
            }
            done.push(self.round(&store, &exec, round).await?);
        }
        self.check_ballast(&store).await?;
        clear(&store, PLUGIN, true).await?;
        clear(&store, BALLAST, false).await?;
        store.shutdown().await;
        let median = |f: fn(&Round) -> f64| super::median(&mut done.iter().map(f).collect::<Vec<_>>());
        Ok(DrainResult {
            backend: store.backend().name(),
            runs: self.runs,
            steps: self.steps,
            gets: self.gets,
            workers: self.workers,
            claim_batch: self.claim_batch,
            prefetch: self.prefetch,
            rounds,
            runs_per_sec: median(|r| r.rate).round(),
            first_tenth_per_sec: median(|r| r.first).round(),
            last_tenth_per_sec: median(|r| r.last).round(),
            cpu_us_per_run: (median(|r| r.cpu_us) * 10.0).round() / 10.0,
            load_s: (median(|r| r.load_s) * 100.0).round() / 100.0,
            closes_per_commit: (median(|r| r.closes_per_commit) * 10.0).round() / 10.0,
            sqlite_synchronous: (store.backend() == crate::store::Backend::Sqlite).then_some(self.sqlite_sync),
            pg_vacuum_dead_rows: (store.backend() == crate::store::Backend::Postgres).then_some(self.pg_vacuum_dead_rows),
            pg_vacuums: (store.backend() == crate::store::Backend::Postgres).then(|| done.iter().map(|r| r.vacuums).sum()),
            keys: self.keys,
            limit: self.limit,
            finished: self.finished,
            sleeping: self.sleeping,
        })
    }

    /// The runs beside the backlog are as loaded: no claim took one.
    async fn check_ballast(&self, store: &Store) -> Result<(), BenchError> {
        let asleep = self.sleeping / 2;
        for (status, want) in [(RunStatus::Completed, self.finished), (RunStatus::Queued, asleep), (RunStatus::WaitingInput, self.sleeping - asleep)] {
            let n: i64 = sqlx::query_scalar(sql!(store, "SELECT COUNT(*) FROM runs WHERE plugin = $1 AND status = $2 AND fence = 0"))
                .bind(BALLAST)
                .bind(status.as_str())
                .fetch_one(store.pool())
                .await
                .map_err(StoreError::from)?;
            if n != want {
                return Err(BenchError::Setup(format!("{n} of the {want} {} runs loaded beside the backlog are left as loaded", status.as_str())));
            }
        }
        Ok(())
    }

    /// The runs beside the backlog, loaded once for all rounds: `finished`
    /// completed ones, and `sleeping` open ones no claim may take during
    /// the drain.
    async fn load_ballast(&self, store: &Store) -> Result<(), BenchError> {
        if self.finished == 0 && self.sleeping == 0 {
            return Ok(());
        }
        let loading = Instant::now();
        // In slices: one statement of a million rows holds a lot of memory
        // on SQLite's side.
        const SLICE: i64 = 100_000;
        let load = |n: i64, status: RunStatus| async move {
            let mut left = n;
            while left > 0 {
                store.bulk_load(left.min(SLICE), BALLAST, status).await?;
                left -= SLICE;
            }
            Ok::<_, StoreError>(())
        };
        load(self.finished, RunStatus::Completed).await?;
        // Finished as a real close leaves them: when, and from when.
        sqlx::query(sql!(store, "UPDATE runs SET started_at = created_at, finished_at = created_at WHERE plugin = $1 AND status = $2"))
            .bind(BALLAST)
            .bind(RunStatus::Completed.as_str())
            .execute(store.writer())
            .await
            .map_err(StoreError::from)?;
        let asleep = self.sleeping / 2;
        load(asleep, RunStatus::Queued).await?;
        sqlx::query(sql!(store, "UPDATE runs SET not_before = not_before + 86400000 WHERE plugin = $1 AND status = $2"))
            .bind(BALLAST)
            .bind(RunStatus::Queued.as_str())
            .execute(store.writer())
            .await
            .map_err(StoreError::from)?;
        load(self.sleeping - asleep, RunStatus::WaitingInput).await?;
        self.say(format_args!(
            "loaded {} finished and {} sleeping or waiting runs beside the backlog in {:.1} s",
            self.finished,
            self.sleeping,
            loading.elapsed().as_secs_f64()
        ));
        Ok(())
    }

    async fn round(&self, store: &Store, exec: &Arc<Executor>, round: usize) -> Result<Round, BenchError> {
        let loading = Instant::now();
        if let Some(limit) = self.limit {
            for k in 0..self.keys {
                store.set_limit(&format!("k{k}"), Some(limit), false).await?;
            }
        }
        let mut loaded = 0;
        while loaded < self.runs {
            let n = (self.runs - loaded).min(MAX_SUBMIT_BATCH as i64);
            let key = |i: i64| (self.keys > 0).then(|| format!("k{}", i as usize % self.keys));
            let batch: Vec<NewRun> = (loaded..loaded + n)
                .map(|i| NewRun { concurrency_key: key(i), ..NewRun::new(PLUGIN, self.input(round, i)) })
                .collect();
            store.create_runs(&batch).await?;
            loaded += n;
        }
        let load_s = loading.elapsed().as_secs_f64();
        self.say(format_args!("loaded {} runs in {load_s:.2} s", self.runs));
        // The tables as a vacuumed, analyzed backlog: where autovacuum is
        // off, the load's dead versions would otherwise be measured too.
        super::vacuum(
            store,
            &["VACUUM ANALYZE runs", "VACUUM ANALYZE threads", "VACUUM ANALYZE events", "VACUUM ANALYZE effects", "VACUUM ANALYZE kv"],
        )
        .await?;

        let cpu = cpu_time();
        let closes = store.closes_written();
        let started = Instant::now();
        let pool = WorkerPool::start(
            store.clone(),
            exec.clone(),
            PoolConfig { workers: self.workers, poll: Duration::from_millis(100), claim_batch: self.claim_batch, prefetch: self.prefetch },
        );
        // Beside the pool, as `serve` runs it.
        let (stop_vacuum, stop) = tokio::sync::watch::channel(false);
        let vacuums = crate::metrics::global().runs_vacuums.load(std::sync::atomic::Ordering::Relaxed);
        let config = VacuumConfig { dead_rows: self.pg_vacuum_dead_rows, ..VacuumConfig::default() };
        let vacuum = tokio::spawn(crate::maintenance::vacuum::run(store.clone(), config, Duration::from_secs(1), stop));
        self.wait_drained(store).await?;
        let _ = stop_vacuum.send(true);
        let _ = vacuum.await;
        let vacuums = crate::metrics::global().runs_vacuums.load(std::sync::atomic::Ordering::Relaxed) - vacuums;
        let cpu_us = (cpu_time() - cpu).as_secs_f64() * 1e6 / self.runs as f64;
        let (written, commits) = store.closes_written();
        let closes_per_commit = (written - closes.0) as f64 / ((commits - closes.1).max(1) as f64);
        let wall = started.elapsed();
        pool.shutdown(Duration::from_secs(10)).await;

        let row = sqlx::query(sql!(
            store,
            "SELECT COUNT(*) AS n, MIN(started_at) AS first_claim, MAX(finished_at) AS last_close FROM runs WHERE status = $1 AND plugin = $2"
        ))
        .bind(RunStatus::Completed.as_str())
        .bind(PLUGIN)
        .fetch_one(store.pool())
        .await
        .map_err(StoreError::from)?;
        let completed: i64 = row.try_get("n").map_err(StoreError::from)?;
        if completed != self.runs {
            return Err(BenchError::Miscount { got: completed as u64, want: self.runs });
        }
        let (first_claim, last_close): (i64, i64) =
            (row.try_get("first_claim").map_err(StoreError::from)?, row.try_get("last_close").map_err(StoreError::from)?);
        let finished: Vec<i64> = sqlx::query_scalar(sql!(store, "SELECT finished_at FROM runs WHERE plugin = $1 ORDER BY finished_at"))
            .bind(PLUGIN)
            .fetch_all(store.pool())
            .await
            .map_err(StoreError::from)?;
        let tenth = (finished.len() / 10).max(1);
        let per_sec = |n: usize, ms: i64| n as f64 * 1000.0 / (ms.max(1) as f64);
        let rate = per_sec(finished.len(), last_close - first_claim);
        let first = per_sec(tenth, finished[tenth - 1] - first_claim);
        let last = per_sec(tenth, last_close - finished[finished.len() - tenth - 1]);
        self.say(format_args!(
            "drained {} runs in {wall:?}: {rate:.0}/s (first tenth {first:.0}/s, last tenth {last:.0}/s), {cpu_us:.1} µs CPU per run",
            self.runs
        ));
        Ok(Round { rate, first, last, cpu_us, load_s, vacuums, closes_per_commit })
    }

    fn input(&self, round: usize, i: i64) -> String {
        // Keys of their own: runs that all wrote one key would queue on its
        // row lock and measure that row.
        if self.gets > 0 {
            return serde_json::json!({ "mode": "gets", "n": self.gets }).to_string();
        }
        serde_json::json!({ "steps": self.steps, "prefix": format!("d{round}-{i}") }).to_string()
    }

    /// Until no run is claimable or running; then every run must be done.
    async fn wait_drained(&self, store: &Store) -> Result<(), BenchError> {
        let shown = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let _bar = self.progress.then(|| super::progress::Progress::start("drained", self.runs as u64, shown.clone()));
        loop {
            let (running, due) = super::open_runs(store).await?;
            let open = running + due;
            shown.store((self.runs - open).max(0) as u64, std::sync::atomic::Ordering::Relaxed);
            if open == 0 {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    fn say(&self, msg: std::fmt::Arguments<'_>) {
        if self.progress {
            eprintln!("{msg}");
        }
    }
}

/// This process's CPU time so far, all threads.
pub(super) fn cpu_time() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// Removes the runs of the bench's plugin `name` and their rows (never
/// another plugin's), and with `plugin` the plugin too.
pub(super) async fn clear(store: &Store, name: &str, plugin: bool) -> Result<(), StoreError> {
    for q in [
        "DELETE FROM effects WHERE run_id IN (SELECT id FROM runs WHERE plugin = $1)",
        "DELETE FROM events WHERE run_id IN (SELECT id FROM runs WHERE plugin = $1)",
        "DELETE FROM threads WHERE id IN (SELECT thread_id FROM runs WHERE plugin = $1)",
        "DELETE FROM runs WHERE plugin = $1",
        "DELETE FROM kv WHERE namespace = $1",
    ] {
        sqlx::query(q).bind(name).execute(store.writer()).await?;
    }
    if plugin {
        sqlx::query("DELETE FROM plugins WHERE name = $1").bind(name).execute(store.writer()).await?;
        sqlx::query("DELETE FROM plugin_versions WHERE name = $1").bind(name).execute(store.writer()).await?;
    }
    Ok(())
}
