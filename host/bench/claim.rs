//! `leasehold bench claim`: claim throughput of the lease protocol against a
//! raw baseline measured in the same run.
//!
//! Both phases load the same number of queued runs into the same table and
//! drain it with the same number of tasks and batch size. The lease phase
//! uses the real claim statement (fence, attempt, lease, both index paths);
//! the baseline is a plain `UPDATE … RETURNING` that sets only the status.
//! Reporting the ratio keeps the figure meaningful on a noisy, shared host.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;

use super::{BENCH_PLUGIN, BenchError, median, vacuum};
use crate::store::{RunStatus, SqliteSync, Store, StoreError, StoreOptions};

/// Settings of `bench claim`. Every field documents its default.
#[derive(Debug, Clone)]
pub struct ClaimBench {
    /// Database to use. It must hold no runs but the bench's own.
    pub database_url: String,
    /// Runs loaded (and claimed) per phase. Default: 20,000.
    pub runs: i64,
    /// Concurrent claiming tasks, each with its own connection. Default: 16.
    pub concurrency: usize,
    /// Runs per claim statement. Default: 1.
    pub batch: i64,
    /// Finished runs loaded first, to show the claim path ignores them.
    /// Default: 0.
    pub finished: i64,
    /// SQLite `synchronous`. The CLI's default: FULL, as `serve`.
    pub sqlite_sync: SqliteSync,
    /// Rounds of (baseline, claim), alternating which goes first so drift on
    /// a shared machine does not favour either. Default: 3.
    pub rounds: usize,
    /// Print progress to stderr. Default: true.
    pub progress: bool,
}

/// The one JSON line the bench ends with.
#[derive(Debug, Clone, Serialize)]
pub struct ClaimBenchResult {
    pub backend: &'static str,
    pub runs: i64,
    pub concurrency: usize,
    pub batch: i64,
    pub claims_per_sec: f64,
    pub baseline_per_sec: f64,
    /// The median of the per-round ratios (each round pairs adjacent phases).
    pub ratio: f64,
    pub finished: i64,
    pub rounds: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub synchronous: Option<SqliteSync>,
}

#[derive(Clone, Copy, PartialEq)]
enum Phase {
    Lease,
    Baseline,
}

impl ClaimBench {
    pub async fn run(&self) -> Result<ClaimBenchResult, BenchError> {
        let opts = StoreOptions {
            max_connections: Some(self.concurrency as u32 + 1),
            sqlite_sync: self.sqlite_sync,
            ..Default::default()
        };
        let store = Store::connect_with(&self.database_url, opts).await?;
        let foreign: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM runs WHERE plugin <> $1")
            .bind(BENCH_PLUGIN)
            .fetch_one(store.pool())
            .await
            .map_err(StoreError::from)?;
        if foreign > 0 {
            return Err(BenchError::NotEmpty(foreign));
        }
        self.clear(&store).await?;
        if self.finished > 0 {
            self.say(format_args!("loading {} finished runs", self.finished));
            store.bulk_load(self.finished, BENCH_PLUGIN, RunStatus::Completed).await?;
        }

        let (mut claims, mut baselines, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        for round in 0..self.rounds.max(1) {
            let order = if round % 2 == 0 { [Phase::Baseline, Phase::Lease] } else { [Phase::Lease, Phase::Baseline] };
            let (mut c, mut b) = (0.0, 0.0);
            for phase in order {
                let rate = self.phase(&store, phase).await?;
                match phase {
                    Phase::Lease => c = rate,
                    Phase::Baseline => b = rate,
                }
            }
            claims.push(c);
            baselines.push(b);
            ratios.push(c / b);
        }
        self.clear(&store).await?;
        store.shutdown().await;
        Ok(ClaimBenchResult {
            backend: store.backend().name(),
            runs: self.runs,
            concurrency: self.concurrency,
            batch: self.batch,
            claims_per_sec: median(&mut claims).round(),
            baseline_per_sec: median(&mut baselines).round(),
            ratio: (median(&mut ratios) * 1000.0).round() / 1000.0,
            finished: self.finished,
            rounds: self.rounds.max(1),
            synchronous: (store.backend() == crate::Backend::Sqlite).then_some(self.sqlite_sync),
        })
    }

    /// Loads `runs` queued runs, drains them, returns claims per second.
    async fn phase(&self, store: &Store, phase: Phase) -> Result<f64, BenchError> {
        let name = if phase == Phase::Lease { "claim" } else { "baseline" };
        self.say(format_args!("{name}: loading {} queued runs", self.runs));
        sqlx::query("DELETE FROM runs WHERE plugin = $1 AND status <> 'completed'")
            .bind(BENCH_PLUGIN)
            .execute(store.writer())
            .await
            .map_err(StoreError::from)?;
        // Both phases start from the same table state.
        vacuum(store, &["VACUUM ANALYZE runs"]).await?;
        store.bulk_load_queued(self.runs, BENCH_PLUGIN).await?;
        vacuum(store, &["VACUUM ANALYZE runs"]).await?;

        let done = Arc::new(AtomicU64::new(0));
        let start = Instant::now();
        let mut tasks = tokio::task::JoinSet::new();
        for w in 0..self.concurrency {
            let (store, done, batch) = (store.clone(), done.clone(), self.batch);
            tasks.spawn(async move {
                let owner = format!("bench-{w}");
                loop {
                    let n = match phase {
                        Phase::Lease => store
                            .claim_batch(&owner, Duration::from_secs(300), batch)
                            .await?
                            .len() as u64,
                        Phase::Baseline => baseline_claim(&store, batch).await?,
                    };
                    if n == 0 {
                        return Ok::<_, StoreError>(());
                    }
                    done.fetch_add(n, Ordering::Relaxed);
                }
            });
        }
        let progress = self
            .progress
            .then(|| super::progress::Progress::start(name.to_string(), self.runs as u64, done.clone()));
        while let Some(r) = tasks.join_next().await {
            r??;
        }
        let secs = start.elapsed().as_secs_f64();
        if let Some(p) = progress {
            p.finish();
        }
        let got = done.load(Ordering::Relaxed);
        if got != self.runs as u64 {
            return Err(BenchError::Miscount { got, want: self.runs });
        }
        let rate = got as f64 / secs;
        self.say(format_args!("{name}: {got} claims in {secs:.2}s = {rate:.0}/s"));
        Ok(rate)
    }

    async fn clear(&self, store: &Store) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM runs WHERE plugin = $1")
            .bind(BENCH_PLUGIN)
            .execute(store.writer())
            .await?;
        Ok(())
    }

    fn say(&self, msg: std::fmt::Arguments<'_>) {
        if self.progress {
            eprintln!("{msg}");
        }
    }
}

/// The baseline statement: claims up to `batch` queued runs, setting only
/// the status. Retried on transient contention like every store write.
async fn baseline_claim(store: &Store, batch: i64) -> Result<u64, StoreError> {
    store
        .retry(|| async move {
            Ok(sqlx::query(crate::store::baseline_sql(store, batch))
                .bind(batch)
                .fetch_all(store.writer())
                .await?
                .len() as u64)
        })
        .await
}
