//! The API served in process on a loopback port, and a client for it.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use leasehold::api::{ApiConfig, AppState};
use leasehold::executor::Executor;
use leasehold::pool::{PoolConfig, WorkerPool};
use leasehold::runtime::Runtime;
use serde_json::Value;
use tokio::sync::watch;

use super::{TestDb, worker};

/// The API on a test database. Dropping it stops the listener;
/// [`Server::stop`] also drains its worker pool, if it has one.
pub struct Server {
    pub base: String,
    pub http: reqwest::Client,
    token: Option<String>,
    pool: Option<WorkerPool>,
    stop: watch::Sender<bool>,
}

impl Server {
    /// The API on `db` with `rt`'s plugins and `config`, and no workers.
    pub async fn on(db: &TestDb, rt: Arc<Runtime>, config: ApiConfig) -> Result<Server> {
        let token = config.token.as_ref().map(|t| t.expose().to_string());
        let (stop, shutdown) = watch::channel(false);
        let state = AppState::new(db.store.clone(), rt, config, shutdown.clone());
        let base = super::serve_api(state, shutdown).await?;
        leasehold::effects::http::install_tls();
        Ok(Server { base, http: reqwest::Client::new(), token, pool: None, stop })
    }

    /// The API with a fresh runtime, two workers (owner `api-test`), a
    /// 64 KiB body limit and a 20 ms stream poll; `token` guards it.
    pub async fn start(db: &TestDb, token: Option<&str>) -> Result<Server> {
        Server::start_with(db, token, true, |_| {}).await
    }

    /// [`Server::start`], with `tune` applied to the API's settings, and
    /// without a worker pool unless `pool`.
    pub async fn start_with(db: &TestDb, token: Option<&str>, pool: bool, tune: impl FnOnce(&mut ApiConfig)) -> Result<Server> {
        let runtime = crate::plugins::runtime()?;
        let store = db.store.clone();
        let exec = Arc::new(Executor::new(store.clone(), runtime.clone(), worker("api-test")));
        let pool = pool.then(|| {
            WorkerPool::start(store.clone(), exec, PoolConfig { workers: 2, poll: Duration::from_millis(200), ..PoolConfig::default() })
        });
        let mut config = ApiConfig {
            token: token.map(Into::into),
            max_body_bytes: 64 << 10,
            stream_poll: Duration::from_millis(20),
            ..ApiConfig::default()
        };
        tune(&mut config);
        let mut server = Server::on(db, runtime, config).await?;
        server.pool = pool;
        Ok(server)
    }

    /// A request to `path`, with the token if there is one.
    pub fn req(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let b = self.http.request(method, format!("{}{path}", self.base));
        match &self.token {
            Some(t) => b.bearer_auth(t),
            None => b,
        }
    }

    /// Sends and returns (status, JSON body). Every answer must be JSON.
    pub async fn send(&self, b: reqwest::RequestBuilder) -> Result<(u16, Value)> {
        let resp = b.send().await?;
        let status = resp.status().as_u16();
        let text = resp.text().await?;
        let body = serde_json::from_str(&text).with_context(|| format!("{status} with a non-JSON body: {text:?}"))?;
        Ok((status, body))
    }

    pub async fn get(&self, path: &str) -> Result<(u16, Value)> {
        self.send(self.req(reqwest::Method::GET, path)).await
    }

    pub async fn post(&self, path: &str, body: Value) -> Result<(u16, Value)> {
        self.send(self.req(reqwest::Method::POST, path).json(&body)).await
    }

    pub async fn put_plugin(&self, name: &str, bytes: Vec<u8>) -> Result<(u16, Value)> {
        self.send(self.req(reqwest::Method::PUT, &format!("/v1/plugins/{name}")).body(bytes)).await
    }

    /// Waits (up to 30 s) until run `id` has `status`; returns the run.
    pub async fn wait_status(&self, id: i64, status: &str) -> Result<Value> {
        let mut last = Value::Null;
        super::eventually(&format!("run {id} never reached {status}"), async || {
            last = self.get(&format!("/v1/runs/{id}")).await?.1;
            Ok(last["status"] == status)
        })
        .await
        .with_context(|| format!("the run: {last}"))?;
        Ok(last)
    }

    /// Reads `path`'s server-sent events from `last_id` on until `until`
    /// holds for one (30 s at most), and returns their data; each event's
    /// `id` must be its `seq`.
    pub async fn read_sse(&self, path: &str, last_id: Option<i64>, until: impl FnMut(&Value) -> bool) -> Result<Vec<Value>> {
        let mut req = self.req(reqwest::Method::GET, path).header("Accept", "text/event-stream");
        if let Some(id) = last_id {
            req = req.header("Last-Event-ID", id.to_string());
        }
        let resp = req.send().await?;
        ensure!(resp.status() == 200, "{}", resp.status());
        ensure!(resp.headers()["content-type"].to_str()?.starts_with("text/event-stream"));
        let events = super::sse::read(resp, until).await?;
        for e in &events {
            ensure!(e.id == Some(e.data["seq"].to_string()), "SSE id {:?} is not the seq of {}", e.id, e.data);
        }
        Ok(events.into_iter().map(|e| e.data).collect())
    }

    /// The worker pool, taken: to stop it on its own.
    pub fn take_pool(&mut self) -> Option<WorkerPool> {
        self.pool.take()
    }

    /// Stops the listener and drains the worker pool (5 s at most).
    pub async fn stop(mut self) {
        let _ = self.stop.send(true);
        if let Some(pool) = self.pool.take() {
            pool.shutdown(Duration::from_secs(5)).await;
        }
    }
}
