//! `leasehold bench submit`: how fast the HTTP API takes runs in.
//!
//! Serves the real API in process on a loopback port (bearer token, the
//! front-door checks and all) beside the worker pool `serve` runs, which
//! drains what is submitted. Then:
//!
//! - *single*: `clients` keep-alive HTTP clients each send `POST /v1/runs`
//!   one at a time until `runs` runs are in; the rate, and each request's
//!   latency (p50, p99) as the client saw it;
//! - *batch*: `batch_clients` clients send `POST /v1/runs:batch` with
//!   `batch` runs each (one idempotency key per run) until `runs` more
//!   are in; runs per second.
//!
//! The pool drains during the single phase ("while draining"), and is
//! stopped before the batch phase, which measures the batch submit alone.
//! The clients run in this process, so their CPU is counted against the
//! host's, as an external load generator on the same machine would be.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;

use super::BenchError;
use crate::pool::{PoolConfig, WorkerPool};
use crate::store::{SqliteSync, Store, StoreError, StoreOptions};

/// The plugin the bench registers: the Rust test plugin.
const PLUGIN: &str = "bench-submit";
const TOKEN: &str = "bench-submit-token";

/// Settings of `bench submit`. The CLI's defaults are in brackets.
pub struct SubmitBench {
    pub database_url: String,
    /// Runs per phase. [20,000]
    pub runs: i64,
    /// Keep-alive clients of the single phase. [64]
    pub clients: usize,
    /// Runs per batch request. [1,000]
    pub batch: usize,
    /// Clients of the batch phase. [4]
    pub batch_clients: usize,
    /// The pool's workers, draining during the single phase. [64]
    pub workers: usize,
    pub plugin_file: PathBuf,
    pub cache_dir: PathBuf,
    pub progress: bool,
    /// SQLite's `synchronous`. [full]
    pub sqlite_sync: SqliteSync,
}

/// The one JSON line the bench ends with.
#[derive(Debug, Clone, Serialize)]
pub struct SubmitResult {
    pub backend: &'static str,
    pub runs: i64,
    pub clients: usize,
    pub workers: usize,
    /// Single submits per second, first request to last answer.
    pub submits_per_sec: f64,
    /// Latency of one `POST /v1/runs` as its client saw it.
    pub submit_p50_ms: f64,
    pub submit_p99_ms: f64,
    /// Runs the pool finished while the single phase ran.
    pub drained_meanwhile: i64,
    /// Submits per commit in the single phase (the group commit's batches).
    pub submits_per_commit: f64,
    pub batch: usize,
    pub batch_clients: usize,
    /// Runs per second through `POST /v1/runs:batch`.
    pub batch_runs_per_sec: f64,
    pub batch_p50_ms: f64,
    /// This process's CPU time per single submit (server, clients and the
    /// draining pool; on SQLite the database's work too).
    pub cpu_us_per_submit: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sqlite_synchronous: Option<SqliteSync>,
}

