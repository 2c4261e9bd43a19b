//! The HTTP API (docs/api.md), on axum. JSON in and out; every error is
//! `{"error": {"code", "message"}}`. See the README for the endpoint table.
//!
//! Every `/v1` route and `/metrics` need `Authorization: Bearer <token>`
//! when a token is configured (`leasehold serve` configures one by
//! default). Bodies are capped (JSON: 1 MiB by default, components: 64 MiB)
//! and requests time out (30 s by default; event streams are exempt).
//!
//! The front door, for callers the operator did not choose (another web
//! page in the operator's browser, a DNS-rebinding page): a `POST` must say
//! `Content-Type: application/json` (415 otherwise), which a cross-site
//! form or simple request cannot without a preflight, and no CORS headers
//! are ever sent; the `Host` header must be an IP address, `localhost` or
//! a configured name (421 otherwise), since a rebinding page's own name is
//! none of those.

mod answers;
mod budget;
mod children;
mod segments;
mod dashboard;
mod error;
mod events;
mod history;
mod limits;
pub mod listener;
mod metrics;
mod openapi;
mod overview;
mod pause;
mod plugins;
mod rerun;
mod resolve;
mod runs;
mod schedules;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, FromRequest, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, patch, post, put};
use serde::de::DeserializeOwned;
use tokio::sync::watch;

pub use self::error::{ApiError, ErrorBody, ErrorDetail};
pub use self::openapi::ApiDoc;
use crate::redact::Secret;
use crate::runtime::Runtime;
use crate::store::Store;

/// API settings. Every field documents its default.
#[derive(Debug, Clone)]
pub struct ApiConfig {
    /// Required as `Authorization: Bearer …` on `/v1` and `/metrics` when
    /// set. Default: none. Never printed.
    pub token: Option<Secret>,
    /// Names (`name` or `name:port`) the `Host` header may carry besides IP
    /// addresses and `localhost`: the names clients reach this API by (a
    /// reverse proxy's). Default: none.
    pub allowed_hosts: Vec<String>,
    /// Largest JSON body. Default: 1 MiB.
    pub max_body_bytes: usize,
    /// Largest component upload. Default: 64 MiB.
    pub max_component_bytes: usize,
    /// Per-request timeout (not for event streams). Default: 30 s.
    pub request_timeout: Duration,
    /// How often the host looks for events other hosts wrote to the
    /// threads its event streams watch (one query for all of them; its
    /// own writes wake them at once). Default: 500 ms.
    pub stream_poll: Duration,
    /// Event streams open at once; one more is refused with 503 and
    /// `Retry-After`. Default: 256.
    pub max_streams: usize,
    /// Bytes of rows one list, ledger or events page carries (at least one
    /// row); past it the page ends early with a cursor. Default: 1 MiB.
    pub max_page_bytes: i64,
    /// How long `/metrics` reuses the gauges it read from the database
    /// (runs by status, ledger rows by state); counters are always live.
    /// Default: 10 s.
    pub metrics_ttl: Duration,
    /// Plugin uploads compiling at once; one more is refused with 503 and
    /// `Retry-After`. Default: 2.
    pub max_uploads: usize,
    /// How long `/healthz`, which needs no token, reuses its last look at
    /// the database: anyone may call it, and a crowd of callers then costs
    /// one query a period, not one each. Default: 1 s.
    pub health_ttl: Duration,
    /// Answer-link requests (`/v1/answers/…`, which need no token) a
    /// second over all links; past it, 429 with `Retry-After`. Default: 10.
    pub answers_per_second: u32,
    /// Answer-link requests taken at once after a quiet spell. Default: 50.
    pub answers_burst: u32,
    /// Reruns replaying their prefix at once (each replays a ledger
    /// offline, in the request); one more is refused with 503 and
    /// `Retry-After`. Default: 2.
    pub max_replays: usize,
    /// Schedules at most; a create past it is refused (409). Default: 10,000.
    pub max_schedules: usize,
    /// Times one backfill may hold. Default: 1,000.
    pub max_backfill_ticks: usize,
    /// How long finished runs and tick records are kept (`--retention`;
    /// zero: forever): a backfill reaches back no further. Default: 7 days.
    pub retention: Duration,
}

