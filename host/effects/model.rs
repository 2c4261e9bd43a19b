//! `model.chat`: an OpenAI-compatible chat completion
//! (`POST {base_url}/chat/completions` with `"stream": true`). Its deltas are
//! mirrored into the turn's `emit` stream as they arrive, which also
//! refreshes the heartbeat.
//!
//! Request (JSON): an OpenAI chat request; `messages` is required, `model`
//! defaults to the host's configured model, and every other field
//! (`temperature`, `max_tokens`, `tools`, …) is passed through. `stream` is
//! always set to `true`. Result:
//! `{"content": "<the whole text>", "finish_reason": "stop", "model": "…", "deltas": N, "usage": {…}}`,
//! where `deltas` is how many emits the call made (the host uses it to keep
//! stream positions right on replay) and `usage` what the provider said the
//! call used (null when it said nothing; asked for when a token limit
//! applies, see docs/flow-control.md). A call to a priced model also
//! records `"cost_usd_nanos"`, what it cost ([`super::prices`]).
//!
//! Class: keyed. A chat has no side effect beyond its cost, so a call whose
//! segment died is re-issued (with the same `Idempotency-Key`, for gateways
//! that deduplicate); the half-streamed text of the dead segment is
//! retracted from the thread log first (docs/concepts.md, "Streams and retracts").

use std::time::Duration;

use serde_json::{Map, Value};

use super::prices::Prices;
use super::{RemoteCtx, RemoteFailure, in_progress};
use crate::redact::Secret;
use super::EffectError;

/// Where `model.chat` goes. Every field documents its default.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    /// The API base, up to and including `/v1`, e.g.
    /// `http://127.0.0.1:11434/v1`. No default: without it `model.chat` is
    /// `denied`. Env: `LEASEHOLD_MODEL_BASE_URL`.
    pub base_url: String,
    /// Sent as `Authorization: Bearer …` when set. Env:
    /// `LEASEHOLD_MODEL_API_KEY`, else `OPENAI_API_KEY`. Default: none.
    /// Never printed.
    pub api_key: Option<Secret>,
    /// Used when a request names no `model`. Env: `LEASEHOLD_MODEL`.
    /// Default: `gpt-4o-mini`.
    pub default_model: String,
    /// The whole call, first byte to last. Default: 120 s.
    pub timeout: Duration,
    /// Prices per model, for budgets in dollars ([`super::prices`]); set
    /// by `serve --model-price`. Default: none.
    pub prices: Prices,
}

impl ModelConfig {
    /// The configuration from the environment, if a base URL is set there.
    pub fn from_env() -> Option<ModelConfig> {
        let base_url = std::env::var("LEASEHOLD_MODEL_BASE_URL").ok().filter(|s| !s.is_empty())?;
        Some(ModelConfig::new(base_url))
    }

    /// A configuration for `base_url` with the other fields from the
    /// environment or their defaults.
    pub fn new(base_url: impl Into<String>) -> ModelConfig {
        let env = |k: &str| std::env::var(k).ok().filter(|s| !s.is_empty());
        ModelConfig {
            base_url: base_url.into(),
            api_key: env("LEASEHOLD_MODEL_API_KEY").or_else(|| env("OPENAI_API_KEY")).map(Secret::from),
            default_model: env("LEASEHOLD_MODEL").unwrap_or_else(|| "gpt-4o-mini".to_string()),
            timeout: Duration::from_secs(120),
            prices: Prices::default(),
        }
    }
}

/// A checked chat request: the JSON body to send.
#[derive(Debug, Clone)]
pub struct ChatRequest {
    body: Map<String, Value>,
}

impl ChatRequest {
    /// The model it names (the host's default filled in).
    pub fn model(&self) -> &str {
        self.body.get("model").and_then(Value::as_str).unwrap_or_default()
    }

