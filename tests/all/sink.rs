//! A counting HTTP effect sink: records every request's idempotency key and
//! fence on arrival, and can hold its responses (to kill a worker while its
//! request is in flight). A JSON body with `delay_ms` is answered that much
//! later. Like a deduplicating server that sees a re-issue while the first
//! request is still in progress, it can answer re-issues (fence above 1)
//! `409` a set number of times ([`Sink::conflict_reissues`]).

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
    /// When it arrived.
    pub at: std::time::Instant,
    /// Its W3C `traceparent` header (`""`: none).
    pub traceparent: String,
}

#[derive(Clone)]
struct Shared {
    hits: Arc<Mutex<Vec<Hit>>>,
    open: tokio::sync::watch::Receiver<bool>,
    delay: std::time::Duration,
    /// Extra delay, uniform in [0, jitter), per request.
    jitter: std::time::Duration,
    /// Re-issues (fence above 1) still to answer 409.
    conflicts: Arc<std::sync::atomic::AtomicU32>,
}

pub struct Sink {
    pub url: String,
    pub port: u16,
    hits: Arc<Mutex<Vec<Hit>>>,
    conflicts: Arc<std::sync::atomic::AtomicU32>,
    ip: std::net::Ipv4Addr,
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
        Sink::start_at(std::net::Ipv4Addr::LOCALHOST, delay, jitter).await
    }

    /// [`Sink::start_with_jitter`], listening on `ip` (e.g. an address
    /// other network namespaces reach).
    pub async fn start_at(ip: std::net::Ipv4Addr, delay: std::time::Duration, jitter: std::time::Duration) -> Result<Sink> {
        let hits = Arc::new(Mutex::new(Vec::new()));
        let (gate, open) = tokio::sync::watch::channel(true);
        let conflicts = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let app = axum::Router::new()
            .route("/effect", post(hit))
            .with_state(Shared { hits: hits.clone(), open, delay, jitter, conflicts: conflicts.clone() });
        let listener = tokio::net::TcpListener::bind((ip, 0)).await?;
        let port = listener.local_addr()?.port();
        let url = format!("http://{ip}:{port}/effect");
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Sink { url, port, hits, conflicts, ip, gate, server })
    }

    /// While held, requests are counted but not answered.
    pub fn hold(&self, held: bool) {
        let _ = self.gate.send(!held);
    }

    pub fn hits(&self) -> Vec<Hit> {
        self.hits.lock().unwrap().clone()
    }

    /// Answers the next `n` re-issues (fence above 1) `409 Conflict`, as a
    /// deduplicating server does while the first request with that key is
    /// still in progress.
    pub fn conflict_reissues(&self, n: u32) {
        self.conflicts.store(n, std::sync::atomic::Ordering::SeqCst);
    }

    /// The allow-list entry for this sink: `<ip>:<port>`.
    pub fn allow(&self) -> String {
        format!("{}:{}", self.ip, self.port)
    }
}

impl Drop for Sink {
    fn drop(&mut self) {
        self.server.abort();
    }
}

async fn hit(State(s): State<Shared>, headers: HeaderMap, body: axum::body::Bytes) -> (axum::http::StatusCode, &'static str) {
    let get = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    let body = String::from_utf8_lossy(&body).into_owned();
    // A body may ask for a slow answer: {"delay_ms": N}.
    let asked = serde_json::from_str::<serde_json::Value>(&body).ok().and_then(|b| b["delay_ms"].as_u64());
    let reissue = get("leasehold-fence").parse::<i64>().is_ok_and(|f| f > 1);
    s.hits.lock().unwrap().push(Hit { key: get("idempotency-key"), fence: get("leasehold-fence"), body, at: std::time::Instant::now(), traceparent: get("traceparent") });
    if reissue
        && s.conflicts.fetch_update(std::sync::atomic::Ordering::SeqCst, std::sync::atomic::Ordering::SeqCst, |n| n.checked_sub(1)).is_ok()
    {
        return (axum::http::StatusCode::CONFLICT, "in progress");
    }
    let mut open = s.open.clone();
    let _ = open.wait_for(|open| *open).await;
    let jitter = if s.jitter.is_zero() { std::time::Duration::ZERO } else { s.jitter.mul_f64(rand::random::<f64>()) };
    tokio::time::sleep(s.delay + jitter + std::time::Duration::from_millis(asked.unwrap_or(0))).await;
    (axum::http::StatusCode::OK, "applied")
}