impl Default for ApiConfig {
    fn default() -> Self {
        ApiConfig {
            token: None,
            max_body_bytes: 1 << 20,
            max_component_bytes: 64 << 20,
            request_timeout: Duration::from_secs(30),
            stream_poll: Duration::from_millis(500),
            max_streams: 256,
            max_page_bytes: 1 << 20,
            metrics_ttl: Duration::from_secs(10),
            max_uploads: 2,
            health_ttl: Duration::from_secs(1),
            answers_per_second: 10,
            answers_burst: 50,
            max_replays: 2,
            max_schedules: 10_000,
            max_backfill_ticks: 1_000,
            retention: Duration::from_secs(7 * 86_400),
            allowed_hosts: Vec::new(),
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
    /// Event streams open ([`ApiConfig::max_streams`]).
    pub(crate) streams: Arc<tokio::sync::Semaphore>,
    /// Plugin uploads compiling ([`ApiConfig::max_uploads`]).
    pub(crate) uploads: Arc<tokio::sync::Semaphore>,
    /// Reruns replaying their prefix ([`ApiConfig::max_replays`]).
    pub(crate) replays: Arc<tokio::sync::Semaphore>,
    /// Backfills running: one at a time on a host.
    pub(crate) backfills: Arc<tokio::sync::Semaphore>,
    /// Answer-link requests' rate ([`ApiConfig::answers_per_second`]).
    pub(crate) answers: Arc<answers::Bucket>,
    /// The database's gauges, shared by `/metrics` (read again past
    /// [`ApiConfig::metrics_ttl`]) and `/v1/stats` (past 2 s).
    pub(crate) gauges: Arc<tokio::sync::Mutex<Option<(std::time::Instant, crate::store::Gauges)>>>,
    /// `/healthz`'s last look at the database: when, and the database's
    /// time then or why it did not answer ([`ApiConfig::health_ttl`]).
    pub(crate) health: Arc<tokio::sync::Mutex<Option<HealthLook>>>,
}

/// When `/healthz` last looked at the database, and the database's time
/// then (epoch ms) or why it did not answer.
pub(crate) type HealthLook = (std::time::Instant, Result<i64, String>);

impl AppState {
    pub fn new(store: Store, runtime: Arc<Runtime>, config: ApiConfig, shutdown: watch::Receiver<bool>) -> AppState {
        AppState {
            store,
            runtime,
            streams: Arc::new(tokio::sync::Semaphore::new(config.max_streams)),
            uploads: Arc::new(tokio::sync::Semaphore::new(config.max_uploads.max(1))),
            replays: Arc::new(tokio::sync::Semaphore::new(config.max_replays.max(1))),
            backfills: Arc::new(tokio::sync::Semaphore::new(1)),
            answers: Arc::new(answers::Bucket::new(config.answers_per_second, config.answers_burst)),
            config: Arc::new(config),
            shutdown,
            gauges: Arc::default(),
            health: Arc::default(),
        }
    }
}

/// The API's router. Also starts the task that looks for other hosts'
/// events on the threads this host's streams watch, until shutdown.
pub fn router(state: AppState) -> Router {
    let config = state.config.clone();
    tokio::spawn(events::watch_other_hosts(state.store.clone(), config.stream_poll, state.shutdown.clone()));
    let timed = Router::new()
        .route("/v1/plugins", get(plugins::list))
        .route(
            "/v1/plugins/{name}",
            put(plugins::put).layer(DefaultBodyLimit::max(config.max_component_bytes)).get(plugins::show),
        )
        .route("/v1/runs", json_post(runs::submit).get(runs::list))
        .route("/v1/runs:batch", json_post(runs::submit_batch))
        .route("/v1/runs/{id}", get(runs::show))
        .route("/v1/runs/{id}/input", json_post(runs::input))
        .route("/v1/runs/{id}/cancel", json_post(runs::cancel))
        .route("/v1/runs/{id}/effects", get(runs::effects))
        .route("/v1/runs/{id}/children", get(children::children))
        .route("/v1/runs/{id}/segments", get(segments::segments))
        .route("/v1/runs/{id}/budget", json_post(budget::set).get(budget::show))
        .route("/v1/runs/{id}/effects/{seq}/resolve", json_post(resolve::resolve))
        .route("/v1/runs/{id}/rerun", json_post(rerun::rerun))
        .route("/v1/runs/{id}/pause", json_post(pause::pause))
        .route("/v1/runs/{id}/resume", json_post(pause::resume))
        .route("/v1/schedules", json_post(schedules::create).get(schedules::list))
        .route("/v1/schedules/{id}", json_patch(schedules::change).get(schedules::show).delete(schedules::remove))
        .route("/v1/schedules/{id}/backfill", json_post(schedules::backfill))
        .route("/v1/schedules/{id}/ticks", get(schedules::ticks))
        .route("/v1/limits", get(limits::list))
        .route("/v1/limits/{key}", json_put(limits::put).get(limits::show).delete(limits::remove))
        .route("/v1/stats", get(overview::stats))
        .route("/v1/stats/history", get(history::history))
        .route("/v1/leases", get(overview::leases))
        .layer(middleware::from_fn_with_state(state.clone(), timeout));
    Router::new()
        .merge(timed)
        .route("/v1/threads/{id}/events", get(events::events))
        .route("/metrics", get(metrics::metrics))
        .layer(middleware::from_fn_with_state(state.clone(), auth))
        // The link's own token is its credential (see `answers`). Anyone
        // with the link may call it: it gets the request timeout too.
        .merge(
            Router::new()
                .route("/v1/answers/{token}", json_post(answers::answer).get(answers::page))
                .layer(middleware::from_fn_with_state(state.clone(), answers::gate))
                .layer(middleware::from_fn_with_state(state.clone(), timeout)),
        )
        .route("/healthz", get(healthz))
        .route("/v1/openapi.json", get(openapi::openapi))
        .merge(dashboard::router())
        .fallback(|| async { ApiError::not_found("no such endpoint") })
        .method_not_allowed_fallback(|| async {
            ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", "method not allowed here")
        })
        .layer(middleware::from_fn_with_state(state.clone(), front_door))
        .layer(DefaultBodyLimit::max(config.max_body_bytes))
        .with_state(state)
}

/// Refuses what another web page could send (see the module's doc): a
/// `Host` that names neither an IP address, `localhost` nor a configured
/// name (421). A `POST` without a JSON content type is refused by
/// [`json_post`], once the path and method are known to exist (so a wrong
/// method is a 405 and a missing token a 401, whatever its content type).
async fn front_door(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let host = req.headers().get(header::HOST).and_then(|v| v.to_str().ok()).or_else(|| req.uri().host());
    match host {
        None => return ApiError::bad_request("the request has no Host header").into_response(),
        Some(host) if !host_allowed(host, &state.config.allowed_hosts) => {
            return ApiError::new(
                StatusCode::MISDIRECTED_REQUEST,
                "misdirected",
                format!(
                    "this API does not answer to the name {host:?}: use its IP address or localhost, \
                     or add the name with --allowed-host"
                ),
            )
            .into_response();
        }
        Some(_) => {}
    }
    next.run(req).await
}

/// Whether a `Host` header (`name`, `name:port`, `[v6]:port`) names this
/// API: an IP address (a DNS-rebinding page can only use a name),
/// `localhost`, or one of `allowed` (with or without its port).
pub fn host_allowed(host: &str, allowed: &[String]) -> bool {
    let name = match host.strip_prefix('[') {
        Some(v6) => return v6.split_once(']').is_some_and(|(ip, _)| ip.parse::<std::net::Ipv6Addr>().is_ok()),
        None => host.rsplit_once(':').filter(|(_, p)| p.parse::<u16>().is_ok()).map_or(host, |(n, _)| n),
    };
    name.parse::<std::net::Ipv4Addr>().is_ok()
        || name.eq_ignore_ascii_case("localhost")
        || allowed.iter().any(|a| a.eq_ignore_ascii_case(host) || a.eq_ignore_ascii_case(name))
}

/// `POST` of `handler`, refused with 415 unless the request says
/// `Content-Type: application/json`: a cross-site form or simple request
/// cannot say that without a preflight, which gets no CORS headers.
fn json_post<H, T>(handler: H) -> axum::routing::MethodRouter<AppState>
where
    H: axum::handler::Handler<T, AppState>,
    T: 'static,
{
    post(handler).layer(middleware::from_fn(require_json))
}

/// [`json_post`] for `PATCH`.
fn json_patch<H, T>(handler: H) -> axum::routing::MethodRouter<AppState>
where
    H: axum::handler::Handler<T, AppState>,
    T: 'static,
{
    patch(handler).layer(middleware::from_fn(require_json))
}

/// [`json_post`] for `PUT`.
fn json_put<H, T>(handler: H) -> axum::routing::MethodRouter<AppState>
where
    H: axum::handler::Handler<T, AppState>,
    T: 'static,
{
    put(handler).layer(middleware::from_fn(require_json))
}

async fn require_json(req: Request, next: Next) -> Response {
    let json = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"));
    if !json {
        return ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "a request with a body must have Content-Type: application/json",
        )
        .into_response();
    }
    next.run(req).await
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
        if !given.is_some_and(|g| constant_time_eq(g.as_bytes(), token.expose().as_bytes())) {
            let message = if given.is_some() {
                "wrong bearer token"
            } else {
                "this API needs a token: send Authorization: Bearer <token> (leasehold serve wrote it to its token file)"
            };
            return ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", message).into_response();
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

/// `GET /healthz`: 200 while the database answers. Needs no token, so it
/// looks at the database at most once a `health_ttl` (1 s) however many
/// call it; `checked_at` is the database's time (epoch ms) of that look.
#[utoipa::path(get, path = "/healthz", tag = "service", security(()),
    responses(
        (status = 200, description = "The database answers.", body = Object, example = json!({"status": "ok", "checked_at": 1764900000000_i64})),
        (status = 503, description = "The database does not answer.", body = ErrorBody),
    ))]
pub(crate) async fn healthz(State(state): State<AppState>) -> Response {
    // Callers that come while a look is in flight wait for it.
    let mut last = state.health.lock().await;
    let fresh = last.as_ref().is_some_and(|(at, _)| at.elapsed() < state.config.health_ttl);
    if !fresh {
        let looked = state.store.now_ms().await.map_err(|e| e.to_string());
        *last = Some((std::time::Instant::now(), looked));
    }
    match last.as_ref().map(|(_, r)| r.clone()) {
        Some(Ok(at)) => (StatusCode::OK, axum::Json(serde_json::json!({ "status": "ok", "checked_at": at }))).into_response(),
        Some(Err(e)) => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "database_unavailable", e).into_response(),
        None => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "database_unavailable", "not checked yet").into_response(),
    }
}

/// A 503 that says when to try again.
pub(crate) fn busy(message: impl Into<String>) -> Response {
    ApiError::busy(message).into_response()
}

/// A JSON body whose errors are API errors: 400 for malformed JSON or a
/// wrong shape, 413 for a body over the limit. Every body of this API is
/// an object: an array is refused though serde would read one as a
/// struct's fields in order (`[1, null]` for `{"concurrency": 1}`).
pub struct JsonBody<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let bytes = body_bytes(req, state).await?;
        if bytes.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'[') {
            return Err(ApiError::bad_request("invalid JSON body: expected a JSON object, got an array"));
        }
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
