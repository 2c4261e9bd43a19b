//! `leasehold bench dashboard`: how fast the dashboard's reads are on a
//! large database. Loads `runs` finished runs (once: a database the bench
//! loaded before is reused), serves the API in process, times each page's
//! requests, and, with Chromium and playwright-core installed (scripts/
//! toolchains), each page from navigation to its first data rendered
//! (`tests/browser/timings.mjs`). Ends with one JSON line.

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::Value;

use super::{BENCH_PLUGIN, BenchError, median};
use crate::api::{ApiConfig, AppState};
use crate::runtime::{Runtime, RuntimeConfig};
use crate::store::{RunStatus, Store, StoreError};

pub struct DashboardBench {
    pub database_url: String,
    pub runs: i64,
    pub plugin_file: PathBuf,
    /// `tests/browser/timings.mjs`; no page timings when it or Chromium is
    /// missing.
    pub script: PathBuf,
    pub chromium: PathBuf,
    /// Timed loads of each page and request; medians are reported.
    pub loads: usize,
    pub progress: bool,
}

#[derive(Debug, Serialize)]
pub struct DashboardReport {
    pub backend: &'static str,
    pub runs: i64,
    /// Median ms per request, by what the page asks.
    pub api_ms: serde_json::Map<String, Value>,
    /// The counts' `GROUP BY`, uncached (what `/v1/stats` pays every 2 s).
    pub stats_uncached_ms: f64,
    /// What the charts' rollup pays to count the busiest minute (the one of
    /// the newest finished run, where the loader put them all), once a
    /// minute for every host together.
    pub minute_count_ms: f64,
    /// Median ms from navigation to the page's first data rendered, by page;
    /// null without a browser.
    pub page_ms: Option<Value>,
}