    /// The size of its messages as JSON: what the prompt costs, roughly.
    pub fn prompt_bytes(&self) -> usize {
        self.body.get("messages").map_or(0, |m| m.to_string().len())
    }

    /// The most tokens its answer may cost, if it says.
    pub fn max_tokens(&self) -> Option<i64> {
        ["max_tokens", "max_completion_tokens"].iter().find_map(|k| self.body.get(*k).and_then(Value::as_i64))
    }

    /// What it may cost before it goes out, as (prompt tokens, answer
    /// tokens): its prompt's bytes over four (a common rough measure) and
    /// its `max_tokens` (1,024 if it names none; the grant always sets
    /// one).
    pub fn estimate(&self) -> (i64, i64) {
        (self.prompt_bytes() as i64 / 4 + 1, self.max_tokens().unwrap_or(1024))
    }

}

/// The usage a call is charged (its budget, its token rate), from what its
/// answer reported: `total_tokens` if it is a whole number from 0 up,
/// else `prompt_tokens` plus `completion_tokens` if both are; an answer
/// that reports neither is charged its estimate (`estimate`: prompt,
/// answer), marked `"estimated": true`. A guest cannot turn usage off,
/// and a provider cannot make a call free or break the sums with a
/// negative, fractional or huge count.
pub fn charged_usage(reported: Option<&Value>, estimate: (i64, i64)) -> Value {
    // Up to 2^53: a sum of many stays exact in a double and in a bigint.
    const MOST: u64 = 1 << 53;
    let count = |k: &str| reported.and_then(|u| u.get(k)).and_then(Value::as_u64).filter(|n| *n <= MOST).map(|n| n as i64);
    let (prompt, answer) = (count("prompt_tokens"), count("completion_tokens"));
    let total = count("total_tokens").or_else(|| Some(prompt? + answer?));
    match total {
        Some(total) => {
            let mut usage = serde_json::json!({ "total_tokens": total });
            if let (Some(p), Some(c)) = (prompt, answer) {
                usage["prompt_tokens"] = p.into();
                usage["completion_tokens"] = c.into();
            }
            usage
        }
        None => serde_json::json!({
            "prompt_tokens": estimate.0.max(0), "completion_tokens": estimate.1.max(0),
            "total_tokens": estimate.0.max(0).saturating_add(estimate.1.max(0)), "estimated": true,
        }),
    }
}

/// Parses and checks a request against the host's endpoint and the
/// plugin's grant ([`super::model_grant`]). `Err` is a recorded refusal.
pub fn check(request: &str, config: Option<&ModelConfig>, grant: &crate::store::ModelGrant) -> Result<ChatRequest, EffectError> {
    let Some(config) = config else {
        return Err(EffectError::Denied(
            "model.chat: no model endpoint is configured on this host \
             (set --model-base-url or LEASEHOLD_MODEL_BASE_URL)"
                .to_string(),
        ));
    };
    let bad = |m: &str| EffectError::Failed(format!("model.chat: bad request: {m}"));
    let mut body = match serde_json::from_str::<Value>(request) {
        Ok(Value::Object(map)) => map,
        Ok(_) => return Err(bad("expected a JSON object")),
        Err(e) => return Err(bad(&e.to_string())),
    };
    match body.get("messages") {
        Some(Value::Array(m)) if !m.is_empty() => {}
        _ => return Err(bad("`messages` must be a non-empty array")),
    }
    body.entry("model").or_insert_with(|| Value::String(config.default_model.clone()));
    super::model_grant::apply(&mut body, grant)?;
    body.insert("stream".into(), Value::Bool(true));
    // The host asks for usage, whatever the guest sent: it is what the
    // call is charged (`charged_usage`).
    body.insert("stream_options".into(), serde_json::json!({ "include_usage": true }));
    Ok(ChatRequest { body })
}

