//! `/v1/limits`: concurrency keys' limits and pauses, and the rate limits
//! of effects, keyed `http:HOST:PORT` and `model:NAME` (docs/flow-control.md).

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::{ApiError, AppState, ErrorBody, JsonBody, Params, QueryParams};
use crate::store::concurrency::{KeyLimit, check_concurrency, check_key};
use crate::store::rates::{RateLimit, check_rate_key, check_rates, is_rate_key};

/// Most keys a page of `GET /v1/limits` holds.
const MAX_PAGE: i64 = 1000;

/// A key's limit: `concurrency` and `paused` for a concurrency key,
/// `per_minute` and `tokens_per_minute` for a rate key.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SetLimit {
    /// The most of the key's runs that run at once, 1 to 1000000; null: no
    /// limit (its runs still take turns with other keys'); absent: as it
    /// is (a plugin's default limit stays the default).
    #[schema(minimum = 1, maximum = 1000000, value_type = Option<i64>)]
    #[serde(default, deserialize_with = "some_whole_number")]
    concurrency: Option<Option<i64>>,
    /// While true its runs stay queued: none is claimed, and a running one
    /// finishes its segment and then waits. Default: false.
    #[serde(default)]
    paused: Option<bool>,
    /// Rate keys: calls a minute across every run and host, spaced evenly,
    /// 1 to 6000000.
    #[schema(minimum = 1, maximum = 6000000)]
    #[serde(default, deserialize_with = "super::runs::whole_number")]
    per_minute: Option<i64>,
    /// `model:` keys: tokens a minute, reserved before a call and settled
    /// from the usage its answer reports, 1 to 1000000000.
    #[schema(minimum = 1, maximum = 1000000000)]
    #[serde(default, deserialize_with = "super::runs::whole_number")]
    tokens_per_minute: Option<i64>,
}

/// A field that may be absent (`None`), null (`Some(None)`) or a whole number.
fn some_whole_number<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Option<i64>>, D::Error> {
    super::runs::whole_number(d).map(Some)
}

/// A key's limit and state: a concurrency key's or a rate key's.
#[derive(Serialize, ToSchema)]
#[serde(untagged)]
pub enum Limit {
    Concurrency(KeyLimit),
    Rate(RateLimit),
}

impl Limit {
    fn key(&self) -> &str {
        match self {
            Limit::Concurrency(k) => &k.key,
            Limit::Rate(r) => &r.key,
        }
    }
}

#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// Keys after this one, by key (the last key of the previous page).
    #[param(max_length = 256)]
    after: Option<String>,
    /// Keys per page, 1 to 1000. Default: 100.
    #[param(minimum = 1, maximum = 1000)]
    limit: Option<i64>,
}

/// A page of keys, by key: concurrency keys and rate keys together.
#[derive(Serialize, ToSchema)]
pub struct LimitsPage {
    limits: Vec<Limit>,
    /// The `after` of the next page; null on the last.
    next: Option<String>,
}

fn key_of(key: &str) -> Result<(), ApiError> {
    if is_rate_key(key) { check_rate_key(key) } else { check_key(key) }.map_err(ApiError::bad_request)
}

/// `PUT /v1/limits/{key}` with `{"concurrency": N, "paused": false}`, or
/// for a rate key `{"per_minute": N, "tokens_per_minute": M}`.
#[utoipa::path(put, path = "/v1/limits/{key}", tag = "limits", request_body = SetLimit,
    params(("key" = String, Path, min_length = 1, max_length = 256, pattern = r"^[^\u0000-\u001f\u007f-\u009f]+$", description = "A concurrency key (1 to 256 characters, no control characters), or a rate key: `http:HOST:PORT` or `model:NAME`.")),
    responses(
        (status = 200, description = "The key with its new limit and its runs (or its rate's clocks) now.", body = Limit),
        (status = 400, description = "A bad key or limit.", body = ErrorBody),
        (status = 415, description = "The body is not said to be JSON (Content-Type: application/json).", body = ErrorBody),
    ))]
