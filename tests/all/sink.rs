//! A counting HTTP effect sink: records every request's idempotency key and
//! fence on arrival, and can hold its responses (to kill a worker while its
//! request is in flight). A JSON body with `delay_ms` is answered that much
//! later.

use std::sync::{Arc, Mutex};

use anyhow::Result;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::routing::post;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hit {
    pub key: String,
    pub fence: String,
    /// The request body, as sent.
    pub body: String,
}

#[derive(Clone)]
struct Shared {
    hits: Arc<Mutex<Vec<Hit>>>,
    open: tokio::sync::watch::Receiver<bool>,
    delay: std::time::Duration,
    /// Extra delay, uniform in [0, jitter), per request.
    jitter: std::time::Duration,
}

pub struct Sink {
    pub url: String,
    hits: Arc<Mutex<Vec<Hit>>>,
    gate: tokio::sync::watch::Sender<bool>,
    server: tokio::task::JoinHandle<()>,
}

impl Sink {
    pub async fn start() -> Result<Sink> {
        Sink::start_with_delay(std::time::Duration::ZERO).await
    }

    /// A sink that takes `delay` to answer each request.
    pub async fn start_with_delay(delay: std::time::Duration) -> Result<Sink> {
        Sink::start_with_jitter(delay, std::time::Duration::ZERO).await
    }

    /// A sink that takes `delay` plus a random part of `jitter` to answer
    /// each request: a window in which a worker can die mid-effect.
    pub async fn start_with_jitter(delay: std::time::Duration, jitter: std::time::Duration) -> Result<Sink> {
        let hits = Arc::new(Mutex::new(Vec::new()));
        let (gate, open) = tokio::sync::watch::channel(true);
        let app = axum::Router::new()
            .route("/effect", post(hit))
            .with_state(Shared { hits: hits.clone(), open, delay, jitter });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}/effect", listener.local_addr()?);
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Sink { url, hits, gate, server })
    }

    /// While held, requests are counted but not answered.
    pub fn hold(&self, held: bool) {
        let _ = self.gate.send(!held);
    }

    pub fn hits(&self) -> Vec<Hit> {
        self.hits.lock().unwrap().clone()
    }
}

impl Drop for Sink {
    fn drop(&mut self) {
        self.server.abort();
    }
}

async fn hit(State(s): State<Shared>, headers: HeaderMap, body: axum::body::Bytes) -> &'static str {
    let get = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    let body = String::from_utf8_lossy(&body).into_owned();
    // A body may ask for a slow answer: {"delay_ms": N}.
    let asked = serde_json::from_str::<serde_json::Value>(&body).ok().and_then(|b| b["delay_ms"].as_u64());
    s.hits.lock().unwrap().push(Hit { key: get("idempotency-key"), fence: get("leasehold-fence"), body });
    let mut open = s.open.clone();
    let _ = open.wait_for(|open| *open).await;
    let jitter = if s.jitter.is_zero() { std::time::Duration::ZERO } else { s.jitter.mul_f64(rand::random::<f64>()) };
    tokio::time::sleep(s.delay + jitter + std::time::Duration::from_millis(asked.unwrap_or(0))).await;
    "applied"
}