/// Receives the deltas of a streaming call as they arrive. `Err` stops the
/// call at once (the lease is lost, or the emit cap is reached); the reason
/// is kept by the sink.
pub trait DeltaSink: Send {
    fn delta(&mut self, text: String) -> impl std::future::Future<Output = Result<(), ()>> + Send;
}

/// What a finished call produced.
#[derive(Debug, Default)]
struct Reply {
    content: String,
    finish_reason: Option<String>,
    model: Option<String>,
    deltas: u64,
    /// What the provider says the call used (`usage`), if it does.
    usage: Option<Value>,
}

pub async fn perform(
    req: ChatRequest,
    config: &ModelConfig,
    ctx: &RemoteCtx,
    sink: &mut impl DeltaSink,
) -> Result<String, RemoteFailure> {
    let failed = |m: String| RemoteFailure::Effect(EffectError::Failed(format!("model.chat: {m}")));
    let url = format!("{}/chat/completions", config.base_url.trim_end_matches('/'));
    let price = config.prices.get(req.model());
    let estimate = req.estimate();
    let req_model = req.model().to_string();
    // The operator's endpoint (often on the host's own network): not the
    // guests' public-only client.
    let mut builder = super::http::host_client()
        .post(&url)
        .timeout(config.timeout)
        .header("Content-Type", "application/json")
        .header("Accept", "text/event-stream")
        .header("Idempotency-Key", ctx.idempotency_key())
        .header("Leasehold-Fence", ctx.fence.to_string())
        .body(Value::Object(req.body).to_string());
    if let Some(key) = &config.api_key {
        builder = builder.bearer_auth(key.expose());
    }
    let mut response = builder.send().await.map_err(|e| failed(format!("request to {url} failed: {e}")))?;
    let status = response.status().as_u16();
    if in_progress(status, ctx) {
        return Err(RemoteFailure::InProgress(format!("HTTP {status}")));
    }
    let retry_after = super::rate::retry_after(status, response.headers());
    let streaming = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    let mut reply = Reply::default();
    let mut buf: Vec<u8> = Vec::new();
    let mut body_len = 0usize;
    let mut done = false;
    while !done {
        let Some(chunk) = response.chunk().await.map_err(|e| failed(format!("reading the response: {e}")))? else {
            break;
        };
        body_len += chunk.len();
        if body_len > ctx.max_result_bytes.saturating_mul(4) || reply.content.len() > ctx.max_result_bytes {
            return Err(failed(format!("response is over the {}-byte cap", ctx.max_result_bytes)));
        }
        buf.extend_from_slice(&chunk);
        if status >= 400 || !streaming {
            continue; // read whole below
        }
        // Server-sent events: one `data: …` line per chunk of the answer.
        while let Some(nl) = buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = buf.drain(..=nl).collect();
            let line = String::from_utf8_lossy(&line);
            let Some(data) = line.trim_end().strip_prefix("data:") else { continue };
            let data = data.trim();
            if data == "[DONE]" {
                done = true;
                break;
            }
            let event: Value =
                serde_json::from_str(data).map_err(|e| failed(format!("bad stream event {data:?}: {e}")))?;
            if let Some(err) = event.get("error") {
                return Err(failed(format!("the model returned an error: {err}")));
            }
            if let Some(m) = event["model"].as_str() {
                reply.model = Some(m.to_string());
            }
            if event["usage"].is_object() {
                reply.usage = Some(event["usage"].clone());
            }
            let choice = &event["choices"][0];
            if let Some(r) = choice["finish_reason"].as_str() {
                reply.finish_reason = Some(r.to_string());
            }
            if let Some(text) = choice["delta"]["content"].as_str().filter(|t| !t.is_empty()) {
                reply.content.push_str(text);
                reply.deltas += 1;
                if sink.delta(text.to_string()).await.is_err() {
                    return Err(failed("stopped by the host".to_string()));
                }
            }
        }
    }
    if status >= 400 {
        let body = String::from_utf8_lossy(&buf);
        let start: String = body.chars().take(300).collect();
        let error = EffectError::Failed(format!("model.chat: HTTP {status} from {url}: {start}"));
        return Err(match retry_after {
            Some(retry_after) => RemoteFailure::Throttled { error, retry_after },
            None => RemoteFailure::Effect(error),
        });
    }
    if !streaming {
        // A server that ignores `stream`: one JSON body, mirrored as one delta.
        let body: Value = serde_json::from_slice(&buf).map_err(|e| failed(format!("bad response body: {e}")))?;
        let choice = &body["choices"][0];
        let content = choice["message"]["content"].as_str().unwrap_or_default().to_string();
        reply.model = body["model"].as_str().map(str::to_string);
        reply.finish_reason = choice["finish_reason"].as_str().map(str::to_string);
        reply.usage = body.get("usage").filter(|u| u.is_object()).cloned();
        if !content.is_empty() {
            reply.deltas = 1;
            if sink.delta(content.clone()).await.is_err() {
                return Err(failed("stopped by the host".to_string()));
            }
        }
        reply.content = content;
    } else if !done {
        return Err(failed("the stream ended before `data: [DONE]`".to_string()));
    }
    let usage = charged_usage(reply.usage.as_ref(), estimate);
    if usage["estimated"] == true {
        tracing::info!(model = req_model.as_str(), "model.chat: the answer reported no usable usage; charged its estimate");
    }
    let mut result = serde_json::json!({
        "content": reply.content,
        "finish_reason": reply.finish_reason,
        "model": reply.model,
        "deltas": reply.deltas,
        "usage": usage,
    });
    if let Some(price) = price {
        result["cost_usd_nanos"] = super::prices::cost_nanos(price, Some(&result["usage"]), estimate).into();
    }
    Ok(result.to_string())
}