impl SubmitBench {
    pub async fn run(&self) -> Result<SubmitResult, BenchError> {
        let opts = StoreOptions {
            max_connections: Some(self.workers as u32 + 16),
            sqlite_sync: self.sqlite_sync,
            ..Default::default()
        };
        let store = Store::connect_with(&self.database_url, opts).await?;
        let exec = super::executor_with_plugin(&store, &self.plugin_file, &self.cache_dir, PLUGIN, self.workers, "bench-submit").await?;
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let config = crate::api::ApiConfig { token: Some(crate::redact::Secret::new(TOKEN.to_string())), ..Default::default() };
        let state = crate::api::AppState::new(store.clone(), exec.runtime().clone(), config, stop_rx.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.map_err(|e| BenchError::Setup(format!("listening: {e}")))?;
        let addr = listener.local_addr().map_err(|e| BenchError::Setup(e.to_string()))?;
        let mut server_stop = stop_rx.clone();
        let server = tokio::spawn(
            axum::serve(listener, crate::api::router(state))
                .with_graceful_shutdown(async move {
                    let _ = server_stop.wait_for(|s| *s).await;
                })
                .into_future(),
        );
        crate::effects::http::install_tls();
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(self.clients.max(self.batch_clients))
            .timeout(Duration::from_secs(60))
            .build()
            .map_err(|e| BenchError::Setup(format!("HTTP client: {e}")))?;

        let pool = WorkerPool::start(
            store.clone(),
            exec.clone(),
            PoolConfig { workers: self.workers, poll: Duration::from_millis(100), claim_batch: 64, prefetch: PoolConfig::default_prefetch(self.workers, store.backend()) },
        );
        let finished_before = finished(&store).await?;
        let (submits, commits) = store.submits_written();
        let cpu = super::drain::cpu_time();
        let single = self.phase(&client, addr, false).await;
        let cpu_us = (super::drain::cpu_time() - cpu).as_secs_f64() * 1e6 / self.runs as f64;
        let (submits_now, commits_now) = store.submits_written();
        let drained = finished(&store).await? - finished_before;
        pool.shutdown(Duration::from_secs(10)).await;
        let single = single?;
        self.say(format_args!(
            "single: {:.0} submits/s, p50 {:.2} ms, p99 {:.2} ms; {drained} runs drained meanwhile",
            single.rate, single.p50, single.p99
        ));
        let batch = self.phase(&client, addr, true).await?;
        self.say(format_args!("batch: {:.0} runs/s, p50 {:.2} ms a request", batch.rate, batch.p50));

        let _ = stop_tx.send(true);
        let _ = server.await;
        super::drain::clear(&store, PLUGIN, true).await?;
        store.shutdown().await;
        let round2 = |x: f64| (x * 100.0).round() / 100.0;
        Ok(SubmitResult {
            backend: store.backend().name(),
            runs: self.runs,
            clients: self.clients,
            workers: self.workers,
            submits_per_sec: single.rate.round(),
            submit_p50_ms: round2(single.p50),
            submit_p99_ms: round2(single.p99),
            drained_meanwhile: drained,
            submits_per_commit: round2((submits_now - submits) as f64 / (commits_now - commits).max(1) as f64),
            batch: self.batch,
            batch_clients: self.batch_clients,
            batch_runs_per_sec: batch.rate.round(),
            batch_p50_ms: round2(batch.p50),
            cpu_us_per_submit: (cpu_us * 10.0).round() / 10.0,
            sqlite_synchronous: (store.backend() == crate::store::Backend::Sqlite).then_some(self.sqlite_sync),
        })
    }

    /// One phase: its clients send requests until `runs` runs are in.
    async fn phase(&self, client: &reqwest::Client, addr: SocketAddr, batch: bool) -> Result<Phase, BenchError> {
        let (clients, per_request) = if batch { (self.batch_clients, self.batch.max(1)) } else { (self.clients, 1) };
        let requests = (self.runs as usize).div_ceil(per_request);
        let next = Arc::new(AtomicI64::new(0));
        let done = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let name = if batch { "batch" } else { "single" };
        let bar = self.progress.then(|| super::progress::Progress::start(name.to_string(), self.runs as u64, done.clone()));
        let url = if batch { format!("http://{addr}/v1/runs:batch") } else { format!("http://{addr}/v1/runs") };
        let started = Instant::now();
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..clients {
            let (client, next, done, url) = (client.clone(), next.clone(), done.clone(), url.clone());
            let runs = self.runs as usize;
            tasks.spawn(async move {
                let mut latencies = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed) as usize;
                    if i >= requests {
                        return Ok::<_, BenchError>(latencies);
                    }
                    let body = if batch {
                        let first = i * per_request;
                        let runs: Vec<_> = (first..(first + per_request).min(runs))
                            .map(|k| serde_json::json!({"plugin": PLUGIN, "input": {"steps": 0}, "idempotency_key": format!("b{k}")}))
                            .collect();
                        serde_json::json!({ "runs": runs })
                    } else {
                        serde_json::json!({"plugin": PLUGIN, "input": {"steps": 0}})
                    };
                    let n = body.get("runs").and_then(|r| r.as_array()).map_or(1, Vec::len);
                    let at = Instant::now();
                    let response = client
                        .post(&url)
                        .bearer_auth(TOKEN)
                        .json(&body)
                        .send()
                        .await
                        .map_err(|e| BenchError::Setup(format!("POST {url}: {e}")))?;
                    let status = response.status();
                    let text = response.text().await.map_err(|e| BenchError::Setup(format!("POST {url}: {e}")))?;
                    if !status.is_success() {
                        return Err(BenchError::Setup(format!("POST {url}: {status}: {text}")));
                    }
                    latencies.push(at.elapsed());
                    done.fetch_add(n as u64, Ordering::Relaxed);
                }
            });
        }
        let mut latencies = Vec::with_capacity(requests);
        while let Some(r) = tasks.join_next().await {
            latencies.extend(r??);
        }
        let secs = started.elapsed().as_secs_f64();
        if let Some(bar) = bar {
            bar.finish();
        }
        latencies.sort();
        let pct = |p: f64| latencies.get(((latencies.len() as f64 * p) as usize).min(latencies.len().saturating_sub(1)));
        let ms = |d: Option<&Duration>| d.map_or(0.0, |d| d.as_secs_f64() * 1000.0);
        Ok(Phase { rate: self.runs as f64 / secs, p50: ms(pct(0.5)), p99: ms(pct(0.99)) })
    }

    fn say(&self, msg: std::fmt::Arguments<'_>) {
        if self.progress {
            eprintln!("{msg}");
        }
    }
}

struct Phase {
    rate: f64,
    p50: f64,
    p99: f64,
}

async fn finished(store: &Store) -> Result<i64, StoreError> {
    Ok(sqlx::query_scalar("SELECT COUNT(*) FROM runs WHERE status = 'completed'").fetch_one(store.pool()).await?)
}
