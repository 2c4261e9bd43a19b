//! `http` (keyed) and `http.unkeyed`: an HTTP request to a host on the
//! plugin's allow-list.
//!
//! Request (JSON): `{"method": "POST", "url": "http://host:port/path",
//! "headers": {"name": "value"}, "body": <string or any JSON>}`; `method`
//! defaults to `GET`; a non-string `body` is sent as JSON. Result:
//! `{"status": 200, "body": "<text>"}`. A status of 400 or more is `failed`
//! with the status and the start of the body.
//!
//! Every request carries `Idempotency-Key: <run_id>:<seq>` (stable across
//! attempts) and `Leasehold-Fence: <fence>` (so the remote side can reject a
//! stale segment). `http` is *keyed*: when a segment dies with the request in
//! flight, the next segment re-issues it with the same key. `http.unkeyed`
//! is for endpoints that cannot deduplicate: it is never re-issued, and the
//! turn receives `in-doubt` instead. Redirects are not followed (they could
//! leave the allow-list). `https://` uses rustls with the system's roots.

use std::collections::BTreeMap;
use std::sync::OnceLock;
use std::time::Duration;

use serde::Deserialize;

use super::RemoteCtx;
use crate::runtime::host::EffectError;

/// How long one request may take. Default: 30 s.
pub const TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpRequest {
    #[serde(default)]
    method: Option<String>,
    url: String,
    #[serde(default)]
    headers: BTreeMap<String, String>,
    #[serde(default)]
    body: Option<serde_json::Value>,
}

/// Parses and checks a request against the plugin's allow-list
/// (`host` or `host:port` entries). `Err` is a recorded refusal.
pub fn check(name: &str, request: &str, allow: &[String]) -> Result<HttpRequest, EffectError> {
    let req: HttpRequest = serde_json::from_str(request)
        .map_err(|e| EffectError::Failed(format!("{name}: bad request: {e}")))?;
    let url = reqwest::Url::parse(&req.url)
        .map_err(|e| EffectError::Failed(format!("{name}: bad url {:?}: {e}", req.url)))?;
    if url.scheme() != "http" && url.scheme() != "https" {
        return Err(EffectError::Denied(format!(
            "{name}: only http:// and https:// URLs are allowed, not {:?}",
            url.scheme()
        )));
    }
    let host = url.host_str().unwrap_or_default();
    let with_port = format!("{host}:{}", url.port_or_known_default().unwrap_or(80));
    if !allow.iter().any(|a| a == host || *a == with_port) {
        return Err(EffectError::Denied(format!(
            "{name}: {with_port} is not on this plugin's allow-list"
        )));
    }
    Ok(req)
}

pub(crate) fn client() -> &'static reqwest::Client {
    static CLIENT: OnceLock<reqwest::Client> = OnceLock::new();
    CLIENT.get_or_init(|| {
        install_tls();
        reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .timeout(TIMEOUT)
            .build()
            .expect("building the HTTP client")
    })
}

/// Installs the process's TLS crypto provider (ring), once. Every reqwest
/// client of the process needs it before it is built.
pub fn install_tls() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // Err means another provider is already installed: fine.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

pub async fn perform(name: &str, req: HttpRequest, ctx: &RemoteCtx) -> Result<String, EffectError> {
    let failed = |m: String| EffectError::Failed(format!("{name}: {m}"));
    let method = req.method.as_deref().unwrap_or("GET").to_ascii_uppercase();
    let method = reqwest::Method::from_bytes(method.as_bytes()).map_err(|e| failed(format!("bad method: {e}")))?;
    let mut builder = client()
        .request(method, &req.url)
        .header("Idempotency-Key", ctx.idempotency_key())
        .header("Leasehold-Fence", ctx.fence.to_string());
    for (k, v) in &req.headers {
        builder = builder.header(k.as_str(), v.as_str());
    }
    builder = match req.body {
        None => builder,
        Some(serde_json::Value::String(s)) => builder.body(s),
        Some(json) => builder.header("Content-Type", "application/json").body(json.to_string()),
    };
    let mut response = builder.send().await.map_err(|e| failed(format!("request failed: {e}")))?;
    let status = response.status().as_u16();
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await.map_err(|e| failed(format!("reading the response: {e}")))? {
        body.extend_from_slice(&chunk);
        if body.len() > ctx.max_result_bytes {
            return Err(failed(format!("response is over the {}-byte cap", ctx.max_result_bytes)));
        }
    }
    let body = String::from_utf8_lossy(&body).into_owned();
    if status >= 400 {
        let start: String = body.chars().take(200).collect();
        return Err(failed(format!("HTTP {status}: {start}")));
    }
    Ok(serde_json::json!({ "status": status, "body": body }).to_string())
}