/// How many emits a recorded `model.chat` result made.
pub fn recorded_deltas(result: &str) -> (i64, usize) {
    let v: Value = serde_json::from_str(result).unwrap_or_default();
    let deltas = v["deltas"].as_i64().unwrap_or(0);
    let bytes = v["content"].as_str().map_or(0, str::len);
    (deltas, bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn an_answer_is_charged_its_reported_usage_or_at_least_its_estimate() {
        let est = (10, 20);
        let charged = |u: Value| charged_usage(Some(&u), est)["total_tokens"].as_i64().unwrap();
        assert_eq!(charged(json!({ "prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7 })), 7);
        assert_eq!(charged(json!({ "prompt_tokens": 3, "completion_tokens": 4 })), 7, "no total: the parts");
        assert_eq!(charged_usage(None, est), json!({ "prompt_tokens": 10, "completion_tokens": 20, "total_tokens": 30, "estimated": true }));
        for bad in [json!(null), json!({}), json!({ "total_tokens": -5 }), json!({ "total_tokens": 1.5 }), json!({ "total_tokens": "9" }),
                    json!({ "total_tokens": 1e30 }), json!({ "prompt_tokens": -1, "completion_tokens": 1 }), json!("usage")] {
            let u = charged_usage(Some(&bad), est);
            assert_eq!((u["total_tokens"].as_i64(), u["estimated"].as_bool()), (Some(30), Some(true)), "{bad} was charged {u}");
        }
    }

    #[test]
    fn the_host_asks_for_usage_whatever_the_guest_sends() {
        let config = ModelConfig::new("http://127.0.0.1:1");
        let grant = crate::store::ModelGrant { models: vec!["*".into()], max_tokens: 20 };
        for options in [json!(null), json!({ "include_usage": false }), json!(7), json!({})] {
            let request = json!({ "messages": [{ "role": "user", "content": "hi" }], "stream_options": options }).to_string();
            let checked = check(&request, Some(&config), &grant).expect("a good request");
            assert_eq!(checked.body["stream_options"], json!({ "include_usage": true }), "the guest sent {options}");
        }
    }
}
