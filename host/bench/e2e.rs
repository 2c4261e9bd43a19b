//! `leasehold bench e2e`: runs through the whole lifecycle (submit, claim,
//! instantiate, one effect, close) with the real worker pool, against the
//! raw claim + close SQL measured in the same run.
//!
//! Phases on the same database: *peak* submits `runs` one-effect runs as
//! fast as it can, from `submitters` tasks each making one submit at a time
//! (by default as many as there are workers, as the baseline has
//! `concurrency` tasks), and times until all are completed; *latency* submits
//! `runs` more at half the peak rate and reads each run's submit→start delay
//! from the database clock (its `created_at` to its `started_at`, set by its
//! claim; 1 ms resolution). The baseline bulk-loads `runs` queued runs and drains them
//! with `concurrency` tasks, each doing the bench claim statement and a bare
//! `UPDATE … SET status = 'completed'`.
//!
//! Peak and baseline run in `rounds` adjacent pairs, alternating which goes
//! first, and the medians are reported (the ratio is the median of the
//! rounds' ratios): on a shared, noisy machine a pair measured seconds apart
//! compares like with like, and drift favours neither phase. The latency
//! phase runs once, at the end.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use super::{BENCH_PLUGIN, BenchError};
use crate::executor::Executor;
use crate::pool::{PoolConfig, WorkerPool};
use crate::store::{NewRun, RunStatus, Store, StoreError, StoreOptions, sql};

/// The plugin the bench registers: the Rust test plugin, one `kv.put`.
const PLUGIN: &str = "bench-e2e";

pub struct E2eBench {
    pub database_url: String,
    /// Runs per phase.
    pub runs: i64,
    /// Workers, and baseline tasks.
    pub concurrency: usize,
    /// Tasks submitting in the peak phase.
    pub submitters: usize,
    /// Rounds of (peak, baseline), alternating which goes first. Default
    /// (CLI): 3.
    pub rounds: usize,
    /// The test plugin's component (`scripts/build-plugins` builds it).
    pub plugin_file: PathBuf,
    pub cache_dir: PathBuf,
    pub progress: bool,
    /// SQLite's `synchronous` (the store's default, FULL, unless set).
    pub sqlite_sync: crate::store::SqliteSync,
}

#[derive(Debug, Serialize)]
pub struct E2eResult {
    pub backend: &'static str,
    pub runs: i64,
    /// The median of the rounds' peak rates.
    pub runs_per_sec: f64,
    /// The median of the rounds' baseline rates.
    pub baseline_per_sec: f64,
    /// The median of the rounds' ratios (each round pairs adjacent phases).
    pub ratio: f64,
    pub submit_to_start_p50_ms: f64,
    pub submit_to_start_p99_ms: f64,
    /// The submit rate of the latency phase (half of `runs_per_sec`).
    pub latency_rate_per_sec: f64,
    /// Runs of the latency phase whose submit→start delay was measured.
    pub latency_samples: usize,
    pub concurrency: usize,
    pub submitters: usize,
    pub rounds: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sqlite_synchronous: Option<crate::store::SqliteSync>,
}

#[derive(Clone, Copy, PartialEq)]
enum Phase {
    Peak,
    Baseline,
}

