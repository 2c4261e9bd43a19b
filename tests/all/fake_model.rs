//! A fake OpenAI-compatible model server: answers `POST /v1/chat/completions`
//! with a scripted answer streamed as server-sent events, records every
//! request, and can stop mid-stream (to kill a worker while it streams).

use std::sync::{Arc, Mutex};

use anyhow::Result;
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use axum::routing::post;
use serde_json::{Value, json};

/// One request as the server saw it.
#[derive(Debug, Clone)]
pub struct ChatHit {
    pub body: Value,
    pub authorization: String,
    pub key: String,
    pub fence: String,
    /// When it arrived.
    pub at: std::time::Instant,
}

/// The answer to call number `n` (from 0), as the chunks to stream. A chunk
/// [`FAIL`] ends the stream with an error event instead.
pub type Script = Arc<dyn Fn(usize, &Value) -> Vec<String> + Send + Sync>;

#[derive(Clone)]
struct Shared {
    hits: Arc<Mutex<Vec<ChatHit>>>,
    script: Script,
    /// While the gate is closed, a stream stops after this many chunks.
    hold_after: usize,
    open: tokio::sync::watch::Receiver<bool>,
    /// Whether it reports usage when asked (a provider that never does: false).
    reports_usage: bool,
}

pub struct FakeModel {
    /// `http://127.0.0.1:<port>/v1`
    pub base_url: String,
    hits: Arc<Mutex<Vec<ChatHit>>>,
    gate: tokio::sync::watch::Sender<bool>,
    server: tokio::task::JoinHandle<()>,
}

/// What every answer says it used (`usage.total_tokens`), in a last chunk
/// of its own, when the request asks (`stream_options.include_usage`), as
/// OpenAI's API does.
pub const USAGE_TOKENS: i64 = 1000;

/// A chunk that makes the stream end with an error: the call fails after
/// the chunks before it were streamed.
pub const FAIL: &str = "\u{0}fail";

/// Answers `echo: <the last message>` in three chunks.
pub fn echo() -> Script {
    Arc::new(|_, body: &Value| {
        let said = body["messages"].as_array().and_then(|m| m.last()).map_or("", |m| {
            m["content"].as_str().unwrap_or_default()
        });
        let answer = format!("echo: {said}");
        let (a, b) = answer.split_at(answer.len() / 2);
        vec!["".to_string(), a.to_string(), b.to_string()]
    })
}

impl FakeModel {
    pub async fn start(script: Script) -> Result<FakeModel> {
        FakeModel::start_holding(script, usize::MAX).await
    }

    /// While [`FakeModel::hold`] is on, each stream pauses after
    /// `hold_after` chunks.
    pub async fn start_holding(script: Script, hold_after: usize) -> Result<FakeModel> {
        FakeModel::serve(script, hold_after, true).await
    }

    /// A provider that never reports usage, asked or not.
    pub async fn start_without_usage(script: Script) -> Result<FakeModel> {
        FakeModel::serve(script, usize::MAX, false).await
    }

    async fn serve(script: Script, hold_after: usize, reports_usage: bool) -> Result<FakeModel> {
        let hits = Arc::new(Mutex::new(Vec::new()));
        let (gate, open) = tokio::sync::watch::channel(true);
        let app = axum::Router::new()
            .route("/v1/chat/completions", post(chat))
            .with_state(Shared { hits: hits.clone(), script, hold_after, open, reports_usage });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let base_url = format!("http://{}/v1", listener.local_addr()?);
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(FakeModel { base_url, hits, gate, server })
    }

    pub fn hold(&self, held: bool) {
        let _ = self.gate.send(!held);
    }

    pub fn hits(&self) -> Vec<ChatHit> {
        self.hits.lock().unwrap().clone()
    }

    /// When each request arrived, in order.
    pub fn arrivals(&self) -> Vec<std::time::Instant> {
        let mut at: Vec<_> = self.hits.lock().unwrap().iter().map(|h| h.at).collect();
        at.sort();
        at
    }
}

