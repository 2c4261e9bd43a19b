//! The HTTP API (DESIGN.md §7), on axum. JSON in and out; every error is
//! `{"error": {"code", "message"}}`. See the README for the endpoint table.
//!
//! Every `/v1` route needs `Authorization: Bearer <token>` when a token is
//! configured. Bodies are capped (JSON: 1 MiB by default, components: 64 MiB)
//! and requests time out (30 s by default; event streams are exempt).

mod error;
mod events;
mod plugins;
mod runs;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, FromRequest, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use serde::de::DeserializeOwned;
use tokio::sync::watch;

pub use self::error::ApiError;
use crate::runtime::Runtime;
use crate::store::Store;

/// API settings. Every field documents its default.
#[derive(Debug, Clone)]
pub struct ApiConfig {
    /// Required as `Authorization: Bearer …` on `/v1` when set. Default: none.
    pub token: Option<String>,
    /// Largest JSON body. Default: 1 MiB.
    pub max_body_bytes: usize,
    /// Largest component upload. Default: 64 MiB.
    pub max_component_bytes: usize,
    /// Per-request timeout (not for event streams). Default: 30 s.
    pub request_timeout: Duration,
    /// How often an event stream looks for events written by other hosts.
    /// Default: 250 ms.
    pub stream_poll: Duration,
}

impl Default for ApiConfig {
    fn default() -> Self {
        ApiConfig {
            token: None,
            max_body_bytes: 1 << 20,
            max_component_bytes: 64 << 20,
            request_timeout: Duration::from_secs(30),
            stream_poll: Duration::from_millis(250),
        }
    }
}

#[derive(Clone)]
pub struct AppState {
    pub store: Store,
    pub runtime: Arc<Runtime>,
    pub config: Arc<ApiConfig>,
    /// Turns true at shutdown: event streams end.
    pub shutdown: watch::Receiver<bool>,
}

pub fn router(state: AppState) -> Router {
    let config = state.config.clone();
    let timed = Router::new()
        .route("/v1/plugins", get(plugins::list))
        .route(
            "/v1/plugins/{name}",
            put(plugins::put).layer(DefaultBodyLimit::max(config.max_component_bytes)),
        )
        .route("/v1/runs", post(runs::submit).get(runs::list))
        .route("/v1/runs/{id}", get(runs::show))
        .route("/v1/runs/{id}/input", post(runs::input))
        .route("/v1/runs/{id}/cancel", post(runs::cancel))
        .route("/v1/runs/{id}/effects", get(runs::effects))
        .layer(middleware::from_fn_with_state(state.clone(), timeout));
    Router::new()
        .merge(timed)
        .route("/v1/threads/{id}/events", get(events::events))
        .layer(middleware::from_fn_with_state(state.clone(), auth))
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .fallback(|| async { ApiError::not_found("no such endpoint") })
        .method_not_allowed_fallback(|| async {
            ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", "method not allowed here")
        })
        .layer(DefaultBodyLimit::max(config.max_body_bytes))
        .with_state(state)
}

async fn auth(State(state): State<AppState>, req: Request, next: Next) -> Response {
    crate::metrics::global().http_requests.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    if let Some(token) = &state.config.token {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        // Constant-time compare: the token must not leak through timing.
        if !given.is_some_and(|g| constant_time_eq(g.as_bytes(), token.as_bytes())) {
            return ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", "missing or wrong bearer token")
                .into_response();
        }
    }
    next.run(req).await
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn timeout(State(state): State<AppState>, req: Request, next: Next) -> Response {
    match tokio::time::timeout(state.config.request_timeout, next.run(req)).await {
        Ok(r) => r,
        Err(_) => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "timeout", "the request timed out").into_response(),
    }
}

async fn healthz(State(state): State<AppState>) -> Response {
    match state.store.now_ms().await {
        Ok(_) => (StatusCode::OK, axum::Json(serde_json::json!({ "status": "ok" }))).into_response(),
        Err(e) => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "database_unavailable", e.to_string()).into_response(),
    }
}

async fn metrics(State(state): State<AppState>) -> Result<Response, ApiError> {
    let text = crate::metrics::global().render(&state.store).await?;
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response())
}

/// A JSON body whose errors are API errors: 400 for malformed JSON or a
/// wrong shape, 413 for a body over the limit.
pub struct JsonBody<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let bytes = body_bytes(req, state).await?;
        serde_json::from_slice(&bytes)
            .map(JsonBody)
            .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))
    }
}

/// The raw body, with a 413 over the limit.
pub async fn body_bytes<S: Send + Sync>(req: Request, state: &S) -> Result<Bytes, ApiError> {
    Bytes::from_request(req, state).await.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "too_large", e.body_text())
        } else {
            ApiError::bad_request(e.body_text())
        }
    })
}

/// Path and query parameters whose errors are 400s with a JSON body.
pub struct Params<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send> axum::extract::FromRequestParts<S> for Params<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut axum::http::request::Parts, state: &S) -> Result<Self, ApiError> {
        axum::extract::Path::<T>::from_request_parts(parts, state)
            .await
            .map(|p| Params(p.0))
            .map_err(|e| ApiError::bad_request(e.body_text()))
    }
}

/// Query parameters whose errors are 400s with a JSON body.
pub struct QueryParams<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send> axum::extract::FromRequestParts<S> for QueryParams<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut axum::http::request::Parts, state: &S) -> Result<Self, ApiError> {
        axum::extract::Query::<T>::from_request_parts(parts, state)
            .await
            .map(|q| QueryParams(q.0))
            .map_err(|e| ApiError::bad_request(e.body_text()))
    }
}