pub async fn put(
    State(s): State<AppState>,
    Params(key): Params<String>,
    JsonBody(req): JsonBody<SetLimit>,
) -> Result<Json<Limit>, ApiError> {
    key_of(&key)?;
    if is_rate_key(&key) {
        if req.concurrency.is_some() || req.paused.is_some() {
            return Err(ApiError::bad_request("a rate key takes per_minute and tokens_per_minute, not concurrency or paused"));
        }
        check_rates(&key, req.per_minute, req.tokens_per_minute).map_err(ApiError::bad_request)?;
        let rate = s.store.set_rate(&key, req.per_minute, req.tokens_per_minute).await?;
        tracing::info!(key, per_minute = ?req.per_minute, tokens_per_minute = ?req.tokens_per_minute, "rate limit set");
        return Ok(Json(Limit::Rate(rate)));
    }
    if req.per_minute.is_some() || req.tokens_per_minute.is_some() {
        return Err(ApiError::bad_request(
            "per_minute and tokens_per_minute are for rate keys (http:HOST:PORT, model:NAME); a concurrency key takes concurrency and paused",
        ));
    }
    if let Some(Some(n)) = req.concurrency {
        check_concurrency(n).map_err(ApiError::bad_request)?;
    }
    let paused = req.paused.unwrap_or(false);
    let limit = match req.concurrency {
        // Only the pause: the limit (an operator's, or a plugin's default) stays.
        None => s.store.set_paused(&key, paused).await?,
        Some(concurrency) => s.store.set_limit(&key, concurrency, paused).await?,
    };
    tracing::info!(key, concurrency = ?limit.concurrency, paused, "limit set");
    Ok(Json(Limit::Concurrency(limit)))
}

/// `GET /v1/limits/{key}`: its limit, and how many of its runs are queued
/// and running now; for a rate key, how long a call would wait now and any
/// provider's hold.
#[utoipa::path(get, path = "/v1/limits/{key}", tag = "limits",
    params(("key" = String, Path, min_length = 1, max_length = 256, pattern = r"^[^\u0000-\u001f\u007f-\u009f]+$", description = "A concurrency key (1 to 256 characters, no control characters), or a rate key: `http:HOST:PORT` or `model:NAME`.")),
    responses(
        (status = 200, description = "The key.", body = Limit),
        (status = 404, description = "The key has neither a limit nor runs (a rate key: neither a limit nor a hold).", body = ErrorBody),
    ))]
pub async fn show(State(s): State<AppState>, Params(key): Params<String>) -> Result<Json<Limit>, ApiError> {
    key_of(&key)?;
    let found = if is_rate_key(&key) {
        s.store.rate(&key).await?.map(Limit::Rate)
    } else {
        s.store.limit(&key).await?.map(Limit::Concurrency)
    };
    found.map(Json).ok_or_else(|| ApiError::not_found(format!("no key {key:?}")))
}

/// `GET /v1/limits`: the concurrency keys with a limit, paused, or with
/// runs to claim, and the rate keys, in one list by key.
#[utoipa::path(get, path = "/v1/limits", tag = "limits", params(ListQuery),
    responses((status = 200, description = "A page of keys.", body = LimitsPage)))]
pub async fn list(State(s): State<AppState>, QueryParams(q): QueryParams<ListQuery>) -> Result<Json<LimitsPage>, ApiError> {
    let limit = q.limit.unwrap_or(100);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(ApiError::bad_request(format!("limit must be between 1 and {MAX_PAGE}")));
    }
    let after = q.after.unwrap_or_default();
    if after.chars().count() > 256 {
        return Err(ApiError::bad_request("after is at most 256 characters"));
    }
    let keys = s.store.limits(&after, limit).await?;
    let rates = s.store.rates(&after, limit).await?;
    // Either table may hold more past a full page of its own.
    let more = keys.len() as i64 == limit || rates.len() as i64 == limit;
    let mut limits: Vec<Limit> = keys.into_iter().map(Limit::Concurrency).chain(rates.into_iter().map(Limit::Rate)).collect();
    limits.sort_by(|a, b| a.key().cmp(b.key()));
    limits.truncate(limit as usize);
    let next = more.then(|| limits.last().map(|l| l.key().to_string())).flatten();
    Ok(Json(LimitsPage { limits, next }))
}

/// `DELETE /v1/limits/{key}`: clears its limit and pause; for a rate key,
/// its limit and any provider's hold.
#[utoipa::path(delete, path = "/v1/limits/{key}", tag = "limits",
    params(("key" = String, Path, min_length = 1, max_length = 256, pattern = r"^[^\u0000-\u001f\u007f-\u009f]+$", description = "A concurrency key (1 to 256 characters, no control characters), or a rate key: `http:HOST:PORT` or `model:NAME`.")),
    responses(
        (status = 204, description = "Cleared: its runs are claimed without a limit."),
        (status = 404, description = "The key had no limit and was not paused (a rate key: no limit and no hold).", body = ErrorBody),
    ))]
pub async fn remove(State(s): State<AppState>, Params(key): Params<String>) -> Result<StatusCode, ApiError> {
    key_of(&key)?;
    let removed = if is_rate_key(&key) { s.store.remove_rate(&key).await? } else { s.store.remove_limit(&key).await? };
    if removed {
        tracing::info!(key, "limit removed");
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError::not_found(format!("key {key:?} has no limit")))
    }
}
