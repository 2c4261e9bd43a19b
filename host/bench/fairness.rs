//! `leasehold bench fairness`: whether one concurrency key's backlog holds
//! another key's runs back (docs/flow-control.md, fair shares).
//!
//! Two phases on one database, the worker pool that `serve` runs draining
//! each. Alone: a small key submits `small` runs, one every `gap_ms`, with
//! nothing else queued. Beside: a large key's `backlog` runs are queued
//! first, the pool starts on them, and then the small key submits the same
//! way. A small run's wait is its first claim less its submit
//! (`started_at - created_at`, the database's clock); the bench reports
//! both phases' p50 and p99 and the ratio of the p99s, and how many of the
//! backlog's runs were still queued when the last small run started (the
//! backlog was there throughout). No-op turns of the test plugin.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use super::BenchError;
use crate::executor::Executor;
use crate::pool::{PoolConfig, WorkerPool};
use crate::store::{MAX_SUBMIT_BATCH, NewRun, SqliteSync, Store, StoreError, StoreOptions};

/// The plugin the bench registers: the Rust test plugin.
const PLUGIN: &str = "bench-fairness";

/// Settings of `bench fairness`. The CLI's defaults are in brackets.
#[derive(Debug, Clone)]
pub struct FairnessBench {
    pub database_url: String,
    /// The large key's queued runs [100,000].
    pub backlog: i64,
    /// The small key's runs [100], one every `gap_ms` [20].
    pub small: usize,
    pub gap_ms: u64,
    /// As `serve`'s [64, 64, its default].
    pub workers: usize,
    pub claim_batch: usize,
    pub prefetch: usize,
    pub plugin_file: PathBuf,
    pub cache_dir: PathBuf,
    pub progress: bool,
    pub sqlite_sync: SqliteSync,
}

/// One `bench fairness`: the small key's waits, alone and beside the backlog.
#[derive(Debug, Clone, Serialize)]
pub struct FairnessResult {
    pub backend: &'static str,
    pub backlog: i64,
    pub small: usize,
    pub workers: usize,
    pub alone_p50_ms: i64,
    pub alone_p99_ms: i64,
    pub beside_p50_ms: i64,
    pub beside_p99_ms: i64,
    /// `beside_p99_ms` over `alone_p99_ms` (each at least 1 ms).
    pub p99_ratio: f64,
    /// The backlog's runs still queued as the last small run started.
    pub backlog_left: i64,
}

impl FairnessBench {
    pub async fn run(&self) -> Result<FairnessResult, BenchError> {
        let opts = StoreOptions { max_connections: Some(self.workers as u32 + 8), sqlite_sync: self.sqlite_sync, ..Default::default() };
        let store = Store::connect_with(&self.database_url, opts).await?;
        let exec = super::executor_with_plugin(&store, &self.plugin_file, &self.cache_dir, PLUGIN, self.workers, "bench-fairness").await?;
        let alone = self.phase(&store, &exec, 0).await;
        super::drain::clear(&store, PLUGIN, false).await?;
        let (alone, _) = alone?;
        let beside = self.phase(&store, &exec, self.backlog).await;
        super::drain::clear(&store, PLUGIN, true).await?;
        sqlx::query("DELETE FROM concurrency_keys WHERE key IN ('bench-large', 'bench-small')")
            .execute(store.writer())
            .await
            .map_err(StoreError::from)?;
        let (beside, backlog_left) = beside?;
        store.shutdown().await;
        let (a50, a99, b50, b99) = (pct(&alone, 50), pct(&alone, 99), pct(&beside, 50), pct(&beside, 99));
        Ok(FairnessResult {
            backend: store.backend().name(),
            backlog: self.backlog,
            small: self.small,
            workers: self.workers,
            alone_p50_ms: a50,
            alone_p99_ms: a99,
            beside_p50_ms: b50,
            beside_p99_ms: b99,
            p99_ratio: ((b99.max(1) as f64 / a99.max(1) as f64) * 100.0).round() / 100.0,
            backlog_left,
        })
    }

    /// Queues `backlog` runs of the large key, starts the pool, submits the
    /// small key's runs at the pace, and waits until each has started: their
    /// waits (ms), sorted, and the backlog's runs still queued then.
    async fn phase(&self, store: &Store, exec: &Arc<Executor>, backlog: i64) -> Result<(Vec<i64>, i64), BenchError> {
        let input = serde_json::json!({ "steps": 0 }).to_string();
        let mut loaded = 0;
        while loaded < backlog {
            let n = (backlog - loaded).min(MAX_SUBMIT_BATCH as i64);
            let batch: Vec<NewRun> = (0..n)
                .map(|_| NewRun { concurrency_key: Some("bench-large".into()), ..NewRun::new(PLUGIN, input.clone()) })
                .collect();
            store.create_runs(&batch).await?;
            loaded += n;
        }
        if backlog > 0 {
            self.say(format_args!("queued {backlog} runs of the large key"));
        }
        let pool = WorkerPool::start(
            store.clone(),
            exec.clone(),
            PoolConfig { workers: self.workers, poll: Duration::from_millis(100), claim_batch: self.claim_batch, prefetch: self.prefetch },
        );
        let result = self.submit_small(store, backlog > 0).await;
        pool.shutdown(Duration::from_secs(10)).await;
        result
    }

    async fn submit_small(&self, store: &Store, beside: bool) -> Result<(Vec<i64>, i64), BenchError> {
        if beside {
            // The pool is busy with the backlog before the first small run.
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let input = serde_json::json!({ "steps": 0 }).to_string();
        let mut ids = Vec::with_capacity(self.small);
        for _ in 0..self.small {
            let new = NewRun { concurrency_key: Some("bench-small".into()), ..NewRun::new(PLUGIN, input.clone()) };
            ids.push(store.create_run(&new).await?.0.id);
            tokio::time::sleep(Duration::from_millis(self.gap_ms)).await;
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        loop {
            let started: Vec<(i64, i64)> = sqlx::query_as(
                "SELECT created_at, started_at FROM runs WHERE concurrency_key = 'bench-small' AND started_at IS NOT NULL",
            )
            .fetch_all(store.pool())
            .await
            .map_err(StoreError::from)?;
            if started.len() == ids.len() {
                let left: i64 = sqlx::query_scalar(concat!(
                    "SELECT COUNT(*) FROM runs WHERE ", crate::claimable!(), " AND concurrency_key = 'bench-large' AND status = 'queued'"
                ))
                .fetch_one(store.pool())
                .await
                .map_err(StoreError::from)?;
                let mut waits: Vec<i64> = started.iter().map(|(c, s)| s - c).collect();
                waits.sort_unstable();
                self.say(format_args!("{} small runs started; {left} of the backlog still queued", ids.len()));
                return Ok((waits, left));
            }
            if std::time::Instant::now() > deadline {
                return Err(BenchError::Setup(format!("only {} of {} small runs started in 120 s", started.len(), ids.len())));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn say(&self, msg: std::fmt::Arguments<'_>) {
        if self.progress {
            eprintln!("{msg}");
        }
    }
}

/// The `p`th percentile of sorted `xs` (nearest rank); 0 when empty.
fn pct(xs: &[i64], p: usize) -> i64 {
    if xs.is_empty() {
        return 0;
    }
    xs[(xs.len() * p).div_ceil(100).saturating_sub(1).min(xs.len() - 1)]
}