impl DashboardBench {
    pub async fn run(&self) -> Result<DashboardReport, BenchError> {
        let say = |m: String| {
            if self.progress {
                eprintln!("bench dashboard: {m}");
            }
        };
        let store = Store::connect(&self.database_url).await?;
        let existing: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM runs").fetch_one(store.pool()).await.map_err(StoreError::from)?;
        if existing == 0 {
            say(format!("loading {} runs", self.runs));
            let failed = self.runs / 100;
            store.bulk_load(self.runs - failed, BENCH_PLUGIN, RunStatus::Completed).await?;
            store.bulk_load(failed, BENCH_PLUGIN, RunStatus::Failed).await?;
            // Finished when loaded: all in a minute or two, the worst case
            // for the rollup's count of a minute.
            sqlx::query("UPDATE runs SET finished_at = created_at WHERE finished_at IS NULL")
                .execute(store.writer())
                .await
                .map_err(StoreError::from)?;
            super::vacuum(&store, &["VACUUM ANALYZE runs"]).await?;
        } else if existing < self.runs {
            return Err(BenchError::NotEmpty(existing));
        }
        let runs: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM runs").fetch_one(store.pool()).await.map_err(StoreError::from)?;
        let cache = std::env::temp_dir().join(format!("leasehold-bench-dashboard-{}", std::process::id()));
        let runtime = Arc::new(
            Runtime::new(RuntimeConfig { cache_dir: cache.clone(), ..RuntimeConfig::default() })
                .map_err(|e| BenchError::Setup(format!("{e:#}")))?,
        );
        let bytes = std::fs::read(&self.plugin_file).map_err(|e| {
            BenchError::Setup(format!("reading {}: {e} (build it with ./scripts/build-plugins)", self.plugin_file.display()))
        })?;
        crate::plugins::register(&store, &runtime, BENCH_PLUGIN, bytes, Default::default())
            .await
            .map_err(|e| BenchError::Setup(e.to_string()))?;

        let started = Instant::now();
        store.gauges().await?;
        let stats_uncached_ms = started.elapsed().as_secs_f64() * 1000.0;
        let newest_end: Option<i64> = sqlx::query_scalar("SELECT MAX(finished_at) FROM runs").fetch_one(store.pool()).await.map_err(StoreError::from)?;
        let minute = newest_end.unwrap_or(0).div_euclid(60_000) * 60_000;
        let started = Instant::now();
        let counted: Vec<(String, i64)> = sqlx::query_as(
            "SELECT status, CAST(COUNT(*) AS BIGINT) FROM runs WHERE finished_at >= $1 AND finished_at < $2 GROUP BY status",
        )
        .bind(minute)
        .bind(minute + 60_000)
        .fetch_all(store.pool())
        .await
        .map_err(StoreError::from)?;
        let minute_count_ms = started.elapsed().as_secs_f64() * 1000.0;
        say(format!("the busiest minute holds {counted:?}, counted in {minute_count_ms:.1} ms"));

        let token = uuid::Uuid::new_v4().to_string();
        let (stop, shutdown) = tokio::sync::watch::channel(false);
        let config = ApiConfig { token: Some(token.clone().into()), ..ApiConfig::default() };
        let state = AppState::new(store.clone(), runtime, config, shutdown.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.map_err(|e| BenchError::Setup(e.to_string()))?;
        let base = format!("http://{}", listener.local_addr().map_err(|e| BenchError::Setup(e.to_string()))?);
        let mut stopped = shutdown;
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, crate::api::router(state))
                .with_graceful_shutdown(async move {
                    let _ = stopped.wait_for(|s| *s).await;
                })
                .await;
        });

        crate::effects::http::install_tls();
        let http = reqwest::Client::new();
        let newest: i64 = sqlx::query_scalar("SELECT MAX(id) FROM runs").fetch_one(store.pool()).await.map_err(StoreError::from)?;
        let requests = [
            ("runs page", "/v1/runs?limit=50".to_string()),
            ("runs page 1000", format!("/v1/runs?limit=50&cursor={}", newest - 1000)),
            ("runs by status", "/v1/runs?status=failed&limit=50".to_string()),
            ("runs by thread", "/v1/runs?thread=bench-7&limit=50".to_string()),
            ("runs by text, no match (a scan)", "/v1/runs?q=no-such-text&limit=50".to_string()),
            ("run", format!("/v1/runs/{newest}")),
            ("run ledger", format!("/v1/runs/{newest}/effects")),
            ("plugins", "/v1/plugins".to_string()),
            ("leases", "/v1/leases".to_string()),
            ("charts: the last hour", "/v1/stats/history?minutes=60".to_string()),
        ];
        let mut api_ms = serde_json::Map::new();
        for (name, path) in requests {
            let mut times = Vec::new();
            for i in 0..=self.loads {
                let t = Instant::now();
                let resp = http.get(format!("{base}{path}")).bearer_auth(&token).send().await;
                let ok = match resp {
                    Ok(r) => r.status().is_success() && r.bytes().await.is_ok(),
                    Err(_) => false,
                };
                if !ok {
                    return Err(BenchError::Setup(format!("GET {path} failed")));
                }
                if i > 0 {
                    times.push(t.elapsed().as_secs_f64() * 1000.0);
                }
            }
            api_ms.insert(name.to_string(), Value::from((median(&mut times) * 100.0).round() / 100.0));
        }
        say(format!("API timed: {}", Value::Object(api_ms.clone())));

        let page_ms = if self.script.exists() && self.chromium.exists() {
            let out = tokio::process::Command::new("node")
                .arg(&self.script)
                .env("LEASEHOLD_URL", &base)
                .env("LEASEHOLD_TOKEN", &token)
                .env("LEASEHOLD_RUN", newest.to_string())
                .env("LEASEHOLD_LOADS", self.loads.to_string())
                .env("CHROMIUM", &self.chromium)
                .stderr(Stdio::inherit())
                .kill_on_drop(true)
                .output();
            let out = tokio::time::timeout(Duration::from_secs(600), out)
                .await
                .map_err(|_| BenchError::Setup("the page timings took over 600 s".into()))?
                .map_err(|e| BenchError::Setup(format!("running node: {e}")))?;
            let text = String::from_utf8_lossy(&out.stdout);
            let last = text.lines().last().unwrap_or_default();
            if !out.status.success() {
                return Err(BenchError::Setup(format!("{} failed ({}): {text}", self.script.display(), out.status)));
            }
            Some(serde_json::from_str(last).map_err(|e| BenchError::Setup(format!("timings output {last:?}: {e}")))?)
        } else {
            say(format!("no page timings: {} or {} is missing", self.script.display(), self.chromium.display()));
            None
        };
        let _ = stop.send(true);
        let _ = server.await;
        let _ = std::fs::remove_dir_all(&cache);
        Ok(DashboardReport { backend: store.backend().name(), runs, api_ms, stats_uncached_ms, minute_count_ms, page_ms })
    }
}