impl E2eBench {
    pub async fn run(&self) -> Result<E2eResult, BenchError> {
        // A connection for each worker, and for the submit batches in
        // flight (up to 4), the claimer, the NOTIFY sender and the poller.
        let opts = StoreOptions {
            max_connections: Some(self.concurrency as u32 + 8),
            sqlite_sync: self.sqlite_sync,
            ..Default::default()
        };
        let store = Store::connect_with(&self.database_url, opts).await?;
        let exec = super::executor_with_plugin(&store, &self.plugin_file, &self.cache_dir, PLUGIN, self.concurrency, "bench-e2e").await?;
        let rounds = self.rounds.max(1);
        let (mut peaks, mut baselines, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        for round in 0..rounds {
            let order = if round % 2 == 0 { [Phase::Peak, Phase::Baseline] } else { [Phase::Baseline, Phase::Peak] };
            let (mut p, mut b) = (0.0, 0.0);
            for (i, phase) in order.into_iter().enumerate() {
                // Not before the first phase: its tables are empty, with
                // nothing dead to remove.
                if round > 0 || i > 0 {
                    vacuum(&store).await?;
                }
                match phase {
                    Phase::Peak => p = self.peak(&store, &exec, round).await?,
                    Phase::Baseline => {
                        b = self.baseline(&store).await?;
                        self.say(format_args!("baseline claim+close: {b:.0}/s"));
                    }
                }
            }
            peaks.push(p);
            baselines.push(b);
            ratios.push(p / b);
        }
        let peak = super::median(&mut peaks);
        let baseline = super::median(&mut baselines);
        let ratio = super::median(&mut ratios);

        // Latency at half the peak rate.
        vacuum(&store).await?;
        let pool = self.start_pool(&store, &exec);
        let rate = peak / 2.0;
        let every = Duration::from_secs_f64(1.0 / rate);
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
        let first_latency_id: i64 = sqlx::query_scalar("SELECT COALESCE(MAX(id), 0) FROM runs")
            .fetch_one(store.pool())
            .await
            .map_err(StoreError::from)?;
        let segments_before = segments_finished();
        for i in 0..self.runs {
            tick.tick().await;
            store.create_run(&NewRun::new(PLUGIN, input(&format!("l{i}")))).await?;
        }
        self.wait_completed(&store, first_latency_id, self.runs, segments_before).await?;
        pool.shutdown(Duration::from_secs(10)).await;
        let mut delays: Vec<f64> = sqlx::query_scalar::<_, i64>(sql!(
            store,
            "SELECT started_at - created_at FROM runs WHERE id > $1"
        ))
        .bind(first_latency_id)
        .fetch_all(store.pool())
        .await
        .map_err(StoreError::from)?
        .into_iter()
        .map(|d| d as f64)
        .collect();
        delays.sort_by(f64::total_cmp);
        let pct = |p: f64| delays.get(((delays.len() as f64 - 1.0) * p).round() as usize).copied().unwrap_or(f64::NAN);
        let (p50, p99) = (pct(0.5), pct(0.99));
        self.say(format_args!("latency at {rate:.0}/s: p50 {p50} ms, p99 {p99} ms"));

        clear(&store).await?;
        store.shutdown().await;
        Ok(E2eResult {
            backend: store.backend().name(),
            runs: self.runs,
            runs_per_sec: peak.round(),
            baseline_per_sec: baseline.round(),
            ratio: (ratio * 1000.0).round() / 1000.0,
            submit_to_start_p50_ms: p50,
            submit_to_start_p99_ms: p99,
            latency_rate_per_sec: rate.round(),
            latency_samples: delays.len(),
            concurrency: self.concurrency,
            submitters: self.submitters,
            rounds,
            sqlite_synchronous: (store.backend() == crate::store::Backend::Sqlite).then_some(self.sqlite_sync),
        })
    }

    /// The worker pool, started for a phase that runs turns: between them,
    /// the baseline's bulk-loaded runs must not be claimed.
    fn start_pool(&self, store: &Store, exec: &Arc<Executor>) -> WorkerPool {
        WorkerPool::start(
            store.clone(),
            exec.clone(),
            PoolConfig { workers: self.concurrency, poll: Duration::from_millis(100), prefetch: PoolConfig::default_prefetch(self.concurrency, store.backend()), ..PoolConfig::default() },
        )
    }

    /// Submits `runs` runs as fast as `submitters` tasks can, each one submit
    /// at a time, and returns runs per second until all are completed.
    async fn peak(&self, store: &Store, exec: &Arc<Executor>, round: usize) -> Result<f64, BenchError> {
        let pool = self.start_pool(store, exec);
        let first_id: i64 = sqlx::query_scalar("SELECT COALESCE(MAX(id), 0) FROM runs")
            .fetch_one(store.pool())
            .await
            .map_err(StoreError::from)?;
        let (submits, commits) = store.submits_written();
        let (closes, close_commits) = store.closes_written();
        let segments_before = segments_finished();
        let started = Instant::now();
        let tasks = self.submitters as i64;
        let submitters: Vec<_> = (0..tasks)
            .map(|t| {
                let store = store.clone();
                let n = self.runs / tasks + i64::from(t < self.runs % tasks);
                tokio::spawn(async move {
                    for i in 0..n {
                        store.create_run(&NewRun::new(PLUGIN, input(&format!("p{round}-{t}-{i}")))).await?;
                    }
                    Ok::<_, StoreError>(())
                })
            })
            .collect();
        for s in submitters {
            s.await??;
        }
        let submitted = started.elapsed();
        self.wait_completed(store, first_id, self.runs, segments_before).await?;
        let elapsed = started.elapsed();
        pool.shutdown(Duration::from_secs(10)).await;
        let peak = self.runs as f64 / elapsed.as_secs_f64();
        self.say(format_args!("peak: {} runs in {elapsed:?} = {peak:.0}/s", self.runs));
        let (submits_now, commits_now) = store.submits_written();
        let (closes_now, close_commits_now) = store.closes_written();
        self.say(format_args!(
            "  submitted in {submitted:?}, {} submits in {} commits; {} closes in {} commits",
            submits_now - submits,
            commits_now - commits,
            closes_now - closes,
            close_commits_now - close_commits
        ));
        Ok(peak)
    }

    /// Waits until the `want` runs after id `after`, all submitted already,
    /// are completed. `segments_before` is [`segments_finished`] as it was
    /// before the first of them was submitted.
    ///
    /// Watches this process's count of finished segments every 2 ms, which
    /// costs the database nothing, and asks the database only once a second
    /// (runs still claimable or running, through the claim index) and at the
    /// end (runs completed). Counting in the database every 5 ms, as before,
    /// put load on the measured phases that the baseline does not carry: a
    /// scan of the whole queue 200 times a second.
    async fn wait_completed(&self, store: &Store, after: i64, want: i64, segments_before: u64) -> Result<(), BenchError> {
        let shown = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let _bar = self
            .progress
            .then(|| super::progress::Progress::start("completed", want as u64, shown.clone()));
        let mut asked = Instant::now();
        loop {
            let done = segments_finished() - segments_before;
            shown.store(done.min(want as u64), std::sync::atomic::Ordering::Relaxed);
            // The counters are the process's: in a test binary other tests'
            // segments count too, so they only say when to ask; the
            // database's answer decides.
            let open = if done >= want as u64 || asked.elapsed() >= Duration::from_secs(1) {
                asked = Instant::now();
                sqlx::query_scalar::<_, i64>(concat!("SELECT COUNT(*) FROM runs WHERE ", crate::claimable!()))
                    .fetch_one(store.pool())
                    .await
                    .map_err(StoreError::from)?
            } else {
                -1
            };
            if open == 0 {
                let done: i64 = sqlx::query_scalar(sql!(store, "SELECT COUNT(*) FROM runs WHERE id > $1 AND status = $2"))
                    .bind(after)
                    .bind(RunStatus::Completed.as_str())
                    .fetch_one(store.pool())
                    .await
                    .map_err(StoreError::from)?;
                // No run is left queued or running: this is final.
                if done >= want {
                    return Ok(());
                }
                return Err(BenchError::Setup(format!("{} bench runs did not complete (see the log)", want - done)));
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// Raw claim + close, `concurrency` tasks.
    async fn baseline(&self, store: &Store) -> Result<f64, BenchError> {
        store.bulk_load_queued(self.runs, BENCH_PLUGIN).await?;
        let started = Instant::now();
        let tasks: Vec<_> = (0..self.concurrency)
            .map(|_| {
                let store = store.clone();
                tokio::spawn(async move {
                    let mut n = 0u64;
                    loop {
                        let ids: Vec<i64> = store
                            .retry(|| async {
                                Ok(sqlx::query_scalar(crate::store::baseline_sql(&store, 1))
                                    .bind(1i64)
                                    .fetch_all(store.writer())
                                    .await?)
                            })
                            .await?;
                        let Some(id) = ids.first().copied() else { return Ok::<_, StoreError>(n) };
                        store
                            .retry(|| async {
                                sqlx::query(sql!(
                                    store,
                                    "UPDATE runs SET status = 'completed', output = '', finished_at = {now} WHERE id = $1"
                                ))
                                .bind(id)
                                .execute(store.writer())
                                .await?;
                                Ok(())
                            })
                            .await?;
                        n += 1;
                    }
                })
            })
            .collect();
        let mut total = 0;
        for t in tasks {
            total += t.await??;
        }
        Ok(total as f64 / started.elapsed().as_secs_f64())
    }

    fn say(&self, msg: std::fmt::Arguments<'_>) {
        if self.progress {
            eprintln!("{msg}");
        }
    }
}

/// Segments this process has finished (completed or failed), from the
/// executor's counters.
///
/// A phase reads it before its first submit: the segments that finish while
/// it is still submitting count toward its runs. (Read after the last
/// submit, as before, they did not: the count never reached the runs, and
/// every peak waited for the once-a-second database check, up to a second
/// more than its runs took.)
fn segments_finished() -> u64 {
    let m = crate::metrics::global();
    m.segments_completed.load(std::sync::atomic::Ordering::Relaxed)
        + m.segments_failed.load(std::sync::atomic::Ordering::Relaxed)
}

/// A bench run's input: one `kv.put`, to a key of its own. Runs that all
/// wrote one key would queue on that row's lock (each waits for the last
/// writer's commit), which measures one hot row rather than the host.
fn input(key: &str) -> String {
    serde_json::json!({ "steps": 1, "prefix": key }).to_string()
}

/// Vacuums and analyzes the tables the phases write (see
/// [`super::vacuum`]). Where autovacuum is off, as on some test
/// machines, dead row versions otherwise pile up at the head of the claim
/// index and slow every later phase: the peak fell from 1235 to 1030 runs/s
/// over three rounds without this.
async fn vacuum(store: &Store) -> Result<(), StoreError> {
    super::vacuum(
        store,
        &[
            "VACUUM ANALYZE runs",
            "VACUUM ANALYZE threads",
            "VACUUM ANALYZE events",
            "VACUUM ANALYZE effects",
            "VACUUM ANALYZE kv",
        ],
    )
    .await
}

/// Removes everything the bench wrote.
async fn clear(store: &Store) -> Result<(), StoreError> {
    for q in [
        "DELETE FROM effects",
        "DELETE FROM events",
        "DELETE FROM threads",
        "DELETE FROM runs",
    ] {
        sqlx::query(q).execute(store.writer()).await?;
    }
    sqlx::query("DELETE FROM kv WHERE namespace = $1").bind(PLUGIN).execute(store.writer()).await?;
    sqlx::query("DELETE FROM plugins WHERE name = $1").bind(PLUGIN).execute(store.writer()).await?;
    sqlx::query("DELETE FROM plugin_versions WHERE name = $1").bind(PLUGIN).execute(store.writer()).await?;
    Ok(())
}