impl Drop for FakeModel {
    fn drop(&mut self) {
        self.server.abort();
    }
}

fn event(data: Value) -> Result<axum::body::Bytes, std::convert::Infallible> {
    Ok(format!("data: {data}\n\n").into())
}

async fn chat(State(s): State<Shared>, headers: HeaderMap, body: String) -> Response {
    let get = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    let body: Value = serde_json::from_str(&body).unwrap_or_default();
    let n = {
        let mut hits = s.hits.lock().unwrap();
        hits.push(ChatHit {
            body: body.clone(),
            authorization: get("authorization"),
            key: get("idempotency-key"),
            fence: get("leasehold-fence"),
            at: std::time::Instant::now(),
        });
        hits.len() - 1
    };
    let chunks = (s.script)(n, &body);
    let model = body["model"].clone();
    let usage = s.reports_usage && body["stream_options"]["include_usage"].as_bool() == Some(true);
    let stream = futures::stream::unfold(0usize, move |i| {
        let (chunks, model, mut open, hold_after) = (chunks.clone(), model.clone(), s.open.clone(), s.hold_after);
        let usage = usage.then(|| {
            event(json!({
                "id": "chatcmpl-fake", "object": "chat.completion.chunk", "model": model, "choices": [],
                "usage": { "prompt_tokens": USAGE_TOKENS / 2, "completion_tokens": USAGE_TOKENS / 2, "total_tokens": USAGE_TOKENS },
            }))
        });
        async move {
            if i == hold_after {
                let _ = open.wait_for(|open| *open).await;
            }
            let chunk = |delta: Value, finish: Value| {
                event(json!({
                    "id": "chatcmpl-fake", "object": "chat.completion.chunk", "model": model,
                    "choices": [{ "index": 0, "delta": delta, "finish_reason": finish }],
                }))
            };
            match i.cmp(&chunks.len()) {
                std::cmp::Ordering::Less if chunks[i] == FAIL => {
                    Some((event(json!({ "error": { "message": "the model broke mid-answer" } })), usize::MAX - 1))
                }
                _ if i == usize::MAX - 1 => None,
                std::cmp::Ordering::Less => {
                    Some((chunk(json!({ "content": chunks[i] }), Value::Null), i + 1))
                }
                std::cmp::Ordering::Equal => Some((chunk(json!({}), json!("stop")), i + 1)),
                _ if i == chunks.len() + 1 && usage.is_some() => Some((usage.unwrap(), i + 100)),
                _ if i == chunks.len() + 1 || i == chunks.len() + 101 => Some((Ok("data: [DONE]\n\n".into()), usize::MAX - 1)),
                _ => None,
            }
        }
    });
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(Body::from_stream(stream))
        .unwrap()
}

/// A worker whose `model.chat` goes to `model` (key `sk-test`, model
/// `fake-1`), with a 30 s lease.
pub fn worker(
    db: &crate::harness::TestDb,
    rt: &Arc<leasehold::runtime::Runtime>,
    owner: &str,
    model: &FakeModel,
) -> leasehold::executor::Executor {
    priced_worker(db, rt, owner, model, Default::default())
}

/// [`worker`], with the models priced at `prices`.
pub fn priced_worker(
    db: &crate::harness::TestDb,
    rt: &Arc<leasehold::runtime::Runtime>,
    owner: &str,
    model: &FakeModel,
    prices: leasehold::effects::prices::Prices,
) -> leasehold::executor::Executor {
    use leasehold::executor::{Executor, ExecutorConfig};
    let mut config = leasehold::effects::model::ModelConfig::new(&model.base_url);
    config.prices = prices;
    config.api_key = Some("sk-test".into());
    config.default_model = "fake-1".into();
    config.timeout = std::time::Duration::from_secs(20);
    let config = ExecutorConfig {
        model: Some(Arc::new(config)),
        ..crate::harness::worker(owner)
    };
    Executor::new(db.store.clone(), rt.clone(), config)
}
